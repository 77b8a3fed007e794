"""`latentkv generate`: one prompt in, text and a stats line out.

With `--session NAME` the conversation is kept in a KV file: a later run whose prompt starts with
the saved tokens prefills only the rest. A turn ends by saving the rows the cache holds: the
prompt and every generated token but the last (sampled, never fed back). The next prompt should
therefore repeat this run's prompt and output, then add to them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from latentkv.commands.common import (
    add_cluster_arguments,
    add_model_arguments,
    add_sampling_arguments,
    add_speculative_arguments,
    check_speculative,
    check_text,
    describe_tier,
    draft_tokens,
    engine_config,
    parse_ids,
    run_as_worker,
    sampling_params,
    speculative_config,
)
from latentkv.commands.session import add_session_arguments, check_name
from latentkv.config import check_tokens
from latentkv.engine.request import context_problem
from latentkv.errors import UserError
from latentkv.runtime import device_cache_line, experts_line, load


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs the model's tokenizer.json)")
    prompt.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default: 64)")
    add_sampling_arguments(p)
    add_speculative_arguments(p)
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument(
        "--json-schema",
        metavar="FILE",
        help="constrain the output to instances of this JSON Schema (structured output; needs tokenizer.json)",
    )
    add_session_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_cluster_arguments(p)


def run(args: argparse.Namespace) -> int:
    if (status := run_as_worker(args)) is not None:
        return status
    if args.session is not None:
        check_name(args.session)  # before the weights load
    check_tokens("--max-tokens", args.max_tokens, low=0)
    sampling = sampling_params(args)
    if args.prompt is not None:
        check_text(args.prompt, "--prompt")  # before the weights load
    engine = engine_config(args)
    args.speculative_config = speculative_config(args, args.model)  # refused before the weights load
    grammar = _json_schema(args)  # a bad file or schema is refused before the weights load
    loaded = load(args.model, engine, quiet=args.json, draft_tokens=draft_tokens(args.speculative_config))
    model, tokenizer = loaded.model, loaded.tokenizer
    check_speculative(model, args.speculative_config)
    if args.prompt is not None:
        if tokenizer is None:
            raise UserError(f"{loaded.directory} has no tokenizer.json; use --prompt-ids")
        prompt = tokenizer.encode(args.prompt)
    else:
        prompt = parse_ids(args.prompt_ids)
    if problem := context_problem(
        len(prompt), args.max_tokens, model.cfg.max_position_embeddings, "--max-tokens"
    ):
        raise UserError(problem)  # as the server answers a request that does not fit
    args.constraint = _constraint(grammar, loaded)
    conv = _open_session(args, loaded)
    try:
        return _generate(
            args,
            model,
            tokenizer,
            prompt,
            sampling,
            loaded.tier,
            conv,
            loaded.streamer,
            loaded.cluster,
            loaded.device_cache,
        )
    finally:
        if conv is not None:
            conv.close()
        loaded.close()


def _json_schema(args: argparse.Namespace):
    """--json-schema FILE as a checked GrammarSpec (None without the flag); UserError names what
    is wrong with the file or the schema."""
    if args.json_schema is None:
        return None
    from latentkv.engine.grammar import GrammarError, GrammarSpec, check_grammar

    if args.speculative_config is not None:
        raise UserError("--json-schema cannot be combined with --speculative")
    try:
        schema = json.loads(Path(args.json_schema).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"--json-schema {args.json_schema}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"--json-schema {args.json_schema}: not a JSON file ({exc})") from None
    if not isinstance(schema, (dict, bool)):
        raise UserError(f"--json-schema {args.json_schema}: a JSON Schema is an object (or true/false)")
    spec = GrammarSpec.json_schema(schema)
    try:
        check_grammar(spec)
    except GrammarError as exc:
        raise UserError(f"--json-schema {args.json_schema}: {exc}") from None
    return spec


def _constraint(spec, loaded):
    if spec is None:
        return None
    from latentkv.engine.grammar import Grammars
    from latentkv.runtime import stop_ids

    path = loaded.directory / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{loaded.directory} has no tokenizer.json: --json-schema needs one")
    grammars = Grammars(path, loaded.model.cfg.vocab_size, stop_ids(loaded.model.cfg, loaded.directory))
    return grammars.constraint(spec)


def _open_session(args: argparse.Namespace, loaded):
    if args.session is None:
        return None
    from latentkv.commands.session import Conversation

    conv = Conversation.open(args.session, args.kv_dir, loaded)
    conv.print_notes()
    return conv


def _generate(
    args,
    model,
    tokenizer,
    prompt: list[int],
    sampling,
    tier,
    conv,
    streamer=None,
    cluster=None,
    device_cache=None,
) -> int:
    from latentkv.engine.generate import GenerationStats, stream_generate

    cache = conv.cache if conv is not None else model.make_cache(tier)
    todo = conv.begin_turn(prompt) if conv is not None else prompt
    stats = GenerationStats()
    tokens, pieces = [], []
    try:
        stop = () if args.ignore_eos else None
        for token, delta, _ in stream_generate(
            model,
            todo,
            args.max_tokens,
            sampling,
            tokenizer,
            cache=cache,
            stop_ids=stop,
            stats=stats,
            speculative=args.speculative_config,
            constraint=args.constraint,
        ):
            tokens.append(token)
            pieces.append(delta)
            if not args.json:
                sys.stdout.write(delta if tokenizer else f"{token} ")
                sys.stdout.flush()
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if conv is not None:
        conv.end_turn(prompt + tokens)
    if args.json:
        out = {
            "model": args.model,
            "prompt_ids": prompt,
            "tokens": tokens,
            "text": "".join(pieces) if tokenizer else None,
            "stats": stats.as_dict(),
            "kv": kv_report(model, cache),
        }
        if conv is not None:
            out["stats"].update(
                resumed_tokens=conv.resumed_tokens, resume_seconds=round(conv.resume_seconds, 6)
            )
            out["session"] = conv.report()
        if streamer is not None:
            out["experts"] = streamer.snapshot()
        if device_cache is not None:
            out["device_experts"] = device_cache.snapshot()
        if cluster is not None:
            out["cluster"] = cluster.report(streamer)
        print(json.dumps(out, indent=1))
    else:
        print()
        line = stats.line()
        if conv is not None:
            line = f"{conv.resume_line()} | {line} | saved: {conv.saved_tokens} tokens to {conv.path}"
        print(line, file=sys.stderr)
        print(f"KV tier: {describe_tier(cache.tier)}", file=sys.stderr)
        if streamer is not None and cluster is None:
            print(experts_line(streamer), file=sys.stderr)
        if device_cache is not None:
            print(device_cache_line(device_cache), file=sys.stderr)
        if cluster is not None:
            from latentkv.cluster.head import describe

            for line in describe(cluster.report(streamer)):
                print(line, file=sys.stderr)
    return 0


def kv_report(model, cache) -> dict:
    """KV sizes per token of the cache in use: ours, the indexer keys, what a per-head K/V cache
    would hold, and the codec parameters (everything that changes the bytes)."""
    cfg = model.cfg
    per_layer = cache.tier.bytes_per_token_layer
    expanded = cfg.expanded_kv_values_per_token_layer() * 4
    return {
        "kv_cache_dtype": cache.tier.name,
        "codec": cache.tier.codec_params(),
        "bytes_per_token_per_layer": per_layer,
        "bytes_per_token": per_layer * cfg.num_layers,
        "index_bytes_per_token": cache.layout.index_bytes_per_token,
        "expanded_per_head_kv_bytes_per_token_per_layer": expanded,
        "smaller_than_expanded": round(expanded / per_layer, 2),
    }

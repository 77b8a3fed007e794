"""lm-evaluation-harness in process: `--model latentkv`, registered in lm_eval's model registry.

    python -m latentkv.eval.harness --model latentkv \\
        --model_args pretrained=MODEL,kv_cache_dtype=q4s,weight_dtype=int8 --tasks hellaswag

(the same flags as `lm_eval`; this module registers the model, then runs lm_eval's own CLI), or
from Python after `import latentkv.eval.harness`: `lm_eval.simple_evaluate(model="latentkv", ...)`.
lm_eval 0.4.13 discovers no plugins, so the plain `lm_eval` command does not see the name
until this module is imported.

It scores exactly as the server path that `lm_eval --model local-completions` drives
(echo + logprobs, docs/server.md): each request's tokens (context + continuation, the last
max_length kept) go through one `Model.forward` with every position's logits on an empty cache
of the chosen KV tier, and `engine.logprobs.prompt_logprobs` -- the function the scheduler
answers echo requests with -- gives each token's float32 logprob; the continuation's are summed
in Python in the same order, and is_greedy compares each with the top-1 logprob as lm_eval does.
`generate_until` runs greedy requests through the engine's Scheduler (continuous batching,
`batch_size` sequences at once) and cuts each text at its first stop string.

model_args: pretrained (MODEL: a directory or builtin:NAME), kv_cache_dtype, kv_group_size,
kv_seed, weight_dtype, expert_dtype, ram_gb, threads, max_length (default: the model's context),
max_gen_toks (256); batch_size comes from `--batch_size`.
"""

from __future__ import annotations

import sys

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from latentkv.config import CacheConfig, EngineConfig
from latentkv.engine.logprobs import prompt_logprobs

DEFAULT_MAX_GEN_TOKS = 256


def _engine_config(args: dict) -> EngineConfig:
    cache_kwargs = {"kv_cache_dtype": str(args.get("kv_cache_dtype", "f32"))}
    if "kv_group_size" in args:
        cache_kwargs["group_size"] = int(args["kv_group_size"])
    if "kv_seed" in args:
        cache_kwargs["rotation_seed"] = int(args["kv_seed"])
    return EngineConfig(
        weight_dtype=str(args.get("weight_dtype", "f32")),
        expert_dtype=args.get("expert_dtype"),
        threads=int(args["threads"]) if "threads" in args else None,
        ram_gb=float(args["ram_gb"]) if "ram_gb" in args else None,
        cache=CacheConfig(**cache_kwargs),
    )


KNOWN_ARGS = (
    "pretrained",
    "kv_cache_dtype",
    "kv_group_size",
    "kv_seed",
    "weight_dtype",
    "expert_dtype",
    "ram_gb",
    "threads",
    "max_length",
    "max_gen_toks",
    "batch_size",
    "max_batch_size",
    "device",
)


@register_model("latentkv")
class LatentKVLM(TemplateLM):
    """latentkv's engine as an lm_eval model (causal, tokens without special tokens added)."""

    backend = "causal"

    def __init__(self, pretrained: str = "builtin:fixture", batch_size: int | str = 1, **kwargs):
        super().__init__()
        from latentkv.runtime import load, stop_ids

        unknown = sorted(set(kwargs) - set(KNOWN_ARGS))
        if unknown:
            raise ValueError(f"unknown model_args {unknown}; valid: {', '.join(KNOWN_ARGS)}")
        self.engine = _engine_config(kwargs)
        self.batch_size = max(1, int(batch_size)) if str(batch_size).isdigit() else 1
        context = None
        self._max_length = int(kwargs["max_length"]) if "max_length" in kwargs else None
        self.max_gen_toks = int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
        self.loaded = load(
            pretrained, self.engine, max_model_len=self._max_length, max_num_seqs=self.batch_size
        )
        if self.loaded.tokenizer is None:
            raise ValueError(f"{pretrained} has no tokenizer.json: lm_eval's tasks are text")
        self.model, self.tok = self.loaded.model, self.loaded.tokenizer
        cfg = self.model.cfg
        context = cfg.max_position_embeddings
        if self._max_length is None or self._max_length > context:
            self._max_length = context
        self.stop_ids = stop_ids(cfg, self.loaded.directory)
        self._scheduler = None

    # --- what lm_eval asks of a model -------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        cfg = self.model.cfg
        return cfg.eos_token_ids[0] if cfg.eos_token_ids else self.stop_ids[0]

    @property
    def prefix_token_id(self) -> int:
        bos = self.model.cfg.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(self.loaded.directory)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string, add_special_tokens=bool(add_special_tokens))

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens, skip_special_tokens=True)

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        out = []
        for key, context_enc, continuation_enc in requests:
            result = self.score(context_enc, continuation_enc)
            out.append(result)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return out

    def score(self, context_enc: list[int], continuation_enc: list[int]) -> tuple[float, bool]:
        """(sum of the continuation's logprobs, whether each was the top-1), as the server path
        computes it: the last max_length tokens, the context's start cut if they are too many."""
        whole = context_enc + continuation_enc
        ids = whole[-self.max_length :]
        ctxlen = len(context_enc) - max(0, len(whole) - self.max_length)
        with torch.inference_mode():
            logits = self.model.forward(
                torch.tensor(ids, dtype=torch.long), self.model.make_cache(self.loaded.tier), all_logits=True
            )
        entries = prompt_logprobs(ids, logits, 1)[ctxlen:]
        total = sum(e["logprob"] for e in entries)
        greedy = all(e["logprob"] == e["top"][0][1] for e in entries)
        return total, greedy

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Disjoint windows of max_length - 1 tokens after the prefix token, as lm_eval's API
        models make them (and so the server path scores them)."""
        from lm_eval import utils

        out = []
        for (string,) in [req.args for req in requests]:
            windows = map(
                utils.make_disjoint_window,
                utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length - 1,
                    context_len=1,
                ),
            )
            total = sum(self.score(list(ctx), list(cont))[0] for ctx, cont in windows)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or as gen_kwargs say) through the Scheduler, `batch_size` at a time."""
        from latentkv.engine.request import Request

        scheduler = self._ensure_scheduler()
        results: list[str] = []
        reqs = [req.args for req in requests]
        for start in range(0, len(reqs), self.batch_size):
            chunk = reqs[start : start + self.batch_size]
            plans = [self._plan(context, dict(gen_kwargs)) for context, gen_kwargs in chunk]
            handles = scheduler.submit_all([Request(ids, params) for ids, params, _ in plans])
            for (context, gen_kwargs), (_, _, until), handle in zip(chunk, plans, handles, strict=True):
                text = _cut(self.tok.decode([e.token for e in handle if hasattr(e, "token")]), until)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
                results.append(text)
        return results

    def _plan(self, context: str, gen_kwargs: dict):
        from latentkv.engine.sampling import SamplingParams

        until = gen_kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_gen = int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks))
        max_gen = min(max_gen, self.max_length - 1)
        temperature = float(gen_kwargs.pop("temperature", 0.0))
        if not gen_kwargs.pop("do_sample", temperature > 0):
            temperature = 0.0
        ids = self.tok_encode(context)[-(self.max_length - max_gen) :]
        params = SamplingParams(
            max_tokens=max_gen,
            temperature=temperature,
            top_p=float(gen_kwargs.pop("top_p", 1.0)),
            seed=1234,
            stop_token_ids=tuple(self.stop_ids),
        )
        return ids, params, until

    def _ensure_scheduler(self):
        if self._scheduler is None:
            from latentkv.engine.scheduler import Scheduler

            self._scheduler = Scheduler(
                self.model,
                self.loaded.tier,
                max_num_seqs=self.batch_size,
                max_queue=self.batch_size,
                max_model_len=self.max_length,
                streamer=self.loaded.streamer,
            )
            self._scheduler.start()
        return self._scheduler

    def close(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
            self._scheduler = None
        self.loaded.close()


def _cut(text: str, until: list[str]) -> str:
    """The text before the first stop string (lm_eval's API models and our server stop there)."""
    cut = len(text)
    for stop in until:
        if stop and (at := text.find(stop)) != -1:
            cut = min(cut, at)
    return text[:cut]


def main(argv: list[str] | None = None) -> None:
    """lm_eval's command line, with `--model latentkv` registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()

"""Log-likelihood of continuations, in process, tokenized exactly as lm-evaluation-harness does.

lm-evaluation-harness scores a (context, continuation) request of a causal model like this
(`TemplateLM._encode_pair` in lm_eval/api/model.py, and `loglikelihood` above it):

    n = len(context) - len(context.rstrip())          trailing whitespace of the context ...
    context, continuation = context[:-n], context[-n:] + continuation   ... moves to the continuation
    ctx  = tok(context)
    cont = tok(context + continuation)[len(ctx):]
    an empty context becomes [prefix token] (BOS, else EOS), cont = tok(continuation)

then feeds ctx + cont (left-truncated to max_length + 1) and sums log p(cont_i | everything
before it); `is_greedy` says every cont token was the argmax. Tokens come without special
tokens, as lm_eval's API models send them (`add_bos_token` off).

Here a context is prefilled once into a cache of the chosen tier; each continuation that shares
it trims the cache back to the context and runs only its own tokens, so four choices cost one
context prefill. The first continuation token is predicted by the context's last logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from latentkv.config import CacheConfig


def encode_pair(tokenizer, context: str, continuation: str, prefix_token: int | None = None):
    """(context ids, continuation ids) the way lm_eval's causal `loglikelihood` makes them."""
    if context == "":
        if prefix_token is None:
            raise ValueError("an empty context needs a BOS or EOS token to condition on")
        cont = tokenizer.encode(continuation, add_special_tokens=False)
        if cont and cont[0] == prefix_token:
            return cont[:1], cont[1:]
        return [prefix_token], cont
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx = tokenizer.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx) :]


def prefix_token(cfg) -> int | None:
    """lm_eval's `prefix_token_id`: BOS if the model has one, else the (first) EOS."""
    if cfg.bos_token_id is not None:
        return cfg.bos_token_id
    return cfg.eos_token_ids[0] if cfg.eos_token_ids else None


def loglikelihood(
    model, tokenizer, pairs: Sequence[tuple[str, str]], cache_config: CacheConfig | None = None
) -> list[tuple[float, bool]]:
    """(sum of log p(continuation tokens), whether greedy decoding would produce them) per pair."""
    cache_config = cache_config or CacheConfig()
    prefix = prefix_token(model.cfg)
    max_length = model.cfg.max_position_embeddings
    results: list[tuple[float, bool]] = []
    state = None  # (context ids, cache holding them, logits [vocab] after the last context token)
    for context, continuation in pairs:
        ctx, cont = encode_pair(tokenizer, context, continuation, prefix)
        if not cont:
            raise ValueError(f"the continuation {continuation!r} encodes to no tokens")
        if not ctx:
            raise ValueError(f"the context {context!r} encodes to no tokens (only whitespace?)")
        ctx = _truncate(ctx, cont, max_length)
        if state is None or state[0] != ctx:
            cache = model.make_cache(cache_config)
            state = (ctx, cache, model.forward(torch.tensor(ctx), cache)[0])
        results.append(_score(model, state, cont))
    return results


def _truncate(ctx: list[int], cont: list[int], max_length: int) -> list[int]:
    """lm_eval keeps the last max_length + 1 tokens of ctx + cont and drops the final one."""
    if len(cont) > max_length:
        raise ValueError(f"a continuation of {len(cont)} tokens exceeds the model's {max_length}")
    keep = max_length + 1 - len(cont)
    return ctx[-keep:] if len(ctx) > keep else ctx


def _score(model, state, cont: list[int]) -> tuple[float, bool]:
    ctx, cache, last = state
    cache.trim(len(ctx))
    logits = last[None]  # [1, vocab]
    if len(cont) > 1:
        logits = torch.cat([logits, model.forward(torch.tensor(cont[:-1]), cache, all_logits=True)])
    target = torch.tensor(cont)
    log_p = torch.log_softmax(logits.double(), dim=-1).gather(1, target[:, None])  # [len(cont), 1]
    greedy = bool((logits.argmax(-1) == target).all())
    return float(log_p.sum()), greedy

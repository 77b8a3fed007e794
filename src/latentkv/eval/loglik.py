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

Here each request is one forward pass over ctx + cont[:-1] through an empty cache of the chosen
tier, the way lm_eval's own backends and our server score it. (Prefilling a shared context once
and running each continuation after it is the same math but not the same float32 sums: on the
tiny random models it moved a choice's log-likelihood by ~1e-5 relative, enough to break a
near tie differently than lm_eval does.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from latentkv.kv.cache import KVTier


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
    model, tokenizer, pairs: Sequence[tuple[str, str]], tier: KVTier | None = None
) -> list[tuple[float, bool]]:
    """(sum of log p(continuation tokens), whether greedy decoding would produce them) per pair,
    over caches of `tier` (the model's; f32 when None)."""
    prefix = prefix_token(model.cfg)
    max_length = model.cfg.max_position_embeddings
    results: list[tuple[float, bool]] = []
    for context, continuation in pairs:
        ctx, cont = encode_pair(tokenizer, context, continuation, prefix)
        if not cont:
            raise ValueError(f"the continuation {continuation!r} encodes to no tokens")
        if not ctx:
            raise ValueError(f"the context {context!r} encodes to no tokens (only whitespace?)")
        if len(cont) > max_length:
            raise ValueError(f"a continuation of {len(cont)} tokens exceeds the model's {max_length}")
        ids = (ctx + cont)[-(max_length + 1) : -1]  # lm_eval: the last max_length + 1, minus the final one
        logits = model.forward(torch.tensor(ids), model.make_cache(tier), all_logits=True)
        results.append(
            _score(logits[-len(cont) :], cont)
        )  # [len(cont), vocab]: the positions predicting cont
    return results


def _score(logits: torch.Tensor, cont: list[int]) -> tuple[float, bool]:
    target = torch.tensor(cont)
    log_p = torch.log_softmax(logits.double(), dim=-1).gather(1, target[:, None])  # [len(cont), 1]
    greedy = bool((logits.argmax(-1) == target).all())
    return float(log_p.sum()), greedy

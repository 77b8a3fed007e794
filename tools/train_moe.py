"""Train `builtin:stdlib-moe`: a GLM-5 (`glm_moe_dsa`) mixture-of-experts model of the Python standard
library that routes like a trained MoE (64 experts, top-8, shared expert, auxiliary-loss-free
balancing) and uses its context to 4096 tokens.

Why: the expert-streaming, MTP and KV-tier numbers need a model whose routing is learned (skewed,
hard to predict one layer ahead) and whose predictions depend on far context. builtin:fixture
(tools/train_fixture.py) is too small for either: 8 experts top-2, context 1024.

    nice -n 19 .venv/bin/python tools/train_moe.py train --work ~/.cache/latentkv/train-moe &
    .venv/bin/python tools/train_moe.py export --work ~/.cache/latentkv/train-moe \\
        --out src/latentkv/builtin/stdlib-moe

`train` is resumable: it checkpoints to WORK every few minutes and a restart with the same WORK
continues where it stopped (the data stream, the schedule and the optimizer included). It pauses,
sleeping, while the file /work/QUIET (`--quiet-file`) exists, so timed benchmarks on a shared
machine are not disturbed. Every step's losses go to WORK/history.jsonl; the held-out evaluation
(loss at 4096 tokens, planted-identifier recall) to WORK/evals.jsonl, and the checkpoint with the
best held-out loss is kept as WORK/best.pt, so a run cut short still leaves a usable model.

Corpus, split and tokenizer are builtin:fixture's (its tokenizer.json is reused, so perplexities
compare token for token): the stdlib's `*.py` files minus the test suites, 5% held out by path hash.

The long-context objective is in the data, not the loss: in each training window a few identifiers
that recur across it are renamed to fresh random names (`kovu_relami`), and some windows get a
planted definition near the start that is used again near the end. A renamed name cannot be guessed,
only copied from earlier in the window, so predicting its later occurrences takes attention across
the window, up to the full 4096 tokens.

A copy curriculum (--synthetic-*, off by default) adds synthetic windows whose loss counts only
tokens copied from earlier in the window (random tokens or text; segments scattered at spread
distances or one segment repeated), meant to force induction heads early; --init-from continues
from an exported model with a fresh optimizer. docs/stdlib-moe.md records what it did and did not do.

Phases (the checkpoint records which one it is in):
0. with --circuit-steps, the induction circuit alone (`train_circuit`): the layers of
   --supervise-induction A,B trained on a truncated forward with the attention-supervision losses
   only, thousands of cheap steps before the model is asked to use the circuit;
1. pretraining, bf16 autocast (AMX) with float32 master weights, AdamW, warmup + cosine; a length
   curriculum (1024-token windows first, 4096 later); next token + 0.3 x MTP (token after next);
   the DSA indexer is bypassed (every earlier token attends, as DSA does while the context fits
   index_topk);
2. the DSA indexer distilled from the frozen model's attention (KL of head-summed attention to the
   softmax of the index scores), as DeepSeek-V3.2 warmed its indexer up.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_fixture as tf  # noqa: E402  (the corpus split, MTP layer, balancer and saver are shared)

from latentkv.eval.recall import DISTANCES, planted_cases, random_name, score  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "src" / "latentkv" / "builtin" / "fixture"
EOT = tf.EOT


# --- configuration ---------------------------------------------------------------------------


def model_config(vocab_size: int, args) -> dict:
    n = args.layers
    cfg = tf.model_config(vocab_size, args.context, args.index_topk)
    cfg.update(
        {
            "hidden_size": args.hidden,
            "num_hidden_layers": n,
            "num_attention_heads": args.heads,
            "num_key_value_heads": args.heads,
            "intermediate_size": args.dense_inter,
            "moe_intermediate_size": args.expert_inter,
            "n_routed_experts": args.experts,
            "num_experts_per_tok": args.top_k,
            "n_shared_experts": 1,
            "mlp_layer_types": ["dense"] + ["sparse"] * (n - 1),
            "layer_types": ["deepseek_sparse_attention"] * n,
            "indexer_types": ["full"] * n,
        }
    )
    return cfg


# --- data ------------------------------------------------------------------------------------

KEYWORDS = set(__import__("keyword").kwlist + __import__("keyword").softkwlist + dir(__import__("builtins")))
CONVENTIONS = {"self", "cls"}  # not names a window defines: renaming them would teach that Python has none
IDENT = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")


def rename_identifiers(text: str, rng: random.Random, n: int) -> str:
    """Rename up to n identifiers that occur at least twice, preferring the ones whose first and last
    occurrences are furthest apart, to fresh random names (whole words only)."""
    spans: dict[str, list[int]] = {}
    for m in IDENT.finditer(text):
        w = m.group()
        if len(w) < 3 or w in KEYWORDS or w in CONVENTIONS or w.startswith("__"):
            continue
        s = spans.setdefault(w, [m.start(), m.start(), 0])
        s[1], s[2] = m.start(), s[2] + 1
    candidates = [(s[1] - s[0], w) for w, s in spans.items() if s[2] >= 2]
    if not candidates:
        return text
    candidates.sort(reverse=True)
    pool = [w for _, w in candidates[: max(4 * n, 8)]]
    chosen = rng.sample(pool, min(n, len(pool)))
    mapping = {w: random_name(rng) for w in chosen}
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, chosen)) + r")\b")
    return pattern.sub(lambda m: mapping[m.group()], text)


def plant_line(
    lines: list[str], name: str, rng: random.Random, def_at: int, use_at: int, indented: bool = False
) -> list[str]:
    """Insert `name = <int>` as line def_at and a bare use of it at use_at: unindented, as
    `latentkv eval recall` plants it (so the use is tokenized as the definition is), or indented like
    its neighbour (trainer versions before 3; the indent's last space then joins the name's first
    token, `Ġk` for `k`)."""
    value = rng.randint(0, 999)
    nxt = lines[use_at] if use_at < len(lines) else ""
    indent = nxt[: len(nxt) - len(nxt.lstrip(" "))] if indented else ""
    out = lines[:use_at] + [f"{indent}{name}\n"] + lines[use_at:]
    return out[:def_at] + [f"{name} = {value}\n"] + out[def_at:]


def repeat_block(lines: list[str], rng: random.Random) -> list[str]:
    """Copy a block of 8-40 consecutive lines from the first third to a line boundary in the
    second half (code repeats itself; after renaming, only the earlier copy tells the later one's
    names)."""
    n = rng.randint(8, 40)
    src = rng.randrange(0, max(1, len(lines) // 3 - n))
    dst = rng.randrange(len(lines) // 2, max(len(lines) // 2 + 1, (3 * len(lines)) // 4))
    return lines[:dst] + lines[src : src + n] + lines[dst:]


def copy_segments(ids: list[int], rng: random.Random, context: int, repeat: float = 0.5) -> list[int]:
    """A window of segments of 32-512 tokens taken in order from `ids`, each followed, with
    probability `repeat`, by a repeat of an earlier segment (any earlier one, so the copy distance
    ranges over the whole window): at 0.5 about a third of the tokens are exact copies, predictable
    only by finding the earlier occurrence and reading on (what an induction head does)."""
    out: list[int] = []
    segments: list[list[int]] = []
    i = 0
    while len(out) < context and i < len(ids):
        seg = ids[i : i + rng.randint(32, 512)]
        i += len(seg)
        out += seg
        segments.append(seg)
        if rng.random() < repeat:
            out += segments[rng.randrange(len(segments))]
    return out[:context]


def synthetic_window(
    rng: random.Random, context: int, vocab: int, avoid: int, args, base: list[int] | None = None
) -> tuple[list[int], list[bool]]:
    """A window of random tokens (uniform over the vocabulary but `avoid`, the EOT) in which
    segments of `synthetic_min_len`-`synthetic_max_len` tokens repeat an earlier stretch exactly, at
    distances drawn log-uniformly from `synthetic_min_distance` to `synthetic_max_distance` (capped
    by the window), until about `synthetic_copy_frac` of the window is copies. Returns (ids, mask):
    mask marks the tokens predictable by copying, every copied token but a copy's first (its
    predecessor is random); nothing else in the window can be predicted, so the loss counts only
    those. Copies never overlap and a copy is no longer than its distance, so each stays exact."""
    if args.synthetic_layout == "periodic":
        return periodic_window(rng, context, vocab, avoid, args, base)
    if base is None:
        ids = [rng.randrange(vocab - 1) for _ in range(context)]
        ids = [t + (t >= avoid) for t in ids]
    else:
        ids = list(base[:context])
    copies: list[tuple[int, int, int]] = []  # (destination, length, distance)
    covered, tries = 0, 0
    while covered < args.synthetic_copy_frac * context and tries < 1000:
        tries += 1
        length = rng.randint(args.synthetic_min_len, args.synthetic_max_len)
        top = min(args.synthetic_max_distance, context - length)
        if top < args.synthetic_min_distance:
            break
        distance = round(math.exp(rng.uniform(math.log(args.synthetic_min_distance), math.log(top))))
        length = min(length, distance)
        dst = rng.randrange(distance, context - length + 1)
        if any(dst < d + n and d < dst + length for d, n, _ in copies):
            continue
        copies.append((dst, length, distance))
        covered += length
    mask = [False] * context
    for dst, length, distance in sorted(
        copies
    ):  # in order: a later copy never writes an earlier one's source
        ids[dst : dst + length] = ids[dst - distance : dst - distance + length]
        mask[dst + 1 : dst + length] = [True] * (length - 1)
    return ids, mask


def periodic_window(
    rng: random.Random, context: int, vocab: int, avoid: int, args, base: list[int] | None = None
) -> tuple[list[int], list[bool]]:
    """--synthetic-layout periodic: one random segment repeated to fill the window (seg + seg +
    ...), its length (the copy distance) log-uniform from --synthetic-min-distance to
    --synthetic-max-distance (at most half the window); every token after the first copy's first
    is predictable. Easier than the scattered layout: the copy is most of the window and its
    distance is the same throughout."""
    top = max(args.synthetic_min_distance, min(args.synthetic_max_distance, context // 2))
    period = round(math.exp(rng.uniform(math.log(args.synthetic_min_distance), math.log(top))))
    if base is None:
        seg = [t + (t >= avoid) for t in (rng.randrange(vocab - 1) for _ in range(period))]
    else:
        seg = list(base[:period])
    ids = (seg * (context // period + 1))[:context]
    return ids, [p > period for p in range(context)]


class Windows:
    """Training windows of `context` tokens from the training text, renamed and planted, seeded by
    (seed, step) so a resumed run draws exactly the batches it would have drawn."""

    def __init__(self, text: str, tok, args):
        self.text, self.tok, self.args = text, tok, args

    def window(self, rng: random.Random, context: int) -> list[int]:
        a = self.args
        long = context > a.short_context  # the long phase copies more (see the module docstring)
        chars = int(context * 4.2)  # the tokenizer averages ~3.5 characters per token here
        start = rng.randrange(0, len(self.text) - chars)
        start = self.text.find("\n", start) + 1  # whole lines
        chunk = self.text[start : start + chars]
        if rng.random() < (a.long_rename_prob if long else a.rename_prob):
            chunk = rename_identifiers(chunk, rng, a.long_renames if long else a.renames)
        lines = chunk.splitlines(keepends=True)
        if long and rng.random() < a.repeat_prob and len(lines) > 60:
            for _ in range(a.long_repeats):
                lines = repeat_block(lines, rng)
        if rng.random() < (a.long_plant_prob if long else a.plant_prob) and len(lines) > 20:
            def_at = rng.randrange(0, max(1, len(lines) // 10))
            use_at = rng.randrange(len(lines) // 2, len(lines) - 5)
            lines = plant_line(lines, random_name(rng), rng, def_at, use_at, a.plant_use == "indented")
        ids = self.tok.encode("".join(lines)).ids
        if long and rng.random() < a.copy_prob:
            ids = copy_segments(ids, rng, context, a.copy_repeat_prob)
        while len(ids) < context:  # rare: a chunk of very long tokens; pad with more text
            ids += [self.tok.token_to_id(EOT)] + self.tok.encode(
                self.text[start + chars : start + 2 * chars]
            ).ids
            start += chars
        return ids[:context]

    def batch(self, step: int, batch: int, context: int) -> torch.Tensor:
        rng = random.Random(self.args.seed * 1_000_003 + step)
        return torch.tensor([self.window(rng, context) for _ in range(batch)], dtype=torch.long)

    def mixed_batch(
        self, step: int, batch: int, context: int, share: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x [B, S], synthetic mask [n, S] or None): the text windows of `batch`, then about
        share x batch synthetic windows (`synthetic_window`, rounded at random) in their place,
        drawn from their own seeded stream. Share 0 gives exactly `batch`'s windows."""
        x = self.batch(step, batch, context)
        if share <= 0:
            return x, None
        rng = random.Random((self.args.seed * 1_000_003 + step) * 7 + 5)
        n = min(batch, int(share * batch + rng.random()))
        if n == 0:
            return x, None
        eot, vocab = self.tok.token_to_id(EOT), self.tok.get_vocab_size()
        if self.args.synthetic_alphabet:  # random tokens from the first N ids (the EOT skipped)
            vocab = min(vocab, self.args.synthetic_alphabet + 1)
        text = self.args.synthetic_source == "text"
        pairs = [
            synthetic_window(rng, context, vocab, eot, self.args, self.window(rng, context) if text else None)
            for _ in range(n)
        ]
        x = torch.cat([x[: batch - n], torch.tensor([ids for ids, _ in pairs], dtype=torch.long)])
        return x, torch.tensor([m for _, m in pairs], dtype=torch.bool)


def training_text(seed: int) -> tuple[str, list[str], list[str]]:
    """(training text: its files joined by EOT lines in a seeded order, held-out texts, training texts)."""
    root = Path(tf.sysconfig.get_paths()["stdlib"])
    train_files, heldout_files = tf.corpus_files(root)
    train_texts, heldout_texts = tf.read_texts(train_files), tf.read_texts(heldout_files)
    order = list(range(len(train_texts)))
    random.Random(seed).shuffle(order)
    return f"\n{EOT}\n".join(train_texts[i] for i in order), heldout_texts, train_texts


def token_counts(tok, texts: list[str]) -> list[int]:
    """Training-split token counts (the unigram baseline of `latentkv eval ppl`)."""
    ids = [t for s in texts for t in tok.encode(s).ids] + [tok.token_to_id(EOT)]
    return torch.bincount(torch.tensor(ids), minlength=tok.get_vocab_size()).tolist()


# --- fast training forward ---------------------------------------------------------------------
# The same math as transformers' GlmMoeDsa modules (checked by `check`): attention through SDPA's
# causal kernel instead of a dense [S, S] mask (the indexer is bypassed), experts on tokens sorted by
# expert instead of a one-hot mask, the router in float32 outside autocast.


def causal_attention(q, k, v, scale: float):
    """SDPA's causal kernel; under a torch CPU capability below AVX-512 (ATEN_CPU_CAPABILITY=avx2
    or default on a CPU with AMX) its flash kernel, bfloat16 under autocast, still takes the AMX
    path and fails ("pack_vnni2 is only supported when avx512 is supported"), so there SDPA runs
    its math backend: the same attention, without the fused kernel."""
    capped = q.device.type == "cpu" and not torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    if capped:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def attention_forward(self, hidden_states, position_embeddings, **_):
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    B, S, _ = hidden_states.shape
    q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
    q = self.q_b_proj(q_resid).view(B, S, -1, self.qk_head_dim).transpose(1, 2)  # [B, H, S, Dq]
    q_pass, q_rot = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    kv_pass, k_rot = self.kv_a_proj_with_mqa(hidden_states).split(
        [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
    )
    k_pass = self.kv_a_layernorm(kv_pass).view(B, 1, S, self.kv_lora_rank)
    k_rot = k_rot.view(B, 1, S, self.qk_rope_head_dim)
    cos, sin = position_embeddings
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
    kv = self.kv_b_proj(k_pass).view(B, S, -1, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2)
    k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)  # [B, H, S, *]
    q = torch.cat([q_pass, q_rot], dim=-1)
    k = torch.cat([k_nope, k_rot.to(k_nope.dtype).expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
    o = causal_attention(q, k, v.to(q.dtype), self.scaling)
    sup = getattr(self, "supervise", None)
    if sup is not None:  # attention supervision (see `supervised_attention`): one head's pattern
        h = sup["head"]
        logits = (q[:, h].float() @ k[:, h].float().transpose(-1, -2)) * self.scaling  # [B, S, S]
        causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
        logp = torch.log_softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
        sup["loss"] = attention_target_loss(logp, sup["targets"])
        if sup.get("keep_write") or sup.get("identity") is not None:
            v = self.v_head_dim  # the head's own write into the residual stream [B, S, D]
            sup["write"] = o[:, h].float() @ self.o_proj.weight[:, h * v : (h + 1) * v].float().T
        if sup.get("identity") is not None:  # the head's write must name the token it attends to
            emb, target = sup["identity"]
            logits = sup["write"] @ emb.detach().float().T  # read with the (fixed) input embedding
            sup["identity_loss"] = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)
    return self.o_proj(o.transpose(1, 2).reshape(B, S, -1)), None, None


def attention_target_loss(logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log of the attention mass a head puts on its target keys, logp / targets [B, S, S] (query
    x key), averaged over the queries that have a target (0 when none has)."""
    rows = targets.any(-1)
    if not rows.any():
        return logp.sum() * 0.0
    mass = torch.logsumexp(logp.masked_fill(~targets, float("-inf")), dim=-1)  # [B, S]
    return -mass[rows].mean()


def induction_targets(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two heads of an induction circuit, as target keys per query for token windows x [B, S]:
    (previous token: query i attends to key i-1; induction: query i attends to every key j + 1
    whose token x[j] is the query's token x[i], j < i, i.e. to what followed the current token
    last time). Boolean [B, S, S] each; a query with no earlier occurrence has no target."""
    B, S = x.shape
    idx = torch.arange(S, device=x.device)
    prev = (idx[None, :, None] - 1 == idx[None, None, :]).expand(B, S, S)
    same = x[:, :, None] == x[:, None, :]  # [B, i, j]: x[i] == x[j]
    earlier = idx[None, :] < idx[:, None]  # j < i
    after = torch.zeros(B, S, S, dtype=torch.bool, device=x.device)
    after[:, :, 1:] = (same & earlier)[:, :, :-1]  # key j + 1 for each matching j
    return prev, after


def supervised_attention(model, spec: tuple[int, int] | None, x: torch.Tensor | None, identity: bool = False):
    """Arm (x a window batch) or disarm (x None) the supervision of an induction circuit: with spec
    (A, B), head 0 of layer A is taught to attend to the previous token and head 0 of layer B to
    the key after the current token's earlier occurrences (`induction_targets`). Returns the armed
    attention modules, whose forward leaves its loss in `.supervise["loss"]`."""
    if spec is None:
        return []
    mods = [model.model.layers[i].self_attn for i in spec]
    if x is None:
        for m in mods:
            m.supervise = None
        return []
    for m, t in zip(mods, induction_targets(x), strict=True):
        m.supervise = {"head": 0, "targets": t}
    if identity:  # the previous-token head's write, read with the input embedding, names x[i-1]
        before = torch.full_like(x, -100)
        before[:, 1:] = x[:, :-1]
        mods[0].supervise["identity"] = (model.model.embed_tokens.weight, before)
    return mods


CIRCUIT_TOKENS = 4096  # tokens a circuit step: 8 windows of 512, 1 of 4,096


def circuit_contexts(args) -> list[int]:
    """--circuit-contexts as window lengths; a malformed value, or a circuit phase without the
    circuit's layers, is one clear line (SystemExit), before any training."""
    if args.circuit_steps > 0 and not args.supervise_induction:
        raise SystemExit("--circuit-steps: needs --supervise-induction A,B (the circuit's layers)")
    parts = str(args.circuit_contexts).split(",")
    if not all(p.strip().isdigit() and 32 <= int(p) <= CIRCUIT_TOKENS for p in parts):
        raise SystemExit(
            f"--circuit-contexts {args.circuit_contexts}: expected window lengths of 32 to "
            f"{CIRCUIT_TOKENS} tokens, comma-separated"
        )
    return [int(p) for p in parts]


def circuit_window(rng: random.Random, context: int, vocab: int, avoid: int) -> tuple[list[int], list[bool]]:
    """A window for the circuit phase: random tokens in which about half the window is copies of
    earlier stretches (8-64 tokens, 16 to `context` tokens back, log-uniform); (ids, mask), the
    mask marking the tokens predictable by copying (`synthetic_window`)."""
    spec = argparse.Namespace(
        synthetic_layout="scattered",
        synthetic_min_len=8,
        synthetic_max_len=64,
        synthetic_min_distance=16,
        synthetic_max_distance=context,
        synthetic_copy_frac=0.5,
    )
    return synthetic_window(rng, context, vocab, avoid, spec)


READOUT_PATHS = ("head", "layer")  # --circuit-readout-via


def circuit_forward(
    model,
    spec: tuple[int, int],
    x: torch.Tensor,
    shift: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    via: str = "head",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(previous-token loss, induction loss, readout loss) of the circuit (A, B) on windows x
    [B, S], running only the layers it needs: A..B-1 whole, then B's attention; `shift` [D] is
    added to every token's embedding (see `train_circuit`). With `mask` [B, S] (the copied tokens),
    the readout loss is a cross-entropy against each copied token of, with `via` "head", the
    induction head's write alone through the final norm and the output head (the direct path);
    with "layer", layer B's whole output (its attention, then its MLP) through them; else None."""
    a, b = spec
    mm = model.model
    h = mm.embed_tokens(x) if shift is None else mm.embed_tokens(x) + shift
    pe = mm.rotary_emb(h, torch.arange(x.shape[1])[None])
    mods = supervised_attention(model, spec, x)
    try:
        mods[1].supervise["keep_write"] = mask is not None and via == "head"
        for layer in mm.layers[a:b]:
            h = layer(h, attention_mask=None, position_embeddings=pe)
            h = h[0] if isinstance(h, tuple) else h
        layer = mm.layers[b]
        if mask is not None and via == "layer":
            out = layer(h, attention_mask=None, position_embeddings=pe)
            write = out[0] if isinstance(out, tuple) else out
        else:
            layer.self_attn(layer.input_layernorm(h), position_embeddings=pe)
            write = mods[1].supervise.get("write")
        readout = None
        if mask is not None:
            logits = model.lm_head(mm.norm(write[:, :-1]))
            target = x[:, 1:].masked_fill(~mask[:, 1:], -100)
            readout = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), ignore_index=-100)
        return mods[0].supervise["loss"], mods[1].supervise["loss"], readout
    finally:
        supervised_attention(model, spec, None)


def circuit_parameters(
    model, spec: tuple[int, int], readout: bool = False, via: str = "head"
) -> list[torch.nn.Parameter]:
    """What the circuit phase trains: layers A..B-1 whole and what layer B's queries and keys are
    made of (its attention but the output projection, its input norm), with `readout` its output
    projection too, and with a readout `via` "layer" layer B's MLP and the norm before it as well
    (the router's balancing bias is a buffer and stays); everything else, the embeddings and the
    output head included, stays as it is."""
    a, b = spec
    layers = model.model.layers
    params = [p for layer in layers[a:b] for p in layer.parameters()]
    attn = layers[b].self_attn
    skip = ("indexer.",) if readout else ("o_proj.", "indexer.")
    keep = [p for n, p in attn.named_parameters() if not n.startswith(skip)]
    mlp = []
    if readout and via == "layer":
        mlp = list(layers[b].mlp.parameters()) + [layers[b].post_attention_layernorm.weight]
    return params + keep + [layers[b].input_layernorm.weight] + mlp


def train_circuit(state: dict, work: Path, tok, args, log) -> None:
    """Phase 0 (--circuit-steps N): form the induction circuit before the model is asked to use it.

    Taught through the next-token loss, the circuit never formed here (docs/stdlib-moe.md): layer
    B's keys must carry the previous token, which the previous-token head writes with a norm of ~1
    into a residual stream whose norm after layer 0's MLP is ~130. So this phase trains only the
    circuit's own weights (`circuit_parameters`) on the truncated forward (`circuit_forward`), with
    the two attention-supervision losses alone, on random-token copy windows whose contexts cycle
    through --circuit-contexts (short ones for many cheap steps, the full context so position
    does not break the previous-token head far out). Own AdamW (kept in the checkpoint), constant
    --circuit-lr after a 20-step warmup, gradient clipping at 10 (the supervision's gradients run
    to 30-50 while the head sharpens).

    A previous-token head attends by position alone, which needs a query that is the same for
    every token; with layer 0's input the bare token embeddings, that takes a direction every
    embedding shares. The phase learns one: a vector added to every embedding row (one [D]
    parameter, the rows themselves stay), folded into the embedding when the phase ends. Without
    it the previous-token loss on the shipped model fell only from 5.3 to 3.2 in 500 steps."""
    spec = supervision_spec(args)
    config, model, mtp = restore(state)
    for p in list(model.parameters()) + list(mtp.parameters()):
        p.requires_grad_(False)
    readout = args.circuit_readout > 0
    via = args.circuit_readout_via
    params = circuit_parameters(model, spec, readout, via)
    shift = torch.nn.Parameter(state.get("circuit_shift", torch.zeros(config.hidden_size)).clone())
    params.append(shift)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.circuit_lr, betas=(0.9, 0.95), weight_decay=0.0)
    saved = state.get("circuit_opt")
    if saved is not None and len(saved["param_groups"][0]["params"]) != len(params):
        log(
            f"circuit phase: the trained parameters changed ({len(saved['param_groups'][0]['params'])} -> "
            f"{len(params)} tensors, e.g. --circuit-readout-via): the phase's optimizer starts afresh"
        )
        saved = None
    if saved is not None:
        opt.load_state_dict(saved)
    contexts = circuit_contexts(args)
    vocab, avoid = config.vocab_size, tok.token_to_id(EOT)
    last_save = time.time()

    def save() -> None:
        state["model"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        state["circuit_opt"] = opt.state_dict()
        state["circuit_shift"] = shift.detach().clone()
        if state.get("circuit_step", 0) >= args.circuit_steps:  # done: the shift joins the embedding
            state["model"]["model.embed_tokens.weight"] += state.pop("circuit_shift")
            state["circuit_opt"] = None
        save_checkpoint(work / "last.pt", state)

    stop = args.circuit_steps if args.stop_after is None else state.get("circuit_step", 0) + args.stop_after
    while state.get("circuit_step", 0) < min(stop, args.circuit_steps):
        state["paused_seconds"] += wait_quiet(args.quiet_file, log)
        step = state.get("circuit_step", 0)
        context = contexts[step % len(contexts)]
        rng = random.Random(f"circuit-{args.seed}-{step}")
        windows = [circuit_window(rng, context, vocab, avoid) for _ in range(CIRCUIT_TOKENS // context)]
        x, mask = torch.tensor([w[0] for w in windows]), torch.tensor([w[1] for w in windows])
        for group in opt.param_groups:
            group["lr"] = args.circuit_lr * min(1.0, (step + 1) / 20)
        t0, c0 = time.time(), time.process_time()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            prev, ind, read = circuit_forward(model, spec, x, shift, mask if readout else None, via)
        opt.zero_grad(set_to_none=True)
        (prev + ind + (args.circuit_readout * read if readout else 0.0)).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 10.0)
        opt.step()
        row = {
            "step": step + 1,
            "context": context,
            "previous_token_loss": round(prev.item(), 4),
            "induction_loss": round(ind.item(), 4),
            "readout_loss": round(read.item(), 4) if readout else None,
            "grad_norm": round(float(grad_norm), 2),
            "seconds": round(time.time() - t0, 3),
            "cpu_seconds": round(time.process_time() - c0, 3),
        }
        state["compute_seconds"] += row["cpu_seconds"]
        state["circuit_step"] = step + 1
        append_jsonl(work / "circuit_history.jsonl", row)
        if (step + 1) % args.log_every == 0 or step == 0:
            log(
                f"circuit step {step + 1}/{args.circuit_steps} ctx {context}  previous-token "
                f"{row['previous_token_loss']:.3f}  induction {row['induction_loss']:.3f}  "
                + (f"readout {row['readout_loss']:.3f}  " if readout else "")
                + f"grad {row['grad_norm']:.1f}  {row['seconds']:.2f} s/step"
            )
        if time.time() - last_save > args.save_minutes * 60:
            save()
            last_save = time.time()
    save()


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """[T, D] tokens, [T, k] experts and weights -> [T, D]. Tokens are grouped by expert into a
    [E, C, D] block padded to the busiest expert's count C, so each projection is one batched GEMM
    (a loop of small per-expert GEMMs costs ~10x more on CPU); padding rows carry weight 0."""
    T, k = top_k_index.shape
    E = self.num_experts
    flat = top_k_index.flatten()
    order = flat.argsort(stable=True)  # assignments grouped by expert
    counts = torch.bincount(flat, minlength=E)
    C = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(T * k) - starts.repeat_interleave(counts)  # rank within its expert
    dest = flat[order] * C + slot  # row in the [E * C] block
    token = torch.full((E * C,), T, dtype=torch.long)  # T: the zero padding row
    token[dest] = order // k
    weight = torch.zeros(E * C, dtype=top_k_weights.dtype)
    weight[dest] = top_k_weights.flatten()[order]
    x = torch.cat([hidden_states, hidden_states.new_zeros(1, hidden_states.shape[1])])[token]
    x = x.view(E, C, -1)  # [E, C, D]
    gate, up = torch.bmm(x, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [E, C, I] each
    y = torch.bmm(self.act_fn(gate) * up, self.down_proj.transpose(1, 2)).view(E * C, -1)
    y = y * weight[:, None].to(y.dtype)
    out = torch.zeros(T + 1, y.shape[1], dtype=y.dtype).index_add_(0, token, y)
    return out[:T].to(hidden_states.dtype)


def router_forward(self, hidden_states, _orig=None):
    with torch.autocast("cpu", enabled=False):
        return _orig(self, hidden_states.float())


def patch_for_training() -> dict:
    """Swap in the fast forwards; returns the originals (for `unpatch`)."""
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m

    orig = {
        "attn": m.GlmMoeDsaAttention.forward,
        "experts": m.GlmMoeDsaExperts.forward,
        "router": m.GlmMoeDsaTopkRouter.forward,
    }
    m.GlmMoeDsaAttention.forward = attention_forward
    m.GlmMoeDsaExperts.forward = experts_forward
    m.GlmMoeDsaTopkRouter.forward = lambda self, h: router_forward(self, h, _orig=orig["router"])
    return orig


def unpatch(orig: dict) -> None:
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m

    m.GlmMoeDsaAttention.forward = orig["attn"]
    m.GlmMoeDsaExperts.forward = orig["experts"]
    m.GlmMoeDsaTopkRouter.forward = orig["router"]


def run_stack(layers, h: torch.Tensor, pe) -> torch.Tensor:
    for layer in layers:
        h, _ = layer(h, attention_mask=None, position_embeddings=pe)
    return h


def forward_losses(
    model, mtp, x: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, S] -> (next-token loss, MTP loss), with the patched (fast) modules; with a mask
    [B, S], only the tokens it marks are predicted (the loss is their mean)."""
    mm = model.model
    pos = torch.arange(x.shape[1])[None]
    h = mm.embed_tokens(x)
    pe = mm.rotary_emb(h, pos)
    h = mm.norm(run_stack(mm.layers, h, pe))  # [B, S, D]

    def targets(t0: int) -> torch.Tensor:
        return x[:, t0:] if mask is None else x[:, t0:].masked_fill(~mask[:, t0:], -100)

    main = head_loss(model.lm_head, h[:, :-1], targets(1))
    e = mm.embed_tokens(x[:, 1:])
    m = mtp.eh_proj(torch.cat([mtp.enorm(e), mtp.hnorm(h[:, :-1])], dim=-1))  # [B, S-1, D]
    m = run_stack([mtp.block], m, mm.rotary_emb(m, pos[:, :-1]))
    return main, head_loss(model.lm_head, mtp.head_norm(m[:, :-1]), targets(2))  # predicts x[i+2]


def head_loss(head, h: torch.Tensor, target: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Mean cross-entropy of head(h) [B, S, V] against target [B, S] over the targets that are not
    -100, 1024 positions at a time so no [B, S, V] logits tensor is ever whole."""
    h, target = h.flatten(0, 1), target.flatten()
    total = sum(
        F.cross_entropy(head(h[i : i + chunk]).float(), target[i : i + chunk], reduction="sum")
        for i in range(0, h.shape[0], chunk)
    )
    return total / max(1, int((target != -100).sum()))


# --- evaluation --------------------------------------------------------------------------------


def fast_logits(model):
    def fn(ids: torch.Tensor) -> torch.Tensor:
        mm = model.model
        h = mm.embed_tokens(ids)
        pe = mm.rotary_emb(h, torch.arange(ids.shape[1])[None])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = mm.norm(run_stack(mm.layers, h, pe))
            return model.lm_head(h).float()

    return fn


def copy_losses(logits_of, segments: torch.Tensor) -> tuple[float, float]:
    """Mean next-token loss on the first and on the second copy of each held-out segment [N, L]
    repeated once. A model that copies from context (an induction head) predicts the second copy
    far better than the first; one that does not, no better. Recall of a planted name needs this."""
    first, second = [], []
    L = segments.shape[1]
    for seg in segments:
        ids = torch.cat([seg, seg])[None]
        nll = F.cross_entropy(logits_of(ids)[0, :-1], ids[0, 1:], reduction="none")
        first.append(nll[: L - 1].mean().item())
        second.append(nll[L:].mean().item())
    return sum(first) / len(first), sum(second) / len(second)


@torch.no_grad()
def heldout_eval(
    model, mtp, eval_ids: torch.Tensor, cases: list, segments: torch.Tensor | None = None
) -> dict:
    """Held-out next-token and MTP loss on fixed windows, planted-identifier recall, and the
    loss on a repeated segment's first and second copy."""
    model.eval()
    mains, extras = [], []
    for x in eval_ids.split(1):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a, b = forward_losses(model, mtp, x)
        mains.append(a.item())
        extras.append(b.item())
    logits_of = fast_logits(model)
    recall = {
        d: hits / n
        for d, (hits, n) in score(lambda ids: logits_of(torch.tensor(ids)[None])[0], cases).items()
    }
    out = {"loss": sum(mains) / len(mains), "mtp_loss": sum(extras) / len(extras), "recall": recall}
    if segments is not None:
        out["copy_first"], out["copy_second"] = copy_losses(logits_of, segments)
    model.train()
    return out


def eval_windows(heldout: str, tok, n: int, context: int) -> torch.Tensor:
    ids = tok.encode(heldout).ids
    step = (len(ids) - context) // n
    return torch.tensor([ids[i * step : i * step + context] for i in range(n)], dtype=torch.long)


# --- checkpoints -------------------------------------------------------------------------------


def append_jsonl(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop rows past the checkpoint's step: a resumed run redoes them."""
    if path.exists():
        rows = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= last_step]
        path.write_text("".join(r + "\n" for r in rows))


def save_checkpoint(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def wait_quiet(quiet: Path, log) -> float:
    """Sleep while the quiet file exists (a timed benchmark is running); returns seconds slept."""
    if not quiet.exists():
        return 0.0
    t0 = time.time()
    log(f"paused: {quiet} exists")
    while quiet.exists():
        time.sleep(5)
    log(f"resumed after {time.time() - t0:.0f} s")
    return time.time() - t0


# --- pretraining -------------------------------------------------------------------------------


def schedule(step: int, args) -> tuple[float, int, int]:
    """(learning rate, batch, context) at a step: warmup, then cosine to 10% (or constant with
    --lr-schedule constant); short windows first."""
    if step < args.warmup:
        lr = args.lr * (step + 1) / args.warmup
    elif args.lr_schedule == "constant":
        lr = args.lr
    else:
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        lr = args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    long = step >= int(args.short_frac * args.steps)
    context = args.context if long else args.short_context
    return lr, args.tokens_per_step // context, context


def synthetic_share(step: int, state: dict, args) -> float:
    """The share of a step's windows that are synthetic copy windows: --synthetic-share until the
    synthetic copy loss (its running mean, state["synthetic_ema"]) first falls below
    --synthetic-anneal-below, then linearly down to --synthetic-final-share over
    --synthetic-anneal-steps steps (the step it fell is state["synthetic_anneal_from"])."""
    start = state.get("synthetic_anneal_from")
    if args.synthetic_share <= 0 or start is None:
        return max(0.0, args.synthetic_share)
    t = min(1.0, (step - start) / max(1, args.synthetic_anneal_steps))
    return args.synthetic_share + t * (args.synthetic_final_share - args.synthetic_share)


def track_synthetic(state: dict, loss: float | None, args) -> None:
    """Update the synthetic copy loss's running mean (0.9 decay) and start the anneal when it
    first falls below --synthetic-anneal-below."""
    if loss is None:
        return
    ema = state.get("synthetic_ema")
    state["synthetic_ema"] = ema = loss if ema is None else 0.9 * ema + 0.1 * loss
    if state.get("synthetic_anneal_from") is None and ema < args.synthetic_anneal_below:
        state["synthetic_anneal_from"] = state["step"]


def build_optimizer(model, mtp, args):
    params = list(model.parameters()) + list(mtp.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    return params, opt


def train_step(
    model, mtp, opt, params, balancer, x: torch.Tensor, lr: float, args, mask: torch.Tensor | None = None
) -> dict:
    """One optimizer step over x [B, S], in micro-batches of about args.micro_tokens tokens (small
    tensors stay in the allocator's heap instead of fresh page-faulted mappings). With a mask
    [n, S], x's last n windows are synthetic and only their masked tokens are predicted; every
    window weighs the same. "loss"/"mtp_loss" are the text windows' (None without any),
    "synthetic_loss" the synthetic windows' next-token loss on their copies."""
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    per = max(1, args.micro_tokens // x.shape[1])
    n_syn = 0 if mask is None else mask.shape[0]
    n_text = x.shape[0] - n_syn
    sums = {"loss": 0.0, "mtp_loss": 0.0, "synthetic_loss": 0.0, "induction_loss": 0.0, "identity_loss": 0.0}
    parts = [(xs, None) for xs in x[:n_text].split(per)] if n_text else []
    if n_syn:
        parts += list(zip(x[n_text:].split(per), mask.split(per), strict=True))
    spec = supervision_spec(args)
    for xs, ms in parts:
        armed = supervised_attention(
            model, spec, xs if ms is not None else None, identity=args.induction_identity > 0
        )
        with torch.autocast("cpu", dtype=torch.bfloat16):
            main, extra = forward_losses(model, mtp, xs, ms)
        share = xs.shape[0] / x.shape[0]
        sup = sum(m.supervise["loss"] for m in armed) if armed else None
        ident = armed[0].supervise.get("identity_loss") if armed else None
        supervised_attention(model, spec, None)
        loss = main + args.mtp_weight * extra
        if sup is not None:
            loss = loss + args.induction_weight * sup
            sums["induction_loss"] += sup.item() * xs.shape[0] / n_syn
        if ident is not None:
            loss = loss + args.induction_identity * ident
            sums["identity_loss"] += ident.item() * xs.shape[0] / n_syn
        (loss * share).backward()
        if ms is None:
            sums["loss"] += main.item() * xs.shape[0] / n_text
            sums["mtp_loss"] += extra.item() * xs.shape[0] / n_text
        else:
            sums["synthetic_loss"] += main.item() * xs.shape[0] / n_syn
    grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return {
        "loss": sums["loss"] if n_text else None,
        "mtp_loss": sums["mtp_loss"] if n_text else None,
        "synthetic_windows": n_syn,
        "synthetic_loss": sums["synthetic_loss"] if n_syn else None,
        "induction_loss": sums["induction_loss"] if n_syn and spec is not None else None,
        "identity_loss": sums["identity_loss"]
        if n_syn and spec is not None and args.induction_identity
        else None,
        "max_load_ratio": balancer.step(),
        "grad_norm": float(grad_norm),
        "lr": lr,
        "context": x.shape[1],
    }


def supervision_spec(args, layers: int | None = None) -> tuple[int, int] | None:
    """--supervise-induction A,B -> (A, B), or None; with `layers`, A < B < layers is checked.
    A malformed value is one clear line (SystemExit), before any training."""
    if not args.supervise_induction:
        return None
    parts = str(args.supervise_induction).split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise SystemExit(f"--supervise-induction {args.supervise_induction}: expected two layer numbers A,B")
    a, b = (int(p) for p in parts)
    if layers is not None and not a < b < layers:
        raise SystemExit(
            f"--supervise-induction {a},{b}: the previous-token layer must come before the induction "
            f"layer, both below the model's {layers} layers"
        )
    return a, b


def keep_heap() -> None:
    """glibc hands every allocation over 128 KB back to the kernel when freed, so each step's
    activations are page-faulted in again (2-3x slower elementwise ops here); keep them."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: its maximum, 32 MiB
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: give back what a step no longer needs past 1 GiB
    libc.mallopt(-2, 64 << 20)  # M_TOP_PAD


def load_tokenizer(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def load_exported(folder: Path) -> tuple[dict, dict, dict]:
    """An exported model folder (`export`'s layout) -> (config, model state, MTP state), float32:
    the inverse of train_fixture.save (the MTP layer's DeepSeek-V3 names mapped back)."""
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    for key in ("dtype", "transformers_version"):
        cfg.pop(key, None)
    tensors = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    _, model, mtp = tf.build(cfg, 0)
    prefix = f"model.layers.{cfg['num_hidden_layers']}."
    names = dict(zip((n for n, _ in mtp.state_items(prefix)), mtp.state_dict(), strict=True))
    mtp_state = {names[k]: tensors.pop(k) for k in list(tensors) if k.startswith(prefix)}
    model_state = model.state_dict()
    missing = set(model_state) - set(tensors) - {k for k in model_state if k.endswith("inv_freq")}
    if missing or set(tensors) - set(model_state) or set(names.values()) - set(mtp_state):
        raise SystemExit(f"--init-from {folder}: not a model this trainer exported")
    model_state.update(tensors)
    return cfg, model_state, mtp_state


# The tensors of a block that write into the residual stream: zero in a grown model's new layers.
RESIDUAL_WRITERS = (
    "self_attn.o_proj.weight",
    "mlp.down_proj.weight",
    "mlp.experts.down_proj",
    "mlp.shared_experts.down_proj.weight",
)


def grow(model, mtp, cfg: dict, source: dict) -> int:
    """Initialize `model` (and `mtp`) from a trainer checkpoint `source` of a shallower model with
    the same widths: its layers become the first layers, its embedding, final norm, head and MTP
    layer are taken as they are, and the new layers' tensors that write into the residual stream
    (attention output, MLP down projections) start at zero, so the grown model computes exactly
    what the source computes and the new layers are learned from there. Returns the source's
    layer count. Used to carry a mechanism a shallow model learns quickly (copying) into a deeper
    one that sits on a plateau before learning it (docs/stdlib-moe.md)."""
    src_cfg = source["config"]
    n_src, n = src_cfg["num_hidden_layers"], cfg["num_hidden_layers"]
    per_layer = {"num_hidden_layers", "mlp_layer_types", "layer_types", "indexer_types"}
    if cfg.get("rope_parameters", {}).get("rope_type", "default") == "default":
        per_layer.add("max_position_embeddings")  # plain RoPE: a longer context, the same weights
    differ = sorted(k for k in set(cfg) | set(src_cfg) if k not in per_layer and cfg.get(k) != src_cfg.get(k))
    if differ or n_src > n:
        why = f"settings differ: {', '.join(differ)}" if differ else f"it has {n_src} layers, more than {n}"
        raise SystemExit(f"--grow-from: cannot grow that checkpoint into this model ({why})")
    own = model.state_dict()
    for k, v in source["model"].items():
        if own[k].shape != v.shape:  # same widths, so only a renamed tensor could differ
            raise SystemExit(f"--grow-from: {k} is {tuple(v.shape)} there, {tuple(own[k].shape)} here")
        own[k] = v
    for i in range(n_src, n):
        for name in RESIDUAL_WRITERS:
            key = f"model.layers.{i}.{name}"
            if key in own:
                own[key] = torch.zeros_like(own[key])
    model.load_state_dict(own)
    mtp.load_state_dict(source["mtp"])
    return n_src


def new_state(args, tok) -> dict:
    if args.init_from is None:
        cfg = model_config(tok.get_vocab_size(), args)
        config, model, mtp = tf.build(cfg, args.seed)
        if args.grow_from is not None:
            grow(model, mtp, cfg, torch.load(args.grow_from, weights_only=False))
    else:  # continue from an exported model: its config and weights, a fresh optimizer
        cfg, model_state, mtp_state = load_exported(Path(args.init_from))
        config, model, mtp = tf.build(cfg, args.seed)
        model.load_state_dict(model_state)
        mtp.load_state_dict(mtp_state)
    _, opt = build_optimizer(model, mtp, args)
    return {
        "phase": "pretrain",
        "step": 0,
        "indexer_step": 0,
        "config": cfg,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "change"},
        "trainer_version": TRAINER_VERSION,
        "model": model.state_dict(),
        "mtp": mtp.state_dict(),
        "opt": opt.state_dict(),
        "best": None,
        "compute_seconds": 0.0,
        "paused_seconds": 0.0,
    }


def restore(state: dict):
    """(config, model, mtp) with the checkpoint's weights, float32."""
    config, model, mtp = tf.build(state["config"], 0)
    model.load_state_dict(state["model"])
    mtp.load_state_dict(state["mtp"])
    return config, model, mtp


def pretrain(state: dict, work: Path, windows: Windows, evals: tuple, args, log) -> None:
    config, model, mtp = restore(state)
    params, opt = build_optimizer(model, mtp, args)
    opt.load_state_dict(state["opt"])
    balancer = tf.Balancer([model, mtp], args.balance_rate)
    model.train()
    last_save = time.time()
    stop = args.steps if args.stop_after is None else min(args.steps, state["step"] + args.stop_after)
    while state["step"] < stop:
        state["paused_seconds"] += wait_quiet(args.quiet_file, log)
        step = state["step"]
        lr, batch, context = schedule(step, args)
        t0, c0 = time.time(), time.process_time()
        x, mask = windows.mixed_batch(step, batch, context, synthetic_share(step, state, args))
        row = {"step": step + 1, **train_step(model, mtp, opt, params, balancer, x, lr, args, mask)}
        row["seconds"] = round(time.time() - t0, 2)
        row["cpu_seconds"] = round(time.process_time() - c0, 2)
        state["compute_seconds"] += row["cpu_seconds"]
        state["step"] = step + 1
        track_synthetic(state, row["synthetic_loss"], args)
        append_jsonl(work / "history.jsonl", row)
        if (step + 1) % args.log_every == 0 or step == 0:
            fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
            syn = (
                f"  synthetic {fmt(row['synthetic_loss'])} ({row['synthetic_windows']} windows, "
                f"mean {state['synthetic_ema']:.3f})"
                if state.get("synthetic_ema") is not None
                else ""
            )
            if row.get("induction_loss") is not None:
                syn += f"  induction heads {row['induction_loss']:.3f}"
            if row.get("identity_loss") is not None:
                syn += f" (identity {row['identity_loss']:.3f})"
            log(
                f"step {step + 1}/{args.steps} ctx {context}  loss {fmt(row['loss'])}  mtp {fmt(row['mtp_loss'])}"
                f"{syn}  load max/mean {row['max_load_ratio']:.2f}  {row['seconds']:.1f} s/step"
            )
        done = state["step"] == args.steps
        if (step + 1) % args.eval_every == 0 or done:
            state["paused_seconds"] += wait_quiet(args.quiet_file, log)
            ev = {"step": step + 1, **heldout_eval(model, mtp, *evals)}
            copy = f" copy {ev['copy_first']:.2f}->{ev['copy_second']:.2f}" if "copy_first" in ev else ""
            log(
                f"eval step {step + 1}: loss {ev['loss']:.3f} mtp {ev['mtp_loss']:.3f}{copy} recall {ev['recall']}"
            )
            append_jsonl(work / "evals.jsonl", ev)
            snapshot(state, model, mtp, opt)
            if state["best"] is None or better(ev, state["best"], args.best_by):
                state["best"] = ev
                save_checkpoint(work / "best.pt", state)
            save_checkpoint(work / "last.pt", state)
            if args.keep_evals:
                save_checkpoint(work / f"step-{step + 1}.pt", state)
            last_save = time.time()
        elif time.time() - last_save > args.save_minutes * 60:
            snapshot(state, model, mtp, opt)
            save_checkpoint(work / "last.pt", state)
            last_save = time.time()
    if state["step"] == args.steps:
        state["phase"] = "indexer"
    snapshot(state, model, mtp, opt)
    save_checkpoint(work / "last.pt", state)


def better(ev: dict, best: dict, by: str) -> bool:
    """Is evaluation `ev` better than `best`? By held-out loss, or ("recall") by planted-name
    recall summed over the distances of 2048 tokens and more, then over all, then by loss."""
    if by == "recall":

        def key(e):
            far = sum(v for d, v in e["recall"].items() if int(d) >= 2048)
            return (-far, -sum(e["recall"].values()), e["loss"])

        return key(ev) < key(best)
    return ev["loss"] < best["loss"]


def snapshot(state: dict, model, mtp, opt) -> None:
    state["model"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["mtp"] = {k: v.detach().clone() for k, v in mtp.state_dict().items()}
    state["opt"] = opt.state_dict()


# --- DSA indexer distillation ------------------------------------------------------------------


def attention_inputs(model, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the (normed hidden state, q_resid) its attention sees, float32, no gradients."""
    captured = []

    def hook(module, args, kwargs):
        captured.append(kwargs["hidden_states"].float())

    handles = [
        layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers
    ]
    with torch.no_grad():
        mm = model.model
        h = mm.embed_tokens(x)
        pe = mm.rotary_emb(h, torch.arange(x.shape[1])[None])
        run_stack(mm.layers, h, pe)
    for handle in handles:
        handle.remove()
    out = []
    for layer, hs in zip(model.model.layers, captured, strict=True):
        with torch.no_grad():
            out.append((hs, layer.self_attn.q_a_layernorm(layer.self_attn.q_a_proj(hs))))
    return out


def head_summed_attention(attn, hs: torch.Tensor, pe, rows: slice) -> torch.Tensor:
    """[B, rows, S] attention probabilities of queries `rows`, summed over heads and normalised."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    B, S, _ = hs.shape
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hs))).view(B, S, -1, attn.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = q.split([attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
    kv_pass, k_rot = attn.kv_a_proj_with_mqa(hs).split([attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    k_pass = attn.kv_a_layernorm(kv_pass).view(B, 1, S, attn.kv_lora_rank)
    cos, sin = pe
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot.view(B, 1, S, -1), cos, sin)
    k_nope = attn.kv_b_proj(k_pass).view(B, S, -1, attn.qk_nope_head_dim + attn.v_head_dim).transpose(1, 2)
    k = torch.cat([k_nope[..., : attn.qk_nope_head_dim], k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
    q = torch.cat([q_pass, q_rot], dim=-1)[:, :, rows]
    scores = (q @ k.transpose(-1, -2)) * attn.scaling  # [B, H, R, S]
    causal = torch.arange(S)[None] <= torch.arange(S)[rows][:, None]
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1).sum(1)
    return probs / probs.sum(-1, keepdim=True)


def index_scores(idx, hs: torch.Tensor, q_resid: torch.Tensor, pe, rows: slice) -> torch.Tensor:
    """The indexer's scores [B, rows, S] with gradients (GlmMoeDsaIndexer.forward's math; its own
    forward runs under no_grad)."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    B, S, _ = hs.shape
    cos, sin = pe
    q = idx.wq_b(q_resid[:, rows]).view(B, -1, idx.n_heads, idx.head_dim)  # [B, R, Hi, Di]
    q_rot, q_pass = q.split([idx.qk_rope_head_dim, idx.head_dim - idx.qk_rope_head_dim], dim=-1)
    k = idx.k_norm(idx.wk(hs)).unsqueeze(2)  # [B, S, 1, Di]
    k_rot, k_pass = k.split([idx.qk_rope_head_dim, idx.head_dim - idx.qk_rope_head_dim], dim=-1)
    q_rot, _ = apply_rotary_pos_emb_interleave(q_rot, q_rot, cos[:, rows], sin[:, rows], unsqueeze_dim=2)
    _, k_rot = apply_rotary_pos_emb_interleave(k_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)  # [B, S, Di]
    scores = F.relu(torch.einsum("brhd,bsd->brhs", q, k) * idx.softmax_scale)
    weights = idx.weights_proj(hs[:, rows]) * idx.n_heads**-0.5  # [B, R, Hi]
    return torch.einsum("brh,brhs->brs", weights, scores)


def distill_indexer(state: dict, work: Path, windows: Windows, args, log) -> None:
    """Train every layer's indexer to match its layer's head-summed attention, the rest frozen,
    in query chunks so memory stays bounded at 4096 tokens."""
    config, model, mtp = restore(state)
    for p in model.parameters():
        p.requires_grad_(False)
    params = [p for layer in model.model.layers for p in layer.self_attn.indexer.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.indexer_lr, weight_decay=0.0)
    if "indexer_opt" in state:
        opt.load_state_dict(state["indexer_opt"])
    chunk = 512
    while state["indexer_step"] < args.indexer_steps:
        state["paused_seconds"] += wait_quiet(args.quiet_file, log)
        t0, c0 = time.time(), time.process_time()
        step = state["indexer_step"]
        x = windows.batch(10_000_000 + step, 1, args.context)
        inputs = attention_inputs(model, x)
        pe = model.model.rotary_emb(inputs[0][0], torch.arange(x.shape[1])[None])
        opt.zero_grad(set_to_none=True)
        total = 0.0
        S = x.shape[1]
        for layer, (hs, q_resid) in zip(model.model.layers, inputs, strict=True):
            for r0 in range(0, S, chunk):
                rows = slice(r0, min(S, r0 + chunk))
                with torch.no_grad():
                    target = head_summed_attention(layer.self_attn, hs, pe, rows)
                scores = index_scores(layer.self_attn.indexer, hs, q_resid, pe, rows)
                causal = torch.arange(S)[None] <= torch.arange(S)[rows][:, None]
                logp = torch.log_softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
                kl = (target * (target.clamp_min(1e-12).log() - logp.masked_fill(~causal, 0))).sum(-1)
                loss = kl.sum() / (S * len(inputs))
                loss.backward()
                total += loss.item()
        opt.step()
        state["indexer_step"] = step + 1
        state["compute_seconds"] += time.process_time() - c0
        append_jsonl(
            work / "indexer_history.jsonl",
            {"step": step + 1, "indexer_kl": total, "seconds": round(time.time() - t0, 2)},
        )
        log(f"indexer step {step + 1}/{args.indexer_steps}: KL {total:.4f}")
        state["model"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        state["indexer_opt"] = opt.state_dict()
        save_checkpoint(work / "last.pt", state)
    state["phase"] = "done"
    save_checkpoint(work / "last.pt", state)


# --- export ------------------------------------------------------------------------------------


def export(state: dict, out: Path, tok, heldout: list[str], counts: list[int], work: Path, args) -> None:
    """The checkpoint -> a model folder (bf16 safetensors, config, tokenizer, held-out text, unigram
    counts, training log), the layout builtin:fixture has."""
    cfg = dict(state["config"])
    if args.index_topk:
        cfg["index_topk"] = args.index_topk
    _, model, mtp = restore(state)
    history = [json.loads(line) for line in (work / "history.jsonl").read_text().splitlines()]
    evals_path = work / "evals.jsonl"
    evals = [json.loads(line) for line in evals_path.read_text().splitlines()] if evals_path.exists() else []
    indexer_path = work / "indexer_history.jsonl"
    indexer = (
        [json.loads(line) for line in indexer_path.read_text().splitlines()] if indexer_path.exists() else []
    )
    meta = {
        "command": "tools/train_moe.py train "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in state["args"].items()),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": tf._version("transformers"),
        "threads": state["args"].get("threads"),
        "steps": state["step"],
        "indexer_steps": state["indexer_step"],
        "phase": state["phase"],
        "compute_seconds": round(state["compute_seconds"], 1),
        "paused_seconds": round(state["paused_seconds"], 1),
        "tokens_seen": sum(
            r["context"] * (state["args"]["tokens_per_step"] // r["context"])
            for r in history[: state["step"]]
        ),
        "parameters": sum(p.numel() for p in model.parameters()) + sum(p.numel() for p in mtp.parameters()),
        "best_eval": state["best"],
        "recipe_changes": state.get("recipe_changes", []),
        "args": state["args"],
        "history": history[: state["step"]],
        "evals": evals,
        "indexer_history": indexer,
    }
    tf.save(out, model, mtp, cfg, tok, heldout, counts, meta)


# --- command line ------------------------------------------------------------------------------


def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train (or resume) into WORK")
    t.add_argument(
        "--work", type=Path, required=True, help="checkpoints and logs (resumes from WORK/last.pt)"
    )
    t.add_argument("--steps", type=int, default=600, help="optimizer steps (default: 600)")
    t.add_argument("--tokens-per-step", type=int, default=8192, help="tokens per step (default: 8192)")
    t.add_argument(
        "--micro-tokens", type=int, default=4096, help="tokens per forward/backward (default: 4096)"
    )
    t.add_argument("--context", type=int, default=4096, help="long windows = max_position_embeddings")
    t.add_argument(
        "--short-context", type=int, default=1024, help="windows of the first part (default: 1024)"
    )
    t.add_argument("--short-frac", type=float, default=0.5, help="share of steps on short windows")
    t.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default: 2e-3)")
    t.add_argument("--warmup", type=int, default=60)
    t.add_argument(
        "--lr-schedule",
        choices=["cosine", "constant"],
        default="cosine",
        help="after the warmup: cosine to 10%% of --lr at --steps (default), or constant",
    )
    t.add_argument(
        "--init-from",
        default=None,
        help="start from an exported model folder (its config and weights, a fresh optimizer) "
        "instead of random weights",
    )
    t.add_argument(
        "--grow-from",
        default=None,
        help="start from a trainer checkpoint (WORK/best.pt, last.pt) of a model with fewer layers "
        "and the same widths: its layers first, the new layers' output projections zero, so the "
        "grown model starts computing what it computed (a fresh optimizer)",
    )
    t.add_argument(
        "--synthetic-share",
        type=float,
        default=0.0,
        help="share of each step's windows that are synthetic copy windows, whose loss counts only "
        "the copies: a curriculum meant to make induction heads form (on the shipped model it did "
        "not in the steps tried: docs/stdlib-moe.md) (default: 0)",
    )
    t.add_argument(
        "--synthetic-final-share",
        type=float,
        default=0.15,
        help="the share once annealed (default: 0.15)",
    )
    t.add_argument(
        "--synthetic-anneal-below",
        type=float,
        default=2.0,
        help="anneal once the synthetic copy loss (running mean) falls below this, in nats (default: 2.0)",
    )
    t.add_argument(
        "--synthetic-anneal-steps", type=int, default=50, help="steps the anneal takes (default: 50)"
    )
    t.add_argument(
        "--synthetic-copy-frac",
        type=float,
        default=0.5,
        help="share of a synthetic window's tokens that are copies (default: 0.5)",
    )
    t.add_argument(
        "--synthetic-layout",
        choices=["scattered", "periodic"],
        default="scattered",
        help="synthetic windows: random tokens with segments copied from earlier at spread distances "
        "(default), or one random segment repeated to fill the window",
    )
    t.add_argument(
        "--synthetic-source",
        choices=["random", "text"],
        default="random",
        help="what the synthetic windows copy: uniformly random tokens (default), or a training "
        "text window (renamed and planted as the text windows are); either way only the copies count",
    )
    t.add_argument(
        "--synthetic-alphabet",
        type=int,
        default=0,
        help="random synthetic tokens come from this many token ids (default 0: the whole vocabulary); "
        "a small alphabet shows each token more often a step",
    )
    t.add_argument(
        "--supervise-induction",
        default=None,
        metavar="A,B",
        help="on the synthetic windows, also teach head 0 of layer A to attend to the previous token "
        "and head 0 of layer B to the token after the current token's earlier occurrences (an "
        "induction circuit), by the attention mass on those keys (default: off)",
    )
    t.add_argument("--induction-weight", type=float, default=1.0, help="weight of that loss (default: 1.0)")
    t.add_argument(
        "--circuit-steps",
        type=int,
        default=0,
        help="with --supervise-induction: first train the induction circuit alone for this many steps "
        "(layers A..B only, the attention-supervision losses only, on random-token copy windows), "
        "then pretrain (default 0: no circuit phase)",
    )
    t.add_argument("--circuit-lr", type=float, default=1e-3, help="the circuit phase's learning rate")
    t.add_argument(
        "--circuit-readout",
        type=float,
        default=0.0,
        help="in the circuit phase, also train layer B's induction head to write the token it copies, "
        "read through the final norm and the output head, with this weight (default 0: off)",
    )
    t.add_argument(
        "--circuit-readout-via",
        choices=READOUT_PATHS,
        default="head",
        help="what --circuit-readout reads: the induction head's write alone ('head', the direct "
        "path) or layer B's whole output, its MLP trained too ('layer': no linear map takes this "
        "model's embeddings to its output head, an MLP can learn one; docs/stdlib-moe.md)",
    )
    t.add_argument(
        "--circuit-contexts",
        default="512,512,512,4096",
        help="the circuit phase's window lengths (32-4096), cycled step by step (4,096 tokens a step: "
        "8 windows of 512, 1 of 4,096); include the full context (default: 512,512,512,4096)",
    )
    t.add_argument(
        "--induction-identity",
        type=float,
        default=0.0,
        help="with --supervise-induction: also train the previous-token head's write into the "
        "residual stream to name the previous token (cross-entropy of the write read against the "
        "input embedding), with this weight (default 0: off), so the induction head has a clean "
        "key to match",
    )
    t.add_argument(
        "--synthetic-min-len", type=int, default=16, help="copied segment length, min (default: 16)"
    )
    t.add_argument(
        "--synthetic-max-len", type=int, default=128, help="copied segment length, max (default: 128)"
    )
    t.add_argument("--synthetic-min-distance", type=int, default=64, help="copy distance, min (default: 64)")
    t.add_argument(
        "--synthetic-max-distance",
        type=int,
        default=4096,
        help="copy distance, max (log-uniform between; capped by the window; default: 4096)",
    )
    t.add_argument(
        "--best-by",
        choices=["loss", "recall"],
        default="loss",
        help="which evaluation WORK/best.pt keeps: the lowest held-out loss (default), or the best "
        "planted-name recall at 2048+ tokens (then at any distance, then loss)",
    )
    t.add_argument("--mtp-weight", type=float, default=0.3, help="weight of the MTP loss (DeepSeek-V3: 0.3)")
    t.add_argument("--balance-rate", type=float, default=1e-2, help="router bias update per step")
    t.add_argument("--rename-prob", type=float, default=0.8, help="share of windows with renamed identifiers")
    t.add_argument("--renames", type=int, default=3, help="identifiers renamed per window")
    t.add_argument("--plant-prob", type=float, default=0.3, help="share of windows with a planted name")
    t.add_argument("--long-rename-prob", type=float, default=1.0, help="--rename-prob of the long windows")
    t.add_argument("--long-renames", type=int, default=12, help="--renames of the long windows")
    t.add_argument("--long-plant-prob", type=float, default=0.5, help="--plant-prob of the long windows")
    t.add_argument(
        "--repeat-prob", type=float, default=0.3, help="share of long windows with blocks of lines repeated"
    )
    t.add_argument(
        "--long-repeats",
        type=int,
        default=3,
        help="blocks of 8-40 lines repeated in such a window (default: 3)",
    )
    t.add_argument(
        "--copy-prob",
        type=float,
        default=0.5,
        help="share of long windows made of segments repeated token for token (default: 0.5)",
    )
    t.add_argument(
        "--copy-repeat-prob",
        type=float,
        default=0.5,
        help="in those windows, the chance that a segment is followed by a repeat (default: 0.5)",
    )
    t.add_argument(
        "--plant-use",
        choices=["top-level", "indented"],
        default="top-level",
        help="where a planted name is used: unindented, as `eval recall` plants it (default), or indented",
    )
    t.add_argument("--layers", type=int, default=6, help="decoder layers: 1 dense, the rest MoE (default: 6)")
    t.add_argument("--hidden", type=int, default=256)
    t.add_argument("--heads", type=int, default=4)
    t.add_argument("--dense-inter", type=int, default=768, help="layer 0's SwiGLU width")
    t.add_argument("--experts", type=int, default=64)
    t.add_argument("--top-k", type=int, default=8)
    t.add_argument(
        "--expert-inter", type=int, default=64, help="each expert's SwiGLU width (the shared one's too)"
    )
    t.add_argument(
        "--index-topk", type=int, default=1024, help="DSA index_topk in the config (default: 1024)"
    )
    t.add_argument(
        "--indexer-steps", type=int, default=60, help="indexer distillation steps after pretraining"
    )
    t.add_argument("--indexer-lr", type=float, default=1e-3)
    t.add_argument("--eval-every", type=int, default=50)
    t.add_argument("--eval-per-distance", type=int, default=8, help="planted-identifier cases per distance")
    t.add_argument("--save-minutes", type=float, default=10)
    t.add_argument(
        "--keep-evals", action="store_true", help="also keep each evaluation's checkpoint as WORK/step-N.pt"
    )
    t.add_argument(
        "--stop-after", type=int, default=None, help="stop (checkpointed) after this many steps of this run"
    )
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument(
        "--change",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="on resume, change a recipe setting from this step on (recorded in the checkpoint's recipe)",
    )
    t.add_argument("--seed", type=int, default=0)
    t.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default: 1: on a shared 2-core machine a second thread waits at every op "
        "for a core the other jobs hold, 3-7x slower per step)",
    )
    t.add_argument(
        "--quiet-file", type=Path, default=Path("/work/QUIET"), help="pause while this file exists"
    )
    e = sub.add_parser("export", help="write a model folder from WORK's checkpoint")
    e.add_argument("--work", type=Path, required=True)
    e.add_argument("--out", type=Path, required=True)
    e.add_argument(
        "--checkpoint",
        default="last",
        help="last (default), best, or step-N (an evaluation's, kept with --keep-evals)",
    )
    e.add_argument("--index-topk", type=int, default=None, help="override index_topk in the config")
    return p.parse_args(argv)


OPERATIONAL = {
    "work",
    "threads",
    "quiet_file",
    "save_minutes",
    "log_every",
    "eval_every",
    "stop_after",
    "change",
    "cmd",
    "keep_evals",
}
TRAINER_VERSION = 8  # recorded with every recipe change
# 3: planted uses unindented, three repeated blocks per long window; 4: --copy-prob windows
# (--copy-repeat-prob, added in the same version, defaults to 4's fixed 0.5); 5: --init-from,
# --lr-schedule, the --synthetic-* copy curriculum, --best-by; 6: --grow-from, --synthetic-alphabet,
# --supervise-induction, --induction-weight, --induction-identity; 7: the circuit phase
# (--circuit-steps, --circuit-lr, --circuit-contexts, --circuit-readout); 8: --circuit-readout-via


def apply_changes(state: dict, args, log) -> None:
    """Resume with the checkpoint's recipe, plus the settings this trainer version introduced (at
    their defaults) and the explicit --change KEY=VALUE ones, recorded from the current step."""
    for k, v in state["args"].items():  # the run's recipe is the checkpoint's, not the flags'
        if k not in OPERATIONAL:
            setattr(args, k, v)
    added = {k: v for k, v in vars(args).items() if k not in state["args"] and k not in OPERATIONAL}
    changed = {}
    for item in args.change:
        key, sep, value = item.partition("=")
        key = key.replace("-", "_")
        if not sep or key in OPERATIONAL or not hasattr(args, key):
            raise SystemExit(f"--change {item}: expected KEY=VALUE with KEY a recipe setting")
        old = getattr(args, key)
        new = type(old)(value) if old is not None else value
        setattr(args, key, new)
        changed[key] = new
    if added or changed:
        state["args"].update(
            {k: (str(v) if isinstance(v, Path) else v) for k, v in {**added, **changed}.items()}
        )
        entry = {
            "step": state["step"],
            "trainer_version": TRAINER_VERSION,
            "added": added,
            "changed": changed,
        }
        state.setdefault("recipe_changes", []).append(entry)
        log(
            f"recipe from step {state['step']} (trainer version {TRAINER_VERSION}): added {added} changed {changed}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.cmd == "train" and args.change and not (args.work / "last.pt").exists():
        # a mistyped WORK, or one whose first run never saved: starting afresh would be wrong
        raise SystemExit(f"--change: no run to change ({args.work / 'last.pt'} does not exist)")

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    tok = load_tokenizer(FIXTURE / "tokenizer.json")
    text, heldout, train_texts = training_text(0)
    if args.cmd == "export":
        path = args.work / f"{args.checkpoint}.pt"
        if not re.fullmatch(r"last|best|step-\d+", args.checkpoint) or not path.exists():
            print(f"export: no checkpoint {path}", file=sys.stderr)
            return 2
        state = torch.load(path, weights_only=False)
        export(state, args.out, tok, heldout, token_counts(tok, train_texts), args.work, args)
        log(f"exported {args.checkpoint} (step {state['step']}, phase {state['phase']}) to {args.out}")
        return 0
    torch.set_num_threads(args.threads)
    keep_heap()
    args.work.mkdir(parents=True, exist_ok=True)
    last = args.work / "last.pt"
    if last.exists():
        state = torch.load(last, weights_only=False)
        apply_changes(state, args, log)
        truncate_jsonl(args.work / "history.jsonl", state["step"])
        truncate_jsonl(args.work / "evals.jsonl", state["step"])
        truncate_jsonl(args.work / "indexer_history.jsonl", state["indexer_step"])
        truncate_jsonl(args.work / "circuit_history.jsonl", state.get("circuit_step", 0))
        log(f"resuming {last}: phase {state['phase']}, step {state['step']}")
    else:
        if args.init_from is not None and args.grow_from is not None:
            raise SystemExit("--init-from and --grow-from: give one starting point, not both")
        if args.grow_from is not None and not Path(args.grow_from).is_file():
            raise SystemExit(f"--grow-from {args.grow_from}: no such checkpoint file")
        state = new_state(args, tok)
        log(f"new run in {args.work}" + (f", grown from {args.grow_from}" if args.grow_from else ""))
    supervision_spec(args, state["config"]["num_hidden_layers"])  # a bad value stops here
    circuit_contexts(args)
    patch_for_training()
    windows = Windows(text, tok, args)
    heldout_text = f"\n{EOT}\n".join(heldout)
    encode = lambda text: (lambda e: (e.ids, e.offsets))(tok.encode(text))  # noqa: E731
    cases = planted_cases(heldout_text, encode, DISTANCES, args.eval_per_distance, seed=1)
    evals = (eval_windows(heldout_text, tok, 2, args.context), cases, eval_windows(heldout_text, tok, 4, 256))
    if state["phase"] == "pretrain" and state.get("circuit_step", 0) < args.circuit_steps:
        train_circuit(state, args.work, tok, args, log)
        if state["circuit_step"] < args.circuit_steps:  # --stop-after ended it early
            log(f"stopped: circuit step {state['circuit_step']} of {args.circuit_steps}")
            return 0
    if state["phase"] == "pretrain":
        pretrain(state, args.work, windows, evals, args, log)
    if state["phase"] == "indexer" and args.stop_after is None:
        distill_indexer(state, args.work, windows, args, log)
    log(f"done: {state['step']} steps, {state['compute_seconds'] / 3600:.2f} h of compute")
    return 0


if __name__ == "__main__":
    sys.exit(main())

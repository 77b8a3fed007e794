"""Can a copying head name the token it attends to? The direct path's ceiling on a trained model.

An induction head copies when its write, alone through the final norm and the output head,
puts the most probability on the token it attended to. What a head writes is a linear function
of what it reads (its value and output projections), so on the direct path copying needs a
linear map from the residual at the attended token to the output head's row of that token.
This fits, on the model's own weights and for every token of the vocabulary at once:

    free vector     one trainable vector per token: the direct path's ceiling
    linear map      x_t -> x_t W + b from the token's input embedding x_t (what a head reading
                    the bare embedding could do at best)
    linear map + embeddings moved
                    the same with the embeddings trainable too, pulled back to where they are by
                    lambda * mean squared move: how far they must go for the map to exist

each reported as the cross-entropy (nats; chance is ln(vocab)) of the output head's logits
against the token, and the share of tokens named within 1 nat. docs/stdlib-moe.md
("Why the readout does not form") reads the results.

    python benchmarks/readout_ceiling.py builtin:stdlib-moe --out benchmarks/results/readout-ceiling-stdlib-moe.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

import machine  # noqa: E402


def load_heads(model: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """(input embeddings [V, D], output head [V, D], final norm weight [D], its epsilon) in float32."""
    from latentkv.config import ModelConfig
    from latentkv.models.loader import Checkpoint
    from latentkv.models.registry import resolve

    folder = resolve(model)
    cfg, ckpt = ModelConfig.from_hf(folder), Checkpoint(folder)
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    names = ("model.embed_tokens.weight", head, "model.norm.weight")
    missing = [n for n in names if n not in ckpt]
    if missing:
        raise SystemExit(f"{model}: no {', '.join(missing)} in its checkpoint")
    emb, out, norm = (ckpt.get(n).float() for n in names)
    return emb, out, norm, cfg.rms_norm_eps


def head_loss(w: torch.Tensor, head: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-token cross-entropy [V] of writes w [V, D] (row t meant to name token t)."""
    logits = F.rms_norm(w, (w.shape[1],), norm, eps) @ head.T
    return F.cross_entropy(logits, torch.arange(w.shape[0]), reduction="none")


FITS = ("free vector", "linear map")


def fit(kind: str, emb, head, norm, eps, steps: int, lam: float = 0.0, seed: int = 0) -> dict:
    """One fit (`FITS`) of writes naming every token; a "linear map" with `lam` > 0 also moves the
    embeddings, at a cost of `lam` x their mean squared move."""
    if kind not in FITS or (kind == "free vector" and lam):
        raise ValueError(
            f"fit {kind!r} with lambda {lam}: expected one of {FITS}, lambda for a linear map only"
        )
    torch.manual_seed(seed)
    V, D = emb.shape
    if kind == "free vector":
        w = torch.nn.Parameter(torch.randn(V, D) * 0.1)
        params, lr = [w], 0.05

        def writes():
            return w
    else:
        W, b = torch.nn.Parameter(torch.eye(D)), torch.nn.Parameter(torch.zeros(D))
        x = torch.nn.Parameter(emb.clone()) if lam > 0 else emb
        params, lr = [W, b] + ([x] if lam > 0 else []), 0.01

        def writes():
            return x @ W + b

    opt = torch.optim.Adam(params, lr=lr)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = head_loss(writes(), head, norm, eps).mean()
        if lam > 0:
            loss = loss + lam * ((x - emb) ** 2).sum(1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        per = head_loss(writes(), head, norm, eps)
    row = {
        "fit": kind + (" + embeddings moved" if lam > 0 else ""),
        "lambda": lam if lam > 0 else None,
        "steps": steps,
        "nats": per.mean().item(),
        "named_within_1_nat": (per < 1).float().mean().item(),
        "seconds": time.perf_counter() - t0,
    }
    if lam > 0:
        row["embedding_move"] = ((x - emb).norm(dim=1) / emb.norm(dim=1)).mean().item()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "model", nargs="?", default="builtin:stdlib-moe", help="model (default: builtin:stdlib-moe)"
    )
    p.add_argument("--steps", type=int, default=400, help="Adam steps per fit (default: 400)")
    p.add_argument("--lambdas", default="1,0.1", help="penalties on the embeddings' move (default: 1,0.1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="results JSON")
    args = p.parse_args(argv)
    try:
        lambdas = [float(v) for v in args.lambdas.split(",") if v]
    except ValueError:
        raise SystemExit(f"bad --lambdas {args.lambdas!r}: expected numbers, comma-separated") from None
    if args.steps < 1 or any(v <= 0 for v in lambdas):
        raise SystemExit("--steps must be >= 1 and every --lambdas value > 0")
    torch.set_num_threads(args.threads)
    emb, head, norm, eps = load_heads(args.model)
    rows = [
        fit("free vector", emb, head, norm, eps, args.steps),
        fit("linear map", emb, head, norm, eps, args.steps),
    ]
    rows += [fit("linear map", emb, head, norm, eps, args.steps, lam) for lam in lambdas]
    chance = math.log(emb.shape[0])
    print(f"{args.model}: vocabulary {emb.shape[0]} (chance {chance:.2f} nats), width {emb.shape[1]}")
    print("| fit | lambda | nats | tokens named within 1 nat | embeddings moved |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        moved = f"{r['embedding_move']:.0%} of their norm" if "embedding_move" in r else ""
        lam = "" if r["lambda"] is None else f"{r['lambda']:g}"
        print(f"| {r['fit']} | {lam} | {r['nats']:.2f} | {r['named_within_1_nat']:.1%} | {moved} |")
    if args.out:
        payload = {
            "bench": "readout_ceiling",
            "model": args.model,
            "vocab": emb.shape[0],
            "chance_nats": chance,
            "rows": rows,
            "machine": {"cpu": machine.cpu_model()},
            "commit": machine.commit(),
            "torch": torch.__version__,
        }
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

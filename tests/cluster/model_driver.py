"""Run a model's passes and save every logit: `python model_driver.py OUT MODEL TIER`. Under
torch's env:// variables (WORLD_SIZE > 1) as the head of a cluster, else as one process with the
experts streamed from this machine's disk (the same formats and MoE path, the reference).

    one sequence    a prompt prefilled, then greedy decode steps
    batched         three prompts prefilled together, then batched decode steps (one token each)
"""

from __future__ import annotations

import os
import sys

import torch


def main() -> int:
    out, model_arg, tier = sys.argv[1:4]
    run(out, model_arg, tier, int(sys.argv[4]) if len(sys.argv) > 4 else 5)
    return 0


def run(out: str, model_arg: str, tier: str, steps: int = 5) -> None:
    from latentkv.commands.common import cluster_config
    from latentkv.config import CacheConfig, EngineConfig
    from latentkv.runtime import load

    torch.set_num_threads(1)

    clustered = int(os.environ.get("WORLD_SIZE", "1")) > 1

    class Args:  # the cluster flags, as the commands parse them
        cluster_timeout = 20.0 if clustered else None
        cluster_start_timeout = 120.0 if clustered else None
        cluster_secret = placement = disk_gbps = None
        no_head_experts = False

    engine = EngineConfig(ram_gb=0.6, threads=1, cache=CacheConfig(tier), cluster=cluster_config(Args))
    loaded = load(model_arg, engine, quiet=True, max_model_len=96, max_num_seqs=3)
    model, V = loaded.model, loaded.model.cfg.vocab_size
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, V, (n,), generator=g) for n in (11, 6, 17)]
    try:
        saved = {"single": _single(model, engine.cache, prompts[0], steps)}
        saved["batched"] = _batched(model, engine.cache, prompts, steps)
        if loaded.cluster is not None:
            saved["ranks"] = len(loaded.cluster.report(loaded.streamer))
    finally:
        loaded.close()
    torch.save(saved, out)


def _single(model, cache_config, prompt, steps: int) -> list[torch.Tensor]:
    cache = model.make_cache(model.tier(cache_config))
    logits = [model.forward(prompt, cache)[-1]]
    for _ in range(steps):
        logits.append(model.forward(logits[-1].argmax().reshape(1), cache)[-1])
    return logits


def _batched(model, cache_config, prompts, steps: int) -> list[torch.Tensor]:
    caches = [model.make_cache(model.tier(cache_config)) for _ in prompts]
    rows = model.prefill_batch(prompts, caches)
    logits = [rows]
    for _ in range(steps):
        rows = model.decode_batch(rows.argmax(-1), caches)
        logits.append(rows)
    return logits


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a cluster's head: as the CLI ends one
        from latentkv.cluster.rendezvous import end_process

        code = end_process(code)
    sys.exit(code)

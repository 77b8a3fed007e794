"""A head that drives the cluster layer directly (no model): `python driver.py MODE` as rank 0
of a cluster whose other ranks run `python -m latentkv generate MODEL ...` (workers serve until the
head ends). Prints one JSON line per event on stdout.

    exchange N    N rounds over every MoE layer: random rows to every remote owner's experts,
                  each output compared bit for bit with the head's own full store
    faults        rounds until told (a file appears), reporting each round's outcome
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch


def main() -> int:
    from latentkv import version
    from latentkv.cluster.head import ClusterLost, new_facts, start_head
    from latentkv.cluster.worker import describe_model
    from latentkv.commands.common import cluster_config
    from latentkv.config import CacheConfig, EngineConfig, ModelConfig
    from latentkv.experts.streamed import ExpertStreamer, StreamConfig
    from latentkv.streaming.attach import ensure_store
    from latentkv.streaming.cluster_plan import make_cluster_plan

    mode, model_arg = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)

    class Args:
        cluster_timeout = float(os.environ.get("DRIVER_TIMEOUT", "5"))
        cluster_start_timeout = 60.0
        cluster_secret = os.environ.get("DRIVER_SECRET")
        placement = None
        disk_gbps = None
        no_head_experts = False

    cfg = cluster_config(Args)
    engine = EngineConfig(ram_gb=0.6, threads=1)
    model = describe_model(model_arg, engine)
    mcfg = ModelConfig.from_hf(model.directory)
    store = ensure_store(model.directory, "f32")
    facts = new_facts(version(), model.fingerprint, model.model, "f32", None, cfg.secret)

    def plan_for(hellos, placement):
        rams = [int(0.6 * (1 << 30))] + [h.ram_bytes for _, h in sorted(hellos.items())]
        speeds = [1.0] * cfg.world_size
        return make_cluster_plan(
            mcfg,
            model.directory,
            rams,
            speeds,
            "f32",
            CacheConfig(),
            256,
            1,
            store_dir=store,
            placement=placement,
        )

    try:
        cluster = start_head(cfg, facts, model.hidden_size, max(model.layers.values()), plan_for)
    except Exception as exc:  # noqa: BLE001 - the test reads the line
        print(json.dumps({"event": "refused", "error": str(exc)}), flush=True)
        return 2
    streamer = ExpertStreamer(store, model.fingerprint, StreamConfig(budget=1 << 30))
    cluster.start_monitor()
    takeover = os.environ.get("DRIVER_TAKEOVER", "1") == "1"
    cluster.local_holds = lambda layer, e: takeover
    print(json.dumps({"event": "started", "placement": cluster.placement.digest}), flush=True)
    gen = torch.Generator().manual_seed(0)
    rounds = int(sys.argv[3]) if mode == "exchange" else 10**9
    stop = Path(os.environ.get("DRIVER_STOP", "/nonexistent"))
    for n in range(rounds):
        if stop.exists():
            break
        t0 = time.monotonic()
        try:
            checked = _round(cluster, streamer, model, gen)
            print(
                json.dumps(
                    {"event": "round", "n": n, "ok": True, "checked": checked, "status": cluster.status()}
                ),
                flush=True,
            )
        except ClusterLost as exc:
            print(
                json.dumps(
                    {
                        "event": "round",
                        "n": n,
                        "ok": False,
                        "error": str(exc),
                        "seconds": time.monotonic() - t0,
                        "status": cluster.status(),
                    }
                ),
                flush=True,
            )
        time.sleep(0.05 if mode == "faults" else 0)
    print(json.dumps({"event": "records", "records": cluster.refresh()}), flush=True)
    cluster.close()
    streamer.close()
    return 0


def _round(cluster, streamer, model, gen) -> int:
    """Every MoE layer: rows to each remote owner's experts; outputs checked against the head's own."""
    checked = 0
    for layer in sorted(model.layers):
        x = torch.randn(5, model.hidden_size, generator=gen)
        jobs, rows = {}, {}
        for e in range(model.layers[layer]):
            rows[e] = x[e % 4 : e % 4 + 1 + e % 2].clone()
            r = cluster.owner(layer, e)
            if r:
                jobs.setdefault(r, []).append((e, rows[e]))
        ex = cluster.exchange(layer, jobs)
        try:
            got = dict(cluster.outputs(ex))
        finally:
            cluster.finish(ex)
        want = streamer.get(layer, sorted(got))
        for e, y in got.items():
            if not torch.equal(y, want[e](rows[e])):
                raise AssertionError(f"layer {layer} expert {e}: the remote output differs")
            checked += 1
        cluster.prefetch(layer, {r: [e for e, _ in js] for r, js in jobs.items()})
    return checked


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a cluster's head: as the CLI ends one
        from latentkv.cluster.rendezvous import end_process

        code = end_process(code)
    sys.exit(code)

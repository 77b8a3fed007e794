"""Child of the memory-limit test: stream every expert of a store, round after round, through
an ExpertStreamer with the given budget (argv: DIR FINGERPRINT BUDGET ROUNDS [baseline])."""

from __future__ import annotations

import json
import random
import resource
import sys

from latentkv.experts.streamed import ExpertStreamer, StreamConfig


def main() -> None:
    directory, fingerprint, budget, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    s = ExpertStreamer(directory, fingerprint, StreamConfig(budget=budget, history=False, threads=2))
    if len(sys.argv) > 5:  # baseline: imports and an open store, nothing read
        print(json.dumps({"maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
        return
    rng = random.Random(0)
    layers = sorted(s.manifest.layers)
    for _ in range(rounds):  # each round asks for every expert, 4 at a time, in a random order
        for layer in layers:
            order = list(range(s.manifest.layers[layer].n_experts))
            rng.shuffle(order)
            for k in range(0, len(order), 4):
                ids = order[k : k + 4]
                s.layer(layer).prefetch(order[k + 4 : k + 8])
                got = s.layer(layer).get(ids)
                assert sorted(got) == sorted(ids)
                assert s.cache.resident_bytes <= budget
    t = s.snapshot()
    s.close()
    print(json.dumps({"maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, **t}))


if __name__ == "__main__":
    main()

"""The full-precision path stays byte-identical as KV tiers are added.

`tests/data/f32_logits_digest.json` holds SHA-256 digests of the exact float32 logit bytes
(prefill of 40 tokens, then 12 decode steps) recorded before any quantized tier existed. With
`f32` chosen, or nothing chosen, the engine must reproduce them bit for bit. Regenerate only
for a deliberate change to the f32 arithmetic: `python tests/kv/test_f32_identity.py --record`.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

DIGESTS = Path(__file__).parent.parent / "data" / "f32_logits_digest.json"
MODELS = ("glm5-tiny", "glm5-tiny-dsa", "dsv3-tiny")


def logits_digest(model, cache) -> str:
    prompt = torch.randint(2, model.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(7))
    digest = hashlib.sha256()
    digest.update(model.forward(prompt, cache, all_logits=True).numpy().tobytes())
    token = torch.tensor([3])
    for _ in range(12):
        logits = model.forward(token, cache)
        digest.update(logits.numpy().tobytes())
        token = logits[-1].argmax().view(1)
    return digest.hexdigest()


@pytest.mark.parametrize("name", MODELS)
def test_f32_logits_are_bit_identical_to_the_recorded_ones(name, ours):
    torch.set_num_threads(1)  # the recorded digests are single-threaded
    model = ours(name)
    recorded = json.loads(DIGESTS.read_text())[name]
    assert logits_digest(model, model.make_cache()) == recorded


if __name__ == "__main__" and "--record" in sys.argv:
    from latentkv.eval import oracle
    from latentkv.models.weights import load_model

    torch.set_num_threads(1)
    out = {}
    for name in MODELS:
        model = load_model(oracle.ensure_built(name))
        out[name] = logits_digest(model, model.make_cache())
    DIGESTS.write_text(json.dumps(out, indent=1) + "\n")
    print(out)

"""The full-precision path stays the same as KV tiers and formats are added, on any x86-64 CPU.

One run = prefill of 40 seeded tokens (every position's logits), then 12 decode steps fed the
tokens recorded in `tests/data/f32_logits.json` (the recording machine's greedy tokens, fed as
given so that a near-tie breaking the other way on another CPU cannot change what is compared).
Float32 logit *bytes* depend on the kernels: MKL, oneDNN and ATen pick different code per vendor
and instruction set (and torch build), so the run is checked three ways.

(a) Paths that must agree, exactly, within this run (any CPU): no tier chosen, `f32`, `auto`
    and the default `CacheConfig()`; a run saved to a KV file mid-way and resumed in f32; one
    batched decode step over caches in a `SlotPool` against the same step over their own
    buffers. Catches a change that reaches one of these paths and not the others (a tier or
    file format that stops being the identity for f32, a resumed cache that differs by a bit).
    It cannot see a change to arithmetic every path shares: (b) and (c) are for that.
(b) The recorded logits themselves (the first 64 of 8 rows per model), compared on any CPU
    within LOGIT_TOLERANCE. Measured spread of these logits (|logit| <= 1.1) across kernel
    families on one Intel Xeon (AVX512 / ATEN_CPU_CAPABILITY=avx2 / =default): at most 6.0e-7;
    the tolerance, 1e-5, is ~17x that, room for another vendor's MKL. Catches a real change to
    the computation (a wrong scale, norm, rope or mask moves logits by 1e-3 and more) on every
    CPU; a change below ~1e-5 (an RMSNorm eps nudged by 1e-7) passes here and fails (c).
(c) Exact SHA-256 of the run's logit bytes per kernel family: CPU vendor, torch's CPU capability
    (`torch.backends.cpu.get_cpu_capability()`, which ATEN_CPU_CAPABILITY lowers), the ISA
    extensions MKL dispatches on, and torch's minor version. Compared exactly where this
    machine's family is recorded (skipped, with the family in the reason, where it is not).
    Catches any change at all to the f32 arithmetic, down to the last bit, on a recorded CPU.

Each part fails on its own kind of change (checked by mutating one op, then the suite):
RMSNorm eps x1.1 -> (b) and (c) fail; 1e-7 added to every logit -> only (c) fails; 1e-7 added
to the rows of an f32 KV file as it loads -> only (a) fails.

Regenerate only for a deliberate change to the f32 arithmetic:
    python tests/kv/test_f32_identity.py --record            # add/refresh this CPU's digests
    python tests/kv/test_f32_identity.py --record --reset    # new values, drop every other digest
(run the first under ATEN_CPU_CAPABILITY=avx2 and =default too, to record those families).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.numerics  # CI runs these under a second CPU capability too

RECORDED = Path(__file__).parent.parent / "data" / "f32_logits.json"
MODELS = ("glm5-tiny", "glm5-tiny-dsa", "dsv3-tiny")
PROMPT_LEN, STEPS = 40, 12
ROWS = (0, 1, 19, 39, 40, 44, 48, 51)  # 4 prefill positions, 4 decode steps
FIRST_K = 64
LOGIT_TOLERANCE = 1e-5  # absolute; see (b) in the module docstring
# ISA extensions that change which MKL / oneDNN kernels run, beyond torch's capability level.
MKL_FLAGS = ("avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "avx_vnni")
KERNEL_ENV = (
    "MKL_CBWR",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_DEBUG_CPU_TYPE",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
)


def kernel_family() -> str:
    """'GenuineIntel AVX512 [amx_tile,...] torch-2.13': the key of this machine's digests (with
    any MKL / oneDNN dispatch override in the environment appended: those change kernels too)."""
    vendor, flags = "unknown-vendor", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "vendor_id":
                vendor = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    isa = ",".join(f for f in MKL_FLAGS if f in flags)
    torch_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    family = f"{vendor} {torch.backends.cpu.get_cpu_capability()} [{isa}] torch-{torch_minor}"
    overrides = [f"{k}={os.environ[k]}" for k in KERNEL_ENV if os.environ.get(k)]
    return family + "".join(f" {o}" for o in overrides)


def prompt_for(model) -> torch.Tensor:
    return torch.randint(2, model.cfg.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7))


def run_logits(model, cache, fed: list[int], start: int = 0) -> torch.Tensor:
    """The run's logits [PROMPT_LEN + STEPS, vocab], from decode step `start` on if the cache
    already holds the prompt and the first `start` fed tokens (then only those rows)."""
    rows = [] if start else [model.forward(prompt_for(model), cache, all_logits=True)]
    rows += [model.forward(torch.tensor([t]), cache) for t in fed[start:]]
    return torch.cat(rows)


def digest(logits: torch.Tensor) -> str:
    return hashlib.sha256(logits.contiguous().numpy().tobytes()).hexdigest()


def recorded() -> dict:
    return json.loads(RECORDED.read_text())


# --- (a) within one run ------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_every_way_of_asking_for_f32_gives_the_same_bytes(name, ours):
    from latentkv.config import CacheConfig

    model = ours(name)
    fed = recorded()["models"][name]["fed"]
    reference = run_logits(model, model.make_cache(), fed)
    for config in (CacheConfig("f32"), CacheConfig("auto"), CacheConfig("fp32"), CacheConfig()):
        assert torch.equal(run_logits(model, model.make_cache(model.tier(config)), fed), reference), config


@pytest.mark.parametrize("name", MODELS)
def test_a_run_resumed_from_a_kv_file_in_f32_gives_the_same_bytes(name, ours, checkpoint, tmp_path):
    from latentkv.kv.store import KVFile, header_for
    from latentkv.models.loader import Checkpoint

    model = ours(name)
    fed = recorded()["models"][name]["fed"]
    reference = run_logits(model, model.make_cache(), fed)
    half = STEPS // 2
    cache = model.make_cache()
    first = run_logits(model, cache, fed[:half])
    tokens = prompt_for(model).tolist() + fed[:half]
    header = header_for(model.cfg, cache, Checkpoint(checkpoint(name)).fingerprint())
    with KVFile.create(tmp_path / "run.kv", header) as f:
        f.append(tokens, cache, 0, len(tokens))
    with KVFile.open(tmp_path / "run.kv") as f:
        resumed = f.load(expected=header).to_cache(model.tier())
    rest = run_logits(model, resumed, fed, start=half)
    assert torch.equal(torch.cat([first, rest]), reference)


def test_the_pooled_batched_step_gives_the_own_buffers_bytes(ours):
    from latentkv.kv.slots import SlotPool

    model = ours("glm5-tiny-dsa")
    g = torch.Generator().manual_seed(11)
    own = []
    for n in (3, 9, 17):
        cache = model.make_cache()
        model.forward(torch.randint(2, model.cfg.vocab_size, (n,), generator=g), cache)
        own.append(cache)
    pooled = [c.tier.from_state(c.state()) for c in own]
    pool = SlotPool(model.layout, slots=3, capacity=8)
    assert all(pool.place(c) for c in pooled)
    tokens = torch.tensor([5, 6, 7])
    for _ in range(4):
        expected, got = model.decode_batch(tokens, own), model.decode_batch(tokens, pooled, pool)
        assert torch.equal(got, expected)
        tokens = expected.argmax(-1)


# --- (b) recorded values, within a tolerance, on any CPU -------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_f32_logits_match_the_recorded_values(name, ours):
    model = ours(name)
    entry = recorded()["models"][name]
    logits = run_logits(model, model.make_cache(), entry["fed"])
    got = logits[list(ROWS), :FIRST_K].double()
    expected = torch.tensor(entry["logits"], dtype=torch.float64)
    assert got.shape == expected.shape
    worst = float((got - expected).abs().max())
    assert worst <= LOGIT_TOLERANCE, f"{name}: logits moved by {worst:.3g} (tolerance {LOGIT_TOLERANCE})"


# --- (c) exact bytes where this kernel family is recorded ------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_f32_logits_are_bit_identical_to_this_kernel_familys_recording(name, ours):
    family = kernel_family()
    digests = recorded()["digests"].get(family)
    if digests is None:
        pytest.skip(f"no f32 digest recorded for kernel family {family!r}; (a) and (b) still ran")
    model = ours(name)
    logits = run_logits(model, model.make_cache(), recorded()["models"][name]["fed"])
    assert digest(logits) == digests[name], f"{name}: f32 logit bytes changed on {family}"


def test_kernel_family_names_this_machine():
    family = kernel_family()
    vendor, capability, isa, version = family.split(" ")[:4]
    assert capability == torch.backends.cpu.get_cpu_capability()
    assert isa.startswith("[") and isa.endswith("]") and version.startswith("torch-2.")


# --- recording ----------------------------------------------------------------------------------


def _record(reset: bool) -> None:
    import tempfile

    from latentkv.eval import oracle
    from latentkv.models.registry import builtin_path
    from latentkv.models.weights import load_model

    torch.set_num_threads(1)  # as conftest sets it for the tests
    old = {} if reset or not RECORDED.exists() else recorded()
    models = old.get("models", {})
    digests = {}
    root = Path(tempfile.mkdtemp())
    for name in MODELS:
        # built here, as conftest builds them: under ATEN_CPU_CAPABILITY=default the seeded
        # weights themselves differ in the last bit (torch's scalar normal_ vs its vectorized one)
        built = builtin_path("tiny") if name == "glm5-tiny" else oracle.build(oracle.SPECS[name], root / name)
        model = load_model(built, device="cpu")
        if name not in models:  # greedy tokens of this machine, fed as given from now on
            cache, token, fed = model.make_cache(), 3, []
            model.forward(prompt_for(model), cache)
            for _ in range(STEPS):
                fed.append(token)
                token = int(model.forward(torch.tensor([token]), cache)[-1].argmax())
            logits = run_logits(model, model.make_cache(), fed)
            rows = logits[list(ROWS), :FIRST_K].tolist()
            models[name] = {"fed": fed, "logits": [[float(f"{v:.9g}") for v in r] for r in rows]}
        digests[name] = digest(run_logits(model, model.make_cache(), models[name]["fed"]))
    out = {
        "procedure": f"prefill {PROMPT_LEN} tokens (seed 7), then {STEPS} decode steps fed 'fed'; "
        f"'logits' holds rows {list(ROWS)}, first {FIRST_K} values; 1 thread",
        "notes": {} if reset else old.get("notes", {}),
        "models": models,
        "digests": {**old.get("digests", {}), kernel_family(): digests},
    }
    RECORDED.write_text(json.dumps(out, indent=1) + "\n")
    print(f"recorded the digests of {kernel_family()!r}")


if __name__ == "__main__" and "--record" in sys.argv:
    _record(reset="--reset" in sys.argv)

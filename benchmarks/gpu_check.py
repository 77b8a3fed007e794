"""The prepared GPU check: one command, JSON out, under 8 minutes on one H200.

    python benchmarks/gpu_check.py [--out benchmarks/results/gpu-check.json]
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu-check.json   # on the CPU, small

What it checks (each section runs on its own: an error is recorded in the JSON and the next
section still runs; a section that would overrun the time budget is skipped and says so):

- env: the device, its multiprocessors and memory, torch / triton versions.
- copy: the device's measured copy bandwidth (a 1 GiB tensor copied device to device, bytes
  read + written over the median time): the yardstick for the decode kernel.
- codecs: every KV tier's codecs on the device (their tables copied there once): rows encoded on
  the device against the same rows encoded on the CPU (the share of identical code bytes, the
  largest scale difference), the CPU's codes decoded on the device against the CPU's decode, and
  the round-trip error on the device against the CPU's. ok: the decodes agree within 1e-6 and
  the device's round-trip error is within 1% of the CPU's.
- kernels: every tier the Triton decode kernel serves, at GLM-5's widths (512 + 64, 64 heads,
  4 ragged sequences, split-K, and the DSA gather on a few), against the torch consumers
  (`latentkv.attention.consumers`, run on CPU copies of the same bytes) and a float64
  dequantize-then-attend reference, for float32 ("ieee") and bfloat16 operands.
- bandwidth: the decode kernel at 4k, 32k and 128k tokens of context (one sequence, 64 heads):
  stored bytes read per call over the median time (triton.testing.do_bench, L2 flushed between
  calls), as GB/s and as a share of the copy bandwidth. Goal: fp8 and q4s >= 70% at 32k.
- weights: bf16, int8 and int4 matrices built on the device from a file's pieces (int4 in the
  CUDA op's own layout, converted at load): the same weight read back, and the product against
  the dequantized matrix in float64 at 1 and 64 rows.
- oracle: our engine on the device (f32 weights and cache) against transformers in float32 on
  the CPU, on every oracle model and builtin:fixture: greedy tokens and teacher-forced argmax
  equal, logits within 1e-4 (the fixture: 1e-3, as its own test).
- decode: builtin:slice decode tok/s with bf16 and int4 weights, on the device and on the CPU.
- experts: builtin:slice decode (bf16, then int4 weights) through the runtime with a --vram-gb
  budget that holds a quarter of the routed experts behind the VRAM expert cache
  (experts/device_cache.py), the rest in page-locked host RAM (home pinned) or streamed from the
  disk store through the page-locked staging ring (home disk; int4 codes converted to the CUDA
  op's layout in their slots); tok/s, the cache's counters (staged copies, staging waits), and
  whether the greedy tokens equal the all-resident model's in the same format on the device.

--dry-run runs every section on the CPU at small shapes (the kernels under triton's
interpreter, builtin:tiny instead of builtin:slice), so the script is exercised by the test
suite (tests/benchmarks/test_gpu_check.py) and is not broken when a GPU finally runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

DEFAULT_OUT = Path(__file__).parent / "results" / "gpu-check.json"
BUDGET_S = 450  # stop starting sections past this (the whole check must end within 8 minutes)


class Shapes:
    """The sizes each section works at: an H200's, or the dry run's."""

    def __init__(self, dry: bool):
        self.dry = dry
        self.n_c, self.n_r, self.heads = (64, 16, 5) if dry else (512, 64, 64)
        self.lengths = (37, 1, 20) if dry else (3000, 1, 777, 2048)
        self.contexts = (64,) if dry else (4096, 32768, 131072)
        self.pool_rows = 48 if dry else 4096  # distinct rows of the bandwidth section's contexts
        self.copy_bytes = (4 << 20) if dry else (1 << 30)
        self.kernel_tiers = (
            ("f32", "fp8", "q4s", "tq4-r8")
            if dry
            else (
                "f32",
                "bf16",
                "fp8",
                "q8_0",
                "q4_0",
                "q8s",
                "q4s",
                "q5s",
                "q4_1",
                "wq4",
                "hq4_0",
                "tq4",
                "tq3",
                "tq4-r8",
            )
        )
        self.bandwidth_tiers = ("fp8",) if dry else ("f32", "bf16", "fp8", "q8s", "q4s", "tq4")
        self.decode_model = "builtin:tiny" if dry else "builtin:slice"
        self.decode_tokens = 2 if dry else 32
        self.decode_context = 8 if dry else 1024


def section(results: dict, name: str, budget_end: float, fn: Callable[[], object]) -> None:
    """Run one section into results[name]; record its error or that the budget ran out."""
    if time.monotonic() > budget_end:
        results[name] = {"skipped": "time budget spent"}
        return
    start = time.monotonic()
    try:
        results[name] = {"result": fn()}
    except Exception as exc:  # a broken section must not hide the others' results
        results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    results[name]["seconds"] = round(time.monotonic() - start, 2)
    print(f"[gpu_check] {name}: {'error' if 'error' in results[name] else 'done'} "
          f"in {results[name]['seconds']} s", file=sys.stderr, flush=True)  # fmt: skip


def env(device) -> dict:
    import torch

    out = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device)}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
        )
    else:
        out.update(
            name=platform.processor() or platform.machine(), interpreter=os.environ.get("TRITON_INTERPRET")
        )
    return out


def timed(fn: Callable[[], object], device, repeats: int = 20) -> float:
    """Median seconds of fn(): triton's do_bench on a GPU (L2 flushed between calls), else a
    plain clock on the CPU."""
    import torch

    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=5, rep=max(25, repeats * 5), return_mode="median") / 1e3
    times = []
    for _ in range(min(repeats, 3)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.tensor(0)  # keep the signature symmetric: nothing to synchronise on the CPU
    return sorted(times)[len(times) // 2]


def _sig(x: float) -> float:
    return float(f"{x:.3g}")


def copy_bandwidth(device, shapes: Shapes) -> dict:
    import torch

    src = torch.empty(shapes.copy_bytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device)
    return {
        "bytes": shapes.copy_bytes,
        "seconds": seconds,
        "gb_per_s": _sig(2 * shapes.copy_bytes / seconds / 1e9),
    }


def _rel(a, b) -> float:
    """Relative L2 distance of a from b (both moved to the CPU, float64)."""
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def codecs(device, shapes: Shapes) -> list[dict]:
    """Every tier's codecs on the device against the CPU, on the same random rows."""
    import torch

    from latentkv.config import KV_CACHE_DTYPES
    from latentkv.kv.codecs import TIERS, EncodedRows, get_codec

    gen = torch.Generator().manual_seed(11)
    rows = 64 if shapes.dry else 1024
    out = []
    for tier in KV_CACHE_DTYPES:
        for part, width in (("c", shapes.n_c), ("r", shapes.n_r)):
            codec = get_codec(getattr(TIERS[tier], part), width)
            x = torch.randn(rows, width, generator=gen) * 3
            cpu = codec.encode(x)
            dev = codec.encode(x.to(device))
            assert dev.codes.device.type == device.type, (tier, part, dev.codes.device)
            same = (dev.codes.cpu() == cpu.codes).all(dim=1).float().mean().item()
            scale_diff = (dev.scales.cpu() - cpu.scales).abs().max().item() if cpu.scales.numel() else 0.0
            decoded = codec.decode(cpu)
            decode_diff = _rel(
                codec.decode(EncodedRows(cpu.codes.to(device), cpu.scales.to(device))), decoded
            )
            err_cpu, err_dev = _rel(decoded, x), _rel(codec.decode(dev), x)
            out.append(
                {
                    "tier": tier,
                    "part": part,
                    "codec": codec.name,
                    "rows_with_identical_codes": _sig(same),
                    "max_scale_diff": _sig(scale_diff),
                    "decode_rel_diff": _sig(decode_diff),
                    "roundtrip_err_cpu": _sig(err_cpu),
                    "roundtrip_err_device": _sig(err_dev),
                    "ok": decode_diff <= 1e-6 and err_dev <= err_cpu * 1.01 + 1e-7,
                }
            )
    _sync(device)
    return out


def _case(tier: str, lengths, shapes: Shapes, device, seed: int):
    """Random rows of every sequence encoded in `tier`, on the CPU and on the device."""
    import torch

    from latentkv.attention.triton.decode import SequenceRows
    from latentkv.kv.codecs import TIERS, get_codec

    t = TIERS[tier]
    codec_c, codec_r = get_codec(t.c, shapes.n_c), get_codec(t.r, shapes.n_r)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(lengths), shapes.heads, shapes.n_c + shapes.n_r, generator=gen) * shapes.n_c**-0.5
    encoded, stored = [], []
    for T in lengths:
        x = torch.randn(T, shapes.n_c + shapes.n_r, generator=gen)
        c, r = codec_c.encode(x[:, : shapes.n_c]), codec_r.encode(x[:, shapes.n_c :])
        encoded.append((c, r))
        if tier == "f32":
            rows = torch.cat([c.codes.view(torch.float32), r.codes.view(torch.float32)], 1).to(device)
            stored.append(SequenceRows(rows[:, : shapes.n_c], None, rows[:, shapes.n_c :], None))
        else:
            stored.append(
                SequenceRows(c.codes.to(device), c.scales.to(device), r.codes.to(device), r.scales.to(device))
            )
    return codec_c, codec_r, q, encoded, stored


def _errors(codec_c, codec_r, q, encoded, out, picks=None) -> tuple[float, float]:
    """Largest error of out [B, H, n_c] against the torch consumers and the float64 reference,
    relative to max(1, the reference's largest value)."""
    import torch

    from latentkv.attention import consumers

    torch_err = f64_err = 0.0
    for b, (c, r) in enumerate(encoded):
        if picks is not None:
            c, r = c.select(picks[b]), r.select(picks[b])
        ref = consumers.attend(codec_c, codec_r, q[b].unsqueeze(1), c, r)[:, 0]
        rows = torch.cat([codec_c.decode(c), codec_r.decode(r)], 1).double()
        f64 = torch.softmax(q[b].double() @ rows.T, -1) @ rows[:, : codec_c.width]
        got = out[b].double()
        torch_err = max(torch_err, float((got - ref.double()).abs().max()) / max(1.0, float(ref.abs().max())))
        f64_err = max(f64_err, float((got - f64).abs().max()) / max(1.0, float(f64.abs().max())))
    return torch_err, f64_err


TOLERANCE = {"ieee": 1e-4, "bf16": 5e-2}
GATHER_TIERS = ("f32", "fp8", "q4s", "tq4", "tq4-r8")


def kernels(device, shapes: Shapes) -> list[dict]:
    import torch

    from latentkv.attention.triton.decode import mla_decode

    rows = []
    for i, tier in enumerate(shapes.kernel_tiers):
        codec_c, codec_r, q, encoded, stored = _case(tier, shapes.lengths, shapes, device, seed=i)
        # float32 products for the tiers the gather covers too; bf16 (the backend's) for all: each
        # variant is one compile of a few seconds, and the whole check has 8 minutes
        for precision in ("ieee", "bf16") if tier in GATHER_TIERS else ("bf16",):
            out, _ = mla_decode(
                q.to(device), codec_c, codec_r, stored, list(shapes.lengths), precision=precision
            )
            torch_err, f64_err = _errors(codec_c, codec_r, q, encoded, out.cpu())
            rows.append(_row(tier, precision, "split-k", torch_err, f64_err))
        if tier in GATHER_TIERS:  # the DSA gather: a random half of each sequence
            gen = torch.Generator().manual_seed(100 + i)
            picks = [torch.randperm(T, generator=gen)[: max(1, T // 2)] for T in shapes.lengths]
            index = torch.zeros(len(picks), max(len(p) for p in picks), dtype=torch.int32)
            for b, p in enumerate(picks):
                index[b, : len(p)] = p.to(torch.int32)
            counts = [len(p) for p in picks]
            out, _ = mla_decode(q.to(device), codec_c, codec_r, stored, counts, index.to(device))
            torch_err, f64_err = _errors(codec_c, codec_r, q, encoded, out.cpu(), picks)
            rows.append(_row(tier, "ieee", "gather", torch_err, f64_err))
    return rows


def _row(tier: str, precision: str, mode: str, torch_err: float, f64_err: float) -> dict:
    ok = max(torch_err, f64_err) <= TOLERANCE[precision]
    return {
        "tier": tier,
        "precision": precision,
        "mode": mode,
        "vs_torch": torch_err,
        "vs_f64": f64_err,
        "ok": ok,
    }


def _long_rows(tier: str, context: int, shapes: Shapes, device):
    """One sequence of `context` stored rows on the device: a pool of `shapes.pool_rows` encoded
    rows repeated (encoding 128k rows with a searched codec would take minutes of the budget; the
    bytes are what is timed, not their values)."""
    import torch

    from latentkv.attention.triton.decode import SequenceRows

    codec_c, codec_r, q, encoded, _ = _case(
        tier, (min(context, shapes.pool_rows),), shapes, torch.device("cpu"), seed=1
    )
    (c, r) = encoded[0]
    reps = -(-context // len(c))

    def grow(t):
        return t.to(device).repeat(reps, 1)[:context].contiguous()

    if tier == "f32":
        full = grow(torch.cat([c.codes.view(torch.float32), r.codes.view(torch.float32)], 1))
        stored = SequenceRows(full[:, : shapes.n_c], None, full[:, shapes.n_c :], None)
    else:
        stored = SequenceRows(grow(c.codes), grow(c.scales), grow(r.codes), grow(r.scales))
    return codec_c, codec_r, q.to(device), stored


def bandwidth(device, shapes: Shapes, copy_gbps: float | None) -> list[dict]:
    from latentkv.attention.triton.decode import mla_decode

    rows = []
    for tier in shapes.bandwidth_tiers:
        precision = "ieee" if tier == "f32" else "bf16"
        for context in shapes.contexts:
            codec_c, codec_r, qd, stored = _long_rows(tier, context, shapes, device)
            nbytes = context * (codec_c.bytes_per_row + codec_r.bytes_per_row)

            def call(qd=qd, codec_c=codec_c, codec_r=codec_r, stored=stored, n=context, precision=precision):
                return mla_decode(qd, codec_c, codec_r, [stored], [n], precision=precision)

            call()  # compile outside the timing
            seconds = timed(call, device)
            gbps = nbytes / seconds / 1e9
            rows.append(
                {
                    "tier": tier,
                    "precision": precision,
                    "context": context,
                    "bytes": nbytes,
                    "seconds": seconds,
                    "gb_per_s": _sig(gbps),
                    "share_of_copy": _sig(gbps / copy_gbps) if copy_gbps else None,
                }
            )
            del stored
    return rows


def weights(device, shapes: Shapes) -> list[dict]:
    """Each weight format built on the device from the file's (portable) pieces: its product
    against its own dequantized matrix in float64 (bfloat16 activations), at 1 and 64 rows."""
    import torch

    from latentkv.weights.base import format_class, make_linear

    out_f, in_f = (96, 128) if shapes.dry else (6144, 2048)
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(out_f, in_f, generator=gen) * in_f**-0.5
    rows = []
    for fmt in ("bf16", "int8", "int4"):
        cls = format_class(fmt)
        cpu = make_linear(w, fmt)
        if hasattr(cls, "quantize_state"):  # what a converted file holds, moved to the device
            state = cls.quantize_state(w)
            lin = cls.from_state({k: v.to(device) for k, v in state.items()}, in_f)
        else:
            lin = make_linear(w.to(device), fmt)
        ref_w = cpu.dequantize().double()
        same = bool(torch.equal(lin.dequantize().cpu(), cpu.dequantize()))
        for m in (1, 64):
            x = torch.randn(m, in_f, generator=gen)
            ref = x.to(torch.bfloat16).double() @ ref_w.T
            got = lin(x.to(device)).double().cpu()
            err = float((got - ref).abs().max() / ref.abs().max())
            rows.append(
                {"format": fmt, "rows": m, "error": err, "same_weight": same, "ok": same and err <= 2e-2}
            )
    return rows


def _transformers_greedy(directory: Path, prompt: list[int], steps: int):
    """transformers in float32 on the CPU: greedy tokens and teacher-forced logits [N, vocab]."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()  # the fixture's MTP layer: not a transformers weight
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        greedy = [int(out.logits[0, -1].argmax())]
        while len(greedy) < steps:
            out = model(torch.tensor([greedy[-1:]]), past_key_values=out.past_key_values, use_cache=True)
            greedy.append(int(out.logits[0, -1].argmax()))
        logits = model(torch.tensor([prompt + greedy])).logits[0].float()
    return greedy, logits


def _ours_greedy(directory: Path, prompt: list[int], steps: int, device):
    """Our engine on `device` (f32 weights, f32 cache): greedy tokens and teacher-forced logits."""
    import torch

    from latentkv.models.weights import load_model

    model = load_model(directory, "f32", device=str(device))
    cache = model.make_cache()
    logits = model.forward(torch.tensor(prompt, device=device), cache)[-1]
    greedy = [int(logits.argmax())]
    while len(greedy) < steps:
        greedy.append(int(model.forward(torch.tensor(greedy[-1:], device=device), cache)[-1].argmax()))
    tf = model.forward(torch.tensor(prompt + greedy, device=device), model.make_cache(), all_logits=True)
    return greedy, tf.float().cpu()


def oracle(device, shapes: Shapes) -> list[dict]:
    from latentkv.eval import oracle as spec_oracle
    from latentkv.models.registry import builtin_path

    names = ["glm5-tiny"] if shapes.dry else list(spec_oracle.SPECS)  # glm5-tiny is bundled: nothing to build
    models = [
        (n, spec_oracle.ensure_built(n), spec_oracle.prompt_ids(spec_oracle.SPECS[n]), 1e-4) for n in names
    ]
    if not shapes.dry:
        models.append(("builtin:fixture", builtin_path("fixture"), list(range(40, 52)), 1e-3))
    rows = []
    for name, directory, prompt, tolerance in models:
        steps = spec_oracle.GREEDY_TOKENS
        hf_greedy, hf_logits = _transformers_greedy(directory, prompt, steps)
        greedy, logits = _ours_greedy(directory, prompt, steps, device)
        tf_hits = int((logits.argmax(-1) == hf_logits.argmax(-1)).sum())
        diff = float((logits - hf_logits).abs().max())
        ok = greedy == hf_greedy and tf_hits == len(hf_logits) and diff <= tolerance
        rows.append(
            {
                "model": name,
                "greedy": f"{sum(a == b for a, b in zip(greedy, hf_greedy, strict=True))}/{steps}",
                "tf": f"{tf_hits}/{len(hf_logits)}",
                "max_abs_logit_diff": diff,
                "tolerance": tolerance,
                "ok": ok,
            }
        )
    return rows


def decode_speed(device, shapes: Shapes) -> list[dict]:
    """Decode tok/s at `decode_context` tokens of context, per weight format, on the device and the CPU."""
    import torch

    from latentkv.models.registry import resolve
    from latentkv.models.weights import load_model

    directory = resolve(shapes.decode_model)
    rows = []
    places = [device, torch.device("cpu")] if device.type != "cpu" else [device]
    for weights in ("bf16", "int8", "int4"):
        for place in places:
            model = load_model(directory, weights, device=str(place))
            cache = model.make_cache()
            vocab = model.cfg.vocab_size
            prompt = torch.arange(shapes.decode_context, device=place) % (vocab - 2) + 2
            logits = model.forward(prompt, cache)
            token = logits[-1].argmax().reshape(1)
            _sync(place)
            start = time.perf_counter()
            for _ in range(shapes.decode_tokens):
                token = model.forward(token, cache)[-1].argmax().reshape(1)
            _sync(place)
            seconds = time.perf_counter() - start
            rows.append(
                {
                    "model": shapes.decode_model,
                    "weights": weights,
                    "device": str(place),
                    "context": shapes.decode_context,
                    "tokens": shapes.decode_tokens,
                    "tok_per_s": round(shapes.decode_tokens / seconds, 2),
                }
            )
            del model, cache
    return rows


EXPERT_CASES = {"bf16": ("pinned", "disk"), "int4": ("pinned", "disk")}  # weights -> the experts' homes


def _quarter_budget(spec) -> int:
    """VRAM bytes for `spec`'s model: the dense weights, KV, activations and staging, plus a quarter
    of the routed experts (so the plan's home is `pinned`)."""
    from latentkv.streaming.gpu_plan import make_gpu_plan

    whole = make_gpu_plan(
        spec.model_cfg, spec.directory, 1 << 50, None, spec.weight_format, max_model_len=spec.max_model_len
    )
    fixed = whole.dense_bytes + whole.kv_bytes + whole.activation_bytes
    staging = (2 * whole.top_k) * whole.expert_extent_bytes
    return fixed + staging + whole.expert_bytes // 4


def _cached_spec(base, home: str, device):
    """`base` with a GPU plan holding a quarter of the experts in VRAM. pinned: on CUDA through
    resolve_load's --vram-gb (the user's path); in the dry run the same plan handed to the CPU
    build. disk: that plan with its home set to the disk and a host cache of a quarter of the
    experts (a model this small has fewer experts than the planner's read and staging buffers, so
    no --ram-gb plans it), built the same way."""
    import dataclasses

    from latentkv.config import EngineConfig
    from latentkv.runtime import resolve_load
    from latentkv.streaming.gpu_plan import make_gpu_plan

    vram = _quarter_budget(base)
    if device.type == "cuda":
        engine = EngineConfig(weight_dtype=base.weight_format, device="cuda", vram_gb=vram / 2**30)
        spec = resolve_load(base.model_arg, engine, base.max_model_len)
    else:
        plan = make_gpu_plan(
            base.model_cfg, base.directory, vram, None, base.weight_format, max_model_len=base.max_model_len
        )
        spec = dataclasses.replace(base, gpu_plan=plan)
    if home == "disk":
        plan = spec.gpu_plan
        quarter = max(1, plan.experts_total // 4)
        plan = dataclasses.replace(
            plan,
            expert_home="disk",
            pinned_experts=quarter,
            pinned_expert_bytes=quarter * plan.expert_extent_bytes,
        )
        spec = dataclasses.replace(spec, gpu_plan=plan)
    return spec, vram


def _greedy_row(loaded, device, shapes: Shapes) -> dict:
    """Greedy decode of `decode_tokens` after a `decode_context` prompt: tokens and tok/s."""
    import torch

    model = loaded.model
    cache = model.make_cache()
    vocab = model.cfg.vocab_size
    prompt = torch.arange(shapes.decode_context, device=device) % (vocab - 2) + 2
    token = model.forward(prompt, cache)[-1].argmax().reshape(1)
    tokens = [int(token)]
    _sync(device)
    start = time.perf_counter()
    for _ in range(shapes.decode_tokens):
        token = model.forward(token, cache)[-1].argmax().reshape(1)
        tokens.append(int(token))
    _sync(device)
    seconds = time.perf_counter() - start
    return {"tok_per_s": round(shapes.decode_tokens / seconds, 2), "greedy": tokens}


def experts_cached(device, shapes: Shapes) -> list[dict]:
    """Decode through the VRAM expert cache (a quarter of the experts in VRAM, the rest in
    page-locked host RAM or streamed from the disk store through the staging ring), bf16 and int4
    weights, each beside the all-resident model in the same format."""
    from latentkv.config import EngineConfig
    from latentkv.runtime import build, load, resolve_load

    length = shapes.decode_context + shapes.decode_tokens + 8
    rows = []
    for weights, homes in EXPERT_CASES.items():
        base = resolve_load(
            shapes.decode_model, EngineConfig(weight_dtype=weights, device=device.type), length
        )
        resident = None
        for home in ("resident", *homes):
            if home == "resident":
                loaded, vram = load(shapes.decode_model, base.engine, True, length), None
            else:
                spec, vram = _cached_spec(base, home, device)
                loaded = build(spec, quiet=True)
            try:
                row = {
                    "model": shapes.decode_model,
                    "weights": weights,
                    "experts": home if home == "resident" else "vram-cache",
                    "device": str(device),
                    "vram_gib": None if vram is None else round(vram / 2**30, 3),
                    "context": shapes.decode_context,
                    "tokens": shapes.decode_tokens,
                    **_greedy_row(loaded, device, shapes),
                }
                if loaded.device_cache is not None:
                    row["plan_home"] = spec.gpu_plan.expert_home
                    row["cache"] = loaded.device_cache.snapshot()
                    row["same_tokens_as_resident"] = row["greedy"] == resident["greedy"]
                    row["ok"] = row["same_tokens_as_resident"]
                else:
                    resident = row
            finally:
                loaded.close()
            rows.append(row)
            del loaded
    return rows


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="the CPU at small shapes (kernels interpreted)"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON file (default: {DEFAULT_OUT})")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="start no section after this")
    parser.add_argument(
        "--only",
        default=None,
        help="comma list of sections (env,copy,codecs,kernels,bandwidth,weights,oracle,decode,experts)",
    )
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates the kernels
        from latentkv.attention.triton.interpreter import fix_bf16_dot

        fix_bf16_dot()
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; run with --dry-run on the CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    shapes = Shapes(args.dry_run)
    wanted = None if args.only is None else set(args.only.split(","))
    budget_end = time.monotonic() + args.budget_s
    results: dict = {"dry_run": args.dry_run, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def run(name: str, fn: Callable[[], object]) -> None:
        if wanted is None or name in wanted:
            section(results, name, budget_end, fn)

    run("env", lambda: env(device))
    run("copy", lambda: copy_bandwidth(device, shapes))
    copy_gbps = results.get("copy", {}).get("result", {}).get("gb_per_s")
    run("codecs", lambda: codecs(device, shapes))
    run("kernels", lambda: kernels(device, shapes))
    run("bandwidth", lambda: bandwidth(device, shapes, copy_gbps))
    run("weights", lambda: weights(device, shapes))
    run("oracle", lambda: oracle(device, shapes))
    run("decode", lambda: decode_speed(device, shapes))
    run("experts", lambda: experts_cached(device, shapes))
    results["ok"] = all(
        row.get("ok", True)
        for key in ("codecs", "kernels", "weights", "oracle", "experts")
        for row in (results.get(key, {}).get("result") or [])
    ) and not any("error" in v for v in results.values() if isinstance(v, dict))  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"[gpu_check] wrote {args.out}; ok={results['ok']}", file=sys.stderr)
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

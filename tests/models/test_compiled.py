"""`--compile` (models/compiled.py): the torch.compile'd decode step against the eager one.

One compiled model is shared by the module (compiling takes tens of seconds). Both models decode
the same random prompts token by token; the compiled logits must agree with the eager ones within
float32 rounding (inductor fuses reductions, so not bit for bit), greedy tokens must be equal,
and after the warm-up no length (buffer growth, RoPE table growth, DSA starting to select) may
trigger a recompilation.
"""

from __future__ import annotations

import pytest
import torch

from latentkv.cli import main
from latentkv.config import CacheConfig
from latentkv.models.compiled import CompileUnavailable, check_compilable, step_guard, tag_inductor_cache
from latentkv.models.weights import load_model

TOLERANCE = 1e-5  # relative to the largest |logit|
# int8/int4 on AVX-512 VNNI quantize each matrix's input to int16 per group: a float32-rounding
# difference upstream can move an activation across a step (2^-15 of its group's largest); int4
# there quantizes to int8 (steps of 1/127: the same crossing moves an activation 258x as far)
PACKED_TOLERANCE = 2e-4
X8_PACKED_TOLERANCE = 5e-2
# bf16 weights: eager rounds each product's output to bfloat16 (2^-8 relative), inductor's fused
# code keeps some of them in float32
BF16_TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def compiled(tiny_dir):
    model = load_model(tiny_dir, device="cpu")
    model.compile_decode(progress=False)
    return model


def _decode_both(compiled, eager, cache_config, prompt_len: int, steps: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, compiled.cfg.vocab_size, (prompt_len,), generator=g)
    fast, slow = compiled.make_cache(compiled.tier(cache_config)), eager.make_cache(eager.tier(cache_config))
    a, b = compiled.forward(prompt, fast)[-1], eager.forward(prompt, slow)[-1]
    worst, tokens_a, tokens_b = 0.0, [], []
    for _ in range(steps):
        ta, tb = int(a.argmax()), int(b.argmax())
        tokens_a.append(ta)
        tokens_b.append(tb)
        a = compiled.forward(torch.tensor([ta]), fast)[-1]
        b = eager.forward(torch.tensor([ta]), slow)[-1]  # both fed the same token
        worst = max(worst, float((a - b).abs().max() / b.abs().max()))
    return worst, tokens_a, tokens_b, fast, slow


def test_compiled_decode_matches_eager_without_recompiling(compiled, ours):
    eager = ours("glm5-tiny")
    assert eager.compiled is None and compiled.compiled is not None
    index_topk = compiled.cfg.dsa.index_topk
    # 30 tokens of prompt, then past index_topk (DSA selects), with recompiling made an error;
    # the tiny model's whole context is small, so the step fixed the cache at full size
    with torch._dynamo.config.patch(error_on_recompile=True):
        worst, tokens_a, tokens_b, fast, slow = _decode_both(compiled, eager, None, 30, 250, seed=1)
    assert index_topk < 30 + 250
    assert worst < TOLERANCE, worst
    assert tokens_a == tokens_b
    assert fast.length == slow.length == 280
    assert fast.fixed == compiled.cfg.max_position_embeddings and slow.fixed is None
    assert torch.equal(fast.view(0)[:30], slow.view(0)[:30])  # the prefill is eager in both


def test_a_small_model_decodes_through_exported_programs_a_bigger_one_through_torch_compile(
    compiled, tiny_dir, monkeypatch
):
    """builtin:tiny's step (the fixture above) is its AOTInductor programs, one below and one
    above index_topk; a model past EXPORT_MAX_WEIGHT_BYTES, or whose whole context is not fixed,
    gets torch.compile's step (built lazily: nothing is compiled here)."""
    from latentkv.models import compiled as compiled_module

    step = compiled.compiled
    assert isinstance(step, compiled_module.ExportedDecode)
    topk = compiled.cfg.dsa.index_topk
    assert step.ranges() == [(3, topk), (topk + 1, compiled.cfg.max_position_embeddings)]
    assert [(low, high) for low, high, _ in step._programs["f32"]] == step.ranges()
    model = load_model(tiny_dir, device="cpu")  # its own: an exported step fixes its RoPE tables
    assert isinstance(compiled_module.decode_step(model, model.f32), compiled_module.ExportedDecode)
    monkeypatch.setattr(compiled_module, "EXPORT_MAX_WEIGHT_BYTES", model.weight_bytes() - 1)
    assert isinstance(compiled_module.decode_step(model, model.f32), compiled_module.CompiledDecode)
    monkeypatch.setattr(compiled_module, "EXPORT_MAX_WEIGHT_BYTES", 1 << 40)
    monkeypatch.setattr(compiled_module, "FIXED_CACHE_MAX_BYTES", 0)
    assert isinstance(compiled_module.decode_step(model, model.f32), compiled_module.CompiledDecode)


def test_a_built_step_is_kept_and_loaded_by_the_next_process(compiled, tiny_dir, monkeypatch):
    """The module's model built its programs into the cache of built steps; another model of the
    same weights loads them from there (AOTInductor's compiler not called) and decodes as
    eagerly; a damaged package is built again."""
    from latentkv.models import compiled as compiled_module

    built = []
    real = torch._inductor.aoti_compile_and_package
    monkeypatch.setattr(
        torch._inductor, "aoti_compile_and_package", lambda *a, **k: built.append(1) or real(*a, **k)
    )
    model, eager = load_model(tiny_dir, device="cpu"), load_model(tiny_dir, device="cpu")
    model.compile_decode(progress=False)
    assert isinstance(model.compiled, compiled_module.ExportedDecode) and built == []
    assert model.compiled.packages == compiled.compiled.packages  # the same keys: the same files
    assert all(p.parent == compiled_module.cache_root() / "steps" for p in model.compiled.packages)
    worst, tokens_a, tokens_b, _, _ = _decode_both(model, eager, None, 20, 60, seed=9)
    assert worst < TOLERANCE and tokens_a == tokens_b
    model.compiled.packages[0].write_bytes(b"not a package")
    load_model(tiny_dir, device="cpu").compile_decode(progress=False)
    assert len(built) == 1


def test_a_step_that_cannot_be_exported_gives_way_to_torch_compile(tiny_dir, monkeypatch, capsys):
    """When torch.export or AOTInductor fails on a model, `--compile` says so in one line and
    compiles with torch.compile instead (its warm-up stubbed here: only the choice is tested)."""
    from latentkv.models import compiled as compiled_module

    def fail(*args):
        raise RuntimeError("no exporting this\nsecond line")

    monkeypatch.setattr(compiled_module.ExportedDecode, "_export", fail)
    monkeypatch.setattr(
        compiled_module.CompiledDecode, "warm_up", lambda self, make_cache, progress=True: 1.5
    )
    model = load_model(tiny_dir, device="cpu")
    assert model.compile_decode(progress=False) == 1.5
    assert isinstance(model.compiled, compiled_module.CompiledDecode)
    err = capsys.readouterr().err
    assert "could not be built (RuntimeError: no exporting this); compiling with torch.compile" in err
    assert "second line" not in err


def test_compiled_model_takes_a_one_token_prompt_and_refuses_past_its_context(compiled):
    """A one-token prompt is a prefill (eager), not a compiled step at length 0 (which would
    trace another graph); a step past max_position_embeddings is the eager step's ValueError,
    not an error from inside torch.compile."""
    cache = compiled.make_cache()
    with torch._dynamo.config.patch(error_on_recompile=True):
        token = compiled.forward(torch.tensor([5]), cache)[-1].argmax().view(1)
        for _ in range(3):
            token = compiled.forward(token, cache)[-1].argmax().view(1)
    assert cache.length == 4
    limit = compiled.cfg.max_position_embeddings
    cache.trim(0)
    compiled.forward(torch.randint(2, compiled.cfg.vocab_size, (limit - 1,)), cache)
    compiled.forward(token, cache)  # the last position
    with pytest.raises(
        ValueError, match=f"context of {limit + 1} tokens exceeds the model's maximum of {limit}"
    ):
        compiled.forward(token, cache)
    assert cache.length == limit


def test_compiled_models_in_one_process_each_run_their_own_graph(ours, checkpoint, monkeypatch):
    """torch.compile's step (`CompiledDecode`: every model but the small ones, which are exported)
    drops torch.compile's guards on the model's own blocks and weights (`step_guard`), so nothing
    but the compile call itself may keep one model's graph from another's: two models of the
    same shapes in other weights (f32 and bf16: the same caches, so every kept guard passes),
    compiled in one process and decoding alternately, must each match their own eager twin.

    Both decode with storage that grows, as a model whose full-context cache passes
    FIXED_CACHE_MAX_BYTES (any big one) does: its buffer and RoPE-table lengths are symbolic
    sizes of the graph. One then goes on alone past its 64-row buffers and 256-position RoPE
    tables, with recompiling made an error."""
    from latentkv.models import compiled as compiled_module

    monkeypatch.setattr(compiled_module, "FIXED_CACHE_MAX_BYTES", 0)
    path = checkpoint("dsv3-tiny")
    twins = [
        (load_model(path, device="cpu"), ours("dsv3-tiny"), TOLERANCE),
        (load_model(path, "bf16", device="cpu"), load_model(path, "bf16", device="cpu"), BF16_TOLERANCE),
    ]
    for fast, _, _ in twins:
        fast.compile_decode(progress=False)
        assert isinstance(fast.compiled, compiled_module.CompiledDecode) and fast.compiled.fixed is None
    g = torch.Generator().manual_seed(6)
    caches = []
    for fast, slow, _ in twins:
        prompt = torch.randint(2, fast.cfg.vocab_size, (12,), generator=g)
        caches.append((fast.make_cache(), slow.make_cache()))
        fast.forward(prompt, caches[-1][0]), slow.forward(prompt, caches[-1][1])
    for step in range(6):
        for (fast, slow, tolerance), (fc, sc) in zip(twins, caches, strict=True):
            token = torch.tensor([3 + step])
            a, b = fast.forward(token, fc)[-1], slow.forward(token, sc)[-1]
            assert a.shape == b.shape
            assert float((a - b).abs().max() / b.abs().max()) < tolerance
    (fast, slow, tolerance), (fc, sc) = twins[0], caches[0]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(250):
            token = torch.tensor([3 + step % 50])
            a, b = fast.forward(token, fc)[-1], slow.forward(token, sc)[-1]
            assert float((a - b).abs().max() / b.abs().max()) < tolerance, step
    assert fc.length == 12 + 6 + 250 > 256 and fc.fixed is None and fc._rows[0].data.shape[0] >= fc.length


@pytest.mark.parametrize(
    ("name", "kind", "kept"),
    [
        ("cache", "TYPE_MATCH", True),
        ("cache._rows[0]", "NOT_PRESENT_IN_GENERIC_DICT", True),
        ("tokens", "TENSOR_MATCH", True),
        ("all_logits", "CONSTANT_MATCH", True),
        ("self.rope._cos", "TENSOR_MATCH", True),  # the RoPE tables grow
        ("", "SHAPE_ENV", True),  # chooses the graph past index_topk
        ("", "GRAD_MODE", True),
        ("self.blocks[0].attn.Lkv", "CONSTANT_MATCH", False),
        ("self.blocks[3].mlp.gate_up.weight", "TENSOR_MATCH", False),
        ("type(self.blocks[2].mlp.down)", "DUPLICATE_INPUT", False),
        ("G['__import_latentkv_dot_weights_dot_int8'].KERNEL_MAX_ROWS", "CONSTANT_MATCH", False),
        ("G['torch']", "MODULE_MATCH", False),
        ("type(self.norm).__call__", "CLOSURE_MATCH", False),
    ],
)
def test_step_guards_kept_and_dropped(name, kind, kept):
    assert step_guard(name, kind) is kept


def test_compiled_prefill_stays_eager(compiled, ours):
    prompt = torch.randint(2, compiled.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    fast, slow = compiled.make_cache(), ours("glm5-tiny").make_cache()
    assert torch.equal(compiled.forward(prompt, fast), ours("glm5-tiny").forward(prompt, slow))


@pytest.mark.parametrize("tier", ["tq4", "polar4", "tq4-r8"])
def test_tiers_that_do_not_compile_are_refused(tier):
    with pytest.raises(CompileUnavailable, match="--compile supports the KV tiers f32, bf16, fp8"):
        check_compilable(tier)
    with pytest.raises(CompileUnavailable, match="recent window"):
        check_compilable("fp8", recent_window=8)


def test_cli_refuses_compile_with_a_packed_tier_before_loading(capsys):
    code = main(["generate", "builtin:tiny", "--prompt-ids", "1,2", "--compile", "--kv-cache-dtype", "tq4"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--compile supports the KV tiers" in err
    assert "loaded" not in err  # refused before the weights load


@pytest.mark.parametrize(
    "fmt",
    ["int4", pytest.param("int8", marks=pytest.mark.slow), pytest.param("bf16", marks=pytest.mark.slow)],
)
def test_compiled_packed_weights_match_eager_in_one_graph(tiny_dir, fmt):
    """int8/int4 weights (and small bf16 ones) trace as latentkv's kernels: the whole step one
    graph (no recompiling, no graph break: one frame per warmed-up graph), logits as eager's."""
    from latentkv import native

    if native.kernels() is None:
        pytest.skip(f"latentkv's kernels are not built here: {native.unavailable()}")
    model, eager = load_model(tiny_dir, fmt, device="cpu"), load_model(tiny_dir, fmt, device="cpu")
    torch._dynamo.reset()
    model.compile_decode(progress=False)
    frames = dict(torch._dynamo.utils.counters["frames"])
    with torch._dynamo.config.patch(error_on_recompile=True):
        worst, tokens_a, tokens_b, _, _ = _decode_both(model, eager, None, 30, 60, seed=4)
    assert torch._dynamo.utils.counters["frames"] == frames  # nothing traced after the warm-up
    x8 = fmt == "int4" and native.kernels().isa4 == 4
    assert worst < (X8_PACKED_TOLERANCE if x8 else PACKED_TOLERANCE), worst
    assert tokens_a == tokens_b
    assert (
        "graph_break" not in torch._dynamo.utils.counters or not torch._dynamo.utils.counters["graph_break"]
    )


@pytest.mark.slow
def test_compiled_fp8_matches_eager_fp8(compiled, ours):
    compiled.compile_decode(compiled.tier("fp8"), progress=False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        worst, tokens_a, tokens_b, _, _ = _decode_both(
            compiled, ours("glm5-tiny"), CacheConfig("fp8"), 30, 100, seed=3
        )
    assert worst < TOLERANCE, worst
    assert tokens_a == tokens_b


def test_compiled_bf16_kv_runs_the_cpu_attention_kernel_in_one_graph(compiled, ours):
    """KV bf16 on an AVX-512 CPU: the step's attention is latentkv's kernel (attention/native.py),
    traced as one opaque call; no graph break (the step is compiled with fullgraph), logits as
    eager's through the same backend, past index_topk (DSA's rows read through their indices)."""
    from latentkv.attention import CPU, backend_for

    tier = compiled.tier("bf16")
    if backend_for(tier, torch.device("cpu")) is not CPU:
        pytest.skip(
            f"the CPU attention kernel does not serve bf16 here: {CPU.refuse(tier, torch.device('cpu'))}"
        )
    compiled.compile_decode(tier, progress=False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        worst, tokens_a, tokens_b, fast, _ = _decode_both(
            compiled, ours("glm5-tiny"), CacheConfig("bf16"), 30, 100, seed=5
        )
    assert worst < TOLERANCE, worst
    assert tokens_a == tokens_b
    assert fast.length > compiled.cfg.dsa.index_topk
    with torch.profiler.profile() as prof:  # the compiled step calls the kernel, once per layer
        compiled.forward(torch.tensor([tokens_a[-1]]), fast)
    calls = [e.count for e in prof.key_averages() if e.key == "latentkv::mla_decode"]
    assert calls == [compiled.cfg.num_layers]


def test_inductor_caches_are_keyed_by_torchs_cpu_capability(compiled, monkeypatch):
    """torch.compile's on-disk caches carry torch's CPU capability in every key (a step compiled
    under one capability and reused under another gave NaN logits); a tag the user set stays."""
    capability = torch.backends.cpu.get_cpu_capability()
    assert torch.compiler.config.cache_key_tag == f"latentkv-aten-{capability}"
    monkeypatch.setattr(torch.compiler.config, "cache_key_tag", "mine")
    tag_inductor_cache()
    assert torch.compiler.config.cache_key_tag == "mine"


_REUSE = """
import sys, torch
from latentkv.models.registry import builtin_path
from latentkv.models.weights import load_model
torch.set_num_threads(1)
model, eager = load_model(builtin_path("tiny"), device="cpu"), load_model(builtin_path("tiny"), device="cpu")
model.compile_decode(progress=False)
a, b = model.make_cache(), eager.make_cache()
prompt = torch.arange(2, 32)
la, lb = model.forward(prompt, a)[-1], eager.forward(prompt, b)[-1]
worst = 0.0
for _ in range(6):
    t = torch.tensor([int(lb.argmax())])
    la, lb = model.forward(t, a)[-1], eager.forward(t, b)[-1]
    worst = max(worst, float((la - lb).abs().max() / lb.abs().max()))
print(worst)
"""


@pytest.mark.slow
def test_a_step_compiled_under_one_capability_is_not_reused_under_another(tmp_path):
    """The same machine and inductor cache, the step compiled under torch's best capability and
    then under ATEN_CPU_CAPABILITY=avx2: each matches its eager twin (without the capability in
    the cache key the second reused the first's code and returned NaN)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env.pop("TORCH_COMPILE_CACHE_KEY_TAG", None)
    for capability in (None, "avx2"):
        run_env = env if capability is None else {**env, "ATEN_CPU_CAPABILITY": capability}
        done = subprocess.run(
            [sys.executable, "-c", _REUSE], env=run_env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-2000:]
        worst = float(done.stdout.split()[-1])
        assert worst < TOLERANCE, (capability, worst)

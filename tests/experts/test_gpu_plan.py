"""The GPU planner (`latentkv plan --vram-gb`): VRAM and host RAM each get their parts, and the
experts' home moves from VRAM to pinned host RAM to the disk exactly at the budgets where they
stop fitting. Budgets are set from the parts the plan reports (the CPU planner's functions,
tested in test_planner.py), so each case sits one byte either side of a boundary."""

from __future__ import annotations

import json

import pytest

from latentkv.cli import main
from latentkv.config import CacheConfig, ModelConfig
from latentkv.models.registry import resolve
from latentkv.streaming.gpu_plan import CUDA_CONTEXT, HOST_BASE, make_gpu_plan
from latentkv.streaming.planner import make_plan

GIB = 1 << 30


@pytest.fixture(scope="module")
def fixture_model():
    d = resolve("builtin:fixture")
    return ModelConfig.from_hf(d), d


def plan(fixture_model, vram: int, ram: int, **kw):
    cfg, d = fixture_model
    return make_gpu_plan(cfg, d, vram, ram, cache=CacheConfig("fp8"), max_model_len=1024, **kw)


def test_vram_holds_what_the_cpu_plan_holds_in_ram(fixture_model):
    cfg, d = fixture_model
    gpu = plan(fixture_model, 64 * GIB, 8 * GIB)
    cpu = make_plan(cfg, d, 8 * GIB, "bf16", CacheConfig("fp8"), 1024)
    assert (gpu.weight_dtype, gpu.dense_bytes, gpu.kv_bytes) == ("bf16", cpu.dense_bytes, cpu.kv_bytes)
    # the same per-sequence activations, with the CUDA context instead of the CPU's base
    assert gpu.activation_bytes - CUDA_CONTEXT == cpu.activation_bytes - HOST_BASE
    # the MTP layer's experts live with the others
    assert gpu.experts_total == (cpu.moe_layers + cpu.mtp_layers) * cfg.n_routed_experts
    assert gpu.expert_bytes == cpu.expert_bytes and gpu.expert_extent_bytes == cpu.expert_extent_bytes


def test_experts_move_from_vram_to_pinned_to_disk_at_the_boundaries(fixture_model):
    probe = plan(fixture_model, 64 * GIB, 8 * GIB)
    fixed = probe.dense_bytes + probe.kv_bytes + probe.activation_bytes
    every = probe.expert_bytes
    extent, k = probe.expert_extent_bytes, probe.top_k

    resident = plan(fixture_model, fixed + every, 8 * GIB)
    assert (resident.expert_home, resident.vram_experts, resident.staging_bytes) == (
        "vram",
        probe.experts_total,
        0,
    )
    assert resident.host_to_device_bytes_per_token == 0 and resident.fits

    pinned = plan(fixture_model, fixed + every - 1, HOST_BASE + every)
    assert pinned.expert_home == "pinned" and pinned.pinned_experts == probe.experts_total
    staging = (min(probe.experts_total, k) + k) * extent  # one token: k experts, plus k prefetched
    assert pinned.staging_bytes == staging
    assert pinned.vram_experts == (fixed + every - 1 - fixed - staging) // extent
    assert (
        pinned.dense_bytes + pinned.kv_bytes + pinned.activation_bytes + staging + pinned.vram_expert_bytes
        <= (fixed + every - 1)
    )
    cold = k * probe.moe_layers * extent
    assert pinned.host_to_device_bytes_per_token == int(
        cold * (1 - pinned.vram_experts / probe.experts_total)
    )
    assert pinned.disk_bytes_per_token == 0 and pinned.fits

    disk = plan(fixture_model, fixed + every - 1, HOST_BASE + every - 1)
    host = HOST_BASE + (k + 4 + 4) * extent  # read buffers: k in flight + SPARE_BUFFERS (4); 4 staging
    assert disk.expert_home == "disk" and disk.host_bytes == host
    assert disk.pinned_experts == (HOST_BASE + every - 1 - host) // extent
    on_host = (disk.vram_experts + disk.pinned_experts) / probe.experts_total
    assert disk.disk_bytes_per_token == int(cold * (1 - min(1.0, on_host)))


def test_a_gpu_too_small_for_the_dense_part_does_not_fit(fixture_model):
    small = plan(fixture_model, CUDA_CONTEXT, 8 * GIB)
    assert not small.fits and "VRAM" in small.problems[0]


def test_plan_command_with_vram(capsys):
    assert main(["plan", "builtin:fixture", "--vram-gb", "24", "--ram-gb", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["expert_home"], out["weight_dtype"], out["vram_bytes"]) == ("vram", "bf16", 24 * GIB)
    assert main(["plan", "builtin:fixture", "--vram-gb", "24", "--weight-dtype", "int4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weight_dtype"] == "int4"
    assert main(["plan", "builtin:fixture", "--vram-gb", "24"]) == 0
    assert "every expert resident in VRAM" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--vram-gb", "0"], "--vram-gb must be positive (got 0)"),
        (["--vram-gb", "-3"], "--vram-gb must be positive (got -3)"),
        (["--vram-gb", "8", "--nodes", "2"], "--vram-gb plans one GPU: drop --nodes"),
    ],
)
def test_bad_vram_flags_exit_2(capsys, flags, message):
    assert main(["plan", "builtin:fixture", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_experts_are_sized_in_their_own_format(fixture_model):
    """--expert-dtype int4 beside bf16 dense weights: the experts are planned at int4's bytes (as
    the CPU planner does), the dense part at bf16's."""
    cfg, d = fixture_model
    mixed = plan(fixture_model, 64 * GIB, 8 * GIB, expert_dtype="int4")
    bf16 = plan(fixture_model, 64 * GIB, 8 * GIB)
    cpu = make_plan(cfg, d, 8 * GIB, "bf16", CacheConfig("fp8"), 1024, expert_dtype="int4")
    assert mixed.expert_extent_bytes == cpu.expert_extent_bytes < bf16.expert_extent_bytes
    assert mixed.dense_bytes == bf16.dense_bytes

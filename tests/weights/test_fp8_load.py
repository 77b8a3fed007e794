"""An fp8 block-quantized checkpoint (e4m3 + 128x128 weight_scale_inv, DeepSeek-V3 / GLM-5 layout)
loads straight into int4 tensor by tensor: the peak of anonymous memory during the load stays
within the loaded model plus a few tensors in float32, far below the whole model in float32.

The load runs in a child process that samples its own RssAnon (file-backed pages of the mmap'd
checkpoint are not counted: they are the file, reclaimable, and no copy of the model).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from latentkv.models.synthetic import SLICE_CONFIG, _init, _shapes

BLOCK = 128
CONFIG = {
    **SLICE_CONFIG,
    "vocab_size": 2048,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 512,
    "n_routed_experts": 16,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 512,
    "kv_lora_rank": 256,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "index_head_dim": 64,
    "index_n_heads": 8,
    "max_position_embeddings": 4096,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK]},
}

CHILD = textwrap.dedent(
    """
    import ctypes, json, sys, threading, time, gc
    import torch
    from latentkv.models.weights import load_model

    def _all_tensors(obj, seen=None):
        seen = set() if seen is None else seen
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                yield from _all_tensors(o, seen)
        elif isinstance(obj, dict):
            for o in obj.values():
                yield from _all_tensors(o, seen)
        elif hasattr(obj, "__dict__"):
            for o in vars(obj).values():
                yield from _all_tensors(o, seen)

    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

    torch.set_num_threads(1)
    gc.collect()
    base = anon()
    peak = [base]
    done = threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon())
            time.sleep(0.002)
    t = threading.Thread(target=sample)
    t.start()
    model = load_model(sys.argv[1], sys.argv[2], device="cpu")
    done.set()
    t.join()
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so `after` is the model
    after = anon()
    nbytes = sum(
        t.untyped_storage().nbytes() for t in {id(t): t for t in _all_tensors(model)}.values()
    )
    print(json.dumps({"peak": max(peak[0], after) - base, "resident": after - base, "tensors": nbytes}))
    """
)


def _fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's recipe, tile by tile: s = amax / 448, w_fp8 = w / s (whole tiles here)."""
    o, i = w.shape
    tiles = w.view(o // BLOCK, BLOCK, i // BLOCK, BLOCK)
    s = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # [o/B, i/B]
    q = (tiles / s[:, None, :, None]).to(torch.float8_e4m3fn).view(o, i)
    return q, s


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-load")
    g = torch.Generator().manual_seed(0)
    tensors, n_params = {}, 0
    for name, shape in _shapes(CONFIG):
        t = _init(name, shape, g)
        n_params += t.numel()
        quantize = (
            len(shape) == 2 and "embed" not in name and "lm_head" not in name and "mlp.gate." not in name
        )
        if quantize and shape[0] % BLOCK == 0 and shape[1] % BLOCK == 0:
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = _fp8_blocks(t)
        else:
            tensors[name] = t.bfloat16()
    save_file(tensors, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(CONFIG))
    return root, n_params, max(t.numel() for t in tensors.values())


@pytest.mark.slow
def test_fp8_checkpoint_loads_into_int4_within_a_bounded_peak(fp8_dir):
    directory, n_params, largest = fp8_dir
    # big blocks straight from mmap, so freed ones leave RSS at once and the peak is live memory
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(directory), "int4"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    whole_f32 = 4 * n_params
    print(
        f"fp8 -> int4 load: peak {got['peak'] / 2**20:.1f} MiB, model {got['tensors'] / 2**20:.1f} MiB, "
        f"whole model in float32 {whole_f32 / 2**20:.1f} MiB"
    )
    # the model as loaded, plus working room for a few float32 copies of the largest tensor
    # (dequantized, fused with its neighbours, quantized), plus the allocator's slack
    # (the largest matrix quantized is gate and up fused: twice the largest checkpoint tensor;
    # quantizing it holds it in float32 plus about three same-sized temporaries)
    bound = got["tensors"] + 4 * (4 * 2 * largest) + (16 << 20)
    assert bound < whole_f32 * 0.8, "the bound must be able to tell a whole-model float32 copy"
    assert got["peak"] <= bound, (got, bound, whole_f32)
    # int4 is about an eighth of float32 (plus scales, the bf16 embedding and float32 norms)
    assert got["tensors"] < whole_f32 / 5, (got, whole_f32)
    assert got["resident"] <= got["tensors"] * 1.1, got

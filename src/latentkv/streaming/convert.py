"""Write a model's routed experts as an expert store (`docs/expert-file-format.md`), one expert
in memory at a time: every MoE layer's, and the MTP draft layer's (layer `num_hidden_layers`).

    convert_experts(model_dir, out_dir, "f32")      # from a checkpoint folder
    write_store(out_dir, fingerprint, layers, ...)   # from any source of Expert objects

The experts go through the same `make_linear` the resident loader uses, so a streamed run
computes with exactly the objects a resident run of the same format would.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch

from latentkv.config import ModelConfig
from latentkv.experts.base import Expert
from latentkv.experts.extent import expert_layout, tensor_bytes
from latentkv.experts.store_file import ALIGN, ExpertStoreWriter, Manifest
from latentkv.fs import gb
from latentkv.models.loader import Checkpoint, CheckpointError, dequantize_fp8_blocks
from latentkv.models.mtp import routed_layer
from latentkv.weights.base import DenseLinear, format_class, make_linear

# (layer index, number of experts, expert e -> Expert)
LayerSource = tuple[int, int, Callable[[int], Expert]]


def write_store(
    out_dir: str | Path,
    fingerprint: str,
    layers: Iterable[LayerSource],
    meta: dict | None = None,
    replace: bool = False,
    progress: bool = False,
    share: Mapping[int, Sequence[int]] | None = None,
) -> Manifest:
    """Write every layer's experts, expert by expert; publish the manifest last. `share`: only
    these experts of each layer (layer -> ids; one rank's share of a cluster's experts). The
    store's size (from the first expert's layout) is checked against the free space before
    anything is written; a failure removes what was written (`ExpertStoreWriter`)."""
    layers = list(layers)
    todo = {i: list(range(n)) if share is None else sorted(share.get(i, ())) for i, n, _f in layers}
    bar = None
    try:
        with ExpertStoreWriter(out_dir, fingerprint, meta=meta, replace=replace) as writer:
            for layer, n, make in layers:
                lw = None
                ids = None if share is None else tuple(todo[layer])
                for e in todo[layer]:
                    layout, tensors = expert_layout(make(e))
                    if lw is None and bar is None:  # the first expert: the store's size is known
                        need = sum(ALIGN + len(todo[i]) * layout.stride for i, _n, _f in layers)
                        writer.check_space(need)
                        bar = _progress(progress, need, writer.directory, sum(map(len, todo.values())))
                    if lw is None:
                        lw = writer.layer(layer, n, layout, ids)
                    elif layout != lw.layout:
                        raise ValueError(f"layer {layer} expert {e}: its tensors differ from expert 0's")
                    lw.write(e, [tensor_bytes(t) for t in tensors])
                    bar.update(1)
                if lw is not None:
                    lw.close()
            return writer.finish()
    finally:
        if bar is not None:
            bar.close()  # before any error line


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(progress: bool, need: int, directory: Path, experts: int):
    """A progress bar over the experts (one that shows nothing when not `progress`), after a
    line saying how much will be written where."""
    if not progress:
        return _NoProgress()
    import sys

    from tqdm import tqdm

    print(f"latentkv: writing {gb(need)} of experts to {directory}", file=sys.stderr)
    return tqdm(total=experts, desc="writing experts", unit="expert", leave=False)


def convert_experts(
    model_dir: str | Path,
    out_dir: str | Path,
    weight_format: str = "f32",
    replace: bool = False,
    progress: bool = False,
    share: Mapping[int, Sequence[int]] | None = None,
    extra_meta: dict | None = None,
    **params,
) -> Manifest:
    """A checkpoint folder's routed experts -> an expert store in `weight_format` (`share`: only
    these experts of each layer, one rank's share; `extra_meta`: more manifest meta)."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_hf(model_dir)
    raw_cfg = json.loads((model_dir / "config.json").read_text())
    block = (raw_cfg.get("quantization_config") or {}).get("weight_block_size")
    ckpt = Checkpoint(model_dir)
    source = _ExpertSource(cfg, ckpt, tuple(block) if block else None)
    sparse = [i for i in range(cfg.num_layers) if cfg.mlp_layer_types[i] == "sparse"]
    mtp = routed_layer(cfg, ckpt)  # the MTP layer is one more MoE layer, keyed by its index

    def layer(i: int) -> LayerSource:
        return i, cfg.n_routed_experts, lambda e: source.expert(i, e, weight_format, params)

    meta = {
        "model_type": cfg.model_type,
        "weight_format": weight_format,
        "params": params,
        "source": str(model_dir),
    }
    if mtp is not None:
        sparse.append(mtp)
        meta["mtp_layer"] = mtp
    meta.update(extra_meta or {})
    return write_store(
        out_dir, ckpt.fingerprint(), [layer(i) for i in sparse], meta, replace, progress, share
    )


class _ExpertSource:
    """One expert's float gate_up [2I, D] and down [D, I] from a checkpoint; a fused layer's
    tensors (transformers' in-memory layout) are read once per layer."""

    def __init__(self, cfg: ModelConfig, ckpt: Checkpoint, block: tuple[int, int] | None):
        self.cfg, self.ckpt, self.block = cfg, ckpt, block
        self._fused: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def expert(self, layer: int, e: int, fmt: str, params: dict) -> Expert:
        # As the resident loader builds them: per-expert tensors of a plain format are stacked
        # in its dtype first; a packed format quantizes the checkpoint's tensors directly.
        gate_up, down, fused = self._float(layer, e)
        cls = format_class(fmt)
        if not fused and issubclass(cls, DenseLinear):
            gate_up, down = gate_up.to(cls.dtype), down.to(cls.dtype)
        return Expert(make_linear(gate_up, fmt, **params), make_linear(down, fmt, **params))

    def _float(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        D, I = self.cfg.hidden_size, self.cfg.moe_intermediate_size
        p = f"model.layers.{layer}.mlp.experts."
        if p + "gate_up_proj" in self.ckpt:
            if self._fused is None or self._fused[0] != layer:
                E = self.cfg.n_routed_experts
                self._fused = None  # drop the previous layer first: one layer in memory
                self._fused = (
                    layer,
                    self._get(p + "gate_up_proj", (E, 2 * I, D)),
                    self._get(p + "down_proj", (E, D, I)),
                )
            return self._fused[1][e], self._fused[2][e], True
        q = f"{p}{e}."
        gate = self._get(q + "gate_proj.weight", (I, D))
        up = self._get(q + "up_proj.weight", (I, D))
        return torch.cat([gate, up]), self._get(q + "down_proj.weight", (D, I)), False

    def _get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.ckpt:
            raise CheckpointError(
                f"{name} is not in the checkpoint: it holds no float experts to convert (a checkpoint "
                "written by `latentkv convert` keeps them quantized); convert the original checkpoint"
            )
        t = self.ckpt.get(name)
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale = name.removesuffix("weight") + "weight_scale_inv"
            if self.block is None or scale not in self.ckpt:
                raise CheckpointError(f"{name} is fp8 but its block scales or block size are missing")
            t = dequantize_fp8_blocks(t, self.ckpt.get(scale), self.block)
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{name} has shape {tuple(t.shape)} but the config implies {shape}")
        return t

"""A model whose MoE layers are served by an `ExpertStreamer`, built with its streamed stores.

    model, streamer = load_streamed(MODEL, "MODEL/experts", StreamConfig(budget=...), device=device)

The loader builds each MoE layer over the streamed store of its layer (`StreamedSource`): the
same router, shared expert and computation (`models.moe.MoE`), its routed experts asked from
the store once per pass (the batch's union, so batched decode reads each expert once; k at a
time, so a long prompt never holds a layer's worth beside the cache). Each MoE layer is built
with the `Lookahead` of the next one: before its own experts, layer L runs the next MoE layer's
router on the current hidden state (the residual stream after L's attention, through the next
layer's MLP norm) and starts reading the experts it predicts, so the reads overlap layer L's
compute; once L is done it predicts again from its output (the next block's input, closer to
what the next router will see), so the reads overlap the next block's attention too. The dense
layer just before the first MoE layer does the latter for it (`PrefetchingMLP`), so every MoE
layer of a token is predicted. Prediction is advice only; what is computed never depends on
it, and the reader serves a pass's own reads before predictions.

The MTP draft layer's MoE (layer `num_hidden_layers`) streams from the same store and cache
when the store holds its experts (stores converted before it did load without the draft
layer, with a note). Nothing prefetches for it: its input needs the token the main model has
just produced, so its experts are read on demand (and, drafting every step, mostly stay cached).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from latentkv.experts.base import ExpertFront
from latentkv.experts.streamed import ExpertStreamer, StreamConfig, StreamedExperts
from latentkv.models.moe import MoE


@dataclass
class StreamedSource:
    """The `ExpertSource` of a model whose routed experts stream through `streamer`."""

    streamer: ExpertStreamer
    at_once: int  # experts asked for at a time: the model's k (one token's)
    predicts: bool = True

    def store(self, layer: int) -> StreamedExperts:
        streamer = self.streamer
        if layer not in streamer.manifest.layers:
            raise ValueError(f"the expert store at {streamer.directory} has no experts for MoE layer {layer}")
        return streamer.layer(layer, self.at_once)


def moe_layers(model) -> list[int]:
    """Indices of the blocks whose MLP is a mixture of experts."""
    return [i for i, b in enumerate(model.blocks) if isinstance(b.mlp, MoE)]


def load_streamed(
    model_dir: str | Path,
    store_dir: str | Path,
    config: StreamConfig,
    weight_dtype: str = "f32",
    prefetch: bool = True,
    progress: bool = False,
    *,
    device: torch.device | str,
    front: ExpertFront | None = None,
):
    """Load the dense weights of the checkpoint at `model_dir` onto `device` and serve its routed
    experts from the expert store at `store_dir` (which must be this checkpoint's): (model,
    streamer). With `front` (a `DeviceCache`), each layer's streamed store is served on `device`
    through it."""
    from latentkv.config import ModelConfig
    from latentkv.models.loader import Checkpoint
    from latentkv.models.mtp import routed_layer
    from latentkv.models.weights import load_model

    ckpt = Checkpoint(model_dir)
    cfg = ModelConfig.from_hf(model_dir)
    streamer = ExpertStreamer(store_dir, ckpt.fingerprint(), config)
    try:
        model = load_model(
            model_dir,
            weight_dtype,
            progress,
            device=device,
            experts=StreamedSource(streamer, cfg.num_experts_per_tok, prefetch),
            load_mtp=_keeps_mtp(streamer, routed_layer(cfg, ckpt)),
            front=front,
        )
    except BaseException:
        streamer.close()
        raise
    _own_and_pin(model, streamer)
    return model, streamer


def _keeps_mtp(streamer: ExpertStreamer, layer: int | None) -> bool:
    """Whether the model keeps its MTP layer: it has no routed experts (`layer` None) or the store
    holds them. A store converted before the MTP layer's experts were written: False (its
    resident experts would sit outside the budget), and a note says what drafting needs."""
    if layer is None:
        return True
    if layer in streamer.manifest.layers:
        streamer.draft_layer = layer
        return True
    streamer.notes.append(missing_mtp_message(streamer.directory, layer))
    return False


def missing_mtp_message(store: Path, layer: int) -> str:
    """The one line that says a store lacks the MTP layer's experts."""
    return (
        f"the expert store at {store} has no experts for the MTP layer (layer {layer}; converted by an "
        "older latentkv), so the model loads without its draft layer and --speculative mtp cannot run: "
        "convert again with `latentkv experts convert MODEL --force` (or delete that folder)"
    )


def mtp_store_problem(model_dir: str | Path, store: str | Path) -> str | None:
    """Before loading: the line refusing --speculative mtp with --ram-gb when the expert store
    at `store` exists and lacks the MTP layer's experts; None when drafting can stream (a store
    converted on first use writes them)."""
    from latentkv.config import ModelConfig
    from latentkv.experts.store_file import ExpertFileError, read_manifest
    from latentkv.models.loader import Checkpoint
    from latentkv.models.mtp import routed_layer

    store = Path(store)
    layer = routed_layer(ModelConfig.from_hf(model_dir), Checkpoint(model_dir))
    if layer is None or not (store / "manifest.json").exists():
        return None
    try:
        manifest = read_manifest(store)
    except ExpertFileError:
        return None  # the load reports a damaged store
    return None if layer in manifest.layers else missing_mtp_message(store, layer)


def _own_and_pin(model, streamer: ExpertStreamer) -> None:
    """Own the dense weights' pages (the expert cache's neighbours at the memory limit; see
    `own_pages`) and pin the hot set."""
    from latentkv.models.loader import own_pages

    own_pages(model.weight_tensors())
    streamer.pin_hot_set()


def default_store_dir(model_dir: str | Path, weight_format: str) -> Path:
    """MODEL/experts when the model folder holds an expert store, else a folder under the user's
    cache named by the checkpoint's fingerprint and the expert format."""
    from latentkv.config import cache_root
    from latentkv.models.loader import Checkpoint

    local = Path(model_dir) / "experts"
    if (local / "manifest.json").exists():
        return local
    return cache_root() / "experts" / f"{Checkpoint(model_dir).fingerprint()[:16]}-{weight_format}"


def ensure_store(model_dir: str | Path, weight_format: str = "f32", progress: bool = False) -> Path:
    """The expert store of `model_dir`, converted from its checkpoint first if there is none."""
    from latentkv.fs import DiskError
    from latentkv.streaming.convert import convert_experts

    store = default_store_dir(model_dir, weight_format)
    if not (store / "manifest.json").exists():
        try:
            convert_experts(model_dir, store, weight_format, replace=True, progress=progress)
        except DiskError as exc:
            raise DiskError(
                f"{exc} (a first --ram-gb run writes the experts there: set LATENTKV_CACHE to a directory "
                f"with room for them, or write them beside the model with `latentkv experts convert "
                f"{model_dir}`)",
                exc.path,
                exc.errno,
            ) from None
    return store

"""A model's MoE layers served by an `ExpertStreamer`: the streamed MoE layer and its prefetch.

    streamer = stream_model(model, "MODEL/experts", StreamConfig(budget=...))

Each MoE layer becomes a `StreamedMoE`: the same router, shared expert and computation
(`models.moe.MoE`), its routed experts asked from the streamed store once per pass (the batch's
union, so batched decode reads each expert once). Before its own experts, layer L runs the next MoE layer's
router on the current hidden state (the residual stream after L's attention, through the next
layer's MLP norm) and starts reading the experts it predicts: the reads overlap layer L's
compute. Once L is done it predicts again from its output (the next block's input, closer to
what the next router will see), so the reads overlap the next block's attention too. The dense
layer just before the first MoE layer does the latter for it (`PrefetchingMLP`), so every MoE
layer of a token is predicted. Prediction is advice only; what
is computed never depends on it, and the reader serves a pass's own reads before predictions.

The MTP draft layer's MoE (layer `num_hidden_layers`) streams from the same store and cache
when the store holds its experts (stores converted before it did load without the draft
layer, with a note). Nothing prefetches for it: its input needs the token the main model has
just produced, so its experts are read on demand (and, drafting every step, mostly stay cached).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from latentkv.experts.base import Expert
from latentkv.experts.streamed import ExpertStreamer, StreamConfig
from latentkv.models.moe import MoE, Router

Lookahead = Callable[[torch.Tensor], None]


class StreamedMoE(MoE):
    """The MoE layer over a streamed store (its `stacked` is None, so every pass asks the store
    once for the experts it needs), plus the lookahead that prefetches the next layer's."""

    def __init__(self, router: Router, store, shared: Expert | None, lookahead: Lookahead | None = None):
        super().__init__(router, store, shared)
        self.lookahead = lookahead

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, decode: bool = False
    ) -> torch.Tensor:
        """x [N, D] (the MLP-normed hidden state) -> [N, D] (+ residual [N, D], the hidden state
        after this layer's attention, which the lookahead reads)."""
        if self.lookahead is not None:
            self.lookahead(residual if residual is not None else x)
        out = super().__call__(x, residual, decode)
        if self.lookahead is not None and residual is not None:
            self.lookahead(out)  # again from this block's output: the next block's input
        return out


class PrefetchingMLP:
    """A dense MLP (the block before the first MoE layer) that, once done, starts the reads of
    the experts the next layer's router predicts from its output (the next block's input): they
    overlap that block's attention. (Predicted before this MLP instead, the first MoE layer of
    the experts benchmark was recalled at chance, 10%: a dense MLP moves the residual stream too
    far.)"""

    def __init__(self, mlp: Expert, lookahead: Lookahead | None):
        self.mlp = mlp
        self.lookahead = lookahead

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, decode: bool = False
    ) -> torch.Tensor:
        out = self.mlp(x, residual, decode)
        if self.lookahead is not None and residual is not None:
            self.lookahead(out)  # from this block's output, the next block's input
        return out


def _prefetcher(streamer: ExpertStreamer, layer: int, norm, router) -> Lookahead:
    def lookahead(hidden: torch.Tensor) -> None:
        idx, _ = router(norm(hidden))
        streamer.prefetch(layer, idx.reshape(-1).unique().tolist())

    return lookahead


def moe_layers(model) -> list[int]:
    """Indices of the blocks whose MLP is a mixture of experts."""
    return [i for i, b in enumerate(model.blocks) if isinstance(b.mlp, MoE)]


def stream_model(
    model, directory: str | Path, config: StreamConfig, fingerprint: str | None = None, prefetch: bool = True
) -> ExpertStreamer:
    """Serve every MoE layer of an already loaded `model` from the expert store at `directory`
    (its resident experts are dropped); the streamer. `load_streamed` never loads them at all."""
    streamer = ExpertStreamer(directory, fingerprint, config)
    try:
        for i in moe_layers(model):
            mlp = model.blocks[i].mlp
            model.blocks[i].mlp = StreamedMoE(mlp.router, _layer_store(streamer, i), mlp.shared)
        mtp = model.mtp
        layer = model.cfg.num_layers if mtp is not None and isinstance(mtp.block.mlp, MoE) else None
        if not _keeps_mtp(streamer, layer):
            model.mtp = None
        elif layer is not None:
            mlp = mtp.block.mlp
            mtp.block.mlp = StreamedMoE(mlp.router, streamer.layer(layer), mlp.shared)
    except BaseException:
        streamer.close()
        raise
    _wire(model, streamer, prefetch)
    return streamer


def load_streamed(
    model_dir: str | Path,
    store_dir: str | Path,
    config: StreamConfig,
    weight_dtype: str = "f32",
    prefetch: bool = True,
    progress: bool = False,
):
    """Load the dense weights of the checkpoint at `model_dir` and serve its routed experts from
    the expert store at `store_dir` (which must be this checkpoint's): (model, streamer)."""
    from latentkv.config import ModelConfig
    from latentkv.models.loader import Checkpoint
    from latentkv.models.mtp import routed_layer
    from latentkv.models.weights import load_model

    ckpt = Checkpoint(model_dir)
    streamer = ExpertStreamer(store_dir, ckpt.fingerprint(), config)
    try:
        model = load_model(
            model_dir,
            weight_dtype,
            progress,
            moe_factory=lambda i, router, shared: StreamedMoE(router, _layer_store(streamer, i), shared),
            load_mtp=_keeps_mtp(streamer, routed_layer(ModelConfig.from_hf(model_dir), ckpt)),
        )
    except BaseException:
        streamer.close()
        raise
    _wire(model, streamer, prefetch)
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


def _layer_store(streamer: ExpertStreamer, layer: int):
    if layer not in streamer.manifest.layers:
        raise ValueError(f"the expert store at {streamer.directory} has no experts for MoE layer {layer}")
    return streamer.layer(layer)


def _wire(model, streamer: ExpertStreamer, prefetch: bool) -> None:
    """Own the dense weights' pages (the expert cache's neighbours at the memory limit; see
    `own_pages`), wire the prefetch, pin the hot set."""
    from latentkv.models.loader import own_pages

    own_pages(model.weight_tensors())
    if prefetch:
        _wire_prefetch(model, streamer)
    streamer.pin_hot_set()


def _wire_prefetch(model, streamer: ExpertStreamer) -> None:
    """Each MoE layer predicts the next one's experts; the dense layer before the first MoE
    layer predicts that one's."""
    layers = moe_layers(model)
    for here, nxt in zip(layers, layers[1:], strict=False):
        nb = model.blocks[nxt]
        model.blocks[here].mlp.lookahead = _prefetcher(streamer, nxt, nb.mlp_norm, nb.mlp.router)
    first = layers[0] if layers else 0
    if first > 0 and not isinstance(model.blocks[first - 1].mlp, (MoE, PrefetchingMLP)):
        nb, before = model.blocks[first], model.blocks[first - 1]
        before.mlp = PrefetchingMLP(before.mlp, _prefetcher(streamer, first, nb.mlp_norm, nb.mlp.router))


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

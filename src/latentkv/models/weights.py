"""Checkpoint -> model, in named steps at the load boundary.

1. read: every tensor by the name transformers writes (`model.layers.{i}.self_attn.q_a_proj.weight`);
2. dequantize: fp8 block-quantized weights (`weight_scale_inv`) become float;
3. check: every shape against the config, with the tensor's name in the error;
4. reshape: `kv_b_proj` split into W_UK / W_UV per head, gate+up fused, experts stacked per layer;
5. format: each matrix becomes a `latentkv.weights.Linear` of the chosen weight format (f32,
   bf16, or any registered one); norms, the router and the indexer's head weights stay f32.

Layer indices come from the config. The first multi-token-prediction (MTP) layer, layer
`num_hidden_layers` in DeepSeek-V3's layout, is loaded as the draft layer (`models/mtp.py`);
further MTP layers (none of the checkpoints we know ship more than one) are not.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from latentkv.config import ModelConfig
from latentkv.experts import ExpertSource, ExpertStore, ResidentExperts
from latentkv.experts.base import Expert, ExpertFront
from latentkv.models.convert import read_manifest
from latentkv.models.indexer import Indexer, IndexerWeights
from latentkv.models.layers import RMSNorm, SwiGLU, softmax_scale
from latentkv.models.loader import Checkpoint, CheckpointError, dequantize_fp8_blocks
from latentkv.models.mla import MLA, MLAWeights
from latentkv.models.model import Block, Model
from latentkv.models.moe import Lookahead, MoE, PrefetchingMLP, Router, RouterWeights
from latentkv.models.mtp import MTPLayer, checkpoint_prefix
from latentkv.weights import Linear, make_linear
from latentkv.weights.base import dense_dtype, format_class
from latentkv.weights.heads import HeadLinears
from latentkv.weights.stack import RowStack

# transformers builds the q-LoRA and kv-a norms without the config's eps: they use 1e-6.
LORA_NORM_EPS = 1e-6


class _Reader:
    """Fetches, dequantizes, checks and casts tensors from a checkpoint."""

    def __init__(
        self,
        ckpt: Checkpoint,
        fmt: str,
        block_size: tuple[int, int] | None,
        device: torch.device | str,
        expert_fmt: str | None = None,
        packed: dict | None = None,
    ):
        self.ckpt = ckpt
        self.device = torch.device(device)
        self.packed = packed or {}  # a converted checkpoint's pre-quantized matrices (its manifest)
        self.fmt = fmt
        self.expert_fmt = expert_fmt or fmt  # routed experts' format (--expert-dtype)
        self.dtype = format_class(fmt).table_dtype  # the embedding table's (a token reads one row)
        self.block_size = block_size
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.ckpt or name in self.packed

    def raw(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor's float values. A pre-quantized matrix read as floats (fused with a float one,
        e.g. a GGUF's F16 q_a beside its Q6_K kv_a) is its format's own dequantization: the same
        values from a GGUF and from its conversion, which keeps only the pieces."""
        if (entry := self.packed.get(name)) is not None:
            t = self._dequantized(name, entry)
        else:
            t = self.ckpt.get(name)
            self.used.add(name)
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale_name = name.removesuffix("weight") + "weight_scale_inv"
            if scale_name not in self.ckpt:
                raise CheckpointError(f"{name} is fp8 but the checkpoint has no {scale_name}")
            if self.block_size is None:
                raise CheckpointError(
                    f"{name} is fp8 but config.json has no quantization_config.weight_block_size"
                )
            t = dequantize_fp8_blocks(t, self.ckpt.get(scale_name), self.block_size)
            self.used.add(scale_name)
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"{name} has shape {tuple(t.shape)} but the config implies {tuple(shape)}; "
                "is config.json the one these weights were saved with?"
            )
        return t.to(self.device)  # (no copy on the CPU)

    def table(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The embedding table, in the format's dtype (a view when it already is); a pre-quantized
        one (a GGUF's) dequantized."""
        return self.raw(name, shape).to(self.dtype).contiguous()

    def _dequantized(self, name: str, entry: dict) -> torch.Tensor:
        state = self._state(name, entry["format"])
        assert state is not None
        return format_class(entry["format"]).from_state(state, entry["shape"][1]).dequantize()

    def linear(self, w: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        """A float matrix [out, in] in the chosen weight format."""
        return make_linear(w.contiguous(), self.fmt, bias=bias)

    def matrix(self, name: str, shape: tuple[int, ...]) -> Linear:
        """A checkpoint matrix used in a matmul: pre-quantized as stored, else in the chosen
        weight format."""
        return self.prequantized([name]) or self.linear(self.raw(name, shape))

    def prequantized(self, names: list[str], factors: list[float] | None = None) -> Linear | None:
        """The matrices `names` fused by rows when a converted checkpoint (or a GGUF) stores
        them all pre-quantized, each in its own format (piece by piece, output rows first): one
        Linear when they share a format and layout, else a RowStack of one per matrix. Each
        times its factor (`factors`; scales multiplied, which only float32 scales take without
        a second rounding). None when one of them is not stored so."""
        entries = [self.packed.get(n) for n in names]
        if not all(e is not None for e in entries):
            return None
        factors = factors or [1.0] * len(names)
        states = [self._state(n, e["format"], f) for n, e, f in zip(names, entries, factors, strict=True)]
        if any(s is None for s in states):
            return None
        formats = {e["format"] for e in entries}
        cls = format_class(entries[0]["format"])
        in_f = entries[0]["shape"][1]
        if len(formats) == 1 and _concatenable(states):
            fused = {
                p: torch.cat([s[p] for s in states]) if len(states) > 1 else states[0][p] for p in cls.pieces
            }
            return cls.from_state(fused, in_f)
        return RowStack(
            [format_class(e["format"]).from_state(s, in_f) for e, s in zip(entries, states, strict=True)]
        )

    def _state(self, name: str, fmt: str, factor: float = 1.0) -> dict[str, torch.Tensor] | None:
        """A pre-quantized matrix's pieces, its scales times `factor`; None when the factor is
        not 1 and a scale piece is narrower than float32."""
        cls = format_class(fmt)
        keys = {piece: f"{name}.{fmt}.{piece}" for piece in cls.pieces}
        self.used.update(keys.values())
        state = {piece: self.ckpt.get(k).to(self.device) for piece, k in keys.items()}
        if factor == 1.0:
            return state
        if any(state[p].dtype != torch.float32 for p in cls.scale_pieces):
            return None
        return {p: t * factor if p in cls.scale_pieces else t for p, t in state.items()}

    def heads(self, name: str, heads: int) -> HeadLinears | None:
        """A pre-quantized per-head stack [heads * N, K] (a GGUF's attn_k_b / attn_v_b) as one
        Linear per head, its rows as stored; None when it is not stored so."""
        entry = self.packed.get(name)
        if entry is None:
            return None
        state = self._state(name, entry["format"])
        assert state is not None
        rows = entry["shape"][0] // heads
        cls = format_class(entry["format"])
        return HeadLinears(
            [
                cls.from_state({p: t[h * rows : (h + 1) * rows] for p, t in state.items()}, entry["shape"][1])
                for h in range(heads)
            ]
        )

    def has_packed(self, name: str) -> bool:
        return name in self.packed

    def vector(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Norm weights, biases, router: always float32."""
        return self.raw(name, shape).float().contiguous()

    def optional_vector(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return self.vector(name, shape) if self.has(name) else None


def load_model(
    directory: str | Path,
    weight_dtype: str = "f32",
    progress: bool = False,
    *,
    device: torch.device | str,
    experts: ExpertSource | None = None,
    expert_dtype: str | None = None,
    load_mtp: bool = True,
    front: ExpertFront | None = None,
) -> Model:
    """The model in `directory`, its matrices in `weight_dtype` and its routed experts in
    `expert_dtype` (default: the same), every tensor on `device` (the one device the model, its
    caches and its passes then use). `experts`, `load_mtp`, `front`: see `build_model`."""
    directory = Path(directory)
    cfg = ModelConfig.from_hf(directory)
    raw_cfg = json.loads((directory / "config.json").read_text())
    block = (raw_cfg.get("quantization_config") or {}).get("weight_block_size")
    manifest = read_manifest(directory)
    if manifest is not None and manifest.get("source") != "gguf":  # a GGUF's matrices load as they map
        _check_converted(directory, manifest, weight_dtype, expert_dtype or weight_dtype)
    ckpt = Checkpoint(directory, progress=progress)
    packed = manifest["tensors"] if manifest else None
    model = build_model(
        cfg,
        ckpt,
        weight_dtype,
        tuple(block) if block else None,
        progress,
        device=device,
        experts=experts,
        expert_dtype=expert_dtype,
        packed=packed,
        load_mtp=load_mtp,
        front=front,
    )
    if progress and ckpt.gguf is not None and packed:
        from latentkv.models.gguf import report_line

        print(f"latentkv: {report_line(packed, ckpt.gguf.report)}", file=sys.stderr)
    release_freed_memory()
    return model


def _concatenable(states: list[dict[str, torch.Tensor]]) -> bool:
    """Whether states of one format can be fused by rows: every piece alike but for its rows."""
    first = states[0]
    return all(
        s[p].dtype == first[p].dtype and s[p].shape[1:] == first[p].shape[1:]
        for s in states[1:]
        for p in first
    )


def release_freed_memory() -> None:
    """Hand the heap pages that loading freed (float and dequantized temporaries) back to the OS:
    glibc keeps them in its arenas, where they count as resident memory (an int4 slice measured
    1.24x its weights' bytes after load, 1.00x after this). Nothing on other C libraries."""
    import contextlib
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _check_converted(directory: Path, manifest: dict, weights: str, experts: str) -> None:
    """A converted checkpoint loads in the formats it was converted to, and no other."""
    have = (manifest["weight_dtype"], manifest["expert_dtype"])
    if (weights, experts) != have:
        raise CheckpointError(
            f"{directory} was converted to {have[0]} weights and {have[1]} experts; load it with "
            f"--weight-dtype {have[0]} --expert-dtype {have[1]}, or convert the original again"
        )


def build_model(
    cfg: ModelConfig,
    ckpt: Checkpoint,
    weight_dtype: str = "f32",
    block_size: tuple[int, int] | None = None,
    progress: bool = False,
    *,
    device: torch.device | str,
    experts: ExpertSource | None = None,
    expert_dtype: str | None = None,
    packed: dict | None = None,
    load_mtp: bool = True,
    front: ExpertFront | None = None,
) -> Model:
    """With `experts`, every MoE layer is built with `experts.store(layer)` (the MTP layer's
    as layer `num_hidden_layers`) and the routed experts' tensors are never read (streamed from
    disk, held elsewhere); when the source `predicts`, each MoE layer and the dense layer
    before the first one are built with the `Lookahead` of the next MoE layer. Without it the
    experts are read into `ResidentExperts`. With `front` (experts served on `device` from host
    memory), each layer's store (the source's, or resident experts read onto `front.host`) is
    put behind `front.over`. `load_mtp=False` leaves the MTP layer out."""
    for name in (weight_dtype, expert_dtype or weight_dtype):
        format_class(name)  # ValueError naming the valid formats
    rd = _Reader(ckpt, weight_dtype, block_size, device, expert_dtype, packed)
    host_rd = None
    if front is not None and experts is None:
        host_rd = _Reader(ckpt, weight_dtype, block_size, front.host, expert_dtype, packed)
    routed = _Routed(cfg, rd, experts, front=front, host_rd=host_rd)
    D, V = cfg.hidden_size, cfg.vocab_size
    embed = rd.table("model.embed_tokens.weight", (V, D))
    layers = range(cfg.num_layers)
    if progress:
        from latentkv.progress import progress as show_progress

        layers = show_progress(layers, "loading layers", "layer", leave=False)
    blocks = [_block(cfg, rd, i, routed) for i in layers]
    norm = RMSNorm(rd.vector("model.norm.weight", (D,)), cfg.rms_norm_eps)
    if cfg.tie_word_embeddings or not rd.has("lm_head.weight"):
        # tied: f32 and bf16 share the embedding's tensor; a pre-quantized embedding (a GGUF's)
        # is the head as stored
        lm_head = rd.prequantized(["model.embed_tokens.weight"]) or rd.linear(embed)
    else:
        lm_head = rd.matrix("lm_head.weight", (V, D))
    mtp = _mtp(cfg, rd, routed) if load_mtp else None
    return Model(cfg, embed, blocks, norm, lm_head, mtp)


def _mtp(cfg: ModelConfig, rd: _Reader, routed: _Routed) -> MTPLayer | None:
    """The first MTP layer, if config and checkpoint have one: the config restricted to one
    layer whose MLP kind the checkpoint says (DeepSeek-V3 and GLM-5: MoE) and which runs its own
    DSA indexer when the model has one; its embedding and head are the main model's. Its MoE
    goes by layer `num_hidden_layers` (the expert store's key for it)."""
    p = checkpoint_prefix(cfg)
    if cfg.num_mtp_layers < 1 or not rd.has(p + "eh_proj.weight"):
        return None
    D = cfg.hidden_size
    dsa = dataclasses.replace(cfg.dsa, indexer_types=("full",)) if cfg.dsa is not None else None
    sparse = rd.has(p + "mlp.gate.weight")
    one = dataclasses.replace(
        cfg, num_layers=1, mlp_layer_types=("sparse" if sparse else "dense",), dsa=dsa, num_mtp_layers=0
    )
    return MTPLayer(
        cfg=one,
        enorm=RMSNorm(rd.vector(p + "enorm.weight", (D,)), cfg.rms_norm_eps),
        hnorm=RMSNorm(rd.vector(p + "hnorm.weight", (D,)), cfg.rms_norm_eps),
        eh_proj=rd.matrix(p + "eh_proj.weight", (D, 2 * D)),
        block=_block(one, rd, 0, routed.mtp(one), prefix=p, layer=cfg.num_layers),
        head_norm=RMSNorm(rd.vector(p + "shared_head.norm.weight", (D,)), cfg.rms_norm_eps),
    )


def _block(
    cfg: ModelConfig,
    rd: _Reader,
    i: int,
    routed: _Routed,
    prefix: str | None = None,
    layer: int | None = None,
) -> Block:
    """Layer i of `cfg`, read from the tensors named `prefix` (default `model.layers.{i}.`);
    its routed experts go by `layer` (default i)."""
    p = prefix or f"model.layers.{i}."
    a = p + "self_attn."
    D, H = cfg.hidden_size, cfg.num_heads
    P, R, Lkv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    # The projections that read x, fused into one matrix (and one bias, if any part has one).
    q_in = (a + "q_a_proj", cfg.q_lora_rank) if cfg.q_lora_rank else (a + "q_proj", H * (P + R))
    parts = [q_in, (a + "kv_a_proj_with_mqa", Lkv + R)]
    indexer = None
    if cfg.dsa is not None and cfg.dsa.indexer_types[i] == "full":
        parts.append((a + "indexer.wk", cfg.dsa.index_head_dim))
        indexer = Indexer(cfg.dsa, _indexer_weights(cfg, rd, a + "indexer."))
    biases = [rd.optional_vector(name + ".bias", (rows,)) for name, rows in parts]
    b_in = None
    if any(b is not None for b in biases):
        b_in = torch.cat(
            [
                b if b is not None else torch.zeros(rows, device=rd.device)
                for b, (_, rows) in zip(biases, parts, strict=False)
            ]
        )
    # without q-LoRA, q comes straight from the fused projection: the softmax scale is folded in
    q_factor = 1.0 if cfg.q_lora_rank else softmax_scale(cfg.rope, cfg.qk_head_dim)
    factors = [q_factor] + [1.0] * (len(parts) - 1)
    w_in = rd.prequantized([name + ".weight" for name, _ in parts], factors) if b_in is None else None
    if w_in is None:
        mats = [rd.raw(name + ".weight", (rows, D)).float() for name, rows in parts]
        if not cfg.q_lora_rank:  # q comes straight from the fused projection: fold the softmax scale here
            mats[0] = mats[0] * softmax_scale(cfg.rope, cfg.qk_head_dim)
        w_in = rd.linear(torch.cat(mats), b_in)
    layer = i if layer is None else layer
    if cfg.mlp_layer_types[i] == "sparse":
        mlp: SwiGLU | MoE | PrefetchingMLP = routed.moe(p, layer)
    else:
        mlp = _swiglu(rd, p + "mlp.", D, cfg.intermediate_size)
        if (ahead := routed.lookahead_after(layer)) is not None:
            mlp = PrefetchingMLP(mlp, ahead)
    return Block(
        attn_norm=RMSNorm(rd.vector(p + "input_layernorm.weight", (D,)), cfg.rms_norm_eps),
        w_in=w_in,
        split=tuple(rows for _, rows in parts),
        attn=MLA(cfg, _mla_weights(cfg, rd, a)),
        indexer=indexer,
        mlp_norm=routed.norm(p),
        mlp=mlp,
    )


def _mla_weights(cfg: ModelConfig, rd: _Reader, p: str) -> MLAWeights:
    D, H = cfg.hidden_size, cfg.num_heads
    P, R, V, Lkv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    scale = softmax_scale(cfg.rope, cfg.qk_head_dim)
    q_a_norm = q_b = None
    if cfg.q_lora_rank:
        q_a_norm = RMSNorm(rd.vector(p + "q_a_layernorm.weight", (cfg.q_lora_rank,)), LORA_NORM_EPS)
        # The softmax scale is folded into q_b, so scores come out scaled.
        name = p + "q_b_proj.weight"
        q_b = rd.prequantized([name], [scale]) or rd.linear(
            rd.raw(name, (H * (P + R), cfg.q_lora_rank)).float() * scale
        )
    # a GGUF stores W_UK^T and W_UV per head (attn_k_b, attn_v_b): taken as stored when quantized
    w_uk_t, w_uv = rd.heads(p + "k_b_proj.weight", H), rd.heads(p + "v_b_proj.weight", H)
    if w_uk_t is None or w_uv is None:
        kv_b = rd.raw(p + "kv_b_proj.weight", (H * (P + V), Lkv)).float().view(H, P + V, Lkv)
        w_uk_t = HeadLinears.from_float(kv_b[:, :P, :].transpose(1, 2), rd.fmt)  # [H, Lkv, P]
        w_uv = HeadLinears.from_float(kv_b[:, P:, :], rd.fmt)  # [H, V, Lkv]
    return MLAWeights(
        q_a_norm=q_a_norm,
        q_b=q_b,
        kv_a_norm=RMSNorm(rd.vector(p + "kv_a_layernorm.weight", (Lkv,)), LORA_NORM_EPS),
        w_uk_t=w_uk_t,
        w_uv=w_uv,
        o=_output(rd, p, D, H * V),
    )


def _output(rd: _Reader, p: str, D: int, width: int) -> Linear:
    bias = rd.optional_vector(p + "o_proj.bias", (D,))
    if bias is None and (o := rd.prequantized([p + "o_proj.weight"])) is not None:
        return o
    return rd.linear(rd.raw(p + "o_proj.weight", (D, width)), bias)


def _indexer_weights(cfg: ModelConfig, rd: _Reader, p: str) -> IndexerWeights:
    dsa = cfg.dsa
    assert dsa is not None
    D, Di, Hi = cfg.hidden_size, dsa.index_head_dim, dsa.index_n_heads
    q_in = cfg.q_lora_rank or D
    # The score scales are folded in: relu(q.k / sqrt(D_i)) = relu((q / sqrt(D_i)).k), and the
    # per-head weights' 1/sqrt(h_i) goes into weights_proj.
    return IndexerWeights(
        wq_b=rd.prequantized([p + "wq_b.weight"], [Di**-0.5])
        or rd.linear(rd.raw(p + "wq_b.weight", (Hi * Di, q_in)).float() * Di**-0.5),
        k_norm_weight=rd.vector(p + "k_norm.weight", (Di,)),
        k_norm_bias=rd.vector(p + "k_norm.bias", (Di,)),
        weights_proj=make_linear(rd.vector(p + "weights_proj.weight", (Hi, D)) * Hi**-0.5, "f32"),
    )


def _swiglu(rd: _Reader, p: str, D: int, inter: int) -> SwiGLU:
    names = [p + "gate_proj.weight", p + "up_proj.weight"]
    if (gate_up := rd.prequantized(names)) is not None:
        return SwiGLU(gate_up, rd.matrix(p + "down_proj.weight", (D, inter)))
    gate = rd.raw(p + "gate_proj.weight", (inter, D))
    up = rd.raw(p + "up_proj.weight", (inter, D))
    gate_up = torch.cat([gate, up], dim=0)  # [2I, D]
    return SwiGLU(rd.linear(gate_up), rd.matrix(p + "down_proj.weight", (D, inter)))


class _Routed:
    """How the loader builds the MoE layers: with resident experts read from the checkpoint, or
    with the stores of an `ExpertSource` (and, when it predicts, each MoE layer's `Lookahead`
    over the next MoE layer). A lookahead needs the next layer's MLP norm and router before that
    layer is built: they are read once, early, and the layer is then built with the same ones."""

    def __init__(
        self,
        cfg: ModelConfig,
        rd: _Reader,
        source: ExpertSource | None,
        main: bool = True,
        front: ExpertFront | None = None,
        host_rd: _Reader | None = None,
    ):
        self.cfg, self.rd, self.source = cfg, rd, source
        self.front, self.host_rd = front, host_rd  # host_rd: reads resident experts for the front
        self._stores: dict[int, ExpertStore] = {}
        self._norms: dict[str, RMSNorm] = {}
        self._routers: dict[str, Router] = {}
        sparse = [i for i, kind in enumerate(cfg.mlp_layer_types) if kind == "sparse"]
        self._next: dict[int, int] = {}  # layer -> the next MoE layer, which it predicts
        predictor = source if source is not None else front
        if main and predictor is not None and predictor.predicts:
            self._next = dict(zip(sparse, sparse[1:], strict=False))
            if sparse and sparse[0] > 0:
                self._next[sparse[0] - 1] = sparse[0]  # the dense layer before the first MoE layer

    def mtp(self, one: ModelConfig) -> _Routed:
        """The MTP layer's (one layer, predicting nothing: its input needs the token the main
        model has just produced)."""
        return _Routed(one, self.rd, self.source, False, self.front, self.host_rd)

    def norm(self, p: str) -> RMSNorm:
        if p not in self._norms:
            weight = self.rd.vector(p + "post_attention_layernorm.weight", (self.cfg.hidden_size,))
            self._norms[p] = RMSNorm(weight, self.cfg.rms_norm_eps)
        return self._norms[p]

    def router(self, p: str) -> Router:
        if p not in self._routers:
            self._routers[p] = _router(self.cfg, self.rd, p)
        return self._routers[p]

    def store(self, layer: int, p: str) -> ExpertStore:
        """Layer `layer`'s store (`p`: its MLP's tensor prefix): the source's, or resident
        experts read for the front; behind the front when there is one."""
        if layer not in self._stores:
            if self.source is not None:
                store, resident = self.source.store(layer), False
            else:
                assert self.front is not None and self.host_rd is not None
                store, resident = _resident(self.cfg, self.host_rd, p), True
            self._stores[layer] = store if self.front is None else self.front.over(layer, store, resident)
        return self._stores[layer]

    def lookahead_after(self, layer: int) -> Lookahead | None:
        """The lookahead layer `layer` runs for the next MoE layer, if it predicts."""
        nxt = self._next.get(layer)
        if nxt is None:
            return None
        p = f"model.layers.{nxt}."
        return Lookahead(self.norm(p), self.router(p + "mlp."), self.store(nxt, p + "mlp."))

    def moe(self, p: str, layer: int) -> MoE:
        """The MoE layer read from the tensors named `p` (`model.layers.{i}.`)."""
        cfg, rd = self.cfg, self.rd
        router = self.router(p + "mlp.")
        shared = None
        if cfg.n_shared_experts:
            width = cfg.moe_intermediate_size * cfg.n_shared_experts
            shared = _swiglu(rd, p + "mlp.shared_experts.", cfg.hidden_size, width)
        if self.source is not None or self.front is not None:  # streamed, or behind a device cache
            return MoE(router, self.store(layer, p + "mlp."), shared, self.lookahead_after(layer))
        return MoE(router, _resident(cfg, rd, p + "mlp."), shared)


def _router(cfg: ModelConfig, rd: _Reader, p: str) -> Router:
    D, E = cfg.hidden_size, cfg.n_routed_experts
    return Router(
        cfg,
        RouterWeights(
            weight=make_linear(rd.vector(p + "gate.weight", (E, D)), "f32"),
            bias=(
                rd.vector(p + "gate.e_score_correction_bias", (E,))
                if rd.has(p + "gate.e_score_correction_bias")
                else torch.zeros(E, device=rd.device)
            ),
        ),
    )


def _resident(cfg: ModelConfig, rd: _Reader, p: str) -> ResidentExperts:
    """The layer's routed experts read from the checkpoint, in the experts' format."""
    D, E, I = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    if rd.has(p + "experts.gate_up_proj"):  # transformers' fused in-memory layout
        gate_up = rd.raw(p + "experts.gate_up_proj", (E, 2 * I, D))
        down = rd.raw(p + "experts.down_proj", (E, D, I))
        return ResidentExperts.from_float(gate_up, down, rd.expert_fmt)
    dtype = dense_dtype(rd.expert_fmt)
    if dtype is None or rd.has_packed(f"{p}experts.0.down_proj.weight"):
        # a packed format, or experts stored pre-quantized (a converted checkpoint's, a GGUF's):
        # each expert straight into its format, one at a time (never the layer in float)
        return ResidentExperts([_expert(rd, f"{p}experts.{e}.", D, I) for e in range(E)])
    # per-expert tensors, as checkpoints ship them: stacked here (the one copy)
    gate_up = torch.empty(E, 2 * I, D, dtype=dtype, device=rd.device)
    down = torch.empty(E, D, I, dtype=dtype, device=rd.device)
    for e in range(E):
        q = f"{p}experts.{e}."
        gate_up[e, :I] = rd.raw(q + "gate_proj.weight", (I, D))
        gate_up[e, I:] = rd.raw(q + "up_proj.weight", (I, D))
        down[e] = rd.raw(q + "down_proj.weight", (D, I))
    return ResidentExperts.from_float(gate_up, down, rd.expert_fmt)


def _expert(rd: _Reader, q: str, D: int, I: int) -> Expert:
    """One routed expert read from its own tensors into the experts' format."""
    gate_up = rd.prequantized([q + "gate_proj.weight", q + "up_proj.weight"])
    if gate_up is not None and (down := rd.prequantized([q + "down_proj.weight"])) is not None:
        return Expert(gate_up, down)
    gate_up = torch.cat([rd.raw(q + "gate_proj.weight", (I, D)), rd.raw(q + "up_proj.weight", (I, D))])
    down = rd.raw(q + "down_proj.weight", (D, I))
    return Expert(make_linear(gate_up, rd.expert_fmt), make_linear(down, rd.expert_fmt))

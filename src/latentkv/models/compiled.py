"""`--compile`: the one-token decode step compiled by inductor, in one of two forms.

A small model's decode step is a few hundred tiny torch ops, and eager PyTorch pays Python and
dispatch overhead for each (3-6 us on a 2-core VM): that, not arithmetic, is its cost. Both
forms trace the whole step (embedding to logits, cache writes included) into one graph, fuse
the elementwise work into generated C++ loops and call the matmuls and latentkv's kernels
directly:

  - `ExportedDecode` (a model on the CPU whose whole context is fixed in advance and whose
    weights are at most EXPORT_MAX_WEIGHT_BYTES: builtin:fixture, builtin:tiny): torch.export
    and AOTInductor, the weights constants of a C++ program, a call straight into its runner.
  - `CompiledDecode` (every other model): torch.compile, whose every call also runs its frame,
    its guards and hands over every weight the graph reads (docs/performance.md: ~74 us a call
    for ~130 tensors).

`decode_step` picks; what follows holds for both unless it says.

What it costs and guarantees:
  - Compiling takes tens of seconds once (torch.compile keeps its generated code in inductor's
    on-disk cache, an exported step its built programs in the cache root's steps/, so later
    processes start in seconds). `compile_decode` warms the graph up on a scratch cache so no
    request pays for it; DSA models warm a second graph for contexts past `index_topk`. An
    exported step keeps its own copy of the weights.
  - Sizes are dynamic in the context length only, so one graph serves every length. A small
    model's caches and RoPE tables are given their full context at the first compiled step
    (`fixed_length`), so the cache's length is the graph's one symbolic size; a bigger model's
    buffers grow before the compiled call and their lengths are symbolic sizes too (marked so;
    every other size is a constant of the graph).
  - A C++ compiler must be installed (inductor builds its CPU kernels with it).
  - int8 and int4 weights trace as latentkv's own kernels (`latentkv/native`): one call per
    matrix, and a layer's resident routed experts in one call.
  - Prefill and batched decode (the server) stay eager. Logits are not bit-identical to the
    eager step (fused reductions round differently); they agree within float32 rounding
    (tests compare against eager and against transformers).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from latentkv import fs, native
from latentkv.config import cache_root
from latentkv.weights.base import format_class

if TYPE_CHECKING:
    from latentkv.config import ModelConfig
    from latentkv.kv.cache import KVTier, LatentCache, PackedLatentCache
    from latentkv.models.layers import Rope


class _Model(Protocol):
    """What the compiled step needs of `latentkv.models.model.Model` (not imported: the model
    imports this module)."""

    cfg: ModelConfig
    rope: Rope
    f32: KVTier  # the reference tier: float32 rows

    def forward(self, tokens: torch.Tensor, cache, all_logits: bool = False) -> torch.Tensor: ...

    def _forward(self, tokens: torch.Tensor, cache, all_logits: bool = False) -> torch.Tensor: ...

    def check_context(self, length: int) -> None: ...

    def make_cache(self, tier: KVTier | None = None): ...

    def weight_bytes(self) -> int: ...


class CompileUnavailable(RuntimeError):
    pass


def _cxx() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


# KV tiers whose one-token step traces into one graph. The rotated and polar codecs' bit
# unpacking breaks the graph in many places, and their compiled step is slower than the eager one.
COMPILABLE_TIERS = ("f32", "bf16", "fp8")


def check_compilable(tier: str = "f32", recent_window: int = 0, formats: tuple[str | None, ...] = ()) -> None:
    """Raise CompileUnavailable unless a step over caches of `tier` (with that recent window)
    and weights in `formats` can be compiled here. int8 and int4 trace as latentkv's kernels (one call per matrix, and a
    layer's resident experts in one call): without them (torch's ops) the experts' Python
    would break the graph at every layer, so they are refused."""
    needs = [f for f in dict.fromkeys(formats) if f is not None and format_class(f).compile_needs_native]
    if needs and native.kernels() is None:
        raise CompileUnavailable(
            f"--compile runs {' and '.join(needs)} weights through latentkv's own kernels, which are not "
            f"available here ({native.unavailable()}): drop --compile, or use another weight format"
        )
    if tier not in COMPILABLE_TIERS or recent_window:
        raise CompileUnavailable(
            f"--compile supports the KV tiers {', '.join(COMPILABLE_TIERS)} (without a recent window); "
            f"{tier} decodes eagerly: drop --compile or pick one of those tiers"
        )
    if _cxx() is None:
        raise CompileUnavailable(
            "--compile needs a C++ compiler for torch.compile's CPU backend (g++ or clang++; "
            "e.g. `apt install g++`), or set CXX; run without --compile to decode eagerly"
        )


# Guards on torch's global state and the symbolic-shape guards (which pick the graph for contexts
# past DSA's index_topk) are always kept.
_STATE_GUARDS = frozenset(
    {
        "SHAPE_ENV",
        "GRAD_MODE",
        "DETERMINISTIC_ALGORITHMS",
        "GLOBAL_STATE",
        "TORCH_FUNCTION_STATE",
        "DEFAULT_DEVICE",
        "AUTOGRAD_SAVED_TENSORS_HOOKS",
    }
)


def step_guard(name: str, guard_type: str) -> bool:
    """Whether the compiled step keeps a guard torch.compile made (source `name`, kind
    `guard_type`). A graph is checked against its guards on every call: ~800 of them on
    builtin:fixture (each weight's dtype and shape, each block's constants, the identity of every
    module and function the step calls), ~140 us of a 1 ms step. Kept: the guards on the step's
    arguments (the token, the cache: its tier, buffers and length choose the graph), on the RoPE
    tables (which grow), and on torch's state. Dropped: those on the model's own blocks and
    weights (`self.`) and on module globals and functions (`G[...]`, closures, builtins): none of
    them changes once a model is loaded, and another model never reaches this graph: each
    `CompiledDecode` keeps its graphs apart (`isolate_recompiles`; tests/models/test_compiled.py
    decodes models of the same shapes in two weight formats, and of two architectures, alternately)."""
    if guard_type in _STATE_GUARDS:
        return True
    if guard_type in ("CLOSURE_MATCH", "BUILTIN_MATCH", "MODULE_MATCH"):
        return False
    model_part = "self." in name and "self.rope" not in name
    return not (model_part or name.startswith("G["))


def step_guards(entries) -> list[bool]:
    """torch.compile's `guard_filter_fn` for the step: `step_guard` per entry."""
    return [step_guard(e.name, e.guard_type) for e in entries]


def tag_inductor_cache() -> None:
    """Key torch.compile's on-disk caches by torch's CPU capability, unless the user set a tag.

    Inductor's cache of compiled graphs does not tell apart processes that run torch's kernels
    at different capabilities (ATEN_CPU_CAPABILITY): a step compiled under AVX-512 and reused
    under `avx2` on the same machine returned NaN logits (tests/models/test_compiled.py, run
    under both in turn). The tag (`torch.compiler.config.cache_key_tag`, env
    TORCH_COMPILE_CACHE_KEY_TAG) is part of every cache key, so each capability keeps its own."""
    if not torch.compiler.config.cache_key_tag:
        torch.compiler.config.cache_key_tag = f"latentkv-aten-{torch.backends.cpu.get_cpu_capability()}"


# A model whose cache at full context fits this (float32 rows and indexer keys, one sequence)
# decodes through caches and RoPE tables of that full size (`fixed_length`).
FIXED_CACHE_MAX_BYTES = 64 << 20


def fixed_length(model: _Model) -> int | None:
    """The context the compiled step sizes every cache and RoPE table for at once, or None.

    With storage that grows, each cache buffer's length (4-5 per layer) and each RoPE table's is
    a symbolic size of the graph: every step boxes each into a tensor for the graph's C++ entry,
    which reads it back, and checks its guards; on builtin:fixture that was ~15% of a step. A
    small model's whole context is a few MB, so its caches are given it at once (the first
    compiled step moves a cache's rows to storage of `max_position_embeddings` rows, which then
    never grows) and only the cache's length stays symbolic. Models whose full-context cache
    would pass FIXED_CACHE_MAX_BYTES keep growing storage."""
    n = model.cfg.max_position_embeddings
    return n if n * model.f32.bytes_per_token <= FIXED_CACHE_MAX_BYTES else None


# A model whose weights take more than this keeps torch.compile's step: the exported program holds
# its own copy of every weight (`ExportedDecode`).
EXPORT_MAX_WEIGHT_BYTES = 256 << 20


class DecodeStep(Protocol):
    """A model's one-token step, installed by `Model.compile_decode` (`decode_step` picks it)."""

    def __call__(
        self, tokens: torch.Tensor, cache: LatentCache | PackedLatentCache, all_logits: bool = False
    ) -> torch.Tensor: ...

    def warm_up(self, make_cache, progress: bool = True) -> float: ...


def decode_step(model: _Model, tier: KVTier) -> DecodeStep:
    """The step `--compile` runs for `model`: its AOTInductor programs (`ExportedDecode`) for a
    small model on the CPU (whole context fixed in advance, weights within
    EXPORT_MAX_WEIGHT_BYTES), else the torch.compile'd step (`CompiledDecode`)."""
    small = fixed_length(model) is not None and model.weight_bytes() <= EXPORT_MAX_WEIGHT_BYTES
    if small and model.rope.inv_freq.device.type == "cpu":
        return ExportedDecode(model, tier)
    return CompiledDecode(model, tier)


def warm_step(
    model: _Model, tier: KVTier, step: DecodeStep | None, progress: bool = True
) -> tuple[DecodeStep, float]:
    """`step` (a new one from `decode_step` when None) built and warmed up for caches of `tier`
    -> (the step, seconds taken). An exported step that cannot be built for this model gives way
    to torch.compile's, with one line on stderr saying why."""
    step = step or decode_step(model, tier)
    try:
        return step, step.warm_up(lambda: model.make_cache(tier), progress)
    except Exception as exc:  # torch.export or AOTInductor could not build this model's step
        if not isinstance(step, ExportedDecode):
            raise
        why = (str(exc).strip().splitlines() or [""])[0][:200]
        print(
            f"note: the ahead-of-time decode step could not be built ({type(exc).__name__}: {why}); "
            "compiling with torch.compile instead",
            file=sys.stderr,
            flush=True,
        )
        step = CompiledDecode(model, tier)
        return step, step.warm_up(lambda: model.make_cache(tier), progress)


def program_key(program) -> str:
    """What a built step depends on, hashed: the exported program's graph, signature and ranges,
    every constant's name, dtype, shape and bytes, torch's version, its CPU capability and the
    cache tag (inductor's generated code differs by all three)."""
    h = hashlib.sha256()
    for part in (
        torch.__version__,
        torch.backends.cpu.get_cpu_capability(),
        str(torch.compiler.config.cache_key_tag),
        program.graph_module.code,
        str(program.graph_signature),
        str(program.range_constraints),
    ):
        h.update(part.encode() + b"\0")
    for name, value in sorted({**program.constants, **program.state_dict}.items()):
        h.update(name.encode() + b"\0")
        if isinstance(value, torch.Tensor):
            t = value.detach().contiguous().cpu()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(value).encode())
    return h.hexdigest()[:32]


class ExportedDecode:
    """A small model's one-token step as AOTInductor programs: the step is traced once per range
    of context lengths its code branches on (below and above DSA's `index_topk`) by
    `torch.export`, with the cache's length as a symbolic size, and built ahead of time into a
    C++ library whose runner a call enters directly. The weights are constants inside the
    program, so a call hands over only the token, the cache's storage tensors and a tensor whose
    size is the context: no torch.compile frame, guards or ~130 weight inputs per call
    (on builtin:fixture, int8 weights and KV bf16: 0.67 -> 0.49 ms a step).

    What the program does not do is what `Model.forward`'s Python does around the graph: the
    cache's length moves on here after the call (`commit`); its storage is fixed at the model's
    whole context first (`fixed_length`). Each tier gets its programs on first use (`warm_up`
    does it before timing or serving). The program keeps a copy of the weights: models above
    EXPORT_MAX_WEIGHT_BYTES keep `CompiledDecode`."""

    def __init__(self, model: _Model, tier: KVTier):
        check_compilable(tier.name, tier.recent_window)
        tag_inductor_cache()
        fixed = fixed_length(model)
        if fixed is None:
            raise ValueError("an exported decode step needs a model whose whole context is fixed in advance")
        self.model, self.fixed = model, fixed
        model.rope.fix(fixed)
        # sliced to the context T = length + 1: the program reads only the slice's size
        self._sizes = torch.empty(fixed, dtype=torch.uint8)
        self._programs: dict[str, list[tuple[int, int, object]]] = {}
        self._dir: tempfile.TemporaryDirectory | None = None  # builds the cache could not keep
        self.packages: list[Path] = []  # the built programs' files, in the order built or loaded

    def ranges(self) -> list[tuple[int, int]]:
        """The contexts T (cached tokens + the new one) each program serves, inclusive. From 3:
        the step's code tells one cached token from more (traced from 2, the program specialized
        to it), so the step after a one-token prompt runs eagerly."""
        dsa = self.model.cfg.dsa
        if dsa is not None and 3 <= dsa.index_topk < self.fixed:  # past index_topk the indexer selects
            return [(3, dsa.index_topk), (dsa.index_topk + 1, self.fixed)]
        return [(3, self.fixed)]

    @torch.inference_mode()
    def __call__(
        self, tokens: torch.Tensor, cache: LatentCache | PackedLatentCache, all_logits: bool = False
    ) -> torch.Tensor:
        self.model.check_context(cache.length + tokens.shape[0])
        if cache.fixed != self.fixed:
            cache.fix_capacity(self.fixed)
        context = cache.length + 1
        for low, high, runner in self._tier_programs(cache.tier):
            if low <= context <= high:
                out = runner(tokens, self._sizes[:context], *cache.storage())
                cache.commit(1)
                return out if isinstance(out, torch.Tensor) else out[0]  # the logits [1, vocab]
        return self.model._forward(tokens, cache, all_logits)  # a context no program serves (2)

    def _tier_programs(self, tier: KVTier) -> list[tuple[int, int, object]]:
        if tier.name not in self._programs:
            self._programs[tier.name] = [self._export(tier, low, high) for low, high in self.ranges()]
        return self._programs[tier.name]

    def _export(self, tier: KVTier, low: int, high: int) -> tuple[int, int, object]:
        """The program for contexts low..high: traced at context `low` through a scratch cache."""
        model = self.model
        device = model.rope.inv_freq.device
        cache = model.make_cache(tier)
        model.forward(torch.zeros(low - 1, dtype=torch.long, device=device), cache)
        cache.fix_capacity(self.fixed)
        token = torch.zeros(1, dtype=torch.long, device=device)
        with torch.inference_mode():  # an eager step first: it builds the RoPE patterns the step reads
            model._forward(token, cache)
        length = cache.length  # context low + 1 for the trace (within the range unless low == high)
        with torch.inference_mode(False):
            # plain copies to trace with: the tracer does not record writes into inference tensors
            # (the cache's own); the program then writes into whatever storage a call hands it
            storage = [t.clone() for t in cache.storage()]

        class _Step(torch.nn.Module):
            def forward(self, tokens, sizes, *tensors):
                with cache.stored_in(tensors, sizes.shape[0] - 1):
                    return model._forward(tokens, cache)

        context = torch.export.Dim("context", min=low, max=high)
        example = self._sizes[: min(length + 1, high)]
        with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's own deprecations, not the user's
            program = torch.export.export(
                _Step(),
                (token, example, *storage),
                dynamic_shapes=(None, {0: context}, (None,) * len(storage)),
                strict=False,
            )
            return low, high, self._built(program, f"{tier.name}-{low}")

    def _built(self, program, name: str):
        """The runner of `program`: loaded from the cache of built steps when this very program
        (its graph, its constants: the weights) was built before under this torch and CPU
        capability, else built now (~12 s) and kept there (published by rename; where the cache
        cannot be written, the build stays in a temporary directory)."""
        path = cache_root() / "steps" / f"{program_key(program)}.pt2"
        if path.is_file():
            try:
                runner = torch._inductor.aoti_load_package(str(path))
                self.packages.append(path)
                return runner
            except Exception:  # a damaged or foreign file: built again below
                fs.remove(path)
        tmp = fs.temp_name(path).with_suffix(".pt2")  # AOTInductor takes only a .pt2 name
        try:
            fs.make_dirs(path.parent, "keeping a built decode step")
            torch._inductor.aoti_compile_and_package(program, package_path=str(tmp))
            fs.rename(tmp, path, "keeping a built decode step")
        except fs.DiskError:
            fs.remove(tmp)
            self._dir = self._dir or tempfile.TemporaryDirectory(prefix="latentkv-step-")
            path = Path(self._dir.name) / f"{name}.pt2"
            torch._inductor.aoti_compile_and_package(program, package_path=str(path))
        self.packages.append(path)
        return torch._inductor.aoti_load_package(str(path))

    def warm_up(self, make_cache, progress: bool = True) -> float:
        """Build the programs for the tier `make_cache` makes caches of; returns the seconds taken."""
        t0 = time.perf_counter()
        if progress:
            print(
                "building the decode step (torch.export + AOTInductor; tens of seconds)...",
                file=sys.stderr,
                flush=True,
            )
        self._tier_programs(make_cache().tier)
        seconds = time.perf_counter() - t0
        if progress:
            print(f"built in {seconds:.1f} s", file=sys.stderr, flush=True)
        return seconds


class CompiledDecode:
    """The model's one-token forward pass, compiled; called by `Model.forward` for S == 1 once
    `Model.compile_decode` installed it, or directly (`latentkv bench decode` times both)."""

    def __init__(self, model: _Model, tier: KVTier):
        check_compilable(tier.name, tier.recent_window)
        tag_inductor_cache()
        self.model = model
        self.fixed = fixed_length(model)
        if self.fixed is not None:
            model.rope.fix(self.fixed)
        # cpp_wrapper: the generated code that calls the kernels is C++ too, not Python (~10% a step).
        # dynamic=None: only the dimensions marked dynamic (the cache buffers' and RoPE tables'
        # lengths) are symbolic; with dynamic=True every weight's size became a graph input read
        # back per step (143 inputs on builtin:tiny, ~17% of its step).
        # guard_filter_fn: the model's own structure is not re-checked every step (see `step_guard`);
        # isolate_recompiles: so this model's graphs are its own. Without it every torch.compile of
        # `Model._forward` with equal options shares one set of graphs, and with those guards gone
        # a model of the same shapes in another weight format ran the first one's graph.
        # fullgraph: a graph break is an error here, not a silent split: with the model's guards
        # dropped, the frames a break resumes in would be shared by every block of the model.
        self._step = torch.compile(
            model._forward,
            fullgraph=True,
            dynamic=None,
            options={"cpp_wrapper": True, "guard_filter_fn": step_guards},
            isolate_recompiles=True,
        )

    @torch.inference_mode()
    def __call__(
        self, tokens: torch.Tensor, cache: LatentCache | PackedLatentCache, all_logits: bool = False
    ) -> torch.Tensor:
        # checked here: the graph cannot raise (an exception inside it stops torch.compile instead)
        self.model.check_context(cache.length + tokens.shape[0])
        # growth happens here, outside the graph: inside it would be a branch the graph guards on
        if self.fixed is None:
            self.model.rope.reserve(cache.length + 1)
            cache.reserve(1)
        elif cache.fixed != self.fixed:
            cache.fix_capacity(self.fixed)
        return self._step(tokens, cache, all_logits)

    def warm_up(self, make_cache, progress: bool = True) -> float:
        """Compile every graph decoding will need, on scratch caches; returns the seconds taken."""
        t0 = time.perf_counter()
        if progress:
            print(
                "compiling the decode step (torch.compile; tens of seconds)...", file=sys.stderr, flush=True
            )
        model = self.model
        lengths = [4]
        dsa = model.cfg.dsa
        if dsa is not None and dsa.index_topk + 2 <= model.cfg.max_position_embeddings:
            lengths.append(dsa.index_topk + 1)  # past index_topk the indexer selects: another graph
        device = model.rope.inv_freq.device
        token = torch.zeros(1, dtype=torch.long, device=device)
        for length in lengths:
            cache = make_cache()
            model.forward(torch.zeros(length, dtype=torch.long, device=device), cache)
            with torch.inference_mode():  # an eager step first: it builds the RoPE patterns the graph reads
                model._forward(token, cache)
            for _ in range(2):  # the second call checks the first graph serves the next length
                self(token, cache)
        seconds = time.perf_counter() - t0
        if progress:
            print(f"compiled in {seconds:.1f} s", file=sys.stderr, flush=True)
        return seconds

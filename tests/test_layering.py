"""The import graph of src/latentkv: layers import downward only, and nothing imports in a circle.

Every `import` and `from ... import` counts, inside functions and `if TYPE_CHECKING:` too: an
import deferred into a function is still a dependency. The layers, lowest first (a unit is a
top-level module or package of latentkv; docs/architecture.md draws them):

    0  __init__ (version), errors, config,       what everything may use
       progress (a stage's progress on stderr)
    1  fs                                        the one way to touch the file system (DiskError)
    2  tokenizer, chat_template, native          text in and out; no model; the C++ kernels (kv,
                                                 weights and attention call them)
    3  kv, weights                               KV codecs, caches, the KV file; weight formats (Linear)
    4  attention, experts                        attention backends over kv; expert stores over weights
    5  models                                    a forward pass over a Batch, through the seams above
    6  streaming                                 experts streamed from disk into a model: attach, convert, plan
    7  cluster                                   experts over several ranks (torch.distributed): head, workers
    8  runtime                                   load a model + tokenizer for running
    9  engine                                    generation, sampling, the scheduler, its process
    10 eval, server                              leaves that use the engine (siblings: neither imports the other)
    11 commands                                  the CLI's subcommands (serve starts the server)
    12 cli                                       argparse -> commands
    13 __main__                                  `python -m latentkv`

A unit may import its own modules and units of lower layers, never a unit of its own layer or
above. Circles are checked between units and between modules (a package's `__init__` is the
package's module; `from pkg import mod` is an edge to the module `pkg.mod`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import latentkv

SRC = Path(latentkv.__file__).parent

LAYERS: list[tuple[str, ...]] = [
    ("__init__", "errors", "config", "progress"),
    ("fs",),
    ("tokenizer", "chat_template", "native"),
    ("kv", "weights"),
    ("attention", "experts"),
    ("models",),
    ("streaming",),
    ("cluster",),
    ("runtime",),
    ("engine",),
    ("eval", "server"),
    ("commands",),
    ("cli",),
    ("__main__",),
]
LAYER = {unit: level for level, units in enumerate(LAYERS) for unit in units}


def module_name(root: Path, path: Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(root: Path, path: Path) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import in `path` that names something under `root`."""
    here = module_name(root, path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[: len(package) - (node.level - 1)]
                base = ".".join([*up, *([node.module] if node.module else [])])
            # `from pkg import mod` depends on the module pkg.mod when there is one
            targets = [_submodule(root, base, a.name) for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            targets = [node.args[0].value]
        else:
            continue
        for target in targets:
            if target == root.name or target.startswith(root.name + "."):
                yield target, node.lineno


def _submodule(root: Path, base: str, name: str) -> str:
    candidate = f"{base}.{name}"
    rel = Path(*candidate.split(".")[1:])
    exists = (root / rel).with_suffix(".py").exists() or (root / rel / "__init__.py").exists()
    return candidate if exists else base


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


Graph = dict[str, dict[str, list[str]]]


def graph(root: Path) -> Graph:
    """module -> {imported module: ["file:line", ...]}, modules of `root` only."""
    out: dict[str, dict[str, list[str]]] = {}
    for path in sorted(root.rglob("*.py")):
        edges = out.setdefault(module_name(root, path), {})
        for target, line in imports(root, path):
            edges.setdefault(target, []).append(f"{path.relative_to(root.parent)}:{line}")
    return out


def layer_violations(g: Graph, layer: dict[str, int]) -> list[str]:
    bad = []
    for module, edges in g.items():
        src = unit_of(module)
        for target, where in edges.items():
            dst = unit_of(target)
            if src == dst:
                continue
            if src not in layer or dst not in layer:
                unknown = src if src not in layer else dst
                bad.append(f"{where[0]}: {unknown!r} has no layer: add it to LAYERS (and the docs)")
            elif layer[dst] >= layer[src]:
                bad.append(
                    f"{where[0]}: {src} (layer {layer[src]}) imports {target} ({dst}, layer {layer[dst]})"
                )
    return bad


def circles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.add(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def module_edges(g: Graph) -> dict[str, set[str]]:
    # A module's own package __init__ runs first but is not a dependency of the module's code.
    return {m: {t for t in targets if t != m and not m.startswith(t + ".")} for m, targets in g.items()}


def unit_edges(g: Graph) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for module, targets in g.items():
        src = unit_of(module)
        out.setdefault(src, set()).update(unit_of(t) for t in targets if unit_of(t) != src)
    return out


# --- the package ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def src() -> Graph:
    return graph(SRC)


def test_every_unit_has_a_layer():
    units = {unit_of(module_name(SRC, p)) for p in SRC.rglob("*.py")}
    assert units <= set(LAYER), f"no layer for {sorted(units - set(LAYER))}: add them to LAYERS"


def test_no_module_imports_its_own_layer_or_above(src):
    assert layer_violations(src, LAYER) == []


def test_no_circle_between_units(src):
    assert circles(unit_edges(src)) == []


def test_no_circle_between_modules(src):
    assert [sorted(c) for c in circles(module_edges(src))] == []


# --- the checker itself, on a made-up package ------------------------------------------------


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    root = tmp_path / "latentkv"
    files = {
        "__init__.py": "",
        "config.py": "",
        "kv/__init__.py": "",
        "kv/cache.py": "from latentkv.config import X\n",
        "engine/__init__.py": "",
        "engine/a.py": "from . import b\n",
        "engine/b.py": "def f():\n    from latentkv.engine.a import g\n",
        "commands/__init__.py": "",
        "commands/chat.py": "import latentkv.kv.cache\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


FAKE_LAYERS = {"__init__": 0, "config": 0, "kv": 1, "engine": 2, "commands": 3}


def test_the_checker_finds_an_upward_import_inside_a_function(fake):
    assert layer_violations(graph(fake), FAKE_LAYERS) == []
    (fake / "kv" / "cache.py").write_text("def load():\n    from latentkv.commands import chat\n")
    assert layer_violations(graph(fake), FAKE_LAYERS) == [
        "latentkv/kv/cache.py:2: kv (layer 1) imports latentkv.commands.chat (commands, layer 3)"
    ]


def test_the_checker_finds_a_sibling_import_and_an_unknown_unit(fake):
    (fake / "server.py").write_text("")
    (fake / "kv" / "cache.py").write_text("import latentkv.server\n")
    layers = {**FAKE_LAYERS, "server": 1}
    assert layer_violations(graph(fake), layers) == [
        "latentkv/kv/cache.py:1: kv (layer 1) imports latentkv.server (server, layer 1)"
    ]
    assert "'server' has no layer" in layer_violations(graph(fake), FAKE_LAYERS)[0]


def test_the_checker_finds_circles_of_modules_and_units(fake):
    assert circles(module_edges(graph(fake))) == [frozenset({"latentkv.engine.a", "latentkv.engine.b"})]
    assert circles(unit_edges(graph(fake))) == []
    (fake / "kv" / "cache.py").write_text("from latentkv.engine import a\n")
    (fake / "engine" / "c.py").write_text("import latentkv.kv.cache\n")
    assert circles(unit_edges(graph(fake))) == [frozenset({"kv", "engine"})]

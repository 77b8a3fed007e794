"""Budgets for the fuzzers (issue 13): a small one in `make test`, a large one under `-m slow`.

pytest tests/fuzz                     # quick: every fuzzer, together well under 2 minutes
pytest tests/fuzz -m slow             # long: the same fuzzers with many more cases
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # kvcraft and budget, the helpers the fuzzers share


def _server_helpers():
    """tests/server/conftest.py's live-server helpers (its fixtures are not visible from here)."""
    import importlib.util

    path = Path(__file__).parent.parent / "server" / "conftest.py"
    spec = importlib.util.spec_from_file_location("latentkv_tests_server_helpers", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def serve():
    """start_server(model, log, *flags, key=..., env=...), as in tests/server."""
    return _server_helpers().start_server

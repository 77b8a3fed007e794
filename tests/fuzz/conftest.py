"""Budgets for the fuzzers (issue 13): a small one in `make test`, a large one under `-m slow`.

pytest tests/fuzz                     # quick: every fuzzer, together well under 2 minutes
pytest tests/fuzz -m slow             # long: the same fuzzers with many more cases
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # kvcraft and budget, the helpers the fuzzers share

"""Case budgets for the fuzzers: `quick` in `make test`, `long` under `-m slow` (see conftest)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

_COMMON = {
    "deadline": None,
    "database": None,
    "suppress_health_check": [
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
}
QUICK = {"max_examples": 40, "derandomize": True, **_COMMON}  # fixed cases: CI is reproducible
LONG = {"max_examples": 2000, "derandomize": False, **_COMMON}  # fresh cases on every long run


def quick(scale: float = 1.0) -> settings:
    return settings(**{**QUICK, "max_examples": max(1, int(QUICK["max_examples"] * scale))})


def long(scale: float = 1.0) -> settings:
    return settings(**{**LONG, "max_examples": max(1, int(LONG["max_examples"] * scale))})

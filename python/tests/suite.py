"""Settings shared by conftest.py and the test modules (importable in the rank processes too)."""
import os

import pytest

BACKEND = os.environ.get("COMMUX_TEST_BACKEND", "ucx")  # backend under test
ALLOW_MISSING = os.environ.get("COMMUX_TESTS_ALLOW_MISSING") == "1"


def uses_commux() -> bool:
    return BACKEND in ("ucx", "commux")


def worlds(*sizes: int):
    """Parametrises ``ws`` with session scope: pytest then groups the tests by world size, so a
    pool of ``ws`` ranks is started once per world size rather than per test."""
    return pytest.mark.parametrize("ws", sizes or (1, 2, 3, 4), ids=lambda w: f"ws{w}", scope="session")

"""Fixtures shared by every test (helpers live in the ``support`` package)."""

from __future__ import annotations

import os

import hypothesis  # noqa: F401  (imported here, not first by hypothesis's plugin at the session's end; see below)
import numpy as np
import pytest

# A run of test files that never import hypothesis ended, after every test passed, with
# "SystemError: AST constructor recursion depth mismatch": hypothesis's pytest plugin imports it
# in the terminal summary, pytest's assertion rewriting parses it there, and CPython 3.11.7's
# ast.parse raised that error (tests/test_docs.py and three others with -p no:cacheprovider,
# every time, on the code before this change too). Imported at collection, it is parsed early.


@pytest.fixture(autouse=True, scope="session")
def _flight_records_in_a_temp_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Flight records of the failures the tests provoke go to pytest's temp dir, not /tmp."""
    os.environ.setdefault("AHCOMM_FLIGHT_DIR", str(tmp_path_factory.mktemp("flight")))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)

"""Fixtures shared by every test (helpers live in the ``support`` package)."""

from __future__ import annotations

import os

import numpy as np
import pytest


@pytest.fixture(autouse=True, scope="session")
def _flight_records_in_a_temp_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Flight records of the failures the tests provoke go to pytest's temp dir, not /tmp."""
    os.environ.setdefault("AHCOMM_FLIGHT_DIR", str(tmp_path_factory.mktemp("flight")))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)

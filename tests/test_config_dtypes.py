"""Leaves: reduce ops and dtypes, environment parsing, AHCOMM_ALGO grammar."""

from __future__ import annotations

import numpy as np
import pytest

import ahcomm
from ahcomm._config import Config
from ahcomm._dtypes import ReduceOp, check_dtype, check_reduce
from ahcomm.algorithms._selection import parse_algo


def test_reduce_op_parse() -> None:
    assert ReduceOp.parse("SUM") is ReduceOp.SUM
    assert ReduceOp.parse(ReduceOp.MAX) is ReduceOp.MAX
    with pytest.raises(ahcomm.InvalidArgument, match="unknown reduce op 'mean'"):
        ReduceOp.parse("mean")


def test_dtypes_supported_and_rejected() -> None:
    for dt in ahcomm.SUPPORTED_DTYPES:
        assert check_dtype(dt) == dt
    with pytest.raises(ahcomm.InvalidDtype, match="complex128"):
        check_dtype(np.dtype(np.complex128))
    with pytest.raises(ahcomm.InvalidDtype):
        check_dtype(np.dtype(">f4"))  # non-native byte order
    with pytest.raises(TypeError, match="avg"):
        check_reduce(ReduceOp.AVG, np.dtype(np.int32))


def test_config_reads_ours_then_torchrun_then_mpi_then_slurm() -> None:
    assert Config.from_env({"AHCOMM_RANK": "1", "RANK": "5"}).rank == 1
    cfg = Config.from_env({"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "99"})
    assert (cfg.rank, cfg.world_size, cfg.master_addr, cfg.master_port) == (2, 4, "h", 99)
    cfg = Config.from_env({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8"})
    assert (cfg.rank, cfg.world_size) == (3, 8)
    cfg = Config.from_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "PMI_RANK": "0"})
    assert cfg.rank == 0  # PMI comes before Slurm
    assert Config.from_env({"AHCOMM_BUFFSIZE": "2"}).buffsize == 2 << 20


def test_config_errors_name_the_variable() -> None:
    with pytest.raises(ahcomm.ConfigError, match="AHCOMM_RANK"):
        Config.from_env({"AHCOMM_RANK": "x"})
    with pytest.raises(ahcomm.ConfigError, match="AHCOMM_TRANSPORT"):
        Config.from_env({"AHCOMM_TRANSPORT": "carrier-pigeon"})
    with pytest.raises(ahcomm.ConfigError, match="AHCOMM_EXEC_TIMEOUT"):
        Config.from_env({"AHCOMM_EXEC_TIMEOUT": "-1"})


def test_algo_grammar() -> None:
    assert parse_algo("level0:NA;level1:ring") == {"*": {1: "ring"}}
    assert parse_algo("allreduce=level0:mesh;level1:NHR/alltoall=level1:pairwise") == {
        "all_reduce": {0: "mesh", 1: "nhr"}, "all_to_all": {1: "pairwise"}}
    with pytest.raises(ahcomm.ConfigError, match="levelN:NAME"):
        parse_algo("ring")
    with pytest.raises(ahcomm.ConfigError, match="unknown op"):
        parse_algo("allsum=level0:ring")


def test_algorithm_names() -> None:
    assert set(ahcomm.algorithms.names("all_reduce")) >= {"ring", "mesh"}
    assert "dissemination" in ahcomm.algorithms.names("barrier")

"""Leaves: reduce ops and dtypes, environment parsing, AHCOMM_ALGO grammar."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import ahcomm
from ahcomm._config import Config
from ahcomm._dtypes import ML_FLOAT_DTYPES, ReduceOp, check_dtype, check_reduce, finish_avg, is_float, ufunc_for
from ahcomm._errors import ConfigError
from ahcomm.algorithms._selection import parse_algo


def test_reduce_op_parse() -> None:
    assert ReduceOp.parse("SUM") is ReduceOp.SUM
    assert ReduceOp.parse(ReduceOp.MAX) is ReduceOp.MAX
    with pytest.raises(ahcomm.InvalidArgument, match="unknown reduce op 'mean'"):
        ReduceOp.parse("mean")
    assert [ReduceOp.parse(s) for s in ("band", " BOR", "bxor")] == [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]
    assert ReduceOp.parse("band") is ahcomm.ReduceOp.BAND
    with pytest.raises(ahcomm.InvalidArgument, match="expected one of: sum, prod, max, min, avg, band, bor, bxor"):
        ReduceOp.parse("and")


def test_dtypes_supported_and_rejected() -> None:
    for dt in ahcomm.SUPPORTED_DTYPES:
        assert check_dtype(dt) == dt
    with pytest.raises(ahcomm.InvalidDtype, match="complex128"):
        check_dtype(np.dtype(np.complex128))
    with pytest.raises(ahcomm.InvalidDtype):
        check_dtype(np.dtype(">f4"))  # non-native byte order
    with pytest.raises(TypeError, match="avg"):
        check_reduce(ReduceOp.AVG, np.dtype(np.int32))


F32 = np.float32
ML_IDS = [str(d) for d in ML_FLOAT_DTYPES]
BITWISE = [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]


def _same_bits(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Elementwise: identical bit patterns, or both NaN (of any payload)."""
    uint = np.dtype(f"u{got.dtype.itemsize}")
    both_nan = np.isnan(got.astype(F32)) & np.isnan(want.astype(F32))
    same: np.ndarray = (got.view(uint) == want.view(uint)) | both_nan
    return same


def _every_value(dt: np.dtype) -> np.ndarray:
    return np.arange(1 << (8 * dt.itemsize), dtype=f"u{dt.itemsize}").view(dt)


def test_ml_dtypes_are_supported_floats() -> None:
    names = {str(d) for d in ahcomm.SUPPORTED_DTYPES}
    assert {"bfloat16", "float8_e4m3fn", "float8_e5m2"} <= names
    for t in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
        dt = np.dtype(t)
        assert check_dtype(dt) == dt and is_float(dt)
        assert check_dtype(np.zeros(3, t).dtype) == dt
    assert check_dtype(np.dtype("bfloat16")) == np.dtype(ml_dtypes.bfloat16)  # the name works once imported
    for dt in (np.dtype(np.int32), np.dtype(np.bool_)):
        assert not is_float(dt)
    # a raw 2-byte (or 1-byte) void is not a bfloat16 (float8), though numpy calls bfloat16 kind "V" too
    for other in ("V2", "V1", np.dtype([("a", "<u2")]), ml_dtypes.float8_e4m3b11fnuz, ml_dtypes.int4):
        with pytest.raises(ahcomm.InvalidDtype, match="not supported; supported: .*bfloat16"):
            check_dtype(np.dtype(other))


@pytest.mark.parametrize("op", BITWISE, ids=lambda o: o.value)
def test_bitwise_ops_reject_floats(op: ReduceOp) -> None:
    floats: list[np.dtype] = [np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64), *ML_FLOAT_DTYPES]
    for dt in floats:
        with pytest.raises(ahcomm.InvalidDtype, match=rf"reduce op '{op.value}' .*integer or bool dtype, got {dt}"):
            check_reduce(op, dt)
        with pytest.raises(ahcomm.InvalidDtype, match=op.value):
            ufunc_for(op, dt)
    for dt in (np.bool_, np.int8, np.int32, np.uint64):
        check_reduce(op, np.dtype(dt))


def test_avg_allowed_on_ml_floats_and_rejected_on_ints() -> None:
    for dt in ML_FLOAT_DTYPES:
        check_reduce(ReduceOp.AVG, dt)
    for t in (np.bool_, np.uint8, np.int64):
        with pytest.raises(ahcomm.InvalidDtype, match=f"'avg' needs a floating dtype, got {np.dtype(t)}"):
            check_reduce(ReduceOp.AVG, np.dtype(t))


@pytest.mark.parametrize("dt", ML_FLOAT_DTYPES, ids=ML_IDS)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MIN],
                         ids=lambda o: o.value)
def test_ml_float_ufuncs_compute_in_float32_and_round_once(dt: np.dtype, op: ReduceOp) -> None:
    """ufunc_for(op, dt)(a, b, out=c) == round_to_dt(float32(a) OP float32(b)), bit for bit.

    float8: every pair of values (NaN, inf, subnormals included). bfloat16: 400k random pairs
    of bit patterns plus pairs of close magnitude (where rounding matters most). The float64
    reference shows the single rounding is the correctly rounded result.
    """
    vals = _every_value(dt)
    if dt.itemsize == 1:
        a, b = (m.ravel() for m in np.meshgrid(vals, vals))
    else:
        rng = np.random.default_rng(7)
        a = vals[rng.integers(0, vals.size, 400_000)]
        with np.errstate(all="ignore"):
            near = (a[200_000:].astype(F32) * rng.uniform(-2, 2, 200_000).astype(F32)).astype(dt)
        b = np.concatenate([vals[rng.integers(0, vals.size, 200_000)], near])
    ufunc = ufunc_for(op, dt)
    c = np.empty_like(a)
    with np.errstate(all="ignore"):
        assert ufunc(a, b, out=c) is c
        ref32 = ufunc(a.astype(F32), b.astype(F32)).astype(dt)
        ref64 = ufunc(a.astype(np.float64), b.astype(np.float64)).astype(dt)
    assert c.dtype == dt
    assert _same_bits(c, ref32).all()
    assert _same_bits(c, ref64).all()
    # in place, as the streams use it (dst aliases an operand)
    a2 = a.copy()
    with np.errstate(all="ignore"):
        ufunc(a2, b, out=a2)
    assert _same_bits(a2, c).all()


def test_ml_float_rounding_is_to_nearest_not_truncation() -> None:
    bf16, e4, e5 = ML_FLOAT_DTYPES
    add = ufunc_for(ReduceOp.SUM, bf16)
    # 1 + 3*2**-9 = 1.005859375 lies between bf16 1 and 1.0078125 (spacing 2**-7): nearest is 1.0078125
    got = add(np.array([1.0], bf16), np.array([3 * 2.0**-9], bf16), out=np.empty(1, bf16))
    assert got.astype(F32)[0] == 1.0078125
    # 256 + 1 in bf16 is a tie (8 significand bits): to even, 256; 256 + 3 rounds to 260 (spacing 2)
    got = add(np.array([256.0, 256.0], bf16), np.array([1.0, 3.0], bf16), out=np.empty(2, bf16))
    assert got.astype(F32).tolist() == [256.0, 260.0]
    # float8: 16 + 1 in e4m3fn (spacing 2 above 16) ties to 16; 8 + 3 in e5m2 (spacing 2) ties to even 12
    assert add(np.array([16.0], e4), np.array([1.0], e4), out=np.empty(1, e4)).astype(F32)[0] == 16.0
    assert add(np.array([8.0], e5), np.array([3.0], e5), out=np.empty(1, e5)).astype(F32)[0] == 12.0


def test_ml_float_overflow_follows_the_type() -> None:
    """e4m3fn has no inf: past 464 a result becomes NaN (no saturation); bf16 and e5m2 go to inf."""
    bf16, e4, e5 = ML_FLOAT_DTYPES
    add = ufunc_for(ReduceOp.SUM, e4)
    got = add(np.array([224.0, 256.0, -256.0], e4), np.array([224.0, 256.0, -256.0], e4), out=np.empty(3, e4))
    assert got.astype(F32)[0] == 448.0 and np.isnan(got.astype(F32)[1:]).all()
    for dt in (bf16, e5):
        big = np.array([float(ml_dtypes.finfo(dt).max)] * 2, dt) * np.array([1, -1], dt)
        with np.errstate(over="ignore"):
            got = ufunc_for(ReduceOp.SUM, dt)(big, big, out=np.empty(2, dt))
        assert got.astype(F32).tolist() == [np.inf, -np.inf]


@pytest.mark.parametrize("dt", ML_FLOAT_DTYPES, ids=ML_IDS)
def test_finish_avg_on_ml_floats(dt: np.dtype) -> None:
    vals = _every_value(dt)
    for n in (1, 3, 5, 8):
        out = vals.copy()
        with np.errstate(all="ignore"):
            finish_avg(out, n)
            want = (vals.astype(np.float64) / n).astype(dt)
        assert out.dtype == dt and _same_bits(out, want).all()


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.uint64, np.bool_])
def test_bitwise_ufuncs(dtype: type) -> None:
    dt = np.dtype(dtype)
    rng = np.random.default_rng(3)
    if dt == np.bool_:
        a, b = np.array([0, 0, 1, 1], bool), np.array([0, 1, 0, 1], bool)
        want = {ReduceOp.BAND: [0, 0, 0, 1], ReduceOp.BOR: [0, 1, 1, 1], ReduceOp.BXOR: [0, 1, 1, 0]}
        for op, w in want.items():
            c = np.empty(4, bool)
            assert ufunc_for(op, dt)(a, b, out=c) is c
            assert c.tolist() == [bool(v) for v in w]
        return
    info = np.iinfo(dt)
    a = rng.integers(info.min, info.max, 1000, dtype=dt, endpoint=True)
    b = rng.integers(info.min, info.max, 1000, dtype=dt, endpoint=True)
    a[:2], b[:2] = info.min, info.max  # sign bit / top bit
    for op, py in ((ReduceOp.BAND, int.__and__), (ReduceOp.BOR, int.__or__), (ReduceOp.BXOR, int.__xor__)):
        c = np.empty_like(a)
        ufunc_for(op, dt)(a, b, out=c)
        assert c.dtype == dt
        assert c.tolist() == [py(int(x), int(y)) for x, y in zip(a, b)]


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
    with pytest.raises(ahcomm.ConfigError, match="AHCOMM_COPY_ENGINE must be auto, on or off, got 'yes'"):
        Config.from_env({"AHCOMM_COPY_ENGINE": "yes"})  # at init, before any link is made
    assert Config.from_env({"AHCOMM_COPY_ENGINE": " OFF "}) is not None


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


def test_a_misspelt_variable_is_named_with_the_one_meant(caplog: pytest.LogCaptureFixture) -> None:
    from ahcomm._config import warn_unknown

    with caplog.at_level("WARNING", logger="ahcomm.config"):
        Config.from_env({"AHCOMM_TRANSPROT": "rdma", "AHCOMM_TRANSPORT": "sdma", "AHCOMMX": "1"})
    assert "AHCOMM_TRANSPROT is not a variable ahcomm reads (did you mean AHCOMM_TRANSPORT?)" in caplog.text
    assert "AHCOMM_TRANSPORT is not" not in caplog.text and "AHCOMMX" not in caplog.text
    assert warn_unknown({"AHCOMM_TRANSPROT": "rdma"}) == []  # once per process


@pytest.mark.parametrize("name, value", [("AHCOMM_SINGLE_COPY", "disable"), ("AHCOMM_SPIN_US", "-5"),
                                         ("AHCOMM_YIELD_US", "nan"), ("AHCOMM_SPIN_US", "30us")])
def test_a_flag_or_a_time_that_means_nothing_is_refused_at_init(name: str, value: str) -> None:
    from ahcomm.transports.mailbox import _micros

    with pytest.raises(ConfigError, match=name) as raised:
        Config.from_env({name: value})
    assert "positive" not in str(raised.value)  # 0 is a value they take: "0 or more", not "positive"
    if name != "AHCOMM_SINGLE_COPY":  # and where the mailboxes read it, later
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(name, value)
            with pytest.raises(ConfigError, match=name):
                _micros(name, 30.0)

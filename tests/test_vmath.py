"""The CPU backend's expf, softmax rows, GELU and SiLU (csrc/backend/cpu/cpu_vmath.c, issue 23).

The attention softmax runs marcache's own expf (IEEE operations only: the same bits on
every instruction set and C library) with lane sums in a fixed order; the MLP's exact-erf
GELU is built on it the same way. These tests hold the expf to the float64 exp (within 2
ulp over the whole float range, exact at the special values), the GELU to the float64
GELU (within 6 ulp wherever the result is a normal float, the negative tail included),
the head's SiLU (x / (1 + e^-x) on the same expf) within 3 ulp, every instruction set to
the plain form bit for bit, and the softmax row to a NumPy emulation of its documented
order bit for bit and to the float64 softmax."""
import math
import shutil
import subprocess

import numpy as np
import pytest

from benchmark_modules import import_benchmark
from marcache import _C

F32 = np.float32
SUPPORTED = tuple(_C.build_info()["cpu_isa_supported"])
ISAS = tuple(isa for isa in ("plain", "avx2", "avx512") if isa in SUPPORTED)


def sweep():
    """Every 61st float32 bit pattern in [-104, 89] plus the edges (about 35 M / 61)."""
    lo = np.array(-104.5, F32).view(np.uint32)  # negative floats: larger patterns are more negative
    hi = np.array(89.5, F32).view(np.uint32)
    neg = np.arange(0x80000000, lo, 61, dtype=np.uint32).view(F32)
    pos = np.arange(0, hi, 61, dtype=np.uint32).view(F32)
    edges = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 88.7228, 88.72284, 88.7229, -87.33654, -87.3366,
                      -103.9, -103.97, -104.0, -200.0, 200.0, 1e-30, -1e-30], F32)
    return np.concatenate([neg, pos, edges])


def assert_isa_matches_plain(fn, x, want, isa):
    """fn(x[:n], isa) equals the plain form's bits for whole vectors and every tail."""
    for n in (len(x), 1, 7, 8, 15, 17, 33):
        got = fn(x[:n], isa)
        np.testing.assert_array_equal(got.view(np.uint32), want[:n].view(np.uint32), err_msg=f"{isa}, n={n}")


@pytest.fixture(scope="module")
def points():
    x = sweep()
    return x, _C._cpu_expf(x, "plain")


def test_expf_is_within_two_ulp_of_the_float64_exp(points):
    x, got = points
    want = np.exp(x.astype(np.float64))
    normal = np.isfinite(x) & (want >= np.finfo(F32).tiny) & (want <= np.finfo(F32).max)
    ulp = np.spacing(want[normal].astype(F32)).astype(np.float64)
    err = np.abs(got[normal].astype(np.float64) - want[normal]) / ulp
    assert err.max() <= 2.0, (err.max(), x[normal][np.argmax(err)])
    # below the normal range: within one subnormal step (2^-149) of the exact value
    sub = np.isfinite(x) & (want < np.finfo(F32).tiny)
    assert np.abs(got[sub].astype(np.float64) - want[sub]).max() <= 2.0 ** -149
    # past the largest float: inf, as the exact value rounds
    big = np.isfinite(x) & (want > np.finfo(F32).max * (1 + 2.0 ** -25))
    assert np.all(got[big] == np.inf)


def test_expf_special_values():
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, -1000.0, 1000.0], F32)
    for isa in ISAS:
        got = _C._cpu_expf(x, isa)
        assert np.isnan(got[0]), isa
        assert got[1:].tolist() == [np.inf, 0.0, 1.0, 1.0, 0.0, np.inf], isa


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "plain"])
def test_expf_isas_agree_bit_for_bit(points, isa):
    x, want = points
    assert_isa_matches_plain(_C._cpu_expf, x, want, isa)


def emulate_softmax(x):
    """The documented order in NumPy: e = the backend's expf(x - max), lane j % 16 sums
    its e in increasing j (float32 adds), the lanes summed l + 8, l + 4, l + 2, l + 1,
    then e * (1 / sum)."""
    out = np.empty_like(x)
    for i, row in enumerate(x):
        e = _C._cpu_expf((row - row.max()).astype(F32), "plain")
        lane = np.zeros(16, F32)
        for j, v in enumerate(e):
            lane[j % 16] = F32(lane[j % 16] + v)
        b = lane[:8] + lane[8:]
        c = b[:4] + b[4:]
        s = F32(F32(c[0] + c[2]) + F32(c[1] + c[3]))
        out[i] = e * (F32(1.0) / s)
    return out


@pytest.mark.parametrize("cols", [1, 5, 16, 17, 40, 320])
@pytest.mark.parametrize("isa", ISAS)
def test_softmax_rows_follow_the_documented_order(isa, cols):
    rng = np.random.default_rng(cols)
    x = (rng.standard_normal((3, cols)) * 4).astype(F32)
    x[1] -= 50.0  # large negative scores: the max subtracted first
    got = _C._cpu_softmax(x, isa)
    np.testing.assert_array_equal(got, emulate_softmax(x))
    xd = x.astype(np.float64)
    want = np.exp(xd - xd.max(axis=1, keepdims=True))
    want /= want.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-9)


@pytest.mark.parametrize("isa", [isa for isa in ISAS if isa != "plain"])
def test_softmax_row_max_is_the_plain_ones_wherever_it_lies(isa):
    """The vector forms take the row maximum lane-wise (max_ps skips a NaN in the row as the
    plain comparison does): the max in any lane, in the tail after the last whole vector,
    a NaN or -inf among the scores, rows of only -inf or NaN, and maxima of +0 against -0
    (which exp(x - max) cannot tell apart) give the plain form's bits."""
    rows = []
    for cols in (7, 16, 17, 40, 321):
        for where in sorted({0, 1, cols // 2, cols - 1}):
            r = np.linspace(-6.0, -1.0, cols).astype(F32)
            r[where] = 3.5
            rows.append(r)
            nan_row = r.copy()
            nan_row[(where + 1) % cols] = np.nan
            rows.append(nan_row)
            inf_row = r.copy()
            inf_row[(where + 2) % cols] = -np.inf
            rows.append(inf_row)
        rows.append(np.full(cols, -np.inf, F32))
        rows.append(np.full(cols, np.nan, F32))
        zeros = -np.abs(np.linspace(-3.0, 3.0, cols)).astype(F32) - F32(0.5)
        zeros[0], zeros[-1] = F32(-0.0), F32(0.0)
        rows.append(zeros)
        rows.append(zeros[::-1].copy())
    for r in rows:
        x = r[None, :]
        want = _C._cpu_softmax(x, "plain")
        got = _C._cpu_softmax(x, isa)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=f"{isa}: {r}")
        if np.isfinite(r).all():  # the NaN-free rows against the float64 softmax too
            xd = r.astype(np.float64)
            ref = np.exp(xd - xd.max())
            np.testing.assert_allclose(got[0], ref / ref.sum(), rtol=2e-6, atol=1e-9)


def gelu64(x):
    """GELU in float64 from the math module: x/2 (1 + erf(x / sqrt 2)), with erfc for
    x < 0 so the negative tail keeps its relative accuracy."""
    def one(v):
        z = abs(v) / math.sqrt(2.0)
        return 0.5 * v * (math.erfc(z) if v < 0 else 1.0 + math.erf(z))
    return np.vectorize(one, otypes=[np.float64])(x.astype(np.float64))


def gelu_sweep():
    """Every 1009th float32 bit pattern in (-16, 16) (2.2 M), every float within 2048
    patterns of the form boundaries (|x| = 0.85, 15), and the specials."""
    pos = np.arange(0, np.array(16.0, F32).view(np.uint32), 1009, dtype=np.uint32)
    neg = pos | np.uint32(0x80000000)
    near = []
    for edge in (0.85, 15.0):
        e = int(np.array(edge, F32).view(np.uint32))
        near.append(np.arange(e - 2048, e + 2048, dtype=np.uint32))
    near = np.concatenate(near)
    return np.concatenate([pos, neg, near, near | np.uint32(0x80000000)]).view(F32)


@pytest.fixture(scope="module")
def gelu_points():
    x = gelu_sweep()
    return x, _C._cpu_gelu(x, "plain")


def test_gelu_is_within_six_ulp_of_the_float64_gelu(gelu_points):
    x, got = gelu_points
    want = gelu64(x)
    normal = np.abs(want) >= np.finfo(F32).tiny
    ulp = np.spacing(np.abs(want[normal]).astype(F32)).astype(np.float64)
    err = np.abs(got[normal].astype(np.float64) - want[normal]) / ulp
    assert err.max() <= 6.0, (err.max(), x[normal][np.argmax(err)])
    assert err.mean() <= 0.2, err.mean()  # 0.09 measured: most points are exact or 1 ulp
    # the negative tail's subnormal results: within 6 subnormal steps
    assert np.abs(got[~normal].astype(np.float64) - want[~normal]).max() <= 6 * 2.0 ** -149


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "plain"])
def test_gelu_isas_agree_bit_for_bit(gelu_points, isa):
    x, want = gelu_points
    assert_isa_matches_plain(_C._cpu_gelu, x, want, isa)


def test_gelu_special_values():
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 100.0, -100.0, 1e-40, 6.0, -20.0], F32)
    for isa in ISAS:
        got = _C._cpu_gelu(x, isa)
        assert np.isnan(got[0]) and np.isnan(got[2]), isa  # -inf * 0: NaN, as in PyTorch's formula
        assert got[1] == np.inf and got[5] == 100.0 and got[8] == 6.0, isa
        assert got[3] == 0.0 and not np.signbit(got[3]) and np.signbit(got[4]), isa
        assert got[6] == 0.0 and np.signbit(got[6]), isa  # -100 Phi(-100) rounds to -0
        assert got[7] == np.float32(5e-41), isa  # x / 2 for a subnormal x
        assert got[9] == 0.0, isa


def silu_sweep():
    """Every 997th float32 bit pattern in (-100, 100) (2.3 M) and the specials."""
    pos = np.arange(0, np.array(100.0, F32).view(np.uint32), 997, dtype=np.uint32)
    return np.concatenate([pos, pos | np.uint32(0x80000000)]).view(F32)


def test_silu_is_within_three_ulp_of_the_float64_silu():
    x = silu_sweep()
    got = _C._cpu_silu(x, "plain")
    xd = x.astype(np.float64)
    with np.errstate(over="ignore"):
        want = xd / (1.0 + np.exp(-xd))
    # x / (1 + e^-x) in float32: e^-x overflows below x = -88.72, giving -0 where the
    # exact value is still a normal float down to about -91.5 (the formula's own limit, and
    # PyTorch's); above it the quotient holds the float64 value to 2.23 ulp (measured)
    ok = (np.abs(want) >= np.finfo(F32).tiny) & (x > -88.0)
    ulp = np.spacing(np.abs(want[ok]).astype(F32)).astype(np.float64)
    err = np.abs(got[ok].astype(np.float64) - want[ok]) / ulp
    assert err.max() <= 3.0, (err.max(), x[ok][np.argmax(err)])
    assert np.all(got[x < -88.8] == 0.0) and np.all(np.signbit(got[x < -88.8]))


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "plain"])
def test_silu_isas_agree_bit_for_bit(isa):
    x = silu_sweep()
    assert_isa_matches_plain(_C._cpu_silu, x, _C._cpu_silu(x, "plain"), isa)


def test_silu_special_values():
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40], F32)
    for isa in ISAS:
        got = _C._cpu_silu(x, isa)
        assert np.isnan(got[0]) and np.isnan(got[2]), isa  # -inf / inf, as in x * sigmoid(x)
        assert got[1] == np.inf and got[3] == 0.0 and np.signbit(got[4]), isa
        assert got[5] == np.float32(5e-41), isa


def test_hooks_reject_bad_arguments():
    with pytest.raises(ValueError, match="isa 'sse'"):
        _C._cpu_expf(np.zeros(3, F32), "sse")
    with pytest.raises(ValueError, match="_cpu_gelu: isa 'sse'"):
        _C._cpu_gelu(np.zeros(3, F32), "sse")
    with pytest.raises(ValueError):
        _C._cpu_softmax(np.zeros(3, F32), "plain")  # softmax rows: 2-D


@pytest.mark.skipif(shutil.which("gcc") is None, reason="benchmarks/bench_attention.py builds its harness with gcc")
def test_the_attention_benchmark_builds_and_times_the_op(tmp_path):
    # benchmarks/bench_attention.py's C harness (attention_time.c) compiles against the
    # checkout's sources and times the op through the backend's table.
    _common = import_benchmark("_common")
    exe = str(tmp_path / "attention_time")
    _common.build_harness("attention_time.c", exe)
    out = subprocess.run([exe, "1", "2", "64", "2", "3", "40", "17", "5"], capture_output=True, text=True,
                         check=True, cwd=tmp_path).stdout
    rows = [line.split() for line in out.strip().splitlines()]
    assert [r[:2] for r in rows] == [["3", "40"], ["17", "5"]]
    assert all(float(v) > 0 for r in rows for v in r[2:])
    bad = subprocess.run([exe, "1", "2", "64", "2", "0", "40"], capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2 and "must be positive" in bad.stderr

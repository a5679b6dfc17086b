"""The CPU backend's small-row linear (csrc/backend/cpu/cpu_smallrow.c and cpu_panels.c,
issue 23).

`linear` with few rows runs one of two kernels instead of OpenBLAS, outputs split across
the OpenMP team, with bias, activation and the residual applied as the sums are stored:
  - a bound fp32 weight (a model's, and run_op's W, which is bound the same way), up to
    768 rows with AVX-512 and 96 with AVX2 (PANEL_MAX): its column panels (cpu_panels.c),
    each output one fma chain over the inputs in order. The wtype "fp32" below;
  - 16-bit weights, and fp32 ones with MARCACHE_SMALLROW_PANELS=0, up to 96 rows: the lane
    kernel that streams W in nn.Linear layout (16 fma lanes and a fixed tree). The wtype
    "fp32-lanes" below is fp32 with the panels off.
MARCACHE_SMALLROW_MAX sets both thresholds. The instruction set (MARCACHE_CPU_ISA:
avx512, avx2 or the plain reference loop) is read when a backend is made; run_op makes
one per call, so each call here sees the environment it sets.

What is held:
  - every ISA the CPU runs, each weight type, against the float64 reference at the op
    test's tolerances (tests/test_ops.py: 1e-5 / 2e-5 from 512 terms; 16-bit weights
    against the rounded operands at 2e-5 and within the 16-bit bounds of the unrounded
    ones), over row counts around the vector and tile sizes and the threshold, widths
    that are not multiples of 16, bias or none, each activation, beta 0 / 1, strided x
    and y, 1 and 2 threads;
  - the documented summation orders exactly: a NumPy emulation of each (one fma chain per
    output for panels; 16 fma lanes and the fixed tree for the lane kernel; then bias and
    residual) equals every ISA's result bit for bit, so a fast kernel that drops, repeats
    or reorders a term fails even where the tolerance would not notice;
  - the ISAs agree with each other bit for bit, and a row's bits do not depend on how
    many rows the call has or on the thread count;
  - bad MARCACHE_CPU_ISA / MARCACHE_SMALLROW_MAX values are a ValueError naming the
    variable, and build_info() names the ISA.
"""
import shutil
import subprocess
from contextlib import contextmanager

import numpy as np
import pytest

from benchmark_modules import import_benchmark
from marcache import _C
from reference import ops as ref
from tolerance import assert_close, scaled_atol


F32 = np.float32
SUPPORTED = tuple(_C.build_info()["cpu_isa_supported"])
# Every ISA this CPU runs (plain always): no parametrisation here ever needs a skip.
ISAS = tuple(isa for isa in ("plain", "avx2", "avx512") if isa in SUPPORTED)
# "fp32-lanes": fp32 weights with MARCACHE_SMALLROW_PANELS=0 (the lane kernel).
WTYPES = ("fp32", "fp32-lanes", "bf16", "fp16")
BOUND_16BIT = {"bf16": 1e-2, "fp16": 2e-3}  # test_ops.py's bounds of 16-bit operands
# The AVX-512 kernel's narrow path runs calls of up to this many rows (SR_NARROW_ROWS in
# cpu_smallrow.c), its blocked path more (with MARCACHE_SMALLROW_MAX above it).
NARROW_MAX = 256
# The panels' default thresholds by the ISA in use (MC_PANEL_MAX_AVX512 / _AVX2 in
# cpu_internal.h); a forced plain ISA takes the machine's best ISA's.
PANEL_MAX = {"avx512": 768, "avx2": 96, "plain": 0}
DEFAULT_PANEL_MAX = PANEL_MAX[SUPPORTED[0]]


@contextmanager
def env(**values):
    """MARCACHE_* variables set (None: unset) while the block runs."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in values.items():
            if v is None:
                mp.delenv(k, raising=False)
            else:
                mp.setenv(k, str(v))
        yield


def stored_wtype(wtype):
    """The weight type of a WTYPES entry ("fp32-lanes" is fp32)."""
    return "fp32" if wtype == "fp32-lanes" else wtype


def run_linear(isa, x, w, bias=None, y=None, act="none", beta=0.0, wtype="fp32", threads=0,
               smallrow_max=None, backend="cpu"):
    with env(MARCACHE_CPU_ISA=isa, MARCACHE_SMALLROW_MAX=smallrow_max,
             MARCACHE_SMALLROW_PANELS=0 if wtype == "fp32-lanes" else None):
        return _C.run_op(backend, "linear", (x, w, bias, y),
                         {"act": act, "beta": float(beta), "wtype": stored_wtype(wtype), "threads": threads})


def column_slice(rng, rows, cols, before=3, after=5, scale=1.0):
    """[rows, cols] view into a [rows, before + cols + after] buffer (ld > cols)."""
    return (rng.standard_normal((rows, before + cols + after)) * scale).astype(F32)[:, before:before + cols]


def make_inputs(seed, rows, inp, out, bias=True, with_y=False, strided=False, w_scale=None):
    rng = np.random.default_rng(seed)
    x = column_slice(rng, rows, inp) if strided else rng.standard_normal((rows, inp)).astype(F32)
    scale = 1.0 / np.sqrt(max(inp, 1)) if w_scale is None else w_scale
    w = (rng.standard_normal((out, inp)) * scale).astype(F32)
    b = rng.standard_normal(out).astype(F32) if bias else None
    y = None
    if with_y:
        y = column_slice(rng, rows, out) if strided else rng.standard_normal((rows, out)).astype(F32)
    return x, w, b, y


def check_against_reference(got, x, w, b, y, act, beta, wtype):
    """test_ops.py's comparison: every element within tol * max |reference|."""
    tol = 2e-5 if x.shape[1] >= 512 else 1e-5
    if stored_wtype(wtype) == "fp32":
        want = ref.linear(x, w, b, act=act, beta=beta, y=y)
        assert_close(got, want, rtol=0.0, atol=scaled_atol(want, tol), what="linear vs float64")
        return
    rounded = ref.linear(ref.round_to_wtype(x, wtype), ref.round_to_wtype(w, wtype), b, act=act, beta=beta, y=y)
    assert_close(got, rounded, rtol=0.0, atol=scaled_atol(rounded, 2e-5), what="linear vs rounded operands")
    exact = ref.linear(x, w, b, act=act, beta=beta, y=y)
    assert_close(got, exact, rtol=0.0, atol=scaled_atol(exact, BOUND_16BIT[wtype]), what="linear vs float64")


# (rows, in, out, act, bias, beta, strided, threads): rows around the AVX-512 tile (3),
# the vector width (16), the kernel's row groups (32, 33) and the lane threshold (96; 97
# leaves the lane kernel); in and out not multiples of 16, down to 1 and 0; the head's adaLN
# and MLP shapes.
CASES = [
    (1, 1, 1, "none", True, 0.0, False, 1),
    (2, 5, 17, "silu", True, 0.0, False, 2),
    (3, 17, 5, "gelu", False, 0.0, True, 2),
    (7, 100, 100, "gelu_tanh", True, 0.0, False, 2),
    (8, 1024, 3072, "none", True, 0.0, False, 2),
    (8, 1024, 1024, "silu", True, 0.0, False, 1),
    (9, 33, 65, "none", True, 1.0, True, 2),
    (16, 64, 80, "gelu", True, 0.0, True, 1),
    (31, 100, 17, "none", False, 1.0, False, 2),
    (32, 17, 100, "silu", True, 0.0, True, 2),
    (33, 100, 5, "none", True, 1.0, True, 2),
    (96, 40, 24, "none", True, 1.0, False, 2),
    (97, 40, 24, "gelu", True, 0.0, True, 2),
    (4, 0, 5, "silu", True, 0.0, False, 2),  # no inputs: act(bias)
    (5, 7, 0, "none", True, 1.0, False, 2),  # no outputs
]


def case_id(c):
    rows, inp, out, act, bias, beta, strided, threads = c
    return "%dx%dx%d-%s%s%s%s-t%d" % (rows, inp, out, act, "" if bias else "-nobias", "-residual" if beta else "",
                                      "-strided" if strided else "", threads)


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("isa", ISAS)
def test_matches_the_float64_reference(isa, wtype, case):
    rows, inp, out, act, bias, beta, strided, threads = case
    x, w, b, y = make_inputs(rows * 7919 + inp * 31 + out, rows, inp, out, bias, beta != 0.0, strided)
    got = run_linear(isa, x, w, b, y, act=act, beta=beta, wtype=wtype, threads=threads)
    assert got.dtype == F32 and got.shape == (rows, out)
    check_against_reference(got, x, w, b, y, act, beta, wtype)


def finish(s, b, y, beta):
    """The epilogue: + bias, then y + that when beta is 1."""
    if b is not None:
        s = s + b
    if beta != 0.0:
        s = y + s
    return s.astype(F32)


def emulate_panel_order(x, w, b, y, beta):
    """The column panels' arithmetic in NumPy: each output accumulates x[i] * w[i] for
    i = 0, 1, ... into one float32 from 0, one rounding per step (an fma, emulated as in
    emulate_order), then the epilogue."""
    xd, wd = x.astype(np.float64), w.astype(np.float64)
    acc = np.zeros((x.shape[0], w.shape[0]), F32)
    for i in range(x.shape[1]):
        acc = (xd[:, i, None] * wd[None, :, i] + acc.astype(np.float64)).astype(F32)
    return finish(acc, b, y, beta)


def emulate_order(x, w, b, y, beta, wtype):
    """The order the wtype's kernel computes: fp32's panels (emulate_panel_order), or the
    lane kernel's arithmetic in NumPy: x rounded and W widened for a 16-bit type; lane
    l = i % 16 of each output accumulates x[i] * w[i] in increasing i with one rounding
    per step (an fma: the product of two floats is exact in float64 and one float64 add
    then rounded to float32 equals it unless the float64 sum lands on a float32 tie,
    which these seeded inputs do not reach); the lanes summed as l + 8, l + 4, l + 2,
    l + 1; then the epilogue."""
    if wtype == "fp32":
        return emulate_panel_order(x, w, b, y, beta)
    wtype = stored_wtype(wtype)
    xr = ref.round_to_wtype(x, wtype).astype(np.float64)
    wr = ref.round_to_wtype(w, wtype).astype(np.float64)
    rows, inp = xr.shape
    pad = (-inp) % 16
    xr = np.pad(xr, ((0, 0), (0, pad)))
    wr = np.pad(wr, ((0, 0), (0, pad)))
    acc = np.zeros((rows, w.shape[0], 16), F32)
    for i0 in range(0, inp + pad, 16):
        prod = xr[:, None, i0:i0 + 16] * wr[None, :, i0:i0 + 16]
        acc = (prod + acc.astype(np.float64)).astype(F32)
    b8 = acc[..., :8] + acc[..., 8:]
    c4 = b8[..., :4] + b8[..., 4:]
    s = (c4[..., 0] + c4[..., 2]) + (c4[..., 1] + c4[..., 3])
    return finish(s, b, y, beta)


ORDER_CASES = [(1, 17, 9, True, 0.0), (3, 100, 24, False, 1.0), (8, 256, 40, True, 1.0), (9, 300, 33, True, 0.0),
               (32, 48, 17, True, 0.0)]


@pytest.mark.parametrize("case", ORDER_CASES, ids=["%dx%dx%d" % c[:3] for c in ORDER_CASES])
@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("isa", ISAS)
def test_computes_the_documented_order_bit_for_bit(isa, wtype, case):
    rows, inp, out, bias, beta = case
    x, w, b, y = make_inputs(inp * 13 + out, rows, inp, out, bias, beta != 0.0, strided=True)
    got = run_linear(isa, x, w, b, y, beta=beta, wtype=wtype, threads=2)
    np.testing.assert_array_equal(got, emulate_order(x, w, b, y, beta, wtype))


# Every row count up to 17, then the plan's other block shapes (23 = 8 + 8 + 7 ... 57 = 8 + 7 x 7) up to
# the narrow path's last row count and past it (cpu_smallrow.c's SR_NARROW_ROWS).
NARROW_ROWS = list(range(1, 18)) + [23, 24, 25, 31, 33, 47, 57, NARROW_MAX, NARROW_MAX + 1]


@pytest.mark.parametrize("rows", NARROW_ROWS)
@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("isa", ISAS)
def test_narrow_path_row_counts_compute_the_documented_order(isa, wtype, rows):
    """Up to NARROW_MAX rows the AVX-512 kernel takes its narrow path: each tile of
    31 // (R1 + 1) outputs (at most 8) runs as register blocks of R1 <= 8 and R1 - 1 rows
    over the whole input, the first streaming the tile's weights, the others reading them
    from cache (12 rows: 6 + 6; 17: 6 + 6 + 5); NARROW_MAX + 1 rows is the blocked path.
    Every block shape, an input ending in a partial chunk and one of several whole chunks,
    outputs that no tile width divides, split over two threads."""
    for inp, out in ((37, 29), (160, 43)):
        x, w, b, y = make_inputs(rows * 101 + inp, rows, inp, out, True, True, strided=True)
        got = run_linear(isa, x, w, b, y, beta=1.0, wtype=wtype, threads=2, smallrow_max=4096)
        np.testing.assert_array_equal(got, emulate_order(x, w, b, y, 1.0, wtype), err_msg=f"{inp} x {out}")


@pytest.mark.parametrize("wtype", WTYPES)
def test_isas_agree_bit_for_bit_and_with_openblas_within_tolerance(wtype):
    x, w, b, _ = make_inputs(5, 8, 1024, 3072)
    results = {isa: run_linear(isa, x, w, b, act="silu", wtype=wtype, threads=2) for isa in ISAS}
    for isa in ISAS:
        np.testing.assert_array_equal(results[isa], results["plain"], err_msg=f"{isa} vs plain")
    # The path before this kernel (OpenBLAS, 16-bit weights widened first): another
    # summation order, the same arithmetic within the op test's tolerance.
    old = run_linear("plain", x, w, b, act="silu", wtype=wtype, threads=2, smallrow_max=0)
    assert_close(results["plain"], old, rtol=0.0, atol=scaled_atol(old, 2e-5), what="small-row vs OpenBLAS")
    assert not np.array_equal(results["plain"], old), "MARCACHE_SMALLROW_MAX=0 did not change the path"


@pytest.mark.skipif(SUPPORTED[0] == "plain", reason="without a vector kernel the path is off by default")
@pytest.mark.parametrize("wtype, threshold", [("fp32", DEFAULT_PANEL_MAX), ("fp32-lanes", 96), ("bf16", 96)])
def test_the_default_thresholds_are_the_isas_panel_rows_and_96_for_lanes(wtype, threshold):
    # At the threshold the kernel runs, bit for bit its order; one row more goes to
    # OpenBLAS: another order, within the op test's tolerance. 1000 inputs: with fewer than
    # OpenBLAS's K block (a few hundred) its SkylakeX kernel is one fma chain per output in
    # input order too, the panels' bits, and the switch would not show.
    with env(MARCACHE_SMALLROW_MAX=None):
        for rows in (threshold, threshold + 1):
            x, w, b, _ = make_inputs(rows, rows, 1000, 40)
            got = run_linear(SUPPORTED[0], x, w, b, wtype=wtype, threads=2)
            order = emulate_order(x, w, b, None, 0.0, wtype)
            if rows == threshold:
                np.testing.assert_array_equal(got, order)
            else:
                assert not np.array_equal(got, order), f"{rows} rows did not leave the small-row kernel"
                check_against_reference(got, x, w, b, None, "none", 0.0, wtype)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="benchmarks/bench_linear.py builds its harness with gcc")
def test_the_threshold_benchmark_builds_and_times_both_paths(tmp_path):
    # benchmarks/bench_linear.py's C harness (linear_threshold.c) compiles against the
    # checkout's sources and runs both paths through the backend factory.
    bench_linear = import_benchmark("bench_linear")
    exe = str(tmp_path / "linear_threshold")
    bench_linear.build(exe)
    out = subprocess.run([exe, "1", "256", "128", "3", "40"], capture_output=True, text=True, check=True,
                         cwd=tmp_path).stdout
    rows = [line.split() for line in out.strip().splitlines()]
    assert [r[0] for r in rows] == ["3", "40"]
    assert all(float(v) > 0 for r in rows for v in r[1:])
    bad = subprocess.run([exe, "1", "0", "128", "3"], capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2 and "must be positive" in bad.stderr
    # --weight-mib (bench_linear.py --weight-mib): a smaller set, gone over again.
    out = subprocess.run([exe, "--weight-mib", "1", "1", "256", "128", "3"], capture_output=True, text=True,
                         check=True, cwd=tmp_path).stdout
    assert out.split()[0] == "3" and all(float(v) > 0 for v in out.split()[1:])
    bad = subprocess.run([exe, "--weight-mib", "0", "1", "256", "128", "3"], capture_output=True, text=True,
                         cwd=tmp_path)
    assert bad.returncode == 2 and "usage" in bad.stderr
    # --split (bench_linear.py --split): both splits timed, and the one the default picks:
    # columns up to 600 rows when each of the 2 threads gets 256 columns, rows above.
    out = subprocess.run([exe, "--split", "2", "64", "512", "100", "601"], capture_output=True, text=True,
                         check=True, cwd=tmp_path).stdout
    rows = [line.split() for line in out.strip().splitlines()]
    assert [(r[0], r[3]) for r in rows] == [("100", "cols"), ("601", "rows")]
    assert all(float(v) > 0 for r in rows for v in r[1:3])


@pytest.mark.parametrize("wtype", ("fp32", "bf16"))
@pytest.mark.parametrize("isa", ISAS)
def test_a_rows_bits_do_not_depend_on_the_row_count_or_threads(isa, wtype):
    x, w, b, _ = make_inputs(11, 9, 200, 300)
    full = run_linear(isa, x, w, b, act="gelu", wtype=wtype, threads=2)
    np.testing.assert_array_equal(full, run_linear(isa, x, w, b, act="gelu", wtype=wtype, threads=1))
    for r in (0, 4, 8):
        alone = run_linear(isa, np.ascontiguousarray(x[r:r + 1]), w, b, act="gelu", wtype=wtype, threads=2)
        np.testing.assert_array_equal(alone[0], full[r], err_msg=f"row {r}")


@pytest.mark.parametrize("isa", ISAS)
def test_a_raised_threshold_runs_groups_of_32_rows(isa):
    # MARCACHE_SMALLROW_MAX=80 sends 33 and 70 rows to the kernel, which takes rows in
    # groups of 32: still the reference, the documented order, and each row's own bits.
    for rows in (33, 70):
        x, w, b, _ = make_inputs(rows, rows, 40, 24)
        got = run_linear(isa, x, w, b, wtype="fp16", threads=2, smallrow_max=80)
        check_against_reference(got, x, w, b, None, "none", 0.0, "fp16")
        np.testing.assert_array_equal(got, emulate_order(x, w, b, None, 0.0, "fp16"))


@pytest.mark.parametrize("isa", ISAS)
def test_fp16_subnormal_weights_and_bf16_extremes_widen_exactly(isa):
    # fp16 weights below 2^-14 are subnormal: F16C / AVX-512 widen them exactly, as
    # mc_f16_to_f32 does; bf16 keeps float32's exponent, so 1e30-sized weights stay finite.
    x, w, b, _ = make_inputs(3, 4, 40, 20, w_scale=3e-6)
    got = run_linear(isa, x, w, b, wtype="fp16", threads=1)
    np.testing.assert_array_equal(got, emulate_order(x, w, b, None, 0.0, "fp16"))
    x, w, b, _ = make_inputs(4, 4, 40, 20, w_scale=1e30)
    got = run_linear(isa, x, w, None, wtype="bf16", threads=1)
    assert np.all(np.isfinite(got))
    np.testing.assert_array_equal(got, emulate_order(x, w, None, None, 0.0, "bf16"))


@pytest.mark.parametrize("wtype", ("bf16", "fp16"))
def test_x_is_rounded_to_the_weight_type_as_mc_wtype_round_does(wtype):
    # One nonzero input per row times a weight of 1: y is x rounded to the weight type,
    # exactly, on the small-row path (x rounded as it is packed) and on the old one
    # (widen_linear_operands): ties to even, overflow to infinity, subnormals, NaN.
    f32max = float(np.finfo(F32).max)
    specials = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-11, 1 + 3 * 2**-11, f32max, -f32max,
                         65519.0, 65520.0, 1e-45, 3e-8, 2.0**-24 * 1.5, np.inf, -np.inf, np.nan, 0.1, -7.3e12],
                        dtype=F32)
    x = np.zeros((len(specials), 3), F32)
    x[:, 0] = specials
    w = np.array([[1.0, 0.0, 0.0]], F32)
    want = ref.round_to_wtype(specials, wtype)
    for isa in ISAS:
        for smallrow_max in (None, 0):
            with np.errstate(invalid="ignore"):
                got = run_linear(isa, x, w, wtype=wtype, threads=1, smallrow_max=smallrow_max)[:, 0]
            np.testing.assert_array_equal(got, want, err_msg=f"{isa}, MARCACHE_SMALLROW_MAX={smallrow_max}")


@pytest.mark.parametrize("wtype", ("fp32", "bf16"))
def test_the_guard_backend_runs_the_same_kernel(wtype):
    # fp32: the guard passes the bound weight to its inner CPU backend, which makes the
    # panels inside the op (the only time the guard's memory is readable).
    x, w, b, y = make_inputs(6, 8, 100, 70, with_y=True, strided=True)
    for isa in ISAS:
        got = run_linear(isa, x, w, b, y, beta=1.0, wtype=wtype, threads=2, backend="guard")
        np.testing.assert_array_equal(got, emulate_order(x, w, b, y, 1.0, wtype))


@pytest.mark.parametrize("name, value, fragment", [
    ("MARCACHE_CPU_ISA", "sse9", "MARCACHE_CPU_ISA='sse9': expected auto, avx512, avx2 or plain"),
    ("MARCACHE_SMALLROW_MAX", "lots", "MARCACHE_SMALLROW_MAX='lots': expected an integer in [0, 4096]"),
    ("MARCACHE_SMALLROW_MAX", "-1", "MARCACHE_SMALLROW_MAX='-1'"),
    ("MARCACHE_SMALLROW_MAX", "4097", "MARCACHE_SMALLROW_MAX='4097'"),
    ("MARCACHE_SMALLROW_MAX", "8 ", "MARCACHE_SMALLROW_MAX='8 '"),
    ("MARCACHE_HUGE_PAGES", "yes", "MARCACHE_HUGE_PAGES='yes': expected 0 or 1"),
    ("MARCACHE_SMALLROW_PANELS", "on", "MARCACHE_SMALLROW_PANELS='on': expected 0 or 1"),
    ("MARCACHE_CPU_GRAPHS", "yes", "MARCACHE_CPU_GRAPHS='yes': expected 0 or 1"),
    ("MARCACHE_GEMM_SPLIT", "columns", "MARCACHE_GEMM_SPLIT='columns': expected auto, rows or cols"),
])
def test_bad_environment_is_a_value_error_naming_the_variable(name, value, fragment):
    x, w, _, _ = make_inputs(0, 2, 3, 4)
    with env(**{name: value}):
        with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
            _C.run_op("cpu", "linear", (x, w), {})
        assert _C.build_info()["cpu_isa"].startswith("invalid: " + name)
        assert _C.build_info()["smallrow_max"] == -1 and _C.build_info()["huge_pages"] == -1
        assert _C.build_info()["panel_max"] == -1 and _C.build_info()["smallrow_panels"] == -1
        assert _C.build_info()["cpu_graphs"] == -1
        assert _C.build_info()["gemm_split"] == "invalid"


def test_an_isa_the_cpu_lacks_is_refused_and_build_info_names_the_choice():
    with env(MARCACHE_CPU_ISA=None, MARCACHE_SMALLROW_MAX=None):
        info = _C.build_info()
    # The best set is the default; without a vector kernel the path is off by default.
    assert info["cpu_isa"] == SUPPORTED[0] and SUPPORTED[-1] == "plain"
    assert info["smallrow_max"] == (0 if SUPPORTED[0] == "plain" else 96)
    assert info["panel_max"] == DEFAULT_PANEL_MAX and info["smallrow_panels"] == 1
    assert info["cpu_graphs"] == 1
    for isa in ISAS:
        # An emulated AVX2 machine (MARCACHE_CPU_ISA=avx2 on an AVX-512 one) takes AVX2's
        # threshold; the plain reference loop the best ISA's.
        with env(MARCACHE_CPU_ISA=isa):
            assert _C.build_info()["panel_max"] == PANEL_MAX[SUPPORTED[0] if isa == "plain" else isa], isa
    with env(MARCACHE_SMALLROW_PANELS="0"):
        assert _C.build_info()["smallrow_panels"] == 0 and _C.build_info()["panel_max"] == 0
    x, w, _, _ = make_inputs(0, 2, 3, 4)
    for isa in ("avx512", "avx2"):
        with env(MARCACHE_CPU_ISA=isa):
            if isa in SUPPORTED:
                assert _C.build_info()["cpu_isa"] == isa
                _C.run_op("cpu", "linear", (x, w), {})
            else:
                with pytest.raises(ValueError, match=f"MARCACHE_CPU_ISA={isa}: this CPU does not support it"):
                    _C.run_op("cpu", "linear", (x, w), {})
    with env(MARCACHE_CPU_ISA="auto", MARCACHE_SMALLROW_MAX="0"):
        assert _C.build_info()["cpu_isa"] == SUPPORTED[0] and _C.build_info()["smallrow_max"] == 0
        assert _C.build_info()["panel_max"] == 0


# Above the small-row threshold a linear is an OpenBLAS sgemm that mc_cpu_sgemm splits across
# the team by rows or by columns (cpu_backend.c; by default columns up to 600 rows). With
# OpenBLAS's SkylakeX kernels neither split changes a bit against the one-thread call; its
# Haswell kernels round some outputs differently with the number of rows a call has (measured
# with OPENBLAS_CORETYPE=Haswell: the row split too), so there every split is held to the
# float64 reference instead, as the batch-invariance tests hold whole images to a tolerance.
# Rows around the split's 16-row blocks and the 600-row switch; MAR-B's Linear shapes (in, out).
GEMM_SPLIT_CASES = [(rows, inp, out) for rows in (97, 100, 200, 330, 600, 601, 642)
                    for inp, out in ((768, 2304), (3072, 768))]
SPLITS_KEEP_BITS = _C.build_info()["blas_core"] == "SkylakeX"


@pytest.mark.parametrize("rows, inp, out", GEMM_SPLIT_CASES)
def test_the_gemm_split_keeps_the_result(rows, inp, out):
    x, w, b, _ = make_inputs(rows * 7 + out, rows, inp, out)
    with env(MARCACHE_GEMM_SPLIT=None):
        serial = run_linear(None, x, w, b, threads=1, smallrow_max=0)
    check_against_reference(serial, x, w, b, None, "none", 0.0, "fp32")
    for split in ("auto", "rows", "cols"):
        with env(MARCACHE_GEMM_SPLIT=split):
            assert _C.build_info()["gemm_split"] == split
            got = run_linear(None, x, w, b, threads=2, smallrow_max=0)
        if SPLITS_KEEP_BITS:
            np.testing.assert_array_equal(got, serial, err_msg=f"MARCACHE_GEMM_SPLIT={split}, {rows} rows")
        else:
            check_against_reference(got, x, w, b, None, "none", 0.0, "fp32")


# Row counts around the panel kernels' register blocks (AVX-512: 14 rows, AVX2: 6; a call
# is cut into blocks as even as possible: 15 = 8 + 7, 29 = 10 + 10 + 9), AVX-512's two panels
# at a time up to 6 rows (80 outputs: a pair, then a partial panel alone; 97: two pairs, the
# second's second panel one output), the head's 8-14 and the thresholds; outputs that no
# panel width divides (a partial last panel). With
# 1024 inputs a thread runs x in chunks of 4 AVX-512 blocks (MC_PANEL_X_CHUNK_BYTES, 256
# KiB: 56 rows) or 10 AVX2 ones (60 rows) over each panel, so from 57 rows a call crosses
# chunks; with 2 threads each packs a share of x's inputs for both.
PANEL_ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 14, 15, 28, 29, 43, 57, 96, 97, 255, 256, 300, 768]


@pytest.mark.parametrize("rows", PANEL_ROWS)
@pytest.mark.parametrize("isa", ISAS)
def test_panels_compute_one_fma_chain_per_output_for_every_block_shape(isa, rows):
    shapes = ((37, 29, 1), (48, 80, 1), (160, 97, 2), (64, 320, 2)) + (((1024, 70, 2),) if rows >= 43 else ())
    for inp, out, threads in shapes:
        x, w, b, y = make_inputs(rows * 31 + inp, rows, inp, out, True, True, strided=True)
        # Every ISA on its panels at every row count here, whatever its default threshold.
        got = run_linear(isa, x, w, b, y, beta=1.0, threads=threads, smallrow_max=4096)
        np.testing.assert_array_equal(got, emulate_panel_order(x, w, b, y, 1.0), err_msg=f"{inp} x {out}")


@pytest.mark.parametrize("isa", ISAS)
def test_panels_match_the_float64_reference_on_the_heads_shapes(isa):
    # MAR-B's head: 1024 inputs, 1024 and 3072 outputs (adaLN), at its batch-1 row counts.
    for rows, out, act in ((8, 3072, "none"), (12, 1024, "silu"), (14, 1024, "gelu")):
        x, w, b, _ = make_inputs(rows + out, rows, 1024, out)
        got = run_linear(isa, x, w, b, act=act, threads=2)
        check_against_reference(got, x, w, b, None, act, 0.0, "fp32")


def test_a_released_weights_panels_are_not_reused():
    # run_op binds W, runs the op and releases W; the next call's W of the same shape
    # (another matrix, often at the same address) must get panels of its own, not the
    # released weight's (cpu_release forgets the weight with its panels).
    results = []
    for seed in range(4):
        x, w, b, _ = make_inputs(seed, 8, 256, 96)
        got = run_linear(None, x, w, b, threads=2)
        np.testing.assert_array_equal(got, emulate_panel_order(x, w, b, None, 0.0), err_msg=f"seed {seed}")
        results.append(got)
    assert not np.array_equal(results[0], results[1])


@pytest.mark.skipif(SUPPORTED[0] == "plain", reason="without a vector kernel no linear runs on panels by default")
@pytest.mark.parametrize("backend_name", ["cpu", "guard"])
@pytest.mark.parametrize("rows", [8, 90])
def test_a_write_into_a_bound_weight_makes_its_panels_again(backend_name, rows):
    # run_op's w_rewrite: W bound and used (its panels made), then W_new copied into W's
    # buffer with the backend's copy (as a load into a bound weight would), and the call
    # run again. The CPU drops the panels of a weight written into (cpu_copy; the guard
    # forwards to its inner CPU backend) and makes them again from the new values; the
    # old panels would give x W^T instead of x W_new^T.
    x, w, b, _ = make_inputs(rows + 5, rows, 160, 97)
    w_new = make_inputs(rows + 6, rows, 160, 97)[1]
    with env(MARCACHE_CPU_ISA=None, MARCACHE_SMALLROW_MAX=None, MARCACHE_SMALLROW_PANELS=None):
        got = _C.run_op(backend_name, "linear", (x, w, b, None, w_new), {"threads": 2})
    np.testing.assert_array_equal(got, emulate_panel_order(x, w_new, b, None, 0.0))
    assert not np.array_equal(got, emulate_panel_order(x, w, b, None, 0.0))


def test_w_rewrite_is_refused_with_accumulation_or_16_bit_weights():
    x, w, b, y = make_inputs(0, 4, 16, 8, with_y=True)
    with pytest.raises(ValueError, match="argument 'w_rewrite' needs beta 0 and wtype fp32"):
        _C.run_op("cpu", "linear", (x, w, b, y, w), {"beta": 1.0})
    with pytest.raises(ValueError, match="argument 'w_rewrite' needs beta 0 and wtype fp32"):
        _C.run_op("cpu", "linear", (x, w, b, None, w), {"wtype": "bf16"})


def test_panels_and_lanes_agree_within_the_op_tolerance():
    # The two orders differ in the last bits (another summation), not beyond the tolerance.
    x, w, b, _ = make_inputs(9, 12, 1024, 1024)
    panels = run_linear(None, x, w, b, threads=2)
    lanes = run_linear(None, x, w, b, wtype="fp32-lanes", threads=2)
    assert not np.array_equal(panels, lanes), "MARCACHE_SMALLROW_PANELS=0 did not change the kernel"
    check_against_reference(panels, x, w, b, None, "none", 0.0, "fp32")
    check_against_reference(lanes, x, w, b, None, "none", 0.0, "fp32")

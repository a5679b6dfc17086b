"""CPU conv-side ops (groupnorm, conv2d, upsample_nearest2x) against the
float64 NumPy reference (tests/reference/ops.py), at odd sizes.

The ops are reached through run_op (csrc/python/py_ops.c), which takes NHWC
float32 arrays and PyTorch-layout conv weights (repacked in C); its common
param `threads` sets the CPU backend's thread count."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from marcache import _C as C  # noqa: E402
from reference import ops as ref  # noqa: E402
from tolerance import assert_close, scaled_atol  # noqa: E402


def conv2d(x, wt, bias=None, y=None, beta=0.0, naive=False, threads=0):
    """beta * y + conv(x) on the CPU backend. With y None and beta 0 the output
    buffer is filled with NaN first: beta = 0 must never read it."""
    if y is None and beta == 0.0:
        y = np.full(x.shape[:3] + (wt.shape[0],), np.nan, np.float32)
    return C.run_op("cpu", "conv2d", (x, wt, bias, y),
                    {"beta": beta, "naive": naive, "threads": threads})


def groupnorm(x, groups, wt=None, b=None, eps=1e-6, swish=False, threads=0):
    """GroupNorm of x [B, ..., C] (the op's [B, HW, C] view of it) on the CPU
    backend; weight and bias None: no affine."""
    flat = np.ascontiguousarray(x).reshape(x.shape[0], -1, x.shape[-1])
    got = C.run_op("cpu", "groupnorm", (flat, wt, b),
                   {"groups": groups, "eps": eps, "swish": swish, "threads": threads})
    return got.reshape(x.shape)


def check_scaled(got, want, what, tol=1e-5):
    """Every element within tol * max |want| (a convolution or normalisation output's
    float32 error follows the size of the window sums behind it: tolerance.scaled_atol)."""
    assert_close(got, want, rtol=0.0, atol=scaled_atol(want, tol), what=what)


# ----- conv2d ----------------------------------------------------------------

CONV_CASES = [
    # (batch, height, width, cin, cout, k)
    (1, 1, 1, 1, 1, 3),
    (1, 1, 1, 3, 33, 3),
    (2, 3, 5, 3, 33, 3),
    (1, 5, 3, 33, 3, 3),
    (2, 3, 5, 33, 1, 3),
    (1, 1, 7, 1, 3, 3),
    (1, 7, 6, 5, 4, 5),
    (2, 3, 5, 33, 3, 1),
    (1, 1, 1, 1, 1, 1),
    (3, 4, 4, 16, 33, 1),
]


@pytest.mark.parametrize("shape", CONV_CASES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_conv2d_matches_reference(shape, with_bias, beta):
    n, h, w, cin, cout, k = shape
    rng = np.random.default_rng(hash((shape, with_bias, beta)) % 2**32)
    x = rng.standard_normal((n, h, w, cin)).astype(np.float32)
    wt = rng.standard_normal((cout, cin, k, k)).astype(np.float32)
    bias = rng.standard_normal(cout).astype(np.float32) if with_bias else None
    y = rng.standard_normal((n, h, w, cout)).astype(np.float32) if beta else None
    want = ref.conv2d(x, wt, bias, beta=beta, y=y)
    for naive in (False, True):
        got = conv2d(x, wt, bias, y, beta, naive)
        assert got.shape == (n, h, w, cout) and got.dtype == np.float32
        assert np.isfinite(got).all()  # beta = 0 must not read the NaN-filled y
        check_scaled(got, want, "conv2d (naive=%s)" % naive)


@pytest.mark.parametrize("shape", [
    (2, 48, 48, 64, 32, 3),    # several 4 MiB im2col chunks, spanning images
    (1, 3, 2048, 64, 8, 3),    # one output row alone exceeds the chunk bound
    (5, 3, 3, 7, 5, 3),        # more threads' chunks than rows per image
], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_conv2d_chunking(shape, num_threads):
    n, h, w, cin, cout, k = shape
    rng = np.random.default_rng(7)
    x = rng.standard_normal((n, h, w, cin)).astype(np.float32)
    wt = (rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float32)
    bias = rng.standard_normal(cout).astype(np.float32)
    y = rng.standard_normal((n, h, w, cout)).astype(np.float32)
    got = conv2d(x, wt, bias, y, 1.0, threads=num_threads)
    check_scaled(got, ref.conv2d(x, wt, bias, beta=1.0, y=y), "chunked conv2d")


def test_conv2d_rejects_even_kernel():
    x = np.zeros((1, 3, 3, 2), np.float32)
    with pytest.raises(ValueError):
        conv2d(x, np.zeros((4, 2, 2, 2), np.float32))


# ----- groupnorm ---------------------------------------------------------------

GN_CASES = [
    # (batch, height, width, channels, groups)
    (1, 1, 1, 32, 32),     # one element per group: variance 0 -> output = bias
    (1, 1, 1, 3, 1),
    (2, 3, 5, 33, 3),
    (2, 3, 5, 33, 11),
    (1, 5, 3, 1, 1),
    (2, 50, 50, 64, 32),   # more than one 1024-pixel partial-sum block
]


@pytest.mark.parametrize("shape", GN_CASES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("swish", [False, True])
@pytest.mark.parametrize("affine", [True, False])
def test_groupnorm_matches_reference(shape, swish, affine):
    n, h, w, c, groups = shape
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((n, h, w, c)) * 2 + 0.5).astype(np.float32)
    wt = (1 + 0.1 * rng.standard_normal(c)).astype(np.float32) if affine else None
    b = (0.1 * rng.standard_normal(c)).astype(np.float32) if affine else None
    got = groupnorm(x, groups, wt, b, 1e-6, swish)
    want = ref.groupnorm(x, groups, np.ones(c) if wt is None else wt,
                         np.zeros(c) if b is None else b, 1e-6, swish=swish)
    assert got.shape == x.shape and got.dtype == np.float32
    check_scaled(got, want, "groupnorm")


def test_groupnorm_large_mean_is_stable():
    """Two-pass statistics: a mean 1e3 times the spread costs no accuracy."""
    rng = np.random.default_rng(4)
    x = (1000 + rng.standard_normal((1, 40, 40, 64))).astype(np.float32)
    got = groupnorm(x, 32, None, None, 1e-6, False)
    want = ref.groupnorm(x, 32, np.ones(64), np.zeros(64), 1e-6)
    # float32 inputs near 1000 carry ~6e-5 absolute error per element already;
    # the normalised output inherits it (x 1 / std = 1), nothing more.
    assert np.abs(got - want).max() < 2e-3


def test_groupnorm_thread_count_invariant():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 70, 33, 64)).astype(np.float32)
    one = groupnorm(x, 32, None, None, 1e-6, True, threads=1)
    two = groupnorm(x, 32, None, None, 1e-6, True, threads=2)
    assert np.array_equal(one, two)


def test_groupnorm_in_hw_layout():
    """The op's own [B, HW, C] layout, given directly (only B and C matter)."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 15, 33)).astype(np.float32)
    got = C.run_op("cpu", "groupnorm", (x,), {"groups": 3, "eps": 1e-6})
    check_scaled(got, ref.groupnorm(x, 3, np.ones(33), np.zeros(33)), "groupnorm [B, HW, C]")


# ----- upsample ------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 5, 33), (1, 5, 3, 3), (3, 40, 40, 32)],
                         ids=lambda s: "x".join(map(str, s)))
def test_upsample_nearest2x(shape):
    x = np.random.default_rng(8).standard_normal(shape).astype(np.float32)
    got = C.run_op("cpu", "upsample_nearest2x", (x,), {})
    assert got.shape == (shape[0], 2 * shape[1], 2 * shape[2], shape[3])
    assert np.array_equal(got, ref.upsample_nearest2x(x).astype(np.float32))

"""Every backend op on every backend against the float64 reference, in the
style of ggml's test-backend-ops: one table of cases, one test.

A case is (op, name, builder, reference, tolerance). The builder makes the
op's inputs and params (the calling conventions of csrc/python/py_ops.c)
from a generator seeded by the case id; the reference (tests/reference/ops.py,
float64) is applied to the same float32 inputs. The error measure is

    max |result - reference| / max |reference|

(absolute when the reference is all zeros), at most `tol`:
  1e-5   default for fp32 ops (a few roundings, or short reductions)
  2e-5   GEMMs and attention with reductions of 512 or more terms
  0      copies (gather, scatter, upsample) and token_normals: the float32
         result must equal the reference exactly (token_normals is the
         counter-based RNG contract of csrc/core/philox.h).

Strided forms: where an op takes a row stride, inputs are also given as
column slices of wider buffers (a q slice of a fused qkv, eps and v halves of
one model output, a KV cache with room to spare); the binding passes the
view's strides as ld / batch stride.

Every backend fills every entry of the table: an op a backend lacks fails here.
"""
import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

from marcache import _C
from reference import fastvar as ref_fastvar
from reference import ops as ref
from reference import vqvae as ref_vq
from reference import philox
from tolerance import assert_close, scaled_atol

F32 = np.float32

# Ops whose CPU table entries are still NULL; a NotImplementedError from any
# other op is a failure.


# --------------------------------------------------------------------------
# input helpers
# --------------------------------------------------------------------------

def randn(rng, *shape, scale=1.0, offset=0.0):
    return (rng.standard_normal(shape) * scale + offset).astype(F32)


def column_slice(rng, rows, cols, before=3, after=5, **kw):
    """[rows, cols] view into a [rows, before + cols + after] buffer (ld > cols)."""
    return randn(rng, rows, before + cols + after, **kw)[:, before:before + cols]


def f32(value):
    """A Python float that float32 represents exactly (the binding rounds
    float params to float32; the reference then sees the same value)."""
    return float(np.float32(value))


# --------------------------------------------------------------------------
# reference adapters: (inputs, params) of the binding -> float64 result
# --------------------------------------------------------------------------

def ref_gemm(inputs, p):
    a, b = inputs[0], inputs[1]
    c = inputs[2] if len(inputs) > 2 and inputs[2] is not None else None
    trans_a, trans_b = p.get("trans_a", False), p.get("trans_b", False)
    m = a.shape[1] if trans_a else a.shape[0]
    n = b.shape[0] if trans_b else b.shape[1]
    if c is None:
        c = np.zeros((m, n))
    return ref.gemm(a, b, trans_a=trans_a, trans_b=trans_b, alpha=p.get("alpha", 1.0),
                    beta=p.get("beta", 0.0), c=c)


def ref_linear(inputs, p):
    x, w, bias, y = (tuple(inputs) + (None,) * 4)[:4]
    return ref.linear(x, w, bias, act=p.get("act", "none"), beta=p.get("beta", 0.0), y=y)


def ref_linear_rounded_operands(inputs, p):
    """The 16-bit linear's contract: x and W rounded to the weight type, then exact."""
    x, w, bias, y = (tuple(inputs) + (None,) * 4)[:4]
    wtype = p.get("wtype", "fp32")
    return ref.linear(ref.round_to_wtype(x, wtype), ref.round_to_wtype(w, wtype), bias,
                      act=p.get("act", "none"), beta=p.get("beta", 0.0), y=y)


def per_row(mod, period, rows):
    """Row r of a per-group array (one row per `period` rows, as an adaLN row per
    sequence): mod[r // period], for the float64 references that take one row per row."""
    return None if mod is None else np.repeat(np.asarray(mod), period, axis=0)[:rows]


def ref_layernorm(inputs, p):
    x, w, b, shift, scale = (tuple(inputs) + (None,) * 5)[:5]
    period = p.get("mod_period", 1)
    return ref.layernorm(x, w, b, eps=p["eps"], shift=per_row(shift, period, len(x)),
                         scale=per_row(scale, period, len(x)))


def ref_activation(inputs, p):
    return ref.activation(inputs[0], p["act"])


def ref_add_rows(inputs, p):
    return ref.add_rows(inputs[0], inputs[1], p.get("period"))


def ref_gated_add(inputs, p):
    y, u, gate = inputs
    return ref.gated_add(y, u, per_row(gate, p.get("gate_period", 1), len(y)))


def ref_gather_rows(inputs, p):
    return ref.gather_rows(inputs[0], inputs[1])


def ref_scatter_rows(inputs, p):
    src, idx, dst = inputs
    return ref.scatter_rows(dst, idx, src)


def ref_attention(inputs, p):
    segments = list(zip(inputs[1::2], inputs[2::2]))
    return ref.attention(inputs[0], segments, p["heads"], p.get("scale"))


def ref_groupnorm(inputs, p):
    x, w, b = inputs
    return ref.groupnorm(x, p["groups"], w, b, eps=p["eps"], swish=p.get("swish", False))


def ref_conv2d(inputs, p):
    x, w, bias, y = (tuple(inputs) + (None,) * 4)[:4]
    beta = p.get("beta", 0.0)
    if y is None:
        y = np.zeros(x.shape[:3] + (w.shape[0],))
    return ref.conv2d(x, w, bias, beta=beta, y=y)


def ref_upsample_nearest2x(inputs, p):
    return ref.upsample_nearest2x(inputs[0])


def ref_cfg_combine(inputs, p):
    cond, uncond = inputs
    return ref.cfg_combine(cond, uncond, p["scale"], p.get("channels", cond.shape[1]))


def ref_ddpm_step(inputs, p):
    x, eps, v, noise = (tuple(inputs) + (None,) * 4)[:4]
    ch = x.shape[1]
    return ref.ddpm_step(x, eps[:, :ch], v[:, :ch], noise, p)


def ref_token_normals(inputs, p):
    image, position = inputs
    return ref.token_normals(p["seed"], p["stream"], p["step"], image, position, p["channels"])


def ref_axpby(inputs, p):
    x, y = inputs
    return ref.axpby(p["a"], x, p["b"], y)


def ref_cosine_rows(inputs, p):
    a, b = inputs
    return ref.cosine_rows(a, b, p["heads"])


def ref_head_l2norm(inputs, p):
    x, scale = (tuple(inputs) + (None,))[:2]
    return ref.head_l2norm(x, p["heads"], scale)


def ref_attention_mass(inputs, p):
    q, k = inputs
    return ref.attention_mass(q, k, p["heads"], p.get("scale"))


REFERENCES = {
    "attention_mass": ref_attention_mass,
    "head_l2norm": ref_head_l2norm,
    "axpby": ref_axpby,
    "cosine_rows": ref_cosine_rows,
    "gemm": ref_gemm,
    "linear": ref_linear,
    "layernorm": ref_layernorm,
    "activation": ref_activation,
    "add_rows": ref_add_rows,
    "gated_add": ref_gated_add,
    "gather_rows": ref_gather_rows,
    "scatter_rows": ref_scatter_rows,
    "attention": ref_attention,
    "groupnorm": ref_groupnorm,
    "conv2d": ref_conv2d,
    "upsample_nearest2x": ref_upsample_nearest2x,
    "cfg_combine": ref_cfg_combine,
    "ddpm_step": ref_ddpm_step,
    "token_normals": ref_token_normals,
}


# --------------------------------------------------------------------------
# the case table
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    op: str
    name: str
    build: Callable  # rng -> (inputs tuple, params dict)
    reference: Callable  # (inputs, params) -> float64 array
    tol: float
    # (got, want, what) -> None for results the float32 comparison does not fit (the
    # sampler's (tokens, masked logits) pair, relative tolerances); None: that comparison.
    check: Callable = None

    @property
    def id(self):
        return "%s-%s" % (self.op, self.name)


CASES = []


def case(op, name, tol=1e-5, reference=None, check=None):
    """Decorator: registers the builder below it as a case of `op` (checked against
    REFERENCES[op] unless another reference is given, by `check` when one is given)."""
    def register(build):
        CASES.append(Case(op, name, build, reference or REFERENCES[op], tol, check))
        return build
    return register


# gemm: every transpose pair at odd sizes, 1-row and 1-column products,
# alpha/beta with an existing C, strided operands, one long reduction.
def gemm_builder(m, n, k, trans_a, trans_b, alpha=1.0, beta=0.0, with_c=False, strided=False):
    def build(rng):
        a_shape = (k, m) if trans_a else (m, k)
        b_shape = (n, k) if trans_b else (k, n)
        if strided:
            a, b = column_slice(rng, *a_shape), column_slice(rng, *b_shape, before=0, after=7)
        else:
            a, b = randn(rng, *a_shape), randn(rng, *b_shape)
        inputs = (a, b)
        if with_c:
            inputs += (column_slice(rng, m, n) if strided else randn(rng, m, n),)
        params = {"trans_a": trans_a, "trans_b": trans_b, "alpha": f32(alpha), "beta": f32(beta)}
        return inputs, params
    return build


for m, n, k in [(1, 1, 1), (1, 17, 33), (3, 5, 7), (17, 33, 65), (65, 3, 17)]:
    for ta in (False, True):
        for tb in (False, True):
            name = "%dx%dx%d-%s%s" % (m, n, k, "t" if ta else "n", "t" if tb else "n")
            case("gemm", name)(gemm_builder(m, n, k, ta, tb))
case("gemm", "17x33x65-alpha-beta-c")(gemm_builder(17, 33, 65, False, True, alpha=0.5, beta=1.0,
                                                   with_c=True))
case("gemm", "33x17x65-beta0-c-ignored")(gemm_builder(33, 17, 65, True, False, alpha=-1.5,
                                                      with_c=True))
case("gemm", "17x33x65-strided-nt")(gemm_builder(17, 33, 65, False, True, beta=1.0, with_c=True,
                                                 strided=True))
case("gemm", "5x3x17-strided-tn")(gemm_builder(5, 3, 17, True, False, beta=-2.0, with_c=True,
                                               strided=True))
case("gemm", "64x80x1024-long-k", tol=2e-5)(gemm_builder(64, 80, 1024, False, True))


# linear: x [rows, in] W^T + bias, activations, residual accumulation.
def linear_builder(rows, inp, out, act="none", bias=True, beta=0.0, with_y=False,
                   strided=False, wtype=None):
    def build(rng):
        x = column_slice(rng, rows, inp) if strided else randn(rng, rows, inp)
        w = randn(rng, out, inp, scale=1.0 / np.sqrt(inp))
        b = randn(rng, out) if bias else None
        inputs = (x, w, b)
        if with_y:
            inputs += (column_slice(rng, rows, out) if strided else randn(rng, rows, out),)
        params = {"act": act, "beta": f32(beta)}
        if wtype is not None:
            params["wtype"] = wtype
        return inputs, params
    return build


for rows, inp, out in [(1, 1, 1), (1, 33, 17), (3, 17, 65), (17, 64, 80), (65, 33, 3)]:
    for act in ("none", "gelu", "silu", "gelu_tanh"):
        case("linear", "%dx%dx%d-%s" % (rows, inp, out, act))(linear_builder(rows, inp, out, act))
case("linear", "17x33x65-nobias-gelu")(linear_builder(17, 33, 65, "gelu", bias=False))
case("linear", "17x33x65-nobias")(linear_builder(17, 33, 65, bias=False))
case("linear", "17x33x65-residual")(linear_builder(17, 33, 65, beta=1.0, with_y=True))
case("linear", "17x33x65-residual-nobias")(linear_builder(17, 33, 65, bias=False, beta=1.0,
                                                           with_y=True))
case("linear", "17x33x65-beta0-y-ignored")(linear_builder(17, 33, 65, "silu", with_y=True))
case("linear", "17x33x65-strided-residual")(linear_builder(17, 33, 65, beta=1.0, with_y=True,
                                                            strided=True))
case("linear", "3x17x33-strided-gelu")(linear_builder(3, 17, 33, "gelu", with_y=True,
                                                      strided=True))
case("linear", "3x17x33-strided-gelu_tanh")(linear_builder(3, 17, 33, "gelu_tanh", with_y=True,
                                                           strided=True))
# 16-bit weights (the model's dtype="bf16"/"fp16"): against the float64 result of the
# unrounded inputs within the bounds of 16-bit operands (METHOD.md: bf16 between 1e-3 and
# 1e-2; fp16 has 3 more mantissa bits), and against the float64 result of the rounded
# operands at float32 accuracy, which pins the rounding (nearest even) and the float32 sums.
for wtype, tol in (("bf16", 1e-2), ("fp16", 2e-3)):
    for rows, inp, out, act, strided in [(1, 33, 17, "none", False), (17, 64, 80, "gelu", False),
                                         (65, 256, 96, "silu", True), (3, 17, 65, "none", True),
                                         (9, 64, 256, "gelu_tanh", False)]:
        name = "%dx%dx%d-%s-%s%s" % (rows, inp, out, act, wtype, "-strided" if strided else "")
        build = linear_builder(rows, inp, out, act, strided=strided, wtype=wtype)
        case("linear", name, tol=tol)(build)
        case("linear", name + "-rounded-ref", tol=2e-5, reference=ref_linear_rounded_operands)(build)
    case("linear", "17x33x65-residual-" + wtype, tol=tol)(
        linear_builder(17, 33, 65, beta=1.0, with_y=True, wtype=wtype))
case("linear", "33x1024x65-long-in", tol=2e-5)(linear_builder(33, 1024, 65, "gelu"))


# layernorm: plain, affine, adaLN modulation (shift/scale as column slices of
# one [rows, 6 * dim] modulation buffer, as the DiT blocks use), in place.
def layernorm_builder(rows, dim, affine="wb", modulate=False, inplace=False, strided=False,
                      offset=0.0, mod_period=None):
    def build(rng):
        x = (column_slice(rng, rows, dim, offset=offset) if strided
             else randn(rng, rows, dim, offset=offset))
        w = randn(rng, dim, offset=1.0) if "w" in affine else None
        b = randn(rng, dim) if "b" in affine else None
        inputs = (x, w, b)
        params = {"eps": f32(1e-6), "inplace": inplace}
        if modulate:
            groups = rows if mod_period is None else -(-rows // mod_period)
            mod = randn(rng, groups, 6 * dim, scale=0.5)
            inputs += (mod[:, 0:dim], mod[:, dim:2 * dim])
        if mod_period is not None:
            params["mod_period"] = mod_period
        return inputs, params
    return build


for rows, dim in [(1, 1), (1, 33), (3, 17), (17, 64), (65, 80), (2, 1024)]:
    case("layernorm", "%dx%d-plain" % (rows, dim))(layernorm_builder(rows, dim, affine=""))
    case("layernorm", "%dx%d-affine" % (rows, dim))(layernorm_builder(rows, dim))
case("layernorm", "17x65-w-only")(layernorm_builder(17, 65, affine="w"))
case("layernorm", "17x65-adaln")(layernorm_builder(17, 65, affine="", modulate=True))
case("layernorm", "1x64-adaln")(layernorm_builder(1, 64, affine="", modulate=True))
case("layernorm", "17x65-affine-adaln")(layernorm_builder(17, 65, modulate=True))
case("layernorm", "17x65-inplace")(layernorm_builder(17, 65, inplace=True))
case("layernorm", "17x65-strided-inplace-adaln")(layernorm_builder(17, 65, modulate=True,
                                                                    inplace=True, strided=True))
case("layernorm", "17x33-strided")(layernorm_builder(17, 33, strided=True))
case("layernorm", "17x65-offset100")(layernorm_builder(17, 65, offset=100.0))
# One adaLN row per sequence (VAR): rows // mod_period picks it; a last sequence cut short,
# one sequence of all rows, and a period of 1 (the per-row form) given explicitly.
case("layernorm", "17x65-adaln-period5")(layernorm_builder(17, 65, affine="", modulate=True, mod_period=5))
case("layernorm", "64x1024-adaln-period16-strided")(layernorm_builder(64, 1024, affine="", modulate=True,
                                                                      strided=True, mod_period=16))
case("layernorm", "9x33-adaln-period9")(layernorm_builder(9, 33, affine="", modulate=True, mod_period=9))
case("layernorm", "9x33-adaln-period1")(layernorm_builder(9, 33, modulate=True, mod_period=1))


# activation: in place on [rows, dim], values wide enough to reach the tails.
def activation_builder(rows, dim, act, strided=False):
    def build(rng):
        x = column_slice(rng, rows, dim, scale=6.0) if strided else randn(rng, rows, dim, scale=6.0)
        # One positive entry keeps max |ref| of order one (a lone x = -7 has
        # gelu(x) ~ 1e-12, where any fp32 result is relatively "wrong").
        x[0, 0] = abs(x[0, 0]) + 0.5
        return (x,), {"act": act}
    return build


for act in ("none", "gelu", "silu", "gelu_tanh"):
    for rows, dim in [(1, 1), (3, 17), (17, 65), (65, 1024)]:
        case("activation", "%dx%d-%s" % (rows, dim, act))(activation_builder(rows, dim, act))
    case("activation", "17x33-%s-strided" % act)(activation_builder(17, 33, act, strided=True))


def activation_tails(rng):
    x = np.array([[-100.0, -30.0, -10.0, -1e-3, 0.0, 1e-3, 10.0, 30.0, 100.0]], dtype=F32)
    return (x,), {"act": "silu"}


case("activation", "silu-tails")(activation_tails)
case("activation", "gelu-tails")(lambda rng: (activation_tails(rng)[0], {"act": "gelu"}))
# The tanh form's tails: x^3 overflows float32 beyond |x| ~ 7e12 (tanh(+-inf) = +-1
# then gives x and 0, the limits), and the polynomial's cancellation near 0.
case("activation", "gelu_tanh-tails")(lambda rng: ((np.array(
    [[-1e20, -1e13, -100.0, -30.0, -10.0, -3.0, -1e-3, 0.0, 1e-3, 3.0, 10.0, 30.0, 100.0]],
    dtype=F32),), {"act": "gelu_tanh"}))


# add_rows: y[r] += v[r % period].
def add_rows_builder(rows, dim, vrows, period=None, strided=False):
    def build(rng):
        y = column_slice(rng, rows, dim) if strided else randn(rng, rows, dim)
        v = column_slice(rng, vrows, dim, before=1, after=0) if strided else randn(rng, vrows, dim)
        return (y, v), ({} if period is None else {"period": period})
    return build


case("add_rows", "1x1-period1")(add_rows_builder(1, 1, 1))
case("add_rows", "17x33-period17")(add_rows_builder(17, 33, 17))
case("add_rows", "17x33-period4")(add_rows_builder(17, 33, 4))
case("add_rows", "65x64-period1")(add_rows_builder(65, 64, 1))
case("add_rows", "3x65-period5-of-8")(add_rows_builder(3, 65, 8, period=5))
case("add_rows", "17x80-period3-strided")(add_rows_builder(17, 80, 3, strided=True))


# gated_add: y += gate * u; gate and u as slices of an adaLN modulation buffer.
def gated_add_builder(rows, dim, strided=False, gate_period=None):
    def build(rng):
        params = {} if gate_period is None else {"gate_period": gate_period}
        groups = rows if gate_period is None else -(-rows // gate_period)
        if strided:
            y = column_slice(rng, rows, dim)
            mod = randn(rng, rows, 6 * dim)
            return (y, mod[:, 5 * dim:], mod[:groups, 2 * dim:3 * dim]), params
        return (randn(rng, rows, dim), randn(rng, rows, dim), randn(rng, groups, dim)), params
    return build


for rows, dim in [(1, 1), (3, 17), (17, 65), (65, 1024)]:
    case("gated_add", "%dx%d" % (rows, dim))(gated_add_builder(rows, dim))
case("gated_add", "17x33-strided")(gated_add_builder(17, 33, strided=True))
# one gate row per sequence (VAR's gamma): the last sequence cut short, and strided operands
case("gated_add", "17x65-period5")(gated_add_builder(17, 65, gate_period=5))
case("gated_add", "64x1024-period16-strided")(gated_add_builder(64, 1024, strided=True, gate_period=16))


# gather_rows / scatter_rows: copies, exact.
def gather_builder(n, rows, dim, strided=False):
    def build(rng):
        src = column_slice(rng, n, dim) if strided else randn(rng, n, dim)
        idx = rng.integers(0, n, size=rows).astype(np.int32)  # repeats allowed
        return (src, idx), {}
    return build


case("gather_rows", "1of1x1", tol=0)(gather_builder(1, 1, 1))
case("gather_rows", "5of17x33", tol=0)(gather_builder(17, 5, 33))
case("gather_rows", "65of17x64-repeats", tol=0)(gather_builder(17, 65, 64))
case("gather_rows", "0of3x8", tol=0)(gather_builder(3, 0, 8))
case("gather_rows", "17of65x80-strided", tol=0)(gather_builder(65, 17, 80, strided=True))


def scatter_builder(n, rows, dim, strided=False):
    def build(rng):
        src = column_slice(rng, rows, dim) if strided else randn(rng, rows, dim)
        dst = column_slice(rng, n, dim, before=0, after=2) if strided else randn(rng, n, dim)
        idx = rng.permutation(n)[:rows].astype(np.int32)
        return (src, idx, dst), {}
    return build


case("scatter_rows", "1into1x1", tol=0)(scatter_builder(1, 1, 1))
case("scatter_rows", "5into17x33", tol=0)(scatter_builder(17, 5, 33))
case("scatter_rows", "65into65x64-all", tol=0)(scatter_builder(65, 65, 64))
case("scatter_rows", "0into3x8", tol=0)(scatter_builder(3, 0, 8))
case("scatter_rows", "17into65x80-strided", tol=0)(scatter_builder(65, 17, 80, strided=True))


# attention: head dims 64 and 80, odd counts, several segments including an
# empty and a single-row one, fused-qkv and KV-cache layouts.
def attention_builder(batch, nq, heads, hd, seg_rows, layout="contiguous", scale=None,
                      magnitude=1.0, wtype=None):
    width = heads * hd

    def build(rng):
        if layout == "fused":  # q, k, v slices of one [B, n, 3 * width] qkv (one segment)
            qkv = randn(rng, batch, nq, 3 * width, scale=magnitude)
            inputs = (qkv[:, :, :width], qkv[:, :, width:2 * width], qkv[:, :, 2 * width:])
        else:
            inputs = (randn(rng, batch, nq, width, scale=magnitude),)
            for i, rows in enumerate(seg_rows):
                if layout == "cache":  # rows of a [B, rows + spare, 2 * width] cache, k|v per row
                    cache = randn(rng, batch, rows + 7, 2 * width, scale=magnitude)
                    inputs += (cache[:, :rows, :width], cache[:, :rows, width:])
                elif layout == "mixed" and i % 2 == 0:  # k and v with different strides
                    inputs += (randn(rng, batch, rows, width + 16, scale=magnitude)[:, :, 16:],
                               randn(rng, batch, rows, width, scale=magnitude))
                else:
                    inputs += (randn(rng, batch, rows, width, scale=magnitude),
                               randn(rng, batch, rows, width, scale=magnitude))
        params = {"heads": heads}
        if scale is not None:
            params["scale"] = f32(scale)
        if wtype is not None:
            params["wtype"] = wtype
        return inputs, params
    return build


case("attention", "b1-q1-h1-hd64-k1")(attention_builder(1, 1, 1, 64, [1]))
case("attention", "b1-q1-h1-hd80-k1")(attention_builder(1, 1, 1, 80, [1]))
case("attention", "b2-q17-h2-hd64-k33")(attention_builder(2, 17, 2, 64, [33]))
case("attention", "b1-q3-h3-hd80-k65")(attention_builder(1, 3, 3, 80, [65]))
case("attention", "b3-q65-h1-hd64-k17")(attention_builder(3, 65, 1, 64, [17]))
case("attention", "b2-q5-h2-hd80-k1")(attention_builder(2, 5, 2, 80, [1]))
case("attention", "b2-q17-h2-hd64-segs33-0-1-17")(attention_builder(2, 17, 2, 64, [33, 0, 1, 17]))
case("attention", "b1-q1-h3-hd80-segs0-65")(attention_builder(1, 1, 3, 80, [0, 65]))
case("attention", "b2-q3-h2-hd80-segs1-1-1")(attention_builder(2, 3, 2, 80, [1, 1, 1]))
case("attention", "b2-q17-h2-hd64-fused-qkv")(attention_builder(2, 17, 2, 64, None,
                                                                 layout="fused"))
case("attention", "b1-q33-h3-hd80-fused-qkv")(attention_builder(1, 33, 3, 80, None,
                                                                 layout="fused"))
case("attention", "b2-q5-h2-hd64-cache-segs17-0-3")(attention_builder(2, 5, 2, 64, [17, 0, 3],
                                                                      layout="cache"))
case("attention", "b2-q5-h2-hd80-mixed-strides")(attention_builder(2, 5, 2, 80, [17, 1, 9],
                                                                   layout="mixed"))
case("attention", "b1-q17-h2-hd64-scale0.3")(attention_builder(1, 17, 2, 64, [33], scale=0.3))
case("attention", "b1-q17-h2-hd64-peaky")(attention_builder(1, 17, 2, 64, [33, 17],
                                                            magnitude=4.0))
case("attention", "b2-q64-h4-hd64-k1024-long", tol=2e-5)(attention_builder(2, 64, 4, 64,
                                                                           [960, 64]))
# 16-bit attention (a model with dtype bf16/fp16; head dims that are multiples of 16 run the
# CUDA tensor-core kernel): q, k, v and the probabilities rounded, float32 softmax and sums.
# Against the float64 result of the unrounded inputs, within the bounds of 16-bit operands
# (the CPU emulation measures 2e-3..5e-3 for bf16, 4e-4..8e-4 for fp16 on these cases).
# The shapes cross the kernel's 64-row query and key tiles, mix segments (one empty), strides
# and the fused-qkv layout. hd 16 and 32 are the test and digits models' head dims.
for wtype, tol in (("bf16", 2e-2), ("fp16", 4e-3)):
    for name, args, kwargs in [
            ("b2-q17-h2-hd64-k33", (2, 17, 2, 64, [33]), {}),
            ("b1-q65-h3-hd80-segs70-0-5", (1, 65, 3, 80, [70, 0, 5]), {}),
            ("b2-q130-h2-hd16-fused-qkv", (2, 130, 2, 16, None), {"layout": "fused"}),
            ("b1-q9-h3-hd32-cache-segs64-1", (1, 9, 3, 32, [64, 1]), {"layout": "cache"}),
            ("b2-q64-h4-hd64-k1024-long", (2, 64, 4, 64, [960, 64]), {}),
            ("b1-q17-h2-hd128-mixed-strides", (1, 17, 2, 128, [17, 1, 9]), {"layout": "mixed"}),
            ("b1-q5-h2-hd48-peaky", (1, 5, 2, 48, [33, 17]), {"magnitude": 4.0})]:
        # Logits 16x larger: the 16-bit rounding of q and k moves them 16x more (measured on
        # the CPU emulation: 2.3e-2 bf16, 3.6e-3 fp16); a wrong rescale would be O(1).
        bound = tol * 2.5 if "peaky" in name else tol
        case("attention", name + "-" + wtype, tol=bound)(attention_builder(*args, wtype=wtype, **kwargs))
# A head dim that is not a multiple of 16 stays float32 under a 16-bit type.
case("attention", "b1-q3-h3-hd80-k65-hd20-bf16-stays-fp32")(attention_builder(1, 3, 3, 20, [65],
                                                                               wtype="bf16"))


# groupnorm (pending on CPU): NHWC [B, HW, C], statistics per image and group.
def groupnorm_builder(batch, hw, channels, groups, swish=False, inplace=False, offset=0.0):
    def build(rng):
        x = randn(rng, batch, hw, channels, offset=offset)
        return ((x, randn(rng, channels, offset=1.0), randn(rng, channels)),
                {"groups": groups, "eps": f32(1e-6), "swish": swish, "inplace": inplace})
    return build


case("groupnorm", "b1-hw1-c64-g32")(groupnorm_builder(1, 1, 64, 32))
case("groupnorm", "b2-hw17-c32-g8")(groupnorm_builder(2, 17, 32, 8))
case("groupnorm", "b2-hw17-c32-g8-swish")(groupnorm_builder(2, 17, 32, 8, swish=True))
case("groupnorm", "b1-hw65-c96-g32-swish-inplace")(groupnorm_builder(1, 65, 96, 32, swish=True,
                                                                     inplace=True))
case("groupnorm", "b2-hw9-c3-g1")(groupnorm_builder(2, 9, 3, 1))
case("groupnorm", "b1-hw256-c128-g32-offset")(groupnorm_builder(1, 256, 128, 32, offset=10.0))


# conv2d (pending on CPU): NHWC, PyTorch weight layout, k in {1, 3}.
def conv2d_builder(batch, height, width, cin, cout, k, bias=True, beta=0.0, with_y=False,
                   naive=False, wtype=None):
    def build(rng):
        x = randn(rng, batch, height, width, cin)
        w = randn(rng, cout, cin, k, k, scale=1.0 / np.sqrt(cin * k * k))
        inputs = (x, w, randn(rng, cout) if bias else None)
        if with_y:
            inputs += (randn(rng, batch, height, width, cout),)
        params = {"beta": f32(beta)}
        if naive:
            params["naive"] = True
        if wtype is not None:
            params["wtype"] = wtype
        return inputs, params
    return build


case("conv2d", "b1-1x1-c3to5-k3")(conv2d_builder(1, 1, 1, 3, 5, 3))
case("conv2d", "b2-5x7-c3to17-k3")(conv2d_builder(2, 5, 7, 3, 17, 3))
case("conv2d", "b1-9x8-c33to16-k3-nobias")(conv2d_builder(1, 9, 8, 33, 16, 3, bias=False))
case("conv2d", "b2-4x3-c17to33-k1")(conv2d_builder(2, 4, 3, 17, 33, 1))
case("conv2d", "b1-6x5-c16to8-k3-residual")(conv2d_builder(1, 6, 5, 16, 8, 3, beta=1.0,
                                                           with_y=True))
case("conv2d", "b1-3x3-c4to4-k5")(conv2d_builder(1, 3, 3, 4, 4, 5))
case("conv2d", "b1-8x8-c64to65-k3")(conv2d_builder(1, 8, 8, 64, 65, 3))
case("conv2d", "b2-5x6-c5to7-k3-residual-naive")(conv2d_builder(2, 5, 6, 5, 7, 3, beta=1.0,
                                                                 with_y=True, naive=True))


def rounded_operands(reference):
    """A 16-bit convolution's contract (ops.h, autocast's) over `reference`: x and w rounded
    to the case's wtype, then exact."""
    def ref_rounded(inputs, p):
        x, w = (ref.round_to_wtype(a, p["wtype"]) for a in inputs[:2])
        return reference((x, w) + tuple(inputs[2:]), p)
    return ref_rounded


def sixteen_bit_cases(op, builder, reference, shapes):
    """For bf16 and fp16, each (name, args, kwargs) of `shapes` as two cases: within the
    bounds of 16-bit operands against the unrounded float64 result, as linear's, and at
    float32 accuracy against the rounded operands (which pins that x and w, and only they,
    are rounded). A naive=True shape keeps its id ending in -naive (NAIVE_CASES)."""
    for wtype, tol in (("bf16", 1e-2), ("fp16", 2e-3)):
        for name, args, kwargs in shapes:
            build = builder(*args, wtype=wtype, **kwargs)
            naive = "-naive" if kwargs.get("naive") else ""
            case(op, name + "-" + wtype + naive, tol=tol)(build)
            case(op, name + "-" + wtype + "-rounded-ref" + naive, tol=2e-5,
                 reference=rounded_operands(reference))(build)


# 16-bit convolutions (a VAE or VQVAE loaded with dtype bf16/fp16).
sixteen_bit_cases("conv2d", conv2d_builder, ref_conv2d,
                  [("b2-5x7-c3to17-k3", (2, 5, 7, 3, 17, 3), {}),
                   ("b1-8x8-c64to65-k3", (1, 8, 8, 64, 65, 3), {}),
                   ("b2-4x3-c17to33-k1", (2, 4, 3, 17, 33, 1), {}),
                   ("b1-6x5-c16to8-k3-residual", (1, 6, 5, 16, 8, 3), dict(beta=1.0, with_y=True)),
                   ("b2-5x6-c5to7-k3", (2, 5, 6, 5, 7, 3), dict(naive=True))])


# upsample_nearest2x (pending on CPU): a copy, exact.
for shape in [(1, 1, 1, 1), (2, 3, 5, 17), (1, 8, 8, 64)]:
    case("upsample_nearest2x", "x".join(map(str, shape)), tol=0)(
        (lambda s: lambda rng: ((randn(rng, *s),), {}))(shape))


# cfg_combine: the first `channels` columns of wider cond/uncond rows.
def cfg_builder(rows, channels, width, scale, strided=False):
    def build(rng):
        if strided:  # cond and uncond halves of one [rows, 2 * width] output
            both = randn(rng, rows, 2 * width)
            cond, uncond = both[:, :width], both[:, width:]
        else:
            cond, uncond = randn(rng, rows, width), randn(rng, rows, width)
        return (cond, uncond), {"scale": f32(scale), "channels": channels}
    return build


case("cfg_combine", "1x16of16-scale4")(cfg_builder(1, 16, 16, 4.0))
case("cfg_combine", "17x16of32-scale2.9")(cfg_builder(17, 16, 32, 2.9))
case("cfg_combine", "65x3of17-scale1")(cfg_builder(65, 3, 17, 1.0))
case("cfg_combine", "17x16of32-scale0")(cfg_builder(17, 16, 32, 0.0))
case("cfg_combine", "33x16of32-strided")(cfg_builder(33, 16, 32, 3.5, strided=True))


# ddpm_step: eps and v are the halves of one [rows, 2 * ch] model output.
DDPM_COEFS = {
    "sqrt_recip_alphas_cumprod": 1.0513,
    "sqrt_recipm1_alphas_cumprod": 0.3225,
    "posterior_mean_coef1": 0.2871,
    "posterior_mean_coef2": 0.7104,
    "log_beta": -3.912,
    "posterior_log_variance": -4.405,
}


def ddpm_builder(rows, channels, noise_scale, split_output=True):
    def build(rng):
        x = randn(rng, rows, channels)
        out = randn(rng, rows, 2 * channels)
        out[:, channels:] = np.tanh(out[:, channels:])  # v in [-1, 1] as the model gives
        if split_output:
            eps, v = out[:, :channels], out[:, channels:]
        else:  # eps is the whole output row: only its first `channels` columns are read
            eps, v = out, out[:, channels:]
        noise = randn(rng, rows, channels) if noise_scale != 0.0 else None
        params = {key: f32(value) for key, value in DDPM_COEFS.items()}
        params["noise_scale"] = f32(noise_scale)
        return (x, eps, v, noise), params
    return build


case("ddpm_step", "1x16-temp1")(ddpm_builder(1, 16, 1.0))
case("ddpm_step", "17x16-temp0.95")(ddpm_builder(17, 16, 0.95))
case("ddpm_step", "65x3-temp1.1")(ddpm_builder(65, 3, 1.1))
case("ddpm_step", "17x16-last-step")(ddpm_builder(17, 16, 0.0))
case("ddpm_step", "33x16-eps-wide-row")(ddpm_builder(33, 16, 0.9, split_output=False))


# token_normals: bit-exact Philox normals.
def token_normals_builder(rows, channels, seed, stream, step):
    def build(rng):
        image = rng.integers(0, 2 ** 32, size=rows, dtype=np.uint64).astype(np.uint32)
        position = rng.integers(0, 256, size=rows).astype(np.uint32)
        if rows >= 2:
            image[0], position[0] = 0, 0
            image[1], position[1] = 2 ** 32 - 1, 2 ** 32 - 1
        return (image, position), {"seed": seed, "stream": stream, "step": step,
                                   "channels": channels}
    return build


case("token_normals", "1x1-seed0", tol=0)(token_normals_builder(1, 1, 0, 1, 0))
case("token_normals", "17x3-stream1", tol=0)(token_normals_builder(17, 3, 12345, 1, 0))
case("token_normals", "65x16-stream2-step99", tol=0)(token_normals_builder(65, 16, 2 ** 40 + 7, 2,
                                                                           99))
case("token_normals", "256x64-seedmax-step65535", tol=0)(
    token_normals_builder(256, 64, 2 ** 64 - 1, 2, 65535))
case("token_normals", "33x17-stream0", tol=0)(token_normals_builder(33, 17, 1, 0, 0))


# axpby: copies (b = 0, where y's old content must not leak), deltas, strided x.
def axpby_builder(rows, cols, a, b, strided=False, garbage_y=False):
    def build(rng):
        x = column_slice(rng, rows, cols) if strided else randn(rng, rows, cols)
        y = np.full((rows, cols), np.nan, np.float32) if garbage_y else randn(rng, rows, cols)
        return (x, y), {"a": f32(a), "b": f32(b)}
    return build


case("axpby", "1x1-copy")(axpby_builder(1, 1, 1.0, 0.0))
case("axpby", "17x33-delta")(axpby_builder(17, 33, -1.0, 1.0))
case("axpby", "65x768-scaled-copy-over-nan")(axpby_builder(65, 768, 0.5, 0.0, garbage_y=True))
case("axpby", "33x17-strided-2.9")(axpby_builder(33, 17, 2.9, 1.0, strided=True))


# cosine_rows: head dims 64 and 80, one head, a zero row (eps), strided V slices.
def cosine_builder(rows, heads, hd, strided=False, zero_row=False, correlated=False):
    def build(rng):
        cols = heads * hd
        if strided:  # the V part of two fused qkv buffers
            a = randn(rng, rows, 3 * cols)[:, 2 * cols:]
            b = randn(rng, rows, 3 * cols)[:, 2 * cols:]
        else:
            a, b = randn(rng, rows, cols), randn(rng, rows, cols)
        if correlated:
            b = (a + 0.1 * b).astype(np.float32)
        if zero_row:
            a[0] = 0.0
        return (a, b), {"heads": heads}
    return build


case("cosine_rows", "1x1x1")(cosine_builder(1, 1, 1))
case("cosine_rows", "17x12x64-correlated")(cosine_builder(17, 12, 64, correlated=True))
case("cosine_rows", "33x16x80-strided")(cosine_builder(33, 16, 80, strided=True))
case("cosine_rows", "5x3x7-zero-row")(cosine_builder(5, 3, 7, zero_row=True))


# head_l2norm: VAR's q/k normalisation in place: head dims 64 and 16, the q and k parts of a
# fused qkv (strided), per-head scales (up to the ln 100 cap), no scale, a zero slice (eps),
# one head, large magnitudes (the norm's squares in double).
def head_l2norm_builder(rows, heads, hd, part=None, scaled=True, zero_slice=False, magnitude=1.0):
    def build(rng):
        cols = heads * hd
        if part is None:
            x = randn(rng, rows, cols, scale=magnitude)
        else:  # the q (0) or k (1) part of a fused [rows, 3 * cols] qkv
            x = randn(rng, rows, 3 * cols, scale=magnitude)[:, part * cols:(part + 1) * cols]
        if zero_slice:
            x[0, :hd] = 0.0
        inputs = (x,)
        if scaled:
            inputs += (np.exp(rng.uniform(0.0, np.log(100.0), size=heads)).astype(F32),)
        return inputs, {"heads": heads}
    return build


case("head_l2norm", "1x1x1")(head_l2norm_builder(1, 1, 1, scaled=False))
case("head_l2norm", "17x2x64-scaled")(head_l2norm_builder(17, 2, 64))
case("head_l2norm", "33x16x64-q-of-qkv")(head_l2norm_builder(33, 16, 64, part=0))
case("head_l2norm", "33x16x64-k-of-qkv-unscaled")(head_l2norm_builder(33, 16, 64, part=1, scaled=False))
case("head_l2norm", "5x3x16-zero-slice")(head_l2norm_builder(5, 3, 16, zero_slice=True))
case("head_l2norm", "9x4x32-large")(head_l2norm_builder(9, 4, 32, magnitude=1e18))


# attention_mass: head dims 64 and 80, one query, several, keys of odd length.
def attention_mass_builder(batch, nq, keys, heads, hd, scale=None):
    def build(rng):
        q = randn(rng, batch, nq, heads * hd)
        k = randn(rng, batch, keys, heads * hd)
        params = {"heads": heads}
        if scale is not None:
            params["scale"] = f32(scale)
        return (q, k), params
    return build


case("attention_mass", "1x1x1-h1")(attention_mass_builder(1, 1, 1, 1, 1))
case("attention_mass", "2x3x320-h12x64")(attention_mass_builder(2, 3, 320, 12, 64))
case("attention_mass", "3x7x33-h16x80")(attention_mass_builder(3, 7, 33, 16, 80))
case("attention_mass", "2x5x17-h2x8-scale0.3")(attention_mass_builder(2, 5, 17, 2, 8, scale=0.3))


# --------------------------------------------------------------------------
# FID-Inception window ops: conv2d_ex, avg_pool2d, max_pool2d,
# resize_bilinear_tf1 (eval_and_formats.md 3-4)
# --------------------------------------------------------------------------

def _window(p, kh, kw, default_stride):
    stride = (p.get("stride_h", default_stride[0]), p.get("stride_w", default_stride[1]))
    return stride, (p.get("pad_h", 0), p.get("pad_w", 0))


def ref_conv2d_ex(inputs, p):
    x, w, bias, y = (tuple(inputs) + (None,) * 4)[:4]
    stride, pad = _window(p, w.shape[2], w.shape[3], (1, 1))
    return ref.conv2d_ex(x, w, bias, stride=stride, pad=pad, beta=p.get("beta", 0.0), y=y,
                         relu=p.get("relu", False))


def ref_avg_pool2d(inputs, p):
    stride, pad = _window(p, p["kh"], p["kw"], (p["kh"], p["kw"]))
    return ref.avg_pool2d(inputs[0], p["kh"], p["kw"], stride, pad,
                          count_include_pad=bool(p["count_include_pad"]))


def ref_max_pool2d(inputs, p):
    stride, pad = _window(p, p["kh"], p["kw"], (p["kh"], p["kw"]))
    return ref.max_pool2d(inputs[0], p["kh"], p["kw"], stride, pad)


def ref_resize_bilinear_tf1(inputs, p):
    return ref.resize_bilinear_tf1(inputs[0], p["out_h"], p["out_w"], p.get("normalize", False))


REFERENCES.update({
    "conv2d_ex": ref_conv2d_ex,
    "avg_pool2d": ref_avg_pool2d,
    "max_pool2d": ref_max_pool2d,
    "resize_bilinear_tf1": ref_resize_bilinear_tf1,
})


def nhwc(rng, batch, height, width, channels, strided=False, **kw):
    """NHWC float32; strided: a channel slice of a wider buffer (pixel stride > channels)."""
    if not strided:
        return randn(rng, batch, height, width, channels, **kw)
    return randn(rng, batch, height, width, channels + 7, **kw)[..., 3:3 + channels]


# conv2d_ex: Inception's shapes in miniature (3x3 stride 2 valid, 1x7 / 7x1,
# 5x5 pad 2, 1x1 into a channel slice of a concat buffer), fused ReLU,
# residual beta, and the plain-loop CPU kernel (naive).
def conv2d_ex_builder(batch, height, width, cin, cout, kh, kw, stride=(1, 1), pad=(0, 0),
                      bias=True, relu=False, beta=0.0, with_y=False, strided=False, naive=False,
                      wtype=None):
    def build(rng):
        x = nhwc(rng, batch, height, width, cin, strided=strided)
        w = randn(rng, cout, cin, kh, kw, scale=1.0 / np.sqrt(cin * kh * kw))
        inputs = (x, w, randn(rng, cout) if bias else None)
        if with_y or strided:
            oh = (height + 2 * pad[0] - kh) // stride[0] + 1
            ow = (width + 2 * pad[1] - kw) // stride[1] + 1
            inputs += (nhwc(rng, batch, oh, ow, cout, strided=strided),)
        params = {"stride_h": stride[0], "stride_w": stride[1], "pad_h": pad[0], "pad_w": pad[1],
                  "beta": f32(beta), "relu": relu}
        if naive:
            params["naive"] = True
        if wtype is not None:
            params["wtype"] = wtype
        return inputs, params
    return build


case("conv2d_ex", "b1-9x11-c3to8-k3-s2-valid")(conv2d_ex_builder(1, 9, 11, 3, 8, 3, 3, (2, 2)))
case("conv2d_ex", "b2-9x8-c5to7-k1x7-p0x3-relu")(
    conv2d_ex_builder(2, 9, 8, 5, 7, 1, 7, pad=(0, 3), relu=True))
case("conv2d_ex", "b1-8x6-c6to5-k7x1-p3x0")(conv2d_ex_builder(1, 8, 6, 6, 5, 7, 1, pad=(3, 0)))
case("conv2d_ex", "b2-6x5-c16to9-k1-sliced-in-out")(
    conv2d_ex_builder(2, 6, 5, 16, 9, 1, 1, strided=True, relu=True))
case("conv2d_ex", "b1-7x7-c8to6-k3-p1-sliced-in-out")(
    conv2d_ex_builder(1, 7, 7, 8, 6, 3, 3, pad=(1, 1), strided=True))
case("conv2d_ex", "b1-9x9-c8to16-k3-s2-p1-relu")(
    conv2d_ex_builder(1, 9, 9, 8, 16, 3, 3, (2, 2), (1, 1), relu=True))
case("conv2d_ex", "b1-5x5-c4to6-k5-p2-residual")(
    conv2d_ex_builder(1, 5, 5, 4, 6, 5, 5, pad=(2, 2), beta=1.0, with_y=True))
case("conv2d_ex", "b2-8x7-c6to5-k2x3-s3x2-p1x0-nobias")(
    conv2d_ex_builder(2, 8, 7, 6, 5, 2, 3, (3, 2), (1, 0), bias=False))
case("conv2d_ex", "b1-1x1-c4to3-k3-p1")(conv2d_ex_builder(1, 1, 1, 4, 3, 3, 3, pad=(1, 1)))
case("conv2d_ex", "b3-17x17-c32to24-k1x7-p0x3")(
    conv2d_ex_builder(3, 17, 17, 32, 24, 1, 7, pad=(0, 3), relu=True))
case("conv2d_ex", "b1-35x35-c48to64-k5-p2", tol=2e-5)(
    conv2d_ex_builder(1, 35, 35, 48, 64, 5, 5, pad=(2, 2), relu=True))
case("conv2d_ex", "b2-7x9-c6to5-k3-s2-p1-sliced-relu-naive")(
    conv2d_ex_builder(2, 7, 9, 6, 5, 3, 3, (2, 2), (1, 1), relu=True, strided=True, naive=True))
case("conv2d_ex", "b1-6x6-c4to4-k1-residual-naive")(
    conv2d_ex_builder(1, 6, 6, 4, 4, 1, 1, beta=0.5, with_y=True, naive=True))


# 16-bit conv2d_ex, as conv2d's: a pointwise one on strided (pixel-stride) input and output
# (its fp32 form reads x in place; the 16-bit one rounds it first), stride 2 with ReLU, a
# residual beta, and the plain-loop kernel.
sixteen_bit_cases("conv2d_ex", conv2d_ex_builder, ref_conv2d_ex,
                  [("b2-6x5-c16to9-k1-sliced-in-out", (2, 6, 5, 16, 9, 1, 1), dict(strided=True, relu=True)),
                   ("b1-9x9-c8to16-k3-s2-p1-relu", (1, 9, 9, 8, 16, 3, 3, (2, 2), (1, 1)), dict(relu=True)),
                   ("b1-7x7-c8to6-k3-p1-sliced-in-out", (1, 7, 7, 8, 6, 3, 3),
                    dict(pad=(1, 1), strided=True, beta=1.0)),
                   ("b2-7x9-c6to5-k3-s2-p1-sliced", (2, 7, 9, 6, 5, 3, 3, (2, 2), (1, 1)),
                    dict(strided=True, naive=True))])


def pool_builder(batch, height, width, channels, kh, kw, stride=None, pad=(0, 0),
                 include_pad=None, strided=False):
    def build(rng):
        x = nhwc(rng, batch, height, width, channels, strided=strided)
        params = {"kh": kh, "kw": kw, "pad_h": pad[0], "pad_w": pad[1]}
        if stride is not None:
            params.update(stride_h=stride[0], stride_w=stride[1])
        if include_pad is not None:
            params["count_include_pad"] = include_pad
        inputs = (x,)
        if strided:
            s = stride or (kh, kw)
            oh = (height + 2 * pad[0] - kh) // s[0] + 1
            ow = (width + 2 * pad[1] - kw) // s[1] + 1
            inputs += (nhwc(rng, batch, oh, ow, channels, strided=True),)
        return inputs, params
    return build


# avg_pool2d: Inception's branch_pool (3x3, stride 1, pad 1, padding not
# counted), the global pool (window = image), PyTorch's default count.
case("avg_pool2d", "b2-7x6-c5-k3-s1-p1-exclude-pad")(
    pool_builder(2, 7, 6, 5, 3, 3, (1, 1), (1, 1), include_pad=False))
case("avg_pool2d", "b1-7x6-c5-k3-s1-p1-include-pad")(
    pool_builder(1, 7, 6, 5, 3, 3, (1, 1), (1, 1), include_pad=True))
case("avg_pool2d", "b2-8x8-c33-global")(pool_builder(2, 8, 8, 33, 8, 8, include_pad=False))
case("avg_pool2d", "b1-9x7-c4-k3-s2")(pool_builder(1, 9, 7, 4, 3, 3, (2, 2), include_pad=True))
case("avg_pool2d", "b2-5x6-c6-k3-s1-p1-sliced-in-out")(
    pool_builder(2, 5, 6, 6, 3, 3, (1, 1), (1, 1), include_pad=False, strided=True))
case("avg_pool2d", "b1-1x1-c3-k3-s1-p1")(pool_builder(1, 1, 1, 3, 3, 3, (1, 1), (1, 1),
                                                      include_pad=False))

# max_pool2d: the stem and Mixed_6a/7a pools (3x3 stride 2, valid; the
# result goes into a channel slice), Mixed_7c's 3x3 stride 1 pad 1.
case("max_pool2d", "b2-9x9-c5-k3-s2", tol=0)(pool_builder(2, 9, 9, 5, 3, 3, (2, 2)))
case("max_pool2d", "b1-8x8-c6-k3-s1-p1", tol=0)(pool_builder(1, 8, 8, 6, 3, 3, (1, 1), (1, 1)))
case("max_pool2d", "b2-17x17-c7-k3-s2-sliced-in-out", tol=0)(
    pool_builder(2, 17, 17, 7, 3, 3, (2, 2), strided=True))
case("max_pool2d", "b1-4x5-c3-k2-default-stride-p1", tol=0)(
    pool_builder(1, 4, 5, 3, 2, 2, None, (1, 1)))


# resize_bilinear_tf1: exact (tol 0) against the float32 NumPy definition:
# MAR's 256 -> 299, up- and down-sampling, odd sizes, identity, 1 pixel.
def resize_builder(batch, in_h, in_w, channels, out_h, out_w, dtype="uint8", normalize=False):
    def build(rng):
        if dtype == "uint8":
            x = rng.integers(0, 256, size=(batch, in_h, in_w, channels), dtype=np.uint8)
        else:
            x = randn(rng, batch, in_h, in_w, channels, scale=50.0)
        return (x,), {"out_h": out_h, "out_w": out_w, "normalize": normalize}
    return build


case("resize_bilinear_tf1", "u8-256to299-normalize", tol=0)(
    resize_builder(1, 256, 256, 3, 299, 299, normalize=True))
case("resize_bilinear_tf1", "u8-32to299", tol=0)(resize_builder(2, 32, 32, 3, 299, 299))
case("resize_bilinear_tf1", "u8-401x333to299-normalize", tol=0)(
    resize_builder(1, 401, 333, 3, 299, 299, normalize=True))
case("resize_bilinear_tf1", "u8-299to299-identity", tol=0)(resize_builder(1, 299, 299, 3, 299, 299))
case("resize_bilinear_tf1", "f32-17x23to11x13", tol=0)(
    resize_builder(2, 17, 23, 5, 11, 13, dtype="float32"))
case("resize_bilinear_tf1", "f32-1x1to5x3", tol=0)(resize_builder(1, 1, 1, 2, 5, 3, dtype="float32"))
case("resize_bilinear_tf1", "u8-31x45to64x7", tol=0)(resize_builder(3, 31, 45, 3, 64, 7))


# --------------------------------------------------------------------------
# VAR resize ops: resize_bicubic (PyTorch bicubic, align_corners=False,
# A = -0.75, clamped taps) and resize_area (adaptive average pooling, down
# and up), var_fastvar.md B3 and D3; float64 references in
# tests/reference/vqvae.py.
# --------------------------------------------------------------------------

def ref_resize_bicubic(inputs, p):
    return ref_vq.resize_bicubic(inputs[0], p["out_h"], p["out_w"])


def ref_resize_area(inputs, p):
    return ref_vq.resize_area(inputs[0], p["out_h"], p["out_w"])


REFERENCES.update({"resize_bicubic": ref_resize_bicubic, "resize_area": ref_resize_area})


def var_resize_builder(batch, in_h, in_w, channels, out_h, out_w, view=False):
    """view: x is every other image of a batch twice as large (a strided batch
    the binding copies to the contiguous layout the op takes)."""
    def build(rng):
        if view:
            x = randn(rng, 2 * batch, in_h, in_w, channels)[::2]
        else:
            x = randn(rng, batch, in_h, in_w, channels)
        return (x,), {"out_h": out_h, "out_w": out_w}
    return build


# bicubic: every VAR scale up to the 16x16 latent (1x1 is a constant map),
# the identity (exact), down-sampling, non-square maps, batches of several
# images, a 1x1 output, and enough elements for the threaded path.
for _pn in (1, 2, 3, 5, 10, 13):
    case("resize_bicubic", "b2-%dto16-c8" % _pn)(var_resize_builder(2, _pn, _pn, 8, 16, 16))
case("resize_bicubic", "b1-16to16-c32-identity", tol=0)(var_resize_builder(1, 16, 16, 32, 16, 16))
case("resize_bicubic", "b2-16to5-c3-down")(var_resize_builder(2, 16, 16, 3, 5, 5))
case("resize_bicubic", "b3-7x11to13x4-c5-nonsquare")(var_resize_builder(3, 7, 11, 5, 13, 4))
case("resize_bicubic", "b2-9x4to4x9-c2-view")(var_resize_builder(2, 9, 4, 2, 4, 9, view=True))
case("resize_bicubic", "b1-16to1-c4")(var_resize_builder(1, 16, 16, 4, 1, 1))
case("resize_bicubic", "b1-1x6to3x2-c3")(var_resize_builder(1, 1, 6, 3, 3, 2))
case("resize_bicubic", "b4-10to16-c64-threads")(var_resize_builder(4, 10, 10, 64, 16, 16))

# area: the spec's in = 16 bin table (every VAR scale below 16, and 1),
# up-sampling 10 -> 13 and 10 -> 16 (FastVAR's cache restoration, D3),
# 1 -> 5, the identity (exact), non-square, a strided batch, the threaded path.
for _pn in (1, 2, 3, 4, 5, 6, 8, 10, 13):
    case("resize_area", "b2-16to%d-c8" % _pn)(var_resize_builder(2, 16, 16, 8, _pn, _pn))
case("resize_area", "b2-10to13-c8-up")(var_resize_builder(2, 10, 10, 8, 13, 13))
case("resize_area", "b1-10to16-c8-up")(var_resize_builder(1, 10, 10, 8, 16, 16))
case("resize_area", "b1-1to5-c3-up")(var_resize_builder(1, 1, 1, 3, 5, 5))
case("resize_area", "b1-16to16-c32-identity", tol=0)(var_resize_builder(1, 16, 16, 32, 16, 16))
case("resize_area", "b3-16x9to5x13-c5-nonsquare")(var_resize_builder(3, 16, 9, 5, 5, 13))
case("resize_area", "b2-13x16to10x3-c2-view")(var_resize_builder(2, 13, 16, 2, 10, 3, view=True))
case("resize_area", "b4-16to10-c128-threads")(var_resize_builder(4, 16, 16, 128, 10, 10))


# --------------------------------------------------------------------------
# VAR's sampling ops (var_fastvar.md A6; contracts in ops_list.h)
# --------------------------------------------------------------------------

def var_keys(rng, rows):
    """Random (image, position) uint32 keys, one pair per row, over the whole range."""
    image = rng.integers(0, 2 ** 32, size=rows, dtype=np.uint64).astype(np.uint32)
    position = rng.integers(0, 2 ** 32, size=rows, dtype=np.uint64).astype(np.uint32)
    return image, position


def sampling_logits(rng, rows, vocab, scale=2.0, strided=False, neg_inf=0.0, ties=False):
    """float32 logits [rows, vocab]: normal * scale, or small integers (ties: many equal
    values, at the top-k threshold too); neg_inf: that share of the entries -inf, every
    row keeping a finite one and row 0 keeping exactly one; strided: a column slice of a
    wider buffer (ld > vocab)."""
    if ties:
        x = rng.integers(-4, 4, size=(rows, vocab)).astype(F32)
    else:
        x = randn(rng, rows, vocab, scale=scale)
    if neg_inf:
        x[rng.random((rows, vocab)) < neg_inf] = -np.inf
        keep = rng.integers(0, vocab, size=rows)
        x[np.arange(rows), keep] = np.abs(randn(rng, rows))
        x[0] = -np.inf
        x[0, keep[0]] = 0.5
    if strided:
        wide = randn(rng, rows, vocab + 9)
        wide[:, 4:4 + vocab] = x
        x = wide[:, 4:4 + vocab]
    return x


def sample_builder(rows, vocab, top_k, top_p, step=0, **logit_kw):
    def build(rng):
        logits = sampling_logits(rng, rows, vocab, **logit_kw)
        image, position = var_keys(rng, rows)
        params = {"seed": int(rng.integers(0, 2 ** 63)), "step": step, "top_k": top_k,
                  "top_p": f32(top_p)}
        return (logits, image, position), params
    return build


def ref_sample_tokens(inputs, p):
    logits, image, position = inputs
    return ref.sample_tokens(logits, p.get("top_k", 0), p.get("top_p", 0.0), p["seed"], p["step"],
                             image, position)


def check_sample_tokens(got, want, what):
    """Tokens and masked logits equal to the reference's exactly; each token survives."""
    assert isinstance(got, tuple) and len(got) == 2, what
    tokens, masked = got
    assert tokens.dtype == np.int32 and masked.dtype == np.float32, what
    np.testing.assert_array_equal(masked, want[1], err_msg=what + ": masked logits")
    np.testing.assert_array_equal(tokens, want[0], err_msg=what + ": tokens")
    assert np.all(np.isfinite(masked[np.arange(len(tokens)), tokens])), what + ": a removed token"


def sample_case(name, *args, **kw):
    case("sample_tokens", name, tol=0, reference=ref_sample_tokens,
         check=check_sample_tokens)(sample_builder(*args, **kw))


# (name, rows, vocab, top_k, top_p, extra): top_k 0 / 1 / mid / = vocab / > vocab / < 0,
# top_p 0 / 0.5 / 0.96 / 1 / tiny, both filters, ties at the top-k threshold, -inf
# entries, strided rows, several steps; every row its own random (image, position).
sample_case("r1-v1", 1, 1, 0, 0.0)
sample_case("r5-v2-k1", 5, 2, 1, 0.0)
sample_case("r9-v10-plain", 9, 10, 0, 0.0)
sample_case("r9-v10-k1", 9, 10, 1, 0.0)
sample_case("r9-v10-k3", 9, 10, 3, 0.0, step=7)
sample_case("r9-v10-k10-keeps-all", 9, 10, 10, 0.0)
sample_case("r9-v10-k100-keeps-all", 9, 10, 100, 0.0)
sample_case("r9-v10-k-negative", 9, 10, -5, 0.0)
sample_case("r9-v10-p0.5", 9, 10, 0, 0.5)
sample_case("r9-v10-k3-p0.5-ties", 9, 10, 3, 0.5, ties=True)
sample_case("r17-v64-k7-ties", 17, 64, 7, 0.0, ties=True)
sample_case("r17-v64-p0.96", 17, 64, 0, 0.96, step=1)
sample_case("r17-v64-p1-keeps-all", 17, 64, 0, 1.0)
sample_case("r17-v64-p0.001", 17, 64, 0, 0.001)
sample_case("r17-v64-k5-p0.5", 17, 64, 5, 0.5, step=65535)
sample_case("r17-v64-k17-p0.96-strided", 17, 64, 17, 0.96, strided=True)
sample_case("r17-v64-k5-p0.5-neginf", 17, 64, 5, 0.5, neg_inf=0.5)
sample_case("r17-v64-p0.96-neginf-strided", 17, 64, 0, 0.96, neg_inf=0.3, strided=True)
sample_case("r17-v64-k100-p0.96-neginf", 17, 64, 100, 0.96, neg_inf=0.9)
sample_case("r17-v64-peaky", 17, 64, 0, 0.0, scale=40.0)
sample_case("r9-v4096-plain", 9, 4096, 0, 0.0, scale=3.0)
sample_case("r9-v4096-k1", 9, 4096, 1, 0.0)
sample_case("r17-v4096-k900-p0.96", 17, 4096, 900, 0.96, step=9, scale=3.0)
sample_case("r9-v4096-p0.5-strided", 9, 4096, 0, 0.5, strided=True)
sample_case("r9-v4096-k900-p0.96-ties", 9, 4096, 900, 0.96, ties=True)
sample_case("r9-v4096-k900-p0.96-neginf", 9, 4096, 900, 0.96, neg_inf=0.5, step=3)
sample_case("r9-v4096-k4096-p1", 9, 4096, 4096, 1.0)


def sample_fixed_builder(rows, top_k, top_p, keys=None):
    """Given logits (and keys), for the boundaries random rows do not reach."""
    def build(rng):
        logits = np.array(rows, dtype=F32)
        image, position = var_keys(rng, len(rows)) if keys is None else (
            np.array(keys[0], np.uint32), np.array(keys[1], np.uint32))
        return (logits, image, position), {"seed": 42, "step": 0, "top_k": top_k,
                                           "top_p": f32(top_p)}
    return build


def sample_fixed_case(name, rows, top_k, top_p, keys=None):
    case("sample_tokens", name, tol=0, reference=ref_sample_tokens,
         check=check_sample_tokens)(sample_fixed_builder(rows, top_k, top_p, keys))


# Equal logits have exact probabilities (1/4, 1/8) and running sums: an entry whose sum
# equals 1 - top_p is removed (<=), and equal values go in vocabulary order.
sample_fixed_case("equal-v4-p0.5-sum-at-bound", [[0.0] * 4, [2.5] * 4], 0, 0.5)
sample_fixed_case("equal-v8-p0.75-sum-at-bound", [[-1.0] * 8, [0.0] * 8], 0, 0.75)
# top_p = 1e-20: 1 - top_p is 1.0 in double, every running sum is <= it, and only the last
# entry of the order (the largest value, the highest index among equal ones) survives.
sample_fixed_case("p1e-20-keeps-the-last", [[0.5, 2.0, -1.0, 2.0, 1.0], [0.0] * 5], 0, 1e-20)
# top_k at a tie on the largest value, then top_p among the survivors.
sample_fixed_case("k2-tie-on-max-p0.4", [[1.0, 3.0, 3.0, 0.0, 3.0, 2.0]], 2, 0.4)
# top_k among values one float32 ulp apart (their order keys differ in the last byte
# only): the threshold is the exact k-th value, found by the last radix pass.
ADJACENT_FLOATS = [[float(v) for v in 1.0 + np.arange(10, dtype=F32) * np.spacing(F32(1.0))],
                   [float(v) for v in -2.0 + np.arange(10, dtype=F32)[::-1] * np.spacing(F32(2.0))]]
sample_fixed_case("k3-adjacent-floats", ADJACENT_FLOATS, 3, 0.0)
sample_fixed_case("k7-adjacent-floats-p0.5", ADJACENT_FLOATS, 7, 0.5)
# The draw's target on a running sum: 1024 equal weights have running sums 1, 2, ..., and
# the key (seed 42, image 0, position 3186371, step 0) has u = 303 / 1024 exactly
# (word 0 = 303 * 2^22), so u * total = 303.0 = c_302: the token is the first j with
# c_j > 303, j = 303 (with >= it would be 302).
EQUAL_1024_KEY = ([0], [3186371])
assert philox.var_sample_uniforms(42, *EQUAL_1024_KEY, 0)[0] * 1024 == 303.0
sample_fixed_case("equal-v1024-target-on-a-sum", [[0.0] * 1024], 0, 0.0, keys=EQUAL_1024_KEY)


def gumbel_builder(rows, vocab, tau, logit_scale, step=0, neg_inf=0.0, strided=False,
                   probs_strided=False):
    def build(rng):
        logits = sampling_logits(rng, rows, vocab, scale=2.0, neg_inf=neg_inf, strided=strided)
        image, position = var_keys(rng, rows)
        inputs = (logits, image, position)
        if probs_strided:
            inputs += (randn(rng, rows, vocab + 5)[:, 2:2 + vocab],)
        params = {"seed": int(rng.integers(0, 2 ** 63)), "step": step, "tau": f32(tau),
                  "logit_scale": f32(logit_scale)}
        return inputs, params
    return build


def ref_gumbel_softmax(inputs, p):
    logits, image, position = inputs[:3]
    return ref.gumbel_softmax(logits, p.get("logit_scale", 1.0), p["tau"], p["seed"], p["step"],
                              image, position)


def check_gumbel_softmax(got, want, what):
    """Within 1e-6 of each probability (relative). atol 1e-44: below float32's smallest
    normal (1.2e-38) a float keeps only an absolute precision of 1.4e-45."""
    assert isinstance(got, np.ndarray) and got.dtype == np.float32, what
    assert got.shape == want.shape, what
    assert_close(got, want, rtol=1e-6, atol=1e-44, what=what)


def gumbel_case(name, *args, **kw):
    case("gumbel_softmax", name, tol=0, reference=ref_gumbel_softmax,
         check=check_gumbel_softmax)(gumbel_builder(*args, **kw))


# VAR's schedule: tau = max(0.27 (1 - 0.95 ratio), 0.005), logit_scale = 1 + ratio.
gumbel_case("r1-v1", 1, 1, 1.0, 1.0)
gumbel_case("r9-v10-tau1", 9, 10, 1.0, 1.0)
gumbel_case("r17-v64-tau0.27-strided", 17, 64, 0.27, 1.0, step=0, strided=True)
gumbel_case("r17-v64-tau0.1-neginf-probs-strided", 17, 64, 0.1, 1.5, step=5, neg_inf=0.5,
            probs_strided=True)
gumbel_case("r9-v4096-tau0.0135-scale2", 9, 4096, 0.0135, 2.0, step=9)
gumbel_case("r9-v4096-tau0.005-neginf", 9, 4096, 0.005, 1.9, step=65535, neg_inf=0.8)
gumbel_case("r9-v4096-tau0.2-strided", 9, 4096, 0.2, 1.2, step=2, strided=True)


# pivotal_rows (FastVAR's PTS, var_fastvar.md D2): the kept rows must be the reference's
# exactly. HART-like sizes (13x13 keeping 85, 16x16 keeping 64), a strided view, keep 0 and
# keep all, repeated rows (exact ties: the lower index wins), constant rows (all scores 0),
# a NaN (every score of its sequence NaN: the lowest rows), one row.
def pivotal_builder(batch, rows, dim, keep, strided=False, repeats=False, constant=False, nan=False):
    def build(rng):
        x = column_slice(rng, batch * rows, dim) if strided else randn(rng, batch * rows, dim)
        if repeats:  # rows 2k and 2k+1 equal within each sequence
            x = np.ascontiguousarray(x)
            x[1::2] = x[0::2][: x[1::2].shape[0]]
        if constant:
            x = np.tile(randn(rng, 1, dim), (batch * rows, 1))
        if nan:
            x = np.ascontiguousarray(x)
            x[rows + 1, dim // 2] = np.nan
        return (x,), {"batch": batch, "keep": keep}
    return build


def ref_pivotal_rows(inputs, p):
    return ref_fastvar.pivotal_rows(inputs[0], p.get("batch", 1), p["keep"])


def check_pivotal_rows(got, want, what):
    assert isinstance(got, np.ndarray) and got.dtype == np.int32, what
    np.testing.assert_array_equal(got, want, err_msg=what)


def pivotal_case(name, *args, **kw):
    case("pivotal_rows", name, tol=0, reference=ref_pivotal_rows, check=check_pivotal_rows)(
        pivotal_builder(*args, **kw))


pivotal_case("b1-r1-c1-k1", 1, 1, 1, 1)
pivotal_case("b2-r169-c32-k85", 2, 169, 32, 85)
pivotal_case("b2-r256-c64-k64-strided", 2, 256, 64, 64, strided=True)
pivotal_case("b4-r36-c48-k20", 4, 36, 48, 20)
pivotal_case("b3-r10-c5-k0", 3, 10, 5, 0)
pivotal_case("b2-r9-c3-k9-all", 2, 9, 3, 9)
pivotal_case("b2-r12-c6-k5-ties", 2, 12, 6, 5, repeats=True)
pivotal_case("b2-r7-c8-k3-constant", 2, 7, 8, 3, constant=True)
pivotal_case("b2-r16-c8-k6-nan", 2, 16, 8, 6, nan=True)


# --------------------------------------------------------------------------
# the test
# --------------------------------------------------------------------------

def check_scaled(got, want, tol, what):
    """The op tests' comparison: every element within tol * max |want| (an op's float32
    error follows the size of the sums behind an element, which the largest output bounds:
    tolerance.scaled_atol), element-wise through the one helper."""
    assert_close(got, want, rtol=0.0, atol=scaled_atol(want, tol), what=what)


# naive=True selects a backend's plain reference kernel beside its fast one; only the CPU
# (conv2d, conv2d_ex) and CUDA have them. The guard backend runs the CPU's fast kernels over
# memory the host cannot read, so those cases run on the backends that have the kernels.
FAST_CASES = [c for c in CASES if not c.id.endswith("-naive")]
NAIVE_CASES = [c for c in CASES if c.id.endswith("-naive")]
REFERENCE_KERNEL_BACKENDS = ("cpu", "cuda")


@pytest.mark.parametrize("case", FAST_CASES, ids=[c.id for c in FAST_CASES])
def test_op(backend, case):
    check_case(backend, case)


@pytest.mark.parametrize("case", NAIVE_CASES, ids=[c.id for c in NAIVE_CASES])
@pytest.mark.parametrize("kernel_backend", REFERENCE_KERNEL_BACKENDS)
def test_op_reference_kernel(kernel_backend, case):
    if kernel_backend not in _C.backends():
        pytest.skip("backend %r is not in this build (marcache._C.backends() == %r)"
                    % (kernel_backend, list(_C.backends())))
    check_case(kernel_backend, case)


def check_case(backend, case):
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    inputs, params = case.build(rng)
    snapshot = [None if a is None else a.copy() for a in inputs]
    got = _C.run_op(backend, case.op, inputs, params)
    for before, after in zip(snapshot, inputs):
        assert before is None or np.array_equal(before, after, equal_nan=True), "run_op modified an input"
    want = case.reference(inputs, params)
    if case.check is not None:
        case.check(got, want, "%s on %s" % (case.id, backend))
        return
    want = np.asarray(want)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    assert got.shape == want.shape
    assert np.all(np.isfinite(got)), "non-finite values in the result"
    if case.tol == 0:
        np.testing.assert_array_equal(got, want.astype(np.float32))
    else:
        check_scaled(got, want, case.tol, "%s on %s" % (case.id, backend))


def test_every_op_has_a_case():
    exported = set(_C.op_names())
    covered = {c.op for c in CASES}
    assert covered == exported, "ops without a case: %s; cases of unknown ops: %s" % (
        sorted(exported - covered), sorted(covered - exported))


def test_case_ids_are_unique():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))


# --------------------------------------------------------------------------
# the binding's input checks (backend-independent: it checks before any op)
# --------------------------------------------------------------------------

def _m(*shape, dtype=F32):
    return np.zeros(shape, dtype=dtype)


BAD_CALLS = [
    # (id, backend, op, inputs, params, exception, message fragment)
    ("unknown-op", "cpu", "matmul", (), {}, ValueError, "valid ops: gemm, linear"),
    ("unknown-backend", "metal", "gemm", (), {}, ValueError, "valid backends: cpu"),
    ("gemm-shape", "cpu", "gemm", (_m(3, 4), _m(5, 2)), {}, ValueError,
     "gemm: argument 'B': expected shape (4, ?), got (5, 2)"),
    ("gemm-dtype", "cpu", "gemm", (_m(3, 4, dtype=np.float64), _m(4, 2)), {}, ValueError,
     "gemm: argument 'A': expected dtype float32 (native byte order), got float64"),
    ("gemm-rank", "cpu", "gemm", (_m(3), _m(4, 2)), {}, ValueError,
     "gemm: argument 'A': expected 2 dimensions"),
    ("gemm-not-array", "cpu", "gemm", ([[1.0]], _m(1, 1)), {}, ValueError,
     "expected a numpy.ndarray"),
    ("gemm-c-shape", "cpu", "gemm", (_m(3, 4), _m(4, 2), _m(2, 3)), {}, ValueError,
     "argument 'C': expected shape (3, 2), got (2, 3)"),
    ("gemm-unknown-param", "cpu", "gemm", (_m(3, 4), _m(4, 2)), {"alpah": 1.0}, ValueError,
     "unknown param 'alpah'"),
    ("gemm-arity", "cpu", "gemm", (_m(3, 4),), {}, ValueError, "expected 2 to 3 inputs"),
    ("linear-act", "cpu", "linear", (_m(2, 3), _m(4, 3)), {"act": "relu"}, ValueError,
     "expected 'none', 'gelu', 'silu' or 'gelu_tanh'"),
    ("linear-beta-act", "cpu", "linear", (_m(2, 3), _m(4, 3), None, _m(2, 4)),
     {"act": "gelu", "beta": 1.0}, ValueError, "'act' must be 'none' when beta == 1"),
    ("linear-bias", "cpu", "linear", (_m(2, 3), _m(4, 3), _m(3)), {}, ValueError,
     "argument 'bias': expected shape (4,), got (3,)"),
    ("layernorm-eps", "cpu", "layernorm", (_m(2, 3),), {}, ValueError, "param 'eps' is required"),
    ("layernorm-b-without-w", "cpu", "layernorm", (_m(2, 3), None, _m(3)), {"eps": 1e-6},
     ValueError, "'b' needs argument 'w'"),
    ("layernorm-shift-alone", "cpu", "layernorm", (_m(2, 3), None, None, _m(2, 3)),
     {"eps": 1e-6}, ValueError, "'shift' and 'scale' come together"),
    ("add_rows-period", "cpu", "add_rows", (_m(4, 3), _m(2, 3)), {"period": 3}, ValueError,
     "param 'period' must be in [1, 2]"),
    ("gather-range", "cpu", "gather_rows", (_m(4, 3), np.array([0, 4], np.int32)), {},
     ValueError, "idx[1] = 4 is outside [0, 4)"),
    ("gather-dtype", "cpu", "gather_rows", (_m(4, 3), np.array([0, 1], np.int64)), {},
     ValueError, "argument 'idx': expected dtype int32"),
    ("scatter-duplicate", "cpu", "scatter_rows",
     (_m(2, 3), np.array([1, 1], np.int32), _m(4, 3)), {}, ValueError, "appears twice"),
    ("head_l2norm-heads", "cpu", "head_l2norm", (_m(2, 8),), {"heads": 3}, ValueError,
     "not a positive multiple of heads"),
    ("head_l2norm-scale-shape", "cpu", "head_l2norm", (_m(2, 8), _m(3)), {"heads": 2}, ValueError,
     "argument 'head_scale': expected shape (2,), got (3,)"),
    ("attention-no-keys", "cpu", "attention", (_m(1, 2, 8), _m(1, 0, 8), _m(1, 0, 8)),
     {"heads": 2}, ValueError, "no keys"),
    ("attention-heads", "cpu", "attention", (_m(1, 2, 8), _m(1, 3, 8), _m(1, 3, 8)),
     {"heads": 3}, ValueError, "not a positive multiple of heads"),
    ("attention-pairs", "cpu", "attention", (_m(1, 2, 8), _m(1, 3, 8)), {"heads": 2},
     ValueError, "expected inputs (q, k1, v1"),
    ("attention-naive-cpu", "cpu", "attention", (_m(1, 2, 8), _m(1, 3, 8), _m(1, 3, 8)),
     {"heads": 2, "naive": True}, ValueError, "no separate reference kernel"),
    ("attention-v-rows", "cpu", "attention", (_m(1, 2, 8), _m(1, 3, 8), _m(1, 4, 8)),
     {"heads": 2}, ValueError, "argument 'v1': expected shape (1, 3, 8), got (1, 4, 8)"),
    ("cfg-channels", "cpu", "cfg_combine", (_m(2, 8), _m(2, 4)), {"scale": 2.0, "channels": 6},
     ValueError, "argument 'uncond': expected shape (2, >=6), got (2, 4)"),
    ("ddpm-noise", "cpu", "ddpm_step", (_m(2, 4), _m(2, 4), _m(2, 4)),
     dict({k: 1.0 for k in DDPM_COEFS}, noise_scale=1.0), ValueError,
     "'noise' is required when noise_scale != 0"),
    ("ddpm-missing-coef", "cpu", "ddpm_step", (_m(2, 4), _m(2, 4), _m(2, 4)), {"noise_scale": 0},
     ValueError, "param 'sqrt_recip_alphas_cumprod' is required"),
    ("token-normals-channels", "cpu", "token_normals",
     (_m(2, dtype=np.uint32), _m(2, dtype=np.uint32)),
     {"seed": 1, "stream": 1, "step": 0, "channels": 65}, ValueError,
     "param 'channels' must be in [1, 64]"),
    ("token-normals-step", "cpu", "token_normals",
     (_m(2, dtype=np.uint32), _m(2, dtype=np.uint32)),
     {"seed": 1, "stream": 1, "step": 65536, "channels": 4}, ValueError,
     "param 'step' must be in [0, 65535]"),
    ("token-normals-seed", "cpu", "token_normals",
     (_m(2, dtype=np.uint32), _m(2, dtype=np.uint32)),
     {"seed": 2 ** 64, "stream": 1, "step": 0, "channels": 4}, ValueError,
     "param 'seed' must be in [0, 2**64 - 1]"),
]


BAD_CALLS += [
    ("conv2d_ex-cin", "cpu", "conv2d_ex", (_m(1, 4, 4, 3), _m(2, 5, 3, 3)), {}, ValueError,
     "conv2d_ex: argument 'w': expected shape (>=1, 3, >=1, >=1), got (2, 5, 3, 3)"),
    ("conv2d_ex-too-small", "cpu", "conv2d_ex", (_m(1, 2, 2, 3), _m(2, 3, 3, 3)), {}, ValueError,
     "window does not fit the 2x2 input"),
    ("conv2d_ex-stride", "cpu", "conv2d_ex", (_m(1, 4, 4, 3), _m(2, 3, 3, 3)), {"stride_h": 0},
     ValueError, "param 'stride_h' must be in [1,"),
    ("conv2d_ex-y-shape", "cpu", "conv2d_ex", (_m(1, 4, 4, 3), _m(2, 3, 3, 3), None,
                                               _m(1, 4, 4, 2)), {}, ValueError,
     "argument 'y': expected shape (1, 2, 2, 2), got (1, 4, 4, 2)"),
    ("avg_pool2d-count", "cpu", "avg_pool2d", (_m(1, 4, 4, 3),), {"kh": 3, "kw": 3}, ValueError,
     "param 'count_include_pad' is required"),
    ("avg_pool2d-pad", "cpu", "avg_pool2d", (_m(1, 4, 4, 3),),
     {"kh": 3, "kw": 3, "pad_h": 2, "count_include_pad": 0}, ValueError,
     "padding must be at most half the window"),
    ("max_pool2d-unknown-param", "cpu", "max_pool2d", (_m(1, 4, 4, 3),),
     {"kh": 3, "kw": 3, "count_include_pad": 0}, ValueError, "unknown param 'count_include_pad'"),
    ("resize-dtype", "cpu", "resize_bilinear_tf1", (_m(1, 4, 4, 3, dtype=np.float64),),
     {"out_h": 2, "out_w": 2}, ValueError, "argument 'x': expected dtype float32"),
    ("resize-size", "cpu", "resize_bilinear_tf1", (_m(1, 4, 4, 3),), {"out_h": 0, "out_w": 2},
     ValueError, "param 'out_h' must be in [1,"),
    ("resize_bicubic-size", "cpu", "resize_bicubic", (_m(1, 4, 4, 3),), {"out_h": 2, "out_w": 0},
     ValueError, "param 'out_w' must be in [1,"),
    ("resize_bicubic-missing", "cpu", "resize_bicubic", (_m(1, 4, 4, 3),), {"out_h": 2},
     ValueError, "param 'out_w' is required"),
    ("resize_area-rank", "cpu", "resize_area", (_m(4, 4, 3),), {"out_h": 2, "out_w": 2},
     ValueError, "resize_area: argument 'x': expected 4 dimensions"),
    ("resize_area-empty-side", "cpu", "resize_area", (_m(1, 0, 4, 3),), {"out_h": 2, "out_w": 2},
     ValueError, "height, width and channels must be positive"),
]


def _u32(n):
    return np.arange(n, dtype=np.uint32)


_KEYS = {"seed": 1, "step": 0}

BAD_CALLS += [
    ("sample_tokens-image-rows", "cpu", "sample_tokens", (_m(3, 8), _u32(2), _u32(3)), _KEYS,
     ValueError, "sample_tokens: argument 'image': expected shape (3,), got (2,)"),
    ("sample_tokens-position-dtype", "cpu", "sample_tokens",
     (_m(3, 8), _u32(3), np.arange(3, dtype=np.int32)), _KEYS, ValueError,
     "sample_tokens: argument 'position': expected dtype uint32"),
    ("sample_tokens-step", "cpu", "sample_tokens", (_m(3, 8), _u32(3), _u32(3)),
     {"seed": 1, "step": 65536}, ValueError, "param 'step' must be in [0, 65535]"),
    ("sample_tokens-seed-missing", "cpu", "sample_tokens", (_m(3, 8), _u32(3), _u32(3)),
     {"step": 0}, ValueError, "sample_tokens: param 'seed' is required"),
    ("sample_tokens-top-p-type", "cpu", "sample_tokens", (_m(3, 8), _u32(3), _u32(3)),
     dict(_KEYS, top_p="0.9"), ValueError, "param 'top_p': expected a number"),
    ("sample_tokens-top-k-float", "cpu", "sample_tokens", (_m(3, 8), _u32(3), _u32(3)),
     dict(_KEYS, top_k=2.0), ValueError, "param 'top_k': expected an integer"),
    ("sample_tokens-rows-above-array", "cpu", "sample_tokens", (_m(3, 8), _u32(3), _u32(3)),
     dict(_KEYS, rows=4), ValueError, "param 'rows' must be in ["),
    ("sample_tokens-vocab-above-array", "cpu", "sample_tokens", (_m(3, 8), _u32(3), _u32(3)),
     dict(_KEYS, vocab=9), ValueError, "param 'vocab' must be in ["),
    ("gumbel-tau-missing", "cpu", "gumbel_softmax", (_m(3, 8), _u32(3), _u32(3)), _KEYS,
     ValueError, "gumbel_softmax: param 'tau' is required"),
    ("gumbel-probs-shape", "cpu", "gumbel_softmax", (_m(3, 8), _u32(3), _u32(3), _m(3, 7)),
     dict(_KEYS, tau=1.0), ValueError, "argument 'probs': expected shape (3, 8), got (3, 7)"),
    ("gumbel-unknown-param", "cpu", "gumbel_softmax", (_m(3, 8), _u32(3), _u32(3)),
     dict(_KEYS, tau=1.0, top_k=3), ValueError, "unknown param 'top_k'"),
    ("pivotal_rows-keep-above-rows", "cpu", "pivotal_rows", (_m(6, 4),), {"batch": 2, "keep": 4}, ValueError,
     "pivotal_rows: keep = 4 is outside [0, rows = 3]"),
    ("pivotal_rows-keep-negative", "cpu", "pivotal_rows", (_m(6, 4),), {"keep": -1}, ValueError,
     "pivotal_rows: keep = -1 is outside [0, rows = 6]"),
    ("pivotal_rows-batch-divides", "cpu", "pivotal_rows", (_m(7, 4),), {"batch": 2, "keep": 1}, ValueError,
     "pivotal_rows: argument 'x': its row count is not a multiple of param 'batch'"),
    ("pivotal_rows-keep-missing", "cpu", "pivotal_rows", (_m(6, 4),), {}, ValueError,
     "pivotal_rows: param 'keep' is required"),
]


@pytest.mark.parametrize("backend_name,op,inputs,params,exc,fragment",
                         [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_run_op_rejects_bad_calls(backend_name, op, inputs, params, exc, fragment):
    with pytest.raises(exc) as info:
        _C.run_op(backend_name, op, inputs, params)
    assert fragment in str(info.value)



# --------------------------------------------------------------------------
# VAR's sampling ops: the op's own refusals on every backend, and properties
# --------------------------------------------------------------------------

def _rows_with(n, vocab, **entries):
    """float32 [n, vocab] of ones with entries {"r_c": value} (row r, column c) set."""
    x = np.ones((n, vocab), dtype=F32)
    for key, value in entries.items():
        r, c = map(int, key[1:].split("_"))
        x[r, c] = value
    return x


def _all_neg_inf_row0(n, vocab):
    x = np.ones((n, vocab), dtype=F32)
    x[0] = -np.inf
    return x


_SAMPLE_FAULTS = [
    # (id, op, logits, params, exception, message)
    ("vocab0", np.zeros((2, 0), F32), {}, ValueError,
     "{op}: vocab must be in [1, 2147483647] (tokens are int32), got 0"),
    ("vocab-param0", _m(2, 4), {"vocab": 0}, ValueError,
     "{op}: vocab must be in [1, 2147483647] (tokens are int32), got 0"),
    ("rows-negative", _m(2, 4), {"rows": -1}, ValueError, "{op}: rows must be >= 0, got -1"),
    ("ld-below-vocab", _m(2, 4), {"ld": 3}, ValueError,
     "{op}: row stride ld = 3 is below vocab = 4"),
    ("nan", _rows_with(3, 5, r1_2=np.nan), {}, FloatingPointError,
     "{op}: row 1 of the logits contains NaN"),
    ("nan-before-inf", _rows_with(3, 5, r1_4=np.inf, r2_0=np.nan, r1_0=np.nan), {},
     FloatingPointError, "{op}: row 1 of the logits contains NaN"),
    ("pos-inf", _rows_with(4, 5, r2_3=np.inf), {}, FloatingPointError,
     "{op}: row 2 of the logits contains +inf (its softmax is not defined)"),
    ("all-neg-inf", _all_neg_inf_row0(2, 5), {}, FloatingPointError,
     "{op}: row 0 of the logits has no finite entry"),
]
_OP_PARAMS = {"sample_tokens": {"seed": 3, "step": 1, "top_k": 2, "top_p": 0.5},
              "gumbel_softmax": {"seed": 3, "step": 1, "tau": 0.5, "logit_scale": 1.5}}
SAMPLING_FAULTS = [("%s-%s" % (op, name), op, logits, dict(_OP_PARAMS[op], **extra), exc,
                    message.format(op=op))
                   for op in ("sample_tokens", "gumbel_softmax")
                   for name, logits, extra, exc, message in _SAMPLE_FAULTS]
SAMPLING_FAULTS += [
    ("gumbel_softmax-ldp-below-vocab", "gumbel_softmax", _m(2, 4),
     dict(_OP_PARAMS["gumbel_softmax"], ldp=3), ValueError,
     "gumbel_softmax: probs row stride ldp = 3 is below vocab = 4"),
    ("gumbel_softmax-tau0", "gumbel_softmax", _m(2, 4), dict(_OP_PARAMS["gumbel_softmax"], tau=0.0),
     ValueError, "gumbel_softmax: logit_scale = 1.5 and tau = 0 must be finite and positive"),
    ("gumbel_softmax-scale-negative", "gumbel_softmax", _m(2, 4),
     dict(_OP_PARAMS["gumbel_softmax"], logit_scale=-1.0), ValueError,
     "gumbel_softmax: logit_scale = -1 and tau = 0.5 must be finite and positive"),
]


@pytest.mark.parametrize("op,logits,params,exc,message", [c[1:] for c in SAMPLING_FAULTS],
                         ids=[c[0] for c in SAMPLING_FAULTS])
def test_sampling_ops_refuse_bad_input(backend, op, logits, params, exc, message):
    """Refused by the op itself on every backend, with the same words (the CUDA backend
    reports a row fault at the download that run_op does)."""
    rows = logits.shape[0]
    inputs = (logits, np.arange(rows, dtype=np.uint32), np.arange(rows, dtype=np.uint32))
    with pytest.raises(exc) as info:
        _C.run_op(backend, op, inputs, params)
    assert message in str(info.value)
    # the backend is usable afterwards (on CUDA: the fault was reported once, then cleared)
    fine = np.zeros((2, 4), F32)
    keys = np.arange(2, dtype=np.uint32)
    got = _C.run_op(backend, op, (fine, keys, keys), _OP_PARAMS[op])
    assert (got[0] if op == "sample_tokens" else got).shape[0] == 2


def test_sample_tokens_keeps_ties_at_the_top_k_threshold(backend):
    """top_k = 2 on rows whose 2nd largest value repeats: every entry equal to it stays,
    so more than k entries remain (var_fastvar.md A6.1), and the draws use all of them."""
    row = np.array([3.0, 1.0, 3.0, 2.0, 3.0, 0.0, 3.0, -1.0], dtype=F32)
    n = 4000
    logits = np.tile(row, (n, 1))
    image, position = np.arange(n, dtype=np.uint32) // 50, np.arange(n, dtype=np.uint32) % 50
    tokens, masked = _C.run_op(backend, "sample_tokens", (logits, image, position),
                               {"seed": 5, "step": 2, "top_k": 2})
    kept = row == 3.0
    assert np.array_equal(masked, np.tile(np.where(kept, row, -np.inf).astype(F32), (n, 1)))
    assert set(np.unique(tokens)) == set(np.flatnonzero(kept))


def test_sample_tokens_rows_are_independent(backend):
    """A row's token depends on its logits and its (image, position) key only: the rows in
    another order, or alone, give the same tokens."""
    rng = np.random.default_rng(8)
    logits = randn(rng, 33, 64, scale=2.0)
    image, position = var_keys(rng, 33)
    params = {"seed": 11, "step": 4, "top_k": 20, "top_p": f32(0.9)}
    tokens, masked = _C.run_op(backend, "sample_tokens", (logits, image, position), params)
    perm = rng.permutation(33)
    tokens_p, masked_p = _C.run_op(backend, "sample_tokens",
                                   (logits[perm], image[perm], position[perm]), params)
    assert np.array_equal(tokens_p, tokens[perm]) and np.array_equal(masked_p, masked[perm])
    one, _ = _C.run_op(backend, "sample_tokens", (logits[5:6], image[5:6], position[5:6]), params)
    assert one[0] == tokens[5]


def _chi_square_pvalue(counts, probs):
    from scipy.stats import chi2
    expected = probs * counts.sum()
    statistic = float(((counts - expected) ** 2 / expected).sum())
    return float(chi2.sf(statistic, len(probs) - 1))


@pytest.mark.parametrize("top_k,top_p", [(0, 0.0), (4, 0.0), (0, 0.8), (6, 0.7)],
                         ids=["plain", "top_k4", "top_p0.8", "top_k6-top_p0.7"])
def test_sample_tokens_draws_follow_the_softmax(backend, top_k, top_p):
    """One row of 12 logits sampled under 24000 (image, position) keys: the empirical
    distribution matches the softmax of the surviving logits (chi-square, p > 1e-3; the
    seeds are fixed, so the outcome is fixed too), and no removed entry is ever drawn."""
    row = np.array([1.2, -0.3, 0.8, 2.0, 0.1, -1.5, 1.9, 0.4, -0.8, 1.0, 0.6, 1.5], dtype=F32)
    n = 24000
    logits = np.tile(row, (n, 1))
    image = (np.arange(n) // 120).astype(np.uint32)
    position = (np.arange(n) % 120).astype(np.uint32) * 7 + 3
    params = {"seed": 20240917, "step": 6, "top_k": top_k, "top_p": f32(top_p)}
    tokens, masked = _C.run_op(backend, "sample_tokens", (logits, image, position), params)
    kept = np.isfinite(masked[0])
    assert np.array_equal(np.isfinite(masked), np.tile(kept, (n, 1)))
    # the surviving set from the definition (float64): top-k by value, then top-p
    order = np.argsort(-row.astype(np.float64), kind="stable")
    survivors = np.ones(row.size, bool)
    if top_k:
        survivors[row < row[order[top_k - 1]]] = False
    if top_p:
        p = np.where(survivors, np.exp(row - row.max()), 0.0)
        p /= p.sum()
        ascending = np.argsort(np.where(survivors, row, -np.inf), kind="stable")
        remove = np.cumsum(p[ascending]) <= 1.0 - f32(top_p)
        remove[-1] = False
        survivors[ascending[remove]] = False
    assert np.array_equal(kept, survivors)
    assert survivors.sum() < row.size or (top_k == 0 and top_p == 0.0)
    assert np.all(survivors[tokens]), "a removed entry was sampled"
    counts = np.bincount(tokens, minlength=row.size)[survivors]
    weights = np.exp(row[survivors].astype(np.float64) - row.max())
    assert _chi_square_pvalue(counts, weights / weights.sum()) > 1e-3


def test_sample_tokens_uniform_key_draws_cover_the_vocabulary(backend):
    """Equal logits: each of 64 tokens about equally often over 64000 keys (chi-square),
    and the same keys at another step give other draws (the step is in the counter)."""
    n, vocab = 64000, 64
    logits = np.zeros((n, vocab), F32)
    image = (np.arange(n) % 16).astype(np.uint32)
    position = (np.arange(n) // 16).astype(np.uint32)
    tokens, _ = _C.run_op(backend, "sample_tokens", (logits, image, position), {"seed": 77, "step": 0})
    counts = np.bincount(tokens, minlength=vocab)
    assert _chi_square_pvalue(counts, np.full(vocab, 1.0 / vocab)) > 1e-3
    other, _ = _C.run_op(backend, "sample_tokens", (logits, image, position), {"seed": 77, "step": 1})
    assert np.mean(other == tokens) < 0.05


def test_gumbel_softmax_rows_sum_to_one_and_follow_the_argmax_law(backend):
    """Gumbel-max: argmax_j (l_j + g_j) is distributed as softmax(l); with logit_scale 1
    the argmax of the op's probabilities is that draw (chi-square over 20000 keys), each
    row sums to 1 and removed (-inf) entries get exactly 0."""
    row = np.array([0.5, -1.0, 1.5, 0.0, -np.inf, 1.0, 0.2, -np.inf], dtype=F32)
    n = 20000
    logits = np.tile(row, (n, 1))
    image = (np.arange(n) // 100).astype(np.uint32)
    position = (np.arange(n) % 100).astype(np.uint32)
    probs = _C.run_op(backend, "gumbel_softmax", (logits, image, position),
                      {"seed": 9, "step": 3, "tau": 1.0, "logit_scale": 1.0})
    assert np.all(probs[:, ~np.isfinite(row)] == 0.0)
    assert_close(probs.sum(axis=1, dtype=np.float64), np.ones(n), rtol=0, atol=1e-5,
                 what="row sums")
    finite = np.isfinite(row)
    counts = np.bincount(np.argmax(probs, axis=1), minlength=row.size)[finite]
    weights = np.exp(row[finite].astype(np.float64))
    assert _chi_square_pvalue(counts, weights / weights.sum()) > 1e-3

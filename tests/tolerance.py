"""Element-wise comparison against a reference, the one helper every test uses.

An element passes when |a - ref| <= rtol * |ref| + atol. Normalising by the largest
reference value instead (max |a - ref| / max |ref|) hides every element that is small
next to the largest: the tiny models' head tokens reach ~1e4, so a "1e-5" bar on that
measure allowed an absolute error of ~0.1 in the ordinary ones. Each caller states its
atol and why (usually: the float32 rounding of values near zero, where rtol alone would
demand more than float32 can give).
"""
import numpy as np


def close_report(actual, ref, rtol, atol):
    """(ok, message): the worst element by its share of the allowance, with its index and values."""
    a = np.asarray(actual, np.float64)
    r = np.asarray(ref, np.float64)
    if a.shape != r.shape:
        return False, f"shape {a.shape} != reference shape {r.shape}"
    if a.size == 0:
        return True, "empty"
    if not np.isfinite(a).all():
        bad = np.argwhere(~np.isfinite(a))[0]
        return False, f"non-finite value {a[tuple(bad)]} at {tuple(int(i) for i in bad)}"
    err = np.abs(a - r)
    allowed = rtol * np.abs(r) + atol
    share = err / np.maximum(allowed, 1e-300)
    worst = np.unravel_index(int(np.argmax(share)), a.shape)
    failing = int((err > allowed).sum())
    atol_text = f"{atol:g}" if np.ndim(atol) == 0 else f"per element, {np.min(atol):.3g} to {np.max(atol):.3g}"
    msg = (f"{failing} of {a.size} elements outside rtol={rtol:g}, atol={atol_text}; worst at "
           f"{tuple(int(i) for i in worst)}: got {a[worst]!r}, reference {r[worst]!r}, "
           f"|diff| {err[worst]:.3g} vs allowed {allowed[worst]:.3g}")
    return failing == 0, msg


def assert_close(actual, ref, rtol, atol, what="value"):
    """Asserts |actual - ref| <= rtol * |ref| + atol element by element, naming `what`.
    atol may be an array broadcast against ref (e.g. a per-row float32 scale)."""
    ok, msg = close_report(actual, ref, rtol, atol)
    assert ok, f"{what}: {msg}"


def worst_share(actual, ref, rtol, atol):
    """max over elements of |a - ref| / (rtol * |ref| + atol): <= 1 passes. For mutation
    checks, which need to know by how much a wrong variant misses."""
    a = np.asarray(actual, np.float64)
    r = np.asarray(ref, np.float64)
    return float((np.abs(a - r) / (rtol * np.abs(r) + atol)).max())


def scaled_atol(ref, share, axis=None):
    """share * max |ref| over `axis` (None: the whole array; -1: each row, e.g. each token),
    shaped to broadcast against ref: an absolute tolerance for values whose float32 error
    follows the size of the sums that produce them rather than their own size. An op's
    output element is a sum of products (a GEMM row, a convolution window, an attention
    mix) whose rounding is bounded by the largest terms, which the largest output of the
    same row or array bounds; a token's error follows its largest channel (the x0 chain
    multiplies by ~2e4). Elements near zero then get the allowance their sums warrant
    instead of a relative one that float32 cannot meet."""
    r = np.abs(np.asarray(ref, np.float64))
    if r.size == 0:
        return 0.0
    if axis is None:
        return share * float(r.max())
    return share * r.max(axis=axis, keepdims=True)

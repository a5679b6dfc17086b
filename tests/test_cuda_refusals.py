"""The GPU tests ask the CUDA backend only for what it runs (issue 21, point 1).

No GPU runs in CI, so a GPU test that asks the backend for something it refuses
by design (16-bit attention in the reference mode was one: 28 failures waiting
for the first GPU run) would only show on a GPU. This CPU-only test:

- reads every refusal the CUDA sources can return (`mc_fail(err, MC_ERR_VALUE |
  MC_ERR_INTERNAL, "...")` in csrc/backend/cuda/*.cu) and requires each to be
  the op's own contract (the CPU backend returns the same message, so the CPU
  runs of the same cases would fail in CI), modelled below as a rule on an op's
  arguments (REFUSAL_RULES), or listed with the reason no test parametrisation
  can reach it (NOT_FROM_ARGUMENTS); a new CUDA-only refusal in a .cu fails here
  until it is written down;
- enumerates the parametrisations of the GPU op tests (test_ops.py's CASES as
  test_op runs them on "cuda"; test_cuda_ops_extra.py's reference-kernel, head-dim
  and flash-vs-naive cases), builds each case's inputs as the test does, and fails
  if any rule says the backend would refuse it.

The model tests of test_devices.py reach attention with at most two segments and
never in the reference mode, and their arrays are far below the 32-bit limits, so
the rules below cannot refuse them; they are not enumerated here.
"""
import glob
import os
import re
import zlib

import numpy as np
import pytest

import test_cuda_ops_extra
from test_ops import CASES

HERE = os.path.dirname(os.path.abspath(__file__))
CUDA_DIR = os.path.join(HERE, os.pardir, "csrc", "backend", "cuda")
INT32_MAX = 0x7FFFFFFF
# cuda_attention.cu: #define ATT_MAX_SEGS 16 (the segments travel as one kernel argument).
ATT_MAX_SEGS = 16
# cuda_attention.cu: one flash block per (item, head, ATT_ROWS * warps query rows); the
# tensor-core kernel per 64 rows. batch * heads * nq bounds both grids from above.


def _attention_segments(inputs):
    return [k for k in inputs[1::2]]


def _attention_grid_upper_bound(inputs, params):
    q = inputs[0]
    return q.shape[0] * params["heads"] * q.shape[1]


def _largest_extent(inputs):
    return max((max(np.shape(a)) if np.ndim(a) else 0) for a in inputs)


# message prefix (as in the .cu) -> (where, predicate(op, inputs, params) -> True if refused)
REFUSAL_RULES = {
    "cuda attention: more than %d non-empty K/V segments": (
        "cuda_attention.cu, mc_cuda_attention: the segment list",
        lambda op, inputs, params: op == "attention" and sum(
            1 for k in _attention_segments(inputs) if k.shape[1] > 0) > ATT_MAX_SEGS),
    "cuda attention: %lld blocks exceed the grid limit": (
        "cuda_attention.cu, launch_tc and mc_cuda_attention: 1-D grids",
        lambda op, inputs, params: op == "attention"
        and _attention_grid_upper_bound(inputs, params) > INT32_MAX),
    "cuda gemm: sizes m=%lld n=%lld k=%lld (lda %lld, ldb %lld, ldc %lld) exceed cuBLAS's "
    "32-bit arguments": (
        "cuda_blas.cu, gemm_of_type (gemm, linear, conv2d, conv2d_ex, attention above head dim 128)",
        lambda op, inputs, params: _largest_extent(inputs) > INT32_MAX),
    "cuda linear: sizes rows=%lld in=%lld out=%lld exceed cuBLAS's 32-bit arguments": (
        "cuda_blas.cu, gemm_16bit_weights",
        lambda op, inputs, params: op == "linear" and _largest_extent(inputs) > INT32_MAX),
    "cuda groupnorm: %lld blocks exceed the grid limit": (
        "cuda_conv.cu, mc_cuda_groupnorm: batch * groups * chunks of the group",
        lambda op, inputs, params: op == "groupnorm" and np.size(inputs[0]) > INT32_MAX),
}

# Refusals no op-test parametrisation reaches, and why.
NOT_FROM_ARGUMENTS = {
    "cuda attention: no 16-bit kernel for head dim %d":
        "unreachable: mc_attention_is_16bit admits exactly the head dims 16..128 that "
        "attention_16bit instantiates",
    "attention: no keys to attend to": "run_op refuses an empty key set before the backend",
    "attention: %d heads of dim %d": "run_op checks heads and head_dim before the backend",
    "cuda: %s while recording a graph": "graph recording (models only; the steps then run "
                                        "directly)",
    "cuda: scratch slot %d out of range": "an internal slot index, no argument reaches it",
    "cuda: graphs are off (MARCACHE_CUDA_GRAPHS=0)": "graph recording, models only",
    "cuda: a graph is already being recorded": "graph recording, models only",
    "cuda: graph recording discarded": "graph recording, models only",
    "cuda backend: no usable CUDA device (cudaGetDeviceCount: %s)":
        "the GPU tests skip where no device is usable",
    "cuda backend: device %d does not exist (%d device%s)": "the tests use cuda:0",
    "cosine_rows: heads must be positive": "run_op's param_heads requires heads >= 1",
    "cuda: %s failed: %s": "a CUDA runtime call's own failure (a device fault, a driver error), "
                           "not a refusal of an op's arguments",
    "cublas: %s failed: %s": "a cuBLAS call's own failure, not a refusal of an op's arguments",
    "pool probe: a recording with releases was kept": "the _cuda_pool_probe test hook's own "
                                                      "check, not an op",
    'cuda backend: cuBLAS %d.x could not be loaded; install it with pip install \\"%s\\" (or '
    'set MARCACHE_CUBLAS to a folder with lib/%s). Tried: %s':
        "making a backend without a loadable cuBLAS (test_cuda_build tests the loader)",
}

_FAIL = re.compile(r'mc_fail\(\s*err,\s*MC_ERR_(?:VALUE|INTERNAL),\s*((?:"(?:[^"\\]|\\.)*"\s*)+)')


def cpu_sources_text():
    """The CPU backend's sources: a refusal with the same message there is the op's own
    contract, which the CPU runs of the same cases already exercise in CI."""
    text = []
    for path in sorted(glob.glob(os.path.join(CUDA_DIR, os.pardir, "cpu", "*.c"))):
        with open(path) as f:
            text.append(f.read())
    return "\n".join(text)


def cuda_refusal_messages():
    """Every MC_ERR_VALUE / MC_ERR_INTERNAL message in csrc/backend/cuda/*.cu (adjacent
    string literals joined), with the file it is in."""
    found = {}
    for path in sorted(glob.glob(os.path.join(CUDA_DIR, "*.cu"))):
        with open(path) as f:
            text = f.read()
        for m in _FAIL.finditer(text):
            message = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(1)))
            found.setdefault(message, os.path.basename(path))
    return found


def gpu_parametrisations():
    """(test id, op, inputs, params) for every CUDA parametrisation of the op tests, the
    params as the test passes them to _C.run_op."""
    out = []
    for case in CASES:  # test_ops.test_op on the "cuda" backend
        out.append(("test_op[cuda-%s]" % case.id, case, {}))
    for case in test_cuda_ops_extra.NAIVE_CASES:
        out.append(("test_naive_kernels_match_reference[%s]" % case.id, case, {"naive": True}))
    for case in test_cuda_ops_extra.HEAD_DIM_CASES:
        out.append(("test_attention_head_dims[%s]" % case.id, case, {}))
    for case in (c for c in CASES if c.op == "attention"):  # test_flash_equals_naive
        out.append(("test_flash_equals_naive[%s] (fast)" % case.id, case, {}))
        out.append(("test_flash_equals_naive[%s] (naive)" % case.id, case, {"naive": True}))
    built = []
    for test_id, case, extra in out:
        rng = np.random.default_rng(zlib.crc32(case.id.encode()))  # as run_case does
        inputs, params = case.build(rng)
        built.append((test_id, case.op, inputs, dict(params, **extra)))
    return built


def test_every_cuda_refusal_is_modelled_or_explained():
    messages = cuda_refusal_messages()
    assert messages, "no mc_fail messages found under %s: the scan is broken" % CUDA_DIR
    cpu = cpu_sources_text()
    unknown = {m: f for m, f in messages.items()
               if m not in REFUSAL_RULES and m not in NOT_FROM_ARGUMENTS
               and '"%s"' % m not in cpu}
    assert not unknown, ("refusals in the CUDA sources that this test does not model: add a "
                         "rule to REFUSAL_RULES or a reason to NOT_FROM_ARGUMENTS: %r" % unknown)
    stale = [m for m in list(REFUSAL_RULES) + list(NOT_FROM_ARGUMENTS) if m not in messages]
    assert not stale, "rules for refusals the CUDA sources no longer have: %r" % stale


def test_no_gpu_parametrisation_is_refused():
    refused = []
    for test_id, op, inputs, params in gpu_parametrisations():
        for message, (where, rule) in REFUSAL_RULES.items():
            if rule(op, inputs, params):
                refused.append("%s: %s (%s)" % (test_id, message, where))
    assert not refused, "GPU tests that the CUDA backend would refuse:\n" + "\n".join(refused)


def test_enumeration_reaches_the_16bit_reference_cases():
    """The case the rules exist for: the 14 bf16/fp16 attention cases run in the reference
    mode twice (test_naive_kernels_match_reference and the naive half of
    test_flash_equals_naive). Before attention_naive_16bit existed the backend refused
    these 28; the enumeration must see them for the test above to mean anything."""
    sixteen_bit_naive = [t for t, op, inputs, params in gpu_parametrisations()
                         if op == "attention" and params.get("naive")
                         and params.get("wtype") in ("bf16", "fp16")
                         and (inputs[0].shape[2] // params["heads"]) % 16 == 0]
    assert len(sixteen_bit_naive) == 28, sixteen_bit_naive


@pytest.mark.parametrize("segments,refused", [(ATT_MAX_SEGS, False), (ATT_MAX_SEGS + 1, True)])
def test_segment_rule_refuses_past_the_limit(segments, refused):
    q = np.zeros((1, 2, 8), np.float32)
    kv = np.zeros((1, 3, 8), np.float32)
    inputs = (q,) + (kv, kv) * segments
    rule = REFUSAL_RULES["cuda attention: more than %d non-empty K/V segments"][1]
    assert rule("attention", inputs, {"heads": 1}) is refused

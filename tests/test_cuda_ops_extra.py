"""CUDA-specific behaviour that the table-driven op test (test_ops.py, which
already runs every case on "cuda" when a GPU is present) does not cover:

- the reference kernels: every attention, conv2d and conv2d_ex case of
  test_ops.py again with naive=True (the plain two-pass attention and the
  plain-loop convolutions the fast kernels are checked beside);
- head dims the MAR models do not use but the flash kernel must handle
  (generic path <= 128) and the naive fallback above 128;
- the flash kernel against the naive kernel on the same inputs;
- the memory pool: repeated allocations of the same sizes stop growing it,
  blocks released during a graph recording (any number) come back to it, and
  an impossible allocation is a MemoryError naming its size.

Everything skips without a usable GPU (marcache._C.backends() lacks "cuda").
"""
import os
import subprocess
import sys
import tempfile
import zlib

import numpy as np
import pytest

from marcache import _C
from test_ops import CASES, attention_builder, check_scaled
from child_env import child_env

pytestmark = pytest.mark.skipif("cuda" not in _C.backends(),
                                reason="no usable CUDA device (marcache._C.backends() == %r)"
                                % (_C.backends(),))

NAIVE_OPS = ("attention", "conv2d", "conv2d_ex")
NAIVE_CASES = [c for c in CASES if c.op in NAIVE_OPS]


def run_case(case, extra_params=None, backend="cuda"):
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    inputs, params = case.build(rng)
    params = dict(params, **(extra_params or {}))
    got = _C.run_op(backend, case.op, inputs, params)
    want = np.asarray(case.reference(inputs, params))
    return got, want


@pytest.mark.parametrize("case", NAIVE_CASES, ids=[c.id for c in NAIVE_CASES])
def test_naive_kernels_match_reference(case):
    got, want = run_case(case, {"naive": True})
    assert got.shape == want.shape and np.all(np.isfinite(got))
    check_scaled(got, want, case.tol, "naive %s" % case.id)


class _Case:
    def __init__(self, op, name, build, reference, tol=1e-5):
        self.op, self.id, self.build, self.reference, self.tol = op, name, build, reference, tol


def _attention_case(name, *args, **kw):
    from test_ops import ref_attention
    return _Case("attention", name, attention_builder(*args, **kw), ref_attention)


HEAD_DIM_CASES = [
    _attention_case("hd32-generic", 2, 17, 3, 32, [33, 5]),
    _attention_case("hd8-generic", 1, 5, 2, 8, [7]),
    _attention_case("hd1-generic", 1, 3, 4, 1, [9]),
    _attention_case("hd96-generic", 1, 9, 2, 96, [40]),
    _attention_case("hd128-generic", 2, 20, 2, 128, [31, 2]),
    # head dims above 128 run on cuBLAS (attention_gemm): the VAE's 512, the VQVAE's 640, and
    # batch, heads and segments (an empty one among them) through its loops and score columns
    _attention_case("hd160-gemm", 1, 6, 1, 160, [17]),
    _attention_case("hd512-vae-gemm", 1, 16, 1, 512, [16]),
    _attention_case("hd640-vqvae-gemm", 1, 256, 1, 640, [256]),
    _attention_case("hd192-gemm-b2-h3-segs17-0-5", 2, 9, 3, 192, [17, 0, 5]),
    _attention_case("hd144-gemm-b2-h2-mixed-strides", 2, 5, 2, 144, [17, 1, 9], layout="mixed"),
    _attention_case("hd256-gemm-cache-peaky", 2, 5, 2, 256, [17, 0, 3], layout="cache", magnitude=4.0),
    _attention_case("hd64-q1-many-tiles", 1, 1, 2, 64, [100, 0, 65]),
    _attention_case("hd80-q37-fused", 2, 37, 2, 80, None, layout="fused"),
]


@pytest.mark.parametrize("case", HEAD_DIM_CASES, ids=[c.id for c in HEAD_DIM_CASES])
def test_attention_head_dims(case):
    got, want = run_case(case)
    check_scaled(got, want, case.tol, case.id)


@pytest.mark.parametrize("case", [c for c in CASES if c.op == "attention"],
                         ids=[c.id for c in CASES if c.op == "attention"])
def test_flash_equals_naive(case):
    # Both are fp32 with different summation orders (sequential vs block
    # reductions, online vs two-pass softmax): they agree to the case's
    # tolerance against float64, not bit for bit.
    fast, _ = run_case(case)
    naive, _ = run_case(case, {"naive": True})
    check_scaled(fast, naive.astype(np.float64), case.tol, "flash vs naive %s" % case.id)


def test_pool_reuses_memory():
    sizes = [4, 1000, 1 << 20, 12345, 3 << 20, 1 << 20]
    reserved = _C._cuda_pool_probe(sizes, 6)
    # the device's shared pool (devpool.h): at least the blocks' size classes; other
    # backends on the device may hold more
    assert reserved[0] >= sum(sizes)
    assert reserved[1:] == reserved[:-1], "the pool grew in steady state: %r" % (reserved,)


@pytest.mark.skipif(os.environ.get("MARCACHE_CUDA_GRAPHS") == "0",
                    reason="graph recording is off (MARCACHE_CUDA_GRAPHS=0)")
def test_releases_during_a_recording_are_not_lost():
    # 100 blocks released inside a graph recording (the list of deferred frees held 32 before
    # issue 21 point 4: the rest went to cudaFreeAsync on the capturing stream and were lost
    # with the discarded graph, so the pool grew by 68 MiB per round).
    sizes = [1 << 20] * 100
    reserved = _C._cuda_pool_probe(sizes, 4, True)
    assert reserved[1:] == reserved[:-1], "the pool grew: frees lost in a recording: %r" % (
        reserved,)


def test_sync_after_each_launch_gives_the_same_bits():
    # MARCACHE_CUDA_SYNC=1 (read once per process, hence a subprocess) waits for the device
    # after every launch and cuBLAS call; the arithmetic must not change. (That a fault is
    # then named by its own kernel needs a faulting kernel, which no op can be made into.)
    ids = [next(c.id for c in CASES if c.op == "gemm"),
           next(c.id for c in CASES if c.op == "attention" and c.id.endswith("-bf16"))]
    here = os.path.dirname(os.path.abspath(__file__))
    code = ("import sys, numpy as np; sys.path[:0] = [%r, %r]; import test_cuda_ops_extra as t; "
            "cases = {c.id: c for c in t.CASES}; "
            "np.savez(sys.argv[1], *[t.run_case(cases[i])[0] for i in %r])"
            % (here, os.path.dirname(here), ids))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.npz")
        env = child_env(MARCACHE_CUDA_SYNC="1")
        subprocess.run([sys.executable, "-c", code, path], env=env, check=True, timeout=300,
                       cwd=os.path.dirname(os.path.abspath(__file__)))
        synced = np.load(path)
        cases = {c.id: c for c in CASES}
        for n, case_id in enumerate(ids):
            got, _ = run_case(cases[case_id])
            assert np.array_equal(synced["arr_%d" % n], got), case_id


def test_out_of_memory_is_memory_error_naming_the_size():
    huge = 1 << 50  # 1 PiB
    with pytest.raises(MemoryError, match=str(huge)):
        _C._cuda_pool_probe([huge], 1)
    # The backend is usable afterwards: the failed allocation left no sticky error.
    assert _C._cuda_pool_probe([1024], 2)
    case = next(c for c in CASES if c.op == "gemm")
    got, want = run_case(case)
    check_scaled(got, want, case.tol, "gemm after an out-of-memory error")

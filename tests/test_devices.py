"""Models on every device: the guard backend (host/device discipline, on any
machine), 16-bit Linear weights (dtype="bf16"/"fp16"), and the CUDA backend
against the CPU engine (skips without a GPU; MARCACHE_REQUIRE_CUDA=1 makes
the session fail instead).

The guard backend runs the CPU's ops over memory that is unreadable from the
host between ops (csrc/backend/guard/). A model, VAE, FID network or cache
policy that touches backend memory from host code dies there with SIGSEGV,
where the CUDA backend would read garbage. Each guard run therefore happens
in a subprocess, so a fault is reported as a failing test with its output
instead of killing the session. On the guard the results must equal the
CPU's bit for bit: the same kernels run on the same data."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

import marcache as mc
from marcache import _C
from mar_fixtures import rel_err, write_tiny_mar
from reference import inception as RI
from reference import vae as ref_vae

HERE = os.path.dirname(os.path.abspath(__file__))
HAS_CUDA = "cuda" in _C.backends()

# cache policies of the test model (depth 4, seq 256, buffer 64): each method at its
# defaults with refresh periods short enough to run cached and full steps in 6 AR steps,
# and MARche composed with LazyMAR's condition and head caches.
POLICIES = {
    "nocache": "None",
    "lazymar": "mc.LazyMAR(start=2, period=3)",
    "lazymar-no-head": "mc.LazyMAR(start=2, period=3, head_cache=False)",
    "marche": "mc.MARche(refresh_period=3)",
    "marche+cond+head": "mc.MARche(refresh_period=3, cond_cache=True, head_cache=True)",
}


def child_env():
    """This session's import path (conftest picks the in-place or the installed build)."""
    return dict(os.environ, PYTHONFAULTHANDLER="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


def run_isolated(code, timeout=600):
    """Runs `code` in a fresh interpreter (cwd tests/, this session's import path) and returns
    its last stdout line parsed as JSON; a crash fails the test with its signal and output."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=child_env(), capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        how = ("killed by signal %d" % -proc.returncode) if proc.returncode < 0 else "exit %d" % proc.returncode
        pytest.fail("subprocess %s\n--- stdout\n%s\n--- stderr\n%s" % (how, proc.stdout[-3000:],
                                                                       proc.stderr[-6000:]))
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny_mar(tmp_path_factory):
    path = tmp_path_factory.mktemp("devices") / "tiny_mar.safetensors"
    write_tiny_mar(path, seed=11, depth=4)
    return str(path)


def test_guard_probe_faults_on_host_access():
    """The guard is armed: a backend buffer read through download works, the same buffer
    read directly on the host kills the process. Without this the guard tests prove nothing."""
    assert _C._guard_probe(False) == 42.0
    proc = subprocess.run([sys.executable, "-c", "import marcache; marcache._C._guard_probe(True)"],
                          cwd=HERE, env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == -11, (proc.returncode, proc.stderr[-2000:])


GENERATE_ON = """
import json, sys, numpy as np, marcache as mc
path, device, dtype = {args!r}
model = mc.load(path, device=device, dtype=dtype)
cache = {policy}
tokens, info = model.generate_tokens(labels=[3, 7, 11], steps=6, cfg=2.5, seed=4, cache=cache, return_info=True)
again = model.generate_tokens(labels=[7], steps=6, cfg=2.5, seed=4, first_index=1, cache=cache)
print(json.dumps({{"tokens": tokens.tolist(), "again": again.tolist(),
                  "graph": [s["head_graph"] for s in info.steps]}}))
"""


def generate_on(path, device, dtype, policy):
    """Tokens of a batch, of a call starting at image 1, and per step whether the head's
    diffusion steps ran as a recorded graph, from a fresh process."""
    out = run_isolated(GENERATE_ON.format(args=(path, device, dtype), policy=POLICIES[policy]))
    return np.array(out["tokens"], np.float32), np.array(out["again"], np.float32), out["graph"]


@pytest.mark.parametrize("policy", list(POLICIES))
def test_mar_on_guard_equals_cpu(tiny_mar, policy):
    """Every cache policy keeps host and device memory apart: on the guard backend the
    tokens of a batch and of a call that starts at image 1 equal the CPU's exactly. The guard
    also records the head sampler's later diffusion steps as a graph with CUDA's rules (no
    allocation, upload or download while recording), so this shows the recorded path of
    every policy gives the direct path's bits; the CPU backend has no graphs."""
    cpu, cpu_again, cpu_graph = generate_on(tiny_mar, "cpu", "fp32", policy)
    guard, guard_again, guard_graph = generate_on(tiny_mar, "guard", "fp32", policy)
    assert not any(cpu_graph) and len(guard_graph) == 6 and all(guard_graph)
    assert cpu.shape == (3, 256, 16) and np.all(np.isfinite(cpu))
    np.testing.assert_array_equal(guard, cpu)
    np.testing.assert_array_equal(guard_again, cpu_again)
    assert rel_err(guard_again[0], guard[1]) < 1e-4  # batch invariance (as test_mar)


@pytest.mark.parametrize("fail_at", [1, 40])
def test_failed_graph_recording_falls_back_to_direct_steps(tiny_mar, fail_at, monkeypatch):
    """A recording that fails (here: the guard's test hook fails op N of each recording,
    as CUDA fails one that allocates) is discarded with every buffer as it was, and the
    head's steps then run directly: the same bits as the CPU, head_graph False."""
    cpu, _, _ = generate_on(tiny_mar, "cpu", "fp32", "lazymar")
    monkeypatch.setenv("MARCACHE_GUARD_FAIL_RECORDING", str(fail_at))
    guard, _, graph = generate_on(tiny_mar, "guard", "fp32", "lazymar")
    assert not any(graph)
    np.testing.assert_array_equal(guard, cpu)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mar_16bit_weights_on_guard_equal_cpu(tiny_mar, dtype):
    """The 16-bit weight path (weights rounded at load, the adaLN gate's row offset in
    2-byte elements) keeps device discipline too, for the policy that reads a weight view."""
    cpu, _, _ = generate_on(tiny_mar, "cpu", dtype, "lazymar")
    guard, _, graph = generate_on(tiny_mar, "guard", dtype, "lazymar")
    assert all(graph)
    np.testing.assert_array_equal(guard, cpu)


def test_vae_and_inception_on_guard_equal_cpu(tmp_path):
    vae_w = ref_vae.random_vae_weights(np.random.default_rng(5), ch=32, ch_mult=(1, 2), num_res_blocks=1, z=5)
    vae_path = str(tmp_path / "vae.safetensors")
    save_file({k: np.ascontiguousarray(v) for k, v in vae_w.items()}, vae_path)
    inc_path = str(tmp_path / "inception.safetensors")
    save_file(RI.random_weights(np.random.default_rng(6), divisor=16, num_classes=10), inc_path)
    code = """
import json, numpy as np, marcache as mc
import marcache.eval
from marcache import _C
rng = np.random.default_rng(0)
tokens = (0.2325 * rng.standard_normal((2, 64, 5))).astype(np.float32)
images = rng.integers(0, 256, (3, 75, 75, 3), dtype=np.uint8)
out = {}
for device in ("cpu", "guard"):
    vae = _C.VAE(%r, device=device)
    net = mc.eval.InceptionV3.load(%r, device=device, chunk=2)
    pool, logits = net._net.features(images)
    out[device] = [vae.decode(tokens).tolist(), pool.tolist(), logits.tolist()]
print(json.dumps(out))
""" % (vae_path, inc_path)
    out = run_isolated(code)
    for cpu, guard in zip(out["cpu"], out["guard"]):
        cpu, guard = np.array(cpu), np.array(guard)
        assert cpu.size > 0 and np.all(np.isfinite(cpu))
        np.testing.assert_array_equal(guard, cpu)


# ----- 16-bit weights ----------------------------------------------------------------------

def test_16bit_weights_keep_the_digits_model_close_to_fp32():
    """On the shipped trained model (marcache/data), 16-bit Linear weights and attention move
    the images by the size of 16-bit rounding, fp16 (11-bit significand) less than bf16
    (8-bit). Measured: PSNR against fp32 26.4 dB (bf16) and 34.1 dB (fp16) on these 50 digits
    (28.7 and 41.3 dB with 16-bit Linear layers only); a wrong weight offset or an unconverted
    weight gives noise (below 10 dB). (Random-weight models are no use here: their tokens
    reach 1e4-1e5, past fp16's range, as autocast's would.)"""
    from marcache import digits

    labels = np.repeat(np.arange(10), 5)
    ref = digits.load_model().generate(labels=labels, steps=16, cfg=2.0, seed=0).astype(np.float64)
    psnr = {}
    for dtype in ("bf16", "fp16"):
        model = mc.load(digits.MODEL_PATH, dtype=dtype)
        assert model.dtype == dtype and "dtype='%s'" % dtype in repr(model)
        got = model.generate(labels=labels, steps=16, cfg=2.0, seed=0).astype(np.float64)
        assert not np.array_equal(got, ref)
        psnr[dtype] = 10 * np.log10(255.0 ** 2 / np.mean((got - ref) ** 2))
    assert 22.0 < psnr["bf16"] < psnr["fp16"] and psnr["fp16"] > 30.0, psnr


def test_16bit_model_matches_rounded_reference(tmp_path, monkeypatch):
    """The MAR transformer and head with bf16 weights follow the float64 reference in which
    every Linear rounds its input and weight to bf16 and attention rounds q, k, v and the
    probabilities (autocast's arithmetic) far more closely than the plain float64 model: the
    dtype changes exactly the arithmetic it says. (The remaining difference: float32 and
    float64 values that straddle a bf16 rounding boundary round to neighbouring values.)"""
    from reference import mar as R
    from reference import ops as ref_ops

    path = tmp_path / "m.safetensors"
    W = write_tiny_mar(path, seed=2)
    model = mc.load(path, dtype="bf16")
    rng = np.random.default_rng(3)
    B, S, C = 2, 256, 16
    tokens = rng.standard_normal((B, S, C)).astype(np.float32)
    mask = np.zeros((B, S), np.uint8)
    for b in range(B):
        mask[b, rng.permutation(S)[:100]] = 1
    labels = np.array([5, 9], np.int32)
    z = model._mar.transformer(tokens, mask, labels)
    x = rng.standard_normal((6, C)).astype(np.float32)
    t_index = 37
    t = model.timesteps[t_index]
    head = model._mar.head(x, z[0, :6], t_index)

    plain_z = R.transformer(W, tokens, mask, labels, heads=2, cfg_on=False)
    plain_head = R.head_net(W, x, t, z[0, :6])
    linear64 = ref_ops.linear

    def autocast_linear(x, w, bias=None, **kw):
        return linear64(ref_ops.round_to_wtype(np.asarray(x, np.float32), "bf16"),
                        ref_ops.round_to_wtype(w, "bf16"), bias, **kw)

    attention64 = ref_ops.attention

    def autocast_attention(q, segments, heads, scale=None):
        return attention64(q, segments, heads, scale, wtype="bf16")

    monkeypatch.setattr(R.ops, "linear", autocast_linear)
    monkeypatch.setattr(R.ops, "attention", autocast_attention)
    want_z = R.transformer(W, tokens, mask, labels, heads=2, cfg_on=False)
    want_head = R.head_net(W, x, t, z[0, :6])
    for got, want, plain in ((z, want_z, plain_z), (head, want_head, plain_head)):
        err, err_plain = rel_err(got, want), rel_err(got, plain)
        assert err < 2e-3 and err < err_plain / 4, (err, err_plain)


# ----- CUDA against the CPU engine (needs a GPU) --------------------------------------------

cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="no usable CUDA device (marcache._C.backends() == %r)"
                               % (_C.backends(),))


@cuda_only
@pytest.mark.parametrize("policy", ["nocache", "lazymar", "marche"])
def test_cuda_tokens_match_cpu(tiny_mar, policy):
    """Issue #8: a tiny model's tokens on CUDA (fp32, TF32 off) match the CPU engine's
    within 1e-4 for NoCache, LazyMAR and MARche (same Philox noise on both)."""
    cache = eval(POLICIES[policy])
    cpu = mc.load(tiny_mar, device="cpu").generate_tokens(labels=[3, 7, 11], steps=6, cfg=2.5, seed=4, cache=cache)
    gpu = mc.load(tiny_mar, device="cuda").generate_tokens(labels=[3, 7, 11], steps=6, cfg=2.5, seed=4, cache=cache)
    assert rel_err(gpu, cpu) <= 1e-4


@cuda_only
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_cuda_16bit_matches_cpu_emulation(tiny_mar, dtype):
    """The tensor-core path computes what the CPU emulation computes: the same rounded
    operands, float32 sums in another order, and attention probabilities rounded before
    normalisation (per 64-key tile) on the GPU, after it on the CPU. Bounded by the op test's
    16-bit attention bounds (bf16 2e-2, fp16 4e-3)."""
    cpu = mc.load(tiny_mar, dtype=dtype).generate_tokens(labels=[3, 7], steps=6, cfg=2.5, seed=4)
    gpu = mc.load(tiny_mar, device="cuda", dtype=dtype).generate_tokens(labels=[3, 7], steps=6, cfg=2.5, seed=4)
    assert rel_err(gpu, cpu) <= {"bf16": 2e-2, "fp16": 4e-3}[dtype]


@cuda_only
def test_cuda_vae_and_model_stay_usable_after_errors(tiny_mar):
    model = mc.load(tiny_mar, device="cuda")
    with pytest.raises(ValueError):
        model.generate_tokens(labels=[5000])
    a = model.generate_tokens(labels=[1], steps=2, seed=3)
    b = model.generate_tokens(labels=[1], steps=2, seed=3)
    np.testing.assert_array_equal(a, b)


@cuda_only
@pytest.mark.parametrize("policy", ["nocache", "lazymar"])
def test_cuda_head_graph_equals_direct_launches(tiny_mar, policy):
    """The head sampler's 99 later diffusion steps run as one recorded CUDA graph (step
    telemetry says so), with the same bits as launching the same kernels one by one
    (MARCACHE_CUDA_GRAPHS=0, read when the backend is made)."""
    code = """
import json, numpy as np, marcache as mc
model = mc.load(%r, device="cuda")
tokens, info = model.generate_tokens(labels=[3, 7], steps=6, cfg=2.5, seed=4, cache=%s, return_info=True)
print(json.dumps({"tokens": tokens.tolist(), "graph": [s["head_graph"] for s in info.steps]}))
""" % (tiny_mar, POLICIES[policy])
    with_graphs = run_isolated(code)
    os.environ["MARCACHE_CUDA_GRAPHS"] = "0"
    try:
        direct = run_isolated(code)
    finally:
        del os.environ["MARCACHE_CUDA_GRAPHS"]
    assert all(with_graphs["graph"]) and not any(direct["graph"])
    np.testing.assert_array_equal(np.array(with_graphs["tokens"]), np.array(direct["tokens"]))


@pytest.mark.parametrize("device", ["cpu", "guard"] + (["cuda"] if HAS_CUDA else []))
@pytest.mark.parametrize("policy", ["nocache", "lazymar", "marche+cond+head"])
def test_no_backend_allocation_inside_the_ar_loop(tiny_mar, device, policy):
    """Once a batch size has been seen, an AR loop allocates no backend memory: the count of
    backend allocations (weights, workspace, caches, scratch) read at every step callback of
    a second identical call stays where the step before left it. (A cache policy's state is
    made before the loop of each call.)"""
    model = mc.load(tiny_mar, device=device)
    cache = eval(POLICIES[policy])
    kwargs = dict(labels=[3, 7], steps=6, cfg=2.5, seed=4, cache=cache)
    model.generate_tokens(**kwargs)
    seen = []
    model._mar.generate(np.array([3, 7], np.int32), steps=6, cfg=2.5, seed=4,
                        cache=None if cache is None else cache.as_dict(rows=320),
                        callback=lambda info: seen.append(model._mar.backend_allocations))
    assert len(seen) == 6 and len(set(seen)) == 1, seen


@pytest.mark.parametrize("device", ["cpu", "guard"] + (["cuda"] if HAS_CUDA else []))
@pytest.mark.parametrize("policy", ["nocache", "lazymar", "marche", "marche+cond+head"])
def test_host_waits_only_where_a_policy_needs_rows(tiny_mar, device, policy):
    """Issue #8: no host sync inside an AR step except where the policy truly needs a count.
    Counted as the CUDA backend waits (every download, uploads over 1 MiB): a full step
    waits never, a cached LazyMAR or MARche step exactly once (the row scores it ranks on
    the host), and the tokens come back once after the loop."""
    model = mc.load(tiny_mar, device=device)
    cache = eval(POLICIES[policy])
    before = model._mar.backend_syncs
    seen, full = [], []

    def on_step(info):
        seen.append(model._mar.backend_syncs)
        full.append(info["full"])

    model._mar.generate(np.array([3, 7], np.int32), steps=6, cfg=2.5, seed=4,
                        cache=None if cache is None else cache.as_dict(rows=320), callback=on_step)
    waits = np.diff([before] + seen)
    assert list(waits) == [0 if f else 1 for f in full], (list(waits), full)
    assert (policy == "nocache") == all(full)
    assert model._mar.backend_syncs == seen[-1] + 1

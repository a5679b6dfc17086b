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
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

import marcache as mc
from marcache import _C
from mar_fixtures import write_tiny_mar
from tolerance import assert_close, scaled_atol, worst_share
from reference import inception as RI
from reference import vae as ref_vae
from child_env import child_env

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


def run_isolated(code, timeout=600):
    """Runs `code` in a fresh interpreter (cwd tests/, this session's import path) and returns
    its last stdout line parsed as JSON; a crash fails the test with its signal and output."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=child_env(PYTHONFAULTHANDLER="1"),
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        how = ("killed by signal %d" % -proc.returncode) if proc.returncode < 0 else "exit %d" % proc.returncode
        pytest.fail("subprocess %s\n--- stdout\n%s\n--- stderr\n%s" % (how, proc.stdout[-3000:],
                                                                       proc.stderr[-6000:]))
    return json.loads(proc.stdout.strip().splitlines()[-1])


TINY_MAR_HEADS = 2  # write_tiny_mar's default, stored in the file's metadata


@pytest.fixture(scope="module")
def tiny_mar(tmp_path_factory):
    path = tmp_path_factory.mktemp("devices") / "tiny_mar.safetensors"
    write_tiny_mar(path, seed=11, depth=4, heads=TINY_MAR_HEADS)
    return str(path)


def test_guard_probe_faults_on_host_access():
    """The guard is armed: a backend buffer read through download works, the same buffer
    read directly on the host kills the process. Without this the guard tests prove nothing."""
    assert _C._guard_probe(False) == 42.0
    proc = subprocess.run([sys.executable, "-c", "import marcache; marcache._C._guard_probe(True)"],
                          cwd=HERE, env=child_env(PYTHONFAULTHANDLER="1"), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -11, (proc.returncode, proc.stderr[-2000:])


# The two calls of GENERATE_ON: a batch, and image 1 alone (first_index=1).
GENERATE_CALLS = (dict(labels=[3, 7, 11], first_index=0), dict(labels=[7], first_index=1))
GENERATE_ARGS = dict(steps=6, cfg=2.5, seed=4)

GENERATE_ON = """
import json, sys, numpy as np, marcache as mc
path, device, dtype, calls, kw = {args!r}
model = mc.load(path, device=device, dtype=dtype)
cache = {policy}
out = {{"tokens": [], "rows": [], "graph": []}}
for call in calls:
    tokens, info = model.generate_tokens(cache=cache, return_info=True, trace_rows=True, **call, **kw)
    out["tokens"].append(tokens.tolist())
    out["rows"].append([s["kept_rows"].tolist() if "kept_rows" in s else None for s in info.steps])
    out["graph"].append([s["head_graph"] for s in info.steps])
print(json.dumps(out))
"""


class Run:
    """One device's GENERATE_ON: tokens of the batch (.tokens) and of image 1 alone
    (.again), per call the decoder rows each cached step kept or made active (.rows: per
    step None or [sequences][rows]), and per step of the batch whether the head's diffusion
    steps ran as a recorded graph (.graph)."""

    def __init__(self, out):
        self.tokens, self.again = (np.array(t, np.float32) for t in out["tokens"])
        self.rows = out["rows"]
        self.graph = out["graph"][0]


def generate_on(path, device, dtype, policy):
    """The Run of `policy` on `device` from a fresh process."""
    return Run(run_isolated(GENERATE_ON.format(
        args=(path, device, dtype, GENERATE_CALLS, GENERATE_ARGS), policy=POLICIES[policy])))


# ----- comparing tokens where a ranking can flip (LazyMAR, MARche) ----------------------------
#
# LazyMAR keeps and MARche makes active the decoder rows that rank highest by a score; two
# runs that compute the scores in other summation orders or roundings (CUDA against the CPU,
# bf16 against fp32) can rank two rows differently where their scores are within that
# perturbation: a near tie. The rows then differ, and the image's tokens with them, without
# either run being wrong. This is the rule the CPU tests use for sampling near ties
# (test_var_generate, test_fastvar: tokens may differ only where the float64 reference finds
# the decision within a window of flipping), applied to the row selection, which the engine
# reports (trace_rows=True: "kept_rows" per cached step):
# - where the two runs' selections for an image first differ, at step k, the float64
#   reference must find that step's selection of the image within TIE_WINDOW of flipping
#   (its smallest boundary gap over the image's cached sequences: select_gaps in
#   reference/lazymar.py and marche.py). A difference away from a near tie fails: one side
#   scores or selects wrongly. (Later differences of that image follow from the first.)
# - an image whose selections agree at every step must match within the token bound;
# - an image with a selection difference at a near tie is compared within FLIP_SHARE.
# The windows: the score perturbation of the compared runs, with a factor 10 of margin.
# fp32: float32 sums in other orders, relative ~1e-6 of scores of order 1 (LazyMAR's
# cosines, MARche's relative relevance gaps): 1e-5. bf16: q, k, v rounded to 8 significant
# bits (2^-9 = 2e-3 each; a cosine or a softmax relevance moves by a few times that): 5e-2.
# Measured on the CPU for this model (tests here): the reference's LazyMAR gaps at its two
# cached steps are 5e-7 to 1.1e-5, far below the bf16 window, and the bf16 emulation's
# selections differ from fp32's for every image at those steps; its tokens still stay within
# 3.9e-3 of each token's largest channel of fp32 (GENERATE_SHARE's measurement below, which
# therefore includes the effect of those flips). A flip at a near tie on this model moves the
# tokens by no more than that: FLIP_SHARE = 1e-2, the bf16 bound.
TIE_WINDOW = {"fp32": 1e-5, "bf16": 5e-2}
FLIP_SHARE = 1e-2


def first_selection_differences(rows_a, rows_b, n_images):
    """{image: step} of the first step at which the two runs' selections for the image
    differ. rows_*: per step None (a full step) or [sequences][rows]; cached sequence s
    belongs to image s % n_images (the conditional sequences first, then, without the
    condition cache, the unconditional ones, as the engine and the reference order them)."""
    first = {}
    assert len(rows_a) == len(rows_b)
    for step, (a, b) in enumerate(zip(rows_a, rows_b)):
        assert (a is None) == (b is None), "step %d is cached in one run only" % step
        if a is None:
            continue
        a, b = np.asarray(a), np.asarray(b)
        for s in range(max(len(a), len(b))):
            if a.shape != b.shape or not np.array_equal(a[s], b[s]):
                first.setdefault(s % n_images, step)
    return first


def assert_tokens_match_near_ties_aside(got, want, rows_got, rows_want, share, window,
                                        reference_gaps, what):
    """got, want: tokens [N, S, C] of two runs of one call; rows_*: their selections per
    step; reference_gaps(): {(step, image): smallest reference boundary gap}, asked only when
    selections differ. Returns the images whose selections differed (at near ties)."""
    n = len(want)
    first = first_selection_differences(rows_got, rows_want, n)
    if first:
        gaps = reference_gaps()
        away = {i: (k, gaps.get((k, i), np.inf)) for i, k in first.items()
                if not gaps.get((k, i), np.inf) < window}
        assert not away, ("%s: selections differ away from a near tie (image: (step, reference "
                          "gap)) %r, window %g" % (what, away, window))
    flipped = sorted(first)
    agreed = [i for i in range(n) if i not in first]
    for images, bound, how in ((agreed, share, "selections agree"),
                               (flipped, max(share, FLIP_SHARE), "selections differ at a near tie")):
        if images:
            assert_close(got[images], want[images], 0.0, per_token_atol(want[images], bound),
                         "%s, images %s (%s; atol %g of each token's largest channel)"
                         % (what, images, how, bound))
    return flipped


def reference_gaps_of(tiny_mar_path, policy, call):
    """reference_gaps for assert_tokens_match_near_ties_aside: the float64 reference of
    `policy` (LazyMAR or MARche) on the test model for one GENERATE_CALLS entry."""
    def run():
        from safetensors.numpy import load_file
        from reference import lazymar as LZ
        from reference import mar as R
        from reference import marche as MC

        W = load_file(tiny_mar_path)
        cache = eval(POLICIES[policy], {"mc": mc})
        if isinstance(cache, mc.LazyMAR):
            generate = LZ.generate_tokens_lazymar
        else:  # the reference reads the budget the engine resolves (P + S = 320 rows here)
            generate = MC.generate_tokens_marche
            cache = dataclasses.replace(cache, budget=cache.budget_for(320))
        labels = np.array(call["labels"])
        _, log = generate(W, labels, len(labels), GENERATE_ARGS["steps"], GENERATE_ARGS["cfg"], "linear", 1.0,
                          GENERATE_ARGS["seed"], call["first_index"], TINY_MAR_HEADS, cache, R.diffusion_tables(100))
        gaps = {}
        for entry in log:
            for s, gap in enumerate(entry.get("select_gaps") or ()):
                key = (entry["step"], s % len(labels))
                gaps[key] = min(gaps.get(key, np.inf), gap)
        return gaps
    return run


@pytest.mark.parametrize("policy", list(POLICIES))
def test_mar_on_guard_equals_cpu(tiny_mar, policy):
    """Every cache policy keeps host and device memory apart: on the guard backend the
    tokens of a batch and of a call that starts at image 1 equal the CPU's exactly. The guard
    also records the head sampler's later diffusion steps as a graph with CUDA's rules (no
    allocation, upload or download while recording), so this shows the recorded path of
    every policy gives the direct path's bits. The CPU records and replays them too, on one
    team (tests/test_cpu_graphs.py compares that with its direct calls)."""
    cpu = generate_on(tiny_mar, "cpu", "fp32", policy)
    guard = generate_on(tiny_mar, "guard", "fp32", policy)
    assert all(cpu.graph) and len(guard.graph) == 6 and all(guard.graph)
    assert cpu.tokens.shape == (3, 256, 16) and np.all(np.isfinite(cpu.tokens))
    np.testing.assert_array_equal(guard.tokens, cpu.tokens)
    np.testing.assert_array_equal(guard.again, cpu.again)
    assert guard.rows == cpu.rows
    # batch invariance (as test_mar): within 1e-4 of each token's largest channel
    assert_close(guard.again[0], guard.tokens[1], rtol=0.0, atol=scaled_atol(guard.tokens[1], 1e-4, axis=-1),
                 what="image 1 alone vs in a batch")
    # The comparison test_cuda_generate_matches_cpu makes, here where the selections agree
    # (equal bits): every image is compared, the reference is never asked.
    for got, want, rows_got, rows_want, call in ((guard.tokens, cpu.tokens, guard.rows[0], cpu.rows[0],
                                                  GENERATE_CALLS[0]),
                                                 (guard.again, cpu.again, guard.rows[1], cpu.rows[1],
                                                  GENERATE_CALLS[1])):
        excused = assert_tokens_match_near_ties_aside(
            got, want, rows_got, rows_want, GENERATE_SHARE["fp32"], TIE_WINDOW["fp32"],
            lambda: pytest.fail("the reference was asked although the selections agree"),
            "%s guard vs cpu" % policy)
        assert excused == []
    cached_steps = [r for r in cpu.rows[0] if r is not None]
    assert (len(cached_steps) > 0) == (policy != "nocache")


@pytest.mark.parametrize("policy,call", [("lazymar", 1), ("marche", 0)])
def test_near_tie_rule_on_cpu_bf16_against_fp32(tiny_mar, policy, call):
    """The near-tie rule of test_cuda_generate_matches_cpu on a perturbation that does flip
    selections, so that each branch of it runs here: the CPU's bf16 emulation against its
    fp32 run (measured: LazyMAR, image 1 alone, first differs at step 4; MARche, the batch,
    image 2 at step 1). The differences must be at near ties of the float64 reference, and
    the tokens within the bounds; with a window no gap is below, the same data fails."""
    fp32 = generate_on(tiny_mar, "cpu", "fp32", policy)
    bf16 = generate_on(tiny_mar, "cpu", "bf16", policy)
    got, want = (bf16.tokens, fp32.tokens) if call == 0 else (bf16.again, fp32.again)
    gaps = reference_gaps_of(tiny_mar, policy, GENERATE_CALLS[call])
    asked = []

    def counted_gaps():
        asked.append(1)
        if len(asked) == 1:
            counted_gaps.value = gaps()
        return counted_gaps.value

    flipped = assert_tokens_match_near_ties_aside(
        got, want, bf16.rows[call], fp32.rows[call], GENERATE_SHARE["bf16"], TIE_WINDOW["bf16"],
        counted_gaps, "%s bf16 vs fp32 on the cpu" % policy)
    assert flipped and asked, "no selection differed: the near-tie branch did not run"
    with pytest.raises(AssertionError, match="away from a near tie"):
        assert_tokens_match_near_ties_aside(got, want, bf16.rows[call], fp32.rows[call],
                                            GENERATE_SHARE["bf16"], 1e-12, counted_gaps, "window 1e-12")


def test_near_tie_rule_compares_tokens_where_selections_agree():
    """Where the selections agree the token bound applies in full, and where they differ the
    flip bound; a token off by more fails either way (synthetic runs: 2 images, one cached
    step, image 1's rows differ at a reference gap of 1e-7)."""
    rng = np.random.default_rng(0)
    want = rng.standard_normal((2, 4, 3)).astype(np.float32)
    rows_a = [None, [[0, 1, 2], [0, 1, 2]]]
    rows_b = [None, [[0, 1, 2], [0, 1, 3]]]
    gaps = lambda: {(1, 0): 0.5, (1, 1): 1e-7}  # noqa: E731
    assert first_selection_differences(rows_a, rows_b, 2) == {1: 1}
    assert assert_tokens_match_near_ties_aside(want.copy(), want, rows_a, rows_b, 1e-4, 1e-5,
                                               gaps, "equal") == [1]
    for image, offset in ((0, 1e-3), (1, 0.1)):  # 1e-3 > the 1e-4 bound; 0.1 > FLIP_SHARE
        got = want.copy()
        got[image, 2, 1] += offset * np.abs(want[image, 2]).max()
        with pytest.raises(AssertionError, match="images \\[%d\\]" % image):
            assert_tokens_match_near_ties_aside(got, want, rows_a, rows_b, 1e-4, 1e-5, gaps, "off")


@pytest.mark.parametrize("fail_at", [1, 40])
def test_failed_graph_recording_falls_back_to_direct_steps(tiny_mar, fail_at, monkeypatch):
    """A recording that fails (here: the guard's test hook fails op N of each recording,
    as CUDA fails one that allocates) is discarded with every buffer as it was, and the
    head's steps then run directly: the same bits as the CPU, head_graph False."""
    cpu = generate_on(tiny_mar, "cpu", "fp32", "lazymar")
    monkeypatch.setenv("MARCACHE_GUARD_FAIL_RECORDING", str(fail_at))
    guard = generate_on(tiny_mar, "guard", "fp32", "lazymar")
    assert not any(guard.graph)
    np.testing.assert_array_equal(guard.tokens, cpu.tokens)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mar_16bit_weights_on_guard_equal_cpu(tiny_mar, dtype):
    """The 16-bit weight path (weights rounded at load, the adaLN gate's row offset in
    2-byte elements) keeps device discipline too, for the policy that reads a weight view."""
    cpu = generate_on(tiny_mar, "cpu", dtype, "lazymar")
    guard = generate_on(tiny_mar, "guard", dtype, "lazymar")
    assert all(guard.graph)
    np.testing.assert_array_equal(guard.tokens, cpu.tokens)


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
        # within 2e-3 of the largest output against the rounded reference, and at least 4x
        # closer to it than to the unrounded one (scaled_atol: a layer's error follows its sums)
        share = worst_share(got, want, 0.0, scaled_atol(want, 2e-3))
        share_plain = worst_share(got, plain, 0.0, scaled_atol(plain, 2e-3))
        assert share < 1 and share < share_plain / 4, (share, share_plain)


# ----- CUDA against the CPU engine (needs a GPU) --------------------------------------------

cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="no usable CUDA device (marcache._C.backends() == %r)"
                               % (_C.backends(),))


def per_token_atol(tokens, share):
    """`share` of each token's largest |channel| (tokens [..., channels]), as the CPU tests
    bound tokens: the random models' tokens span 1e-3..1e5, so one scale for all would let
    the small ones drift unseen."""
    t = np.asarray(tokens, np.float64)
    return share * np.abs(t).max(axis=-1, keepdims=True)


# Bounds of CUDA against the CPU over a whole generate (6 AR steps x 100 diffusion steps of
# tiny_mar), per token, as a share of its largest channel:
# - fp32: both sides round every op to float32 in other summation orders (cuBLAS, block
#   reductions) and nothing else; 1e-4, ten times the CPU engine's bound against the float64
#   reference (1e-5 of each token's largest channel, test_lazymar_reference).
# - bf16: the GPU rounds the attention probabilities before normalising (per 64-key tile),
#   the CPU emulation after (both allowed by ops.h), and sums in other orders. Both are bf16
#   perturbations of the same fp32 run; measured on the CPU, the emulation's tokens differ
#   from fp32 by at most 3.9e-3 of a token's largest channel over the policies of POLICIES
#   (median 3.4e-4; nocache 3.1e-3, lazymar 3.3e-3, lazymar-no-head 3.9e-3, marche 3.4e-3,
#   marche+cond+head 2.9e-3). By the triangle inequality the GPU's bf16 run, a perturbation
#   of the same kind and size, is within twice that of the emulation: 7.8e-3, bound 1e-2.
#   (The single-op bound 2e-2 of max|ref| used before allowed far more on small tokens.)
#   A cached step's row ranking can flip where two scores tie within that perturbation; the
#   engine does not report its selection margin, so a flip would show here as a failure to
#   be read with the step telemetry (the CPU reference tests assert their margins > 1e-6).
# fp16 is not run on tiny_mar: its random weights give tokens up to 8.6e4, past fp16's
# range (65504), on the CPU emulation as on the GPU (inf/NaN); see the digits test below.
GENERATE_SHARE = {"fp32": 1e-4, "bf16": 1e-2}


@cuda_only
@pytest.mark.parametrize("dtype", list(GENERATE_SHARE))
@pytest.mark.parametrize("policy", list(POLICIES))
def test_cuda_generate_matches_cpu(tiny_mar, policy, dtype):
    """Issue 21 point 8: a whole generate on CUDA against the CPU engine (the same Philox
    noise; TF32 off) for every cache policy, in fp32 and bf16, element-wise per token."""
    cpu = generate_on(tiny_mar, "cpu", dtype, policy)
    gpu = generate_on(tiny_mar, "cuda", dtype, policy)
    assert all(gpu.graph), "the head's later diffusion steps did not run as a recorded graph"
    share = GENERATE_SHARE[dtype]
    # Where LazyMAR or MARche rank two rows within the runs' perturbation of a tie, the rows
    # kept may differ and so may that image's tokens: the near-tie rule above.
    for got, want, rows_got, rows_want, call, what in (
            (gpu.tokens, cpu.tokens, gpu.rows[0], cpu.rows[0], GENERATE_CALLS[0], "batch"),
            (gpu.again, cpu.again, gpu.rows[1], cpu.rows[1], GENERATE_CALLS[1], "image 1 alone")):
        excused = assert_tokens_match_near_ties_aside(
            got, want, rows_got, rows_want, share, TIE_WINDOW[dtype],
            reference_gaps_of(tiny_mar, policy, call),
            "%s %s tokens of the %s, cuda vs cpu" % (policy, dtype, what))
        if excused:
            print("%s %s %s: images %s excused at near ties" % (policy, dtype, what, excused))


@cuda_only
@pytest.mark.parametrize("dtype,min_psnr", [("bf16", 20.0), ("fp16", 28.0)])
def test_cuda_16bit_digits_images_match_cpu_emulation(dtype, min_psnr):
    """fp16 (and bf16) whole generates on the trained digits model, whose tokens stay in
    fp16's range. Its sampling amplifies small differences in individual tokens (bf16 vs
    fp32 on the CPU: some tokens move by 28x their largest channel, median 2.3e-3), so the
    comparison is in image space, as test_16bit_weights_keep_the_digits_model_close_to_fp32
    does: there the CPU emulation's images are 26.4 dB (bf16) and 34.1 dB (fp16) from fp32.
    The GPU's 16-bit run is a perturbation of the same kind (ops.h), so by the triangle
    inequality on the RMS difference it is within 6.02 dB less of the emulation: 20.4 and
    28.1 dB; the bounds are 20 and 28 dB."""
    from marcache import digits

    labels = np.repeat(np.arange(10), 5)
    kw = dict(labels=labels, steps=16, cfg=2.0, seed=0)
    cpu = mc.load(digits.MODEL_PATH, dtype=dtype).generate(**kw).astype(np.float64)
    gpu = mc.load(digits.MODEL_PATH, device="cuda", dtype=dtype).generate(**kw).astype(np.float64)
    psnr = 10 * np.log10(255.0 ** 2 / max(np.mean((gpu - cpu) ** 2), 1e-12))
    assert psnr > min_psnr, "%s images, cuda vs cpu emulation: %.1f dB" % (dtype, psnr)


@cuda_only
def test_cuda_generate_wraps_the_upload_ring(tiny_mar):
    """A batch whose per-step index lists (1000 images x 256 rows x 4 bytes, just under the
    1 MiB staging limit of ops.h) fill the 8 MiB pinned upload ring within a few AR steps of
    NoCache, whose full steps otherwise never wait: the ring must wrap (a wait shows in the
    step's sync count) and the tokens still equal the CPU's (images 0..2, batch invariance)."""
    labels = (np.arange(1000) * 7) % 1000
    model = mc.load(tiny_mar, device="cuda")
    waits, before = [], [model._mar.backend_syncs]

    def on_step(info):
        waits.append(model._mar.backend_syncs - before[-1])
        before.append(model._mar.backend_syncs)

    gpu, _ = model._mar.generate(labels.astype(np.int32), steps=16, cfg=2.5, seed=4,
                                 cache=None, callback=on_step)
    assert sum(waits) > 0, "the upload ring never wrapped: %r" % (waits,)
    cpu, _ = mc.load(tiny_mar, device="cpu")._mar.generate(labels[:3].astype(np.int32), steps=16,
                                                          cfg=2.5, seed=4, cache=None)
    share = GENERATE_SHARE["fp32"]
    assert_close(np.asarray(gpu)[:3], cpu, 0.0, per_token_atol(cpu, share),
                 "tokens of a ring-wrapping batch, cuda vs cpu")


# The VAE at the real decoder's widths where it matters: a 512-channel mid block (one
# 512-wide attention head over 16 x 16 = 256 positions, the naive CUDA kernel's case) on the
# real 16 x 16 x 16 latent. Both sides are float32 in other summation orders through ~10
# convolutions of up to 512 x 9 terms and GroupNorms (statistics in double on both): per
# sum about sqrt(4608) * 6e-8 = 4e-6 relative, compounded over the layers; bound 1e-4 of the
# image's largest |value| (unmeasured: no GPU has run it).
VAE_SHARE = 1e-4


@cuda_only
def test_cuda_vae_decode_at_512_wide_attention_matches_cpu(tmp_path):
    vae_w = ref_vae.random_vae_weights(np.random.default_rng(7), ch=128, ch_mult=(1, 4),
                                       num_res_blocks=1, z=16)
    assert vae_w["decoder.mid.attn_1.q.weight"].shape[0] == 512
    vae_path = str(tmp_path / "vae512.safetensors")
    save_file({k: np.ascontiguousarray(v) for k, v in vae_w.items()}, vae_path)
    tokens = (0.2325 * np.random.default_rng(1).standard_normal((2, 256, 16))).astype(np.float32)
    cpu = _C.VAE(vae_path, device="cpu").decode(tokens)
    gpu = _C.VAE(vae_path, device="cuda").decode(tokens)
    assert cpu.shape == gpu.shape and np.all(np.isfinite(cpu))
    assert_close(gpu, cpu, 0.0, VAE_SHARE * np.abs(cpu).max(),
                 "VAE decode, cuda vs cpu (atol %g of max |image|)" % VAE_SHARE)


# Inception (random weights, channels / 16): float32 on both sides, ~95 convolutions of up
# to 2048 x 9 terms with folded batch norms; bound 1e-4 of the largest |feature| / |logit|,
# the same reasoning as the VAE's (unmeasured).
INCEPTION_SHARE = 1e-4


@cuda_only
def test_cuda_inception_features_and_logits_match_cpu(tmp_path):
    import marcache.eval

    inc_path = str(tmp_path / "inception.safetensors")
    save_file(RI.random_weights(np.random.default_rng(6), divisor=16, num_classes=10), inc_path)
    images = np.random.default_rng(2).integers(0, 256, (5, 64, 80, 3), dtype=np.uint8)
    out = {}
    for device in ("cpu", "cuda"):
        net = mc.eval.InceptionV3.load(inc_path, device=device, chunk=2)
        out[device] = net._net.features(images)
    for name, cpu, gpu in zip(("pool features", "logits"), out["cpu"], out["cuda"]):
        assert np.all(np.isfinite(cpu)) and cpu.size > 0
        assert_close(gpu, cpu, 0.0, INCEPTION_SHARE * np.abs(cpu).max(),
                     "Inception %s, cuda vs cpu (atol %g of the largest)" % (name, INCEPTION_SHARE))


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

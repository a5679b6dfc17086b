"""VAR generation (csrc/runtime/var_sampler.c through marcache._C.VAR.generate) against
the float64 reference loop (tests/reference/var.py generate, with the VQ update of
tests/reference/vqvae.py) on a tiny VAR and a tiny VQVAE in the official key layouts.

Tokens: the engine samples from float32 logits with the same Philox uniforms as the
reference, so every token must be the reference's own sample, except where the reference
finds the decision within TIE_TOL of flipping (top-k boundary, top-p cumulative sum, or
the draw's cumulative weight): those near ties are counted and reported, and the
reference follows the engine's token from there (teacher forcing), so f_hat is still
compared. f_hat: element-wise against the reference that used the engine's tokens."""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from marcache import _C
from interrupt import call_with_sigint_pending, gil_released_during
from reference import var as RV
from reference import vqvae as RVQ
from tolerance import assert_close, scaled_atol
from var_fixtures import TINY, TINY_VQ, module_fixtures
from child_env import child_env

HERE = os.path.dirname(os.path.abspath(__file__))
# Near-tie windows (see the module docstring and notes/var-model.md): logit gaps relative to
# the threshold's size; probabilities absolute.
TIE_TOL = 1e-4


files, models = module_fixtures("var_gen", 21, 22)


def run(models, labels, **kw):
    var, vq, _, _ = models
    (tokens, f_hat), steps = var.generate(np.asarray(labels, np.int32), vq, **kw)
    return tokens, f_hat, steps


def reference_run(models, labels, tokens, **kw):
    _, _, ref, vq = models
    labels = np.asarray(labels)
    seq_labels = np.where(labels < 0, ref.num_classes, labels)
    return RV.generate(ref, vq, seq_labels, forced_tokens=tokens, **kw)


def check_against_reference(models, labels, what, **kw):
    tokens, f_hat, steps = run(models, labels, **kw)
    ref = reference_run(models, labels, tokens, **kw)
    near = ref["margins"] < TIE_TOL
    differ = ref["own_tokens"] != tokens
    assert not (differ & ~near).any(), "%s: tokens differ away from a near tie at %s" % (
        what, np.argwhere(differ & ~near).tolist())
    if near.any():
        print("%s: %d near ties (margin < %g) at %s; engine and reference %s there" % (
            what, near.sum(), TIE_TOL, np.argwhere(near).tolist(),
            "differ" if (differ & near).any() else "agree"))
    assert near.mean() < 0.05, "%s: too many near ties for a meaningful test" % what
    # more_smooth divides the logits by tau (0.0135 at the last of 4 scales): their float32
    # error reaches the probabilities, and f_hat, 1 / tau times larger.
    share = 1e-5 / (0.27 * (1 - 0.95)) if kw.get("more_smooth") else 1e-5
    assert_close(f_hat, ref["f_hat"], rtol=share, atol=scaled_atol(ref["f_hat"], share, axis=-1),
                 what=what + " f_hat")
    return tokens, f_hat, steps, ref


SETTINGS = {
    "topk-topp": dict(cfg=1.5, top_k=20, top_p=0.9),
    "plain-multinomial": dict(cfg=3.0, top_k=0, top_p=0.0),
    "topk-only": dict(cfg=1.5, top_k=5, top_p=0.0),
    "topp-only": dict(cfg=1.5, top_k=0, top_p=0.6),
    "topk-at-vocab": dict(cfg=1.5, top_k=64, top_p=0.96),
    "cfg0": dict(cfg=0.0, top_k=20, top_p=0.9),
    "more-smooth": dict(cfg=2.0, top_k=30, top_p=0.95, more_smooth=True),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_generate_matches_reference(models, setting):
    kw = dict(SETTINGS[setting], seed=7, first_index=2)
    tokens, f_hat, steps, ref = check_against_reference(models, [1, 5, -1], setting, **kw)
    L, side = 30, TINY["patch_nums"][-1]
    assert tokens.shape == (3, L) and tokens.dtype == np.int32 and f_hat.shape == (3, side, side, 8)
    assert ((tokens >= 0) & (tokens < 64)).all()
    assert len(np.unique(tokens)) > 8, "degenerate sampling: too few distinct tokens"
    assert [s["scale"] for s in steps] == [0, 1, 2, 3] and [s["step"] for s in steps] == [0, 1, 2, 3]
    assert [s["tokens"] for s in steps] == [1, 4, 9, 16] and [s["kv_rows"] for s in steps] == [1, 5, 14, 30]
    cfg_on = kw["cfg"] != 0
    assert all(s["sequences"] == (6 if cfg_on else 3) for s in steps)
    assert [s["guidance"] for s in steps] == [RV.guidance(kw["cfg"], si, 4) if cfg_on else 0.0 for si in range(4)]
    assert not any(s["skipped"] for s in steps) and all(s["full"] for s in steps)


def test_top_k_and_top_p_change_the_tokens(models):
    """The filters matter on this model: different settings give different tokens."""
    base = dict(cfg=1.5, seed=3)
    a, _, _ = run(models, [2, 2, 2], top_k=0, top_p=0.0, **base)
    b, _, _ = run(models, [2, 2, 2], top_k=2, top_p=0.0, **base)
    c, _, _ = run(models, [2, 2, 2], top_k=0, top_p=0.3, **base)
    assert (a != b).any() and (a != c).any() and (b != c).any()
    # top_k = 1 is greedy: the same tokens for every seed
    g1, _, _ = run(models, [2], top_k=1, top_p=0.0, cfg=1.5, seed=1)
    g2, _, _ = run(models, [2], top_k=1, top_p=0.0, cfg=1.5, seed=99)
    np.testing.assert_array_equal(g1, g2)


def test_seed_and_image_index_select_the_draws(models):
    a, _, _ = run(models, [4], seed=1)
    b, _, _ = run(models, [4], seed=2)
    c, _, _ = run(models, [4], seed=1, first_index=1)
    assert (a != b).any() and (a != c).any()
    again, _, _ = run(models, [4], seed=1)
    np.testing.assert_array_equal(a, again)


def test_batch_invariance(models):
    """Image i is the same alone (first_index shifted) and in a batch: tokens identical,
    f_hat within 1e-5 of each pixel's largest channel (GEMM row counts differ)."""
    labels = [3, 0, 9, 7]
    kw = dict(cfg=2.0, top_k=30, top_p=0.95, seed=11, first_index=5)
    tokens, f_hat, _ = run(models, labels, **kw)
    for i, label in enumerate(labels):
        t1, f1, _ = run(models, [label], **dict(kw, first_index=5 + i))
        np.testing.assert_array_equal(t1[0], tokens[i])
        assert_close(f1[0], f_hat[i], rtol=0.0, atol=scaled_atol(f_hat[i], 1e-5, axis=-1), what="image %d alone" % i)


def test_cfg0_runs_the_conditional_rows_alone_and_equals_cfg_formula(models):
    """cfg = 0: half the sequences, and the same tokens as the (1 + 0) c - 0 u formula."""
    t0, f0, steps = run(models, [1, 6], cfg=0.0, top_k=20, top_p=0.9, seed=4)
    assert all(s["sequences"] == 2 for s in steps)
    ref = reference_run(models, [1, 6], t0, cfg=0.0, top_k=20, top_p=0.9, seed=4)
    assert ((ref["own_tokens"] == t0) | (ref["margins"] < TIE_TOL)).all()


def test_policy_names(models):
    """NoCache by its VAR name and by the shared Python NoCache's name equal cache=None;
    an unknown or MAR-only policy is refused."""
    base, _, _ = run(models, [8], seed=5)
    for cache in ({"policy": "nocache"}, {"policy": "none"}):
        t, _, _ = run(models, [8], seed=5, cache=cache)
        np.testing.assert_array_equal(t, base)
    with pytest.raises(ValueError, match="no VAR cache policy named 'lazymar'"):
        run(models, [8], cache={"policy": "lazymar"})
    with pytest.raises(ValueError, match="nocache: unknown field 'ratio'"):
        run(models, [8], cache={"policy": "nocache", "ratio": 0.5})


def test_flops_telemetry(models):
    """Per-scale FLOPs (Part E rules, conditioning in scale 0) by formula."""
    var, _, _, _ = models
    c = var.config
    C, F, V, depth, Cvae = c["width"], c["ffn_hidden"], c["vocab"], c["depth"], c["vae_channels"]
    for cfg, smooth in ((1.5, False), (0.0, False), (2.0, True)):
        B = 2
        S = 2 * B if cfg else B
        _, _, steps = run(models, [1, 2], cfg=cfg, more_smooth=smooth, seed=0)
        for si, s in enumerate(steps):
            n, keys = s["tokens"], s["kv_rows"]
            want = depth * (S * n * (8 * C * C + 4 * C * F) + 4 * S * n * keys * C) + 2 * S * n * C * V
            want += depth * 2 * S * C * 6 * C + 2 * S * C * 2 * C if si == 0 else 2 * B * n * Cvae * C
            want += 2 * B * n * V * Cvae if smooth else 0
            assert s["flops"] == want


GUARD_CHILD = r"""
import json, sys
import numpy as np
from marcache import _C
var_path, vq_path = sys.argv[1], sys.argv[2]
out = {}
for device in ("cpu", "guard"):
    var, vq = _C.VAR(var_path, device=device), _C.VQVAE(vq_path, device=device)
    # a first call sizes the workspaces (the model's, the VQVAE's, the backend's scratch)
    var.generate(np.array([1, 5, -1], np.int32), vq, seed=0, more_smooth=True)
    flops = []
    runs = []
    for kw in (dict(cfg=1.5, top_k=20, top_p=0.9), dict(cfg=0.0), dict(cfg=2.0, more_smooth=True)):
        before = var.backend_flops
        marks = []
        (t, f), steps = var.generate(np.array([1, 5, -1], np.int32), vq, seed=7, first_index=2,
                                     callback=lambda d: marks.append(var.backend_flops), **kw)
        runs.append([t.tobytes().hex(), f.tobytes().hex()])
        per_step = np.diff([before] + marks).tolist()
        flops.append([per_step, [s["flops"] for s in steps], [s["allocations"] for s in steps]])
    out[device] = {"runs": runs, "flops": flops}
print(json.dumps({"same": out["cpu"]["runs"] == out["guard"]["runs"], "flops": out["guard"]["flops"]}))
"""


def test_guard_equals_cpu_and_counts_the_telemetry_flops(files):
    """On the guard backend the tokens and f_hat equal the CPU's bit for bit, and the FLOPs
    the guard dispatches in each scale equal that scale's telemetry exactly."""
    var_path, _, vq_path, _ = files
    env = child_env(PYTHONFAULTHANDLER="1")
    proc = subprocess.run([sys.executable, "-c", GUARD_CHILD, var_path, vq_path], cwd=HERE, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["same"]
    for dispatched, telemetry, allocations in out["flops"]:
        assert dispatched == telemetry
        assert allocations == [0, 0, 0, 0]  # after a first call of this batch nothing grows in the loop


def test_ctrl_c_between_scales_leaves_the_model_usable(models):
    var, vq, _, _ = models
    labels = np.array([4, 2], np.int32)
    (want, want_f), _ = var.generate(labels, vq, seed=5)
    seen = []

    def on_step(info):
        seen.append(info["scale"])
        if info["scale"] == 1:
            signal.raise_signal(signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        var.generate(labels, vq, seed=5, callback=on_step)
    assert seen == [0, 1]
    assert call_with_sigint_pending(lambda: var.generate(labels, vq, seed=5, callback=seen.append))
    (again, again_f), _ = var.generate(labels, vq, seed=5)
    np.testing.assert_array_equal(again, want)
    np.testing.assert_array_equal(again_f, want_f)


def test_callback_error_stops_and_model_stays_usable(models):
    var, vq, _, _ = models
    labels = np.array([1], np.int32)

    def boom(info):
        raise ValueError("stop at %d" % info["scale"])

    with pytest.raises(ValueError, match="stop at 0"):
        var.generate(labels, vq, seed=1, callback=boom)
    (t, _), steps = var.generate(labels, vq, seed=1)
    assert len(steps) == 4 and t.shape == (1, 30)


def test_gil_released(models):
    var, vq, _, _ = models
    assert gil_released_during(lambda: var.generate(np.array([1, 2, 3], np.int32), vq, seed=0))


def test_bad_generate_arguments(models, files, tmp_path):
    var, vq, _, _ = models
    labels = np.array([1], np.int32)
    with pytest.raises(TypeError, match="vqvae must be a marcache._C.VQVAE"):
        var.generate(labels, "vq.safetensors")
    with pytest.raises(ValueError, match=r"label 10 at index 0 is outside 0..9 \(or -1 for unconditional\)"):
        var.generate(np.array([10], np.int32), vq)
    with pytest.raises(ValueError, match="cfg must be a finite number >= 0"):
        var.generate(labels, vq, cfg=-1.0)
    with pytest.raises(ValueError, match="n_images must be positive"):
        var.generate(np.zeros(0, np.int32), vq)
    other = RVQ.random_vqvae_weights(np.random.default_rng(0), **dict(TINY_VQ, vocab=32))
    path = tmp_path / "other_vq.safetensors"
    save_file(dict(other), str(path))
    with pytest.raises(ValueError, match=r"the VQVAE \(vocabulary 32, 8 latent channels\) does not fit the VAR "
                                         r"model \(vocabulary 64, 8 latent channels\)"):
        var.generate(labels, _C.VQVAE(str(path)))

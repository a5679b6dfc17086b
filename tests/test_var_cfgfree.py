"""CfgFreeLate on VAR (csrc/runtime/var_cfgfree.c, marcache/policies/cfgfree.py), alone and
composed with FastVAR, against the float64 reference (tests/reference/fastvar.py's loop
with cfg_free_after: scale si of n is guidance-free when si >= after * n) on the tiny
6-scale VAR of test_fastvar (1, 2, 3, 4, 6, 8; 3 blocks).

- whole generations: tokens are the reference's own samples except at near ties, f_hat
  within 1e-5; the late scales run the conditional sequences alone (telemetry
  "sequences" B, guidance 0), FastVAR's pruned rows per block are unchanged;
- after=1 is the inner policy bit for bit, after=0 the same run with cfg=0;
- marcache.flops equals the telemetry at every scale, and its blocks the reference's
  count; the released d30 exactly from the definitions;
- the guard backend gives the CPU's bits and dispatches exactly the telemetry's FLOPs;
- VARModel.forward_scales passes cache= and trace= through (FastVAR's pruned forward per
  scale, against the reference);
- bad compositions and hand-made configs are errors naming the field.
"""
import os

import numpy as np
import pytest

import marcache as mc
from reference import fastvar as RF
from reference import var as RV
from tolerance import assert_close, scaled_atol
from var_fixtures import assert_tokens_follow, generate_on_guard_and_cpu, module_fixtures

HERE = os.path.dirname(os.path.abspath(__file__))
PATCH_NUMS = (1, 2, 3, 4, 6, 8)
DEPTH = 3
TIE_TOL = 1e-4   # near-tie window of the sampled tokens (as test_var_generate)
GAP_MIN = 1e-5   # the reference's FastVAR selections must be this far from a tie (as test_fastvar)
N_SCALES = len(PATCH_NUMS)

# name -> (after, inner policy, sampling settings); after * 6 scales: 0.5 -> scales 3..5
# guidance-free, 0.7 -> 5, 0.6 -> 4 and 5 (the pruned scales of the FastVAR settings, one of
# them with its cache scale guided and its pruned scales not).
SETTINGS = {
    "nocache-0.5": (0.5, mc.NoCache(), dict(cfg=1.5, top_k=20, top_p=0.9)),
    "fastvar-0.7": (0.7, mc.FastVAR(cache_scale=3, prune={4: 0.5, 5: 0.75}), dict(cfg=2.0, top_k=30, top_p=0.95)),
    "fastvar-0.6-layers": (0.6, mc.FastVAR(cache_scale=3, prune={4: 0.75, 5: 0.5}, layers=(1, 3)),
                           dict(cfg=1.5, top_k=0, top_p=0.0)),
    "fastvar-0.5-skip": (0.5, mc.FastVAR(cache_scale=3, prune={4: 0.5, 5: 1.0}), dict(cfg=2.0, top_k=30,
                                                                                      top_p=0.95)),
    "fastvar-0.2-smooth": (0.2, mc.FastVAR(cache_scale=2, prune={3: 0.5, 5: 0.75}),
                           dict(cfg=2.0, top_k=30, top_p=0.95, more_smooth=True)),
}


files, models = module_fixtures("var_cfgfree", 31, 32, depth=DEPTH, patch_nums=PATCH_NUMS)


@pytest.fixture(scope="module")
def model(files):
    var_path, _, vq_path, _ = files
    return mc.load(var_path, vae=vq_path)


def reference_settings(inner):
    """The reference's FastVAR settings of an inner policy (NoCache: nothing pruned)."""
    if isinstance(inner, mc.FastVAR):
        return RF.Settings.of_policy(inner)
    return RF.Settings(cache_scale=0, prune={})


# --------------------------------------------------------------------------------------
# whole generations against the reference
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_generate_matches_reference(models, setting):
    """The composed run is the reference's: tokens equal except at near ties (where the
    reference follows the engine), f_hat within 1e-5 of each pixel's largest channel; the
    late scales run B sequences unguided, the rows per block are the inner policy's."""
    var, vq, ref, rvq = models
    after, inner, kw = SETTINGS[setting]
    policy = mc.CfgFreeLate(after=after, inner=inner)
    labels = np.array([1, 5, -1], np.int32)
    kw = dict(kw, seed=7, first_index=2)
    (tokens, f_hat), steps = var.generate(labels, vq, cache=policy.as_dict(), **kw)
    seq_labels = np.where(labels < 0, ref.num_classes, labels)
    want = RF.generate(ref, rvq, seq_labels, reference_settings(inner), forced_tokens=tokens,
                       cfg_free_after=after, **kw)
    assert want["transformer"].min_gap > GAP_MIN
    assert_tokens_follow(tokens, want, TIE_TOL)
    share = 1e-5 / (0.27 * (1 - 0.95)) if kw.get("more_smooth") else 1e-5
    assert_close(f_hat, want["f_hat"], rtol=share, atol=scaled_atol(want["f_hat"], share, axis=-1),
                 what=setting + " f_hat")
    B = len(labels)
    config = dict(patch_nums=PATCH_NUMS, depth=DEPTH)
    late = [si for si in range(N_SCALES) if si >= after * N_SCALES]
    assert late, "the setting has no guidance-free scale"
    for si, s in enumerate(steps):
        if s["skipped"]:
            assert not policy.runs_scale(si, N_SCALES) and s["flops"] == 0
            continue
        assert s["sequences"] == want["sequences"][si] == (B if si in late else 2 * B)
        assert s["guidance"] == (0.0 if si in late else RV.guidance(kw["cfg"], si, N_SCALES))
        assert s["block_rows"] == [list(r) for r in policy.block_rows(config, si)]
        assert s["block_rows"] == [list(r) for r in want["transformer"].block_rows(si, PATCH_NUMS[si] ** 2)]


def test_guidance_free_scales_change_the_late_tokens_only(models):
    """The scales before `after` are the inner policy's bit for bit (same rows, same sums);
    the guidance-free ones differ (unguided logits)."""
    var, vq, _, _ = models
    labels = np.array([1, 5, 7], np.int32)
    kw = dict(cfg=4.0, top_k=0, top_p=0.0, seed=3)
    inner = mc.FastVAR(cache_scale=3, prune={4: 0.5, 5: 0.75})
    (t0, _), _ = var.generate(labels, vq, cache=inner.as_dict(), **kw)
    (t1, _), _ = var.generate(labels, vq, cache=mc.CfgFreeLate(after=0.7, inner=inner).as_dict(), **kw)
    first_late = sum(p * p for p in PATCH_NUMS[:5])
    np.testing.assert_array_equal(t1[:, :first_late], t0[:, :first_late])
    assert (t1[:, first_late:] != t0[:, first_late:]).mean() > 0.2


@pytest.mark.parametrize("inner", [mc.NoCache(), mc.FastVAR(cache_scale=3, prune={4: 0.5, 5: 0.75}),
                                   mc.FastVAR(cache_scale=3, prune={4: 0.5}, skip_last=1)],
                         ids=["nocache", "fastvar", "fastvar-skip"])
def test_after_one_is_the_inner_policy_and_after_zero_is_cfg0(models, inner):
    """after=1 guides every scale: the inner policy's tokens, f_hat and FLOPs bit for bit.
    after=0 guides none: the bits of the same run with cfg=0 (the same rows run)."""
    var, vq, _, _ = models
    labels = np.array([3, 8, -1], np.int32)
    kw = dict(top_k=20, top_p=0.9, seed=9)
    for cfg_kw in (dict(cfg=1.5), dict(cfg=2.0, more_smooth=True)):
        (t0, f0), s0 = var.generate(labels, vq, cache=inner.as_dict(), **kw, **cfg_kw)
        (t1, f1), s1 = var.generate(labels, vq, cache=mc.CfgFreeLate(after=1.0, inner=inner).as_dict(), **kw,
                                    **cfg_kw)
        np.testing.assert_array_equal(t1, t0)
        np.testing.assert_array_equal(f1, f0)
        assert [s["flops"] for s in s1] == [s["flops"] for s in s0]
        (t2, f2), s2 = var.generate(labels, vq, cache=mc.CfgFreeLate(after=0.0, inner=inner).as_dict(), **kw,
                                    **dict(cfg_kw, cfg=0.0))
        (t3, f3), s3 = var.generate(labels, vq, cache=mc.CfgFreeLate(after=0.0, inner=inner).as_dict(), **kw,
                                    **cfg_kw)
        (t4, f4), s4 = var.generate(labels, vq, cache=inner.as_dict(), **kw, **dict(cfg_kw, cfg=0.0))
        for t, f, s in ((t2, f2, s2), (t3, f3, s3)):
            np.testing.assert_array_equal(t, t4)
            np.testing.assert_array_equal(f, f4)
            assert [x["flops"] for x in s] == [x["flops"] for x in s4]
            assert all(x["sequences"] == 3 for x in s if not x["skipped"])


# --------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------

def test_python_flop_model_equals_the_telemetry(model):
    """marcache.flops(model, cache=CfgFreeLate(...)) per scale equals the engine's telemetry
    exactly; the blocks' part equals the reference's count on the sequences each scale runs."""
    config = model.config
    for after, inner, cfg, smooth in ((0.5, mc.NoCache(), 1.5, False),
                                      (0.7, mc.FastVAR(cache_scale=3, prune={4: 0.5, 5: 0.75}), 2.0, False),
                                      (0.6, mc.FastVAR(cache_scale=2, prune={4: 0.4, 5: 1.0}, layers=(1, 3)), 1.5,
                                       True),
                                      (0.0, mc.FastVAR(cache_scale=3, prune={4: 0.99}), 1.5, False),
                                      (0.5, mc.NoCache(), 0.0, False)):
        policy = mc.CfgFreeLate(after=after, inner=inner)
        _, _, info = model.generate_tokens([1, 2], cfg=cfg, more_smooth=smooth, cache=policy, return_info=True)
        report = mc.flops(model, cfg=cfg, cache=policy, batch=2, more_smooth=smooth)
        assert [s["total"] for s in report.per_scale] == [s["flops"] for s in info.steps]
        assert [(s["tokens"], s["keys"]) for s in report.per_scale] == [(s["tokens"], s["kv_rows"])
                                                                       for s in info.steps]
        settings = reference_settings(inner)
        for si, s in enumerate(report.per_scale):
            n_seq = 4 if RF.guided_scale(cfg, si, N_SCALES, after) else 2
            assert (s["linear"], s["attention"]) == RF.scale_block_flops(config, settings, si, n_seq)


def test_flops_of_the_released_d30_follow_the_definitions():
    """marcache.flops("var_d30", cache=CfgFreeLate(after=0.8, inner=FastVAR())) exactly: the
    blocks from the reference's count (scales 8 and 9, 13x13 and 16x16, on the conditional
    sequence alone), the head on the sequences each scale runs, word_embed on the image
    rows, the conditioning of both sequences at scale 0."""
    config = mc.VAR_CONFIGS["var_d30"]
    C, V, depth = config["width"], config["vocab"], config["depth"]
    for inner in (mc.FastVAR(), mc.NoCache()):
        report = mc.flops("var_d30", cache=mc.CfgFreeLate(after=0.8, inner=inner))
        settings = reference_settings(inner)
        total = 0
        for si, pn in enumerate(config["patch_nums"]):
            n, n_seq = pn * pn, (2 if si < 8 else 1)
            linear, attention = RF.scale_block_flops(config, settings, si, n_seq)
            total += linear + attention + 2 * n_seq * n * C * V
            total += 2 * 1 * n * 32 * C if si > 0 else 2 * 2 * (depth * 6 * C * C + 2 * C * C)
        assert report.total == float(total)
    # the composition halves the late scales of FastVAR's own count
    assert mc.flops("var_d30", cache=mc.CfgFreeLate(after=0.8, inner=mc.FastVAR())).total < \
        mc.flops("var_d30", cache=mc.FastVAR()).total


def test_guard_equals_cpu_and_counts_the_telemetry_flops(files):
    """On the guard backend the composed runs' tokens and f_hat equal the CPU's bit for bit,
    and the FLOPs dispatched in each scale equal that scale's telemetry exactly."""
    var_path, _, vq_path, _ = files
    caches = [mc.CfgFreeLate(after=0.5).as_dict(),
              mc.CfgFreeLate(after=0.7, inner=mc.FastVAR(cache_scale=3, prune={4: 0.5, 5: 0.75})).as_dict(),
              mc.CfgFreeLate(after=0.6, inner=mc.FastVAR(cache_scale=2, prune={4: 0.4, 5: 1.0},
                                                         layers=(1, 3))).as_dict()]
    same, flops = generate_on_guard_and_cpu(var_path, vq_path, caches)
    assert same
    for dispatched, telemetry in flops:
        assert dispatched == telemetry


# --------------------------------------------------------------------------------------
# VARModel.forward_scales with a cache policy (issue 16: FastVAR's pruned forward per scale)
# --------------------------------------------------------------------------------------

def test_model_forward_scales_passes_the_cache_and_the_trace(model, models):
    """model.forward_scales(labels, inputs, cache=FastVAR(...), trace=True): hidden states and
    logits of every scale within 1e-5 of the reference's pruned forward, and the rows each
    sublayer ran on the reference's; cache=None (and CfgFreeLate around NoCache, which
    changes nothing without guidance) is the plain loop."""
    ref = models[2]
    labels = np.array([1, 5, 10, 10], np.int32)  # two images with their CFG rows (10 = the null class)
    rng = np.random.default_rng(3)
    maps = rng.standard_normal((len(labels), ref.L - ref.begin[1], ref.Cvae)).astype(np.float32)
    inputs = model.scale_inputs(labels, maps)
    policy = mc.FastVAR(cache_scale=3, prune={4: 0.5, 5: 0.75})
    hidden, logits, trace = model.forward_scales(labels, inputs, cache=policy, trace=True)
    want_h, want_l, t = RF.forward_scales(ref, RF.Settings.of_policy(policy), labels, inputs)
    assert t.min_gap > GAP_MIN
    for si, pn in enumerate(PATCH_NUMS):
        b, e = ref.begin[si], ref.begin[si + 1]
        assert_close(hidden[:, b:e], want_h[:, b:e], rtol=1e-5, atol=scaled_atol(want_h[:, b:e], 1e-5, axis=-1),
                     what="hidden of scale %d" % si)
        assert_close(logits[:, b:e], want_l[:, b:e], rtol=1e-5, atol=scaled_atol(want_l[:, b:e], 1e-5, axis=-1),
                     what="logits of scale %d" % si)
        assert trace[si].shape == (DEPTH, 2, 4, pn * pn)
        for i in range(DEPTH):
            for sub in range(2):
                kept = t.trace.get(si, {}).get((i, sub))
                if kept is None:
                    np.testing.assert_array_equal(trace[si][i, sub], np.tile(np.arange(pn * pn), (4, 1)))
                else:
                    np.testing.assert_array_equal(trace[si][i, sub][:, :kept.shape[1]], kept)
                    assert (trace[si][i, sub][:, kept.shape[1]:] == -1).all()
    plain_h, plain_l = model.forward_scales(labels, inputs)
    want_plain_h, _ = ref.forward_scales(labels, inputs)
    assert_close(plain_h, want_plain_h, rtol=1e-5, atol=scaled_atol(want_plain_h, 1e-5, axis=-1), what="plain")
    h2, l2 = model.forward_scales(labels, inputs, cache=mc.CfgFreeLate(after=0.5))
    np.testing.assert_array_equal(h2, plain_h)
    np.testing.assert_array_equal(l2, plain_l)
    with pytest.raises(ValueError, match="LazyMAR is a cache policy for MAR models, not VAR"):
        model.forward_scales(labels, inputs, cache=mc.LazyMAR())
    with pytest.raises(ValueError, match="FastVAR.cache_scale = 7 is outside the model's scales 0..5"):
        model.forward_scales(labels, inputs, cache=mc.FastVAR())


# --------------------------------------------------------------------------------------
# the public API and bad input
# --------------------------------------------------------------------------------------

def test_family_follows_the_inner_policy(model, tmp_path):
    assert mc.CfgFreeLate().families == ("mar", "var")
    assert mc.CfgFreeLate(inner=mc.FastVAR()).families == ("var",)
    assert mc.CfgFreeLate(inner=mc.LazyMAR(cond_cache=True)).families == ("mar",)
    with pytest.raises(ValueError, match="CfgFreeLate is a cache policy for MAR models, not VAR"):
        model.generate_tokens([1], cache=mc.CfgFreeLate(inner=mc.LazyMAR(cond_cache=True)))
    from mar_fixtures import write_tiny_mar
    mar_path = tmp_path / "tiny_mar.safetensors"
    write_tiny_mar(str(mar_path))
    mar = mc.load(str(mar_path))
    with pytest.raises(ValueError, match="CfgFreeLate is a cache policy for VAR models, not MAR"):
        mar.generate_tokens([1], steps=2, cache=mc.CfgFreeLate(inner=mc.FastVAR()))
    with pytest.raises(ValueError, match="CfgFreeLate is a cache policy for VAR models, not MAR"):
        mc.flops("mar_base", cache=mc.CfgFreeLate(inner=mc.FastVAR()))
    with pytest.raises(ValueError, match="FastVAR.prune names scale 8, but the model has scales 0..5"):
        model.generate_tokens([1], cache=mc.CfgFreeLate(inner=mc.FastVAR(cache_scale=3, prune={8: 0.5})))


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(after=1.5), "field 'after' = 1.5 is outside"),
    (lambda d: d.update(inner={"policy": "lazymar"}), "names no policy of this model family"),
    (lambda d: d.update(inner=mc.CfgFreeLate().as_dict()), "a CfgFreeLate inside a CfgFreeLate"),
    (lambda d: d["inner"].update(cache_scale=5), r"FastVAR.prune: scale 4 is at or before the cache scale"),
    (lambda d: d.pop("inner"), "missing field 'inner'"),
])
def test_engine_checks_a_hand_made_config(models, edit, match):
    var, vq, _, _ = models
    d = mc.CfgFreeLate(after=0.5, inner=mc.FastVAR(cache_scale=3, prune={4: 0.5})).as_dict()
    edit(d)
    with pytest.raises(ValueError, match=match):
        var.generate(np.array([1], np.int32), vq, cache=d)


def test_command_line_composition():
    from marcache.__main__ import make_cache
    assert make_cache("cfgfreelate", ["after=0.8", "inner=fastvar"]) == mc.CfgFreeLate(after=0.8,
                                                                                         inner=mc.FastVAR())


def test_readme_flop_numbers_are_marcache_flops():
    """The README's FLOP numbers of CfgFreeLate on VAR and of the FastVAR alternatives are
    what marcache.flops computes (GFLOP per image with CFG, share of NoCache)."""
    readme = " ".join(open(os.path.join(os.path.dirname(HERE), "README.md")).read().split())
    claims = [(mc.CfgFreeLate(after=0.8, inner=mc.FastVAR()), "var_d16", "282.6 GFLOP per image on d16 (47.3 %)"),
              (mc.CfgFreeLate(after=0.8, inner=mc.FastVAR()), "var_d30", "1798.0 on d30 (47.7 %)"),
              (mc.CfgFreeLate(after=0.8), "var_d16", "406.2 GFLOP per image on d16 (68.0 %)"),
              (mc.CfgFreeLate(after=0.8), "var_d30", "2574.5 on d30 (68.4 %)"),
              (mc.FastVAR(cache_scale=8, prune={9: 0.5}), "var_d16", "it, 80.5 % of the FLOPs)")]
    for policy, name, text in claims:
        total, base = mc.flops(name, cache=policy).total, mc.flops(name).total
        assert text in readme, text
        assert f"{100 * total / base:.1f} %" in text, (text, total)
        if " on d" in text:
            assert f"{total / 1e9:.1f}" in text, (text, total)

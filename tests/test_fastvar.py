"""FastVAR (csrc/runtime/fastvar.c, marcache/policies/fastvar.py) against the float64
reference (tests/reference/fastvar.py, written from spec Part D) on a tiny random VAR
with 6 scales (1, 2, 3, 4, 6, 8; 130 tokens) and 3 blocks.

- the pruned transformer scale by scale (forward_scales with the policy): the rows each
  pruned sublayer keeps are the reference's exactly (and far from a tie), hidden states
  and logits within 1e-5 of each token's largest value, for ratios 0, 0.4, 0.5, 0.75 and
  a single kept row, one and two pruned scales, a cache scale two scales back, a partial
  layer range;
- whole generations (sampling, guidance, the VQ update) against the reference loop, with
  skipped trailing scales (ratio 1, skip_last);
- prune={} is NoCache bit for bit; the guard backend gives the CPU's bits and dispatches
  exactly the FLOPs of the telemetry; the Python FLOP model equals the telemetry;
- bad settings are ValueErrors naming the field.
"""
import os

import numpy as np
import pytest

import marcache as mc
from marcache import _C
from reference import fastvar as RF
from tolerance import assert_close, scaled_atol
from var_fixtures import assert_tokens_follow, generate_on_guard_and_cpu, module_fixtures

HERE = os.path.dirname(os.path.abspath(__file__))
PATCH_NUMS = (1, 2, 3, 4, 6, 8)
DEPTH = 3
# Near-tie window of the sampled tokens (as test_var_generate).
TIE_TOL = 1e-4
# The reference's selections must be this far (relative score gap at the keep boundary)
# from a tie, so that "the same rows" is a fair demand of the float32 engine: its scores
# carry ~1e-6 relative error (the residual stream's float32 rounding over a few blocks).
GAP_MIN = 1e-5

# name -> FastVAR settings for the 6-scale model (4x4 = scale 3, 6x6 = 4, 8x8 = 5)
FORWARD_SETTINGS = {
    "one-scale-r0.5": dict(cache_scale=3, prune={4: 0.5}),
    "two-scales-r0.5-r0.75": dict(cache_scale=3, prune={4: 0.5, 5: 0.75}),
    "two-scales-r0": dict(cache_scale=3, prune={4: 0.0, 5: 0.0}),
    "cache2-r0.4-r0.5": dict(cache_scale=2, prune={4: 0.4, 5: 0.5}),
    "layers1-3-r0.75-r0.5": dict(cache_scale=3, prune={4: 0.75, 5: 0.5}, layers=(1, 3)),
    "layers0-1-r0.5": dict(cache_scale=3, prune={5: 0.5}, layers=(0, 1)),
    "one-row-kept": dict(cache_scale=4, prune={5: 0.99}),
}


files, models = module_fixtures("fastvar", 31, 32, depth=DEPTH, patch_nums=PATCH_NUMS)


def per_token(ref, share=1e-5):
    return scaled_atol(ref, share, axis=-1)


def forward_inputs(ref, labels, seed):
    rng = np.random.default_rng(seed)
    maps = rng.standard_normal((len(labels), ref.L - ref.begin[1], ref.Cvae)).astype(np.float32)
    return ref.scale_inputs(np.asarray(labels), maps).astype(np.float32)


# --------------------------------------------------------------------------------------
# the pruned transformer, scale by scale
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("setting", sorted(FORWARD_SETTINGS))
def test_pruned_forward_matches_reference(backend, files, models, setting):
    """Kept rows identical to the reference's; hidden states and logits of every scale
    within 1e-5 of each token's largest value."""
    var_path = files[0]
    ref = models[2]
    policy = mc.FastVAR(**FORWARD_SETTINGS[setting])
    var = _C.VAR(var_path, device=backend)
    labels = np.array([1, 5, 10, 10], np.int32)  # two images with their CFG rows (10 = null class)
    inputs = forward_inputs(ref, labels, seed=3)
    hidden, logits, trace = var.forward_scales(labels, inputs, cache=policy.as_dict(), trace=True)
    want_h, want_l, t = RF.forward_scales(ref, RF.Settings.of_policy(policy), labels, inputs)
    assert t.min_gap > GAP_MIN, "a selection of the reference is within %g of a tie" % t.min_gap
    pruned_sublayers = 0
    for si, pn in enumerate(PATCH_NUMS):
        n = pn * pn
        assert trace[si].shape == (DEPTH, 2, 4, n)
        for i in range(DEPTH):
            for sub in range(2):
                got = trace[si][i, sub]
                kept = t.trace.get(si, {}).get((i, sub))
                if kept is None:  # a full sublayer: every row
                    np.testing.assert_array_equal(got, np.tile(np.arange(n), (4, 1)))
                    continue
                pruned_sublayers += 1
                k = kept.shape[1]
                np.testing.assert_array_equal(got[:, :k], kept, err_msg="scale %d block %d sublayer %d" % (si, i, sub))
                assert (got[:, k:] == -1).all()
        b, e = ref.begin[si], ref.begin[si + 1]
        assert_close(hidden[:, b:e], want_h[:, b:e], rtol=1e-5, atol=per_token(want_h[:, b:e]),
                     what="%s: hidden of scale %d on %s" % (setting, si, backend))
        assert_close(logits[:, b:e], want_l[:, b:e], rtol=1e-5, atol=per_token(want_l[:, b:e]),
                     what="%s: logits of scale %d on %s" % (setting, si, backend))
    assert pruned_sublayers == 2 * sum(
        1 for si in policy.prune for i in range(DEPTH) if policy.layer_range(DEPTH)[0] <= i < policy.layer_range(DEPTH)[1])


def test_pruning_changes_the_result_and_the_sequences_choose_their_own_rows(models):
    """The pruned scales differ from the uncached model (the cached outputs stand in for the
    pruned rows), earlier scales do not; each CFG row selects its own rows."""
    var, _, ref, _ = models
    labels = np.array([1, 5, 10, 10], np.int32)
    inputs = forward_inputs(ref, labels, seed=4)
    h0, _ = var.forward_scales(labels, inputs)
    h1, _, trace = var.forward_scales(labels, inputs, cache=mc.FastVAR(cache_scale=3, prune={4: 0.5, 5: 0.75})
                                      .as_dict(), trace=True)
    b4 = ref.begin[4]
    np.testing.assert_array_equal(h1[:, :b4], h0[:, :b4])
    assert np.abs(h1[:, b4:] - h0[:, b4:]).max() > 1e-2
    kept = trace[5][0, 0][:, :16]
    assert len({tuple(k) for k in kept}) > 1, "every sequence kept the same rows"


def test_ratio_zero_keeps_every_row_and_equals_nocache(models):
    """Ratio 0 keeps every row (the restored map is entirely overwritten): the outputs are
    the uncached model's bit for bit (the same rows in the same GEMMs, the same sums)."""
    var, _, ref, _ = models
    labels = np.array([2, 10], np.int32)
    inputs = forward_inputs(ref, labels, seed=5)
    h0, l0 = var.forward_scales(labels, inputs)
    h1, l1, trace = var.forward_scales(labels, inputs, cache=mc.FastVAR(cache_scale=3, prune={4: 0.0, 5: 0.0})
                                       .as_dict(), trace=True)
    np.testing.assert_array_equal(trace[5][:, :, :, :], np.broadcast_to(np.arange(64), (DEPTH, 2, 2, 64)))
    np.testing.assert_array_equal(h1, h0)
    np.testing.assert_array_equal(l1, l0)


def test_forward_refuses_inputs_of_a_skipped_scale(models):
    var, _, ref, _ = models
    labels = np.array([2], np.int32)
    inputs = forward_inputs(ref, labels, seed=6)
    with pytest.raises(ValueError, match="the inputs cover scale 5, which cache policy 'fastvar' skips"):
        var.forward_scales(labels, inputs, cache=mc.FastVAR(cache_scale=3, prune={4: 0.5}, skip_last=1).as_dict())
    # the scales before run
    h, _ = var.forward_scales(labels, inputs[:, :ref.begin[5]],
                              cache=mc.FastVAR(cache_scale=3, prune={4: 0.5}, skip_last=1).as_dict())
    assert h.shape[1] == ref.begin[5]


# --------------------------------------------------------------------------------------
# whole generations
# --------------------------------------------------------------------------------------

GENERATE_SETTINGS = {
    "two-scales": (dict(cache_scale=3, prune={4: 0.5, 5: 0.75}), dict(cfg=1.5, top_k=20, top_p=0.9)),
    "partial-layers-cfg0": (dict(cache_scale=3, prune={4: 0.75, 5: 0.5}, layers=(1, 3)),
                            dict(cfg=0.0, top_k=0, top_p=0.0)),
    "skip-last-by-ratio": (dict(cache_scale=3, prune={4: 0.5, 5: 1.0}), dict(cfg=2.0, top_k=30, top_p=0.95)),
    "skip-last-two": (dict(cache_scale=3, prune={}, skip_last=2), dict(cfg=1.5, top_k=20, top_p=0.9)),
    "more-smooth": (dict(cache_scale=2, prune={3: 0.5, 5: 0.75}), dict(cfg=2.0, top_k=30, top_p=0.95,
                                                                         more_smooth=True)),
}


def keys_of(ref, policy, si):
    """K/V rows per sequence after scale si: the largest over blocks."""
    rows = [0] * DEPTH
    for s in range(si + 1):
        for i, (attn, _) in enumerate(policy.block_rows(dict(patch_nums=PATCH_NUMS, depth=DEPTH), s)):
            rows[i] += attn
    return max(rows)


@pytest.mark.parametrize("setting", sorted(GENERATE_SETTINGS))
def test_generate_matches_reference(models, setting):
    """Tokens are the reference's own samples except at near ties (then the reference
    follows the engine), f_hat within 1e-5 of each pixel's largest channel; skipped scales
    have tokens -1 and no work; the telemetry's rows per block are the policy's."""
    var, vq, ref, rvq = models
    fields, kw = GENERATE_SETTINGS[setting]
    policy = mc.FastVAR(**fields)
    labels = np.array([1, 5, -1], np.int32)
    kw = dict(kw, seed=7, first_index=2)
    (tokens, f_hat), steps = var.generate(labels, vq, cache=policy.as_dict(), **kw)
    seq_labels = np.where(labels < 0, ref.num_classes, labels)
    want = RF.generate(ref, rvq, seq_labels, RF.Settings.of_policy(policy), forced_tokens=tokens, **kw)
    assert want["transformer"].min_gap > GAP_MIN
    assert_tokens_follow(tokens, want, TIE_TOL)
    share = 1e-5 / (0.27 * (1 - 0.95)) if kw.get("more_smooth") else 1e-5
    assert_close(f_hat, want["f_hat"], rtol=share, atol=scaled_atol(want["f_hat"], share, axis=-1),
                 what=setting + " f_hat")
    config = dict(patch_nums=PATCH_NUMS, depth=DEPTH)
    n_scales = len(PATCH_NUMS)
    for si, s in enumerate(steps):
        n = PATCH_NUMS[si] ** 2
        skipped = not policy.runs_scale(si, n_scales)
        assert s["skipped"] == skipped
        b, e = ref.begin[si], ref.begin[si + 1]
        if skipped:
            assert s["flops"] == 0 and s["tokens"] == 0 and (tokens[:, b:e] == -1).all()
            assert s["block_rows"] == [[0, 0]] * DEPTH
            continue
        assert ((tokens[:, b:e] >= 0) & (tokens[:, b:e] < 64)).all()
        assert s["block_rows"] == [list(r) for r in policy.block_rows(config, si)]
        assert s["block_rows"] == [list(r) for r in want["transformer"].block_rows(si, n)]
        assert s["kv_rows"] == keys_of(ref, policy, si)
        assert s["full"] == (not policy.pruned(si))
        assert s["cache_bytes"] > 0 or not any(policy.pruned(x) for x in policy.prune)


def test_prune_empty_is_nocache_bit_for_bit(models):
    """prune={} (any cache scale, any layers) runs the uncached model: the same tokens,
    f_hat and telemetry FLOPs bit for bit, no cache."""
    var, vq, _, _ = models
    labels = np.array([3, 8, -1], np.int32)
    for kw in (dict(cfg=1.5, top_k=20, top_p=0.9), dict(cfg=0.0, more_smooth=True)):
        (t0, f0), s0 = var.generate(labels, vq, seed=9, **kw)
        for policy in (mc.FastVAR(cache_scale=3, prune={}), mc.FastVAR(cache_scale=0, prune={}, layers=(1, 2))):
            (t1, f1), s1 = var.generate(labels, vq, seed=9, cache=policy.as_dict(), **kw)
            np.testing.assert_array_equal(t1, t0)
            np.testing.assert_array_equal(f1, f0)
            assert [s["flops"] for s in s1] == [s["flops"] for s in s0]
            assert all(s["cache_bytes"] == 0 and s["full"] for s in s1)


def test_python_flop_model_equals_the_telemetry(files):
    """marcache.flops(model, cache=FastVAR(...)) per scale equals the engine's telemetry
    exactly, and the blocks' part equals the reference's count from the definitions."""
    var_path, _, vq_path, _ = files
    model = mc.load(var_path, vae=vq_path)
    config = model.config
    for fields, cfg, smooth in ((dict(cache_scale=3, prune={4: 0.5, 5: 0.75}), 1.5, False),
                                (dict(cache_scale=2, prune={4: 0.4, 5: 1.0}, layers=(1, 3)), 0.0, False),
                                (dict(cache_scale=3, prune={4: 0.99}, skip_last=1), 2.0, True)):
        policy = mc.FastVAR(**fields)
        _, _, info = model.generate_tokens([1, 2], cfg=cfg, more_smooth=smooth, cache=policy, return_info=True)
        report = mc.flops(model, cfg=cfg, cache=policy, batch=2, more_smooth=smooth)
        assert [s["total"] for s in report.per_scale] == [s["flops"] for s in info.steps]
        assert [(s["tokens"], s["keys"]) for s in report.per_scale] == [(s["tokens"], s["kv_rows"])
                                                                       for s in info.steps]
        n_seq = 4 if cfg else 2
        settings = RF.Settings.of_policy(policy)
        for si, s in enumerate(report.per_scale):
            linear, attention = RF.scale_block_flops(config, settings, si, n_seq)
            assert (s["linear"], s["attention"]) == (linear, attention)


def test_flops_of_the_released_models_follow_the_spec():
    """marcache.flops("var_d30", cache=FastVAR()) exactly: the blocks from the reference's
    count of the definitions, the head on every token, word_embed and the conditioning as
    the engine computes them; in the spec's convention the totals of Part E4 (0.1 GFLOP)."""
    for name, depth in (("var_d16", 16), ("var_d30", 30)):
        config = mc.VAR_CONFIGS[name]
        C, V = config["width"], config["vocab"]
        policy = mc.FastVAR()
        report = mc.flops(name, cache=policy)
        settings = RF.Settings.of_policy(policy)
        total = 0
        for si, pn in enumerate(config["patch_nums"]):
            n = pn * pn
            linear, attention = RF.scale_block_flops(config, settings, si, 2)
            total += linear + attention + 2 * 2 * n * C * V
            total += 2 * 1 * n * 32 * C if si > 0 else 2 * 2 * (depth * 6 * C * C + 2 * C * C)
        assert report.total == float(total), name
    e4 = {("var_d16", "harp"): 353.5, ("var_d30", "harp"): 2237.0, ("var_d16", "infinity"): 424.4,
          ("var_d30", "infinity"): 2687.1, ("var_d16", "skip"): 218.3, ("var_d30", "skip"): 1402.0}
    settings = {"harp": mc.FastVAR(), "infinity": mc.FastVAR(prune={8: 0.4, 9: 0.5}),
                "skip": mc.FastVAR(prune={8: 1.0, 9: 1.0})}
    for (name, which), gflop in e4.items():
        got = mc.flops(name, cache=settings[which], convention="spec").total / 1e9
        assert round(got, 1) == gflop, (name, which, got)


def test_guard_equals_cpu_and_counts_the_telemetry_flops(files):
    """On the guard backend FastVAR's tokens and f_hat equal the CPU's bit for bit, and the
    FLOPs dispatched in each scale equal that scale's telemetry exactly."""
    var_path, _, vq_path, _ = files
    caches = [mc.FastVAR(cache_scale=3, prune={4: 0.5, 5: 0.75}).as_dict(),
              mc.FastVAR(cache_scale=2, prune={4: 0.4, 5: 1.0}, layers=(1, 3)).as_dict()]
    same, flops = generate_on_guard_and_cpu(var_path, vq_path, caches)
    assert same
    for dispatched, telemetry in flops:
        assert dispatched == telemetry


# --------------------------------------------------------------------------------------
# the public API and bad input
# --------------------------------------------------------------------------------------

def test_defaults_and_engine_fields():
    p = mc.FastVAR()
    assert (p.cache_scale, p.prune, p.layers, p.skip_last) == (7, {8: 0.5, 9: 0.75}, None, 0)
    d = p.as_dict()
    assert d["policy"] == "fastvar" and d["cache_scale"] == 7 and d["layer_first"] == 0 and d["layer_stop"] == -1
    assert d["prune"] == [-1.0] * 8 + [0.5, 0.75] + [-1.0] * 6
    assert mc.FastVAR(layers=range(3, 28)).layers == (3, 28)
    assert mc.FastVAR(prune={"9": "0.75"}).prune == {9: 0.75}
    assert mc.FastVAR() == mc.FastVAR() and hash(mc.FastVAR()) == hash(mc.FastVAR())
    # r = int(L * rho) in double, as the official code: 0.7 of 10 rows removes 7 (float32 0.7 would remove 6)
    assert mc.FastVAR(cache_scale=0, prune={1: 0.7}).kept_tokens(1, 10) == 3
    assert RF.keep_count(169, 0.5) == 85 and RF.keep_count(256, 0.75) == 64


def test_ratio_rounds_in_double_in_the_engine(models):
    """Kept rows L - int(L rho) with the product in double, as the official int(L * ratio):
    rho = 11/36 removes 11 of the 36 rows of scale 4 (float32(rho) * 36 = 10.99... would
    remove 10), 13/36 removes 13; the telemetry shows it."""
    var, vq, _, _ = models
    for k in (11, 13, 25):
        rho = k / 36
        assert int(36 * rho) == k and int(float(np.float32(rho)) * 36) == k - 1
        policy = mc.FastVAR(cache_scale=3, prune={4: rho})
        (_, _), steps = var.generate(np.array([1], np.int32), vq, cfg=0.0, seed=1, cache=policy.as_dict())
        assert steps[4]["block_rows"] == [[36 - k, 36 - k]] * DEPTH
        assert policy.kept_tokens(4, 36) == 36 - k


@pytest.mark.parametrize("fields, message", [
    (dict(prune={3: 0.5}), r"FastVAR.prune: scale 3 is at or before the cache scale \(cache_scale = 7\)"),
    (dict(prune={7: 0.5}), r"FastVAR.prune: scale 7 is at or before the cache scale"),
    (dict(prune={8: 1.5}), r"FastVAR.prune\[8\] = 1.5: a ratio must be in \[0, 1\]"),
    (dict(prune={8: -0.1}), r"FastVAR.prune\[8\] = -0.1: a ratio must be in \[0, 1\]"),
    (dict(prune={8: float("nan")}), r"FastVAR.prune\[8\] = nan: a ratio must be in \[0, 1\]"),
    (dict(prune={8: True}), r"FastVAR.prune\[8\] = True: a ratio must be in \[0, 1\]"),
    (dict(prune=[0.5]), r"FastVAR.prune must be a dict"),
    (dict(prune={-1: 0.5}), r"FastVAR.prune: scale -1 must be a scale index >= 0"),
    (dict(prune="8=0.5"), r"FastVAR.prune: '8=0.5': expected SCALE:RATIO pairs"),
    (dict(cache_scale=-1), r"FastVAR.cache_scale must be a scale index >= 0"),
    (dict(cache_scale=2.0), r"FastVAR.cache_scale must be a scale index >= 0"),
    (dict(skip_last=-1), r"FastVAR.skip_last must be an integer >= 0"),
    (dict(layers=(5, 5)), r"FastVAR.layers = \(5, 5\): needs 0 <= start < stop"),
    (dict(layers=(-1, 5)), r"FastVAR.layers = \(-1, 5\): needs 0 <= start < stop"),
    (dict(layers=range(0, 10, 2)), r"FastVAR.layers: range\(0, 10, 2\) must have step 1"),
    (dict(layers=3), r"FastVAR.layers must be None or \(start, stop\)"),
])
def test_bad_settings_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        mc.FastVAR(**fields)


@pytest.mark.parametrize("fields, message", [
    (dict(cache_scale=3, prune={4: 0.5, 6: 0.5}), r"FastVAR.prune names scale 6, but the model has scales 0..5"),
    (dict(), r"FastVAR.cache_scale = 7 is outside the model's scales 0..5 \(patch_nums 1,2,3,4,6,8; the "
             r"defaults are for the released 10-scale models"),
    (dict(cache_scale=3, prune={4: 1.0}), r"FastVAR.prune: scale 4 is skipped \(ratio 1\) but scale 5 after it "
                                          r"runs: only trailing scales can be skipped"),
    (dict(cache_scale=3, prune={5: 0.5}, skip_last=1), r"FastVAR.skip_last = 1 skips scale 5, which prune gives "
                                                       r"ratio 0.5"),
    (dict(cache_scale=3, prune={4: 0.5}, skip_last=6), r"FastVAR.skip_last = 6: the model has 6 scales"),
    (dict(cache_scale=3, prune={4: 0.5}, layers=(1, 4)), r"FastVAR.layers = \(1, 4\) is outside the model's "
                                                         r"blocks 0..2"),
])
def test_settings_the_model_refuses_name_the_field(files, fields, message):
    """Checked against the model by VARModel (Python) and by the engine (a hand-made dict)."""
    var_path, _, vq_path, _ = files
    model = mc.load(var_path, vae=vq_path)
    policy = mc.FastVAR(**fields)
    with pytest.raises(ValueError, match=message):
        model.generate_tokens([1], cache=policy)
    with pytest.raises(ValueError, match=message.split(" \\(patch_nums")[0]):
        model._var.generate(np.array([1], np.int32), model._vqvae, cache=policy.as_dict())


@pytest.mark.parametrize("table, message", [
    (dict(prune=[-1.0] * 4 + [-0.5] + [-1.0] * 11), r"FastVAR.prune\[4\] = -0.5: a ratio must be in \[0, 1\]"),
    (dict(prune=[-1.0] * 3 + [0.5] + [-1.0] * 12), r"FastVAR.prune: scale 3 is at or before the cache scale"),
    (dict(layer_first=2, layer_stop=1), r"FastVAR.layers = \(2, 1\): needs 0 <= start < stop"),
    (dict(layer_first=0, layer_stop=4), r"FastVAR.layers = \(0, 4\) is outside the model's blocks 0..2"),
    (dict(cache_scale=9), r"FastVAR.cache_scale = 9 is outside the model's scales 0..5"),
])
def test_engine_checks_a_hand_made_config(models, table, message):
    var, vq, _, _ = models
    cache = dict(mc.FastVAR(cache_scale=3, prune={4: 0.5}).as_dict(), **table)
    with pytest.raises(ValueError, match=message):
        var.generate(np.array([1], np.int32), vq, cache=cache)


def test_policies_of_the_other_family_are_refused(files, tmp_path):
    var_path, _, vq_path, _ = files
    var_model = mc.load(var_path, vae=vq_path)
    with pytest.raises(ValueError, match="LazyMAR is a cache policy for MAR models, not VAR"):
        var_model.generate_tokens([1], cache=mc.LazyMAR())
    from mar_fixtures import write_tiny_mar
    mar_path = tmp_path / "tiny_mar.safetensors"
    write_tiny_mar(str(mar_path))
    mar = mc.load(str(mar_path))
    with pytest.raises(ValueError, match="FastVAR is a cache policy for VAR models, not MAR"):
        mar.generate_tokens([1], steps=2, cache=mc.FastVAR())
    with pytest.raises(ValueError, match="FastVAR is a cache policy for VAR models, not MAR"):
        mc.flops("mar_base", cache=mc.FastVAR())


def test_command_line_settings():
    from marcache.__main__ import make_cache
    p = make_cache("fastvar", ["cache_scale=3", "prune=4:0.5,5:0.75", "layers=1,3", "skip_last=0"])
    assert p == mc.FastVAR(cache_scale=3, prune={4: 0.5, 5: 0.75}, layers=(1, 3))
    assert make_cache("fastvar", ['prune={"9": 1.0}', "layers=none"]) == mc.FastVAR(prune={9: 1.0})


def test_readme_fastvar_table_is_marcache_flops():
    """The README's FastVAR FLOP table holds what marcache.flops computes."""
    import ast
    import re

    readme = open(os.path.join(os.path.dirname(HERE), "README.md")).read()
    rows = re.findall(r"^\| `(FastVAR\(\)|prune=\{[^`]*\})` \([^|]*\) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) %, "
                      r"([\d.]+) % \|$", readme, re.M)
    assert len(rows) == 4
    for setting, d16, d30, share16, share30 in rows:
        policy = mc.FastVAR() if setting == "FastVAR()" else mc.FastVAR(prune=ast.literal_eval(setting[6:]))
        for name, gflop, share in (("var_d16", d16, share16), ("var_d30", d30, share30)):
            total = mc.flops(name, cache=policy).total
            assert f"{total / 1e9:.1f}" == gflop, (setting, name)
            assert f"{100 * total / mc.flops(name).total:.1f}" == share, (setting, name)

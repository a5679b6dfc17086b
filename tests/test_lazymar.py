"""LazyMAR: schedules and kept rows against the spec, exactness when every
step is full, FLOPs against telemetry and the published totals, and bad
configurations. (tests/test_lazymar_reference.py compares whole cached runs
with an independent NumPy implementation.)"""
import numpy as np
import pytest

import comparisons as C
import marcache as mc
from mar_fixtures import write_tiny_mar
from reference import lazymar as LZ
from reference import mar as R
from tolerance import assert_close, worst_share


@pytest.fixture(scope="module")
def weights_and_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("lazy") / "tiny.safetensors"
    W = write_tiny_mar(path, dim=16, depth=6, heads=2, head_width=16, head_depth=6)
    return W, mc.load(path, diffusion_steps=10)


@pytest.fixture(scope="module")
def model(weights_and_model):
    return weights_and_model[1]


SPEC_FULL_64 = [0, 1, 2, 3, 4, 5, 14, 23, 32, 41, 50, 59]


def test_defaults_are_the_official_constants():
    assert mc.LazyMAR().retention == LZ.RETENTION_64  # the table written out in tests (lazymar.md 5.4)
    lz = mc.LazyMAR()
    assert (lz.start, lz.period, lz.select_layer, lz.margin) == (5, 9, 3, 15)
    assert (lz.head_period, lz.head_skip_first, lz.head_skip_last, lz.head_recompute_above) == (7, 1, 4, 0.9)
    assert [s for s in range(64) if lz.is_full_step(s)] == SPEC_FULL_64
    assert [lz.keep_rows(s, 64, 0, 0) for s in (0, 19, 20, 21, 24, 25, 29, 30, 34, 35, 39, 40, 63)] == \
        [320, 320, 192, 160, 160, 128, 128, 48, 48, 38, 38, 16, 16]
    p32 = mc.LazyMAR.preset(32)
    assert (p32.start, p32.period) == (4, 5)
    assert [s for s in range(32) if p32.is_full_step(s)] == [0, 1, 2, 3, 4, 9, 14, 19, 24, 29]
    # normalised progress: 32 steps read entries 0, 2, 4, ...; 256 steps repeat each entry 4 times
    assert [lz.retention_at(s, 32) for s in (9, 10, 11, 12, 13)] == [1.0, 0.6, 0.5, 0.5, 0.4]
    assert [lz.retention_at(s, 256) for s in range(80, 84)] == [0.6] * 4


def test_official_64_step_schedule_and_kept_rows(model):
    """lazymar.md 3 and 5.8: full steps, encoder rows and decoder rows kept per step."""
    _, info = model.generate_tokens(labels=[1, 2], steps=64, cfg=3.0, seed=0, cache=mc.LazyMAR(),
                                    return_info=True)
    steps = info.steps
    assert [s["step"] for s in steps if s["full"]] == SPEC_FULL_64
    B = 2
    kept = [s["decoder_kept_rows"] // B for s in steps]
    enc = [s["encoder_rows"] for s in steps]
    for s in range(64):
        if steps[s]["full"]:
            assert steps[s]["decoder_kept_rows"] == steps[s]["decoder_rows"] == 2 * B * 320
            assert enc[s] == 2 * B * (64 + 256 - steps[s]["masked_before"])
            continue
        m, p = steps[s]["predicted"], steps[s - 1]["predicted"]
        assert enc[s] == B * (64 + p)  # cond only: buffer + tokens revealed last step
        assert 65 <= enc[s] // B <= 71
        if 6 <= s <= 19:
            assert kept[s] == 320
        elif s == 20:
            assert kept[s] == 192
        elif s in (21, 22, 24):
            assert kept[s] == 160
        elif 25 <= s <= 29:
            assert kept[s] == 128
        elif s in (30, 31, 33, 34):
            assert kept[s] == 48
        elif 35 <= s <= 39:
            assert kept[s] == 38
        else:
            assert kept[s] == m + p + 15 and 25 <= kept[s] <= 28
    # the condition cache skips the unconditional branch on cached steps
    assert all(s["decoder_rows"] == B * 320 for s in steps if not s["full"])
    # diffusion-head cache: 16 full evaluations of 100, here 10 steps: j = 9 and multiples of 7
    assert all(s["head_evaluations"] - s["head_cached_evaluations"] == 3 for s in steps)
    assert all(s["cache_bytes"] > 0 for s in steps)


@pytest.mark.parametrize("cfg,labels", [(3.0, [5, 6]), (1.0, [5, 6]), (2.0, None)])
def test_every_step_full_equals_nocache_bitwise(model, cfg, labels):
    n = None if labels else 2
    plain = model.generate_tokens(labels=labels, num_images=n, steps=12, cfg=cfg, seed=3)
    lazy = model.generate_tokens(labels=labels, num_images=n, steps=12, cfg=cfg, seed=3,
                                 cache=mc.LazyMAR(period=1, head_cache=False))
    assert np.array_equal(plain, lazy)


@pytest.mark.parametrize("flags", [dict(), dict(token_cache=False), dict(cond_cache=False), dict(head_cache=False),
                                   dict(token_cache=False, cond_cache=False)])
@pytest.mark.parametrize("steps,cfg", [(16, 3.0), (64, 2.9), (20, 1.0)])
def test_telemetry_flops_equal_marcache_flops(model, flags, steps, cfg):
    lz = mc.LazyMAR(start=2, period=4, **flags)
    _, info = model.generate_tokens(labels=[1, 2, 3], steps=steps, cfg=cfg, seed=1, cache=lz, return_info=True)
    rep = mc.flops(model, steps=steps, cfg=cfg, cache=lz, batch=3)
    assert [s["flops"] for s in info.steps] == pytest.approx(rep.per_step, rel=1e-12)


@pytest.mark.parametrize("steps", [1, 8, 32, 100, 300])
def test_any_step_count_runs(model, steps):
    tokens, info = model.generate_tokens(labels=[7], steps=steps, cfg=2.5, seed=2, cache=mc.LazyMAR(),
                                         return_info=True)
    assert np.isfinite(tokens).all() and sum(s["predicted"] for s in info.steps) == 256
    rep = mc.flops(model, steps=steps, cfg=2.5, cache=mc.LazyMAR(), batch=1)
    assert info.flops == pytest.approx(rep.total, rel=1e-12)


@pytest.mark.parametrize("steps", [1, 3, 7, 13])
def test_any_step_count_matches_reference(weights_and_model, steps):
    """The default LazyMAR at step counts other than 8 (test_lazymar_reference) and 64
    (the schedule test above), against the float64 reference: 1 and 3 steps are all
    full; 7 caches step 6; 13 caches steps 6..12, pruning from table entry 29 on.
    Tolerance: comparisons.TOKEN_ROW_ATOL (2e-6 of each token's largest channel)."""
    W, model = weights_and_model
    lz = mc.LazyMAR()
    tokens, info = model.generate_tokens(labels=[7], steps=steps, cfg=2.5, seed=2, cache=lz, return_info=True)
    ref, log = LZ.generate_tokens_lazymar(W, np.array([7]), 1, steps, 2.5, "linear", 1.0, 2, 0, 2, lz,
                                          R.diffusion_tables(10))
    assert [s["full"] for s in info.steps] == [e["full"] for e in log]
    assert [s["decoder_kept_rows"] for s in info.steps] == [e["sequences"] * e["n_keep"] for e in log]
    assert_close(tokens, ref, 0.0, C.TOKEN_ROW_ATOL * np.abs(ref).max(axis=-1, keepdims=True), "tokens")


def test_cached_run_stays_close_to_nocache_and_is_batch_invariant(model):
    """On this random model (0.05-scale weights) the cache changes the tokens, but only
    slightly: measured at most 2.2e-5 of each token's largest channel (median 4e-7),
    bound 1e-4; another seed moves them by ~3.6 of it. Image 1 alone equals image 1 of
    the batch to 1e-5 of its token's largest channel (float32 row splits only)."""
    plain = model.generate_tokens(labels=[3, 4, 5], steps=16, cfg=3.0, seed=8)
    lazy = model.generate_tokens(labels=[3, 4, 5], steps=16, cfg=3.0, seed=8, cache=mc.LazyMAR(start=2, period=4))
    row_scale = np.abs(plain).max(axis=-1, keepdims=True)
    assert worst_share(lazy, plain, 0.0, 1e-6 * row_scale) > 1  # the cache really changes the computation
    assert_close(lazy, plain, 0.0, 1e-4 * row_scale, "LazyMAR against no cache")
    alone = model.generate_tokens(labels=[4], steps=16, cfg=3.0, seed=8, first_index=1,
                                  cache=mc.LazyMAR(start=2, period=4))
    assert_close(alone[0], lazy[1], 0.0, 1e-5 * np.abs(lazy[1]).max(axis=-1, keepdims=True), "image 1 alone")


@pytest.mark.parametrize("name,spec_total", [("mar_base", 5.30), ("mar_large", 11.9), ("mar_huge", 23.6)])
def test_flops_match_the_published_lazymar_totals(name, spec_total):
    """lazymar.md 10.3: derived LazyMAR totals at 64 steps with CFG, counted the way the
    official code computes (convention="reference"); marcache itself computes fewer."""
    base_ref = mc.flops(name, steps=64, cfg=2.9, convention="reference").total
    lazy_ref = mc.flops(name, steps=64, cfg=2.9, cache=mc.LazyMAR(), convention="reference").total
    assert lazy_ref / 1e12 == pytest.approx(spec_total, rel=0.03)
    assert base_ref / lazy_ref >= 2.7
    base = mc.flops(name, steps=64, cfg=2.9).total
    lazy = mc.flops(name, steps=64, cfg=2.9, cache=mc.LazyMAR()).total
    assert lazy < lazy_ref and base / lazy >= 2.7


@pytest.mark.parametrize("kwargs,error", [
    (dict(period=0), ValueError), (dict(start=-1), ValueError), (dict(margin=-2), ValueError),
    (dict(retention=(1.0,) * 63), ValueError), (dict(retention=(1.5,) * 64), ValueError),
    (dict(head_recompute_above=2.0), ValueError), (dict(token_cache=1), TypeError),
    (dict(head_skip_first=3, head_skip_last=1), ValueError),
])
def test_bad_configs_are_refused(kwargs, error):
    with pytest.raises(error):
        mc.LazyMAR(**kwargs)


def test_select_layer_beyond_the_decoder(model):
    with pytest.raises(ValueError, match="select_layer"):
        model.generate_tokens(labels=[1], steps=4, cache=mc.LazyMAR(select_layer=6))
    with pytest.raises(ValueError, match="presets"):
        mc.LazyMAR.preset(48)

"""MARche in the C engine against the independent float64 reference
(tests/reference/marche.py, written from /work/shared/spec/marche.md and the
marcache.MARche docstring), on tiny random models in the official key
layout, in the manner of test_lazymar_reference.py.

Compared per run: the tokens element by element (each within
comparisons.AMPLIFIED_ROW_ATOL = 1e-5 of its own token's largest channel), which AR
steps are full, the active rows of every cached sequence on every cached step
(engine trace_rows "kept_rows" == reference, exactly), decoder_kept_rows,
encoder_rows and the number of cached head timesteps.

As in the LazyMAR reference test the attention QKV weights are scaled up
(qkv_gain of mar_fixtures.AMPLIFIED) so that attention is sharp: stale K/V
and the choice of refreshed rows then matter, and test_row_choice_is_visible_in_tokens shows that
swapping one active row for the next-ranked candidate at every cached step
moves the tokens far beyond the tolerance. The head's cond_embed / adaLN /
MLP weights are scaled up too (head_gain) so that the head cache matters
(test_composed_options_are_visible_in_tokens). Every selection boundary
must have a relative relevance gap of at least GAP_MIN, so the float32
ranking of the engine is well defined: feeding the engine's tokens into the
reference moves the relevances by at most ~5e-6 relative on these models.
"""
import dataclasses

import numpy as np
import pytest

import comparisons as C
import marcache as mc
from mar_fixtures import AMPLIFIED, amplified_tiny
from reference import marche as MC
from reference import mar as R
from tolerance import assert_close, worst_share

HEADS = AMPLIFIED["heads"]  # the model: mar_fixtures.AMPLIFIED
GAP_MIN = 1e-4     # relative relevance gap at every selection boundary
STEPS = 8          # n_pred 5, 15, 24, 31, 39, 45, 48, 49
P, S = 64, 256
L = P + S


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return amplified_tiny(tmp_path_factory.mktemp("marche_ref"))


# name -> (config, run arguments); the engine runs are shared between tests
CASES = {
    # (a) paper defaults except the 8-step schedule and a budget that leaves
    # refreshing choices (steps 1, 2, 4: 60, 41 and 10 refreshed rows); CFG on,
    # both halves select their own rows
    "a": (mc.MARche(budget=80),
          dict(labels=[1, 2], cfg=3.0, diffusion_steps=10)),
    # (b) image candidates, low-relevance refresh, select layer 1 of 3 full
    # layers; full steps 0, 1, 5 (choices at steps 2, 3, 4)
    "b": (mc.MARche(budget=80, candidates="image", refresh="low", select_layer=1, full_layers=3,
                    refresh_period=4, refresh_phase=1),
          dict(labels=[3, 11], cfg=3.0, diffusion_steps=10, temperature=0.9, schedule="constant")),
    # (c) cfg == 1: B sequences, unconditional
    "c": (mc.MARche(budget=72),
          dict(labels=None, num_images=2, cfg=1.0, diffusion_steps=10)),
    # (d) the composition: LazyMAR's encoder, condition and head caches, the
    # 100-step head sampler (head timesteps 99, 98, 91, ..., 0 full, MLP
    # recompute at 92..97)
    "d": (mc.MARche(budget=80, encoder_cache=True, cond_cache=True, head_cache=True),
          dict(labels=[7, 400], cfg=2.5, diffusion_steps=100)),
    # (f) App. D's "full at layer 1 only" (select and full layer 1) with the
    # encoder cache on both CFG halves (no condition cache); full steps 0, 4
    "f": (mc.MARche(budget=64, select_layer=1, full_layers=1, encoder_cache=True, refresh_period=4),
          dict(labels=[8, 21], cfg=3.0, diffusion_steps=10)),
    # (e) every row active: plain MAR
    "e": (mc.MARche(budget=320),
          dict(labels=[1, 2], cfg=3.0, diffusion_steps=10)),
}


def _args(kw):
    n = len(kw["labels"]) if kw["labels"] is not None else kw["num_images"]
    return dict(labels=kw["labels"], n=n, cfg=kw["cfg"], diffusion_steps=kw["diffusion_steps"],
                temperature=kw.get("temperature", 1.0), schedule=kw.get("schedule", "linear"))


@pytest.fixture(scope="module")
def engine_runs(tiny):
    model, _ = tiny
    runs = {}

    def run(name):
        if name == "a":   # the same run as comparisons.MARCHE_DEFAULTS: computed once
            return C.MARCHE_DEFAULTS.engine()
        if name not in runs:
            cache, kw = CASES[name]
            a = _args(kw)
            runs[name] = model(a["diffusion_steps"]).generate_tokens(
                labels=a["labels"], num_images=None if a["labels"] is not None else a["n"], steps=STEPS,
                cfg=a["cfg"], cfg_schedule=a["schedule"], temperature=a["temperature"], seed=3, first_index=1,
                cache=cache, return_info=True, trace_rows=True)
        return runs[name]

    return run


def _reference(tiny, name, cache=None):
    _, W = tiny
    default_cache, kw = CASES[name]
    a = _args(kw)
    labels = None if a["labels"] is None else np.array(a["labels"])
    return MC.generate_tokens_marche(W, labels, a["n"], STEPS, a["cfg"], a["schedule"], a["temperature"], 3, 1,
                                     HEADS, cache if cache is not None else default_cache,
                                     R.diffusion_tables(a["diffusion_steps"]))


def _check(tokens, info, ref, log, expect_choices=True):
    steps = info.steps
    assert [s["full"] for s in steps] == [e["full"] for e in log]
    assert [s["decoder_kept_rows"] for s in steps] == [e["decoder_kept_rows"] for e in log]
    assert [s["encoder_rows"] for s in steps] == [e["encoder_rows"] for e in log]
    assert [s["head_cached_evaluations"] for s in steps] == [e["head_cached"] for e in log]
    for s, e in zip(steps, log):
        if e["full"]:
            assert "kept_rows" not in s or s["kept_rows"] is None
            continue
        got = np.asarray(s["kept_rows"])
        assert got.dtype == np.int32
        want = e["active"]
        if not np.array_equal(got, want):
            diff = [(b, sorted(set(got[b].tolist()) - set(want[b].tolist())),
                     sorted(set(want[b].tolist()) - set(got[b].tolist())))
                    for b in range(len(want)) if got.shape != want.shape or not np.array_equal(got[b], want[b])]
            pytest.fail("step %d: active rows differ (sequence, engine only, reference only): %r"
                        % (e["step"], diff))
    if expect_choices:
        assert any(np.isfinite(e["select_gap"]) for e in log), "no cached step had a refreshing choice"
    # the row choice is well defined: no near ties at the selection boundary
    assert min(e["select_gap"] for e in log) > GAP_MIN
    assert np.isfinite(tokens).all()
    assert_close(tokens, ref, 0.0, token_atol(ref), "tokens")


def token_atol(ref):
    """comparisons.AMPLIFIED_ROW_ATOL of each token's largest channel (see comparisons.py)."""
    return C.AMPLIFIED_ROW_ATOL * np.abs(np.asarray(ref, np.float64)).max(axis=-1, keepdims=True)


def far_off(tokens, ref):
    """How far tokens are from ref in units of the tolerance (worst_share)."""
    return worst_share(tokens, ref, 0.0, token_atol(ref))


def test_paper_defaults_short_schedule(tiny, engine_runs):
    """(a) budget 80 of 320, select layer 2, full layers 1-2, refresh every 3 steps."""
    # the run of comparisons.MARCHE_DEFAULTS, which test_mutations mutates
    assert (CASES["a"][0], CASES["a"][1]["labels"]) == (mc.MARche(budget=80), [1, 2])
    (tokens, info), (ref, log) = C.MARCHE_DEFAULTS.engine(), C.MARCHE_DEFAULTS.reference()
    assert [e["full"] for e in log] == [True, False, False, True, False, False, True, False]
    assert [e["n_active"] for e in log if not e["full"]] == [80, 80, 80, 84, 97]
    assert all(e["sequences"] == 4 for e in log)
    # buffer rows are candidates and some of them are refreshed
    assert any((e["active"] < P).any() for e in log if not e["full"])
    _check(tokens, info, ref, log)


def test_image_candidates_low_refresh_select_layer_1(tiny, engine_runs):
    """(b) candidates="image", refresh="low", select_layer 1, full_layers 3, phase 1."""
    tokens, info = engine_runs("b")
    ref, log = _reference(tiny, "b")
    assert [e["full"] for e in log] == [True, True, False, False, False, True, False, False]
    assert [e["n_active"] for e in log if not e["full"]] == [80, 80, 80, 93, 97]
    assert all((e["active"] >= P).all() for e in log if not e["full"])
    _check(tokens, info, ref, log)


def test_cfg_off(tiny, engine_runs):
    """(c) cfg == 1: the B (unconditional) sequences select their rows."""
    tokens, info = engine_runs("c")
    ref, log = _reference(tiny, "c")
    assert all(e["sequences"] == 2 for e in log)
    _check(tokens, info, ref, log)


def test_encoder_condition_and_head_caches(tiny, engine_runs):
    """(d) encoder_cache + cond_cache + head_cache: the cached steps run the
    conditional sequences only, through LazyMAR's cached encoder, and the head
    uses LazyMAR's head cache on every AR step."""
    tokens, info = engine_runs("d")
    ref, log = _reference(tiny, "d")
    assert [e["sequences"] for e in log] == [4, 2, 2, 4, 2, 2, 4, 2]
    assert all(e["head_cached"] == 84 for e in log)
    _check(tokens, info, ref, log)


def test_layer_1_only_with_encoder_cache_on_both_halves(tiny, engine_runs):
    """(f) select_layer = full_layers = 1, encoder_cache without cond_cache:
    2B sequences, each with its own encoder and decoder caches."""
    tokens, info = engine_runs("f")
    ref, log = _reference(tiny, "f")
    assert [e["full"] for e in log] == [True, False, False, False, True, False, False, False]
    assert all(e["sequences"] == 4 for e in log)
    _check(tokens, info, ref, log)


def test_budget_320_is_plain_mar(tiny, engine_runs):
    """(e) budget 320: every row active on the cached steps, and the output is
    plain MAR (reference against reference to 1e-12, engine against both)."""
    tokens, info = engine_runs("e")
    ref, log = _reference(tiny, "e")
    for e in log:
        if not e["full"]:
            assert np.array_equal(e["active"], np.tile(np.arange(L), (4, 1)))
    _check(tokens, info, ref, log, expect_choices=False)
    _, W = tiny
    plain, _ = R.generate_tokens(W, np.array([1, 2]), 2, STEPS, 3.0, "linear", 1.0, 3, 1, HEADS,
                                 R.diffusion_tables(10))
    assert np.array_equal(ref, plain)
    assert_close(tokens, plain, 0.0, token_atol(plain), "tokens against plain MAR")


def test_reference_selection_rules():
    """Reference self-check of the selection rule on a hand-made relevance:
    high/low order, ties to the lower row, forced rows, image candidates."""
    rel = np.array([0.5, 0.9, 0.1, 0.9, 0.3, 0.7, 0.2, 0.05])
    rows, gap = MC.select_active(rel, [6], 4, 2, "all", "high")
    assert rows.tolist() == [1, 3, 5, 6] and gap == pytest.approx((0.7 - 0.5) / 0.7)
    rows, _ = MC.select_active(rel, [6], 3, 2, "all", "high")     # tie 0.9/0.9: lower row first
    assert rows.tolist() == [1, 3, 6]
    rows, _ = MC.select_active(rel, [6], 4, 2, "all", "low")
    assert rows.tolist() == [2, 4, 6, 7]
    rows, _ = MC.select_active(rel, [6], 4, 2, "image", "high")    # rows 0, 1 are not candidates
    assert rows.tolist() == [3, 4, 5, 6]
    rows, gap = MC.select_active(rel, [6, 7], 2, 2, "all", "high")
    assert rows.tolist() == [6, 7] and gap == np.inf
    for m in (mc.MARche(budget=64), mc.MARche(budget=300, candidates="image")):
        for g, c in [(1, 0), (5, 15), (40, 30), (200, 50)]:
            assert MC.active_count(m, g, c, L, S) == m.active_rows(g, c)
    assert [s for s in range(10) if MC.is_full_step(mc.MARche(refresh_phase=2, refresh_period=4), s)] == [0, 1, 2, 6]


@pytest.mark.parametrize("name", ["a", "b"])
def test_row_choice_is_visible_in_tokens(tiny, engine_runs, monkeypatch, name):
    """Swapping the last refreshed row for the first dropped candidate at
    every cached step with a choice moves the tokens far beyond the tolerance, so
    matching tokens checks the choice (besides the exact kept_rows check)."""
    tokens, _ = engine_runs(name)
    cache = CASES[name][0]
    plain = MC.select_active
    swaps = []

    def swapped(rel, forced, n_active, P_, candidates, refresh):
        chosen, gap = plain(rel, forced, n_active, P_, candidates, refresh)
        forced = np.unique(forced)
        order = MC.rank_candidates(rel, forced, P_, candidates, refresh)
        take = n_active - len(forced)
        if 0 < take < len(order):
            chosen = np.sort(np.concatenate([forced, order[:take - 1], order[take:take + 1]]))
            swaps.append(take)
        return chosen, gap

    monkeypatch.setattr(MC, "select_active", swapped)
    ref_swapped, _ = _reference(tiny, name, cache)
    assert swaps
    assert far_off(tokens, ref_swapped) > 10


@pytest.mark.parametrize("change", [dict(encoder_cache=False), dict(cond_cache=False), dict(head_cache=False)],
                         ids=["encoder_cache_off", "cond_cache_off", "head_cache_off"])
def test_composed_options_are_visible_in_tokens(tiny, engine_runs, change):
    """Switching off any one of the composed caches of (d) moves the tokens
    far beyond the tolerance, so (d) checks each of them."""
    tokens, _ = engine_runs("d")
    ref, _ = _reference(tiny, "d", dataclasses.replace(CASES["d"][0], **change))
    assert far_off(tokens, ref) > 10


@pytest.mark.parametrize("comparison", C.MARCHE_HEAD_CACHE, ids=lambda c: c.name)
def test_head_cache_matches_reference(comparison):
    """LazyMAR's head cache under MARche (every AR step a refresh step, 10 diffusion
    steps, head_period 3, recompute above 0.7): on the v_dominant model at temperature
    300, where v on the cached head timesteps decides the tokens, and on the amplified
    model at temperature 1 (comparisons.py; test_mutations shows each rule's variant
    fails it)."""
    tokens, info = comparison.engine()
    ref, log = comparison.reference()
    assert [s["head_cached_evaluations"] for s in info.steps] == [e["head_cached"] for e in log] == [6, 6]
    comparison.check()

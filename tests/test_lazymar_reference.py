"""LazyMAR in the C engine against the independent float64 reference
(tests/reference/lazymar.py, written from /work/shared/spec/lazymar.md), on
tiny random models in the official key layout.

Compared per run: the tokens element by element (each within
comparisons.AMPLIFIED_ROW_ATOL = 1e-5 of its own token's largest channel), which AR
steps are full, the decoder rows kept per sequence (engine
decoder_kept_rows / sequences == reference n_keep), the encoder query rows,
and the number of cached head timesteps. The engine does not expose the kept
row indices; test_row_choice_is_visible_in_tokens shows that choosing one
different row moves the tokens far beyond the tolerance on these models, so
matching tokens does check which rows were kept.

The models' attention QKV weights are scaled up (qkv_gain of
mar_fixtures.AMPLIFIED) so that attention is sharp enough for stale K/V and
the row choice to matter; with the plain
0.05-scale random weights every layer-3 V cosine is ~0.99999 and the
selection would be a near tie with no visible effect. Likewise the head's
cond_embed / adaLN / MLP weights (head_gain): with the plain weights the res
blocks barely move h, and switching the whole head cache off changed the
tokens by less than the tolerance. test_head_cache_is_visible_in_tokens
checks that each head-cache rule now matters.
"""
import numpy as np
import pytest

import comparisons as C
import marcache as mc
from mar_fixtures import AMPLIFIED, amplified_tiny
from reference import lazymar as LZ
from reference import mar as R
from tolerance import assert_close, worst_share

HEADS = AMPLIFIED["heads"]  # the model: mar_fixtures.AMPLIFIED
STEPS = C.LAZYMAR_STEPS
SCHEDULE = C.LAZYMAR_SCHEDULE        # full steps 0, 1, 2, 6; cached 3, 4, 5, 7
RETENTION = C.LAZYMAR_RETENTION      # entries < 1 prune within 8 steps (entries 24.. -> steps 3..)


def token_atol(ref):
    """comparisons.AMPLIFIED_ROW_ATOL of each token's largest channel (see comparisons.py)."""
    return C.AMPLIFIED_ROW_ATOL * np.abs(np.asarray(ref, np.float64)).max(axis=-1, keepdims=True)


def far_off(tokens, ref):
    """How far tokens are from ref in units of the tolerance (worst_share)."""
    return worst_share(tokens, ref, 0.0, token_atol(ref))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return amplified_tiny(tmp_path_factory.mktemp("lazymar"))


def _run_both(tiny, lz, labels, cfg, diffusion_steps, num_images=None, steps=STEPS, seed=3, first_index=1,
              temperature=1.0, schedule="linear"):
    model, W = tiny
    m = model(diffusion_steps)
    tokens, info = m.generate_tokens(labels=labels, num_images=num_images, steps=steps, cfg=cfg,
                                     cfg_schedule=schedule, temperature=temperature, seed=seed,
                                     first_index=first_index, cache=lz, return_info=True)
    n = len(labels) if labels is not None else num_images
    ref, log = LZ.generate_tokens_lazymar(W, None if labels is None else np.array(labels), n, steps, cfg,
                                          schedule, temperature, seed, first_index, HEADS, lz,
                                          R.diffusion_tables(diffusion_steps))
    return tokens, info, ref, log


def _check(tokens, info, ref, log, expect_pruned=True):
    assert [s["full"] for s in info.steps] == [e["full"] for e in log]
    assert [s["encoder_rows"] for s in info.steps] == [e["encoder_rows"] for e in log]
    assert [s["decoder_kept_rows"] for s in info.steps] == [e["sequences"] * e["n_keep"] for e in log]
    assert [s["head_cached_evaluations"] for s in info.steps] == [e["head_cached"] for e in log]
    if expect_pruned:
        assert any(e["kept"] is not None and e["n_keep"] < 320 for e in log), "no cached step pruned rows"
    # the row choice is well defined: no near ties at the selection boundary
    assert min(e["select_gap"] for e in log) > 1e-6
    assert np.isfinite(tokens).all()
    assert_close(tokens, ref, 0.0, token_atol(ref), "tokens")


def test_token_and_condition_cache_with_pruning():
    """(a) token + condition cache, head cache off, cached steps that prune
    (comparisons.LAZYMAR_TOKEN_CACHE, the run test_mutations mutates)."""
    (tokens, info), (ref, log) = C.LAZYMAR_TOKEN_CACHE.engine(), C.LAZYMAR_TOKEN_CACHE.reference()
    assert [e["full"] for e in log] == [True, True, True, False, False, False, True, False]
    assert [e["n_keep"] for e in log if not e["full"]] == [160, 85, 99, 128]
    _check(tokens, info, ref, log)


ALL_DEFAULTS = dict(labels=[7, 400], cfg=2.5, diffusion_steps=100)


@pytest.fixture(scope="module")
def all_defaults_engine(tiny):
    model, _ = tiny
    a = ALL_DEFAULTS
    return model(a["diffusion_steps"]).generate_tokens(labels=a["labels"], steps=STEPS, cfg=a["cfg"], seed=3,
                                                       first_index=1, cache=mc.LazyMAR(**SCHEDULE),
                                                       return_info=True)


def _reference(tiny, lz, labels, cfg, diffusion_steps):
    _, W = tiny
    return LZ.generate_tokens_lazymar(W, np.array(labels), len(labels), STEPS, cfg, "linear", 1.0, 3, 1, HEADS, lz,
                                      R.diffusion_tables(diffusion_steps))


def test_all_caches_default_parameters(tiny, all_defaults_engine):
    """(b) all three caches with the default parameters except start/period,
    the full 100-step head sampler (full head timesteps 99, 98, 91, ..., 0;
    MLP recompute at 92..97)."""
    tokens, info = all_defaults_engine
    # the reference reads the spec's retention table written out in tests (RETENTION_64),
    # the engine its own default
    ref, log = _reference(tiny, mc.LazyMAR(**SCHEDULE, retention=LZ.RETENTION_64), **ALL_DEFAULTS)
    assert all(e["head_cached"] == 84 for e in log)
    _check(tokens, info, ref, log)


@pytest.mark.parametrize("change", [dict(head_cache=False), dict(head_recompute_above=1.0),
                                    dict(head_skip_last=3), dict(head_period=8)],
                         ids=["head_cache_off", "no_mlp_recompute", "skip_1_to_3", "head_period_8"])
def test_head_cache_is_visible_in_tokens(tiny, all_defaults_engine, change):
    """Each head-cache rule moves the tokens of (b) far beyond the tolerance, so (b)
    checks them (with the plain random weights it would not)."""
    tokens, _ = all_defaults_engine
    ref, _ = _reference(tiny, mc.LazyMAR(**SCHEDULE, **change), **ALL_DEFAULTS)
    assert far_off(tokens, ref) > 10


def test_cfg_off(tiny):
    """(c) cfg == 1: B sequences cached, no condition cache; unconditional."""
    lz = mc.LazyMAR(retention=RETENTION, **SCHEDULE)
    tokens, info, ref, log = _run_both(tiny, lz, None, 1.0, diffusion_steps=10, num_images=2)
    assert all(e["sequences"] == 2 for e in log)
    _check(tokens, info, ref, log)


def test_cfg_without_condition_cache(tiny):
    """(d) CFG with cond_cache=False: both halves cached, each with its own caches."""
    lz = mc.LazyMAR(cond_cache=False, retention=RETENTION, **SCHEDULE)
    tokens, info, ref, log = _run_both(tiny, lz, [3, 11], 3.0, diffusion_steps=10, temperature=0.9,
                                       schedule="constant")
    assert all(e["sequences"] == 4 for e in log)
    _check(tokens, info, ref, log)


def test_condition_cache_only(tiny):
    """(e) token_cache=False: the cached steps run the conditional branch only."""
    lz = mc.LazyMAR(token_cache=False, retention=RETENTION, **SCHEDULE)
    tokens, info, ref, log = _run_both(tiny, lz, [1, 2], 3.0, diffusion_steps=10)
    assert [e["sequences"] for e in log] == [4, 4, 4, 2, 2, 2, 4, 2]
    _check(tokens, info, ref, log, expect_pruned=False)


def test_reference_reduces_to_plain_mar(tiny):
    """Reference self-check: every step full and no head cache is plain MAR."""
    _, W = tiny
    tables = R.diffusion_tables(5)
    lz = mc.LazyMAR(start=0, period=1, head_cache=False)
    a, log = LZ.generate_tokens_lazymar(W, np.array([4, 5]), 2, 4, 2.0, "linear", 1.0, 9, 0, HEADS, lz, tables)
    b, _ = R.generate_tokens(W, np.array([4, 5]), 2, 4, 2.0, "linear", 1.0, 9, 0, HEADS, tables)
    assert all(e["full"] for e in log)
    assert np.array_equal(a, b)


def test_row_choice_is_visible_in_tokens(tiny, monkeypatch):
    """Swapping one kept row for the next-ranked dropped one at every pruned
    step moves the tokens far beyond the tolerance: matching tokens checks the choice."""
    model, W = tiny
    lz = mc.LazyMAR(head_cache=False, retention=RETENTION, **SCHEDULE)
    tokens = model(10).generate_tokens(labels=[1, 2], steps=STEPS, cfg=3.0, seed=3, first_index=1, cache=lz)
    plain = LZ.select_rows

    def swapped(score, forced, n):
        chosen, gap = plain(score, forced, n)
        forced = np.unique(forced)
        free = np.setdiff1d(np.arange(len(score)), forced)
        order = free[np.lexsort((free, score[free]))]
        take = n - len(forced)
        if 0 < take < len(order):
            chosen = np.sort(np.concatenate([forced, order[:take - 1], order[take:take + 1]]))
        return chosen, gap

    monkeypatch.setattr(LZ, "select_rows", swapped)
    ref_swapped, _ = LZ.generate_tokens_lazymar(W, np.array([1, 2]), 2, STEPS, 3.0, "linear", 1.0, 3, 1, HEADS,
                                                lz, R.diffusion_tables(10))
    assert far_off(tokens, ref_swapped) > 10


@pytest.mark.parametrize("comparison", C.LAZYMAR_HEAD_CACHE, ids=lambda c: c.name)
def test_head_cache_matches_reference(comparison):
    """The head cache alone (every AR step full, 10 diffusion steps, head_period 3,
    recompute above 0.7): on the v_dominant model at temperature 300, where v on the
    cached head timesteps decides the tokens, and on the amplified model at temperature
    1, where the cached eps rules do (comparisons.py; test_mutations shows each
    rule's variant fails it)."""
    tokens, info = comparison.engine()
    ref, log = comparison.reference()
    assert [s["head_cached_evaluations"] for s in info.steps] == [e["head_cached"] for e in log] == [6, 6]
    comparison.check()


def test_retention_table_is_the_spec_table():
    """lazymar.md 5.4: the implementation's 64-entry table equals the one written out
    in tests/reference/lazymar.py (all 64 entries, including the full steps' 23, 32, 41,
    50, 59 that no run reads)."""
    assert len(LZ.RETENTION_64) == 64
    assert mc.LazyMAR().retention == LZ.RETENTION_64
    assert [mc.LazyMAR().retention_at(s, 64) for s in range(64)] == list(LZ.RETENTION_64)

"""DiSA (issue 20): the respaced DDPM tables against a from-scratch float64 computation
(tests/reference/disa.py), the official clip's tables, the annealed sampler against
the float64 reference, NoCache's bits at start = end = 100 without the clip, the
compositions with LazyMAR and MARche (head-cache plans on the respaced indices, the
guard backend's bits, no allocation in the loop), and bad input."""
import numpy as np
import pytest

import marcache as mc
from marcache import _C
from marcache.policies import resolve
from marcache.policies.disa import respaced_timesteps
from mar_fixtures import guard_generate_json, write_tiny_mar
from reference import disa as RD
from reference import mar as R
from tolerance import assert_close

HEADS = 2
TABLE_KEYS = ("betas", "alphas_cumprod", "sqrt_recip_alphas_cumprod", "sqrt_recipm1_alphas_cumprod",
              "posterior_variance", "posterior_log_variance_clipped", "posterior_mean_coef1",
              "posterior_mean_coef2", "log_betas")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The seams test's tiny model (6 decoder layers, 6 head blocks), loaded with the
    default 100 diffusion steps so that DiSA(100, 100, clip=None) is the model's own."""
    path = tmp_path_factory.mktemp("disa") / "tiny.safetensors"
    W = write_tiny_mar(path, seed=3, heads=HEADS, dim=16, depth=6, head_width=16, head_depth=6)
    return mc.load(path), W, path


@pytest.mark.parametrize("clip", [None, 950, 500, 0])
@pytest.mark.parametrize("steps", [1, 2, 5, 13, 48, 50, 100, 333, 1000])
def test_respaced_tables_equal_a_float64_computation(steps, clip):
    """The engine's float64 tables (runtime/diffusion.c) against reference/disa.py's
    from-scratch computation: timesteps exact, every table to 1e-12 relative (both are
    float64; the two compute the cumulative products in different orders)."""
    engine = _C.diffusion_tables(steps, 999 if clip is None else clip)
    ref = RD.respaced_tables(steps, clip)
    assert engine["timesteps"].tolist() == ref["timesteps"].tolist()
    assert respaced_timesteps(steps, clip) == ref["timesteps"].tolist()  # the Python FLOP model's count
    for key in TABLE_KEYS:
        finite = np.isfinite(ref[key])
        assert np.array_equal(np.isfinite(engine[key]), finite), key
        assert_close(engine[key][finite], ref[key][finite], rtol=1e-12, atol=0.0, what=f"{key} ({steps}, {clip})")


def test_official_clip_gives_the_official_disa_tables():
    """disa.md: with the DiSA sampler's clip of 950, a 50-step respacing keeps 48
    distinct timesteps, the top three 917, 938, 950, and starts at t = 950; without the
    clip (the official "default" sampler, clip 1001) it is MAR's 50-step respacing."""
    clipped = _C.diffusion_tables(50, 950)
    assert len(clipped["timesteps"]) == 48
    assert clipped["timesteps"][-3:].tolist() == [917, 938, 950]
    plain = _C.diffusion_tables(50)
    assert len(plain["timesteps"]) == 50 and plain["timesteps"][-1] == 999
    assert plain["timesteps"].tolist() == R.space_timesteps(1000, "50")
    # below the clip nothing changes; the collapsed step's beta spans 917 -> 950
    assert clipped["timesteps"][:-1].tolist() == plain["timesteps"][:47].tolist()
    abar = RD.base_alphas_cumprod()
    assert clipped["betas"][-1] == pytest.approx(1 - abar[950] / abar[938], rel=1e-13)
    for k in range(5, 51):  # every table the default DiSA(50, 5) builds
        assert _C.diffusion_tables(k, 950)["timesteps"].tolist() == RD.kept_timesteps(k, 950)


def test_no_clip_100_steps_is_the_models_own_table(tiny):
    model, _, _ = tiny
    assert _C.diffusion_tables(100)["timesteps"].tolist() == list(model.timesteps)
    for key, ref in R.diffusion_tables(100).items():
        if key in TABLE_KEYS:
            assert_close(_C.diffusion_tables(100)[key], ref, rtol=1e-12, atol=0.0, what=key)


@pytest.mark.parametrize("schedule", ["linear", "cosine", "constant", "two-stage"])
@pytest.mark.parametrize("steps", [1, 2, 7, 64])
def test_schedule_index_is_the_official_formula(schedule, steps):
    policy = mc.DiSA(start=50, end=5, schedule=schedule)
    got = [policy.schedule_index(s, steps) for s in range(steps)]
    assert got == [RD.schedule_index(schedule, s, steps, 5, 50) for s in range(steps)]
    if steps == 1:
        assert got == [45]  # marcache's definition: the one AR step uses `start` steps
    if schedule == "linear" and steps > 1:
        assert got[0] == 45 and got[-1] == 0 and got == sorted(got, reverse=True)


def test_start_end_100_without_clip_equals_nocache_bitwise(tiny):
    """DiSA(100, 100, clip=None) samples with the model's own tables and time
    embeddings: NoCache's bits, alone and composed with LazyMAR."""
    model, _, _ = tiny
    kw = dict(labels=[3, 7], steps=5, cfg=3.0, temperature=0.95, seed=9)
    same = mc.DiSA(start=100, end=100, clip=None)
    assert np.array_equal(model.generate_tokens(cache=same, **kw), model.generate_tokens(**kw))
    lazy = mc.LazyMAR(start=2, period=3)
    assert np.array_equal(model.generate_tokens(cache=mc.DiSA(start=100, end=100, clip=None, inner=lazy), **kw),
                          model.generate_tokens(cache=lazy, **kw))


@pytest.mark.parametrize("schedule,clip,steps", [("linear", 950, 6), ("cosine", None, 5), ("two-stage", 950, 4),
                                                 ("linear", 950, 1)])
def test_annealed_sampler_matches_the_float64_reference(tiny, schedule, clip, steps):
    """The whole annealed run against reference/disa.py (MAR's float64 AR loop with
    each step's head sampled by its respacing): tokens within rtol 1e-5 (atol 1e-6 *
    max |ref|, as the CfgFreeLate reference test, for the tiny model's large tokens),
    and the telemetry's diffusion steps equal the reference's per step. steps=1 is one
    AR step's head sampling (all tokens) with `start` steps."""
    model, W, _ = tiny
    labels, cfg, start, end = [5, 9], 3.0, 14, 3
    policy = mc.DiSA(start=start, end=end, schedule=schedule, clip=clip)
    tokens, info = model.generate_tokens(labels=labels, steps=steps, cfg=cfg, temperature=0.9, seed=11,
                                         first_index=2, cache=policy, return_info=True)
    ref, log = RD.generate_tokens(W, np.array(labels), 2, steps, cfg, "linear", 0.9, 11, 2, HEADS, start, end,
                                  schedule, clip)
    assert_close(tokens, ref, rtol=1e-5, atol=1e-6 * float(np.abs(ref).max()),
                 what=f"DiSA({schedule}, clip={clip}) tokens")
    assert [s["diffusion_steps"] for s in info.steps] == [e["diffusion_steps"] for e in log]
    assert [s["head_evaluations"] for s in info.steps] == [e["diffusion_steps"] for e in log]
    assert len(set(e["k"] for e in log)) > (1 if steps > 2 else 0)  # the count really changes


def test_disa_changes_the_tokens_and_the_clip_matters(tiny):
    """Guards against a policy that runs but samples with the model's tables."""
    model, _, _ = tiny
    kw = dict(labels=[1, 2], steps=4, cfg=2.0, seed=3)
    plain = model.generate_tokens(**kw)
    annealed = model.generate_tokens(cache=mc.DiSA(start=20, end=4), **kw)
    unclipped = model.generate_tokens(cache=mc.DiSA(start=20, end=4, clip=None), **kw)
    assert not np.array_equal(plain, annealed) and not np.array_equal(annealed, unclipped)


def test_composed_head_cache_is_planned_on_the_respaced_indices(tiny):
    """DiSA + LazyMAR: at each AR step the head cache's plan (full evaluations at the
    first index and every head_period-th, cached ones between) is LazyMAR's rule on
    that step's k respaced indices, as marcache.mar_family.head_modes computes it."""
    from marcache import mar_family

    model, _, _ = tiny
    lazy = mc.LazyMAR(start=1, period=3, head_period=3)
    policy = mc.DiSA(start=16, end=4, inner=lazy)
    _, info = model.generate_tokens(labels=[1, 2], steps=6, cfg=2.0, seed=3, cache=policy, return_info=True)
    for s in info.steps:
        k = policy.diffusion_steps_at(s["step"], 6)
        modes = mar_family.head_modes(k, lazy)
        assert s["diffusion_steps"] == k
        assert s["head_cached_evaluations"] == sum(m in ("recompute", "reuse") for m in modes)
        assert s["head_evaluations"] == k


@pytest.mark.parametrize("policy", [
    mc.DiSA(start=12, end=3),
    mc.DiSA(start=12, end=3, schedule="cosine", inner=mc.LazyMAR(start=2, period=3)),
    mc.DiSA(start=9, end=2, schedule="two-stage", clip=None, inner=mc.MARche(refresh_period=2, head_cache=True)),
    mc.DiSA(start=12, end=3, inner=mc.CfgFreeLate(after=0.5, inner=mc.LazyMAR(start=2, period=3))),
], ids=["alone", "lazymar", "marche", "cfgfree+lazymar"])
@pytest.mark.parametrize("cfg", [3.0, 1.0])
def test_flops_equal_telemetry(tiny, policy, cfg):
    """marcache.flops (DiSA's step_diffusion_steps and the inner policy's model) equals
    the engine's per-step telemetry for DiSA alone and composed."""
    model, _, _ = tiny
    _, info = model.generate_tokens(labels=[1, 2], steps=7, cfg=cfg, seed=5, cache=policy, return_info=True)
    rep = mc.flops(model, steps=7, cfg=cfg, cache=policy, batch=2)
    assert [s["flops"] for s in info.steps] == pytest.approx(rep.per_step, rel=1e-12)
    assert rep.total < mc.flops(model, steps=7, cfg=cfg, cache=policy.inner, batch=2).total


def test_no_allocation_in_the_loop_when_the_step_count_changes(tiny):
    """The respacings and their time embeddings are made before the loop: a second
    call of the same batch allocates nothing on the backend inside any step."""
    model, _, _ = tiny
    kw = dict(labels=[1, 2], steps=6, cfg=2.0, seed=1, return_info=True,
              cache=mc.DiSA(start=30, end=2, inner=mc.LazyMAR(start=1, period=3)))
    model.generate_tokens(**kw)
    _, info = model.generate_tokens(**kw)
    assert len({s["diffusion_steps"] for s in info.steps}) == 6
    assert all(s["allocations"] == 0 for s in info.steps)


def test_disa_runs_on_the_guard_backend_with_the_cpu_bits(tiny):
    """DiSA alone, with LazyMAR and with MARche keep host and device memory apart: on
    the guard backend (a subprocess, so a fault is a failing test) the CPU's bits."""
    model, _, path = tiny
    policies = ["mc.DiSA(start=12, end=3)",
                "mc.DiSA(start=12, end=3, schedule='cosine', inner=mc.LazyMAR(start=2, period=3))",
                "mc.DiSA(start=9, end=2, inner=mc.MARche(refresh_period=2, head_cache=True))"]
    kw = dict(labels=[1, 2], steps=5, cfg=2.5, seed=4)
    guard = guard_generate_json(path, policies, **kw)
    for text, tokens in zip(policies, guard):
        cpu = model.generate_tokens(cache=eval(text, {"mc": mc}), **kw)
        assert np.array_equal(tokens, cpu), text


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(start=5, end=50), ValueError, "DiSA.start must be >= DiSA.end"),
    (dict(start=0, end=0), ValueError, "DiSA.start must be an integer"),
    (dict(end=0), ValueError, "DiSA.end must be an integer"),
    (dict(start=1001), ValueError, "DiSA.start must be an integer"),
    (dict(start=5.0), ValueError, "DiSA.start"),
    (dict(schedule="exponential"), ValueError, "DiSA.schedule must be one of"),
    (dict(clip=1000), ValueError, "DiSA.clip must be None or an integer timestep in 0..999"),
    (dict(clip=-1), ValueError, "DiSA.clip"),
    (dict(clip=True), ValueError, "DiSA.clip"),
    (dict(inner=mc.DiSA()), TypeError, "DiSA.inner"),
    (dict(inner="lazymar"), TypeError, "DiSA.inner"),
])
def test_bad_fields_name_the_field(kwargs, error, match):
    with pytest.raises(error, match=match):
        mc.DiSA(**kwargs)


def test_disa_on_a_var_model_is_refused():
    with pytest.raises(ValueError, match="DiSA is a cache policy for MAR models, not VAR"):
        resolve(mc.DiSA(), family="var")
    with pytest.raises(ValueError, match="FastVAR"):
        mc.DiSA(inner=mc.FastVAR())


@pytest.mark.parametrize("edit,match", [
    (lambda d: d.update(clip=1000), "field 'clip' = 1000 is outside"),
    (lambda d: d.update(schedule="fast"), "field 'schedule' must be one of"),
    (lambda d: d.update(start=0), "field 'start' = 0 is outside"),
    (lambda d: d.update(start=3, end=9), r"DiSA: start \(3\) must be >= end \(9\)"),
])
def test_engine_field_table_names_the_field(tiny, edit, match):
    """The C policy checks its config as well (a hand-made dict bypasses the class)."""
    model, _, _ = tiny
    d = mc.DiSA().as_dict()
    edit(d)
    with pytest.raises(ValueError, match=match):
        model._mar.generate(np.array([1], np.int32), steps=2, cfg=2.0, cache=d)


def test_readme_numbers():
    """The README's DiSA lines: the first step counts at 64 AR steps and MAR-B's FLOPs and
    ratios at 64 steps with CFG (exact counts, equal to the telemetry by test_flops_equal_telemetry)."""
    assert [mc.DiSA().diffusion_steps_at(s, 64) for s in range(4)] == [48, 47, 46, 45]
    kw = dict(steps=64, cfg=2.9)
    base = mc.flops("mar_base", **kw).total
    assert mc.flops("mar_base", cache=mc.DiSA(inner=mc.LazyMAR()), **kw).total / 1e12 == pytest.approx(4.28, abs=0.005)
    assert base / 1e12 == pytest.approx(13.92, abs=0.005)
    for policy, ratio in ((mc.DiSA(), 1.24), (mc.LazyMAR(), 2.86), (mc.DiSA(inner=mc.LazyMAR()), 3.25)):
        for batch in (1, 8):
            assert mc.flops("mar_base", batch=batch, **kw).total / \
                mc.flops("mar_base", cache=policy, batch=batch, **kw).total == pytest.approx(ratio, abs=0.005)
    report = mc.flops("mar_base", **kw)
    assert report.head / report.total == pytest.approx(0.25, abs=0.005)


def test_disa_comparison_matches_reference():
    """comparisons.DISA_ANNEALED (the mutation test's DiSA case: an off-by-one in the
    index formula and a missing clip both fail it): tokens within 2e-6 of each token's
    largest channel, and the per-step diffusion steps equal."""
    import comparisons as C

    comparison = C.DISA_ANNEALED
    tokens, info = comparison.engine()
    ref, log = comparison.reference()
    assert [s["diffusion_steps"] for s in info.steps] == [e["diffusion_steps"] for e in log]
    comparison.check()


def test_readme_digits_table_flop_ratios():
    """The FLOP-ratio column of the README's digits DiSA table (500 digits, 16 steps, cfg 2.0,
    batch 8): exact counts, equal to the telemetry the table was measured with."""
    model = mc.digits.load_model(threads=1)
    kw = dict(steps=mc.digits.STEPS, cfg=mc.digits.CFG, batch=8)
    base = mc.flops(model, **kw).total
    no_head = dict(head_cache=False)
    rows = ((mc.LazyMAR(), 2.53), (mc.MARche(), 1.10), (mc.DiSA(), 1.99),
            (mc.DiSA(inner=mc.LazyMAR(**no_head)), 2.68), (mc.DiSA(start=25, end=5, inner=mc.LazyMAR(**no_head)), 3.16),
            (mc.DiSA(start=10, end=2, inner=mc.LazyMAR(start=1, period=16, **no_head)), 5.02),
            (mc.DiSA(start=25, end=5, inner=mc.MARche()), 2.80))
    for policy, ratio in rows:
        assert base / mc.flops(model, cache=policy, **kw).total == pytest.approx(ratio, abs=0.005), policy

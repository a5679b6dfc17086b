"""The runtime seams of issue 14: the cache-policy interface (every policy, and the
composing CfgFreeLate, through one C ops table), config passing through each C
policy's field table, the family-neutral generation driver's step telemetry, and the
Python FLOP model held equal to the engine's telemetry for every policy."""
import numpy as np
import pytest

import marcache as mc
from marcache.policies import resolve
from mar_fixtures import guard_generate_json, write_tiny_mar
from reference import cfgfree as RF
from reference import mar as R
from tolerance import assert_close

HEADS = 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("seams") / "tiny.safetensors"
    W = write_tiny_mar(path, seed=3, heads=HEADS, dim=16, depth=6, head_width=16, head_depth=6)
    return mc.load(path, diffusion_steps=10), W


# Every policy, alone and composed (LazyMAR's select layer 3 and MARche's 2 full
# layers leave cached layers in the 6-layer decoder).
POLICIES = {
    "nocache": mc.NoCache(),
    "lazymar": mc.LazyMAR(start=2, period=4),
    "lazymar-token": mc.LazyMAR(start=2, period=4, cond_cache=False, head_cache=False),
    "lazymar-cond": mc.LazyMAR(start=2, period=4, token_cache=False, head_cache=False),
    "marche": mc.MARche(refresh_period=2),
    "marche-composed": mc.MARche(refresh_period=2, encoder_cache=True, cond_cache=True, head_cache=True),
    "cfgfree": mc.CfgFreeLate(after=0.5),
    "cfgfree+lazymar": mc.CfgFreeLate(after=0.6, inner=mc.LazyMAR(start=2, period=4)),
    "cfgfree+marche": mc.CfgFreeLate(after=0.4, inner=mc.MARche(refresh_period=2, cond_cache=True)),
}


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("steps,cfg", [(10, 3.0), (7, 1.0)])
def test_telemetry_flops_equal_the_python_flop_model(tiny, name, steps, cfg):
    """marcache.flops (each policy's module) and the engine's telemetry (each C policy
    and runtime/flops.c) count the same FLOPs at every step."""
    model, _ = tiny
    policy = POLICIES[name]
    _, info = model.generate_tokens(labels=[1, 2], steps=steps, cfg=cfg, seed=5, cache=policy, return_info=True)
    rep = mc.flops(model, steps=steps, cfg=cfg, cache=policy, batch=2)
    assert [s["flops"] for s in info.steps] == pytest.approx(rep.per_step, rel=1e-12)


@pytest.mark.parametrize("after", [0.0, 0.5, 0.75, 1.0])
def test_cfgfree_late_matches_the_float64_reference(tiny, after):
    """CfgFreeLate against tests/reference/cfgfree.py, element-wise. Tolerance: rtol 1e-5
    as the MAR reference test (float32 engine against float64, through 10 diffusion
    steps per token); atol 1e-6 * max |ref|: the tiny random model's tokens reach ~2e4,
    and a small token is the difference of head outputs of that size, so float32 bounds
    its error by a few ulps of the largest values (measured: 1.2e-3 = 5e-8 * max |ref|),
    not by its own size. (test_mar's reference test allows 1e-5 * max |ref|.)"""
    model, W = tiny
    labels, steps, cfg = [5, 9], 6, 3.0
    tokens, info = model.generate_tokens(labels=labels, steps=steps, cfg=cfg, temperature=0.9, seed=11,
                                         first_index=2, cache=mc.CfgFreeLate(after=after), return_info=True)
    ref, log = RF.generate_tokens(W, np.array(labels), 2, steps, cfg, "linear", 0.9, 11, 2, HEADS, after,
                                  tables=R.diffusion_tables(10))
    assert_close(tokens, ref, rtol=1e-5, atol=1e-6 * float(np.abs(ref).max()), what=f"CfgFreeLate(after={after}) tokens")
    assert [s["cfg"] for s in info.steps] == pytest.approx([e["cfg_iter"] for e in log], rel=0, abs=0)
    assert [s["head_rows"] for s in info.steps] == \
        [(2 if e["guided"] else 1) * 2 * s["predicted"] for s, e in zip(info.steps, log)]
    # the late steps really run half the sequences
    assert any(not e["guided"] for e in log) == (after < 1.0)


def test_cfgfree_late_endpoints_equal_plain_runs_bitwise(tiny):
    """after=1 guides every step: the inner policy's bits. after=0 guides none: the
    bits of the same run with cfg=1 (the engine runs the same rows either way)."""
    model, _ = tiny
    kw = dict(labels=[3, 4], steps=6, seed=2)
    lazy = mc.LazyMAR(start=2, period=3)
    assert np.array_equal(model.generate_tokens(cfg=2.5, cache=mc.CfgFreeLate(after=1.0, inner=lazy), **kw),
                          model.generate_tokens(cfg=2.5, cache=lazy, **kw))
    assert np.array_equal(model.generate_tokens(cfg=2.5, cache=mc.CfgFreeLate(after=0.0), **kw),
                          model.generate_tokens(cfg=1.0, **kw))


def test_cfgfree_composition_rules():
    with pytest.raises(ValueError, match="cond_cache=True"):
        mc.CfgFreeLate(inner=mc.LazyMAR(cond_cache=False))
    with pytest.raises(ValueError, match="cond_cache=True"):
        mc.CfgFreeLate(inner=mc.MARche())
    with pytest.raises(TypeError, match="inner"):
        mc.CfgFreeLate(inner=mc.CfgFreeLate())
    with pytest.raises(ValueError, match="after"):
        mc.CfgFreeLate(after=1.5)


def test_policy_dispatch_by_family():
    assert isinstance(resolve(None), mc.NoCache)
    with pytest.raises(ValueError, match="MAR models, not VAR"):
        resolve(mc.LazyMAR(), family="var")
    with pytest.raises(TypeError, match="CfgFreeLate"):
        resolve("lazymar")
    from marcache import caches  # the historical module keeps its names
    assert caches.LazyMAR is mc.LazyMAR and caches.MARche is mc.MARche and len(caches.RETENTION_64) == 64


@pytest.mark.parametrize("edit,error,match", [
    (lambda d: d.pop("margin"), ValueError, "missing field 'margin'"),
    (lambda d: d.update(marginn=3), ValueError, "unknown field 'marginn'"),
    (lambda d: d.update(margin=2.5), TypeError, "field 'margin' must be an integer"),
    (lambda d: d.update(period=0), ValueError, "field 'period' = 0 is outside"),
    (lambda d: d.update(retention=[1.0] * 63), ValueError, "field 'retention' needs 64 entries"),
    (lambda d: d.update(head_recompute_above=1.5), ValueError, "field 'head_recompute_above'"),
    (lambda d: d.update(policy="lazymarr"), ValueError, "no MAR cache policy named 'lazymarr'"),
    (lambda d: d.update(select_layer=6), ValueError, "select_layer 6 is outside the decoder"),
])
def test_field_table_errors_name_the_field(tiny, edit, error, match):
    """The binding fills each C policy's config by walking its field table: a missing,
    unknown, mistyped or out-of-range field is an error naming it."""
    model, _ = tiny
    d = mc.LazyMAR().as_dict()
    edit(d)
    with pytest.raises(error, match=match):
        model._mar.generate(np.array([1], np.int32), steps=2, cfg=2.0, cache=d)


def test_field_table_errors_in_a_composed_policy(tiny):
    model, _ = tiny
    d = mc.CfgFreeLate(inner=mc.MARche(cond_cache=True)).as_dict(rows=320)
    d["inner"]["candidates"] = "some"
    with pytest.raises(ValueError, match="field 'candidates' must be one of 'all|image'"):
        model._mar.generate(np.array([1], np.int32), steps=2, cfg=2.0, cache=d)
    d["inner"] = {"policy": "nonesuch"}
    with pytest.raises(ValueError, match="names no policy of this model family"):
        model._mar.generate(np.array([1], np.int32), steps=2, cfg=2.0, cache=d)


def test_driver_step_header(tiny):
    """Every step dict carries the driver's common header (step, seconds, FLOPs, full,
    cache bytes, backend allocations and host waits during the step) before the
    family's tail; a second identical call allocates nothing inside the loop."""
    model, _ = tiny
    kw = dict(labels=[1, 2], steps=5, cfg=2.0, seed=1, cache=mc.LazyMAR(start=1, period=3), return_info=True)
    model.generate_tokens(**kw)
    _, info = model.generate_tokens(**kw)
    for i, s in enumerate(info.steps):
        assert s["step"] == i and s["seconds"] > 0 and s["flops"] > 0 and isinstance(s["full"], bool)
        assert s["allocations"] == 0
        assert s["host_waits"] == (0 if s["full"] else 1)  # a cached LazyMAR step downloads its scores
        assert s["cache_bytes"] > 0 and s["predicted"] > 0


def test_cfgfree_composed_runs_on_the_guard_backend_with_the_cpu_bits(tiny, tmp_path):
    """The composing policy keeps host and device memory apart: on the guard backend
    (in a subprocess, so a fault is a failing test) it gives the CPU's bits."""
    model, _ = tiny
    path = tmp_path / "t.safetensors"
    write_tiny_mar(path, seed=3, heads=HEADS, dim=16, depth=6, head_width=16, head_depth=6)
    kw = dict(labels=[1, 2], steps=6, cfg=2.5, seed=4)
    [guard] = guard_generate_json(path, ["mc.CfgFreeLate(after=0.6, inner=mc.LazyMAR(start=2, period=4))"],
                                  diffusion_steps=10, **kw)
    assert np.array_equal(guard, model.generate_tokens(cache=POLICIES["cfgfree+lazymar"], **kw))

"""VAR's FLOP model (marcache/var_family.py, marcache.flops("var_d*")) against the
spec's Part E tables (var_fastvar.md E1, E2 and the d20/d24 totals), and the
parameter counts of A1. The tables count the adaLN modulation at every scale and
word_embed on both CFG halves (convention="spec"); the engine computes the
modulation once per run and word_embed on the image rows (convention="engine"),
and the two differ by exactly that."""
import pytest

import marcache as mc
from marcache import var_family

# spec E1 / E2: (si, pn, tokens, KV length, linear, attention, head, total) in GFLOP per image
E1_D16 = [(0, 1, 1, 1, 0.81, 0.00, 0.02, 1.23), (1, 2, 4, 5, 3.22, 0.00, 0.07, 3.70),
          (2, 3, 9, 14, 7.25, 0.02, 0.15, 7.83), (3, 4, 16, 30, 12.88, 0.06, 0.27, 13.63),
          (4, 5, 25, 55, 20.13, 0.18, 0.42, 21.15), (5, 6, 36, 91, 28.99, 0.43, 0.60, 30.44),
          (6, 8, 64, 155, 51.54, 1.30, 1.07, 54.33), (7, 10, 100, 255, 80.53, 3.34, 1.68, 85.97),
          (8, 13, 169, 424, 136.10, 9.39, 2.84, 148.76), (9, 16, 256, 680, 206.16, 22.82, 4.29, 233.72)]
E2_D30 = [(0, 1, 1, 1, 5.31, 0.00, 0.03, 8.02), (1, 2, 4, 5, 21.23, 0.01, 0.13, 24.05),
          (2, 3, 9, 14, 47.78, 0.06, 0.28, 50.80), (3, 4, 16, 30, 84.93, 0.22, 0.50, 88.35),
          (4, 5, 25, 55, 132.71, 0.63, 0.79, 136.82), (5, 6, 36, 91, 191.10, 1.51, 1.13, 196.44),
          (6, 8, 64, 155, 339.74, 4.57, 2.01, 349.02), (7, 10, 100, 255, 530.84, 11.75, 3.15, 548.45),
          (8, 13, 169, 424, 897.12, 33.02, 5.32, 938.18), (9, 16, 256, 680, 1358.95, 80.22, 8.05, 1449.97)]
# spec E1/E2 "sum" and "Other depths", and the last two scales (13x13 + 16x16)
TOTALS = {"var_d16": (600.8, 382.5, 63.7), "var_d20": (1150.6, None, 63.4), "var_d24": (1963.7, None, 63.2),
          "var_d30": (3790.1, 2388.2, 63.0)}
# spec A1 [computed]
PARAMS = {"var_d16": 310_283_520, "var_d20": 600_917_136, "var_d24": 1_033_399_360, "var_d30": 2_010_020_356}


@pytest.mark.parametrize("name,table", [("var_d16", E1_D16), ("var_d30", E2_D30)])
def test_per_scale_rows_reproduce_the_spec_tables(name, table):
    rep = mc.flops(name, cfg=1.5, convention="spec")
    assert len(rep.per_scale) == len(table) == 10
    for row, (si, pn, n, kv, linear, attn, head, total) in zip(rep.per_scale, table):
        assert (row["scale"], row["tokens"], row["keys"]) == (si, n, kv) and pn * pn == n
        # the spec rounds to 2 decimals
        assert round(row["linear"] / 1e9, 2) == pytest.approx(linear, abs=1e-9), (si, row)
        assert round(row["attention"] / 1e9, 2) == pytest.approx(attn, abs=1e-9), (si, row)
        assert round(row["head"] / 1e9, 2) == pytest.approx(head, abs=1e-9), (si, row)
        assert round(row["total"] / 1e9, 2) == pytest.approx(total, abs=1e-9), (si, row)


@pytest.mark.parametrize("name", sorted(TOTALS))
def test_totals_and_last_two_scales_reproduce_the_spec(name):
    total, last_two, share = TOTALS[name]
    rep = mc.flops(name, convention="spec")
    assert round(rep.total / 1e9, 1) == pytest.approx(total, abs=1e-9)
    tail = sum(s["total"] for s in rep.per_scale[-2:])
    if last_two is not None:
        assert round(tail / 1e9, 1) == pytest.approx(last_two, abs=1e-9)
    assert round(100 * tail / rep.total, 1) == pytest.approx(share, abs=1e-9)
    assert rep.total == pytest.approx(sum(rep.per_step), rel=1e-15)
    assert rep.total == rep.linear + rep.attention + rep.head + rep.embed + rep.adaln + rep.smooth


@pytest.mark.parametrize("name", sorted(TOTALS))
@pytest.mark.parametrize("batch,cfg", [(1, 1.5), (3, 4.0), (2, 0.0)])
def test_engine_convention_differs_by_exactly_the_hoisted_modulation_and_embedding(name, batch, cfg):
    c = mc.VAR_CONFIGS[name]
    spec = mc.flops(name, cfg=cfg, batch=batch, convention="spec")
    engine = mc.flops(name, cfg=cfg, batch=batch)
    n_seq = batch * (2 if cfg != 0 else 1)
    scales = len(c["patch_nums"])
    modulation = 2 * n_seq * (c["depth"] * 6 * c["width"] ** 2 + 2 * c["width"] ** 2)
    later_tokens = sum(p * p for p in c["patch_nums"][1:])
    embed_uncond = 2 * (n_seq - batch) * later_tokens * c["vae_channels"] * c["width"]
    assert spec.total - engine.total == (scales - 1) * modulation + embed_uncond
    assert engine.adaln == modulation and spec.adaln == scales * modulation
    # the engine's modulation is counted at the first scale, where it is computed
    assert engine.per_scale[0]["adaln"] == modulation and all(s["adaln"] == 0 for s in engine.per_scale[1:])
    assert engine.per_scale[0]["embed"] == 0 and spec.per_scale[0]["embed"] == 0  # scale 0 takes sos
    assert engine.embed == 2 * batch * later_tokens * c["vae_channels"] * c["width"]
    for a, b in zip(spec.per_scale, engine.per_scale):
        assert (a["linear"], a["attention"], a["head"]) == (b["linear"], b["attention"], b["head"])


def test_rules_per_block_kind():
    """Part E's counting rules, block by block: 24 C^2 per token and block, 4 n kv C of
    attention, 2 C V of head, 2 Cvae C of word_embed, 2 V Cvae of more_smooth's GEMM."""
    C, hidden = 1024, 4096
    assert var_family.block_linear(1, C, hidden) == 24 * C * C
    assert var_family.attention(2, 5, 14, C) == 2 * 4 * 5 * 14 * C
    assert var_family.head(3, C, 4096) == 3 * 2 * C * 4096
    assert var_family.word_embed(4, 32, C) == 4 * 2 * 32 * C
    assert var_family.adaln(2, 16, C) == 2 * (16 * 2 * 6 * C * C + 2 * 2 * C * C)
    assert var_family.smooth(5, 4096, 32) == 5 * 2 * 4096 * 32
    assert var_family.scale_begin((1, 2, 3, 4, 5, 6, 8, 10, 13, 16)) == [0, 1, 5, 14, 30, 55, 91, 155, 255, 424]


def test_cfg_off_and_more_smooth_and_batch():
    one = mc.flops("var_d16", cfg=1.5)
    assert mc.flops("var_d16", cfg=1.5, batch=4).total == 4 * one.total
    off = mc.flops("var_d16", cfg=0)      # cfg 0: the conditional half alone
    assert off.linear * 2 == one.linear and off.head * 2 == one.head and off.embed == one.embed
    smooth = mc.flops("var_d16", cfg=1.5, more_smooth=True)
    assert smooth.smooth == 680 * 2 * 4096 * 32 and smooth.total == one.total + smooth.smooth
    assert one.smooth == 0


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_parameter_counts_of_the_released_configs(name):
    assert var_family.num_params(mc.VAR_CONFIGS[name]) == PARAMS[name]


def test_bad_arguments():
    with pytest.raises(ValueError, match="one step per scale"):
        mc.flops("var_d16", steps=10)
    with pytest.raises(ValueError, match="diffusion_steps applies to MAR"):
        mc.flops("var_d16", diffusion_steps=100)
    with pytest.raises(ValueError, match="more_smooth applies to VAR"):
        mc.flops("mar_base", more_smooth=True)
    with pytest.raises(ValueError, match="convention must be 'engine' or 'spec'"):
        mc.flops("var_d16", convention="reference")
    with pytest.raises(ValueError, match="cfg must be a finite number >= 0"):
        mc.flops("var_d16", cfg=-1)
    with pytest.raises(ValueError, match="batch must be an integer >= 1"):
        mc.flops("var_d16", batch=0)
    with pytest.raises(ValueError, match="LazyMAR is a cache policy for MAR models, not VAR"):
        mc.flops("var_d16", cache=mc.LazyMAR())
    with pytest.raises(ValueError, match="MARche is a cache policy for MAR models, not VAR"):
        mc.flops("var_d30", cache=mc.MARche())
    with pytest.raises(ValueError, match="unknown model 'var_d17'.*var_d16"):
        mc.flops("var_d17")
    # NoCache serves both families
    assert mc.flops("var_d16", cache=mc.NoCache()).total == mc.flops("var_d16").total


def test_readme_flop_table_is_marcache_flops():
    """The README's VAR FLOP table holds what marcache.flops computes (so it cannot drift)."""
    import os
    import re

    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    rows = re.findall(r"^\| `(var_d\d+)` \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) % \(spec: ([\d.]+) %\)|"
                      r"^\| `(var_d\d+)` \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) % \(([\d.]+) %\)", readme, re.M)
    rows = [tuple(x for x in r if x) for r in rows]
    assert [r[0] for r in rows] == ["var_d16", "var_d20", "var_d24", "var_d30"]
    for name, engine, spec, share, spec_share in rows:
        e, s = mc.flops(name), mc.flops(name, convention="spec")
        assert f"{e.total / 1e9:.1f}" == engine and f"{s.total / 1e9:.1f}" == spec
        assert f"{100 * sum(x['total'] for x in e.per_scale[-2:]) / e.total:.1f}" == share
        assert f"{100 * sum(x['total'] for x in s.per_scale[-2:]) / s.total:.1f}" == spec_share

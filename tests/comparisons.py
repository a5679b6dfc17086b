"""Named engine-against-reference comparisons, shared by the engine tests that
assert them and by the mutation test (tests/test_mutations.py), which runs each
known-wrong variant of tests/mutations.py through the comparison that must catch it.

A Comparison holds how to run the engine, how to run the float64 reference, and the
element-wise tolerance (|engine - ref| <= rtol |ref| + atol, tolerance.py) with the
reason for its atol. Engine results are computed once per process; so is the
unmutated reference (a mutated one is recomputed every time, see reference()).

Tolerances used here:

Tokens (row_atol): every sampled token passes through x0 = sqrt(1/abar) x -
sqrt(1/abar - 1) eps at the first DDPM step, with sqrt(1/abar_999) = 2.03e4 (mar.md
6.3), so that token's chain carries float32 roundings of values of the size of its
largest channels (2^-24 = 6e-8 of them per rounding, over 100 steps of GEMMs and DDPM
updates), whatever the size of one channel: a channel near 0 has the error of its
token's large ones. So each element may differ by a fixed fraction of the largest
|value| of its own token (its row over the channel axis), with rtol 0:
  * TOKEN_ROW_ATOL = 2e-6 on the plain 0.05-scale models (measured worst 9.4e-7);
  * AMPLIFIED_ROW_ATOL = 1e-5 on mar_fixtures.AMPLIFIED, whose head weights are 10x
    larger (adaLN shift/scale and MLP outputs 10-100x the tokens' eps terms, each
    rounded in float32; measured worst 3.7e-6).
Both are tighter, element by element, than the old max|a - ref| / max|ref| <= 1e-5,
which gave every element 1e-5 of the largest token of the whole array.
"""
import atexit
import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

import numpy as np
from safetensors.numpy import save_file

import mar_fixtures as F
from reference import disa as RD
from reference import lazymar as LZ
from reference import mar as R
from reference import marche as MC
from reference import ops
from tolerance import assert_close, worst_share

TOKEN_ROW_ATOL = 2e-6        # see the module docstring
AMPLIFIED_ROW_ATOL = 1e-5

_WORKDIR = Path(tempfile.mkdtemp(prefix="marcache-comparisons-"))
atexit.register(shutil.rmtree, _WORKDIR, ignore_errors=True)


_SPEC_GELU = ops.gelu   # the exact erf GELU; a mutation may patch ops.gelu for a while


_SPEC_DISA = (RD.schedule_index, RD.kept_timesteps)   # a DiSA mutation patches one of these


def reference_is_unmutated():
    """True when the references compute exactly the spec (no variant switched on)."""
    return not R.MUTATION and ops.gelu is _SPEC_GELU and (RD.schedule_index, RD.kept_timesteps) == _SPEC_DISA


@dataclasses.dataclass
class Comparison:
    name: str
    test: str                        # the engine test (node id) that asserts this comparison
    run_engine: Callable[[], object]
    run_reference: Callable[[], object]
    rtol: float
    atol: float
    atol_why: str
    row_atol: float = 0.0            # plus row_atol * max |ref| over the last axis (one token)
    pick: Callable[[object], np.ndarray] = lambda result: result[0] if isinstance(result, tuple) else result
    _engine: Optional[object] = dataclasses.field(default=None, repr=False)
    _reference: Optional[object] = dataclasses.field(default=None, repr=False)

    def engine(self):
        if self._engine is None:
            self._engine = self.run_engine()
        return self._engine

    def reference(self):
        """The reference result; cached only when no variant is switched on."""
        if not reference_is_unmutated():
            return self.run_reference()
        if self._reference is None:
            self._reference = self.run_reference()
        return self._reference

    def allowance(self, ref):
        """The atol of every element: atol + row_atol * (largest |ref| of its row)."""
        ref = np.asarray(ref, np.float64)
        if not self.row_atol:
            return self.atol
        return self.atol + self.row_atol * np.abs(ref).max(axis=-1, keepdims=True)

    def check(self):
        ref = self.pick(self.reference())
        assert_close(self.pick(self.engine()), ref, self.rtol, self.allowance(ref),
                     "%s (atol: %s)" % (self.name, self.atol_why))

    def share(self):
        """worst_share of the engine against the reference as it is now (> 1 fails)."""
        ref = self.pick(self.reference())
        return worst_share(self.pick(self.engine()), ref, self.rtol, self.allowance(ref))


COMPARISONS = {}


def _add(c):
    assert c.name not in COMPARISONS
    COMPARISONS[c.name] = c
    return c


_WEIGHTS = {}
_MODELS = {}


def weights(key):
    """(W, heads) of the model registered under key (built on first use)."""
    if key not in _WEIGHTS:
        _WEIGHTS[key] = _BUILDERS[key]()
    return _WEIGHTS[key]


def model(key, diffusion_steps=100):
    """The marcache model of the weights registered under key (loaded once)."""
    import marcache as mc

    if (key, diffusion_steps) not in _MODELS:
        W, heads = weights(key)
        path = _WORKDIR / ("%s.safetensors" % key)
        if not path.exists():
            save_file(W, str(path), metadata={"heads": str(heads)})
        _MODELS[key, diffusion_steps] = mc.load(path, diffusion_steps=diffusion_steps)
    return _MODELS[key, diffusion_steps]


def token_tolerance(key):
    """Comparison tolerance fields for the tokens of model `key` (module docstring)."""
    amplified = key in ("amplified", "v_dominant_deep_head")
    return dict(rtol=0.0, atol=0.0, row_atol=AMPLIFIED_ROW_ATOL if amplified else TOKEN_ROW_ATOL,
                atol_why="%s of each token's largest channel: float32 rounding of its x0 chain"
                % ("1e-5" if amplified else "2e-6"))


def _tiny_weights(seed=0):
    rng = np.random.default_rng(seed)
    return R.random_mar_weights(rng, dim=32, depth=2, heads_unused=2, head_width=32, head_depth=2)


# The models: key -> () -> (W, heads)
_BUILDERS = {
    # the plain random tiny model of test_mar.py
    "tiny": lambda: (_tiny_weights(), 2),
    # eps rows zeroed, the condition path amplified: v decides the tokens at temperature 300
    "v_dominant": lambda: (F.v_dominant(_tiny_weights(), eps_gain=0.0, cond_gain=10.0), 2),
    # every LayerNorm input ~1e-2, GELU inputs ~1-3: eps and the GELU form visible
    "small_activations": lambda: (F.small_activations(_tiny_weights()), 2),
    # head depth 6 (LazyMAR's skipped blocks 1..4) for the head-cache cases, v dominant
    # (its cond_embed and adaLN are already 10x: no further gain, or v overflows exp)
    "v_dominant_deep_head": lambda: (F.v_dominant(F.amplified_mar_weights(1, **F.AMPLIFIED), eps_gain=0.0),
                                     F.AMPLIFIED["heads"]),
    # the amplified model of the LazyMAR / MARche reference tests
    "amplified": lambda: (F.amplified_mar_weights(1, **F.AMPLIFIED), F.AMPLIFIED["heads"]),
}


# --------------------------------------------------------------------------
# Plain MAR (tests/test_mar.py)
# --------------------------------------------------------------------------

SAMPLER_IMAGES = np.array([0, 0, 3, 7, 7], np.uint32)
SAMPLER_POSITIONS = np.array([4, 200, 4, 0, 255], np.uint32)
# v decides the tokens only when the noise each step adds is not swamped by the first
# step's x0 ~ 2.03e4 x: at temperature 300 it is of the same order (measured: v taken
# from the eps columns then moves the tokens 50x beyond the tolerance, at temperature 1 not at all).
V_TEMPERATURE = 300.0


def _head_sampler(key, cfg, temperature, seed=11):
    W, _ = weights(key)
    n = len(SAMPLER_POSITIONS)
    z = np.random.default_rng(1).standard_normal((2 * n if cfg != 1.0 else n, W["class_emb.weight"].shape[1]))
    z = z.astype(np.float32)
    return _add(Comparison(
        name="head_sampler[%s,cfg=%g,T=%g]" % (key, cfg, temperature),
        test="tests/test_mar.py::test_head_sampler_matches_reference",
        run_engine=lambda: model(key).head_sample(z, SAMPLER_IMAGES, SAMPLER_POSITIONS, cfg=cfg,
                                                  temperature=temperature, seed=seed),
        run_reference=lambda: R.head_sample(W, z, SAMPLER_IMAGES, SAMPLER_POSITIONS, seed, temperature, cfg),
        **token_tolerance(key)))


HEAD_SAMPLERS = [_head_sampler("tiny", cfg, t) for cfg in (1.0, 2.5) for t in (1.0, 0.7)] + \
    [_head_sampler("v_dominant", cfg, V_TEMPERATURE) for cfg in (1.0, 2.5)]


def _transformer_small():
    W, heads = weights("small_activations")
    rng = np.random.default_rng(37)
    B = 3
    tokens = rng.standard_normal((B, 256, 16)).astype(np.float32)
    mask = np.ones((B, 256), bool)
    for b in range(B):
        mask[b, rng.permutation(256)[:37]] = False
    labels = np.array([5, 999, 0])
    return _add(Comparison(
        name="transformer[small_activations]",
        test="tests/test_mar.py::test_transformer_small_activations_matches_reference",
        run_engine=lambda: model("small_activations").transformer(tokens, mask, labels),
        run_reference=lambda: R.transformer(W, tokens, mask, labels, heads, cfg_on=False),
        # z = decoder_norm output (weights ~1) + pos: |z| up to 3.5, rms 1. Each element
        # carries float32 roundings of the normalised stream (2^-24 * 3.5 = 2e-7 each,
        # ~10 through 4 blocks and 3 LayerNorms whose inputs are ~1e-2); measured worst
        # 1.6e-6. A wrong eps in any one LayerNorm moves elements by >= 4e-4.
        rtol=1e-5, atol=4e-6, atol_why="float32 roundings of |z| ~ 1 through the LayerNorms"))


TRANSFORMER_SMALL = _transformer_small()


def _head_net_small(t_index):
    W, _ = weights("small_activations")
    rng = np.random.default_rng(t_index)
    x = rng.standard_normal((7, 16)).astype(np.float32)
    z = rng.standard_normal((7, 32)).astype(np.float32)
    tau = R.diffusion_tables(100)["timesteps"][t_index]
    return _add(Comparison(
        name="head_net[small_activations,t=%d]" % t_index,
        test="tests/test_mar.py::test_head_network_small_activations_matches_reference",
        run_engine=lambda: model("small_activations").head(x, z, t_index),
        run_reference=lambda: R.head_net(W, x, np.full(7, tau), z),
        # outputs up to 0.63 from one Linear of a LayerNorm output: a few float32 ulp of
        # 0.6 (6e-8 each); measured worst 1.1e-7.
        rtol=1e-5, atol=1e-6, atol_why="float32 ulp of the head outputs ~0.6"))


HEAD_NET_SMALL = [_head_net_small(t) for t in (0, 50, 99)]


# --------------------------------------------------------------------------
# LazyMAR and MARche cached head steps on the v-dominant model
# --------------------------------------------------------------------------

# 10 diffusion steps: full head timesteps 9, 6, 3, 0 (head_period 3), cached 8, 7, 5,
# 4, 2, 1; the MLP recompute rule j > 0.7 * 10 recomputes at 8 only; res blocks 1..4
# skipped (delta) and 0, 5 reused or recomputed. Two AR steps, both full (the head
# cache works on every AR step), one image: the cost is the head's.
HEAD_CACHE_RULES = dict(head_cache=True, head_period=3, head_recompute_above=0.7)


def _head_cache(policy_name, key, temperature):
    """The cached head steps of `policy_name` ("lazymar" or "marche", every AR step a full
    transformer step) against its reference loop."""
    import marcache as mc

    W, heads = weights(key)
    if policy_name == "lazymar":
        cache, reference, test = mc.LazyMAR(start=0, period=1, **HEAD_CACHE_RULES), \
            LZ.generate_tokens_lazymar, "tests/test_lazymar_reference.py"
    else:
        cache, reference, test = mc.MARche(refresh_period=1, **HEAD_CACHE_RULES), \
            MC.generate_tokens_marche, "tests/test_marche_reference.py"
    args = dict(labels=[7], steps=2, cfg=2.5, temperature=temperature, seed=3, first_index=1)
    return _add(Comparison(
        name="%s_head_cache[%s,T=%g]" % (policy_name, key, temperature),
        test=test + "::test_head_cache_matches_reference",
        run_engine=lambda: model(key, 10).generate_tokens(cache=cache, return_info=True, **args),
        run_reference=lambda: reference(W, np.array(args["labels"]), 1, args["steps"], args["cfg"], "linear",
                                        temperature, args["seed"], args["first_index"], heads, cache,
                                        R.diffusion_tables(10)),
        **token_tolerance(key)))


LAZYMAR_HEAD_CACHE = [_head_cache("lazymar", "v_dominant_deep_head", V_TEMPERATURE),
                      _head_cache("lazymar", "amplified", 1.0)]
MARCHE_HEAD_CACHE = [_head_cache("marche", "v_dominant_deep_head", V_TEMPERATURE),
                     _head_cache("marche", "amplified", 1.0)]


# --------------------------------------------------------------------------
# LazyMAR's token and condition caches, MARche's active set (the amplified model)
# --------------------------------------------------------------------------

LAZYMAR_STEPS = 8
LAZYMAR_SCHEDULE = dict(start=2, period=4)   # full steps 0, 1, 2, 6; cached 3, 4, 5, 7
# a retention table whose entries < 1 prune within 8 steps (entries 24.. -> steps 3..)
LAZYMAR_RETENTION = tuple([1.0] * 16 + [0.5] * 16 + [0.15] * 16 + [0.4] * 16)


def lazymar_run(lz, labels, cfg, diffusion_steps, num_images=None, steps=LAZYMAR_STEPS, seed=3, first_index=1,
                temperature=1.0, schedule="linear"):
    """(engine run, reference run) closures of one LazyMAR configuration on the amplified model."""
    W, heads = weights("amplified")
    n = len(labels) if labels is not None else num_images

    def engine():
        return model("amplified", diffusion_steps).generate_tokens(
            labels=labels, num_images=num_images, steps=steps, cfg=cfg, cfg_schedule=schedule,
            temperature=temperature, seed=seed, first_index=first_index, cache=lz, return_info=True)

    def reference():
        return LZ.generate_tokens_lazymar(W, None if labels is None else np.array(labels), n, steps, cfg, schedule,
                                          temperature, seed, first_index, heads, lz,
                                          R.diffusion_tables(diffusion_steps))

    return engine, reference


def _lazymar_token_cache():
    import marcache as mc

    lz = mc.LazyMAR(head_cache=False, retention=LAZYMAR_RETENTION, **LAZYMAR_SCHEDULE)
    engine, reference = lazymar_run(lz, [1, 2], 3.0, diffusion_steps=10)
    return _add(Comparison(
        name="lazymar_token_cache[amplified]",
        test="tests/test_lazymar_reference.py::test_token_and_condition_cache_with_pruning",
        run_engine=engine, run_reference=reference, **token_tolerance("amplified")))


LAZYMAR_TOKEN_CACHE = _lazymar_token_cache()

MARCHE_STEPS = 8


def marche_run(cache, labels, cfg, diffusion_steps, num_images=None, temperature=1.0, schedule="linear"):
    """(engine run, reference run) closures of one MARche configuration on the amplified model
    (8 AR steps, seed 3, first index 1; the engine traces the active rows)."""
    W, heads = weights("amplified")
    n = len(labels) if labels is not None else num_images

    def engine():
        return model("amplified", diffusion_steps).generate_tokens(
            labels=labels, num_images=num_images, steps=MARCHE_STEPS, cfg=cfg, cfg_schedule=schedule,
            temperature=temperature, seed=3, first_index=1, cache=cache, return_info=True, trace_rows=True)

    def reference():
        return MC.generate_tokens_marche(W, None if labels is None else np.array(labels), n, MARCHE_STEPS, cfg,
                                         schedule, temperature, 3, 1, heads, cache,
                                         R.diffusion_tables(diffusion_steps))

    return engine, reference


def _marche_defaults():
    import marcache as mc

    # paper defaults except the 8-step schedule and a budget that leaves refreshing
    # choices; CFG on, both halves select their own rows (test_marche_reference case a)
    engine, reference = marche_run(mc.MARche(budget=80), [1, 2], 3.0, diffusion_steps=10)
    return _add(Comparison(
        name="marche_active_set[amplified]",
        test="tests/test_marche_reference.py::test_paper_defaults_short_schedule",
        run_engine=engine, run_reference=reference, **token_tolerance("amplified")))


MARCHE_DEFAULTS = _marche_defaults()


# --------------------------------------------------------------------------
# DiSA (tests/test_disa.py): the annealed sampler on the plain tiny model
# --------------------------------------------------------------------------

def _disa_annealed():
    import marcache as mc

    W, heads = weights("tiny")
    # 6 AR steps, 14 -> 3 linear with the official clip: k = 14, 11, 9, 7, 5, 3 (clip
    # collapses the top of the 14-step respacing), two images with CFG
    policy = mc.DiSA(start=14, end=3, clip=950)
    args = dict(labels=[5, 9], steps=6, cfg=3.0, temperature=0.9, seed=11, first_index=2)
    return _add(Comparison(
        name="disa_annealed[tiny]",
        test="tests/test_disa.py::test_disa_comparison_matches_reference",
        run_engine=lambda: model("tiny").generate_tokens(cache=policy, return_info=True, **args),
        run_reference=lambda: RD.generate_tokens(W, np.array(args["labels"]), 2, args["steps"], args["cfg"], "linear",
                                                 args["temperature"], args["seed"], args["first_index"], heads,
                                                 14, 3, "linear", 950),
        **token_tolerance("tiny")))


DISA_ANNEALED = _disa_annealed()

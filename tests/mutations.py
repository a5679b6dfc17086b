"""Known-wrong variants of the float64 references, each with the engine comparisons
that must catch it (tests/test_mutations.py runs the list in CI).

Each entry is a mistake a port commonly makes. It is applied to the reference only,
through the switches of reference.mar.MUTATION (read by reference/mar.py, lazymar.py,
marche.py) or by patching one reference function for the duration, never to the
engine. A variant is caught by a comparison (tests/comparisons.py) when the mutated
reference, compared with the engine's output under that comparison's own tolerance,
fails it (worst_share > 1) while the unmutated reference passes.

To add a variant: put its switch in the reference (the spec's behaviour unchanged when
it is off), add an entry here naming the comparisons that must catch it; add a
comparison if no existing one sees it. New models (VAR, FastVAR, DiSA) add their
references' variants the same way.
"""
import contextlib
import dataclasses
import math
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from reference import disa as RD
from reference import mar as R
from reference import ops


def gelu_tanh(x):
    """The tanh approximation of GELU (nn.GELU(approximate="tanh")); MAR uses the exact erf form."""
    x = ops.f64(x)
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


@dataclasses.dataclass(frozen=True)
class Mutation:
    what: str                                   # the mistake, in words
    caught_by: Tuple[str, ...]                  # names in comparisons.COMPARISONS
    switches: Dict[str, object] = dataclasses.field(default_factory=dict)   # reference.mar.MUTATION entries
    patch: Optional[Tuple[object, str, Callable]] = None                     # (module, attribute, replacement)


@contextlib.contextmanager
def applied(mutation):
    """The references compute `mutation` inside the block, the spec again after it."""
    assert not R.MUTATION, "a mutation is already applied"
    saved = None
    R.MUTATION.update(mutation.switches)
    if mutation.patch is not None:
        module, attribute, replacement = mutation.patch
        saved = getattr(module, attribute)
        setattr(module, attribute, replacement)
    try:
        yield
    finally:
        R.MUTATION.clear()
        if mutation.patch is not None:
            setattr(mutation.patch[0], mutation.patch[1], saved)


HEAD_PLAIN_CFG = "head_sampler[tiny,cfg=2.5,T=1]"
V_NOCFG = "head_sampler[v_dominant,cfg=1,T=300]"
V_CFG = "head_sampler[v_dominant,cfg=2.5,T=300]"
TRANSFORMER = "transformer[small_activations]"
HEAD_NET = "head_net[small_activations,t=50]"
LAZY_V = "lazymar_head_cache[v_dominant_deep_head,T=300]"
MARCHE_V = "marche_head_cache[v_dominant_deep_head,T=300]"
LAZY_HEAD = "lazymar_head_cache[amplified,T=1]"
DISA = "disa_annealed[tiny]"
_SPEC_DISA_INDEX = RD.schedule_index
_SPEC_DISA_KEPT = RD.kept_timesteps


def disa_index_off_by_one(schedule, step, num_iter, lower, upper):
    """DiSA's index formula with L (the list's length) where the official code has L - 1
    (clamped into the list, as an implementation that indexes safely would)."""
    return min(upper - lower, _SPEC_DISA_INDEX(schedule, step, num_iter, lower, upper + 1))


def disa_clip_ignored(k, clip=None, T=1000):
    """The respacing without DiSA's clip of the kept timesteps (the "default" sampler's)."""
    return _SPEC_DISA_KEPT(k, None, T)
MARCHE_HEAD = "marche_head_cache[amplified,T=1]"
LAZY_TOKENS = "lazymar_token_cache[amplified]"
MARCHE_ACTIVE = "marche_active_set[amplified]"

MUTATIONS = {
    # ---- the head sampler (mar.md 5.2, 6.4-6.5)
    "cfg_sign": Mutation("CFG with the sign flipped: u - s (c - u)", (HEAD_PLAIN_CFG,), {"cfg_sign": True}),
    "v_cfg": Mutation("guidance applied to v too", (V_CFG,), {"v_cfg": True}),
    "v_uncond": Mutation("v taken from the unconditional row", (V_CFG,), {"v_uncond": True}),
    "v_from_eps": Mutation("v read from the eps columns", (V_NOCFG, V_CFG), {"v_from_eps": True}),
    "v_ignored": Mutation("v ignored: the fixed posterior variance", (V_NOCFG, V_CFG), {"v_ignored": True}),
    "noise_at_last_step": Mutation("noise added at the last DDPM step too", (V_NOCFG,),
                                   {"noise_at_last_step": True}),
    # ---- LayerNorm eps (1e-6, mar.md 1.2) and the GELU form
    **{"ln_eps_%s" % site: Mutation("eps 1e-5 (the PyTorch default) in %s" % site,
                                    (TRANSFORMER if not site.startswith("head_") else HEAD_NET,),
                                    {"ln_eps." + site: 1e-5})
       for site in R.LN_SITES},
    "tanh_gelu": Mutation("tanh-approximated GELU instead of erf", (TRANSFORMER,), patch=(ops, "gelu", gelu_tanh)),
    # ---- v on the cached head timesteps (LazyMAR's head cache, also under MARche)
    "cached_v_cfg": Mutation("cached head step: the CFG difference applied to v too", (LAZY_V, MARCHE_V),
                             {"cached_v_cfg": True}),
    "cached_v_stale": Mutation("cached head step: v of the last full timestep", (LAZY_V, MARCHE_V),
                               {"cached_v_stale": True}),
    "cached_v_from_eps": Mutation("cached head step: v read from the eps columns", (LAZY_V, MARCHE_V),
                                  {"cached_v_from_eps": True}),
    "cached_v_ignored": Mutation("cached head step: fixed posterior variance", (LAZY_V, MARCHE_V),
                                 {"cached_v_ignored": True}),
    # ---- the head cache's rules (lazymar.md 7)
    "head_cfg_delta_reversed": Mutation("cached head step: CFG difference taken u - c", (LAZY_HEAD, MARCHE_HEAD),
                                        {"head_cfg_delta_reversed": True}),
    "head_recompute_off_by_one": Mutation("MLP recompute from one timestep earlier (j > 0.7 T - 1)",
                                          (LAZY_HEAD, MARCHE_HEAD), {"head_recompute_off_by_one": True}),
    "head_never_recompute": Mutation("cached MLP outputs always reused, never recomputed", (LAZY_HEAD, MARCHE_HEAD),
                                     {"head_never_recompute": True}),
    "head_skip_off_by_one": Mutation("res blocks 1..5 skipped instead of 1..4", (LAZY_HEAD, MARCHE_HEAD),
                                     {"head_skip_off_by_one": True}),
    "head_cache_from_uncond": Mutation("head cache filled from the unconditional rows", (LAZY_HEAD, MARCHE_HEAD),
                                       {"head_cache_from_uncond": True}),
    # ---- LazyMAR's token and condition caches (lazymar.md 4-5)
    "cond_diff_reversed": Mutation("condition cache difference taken x_cond - x_uncond", (LAZY_TOKENS,),
                                   {"cond_diff_reversed": True}),
    "retention_step_off_by_one": Mutation("retention entry of step s - 1", (LAZY_TOKENS,),
                                          {"retention_step_off_by_one": True}),
    "lazymar_prev_not_forced": Mutation("tokens predicted at the previous step not forced into the kept rows",
                                        (LAZY_TOKENS,), {"lazymar_prev_not_forced": True}),
    "lazymar_rank_descending": Mutation("rows ranked by similarity descending (the most similar kept)",
                                        (LAZY_TOKENS,), {"lazymar_rank_descending": True}),
    "lazymar_v_prev_stale": Mutation("the previous layer-3 V not updated on cached steps", (LAZY_TOKENS,),
                                     {"lazymar_v_prev_stale": True}),
    # ---- MARche's active set (marche.md 3-4)
    "marche_select_layer_early": Mutation("relevance taken one decoder layer early", (MARCHE_ACTIVE,),
                                          {"marche_select_layer_early": True}),
    "marche_caching_not_forced": Mutation("caching rows (predicted at the previous step) not forced active",
                                          (MARCHE_ACTIVE,), {"marche_caching_not_forced": True}),
    # ---- DiSA (disa.md): the schedule index formula and the clip of the kept timesteps
    "disa_index_off_by_one": Mutation("DiSA index int(... * L) instead of int(... * (L - 1))", (DISA,),
                                      patch=(RD, "schedule_index", disa_index_off_by_one)),
    "disa_clip_ignored": Mutation("DiSA respacings without the clip at 950", (DISA,),
                                  patch=(RD, "kept_timesteps", disa_clip_ignored)),
    "marche_attend_stale_kv": Mutation("active queries attend to the cache before their fresh K/V is written",
                                       (MARCHE_ACTIVE,), {"marche_attend_stale_kv": True}),
}

"""CfgFreeLate: guidance only for the early AR steps (MAR, csrc/runtime/cfgfree.c) or
the early scales (VAR, csrc/runtime/var_cfgfree.c)."""
import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import Any

from .. import mar_family, var_family
from ._common import StepContext, engine_fields
from .nocache import NoCache


@dataclass(frozen=True)
class CfgFreeLate:
    """Classifier-free guidance for the early AR steps (MAR) or scales (VAR) only.

    MAR: AR step s of a run of N steps is *guidance-free* when ``s >= after * N``: it
    runs the conditional sequences alone through the transformer and samples its
    tokens with the head unguided (cfg 1), which halves the transformer and the head
    of the late steps. VAR: scale si of n is guidance-free when ``si >= after * n``:
    the conditional sequences alone through the transformer and the head, the tokens
    sampled from their logits unguided (t = 0); with the released 10 scales,
    ``after=0.8`` leaves the 13x13 and 16x16 scales (63 % of the FLOPs) unguided. The
    early steps or scales are guided as usual. ``after=1`` guides every one (the
    output equals ``inner`` alone, bit for bit); ``after=0`` guides none (the output
    of the same run without CFG: MAR ``cfg=1``, VAR ``cfg=0``). Without CFG the
    policy changes nothing.

    ``inner`` is the policy every step or scale runs with (default NoCache); the late
    ones reach it guidance-free, and the model family is the inner policy's (NoCache:
    either). MAR: composes with NoCache, and with LazyMAR and MARche when their
    ``cond_cache`` is on (their caches then hold the conditional half alone; without
    it they would cache both halves, and a guidance-free step computes one). VAR:
    composes with NoCache and FastVAR (a FastVAR scale run guidance-free prunes and
    restores the conditional sequences from the conditional half of its cache, which
    the guided cache scale filled). Guidance grows with the scale in VAR (t = cfg *
    si / (n - 1)), so the late scales are where it is strongest: whether dropping it
    there is acceptable is measured on the digits VAR (README, "CfgFreeLate on VAR").
    """

    after: float = 0.75
    inner: Any = field(default_factory=NoCache)

    name = "cfgfree"
    # The class serves both families; an instance runs on its inner policy's
    # (set in __post_init__: NoCache either, LazyMAR/MARche MAR, FastVAR VAR).
    family = mar_family.FAMILY
    families = (mar_family.FAMILY, var_family.FAMILY)

    def __post_init__(self):
        if isinstance(self.after, bool) or not isinstance(self.after, numbers.Real) or \
                not 0.0 <= float(self.after) <= 1.0:
            raise ValueError(f"CfgFreeLate.after must be a fraction in [0, 1], got {self.after!r}")
        from . import POLICIES  # the registry imports this module

        if not isinstance(self.inner, POLICIES) or isinstance(self.inner, CfgFreeLate):
            raise TypeError(f"CfgFreeLate.inner must be NoCache(), LazyMAR(...), MARche(...) or FastVAR(...), "
                            f"got {self.inner!r}")
        object.__setattr__(self, "family", self.inner.family)
        object.__setattr__(self, "families", getattr(self.inner, "families", (self.inner.family,)))
        if self.inner.family == mar_family.FAMILY and not isinstance(self.inner, NoCache) and \
                not getattr(self.inner, "cond_cache", False):
            raise ValueError(f"CfgFreeLate.inner={type(self.inner).__name__}(...) needs cond_cache=True: without the "
                             f"condition cache it caches both CFG halves, and a guidance-free step computes only "
                             f"the conditional one")

    def guided(self, step, steps):
        """Whether AR step (MAR) or scale (VAR) `step` of `steps` is guided (before `after`)."""
        return not step >= float(self.after) * steps

    def as_dict(self, rows=320):
        """The engine's configuration: `after` and the inner policy's own field dict."""
        return engine_fields(self, after=float(self.after), inner=self.inner.as_dict(rows=rows))

    def check_model(self, config):
        self.inner.check_model(config)

    def head_cache_config(self, cfg_on):
        return self.inner.head_cache_config(cfg_on)

    def step_cfg_on(self, ctx):
        return ctx.cfg_on and self.guided(ctx.step, ctx.steps)

    def transformer_flops(self, ctx):
        """(encoder, decoder) FLOPs of one AR step: the inner policy's, guidance-free late."""
        if self.step_cfg_on(ctx) == ctx.cfg_on:
            return self.inner.transformer_flops(ctx)
        late = StepContext(**{**ctx.__dict__, "cfg_on": False})
        return self.inner.transformer_flops(late)

    # ----------------------------------------------------------- VAR (var_family)
    def scale_cfg_on(self, ctx):
        """Whether VAR scale ctx.scale runs both CFG halves (var_family.ScaleContext)."""
        return ctx.cfg_on and self.guided(ctx.scale, ctx.n_scales)

    def runs_scale(self, si, n_scales):
        """The inner policy's scale plan (FastVAR may skip trailing scales)."""
        runs = getattr(self.inner, "runs_scale", None)
        return True if runs is None else runs(si, n_scales)

    def block_rows(self, config, si):
        """The inner policy's rows per block at scale si (FastVAR's; NoCache: every token)."""
        rows = getattr(self.inner, "block_rows", None)
        if rows is not None:
            return rows(config, si)
        tokens = int(config["patch_nums"][si]) ** 2
        return [(tokens, tokens)] * config["depth"]

    def _scale_ctx(self, ctx):
        return ctx if self.scale_cfg_on(ctx) == ctx.cfg_on else dataclasses.replace(ctx, cfg_on=False)

    def scale_keys(self, ctx):
        """K/V rows per sequence after the scale (the inner policy's)."""
        keys = getattr(self.inner, "scale_keys", None)
        return ctx.keys if keys is None else keys(self._scale_ctx(ctx))

    def scale_flops(self, ctx):
        """(linear, attention) FLOPs of the blocks at one VAR scale: the inner policy's on
        the sequences the scale runs (the conditional half alone when guidance-free)."""
        return self.inner.scale_flops(self._scale_ctx(ctx))

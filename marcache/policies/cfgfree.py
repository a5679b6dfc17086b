"""CfgFreeLate (csrc/runtime/cfgfree.c): guidance only for the early AR steps."""
import numbers
from dataclasses import dataclass, field
from typing import Any

from .. import mar_family
from ._common import StepContext, engine_fields
from .nocache import NoCache


@dataclass(frozen=True)
class CfgFreeLate:
    """Classifier-free guidance for the early AR steps only.

    AR step s of a run of N steps is *guidance-free* when ``s >= after * N``: it runs
    the conditional sequences alone through the transformer and samples its tokens
    with the head unguided (cfg 1), which halves the transformer and the head of the
    late steps. The early steps are guided as usual. ``after=1`` guides every step
    (the output equals ``inner`` alone); ``after=0`` guides none. Without CFG
    (``cfg == 1``) the policy changes nothing.

    ``inner`` is the policy every step runs with (default NoCache); the late steps
    reach it guidance-free. Composes with NoCache, and with LazyMAR and MARche when
    their ``cond_cache`` is on (their caches then hold the conditional half alone;
    without it they would cache both halves, and a guidance-free step computes one).
    """

    after: float = 0.75
    inner: Any = field(default_factory=NoCache)

    name = "cfgfree"
    family = mar_family.FAMILY

    def __post_init__(self):
        if isinstance(self.after, bool) or not isinstance(self.after, numbers.Real) or \
                not 0.0 <= float(self.after) <= 1.0:
            raise ValueError(f"CfgFreeLate.after must be a fraction in [0, 1], got {self.after!r}")
        from . import POLICIES  # the registry imports this module

        if not isinstance(self.inner, POLICIES) or isinstance(self.inner, CfgFreeLate):
            raise TypeError(f"CfgFreeLate.inner must be NoCache(), LazyMAR(...) or MARche(...), got {self.inner!r}")
        if self.inner.family != self.family:
            raise ValueError(f"CfgFreeLate.inner: {type(self.inner).__name__} is not a MAR policy")
        if not isinstance(self.inner, NoCache) and not getattr(self.inner, "cond_cache", False):
            raise ValueError(f"CfgFreeLate.inner={type(self.inner).__name__}(...) needs cond_cache=True: without the "
                             f"condition cache it caches both CFG halves, and a guidance-free step computes only "
                             f"the conditional one")

    def guided(self, step, steps):
        """Whether AR step `step` of `steps` is guided (before `after`)."""
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

"""DiSA (csrc/runtime/disa.c): diffusion step annealing, composed with another policy."""
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from .. import mar_family
from ._common import StepContext, engine_fields
from .nocache import NoCache

SCHEDULES = ("linear", "cosine", "constant", "two-stage")
BASE_TIMESTEPS = 1000  # the head's training diffusion (cosine, learned sigma)
OFFICIAL_CLIP = 950    # the official DiSA sampler's clip of the kept timesteps


def respaced_timesteps(steps, clip=None):
    """The kept timesteps of a respacing of the 1000-step DDPM to `steps` steps,
    ascending: ``space_timesteps(1000, str(steps))`` (Python round, half to even, of a
    repeatedly incremented float) with every kept timestep t made ``min(t, clip)``;
    the kept set stays a set, so timesteps above ``clip`` collapse into one. ``clip``
    None keeps them (the engine's clip 999)."""
    stride = (BASE_TIMESTEPS - 1) / (steps - 1) if steps > 1 else 1
    kept, cursor = set(), 0.0
    for _ in range(steps):
        t = round(cursor)
        cursor += stride
        kept.add(t if clip is None else min(t, clip))
    return sorted(kept)


@dataclass(frozen=True)
class DiSA:
    """DiSA: diffusion step annealing (Zhao et al., arXiv 2505.20297), training-free.

    AR step ``s`` of a run of N steps samples its tokens with a respaced DDPM of
    ``k = end + i`` steps, where i is the official schedule index over the L =
    start - end + 1 respacings, with U = N - 1 (``int()`` truncates):

    - ``"linear"``: ``i = int((U - s) / U * (L - 1))`` (start steps first, end last)
    - ``"cosine"``: ``i = int((cos(pi * s / U) + 1) / 2 * (L - 1))``
    - ``"constant"``: ``i = 0`` (always ``end`` steps)
    - ``"two-stage"``: ``i = L - 1`` while ``s < U / 2``, else 0.

    With one AR step (N = 1) the official formula divides by zero; marcache samples
    that step with ``start`` steps. Each respacing is the one MAR's head uses
    (``space_timesteps``, cosine schedule, 1000 training steps, learned sigma; float64
    tables made by the same engine code as the model's own 100-step tables), with
    the official DiSA sampler's clip of the kept timesteps: each becomes
    ``min(t, clip)`` and the set collapses the ones above, so ``start=50`` with the
    default ``clip=950`` runs 48 distinct steps and starts at t = 950.
    ``clip=None`` clips nothing (the official "default" sampler's behaviour);
    ``DiSA(start=100, end=100, clip=None)`` equals NoCache bit for bit on a model
    loaded with the default 100 diffusion steps. DiSA's respacings replace the
    model's ``diffusion_steps`` (set at load) for the head.

    ``inner`` is the policy every step runs with (default NoCache): its transformer,
    and its head cache (LazyMAR's, or MARche's ``head_cache=True``) planned on the
    step's k respaced diffusion indices j = k-1..0: full evaluations at the first
    and at every ``head_period``-th index, the MLP recomputed while
    ``j > head_recompute_above * k``. ``DiSA(inner=CfgFreeLate(...))`` composes
    with late guidance as well.

    Noise is keyed by (image, position, diffusion index j), so two step counts
    draw the same noise at the same j; the official code draws fresh noise.
    """

    start: int = 50
    end: int = 5
    schedule: str = "linear"
    clip: Optional[int] = OFFICIAL_CLIP
    inner: Any = field(default_factory=NoCache)

    name = "disa"
    family = mar_family.FAMILY

    def __post_init__(self):
        for name in ("start", "end"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= BASE_TIMESTEPS:
                raise ValueError(f"DiSA.{name} must be an integer number of diffusion steps in 1..{BASE_TIMESTEPS}, "
                                 f"got {value!r}")
        if self.start < self.end:
            raise ValueError(f"DiSA.start must be >= DiSA.end (steps at the first AR step, then at the last), "
                             f"got start={self.start}, end={self.end}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"DiSA.schedule must be one of {', '.join(repr(s) for s in SCHEDULES)}, "
                             f"got {self.schedule!r}")
        if self.clip is not None and (isinstance(self.clip, bool) or not isinstance(self.clip, int)
                                      or not 0 <= self.clip <= BASE_TIMESTEPS - 1):
            raise ValueError(f"DiSA.clip must be None or an integer timestep in 0..{BASE_TIMESTEPS - 1} "
                             f"(official: {OFFICIAL_CLIP}), got {self.clip!r}")
        from . import POLICIES  # the registry imports this module

        if not isinstance(self.inner, POLICIES) or isinstance(self.inner, DiSA):
            raise TypeError(f"DiSA.inner must be NoCache(), LazyMAR(...), MARche(...) or CfgFreeLate(...), "
                            f"got {self.inner!r}")
        if self.inner.family != self.family:
            raise ValueError(f"DiSA.inner: {type(self.inner).__name__} is not a MAR policy")

    def schedule_index(self, step, steps):
        """The official index i (0 .. start - end) of AR step `step` of `steps`."""
        last, upper = self.start - self.end, steps - 1
        if upper <= 0:
            return last
        if self.schedule == "linear":
            return int((upper - step) / upper * last)
        if self.schedule == "cosine":
            return int((math.cos(math.pi * step / upper) + 1) / 2 * last)
        if self.schedule == "constant":
            return 0
        return last if step < upper / 2 else 0

    def respaced_steps(self, step, steps):
        """Respaced steps k of AR step `step` before the clip (the official step count)."""
        return self.end + self.schedule_index(step, steps)

    def diffusion_steps_at(self, step, steps):
        """Diffusion steps the head runs at AR step `step` (distinct timesteps after the clip)."""
        return len(respaced_timesteps(self.respaced_steps(step, steps), self.clip))

    def as_dict(self, rows=320):
        """The engine's configuration: the fields, clip None sent as 999 (which clips
        nothing), and the inner policy's own field dict."""
        return engine_fields(self, clip=BASE_TIMESTEPS - 1 if self.clip is None else self.clip,
                             inner=self.inner.as_dict(rows=rows))

    def check_model(self, config):
        self.inner.check_model(config)

    def head_cache_config(self, cfg_on):
        return self.inner.head_cache_config(cfg_on)

    def step_cfg_on(self, ctx):
        return self.inner.step_cfg_on(ctx) if hasattr(self.inner, "step_cfg_on") else ctx.cfg_on

    def step_diffusion_steps(self, ctx: StepContext, default):
        """Diffusion steps of one AR step (the model's `default` does not apply)."""
        del default
        return self.diffusion_steps_at(ctx.step, ctx.steps)

    def transformer_flops(self, ctx):
        """(encoder, decoder) FLOPs of one AR step: the inner policy's."""
        return self.inner.transformer_flops(ctx)

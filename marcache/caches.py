"""Cache policy configurations: small frozen dataclasses whose fields are
validated at construction. The C runtime reads them (as_dict)."""
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Optional, Tuple


@dataclass(frozen=True)
class NoCache:
    """Every AR step runs the full encoder, decoder and head: the official model."""

    name = "none"


def _retention_64():
    """LazyMAR's retention table for 64 steps (lazymar.md 5.4)."""
    table = []
    for s in range(64):
        if s < 20:
            r = 1.0
        elif s == 20:
            r = 0.6
        elif s < 25:
            r = 0.5
        elif s < 30:
            r = 0.4
        elif s < 35:
            r = 0.15
        elif s < 40:
            r = 0.12
        else:
            r = 0.05
        table.append(r)
    return tuple(table)


RETENTION_64 = _retention_64()


def _check_fields(cache, what, flags, lower_bounds):
    """The checks both cache configurations share: boolean switches, integer fields with
    lower bounds, and LazyMAR's head-cache settings (which MARche reuses)."""
    for flag in flags:
        if not isinstance(getattr(cache, flag), bool):
            raise TypeError(f"{what}.{flag} must be True or False, got {getattr(cache, flag)!r}")
    for name, low in tuple(lower_bounds) + (("head_period", 1), ("head_skip_first", 0), ("head_skip_last", -1)):
        value = getattr(cache, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{what}.{name} must be an integer >= {low}, got {value!r}")
    if cache.head_skip_last < cache.head_skip_first - 1:
        raise ValueError(f"{what}.head_skip_last must be >= head_skip_first - 1 (an empty range)")
    above = cache.head_recompute_above
    if not isinstance(above, (int, float)) or not 0.0 <= above <= 1.0:
        raise ValueError(f"{what}.head_recompute_above must be in [0, 1], got {above!r}")


@dataclass(frozen=True)
class LazyMAR:
    """LazyMAR (Yan et al., ICCV 2025) as the official code runs it, at any step count.

    AR step s is a *full* step when ``s < start`` or ``(s - start) % period == 0``;
    full steps run the whole model and refill the caches. The other steps are
    *cached*:

    - ``token_cache``: the encoder runs only the buffer rows and the tokens
      revealed last step, attending to per-layer cached K/V of all visible
      tokens; the decoder runs all rows up to ``select_layer`` (0-based; the
      official "layer 3"), ranks rows by the cosine of that layer's V against
      the previous step (mean over heads), and keeps only
      ``max(predicted + predicted_last_step + margin, floor(320 * r))`` rows
      for the remaining layers, which attend to cached K/V of every row.
      Rows predicted now and last step are always kept (the official code can
      drop them when many cosines are negative; marcache never does).
    - ``cond_cache`` (with CFG): the unconditional branch is skipped and its
      last-block output approximated as ``cond + (uncond - cond)`` from the
      last full step.
    - ``head_cache``: inside every AR step's diffusion sampler, full head
      evaluations at the first timestep and every ``head_period``-th; in
      between only the conditional rows run, res blocks
      ``head_skip_first..head_skip_last`` add their cached deltas, the other
      blocks reuse their cached MLP output (recomputed when
      ``j > head_recompute_above * T``), and ``eps_uncond = eps_cond - delta``.

    ``retention`` is the 64-step table; a run of N steps reads entry
    ``floor(s * 64 / N)`` (normalised progress, the identity at 64 steps).
    ``start`` and ``period`` are used as given: ``LazyMAR.preset(32)`` gives the
    paper's 32-step setting (start 4, period 5). With ``period=1`` every step is
    full. ``cfg == 1`` runs without the condition cache; unconditional
    generation works.
    """

    token_cache: bool = True
    cond_cache: bool = True
    head_cache: bool = True
    start: int = 5
    period: int = 9
    retention: Tuple[float, ...] = field(default=RETENTION_64)
    select_layer: int = 3
    margin: int = 15
    head_period: int = 7
    head_skip_first: int = 1
    head_skip_last: int = 4
    head_recompute_above: float = 0.9

    name = "lazymar"

    def __post_init__(self):
        _check_fields(self, "LazyMAR", ("token_cache", "cond_cache", "head_cache"),
                      (("start", 0), ("period", 1), ("select_layer", 0), ("margin", 0)))
        table = tuple(float(r) for r in self.retention)
        if len(table) != 64 or not all(0.0 <= r <= 1.0 for r in table):
            raise ValueError("LazyMAR.retention must be 64 fractions in [0, 1] (the 64-step table)")
        object.__setattr__(self, "retention", table)

    @classmethod
    def preset(cls, steps, **overrides):
        """The published settings: 64 steps (the official code's constants) or 32
        steps (the paper's start 4, period 5; the retention table is the 64-step
        one read by normalised progress, since the paper gives none)."""
        if steps == 64:
            base = cls()
        elif steps == 32:
            base = cls(start=4, period=5)
        else:
            raise ValueError(f"LazyMAR presets exist for 64 and 32 steps, not {steps}")
        return replace(base, **overrides)

    def is_full_step(self, step):
        return step < self.start or (step - self.start) % self.period == 0

    def retention_at(self, step, num_steps):
        index = min(63, step * 64 // num_steps)
        return self.retention[index]

    def keep_rows(self, step, num_steps, predicted, predicted_before, rows=320):
        """Decoder rows kept per sequence on a cached step."""
        import numpy as np

        by_table = math.floor(rows * float(np.float32(self.retention_at(step, num_steps))))
        return min(rows, max(predicted + predicted_before + self.margin, by_table))

    def as_dict(self, rows=320):
        """The C runtime's configuration (one struct serves LazyMAR and MARche);
        ``rows`` (P + S) is unused: LazyMAR's row counts are computed by the engine."""
        del rows
        d = _engine_defaults()
        d.update(encoder_cache=int(self.token_cache), decoder_mode=DECODER_LAZYMAR if self.token_cache else DECODER_FULL,
                 cond_cache=int(self.cond_cache), head_cache=int(self.head_cache), start=self.start,
                 period=self.period, retention=list(self.retention), select_layer=self.select_layer,
                 margin=self.margin, head_period=self.head_period, head_skip_first=self.head_skip_first,
                 head_skip_last=self.head_skip_last, head_recompute_above=float(self.head_recompute_above))
        return d


DECODER_FULL, DECODER_LAZYMAR, DECODER_MARCHE = 0, 1, 2


def _engine_defaults():
    return dict(encoder_cache=0, decoder_mode=DECODER_FULL, cond_cache=0, head_cache=0, start=0, period=1,
                retention=[1.0] * 64, select_layer=0, margin=0, budget=1, full_layers=1, marche_select_layer=0,
                image_candidates=0, refresh_low=0, head_period=7, head_skip_first=1, head_skip_last=4,
                head_recompute_above=0.9)


@dataclass(frozen=True)
class MARche:
    """MARche (Jiang et al., arXiv 2506.12035): cache-aware attention with selective KV refresh.

    The paper has no public code; this follows marcache's spec (marche.md), with
    every choice the paper leaves open exposed as a field.

    Step s is a *full refresh* step when ``s < refresh_phase`` or
    ``(s - refresh_phase) % refresh_period == 0`` (step 0 is always full): the plain model runs and
    the K/V of every decoder layer after the full prefix are cached. On the other
    steps the decoder layers ``1..full_layers`` (1-based, as in the paper) run on
    every row; inside layer ``select_layer`` the attention probabilities that the
    *generating* rows (predicted now) put on each row are summed over heads and
    generating queries, and the rows with the most mass become *refreshing* rows.
    The *active* set is generating + *caching* rows (predicted last step) +
    refreshing rows, ``max(budget, generating + caching)`` rows per sequence.
    The later layers run only on active rows: their fresh K/V are written back
    into each layer's cache and they attend to every row (fresh K/V for active
    rows, cached K/V for the others; this is exactly attention over the union,
    the online-softmax merge of the two parts). The FFN runs on active rows only.

    Decisions where the paper is silent, as fields:
    ``select_layer=2`` (the paper says layer 2 in sections 4.2/5.3 and layer 1 in 4.3/App. D);
    ``candidates="all"`` (buffer rows may be refreshed; ``"image"`` restricts to image rows);
    ``refresh="high"`` (``"low"`` is the paper's ablation); selection per sequence, CFG halves
    separately; ties go to the lower row; the encoder runs in full (``encoder_cache=True`` is
    the labelled extension E1: LazyMAR's encoder token cache, not in the paper).
    Composition beyond both papers: ``cond_cache=True`` adds LazyMAR's condition cache
    (only the conditional half is computed on cached steps; the unconditional output is
    cond + the diff of the last full step) and ``head_cache=True`` LazyMAR's diffusion-head
    cache with LazyMAR's default head settings (``head_period`` etc.).
    With ``budget >= P + S`` (320 on the released models) every row is active and the
    output equals NoCache.

    ``budget=None`` (the default) takes one fifth of the decoder rows ``P + S``, rounded:
    the paper's 64 on the released models (320 rows), 16 on the shipped digits model
    (80 rows). An integer is used as given, whatever the model.
    """

    budget: Optional[int] = None
    select_layer: int = 2
    full_layers: int = 2
    refresh_period: int = 3
    refresh_phase: int = 0
    candidates: str = "all"
    refresh: str = "high"
    encoder_cache: bool = False
    cond_cache: bool = False
    head_cache: bool = False
    head_period: int = 7
    head_skip_first: int = 1
    head_skip_last: int = 4
    head_recompute_above: float = 0.9

    name = "marche"

    def __post_init__(self):
        _check_fields(self, "MARche", ("encoder_cache", "cond_cache", "head_cache"),
                      (("select_layer", 1), ("full_layers", 1), ("refresh_period", 1), ("refresh_phase", 0)))
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, int)
                                        or self.budget < 1):
            raise ValueError(f"MARche.budget must be None or an integer >= 1, got {self.budget!r}")
        if self.select_layer > self.full_layers:
            raise ValueError(f"MARche.select_layer ({self.select_layer}) must be one of the full layers "
                             f"1..full_layers ({self.full_layers})")
        if self.candidates not in ("all", "image"):
            raise ValueError(f"MARche.candidates must be 'all' or 'image', got {self.candidates!r}")
        if self.refresh not in ("high", "low"):
            raise ValueError(f"MARche.refresh must be 'high' or 'low', got {self.refresh!r}")

    def is_full_step(self, step):
        return step < self.refresh_phase or (step - self.refresh_phase) % self.refresh_period == 0

    def budget_for(self, rows=320):
        """The active-set budget on a model with ``rows`` = P + S decoder rows."""
        if self.budget is not None:
            return self.budget
        return max(1, int(math.floor(rows / 5 + 0.5)))

    def active_rows(self, generating, caching, rows=320, image_rows=256):
        candidates = (image_rows if self.candidates == "image" else rows) - generating - caching
        forced = generating + caching
        return min(rows, min(max(self.budget_for(rows), forced), forced + candidates))

    def as_dict(self, rows=320):
        """The C runtime's configuration for a model with ``rows`` = P + S decoder rows."""
        d = _engine_defaults()
        d.update(encoder_cache=int(self.encoder_cache), decoder_mode=DECODER_MARCHE, cond_cache=int(self.cond_cache),
                 head_cache=int(self.head_cache), start=self.refresh_phase, period=self.refresh_period,
                 budget=self.budget_for(rows), full_layers=self.full_layers, marche_select_layer=self.select_layer - 1,
                 image_candidates=int(self.candidates == "image"), refresh_low=int(self.refresh == "low"),
                 head_period=self.head_period, head_skip_first=self.head_skip_first,
                 head_skip_last=self.head_skip_last, head_recompute_above=float(self.head_recompute_above))
        return d


def resolve(cache):
    """Returns a validated cache config (None means NoCache)."""
    if cache is None:
        return NoCache()
    if isinstance(cache, (NoCache, LazyMAR, MARche)):
        return cache
    raise TypeError(f"cache must be None, marcache.NoCache(), marcache.LazyMAR(...) or marcache.MARche(...), "
                    f"got {cache!r}")

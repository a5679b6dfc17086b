"""MARche (csrc/runtime/marche.c): its configuration and its FLOP model."""
import math
from dataclasses import dataclass
from typing import Optional

from .. import mar_family
from ._common import check_fields, engine_fields


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
    family = mar_family.FAMILY

    def __post_init__(self):
        check_fields(self, "MARche", ("encoder_cache", "cond_cache", "head_cache"),
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
        """The engine's configuration for a model with ``rows`` = P + S decoder rows:
        the policy's name and its own fields, the budget resolved."""
        return engine_fields(self, budget=self.budget_for(rows))

    def check_model(self, config):
        depth = config["decoder_depth"]
        if self.full_layers > depth:
            raise ValueError(f"MARche.full_layers={self.full_layers} but the decoder has {depth} layers")

    def head_cache_config(self, cfg_on):
        del cfg_on
        return self if self.head_cache else None

    def transformer_flops(self, ctx):
        """(encoder, decoder) FLOPs of one AR step."""
        c, B = ctx.config, ctx.batch
        if self.is_full_step(ctx.step):
            return mar_family.plain_transformer(c, ctx.n_seq, ctx.known, ctx.read_full_step(self.cond_cache))
        n = 2 * B if (ctx.cfg_on and not (self.cond_cache and ctx.cfg_on)) else B
        P, S, Dd = c["buffer_size"], c["seq_len"], c["decoder_width"]
        L, F = P + S, self.full_layers
        if self.encoder_cache:
            enc, embed = mar_family.encoder(c, n, ctx.predicted_before, P + ctx.predicted_before, P + ctx.known)
        else:
            enc, embed = mar_family.encoder(c, n, ctx.known, P + ctx.known, P + ctx.known)
        active = self.active_rows(ctx.predicted, ctx.predicted_before, L, S)
        dec = embed + mar_family.decoder_layers(c, n, L, L, F) + 2 * n * ctx.predicted * L * Dd + \
            mar_family.decoder_layers(c, n, active, L, c["decoder_depth"] - F, ctx.read(ctx.predicted))
        return enc, dec

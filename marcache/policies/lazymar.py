"""LazyMAR (csrc/runtime/lazymar.c): its configuration and its FLOP model."""
import math
from dataclasses import dataclass, field, replace
from typing import Tuple

from .. import mar_family
from ._common import check_fields, engine_fields


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
    family = mar_family.FAMILY

    def __post_init__(self):
        check_fields(self, "LazyMAR", ("token_cache", "cond_cache", "head_cache"),
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
        """The engine's configuration: the policy's name and its own fields (the C
        policy's field table reads them by name). ``rows`` (P + S) is unused: LazyMAR's
        row counts are computed by the engine."""
        del rows
        return engine_fields(self)

    def check_model(self, config):
        depth = config["decoder_depth"]
        if self.token_cache and self.select_layer >= depth:
            raise ValueError(f"LazyMAR.select_layer={self.select_layer} but the decoder has {depth} layers")

    def head_cache_config(self, cfg_on):
        del cfg_on
        return self if self.head_cache else None

    def transformer_flops(self, ctx):
        """(encoder, decoder) FLOPs of one AR step."""
        c, B = ctx.config, ctx.batch
        cond_cache = self.cond_cache and ctx.cfg_on
        if self.is_full_step(ctx.step) or not (self.token_cache or cond_cache):
            return mar_family.plain_transformer(c, ctx.n_seq, ctx.known, ctx.read_full_step(cond_cache))
        if not self.token_cache:  # condition cache alone: the conditional half only
            return mar_family.plain_transformer(c, B, ctx.known, ctx.read(ctx.predicted))
        n = 2 * B if (ctx.cfg_on and not cond_cache) else B
        P, S = c["buffer_size"], c["seq_len"]
        L, q, keys = P + S, P + ctx.predicted_before, P + ctx.known
        enc, embed = mar_family.encoder(c, n, ctx.predicted_before, q, keys)
        keep = self.keep_rows(ctx.step, ctx.steps, ctx.predicted, ctx.predicted_before, L)
        sel, depth = self.select_layer, c["decoder_depth"]
        dec = embed + mar_family.decoder_layers(c, n, L, L, sel) + \
            mar_family.attn(n, L, L, c["decoder_width"]) + mar_family.mlp(n * keep, c["decoder_width"],
                                                                          c["decoder_mlp_hidden"]) + \
            mar_family.decoder_layers(c, n, keep, L, depth - sel - 1, ctx.read(ctx.predicted))
        return enc, dec

"""FastVAR (csrc/runtime/fastvar.c): cached token pruning for VAR models, its
configuration and its FLOP model (spec var_fastvar.md Part D)."""
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from .. import var_family

#: Most scales a VAR model may have (csrc/models/var.h MC_VAR_MAX_SCALES): the length
#: of the engine's per-scale ratio table.
MAX_SCALES = 16
#: The engine's entry for a scale that is not pruned.
NOT_PRUNED = -1.0


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _parse_prune(value):
    """prune as given: a mapping {scale: ratio}, or its text from the command line
    ("8:0.5,9:0.75" or a JSON object {"8": 0.5}). Keys may be decimal strings."""
    if isinstance(value, str):
        text = value.strip()
        if text in ("", "{}", "none"):
            return {}
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                raise ValueError(f"FastVAR.prune: {value!r} is not a JSON object of scale: ratio") from None
        else:
            pairs = {}
            for item in text.split(","):
                scale, sep, ratio = item.partition(":")
                if not sep:
                    raise ValueError(f"FastVAR.prune: {value!r}: expected SCALE:RATIO pairs separated by commas "
                                     f"(e.g. 8:0.5,9:0.75)")
                pairs[scale.strip()] = ratio.strip()
            value = pairs
    if not hasattr(value, "items"):
        raise ValueError(f"FastVAR.prune must be a dict {{scale: ratio}}, got {value!r}")
    out = {}
    for scale, ratio in value.items():
        if isinstance(scale, str) and scale.strip().isdigit():
            scale = int(scale)
        if not _is_int(scale) or scale < 0:
            raise ValueError(f"FastVAR.prune: scale {scale!r} must be a scale index >= 0")
        if isinstance(ratio, str):
            try:
                ratio = float(ratio)
            except ValueError:
                raise ValueError(f"FastVAR.prune[{scale}] = {ratio!r}: a ratio must be a number in [0, 1]") from None
        if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0.0 <= float(ratio) <= 1.0:
            raise ValueError(f"FastVAR.prune[{scale}] = {ratio!r}: a ratio must be in [0, 1] (1 skips the scale)")
        if int(scale) in out:
            raise ValueError(f"FastVAR.prune names scale {int(scale)} twice")
        out[int(scale)] = float(ratio)
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class FastVAR:
    """FastVAR (Guo et al., arXiv 2503.23367): cached token pruning for VAR models.

    The scales up to and including ``cache_scale`` run in full; at ``cache_scale``
    every block of the layer range also keeps its attention and FFN outputs (after
    the adaLN gamma) for every token. At a pruned scale ``si`` (``prune = {si:
    rho}``), inside every block of the range and separately for the attention and
    the FFN sublayer, each sequence (the two CFG halves separately) scores its
    tokens by the squared distance of the residual stream to its mean token, keeps
    the ``L - floor(rho * L)`` highest-scoring tokens (a tie goes to the lower
    token index; kept tokens stay in raster order), runs the sublayer on them only
    (the attention appends only their K/V), and fills the other tokens with the
    cached output area-resized to the scale's size. ``rho = 1`` skips the scale
    (trailing scales only: the latent accumulated so far is decoded as is); so
    does ``skip_last=n`` for the last n scales. Logits, guidance, sampling and the
    VQ update are unchanged.

    - ``cache_scale``: the scale index (0-based) whose outputs are cached; every
      pruned scale must come after it.
    - ``prune``: {scale index: ratio in [0, 1]}.
    - ``layers``: the pruned blocks as ``(start, stop)`` (Python's half-open
      range; a ``range`` works too), or None for every block.
    - ``skip_last``: how many trailing scales are skipped (as ratio 1).

    The defaults are the spec's HART-like setting for the released 10-scale models
    (patch_nums 1,2,3,4,5,6,8,10,13,16): cache at 10x10 (scale 7), prune 13x13
    (scale 8) by 50 % and 16x16 (scale 9) by 75 %, every block, nothing skipped.
    Why: on the measured digits curve (benchmarks/results/fastvar-digits-2026-11-25.md)
    its analogue keeps class accuracy within 0.6 points of no pruning (the bar is 2)
    with the largest FLOP cut of the settings that run every scale (58.6 % of the
    FLOPs on d16, 58.8 % on d30); it is the spec's proposal (D8) and HART's shipped
    setting, and no ImageNet measurement exists to re-tune it. Its digits-FID cost is
    +5.9; ``FastVAR(cache_scale=8, prune={9: 0.5})`` (80.5 % of the FLOPs) keeps the
    digits-FID within noise. Models with other patch_nums (the digits VAR) need their
    own scale indices. ``prune={}`` is the uncached model exactly. Composes with
    guidance and with ``CfgFreeLate(inner=FastVAR(...))`` (guidance-free late scales).
    """

    cache_scale: int = 7
    prune: Dict[int, float] = field(default_factory=lambda: {8: 0.5, 9: 0.75}, hash=False)
    layers: Optional[Tuple[int, int]] = None
    skip_last: int = 0

    name = "fastvar"
    family = var_family.FAMILY

    def __post_init__(self):
        if not _is_int(self.cache_scale) or self.cache_scale < 0:
            raise ValueError(f"FastVAR.cache_scale must be a scale index >= 0, got {self.cache_scale!r}")
        if not _is_int(self.skip_last) or self.skip_last < 0:
            raise ValueError(f"FastVAR.skip_last must be an integer >= 0, got {self.skip_last!r}")
        prune = _parse_prune(self.prune)
        for scale, ratio in prune.items():
            if scale <= self.cache_scale:
                raise ValueError(f"FastVAR.prune: scale {scale} is at or before the cache scale (cache_scale = "
                                 f"{self.cache_scale}); pruned scales restore from it, so they come after it")
            if scale >= MAX_SCALES:
                raise ValueError(f"FastVAR.prune: scale {scale} is beyond the {MAX_SCALES} scales a VAR model "
                                 f"may have")
        object.__setattr__(self, "prune", prune)
        object.__setattr__(self, "layers", self._parse_layers(self.layers))

    @staticmethod
    def _parse_layers(layers):
        if layers is None:
            return None
        if isinstance(layers, range):
            if layers.step != 1:
                raise ValueError(f"FastVAR.layers: {layers!r} must have step 1")
            layers = (layers.start, layers.stop)
        try:
            start, stop = layers
        except (TypeError, ValueError):
            raise ValueError(f"FastVAR.layers must be None or (start, stop), got {layers!r}") from None
        bounds = []
        for v in (start, stop):
            if isinstance(v, float) and v.is_integer():  # the command line gives floats
                v = int(v)
            if not _is_int(v):
                raise ValueError(f"FastVAR.layers must be None or (start, stop) of block indices, got {layers!r}")
            bounds.append(int(v))
        if not 0 <= bounds[0] < bounds[1]:
            raise ValueError(f"FastVAR.layers = {tuple(bounds)}: needs 0 <= start < stop")
        return tuple(bounds)

    # ----------------------------------------------------------- the model's view
    def layer_range(self, depth):
        """The pruned blocks [start, stop) of a model with `depth` blocks."""
        return (0, depth) if self.layers is None else self.layers

    def _skipped(self, si, n_scales):
        return si >= n_scales - self.skip_last or self.prune.get(si) == 1.0

    def runs_scale(self, si, n_scales):
        """Whether scale si of n_scales runs (the engine's scale plan)."""
        return not self._skipped(si, n_scales)

    def pruned(self, si):
        """Whether scale si is pruned (a ratio below 1)."""
        return si in self.prune and self.prune[si] < 1.0

    def kept_tokens(self, si, tokens):
        """Tokens per sequence each pruned sublayer keeps at scale si: L - floor(rho L)
        (tokens when si is not pruned)."""
        if not self.pruned(si):
            return tokens
        return tokens - math.floor(tokens * self.prune[si])

    def check_model(self, config):
        """The model-dependent checks (a ValueError naming the field)."""
        n = len(config["patch_nums"])
        depth = config["depth"]
        if self.cache_scale >= n:
            raise ValueError(f"FastVAR.cache_scale = {self.cache_scale} is outside the model's scales 0..{n - 1}"
                             f"{self._patch_hint(config)}")
        for scale in self.prune:
            if scale >= n:
                raise ValueError(f"FastVAR.prune names scale {scale}, but the model has scales 0..{n - 1}"
                                 f"{self._patch_hint(config)}")
        if self.skip_last >= n:
            raise ValueError(f"FastVAR.skip_last = {self.skip_last}: the model has {n} scales, at least the first "
                             f"must run")
        for si in range(n - self.skip_last, n):
            if self.pruned(si):
                raise ValueError(f"FastVAR.skip_last = {self.skip_last} skips scale {si}, which prune gives ratio "
                                 f"{self.prune[si]} (below 1: pruned, not skipped)")
        for si in range(n):
            if self._skipped(si, n):
                later = [s for s in range(si + 1, n) if not self._skipped(s, n)]
                if later:
                    raise ValueError(f"FastVAR.prune: scale {si} is skipped (ratio 1) but scale {later[0]} after it "
                                     f"runs: only trailing scales can be skipped")
        if self.layers is not None and self.layers[1] > depth:
            raise ValueError(f"FastVAR.layers = {self.layers} is outside the model's blocks 0..{depth - 1} "
                             f"(start, stop with stop <= {depth})")

    @staticmethod
    def _patch_hint(config):
        pns = ",".join(str(p) for p in config["patch_nums"])
        return f" (patch_nums {pns}; the defaults are for the released 10-scale models: pass cache_scale= and prune=)"

    def as_dict(self, rows=320):
        """The engine's configuration: the field table of csrc/runtime/fastvar.c (prune as
        a ratio per scale, -1 where a scale is not pruned; layers as layer_first /
        layer_stop, -1 meaning the model's depth). ``rows`` is unused (MAR's)."""
        del rows
        table = [NOT_PRUNED] * MAX_SCALES
        for scale, ratio in self.prune.items():
            table[scale] = ratio
        first, stop = (0, -1) if self.layers is None else self.layers
        return {"policy": self.name, "cache_scale": self.cache_scale, "prune": table, "layer_first": first,
                "layer_stop": stop, "skip_last": self.skip_last}

    # ----------------------------------------------------------- FLOP model
    def block_rows(self, config, si):
        """[(attention rows, FFN rows)] per block at scale si, per sequence (the
        engine's telemetry "block_rows"); zeros when the scale is skipped."""
        n_scales = len(config["patch_nums"])
        tokens = int(config["patch_nums"][si]) ** 2
        if self._skipped(si, n_scales):
            return [(0, 0)] * config["depth"]
        start, stop = self.layer_range(config["depth"])
        keep = self.kept_tokens(si, tokens) if self.prune else tokens
        return [(keep, keep) if start <= b < stop else (tokens, tokens) for b in range(config["depth"])]

    def _block_keys(self, config, si):
        """K/V rows per sequence of every block after scale si."""
        keys = [0] * config["depth"]
        for s in range(si + 1):
            for b, (attn_rows, _) in enumerate(self.block_rows(config, s)):
                keys[b] += attn_rows
        return keys

    def scale_keys(self, ctx):
        """K/V rows per sequence after the scale, the largest over blocks (the engine's
        telemetry kv_rows)."""
        return max(self._block_keys(ctx.config, ctx.scale))

    def scale_flops(self, ctx):
        """(linear, attention) FLOPs of the blocks at one scale (var_family.ScaleContext):
        the attention and FFN GEMMs on the rows each sublayer runs, and attention over
        the block's own K/V length, which earlier pruned scales shortened."""
        c = ctx.config
        C, hidden = c["width"], c["ffn_hidden"]
        if not self.runs_scale(ctx.scale, ctx.n_scales):
            return 0, 0
        keys = self._block_keys(c, ctx.scale)
        linear = attention = 0
        for b, (attn_rows, ffn_rows) in enumerate(self.block_rows(c, ctx.scale)):
            linear += attn_linear(ctx.n_seq * attn_rows, C) + ffn_linear(ctx.n_seq * ffn_rows, C, hidden)
            attention += var_family.attention(ctx.n_seq, attn_rows, keys[b], C)
        return linear, attention


def attn_linear(rows, width):
    """mat_qkv (C -> 3C) and proj (C -> C) on `rows` token rows."""
    return 2 * rows * width * 3 * width + 2 * rows * width * width


def ffn_linear(rows, width, ffn_hidden):
    """fc1 (C -> hidden) and fc2 (hidden -> C) on `rows` token rows."""
    return 4 * rows * width * ffn_hidden

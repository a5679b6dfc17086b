"""Float64 reference of FastVAR's cached token pruning on class-conditional VAR,
written from spec/var_fastvar.md Part D (D1-D4, D8) and the marcache FastVAR
settings, on top of the VAR reference (tests/reference/var.py), independently of
the C engine.

Settings (marcache.FastVAR): cache_scale; prune {scale: rho}; layers (start,
stop) or None for every block; skip_last. Per run:

  * scales before the cache scale and scales neither cached nor pruned: every
    block on every row (VAR A5);
  * the cache scale: the same, and every block of the layer range keeps both
    sublayers' outputs times gamma, [S, pc * pc, C] each (D3, D8);
  * a pruned scale (rho < 1), every block of the range, the attention and then
    the FFN sublayer (D1), each on the residual stream x entering it:
      PTS (D2): per sequence, mu = mean over rows of x, score_i = sum_c (x_ic -
      mu_c)^2; keep K = L - floor(L rho) rows, the largest scores first, a tie to
      the lower row index; kept rows in raster order;
      the sublayer (modulated LN, attention or FFN, times gamma) on the kept rows;
      the attention appends only their k/v to the block's cache (D4);
      CTR (D3): the cached output of the same block and sublayer, area-resized
      (adaptive average pooling, spec B3/D3) from pc x pc to pn x pn, with the
      kept rows' outputs written over it, is added to x;
  * rho = 1 or the last skip_last scales: skipped (trailing scales only; D5, D8).
Blocks outside the layer range run in full at every scale.

Without any pruned scale the run is the plain VAR loop.

Composition with CfgFreeLate (the seams issue's guidance-free late steps, here scales):
with `cfg_free_after` = a, scale si of n runs guidance-free when si >= a * n (and the
run has CFG): the conditional sequences alone (the first B) through the transformer,
whose later K/V then hold the conditional rows only, and the tokens sampled from their
logits without guidance. Everything else, pruning included, is unchanged: a pruned
guidance-free scale restores from the conditional sequences' cached outputs.
"""
import math

import numpy as np

from . import var as RV
from . import vqvae as RVQ

NOT_PRUNED = -1.0


# ------------------------------------------------------------------------------------------
# PTS: the pivotal_rows op
# ------------------------------------------------------------------------------------------

def pivotal_scores(x):
    """score [S, L] of x [S, L, C]: squared L2 distance of each row to the mean row."""
    x = RV.f64(x)
    mu = x.mean(axis=1, keepdims=True)
    return ((x - mu) ** 2).sum(-1)


def _order(scores):
    """Row indices of one sequence, largest score first, ties to the lower index; a NaN
    score counts as larger than any number."""
    s = np.asarray(scores, np.float64)
    key = np.where(np.isnan(s), np.inf, s)
    nan_first = ~np.isnan(s)  # False (NaN) sorts first
    return np.lexsort((np.arange(s.size), -key, nan_first))


def select_rows(scores, keep):
    """[S, keep] kept rows of each sequence, ascending, and the relative score gap at
    the boundary (between the keep-th and the (keep+1)-th row of the order; inf when
    every row is kept): how far the selection is from flipping."""
    scores = np.asarray(scores, np.float64)
    S, L = scores.shape
    kept = np.zeros((S, keep), np.int64)
    gap = np.inf
    for b in range(S):
        order = _order(scores[b])
        kept[b] = np.sort(order[:keep])
        if 0 < keep < L:
            hi, lo = scores[b, order[keep - 1]], scores[b, order[keep]]
            gap = min(gap, (hi - lo) / max(abs(hi), 1e-300))
    return kept, gap


def pivotal_rows(x, batch, keep):
    """The op's contract: x [batch * rows, dim] -> int32 [batch * keep], sequence b's kept
    rows ascending as b * rows + r."""
    x = RV.f64(x)
    rows = x.shape[0] // batch
    kept, _ = select_rows(pivotal_scores(x.reshape(batch, rows, -1)), keep)
    return (kept + rows * np.arange(batch)[:, None]).reshape(-1).astype(np.int32)


def keep_count(tokens, rho):
    """Rows kept of `tokens` at ratio rho: L - int(L * rho) (the official r = int(L * ratio))."""
    return tokens - math.floor(tokens * rho)


# ------------------------------------------------------------------------------------------
# settings
# ------------------------------------------------------------------------------------------

class Settings:
    """FastVAR's settings for a model of `depth` blocks and `n_scales` scales."""

    def __init__(self, cache_scale, prune, layers=None, skip_last=0):
        self.cache_scale = int(cache_scale)
        self.prune = {int(k): float(v) for k, v in dict(prune).items()}
        self.layers = layers
        self.skip_last = int(skip_last)

    @classmethod
    def of_policy(cls, policy):
        """From a marcache.FastVAR (its public fields, not its engine dict)."""
        return cls(policy.cache_scale, policy.prune, policy.layers, policy.skip_last)

    def pruned(self, si):
        return si in self.prune and self.prune[si] < 1.0

    def skipped(self, si, n_scales):
        return si >= n_scales - self.skip_last or self.prune.get(si) == 1.0

    def in_range(self, block, depth):
        start, stop = (0, depth) if self.layers is None else self.layers
        return start <= block < stop

    @property
    def pruning(self):
        return any(self.pruned(si) for si in self.prune)


# ------------------------------------------------------------------------------------------
# the pruned transformer
# ------------------------------------------------------------------------------------------

class FastVARTransformer:
    """The transformer side of a FastVAR run for sequences `labels` (their class rows;
    num_classes is the null class): call scale(si, x) for si = 0, 1, ... in order."""

    def __init__(self, model, settings, labels):
        self.model = model
        self.settings = settings
        _, self.mods, self.head_mod = model.condition(labels)
        self.n_seq = len(labels)
        self.kv = [None] * model.depth
        self.cache = {}   # (block, sublayer) -> [S, pc * pc, C]
        self.trace = {}   # si -> {(block, sublayer): [S, K] kept rows}
        self.min_gap = np.inf

    def keep_first(self, S):
        """From now on only the first S sequences run (the conditional half, once guidance
        stops): their conditioning, K/V and cached outputs are kept, the others dropped."""
        self.n_seq = S
        self.mods = [[m[:S] for m in mod] for mod in self.mods]
        self.head_mod = tuple(h[:S] for h in self.head_mod)
        self.kv = [None if kv is None else (kv[0][:S], kv[1][:S]) for kv in self.kv]
        self.cache = {key: out[:S] for key, out in self.cache.items()}

    def _append(self, i, k, v):
        kv = self.kv
        kv[i] = (k, v) if kv[i] is None else (np.concatenate([kv[i][0], k], 1), np.concatenate([kv[i][1], v], 1))

    def _attention(self, i, x):
        """gamma1 * attention sublayer of block i on rows x [S, n, C], appending their k/v."""
        m = self.model
        g1, _, sc1, _, sh1, _ = (t[:, None, :] for t in self.mods[i])
        q, k, v = m.qkv(i, RV.layernorm(x) * (1 + sc1) + sh1)
        self._append(i, k, v)
        return m.attend(i, q, self.kv[i][0], self.kv[i][1]) * g1

    def _ffn(self, i, x):
        _, g2, _, sc2, _, sh2 = (t[:, None, :] for t in self.mods[i])
        return self.model.ffn(i, RV.layernorm(x) * (1 + sc2) + sh2) * g2

    def _restore(self, i, sub, pn, kept, out):
        """CTR: the cached output resized to pn x pn, the kept rows' outputs over it."""
        S, C = out.shape[0], out.shape[2]
        pc = self.model.patch_nums[self.settings.cache_scale]
        restored = RVQ.resize_area(self.cache[(i, sub)].reshape(S, pc, pc, C), pn, pn).reshape(S, pn * pn, C)
        for b in range(S):
            restored[b, kept[b]] = out[b]
        return restored

    def scale(self, si, x):
        """The blocks on the scale's input x [S, n, C] -> the last block's output."""
        m, st = self.model, self.settings
        x = RV.f64(x)
        S, n, _ = x.shape
        if S < self.n_seq:
            self.keep_first(S)
        pn = m.patch_nums[si]
        pruned, caching = st.pruning and st.pruned(si), st.pruning and si == st.cache_scale
        keep = keep_count(n, st.prune[si]) if pruned else n
        trace = self.trace.setdefault(si, {})
        for i in range(m.depth):
            here = st.in_range(i, m.depth)
            for sub, fn in ((0, self._attention), (1, self._ffn)):
                if pruned and here:
                    kept, gap = select_rows(pivotal_scores(x), keep)
                    self.min_gap = min(self.min_gap, gap)
                    trace[(i, sub)] = kept
                    out = fn(i, x[np.arange(S)[:, None], kept])
                    x = x + self._restore(i, sub, pn, kept, out)
                else:
                    out = fn(i, x)
                    if caching and here:
                        self.cache[(i, sub)] = out
                    x = x + out
        return x

    def block_rows(self, si, n):
        """[(attention rows, FFN rows)] per block at scale si (the engine's telemetry)."""
        st, depth = self.settings, self.model.depth
        keep = keep_count(n, st.prune[si]) if st.pruning and st.pruned(si) else n
        return [(keep, keep) if st.pruning and st.pruned(si) and st.in_range(i, depth) else (n, n)
                for i in range(depth)]


def forward_scales(model, settings, labels, inputs):
    """The scale loop on given inputs [S, L_k, C] (scales 0..k) with FastVAR: (hidden,
    logits, transformer) as the engine's forward_scales(cache=...)."""
    inputs = RV.f64(inputs)
    t = FastVARTransformer(model, settings, labels)
    hidden, logits = [], []
    si = 0
    while si < len(model.patch_nums) and model.begin[si] < inputs.shape[1]:
        assert not settings.skipped(si, len(model.patch_nums)), "the inputs cover a skipped scale"
        x = t.scale(si, inputs[:, model.begin[si]:model.begin[si + 1]])
        hidden.append(x)
        logits.append(model.logits(x, t.head_mod))
        si += 1
    return np.concatenate(hidden, 1), np.concatenate(logits, 1), t


def guided_scale(cfg, si, n_scales, cfg_free_after=None):
    """Whether scale si runs both CFG halves: the run has CFG (cfg != 0) and, composed
    with CfgFreeLate(after=a), si < a * n_scales."""
    return cfg != 0 and not (cfg_free_after is not None and si >= cfg_free_after * n_scales)


def generate(model, vq, labels, settings, cfg=1.5, top_k=900, top_p=0.96, more_smooth=False, seed=0,
             first_index=0, forced_tokens=None, cfg_free_after=None):
    """RV.generate's loop (A4, A6, marcache's Philox draws) with the FastVAR
    transformer and its skipped scales (their tokens -1, no VQ update), and with
    cfg_free_after (CfgFreeLate's `after`) the late scales guidance-free. Returns RV's
    dict plus "transformer" (the FastVARTransformer, its traces and min_gap) and
    "sequences" (sequences run per scale)."""
    labels = np.asarray(labels)
    B, n_scales, side = labels.size, len(model.patch_nums), model.patch_nums[-1]
    cfg_on = cfg != 0
    seq_labels = np.concatenate([labels, np.full(B, model.num_classes)]) if cfg_on else labels
    t = FastVARTransformer(model, settings, seq_labels)
    cond = RV.f64(model.W["class_emb.weight"])[seq_labels]
    run = RV.new_run(B, model.L, side, RV.f64(vq.codebook), token_fill=-1, margin_fill=np.inf)
    sequences = []
    next_map = None
    images = first_index + np.arange(B)
    for si, pn in enumerate(model.patch_nums):
        if settings.skipped(si, n_scales):
            break
        both = guided_scale(cfg, si, n_scales, cfg_free_after)
        if si == 0:
            x = model.first_input(cond if both else cond[:B])
        else:
            x = model.scale_input(si, next_map.reshape(B, pn * pn, -1))
            if both:
                x = np.concatenate([x, x], 0)
        x = t.scale(si, x)
        sequences.append(x.shape[0])
        next_map = RV.sample_scale(run, model, vq, si, model.logits(x, t.head_mod), both, cfg, top_k, top_p,
                                   more_smooth, seed, images, forced_tokens)
    del run["codebook"]
    return dict(run, transformer=t, sequences=sequences)


# ------------------------------------------------------------------------------------------
# FLOPs (spec Part E rules) of one scale, from the definitions above
# ------------------------------------------------------------------------------------------

def scale_block_flops(config, settings, si, n_seq):
    """(linear, attention) FLOPs of the blocks at scale si: per block, the QKV/proj GEMMs
    (8 C^2 per row), the FFN (4 C F per row) and attention 4 q kv C with kv the block's
    own K/V length (its rows of scales 0..si). Zeros for a skipped scale."""
    n_scales, depth = len(config["patch_nums"]), config["depth"]
    C, F = config["width"], config["ffn_hidden"]
    if settings.skipped(si, n_scales):
        return 0, 0
    kv = [0] * depth
    rows = None
    for s in range(si + 1):
        n = config["patch_nums"][s] ** 2
        keep = keep_count(n, settings.prune[s]) if settings.pruning and settings.pruned(s) else n
        rows = [keep if settings.pruning and settings.pruned(s) and settings.in_range(i, depth) else n
                for i in range(depth)]
        kv = [kv[i] + rows[i] for i in range(depth)]
    linear = sum(n_seq * r * (8 * C * C + 4 * C * F) for r in rows)
    attention = sum(4 * n_seq * r * kv[i] * C for i, r in enumerate(rows))
    return linear, attention

"""Float64 reference of the VAR transformer and its sampling loop, written from
spec/var_fastvar.md Part A (A3-A6) and the marcache design of the sampler
(Philox draws, guidance schedule, CFG rows), independently of the C engine.

Layouts: token maps are NHWC in raster order ([B, pn * pn, Cvae]); f_hat is
[B, side, side, Cvae]. Sequences under CFG: rows 0..B-1 conditional, B..2B-1
unconditional (label = num_classes, the null class).

The VQ update (bicubic up-sampling, Phi, area down-sampling; spec B3) is not
part of the transformer: `generate` takes it as an object with
    codebook            [V, Cvae]
    add_scale(f_hat, h, si, n_scales) -> f_hat   (h [B, pn, pn, Cvae])
    next_input(f_hat, pn) -> [B, pn, pn, Cvae]
(tests/reference/vqvae.py provides the real one).
"""
import math

import numpy as np

from . import philox

DEFAULT_PATCH_NUMS = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)
LN_EPS = 1e-6
# Philox streams of the VAR sampler (csrc/core/philox.h): the sampling uniform and the
# more_smooth Gumbel noise.
STREAM_VAR_SAMPLE = 3
STREAM_VAR_GUMBEL = 4
# The official cap of the per-head query scale, torch.log(torch.tensor(100)).item(): ln 100
# computed in float32 (4.60517025, 6.4e-8 above ln 100).
SCALE_MUL_CAP = float(np.float32(math.log(100.0)))


def f64(x):
    return np.asarray(x, dtype=np.float64)


def layernorm(x, eps=LN_EPS):
    """LayerNorm without affine over the last axis (biased variance)."""
    x = f64(x)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps)


def silu(x):
    x = f64(x)
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x):
    x = f64(x)
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def l2_normalize(v, eps=1e-12):
    """F.normalize over the last axis."""
    return v / np.maximum(np.sqrt((v * v).sum(-1, keepdims=True)), eps)


def softmax(s, axis=-1):
    s = s - s.max(axis=axis, keepdims=True)
    e = np.exp(s)
    return e / e.sum(axis=axis, keepdims=True)


def scale_begins(patch_nums):
    begins = [0]
    for pn in patch_nums:
        begins.append(begins[-1] + pn * pn)
    return begins


def count_blocks(W):
    depth = 0
    while "blocks.%d.ada_lin.1.weight" % depth in W:
        depth += 1
    return depth


class _Float64View:
    """W[key] as float64, converted at each use (full-size weights stay in their own dtype)."""

    def __init__(self, W):
        self._W = W

    def __getitem__(self, key):
        return f64(self._W[key])

    def __contains__(self, key):
        return key in self._W


class VARReference:
    """The VAR transformer of a state dict in the official key layout (A3), in float64."""

    def __init__(self, W, patch_nums=DEFAULT_PATCH_NUMS):
        self.W = _Float64View(W)
        W = self.W
        self.patch_nums = tuple(int(p) for p in patch_nums)
        self.begin = scale_begins(self.patch_nums)
        self.L = self.begin[-1]
        self.depth = count_blocks(W)
        self.C = W["class_emb.weight"].shape[1]
        self.num_classes = W["class_emb.weight"].shape[0] - 1
        self.heads = W["blocks.0.attn.scale_mul_1H11"].shape[1]
        self.hd = self.C // self.heads
        self.V = W["head.weight"].shape[0]
        self.Cvae = W["word_embed.weight"].shape[1]
        assert W["pos_1LC"].shape[1] == self.L and W["lvl_embed.weight"].shape[0] == len(self.patch_nums)
        # lvl_pos = lvl_embed[lvl_1L] + pos_1LC (A4 step 4); lvl_1L = the scale of each token.
        lvl = np.concatenate([np.full(pn * pn, si) for si, pn in enumerate(self.patch_nums)])
        self.lvl_pos = W["lvl_embed.weight"][lvl] + W["pos_1LC"][0]

    # -- conditioning and inputs ------------------------------------------------------

    def head_scales(self, i):
        """s_h = exp(min(scale_mul_1H11[h], ln 100)) with the float32 cap of the official code."""
        v = self.W["blocks.%d.attn.scale_mul_1H11" % i].reshape(-1)
        return np.exp(np.minimum(v, SCALE_MUL_CAP))

    def condition(self, labels):
        """cond [S, C] and the per-sequence modulations: blocks [depth][6][S, C] in the
        order gamma1, gamma2, scale1, scale2, shift1, shift2; head [2][S, C] (scale, shift)."""
        W = self.W
        cond = W["class_emb.weight"][np.asarray(labels)]
        s = silu(cond)
        blocks = []
        for i in range(self.depth):
            mod = s @ W["blocks.%d.ada_lin.1.weight" % i].T + W["blocks.%d.ada_lin.1.bias" % i]
            blocks.append([mod[:, k * self.C:(k + 1) * self.C] for k in range(6)])
        head = s @ W["head_nm.ada_lin.1.weight"].T + W["head_nm.ada_lin.1.bias"]
        return cond, blocks, (head[:, :self.C], head[:, self.C:])

    def first_input(self, cond):
        """Scale 0 (A4 step 5): sos + pos_start + lvl_pos of the first tokens -> [S, first, C]."""
        first = self.patch_nums[0] ** 2
        return cond[:, None, :] + self.W["pos_start"][0][None, :first] + self.lvl_pos[None, :first]

    def scale_input(self, si, next_map):
        """Scale si > 0 (A4 step 7): word_embed(next [N, pn^2, Cvae]) + lvl_pos of its tokens."""
        W = self.W
        b, e = self.begin[si], self.begin[si + 1]
        return f64(next_map) @ W["word_embed.weight"].T + W["word_embed.bias"] + self.lvl_pos[None, b:e]

    def scale_inputs(self, labels, next_maps):
        """The inputs of scales 0..k for N sequences: next_maps [N, T, Cvae] holds the maps
        of scales 1..k back to back (the C binding's scale_inputs)."""
        cond, _, _ = self.condition(labels)
        parts = [self.first_input(cond)]
        first = self.begin[1]
        si = 1
        while self.begin[si] - first < next_maps.shape[1]:
            b, e = self.begin[si] - first, self.begin[si + 1] - first
            parts.append(self.scale_input(si, next_maps[:, b:e]))
            si += 1
        return np.concatenate(parts, axis=1)

    # -- blocks --------------------------------------------------------------------------

    def qkv(self, i, a):
        """q, k, v [S, n, H, hd] of modulated rows a [S, n, C]: the bias is [q_bias; 0; v_bias],
        q and k L2-normalised per head, q times the head scale (A5.2)."""
        W = self.W
        p = "blocks.%d.attn." % i
        bias = np.concatenate([W[p + "q_bias"], np.zeros(self.C), W[p + "v_bias"]])
        qkv = a @ W[p + "mat_qkv.weight"].T + bias
        S, n = a.shape[:2]
        q, k, v = (qkv[..., j * self.C:(j + 1) * self.C].reshape(S, n, self.heads, self.hd) for j in range(3))
        q = l2_normalize(q) * self.head_scales(i)[None, None, :, None]
        k = l2_normalize(k)
        return q, k, v

    def attend(self, i, q, k_all, v_all, mask=None):
        """softmax(q k^T) v per head with scale 1 (A5.2), then proj. q [S, n, H, hd],
        k_all/v_all [S, kv, H, hd]; mask [n, kv] of 0 / -inf or None."""
        W = self.W
        s = np.einsum("snhd,skhd->shnk", q, k_all)
        if mask is not None:
            s = s + mask[None, None]
        o = np.einsum("shnk,skhd->snhd", softmax(s, -1), v_all)
        S, n = q.shape[:2]
        o = o.reshape(S, n, self.C)
        return o @ W["blocks.%d.attn.proj.weight" % i].T + W["blocks.%d.attn.proj.bias" % i]

    def ffn(self, i, f):
        W = self.W
        p = "blocks.%d.ffn." % i
        h = gelu_tanh(f @ W[p + "fc1.weight"].T + W[p + "fc1.bias"])
        return h @ W[p + "fc2.weight"].T + W[p + "fc2.bias"]

    def block(self, i, x, mod, kv):
        """One AdaLNSelfAttn block on x [S, n, C] (A5.1), appending the rows' k, v to the cache
        kv[i] = (k [S, kv, H, hd], v) and attending to all of it."""
        g1, g2, sc1, sc2, sh1, sh2 = (m[:, None, :] for m in mod)
        q, k, v = self.qkv(i, layernorm(x) * (1 + sc1) + sh1)
        if kv[i] is None:
            kv[i] = (k, v)
        else:
            kv[i] = (np.concatenate([kv[i][0], k], 1), np.concatenate([kv[i][1], v], 1))
        x = x + self.attend(i, q, kv[i][0], kv[i][1]) * g1
        return x + self.ffn(i, layernorm(x) * (1 + sc2) + sh2) * g2

    def logits(self, x, head_mod):
        scale, shift = head_mod
        y = layernorm(x) * (1 + scale[:, None, :]) + shift[:, None, :]
        return y @ self.W["head.weight"].T + self.W["head.bias"]

    def forward_scales(self, labels, inputs):
        """The KV-cached scale loop over the scales inputs [S, L_k, C] covers: (hidden, logits)."""
        inputs = f64(inputs)
        _, mods, head_mod = self.condition(labels)
        kv = [None] * self.depth
        hidden, logits = [], []
        si = 0
        while si < len(self.patch_nums) and self.begin[si] < inputs.shape[1]:
            x = inputs[:, self.begin[si]:self.begin[si + 1]]
            for i in range(self.depth):
                x = self.block(i, x, mods[i], kv)
            hidden.append(x)
            logits.append(self.logits(x, head_mod))
            si += 1
        return np.concatenate(hidden, 1), np.concatenate(logits, 1)

    def forward_masked(self, labels, inputs):
        """The same as the teacher-forced training forward: every scale at once with the
        block-causal mask (query level >= key level, A4 'Important properties'). Used to
        check forward_scales' KV cache."""
        inputs = f64(inputs)
        Lk = inputs.shape[1]
        _, mods, head_mod = self.condition(labels)
        lvl = np.concatenate([np.full(pn * pn, si) for si, pn in enumerate(self.patch_nums)])[:Lk]
        mask = np.where(lvl[:, None] >= lvl[None, :], 0.0, -np.inf)
        x = inputs
        for i in range(self.depth):
            g1, g2, sc1, sc2, sh1, sh2 = (m[:, None, :] for m in mods[i])
            q, k, v = self.qkv(i, layernorm(x) * (1 + sc1) + sh1)
            x = x + self.attend(i, q, k, v, mask) * g1
            x = x + self.ffn(i, layernorm(x) * (1 + sc2) + sh2) * g2
        return x, self.logits(x, head_mod)


# ------------------------------------------------------------------------------------------
# sampling (A6, with marcache's Philox draws)
# ------------------------------------------------------------------------------------------

def sample_row(logits, top_k, top_p, u):
    """One row of the sampler: top-k (ties at the threshold survive; k <= 0 or k >= V: off),
    top-p (softmax in float64, entries ordered ascending by (value, index), those whose
    cumulative sum is <= 1 - top_p removed, never the largest; p <= 0 or >= 1: off), then
    inverse-CDF sampling with the uniform u over exp(l - max) in vocabulary order.
    Returns (token, masked logits, margin): margin is the smallest distance of any decision
    from flipping (top-k: the gap between the k-th and (k+1)-th largest logits; top-p: of a
    cumulative sum from 1 - top_p; the draw: of u * total from a cumulative weight,
    relative to the total), so a caller can tell a float32 engine's decision apart from a
    near tie."""
    l = f64(logits).copy()
    V = l.size
    margins = [np.inf]
    if 0 < top_k < V:
        desc = np.sort(l)[::-1]
        thr = desc[top_k - 1]
        margins.append((desc[top_k - 1] - desc[top_k]) / max(1.0, abs(thr)))
        l[l < thr] = -np.inf
    if 0.0 < top_p < 1.0:
        p = np.exp(l - l.max())
        p /= p.sum()
        order = np.lexsort((np.arange(V), l))  # ascending by value, ties by index
        cum = np.cumsum(p[order])
        remove = cum <= 1.0 - top_p
        remove[-1] = False
        live = np.isfinite(l[order])
        if live.any():
            margins.append(np.min(np.abs(cum[live] - (1.0 - top_p))))
        l[order[remove]] = -np.inf
    q = np.where(np.isfinite(l), np.exp(l - l.max()), 0.0)
    c = np.cumsum(q)
    target = u * c[-1]
    above = np.nonzero(c > target)[0]
    token = int(above[0]) if above.size else int(np.nonzero(q > 0)[0][-1])
    lo = c[token - 1] if token > 0 else 0.0
    margins.append(min(target - lo, c[token] - target) / c[-1])
    return token, l, float(min(margins))


def sample_uniforms(seed, images, positions, step):
    """u = word 0 of the Philox block (seed, image, STREAM_VAR_SAMPLE, position, step, 0) / 2^32."""
    w = philox.block(seed, np.asarray(images, np.uint64), STREAM_VAR_SAMPLE, np.asarray(positions, np.uint64),
                     step, 0)
    return np.asarray(w[..., 0], np.float64) / 2.0 ** 32


def gumbel_probs(logits, logit_scale, tau, seed, images, positions, step):
    """more_smooth (A6): softmax((logits * logit_scale + g) / tau) per row, g = -log(-log(u)),
    u = (w + 0.5) / 2^32 with w = word j % 4 of the Philox block (seed, image,
    STREAM_VAR_GUMBEL, position, step, j // 4) for vocabulary entry j. -inf -> 0."""
    logits = f64(logits)
    rows, V = logits.shape
    blocks = np.arange((V + 3) // 4, dtype=np.uint64)
    out = np.empty((rows, V))
    for r in range(rows):
        w = philox.block(seed, np.uint64(images[r]), STREAM_VAR_GUMBEL, np.uint64(positions[r]), step, blocks)
        u = (np.asarray(w, np.float64).reshape(-1)[:V] + 0.5) / 2.0 ** 32
        g = -np.log(-np.log(u))
        z = (logits[r] * logit_scale + g) / tau
        z = np.where(np.isfinite(logits[r]), z, -np.inf)
        out[r] = softmax(z)
    return out


def guidance(cfg, si, n_scales):
    """t = cfg * ratio with ratio = si / (n_scales - 1) (A4 step 3; the official order of the
    double operations); 0 with one scale."""
    return 0.0 if n_scales == 1 else cfg * (si / (n_scales - 1))


def new_run(B, L, side, codebook, token_fill=0, margin_fill=0.0):
    """What a scale loop carries and returns (generate's dict): tokens, own_tokens, margins
    [B, L] (filled with token_fill / margin_fill until a scale samples them), f_hat, the
    codebook, and the per-scale guided and raw logits."""
    return {"tokens": np.full((B, L), token_fill, np.int64), "own_tokens": np.full((B, L), token_fill, np.int64),
            "margins": np.full((B, L), margin_fill), "f_hat": np.zeros((B, side, side, codebook.shape[1])),
            "codebook": codebook, "guided": [], "logits": []}


def sample_scale(run, model, vq, si, logits, both, cfg, top_k, top_p, more_smooth, seed, images,
                 forced_tokens=None):
    """A4 steps 3-6 of scale si, whatever ran the transformer: guidance of logits (rows
    [cond; uncond] when `both`, else the B conditional rows, which are then the guided
    ones), a draw per token with the Philox uniform of (seed, image, step = si, position =
    token index in the L-token sequence), the tokens used (forced_tokens' where given: the
    loop then follows an engine whose float32 decisions differ at a near tie), the VQ update
    of f_hat (codebook rows, or Gumbel probabilities x codebook with more_smooth). Updates
    `run` (new_run) in place; returns the next scale's input map (None after the last)."""
    B, n_scales = len(images), len(model.patch_nums)
    pn = model.patch_nums[si]
    n, begin = pn * pn, model.begin[si]
    codebook, own, margins = run["codebook"], run["own_tokens"], run["margins"]
    run["logits"].append(logits)
    t = guidance(cfg, si, n_scales)
    guided = (1 + t) * logits[:B] - t * logits[B:] if both else logits[:B]
    run["guided"].append(guided)
    positions = begin + np.arange(n)
    u = sample_uniforms(seed, images[:, None], positions[None, :], si)
    masked = np.empty((B, n, model.V))
    for b in range(B):
        for r in range(n):
            tok, masked[b, r], margins[b, begin + r] = sample_row(guided[b, r], top_k, top_p, u[b, r])
            own[b, begin + r] = tok
    used = own[:, begin:begin + n] if forced_tokens is None else np.asarray(forced_tokens)[:, begin:begin + n]
    run["tokens"][:, begin:begin + n] = used
    if more_smooth:
        ratio = 0.0 if n_scales == 1 else si / (n_scales - 1)
        tau = max(0.27 * (1 - 0.95 * ratio), 0.005)
        probs = gumbel_probs(masked.reshape(B * n, -1), 1 + ratio, tau, seed, np.repeat(images, n),
                             np.tile(positions, B), si)
        h = probs @ codebook
    else:
        h = codebook[used.reshape(-1)]
    run["f_hat"] = vq.add_scale(run["f_hat"], h.reshape(B, pn, pn, -1), si, n_scales)
    return vq.next_input(run["f_hat"], model.patch_nums[si + 1]) if si + 1 < n_scales else None


def generate(model, vq, labels, cfg=1.5, top_k=900, top_p=0.96, more_smooth=False, seed=0, first_index=0,
             forced_tokens=None):
    """The whole sampling loop (A4) in float64 for B = len(labels) images.

    CFG rows: with cfg != 0 the unconditional half runs at every scale (the official
    code), and the guided logits are (1 + t) * cond - t * uncond; with cfg == 0 only the
    conditional rows run (their logits are the guided ones). Sampling per sample_row with
    the Philox uniform of (seed, first_index + b, step = si, position = token index in the
    L-token sequence). forced_tokens [B, L] (e.g. an engine's tokens) replaces the sampled
    tokens of each scale after sampling, so the loop can follow an engine whose float32
    decisions differ at a near tie; every token's own sample and margin are returned.

    Returns a dict: tokens [B, L] (the tokens used), own_tokens [B, L] (sampled here),
    margins [B, L], f_hat [B, side, side, Cvae], guided (list of per-scale guided logits
    [B, n, V] before masking), logits (per-scale raw logits [S, n, V])."""
    labels = np.asarray(labels)
    B, side = labels.size, model.patch_nums[-1]
    cfg_on = cfg != 0
    seq_labels = np.concatenate([labels, np.full(B, model.num_classes)]) if cfg_on else labels
    cond, mods, head_mod = model.condition(seq_labels)
    kv = [None] * model.depth
    run = new_run(B, model.L, side, f64(vq.codebook))
    next_map = None
    images = first_index + np.arange(B)
    for si, pn in enumerate(model.patch_nums):
        if si == 0:
            x = model.first_input(cond)
        else:
            x = model.scale_input(si, next_map.reshape(B, pn * pn, -1))
            if cfg_on:
                x = np.concatenate([x, x], 0)
        for i in range(model.depth):
            x = model.block(i, x, mods[i], kv)
        next_map = sample_scale(run, model, vq, si, model.logits(x, head_mod), cfg_on, cfg, top_k, top_p,
                                more_smooth, seed, images, forced_tokens)
    del run["codebook"]
    return run


# ------------------------------------------------------------------------------------------
# random weights in the official key layout (tests)
# ------------------------------------------------------------------------------------------

def random_var_weights(rng, depth=2, width=128, heads=2, vocab=64, vae_channels=8, num_classes=10,
                       patch_nums=(1, 2, 3, 4), ffn_hidden=None, scale_mul=None, buffers=True):
    """A state dict in the official layout (A3) with random weights of useful magnitudes:
    modulations of order 0.1..1 (so gamma, scale, shift matter), logits of order a few units,
    scale_mul values spread across the ln 100 cap unless given ([depth, heads] log scales).
    With `buffers` the derivable buffers (lvl_1L, attn_bias_for_masking, zero_k_bias) are
    included as the official files have them."""
    C, F = width, ffn_hidden or 4 * width
    L = sum(p * p for p in patch_nums)
    first = patch_nums[0] ** 2

    def n(*shape, s=1.0):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    W = {
        "pos_start": n(1, first, C, s=0.5),
        "pos_1LC": n(1, L, C, s=0.5),
        "word_embed.weight": n(C, vae_channels, s=1.0 / math.sqrt(vae_channels)),
        "word_embed.bias": n(C, s=0.1),
        "class_emb.weight": n(num_classes + 1, C, s=1.0),
        "lvl_embed.weight": n(len(patch_nums), C, s=0.5),
        "head_nm.ada_lin.1.weight": n(2 * C, C, s=0.3 / math.sqrt(C)),
        "head_nm.ada_lin.1.bias": n(2 * C, s=0.1),
        "head.weight": n(vocab, C, s=2.0 / math.sqrt(C)),
        "head.bias": n(vocab, s=0.2),
    }
    if scale_mul is None:
        # log scales from ln 2 to ln 400: some heads beyond the ln 100 cap.
        scale_mul = np.linspace(math.log(2.0), math.log(400.0), depth * heads).reshape(depth, heads)
    for i in range(depth):
        p = "blocks.%d." % i
        W[p + "attn.scale_mul_1H11"] = np.asarray(scale_mul[i], np.float32).reshape(1, heads, 1, 1)
        W[p + "attn.q_bias"] = n(C, s=0.2)
        W[p + "attn.v_bias"] = n(C, s=0.2)
        W[p + "attn.mat_qkv.weight"] = n(3 * C, C, s=1.0 / math.sqrt(C))
        W[p + "attn.proj.weight"] = n(C, C, s=1.0 / math.sqrt(C))
        W[p + "attn.proj.bias"] = n(C, s=0.1)
        W[p + "ffn.fc1.weight"] = n(F, C, s=1.0 / math.sqrt(C))
        W[p + "ffn.fc1.bias"] = n(F, s=0.1)
        W[p + "ffn.fc2.weight"] = n(C, F, s=1.0 / math.sqrt(F))
        W[p + "ffn.fc2.bias"] = n(C, s=0.1)
        W[p + "ada_lin.1.weight"] = n(6 * C, C, s=0.5 / math.sqrt(C))
        W[p + "ada_lin.1.bias"] = n(6 * C, s=0.2)
        if buffers:
            W[p + "attn.zero_k_bias"] = np.zeros(C, np.float32)
    if buffers:
        lvl = np.concatenate([np.full(pn * pn, si) for si, pn in enumerate(patch_nums)])
        W["lvl_1L"] = lvl[None].astype(np.int64)
        W["attn_bias_for_masking"] = np.where(lvl[:, None] >= lvl[None, :], 0.0, -np.inf).astype(
            np.float32)[None, None]
    return W

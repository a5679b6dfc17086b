"""Exact FLOP counts of a MAR run without running it.

Convention (spec mar.md 13): GEMMs and attention matmuls only, 2 FLOPs per
multiply-add; norms, softmax, activations and the sampler's elementwise
arithmetic are not counted. The counts are of what marcache computes: the
head's time embedding is precomputed once at load (not counted), cond_embed
runs once per AR step, input_proj only on the live half of the CFG state,
and steps that predict nothing (more steps than tokens) are skipped.
The engine's per-step telemetry uses the same rules and must agree.
"""
from dataclasses import dataclass, field
from typing import List

from . import schedule as _schedule
from .caches import resolve as _resolve_cache

MAR_CONFIGS = {
    "mar_base": dict(width=768, depth=12, heads=12, decoder_width=768, decoder_depth=12, decoder_heads=12,
                     mlp_hidden=3072, decoder_mlp_hidden=3072, head_width=1024, head_depth=6,
                     seq_len=256, buffer_size=64, token_channels=16, num_classes=1000),
    "mar_large": dict(width=1024, depth=16, heads=16, decoder_width=1024, decoder_depth=16, decoder_heads=16,
                      mlp_hidden=4096, decoder_mlp_hidden=4096, head_width=1280, head_depth=8,
                      seq_len=256, buffer_size=64, token_channels=16, num_classes=1000),
    "mar_huge": dict(width=1280, depth=20, heads=16, decoder_width=1280, decoder_depth=20, decoder_heads=16,
                     mlp_hidden=5120, decoder_mlp_hidden=5120, head_width=1536, head_depth=12,
                     seq_len=256, buffer_size=64, token_channels=16, num_classes=1000),
}


@dataclass
class FlopReport:
    """FLOPs of one generate call (all images of the batch)."""
    total: float
    encoder: float
    decoder: float
    head: float
    per_step: List[float] = field(default_factory=list)

    @property
    def tflops(self):
        return self.total / 1e12


def _attn(n_seq, q_rows, keys, dim):
    rows = n_seq * q_rows
    return 2 * rows * dim * 3 * dim + 2 * rows * dim * dim + 4 * rows * keys * dim


def _mlp(rows, dim, hidden):
    return 4 * rows * dim * hidden


def _plain_transformer(c, n_seq, known):
    P, S, C, D, Dd = c["buffer_size"], c["seq_len"], c["token_channels"], c["width"], c["decoder_width"]
    enc_len, L = P + known, P + S
    enc = 2 * n_seq * known * C * D + c["depth"] * (_attn(n_seq, enc_len, enc_len, D) +
                                                    _mlp(n_seq * enc_len, D, c["mlp_hidden"]))
    dec = 2 * n_seq * enc_len * D * Dd + c["decoder_depth"] * (_attn(n_seq, L, L, Dd) +
                                                               _mlp(n_seq * L, Dd, c["decoder_mlp_hidden"]))
    return enc, dec


def _token_cached_transformer(c, lz, n_seq, known, predicted, predicted_before, step, steps):
    P, S, C, D, Dd = c["buffer_size"], c["seq_len"], c["token_channels"], c["width"], c["decoder_width"]
    L, q, keys = P + S, P + predicted_before, P + known
    enc = 2 * n_seq * predicted_before * C * D + \
        c["depth"] * (_attn(n_seq, q, keys, D) + _mlp(n_seq * q, D, c["mlp_hidden"]))
    keep = lz.keep_rows(step, steps, predicted, predicted_before, L)
    sel, hidden = lz.select_layer, c["decoder_mlp_hidden"]
    dec = 2 * n_seq * q * D * Dd + sel * (_attn(n_seq, L, L, Dd) + _mlp(n_seq * L, Dd, hidden)) + \
        _attn(n_seq, L, L, Dd) + _mlp(n_seq * keep, Dd, hidden) + \
        (c["decoder_depth"] - sel - 1) * (_attn(n_seq, keep, L, Dd) + _mlp(n_seq * keep, Dd, hidden))
    return enc, dec


def _cached_encoder(c, n_seq, known, predicted_before, encoder_cache):
    """Encoder and decoder_embed FLOPs of a cached step."""
    P, C, D, Dd = c["buffer_size"], c["token_channels"], c["width"], c["decoder_width"]
    if encoder_cache:
        q, keys, new = P + predicted_before, P + known, predicted_before
    else:
        q, keys, new = P + known, P + known, known
    enc = 2 * n_seq * new * C * D + c["depth"] * (_attn(n_seq, q, keys, D) + _mlp(n_seq * q, D, c["mlp_hidden"]))
    return enc, 2 * n_seq * q * D * Dd


def _marche_decoder(c, mc_cfg, n_seq, predicted, predicted_before):
    P, S, Dd = c["buffer_size"], c["seq_len"], c["decoder_width"]
    L, hidden, F = P + S, c["decoder_mlp_hidden"], mc_cfg.full_layers
    active = mc_cfg.active_rows(predicted, predicted_before, L, S)
    return F * (_attn(n_seq, L, L, Dd) + _mlp(n_seq * L, Dd, hidden)) + 2 * n_seq * predicted * L * Dd + \
        (c["decoder_depth"] - F) * (_attn(n_seq, active, L, Dd) + _mlp(n_seq * active, Dd, hidden))


def _head_eval(c, rows, x_rows, mode, skip=(0, -1), reference=False):
    """One head evaluation; mode is "plain", "store", "recompute" or "reuse".
    reference=True counts what the official PyTorch code computes: the time
    embedding MLP and cond_embed for every row at every evaluation, input_proj
    on both CFG halves, and the whole adaLN Linear of blocks whose MLP output
    is reused."""
    W, C, Dd = c["head_width"], c["token_channels"], c["decoder_width"]
    f = 2 * (rows if reference else x_rows) * C * W
    if reference:
        f += rows * (2 * 256 * W + 2 * W * W + 2 * Dd * W)
    for j in range(c["head_depth"]):
        skipped = mode != "plain" and skip[0] <= j <= skip[1]
        if skipped and mode in ("recompute", "reuse"):
            continue
        if mode == "reuse":
            f += (6 if reference else 2) * rows * W * W
        else:
            f += 10 * rows * W * W
    return f + 4 * rows * W * W + 4 * rows * W * C


def _head(c, live, cfg_on, diffusion_steps, lz, reference=False):
    rows = 2 * live if cfg_on else live
    f = 0 if reference else 2 * rows * c["decoder_width"] * c["head_width"]
    head_cache = lz is not None and lz.head_cache
    skip = (lz.head_skip_first, lz.head_skip_last) if head_cache else (0, -1)
    for j in range(diffusion_steps - 1, -1, -1):
        if not head_cache or j == diffusion_steps - 1 or j % lz.head_period == 0:
            f += _head_eval(c, rows, live, "store" if head_cache else "plain", skip, reference)
        else:
            mode = "recompute" if j > lz.head_recompute_above * diffusion_steps else "reuse"
            f += _head_eval(c, live, live, mode, skip, reference)
    return f


def flops(model_or_name, steps=64, cfg=1.0, cache=None, batch=1, diffusion_steps=100, convention="engine"):
    """FLOPs of generating `batch` images with `steps` AR steps.

    model_or_name: a loaded MARModel or one of "mar_base", "mar_large", "mar_huge".
    cfg != 1.0 doubles the transformer batch and the head rows (CFG on).
    cache: None / NoCache() or a LazyMAR(...) configuration.
    convention: "engine" counts what marcache computes (equal to the engine's
    telemetry); "reference" counts what the official PyTorch code computes for
    the same run (no hoisting in the diffusion head, the convention of the
    published MAR/LazyMAR FLOPs and of the spec's derived tables).
    """
    if convention not in ("engine", "reference"):
        raise ValueError(f"convention must be 'engine' or 'reference', got {convention!r}")
    reference = convention == "reference"
    cache = _resolve_cache(cache)
    if isinstance(model_or_name, str):
        if model_or_name not in MAR_CONFIGS:
            raise ValueError(f"unknown model {model_or_name!r}; expected one of {sorted(MAR_CONFIGS)}")
        c = MAR_CONFIGS[model_or_name]
    else:
        c = model_or_name.config
        diffusion_steps = c.get("diffusion_steps", diffusion_steps)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    lz = cache if getattr(cache, "name", "none") in ("lazymar", "marche") else None
    marche = lz is not None and lz.name == "marche"
    cfg_on = cfg != 1.0
    cond_cache = lz is not None and lz.cond_cache and cfg_on
    n_seq = (2 if cfg_on else 1) * batch
    n_cache_seq = 2 * batch if (cfg_on and not cond_cache) else batch
    S = c["seq_len"]
    enc = dec = head = 0.0
    per_step = []
    predicted_before = 0
    for step, (masked_before, _mask_len, predicted) in enumerate(_schedule.plan(S, steps)):
        if predicted == 0:
            per_step.append(0.0)
            continue
        known = S - masked_before
        if marche and not lz.is_full_step(step):
            e, embed = _cached_encoder(c, n_cache_seq, known, predicted_before, lz.encoder_cache)
            d = embed + _marche_decoder(c, lz, n_cache_seq, predicted, predicted_before)
        elif lz is None or marche or lz.is_full_step(step) or not (lz.token_cache or cond_cache):
            e, d = _plain_transformer(c, n_seq, known)
        elif lz.token_cache:
            e, d = _token_cached_transformer(c, lz, n_cache_seq, known, predicted, predicted_before, step,
                                             steps)
        else:
            e, d = _plain_transformer(c, batch, known)
        h = _head(c, batch * predicted, cfg_on, diffusion_steps, lz, reference)
        enc, dec, head = enc + e, dec + d, head + h
        per_step.append(float(e + d + h))
        predicted_before = predicted
    return FlopReport(total=float(enc + dec + head), encoder=float(enc), decoder=float(dec), head=float(head),
                      per_step=per_step)

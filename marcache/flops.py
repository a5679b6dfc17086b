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


def _block(rows, seq_rows, n_seq, width, hidden):
    return 2 * rows * width * 3 * width + 2 * rows * width * width + 4 * rows * width * hidden + \
        n_seq * 4 * seq_rows * seq_rows * width


def flops(model_or_name, steps=64, cfg=1.0, cache=None, batch=1, diffusion_steps=100):
    """FLOPs of generating `batch` images with `steps` AR steps.

    model_or_name: a loaded MARModel or one of "mar_base", "mar_large", "mar_huge".
    cfg != 1.0 doubles the transformer batch and the head rows (CFG on).
    """
    _resolve_cache(cache)
    if isinstance(model_or_name, str):
        if model_or_name not in MAR_CONFIGS:
            raise ValueError(f"unknown model {model_or_name!r}; expected one of {sorted(MAR_CONFIGS)}")
        c = MAR_CONFIGS[model_or_name]
    else:
        c = model_or_name.config
        diffusion_steps = c.get("diffusion_steps", diffusion_steps)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    cfg_on = cfg != 1.0
    n_seq = (2 if cfg_on else 1) * batch
    S, P, C = c["seq_len"], c["buffer_size"], c["token_channels"]
    D, Dd, W = c["width"], c["decoder_width"], c["head_width"]
    enc = dec = head = 0.0
    per_step = []
    for masked_before, _mask_len, predicted in _schedule.plan(S, steps):
        if predicted == 0:
            per_step.append(0.0)
            continue
        known = S - masked_before
        enc_len = P + known
        e = 2 * n_seq * known * C * D + c["depth"] * _block(n_seq * enc_len, enc_len, n_seq, D, c["mlp_hidden"])
        d = 2 * n_seq * enc_len * D * Dd + \
            c["decoder_depth"] * _block(n_seq * (P + S), P + S, n_seq, Dd, c["decoder_mlp_hidden"])
        live = batch * predicted
        rows = (2 if cfg_on else 1) * live
        per_eval = 2 * live * C * W + c["head_depth"] * rows * (6 * W * W + 4 * W * W) + \
            rows * (4 * W * W + 4 * W * C)
        h = 2 * rows * Dd * W + diffusion_steps * per_eval
        enc, dec, head = enc + e, dec + d, head + h
        per_step.append(float(e + d + h))
    return FlopReport(total=float(enc + dec + head), encoder=float(enc), decoder=float(dec), head=float(head),
                      per_step=per_step)

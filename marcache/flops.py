"""Exact FLOP counts of a MAR run without running it.

Convention (spec mar.md 13): GEMMs and attention matmuls only, 2 FLOPs per
multiply-add; norms, softmax, activations and the sampler's elementwise
arithmetic are not counted. The counts are of what marcache computes: the
head's time embedding is precomputed once at load (not counted), cond_embed
runs once per AR step, input_proj only on the live half of the CFG state,
and steps that predict nothing (more steps than tokens) are skipped.
The engine's per-step telemetry uses the same rules and must agree. The block
formulas live in marcache/mar_family.py and each policy's step model in its module
under marcache/policies/.
"""
import numbers
from dataclasses import dataclass, field
from typing import List

from . import mar_family as _mar
from . import schedule as _schedule
from .policies import resolve as _resolve_cache
from .policies._common import StepContext as _StepContext

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


def flops(model_or_name, steps=64, cfg=1.0, cache=None, batch=1, diffusion_steps=100, convention="engine"):
    """FLOPs of generating `batch` images with `steps` AR steps.

    model_or_name: a loaded MARModel or one of "mar_base", "mar_large", "mar_huge".
    cfg != 1.0 doubles the transformer batch and the head rows (CFG on).
    cache: None / NoCache() or any other MAR cache policy (LazyMAR, MARche, CfgFreeLate).
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
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or not 1 <= steps <= 2**31 - 1:
        raise ValueError(f"steps must be an integer in 1..2**31-1, got {steps!r}")
    cfg_on = cfg != 1.0
    head_cache = cache.head_cache_config(cfg_on)
    S = c["seq_len"]
    enc = dec = head = 0.0
    per_step = []
    predicted_before = 0
    for step, (masked_before, _mask_len, predicted) in enumerate(_schedule.plan(S, steps)):
        if predicted == 0:
            per_step.append(0.0)
            continue
        ctx = _StepContext(config=c, batch=batch, cfg_on=cfg_on, step=step, steps=steps,
                           known=S - masked_before, predicted=predicted, predicted_before=predicted_before)
        e, d = cache.transformer_flops(ctx)
        # A policy may sample some steps unguided (CfgFreeLate): its step_cfg_on says which.
        step_cfg_on = cache.step_cfg_on(ctx) if hasattr(cache, "step_cfg_on") else cfg_on
        h = _mar.head(c, batch * predicted, step_cfg_on, diffusion_steps, head_cache, reference)
        enc, dec, head = enc + e, dec + d, head + h
        per_step.append(float(e + d + h))
        predicted_before = predicted
    return FlopReport(total=float(enc + dec + head), encoder=float(enc), decoder=float(dec), head=float(head),
                      per_step=per_step)

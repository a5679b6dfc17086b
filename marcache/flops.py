"""Exact FLOP counts of a MAR or VAR run without running it.

Convention (spec mar.md 13): GEMMs and attention matmuls only, 2 FLOPs per
multiply-add; norms, softmax, activations and the sampler's elementwise
arithmetic are not counted. The counts are of what marcache computes: the
head's time embedding is precomputed once at load (not counted), cond_embed
runs once per AR step, input_proj only on the live half of the CFG state,
and steps that predict nothing (more steps than tokens) are skipped.
The engine's per-step telemetry uses the same rules and must agree. The block
formulas live in marcache/mar_family.py and each policy's step model in its module
under marcache/policies/. VAR's blocks are in marcache/var_family.py (spec
var_fastvar.md Part E), with its two conventions described there.
"""
import math
import numbers
from dataclasses import dataclass, field
from typing import List

from . import mar_family as _mar
from . import var_family as _var
from . import schedule as _schedule
from .policies import resolve as _resolve_cache
from .policies._common import StepContext as _StepContext
from .var_family import VAR_CONFIGS

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
    """FLOPs of one generate call (all images of the batch).

    head_params_read: the weights of the head's Linear layers that the call streams, as a
    count of parameters (cond_embed once per AR step, then each diffusion evaluation's
    layers once, whatever its row count): times the weight type's size, the bytes the
    head reads, which bound it at small batches (issue 23). The engine's convention only
    (0 for "reference")."""
    total: float
    encoder: float
    decoder: float
    head: float
    per_step: List[float] = field(default_factory=list)
    head_params_read: float = 0.0

    @property
    def tflops(self):
        return self.total / 1e12


@dataclass
class VARFlopReport:
    """FLOPs of one VAR generate call (all images of the batch), by block kind and
    by scale. per_scale: one dict per scale (scale, tokens, keys, linear, attention,
    head, embed, adaln, smooth, total); per_step: the totals (the engine's telemetry
    has one step per scale)."""
    total: float
    linear: float
    attention: float
    head: float
    embed: float
    adaln: float
    smooth: float
    per_scale: List[dict] = field(default_factory=list)

    @property
    def per_step(self):
        return [s["total"] for s in self.per_scale]

    @property
    def transformer(self):
        """The blocks: their GEMMs and attention."""
        return self.linear + self.attention

    @property
    def tflops(self):
        return self.total / 1e12


def _family(model_or_name):
    if isinstance(model_or_name, str):
        if model_or_name in MAR_CONFIGS:
            return "mar"
        if model_or_name in VAR_CONFIGS:
            return "var"
        raise ValueError(f"unknown model {model_or_name!r}; expected one of "
                         f"{sorted(MAR_CONFIGS) + sorted(VAR_CONFIGS)}, or a loaded model")
    return getattr(model_or_name, "family", "mar")


def flops(model_or_name, steps=None, cfg=None, cache=None, batch=1, diffusion_steps=None, convention="engine",
          more_smooth=False):
    """FLOPs of generating `batch` images.

    model_or_name: a loaded model (MARModel or VARModel) or one of "mar_base",
    "mar_large", "mar_huge", "var_d16", "var_d20", "var_d24", "var_d30".

    MAR: `steps` AR steps (default 64); cfg != 1.0 (default 1.0) doubles the
    transformer batch and the head rows (CFG on). cache: None / NoCache() or any other
    MAR cache policy (LazyMAR, MARche, CfgFreeLate, DiSA; DiSA's respaced step counts
    replace `diffusion_steps`). convention: "engine" counts what
    marcache computes (equal to the engine's telemetry); "reference" counts what the
    official PyTorch code computes for the same run (the decoder's last block on
    every row, no hoisting in the diffusion head: the convention of the published
    MAR/LazyMAR FLOPs and of the spec's derived tables).

    VAR: one step per scale (the model's patch_nums; `steps` and `diffusion_steps`
    do not apply); cfg != 0 (default 1.5) runs the unconditional half, two sequences
    per image; more_smooth=True adds the probabilities x codebook GEMM. convention:
    "engine" (the telemetry: the adaLN modulation once per run, word_embed on the
    image rows) or "spec" (the spec's Part E tables: the modulation at every scale,
    word_embed on every sequence). Returns a VARFlopReport.
    """
    if _family(model_or_name) == "var":
        if steps is not None:
            raise ValueError(f"steps={steps!r}: a VAR model runs one step per scale of its patch_nums; "
                             f"leave steps out")
        if diffusion_steps is not None:
            raise ValueError("diffusion_steps applies to MAR models only")
        return _var_flops(model_or_name, 1.5 if cfg is None else cfg, cache, batch, convention, more_smooth)
    if more_smooth:
        raise ValueError("more_smooth applies to VAR models only")
    return _mar_flops(model_or_name, 64 if steps is None else steps, 1.0 if cfg is None else cfg, cache, batch,
                      100 if diffusion_steps is None else diffusion_steps, convention)


def _var_flops(model_or_name, cfg, cache, batch, convention, more_smooth):
    if convention not in ("engine", "spec"):
        raise ValueError(f"convention must be 'engine' or 'spec' for a VAR model, got {convention!r}")
    if isinstance(batch, bool) or not isinstance(batch, numbers.Integral) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    if isinstance(cfg, bool) or not isinstance(cfg, numbers.Real) or not math.isfinite(cfg) or cfg < 0:
        raise ValueError(f"cfg must be a finite number >= 0, got {cfg!r}")
    if not isinstance(more_smooth, bool):
        raise ValueError(f"more_smooth must be True or False, got {more_smooth!r}")
    policy = _resolve_cache(cache, family=_var.FAMILY)
    c = VAR_CONFIGS[model_or_name] if isinstance(model_or_name, str) else model_or_name.config
    patch_nums = [int(p) for p in c["patch_nums"]]
    per_scale, keys = [], 0
    for si, n in enumerate(_var.scale_tokens(patch_nums)):
        keys += n
        ctx = _var.ScaleContext(config=c, batch=int(batch), cfg_on=cfg != 0, scale=si, n_scales=len(patch_nums),
                                tokens=n, keys=keys)
        per_scale.append(_var.scale_flops(ctx, policy, more_smooth=more_smooth, convention=convention))
    sums = {k: float(sum(s[k] for s in per_scale))
            for k in ("total", "linear", "attention", "head", "embed", "adaln", "smooth")}
    return VARFlopReport(per_scale=per_scale, **sums)


def _mar_flops(model_or_name, steps, cfg, cache, batch, diffusion_steps, convention):
    if convention not in ("engine", "reference"):
        raise ValueError(f"convention must be 'engine' or 'reference', got {convention!r}")
    reference = convention == "reference"
    cache = _resolve_cache(cache)
    if isinstance(model_or_name, str):
        c = MAR_CONFIGS[model_or_name]
    else:
        c = model_or_name.config
        diffusion_steps = c.get("diffusion_steps", diffusion_steps)
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or not 1 <= steps <= 2**31 - 1:
        raise ValueError(f"steps must be an integer in 1..2**31-1, got {steps!r}")
    cfg_on = cfg != 1.0
    head_cache = cache.head_cache_config(cfg_on)
    S = c["seq_len"]
    enc = dec = head = head_params = 0.0
    per_step = []
    predicted_before = 0
    for step, (masked_before, _mask_len, predicted) in enumerate(_schedule.plan(S, steps)):
        if predicted == 0:
            per_step.append(0.0)
            continue
        ctx = _StepContext(config=c, batch=batch, cfg_on=cfg_on, step=step, steps=steps,
                           known=S - masked_before, predicted=predicted, predicted_before=predicted_before,
                           reference=reference)
        e, d = cache.transformer_flops(ctx)
        # A policy may sample some steps unguided (CfgFreeLate): its step_cfg_on says which.
        step_cfg_on = cache.step_cfg_on(ctx) if hasattr(cache, "step_cfg_on") else cfg_on
        # A policy may sample some steps with its own respacing (DiSA).
        step_diffusion = cache.step_diffusion_steps(ctx, diffusion_steps) if hasattr(
            cache, "step_diffusion_steps") else diffusion_steps
        h = _mar.head(c, batch * predicted, step_cfg_on, step_diffusion, head_cache, reference)
        # Every head FLOP term is 2 x rows x a weight's size, so one unguided row's
        # FLOPs / 2 count the weights each evaluation reads (once, for all its rows).
        if not reference:
            head_params += _mar.head(c, 1, False, step_diffusion, head_cache) / 2
        enc, dec, head = enc + e, dec + d, head + h
        per_step.append(float(e + d + h))
        predicted_before = predicted
    return FlopReport(total=float(enc + dec + head), encoder=float(enc), decoder=float(dec), head=float(head),
                      per_step=per_step, head_params_read=float(head_params))

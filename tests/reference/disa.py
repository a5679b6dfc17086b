"""Float64 reference of DiSA (diffusion step annealing, spec disa.md), written from
the spec on top of the MAR reference (mar.py sections 6 and 7), independent of the
engine and of marcache's Python policy:

  The official code makes one respaced DDPM per step count k = lower .. upper (a list
  of L = upper - lower + 1); AR step `step` of `num_iter` (U = num_iter - 1) samples
  with entry i of the list: linear int((U - step) / U * (L - 1)), cosine
  int((cos(pi * step / U) + 1) / 2 * (L - 1)), constant 0, two-stage L - 1 while
  step < U / 2 else 0. num_iter = 1 (U = 0) is marcache's choice: i = L - 1.
  Each respacing is MAR's space_timesteps(1000, str(k)) of the cosine schedule, with
  the DiSA sampler's clip: every kept timestep t becomes min(t, clip) and the kept
  set stays a set; the betas are re-derived from the base alphas_cumprod at the kept
  timesteps (SpacedDiffusion), learned-range variance.
"""
import math

import numpy as np

from . import cfgfree as RF


def base_alphas_cumprod(T=1000):
    """The cosine schedule (Nichol & Dhariwal) with betas clipped at 0.999, float64."""
    f = lambda s: math.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2  # noqa: E731
    alphas = [1.0 - min(1.0 - f((i + 1) / T) / f(i / T), 0.999) for i in range(T)]
    return np.cumprod(np.array(alphas, dtype=np.float64))


def kept_timesteps(k, clip=None, T=1000):
    """space_timesteps(T, str(k)) with DiSA's clip, as a sorted list."""
    stride = 1.0 if k <= 1 else (T - 1) / (k - 1)
    cur, kept = 0.0, set()
    for _ in range(k):
        t = round(cur)
        kept.add(t if clip is None else min(t, clip))
        cur += stride
    return sorted(kept)


def respaced_tables(k, clip=None, T=1000):
    """The tables mar.py's head_sample reads, for the respacing of k steps with `clip`.
    With one kept timestep the posterior variance has no second entry: its log is
    taken of the first (0, so -inf), which the last step never reads (no noise)."""
    abar = base_alphas_cumprod(T)
    tau = kept_timesteps(k, clip, T)
    betas, last = [], 1.0
    for t in tau:
        betas.append(1.0 - abar[t] / last)
        last = abar[t]
    betas = np.array(betas)
    ac = np.cumprod(1.0 - betas)
    ac_prev = np.concatenate([[1.0], ac[:-1]])
    post_var = betas * (1.0 - ac_prev) / (1.0 - ac)
    with np.errstate(divide="ignore"):
        clipped = np.log(np.concatenate([post_var[1:2] if len(tau) > 1 else post_var[:1], post_var[1:]]))
    return dict(
        timesteps=np.array(tau, dtype=np.int64),
        betas=betas,
        alphas_cumprod=ac,
        sqrt_recip_alphas_cumprod=np.sqrt(1.0 / ac),
        sqrt_recipm1_alphas_cumprod=np.sqrt(1.0 / ac - 1.0),
        posterior_variance=post_var,
        posterior_log_variance_clipped=clipped,
        posterior_mean_coef1=betas * np.sqrt(ac_prev) / (1.0 - ac),
        posterior_mean_coef2=(1.0 - ac_prev) * np.sqrt(1.0 - betas) / (1.0 - ac),
        log_betas=np.log(betas),
    )


def schedule_index(schedule, step, num_iter, lower, upper):
    L, U = upper - lower + 1, num_iter - 1
    if U == 0:
        return L - 1
    if schedule == "linear":
        return int((U - step) / U * (L - 1))
    if schedule == "cosine":
        return int((math.cos(math.pi * step / U) + 1) / 2 * (L - 1))
    if schedule == "constant":
        return 0
    if schedule == "two-stage":
        return L - 1 if step < U / 2 else 0
    raise ValueError(schedule)


def generate_tokens(W, labels, num_images, steps, cfg, cfg_schedule, temperature, seed, first_index, heads,
                    upper, lower, schedule="linear", clip=950):
    """MAR's AR loop (no cache; cfgfree.py's loop with every step guided, which is MAR's)
    with each step's head sampled by its DiSA respacing. Tokens float32 [num_images, S, C]
    and one dict per step (step, k, diffusion_steps)."""
    def k_at(step):
        return lower + schedule_index(schedule, step, steps, lower, upper)

    tokens, _ = RF.generate_tokens(W, labels, num_images, steps, cfg, cfg_schedule, temperature, seed, first_index,
                                   heads, after=1.0, tables=lambda step: respaced_tables(k_at(step), clip))
    log = [dict(step=s, k=k_at(s), diffusion_steps=len(kept_timesteps(k_at(s), clip))) for s in range(steps)]
    return tokens, log

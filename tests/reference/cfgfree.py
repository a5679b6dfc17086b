"""Float64 reference of CfgFreeLate (guidance only for the early AR steps), written
from its definition on top of the MAR reference (mar.py sections 7.2-7.4):

  AR step k of a run of N steps is guidance-free when k >= after * N. A guided step
  is MAR's (transformer on the cond + uncond batch, head with cfg_iter); a
  guidance-free step runs the transformer on the conditional sequences alone and
  samples its tokens with the unguided head (cfg 1). Everything else (orders,
  schedule, noise keyed by image and position) is MAR's.
"""
import numpy as np

from . import mar as R


def guidance_free(step, steps, after):
    return step >= after * steps


def generate_tokens(W, labels, num_images, steps, cfg, cfg_schedule, temperature, seed, first_index, heads,
                    after, tables=None):
    """Tokens float32 [num_images, S, C] and a log with one dict per step (step, guided).
    tables: MAR's diffusion tables (default 100 steps), or a function of the AR step giving
    that step's tables (DiSA's reference, disa.py, samples each step with its respacing)."""
    sz = R.model_sizes(W)
    S, C = sz["seq_len"], sz["token_channels"]
    B = int(num_images)
    if tables is None:
        tables = R.diffusion_tables()
    tokens = np.zeros((B, S, C), dtype=np.float32)
    mask = np.ones((B, S), dtype=bool)
    orders = R.generation_orders(seed, first_index, B, S)
    log = []
    for k, (_m_before, mask_len, n_pred) in enumerate(R.mask_schedule(S, steps)):
        guided = cfg != 1.0 and not guidance_free(k, steps, after)
        z = R.transformer(W, tokens, mask, labels, heads, guided)
        mask_next = np.zeros_like(mask)
        mask_next[np.arange(B)[:, None], orders[:, :mask_len]] = True
        pred = mask.copy() if k == steps - 1 else mask & ~mask_next
        mask = mask_next
        rows_b, rows_pos = np.nonzero(pred)
        z_sel = z[rows_b, rows_pos]
        if guided:
            z_sel = np.concatenate([z_sel, z[B + rows_b, rows_pos]])
        cfg_iter = R.cfg_schedule(cfg, cfg_schedule, mask_len, S) if guided else 1.0
        if n_pred > 0:
            step_tables = tables(k) if callable(tables) else tables
            sampled = R.head_sample(W, z_sel, first_index + rows_b, rows_pos, seed, temperature, cfg_iter,
                                    step_tables)
            tokens[rows_b, rows_pos] = sampled.astype(np.float32)
        log.append(dict(step=k, guided=guided, cfg_iter=cfg_iter))
    return tokens, log

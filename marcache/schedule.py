"""The MAR schedules in Python (mar.md 7.2 step 5 and 7.4), used by flops()
and by users who want the per-step plan of a run before running it. The C
runtime computes the same numbers; tests compare both with the spec tables."""
import math

import numpy as np


def mask_len_after(seq_len, masked_before, step, num_steps):
    """Tokens that stay masked after AR step `step` (clamped to [1, masked_before - 1])."""
    ratio = np.cos(math.pi / 2.0 * (step + 1) / num_steps)
    mask_len = math.floor(seq_len * ratio)
    return int(max(1, min(masked_before - 1, mask_len)))


def plan(seq_len, num_steps):
    """Per step: (masked_before, mask_len_after, predicted) for a run of num_steps."""
    out = []
    masked = seq_len
    for step in range(num_steps):
        mask_len = mask_len_after(seq_len, masked, step, num_steps)
        last = step == num_steps - 1
        predicted = masked if last else masked - mask_len
        out.append((masked, mask_len, predicted))
        masked = 0 if last else mask_len
    return out


def cfg_at(cfg, schedule, mask_len, seq_len):
    """cfg_iter of one step, in float32 as the reference computes it."""
    if schedule == "constant":
        return float(np.float32(cfg))
    if schedule != "linear":
        raise ValueError(f"cfg_schedule must be 'linear' or 'constant', got {schedule!r}")
    known_after = np.float32(seq_len - mask_len)
    scaled = np.float32(cfg - 1.0) * known_after
    return float(np.float32(1.0) + scaled / np.float32(seq_len))

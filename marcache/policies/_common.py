"""What the cache policies share: field checks, the engine's field dict, and the
per-step context their FLOP models read."""
from dataclasses import dataclass, fields


def check_fields(cache, what, flags, lower_bounds, head_fields=True):
    """Boolean switches, integer fields with lower bounds, and (head_fields) LazyMAR's
    head-cache settings, which MARche reuses."""
    for flag in flags:
        if not isinstance(getattr(cache, flag), bool):
            raise TypeError(f"{what}.{flag} must be True or False, got {getattr(cache, flag)!r}")
    bounds = tuple(lower_bounds)
    if head_fields:
        bounds += (("head_period", 1), ("head_skip_first", 0), ("head_skip_last", -1))
    for name, low in bounds:
        value = getattr(cache, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{what}.{name} must be an integer >= {low}, got {value!r}")
    if not head_fields:
        return
    if cache.head_skip_last < cache.head_skip_first - 1:
        raise ValueError(f"{what}.head_skip_last must be >= head_skip_first - 1 (an empty range)")
    above = cache.head_recompute_above
    if isinstance(above, bool) or not isinstance(above, (int, float)) or not 0.0 <= above <= 1.0:
        raise ValueError(f"{what}.head_recompute_above must be in [0, 1], got {above!r}")


def engine_fields(policy, **resolved):
    """{"policy": name, field: value, ...}: the policy's own dataclass fields, which the
    C policy's field table reads by name; values in `resolved` replace fields that
    depend on the model (MARche's budget)."""
    out = {"policy": policy.name}
    for f in fields(policy):
        value = resolved[f.name] if f.name in resolved else getattr(policy, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


@dataclass
class StepContext:
    """One AR step as a policy's FLOP model sees it."""
    config: dict          # the model's hyper-parameters
    batch: int            # images B
    cfg_on: bool
    step: int
    steps: int
    known: int            # tokens known before the step, per image
    predicted: int        # tokens predicted now, per image
    predicted_before: int  # tokens predicted at the previous step
    reference: bool = False  # count what the official code computes (flops(convention="reference"))

    @property
    def n_seq(self):
        return (2 if self.cfg_on else 1) * self.batch

    def read(self, rows):
        """Rows per sequence at which the engine computes the decoder's last block
        (its outputs are read only there); None, every row, in the reference count."""
        return None if self.reference else rows

    def read_full_step(self, cond_cache):
        """A cache policy's full step: with the condition cache (on this step) the last
        block is read at every masked row (the diff later steps read there), without at
        the predicted rows."""
        return self.read(self.config["seq_len"] - self.known if cond_cache and self.cfg_on else self.predicted)

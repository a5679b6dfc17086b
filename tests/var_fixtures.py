"""Tiny VAR models in the exact official key layout (var_fastvar.md A3), written with
the safetensors package (an independent writer) for the VAR engine tests."""
import numpy as np
from safetensors.numpy import save_file

from reference import var as RV

# depth 2, width 128, 2 heads of 64, vocab 64, 4 scales (30 tokens); scale_mul spans the
# ln 100 cap (ln 2 .. ln 400 over the 4 heads).
TINY = dict(depth=2, width=128, heads=2, vocab=64, vae_channels=8, num_classes=10, patch_nums=(1, 2, 3, 4))


def patch_nums_text(patch_nums):
    return ",".join(str(p) for p in patch_nums)


def write_tiny_var(path, seed=0, dtype=np.float32, metadata=True, buffers=True, drop=(), **overrides):
    """Writes a random VAR (TINY with `overrides`) to path; returns its float32 state dict.
    metadata: write patch_nums (and kind) into __metadata__; drop: keys to leave out."""
    cfg = dict(TINY, **overrides)
    rng = np.random.default_rng(seed)
    W = RV.random_var_weights(rng, buffers=buffers, **cfg)
    meta = {"kind": "var", "patch_nums": patch_nums_text(cfg["patch_nums"])} if metadata else None
    stored = {k: (v if v.dtype == np.int64 else v.astype(dtype)) for k, v in W.items() if k not in drop}
    save_file(stored, str(path), metadata=meta)
    return W

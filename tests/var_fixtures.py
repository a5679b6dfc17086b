"""Tiny VAR models in the exact official key layout (var_fastvar.md A3), written with
the safetensors package (an independent writer) for the VAR engine tests."""
import os

import numpy as np
from safetensors.numpy import save_file

from reference import var as RV
from reference import vqvae as RVQ

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


# The tiny VQVAE the generation tests pair with the tiny VARs (vocab 64, 8 latent channels).
TINY_VQ = dict(ch=32, ch_mult=(1, 2), num_res_blocks=1, z=8, vocab=64, num_phi=4)


def write_var_and_vqvae(directory, var_seed, vq_seed, **overrides):
    """A tiny VAR (TINY with `overrides`) and a TINY_VQ VQVAE of random weights under
    `directory`: (var path, VAR state dict, VQVAE path, VQVAE state dict)."""
    var_path = os.path.join(str(directory), "tiny_var.safetensors")
    W = write_tiny_var(var_path, seed=var_seed, **overrides)
    VQW = RVQ.random_vqvae_weights(np.random.default_rng(vq_seed), **TINY_VQ)
    vq_path = os.path.join(str(directory), "tiny_vqvae.safetensors")
    save_file(dict(VQW), vq_path)
    return var_path, W, vq_path, VQW


class ReferenceVQ:
    """The float64 reference's VQ update, as RV.generate / RF.generate call it."""

    def __init__(self, W):
        self.W = W
        self.codebook = W["quantize.embedding.weight"]
        self.num_phi = RVQ.count_phi(W)

    def add_scale(self, f_hat, h, si, n_scales):
        return RVQ.add_scale(self.W, f_hat, h, RVQ.phi_index(si, n_scales, self.num_phi))

    def next_input(self, f_hat, pn):
        return RVQ.resize_area(f_hat, pn, pn)

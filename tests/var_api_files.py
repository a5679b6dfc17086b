"""Tiny VQVAEs in the official key layout (marcache/convert/decoder.py
decoder_expected_shapes plus the codebook and Phi convs, as `marcache convert vqvae`
writes them) with random weights, written with the safetensors package, and the tiny
VAR of var_fixtures they fit: the files of the API tests."""
import math

import numpy as np
from safetensors.numpy import save_file

from marcache.convert import decoder_expected_shapes
from var_fixtures import TINY, write_tiny_var  # noqa: F401  (re-exported for the API tests)

# The VAR of var_fixtures (var-model's: depth 2, width 128, vocab 64, 8 latent channels, 10
# classes, patch_nums 1, 2, 3, 4) and a VQVAE that fits it: codebook 64 x 8, ch 32, ch_mult
# (1, 2) (upscale 2: 8 x 8 images), 4 Phi convs.
TINY_VAR = dict(TINY)
TINY_VQVAE = dict(vocab=TINY["vocab"], z=TINY["vae_channels"], ch=32, ch_mult=(1, 2), num_res_blocks=1, num_phi=4)


def _random(rng, name, shape):
    """Conv weights ~ N(0, 1 / fan_in), GroupNorm weights ~ 1 + N(0, 0.05^2), biases
    ~ N(0, 0.05^2), the codebook ~ N(0, 0.5^2)."""
    z = rng.standard_normal(shape)
    if name == "quantize.embedding.weight":
        return 0.5 * z
    if len(shape) == 4:
        return z / math.sqrt(int(np.prod(shape[1:])))
    if name.endswith(".weight"):
        return 1.0 + 0.05 * z
    return 0.05 * z


def write_var_with_metadata(path, metadata, seed=0, **overrides):
    """var_fixtures' tiny VAR with exactly `metadata` (None: no metadata at all)."""
    W = write_tiny_var(path, seed=seed, metadata=False, **overrides)
    save_file({k: v for k, v in W.items()}, str(path), metadata=metadata)
    return W


def vqvae_weights(seed=1, vocab=64, z=8, ch=32, ch_mult=(1, 2), num_res_blocks=1, num_phi=4):
    """name -> float32 array of VAR's VQVAE decoding tensors (decoder, post_quant_conv,
    codebook, Phi convs: what `marcache convert vqvae` keeps)."""
    rng = np.random.default_rng(seed)
    shapes = dict(decoder_expected_shapes(ch, tuple(ch_mult), num_res_blocks, z, post_quant_ks=3, fused_qkv=True,
                                          top_attention=True))
    shapes["quantize.embedding.weight"] = (vocab, z)
    for i in range(num_phi):
        shapes[f"quantize.quant_resi.qresi_ls.{i}.weight"] = (z, z, 3, 3)
        shapes[f"quantize.quant_resi.qresi_ls.{i}.bias"] = (z,)
    return {name: _random(rng, name, shape).astype(np.float32) for name, shape in shapes.items()}


def write_tiny_vqvae(path, seed=1, metadata=True, **config):
    c = dict(TINY_VQVAE, **config)
    W = vqvae_weights(seed, **c)
    meta = None
    if metadata:
        meta = {"kind": "vqvae", "ch": str(c["ch"]), "ch_mult": ",".join(map(str, c["ch_mult"])),
                "num_res_blocks": str(c["num_res_blocks"]), "z_channels": str(c["z"]), "vocab": str(c["vocab"]),
                "num_phi": str(c["num_phi"]), "quant_resi": "0.5"}
    save_file(W, str(path), metadata=meta)
    return W

"""Tiny VAR transformers and VQVAEs in the official key layouts (the shapes of
marcache/convert/var.py var_expected_shapes and marcache/convert/decoder.py
decoder_expected_shapes, as `marcache convert` writes them), with random weights,
written with the safetensors package (an independent writer) for the API tests."""
import math

import numpy as np
from safetensors.numpy import save_file

from marcache.convert import decoder_expected_shapes, var_expected_shapes

# A VAR small enough to generate in well under a second on the CPU: 2 blocks of width
# 32 (2 heads of 16), 3 scales (1, 2, 3: 14 tokens), 10 classes; its VQVAE: codebook of
# 24 x 8, ch 32, ch_mult (1, 2) (upscale 2: 6 x 6 images), 4 Phi convs.
TINY_VAR = dict(depth=2, width=32, heads=2, vocab=24, vae_channels=8, num_classes=10, patch_nums=(1, 2, 3))
TINY_VQVAE = dict(vocab=24, z=8, ch=32, ch_mult=(1, 2), num_res_blocks=1, num_phi=4)
VAR_BUFFERS = ("lvl_1L", "attn_bias_for_masking")


def _random(rng, name, shape):
    """Linear / conv weights ~ N(0, 1 / fan_in), norm weights ~ 1 + N(0, 0.05^2), biases
    and embeddings ~ N(0, 0.05^2 .. 0.5^2)."""
    z = rng.standard_normal(shape)
    if name.endswith("scale_mul_1H11"):
        return np.full(shape, math.log(4.0))
    if len(shape) >= 2 and name.endswith(".weight") and not name.startswith(("class_emb", "lvl_embed",
                                                                              "quantize.embedding")):
        return z / math.sqrt(int(np.prod(shape[1:])))
    if name.endswith("norm.weight") or ".norm1.weight" in name or ".norm2.weight" in name or \
            name.endswith("norm_out.weight"):
        return 1.0 + 0.05 * z
    if name.startswith(("class_emb", "quantize.embedding")):
        return 0.5 * z
    return 0.05 * z


def var_weights(seed=0, depth=2, width=32, heads=2, vocab=24, vae_channels=8, num_classes=10, patch_nums=(1, 2, 3),
                buffers=False):
    """name -> float32 array of a VAR transformer (12 + 13 depth keys with the buffers,
    10 + 12 depth without them, as `marcache convert var` writes)."""
    rng = np.random.default_rng(seed)
    L = sum(p * p for p in patch_nums)
    shapes = var_expected_shapes(depth, width, heads, vocab=vocab, tokens=L, vae_channels=vae_channels,
                                 num_classes=num_classes, num_levels=len(patch_nums))
    out = {}
    for name, shape in shapes.items():
        is_buffer = name in VAR_BUFFERS or name.endswith("zero_k_bias")
        if is_buffer and not buffers:
            continue
        if name == "lvl_1L":
            out[name] = np.concatenate([np.full(p * p, i) for i, p in enumerate(patch_nums)]).reshape(1, L)
        elif name == "attn_bias_for_masking":
            lvl = np.concatenate([np.full(p * p, i) for i, p in enumerate(patch_nums)])
            out[name] = np.where(lvl[:, None] >= lvl[None, :], 0.0, -np.inf).astype(np.float32).reshape(1, 1, L, L)
        elif name.endswith("zero_k_bias"):
            out[name] = np.zeros(shape, np.float32)
        else:
            out[name] = _random(rng, name, shape).astype(np.float32)
    return out


def write_tiny_var(path, seed=0, metadata=True, drop=(), extra_metadata=None, **config):
    """Writes a tiny VAR (TINY_VAR, overridden by `config`) to path; metadata=True adds what
    `marcache convert var` records (kind, patch_nums, ...). `drop`: keys to leave out."""
    c = dict(TINY_VAR, **config)
    W = var_weights(seed, **c)
    for name in drop:
        W.pop(name)
    meta = None
    if metadata:
        meta = {"kind": "var", "depth": str(c["depth"]), "width": str(c["width"]), "heads": str(c["heads"]),
                "vocab": str(c["vocab"]), "patch_nums": ",".join(map(str, c["patch_nums"]))}
    if extra_metadata:
        meta = dict(meta or {}, **extra_metadata)
    save_file(W, str(path), metadata=meta)
    return W


def vqvae_weights(seed=1, vocab=24, z=8, ch=32, ch_mult=(1, 2), num_res_blocks=1, num_phi=4):
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

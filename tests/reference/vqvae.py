"""Float64 reference of VAR's multi-scale VQVAE, decode side (var_fastvar.md
Part B, A4 step 6), NHWC, written from the spec:

  * the resize ops: bicubic (PyTorch's F.interpolate 'bicubic',
    align_corners=False, A = -0.75, clamped taps; B3) and 'area' (adaptive
    average pooling, down- and up-sampling; B3, D3);
  * the codebook lookup (B2), the Phi convs and their selection by scale (B3),
    the f_hat accumulation over scales and the next scale's input (A4 step 6);
  * the decoder (B4): post_quant_conv (3x3), an LDM decoder whose top level
    has an attention block after every ResnetBlock, fused qkv 1x1 convs,
    clamped to [-1, 1];
  * the official key layout (B5) and random weights in it.

Generic over ch, ch_mult, num_res_blocks, z_channels, vocab and the number of
Phi convs, all read back from the shapes.
"""
import math
from collections import OrderedDict

import numpy as np

from . import ops
from . import vae as ref_vae

GN_GROUPS = 32
GN_EPS = 1e-6
QUANT_RESI = 0.5   # B3: Phi(x) = (1 - 0.5) x + 0.5 conv(x)
CUBIC_A = -0.75
DEFAULT_PATCH_NUMS = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)
OFFICIAL_CONFIG = dict(ch=160, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=2, z=32, vocab=4096, num_phi=4)
OFFICIAL_KEY_COUNT = 189            # B5 / appendix: 178 decoder + embedding + 4 x 2 Phi + 2 post_quant
OFFICIAL_DECODER_PARAMS = 64653923  # B1


# ==========================================================================
# Resizing (B3, D3)
# ==========================================================================

def _cubic_weights(t):
    """The four A = -0.75 cubic-convolution weights of taps i0-1 .. i0+2 for
    fraction t (B3)."""
    a = CUBIC_A

    def inner(x):   # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def outer(x):   # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    return np.array([outer(t + 1), inner(t), inner(1 - t), outer(2 - t)])


def bicubic_matrix(in_size, out_size):
    """[out, in] float64 interpolation matrix of one axis: src = (o + 0.5)
    in / out - 0.5, i0 = floor(src), t = src - i0, taps clamped to
    [0, in - 1] (a clamped tap adds its weight to the edge sample)."""
    m = np.zeros((out_size, in_size))
    for o in range(out_size):
        src = (o + 0.5) * in_size / out_size - 0.5
        i0 = math.floor(src)
        w = _cubic_weights(src - i0)
        for j in range(4):
            m[o, min(max(i0 - 1 + j, 0), in_size - 1)] += w[j]
    return m


def resize_bicubic(x, out_h, out_w):
    """x NHWC [B, H, W, C] -> [B, out_h, out_w, C], separable bicubic (B3)."""
    x = ops.f64(x)
    mh = bicubic_matrix(x.shape[1], out_h)
    mw = bicubic_matrix(x.shape[2], out_w)
    return np.einsum("oh,bhwc,pw->bopc", mh, x, mw)


def area_bins(in_size, out_size):
    """[(start, end)] of adaptive average pooling: [floor(i in / out),
    ceil((i + 1) in / out)) (B3; D3 for out > in)."""
    return [((i * in_size) // out_size, -((-(i + 1) * in_size) // out_size))
            for i in range(out_size)]


def resize_area(x, out_h, out_w):
    """x NHWC -> the mean over each (row bin) x (column bin) rectangle."""
    x = ops.f64(x)
    out = np.zeros((x.shape[0], out_h, out_w, x.shape[3]))
    for i, (y0, y1) in enumerate(area_bins(x.shape[1], out_h)):
        for j, (x0, x1) in enumerate(area_bins(x.shape[2], out_w)):
            out[:, i, j, :] = x[:, y0:y1, x0:x1, :].mean(axis=(1, 2))
    return out


# ==========================================================================
# Phi selection, the multi-scale f_hat (B3, A4 step 6)
# ==========================================================================

def phi_ticks(num_phi):
    """B3: the ticks of PhiPartiallyShared, np.linspace(1/(3K), 1 - 1/(3K), K)
    for K = 4 (1/12 .. 11/12, the spec's table) and np.linspace(1/(2K),
    1 - 1/(2K), K) for any other K (the official quant.py rule)."""
    k = num_phi
    lo = 1 / 3 / k if k == 4 else 1 / 2 / k
    return np.linspace(lo, 1 - lo, k)


def phi_index(si, n_scales, num_phi):
    """argmin_k |ticks_k - si / (n - 1)|, first minimum (np.argmin); 0 for n = 1."""
    at = si / (n_scales - 1) if n_scales > 1 else 0.0
    return int(np.argmin(np.abs(phi_ticks(num_phi) - at)))


def embed(W, idx):
    """B2: codebook rows quantize.embedding.weight[idx] (float64)."""
    return ops.f64(W["quantize.embedding.weight"])[np.asarray(idx)]


def phi(W, k, h, quant_resi=QUANT_RESI, wtype="fp32"):
    """Phi_k(h) = (1 - r) h + r (conv3x3_k(h) + b_k) on NHWC h. A 16-bit wtype (a VQVAE
    loaded in bf16/fp16) convolves h and the weights rounded to it, as autocast does."""
    p = "quantize.quant_resi.qresi_ls.%d" % k
    x, w = (h, W[p + ".weight"]) if wtype == "fp32" else (ops.round_to_wtype(h, wtype),
                                                           ops.round_to_wtype(W[p + ".weight"], wtype))
    conv = ops.conv2d(ops.f64(x), ops.f64(w), ops.f64(W[p + ".bias"]))
    return (1 - quant_resi) * ops.f64(h) + quant_resi * conv


def add_scale(W, f_hat, h, phi_k, wtype="fp32"):
    """f_hat + Phi_k(bicubic(h -> side x side)); no resize when h is already
    side x side (the last scale). wtype: phi's."""
    side = f_hat.shape[1]
    if h.shape[1] != side:
        h = resize_bicubic(h, side, side)
    return f_hat + phi(W, phi_k, h, wtype=wtype)


def idx_to_fhat(W, idx_list, patch_nums):
    """A4 step 6 over the first k = len(idx_list) scales of patch_nums:
    idx_list[si] int [B, pn^2] (raster order). Returns (f_hat [B, side,
    side, z], nexts) with nexts[si] = area(f_hat after scale si -> the next
    scale's pn) for si < n - 1 (the next scale's input map)."""
    n = len(patch_nums)
    side = patch_nums[-1]
    num_phi = count_phi(W)
    z = W["quantize.embedding.weight"].shape[1]
    batch = np.asarray(idx_list[0]).shape[0]
    f_hat = np.zeros((batch, side, side, z))
    nexts = []
    for si, idx in enumerate(idx_list):
        pn = patch_nums[si]
        h = embed(W, idx).reshape(batch, pn, pn, z)
        f_hat = add_scale(W, f_hat, h, phi_index(si, n, num_phi))
        if si < n - 1:
            nexts.append(resize_area(f_hat, patch_nums[si + 1], patch_nums[si + 1]))
    return f_hat, nexts


def count_phi(W):
    return sum(1 for k in W if k.startswith("quantize.quant_resi.qresi_ls.") and k.endswith(".weight"))


# ==========================================================================
# Keys and shapes (B5)
# ==========================================================================

def _attn_shapes(prefix, c):
    """AttnBlock with the fused qkv 1x1 conv (B4)."""
    return [(prefix + ".norm.weight", (c,)), (prefix + ".norm.bias", (c,)),
            (prefix + ".qkv.weight", (3 * c, c, 1, 1)), (prefix + ".qkv.bias", (3 * c,)),
            (prefix + ".proj_out.weight", (c, c, 1, 1)), (prefix + ".proj_out.bias", (c,))]


def vqvae_shapes(ch=160, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=2, z=32, vocab=4096, num_phi=4):
    """OrderedDict key -> shape of the decoding tensors (B5): the codebook,
    the Phi convs, post_quant_conv (3x3) and decoder.*, whose top level has
    an attention block after each of its ResnetBlocks."""
    s = [("quantize.embedding.weight", (vocab, z))]
    for k in range(num_phi):
        s += [("quantize.quant_resi.qresi_ls.%d.weight" % k, (z, z, 3, 3)),
              ("quantize.quant_resi.qresi_ls.%d.bias" % k, (z,))]
    s += [("post_quant_conv.weight", (z, z, 3, 3)), ("post_quant_conv.bias", (z,))]
    return OrderedDict(s + ref_vae.decoder_shapes(ch, ch_mult, num_res_blocks, z, 3, _attn_shapes, True))


def random_vqvae_weights(rng, ch=160, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=2, z=32, vocab=4096,
                         num_phi=4, scale=1.0):
    """Random weights with the official names (float32): conv weights
    ~ N(0, scale^2 / fan_in), biases ~ N(0, 0.05^2), GroupNorm weights
    ~ 1 + N(0, 0.05^2), codebook ~ N(0, 1)."""
    out = OrderedDict()
    for name, shape in vqvae_shapes(ch, ch_mult, num_res_blocks, z, vocab, num_phi).items():
        if name == "quantize.embedding.weight":
            out[name] = rng.standard_normal(shape).astype(np.float32)
        else:
            out[name] = ref_vae.random_decoder_tensor(rng, name, shape, scale)
    return out


def vqvae_config(W):
    """dict(ch, ch_mult, num_res_blocks, z, vocab, num_phi) read back from the shapes."""
    levels = sorted({int(k.split(".")[2]) for k in W if k.startswith("decoder.up.")})
    vocab, z = W["quantize.embedding.weight"].shape
    return dict(ref_vae.decoder_levels_config(W, levels), z=int(z), vocab=int(vocab), num_phi=count_phi(W))


def check_keys(W):
    """Raise unless W holds exactly the decoding keys/shapes of its configuration."""
    ref_vae.check_shapes(W, vqvae_shapes(**vqvae_config(W)), "VQVAE")


# ==========================================================================
# Decoder (B4)
# ==========================================================================

def attn_block(W, x, prefix, groups=GN_GROUPS):
    """AttnBlock with the fused qkv conv: q, k, v = channels [0, c), [c, 2c),
    [2c, 3c) of qkv(norm(x)); one head over the H*W positions (row-major),
    scale c^-0.5; x + proj_out(softmax(q k^T scale) v)."""
    n, hgt, wid, c = x.shape
    hn = ops.groupnorm(x, groups, ops.f64(W[prefix + ".norm.weight"]), ops.f64(W[prefix + ".norm.bias"]),
                       GN_EPS)
    qkv = ops.conv2d(hn, ops.f64(W[prefix + ".qkv.weight"]), ops.f64(W[prefix + ".qkv.bias"]))
    qkv = qkv.reshape(n, hgt * wid, 3 * c)
    q, k, v = qkv[..., :c], qkv[..., c:2 * c], qkv[..., 2 * c:]
    o = ops.attention(q, [(k, v)], heads=1, scale=c ** -0.5).reshape(n, hgt, wid, c)
    return x + ops.conv2d(o, ops.f64(W[prefix + ".proj_out.weight"]), ops.f64(W[prefix + ".proj_out.bias"]))


def decoder(W, h):
    """decoder.* on a post_quant_conv output h [N, s, s, z] (B4): conv_in,
    mid (block_1, attn_1, block_2), up levels n-1 .. 0 (ResnetBlocks, each
    followed by an AttnBlock on the top level; nearest x2 + conv for levels
    != 0), norm_out + swish, conv_out."""
    cfg = vqvae_config(W)
    conv = ref_vae._conv
    h = conv(W, h, "decoder.conv_in")
    h = ref_vae.resnet_block(W, h, "decoder.mid.block_1")
    h = attn_block(W, h, "decoder.mid.attn_1")
    h = ref_vae.resnet_block(W, h, "decoder.mid.block_2")
    levels = len(cfg["ch_mult"])
    for level in reversed(range(levels)):
        for b in range(cfg["num_res_blocks"] + 1):
            h = ref_vae.resnet_block(W, h, "decoder.up.%d.block.%d" % (level, b))
            if level == levels - 1:
                h = attn_block(W, h, "decoder.up.%d.attn.%d" % (level, b))
        if level != 0:
            h = conv(W, ops.upsample_nearest2x(h), "decoder.up.%d.upsample.conv" % level)
    h = ref_vae._norm(W, h, "decoder.norm_out", True, GN_GROUPS)
    return conv(W, h, "decoder.conv_out")


def decode_unclamped(W, f_hat):
    """decoder(post_quant_conv(f_hat)) before the clamp."""
    check_keys(W)
    return decoder(W, ref_vae._conv(W, ops.f64(f_hat), "post_quant_conv"))


def decode(W, f_hat):
    """fhat_to_img: clamp(decoder(post_quant_conv(f_hat)), -1, 1), NHWC
    [N, side * 2^(levels-1), ..., 3] (B4)."""
    return np.clip(decode_unclamped(W, f_hat), -1.0, 1.0)

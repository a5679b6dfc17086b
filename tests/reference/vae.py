"""Float64 reference of MAR's KL-16 VAE decoder (mar.md section 8), NHWC.

Generic over ch, ch_mult, num_res_blocks and z_channels, which are read back
from the weight shapes; decode() checks that the weights hold exactly the key
set of that configuration (section 9: strict=False loading hides missing keys).
"""
import math
from collections import OrderedDict

import numpy as np

from . import ops

GN_GROUPS = 32          # section 8.1: Normalize = GroupNorm(32, eps 1e-6)
GN_EPS = 1e-6
LATENT_SCALE = 0.2325   # section 1.2 / 2: the VAE gets tokens / 0.2325
DEFAULT_CONFIG = dict(ch=128, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=2, z=16, out_ch=3)
OFFICIAL_KEY_COUNT = 166
OFFICIAL_PARAM_COUNT = 38189203


# ==========================================================================
# Keys and shapes (section 8.3, Appendix B)
# ==========================================================================

def _resnet_shapes(prefix, cin, cout):
    s = [(prefix + ".norm1.weight", (cin,)), (prefix + ".norm1.bias", (cin,)),
         (prefix + ".conv1.weight", (cout, cin, 3, 3)), (prefix + ".conv1.bias", (cout,)),
         (prefix + ".norm2.weight", (cout,)), (prefix + ".norm2.bias", (cout,)),
         (prefix + ".conv2.weight", (cout, cout, 3, 3)), (prefix + ".conv2.bias", (cout,))]
    if cin != cout:
        s += [(prefix + ".nin_shortcut.weight", (cout, cin, 1, 1)),
              (prefix + ".nin_shortcut.bias", (cout,))]
    return s


def _attn_shapes(prefix, c):
    s = [(prefix + ".norm.weight", (c,)), (prefix + ".norm.bias", (c,))]
    for n in ("q", "k", "v", "proj_out"):
        s += [(prefix + "." + n + ".weight", (c, c, 1, 1)), (prefix + "." + n + ".bias", (c,))]
    return s


def level_channels(ch, ch_mult, num_res_blocks):
    """{level: [(cin, cout) per ResnetBlock]} following the execution order
    up.(n-1) -> up.0 (section 8.2): block_in starts at ch * ch_mult[-1]."""
    out, block_in = {}, ch * ch_mult[-1]
    for level in reversed(range(len(ch_mult))):
        block_out = ch * ch_mult[level]
        pairs = []
        for _ in range(num_res_blocks + 1):
            pairs.append((block_in, block_out))
            block_in = block_out
        out[level] = pairs
    return out


def vae_shapes(ch=128, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=2, z=16, out_ch=3):
    """OrderedDict key -> shape of post_quant_conv + decoder, in
    state_dict order (Appendix B for the default configuration)."""
    s = [("post_quant_conv.weight", (z, z, 1, 1)), ("post_quant_conv.bias", (z,))]
    return OrderedDict(s + decoder_shapes(ch, ch_mult, num_res_blocks, z, out_ch, _attn_shapes, False))


def decoder_shapes(ch, ch_mult, num_res_blocks, z, out_ch, attn_shapes, top_level_attention):
    """[(key, shape)] of decoder.* in state_dict order: conv_in, the mid blocks, the up
    levels (with an attention block after each ResnetBlock of the top level when
    `top_level_attention`, as VAR's VQVAE has), norm_out and conv_out. `attn_shapes`
    (prefix, channels) gives an attention block's tensors."""
    top = ch * ch_mult[-1]
    s = [("decoder.conv_in.weight", (top, z, 3, 3)), ("decoder.conv_in.bias", (top,))]
    s += _resnet_shapes("decoder.mid.block_1", top, top)
    s += attn_shapes("decoder.mid.attn_1", top)
    s += _resnet_shapes("decoder.mid.block_2", top, top)
    chans = level_channels(ch, ch_mult, num_res_blocks)
    levels = len(ch_mult)
    for level in range(levels):
        for b, (cin, cout) in enumerate(chans[level]):
            s += _resnet_shapes("decoder.up.%d.block.%d" % (level, b), cin, cout)
            if top_level_attention and level == levels - 1:
                s += attn_shapes("decoder.up.%d.attn.%d" % (level, b), cout)
        if level != 0:
            c = chans[level][-1][1]
            s += [("decoder.up.%d.upsample.conv.weight" % level, (c, c, 3, 3)),
                  ("decoder.up.%d.upsample.conv.bias" % level, (c,))]
    bottom = ch * ch_mult[0]
    s += [("decoder.norm_out.weight", (bottom,)), ("decoder.norm_out.bias", (bottom,)),
          ("decoder.conv_out.weight", (out_ch, bottom, 3, 3)), ("decoder.conv_out.bias", (out_ch,))]
    return s


def random_vae_weights(rng, ch=128, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=2, z=16, out_ch=3,
                       scale=1.0):
    """Random decoder weights with the official names (float32). Conv
    weights ~ N(0, scale^2 / fan_in); biases ~ N(0, 0.05^2); GroupNorm
    weights ~ 1 + N(0, 0.05^2). For the default configuration this is
    exactly the 166 keys of Appendix B."""
    shapes = vae_shapes(ch, ch_mult, num_res_blocks, z, out_ch)
    if tuple(ch_mult) == DEFAULT_CONFIG["ch_mult"] and (ch, num_res_blocks, z, out_ch) == (128, 2, 16, 3):
        assert len(shapes) == OFFICIAL_KEY_COUNT
    return OrderedDict((name, random_decoder_tensor(rng, name, shape, scale)) for name, shape in shapes.items())


def random_decoder_tensor(rng, name, shape, scale=1.0):
    """One random decoder tensor (float32): conv weights ~ N(0, scale^2 / fan_in),
    GroupNorm weights ~ 1 + N(0, 0.05^2), biases ~ N(0, 0.05^2). The VQVAE's decoder
    draws its tensors the same way."""
    zn = rng.standard_normal(shape)
    if len(shape) == 4:
        val = scale * zn / math.sqrt(shape[1] * shape[2] * shape[3])
    elif name.endswith(".weight"):
        val = 1.0 + 0.05 * zn
    else:
        val = 0.05 * zn
    return val.astype(np.float32)


def vae_config(W):
    """(ch, ch_mult, num_res_blocks, z, out_ch) read back from the shapes."""
    levels = sorted({int(k.split(".")[2]) for k in W if k.startswith("decoder.up.")})
    if levels != list(range(len(levels))) or not levels:
        raise ValueError("decoder.up levels must be 0..n-1")
    return dict(decoder_levels_config(W, levels), z=W["decoder.conv_in.weight"].shape[1],
                out_ch=W["decoder.conv_out.weight"].shape[0])


def decoder_levels_config(W, levels):
    """dict(ch, ch_mult, num_res_blocks) of an LDM decoder read back from its up levels'
    shapes (the KL-16 VAE's and the VQVAE's decoders alike)."""
    outs = [W["decoder.up.%d.block.0.conv1.weight" % L].shape[0] for L in levels]
    ch = 0
    for c in outs:
        ch = math.gcd(ch, int(c))
    nblocks = sum(1 for k in W if k.startswith("decoder.up.0.block.") and k.endswith(".norm1.weight"))
    return dict(ch=ch, ch_mult=tuple(int(c) // ch for c in outs), num_res_blocks=nblocks - 1)


def check_shapes(W, want, what):
    """Raise unless W holds every key of `want` ({name: shape}) with that shape."""
    for name, shape in want.items():
        if name not in W:
            raise KeyError("missing %s key %s" % (what, name))
        if tuple(W[name].shape) != shape:
            raise ValueError("%s key %s has shape %s, want %s" % (what, name, W[name].shape, shape))


def check_keys(W):
    """Raise unless W holds exactly the keys/shapes of its configuration
    (extra keys such as encoder.* are ignored)."""
    want = vae_shapes(**vae_config(W))
    check_shapes(W, want, "VAE")
    extra = [k for k in W if (k.startswith("decoder.") or k.startswith("post_quant_conv."))
             and k not in want]
    if extra:
        raise KeyError("unexpected VAE keys: %s" % extra[:5])


# ==========================================================================
# Forward (section 8.1-8.2), NHWC float64
# ==========================================================================

def _p(W, name):
    return ops.f64(W[name])


def _conv(W, x, prefix):
    return ops.conv2d(x, _p(W, prefix + ".weight"), _p(W, prefix + ".bias"))


def _norm(W, x, prefix, swish, groups):
    return ops.groupnorm(x, groups, _p(W, prefix + ".weight"), _p(W, prefix + ".bias"),
                         GN_EPS, swish=swish)


def resnet_block(W, x, prefix, groups=GN_GROUPS):
    """ResnetBlock: h = conv1(swish(norm1 x)); h = conv2(swish(norm2 h));
    skip = nin_shortcut(x) (1x1) if present else x; return skip + h."""
    h = _conv(W, _norm(W, x, prefix + ".norm1", True, groups), prefix + ".conv1")
    h = _conv(W, _norm(W, h, prefix + ".norm2", True, groups), prefix + ".conv2")
    skip = _conv(W, x, prefix + ".nin_shortcut") if prefix + ".nin_shortcut.weight" in W else x
    return skip + h


def attn_block(W, x, prefix, groups=GN_GROUPS):
    """AttnBlock: single head over the H*W positions (row-major), scale
    C^-0.5, x + proj_out(softmax(q k^T * scale) v)."""
    n, hgt, wid, c = x.shape
    hn = _norm(W, x, prefix + ".norm", False, groups)
    q, k, v = (_conv(W, hn, prefix + "." + s).reshape(n, hgt * wid, c) for s in ("q", "k", "v"))
    o = ops.attention(q, [(k, v)], heads=1, scale=c ** -0.5).reshape(n, hgt, wid, c)
    return x + _conv(W, o, prefix + ".proj_out")


def vae_decoder(W, z, groups=GN_GROUPS):
    """decoder.* on a post_quant_conv output z [N, h, w, z_ch] (section 8.2):
    conv_in, mid (block_1, attn_1, block_2), up levels n-1 .. 0 (ResnetBlocks,
    then nearest x2 + conv for levels != 0), norm_out + swish, conv_out.
    No tanh or clamp. Returns [N, H, W, out_ch]."""
    h = _conv(W, z, "decoder.conv_in")
    h = resnet_block(W, h, "decoder.mid.block_1", groups)
    h = attn_block(W, h, "decoder.mid.attn_1", groups)
    h = resnet_block(W, h, "decoder.mid.block_2", groups)
    cfg = vae_config(W)
    for level in reversed(range(len(cfg["ch_mult"]))):
        for b in range(cfg["num_res_blocks"] + 1):
            h = resnet_block(W, h, "decoder.up.%d.block.%d" % (level, b), groups)
        if level != 0:
            h = _conv(W, ops.upsample_nearest2x(h), "decoder.up.%d.upsample.conv" % level)
    h = _norm(W, h, "decoder.norm_out", True, groups)
    return _conv(W, h, "decoder.conv_out")


def unpatchify(tokens):
    """Section 2 (p = 1): tokens [N, S, c] -> latent NHWC [N, h, w, c] with
    token l = row * w + col (h = w = sqrt(S)). NCHW would be the transpose."""
    tokens = ops.f64(tokens)
    n, s, c = tokens.shape
    side = math.isqrt(s)
    if side * side != s:
        raise ValueError("token count must be a square")
    return tokens.reshape(n, side, side, c)


def decode(W, tokens, groups=GN_GROUPS):
    """Section 7.2 end + 8: tokens [N, S, 16] -> unpatchify -> / 0.2325 ->
    post_quant_conv (1x1) -> decoder. Returns the image NHWC float64
    [N, 16*sqrt(S), ..., 3] (for the official config), nominally in [-1, 1]."""
    check_keys(W)
    latent = unpatchify(tokens) / LATENT_SCALE
    return vae_decoder(W, _conv(W, latent, "post_quant_conv"), groups)


def to_uint8(x):
    """Section 8.4: round_half_even(clip((x + 1) / 2 * 255, 0, 255)) as uint8.
    (The reference does this in float16; here it is float64.)"""
    y = (ops.f64(x) + 1.0) / 2.0 * 255.0
    return np.round(np.clip(y, 0.0, 255.0)).astype(np.uint8)

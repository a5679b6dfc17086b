"""The LDM-style convolutional decoder that MAR's KL-16 VAE and VAR's VQVAE share
(``spec/mar.md`` 8.3, ``spec/var_fastvar.md`` B4-B5): its expected key set, its
configuration read back from the shapes, and splitting it from the encoder side."""
import collections
import math

from .checks import _count, _dim, _first, _wrong_kind
from .tensors import CheckpointError


def _resnet_shapes(prefix, cin, cout):
    s = [(f"{prefix}.norm1.weight", (cin,)), (f"{prefix}.norm1.bias", (cin,)),
         (f"{prefix}.conv1.weight", (cout, cin, 3, 3)), (f"{prefix}.conv1.bias", (cout,)),
         (f"{prefix}.norm2.weight", (cout,)), (f"{prefix}.norm2.bias", (cout,)),
         (f"{prefix}.conv2.weight", (cout, cout, 3, 3)), (f"{prefix}.conv2.bias", (cout,))]
    if cin != cout:
        s += [(f"{prefix}.nin_shortcut.weight", (cout, cin, 1, 1)), (f"{prefix}.nin_shortcut.bias", (cout,))]
    return s


def _attn_shapes(prefix, c, fused_qkv):
    s = [(f"{prefix}.norm.weight", (c,)), (f"{prefix}.norm.bias", (c,))]
    if fused_qkv:   # VAR's VQVAE AttnBlock: one qkv conv c -> 3c (var_fastvar.md B4)
        s += [(f"{prefix}.qkv.weight", (3 * c, c, 1, 1)), (f"{prefix}.qkv.bias", (3 * c,))]
    else:           # LDM / MAR KL-16 AttnBlock: q, k, v convs (mar.md 8.1)
        for n in ("q", "k", "v"):
            s += [(f"{prefix}.{n}.weight", (c, c, 1, 1)), (f"{prefix}.{n}.bias", (c,))]
    s += [(f"{prefix}.proj_out.weight", (c, c, 1, 1)), (f"{prefix}.proj_out.bias", (c,))]
    return s


def decoder_expected_shapes(ch, ch_mult, num_res_blocks, z_channels, post_quant_ks, fused_qkv, top_attention,
                            out_ch=3):
    """key -> shape of post_quant_conv + an LDM-style decoder: MAR's KL-16
    (mar.md 8.3 / Appendix B: post_quant 1x1, q/k/v attention in the mid block
    only, 166 tensors) or VAR's VQVAE (var_fastvar.md B4/B5: post_quant 3x3,
    fused qkv, attention also after every block of the top level, 178 + 2)."""
    top = ch * ch_mult[-1]
    z = z_channels
    k = post_quant_ks
    s = [("post_quant_conv.weight", (z, z, k, k)), ("post_quant_conv.bias", (z,)),
         ("decoder.conv_in.weight", (top, z, 3, 3)), ("decoder.conv_in.bias", (top,))]
    s += _resnet_shapes("decoder.mid.block_1", top, top)
    s += _attn_shapes("decoder.mid.attn_1", top, fused_qkv)
    s += _resnet_shapes("decoder.mid.block_2", top, top)
    levels = len(ch_mult)
    block_in = top
    per_level = {}
    for level in reversed(range(levels)):
        out = ch * ch_mult[level]
        entries = []
        for b in range(num_res_blocks + 1):
            entries += _resnet_shapes(f"decoder.up.{level}.block.{b}", block_in, out)
            block_in = out
            if top_attention and level == levels - 1:
                entries += _attn_shapes(f"decoder.up.{level}.attn.{b}", out, fused_qkv)
        if level != 0:
            entries += [(f"decoder.up.{level}.upsample.conv.weight", (out, out, 3, 3)),
                        (f"decoder.up.{level}.upsample.conv.bias", (out,))]
        per_level[level] = entries
    for level in range(levels):
        s += per_level[level]
    bottom = ch * ch_mult[0]
    s += [("decoder.norm_out.weight", (bottom,)), ("decoder.norm_out.bias", (bottom,)),
          ("decoder.conv_out.weight", (out_ch, bottom, 3, 3)), ("decoder.conv_out.bias", (out_ch,))]
    return collections.OrderedDict(s)


def _decoder_config(path, sd, kind):
    """(ch, ch_mult, num_res_blocks, z) of an LDM-style decoder, read back from shapes.
    ch is the gcd of the level widths (the rule of csrc/models/vae.c)."""
    z = _first(_dim(sd, "post_quant_conv.weight", 0), _dim(sd, "decoder.conv_in.weight", 1))
    levels = _count(sd, "decoder.up.")
    if z is None or levels == 0:
        raise _wrong_kind(path, kind, sd)
    widths = []
    for level in range(levels):
        w = _first(_dim(sd, f"decoder.up.{level}.block.0.conv1.weight", 0),
                   _dim(sd, f"decoder.up.{level}.block.0.norm2.weight", 0))
        if w is None:
            raise CheckpointError(f"{path}: missing decoder.up.{level}.block.0.conv1.weight, so the width of decoder "
                                  f"level {level} is unknown")
        widths.append(w)
    ch = 0
    for w in widths:
        ch = math.gcd(ch, w)
    nrb = max(_count(sd, f"decoder.up.{level}.block.") for level in range(levels)) - 1
    return ch, tuple(w // ch for w in widths), nrb, z


def _split_decoder(sd):
    keep = collections.OrderedDict((k, v) for k, v in sd.items()
                                   if k.startswith("decoder.") or k.startswith("post_quant_conv."))
    return keep, [k for k in sd if k not in keep]


def _dropped_summary(dropped):
    groups = collections.OrderedDict()
    for k in dropped:
        groups.setdefault(k.split(".", 1)[0], []).append(k)
    return ", ".join(f"{g}.* ({len(ks)})" if len(ks) > 1 else ks[0] for g, ks in groups.items())

"""Kind ``vae-kl16``: MAR's KL-16 VAE, of which only the decoder is kept (``spec/mar.md``
sections 8 and 9). LDM kl-f16 weights, which have up-path attention, are refused."""
import collections

from .checks import Plan, _check_float, _compare, _sniff_kind, _state_dict, _wrong_kind
from .decoder import _decoder_config, _dropped_summary, _split_decoder, decoder_expected_shapes
from .tensors import CheckpointError


def plan_vae_kl16(ck):
    """MAR's KL-16 VAE (mar.md 8, 9): keeps post_quant_conv.* + decoder.*, which must be
    exactly the decoder of the config read back from the shapes (166 tensors for
    the released kl16.ckpt). Refuses LDM kl-f16 weights (up-path attention)."""
    path = ck.path
    sd, where = _state_dict(ck.root, path, prefer=("model", "state_dict"))
    if _sniff_kind(sd) not in (None, "vae-kl16"):   # before the LDM check: a VQVAE also has up-path attention
        raise _wrong_kind(path, "vae-kl16", sd, where)
    attn = [k for k in sd if k.startswith("decoder.up.") and ".attn." in k]
    if attn:
        raise CheckpointError(
            f"{path}: the decoder has up-path attention ({attn[0]}, {len(attn)} such tensors): these are LDM kl-f16 "
            "weights, not MAR's KL-16 VAE, whose decoder has attention only in the mid block (mar.md 8.1). The two "
            "are not interchangeable: LDM weights would load partially and decode wrongly. Use MAR's kl16.ckpt.")
    if any(k.startswith("first_stage_model.") for k in sd):
        raise CheckpointError(f"{path}: keys start with 'first_stage_model.': this is a whole latent-diffusion model, "
                              "not MAR's kl16.ckpt")
    keep, dropped = _split_decoder(sd)
    if not keep:
        raise _wrong_kind(path, "vae-kl16", sd, where)
    ch, ch_mult, nrb, z = _decoder_config(path, keep, "vae-kl16")
    expected = decoder_expected_shapes(ch, ch_mult, nrb, z, post_quant_ks=1, fused_qkv=False, top_attention=False)
    official = (ch, ch_mult, nrb, z) == (128, (1, 1, 2, 2, 4), 2, 16)
    inside = f"['{where}']" if where else ""
    _compare(path + inside, f"KL-16 decoder key set (mar.md 8.3) for ch={ch}, ch_mult={ch_mult}, "
             f"num_res_blocks={nrb}, z_channels={z}", expected, keep)
    _check_float(path, keep)
    tensors = collections.OrderedDict((k, keep[k]) for k in expected)
    meta = {"ch": ch, "ch_mult": ",".join(map(str, ch_mult)), "num_res_blocks": nrb, "z_channels": z,
            "official_config": "yes" if official else "no", "weights": where or "(top level)"}
    notes = [f"KL-16 decoder: ch {ch}, ch_mult {ch_mult}, num_res_blocks {nrb}, z {z}"
             + ("" if official else " (not the released kl16 config)")]
    if dropped:
        notes.append(f"dropped (encoder side): {_dropped_summary(dropped)}")
    return Plan("vae-kl16", tensors, meta, dropped, notes)

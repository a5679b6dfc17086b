"""Kind ``vqvae``: VAR's VQVAE, of which the decoding tensors are kept (decoder,
codebook, the Phi convs; ``spec/var_fastvar.md`` B5)."""
import collections

from .checks import Plan, _check_float, _compare, _count, _dim, _state_dict, _wrong_kind
from .decoder import _decoder_config, _dropped_summary, _split_decoder, decoder_expected_shapes


def plan_vqvae(ck):
    """VAR's VQVAE (var_fastvar.md B5): keeps the decoding tensors (decoder.*,
    post_quant_conv.*, quantize.embedding.weight, the Phi convs; 189 for
    vae_ch160v4096z32.pth); the encoder side and training statistics are dropped."""
    path = ck.path
    sd, where = _state_dict(ck.root, path, prefer=("model", "state_dict"))
    if "quantize.embedding.weight" not in sd:
        raise _wrong_kind(path, "vqvae", sd, where)
    keep, dropped = _split_decoder(sd)
    if not keep:
        raise _wrong_kind(path, "vqvae", sd, where)
    ch, ch_mult, nrb, z = _decoder_config(path, keep, "vqvae")
    vocab = _dim(sd, "quantize.embedding.weight", 0)
    n_phi = _count(sd, "quantize.quant_resi.qresi_ls.")
    expected = decoder_expected_shapes(ch, ch_mult, nrb, z, post_quant_ks=3, fused_qkv=True, top_attention=True)
    expected["quantize.embedding.weight"] = (vocab, z)
    for i in range(n_phi):
        expected[f"quantize.quant_resi.qresi_ls.{i}.weight"] = (z, z, 3, 3)
        expected[f"quantize.quant_resi.qresi_ls.{i}.bias"] = (z,)
    for k in list(dropped):
        if k in expected:
            keep[k] = sd[k]
            dropped.remove(k)
    others = [k for k in dropped if not (k.startswith("encoder.") or k.startswith("quant_conv.") or
                                         k == "quantize.ema_vocab_hit_SV")]
    for k in others:     # unknown keys are errors, not silently dropped
        keep[k] = sd[k]
        dropped.remove(k)
    if n_phi == 0:
        expected["quantize.quant_resi.qresi_ls.0.weight"] = (z, z, 3, 3)
        expected["quantize.quant_resi.qresi_ls.0.bias"] = (z,)
    official = (ch, ch_mult, nrb, z, vocab, n_phi) == (160, (1, 1, 2, 2, 4), 2, 32, 4096, 4)
    _compare(path, f"VQVAE decoding key set (var_fastvar.md B5) for ch={ch}, ch_mult={ch_mult}, "
             f"num_res_blocks={nrb}, z_channels={z}, vocab={vocab}, {n_phi} Phi convs", expected, keep)
    _check_float(path, keep)
    tensors = collections.OrderedDict((k, keep[k]) for k in expected)
    meta = {"ch": ch, "ch_mult": ",".join(map(str, ch_mult)), "num_res_blocks": nrb, "z_channels": z,
            "vocab": vocab, "num_phi": n_phi, "quant_resi": "0.5", "official_config": "yes" if official else "no"}
    notes = [f"VQVAE: ch {ch}, ch_mult {ch_mult}, vocab {vocab} x {z}, {n_phi} Phi convs"
             + ("" if official else " (not the released vae_ch160v4096z32 config)")]
    if dropped:
        notes.append(f"dropped (encoder side, training statistics): {_dropped_summary(dropped)}")
    return Plan("vqvae", tensors, meta, dropped, notes)

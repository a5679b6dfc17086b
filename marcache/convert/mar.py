"""Kind ``mar``: the MAR transformer and diffusion head (``spec/mar.md`` sections 4
and 9, Appendix A). The configuration is read back from the shapes; attention
heads, which the weights do not hold, come from the released widths or ``heads``."""
import collections

from .checks import Plan, _check_float, _compare, _count, _dim, _first, _sniff_kind, _state_dict, _vote, _wrong_kind
from .tensors import CheckpointError


def _block_shapes(prefix, dim, hidden):
    """One timm Block (mar.md 3.1): 12 tensors."""
    return [(f"{prefix}.norm1.weight", (dim,)), (f"{prefix}.norm1.bias", (dim,)),
            (f"{prefix}.attn.qkv.weight", (3 * dim, dim)), (f"{prefix}.attn.qkv.bias", (3 * dim,)),
            (f"{prefix}.attn.proj.weight", (dim, dim)), (f"{prefix}.attn.proj.bias", (dim,)),
            (f"{prefix}.norm2.weight", (dim,)), (f"{prefix}.norm2.bias", (dim,)),
            (f"{prefix}.mlp.fc1.weight", (hidden, dim)), (f"{prefix}.mlp.fc1.bias", (hidden,)),
            (f"{prefix}.mlp.fc2.weight", (dim, hidden)), (f"{prefix}.mlp.fc2.bias", (dim,))]


def mar_expected_shapes(width, depth, head_width, head_depth, decoder_width=None, decoder_depth=None,
                        seq_len=256, buffer_size=64, token_channels=16, num_classes=1000, mlp_hidden=None,
                        decoder_mlp_hidden=None):
    """key -> shape of a MAR state_dict (mar.md section 4, Appendix A; 364 / 476 /
    604 tensors for MAR-B / L / H). There are no buffers."""
    D, W, C = width, head_width, token_channels
    Dd = decoder_width or D
    dd = decoder_depth or depth
    L = seq_len + buffer_size
    h = "diffloss.net."
    s = [("fake_latent", (1, D)), ("encoder_pos_embed_learned", (1, L, D)), ("mask_token", (1, 1, Dd)),
         ("decoder_pos_embed_learned", (1, L, Dd)), ("diffusion_pos_embed_learned", (1, seq_len, Dd)),
         ("class_emb.weight", (num_classes, D)), ("z_proj.weight", (D, C)), ("z_proj.bias", (D,)),
         ("z_proj_ln.weight", (D,)), ("z_proj_ln.bias", (D,))]
    for i in range(depth):
        s += _block_shapes(f"encoder_blocks.{i}", D, mlp_hidden or 4 * D)
    s += [("encoder_norm.weight", (D,)), ("encoder_norm.bias", (D,)),
          ("decoder_embed.weight", (Dd, D)), ("decoder_embed.bias", (Dd,))]
    for i in range(dd):
        s += _block_shapes(f"decoder_blocks.{i}", Dd, decoder_mlp_hidden or 4 * Dd)
    s += [("decoder_norm.weight", (Dd,)), ("decoder_norm.bias", (Dd,)),
          (h + "time_embed.mlp.0.weight", (W, 256)), (h + "time_embed.mlp.0.bias", (W,)),
          (h + "time_embed.mlp.2.weight", (W, W)), (h + "time_embed.mlp.2.bias", (W,)),
          (h + "cond_embed.weight", (W, Dd)), (h + "cond_embed.bias", (W,)),
          (h + "input_proj.weight", (W, C)), (h + "input_proj.bias", (W,))]
    for j in range(head_depth):
        p = f"{h}res_blocks.{j}."
        s += [(p + "in_ln.weight", (W,)), (p + "in_ln.bias", (W,)),
              (p + "mlp.0.weight", (W, W)), (p + "mlp.0.bias", (W,)),
              (p + "mlp.2.weight", (W, W)), (p + "mlp.2.bias", (W,)),
              (p + "adaLN_modulation.1.weight", (3 * W, W)), (p + "adaLN_modulation.1.bias", (3 * W,))]
    s += [(h + "final_layer.linear.weight", (2 * C, W)), (h + "final_layer.linear.bias", (2 * C,)),
          (h + "final_layer.adaLN_modulation.1.weight", (2 * W, W)),
          (h + "final_layer.adaLN_modulation.1.bias", (2 * W,))]
    return collections.OrderedDict(s)


#: The released MAR configurations (mar.md 1.1).
MAR_CONFIGS = {
    "mar_base": dict(width=768, depth=12, heads=12, head_width=1024, head_depth=6),
    "mar_large": dict(width=1024, depth=16, heads=16, head_width=1280, head_depth=8),
    "mar_huge": dict(width=1280, depth=20, heads=16, head_width=1536, head_depth=12),
}
#: Attention heads are not in the weights (mar.md 4.2): the released widths.
MAR_HEADS_FOR_WIDTH = {768: 12, 1024: 16, 1280: 16}


def plan_mar(ck, weights="model_ema", heads=None):
    """MAR (mar.md 4, 9): ckpt[weights] with every key and shape of the config read
    back from the shapes; records depth / width / heads / head size."""
    path = ck.path
    root = ck.root
    if weights not in ("model_ema", "model"):
        raise ValueError(f"weights must be 'model_ema' or 'model', got {weights!r}")
    if isinstance(root, dict) and weights in root:
        sd, where = _state_dict(root, path, prefer=(weights,))
    elif isinstance(root, dict) and "class_emb.weight" in root:
        sd, where = _state_dict(root, path, prefer=())
    else:
        keys = list(root) if isinstance(root, dict) else type(root).__name__
        hint = ""
        if isinstance(root, dict):
            inner = next((root[k] for k in ("model", "model_ema", "state_dict") if isinstance(root.get(k), dict)), root)
            found = _sniff_kind(inner)
            if found == "mar":
                other = "model" if weights == "model_ema" else "model_ema"
                hint = f" It has '{other}': pass --weights {other} (weights='{other}')."
            elif found:
                hint = f" It looks like a '{found}' checkpoint: use `convert {found}`."
        raise CheckpointError(f"{path}: no '{weights}' entry (top-level keys: {keys}); a MAR checkpoint-last.pth "
                              f"holds 'model' and 'model_ema'.{hint}")
    dropped = [k for k in root if k != where] if where else []
    h = "diffloss.net."
    D = _vote(_dim(sd, "class_emb.weight", 1), _dim(sd, "fake_latent", 1), _dim(sd, "z_proj.weight", 0),
              _dim(sd, "encoder_norm.weight", 0), _dim(sd, "encoder_pos_embed_learned", 2),
              _dim(sd, "decoder_embed.weight", 1))
    W = _vote(_dim(sd, h + "input_proj.weight", 0), _dim(sd, h + "time_embed.mlp.0.weight", 0),
              _dim(sd, h + "cond_embed.weight", 0), _dim(sd, h + "final_layer.linear.weight", 1))
    depth = _count(sd, "encoder_blocks.")
    if D is None or W is None or depth == 0:
        raise _wrong_kind(path, "mar", sd, where)
    Dd = _first(_vote(_dim(sd, "decoder_embed.weight", 0), _dim(sd, "decoder_norm.weight", 0),
                      _dim(sd, "mask_token", 2), _dim(sd, h + "cond_embed.weight", 1),
                      _dim(sd, "diffusion_pos_embed_learned", 2)), D)
    S = _first(_dim(sd, "diffusion_pos_embed_learned", 1), 256)
    L = _first(_vote(_dim(sd, "encoder_pos_embed_learned", 1), _dim(sd, "decoder_pos_embed_learned", 1)), S + 64)
    final = _dim(sd, h + "final_layer.linear.weight", 0)
    cfg = dict(width=D, depth=depth, decoder_width=Dd, decoder_depth=_count(sd, "decoder_blocks."),
               head_width=W, head_depth=_count(sd, h + "res_blocks."), seq_len=S, buffer_size=L - S,
               token_channels=_first(_vote(_dim(sd, "z_proj.weight", 1), _dim(sd, h + "input_proj.weight", 1),
                                           final // 2 if final else None), 16),
               num_classes=_first(_dim(sd, "class_emb.weight", 0), 1000),
               mlp_hidden=_first(_dim(sd, "encoder_blocks.0.mlp.fc1.weight", 0), 4 * D),
               decoder_mlp_hidden=_first(_dim(sd, "decoder_blocks.0.mlp.fc1.weight", 0), 4 * Dd))
    expected = mar_expected_shapes(**cfg)
    name = next((n for n, c in MAR_CONFIGS.items() if all(cfg[k] == c[k] for k in
                                                           ("width", "depth", "head_width", "head_depth"))
                 and cfg["decoder_width"] == c["width"] and cfg["decoder_depth"] == c["depth"]), None)
    where_txt = f"['{where}']" if where else ""
    _compare(path + where_txt, f"MAR key set (mar.md section 4) for width {D}, depth {depth}+{cfg['decoder_depth']}, "
             f"head {W}x{cfg['head_depth']}", expected, sd)
    _check_float(path, sd)
    if heads is not None:
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
            raise ValueError(f"heads must be a positive integer, got {heads!r}")
        enc_heads = dec_heads = heads
    else:
        enc_heads, dec_heads = MAR_HEADS_FOR_WIDTH.get(D), MAR_HEADS_FOR_WIDTH.get(Dd)
        if enc_heads is None or dec_heads is None:
            raise CheckpointError(f"{path}: width {D if enc_heads is None else Dd} is not one of the released MAR "
                                  "configs (768, 1024, 1280) and attention heads are not stored in the weights "
                                  "(mar.md 4.2): pass --heads N (heads=N)")
    for w, h in ((D, enc_heads), (Dd, dec_heads)):
        if w % h:
            raise CheckpointError(f"{path}: width {w} is not divisible by {h} heads")
    tensors = collections.OrderedDict((k, sd[k]) for k in expected)
    meta = {"config": name or "custom", "weights": where or "(top level)", "width": D, "depth": depth,
            "decoder_width": Dd, "decoder_depth": cfg["decoder_depth"], "heads": enc_heads,
            "decoder_heads": dec_heads, "head_dim": D // enc_heads, "head_width": W, "head_depth": cfg["head_depth"],
            "mlp_hidden": cfg["mlp_hidden"], "seq_len": S, "buffer_size": L - S,
            "token_channels": cfg["token_channels"], "num_classes": cfg["num_classes"]}
    notes = [f"MAR {name or 'custom config'}: width {D}, depth {depth}+{cfg['decoder_depth']}, heads {enc_heads} "
             f"(head dim {D // enc_heads}), diffusion head {W} x {cfg['head_depth']}, from '{meta['weights']}'"]
    return Plan("mar", tensors, meta, dropped, notes)

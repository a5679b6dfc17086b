"""Kind ``var``: the VAR transformer (``spec/var_fastvar.md`` A2-A3); its derivable
buffers are checked and then not written."""
import collections
import math

import numpy as np

from .checks import Plan, _check_float, _compare, _count, _dim, _first, _state_dict, _wrong_kind
from .tensors import CheckpointError


def var_expected_shapes(depth, width, heads, vocab=4096, tokens=680, vae_channels=32, num_classes=1000,
                        num_levels=10, ffn_hidden=None):
    """key -> (shape, dtype) of a VAR transformer state_dict (var_fastvar.md A3):
    12 + 13 * depth keys, buffers included (lvl_1L is int64)."""
    C, L = width, tokens
    hidden = ffn_hidden or 4 * C
    s = [("pos_start", (1, 1, C)), ("pos_1LC", (1, L, C)), ("lvl_1L", (1, L)),
         ("attn_bias_for_masking", (1, 1, L, L)), ("word_embed.weight", (C, vae_channels)),
         ("word_embed.bias", (C,)), ("class_emb.weight", (num_classes + 1, C)), ("lvl_embed.weight", (num_levels, C)),
         ("head_nm.ada_lin.1.weight", (2 * C, C)), ("head_nm.ada_lin.1.bias", (2 * C,)),
         ("head.weight", (vocab, C)), ("head.bias", (vocab,))]
    for i in range(depth):
        p = f"blocks.{i}."
        s += [(p + "attn.scale_mul_1H11", (1, heads, 1, 1)), (p + "attn.q_bias", (C,)), (p + "attn.v_bias", (C,)),
              (p + "attn.zero_k_bias", (C,)), (p + "attn.mat_qkv.weight", (3 * C, C)),
              (p + "attn.proj.weight", (C, C)), (p + "attn.proj.bias", (C,)),
              (p + "ffn.fc1.weight", (hidden, C)), (p + "ffn.fc1.bias", (hidden,)),
              (p + "ffn.fc2.weight", (C, hidden)), (p + "ffn.fc2.bias", (C,)),
              (p + "ada_lin.1.weight", (6 * C, C)), (p + "ada_lin.1.bias", (6 * C,))]
    return collections.OrderedDict(s)


#: The released models' scales (var_fastvar.md A1), the loader's default when a file has
#: no ``patch_nums`` metadata.
DEFAULT_PATCH_NUMS = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)


def _patch_nums(path, sd, tokens, num_levels):
    """The side of each scale's token map, read from the lvl_1L buffer (the scale index
    of every token: scale i holds pn_i^2 consecutive tokens). A checkpoint whose
    buffer cannot be read (a test's stand-in) with the released 680 tokens in 10
    scales has the released patch_nums."""
    lvl = sd.get("lvl_1L")
    if lvl is None or not hasattr(lvl, "numpy"):
        if (tokens, num_levels) == (sum(p * p for p in DEFAULT_PATCH_NUMS), len(DEFAULT_PATCH_NUMS)):
            return DEFAULT_PATCH_NUMS
        raise CheckpointError(f"{path}: lvl_1L cannot be read, so the scales of its {tokens} tokens in "
                              f"{num_levels} levels are unknown")
    values = np.asarray(lvl.numpy()).reshape(-1).astype(np.int64)
    counts = np.bincount(values, minlength=num_levels) if values.size and values.min() >= 0 else None
    sides = [math.isqrt(int(n)) for n in counts] if counts is not None else []
    if counts is None or len(counts) != num_levels or np.any(np.diff(values) < 0) or \
            any(s * s != n or s < 1 for s, n in zip(sides, counts)):
        raise CheckpointError(f"{path}: lvl_1L is not a scale index per token (0, 1, 1, 1, 1, 2, ...: ascending, "
                              f"every one of the {num_levels} levels a square number of tokens)")
    return tuple(sides)


def _var_is_buffer(name):
    return name in ("lvl_1L", "attn_bias_for_masking") or name.endswith(".attn.zero_k_bias")


def plan_var(ck):
    """VAR transformer (var_fastvar.md A2, A3): a flat state dict of 12 + 13 * depth keys.
    All keys and shapes are checked; the buffers lvl_1L, attn_bias_for_masking and
    blocks.*.attn.zero_k_bias are derivable and are not written."""
    path = ck.path
    sd, where = _state_dict(ck.root, path, prefer=("model", "state_dict"))
    C = _first(_dim(sd, "pos_start", 2), _dim(sd, "word_embed.weight", 0), _dim(sd, "class_emb.weight", 1))
    depth = _count(sd, "blocks.")
    if C is None or depth == 0 or "word_embed.weight" not in sd:
        raise _wrong_kind(path, "var", sd, where)
    heads = _first(_dim(sd, "blocks.0.attn.scale_mul_1H11", 1), depth)
    cfg = dict(depth=depth, width=C, heads=heads, vocab=_first(_dim(sd, "head.weight", 0), 4096),
               tokens=_first(_dim(sd, "pos_1LC", 1), 680), vae_channels=_first(_dim(sd, "word_embed.weight", 1), 32),
               num_classes=_first(_dim(sd, "class_emb.weight", 0), 1001) - 1,
               num_levels=_first(_dim(sd, "lvl_embed.weight", 0), 10),
               ffn_hidden=_first(_dim(sd, "blocks.0.ffn.fc1.weight", 0), 4 * C))
    expected = var_expected_shapes(**cfg)
    _compare(path, f"VAR key set (var_fastvar.md A3) for depth {depth}, width {C}, {heads} heads", expected, sd)
    if C % heads:
        raise CheckpointError(f"{path}: width {C} is not divisible by {heads} heads")
    patch_nums = _patch_nums(path, sd, cfg["tokens"], cfg["num_levels"])
    official = (C == 64 * depth and heads == depth and cfg["vocab"] == 4096 and patch_nums == DEFAULT_PATCH_NUMS and
                cfg["vae_channels"] == 32 and cfg["num_classes"] == 1000)
    tensors = collections.OrderedDict((k, sd[k]) for k in expected if not _var_is_buffer(k))
    _check_float(path, tensors)
    dropped = [k for k in sd if k not in tensors]
    meta = {"depth": depth, "width": C, "heads": heads, "head_dim": C // heads, "ffn_hidden": cfg["ffn_hidden"],
            "vocab": cfg["vocab"], "tokens": cfg["tokens"], "vae_channels": cfg["vae_channels"],
            "num_classes": cfg["num_classes"], "num_levels": cfg["num_levels"],
            "patch_nums": ",".join(map(str, patch_nums)), "shared_aln": "false",
            "attn_l2_norm": "true", "official_config": "yes" if official else "no"}
    notes = [f"VAR depth {depth}: width {C}, {heads} heads (head dim {C // heads}), vocab {cfg['vocab']}, "
             f"{cfg['tokens']} tokens in scales {','.join(map(str, patch_nums))}"
             + ("" if official else " (not a released d16/d20/d24/d30 config)"),
             f"dropped buffers: {len(dropped)} (lvl_1L, attn_bias_for_masking, blocks.*.attn.zero_k_bias)"]
    return Plan("var", tensors, meta, dropped, notes)

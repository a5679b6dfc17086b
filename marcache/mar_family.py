"""The MAR model family's FLOP model: one function per block kind, the same
rules as the engine's csrc/runtime/flops.c (GEMMs and attention matmuls, 2 FLOPs
per multiply-add; tests/test_policy_seams.py holds the two equal for every
policy). A cache policy's module composes these into its own step model."""

FAMILY = "mar"


def attn(n_seq, q_rows, keys, dim):
    """qkv + proj of q_rows rows per sequence, attention against `keys` rows."""
    rows = n_seq * q_rows
    return 2 * rows * dim * 3 * dim + 2 * rows * dim * dim + 4 * rows * keys * dim


def mlp(rows, dim, hidden):
    return 4 * rows * dim * hidden


def encoder(c, n_seq, new_tokens, q_rows, keys):
    """z_proj of `new_tokens` tokens, the encoder blocks on q_rows rows against `keys`
    rows, and decoder_embed of the q_rows rows: (encoder, decoder_embed)."""
    D = c["width"]
    enc = 2 * n_seq * new_tokens * c["token_channels"] * D + \
        c["depth"] * (attn(n_seq, q_rows, keys, D) + mlp(n_seq * q_rows, D, c["mlp_hidden"]))
    return enc, 2 * n_seq * q_rows * D * c["decoder_width"]


def decoder_layers(c, n_seq, q_rows, keys, layers, read=None):
    """`layers` decoder blocks on q_rows rows per sequence attending to `keys` rows;
    the last of them read at `read` rows per sequence (read_block)."""
    Dd, hidden = c["decoder_width"], c["decoder_mlp_hidden"]
    if layers <= 0:
        return 0
    whole = attn(n_seq, q_rows, keys, Dd) + mlp(n_seq * q_rows, Dd, hidden)
    return (layers - 1) * whole + read_block(n_seq, q_rows, read, keys, Dd, hidden)


def read_block(n_seq, q_rows, read, keys, dim, hidden):
    """A block whose outputs are read at `read` of its q_rows rows per sequence (the
    decoder's last block, csrc mc_mar_block_read_rows): k and v of every row; q,
    attention, proj and the MLP of the read rows. read None, <= 0 or >= q_rows: the
    whole block."""
    if read is None or read <= 0 or read >= q_rows:
        return attn(n_seq, q_rows, keys, dim) + mlp(n_seq * q_rows, dim, hidden)
    rows, out = n_seq * q_rows, n_seq * read
    return 2 * rows * dim * 2 * dim + 2 * out * dim * dim + 4 * out * keys * dim + 2 * out * dim * dim + \
        mlp(out, dim, hidden)


def plain_transformer(c, n_seq, known, read=None):
    """(encoder, decoder) FLOPs of the uncached transformer with `known` known tokens,
    its last decoder block read at `read` rows per sequence (None: every row)."""
    P, S = c["buffer_size"], c["seq_len"]
    enc_len, L = P + known, P + S
    enc, embed = encoder(c, n_seq, known, enc_len, enc_len)
    return enc, embed + decoder_layers(c, n_seq, L, L, c["decoder_depth"], read)


def head_eval(c, rows, x_rows, mode, skip=(0, -1), reference=False):
    """One head evaluation; mode is "plain", "store", "recompute" or "reuse".
    reference=True counts what the official PyTorch code computes: the time
    embedding MLP and cond_embed for every row at every evaluation, input_proj
    on both CFG halves, and the whole adaLN Linear of blocks whose MLP output
    is reused."""
    W, C, Dd = c["head_width"], c["token_channels"], c["decoder_width"]
    f = 2 * (rows if reference else x_rows) * C * W
    if reference:
        f += rows * (2 * 256 * W + 2 * W * W + 2 * Dd * W)
    for j in range(c["head_depth"]):
        skipped = mode != "plain" and skip[0] <= j <= skip[1]
        if skipped and mode in ("recompute", "reuse"):
            continue
        if mode == "reuse":
            f += (6 if reference else 2) * rows * W * W
        else:
            f += 10 * rows * W * W
    return f + 4 * rows * W * W + 4 * rows * W * C


def head_modes(diffusion_steps, head_cache):
    """The head-cache mode of each diffusion index j, first step first (as the
    engine's runtime/head_cache.c plans them); head_cache None: all "plain"."""
    modes = []
    for j in range(diffusion_steps - 1, -1, -1):
        if head_cache is None:
            modes.append("plain")
        elif j == diffusion_steps - 1 or j % head_cache.head_period == 0:
            modes.append("store")
        else:
            modes.append("recompute" if j > head_cache.head_recompute_above * diffusion_steps else "reuse")
    return modes


def head(c, live, cfg_on, diffusion_steps, head_cache=None, reference=False):
    """FLOPs of one AR step's head sampling of `live` tokens. head_cache: an object
    with LazyMAR's head fields (head_period, head_skip_first, head_skip_last,
    head_recompute_above), or None without the head cache."""
    rows = 2 * live if cfg_on else live
    f = 0 if reference else 2 * rows * c["decoder_width"] * c["head_width"]
    skip = (head_cache.head_skip_first, head_cache.head_skip_last) if head_cache is not None else (0, -1)
    for mode in head_modes(diffusion_steps, head_cache):
        if mode in ("plain", "store"):
            f += head_eval(c, rows, live, mode, skip, reference)
        else:
            f += head_eval(c, live, live, mode, skip, reference)
    return f

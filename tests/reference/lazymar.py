"""Float64 reference of LazyMAR inference (feihongyan1/LazyMAR), written from
/work/shared/spec/lazymar.md (sections 2-7) on top of the plain MAR reference
(mar.py, /work/shared/spec/mar.md), with marcache's documented conventions
(marcache.LazyMAR docstring):

* Step s is full iff s < start or (s - start) % period == 0 (section 3);
  step 0 is therefore always full.
* Retention entry floor(s * 64 / steps) (capped at 63); kept rows per cached
  sequence n = min(P+S, max(m + p + margin, floor((P+S) * float32(r)))),
  m = tokens predicted now, p = tokens predicted at the previous step that
  predicted anything (0 at step 0).
* Cached sequences: CFG with cond_cache -> the B conditional ones; CFG
  without cond_cache -> all 2B (each with its own caches); cfg == 1 -> the B
  sequences, condition cache off.
* Tokens predicted now and at the previous step are always kept (marcache
  never drops them, unlike the official code's corner case of section 5.3
  item 5); the other rows are ranked by (score, row index) ascending.
* Head cache (section 7) with head_period, head_skip_first..head_skip_last
  and head_recompute_above as parameters; the noise draws are exactly those
  of the plain sampler (Philox, mar.head_sample).

Orders, noise, cfg_iter, respacing and the DDPM step are mar.py's.
Everything is float64; weights are read as float64 at use.
"""
import numpy as np

from . import mar as R
from . import ops, philox

LN_EPS = R.LN_EPS
HEAD = R.HEAD

# lazymar.md 5.4, the 64-step retention table, written out (not read from marcache):
# steps 0-19 1.0, 20 0.6, 21-24 0.5, 25-29 0.4, 30-34 0.15, 35-39 0.12, 40-63 0.05.
RETENTION_64 = (
    1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0,   # 0-15
    1.0, 1.0, 1.0, 1.0, 0.6, 0.5, 0.5, 0.5, 0.5, 0.4, 0.4, 0.4, 0.4, 0.4, 0.15, 0.15,  # 16-31
    0.15, 0.15, 0.15, 0.12, 0.12, 0.12, 0.12, 0.12, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05,  # 32-47
    0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05,  # 48-63
)


# ==========================================================================
# Transformer pieces (mar.md section 3.1) split at the points LazyMAR needs
# ==========================================================================

def _w(W, name):
    return ops.f64(W[name])


def _qkv(W, prefix, x):
    """LN1 and the QKV projection of a block: returns q, k, v [..., rows, dim]."""
    dim = x.shape[-1]
    a = ops.layernorm(x, _w(W, prefix + ".norm1.weight"), _w(W, prefix + ".norm1.bias"), R.ln_eps("norm1"))
    qkv = ops.linear(a, _w(W, prefix + ".attn.qkv.weight"), _w(W, prefix + ".attn.qkv.bias"))
    return qkv[..., :dim], qkv[..., dim:2 * dim], qkv[..., 2 * dim:]


def _attn_residual(W, prefix, x, q, k, v, heads):
    """x + proj(attention(q, k, v)); k, v may have more rows than q."""
    o = ops.attention(q, [(k, v)], heads)
    return ops.linear(o, _w(W, prefix + ".attn.proj.weight"), _w(W, prefix + ".attn.proj.bias"),
                      beta=1.0, y=x)


def _mlp_residual(W, prefix, x):
    """x + MLP(LN2 x)."""
    m = ops.layernorm(x, _w(W, prefix + ".norm2.weight"), _w(W, prefix + ".norm2.bias"), R.ln_eps("norm2"))
    m = ops.linear(m, _w(W, prefix + ".mlp.fc1.weight"), _w(W, prefix + ".mlp.fc1.bias"), act=ops.ACT_GELU)
    return ops.linear(m, _w(W, prefix + ".mlp.fc2.weight"), _w(W, prefix + ".mlp.fc2.bias"), beta=1.0, y=x)


def _block(W, prefix, x, heads):
    """Plain timm block (same maths as mar.block); returns (x_out, k, v)."""
    q, k, v = _qkv(W, prefix, x)
    x = _attn_residual(W, prefix, x, q, k, v, heads)
    return _mlp_residual(W, prefix, x), k, v


def _depths(W):
    enc = sum(1 for n in W if n.startswith("encoder_blocks.") and n.endswith(".norm1.weight"))
    dec = sum(1 for n in W if n.startswith("decoder_blocks.") and n.endswith(".norm1.weight"))
    return enc, dec


def _encoder_front(W, tokens, cls_vec, positions, P):
    """Encoder front-end (mar.md 3.2 steps 1-4) for selected rows only.

    tokens [nseq, S, C], cls_vec [nseq, D], positions [nseq, K] (image
    positions, per sequence). Returns the rows [buffer 0..P-1 | 64 + positions]
    after z_proj / buffer fill, pos-embed and z_proj_ln: [nseq, P + K, D]."""
    tokens = ops.f64(tokens)
    cls_vec = ops.f64(cls_vec)
    positions = np.asarray(positions, dtype=np.int64)
    nseq, K = positions.shape
    pos = _w(W, "encoder_pos_embed_learned")[0]
    buf = cls_vec[:, None, :] + pos[:P][None]
    rows_tok = tokens[np.arange(nseq)[:, None], positions]                     # [nseq, K, C]
    y = ops.linear(rows_tok, _w(W, "z_proj.weight"), _w(W, "z_proj.bias")) + pos[P + positions]
    h = np.concatenate([buf, y], axis=1)
    return ops.layernorm(h, _w(W, "z_proj_ln.weight"), _w(W, "z_proj_ln.bias"), R.ln_eps("z_proj_ln"))


def _decoder_input_rows(W, E, rows):
    """decoder_embed of encoder-output rows plus decoder_pos_embed at their
    sequence rows (0..P-1 buffer, P + position). E [nseq, r, D], rows [nseq, r]."""
    g = ops.linear(E, _w(W, "decoder_embed.weight"), _w(W, "decoder_embed.bias"))
    return g + _w(W, "decoder_pos_embed_learned")[0][np.asarray(rows, dtype=np.int64)]


def _known_positions(mask):
    """[nseq, K] ascending known positions (mask 0); equal K per row."""
    mask = np.asarray(mask).astype(bool)
    rows = [np.flatnonzero(~m) for m in mask]
    if len({len(r) for r in rows}) != 1:
        raise ValueError("every row must have the same number of known tokens")
    return np.stack(rows).astype(np.int64).reshape(len(rows), -1)


def encoder_full(W, tokens, mask, cls_vec, heads):
    """Plain MAR encoder (mar.md 3.2) and the decoder input (3.3 steps 1-3).
    Returns dict: dec_in [nseq, P+S, D], enc_k/enc_v (per encoder layer, rows
    buffer then known positions in raster order), enc_rows (P + known)."""
    S = W["diffusion_pos_embed_learned"].shape[1]
    P = W["encoder_pos_embed_learned"].shape[1] - S
    enc_depth, _ = _depths(W)
    nseq = tokens.shape[0]
    known = _known_positions(mask)
    h = _encoder_front(W, tokens, cls_vec, known, P)
    enc_k, enc_v = [], []
    for i in range(enc_depth):
        h, k, v = _block(W, "encoder_blocks.%d" % i, h, heads)
        enc_k.append(k)
        enc_v.append(v)
    E = ops.layernorm(h, _w(W, "encoder_norm.weight"), _w(W, "encoder_norm.bias"), R.ln_eps("encoder_norm"))
    D = _w(W, "decoder_embed.weight").shape[0]
    rows = np.concatenate([np.broadcast_to(np.arange(P), (nseq, P)), P + known], axis=1)
    x = np.broadcast_to(_w(W, "mask_token")[0] + _w(W, "decoder_pos_embed_learned")[0],
                        (nseq, P + S, D)).copy()
    x[np.arange(nseq)[:, None], rows] = _decoder_input_rows(W, E, rows)
    return dict(dec_in=x, enc_k=enc_k, enc_v=enc_v, enc_rows=P + known.shape[1])


def full_transformer(W, tokens, mask, cls_vec, heads):
    """The plain MAR transformer (mar.md 3.2-3.3) keeping what LazyMAR caches.

    tokens [nseq, S, C], mask [nseq, S] (True = unknown), cls_vec [nseq, D].
    Returns dict: x (last decoder block output, pre-norm, [nseq, P+S, D]),
    dec_in (decoder input after embed, mask fill and pos-embed), enc_k/enc_v
    (per encoder layer [nseq, P+K, D], rows buffer then known tokens in raster
    order), dec_k/dec_v (per decoder layer [nseq, P+S, D]), enc_rows (P+K)."""
    front = encoder_full(W, tokens, mask, cls_vec, heads)
    _, dec_depth = _depths(W)
    x = front["dec_in"]
    dec_in = x.copy()
    enc_k, enc_v = front["enc_k"], front["enc_v"]
    dec_k, dec_v = [], []
    for i in range(dec_depth):
        x, k, v = _block(W, "decoder_blocks.%d" % i, x, heads)
        dec_k.append(k)
        dec_v.append(v)
    return dict(x=x, dec_in=dec_in, enc_k=enc_k, enc_v=enc_v, dec_k=dec_k, dec_v=dec_v,
                enc_rows=front["enc_rows"])


def condition_rows(W, x, rows_seq, rows_pos):
    """z = decoder_norm(x[seq, P + pos]) + diffusion_pos_embed[pos] (mar.md 3.3
    steps 5-7) for the given (sequence, position) rows. Returns [n, Dd]."""
    S = W["diffusion_pos_embed_learned"].shape[1]
    P = W["encoder_pos_embed_learned"].shape[1] - S
    sel = x[rows_seq, P + rows_pos]
    z = ops.layernorm(sel, _w(W, "decoder_norm.weight"), _w(W, "decoder_norm.bias"), R.ln_eps("decoder_norm"))
    return z + _w(W, "diffusion_pos_embed_learned")[0][rows_pos]


# ==========================================================================
# Diffusion head with its cache (lazymar.md section 7)
# ==========================================================================

def _head_cond(W, t, c):
    """SiLU(t_emb + cond_embed(c)) for rows c [n, Dd] at original timestep t."""
    w = lambda n: _w(W, HEAD + n)  # noqa: E731
    n = c.shape[0]
    tf = np.broadcast_to(R.timestep_embedding(t), (n, R.FREQ_DIM))
    t_emb = ops.linear(tf, w("time_embed.mlp.0.weight"), w("time_embed.mlp.0.bias"), act=ops.ACT_SILU)
    t_emb = ops.linear(t_emb, w("time_embed.mlp.2.weight"), w("time_embed.mlp.2.bias"))
    c_emb = ops.linear(c, w("cond_embed.weight"), w("cond_embed.bias"))
    return ops.silu(t_emb + c_emb)


def _head_modulation(W, j, y_act):
    r = HEAD + "res_blocks.%d." % j
    m = ops.linear(y_act, _w(W, r + "adaLN_modulation.1.weight"), _w(W, r + "adaLN_modulation.1.bias"))
    width = m.shape[-1] // 3
    return m[:, :width], m[:, width:2 * width], m[:, 2 * width:]


def _head_mlp(W, j, h, shift, scale):
    """The res block's MLP output (mlp.2 output, before the gate)."""
    r = HEAD + "res_blocks.%d." % j
    u = ops.layernorm(h, _w(W, r + "in_ln.weight"), _w(W, r + "in_ln.bias"), R.ln_eps("head_in_ln"),
                      shift=shift, scale=scale)
    u = ops.linear(u, _w(W, r + "mlp.0.weight"), _w(W, r + "mlp.0.bias"), act=ops.ACT_SILU)
    return ops.linear(u, _w(W, r + "mlp.2.weight"), _w(W, r + "mlp.2.bias"))


def _head_final(W, h, y_act):
    w = lambda n: _w(W, HEAD + n)  # noqa: E731
    m = ops.linear(y_act, w("final_layer.adaLN_modulation.1.weight"), w("final_layer.adaLN_modulation.1.bias"))
    width = h.shape[-1]
    u = ops.layernorm(h, None, None, R.ln_eps("head_final"), shift=m[:, :width], scale=m[:, width:])
    return ops.linear(u, w("final_layer.linear.weight"), w("final_layer.linear.bias"))


def _head_depth(W):
    return sum(1 for n in W if n.startswith(HEAD + "res_blocks.") and n.endswith(".in_ln.weight"))


def head_forward(W, x, t, c, capture=None):
    """SimpleMLPAdaLN forward (mar.md 5.1; same maths as mar.head_net).

    With capture (a dict), stores per res block j: capture["mlp"][j] (MLP
    output before the gate) and capture["delta"][j] (h_out - h_in)."""
    y_act = _head_cond(W, t, c)
    h = ops.linear(ops.f64(x), _w(W, HEAD + "input_proj.weight"), _w(W, HEAD + "input_proj.bias"))
    if capture is not None:
        capture.setdefault("mlp", {})
        capture.setdefault("delta", {})
    for j in range(_head_depth(W)):
        shift, scale, gate = _head_modulation(W, j, y_act)
        u = _head_mlp(W, j, h, shift, scale)
        h_new = ops.gated_add(h, u, gate)
        if capture is not None:
            capture["mlp"][j] = u
            capture["delta"][j] = h_new - h
        h = h_new
    return _head_final(W, h, y_act)


def head_forward_cached(W, x, t, c, cache, j_index, num_steps, lz):
    """A cached head timestep (lazymar.md section 7): conditional rows only.

    Skipped blocks (head_skip_first..head_skip_last) add their stored delta;
    the others recompute their MLP (overwriting the stored output) when
    j_index > head_recompute_above * num_steps, else reuse it with the gate of
    now. The final layer is always computed. Returns [n, 2C]."""
    y_act = _head_cond(W, t, c)
    h = ops.linear(ops.f64(x), _w(W, HEAD + "input_proj.weight"), _w(W, HEAD + "input_proj.bias"))
    recompute = j_index > lz.head_recompute_above * num_steps - (1 if R.mutated("head_recompute_off_by_one") else 0)
    if R.mutated("head_never_recompute"):
        recompute = False
    skip_last = lz.head_skip_last + (1 if R.mutated("head_skip_off_by_one") else 0)
    for j in range(_head_depth(W)):
        if lz.head_skip_first <= j <= skip_last:
            h = h + cache["delta"][j]
            continue
        shift, scale, gate = _head_modulation(W, j, y_act)
        if recompute:
            cache["mlp"][j] = _head_mlp(W, j, h, shift, scale)
        h = ops.gated_add(h, cache["mlp"][j], gate)
    return _head_final(W, h, y_act)


def _cached_step_v(v, eps, v_full, delta_v, cfg_on, cfg_scale):
    """v of a cached head timestep: the conditional rows' own, just computed. The
    variants (tests/mutations.py): "cached_v_cfg" guidance also on v with the v
    difference of the last full timestep; "cached_v_stale" the v of the last full
    timestep; "cached_v_from_eps" the eps columns; "cached_v_ignored" v = -1."""
    if R.mutated("cached_v_cfg") and cfg_on:
        v = v + (float(cfg_scale) - 1.0) * delta_v
    if R.mutated("cached_v_stale"):
        v = v_full
    if R.mutated("cached_v_from_eps"):
        v = eps
    if R.mutated("cached_v_ignored"):
        v = -np.ones_like(v)
    return v


def head_sample_lazymar(W, z_cond, z_uncond, images, positions, seed, temperature, cfg_scale, tables, lz):
    """DiffLoss.sample (mar.md 6.5) with the LazyMAR head cache when
    lz.head_cache (else exactly the plain sampler). z_cond [n, Dd], z_uncond
    [n, Dd] or None (no CFG). Returns (x float64 [n, C], number of cached
    timesteps)."""
    images = np.asarray(images, dtype=np.int64).reshape(-1)
    positions = np.asarray(positions, dtype=np.int64).reshape(-1)
    n = len(positions)
    ch = W[HEAD + "input_proj.weight"].shape[1]
    cfg_on = z_uncond is not None
    T = len(tables["timesteps"])
    x = ops.f64(philox.token_normals(seed, images, positions, philox.STREAM_HEAD_INIT, 0, ch))
    cache = {}
    delta_eps = delta_v = v_full = None
    cached_evals = 0
    for j in range(T - 1, -1, -1):
        t = int(tables["timesteps"][j])
        full = (not lz.head_cache) or j == T - 1 or j % lz.head_period == 0
        if full:
            cap = {}
            if cfg_on:
                out = head_forward(W, np.concatenate([x, x]), t, np.concatenate([z_cond, z_uncond]), cap)
                eps, v = R.guided_eps_v(out[:n], out[n:], cfg_scale, ch)
                delta_eps = out[:n, :ch] - out[n:, :ch]
                delta_v = out[:n, ch:2 * ch] - out[n:, ch:2 * ch]
                if R.mutated("head_cfg_delta_reversed"):
                    delta_eps = -delta_eps
            else:
                out = head_forward(W, x, t, z_cond, cap)
                eps, v = R.guided_eps_v(out, None, cfg_scale, ch)
            v_full = v
            keep = slice(n, 2 * n) if R.mutated("head_cache_from_uncond") and cfg_on else slice(0, n)
            cache = dict(mlp={j_: u[keep] for j_, u in cap["mlp"].items()},
                         delta={j_: d[keep] for j_, d in cap["delta"].items()})
        else:
            cached_evals += 1
            out = head_forward_cached(W, x, t, z_cond, cache, j, T, lz)
            e_c, v = out[:, :ch], out[:, ch:2 * ch]
            eps = e_c + (float(cfg_scale) - 1.0) * delta_eps if cfg_on else e_c
            v = _cached_step_v(v, eps, v_full, delta_v, cfg_on, cfg_scale)
        noise = R.step_noise(seed, images, positions, j, ch)
        x = ops.ddpm_step(x, eps, v, noise, R.ddpm_coefs(tables, j, temperature))
    return x, cached_evals


# ==========================================================================
# The AR loop with the token and condition caches (lazymar.md sections 3-6)
# ==========================================================================

def is_full_step(lz, s):
    """Section 3: full iff s < start or (s - start) % period == 0."""
    return s < lz.start or (s - lz.start) % lz.period == 0


def keep_count(lz, s, steps, m, p, rows):
    """Kept decoder rows per cached sequence (section 5.3 item 3, marcache
    conventions): table index floor(s * 64 / steps) (at most 63)."""
    s_table = s - 1 if R.mutated("retention_step_off_by_one") else s
    r = lz.retention[min(63, (s_table * 64) // steps)]
    by_table = int(np.floor(rows * float(np.float32(r))))
    return min(rows, max(m + p + lz.margin, by_table))


def select_rows(score, forced, n):
    """Forced rows first, then the others by ascending (score, row index),
    until n; returned ascending. Also returns the score gap at the boundary
    (first dropped minus last taken non-forced score; inf if none dropped
    or none taken)."""
    rows = np.arange(len(score))
    forced = np.unique(np.asarray(forced, dtype=np.int64))
    free = np.setdiff1d(rows, forced)
    order = free[np.lexsort((free, score[free]))]
    take = n - len(forced)
    assert take >= 0
    chosen = np.sort(np.concatenate([forced, order[:take]])).astype(np.int64)
    gap = np.inf
    if 0 < take < len(order):
        gap = float(score[order[take]] - score[order[take - 1]])
    return chosen, gap


def cfg_sequences(W, labels_or_None, num_images, cfg, cond_cache):
    """The sequences a cache-policy reference runs (shared by the LazyMAR and
    MARche references): (cfg_on, use_cond, nseq, cls [nseq, D], seq_img [nseq]),
    rows 0..B-1 conditional, B..2B-1 unconditional (fake_latent) with CFG."""
    B = int(num_images)
    cfg_on = cfg != 1.0
    use_cond = bool(cond_cache) and cfg_on
    nseq = 2 * B if cfg_on else B
    cls = R.class_vectors(W, labels_or_None, B)
    if cfg_on:
        cls = np.concatenate([cls, np.repeat(_w(W, "fake_latent"), B, axis=0)])
    return cfg_on, use_cond, nseq, cls, np.arange(nseq) % B


def cond_diff(x, B):
    """The condition cache's difference x_uncond - x_cond at the last decoder block
    (lazymar.md 4; marche.md uses the same). Variant "cond_diff_reversed": x_cond - x_uncond."""
    diff = x[B:] - x[:B]
    return -diff if R.mutated("cond_diff_reversed") else diff


def step_masks(mask, orders, mask_len, last):
    """(mask after this step, tokens predicted now) from the mask before it."""
    mask_next = np.zeros_like(mask)
    mask_next[np.arange(mask.shape[0])[:, None], orders[:, :mask_len]] = True
    return mask_next, (mask.copy() if last else mask & ~mask_next)


def sample_predicted(W, x_c, x_u, pred, tokens, cfg_iter, first_index, seed, temperature, tables, policy):
    """Conditions the head on the predicted rows of x_c (and x_u with CFG), samples
    them with the policy's head cache and writes them into tokens. Returns the
    number of cached head timesteps."""
    rows_b, rows_pos = np.nonzero(pred)
    z_c = condition_rows(W, x_c, rows_b, rows_pos)
    z_u = condition_rows(W, x_u, rows_b, rows_pos) if x_u is not None else None
    sampled, head_cached = head_sample_lazymar(W, z_c, z_u, first_index + rows_b, rows_pos, seed, temperature,
                                               cfg_iter, tables, policy)
    tokens[rows_b, rows_pos] = sampled.astype(np.float32)
    return head_cached


def finish_step(W, log, entry, x_c, x_u, pred, n_pred, prev_pred, p_prev, tokens, cfg_iter, first_index, seed,
                temperature, tables, policy):
    """The end of an AR step of a token-cache policy (LazyMAR, MARche): the head samples
    the n_pred predicted tokens per image (sample_predicted) and the step's entry is
    logged. Returns (prev_pred, p_prev) for the next step: the positions predicted at the
    last step that predicted anything, and their count per image."""
    assert pred.sum() == len(pred) * n_pred
    head_cached = 0
    if n_pred > 0:
        head_cached = sample_predicted(W, x_c, x_u, pred, tokens, cfg_iter, first_index, seed, temperature, tables,
                                       policy)
        prev_pred, p_prev = pred.copy(), n_pred
    entry.update(cfg_iter=cfg_iter, head_cached=head_cached)
    log.append(entry)
    return prev_pred, p_prev


def generate_tokens_lazymar(W, labels_or_None, num_images, steps, cfg, cfg_schedule, temperature, seed,
                            first_index, heads, lz, tables=None):
    """MAR sampling with LazyMAR (lazymar.md), Philox orders and noise as in
    mar.generate_tokens. lz: a marcache.LazyMAR (fields read: token_cache,
    cond_cache, head_cache, start, period, retention, select_layer, margin,
    head_period, head_skip_first, head_skip_last, head_recompute_above).

    Returns (tokens float32 [N, S, C], log) with one dict per step: step,
    full, n_pred, cfg_iter, kept (list per cached sequence of the kept decoder
    rows 0..P+S-1 ascending; None unless a token-cache step), n_keep (rows per
    sequence from the select layer's MLP onwards), sequences (sequences
    through the transformer), encoder_rows (encoder query rows per layer,
    summed over sequences), head_cached (cached head timesteps), select_gap
    (smallest score gap at the selection boundary over the cached sequences)
    and, on token-cache steps, select_gaps (that gap per cached sequence)."""
    sz = R.model_sizes(W)
    S, C, P = sz["seq_len"], sz["token_channels"], sz["buffer"]
    L = P + S
    _, dec_depth = _depths(W)
    sel = int(lz.select_layer)
    if sel >= dec_depth:
        raise ValueError("select_layer must be < decoder depth")
    B = int(num_images)
    if tables is None:
        tables = R.diffusion_tables()
    cfg_on, use_cond, nseq, cls, seq_img = cfg_sequences(W, labels_or_None, B, cfg, lz.cond_cache)
    if lz.token_cache:
        cached = np.arange(B) if (use_cond or not cfg_on) else np.arange(2 * B)
    else:
        cached = np.arange(0)
    nc = len(cached)

    tokens = np.zeros((B, S, C), dtype=np.float32)
    mask = np.ones((B, S), dtype=bool)
    orders = R.generation_orders(seed, first_index, B, S)
    st = {}                                  # caches
    prev_pred = np.zeros((B, S), dtype=bool)  # predicted at the last step that predicted anything
    p_prev = 0
    log = []
    for k, (m_before, mask_len, n_pred) in enumerate(R.mask_schedule(S, steps)):
        assert np.all(mask.sum(axis=1) == m_before)
        mask_next, pred = step_masks(mask, orders, mask_len, k == steps - 1)
        full = is_full_step(lz, k)
        entry = dict(step=k, full=full, n_pred=n_pred, kept=None, n_keep=L, select_gap=np.inf)
        tok_seq = ops.f64(tokens)[seq_img]
        mask_seq = mask[seq_img]
        x_c = x_u = None
        if full:
            out = full_transformer(W, tok_seq, mask_seq, cls, heads)
            x = out["x"]
            x_c = x[:B]
            x_u = x[B:] if cfg_on else None
            if nc:
                st["enc_k"] = [kk[cached].copy() for kk in out["enc_k"]]
                st["enc_v"] = [vv[cached].copy() for vv in out["enc_v"]]
                st["enc_known"] = ~mask.copy()
                st["dec_in"] = out["dec_in"][cached].copy()
                st["dec_k"] = {l: out["dec_k"][l][cached].copy() for l in range(sel + 1, dec_depth)}
                st["dec_v"] = {l: out["dec_v"][l][cached].copy() for l in range(sel + 1, dec_depth)}
                st["v_prev"] = out["dec_v"][sel][cached].copy()
            if use_cond:
                st["diff"] = cond_diff(x, B)
            entry.update(sequences=nseq, encoder_rows=nseq * out["enc_rows"])
        elif nc:
            x_tc, info = _token_cache_step(W, st, tokens, mask, pred, prev_pred, cls[cached],
                                           seq_img[cached], heads, sel, dec_depth,
                                           keep_count(lz, k, steps, n_pred, p_prev, L), P, S)
            x_c = x_tc[:B]
            if cfg_on:
                x_u = x_c + st["diff"] if use_cond else x_tc[B:2 * B]
            entry.update(info)
        else:
            run = np.arange(B) if use_cond else np.arange(nseq)
            out = full_transformer(W, tok_seq[run], mask_seq[run], cls[run], heads)
            x_c = out["x"][:B]
            if cfg_on:
                x_u = x_c + st["diff"] if use_cond else out["x"][B:]
            entry.update(sequences=len(run), encoder_rows=len(run) * out["enc_rows"])

        mask = mask_next
        cfg_iter = R.cfg_schedule(cfg, cfg_schedule, mask_len, S) if cfg_on else 1.0
        prev_pred, p_prev = finish_step(W, log, entry, x_c, x_u, pred, n_pred, prev_pred, p_prev, tokens, cfg_iter,
                                        first_index, seed, temperature, tables, lz)
    return tokens, log


def cached_encoder(W, st, tokens, mask, prev_pred, cls_c, img_c, heads, P):
    """The cached encoder (section 5.1) on the cached sequences: buffer rows + the
    tokens revealed since the last encoder pass, against the per-layer encoder K/V
    cache; updates st["dec_in"] at those rows. MARche's encoder cache is this one.
    Returns the encoder query rows per sequence (P + p)."""
    nc = len(img_c)
    known = ~mask
    new = known & ~st["enc_known"]
    if not np.array_equal(new, prev_pred):
        raise NotImplementedError("the reference assumes every step predicts at least one token")
    new_pos = _known_positions(~new)[img_c]                                   # [nc, p] ascending
    h = _encoder_front(W, ops.f64(tokens)[img_c], cls_c, new_pos, P)
    for i in range(len(st["enc_k"])):
        pre = "encoder_blocks.%d" % i
        q, kk, vv = _qkv(W, pre, h)
        Kc, Vc = st["enc_k"][i], st["enc_v"][i]
        Kc[:, :P] = kk[:, :P]
        Vc[:, :P] = vv[:, :P]
        Kc = np.concatenate([Kc, kk[:, P:]], axis=1)
        Vc = np.concatenate([Vc, vv[:, P:]], axis=1)
        st["enc_k"][i], st["enc_v"][i] = Kc, Vc
        h = _attn_residual(W, pre, h, q, Kc, Vc, heads)
        h = _mlp_residual(W, pre, h)
    st["enc_known"] = known.copy()
    E = ops.layernorm(h, _w(W, "encoder_norm.weight"), _w(W, "encoder_norm.bias"), R.ln_eps("encoder_norm"))
    rows = np.concatenate([np.broadcast_to(np.arange(P), (nc, P)), P + new_pos], axis=1)
    st["dec_in"][np.arange(nc)[:, None], rows] = _decoder_input_rows(W, E, rows)
    return P + new_pos.shape[1]


def _token_cache_step(W, st, tokens, mask, pred, prev_pred, cls_c, img_c, heads, sel, dec_depth, n_keep, P, S):
    """One cached step with the token cache (sections 5.1-5.5) on the cached
    sequences (class vectors cls_c, images img_c). Updates st in place.
    Returns (x [nc, P+S, D] with the kept rows of the last decoder block
    output, zeros elsewhere; log fields)."""
    nc = len(img_c)
    L = P + S
    # ---- 5.1 encoder: buffer rows + tokens revealed last step, against the K/V cache
    enc_rows = cached_encoder(W, st, tokens, mask, prev_pred, cls_c, img_c, heads, P)
    # ---- 5.2 decoder layers 0..sel-1 and the attention of sel, all rows
    x = st["dec_in"].copy()
    for i in range(sel):
        x, _, _ = _block(W, "decoder_blocks.%d" % i, x, heads)
    pre = "decoder_blocks.%d" % sel
    q, kk, vv = _qkv(W, pre, x)
    x = _attn_residual(W, pre, x, q, kk, vv, heads)
    # ---- 5.3 selection
    forced_mask = pred if R.mutated("lazymar_prev_not_forced") else pred | prev_pred
    kept, gaps = [], []
    for s in range(nc):
        score = ops.cosine_rows(vv[s], st["v_prev"][s], heads)
        if R.mutated("lazymar_rank_descending"):   # keep the most similar rows instead
            score = -score
        forced = P + np.flatnonzero(forced_mask[img_c[s]])
        chosen, gap = select_rows(score, forced, n_keep)
        kept.append(chosen)
        gaps.append(gap)
    if not R.mutated("lazymar_v_prev_stale"):
        st["v_prev"] = vv.copy()
    kept_arr = np.stack(kept)                                                   # [nc, n]
    ar = np.arange(nc)[:, None]
    # ---- 5.5 kept rows only from the select layer's MLP on
    xk = _mlp_residual(W, pre, x[ar, kept_arr])
    for i in range(sel + 1, dec_depth):
        pre = "decoder_blocks.%d" % i
        q, kk, vv = _qkv(W, pre, xk)
        st["dec_k"][i][ar, kept_arr] = kk
        st["dec_v"][i][ar, kept_arr] = vv
        xk = _attn_residual(W, pre, xk, q, st["dec_k"][i], st["dec_v"][i], heads)
        xk = _mlp_residual(W, pre, xk)
    out = np.zeros((nc, L, xk.shape[-1]))
    out[ar, kept_arr] = xk
    info = dict(kept=[r.tolist() for r in kept], n_keep=n_keep, sequences=nc, encoder_rows=nc * enc_rows,
                select_gap=float(min(gaps)) if gaps else np.inf, select_gaps=[float(g) for g in gaps])
    return out, info

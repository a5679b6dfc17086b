"""Float64 reference of MARche inference (Jiang et al., arXiv 2506.12035,
no public code), written from /work/shared/spec/marche.md (sections 1-7) on
top of the plain MAR reference (mar.py, /work/shared/spec/mar.md) and, for the
composed options, the LazyMAR reference (lazymar.py, lazymar.md sections 5.1
and 7), with marcache's documented decisions (marcache.MARche docstring):

* Step s is a full refresh step iff s < refresh_phase or
  (s - refresh_phase) % refresh_period == 0 (step 0 is always full). A full
  step is the plain MAR step; it also stores, per cached sequence, the K/V of
  all P+S rows of every decoder layer with 0-based index >= full_layers (and
  with encoder_cache the per-layer encoder K/V of buffer + known rows and the
  decoder input; with cond_cache and CFG the diff x_uncond - x_cond at the
  last decoder block output, pre-norm).
* Cached sequences: CFG with cond_cache -> the B conditional ones; CFG
  without cond_cache -> all 2B (each selects its own rows); cfg == 1 -> B.
* Cached step: encoder in full on the cached sequences, or with
  encoder_cache LazyMAR's cached encoder (section 5.1). Decoder layers
  0..full_layers-1 on all P+S rows. In layer select_layer-1 (0-based) the
  relevance of key row j is the sum over heads and generating query rows of
  softmax_j(q_i.k_j / sqrt(hd)) (q, k from LN1 of the layer input). Active
  rows = generating + caching (rows predicted at the previous step that
  predicted anything) + the top refresh rows among the candidates (all other
  rows, or with candidates="image" the other rows >= P), ranked by
  relevance descending (refresh="low": ascending), ties to the lower row;
  count min(P+S, min(max(budget, g + c), g + c + candidates)); ascending.
  Layers >= full_layers run on the active rows only: their fresh K/V
  overwrite the layer cache at their rows, then the active queries attend
  over all P+S rows of the updated cache (marche.md 3.2, the "simpler
  equivalent implementation"); proj, residual, MLP on the active rows.
* Generating rows: z = decoder_norm(x) + diffusion_pos_embed; with
  cond_cache z_uncond = decoder_norm(x_cond + diff) + pos, otherwise from the
  unconditional cached sequences.
* Head: the plain sampler, or with head_cache LazyMAR's head cache
  (lazymar.head_sample_lazymar, reading head_period, head_skip_first,
  head_skip_last, head_recompute_above from the MARche config).

Orders, noise, cfg_iter, respacing and the DDPM step are mar.py's.
Everything is float64; weights are read as float64 at use.
"""
import numpy as np

from . import lazymar as LZ
from . import mar as R
from . import ops

LN_EPS = R.LN_EPS
_w = LZ._w


# ==========================================================================
# Schedule and active-set selection (marche.md sections 2, 4)
# ==========================================================================

def is_full_step(mc, s):
    """Full refresh step: s < refresh_phase or (s - refresh_phase) % refresh_period == 0."""
    return s < mc.refresh_phase or (s - mc.refresh_phase) % mc.refresh_period == 0


def active_count(mc, generating, caching, rows, image_rows):
    """Active rows per cached sequence: min(rows, min(max(budget, g + c), g + c + candidates))."""
    forced = generating + caching
    candidates = (image_rows if mc.candidates == "image" else rows) - forced
    return min(rows, min(max(int(mc.budget), forced), forced + candidates))


def relevance(q_gen, k, heads):
    """relevance[b, j] = sum over heads and generating queries of
    softmax_j(q.k_j / sqrt(hd)) over all key rows. q_gen [n, g, D], k [n, L, D]."""
    return ops.attention_mass(q_gen, k, heads)


def rank_candidates(rel, forced, P, candidates="all", refresh="high"):
    """Candidate rows of one sequence in selection order: every row not in
    forced ("all") or every such row >= P ("image"), by (relevance
    descending, row ascending) for refresh="high", (relevance ascending, row
    ascending) for "low"."""
    forced = np.unique(np.asarray(forced, dtype=np.int64))
    cand = np.setdiff1d(np.arange(P if candidates == "image" else 0, len(rel)), forced)
    key = -rel[cand] if refresh == "high" else rel[cand]
    return cand[np.lexsort((cand, key))]


def select_active(rel, forced, n_active, P, candidates="all", refresh="high"):
    """Active rows of one sequence, ascending: the forced rows (generating +
    caching) plus the first n_active - |forced| rows of rank_candidates.

    Also returns the relative relevance gap at the selection boundary,
    |a - b| / max(a, b) for the last taken (a) and the first dropped (b)
    candidate; inf when nothing is dropped or nothing taken. Relative, because
    with refresh="low" the boundary relevances are tiny probabilities."""
    forced = np.unique(np.asarray(forced, dtype=np.int64))
    order = rank_candidates(rel, forced, P, candidates, refresh)
    take = n_active - len(forced)
    assert 0 <= take <= len(order)
    chosen = np.sort(np.concatenate([forced, order[:take]])).astype(np.int64)
    gap = np.inf
    if 0 < take < len(order):
        a, b = float(rel[order[take - 1]]), float(rel[order[take]])
        gap = abs(a - b) / max(abs(a), abs(b), 1e-300)
    return chosen, gap


# ==========================================================================
# Transformer pieces
# ==========================================================================

# Plain MAR encoder and decoder input: the same as LazyMAR's full step computes.
encoder_full = LZ.encoder_full


def decoder_full(W, x, heads):
    """All decoder blocks on all rows. Returns (x_out pre-norm, dec_k, dec_v)."""
    _, dec_depth = LZ._depths(W)
    dec_k, dec_v = [], []
    for i in range(dec_depth):
        x, k, v = LZ._block(W, "decoder_blocks.%d" % i, x, heads)
        dec_k.append(k)
        dec_v.append(v)
    return x, dec_k, dec_v


def cached_decoder(W, st, x, gen_rows, forced_rows, n_active, mc, heads, P):
    """The decoder of a cached step (marche.md 3.1-3.2) on the cached
    sequences. x [nc, P+S, D] decoder input; gen_rows [nc, g] (generating
    rows, ascending); forced_rows: list per sequence of generating + caching
    rows. Updates st["dec_k"], st["dec_v"] in place.

    Returns (out [nc, P+S, D] with the active rows of the last block output,
    zeros elsewhere; active [nc, n_active]; boundary gaps per sequence;
    relevance [nc, P+S])."""
    _, dec_depth = LZ._depths(W)
    full_layers = int(mc.full_layers)
    sel = int(mc.select_layer) - 1
    if R.mutated("marche_select_layer_early"):   # 1-based select_layer read one layer early
        sel = max(0, sel - 1)
    nc, L, _ = x.shape
    ar = np.arange(nc)[:, None]
    rel = None
    for i in range(full_layers):
        pre = "decoder_blocks.%d" % i
        q, kk, vv = LZ._qkv(W, pre, x)
        if i == sel:
            rel = relevance(q[ar, gen_rows], kk, heads)
        x = LZ._attn_residual(W, pre, x, q, kk, vv, heads)
        x = LZ._mlp_residual(W, pre, x)
    active, gaps = [], []
    for b in range(nc):
        rows, gap = select_active(rel[b], forced_rows[b], n_active, P, mc.candidates, mc.refresh)
        active.append(rows)
        gaps.append(gap)
    active = np.stack(active)                                                  # [nc, n_active]
    xa = x[ar, active]
    for i in range(full_layers, dec_depth):
        pre = "decoder_blocks.%d" % i
        q, kk, vv = LZ._qkv(W, pre, xa)
        if R.mutated("marche_attend_stale_kv"):   # attend before writing the fresh K/V
            stale_k, stale_v = st["dec_k"][i].copy(), st["dec_v"][i].copy()
        st["dec_k"][i][ar, active] = kk
        st["dec_v"][i][ar, active] = vv
        if R.mutated("marche_attend_stale_kv"):
            xa = LZ._attn_residual(W, pre, xa, q, stale_k, stale_v, heads)
        else:
            xa = LZ._attn_residual(W, pre, xa, q, st["dec_k"][i], st["dec_v"][i], heads)
        xa = LZ._mlp_residual(W, pre, xa)
    out = np.zeros_like(x)
    out[ar, active] = xa
    return out, active, gaps, rel


# ==========================================================================
# The AR loop
# ==========================================================================

def generate_tokens_marche(W, labels_or_None, num_images, steps, cfg, cfg_schedule, temperature, seed,
                           first_index, heads, mc, tables=None):
    """MAR sampling with MARche, Philox orders and noise as in
    mar.generate_tokens. mc: a marcache.MARche (fields read: budget,
    select_layer, full_layers, refresh_period, refresh_phase, candidates,
    refresh, encoder_cache, cond_cache, head_cache, head_period,
    head_skip_first, head_skip_last, head_recompute_above).

    Returns (tokens float32 [N, S, C], log) with one dict per step: step,
    full, n_pred, cfg_iter, active (int64 [cached sequences, n_active] of
    the active rows, ascending; None on full steps), n_active, sequences
    (sequences through the decoder), decoder_kept_rows (full: sequences *
    (P+S); cached: cached sequences * n_active), encoder_rows (encoder query
    rows per layer summed over sequences), head_cached (cached head
    timesteps), select_gap (smallest relevance gap at the selection boundary
    over the cached sequences; inf if none), select_gaps (that gap per cached
    sequence; cached steps only), relevance ([cached sequences, P+S] or
    None)."""
    sz = R.model_sizes(W)
    S, C, P = sz["seq_len"], sz["token_channels"], sz["buffer"]
    L = P + S
    _, dec_depth = LZ._depths(W)
    if not 1 <= mc.select_layer <= mc.full_layers <= dec_depth:
        raise ValueError("need 1 <= select_layer <= full_layers <= decoder depth")
    B = int(num_images)
    if tables is None:
        tables = R.diffusion_tables()
    cfg_on, use_cond, nseq, cls, seq_img = LZ.cfg_sequences(W, labels_or_None, B, cfg, mc.cond_cache)
    cached = np.arange(B) if (use_cond or not cfg_on) else np.arange(2 * B)
    nc = len(cached)
    img_c = seq_img[cached]

    tokens = np.zeros((B, S, C), dtype=np.float32)
    mask = np.ones((B, S), dtype=bool)
    orders = R.generation_orders(seed, first_index, B, S)
    st = {}
    prev_pred = np.zeros((B, S), dtype=bool)  # predicted at the last step that predicted anything
    p_prev = 0
    log = []
    for k, (m_before, mask_len, n_pred) in enumerate(R.mask_schedule(S, steps)):
        assert np.all(mask.sum(axis=1) == m_before)
        mask_next, pred = LZ.step_masks(mask, orders, mask_len, k == steps - 1)
        full = is_full_step(mc, k)
        entry = dict(step=k, full=full, n_pred=n_pred, active=None, n_active=L, select_gap=np.inf,
                     relevance=None)
        tok_seq = ops.f64(tokens)[seq_img]
        if full:
            enc = encoder_full(W, tok_seq, mask[seq_img], cls, heads)
            x, dec_k, dec_v = decoder_full(W, enc["dec_in"], heads)
            x_c = x[:B]
            x_u = x[B:] if cfg_on else None
            st["dec_k"] = {l: dec_k[l][cached].copy() for l in range(mc.full_layers, dec_depth)}
            st["dec_v"] = {l: dec_v[l][cached].copy() for l in range(mc.full_layers, dec_depth)}
            if mc.encoder_cache:
                st["enc_k"] = [kk[cached].copy() for kk in enc["enc_k"]]
                st["enc_v"] = [vv[cached].copy() for vv in enc["enc_v"]]
                st["enc_known"] = ~mask.copy()
                st["dec_in"] = enc["dec_in"][cached].copy()
            if use_cond:
                st["diff"] = LZ.cond_diff(x, B)
            entry.update(sequences=nseq, decoder_kept_rows=nseq * L, encoder_rows=nseq * enc["enc_rows"])
        else:
            if n_pred == 0:
                raise NotImplementedError("the reference assumes every step predicts at least one token")
            if mc.encoder_cache:
                enc_rows = LZ.cached_encoder(W, st, tokens, mask, prev_pred, cls[cached], img_c, heads, P)
                dec_in = st["dec_in"].copy()
            else:
                enc = encoder_full(W, tok_seq[cached], mask[img_c], cls[cached], heads)
                dec_in, enc_rows = enc["dec_in"], enc["enc_rows"]
            gen_rows = np.stack([P + np.flatnonzero(pred[i]) for i in img_c])            # [nc, g]
            caching_forced = not R.mutated("marche_caching_not_forced")
            forced = [P + np.flatnonzero(pred[i] | prev_pred[i] if caching_forced else pred[i]) for i in img_c]
            n_active = active_count(mc, n_pred, p_prev, L, S)
            assert all(len(f) == n_pred + (p_prev if caching_forced else 0) for f in forced)
            x, active, gaps, rel = cached_decoder(W, st, dec_in, gen_rows, forced, n_active, mc, heads, P)
            x_c = x[:B]
            x_u = None
            if cfg_on:
                x_u = x_c + st["diff"] if use_cond else x[B:2 * B]
            entry.update(active=active, n_active=n_active, sequences=nc, decoder_kept_rows=nc * n_active,
                         encoder_rows=nc * enc_rows, select_gap=float(min(gaps)),
                         select_gaps=[float(g) for g in gaps], relevance=rel)

        mask = mask_next
        cfg_iter = R.cfg_schedule(cfg, cfg_schedule, mask_len, S) if cfg_on else 1.0
        prev_pred, p_prev = LZ.finish_step(W, log, entry, x_c, x_u, pred, n_pred, prev_pred, p_prev, tokens, cfg_iter,
                                           first_index, seed, temperature, tables, mc)
    return tokens, log

/* LazyMAR cache policy (spec lazymar.md). Only the rows a later step reads
 * are stored: per-layer encoder K/V, the decoder input, decoder K/V of the
 * layers after the selection layer, V of the selection layer, the CFG diff
 * at the last block, and per-block head caches of the live rows. */
#include "lazymar.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "flops.h"

struct mc_lazymar {
    mc_mar *mar;
    mc_lazymar_config cfg;
    int64_t n_images, n_cache_seq; /* B, and the sequences with token caches */
    int cfg_on;
    int64_t enc_filled;            /* encoder cache rows filled per sequence (P + visible) */
    float **enc_k, **enc_v;        /* [enc_depth] of [n_cache_seq, L, D] */
    float *dec_input;              /* [n_cache_seq, L, Dd] */
    float **dec_k, **dec_v;        /* [dec_depth]; only layers > select_layer */
    float *select_v[2];            /* V of the selection layer, this and the previous step */
    int select_v_current;
    float *cond_diff;              /* [B, L, Dd] (condition cache) */
    int32_t *prev_pred;            /* host [B, S]: positions predicted at the previous step */
    int64_t n_prev;
    float *head_buffer;            /* head caches, [head_depth, rows, W] grow-only */
    size_t head_buffer_floats;
    float **head_blocks;           /* [head_depth] pointers into head_buffer */
    float *scores_host;            /* [n_cache_seq * L] */
    int32_t *kept;                 /* [n_cache_seq * L]: rows kept (active) at the last cached step */
    int32_t *order;                /* [L] ranking scratch */
    size_t bytes;
};

static const mc_ops *ops_of(const mc_lazymar *lz) { return lz->mar->backend->ops; }

mc_status mc_lazymar_check(const mc_lazymar_config *cfg, const mc_mar_config *model, mc_err *err) {
    if (cfg->start < 0 || cfg->period < 1)
        return mc_fail(err, MC_ERR_VALUE, "LazyMAR: start must be >= 0 and period >= 1 (got %d, %d)",
                       cfg->start, cfg->period);
    if (cfg->decoder_mode == MC_DECODER_LAZYMAR &&
        (cfg->select_layer < 0 || cfg->select_layer >= model->dec_depth))
        return mc_fail(err, MC_ERR_VALUE, "LazyMAR: select_layer %d is outside the decoder's 0..%lld",
                       cfg->select_layer, (long long)model->dec_depth - 1);
    if (cfg->margin < 0)
        return mc_fail(err, MC_ERR_VALUE, "LazyMAR: margin must be >= 0");
    if (cfg->decoder_mode < MC_DECODER_FULL || cfg->decoder_mode > MC_DECODER_MARCHE)
        return mc_fail(err, MC_ERR_VALUE, "cache policy: unknown decoder mode %d", cfg->decoder_mode);
    if (cfg->decoder_mode == MC_DECODER_MARCHE) {
        if (cfg->budget < 1)
            return mc_fail(err, MC_ERR_VALUE, "MARche: budget must be >= 1, got %d", cfg->budget);
        if (cfg->full_layers < 1 || cfg->full_layers > model->dec_depth)
            return mc_fail(err, MC_ERR_VALUE, "MARche: full_layers %d is outside 1..%lld", cfg->full_layers,
                           (long long)model->dec_depth);
        if (cfg->marche_select_layer < 0 || cfg->marche_select_layer >= cfg->full_layers)
            return mc_fail(err, MC_ERR_VALUE,
                           "MARche: the selection layer (%d, 1-based) must be one of the %d full layers",
                           cfg->marche_select_layer + 1, cfg->full_layers);
    }
    for (int i = 0; i < MC_LAZYMAR_TABLE; i++)
        if (!(cfg->retention[i] >= 0.0f && cfg->retention[i] <= 1.0f))
            return mc_fail(err, MC_ERR_VALUE, "LazyMAR: retention[%d] = %g is outside [0, 1]", i,
                           (double)cfg->retention[i]);
    if (cfg->head_period < 1 || cfg->head_skip_first < 0 || cfg->head_skip_last < cfg->head_skip_first - 1)
        return mc_fail(err, MC_ERR_VALUE, "LazyMAR: bad head cache settings");
    if (!(cfg->head_recompute_above >= 0.0 && cfg->head_recompute_above <= 1.0))
        return mc_fail(err, MC_ERR_VALUE, "LazyMAR: head_recompute_above must be in [0, 1]");
    return MC_OK;
}

int mc_lazymar_full_step(const mc_lazymar_config *cfg, int step) {
    return step < cfg->start || (step - cfg->start) % cfg->period == 0;
}

float mc_lazymar_retention(const mc_lazymar_config *cfg, int step, int num_steps) {
    int64_t index = (int64_t)step * MC_LAZYMAR_TABLE / num_steps;
    if (index >= MC_LAZYMAR_TABLE)
        index = MC_LAZYMAR_TABLE - 1;
    return cfg->retention[index];
}

int64_t mc_lazymar_keep(const mc_lazymar_config *cfg, int step, int num_steps, int64_t predicted,
                        int64_t predicted_before, int64_t rows) {
    int64_t by_table = (int64_t)floor((double)rows * (double)mc_lazymar_retention(cfg, step, num_steps));
    int64_t floor_rows = predicted + predicted_before + cfg->margin;
    int64_t keep = by_table > floor_rows ? by_table : floor_rows;
    return keep < rows ? keep : rows;
}

static float *cache_buffer(mc_lazymar *lz, size_t floats, mc_err *err) {
    mc_backend *be = lz->mar->backend;
    float *p = be->ops->alloc(be, floats * sizeof(float), err);
    if (p != NULL)
        lz->bytes += floats * sizeof(float);
    return p;
}

static void release(mc_lazymar *lz, void *p) {
    if (p != NULL)
        lz->mar->backend->ops->release(lz->mar->backend, p);
}

void mc_lazymar_free(mc_lazymar *lz) {
    if (lz == NULL)
        return;
    const mc_mar_config *c = &lz->mar->config;
    for (int64_t i = 0; lz->enc_k && i < c->enc_depth; i++) {
        release(lz, lz->enc_k[i]);
        release(lz, lz->enc_v[i]);
    }
    for (int64_t i = 0; lz->dec_k && i < c->dec_depth; i++) {
        release(lz, lz->dec_k[i]);
        release(lz, lz->dec_v[i]);
    }
    release(lz, lz->dec_input);
    release(lz, lz->select_v[0]);
    release(lz, lz->select_v[1]);
    release(lz, lz->cond_diff);
    release(lz, lz->head_buffer);
    free(lz->enc_k);
    free(lz->enc_v);
    free(lz->dec_k);
    free(lz->dec_v);
    free(lz->head_blocks);
    free(lz->prev_pred);
    free(lz->scores_host);
    free(lz->order);
    free(lz->kept);
    free(lz);
}

mc_status mc_lazymar_create(mc_mar *mar, const mc_lazymar_config *cfg, int64_t n_images, int cfg_on,
                            mc_lazymar **out, mc_err *err) {
    const mc_mar_config *c = &mar->config;
    MC_TRY(mc_lazymar_check(cfg, c, err));
    mc_lazymar *lz = calloc(1, sizeof *lz);
    if (lz == NULL)
        return mc_fail(err, MC_ERR_NOMEM, "cannot allocate the LazyMAR state");
    lz->mar = mar;
    lz->cfg = *cfg;
    lz->n_images = n_images;
    lz->cfg_on = cfg_on;
    /* The condition cache replaces the unconditional branch, so only the
     * conditional sequences need token caches; without it both halves do. */
    lz->cfg.cond_cache = cfg->cond_cache && cfg_on;
    lz->n_cache_seq = (cfg_on && !lz->cfg.cond_cache) ? 2 * n_images : n_images;
    const int64_t L = c->buffer_size + c->seq_len, nc = lz->n_cache_seq;
    lz->prev_pred = malloc((size_t)(n_images * c->seq_len) * sizeof(int32_t));
    lz->scores_host = malloc((size_t)(nc * L) * sizeof(float));
    lz->order = malloc((size_t)L * sizeof(int32_t));
    lz->kept = malloc((size_t)(nc * L) * sizeof(int32_t));
    lz->head_blocks = calloc((size_t)c->head_depth, sizeof(float *));
    mc_status st = (lz->prev_pred && lz->scores_host && lz->order && lz->head_blocks && lz->kept)
                       ? MC_OK : mc_fail(err, MC_ERR_NOMEM, "cannot allocate the LazyMAR state");
    const int any_decoder_cache = cfg->decoder_mode != MC_DECODER_FULL;
    if (st == MC_OK && (cfg->encoder_cache || any_decoder_cache)) {
        lz->enc_k = calloc((size_t)c->enc_depth, sizeof(float *));
        lz->enc_v = calloc((size_t)c->enc_depth, sizeof(float *));
        lz->dec_k = calloc((size_t)c->dec_depth, sizeof(float *));
        lz->dec_v = calloc((size_t)c->dec_depth, sizeof(float *));
        if (!lz->enc_k || !lz->enc_v || !lz->dec_k || !lz->dec_v)
            st = mc_fail(err, MC_ERR_NOMEM, "cannot allocate the cache tables");
    }
    if (st == MC_OK && cfg->encoder_cache) {
        for (int64_t i = 0; st == MC_OK && i < c->enc_depth; i++) {
            lz->enc_k[i] = cache_buffer(lz, (size_t)(nc * L * c->width), err);
            lz->enc_v[i] = lz->enc_k[i] ? cache_buffer(lz, (size_t)(nc * L * c->width), err) : NULL;
            if (lz->enc_v[i] == NULL)
                st = err->status;
        }
        if (st == MC_OK && (lz->dec_input = cache_buffer(lz, (size_t)(nc * L * c->dec_width), err)) == NULL)
            st = err->status;
    }
    /* Decoder K/V only for the layers that attend to a cache. */
    int64_t first_cached_layer = c->dec_depth;
    if (cfg->decoder_mode == MC_DECODER_LAZYMAR)
        first_cached_layer = cfg->select_layer + 1;
    else if (cfg->decoder_mode == MC_DECODER_MARCHE)
        first_cached_layer = cfg->full_layers;
    for (int64_t i = first_cached_layer; st == MC_OK && i < c->dec_depth; i++) {
        lz->dec_k[i] = cache_buffer(lz, (size_t)(nc * L * c->dec_width), err);
        lz->dec_v[i] = lz->dec_k[i] ? cache_buffer(lz, (size_t)(nc * L * c->dec_width), err) : NULL;
        if (lz->dec_v[i] == NULL)
            st = err->status;
    }
    for (int i = 0; st == MC_OK && cfg->decoder_mode == MC_DECODER_LAZYMAR && i < 2; i++)
        if ((lz->select_v[i] = cache_buffer(lz, (size_t)(nc * L * c->dec_width), err)) == NULL)
            st = err->status;
    if (st == MC_OK && lz->cfg.cond_cache &&
        (lz->cond_diff = cache_buffer(lz, (size_t)(n_images * L * c->dec_width), err)) == NULL)
        st = err->status;
    if (st != MC_OK) {
        mc_lazymar_free(lz);
        return st;
    }
    *out = lz;
    return MC_OK;
}

size_t mc_lazymar_cache_bytes(const mc_lazymar *lz) { return lz->bytes; }

const mc_lazymar_config *mc_lazymar_config_of(const mc_lazymar *lz) { return &lz->cfg; }

mc_status mc_lazymar_head_cache(mc_lazymar *lz, int64_t live_rows, mc_head_cache *cache, mc_err *err) {
    const mc_mar_config *c = &lz->mar->config;
    const size_t per_block = (size_t)(live_rows * c->head_width);
    const size_t need = per_block * (size_t)c->head_depth;
    if (lz->head_buffer_floats < need) {
        release(lz, lz->head_buffer);
        lz->bytes -= lz->head_buffer_floats * sizeof(float);
        lz->head_buffer = NULL;
        lz->head_buffer_floats = 0;
        if ((lz->head_buffer = cache_buffer(lz, need, err)) == NULL)
            return err->status;
        lz->head_buffer_floats = need;
    }
    for (int64_t j = 0; j < c->head_depth; j++)
        lz->head_blocks[j] = lz->head_buffer + (size_t)j * per_block;
    cache->skip_first = lz->cfg.head_skip_first;
    cache->skip_last = lz->cfg.head_skip_last;
    cache->live_rows = live_rows;
    /* A block is either skipped (it keeps a delta) or computed (it keeps its
     * MLP output), so one buffer per block serves both. */
    cache->mlp = lz->head_blocks;
    cache->delta = lz->head_blocks;
    return MC_OK;
}

static int compare_by_score(const void *a, const void *b, void *scores_v) {
    const float *scores = scores_v;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    if (scores[x] != scores[y])
        return scores[x] < scores[y] ? -1 : 1;
    return (x > y) - (x < y);
}

/* Insertion sort by (score, index): glibc's qsort_r is a GNU extension and
 * rows are at most a few hundred. */
static void rank_rows(int32_t *idx, int64_t n, const float *scores) {
    for (int64_t i = 1; i < n; i++) {
        int32_t v = idx[i];
        int64_t j = i - 1;
        while (j >= 0 && compare_by_score(&idx[j], &v, (void *)scores) > 0) {
            idx[j + 1] = idx[j];
            j--;
        }
        idx[j + 1] = v;
    }
}

/* Rows of one sequence, ascending: the forced rows (predicted now and at
 * the previous step) always, then the other rows from `first_candidate` on in
 * ascending (key, row) order until `count` rows. LazyMAR keys by V cosine
 * (least similar first); its forcing is unconditional, unlike the official
 * code, which can drop a forced row when many cosines are negative
 * (lazymar.md 5.3 item 5). MARche keys by negated attention mass. */
static void choose_rows(const float *key, int64_t L, int64_t P, int64_t first_candidate, const int32_t *now,
                        int64_t n_now, const int32_t *prev, int64_t n_prev, int64_t count, uint8_t *taken,
                        int32_t *order, int32_t *rows) {
    memset(taken, 0, (size_t)L);
    int64_t n = 0;
    for (int64_t i = 0; i < n_now + n_prev; i++) {
        int64_t row = P + (i < n_now ? now[i] : prev[i - n_now]);
        if (!taken[row]) {
            taken[row] = 1;
            n++;
        }
    }
    int64_t m = 0;
    for (int64_t r = first_candidate; r < L; r++)
        if (!taken[r])
            order[m++] = (int32_t)r;
    rank_rows(order, m, key);
    for (int64_t i = 0; i < m && n < count; i++, n++)
        taken[order[i]] = 1;
    int64_t k = 0;
    for (int64_t r = 0; r < L; r++)
        if (taken[r])
            rows[k++] = (int32_t)r;
}

/* Output rows of the predicted positions: `x` holds `rows_per` rows per
 * sequence at positions `row_pos` (NULL: all P + S rows). */
static mc_status emit_outputs(mc_lazymar *lz, const mc_lazymar_step *s, const float *x, int64_t rows_per,
                              const int32_t *row_pos, float *z, mc_err *err) {
    const mc_mar_config *c = &lz->mar->config;
    const int64_t B = s->n_images, P = c->buffer_size, L = P + c->seq_len, n = B * s->n_pred;
    const int uncond_rows = s->cfg_on ? 1 : 0;
    int32_t *host = malloc((size_t)(n * 3 + 1) * sizeof(int32_t));
    if (host == NULL)
        return mc_fail(err, MC_ERR_NOMEM, "cannot allocate output indices");
    int32_t *src = host, *pos = host + n, *extra = host + 2 * n;
    for (int half = 0; half <= uncond_rows; half++) {
        const int from_cache = half == 1 && lz->cfg.cond_cache;
        for (int64_t b = 0; b < B; b++) {
            const int64_t seq = from_cache ? b : half * B + b;
            const int32_t *kept = row_pos ? row_pos + seq * rows_per : NULL;
            int64_t k = 0;
            for (int64_t i = 0; i < s->n_pred; i++) {
                int32_t row = (int32_t)(P + s->pred_pos[b * s->n_pred + i]);
                if (kept != NULL)
                    while (kept[k] != row)
                        k++;
                src[b * s->n_pred + i] = (int32_t)(seq * rows_per + (kept ? k : row));
                pos[b * s->n_pred + i] = s->pred_pos[b * s->n_pred + i];
                extra[b * s->n_pred + i] = (int32_t)(b * L + row);
            }
        }
        MC_TRY(mc_mar_output_rows(lz->mar, x, src, pos, n, from_cache ? lz->cond_diff : NULL, extra,
                                  z + (int64_t)half * n * c->dec_width, err));
    }
    free(host);
    return MC_OK;
}

static mc_status full_step(mc_lazymar *lz, const mc_lazymar_step *s, float *z, mc_lazymar_stats *stats,
                           mc_err *err) {
    mc_mar *mar = lz->mar;
    const mc_mar_config *c = &mar->config;
    const int64_t Bp = s->cfg_on ? 2 * s->n_images : s->n_images, P = c->buffer_size;
    const int64_t L = P + c->seq_len;
    mc_mar_batch batch = {.n_seq = Bp, .n_known = s->n_known, .tokens = s->tokens,
                          .known_pos = s->known_pos, .class_vectors = s->class_vectors};
    float *dec_v[512];
    mc_mar_hooks hooks = {.store_seq = lz->n_cache_seq, .cond_diff = lz->cond_diff};
    if (lz->dec_k != NULL) {
        if (c->dec_depth > 512)
            return mc_fail(err, MC_ERR_VALUE, "decoder depth %lld too large", (long long)c->dec_depth);
        for (int64_t i = 0; i < c->dec_depth; i++)
            dec_v[i] = lz->dec_v[i];
        if (lz->cfg.decoder_mode == MC_DECODER_LAZYMAR) {
            lz->select_v_current ^= 1;
            dec_v[lz->cfg.select_layer] = lz->select_v[lz->select_v_current];
        }
        if (lz->cfg.encoder_cache) {
            hooks.enc_k = lz->enc_k;
            hooks.enc_v = lz->enc_v;
            hooks.enc_cap = L;
            hooks.dec_input = lz->dec_input;
            lz->enc_filled = P + s->n_known;
        }
        hooks.dec_k = lz->dec_k;
        hooks.dec_v = dec_v;
    }
    /* Output rows: cond (image-major, positions ascending), then uncond. */
    const int64_t n = s->n_images * s->n_pred, S = c->seq_len;
    int32_t *out_rows = malloc((size_t)(2 * n + 1) * sizeof(int32_t));
    if (out_rows == NULL)
        return mc_fail(err, MC_ERR_NOMEM, "cannot allocate output rows");
    for (int64_t i = 0; i < n; i++) {
        int64_t b = i / s->n_pred;
        out_rows[i] = (int32_t)(b * S + s->pred_pos[i]);
        out_rows[n + i] = (int32_t)((s->n_images + b) * S + s->pred_pos[i]);
    }
    mc_status st = mc_mar_transformer_ex(mar, &batch, out_rows, s->cfg_on ? 2 * n : n, z, &hooks, err);
    free(out_rows);
    stats->full = 1;
    stats->encoder_rows = Bp * (P + s->n_known);
    stats->decoder_rows = stats->decoder_kept_rows = Bp * L;
    return st;
}

/* Cached step without the token cache: the plain transformer on the
 * conditional sequences only, the unconditional rows from the diff. */
static mc_status cond_only_step(mc_lazymar *lz, const mc_lazymar_step *s, float *z, mc_lazymar_stats *stats,
                                mc_err *err) {
    mc_mar *mar = lz->mar;
    const mc_mar_config *c = &mar->config;
    const int64_t B = s->n_images, P = c->buffer_size, L = P + c->seq_len;
    mc_mar_batch batch = {.n_seq = B, .n_known = s->n_known, .tokens = s->tokens,
                          .known_pos = s->known_pos, .class_vectors = s->class_vectors};
    MC_TRY(mc_mar_transformer_ex(mar, &batch, NULL, 0, NULL, NULL, err));
    stats->encoder_rows = B * (P + s->n_known);
    stats->decoder_rows = stats->decoder_kept_rows = B * L;
    stats->flops = 2.0 * (double)(B * s->n_known) * (double)(c->token_channels * c->width) +
                   (double)c->enc_depth * (mc_flops_block_attn(B, P + s->n_known, P + s->n_known, c->width) +
                                           mc_flops_block_mlp(B * (P + s->n_known), c->width, c->mlp_hidden)) +
                   2.0 * (double)(B * (P + s->n_known)) * (double)(c->width * c->dec_width) +
                   (double)c->dec_depth * (mc_flops_block_attn(B, L, L, c->dec_width) +
                                           mc_flops_block_mlp(B * L, c->dec_width, c->dec_mlp_hidden));
    return emit_outputs(lz, s, mc_mar_decoder_activations(mar), L, NULL, z, err);
}

/* Encoder phase of a cached step. With the encoder cache: the buffer rows
 * and the tokens revealed last step, against the per-layer cache of every
 * visible token (stale where not recomputed), refreshing their rows of the
 * cached decoder input. Without: the plain encoder on the cached sequences.
 * Either way f [nc, P + S, Dd] receives this step's decoder input. */
static mc_status encoder_phase(mc_lazymar *lz, const mc_lazymar_step *s, float *f, double *flops,
                               mc_lazymar_stats *stats, mc_err *err) {
    mc_mar *mar = lz->mar;
    mc_backend *be = mar->backend;
    const mc_ops *ops = ops_of(lz);
    const mc_mar_config *c = &mar->config;
    const int64_t B = s->n_images, nc = lz->n_cache_seq, P = c->buffer_size, S = c->seq_len, L = P + S;
    const int64_t D = c->width, Dd = c->dec_width;
    if (!lz->cfg.encoder_cache) {
        const int64_t K = s->n_known, rows = P + K;
        float *x = mc_mar_ws(mar, MC_MAR_WS_SLOTS - 1, (size_t)(nc * rows * D), err);
        if (x == NULL)
            return err->status;
        mc_mar_batch batch = {.n_seq = nc, .n_known = K, .tokens = s->tokens, .known_pos = s->known_pos,
                              .class_vectors = s->class_vectors};
        MC_TRY(mc_mar_encoder_input(mar, &batch, x, err));
        for (int64_t i = 0; i < c->enc_depth; i++) {
            MC_TRY(mc_mar_block_attn(mar, &mar->enc_blocks[i], x, nc, rows, D, c->enc_heads, NULL, err));
            MC_TRY(mc_mar_block_mlp(mar, &mar->enc_blocks[i], x, nc * rows, D, c->mlp_hidden, err));
        }
        MC_TRY(ops->layernorm(be, x, D, nc * rows, D, mar->enc_norm_w, mar->enc_norm_b, 1e-6f, NULL, NULL, 0,
                              x, D, err));
        MC_TRY(mc_mar_decoder_init(mar, f, nc, err));
        MC_TRY(mc_mar_decoder_input(mar, x, nc, K, s->known_pos, f, err));
        *flops += 2.0 * (double)(nc * K) * (double)(c->token_channels * D) +
                  (double)c->enc_depth * (mc_flops_block_attn(nc, rows, rows, D) +
                                          mc_flops_block_mlp(nc * rows, D, c->mlp_hidden)) +
                  2.0 * (double)(nc * rows) * (double)(D * Dd);
        stats->encoder_rows = nc * rows;
        return MC_OK;
    }

    const int64_t p = lz->n_prev;
    int32_t *host = malloc((size_t)(nc * (P + p + 1) + nc * (p + 1)) * sizeof(int32_t));
    if (host == NULL)
        return mc_fail(err, MC_ERR_NOMEM, "cannot allocate encoder slots");
    int32_t *slots = host, *new_pos = host + nc * (P + p + 1);
    for (int64_t q = 0; q < nc; q++) {
        for (int64_t r = 0; r < P; r++)
            slots[q * (P + p) + r] = (int32_t)r;
        for (int64_t i = 0; i < p; i++) {
            slots[q * (P + p) + P + i] = (int32_t)(lz->enc_filled + i);
            new_pos[q * p + i] = lz->prev_pred[(q % B) * p + i];
        }
    }
    const int64_t q_rows = P + p, keys = lz->enc_filled + p;
    mc_status st = MC_OK;
    float *x = mc_mar_ws(mar, MC_MAR_WS_SLOTS - 1, (size_t)(nc * q_rows * D), err);
    mc_mar_batch batch = {.n_seq = nc, .n_known = p, .tokens = s->tokens, .known_pos = new_pos,
                          .class_vectors = s->class_vectors};
    st = x ? mc_mar_encoder_input(mar, &batch, x, err) : err->status;
    for (int64_t i = 0; st == MC_OK && i < c->enc_depth; i++) {
        mc_mar_kv_io io = {.k_store = lz->enc_k[i], .v_store = lz->enc_v[i], .store_seq = nc,
                           .store_cap = L, .store_slots = slots, .k_attend = lz->enc_k[i],
                           .v_attend = lz->enc_v[i], .attend_rows = keys, .attend_cap = L};
        st = mc_mar_block_attn(mar, &mar->enc_blocks[i], x, nc, q_rows, D, c->enc_heads, &io, err);
        if (st == MC_OK)
            st = mc_mar_block_mlp(mar, &mar->enc_blocks[i], x, nc * q_rows, D, c->mlp_hidden, err);
    }
    if (st == MC_OK)
        st = ops->layernorm(be, x, D, nc * q_rows, D, mar->enc_norm_w, mar->enc_norm_b, 1e-6f, NULL, NULL,
                            0, x, D, err);
    if (st == MC_OK)
        st = mc_mar_decoder_input(mar, x, nc, p, new_pos, lz->dec_input, err);
    if (st == MC_OK)
        st = ops->copy(be, f, lz->dec_input, (size_t)(nc * L * Dd) * sizeof(float), err);
    free(host);
    lz->enc_filled = keys;
    *flops += 2.0 * (double)(nc * p) * (double)(c->token_channels * D) +
              (double)c->enc_depth * (mc_flops_block_attn(nc, q_rows, keys, D) +
                                      mc_flops_block_mlp(nc * q_rows, D, c->mlp_hidden)) +
              2.0 * (double)(nc * q_rows) * (double)(D * Dd);
    stats->encoder_rows = nc * q_rows;
    return st;
}

static mc_status full_layers(mc_lazymar *lz, float *f, int64_t first, int64_t last, double *flops, mc_err *err) {
    mc_mar *mar = lz->mar;
    const mc_mar_config *c = &mar->config;
    const int64_t nc = lz->n_cache_seq, L = c->buffer_size + c->seq_len, Dd = c->dec_width;
    for (int64_t i = first; i < last; i++) {
        MC_TRY(mc_mar_block_attn(mar, &mar->dec_blocks[i], f, nc, L, Dd, c->dec_heads, NULL, err));
        MC_TRY(mc_mar_block_mlp(mar, &mar->dec_blocks[i], f, nc * L, Dd, c->dec_mlp_hidden, err));
        *flops += mc_flops_block_attn(nc, L, L, Dd) + mc_flops_block_mlp(nc * L, Dd, c->dec_mlp_hidden);
    }
    return MC_OK;
}

/* Layers [first, depth) on the kept rows xk [nc, keep] only: their fresh K/V
 * go into each layer's cache at their row positions, and they attend to all
 * P + S cached rows (exactly the online-softmax merge of fresh and cached
 * K/V, since the fresh rows are written first). */
static mc_status cache_aware_layers(mc_lazymar *lz, float *xk, const int32_t *kept, int64_t keep, int64_t first,
                                    double *flops, mc_err *err) {
    mc_mar *mar = lz->mar;
    const mc_mar_config *c = &mar->config;
    const int64_t nc = lz->n_cache_seq, L = c->buffer_size + c->seq_len, Dd = c->dec_width;
    for (int64_t i = first; i < c->dec_depth; i++) {
        mc_mar_kv_io io = {.k_store = lz->dec_k[i], .v_store = lz->dec_v[i], .store_seq = nc, .store_cap = L,
                           .store_slots = kept, .k_attend = lz->dec_k[i], .v_attend = lz->dec_v[i],
                           .attend_rows = L, .attend_cap = L};
        MC_TRY(mc_mar_block_attn(mar, &mar->dec_blocks[i], xk, nc, keep, Dd, c->dec_heads, &io, err));
        MC_TRY(mc_mar_block_mlp(mar, &mar->dec_blocks[i], xk, nc * keep, Dd, c->dec_mlp_hidden, err));
        *flops += mc_flops_block_attn(nc, keep, L, Dd) + mc_flops_block_mlp(nc * keep, Dd, c->dec_mlp_hidden);
    }
    return MC_OK;
}

/* Gathers rows `kept` [nc, keep] of f into a fresh workspace buffer. */
static float *gather_kept(mc_lazymar *lz, const float *f, const int32_t *kept, int64_t keep, mc_err *err) {
    mc_mar *mar = lz->mar;
    mc_backend *be = mar->backend;
    const int64_t nc = lz->n_cache_seq, L = mar->config.buffer_size + mar->config.seq_len;
    const int64_t Dd = mar->config.dec_width;
    int32_t *gather = malloc((size_t)(nc * keep) * sizeof(int32_t));
    float *xk = mc_mar_ws(mar, MC_MAR_WS_SLOTS - 4, (size_t)(nc * keep * Dd), err);
    int32_t *d_gather = (int32_t *)mc_mar_ws_index(mar, MC_MAR_WSI_SLOTS - 1, (size_t)(nc * keep), err);
    if (gather == NULL) {
        mc_fail(err, MC_ERR_NOMEM, "cannot allocate gather indices");
        return NULL;
    }
    for (int64_t q = 0; q < nc; q++)
        for (int64_t i = 0; i < keep; i++)
            gather[q * keep + i] = (int32_t)(q * L + kept[q * keep + i]);
    mc_status st = (xk && d_gather) ? MC_OK : err->status;
    if (st == MC_OK)
        st = be->ops->upload(be, d_gather, gather, (size_t)(nc * keep) * sizeof(int32_t), err);
    if (st == MC_OK)
        st = be->ops->gather_rows(be, f, Dd, d_gather, nc * keep, Dd, xk, Dd, err);
    free(gather);
    return st == MC_OK ? xk : NULL;
}

/* LazyMAR decoder (lazymar.md 5.2-5.5). */
static mc_status lazymar_decoder(mc_lazymar *lz, const mc_lazymar_step *s, float *f, int32_t *kept, int64_t keep,
                                 float **out, double *flops, mc_err *err) {
    mc_mar *mar = lz->mar;
    mc_backend *be = mar->backend;
    const mc_ops *ops = ops_of(lz);
    const mc_mar_config *c = &mar->config;
    const int64_t B = s->n_images, nc = lz->n_cache_seq, P = c->buffer_size, L = P + c->seq_len;
    const int64_t Dd = c->dec_width, p = lz->n_prev, sel = lz->cfg.select_layer;
    MC_TRY(full_layers(lz, f, 0, sel, flops, err));
    /* Selection layer: attention over all rows, V kept for the ranking. */
    float *v_old = lz->select_v[lz->select_v_current];
    lz->select_v_current ^= 1;
    float *v_new = lz->select_v[lz->select_v_current];
    mc_mar_kv_io io_sel = {.v_store = v_new, .store_seq = nc, .store_cap = L};
    MC_TRY(mc_mar_block_attn(mar, &mar->dec_blocks[sel], f, nc, L, Dd, c->dec_heads, &io_sel, err));
    *flops += mc_flops_block_attn(nc, L, L, Dd);
    float *scores = mc_mar_ws(mar, MC_MAR_WS_SLOTS - 3, (size_t)(nc * L), err);
    if (scores == NULL)
        return err->status;
    MC_TRY(ops->cosine_rows(be, v_new, Dd, v_old, Dd, nc * L, (int)c->dec_heads, (int)(Dd / c->dec_heads),
                            scores, err));
    MC_TRY(ops->download(be, lz->scores_host, scores, (size_t)(nc * L) * sizeof(float), err));
    uint8_t *taken = malloc((size_t)L);
    if (taken == NULL)
        return mc_fail(err, MC_ERR_NOMEM, "cannot allocate selection state");
    for (int64_t q = 0; q < nc; q++) {
        const int64_t b = q % B;
        choose_rows(lz->scores_host + q * L, L, P, 0, s->pred_pos + b * s->n_pred, s->n_pred,
                    lz->prev_pred + b * p, p, keep, taken, lz->order, kept + q * keep);
    }
    free(taken);
    float *xk = gather_kept(lz, f, kept, keep, err);
    if (xk == NULL)
        return err->status;
    MC_TRY(mc_mar_block_mlp(mar, &mar->dec_blocks[sel], xk, nc * keep, Dd, c->dec_mlp_hidden, err));
    *flops += mc_flops_block_mlp(nc * keep, Dd, c->dec_mlp_hidden);
    MC_TRY(cache_aware_layers(lz, xk, kept, keep, sel + 1, flops, err));
    *out = xk;
    return MC_OK;
}

int64_t mc_marche_active_count(const mc_lazymar_config *cfg, int64_t generating, int64_t caching, int64_t rows,
                               int64_t candidates) {
    int64_t forced = generating + caching;
    int64_t active = cfg->budget > forced ? cfg->budget : forced;
    if (active > forced + candidates)
        active = forced + candidates;
    return active < rows ? active : rows;
}

/* MARche decoder (marche.md 2-3): full prefix layers, refreshing rows picked
 * by the attention mass the generating rows put on them at the selection
 * layer, cache-aware attention for the active rows in the later layers. */
static mc_status marche_decoder(mc_lazymar *lz, const mc_lazymar_step *s, float *f, int32_t *active,
                                int64_t n_active, float **out, double *flops, mc_err *err) {
    mc_mar *mar = lz->mar;
    mc_backend *be = mar->backend;
    const mc_ops *ops = ops_of(lz);
    const mc_mar_config *c = &mar->config;
    const int64_t B = s->n_images, nc = lz->n_cache_seq, P = c->buffer_size, L = P + c->seq_len;
    const int64_t Dd = c->dec_width, p = lz->n_prev, sel = lz->cfg.marche_select_layer, ng = s->n_pred;
    const int64_t hd = Dd / c->dec_heads;
    MC_TRY(full_layers(lz, f, 0, sel, flops, err));
    MC_TRY(mc_mar_block_attn(mar, &mar->dec_blocks[sel], f, nc, L, Dd, c->dec_heads, NULL, err));
    *flops += mc_flops_block_attn(nc, L, L, Dd);
    /* Relevance from the queries of the generating rows, read from this
     * layer's fused qkv (still in the workspace). */
    const float *qkv = mc_mar_last_qkv(mar);
    float *q_gen = mc_mar_ws(mar, MC_MAR_WS_SLOTS - 3, (size_t)(nc * ng * Dd + nc * L), err);
    int32_t *rows = malloc((size_t)(nc * ng + 1) * sizeof(int32_t));
    int32_t *d_rows = (int32_t *)mc_mar_ws_index(mar, MC_MAR_WSI_SLOTS - 1, (size_t)(nc * ng + 1), err);
    if (q_gen == NULL || rows == NULL || d_rows == NULL) {
        free(rows);
        return rows == NULL ? mc_fail(err, MC_ERR_NOMEM, "cannot allocate query rows") : err->status;
    }
    for (int64_t q = 0; q < nc; q++)
        for (int64_t i = 0; i < ng; i++)
            rows[q * ng + i] = (int32_t)(q * L + P + s->pred_pos[(q % B) * ng + i]);
    float *mass = q_gen + nc * ng * Dd;
    mc_status st = ops->upload(be, d_rows, rows, (size_t)(nc * ng) * sizeof(int32_t), err);
    free(rows);
    if (st == MC_OK)
        st = ops->gather_rows(be, qkv, 3 * Dd, d_rows, nc * ng, Dd, q_gen, Dd, err);
    if (st == MC_OK)
        st = ops->attention_mass(be, nc, ng, (int)c->dec_heads, (int)hd, (float)(1.0 / sqrt((double)hd)), q_gen,
                                 Dd, ng * Dd, qkv + Dd, 3 * Dd, L * 3 * Dd, L, mass, err);
    if (st == MC_OK)
        st = ops->download(be, lz->scores_host, mass, (size_t)(nc * L) * sizeof(float), err);
    if (st != MC_OK)
        return st;
    *flops += 2.0 * (double)(nc * ng * L) * (double)Dd;
    MC_TRY(mc_mar_block_mlp(mar, &mar->dec_blocks[sel], f, nc * L, Dd, c->dec_mlp_hidden, err));
    *flops += mc_flops_block_mlp(nc * L, Dd, c->dec_mlp_hidden);
    MC_TRY(full_layers(lz, f, sel + 1, lz->cfg.full_layers, flops, err));
    uint8_t *taken = malloc((size_t)L);
    if (taken == NULL)
        return mc_fail(err, MC_ERR_NOMEM, "cannot allocate selection state");
    /* Most attention mass first (or least, as an ablation): rank by the
     * negated mass, flipped in place in the host copy. */
    if (!lz->cfg.refresh_low)
        for (int64_t i = 0; i < nc * L; i++)
            lz->scores_host[i] = -lz->scores_host[i];
    for (int64_t q = 0; q < nc; q++) {
        const int64_t b = q % B;
        choose_rows(lz->scores_host + q * L, L, P, lz->cfg.image_candidates ? P : 0, s->pred_pos + b * ng, ng,
                    lz->prev_pred + b * p, p, n_active, taken, lz->order, active + q * n_active);
    }
    free(taken);
    float *xa = gather_kept(lz, f, active, n_active, err);
    if (xa == NULL)
        return err->status;
    MC_TRY(cache_aware_layers(lz, xa, active, n_active, lz->cfg.full_layers, flops, err));
    *out = xa;
    return MC_OK;
}

static mc_status cached_step(mc_lazymar *lz, const mc_lazymar_step *s, float *z, mc_lazymar_stats *stats,
                             mc_err *err) {
    mc_mar *mar = lz->mar;
    const mc_mar_config *c = &mar->config;
    const int64_t nc = lz->n_cache_seq, P = c->buffer_size, L = P + c->seq_len, Dd = c->dec_width;
    double flops = 0.0;
    float *f = mc_mar_ws(mar, MC_MAR_WS_SLOTS - 2, (size_t)(nc * L * Dd), err);
    if (f == NULL)
        return err->status;
    MC_TRY(encoder_phase(lz, s, f, &flops, stats, err));
    stats->decoder_rows = nc * L;
    int64_t keep = L;
    if (lz->cfg.decoder_mode == MC_DECODER_LAZYMAR)
        keep = mc_lazymar_keep(&lz->cfg, s->step, s->num_steps, s->n_pred, lz->n_prev, L);
    else if (lz->cfg.decoder_mode == MC_DECODER_MARCHE)
        keep = mc_marche_active_count(&lz->cfg, s->n_pred, lz->n_prev, L,
                                      (lz->cfg.image_candidates ? c->seq_len : L) - s->n_pred - lz->n_prev);
    int32_t *kept = lz->kept;
    float *x = f;
    mc_status st = MC_OK;
    if (lz->cfg.decoder_mode == MC_DECODER_LAZYMAR)
        st = lazymar_decoder(lz, s, f, kept, keep, &x, &flops, err);
    else if (lz->cfg.decoder_mode == MC_DECODER_MARCHE)
        st = marche_decoder(lz, s, f, kept, keep, &x, &flops, err);
    else
        st = full_layers(lz, f, 0, c->dec_depth, &flops, err);
    if (st == MC_OK)
        st = emit_outputs(lz, s, x, keep, x == f ? NULL : kept, z, err);
    stats->decoder_kept_rows = nc * keep;
    if (x != f) {
        stats->kept_rows = kept;
        stats->kept_sequences = nc;
        stats->kept_per_sequence = keep;
    }
    stats->flops = flops;
    return st;
}

mc_status mc_lazymar_transformer(mc_lazymar *lz, const mc_lazymar_step *s, float *z,
                                 mc_lazymar_stats *stats, mc_err *err) {
    const mc_mar_config *c = &lz->mar->config;
    memset(stats, 0, sizeof *stats);
    mc_status st;
    const int token_work = lz->cfg.encoder_cache || lz->cfg.decoder_mode != MC_DECODER_FULL;
    if (mc_lazymar_full_step(&lz->cfg, s->step) || (!token_work && !lz->cfg.cond_cache))
        st = full_step(lz, s, z, stats, err);
    else if (token_work)
        st = cached_step(lz, s, z, stats, err);
    else
        st = cond_only_step(lz, s, z, stats, err);
    if (st != MC_OK)
        return st;
    memcpy(lz->prev_pred, s->pred_pos, (size_t)(s->n_images * s->n_pred) * sizeof(int32_t));
    lz->n_prev = s->n_pred;
    (void)c;
    return MC_OK;
}

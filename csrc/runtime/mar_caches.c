#include "mar_caches.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "flops.h"
#include "rows.h"

float *mc_mar_caches_buffer(mc_mar_caches *tc, size_t floats, mc_err *err, const char *what_fmt, ...) {
    mc_backend *be = tc->mar->backend;
    char what[160];
    va_list ap;
    va_start(ap, what_fmt);
    vsnprintf(what, sizeof what, what_fmt, ap);
    va_end(ap);
    size_t bytes;
    if (mc_mul_overflows(floats, sizeof(float), &bytes)) {
        mc_fail_nomem_n(err, floats, sizeof(float), "%s", what);
        return NULL;
    }
    float *p = be->ops->alloc(be, bytes, what, err);
    if (p != NULL)
        tc->bytes += bytes;
    return p;
}

static void release(mc_mar_caches *tc, void *p) {
    if (p != NULL)
        tc->mar->backend->ops->release(tc->mar->backend, p);
}

void mc_mar_caches_release(mc_mar_caches *tc) {
    if (tc->mar == NULL)
        return;
    const mc_mar_config *c = &tc->mar->config;
    for (int64_t i = 0; tc->enc_k && i < c->enc_depth; i++) {
        release(tc, tc->enc_k[i]);
        release(tc, tc->enc_v[i]);
    }
    for (int64_t i = 0; tc->dec_k && i < c->dec_depth; i++) {
        release(tc, tc->dec_k[i]);
        release(tc, tc->dec_v[i]);
    }
    release(tc, tc->dec_input);
    release(tc, tc->cond_diff);
    if (tc->head.mar != NULL)
        mc_head_cache_release(&tc->head);
    free(tc->enc_k);
    free(tc->enc_v);
    free(tc->dec_k);
    free(tc->dec_v);
    free(tc->prev_pred);
    free(tc->scores_host);
    free(tc->order);
    free(tc->taken);
    free(tc->kept);
    free(tc->read_rows);
    memset(tc, 0, sizeof *tc);
}

void mc_mar_caches_release_state(void *state) { mc_mar_caches_release((mc_mar_caches *)state); }

size_t mc_mar_caches_cache_bytes(const void *state) {
    const mc_mar_caches *tc = state;
    return tc->bytes + mc_head_cache_bytes(&tc->head);
}

mc_status mc_mar_caches_plan(void *state, int64_t most_live_rows, mc_err *err) {
    mc_mar_caches *tc = state;
    return mc_head_cache_reserve(&tc->head, most_live_rows, err);
}

mc_status mc_mar_caches_head_plan(void *state, const mc_mar_step *step, int n_diffusion_steps,
                                  mc_mar_head_plan *plan, mc_err *err) {
    mc_mar_caches *tc = state;
    return mc_head_cache_plan(&tc->head, step->n_images * step->n_pred, n_diffusion_steps, plan, err);
}

mc_status mc_mar_caches_init(mc_mar_caches *tc, mc_mar *mar, const mc_mar_run_shape *run, int encoder_cache,
                             int cond_cache, int token_tables, int64_t first_cached_layer,
                             const mc_head_cache_config *head, mc_err *err) {
    const mc_mar_config *c = &mar->config;
    memset(tc, 0, sizeof *tc);
    tc->mar = mar;
    tc->acts = NULL;
    mc_mar_runtime_acts *acts = mc_mar_runtime_acts_of(mar, err);
    if (acts == NULL)
        return err->status;
    tc->acts = &acts->policy;
    tc->n_images = run->n_images;
    tc->cfg_on = run->cfg_on;
    tc->encoder_cache = encoder_cache;
    /* The condition cache replaces the unconditional branch, so only the
     * conditional sequences need token caches; without it both halves do. */
    tc->cond_cache = cond_cache && run->cfg_on;
    tc->n_cache_seq = (run->cfg_on && !tc->cond_cache) ? 2 * run->n_images : run->n_images;
    const int64_t L = c->buffer_size + c->seq_len, nc = tc->n_cache_seq;
    const size_t prev_bytes = (size_t)(run->n_images * c->seq_len) * sizeof(int32_t),
                 scores_bytes = (size_t)(nc * L) * sizeof(float), order_bytes = (size_t)L * sizeof(int32_t),
                 kept_bytes = (size_t)(nc * L) * sizeof(int32_t),
                 read_bytes = (size_t)(2 * run->n_images * L) * sizeof(int32_t);
    tc->prev_pred = malloc(prev_bytes);
    tc->scores_host = malloc(scores_bytes);
    tc->order = malloc(order_bytes);
    tc->taken = malloc((size_t)L);
    tc->kept = malloc(kept_bytes);
    tc->read_rows = malloc(read_bytes);
    mc_status st = (tc->prev_pred && tc->scores_host && tc->order && tc->taken && tc->kept && tc->read_rows)
                       ? MC_OK
                       : mc_fail_nomem(err, prev_bytes + scores_bytes + order_bytes + (size_t)L + kept_bytes +
                                                read_bytes,
                                       "the cache policy's host state for %lld sequences", (long long)nc);
    if (st == MC_OK)
        st = mc_head_cache_init(&tc->head, mar, head, err);
    if (st == MC_OK && (encoder_cache || token_tables)) {
        tc->enc_k = calloc((size_t)c->enc_depth, sizeof(float *));
        tc->enc_v = calloc((size_t)c->enc_depth, sizeof(float *));
        tc->dec_k = calloc((size_t)c->dec_depth, sizeof(float *));
        tc->dec_v = calloc((size_t)c->dec_depth, sizeof(float *));
        if (!tc->enc_k || !tc->enc_v || !tc->dec_k || !tc->dec_v)
            st = mc_fail_nomem_n(err, (size_t)(2 * (c->enc_depth + c->dec_depth)), sizeof(float *),
                                 "the K/V cache tables");
    }
    if (st == MC_OK && encoder_cache) {
        for (int64_t i = 0; st == MC_OK && i < c->enc_depth; i++) {
            tc->enc_k[i] = mc_mar_caches_buffer(tc, (size_t)(nc * L * c->width), err, "encoder block %lld's K cache",
                                                (long long)i);
            tc->enc_v[i] = tc->enc_k[i] ? mc_mar_caches_buffer(tc, (size_t)(nc * L * c->width), err,
                                                               "encoder block %lld's V cache", (long long)i)
                                        : NULL;
            if (tc->enc_v[i] == NULL)
                st = err->status;
        }
        if (st == MC_OK && (tc->dec_input = mc_mar_caches_buffer(tc, (size_t)(nc * L * c->dec_width), err,
                                                                 "the cached decoder input")) == NULL)
            st = err->status;
    }
    /* Decoder K/V only for the layers that attend to a cache. */
    for (int64_t i = first_cached_layer; st == MC_OK && token_tables && i < c->dec_depth; i++) {
        tc->dec_k[i] = mc_mar_caches_buffer(tc, (size_t)(nc * L * c->dec_width), err, "decoder block %lld's K cache",
                                            (long long)i);
        tc->dec_v[i] = tc->dec_k[i] ? mc_mar_caches_buffer(tc, (size_t)(nc * L * c->dec_width), err,
                                                           "decoder block %lld's V cache", (long long)i)
                                    : NULL;
        if (tc->dec_v[i] == NULL)
            st = err->status;
    }
    if (st == MC_OK && tc->cond_cache &&
        (tc->cond_diff = mc_mar_caches_buffer(tc, (size_t)(run->n_images * L * c->dec_width), err,
                                              "the condition cache's difference")) == NULL)
        st = err->status;
    if (st != MC_OK)
        mc_mar_caches_release(tc);
    return st;
}

/* Where `row` sits among a sequence's `keep` kept rows, or -1. The rows
 * predicted now are forced into every kept set (mc_rows_choose), so -1 is
 * an internal error. */
static int64_t kept_slot(const int32_t *kept, int64_t keep, int32_t row) {
    for (int64_t k = 0; k < keep; k++)
        if (kept[k] == row)
            return k;
    return -1;
}

/* Output rows of the predicted positions: `x` holds `rows_per` rows per
 * sequence at positions `row_pos` (NULL: all P + S rows). The unconditional
 * half comes from the conditional rows plus the cached diff when the
 * condition cache is on. */
static mc_status emit_outputs(mc_mar_caches *tc, const mc_mar_step *s, const float *x, int64_t rows_per,
                              const int32_t *row_pos, float *z, mc_err *err) {
    const mc_mar_config *c = &tc->mar->config;
    const int64_t B = s->n_images, P = c->buffer_size, L = P + c->seq_len, n = B * s->n_pred;
    const int uncond_rows = s->cfg_on ? 1 : 0;
    int32_t *host = malloc((size_t)(n * 3 + 1) * sizeof(int32_t));
    if (host == NULL)
        return mc_fail_nomem_n(err, (size_t)(n * 3 + 1), sizeof(int32_t), "the output row indices of %lld rows",
                               (long long)n);
    int32_t *src = host, *pos = host + n, *extra = host + 2 * n;
    for (int half = 0; half <= uncond_rows; half++) {
        const int from_cache = half == 1 && tc->cond_cache;
        for (int64_t b = 0; b < B; b++) {
            const int64_t seq = from_cache ? b : half * B + b;
            const int32_t *kept = row_pos ? row_pos + seq * rows_per : NULL;
            for (int64_t i = 0; i < s->n_pred; i++) {
                int32_t row = (int32_t)(P + s->pred_pos[b * s->n_pred + i]);
                const int64_t k = kept != NULL ? kept_slot(kept, rows_per, row) : row;
                if (k < 0) {
                    free(host);
                    return mc_fail(err, MC_ERR_INTERNAL, "predicted row %d is not among sequence %lld's kept rows",
                                   row, (long long)seq);
                }
                src[b * s->n_pred + i] = (int32_t)(seq * rows_per + k);
                pos[b * s->n_pred + i] = s->pred_pos[b * s->n_pred + i];
                extra[b * s->n_pred + i] = (int32_t)(b * L + row);
            }
        }
        mc_status st = mc_mar_output_rows(tc->mar, x, src, pos, n, from_cache ? tc->cond_diff : NULL, extra,
                                          z + (int64_t)half * n * c->dec_width, err);
        if (st != MC_OK) {
            free(host);
            return st;
        }
    }
    free(host);
    return MC_OK;
}

/* The rows predicted now of each of n_seq sequences (P + position, in
 * pred_pos order: the order NoCache reads them in, from out_rows) into
 * rows [n_seq, n_pred]. */
static void predicted_rows(const mc_mar_caches *tc, const mc_mar_step *s, int64_t n_seq, int32_t *rows) {
    const int64_t P = tc->mar->config.buffer_size, B = s->n_images;
    for (int64_t q = 0; q < n_seq; q++)
        for (int64_t i = 0; i < s->n_pred; i++)
            rows[q * s->n_pred + i] = (int32_t)(P + s->pred_pos[(q % B) * s->n_pred + i]);
}

/* A full step's rows of the last decoder block with the condition cache:
 * group 0 the predicted rows (as NoCache reads them, so the step's z is
 * NoCache's to the bit), group 1 every other masked row, ascending (the
 * diff's rows that later steps predict). Both in tc->read_rows. */
static mc_status full_step_read_rows(mc_mar_caches *tc, const mc_mar_step *s, int64_t n_seq, mc_mar_read_rows *read,
                                     mc_err *err) {
    const mc_mar_config *c = &tc->mar->config;
    const int64_t P = c->buffer_size, S = c->seq_len, K = s->n_known, B = s->n_images;
    const int64_t others = S - K - s->n_pred;
    int32_t *rest = tc->read_rows + n_seq * s->n_pred;
    predicted_rows(tc, s, n_seq, tc->read_rows);
    for (int64_t q = 0; q < n_seq; q++) {
        memset(tc->taken, 0, (size_t)S);
        for (int64_t i = 0; i < K; i++)
            tc->taken[s->known_pos[q * K + i]] = 1;
        for (int64_t i = 0; i < s->n_pred; i++)
            tc->taken[s->pred_pos[(q % B) * s->n_pred + i]] = 1;
        int64_t n = 0;
        for (int64_t pos = 0; pos < S; pos++)
            if (!tc->taken[pos]) {
                if (n < others)
                    rest[q * others + n] = (int32_t)(P + pos);
                n++;
            }
        if (n != others)
            return mc_fail(err, MC_ERR_INTERNAL,
                           "sequence %lld has %lld masked positions besides the predicted ones, expected %lld",
                           (long long)q, (long long)n, (long long)others);
    }
    *read = (mc_mar_read_rows){.n_groups = 2, .rows = {tc->read_rows, rest}, .per_seq = {s->n_pred, others}};
    return MC_OK;
}

mc_status mc_mar_caches_full_step(mc_mar_caches *tc, const mc_mar_step *s, float *select_v, int64_t select_layer,
                                  float *z, mc_mar_transformer_stats *stats, mc_err *err) {
    mc_mar *mar = tc->mar;
    mc_backend *be = mar->backend;
    const mc_mar_config *c = &mar->config;
    const int64_t Bp = s->cfg_on ? 2 * s->n_images : s->n_images, P = c->buffer_size;
    const int64_t L = P + c->seq_len, Dd = c->dec_width;
    mc_mar_batch batch = {.n_seq = Bp, .n_known = s->n_known, .tokens = s->tokens,
                          .known_pos = s->known_pos, .class_vectors = s->class_vectors};
    float *dec_v[512];
    mc_mar_hooks hooks = {.store_seq = tc->n_cache_seq};
    if (tc->dec_k != NULL) {
        if (c->dec_depth > 512)
            return mc_fail(err, MC_ERR_VALUE, "decoder depth %lld too large", (long long)c->dec_depth);
        for (int64_t i = 0; i < c->dec_depth; i++)
            dec_v[i] = tc->dec_v[i];
        if (select_v != NULL)
            dec_v[select_layer] = select_v;
        if (tc->encoder_cache) {
            hooks.enc_k = tc->enc_k;
            hooks.enc_v = tc->enc_v;
            hooks.enc_cap = L;
            hooks.dec_input = tc->dec_input;
            tc->enc_filled = P + s->n_known;
        }
        hooks.dec_k = tc->dec_k;
        hooks.dec_v = dec_v;
    }
    /* With the condition cache the last block's outputs are read at every
     * masked row (the diff below, read at the rows later steps predict);
     * without, at the rows predicted now (the transformer's default). */
    const int keep_diff = tc->cond_diff != NULL && s->cfg_on;
    mc_mar_read_rows masked = {0};
    if (keep_diff)
        MC_TRY(full_step_read_rows(tc, s, Bp, &masked, err));
    MC_TRY(mc_mar_transformer_ex(mar, &batch, s->out_rows, s->n_out, z, &hooks, keep_diff ? &masked : NULL, err));
    /* Condition cache: what the unconditional half adds to the conditional
     * one at the last block's output (pre-norm); valid at the masked rows,
     * the only ones read. */
    if (keep_diff) {
        const float *f = mc_mar_decoder_activations(mar);
        const int64_t half = Bp / 2;
        MC_TRY(be->ops->copy(be, tc->cond_diff, f + half * L * Dd, (size_t)(half * L * Dd) * sizeof(float), err));
        MC_TRY(be->ops->axpby(be, -1.0f, f, Dd, 1.0f, tc->cond_diff, Dd, half * L, Dd, err));
    }
    stats->full = 1;
    stats->encoder_rows = Bp * (P + s->n_known);
    stats->decoder_rows = stats->decoder_kept_rows = Bp * L;
    const int64_t read_per_seq = keep_diff ? mc_mar_read_rows_per_seq(&masked) : s->n_pred;
    stats->flops = mc_mar_transformer_flops(c, Bp, s->n_known, read_per_seq);
    return MC_OK;
}

mc_status mc_mar_caches_cond_only_step(mc_mar_caches *tc, const mc_mar_step *s, float *z,
                                       mc_mar_transformer_stats *stats, mc_err *err) {
    mc_mar *mar = tc->mar;
    const mc_mar_config *c = &mar->config;
    const int64_t B = s->n_images, P = c->buffer_size, L = P + c->seq_len;
    mc_mar_batch batch = {.n_seq = B, .n_known = s->n_known, .tokens = s->tokens,
                          .known_pos = s->known_pos, .class_vectors = s->class_vectors};
    /* The conditional rows of the predicted positions are all emit_outputs reads. */
    predicted_rows(tc, s, B, tc->read_rows);
    const mc_mar_read_rows predicted = {.n_groups = 1, .rows = {tc->read_rows}, .per_seq = {s->n_pred}};
    MC_TRY(mc_mar_transformer_ex(mar, &batch, NULL, 0, NULL, NULL, &predicted, err));
    stats->encoder_rows = B * (P + s->n_known);
    stats->decoder_rows = stats->decoder_kept_rows = B * L;
    stats->flops = mc_mar_transformer_flops(c, B, s->n_known, s->n_pred);
    return emit_outputs(tc, s, mc_mar_decoder_activations(mar), L, NULL, z, err);
}

/* Encoder phase of a cached step. With the encoder cache: the buffer rows
 * and the tokens revealed last step, against the per-layer cache of every
 * visible token (stale where not recomputed), refreshing their rows of the
 * cached decoder input. Without: the plain encoder on the cached sequences.
 * Either way f [nc, P + S, Dd] receives this step's decoder input. */
static mc_status encoder_phase(mc_mar_caches *tc, const mc_mar_step *s, float *f, double *flops,
                               mc_mar_transformer_stats *stats, mc_err *err) {
    mc_mar *mar = tc->mar;
    mc_backend *be = mar->backend;
    const mc_ops *ops = be->ops;
    const mc_mar_config *c = &mar->config;
    const int64_t B = s->n_images, nc = tc->n_cache_seq, P = c->buffer_size, S = c->seq_len, L = P + S;
    const int64_t D = c->width, Dd = c->dec_width;
    if (!tc->encoder_cache) {
        const int64_t K = s->n_known, rows = P + K;
        float *x = MC_POLICY_FLOATS(tc, enc_x, (size_t)(nc * rows * D), err);
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
                              1, x, D, err));
        MC_TRY(mc_mar_decoder_init(mar, f, nc, err));
        MC_TRY(mc_mar_decoder_input(mar, x, nc, K, s->known_pos, f, err));
        *flops += mc_flops_mar_encoder(c, nc, K, rows, rows);
        stats->encoder_rows = nc * rows;
        return MC_OK;
    }

    const int64_t p = tc->n_prev;
    int32_t *host = malloc((size_t)(nc * (P + p + 1) + nc * (p + 1)) * sizeof(int32_t));
    if (host == NULL)
        return mc_fail_nomem_n(err, (size_t)(nc * (P + p + 1) + nc * (p + 1)), sizeof(int32_t),
                               "the encoder's cache slots of %lld sequences", (long long)nc);
    int32_t *slots = host, *new_pos = host + nc * (P + p + 1);
    for (int64_t q = 0; q < nc; q++) {
        for (int64_t r = 0; r < P; r++)
            slots[q * (P + p) + r] = (int32_t)r;
        for (int64_t i = 0; i < p; i++) {
            slots[q * (P + p) + P + i] = (int32_t)(tc->enc_filled + i);
            new_pos[q * p + i] = tc->prev_pred[(q % B) * p + i];
        }
    }
    const int64_t q_rows = P + p, keys = tc->enc_filled + p;
    mc_status st = MC_OK;
    float *x = MC_POLICY_FLOATS(tc, enc_x, (size_t)(nc * q_rows * D), err);
    mc_mar_batch batch = {.n_seq = nc, .n_known = p, .tokens = s->tokens, .known_pos = new_pos,
                          .class_vectors = s->class_vectors};
    st = x ? mc_mar_encoder_input(mar, &batch, x, err) : err->status;
    for (int64_t i = 0; st == MC_OK && i < c->enc_depth; i++) {
        mc_mar_kv_io io = {.k_store = tc->enc_k[i], .v_store = tc->enc_v[i], .store_seq = nc,
                           .store_cap = L, .store_slots = slots, .k_attend = tc->enc_k[i],
                           .v_attend = tc->enc_v[i], .attend_rows = keys, .attend_cap = L};
        st = mc_mar_block_attn(mar, &mar->enc_blocks[i], x, nc, q_rows, D, c->enc_heads, &io, err);
        if (st == MC_OK)
            st = mc_mar_block_mlp(mar, &mar->enc_blocks[i], x, nc * q_rows, D, c->mlp_hidden, err);
    }
    if (st == MC_OK)
        st = ops->layernorm(be, x, D, nc * q_rows, D, mar->enc_norm_w, mar->enc_norm_b, 1e-6f, NULL, NULL,
                            0, 1, x, D, err);
    if (st == MC_OK)
        st = mc_mar_decoder_input(mar, x, nc, p, new_pos, tc->dec_input, err);
    if (st == MC_OK)
        st = ops->copy(be, f, tc->dec_input, (size_t)(nc * L * Dd) * sizeof(float), err);
    free(host);
    tc->enc_filled = keys;
    *flops += mc_flops_mar_encoder(c, nc, p, q_rows, keys);
    stats->encoder_rows = nc * q_rows;
    return st;
}

mc_status mc_mar_caches_full_layers(mc_mar_caches *tc, float *f, int64_t first, int64_t last, double *flops,
                                    mc_err *err) {
    mc_mar *mar = tc->mar;
    const mc_mar_config *c = &mar->config;
    const int64_t nc = tc->n_cache_seq, L = c->buffer_size + c->seq_len, Dd = c->dec_width;
    for (int64_t i = first; i < last; i++) {
        MC_TRY(mc_mar_block_attn(mar, &mar->dec_blocks[i], f, nc, L, Dd, c->dec_heads, NULL, err));
        MC_TRY(mc_mar_block_mlp(mar, &mar->dec_blocks[i], f, nc * L, Dd, c->dec_mlp_hidden, err));
        *flops += mc_flops_block_attn(nc, L, L, Dd) + mc_flops_block_mlp(nc * L, Dd, c->dec_mlp_hidden);
    }
    return MC_OK;
}

mc_status mc_mar_caches_keep_rows(mc_mar_caches *tc, const mc_mar_step *s, const float *f, int64_t first_candidate,
                                  int32_t *kept, int64_t keep, float **xk, mc_err *err) {
    const mc_mar_config *c = &tc->mar->config;
    const int64_t B = s->n_images, nc = tc->n_cache_seq, P = c->buffer_size, L = P + c->seq_len, p = tc->n_prev;
    for (int64_t q = 0; q < nc; q++) {
        const int64_t b = q % B;
        mc_rows_choose(tc->scores_host + q * L, L, P, first_candidate, s->pred_pos + b * s->n_pred, s->n_pred,
                       tc->prev_pred + b * p, p, keep, tc->taken, tc->order, kept + q * keep);
    }
    *xk = MC_POLICY_FLOATS(tc, kept_x, (size_t)(nc * keep * c->dec_width), err);
    if (*xk == NULL)
        return err->status;
    return mc_rows_gather(tc->mar, f, nc, L, c->dec_width, kept, keep, &tc->acts->rows, *xk, err);
}

/* The fresh rows are written into the cache first, so attending to all
 * P + S cached rows is exactly the online-softmax merge of fresh and cached K/V. */
mc_status mc_mar_caches_cache_aware_layers(mc_mar_caches *tc, const mc_mar_step *s, float *xk, const int32_t *kept,
                                           int64_t keep, int64_t first, double *flops, mc_err *err) {
    mc_mar *mar = tc->mar;
    const mc_mar_config *c = &mar->config;
    const int64_t nc = tc->n_cache_seq, B = s->n_images, P = c->buffer_size, L = P + c->seq_len;
    const int64_t Dd = c->dec_width;
    for (int64_t i = first; i + 1 < c->dec_depth; i++) {
        mc_mar_kv_io io = {.k_store = tc->dec_k[i], .v_store = tc->dec_v[i], .store_seq = nc, .store_cap = L,
                           .store_slots = kept, .k_attend = tc->dec_k[i], .v_attend = tc->dec_v[i],
                           .attend_rows = L, .attend_cap = L};
        MC_TRY(mc_mar_block_attn(mar, &mar->dec_blocks[i], xk, nc, keep, Dd, c->dec_heads, &io, err));
        MC_TRY(mc_mar_block_mlp(mar, &mar->dec_blocks[i], xk, nc * keep, Dd, c->dec_mlp_hidden, err));
        *flops += mc_flops_block_attn(nc, keep, L, Dd) + mc_flops_block_mlp(nc * keep, Dd, c->dec_mlp_hidden);
    }
    const int64_t last = c->dec_depth - 1;
    if (last < first)
        return MC_OK;
    /* The last layer's outputs are read at the predicted rows alone: where
     * each sits among its sequence's kept rows (kept_slot, as emit_outputs
     * finds them afterwards). */
    for (int64_t q = 0; q < nc; q++)
        for (int64_t i = 0; i < s->n_pred; i++) {
            const int32_t row = (int32_t)(P + s->pred_pos[(q % B) * s->n_pred + i]);
            const int64_t k = kept_slot(kept + q * keep, keep, row);
            if (k < 0)
                return mc_fail(err, MC_ERR_INTERNAL, "predicted row %d is not among sequence %lld's kept rows", row,
                               (long long)q);
            tc->read_rows[q * s->n_pred + i] = (int32_t)k;
        }
    const mc_mar_read_rows predicted = {.n_groups = 1, .rows = {tc->read_rows}, .per_seq = {s->n_pred}};
    mc_mar_kv_io io = {.k_store = tc->dec_k[last], .v_store = tc->dec_v[last], .store_seq = nc, .store_cap = L,
                       .store_slots = kept, .k_attend = tc->dec_k[last], .v_attend = tc->dec_v[last],
                       .attend_rows = L, .attend_cap = L};
    MC_TRY(mc_mar_block_read_rows(mar, &mar->dec_blocks[last], xk, nc, keep, Dd, c->dec_heads, c->dec_mlp_hidden,
                                  &io, &predicted, err));
    *flops += mc_flops_block_read_rows(nc, keep, s->n_pred, L, Dd, c->dec_mlp_hidden);
    return MC_OK;
}

mc_status mc_mar_caches_cached_step(mc_mar_caches *tc, const mc_mar_step *s, int64_t keep,
                                    mc_mar_cached_decoder decoder, void *policy, float *z,
                                    mc_mar_transformer_stats *stats, mc_err *err) {
    mc_mar *mar = tc->mar;
    const mc_mar_config *c = &mar->config;
    const int64_t nc = tc->n_cache_seq, L = c->buffer_size + c->seq_len, Dd = c->dec_width;
    double flops = 0.0;
    float *f = MC_POLICY_FLOATS(tc, dec_x, (size_t)(nc * L * Dd), err);
    if (f == NULL)
        return err->status;
    MC_TRY(encoder_phase(tc, s, f, &flops, stats, err));
    stats->decoder_rows = nc * L;
    float *x = f;
    mc_status st = decoder(policy, s, f, tc->kept, keep, &x, &flops, err);
    if (st == MC_OK)
        st = emit_outputs(tc, s, x, keep, tc->kept, z, err);
    stats->decoder_kept_rows = nc * keep;
    stats->kept_rows = tc->kept;
    stats->kept_sequences = nc;
    stats->kept_per_sequence = keep;
    stats->flops = flops;
    return st;
}

void mc_mar_caches_remember(mc_mar_caches *tc, const mc_mar_step *s) {
    memcpy(tc->prev_pred, s->pred_pos, (size_t)(s->n_images * s->n_pred) * sizeof(int32_t));
    tc->n_prev = s->n_pred;
}

mc_status mc_mar_caches_check_step(const mc_mar_caches *tc, const mc_mar_step *s, const char *policy, mc_err *err) {
    if (tc->cfg_on && !s->cfg_on && tc->n_cache_seq > s->n_images)
        return mc_fail(err, MC_ERR_VALUE,
                       "%s: a guidance-free step needs the condition cache (without it the policy caches both "
                       "CFG halves, and the step computes only the conditional one)", policy);
    return MC_OK;
}

/* LazyMAR cache policy (spec lazymar.md). Besides the caches both token
 * policies keep (mar_caches.h), LazyMAR keeps V of the selection layer for
 * two steps (ping-pong): the ranking compares this step's V with the last. */
#include "lazymar.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "flops.h"
#include "mar_caches.h"
#include "rows.h"

static const mc_config_field lazymar_fields[] = {
    MC_FIELD_BOOL_AT(mc_lazymar_config, token_cache),
    MC_FIELD_BOOL_AT(mc_lazymar_config, cond_cache),
    MC_FIELD_INT_AT(mc_lazymar_config, start, 0, MC_FIELD_INT_MAX),
    MC_FIELD_INT_AT(mc_lazymar_config, period, 1, MC_FIELD_INT_MAX),
    MC_FIELD_FLOATS_AT(mc_lazymar_config, retention, MC_LAZYMAR_TABLE, 0, 1),
    MC_FIELD_INT_AT(mc_lazymar_config, select_layer, 0, MC_FIELD_INT_MAX),
    MC_FIELD_INT_AT(mc_lazymar_config, margin, 0, MC_FIELD_INT_MAX),
    MC_HEAD_CACHE_FIELDS(mc_lazymar_config, head),
    MC_FIELDS_END,
};

typedef struct lazymar_state {
    mc_mar_caches tc; /* first: the shared ops (mar_caches.h) read it through the state pointer */
    mc_lazymar_config cfg;
    float *select_v[2]; /* V of the selection layer, this and the previous step */
    int select_v_current;
} lazymar_state;

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

static mc_status lazymar_check(const void *config, const mc_mar_config *model, mc_err *err) {
    const mc_lazymar_config *cfg = config;
    if (cfg->start < 0 || cfg->period < 1)
        return mc_fail(err, MC_ERR_VALUE, "LazyMAR: start must be >= 0 and period >= 1 (got %d, %d)",
                       cfg->start, cfg->period);
    if (cfg->token_cache && (cfg->select_layer < 0 || cfg->select_layer >= model->dec_depth))
        return mc_fail(err, MC_ERR_VALUE, "LazyMAR: select_layer %d is outside the decoder's 0..%lld",
                       cfg->select_layer, (long long)model->dec_depth - 1);
    if (cfg->margin < 0)
        return mc_fail(err, MC_ERR_VALUE, "LazyMAR: margin must be >= 0");
    for (int i = 0; i < MC_LAZYMAR_TABLE; i++)
        if (!(cfg->retention[i] >= 0.0f && cfg->retention[i] <= 1.0f))
            return mc_fail(err, MC_ERR_VALUE, "LazyMAR: retention[%d] = %g is outside [0, 1]", i,
                           (double)cfg->retention[i]);
    return mc_head_cache_check(&cfg->head, "LazyMAR", err);
}

static void lazymar_release(void *state) {
    lazymar_state *lz = state;
    mc_backend *be = lz->tc.mar ? lz->tc.mar->backend : NULL;
    for (int i = 0; i < 2; i++)
        if (lz->select_v[i] != NULL)
            be->ops->release(be, lz->select_v[i]);
    mc_mar_caches_release(&lz->tc);
}

static mc_status lazymar_init(void *state, mc_mar *mar, const void *config, const mc_mar_run_shape *run,
                              mc_err *err) {
    lazymar_state *lz = state;
    const mc_lazymar_config *cfg = config;
    const mc_mar_config *c = &mar->config;
    lz->cfg = *cfg;
    /* The token cache keeps decoder K/V only for the layers after the
     * selection layer: they are the ones that attend to a cache. */
    MC_TRY(mc_mar_caches_init(&lz->tc, mar, run, cfg->token_cache, cfg->cond_cache, cfg->token_cache,
                              cfg->select_layer + 1, &cfg->head, err));
    const int64_t L = c->buffer_size + c->seq_len;
    for (int i = 0; cfg->token_cache && i < 2; i++)
        if ((lz->select_v[i] = mc_mar_caches_buffer(&lz->tc, (size_t)(lz->tc.n_cache_seq * L * c->dec_width), err,
                                                    "LazyMAR's ranking V (%d of 2)", i + 1)) == NULL)
            return err->status;
    return MC_OK;
}

/* LazyMAR decoder (lazymar.md 5.2-5.5): every row up to the selection layer,
 * its attention over all rows with V kept for the ranking, then only the
 * `keep` least similar rows (plus the forced ones) in the later layers. */
static mc_status lazymar_decoder(void *policy, const mc_mar_step *s, float *f, int32_t *kept, int64_t keep,
                                 float **out, double *flops, mc_err *err) {
    lazymar_state *lz = policy;
    mc_mar_caches *tc = &lz->tc;
    mc_mar *mar = tc->mar;
    mc_backend *be = mar->backend;
    const mc_ops *ops = be->ops;
    const mc_mar_config *c = &mar->config;
    const int64_t nc = tc->n_cache_seq, L = c->buffer_size + c->seq_len;
    const int64_t Dd = c->dec_width, sel = lz->cfg.select_layer;
    MC_TRY(mc_mar_caches_full_layers(tc, f, 0, sel, flops, err));
    float *v_old = lz->select_v[lz->select_v_current];
    lz->select_v_current ^= 1;
    float *v_new = lz->select_v[lz->select_v_current];
    mc_mar_kv_io io_sel = {.v_store = v_new, .store_seq = nc, .store_cap = L};
    MC_TRY(mc_mar_block_attn(mar, &mar->dec_blocks[sel], f, nc, L, Dd, c->dec_heads, &io_sel, err));
    *flops += mc_flops_block_attn(nc, L, L, Dd);
    float *scores = MC_POLICY_FLOATS(tc, scores, (size_t)(nc * L), err);
    if (scores == NULL)
        return err->status;
    MC_TRY(ops->cosine_rows(be, v_new, Dd, v_old, Dd, nc * L, (int)c->dec_heads, (int)(Dd / c->dec_heads),
                            scores, err));
    MC_TRY(ops->download(be, tc->scores_host, scores, (size_t)(nc * L) * sizeof(float), err));
    float *xk;
    MC_TRY(mc_mar_caches_keep_rows(tc, s, f, 0, kept, keep, &xk, err));
    MC_TRY(mc_mar_block_mlp(mar, &mar->dec_blocks[sel], xk, nc * keep, Dd, c->dec_mlp_hidden, err));
    *flops += mc_flops_block_mlp(nc * keep, Dd, c->dec_mlp_hidden);
    MC_TRY(mc_mar_caches_cache_aware_layers(tc, s, xk, kept, keep, sel + 1, flops, err));
    *out = xk;
    return MC_OK;
}

static mc_status lazymar_transformer(void *state, const mc_mar_step *s, float *z, mc_mar_transformer_stats *stats,
                                     mc_err *err) {
    lazymar_state *lz = state;
    mc_mar_caches *tc = &lz->tc;
    const int64_t L = tc->mar->config.buffer_size + tc->mar->config.seq_len;
    mc_status st;
    MC_TRY(mc_mar_caches_check_step(tc, s, "LazyMAR", err));
    if (mc_lazymar_full_step(&lz->cfg, s->step) || (!lz->cfg.token_cache && !tc->cond_cache)) {
        float *select_v = NULL;
        if (lz->cfg.token_cache) { /* the full step's V becomes the next ranking's "previous" */
            lz->select_v_current ^= 1;
            select_v = lz->select_v[lz->select_v_current];
        }
        st = mc_mar_caches_full_step(tc, s, select_v, lz->cfg.select_layer, z, stats, err);
    } else if (lz->cfg.token_cache) {
        const int64_t keep = mc_lazymar_keep(&lz->cfg, s->step, s->num_steps, s->n_pred, tc->n_prev, L);
        st = mc_mar_caches_cached_step(tc, s, keep, lazymar_decoder, lz, z, stats, err);
    } else {
        st = mc_mar_caches_cond_only_step(tc, s, z, stats, err);
    }
    if (st == MC_OK)
        mc_mar_caches_remember(tc, s);
    return st;
}

const mc_mar_policy_ops mc_lazymar_policy = MC_MAR_CACHED_POLICY_OPS(lazymar, "lazymar", lazymar_fields, mc_lazymar_config,
                                                                   lazymar_release);

/* MARche cache policy (spec marche.md 2-3): full prefix layers, refreshing
 * rows picked by the attention mass the generating rows put on them at the
 * selection layer, cache-aware attention for the active rows in the later
 * layers. The caches it shares with LazyMAR live in mar_caches.c. */
#include "marche.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "flops.h"
#include "mar_caches.h"
#include "rows.h"

static const mc_config_field marche_fields[] = {
    MC_FIELD_BOOL_AT(mc_marche_config, encoder_cache),
    MC_FIELD_BOOL_AT(mc_marche_config, cond_cache),
    MC_FIELD_INT_AT(mc_marche_config, refresh_phase, 0, MC_FIELD_INT_MAX),
    MC_FIELD_INT_AT(mc_marche_config, refresh_period, 1, MC_FIELD_INT_MAX),
    MC_FIELD_INT_AT(mc_marche_config, budget, 1, MC_FIELD_INT_MAX),
    MC_FIELD_INT_AT(mc_marche_config, full_layers, 1, MC_FIELD_INT_MAX),
    MC_FIELD_INT_AT(mc_marche_config, select_layer, 1, MC_FIELD_INT_MAX),
    MC_FIELD_CHOICE_AT(mc_marche_config, candidates, "all|image"),
    MC_FIELD_CHOICE_AT(mc_marche_config, refresh, "high|low"),
    MC_HEAD_CACHE_FIELDS(mc_marche_config, head),
    MC_FIELDS_END,
};

typedef struct marche_state {
    mc_mar_caches tc; /* first: the shared ops (mar_caches.h) read it through the state pointer */
    mc_marche_config cfg;
} marche_state;

int64_t mc_marche_active_count(const mc_marche_config *cfg, int64_t generating, int64_t caching, int64_t rows,
                               int64_t candidates) {
    int64_t forced = generating + caching;
    int64_t active = cfg->budget > forced ? cfg->budget : forced;
    if (active > forced + candidates)
        active = forced + candidates;
    return active < rows ? active : rows;
}

static int marche_full_step(const mc_marche_config *cfg, int step) {
    return step < cfg->refresh_phase || (step - cfg->refresh_phase) % cfg->refresh_period == 0;
}

static mc_status marche_check(const void *config, const mc_mar_config *model, mc_err *err) {
    const mc_marche_config *cfg = config;
    if (cfg->refresh_phase < 0 || cfg->refresh_period < 1)
        return mc_fail(err, MC_ERR_VALUE, "MARche: refresh_phase must be >= 0 and refresh_period >= 1 (got %d, %d)",
                       cfg->refresh_phase, cfg->refresh_period);
    if (cfg->budget < 1)
        return mc_fail(err, MC_ERR_VALUE, "MARche: budget must be >= 1, got %d", cfg->budget);
    if (cfg->full_layers < 1 || cfg->full_layers > model->dec_depth)
        return mc_fail(err, MC_ERR_VALUE, "MARche: full_layers %d is outside 1..%lld", cfg->full_layers,
                       (long long)model->dec_depth);
    if (cfg->select_layer < 1 || cfg->select_layer > cfg->full_layers)
        return mc_fail(err, MC_ERR_VALUE,
                       "MARche: the selection layer (%d, 1-based) must be one of the %d full layers",
                       cfg->select_layer, cfg->full_layers);
    return mc_head_cache_check(&cfg->head, "MARche", err);
}

static mc_status marche_init(void *state, mc_mar *mar, const void *config, const mc_mar_run_shape *run,
                             mc_err *err) {
    marche_state *mc = state;
    mc->cfg = *(const mc_marche_config *)config;
    /* Decoder K/V for the layers after the full prefix: they attend to a cache. */
    return mc_mar_caches_init(&mc->tc, mar, run, mc->cfg.encoder_cache, mc->cfg.cond_cache, 1, mc->cfg.full_layers,
                              &mc->cfg.head, err);
}

static mc_status marche_decoder(void *policy, const mc_mar_step *s, float *f, int32_t *active, int64_t n_active,
                                float **out, double *flops, mc_err *err) {
    marche_state *mc = policy;
    mc_mar_caches *tc = &mc->tc;
    mc_mar *mar = tc->mar;
    mc_backend *be = mar->backend;
    const mc_ops *ops = be->ops;
    const mc_mar_config *c = &mar->config;
    const int64_t B = s->n_images, nc = tc->n_cache_seq, P = c->buffer_size, L = P + c->seq_len;
    const int64_t Dd = c->dec_width, sel = mc->cfg.select_layer - 1, ng = s->n_pred;
    const int64_t hd = Dd / c->dec_heads;
    MC_TRY(mc_mar_caches_full_layers(tc, f, 0, sel, flops, err));
    MC_TRY(mc_mar_block_attn(mar, &mar->dec_blocks[sel], f, nc, L, Dd, c->dec_heads, NULL, err));
    *flops += mc_flops_block_attn(nc, L, L, Dd);
    /* Relevance from the queries of the generating rows, read from this
     * layer's fused qkv (still in the workspace). */
    const float *qkv = mc_mar_last_qkv(mar);
    float *q_gen = MC_POLICY_FLOATS(tc, scores, (size_t)(nc * ng * Dd + nc * L), err);
    int32_t *rows = malloc((size_t)(nc * ng + 1) * sizeof(int32_t));
    int32_t *d_rows = MC_POLICY_INTS(tc, rows, (size_t)(nc * ng + 1), err);
    if (q_gen == NULL || rows == NULL || d_rows == NULL) {
        free(rows);
        return rows == NULL ? mc_fail_nomem_n(err, (size_t)(nc * ng + 1), sizeof(int32_t),
                                              "MARche's query row indices of %lld sequences", (long long)nc)
                            : err->status;
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
        st = ops->download(be, tc->scores_host, mass, (size_t)(nc * L) * sizeof(float), err);
    if (st != MC_OK)
        return st;
    *flops += 2.0 * (double)(nc * ng * L) * (double)Dd;
    MC_TRY(mc_mar_block_mlp(mar, &mar->dec_blocks[sel], f, nc * L, Dd, c->dec_mlp_hidden, err));
    *flops += mc_flops_block_mlp(nc * L, Dd, c->dec_mlp_hidden);
    MC_TRY(mc_mar_caches_full_layers(tc, f, sel + 1, mc->cfg.full_layers, flops, err));
    /* Most attention mass first (or least, as an ablation): rank by the
     * negated mass, flipped in place in the host copy. */
    if (!mc->cfg.refresh)
        for (int64_t i = 0; i < nc * L; i++)
            tc->scores_host[i] = -tc->scores_host[i];
    float *xa;
    MC_TRY(mc_mar_caches_keep_rows(tc, s, f, mc->cfg.candidates ? P : 0, active, n_active, &xa, err));
    MC_TRY(mc_mar_caches_cache_aware_layers(tc, s, xa, active, n_active, mc->cfg.full_layers, flops, err));
    *out = xa;
    return MC_OK;
}

static mc_status marche_transformer(void *state, const mc_mar_step *s, float *z, mc_mar_transformer_stats *stats,
                                    mc_err *err) {
    marche_state *mc = state;
    mc_mar_caches *tc = &mc->tc;
    const mc_mar_config *c = &tc->mar->config;
    const int64_t L = c->buffer_size + c->seq_len;
    mc_status st;
    MC_TRY(mc_mar_caches_check_step(tc, s, "MARche", err));
    if (marche_full_step(&mc->cfg, s->step)) {
        st = mc_mar_caches_full_step(tc, s, NULL, 0, z, stats, err);
    } else {
        const int64_t candidates = (mc->cfg.candidates ? c->seq_len : L) - s->n_pred - tc->n_prev;
        const int64_t active = mc_marche_active_count(&mc->cfg, s->n_pred, tc->n_prev, L, candidates);
        st = mc_mar_caches_cached_step(tc, s, active, marche_decoder, mc, z, stats, err);
    }
    if (st == MC_OK)
        mc_mar_caches_remember(tc, s);
    return st;
}

const mc_mar_policy_ops mc_marche_policy = MC_MAR_CACHED_POLICY_OPS(marche, "marche", marche_fields, mc_marche_config,
                                                                  mc_mar_caches_release_state);

#include "head_cache.h"

#include <stdlib.h>
#include <string.h>

mc_status mc_head_cache_check(const mc_head_cache_config *cfg, const char *policy, mc_err *err) {
    if (cfg->head_period < 1 || cfg->head_skip_first < 0 || cfg->head_skip_last < cfg->head_skip_first - 1)
        return mc_fail(err, MC_ERR_VALUE, "%s: bad head cache settings", policy);
    if (!(cfg->head_recompute_above >= 0.0 && cfg->head_recompute_above <= 1.0))
        return mc_fail(err, MC_ERR_VALUE, "%s: head_recompute_above must be in [0, 1]", policy);
    return MC_OK;
}

mc_status mc_head_cache_init(mc_head_cache_state *hc, mc_mar *mar, const mc_head_cache_config *cfg, mc_err *err) {
    memset(hc, 0, sizeof *hc);
    hc->mar = mar;
    hc->cfg = *cfg;
    hc->blocks = calloc((size_t)mar->config.head_depth, sizeof(float *));
    if (hc->blocks == NULL)
        return mc_fail_nomem_n(err, (size_t)mar->config.head_depth, sizeof(float *), "the head cache's block table");
    return MC_OK;
}

void mc_head_cache_release(mc_head_cache_state *hc) {
    if (hc->buffer != NULL)
        hc->mar->backend->ops->release(hc->mar->backend, hc->buffer);
    free(hc->blocks);
    free(hc->modes);
    memset(hc, 0, sizeof *hc);
}

size_t mc_head_cache_bytes(const mc_head_cache_state *hc) { return hc->buffer_floats * sizeof(float); }

mc_status mc_head_cache_reserve(mc_head_cache_state *hc, int64_t live_rows, mc_err *err) {
    if (!hc->cfg.head_cache)
        return MC_OK;
    const mc_mar_config *c = &hc->mar->config;
    mc_backend *be = hc->mar->backend;
    const size_t per_block = (size_t)(live_rows * c->head_width);
    const size_t need = per_block * (size_t)c->head_depth;
    if (hc->buffer_floats < need) {
        if (hc->buffer != NULL)
            be->ops->release(be, hc->buffer);
        hc->buffer_floats = 0;
        if ((hc->buffer = be->ops->alloc(be, need * sizeof(float), "the diffusion head cache", err)) == NULL)
            return err->status;
        hc->buffer_floats = need;
    }
    for (int64_t j = 0; j < c->head_depth; j++)
        hc->blocks[j] = hc->buffer + (size_t)j * per_block;
    hc->cache.skip_first = hc->cfg.head_skip_first;
    hc->cache.skip_last = hc->cfg.head_skip_last;
    hc->cache.live_rows = live_rows;
    /* A block is either skipped (it keeps a delta) or computed (it keeps its
     * MLP output), so one buffer per block serves both. */
    hc->cache.mlp = hc->blocks;
    hc->cache.delta = hc->blocks;
    return MC_OK;
}

mc_status mc_head_cache_plan(mc_head_cache_state *hc, int64_t live_rows, int n_steps, mc_mar_head_plan *plan,
                             mc_err *err) {
    plan->cache = NULL;
    plan->modes = NULL;
    plan->guidance_off = 0;
    if (!hc->cfg.head_cache)
        return MC_OK;
    MC_TRY(mc_head_cache_reserve(hc, live_rows, err));
    if (hc->n_modes < n_steps) { /* grow-only: DiSA changes the step count between AR steps */
        mc_head_mode *fresh = realloc(hc->modes, (size_t)n_steps * sizeof *fresh);
        if (fresh == NULL)
            return mc_fail_nomem_n(err, (size_t)n_steps, sizeof *fresh, "the head cache's schedule of %d steps",
                                   n_steps);
        hc->modes = fresh;
        hc->n_modes = n_steps;
    }
    /* Full evaluations at the first step (j = T - 1) and every head_period-th;
     * in between, the MLPs are recomputed while j > recompute_above * T. */
    for (int j = 0; j < n_steps; j++) {
        if (j == n_steps - 1 || j % hc->cfg.head_period == 0)
            hc->modes[j] = MC_HEAD_STORE;
        else
            hc->modes[j] = (double)j > hc->cfg.head_recompute_above * n_steps ? MC_HEAD_RECOMPUTE : MC_HEAD_REUSE;
    }
    plan->cache = &hc->cache;
    plan->modes = hc->modes;
    return MC_OK;
}

mc_status mc_head_forward(mc_mar *m, const float *x, int64_t rows, int x_duplicated, const float *c_emb,
                          const float *t_emb, float *out, const mc_head_cache *cache, mc_head_mode mode, mc_err *err) {
    if (cache == NULL || mode == MC_HEAD_PLAIN)
        return mc_mar_head_forward(m, x, rows, x_duplicated, c_emb, t_emb, out, err);
    mc_backend *be = m->backend;
    const mc_ops *ops = be->ops;
    const int64_t W = m->config.head_width, live = cache->live_rows;
    if ((mode == MC_HEAD_RECOMPUTE || mode == MC_HEAD_REUSE) && rows != live)
        return mc_fail(err, MC_ERR_INTERNAL, "head: cached evaluation needs the live rows only");
    mc_mar_head_acts a;
    MC_TRY(mc_mar_head_activations(m, rows, &a, err));
    MC_TRY(mc_mar_head_embed(m, &a, x, rows, x_duplicated, c_emb, t_emb, err));
    for (int64_t j = 0; j < m->config.head_depth; j++) {
        const int skipped = j >= cache->skip_first && j <= cache->skip_last;
        if (skipped && mode != MC_HEAD_STORE) {
            MC_TRY(ops->add_rows(be, a.h, W, rows, W, cache->delta[j], W, rows, err));
            continue;
        }
        if (mode == MC_HEAD_REUSE) {
            MC_TRY(mc_mar_head_block_gate(m, j, &a, rows, err));
            MC_TRY(ops->gated_add(be, a.h, W, cache->mlp[j], W, a.ada, W, 1, rows, W, err));
            continue;
        }
        if (skipped) /* STORE: delta = h_after - h_before, live rows */
            MC_TRY(ops->axpby(be, -1.0f, a.h, W, 0.0f, cache->delta[j], W, live, W, err));
        MC_TRY(mc_mar_head_block_mlp(m, j, &a, rows, err));
        if (!skipped)
            MC_TRY(ops->copy(be, cache->mlp[j], a.u, (size_t)(live * W) * sizeof(float), err));
        MC_TRY(ops->gated_add(be, a.h, W, a.u, W, a.ada + 2 * W, 3 * W, 1, rows, W, err));
        if (skipped)
            MC_TRY(ops->axpby(be, 1.0f, a.h, W, 1.0f, cache->delta[j], W, live, W, err));
    }
    return mc_mar_head_final(m, &a, rows, out, err);
}

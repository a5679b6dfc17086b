/* FastVAR (Guo et al., "FastVAR: Linear Visual Autoregressive Modeling via
 * Cached Token Pruning", arXiv 2503.23367) for class-conditional VAR: the
 * cached token pruning of var_fastvar.md Part D (D1-D4, D8), as the
 * official HART/Infinity code applies it, on FoundationVision's VAR.
 *
 * At the cache scale every block in the layer range runs in full and keeps
 * both sublayers' outputs (after gamma) for every row. At a pruned scale
 * (ratio rho), inside every block of the range and separately for the
 * attention and the FFN sublayer:
 *   1. PTS: each sequence's rows are scored by their squared distance to the
 *      sequence's mean row (the residual stream entering the sublayer; CFG
 *      rows separately); the K = L - floor(rho L) largest are kept, a tie
 *      going to the lower row index, in raster order (the pivotal_rows op);
 *   2. the sublayer (LN -> adaLN -> attention or FFN -> gamma) runs on the
 *      kept rows only; the attention appends only their K/V to the block's
 *      cache and attends to everything the block holds plus them;
 *   3. CTR: the cached output of the same block and sublayer is area-resized
 *      from the cache scale to the scale's size (resize_area), the kept
 *      rows' fresh outputs are scattered over it, and the result is added to
 *      the residual.
 * A ratio of 1 skips the scale (trailing scales only; the VQ update of the
 * scales run is decoded as is), as does skip_last. Blocks outside the layer
 * range and scales that are neither cached nor pruned run in full; each
 * block keeps its own K/V length, since pruned scales append fewer rows.
 * The logits of all rows, guidance, sampling and the VQ update stay the
 * sampler's. Without a pruned scale (prune all -1) this is exactly NoCache:
 * the plain transformer, no cache.
 *
 * An unguided scale (a composing CfgFreeLate) reaches the transformer with
 * the conditional sequences alone, the first n_images of the run: their
 * rows are the first of every buffer and of the cache (sequence-major), so
 * the same code runs on fewer sequences, restoring from the conditional
 * half of the cache. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "flops.h"
#include "var_policy.h"

/* A scale's `prune` entry when the scale is left alone. */
#define FASTVAR_NOT_PRUNED (-1.0)

enum { FASTVAR_ATTN = 0, FASTVAR_FFN = 1 };

/* The fields of marcache.FastVAR's as_dict() (marcache/policies/fastvar.py). */
typedef struct mc_fastvar_config {
    int cache_scale;                 /* the scale whose sublayer outputs are cached */
    double prune[MC_VAR_MAX_SCALES]; /* per scale: rho in [0, 1] (1 = skip), or -1 = not pruned */
    int layer_first, layer_stop;     /* pruned blocks [layer_first, layer_stop); stop -1 = the depth */
    int skip_last;                   /* trailing scales skipped (as ratio 1) */
} mc_fastvar_config;

static const mc_config_field fastvar_fields[] = {
    MC_FIELD_INT_AT(mc_fastvar_config, cache_scale, 0, MC_VAR_MAX_SCALES - 1),
    MC_FIELD_DOUBLES_AT(mc_fastvar_config, prune, MC_VAR_MAX_SCALES, -1, 1),
    MC_FIELD_INT_AT(mc_fastvar_config, layer_first, 0, MC_FIELD_INT_MAX),
    MC_FIELD_INT_AT(mc_fastvar_config, layer_stop, -1, MC_FIELD_INT_MAX),
    MC_FIELD_INT_AT(mc_fastvar_config, skip_last, 0, MC_VAR_MAX_SCALES - 1),
    MC_FIELDS_END,
};

/* Scale si is pruned: a ratio in [0, 1). */
static int is_pruned(const mc_fastvar_config *cfg, int si) {
    return cfg->prune[si] != FASTVAR_NOT_PRUNED && cfg->prune[si] < 1.0;
}

static int is_skipped(const mc_fastvar_config *cfg, int si, int n_scales) {
    return si >= n_scales - cfg->skip_last || cfg->prune[si] == 1.0;
}

/* Rows kept of L at ratio rho: L - floor(rho L), the official r = int(L * ratio)
 * (Python's product in double, truncated). */
static int64_t kept_rows(int64_t rows, double rho) { return rows - (int64_t)floor((double)rows * rho); }

static mc_status fastvar_check(const void *config, const mc_var_config *model, mc_err *err) {
    const mc_fastvar_config *cfg = config;
    const int n = model->n_scales;
    const int depth = (int)model->depth;
    if (cfg->cache_scale < 0 || cfg->cache_scale >= n)
        return mc_fail(err, MC_ERR_VALUE, "FastVAR.cache_scale = %d is outside the model's scales 0..%d",
                       cfg->cache_scale, n - 1);
    for (int si = 0; si < MC_VAR_MAX_SCALES; si++) {
        const double rho = cfg->prune[si];
        if (rho == FASTVAR_NOT_PRUNED)
            continue;
        if (!(rho >= 0.0 && rho <= 1.0))
            return mc_fail(err, MC_ERR_VALUE, "FastVAR.prune[%d] = %g: a ratio must be in [0, 1] (1 skips the scale)",
                           si, rho);
        if (si >= n)
            return mc_fail(err, MC_ERR_VALUE, "FastVAR.prune names scale %d, but the model has scales 0..%d", si,
                           n - 1);
        if (si <= cfg->cache_scale)
            return mc_fail(err, MC_ERR_VALUE, "FastVAR.prune: scale %d is at or before the cache scale "
                           "(cache_scale = %d); pruned scales restore from it, so they come after it",
                           si, cfg->cache_scale);
    }
    if (cfg->skip_last < 0 || cfg->skip_last >= n)
        return mc_fail(err, MC_ERR_VALUE, "FastVAR.skip_last = %d: the model has %d scales, at least the first "
                       "must run", cfg->skip_last, n);
    for (int si = n - cfg->skip_last; si < n; si++)
        if (is_pruned(cfg, si))
            return mc_fail(err, MC_ERR_VALUE, "FastVAR.skip_last = %d skips scale %d, which prune gives ratio %g "
                           "(below 1: pruned, not skipped)", cfg->skip_last, si, cfg->prune[si]);
    for (int si = 0; si < n; si++)
        if (is_skipped(cfg, si, n))
            for (int later = si + 1; later < n; later++)
                if (!is_skipped(cfg, later, n))
                    return mc_fail(err, MC_ERR_VALUE, "FastVAR.prune: scale %d is skipped (ratio 1) but scale %d "
                                   "after it runs: only trailing scales can be skipped", si, later);
    const int stop = cfg->layer_stop == -1 ? depth : cfg->layer_stop;
    if (cfg->layer_first < 0 || cfg->layer_first >= stop)
        return mc_fail(err, MC_ERR_VALUE, "FastVAR.layers = (%d, %d): needs 0 <= start < stop", cfg->layer_first,
                       cfg->layer_stop);
    if (stop > depth)
        return mc_fail(err, MC_ERR_VALUE, "FastVAR.layers = (%d, %d) is outside the model's blocks 0..%d (start, "
                       "stop with stop <= %d)", cfg->layer_first, cfg->layer_stop, depth - 1, depth);
    return MC_OK;
}

typedef struct fastvar_state {
    mc_var *var;
    mc_fastvar_config cfg;
    int n_scales, layer_first, layer_stop;
    int pruning;                   /* a scale is pruned (ratio < 1): the cache is kept */
    int64_t n_seq, width, depth;   /* n_seq: the run's sequences, the cache's stride */
    int64_t n_images;              /* the conditional half: the sequences of an unguided scale */
    int64_t cache_pn, cache_tokens;
    /* backend */
    float *cache;     /* [layers][2][n_seq * cache_tokens, C]: the cache scale's gamma * sublayer outputs */
    int32_t *kept;    /* [n_seq * max_keep]: one sublayer's kept rows (b * tokens + r) */
    float *kept_x;    /* [n_seq * max_keep, C]: their residual rows */
    float *kept_out;  /* [n_seq * max_keep, C]: their gamma * sublayer outputs */
    float *restored;  /* [n_seq * max_rows, C]: the resized cache with the kept outputs over it */
    size_t backend_bytes;
    /* host */
    int64_t *kv_used;    /* [depth]: K/V rows per sequence each block holds */
    int64_t *block_rows; /* [depth][2]: rows per sequence of each sublayer at the last scale */
    int32_t *trace_host; /* [n_seq * max_keep]: the kept rows downloaded for a trace */
} fastvar_state;

static void fastvar_release(void *state) {
    fastvar_state *s = state;
    if (s->var == NULL)
        return;
    mc_backend *be = s->var->backend;
    void *buffers[] = {s->cache, s->kept, s->kept_x, s->kept_out, s->restored};
    for (size_t i = 0; i < sizeof buffers / sizeof buffers[0]; i++)
        if (buffers[i] != NULL)
            be->ops->release(be, buffers[i]);
    free(s->kv_used);
    free(s->block_rows);
    free(s->trace_host);
}

static void *backend_alloc(fastvar_state *s, size_t bytes, const char *what, mc_err *err) {
    mc_backend *be = s->var->backend;
    void *p = be->ops->alloc(be, bytes > 0 ? bytes : 1, what, err);
    if (p != NULL)
        s->backend_bytes += bytes;
    return p;
}

static mc_status fastvar_init(void *state, mc_var *var, const void *config, const mc_var_run_shape *run,
                              mc_err *err) {
    const mc_var_config *c = &var->config;
    fastvar_state *s = state;
    s->var = var;
    s->cfg = *(const mc_fastvar_config *)config;
    s->n_scales = c->n_scales;
    s->n_seq = run->n_seq;
    s->n_images = run->n_images;
    s->width = c->width;
    s->depth = c->depth;
    s->layer_first = s->cfg.layer_first;
    s->layer_stop = s->cfg.layer_stop == -1 ? (int)c->depth : s->cfg.layer_stop;
    s->cache_pn = c->patch_nums[s->cfg.cache_scale];
    s->cache_tokens = s->cache_pn * s->cache_pn;
    int64_t max_rows = 0, max_keep = 0;
    for (int si = 0; si < c->n_scales; si++)
        if (is_pruned(&s->cfg, si)) {
            const int64_t n = c->patch_nums[si] * c->patch_nums[si];
            s->pruning = 1;
            max_rows = n > max_rows ? n : max_rows;
            max_keep = kept_rows(n, s->cfg.prune[si]) > max_keep ? kept_rows(n, s->cfg.prune[si]) : max_keep;
        }
    const size_t kv_used_bytes = (size_t)c->depth * sizeof *s->kv_used,
                 block_rows_bytes = (size_t)(2 * c->depth) * sizeof *s->block_rows,
                 trace_bytes = (size_t)(s->n_seq * (max_keep > 0 ? max_keep : 1)) * sizeof(int32_t);
    s->kv_used = calloc(1, kv_used_bytes);
    s->block_rows = calloc(1, block_rows_bytes);
    s->trace_host = malloc(trace_bytes);
    if (s->kv_used == NULL || s->block_rows == NULL || s->trace_host == NULL)
        return mc_fail_nomem(err, kv_used_bytes + block_rows_bytes + trace_bytes, "the FastVAR host state");
    if (!s->pruning)
        return MC_OK;
    const int64_t S = s->n_seq, C = s->width, layers = s->layer_stop - s->layer_first;
    s->cache = backend_alloc(s, (size_t)(layers * 2 * S * s->cache_tokens * C) * sizeof(float),
                             "FastVAR's cache of the cached scale", err);
    s->kept = s->cache ? backend_alloc(s, (size_t)(S * max_keep) * sizeof(int32_t), "FastVAR's kept rows", err) : NULL;
    s->kept_x = s->kept ? backend_alloc(s, (size_t)(S * max_keep * C) * sizeof(float), "FastVAR's kept inputs", err)
                        : NULL;
    s->kept_out =
        s->kept_x ? backend_alloc(s, (size_t)(S * max_keep * C) * sizeof(float), "FastVAR's kept outputs", err) : NULL;
    s->restored = s->kept_out
                      ? backend_alloc(s, (size_t)(S * max_rows * C) * sizeof(float), "FastVAR's restored rows", err)
                      : NULL;
    return s->restored != NULL ? MC_OK : err->status;
}

static int fastvar_scale_plan(void *state, int si) {
    const fastvar_state *s = state;
    return is_skipped(&s->cfg, si, s->n_scales) ? MC_VAR_SCALE_SKIP : MC_VAR_SCALE_RUN;
}

/* The cached gamma * output of block b's sublayer `sub`: [n_seq * cache_tokens, C]
 * (a scale of fewer sequences uses the first rows). */
static float *cache_slot(const fastvar_state *s, int b, int sub) {
    return s->cache + ((int64_t)(b - s->layer_first) * 2 + sub) * s->n_seq * s->cache_tokens * s->width;
}

/* Writes the kept rows of block b's sublayer `sub` into the caller's trace
 * (var_policy.h: ascending rows per sequence, then -1). */
static mc_status trace_kept(fastvar_state *s, const mc_var_scale *scale, int b, int sub, int64_t keep,
                            mc_err *err) {
    mc_backend *be = s->var->backend;
    const int64_t S = scale->n_seq, n = scale->tokens;
    MC_TRY(be->ops->download(be, s->trace_host, s->kept, (size_t)(S * keep) * sizeof(int32_t), err));
    for (int64_t q = 0; q < S; q++) {
        int32_t *row = scale->trace_rows + (((int64_t)b * 2 + sub) * S + q) * n;
        for (int64_t j = 0; j < n; j++)
            row[j] = j < keep ? (int32_t)(s->trace_host[q * keep + j] - q * n) : -1;
    }
    return MC_OK;
}

/* One sublayer of block b at a pruned scale: PTS, the sublayer on the kept
 * rows (the attention appends their K/V), CTR, the residual add. */
static mc_status pruned_sublayer(fastvar_state *s, const mc_var_scale *scale, int b, int sub, int64_t keep,
                                 mc_err *err) {
    mc_var *var = s->var;
    mc_backend *be = var->backend;
    const mc_ops *ops = be->ops;
    const int64_t S = scale->n_seq, n = scale->tokens, C = s->width;
    float *x = scale->x;
    MC_TRY(ops->pivotal_rows(be, x, C, S, n, C, keep, s->kept, err));
    MC_TRY(ops->gather_rows(be, x, C, s->kept, S * keep, C, s->kept_x, C, err));
    if (sub == FASTVAR_ATTN)
        MC_TRY(mc_var_attn_sublayer(var, b, s->kept_x, S, keep, s->kv_used[b], s->kept_out, MC_VAR_OUT_SET, err));
    else
        MC_TRY(mc_var_ffn_sublayer(var, b, s->kept_x, S, keep, s->kept_out, MC_VAR_OUT_SET, err));
    MC_TRY(ops->resize_area(be, cache_slot(s, b, sub), S, s->cache_pn, s->cache_pn, C, scale->pn, scale->pn,
                            s->restored, err));
    MC_TRY(ops->scatter_rows(be, s->kept_out, C, s->kept, S * keep, C, s->restored, C, err));
    /* x + restored: 1 * restored + 1 * x is exact, one rounding of the sum. */
    MC_TRY(ops->axpby(be, 1.0f, s->restored, C, 1.0f, x, C, S * n, C, err));
    return scale->trace_rows != NULL ? trace_kept(s, scale, b, sub, keep, err) : MC_OK;
}

/* One sublayer of block b at the cache scale: in full, its gamma * output
 * kept, then added to the residual (the same float32 sum as the plain
 * sublayer's x + gamma * u). */
static mc_status cached_sublayer(fastvar_state *s, const mc_var_scale *scale, int b, int sub, mc_err *err) {
    mc_var *var = s->var;
    mc_backend *be = var->backend;
    const int64_t S = scale->n_seq, n = scale->tokens, C = s->width;
    float *x = scale->x, *slot = cache_slot(s, b, sub);
    if (sub == FASTVAR_ATTN)
        MC_TRY(mc_var_attn_sublayer(var, b, x, S, n, s->kv_used[b], slot, MC_VAR_OUT_SET, err));
    else
        MC_TRY(mc_var_ffn_sublayer(var, b, x, S, n, slot, MC_VAR_OUT_SET, err));
    return be->ops->axpby(be, 1.0f, slot, C, 1.0f, x, C, S * n, C, err);
}

static mc_status fastvar_transformer(void *state, const mc_var_scale *scale, mc_var_transformer_stats *stats,
                                     mc_err *err) {
    fastvar_state *s = state;
    mc_var *var = s->var;
    const mc_var_config *c = &var->config;
    const int si = scale->si;
    const int64_t S = scale->n_seq, n = scale->tokens;
    if ((S != s->n_seq && S != s->n_images) || n != c->patch_nums[si] * c->patch_nums[si])
        return mc_fail(err, MC_ERR_INTERNAL, "FastVAR: scale %d with %lld sequences of %lld rows, created for %lld "
                       "(or their conditional %lld)", si, (long long)S, (long long)n, (long long)s->n_seq,
                       (long long)s->n_images);
    if (!s->pruning) /* nothing is pruned: NoCache exactly */
        return mc_var_plain_transformer(var, scale, stats, err);
    const int pruned = is_pruned(&s->cfg, si), caching = si == s->cfg.cache_scale;
    const int64_t keep = pruned ? kept_rows(n, s->cfg.prune[si]) : n;
    double flops = 0.0;
    int64_t sublayer_rows = 0, kv_rows = 0;
    for (int b = 0; b < (int)s->depth; b++) {
        const int in_range = b >= s->layer_first && b < s->layer_stop;
        const int64_t rows = pruned && in_range ? keep : n;
        int64_t run_rows[2];
        for (int sub = FASTVAR_ATTN; sub <= FASTVAR_FFN; sub++) {
            if (pruned && in_range)
                MC_TRY(pruned_sublayer(s, scale, b, sub, keep, err));
            else if (caching && in_range)
                MC_TRY(cached_sublayer(s, scale, b, sub, err));
            else if (sub == FASTVAR_ATTN)
                MC_TRY(mc_var_attn_sublayer(var, b, scale->x, S, n, s->kv_used[b], scale->x, MC_VAR_OUT_ADD, err));
            else
                MC_TRY(mc_var_ffn_sublayer(var, b, scale->x, S, n, scale->x, MC_VAR_OUT_ADD, err));
            run_rows[sub] = rows;
        }
        flops += mc_var_flops_fastvar_block(c, S, run_rows[0], s->kv_used[b] + run_rows[0], run_rows[1]);
        s->kv_used[b] += run_rows[0];
        s->block_rows[2 * b] = run_rows[0];
        s->block_rows[2 * b + 1] = run_rows[1];
        sublayer_rows += S * (run_rows[0] + run_rows[1]);
        kv_rows = s->kv_used[b] > kv_rows ? s->kv_used[b] : kv_rows;
    }
    stats->full = !pruned;
    stats->sublayer_rows = sublayer_rows;
    stats->kv_rows = kv_rows;
    stats->flops = flops;
    stats->block_rows = s->block_rows;
    return MC_OK;
}

static size_t fastvar_cache_bytes(const void *state) { return ((const fastvar_state *)state)->backend_bytes; }

const mc_var_policy_ops mc_var_fastvar_policy =
    MC_VAR_POLICY_OPS(fastvar, "fastvar", fastvar_fields, mc_fastvar_config);

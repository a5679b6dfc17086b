/* MAR sampling: the AR loop of mar.md 7.2 and the head sampler of 6.5.
 * Randomness comes only from core/philox, keyed by (image index, token
 * position), so an image is the same in any batch and on any backend. */
#include "mar_sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../core/philox.h"
#include "flops.h"

enum {
    WS_TOKENS = MC_MAR_WS_FIRST_FREE, WS_CLASS, WS_Z, WS_COND_EMB, WS_STATE, WS_HEAD_OUT, WS_EPS,
    WS_NOISE, WS_EPS_DELTA
}; /* slots 22..27 belong to runtime/lazymar.c */
enum { WSI_IMAGES = MC_MAR_WSI_FIRST_FREE, WSI_POSITIONS, WSI_SCATTER };

int64_t mc_mask_len_after(int64_t seq_len, int64_t masked_before, int step, int num_steps) {
    /* Same operation order as the reference: np.cos(math.pi / 2. * (step + 1) / num_iter). */
    double ratio = cos(3.14159265358979323846 / 2.0 * (double)(step + 1) / (double)num_steps);
    double mask_len = floor((double)seq_len * ratio);
    double upper = (double)(masked_before - 1);
    if (mask_len > upper)
        mask_len = upper;
    if (mask_len < 1.0)
        mask_len = 1.0;
    return (int64_t)mask_len;
}

float mc_cfg_at(double cfg, mc_cfg_schedule schedule, int64_t mask_len, int64_t seq_len) {
    if (schedule == MC_CFG_CONSTANT)
        return (float)cfg;
    /* 1 + (cfg - 1) * (seq_len - mask_len) / seq_len on float32 tensors. */
    float known_after = (float)(seq_len - mask_len);
    float scaled = (float)(cfg - 1.0) * known_after;
    return 1.0f + scaled / (float)seq_len;
}

static double seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

double mc_mar_transformer_flops(const mc_mar_config *c, int64_t n_seq, int64_t n_known) {
    const int64_t P = c->buffer_size, L = P + c->seq_len, enc_len = P + n_known;
    double f = 2.0 * (double)(n_seq * n_known) * (double)(c->token_channels * c->width);
    f += (double)c->enc_depth * (mc_flops_block_attn(n_seq, enc_len, enc_len, c->width) +
                                 mc_flops_block_mlp(n_seq * enc_len, c->width, c->mlp_hidden));
    f += 2.0 * (double)(n_seq * enc_len) * (double)(c->width * c->dec_width);
    f += (double)c->dec_depth * (mc_flops_block_attn(n_seq, L, L, c->dec_width) +
                                 mc_flops_block_mlp(n_seq * L, c->dec_width, c->dec_mlp_hidden));
    return f;
}

/* Everything one diffusion step of the head sampler reads: buffers, the
 * CFG and cache settings. One step only enqueues backend ops (no host
 * reads of device memory, no allocation once the first step has sized the
 * workspace), which is what lets a backend record steps as a graph. */
typedef struct head_loop {
    mc_mar *mar;
    const mc_diffusion *diffusion;
    int64_t n, rows;
    int cfg_on;
    float cfg;
    double temperature;
    uint64_t seed;
    const mc_lazymar_config *lcfg; /* NULL without LazyMAR's head cache */
    mc_head_cache cache;
    float *c_emb, *state, *out, *eps, *noise, *eps_delta;
    const uint32_t *d_images, *d_positions;
} head_loop;

/* LazyMAR's head cache (lazymar.md 7): full evaluations at the first step
 * and every head_period-th; in between only the live rows run, skipped
 * blocks add cached deltas, and eps_uncond = eps_cond - delta. */
static int head_step_full(const head_loop *h, int j) {
    return h->lcfg == NULL || j == h->diffusion->n_steps - 1 || j % h->lcfg->head_period == 0;
}

static mc_head_mode head_step_mode(const head_loop *h, int j) {
    if (h->lcfg == NULL)
        return MC_HEAD_PLAIN;
    if (head_step_full(h, j))
        return MC_HEAD_STORE;
    return (double)j > h->lcfg->head_recompute_above * h->diffusion->n_steps ? MC_HEAD_RECOMPUTE
                                                                            : MC_HEAD_REUSE;
}

static void head_step_stats(const head_loop *h, int j, mc_head_stats *stats) {
    const int full = head_step_full(h, j);
    const int64_t eval_rows = full ? h->rows : h->n;
    stats->flops += mc_flops_head_eval(&h->mar->config, eval_rows, full ? h->n : eval_rows,
                                       head_step_mode(h, j), h->lcfg ? h->lcfg->head_skip_first : 0,
                                       h->lcfg ? h->lcfg->head_skip_last : -1);
    if (full)
        stats->full_evaluations++;
    else
        stats->cached_evaluations++;
}

static mc_status head_step(head_loop *h, int j, mc_err *err) {
    mc_backend *be = h->mar->backend;
    const mc_ops *ops = be->ops;
    const int64_t n = h->n, C = h->mar->config.token_channels;
    const int full = head_step_full(h, j);
    h->cache.mode = head_step_mode(h, j);
    MC_TRY(mc_mar_head_forward_cached(h->mar, h->state, full ? h->rows : n, full && h->cfg_on, h->c_emb, j,
                                      h->out, h->lcfg ? &h->cache : NULL, err));
    const float *eps_used = h->out;
    int64_t ld_eps = 2 * C;
    if (h->cfg_on && full) {
        MC_TRY(ops->cfg_combine(be, h->out, 2 * C, h->out + n * 2 * C, 2 * C, n, (int)C, h->cfg, h->eps, C,
                                err));
        if (h->lcfg) { /* delta = eps_cond - eps_uncond */
            MC_TRY(ops->axpby(be, 1.0f, h->out, 2 * C, 0.0f, h->eps_delta, C, n, C, err));
            MC_TRY(ops->axpby(be, -1.0f, h->out + n * 2 * C, 2 * C, 1.0f, h->eps_delta, C, n, C, err));
        }
        eps_used = h->eps;
        ld_eps = C;
    } else if (h->cfg_on) { /* eps = eps_cond + (cfg - 1) * delta */
        MC_TRY(ops->axpby(be, 1.0f, h->out, 2 * C, 0.0f, h->eps, C, n, C, err));
        MC_TRY(ops->axpby(be, h->cfg - 1.0f, h->eps_delta, C, 1.0f, h->eps, C, n, C, err));
        eps_used = h->eps;
        ld_eps = C;
    }
    float noise_scale = j > 0 ? (float)h->temperature : 0.0f;
    if (j > 0)
        MC_TRY(ops->token_normals(be, h->seed, MC_STREAM_HEAD_STEP, (uint32_t)j, h->d_images, h->d_positions, n,
                                  (int)C, h->noise, err));
    mc_ddpm_coefs coefs = mc_diffusion_coefs(h->diffusion, j, noise_scale);
    return ops->ddpm_step(be, h->state, n, (int)C, eps_used, ld_eps, h->out + C, 2 * C, j > 0 ? h->noise : NULL,
                          &coefs, err);
}

/* Diffusion steps first..0 recorded as one backend graph and run once (the
 * graph object is kept in the model and updated in place on the next call,
 * which is cheaper than building it anew). Returns 0 when the backend has
 * no graphs or the recording failed: nothing was run then, the caller runs
 * the steps directly. A recording failure is not an error of the call. */
static int head_steps_as_graph(head_loop *h, int first, mc_err *err) {
    mc_backend *be = h->mar->backend;
    const mc_ops *ops = be->ops;
    if (ops->capture_begin == NULL || first < 0)
        return 0;
    mc_err capture_err = {0};
    if (ops->capture_begin(be, &capture_err) != MC_OK)
        return 0;
    mc_status st = MC_OK;
    for (int j = first; j >= 0 && st == MC_OK; j--)
        st = head_step(h, j, &capture_err);
    void **graph = mc_mar_head_graph(h->mar);
    if (ops->capture_end(be, graph, st == MC_OK, &capture_err) != MC_OK || st != MC_OK)
        return 0;
    return ops->graph_launch(be, *graph, err) == MC_OK ? 1 : -1;
}

mc_status mc_mar_head_sample_ex(mc_mar *mar, const mc_diffusion *diffusion, const float *z, int64_t n,
                                int cfg_on, float cfg, double temperature, uint64_t seed,
                                const uint32_t *images, const uint32_t *positions, float *x_out,
                                mc_lazymar *lazymar, mc_head_stats *stats, mc_err *err) {
    mc_backend *be = mar->backend;
    const mc_ops *ops = be->ops;
    const mc_mar_config *c = &mar->config;
    const int64_t C = c->token_channels, W = c->head_width;
    mc_head_stats local = {0};
    if (stats == NULL)
        stats = &local;
    memset(stats, 0, sizeof *stats);
    if (n == 0)
        return MC_OK;
    head_loop h = {0};
    h.mar = mar;
    h.diffusion = diffusion;
    h.n = n;
    h.rows = cfg_on ? 2 * n : n;
    h.cfg_on = cfg_on;
    h.cfg = cfg;
    h.temperature = temperature;
    h.seed = seed;
    h.c_emb = mc_mar_ws(mar, WS_COND_EMB, (size_t)(h.rows * W), err);
    h.state = mc_mar_ws(mar, WS_STATE, (size_t)(n * C), err);
    h.out = mc_mar_ws(mar, WS_HEAD_OUT, (size_t)(h.rows * 2 * C), err);
    h.eps = mc_mar_ws(mar, WS_EPS, (size_t)(n * C), err);
    h.noise = mc_mar_ws(mar, WS_NOISE, (size_t)(n * C), err);
    h.eps_delta = mc_mar_ws(mar, WS_EPS_DELTA, (size_t)(n * C), err);
    uint32_t *d_images = (uint32_t *)mc_mar_ws_index(mar, WSI_IMAGES, (size_t)n, err);
    uint32_t *d_positions = (uint32_t *)mc_mar_ws_index(mar, WSI_POSITIONS, (size_t)n, err);
    if (!h.c_emb || !h.state || !h.out || !h.eps || !h.noise || !h.eps_delta || !d_images || !d_positions)
        return err->status;
    h.d_images = d_images;
    h.d_positions = d_positions;
    const mc_lazymar_config *lcfg = lazymar ? mc_lazymar_config_of(lazymar) : NULL;
    if (lcfg != NULL && lcfg->head_cache) {
        h.lcfg = lcfg;
        MC_TRY(mc_lazymar_head_cache(lazymar, n, &h.cache, err));
    }
    MC_TRY(ops->upload(be, d_images, images, (size_t)n * sizeof(uint32_t), err));
    MC_TRY(ops->upload(be, d_positions, positions, (size_t)n * sizeof(uint32_t), err));

    MC_TRY(mc_mar_head_cond(mar, z, h.rows, h.c_emb, err));
    stats->flops += 2.0 * (double)h.rows * (double)(c->dec_width * W);
    /* Initial noise is not scaled by temperature (mar.md 6.5). */
    MC_TRY(ops->token_normals(be, seed, MC_STREAM_HEAD_INIT, 0, d_images, d_positions, n, (int)C, h.state,
                              err));
    const int T = diffusion->n_steps;
    for (int j = T - 1; j >= 0; j--)
        head_step_stats(&h, j, stats);
    /* The first step runs directly: it is a full evaluation, so it sizes
     * every workspace and scratch buffer the later steps use, and the rest
     * can be recorded without allocating. */
    MC_TRY(head_step(&h, T - 1, err));
    int graphed = head_steps_as_graph(&h, T - 2, err);
    if (graphed < 0)
        return err->status;
    stats->graph = graphed;
    if (!graphed)
        for (int j = T - 2; j >= 0; j--)
            MC_TRY(head_step(&h, j, err));
    if (x_out == NULL)
        return MC_OK;
    return ops->download(be, x_out, h.state, (size_t)(n * C) * sizeof(float), err);
}

mc_status mc_mar_head_sample(mc_mar *mar, const mc_diffusion *diffusion, const float *z, int64_t n,
                             int cfg_on, float cfg, double temperature, uint64_t seed,
                             const uint32_t *images, const uint32_t *positions, float *x_out,
                             mc_err *err) {
    return mc_mar_head_sample_ex(mar, diffusion, z, n, cfg_on, cfg, temperature, seed, images, positions,
                                 x_out, NULL, NULL, err);
}

static int compare_int32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

typedef struct generate_state {
    int32_t *orders;     /* [B, S] generation order per image */
    uint8_t *masked;     /* [B, S] 1 = unknown */
    int32_t *known_pos;  /* [B', S] */
    int32_t *pred_pos;   /* [B, S] */
    int32_t *out_rows;   /* [B' * S] */
    int32_t *class_ids;  /* [B'] */
    uint32_t *images;    /* [B * S] */
    uint32_t *positions; /* [B * S] */
    int32_t *scatter;    /* [B' * S] */
    float *zeros;        /* [S, C] */
} generate_state;

static void free_state(generate_state *g) {
    free(g->orders);
    free(g->masked);
    free(g->known_pos);
    free(g->pred_pos);
    free(g->out_rows);
    free(g->class_ids);
    free(g->images);
    free(g->positions);
    free(g->scatter);
    free(g->zeros);
}

mc_status mc_mar_generate(mc_mar *mar, const mc_diffusion *diffusion,
                          const mc_mar_generate_args *args, float *tokens_out,
                          mc_step_info *steps_out, mc_err *err) {
    mc_backend *be = mar->backend;
    const mc_ops *ops = be->ops;
    const mc_mar_config *c = &mar->config;
    const int64_t B = args->n_images, S = c->seq_len, C = c->token_channels;
    const int64_t D = c->width, Dd = c->dec_width;
    const int cfg_on = args->cfg != 1.0;
    const int64_t Bp = cfg_on ? 2 * B : B;
    if (B <= 0)
        return mc_fail(err, MC_ERR_VALUE, "n_images must be positive");
    if (args->num_steps < 1)
        return mc_fail(err, MC_ERR_VALUE, "steps must be >= 1, got %d", args->num_steps);
    if (S > MC_PHILOX_ORDER_MAX)
        return mc_fail(err, MC_ERR_VALUE, "seq_len %lld exceeds %d", (long long)S, MC_PHILOX_ORDER_MAX);

    generate_state g = {0};
    g.orders = malloc((size_t)(B * S) * sizeof(int32_t));
    g.masked = malloc((size_t)(B * S));
    g.known_pos = malloc((size_t)(Bp * S) * sizeof(int32_t));
    g.pred_pos = malloc((size_t)(B * S) * sizeof(int32_t));
    g.out_rows = malloc((size_t)(Bp * S) * sizeof(int32_t));
    g.class_ids = malloc((size_t)Bp * sizeof(int32_t));
    g.images = malloc((size_t)(B * S) * sizeof(uint32_t));
    g.positions = malloc((size_t)(B * S) * sizeof(uint32_t));
    g.scatter = malloc((size_t)(Bp * S) * sizeof(int32_t));
    g.zeros = calloc((size_t)(S * C), sizeof(float));
    if (!g.orders || !g.masked || !g.known_pos || !g.pred_pos || !g.out_rows || !g.class_ids ||
        !g.images || !g.positions || !g.scatter || !g.zeros) {
        free_state(&g);
        return mc_fail(err, MC_ERR_NOMEM, "cannot allocate sampler state for %lld images", (long long)B);
    }
    mc_status st = MC_OK;
    mc_lazymar *lazymar = NULL;
    if (args->lazymar != NULL &&
        mc_lazymar_create(mar, args->lazymar, B, cfg_on, &lazymar, err) != MC_OK) {
        free_state(&g);
        return err->status;
    }
    if (lazymar != NULL && args->lazymar->head_cache) {
        /* Size the head cache for the step that predicts the most tokens, so
         * it never grows inside the loop (the count rises along the cosine
         * schedule; growing step by step would allocate on most steps). */
        int64_t most = 0, before = S;
        for (int step = 0; step < args->num_steps && before > 0; step++) {
            const int last = step == args->num_steps - 1;
            const int64_t after = mc_mask_len_after(S, before, step, args->num_steps);
            const int64_t predicted = last ? before : before - after;
            most = predicted > most ? predicted : most;
            before = last ? 0 : after;
        }
        mc_head_cache sizing;
        if (mc_lazymar_head_cache(lazymar, B * most, &sizing, err) != MC_OK) {
            free_state(&g);
            mc_lazymar_free(lazymar);
            return err->status;
        }
    }
    float *tokens = mc_mar_ws(mar, WS_TOKENS, (size_t)(Bp * S * C), err);
    float *class_vectors = mc_mar_ws(mar, WS_CLASS, (size_t)(Bp * D), err);
    float *z = mc_mar_ws(mar, WS_Z, (size_t)(Bp * S * Dd), err);
    if (!tokens || !class_vectors || !z) {
        free_state(&g);
        mc_lazymar_free(lazymar);
        return err->status;
    }
    for (int64_t b = 0; b < Bp; b++) {
        st = ops->upload(be, tokens + b * S * C, g.zeros, (size_t)(S * C) * sizeof(float), err);
        if (st != MC_OK)
            goto done;
    }
    for (int64_t b = 0; b < B; b++) {
        mc_philox_order(args->seed, args->first_index + (uint32_t)b, (int)S, g.orders + b * S);
        g.class_ids[b] = args->labels ? args->labels[b] : -1;
        if (cfg_on)
            g.class_ids[B + b] = -1;
    }
    memset(g.masked, 1, (size_t)(B * S));
    st = mc_mar_class_vectors(mar, g.class_ids, Bp, class_vectors, err);
    if (st != MC_OK)
        goto done;

    int64_t masked_before = S;
    for (int step = 0; step < args->num_steps; step++) {
        double t0 = seconds_now();
        const int last = step == args->num_steps - 1;
        const int64_t mask_len = mc_mask_len_after(S, masked_before, step, args->num_steps);
        const int64_t n_pred = last ? masked_before : masked_before - mask_len;
        const int64_t K = S - masked_before;
        const float cfg_iter = cfg_on ? mc_cfg_at(args->cfg, args->cfg_schedule, mask_len, S) : 1.0f;

        /* Known tokens in raster order; predicted ones are the tail of the
         * order that the schedule releases now, also sorted by position. */
        for (int64_t b = 0; b < B; b++) {
            int64_t k = 0;
            for (int64_t p = 0; p < S; p++)
                if (!g.masked[b * S + p])
                    g.known_pos[b * K + k++] = (int32_t)p;
            const int32_t *order = g.orders + b * S;
            int32_t *pred = g.pred_pos + b * n_pred;
            int64_t first = last ? 0 : mask_len;
            for (int64_t i = 0; i < n_pred; i++)
                pred[i] = order[first + i];
            qsort(pred, (size_t)n_pred, sizeof(int32_t), compare_int32);
        }
        if (cfg_on)
            memcpy(g.known_pos + B * K, g.known_pos, (size_t)(B * K) * sizeof(int32_t));
        const int64_t n_head = B * n_pred;
        for (int64_t i = 0; i < n_head; i++) {
            int64_t b = i / (n_pred ? n_pred : 1);
            g.out_rows[i] = (int32_t)(b * S + g.pred_pos[i]);
            if (cfg_on)
                g.out_rows[n_head + i] = (int32_t)((B + b) * S + g.pred_pos[i]);
            g.images[i] = args->first_index + (uint32_t)b;
            g.positions[i] = (uint32_t)g.pred_pos[i];
        }

        /* With more steps than tokens the clamp leaves steps that predict
         * nothing (mar.md 7.5); their transformer pass would be wasted. */
        mc_lazymar_stats lstats = {.full = 1};
        mc_head_stats hstats = {0};
        double transformer_flops = 0.0;
        if (n_head > 0) {
            mc_mar_batch batch = {.n_seq = Bp, .n_known = K, .tokens = tokens,
                                  .known_pos = g.known_pos, .class_vectors = class_vectors};
            if (lazymar != NULL) {
                mc_lazymar_step ls = {.step = step, .num_steps = args->num_steps, .n_images = B,
                                      .cfg_on = cfg_on, .tokens = tokens, .class_vectors = class_vectors,
                                      .known_pos = g.known_pos, .n_known = K, .pred_pos = g.pred_pos,
                                      .n_pred = n_pred};
                st = mc_lazymar_transformer(lazymar, &ls, z, &lstats, err);
            } else {
                st = mc_mar_transformer(mar, &batch, g.out_rows, cfg_on ? 2 * n_head : n_head, z, err);
                lstats.encoder_rows = Bp * (c->buffer_size + K);
                lstats.decoder_rows = lstats.decoder_kept_rows = Bp * (c->buffer_size + S);
            }
            transformer_flops = lstats.full ? mc_mar_transformer_flops(c, Bp, K) : lstats.flops;
            if (st == MC_OK)
                st = mc_mar_head_sample_ex(mar, diffusion, z, n_head, cfg_on, cfg_iter, args->temperature,
                                           args->seed, g.images, g.positions, NULL, lazymar, &hstats, err);
            if (st != MC_OK)
                goto done;
            /* The sampled tokens are still in the head's state slot (same
             * size, so the same buffer): write them into every copy of the
             * sequence without a host round trip. */
            float *dev_sampled = mc_mar_ws(mar, WS_STATE, (size_t)(n_head * C), err);
            int32_t *d_scatter = (int32_t *)mc_mar_ws_index(mar, WSI_SCATTER, (size_t)n_head, err);
            if (!dev_sampled || !d_scatter) {
                st = err->status;
                goto done;
            }
            for (int copy = 0; copy < (cfg_on ? 2 : 1); copy++) {
                for (int64_t i = 0; i < n_head; i++)
                    g.scatter[i] = g.out_rows[i] + (int32_t)(copy * B * S);
                st = ops->upload(be, d_scatter, g.scatter, (size_t)n_head * sizeof(int32_t), err);
                if (st == MC_OK)
                    st = ops->scatter_rows(be, dev_sampled, C, d_scatter, n_head, C, tokens, C, err);
                if (st != MC_OK)
                    goto done;
            }
        }
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < n_pred; i++)
                g.masked[b * S + g.pred_pos[b * n_pred + i]] = 0;
        masked_before = last ? 0 : mask_len;

        mc_step_info info = {
            .step = step, .num_steps = args->num_steps, .masked_before = masked_before + n_pred,
            .predicted = n_pred, .cfg = cfg_iter, .full = lstats.full,
            .encoder_rows = n_head ? lstats.encoder_rows : 0,
            .decoder_rows = n_head ? lstats.decoder_rows : 0,
            .decoder_kept_rows = n_head ? lstats.decoder_kept_rows : 0,
            .head_rows = n_head ? (cfg_on ? 2 * n_head : n_head) : 0,
            .head_evaluations = hstats.full_evaluations + hstats.cached_evaluations,
            .head_cached_evaluations = hstats.cached_evaluations,
            .cache_bytes = lazymar ? (int64_t)mc_lazymar_cache_bytes(lazymar) : 0,
            .head_graph = hstats.graph,
            .flops = transformer_flops + hstats.flops,
            .seconds = seconds_now() - t0,
            .kept_rows = n_head ? lstats.kept_rows : NULL,
            .kept_sequences = lstats.kept_sequences,
            .kept_per_sequence = lstats.kept_per_sequence,
        };
        if (steps_out != NULL)
            steps_out[step] = info;
        if (args->on_step != NULL && args->on_step(args->callback_ctx, &info)) {
            st = mc_fail(err, MC_ERR_INTERRUPTED, "generation interrupted after step %d", step);
            goto done;
        }
    }
    st = ops->download(be, tokens_out, tokens, (size_t)(B * S * C) * sizeof(float), err);
done:
    free_state(&g);
    mc_lazymar_free(lazymar);
    return st;
}

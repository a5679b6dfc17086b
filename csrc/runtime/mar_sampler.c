/* MAR sampling: the AR loop of mar.md 7.2 and the head sampler of 6.5.
 * Randomness comes only from core/philox, keyed by (image index, token
 * position), so an image is the same in any batch and on any backend. */
#include "mar_sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/philox.h"
#include "flops.h"
#include "mar_workspace.h"

/* A named sampler activation (mar_workspace.h) grown to `count` elements. */
#define SAMPLER_FLOATS(acts, name, count)                                                                      \
    mc_buffer_floats(mar->backend, &(acts)->sampler.name, (size_t)(count), "sampler." #name, err)
#define SAMPLER_INTS(acts, name, count)                                                                        \
    mc_buffer_ints(mar->backend, &(acts)->sampler.name, (size_t)(count), "sampler." #name, err)

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

/* Everything one diffusion step of the head sampler reads: buffers, the
 * CFG setting and the policy's head plan. One step only enqueues backend ops
 * (no host reads of device memory, no allocation once the first step has
 * sized the workspace), which is what lets a backend record steps as a graph. */
typedef struct head_loop {
    mc_mar *mar;
    const mc_diffusion *diffusion;
    int64_t n, rows;
    int cfg_on;
    float cfg;
    double temperature;
    uint64_t seed;
    mc_mar_head_plan plan;
    float *c_emb, *state, *out, *eps, *noise, *eps_delta;
    const uint32_t *d_images, *d_positions;
} head_loop;

static mc_head_mode head_step_mode(const head_loop *h, int j) {
    return h->plan.modes != NULL ? h->plan.modes[j] : MC_HEAD_PLAIN;
}

static void head_step_stats(const head_loop *h, int j, mc_head_stats *stats) {
    const mc_head_mode mode = head_step_mode(h, j);
    const int full = mc_head_mode_full(mode);
    const int64_t eval_rows = full ? h->rows : h->n;
    const mc_head_cache *cache = h->plan.cache;
    const int skip_first = cache ? cache->skip_first : 0, skip_last = cache ? cache->skip_last : -1;
    stats->flops += mc_flops_head_eval(&h->mar->config, eval_rows, full ? h->n : eval_rows, mode, skip_first,
                                       skip_last);
    /* Every term of an evaluation's FLOPs is 2 x rows x one weight's size,
     * so one row's FLOPs / 2 is the weights it reads, whatever its rows. */
    stats->weight_bytes += mc_flops_head_eval(&h->mar->config, 1, 1, mode, skip_first, skip_last) / 2.0 *
                           (double)mc_wtype_size(h->mar->backend->linear_wtype);
    if (full)
        stats->full_evaluations++;
    else
        stats->cached_evaluations++;
}

/* A full evaluation with CFG combines both halves' eps (and, when the head
 * cache stores, keeps delta = eps_cond - eps_uncond); a cached one runs the
 * conditional rows only and takes eps = eps_cond + (cfg - 1) * delta. */
static mc_status head_step(head_loop *h, int j, mc_err *err) {
    mc_backend *be = h->mar->backend;
    const mc_ops *ops = be->ops;
    const int64_t n = h->n, C = h->mar->config.token_channels;
    const mc_head_mode mode = head_step_mode(h, j);
    const int full = mc_head_mode_full(mode);
    const float *t_emb = mc_mar_time_embedding(h->mar, h->diffusion->timesteps[j]);
    MC_TRY(mc_head_forward(h->mar, h->state, full ? h->rows : n, full && h->cfg_on, h->c_emb, t_emb, h->out,
                           h->plan.cache, mode, err));
    const float *eps_used = h->out;
    int64_t ld_eps = 2 * C;
    if (h->cfg_on && full) {
        MC_TRY(ops->cfg_combine(be, h->out, 2 * C, h->out + n * 2 * C, 2 * C, n, (int)C, h->cfg, h->eps, C,
                                err));
        if (mode == MC_HEAD_STORE) {
            MC_TRY(ops->axpby(be, 1.0f, h->out, 2 * C, 0.0f, h->eps_delta, C, n, C, err));
            MC_TRY(ops->axpby(be, -1.0f, h->out + n * 2 * C, 2 * C, 1.0f, h->eps_delta, C, n, C, err));
        }
        eps_used = h->eps;
        ld_eps = C;
    } else if (h->cfg_on) {
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

mc_status mc_mar_head_sample_ex(mc_mar *mar, const mc_diffusion *diffusion, const mc_mar_head_call *call,
                                mc_head_stats *stats, mc_err *err) {
    mc_backend *be = mar->backend;
    const mc_ops *ops = be->ops;
    const mc_mar_config *c = &mar->config;
    const int64_t C = c->token_channels, W = c->head_width, n = call->n;
    mc_head_stats local = {0};
    if (stats == NULL)
        stats = &local;
    memset(stats, 0, sizeof *stats);
    if (n == 0)
        return MC_OK;
    head_loop h = {0};
    h.mar = mar;
    /* A policy may sample this AR step with its own respacing (DiSA). */
    h.diffusion = call->plan.diffusion != NULL ? call->plan.diffusion : diffusion;
    h.n = n;
    h.rows = call->cfg_on ? 2 * n : n;
    h.cfg_on = call->cfg_on;
    h.cfg = call->cfg;
    h.temperature = call->temperature;
    h.seed = call->seed;
    h.plan = call->plan;
    mc_mar_runtime_acts *acts = mc_mar_runtime_acts_of(mar, err);
    if (acts == NULL)
        return err->status;
    h.c_emb = SAMPLER_FLOATS(acts, cond_emb, (h.rows * W));
    h.state = SAMPLER_FLOATS(acts, state, (n * C));
    h.out = SAMPLER_FLOATS(acts, head_out, (h.rows * 2 * C));
    h.eps = SAMPLER_FLOATS(acts, eps, (n * C));
    h.noise = SAMPLER_FLOATS(acts, noise, (n * C));
    h.eps_delta = SAMPLER_FLOATS(acts, eps_delta, (n * C));
    uint32_t *d_images = (uint32_t *)SAMPLER_INTS(acts, images, n);
    uint32_t *d_positions = (uint32_t *)SAMPLER_INTS(acts, positions, n);
    if (!h.c_emb || !h.state || !h.out || !h.eps || !h.noise || !h.eps_delta || !d_images || !d_positions)
        return err->status;
    h.d_images = d_images;
    h.d_positions = d_positions;
    MC_TRY(ops->upload(be, d_images, call->images, (size_t)n * sizeof(uint32_t), err));
    MC_TRY(ops->upload(be, d_positions, call->positions, (size_t)n * sizeof(uint32_t), err));

    MC_TRY(mc_mar_head_cond(mar, call->z, h.rows, h.c_emb, err));
    stats->flops += 2.0 * (double)h.rows * (double)(c->dec_width * W);
    stats->weight_bytes += (double)(c->dec_width * W) * (double)mc_wtype_size(be->linear_wtype);
    /* Initial noise is not scaled by temperature (mar.md 6.5). */
    MC_TRY(ops->token_normals(be, call->seed, MC_STREAM_HEAD_INIT, 0, d_images, d_positions, n, (int)C, h.state,
                              err));
    const int T = h.diffusion->n_steps;
    stats->diffusion_steps = T;
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
    if (call->x_out == NULL)
        return MC_OK;
    return ops->download(be, call->x_out, h.state, (size_t)(n * C) * sizeof(float), err);
}

mc_status mc_mar_head_sample(mc_mar *mar, const mc_diffusion *diffusion, const float *z, int64_t n,
                             int cfg_on, float cfg, double temperature, uint64_t seed,
                             const uint32_t *images, const uint32_t *positions, float *x_out,
                             mc_err *err) {
    mc_mar_head_call call = {.z = z, .n = n, .cfg_on = cfg_on, .cfg = cfg, .temperature = temperature,
                             .seed = seed, .images = images, .positions = positions, .x_out = x_out};
    return mc_mar_head_sample_ex(mar, diffusion, &call, NULL, err);
}

static int compare_int32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

struct mc_mar_run {
    mc_mar *mar;
    const mc_diffusion *diffusion;
    mc_mar_generate_args args;
    float *tokens_out;   /* host [B, S, C] */
    int64_t B, Bp;       /* images, and sequences (2B with CFG) */
    int cfg_on;
    mc_mar_policy policy;
    int64_t masked_before;
    /* host state */
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
    /* backend buffers (model workspace) */
    float *tokens, *class_vectors, *z;
    mc_mar_step_tail tail;
};

void mc_mar_run_free(mc_mar_run *r) {
    if (r == NULL)
        return;
    mc_mar_policy_free(&r->policy);
    free(r->orders);
    free(r->masked);
    free(r->known_pos);
    free(r->pred_pos);
    free(r->out_rows);
    free(r->class_ids);
    free(r->images);
    free(r->positions);
    free(r->scatter);
    free(r->zeros);
    free(r);
}

mc_status mc_mar_run_new(mc_mar *mar, const mc_diffusion *diffusion, const mc_mar_generate_args *args,
                         float *tokens_out, mc_mar_run **out, mc_err *err) {
    const int64_t B = args->n_images, S = mar->config.seq_len, C = mar->config.token_channels;
    if (B <= 0)
        return mc_fail(err, MC_ERR_VALUE, "n_images must be positive");
    if (args->num_steps < 1)
        return mc_fail(err, MC_ERR_VALUE, "steps must be >= 1, got %d", args->num_steps);
    if (S > MC_PHILOX_ORDER_MAX)
        return mc_fail(err, MC_ERR_VALUE, "seq_len %lld exceeds %d", (long long)S, MC_PHILOX_ORDER_MAX);
    mc_mar_run *r = calloc(1, sizeof *r);
    if (r == NULL)
        return mc_fail_nomem(err, sizeof *r, "the MAR sampler state");
    r->mar = mar;
    r->diffusion = diffusion;
    r->args = *args;
    r->tokens_out = tokens_out;
    r->B = B;
    r->cfg_on = args->cfg != 1.0;
    r->Bp = r->cfg_on ? 2 * B : B;
    const int64_t Bp = r->Bp;
    /* per image: 4-byte orders, pred_pos, images, positions and a mask byte;
     * per sequence (both CFG halves): known_pos, out_rows, scatter and a class */
    const size_t per_image = (size_t)S * (4 * sizeof(int32_t) + 1), per_seq = (size_t)S * 3 * sizeof(int32_t) + 4;
    r->orders = malloc((size_t)(B * S) * sizeof(int32_t));
    r->masked = malloc((size_t)(B * S));
    r->known_pos = malloc((size_t)(Bp * S) * sizeof(int32_t));
    r->pred_pos = malloc((size_t)(B * S) * sizeof(int32_t));
    r->out_rows = malloc((size_t)(Bp * S) * sizeof(int32_t));
    r->class_ids = malloc((size_t)Bp * sizeof(int32_t));
    r->images = malloc((size_t)(B * S) * sizeof(uint32_t));
    r->positions = malloc((size_t)(B * S) * sizeof(uint32_t));
    r->scatter = malloc((size_t)(Bp * S) * sizeof(int32_t));
    r->zeros = calloc((size_t)(S * C), sizeof(float));
    if (!r->orders || !r->masked || !r->known_pos || !r->pred_pos || !r->out_rows || !r->class_ids ||
        !r->images || !r->positions || !r->scatter || !r->zeros) {
        mc_mar_run_free(r);
        return mc_fail_nomem(err, (size_t)B * per_image + (size_t)Bp * per_seq + (size_t)(S * C) * sizeof(float),
                             "the MAR sampler's host state for %lld images", (long long)B);
    }
    *out = r;
    return MC_OK;
}

/* The head rows (B x predicted) of the run's largest step. */
static int64_t most_live_rows(const mc_mar_run *r) {
    const int64_t S = r->mar->config.seq_len;
    int64_t most = 0, before = S;
    for (int step = 0; step < r->args.num_steps && before > 0; step++) {
        const int last = step == r->args.num_steps - 1;
        const int64_t after = mc_mask_len_after(S, before, step, r->args.num_steps);
        const int64_t predicted = last ? before : before - after;
        most = predicted > most ? predicted : most;
        before = last ? 0 : after;
    }
    return r->B * most;
}

/* Creates the policy and has it size its buffers for the largest step, so
 * nothing grows inside the loop (the predicted count rises along the cosine
 * schedule; growing step by step would allocate on most steps). */
static mc_status make_policy(mc_mar_run *r, mc_err *err) {
    mc_mar_run_shape shape = {.n_images = r->B, .cfg_on = r->cfg_on, .num_steps = r->args.num_steps};
    MC_TRY(mc_mar_policy_make(&r->policy, r->args.policy, r->mar, r->args.policy_config, &shape, err));
    return r->policy.ops->plan(r->policy.state, most_live_rows(r), err);
}

/* Every sequence starts all masked (zero tokens); the generation order of
 * each image comes from Philox; class vectors, unconditional for the CFG half. */
static mc_status init_sequences(mc_mar_run *r, mc_err *err) {
    mc_mar *mar = r->mar;
    mc_backend *be = mar->backend;
    const mc_mar_config *c = &mar->config;
    const int64_t B = r->B, Bp = r->Bp, S = c->seq_len, C = c->token_channels;
    mc_mar_runtime_acts *acts = mc_mar_runtime_acts_of(mar, err);
    if (acts == NULL)
        return err->status;
    r->tokens = SAMPLER_FLOATS(acts, tokens, (Bp * S * C));
    r->class_vectors = SAMPLER_FLOATS(acts, class_vectors, (Bp * c->width));
    r->z = SAMPLER_FLOATS(acts, z, (Bp * S * c->dec_width));
    if (!r->tokens || !r->class_vectors || !r->z)
        return err->status;
    for (int64_t b = 0; b < Bp; b++)
        MC_TRY(be->ops->upload(be, r->tokens + b * S * C, r->zeros, (size_t)(S * C) * sizeof(float), err));
    for (int64_t b = 0; b < B; b++) {
        mc_philox_order(r->args.seed, r->args.first_index + (uint32_t)b, (int)S, r->orders + b * S);
        r->class_ids[b] = r->args.labels ? r->args.labels[b] : -1;
        if (r->cfg_on)
            r->class_ids[B + b] = -1;
    }
    memset(r->masked, 1, (size_t)(B * S));
    r->masked_before = S;
    return mc_mar_class_vectors(mar, r->class_ids, Bp, r->class_vectors, err);
}

static mc_status run_begin(void *opaque, int *num_steps, mc_err *err) {
    mc_mar_run *r = opaque;
    *num_steps = r->args.num_steps;
    MC_TRY(make_policy(r, err));
    return init_sequences(r, err);
}

/* Known positions in raster order; predicted ones are the tail of the order
 * that the schedule releases now, sorted by position; the z rows and noise
 * identities (image, position) of the predicted tokens. */
static void step_positions(mc_mar_run *r, int64_t mask_len, int64_t n_pred, int last) {
    const int64_t B = r->B, S = r->mar->config.seq_len, K = S - r->masked_before, n_head = B * n_pred;
    for (int64_t b = 0; b < B; b++) {
        int64_t k = 0;
        for (int64_t p = 0; p < S; p++)
            if (!r->masked[b * S + p])
                r->known_pos[b * K + k++] = (int32_t)p;
        const int32_t *order = r->orders + b * S;
        int32_t *pred = r->pred_pos + b * n_pred;
        int64_t first = last ? 0 : mask_len;
        for (int64_t i = 0; i < n_pred; i++)
            pred[i] = order[first + i];
        qsort(pred, (size_t)n_pred, sizeof(int32_t), compare_int32);
    }
    if (r->cfg_on)
        memcpy(r->known_pos + B * K, r->known_pos, (size_t)(B * K) * sizeof(int32_t));
    for (int64_t i = 0; i < n_head; i++) {
        int64_t b = i / (n_pred ? n_pred : 1);
        r->out_rows[i] = (int32_t)(b * S + r->pred_pos[i]);
        if (r->cfg_on)
            r->out_rows[n_head + i] = (int32_t)((B + b) * S + r->pred_pos[i]);
        r->images[i] = r->args.first_index + (uint32_t)b;
        r->positions[i] = (uint32_t)r->pred_pos[i];
    }
}

/* The sampled tokens are still in the head's state slot (same size, so the
 * same buffer): write them into every copy of the sequence without a host
 * round trip. */
static mc_status scatter_sampled(mc_mar_run *r, int64_t n_head, mc_err *err) {
    mc_mar *mar = r->mar;
    mc_backend *be = mar->backend;
    const int64_t B = r->B, S = mar->config.seq_len, C = mar->config.token_channels;
    mc_mar_runtime_acts *acts = mc_mar_runtime_acts_of(mar, err);
    if (acts == NULL)
        return err->status;
    float *dev_sampled = SAMPLER_FLOATS(acts, state, (n_head * C));
    int32_t *d_scatter = SAMPLER_INTS(acts, scatter, n_head);
    if (!dev_sampled || !d_scatter)
        return err->status;
    for (int copy = 0; copy < (r->cfg_on ? 2 : 1); copy++) {
        for (int64_t i = 0; i < n_head; i++)
            r->scatter[i] = r->out_rows[i] + (int32_t)(copy * B * S);
        MC_TRY(be->ops->upload(be, d_scatter, r->scatter, (size_t)n_head * sizeof(int32_t), err));
        MC_TRY(be->ops->scatter_rows(be, dev_sampled, C, d_scatter, n_head, C, r->tokens, C, err));
    }
    return MC_OK;
}

static mc_status run_step(void *opaque, int step, mc_step_header *header, const void **tail, mc_err *err) {
    mc_mar_run *r = opaque;
    mc_mar *mar = r->mar;
    const mc_mar_policy *policy = &r->policy;
    const int64_t B = r->B, S = mar->config.seq_len;
    const int num_steps = r->args.num_steps, last = step == num_steps - 1;
    const int64_t mask_len = mc_mask_len_after(S, r->masked_before, step, num_steps);
    const int64_t n_pred = last ? r->masked_before : r->masked_before - mask_len;
    const int64_t K = S - r->masked_before, n_head = B * n_pred;
    float cfg_iter = r->cfg_on ? mc_cfg_at(r->args.cfg, r->args.cfg_schedule, mask_len, S) : 1.0f;
    step_positions(r, mask_len, n_pred, last);

    /* With more steps than tokens the clamp leaves steps that predict
     * nothing (mar.md 7.5); their transformer pass would be wasted. */
    mc_mar_transformer_stats tstats = {.full = 1};
    mc_head_stats hstats = {0};
    const int be_synchronous = mar->backend->ops->synchronous;
    const mc_phase_meter encoder_before = mar->encoder_meter, decoder_before = mar->decoder_meter;
    mc_phase_meter head_meter = {0};
    int guided = r->cfg_on;
    if (n_head > 0) {
        mc_mar_step ms = {.step = step, .num_steps = num_steps, .n_images = B, .cfg_on = r->cfg_on,
                          .tokens = r->tokens, .class_vectors = r->class_vectors, .known_pos = r->known_pos,
                          .n_known = K, .pred_pos = r->pred_pos, .n_pred = n_pred, .out_rows = r->out_rows,
                          .n_out = r->cfg_on ? 2 * n_head : n_head};
        memset(&tstats, 0, sizeof tstats);
        MC_TRY(policy->ops->transformer(policy->state, &ms, r->z, &tstats, err));
        const double head_t0 = mc_seconds_now();
        mc_mar_head_call call = {.z = r->z, .n = n_head, .cfg = cfg_iter, .temperature = r->args.temperature,
                                 .seed = r->args.seed, .images = r->images, .positions = r->positions};
        MC_TRY(policy->ops->head_plan(policy->state, &ms, r->diffusion->n_steps, &call.plan, err));
        call.cfg_on = r->cfg_on && !call.plan.guidance_off;
        if (!call.cfg_on)
            call.cfg = cfg_iter = 1.0f;
        guided = call.cfg_on;
        MC_TRY(mc_mar_head_sample_ex(mar, r->diffusion, &call, &hstats, err));
        head_meter = (mc_phase_meter){be_synchronous ? mc_seconds_now() - head_t0 : 0.0, hstats.flops,
                                      hstats.weight_bytes};
        MC_TRY(scatter_sampled(r, n_head, err));
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < n_pred; i++)
            r->masked[b * S + r->pred_pos[b * n_pred + i]] = 0;
    r->masked_before = last ? 0 : mask_len;

    header->full = tstats.full;
    header->flops = (n_head ? tstats.flops : 0.0) + hstats.flops;
    header->cache_bytes = (int64_t)policy->ops->cache_bytes(policy->state);
    r->tail = (mc_mar_step_tail){
        .masked_before = r->masked_before + n_pred, .predicted = n_pred, .cfg = cfg_iter,
        .encoder_rows = n_head ? tstats.encoder_rows : 0,
        .decoder_rows = n_head ? tstats.decoder_rows : 0,
        .decoder_kept_rows = n_head ? tstats.decoder_kept_rows : 0,
        .head_rows = n_head ? (guided ? 2 * n_head : n_head) : 0,
        .head_evaluations = hstats.full_evaluations + hstats.cached_evaluations,
        .head_cached_evaluations = hstats.cached_evaluations,
        .head_graph = hstats.graph,
        .diffusion_steps = hstats.diffusion_steps,
        .kept_rows = n_head ? tstats.kept_rows : NULL,
        .kept_sequences = tstats.kept_sequences,
        .kept_per_sequence = tstats.kept_per_sequence,
        .encoder = mc_phase_meter_since(&mar->encoder_meter, &encoder_before),
        .decoder = mc_phase_meter_since(&mar->decoder_meter, &decoder_before),
        .head = head_meter,
        .phases_timed = be_synchronous,
    };
    *tail = &r->tail;
    return MC_OK;
}

static mc_status run_finish(void *opaque, mc_err *err) {
    mc_mar_run *r = opaque;
    mc_backend *be = r->mar->backend;
    const mc_mar_config *c = &r->mar->config;
    return be->ops->download(be, r->tokens_out, r->tokens, (size_t)(r->B * c->seq_len * c->token_channels) *
                                                                sizeof(float), err);
}

/* The policy's state lives for one run: free it as soon as the run ends. */
static void run_end(void *opaque) {
    mc_mar_policy_free(&((mc_mar_run *)opaque)->policy);
}

const mc_generator_ops mc_mar_generator = {
    .begin = run_begin,
    .step = run_step,
    .finish = run_finish,
    .end = run_end,
};

mc_status mc_mar_generate(mc_mar *mar, const mc_diffusion *diffusion, const mc_mar_generate_args *args,
                          float *tokens_out, const mc_driver_host *host, mc_err *err) {
    mc_mar_run *run = NULL;
    MC_TRY(mc_mar_run_new(mar, diffusion, args, tokens_out, &run, err));
    mc_status st = mc_generate(&mc_mar_generator, run, mar->backend, host, err);
    mc_mar_run_free(run);
    return st;
}

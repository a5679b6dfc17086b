/* VAR sampling: the scale loop of var_fastvar.md A4 with the sampler of A6
 * on Philox draws (core/philox.h streams MC_STREAM_VAR_SAMPLE and
 * MC_STREAM_VAR_GUMBEL, keyed by image index, token position and scale). */
#include "var_sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "flops.h"

/* Backend buffers a run allocates (released at its end). */
#define VAR_RUN_MAX_BUFFERS 16

struct mc_var_run {
    mc_var *var;
    mc_vqvae *vq;
    mc_backend *be, *vq_be; /* the transformer's and the VQ update's backends */
    int shared;             /* one backend: nothing moves through the host */
    mc_var_generate_args args;
    int32_t *tokens_out;    /* host [B, L] */
    float *f_hat_out;       /* host [B, side, side, Cvae] */
    int64_t B, S, side, Cvae, V, max_tokens;
    int cfg_on, n_scales;
    mc_var_policy policy;
    int skipping;           /* a scale was skipped: every later one must be */
    int unguided;           /* a scale ran unguided: every later one must (the uncond K/V stopped) */
    int scales_run;
    /* host */
    int32_t *seq_labels;    /* [S] class rows of the sequences (null class for the CFG half) */
    uint32_t *images, *positions; /* [B * max_tokens] Philox identities of a scale's tokens */
    float *stage;           /* [B * max_tokens * Cvae] host hop between the two backends */
    int32_t *tokens_host;   /* [L * B] scale-major, as on the backend */
    /* transformer backend */
    int32_t *d_tokens;      /* [L * B]: scale si's tokens at [begin * B, (begin + n) * B), image-major */
    uint32_t *d_images, *d_positions;
    float *d_h, *d_next, *d_probs; /* [B * n, Cvae], [B * n, Cvae], [B * n, V] (more_smooth) */
    const float *codebook;  /* [V, Cvae] on the transformer's backend (the VQVAE's, or a copy) */
    /* VQ backend */
    float *q_f_hat, *q_h, *q_next;
    /* every backend buffer above, to release */
    mc_backend *owner[VAR_RUN_MAX_BUFFERS];
    void *buffer[VAR_RUN_MAX_BUFFERS];
    int n_buffers;
    mc_var_step_tail tail;
};

static void *run_alloc(mc_var_run *r, mc_backend *be, size_t bytes, const char *what, mc_err *err) {
    if (r->n_buffers == VAR_RUN_MAX_BUFFERS) {
        mc_fail(err, MC_ERR_INTERNAL, "VAR run: more than %d buffers", VAR_RUN_MAX_BUFFERS);
        return NULL;
    }
    void *p = be->ops->alloc(be, bytes > 0 ? bytes : 1, what, err);
    if (p != NULL) {
        r->owner[r->n_buffers] = be;
        r->buffer[r->n_buffers++] = p;
    }
    return p;
}

static void release_buffers(mc_var_run *r) {
    for (int i = 0; i < r->n_buffers; i++)
        r->owner[i]->ops->release(r->owner[i], r->buffer[i]);
    r->n_buffers = 0;
}

void mc_var_run_free(mc_var_run *r) {
    if (r == NULL)
        return;
    mc_var_policy_free(&r->policy);
    release_buffers(r);
    free(r->seq_labels);
    free(r->images);
    free(r->positions);
    free(r->stage);
    free(r->tokens_host);
    free(r);
}

/* Whether buffers of one backend can be handed to ops of the other: the
 * same backend, or two CPU backends (plain host memory, ops that finish
 * before they return). The guard backend keeps its memory closed to every
 * other backend, and two CUDA backends run on unordered streams, so those
 * pairs move data through the host. */
static int backends_share_memory(const mc_backend *a, const mc_backend *b) {
    return a == b || (strcmp(a->ops->name, "cpu") == 0 && strcmp(b->ops->name, "cpu") == 0);
}

/* Model and VQVAE agree (vocabulary, latent channels, a Phi conv for every
 * scale), the arguments are in range. */
static mc_status check_run(const mc_var *var, const mc_vqvae *vq, const mc_var_generate_args *args, mc_err *err) {
    const mc_var_config *c = &var->config;
    mc_vqvae_info info;
    mc_vqvae_get_info(vq, &info);
    if (info.vocab != c->vocab || info.z_channels != c->vae_channels)
        return mc_fail(err, MC_ERR_VALUE,
                       "the VQVAE (vocabulary %lld, %lld latent channels) does not fit the VAR model (vocabulary "
                       "%lld, %lld latent channels)", (long long)info.vocab, (long long)info.z_channels,
                       (long long)c->vocab, (long long)c->vae_channels);
    for (int si = 0; si < c->n_scales; si++)
        if (mc_vqvae_phi_index(vq, si, c->n_scales) < 0)
            return mc_fail(err, MC_ERR_VALUE, "the VQVAE has no Phi conv for scale %d of %d", si, c->n_scales);
    if (args->n_images <= 0)
        return mc_fail(err, MC_ERR_VALUE, "n_images must be positive, got %lld", (long long)args->n_images);
    if ((uint64_t)args->first_index + (uint64_t)args->n_images - 1 > UINT32_MAX)
        return mc_fail(err, MC_ERR_VALUE, "first_index %u + %lld images exceeds the 32-bit image index",
                       args->first_index, (long long)args->n_images);
    if (!(args->cfg >= 0.0) || !isfinite(args->cfg))
        return mc_fail(err, MC_ERR_VALUE, "cfg must be a finite number >= 0, got %g", args->cfg);
    if (!isfinite(args->top_p))
        return mc_fail(err, MC_ERR_VALUE, "top_p must be finite, got %g", args->top_p);
    for (int64_t b = 0; b < args->n_images; b++)
        if (args->labels[b] < -1 || args->labels[b] >= c->num_classes)
            return mc_fail(err, MC_ERR_VALUE, "label %d at index %lld is outside 0..%lld (or -1 for unconditional)",
                           args->labels[b], (long long)b, (long long)c->num_classes - 1);
    return MC_OK;
}

mc_status mc_var_run_new(mc_var *var, mc_vqvae *vq, mc_backend *vq_backend, const mc_var_generate_args *args,
                         int32_t *tokens_out, float *f_hat_out, mc_var_run **out, mc_err *err) {
    MC_TRY(check_run(var, vq, args, err));
    const mc_var_config *c = &var->config;
    mc_var_run *r = calloc(1, sizeof *r);
    if (r == NULL)
        return mc_fail_nomem(err, sizeof *r, "the VAR sampler state");
    r->var = var;
    r->vq = vq;
    r->be = var->backend;
    r->vq_be = vq_backend;
    r->shared = backends_share_memory(var->backend, vq_backend);
    r->args = *args;
    r->tokens_out = tokens_out;
    r->f_hat_out = f_hat_out;
    r->B = args->n_images;
    r->cfg_on = args->cfg != 0.0;
    r->S = r->cfg_on ? 2 * r->B : r->B;
    r->n_scales = c->n_scales;
    r->side = c->patch_nums[c->n_scales - 1];
    r->Cvae = c->vae_channels;
    r->V = c->vocab;
    for (int si = 0; si < c->n_scales; si++)
        if (c->patch_nums[si] * c->patch_nums[si] > r->max_tokens)
            r->max_tokens = c->patch_nums[si] * c->patch_nums[si];
    const int64_t B = r->B, rows = B * r->max_tokens;
    const size_t labels_bytes = (size_t)r->S * sizeof(int32_t), index_bytes = (size_t)rows * sizeof(uint32_t),
                 stage_bytes = (size_t)(rows * r->Cvae) * sizeof(float),
                 tokens_bytes = (size_t)(B * c->tokens) * sizeof(int32_t);
    r->seq_labels = malloc(labels_bytes);
    r->images = malloc(index_bytes);
    r->positions = malloc(index_bytes);
    r->stage = malloc(stage_bytes);
    r->tokens_host = malloc(tokens_bytes);
    if (!r->seq_labels || !r->images || !r->positions || !r->stage || !r->tokens_host) {
        mc_var_run_free(r);
        return mc_fail_nomem(err, labels_bytes + 2 * index_bytes + stage_bytes + tokens_bytes,
                             "the VAR sampler's host state for %lld images", (long long)B);
    }
    for (int64_t b = 0; b < B; b++) {
        r->seq_labels[b] = args->labels[b] < 0 ? (int32_t)c->num_classes : args->labels[b];
        if (r->cfg_on)
            r->seq_labels[B + b] = (int32_t)c->num_classes;
    }
    *out = r;
    return MC_OK;
}

/* Buffers, the zero f_hat, the codebook on the transformer's backend, the
 * model sized for the run, and the policy. Nothing grows inside the loop
 * afterwards (the VQVAE's own workspace grows on its first scales). */
static mc_status run_begin(void *opaque, int *num_steps, mc_err *err) {
    mc_var_run *r = opaque;
    mc_var *var = r->var;
    const mc_var_config *c = &var->config;
    const int64_t B = r->B, rows = B * r->max_tokens, L = c->tokens;
    const size_t map_bytes = (size_t)(rows * r->Cvae) * sizeof(float);
    const size_t f_hat_bytes = (size_t)(B * r->side * r->side * r->Cvae) * sizeof(float);
    *num_steps = r->n_scales;
    r->skipping = 0;
    r->unguided = 0;
    r->scales_run = 0;
    MC_TRY(mc_var_reserve(var, r->S, r->max_tokens, err));
    r->d_tokens = run_alloc(r, r->be, (size_t)(L * B) * sizeof(int32_t), "the VAR run's tokens", err);
    r->d_images = r->d_tokens ? run_alloc(r, r->be, (size_t)rows * sizeof(uint32_t), "the VAR run's image indices", err)
                              : NULL;
    r->d_positions =
        r->d_images ? run_alloc(r, r->be, (size_t)rows * sizeof(uint32_t), "the VAR run's positions", err) : NULL;
    r->d_h = r->d_positions ? run_alloc(r, r->be, map_bytes, "the VAR run's h map", err) : NULL;
    r->d_next = r->d_h ? run_alloc(r, r->be, map_bytes, "the VAR run's next-scale input", err) : NULL;
    r->q_f_hat = r->d_next ? run_alloc(r, r->vq_be, f_hat_bytes, "the VAR run's f_hat", err) : NULL;
    if (r->q_f_hat == NULL)
        return err->status;
    if (r->args.more_smooth && (r->d_probs = run_alloc(r, r->be, (size_t)(rows * r->V) * sizeof(float),
                                                       "the VAR run's smoothed probabilities", err)) == NULL)
        return err->status;
    if (r->shared) {
        r->q_h = r->d_h;
        r->q_next = r->d_next;
        r->codebook = mc_vqvae_codebook(r->vq);
    } else {
        r->q_h = run_alloc(r, r->vq_be, map_bytes, "the VQVAE's copy of the h map", err);
        r->q_next = r->q_h ? run_alloc(r, r->vq_be, map_bytes, "the VQVAE's copy of the next-scale input", err) : NULL;
        float *codebook = r->q_next ? run_alloc(r, r->be, (size_t)(r->V * r->Cvae) * sizeof(float),
                                                "the codebook on the transformer's device", err)
                                    : NULL;
        float *host = codebook ? malloc((size_t)(r->V * r->Cvae) * sizeof(float)) : NULL;
        if (codebook != NULL && host == NULL)
            mc_fail_nomem_n(err, (size_t)(r->V * r->Cvae), sizeof(float), "the codebook's host copy");
        mc_status st = host ? MC_OK : err->status;
        if (st == MC_OK)
            st = r->vq_be->ops->download(r->vq_be, host, mc_vqvae_codebook(r->vq),
                                         (size_t)(r->V * r->Cvae) * sizeof(float), err);
        if (st == MC_OK)
            st = r->be->ops->upload(r->be, codebook, host, (size_t)(r->V * r->Cvae) * sizeof(float), err);
        free(host);
        MC_TRY(st);
        r->codebook = codebook;
    }
    /* f_hat starts at zero (A4 setup step 6): the caller's output buffer, zeroed, is the source. */
    memset(r->f_hat_out, 0, f_hat_bytes);
    MC_TRY(r->vq_be->ops->upload(r->vq_be, r->q_f_hat, r->f_hat_out, f_hat_bytes, err));
    mc_var_run_shape shape = {.n_images = B, .cfg_on = r->cfg_on, .n_seq = r->S};
    return mc_var_policy_make(&r->policy, r->args.policy, var, r->args.policy_config, &shape, err);
}

/* Moves `floats` floats from one backend to the other through the host
 * stage (a no-op with one backend: src is dst then). */
static mc_status hop(mc_var_run *r, mc_backend *from, const float *src, mc_backend *to, float *dst, int64_t floats,
                     mc_err *err) {
    if (r->shared)
        return MC_OK;
    MC_TRY(from->ops->download(from, r->stage, src, (size_t)floats * sizeof(float), err));
    return to->ops->upload(to, dst, r->stage, (size_t)floats * sizeof(float), err);
}

/* si / (n_scales - 1): the progress of the scale loop (A4's ratio); 0 with one scale. */
static double scale_ratio(int si, int n_scales) { return n_scales > 1 ? (double)si / (double)(n_scales - 1) : 0.0; }

static mc_status run_step(void *opaque, int si, mc_step_header *header, const void **tail, mc_err *err) {
    mc_var_run *r = opaque;
    mc_var *var = r->var;
    mc_backend *be = r->be;
    const mc_ops *ops = be->ops;
    const mc_var_config *c = &var->config;
    const int64_t B = r->B, V = r->V, Cvae = r->Cvae;
    const int64_t pn = c->patch_nums[si], n = pn * pn, begin = c->scale_begin[si];
    const mc_var_policy *policy = &r->policy;
    const int plan = policy->ops->scale_plan(policy->state, si);
    /* An unguided scale of a run with CFG runs the conditional half alone: the
     * first B sequences of every buffer and of the KV cache. */
    const int guided = r->cfg_on && plan != MC_VAR_SCALE_UNGUIDED;
    const int64_t S = guided ? r->S : B;
    r->tail = (mc_var_step_tail){.scale = si, .patch = pn, .sequences = S, .depth = c->depth};
    *tail = &r->tail;
    header->full = 1;
    header->cache_bytes = (int64_t)policy->ops->cache_bytes(policy->state);
    if (plan != MC_VAR_SCALE_SKIP && r->skipping)
        return mc_fail(err, MC_ERR_INTERNAL, "VAR policy '%s' runs scale %d after skipping an earlier one (only "
                       "trailing scales may be skipped)", policy->ops->schema.name, si);
    if (plan == MC_VAR_SCALE_SKIP) {
        r->skipping = 1;
        r->tail.skipped = 1;
        return MC_OK;
    }
    if (guided && r->unguided)
        return mc_fail(err, MC_ERR_INTERNAL, "VAR policy '%s' guides scale %d after an unguided one (only "
                       "trailing scales may run unguided)", policy->ops->schema.name, si);
    r->unguided = r->cfg_on && !guided;
    double flops = 0.0;
    float *x = var->acts.x;
    if (si == 0) {
        /* The conditioning is computed once per run, here (the official loop recomputes it per scale). */
        MC_TRY(mc_var_condition(var, r->seq_labels, S, err));
        flops += mc_var_flops_conditioning(c, S);
        MC_TRY(mc_var_first_input(var, S, x, err));
    } else {
        MC_TRY(mc_var_scale_input(var, si, r->d_next, B, guided ? 2 : 1, x, err));
        flops += mc_var_flops_scale_input(c, B, n);
    }
    mc_var_scale scale = {.si = si, .n_scales = r->n_scales, .n_seq = S, .pn = pn, .tokens = n, .begin = begin,
                          .x = x};
    mc_var_transformer_stats stats = {0};
    MC_TRY(policy->ops->transformer(policy->state, &scale, &stats, err));
    flops += stats.flops;
    float *logits = var->acts.logits;
    MC_TRY(mc_var_logits(var, x, S, n, logits, err));
    flops += mc_var_flops_logits(c, S * n);

    /* Guided logits (1 + t) c - t u (A4 step 3), written over the
     * unconditional rows: a = float32(1 + t), b = -float32(t), as torch
     * rounds the Python scalars; the products and their sum are float32. */
    const double ratio = scale_ratio(si, r->n_scales), t = guided ? r->args.cfg * ratio : 0.0;
    float *guided_logits = logits;
    if (guided) {
        guided_logits = logits + B * n * V;
        MC_TRY(ops->axpby(be, (float)(1.0 + t), logits, V, -(float)t, guided_logits, V, B * n, V, err));
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < n; i++) {
            r->images[b * n + i] = r->args.first_index + (uint32_t)b;
            r->positions[b * n + i] = (uint32_t)(begin + i);
        }
    MC_TRY(ops->upload(be, r->d_images, r->images, (size_t)(B * n) * sizeof(uint32_t), err));
    MC_TRY(ops->upload(be, r->d_positions, r->positions, (size_t)(B * n) * sizeof(uint32_t), err));
    int32_t *tokens = r->d_tokens + begin * B;
    MC_TRY(ops->sample_tokens(be, guided_logits, V, B * n, V, r->args.top_k, (float)r->args.top_p, r->args.seed,
                              (uint32_t)si, r->d_images, r->d_positions, tokens, err));
    if (!r->args.more_smooth) {
        MC_TRY(ops->gather_rows(be, r->codebook, Cvae, tokens, B * n, Cvae, r->d_h, Cvae, err));
    } else {
        /* A6: softmax((masked logits * (1 + ratio) + g) / tau) @ codebook. */
        const double tau = fmax(0.27 * (1.0 - 0.95 * ratio), 0.005);
        MC_TRY(ops->gumbel_softmax(be, guided_logits, V, B * n, V, (float)(1.0 + ratio), (float)tau, r->args.seed,
                                   (uint32_t)si, r->d_images, r->d_positions, r->d_probs, V, err));
        MC_TRY(ops->gemm(be, 0, 0, B * n, Cvae, V, 1.0f, r->d_probs, V, r->codebook, Cvae, 0.0f, r->d_h, Cvae, err));
        flops += mc_var_flops_smooth(c, B * n);
    }
    /* The VQ update (A4 step 6) on the VQVAE's backend. */
    MC_TRY(hop(r, be, r->d_h, r->vq_be, r->q_h, B * n * Cvae, err));
    MC_TRY(mc_vqvae_add_scale(r->vq, r->q_f_hat, B, r->side, r->q_h, pn, mc_vqvae_phi_index(r->vq, si, r->n_scales),
                              err));
    if (si + 1 < r->n_scales) {
        const int64_t next_pn = c->patch_nums[si + 1];
        MC_TRY(mc_vqvae_area_input(r->vq, r->q_f_hat, B, r->side, next_pn, r->q_next, err));
        MC_TRY(hop(r, r->vq_be, r->q_next, be, r->d_next, B * next_pn * next_pn * Cvae, err));
    }
    r->scales_run = si + 1;
    header->full = stats.full;
    header->flops = flops;
    header->cache_bytes = (int64_t)policy->ops->cache_bytes(policy->state);
    r->tail.tokens = n;
    r->tail.kv_rows = stats.kv_rows;
    r->tail.sublayer_rows = stats.sublayer_rows;
    r->tail.block_rows = stats.block_rows;
    r->tail.guidance = t;
    return MC_OK;
}

static mc_status run_finish(void *opaque, mc_err *err) {
    mc_var_run *r = opaque;
    const mc_var_config *c = &r->var->config;
    const int64_t B = r->B, L = c->tokens;
    const int64_t done = c->scale_begin[r->scales_run];
    if (done > 0)
        MC_TRY(r->be->ops->download(r->be, r->tokens_host, r->d_tokens, (size_t)(done * B) * sizeof(int32_t), err));
    for (int si = 0; si < c->n_scales; si++) {
        const int64_t begin = c->scale_begin[si], n = c->patch_nums[si] * c->patch_nums[si];
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < n; i++)
                r->tokens_out[b * L + begin + i] = si < r->scales_run ? r->tokens_host[begin * B + b * n + i] : -1;
    }
    return r->vq_be->ops->download(r->vq_be, r->f_hat_out, r->q_f_hat,
                                   (size_t)(B * r->side * r->side * r->Cvae) * sizeof(float), err);
}

/* The policy's state and the run's buffers live for one run. */
static void run_end(void *opaque) {
    mc_var_run *r = opaque;
    mc_var_policy_free(&r->policy);
    release_buffers(r);
}

const mc_generator_ops mc_var_generator = {
    .begin = run_begin,
    .step = run_step,
    .finish = run_finish,
    .end = run_end,
};

mc_status mc_var_generate(mc_var *var, mc_vqvae *vq, mc_backend *vq_backend, const mc_var_generate_args *args,
                          int32_t *tokens_out, float *f_hat_out, const mc_driver_host *host, mc_err *err) {
    mc_var_run *run = NULL;
    MC_TRY(mc_var_run_new(var, vq, vq_backend, args, tokens_out, f_hat_out, &run, err));
    mc_status st = mc_generate(&mc_var_generator, run, var->backend, host, err);
    mc_var_run_free(run);
    return st;
}

/* NoCache: every AR step runs the plain encoder, decoder and head, as the
 * official model does. A real policy, so the sampler has one code path. */
#include "flops.h"
#include "mar_policy.h"

typedef struct nocache_config {
    char unused; /* NoCache has no fields; C11 forbids an empty struct */
} nocache_config;

static const mc_config_field nocache_fields[] = {MC_FIELDS_END};

typedef struct nocache_state {
    mc_mar *mar;
} nocache_state;

mc_status mc_mar_plain_transformer(mc_mar *mar, const mc_mar_step *step, float *z, mc_mar_transformer_stats *stats,
                                   mc_err *err) {
    const mc_mar_config *c = &mar->config;
    const int64_t Bp = step->cfg_on ? 2 * step->n_images : step->n_images;
    mc_mar_batch batch = {.n_seq = Bp, .n_known = step->n_known, .tokens = step->tokens,
                          .known_pos = step->known_pos, .class_vectors = step->class_vectors};
    stats->full = 1;
    stats->encoder_rows = Bp * (c->buffer_size + step->n_known);
    stats->decoder_rows = stats->decoder_kept_rows = Bp * (c->buffer_size + c->seq_len);
    stats->flops = mc_mar_transformer_flops(c, Bp, step->n_known, step->n_pred);
    return mc_mar_transformer(mar, &batch, step->out_rows, step->n_out, z, err);
}

static mc_status nocache_check(const void *config, const mc_mar_config *model, mc_err *err) {
    (void)config, (void)model, (void)err;
    return MC_OK;
}

static mc_status nocache_init(void *state, mc_mar *mar, const void *config, const mc_mar_run_shape *run,
                              mc_err *err) {
    (void)config, (void)run, (void)err;
    ((nocache_state *)state)->mar = mar;
    return MC_OK;
}

static mc_status nocache_plan(void *state, int64_t most_live_rows, mc_err *err) {
    (void)state, (void)most_live_rows, (void)err;
    return MC_OK;
}

static mc_status nocache_transformer(void *state, const mc_mar_step *step, float *z, mc_mar_transformer_stats *stats,
                                     mc_err *err) {
    return mc_mar_plain_transformer(((nocache_state *)state)->mar, step, z, stats, err);
}

static mc_status nocache_head_plan(void *state, const mc_mar_step *step, int n_steps, mc_mar_head_plan *plan,
                                   mc_err *err) {
    (void)state, (void)step, (void)n_steps, (void)err;
    plan->cache = NULL;
    plan->modes = NULL;
    plan->guidance_off = 0;
    return MC_OK;
}

static size_t nocache_cache_bytes(const void *state) {
    (void)state;
    return 0;
}

static void nocache_release(void *state) { (void)state; /* the state holds nothing of its own */ }

const mc_mar_policy_ops mc_nocache_policy = MC_MAR_POLICY_OPS(nocache, "none", nocache_fields, nocache_config);

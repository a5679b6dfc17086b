/* The MAR cache-policy seam. A policy is one C file that fills one
 * mc_mar_policy_ops table; the sampler (mar_sampler.c) calls it once per
 * phase and never names a policy:
 *
 *   init        before the AR loop: fill the policy's state for this run
 *               (mc_mar_policy_make checks the config and allocates the
 *               state, state_size bytes zeroed)
 *   plan        before the AR loop: size every buffer for the run's largest step
 *   transformer per AR step: the condition vectors z of the predicted rows
 *   head_plan   per AR step: the head-cache mode of each diffusion step
 *   cache_bytes per AR step: bytes the policy holds (telemetry)
 *   release     after the run: free what the state holds (mc_mar_policy_free
 *               then frees the state itself)
 *
 * Register a new policy in mar_policies.c. */
#ifndef MC_MAR_POLICY_H
#define MC_MAR_POLICY_H

#include <stddef.h>
#include <stdint.h>

#include "../models/mar.h"
#include "config_fields.h"
#include "head_cache.h"

/* The run a policy is created for. */
typedef struct mc_mar_run_shape {
    int64_t n_images; /* B */
    int cfg_on;       /* B' = 2B sequences (cond, then uncond) when on */
    int num_steps;
} mc_mar_run_shape;

/* One AR step's transformer input as the sampler knows it. */
typedef struct mc_mar_step {
    int step, num_steps;
    int64_t n_images;           /* B */
    int cfg_on;
    const float *tokens;        /* backend [B', S, C] */
    const float *class_vectors; /* backend [B', D] */
    const int32_t *known_pos;   /* host [B', K], ascending per sequence */
    int64_t n_known;
    const int32_t *pred_pos;    /* host [B, n_pred], ascending per image */
    int64_t n_pred;
    const int32_t *out_rows;    /* host [n_out]: b * S + position of the z rows, cond then uncond */
    int64_t n_out;              /* B * n_pred, doubled with CFG */
} mc_mar_step;

/* What a policy's transformer did (telemetry). */
typedef struct mc_mar_transformer_stats {
    int full;                  /* the plain model ran (no cached state was read) */
    int64_t encoder_rows, decoder_rows, decoder_kept_rows;
    double flops;              /* runtime/flops.h rules */
    /* Rows kept or active per cached sequence, ascending; NULL when the
     * decoder ran every row. Valid until the next step. */
    const int32_t *kept_rows;
    int64_t kept_sequences, kept_per_sequence;
} mc_mar_transformer_stats;

typedef struct mc_mar_policy_ops {
    /* The Python policy's `name`, its config field by field, the config
     * struct's size. The first member, so a schema found by name is the table. */
    mc_config_schema schema;
    /* Cross-field and model-dependent checks of a filled config. */
    mc_status (*check)(const void *config, const mc_mar_config *model, mc_err *err);
    /* Fills a zeroed state of state_size bytes for one run with a checked
     * config. On failure the seam calls release: it must handle a state
     * init left partly filled. */
    size_t state_size;
    mc_status (*init)(void *state, mc_mar *mar, const void *config, const mc_mar_run_shape *run, mc_err *err);
    /* `most_live_rows`: the head rows (B x predicted) of the run's largest step. */
    mc_status (*plan)(void *state, int64_t most_live_rows, mc_err *err);
    /* Fills z [n_out, Dd] (backend) with the rows step->out_rows names. */
    mc_status (*transformer)(void *state, const mc_mar_step *step, float *z, mc_mar_transformer_stats *stats,
                             mc_err *err);
    /* The step's head plan: cache, per-diffusion-step modes, guidance. */
    mc_status (*head_plan)(void *state, const mc_mar_step *step, int n_diffusion_steps, mc_mar_head_plan *plan,
                           mc_err *err);
    size_t (*cache_bytes)(const void *state);
    void (*release)(void *state);
} mc_mar_policy_ops;

/* The ops table of a policy whose state is <prefix>_state and whose
 * functions are <prefix>_check, _init, _plan, _transformer, _head_plan,
 * _cache_bytes and _release. */
#define MC_MAR_POLICY_OPS(prefix, policy_name, field_table, config_type)                                      \
    {.schema = {policy_name, field_table, sizeof(config_type)}, .check = prefix##_check,                      \
     .state_size = sizeof(prefix##_state), .init = prefix##_init, .plan = prefix##_plan,                      \
     .transformer = prefix##_transformer, .head_plan = prefix##_head_plan,                                    \
     .cache_bytes = prefix##_cache_bytes, .release = prefix##_release}

/* A policy made for one run. */
typedef struct mc_mar_policy {
    const mc_mar_policy_ops *ops;
    void *state;
} mc_mar_policy;

/* A policy's life for one run (policy_seam.h): make checks the config,
 * allocates the state and has the policy fill it (ops NULL: NoCache); on
 * failure policy->state is NULL and nothing is held. */
mc_status mc_mar_policy_make(mc_mar_policy *policy, const mc_mar_policy_ops *ops, mc_mar *mar, const void *config,
                             const mc_mar_run_shape *run, mc_err *err);
void mc_mar_policy_free(mc_mar_policy *policy);

/* The registered policies, or the one named `name` (NULL if none). */
extern const mc_mar_policy_ops *const mc_mar_policies[];
const mc_mar_policy_ops *mc_mar_policy_find(const char *name);
/* The same as a config schema (the MC_FIELD_POLICY lookup of composing policies). */
const mc_config_schema *mc_mar_policy_schema(const char *name);
static inline const mc_mar_policy_ops *mc_mar_policy_of(const mc_config_schema *schema) {
    return (const mc_mar_policy_ops *)(const void *)schema;
}

extern const mc_mar_policy_ops mc_nocache_policy;

/* The inner policy of a composing policy (CfgFreeLate, DiSA), from its config
 * reference: checked (`outer` names the composing policy in the message) and
 * made for a run (mc_mar_policy_free frees it). */
mc_status mc_mar_inner_check(const mc_policy_ref *ref, const char *outer, const mc_mar_config *model, mc_err *err);
mc_status mc_mar_inner_make(mc_mar_policy *inner, mc_mar *mar, const mc_policy_ref *ref,
                            const mc_mar_run_shape *run, mc_err *err);

/* The plain transformer on step->out_rows: what NoCache runs on every step
 * and the other policies on full steps that fill nothing. */
mc_status mc_mar_plain_transformer(mc_mar *mar, const mc_mar_step *step, float *z, mc_mar_transformer_stats *stats,
                                   mc_err *err);

#endif

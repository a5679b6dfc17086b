/* The VAR cache-policy seam (the VAR family's counterpart of mar_policy.h).
 * A policy is one C file that fills one mc_var_policy_ops table; the scale
 * loop (var_sampler.c) calls it once per phase and never names a policy:
 *
 *   init         before the loop: fill the policy's state for this run (the
 *                model's activations and KV cache are already sized for the
 *                run; mc_var_policy_make checks the config and allocates the
 *                state, state_size bytes zeroed)
 *   scale_plan   per scale: run it, run it without guidance, or skip it
 *                (mc_var_scale_mode). Only trailing scales may be skipped
 *                (FastVAR's ratio 1: the f_hat so far is decoded as is), and
 *                only trailing scales may run unguided (CfgFreeLate: the
 *                unconditional sequences stop, so their K/V stop growing);
 *                the sampler refuses a plan that runs a scale after a skip or
 *                a guided scale after an unguided one
 *   transformer  per run scale: every block on the scale's input rows, leaving
 *                the last block's output of every row in scale->x and the rows'
 *                K/V in the model's KV cache (the plain blocks for NoCache;
 *                FastVAR prunes rows per block and sublayer, fills the pruned
 *                rows from its cached outputs and appends only kept K/V)
 *   cache_bytes  per scale: bytes the policy holds (telemetry)
 *   release      after the run: free what the state holds (mc_var_policy_free
 *                then frees the state itself)
 *
 * The sampler owns everything else: the conditioning, the scale inputs, the
 * logits of all rows, guidance, sampling and the VQ update. Register a new
 * policy in var_policies.c. */
#ifndef MC_VAR_POLICY_H
#define MC_VAR_POLICY_H

#include <stddef.h>
#include <stdint.h>

#include "../models/var.h"
#include "config_fields.h"

/* What scale_plan says of a scale. */
typedef enum mc_var_scale_mode {
    MC_VAR_SCALE_SKIP = 0,     /* not run (and neither is any later scale) */
    MC_VAR_SCALE_RUN = 1,      /* run as the sampler would: both CFG halves when the run has CFG */
    MC_VAR_SCALE_UNGUIDED = 2, /* run the conditional sequences alone and sample their logits
                                  unguided (t = 0); every later scale run is unguided too */
} mc_var_scale_mode;

/* The run a policy is created for. */
typedef struct mc_var_run_shape {
    int64_t n_images; /* B */
    int cfg_on;       /* the unconditional half runs too: B' = 2B sequences (cond, then uncond) */
    int64_t n_seq;    /* B' */
} mc_var_run_shape;

/* One scale's transformer input as the sampler knows it. */
typedef struct mc_var_scale {
    int si, n_scales;
    int64_t n_seq;  /* B' of the run; B (the conditional half, the first B sequences of every
                       buffer and of the KV cache) at an unguided scale */
    int64_t pn;     /* side of the token map */
    int64_t tokens; /* pn * pn rows per sequence */
    int64_t begin;  /* the scale's first token in the L-token sequence (= the plain KV length before it) */
    float *x;       /* backend [n_seq, tokens, C]: the scale's input; the last block's output on return */
    /* Optional (tests: the binding's forward_scales with trace=True), else
     * NULL: host int32 [depth][2][n_seq][tokens], which the caller fills with
     * every row (0..tokens-1 for each block, sublayer and sequence). A policy
     * that runs a sublayer on a subset of rows overwrites that sublayer's
     * entries: each sequence's rows in ascending order, then -1. */
    int32_t *trace_rows;
} mc_var_scale;

/* What a policy's transformer did (telemetry). */
typedef struct mc_var_transformer_stats {
    int full;              /* every block ran on every row (no cached output was used) */
    int64_t sublayer_rows; /* rows run, summed over every sublayer of every block and sequence */
    int64_t kv_rows;       /* K/V rows per sequence after the scale (the largest over blocks) */
    double flops;          /* runtime/flops.h rules */
    /* Rows per sequence each sublayer ran on, [depth][2] (attention, FFN),
     * owned by the policy and valid until its next call; NULL: every block
     * ran every row (the telemetry then reports `tokens` for each). */
    const int64_t *block_rows;
} mc_var_transformer_stats;

typedef struct mc_var_policy_ops {
    /* The policy's name, its config field by field, the config struct's
     * size. The first member, so a schema found by name is the table. */
    mc_config_schema schema;
    /* Cross-field and model-dependent checks of a filled config. */
    mc_status (*check)(const void *config, const mc_var_config *model, mc_err *err);
    /* Fills a zeroed state of state_size bytes for one run with a checked
     * config. On failure the seam calls release: it must handle a state
     * init left partly filled. */
    size_t state_size;
    mc_status (*init)(void *state, mc_var *var, const void *config, const mc_var_run_shape *run, mc_err *err);
    /* An mc_var_scale_mode: run scale si, run it unguided, or skip it. */
    int (*scale_plan)(void *state, int si);
    mc_status (*transformer)(void *state, const mc_var_scale *scale, mc_var_transformer_stats *stats, mc_err *err);
    size_t (*cache_bytes)(const void *state);
    void (*release)(void *state);
} mc_var_policy_ops;

/* The ops table of a policy whose state is <prefix>_state and whose
 * functions are <prefix>_check, _init, _scale_plan, _transformer,
 * _cache_bytes and _release. */
#define MC_VAR_POLICY_OPS(prefix, policy_name, field_table, config_type)                                    \
    {.schema = {policy_name, field_table, sizeof(config_type)}, .check = prefix##_check,                    \
     .state_size = sizeof(prefix##_state), .init = prefix##_init, .scale_plan = prefix##_scale_plan,        \
     .transformer = prefix##_transformer, .cache_bytes = prefix##_cache_bytes, .release = prefix##_release}

/* A policy made for one run. */
typedef struct mc_var_policy {
    const mc_var_policy_ops *ops;
    void *state;
} mc_var_policy;

/* A policy's life for one run (policy_seam.h): make checks the config,
 * allocates the state and has the policy fill it (ops NULL: NoCache); on
 * failure policy->state is NULL and nothing is held. */
mc_status mc_var_policy_make(mc_var_policy *policy, const mc_var_policy_ops *ops, mc_var *var, const void *config,
                             const mc_var_run_shape *run, mc_err *err);
void mc_var_policy_free(mc_var_policy *policy);

/* The registered policies, or the one named `name` (NULL if none). "none",
 * the name of the Python NoCache class MAR and VAR share, finds NoCache. */
extern const mc_var_policy_ops *const mc_var_policies[];
const mc_var_policy_ops *mc_var_policy_find(const char *name);
const mc_config_schema *mc_var_policy_schema(const char *name);

extern const mc_var_policy_ops mc_var_nocache_policy;
extern const mc_var_policy_ops mc_var_fastvar_policy;
extern const mc_var_policy_ops mc_var_cfgfree_policy;

/* The ops table of a schema found by mc_var_policy_schema (its first member). */
static inline const mc_var_policy_ops *mc_var_policy_of(const mc_config_schema *schema) {
    return (const mc_var_policy_ops *)(const void *)schema;
}

/* The plain transformer of a scale (every block on every row, K/V appended
 * after the scales before it): what NoCache runs at every scale, and what a
 * pruning policy runs at the scales before it prunes. It assumes every
 * block's cache holds exactly the rows of the earlier scales (scale->begin);
 * after a scale that appended only kept rows, a policy calls the sublayers
 * (models/var.h) with each block's own K/V length instead. */
mc_status mc_var_plain_transformer(mc_var *var, const mc_var_scale *scale, mc_var_transformer_stats *stats,
                                   mc_err *err);

#endif

/* NoCache for VAR: every scale runs every block on every row, as the official
 * model does. A real policy, so the scale loop has one code path. */
#include "flops.h"
#include "var_policy.h"

typedef struct var_nocache_config {
    char unused; /* NoCache has no fields; C11 forbids an empty struct */
} var_nocache_config;

static const mc_config_field var_nocache_fields[] = {MC_FIELDS_END};

typedef struct var_nocache_state {
    mc_var *var;
} var_nocache_state;

mc_status mc_var_plain_transformer(mc_var *var, const mc_var_scale *scale, mc_var_transformer_stats *stats,
                                   mc_err *err) {
    const mc_var_config *c = &var->config;
    const int64_t keys = scale->begin + scale->tokens;
    stats->full = 1;
    stats->sublayer_rows = 2 * c->depth * scale->n_seq * scale->tokens;
    stats->kv_rows = keys;
    stats->flops = mc_var_flops_blocks(c, scale->n_seq, scale->tokens, keys);
    return mc_var_blocks(var, scale->x, scale->n_seq, scale->tokens, scale->begin, err);
}

static mc_status var_nocache_check(const void *config, const mc_var_config *model, mc_err *err) {
    (void)config, (void)model, (void)err;
    return MC_OK;
}

static mc_status var_nocache_init(void *state, mc_var *var, const void *config, const mc_var_run_shape *run,
                                  mc_err *err) {
    (void)config, (void)run, (void)err;
    ((var_nocache_state *)state)->var = var;
    return MC_OK;
}

static int var_nocache_scale_plan(void *state, int si) {
    (void)state, (void)si;
    return MC_VAR_SCALE_RUN;
}

static mc_status var_nocache_transformer(void *state, const mc_var_scale *scale, mc_var_transformer_stats *stats,
                                         mc_err *err) {
    return mc_var_plain_transformer(((var_nocache_state *)state)->var, scale, stats, err);
}

static size_t var_nocache_cache_bytes(const void *state) {
    (void)state;
    return 0;
}

static void var_nocache_release(void *state) { (void)state; /* the state holds nothing of its own */ }

const mc_var_policy_ops mc_var_nocache_policy =
    MC_VAR_POLICY_OPS(var_nocache, "nocache", var_nocache_fields, var_nocache_config);

/* CfgFreeLate for VAR: classifier-free guidance for the early scales only.
 * Scale si of n is guidance-free when si >= after * n (the MAR policy's rule,
 * cfgfree.c, with scales as steps): it runs the conditional sequences alone
 * and samples their logits unguided (t = 0), which halves the transformer and
 * the head of the late scales, the most expensive ones (13x13 and 16x16 hold
 * 63 % of VAR's FLOPs). VAR's own guidance grows with the scale (t = cfg * si /
 * (n - 1)), so the late scales are where it is strongest: what it costs in
 * quality is measured on the digits VAR (benchmarks/results/fastvar-digits-*.md).
 *
 * It composes with another VAR policy, `inner`, which plans and runs every
 * scale as it would alone, except that the late scales reach its transformer
 * with the conditional half only (scale->n_seq = n_images; var_policy.h). A
 * scale the inner policy skips stays skipped. NoCache and FastVAR compose:
 * both work on whichever sequences a scale brings, and FastVAR restores the
 * conditional rows from the conditional half of its cache. */

#include "var_policy.h"

typedef struct mc_var_cfgfree_config {
    double after;        /* normalised progress from which scales are guidance-free */
    mc_policy_ref inner; /* the composed VAR policy */
} mc_var_cfgfree_config;

static const mc_config_field var_cfgfree_fields[] = {
    MC_FIELD_DOUBLE_AT(mc_var_cfgfree_config, after, 0, 1),
    MC_FIELD_POLICY_AT(mc_var_cfgfree_config, inner, mc_var_policy_schema),
    MC_FIELDS_END,
};

typedef struct var_cfgfree_state {
    double after;
    int n_scales, cfg_on;
    mc_var_policy inner;
} var_cfgfree_state;

static mc_status var_cfgfree_check(const void *config, const mc_var_config *model, mc_err *err) {
    const mc_var_cfgfree_config *cfg = config;
    if (!(cfg->after >= 0.0 && cfg->after <= 1.0))
        return mc_fail(err, MC_ERR_VALUE, "CfgFreeLate: after must be in [0, 1], got %g", cfg->after);
    if (cfg->inner.schema == NULL || cfg->inner.config == NULL)
        return mc_fail(err, MC_ERR_VALUE, "CfgFreeLate: no inner policy");
    const mc_var_policy_ops *inner = mc_var_policy_of(cfg->inner.schema);
    if (inner == &mc_var_cfgfree_policy)
        return mc_fail(err, MC_ERR_VALUE, "CfgFreeLate.inner: a CfgFreeLate inside a CfgFreeLate (compose it "
                       "with NoCache or FastVAR)");
    return inner->check(cfg->inner.config, model, err);
}

static void var_cfgfree_release(void *state) { mc_var_policy_free(&((var_cfgfree_state *)state)->inner); }

static mc_status var_cfgfree_init(void *state, mc_var *var, const void *config, const mc_var_run_shape *run,
                                  mc_err *err) {
    var_cfgfree_state *s = state;
    const mc_var_cfgfree_config *cfg = config;
    s->after = cfg->after;
    s->n_scales = var->config.n_scales;
    s->cfg_on = run->cfg_on;
    /* The inner policy is made for the whole run (both halves): the early
     * scales run guided, and its buffers then hold both. */
    return mc_var_policy_make(&s->inner, mc_var_policy_of(cfg->inner.schema), var, cfg->inner.config, run, err);
}

/* The inner policy's plan, unguided from `after` on (only when the run has
 * CFG: without it every scale already runs the conditional sequences alone). */
static int var_cfgfree_scale_plan(void *state, int si) {
    var_cfgfree_state *s = state;
    const int plan = s->inner.ops->scale_plan(s->inner.state, si);
    if (plan == MC_VAR_SCALE_SKIP || !s->cfg_on)
        return plan;
    return (double)si >= s->after * (double)s->n_scales ? MC_VAR_SCALE_UNGUIDED : plan;
}

static mc_status var_cfgfree_transformer(void *state, const mc_var_scale *scale, mc_var_transformer_stats *stats,
                                         mc_err *err) {
    var_cfgfree_state *s = state;
    return s->inner.ops->transformer(s->inner.state, scale, stats, err);
}

static size_t var_cfgfree_cache_bytes(const void *state) {
    const var_cfgfree_state *s = state;
    return s->inner.ops->cache_bytes(s->inner.state);
}

const mc_var_policy_ops mc_var_cfgfree_policy =
    MC_VAR_POLICY_OPS(var_cfgfree, "cfgfree", var_cfgfree_fields, mc_var_cfgfree_config);

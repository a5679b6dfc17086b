/* CfgFreeLate: classifier-free guidance only for the early AR steps. From
 * normalised progress `after` on (AR step s with s >= after * num_steps), a
 * step runs the conditional sequences alone and the head samples them
 * without guidance: the late steps, which fill in the last tokens, cost half
 * of the transformer and of the head.
 *
 * It composes with another policy, `inner`, which runs every step as it
 * would alone, except that the late steps reach it guidance-free (a step
 * with cfg_on = 0 and only conditional z rows). NoCache composes always;
 * LazyMAR and MARche compose when their condition cache is on (their caches
 * then hold the conditional half alone; without it they refuse the step). */

#include "mar_policy.h"

typedef struct mc_cfgfree_config {
    double after;        /* normalised progress from which steps are guidance-free */
    mc_policy_ref inner; /* the composed policy */
} mc_cfgfree_config;

static const mc_config_field cfgfree_fields[] = {
    MC_FIELD_DOUBLE_AT(mc_cfgfree_config, after, 0, 1),
    MC_FIELD_POLICY_AT(mc_cfgfree_config, inner, mc_mar_policy_schema),
    MC_FIELDS_END,
};

typedef struct cfgfree_state {
    double after;
    mc_mar_policy inner;
} cfgfree_state;

static int guidance_free(double after, const mc_mar_step *s) {
    return s->cfg_on && (double)s->step >= after * (double)s->num_steps;
}

static mc_status cfgfree_check(const void *config, const mc_mar_config *model, mc_err *err) {
    const mc_cfgfree_config *cfg = config;
    if (!(cfg->after >= 0.0 && cfg->after <= 1.0))
        return mc_fail(err, MC_ERR_VALUE, "CfgFreeLate: after must be in [0, 1], got %g", cfg->after);
    return mc_mar_inner_check(&cfg->inner, "CfgFreeLate", model, err);
}

static void cfgfree_release(void *state) { mc_mar_policy_free(&((cfgfree_state *)state)->inner); }

static mc_status cfgfree_init(void *state, mc_mar *mar, const void *config, const mc_mar_run_shape *run,
                              mc_err *err) {
    cfgfree_state *s = state;
    const mc_cfgfree_config *cfg = config;
    s->after = cfg->after;
    return mc_mar_inner_make(&s->inner, mar, &cfg->inner, run, err);
}

static mc_status cfgfree_plan(void *state, int64_t most_live_rows, mc_err *err) {
    cfgfree_state *s = state;
    return s->inner.ops->plan(s->inner.state, most_live_rows, err);
}

/* A late step reaches the inner policy as a step without CFG: the
 * conditional sequences come first in every buffer, so it is the same step
 * with B sequences and the first half of the output rows. */
static mc_mar_step late_step(const mc_mar_step *step) {
    mc_mar_step cond = *step;
    cond.cfg_on = 0;
    cond.n_out = step->n_images * step->n_pred;
    return cond;
}

static mc_status cfgfree_transformer(void *state, const mc_mar_step *step, float *z, mc_mar_transformer_stats *stats,
                                     mc_err *err) {
    cfgfree_state *s = state;
    if (!guidance_free(s->after, step))
        return s->inner.ops->transformer(s->inner.state, step, z, stats, err);
    const mc_mar_step cond = late_step(step);
    return s->inner.ops->transformer(s->inner.state, &cond, z, stats, err);
}

static mc_status cfgfree_head_plan(void *state, const mc_mar_step *step, int n_steps, mc_mar_head_plan *plan,
                                   mc_err *err) {
    cfgfree_state *s = state;
    const int late = guidance_free(s->after, step);
    const mc_mar_step cond = late ? late_step(step) : *step;
    MC_TRY(s->inner.ops->head_plan(s->inner.state, &cond, n_steps, plan, err));
    plan->guidance_off = plan->guidance_off || late;
    return MC_OK;
}

static size_t cfgfree_cache_bytes(const void *state) {
    const cfgfree_state *s = state;
    return s->inner.ops->cache_bytes(s->inner.state);
}

const mc_mar_policy_ops mc_cfgfree_policy = MC_MAR_POLICY_OPS(cfgfree, "cfgfree", cfgfree_fields, mc_cfgfree_config);

/* DiSA (diffusion step annealing; Zhao et al., arXiv 2505.20297, spec
 * disa.md): the diffusion head samples AR step `step` of `num_steps` with a
 * respaced DDPM of k steps, k annealed from `start` (first AR step) to `end`
 * (last) by the official schedule index formula. Everything else (CFG,
 * temperature, mask schedule, transformer) is the inner policy's.
 *
 * It composes with another policy, `inner`, which runs every step as it
 * would alone and plans its head cache for the step's k diffusion steps (a
 * head cache is defined on diffusion indices j = k-1..0: its period and
 * recompute threshold apply to the respaced indices). The respaced tables are
 * built before the loop for every step count the run will use, and so are the
 * time embeddings of their timesteps, so the loop allocates nothing. */
#include <math.h>
#include <stdlib.h>

#include "mar_policy.h"

enum { DISA_LINEAR = 0, DISA_COSINE, DISA_CONSTANT, DISA_TWO_STAGE };

typedef struct mc_disa_config {
    int start, end;      /* diffusion steps at the first and at the last AR step */
    int schedule;        /* DISA_* */
    int clip;            /* kept timesteps become min(t, clip); 999 clips nothing */
    mc_policy_ref inner; /* the composed policy */
} mc_disa_config;

static const mc_config_field disa_fields[] = {
    MC_FIELD_INT_AT(mc_disa_config, start, 1, MC_DIFFUSION_MAX_STEPS),
    MC_FIELD_INT_AT(mc_disa_config, end, 1, MC_DIFFUSION_MAX_STEPS),
    MC_FIELD_CHOICE_AT(mc_disa_config, schedule, "linear|cosine|constant|two-stage"),
    MC_FIELD_INT_AT(mc_disa_config, clip, 0, MC_DIFFUSION_BASE_STEPS - 1),
    MC_FIELD_POLICY_AT(mc_disa_config, inner, mc_mar_policy_schema),
    MC_FIELDS_END,
};

typedef struct disa_state {
    mc_disa_config cfg;
    int num_steps;
    mc_mar_policy inner;
    /* tables[i]: the respacing of end + i steps, made for the indices the
     * run's steps pick (NULL for the others). */
    mc_diffusion **tables;
    int n_tables;
} disa_state;

/* The official index into the list of respacings end..start (disa.md), in
 * double as Python evaluates it; int() truncates toward zero. With one AR
 * step the official formula divides by zero: that step uses `start` steps. */
static int schedule_index(const mc_disa_config *cfg, int step, int num_steps) {
    const int last = cfg->start - cfg->end; /* L - 1 */
    const int upper = num_steps - 1;
    if (upper <= 0)
        return last;
    switch (cfg->schedule) {
    case DISA_COSINE:
        return (int)((cos(3.14159265358979323846 * (double)step / (double)upper) + 1.0) / 2.0 * (double)last);
    case DISA_CONSTANT:
        return 0;
    case DISA_TWO_STAGE:
        return (double)step < (double)upper / 2.0 ? last : 0;
    default:
        return (int)((double)(upper - step) / (double)upper * (double)last);
    }
}

static mc_status disa_check(const void *config, const mc_mar_config *model, mc_err *err) {
    const mc_disa_config *cfg = config;
    if (cfg->end < 1 || cfg->start > MC_DIFFUSION_MAX_STEPS)
        return mc_fail(err, MC_ERR_VALUE, "DiSA: start and end must be in 1..%d", MC_DIFFUSION_MAX_STEPS);
    if (cfg->start < cfg->end)
        return mc_fail(err, MC_ERR_VALUE, "DiSA: start (%d) must be >= end (%d)", cfg->start, cfg->end);
    if (cfg->clip < 0 || cfg->clip > MC_DIFFUSION_BASE_STEPS - 1)
        return mc_fail(err, MC_ERR_VALUE, "DiSA: clip must be in 0..%d, got %d", MC_DIFFUSION_BASE_STEPS - 1,
                       cfg->clip);
    if (cfg->schedule < DISA_LINEAR || cfg->schedule > DISA_TWO_STAGE)
        return mc_fail(err, MC_ERR_VALUE, "DiSA: unknown schedule %d", cfg->schedule);
    return mc_mar_inner_check(&cfg->inner, "DiSA", model, err);
}

static void disa_release(void *state) {
    disa_state *s = state;
    mc_mar_policy_free(&s->inner);
    if (s->tables != NULL)
        for (int i = 0; i < s->n_tables; i++)
            free(s->tables[i]);
    free(s->tables);
}

/* The respacing of every step count the run uses, with its timesteps'
 * embeddings. */
static mc_status make_tables(disa_state *s, mc_mar *mar, mc_err *err) {
    s->n_tables = s->cfg.start - s->cfg.end + 1;
    s->tables = calloc((size_t)s->n_tables, sizeof *s->tables);
    if (s->tables == NULL)
        return mc_fail_nomem_n(err, (size_t)s->n_tables, sizeof *s->tables, "DiSA's table list (%d entries)",
                               s->n_tables);
    for (int step = 0; step < s->num_steps; step++) {
        const int i = schedule_index(&s->cfg, step, s->num_steps);
        if (i < 0 || i >= s->n_tables)
            return mc_fail(err, MC_ERR_INTERNAL, "DiSA: schedule index %d out of 0..%d", i, s->n_tables - 1);
        if (s->tables[i] != NULL)
            continue;
        if ((s->tables[i] = malloc(sizeof *s->tables[i])) == NULL)
            return mc_fail_nomem(err, sizeof *s->tables[i], "DiSA's respacing to %d steps", s->cfg.end + i);
        MC_TRY(mc_diffusion_init_clipped(s->tables[i], s->cfg.end + i, s->cfg.clip, err));
        MC_TRY(mc_mar_prepare_time_embeddings(mar, s->tables[i]->timesteps, s->tables[i]->n_steps, err));
    }
    return MC_OK;
}

static mc_status disa_init(void *state, mc_mar *mar, const void *config, const mc_mar_run_shape *run,
                           mc_err *err) {
    disa_state *s = state;
    const mc_disa_config *cfg = config;
    s->cfg = *cfg;
    s->num_steps = run->num_steps;
    MC_TRY(make_tables(s, mar, err));
    return mc_mar_inner_make(&s->inner, mar, &cfg->inner, run, err);
}

static mc_status disa_plan(void *state, int64_t most_live_rows, mc_err *err) {
    disa_state *s = state;
    return s->inner.ops->plan(s->inner.state, most_live_rows, err);
}

static mc_status disa_transformer(void *state, const mc_mar_step *step, float *z, mc_mar_transformer_stats *stats,
                                  mc_err *err) {
    disa_state *s = state;
    return s->inner.ops->transformer(s->inner.state, step, z, stats, err);
}

/* The inner policy plans the step's head for the step's respacing. */
static mc_status disa_head_plan(void *state, const mc_mar_step *step, int n_steps, mc_mar_head_plan *plan,
                                mc_err *err) {
    (void)n_steps;
    disa_state *s = state;
    const int i = schedule_index(&s->cfg, step->step, step->num_steps);
    if (step->num_steps != s->num_steps || i < 0 || i >= s->n_tables || s->tables[i] == NULL)
        return mc_fail(err, MC_ERR_INTERNAL, "DiSA: no respacing prepared for AR step %d of %d", step->step,
                       step->num_steps);
    const mc_diffusion *d = s->tables[i];
    MC_TRY(s->inner.ops->head_plan(s->inner.state, step, d->n_steps, plan, err));
    plan->diffusion = d;
    return MC_OK;
}

static size_t disa_cache_bytes(const void *state) {
    const disa_state *s = state;
    return s->inner.ops->cache_bytes(s->inner.state);
}

const mc_mar_policy_ops mc_disa_policy = MC_MAR_POLICY_OPS(disa, "disa", disa_fields, mc_disa_config);

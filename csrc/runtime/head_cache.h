/* LazyMAR's diffusion-head cache (lazymar.md 7), a helper any MAR policy can
 * embed (LazyMAR and MARche do): which head-cache mode each diffusion step
 * runs in, the per-block buffers of the live (conditional) rows, and the
 * head evaluation in each mode, composed from the model's head blocks. */
#ifndef MC_HEAD_CACHE_H
#define MC_HEAD_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "../models/mar.h"
#include "config_fields.h"
#include "diffusion.h"

typedef enum mc_head_mode {
    MC_HEAD_PLAIN = 0, /* the network as published, nothing stored */
    MC_HEAD_STORE,     /* full evaluation; store MLP outputs and skipped-block deltas */
    MC_HEAD_RECOMPUTE, /* live rows only; skipped blocks add their delta; MLPs recomputed and stored */
    MC_HEAD_REUSE      /* live rows only; skipped blocks add their delta; MLPs reused, gate recomputed */
} mc_head_mode;

/* A full evaluation runs every row (both CFG halves); the cached modes run
 * the live rows only, and eps_uncond = eps_cond - the delta of the last full step. */
static inline int mc_head_mode_full(mc_head_mode mode) { return mode == MC_HEAD_PLAIN || mode == MC_HEAD_STORE; }

/* The head cache's settings, embedded in every policy config that offers it
 * (the Python fields of the same names). */
typedef struct mc_head_cache_config {
    int head_cache;              /* on/off */
    int head_period;             /* full timesteps: the first, and j % period == 0 */
    int head_skip_first, head_skip_last; /* res blocks replaced by cached deltas, inclusive */
    double head_recompute_above; /* cached timesteps j > this * T recompute the MLPs */
} mc_head_cache_config;

/* The field-table rows of mc_head_cache_config member `member` of struct `st`. */
#define MC_HEAD_CACHE_FIELDS(st, member)                                                             \
    MC_FIELD_NAMED("head_cache", MC_FIELD_BOOL, st, member.head_cache, 0, 1),                        \
    MC_FIELD_NAMED("head_period", MC_FIELD_INT, st, member.head_period, 1, MC_FIELD_INT_MAX),        \
    MC_FIELD_NAMED("head_skip_first", MC_FIELD_INT, st, member.head_skip_first, 0, MC_FIELD_INT_MAX), \
    MC_FIELD_NAMED("head_skip_last", MC_FIELD_INT, st, member.head_skip_last, -1, MC_FIELD_INT_MAX),  \
    MC_FIELD_NAMED("head_recompute_above", MC_FIELD_DOUBLE, st, member.head_recompute_above, 0, 1)

/* Per-block buffers of the live rows as one head evaluation reads them. */
typedef struct mc_head_cache {
    int skip_first, skip_last; /* res blocks replaced by cached deltas, inclusive */
    int64_t live_rows;         /* n: the conditional rows whose caches are kept */
    float **mlp;               /* [head_depth] of [n, W]: computed blocks' MLP outputs */
    float **delta;             /* [head_depth] of [n, W]: skipped blocks' deltas */
} mc_head_cache;

/* What the head sampler needs from a policy for one AR step. */
typedef struct mc_mar_head_plan {
    const mc_head_cache *cache; /* NULL: no head cache (every step plain) */
    const mc_head_mode *modes;  /* [n_diffusion_steps], indexed by diffusion index j; NULL: all plain */
    int guidance_off;           /* sample the conditional rows without CFG (the step's z has no uncond rows) */
    /* The respaced DDPM this AR step samples with (DiSA), its timesteps'
     * embeddings prepared; NULL: the run's own (the model's diffusion_steps).
     * `modes` then has diffusion->n_steps entries. */
    const mc_diffusion *diffusion;
} mc_mar_head_plan;

/* A policy's head-cache state. */
typedef struct mc_head_cache_state {
    mc_mar *mar;
    mc_head_cache_config cfg;
    float *buffer;         /* [head_depth, live rows, W], grow-only */
    size_t buffer_floats;
    float **blocks;        /* [head_depth] pointers into buffer */
    mc_head_mode *modes;   /* [n_modes]: capacity; a step's plan fills its n_steps first entries */
    int n_modes;
    mc_head_cache cache;
} mc_head_cache_state;

mc_status mc_head_cache_check(const mc_head_cache_config *cfg, const char *policy, mc_err *err);
mc_status mc_head_cache_init(mc_head_cache_state *hc, mc_mar *mar, const mc_head_cache_config *cfg, mc_err *err);
void mc_head_cache_release(mc_head_cache_state *hc);
size_t mc_head_cache_bytes(const mc_head_cache_state *hc);
/* Sizes the buffers for `live_rows` rows (grow-only); a no-op with the cache off. */
mc_status mc_head_cache_reserve(mc_head_cache_state *hc, int64_t live_rows, mc_err *err);
/* The plan of an AR step whose head samples `live_rows` rows in `n_steps` diffusion steps. */
mc_status mc_head_cache_plan(mc_head_cache_state *hc, int64_t live_rows, int n_steps, mc_mar_head_plan *plan,
                             mc_err *err);

/* One head evaluation in `mode` at the timestep whose embedding row is
 * t_emb (mc_mar_time_embedding; cache may be NULL for MC_HEAD_PLAIN):
 * out [rows, 2C]. In the cached modes rows must be the live rows. */
mc_status mc_head_forward(mc_mar *mar, const float *x, int64_t rows, int x_duplicated, const float *c_emb,
                          const float *t_emb, float *out, const mc_head_cache *cache, mc_head_mode mode, mc_err *err);

#endif

/* The named activations of MAR's runtime: the sampler's and the cache
 * policies' buffers (backend/workspace.h), attached to the model on first
 * use (mc_mar.runtime) so that a second call of the same size allocates
 * nothing, and freed with it. */
#ifndef MC_MAR_WORKSPACE_H
#define MC_MAR_WORKSPACE_H

#include "../backend/workspace.h"
#include "../models/mar.h"

/* The sampler's (mar_sampler.c; the binding's component calls borrow them). */
typedef struct mc_mar_sampler_acts {
    mc_buffer tokens;        /* the sequences' tokens [B', S, C] */
    mc_buffer class_vectors; /* [B', D] */
    mc_buffer z;             /* condition vectors of the predicted rows [n_out, Dd] */
    mc_buffer cond_emb;      /* the head's cond_embed(z) [rows, W] */
    mc_buffer state;         /* the head sampler's x [n, C] (then the sampled tokens) */
    mc_buffer head_out;      /* the head's output [rows, 2C] */
    mc_buffer eps, noise, eps_delta; /* [n, C] */
    mc_buffer images, positions;     /* uint32 [n]: the Philox keys of the head rows */
    mc_buffer scatter;               /* int32 [n]: rows the sampled tokens go to */
} mc_mar_sampler_acts;

/* The cache policies' (mar_caches.c, lazymar.c, marche.c, rows.c). */
typedef struct mc_mar_policy_acts {
    mc_buffer enc_x;  /* encoder rows of a cached step */
    mc_buffer dec_x;  /* decoder rows of a cached step */
    mc_buffer scores; /* row scores (and MARche's generating queries) */
    mc_buffer kept_x; /* the kept (active) rows */
    mc_buffer rows;   /* int32 device row indices */
} mc_mar_policy_acts;

typedef struct mc_mar_runtime_acts {
    mc_mar_sampler_acts sampler;
    mc_mar_policy_acts policy;
} mc_mar_runtime_acts;

/* The model's runtime activations, made and attached on first use; NULL with
 * err set when out of memory. */
mc_mar_runtime_acts *mc_mar_runtime_acts_of(mc_mar *mar, mc_err *err);

#endif

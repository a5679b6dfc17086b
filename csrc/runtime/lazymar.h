/* LazyMAR (lazymar.md), faithful to the official code by default: full and
 * cached AR steps, the token cache (encoder token cache + decoder token
 * pruning ranked by the cosine of V at the selection layer), the condition
 * (CFG) cache at the last decoder block, and the diffusion-head cache. Every
 * constant is a field; each of the three caches can be switched off. */
#ifndef MC_LAZYMAR_H
#define MC_LAZYMAR_H

#include <stdint.h>

#include "head_cache.h"
#include "mar_policy.h"

#define MC_LAZYMAR_TABLE 64

/* marcache.LazyMAR's fields. */
typedef struct mc_lazymar_config {
    int token_cache, cond_cache;
    int start, period;                 /* full: s < start or (s - start) % period == 0 */
    float retention[MC_LAZYMAR_TABLE]; /* kept fraction of the P + S decoder rows, 64-step table */
    int select_layer;                  /* 0-based decoder layer whose V ranks tokens */
    int margin;                        /* rows kept beyond predicted now + predicted last step */
    mc_head_cache_config head;
} mc_lazymar_config;

extern const mc_mar_policy_ops mc_lazymar_policy;

int mc_lazymar_full_step(const mc_lazymar_config *cfg, int step);
/* Retention fraction of step `step` of a run of `num_steps`: the 64-entry
 * table read at index floor(step * 64 / num_steps) (normalised progress;
 * the identity at 64 steps). */
float mc_lazymar_retention(const mc_lazymar_config *cfg, int step, int num_steps);
/* Decoder rows kept per sequence on a cached step. */
int64_t mc_lazymar_keep(const mc_lazymar_config *cfg, int step, int num_steps, int64_t predicted,
                        int64_t predicted_before, int64_t rows);

#endif

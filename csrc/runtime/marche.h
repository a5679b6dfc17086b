/* MARche (marche.md): cache-aware attention with selective KV refresh, with
 * LazyMAR's encoder token cache (option E1), condition cache and head cache
 * as compositions. */
#ifndef MC_MARCHE_H
#define MC_MARCHE_H

#include <stdint.h>

#include "head_cache.h"
#include "mar_policy.h"

/* marcache.MARche's fields (budget resolved for the model by the Python side). */
typedef struct mc_marche_config {
    int encoder_cache, cond_cache;
    int refresh_phase, refresh_period; /* full: s < phase or (s - phase) % period == 0 */
    int budget;                        /* active rows per sequence */
    int full_layers;                   /* decoder layers 1..full_layers run on every row */
    int select_layer;                  /* 1-based layer whose attention picks refreshing rows */
    int candidates;                    /* 0 "all" rows, 1 "image" rows only */
    int refresh;                       /* 0 "high" (most attended), 1 "low" (the ablation) */
    mc_head_cache_config head;
} mc_marche_config;

extern const mc_mar_policy_ops mc_marche_policy;

/* Active rows per sequence: max(budget, generating + caching), at most what
 * the candidates allow and at most `rows`. */
int64_t mc_marche_active_count(const mc_marche_config *cfg, int64_t generating, int64_t caching, int64_t rows,
                               int64_t candidates);

#endif

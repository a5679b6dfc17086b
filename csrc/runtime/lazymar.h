/* LazyMAR (lazymar.md), faithful to the official code by default: full and
 * cached AR steps, the encoder token cache, decoder token pruning ranked by
 * the cosine of V at the selection layer, the condition (CFG) cache at the
 * last decoder block, and the diffusion-head cache. Every constant is a
 * field; each of the three caches can be switched off. */
#ifndef MC_LAZYMAR_H
#define MC_LAZYMAR_H

#include <stdint.h>

#include "../models/mar.h"

#define MC_LAZYMAR_TABLE 64

/* How a cached step runs the decoder. */
typedef enum mc_decoder_mode {
    MC_DECODER_FULL = 0,    /* every layer on every row */
    MC_DECODER_LAZYMAR = 1, /* LazyMAR: rank rows by V cosine at select_layer, keep the least similar */
    MC_DECODER_MARCHE = 2   /* MARche: active set by attention mass at marche_select_layer */
} mc_decoder_mode;

/* One configuration for both published methods and their compositions
 * (marcache.LazyMAR and marcache.MARche fill it). */
typedef struct mc_lazymar_config {
    int encoder_cache;                     /* encoder token cache (LazyMAR's; MARche's option E1) */
    int decoder_mode;                      /* mc_decoder_mode */
    int cond_cache, head_cache;
    int start, period;                     /* full: s < start or (s - start) % period == 0 */
    float retention[MC_LAZYMAR_TABLE];     /* kept fraction of the P + S decoder rows, 64-step table */
    int select_layer;                      /* LazyMAR: 0-based decoder layer whose V ranks tokens */
    int margin;                            /* rows kept beyond predicted now + predicted last step */
    int budget;                            /* MARche: active rows per sequence */
    int full_layers;                       /* MARche: decoder layers 0..full_layers-1 run on every row */
    int marche_select_layer;               /* MARche: 0-based layer whose attention picks refreshing rows */
    int image_candidates;                  /* MARche: refreshing rows only among image rows */
    int refresh_low;                       /* MARche ablation: refresh the least attended rows */
    int head_period;                       /* head full timesteps: the first, and j % period == 0 */
    int head_skip_first, head_skip_last;   /* head res blocks replaced by cached deltas */
    double head_recompute_above;           /* cached timesteps j > this * T recompute the MLPs */
} mc_lazymar_config;

/* Validates a configuration against a model (layer and block indices). */
mc_status mc_lazymar_check(const mc_lazymar_config *cfg, const mc_mar_config *model, mc_err *err);

int mc_lazymar_full_step(const mc_lazymar_config *cfg, int step);
/* Retention fraction of step `step` of a run of `num_steps`: the 64-entry
 * table read at index floor(step * 64 / num_steps) (normalised progress;
 * the identity at 64 steps). */
float mc_lazymar_retention(const mc_lazymar_config *cfg, int step, int num_steps);
/* Decoder rows kept per sequence on a cached step. */
int64_t mc_lazymar_keep(const mc_lazymar_config *cfg, int step, int num_steps, int64_t predicted,
                        int64_t predicted_before, int64_t rows);

/* MARche active rows per sequence: max(budget, generating + caching), at
 * most what the candidates allow and at most `rows`. */
int64_t mc_marche_active_count(const mc_lazymar_config *cfg, int64_t generating, int64_t caching, int64_t rows,
                               int64_t candidates);

typedef struct mc_lazymar mc_lazymar;

mc_status mc_lazymar_create(mc_mar *mar, const mc_lazymar_config *cfg, int64_t n_images, int cfg_on,
                            mc_lazymar **out, mc_err *err);
void mc_lazymar_free(mc_lazymar *lz);
const mc_lazymar_config *mc_lazymar_config_of(const mc_lazymar *lz);
/* Bytes held by the caches (for telemetry). */
size_t mc_lazymar_cache_bytes(const mc_lazymar *lz);

/* One AR step's transformer input as the sampler knows it. */
typedef struct mc_lazymar_step {
    int step, num_steps;
    int64_t n_images;           /* B */
    int cfg_on;
    const float *tokens;        /* backend [B', S, C] */
    const float *class_vectors; /* backend [B', D] */
    const int32_t *known_pos;   /* host [B', K] */
    int64_t n_known;
    const int32_t *pred_pos;    /* host [B, n_pred], ascending */
    int64_t n_pred;
} mc_lazymar_step;

typedef struct mc_lazymar_stats {
    int full;
    int64_t encoder_rows, decoder_rows, decoder_kept_rows;
    double flops;
    /* Rows kept (LazyMAR) or active (MARche) per cached sequence, ascending;
     * NULL when the decoder ran every row. Valid until the next step. */
    const int32_t *kept_rows;
    int64_t kept_sequences, kept_per_sequence;
} mc_lazymar_stats;

/* Fills z [rows: cond (image-major, position ascending), then uncond] for the
 * predicted positions, like the plain transformer would. */
mc_status mc_lazymar_transformer(mc_lazymar *lz, const mc_lazymar_step *step, float *z,
                                 mc_lazymar_stats *stats, mc_err *err);

/* The head cache buffers for `live_rows` rows (grow-only). */
mc_status mc_lazymar_head_cache(mc_lazymar *lz, int64_t live_rows, mc_head_cache *cache, mc_err *err);

#endif

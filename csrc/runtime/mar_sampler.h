/* The MAR autoregressive loop (mar.md section 7) and the diffusion-head
 * sampler (section 6.5), with the schedules they use. */
#ifndef MC_MAR_SAMPLER_H
#define MC_MAR_SAMPLER_H

#include <stdint.h>

#include "../models/mar.h"
#include "diffusion.h"
#include "lazymar.h"

typedef enum mc_cfg_schedule { MC_CFG_LINEAR = 0, MC_CFG_CONSTANT = 1 } mc_cfg_schedule;

/* Tokens left masked after step k (mar.md 7.2 step 5), clamp included. */
int64_t mc_mask_len_after(int64_t seq_len, int64_t masked_before, int step, int num_steps);
/* cfg_iter of a step (mar.md 7.4), evaluated in float32 like the reference. */
float mc_cfg_at(double cfg, mc_cfg_schedule schedule, int64_t mask_len, int64_t seq_len);

typedef struct mc_step_info {
    int step;
    int num_steps;
    int64_t masked_before;
    int64_t predicted;        /* tokens predicted per image */
    float cfg;                /* cfg_iter used by the head */
    int64_t encoder_rows;     /* rows through each encoder block (all sequences) */
    int64_t decoder_rows;     /* rows through each decoder block */
    int full;                 /* 1 unless a cache policy made this a cached step */
    int64_t decoder_kept_rows; /* rows after the selection layer (= decoder_rows when not pruned) */
    int64_t head_rows;        /* rows of a full head evaluation */
    int64_t head_evaluations; /* diffusion steps run */
    int64_t head_cached_evaluations; /* of which ran from the head cache */
    int64_t cache_bytes;      /* bytes held by the cache policy */
    int head_graph;           /* the head's later diffusion steps ran as a recorded graph */
    const int32_t *kept_rows; /* see mc_lazymar_stats; valid during the callback only */
    int64_t kept_sequences, kept_per_sequence;
    double flops;             /* GEMM + attention FLOPs of this step */
    double seconds;
} mc_step_info;

/* Called after every AR step; a nonzero return cancels generation
 * (MC_ERR_INTERRUPTED). The callback owns what cancellation means. */
typedef int (*mc_step_callback)(void *ctx, const mc_step_info *info);

typedef struct mc_mar_generate_args {
    const int32_t *labels; /* [n_images]; -1 = unconditional */
    int64_t n_images;
    int num_steps;
    double cfg;
    mc_cfg_schedule cfg_schedule;
    double temperature;
    uint64_t seed;
    uint32_t first_index;
    mc_step_callback on_step;
    void *callback_ctx;
    const mc_lazymar_config *lazymar; /* NULL: no caching */
} mc_mar_generate_args;

/* Generates tokens [n_images, S, C] into host memory; `steps_out` (may be
 * NULL) receives num_steps entries. */
mc_status mc_mar_generate(mc_mar *mar, const mc_diffusion *diffusion,
                          const mc_mar_generate_args *args, float *tokens_out,
                          mc_step_info *steps_out, mc_err *err);

/* The head sampler alone on n conditional rows (and n unconditional rows of
 * z when cfg != 1): z [n or 2n, Dd] on the backend; rows are identified by
 * (image, position) for the noise streams. x_out [n, C] on the host, or NULL
 * to leave the result only in the backend state buffer. */
mc_status mc_mar_head_sample(mc_mar *mar, const mc_diffusion *diffusion, const float *z, int64_t n,
                             int cfg_on, float cfg, double temperature, uint64_t seed,
                             const uint32_t *images, const uint32_t *positions, float *x_out,
                             mc_err *err);

typedef struct mc_head_stats {
    int64_t full_evaluations, cached_evaluations;
    double flops;
    int graph; /* 1 when the diffusion steps after the first ran as one recorded graph */
} mc_head_stats;

/* The head sampler with LazyMAR's head cache when `lazymar` has it on. */
mc_status mc_mar_head_sample_ex(mc_mar *mar, const mc_diffusion *diffusion, const float *z, int64_t n,
                                int cfg_on, float cfg, double temperature, uint64_t seed,
                                const uint32_t *images, const uint32_t *positions, float *x_out,
                                mc_lazymar *lazymar, mc_head_stats *stats, mc_err *err);

/* FLOPs of the uncached transformer of one AR step (runtime/flops.h rules). */
double mc_mar_transformer_flops(const mc_mar_config *c, int64_t n_seq, int64_t n_known);

#endif

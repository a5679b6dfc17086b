/* The MAR autoregressive loop (mar.md section 7) and the diffusion-head
 * sampler (section 6.5), with the schedules they use. */
#ifndef MC_MAR_SAMPLER_H
#define MC_MAR_SAMPLER_H

#include <stdint.h>

#include "../models/mar.h"
#include "diffusion.h"
#include "driver.h"
#include "mar_policy.h"

typedef enum mc_cfg_schedule { MC_CFG_LINEAR = 0, MC_CFG_CONSTANT = 1 } mc_cfg_schedule;

/* Tokens left masked after step k (mar.md 7.2 step 5), clamp included. */
int64_t mc_mask_len_after(int64_t seq_len, int64_t masked_before, int step, int num_steps);
/* cfg_iter of a step (mar.md 7.4), evaluated in float32 like the reference. */
float mc_cfg_at(double cfg, mc_cfg_schedule schedule, int64_t mask_len, int64_t seq_len);

/* MAR's tail of the step telemetry (the header is driver.h's). */
typedef struct mc_mar_step_tail {
    int64_t masked_before;    /* tokens masked before the step, per image */
    int64_t predicted;        /* tokens predicted per image */
    float cfg;                /* cfg_iter used by the head */
    int64_t encoder_rows;     /* rows through each encoder block (all sequences) */
    int64_t decoder_rows;     /* rows through each decoder block */
    int64_t decoder_kept_rows; /* rows after the selection layer (= decoder_rows when not pruned) */
    int64_t head_rows;        /* rows of a full head evaluation */
    int64_t head_evaluations; /* diffusion steps run */
    int64_t head_cached_evaluations; /* of which ran from the head cache */
    int head_graph;           /* the head's later diffusion steps ran as a recorded graph */
    int diffusion_steps;      /* respaced DDPM steps the head sampled with (0 on a step that predicts nothing) */
    const int32_t *kept_rows; /* see mc_mar_transformer_stats; valid during the callback only */
    int64_t kept_sequences, kept_per_sequence;
    /* Where the step's work went (models/block_cost.h): the encoder's and
     * the decoder's blocks, and the head's sampling (cond_embed and every
     * diffusion step). The rest of the step (embeddings, output rows, the
     * policy's bookkeeping) is the header's seconds less these. Their
     * seconds are compute time only when phases_timed (a synchronous
     * backend, mc_ops.synchronous); otherwise they are not reported. */
    mc_phase_meter encoder, decoder, head;
    int phases_timed;
} mc_mar_step_tail;

typedef struct mc_mar_generate_args {
    const int32_t *labels; /* [n_images]; -1 = unconditional */
    int64_t n_images;
    int num_steps;
    double cfg;
    mc_cfg_schedule cfg_schedule;
    double temperature;
    uint64_t seed;
    uint32_t first_index;
    const mc_mar_policy_ops *policy; /* NULL: NoCache */
    const void *policy_config;       /* the policy's config struct */
} mc_mar_generate_args;

/* MAR generation as a user of the driver (driver.h). */
typedef struct mc_mar_run mc_mar_run;
extern const mc_generator_ops mc_mar_generator;
/* A run that writes tokens [n_images, S, C] into host memory `tokens_out`;
 * run it with mc_generate(&mc_mar_generator, run, ...), then free it. */
mc_status mc_mar_run_new(mc_mar *mar, const mc_diffusion *diffusion, const mc_mar_generate_args *args,
                         float *tokens_out, mc_mar_run **out, mc_err *err);
void mc_mar_run_free(mc_mar_run *run);

/* The whole generation in one call (C callers and tests). */
mc_status mc_mar_generate(mc_mar *mar, const mc_diffusion *diffusion, const mc_mar_generate_args *args,
                          float *tokens_out, const mc_driver_host *host, mc_err *err);

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
    double weight_bytes; /* Linear weights streamed: cond_embed once, each evaluation's layers once */
    int graph; /* 1 when the diffusion steps after the first ran as one recorded graph */
    int diffusion_steps; /* of the respacing used (the policy's or the run's) */
} mc_head_stats;

/* One AR step's head sampling, with the policy's head plan. */
typedef struct mc_mar_head_call {
    const float *z;            /* backend [n or 2n, Dd] */
    int64_t n;
    int cfg_on;
    float cfg;
    double temperature;
    uint64_t seed;
    const uint32_t *images, *positions; /* host [n] */
    float *x_out;              /* host [n, C] or NULL */
    mc_mar_head_plan plan;     /* zero: the plain head */
} mc_mar_head_call;

mc_status mc_mar_head_sample_ex(mc_mar *mar, const mc_diffusion *diffusion, const mc_mar_head_call *call,
                                mc_head_stats *stats, mc_err *err);

#endif

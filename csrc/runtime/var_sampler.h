/* The VAR scale loop (var_fastvar.md A4) as a user of the generation driver
 * (driver.h): one driver step per scale. Per scale: the scale's input ->
 * the policy's transformer -> logits of every row -> guidance t = cfg * si /
 * (n_scales - 1) (none at a scale the policy runs unguided) -> sample_tokens (Philox keyed by image index and token
 * position) -> codebook rows (or, with more_smooth, Gumbel probabilities times
 * the codebook) -> f_hat += Phi(bicubic(h)) -> the next scale's input (area
 * resize of f_hat). Randomness is keyed by (image, position), so an image is
 * the same in any batch and on any backend. */
#ifndef MC_VAR_SAMPLER_H
#define MC_VAR_SAMPLER_H

#include <stdint.h>

#include "../models/var.h"
#include "../models/vqvae.h"
#include "driver.h"
#include "var_policy.h"

/* VAR's tail of the step telemetry (the header is driver.h's). */
typedef struct mc_var_step_tail {
    int scale;             /* si */
    int64_t patch;         /* pn */
    int64_t tokens;        /* tokens per image sampled at this scale (0 when skipped) */
    int skipped;           /* the policy skipped the scale (a trailing one) */
    int64_t sequences;     /* sequences through the transformer: B' (B at an unguided scale) */
    int64_t kv_rows;       /* K/V rows per sequence after the scale */
    int64_t sublayer_rows; /* rows run, summed over sublayers, blocks and sequences */
    int64_t depth;         /* blocks (entries of block_rows) */
    const int64_t *block_rows; /* [depth][2] rows per sequence of each block's attention and FFN
                                  (the policy's, valid during the step's telemetry); NULL: `tokens`
                                  for every one (0 when skipped) */
    double guidance;       /* t of the guided logits (1 + t) c - t u; 0 without CFG or unguided */
} mc_var_step_tail;

typedef struct mc_var_generate_args {
    const int32_t *labels; /* [n_images], 0..num_classes-1, or -1 for the null class */
    int64_t n_images;
    double cfg;            /* 0: the conditional rows alone (their logits are the guided ones) */
    int64_t top_k;         /* <= 0 or >= vocab: no top-k filter */
    double top_p;          /* <= 0 or >= 1: no top-p filter */
    int more_smooth;       /* Gumbel-softmax codebook mixtures (A6, visualisation only) */
    uint64_t seed;
    uint32_t first_index;  /* Philox image index of image 0 */
    const mc_var_policy_ops *policy; /* NULL: NoCache */
    const void *policy_config;
} mc_var_generate_args;

/* VAR generation as a user of the driver. */
typedef struct mc_var_run mc_var_run;
extern const mc_generator_ops mc_var_generator;

/* A run of `var` with the VQ update of `vq`, which lives on its own backend
 * (the VQVAE's; it may be var's backend): unless the two share memory (one
 * backend, or two CPU backends), each scale's token embeddings and the next
 * scale's input move through the host.
 * Outputs (host): tokens_out int32 [n_images, L] (-1 at the tokens of
 * skipped scales) and f_hat_out float32 [n_images, side, side, Cvae].
 * Run it with mc_generate(&mc_var_generator, run, var->backend, ...), then
 * free it. */
mc_status mc_var_run_new(mc_var *var, mc_vqvae *vq, mc_backend *vq_backend, const mc_var_generate_args *args,
                         int32_t *tokens_out, float *f_hat_out, mc_var_run **out, mc_err *err);
void mc_var_run_free(mc_var_run *run);

/* The whole generation in one call (C callers and tests). */
mc_status mc_var_generate(mc_var *var, mc_vqvae *vq, mc_backend *vq_backend, const mc_var_generate_args *args,
                          int32_t *tokens_out, float *f_hat_out, const mc_driver_host *host, mc_err *err);

#endif

/* The LDM-style convolutional decoder that MAR's KL-16 VAE (vae.c, mar.md
 * 8) and VAR's VQVAE (vqvae.c, var_fastvar.md B4) share: post_quant_conv,
 * conv_in, mid (ResnetBlock, AttnBlock, ResnetBlock), up levels from the last
 * to level 0 (num_res_blocks + 1 ResnetBlocks each, nearest x2 + 3x3 conv
 * except at level 0), GroupNorm + swish, conv_out. The two differ only in
 * what a layout says:
 *
 *   KL-16: post_quant_conv 1x1; AttnBlocks with q, k, v 1x1 convs; attention
 *          in the mid block only.
 *   VQVAE: post_quant_conv 3x3; AttnBlocks with one fused qkv 1x1 conv
 *          (channels q [0, c), k [c, 2c), v [2c, 3c)); an AttnBlock also after
 *          every ResnetBlock of the top level (decoder.up.<n-1>.attn.<b>).
 *
 * The hyper-parameters (z_channels, ch, ch_mult, num_res_blocks) are read
 * back from tensor shapes, so smaller test configurations load too. All
 * activations are NHWC float32 in backend memory; a decoder decodes one
 * image at a time through three buffers it owns, grown to the largest
 * latent side seen and reused, so one decoder must not run on two threads
 * at once.
 *
 * A model loads it with an mc_ldm_binder (a loader that also counts the
 * parameters it binds and remembers their names, so the model can refuse
 * tensors nobody bound), which the model uses for its own tensors too. */
#ifndef MC_LDM_DECODER_H
#define MC_LDM_DECODER_H

#include <stdint.h>

#include "../backend/ops.h"
#include "../core/mc_core.h"
#include "../io/bind.h"
#include "../io/safetensors.h"

/* Up levels supported (both official models have 5). */
#define MC_LDM_MAX_LEVELS 8
/* Longest tensor name the binder handles. */
#define MC_LDM_NAME_LEN 128

/* ---- binding ---------------------------------------------------------------- */

typedef struct mc_ldm_binder {
    mc_loader loader;
    mc_err *err;
    const char *model; /* "VAE", "VQVAE": prefix of the binder's own messages */
    int64_t num_params;
    char (*bound)[MC_LDM_NAME_LEN];
    int64_t n_bound, cap_bound;
} mc_ldm_binder;

void mc_ldm_binder_init(mc_ldm_binder *bd, const mc_st_file *file, mc_backend *be,
                        const char *model, mc_err *err);
/* Frees the name list and the loader (with every upload the caller has not
 * taken with mc_loader_take_allocations(&bd->loader)). */
void mc_ldm_binder_finish(mc_ldm_binder *bd);

/* Binds the tensor named by fmt with exactly `ndim` dims `shape` (mc_bind's
 * checks and messages); 4-D tensors are conv weights, repacked to
 * [O, kh, kw, I]. Counts its elements and remembers its name. */
mc_status mc_ldm_bind(mc_ldm_binder *bd, float **out, int ndim, const int64_t *shape,
                      const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 5, 6)))
#endif
    ;

/* A conv weight [cout, cin, k, k] and its bias [cout] at prefix.weight / .bias. */
mc_status mc_ldm_bind_conv(mc_ldm_binder *bd, float **w, float **b, int64_t cout, int64_t cin,
                           int64_t k, const char *prefix);

/* Whether `name` has been bound. */
int mc_ldm_was_bound(const mc_ldm_binder *bd, const char *name);

/* ---- the decoder ---------------------------------------------------------------- */

typedef struct mc_ldm_layout {
    const char *model;        /* "VAE", "VQVAE": messages ("<model> decoding was interrupted") */
    const char *description;  /* "KL-16", "VQVAE": which decoder, for the unexpected-tensor check */
    int post_quant_ksize;     /* 1 (KL-16) or 3 (VQVAE) */
    int fused_qkv;            /* AttnBlocks have one qkv conv (VQVAE) or q, k, v convs (KL-16) */
    int top_attention;        /* an AttnBlock after every ResnetBlock of the top up level */
} mc_ldm_layout;

typedef struct mc_ldm_resblock {
    int64_t cin, cout;
    float *norm1_w, *norm1_b, *conv1_w, *conv1_b;
    float *norm2_w, *norm2_b, *conv2_w, *conv2_b;
    float *nin_w, *nin_b; /* 1x1 shortcut, only when cin != cout */
} mc_ldm_resblock;

typedef struct mc_ldm_attn {
    int64_t channels;
    float *norm_w, *norm_b;
    float *qkv_w, *qkv_b;                          /* fused layout: [3c, c] */
    float *q_w, *q_b, *k_w, *k_b, *v_w, *v_b;      /* separate layout */
    float *proj_w, *proj_b;
} mc_ldm_attn;

typedef struct mc_ldm_level {
    int64_t channels;            /* ch * ch_mult[level]: output of every block */
    mc_ldm_resblock *blocks;     /* num_res_blocks + 1 */
    mc_ldm_attn *attns;          /* num_res_blocks + 1 on the top level with top_attention, else NULL */
    float *upsample_w, *upsample_b; /* NULL at level 0 */
} mc_ldm_level;

typedef struct mc_ldm_decoder {
    mc_ldm_layout layout;
    int64_t z_channels;
    int64_t ch;
    int num_levels;
    int64_t ch_mult[MC_LDM_MAX_LEVELS];
    int64_t num_res_blocks;  /* each up level has this + 1 ResnetBlocks */
    int64_t out_channels;    /* 3 */
    int64_t upscale;         /* 2^(num_levels - 1) */

    float *post_quant_w, *post_quant_b;
    float *conv_in_w, *conv_in_b;
    mc_ldm_resblock mid_block_1, mid_block_2;
    mc_ldm_attn mid_attn;
    mc_ldm_level levels[MC_LDM_MAX_LEVELS];
    float *norm_out_w, *norm_out_b;
    float *conv_out_w, *conv_out_b;

    /* Activation buffers in backend memory, each `buffer_floats` long,
     * sized for the largest latent side seen so far and reused. */
    float *buffers[3];
    size_t buffer_floats;
} mc_ldm_decoder;

/* Reads the configuration from the shapes of post_quant_conv.* and
 * decoder.* in the binder's file (missing key -> MC_ERR_KEY, wrong rank or
 * output channels -> MC_ERR_VALUE, naming the file and the key), then
 * binds every tensor of that configuration. `dec` starts zeroed; on failure
 * it holds what was made (free it with mc_ldm_decoder_release). */
mc_status mc_ldm_decoder_load(mc_ldm_decoder *dec, const mc_ldm_layout *layout,
                              mc_ldm_binder *bd);

/* Every post_quant_conv.* / decoder.* tensor of the file must have been
 * bound: an extra one means a different architecture that would otherwise
 * decode wrongly (MC_ERR_VALUE naming it). */
mc_status mc_ldm_decoder_check_unused(const mc_ldm_decoder *dec, const mc_st_file *file,
                                      const mc_ldm_binder *bd);

/* Frees the activation buffers and block tables (the weights belong to the
 * model's allocation list). */
void mc_ldm_decoder_release(mc_ldm_decoder *dec, mc_backend *be);

/* Grows the buffers for latent side `side` (the caller checked that side *
 * upscale is sane). */
mc_status mc_ldm_decoder_reserve(mc_ldm_decoder *dec, mc_backend *be, int64_t side, mc_err *err);

/* A buffer of at least side * side * z_channels floats that the caller may
 * fill with the latent before mc_ldm_decoder_run reads it from there
 * (valid after mc_ldm_decoder_reserve). */
float *mc_ldm_decoder_input_buffer(mc_ldm_decoder *dec);

/* Decodes one image: latent [side, side, z_channels] NHWC in backend memory
 * (before post_quant_conv; it may be mc_ldm_decoder_input_buffer) ->
 * out_host [side * upscale, side * upscale, out_channels], host, unclamped.
 * `cancel`, when non-NULL, is polled between stages; a non-zero answer
 * stops with MC_ERR_INTERRUPTED. Needs mc_ldm_decoder_reserve(side). */
mc_status mc_ldm_decoder_run(mc_ldm_decoder *dec, mc_backend *be, const float *latent,
                             int64_t side, float *out_host, int (*cancel)(void *ctx),
                             void *cancel_ctx, mc_err *err);

#endif

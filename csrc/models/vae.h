/* The KL-16 VAE decoder of MAR (mar.md section 8): post_quant_conv + the
 * LDM-style Decoder without up-path attention. Weights come from a
 * safetensors file in the official key layout (mar.md Appendix B); the
 * hyper-parameters are read back from tensor shapes, so smaller test
 * configurations (other ch, ch_mult, num_res_blocks, z_channels) load too.
 *
 * All activations are NHWC float32 in backend memory. Decoding runs one
 * image at a time through buffers kept in the struct and reused across
 * calls, so one mc_vae must not decode from two threads at once. */
#ifndef MC_VAE_H
#define MC_VAE_H

#include <stdint.h>

#include "../backend/ops.h"
#include "../core/mc_core.h"
#include "../io/safetensors.h"

/* Up levels supported (the official model has 5). */
#define MC_VAE_MAX_LEVELS 8

/* Tokens live in the scaled latent space; the decoder sees tokens / this. */
#define MC_VAE_LATENT_SCALE 0.2325f

typedef struct mc_vae mc_vae;

typedef struct mc_vae_info {
    int64_t z_channels;      /* latent channels = token width (16) */
    int64_t ch;              /* base channel count (128) */
    int num_levels;          /* len(ch_mult) (5) */
    int64_t ch_mult[MC_VAE_MAX_LEVELS];
    int64_t num_res_blocks;  /* the Decoder argument: each up level has this + 1 blocks (2) */
    int64_t out_channels;    /* 3 */
    int64_t upscale;         /* output side / latent side = 2^(num_levels - 1) (16) */
    int64_t num_params;      /* elements of every bound tensor (38,189,203) */
    size_t weight_bytes;     /* backend memory the bound weights hold */
} mc_vae_info;

/* Binds post_quant_conv.* and decoder.* from `file` onto `be` (which must
 * outlive the VAE). Missing tensor -> MC_ERR_KEY; wrong shape, an LDM
 * kl-f16 file (up-path attention), a file that is no VAE decoder at all, or
 * unexpected decoder tensors -> MC_ERR_VALUE. */
mc_status mc_vae_load(mc_backend *be, const mc_st_file *file, mc_vae **out, mc_err *err);
void mc_vae_free(mc_vae *vae);
void mc_vae_get_info(const mc_vae *vae, mc_vae_info *info);

/* Decodes tokens [n_images, seq_len, channels] (host, scaled latent space,
 * row-major token index h * side + w with side = sqrt(seq_len)) into
 * out_nhwc_host [n_images, side * upscale, side * upscale, 3] (host float,
 * nominally in [-1, 1], not clamped). `cancel`, when non-NULL, is polled
 * between stages; a non-zero answer stops with MC_ERR_INTERRUPTED. */
mc_status mc_vae_decode(mc_vae *vae, const float *tokens_host, int64_t n_images, int64_t seq_len,
                        int64_t channels, float *out_nhwc_host, int (*cancel)(void *ctx),
                        void *cancel_ctx, mc_err *err);

/* out[i] = round_half_even(clip((x[i] + 1) / 2 * 255, 0, 255)) as
 * engine_mar.evaluate does (mar.md 8.4), computed in double. NaN maps to 0
 * and makes the call return MC_ERR_NUMERIC (after converting everything). */
mc_status mc_vae_to_uint8(const float *x, int64_t count, uint8_t *out);

#endif

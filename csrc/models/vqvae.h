/* VAR's multi-scale VQVAE, decode side (var_fastvar.md Part B, A4 step 6):
 * the codebook, the Phi convs that refine each scale's token map, the
 * multi-scale f_hat accumulation and the next scale's input, and the decoder
 * (the LDM decoder shared with the KL-16 VAE, ldm_decoder.h, with attention
 * on the top level and fused qkv convs).
 *
 * Weights come from a safetensors file in the official key layout (B5:
 * quantize.embedding.weight, quantize.quant_resi.qresi_ls.{k}.*,
 * post_quant_conv.* 3x3, decoder.*; encoder.*, quant_conv.* and
 * quantize.ema_vocab_hit_SV are ignored). vocab, z_channels, ch, ch_mult,
 * num_res_blocks and the number of Phi convs are read back from the shapes
 * and keys, so small test models and the digits VQVAE load like the official
 * vae_ch160v4096z32. quant_resi is 0.5 (B1), or the file's metadata value.
 *
 * Layouts: token maps and f_hat are NHWC float32 in backend memory, raster
 * order (a scale's tokens [B, pn * pn, z] are [B, pn, pn, z]). One mc_vqvae
 * owns workspace buffers (grow-only), so it must not run on two threads at
 * once. */
#ifndef MC_VQVAE_H
#define MC_VQVAE_H

#include <stdint.h>

#include "../backend/ops.h"
#include "../core/mc_core.h"
#include "../io/safetensors.h"

typedef struct mc_vqvae mc_vqvae;

typedef struct mc_vqvae_info {
    int64_t vocab, z_channels, ch, num_levels, ch_mult[8], num_res_blocks, num_phi, upscale;
    double quant_resi;   /* 0.5 */
    int64_t num_params;  /* elements of every bound tensor: codebook, Phi, post_quant_conv, decoder */
} mc_vqvae_info;

/* Binds the decoding tensors of `file` onto `be` (which must outlive the
 * VQVAE). A file of another kind (a VAR or MAR model, MAR's KL-16 VAE) or
 * without the codebook -> MC_ERR_VALUE saying what the file is; missing
 * tensor -> MC_ERR_KEY; wrong shape (a codebook whose width is not the
 * decoder's z_channels among them) or unexpected decoder / quantizer
 * tensors -> MC_ERR_VALUE; every message names the file and the key. */
mc_status mc_vqvae_load(mc_backend *be, const mc_st_file *file, mc_vqvae **out, mc_err *err);
void mc_vqvae_free(mc_vqvae *vq);
void mc_vqvae_get_info(const mc_vqvae *vq, mc_vqvae_info *info);
const float *mc_vqvae_codebook(const mc_vqvae *vq);            /* backend [vocab, z] */

/* The Phi conv of scale si of n_scales (B3): argmin_k |ticks_k - si / (n - 1)|
 * (first minimum; si / (n - 1) = 0 when n = 1) with ticks = linspace(1/(3K),
 * 1 - 1/(3K), K) for K = 4 Phi convs and linspace(1/(2K), 1 - 1/(2K), K)
 * otherwise, in double as numpy computes it (VAR's quant.py); for 10 scales
 * and K = 4 this is 0,0,1,1,1,2,2,3,3,3. -1 when si is outside [0, n). */
int mc_vqvae_phi_index(const mc_vqvae *vq, int si, int n_scales);

/* f_hat [B, side, side, z] += Phi_k(bicubic(h [B, pn, pn, z] -> side x side)) (no resize when
 * pn == side); all backend memory; uses the model's workspace. */
mc_status mc_vqvae_add_scale(mc_vqvae *vq, float *f_hat, int64_t n_images, int64_t side, const float *h,
                             int64_t pn, int phi_index, mc_err *err);

/* next [B, pn, pn, z] = area resize of f_hat [B, side, side, z]. */
mc_status mc_vqvae_area_input(mc_vqvae *vq, const float *f_hat, int64_t n_images, int64_t side, int64_t pn,
                              float *next, mc_err *err);

/* Decoder: f_hat (backend) -> host float NHWC [B, side*upscale, side*upscale, 3], clamped to [-1, 1];
 * cancel polled between stages as in mc_vae_decode. */
mc_status mc_vqvae_decode(mc_vqvae *vq, const float *f_hat, int64_t n_images, int64_t side,
                          float *out_nhwc_host, int (*cancel)(void *), void *cancel_ctx, mc_err *err);

#endif

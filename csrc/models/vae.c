/* KL-16 VAE decoder (mar.md 8.2) on the backend op table: the shared LDM
 * decoder (ldm_decoder.c) with MAR's layout (post_quant_conv 1x1, q/k/v
 * attention in the mid block only), fed with tokens / 0.2325 (the token
 * layout already is NHWC: latent[h, w, c] = tokens[h * side + w, c]). */
#include "vae.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ldm_decoder.h"

/* Largest output side accepted (keeps every size computation far from
 * int64 overflow; a 16384^2 image is already ~100 GB of activations). */
#define VAE_MAX_OUTPUT_SIDE 16384

_Static_assert(MC_VAE_MAX_LEVELS == MC_LDM_MAX_LEVELS, "mc_vae_info.ch_mult holds every level");

/* MAR's KL-16 decoder in the shared LDM decoder's terms. */
static const mc_ldm_layout kl16_layout = {
    .model = "VAE",
    .description = "KL-16",
    .post_quant_ksize = 1,
    .fused_qkv = 0,
    .top_attention = 0,
};

struct mc_vae {
    mc_backend *be;
    mc_vae_info info;
    mc_alloc_list weights;
    mc_ldm_decoder dec;
    float *host_latent; /* one image's scaled latent, host */
    size_t host_latent_floats;
};

/* ------------------------------------------------------------------ loading */

static int starts_with(const char *s, const char *prefix) {
    return strncmp(s, prefix, strlen(prefix)) == 0;
}

/* Refuses files that are not MAR's KL-16 decoder before binding anything,
 * so the message says what the file is rather than which key is missing. */
static mc_status check_file_kind(const mc_st_file *file, const mc_ldm_binder *bd) {
    const char *path = file->path != NULL ? file->path : "<memory>";
    if (!mc_loader_has(&bd->loader, "decoder.conv_in.weight"))
        return mc_fail(bd->err, MC_ERR_VALUE,
                       "%s is not a KL-16 VAE decoder checkpoint: it has no tensor "
                       "'decoder.conv_in.weight' (a MAR or VAR model file, or a VAE file "
                       "without the decoder?)",
                       path);
    if (mc_loader_has(&bd->loader, "quantize.embedding.weight"))
        return mc_fail(bd->err, MC_ERR_VALUE,
                       "%s is VAR's multi-scale VQVAE (it has 'quantize.embedding.weight'), not "
                       "MAR's KL-16 VAE: load it as a VQVAE (marcache._C.VQVAE)",
                       path);
    for (int64_t i = 0; i < file->n_tensors; i++) {
        const char *name = file->tensors[i].name;
        if (starts_with(name, "decoder.up.") && strstr(name, ".attn.") != NULL)
            return mc_fail(bd->err, MC_ERR_VALUE,
                           "%s has up-path attention ('%s'): this is an LDM kl-f16-style "
                           "decoder, not MAR's KL-16 VAE, whose decoder has attention only in "
                           "the mid block (mar.md 8.1); the two are not interchangeable",
                           path, name);
    }
    return MC_OK;
}

static void fill_info(mc_vae_info *info, const mc_ldm_decoder *dec) {
    info->z_channels = dec->z_channels;
    info->ch = dec->ch;
    info->num_levels = dec->num_levels;
    for (int level = 0; level < dec->num_levels; level++)
        info->ch_mult[level] = dec->ch_mult[level];
    info->num_res_blocks = dec->num_res_blocks;
    info->out_channels = dec->out_channels;
    info->upscale = dec->upscale;
}

mc_status mc_vae_load(mc_backend *be, const mc_st_file *file, mc_vae **out, mc_err *err) {
    *out = NULL;
    mc_vae *v = calloc(1, sizeof *v);
    if (v == NULL)
        return mc_fail_nomem(err, sizeof *v, "the VAE model struct");
    v->be = be;

    mc_ldm_binder bd;
    mc_ldm_binder_init(&bd, file, be, "VAE", err);
    mc_status st = check_file_kind(file, &bd);
    if (st == MC_OK)
        st = mc_ldm_decoder_load(&v->dec, &kl16_layout, &bd);
    if (st == MC_OK)
        st = mc_ldm_decoder_check_unused(&v->dec, file, &bd);
    if (st == MC_OK) {
        fill_info(&v->info, &v->dec);
        v->info.num_params = bd.num_params;
        v->weights = mc_loader_take_allocations(&bd.loader);
        v->info.weight_bytes = v->weights.bytes;
    }
    mc_ldm_binder_finish(&bd);
    if (st != MC_OK) {
        mc_vae_free(v); /* weights were never taken: the loader freed them */
        return st;
    }
    *out = v;
    return MC_OK;
}

void mc_vae_free(mc_vae *vae) {
    if (vae == NULL)
        return;
    mc_ldm_decoder_release(&vae->dec, vae->be);
    mc_alloc_list_free(&vae->weights, vae->be);
    free(vae->host_latent);
    free(vae);
}

void mc_vae_get_info(const mc_vae *vae, mc_vae_info *info) { *info = vae->info; }

/* ------------------------------------------------------------------ decoding */

static mc_status ensure_host_latent(mc_vae *v, int64_t side, mc_err *err) {
    size_t latent = (size_t)(side * side * v->info.z_channels);
    if (v->host_latent_floats >= latent)
        return MC_OK;
    float *fresh = malloc(latent * sizeof(float));
    if (fresh == NULL)
        return mc_fail_nomem_n(err, latent, sizeof(float), "the VAE's latent staging buffer");
    free(v->host_latent);
    v->host_latent = fresh;
    v->host_latent_floats = latent;
    return MC_OK;
}

#define VAE_CHECK_CANCEL()                                                          \
    do {                                                                            \
        if (cancel != NULL && cancel(cancel_ctx))                                   \
            return mc_fail(err, MC_ERR_INTERRUPTED, "VAE decoding was interrupted"); \
    } while (0)

mc_status mc_vae_decode(mc_vae *vae, const float *tokens_host, int64_t n_images, int64_t seq_len,
                        int64_t channels, float *out_nhwc_host, int (*cancel)(void *ctx),
                        void *cancel_ctx, mc_err *err) {
    const mc_vae_info *info = &vae->info;
    if (n_images < 0)
        return mc_fail(err, MC_ERR_VALUE, "VAE decode: negative image count %lld",
                       (long long)n_images);
    if (channels != info->z_channels)
        return mc_fail(err, MC_ERR_VALUE, "VAE decode: tokens have %lld channels, expected %lld",
                       (long long)channels, (long long)info->z_channels);
    int64_t side = (int64_t)llround(sqrt((double)seq_len));
    if (seq_len <= 0 || side * side != seq_len)
        return mc_fail(err, MC_ERR_VALUE,
                       "VAE decode: sequence length %lld is not a positive perfect square",
                       (long long)seq_len);
    if (side > VAE_MAX_OUTPUT_SIDE / info->upscale)
        return mc_fail(err, MC_ERR_VALUE,
                       "VAE decode: latent side %lld gives images larger than %d pixels a side",
                       (long long)side, VAE_MAX_OUTPUT_SIDE);
    if (n_images == 0)
        return MC_OK;
    MC_TRY(ensure_host_latent(vae, side, err));
    MC_TRY(mc_ldm_decoder_reserve(&vae->dec, vae->be, side, err));

    const int64_t token_floats = seq_len * channels;
    const int64_t out_side = side * info->upscale;
    const int64_t image_floats = out_side * out_side * info->out_channels;
    float *latent = mc_ldm_decoder_input_buffer(&vae->dec);
    for (int64_t i = 0; i < n_images; i++) {
        VAE_CHECK_CANCEL();
        /* unpatchify (p = 1) is the identity in NHWC: only the scale remains.
         * A division, not a multiply by the reciprocal, as the reference does. */
        const float *tok = tokens_host + i * token_floats;
        for (int64_t j = 0; j < token_floats; j++)
            vae->host_latent[j] = tok[j] / MC_VAE_LATENT_SCALE;
        MC_TRY(vae->be->ops->upload(vae->be, latent, vae->host_latent,
                                    (size_t)token_floats * sizeof(float), err));
        MC_TRY(mc_ldm_decoder_run(&vae->dec, vae->be, latent, side, out_nhwc_host + i * image_floats,
                                  cancel, cancel_ctx, err));
    }
    return MC_OK;
}

mc_status mc_vae_to_uint8(const float *x, int64_t count, uint8_t *out) {
    if (count < 0)
        return MC_ERR_VALUE;
    int saw_nan = 0;
    for (int64_t i = 0; i < count; i++) {
        /* In double: every float32 input is exact there, so values that
         * land within float32 rounding of a .5 boundary round the same way
         * as the float64 reference (the original does this in float16, so
         * neither width is "the" reference; double is the reproducible one). */
        double scaled = ((double)x[i] + 1.0) / 2.0 * 255.0;
        if (scaled != scaled) {
            saw_nan = 1;
            out[i] = 0;
            continue;
        }
        scaled = scaled < 0.0 ? 0.0 : (scaled > 255.0 ? 255.0 : scaled);
        out[i] = (uint8_t)nearbyint(scaled); /* default rounding: half to even, like np.round */
    }
    return saw_nan ? MC_ERR_NUMERIC : MC_OK;
}

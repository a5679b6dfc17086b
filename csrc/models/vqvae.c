/* VAR's multi-scale VQVAE, decode side (vqvae.h; var_fastvar.md B2-B5,
 * A4 step 6) on the backend op table.
 *
 * One scale's update (add_scale), all NHWC in backend memory:
 *   h [B, pn, pn, z] --resize_bicubic--> up [B, side, side, z] (skipped when
 *   pn == side) --conv2d 3x3 (Phi_k)--> c; c = (1 - r) up + r c (axpby);
 *   f_hat += c (axpby). The same roundings as the official
 *   h.mul(1 - r) + conv(h).mul_(r) and f_hat.add_(...).
 * The next scale's input (area_input) is one resize_area of f_hat. The
 * decoder is the LDM decoder shared with the KL-16 VAE (ldm_decoder.c). */
#include "vqvae.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ldm_decoder.h"

/* Largest output side accepted, as the KL-16 VAE. */
#define VQVAE_MAX_OUTPUT_SIDE 16384
/* Phi convs supported (the official model has 4). */
#define VQVAE_MAX_PHI 64
/* B1: Phi(x) = (1 - 0.5) x + 0.5 conv(x) unless the file's metadata says otherwise. */
#define VQVAE_QUANT_RESI 0.5

_Static_assert(sizeof(((mc_vqvae_info *)0)->ch_mult) / sizeof(int64_t) == MC_LDM_MAX_LEVELS,
               "mc_vqvae_info.ch_mult holds every decoder level");

/* VAR's VQVAE decoder in the shared LDM decoder's terms (B4). */
static const mc_ldm_layout vqvae_layout = {
    .model = "VQVAE",
    .description = "VQVAE",
    .post_quant_ksize = 3,
    .fused_qkv = 1,
    .top_attention = 1,
};

struct mc_vqvae {
    mc_backend *be;
    mc_vqvae_info info;
    mc_alloc_list weights;
    mc_ldm_decoder dec;
    float *codebook;                  /* [vocab, z] */
    float *phi_w[VQVAE_MAX_PHI];      /* packed [z, 3, 3, z] */
    float *phi_b[VQVAE_MAX_PHI];      /* [z] */

    /* add_scale's named activations (grow-only): a scale's bicubic-upsampled
     * map and its Phi output [B, side, side, z]. */
    mc_buffer up, phi;
};

/* ------------------------------------------------------------------ loading */

static const char *path_of(const mc_st_file *file) {
    return file->path != NULL ? file->path : "<memory>";
}

static int has(const mc_ldm_binder *bd, const char *name) { return mc_loader_has(&bd->loader, name); }

static int starts_with(const char *s, const char *prefix) {
    return strncmp(s, prefix, strlen(prefix)) == 0;
}

/* Refuses files of another kind before binding anything, so the message
 * says what the file is rather than which key is missing. */
static mc_status check_file_kind(const mc_st_file *file, const mc_ldm_binder *bd) {
    const char *path = path_of(file);
    const char *kind = mc_st_metadata(file, "kind");
    if (kind != NULL && strcmp(kind, "vqvae") != 0)
        return mc_fail(bd->err, MC_ERR_VALUE,
                       "%s is a '%s' file (its metadata 'kind'), not VAR's VQVAE (kind 'vqvae')",
                       path, kind);
    if (has(bd, "quantize.embedding.weight"))
        return MC_OK;
    if (has(bd, "class_emb.weight") || has(bd, "lvl_embed.weight") || has(bd, "pos_1LC"))
        return mc_fail(bd->err, MC_ERR_VALUE,
                       "%s is a VAR transformer file, not VAR's VQVAE: it has 'class_emb.weight' / "
                       "'lvl_embed.weight' and no codebook 'quantize.embedding.weight' (pass it as "
                       "the VAR model, and vae_ch160v4096z32 converted with 'convert vqvae' as the "
                       "VQVAE)",
                       path);
    if (has(bd, "z_proj.weight") || has(bd, "diffloss.net.input_proj.weight") ||
        has(bd, "encoder_blocks.0.norm1.weight"))
        return mc_fail(bd->err, MC_ERR_VALUE,
                       "%s is a MAR model file, not VAR's VQVAE: it has no codebook "
                       "'quantize.embedding.weight'",
                       path);
    if (has(bd, "decoder.conv_in.weight"))
        return mc_fail(bd->err, MC_ERR_VALUE,
                       "%s is a VAE decoder without a codebook (MAR's KL-16 VAE?), not VAR's "
                       "VQVAE: it has no tensor 'quantize.embedding.weight'",
                       path);
    return mc_fail(bd->err, MC_ERR_VALUE,
                   "%s is not a VQVAE checkpoint: it has no codebook tensor "
                   "'quantize.embedding.weight'",
                   path);
}

/* quantize.embedding.weight [vocab, z]: its width must be the decoder's latent width. */
static mc_status bind_codebook(mc_vqvae *vq, mc_ldm_binder *bd, const mc_st_file *file) {
    int ndim;
    int64_t shape[8];
    MC_TRY(mc_loader_shape(&bd->loader, "quantize.embedding.weight", &ndim, shape));
    const int64_t z = vq->dec.z_channels;
    if (ndim != 2 || shape[0] <= 0 || shape[0] > INT32_MAX)
        return mc_fail(bd->err, MC_ERR_VALUE,
                       "%s: 'quantize.embedding.weight' must be the codebook [vocab, %lld] with "
                       "0 < vocab < 2^31 (got rank %d, first dimension %lld)",
                       path_of(file), (long long)z, ndim, ndim >= 1 ? (long long)shape[0] : 0LL);
    if (shape[1] != z)
        return mc_fail(bd->err, MC_ERR_VALUE,
                       "%s: codebook 'quantize.embedding.weight' has shape [%lld, %lld], but the "
                       "decoder's latent has %lld channels ('post_quant_conv.weight' is [%lld, "
                       "%lld, 3, 3]): expected [%lld, %lld]",
                       path_of(file), (long long)shape[0], (long long)shape[1], (long long)z,
                       (long long)z, (long long)z, (long long)shape[0], (long long)z);
    vq->info.vocab = shape[0];
    return mc_ldm_bind(bd, &vq->codebook, 2, (int64_t[]){shape[0], z}, "%s",
                       "quantize.embedding.weight");
}

/* quantize.quant_resi.qresi_ls.{0..K-1} (PhiPartiallyShared), K >= 1. */
static mc_status bind_phi(mc_vqvae *vq, mc_ldm_binder *bd, const mc_st_file *file) {
    const int64_t z = vq->dec.z_channels;
    int count = 0;
    char name[MC_LDM_NAME_LEN];
    for (;;) {
        snprintf(name, sizeof name, "quantize.quant_resi.qresi_ls.%d.weight", count);
        if (!has(bd, name))
            break;
        if (count == VQVAE_MAX_PHI)
            return mc_fail(bd->err, MC_ERR_VALUE, "%s: more than %d Phi convs are not supported",
                           path_of(file), VQVAE_MAX_PHI);
        count++;
    }
    if (count == 0)
        return mc_fail(bd->err, MC_ERR_KEY,
                       "%s: missing tensor 'quantize.quant_resi.qresi_ls.0.weight' (the Phi convs "
                       "of the residual path, var_fastvar.md B3: shape [%lld, %lld, 3, 3])",
                       path_of(file), (long long)z, (long long)z);
    for (int k = 0; k < count; k++) {
        snprintf(name, sizeof name, "quantize.quant_resi.qresi_ls.%d", k);
        MC_TRY(mc_ldm_bind_conv(bd, &vq->phi_w[k], &vq->phi_b[k], z, z, 3, name));
    }
    vq->info.num_phi = count;
    return MC_OK;
}

/* Metadata 'quant_resi' (written by marcache convert), or 0.5. */
static mc_status read_quant_resi(mc_vqvae *vq, const mc_st_file *file, mc_err *err) {
    vq->info.quant_resi = VQVAE_QUANT_RESI;
    const char *text = mc_st_metadata(file, "quant_resi");
    if (text == NULL)
        return MC_OK;
    char *end = NULL;
    errno = 0;
    double value = strtod(text, &end);
    if (end == text || *end != '\0' || errno == ERANGE || !(value > 0.0 && value <= 1.0))
        return mc_fail(err, MC_ERR_VALUE,
                       "%s: metadata 'quant_resi' = '%s' is not a number in (0, 1] (the Phi mix "
                       "(1 - r) x + r conv(x), 0.5 in the released VQVAE)",
                       path_of(file), text);
    vq->info.quant_resi = value;
    return MC_OK;
}

/* Every quantize.* tensor but the training statistics must have been bound
 * (a Phi conv outside 0..K-1, another Phi layout, a second codebook): the
 * decoder's own check covers decoder.* and post_quant_conv.*. */
static mc_status check_unused(const mc_vqvae *vq, const mc_st_file *file, const mc_ldm_binder *bd) {
    MC_TRY(mc_ldm_decoder_check_unused(&vq->dec, file, bd));
    for (int64_t i = 0; i < file->n_tensors; i++) {
        const char *name = file->tensors[i].name;
        if (!starts_with(name, "quantize.") || strcmp(name, "quantize.ema_vocab_hit_SV") == 0)
            continue;
        if (!mc_ldm_was_bound(bd, name))
            return mc_fail(bd->err, MC_ERR_VALUE,
                           "%s: unexpected quantizer tensor '%s' (this VQVAE reads the codebook "
                           "'quantize.embedding.weight' and %lld Phi convs "
                           "'quantize.quant_resi.qresi_ls.0..%lld'; another Phi layout or a gap "
                           "in their numbering means a different model)",
                           path_of(file), name, (long long)vq->info.num_phi,
                           (long long)vq->info.num_phi - 1);
    }
    return MC_OK;
}

static void fill_info(mc_vqvae_info *info, const mc_ldm_decoder *dec) {
    info->z_channels = dec->z_channels;
    info->ch = dec->ch;
    info->num_levels = dec->num_levels;
    for (int level = 0; level < dec->num_levels; level++)
        info->ch_mult[level] = dec->ch_mult[level];
    info->num_res_blocks = dec->num_res_blocks;
    info->upscale = dec->upscale;
}

mc_status mc_vqvae_load(mc_backend *be, const mc_st_file *file, mc_vqvae **out, mc_err *err) {
    *out = NULL;
    mc_vqvae *vq = calloc(1, sizeof *vq);
    if (vq == NULL)
        return mc_fail_nomem(err, sizeof *vq, "the VQVAE model struct");
    vq->be = be;

    mc_ldm_binder bd;
    mc_ldm_binder_init(&bd, file, be, "VQVAE", err);
    mc_status st = check_file_kind(file, &bd);
    if (st == MC_OK)
        st = mc_ldm_decoder_load(&vq->dec, &vqvae_layout, &bd);
    if (st == MC_OK)
        st = bind_codebook(vq, &bd, file);
    if (st == MC_OK)
        st = bind_phi(vq, &bd, file);
    if (st == MC_OK)
        st = read_quant_resi(vq, file, err);
    if (st == MC_OK)
        st = check_unused(vq, file, &bd);
    if (st == MC_OK) {
        fill_info(&vq->info, &vq->dec);
        vq->info.num_params = bd.num_params;
        vq->weights = mc_loader_take_allocations(&bd.loader);
    }
    mc_ldm_binder_finish(&bd);
    if (st != MC_OK) {
        mc_vqvae_free(vq); /* weights were never taken: the loader freed them */
        return st;
    }
    *out = vq;
    return MC_OK;
}

void mc_vqvae_free(mc_vqvae *vq) {
    if (vq == NULL)
        return;
    mc_buffer_release(vq->be, &vq->up);
    mc_buffer_release(vq->be, &vq->phi);
    mc_ldm_decoder_release(&vq->dec, vq->be);
    mc_alloc_list_free(&vq->weights, vq->be);
    free(vq);
}

void mc_vqvae_get_info(const mc_vqvae *vq, mc_vqvae_info *info) { *info = vq->info; }

const float *mc_vqvae_codebook(const mc_vqvae *vq) { return vq->codebook; }

/* ------------------------------------------------------------- Phi selection */

int mc_vqvae_phi_index(const mc_vqvae *vq, int si, int n_scales) {
    const int count = (int)vq->info.num_phi;
    if (n_scales < 1 || si < 0 || si >= n_scales)
        return -1;
    /* numpy.linspace(lo, 1 - lo, K): step = (hi - lo) / (K - 1), tick k =
     * k * step + lo, the last tick exactly hi; lo = 1/3/K for K = 4, else
     * 1/2/K, each rounded as Python evaluates it left to right. */
    const double lo = count == 4 ? 1.0 / 3.0 / (double)count : 1.0 / 2.0 / (double)count;
    const double hi = 1.0 - lo;
    const double step = count > 1 ? (hi - lo) / (double)(count - 1) : 0.0;
    const double at = n_scales > 1 ? (double)si / (double)(n_scales - 1) : 0.0;
    int best = 0;
    double best_dist = 0.0;
    for (int k = 0; k < count; k++) {
        const double tick = k == count - 1 && count > 1 ? hi : (double)k * step + lo;
        const double dist = fabs(tick - at);
        if (k == 0 || dist < best_dist) { /* strictly smaller: the first minimum wins */
            best = k;
            best_dist = dist;
        }
    }
    return best;
}

/* ------------------------------------------------------------ scale updates */

static mc_status ensure_workspace(mc_vqvae *vq, size_t floats, mc_err *err) {
    if (mc_buffer_floats(vq->be, &vq->up, floats, "vqvae.up", err) == NULL ||
        mc_buffer_floats(vq->be, &vq->phi, floats, "vqvae.phi", err) == NULL)
        return err->status;
    return MC_OK;
}

/* side and batch within what the ops take (mc_check_resize_f32's bounds and
 * far from int64 overflow); `what` names the call. */
static mc_status check_map(const mc_vqvae *vq, const char *what, int64_t n_images, int64_t side,
                           mc_err *err) {
    if (n_images < 0 || side < 1 || side > VQVAE_MAX_OUTPUT_SIDE / vq->info.upscale)
        return mc_fail(err, MC_ERR_VALUE,
                       "VQVAE %s: bad f_hat size: %lld images of side %lld (side must be in [1, "
                       "%lld])",
                       what, (long long)n_images, (long long)side,
                       (long long)(VQVAE_MAX_OUTPUT_SIDE / vq->info.upscale));
    if (n_images > ((int64_t)1 << 40) / (side * side * vq->info.z_channels))
        return mc_fail(err, MC_ERR_VALUE, "VQVAE %s: %lld images of side %lld are too many", what,
                       (long long)n_images, (long long)side);
    return MC_OK;
}

mc_status mc_vqvae_add_scale(mc_vqvae *vq, float *f_hat, int64_t n_images, int64_t side, const float *h,
                             int64_t pn, int phi_index, mc_err *err) {
    MC_TRY(check_map(vq, "add_scale", n_images, side, err));
    if (pn < 1 || pn > side)
        return mc_fail(err, MC_ERR_VALUE,
                       "VQVAE add_scale: token map side %lld is outside [1, %lld] (f_hat side)",
                       (long long)pn, (long long)side);
    if (phi_index < 0 || phi_index >= vq->info.num_phi)
        return mc_fail(err, MC_ERR_VALUE, "VQVAE add_scale: Phi index %d is outside [0, %lld)",
                       phi_index, (long long)vq->info.num_phi);
    if (n_images == 0)
        return MC_OK;
    mc_backend *be = vq->be;
    const mc_ops *op = be->ops;
    const int64_t z = vq->info.z_channels;
    const int64_t pixels = n_images * side * side;
    MC_TRY(ensure_workspace(vq, (size_t)(pixels * z), err));
    const float *up = h;
    if (pn != side) {
        MC_TRY(op->resize_bicubic(be, h, n_images, pn, pn, z, side, side, (float *)vq->up.data, err));
        up = (float *)vq->up.data;
    }
    const float r = (float)vq->info.quant_resi, keep = (float)(1.0 - vq->info.quant_resi);
    MC_TRY(op->conv2d(be, up, n_images, side, side, z, vq->phi_w[phi_index], vq->phi_b[phi_index], z,
                      3, 0.0f, (float *)vq->phi.data, err));
    MC_TRY(op->axpby(be, keep, up, z, r, (float *)vq->phi.data, z, pixels, z, err));
    return op->axpby(be, 1.0f, (float *)vq->phi.data, z, 1.0f, f_hat, z, pixels, z, err);
}

mc_status mc_vqvae_area_input(mc_vqvae *vq, const float *f_hat, int64_t n_images, int64_t side, int64_t pn,
                              float *next, mc_err *err) {
    MC_TRY(check_map(vq, "area_input", n_images, side, err));
    if (pn < 1 || pn > VQVAE_MAX_OUTPUT_SIDE)
        return mc_fail(err, MC_ERR_VALUE, "VQVAE area_input: token map side %lld is not positive",
                       (long long)pn);
    if (n_images == 0)
        return MC_OK;
    return vq->be->ops->resize_area(vq->be, f_hat, n_images, side, side, vq->info.z_channels, pn,
                                    pn, next, err);
}

/* ------------------------------------------------------------------ decoding */

mc_status mc_vqvae_decode(mc_vqvae *vq, const float *f_hat, int64_t n_images, int64_t side,
                          float *out_nhwc_host, int (*cancel)(void *), void *cancel_ctx, mc_err *err) {
    MC_TRY(check_map(vq, "decode", n_images, side, err));
    if (n_images == 0)
        return MC_OK;
    MC_TRY(mc_ldm_decoder_reserve(&vq->dec, vq->be, side, err));
    const int64_t z = vq->info.z_channels;
    const int64_t out_side = side * vq->info.upscale;
    const int64_t image_floats = out_side * out_side * vq->dec.out_channels;
    for (int64_t i = 0; i < n_images; i++) {
        if (cancel != NULL && cancel(cancel_ctx))
            return mc_fail(err, MC_ERR_INTERRUPTED, "VQVAE decoding was interrupted");
        float *image = out_nhwc_host + i * image_floats;
        MC_TRY(mc_ldm_decoder_run(&vq->dec, vq->be, f_hat + i * side * side * z, side, image, cancel,
                                  cancel_ctx, err));
        /* fhat_to_img's clamp_(-1, 1); NaN stays NaN, as in PyTorch. */
        for (int64_t j = 0; j < image_floats; j++)
            image[j] = image[j] < -1.0f ? -1.0f : (image[j] > 1.0f ? 1.0f : image[j]);
    }
    return MC_OK;
}

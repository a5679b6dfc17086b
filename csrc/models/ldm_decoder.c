/* The LDM-style decoder of the KL-16 VAE and the VQVAE (ldm_decoder.h) on the
 * backend op table.
 *
 * Data flow per image, all NHWC: latent -> post_quant_conv -> conv_in -> mid
 * (ResnetBlock, AttnBlock, ResnetBlock) -> up levels from the last to level
 * 0, each num_res_blocks + 1 ResnetBlocks (on the top level each followed by
 * an AttnBlock when the layout says so) and, except level 0, nearest x2 +
 * 3x3 conv -> GroupNorm + swish -> conv_out. */
#include "ldm_decoder.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LDM_GROUPS 32
#define LDM_EPS 1e-6f

/* ------------------------------------------------------------------ binding */

void mc_ldm_binder_init(mc_ldm_binder *bd, const mc_st_file *file, mc_backend *be,
                        const char *model, mc_err *err) {
    memset(bd, 0, sizeof *bd);
    bd->err = err;
    bd->model = model;
    mc_loader_init(&bd->loader, file, be, err);
}

void mc_ldm_binder_finish(mc_ldm_binder *bd) {
    mc_loader_finish(&bd->loader);
    free(bd->bound);
    bd->bound = NULL;
    bd->n_bound = bd->cap_bound = 0;
}

static mc_status note_bound(mc_ldm_binder *bd, const char *name, int ndim, const int64_t *shape) {
    if (bd->n_bound == bd->cap_bound) {
        int64_t cap = bd->cap_bound ? 2 * bd->cap_bound : 256;
        void *grown = realloc(bd->bound, (size_t)cap * MC_LDM_NAME_LEN);
        if (grown == NULL)
            return mc_fail_nomem_n(bd->err, (size_t)cap, MC_LDM_NAME_LEN, "the %s's list of bound names (%lld names)",
                                   bd->model, (long long)cap);
        bd->bound = grown;
        bd->cap_bound = cap;
    }
    snprintf(bd->bound[bd->n_bound++], MC_LDM_NAME_LEN, "%s", name);
    int64_t numel = 1;
    for (int d = 0; d < ndim; d++)
        numel *= shape[d];
    bd->num_params += numel;
    return MC_OK;
}

mc_status mc_ldm_bind(mc_ldm_binder *bd, float **out, int ndim, const int64_t *shape,
                      const char *fmt, ...) {
    char name[MC_LDM_NAME_LEN];
    va_list ap;
    va_start(ap, fmt);
    int len = vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    if (len < 0 || len >= (int)sizeof name)
        return mc_fail(bd->err, MC_ERR_INTERNAL, "%s: tensor name too long", bd->model);
    mc_bind_layout layout = ndim == 4 ? MC_BIND_CONV_OHWI : MC_BIND_AS_IS;
    MC_TRY(mc_bind(&bd->loader, name, ndim, shape, layout, out));
    return note_bound(bd, name, ndim, shape);
}

mc_status mc_ldm_bind_conv(mc_ldm_binder *bd, float **w, float **b, int64_t cout, int64_t cin,
                           int64_t k, const char *prefix) {
    MC_TRY(mc_ldm_bind(bd, w, 4, (int64_t[]){cout, cin, k, k}, "%s.weight", prefix));
    return mc_ldm_bind(bd, b, 1, (int64_t[]){cout}, "%s.bias", prefix);
}

int mc_ldm_was_bound(const mc_ldm_binder *bd, const char *name) {
    for (int64_t j = 0; j < bd->n_bound; j++)
        if (strcmp(bd->bound[j], name) == 0)
            return 1;
    return 0;
}

static mc_status bind_norm(mc_ldm_binder *bd, float **w, float **b, int64_t channels,
                           const char *prefix) {
    MC_TRY(mc_ldm_bind(bd, w, 1, (int64_t[]){channels}, "%s.weight", prefix));
    return mc_ldm_bind(bd, b, 1, (int64_t[]){channels}, "%s.bias", prefix);
}

static mc_status bind_resblock(mc_ldm_binder *bd, mc_ldm_resblock *blk, int64_t cin, int64_t cout,
                               const char *prefix) {
    char name[MC_LDM_NAME_LEN];
    blk->cin = cin;
    blk->cout = cout;
    snprintf(name, sizeof name, "%s.norm1", prefix);
    MC_TRY(bind_norm(bd, &blk->norm1_w, &blk->norm1_b, cin, name));
    snprintf(name, sizeof name, "%s.conv1", prefix);
    MC_TRY(mc_ldm_bind_conv(bd, &blk->conv1_w, &blk->conv1_b, cout, cin, 3, name));
    snprintf(name, sizeof name, "%s.norm2", prefix);
    MC_TRY(bind_norm(bd, &blk->norm2_w, &blk->norm2_b, cout, name));
    snprintf(name, sizeof name, "%s.conv2", prefix);
    MC_TRY(mc_ldm_bind_conv(bd, &blk->conv2_w, &blk->conv2_b, cout, cout, 3, name));
    if (cin != cout) {
        snprintf(name, sizeof name, "%s.nin_shortcut", prefix);
        MC_TRY(mc_ldm_bind_conv(bd, &blk->nin_w, &blk->nin_b, cout, cin, 1, name));
    }
    return MC_OK;
}

static mc_status bind_attn(mc_ldm_binder *bd, const mc_ldm_layout *layout, mc_ldm_attn *at,
                           int64_t c, const char *prefix) {
    char name[MC_LDM_NAME_LEN];
    at->channels = c;
    snprintf(name, sizeof name, "%s.norm", prefix);
    MC_TRY(bind_norm(bd, &at->norm_w, &at->norm_b, c, name));
    if (layout->fused_qkv) {
        /* [3c, c, 1, 1] repacks to [3c, 1, 1, c]: output channels q, k, v in order. */
        snprintf(name, sizeof name, "%s.qkv", prefix);
        MC_TRY(mc_ldm_bind_conv(bd, &at->qkv_w, &at->qkv_b, 3 * c, c, 1, name));
    } else {
        snprintf(name, sizeof name, "%s.q", prefix);
        MC_TRY(mc_ldm_bind_conv(bd, &at->q_w, &at->q_b, c, c, 1, name));
        snprintf(name, sizeof name, "%s.k", prefix);
        MC_TRY(mc_ldm_bind_conv(bd, &at->k_w, &at->k_b, c, c, 1, name));
        snprintf(name, sizeof name, "%s.v", prefix);
        MC_TRY(mc_ldm_bind_conv(bd, &at->v_w, &at->v_b, c, c, 1, name));
    }
    snprintf(name, sizeof name, "%s.proj_out", prefix);
    return mc_ldm_bind_conv(bd, &at->proj_w, &at->proj_b, c, c, 1, name);
}

static int has_tensorf(const mc_ldm_binder *bd, const char *fmt, int a, int b) {
    char name[MC_LDM_NAME_LEN];
    snprintf(name, sizeof name, fmt, a, b);
    return mc_loader_has(&bd->loader, name);
}

static int starts_with(const char *s, const char *prefix) {
    return strncmp(s, prefix, strlen(prefix)) == 0;
}

static int64_t gcd64(int64_t a, int64_t b) {
    while (b != 0) {
        int64_t r = a % b;
        a = b;
        b = r;
    }
    return a;
}

static const char *file_path(const mc_ldm_binder *bd) {
    return bd->loader.file->path != NULL ? bd->loader.file->path : "<memory>";
}

/* Reads the hyper-parameters back from tensor shapes (mar.md 8.1/8.3,
 * var_fastvar.md B4/B5); bind_all then checks every shape against them. */
static mc_status infer_config(mc_ldm_decoder *dec, mc_ldm_binder *bd) {
    const char *path = file_path(bd);
    const int k = dec->layout.post_quant_ksize;
    int ndim;
    int64_t shape[8];

    MC_TRY(mc_loader_shape(&bd->loader, "post_quant_conv.weight", &ndim, shape));
    if (ndim != 4 || shape[0] <= 0)
        return mc_fail(bd->err, MC_ERR_VALUE,
                       "%s: 'post_quant_conv.weight' must be a [z, z, %d, %d] conv weight (rank %d)",
                       path, k, k, ndim);
    dec->z_channels = shape[0];

    MC_TRY(mc_loader_shape(&bd->loader, "decoder.conv_out.weight", &ndim, shape));
    if (ndim != 4)
        return mc_fail(bd->err, MC_ERR_VALUE,
                       "%s: 'decoder.conv_out.weight' must be a [3, C, 3, 3] conv weight (rank %d)",
                       path, ndim);
    dec->out_channels = shape[0];
    if (dec->out_channels != 3)
        return mc_fail(bd->err, MC_ERR_VALUE,
                       "%s: 'decoder.conv_out.weight' has %lld output channels, expected 3 (RGB)",
                       path, (long long)dec->out_channels);

    int levels = 0;
    while (levels < MC_LDM_MAX_LEVELS && has_tensorf(bd, "decoder.up.%d.block.%d.conv1.weight", levels, 0))
        levels++;
    if (levels == 0)
        return mc_fail(bd->err, MC_ERR_KEY, "%s: missing tensor 'decoder.up.0.block.0.conv1.weight'",
                       path);
    if (has_tensorf(bd, "decoder.up.%d.block.%d.conv1.weight", levels, 0))
        return mc_fail(bd->err, MC_ERR_VALUE, "%s: more than %d decoder up levels are not supported",
                       path, MC_LDM_MAX_LEVELS);
    dec->num_levels = levels;

    int blocks = 0;
    while (blocks < 64 && has_tensorf(bd, "decoder.up.%d.block.%d.conv1.weight", 0, blocks))
        blocks++;
    dec->num_res_blocks = blocks - 1;

    /* Only the products ch * ch_mult[level] are observable. ch is their
     * greatest common divisor, which is conv_out's input width whenever
     * ch_mult[0] == 1 (all released configs) and still sensible otherwise
     * (the same rule as tests/reference/vae.py). */
    int64_t level_channels[MC_LDM_MAX_LEVELS];
    int64_t gcd = 0;
    for (int level = 0; level < levels; level++) {
        char name[MC_LDM_NAME_LEN];
        snprintf(name, sizeof name, "decoder.up.%d.block.0.conv1.weight", level);
        MC_TRY(mc_loader_shape(&bd->loader, name, &ndim, shape));
        if (ndim != 4 || shape[0] <= 0)
            return mc_fail(bd->err, MC_ERR_VALUE,
                           "%s: '%s' must be a [C_out, C_in, 3, 3] conv weight; got rank %d", path,
                           name, ndim);
        if (shape[0] % LDM_GROUPS != 0)
            return mc_fail(bd->err, MC_ERR_VALUE,
                           "%s: level %d has %lld channels, not a multiple of the %d GroupNorm groups",
                           path, level, (long long)shape[0], LDM_GROUPS);
        level_channels[level] = shape[0];
        gcd = gcd64(gcd, shape[0]);
    }
    dec->ch = gcd;
    for (int level = 0; level < levels; level++)
        dec->ch_mult[level] = level_channels[level] / gcd;
    dec->upscale = (int64_t)1 << (levels - 1);
    return MC_OK;
}

static mc_status bind_all(mc_ldm_decoder *dec, mc_ldm_binder *bd) {
    const mc_ldm_layout *layout = &dec->layout;
    const int levels = dec->num_levels;
    const int64_t z = dec->z_channels;
    const int64_t top = dec->ch * dec->ch_mult[levels - 1];
    char name[MC_LDM_NAME_LEN];

    MC_TRY(mc_ldm_bind_conv(bd, &dec->post_quant_w, &dec->post_quant_b, z, z,
                            layout->post_quant_ksize, "post_quant_conv"));
    MC_TRY(mc_ldm_bind_conv(bd, &dec->conv_in_w, &dec->conv_in_b, top, z, 3, "decoder.conv_in"));
    MC_TRY(bind_resblock(bd, &dec->mid_block_1, top, top, "decoder.mid.block_1"));
    MC_TRY(bind_attn(bd, layout, &dec->mid_attn, top, "decoder.mid.attn_1"));
    MC_TRY(bind_resblock(bd, &dec->mid_block_2, top, top, "decoder.mid.block_2"));

    int64_t block_in = top;
    for (int level = levels - 1; level >= 0; level--) {
        mc_ldm_level *lv = &dec->levels[level];
        const size_t nblocks = (size_t)(dec->num_res_blocks + 1);
        lv->channels = dec->ch * dec->ch_mult[level];
        lv->blocks = calloc(nblocks, sizeof *lv->blocks);
        if (lv->blocks == NULL)
            return mc_fail_nomem_n(bd->err, nblocks, sizeof *lv->blocks, "the %s's block table of level %d", bd->model,
                                   level);
        const int with_attn = layout->top_attention && level == levels - 1;
        if (with_attn) {
            lv->attns = calloc(nblocks, sizeof *lv->attns);
            if (lv->attns == NULL)
                return mc_fail_nomem_n(bd->err, nblocks, sizeof *lv->attns, "the %s's attention table of level %d",
                                       bd->model, level);
        }
        for (int b = 0; b <= dec->num_res_blocks; b++) {
            snprintf(name, sizeof name, "decoder.up.%d.block.%d", level, b);
            MC_TRY(bind_resblock(bd, &lv->blocks[b], block_in, lv->channels, name));
            block_in = lv->channels;
            if (with_attn) {
                snprintf(name, sizeof name, "decoder.up.%d.attn.%d", level, b);
                MC_TRY(bind_attn(bd, layout, &lv->attns[b], lv->channels, name));
            }
        }
        if (level != 0) {
            snprintf(name, sizeof name, "decoder.up.%d.upsample.conv", level);
            MC_TRY(mc_ldm_bind_conv(bd, &lv->upsample_w, &lv->upsample_b, block_in, block_in, 3,
                                    name));
        }
    }
    MC_TRY(bind_norm(bd, &dec->norm_out_w, &dec->norm_out_b, block_in, "decoder.norm_out"));
    return mc_ldm_bind_conv(bd, &dec->conv_out_w, &dec->conv_out_b, dec->out_channels, block_in, 3,
                            "decoder.conv_out");
}

mc_status mc_ldm_decoder_load(mc_ldm_decoder *dec, const mc_ldm_layout *layout,
                              mc_ldm_binder *bd) {
    dec->layout = *layout;
    MC_TRY(infer_config(dec, bd));
    return bind_all(dec, bd);
}

mc_status mc_ldm_decoder_check_unused(const mc_ldm_decoder *dec, const mc_st_file *file,
                                      const mc_ldm_binder *bd) {
    for (int64_t i = 0; i < file->n_tensors; i++) {
        const char *name = file->tensors[i].name;
        if (!starts_with(name, "decoder.") && !starts_with(name, "post_quant_conv."))
            continue;
        if (!mc_ldm_was_bound(bd, name))
            return mc_fail(bd->err, MC_ERR_VALUE,
                           "%s: unexpected decoder tensor '%s' (the %s decoder read from this "
                           "file has %d up levels of %lld ResnetBlocks and %s; "
                           "a tensor outside that layout means a different architecture)",
                           file_path(bd), name, dec->layout.description, dec->num_levels,
                           (long long)(dec->num_res_blocks + 1),
                           dec->layout.top_attention
                               ? "an AttnBlock after each ResnetBlock of the top level"
                               : "no up-path attention");
    }
    return MC_OK;
}

void mc_ldm_decoder_release(mc_ldm_decoder *dec, mc_backend *be) {
    mc_buffers_release(be, dec->buffers, 3);
    for (int level = 0; level < MC_LDM_MAX_LEVELS; level++) {
        free(dec->levels[level].blocks);
        free(dec->levels[level].attns);
    }
    memset(dec, 0, sizeof *dec);
}

/* ------------------------------------------------------------------ decoding */

/* Floats the largest activation of one image needs at latent side `side`,
 * walking the same shapes as mc_ldm_decoder_run. Also covers an AttnBlock's
 * q, k, v side by side in one buffer (the mid block and the top level both
 * run at the latent side with the top width). */
static size_t activation_floats(const mc_ldm_decoder *dec, int64_t side) {
    int64_t res = side, top = dec->ch * dec->ch_mult[dec->num_levels - 1];
    int64_t need = res * res * (dec->z_channels > top ? dec->z_channels : top);
    if (3 * res * res * top > need)
        need = 3 * res * res * top;
    int64_t block_in = top;
    for (int level = dec->num_levels - 1; level >= 0; level--) {
        int64_t c = dec->ch * dec->ch_mult[level];
        int64_t widest = block_in > c ? block_in : c;
        if (res * res * widest > need)
            need = res * res * widest;
        block_in = c;
        if (level != 0) {
            res *= 2;
            if (res * res * c > need)
                need = res * res * c;
        }
    }
    if (res * res * dec->out_channels > need)
        need = res * res * dec->out_channels;
    return (size_t)need;
}

mc_status mc_ldm_decoder_reserve(mc_ldm_decoder *dec, mc_backend *be, int64_t side, mc_err *err) {
    static const char *const names[3] = {"decoder.t0", "decoder.t1", "decoder.t2"};
    size_t floats = activation_floats(dec, side);
    for (int i = 0; i < 3; i++)
        if (mc_buffer_floats(be, &dec->buffers[i], floats, names[i], err) == NULL)
            return err->status; /* the others stay allocated and are freed later */
    return MC_OK;
}

/* The latent goes where run's post_quant_conv reads it without a copy: the
 * buffer that is t1 when run starts (see ldm_bufs). */
float *mc_ldm_decoder_input_buffer(mc_ldm_decoder *dec) { return dec->buffers[1].data; }

/* The three rotating activation buffers: x is the residual stream, t1 and
 * t2 are temporaries. Swapping pointers moves a result into x for free. */
typedef struct ldm_bufs {
    float *x, *t1, *t2;
} ldm_bufs;

static void swap_buffers(float **a, float **b) {
    float *t = *a;
    *a = *b;
    *b = t;
}

/* ResnetBlock: h = conv1(swish(norm1(x))); h = conv2(swish(norm2(h)));
 * x = shortcut(x) + h. The residual add is the conv's beta = 1. */
static mc_status resblock_forward(mc_backend *be, const mc_ldm_resblock *blk, int64_t res,
                                  ldm_bufs *bf, mc_err *err) {
    const mc_ops *op = be->ops;
    const int64_t hw = res * res;
    MC_TRY(op->groupnorm(be, bf->x, 1, hw, blk->cin, LDM_GROUPS, blk->norm1_w, blk->norm1_b,
                         LDM_EPS, 1, bf->t1, err));
    MC_TRY(op->conv2d(be, bf->t1, 1, res, res, blk->cin, blk->conv1_w, blk->conv1_b, blk->cout, 3,
                      0.0f, bf->t2, err));
    MC_TRY(op->groupnorm(be, bf->t2, 1, hw, blk->cout, LDM_GROUPS, blk->norm2_w, blk->norm2_b,
                         LDM_EPS, 1, bf->t2, err));
    if (blk->nin_w != NULL) {
        MC_TRY(op->conv2d(be, bf->x, 1, res, res, blk->cin, blk->nin_w, blk->nin_b, blk->cout, 1,
                          0.0f, bf->t1, err));
        MC_TRY(op->conv2d(be, bf->t2, 1, res, res, blk->cout, blk->conv2_w, blk->conv2_b,
                          blk->cout, 3, 1.0f, bf->t1, err));
        swap_buffers(&bf->x, &bf->t1);
    } else {
        MC_TRY(op->conv2d(be, bf->t2, 1, res, res, blk->cout, blk->conv2_w, blk->conv2_b,
                          blk->cout, 3, 1.0f, bf->x, err));
    }
    return MC_OK;
}

/* AttnBlock, one head over the res x res positions (row-major, which NHWC
 * already is): x += proj_out(softmax(q k^T / sqrt(C)) v). The fused layout
 * computes q, k, v as one [hw, 3C] map, read in place as three column
 * slices (row stride 3C); the separate one as three [hw, C] maps. */
static mc_status attn_forward(mc_backend *be, const mc_ldm_attn *at, int64_t res, ldm_bufs *bf,
                              mc_err *err) {
    const mc_ops *op = be->ops;
    const int64_t hw = res * res, c = at->channels;
    float *q, *k, *val;
    int64_t ld;
    MC_TRY(op->groupnorm(be, bf->x, 1, hw, c, LDM_GROUPS, at->norm_w, at->norm_b, LDM_EPS, 0,
                         bf->t1, err));
    if (at->qkv_w != NULL) {
        MC_TRY(op->conv2d(be, bf->t1, 1, res, res, c, at->qkv_w, at->qkv_b, 3 * c, 1, 0.0f, bf->t2,
                          err));
        q = bf->t2;
        k = bf->t2 + c;
        val = bf->t2 + 2 * c;
        ld = 3 * c;
    } else {
        q = bf->t2;
        k = bf->t2 + hw * c;
        val = bf->t2 + 2 * hw * c;
        ld = c;
        MC_TRY(op->conv2d(be, bf->t1, 1, res, res, c, at->q_w, at->q_b, c, 1, 0.0f, q, err));
        MC_TRY(op->conv2d(be, bf->t1, 1, res, res, c, at->k_w, at->k_b, c, 1, 0.0f, k, err));
        MC_TRY(op->conv2d(be, bf->t1, 1, res, res, c, at->v_w, at->v_b, c, 1, 0.0f, val, err));
    }
    mc_kv_segment seg = {.k = k, .v = val, .rows = hw, .ld = ld, .batch_stride = hw * ld};
    MC_TRY(op->attention(be, 1, hw, 1, (int)c, (float)(1.0 / sqrt((double)c)), q, ld, hw * ld,
                         &seg, 1, bf->t1, c, hw * c, err));
    return op->conv2d(be, bf->t1, 1, res, res, c, at->proj_w, at->proj_b, c, 1, 1.0f, bf->x, err);
}

#define LDM_CHECK_CANCEL()                                                            \
    do {                                                                              \
        if (cancel != NULL && cancel(cancel_ctx))                                     \
            return mc_fail(err, MC_ERR_INTERRUPTED, "%s decoding was interrupted",     \
                           dec->layout.model);                                        \
    } while (0)

mc_status mc_ldm_decoder_run(mc_ldm_decoder *dec, mc_backend *be, const float *latent,
                             int64_t side, float *out_host, int (*cancel)(void *ctx),
                             void *cancel_ctx, mc_err *err) {
    const mc_ops *op = be->ops;
    const int64_t z = dec->z_channels, top = dec->ch * dec->ch_mult[dec->num_levels - 1];
    if (dec->buffers[2].bytes < activation_floats(dec, side) * sizeof(float))
        return mc_fail(err, MC_ERR_INTERNAL, "%s decoder: buffers not reserved for latent side %lld",
                       dec->layout.model, (long long)side);
    ldm_bufs bf = {dec->buffers[0].data, dec->buffers[1].data, dec->buffers[2].data};
    int64_t res = side;

    MC_TRY(op->conv2d(be, latent, 1, res, res, z, dec->post_quant_w, dec->post_quant_b, z,
                      dec->layout.post_quant_ksize, 0.0f, bf.t2, err));
    MC_TRY(op->conv2d(be, bf.t2, 1, res, res, z, dec->conv_in_w, dec->conv_in_b, top, 3, 0.0f, bf.x,
                      err));
    MC_TRY(resblock_forward(be, &dec->mid_block_1, res, &bf, err));
    MC_TRY(attn_forward(be, &dec->mid_attn, res, &bf, err));
    MC_TRY(resblock_forward(be, &dec->mid_block_2, res, &bf, err));
    LDM_CHECK_CANCEL();

    for (int level = dec->num_levels - 1; level >= 0; level--) {
        const mc_ldm_level *lv = &dec->levels[level];
        for (int64_t b = 0; b <= dec->num_res_blocks; b++) {
            MC_TRY(resblock_forward(be, &lv->blocks[b], res, &bf, err));
            if (lv->attns != NULL)
                MC_TRY(attn_forward(be, &lv->attns[b], res, &bf, err));
            LDM_CHECK_CANCEL();
        }
        if (level != 0) {
            MC_TRY(op->upsample_nearest2x(be, bf.x, 1, res, res, lv->channels, bf.t1, err));
            res *= 2;
            MC_TRY(op->conv2d(be, bf.t1, 1, res, res, lv->channels, lv->upsample_w, lv->upsample_b,
                              lv->channels, 3, 0.0f, bf.x, err));
            LDM_CHECK_CANCEL();
        }
    }

    const int64_t c0 = dec->levels[0].channels;
    MC_TRY(op->groupnorm(be, bf.x, 1, res * res, c0, LDM_GROUPS, dec->norm_out_w, dec->norm_out_b,
                         LDM_EPS, 1, bf.t1, err));
    MC_TRY(op->conv2d(be, bf.t1, 1, res, res, c0, dec->conv_out_w, dec->conv_out_b,
                      dec->out_channels, 3, 0.0f, bf.t2, err));
    return op->download(be, out_host, bf.t2,
                        (size_t)(res * res * dec->out_channels) * sizeof(float), err);
}

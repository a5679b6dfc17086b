/* KL-16 VAE decoder (mar.md 8.2) on the backend op table.
 *
 * Data flow per image, all NHWC: tokens / 0.2325 (the token layout already
 * is NHWC: latent[h, w, c] = tokens[h * side + w, c]) -> post_quant_conv ->
 * conv_in -> mid (ResnetBlock, AttnBlock, ResnetBlock) -> up levels from the
 * last to level 0, each num_res_blocks + 1 ResnetBlocks and, except level 0,
 * nearest x2 + 3x3 conv -> GroupNorm + swish -> conv_out. */
#include "vae.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../io/bind.h"

#define VAE_GROUPS 32
#define VAE_EPS 1e-6f
/* Largest output side accepted (keeps every size computation far from
 * int64 overflow; a 16384^2 image is already ~100 GB of activations). */
#define VAE_MAX_OUTPUT_SIDE 16384
#define VAE_NAME_LEN 128

typedef struct vae_resblock {
    int64_t cin, cout;
    float *norm1_w, *norm1_b, *conv1_w, *conv1_b;
    float *norm2_w, *norm2_b, *conv2_w, *conv2_b;
    float *nin_w, *nin_b; /* 1x1 shortcut, only when cin != cout */
} vae_resblock;

typedef struct vae_attn {
    int64_t channels;
    float *norm_w, *norm_b;
    float *q_w, *q_b, *k_w, *k_b, *v_w, *v_b, *proj_w, *proj_b;
} vae_attn;

typedef struct vae_level {
    int64_t channels;       /* ch * ch_mult[level]: output of every block */
    vae_resblock *blocks;   /* num_res_blocks + 1 */
    float *upsample_w, *upsample_b; /* NULL at level 0 */
} vae_level;

struct mc_vae {
    mc_backend *be;
    mc_vae_info info;
    mc_alloc_list weights;

    float *post_quant_w, *post_quant_b;
    float *conv_in_w, *conv_in_b;
    vae_resblock mid_block_1, mid_block_2;
    vae_attn mid_attn;
    vae_level levels[MC_VAE_MAX_LEVELS];
    float *norm_out_w, *norm_out_b;
    float *conv_out_w, *conv_out_b;

    /* Activation buffers in backend memory, each `buffer_floats` long,
     * sized for the largest latent side seen so far and reused. */
    float *buffers[3];
    size_t buffer_floats;
    float *host_latent; /* one image's scaled latent, host */
    size_t host_latent_floats;
};

/* ------------------------------------------------------------------ loading */

/* Binding context: the loader plus bookkeeping for the parameter count and
 * the check that no decoder tensor of the file is left unused. */
typedef struct vae_binder {
    mc_loader loader;
    mc_err *err;
    int64_t num_params;
    char (*bound)[VAE_NAME_LEN];
    int64_t n_bound, cap_bound;
} vae_binder;

static mc_status note_bound(vae_binder *bd, const char *name, int ndim, const int64_t *shape) {
    if (bd->n_bound == bd->cap_bound) {
        int64_t cap = bd->cap_bound ? 2 * bd->cap_bound : 256;
        void *grown = realloc(bd->bound, (size_t)cap * VAE_NAME_LEN);
        if (grown == NULL)
            return mc_fail(bd->err, MC_ERR_NOMEM, "VAE: cannot allocate the list of bound names");
        bd->bound = grown;
        bd->cap_bound = cap;
    }
    snprintf(bd->bound[bd->n_bound++], VAE_NAME_LEN, "%s", name);
    int64_t numel = 1;
    for (int d = 0; d < ndim; d++)
        numel *= shape[d];
    bd->num_params += numel;
    return MC_OK;
}

/* Binds the tensor named by fmt with exactly `ndim` dims `shape`. 4-D
 * tensors are conv weights and get repacked to [O, kh, kw, I]. */
static mc_status bind_tensor(vae_binder *bd, float **out, int ndim, const int64_t *shape,
                             const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 5, 6)))
#endif
    ;

static mc_status bind_tensor(vae_binder *bd, float **out, int ndim, const int64_t *shape,
                             const char *fmt, ...) {
    char name[VAE_NAME_LEN];
    va_list ap;
    va_start(ap, fmt);
    int len = vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    if (len < 0 || len >= (int)sizeof name)
        return mc_fail(bd->err, MC_ERR_INTERNAL, "VAE: tensor name too long");
    mc_bind_layout layout = ndim == 4 ? MC_BIND_CONV_OHWI : MC_BIND_AS_IS;
    MC_TRY(mc_bind(&bd->loader, name, ndim, shape, layout, out));
    return note_bound(bd, name, ndim, shape);
}

static mc_status bind_conv(vae_binder *bd, float **w, float **b, int64_t cout, int64_t cin,
                           int64_t k, const char *prefix) {
    MC_TRY(bind_tensor(bd, w, 4, (int64_t[]){cout, cin, k, k}, "%s.weight", prefix));
    return bind_tensor(bd, b, 1, (int64_t[]){cout}, "%s.bias", prefix);
}

static mc_status bind_norm(vae_binder *bd, float **w, float **b, int64_t channels,
                           const char *prefix) {
    MC_TRY(bind_tensor(bd, w, 1, (int64_t[]){channels}, "%s.weight", prefix));
    return bind_tensor(bd, b, 1, (int64_t[]){channels}, "%s.bias", prefix);
}

static mc_status bind_resblock(vae_binder *bd, vae_resblock *blk, int64_t cin, int64_t cout,
                               const char *prefix) {
    char name[VAE_NAME_LEN];
    blk->cin = cin;
    blk->cout = cout;
    snprintf(name, sizeof name, "%s.norm1", prefix);
    MC_TRY(bind_norm(bd, &blk->norm1_w, &blk->norm1_b, cin, name));
    snprintf(name, sizeof name, "%s.conv1", prefix);
    MC_TRY(bind_conv(bd, &blk->conv1_w, &blk->conv1_b, cout, cin, 3, name));
    snprintf(name, sizeof name, "%s.norm2", prefix);
    MC_TRY(bind_norm(bd, &blk->norm2_w, &blk->norm2_b, cout, name));
    snprintf(name, sizeof name, "%s.conv2", prefix);
    MC_TRY(bind_conv(bd, &blk->conv2_w, &blk->conv2_b, cout, cout, 3, name));
    if (cin != cout) {
        snprintf(name, sizeof name, "%s.nin_shortcut", prefix);
        MC_TRY(bind_conv(bd, &blk->nin_w, &blk->nin_b, cout, cin, 1, name));
    }
    return MC_OK;
}

static mc_status bind_attn(vae_binder *bd, vae_attn *at, int64_t c, const char *prefix) {
    char name[VAE_NAME_LEN];
    at->channels = c;
    snprintf(name, sizeof name, "%s.norm", prefix);
    MC_TRY(bind_norm(bd, &at->norm_w, &at->norm_b, c, name));
    snprintf(name, sizeof name, "%s.q", prefix);
    MC_TRY(bind_conv(bd, &at->q_w, &at->q_b, c, c, 1, name));
    snprintf(name, sizeof name, "%s.k", prefix);
    MC_TRY(bind_conv(bd, &at->k_w, &at->k_b, c, c, 1, name));
    snprintf(name, sizeof name, "%s.v", prefix);
    MC_TRY(bind_conv(bd, &at->v_w, &at->v_b, c, c, 1, name));
    snprintf(name, sizeof name, "%s.proj_out", prefix);
    return bind_conv(bd, &at->proj_w, &at->proj_b, c, c, 1, name);
}

static int has_tensorf(const vae_binder *bd, const char *fmt, int a, int b) {
    char name[VAE_NAME_LEN];
    snprintf(name, sizeof name, fmt, a, b);
    return mc_loader_has(&bd->loader, name);
}

static int starts_with(const char *s, const char *prefix) {
    return strncmp(s, prefix, strlen(prefix)) == 0;
}

/* Refuses files that are not MAR's KL-16 decoder before binding anything,
 * so the message says what the file is rather than which key is missing. */
static mc_status check_file_kind(const mc_st_file *file, const vae_binder *bd) {
    const char *path = file->path != NULL ? file->path : "<memory>";
    if (!mc_loader_has(&bd->loader, "decoder.conv_in.weight"))
        return mc_fail(bd->err, MC_ERR_VALUE,
                       "%s is not a KL-16 VAE decoder checkpoint: it has no tensor "
                       "'decoder.conv_in.weight' (a MAR or VAR model file, or a VAE file "
                       "without the decoder?)",
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

/* Every post_quant_conv.* / decoder.* tensor must have been bound: an extra
 * one means a different architecture that would otherwise decode wrongly. */
static mc_status check_nothing_left(const mc_st_file *file, const vae_binder *bd,
                                    const mc_vae_info *info) {
    for (int64_t i = 0; i < file->n_tensors; i++) {
        const char *name = file->tensors[i].name;
        if (!starts_with(name, "decoder.") && !starts_with(name, "post_quant_conv."))
            continue;
        int found = 0;
        for (int64_t j = 0; j < bd->n_bound && !found; j++)
            found = strcmp(bd->bound[j], name) == 0;
        if (!found)
            return mc_fail(bd->err, MC_ERR_VALUE,
                           "%s: unexpected decoder tensor '%s' (the KL-16 decoder read from this "
                           "file has %d up levels of %lld ResnetBlocks and no up-path attention; "
                           "a tensor outside that layout means a different architecture)",
                           file->path != NULL ? file->path : "<memory>", name, info->num_levels,
                           (long long)(info->num_res_blocks + 1));
    }
    return MC_OK;
}

static int64_t gcd64(int64_t a, int64_t b) {
    while (b != 0) {
        int64_t r = a % b;
        a = b;
        b = r;
    }
    return a;
}

/* Reads the hyper-parameters back from tensor shapes (mar.md 8.1/8.3);
 * bind_all then checks every shape against them. */
static mc_status infer_config(const mc_st_file *file, vae_binder *bd, mc_vae_info *info) {
    const char *path = file->path != NULL ? file->path : "<memory>";
    int ndim;
    int64_t shape[8];

    MC_TRY(mc_loader_shape(&bd->loader, "post_quant_conv.weight", &ndim, shape));
    if (ndim != 4 || shape[0] <= 0)
        return mc_fail(bd->err, MC_ERR_VALUE,
                       "%s: 'post_quant_conv.weight' must be a [z, z, 1, 1] conv weight (rank %d)",
                       path, ndim);
    info->z_channels = shape[0];

    MC_TRY(mc_loader_shape(&bd->loader, "decoder.conv_out.weight", &ndim, shape));
    if (ndim != 4)
        return mc_fail(bd->err, MC_ERR_VALUE,
                       "%s: 'decoder.conv_out.weight' must be a [3, C, 3, 3] conv weight (rank %d)",
                       path, ndim);
    info->out_channels = shape[0];
    if (info->out_channels != 3)
        return mc_fail(bd->err, MC_ERR_VALUE,
                       "%s: 'decoder.conv_out.weight' has %lld output channels, expected 3 (RGB)",
                       path, (long long)info->out_channels);

    int levels = 0;
    while (levels < MC_VAE_MAX_LEVELS && has_tensorf(bd, "decoder.up.%d.block.%d.conv1.weight", levels, 0))
        levels++;
    if (levels == 0)
        return mc_fail(bd->err, MC_ERR_KEY, "%s: missing tensor 'decoder.up.0.block.0.conv1.weight'",
                       path);
    if (has_tensorf(bd, "decoder.up.%d.block.%d.conv1.weight", levels, 0))
        return mc_fail(bd->err, MC_ERR_VALUE, "%s: more than %d decoder up levels are not supported",
                       path, MC_VAE_MAX_LEVELS);
    info->num_levels = levels;

    int blocks = 0;
    while (blocks < 64 && has_tensorf(bd, "decoder.up.%d.block.%d.conv1.weight", 0, blocks))
        blocks++;
    info->num_res_blocks = blocks - 1;

    /* Only the products ch * ch_mult[level] are observable. ch is their
     * greatest common divisor, which is conv_out's input width whenever
     * ch_mult[0] == 1 (all released configs) and still sensible otherwise
     * (the same rule as tests/reference/vae.py). */
    int64_t level_channels[MC_VAE_MAX_LEVELS];
    int64_t gcd = 0;
    for (int level = 0; level < levels; level++) {
        char name[VAE_NAME_LEN];
        snprintf(name, sizeof name, "decoder.up.%d.block.0.conv1.weight", level);
        MC_TRY(mc_loader_shape(&bd->loader, name, &ndim, shape));
        if (ndim != 4 || shape[0] <= 0)
            return mc_fail(bd->err, MC_ERR_VALUE,
                           "%s: '%s' must be a [C_out, C_in, 3, 3] conv weight; got rank %d", path,
                           name, ndim);
        if (shape[0] % VAE_GROUPS != 0)
            return mc_fail(bd->err, MC_ERR_VALUE,
                           "%s: level %d has %lld channels, not a multiple of the %d GroupNorm groups",
                           path, level, (long long)shape[0], VAE_GROUPS);
        level_channels[level] = shape[0];
        gcd = gcd64(gcd, shape[0]);
    }
    info->ch = gcd;
    for (int level = 0; level < levels; level++)
        info->ch_mult[level] = level_channels[level] / gcd;
    info->upscale = (int64_t)1 << (levels - 1);
    return MC_OK;
}

static mc_status bind_all(vae_binder *bd, mc_vae *v) {
    const mc_vae_info *info = &v->info;
    const int levels = info->num_levels;
    const int64_t z = info->z_channels;
    const int64_t top = info->ch * info->ch_mult[levels - 1];
    char name[VAE_NAME_LEN];

    MC_TRY(bind_conv(bd, &v->post_quant_w, &v->post_quant_b, z, z, 1, "post_quant_conv"));
    MC_TRY(bind_conv(bd, &v->conv_in_w, &v->conv_in_b, top, z, 3, "decoder.conv_in"));
    MC_TRY(bind_resblock(bd, &v->mid_block_1, top, top, "decoder.mid.block_1"));
    MC_TRY(bind_attn(bd, &v->mid_attn, top, "decoder.mid.attn_1"));
    MC_TRY(bind_resblock(bd, &v->mid_block_2, top, top, "decoder.mid.block_2"));

    int64_t block_in = top;
    for (int level = levels - 1; level >= 0; level--) {
        vae_level *lv = &v->levels[level];
        lv->channels = info->ch * info->ch_mult[level];
        lv->blocks = calloc((size_t)(info->num_res_blocks + 1), sizeof *lv->blocks);
        if (lv->blocks == NULL)
            return mc_fail(bd->err, MC_ERR_NOMEM, "VAE: cannot allocate the block table");
        for (int b = 0; b <= info->num_res_blocks; b++) {
            snprintf(name, sizeof name, "decoder.up.%d.block.%d", level, b);
            MC_TRY(bind_resblock(bd, &lv->blocks[b], block_in, lv->channels, name));
            block_in = lv->channels;
        }
        if (level != 0) {
            snprintf(name, sizeof name, "decoder.up.%d.upsample.conv", level);
            MC_TRY(bind_conv(bd, &lv->upsample_w, &lv->upsample_b, block_in, block_in, 3, name));
        }
    }
    MC_TRY(bind_norm(bd, &v->norm_out_w, &v->norm_out_b, block_in, "decoder.norm_out"));
    return bind_conv(bd, &v->conv_out_w, &v->conv_out_b, info->out_channels, block_in, 3,
                     "decoder.conv_out");
}

mc_status mc_vae_load(mc_backend *be, const mc_st_file *file, mc_vae **out, mc_err *err) {
    *out = NULL;
    mc_vae *v = calloc(1, sizeof *v);
    if (v == NULL)
        return mc_fail(err, MC_ERR_NOMEM, "VAE: cannot allocate the model struct");
    v->be = be;

    vae_binder bd = {.err = err};
    mc_loader_init(&bd.loader, file, be, err);
    mc_status st = check_file_kind(file, &bd);
    if (st == MC_OK)
        st = infer_config(file, &bd, &v->info);
    if (st == MC_OK)
        st = bind_all(&bd, v);
    if (st == MC_OK)
        st = check_nothing_left(file, &bd, &v->info);
    if (st == MC_OK) {
        v->info.num_params = bd.num_params;
        v->weights = mc_loader_take_allocations(&bd.loader);
    }
    mc_loader_finish(&bd.loader);
    free(bd.bound);
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
    for (int i = 0; i < 3; i++)
        if (vae->buffers[i] != NULL)
            vae->be->ops->release(vae->be, vae->buffers[i]);
    mc_alloc_list_free(&vae->weights, vae->be);
    for (int level = 0; level < MC_VAE_MAX_LEVELS; level++)
        free(vae->levels[level].blocks);
    free(vae->host_latent);
    free(vae);
}

void mc_vae_get_info(const mc_vae *vae, mc_vae_info *info) { *info = vae->info; }

/* ------------------------------------------------------------------ decoding */

/* Floats the largest activation of one image needs at latent side `side`,
 * walking the same shapes as decode_one. Also covers the mid attention's
 * q, k, v side by side in one buffer. */
static size_t activation_floats(const mc_vae *v, int64_t side) {
    const mc_vae_info *info = &v->info;
    int64_t res = side, top = info->ch * info->ch_mult[info->num_levels - 1];
    int64_t need = res * res * (info->z_channels > top ? info->z_channels : top);
    if (3 * res * res * top > need)
        need = 3 * res * res * top;
    int64_t block_in = top;
    for (int level = info->num_levels - 1; level >= 0; level--) {
        int64_t c = info->ch * info->ch_mult[level];
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
    if (res * res * info->out_channels > need)
        need = res * res * info->out_channels;
    return (size_t)need;
}

static mc_status ensure_buffers(mc_vae *v, int64_t side, mc_err *err) {
    size_t latent = (size_t)(side * side * v->info.z_channels);
    if (v->host_latent_floats < latent) {
        float *fresh = malloc(latent * sizeof(float));
        if (fresh == NULL)
            return mc_fail(err, MC_ERR_NOMEM, "VAE: cannot allocate the %zu-float latent staging buffer",
                           latent);
        free(v->host_latent);
        v->host_latent = fresh;
        v->host_latent_floats = latent;
    }
    size_t floats = activation_floats(v, side);
    if (v->buffer_floats >= floats)
        return MC_OK;
    for (int i = 0; i < 3; i++) {
        if (v->buffers[i] != NULL)
            v->be->ops->release(v->be, v->buffers[i]);
        v->buffers[i] = NULL;
    }
    v->buffer_floats = 0;
    for (int i = 0; i < 3; i++) {
        v->buffers[i] = v->be->ops->alloc(v->be, floats * sizeof(float), err);
        if (v->buffers[i] == NULL)
            return err->status; /* the others stay allocated and are freed later */
    }
    v->buffer_floats = floats;
    return MC_OK;
}

/* The three rotating activation buffers: x is the residual stream, t1 and
 * t2 are temporaries. Swapping pointers moves a result into x for free. */
typedef struct vae_bufs {
    float *x, *t1, *t2;
} vae_bufs;

static void swap_buffers(float **a, float **b) {
    float *t = *a;
    *a = *b;
    *b = t;
}

/* ResnetBlock: h = conv1(swish(norm1(x))); h = conv2(swish(norm2(h)));
 * x = shortcut(x) + h. The residual add is the conv's beta = 1. */
static mc_status resblock_forward(mc_vae *v, const vae_resblock *blk, int64_t res, vae_bufs *bf,
                                  mc_err *err) {
    mc_backend *be = v->be;
    const mc_ops *op = be->ops;
    const int64_t hw = res * res;
    MC_TRY(op->groupnorm(be, bf->x, 1, hw, blk->cin, VAE_GROUPS, blk->norm1_w, blk->norm1_b,
                         VAE_EPS, 1, bf->t1, err));
    MC_TRY(op->conv2d(be, bf->t1, 1, res, res, blk->cin, blk->conv1_w, blk->conv1_b, blk->cout, 3,
                      0.0f, bf->t2, err));
    MC_TRY(op->groupnorm(be, bf->t2, 1, hw, blk->cout, VAE_GROUPS, blk->norm2_w, blk->norm2_b,
                         VAE_EPS, 1, bf->t2, err));
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
 * already is): x += proj_out(softmax(q k^T / sqrt(C)) v). */
static mc_status attn_forward(mc_vae *v, const vae_attn *at, int64_t res, vae_bufs *bf,
                              mc_err *err) {
    mc_backend *be = v->be;
    const mc_ops *op = be->ops;
    const int64_t hw = res * res, c = at->channels;
    float *q = bf->t2, *k = bf->t2 + hw * c, *val = bf->t2 + 2 * hw * c;
    MC_TRY(op->groupnorm(be, bf->x, 1, hw, c, VAE_GROUPS, at->norm_w, at->norm_b, VAE_EPS, 0,
                         bf->t1, err));
    MC_TRY(op->conv2d(be, bf->t1, 1, res, res, c, at->q_w, at->q_b, c, 1, 0.0f, q, err));
    MC_TRY(op->conv2d(be, bf->t1, 1, res, res, c, at->k_w, at->k_b, c, 1, 0.0f, k, err));
    MC_TRY(op->conv2d(be, bf->t1, 1, res, res, c, at->v_w, at->v_b, c, 1, 0.0f, val, err));
    mc_kv_segment seg = {.k = k, .v = val, .rows = hw, .ld = c, .batch_stride = hw * c};
    MC_TRY(op->attention(be, 1, hw, 1, (int)c, (float)(1.0 / sqrt((double)c)), q, c, hw * c, &seg,
                         1, bf->t1, c, hw * c, err));
    return op->conv2d(be, bf->t1, 1, res, res, c, at->proj_w, at->proj_b, c, 1, 1.0f, bf->x, err);
}

#define VAE_CHECK_CANCEL()                                                          \
    do {                                                                            \
        if (cancel != NULL && cancel(cancel_ctx))                                   \
            return mc_fail(err, MC_ERR_INTERRUPTED, "VAE decoding was interrupted"); \
    } while (0)

/* Decodes one image whose scaled latent [side * side, z] is in
 * v->host_latent into out_host [side * upscale, side * upscale, 3]. */
static mc_status decode_one(mc_vae *v, int64_t side, float *out_host, int (*cancel)(void *),
                            void *cancel_ctx, mc_err *err) {
    mc_backend *be = v->be;
    const mc_ops *op = be->ops;
    const mc_vae_info *info = &v->info;
    const int64_t z = info->z_channels, top = info->ch * info->ch_mult[info->num_levels - 1];
    vae_bufs bf = {v->buffers[0], v->buffers[1], v->buffers[2]};
    int64_t res = side;

    MC_TRY(op->upload(be, bf.t1, v->host_latent, (size_t)(res * res * z) * sizeof(float), err));
    MC_TRY(op->conv2d(be, bf.t1, 1, res, res, z, v->post_quant_w, v->post_quant_b, z, 1, 0.0f,
                      bf.t2, err));
    MC_TRY(op->conv2d(be, bf.t2, 1, res, res, z, v->conv_in_w, v->conv_in_b, top, 3, 0.0f, bf.x,
                      err));
    MC_TRY(resblock_forward(v, &v->mid_block_1, res, &bf, err));
    MC_TRY(attn_forward(v, &v->mid_attn, res, &bf, err));
    MC_TRY(resblock_forward(v, &v->mid_block_2, res, &bf, err));
    VAE_CHECK_CANCEL();

    for (int level = info->num_levels - 1; level >= 0; level--) {
        const vae_level *lv = &v->levels[level];
        for (int64_t b = 0; b <= info->num_res_blocks; b++) {
            MC_TRY(resblock_forward(v, &lv->blocks[b], res, &bf, err));
            VAE_CHECK_CANCEL();
        }
        if (level != 0) {
            MC_TRY(op->upsample_nearest2x(be, bf.x, 1, res, res, lv->channels, bf.t1, err));
            res *= 2;
            MC_TRY(op->conv2d(be, bf.t1, 1, res, res, lv->channels, lv->upsample_w, lv->upsample_b,
                              lv->channels, 3, 0.0f, bf.x, err));
            VAE_CHECK_CANCEL();
        }
    }

    const int64_t c0 = v->levels[0].channels;
    MC_TRY(op->groupnorm(be, bf.x, 1, res * res, c0, VAE_GROUPS, v->norm_out_w, v->norm_out_b,
                         VAE_EPS, 1, bf.t1, err));
    MC_TRY(op->conv2d(be, bf.t1, 1, res, res, c0, v->conv_out_w, v->conv_out_b, info->out_channels,
                      3, 0.0f, bf.t2, err));
    return op->download(be, out_host, bf.t2,
                        (size_t)(res * res * info->out_channels) * sizeof(float), err);
}

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
    MC_TRY(ensure_buffers(vae, side, err));

    const int64_t token_floats = seq_len * channels;
    const int64_t out_side = side * info->upscale;
    const int64_t image_floats = out_side * out_side * info->out_channels;
    for (int64_t i = 0; i < n_images; i++) {
        VAE_CHECK_CANCEL();
        /* unpatchify (p = 1) is the identity in NHWC: only the scale remains.
         * A division, not a multiply by the reciprocal, as the reference does. */
        const float *tok = tokens_host + i * token_floats;
        for (int64_t j = 0; j < token_floats; j++)
            vae->host_latent[j] = tok[j] / MC_VAE_LATENT_SCALE;
        MC_TRY(decode_one(vae, side, out_nhwc_host + i * image_floats, cancel, cancel_ctx, err));
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

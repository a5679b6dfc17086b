/* FID-Inception on the backend op table (inception.h has the contract).
 *
 * Layout (pytorch-fid fid_inception_v3 / torch-fidelity inception-v3-compat):
 *   Conv2d_1a_3x3 (3x3 s2) Conv2d_2a_3x3 (3x3) Conv2d_2b_3x3 (3x3 p1)
 *   MaxPool 3 s2, Conv2d_3b_1x1, Conv2d_4a_3x3 (3x3), MaxPool 3 s2
 *   Mixed_5b/5c/5d  FIDInceptionA   [1x1 | 1x1,5x5 | 1x1,3x3,3x3 | avg,1x1]
 *   Mixed_6a        InceptionB      [3x3 s2 | 1x1,3x3,3x3 s2 | max 3 s2]
 *   Mixed_6b..6e    FIDInceptionC   [1x1 | 1x1,1x7,7x1 | 1x1,7x1,1x7,7x1,1x7 | avg,1x1]
 *   Mixed_7a        InceptionD      [1x1,3x3 s2 | 1x1,1x7,7x1,3x3 s2 | max 3 s2]
 *   Mixed_7b        FIDInceptionE_1 [1x1 | 1x1,(1x3 | 3x1) | 1x1,3x3,(1x3 | 3x1) | avg,1x1]
 *   Mixed_7c        FIDInceptionE_2 (the same with max 3 s1 p1 in branch_pool)
 *   global average pool, fc without bias.
 * Every conv is BasicConv2d: conv (no bias) + BatchNorm(eps 1e-3) + ReLU,
 * here one conv2d_ex with the folded weight/bias and the fused ReLU. The
 * average pools are 3x3 s1 p1 without counting padding.
 *
 * Activations: two ping-pong buffers for the main path (a block reads one
 * and writes its concatenated output into the other, each branch straight
 * into its channel slice via the ops' pixel stride) and two temporaries for
 * branch intermediates. Their sizes come from running the forward once in
 * "plan" mode at load, which walks exactly the shapes of the real pass. */
#include "inception.h"

#include "../backend/workspace.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../io/bind.h"

#define INC_NAME_LEN 128

/* ----------------------------------------------------------------- layout */

typedef struct inc_conv {
    int64_t cin, cout;
    int kh, kw, sh, sw, ph, pw;
    float *w; /* folded, packed [cout, kh, kw, cin] */
    float *b; /* folded [cout] */
} inc_conv;

/* One BasicConv2d of a mixed block, as tests/reference/inception.py's
 * BRANCHES table lists it: the branch name (the key after the block's),
 * kernel, stride, padding, and what feeds it. A conv that feeds no later
 * one ends its branch and writes the next channel slice of the block
 * output, in table order. */
enum { FROM_X = -1, FROM_POOL = -2 }; /* the block input; the pooled block input */

typedef struct inc_conv_spec {
    const char *branch;
    int kh, kw, stride, ph, pw;
    int from; /* FROM_X, FROM_POOL, or the index of the conv that feeds this one */
} inc_conv_spec;

#define INC_MAX_CONVS 10

typedef struct inc_block_kind {
    int n_convs;
    inc_conv_spec conv[INC_MAX_CONVS];
    int pool_max;     /* FROM_POOL pools 3x3 s1 p1: max (FIDInceptionE_2) or average */
    int max_pool_out; /* the last slice is a 3x3 s2 max pool of the input (InceptionB, D) */
} inc_block_kind;

/* 1x1 convs, kh x kw s1 "same" convs, k x k s2 valid convs. */
#define ONE(name, from) {name, 1, 1, 1, 0, 0, from}
#define SAME(name, kh, kw, from) {name, kh, kw, 1, (kh) / 2, (kw) / 2, from}
#define DOWN(name, k, from) {name, k, k, 2, 0, 0, from}

static const inc_block_kind KIND_A = {
    7,
    {ONE("branch1x1", FROM_X), ONE("branch5x5_1", FROM_X), SAME("branch5x5_2", 5, 5, 1),
     ONE("branch3x3dbl_1", FROM_X), SAME("branch3x3dbl_2", 3, 3, 3), SAME("branch3x3dbl_3", 3, 3, 4),
     ONE("branch_pool", FROM_POOL)},
    0, 0};
static const inc_block_kind KIND_B = {
    4,
    {DOWN("branch3x3", 3, FROM_X), ONE("branch3x3dbl_1", FROM_X), SAME("branch3x3dbl_2", 3, 3, 1),
     DOWN("branch3x3dbl_3", 3, 2)},
    0, 1};
static const inc_block_kind KIND_C = {
    10,
    {ONE("branch1x1", FROM_X), ONE("branch7x7_1", FROM_X), SAME("branch7x7_2", 1, 7, 1),
     SAME("branch7x7_3", 7, 1, 2), ONE("branch7x7dbl_1", FROM_X), SAME("branch7x7dbl_2", 7, 1, 4),
     SAME("branch7x7dbl_3", 1, 7, 5), SAME("branch7x7dbl_4", 7, 1, 6), SAME("branch7x7dbl_5", 1, 7, 7),
     ONE("branch_pool", FROM_POOL)},
    0, 0};
static const inc_block_kind KIND_D = {
    6,
    {ONE("branch3x3_1", FROM_X), DOWN("branch3x3_2", 3, 0), ONE("branch7x7x3_1", FROM_X),
     SAME("branch7x7x3_2", 1, 7, 2), SAME("branch7x7x3_3", 7, 1, 3), DOWN("branch7x7x3_4", 3, 4)},
    0, 1};
#define KIND_E_CONVS                                                                                     \
    {ONE("branch1x1", FROM_X), ONE("branch3x3_1", FROM_X), SAME("branch3x3_2a", 1, 3, 1),               \
     SAME("branch3x3_2b", 3, 1, 1), ONE("branch3x3dbl_1", FROM_X), SAME("branch3x3dbl_2", 3, 3, 4),     \
     SAME("branch3x3dbl_3a", 1, 3, 5), SAME("branch3x3dbl_3b", 3, 1, 5), ONE("branch_pool", FROM_POOL)}
static const inc_block_kind KIND_E1 = {9, KIND_E_CONVS, 0, 0};
static const inc_block_kind KIND_E2 = {9, KIND_E_CONVS, 1, 0};

#undef ONE
#undef SAME
#undef DOWN

/* Whether conv i of a block feeds a later one (else it ends its branch). */
static int feeds_another(const inc_block_kind *kind, int i) {
    for (int j = i + 1; j < kind->n_convs; j++)
        if (kind->conv[j].from == i)
            return 1;
    return 0;
}

typedef struct inc_block {
    const inc_block_kind *kind;
    inc_conv conv[INC_MAX_CONVS];
    int64_t cin, cout; /* cout: the concatenated output's width */
} inc_block;

/* The stem: convs, each possibly followed by a 3x3 s2 max pool. */
#define INC_STEM 5
static const struct {
    const char *name;
    int k, stride, pad, max_pool_after;
} STEM[INC_STEM] = {
    {"Conv2d_1a_3x3", 3, 2, 0, 0}, {"Conv2d_2a_3x3", 3, 1, 0, 0}, {"Conv2d_2b_3x3", 3, 1, 1, 1},
    {"Conv2d_3b_1x1", 1, 1, 0, 0}, {"Conv2d_4a_3x3", 3, 1, 0, 1},
};

#define INC_MIXED 11
static const struct {
    const char *name;
    const inc_block_kind *kind;
} MIXED[INC_MIXED] = {
    {"Mixed_5b", &KIND_A}, {"Mixed_5c", &KIND_A}, {"Mixed_5d", &KIND_A}, {"Mixed_6a", &KIND_B},
    {"Mixed_6b", &KIND_C}, {"Mixed_6c", &KIND_C}, {"Mixed_6d", &KIND_C}, {"Mixed_6e", &KIND_C},
    {"Mixed_7a", &KIND_D}, {"Mixed_7b", &KIND_E1}, {"Mixed_7c", &KIND_E2},
};

enum { SLOT_X, SLOT_Y, SLOT_T1, SLOT_T2, SLOT_POOL, SLOT_LOGITS, SLOT_COUNT };

struct mc_inception {
    mc_backend *be;
    mc_inception_info info;
    mc_alloc_list weights;

    inc_conv stem[INC_STEM];
    inc_block mixed[INC_MIXED];
    float *fc_w; /* [num_classes, feature_dim] */

    /* Named activation buffers (backend/workspace.h), indexed by the SLOT_
     * names: a layer's output view names the slot it writes (the pass
     * alternates X and Y as a mixed block's input and output). */
    mc_buffer buf[SLOT_COUNT];
    mc_buffer input; /* uint8 images of one chunk */
};

/* ---------------------------------------------------------------- loading */

typedef struct inc_loader {
    mc_loader loader;
    mc_err *err;
    const char *path;
    int64_t num_params;
    char (*bound)[INC_NAME_LEN];
    int64_t n_bound, cap_bound;
} inc_loader;

static mc_status note_bound(inc_loader *L, const char *name, int64_t numel) {
    /* The list keeps whole names (the unused-tensor check compares them):
     * a longer one is refused, never cut. */
    const size_t len = strlen(name);
    if (len >= INC_NAME_LEN)
        return mc_fail(L->err, MC_ERR_VALUE, "%s: tensor name '%s' is %zu bytes long, at most %d are supported",
                       L->path, name, len, INC_NAME_LEN - 1);
    if (L->n_bound == L->cap_bound) {
        int64_t cap = L->cap_bound ? 2 * L->cap_bound : 512;
        void *grown = realloc(L->bound, (size_t)cap * INC_NAME_LEN);
        if (grown == NULL)
            return mc_fail_nomem_n(L->err, (size_t)cap, INC_NAME_LEN, "Inception's list of bound names (%lld names)",
                                   (long long)cap);
        L->bound = grown;
        L->cap_bound = cap;
    }
    memcpy(L->bound[L->n_bound++], name, len + 1);
    L->num_params += numel;
    return MC_OK;
}

static mc_status read_host(inc_loader *L, const char *name, int ndim, const int64_t *shape, float *dst) {
    MC_TRY(mc_bind_host(&L->loader, name, ndim, shape, dst));
    int64_t numel = 1;
    for (int d = 0; d < ndim; d++)
        numel *= shape[d];
    return note_bound(L, name, numel);
}

/* Binds "<prefix>.conv.weight" [cout, cin, kh, kw] (cout read from the
 * file, the rest checked) and "<prefix>.bn.*" [cout]; folds BatchNorm:
 *   s = gamma / sqrt(var + eps),  w' = w * s,  b' = beta - mean * s. */
static mc_status load_conv(inc_loader *L, inc_conv *c, const char *prefix, int64_t cin, int kh,
                           int kw, int sh, int sw, int ph, int pw) {
    char name[2 * INC_NAME_LEN];
    int ndim;
    int64_t shape[8];
    snprintf(name, sizeof name, "%s.conv.weight", prefix);
    MC_TRY(mc_loader_shape(&L->loader, name, &ndim, shape));
    if (ndim != 4 || shape[0] <= 0 || shape[1] != cin || shape[2] != kh || shape[3] != kw)
        return mc_fail(L->err, MC_ERR_VALUE,
                       "%s: key '%s' has shape [%lld, %lld, %lld, %lld] (rank %d), expected "
                       "[C_out, %lld, %d, %d] (the FID-Inception layout)",
                       L->path, name, (long long)(ndim > 0 ? shape[0] : 0),
                       (long long)(ndim > 1 ? shape[1] : 0), (long long)(ndim > 2 ? shape[2] : 0),
                       (long long)(ndim > 3 ? shape[3] : 0), ndim, (long long)cin, kh, kw);
    const int64_t cout = shape[0];
    const int64_t taps = (int64_t)kh * kw * cin;
    c->cin = cin;
    c->cout = cout;
    c->kh = kh;
    c->kw = kw;
    c->sh = sh;
    c->sw = sw;
    c->ph = ph;
    c->pw = pw;

    size_t wfloats = (size_t)(cout * taps);
    float *host = malloc((2 * wfloats + 4 * (size_t)cout) * sizeof(float));
    if (host == NULL)
        return mc_fail_nomem_n(L->err, 2 * wfloats + 4 * (size_t)cout, sizeof(float),
                               "Inception's host copy of '%s' to fold its BatchNorm into", name);
    float *w = host, *packed = host + wfloats, *bn = packed + wfloats;
    float *gamma = bn, *beta = bn + cout, *mean = bn + 2 * cout, *var = bn + 3 * cout;
    mc_status st = read_host(L, name, 4, shape, w);
    static const char *const bn_names[4] = {"weight", "bias", "running_mean", "running_var"};
    for (int i = 0; i < 4 && st == MC_OK; i++) {
        snprintf(name, sizeof name, "%s.bn.%s", prefix, bn_names[i]);
        st = read_host(L, name, 1, (int64_t[]){cout}, bn + i * cout);
    }
    float *bias = gamma; /* reuse: the folded bias overwrites gamma after use */
    for (int64_t o = 0; o < cout && st == MC_OK; o++) {
        double v = (double)var[o] + MC_INCEPTION_BN_EPS;
        if (!(v > 0.0) || !isfinite((double)var[o]))
            st = mc_fail(L->err, MC_ERR_VALUE,
                         "%s: key '%s.bn.running_var' has entry %lld = %g: a variance must be "
                         ">= 0 and finite",
                         L->path, prefix, (long long)o, (double)var[o]);
        if (st != MC_OK)
            break;
        double s = (double)gamma[o] / sqrt(v);
        for (int64_t i = 0; i < cin; i++)
            for (int y = 0; y < kh; y++)
                for (int x = 0; x < kw; x++)
                    packed[((o * kh + y) * kw + x) * cin + i] =
                        (float)((double)w[((o * cin + i) * kh + y) * kw + x] * s);
        bias[o] = (float)((double)beta[o] - (double)mean[o] * s);
    }
    if (st == MC_OK)
        st = mc_loader_upload(&L->loader, packed, wfloats, &c->w, "the folded weight of %s", prefix);
    if (st == MC_OK)
        st = mc_loader_upload(&L->loader, bias, (size_t)cout, &c->b, "the folded bias of %s", prefix);
    free(host);
    return st;
}

/* Every conv of a mixed block, its input widths from its feeders'. */
static mc_status load_block(inc_loader *L, inc_block *m, const inc_block_kind *kind, const char *name,
                            int64_t cin) {
    m->kind = kind;
    m->cin = cin;
    m->cout = kind->max_pool_out ? cin : 0;
    for (int i = 0; i < kind->n_convs; i++) {
        const inc_conv_spec *s = &kind->conv[i];
        char prefix[INC_NAME_LEN];
        snprintf(prefix, sizeof prefix, "%s.%s", name, s->branch);
        const int64_t in = s->from >= 0 ? m->conv[s->from].cout : cin;
        MC_TRY(load_conv(L, &m->conv[i], prefix, in, s->kh, s->kw, s->stride, s->stride, s->ph, s->pw));
        if (!feeds_another(kind, i))
            m->cout += m->conv[i].cout;
    }
    return MC_OK;
}

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* Every tensor of the file must have been read, except BatchNorm's
 * num_batches_tracked counters: anything else means another network
 * (torchvision's ImageNet Inception, for one, has AuxLogits.*). */
static mc_status check_nothing_left(const mc_st_file *file, inc_loader *L) {
    for (int64_t i = 0; i < file->n_tensors; i++) {
        const char *name = file->tensors[i].name;
        if (ends_with(name, ".num_batches_tracked"))
            continue;
        int found = 0;
        for (int64_t j = 0; j < L->n_bound && !found; j++)
            found = strcmp(L->bound[j], name) == 0;
        if (!found)
            return mc_fail(L->err, MC_ERR_VALUE,
                           "%s: unexpected tensor '%s': not part of the FID-Inception layout "
                           "(pytorch-fid fid_inception_v3 state_dict names; torchvision's ImageNet "
                           "Inception v3 is a different network)",
                           L->path, name);
    }
    return MC_OK;
}

/* The output width of the conv named `branch` in block m (0 if none). */
static int64_t branch_width(const inc_block *m, const char *branch) {
    for (int i = 0; i < m->kind->n_convs; i++)
        if (strcmp(m->kind->conv[i].branch, branch) == 0)
            return m->conv[i].cout;
    return 0;
}

/* Widths of the real network, to tell a test-sized one apart. */
static int is_standard(const mc_inception *net) {
    return net->stem[0].cout == 32 && net->stem[1].cout == 32 && net->stem[2].cout == 64 &&
           net->stem[3].cout == 80 && net->stem[4].cout == 192 &&
           branch_width(&net->mixed[0], "branch_pool") == 32 && branch_width(&net->mixed[1], "branch_pool") == 64 &&
           branch_width(&net->mixed[4], "branch7x7_1") == 128 && branch_width(&net->mixed[5], "branch7x7_1") == 160 &&
           branch_width(&net->mixed[7], "branch7x7_1") == 192 && branch_width(&net->mixed[8], "branch3x3_2") == 320 &&
           net->info.feature_dim == 2048 && net->info.num_classes == 1008;
}

static mc_status load_all(inc_loader *L, mc_inception *net) {
    int64_t c = 3;
    for (int i = 0; i < INC_STEM; i++) {
        MC_TRY(load_conv(L, &net->stem[i], STEM[i].name, c, STEM[i].k, STEM[i].k, STEM[i].stride,
                         STEM[i].stride, STEM[i].pad, STEM[i].pad));
        c = net->stem[i].cout;
    }
    for (int i = 0; i < INC_MIXED; i++) {
        MC_TRY(load_block(L, &net->mixed[i], MIXED[i].kind, MIXED[i].name, c));
        c = net->mixed[i].cout;
    }
    net->info.feature_dim = c;

    int ndim;
    int64_t shape[8];
    MC_TRY(mc_loader_shape(&L->loader, "fc.weight", &ndim, shape));
    if (ndim != 2 || shape[0] <= 0 || shape[1] != c)
        return mc_fail(L->err, MC_ERR_VALUE,
                       "%s: key 'fc.weight' must have shape [num_classes, %lld] (Mixed_7c's "
                       "width), got rank %d [%lld, ...]",
                       L->path, (long long)c, ndim, (long long)(ndim > 0 ? shape[0] : 0));
    net->info.num_classes = shape[0];
    MC_TRY(mc_bind(&L->loader, "fc.weight", 2, shape, MC_BIND_AS_IS, &net->fc_w));
    MC_TRY(note_bound(L, "fc.weight", shape[0] * shape[1]));
    /* The bias is not used (IS takes the unbiased logits) but must be there:
     * its absence would mean another layout. */
    int64_t bias_shape[1] = {shape[0]};
    const mc_st_tensor *t = mc_st_find(L->loader.file, "fc.bias");
    if (t == NULL || t->ndim != 1 || t->shape[0] != bias_shape[0])
        return mc_fail(L->err, t == NULL ? MC_ERR_KEY : MC_ERR_VALUE,
                       "%s: key 'fc.bias' %s (expected shape [%lld])", L->path,
                       t == NULL ? "is missing" : "has the wrong shape", (long long)bias_shape[0]);
    return note_bound(L, "fc.bias", bias_shape[0]);
}

/* ---------------------------------------------------------------- forward */

/* A place in one of the slots: column `col` of rows `ld` floats apart. */
typedef struct inc_view {
    int slot;
    int64_t col, ld;
} inc_view;

static inc_view view(int slot, int64_t col, int64_t ld) {
    inc_view v = {slot, col, ld};
    return v;
}

/* A pass over one chunk. In plan mode nothing runs: each op only records
 * how many floats its output slot needs, and the FLOPs of one image. */
typedef struct inc_run {
    mc_inception *net;
    int plan;
    int64_t batch;
    size_t need[SLOT_COUNT];
    double flops;
    int (*cancel)(void *);
    void *cancel_ctx;
    mc_err *err;
} inc_run;

static float *at(inc_run *r, inc_view v) { return (float *)r->net->buf[v.slot].data + v.col; }

static void record(inc_run *r, inc_view out, int64_t pixels) {
    size_t floats = (size_t)(r->batch * pixels * out.ld);
    if (floats > r->need[out.slot])
        r->need[out.slot] = floats;
}

static mc_status conv(inc_run *r, const inc_conv *c, inc_view in, int64_t h, int64_t w,
                      inc_view out, int64_t *oh, int64_t *ow) {
    mc_window2d g = {.batch = r->batch, .height = h, .width = w, .kh = c->kh, .kw = c->kw,
                     .stride_h = c->sh, .stride_w = c->sw, .pad_h = c->ph, .pad_w = c->pw};
    *oh = mc_window_out_h(&g);
    *ow = mc_window_out_w(&g);
    if (*oh < 1 || *ow < 1)
        return mc_fail(r->err, MC_ERR_INTERNAL, "Inception: a %dx%d conv does not fit %lldx%lld",
                       c->kh, c->kw, (long long)h, (long long)w);
    if (r->plan) {
        record(r, out, *oh * *ow);
        r->flops += 2.0 * (double)(*oh * *ow) * (double)c->cout * (double)(c->kh * c->kw) *
                    (double)c->cin;
        return MC_OK;
    }
    mc_backend *be = r->net->be;
    return be->ops->conv2d_ex(be, &g, at(r, in), c->cin, in.ld, c->w, c->b, c->cout, 0.0f, 1,
                              at(r, out), out.ld, r->err);
}

/* 3x3 pool: max (stride 1 pad 1 or stride 2 valid) or average (stride 1 pad
 * 1, padding not counted). */
static mc_status pool(inc_run *r, int is_max, int stride, inc_view in, int64_t channels, int64_t h,
                      int64_t w, inc_view out, int64_t *oh, int64_t *ow) {
    int pad = stride == 1 ? 1 : 0;
    mc_window2d g = {.batch = r->batch, .height = h, .width = w, .kh = 3, .kw = 3,
                     .stride_h = stride, .stride_w = stride, .pad_h = pad, .pad_w = pad};
    *oh = mc_window_out_h(&g);
    *ow = mc_window_out_w(&g);
    if (r->plan) {
        record(r, out, *oh * *ow);
        return MC_OK;
    }
    mc_backend *be = r->net->be;
    if (is_max)
        return be->ops->max_pool2d(be, &g, at(r, in), channels, in.ld, at(r, out), out.ld, r->err);
    return be->ops->avg_pool2d(be, &g, at(r, in), channels, in.ld, 0, at(r, out), out.ld, r->err);
}

static mc_status check_cancel(inc_run *r) {
    if (!r->plan && r->cancel != NULL && r->cancel(r->cancel_ctx))
        return mc_fail(r->err, MC_ERR_INTERRUPTED, "Inception was interrupted");
    return MC_OK;
}

/* A mixed block reads x (slot xs, contiguous, m->cin channels) at h x w and
 * writes its concatenation into slot ys (contiguous, m->cout channels),
 * each branch's last conv straight into its channel slice, updating h and
 * w. Intermediates alternate between the temporaries: a conv fed from T1
 * writes T2, any other T1 (the pooled input of branch_pool is in T1). */
static mc_status run_block(inc_run *r, const inc_block *m, int xs, int ys, int64_t *h, int64_t *w) {
    const inc_block_kind *kind = m->kind;
    const inc_view x = view(xs, 0, m->cin);
    int64_t oh[INC_MAX_CONVS], ow[INC_MAX_CONVS], col = 0, out_h = 0, out_w = 0;
    int slot[INC_MAX_CONVS];
    for (int i = 0; i < kind->n_convs; i++) {
        const inc_conv_spec *s = &kind->conv[i];
        inc_view in = x;
        int64_t ih = *h, iw = *w;
        if (s->from == FROM_POOL) {
            in = view(SLOT_T1, 0, m->cin);
            MC_TRY(pool(r, kind->pool_max, 1, x, m->cin, *h, *w, in, &ih, &iw));
        } else if (s->from >= 0) {
            in = view(slot[s->from], 0, m->conv[s->from].cout);
            ih = oh[s->from];
            iw = ow[s->from];
        }
        const int ends_branch = !feeds_another(kind, i);
        slot[i] = in.slot == SLOT_T1 ? SLOT_T2 : SLOT_T1;
        const inc_view out = ends_branch ? view(ys, col, m->cout) : view(slot[i], 0, m->conv[i].cout);
        MC_TRY(conv(r, &m->conv[i], in, ih, iw, out, &oh[i], &ow[i]));
        if (ends_branch) {
            col += m->conv[i].cout;
            out_h = oh[i];
            out_w = ow[i];
        }
    }
    if (kind->max_pool_out)
        MC_TRY(pool(r, 1, 2, x, m->cin, *h, *w, view(ys, col, m->cout), &out_h, &out_w));
    *h = out_h;
    *w = out_w;
    return MC_OK;
}

/* The network from the resized input in SLOT_X to the pooled features in
 * SLOT_POOL and the unbiased logits in SLOT_LOGITS. Every layer reads one of
 * X and Y and writes the other; c is the running width. */
static mc_status run_network(inc_run *r) {
    mc_inception *net = r->net;
    int64_t h = MC_INCEPTION_SIZE, w = MC_INCEPTION_SIZE, c = 3;
    int cur = SLOT_X, nxt = SLOT_Y;
#define SWAP_SLOTS()       \
    do {                   \
        int t_ = cur;      \
        cur = nxt;         \
        nxt = t_;          \
    } while (0)
    if (r->plan)
        record(r, view(SLOT_X, 0, 3), h * w);
    for (int i = 0; i < INC_STEM; i++) {
        const inc_conv *cv = &net->stem[i];
        MC_TRY(conv(r, cv, view(cur, 0, c), h, w, view(nxt, 0, cv->cout), &h, &w));
        c = cv->cout;
        SWAP_SLOTS();
        if (STEM[i].max_pool_after) {
            MC_TRY(pool(r, 1, 2, view(cur, 0, c), c, h, w, view(nxt, 0, c), &h, &w));
            SWAP_SLOTS();
        }
    }
    MC_TRY(check_cancel(r));
    for (int i = 0; i < INC_MIXED; i++) {
        MC_TRY(run_block(r, &net->mixed[i], cur, nxt, &h, &w));
        c = net->mixed[i].cout;
        SWAP_SLOTS();
        MC_TRY(check_cancel(r));
    }
#undef SWAP_SLOTS

    /* Global average pool (the window is the whole h x w map), then fc
     * without bias. */
    const int64_t f = net->info.feature_dim, k = net->info.num_classes;
    if (r->plan) {
        record(r, view(SLOT_POOL, 0, f), 1);
        record(r, view(SLOT_LOGITS, 0, k), 1);
        r->flops += 2.0 * (double)f * (double)k;
        return MC_OK;
    }
    mc_backend *be = net->be;
    mc_window2d g = {.batch = r->batch, .height = h, .width = w, .kh = (int)h, .kw = (int)w,
                     .stride_h = 1, .stride_w = 1, .pad_h = 0, .pad_w = 0};
    MC_TRY(be->ops->avg_pool2d(be, &g, (float *)net->buf[cur].data, c, c, 0, (float *)net->buf[SLOT_POOL].data, f, r->err));
    return be->ops->linear(be, (float *)net->buf[SLOT_POOL].data, f, r->batch, f, net->fc_w, NULL, k, MC_ACT_NONE,
                           0.0f, (float *)net->buf[SLOT_LOGITS].data, k, r->err);
}

static mc_status allocate_buffers(mc_inception *net, const size_t *need, mc_err *err) {
    static const char *const slot_names[SLOT_COUNT] = {"inception.x", "inception.y", "inception.t1",
                                                       "inception.t2", "inception.pool", "inception.logits"};
    for (int s = 0; s < SLOT_COUNT; s++) {
        /* the buffer's name carries the hint: a smaller chunk needs less */
        char what[96];
        snprintf(what, sizeof what, "%s (activations of %lld images per chunk: use a smaller chunk)", slot_names[s],
                 (long long)net->info.chunk);
        if (mc_buffer_floats(net->be, &net->buf[s], need[s], what, err) == NULL)
            return err->status;
    }
    return MC_OK;
}

mc_status mc_inception_load(mc_backend *be, const mc_st_file *file, int64_t chunk,
                            mc_inception **out, mc_err *err) {
    *out = NULL;
    if (chunk < 1 || chunk > 4096)
        return mc_fail(err, MC_ERR_VALUE, "Inception: chunk must be in 1..4096 images, got %lld",
                       (long long)chunk);
    mc_inception *net = calloc(1, sizeof *net);
    if (net == NULL)
        return mc_fail_nomem(err, sizeof *net, "the Inception model struct");
    net->be = be;
    net->info.chunk = chunk;

    inc_loader L = {.err = err, .path = file->path != NULL ? file->path : "<memory>"};
    mc_loader_init(&L.loader, file, be, err);
    mc_status st = MC_OK;
    if (!mc_loader_has(&L.loader, "Conv2d_1a_3x3.conv.weight"))
        st = mc_fail(err, MC_ERR_VALUE,
                     "%s is not an FID-Inception checkpoint: it has no tensor "
                     "'Conv2d_1a_3x3.conv.weight' (convert pt_inception-2015-12-05-6726825d.pth "
                     "with its pytorch-fid key names)",
                     L.path);
    if (st == MC_OK)
        st = load_all(&L, net);
    if (st == MC_OK)
        st = check_nothing_left(file, &L);
    if (st == MC_OK) {
        net->info.num_params = L.num_params;
        net->weights = mc_loader_take_allocations(&L.loader);
    }
    mc_loader_finish(&L.loader);
    free(L.bound);
    if (st == MC_OK) {
        net->info.standard = is_standard(net);
        inc_run plan = {.net = net, .plan = 1, .batch = chunk, .err = err};
        st = run_network(&plan);
        if (st == MC_OK)
            st = allocate_buffers(net, plan.need, err);
        if (st == MC_OK)
            net->info.flops_per_image = plan.flops; /* conv() and the fc count one image */
    }
    if (st != MC_OK) {
        mc_inception_free(net);
        return st;
    }
    *out = net;
    return MC_OK;
}

void mc_inception_free(mc_inception *net) {
    if (net == NULL)
        return;
    mc_buffers_release(net->be, net->buf, SLOT_COUNT);
    mc_buffer_release(net->be, &net->input);
    mc_alloc_list_free(&net->weights, net->be);
    free(net);
}

void mc_inception_get_info(const mc_inception *net, mc_inception_info *info) { *info = net->info; }

mc_status mc_inception_forward(mc_inception *net, const uint8_t *images, int64_t n, int64_t height,
                               int64_t width, float *pool_out, float *logits_out,
                               int (*cancel)(void *ctx), void *cancel_ctx, mc_err *err) {
    if (n < 0 || height < 1 || width < 1 || height > MC_INCEPTION_MAX_SIDE ||
        width > MC_INCEPTION_MAX_SIDE)
        return mc_fail(err, MC_ERR_VALUE,
                       "Inception: images must be [n >= 0, 1..%d, 1..%d, 3], got [%lld, %lld, %lld, 3]",
                       MC_INCEPTION_MAX_SIDE, MC_INCEPTION_MAX_SIDE, (long long)n,
                       (long long)height, (long long)width);
    if (n == 0)
        return MC_OK;
    mc_backend *be = net->be;
    const int64_t chunk = net->info.chunk;
    const size_t image_bytes = (size_t)(height * width * 3);
    const size_t need = (size_t)chunk * image_bytes;
    uint8_t *input = mc_buffer_reserve(be, &net->input, need, 1, "inception.input", err);
    if (input == NULL)
        return err->status; /* mc_buffer_reserve named it and its size */
    const int64_t f = net->info.feature_dim, k = net->info.num_classes;
    for (int64_t i0 = 0; i0 < n; i0 += chunk) {
        if (cancel != NULL && cancel(cancel_ctx))
            return mc_fail(err, MC_ERR_INTERRUPTED, "Inception was interrupted");
        const int64_t b = n - i0 < chunk ? n - i0 : chunk;
        MC_TRY(be->ops->upload(be, input, images + (size_t)i0 * image_bytes,
                               (size_t)b * image_bytes, err));
        MC_TRY(be->ops->resize_bilinear_tf1(be, input, MC_PIXEL_U8, b, height, width, 3,
                                            MC_INCEPTION_SIZE, MC_INCEPTION_SIZE, 1,
                                            (float *)net->buf[SLOT_X].data, err));
        inc_run r = {.net = net, .plan = 0, .batch = b, .cancel = cancel, .cancel_ctx = cancel_ctx,
                     .err = err};
        MC_TRY(run_network(&r));
        MC_TRY(be->ops->download(be, pool_out + i0 * f, (float *)net->buf[SLOT_POOL].data,
                                 (size_t)(b * f) * sizeof(float), err));
        if (logits_out != NULL)
            MC_TRY(be->ops->download(be, logits_out + i0 * k, (float *)net->buf[SLOT_LOGITS].data,
                                     (size_t)(b * k) * sizeof(float), err));
    }
    return MC_OK;
}

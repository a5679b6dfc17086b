/* VAR transformer (var_fastvar.md Part A) on the backend op table: loading,
 * the run's conditioning, scale inputs, the two sublayers of a block, the
 * KV cache and the logits. */
#include "var.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../io/bind_shorthand.h"

/* All LayerNorms of VAR: no affine, eps 1e-6 (A1 norm_eps). */
#define VAR_LN_EPS 1e-6f
/* Rows of the FFN hidden activation held at once: bounds its memory at
 * large batches (B' * 256 rows of 4C) while keeping the GEMMs large. */
#define VAR_FFN_CHUNK_ROWS 4096

/* ---------------------------------------------------------------- workspace */

/* The activation members in mc_var_acts order, and their sizes for S
 * sequences of R rows (llm.c's fill_in_activation_sizes). */
static void act_members(mc_var_acts *a, float **members[MC_VAR_NUM_ACTS]) {
    float **list[MC_VAR_NUM_ACTS] = {&a->cond, &a->cond_silu, &a->block_mod, &a->head_mod, &a->x, &a->normed,
                                     &a->qkv,  &a->attn,      &a->sub,       &a->hidden,   &a->logits};
    memcpy(members, list, sizeof list);
}

static void index_members(mc_var_index_acts *a, int32_t **members[MC_VAR_NUM_INDEX_ACTS]) {
    int32_t **list[MC_VAR_NUM_INDEX_ACTS] = {&a->labels, &a->rows, &a->kv_slots};
    memcpy(members, list, sizeof list);
}

static void fill_in_sizes(const mc_var_config *c, int64_t S, int64_t R, size_t act[MC_VAR_NUM_ACTS],
                          size_t idx[MC_VAR_NUM_INDEX_ACTS]) {
    const int64_t C = c->width, rows = S * R;
    const int64_t chunk = rows < VAR_FFN_CHUNK_ROWS ? rows : VAR_FFN_CHUNK_ROWS;
    const size_t sizes[MC_VAR_NUM_ACTS] = {
        (size_t)(S * C),                  /* cond */
        (size_t)(S * C),                  /* cond_silu */
        (size_t)(c->depth * S * 6 * C),   /* block_mod */
        (size_t)(S * 2 * C),              /* head_mod */
        (size_t)(rows * C),               /* x */
        (size_t)(rows * C),               /* normed */
        (size_t)(rows * 3 * C),           /* qkv */
        (size_t)(rows * C),               /* attn */
        (size_t)(rows * C),               /* sub */
        (size_t)(chunk * c->ffn_hidden),  /* hidden */
        (size_t)(rows * c->vocab),        /* logits */
    };
    memcpy(act, sizes, sizeof sizes);
    idx[0] = (size_t)S;
    idx[1] = (size_t)rows;
    idx[2] = (size_t)rows;
}

/* A backend buffer of `count` elements of `elem` bytes replacing *slot when
 * *have < count (grow-only; contents are not kept). */
static mc_status grow(mc_backend *be, void **slot, size_t *have, size_t count, size_t elem, const char *what,
                      mc_err *err) {
    if (*have >= count && *slot != NULL)
        return MC_OK;
    size_t bytes;
    if (mc_mul_overflows(count > 0 ? count : 1, elem, &bytes))
        return mc_fail_nomem_n(err, count, elem, "VAR's %s", what);
    char named[96];
    snprintf(named, sizeof named, "VAR's %s", what);
    void *fresh = be->ops->alloc(be, bytes, named, err);
    if (fresh == NULL)
        return err->status;
    if (*slot != NULL)
        be->ops->release(be, *slot);
    *slot = fresh;
    *have = count;
    return MC_OK;
}

mc_status mc_var_reserve(mc_var *var, int64_t n_seq, int64_t max_rows, mc_err *err) {
    mc_backend *be = var->backend;
    const mc_var_config *c = &var->config;
    if (n_seq <= 0 || max_rows <= 0 || max_rows > c->tokens)
        return mc_fail(err, MC_ERR_INTERNAL, "VAR workspace: %lld sequences of %lld rows", (long long)n_seq,
                       (long long)max_rows);
    /* Sizes never shrink: a smaller run keeps the larger buffers. */
    const int64_t S = n_seq > var->acts_seq ? n_seq : var->acts_seq;
    const int64_t R = max_rows > var->acts_rows ? max_rows : var->acts_rows;
    size_t act[MC_VAR_NUM_ACTS], idx[MC_VAR_NUM_INDEX_ACTS];
    fill_in_sizes(c, S, R, act, idx);
    float **members[MC_VAR_NUM_ACTS];
    act_members(&var->acts, members);
    for (int i = 0; i < MC_VAR_NUM_ACTS; i++)
        MC_TRY(grow(be, (void **)members[i], &var->act_floats[i], act[i], sizeof(float), "activations", err));
    int32_t **index[MC_VAR_NUM_INDEX_ACTS];
    index_members(&var->index_acts, index);
    for (int i = 0; i < MC_VAR_NUM_INDEX_ACTS; i++)
        MC_TRY(grow(be, (void **)index[i], &var->index_act_count[i], idx[i], sizeof(int32_t), "index lists",
                    err));
    var->acts_seq = S;
    var->acts_rows = R;
    var->slots_seq = -1; /* the slot list may have moved */
    /* KV cache: [S, L, C] per block, laid out for exactly S sequences (the
     * sequence stride is L * C whatever S is, so only its total grows). */
    const size_t kv = (size_t)(S * c->tokens * c->width);
    for (int64_t b = 0; b < c->depth; b++) {
        size_t have_k = var->kv_floats, have_v = var->kv_floats;
        MC_TRY(grow(be, (void **)&var->k_cache[b], &have_k, kv, sizeof(float), "KV cache", err));
        MC_TRY(grow(be, (void **)&var->v_cache[b], &have_v, kv, sizeof(float), "KV cache", err));
    }
    if (kv > var->kv_floats)
        var->kv_floats = kv;
    var->kv_seq = S;
    return MC_OK;
}

float *mc_var_k_cache(mc_var *var, int block) { return var->k_cache[block]; }
float *mc_var_v_cache(mc_var *var, int block) { return var->v_cache[block]; }

static void free_workspace(mc_var *var) {
    mc_backend *be = var->backend;
    float **members[MC_VAR_NUM_ACTS];
    act_members(&var->acts, members);
    for (int i = 0; i < MC_VAR_NUM_ACTS; i++)
        if (*members[i] != NULL)
            be->ops->release(be, *members[i]);
    int32_t **index[MC_VAR_NUM_INDEX_ACTS];
    index_members(&var->index_acts, index);
    for (int i = 0; i < MC_VAR_NUM_INDEX_ACTS; i++)
        if (*index[i] != NULL)
            be->ops->release(be, *index[i]);
    for (int64_t b = 0; var->k_cache != NULL && b < var->config.depth; b++) {
        if (var->k_cache[b] != NULL)
            be->ops->release(be, var->k_cache[b]);
        if (var->v_cache[b] != NULL)
            be->ops->release(be, var->v_cache[b]);
    }
}

/* ---------------------------------------------------------------- loading */

int mc_var_parse_patch_nums(const char *text, int64_t nums[MC_VAR_MAX_SCALES]) {
    int count = 0;
    const char *p = text;
    for (;;) {
        if (*p < '0' || *p > '9' || count == MC_VAR_MAX_SCALES)
            return 0;
        int64_t v = 0;
        while (*p >= '0' && *p <= '9') {
            v = v * 10 + (*p - '0');
            if (v > 1000000)
                return 0;
            p++;
        }
        if (v <= 0)
            return 0;
        nums[count++] = v;
        if (*p == '\0')
            return count;
        if (*p != ',')
            return 0;
        p++;
    }
}

static mc_status shape_of(mc_loader *ld, const char *key, int ndim, int64_t shape[8]) {
    int got;
    MC_TRY(mc_loader_shape(ld, key, &got, shape));
    if (got != ndim)
        return mc_fail(ld->err, MC_ERR_VALUE, "%s: key '%s' must have %d dimensions, has %d", ld->file->path, key,
                       ndim, got);
    return MC_OK;
}

static mc_status missing_scale_mul(mc_loader *ld, int block) {
    return mc_fail(ld->err, MC_ERR_KEY,
                   "%s: key 'blocks.%d.attn.scale_mul_1H11' is missing: marcache runs VAR models built with "
                   "attn_l2_norm=True (the released d16/d20/d24/d30 checkpoints have the key; older "
                   "checkpoints lack it, see FoundationVision/VAR issue #38)",
                   ld->file->path, block);
}

static mc_status read_config(mc_loader *ld, mc_var_config *c) {
    const mc_st_file *file = ld->file;
    mc_err *err = ld->err;
    int64_t shape[8];
    if (!mc_loader_has(ld, "word_embed.weight") || !mc_loader_has(ld, "lvl_embed.weight")) {
        if (mc_loader_has(ld, "diffloss.net.input_proj.weight"))
            return mc_fail(err, MC_ERR_VALUE, "%s is a MAR checkpoint, not a VAR model", file->path);
        if (mc_loader_has(ld, "quantize.embedding.weight"))
            return mc_fail(err, MC_ERR_VALUE, "%s is a VQVAE file, not a VAR model: pass it as vae=...",
                           file->path);
        if (mc_loader_has(ld, "decoder.conv_in.weight"))
            return mc_fail(err, MC_ERR_VALUE, "%s is a VAE file, not a VAR model", file->path);
        return mc_fail(err, MC_ERR_VALUE,
                       "%s is not a VAR checkpoint: keys 'word_embed.weight' and 'lvl_embed.weight' are missing",
                       file->path);
    }
    MC_TRY(shape_of(ld, "class_emb.weight", 2, shape));
    c->num_classes = shape[0] - 1;
    c->width = shape[1];
    if (c->num_classes < 1)
        return mc_fail(err, MC_ERR_VALUE, "%s: 'class_emb.weight' needs at least 2 rows (classes and the null "
                       "class), has %lld", file->path, (long long)shape[0]);
    MC_TRY(shape_of(ld, "word_embed.weight", 2, shape));
    c->vae_channels = shape[1];
    MC_TRY(shape_of(ld, "head.weight", 2, shape));
    c->vocab = shape[0];
    MC_TRY(shape_of(ld, "pos_1LC", 3, shape));
    c->tokens = shape[1];
    MC_TRY(shape_of(ld, "lvl_embed.weight", 2, shape));
    const int64_t levels = shape[0];
    for (c->depth = 0;; c->depth++) {
        char name[96];
        snprintf(name, sizeof name, "blocks.%lld.ada_lin.1.weight", (long long)c->depth);
        if (!mc_loader_has(ld, name))
            break;
    }
    if (c->depth == 0)
        return mc_fail(err, MC_ERR_VALUE, "%s: no transformer blocks (key 'blocks.0.ada_lin.1.weight' is missing)",
                       file->path);
    if (!mc_loader_has(ld, "blocks.0.attn.scale_mul_1H11"))
        return missing_scale_mul(ld, 0);
    MC_TRY(shape_of(ld, "blocks.0.attn.scale_mul_1H11", 4, shape));
    c->heads = shape[1];
    if (c->heads <= 0 || c->width % c->heads != 0)
        return mc_fail(err, MC_ERR_VALUE, "%s: width %lld is not divisible by the %lld heads of "
                       "'blocks.0.attn.scale_mul_1H11'", file->path, (long long)c->width, (long long)c->heads);
    c->head_dim = c->width / c->heads;
    MC_TRY(shape_of(ld, "blocks.0.ffn.fc1.weight", 2, shape));
    c->ffn_hidden = shape[0];
    const mc_shape_size sizes[] = {{"width", "class_emb.weight", c->width},
                                   {"latent channel count", "word_embed.weight", c->vae_channels},
                                   {"vocabulary", "head.weight", c->vocab},
                                   {"FFN hidden size", "blocks.0.ffn.fc1.weight", c->ffn_hidden}};
    MC_TRY(mc_loader_check_sizes(ld, sizes, sizeof sizes / sizeof sizes[0]));

    const char *meta = mc_st_metadata(file, "patch_nums");
    const char *text = meta != NULL ? meta : MC_VAR_DEFAULT_PATCH_NUMS;
    c->n_scales = mc_var_parse_patch_nums(text, c->patch_nums);
    if (c->n_scales == 0)
        return mc_fail(err, MC_ERR_VALUE, "%s: metadata 'patch_nums' = '%s' is not a list of 1 to %d positive "
                       "integers separated by commas", file->path, text, MC_VAR_MAX_SCALES);
    int64_t total = 0;
    for (int i = 0; i < c->n_scales; i++) {
        c->scale_begin[i] = total;
        total += c->patch_nums[i] * c->patch_nums[i];
    }
    c->scale_begin[c->n_scales] = total;
    if (levels != c->n_scales || total != c->tokens)
        return mc_fail(err, MC_ERR_VALUE,
                       "%s: patch_nums %s (%s) gives %d scales of %lld tokens in all, but 'lvl_embed.weight' has "
                       "%lld rows and 'pos_1LC' %lld tokens%s",
                       file->path, text, meta != NULL ? "from the file's metadata" : "the released models' default",
                       c->n_scales, (long long)total, (long long)levels, (long long)c->tokens,
                       meta != NULL ? "" : ": add metadata 'patch_nums' for other models");
    return MC_OK;
}

/* exp(min(v, ln 100)) as the official code computes it in float32: the cap
 * is torch.log(torch.tensor(100)).item(), i.e. ln 100 rounded to float32
 * (4.60517025, 6.4e-8 above ln 100), so a capped head scale is
 * float32(exp(4.60517025)) = 100.0000076, one float32 step above 100. exp
 * is taken in double and rounded once (a correctly rounded expf). */
static float head_scale_of(float scale_mul) {
    const float cap = (float)log(100.0);
    const float v = scale_mul < cap ? scale_mul : cap;
    return (float)exp((double)v);
}

static mc_status bind_block(mc_loader *ld, const mc_var_config *c, int i, mc_var_block *b, float *host) {
    const int64_t C = c->width, F = c->ffn_hidden, H = c->heads;
    char name[96];
    snprintf(name, sizeof name, "blocks.%d.attn.scale_mul_1H11", i);
    if (!mc_loader_has(ld, name))
        return missing_scale_mul(ld, i);
    /* host: [3C] qkv bias, then [H] scale_mul */
    float *bias = host, *scale_mul = host + 3 * C;
    MC_TRY(mc_bind_host(ld, name, 4, SHAPE(1, H, 1, 1), scale_mul));
    for (int64_t h = 0; h < H; h++)
        scale_mul[h] = head_scale_of(scale_mul[h]);
    MC_TRY(mc_loader_upload(ld, scale_mul, (size_t)H, &b->head_scale, "block %d's head scales", i));
    /* The Linear has no bias; the official forward adds cat(q_bias, zeros, v_bias). */
    snprintf(name, sizeof name, "blocks.%d.attn.q_bias", i);
    MC_TRY(mc_bind_host(ld, name, 1, SHAPE(C), bias));
    memset(bias + C, 0, (size_t)C * sizeof(float));
    snprintf(name, sizeof name, "blocks.%d.attn.v_bias", i);
    MC_TRY(mc_bind_host(ld, name, 1, SHAPE(C), bias + 2 * C));
    MC_TRY(mc_loader_upload(ld, bias, (size_t)(3 * C), &b->qkv_b, "block %d's qkv bias", i));
    LBIND(b->qkv_w, 3 * C, C, "blocks.%d.attn.mat_qkv.weight", i);
    LBIND(b->proj_w, C, C, "blocks.%d.attn.proj.weight", i);
    BINDF(b->proj_b, (C), "blocks.%d.attn.proj.bias", i);
    LBIND(b->fc1_w, F, C, "blocks.%d.ffn.fc1.weight", i);
    BINDF(b->fc1_b, (F), "blocks.%d.ffn.fc1.bias", i);
    LBIND(b->fc2_w, C, F, "blocks.%d.ffn.fc2.weight", i);
    BINDF(b->fc2_b, (C), "blocks.%d.ffn.fc2.bias", i);
    LBIND(b->ada_w, 6 * C, C, "blocks.%d.ada_lin.1.weight", i);
    BINDF(b->ada_b, (6 * C), "blocks.%d.ada_lin.1.bias", i);
    return MC_OK;
}

/* lvl_pos = lvl_embed[scale of token] + pos_1LC (A4 step 4), in float32. */
static mc_status bind_lvl_pos(mc_loader *ld, const mc_var_config *c, float *host) {
    const int64_t C = c->width, L = c->tokens;
    float *pos = host, *lvl = host + L * C;
    MC_TRY(mc_bind_host(ld, "pos_1LC", 3, SHAPE(1, L, C), pos));
    MC_TRY(mc_bind_host(ld, "lvl_embed.weight", 2, SHAPE(c->n_scales, C), lvl));
    for (int s = 0; s < c->n_scales; s++)
        for (int64_t t = c->scale_begin[s]; t < c->scale_begin[s + 1]; t++)
            for (int64_t j = 0; j < C; j++)
                pos[t * C + j] = lvl[s * C + j] + pos[t * C + j];
    return MC_OK;
}

static mc_status bind_all(mc_loader *ld, mc_var *m, float *host) {
    const mc_var_config *c = &m->config;
    const int64_t C = c->width, first = c->patch_nums[0] * c->patch_nums[0];
    BIND(m->pos_start, "pos_start", 1, first, C);
    MC_TRY(bind_lvl_pos(ld, c, host));
    MC_TRY(mc_loader_upload(ld, host, (size_t)(c->tokens * C), &m->lvl_pos, "the level and position embeddings"));
    BIND(m->class_emb, "class_emb.weight", c->num_classes + 1, C);
    LBIND(m->word_embed_w, C, c->vae_channels, "%s", "word_embed.weight");
    BIND(m->word_embed_b, "word_embed.bias", C);
    for (int i = 0; i < (int)c->depth; i++)
        MC_TRY(bind_block(ld, c, i, &m->blocks[i], host));
    LBIND(m->head_ada_w, 2 * C, C, "%s", "head_nm.ada_lin.1.weight");
    BIND(m->head_ada_b, "head_nm.ada_lin.1.bias", 2 * C);
    LBIND(m->head_w, c->vocab, C, "%s", "head.weight");
    BIND(m->head_b, "head.bias", c->vocab);
    return MC_OK;
}

mc_status mc_var_load(mc_backend *be, const mc_st_file *file, mc_var **out, mc_err *err) {
    mc_var *m = calloc(1, sizeof *m);
    if (m == NULL)
        return mc_fail_nomem(err, sizeof *m, "the VAR model");
    m->backend = be;
    m->slots_seq = -1;
    mc_loader ld;
    mc_loader_init(&ld, file, be, err);
    mc_status st = read_config(&ld, &m->config);
    float *host = NULL;
    if (st == MC_OK) {
        const mc_var_config *c = &m->config;
        const size_t host_floats = (size_t)((c->tokens + c->n_scales) * c->width + 3 * c->width + c->heads);
        m->blocks = calloc((size_t)c->depth, sizeof *m->blocks);
        m->k_cache = calloc((size_t)c->depth, sizeof *m->k_cache);
        m->v_cache = calloc((size_t)c->depth, sizeof *m->v_cache);
        host = malloc(host_floats * sizeof(float));
        if (!m->blocks || !m->k_cache || !m->v_cache || !host)
            st = mc_fail_nomem(err,
                               (size_t)c->depth * (sizeof *m->blocks + sizeof *m->k_cache + sizeof *m->v_cache) +
                                   host_floats * sizeof(float),
                               "the VAR block tables and the load's host staging of embeddings and biases");
    }
    if (st == MC_OK)
        st = bind_all(&ld, m, host);
    if (st == MC_OK)
        m->weights = mc_loader_take_allocations(&ld);
    mc_loader_finish(&ld);
    free(host);
    if (st != MC_OK) {
        mc_var_free(m);
        return st;
    }
    *out = m;
    return MC_OK;
}

void mc_var_free(mc_var *var) {
    if (var == NULL)
        return;
    free_workspace(var);
    mc_alloc_list_free(&var->weights, var->backend);
    free(var->blocks);
    free(var->k_cache);
    free(var->v_cache);
    free(var);
}

int64_t mc_var_num_params(const mc_var *var) {
    const mc_var_config *c = &var->config;
    const int64_t C = c->width, F = c->ffn_hidden, V = c->vocab;
    const int64_t first = c->patch_nums[0] * c->patch_nums[0];
    int64_t n = c->vae_channels * C + C + (c->num_classes + 1) * C + first * C + c->tokens * C + c->n_scales * C;
    n += c->depth * (3 * C * C + 2 * C + C * C + C + 2 * F * C + F + C + 6 * C * C + 6 * C + c->heads);
    n += 2 * C * C + 2 * C + V * C + V;
    return n;
}

/* ---------------------------------------------------------------- forward */

static mc_status check_seq(const mc_var *var, int64_t n_seq, int64_t rows, const char *what, mc_err *err) {
    if (n_seq <= 0 || rows < 0 || n_seq > var->acts_seq || rows > var->acts_rows || n_seq * rows > var->acts_seq * var->acts_rows)
        return mc_fail(err, MC_ERR_INTERNAL, "VAR %s: %lld sequences of %lld rows exceed the reserved %lld of %lld",
                       what, (long long)n_seq, (long long)rows, (long long)var->acts_seq,
                       (long long)var->acts_rows);
    return MC_OK;
}

/* Sequence b of a call is sequence b of the run's conditioning. */
static mc_status check_cond(const mc_var *var, int64_t n_seq, const char *what, mc_err *err) {
    if (n_seq > var->cond_seq)
        return mc_fail(err, MC_ERR_INTERNAL, "VAR %s: %lld sequences, but the conditioning has %lld", what,
                       (long long)n_seq, (long long)var->cond_seq);
    return MC_OK;
}

mc_status mc_var_condition(mc_var *var, const int32_t *labels, int64_t n_seq, mc_err *err) {
    mc_backend *be = var->backend;
    const mc_ops *ops = be->ops;
    const mc_var_config *c = &var->config;
    const int64_t C = c->width;
    const mc_var_acts *a = &var->acts;
    MC_TRY(check_seq(var, n_seq, 1, "conditioning", err));
    var->cond_seq = 0; /* until the modulation below is complete */
    for (int64_t i = 0; i < n_seq; i++)
        if (labels[i] < 0 || labels[i] > c->num_classes)
            return mc_fail(err, MC_ERR_VALUE, "VAR label %d at %lld is outside 0..%lld (%lld = the null class)",
                           labels[i], (long long)i, (long long)c->num_classes, (long long)c->num_classes);
    MC_TRY(ops->upload(be, var->index_acts.labels, labels, (size_t)n_seq * sizeof(int32_t), err));
    MC_TRY(ops->gather_rows(be, var->class_emb, C, var->index_acts.labels, n_seq, C, a->cond, C, err));
    MC_TRY(ops->axpby(be, 1.0f, a->cond, C, 0.0f, a->cond_silu, C, n_seq, C, err));
    MC_TRY(ops->activation(be, MC_ACT_SILU, a->cond_silu, C, n_seq, C, err));
    for (int64_t b = 0; b < c->depth; b++)
        MC_TRY(ops->linear(be, a->cond_silu, C, n_seq, C, var->blocks[b].ada_w, var->blocks[b].ada_b, 6 * C,
                           MC_ACT_NONE, 0.0f, a->block_mod + b * n_seq * 6 * C, 6 * C, err));
    MC_TRY(ops->linear(be, a->cond_silu, C, n_seq, C, var->head_ada_w, var->head_ada_b, 2 * C, MC_ACT_NONE, 0.0f,
                       a->head_mod, 2 * C, err));
    var->cond_seq = n_seq;
    return MC_OK;
}

mc_status mc_var_first_input(mc_var *var, int64_t n_seq, float *x, mc_err *err) {
    mc_backend *be = var->backend;
    const mc_ops *ops = be->ops;
    const int64_t C = var->config.width, first = var->config.patch_nums[0] * var->config.patch_nums[0];
    MC_TRY(check_seq(var, n_seq, first, "first scale", err));
    MC_TRY(check_cond(var, n_seq, "first scale", err));
    int32_t *rows = malloc((size_t)(n_seq * first) * sizeof(int32_t));
    if (rows == NULL)
        return mc_fail_nomem_n(err, (size_t)(n_seq * first), sizeof(int32_t), "the first scale's row list");
    for (int64_t i = 0; i < n_seq * first; i++)
        rows[i] = (int32_t)(i / first);
    mc_status st = ops->upload(be, var->index_acts.rows, rows, (size_t)(n_seq * first) * sizeof(int32_t), err);
    free(rows);
    MC_TRY(st);
    /* (sos + pos_start) + lvl_pos, the official order of the float32 sums. */
    MC_TRY(ops->gather_rows(be, var->acts.cond, C, var->index_acts.rows, n_seq * first, C, x, C, err));
    MC_TRY(ops->add_rows(be, x, C, n_seq * first, C, var->pos_start, C, first, err));
    return ops->add_rows(be, x, C, n_seq * first, C, var->lvl_pos, C, first, err);
}

mc_status mc_var_scale_input(mc_var *var, int si, const float *next, int64_t n_maps, int copies, float *x,
                             mc_err *err) {
    mc_backend *be = var->backend;
    const mc_ops *ops = be->ops;
    const mc_var_config *c = &var->config;
    const int64_t C = c->width;
    if (si <= 0 || si >= c->n_scales || copies < 1)
        return mc_fail(err, MC_ERR_INTERNAL, "VAR scale input: scale %d of %d, %d copies", si, c->n_scales, copies);
    const int64_t n = c->patch_nums[si] * c->patch_nums[si], rows = n_maps * n;
    MC_TRY(ops->linear(be, next, c->vae_channels, rows, c->vae_channels, var->word_embed_w, var->word_embed_b, C,
                       MC_ACT_NONE, 0.0f, x, C, err));
    MC_TRY(ops->add_rows(be, x, C, rows, C, var->lvl_pos + c->scale_begin[si] * C, C, n, err));
    for (int k = 1; k < copies; k++)
        MC_TRY(ops->copy(be, x + k * rows * C, x, (size_t)(rows * C) * sizeof(float), err));
    return MC_OK;
}

/* y_b = LN(x_b) * (1 + scale_b) + shift_b for each sequence b of n_seq
 * sequences of `rows` rows: the modulation is one row per sequence, so one
 * layernorm call takes all of them with mod_period = rows. (A call per
 * sequence, as before, was 10,560 launches of a VAR-d16 image at batch 16
 * and 9% of its GPU time on an H200.) */
static mc_status modulated_ln(mc_var *var, const float *x, int64_t n_seq, int64_t rows, const float *shift,
                              const float *scale, int64_t ld_mod, float *y, mc_err *err) {
    mc_backend *be = var->backend;
    const int64_t C = var->config.width;
    if (rows == 0)
        return MC_OK;
    return be->ops->layernorm(be, x, C, n_seq * rows, C, NULL, NULL, VAR_LN_EPS, shift, scale, ld_mod, rows, y, C,
                              err);
}

/* out (+)= gamma_b * u_b per sequence (gamma: one row per sequence, stride
 * ld_gamma). The product is rounded before the sum, as x + u.mul(gamma). */
static mc_status gamma_out(mc_var *var, const float *u, int64_t n_seq, int64_t rows, const float *gamma,
                           int64_t ld_gamma, float *out, mc_var_out_mode mode, mc_err *err) {
    mc_backend *be = var->backend;
    const int64_t C = var->config.width;
    if (mode == MC_VAR_OUT_SET) /* 0 * u (finite) = 0; gated_add then writes exactly gamma * u */
        MC_TRY(be->ops->axpby(be, 0.0f, u, C, 0.0f, out, C, n_seq * rows, C, err));
    if (rows == 0)
        return MC_OK;
    return be->ops->gated_add(be, out, C, u, C, gamma, ld_gamma, rows, n_seq * rows, C, err);
}

/* Cache rows b * L + kv_used + r of a K/V append, uploaded once for every
 * block of a scale. */
static mc_status kv_slots(mc_var *var, int64_t n_seq, int64_t rows, int64_t kv_used, mc_err *err) {
    if (var->slots_seq == n_seq && var->slots_rows == rows && var->slots_start == kv_used)
        return MC_OK;
    const int64_t L = var->config.tokens, n = n_seq * rows;
    int32_t *host = malloc((size_t)n * sizeof(int32_t));
    if (host == NULL)
        return mc_fail_nomem_n(err, (size_t)n, sizeof(int32_t), "the K/V slot list of %lld rows", (long long)n);
    for (int64_t b = 0; b < n_seq; b++)
        for (int64_t r = 0; r < rows; r++)
            host[b * rows + r] = (int32_t)(b * L + kv_used + r);
    mc_status st = var->backend->ops->upload(var->backend, var->index_acts.kv_slots, host, (size_t)n * sizeof(int32_t),
                                             err);
    free(host);
    MC_TRY(st);
    var->slots_seq = n_seq;
    var->slots_rows = rows;
    var->slots_start = kv_used;
    return MC_OK;
}

mc_status mc_var_attn_sublayer(mc_var *var, int block, const float *x, int64_t n_seq, int64_t rows,
                               int64_t kv_used, float *out, mc_var_out_mode mode, mc_err *err) {
    mc_backend *be = var->backend;
    const mc_ops *ops = be->ops;
    const mc_var_config *c = &var->config;
    const int64_t C = c->width, L = c->tokens, n = n_seq * rows;
    const mc_var_block *blk = &var->blocks[block];
    const mc_var_acts *a = &var->acts;
    MC_TRY(check_seq(var, n_seq, rows, "attention", err));
    if (n_seq > var->kv_seq || kv_used < 0 || kv_used + rows > L)
        return mc_fail(err, MC_ERR_INTERNAL, "VAR attention: %lld sequences, K/V rows %lld..%lld of %lld",
                       (long long)n_seq, (long long)kv_used, (long long)(kv_used + rows), (long long)L);
    MC_TRY(check_cond(var, n_seq, "attention", err));
    const float *mod = a->block_mod + (int64_t)block * var->cond_seq * 6 * C;
    /* gamma1 at 0, scale1 at 2C, shift1 at 4C of each sequence's 6C (A5.1). */
    MC_TRY(modulated_ln(var, x, n_seq, rows, mod + 4 * C, mod + 2 * C, 6 * C, a->normed, err));
    MC_TRY(ops->linear(be, a->normed, C, n, C, blk->qkv_w, blk->qkv_b, 3 * C, MC_ACT_NONE, 0.0f, a->qkv, 3 * C,
                       err));
    MC_TRY(ops->head_l2norm(be, a->qkv, 3 * C, n, (int)c->heads, (int)c->head_dim, blk->head_scale, err));
    MC_TRY(ops->head_l2norm(be, a->qkv + C, 3 * C, n, (int)c->heads, (int)c->head_dim, NULL, err));
    MC_TRY(kv_slots(var, n_seq, rows, kv_used, err));
    float *k = var->k_cache[block], *v = var->v_cache[block];
    MC_TRY(ops->scatter_rows(be, a->qkv + C, 3 * C, var->index_acts.kv_slots, n, C, k, C, err));
    MC_TRY(ops->scatter_rows(be, a->qkv + 2 * C, 3 * C, var->index_acts.kv_slots, n, C, v, C, err));
    mc_kv_segment seg = {.k = k, .v = v, .rows = kv_used + rows, .ld = C, .batch_stride = L * C};
    MC_TRY(ops->attention(be, n_seq, rows, (int)c->heads, (int)c->head_dim, 1.0f, a->qkv, 3 * C, rows * 3 * C, &seg,
                          1, a->attn, C, rows * C, err));
    MC_TRY(ops->linear(be, a->attn, C, n, C, blk->proj_w, blk->proj_b, C, MC_ACT_NONE, 0.0f, a->sub, C, err));
    return gamma_out(var, a->sub, n_seq, rows, mod, 6 * C, out, mode, err);
}

mc_status mc_var_ffn_sublayer(mc_var *var, int block, const float *x, int64_t n_seq, int64_t rows, float *out,
                              mc_var_out_mode mode, mc_err *err) {
    mc_backend *be = var->backend;
    const mc_ops *ops = be->ops;
    const mc_var_config *c = &var->config;
    const int64_t C = c->width, F = c->ffn_hidden, n = n_seq * rows;
    const mc_var_block *blk = &var->blocks[block];
    const mc_var_acts *a = &var->acts;
    MC_TRY(check_seq(var, n_seq, rows, "FFN", err));
    MC_TRY(check_cond(var, n_seq, "FFN", err));
    const float *mod = a->block_mod + (int64_t)block * var->cond_seq * 6 * C;
    /* gamma2 at C, scale2 at 3C, shift2 at 5C. */
    MC_TRY(modulated_ln(var, x, n_seq, rows, mod + 5 * C, mod + 3 * C, 6 * C, a->normed, err));
    for (int64_t r0 = 0; r0 < n; r0 += VAR_FFN_CHUNK_ROWS) {
        const int64_t m = n - r0 < VAR_FFN_CHUNK_ROWS ? n - r0 : VAR_FFN_CHUNK_ROWS;
        MC_TRY(ops->linear(be, a->normed + r0 * C, C, m, C, blk->fc1_w, blk->fc1_b, F, MC_ACT_GELU_TANH, 0.0f,
                           a->hidden, F, err));
        MC_TRY(ops->linear(be, a->hidden, F, m, F, blk->fc2_w, blk->fc2_b, C, MC_ACT_NONE, 0.0f, a->sub + r0 * C, C,
                           err));
    }
    return gamma_out(var, a->sub, n_seq, rows, mod + C, 6 * C, out, mode, err);
}

mc_status mc_var_blocks(mc_var *var, float *x, int64_t n_seq, int64_t rows, int64_t kv_used, mc_err *err) {
    for (int b = 0; b < (int)var->config.depth; b++) {
        MC_TRY(mc_var_attn_sublayer(var, b, x, n_seq, rows, kv_used, x, MC_VAR_OUT_ADD, err));
        MC_TRY(mc_var_ffn_sublayer(var, b, x, n_seq, rows, x, MC_VAR_OUT_ADD, err));
    }
    return MC_OK;
}

mc_status mc_var_logits(mc_var *var, const float *x, int64_t n_seq, int64_t rows, float *logits, mc_err *err) {
    mc_backend *be = var->backend;
    const mc_var_config *c = &var->config;
    const int64_t C = c->width;
    const mc_var_acts *a = &var->acts;
    MC_TRY(check_seq(var, n_seq, rows, "logits", err));
    MC_TRY(check_cond(var, n_seq, "logits", err));
    /* The head's modulation: scale at 0, shift at C (A5.4). */
    MC_TRY(modulated_ln(var, x, n_seq, rows, a->head_mod + C, a->head_mod, 2 * C, a->normed, err));
    return be->ops->linear(be, a->normed, C, n_seq * rows, C, var->head_w, var->head_b, c->vocab, MC_ACT_NONE, 0.0f,
                           logits, c->vocab, err);
}

/* MAR forward passes (spec mar.md sections 3 and 5) on the backend op table. */
#include "mar.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../io/bind_shorthand.h"

#define MAR_LN_EPS 1e-6f
#define MAR_TIME_FREQ_DIM 256
/* Rows of the MLP hidden activation held at once: bounds memory at large
 * batch while keeping GEMMs large enough to run at full rate. */
#define MAR_MLP_CHUNK_ROWS 4096

/* A named activation of the model grown to `count` floats / int32s. */
#define ACT_FLOATS(m, name, count, err) mc_buffer_floats((m)->backend, &(m)->acts.name, (count), "mar." #name, (err))
/* Uploads a host index array into the named index buffer. */
#define ACT_ROWS(m, name, host, count, err)                                                                     \
    mc_buffer_upload_ints((m)->backend, &(m)->acts.name, (host), (count), "mar." #name, (err))

static void free_workspace(mc_mar *mar) {
    MC_BUFFERS_RELEASE(mar->backend, &mar->acts);
    if (mar->runtime.free != NULL)
        mar->runtime.free(mar->runtime.data, mar->backend);
    memset(&mar->runtime, 0, sizeof mar->runtime);
}

/* ---------------------------------------------------------------- loading */

static int count_indexed(const mc_loader *ld, const char *fmt) {
    char name[256];
    int n = 0;
    for (;;) {
        snprintf(name, sizeof name, fmt, n);
        if (!mc_loader_has(ld, name))
            return n;
        n++;
    }
}

static int64_t heads_for_width(int64_t width) {
    switch (width) {
    case 768: return 12;
    case 1024: return 16;
    case 1280: return 16;
    default: return 0;
    }
}

static mc_status read_int_metadata(const mc_st_file *file, const char *key, int64_t *value,
                                   mc_err *err) {
    const char *text = mc_st_metadata(file, key);
    if (text == NULL)
        return MC_OK;
    char *end = NULL;
    errno = 0;
    long long parsed = strtoll(text, &end, 10);
    /* ERANGE: strtoll clamps an out-of-range value to LLONG_MAX, which would then be
     * reported as if the file said 9223372036854775807. */
    if (end == text || *end != '\0' || parsed <= 0 || errno == ERANGE)
        return mc_fail(err, MC_ERR_VALUE, "%s: metadata '%s' = '%s' is not a positive integer%s",
                       file->path, key, text, errno == ERANGE ? " (too large for a 64-bit integer)" : "");
    *value = parsed;
    return MC_OK;
}

/* The shape of tensor `key`, which must have `ndim` dimensions. */
static mc_status shape_of(mc_loader *ld, const char *key, int ndim, int64_t shape[8]) {
    int got;
    MC_TRY(mc_loader_shape(ld, key, &got, shape));
    if (got != ndim)
        return mc_fail(ld->err, MC_ERR_VALUE, "%s: key '%s' must be %d-D", ld->file->path, key, ndim);
    return MC_OK;
}

static mc_status read_config(mc_loader *ld, int heads_override, mc_mar_config *cfg) {
    const mc_st_file *file = ld->file;
    mc_err *err = ld->err;
    int ndim;
    int64_t shape[8];
    if (!mc_loader_has(ld, "class_emb.weight") || !mc_loader_has(ld, "diffloss.net.input_proj.weight")) {
        if (mc_loader_has(ld, "decoder.conv_in.weight"))
            return mc_fail(err, MC_ERR_VALUE,
                           "%s is a KL-16 VAE file, not a MAR model: pass it as vae=...", file->path);
        if (mc_loader_has(ld, "word_embed.weight"))
            return mc_fail(err, MC_ERR_VALUE, "%s is a VAR checkpoint, not a MAR model", file->path);
        return mc_fail(err, MC_ERR_VALUE,
                       "%s is not a MAR checkpoint: keys 'class_emb.weight' and "
                       "'diffloss.net.input_proj.weight' are missing", file->path);
    }
    MC_TRY(shape_of(ld, "class_emb.weight", 2, shape));
    cfg->num_classes = shape[0];
    cfg->width = shape[1];
    MC_TRY(shape_of(ld, "decoder_embed.weight", 2, shape));
    cfg->dec_width = shape[0];
    MC_TRY(shape_of(ld, "diffusion_pos_embed_learned", 3, shape));
    cfg->seq_len = shape[1];
    MC_TRY(mc_loader_shape(ld, "encoder_pos_embed_learned", &ndim, shape));
    if (ndim != 3 || shape[1] <= cfg->seq_len)
        return mc_fail(err, MC_ERR_VALUE,
                       "%s: key 'encoder_pos_embed_learned' must be [1, buffer + %lld, width]",
                       file->path, (long long)cfg->seq_len);
    cfg->buffer_size = shape[1] - cfg->seq_len;
    MC_TRY(shape_of(ld, "z_proj.weight", 2, shape));
    cfg->token_channels = shape[1];
    MC_TRY(shape_of(ld, "diffloss.net.input_proj.weight", 2, shape));
    cfg->head_width = shape[0];
    cfg->enc_depth = count_indexed(ld, "encoder_blocks.%d.norm1.weight");
    cfg->dec_depth = count_indexed(ld, "decoder_blocks.%d.norm1.weight");
    cfg->head_depth = count_indexed(ld, "diffloss.net.res_blocks.%d.in_ln.weight");
    if (cfg->enc_depth == 0 || cfg->dec_depth == 0 || cfg->head_depth == 0)
        return mc_fail(err, MC_ERR_VALUE,
                       "%s: found %lld encoder blocks, %lld decoder blocks, %lld head res blocks; "
                       "each needs at least one", file->path, (long long)cfg->enc_depth,
                       (long long)cfg->dec_depth, (long long)cfg->head_depth);
    MC_TRY(mc_loader_shape(ld, "encoder_blocks.0.mlp.fc1.weight", &ndim, shape));
    cfg->mlp_hidden = shape[0];
    MC_TRY(mc_loader_shape(ld, "decoder_blocks.0.mlp.fc1.weight", &ndim, shape));
    cfg->dec_mlp_hidden = shape[0];

    const mc_shape_size sizes[] = {{"width", "class_emb.weight", cfg->width},
                                   {"decoder width", "decoder_embed.weight", cfg->dec_width},
                                   {"token count", "diffusion_pos_embed_learned", cfg->seq_len},
                                   {"token channel count", "z_proj.weight", cfg->token_channels},
                                   {"head width", "diffloss.net.input_proj.weight", cfg->head_width},
                                   {"MLP hidden size", "encoder_blocks.0.mlp.fc1.weight", cfg->mlp_hidden},
                                   {"decoder MLP hidden size", "decoder_blocks.0.mlp.fc1.weight", cfg->dec_mlp_hidden}};
    MC_TRY(mc_loader_check_sizes(ld, sizes, sizeof sizes / sizeof sizes[0]));

    cfg->enc_heads = heads_for_width(cfg->width);
    cfg->dec_heads = heads_for_width(cfg->dec_width);
    MC_TRY(read_int_metadata(file, "heads", &cfg->enc_heads, err));
    cfg->dec_heads = mc_st_metadata(file, "heads") ? cfg->enc_heads : cfg->dec_heads;
    MC_TRY(read_int_metadata(file, "decoder_heads", &cfg->dec_heads, err));
    if (heads_override > 0)
        cfg->enc_heads = cfg->dec_heads = heads_override;
    if (cfg->enc_heads <= 0 || cfg->dec_heads <= 0)
        return mc_fail(err, MC_ERR_VALUE,
                       "%s: width %lld is not one of the released MAR configs (768, 1024, 1280), so "
                       "the number of attention heads is unknown: add metadata 'heads' or pass heads=",
                       file->path, (long long)cfg->width);
    if (cfg->width % cfg->enc_heads != 0 || cfg->dec_width % cfg->dec_heads != 0)
        return mc_fail(err, MC_ERR_VALUE, "%s: width %lld / %lld not divisible by heads %lld / %lld",
                       file->path, (long long)cfg->width, (long long)cfg->dec_width,
                       (long long)cfg->enc_heads, (long long)cfg->dec_heads);
    return MC_OK;
}

static mc_status bind_blocks(mc_loader *ld, const char *prefix, int64_t depth, int64_t width,
                             int64_t hidden, mc_mar_block *blocks) {
    for (int i = 0; i < (int)depth; i++) {
        mc_mar_block *b = &blocks[i];
        BINDF(b->norm1_w, (width), "%s.%d.norm1.weight", prefix, i);
        BINDF(b->norm1_b, (width), "%s.%d.norm1.bias", prefix, i);
        LBIND(b->qkv_w, 3 * width, width, "%s.%d.attn.qkv.weight", prefix, i);
        BINDF(b->qkv_b, (3 * width), "%s.%d.attn.qkv.bias", prefix, i);
        LBIND(b->proj_w, width, width, "%s.%d.attn.proj.weight", prefix, i);
        BINDF(b->proj_b, (width), "%s.%d.attn.proj.bias", prefix, i);
        BINDF(b->norm2_w, (width), "%s.%d.norm2.weight", prefix, i);
        BINDF(b->norm2_b, (width), "%s.%d.norm2.bias", prefix, i);
        LBIND(b->fc1_w, hidden, width, "%s.%d.mlp.fc1.weight", prefix, i);
        BINDF(b->fc1_b, (hidden), "%s.%d.mlp.fc1.bias", prefix, i);
        LBIND(b->fc2_w, width, hidden, "%s.%d.mlp.fc2.weight", prefix, i);
        BINDF(b->fc2_b, (width), "%s.%d.mlp.fc2.bias", prefix, i);
    }
    return MC_OK;
}

static mc_status bind_all(mc_loader *ld, mc_mar *m) {
    const mc_mar_config *c = &m->config;
    const int64_t D = c->width, Dd = c->dec_width, S = c->seq_len, L = c->seq_len + c->buffer_size;
    const int64_t W = c->head_width, C = c->token_channels;
    BIND(m->fake_latent, "fake_latent", 1, D);
    BIND(m->enc_pos, "encoder_pos_embed_learned", 1, L, D);
    BIND(m->mask_token, "mask_token", 1, 1, Dd);
    BIND(m->dec_pos, "decoder_pos_embed_learned", 1, L, Dd);
    BIND(m->diff_pos, "diffusion_pos_embed_learned", 1, S, Dd);
    BIND(m->class_emb, "class_emb.weight", c->num_classes, D);
    LBIND(m->z_proj_w, D, C, "%s", "z_proj.weight");
    BIND(m->z_proj_b, "z_proj.bias", D);
    BIND(m->z_proj_ln_w, "z_proj_ln.weight", D);
    BIND(m->z_proj_ln_b, "z_proj_ln.bias", D);
    MC_TRY(bind_blocks(ld, "encoder_blocks", c->enc_depth, D, c->mlp_hidden, m->enc_blocks));
    BIND(m->enc_norm_w, "encoder_norm.weight", D);
    BIND(m->enc_norm_b, "encoder_norm.bias", D);
    LBIND(m->dec_embed_w, Dd, D, "%s", "decoder_embed.weight");
    BIND(m->dec_embed_b, "decoder_embed.bias", Dd);
    MC_TRY(bind_blocks(ld, "decoder_blocks", c->dec_depth, Dd, c->dec_mlp_hidden, m->dec_blocks));
    BIND(m->dec_norm_w, "decoder_norm.weight", Dd);
    BIND(m->dec_norm_b, "decoder_norm.bias", Dd);
    LBIND(m->time_mlp0_w, W, MAR_TIME_FREQ_DIM, "%s", "diffloss.net.time_embed.mlp.0.weight");
    BIND(m->time_mlp0_b, "diffloss.net.time_embed.mlp.0.bias", W);
    LBIND(m->time_mlp2_w, W, W, "%s", "diffloss.net.time_embed.mlp.2.weight");
    BIND(m->time_mlp2_b, "diffloss.net.time_embed.mlp.2.bias", W);
    LBIND(m->cond_w, W, Dd, "%s", "diffloss.net.cond_embed.weight");
    BIND(m->cond_b, "diffloss.net.cond_embed.bias", W);
    LBIND(m->input_proj_w, W, C, "%s", "diffloss.net.input_proj.weight");
    BIND(m->input_proj_b, "diffloss.net.input_proj.bias", W);
    for (int j = 0; j < (int)c->head_depth; j++) {
        mc_mar_res_block *r = &m->res_blocks[j];
        BINDF(r->in_ln_w, (W), "diffloss.net.res_blocks.%d.in_ln.weight", j);
        BINDF(r->in_ln_b, (W), "diffloss.net.res_blocks.%d.in_ln.bias", j);
        LBIND(r->mlp0_w, W, W, "diffloss.net.res_blocks.%d.mlp.0.weight", j);
        BINDF(r->mlp0_b, (W), "diffloss.net.res_blocks.%d.mlp.0.bias", j);
        LBIND(r->mlp2_w, W, W, "diffloss.net.res_blocks.%d.mlp.2.weight", j);
        BINDF(r->mlp2_b, (W), "diffloss.net.res_blocks.%d.mlp.2.bias", j);
        LBIND(r->ada_w, 3 * W, W, "diffloss.net.res_blocks.%d.adaLN_modulation.1.weight", j);
        BINDF(r->ada_b, (3 * W), "diffloss.net.res_blocks.%d.adaLN_modulation.1.bias", j);
    }
    LBIND(m->final_ada_w, 2 * W, W, "%s", "diffloss.net.final_layer.adaLN_modulation.1.weight");
    BIND(m->final_ada_b, "diffloss.net.final_layer.adaLN_modulation.1.bias", 2 * W);
    LBIND(m->final_linear_w, 2 * C, W, "%s", "diffloss.net.final_layer.linear.weight");
    BIND(m->final_linear_b, "diffloss.net.final_layer.linear.bias", 2 * C);
    return MC_OK;
}

/* A buffer owned by the model's allocation list. */
static float *model_buffer(mc_mar *m, size_t floats, const char *what, mc_err *err) {
    mc_backend *be = m->backend;
    float *p = be->ops->alloc(be, floats * sizeof(float), what, err);
    if (p == NULL)
        return NULL;
    if (mc_alloc_list_push(&m->weights, p, floats * sizeof(float), err) != MC_OK) {
        be->ops->release(be, p);
        return NULL;
    }
    return p;
}

/* GLIDE/DiT sinusoidal embedding (cos first, then sin). The reference
 * evaluates it on float32 tensors; every float32 rounding of that chain is
 * kept here, while exp/cos/sin are taken in double and rounded once (so the
 * result does not depend on the libm's float versions). */
static void timestep_frequencies(int32_t t, float *out) {
    const int half = MAR_TIME_FREQ_DIM / 2;
    const float neg_log_period = (float)(-log(10000.0));
    for (int k = 0; k < half; k++) {
        float exponent = (neg_log_period * (float)k) / (float)half;
        float freq = (float)exp((double)exponent);
        float arg = (float)t * freq;
        out[k] = (float)cos((double)arg);
        out[half + k] = (float)sin((double)arg);
    }
}

/* The head's time embedding (time_embed MLP of the sinusoidal frequencies)
 * of n timesteps into out [n, W] on the backend. */
static mc_status embed_timesteps(mc_mar *m, const int32_t *timesteps, int64_t n, float *out, mc_err *err) {
    mc_backend *be = m->backend;
    const mc_ops *ops = be->ops;
    const int64_t W = m->config.head_width;
    float *host_freq = malloc((size_t)n * MAR_TIME_FREQ_DIM * sizeof(float));
    if (host_freq == NULL)
        return mc_fail_nomem_n(err, (size_t)n * MAR_TIME_FREQ_DIM, sizeof(float),
                               "the sinusoidal frequencies of %lld timesteps", (long long)n);
    for (int64_t i = 0; i < n; i++)
        timestep_frequencies(timesteps[i], host_freq + i * MAR_TIME_FREQ_DIM);
    mc_status st = MC_OK;
    float *dev_freq = ops->alloc(be, (size_t)n * MAR_TIME_FREQ_DIM * sizeof(float), "the timestep frequencies", err);
    float *hidden = dev_freq ? ops->alloc(be, (size_t)(n * W) * sizeof(float), "the time MLP's hidden layer", err)
                             : NULL;
    if (dev_freq == NULL || hidden == NULL)
        st = err->status;
    if (st == MC_OK)
        st = ops->upload(be, dev_freq, host_freq, (size_t)n * MAR_TIME_FREQ_DIM * sizeof(float), err);
    if (st == MC_OK)
        st = ops->linear(be, dev_freq, MAR_TIME_FREQ_DIM, n, MAR_TIME_FREQ_DIM, m->time_mlp0_w, m->time_mlp0_b, W,
                         MC_ACT_SILU, 0.0f, hidden, W, err);
    if (st == MC_OK)
        st = ops->linear(be, hidden, W, n, W, m->time_mlp2_w, m->time_mlp2_b, W, MC_ACT_NONE, 0.0f, out, W, err);
    free(host_freq);
    if (dev_freq)
        ops->release(be, dev_freq);
    if (hidden)
        ops->release(be, hidden);
    return st;
}

static mc_status hoist_constants(mc_mar *m, const int32_t *timesteps, int64_t n_timesteps,
                                 mc_err *err) {
    mc_backend *be = m->backend;
    const mc_ops *ops = be->ops;
    const int64_t Dd = m->config.dec_width, L = m->config.seq_len + m->config.buffer_size;
    const int64_t W = m->config.head_width;

    m->dec_masked_rows = model_buffer(m, (size_t)(L * Dd), "the decoder's masked rows", err);
    if (m->dec_masked_rows == NULL)
        return err->status;
    MC_TRY(ops->copy(be, m->dec_masked_rows, m->dec_pos, (size_t)(L * Dd) * sizeof(float), err));
    MC_TRY(ops->add_rows(be, m->dec_masked_rows, Dd, L, Dd, m->mask_token, Dd, 1, err));

    for (int t = 0; t < MAR_BASE_TIMESTEPS; t++)
        m->time_slot[t] = -1;
    for (int64_t i = 0; i < n_timesteps; i++) {
        if (timesteps[i] < 0 || timesteps[i] >= MAR_BASE_TIMESTEPS)
            return mc_fail(err, MC_ERR_VALUE, "timestep %d out of 0..%d", (int)timesteps[i], MAR_BASE_TIMESTEPS - 1);
        m->time_slot[timesteps[i]] = (int32_t)i;
    }
    m->n_timesteps = n_timesteps;
    m->time_embeddings = model_buffer(m, (size_t)(n_timesteps * W), "the head's time embeddings", err);
    if (m->time_embeddings == NULL)
        return err->status;
    return embed_timesteps(m, timesteps, n_timesteps, m->time_embeddings, err);
}

mc_status mc_mar_prepare_time_embeddings(mc_mar *m, const int32_t *timesteps, int64_t n, mc_err *err) {
    int missing = 0;
    for (int64_t i = 0; i < n; i++) {
        if (timesteps[i] < 0 || timesteps[i] >= MAR_BASE_TIMESTEPS)
            return mc_fail(err, MC_ERR_VALUE, "timestep %d out of 0..%d", (int)timesteps[i], MAR_BASE_TIMESTEPS - 1);
        missing |= m->time_slot[timesteps[i]] < 0;
    }
    if (!missing || m->base_time_embeddings != NULL)
        return MC_OK;
    /* All base timesteps at once, whatever was asked: a timestep's bits then
     * do not depend on which runs came before (a GEMM's rounding may depend
     * on its row count). */
    int32_t every[MAR_BASE_TIMESTEPS];
    for (int t = 0; t < MAR_BASE_TIMESTEPS; t++)
        every[t] = t;
    float *table = model_buffer(m, (size_t)(MAR_BASE_TIMESTEPS * m->config.head_width),
                                "the time embeddings of every base timestep", err);
    if (table == NULL)
        return err->status;
    MC_TRY(embed_timesteps(m, every, MAR_BASE_TIMESTEPS, table, err));
    m->base_time_embeddings = table;
    return MC_OK;
}

const float *mc_mar_time_embedding(const mc_mar *m, int32_t timestep) {
    if (timestep < 0 || timestep >= MAR_BASE_TIMESTEPS)
        return NULL;
    const int64_t W = m->config.head_width;
    if (m->time_slot[timestep] >= 0)
        return m->time_embeddings + (int64_t)m->time_slot[timestep] * W;
    return m->base_time_embeddings ? m->base_time_embeddings + (int64_t)timestep * W : NULL;
}

mc_status mc_mar_load(mc_backend *be, const mc_st_file *file, int heads_override,
                      const int32_t *timesteps, int64_t n_timesteps, mc_mar **out, mc_err *err) {
    mc_mar *m = calloc(1, sizeof *m);
    if (m == NULL)
        return mc_fail_nomem(err, sizeof *m, "the MAR model");
    m->backend = be;
    mc_loader ld;
    mc_loader_init(&ld, file, be, err);
    mc_status st = read_config(&ld, heads_override, &m->config);
    if (st == MC_OK) {
        m->enc_blocks = calloc((size_t)m->config.enc_depth, sizeof *m->enc_blocks);
        m->dec_blocks = calloc((size_t)m->config.dec_depth, sizeof *m->dec_blocks);
        m->res_blocks = calloc((size_t)m->config.head_depth, sizeof *m->res_blocks);
        if (!m->enc_blocks || !m->dec_blocks || !m->res_blocks)
            st = mc_fail_nomem(err,
                               (size_t)m->config.enc_depth * sizeof *m->enc_blocks +
                                   (size_t)m->config.dec_depth * sizeof *m->dec_blocks +
                                   (size_t)m->config.head_depth * sizeof *m->res_blocks,
                               "the MAR block tables");
    }
    if (st == MC_OK)
        st = bind_all(&ld, m);
    if (st == MC_OK)
        m->weights = mc_loader_take_allocations(&ld);
    mc_loader_finish(&ld);
    if (st == MC_OK)
        st = hoist_constants(m, timesteps, n_timesteps, err);
    if (st != MC_OK) {
        mc_mar_free(m);
        return st;
    }
    *out = m;
    return MC_OK;
}

void **mc_mar_head_graph(mc_mar *mar) { return &mar->head_graph; }

void mc_mar_free(mc_mar *mar) {
    if (mar == NULL)
        return;
    if (mar->head_graph != NULL && mar->backend->ops->graph_free != NULL)
        mar->backend->ops->graph_free(mar->backend, mar->head_graph);
    free_workspace(mar);
    mc_alloc_list_free(&mar->weights, mar->backend);
    free(mar->enc_blocks);
    free(mar->dec_blocks);
    free(mar->res_blocks);
    free(mar);
}

int64_t mc_mar_num_params(const mc_mar *mar) {
    const mc_mar_config *c = &mar->config;
    const int64_t D = c->width, Dd = c->dec_width, S = c->seq_len, L = S + c->buffer_size;
    const int64_t W = c->head_width, C = c->token_channels;
    int64_t n = D + 2 * L * D + Dd + S * Dd + c->num_classes * D + D * C + D + 2 * D;
    n += c->enc_depth * (4 * D + 3 * D * D + 3 * D + D * D + D + 2 * c->mlp_hidden * D + c->mlp_hidden + D);
    n += 2 * D + Dd * D + Dd;
    n += c->dec_depth * (4 * Dd + 3 * Dd * Dd + 3 * Dd + Dd * Dd + Dd + 2 * c->dec_mlp_hidden * Dd +
                         c->dec_mlp_hidden + Dd);
    n += 2 * Dd;
    n += W * MAR_TIME_FREQ_DIM + W + W * W + W + W * Dd + W + W * C + W;
    n += c->head_depth * (2 * W + 2 * (W * W + W) + 3 * W * W + 3 * W);
    n += 2 * W * W + 2 * W + 2 * C * W + 2 * C;
    return n;
}

/* ---------------------------------------------------------------- forward */

static mc_status store_kv(mc_mar *m, const float *qkv, int64_t q_rows, int64_t dim,
                          const mc_mar_kv_io *io, mc_err *err) {
    const int64_t n = io->store_seq * q_rows;
    if (n == 0 || (io->k_store == NULL && io->v_store == NULL))
        return MC_OK;
    int32_t *host = malloc((size_t)n * sizeof(int32_t));
    if (host == NULL)
        return mc_fail_nomem_n(err, (size_t)n, sizeof(int32_t), "the K/V store indices of %lld rows", (long long)n);
    for (int64_t b = 0; b < io->store_seq; b++)
        for (int64_t r = 0; r < q_rows; r++) {
            int64_t slot = io->store_slots ? io->store_slots[b * q_rows + r] : r;
            host[b * q_rows + r] = (int32_t)(b * io->store_cap + slot);
        }
    int32_t *d_idx = ACT_ROWS(m, rows_c, host, n, err);
    free(host);
    if (d_idx == NULL)
        return err->status;
    mc_backend *be = m->backend;
    if (io->k_store != NULL)
        MC_TRY(be->ops->scatter_rows(be, qkv + dim, 3 * dim, d_idx, n, dim, io->k_store, dim, err));
    if (io->v_store != NULL)
        MC_TRY(be->ops->scatter_rows(be, qkv + 2 * dim, 3 * dim, d_idx, n, dim, io->v_store, dim, err));
    return MC_OK;
}

/* The attention's keys: the block's own k and v in qkv, or io's cache. */
static mc_kv_segment block_keys(const float *qkv, int64_t q_rows, int64_t dim, const mc_mar_kv_io *io) {
    if (io != NULL && io->k_attend != NULL)
        return (mc_kv_segment){.k = io->k_attend, .v = io->v_attend, .rows = io->attend_rows, .ld = dim,
                               .batch_stride = io->attend_cap * dim};
    return (mc_kv_segment){.k = qkv + dim, .v = qkv + 2 * dim, .rows = q_rows, .ld = 3 * dim,
                           .batch_stride = q_rows * 3 * dim};
}

static mc_status block_attn(mc_mar *m, const mc_mar_block *blk, float *x, int64_t n_seq, int64_t q_rows,
                            int64_t dim, int64_t heads, const mc_mar_kv_io *io, mc_err *err) {
    mc_backend *be = m->backend;
    const mc_ops *ops = be->ops;
    const int64_t rows = n_seq * q_rows;
    const int64_t head_dim = dim / heads;
    float *normed = ACT_FLOATS(m, normed, (size_t)(rows * dim), err);
    float *qkv = ACT_FLOATS(m, qkv, (size_t)(rows * 3 * dim), err);
    float *attn = ACT_FLOATS(m, attn, (size_t)(rows * dim), err);
    if (!normed || !qkv || !attn)
        return err->status;
    MC_TRY(ops->layernorm(be, x, dim, rows, dim, blk->norm1_w, blk->norm1_b, MAR_LN_EPS, NULL, NULL,
                          0, 1, normed, dim, err));
    MC_TRY(ops->linear(be, normed, dim, rows, dim, blk->qkv_w, blk->qkv_b, 3 * dim, MC_ACT_NONE,
                       0.0f, qkv, 3 * dim, err));
    if (io != NULL)
        MC_TRY(store_kv(m, qkv, q_rows, dim, io, err));
    const mc_kv_segment kv = block_keys(qkv, q_rows, dim, io);
    MC_TRY(ops->attention(be, n_seq, q_rows, (int)heads, (int)head_dim,
                          (float)(1.0 / sqrt((double)head_dim)), qkv, 3 * dim, q_rows * 3 * dim,
                          &kv, 1, attn, dim, q_rows * dim, err));
    return ops->linear(be, attn, dim, rows, dim, blk->proj_w, blk->proj_b, dim, MC_ACT_NONE, 1.0f,
                       x, dim, err);
}

static mc_status block_mlp(mc_mar *m, const mc_mar_block *blk, float *x, int64_t rows, int64_t dim,
                           int64_t hidden, mc_err *err) {
    mc_backend *be = m->backend;
    const mc_ops *ops = be->ops;
    int64_t chunk = rows < MAR_MLP_CHUNK_ROWS ? rows : MAR_MLP_CHUNK_ROWS;
    float *normed = ACT_FLOATS(m, normed, (size_t)(chunk * dim), err);
    float *mlp_hidden = ACT_FLOATS(m, mlp_hidden, (size_t)(chunk * hidden), err);
    if (!normed || !mlp_hidden)
        return err->status;
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
        int64_t n = rows - r0 < chunk ? rows - r0 : chunk;
        float *xr = x + r0 * dim;
        MC_TRY(ops->layernorm(be, xr, dim, n, dim, blk->norm2_w, blk->norm2_b, MAR_LN_EPS, NULL,
                              NULL, 0, 1, normed, dim, err));
        MC_TRY(ops->linear(be, normed, dim, n, dim, blk->fc1_w, blk->fc1_b, hidden, MC_ACT_GELU,
                           0.0f, mlp_hidden, hidden, err));
        MC_TRY(ops->linear(be, mlp_hidden, hidden, n, hidden, blk->fc2_w, blk->fc2_b, dim,
                           MC_ACT_NONE, 1.0f, xr, dim, err));
    }
    return MC_OK;
}

/* The meter of the blocks `blk` is one of. */
static mc_phase_meter *block_meter(mc_mar *m, const mc_mar_block *blk) {
    return blk >= m->enc_blocks && blk < m->enc_blocks + m->config.enc_depth ? &m->encoder_meter
                                                                              : &m->decoder_meter;
}

/* Host time only where it is compute time (mc_ops.synchronous). */
static double meter_seconds(const mc_mar *m, double t0) {
    return m->backend->ops->synchronous ? mc_seconds_now() - t0 : 0.0;
}

mc_status mc_mar_block_attn(mc_mar *m, const mc_mar_block *blk, float *x, int64_t n_seq, int64_t q_rows,
                            int64_t dim, int64_t heads, const mc_mar_kv_io *io, mc_err *err) {
    const double t0 = mc_seconds_now();
    MC_TRY(block_attn(m, blk, x, n_seq, q_rows, dim, heads, io, err));
    const int64_t keys = io != NULL && io->k_attend != NULL ? io->attend_rows : q_rows;
    /* qkv [3 dim, dim] and proj [dim, dim] */
    mc_phase_meter_add(block_meter(m, blk), meter_seconds(m, t0), mc_flops_block_attn(n_seq, q_rows, keys, dim),
                       4.0 * (double)dim * (double)dim * (double)mc_wtype_size(m->backend->linear_wtype));
    return MC_OK;
}

mc_status mc_mar_block_mlp(mc_mar *m, const mc_mar_block *blk, float *x, int64_t rows, int64_t dim,
                           int64_t hidden, mc_err *err) {
    const double t0 = mc_seconds_now();
    MC_TRY(block_mlp(m, blk, x, rows, dim, hidden, err));
    /* fc1 and fc2 [hidden, dim] each, read again by every chunk of rows */
    const int64_t chunks = (rows + MAR_MLP_CHUNK_ROWS - 1) / MAR_MLP_CHUNK_ROWS;
    mc_phase_meter_add(block_meter(m, blk), meter_seconds(m, t0), mc_flops_block_mlp(rows, dim, hidden),
                       (double)chunks * 2.0 * (double)dim * (double)hidden *
                           (double)mc_wtype_size(m->backend->linear_wtype));
    return MC_OK;
}

/* One group of read rows (mar.h): gathered into read_x, so the attention's
 * queries and every later op see read_rows rows per sequence, and scattered
 * back at the end. ln holds every row's normed input, qkv every row's k and
 * v; neither is written here (block_mlp's scratch is acts.normed). */
static mc_status read_group(mc_mar *m, const mc_mar_block *blk, float *x, int64_t n_seq, int64_t q_rows,
                            int64_t dim, int64_t heads, int64_t hidden, const float *ln, const mc_kv_segment *kv,
                            const int32_t *rows, int64_t per_seq, mc_err *err) {
    mc_backend *be = m->backend;
    const mc_ops *ops = be->ops;
    const int64_t n_read = n_seq * per_seq, head_dim = dim / heads;
    int32_t *host = malloc((size_t)n_read * sizeof(int32_t));
    if (host == NULL)
        return mc_fail_nomem_n(err, (size_t)n_read, sizeof(int32_t), "the read row indices of %lld rows",
                               (long long)n_read);
    for (int64_t b = 0; b < n_seq; b++)
        for (int64_t i = 0; i < per_seq; i++) {
            const int32_t r = rows[b * per_seq + i];
            if (r < 0 || r >= q_rows) {
                free(host);
                return mc_fail(err, MC_ERR_INTERNAL, "read row %d of sequence %lld is outside its %lld rows", r,
                               (long long)b, (long long)q_rows);
            }
            host[b * per_seq + i] = (int32_t)(b * q_rows + r);
        }
    int32_t *d_read = ACT_ROWS(m, rows_a, host, n_read, err);
    free(host);
    float *normed = d_read ? ACT_FLOATS(m, normed, (size_t)(n_read * dim), err) : NULL;
    float *q = normed ? ACT_FLOATS(m, read_q, (size_t)(n_read * dim), err) : NULL;
    float *attn = q ? ACT_FLOATS(m, attn, (size_t)(n_read * dim), err) : NULL;
    float *xr = attn ? ACT_FLOATS(m, read_x, (size_t)(n_read * dim), err) : NULL;
    if (xr == NULL)
        return err->status;
    /* q: the first dim rows of the fused weight, on the read rows alone. */
    MC_TRY(ops->gather_rows(be, ln, dim, d_read, n_read, dim, normed, dim, err));
    MC_TRY(ops->linear(be, normed, dim, n_read, dim, blk->qkv_w, blk->qkv_b, dim, MC_ACT_NONE, 0.0f, q, dim, err));
    MC_TRY(ops->attention(be, n_seq, per_seq, (int)heads, (int)head_dim, (float)(1.0 / sqrt((double)head_dim)), q,
                          dim, per_seq * dim, kv, 1, attn, dim, per_seq * dim, err));
    MC_TRY(ops->gather_rows(be, x, dim, d_read, n_read, dim, xr, dim, err));
    MC_TRY(ops->linear(be, attn, dim, n_read, dim, blk->proj_w, blk->proj_b, dim, MC_ACT_NONE, 1.0f, xr, dim, err));
    MC_TRY(block_mlp(m, blk, xr, n_read, dim, hidden, err));
    /* d_read again: block_mlp uploads no indices, so rows_a still holds ours. */
    return ops->scatter_rows(be, xr, dim, d_read, n_read, dim, x, dim, err);
}

/* x [n_seq, q_rows, dim]: see mar.h. */
static mc_status block_read_rows(mc_mar *m, const mc_mar_block *blk, float *x, int64_t n_seq, int64_t q_rows,
                                 int64_t dim, int64_t heads, int64_t hidden, const mc_mar_kv_io *io,
                                 const mc_mar_read_rows *read, mc_err *err) {
    mc_backend *be = m->backend;
    const mc_ops *ops = be->ops;
    const int64_t rows = n_seq * q_rows;
    const size_t w_row_bytes = (size_t)dim * mc_wtype_size(be->linear_wtype);
    float *ln = ACT_FLOATS(m, read_ln, (size_t)(rows * dim), err);
    float *qkv = ln ? ACT_FLOATS(m, qkv, (size_t)(rows * 3 * dim), err) : NULL;
    if (qkv == NULL)
        return err->status;
    MC_TRY(ops->layernorm(be, x, dim, rows, dim, blk->norm1_w, blk->norm1_b, MAR_LN_EPS, NULL, NULL, 0, 1, ln,
                          dim, err));
    /* k and v of every row: the rows dim..3 dim of the fused weight, into
     * their columns of qkv (where store_kv and the keys read them). */
    MC_TRY(ops->linear(be, ln, dim, rows, dim, (const char *)blk->qkv_w + (size_t)dim * w_row_bytes,
                       blk->qkv_b + dim, 2 * dim, MC_ACT_NONE, 0.0f, qkv + dim, 3 * dim, err));
    if (io != NULL)
        MC_TRY(store_kv(m, qkv, q_rows, dim, io, err));
    const mc_kv_segment kv = block_keys(qkv, q_rows, dim, io);
    for (int g = 0; g < read->n_groups; g++)
        if (read->per_seq[g] > 0)
            MC_TRY(read_group(m, blk, x, n_seq, q_rows, dim, heads, hidden, ln, &kv, read->rows[g],
                              read->per_seq[g], err));
    return MC_OK;
}

mc_status mc_mar_block_read_rows(mc_mar *m, const mc_mar_block *blk, float *x, int64_t n_seq, int64_t q_rows,
                                 int64_t dim, int64_t heads, int64_t hidden, const mc_mar_kv_io *io,
                                 const mc_mar_read_rows *read, mc_err *err) {
    if (read != NULL && (read->n_groups < 0 || read->n_groups > MC_MAR_READ_GROUPS))
        return mc_fail(err, MC_ERR_INTERNAL, "read rows in %d groups (at most %d)", read->n_groups,
                       MC_MAR_READ_GROUPS);
    const int64_t per_seq = read != NULL ? mc_mar_read_rows_per_seq(read) : 0;
    if (per_seq <= 0 || (read->n_groups == 1 && per_seq >= q_rows)) {
        MC_TRY(mc_mar_block_attn(m, blk, x, n_seq, q_rows, dim, heads, io, err));
        return mc_mar_block_mlp(m, blk, x, n_seq * q_rows, dim, hidden, err);
    }
    const double t0 = mc_seconds_now();
    MC_TRY(block_read_rows(m, blk, x, n_seq, q_rows, dim, heads, hidden, io, read, err));
    const int64_t keys = io != NULL && io->k_attend != NULL ? io->attend_rows : q_rows;
    /* k and v [2 dim, dim] once; q and proj [dim, dim] each and fc1 and fc2
     * [hidden, dim] once per chunk of each group's rows */
    double bytes = 2.0 * (double)dim * (double)dim;
    for (int g = 0; g < read->n_groups; g++)
        if (read->per_seq[g] > 0) {
            const int64_t chunks = (n_seq * read->per_seq[g] + MAR_MLP_CHUNK_ROWS - 1) / MAR_MLP_CHUNK_ROWS;
            bytes += 2.0 * (double)dim * (double)dim + (double)chunks * 2.0 * (double)dim * (double)hidden;
        }
    mc_phase_meter_add(block_meter(m, blk), meter_seconds(m, t0),
                       mc_flops_block_read_rows(n_seq, q_rows, per_seq, keys, dim, hidden),
                       bytes * (double)mc_wtype_size(m->backend->linear_wtype));
    return MC_OK;
}

mc_status mc_mar_class_vectors(mc_mar *mar, const int32_t *labels_host, int64_t n, float *out,
                               mc_err *err) {
    mc_backend *be = mar->backend;
    const int64_t D = mar->config.width;
    for (int64_t i = 0; i < n; i++) {
        const float *src = labels_host[i] < 0 ? mar->fake_latent : mar->class_emb + (int64_t)labels_host[i] * D;
        MC_TRY(be->ops->copy(be, out + i * D, src, (size_t)D * sizeof(float), err));
    }
    return MC_OK;
}

mc_status mc_mar_encoder_input(mc_mar *m, const mc_mar_batch *batch, float *x, mc_err *err) {
    mc_backend *be = m->backend;
    const mc_ops *ops = be->ops;
    const mc_mar_config *c = &m->config;
    const int64_t B = batch->n_seq, K = batch->n_known, P = c->buffer_size, S = c->seq_len;
    const int64_t D = c->width, C = c->token_channels, rows_per = P + K;
    for (int64_t b = 0; b < B; b++) {
        MC_TRY(ops->copy(be, x + b * rows_per * D, m->enc_pos, (size_t)(P * D) * sizeof(float), err));
        MC_TRY(ops->add_rows(be, x + b * rows_per * D, D, P, D, batch->class_vectors + b * D, D, 1, err));
    }
    if (K > 0) {
        const int64_t n = B * K;
        int32_t *host = malloc((size_t)n * 3 * sizeof(int32_t));
        if (host == NULL)
            return mc_fail_nomem_n(err, (size_t)n * 3, sizeof(int32_t), "the encoder's row indices of %lld tokens",
                                   (long long)n);
        int32_t *token_rows = host, *pos_rows = host + n, *dst_rows = host + 2 * n;
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < K; i++) {
                int32_t pos = batch->known_pos[b * K + i];
                token_rows[b * K + i] = (int32_t)(b * S + pos);
                pos_rows[b * K + i] = (int32_t)(P + pos);
                dst_rows[b * K + i] = (int32_t)(b * rows_per + P + i);
            }
        int32_t *d_tok = ACT_ROWS(m, rows_a, token_rows, n, err);
        int32_t *d_pos = d_tok ? ACT_ROWS(m, rows_b, pos_rows, n, err) : NULL;
        int32_t *d_dst = d_pos ? ACT_ROWS(m, rows_c, dst_rows, n, err) : NULL;
        free(host);
        float *tok = ACT_FLOATS(m, tokens, (size_t)(n * C), err);
        float *proj = ACT_FLOATS(m, gather, (size_t)(n * D), err);
        if (!d_dst || !tok || !proj)
            return err->status;
        MC_TRY(ops->gather_rows(be, batch->tokens, C, d_tok, n, C, tok, C, err));
        MC_TRY(ops->gather_rows(be, m->enc_pos, D, d_pos, n, D, proj, D, err));
        MC_TRY(ops->linear(be, tok, C, n, C, m->z_proj_w, m->z_proj_b, D, MC_ACT_NONE, 1.0f, proj, D, err));
        MC_TRY(ops->scatter_rows(be, proj, D, d_dst, n, D, x, D, err));
    }
    return ops->layernorm(be, x, D, B * rows_per, D, m->z_proj_ln_w, m->z_proj_ln_b, MAR_LN_EPS,
                          NULL, NULL, 0, 1, x, D, err);
}

mc_status mc_mar_decoder_input(mc_mar *m, const float *enc, int64_t n_seq, int64_t n_tok,
                               const int32_t *positions, float *f, mc_err *err) {
    mc_backend *be = m->backend;
    const mc_ops *ops = be->ops;
    const mc_mar_config *c = &m->config;
    const int64_t P = c->buffer_size, L = P + c->seq_len, D = c->width, Dd = c->dec_width;
    const int64_t rows_per = P + n_tok, n = n_seq * rows_per;
    float *embedded = ACT_FLOATS(m, gather, (size_t)(n * Dd), err);
    int32_t *host = malloc((size_t)n * 2 * sizeof(int32_t));
    if (embedded == NULL || host == NULL) {
        free(host);
        return embedded == NULL ? err->status
                                : mc_fail_nomem_n(err, (size_t)n * 2, sizeof(int32_t),
                                                  "the decoder's row indices of %lld rows", (long long)n);
    }
    int32_t *pos_rows = host, *dst_rows = host + n;
    for (int64_t b = 0; b < n_seq; b++)
        for (int64_t r = 0; r < rows_per; r++) {
            int32_t pos = r < P ? (int32_t)r : (int32_t)(P + positions[b * n_tok + (r - P)]);
            pos_rows[b * rows_per + r] = pos;
            dst_rows[b * rows_per + r] = (int32_t)(b * L + pos);
        }
    int32_t *d_pos = ACT_ROWS(m, rows_a, pos_rows, n, err);
    int32_t *d_dst = d_pos ? ACT_ROWS(m, rows_b, dst_rows, n, err) : NULL;
    free(host);
    if (d_dst == NULL)
        return err->status;
    MC_TRY(ops->gather_rows(be, m->dec_pos, Dd, d_pos, n, Dd, embedded, Dd, err));
    MC_TRY(ops->linear(be, enc, D, n, D, m->dec_embed_w, m->dec_embed_b, Dd, MC_ACT_NONE, 1.0f,
                       embedded, Dd, err));
    return ops->scatter_rows(be, embedded, Dd, d_dst, n, Dd, f, Dd, err);
}

mc_status mc_mar_decoder_init(mc_mar *m, float *f, int64_t n_seq, mc_err *err) {
    mc_backend *be = m->backend;
    const int64_t L = m->config.buffer_size + m->config.seq_len, Dd = m->config.dec_width;
    for (int64_t b = 0; b < n_seq; b++)
        MC_TRY(be->ops->copy(be, f + b * L * Dd, m->dec_masked_rows, (size_t)(L * Dd) * sizeof(float), err));
    return MC_OK;
}

mc_status mc_mar_output_rows(mc_mar *m, const float *x, const int32_t *src_rows, const int32_t *positions,
                             int64_t n_out, const float *extra, const int32_t *extra_rows, float *z_out,
                             mc_err *err) {
    if (n_out == 0)
        return MC_OK;
    mc_backend *be = m->backend;
    const mc_ops *ops = be->ops;
    const int64_t Dd = m->config.dec_width;
    int32_t *d_src = ACT_ROWS(m, rows_a, src_rows, n_out, err);
    int32_t *d_pos = d_src ? ACT_ROWS(m, rows_b, positions, n_out, err) : NULL;
    float *tmp = ACT_FLOATS(m, gather, (size_t)(n_out * Dd), err);
    if (d_pos == NULL || tmp == NULL)
        return err->status;
    MC_TRY(ops->gather_rows(be, x, Dd, d_src, n_out, Dd, z_out, Dd, err));
    if (extra != NULL) {
        int32_t *d_extra = ACT_ROWS(m, rows_c, extra_rows, n_out, err);
        if (d_extra == NULL)
            return err->status;
        MC_TRY(ops->gather_rows(be, extra, Dd, d_extra, n_out, Dd, tmp, Dd, err));
        MC_TRY(ops->add_rows(be, z_out, Dd, n_out, Dd, tmp, Dd, n_out, err));
    }
    MC_TRY(ops->layernorm(be, z_out, Dd, n_out, Dd, m->dec_norm_w, m->dec_norm_b, MAR_LN_EPS, NULL,
                          NULL, 0, 1, z_out, Dd, err));
    MC_TRY(ops->gather_rows(be, m->diff_pos, Dd, d_pos, n_out, Dd, tmp, Dd, err));
    return ops->add_rows(be, z_out, Dd, n_out, Dd, tmp, Dd, n_out, err);
}

/* Where encoder (or decoder) layer i of a full pass stores its K/V for a
 * policy's hooks: nowhere without hooks or without that table. */
static mc_mar_kv_io hook_io(const mc_mar_hooks *hooks, int decoder, int64_t i, int64_t rows_per_seq) {
    mc_mar_kv_io io = {0};
    float **k = hooks == NULL ? NULL : decoder ? hooks->dec_k : hooks->enc_k;
    if (k != NULL) {
        io.k_store = k[i];
        io.v_store = decoder ? hooks->dec_v[i] : hooks->enc_v[i];
        io.store_seq = hooks->store_seq;
        io.store_cap = decoder ? rows_per_seq : hooks->enc_cap;
    }
    return io;
}

/* The decoder rows out_rows (b * S + position) names, as read rows of the
 * last block: each sequence's in the order given, padded with repeats of
 * its first (or, with none, of row 0) to the most any sequence has, since
 * the attention takes the same query count per sequence. A repeated row is
 * the same computation, written back twice with the same values. */
static int32_t *read_rows_of_outputs(const mc_mar *m, const int32_t *out_rows, int64_t n_out, int64_t n_seq,
                                     int64_t *per_seq, mc_err *err) {
    const int64_t P = m->config.buffer_size, S = m->config.seq_len;
    int64_t *count = calloc((size_t)n_seq, sizeof(int64_t));
    if (count == NULL) {
        mc_fail_nomem_n(err, (size_t)n_seq, sizeof(int64_t), "the read row counts of %lld sequences",
                        (long long)n_seq);
        return NULL;
    }
    int64_t most = 0;
    for (int64_t i = 0; i < n_out; i++) {
        const int64_t b = out_rows[i] / S;
        if (out_rows[i] < 0 || b >= n_seq) {
            free(count);
            mc_fail(err, MC_ERR_INTERNAL, "output row %d is outside %lld sequences of %lld", out_rows[i],
                    (long long)n_seq, (long long)S);
            return NULL;
        }
        most = ++count[b] > most ? count[b] : most;
    }
    int32_t *rows = malloc((size_t)(n_seq * most + 1) * sizeof(int32_t));
    if (rows == NULL) {
        free(count);
        mc_fail_nomem_n(err, (size_t)(n_seq * most), sizeof(int32_t), "the read rows of %lld sequences",
                        (long long)n_seq);
        return NULL;
    }
    memset(count, 0, (size_t)n_seq * sizeof(int64_t));
    for (int64_t i = 0; i < n_out; i++) {
        const int64_t b = out_rows[i] / S;
        rows[b * most + count[b]++] = (int32_t)(P + out_rows[i] % S);
    }
    for (int64_t b = 0; b < n_seq; b++)
        for (int64_t i = count[b]; i < most; i++)
            rows[b * most + i] = count[b] > 0 ? rows[b * most] : 0;
    free(count);
    *per_seq = most;
    return rows;
}

mc_status mc_mar_transformer_ex(mc_mar *m, const mc_mar_batch *batch, const int32_t *out_rows,
                                int64_t n_out, float *z_out, const mc_mar_hooks *hooks,
                                const mc_mar_read_rows *read, mc_err *err) {
    mc_backend *be = m->backend;
    const mc_ops *ops = be->ops;
    const mc_mar_config *c = &m->config;
    const int64_t B = batch->n_seq, K = batch->n_known, P = c->buffer_size, S = c->seq_len;
    const int64_t D = c->width, Dd = c->dec_width, L = P + S, rows_per = P + K;

    float *x = ACT_FLOATS(m, enc_x, (size_t)(B * rows_per * D), err);
    if (x == NULL)
        return err->status;
    MC_TRY(mc_mar_encoder_input(m, batch, x, err));
    for (int64_t i = 0; i < c->enc_depth; i++) {
        const mc_mar_kv_io io = hook_io(hooks, 0, i, L);
        MC_TRY(mc_mar_block_attn(m, &m->enc_blocks[i], x, B, rows_per, D, c->enc_heads,
                                 hooks ? &io : NULL, err));
        MC_TRY(mc_mar_block_mlp(m, &m->enc_blocks[i], x, B * rows_per, D, c->mlp_hidden, err));
    }
    MC_TRY(ops->layernorm(be, x, D, B * rows_per, D, m->enc_norm_w, m->enc_norm_b, MAR_LN_EPS, NULL,
                          NULL, 0, 1, x, D, err));

    float *f = ACT_FLOATS(m, dec_x, (size_t)(B * L * Dd), err);
    if (f == NULL)
        return err->status;
    MC_TRY(mc_mar_decoder_init(m, f, B, err));
    MC_TRY(mc_mar_decoder_input(m, x, B, K, batch->known_pos, f, err));
    if (hooks != NULL && hooks->dec_input != NULL)
        MC_TRY(ops->copy(be, hooks->dec_input, f, (size_t)(hooks->store_seq * L * Dd) * sizeof(float), err));
    for (int64_t i = 0; i + 1 < c->dec_depth; i++) {
        const mc_mar_kv_io io = hook_io(hooks, 1, i, L);
        MC_TRY(mc_mar_block_attn(m, &m->dec_blocks[i], f, B, L, Dd, c->dec_heads, hooks ? &io : NULL, err));
        MC_TRY(mc_mar_block_mlp(m, &m->dec_blocks[i], f, B * L, Dd, c->dec_mlp_hidden, err));
    }
    if (c->dec_depth > 0) {
        const int64_t last = c->dec_depth - 1;
        const mc_mar_kv_io io = hook_io(hooks, 1, last, L);
        mc_mar_read_rows from_outputs = {.n_groups = 1};
        int32_t *owned = NULL;
        if (read == NULL && n_out > 0) {
            if ((owned = read_rows_of_outputs(m, out_rows, n_out, B, &from_outputs.per_seq[0], err)) == NULL)
                return err->status;
            from_outputs.rows[0] = owned;
            read = &from_outputs;
        }
        mc_status st = mc_mar_block_read_rows(m, &m->dec_blocks[last], f, B, L, Dd, c->dec_heads,
                                              c->dec_mlp_hidden, hooks ? &io : NULL, read, err);
        free(owned);
        MC_TRY(st);
    }

    /* Final norm and diffusion_pos_embed only on the rows the head needs. */
    if (n_out == 0)
        return MC_OK;
    int32_t *host = malloc((size_t)n_out * 2 * sizeof(int32_t));
    if (host == NULL)
        return mc_fail_nomem_n(err, (size_t)n_out * 2, sizeof(int32_t), "the output row indices of %lld rows",
                               (long long)n_out);
    for (int64_t i = 0; i < n_out; i++) {
        int64_t b = out_rows[i] / S, pos = out_rows[i] % S;
        host[i] = (int32_t)(b * L + P + pos);
        host[n_out + i] = (int32_t)pos;
    }
    mc_status st = mc_mar_output_rows(m, f, host, host + n_out, n_out, NULL, NULL, z_out, err);
    free(host);
    return st;
}

mc_status mc_mar_transformer(mc_mar *m, const mc_mar_batch *batch, const int32_t *out_rows,
                             int64_t n_out, float *z_out, mc_err *err) {
    return mc_mar_transformer_ex(m, batch, out_rows, n_out, z_out, NULL, NULL, err);
}

/* ------------------------------------------------------------------- head */

mc_status mc_mar_head_cond(mc_mar *m, const float *z, int64_t rows, float *c_emb, mc_err *err) {
    const mc_mar_config *c = &m->config;
    return m->backend->ops->linear(m->backend, z, c->dec_width, rows, c->dec_width, m->cond_w,
                                   m->cond_b, c->head_width, MC_ACT_NONE, 0.0f, c_emb,
                                   c->head_width, err);
}

float *mc_mar_decoder_activations(mc_mar *mar) { return mar->acts.dec_x.data; }

const float *mc_mar_last_qkv(mc_mar *mar) { return mar->acts.qkv.data; }

mc_status mc_mar_head_activations(mc_mar *m, int64_t rows, mc_mar_head_acts *b, mc_err *err) {
    const int64_t W = m->config.head_width;
    b->y = ACT_FLOATS(m, head_y, (size_t)(rows * W), err);
    b->ada = ACT_FLOATS(m, head_ada, (size_t)(rows * 3 * W), err);
    b->h = ACT_FLOATS(m, head_h, (size_t)(rows * W), err);
    b->u = ACT_FLOATS(m, head_u, (size_t)(rows * W), err);
    b->u2 = ACT_FLOATS(m, head_u2, (size_t)(rows * W), err);
    return (b->y && b->ada && b->h && b->u && b->u2) ? MC_OK : err->status;
}

mc_status mc_mar_head_embed(mc_mar *m, const mc_mar_head_acts *b, const float *x, int64_t rows,
                            int x_duplicated, const float *c_emb, const float *t_emb, mc_err *err) {
    mc_backend *be = m->backend;
    const mc_ops *ops = be->ops;
    const int64_t W = m->config.head_width, C = m->config.token_channels;
    if (t_emb == NULL)
        return mc_fail(err, MC_ERR_INTERNAL, "head: the timestep's embedding was not prepared");
    /* SiLU(t_emb + c_emb) feeds every adaLN modulation. */
    MC_TRY(ops->copy(be, b->y, c_emb, (size_t)(rows * W) * sizeof(float), err));
    MC_TRY(ops->add_rows(be, b->y, W, rows, W, t_emb, W, 1, err));
    MC_TRY(ops->activation(be, MC_ACT_SILU, b->y, W, rows, W, err));
    int64_t x_rows = x_duplicated ? rows / 2 : rows;
    MC_TRY(ops->linear(be, x, C, x_rows, C, m->input_proj_w, m->input_proj_b, W, MC_ACT_NONE, 0.0f,
                       b->h, W, err));
    if (x_duplicated)
        MC_TRY(ops->copy(be, b->h + x_rows * W, b->h, (size_t)(x_rows * W) * sizeof(float), err));
    return MC_OK;
}

mc_status mc_mar_head_block_mlp(mc_mar *m, int64_t j, const mc_mar_head_acts *b, int64_t rows,
                                mc_err *err) {
    mc_backend *be = m->backend;
    const mc_ops *ops = be->ops;
    const mc_mar_res_block *r = &m->res_blocks[j];
    const int64_t W = m->config.head_width;
    MC_TRY(ops->linear(be, b->y, W, rows, W, r->ada_w, r->ada_b, 3 * W, MC_ACT_NONE, 0.0f, b->ada,
                       3 * W, err));
    MC_TRY(ops->layernorm(be, b->h, W, rows, W, r->in_ln_w, r->in_ln_b, MAR_LN_EPS, b->ada, b->ada + W,
                          3 * W, 1, b->u, W, err));
    MC_TRY(ops->linear(be, b->u, W, rows, W, r->mlp0_w, r->mlp0_b, W, MC_ACT_SILU, 0.0f, b->u2, W, err));
    return ops->linear(be, b->u2, W, rows, W, r->mlp2_w, r->mlp2_b, W, MC_ACT_NONE, 0.0f, b->u, W, err);
}

mc_status mc_mar_head_block_gate(mc_mar *m, int64_t j, const mc_mar_head_acts *b, int64_t rows,
                                 mc_err *err) {
    mc_backend *be = m->backend;
    const mc_mar_res_block *r = &m->res_blocks[j];
    const int64_t W = m->config.head_width;
    /* Rows 2W..3W of the adaLN Linear: the gate alone. */
    return be->ops->linear(be, b->y, W, rows, W, mc_linear_w_rows(be, r->ada_w, 2 * W, W), r->ada_b + 2 * W, W,
                           MC_ACT_NONE, 0.0f, b->ada, W, err);
}

mc_status mc_mar_head_final(mc_mar *m, const mc_mar_head_acts *b, int64_t rows, float *out, mc_err *err) {
    mc_backend *be = m->backend;
    const mc_ops *ops = be->ops;
    const int64_t W = m->config.head_width, C = m->config.token_channels;
    MC_TRY(ops->linear(be, b->y, W, rows, W, m->final_ada_w, m->final_ada_b, 2 * W, MC_ACT_NONE, 0.0f,
                       b->ada, 2 * W, err));
    MC_TRY(ops->layernorm(be, b->h, W, rows, W, NULL, NULL, MAR_LN_EPS, b->ada, b->ada + W, 2 * W, 1, b->u,
                          W, err));
    return ops->linear(be, b->u, W, rows, W, m->final_linear_w, m->final_linear_b, 2 * C, MC_ACT_NONE, 0.0f,
                       out, 2 * C, err);
}

mc_status mc_mar_head_forward(mc_mar *m, const float *x, int64_t rows, int x_duplicated,
                              const float *c_emb, const float *t_emb, float *out, mc_err *err) {
    const int64_t W = m->config.head_width;
    mc_mar_head_acts b;
    MC_TRY(mc_mar_head_activations(m, rows, &b, err));
    MC_TRY(mc_mar_head_embed(m, &b, x, rows, x_duplicated, c_emb, t_emb, err));
    for (int64_t j = 0; j < m->config.head_depth; j++) {
        MC_TRY(mc_mar_head_block_mlp(m, j, &b, rows, err));
        MC_TRY(m->backend->ops->gated_add(m->backend, b.h, W, b.u, W, b.ada + 2 * W, 3 * W, 1, rows, W, err));
    }
    return mc_mar_head_final(m, &b, rows, out, err);
}

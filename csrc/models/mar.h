/* MAR (LTH14/mar): MAE encoder, MAE decoder and the SimpleMLPAdaLN diffusion
 * head, written against the backend op table. Hyper-parameters are read back
 * from the checkpoint shapes (spec mar.md section 4). The model knows nothing
 * of sampling or caching policy: runtime/ drives it. */
#ifndef MC_MAR_H
#define MC_MAR_H

#include <stdint.h>

#include "../backend/ops.h"
#include "block_cost.h"
#include "../backend/workspace.h"
#include "../io/bind.h"
#include "../io/safetensors.h"

/* The diffusion head's training timesteps (the official cosine DDPM's 1000). */
#define MAR_BASE_TIMESTEPS 1000

typedef struct mc_mar_config {
    int64_t width;          /* encoder width D */
    int64_t enc_depth;
    int64_t enc_heads;
    int64_t dec_width;      /* decoder width Dd */
    int64_t dec_depth;
    int64_t dec_heads;
    int64_t mlp_hidden;     /* encoder MLP hidden size */
    int64_t dec_mlp_hidden;
    int64_t head_width;     /* diffusion head width W */
    int64_t head_depth;     /* number of head res blocks d */
    int64_t seq_len;        /* image tokens S */
    int64_t buffer_size;    /* class-token buffer rows P */
    int64_t token_channels; /* C */
    int64_t num_classes;
} mc_mar_config;

/* Weights of `linear` (the *_w of a Linear layer) are `void *`: they are
 * stored in the backend's linear_wtype, float32 or 16-bit. Everything
 * else (norms, biases, embeddings) is float32. */
typedef struct mc_mar_block {
    float *norm1_w, *norm1_b, *qkv_b, *proj_b;
    float *norm2_w, *norm2_b, *fc1_b, *fc2_b;
    void *qkv_w, *proj_w, *fc1_w, *fc2_w;
} mc_mar_block;

typedef struct mc_mar_res_block {
    float *in_ln_w, *in_ln_b, *mlp0_b, *mlp2_b, *ada_b;
    void *mlp0_w, *mlp2_w, *ada_w;
} mc_mar_res_block;

/* The model's named activations (backend/workspace.h): what its forward
 * passes write, grown on demand and reused across steps and calls. */
typedef struct mc_mar_acts {
    mc_buffer enc_x;      /* encoder residual stream [B', P + K, D] */
    mc_buffer dec_x;      /* decoder residual stream [B', P + S, Dd] */
    mc_buffer normed;     /* a block's normed input [rows, dim] */
    mc_buffer qkv;        /* a block's fused q, k, v [rows, 3 dim] */
    mc_buffer attn;       /* a block's attention output [rows, dim] */
    mc_buffer mlp_hidden; /* a block's MLP hidden chunk [chunk, hidden] */
    mc_buffer tokens;     /* gathered known tokens [n, C] */
    mc_buffer gather;     /* projected or gathered rows [n, D or Dd] */
    mc_buffer read_ln;    /* mc_mar_block_read_rows: every row's normed input [rows, dim] */
    mc_buffer read_x, read_q; /* ... and a group's residual rows and queries [n, dim] */
    mc_buffer head_y, head_ada, head_h, head_u, head_u2; /* mc_mar_head_acts */
    mc_buffer rows_a, rows_b, rows_c;                    /* device row indices of the current pass */
} mc_mar_acts;

/* Workspace of the layers above the model (runtime/: the sampler and the
 * cache policies), kept with the model so that a second call of the same
 * size allocates nothing. The model does not know what it holds; it only
 * frees it with the model. */
typedef struct mc_mar_attached {
    void *data;
    void (*free)(void *data, mc_backend *be);
} mc_mar_attached;

typedef struct mc_mar {
    mc_backend *backend;
    mc_mar_config config;
    mc_alloc_list weights;

    float *fake_latent, *enc_pos, *mask_token, *dec_pos, *diff_pos, *class_emb;
    void *z_proj_w;
    float *z_proj_b, *z_proj_ln_w, *z_proj_ln_b;
    mc_mar_block *enc_blocks, *dec_blocks;
    void *dec_embed_w;
    float *enc_norm_w, *enc_norm_b, *dec_embed_b, *dec_norm_w, *dec_norm_b;

    void *time_mlp0_w, *time_mlp2_w, *cond_w, *input_proj_w;
    float *time_mlp0_b, *time_mlp2_b, *cond_b, *input_proj_b;
    mc_mar_res_block *res_blocks;
    void *final_ada_w, *final_linear_w;
    float *final_ada_b, *final_linear_b;

    /* Hoisted at load: decoder rows of unknown positions before the blocks
     * (mask_token + decoder_pos_embed), and the head's time embedding for
     * every diffusion timestep it will be called with. */
    float *dec_masked_rows; /* [P + S, Dd] */
    float *time_embeddings; /* [n_timesteps, W] */
    int64_t n_timesteps;
    int32_t time_slot[MAR_BASE_TIMESTEPS]; /* row of a base timestep in time_embeddings, or -1 */
    /* Every base timestep's embedding [1000, W], made on first need by
     * mc_mar_prepare_time_embeddings (a policy that runs other timesteps than
     * the hoisted ones, e.g. DiSA's respacings); NULL until then. */
    float *base_time_embeddings;

    mc_mar_acts acts;
    /* Phase telemetry: every mc_mar_block_attn / mc_mar_block_mlp call adds
     * to the meter of the blocks it ran (encoder or decoder), whichever
     * policy called it; the sampler reports each AR step's share. */
    mc_phase_meter encoder_meter, decoder_meter;
    mc_mar_attached runtime; /* runtime/mar_workspace.h */
    void *head_graph; /* the backend's recorded head sampler steps, or NULL */
} mc_mar;

/* Loads a MAR checkpoint. `heads_override` / `dec_heads_override` <= 0 mean:
 * read metadata "heads"/"decoder_heads" if present, else the width table of
 * mar.md (768 -> 12, 1024 -> 16, 1280 -> 16). `timesteps` are the original
 * diffusion indices the head will see (tau_j), precomputed into embeddings. */
mc_status mc_mar_load(mc_backend *be, const mc_st_file *file, int heads_override,
                      const int32_t *timesteps, int64_t n_timesteps, mc_mar **out, mc_err *err);
/* Makes sure every timestep in `timesteps` has an embedding: the hoisted
 * ones have; for any other the table of all 1000 base timesteps is computed
 * once (before a run: it allocates). */
mc_status mc_mar_prepare_time_embeddings(mc_mar *mar, const int32_t *timesteps, int64_t n, mc_err *err);
/* The embedding row [W] (backend) of base timestep `timestep`: the hoisted
 * row when it has one (so the model's own timesteps keep their bits), else
 * the base table's; NULL when not prepared. */
const float *mc_mar_time_embedding(const mc_mar *mar, int32_t timestep);
void mc_mar_free(mc_mar *mar);
int64_t mc_mar_num_params(const mc_mar *mar);

/* Transformer input for B' sequences sharing one known-token count K. */
typedef struct mc_mar_batch {
    int64_t n_seq;              /* B' */
    int64_t n_known;            /* K */
    const float *tokens;        /* backend [B', S, C] */
    const int32_t *known_pos;   /* host [B', K]: known positions, ascending per row */
    const float *class_vectors; /* backend [B', D] */
} mc_mar_batch;

/* Runs encoder and decoder; writes the condition vectors of `n_out` rows
 * (out_rows, host: flat indices b * S + position) to z_out [n_out, Dd]
 * (backend memory). */
mc_status mc_mar_transformer(mc_mar *mar, const mc_mar_batch *batch, const int32_t *out_rows,
                             int64_t n_out, float *z_out, mc_err *err);

/* Where a block's fresh K/V go and what its queries attend to. With
 * k_attend == NULL queries attend to their own fresh K/V (the plain block).
 * Stores: row r of sequence b goes to slot store_slots[b * q_rows + r] (or r
 * when store_slots is NULL, host memory) of a cache with store_cap rows per
 * sequence; only the first store_seq sequences are stored. Stores happen
 * before attention, so a query can attend to a cache that already holds its
 * own fresh row. */
typedef struct mc_mar_kv_io {
    float *k_store, *v_store;
    int64_t store_seq, store_cap;
    const int32_t *store_slots;
    const float *k_attend, *v_attend;
    int64_t attend_rows, attend_cap;
} mc_mar_kv_io;

/* The rows of each sequence whose outputs of a block are read
 * (mc_mar_block_read_rows), in groups: group g's rows[g][b * per_seq[g] + i]
 * index sequence b's rows. Each group runs as its own op calls, so its rows
 * meet the same kernels as they would alone: a cache policy's full step
 * reads the predicted rows as NoCache reads them, bit for bit, and the
 * other masked rows (the condition cache's) as a second group. */
#define MC_MAR_READ_GROUPS 2
typedef struct mc_mar_read_rows {
    int n_groups;
    const int32_t *rows[MC_MAR_READ_GROUPS]; /* host [n_seq * per_seq[g]] */
    int64_t per_seq[MC_MAR_READ_GROUPS];
} mc_mar_read_rows;

/* The read rows per sequence, over the groups. */
static inline int64_t mc_mar_read_rows_per_seq(const mc_mar_read_rows *read) {
    int64_t n = 0;
    for (int g = 0; g < read->n_groups; g++)
        n += read->per_seq[g];
    return n;
}

/* Caches filled by a full pass for a cache policy (all optional). Arrays of
 * per-layer pointers may hold NULL for layers that are not cached. */
typedef struct mc_mar_hooks {
    int64_t store_seq;          /* sequences stored (the conditional half, or all) */
    float **enc_k, **enc_v;     /* [enc_depth] caches of enc_cap rows per sequence */
    int64_t enc_cap;
    float *dec_input;           /* [store_seq, P + S, Dd] decoder input */
    float **dec_k, **dec_v;     /* [dec_depth] caches of P + S rows per sequence */
} mc_mar_hooks;

/* Building blocks the cache policies compose (runtime/). */
mc_status mc_mar_block_attn(mc_mar *mar, const mc_mar_block *blk, float *x, int64_t n_seq,
                            int64_t q_rows, int64_t dim, int64_t heads, const mc_mar_kv_io *io,
                            mc_err *err);
mc_status mc_mar_block_mlp(mc_mar *mar, const mc_mar_block *blk, float *x, int64_t rows, int64_t dim,
                           int64_t hidden, mc_err *err);
/* A whole block (attention and MLP) of which only `read`'s rows are read
 * afterwards: the last decoder block, whose outputs reach the head only at
 * the predicted rows (and the condition cache at the masked ones). K and V
 * come from every row, as the attention's keys and for io's store; the
 * queries, the attention, proj and the MLP run on the read rows alone, and
 * their outputs go back into their rows of x. x's other rows keep the
 * block's input. read == NULL, no rows, or one group of every row: the
 * whole block. */
mc_status mc_mar_block_read_rows(mc_mar *mar, const mc_mar_block *blk, float *x, int64_t n_seq, int64_t q_rows,
                                 int64_t dim, int64_t heads, int64_t hidden, const mc_mar_kv_io *io,
                                 const mc_mar_read_rows *read, mc_err *err);
/* Encoder input rows [B', P + K, D] (buffer + known tokens, z_proj_ln applied). */
mc_status mc_mar_encoder_input(mc_mar *mar, const mc_mar_batch *batch, float *x, mc_err *err);
/* decoder_embed of encoder rows [n_seq, P + n_tok] (positions: host [n_seq, n_tok])
 * plus decoder_pos_embed, written into their rows of f [n_seq, P + S, Dd]. */
mc_status mc_mar_decoder_input(mc_mar *mar, const float *enc, int64_t n_seq, int64_t n_tok,
                               const int32_t *positions, float *f, mc_err *err);
/* f [n_seq, P + S, Dd] = mask_token + decoder_pos_embed. */
mc_status mc_mar_decoder_init(mc_mar *mar, float *f, int64_t n_seq, mc_err *err);
/* z_out[i] = LN(x[src_rows[i]] (+ extra[extra_rows[i]])) + diffusion_pos_embed[positions[i]]
 * (host index arrays). */
mc_status mc_mar_output_rows(mc_mar *mar, const float *x, const int32_t *src_rows, const int32_t *positions,
                             int64_t n_out, const float *extra, const int32_t *extra_rows, float *z_out,
                             mc_err *err);
/* The full transformer with optional cache fills. The last decoder block
 * runs on the rows `read` names (NULL: the rows out_rows names, or every
 * row when n_out is 0); mc_mar_decoder_activations then holds the last
 * block's outputs at those rows only. */
mc_status mc_mar_transformer_ex(mc_mar *mar, const mc_mar_batch *batch, const int32_t *out_rows,
                                int64_t n_out, float *z_out, const mc_mar_hooks *hooks,
                                const mc_mar_read_rows *read, mc_err *err);

/* Class vectors: label < 0 selects fake_latent (unconditional). */
mc_status mc_mar_class_vectors(mc_mar *mar, const int32_t *labels_host, int64_t n, float *out,
                               mc_err *err);

/* The head network on N rows at the timestep whose embedding row is `t_emb`
 * (mc_mar_time_embedding): out[N, 2C] = net(x, tau, c) where c_emb = cond_embed(c) was
 * computed by mc_mar_head_cond. x_rows = N, or N/2 with x_duplicated
 * (the CFG wrapper feeds [x; x]). */
mc_status mc_mar_head_cond(mc_mar *mar, const float *z, int64_t rows, float *c_emb, mc_err *err);
mc_status mc_mar_head_forward(mc_mar *mar, const float *x, int64_t rows, int x_duplicated,
                              const float *c_emb, const float *t_emb, float *out, mc_err *err);

/* The head's activations for `rows` rows (model workspace, grow-only): y =
 * SiLU(t_emb + c_emb), ada = adaLN modulation, h = the residual stream, u
 * and u2 = MLP scratch (u holds a block's MLP output after
 * mc_mar_head_block_mlp). */
typedef struct mc_mar_head_acts {
    float *y, *ada, *h, *u, *u2;
} mc_mar_head_acts;

/* Building blocks of one head evaluation, which mc_mar_head_forward and the
 * head cache (runtime/head_cache.c) compose: */
mc_status mc_mar_head_activations(mc_mar *mar, int64_t rows, mc_mar_head_acts *acts, mc_err *err);
/* y and h = input_proj(x) (x duplicated into both CFG halves when asked). */
mc_status mc_mar_head_embed(mc_mar *mar, const mc_mar_head_acts *acts, const float *x, int64_t rows,
                            int x_duplicated, const float *c_emb, const float *t_emb, mc_err *err);
/* Res block j: ada = adaLN(y) [rows, 3W], u = MLP(LN(h) modulated) [rows, W]; the
 * caller adds u gated by ada + 2W to h (ops->gated_add). */
mc_status mc_mar_head_block_mlp(mc_mar *mar, int64_t j, const mc_mar_head_acts *acts, int64_t rows,
                                mc_err *err);
/* Res block j's gate alone: ada [rows, W] = rows 2W..3W of its adaLN Linear. */
mc_status mc_mar_head_block_gate(mc_mar *mar, int64_t j, const mc_mar_head_acts *acts, int64_t rows,
                                 mc_err *err);
/* Final adaLN layer: out [rows, 2C]. */
mc_status mc_mar_head_final(mc_mar *mar, const mc_mar_head_acts *acts, int64_t rows, float *out, mc_err *err);

/* The decoder's last activations [B', P + S, Dd] after mc_mar_transformer_ex
 * (valid until the next transformer call; the last block's outputs only at
 * the rows it read). */
float *mc_mar_decoder_activations(mc_mar *mar);

/* The head sampler's recorded graph (ops.h capture_*), NULL until the first
 * recording; owned by the model and freed with it. */
void **mc_mar_head_graph(mc_mar *mar);
/* The fused qkv [rows, 3 * dim] of the last mc_mar_block_attn call. */
const float *mc_mar_last_qkv(mc_mar *mar);

#endif

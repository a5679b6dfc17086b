/* VAR (FoundationVision/VAR, var_fastvar.md Part A): the class-conditional
 * next-scale transformer, written against the backend op table. Every
 * hyper-parameter is read back from the checkpoint's shapes and metadata
 * (patch_nums), so a tiny test model, the digits VAR and the released
 * d16..d30 load alike. The model holds building blocks only: the scale
 * loop, sampling and the cache policies live in runtime/ (var_sampler.c,
 * var_policy.h), which compose these blocks. */
#ifndef MC_VAR_H
#define MC_VAR_H

#include <stdint.h>

#include "../backend/ops.h"
#include "../io/bind.h"
#include "../io/safetensors.h"

/* Most scales a model may have (the released models have 10). */
#define MC_VAR_MAX_SCALES 16
/* patch_nums of the released 256-px models, used when the file's metadata
 * has none (var_fastvar.md A1). */
#define MC_VAR_DEFAULT_PATCH_NUMS "1,2,3,4,5,6,8,10,13,16"

typedef struct mc_var_config {
    int64_t depth;        /* blocks */
    int64_t width;        /* C (= the condition width D) */
    int64_t heads;        /* H: scale_mul_1H11's dim 1 */
    int64_t head_dim;     /* C / H */
    int64_t ffn_hidden;   /* fc1 rows (4C in the released models) */
    int64_t vocab;        /* V: head rows */
    int64_t vae_channels; /* Cvae: word_embed columns */
    int64_t num_classes;  /* class_emb rows - 1; label num_classes is the null class */
    int n_scales;
    int64_t patch_nums[MC_VAR_MAX_SCALES];
    /* Token offset of each scale in the L-token sequence; scale_begin[n_scales] = L. */
    int64_t scale_begin[MC_VAR_MAX_SCALES + 1];
    int64_t tokens;       /* L = sum of patch_nums^2 */
} mc_var_config;

/* One AdaLNSelfAttn block. Linear weights (void *) are stored in the
 * backend's linear_wtype; everything else is float32. */
typedef struct mc_var_block {
    void *qkv_w, *proj_w, *fc1_w, *fc2_w, *ada_w;
    float *qkv_b;      /* [3C] = [q_bias; 0; v_bias], built at load */
    float *proj_b, *fc1_b, *fc2_b, *ada_b;
    float *head_scale; /* [H] = exp(min(scale_mul_1H11, float32(ln 100))), built at load */
} mc_var_block;

/* Activations, llm.c style: named buffers sized together by one function
 * (var.c's fill_in_sizes) for a run's sequences S (B' = 2B with CFG) and
 * rows per sequence R (the largest scale), grown only when a run needs more
 * and reused across scales and calls. The first group is per run (written
 * once at the start of a run, read at every scale); the rest are scratch of
 * one scale. */
typedef struct mc_var_acts {
    /* per run */
    float *cond;      /* [S, C] class embeddings (also the first scale's sos) */
    float *cond_silu; /* [S, C] SiLU(cond), the ada_lin input */
    float *block_mod; /* [depth, S, 6C]: per block and sequence gamma1, gamma2, scale1, scale2, shift1, shift2 */
    float *head_mod;  /* [S, 2C]: the head's scale, shift */
    /* per scale */
    float *x;         /* [S, R, C] the residual stream of the scale being computed */
    float *normed;    /* [S * R, C] modulated LayerNorm output (a sublayer's input) */
    float *qkv;       /* [S * R, 3C] */
    float *attn;      /* [S * R, C] attention output (heads concatenated) */
    float *sub;       /* [S * R, C] a sublayer's output before gamma */
    float *hidden;    /* [min(S * R, chunk), F] FFN hidden rows */
    float *logits;    /* [S * R, V] */
} mc_var_acts;
#define MC_VAR_NUM_ACTS 11

/* Index buffers (int32, backend memory), sized with the activations. */
typedef struct mc_var_index_acts {
    int32_t *labels;   /* [S] class rows of the conditioning */
    int32_t *rows;     /* [S * R] row lists of gathers (the first scale's sos rows) */
    int32_t *kv_slots; /* [S * R] cache rows a K/V append writes */
} mc_var_index_acts;
#define MC_VAR_NUM_INDEX_ACTS 3

typedef struct mc_var {
    mc_backend *backend;
    mc_var_config config;
    mc_alloc_list weights;

    float *pos_start;  /* [first, C], first = patch_nums[0]^2 */
    float *lvl_pos;    /* [L, C] = lvl_embed[scale of token] + pos_1LC, built at load */
    float *class_emb;  /* [num_classes + 1, C] */
    void *word_embed_w;
    float *word_embed_b;
    void *head_ada_w, *head_w;
    float *head_ada_b, *head_b;
    mc_var_block *blocks;

    /* Activations and their sizes (floats / ints) as allocated. */
    mc_var_acts acts;
    size_t act_floats[MC_VAR_NUM_ACTS];
    mc_var_index_acts index_acts;
    size_t index_act_count[MC_VAR_NUM_INDEX_ACTS];
    int64_t acts_seq, acts_rows; /* the S and R the activations were last sized for */
    int64_t cond_seq;            /* sequences of the last mc_var_condition (block_mod's S) */

    /* The KV cache: per block, k and v of kv_seq sequences of kv_capacity
     * (= L) rows each, [kv_seq, L, C]; the (normalized) k and v of a scale's
     * rows are appended at the rows a caller names. Grown with the
     * activations. */
    float **k_cache, **v_cache;
    size_t kv_floats; /* floats of each k_cache[i] / v_cache[i] */
    int64_t kv_seq;
    /* The K/V rows last uploaded to index_acts.kv_slots: appends with the
     * same sequences, rows and start reuse them (every block of a scale). */
    int64_t slots_seq, slots_rows, slots_start;
} mc_var;

/* Loads a VAR transformer from a safetensors file in the official key layout
 * (var_fastvar.md A3; buffers may be absent). Hyper-parameters come from the
 * shapes; patch_nums from metadata "patch_nums" ("1,2,3,..."; the released
 * models' list when absent), checked against pos_1LC (L) and lvl_embed
 * (number of scales). A file without blocks.*.attn.scale_mul_1H11 is refused
 * naming the key: only attn_l2_norm models are supported. */
mc_status mc_var_load(mc_backend *be, const mc_st_file *file, mc_var **out, mc_err *err);
void mc_var_free(mc_var *var);
/* Parameters (buffers excluded), var_fastvar.md A3's count. */
int64_t mc_var_num_params(const mc_var *var);

/* Sizes the activations and the KV cache for n_seq sequences of at most
 * max_rows rows per scale (grow-only: nothing is freed or moved when they
 * are large enough already, so a run reserves once before its loop and
 * nothing grows inside it). Moving buffers loses their contents: reserve
 * before mc_var_condition. */
mc_status mc_var_reserve(mc_var *var, int64_t n_seq, int64_t max_rows, mc_err *err);

/* The run's class conditioning (A4 step 3, A5.1 step 1, A5.4), computed once
 * per run: cond = class_emb[labels] (host int32 [n_seq]; num_classes is the
 * null class), and every block's ada_lin(SiLU(cond)) and the head's, into
 * acts.cond, cond_silu, block_mod and head_mod. Needs mc_var_reserve for at
 * least n_seq sequences. */
mc_status mc_var_condition(mc_var *var, const int32_t *labels, int64_t n_seq, mc_err *err);

/* The first scale's input (A4 step 5): x [n_seq, first, C] = cond + pos_start
 * + lvl_pos[0 .. first), with cond from mc_var_condition. */
mc_status mc_var_first_input(mc_var *var, int64_t n_seq, float *x, mc_err *err);

/* A later scale's input (A4 step 7): x [n_maps, n, C] = word_embed(next
 * [n_maps, n, Cvae]) + lvl_pos[rows of scale si], then copied `copies` - 1
 * more times after itself (the CFG halves get identical inputs), so x holds
 * copies * n_maps sequences. */
mc_status mc_var_scale_input(mc_var *var, int si, const float *next, int64_t n_maps, int copies, float *x,
                             mc_err *err);

/* Where a sublayer's gamma * output goes. */
typedef enum mc_var_out_mode {
    MC_VAR_OUT_ADD = 0, /* out += gamma * sublayer (out is the residual x) */
    MC_VAR_OUT_SET = 1  /* out = gamma * sublayer (FastVAR keeps it) */
} mc_var_out_mode;

/* The attention sublayer of block `block` (A5.1 step 2, A5.2) on rows x
 * [n_seq, rows, C] (all rows of the scale, or a kept subset): a = modulated
 * LN(x); qkv = a W^T + [q_bias; 0; v_bias]; q, k L2-normalized per head, q
 * times the head scale; the rows' k and v are appended to the block's KV
 * cache at rows [kv_used, kv_used + rows) of each sequence; the queries
 * attend (softmax scale 1, no mask) to cache rows [0, kv_used + rows); the
 * output goes through proj and is multiplied by gamma1 into `out`
 * ([n_seq, rows, C], per `mode`). out may be x with MC_VAR_OUT_ADD. The
 * conditioning of sequence b is row b of mc_var_condition's. */
mc_status mc_var_attn_sublayer(mc_var *var, int block, const float *x, int64_t n_seq, int64_t rows,
                               int64_t kv_used, float *out, mc_var_out_mode mode, mc_err *err);

/* The FFN sublayer (A5.1 step 3, A5.3): f = modulated LN(x); fc2(gelu_tanh(
 * fc1(f))) times gamma2 into out, as the attention sublayer. */
mc_status mc_var_ffn_sublayer(mc_var *var, int block, const float *x, int64_t n_seq, int64_t rows, float *out,
                              mc_var_out_mode mode, mc_err *err);

/* All blocks in place on x [n_seq, rows, C], every row, the scale's K/V
 * appended at [kv_used, kv_used + rows): the plain transformer of a scale. */
mc_status mc_var_blocks(mc_var *var, float *x, int64_t n_seq, int64_t rows, int64_t kv_used, mc_err *err);

/* Logits (A5.4): head(head_nm(x)) for x [n_seq, rows, C] into logits
 * [n_seq * rows, V]. */
mc_status mc_var_logits(mc_var *var, const float *x, int64_t n_seq, int64_t rows, float *logits, mc_err *err);

/* Block `block`'s KV cache: k and v [kv_seq, L, C] (row stride C, sequence
 * stride L * C), valid after mc_var_reserve. */
float *mc_var_k_cache(mc_var *var, int block);
float *mc_var_v_cache(mc_var *var, int block);

/* Parses a patch_nums list ("1,2,3": 1..MC_VAR_MAX_SCALES positive integers
 * separated by commas) into nums; returns the count, or 0 when malformed. */
int mc_var_parse_patch_nums(const char *text, int64_t nums[MC_VAR_MAX_SCALES]);

#endif

/* The state LazyMAR and MARche keep between AR steps, and the pieces of a
 * step both compose (lazymar.md 5-6, marche.md 2-3): per-layer encoder K/V
 * (the encoder token cache), the decoder input, decoder K/V of the layers
 * that attend to a cache, the condition cache (CFG diff at the last block),
 * the previous step's predicted positions, and the head cache. Only the rows
 * a later step reads are stored. */
#ifndef MC_MAR_CACHES_H
#define MC_MAR_CACHES_H

#include <stddef.h>
#include <stdint.h>

#include "head_cache.h"
#include "mar_policy.h"
#include "mar_workspace.h"

/* A named policy activation (mar_workspace.h) grown to `count` elements. */
#define MC_POLICY_FLOATS(tc, name, count, err)                                                                 \
    mc_buffer_floats((tc)->mar->backend, &(tc)->acts->name, (count), "policy." #name, (err))
#define MC_POLICY_INTS(tc, name, count, err)                                                                   \
    mc_buffer_ints((tc)->mar->backend, &(tc)->acts->name, (count), "policy." #name, (err))

typedef struct mc_mar_caches {
    mc_mar *mar;
    mc_mar_policy_acts *acts;      /* the policies' named activations (mar_workspace.h) */
    int64_t n_images, n_cache_seq; /* B, and the sequences with token caches */
    int cfg_on;
    int encoder_cache;             /* the encoder token cache is on */
    int cond_cache;                /* the condition cache is on (and CFG is) */
    int64_t enc_filled;            /* encoder cache rows filled per sequence (P + visible) */
    float **enc_k, **enc_v;        /* [enc_depth] of [n_cache_seq, L, D], or NULL tables */
    float *dec_input;              /* [n_cache_seq, L, Dd] */
    float **dec_k, **dec_v;        /* [dec_depth]; only the layers that attend to a cache */
    float *cond_diff;              /* [B, L, Dd] (condition cache) */
    int32_t *prev_pred;            /* host [B, S]: positions predicted at the previous step */
    int64_t n_prev;
    float *scores_host;            /* [n_cache_seq * L] */
    int32_t *kept;                 /* [n_cache_seq * L]: rows kept (active) at the last cached step */
    int32_t *order;                /* [L] ranking scratch */
    uint8_t *taken;                /* [L] selection scratch */
    int32_t *read_rows;            /* [2 n_images * L]: rows the last decoder block's outputs are read at */
    mc_head_cache_state head;
    size_t bytes;                  /* backend bytes of the token and condition caches */
} mc_mar_caches;

/* `token_tables`: the policy prunes decoder rows on cached steps, so the K/V
 * tables exist (layers first_cached_layer.. get buffers). */
mc_status mc_mar_caches_init(mc_mar_caches *tc, mc_mar *mar, const mc_mar_run_shape *run, int encoder_cache,
                             int cond_cache, int token_tables, int64_t first_cached_layer,
                             const mc_head_cache_config *head, mc_err *err);
void mc_mar_caches_release(mc_mar_caches *tc);
/* The policy ops a policy whose state begins with an mc_mar_caches shares:
 * size the head cache, plan the step's head, the bytes held. */
mc_status mc_mar_caches_plan(void *state, int64_t most_live_rows, mc_err *err);
mc_status mc_mar_caches_head_plan(void *state, const mc_mar_step *step, int n_diffusion_steps,
                                  mc_mar_head_plan *plan, mc_err *err);
size_t mc_mar_caches_cache_bytes(const void *state);
/* Releases a policy state that holds nothing beyond its mc_mar_caches. */
void mc_mar_caches_release_state(void *state);
/* The ops table of such a policy: its state is <prefix>_state, <prefix>_check,
 * _init and _transformer are its own, the rest the shared ones above, and
 * `release_state` releases what its state holds. */
#define MC_MAR_CACHED_POLICY_OPS(prefix, policy_name, field_table, config_type, release_state)                \
    {.schema = {policy_name, field_table, sizeof(config_type)}, .check = prefix##_check,                      \
     .state_size = sizeof(prefix##_state), .init = prefix##_init, .plan = mc_mar_caches_plan,                 \
     .transformer = prefix##_transformer, .head_plan = mc_mar_caches_head_plan,                               \
     .cache_bytes = mc_mar_caches_cache_bytes, .release = release_state}
/* A backend buffer counted in the cache bytes (freed by mc_mar_caches_release
 * only if stored in one of the struct's fields; policies release their own).
 * what_fmt names it (printf-style) in an out-of-memory message. */
float *mc_mar_caches_buffer(mc_mar_caches *tc, size_t floats, mc_err *err, const char *what_fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;

/* A full step: the plain model, filling every cache. `select_v` (or NULL)
 * replaces decoder layer `select_layer`'s V store (LazyMAR's ranking V). */
mc_status mc_mar_caches_full_step(mc_mar_caches *tc, const mc_mar_step *s, float *select_v, int64_t select_layer,
                                  float *z, mc_mar_transformer_stats *stats, mc_err *err);
/* A cached step with the condition cache alone: the plain transformer on
 * the conditional sequences, the unconditional rows from the diff. */
mc_status mc_mar_caches_cond_only_step(mc_mar_caches *tc, const mc_mar_step *s, float *z,
                                       mc_mar_transformer_stats *stats, mc_err *err);

/* A policy's decoder on a cached step: f [nc, L, Dd] holds the decoder input;
 * it picks `count` rows per sequence into `rows` and leaves their outputs in
 * *out ([nc, count, Dd]). */
typedef mc_status (*mc_mar_cached_decoder)(void *policy, const mc_mar_step *s, float *f, int32_t *rows,
                                           int64_t count, float **out, double *flops, mc_err *err);
/* A cached step: the encoder phase (token cache or plain), the policy's
 * decoder on `keep` rows per sequence, the output rows. */
mc_status mc_mar_caches_cached_step(mc_mar_caches *tc, const mc_mar_step *s, int64_t keep,
                                    mc_mar_cached_decoder decoder, void *policy, float *z,
                                    mc_mar_transformer_stats *stats, mc_err *err);

/* Decoder layers [first, last) on every row of f. */
mc_status mc_mar_caches_full_layers(mc_mar_caches *tc, float *f, int64_t first, int64_t last, double *flops,
                                    mc_err *err);
/* A decoder's row selection from the scores in tc->scores_host [nc, L]:
 * each sequence's `keep` rows (mc_rows_choose: the rows predicted now and at
 * the previous step forced, the others ranked from `first_candidate` on)
 * into kept [nc, keep], and those rows of f [nc, L, Dd] gathered into the
 * policy's kept-row buffer, *xk [nc * keep, Dd]. */
mc_status mc_mar_caches_keep_rows(mc_mar_caches *tc, const mc_mar_step *s, const float *f, int64_t first_candidate,
                                  int32_t *kept, int64_t keep, float **xk, mc_err *err);
/* Layers [first, depth) on the kept rows xk [nc, keep]: their fresh K/V go
 * into each layer's cache, and they attend to all P + S cached rows. The
 * last layer's outputs are computed at the rows predicted now alone (what
 * the step emits; mc_mar_block_read_rows). */
mc_status mc_mar_caches_cache_aware_layers(mc_mar_caches *tc, const mc_mar_step *s, float *xk, const int32_t *kept,
                                           int64_t keep, int64_t first, double *flops, mc_err *err);
/* A step without CFG inside a CFG run (a composing policy made it
 * guidance-free) is valid only when the caches hold the conditional half alone. */
mc_status mc_mar_caches_check_step(const mc_mar_caches *tc, const mc_mar_step *s, const char *policy, mc_err *err);
/* After a step: remember its predicted positions. */
void mc_mar_caches_remember(mc_mar_caches *tc, const mc_mar_step *s);

#endif

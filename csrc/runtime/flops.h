/* FLOP counts of what the engine computes: GEMMs and attention matmuls,
 * 2 FLOPs per multiply-add (mar.md 13), one function per block kind.
 * marcache/flops.py mirrors these (tests/test_policy_seams.py holds them equal). */
#ifndef MC_FLOPS_H
#define MC_FLOPS_H

#include <stdint.h>

#include "../models/mar.h"
#include "head_cache.h"

/* qkv + proj of q_rows rows per sequence, and attention against `keys` rows. */
double mc_flops_block_attn(int64_t n_seq, int64_t q_rows, int64_t keys, int64_t dim);
double mc_flops_block_mlp(int64_t rows, int64_t dim, int64_t hidden);
/* MAR encoder pass: z_proj of `new_tokens` tokens per sequence, the encoder
 * blocks on q_rows rows against `keys` rows, decoder_embed of the q_rows rows. */
double mc_flops_mar_encoder(const mc_mar_config *c, int64_t n_seq, int64_t new_tokens, int64_t q_rows,
                            int64_t keys);
/* The uncached MAR transformer of one AR step with n_known known tokens. */
double mc_mar_transformer_flops(const mc_mar_config *c, int64_t n_seq, int64_t n_known);
/* One head evaluation on `rows` rows whose x part has `x_rows` rows. */
double mc_flops_head_eval(const mc_mar_config *c, int64_t rows, int64_t x_rows, mc_head_mode mode,
                          int skip_first, int skip_last);

#endif

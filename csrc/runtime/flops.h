/* FLOP counts of what the engine computes: GEMMs and attention matmuls,
 * 2 FLOPs per multiply-add (mar.md 13), one function per block kind.
 * marcache/flops.py mirrors these (tests/test_policy_seams.py holds them equal). */
#ifndef MC_FLOPS_H
#define MC_FLOPS_H

#include <stdint.h>

#include "../models/block_cost.h" /* mc_flops_block_attn, mc_flops_block_mlp */
#include "../models/mar.h"
#include "../models/var.h"
#include "head_cache.h"

/* MAR encoder pass: z_proj of `new_tokens` tokens per sequence, the encoder
 * blocks on q_rows rows against `keys` rows, decoder_embed of the q_rows rows. */
double mc_flops_mar_encoder(const mc_mar_config *c, int64_t n_seq, int64_t new_tokens, int64_t q_rows,
                            int64_t keys);
/* The uncached MAR transformer of one AR step with n_known known tokens,
 * the last decoder block read at `read_rows` rows per sequence
 * (mc_mar_block_read_rows; P + S: every row). */
double mc_mar_transformer_flops(const mc_mar_config *c, int64_t n_seq, int64_t n_known, int64_t read_rows);
/* One head evaluation on `rows` rows whose x part has `x_rows` rows. */
double mc_flops_head_eval(const mc_mar_config *c, int64_t rows, int64_t x_rows, mc_head_mode mode,
                          int skip_first, int skip_last);

/* VAR (var_fastvar.md Part E, with every GEMM the engine dispatches). */
/* The run's conditioning, computed once per run (not per scale as the
 * official loop does): every block's ada_lin (6C x C) and the head's (2C x C)
 * on n_seq sequences. */
double mc_var_flops_conditioning(const mc_var_config *c, int64_t n_seq);
/* word_embed of a later scale's input: n_maps maps of `tokens` tokens (the
 * CFG copy is a copy, not a GEMM). */
double mc_var_flops_scale_input(const mc_var_config *c, int64_t n_maps, int64_t tokens);
/* One block's attention sublayer on `rows` rows per sequence attending to
 * `keys` rows (qkv, proj, q k^T and p v), and its FFN sublayer. */
double mc_var_flops_attn_sublayer(const mc_var_config *c, int64_t n_seq, int64_t rows, int64_t keys);
double mc_var_flops_ffn_sublayer(const mc_var_config *c, int64_t n_seq, int64_t rows);
/* One FastVAR block (var_fastvar.md D8): its attention on attn_rows rows
 * per sequence (the kept rows at a pruned scale, all rows otherwise)
 * attending to attn_keys rows (the block's K/V after the append), its FFN
 * on ffn_rows rows. The pivotal scores, gathers, the area up-sampling of the
 * cached outputs and the scatter are not counted (no GEMM; Part E's rules). */
double mc_var_flops_fastvar_block(const mc_var_config *c, int64_t n_seq, int64_t attn_rows, int64_t attn_keys,
                                  int64_t ffn_rows);
/* Every block on every row of a scale. */
double mc_var_flops_blocks(const mc_var_config *c, int64_t n_seq, int64_t rows, int64_t keys);
/* The head on `rows` rows (all sequences). */
double mc_var_flops_logits(const mc_var_config *c, int64_t rows);
/* more_smooth: the Gumbel probabilities times the codebook on `rows` rows. */
double mc_var_flops_smooth(const mc_var_config *c, int64_t rows);

#endif

/* Counter-based randomness (Philox-4x32-10, Salmon et al. 2011, as in cuRAND
 * and JAX). Every draw is a pure function of (seed, image index, stream,
 * position, step, element), so an image does not depend on the batch it was
 * generated in, on the backend, or on how a sweep was sharded.
 *
 * Counter layout (the contract the NumPy reference in tests/ re-implements):
 *   key     = (seed & 0xffffffff, seed >> 32)
 *   counter = (c0 = element block, c1 = image index, c2 = position,
 *              c3 = stream << 16 | step)
 *   MC_STREAM_ORDER: one 32-bit word per token position p: word p % 4 of the
 *       block c0 = p / 4, c2 = 0, step 0. The generation order is the
 *       positions sorted by (word, p) ascending.
 *   MC_STREAM_HEAD_INIT: initial head noise of token position p; channel ch
 *       is normal ch % 4 of block c0 = ch / 4, c2 = p, step 0.
 *   MC_STREAM_HEAD_STEP: noise added at diffusion index j (1..99) to token p:
 *       as above with step = j.
 *   MC_STREAM_VAR_SAMPLE: VAR's categorical draw of token position p (its
 *       index in the whole multi-scale sequence) at scale si: one uniform
 *       u = w / 2^32 in [0, 1) from word 0 of block c0 = 0, c2 = p,
 *       step = si (the sample_tokens op).
 *   MC_STREAM_VAR_GUMBEL: VAR's more_smooth Gumbel noise of token position p
 *       at scale si: vocabulary entry j uses word j % 4 of block c0 = j / 4,
 *       c2 = p, step = si, as u = (w + 0.5) / 2^32 in (0, 1) (the
 *       gumbel_softmax op).
 * Normals: Box-Muller in double on word pairs (w0, w1) -> (z0, z1) and
 *   (w2, w3) -> (z2, z3): u1 = (wa + 1) / 2^32, u2 = wb / 2^32,
 *   z = sqrt(-2 ln u1) * (cos 2 pi u2, sin 2 pi u2), rounded to float.
 * Indexing noise by token position (not by AR step or batch row) means a
 * cached and an uncached run, or runs with different step counts, give each
 * token the same noise. */
#ifndef MC_PHILOX_H
#define MC_PHILOX_H

#include <stdint.h>

enum {
    MC_STREAM_ORDER = 0,
    MC_STREAM_HEAD_INIT = 1,
    MC_STREAM_HEAD_STEP = 2,
    MC_STREAM_VAR_SAMPLE = 3,
    MC_STREAM_VAR_GUMBEL = 4
};

void mc_philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]);

/* The 4 words of block `block` for (seed, image, stream, position, step). */
void mc_philox_block(uint64_t seed, uint32_t image, uint32_t stream, uint32_t position,
                     uint32_t step, uint32_t block, uint32_t out[4]);

/* `count` standard normals for one token (count <= 64; channels 0..count-1). */
void mc_philox_token_normals(uint64_t seed, uint32_t image, uint32_t stream, uint32_t position,
                             uint32_t step, int count, float *out);

#define MC_PHILOX_ORDER_MAX 1024

/* Generation order of one image: a permutation of 0..n-1 (n <= MC_PHILOX_ORDER_MAX). */
void mc_philox_order(uint64_t seed, uint32_t image, int n, int32_t *order_out);

#endif

/* The arithmetic of Philox-4x32-10 and of the Box-Muller normals, as inline
 * functions that compile both as C11 (philox.c, the CPU) and as CUDA device
 * code (the CUDA backend's token_normals), so both backends run the same
 * source. The counter contract is in philox.h.
 *
 * Bitwise agreement of the normals across backends: the Philox words are
 * integer arithmetic and identical. Box-Muller runs in double and rounds
 * once to float; CUDA's double log/sin/cos are within 1-2 ulp of glibc's,
 * so the float results can differ only when the double value lies within a
 * couple of double ulps of a float rounding boundary (about 2^-28 per
 * normal). The op test compares the CUDA normals with the float64 reference
 * bit for bit. */
#ifndef MC_PHILOX_INLINE_H
#define MC_PHILOX_INLINE_H

#include <stdint.h>

#if defined(__CUDACC__)
#define MC_PHILOX_FN static __host__ __device__ __forceinline__
#else
#include <math.h>
#define MC_PHILOX_FN static inline
#endif

#define MC_PHILOX_M0 0xD2511F53u
#define MC_PHILOX_M1 0xCD9E8D57u
#define MC_PHILOX_W0 0x9E3779B9u
#define MC_PHILOX_W1 0xBB67AE85u

/* Ten rounds on counter (c0..c3) with key (k0, k1); the result in out[4]. */
MC_PHILOX_FN void mc_philox4x32_10_inline(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                          uint32_t k0, uint32_t k1, uint32_t out[4]) {
    for (int round = 0; round < 10; round++) {
        uint64_t p0 = (uint64_t)MC_PHILOX_M0 * c0;
        uint64_t p1 = (uint64_t)MC_PHILOX_M1 * c2;
        uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
        uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += MC_PHILOX_W0;
        k1 += MC_PHILOX_W1;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

/* The 4 words of block `block` for (seed, image, stream, position, step). */
MC_PHILOX_FN void mc_philox_block_inline(uint64_t seed, uint32_t image, uint32_t stream,
                                         uint32_t position, uint32_t step, uint32_t block,
                                         uint32_t out[4]) {
    mc_philox4x32_10_inline(block, image, position, (stream << 16) | (step & 0xffffu),
                            (uint32_t)(seed & 0xffffffffu), (uint32_t)(seed >> 32), out);
}

/* Box-Muller in double on one word pair, each normal rounded once to float. */
MC_PHILOX_FN void mc_box_muller_inline(uint32_t wa, uint32_t wb, float *z0, float *z1) {
    const double two_pi = 6.283185307179586476925286766559;
    double u1 = ((double)wa + 1.0) / 4294967296.0;
    double u2 = (double)wb / 4294967296.0;
    double r = sqrt(-2.0 * log(u1));
    *z0 = (float)(r * cos(two_pi * u2));
    *z1 = (float)(r * sin(two_pi * u2));
}

#endif

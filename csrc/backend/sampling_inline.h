/* Pieces of VAR's sampling ops (sample_tokens, gumbel_softmax; contracts in
 * ops_list.h) that the CPU (cpu_sampling.c) and CUDA (cuda_sampling.cu)
 * backends share as one source: the order key of a float and how a row of
 * logits that cannot be sampled is classified; and the order FastVAR's
 * pivotal_rows selects rows in (cpu_dense.c, cuda_dense.cu). Compiles as C11 and as CUDA
 * host/device code, like core/philox_inline.h. */
#ifndef MC_SAMPLING_INLINE_H
#define MC_SAMPLING_INLINE_H

#include <stdint.h>

#if defined(__CUDACC__)
#define MC_SAMPLING_FN static __host__ __device__ __forceinline__
#else
#include <string.h>
#define MC_SAMPLING_FN static inline
#endif

/* What is wrong with a row of logits (MC_ROW_FINE: nothing). A row is
 * classified by the first that applies: it holds a NaN; it holds +inf; it
 * has no finite entry (all -inf). */
enum { MC_ROW_FINE = 0, MC_ROW_NAN = 1, MC_ROW_POS_INF = 2, MC_ROW_NO_FINITE = 3 };

MC_SAMPLING_FN uint32_t mc_float_bits(float v) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(v);
#else
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return bits;
#endif
}

MC_SAMPLING_FN float mc_bits_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(bits);
#else
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
#endif
}

/* A key whose unsigned order is the order of the (non-NaN) float values:
 * positive floats get the sign bit set, negative ones are inverted. -0 is
 * first made +0, so equal values have equal keys (-inf has the smallest key,
 * 0x007fffff). Sorting (key << 32 | index) ascending is then the stable
 * ascending (value, index) order of the contracts. */
MC_SAMPLING_FN uint32_t mc_logit_order_key(float v) {
    uint32_t bits = mc_float_bits(v == 0.0f ? 0.0f : v);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

/* The float of an order key (the inverse of mc_logit_order_key). */
MC_SAMPLING_FN float mc_logit_key_value(uint32_t key) {
    return mc_bits_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

/* pivotal_rows' order: 1 when row a (score sa) comes before row b (score
 * sb): a larger score, or an equal one and the lower index. A NaN score is
 * larger than any number and equal to another NaN, so the order is total
 * and a selection of the first `keep` rows always has `keep` rows. */
MC_SAMPLING_FN int mc_pivotal_before(double sa, int64_t a, double sb, int64_t b) {
    const int nan_a = sa != sa, nan_b = sb != sb;
    if (nan_a || nan_b)
        return nan_a && (!nan_b || a < b);
    return sa > sb || (sa == sb && a < b);
}

#endif

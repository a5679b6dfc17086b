/* 16-bit floating point storage: bfloat16 and IEEE binary16, converted with
 * round-to-nearest-even like the CUDA intrinsics __float2bfloat16_rn and
 * __float2half_rn, so weights rounded on the host and activations rounded
 * by a kernel agree bit for bit. The element type that a backend's `linear`
 * reads its weights in is an mc_wtype (ops.h). */
#ifndef MC_HALF_H
#define MC_HALF_H

#include <stdint.h>
#include <string.h>

static inline uint32_t mc_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float mc_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float mc_bf16_to_f32(uint16_t h) { return mc_bits_f32((uint32_t)h << 16); }

static inline uint16_t mc_f32_to_bf16(float f) {
    uint32_t u = mc_f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) /* NaN: keep it a (quiet) NaN */
        return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7FFFu + ((u >> 16) & 1u); /* ties to even; overflow carries into inf */
    return (uint16_t)(u >> 16);
}

static inline float mc_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1Fu;
    uint32_t mantissa = h & 0x3FFu;
    if (exponent == 0) {
        float magnitude = (float)mantissa * 0x1p-24f; /* zero or subnormal, exact */
        return sign ? -magnitude : magnitude;
    }
    if (exponent == 31)
        return mc_bits_f32(sign | 0x7F800000u | (mantissa << 13));
    return mc_bits_f32(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

static inline uint16_t mc_f32_to_f16(float f) {
    uint32_t u = mc_f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t abs = u & 0x7FFFFFFFu;
    if (abs > 0x7F800000u) /* NaN */
        return (uint16_t)(sign | 0x7E00u | ((abs >> 13) & 0x3FFu));
    if (abs >= 0x477FF000u) /* rounds to 65520 or more: infinity */
        return (uint16_t)(sign | 0x7C00u);
    if (abs < 0x38800000u) {
        /* Below 2^-14: a subnormal half, an integer count q of 2^-24 units.
         * q is the float's 24-bit significand shifted right; the dropped
         * bits decide the rounding (ties to even). */
        int32_t exp = (int32_t)(abs >> 23);
        if (exp < 102) /* below 2^-25: rounds to zero */
            return sign;
        uint32_t mant = (abs & 0x7FFFFFu) | 0x800000u;
        int shift = 126 - exp; /* 14..24 */
        uint32_t q = mant >> shift;
        uint32_t rem = mant & ((1u << shift) - 1u), halfway = 1u << (shift - 1);
        if (rem > halfway || (rem == halfway && (q & 1u)))
            q++;
        return (uint16_t)(sign | q);
    }
    /* Normal: rebias the exponent, round the 13 dropped mantissa bits to
     * nearest even; a carry into the exponent is the correct result. */
    uint32_t rebiased = abs - (112u << 23);
    rebiased += 0xFFFu + ((rebiased >> 13) & 1u);
    return (uint16_t)(sign | (rebiased >> 13));
}

#endif

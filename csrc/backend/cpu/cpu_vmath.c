/* The CPU's vector math: expf, the attention softmax rows on it, the MLP's
 * exact-erf GELU and the head's SiLU (issue 23: a profile of a batch-1 MAR-B
 * image found 4.5% of its samples in the attention softmax, one scalar glibc
 * expf per score and a serial sum, 5.7% in the GELU, one scalar glibc erff
 * per element, and 0.9% in the SiLU's scalar glibc expf).
 *
 * mc_expf is written with IEEE operations only (multiply, add, fma, round to
 * nearest integer, exact scaling by powers of two), so the plain form below,
 * the AVX-512 form and the AVX2 form give the same bits for every input, on
 * every machine and C library: a softmax row does not depend on the ISA
 * chosen (MARCACHE_CPU_ISA) or on glibc's version.
 *
 * The algorithm (Cephes' expf): n = round(x log2 e); r = x - n ln2 with ln2
 * split in two (Cody-Waite; each step one fma); e^r on [-ln2/2, ln2/2] by a
 * degree-5 polynomial p with e^r ~ 1 + r + r^2 p(r); then 2^n applied as two
 * exact power-of-two factors (n = n1 + n2, each a normal float), so results
 * that underflow to subnormals are rounded once, as the true value would be.
 * x is clamped to [-104, 89] first: e^-104 rounds to 0 and e^89 to inf. NaN
 * stays NaN. tests/test_vmath.py holds it within 2 ulp of the float64 exp
 * over the whole range (at most 1.01 ulp over 2 million points, measured).
 *
 * The softmax row (same arithmetic everywhere): m = the row's max (exact);
 * e_j = mc_expf(s_j - m); lane l = j % 16 sums the e_j of its columns in
 * increasing j; the 16 lanes are summed in mc_smallrow_reduce16's fixed tree;
 * every e_j is multiplied by 1 / sum.
 *
 * mc_gelu_erf, GELU(x) = x/2 (1 + erf(x / sqrt 2)) = x/2 g(x), from the same
 * IEEE operations (and mc_expf), so again the same bits on every ISA:
 *   |x| < 0.85:  g = 1 + x P(x^2), P of degree 5;
 *   |x| >= 0.85: with y = |x|, erfc(y / sqrt 2) = e^(-y^2/2) F(t) / y,
 *                t = 1 / (1 + y/2), F of degree 10; g = 2 - that for x > 0
 *                and g = that for x < 0.
 * The far form computes 1 + erf for negative x directly instead of as
 * 1 - (1 - erfc): the glibc form 0.5 x (1 + erff(x / sqrt 2)) cancels there
 * (up to 12 ulp on [-2, -0.85], and 1e7 ulp on the tail where erff rounds to
 * -1). e^(-y^2/2) is taken as e^(-h/2) (1 - l/2) with h + l = y^2 exactly
 * (l from an fma), so the rounding of y^2 (which would cost y^2/2 ulp, 100
 * ulp at y = 14) does not enter. F carries y's dependence smoothly (0.43 to
 * 0.80), so t's own rounding moves it little; y is clamped to [0.85, 15] in
 * the far form (e^(-y^2/2) is 0 in float32 past 14.4, and the clamp keeps the
 * unused lanes finite). P and F are minimax fits on relative error with
 * float32 coefficients (each rounded in turn, the higher ones refitted:
 * tools/fit_gelu_erf.py). tests/test_vmath.py holds GELU within 6 ulp of the
 * float64 GELU wherever the result is a normal float (5.7 measured over every
 * 37th float in (-16, 16), 59 million; 1.7 for x > -0.85; the glibc form: up
 * to 1.7e7 on the negative tail), and the ISAs bit-equal. Its absolute error
 * is at most 1.3x the glibc form's on [-2, -0.85] and smaller elsewhere.
 * Cost: 1.0 ns an element with AVX-512, 1.7 with AVX2, 19 in the plain form
 * (one core, measured with _cpu_gelu; the glibc form: 12-13 ns). NaN stays
 * NaN; GELU(-inf) is NaN, as -inf * 0 is in PyTorch's
 * x * 0.5 * (1 + erf(x / sqrt 2)). */
#include <math.h>
#include <string.h>

#include "cpu_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#define MC_VMATH_X86 1
#include <immintrin.h>
#else
#define MC_VMATH_X86 0
#endif

#define EXP_LO (-104.0f)
#define EXP_HI 89.0f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO (-2.12194440e-4f)
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

/* mc_gelu_erf's constants (tools/fit_gelu_erf.py prints them). */
#define GELU_NEAR 0.85f /* |x| below: the near form */
#define GELU_FAR_MAX 15.0f
#define GELU_P0 0.7978846f
#define GELU_P1 -0.13298227f
#define GELU_P2 0.01996348f
#define GELU_P3 -0.0024370572f
#define GELU_P4 0.00032784327f
#define GELU_P5 -7.0721704e-05f
#define GELU_F0 0.7978846f
#define GELU_F1 -5.382782e-06f
#define GELU_F2 -0.19926332f
#define GELU_F3 -0.40179253f
#define GELU_F4 -0.4336533f
#define GELU_F5 -0.19679959f
#define GELU_F6 -0.08879164f
#define GELU_F7 2.6189632f
#define GELU_F8 -3.9376786f
#define GELU_F9 2.3849032f
#define GELU_F10 -0.54313344f

static float pow2i(int32_t e) { /* 2^e for e in [-126, 127] */
    const uint32_t bits = (uint32_t)(e + 127) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

float mc_expf(float x) {
    if (x != x)
        return x;
    const float xc = x < EXP_LO ? EXP_LO : x > EXP_HI ? EXP_HI : x;
    const float n = rintf(xc * EXP_LOG2E);
    float r = fmaf(-n, EXP_LN2_HI, xc);
    r = fmaf(-n, EXP_LN2_LO, r);
    float p = EXP_P0;
    p = fmaf(p, r, EXP_P1);
    p = fmaf(p, r, EXP_P2);
    p = fmaf(p, r, EXP_P3);
    p = fmaf(p, r, EXP_P4);
    p = fmaf(p, r, EXP_P5);
    const float y = fmaf(p, r * r, r) + 1.0f;
    const int32_t ni = (int32_t)n, n1 = ni >> 1, n2 = ni - n1; /* n1 <= n2 <= n1 + 1, both in [-75, 64] */
    return (y * pow2i(n1)) * pow2i(n2);
}

/* The comparisons below are written as the vector min/max/blend compute
 * them, so a NaN x takes the same path in every form. */
float mc_gelu_erf(float x) {
    const float ax = fabsf(x);
    const float u = x * x;
    float p = GELU_P5;
    p = fmaf(p, u, GELU_P4);
    p = fmaf(p, u, GELU_P3);
    p = fmaf(p, u, GELU_P2);
    p = fmaf(p, u, GELU_P1);
    p = fmaf(p, u, GELU_P0);
    const float g_near = fmaf(x, p, 1.0f);
    float y = ax > GELU_NEAR ? ax : GELU_NEAR;
    y = y < GELU_FAR_MAX ? y : GELU_FAR_MAX;
    const float h = y * y, l = fmaf(y, y, -h);
    const float e_h = mc_expf(-0.5f * h);
    const float e = fmaf(e_h, -0.5f * l, e_h);
    const float t = 1.0f / fmaf(0.5f, y, 1.0f);
    float f = GELU_F10;
    f = fmaf(f, t, GELU_F9);
    f = fmaf(f, t, GELU_F8);
    f = fmaf(f, t, GELU_F7);
    f = fmaf(f, t, GELU_F6);
    f = fmaf(f, t, GELU_F5);
    f = fmaf(f, t, GELU_F4);
    f = fmaf(f, t, GELU_F3);
    f = fmaf(f, t, GELU_F2);
    f = fmaf(f, t, GELU_F1);
    f = fmaf(f, t, GELU_F0);
    const float erfc_y = e * (f / y);
    const float g_far = x > 0.0f ? 2.0f - erfc_y : erfc_y;
    const float g = ax < GELU_NEAR ? g_near : g_far;
    return (0.5f * x) * g;
}

/* SiLU(x) = x / (1 + e^-x) on mc_expf: within 3 ulp of the exact value (the
 * expf's ulp, the add's and the divide's), the same bits on every ISA. */
float mc_silu(float x) { return x / (1.0f + mc_expf(-x)); }

/* name_plain(x, y, n): y[i] = scalar(x[i]), the reference form of the
 * arrays below. */
#define VMATH_PLAIN(name, scalar)                                                                           \
    static void name##_plain(const float *x, float *y, int64_t n) {                                         \
        for (int64_t i = 0; i < n; i++)                                                                     \
            y[i] = scalar(x[i]);                                                                            \
    }
VMATH_PLAIN(expf, mc_expf)
VMATH_PLAIN(gelu, mc_gelu_erf)
VMATH_PLAIN(silu, mc_silu)

/* e = exp(row - max) in place; returns the sum in the documented order. */
static float exp_sum_plain(float *row, int64_t n, float max) {
    float lane[MC_SMALLROW_LANES] = {0};
    for (int64_t j = 0; j < n; j++) {
        row[j] = mc_expf(row[j] - max);
        lane[j % MC_SMALLROW_LANES] += row[j];
    }
    return mc_smallrow_reduce16(lane);
}

/* The largest element of the row that is not NaN, -inf if none: exact, so
 * the vector forms below (a lane-wise maximum, then over the lanes) give the
 * same value, up to the sign of a zero maximum, which no exp(x - max) can
 * tell apart. */
static float max_plain(const float *row, int64_t n) {
    float max = -INFINITY;
    for (int64_t j = 0; j < n; j++)
        max = row[j] > max ? row[j] : max;
    return max;
}

static void scale_plain(float *row, int64_t n, float inv) {
    for (int64_t j = 0; j < n; j++)
        row[j] *= inv;
}

#if MC_VMATH_X86
/* The vector forms of mc_expf, operation for operation (the NaN test last:
 * the clamp's min/max would otherwise drop it). */
#define EXP_VECTOR(isa, pre, vec, ivec, round_nearest, cast_ps, nan_blend)                                 \
    static inline __attribute__((always_inline)) vec isa##_expf(vec x) {                                   \
        vec xc = pre##_min_ps(pre##_max_ps(x, pre##_set1_ps(EXP_LO)), pre##_set1_ps(EXP_HI));              \
        vec n = round_nearest(pre##_mul_ps(xc, pre##_set1_ps(EXP_LOG2E)));                      \
        vec r = pre##_fnmadd_ps(n, pre##_set1_ps(EXP_LN2_HI), xc);                                         \
        r = pre##_fnmadd_ps(n, pre##_set1_ps(EXP_LN2_LO), r);                                              \
        vec p = pre##_set1_ps(EXP_P0);                                                                     \
        p = pre##_fmadd_ps(p, r, pre##_set1_ps(EXP_P1));                                                   \
        p = pre##_fmadd_ps(p, r, pre##_set1_ps(EXP_P2));                                                   \
        p = pre##_fmadd_ps(p, r, pre##_set1_ps(EXP_P3));                                                   \
        p = pre##_fmadd_ps(p, r, pre##_set1_ps(EXP_P4));                                                   \
        p = pre##_fmadd_ps(p, r, pre##_set1_ps(EXP_P5));                                                   \
        vec y = pre##_add_ps(pre##_fmadd_ps(p, pre##_mul_ps(r, r), r), pre##_set1_ps(1.0f));               \
        ivec ni = pre##_cvtps_epi32(n); /* n is integral: exact */                                         \
        ivec n1 = pre##_srai_epi32(ni, 1), n2 = pre##_sub_epi32(ni, n1);                                 \
        ivec bias = pre##_set1_epi32(127);                                                                \
        vec s1 = cast_ps(pre##_slli_epi32(pre##_add_epi32(n1, bias), 23));                        \
        vec s2 = cast_ps(pre##_slli_epi32(pre##_add_epi32(n2, bias), 23));                        \
        vec e = pre##_mul_ps(pre##_mul_ps(y, s1), s2);                                                     \
        return nan_blend(x, e);                                                                    \
    }

/* The vector forms of mc_gelu_erf, operation for operation. cmp_lt(a, b) and
 * cmp_gt are ordered compares (false for NaN), select(m, a, b) = m ? a : b;
 * min_ps(a, b)/max_ps(a, b) return b when a is NaN, as the plain ?: do. */
#define GELU_VECTOR(isa, pre, vec, abs, cmp_lt, cmp_gt, select)                                             \
    static inline __attribute__((always_inline)) vec isa##_gelu(vec x) {                                    \
        const vec ax = abs(x);                                                                              \
        const vec u = pre##_mul_ps(x, x);                                                                   \
        vec p = pre##_set1_ps(GELU_P5);                                                                     \
        p = pre##_fmadd_ps(p, u, pre##_set1_ps(GELU_P4));                                                   \
        p = pre##_fmadd_ps(p, u, pre##_set1_ps(GELU_P3));                                                   \
        p = pre##_fmadd_ps(p, u, pre##_set1_ps(GELU_P2));                                                   \
        p = pre##_fmadd_ps(p, u, pre##_set1_ps(GELU_P1));                                                   \
        p = pre##_fmadd_ps(p, u, pre##_set1_ps(GELU_P0));                                                   \
        const vec g_near = pre##_fmadd_ps(x, p, pre##_set1_ps(1.0f));                                       \
        vec y = pre##_max_ps(ax, pre##_set1_ps(GELU_NEAR));                                                 \
        y = pre##_min_ps(y, pre##_set1_ps(GELU_FAR_MAX));                                                   \
        const vec h = pre##_mul_ps(y, y), l = pre##_fmsub_ps(y, y, h);                                      \
        const vec e_h = isa##_expf(pre##_mul_ps(pre##_set1_ps(-0.5f), h));                                  \
        const vec e = pre##_fmadd_ps(e_h, pre##_mul_ps(pre##_set1_ps(-0.5f), l), e_h);                      \
        const vec t = pre##_div_ps(pre##_set1_ps(1.0f),                                                     \
                                   pre##_fmadd_ps(pre##_set1_ps(0.5f), y, pre##_set1_ps(1.0f)));             \
        vec f = pre##_set1_ps(GELU_F10);                                                                    \
        f = pre##_fmadd_ps(f, t, pre##_set1_ps(GELU_F9));                                                   \
        f = pre##_fmadd_ps(f, t, pre##_set1_ps(GELU_F8));                                                   \
        f = pre##_fmadd_ps(f, t, pre##_set1_ps(GELU_F7));                                                   \
        f = pre##_fmadd_ps(f, t, pre##_set1_ps(GELU_F6));                                                   \
        f = pre##_fmadd_ps(f, t, pre##_set1_ps(GELU_F5));                                                   \
        f = pre##_fmadd_ps(f, t, pre##_set1_ps(GELU_F4));                                                   \
        f = pre##_fmadd_ps(f, t, pre##_set1_ps(GELU_F3));                                                   \
        f = pre##_fmadd_ps(f, t, pre##_set1_ps(GELU_F2));                                                   \
        f = pre##_fmadd_ps(f, t, pre##_set1_ps(GELU_F1));                                                   \
        f = pre##_fmadd_ps(f, t, pre##_set1_ps(GELU_F0));                                                   \
        const vec erfc_y = pre##_mul_ps(e, pre##_div_ps(f, y));                                             \
        const vec g_far = select(cmp_gt(x, pre##_setzero_ps()),                                             \
                                 pre##_sub_ps(pre##_set1_ps(2.0f), erfc_y), erfc_y);                        \
        const vec g = select(cmp_lt(ax, pre##_set1_ps(GELU_NEAR)), g_near, g_far);                          \
        return pre##_mul_ps(pre##_mul_ps(pre##_set1_ps(0.5f), x), g);                                       \
    }

/* The vector form of mc_silu: x / (1 + e^-x), operation for operation. */
#define SILU_VECTOR(isa, pre, vec)                                                                          \
    static inline __attribute__((always_inline)) vec isa##_silu(vec x) {                                    \
        const vec e = isa##_expf(pre##_sub_ps(pre##_setzero_ps(), x));                                      \
        return pre##_div_ps(x, pre##_add_ps(pre##_set1_ps(1.0f), e));                                       \
    }

/* max_<isa>(row, n): max_plain's value in vector lanes, then over the lanes
 * and the tail. max_ps(x, acc) returns acc where x is NaN (its second
 * operand), as max_plain skips NaN. (A scalar maximum is a chain of dependent
 * compares, ~4 cycles an element: it was 13% of the attention's time at 320
 * keys.) */
#define MAX_ROW(isa, pre, vec, width)                                                                       \
    static float max_##isa(const float *row, int64_t n) {                                                   \
        vec acc = pre##_set1_ps(-INFINITY);                                                                 \
        int64_t j = 0;                                                                                      \
        for (; j + (width) <= n; j += (width))                                                              \
            acc = pre##_max_ps(pre##_loadu_ps(row + j), acc);                                               \
        float lane[width];                                                                                  \
        pre##_storeu_ps(lane, acc);                                                                         \
        const float lanes = max_plain(lane, width), tail = max_plain(row + j, n - j);                       \
        return tail > lanes ? tail : lanes;                                                                 \
    }

/* name_<isa>(x, y, n): y[i] = scalar(x[i]) with isa's vector form (the same
 * bits), the last partial vector by the scalar form. */
#define VMATH_ARRAY(name, scalar, isa, width, load, store)                                                  \
    static void name##_##isa(const float *x, float *y, int64_t n) {                                         \
        int64_t i = 0;                                                                                      \
        for (; i + (width) <= n; i += (width))                                                              \
            store(y + i, isa##_##name(load(x + i)));                                                        \
        for (; i < n; i++)                                                                                  \
            y[i] = scalar(x[i]);                                                                            \
    }

#pragma GCC push_options
#pragma GCC target("avx512f")
#define AVX512_ROUND(v) _mm512_roundscale_ps((v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define AVX512_NAN_BLEND(x, e) _mm512_mask_blend_ps(_mm512_cmp_ps_mask((x), (x), _CMP_UNORD_Q), (e), (x))
EXP_VECTOR(avx512, _mm512, __m512, __m512i, AVX512_ROUND, _mm512_castsi512_ps, AVX512_NAN_BLEND)
#define AVX512_LT(a, b) _mm512_cmp_ps_mask((a), (b), _CMP_LT_OQ)
#define AVX512_GT(a, b) _mm512_cmp_ps_mask((a), (b), _CMP_GT_OQ)
#define AVX512_SELECT(m, a, b) _mm512_mask_blend_ps((m), (b), (a))
GELU_VECTOR(avx512, _mm512, __m512, _mm512_abs_ps, AVX512_LT, AVX512_GT, AVX512_SELECT)
SILU_VECTOR(avx512, _mm512, __m512)
VMATH_ARRAY(expf, mc_expf, avx512, 16, _mm512_loadu_ps, _mm512_storeu_ps)
VMATH_ARRAY(gelu, mc_gelu_erf, avx512, 16, _mm512_loadu_ps, _mm512_storeu_ps)
VMATH_ARRAY(silu, mc_silu, avx512, 16, _mm512_loadu_ps, _mm512_storeu_ps)

/* Lane l of acc holds the columns j % 16 == l: one vector is the 16 lanes. */
static float exp_sum_avx512(float *row, int64_t n, float max) {
    const __m512 vmax = _mm512_set1_ps(max);
    __m512 acc = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const __m512 e = avx512_expf(_mm512_sub_ps(_mm512_loadu_ps(row + j), vmax));
        _mm512_storeu_ps(row + j, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (j < n) { /* the lanes past n add nothing: the plain form's lane sums stop there too */
        const __mmask16 m = (__mmask16)((1u << (n - j)) - 1u);
        const __m512 e = avx512_expf(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + j), vmax));
        _mm512_mask_storeu_ps(row + j, m, e);
        acc = _mm512_mask_add_ps(acc, m, acc, e);
    }
    _Alignas(64) float lane[16];
    _mm512_store_ps(lane, acc);
    return mc_smallrow_reduce16(lane);
}

MAX_ROW(avx512, _mm512, __m512, 16)

static void scale_avx512(float *row, int64_t n, float inv) {
    const __m512 v = _mm512_set1_ps(inv);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        _mm512_storeu_ps(row + j, _mm512_mul_ps(_mm512_loadu_ps(row + j), v));
    for (; j < n; j++)
        row[j] *= inv;
}
#undef AVX512_ROUND
#undef AVX512_NAN_BLEND
#undef AVX512_LT
#undef AVX512_GT
#undef AVX512_SELECT
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define AVX2_ROUND(v) _mm256_round_ps((v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define AVX2_NAN_BLEND(x, e) _mm256_blendv_ps((e), (x), _mm256_cmp_ps((x), (x), _CMP_UNORD_Q))
EXP_VECTOR(avx2, _mm256, __m256, __m256i, AVX2_ROUND, _mm256_castsi256_ps, AVX2_NAN_BLEND)
#define AVX2_LT(a, b) _mm256_cmp_ps((a), (b), _CMP_LT_OQ)
#define AVX2_GT(a, b) _mm256_cmp_ps((a), (b), _CMP_GT_OQ)
#define AVX2_SELECT(m, a, b) _mm256_blendv_ps((b), (a), (m))
#define AVX2_ABS(x) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), (x))
GELU_VECTOR(avx2, _mm256, __m256, AVX2_ABS, AVX2_LT, AVX2_GT, AVX2_SELECT)
SILU_VECTOR(avx2, _mm256, __m256)
VMATH_ARRAY(expf, mc_expf, avx2, 8, _mm256_loadu_ps, _mm256_storeu_ps)
VMATH_ARRAY(gelu, mc_gelu_erf, avx2, 8, _mm256_loadu_ps, _mm256_storeu_ps)
VMATH_ARRAY(silu, mc_silu, avx2, 8, _mm256_loadu_ps, _mm256_storeu_ps)

/* The 16 lanes as two vectors (columns 16k + 0..7 and 16k + 8..15); a
 * row's last partial block of 16 goes through the plain lanes. */
static float exp_sum_avx2(float *row, int64_t n, float max) {
    const __m256 vmax = _mm256_set1_ps(max);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const __m256 e0 = avx2_expf(_mm256_sub_ps(_mm256_loadu_ps(row + j), vmax));
        const __m256 e1 = avx2_expf(_mm256_sub_ps(_mm256_loadu_ps(row + j + 8), vmax));
        _mm256_storeu_ps(row + j, e0);
        _mm256_storeu_ps(row + j + 8, e1);
        acc0 = _mm256_add_ps(acc0, e0);
        acc1 = _mm256_add_ps(acc1, e1);
    }
    _Alignas(32) float lane[16];
    _mm256_store_ps(lane, acc0);
    _mm256_store_ps(lane + 8, acc1);
    for (int l = 0; j < n; j++, l++) {
        row[j] = mc_expf(row[j] - max);
        lane[l] += row[j];
    }
    return mc_smallrow_reduce16(lane);
}

MAX_ROW(avx2, _mm256, __m256, 8)

static void scale_avx2(float *row, int64_t n, float inv) {
    const __m256 v = _mm256_set1_ps(inv);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(row + j, _mm256_mul_ps(_mm256_loadu_ps(row + j), v));
    for (; j < n; j++)
        row[j] *= inv;
}
#undef AVX2_ROUND
#undef AVX2_NAN_BLEND
#undef AVX2_LT
#undef AVX2_GT
#undef AVX2_SELECT
#undef AVX2_ABS
#pragma GCC pop_options
#endif /* MC_VMATH_X86 */

/* isa's form of the elementwise function `name` (name_avx512, name_avx2 or
 * name_plain: the same bits). */
#if MC_VMATH_X86
#define VMATH_PICK(isa, name)                                                                               \
    ((isa) == MC_CPU_ISA_AVX512 ? name##_avx512 : (isa) == MC_CPU_ISA_AVX2 ? name##_avx2 : name##_plain)
#else
#define VMATH_PICK(isa, name) ((void)(isa), name##_plain)
#endif

void mc_cpu_expf_array(mc_cpu_isa isa, const float *x, float *y, int64_t n) { VMATH_PICK(isa, expf)(x, y, n); }

void mc_cpu_gelu_erf_array(mc_cpu_isa isa, const float *x, float *y, int64_t n) {
    VMATH_PICK(isa, gelu)(x, y, n);
}

void mc_cpu_silu_array(mc_cpu_isa isa, const float *x, float *y, int64_t n) { VMATH_PICK(isa, silu)(x, y, n); }

void mc_cpu_softmax_rows(mc_cpu_isa isa, float *s, int64_t rows, int64_t cols, int64_t ld) {
    float (*row_max)(const float *row, int64_t n) = max_plain;
    float (*exp_sum)(float *row, int64_t n, float max) = exp_sum_plain;
    void (*scale)(float *row, int64_t n, float inv) = scale_plain;
#if MC_VMATH_X86
    if (isa == MC_CPU_ISA_AVX512) {
        row_max = max_avx512;
        exp_sum = exp_sum_avx512;
        scale = scale_avx512;
    } else if (isa == MC_CPU_ISA_AVX2) {
        row_max = max_avx2;
        exp_sum = exp_sum_avx2;
        scale = scale_avx2;
    }
#else
    (void)isa;
#endif
    for (int64_t i = 0; i < rows; i++) {
        float *row = s + i * ld;
        scale(row, cols, 1.0f / exp_sum(row, cols, row_max(row, cols)));
    }
}

/* The small-row linear: y = beta * y + act(x W^T + bias) for few rows
 * (issue 23: the diffusion head at batch 1 runs 8 rows against ~134 MB of
 * weights per step, so it is bound by streaming W, not by arithmetic).
 *
 * Why not OpenBLAS there: at 8 rows sgemm packs the whole of W into its
 * own layout on every call (a second pass over W, and a write), and that
 * is most of the time. W in nn.Linear layout [out, in] is already a
 * streaming layout for this shape: output o is the dot of each x row with
 * the contiguous W row o. So the outputs are split across the OpenMP team
 * in contiguous slices, each thread reads its slice of W exactly once per
 * call (tiles of SR_O W rows, in blocks of 256 inputs that stay in L1 while
 * every block of SR_RMAX x rows runs over them; cpu_smallrow_simd.h), and
 * bias, activation and the residual are applied as each tile's sums are
 * stored, so y is written once. W is read in place, so nothing changes at
 * load. Since then a bound fp32 weight runs its column panels instead
 * (cpu_panels.c: at 8-14 rows x's reloads here crowded the weight stream);
 * this kernel serves 16-bit weights, which it widens in registers, and fp32
 * with MARCACHE_SMALLROW_PANELS=0 or an unbound weight.
 *
 * The threshold (MC_SMALLROW_MAX_DEFAULT, 96 rows): measured with
 * benchmarks/bench_linear.py (both paths through the backend, two threads,
 * weights beyond L3, alternated) on the 2-core EPYC (AVX-512) on MAR-B's
 * shapes, two runs: the kernel against OpenBLAS is 1.3-1.7x at 16 rows,
 * 1.0-1.3x at 32 and 64, 0.93-1.12x at 96 (the head's 1024-wide inputs ahead,
 * the transformer's 768-wide behind), 0.89-1.0x at 128 and 0.7-0.88x from
 * 192. OpenBLAS splits a GEMM of 64 or more rows by rows, so each of the two
 * threads packs all of W; up to ~100 rows that costs more than the kernel's
 * lower arithmetic rate. MAR-B's head runs 16 x (tokens of the AR step) rows
 * at batch 8, 16 to 112: a threshold of 32 sent 93% of them to OpenBLAS
 * (issue 23 found batch 8 no faster per image than batch 1). An
 * earlier one-thread measurement put the crossover at 32-40 rows; with one
 * thread OpenBLAS packs W once. With bf16 weights the old path widens all of
 * W first, and the kernel stays ahead further; one threshold keeps it simple.
 *
 * 16-bit weights keep the semantics of mc_wtype_round / mc_wtype_unpack (ops.h):
 * x is rounded to the weight type once per call (into the packed copy), the
 * weights are widened exactly in registers, products are summed in float32.
 * Nothing widens the whole matrix, so bf16 streams half the bytes.
 *
 * Summation order (one order for every instruction set): lane l = i % 16 of
 * an output accumulates its products in increasing i with fma, then the 16
 * lanes are summed in a fixed tree (mc_smallrow_reduce16). The AVX-512 and
 * AVX2 kernels (cpu_smallrow_simd.h) and the plain loop below compute that
 * same sequence of roundings, so they agree bit for bit; a row's result
 * does not depend on how many rows the call has or on the thread count. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#define MC_SMALLROW_X86 1
#include <immintrin.h>
#else
#define MC_SMALLROW_X86 0
#endif

/* Thread slices start at multiples of this many outputs, so two threads
 * never write one 64-byte line of a y row (for a row start that is 64-byte
 * aligned). A kernel's tiles of SR_O outputs (5 for AVX-512, 4 for AVX2)
 * run inside one thread's slice, the last one short where the slice ends. */
#define MC_SMALLROW_SLICE_ALIGN 16

const char *mc_cpu_gemm_split_name(mc_cpu_gemm_split split) {
    return split == MC_CPU_GEMM_SPLIT_ROWS ? "rows" : split == MC_CPU_GEMM_SPLIT_COLS ? "cols" : "auto";
}

const char *mc_cpu_isa_name(mc_cpu_isa isa) {
    return isa == MC_CPU_ISA_AVX512 ? "avx512" : isa == MC_CPU_ISA_AVX2 ? "avx2" : "plain";
}

int mc_cpu_isa_supported(mc_cpu_isa isa) {
    if (isa == MC_CPU_ISA_PLAIN)
        return 1;
#if MC_SMALLROW_X86
    __builtin_cpu_init();
    if (isa == MC_CPU_ISA_AVX2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (isa == MC_CPU_ISA_AVX512)
        return __builtin_cpu_supports("avx512f");
#endif
    return 0;
}

int mc_cpu_isa_from_name(const char *name, mc_cpu_isa *isa) {
    static const mc_cpu_isa all[] = {MC_CPU_ISA_AVX512, MC_CPU_ISA_AVX2, MC_CPU_ISA_PLAIN};
    for (size_t k = 0; k < sizeof all / sizeof all[0]; k++)
        if (strcmp(name, mc_cpu_isa_name(all[k])) == 0) {
            *isa = all[k];
            return 1;
        }
    return 0;
}

mc_cpu_isa mc_cpu_isa_best(void) {
    if (mc_cpu_isa_supported(MC_CPU_ISA_AVX512))
        return MC_CPU_ISA_AVX512;
    return mc_cpu_isa_supported(MC_CPU_ISA_AVX2) ? MC_CPU_ISA_AVX2 : MC_CPU_ISA_PLAIN;
}

/* An on/off environment variable: 1 when unset or empty, else "0" or "1". */
static mc_status read_switch(const char *name, int *on, mc_err *err) {
    const char *text = getenv(name);
    *on = 1;
    if (text == NULL || *text == '\0')
        return MC_OK;
    if (strcmp(text, "0") != 0 && strcmp(text, "1") != 0)
        return mc_fail(err, MC_ERR_VALUE, "%s='%.64s': expected 0 or 1", name, text);
    *on = text[0] == '1';
    return MC_OK;
}

mc_status mc_cpu_config_from_env(mc_cpu_config *cfg, mc_err *err) {
    const char *name = getenv("MARCACHE_CPU_ISA");
    cfg->isa = mc_cpu_isa_best();
    if (name != NULL && *name != '\0' && strcmp(name, "auto") != 0) {
        if (!mc_cpu_isa_from_name(name, &cfg->isa))
            return mc_fail(err, MC_ERR_VALUE, "MARCACHE_CPU_ISA='%.64s': expected auto, avx512, avx2 or plain",
                           name);
        if (!mc_cpu_isa_supported(cfg->isa))
            return mc_fail(err, MC_ERR_VALUE,
                           "MARCACHE_CPU_ISA=%s: this CPU does not support it (the best it supports is %s)",
                           name, mc_cpu_isa_name(mc_cpu_isa_best()));
    }
    /* Where no vector kernel runs, the plain loop is a reference, not a
     * faster path: OpenBLAS keeps every linear unless a threshold is asked for. */
    cfg->smallrow_max = mc_cpu_isa_best() == MC_CPU_ISA_PLAIN ? 0 : MC_SMALLROW_MAX_DEFAULT;
    const mc_cpu_isa panel_isa = cfg->isa == MC_CPU_ISA_PLAIN ? mc_cpu_isa_best() : cfg->isa;
    cfg->panel_max = panel_isa == MC_CPU_ISA_AVX512 ? MC_PANEL_MAX_AVX512
                     : panel_isa == MC_CPU_ISA_AVX2 ? MC_PANEL_MAX_AVX2
                                                    : 0;
    const char *max_text = getenv("MARCACHE_SMALLROW_MAX");
    if (max_text != NULL && *max_text != '\0') {
        char *end = NULL;
        long v = strtol(max_text, &end, 10);
        if (end == max_text || *end != '\0' || v < 0 || v > MC_SMALLROW_MAX_LIMIT)
            return mc_fail(err, MC_ERR_VALUE, "MARCACHE_SMALLROW_MAX='%.64s': expected an integer in [0, %d]",
                           max_text, MC_SMALLROW_MAX_LIMIT);
        cfg->smallrow_max = (int)v;
        cfg->panel_max = (int)v;
    }
    cfg->gemm_split = MC_CPU_GEMM_SPLIT_AUTO;
    const char *split = getenv("MARCACHE_GEMM_SPLIT");
    if (split != NULL && *split != '\0') {
        static const mc_cpu_gemm_split all[] = {MC_CPU_GEMM_SPLIT_AUTO, MC_CPU_GEMM_SPLIT_ROWS,
                                                MC_CPU_GEMM_SPLIT_COLS};
        int found = 0;
        for (size_t k = 0; k < sizeof all / sizeof all[0]; k++)
            if (strcmp(split, mc_cpu_gemm_split_name(all[k])) == 0) {
                cfg->gemm_split = all[k];
                found = 1;
            }
        if (!found)
            return mc_fail(err, MC_ERR_VALUE, "MARCACHE_GEMM_SPLIT='%.64s': expected auto, rows or cols", split);
    }
    MC_TRY(read_switch("MARCACHE_SMALLROW_PANELS", &cfg->panels, err));
    MC_TRY(read_switch("MARCACHE_CPU_GRAPHS", &cfg->graphs, err));
    return read_switch("MARCACHE_HUGE_PAGES", &cfg->huge_pages, err);
}

float mc_smallrow_reduce16(const float lane[MC_SMALLROW_LANES]) {
    float b[8], c[4];
    for (int l = 0; l < 8; l++)
        b[l] = lane[l] + lane[l + 8];
    for (int l = 0; l < 4; l++)
        c[l] = b[l] + b[l + 4];
    const float d0 = c[0] + c[2], d1 = c[1] + c[3];
    return d0 + d1;
}

void mc_smallrow_store(const mc_smallrow_job *j, int64_t r0, int nr, int64_t o0, int no, const float *sums,
                       int ld_sums) {
    if (j->act != MC_ACT_GELU_TANH) {
        /* No activation here: GELU (erf) and SiLU are applied after the
         * store in vectors (mc_cpu_slice_act: the panels per register block,
         * the lane kernel over the thread's slice; the kernels see them as
         * MC_ACT_NONE). The tests stay out of the inner
         * loops so that the adds run in vectors (written per element, the
         * epilogue was 1.8% of a batch-1 LazyMAR image's samples). beta == 0
         * never reads y (it may hold garbage or NaN). */
        const float *bias = j->bias != NULL ? j->bias + o0 : NULL;
        for (int r = 0; r < nr; r++) {
            float *restrict yr = j->y + (r0 + r) * j->ldy + o0;
            const float *restrict s = sums + (int64_t)r * ld_sums;
            if (bias != NULL && j->beta != 0.0f)
                for (int o = 0; o < no; o++)
                    yr[o] = yr[o] + (s[o] + bias[o]);
            else if (bias != NULL)
                for (int o = 0; o < no; o++)
                    yr[o] = s[o] + bias[o];
            else if (j->beta != 0.0f)
                for (int o = 0; o < no; o++)
                    yr[o] = yr[o] + s[o];
            else
                for (int o = 0; o < no; o++)
                    yr[o] = s[o];
        }
        return;
    }
    /* GELU (tanh), per element; beta is 0 with an activation (linear
     * refuses the pair), so y is not read. */
    for (int r = 0; r < nr; r++) {
        float *yr = j->y + (r0 + r) * j->ldy + o0;
        const float *s = sums + (int64_t)r * ld_sums;
        for (int o = 0; o < no; o++) {
            float v = s[o];
            if (j->bias != NULL)
                v += j->bias[o0 + o];
            yr[o] = mc_gelu_tanh(v);
        }
    }
}

/* The reference form: each (row, output) on its own, the 16 lanes in an
 * array, weights widened one at a time by mc_wtype_unpack. */
static void mc_smallrow_plain(const mc_smallrow_job *j, int64_t o_begin, int64_t o_end) {
    const uint16_t *w16 = j->w;
    const float *w32 = j->w;
    for (int64_t o = o_begin; o < o_end; o++)
        for (int64_t r = 0; r < j->rows; r++) {
            const float *xr = j->xp + r * j->ldxp;
            float lane[MC_SMALLROW_LANES] = {0};
            for (int64_t i0 = 0; i0 < j->in; i0 += MC_SMALLROW_LANES)
                for (int l = 0; l < MC_SMALLROW_LANES; l++) {
                    const int64_t i = i0 + l;
                    float wv = 0.0f; /* past `in`: the zero padding of the vector kernels */
                    if (i < j->in)
                        wv = j->wt == MC_WTYPE_F32 ? w32[o * j->in + i] : mc_wtype_unpack(j->wt, w16[o * j->in + i]);
                    lane[l] = fmaf(xr[i], wv, lane[l]);
                }
            const float sum = mc_smallrow_reduce16(lane);
            mc_smallrow_store(j, r, 1, o, 1, &sum, 1);
        }
}

#if MC_SMALLROW_X86

/* The vector operations of one instruction set that cpu_smallrow_simd.h
 * uses, <isa>_zero / _load / _store / _fma / _widen_bf16 / _widen_f16, from
 * its intrinsics (prefix pre: _mm512 or _mm256; bits: the vector's width;
 * half: the integer vector of half as many bits and its unaligned load). The
 * widenings are exact: bf16 bits are the high half of the float's (widen and
 * shift); F16C's conversion keeps fp16 subnormals. */
#define SR_VECTOR_OPS(isa, pre, bits, vec, half, half_load)                                                 \
    static inline __attribute__((always_inline)) vec isa##_zero(void) { return pre##_setzero_ps(); }       \
    static inline __attribute__((always_inline)) vec isa##_load(const float *p) { return pre##_loadu_ps(p); } \
    static inline __attribute__((always_inline)) void isa##_store(float *p, vec v) { pre##_storeu_ps(p, v); } \
    static inline __attribute__((always_inline)) vec isa##_fma(vec acc, vec w, vec x) {                    \
        return pre##_fmadd_ps(w, x, acc);                                                                    \
    }                                                                                                        \
    static inline __attribute__((always_inline)) vec isa##_widen_bf16(const uint16_t *p) {                \
        return pre##_castsi##bits##_ps(pre##_slli_epi32(pre##_cvtepu16_epi32(half_load((const half *)p)), 16)); \
    }                                                                                                        \
    static inline __attribute__((always_inline)) vec isa##_widen_f16(const uint16_t *p) {                 \
        return pre##_cvtph_ps(half_load((const half *)p));                                                  \
    }

/* The tree's last two levels on 128-bit lanes, shared by both reductions:
 * c[0..3] holds four accumulators' c values per 128-bit lane; s gets, in
 * lane g, element m: d0 + d1 (d0 = c0 + c2, d1 = c1 + c3) of the
 * accumulator in lane g of c[m]. */
#define SR_REDUCE_D_S(pre, vec, c, s)                                                                    \
    vec sr_t_[2];                                                                                        \
    for (int k = 0; k < 2; k++)                                                                          \
        sr_t_[k] = pre##_add_ps(pre##_shuffle_ps(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),       \
                                pre##_shuffle_ps(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));      \
    const vec s = pre##_add_ps(pre##_shuffle_ps(sr_t_[0], sr_t_[1], _MM_SHUFFLE(2, 0, 2, 0)),           \
                               pre##_shuffle_ps(sr_t_[0], sr_t_[1], _MM_SHUFFLE(3, 1, 3, 1)))

/* ---- AVX-512: one __m512 holds the 16 lanes. Tiles of 5 outputs x 5 rows:
 * 25 accumulators, 5 weight vectors and one x vector, 31 of the 32
 * registers, so GCC keeps the weights in registers (with 8 x 3 it folds a
 * weight load into every fma). Measured on the 2-core EPYC, one thread,
 * 1024-wide rows: at 8 rows 73 GFLOP/s with W in L2 (8 x 3: 66, 6 x 4: 63,
 * 5 x 4: 60, 4 x 6: 56, 5 x 6: 68) and 13.3 GB/s with W streamed from memory
 * (8 x 3: 11.7); at 32 rows 84 GFLOP/s (8 x 3: 73). */
#pragma GCC push_options
#pragma GCC target("avx512f")

SR_VECTOR_OPS(avx512, _mm512, 512, __m512, __m256i, _mm256_loadu_si256)

/* The sums of n accumulators (v[k]: 16 lanes each) into out[k], 16 at a time
 * with shuffles that pair whole accumulators at each level of the tree, so
 * every add is the tree's own (lanes l and l + 8, then l + 4, l + 2, l + 1):
 * mc_smallrow_reduce16's bits, in 46 instructions per 16 sums instead of 112
 * one accumulator at a time. */
static inline __attribute__((always_inline)) void avx512_reduce_many(const __m512 *v, int64_t n, float *out) {
    for (int64_t k0 = 0; k0 < n; k0 += 16) {
        __m512 a[16];
        for (int k = 0; k < 16; k++)
            a[k] = k0 + k < n ? v[k0 + k] : _mm512_setzero_ps();
        __m512 p[8], q[4];
        for (int k = 0; k < 8; k++) /* lanes 0-7: a[2k]'s b[l], 8-15: a[2k + 1]'s */
            p[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x44),
                                 _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xEE));
        for (int k = 0; k < 4; k++) /* 128-bit lane g: a[4k + g]'s c[0..3] */
            q[k] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * k], p[2 * k + 1], 0x88),
                                 _mm512_shuffle_f32x4(p[2 * k], p[2 * k + 1], 0xDD));
        SR_REDUCE_D_S(_mm512, __m512, q, s);
        /* element 4g + m: the sum of a[4m + g]; put it at 4m + g */
        const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _Alignas(64) float sums[16];
        _mm512_store_ps(sums, _mm512_permutexvar_ps(order, s));
        memcpy(out + k0, sums, (size_t)(n - k0 < 16 ? n - k0 : 16) * sizeof(float));
    }
}

#define SR_ISA avx512
/* The narrow path (cpu_smallrow_simd.h) up to 256 rows, in register blocks
 * of at most 8 rows: R rows x O outputs with R x O accumulators + O weight
 * vectors + 1 x vector in the 32 registers, O at most 8 (more concurrent
 * weight streams did not help). Above 256 rows the blocked path: every block
 * of a tile reads its rows of x, and 256 rows of 1024 inputs already fill
 * L2; at 128-256 rows it measured 0.95-1.15x the blocked path and about
 * level with OpenBLAS (narrow-rows-2026-11-28.md). */
#define SR_NARROW_ROWS 256
#define SR_NARROW_OMAX 8
#define SR_NARROW_O(R) (31 / ((R) + 1) < SR_NARROW_OMAX ? 31 / ((R) + 1) : SR_NARROW_OMAX)
#define SR_O 5
#define SR_RMAX 5
#define SR_VW 16
#define SR_VEC __m512
#include "cpu_smallrow_simd.h"

#pragma GCC pop_options

/* ---- AVX2 + FMA + F16C: the 16 lanes as two __m256 (lanes 0-7, 8-15), so
 * each lane does exactly the AVX-512 kernel's arithmetic. Tiles of 4 outputs
 * x 1 row: 8 accumulators, 4 weight vectors and one x vector, 13 of the 16
 * registers (measured with -march=znver3, so no AVX-512 register was
 * available: 4 x 1 and 5 x 1 beat 2 x 3, 3 x 2 and 2 x 2 at 2, 8 and 32 rows;
 * 5 x 1 fills all 16 registers and was within 5%). The pragma adds to the build's -march: on
 * an AVX-512 machine built with -march=native, GCC may encode these 256-bit
 * operations with EVEX (AVX-512 cannot be switched off here: the intrinsics
 * were declared for the native target), the same arithmetic an AVX2-only
 * machine runs; a build for such a machine, or with MARCACHE_MARCH="",
 * emits AVX2 alone. */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

SR_VECTOR_OPS(avx2, _mm256, 256, __m256, __m128i, _mm_loadu_si128)

/* avx512_reduce_many for two-part accumulators (v[2k], v[2k + 1]: lanes 0-7
 * and 8-15 of accumulator k), 8 sums at a time; mc_smallrow_reduce16's bits. */
static inline __attribute__((always_inline)) void avx2_reduce_many(const __m256 *v, int64_t n, float *out) {
    for (int64_t k0 = 0; k0 < n; k0 += 8) {
        __m256 b[8], c[4];
        for (int k = 0; k < 8; k++) /* lanes l and l + 8 */
            b[k] = k0 + k < n ? _mm256_add_ps(v[2 * (k0 + k)], v[2 * (k0 + k) + 1]) : _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) /* 128-bit half h: b[2k + h]'s c[0..3] */
            c[k] = _mm256_add_ps(_mm256_permute2f128_ps(b[2 * k], b[2 * k + 1], 0x20),
                                 _mm256_permute2f128_ps(b[2 * k], b[2 * k + 1], 0x31));
        SR_REDUCE_D_S(_mm256, __m256, c, s);
        /* element 4h + m: the sum of b[2m + h]; put it at 2m + h */
        _Alignas(32) float sums[8];
        _mm256_store_ps(sums, _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        memcpy(out + k0, sums, (size_t)(n - k0 < 8 ? n - k0 : 8) * sizeof(float));
    }
}

#define SR_ISA avx2
#define SR_O 4
#define SR_RMAX 1
#define SR_VW 8
#define SR_VEC __m256
#include "cpu_smallrow_simd.h"

#pragma GCC pop_options

#endif /* MC_SMALLROW_X86 */

typedef void (*smallrow_kernel)(const mc_smallrow_job *j, int64_t o_begin, int64_t o_end);

static smallrow_kernel kernel_of(mc_cpu_isa isa) {
#if MC_SMALLROW_X86
    if (isa == MC_CPU_ISA_AVX512)
        return mc_smallrow_avx512;
    if (isa == MC_CPU_ISA_AVX2)
        return mc_smallrow_avx2;
#else
    (void)isa;
#endif
    return mc_smallrow_plain;
}

int64_t mc_smallrow_ldxp(int64_t in) {
    const int64_t chunks = (in + MC_SMALLROW_LANES - 1) / MC_SMALLROW_LANES;
    return (chunks > 0 && chunks % 2 == 0 ? chunks + 1 : chunks) * MC_SMALLROW_LANES;
}

void mc_cpu_smallrow_pack_x(mc_wtype wt, const float *x, int64_t ldx, int64_t rows, int64_t in, int64_t ldxp,
                            float *xp) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *pr = xp + r * ldxp;
        if (wt == MC_WTYPE_F32) {
            memcpy(pr, xr, (size_t)in * sizeof(float));
        } else if (wt == MC_WTYPE_BF16) {
            /* mc_f32_to_bf16 then back, without branches so GCC vectorises it
             * (x is rounded on every call; the scalar form was ~10% of a bf16
             * 1024 x 1024 layer at 8 rows): ties to even, a NaN kept quiet. */
            for (int64_t i = 0; i < in; i++) {
                uint32_t u;
                memcpy(&u, &xr[i], sizeof u);
                const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
                const uint32_t nan = (u & 0xFFFF0000u) | 0x00400000u;
                const uint32_t v = (u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded;
                memcpy(&pr[i], &v, sizeof v);
            }
        } else {
            for (int64_t i = 0; i < in; i++)
                pr[i] = mc_wtype_round(wt, xr[i]);
        }
        for (int64_t i = in; i < ldxp; i++)
            pr[i] = 0.0f;
    }
}

int mc_cpu_slice_act_is_vector(mc_act act) { return act == MC_ACT_GELU || act == MC_ACT_SILU; }

void mc_cpu_slice_act(mc_cpu_isa isa, mc_act act, float *y, int64_t ldy, int64_t rows, int64_t begin, int64_t end) {
    if (!mc_cpu_slice_act_is_vector(act))
        return;
    for (int64_t r = 0; r < rows; r++) {
        float *yr = y + r * ldy + begin;
        if (act == MC_ACT_GELU)
            mc_cpu_gelu_erf_array(isa, yr, yr, end - begin);
        else
            mc_cpu_silu_array(isa, yr, yr, end - begin);
    }
}

int64_t mc_cpu_thread_slice(int64_t total, int t, int nt, int64_t align, int64_t *end) {
    int64_t per = (total + nt - 1) / nt;
    per = (per + align - 1) / align * align;
    const int64_t begin = (int64_t)t * per < total ? (int64_t)t * per : total;
    *end = begin + per < total ? begin + per : total;
    return begin;
}

/* Outputs [begin, end) of every row: the kernel, then GELU or SiLU over the
 * slice it just wrote (mc_cpu_slice_act). */
static void run_slice(smallrow_kernel kernel, mc_cpu_isa isa, const mc_smallrow_job *j, int64_t begin, int64_t end) {
    mc_smallrow_job k = *j;
    if (mc_cpu_slice_act_is_vector(j->act))
        k.act = MC_ACT_NONE; /* beta is 0 with an activation (linear refuses the pair) */
    kernel(&k, begin, end);
    mc_cpu_slice_act(isa, j->act, j->y, j->ldy, j->rows, begin, end);
}

void mc_cpu_smallrow_team_body(mc_cpu_isa isa, const mc_smallrow_job *j, int tid, int team) {
    int64_t end;
    const int64_t begin = mc_cpu_thread_slice(j->out, tid, team, MC_SMALLROW_SLICE_ALIGN, &end);
    if (begin < end)
        run_slice(kernel_of(isa), isa, j, begin, end);
}

void mc_cpu_smallrow_run(mc_cpu_isa isa, int threads, const mc_smallrow_job *j) {
    if (j->rows == 0 || j->out == 0)
        return;
    if (omp_get_level() > 0 || (double)j->rows * (double)j->in * (double)j->out < MC_SMALLROW_PARALLEL_MIN_MACS)
        threads = 1;
    if (threads <= 1) {
        run_slice(kernel_of(isa), isa, j, 0, j->out);
        return;
    }
    /* One parallel region per call (a CPU graph's replay runs the body on
     * its own team instead, cpu_graph.c); each thread's outputs are one
     * contiguous slice, so it streams its own W rows once. */
#pragma omp parallel num_threads(threads)
    mc_cpu_smallrow_team_body(isa, j, omp_get_thread_num(), omp_get_num_threads());
}

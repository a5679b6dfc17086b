/* The vector body of the small-row linear (cpu_smallrow.c), written once and
 * included once per instruction set, inside that set's `#pragma GCC target`.
 *
 * The includer defines
 *   SR_ISA            the instruction set's prefix (avx512, avx2)
 *   SR_O              outputs per tile (W rows streamed side by side)
 *   SR_RMAX           rows per register block at most, up to 5 (x rows sharing
 *                     each W vector; SR_O * SR_RMAX * SR_PARTS accumulators)
 *   SR_VW, SR_VEC     SR_VW float lanes per vector of type SR_VEC (16: __m512,
 *                     8: __m256); the 16 lanes of the order are SR_PARTS =
 *                     16 / SR_VW vectors
 * and these functions, named <SR_ISA>_<name>:
 *   zero()            all lanes +0
 *   load(p)           SR_VW floats (unaligned)
 *   store(p, v)       SR_VW floats (unaligned)
 *   widen_bf16(p), widen_f16(p)
 *                     SR_VW 16-bit weights widened exactly to float
 *   fma(acc, w, x)    acc + w * x per lane, one rounding (IEEE fma)
 *   reduce_many(v, n, out)
 *                     the sums of n accumulators (SR_PARTS vectors each, in a
 *                     row) into out[0..n), each in the fixed tree of
 *                     mc_smallrow_reduce16 (cpu_smallrow.c)
 * and, for the narrow path (few rows, below), optionally
 *   SR_NARROW_ROWS    its largest row count (above 8 a call runs each tile as
 *                     several register blocks of at most 8 rows, sr_narrow_plan)
 *   SR_NARROW_OMAX, SR_NARROW_O(R)
 *                     the outputs per tile for R rows, at most SR_NARROW_OMAX
 * and gets the entry point
 *   static void mc_smallrow_<SR_ISA>(const mc_smallrow_job *j, int64_t o_begin, int64_t o_end)
 * which computes outputs [o_begin, o_end) of every row. The SR_ macros are
 * undefined again at the end.
 *
 * The loop: for each tile of SR_O outputs, for each group of up to
 * SR_GROUP rows, the inputs in blocks of SR_IB. A block's SR_O weight rows
 * are read from memory once, by the first register block of SR_RMAX rows
 * (16-bit ones widened in registers and kept widened in an L1 buffer, so the
 * widening is paid once, not once per row block); the later register blocks
 * read them from L1. Each register block's accumulators are loaded from and
 * stored to the group's array between input blocks.
 *
 * The order: lane l of output (r, o) accumulates the products of the inputs i
 * with i % 16 == l in increasing i, with fma, exactly as the plain reference
 * does (blocking only saves and restores the accumulators); the lanes are then
 * summed in the same tree. So every instruction set gives the reference's
 * bits: the tests compare them with tolerance 0. */

#define SR_CAT2(a, b) a##_##b
#define SR_CAT(a, b) SR_CAT2(a, b)
#define SR_FN(name) SR_CAT(name, SR_ISA)
#define SR_INLINE static inline __attribute__((always_inline))
#define sr_vec SR_VEC
#define sr_zero SR_CAT(SR_ISA, zero)
#define sr_load SR_CAT(SR_ISA, load)
#define sr_store SR_CAT(SR_ISA, store)
#define sr_widen_bf16 SR_CAT(SR_ISA, widen_bf16)
#define sr_widen_f16 SR_CAT(SR_ISA, widen_f16)
#define sr_fma SR_CAT(SR_ISA, fma)
#define sr_reduce_many SR_CAT(SR_ISA, reduce_many)
#define SR_PARTS (16 / SR_VW)
/* Inputs per block: SR_O rows of widened weights (at most 5 x 256 x 4 B =
 * 5 KiB) and the group's x slice stay in L1 while every row block reads them. */
#define SR_IB 256
/* Rows per group: the accumulators of a group live on the stack
 * (32 x SR_O x 64 B = 10 KiB for AVX-512, 8 KiB for AVX2). */
#define SR_GROUP 32

/* Weights [i0, i0 + n) of the tile's rows as float, in `buf` rows of SR_IB
 * floats, zero from n up to a whole chunk of 16 (x is zero there too: the
 * plain form's fma(0, 0, acc)). The 16-bit types go through the vector
 * widening; fp32 is copied only for a block that ends in a partial chunk. */
SR_INLINE void SR_FN(sr_widen)(const mc_wtype wt, const char *const *wrow, int64_t i0, int64_t n,
                               float (*buf)[SR_IB]) {
    const int64_t esize = (int64_t)mc_wtype_size(wt), full = n / SR_VW * SR_VW;
    for (int o = 0; o < SR_O; o++) {
        const char *src = wrow[o] + i0 * esize;
        float *dst = buf[o];
        if (wt == MC_WTYPE_F32) {
            memcpy(dst, src, (size_t)n * sizeof(float));
        } else {
            for (int64_t i = 0; i < full; i += SR_VW)
                sr_store(dst + i, wt == MC_WTYPE_BF16 ? sr_widen_bf16((const uint16_t *)src + i)
                                                      : sr_widen_f16((const uint16_t *)src + i));
            if (full < n) {
                _Alignas(64) uint16_t tail[SR_VW] = {0};
                memcpy(tail, (const uint16_t *)src + full, (size_t)(n - full) * sizeof(uint16_t));
                sr_store(dst + full, wt == MC_WTYPE_BF16 ? sr_widen_bf16(tail) : sr_widen_f16(tail));
            }
        }
        for (int64_t i = n; i < (n + 15) / 16 * 16; i++)
            dst[i] = 0.0f;
    }
}

/* SR_VW weights at element `at` of a block's weight row of type wt, as float. */
SR_INLINE sr_vec SR_FN(sr_loadw)(const mc_wtype wt, const void *row, int64_t at) {
    if (wt == MC_WTYPE_F32)
        return sr_load((const float *)row + at);
    if (wt == MC_WTYPE_BF16)
        return sr_widen_bf16((const uint16_t *)row + at);
    return sr_widen_f16((const uint16_t *)row + at);
}

/* R rows (x[r] at the block's first input) x the tile's SR_O weight rows
 * (w[o] at the block's first input, of type wt) over `chunks` chunks of 16
 * inputs. With `keep`, the widened weights are also stored into buf, where
 * the next row blocks read them as fp32. acc holds the R x SR_O x SR_PARTS
 * accumulators between blocks (`first`: start from zero). The SR_O weight
 * vectors of a part are loaded once and each x vector once: SR_O + R loads
 * for SR_O * R fma. */
SR_INLINE void SR_FN(sr_block)(const mc_wtype wt, const int keep, const int R, const void *const *w,
                               float (*buf)[SR_IB], const float *const *x, int64_t chunks,
                               sr_vec (*acc)[SR_O][SR_PARTS], int first, const char *const *pf) {
    sr_vec a[SR_RMAX][SR_O][SR_PARTS];
    for (int r = 0; r < R; r++)
        for (int o = 0; o < SR_O; o++)
            for (int p = 0; p < SR_PARTS; p++)
                a[r][o][p] = first ? sr_zero() : acc[r][o][p];
    for (int64_t c = 0; c < chunks; c++) {
        if (pf != NULL) /* the next block's weights into L2, one chunk's worth per chunk */
            for (int o = 0; o < SR_O; o++)
                _mm_prefetch(pf[o] + c * 16 * (int64_t)mc_wtype_size(wt), _MM_HINT_T1);
        for (int p = 0; p < SR_PARTS; p++) {
            const int64_t at = c * 16 + p * SR_VW;
            sr_vec wv[SR_O];
            for (int o = 0; o < SR_O; o++) {
                wv[o] = SR_FN(sr_loadw)(wt, w[o], at);
                if (keep)
                    sr_store(buf[o] + at, wv[o]);
            }
            for (int r = 0; r < R; r++) {
                const sr_vec xv = sr_load(x[r] + at);
                for (int o = 0; o < SR_O; o++)
                    a[r][o][p] = sr_fma(a[r][o][p], wv[o], xv);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int o = 0; o < SR_O; o++)
            for (int p = 0; p < SR_PARTS; p++)
                acc[r][o][p] = a[r][o][p];
}

/* sr_block with R (1 .. SR_RMAX) made a constant. */
SR_INLINE void SR_FN(sr_rows)(const mc_wtype wt, const int keep, int R, const void *const *w, float (*buf)[SR_IB],
                              const float *const *x, int64_t chunks, sr_vec (*acc)[SR_O][SR_PARTS], int first,
                              const char *const *pf) {
#define SR_ROWS_CASE(n)                                                                      \
    case n:                                                                                  \
        SR_FN(sr_block)(wt, keep, n, w, buf, x, chunks, acc, first, pf);                     \
        break;
    switch (R) {
        SR_ROWS_CASE(SR_RMAX)
#if SR_RMAX > 1
        SR_ROWS_CASE(1)
#endif
#if SR_RMAX > 2
        SR_ROWS_CASE(2)
#endif
#if SR_RMAX > 3
        SR_ROWS_CASE(3)
#endif
#if SR_RMAX > 4
        SR_ROWS_CASE(4)
#endif
#if SR_RMAX > 5
#error "sr_rows: add the cases for SR_RMAX > 5"
#endif
    default: break;
    }
#undef SR_ROWS_CASE
}

/* Rows [r0, r0 + nr) (nr <= SR_GROUP) x outputs [o0, o0 + no) (no <=
 * SR_O). Outputs past no stream W row o0 again and are discarded, so the
 * loops have no branch on them. */
SR_INLINE void SR_FN(sr_group)(const mc_smallrow_job *j, const mc_wtype wt, int64_t r0, int nr, int64_t o0,
                               int no) {
    const int64_t in = j->in, esize = (int64_t)mc_wtype_size(wt);
    const char *wrow[SR_O];
    for (int o = 0; o < SR_O; o++)
        wrow[o] = (const char *)j->w + (o0 + (o < no ? o : 0)) * in * esize;
    _Alignas(64) float buf[SR_O][SR_IB];
    _Alignas(64) sr_vec acc[SR_GROUP][SR_O][SR_PARTS];
    if (in == 0) /* no input block sets them: every sum is +0 */
        for (int r = 0; r < nr; r++)
            for (int o = 0; o < SR_O; o++)
                for (int p = 0; p < SR_PARTS; p++)
                    acc[r][o][p] = sr_zero();
    for (int64_t i0 = 0; i0 < in; i0 += SR_IB) {
        const int64_t n = in - i0 < SR_IB ? in - i0 : SR_IB, chunks = (n + 15) / 16;
        /* Whole chunks: the first row block reads the weights from memory
         * (widening 16-bit ones in registers and keeping them in buf for
         * the next row blocks); a block ending in a partial chunk is
         * widened into buf, zero-padded, first. */
        const int direct = n % 16 == 0;
        const void *w[SR_O], *wbuf[SR_O];
        for (int o = 0; o < SR_O; o++) {
            w[o] = wrow[o] + i0 * esize;
            wbuf[o] = buf[o];
        }
        if (!direct)
            SR_FN(sr_widen)(wt, wrow, i0, n, buf);
        /* The first row block also prefetches the next block's weights into
         * L2, spread over its chunks, so the memory does not idle while the
         * later row blocks read L1 (the hardware prefetchers follow demand
         * reads only). A burst of prefetches at the block's start stalled
         * on the miss queue instead (10% of the samples of an 8-row head).
         * At the tile's last block the next tile's first is prefetched
         * (W's last row where there is none). */
        const char *next[SR_O]; /* after the tile's last block: the next tile's first */
        for (int o = 0; o < SR_O; o++) {
            const int64_t row = o0 + SR_O + o < j->out ? o0 + SR_O + o : j->out - 1;
            next[o] = i0 + SR_IB < in ? wrow[o] + (i0 + SR_IB) * esize : (const char *)j->w + row * in * esize;
        }
        const char *const *pf = next;
        const int first = i0 == 0;
        for (int r = 0; r < nr; r += SR_RMAX) {
            const int R = nr - r < SR_RMAX ? nr - r : SR_RMAX;
            const float *x[SR_RMAX];
            for (int k = 0; k < SR_RMAX; k++) /* entries past R are not read */
                x[k] = j->xp + (r0 + r + (k < R ? k : 0)) * j->ldxp + i0;
            const char *const *pf_r = r == 0 ? pf : NULL;
            if (!direct)
                SR_FN(sr_rows)(MC_WTYPE_F32, 0, R, wbuf, buf, x, chunks, acc + r, first, pf_r);
            else if (wt == MC_WTYPE_F32)
                SR_FN(sr_rows)(MC_WTYPE_F32, 0, R, w, buf, x, chunks, acc + r, first, pf_r);
            else if (r > 0)
                SR_FN(sr_rows)(MC_WTYPE_F32, 0, R, wbuf, buf, x, chunks, acc + r, first, NULL);
            else if (nr > SR_RMAX)
                SR_FN(sr_rows)(wt, 1, R, w, buf, x, chunks, acc + r, first, pf);
            else
                SR_FN(sr_rows)(wt, 0, R, w, buf, x, chunks, acc + r, first, pf);
        }
    }
    float sums[SR_GROUP * SR_O];
    sr_reduce_many(&acc[0][0][0], (int64_t)nr * SR_O, sums);
    mc_smallrow_store(j, r0, nr, o0, no, sums, SR_O);
}

#ifdef SR_NARROW_ROWS
/* Rows of one narrow tile: R x O accumulators + O weight vectors + one x
 * vector fit the 32 registers for R <= 8 (SR_NARROW_O). */
#define SR_NARROW_TILE_ROWS 8
/* The narrow path, for calls of at most SR_NARROW_ROWS rows (the head at
 * batch 1: 2 to 14 rows, 8 or fewer in 33 of MAR-B's 64 AR steps; at batch 8
 * 16 to 112). A tile:
 * one register block of R rows (at most 8) x O outputs over the whole input, so
 * the accumulators stay in registers from the first input to the last (no
 * save and restore per input block, no second pass over W from L1): each
 * weight vector is loaded once and used by all R rows, each x vector once
 * and used by all O outputs. The empty asm statements keep those loads in
 * registers: without them GCC folds a memory operand into every fma (the
 * weights' with 8 x 3 tiles, x's once the weights were pinned), 27 loads per
 * 24 fma, load-bound. Each chunk also prefetches the next tile's weights at
 * the same input into L2 (one tile, O x in x esize bytes, ahead), so the
 * stream does not wait on the arithmetic: measured on the 2-core EPYC with
 * benchmarks/linear_threshold.c's approach (two threads, 1024 x 1024
 * weights beyond L3, alternated), 8 rows 104 against the blocked path's
 * 92 GFLOP/s; no prefetch 66, prefetch into L1 70, two tiles ahead as one.
 * Same order as the blocked path: lane l of (r, o) accumulates its inputs
 * in increasing i with fma, then mc_smallrow_reduce16's tree. */
SR_INLINE void SR_FN(sr_narrow_tile)(const mc_smallrow_job *j, const mc_wtype wt, const int R, const int O,
                                     int64_t r0, int64_t o0, int no, int prefetch) {
    const int64_t in = j->in, esize = (int64_t)mc_wtype_size(wt), chunks = in / 16;
    const char *w[SR_NARROW_OMAX], *next[SR_NARROW_OMAX];
    const float *x[SR_NARROW_TILE_ROWS];
    for (int o = 0; o < O; o++) {
        w[o] = (const char *)j->w + (o0 + (o < no ? o : 0)) * in * esize; /* past no: row o0 again, discarded */
        const int64_t row = o0 + O + o < j->out ? o0 + O + o : j->out - 1;
        next[o] = (const char *)j->w + row * in * esize;
    }
    for (int r = 0; r < R; r++)
        x[r] = j->xp + (r0 + r) * j->ldxp;
    sr_vec a[SR_NARROW_TILE_ROWS][SR_NARROW_OMAX][SR_PARTS];
    for (int r = 0; r < R; r++)
        for (int o = 0; o < O; o++)
            for (int p = 0; p < SR_PARTS; p++)
                a[r][o][p] = sr_zero();
    for (int64_t c = 0; c < chunks; c++) {
        if (prefetch)
            for (int o = 0; o < O; o++)
                _mm_prefetch(next[o] + c * 16 * esize, _MM_HINT_T1);
        for (int p = 0; p < SR_PARTS; p++) {
            const int64_t at = c * 16 + p * SR_VW;
            sr_vec wv[SR_NARROW_OMAX];
            for (int o = 0; o < O; o++) {
                wv[o] = SR_FN(sr_loadw)(wt, w[o], at);
                __asm__("" : "+v"(wv[o]));
            }
            for (int r = 0; r < R; r++) {
                sr_vec xv = sr_load(x[r] + at);
                __asm__("" : "+v"(xv));
                for (int o = 0; o < O; o++)
                    a[r][o][p] = sr_fma(a[r][o][p], wv[o], xv);
            }
        }
    }
    if (chunks * 16 < in) { /* the last, partial chunk: weights zero-padded (x is zero there too) */
        _Alignas(64) float tail[SR_NARROW_OMAX][16];
        const int64_t n = in - chunks * 16;
        for (int o = 0; o < O; o++)
            for (int64_t i = 0; i < 16; i++)
                tail[o][i] = i >= n                 ? 0.0f
                             : wt == MC_WTYPE_F32 ? ((const float *)w[o])[chunks * 16 + i]
                                                  : mc_wtype_unpack(wt, ((const uint16_t *)w[o])[chunks * 16 + i]);
        for (int p = 0; p < SR_PARTS; p++)
            for (int r = 0; r < R; r++) {
                const sr_vec xv = sr_load(x[r] + chunks * 16 + p * SR_VW);
                for (int o = 0; o < O; o++)
                    a[r][o][p] = sr_fma(a[r][o][p], sr_load(tail[o] + p * SR_VW), xv);
            }
    }
    _Alignas(64) sr_vec acc[SR_NARROW_TILE_ROWS * SR_NARROW_OMAX][SR_PARTS];
    for (int r = 0; r < R; r++)
        for (int o = 0; o < O; o++)
            for (int p = 0; p < SR_PARTS; p++)
                acc[r * O + o][p] = a[r][o][p];
    float sums[SR_NARROW_TILE_ROWS * SR_NARROW_OMAX];
    sr_reduce_many(&acc[0][0], (int64_t)R * O, sums);
    mc_smallrow_store(j, r0, R, o0, no, sums, O);
}

/* The register blocks of a narrow call of `rows` (>= 1) rows: as few blocks
 * of at most SR_NARROW_TILE_ROWS rows as hold them, as even as they go, n1
 * blocks of R1 rows then n2 of R1 - 1 (12 rows: 6 + 6; 17: 6 + 6 + 5). The
 * tile width follows R1. */
SR_INLINE void SR_FN(sr_narrow_plan)(int64_t rows, int *R1, int *n1, int *n2) {
    const int64_t blocks = (rows + SR_NARROW_TILE_ROWS - 1) / SR_NARROW_TILE_ROWS;
    const int64_t r1 = (rows + blocks - 1) / blocks;
    *R1 = (int)r1;
    *n1 = (int)(rows - blocks * (r1 - 1));
    *n2 = (int)(blocks - *n1);
}

/* Outputs [o_begin, o_end) of every row, in tiles of O outputs, each tile
 * as n1 register blocks of R1 rows then n2 of R1 - 1 (sr_narrow_plan; up to
 * 8 rows one block). The first block streams the tile's weights from memory
 * over the whole input (prefetching the next tile's; it is peeled so that
 * flag is a constant: a run-time one lost 15% at 16 rows on 768 x 2304); the
 * others read the same O x in weights again from L1 / L2, 4 to 36 KiB
 * later. Above 8 rows this replaced the blocked path (5-row blocks over
 * 256-input slices, accumulators saved and restored between slices, W from
 * memory by the first block only): at 12 rows ~30% of its samples stalled on
 * W's loads, and its 1- and 2-row remainder blocks (32 rows = 6 x 5 + 2) did
 * 5 to 10 fma per 6 to 7 loads; the measurements are in
 * benchmarks/results/head-split-2026-11-28.md (9-16 rows) and
 * narrow-rows-2026-11-28.md (17 rows and up). Same order, same bits. */
SR_INLINE void SR_FN(sr_narrow_slice)(const mc_smallrow_job *j, const mc_wtype wt, const int R1, const int O,
                                      int n1, int n2, int64_t o_begin, int64_t o_end) {
    for (int64_t o0 = o_begin; o0 < o_end; o0 += O) {
        const int no = o_end - o0 < O ? (int)(o_end - o0) : O;
        SR_FN(sr_narrow_tile)(j, wt, R1, O, 0, o0, no, 1); /* n1 >= 1 */
        int64_t r0 = R1;
        for (int b = 1; b < n1; b++, r0 += R1)
            SR_FN(sr_narrow_tile)(j, wt, R1, O, r0, o0, no, 0);
        if (R1 > 1) /* R1 = 1 has n2 = 0; the test keeps a 0-row tile from being compiled */
            for (int b = 0; b < n2; b++, r0 += R1 - 1)
                SR_FN(sr_narrow_tile)(j, wt, R1 - 1, O, r0, o0, no, 0);
    }
}

/* The plan's R1 (1 .. 8) and its tile width SR_NARROW_O(R1) made constants. */
SR_INLINE void SR_FN(sr_narrow)(const mc_smallrow_job *j, const mc_wtype wt, int64_t o_begin, int64_t o_end) {
    int R1, n1, n2;
    SR_FN(sr_narrow_plan)(j->rows, &R1, &n1, &n2);
#define SR_NARROW_CASE(n)                                                                   \
    case n:                                                                                 \
        SR_FN(sr_narrow_slice)(j, wt, n, SR_NARROW_O(n), n1, n2, o_begin, o_end);           \
        break;
    switch (R1) {
        SR_NARROW_CASE(1)
        SR_NARROW_CASE(2)
        SR_NARROW_CASE(3)
        SR_NARROW_CASE(4)
        SR_NARROW_CASE(5)
        SR_NARROW_CASE(6)
        SR_NARROW_CASE(7)
        SR_NARROW_CASE(8)
#if SR_NARROW_TILE_ROWS != 8
#error "sr_narrow: the cases above are R1 = 1 .. SR_NARROW_TILE_ROWS"
#endif
    default: break;
    }
#undef SR_NARROW_CASE
}
#endif

SR_INLINE void SR_FN(sr_slice)(const mc_smallrow_job *j, const mc_wtype wt, int64_t o_begin, int64_t o_end) {
    for (int64_t o0 = o_begin; o0 < o_end; o0 += SR_O) {
        const int no = o_end - o0 < SR_O ? (int)(o_end - o0) : SR_O;
        for (int64_t r0 = 0; r0 < j->rows; r0 += SR_GROUP)
            SR_FN(sr_group)(j, wt, r0, j->rows - r0 < SR_GROUP ? (int)(j->rows - r0) : SR_GROUP, o0, no);
    }
}

/* One instance per weight type (wt a constant in each). */
static void SR_FN(mc_smallrow)(const mc_smallrow_job *j, int64_t o_begin, int64_t o_end) {
#ifdef SR_NARROW_ROWS
    if (j->rows <= SR_NARROW_ROWS) {
        switch (j->wt) {
        case MC_WTYPE_F32: SR_FN(sr_narrow)(j, MC_WTYPE_F32, o_begin, o_end); break;
        case MC_WTYPE_BF16: SR_FN(sr_narrow)(j, MC_WTYPE_BF16, o_begin, o_end); break;
        case MC_WTYPE_F16: SR_FN(sr_narrow)(j, MC_WTYPE_F16, o_begin, o_end); break;
        }
        return;
    }
#endif
    switch (j->wt) {
    case MC_WTYPE_F32: SR_FN(sr_slice)(j, MC_WTYPE_F32, o_begin, o_end); break;
    case MC_WTYPE_BF16: SR_FN(sr_slice)(j, MC_WTYPE_BF16, o_begin, o_end); break;
    case MC_WTYPE_F16: SR_FN(sr_slice)(j, MC_WTYPE_F16, o_begin, o_end); break;
    }
}

#undef sr_vec
#undef sr_zero
#undef sr_load
#undef sr_store
#undef sr_widen_bf16
#undef sr_widen_f16
#undef sr_fma
#undef sr_reduce_many
#undef SR_ISA
#undef SR_O
#undef SR_RMAX
#undef SR_VW
#undef SR_VEC
#undef SR_CAT2
#undef SR_CAT
#undef SR_FN
#undef SR_INLINE
#undef SR_PARTS
#undef SR_IB
#undef SR_GROUP
#undef SR_NARROW_ROWS
#undef SR_NARROW_OMAX
#undef SR_NARROW_O
#undef SR_NARROW_TILE_ROWS

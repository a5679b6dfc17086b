/* Column panels: the small-row linear for fp32 weights (issue 23).
 *
 * Why: the lane kernel (cpu_smallrow.c) reads W in nn.Linear layout, so an
 * x vector meets only the few W rows of a tile (5), and at 8-14 rows x's
 * lines, reloaded from L2 for every tile, outnumber the weight lines the
 * tile streams from memory: they take the miss slots the weight stream
 * needs (benchmarks/results/head-kernel-probes-2026-11-28.md), and the head
 * ran at 58-65% of either roofline. Here a weight also exists as panels of
 * 32 outputs, [in][32] floats each: per input the kernel loads 32 weights (2
 * vectors) and broadcasts one x value per row, so x costs 4 bytes per row
 * against 128 of weights, and a panel is one sequential stream for the
 * hardware prefetcher. Scratch loops of this form on the 2-core EPYC (two
 * threads, weights beyond L3) read 34.8 GB/s at 8 rows and ran 197-209
 * GFLOP/s at 12-14 rows (the lane kernel: 29.8 GB/s, 134 and ~140).
 *
 * The cost is memory: a panel copy beside the [out, in] weight (OpenBLAS
 * keeps using that one for more rows, and views into fused weights such as
 * the q rows of qkv need it), made when the weight is bound (the backend's
 * bind_linear, at load), so an fp32 model's Linears take twice their bytes
 * on the CPU (MAR-B: +0.8 GB). Made at a weight's first small-row call
 * instead, they cost ~1 s inside the first generate of a MAR-B model (the
 * transformer's 680 MB written in the loop). MARCACHE_SMALLROW_PANELS=0
 * turns them off (the lane kernel then serves fp32 too); 16-bit weights
 * always use the lane kernel, which widens them in registers and so already
 * streams half the bytes.
 *
 * The order: output (r, o) accumulates x[r][i] * W[o][i] for i = 0, 1, ...
 * with one fma each into one float (from +0), then the epilogue of the lane
 * kernel (+ bias, activation, + y). Blocking rows, splitting outputs or
 * running two panels at once (AVX-512 at <= 6 rows) never changes it, so
 * AVX-512, AVX2 and the plain loop agree bit for bit however a call is cut,
 * and a row's result does not depend on the call's other rows. It is
 * another order than the lane kernel's and OpenBLAS's, within the same
 * float32 error. */
#include <math.h>
#include <stdio.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#define MC_PANEL_X86 1
#include <immintrin.h>
#else
#define MC_PANEL_X86 0
#endif

/* Rows per register block: AVX-512: 14 x 2 accumulators + 2 weight vectors
 * + 1 broadcast = 31 of 32 registers; AVX2: half a panel (16 outputs) at a
 * time, 6 x 2 + 2 + 1 = 15 of 16. */
#define MC_PANEL_ROWS_AVX512 14
#define MC_PANEL_ROWS_AVX2 6
/* At most this many rows, the AVX-512 kernel runs two panels at a time. With
 * one, R rows keep 2 R accumulator chains in flight, and at R = 4 (8 chains)
 * a core reached 72% of the rate it reaches from 6 rows (linear_threshold.c,
 * 1024 x 1024, weights in L3, one thread: 80 against 111 GFLOP/s). That is
 * where the head cache's reused evaluations run at batch 1 (the conditional
 * rows alone, ~4, over ~17 MB of gates and final adaLN weights, which stay
 * in L3 from one diffusion step to the next); two panels double the chains:
 * 1.08-1.15x at 3-4 rows there, a tie with the weights beyond L3 (memory
 * bound) (benchmarks/results/panel-pairs-2026-11-29.md). 6 x 4 accumulators
 * + 4 weight vectors + 1 broadcast = 29 of 32 registers. AVX2 (16
 * registers) stays on one panel: not measured on an AVX2 machine. */
#define MC_PANEL_PAIR_ROWS_AVX512 6
/* The rows of x a thread runs over one panel before the next: chunks of
 * register blocks of about this many bytes, so that with a panel (in x 128
 * bytes) they stay in a 512 KiB L2 while the panels stream past. One chunk
 * of all rows instead re-read x from L3 or memory for every panel: at
 * 2560-4096 rows the panels fell to 0.82-0.89x OpenBLAS. */
#define MC_PANEL_X_CHUNK_BYTES (256 * 1024)

/* ---- the set of bound weights ---- */

static mc_status make_panels(mc_backend *be, mc_cpu_panel_weight *pw, mc_err *err);

mc_status mc_cpu_panel_set_add(mc_backend *be, mc_cpu_panel_set *set, const void *w, int64_t out, int64_t in,
                               int make, mc_err *err) {
    if (out <= 0 || in <= 0)
        return MC_OK; /* nothing a panel could hold: the lane kernel takes it */
    if (set->count == set->capacity) {
        const int64_t fresh = set->capacity ? 2 * set->capacity : 64;
        mc_cpu_panel_weight *moved = realloc(set->items, (size_t)fresh * sizeof *moved);
        if (moved == NULL)
            return mc_fail_nomem_n(err, (size_t)fresh, sizeof *moved, "the CPU backend's list of linear weights");
        set->items = moved;
        set->capacity = fresh;
    }
    mc_cpu_panel_weight *pw = &set->items[set->count];
    *pw = (mc_cpu_panel_weight){.w = w, .out = out, .in = in};
    if (make)
        MC_TRY(make_panels(be, pw, err));
    set->count++;
    return MC_OK;
}

static void drop_panels(mc_cpu_panel_weight *pw) {
    mc_aligned_free(pw->panels);
    pw->panels = NULL;
}

void mc_cpu_panel_set_forget(mc_cpu_panel_set *set, const void *buffer) {
    for (int64_t i = 0; i < set->count; i++)
        if (set->items[i].w == buffer) {
            drop_panels(&set->items[i]);
            set->items[i] = set->items[--set->count];
            return;
        }
}

void mc_cpu_panel_set_stale(mc_cpu_panel_set *set, const void *dst, size_t bytes) {
    const char *lo = dst, *hi = (const char *)dst + bytes;
    for (int64_t i = 0; i < set->count; i++) {
        mc_cpu_panel_weight *pw = &set->items[i];
        const char *end = pw->w + (size_t)(pw->out * pw->in) * sizeof(float);
        if (pw->panels != NULL && lo < end && pw->w < hi)
            drop_panels(pw);
    }
}

void mc_cpu_panel_set_free(mc_cpu_panel_set *set) {
    for (int64_t i = 0; i < set->count; i++)
        drop_panels(&set->items[i]);
    free(set->items);
    memset(set, 0, sizeof *set);
}

/* W [out, in] into panels: panel p, input i, column c = W[32 p + c][i]. Each
 * W row is read once in order; a panel (in x 128 bytes) is written in L2. */
static void pack_panels(const float *w, int64_t out, int64_t in, float *panels, int threads) {
    const int64_t npanels = (out + MC_PANEL_COLS - 1) / MC_PANEL_COLS;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && omp_get_level() == 0)
    for (int64_t p = 0; p < npanels; p++) {
        float *dst = panels + p * in * MC_PANEL_COLS;
        for (int c = 0; c < MC_PANEL_COLS; c++) {
            const int64_t o = p * MC_PANEL_COLS + c;
            for (int64_t i = 0; i < in; i++)
                dst[i * MC_PANEL_COLS + c] = o < out ? w[o * in + i] : 0.0f;
        }
    }
}

static mc_status make_panels(mc_backend *be, mc_cpu_panel_weight *pw, mc_err *err) {
    const int64_t npanels = (pw->out + MC_PANEL_COLS - 1) / MC_PANEL_COLS;
    size_t bytes;
    if (mc_mul_overflows((size_t)(npanels * pw->in), MC_PANEL_COLS * sizeof(float), &bytes))
        return mc_fail_nomem_n(err, (size_t)(npanels * pw->in), MC_PANEL_COLS * sizeof(float),
                               "the column panels of a %lld x %lld linear weight", (long long)pw->out,
                               (long long)pw->in);
    /* Laid out as a weight's own buffer: huge pages for the same reason. */
    char what[160];
    snprintf(what, sizeof what,
             "the column panels of a %lld x %lld linear weight (MARCACHE_SMALLROW_PANELS=0 runs without them)",
             (long long)pw->out, (long long)pw->in);
    float *p = mc_cpu_host_alloc(be, bytes, what, err);
    if (p == NULL)
        return err->status;
    pack_panels((const float *)pw->w, pw->out, pw->in, p, mc_cpu_threads(be));
    pw->panels = p;
    return MC_OK;
}

int mc_cpu_panels_for(mc_backend *be, const void *w, int64_t out, int64_t in, int make, const float **panels,
                      mc_err *err) {
    *panels = NULL;
    /* With the panels off nothing was bound (mc_cpu_bind_linear), so the
     * search below finds nothing. */
    if (be->linear_wtype != MC_WTYPE_F32 || in <= 0)
        return 0;
    mc_cpu_panel_set *set = mc_cpu_panel_set_of(be);
    const char *view = w;
    for (int64_t i = 0; i < set->count; i++) {
        mc_cpu_panel_weight *pw = &set->items[i];
        const size_t row_bytes = (size_t)pw->in * sizeof(float);
        if (pw->in != in || view < pw->w || view >= pw->w + (size_t)pw->out * row_bytes)
            continue;
        const size_t offset = (size_t)(view - pw->w);
        const int64_t row0 = (int64_t)(offset / row_bytes);
        if (offset % row_bytes != 0 || row0 % MC_PANEL_COLS != 0 || row0 + out > pw->out)
            return 0; /* a view the panels do not line up with: the lane kernel */
        if (!make)
            return 1;
        if (pw->panels == NULL && make_panels(be, pw, err) != MC_OK)
            return -1;
        *panels = pw->panels + (row0 / MC_PANEL_COLS) * in * MC_PANEL_COLS;
        return 1;
    }
    return 0;
}

int mc_cpu_panel_block_rows(mc_cpu_isa isa) {
    switch (isa) {
    case MC_CPU_ISA_AVX512: return MC_PANEL_ROWS_AVX512;
    case MC_CPU_ISA_AVX2: return MC_PANEL_ROWS_AVX2;
    case MC_CPU_ISA_PLAIN: break;
    }
    return MC_PANEL_ROWS_AVX512;
}

/* Block b of `blocks` over `rows`: its first row and row count. */
static int64_t block_rows(int64_t rows, int64_t blocks, int64_t b, int *count) {
    const int64_t base = rows / blocks, extra = rows % blocks;
    *count = (int)(base + (b < extra));
    return b * base + (b < extra ? b : extra);
}

/* Inputs [i_begin, i_end) of x's rows (stride ldx) transposed into the
 * register blocks of the vector kernels: rows split into
 * ceil(rows / block_rows_max) blocks as even as possible (the first ones one
 * row longer), block b of R rows starting at row r0 stored at xt + r0 * in
 * as [in][R]. The inputs go 64 at a time over
 * a block's rows, so the piece of the block being written (64 x R floats)
 * stays in L1 instead of each row's pass sweeping the whole block (43 KB at
 * 768 inputs and 14 rows). */
static void pack_x(const float *x, int64_t ldx, int64_t rows, int64_t in, int block_rows_max, int64_t i_begin,
                   int64_t i_end, float *xt) {
    const int64_t blocks = (rows + block_rows_max - 1) / block_rows_max;
    for (int64_t b = 0; b < blocks; b++) {
        int nr;
        const int64_t r0 = block_rows(rows, blocks, b, &nr);
        float *dst = xt + r0 * in;
        for (int64_t i0 = i_begin; i0 < i_end; i0 += 64) {
            const int64_t i1 = i0 + 64 < i_end ? i0 + 64 : i_end;
            for (int r = 0; r < nr; r++) {
                const float *src = x + (r0 + r) * ldx;
                for (int64_t i = i0; i < i1; i++)
                    dst[i * nr + r] = src[i];
            }
        }
    }
}

/* ---- the kernels: outputs [o_begin, o_end) of every row ---- */

/* The epilogue's view of a panel job (mc_smallrow_store reads y, ldy, bias,
 * act, beta). */
static mc_smallrow_job store_job(const mc_panel_job *j) {
    return (mc_smallrow_job){.wt = MC_WTYPE_F32, .rows = j->rows, .in = j->in, .out = j->out, .bias = j->bias,
                             .act = j->act, .beta = j->beta, .y = j->y, .ldy = j->ldy};
}

/* The reference form: each (row, output) on its own, from x and W as given. */
static void panel_plain(const mc_panel_job *j, int64_t o_begin, int64_t o_end) {
    const mc_smallrow_job s = store_job(j);
    for (int64_t o = o_begin; o < o_end; o++)
        for (int64_t r = 0; r < j->rows; r++) {
            const float *xr = j->x + r * j->ldx, *wo = j->w + o * j->in;
            float acc = 0.0f;
            for (int64_t i = 0; i < j->in; i++)
                acc = fmaf(xr[i], wo[i], acc);
            mc_smallrow_store(&s, r, 1, o, 1, &acc, 1);
        }
}

#if MC_PANEL_X86

/* The loop over NP adjacent panels (1 or 2) for one register block, written
 * once: PANEL_BLOCK(name, NP, vec, VW, load, bcast, fma, store, zero, MAXR)
 * defines name(pw, xt, in, R, sums) for R <= MAXR rows (xt: the block,
 * [in][R]), 2 * VW outputs from each of the NP panels at pw, pw + in x 32
 * floats, ... (stride 32 floats) into sums (stride NP x 32). Each output is
 * its own fma chain over the inputs in order whatever NP, so NP does not
 * change the bits. The callers (panel_<isa>_block, panel_avx512_pair)
 * instantiate it for each constant R so the accumulators live in registers. */
#define PANEL_BLOCK(name, NP, vec, VW, load, bcast, fma, store, zero, MAXR)                                  \
    static inline __attribute__((always_inline)) void name(const float *pw, const float *xt, int64_t in,   \
                                                           const int R, float *sums) {                      \
        vec acc[MAXR][2 * (NP)];                                                                            \
        for (int r = 0; r < R; r++)                                                                         \
            for (int k = 0; k < 2 * (NP); k++)                                                              \
                acc[r][k] = zero();                                                                         \
        for (int64_t i = 0; i < in; i++) {                                                                  \
            vec w[2 * (NP)];                                                                                \
            for (int p = 0; p < (NP); p++) {                                                                \
                w[2 * p] = load(pw + (p * in + i) * MC_PANEL_COLS);                                         \
                w[2 * p + 1] = load(pw + (p * in + i) * MC_PANEL_COLS + VW);                                \
            }                                                                                               \
            const float *xi = xt + i * R;                                                                   \
            for (int r = 0; r < R; r++) {                                                                   \
                const vec xb = bcast(xi + r);                                                               \
                for (int k = 0; k < 2 * (NP); k++)                                                          \
                    acc[r][k] = fma(w[k], xb, acc[r][k]);                                                   \
            }                                                                                               \
        }                                                                                                   \
        for (int r = 0; r < R; r++)                                                                         \
            for (int k = 0; k < 2 * (NP); k++)                                                              \
                store(sums + r * (NP) * MC_PANEL_COLS + k * VW, acc[r][k]);                                 \
    }

#pragma GCC push_options
#pragma GCC target("avx512f")
static inline __attribute__((always_inline)) __m512 p512_load(const float *p) { return _mm512_load_ps(p); }
static inline __attribute__((always_inline)) __m512 p512_bcast(const float *p) { return _mm512_set1_ps(*p); }
static inline __attribute__((always_inline)) __m512 p512_fma(__m512 w, __m512 x, __m512 acc) {
    return _mm512_fmadd_ps(w, x, acc);
}
static inline __attribute__((always_inline)) void p512_store(float *p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline __attribute__((always_inline)) __m512 p512_zero(void) { return _mm512_setzero_ps(); }
PANEL_BLOCK(panel_avx512_rows, 1, __m512, 16, p512_load, p512_bcast, p512_fma, p512_store, p512_zero,
            MC_PANEL_ROWS_AVX512)

/* One register block over a whole panel (32 outputs). */
static void panel_avx512_block(const float *pw, const float *xt, int64_t in, int R, float *sums) {
    switch (R) {
#define PANEL_CASE(n) \
    case n: panel_avx512_rows(pw, xt, in, n, sums); break;
        PANEL_CASE(1) PANEL_CASE(2) PANEL_CASE(3) PANEL_CASE(4) PANEL_CASE(5) PANEL_CASE(6) PANEL_CASE(7)
        PANEL_CASE(8) PANEL_CASE(9) PANEL_CASE(10) PANEL_CASE(11) PANEL_CASE(12) PANEL_CASE(13) PANEL_CASE(14)
#undef PANEL_CASE
    default: break;
    }
}

PANEL_BLOCK(panel_avx512_pair_rows, 2, __m512, 16, p512_load, p512_bcast, p512_fma, p512_store, p512_zero,
            MC_PANEL_PAIR_ROWS_AVX512)

/* One register block of at most MC_PANEL_PAIR_ROWS_AVX512 rows over two
 * panels (64 outputs). */
static void panel_avx512_pair(const float *pw, const float *xt, int64_t in, int R, float *sums) {
    switch (R) {
#define PANEL_CASE(n) \
    case n: panel_avx512_pair_rows(pw, xt, in, n, sums); break;
        PANEL_CASE(1) PANEL_CASE(2) PANEL_CASE(3) PANEL_CASE(4) PANEL_CASE(5) PANEL_CASE(6)
#undef PANEL_CASE
    default: break;
    }
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
static inline __attribute__((always_inline)) __m256 p256_load(const float *p) { return _mm256_load_ps(p); }
static inline __attribute__((always_inline)) __m256 p256_bcast(const float *p) { return _mm256_broadcast_ss(p); }
static inline __attribute__((always_inline)) __m256 p256_fma(__m256 w, __m256 x, __m256 acc) {
    return _mm256_fmadd_ps(w, x, acc);
}
static inline __attribute__((always_inline)) void p256_store(float *p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline __attribute__((always_inline)) __m256 p256_zero(void) { return _mm256_setzero_ps(); }
PANEL_BLOCK(panel_avx2_rows, 1, __m256, 8, p256_load, p256_bcast, p256_fma, p256_store, p256_zero,
            MC_PANEL_ROWS_AVX2)

/* One register block over a whole panel: its two halves of 16 outputs (the
 * second reads the panel from L2). */
static void panel_avx2_block(const float *pw, const float *xt, int64_t in, int R, float *sums) {
    for (int half = 0; half < 2; half++) {
        const float *ph = pw + half * 16;
        float *sh = sums + half * 16;
        switch (R) {
#define PANEL_CASE(n) \
    case n: panel_avx2_rows(ph, xt, in, n, sh); break;
            PANEL_CASE(1) PANEL_CASE(2) PANEL_CASE(3) PANEL_CASE(4) PANEL_CASE(5) PANEL_CASE(6)
#undef PANEL_CASE
        default: break;
        }
    }
}
#pragma GCC pop_options

typedef void (*panel_block_fn)(const float *pw, const float *xt, int64_t in, int R, float *sums);

/* The panel that holds output o0 (a multiple of 32) of the job's weight. */
static const float *panel_at(const mc_panel_job *j, int64_t o0) {
    return j->panels + (o0 / MC_PANEL_COLS) * j->in * MC_PANEL_COLS;
}

/* Outputs [o_begin, o_end) (o_begin a multiple of 32) with `block`: chunk
 * of rows by chunk (MC_PANEL_X_CHUNK_BYTES), within it panel by panel, every
 * register block of the chunk over the panel (the first streams the panel
 * from memory or L3, the others find it in L2), each block's sums stored
 * through the epilogue, then vector_act (GELU or SiLU) over them. With
 * `pair` (NULL for none) and at most pair_rows rows, two panels at a time
 * (the last one alone when the slice has an odd count; a partial second
 * panel is computed whole from its zero padding and stored in part). */
static void panel_vector(mc_cpu_isa isa, mc_act vector_act, panel_block_fn block, int block_rows_max,
                         panel_block_fn pair, int pair_rows, const mc_panel_job *j, int64_t o_begin,
                         int64_t o_end) {
    const mc_smallrow_job s = store_job(j);
    const int64_t blocks = (j->rows + block_rows_max - 1) / block_rows_max;
    const int64_t block_bytes = (int64_t)block_rows_max * j->in * (int64_t)sizeof(float);
    const int64_t chunk = block_bytes < MC_PANEL_X_CHUNK_BYTES ? MC_PANEL_X_CHUNK_BYTES / block_bytes : 1;
    _Alignas(64) float sums[MC_PANEL_ROWS_AVX512 * MC_PANEL_COLS];
    if (pair != NULL && j->rows <= pair_rows) {
        /* One block of all rows; two panels while the slice has outputs in both. */
        const int nr = (int)j->rows;
        for (int64_t o0 = o_begin; o0 < o_end;) {
            const int width = (o_end - o0 > MC_PANEL_COLS ? 2 : 1) * MC_PANEL_COLS;
            const int no = (int)(o_end - o0 < width ? o_end - o0 : width);
            (width > MC_PANEL_COLS ? pair : block)(panel_at(j, o0), j->xt, j->in, nr, sums);
            mc_smallrow_store(&s, 0, nr, o0, no, sums, width);
            mc_cpu_slice_act(isa, vector_act, j->y, j->ldy, nr, o0, o0 + no);
            o0 += width;
        }
        return;
    }
    for (int64_t b0 = 0; b0 < blocks; b0 += chunk) {
        const int64_t b1 = b0 + chunk < blocks ? b0 + chunk : blocks;
        for (int64_t o0 = o_begin; o0 < o_end; o0 += MC_PANEL_COLS) {
            const float *pw = panel_at(j, o0);
            const int no = (int)(o_end - o0 < MC_PANEL_COLS ? o_end - o0 : MC_PANEL_COLS);
            for (int64_t b = b0; b < b1; b++) {
                int nr;
                const int64_t r0 = block_rows(j->rows, blocks, b, &nr);
                block(pw, j->xt + r0 * j->in, j->in, nr, sums);
                mc_smallrow_store(&s, r0, nr, o0, no, sums, MC_PANEL_COLS);
                /* GELU (erf) or SiLU while the block's outputs are in L1 (the
                 * store saw MC_ACT_NONE); over the thread's slice afterwards,
                 * it re-read y from L3 (fc1's output at 640 rows: 7.5 MB). */
                mc_cpu_slice_act(isa, vector_act, j->y + r0 * j->ldy, j->ldy, nr, o0, o0 + no);
            }
        }
    }
}

#endif /* MC_PANEL_X86 */

/* Outputs [begin, end) of every row with isa's kernel; GELU (erf) or SiLU
 * in vectors (mc_cpu_slice_act, as the lane kernel does): the vector
 * kernels per register block, the plain one over the slice after it. */
static void panel_slice(mc_cpu_isa isa, const mc_panel_job *j, int64_t begin, int64_t end) {
    mc_panel_job k = *j;
    const mc_act vector_act = mc_cpu_slice_act_is_vector(j->act) ? j->act : MC_ACT_NONE;
    if (vector_act != MC_ACT_NONE)
        k.act = MC_ACT_NONE; /* beta is 0 with an activation (linear refuses the pair) */
#if MC_PANEL_X86
    if (isa == MC_CPU_ISA_AVX512) {
        panel_vector(isa, vector_act, panel_avx512_block, MC_PANEL_ROWS_AVX512, panel_avx512_pair,
                     MC_PANEL_PAIR_ROWS_AVX512, &k, begin, end);
        return;
    }
    if (isa == MC_CPU_ISA_AVX2) {
        panel_vector(isa, vector_act, panel_avx2_block, MC_PANEL_ROWS_AVX2, NULL, 0, &k, begin, end);
        return;
    }
#endif
    panel_plain(&k, begin, end);
    mc_cpu_slice_act(isa, vector_act, j->y, j->ldy, j->rows, begin, end);
}

void mc_cpu_panel_team_body(mc_cpu_isa isa, const mc_panel_job *j, int tid, int team) {
    /* Every thread packs a share of x's inputs (64 at a time) in every
     * block, then a barrier: every thread reads all blocks. Packed by one
     * thread before the team, the other waited (with the scalar transposes
     * reading x from L3 or the other core's L2, 6% of a batch-1 LazyMAR
     * image's wall time by perf); packed in the team by blocks of rows
     * instead (99eb2eb), bench_linear measured the panels 5-20% slower; by
     * inputs, 0.96-1.14x the one-thread packing (15 shape and row pairs,
     * alternated twice, 2026-11-29). The plain kernel reads x itself. */
    if (isa != MC_CPU_ISA_PLAIN) {
        int64_t i_end;
        const int64_t i_begin = mc_cpu_thread_slice(j->in, tid, team, 64, &i_end);
        if (i_begin < i_end)
            pack_x(j->x, j->ldx, j->rows, j->in, mc_cpu_panel_block_rows(isa), i_begin, i_end, j->xt);
#pragma omp barrier
    }
    int64_t end;
    const int64_t begin = mc_cpu_thread_slice(j->out, tid, team, MC_PANEL_COLS, &end);
    if (begin < end)
        panel_slice(isa, j, begin, end);
}

void mc_cpu_panel_run(mc_cpu_isa isa, int threads, const mc_panel_job *j) {
    if (j->rows == 0 || j->out == 0)
        return;
    if (omp_get_level() > 0 || (double)j->rows * (double)j->in * (double)j->out < MC_SMALLROW_PARALLEL_MIN_MACS)
        threads = 1;
    if (threads <= 1) {
        if (isa != MC_CPU_ISA_PLAIN)
            pack_x(j->x, j->ldx, j->rows, j->in, mc_cpu_panel_block_rows(isa), 0, j->in, j->xt);
        panel_slice(isa, j, 0, j->out);
        return;
    }
    /* One parallel region per call (a CPU graph's replay runs the body on
     * its own team instead, cpu_graph.c). */
#pragma omp parallel num_threads(threads)
    mc_cpu_panel_team_body(isa, j, omp_get_thread_num(), omp_get_num_threads());
}

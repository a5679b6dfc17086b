/* CPU backend internals: the op implementations the table in cpu_backend.c
 * points to, split by file (dense, attention, conv, sampler). */
#ifndef MC_CPU_INTERNAL_H
#define MC_CPU_INTERNAL_H

#include "../ops.h"

/* How mc_cpu_sgemm splits a GEMM across its team (MARCACHE_GEMM_SPLIT):
 * AUTO chooses by shape (mc_cpu_sgemm_splits_rows); ROWS and COLS force one
 * split where the call has enough rows or columns for it, for tests and
 * benchmarks. On OpenBLAS's SkylakeX kernels every split gives the same bits
 * (cpu_backend.c says where they do not). */
typedef enum mc_cpu_gemm_split {
    MC_CPU_GEMM_SPLIT_AUTO = 0,
    MC_CPU_GEMM_SPLIT_ROWS,
    MC_CPU_GEMM_SPLIT_COLS
} mc_cpu_gemm_split;
/* cblas is reached through these so the BLAS symbol prefix lives in one place. */
/* `threads`: the team size for a GEMM called outside a parallel region
 * (inside one it always runs serially on the calling thread). */
void mc_cpu_sgemm(int threads, mc_cpu_gemm_split split, int trans_a, int trans_b, int64_t m, int64_t n,
                  int64_t k, float alpha, const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                  float *c, int64_t ldc);
const char *mc_cpu_gemm_split_name(mc_cpu_gemm_split split);
/* AUTO's choice for an m x n result on `threads` threads: 1 splits rows, 0 columns. */
int mc_cpu_sgemm_splits_rows(int threads, int64_t m, int64_t n);
const char *mc_cpu_blas_config(void);
/* The kernel family OpenBLAS chose at load (e.g. "SkylakeX"). */
const char *mc_cpu_blas_core(void);
int mc_cpu_threads(mc_backend *be);

/* The op table's entries: mc_cpu_<op> for every op of ops_list.h (the CPU
 * backend implements them all; a new op lands here first). */
#define MC_OP(name, where, params, args, flops) mc_status mc_cpu_##name params;
#include "../ops_list.h"

/* Below this many elements an elementwise op runs on one thread: waking the
 * team costs more than the work. */
#define MC_PARALLEL_MIN_ELEMS 32768
/* Below this many multiply-adds a small-row linear (panels or lane kernel)
 * runs on one thread, for the same reason. The head's input projection (16
 * inputs) and final layer (32 outputs) fall below; its 1024-wide layers do
 * not. */
#define MC_SMALLROW_PARALLEL_MIN_MACS (256 * 1024)

/* The entries of the CPU backend's op table (cpu_graph.c): mc_cpu_<op>
 * itself, or, while a graph is being recorded, a record of the call. */
#define MC_OP(name, where, params, args, flops) mc_status mc_cpu_entry_##name params;
#include "../ops_list.h"

/* Graph recording state of a CPU backend (cpu_graph.c; ops.h capture_*). */
typedef struct mc_cpu_graph mc_cpu_graph;
typedef struct mc_cpu_recorder {
    int capturing;           /* between capture_begin and capture_end */
    int failed;              /* the recording met a call it cannot keep */
    const char *failed_what; /* the first such call ("allocation", ...) */
    mc_cpu_graph *recording; /* the calls recorded so far (reused from one recording to the next) */
} mc_cpu_recorder;
mc_cpu_recorder *mc_cpu_recorder_of(mc_backend *be);
/* Refuses (and fails the recording) what a recording cannot hold:
 * allocation, upload, download, a weight bound. MC_OK when not recording. */
mc_status mc_cpu_refuse_while_recording(mc_backend *be, const char *what, mc_err *err);
mc_status mc_cpu_capture_begin(mc_backend *be, mc_err *err);
mc_status mc_cpu_capture_end(mc_backend *be, void **graph, int keep, mc_err *err);
mc_status mc_cpu_graph_launch(mc_backend *be, void *graph, mc_err *err);
void mc_cpu_graph_free(mc_backend *be, void *graph);
void mc_cpu_recorder_free(mc_cpu_recorder *rec);
/* A backend copy: a memcpy that drops the panels of a bound weight written
 * into (mc_cpu_copy_bytes); while recording, a node of the graph. */
void mc_cpu_copy_bytes(mc_backend *be, void *dst, const void *src, size_t bytes);
mc_status mc_cpu_copy_or_record(mc_backend *be, void *dst, const void *src, size_t bytes, mc_err *err);
int mc_cpu_graphs_enabled(mc_backend *be);

/* Plain-loop reference of mc_cpu_conv2d (same contract), for tests. */
mc_status mc_cpu_conv2d_naive(mc_backend *be, const float *x, int64_t batch, int64_t height,
                              int64_t width, int64_t cin, const float *w, const float *bias,
                              int64_t cout, int ksize, float beta, float *y, mc_err *err);

/* Scratch slot of the rounded operands of a 16-bit convolution: above the
 * im2col slots 0..61 of conv2d and conv2d_ex, below groupnorm's 63. */
#define MC_CONV_ROUNDED_SLOT 62

/* A convolution on a backend whose linear_wtype is 16-bit runs as PyTorch's
 * autocast runs it (ops.h): x and w rounded to the type, products summed in
 * float32. This makes the rounded copies in scratch (MC_CONV_ROUNDED_SLOT):
 * *x becomes `pixels` contiguous pixels of cin channels (*ldx = cin) and *w
 * its w_count values, both exactly representable in the 16-bit type. With a
 * float32 linear_wtype nothing changes. Shared by conv2d and conv2d_ex and
 * their naive references. */
mc_status mc_cpu_conv_round_operands(mc_backend *be, const float **x, int64_t pixels, int64_t cin,
                                     int64_t *ldx, const float **w, int64_t w_count, mc_err *err);

/* Prepares rows [0, rows) of y (row stride ldy, cout columns) for a GEMM
 * that adds onto them: y = beta * y + bias. Returns the beta the GEMM must
 * then use. beta == 0 never reads y (it may hold garbage or NaN). Shared by
 * conv2d and conv2d_ex. */
float mc_cpu_prefill_bias(float *y, int64_t rows, int64_t cout, int64_t ldy, const float *bias, float beta);

/* Plans an im2col convolution's chunks of output rows for a static OpenMP
 * schedule of *threads threads (conv2d, conv2d_ex): `total_rows` rows in
 * chunks of at most *rows_per_chunk rows (>= 1), the chunk count a multiple
 * of the thread count where the rows allow and all chunks but the last of
 * equal size, so the schedule is balanced. Updates *rows_per_chunk, sets
 * *nchunks, lowers *threads to it when fewer, and takes thread t's scratch
 * (slot t) of *rows_per_chunk * floats_per_row floats into cols[t] (none
 * when floats_per_row is 0). */
static inline mc_status mc_cpu_plan_chunks(mc_backend *be, int64_t total_rows, int64_t floats_per_row,
                                           int64_t *rows_per_chunk, int *threads, float **cols, int64_t *nchunks,
                                           mc_err *err) {
    int64_t n = (total_rows + *rows_per_chunk - 1) / *rows_per_chunk;
    n = (n + *threads - 1) / *threads * *threads;
    if (n > total_rows)
        n = total_rows;
    *rows_per_chunk = (total_rows + n - 1) / n;
    n = (total_rows + *rows_per_chunk - 1) / *rows_per_chunk;
    if (*threads > n)
        *threads = (int)n;
    *nchunks = n;
    for (int t = 0; t < *threads && floats_per_row > 0; t++) {
        cols[t] = mc_cpu_scratch(be, t, (size_t)(*rows_per_chunk * floats_per_row), "a thread's im2col columns",
                                 err);
        if (cols[t] == NULL)
            return err->status;
    }
    return MC_OK;
}

/* The first row of chunk `chunk` of mc_cpu_plan_chunks' plan; *nrows gets its row count. */
static inline int64_t mc_cpu_chunk_rows(int64_t chunk, int64_t rows_per_chunk, int64_t total_rows, int64_t *nrows) {
    int64_t row0 = chunk * rows_per_chunk;
    *nrows = total_rows - row0 < rows_per_chunk ? total_rows - row0 : rows_per_chunk;
    return row0;
}

/* Elementwise kernels shared by several ops (mc_gelu_erf, mc_silu:
 * cpu_vmath.c, with their vector forms). */
float mc_gelu_erf(float x);
float mc_silu(float x);
float mc_gelu_tanh(float x);

/* ---- The small-row linear (cpu_smallrow.c; issue 23). ---- */

/* The vector instruction set of the small-row kernels, chosen once per
 * backend when it is made: the best the CPU has, or MARCACHE_CPU_ISA
 * (auto | avx512 | avx2 | plain; one the CPU lacks is a ValueError). plain
 * is the reference loop, which every ISA matches bit for bit. */
typedef enum mc_cpu_isa { MC_CPU_ISA_PLAIN = 0, MC_CPU_ISA_AVX2 = 1, MC_CPU_ISA_AVX512 = 2 } mc_cpu_isa;

/* linear runs the small-row kernel for rows <= this (MARCACHE_SMALLROW_MAX
 * overrides it, 0 turns the path off; at most MC_SMALLROW_MAX_LIMIT). 96:
 * where OpenBLAS starts to win for fp32 weights on MAR-B's shapes (measured,
 * cpu_smallrow.c); 95% of the head's rows at batch 8. */
#define MC_SMALLROW_MAX_DEFAULT 96
/* linear runs a bound fp32 weight's column panels (cpu_panels.c) for rows <=
 * these (MARCACHE_SMALLROW_MAX sets both thresholds), by the instruction set
 * in use (a forced plain one: the machine's best). Measured with
 * bench_linear.py on MAR-B's five shapes (2 threads, weights beyond L3,
 * benchmarks/results/panels-chunked-2026-11-29.md), x run in L2-sized row
 * chunks: AVX-512 1.01-1.15x OpenBLAS from 256 to 768 rows but for
 * 3072 x 768 at 640-768 (0.98-0.99x), 0.99-1.08x at 1024-2560; AVX2
 * (emulated on that Zen 4: MARCACHE_CPU_ISA=avx2, OPENBLAS_CORETYPE=Haswell)
 * 0.93-1.07x at 32-96 rows but for 3072 x 768 (0.85-0.88x), 0.85-0.98x at
 * 128-256. Not below the lane threshold (96): fp32 calls between the two
 * would take the lane kernel, slower than both. */
#define MC_PANEL_MAX_AVX512 768
#define MC_PANEL_MAX_AVX2 96
/* The lanes of the small-row summation order (one AVX-512 vector, two AVX2
 * ones): x rows are padded to a multiple of it. */
#define MC_SMALLROW_LANES 16
#define MC_SMALLROW_MAX_LIMIT 4096

const char *mc_cpu_isa_name(mc_cpu_isa isa);
int mc_cpu_isa_supported(mc_cpu_isa isa);
mc_cpu_isa mc_cpu_isa_best(void);
/* *isa = the ISA named by mc_cpu_isa_name's `name`; 0 (isa untouched) for
 * any other name. */
int mc_cpu_isa_from_name(const char *name, mc_cpu_isa *isa);
/* What a CPU backend reads from the environment when it is made, so a
 * model's kernels and memory never change under it. */
typedef struct mc_cpu_config {
    mc_cpu_isa isa;   /* MARCACHE_CPU_ISA: the small-row kernels' instruction set */
    int smallrow_max; /* MARCACHE_SMALLROW_MAX: linear's small-row threshold (the lane kernel) */
    int panel_max;    /* the same for column panels (MARCACHE_SMALLROW_MAX sets both) */
    int huge_pages;   /* MARCACHE_HUGE_PAGES: buffers of 2 MiB or more asked for huge pages */
    mc_cpu_gemm_split gemm_split; /* MARCACHE_GEMM_SPLIT: auto, rows or cols */
    int panels;       /* MARCACHE_SMALLROW_PANELS: fp32 weights' column panels (cpu_panels.c) */
    int graphs;       /* MARCACHE_CPU_GRAPHS: recorded head steps replayed on one team (cpu_graph.c) */
} mc_cpu_config;
/* The configuration a CPU backend made now uses (the environment read,
 * checked: a bad value is MC_ERR_VALUE naming the variable). */
mc_status mc_cpu_config_from_env(mc_cpu_config *cfg, mc_err *err);
mc_cpu_isa mc_cpu_isa_of(mc_backend *be);

/* ---- Vector math: expf, softmax rows, GELU, SiLU (cpu_vmath.c; issue 23). ---- */
/* e^x from IEEE operations only: the same bits on every ISA and C library,
 * within 2 ulp of the exact value. */
float mc_expf(float x);
/* y[i] = mc_expf(x[i]) with isa's vectors (the same bits). */
void mc_cpu_expf_array(mc_cpu_isa isa, const float *x, float *y, int64_t n);
/* y[i] = mc_gelu_erf(x[i]) with isa's vectors (the same bits); y may be x. */
void mc_cpu_gelu_erf_array(mc_cpu_isa isa, const float *x, float *y, int64_t n);
/* y[i] = mc_silu(x[i]) with isa's vectors (the same bits); y may be x. */
void mc_cpu_silu_array(mc_cpu_isa isa, const float *x, float *y, int64_t n);
/* Each of `rows` rows of `cols` (stride ld) replaced by its softmax, in
 * place, in one order for every isa. */
void mc_cpu_softmax_rows(mc_cpu_isa isa, float *s, int64_t rows, int64_t cols, int64_t ld);
int mc_cpu_smallrow_max(mc_backend *be);
int mc_cpu_panel_max(mc_backend *be);
mc_cpu_gemm_split mc_cpu_gemm_split_of(mc_backend *be);

/* One small-row linear: y = beta * y + act(xp W^T + bias), the contract of
 * the op (ops_list.h) with x already packed by mc_cpu_smallrow_pack_x. */
typedef struct mc_smallrow_job {
    mc_wtype wt;
    const float *xp;  /* rows of ldxp floats: x rounded to wt, zero past in */
    int64_t ldxp;     /* xp's row stride, mc_smallrow_ldxp(in) */
    int64_t rows, in, out;
    const void *w;    /* [out, in] of wt */
    const float *bias; /* [out] or NULL */
    mc_act act;
    float beta;       /* 0 or 1 */
    float *y;
    int64_t ldy;
} mc_smallrow_job;

/* The row stride of the packed x for `in` inputs: in rounded up to whole
 * chunks of MC_SMALLROW_LANES, plus one chunk where that is an even number
 * of 64-byte lines. An odd number of lines puts the same input of
 * successive rows in different L1 sets: with 1024 inputs (4 KiB rows) the
 * kernels' 5 to 8 x rows at one input all fell in one 8-way set beside the
 * weights streaming through it (measured: 10-16% slower at 8-16 rows). */
int64_t mc_smallrow_ldxp(int64_t in);
/* x rows (row stride ldx) into xp (row stride ldxp), rounded to a 16-bit
 * wt as mc_wtype_round does, zeros in [in, ldxp). */
void mc_cpu_smallrow_pack_x(mc_wtype wt, const float *x, int64_t ldx, int64_t rows, int64_t in, int64_t ldxp,
                            float *xp);
/* Runs the job with `isa`'s kernel, outputs split across `threads` (one
 * parallel region; serial inside another region or for small jobs). */
void mc_cpu_smallrow_run(mc_cpu_isa isa, int threads, const mc_smallrow_job *j);
void mc_cpu_smallrow_team_body(mc_cpu_isa isa, const mc_smallrow_job *j, int tid, int team);
/* Whether mc_cpu_slice_act applies act (GELU, SiLU: the kernels then store
 * with MC_ACT_NONE and leave it to that). */
int mc_cpu_slice_act_is_vector(mc_act act);
/* GELU or SiLU over outputs [begin, end) of `rows` rows of y (stride ldy), in
 * isa's vectors, right after a small-row kernel wrote them (still in L1/L2):
 * the bits of the scalar mc_gelu_erf / mc_silu, which the store's epilogue
 * would apply one element at a time (GELU: 18x the AVX-512 form's time).
 * Other activations: nothing. */
void mc_cpu_slice_act(mc_cpu_isa isa, mc_act act, float *y, int64_t ldy, int64_t rows, int64_t begin, int64_t end);
/* Thread t of nt's share [begin, *end) of `total` outputs: contiguous
 * slices of whole multiples of `align` (empty for a thread past the end). */
int64_t mc_cpu_thread_slice(int64_t total, int t, int nt, int64_t align, int64_t *end);
/* The kernels' shared pieces: the fixed 16-lane summation tree, and the
 * epilogue (bias, activation, residual) storing nr x no sums. */
float mc_smallrow_reduce16(const float lane[MC_SMALLROW_LANES]);
void mc_smallrow_store(const mc_smallrow_job *j, int64_t r0, int nr, int64_t o0, int no, const float *sums,
                       int ld_sums);

/* ---- Column panels: fp32 linear weights laid out for few rows (cpu_panels.c). ---- */

/* Outputs per panel: a panel holds W^T's columns [32 p, 32 p + 32) as
 * [in][32] floats (zeros past out), so the kernel reads one sequential
 * stream and each x value it broadcasts meets 32 outputs. */
#define MC_PANEL_COLS 32

/* A bound fp32 linear weight and its panels (made at load). */
typedef struct mc_cpu_panel_weight {
    const char *w;  /* the buffer bind_linear was given: [out, in] floats */
    int64_t out, in;
    float *panels;  /* [ceil(out / 32)][in][32]; NULL after a write into w, until the next call */
} mc_cpu_panel_weight;

typedef struct mc_cpu_panel_set {
    mc_cpu_panel_weight *items;
    int64_t count, capacity;
} mc_cpu_panel_set;

/* The backend's set, and its configuration (cpu_backend.c). */
mc_cpu_panel_set *mc_cpu_panel_set_of(mc_backend *be);
/* `bytes` of host memory laid out as the backend's buffers are (2 MiB
 * aligned with huge pages advised from 2 MiB, under MARCACHE_HUGE_PAGES;
 * else 64-byte aligned); NULL with MemoryError naming `what` and the size
 * in err when out of memory; mc_aligned_free frees it. */
void *mc_cpu_host_alloc(mc_backend *be, size_t bytes, const char *what, mc_err *err);
/* The CPU backend's bind_linear (ops.h): notes an fp32 weight and makes its
 * panels (nothing when panels are off, their threshold is 0 or the weights
 * are 16-bit; no panels for the plain ISA, whose kernel reads W). */
mc_status mc_cpu_bind_linear(mc_backend *be, const void *w, int64_t out, int64_t in, mc_err *err);
/* Notes the weight and, with `make`, makes its panels now (at load: a first
 * call inside the generation loop would pay for them, ~1 s for MAR-B's
 * transformer). */
mc_status mc_cpu_panel_set_add(mc_backend *be, mc_cpu_panel_set *set, const void *w, int64_t out, int64_t in,
                               int make, mc_err *err);
/* A buffer was released: forget the weight bound there. */
void mc_cpu_panel_set_forget(mc_cpu_panel_set *set, const void *buffer);
/* [dst, dst + bytes) was written: drop the panels of every weight it touches
 * (they are made again at the next small-row call). */
void mc_cpu_panel_set_stale(mc_cpu_panel_set *set, const void *dst, size_t bytes);
void mc_cpu_panel_set_free(mc_cpu_panel_set *set);
/* Whether the fp32 weight `w` of a linear call ([out, in]: a bound weight or
 * rows of one starting at a multiple of 32) runs in panel order: 1 with
 * *panels its first panel (made again now if `make` and a write dropped
 * them; NULL when !make), 0 when it does not (not bound, another width,
 * rows not aligned, panels off); -1 with err set when making them failed. */
int mc_cpu_panels_for(mc_backend *be, const void *w, int64_t out, int64_t in, int make, const float **panels,
                      mc_err *err);
/* Rows per register block of isa's panel kernel (the plain one takes any). */
int mc_cpu_panel_block_rows(mc_cpu_isa isa);
/* y = beta * y + act(x W^T + bias) with fp32 panels: output (r, o) is
 * fma(x[r][in - 1], W[o][in - 1], ... fma(x[r][0], W[o][0], 0)), the
 * inputs in increasing order, one rounding each, then + bias, act, + y; the
 * same bits on every ISA, thread count and row count. The vector kernels
 * first write x into `xt` (rows x in floats) as register blocks of at most
 * mc_cpu_panel_block_rows(isa) rows; the plain
 * kernel reads x and w instead (so it checks the packing too) and xt may be
 * NULL. */
typedef struct mc_panel_job {
    const float *x;
    int64_t ldx;
    float *xt;
    const float *w;      /* [out, in] */
    const float *panels; /* panel 0 = outputs [0, 32) of this call */
    int64_t rows, in, out;
    const float *bias;
    mc_act act;
    float beta;
    float *y;
    int64_t ldy;
} mc_panel_job;
void mc_cpu_panel_run(mc_cpu_isa isa, int threads, const mc_panel_job *j);
/* The parallel part of mc_cpu_panel_run / mc_cpu_smallrow_run for thread
 * `tid` of a team of `team`: every thread of the team calls it (the panel
 * body holds a barrier of the enclosing team between packing x and the
 * kernel). The runs open a region for it; a CPU graph's replay calls it on
 * its persistent team. */
void mc_cpu_panel_team_body(mc_cpu_isa isa, const mc_panel_job *j, int tid, int team);

/* A small-row linear call planned for a team (cpu_dense.c): which kernel,
 * and its job with x already packed for the lane kernel. */
typedef enum mc_linear_path { MC_LINEAR_BLAS = 0, MC_LINEAR_PANELS = 1, MC_LINEAR_LANES = 2 } mc_linear_path;
typedef struct mc_linear_plan {
    mc_linear_path path;
    mc_cpu_isa isa;
    mc_panel_job panel;
    mc_smallrow_job lane;
} mc_linear_plan;
/* Whether `linear` with these operands takes a small-row kernel (panels or
 * lanes) rather than OpenBLAS, without making anything. */
int mc_cpu_linear_takes_small_rows(mc_backend *be, const void *w, int64_t rows, int64_t in, int64_t out);
/* Plans a linear call (scratch taken, panels made if dropped, x packed for
 * the lane kernel): plan->path MC_LINEAR_BLAS when it is OpenBLAS's. */
mc_status mc_cpu_linear_plan_of(mc_backend *be, const float *x, int64_t ldx, int64_t rows, int64_t in,
                                const void *w, const float *bias, int64_t out, mc_act act, float beta, float *y,
                                int64_t ldy, mc_linear_plan *plan, mc_err *err);
/* Thread `tid`'s part of a planned small-row call, on a team of `team`. */
void mc_cpu_linear_team_body(const mc_linear_plan *plan, int tid, int team);

/* Plain-loop reference of mc_cpu_conv2d_ex (same contract), for tests. */
mc_status mc_cpu_conv2d_ex_naive(mc_backend *be, const mc_window2d *g, const float *x, int64_t cin,
                                 int64_t ldx, const float *w, const float *bias, int64_t cout,
                                 float beta, int relu, float *y, int64_t ldy, mc_err *err);

#endif

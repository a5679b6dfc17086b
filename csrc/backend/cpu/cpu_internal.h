/* CPU backend internals: the op implementations the table in cpu_backend.c
 * points to, split by file (dense, attention, conv, sampler). */
#ifndef MC_CPU_INTERNAL_H
#define MC_CPU_INTERNAL_H

#include "../ops.h"

/* cblas is reached through these so the BLAS symbol prefix lives in one place. */
/* `threads`: the team size for a GEMM called outside a parallel region
 * (inside one it always runs serially on the calling thread). */
void mc_cpu_sgemm(int threads, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                  const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c,
                  int64_t ldc);
const char *mc_cpu_blas_config(void);
/* The kernel family OpenBLAS chose at load (e.g. "SkylakeX"). */
const char *mc_cpu_blas_core(void);
int mc_cpu_threads(mc_backend *be);

/* The op table's entries: mc_cpu_<op> for every op of ops_list.h (the CPU
 * backend implements them all; a new op lands here first). */
#define MC_OP(name, where, params, args, flops) mc_status mc_cpu_##name params;
#include "../ops_list.h"

/* Plain-loop reference of mc_cpu_conv2d (same contract), for tests. */
mc_status mc_cpu_conv2d_naive(mc_backend *be, const float *x, int64_t batch, int64_t height,
                              int64_t width, int64_t cin, const float *w, const float *bias,
                              int64_t cout, int ksize, float beta, float *y, mc_err *err);

/* Prepares rows [0, rows) of y (row stride ldy, cout columns) for a GEMM
 * that adds onto them: y = beta * y + bias. Returns the beta the GEMM must
 * then use. beta == 0 never reads y (it may hold garbage or NaN). Shared by
 * conv2d and conv2d_ex. */
float mc_cpu_prefill_bias(float *y, int64_t rows, int64_t cout, int64_t ldy, const float *bias, float beta);

/* Elementwise kernels shared by several ops. */
float mc_gelu_erf(float x);
float mc_silu(float x);
float mc_gelu_tanh(float x);

/* Plain-loop reference of mc_cpu_conv2d_ex (same contract), for tests. */
mc_status mc_cpu_conv2d_ex_naive(mc_backend *be, const mc_window2d *g, const float *x, int64_t cin,
                                 int64_t ldx, const float *w, const float *bias, int64_t cout,
                                 float beta, int relu, float *y, int64_t ldy, mc_err *err);

#endif

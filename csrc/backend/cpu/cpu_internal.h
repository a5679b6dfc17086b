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

mc_status mc_cpu_gemm(mc_backend *be, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                      float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
                      float beta, float *c, int64_t ldc, mc_err *err);
mc_status mc_cpu_linear(mc_backend *be, const float *x, int64_t ldx, int64_t rows, int64_t in,
                        const void *w, const float *bias, int64_t out, mc_act act, float beta,
                        float *y, int64_t ldy, mc_err *err);
mc_status mc_cpu_layernorm(mc_backend *be, const float *x, int64_t ldx, int64_t rows, int64_t dim,
                           const float *w, const float *b, float eps, const float *shift,
                           const float *scale, int64_t ld_mod, float *y, int64_t ldy, mc_err *err);
mc_status mc_cpu_activation(mc_backend *be, mc_act act, float *x, int64_t ld, int64_t rows,
                            int64_t dim, mc_err *err);
mc_status mc_cpu_add_rows(mc_backend *be, float *y, int64_t ldy, int64_t rows, int64_t dim,
                          const float *v, int64_t ldv, int64_t period, mc_err *err);
mc_status mc_cpu_gated_add(mc_backend *be, float *y, int64_t ldy, const float *u, int64_t ldu,
                           const float *gate, int64_t ldg, int64_t rows, int64_t dim, mc_err *err);
mc_status mc_cpu_gather_rows(mc_backend *be, const float *src, int64_t lds, const int32_t *idx,
                             int64_t rows, int64_t dim, float *dst, int64_t ldd, mc_err *err);
mc_status mc_cpu_scatter_rows(mc_backend *be, const float *src, int64_t lds, const int32_t *idx,
                              int64_t rows, int64_t dim, float *dst, int64_t ldd, mc_err *err);
mc_status mc_cpu_attention(mc_backend *be, int64_t batch, int64_t nq, int heads, int head_dim,
                           float scale, const float *q, int64_t ldq, int64_t q_bstride,
                           const mc_kv_segment *segs, int nsegs, float *out, int64_t ldo,
                           int64_t o_bstride, mc_err *err);
mc_status mc_cpu_groupnorm(mc_backend *be, const float *x, int64_t batch, int64_t hw,
                           int64_t channels, int groups, const float *w, const float *b, float eps,
                           int swish, float *y, mc_err *err);
mc_status mc_cpu_conv2d(mc_backend *be, const float *x, int64_t batch, int64_t height,
                        int64_t width, int64_t cin, const float *w, const float *bias,
                        int64_t cout, int ksize, float beta, float *y, mc_err *err);
/* Plain-loop reference of mc_cpu_conv2d (same contract), for tests. */
mc_status mc_cpu_conv2d_naive(mc_backend *be, const float *x, int64_t batch, int64_t height,
                              int64_t width, int64_t cin, const float *w, const float *bias,
                              int64_t cout, int ksize, float beta, float *y, mc_err *err);
mc_status mc_cpu_upsample_nearest2x(mc_backend *be, const float *x, int64_t batch, int64_t height,
                                    int64_t width, int64_t channels, float *y, mc_err *err);
mc_status mc_cpu_cfg_combine(mc_backend *be, const float *cond, int64_t ldc, const float *uncond,
                             int64_t ldu, int64_t rows, int channels, float scale, float *out,
                             int64_t ldo, mc_err *err);
mc_status mc_cpu_ddpm_step(mc_backend *be, float *x, int64_t rows, int channels, const float *eps,
                           int64_t ld_eps, const float *v, int64_t ld_v, const float *noise,
                           const mc_ddpm_coefs *coefs, mc_err *err);
mc_status mc_cpu_token_normals(mc_backend *be, uint64_t seed, uint32_t stream, uint32_t step,
                               const uint32_t *image, const uint32_t *position, int64_t rows,
                               int channels, float *out, mc_err *err);

mc_status mc_cpu_axpby(mc_backend *be, float a, const float *x, int64_t ldx, float b, float *y,
                       int64_t ldy, int64_t rows, int64_t cols, mc_err *err);
mc_status mc_cpu_cosine_rows(mc_backend *be, const float *a, int64_t lda, const float *b,
                             int64_t ldb, int64_t rows, int heads, int head_dim, float *out,
                             mc_err *err);

mc_status mc_cpu_attention_mass(mc_backend *be, int64_t batch, int64_t nq, int heads, int head_dim,
                                float scale, const float *q, int64_t ldq, int64_t q_bstride,
                                const float *k, int64_t ldk, int64_t k_bstride, int64_t keys,
                                float *out, mc_err *err);

/* Prepares rows [0, rows) of y (row stride ldy, cout columns) for a GEMM
 * that adds onto them: y = beta * y + bias. Returns the beta the GEMM must
 * then use. beta == 0 never reads y (it may hold garbage or NaN). Shared by
 * conv2d and conv2d_ex. */
float mc_cpu_prefill_bias(float *y, int64_t rows, int64_t cout, int64_t ldy, const float *bias, float beta);

/* Elementwise kernels shared by several ops. */
float mc_gelu_erf(float x);
float mc_silu(float x);

/* Window ops for FID-Inception (cpu_window.c). */
mc_status mc_cpu_conv2d_ex(mc_backend *be, const mc_window2d *g, const float *x, int64_t cin,
                           int64_t ldx, const float *w, const float *bias, int64_t cout, float beta,
                           int relu, float *y, int64_t ldy, mc_err *err);
/* Plain-loop reference of mc_cpu_conv2d_ex (same contract), for tests. */
mc_status mc_cpu_conv2d_ex_naive(mc_backend *be, const mc_window2d *g, const float *x, int64_t cin,
                                 int64_t ldx, const float *w, const float *bias, int64_t cout,
                                 float beta, int relu, float *y, int64_t ldy, mc_err *err);
mc_status mc_cpu_avg_pool2d(mc_backend *be, const mc_window2d *g, const float *x, int64_t channels,
                            int64_t ldx, int count_include_pad, float *y, int64_t ldy, mc_err *err);
mc_status mc_cpu_max_pool2d(mc_backend *be, const mc_window2d *g, const float *x, int64_t channels,
                            int64_t ldx, float *y, int64_t ldy, mc_err *err);
mc_status mc_cpu_resize_bilinear_tf1(mc_backend *be, const void *x, mc_pixel_type type,
                                     int64_t batch, int64_t in_h, int64_t in_w, int64_t channels,
                                     int64_t out_h, int64_t out_w, int normalize, float *y,
                                     mc_err *err);

#endif

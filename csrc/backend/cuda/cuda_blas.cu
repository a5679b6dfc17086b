/* GEMM-based ops on the CUDA backend: gemm, linear (cuBLAS GEMM + a fused
 * bias/activation epilogue), activation, and the bias prefill and ReLU
 * passes that conv2d / conv2d_ex share.
 *
 * Row-major to cuBLAS: a row-major [m, n] matrix with row stride ld is the
 * column-major [n, m] matrix with leading dimension ld, i.e. its transpose.
 * So C = op(A) op(B) in row-major is C^T = op(B)^T op(A)^T in column-major:
 * cuBLAS gets (B, A) swapped, m and n swapped, and each keeps its own
 * transpose flag. */
#include <limits.h>
#include <math.h>

#include "cuda_internal.h"

/* ---- kernels ------------------------------------------------------------- */

__device__ __forceinline__ float gelu_erf(float x) {
    return 0.5f * x * (1.0f + erff(x * 0.70710678118654752440f));
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

/* The CPU's mc_gelu_tanh, same operation order (PyTorch's approximate='tanh'). */
__device__ __forceinline__ float gelu_tanh(float x) {
    const float cube = x * x * x;
    const float inner = 0.79788456080286535588f * (x + 0.044715f * cube);
    return 0.5f * x * (1.0f + tanhf(inner));
}

__device__ __forceinline__ float apply_act(int act, float v) {
    if (act == MC_ACT_GELU)
        return gelu_erf(v);
    if (act == MC_ACT_SILU)
        return silu(v);
    if (act == MC_ACT_GELU_TANH)
        return gelu_tanh(v);
    return v;
}

/* y = act(y + bias) over rows x cols (bias may be NULL). One thread per
 * element, grid-stride over the flattened index (64-bit). */
__global__ void bias_act_kernel(float *y, int64_t ldy, int64_t rows, int64_t cols,
                                const float *bias, int act) {
    const int64_t n = rows * cols;
    MC_GRID_STRIDE_LOOP(i, n) {
        int64_t r = i / cols, c = i - r * cols;
        float *p = y + r * ldy + c;
        float v = *p;
        if (bias != NULL)
            v += bias[c];
        *p = apply_act(act, v);
    }
}

/* y = beta * y + bias, never reading y when beta == 0 (it may hold NaN). */
__global__ void prefill_bias_kernel(float *y, int64_t ldy, int64_t rows, int64_t cols,
                                    const float *bias, float beta) {
    const int64_t n = rows * cols;
    MC_GRID_STRIDE_LOOP(i, n) {
        int64_t r = i / cols, c = i - r * cols;
        float *p = y + r * ldy + c;
        float b = bias != NULL ? bias[c] : 0.0f;
        *p = beta != 0.0f ? beta * *p + b : b;
    }
}

__global__ void relu_kernel(float *y, int64_t ldy, int64_t rows, int64_t cols) {
    const int64_t n = rows * cols;
    MC_GRID_STRIDE_LOOP(i, n) {
        int64_t r = i / cols, c = i - r * cols;
        float *p = y + r * ldy + c;
        float v = *p;
        *p = v > 0.0f ? v : 0.0f; /* NaN -> 0, as the CPU backend */
    }
}

/* x [rows, in] (row stride ldx) -> contiguous 16-bit copy, rounded to
 * nearest even (the host's mc_f32_to_bf16 / mc_f32_to_f16 give the same
 * bits, so the CPU emulation of a 16-bit linear sees the same operands). */
template <typename T>
__global__ void round_rows_kernel(const float *x, int64_t ldx, int64_t rows, int64_t in, T *out) {
    const int64_t n = rows * in;
    MC_GRID_STRIDE_LOOP(i, n) {
        int64_t r = i / in, c = i - r * in;
        mc_store_rounded(out + i, x[r * ldx + c]);
    }
}

/* ---- host side ----------------------------------------------------------- */

mc_status mc_cuda_prefill_bias(mc_backend *be, float *y, int64_t rows, int64_t cols, int64_t ldy,
                               const float *bias, float beta, mc_err *err) {
    if (rows <= 0 || cols <= 0)
        return MC_OK;
    prefill_bias_kernel<<<mc_cuda_blocks(rows * cols, MC_CUDA_THREADS), MC_CUDA_THREADS, 0,
                          cuda_st(be)->stream>>>(y, ldy, rows, cols, bias, beta);
    MC_CUDA_LAUNCHED("prefill_bias_kernel", err);
    return MC_OK;
}

mc_status mc_cuda_relu_rows(mc_backend *be, float *y, int64_t rows, int64_t cols, int64_t ldy,
                            mc_err *err) {
    if (rows <= 0 || cols <= 0)
        return MC_OK;
    relu_kernel<<<mc_cuda_blocks(rows * cols, MC_CUDA_THREADS), MC_CUDA_THREADS, 0,
                  cuda_st(be)->stream>>>(y, ldy, rows, cols);
    MC_CUDA_LAUNCHED("relu_kernel", err);
    return MC_OK;
}

static int fits_int(int64_t v) { return v >= 0 && v <= INT_MAX; }

/* Row-major C[m,n] = alpha op(A) op(B) + beta C, A and B of element type
 * `type` (float32 or the 16-bit weight type), C float32, fp32 compute (no
 * TF32). The body of mc_cuda_sgemm and mc_cuda_gemm_16bit_nt. */
static mc_status gemm_of_type(mc_backend *be, int trans_a, int trans_b, int64_t m, int64_t n,
                              int64_t k, float alpha, const void *a, int64_t lda, const void *b,
                              int64_t ldb, cudaDataType_t type, float beta, float *c, int64_t ldc,
                              mc_err *err) {
    if (m <= 0 || n <= 0)
        return MC_OK;
    if (k <= 0) /* an empty sum: C = beta * C (cuBLAS would reject lda = 0) */
        return mc_cuda_prefill_bias(be, c, m, n, ldc, NULL, beta, err);
    if (!fits_int(m) || !fits_int(n) || !fits_int(k) || !fits_int(lda) || !fits_int(ldb) ||
        !fits_int(ldc))
        return mc_fail(err, MC_ERR_VALUE,
                       "cuda gemm: sizes m=%lld n=%lld k=%lld (lda %lld, ldb %lld, ldc %lld) "
                       "exceed cuBLAS's 32-bit arguments",
                       (long long)m, (long long)n, (long long)k, (long long)lda, (long long)ldb,
                       (long long)ldc);
    cublasHandle_t h = cuda_st(be)->blas;
    /* C^T[n, m] = op(B)^T op(A)^T: B first, with B's own flag (see the top). */
    MC_CUBLAS_TRY(mc_cublas.gemm_ex(h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                               trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, (int)n, (int)m, (int)k, &alpha,
                               b, type, (int)ldb, a, type, (int)lda, &beta, c, CUDA_R_32F,
                               (int)ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                  err);
    return MC_OK;
}

mc_status mc_cuda_sgemm(mc_backend *be, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                        float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
                        float beta, float *c, int64_t ldc, mc_err *err) {
    return gemm_of_type(be, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, CUDA_R_32F, beta, c,
                        ldc, err);
}

mc_status mc_cuda_gemm(mc_backend *be, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                       float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
                       float beta, float *c, int64_t ldc, mc_err *err) {
    MC_TRY(mc_cuda_enter(be, err));
    return mc_cuda_sgemm(be, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, err);
}

mc_status mc_cuda_round_rows_16bit(mc_backend *be, const float *x, int64_t ldx, int64_t rows,
                                   int64_t in, void *out16, mc_err *err) {
    if (rows <= 0 || in <= 0)
        return MC_OK;
    cudaStream_t stream = cuda_st(be)->stream;
    const unsigned blocks = mc_cuda_blocks(rows * in, MC_CUDA_THREADS);
    if (be->linear_wtype == MC_WTYPE_BF16)
        round_rows_kernel<<<blocks, MC_CUDA_THREADS, 0, stream>>>(x, ldx, rows, in,
                                                                 (__nv_bfloat16 *)out16);
    else
        round_rows_kernel<<<blocks, MC_CUDA_THREADS, 0, stream>>>(x, ldx, rows, in, (__half *)out16);
    MC_CUDA_LAUNCHED("round_rows_16bit_kernel", err);
    return MC_OK;
}

mc_status mc_cuda_gemm_16bit_nt(mc_backend *be, int64_t m, int64_t n, int64_t k, const void *a16,
                                int64_t lda, const void *w16, int64_t ldw, float beta, float *y,
                                int64_t ldy, mc_err *err) {
    return gemm_of_type(be, 0, 1, m, n, k, 1.0f, a16, lda, w16, ldw,
                        be->linear_wtype == MC_WTYPE_BF16 ? CUDA_R_16BF : CUDA_R_16F, beta, y, ldy,
                        err);
}

/* y = beta * y + x W^T with W of the backend's 16-bit weight type: x is
 * rounded to that type into scratch, cuBLAS multiplies the 16-bit operands
 * on the tensor cores and sums in float32 into the float32 y (autocast's
 * arithmetic). */
static mc_status gemm_16bit_weights(mc_backend *be, const float *x, int64_t ldx, int64_t rows,
                                    int64_t in, const void *w, int64_t out, float beta, float *y,
                                    int64_t ldy, mc_err *err) {
    if (!fits_int(rows) || !fits_int(in) || !fits_int(out) || !fits_int(ldy))
        return mc_fail(err, MC_ERR_VALUE,
                       "cuda linear: sizes rows=%lld in=%lld out=%lld exceed cuBLAS's 32-bit "
                       "arguments",
                       (long long)rows, (long long)in, (long long)out);
    void *x16 = mc_cuda_scratch(be, MC_CUDA_SLOT_HALF_X, (size_t)(rows * in) * 2,
                               "a 16-bit linear's rounded input", err);
    if (x16 == NULL)
        return err->status;
    MC_TRY(mc_cuda_round_rows_16bit(be, x, ldx, rows, in, x16, err));
    return mc_cuda_gemm_16bit_nt(be, rows, out, in, x16, in, w, in, beta, y, ldy, err);
}

/* y = beta * y + act(x W^T + bias). The GEMM writes (beta = 0) or adds onto
 * (beta = 1) y; one epilogue pass then adds the bias and applies the
 * activation. cuBLASLt's GELU epilogue is the tanh approximation, not the
 * erf form the models use, so the epilogue is ours. */
mc_status mc_cuda_linear(mc_backend *be, const float *x, int64_t ldx, int64_t rows, int64_t in,
                         const void *w, const float *bias, int64_t out, mc_act act, float beta,
                         float *y, int64_t ldy, mc_err *err) {
    if (rows == 0 || out == 0)
        return MC_OK;
    if (beta != 0.0f && act != MC_ACT_NONE)
        return mc_fail(err, MC_ERR_INTERNAL, "linear: activation with accumulation is not defined");
    MC_TRY(mc_cuda_enter(be, err));
    if (be->linear_wtype == MC_WTYPE_F32 || in == 0)
        MC_TRY(mc_cuda_sgemm(be, 0, 1, rows, out, in, 1.0f, x, ldx, (const float *)w, in, beta, y,
                             ldy, err));
    else
        MC_TRY(gemm_16bit_weights(be, x, ldx, rows, in, w, out, beta, y, ldy, err));
    if (bias == NULL && act == MC_ACT_NONE)
        return MC_OK;
    bias_act_kernel<<<mc_cuda_blocks(rows * out, MC_CUDA_THREADS), MC_CUDA_THREADS, 0,
                      cuda_st(be)->stream>>>(y, ldy, rows, out, bias, (int)act);
    MC_CUDA_LAUNCHED("bias_act_kernel", err);
    return MC_OK;
}

mc_status mc_cuda_activation(mc_backend *be, mc_act act, float *x, int64_t ld, int64_t rows,
                             int64_t dim, mc_err *err) {
    if (act == MC_ACT_NONE || rows <= 0 || dim <= 0)
        return MC_OK;
    MC_TRY(mc_cuda_enter(be, err));
    bias_act_kernel<<<mc_cuda_blocks(rows * dim, MC_CUDA_THREADS), MC_CUDA_THREADS, 0,
                      cuda_st(be)->stream>>>(x, ld, rows, dim, NULL, (int)act);
    MC_CUDA_LAUNCHED("bias_act_kernel", err);
    return MC_OK;
}

/* CUDA backend internals, shared by the .cu files of this folder: the
 * backend state, error helpers that turn CUDA and cuBLAS codes into mc_err
 * messages naming the call, launch geometry helpers and the op entry points
 * the table in cuda_backend.cu points to.
 *
 * Everything is fp32, row-major, in the backend's stream; ops never
 * synchronise except download and large uploads (which hand host memory
 * back); small uploads are staged through pinned memory and only enqueued. */
#ifndef MC_CUDA_INTERNAL_H
#define MC_CUDA_INTERNAL_H

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
#include "../../core/mc_core.h"
#include "../devpool.h"
#include "../ops.h"
#include "../op_checks.h" /* argument checks shared with the CPU backend */
}

#include "cuda_backend.h"

/* Grow-only scratch slots for op internals (im2col columns, statistics),
 * like the CPU backend's mc_cpu_scratch. No op keeps scratch across calls,
 * but an op may use several slots at once. */
#define MC_CUDA_SCRATCH_SLOTS 8
enum {
    MC_CUDA_SLOT_COLUMNS = 0, /* im2col chunks of conv2d / conv2d_ex */
    MC_CUDA_SLOT_STATS = 1,   /* groupnorm partial sums, attention_mass row statistics */
    MC_CUDA_SLOT_HALF_X = 2,  /* linear's input rounded to the 16-bit weight type */
    MC_CUDA_SLOT_SAMPLING = 3, /* sample_tokens: per-block weights and sort keys */
    MC_CUDA_SLOT_HALF_W = 4,  /* a 16-bit convolution's weights rounded to the type */
    MC_CUDA_SLOT_SCORES = 5,  /* attention's score matrix at head dims above 128 */
};

typedef struct cuda_state {
    int device;
    cudaStream_t stream;
    cublasHandle_t blas;
    /* This backend's membership of its device's shared caching allocator
     * (backend/devpool.h): every backend on the device (MAR, VAE,
     * Inception, VAR, VQVAE) takes memory from the same pool; freed blocks
     * stay cached, so the same sizes allocated again in steady state never
     * reach cudaMalloc, and an out-of-memory gives every backend's cached
     * blocks back to the device before it retries. */
    mc_devpool_owner *pool_owner;
    int naive; /* run the reference kernels (mc_cuda_set_naive) */
    /* Pinned staging ring for small uploads (index lists, per-step vectors):
     * the host bytes are copied here and the copy to the device is only
     * enqueued, so an upload inside the AR loop does not wait for the
     * stream. staging_used bytes have been handed out since the last stream
     * synchronisation; the ring wraps only after one (cuda_backend.cu). */
    char *staging;
    size_t staging_used;
    /* Graph recording (capture_begin .. capture_end). graphs_enabled is off
     * with MARCACHE_CUDA_GRAPHS=0 (for comparisons and debugging). During a
     * recording alloc/upload/download fail and release is deferred until the
     * recording ends, since a recorded free would run at every replay. */
    int graphs_enabled;
    int capturing;
    int capture_failed;
    /* Blocks released during a recording, returned to the pool when it
     * ends (a recording with a release is discarded, ops.h; until then the
     * recorded kernels may still name the block). Grows by doubling: a
     * recorded step may release any number of blocks, and a block left
     * off this list would never return to the pool. */
    void **deferred_free;
    int deferred_count;
    int deferred_capacity;
    void *blas_workspace; /* explicit cuBLAS workspace: recordable GEMMs */
    size_t total_mem; /* the device's global memory, for requests that can never fit */
    size_t smem_per_block_optin; /* the most dynamic shared memory a kernel may opt in to */
    void *scratch[MC_CUDA_SCRATCH_SLOTS];
    size_t scratch_bytes[MC_CUDA_SCRATCH_SLOTS];
    /* Row faults of the sampling ops (a row of logits with NaN, +inf or no
     * finite entry: MC_ERR_NUMERIC on the CPU). Finding one is data the
     * host only has after a wait, and ops never wait: the kernel records
     * the fault in this device word (mc_cuda_record_row_fault) and the next
     * download, which waits anyway, reads it back into row_fault_host
     * (pinned) and fails with the CPU's message. MC_ROW_FAULT_NONE: none. */
    unsigned long long *row_fault;
    unsigned long long *row_fault_host;
} cuda_state;

static inline cuda_state *cuda_st(mc_backend *be) { return (cuda_state *)be->impl; }

/* Records a failed CUDA runtime call ("cudaMemcpyAsync: out of memory");
 * cudaErrorMemoryAllocation maps to MC_ERR_NOMEM (MemoryError), anything
 * else to MC_ERR_INTERNAL (RuntimeError). Clears the runtime's last error so
 * a later launch check does not report it again. The runtime does not say
 * how much such a call needed; an allocation of ours goes through
 * mc_cuda_fail_alloc, which names what and how many bytes. */
mc_status mc_cuda_fail(cudaError_t code, const char *call, mc_err *err);
mc_status mc_cuda_fail_alloc(cudaError_t code, const char *call, size_t bytes, const char *what,
                             mc_err *err);
mc_status mc_cublas_fail(cublasStatus_t code, const char *call, mc_err *err);

#define MC_CUDA_TRY(call, err)                                 \
    do {                                                       \
        cudaError_t mc_cuda_code_ = (call);                    \
        if (mc_cuda_code_ != cudaSuccess)                      \
            return mc_cuda_fail(mc_cuda_code_, #call, (err));  \
    } while (0)

/* MC_CUDA_TRY for a cudaMalloc / cudaMallocHost of `bytes` bytes of `what`. */
#define MC_CUDA_ALLOC_TRY(call, bytes, what, err)                                    \
    do {                                                                             \
        cudaError_t mc_cuda_code_ = (call);                                          \
        if (mc_cuda_code_ != cudaSuccess)                                            \
            return mc_cuda_fail_alloc(mc_cuda_code_, #call, (bytes), (what), (err)); \
    } while (0)

/* 1 when MARCACHE_CUDA_SYNC=1 (read once per process): the device is
 * synchronised after every kernel launch and cuBLAS call, so an
 * asynchronous fault is reported under the kernel that caused it rather
 * than under the next launch or copy. For debugging: it serialises host
 * and device, and it turns graph recording off (a synchronisation is not
 * allowed inside one). */
int mc_cuda_sync_launches(void);

/* The error of the work just enqueued, under MARCACHE_CUDA_SYNC=1. */
#define MC_CUDA_SYNC_CHECK(what, err)                                                     \
    do {                                                                                  \
        if (mc_cuda_sync_launches()) {                                                    \
            cudaError_t mc_sync_code_ = cudaDeviceSynchronize();                          \
            if (mc_sync_code_ != cudaSuccess)                                             \
                return mc_cuda_fail(mc_sync_code_, what " (MARCACHE_CUDA_SYNC=1: waited on " \
                                                        "it)",                            \
                                    (err));                                               \
        }                                                                                 \
    } while (0)

#define MC_CUBLAS_TRY(call, err)                                   \
    do {                                                           \
        cublasStatus_t mc_cublas_code_ = (call);                   \
        if (mc_cublas_code_ != CUBLAS_STATUS_SUCCESS)              \
            return mc_cublas_fail(mc_cublas_code_, #call, (err));  \
        MC_CUDA_SYNC_CHECK(#call, err);                            \
    } while (0)

/* After every kernel launch: a bad configuration (grid, shared memory) or
 * an earlier asynchronous fault shows up here; with MARCACHE_CUDA_SYNC=1
 * the kernel's own fault too, under its name. */
#define MC_CUDA_LAUNCHED(name, err)                                   \
    do {                                                              \
        cudaError_t mc_launch_code_ = cudaGetLastError();             \
        if (mc_launch_code_ != cudaSuccess)                           \
            return mc_cuda_fail(mc_launch_code_, "launch of " name, (err)); \
        MC_CUDA_SYNC_CHECK("kernel " name, err);                      \
    } while (0)

/* Makes the backend's device current on the calling thread (the binding may
 * call from any thread). Every op starts with it. */
mc_status mc_cuda_enter(mc_backend *be, mc_err *err);

/* Scratch of at least `bytes` in slot `slot` (grow-only; the old block is
 * freed in stream order, after the kernels that used it). `what` names it in
 * an out-of-memory message. */
void *mc_cuda_scratch(mc_backend *be, int slot, size_t bytes, const char *what, mc_err *err);

/* ---- row faults of the sampling ops ------------------------------------- */

#define MC_ROW_FAULT_NONE 0xffffffffffffffffull
#define MC_ROW_FAULT_ROW_BITS 54

/* Records that row `row` of op `op` has fault `fault` (sampling_inline.h:
 * MC_ROW_NAN, MC_ROW_POS_INF, MC_ROW_NO_FINITE). The word keeps the
 * smallest (op id, row) since it was last read, so the report does not
 * depend on the order the blocks ran in. */
__device__ __forceinline__ void mc_cuda_record_row_fault(unsigned long long *word, int op,
                                                         int64_t row, int fault) {
    atomicMin(word, (unsigned long long)op << (MC_ROW_FAULT_ROW_BITS + 2) |
                        (unsigned long long)row << 2 | (unsigned long long)fault);
}

/* ---- launch geometry ---------------------------------------------------- */

#define MC_CUDA_THREADS 256
/* Grid-stride loops cover any element count with at most this many blocks
 * (far below the 2^31 - 1 limit of gridDim.x; 2^16 blocks of 256 threads
 * keep every SM of the largest parts busy). */
#define MC_CUDA_MAX_BLOCKS 65536

static inline unsigned mc_cuda_blocks(int64_t n, int threads) {
    int64_t b = (n + threads - 1) / threads;
    if (b < 1)
        b = 1;
    return (unsigned)(b < MC_CUDA_MAX_BLOCKS ? b : MC_CUDA_MAX_BLOCKS);
}

/* 64-bit grid-stride index: i runs over [0, n). */
#define MC_GRID_STRIDE_LOOP(i, n)                                                \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);    \
         i += (int64_t)gridDim.x * blockDim.x)

/* ---- 16-bit storage ------------------------------------------------------ */

/* Round to nearest even into the 16-bit type (the bits of core/half.h). */
__device__ __forceinline__ void mc_store_rounded(__nv_bfloat16 *p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void mc_store_rounded(__half *p, float v) { *p = __float2half_rn(v); }
/* float storage keeps v: the float32 instantiation of a kernel templated on T. */
__device__ __forceinline__ void mc_store_rounded(float *p, float v) { *p = v; }

/* x rounded to T (nearest even) and back; T = float keeps x (the fp32 kernel). */
template <typename T> __device__ __forceinline__ float round_to(float x);
template <> __device__ __forceinline__ float round_to<float>(float x) { return x; }
template <> __device__ __forceinline__ float round_to<__nv_bfloat16>(float x) {
    return __bfloat162float(__float2bfloat16_rn(x));
}
template <> __device__ __forceinline__ float round_to<__half>(float x) {
    return __half2float(__float2half_rn(x));
}

/* ---- warp and block reductions ----------------------------------------- */

template <typename T> __device__ __forceinline__ T mc_warp_sum(T v) {
    for (int offset = 16; offset > 0; offset >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ float mc_warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

/* Sum over the whole block (blockDim.x a multiple of 32, at most 1024);
 * every thread gets the total. `shared` holds 32 values. The order of the
 * additions depends only on blockDim, so results are reproducible. Ends with
 * a barrier so `shared` may be reused at once. */
template <typename T> __device__ T mc_block_sum(T v, T *shared) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    v = mc_warp_sum(v);
    if (lane == 0)
        shared[warp] = v;
    __syncthreads();
    T total = lane < warps ? shared[lane] : (T)0;
    total = mc_warp_sum(total);
    __syncthreads();
    return total;
}

/* Maximum over the whole block (fmaxf skips NaN; -inf where every value is
 * NaN, as a loop of fmaxf from -inf gives), as mc_block_sum: every thread gets it, `shared` holds 32 values, ends with
 * a barrier. */
__device__ __forceinline__ float mc_block_max(float v, float *shared) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    v = mc_warp_max(v);
    if (lane == 0)
        shared[warp] = v;
    __syncthreads();
    float m = lane < warps ? shared[lane] : -INFINITY;
    m = mc_warp_max(m);
    __syncthreads();
    return m;
}

/* ---- cuBLAS ------------------------------------------------------------- */

/* The cuBLAS entry points the backend uses, resolved by dlopen when the
 * first CUDA backend is made (cuda_cublas.cu: mc_cuda_cublas_load), so the
 * extension has no link-time dependency on libcublas. The types come from
 * the headers (decltype), so a call through the table is checked like a
 * direct one. Filled once and never changed after a successful load. */
typedef struct mc_cublas_api {
    decltype(&cublasCreate_v2) create;
    decltype(&cublasDestroy_v2) destroy;
    decltype(&cublasSetStream_v2) set_stream;
    decltype(&cublasSetWorkspace_v2) set_workspace;
    decltype(&cublasSetMathMode) set_math_mode;
    decltype(&cublasSetAtomicsMode) set_atomics_mode;
    /* The 32-bit-int cublasGemmEx (C++ also sees an int64_t overload). */
    cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                              const void *, const void *, cudaDataType, int, const void *,
                              cudaDataType, int, const void *, void *, cudaDataType, int,
                              cublasComputeType_t, cublasGemmAlgo_t);
    decltype(&cublasGetProperty) get_property;
    decltype(&cublasGetStatusString) get_status_string;
    decltype(&cublasGetStatusName) get_status_name;
} mc_cublas_api;

extern mc_cublas_api mc_cublas;

/* Row-major C[m,n] = alpha op(A) op(B) + beta C on the backend's handle
 * (fp32 compute, no TF32). beta == 0 never reads C. k == 0 scales C. */
mc_status mc_cuda_sgemm(mc_backend *be, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                        float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
                        float beta, float *c, int64_t ldc, mc_err *err);

/* out16[r * in + c] = x[r * ldx + c] rounded to nearest even into the
 * backend's 16-bit linear_wtype (rows x in values, written densely). */
mc_status mc_cuda_round_rows_16bit(mc_backend *be, const float *x, int64_t ldx, int64_t rows,
                                   int64_t in, void *out16, mc_err *err);

/* Row-major y[m, n] = beta * y + a16 w16^T: a16 [m, k] (row stride lda) and
 * w16 [n, k] (row stride ldw) of the backend's 16-bit linear_wtype, products
 * summed in float32 on the tensor cores into the float32 y (autocast's
 * arithmetic). beta == 0 never reads y. */
mc_status mc_cuda_gemm_16bit_nt(mc_backend *be, int64_t m, int64_t n, int64_t k, const void *a16,
                                int64_t lda, const void *w16, int64_t ldw, float beta, float *y,
                                int64_t ldy, mc_err *err);

/* y[r, :cols] = beta * y + bias (beta == 0: y = bias, y never read);
 * bias NULL and beta 0: y = 0. */
mc_status mc_cuda_prefill_bias(mc_backend *be, float *y, int64_t rows, int64_t cols, int64_t ldy,
                               const float *bias, float beta, mc_err *err);

/* y = max(y, 0) over rows x cols (NaN -> 0, as the CPU's y > 0 ? y : 0). */
mc_status mc_cuda_relu_rows(mc_backend *be, float *y, int64_t rows, int64_t cols, int64_t ldy,
                            mc_err *err);

/* ---- the op table entries (one file per family) -------------------------- */

/* mc_cuda_<op> for every op of ops_list.h that runs on every backend
 * (ALL); a CPU_ONLY op has no CUDA entry point yet. */
#define MC_CUDA_PROTOTYPE_ALL(name, params) mc_status mc_cuda_##name params;
#define MC_CUDA_PROTOTYPE_CPU_ONLY(name, params)
#define MC_OP(name, where, params, args, flops) MC_CUDA_PROTOTYPE_##where(name, params)
#include "../ops_list.h"
#undef MC_CUDA_PROTOTYPE_ALL
#undef MC_CUDA_PROTOTYPE_CPU_ONLY

#endif

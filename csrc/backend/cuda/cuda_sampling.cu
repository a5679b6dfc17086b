/* VAR's sampling ops on the CUDA backend: sample_tokens and gumbel_softmax
 * (contracts in ops_list.h). Each mirrors cpu_sampling.c step for step.
 *
 * One block per row (grid-stride over rows). The parts whose order does not
 * change a result run on all threads: the row checks (integer counts), the
 * maximum, the top-k threshold (radix selection with integer histograms),
 * the exponentials, the sort of the top-p order (keys are unique, so any
 * correct sort gives the one order) and the masking. The sums that decide a
 * token run sequentially on thread 0 in the contract's orders, as on the
 * CPU, so both backends take the same decisions except where CUDA's double
 * exp (within 1 ulp) differs from the C library's and a running sum lands
 * within that rounding of a decision boundary.
 *
 * A row that cannot be sampled (NaN, +inf, no finite entry) is recorded in
 * the backend's row-fault word and reported by the next download
 * (cuda_internal.h); the row's token is set to 0 so that later ops index
 * inside the codebook, and its logits / probs are left as they were. */
#include <math.h>

extern "C" {
#include "../../core/philox.h" /* the stream numbers */
}
#include "../../core/philox_inline.h"
#include "../sampling_inline.h"
#include "cuda_internal.h"

#define SAMPLE_THREADS 256
/* Rows in flight at once for sample_tokens: its scratch is per block
 * (vocab weights and the sort keys), 64 KB per block at vocab 4096. */
#define SAMPLE_MAX_BLOCKS 512

/* ---- block helpers -------------------------------------------------------- */

/* Maximum over the block (blockDim.x a multiple of 32); every thread gets
 * it. A maximum does not depend on the order it is taken in. Ends with a
 * barrier so `shared` (32 values) may be reused at once. */
template <typename T> static __device__ T block_max(T v, T *shared) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    for (int offset = 16; offset > 0; offset >>= 1) {
        T other = __shfl_xor_sync(0xffffffffu, v, offset);
        v = other > v ? other : v;
    }
    if (lane == 0)
        shared[warp] = v;
    __syncthreads();
    T total = lane < warps ? shared[lane] : shared[0];
    for (int offset = 16; offset > 0; offset >>= 1) {
        T other = __shfl_xor_sync(0xffffffffu, total, offset);
        total = other > total ? other : total;
    }
    __syncthreads();
    return total;
}

/* The row's fault (sampling_inline.h) and its largest finite logit, the same
 * classification as cpu_sampling.c's classify_row. Block-uniform results. */
static __device__ int classify_row(const float *row, int64_t vocab, float *max_out, int *ishared,
                            float *fshared) {
    int has_nan = 0, has_pos_inf = 0, has_finite = 0;
    float max_value = -INFINITY;
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
        const float v = row[j];
        if (isnan(v))
            has_nan = 1;
        else if (v == INFINITY)
            has_pos_inf = 1;
        else if (v != -INFINITY) {
            has_finite = 1;
            max_value = fmaxf(max_value, v);
        }
    }
    has_nan = mc_block_sum(has_nan, ishared);
    has_pos_inf = mc_block_sum(has_pos_inf, ishared);
    has_finite = mc_block_sum(has_finite, ishared);
    *max_out = block_max(max_value, fshared);
    return has_nan ? MC_ROW_NAN : has_pos_inf ? MC_ROW_POS_INF : has_finite ? MC_ROW_FINE : MC_ROW_NO_FINITE;
}

/* ---- sample_tokens --------------------------------------------------------- */

/* The k-th largest value of the row (1 <= k <= vocab): radix selection on
 * the order keys, most significant byte first, as cpu_sampling.c's
 * kth_largest. The histograms are integer counts (the atomics' order does
 * not matter); thread 0 walks each one. Block-uniform result. */
static __device__ float kth_largest(const float *row, int64_t vocab, int64_t k, unsigned *hist,
                             int *digit_shared, long long *need_shared) {
    uint32_t prefix = 0, mask = 0;
    long long need = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x)
            hist[i] = 0;
        __syncthreads();
        for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
            const uint32_t key = mc_logit_order_key(row[j]);
            if ((key & mask) == prefix)
                atomicAdd(&hist[(key >> shift) & 0xffu], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int digit = 255;
            while ((long long)hist[digit] < need) {
                need -= hist[digit];
                digit--;
            }
            *digit_shared = digit;
            *need_shared = need;
        }
        __syncthreads();
        /* Read before the next pass's barrier; thread 0 writes them again
         * only after the next pass's second barrier. */
        prefix |= (uint32_t)*digit_shared << shift;
        mask |= 0xffu << shift;
        need = *need_shared;
    }
    return mc_logit_key_value(prefix);
}

/* Ascending bitonic sort of keys[0, n) (n a power of two) by the block.
 * Each compare-exchange pair belongs to one thread per stage; the barrier
 * after a stage makes its global writes visible to the whole block. */
static __device__ void block_sort_keys(unsigned long long *keys, int64_t n) {
    for (int64_t size = 2; size <= n; size <<= 1)
        for (int64_t stride = size >> 1; stride > 0; stride >>= 1) {
            for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
                const int64_t partner = i ^ stride;
                if (partner > i) {
                    const unsigned long long a = keys[i], b = keys[partner];
                    const bool ascending = (i & size) == 0;
                    if ((a > b) == ascending) {
                        keys[i] = b;
                        keys[partner] = a;
                    }
                }
            }
            __syncthreads();
        }
}

/* weights: SAMPLE_MAX_BLOCKS * vocab doubles; keys: SAMPLE_MAX_BLOCKS *
 * sort_n words (only with the top-p filter; sort_n = vocab rounded up to a
 * power of two). */
__global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_tokens_kernel(float *logits, int64_t ld, int64_t rows, int64_t vocab, int64_t top_k,
                         float top_p, uint64_t seed, uint32_t step, const uint32_t *image,
                         const uint32_t *position, int32_t *out, double *weights,
                         unsigned long long *keys_all, int64_t sort_n,
                         unsigned long long *row_fault) {
    __shared__ int ishared[32];
    __shared__ float fshared[32];
    __shared__ unsigned hist[256];
    __shared__ int digit_shared;
    __shared__ long long need_shared;
    __shared__ long long cut_shared;
    double *e = weights + (int64_t)blockIdx.x * vocab;
    unsigned long long *keys = keys_all != NULL ? keys_all + (int64_t)blockIdx.x * sort_n : NULL;
    const bool use_top_k = top_k > 0 && top_k < vocab;
    const bool use_top_p = top_p > 0.0f && top_p < 1.0f;

    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        float *row = logits + r * ld;
        float max_value;
        const int fault = classify_row(row, vocab, &max_value, ishared, fshared);
        if (fault != MC_ROW_FINE) { /* block-uniform: every thread skips the row */
            if (threadIdx.x == 0) {
                out[r] = 0;
                mc_cuda_record_row_fault(row_fault, MC_OP_ID_sample_tokens, r, fault);
            }
            continue;
        }
        /* Neither filter removes the largest value: one maximum for all steps. */
        const double max_logit = (double)max_value;

        /* a) top-k */
        if (use_top_k) {
            const float threshold = kth_largest(row, vocab, top_k, hist, &digit_shared, &need_shared);
            for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x)
                if (row[j] < threshold)
                    row[j] = -INFINITY;
            __syncthreads();
        }

        /* b) top-p: weights in vocabulary order, their sum on thread 0 in
         * that order, the ascending (value, index) order by sorting the
         * unique keys; thread 0 runs the cumulative sum along it. The -inf
         * entries come first and add exact zeros (cpu_sampling.c leaves
         * them out of its sort: the same sums). Since the running sum only
         * grows, the removed entries are a prefix of the order: thread 0
         * stops at the first sum above the bound, and the block masks the
         * prefix. */
        if (use_top_p) {
            for (int64_t j = threadIdx.x; j < sort_n; j += blockDim.x) {
                if (j < vocab) {
                    const float v = row[j];
                    e[j] = v == -INFINITY ? 0.0 : exp((double)v - max_logit);
                    keys[j] = (unsigned long long)mc_logit_order_key(v) << 32 | (unsigned long long)j;
                } else {
                    keys[j] = ~0ull; /* padding sorts last: no real key has a NaN's bits */
                }
            }
            __syncthreads();
            block_sort_keys(keys, sort_n);
            if (threadIdx.x == 0) {
                double sum = 0.0;
                for (int64_t j = 0; j < vocab; j++)
                    sum += e[j];
                const double bound = 1.0 - (double)top_p;
                double cumulative = 0.0;
                long long cut = 0;
                for (int64_t i = 0; i < vocab - 1; i++) { /* never the last entry */
                    cumulative += e[keys[i] & 0xffffffffull] / sum;
                    if (!(cumulative <= bound))
                        break;
                    cut = i + 1;
                }
                cut_shared = cut;
            }
            __syncthreads();
            for (int64_t i = threadIdx.x; i < cut_shared; i += blockDim.x)
                row[keys[i] & 0xffffffffull] = -INFINITY;
            __syncthreads();
        }

        /* c) the draw: weights of the filtered row in parallel, running sum
         * on thread 0 (stored in place), then the first running sum above
         * u * total. The sums only grow, so a binary search finds the same
         * entry as the CPU's scan. */
        for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
            const float v = row[j];
            e[j] = v == -INFINITY ? 0.0 : exp((double)v - max_logit);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            double total = 0.0;
            for (int64_t j = 0; j < vocab; j++) {
                total += e[j];
                e[j] = total;
            }
            uint32_t words[4];
            mc_philox_block_inline(seed, image[r], MC_STREAM_VAR_SAMPLE, position[r], step, 0, words);
            const double u = (double)words[0] / 4294967296.0;
            const double target = u * total;
            int64_t lo = 0, hi = vocab; /* first j in [lo, hi) with e[j] > target, or vocab */
            while (lo < hi) {
                const int64_t mid = lo + (hi - lo) / 2;
                if (e[mid] > target)
                    hi = mid;
                else
                    lo = mid + 1;
            }
            int64_t token = lo;
            if (token == vocab) { /* rounding only: the last entry with weight */
                token = vocab - 1;
                while (token > 0 && !(row[token] != -INFINITY &&
                                      exp((double)row[token] - max_logit) > 0.0))
                    token--;
            }
            out[r] = (int32_t)token;
        }
        __syncthreads(); /* e and the shared words are reused by the next row */
    }
}

mc_status mc_cuda_sample_tokens(mc_backend *be, float *logits, int64_t ld, int64_t rows,
                                int64_t vocab, int64_t top_k, float top_p, uint64_t seed,
                                uint32_t step, const uint32_t *image, const uint32_t *position,
                                int32_t *out, mc_err *err) {
    MC_TRY(mc_check_logit_rows("sample_tokens", ld, rows, vocab, err));
    MC_TRY(mc_check_top_p(top_p, err));
    if (rows == 0)
        return MC_OK;
    MC_TRY(mc_cuda_enter(be, err));
    const bool use_top_p = top_p > 0.0f && top_p < 1.0f;
    int64_t sort_n = 1;
    while (sort_n < vocab)
        sort_n <<= 1;
    const int64_t blocks = rows < SAMPLE_MAX_BLOCKS ? rows : SAMPLE_MAX_BLOCKS;
    const size_t weight_bytes = (size_t)blocks * (size_t)vocab * sizeof(double);
    const size_t key_bytes = use_top_p ? (size_t)blocks * (size_t)sort_n * sizeof(unsigned long long) : 0;
    char *scratch = (char *)mc_cuda_scratch(be, MC_CUDA_SLOT_SAMPLING, weight_bytes + key_bytes,
                                            "the sampling weights and keys", err);
    if (scratch == NULL)
        return err->status;
    double *weights = (double *)scratch;
    unsigned long long *keys = use_top_p ? (unsigned long long *)(scratch + weight_bytes) : NULL;
    cuda_state *st = cuda_st(be);
    sample_tokens_kernel<<<(unsigned)blocks, SAMPLE_THREADS, 0, st->stream>>>(
        logits, ld, rows, vocab, top_k, top_p, seed, step, image, position, out, weights, keys,
        sort_n, st->row_fault);
    MC_CUDA_LAUNCHED("sample_tokens_kernel", err);
    return MC_OK;
}

/* ---- gumbel_softmax -------------------------------------------------------- */

/* z_j = (l_j * logit_scale + g_j) / tau of entry j (-inf for a -inf logit),
 * with u from word j % 4 of the given Philox block. __dmul_rn keeps the
 * product rounded on its own, as the CPU's (no fused multiply-add). */
__device__ __forceinline__ double gumbel_logit(float logit, uint32_t word, double scale, double tau) {
    if (logit == -INFINITY)
        return -INFINITY;
    const double u = ((double)word + 0.5) / 4294967296.0;
    const double gumbel = -log(-log(u));
    return __dadd_rn(__dmul_rn((double)logit, scale), gumbel) / tau;
}

/* The z of the entries of a row that Philox block b draws for (4, fewer at
 * the end of the row) into z; returns how many. */
__device__ __forceinline__ int gumbel_block(const float *row, int64_t vocab, int64_t b, uint64_t seed,
                                            uint32_t image, uint32_t position, uint32_t step, double scale,
                                            double tau, double z[4]) {
    uint32_t words[4];
    mc_philox_block_inline(seed, image, MC_STREAM_VAR_GUMBEL, position, step, (uint32_t)b, words);
    int n = 0;
    for (; n < 4 && 4 * b + n < vocab; n++)
        z[n] = gumbel_logit(row[4 * b + n], words[n], scale, tau);
    return n;
}

/* One block per row, three passes over the row that recompute z (a few
 * Philox rounds per 4 entries) instead of keeping it: the maximum, the sum
 * of exp(z - max), the probabilities. The sum is the block's fixed-order
 * reduction (mc_block_sum): no decision rests on it, and it differs from
 * the CPU's sequential sum by rounding only. */
__global__ void __launch_bounds__(SAMPLE_THREADS)
    gumbel_softmax_kernel(const float *logits, int64_t ld, int64_t rows, int64_t vocab,
                          float logit_scale, float tau, uint64_t seed, uint32_t step,
                          const uint32_t *image, const uint32_t *position, float *probs,
                          int64_t ldp, unsigned long long *row_fault) {
    __shared__ int ishared[32];
    __shared__ float fshared[32];
    __shared__ double dshared[32];
    const double scale = (double)logit_scale, t = (double)tau;
    const int64_t nblocks = (vocab + 3) / 4;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *row = logits + r * ld;
        float unused_max;
        const int fault = classify_row(row, vocab, &unused_max, ishared, fshared);
        if (fault != MC_ROW_FINE) {
            if (threadIdx.x == 0)
                mc_cuda_record_row_fault(row_fault, MC_OP_ID_gumbel_softmax, r, fault);
            continue;
        }
        double z[4], max_z = -INFINITY;
        for (int64_t b = threadIdx.x; b < nblocks; b += blockDim.x) {
            const int n = gumbel_block(row, vocab, b, seed, image[r], position[r], step, scale, t, z);
            for (int i = 0; i < n; i++)
                max_z = z[i] > max_z ? z[i] : max_z;
        }
        max_z = block_max(max_z, dshared);
        double sum = 0.0;
        for (int64_t b = threadIdx.x; b < nblocks; b += blockDim.x) {
            const int n = gumbel_block(row, vocab, b, seed, image[r], position[r], step, scale, t, z);
            for (int i = 0; i < n; i++)
                sum += z[i] == -INFINITY ? 0.0 : exp(z[i] - max_z);
        }
        sum = mc_block_sum(sum, dshared);
        float *p = probs + r * ldp;
        for (int64_t b = threadIdx.x; b < nblocks; b += blockDim.x) {
            const int n = gumbel_block(row, vocab, b, seed, image[r], position[r], step, scale, t, z);
            for (int i = 0; i < n; i++)
                p[4 * b + i] = (float)((z[i] == -INFINITY ? 0.0 : exp(z[i] - max_z)) / sum);
        }
    }
}

mc_status mc_cuda_gumbel_softmax(mc_backend *be, const float *logits, int64_t ld, int64_t rows,
                                 int64_t vocab, float logit_scale, float tau, uint64_t seed,
                                 uint32_t step, const uint32_t *image, const uint32_t *position,
                                 float *probs, int64_t ldp, mc_err *err) {
    MC_TRY(mc_check_logit_rows("gumbel_softmax", ld, rows, vocab, err));
    MC_TRY(mc_check_gumbel(logit_scale, tau, ldp, vocab, err));
    if (rows == 0)
        return MC_OK;
    MC_TRY(mc_cuda_enter(be, err));
    cuda_state *st = cuda_st(be);
    gumbel_softmax_kernel<<<mc_cuda_blocks(rows, 1), SAMPLE_THREADS, 0, st->stream>>>(
        logits, ld, rows, vocab, logit_scale, tau, seed, step, image, position, probs, ldp,
        st->row_fault);
    MC_CUDA_LAUNCHED("gumbel_softmax_kernel", err);
    return MC_OK;
}

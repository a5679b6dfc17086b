/* Attention on the CUDA backend.
 *
 * attention: a fused flash-style kernel (one pass over the K/V segments with
 * an online softmax: running max m, running sum l, and the output rescaled
 * by exp(m_old - m_new) whenever the max grows), which is exactly the merge
 * of per-segment softmax partials that ops.h asks for; no K/V is copied and
 * the scores never reach global memory. Head dims up to 128 run on it (64
 * and 80 with the loop bounds fixed at compile time); larger head dims (the
 * VAE's single 512-wide head, the VQVAE's 640-wide one) run on cuBLAS
 * (attention_gemm: scores, softmax, weighted sum), and the reference mode
 * uses attention_naive, a plain two-pass softmax, one block per query row.
 * With a 16-bit weight type
 * (mc_attention_is_16bit) the tensor-core kernel below runs instead, and in
 * the reference mode attention_naive_16bit (the CPU emulation's arithmetic).
 *
 * attention_mass: row statistics (max and 1 / sum of exponentials) per
 * (item, head, query), then one thread per (item, key) adds the
 * probabilities over heads and queries in the CPU's order. */
#include <math.h>
#include <mma.h>

#include "cuda_internal.h"

/* Segments travel as one kernel argument (a few hundred bytes, well inside
 * the 4 KiB limit). More segments than this are refused: the models use one
 * or two; the op test at most eight. */
#define ATT_MAX_SEGS 16

struct att_segments {
    const float *k[ATT_MAX_SEGS];
    const float *v[ATT_MAX_SEGS];
    int64_t rows[ATT_MAX_SEGS];
    int64_t ld[ATT_MAX_SEGS];
    int64_t bstride[ATT_MAX_SEGS];
    int count;
};

/* ---- flash kernel ---------------------------------------------------------
 *
 * Launch geometry: one block per (item b, head h, tile of query rows), a
 * 1-D grid of batch * heads * tiles blocks. A block has W warps (1..4, fewer
 * when nq is small) and each warp owns ATT_ROWS = 4 query rows, so a tile is
 * 4 W rows. K/V stream through shared memory in tiles of ATT_BK = 32 keys:
 *   scores: lane j of a warp computes the score of key j for its 4 rows
 *           (K tile rows padded to DMAX + 1 floats so the 32 lanes reading
 *           column d of 32 different rows hit 32 different banks);
 *   softmax: warp max / warp sum by shuffles, per row;
 *   P V:    lane owns output columns lane, lane + 32, ... (NT of them), and
 *           p_j is broadcast from lane j by a shuffle.
 * Shared memory (static): Q 16 x DMAX + K 32 x (DMAX + 1) + V 32 x DMAX
 * floats = 41,088 bytes at DMAX = 128, under the 48 KiB static limit.
 * Keys past a segment's end load as zeros with score -inf (p = 0), so a
 * partial tile contributes nothing, and 0 * V never meets garbage. */
#define ATT_ROWS 4
#define ATT_MAX_WARPS 4
#define ATT_BK 32

template <int NT, int DFIX>
__global__ void __launch_bounds__(32 * ATT_MAX_WARPS)
    flash_attention_kernel(int64_t nq, int heads, int head_dim, float scale, const float *q,
                           int64_t ldq, int64_t q_bstride, att_segments segs, float *out,
                           int64_t ldo, int64_t o_bstride, int64_t qtiles) {
    constexpr int DMAX = 32 * NT;
    const int D = DFIX > 0 ? DFIX : head_dim;
    __shared__ float qs[ATT_MAX_WARPS * ATT_ROWS][DMAX];
    __shared__ float ks[ATT_BK][DMAX + 1];
    __shared__ float vs[ATT_BK][DMAX];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tile_rows = (int)(blockDim.x >> 5) * ATT_ROWS;
    int64_t block = blockIdx.x;
    const int64_t tile = block % qtiles;
    block /= qtiles;
    const int h = (int)(block % heads);
    const int64_t b = block / heads;
    const int64_t i0 = tile * tile_rows;

    for (int e = threadIdx.x; e < tile_rows * D; e += blockDim.x) {
        int r = e / D, d = e - r * D;
        int64_t i = i0 + r;
        qs[r][d] = i < nq ? q[b * q_bstride + i * ldq + (int64_t)h * D + d] : 0.0f;
    }

    float m[ATT_ROWS], l[ATT_ROWS], o[ATT_ROWS][NT];
#pragma unroll
    for (int r = 0; r < ATT_ROWS; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
#pragma unroll
        for (int t = 0; t < NT; t++)
            o[r][t] = 0.0f;
    }

    for (int s = 0; s < segs.count; s++) {
        const int64_t rows = segs.rows[s], ld = segs.ld[s];
        const float *kb = segs.k[s] + b * segs.bstride[s] + (int64_t)h * D;
        const float *vb = segs.v[s] + b * segs.bstride[s] + (int64_t)h * D;
        for (int64_t t0 = 0; t0 < rows; t0 += ATT_BK) {
            const int n = rows - t0 < ATT_BK ? (int)(rows - t0) : ATT_BK;
            __syncthreads(); /* the previous tile is consumed (and Q is loaded) */
            for (int e = threadIdx.x; e < ATT_BK * D; e += blockDim.x) {
                int j = e / D, d = e - j * D;
                float kv = 0.0f, vv = 0.0f;
                if (j < n) {
                    kv = kb[(t0 + j) * ld + d];
                    vv = vb[(t0 + j) * ld + d];
                }
                ks[j][d] = kv;
                vs[j][d] = vv;
            }
            __syncthreads();

            float sc[ATT_ROWS];
#pragma unroll
            for (int r = 0; r < ATT_ROWS; r++)
                sc[r] = 0.0f;
#pragma unroll 8
            for (int d = 0; d < D; d++) {
                const float kd = ks[lane][d];
#pragma unroll
                for (int r = 0; r < ATT_ROWS; r++)
                    sc[r] += qs[warp * ATT_ROWS + r][d] * kd;
            }
            float p[ATT_ROWS];
#pragma unroll
            for (int r = 0; r < ATT_ROWS; r++) {
                const float x = lane < n ? sc[r] * scale : -INFINITY;
                const float m_new = fmaxf(m[r], mc_warp_max(x));
                const float alpha = expf(m[r] - m_new); /* 0 on the first tile (m = -inf) */
                p[r] = expf(x - m_new);
                l[r] = l[r] * alpha + mc_warp_sum(p[r]);
                m[r] = m_new;
#pragma unroll
                for (int t = 0; t < NT; t++)
                    o[r][t] *= alpha;
            }
            for (int j = 0; j < n; j++) {
                float vj[NT];
#pragma unroll
                for (int t = 0; t < NT; t++) /* columns D..DMAX-1 of vs are never loaded */
                    vj[t] = lane + 32 * t < D ? vs[j][lane + 32 * t] : 0.0f;
#pragma unroll
                for (int r = 0; r < ATT_ROWS; r++) {
                    const float pj = __shfl_sync(0xffffffffu, p[r], j);
#pragma unroll
                    for (int t = 0; t < NT; t++)
                        o[r][t] += pj * vj[t];
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < ATT_ROWS; r++) {
        const int64_t i = i0 + warp * ATT_ROWS + r;
        if (i >= nq)
            continue;
        float *orow = out + b * o_bstride + i * ldo + (int64_t)h * D;
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const int d = lane + 32 * t;
            if (d < D)
                orow[d] = o[r][t] / l[r];
        }
    }
}

/* ---- reference kernel -----------------------------------------------------
 *
 * attention_naive: the textbook two-pass softmax, one block of
 * NAIVE_THREADS per (item, head, query row), grid-stride over those rows.
 * Pass 1 finds the max score over every key of every segment; pass 2 adds
 * exp(s - max) into l and exp(s - max) v into the output row (each thread
 * owns the columns d = tid, tid + blockDim, ...); the row is divided by l at
 * the end. Each score is a block-wide dot product. Slow, any head_dim. */
#define NAIVE_THREADS 128

/* Both naive references (attention_naive and attention_naive_16bit, the one
 * kernel template below) walk the same rows and keys: query row `row` of the grid-stride order (query
 * index fastest, then head, then item), and key j of segment s for its item
 * and head. */
struct naive_row {
    int64_t b;      /* item */
    int h;          /* head */
    const float *q; /* the query row */
    float *o;       /* the output row */
};

__device__ __forceinline__ naive_row naive_row_of(int64_t row, int64_t nq, int heads, int D, const float *q,
                                                  int64_t ldq, int64_t q_bstride, float *out, int64_t ldo,
                                                  int64_t o_bstride) {
    const int64_t i = row % nq, bh = row / nq;
    naive_row r;
    r.h = (int)(bh % heads);
    r.b = bh / heads;
    r.q = q + r.b * q_bstride + i * ldq + (int64_t)r.h * D;
    r.o = out + r.b * o_bstride + i * ldo + (int64_t)r.h * D;
    return r;
}

/* Where key (and value) j of segment s of the row's item and head starts. */
__device__ __forceinline__ int64_t naive_kv_offset(const att_segments &segs, int s, int64_t j, const naive_row &r,
                                                   int D) {
    return r.b * segs.bstride[s] + j * segs.ld[s] + (int64_t)r.h * D;
}

/* A score: the block-wide dot product of q and k, each rounded to T. */
template <typename T>
__device__ float naive_score(const float *qrow, const float *krow, int D, float scale, float *red) {
    float part = 0.0f;
    for (int d = threadIdx.x; d < D; d += blockDim.x)
        part += round_to<T>(qrow[d]) * round_to<T>(krow[d]);
    return mc_block_sum(part, red) * scale;
}

/* The first pass of both references: the largest score of the row over every
 * key of every segment. */
template <typename T>
__device__ float naive_max_score(const naive_row &r, const att_segments &segs, int D, float scale, float *red) {
    float m = -INFINITY;
    for (int s = 0; s < segs.count; s++)
        for (int64_t j = 0; j < segs.rows[s]; j++)
            m = fmaxf(m, naive_score<T>(r.q, segs.k[s] + naive_kv_offset(segs, s, j, r, D), D, scale, red));
    return m;
}

/* The passes after the max, per precision. They are not one arithmetic
 * with a rounding switched off: fp32 (attention_naive) accumulates
 * exp(s - m) into l and exp(s - m) v into the output row and divides the row
 * by l at the end; 16-bit T (attention_naive_16bit: the reference for the
 * 16-bit form of attention, ops.h, and the same arithmetic as the CPU
 * emulation, cpu_attention.c attention_pair_16bit) sums l first, then adds
 * round_T(exp(s - m) / l) round_T(v), because the probabilities are
 * normalised before they are rounded: scores and sums in float32. */
template <typename T>
__device__ void naive_weighted_sum(const naive_row &r, const att_segments &segs, int D, float scale, float m,
                                   float *red) {
    float l = 0.0f;
    for (int s = 0; s < segs.count; s++)
        for (int64_t j = 0; j < segs.rows[s]; j++)
            l += expf(naive_score<T>(r.q, segs.k[s] + naive_kv_offset(segs, s, j, r, D), D, scale, red) - m);
    const float inv = 1.0f / l;
    for (int d = threadIdx.x; d < D; d += blockDim.x)
        r.o[d] = 0.0f;
    for (int s = 0; s < segs.count; s++)
        for (int64_t j = 0; j < segs.rows[s]; j++) {
            const int64_t off = naive_kv_offset(segs, s, j, r, D);
            const float p = round_to<T>(expf(naive_score<T>(r.q, segs.k[s] + off, D, scale, red) - m) * inv);
            for (int d = threadIdx.x; d < D; d += blockDim.x)
                r.o[d] += p * round_to<T>(segs.v[s][off + d]);
        }
}

template <>
__device__ void naive_weighted_sum<float>(const naive_row &r, const att_segments &segs, int D, float scale, float m,
                                          float *red) {
    float l = 0.0f;
    for (int d = threadIdx.x; d < D; d += blockDim.x)
        r.o[d] = 0.0f;
    for (int s = 0; s < segs.count; s++)
        for (int64_t j = 0; j < segs.rows[s]; j++) {
            const int64_t off = naive_kv_offset(segs, s, j, r, D);
            const float p = expf(naive_score<float>(r.q, segs.k[s] + off, D, scale, red) - m);
            l += p;
            for (int d = threadIdx.x; d < D; d += blockDim.x)
                r.o[d] += p * segs.v[s][off + d];
        }
    for (int d = threadIdx.x; d < D; d += blockDim.x)
        r.o[d] /= l;
}

/* attention_naive (T = float) and attention_naive_16bit (T = __nv_bfloat16,
 * __half): the max pass, then the precision's own passes. */
template <typename T>
__global__ void attention_naive_kernel(int64_t batch, int64_t nq, int heads, int D, float scale,
                                       const float *q, int64_t ldq, int64_t q_bstride,
                                       att_segments segs, float *out, int64_t ldo,
                                       int64_t o_bstride) {
    __shared__ float red[32];
    const int64_t items = batch * heads * nq;
    for (int64_t row = blockIdx.x; row < items; row += gridDim.x) {
        const naive_row r = naive_row_of(row, nq, heads, D, q, ldq, q_bstride, out, ldo, o_bstride);
        naive_weighted_sum<T>(r, segs, D, scale, naive_max_score<T>(r, segs, D, scale, red), red);
    }
}


/* ---- 16-bit tensor-core kernel (ops.h: autocast's attention) ---------------
 *
 * For a 16-bit linear_wtype and head dims D = 16, 32, ..., 128. One block per
 * (item, head, 64 query rows); TC_WARPS = 4 warps own 16 query rows each. K
 * and V stream through shared memory in tiles of TC_BK = 64 keys, converted
 * to the 16-bit type T on the way in (q likewise, once). Per tile and warp:
 *   S = Q_w K^T     WMMA 16x16x16, T operands, float32 accumulators, stored
 *                   to shared memory (the fragments' element layout is
 *                   opaque, the softmax needs rows);
 *   softmax:        per row, the running max m and sum l in float32 (online
 *                   softmax, exactly the segment merge of ops.h); p =
 *                   exp(scale s - m) rounded to T; O *= exp(m_old - m_new);
 *   O += P V        WMMA with the float32 O kept in shared memory.
 * Keys past a segment's end load as zeros and score -inf (p = 0).
 * Shared memory (dynamic, opted in above 48 KiB): Q, K, V tiles of
 * 64 x (D + 8) T, scores 4 x 16 x 68 float, P 4 x 16 x 72 T, O 4 x 16 x (D + 4)
 * float and 3 x 64 row statistics: 82,688 bytes at D = 80. Row strides keep
 * every WMMA pointer 32-byte aligned and every leading dimension a multiple
 * of 8 (T) or 4 (float) elements, as WMMA requires. */
#define TC_WARPS 4
#define TC_ROWS 16
#define TC_BQ (TC_WARPS * TC_ROWS)
#define TC_BK 64

template <int D> struct tc_layout {
    static constexpr int LDT = D + 8;      /* Q, K, V rows (T) */
    static constexpr int LDS = TC_BK + 4;  /* scores (float) */
    static constexpr int LDP = TC_BK + 8;  /* probabilities (T) */
    static constexpr int LDO = D + 4;      /* output accumulators (float) */
    static constexpr size_t round128(size_t b) { return (b + 127) / 128 * 128; }
    static constexpr size_t q_off = 0;
    static constexpr size_t k_off = q_off + round128((size_t)TC_BQ * LDT * 2);
    static constexpr size_t v_off = k_off + round128((size_t)TC_BK * LDT * 2);
    static constexpr size_t s_off = v_off + round128((size_t)TC_BK * LDT * 2);
    static constexpr size_t p_off = s_off + round128((size_t)TC_BQ * LDS * 4);
    static constexpr size_t o_off = p_off + round128((size_t)TC_BQ * LDP * 2);
    static constexpr size_t stat_off = o_off + round128((size_t)TC_BQ * LDO * 4);
    static constexpr size_t bytes = stat_off + round128((size_t)3 * TC_BQ * 4);
};

template <typename T, int D>
__global__ void __launch_bounds__(32 * TC_WARPS)
    tc_attention_kernel(int64_t nq, int heads, float scale, const float *q, int64_t ldq,
                        int64_t q_bstride, att_segments segs, float *out, int64_t ldo,
                        int64_t o_bstride, int64_t qtiles) {
    using namespace nvcuda;
    using L = tc_layout<D>;
    extern __shared__ __align__(128) unsigned char smem[];
    T *qs = (T *)(smem + L::q_off), *ks = (T *)(smem + L::k_off), *vs = (T *)(smem + L::v_off);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float *sw = (float *)(smem + L::s_off) + warp * TC_ROWS * L::LDS;
    T *pw = (T *)(smem + L::p_off) + warp * TC_ROWS * L::LDP;
    float *ow = (float *)(smem + L::o_off) + warp * TC_ROWS * L::LDO;
    float *mw = (float *)(smem + L::stat_off) + warp * TC_ROWS;
    float *lw = mw + TC_BQ, *aw = mw + 2 * TC_BQ;

    const int64_t tile = blockIdx.x % qtiles, bh = blockIdx.x / qtiles;
    const int h = (int)(bh % heads);
    const int64_t b = bh / heads, q0 = tile * TC_BQ;
    const float *qb = q + b * q_bstride + (int64_t)h * D;

    for (int i = threadIdx.x; i < TC_BQ * D; i += blockDim.x) {
        const int r = i / D, d = i - r * D;
        mc_store_rounded(qs + r * L::LDT + d, q0 + r < nq ? qb[(q0 + r) * ldq + d] : 0.0f);
    }
    for (int i = lane; i < TC_ROWS * L::LDO; i += 32)
        ow[i] = 0.0f;
    if (lane < TC_ROWS) {
        mw[lane] = -INFINITY;
        lw[lane] = 0.0f;
    }

    for (int g = 0; g < segs.count; g++) {
        const int64_t rows = segs.rows[g], ld = segs.ld[g];
        const float *kb = segs.k[g] + b * segs.bstride[g] + (int64_t)h * D;
        const float *vb = segs.v[g] + b * segs.bstride[g] + (int64_t)h * D;
        for (int64_t k0 = 0; k0 < rows; k0 += TC_BK) {
            __syncthreads(); /* every warp is done with the previous K/V tile (and Q is in) */
            for (int i = threadIdx.x; i < TC_BK * D; i += blockDim.x) {
                const int r = i / D, d = i - r * D;
                const int valid = k0 + r < rows;
                mc_store_rounded(ks + r * L::LDT + d, valid ? kb[(k0 + r) * ld + d] : 0.0f);
                mc_store_rounded(vs + r * L::LDT + d, valid ? vb[(k0 + r) * ld + d] : 0.0f);
            }
            __syncthreads();
            const int valid_keys = rows - k0 < TC_BK ? (int)(rows - k0) : TC_BK;

            for (int n = 0; n < TC_BK / 16; n++) {
                wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
                wmma::fill_fragment(acc, 0.0f);
                for (int kk = 0; kk < D / 16; kk++) {
                    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> kt;
                    wmma::load_matrix_sync(a, qs + warp * TC_ROWS * L::LDT + kk * 16, L::LDT);
                    /* K row-major [key][d] read column-major is K^T. */
                    wmma::load_matrix_sync(kt, ks + n * 16 * L::LDT + kk * 16, L::LDT);
                    wmma::mma_sync(acc, a, kt, acc);
                }
                wmma::store_matrix_sync(sw + n * 16, acc, L::LDS, wmma::mem_row_major);
            }
            __syncwarp();

            for (int r = 0; r < TC_ROWS; r++) {
                const float s0 = lane < valid_keys ? scale * sw[r * L::LDS + lane] : -INFINITY;
                const float s1 = lane + 32 < valid_keys ? scale * sw[r * L::LDS + lane + 32] : -INFINITY;
                const float m_old = mw[r];
                const float m_new = fmaxf(m_old, mc_warp_max(fmaxf(s0, s1)));
                const float p0 = expf(s0 - m_new), p1 = expf(s1 - m_new);
                const float sum = mc_warp_sum(p0 + p1);
                mc_store_rounded(pw + r * L::LDP + lane, p0);
                mc_store_rounded(pw + r * L::LDP + lane + 32, p1);
                __syncwarp(); /* every lane has read mw[r] */
                if (lane == 0) {
                    const float alpha = expf(m_old - m_new); /* 0 on the first tile */
                    mw[r] = m_new;
                    lw[r] = lw[r] * alpha + sum;
                    aw[r] = alpha;
                }
            }
            __syncwarp();
            for (int i = lane; i < TC_ROWS * D; i += 32) {
                const int r = i / D, d = i - r * D;
                ow[r * L::LDO + d] *= aw[r];
            }
            __syncwarp();

            for (int j = 0; j < D / 16; j++) {
                wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
                wmma::load_matrix_sync(acc, ow + j * 16, L::LDO, wmma::mem_row_major);
                for (int kk = 0; kk < TC_BK / 16; kk++) {
                    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> p;
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> v;
                    wmma::load_matrix_sync(p, pw + kk * 16, L::LDP);
                    wmma::load_matrix_sync(v, vs + kk * 16 * L::LDT + j * 16, L::LDT);
                    wmma::mma_sync(acc, p, v, acc);
                }
                wmma::store_matrix_sync(ow + j * 16, acc, L::LDO, wmma::mem_row_major);
            }
            __syncwarp();
        }
    }

    float *ob = out + b * o_bstride + (int64_t)h * D;
    for (int i = lane; i < TC_ROWS * D; i += 32) {
        const int r = i / D, d = i - r * D;
        const int64_t row = q0 + warp * TC_ROWS + r;
        if (row < nq)
            ob[row * ldo + d] = ow[r * L::LDO + d] / lw[r];
    }
}

template <typename T, int D>
static mc_status launch_tc(int64_t batch, int64_t nq, int heads, float scale, const float *q,
                           int64_t ldq, int64_t q_bstride, const att_segments &segs, float *out,
                           int64_t ldo, int64_t o_bstride, cudaStream_t stream, mc_err *err) {
    const int64_t qtiles = (nq + TC_BQ - 1) / TC_BQ, blocks = batch * heads * qtiles;
    if (blocks > 0x7fffffffLL)
        return mc_fail(err, MC_ERR_VALUE, "cuda attention: %lld blocks exceed the grid limit",
                       (long long)blocks);
    const size_t bytes = tc_layout<D>::bytes;
    MC_CUDA_TRY(cudaFuncSetAttribute(tc_attention_kernel<T, D>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes),
                err);
    tc_attention_kernel<T, D><<<(unsigned)blocks, 32 * TC_WARPS, bytes, stream>>>(
        nq, heads, scale, q, ldq, q_bstride, segs, out, ldo, o_bstride, qtiles);
    MC_CUDA_LAUNCHED("tc_attention_kernel", err);
    return MC_OK;
}

/* The head dims with a tensor-core instance (mc_attention_is_16bit admits
 * exactly these: multiples of 16 up to 128). */
#define MC_TC_HEAD_DIMS(X) X(16) X(32) X(48) X(64) X(80) X(96) X(112) X(128)

/* Dynamic shared memory the tensor-core kernel needs at `head_dim` (0: no
 * instance). Up to 163 KiB per block on sm_80 and 227 KiB on sm_90, but the
 * sm_80 machine code also runs on sm_86 / sm_89, which allow 99 KiB: there
 * the larger head dims do not fit, and mc_cuda_attention runs the 16-bit
 * reference kernel instead of failing at cudaFuncSetAttribute. */
static size_t tc_smem_bytes(int head_dim) {
#define MC_TC_BYTES(D)                                                                        \
    case D:                                                                                   \
        return tc_layout<D>::bytes;
    switch (head_dim) {
        MC_TC_HEAD_DIMS(MC_TC_BYTES)
    default:
        return 0;
    }
#undef MC_TC_BYTES
}

template <typename T>
static mc_status attention_16bit(int64_t batch, int64_t nq, int heads, int head_dim, float scale,
                                 const float *q, int64_t ldq, int64_t q_bstride,
                                 const att_segments &segs, float *out, int64_t ldo,
                                 int64_t o_bstride, cudaStream_t stream, mc_err *err) {
#define MC_TC_CASE(D)                                                                         \
    case D:                                                                                   \
        return launch_tc<T, D>(batch, nq, heads, scale, q, ldq, q_bstride, segs, out, ldo,    \
                               o_bstride, stream, err);
    switch (head_dim) {
        MC_TC_HEAD_DIMS(MC_TC_CASE)
    default:
        return mc_fail(err, MC_ERR_INTERNAL, "cuda attention: no 16-bit kernel for head dim %d",
                       head_dim);
    }
#undef MC_TC_CASE
}

/* ---- host side ------------------------------------------------------------ */

template <int NT, int DFIX>
static void launch_flash(int warps, int64_t blocks, int64_t nq, int heads, int head_dim,
                         float scale, const float *q, int64_t ldq, int64_t q_bstride,
                         const att_segments &segs, float *out, int64_t ldo, int64_t o_bstride,
                         int64_t qtiles, cudaStream_t stream) {
    flash_attention_kernel<NT, DFIX><<<(unsigned)blocks, 32 * warps, 0, stream>>>(
        nq, heads, head_dim, scale, q, ldq, q_bstride, segs, out, ldo, o_bstride, qtiles);
}

/* ---- head dims above 128: cuBLAS ------------------------------------------
 *
 * Per (item, head) and block of query rows: S = scale q k^T, one GEMM per
 * segment into that segment's columns of a score matrix; softmax_rows_kernel
 * over S in place (p = exp(s - max) / sum, the max over every segment's
 * keys, so the segments merge exactly); then out = P v, one GEMM per segment
 * adding onto the one before. All fp32 (CUBLAS_COMPUTE_32F). The naive
 * kernel these head dims ran on before (one block per query row, each score
 * a block-wide dot product) took 11% of a VAR-d16 image's GPU time on an
 * H200, in the VQVAE decoder's 640-wide attention. */
#define ATT_GEMM_THREADS 256
/* Scores held at once, in floats (64 MiB): query rows go in blocks that fit. */
#define ATT_GEMM_SCORES_MAX ((int64_t)1 << 24)

/* Each row of s [rows, cols] (row stride cols) replaced by its softmax; one
 * block per row, grid-stride. fmaxf skips NaN scores; a row of -inf (or NaN)
 * scores gives NaN, as the naive kernel's does. */
__global__ void softmax_rows_kernel(float *s, int64_t rows, int64_t cols) {
    __shared__ float red[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        float *row = s + r * cols;
        float m = -INFINITY;
        for (int64_t j = threadIdx.x; j < cols; j += blockDim.x)
            m = fmaxf(m, row[j]);
        m = mc_block_max(m, red);
        float l = 0.0f;
        for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
            const float p = expf(row[j] - m);
            row[j] = p;
            l += p;
        }
        const float inv = 1.0f / mc_block_sum(l, red);
        for (int64_t j = threadIdx.x; j < cols; j += blockDim.x)
            row[j] *= inv;
    }
}

static mc_status attention_gemm(mc_backend *be, int64_t batch, int64_t nq, int heads, int head_dim,
                                float scale, const float *q, int64_t ldq, int64_t q_bstride,
                                const att_segments &list, int64_t total_keys, float *out,
                                int64_t ldo, int64_t o_bstride, mc_err *err) {
    int64_t qblock = ATT_GEMM_SCORES_MAX / total_keys;
    if (qblock < 1)
        qblock = 1;
    if (qblock > nq)
        qblock = nq;
    float *scores = (float *)mc_cuda_scratch(be, MC_CUDA_SLOT_SCORES,
                                             (size_t)(qblock * total_keys) * sizeof(float),
                                             "attention's scores (head dims above 128)", err);
    if (scores == NULL)
        return err->status;
    cudaStream_t stream = cuda_st(be)->stream;
    for (int64_t b = 0; b < batch; b++)
        for (int h = 0; h < heads; h++)
            for (int64_t i0 = 0; i0 < nq; i0 += qblock) {
                const int64_t nb = nq - i0 < qblock ? nq - i0 : qblock;
                const float *qb = q + b * q_bstride + i0 * ldq + (int64_t)h * head_dim;
                float *ob = out + b * o_bstride + i0 * ldo + (int64_t)h * head_dim;
                /* The next block's scores are written after this block's
                 * last GEMM on the stream, so one score matrix serves all. */
                int64_t col = 0;
                for (int s = 0; s < list.count; s++) {
                    const float *kb = list.k[s] + b * list.bstride[s] + (int64_t)h * head_dim;
                    MC_TRY(mc_cuda_sgemm(be, 0, 1, nb, list.rows[s], head_dim, scale, qb, ldq, kb,
                                         list.ld[s], 0.0f, scores + col, total_keys, err));
                    col += list.rows[s];
                }
                softmax_rows_kernel<<<mc_cuda_blocks(nb, 1), ATT_GEMM_THREADS, 0, stream>>>(
                    scores, nb, total_keys);
                MC_CUDA_LAUNCHED("softmax_rows_kernel", err);
                col = 0;
                for (int s = 0; s < list.count; s++) {
                    const float *vb = list.v[s] + b * list.bstride[s] + (int64_t)h * head_dim;
                    MC_TRY(mc_cuda_sgemm(be, 0, 0, nb, head_dim, list.rows[s], 1.0f, scores + col,
                                         total_keys, vb, list.ld[s], s == 0 ? 0.0f : 1.0f, ob, ldo,
                                         err));
                    col += list.rows[s];
                }
            }
    return MC_OK;
}

mc_status mc_cuda_attention(mc_backend *be, int64_t batch, int64_t nq, int heads, int head_dim,
                            float scale, const float *q, int64_t ldq, int64_t q_bstride,
                            const mc_kv_segment *segs, int nsegs, float *out, int64_t ldo,
                            int64_t o_bstride, mc_err *err) {
    int64_t total_keys = 0;
    att_segments list;
    list.count = 0;
    for (int s = 0; s < nsegs; s++) {
        total_keys += segs[s].rows;
        if (segs[s].rows == 0)
            continue; /* empty segments cost nothing and take no slot */
        if (list.count == ATT_MAX_SEGS)
            return mc_fail(err, MC_ERR_VALUE,
                           "cuda attention: more than %d non-empty K/V segments", ATT_MAX_SEGS);
        list.k[list.count] = segs[s].k;
        list.v[list.count] = segs[s].v;
        list.rows[list.count] = segs[s].rows;
        list.ld[list.count] = segs[s].ld;
        list.bstride[list.count] = segs[s].batch_stride;
        list.count++;
    }
    if (nq == 0 || batch == 0)
        return MC_OK;
    if (total_keys == 0)
        return mc_fail(err, MC_ERR_INTERNAL, "attention: no keys to attend to");
    if (heads <= 0 || head_dim <= 0)
        return mc_fail(err, MC_ERR_INTERNAL, "attention: %d heads of dim %d", heads, head_dim);
    MC_TRY(mc_cuda_enter(be, err));
    cuda_state *st = cuda_st(be);

    if (mc_attention_is_16bit(be, head_dim)) {
        /* The reference kernel also where the device cannot give the
         * tensor-core kernel its shared memory (tc_smem_bytes): the same
         * rounding of q, k, v and p (ops.h), slower. */
        if (st->naive || tc_smem_bytes(head_dim) > st->smem_per_block_optin) {
            const int64_t items = batch * heads * nq;
            if (be->linear_wtype == MC_WTYPE_BF16)
                attention_naive_kernel<__nv_bfloat16>
                    <<<mc_cuda_blocks(items, 1), NAIVE_THREADS, 0, st->stream>>>(
                        batch, nq, heads, head_dim, scale, q, ldq, q_bstride, list, out, ldo,
                        o_bstride);
            else
                attention_naive_kernel<__half>
                    <<<mc_cuda_blocks(items, 1), NAIVE_THREADS, 0, st->stream>>>(
                        batch, nq, heads, head_dim, scale, q, ldq, q_bstride, list, out, ldo,
                        o_bstride);
            MC_CUDA_LAUNCHED("attention_naive_kernel (16-bit)", err);
            return MC_OK;
        }
        if (be->linear_wtype == MC_WTYPE_BF16)
            return attention_16bit<__nv_bfloat16>(batch, nq, heads, head_dim, scale, q, ldq,
                                                  q_bstride, list, out, ldo, o_bstride,
                                                  st->stream, err);
        return attention_16bit<__half>(batch, nq, heads, head_dim, scale, q, ldq, q_bstride, list,
                                       out, ldo, o_bstride, st->stream, err);
    }

    if (st->naive) {
        const int64_t items = batch * heads * nq;
        attention_naive_kernel<float><<<mc_cuda_blocks(items, 1), NAIVE_THREADS, 0, st->stream>>>(
            batch, nq, heads, head_dim, scale, q, ldq, q_bstride, list, out, ldo, o_bstride);
        MC_CUDA_LAUNCHED("attention_naive_kernel", err);
        return MC_OK;
    }
    if (head_dim > 32 * 4)
        return attention_gemm(be, batch, nq, heads, head_dim, scale, q, ldq, q_bstride, list,
                              total_keys, out, ldo, o_bstride, err);

    int64_t warps = (nq + ATT_ROWS - 1) / ATT_ROWS;
    if (warps > ATT_MAX_WARPS)
        warps = ATT_MAX_WARPS;
    const int64_t qtiles = (nq + warps * ATT_ROWS - 1) / (warps * ATT_ROWS);
    const int64_t blocks = batch * heads * qtiles;
    if (blocks > 0x7fffffffLL)
        return mc_fail(err, MC_ERR_VALUE, "cuda attention: %lld blocks exceed the grid limit",
                       (long long)blocks);
    const int w = (int)warps;
    if (head_dim == 64)
        launch_flash<2, 64>(w, blocks, nq, heads, head_dim, scale, q, ldq, q_bstride, list, out,
                            ldo, o_bstride, qtiles, st->stream);
    else if (head_dim == 80)
        launch_flash<3, 80>(w, blocks, nq, heads, head_dim, scale, q, ldq, q_bstride, list, out,
                            ldo, o_bstride, qtiles, st->stream);
    else if (head_dim <= 32)
        launch_flash<1, 0>(w, blocks, nq, heads, head_dim, scale, q, ldq, q_bstride, list, out,
                           ldo, o_bstride, qtiles, st->stream);
    else if (head_dim <= 64)
        launch_flash<2, 0>(w, blocks, nq, heads, head_dim, scale, q, ldq, q_bstride, list, out,
                           ldo, o_bstride, qtiles, st->stream);
    else if (head_dim <= 96)
        launch_flash<3, 0>(w, blocks, nq, heads, head_dim, scale, q, ldq, q_bstride, list, out,
                           ldo, o_bstride, qtiles, st->stream);
    else
        launch_flash<4, 0>(w, blocks, nq, heads, head_dim, scale, q, ldq, q_bstride, list, out,
                           ldo, o_bstride, qtiles, st->stream);
    MC_CUDA_LAUNCHED("flash_attention_kernel", err);
    return MC_OK;
}

/* ---- attention_mass -------------------------------------------------------- */

/* One warp per (item, head, query) row, grid-stride over rows: lanes take
 * keys j = lane, lane + 32, ...; pass 1 the max score, pass 2 the sum of
 * exp(s - max). Stored as (max, 1 / sum), the CPU's softmax (expf, then a
 * multiply by the reciprocal of the sum). */
__device__ __forceinline__ float dot_scaled(const float *a, const float *b, int D, float scale) {
    float acc = 0.0f;
    for (int d = 0; d < D; d++)
        acc += a[d] * b[d];
    return acc * scale;
}

__global__ void mass_stats_kernel(int64_t batch, int64_t nq, int heads, int D, float scale,
                                  const float *q, int64_t ldq, int64_t q_bstride, const float *k,
                                  int64_t ldk, int64_t k_bstride, int64_t keys, float2 *stats) {
    const int lane = threadIdx.x & 31;
    const int64_t rows = batch * heads * nq;
    const int64_t warps_per_block = blockDim.x >> 5;
    for (int64_t row = blockIdx.x * warps_per_block + (threadIdx.x >> 5); row < rows;
         row += (int64_t)gridDim.x * warps_per_block) {
        const int64_t i = row % nq, bh = row / nq;
        const int h = (int)(bh % heads);
        const int64_t b = bh / heads;
        const float *qrow = q + b * q_bstride + i * ldq + (int64_t)h * D;
        const float *kb = k + b * k_bstride + (int64_t)h * D;
        float m = -INFINITY;
        for (int64_t j = lane; j < keys; j += 32)
            m = fmaxf(m, dot_scaled(qrow, kb + j * ldk, D, scale));
        m = mc_warp_max(m);
        float l = 0.0f;
        for (int64_t j = lane; j < keys; j += 32)
            l += expf(dot_scaled(qrow, kb + j * ldk, D, scale) - m);
        l = mc_warp_sum(l);
        if (lane == 0)
            stats[row] = make_float2(m, 1.0f / l);
    }
}

/* One thread per (item b, key j): out[b, j] = sum over h, then i, of
 * exp(s - max) * (1 / sum), in that order (the CPU's accumulation order). */
__global__ void mass_sum_kernel(int64_t batch, int64_t nq, int heads, int D, float scale,
                                const float *q, int64_t ldq, int64_t q_bstride, const float *k,
                                int64_t ldk, int64_t k_bstride, int64_t keys, const float2 *stats,
                                float *out) {
    MC_GRID_STRIDE_LOOP(e, batch * keys) {
        const int64_t b = e / keys, j = e - b * keys;
        float acc = 0.0f;
        for (int h = 0; h < heads; h++) {
            const float *krow = k + b * k_bstride + j * ldk + (int64_t)h * D;
            for (int64_t i = 0; i < nq; i++) {
                const float2 st = stats[(b * heads + h) * nq + i];
                const float *qrow = q + b * q_bstride + i * ldq + (int64_t)h * D;
                acc += expf(dot_scaled(qrow, krow, D, scale) - st.x) * st.y;
            }
        }
        out[e] = acc;
    }
}

mc_status mc_cuda_attention_mass(mc_backend *be, int64_t batch, int64_t nq, int heads,
                                 int head_dim, float scale, const float *q, int64_t ldq,
                                 int64_t q_bstride, const float *k, int64_t ldk, int64_t k_bstride,
                                 int64_t keys, float *out, mc_err *err) {
    if (batch == 0 || keys == 0)
        return MC_OK;
    MC_TRY(mc_cuda_enter(be, err));
    cuda_state *st = cuda_st(be);
    const int64_t rows = batch * heads * nq;
    float2 *stats = NULL;
    if (rows > 0) {
        stats = (float2 *)mc_cuda_scratch(be, MC_CUDA_SLOT_STATS, (size_t)rows * sizeof(float2),
                                            "attention's per-row statistics", err);
        if (stats == NULL)
            return err->status;
        const int warps = 4;
        mass_stats_kernel<<<mc_cuda_blocks(rows, warps), 32 * warps, 0, st->stream>>>(
            batch, nq, heads, head_dim, scale, q, ldq, q_bstride, k, ldk, k_bstride, keys, stats);
        MC_CUDA_LAUNCHED("mass_stats_kernel", err);
    }
    mass_sum_kernel<<<mc_cuda_blocks(batch * keys, MC_CUDA_THREADS), MC_CUDA_THREADS, 0,
                      st->stream>>>(batch, nq, heads, head_dim, scale, q, ldq, q_bstride, k, ldk,
                                    k_bstride, keys, stats, out);
    MC_CUDA_LAUNCHED("mass_sum_kernel", err);
    return MC_OK;
}

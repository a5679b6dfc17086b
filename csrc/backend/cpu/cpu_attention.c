/* Multi-head attention over a list of K/V segments on the CPU.
 *
 * For one (batch item, head): the scores of every segment are written side by
 * side into one row buffer (S_s = scale * Q K_s^T, one GEMM per segment), the
 * softmax runs over the whole row (a single max and sum, which is exactly
 * the online-softmax merge of the segments; cpu_vmath.c), and O = sum_s P_s V_s
 * accumulates one GEMM per segment. No K/V bytes are copied.
 *
 * (batch, head) pairs are independent, so OpenMP splits them; the GEMMs
 * inside run serially (mc_cpu_sgemm does not nest parallel regions). */
#include <math.h>
#include <omp.h>

#include "cpu_internal.h"

/* dst[r, :cols] = 16-bit rounding of src[r, :cols] (row strides lds, ldd). */
static void round_rows(mc_wtype t, const float *src, int64_t lds, int64_t rows, int64_t cols, float *dst,
                       int64_t ldd) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            dst[r * ldd + c] = mc_wtype_round(t, src[r * lds + c]);
}

/* The 16-bit form of attention for one (item, head) (ops.h): rounded copies
 * of q and of every segment's k and v side by side, one score GEMM, the
 * float32 softmax, probabilities rounded, one P V GEMM. An emulation of the
 * CUDA tensor-core kernel's arithmetic (up to its summation order and its
 * tile-wise running max), so that CPU and GPU runs of a 16-bit model agree. */
static void attention_pair_16bit(mc_cpu_isa isa, mc_wtype t, int64_t nq, int head_dim, float scale, const float *qb,
                                 int64_t ldq, const mc_kv_segment *segs, int nsegs, int64_t b, int h,
                                 int64_t total_keys, float *s, float *ob, int64_t ldo) {
    float *qr = s + nq * total_keys, *kr = qr + nq * head_dim, *vr = kr + total_keys * head_dim;
    round_rows(t, qb, ldq, nq, head_dim, qr, head_dim);
    int64_t row = 0;
    for (int g = 0; g < nsegs; g++) {
        const int64_t off = b * segs[g].batch_stride + (int64_t)h * head_dim;
        round_rows(t, segs[g].k + off, segs[g].ld, segs[g].rows, head_dim, kr + row * head_dim, head_dim);
        round_rows(t, segs[g].v + off, segs[g].ld, segs[g].rows, head_dim, vr + row * head_dim, head_dim);
        row += segs[g].rows;
    }
    mc_cpu_sgemm(1, MC_CPU_GEMM_SPLIT_AUTO,
                 0, 1, nq, total_keys, head_dim, scale, qr, head_dim, kr, head_dim, 0.0f, s, total_keys);
    mc_cpu_softmax_rows(isa, s, nq, total_keys, total_keys);
    round_rows(t, s, total_keys, nq, total_keys, s, total_keys);
    mc_cpu_sgemm(1, MC_CPU_GEMM_SPLIT_AUTO,
                 0, 0, nq, head_dim, total_keys, 1.0f, s, total_keys, vr, head_dim, 0.0f, ob, ldo);
}

mc_status mc_cpu_attention(mc_backend *be, int64_t batch, int64_t nq, int heads, int head_dim,
                           float scale, const float *q, int64_t ldq, int64_t q_bstride,
                           const mc_kv_segment *segs, int nsegs, float *out, int64_t ldo,
                           int64_t o_bstride, mc_err *err) {
    int64_t total_keys = 0;
    for (int s = 0; s < nsegs; s++)
        total_keys += segs[s].rows;
    if (nq == 0 || batch == 0)
        return MC_OK;
    if (total_keys == 0)
        return mc_fail(err, MC_ERR_INTERNAL, "attention: no keys to attend to");

    int threads = mc_cpu_threads(be);
    int64_t pairs = batch * heads;
    if (threads > pairs)
        threads = (int)pairs;
    float *scores[64];
    if (threads > 64)
        threads = 64;
    const int rounded = mc_attention_is_16bit(be, head_dim);
    const mc_cpu_isa isa = mc_cpu_isa_of(be);
    const size_t per_thread =
        (size_t)(nq * total_keys) + (rounded ? (size_t)((nq + 2 * total_keys) * head_dim) : 0);
    for (int t = 0; t < threads; t++) {
        scores[t] = mc_cpu_scratch(be, t, per_thread, "a thread's attention scores", err);
        if (scores[t] == NULL)
            return err->status;
    }

#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t pair = 0; pair < pairs; pair++) {
        int64_t b = pair / heads, h = pair % heads;
        float *s = scores[omp_get_thread_num()];
        const float *qb = q + b * q_bstride + h * head_dim;
        float *ob = out + b * o_bstride + h * head_dim;
        if (rounded) {
            attention_pair_16bit(isa, be->linear_wtype, nq, head_dim, scale, qb, ldq, segs, nsegs, b, (int)h,
                                 total_keys, s, ob, ldo);
            continue;
        }
        int64_t col = 0;
        for (int g = 0; g < nsegs; g++) {
            if (segs[g].rows == 0)
                continue;
            const float *kb = segs[g].k + b * segs[g].batch_stride + h * head_dim;
            mc_cpu_sgemm(1, MC_CPU_GEMM_SPLIT_AUTO,
                         0, 1, nq, segs[g].rows, head_dim, scale, qb, ldq, kb, segs[g].ld, 0.0f,
                         s + col, total_keys);
            col += segs[g].rows;
        }
        mc_cpu_softmax_rows(isa, s, nq, total_keys, total_keys);
        col = 0;
        int first = 1;
        for (int g = 0; g < nsegs; g++) {
            if (segs[g].rows == 0)
                continue;
            const float *vb = segs[g].v + b * segs[g].batch_stride + h * head_dim;
            mc_cpu_sgemm(1, MC_CPU_GEMM_SPLIT_AUTO, 0, 0, nq, head_dim, segs[g].rows, 1.0f, s + col, total_keys, vb,
                         segs[g].ld, first ? 0.0f : 1.0f, ob, ldo);
            col += segs[g].rows;
            first = 0;
        }
    }
    return MC_OK;
}

mc_status mc_cpu_attention_mass(mc_backend *be, int64_t batch, int64_t nq, int heads, int head_dim,
                                float scale, const float *q, int64_t ldq, int64_t q_bstride,
                                const float *k, int64_t ldk, int64_t k_bstride, int64_t keys,
                                float *out, mc_err *err) {
    if (batch == 0 || keys == 0)
        return MC_OK;
    int threads = mc_cpu_threads(be);
    if (threads > batch)
        threads = (int)batch;
    if (threads > 64)
        threads = 64;
    float *scores[64];
    const mc_cpu_isa isa = mc_cpu_isa_of(be);
    for (int t = 0; t < threads; t++) {
        scores[t] = mc_cpu_scratch(be, t, (size_t)(nq * keys + 1), "a thread's attention_mass scores", err);
        if (scores[t] == NULL)
            return err->status;
    }
    /* One batch item per task so each output row has a single writer, and
     * the sum over heads and queries runs in a fixed order (deterministic). */
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t b = 0; b < batch; b++) {
        float *s = scores[omp_get_thread_num()];
        float *ob = out + b * keys;
        for (int64_t j = 0; j < keys; j++)
            ob[j] = 0.0f;
        for (int h = 0; h < heads; h++) {
            if (nq == 0)
                break;
            mc_cpu_sgemm(1, MC_CPU_GEMM_SPLIT_AUTO,
                         0, 1, nq, keys, head_dim, scale, q + b * q_bstride + (int64_t)h * head_dim, ldq,
                         k + b * k_bstride + (int64_t)h * head_dim, ldk, 0.0f, s, keys);
            mc_cpu_softmax_rows(isa, s, nq, keys, keys);
            for (int64_t i = 0; i < nq; i++)
                for (int64_t j = 0; j < keys; j++)
                    ob[j] += s[i * keys + j];
        }
    }
    return MC_OK;
}

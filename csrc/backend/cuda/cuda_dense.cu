/* Row-wise ops of the CUDA backend: layernorm (+adaLN), add_rows,
 * gated_add, gather/scatter, cfg_combine, ddpm_step, token_normals, axpby,
 * cosine_rows. Each mirrors the CPU loop of cpu_dense.c element for
 * element; where the CPU reduces in double (layernorm, cosine_rows), so
 * does the GPU. Elementwise kernels use one thread per element and a
 * 64-bit grid-stride loop over the flattened [rows, cols] index. */
#include <math.h>

#include "../../core/philox_inline.h"
#include "../sampling_inline.h"
#include "cuda_internal.h"

/* ---- layernorm ----------------------------------------------------------- */

/* One block per row (grid-stride over rows). Two-pass statistics in double
 * (the contract of ops.h: mean, then the centred sum of squares), reduced
 * over the block in a fixed order; then each thread normalises the elements
 * it read. y may be x: every element is read in the statistics passes,
 * which end with a barrier (mc_block_sum), before any is written. */
#define LN_THREADS 256

__global__ void layernorm_kernel(const float *x, int64_t ldx, int64_t rows, int64_t dim,
                                 const float *w, const float *b, float eps, const float *shift,
                                 const float *scale, int64_t ld_mod, int64_t mod_period, float *y,
                                 int64_t ldy) {
    __shared__ double red[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *xr = x + r * ldx;
        float *yr = y + r * ldy;
        const int64_t mod = (r / mod_period) * ld_mod; /* the row's adaLN row (ops_list.h) */
        double sum = 0.0;
        for (int64_t i = threadIdx.x; i < dim; i += blockDim.x)
            sum += (double)xr[i];
        const double mean = mc_block_sum(sum, red) / (double)dim;
        double sq = 0.0;
        for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
            double d = (double)xr[i] - mean;
            sq += d * d;
        }
        const double inv = 1.0 / sqrt(mc_block_sum(sq, red) / (double)dim + (double)eps);
        for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
            float v = (float)(((double)xr[i] - mean) * inv);
            if (w != NULL)
                v = v * w[i] + (b != NULL ? b[i] : 0.0f);
            if (scale != NULL)
                v = v * (1.0f + scale[mod + i]) + shift[mod + i];
            yr[i] = v;
        }
    }
}

mc_status mc_cuda_layernorm(mc_backend *be, const float *x, int64_t ldx, int64_t rows, int64_t dim,
                            const float *w, const float *b, float eps, const float *shift,
                            const float *scale, int64_t ld_mod, int64_t mod_period, float *y, int64_t ldy,
                            mc_err *err) {
    if ((shift == NULL) != (scale == NULL))
        return mc_fail(err, MC_ERR_INTERNAL, "layernorm: shift and scale go together");
    if (mod_period < 1)
        return mc_fail(err, MC_ERR_INTERNAL, "layernorm: mod_period %lld is not positive", (long long)mod_period);
    if (rows <= 0 || dim <= 0)
        return MC_OK;
    MC_TRY(mc_cuda_enter(be, err));
    /* Short rows (the head's 1024-wide and smaller) waste most of 256
     * threads; 64 threads still cover them in a few strides. */
    int threads = dim <= 256 ? 64 : LN_THREADS;
    layernorm_kernel<<<mc_cuda_blocks(rows, 1), threads, 0, cuda_st(be)->stream>>>(
        x, ldx, rows, dim, w, b, eps, shift, scale, ld_mod, mod_period, y, ldy);
    MC_CUDA_LAUNCHED("layernorm_kernel", err);
    return MC_OK;
}

/* ---- elementwise row ops ----------------------------------------------- */

__global__ void add_rows_kernel(float *y, int64_t ldy, int64_t rows, int64_t dim, const float *v,
                                int64_t ldv, int64_t period) {
    MC_GRID_STRIDE_LOOP(i, rows * dim) {
        int64_t r = i / dim, c = i - r * dim;
        y[r * ldy + c] += v[(r % period) * ldv + c];
    }
}

mc_status mc_cuda_add_rows(mc_backend *be, float *y, int64_t ldy, int64_t rows, int64_t dim,
                           const float *v, int64_t ldv, int64_t period, mc_err *err) {
    if (period <= 0)
        return mc_fail(err, MC_ERR_INTERNAL, "add_rows: period must be positive");
    if (rows <= 0 || dim <= 0)
        return MC_OK;
    MC_TRY(mc_cuda_enter(be, err));
    add_rows_kernel<<<mc_cuda_blocks(rows * dim, MC_CUDA_THREADS), MC_CUDA_THREADS, 0,
                      cuda_st(be)->stream>>>(y, ldy, rows, dim, v, ldv, period);
    MC_CUDA_LAUNCHED("add_rows_kernel", err);
    return MC_OK;
}

__global__ void gated_add_kernel(float *y, int64_t ldy, const float *u, int64_t ldu,
                                 const float *gate, int64_t ldg, int64_t gate_period, int64_t rows,
                                 int64_t dim) {
    MC_GRID_STRIDE_LOOP(i, rows * dim) {
        int64_t r = i / dim, c = i - r * dim;
        y[r * ldy + c] += gate[(r / gate_period) * ldg + c] * u[r * ldu + c];
    }
}

mc_status mc_cuda_gated_add(mc_backend *be, float *y, int64_t ldy, const float *u, int64_t ldu,
                            const float *gate, int64_t ldg, int64_t gate_period, int64_t rows, int64_t dim,
                            mc_err *err) {
    if (gate_period < 1)
        return mc_fail(err, MC_ERR_INTERNAL, "gated_add: gate_period %lld is not positive", (long long)gate_period);
    if (rows <= 0 || dim <= 0)
        return MC_OK;
    MC_TRY(mc_cuda_enter(be, err));
    gated_add_kernel<<<mc_cuda_blocks(rows * dim, MC_CUDA_THREADS), MC_CUDA_THREADS, 0,
                       cuda_st(be)->stream>>>(y, ldy, u, ldu, gate, ldg, gate_period, rows, dim);
    MC_CUDA_LAUNCHED("gated_add_kernel", err);
    return MC_OK;
}

/* dst[dst_row(r), :] = src[src_row(r), :]: gather reads through idx, scatter
 * writes through it (indices are distinct for scatter, so no two threads
 * write one element). */
__global__ void move_rows_kernel(const float *src, int64_t lds, const int32_t *idx, int64_t rows,
                                 int64_t dim, float *dst, int64_t ldd, int scatter) {
    MC_GRID_STRIDE_LOOP(i, rows * dim) {
        int64_t r = i / dim, c = i - r * dim;
        int64_t other = (int64_t)idx[r];
        if (scatter)
            dst[other * ldd + c] = src[r * lds + c];
        else
            dst[r * ldd + c] = src[other * lds + c];
    }
}

static mc_status move_rows(mc_backend *be, const float *src, int64_t lds, const int32_t *idx,
                           int64_t rows, int64_t dim, float *dst, int64_t ldd, int scatter,
                           mc_err *err) {
    if (rows <= 0 || dim <= 0)
        return MC_OK;
    MC_TRY(mc_cuda_enter(be, err));
    move_rows_kernel<<<mc_cuda_blocks(rows * dim, MC_CUDA_THREADS), MC_CUDA_THREADS, 0,
                       cuda_st(be)->stream>>>(src, lds, idx, rows, dim, dst, ldd, scatter);
    MC_CUDA_LAUNCHED("move_rows_kernel", err);
    return MC_OK;
}

mc_status mc_cuda_gather_rows(mc_backend *be, const float *src, int64_t lds, const int32_t *idx,
                              int64_t rows, int64_t dim, float *dst, int64_t ldd, mc_err *err) {
    return move_rows(be, src, lds, idx, rows, dim, dst, ldd, 0, err);
}

mc_status mc_cuda_scatter_rows(mc_backend *be, const float *src, int64_t lds, const int32_t *idx,
                               int64_t rows, int64_t dim, float *dst, int64_t ldd, mc_err *err) {
    return move_rows(be, src, lds, idx, rows, dim, dst, ldd, 1, err);
}

__global__ void cfg_combine_kernel(const float *cond, int64_t ldc, const float *uncond,
                                   int64_t ldu, int64_t rows, int channels, float scale,
                                   float *out, int64_t ldo) {
    MC_GRID_STRIDE_LOOP(i, rows * channels) {
        int64_t r = i / channels, c = i - r * channels;
        float u = uncond[r * ldu + c];
        out[r * ldo + c] = u + scale * (cond[r * ldc + c] - u);
    }
}

mc_status mc_cuda_cfg_combine(mc_backend *be, const float *cond, int64_t ldc, const float *uncond,
                              int64_t ldu, int64_t rows, int channels, float scale, float *out,
                              int64_t ldo, mc_err *err) {
    if (rows <= 0 || channels <= 0)
        return MC_OK;
    MC_TRY(mc_cuda_enter(be, err));
    cfg_combine_kernel<<<mc_cuda_blocks(rows * channels, MC_CUDA_THREADS), MC_CUDA_THREADS, 0,
                         cuda_st(be)->stream>>>(cond, ldc, uncond, ldu, rows, channels, scale, out,
                                                ldo);
    MC_CUDA_LAUNCHED("cfg_combine_kernel", err);
    return MC_OK;
}

/* The coefficients travel by value (a kernel argument), not as a pointer to
 * host memory. */
__global__ void ddpm_step_kernel(float *x, int64_t rows, int channels, const float *eps,
                                 int64_t ld_eps, const float *v, int64_t ld_v, const float *noise,
                                 mc_ddpm_coefs k) {
    MC_GRID_STRIDE_LOOP(i, rows * channels) {
        int64_t r = i / channels, c = i - r * channels;
        float xt = x[i];
        float e = eps[r * ld_eps + c];
        float x0 = k.sqrt_recip_alphas_cumprod * xt - k.sqrt_recipm1_alphas_cumprod * e;
        float mean = k.posterior_mean_coef1 * x0 + k.posterior_mean_coef2 * xt;
        float frac = (v[r * ld_v + c] + 1.0f) * 0.5f;
        float log_var = frac * k.log_beta + (1.0f - frac) * k.posterior_log_variance;
        float next = mean;
        if (k.noise_scale != 0.0f)
            next += expf(0.5f * log_var) * noise[i] * k.noise_scale;
        x[i] = next;
    }
}

mc_status mc_cuda_ddpm_step(mc_backend *be, float *x, int64_t rows, int channels, const float *eps,
                            int64_t ld_eps, const float *v, int64_t ld_v, const float *noise,
                            const mc_ddpm_coefs *coefs, mc_err *err) {
    if (noise == NULL && coefs->noise_scale != 0.0f)
        return mc_fail(err, MC_ERR_INTERNAL, "ddpm_step: noise missing");
    if (rows <= 0 || channels <= 0)
        return MC_OK;
    MC_TRY(mc_cuda_enter(be, err));
    ddpm_step_kernel<<<mc_cuda_blocks(rows * channels, MC_CUDA_THREADS), MC_CUDA_THREADS, 0,
                       cuda_st(be)->stream>>>(x, rows, channels, eps, ld_eps, v, ld_v, noise,
                                              *coefs);
    MC_CUDA_LAUNCHED("ddpm_step_kernel", err);
    return MC_OK;
}

/* ---- token_normals ------------------------------------------------------- */

/* One thread per (row, block of 4 channels): one Philox block gives four
 * words, Box-Muller turns them into four normals (philox_inline.h, the same
 * source the CPU runs). */
__global__ void token_normals_kernel(uint64_t seed, uint32_t stream, uint32_t step,
                                     const uint32_t *image, const uint32_t *position,
                                     int64_t rows, int channels, float *out) {
    const int blocks = (channels + 3) / 4;
    MC_GRID_STRIDE_LOOP(i, rows * blocks) {
        int64_t r = i / blocks;
        int block = (int)(i - r * blocks);
        uint32_t w[4];
        float z[4];
        mc_philox_block_inline(seed, image[r], stream, position[r], step, (uint32_t)block, w);
        mc_box_muller_inline(w[0], w[1], &z[0], &z[1]);
        mc_box_muller_inline(w[2], w[3], &z[2], &z[3]);
        float *o = out + r * channels;
        for (int j = 0; j < 4 && block * 4 + j < channels; j++)
            o[block * 4 + j] = z[j];
    }
}

mc_status mc_cuda_token_normals(mc_backend *be, uint64_t seed, uint32_t stream, uint32_t step,
                                const uint32_t *image, const uint32_t *position, int64_t rows,
                                int channels, float *out, mc_err *err) {
    if (channels > 64)
        return mc_fail(err, MC_ERR_INTERNAL, "token_normals: at most 64 channels");
    if (rows <= 0 || channels <= 0)
        return MC_OK;
    MC_TRY(mc_cuda_enter(be, err));
    const int64_t threads = rows * ((channels + 3) / 4);
    token_normals_kernel<<<mc_cuda_blocks(threads, MC_CUDA_THREADS), MC_CUDA_THREADS, 0,
                           cuda_st(be)->stream>>>(seed, stream, step, image, position, rows,
                                                  channels, out);
    MC_CUDA_LAUNCHED("token_normals_kernel", err);
    return MC_OK;
}

/* ---- axpby --------------------------------------------------------------- */

/* b == 0 is a separate branch that never loads y: y may hold NaN (the
 * contract of ops.h: copies and scaled copies into garbage). */
__global__ void axpby_kernel(float a, const float *x, int64_t ldx, float b, float *y, int64_t ldy,
                             int64_t rows, int64_t cols) {
    MC_GRID_STRIDE_LOOP(i, rows * cols) {
        int64_t r = i / cols, c = i - r * cols;
        float xv = x[r * ldx + c];
        float *py = y + r * ldy + c;
        if (b == 0.0f)
            *py = a * xv;
        else
            *py = a * xv + b * *py;
    }
}

mc_status mc_cuda_axpby(mc_backend *be, float a, const float *x, int64_t ldx, float b, float *y,
                        int64_t ldy, int64_t rows, int64_t cols, mc_err *err) {
    if (rows <= 0 || cols <= 0)
        return MC_OK;
    MC_TRY(mc_cuda_enter(be, err));
    axpby_kernel<<<mc_cuda_blocks(rows * cols, MC_CUDA_THREADS), MC_CUDA_THREADS, 0,
                   cuda_st(be)->stream>>>(a, x, ldx, b, y, ldy, rows, cols);
    MC_CUDA_LAUNCHED("axpby_kernel", err);
    return MC_OK;
}

/* ---- cosine_rows --------------------------------------------------------- */

/* One block of COS_WARPS warps per row (grid-stride over rows). Warp w
 * takes heads w, w + COS_WARPS, ...; for each, its lanes reduce dot and the
 * two squared norms in double (as the CPU) and lane 0 adds the head's cosine
 * to the warp's total. The warp totals are added in warp order by thread 0:
 * a fixed order, so the result is reproducible. */
#define COS_WARPS 4

__global__ void cosine_rows_kernel(const float *a, int64_t lda, const float *b, int64_t ldb,
                                   int64_t rows, int heads, int head_dim, float *out) {
    __shared__ double totals[COS_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        double total = 0.0;
        for (int h = warp; h < heads; h += COS_WARPS) {
            const float *ar = a + r * lda + (int64_t)h * head_dim;
            const float *br = b + r * ldb + (int64_t)h * head_dim;
            double dot = 0.0, na = 0.0, nb = 0.0;
            for (int i = lane; i < head_dim; i += 32) {
                double av = ar[i], bv = br[i];
                dot += av * bv;
                na += av * av;
                nb += bv * bv;
            }
            dot = mc_warp_sum(dot);
            na = mc_warp_sum(na);
            nb = mc_warp_sum(nb);
            double denom = sqrt(na) * sqrt(nb);
            total += dot / (denom > 1e-8 ? denom : 1e-8);
        }
        if (lane == 0)
            totals[warp] = total;
        __syncthreads();
        if (threadIdx.x == 0) {
            double sum = 0.0;
            for (int w = 0; w < COS_WARPS; w++)
                sum += totals[w];
            out[r] = (float)(sum / heads);
        }
        __syncthreads(); /* totals is rewritten for the next row */
    }
}

mc_status mc_cuda_cosine_rows(mc_backend *be, const float *a, int64_t lda, const float *b,
                              int64_t ldb, int64_t rows, int heads, int head_dim, float *out,
                              mc_err *err) {
    if (rows <= 0)
        return MC_OK;
    if (heads <= 0)
        return mc_fail(err, MC_ERR_INTERNAL, "cosine_rows: heads must be positive");
    MC_TRY(mc_cuda_enter(be, err));
    cosine_rows_kernel<<<mc_cuda_blocks(rows, 1), 32 * COS_WARPS, 0, cuda_st(be)->stream>>>(
        a, lda, b, ldb, rows, heads, head_dim, out);
    MC_CUDA_LAUNCHED("cosine_rows_kernel", err);
    return MC_OK;
}

/* ---- head_l2norm --------------------------------------------------------- */

/* One warp per (row, head) slice, HL2_WARPS slices per block (grid-stride).
 * The lanes reduce the squared norm in double (as the CPU), then each lane
 * rescales the elements it read: v / max(||v||, 1e-12) * scale, in double,
 * rounded once. */
#define HL2_WARPS 4

__global__ void head_l2norm_kernel(float *x, int64_t ld, int64_t rows, int heads, int head_dim,
                                   const float *head_scale) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t slices = rows * heads;
    for (int64_t s = (int64_t)blockIdx.x * HL2_WARPS + warp; s < slices;
         s += (int64_t)gridDim.x * HL2_WARPS) {
        const int64_t r = s / heads;
        const int h = (int)(s - r * heads);
        float *v = x + r * ld + (int64_t)h * head_dim;
        double sq = 0.0;
        for (int i = lane; i < head_dim; i += 32) {
            const double e = v[i];
            sq += e * e;
        }
        sq = mc_warp_sum(sq);
        const double norm = sqrt(sq);
        const double denom = norm > 1e-12 ? norm : 1e-12;
        const double scale = head_scale != NULL ? (double)head_scale[h] : 1.0;
        for (int i = lane; i < head_dim; i += 32)
            v[i] = (float)((double)v[i] / denom * scale);
    }
}

mc_status mc_cuda_head_l2norm(mc_backend *be, float *x, int64_t ld, int64_t rows, int heads,
                              int head_dim, const float *head_scale, mc_err *err) {
    if (heads <= 0 || head_dim <= 0)
        return mc_fail(err, MC_ERR_INTERNAL, "head_l2norm: %d heads of %d channels", heads, head_dim);
    if (rows <= 0)
        return MC_OK;
    MC_TRY(mc_cuda_enter(be, err));
    head_l2norm_kernel<<<mc_cuda_blocks(rows * heads, HL2_WARPS), 32 * HL2_WARPS, 0,
                         cuda_st(be)->stream>>>(x, ld, rows, heads, head_dim, head_scale);
    MC_CUDA_LAUNCHED("head_l2norm_kernel", err);
    return MC_OK;
}

/* ---- pivotal_rows (FastVAR) ----------------------------------------------- */

/* Four passes over scratch: the mean token (one thread per sequence and
 * channel, rows summed in order), the scores (one thread per row, channels
 * in order, products and sums rounded separately: the CPU's arithmetic, so
 * equal inputs give equal scores and the same selection), the kept flags
 * (one thread per row counts the rows before it in mc_pivotal_before's
 * order) and the compaction (each kept row counts the kept rows of lower
 * index). The last two are O(rows^2) per sequence: a few hundred to a few
 * thousand rows per scale, no sort needed. */
__global__ void pivotal_mean_kernel(const float *x, int64_t ldx, int64_t batch, int64_t rows, int64_t dim,
                                    double *mean) {
    MC_GRID_STRIDE_LOOP(i, batch * dim) {
        const int64_t b = i / dim, c = i % dim;
        const float *xc = x + b * rows * ldx + c;
        double sum = 0.0;
        for (int64_t r = 0; r < rows; r++)
            sum = __dadd_rn(sum, (double)xc[r * ldx]);
        mean[i] = sum / (double)rows;
    }
}

__global__ void pivotal_score_kernel(const float *x, int64_t ldx, int64_t batch, int64_t rows, int64_t dim,
                                     const double *mean, double *score) {
    MC_GRID_STRIDE_LOOP(i, batch * rows) {
        const float *xr = x + i * ldx;
        const double *m = mean + (i / rows) * dim;
        double sum = 0.0;
        for (int64_t c = 0; c < dim; c++) {
            const double d = __dsub_rn((double)xr[c], m[c]);
            sum = __dadd_rn(sum, __dmul_rn(d, d));
        }
        score[i] = sum;
    }
}

__global__ void pivotal_keep_kernel(const double *score, int64_t batch, int64_t rows, int64_t keep,
                                    unsigned char *kept) {
    MC_GRID_STRIDE_LOOP(i, batch * rows) {
        const int64_t r = i % rows;
        const double *sb = score + (i - r);
        int64_t before = 0;
        for (int64_t s = 0; s < rows && before < keep; s++)
            before += mc_pivotal_before(sb[s], s, sb[r], r);
        kept[i] = before < keep;
    }
}

__global__ void pivotal_compact_kernel(const unsigned char *kept, int64_t batch, int64_t rows, int64_t keep,
                                       int32_t *out) {
    MC_GRID_STRIDE_LOOP(i, batch * rows) {
        if (!kept[i])
            continue;
        const int64_t r = i % rows, b = i / rows;
        int64_t n = 0;
        for (int64_t s = i - r; s < i; s++)
            n += kept[s];
        if (n < keep) /* always (exactly keep rows are kept); guards the write */
            out[b * keep + n] = (int32_t)i;
    }
}

mc_status mc_cuda_pivotal_rows(mc_backend *be, const float *x, int64_t ldx, int64_t batch, int64_t rows,
                               int64_t dim, int64_t keep, int32_t *out, mc_err *err) {
    MC_TRY(mc_check_pivotal_rows(ldx, batch, rows, dim, keep, err));
    if (batch == 0 || keep == 0)
        return MC_OK;
    MC_TRY(mc_cuda_enter(be, err));
    /* scratch: mean [batch, dim] and score [batch * rows] doubles, then the flags */
    const size_t mean_bytes = (size_t)(batch * dim) * sizeof(double);
    const size_t score_bytes = (size_t)(batch * rows) * sizeof(double);
    char *scratch = (char *)mc_cuda_scratch(be, MC_CUDA_SLOT_STATS, mean_bytes + score_bytes + (size_t)(batch * rows),
                                            "pivotal_rows' means, scores and flags", err);
    if (scratch == NULL)
        return err->status;
    double *mean = (double *)scratch, *score = (double *)(scratch + mean_bytes);
    unsigned char *kept = (unsigned char *)(scratch + mean_bytes + score_bytes);
    cudaStream_t stream = cuda_st(be)->stream;
    if (dim > 0) {
        pivotal_mean_kernel<<<mc_cuda_blocks(batch * dim, MC_CUDA_THREADS), MC_CUDA_THREADS, 0, stream>>>(
            x, ldx, batch, rows, dim, mean);
        MC_CUDA_LAUNCHED("pivotal_mean_kernel", err);
    }
    const unsigned blocks = mc_cuda_blocks(batch * rows, MC_CUDA_THREADS);
    pivotal_score_kernel<<<blocks, MC_CUDA_THREADS, 0, stream>>>(x, ldx, batch, rows, dim, mean, score);
    MC_CUDA_LAUNCHED("pivotal_score_kernel", err);
    pivotal_keep_kernel<<<blocks, MC_CUDA_THREADS, 0, stream>>>(score, batch, rows, keep, kept);
    MC_CUDA_LAUNCHED("pivotal_keep_kernel", err);
    pivotal_compact_kernel<<<blocks, MC_CUDA_THREADS, 0, stream>>>(kept, batch, rows, keep, out);
    MC_CUDA_LAUNCHED("pivotal_compact_kernel", err);
    return MC_OK;
}

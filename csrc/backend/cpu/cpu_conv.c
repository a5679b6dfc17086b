/* Convolution-side CPU ops for the VAE decoder: GroupNorm, 2-D convolution
 * (NHWC, stride 1, "same" zero padding) and nearest-neighbour x2 upsampling.
 *
 * conv2d lowers to GEMM. A 1x1 convolution over NHWC is exactly one GEMM
 * [pixels, cin] x [cout, cin]^T. A kxk convolution first gathers, for a
 * chunk of output rows, every pixel's k*k*cin receptive field into one row
 * of a column matrix (im2col), ordered (ky, kx, ci) to match the packed
 * weights [cout, k, k, cin], and then runs one GEMM [chunk pixels, k*k*cin] x
 * [cout, k*k*cin]^T. Chunks are bounded in bytes so the column matrix stays
 * cache/memory friendly instead of being k*k times the whole input.
 *
 * mc_cpu_conv2d_naive keeps the plain seven-loop definition as the
 * reference the fast path is tested against. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cpu_internal.h"
#include "../op_checks.h"

/* Below this many elements an op runs on one thread: waking the team costs
 * more than the work (same threshold as cpu_dense.c). */
#define MC_CONV_PARALLEL_MIN_ELEMS 32768

/* Upper bound on one im2col chunk, in floats (4 MiB). Big enough that the
 * GEMM has a few hundred rows to amortise packing of the weights, small
 * enough that the column matrix of each thread fits in L3. At least one
 * output row is always taken, whatever its size. Measured on the VAE's conv
 * shapes, single thread: 0.5 to 8 MiB all within 5%; 16 MiB 10% slower. */
#define MC_CONV_CHUNK_FLOATS ((size_t)1 << 20)

/* Pixels per partial-sum block in groupnorm. The block partition is fixed
 * (not derived from the thread count), so the statistics are bit-identical
 * for any number of threads. */
#define MC_GN_BLOCK_PIXELS 1024

/* Scratch slots: im2col uses 0..threads-1 (like attention). Groupnorm's
 * partial sums use a slot of its own so the two never alias, even though no
 * op keeps scratch across calls. */
#define MC_GN_SCRATCH_SLOT 63

/* OpenBLAS takes 32-bit dimensions in this build; keep every GEMM below. */
#define MC_BLAS_DIM_MAX ((int64_t)1 << 30)

/* ---------------------------------------------------------------- groupnorm */

/* e^x written so GCC vectorises it: libm's expf is a scalar call, and it
 * took 3/4 of groupnorm + swish time over a 256x256x128 activation. Cephes
 * expf: Cody-Waite reduction by ln 2 and a degree-5 polynomial, relative
 * error ~1e-7 on the clamped range [-87, 88] (beyond it swish is x or 0 to
 * float precision anyway). NaN propagates through the caller's x * ... . */
static inline float exp_vectorizable(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    /* n = round(x / ln 2) by the 1.5 * 2^23 trick: floorf/rintf would be
     * library calls here (ISO C keeps trapping math), this is two adds. */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23; /* 2^n, n in [-126, 127] */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

static inline float swish_vectorizable(float x) { return x / (1.0f + exp_vectorizable(-x)); }

/* GroupNorm's per-block channel sums over blocks of MC_GN_BLOCK_PIXELS
 * pixels: of x (center NULL) or of (x - center)^2, in double, into
 * partial[blk * channels + c]. Block by block and channel by channel, so the
 * inner loop is contiguous in NHWC and the sums do not depend on the thread
 * count. */
static void gn_block_sums(const float *xi, int64_t hw, int64_t channels, int64_t nblocks, const double *center,
                          double *partial, int threads, int parallel) {
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
    for (int64_t blk = 0; blk < nblocks; blk++) {
        double *acc = partial + blk * channels;
        for (int64_t c = 0; c < channels; c++)
            acc[c] = 0.0;
        int64_t p_end = (blk + 1) * MC_GN_BLOCK_PIXELS < hw ? (blk + 1) * MC_GN_BLOCK_PIXELS : hw;
        for (int64_t p = blk * MC_GN_BLOCK_PIXELS; p < p_end; p++) {
            const float *px = xi + p * channels;
            if (center == NULL) {
                for (int64_t c = 0; c < channels; c++)
                    acc[c] += px[c];
            } else {
                for (int64_t c = 0; c < channels; c++) {
                    double d = (double)px[c] - center[c];
                    acc[c] += d * d;
                }
            }
        }
    }
}

/* The sum of gn_block_sums' partial sums over the blocks and the group's
 * channels first..first+count-1 (blocks outer, as the passes always summed). */
static double gn_group_sum(const double *partial, int64_t nblocks, int64_t channels, int64_t first, int64_t count) {
    double s = 0.0;
    for (int64_t blk = 0; blk < nblocks; blk++)
        for (int64_t c = first; c < first + count; c++)
            s += partial[blk * channels + c];
    return s;
}

mc_status mc_cpu_groupnorm(mc_backend *be, const float *x, int64_t batch, int64_t hw,
                           int64_t channels, int groups, const float *w, const float *b, float eps,
                           int swish, float *y, mc_err *err) {
    MC_TRY(mc_check_groups(channels, groups, err));
    if (batch <= 0 || hw <= 0)
        return MC_OK;
    const int64_t per_group = channels / groups;
    const int64_t nblocks = (hw + MC_GN_BLOCK_PIXELS - 1) / MC_GN_BLOCK_PIXELS;

    /* One scratch request holds, in doubles: per-channel partial sums per
     * pixel block [nblocks][channels] and the per-channel group mean
     * [channels]; then, in floats, the per-channel coefficients of
     * y = (x - mean) * scale + shift. Doubles first keeps them aligned.
     * (Folding the mean into the shift would save a subtraction but cancels
     * catastrophically when the variance is ~0 and scale ~ 1/sqrt(eps).) */
    size_t doubles = (size_t)(nblocks + 1) * (size_t)channels;
    size_t floats = 2 * doubles + 3 * (size_t)channels;
    float *scratch = mc_cpu_scratch(be, MC_GN_SCRATCH_SLOT, floats, "groupnorm's sums and coefficients", err);
    if (scratch == NULL)
        return err->status;
    double *partial = (double *)scratch;
    double *chan_mean = partial + nblocks * channels;
    float *scale_c = scratch + 2 * doubles;
    float *shift_c = scale_c + channels;
    float *mean_c = shift_c + channels;
    const int parallel = hw * channels >= MC_CONV_PARALLEL_MIN_ELEMS;
    const int threads = mc_cpu_threads(be);
    const double count = (double)hw * (double)per_group;

    for (int64_t img = 0; img < batch; img++) {
        const float *xi = x + img * hw * channels;
        float *yi = y + img * hw * channels;

        /* Pass 1: per-channel sums, then group means. Summing channel by
         * channel first keeps the inner loop contiguous in NHWC. */
        gn_block_sums(xi, hw, channels, nblocks, NULL, partial, threads, parallel);
        for (int g = 0; g < groups; g++) {
            double s = gn_group_sum(partial, nblocks, channels, g * per_group, per_group);
            for (int64_t c = g * per_group; c < (g + 1) * per_group; c++)
                chan_mean[c] = s / count;
        }

        /* Pass 2: centred sum of squares (two-pass variance: no cancellation
         * for inputs with a large mean). */
        gn_block_sums(xi, hw, channels, nblocks, chan_mean, partial, threads, parallel);
        for (int g = 0; g < groups; g++) {
            double sq = gn_group_sum(partial, nblocks, channels, g * per_group, per_group);
            double inv_std = 1.0 / sqrt(sq / count + (double)eps);
            for (int64_t c = g * per_group; c < (g + 1) * per_group; c++) {
                double gamma = w != NULL ? (double)w[c] : 1.0;
                double beta = b != NULL ? (double)b[c] : 0.0;
                scale_c[c] = (float)(gamma * inv_std);
                shift_c[c] = (float)beta;
                mean_c[c] = (float)chan_mean[c];
            }
        }

        /* Pass 3: affine (and swish) in one sweep; y may alias x. */
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
        for (int64_t p = 0; p < hw; p++) {
            const float *px = xi + p * channels;
            float *py = yi + p * channels;
            if (swish)
                for (int64_t c = 0; c < channels; c++)
                    py[c] = swish_vectorizable((px[c] - mean_c[c]) * scale_c[c] + shift_c[c]);
            else
                for (int64_t c = 0; c < channels; c++)
                    py[c] = (px[c] - mean_c[c]) * scale_c[c] + shift_c[c];
        }
    }
    return MC_OK;
}

/* ------------------------------------------------- 16-bit convolutions */

mc_status mc_cpu_conv_round_operands(mc_backend *be, const float **x, int64_t pixels, int64_t cin,
                                     int64_t *ldx, const float **w, int64_t w_count, mc_err *err) {
    const mc_wtype wt = be->linear_wtype;
    if (wt == MC_WTYPE_F32)
        return MC_OK;
    size_t x_floats, floats;
    if (pixels < 0 || cin < 0 || w_count < 0 || mc_mul_overflows((size_t)pixels, (size_t)cin, &x_floats) ||
        x_floats > SIZE_MAX - (size_t)w_count)
        return mc_fail(err, MC_ERR_VALUE, "conv2d: %lld pixels x %lld channels are too many to round",
                       (long long)pixels, (long long)cin);
    floats = x_floats + (size_t)w_count;
    float *xr = mc_cpu_scratch(be, MC_CONV_ROUNDED_SLOT, floats, "a 16-bit convolution's rounded input and weights",
                               err);
    if (xr == NULL)
        return err->status;
    float *wr = xr + x_floats;
    const float *xs = *x, *ws = *w;
    const int64_t ld = *ldx;
    const int parallel = (int64_t)floats >= MC_CONV_PARALLEL_MIN_ELEMS;
#pragma omp parallel for schedule(static) num_threads(mc_cpu_threads(be)) if (parallel)
    for (int64_t p = 0; p < pixels; p++)
        for (int64_t c = 0; c < cin; c++)
            xr[p * cin + c] = mc_wtype_round(wt, xs[p * ld + c]);
    /* The weights on the team too: a 640-to-640 3x3 layer has 3.7 M of them. */
#pragma omp parallel for schedule(static) num_threads(mc_cpu_threads(be)) if (parallel)
    for (int64_t i = 0; i < w_count; i++)
        wr[i] = mc_wtype_round(wt, ws[i]);
    *x = xr;
    *ldx = cin;
    *w = wr;
    return MC_OK;
}

/* ------------------------------------------------------------------- conv2d */

/* The reference: y = beta * y + bias + sum over taps and input channels, in
 * float accumulation, one output element at a time. Slow; tests only. */
mc_status mc_cpu_conv2d_naive(mc_backend *be, const float *x, int64_t batch, int64_t height,
                              int64_t width, int64_t cin, const float *w, const float *bias,
                              int64_t cout, int ksize, float beta, float *y, mc_err *err) {
    if (ksize <= 0 || ksize % 2 == 0)
        return mc_fail(err, MC_ERR_INTERNAL, "conv2d: kernel size %d is not odd", ksize);
    int64_t ldx = cin;
    MC_TRY(mc_cpu_conv_round_operands(be, &x, batch * height * width, cin, &ldx, &w,
                                      cout * ksize * ksize * cin, err));
    const int pad = ksize / 2;
    for (int64_t n = 0; n < batch; n++)
        for (int64_t oy = 0; oy < height; oy++)
            for (int64_t ox = 0; ox < width; ox++)
                for (int64_t co = 0; co < cout; co++) {
                    float acc = bias != NULL ? bias[co] : 0.0f;
                    for (int ky = 0; ky < ksize; ky++) {
                        int64_t iy = oy + ky - pad;
                        if (iy < 0 || iy >= height)
                            continue;
                        for (int kx = 0; kx < ksize; kx++) {
                            int64_t ix = ox + kx - pad;
                            if (ix < 0 || ix >= width)
                                continue;
                            const float *px = x + ((n * height + iy) * width + ix) * cin;
                            const float *wk = w + ((co * ksize + ky) * ksize + kx) * cin;
                            for (int64_t ci = 0; ci < cin; ci++)
                                acc += px[ci] * wk[ci];
                        }
                    }
                    float *out = y + ((n * height + oy) * width + ox) * cout + co;
                    *out = beta != 0.0f ? beta * *out + acc : acc;
                }
    return MC_OK;
}

float mc_cpu_prefill_bias(float *y, int64_t rows, int64_t cout, int64_t ldy, const float *bias, float beta) {
    if (bias == NULL)
        return beta;
    for (int64_t r = 0; r < rows; r++) {
        float *yr = y + r * ldy;
        if (beta == 0.0f)
            memcpy(yr, bias, (size_t)cout * sizeof(float));
        else if (beta == 1.0f)
            for (int64_t c = 0; c < cout; c++)
                yr[c] += bias[c];
        else
            for (int64_t c = 0; c < cout; c++)
                yr[c] = beta * yr[c] + bias[c];
    }
    return 1.0f;
}

/* im2col for output rows [row0, row0 + nrows) counted over the whole batch
 * (global row g = image * height + oy), so a chunk may span images. Column
 * row (r * width + ox) holds the (ky, kx, ci) patch of that output pixel;
 * taps outside the image are zeros (the padding). */
static void im2col_rows(const float *x, int64_t height, int64_t width, int64_t cin, int ksize,
                        int64_t row0, int64_t nrows, float *col) {
    const int pad = ksize / 2;
    const int64_t patch = (int64_t)ksize * ksize * cin;
    const size_t tap_bytes = (size_t)cin * sizeof(float);
    for (int64_t r = 0; r < nrows; r++) {
        int64_t g = row0 + r;
        int64_t n = g / height, oy = g % height;
        const float *image = x + n * height * width * cin;
        for (int64_t ox = 0; ox < width; ox++) {
            float *dst = col + (r * width + ox) * patch;
            for (int ky = 0; ky < ksize; ky++) {
                int64_t iy = oy + ky - pad;
                float *dst_row = dst + (int64_t)ky * ksize * cin;
                if (iy < 0 || iy >= height) {
                    memset(dst_row, 0, (size_t)ksize * tap_bytes);
                    continue;
                }
                const float *src_row = image + iy * width * cin;
                /* Taps kx whose input column lies inside the image form one
                 * contiguous run in NHWC: copy it with a single memcpy. */
                int kx_lo = (int)(pad - ox > 0 ? pad - ox : 0);
                int kx_hi = (int)(width - 1 - ox + pad < ksize - 1 ? width - 1 - ox + pad : ksize - 1);
                if (kx_lo > 0)
                    memset(dst_row, 0, (size_t)kx_lo * tap_bytes);
                if (kx_hi >= kx_lo)
                    memcpy(dst_row + (int64_t)kx_lo * cin, src_row + (ox + kx_lo - pad) * cin,
                           (size_t)(kx_hi - kx_lo + 1) * tap_bytes);
                if (kx_hi < ksize - 1)
                    memset(dst_row + (int64_t)(kx_hi + 1) * cin, 0,
                           (size_t)(ksize - 1 - kx_hi) * tap_bytes);
            }
        }
    }
}

/* Threading: every OpenMP thread takes whole chunks (im2col + one serial
 * GEMM into its own scratch slot); OpenBLAS stays single-threaded (the
 * backend's one-pool rule, cpu_backend.c). Measured on the 2-core dev box,
 * one 256x256 VAE decode: 1.3 s this way, 25-29 s with one chunk at a time
 * and OpenBLAS threading the GEMM, where its pthreads and the OpenMP team
 * spin-wait against each other between every im2col and GEMM. */

/* One chunk of output rows: y rows [row0, row0 + nrows) (a row is `width`
 * pixels) = beta * y + bias + patches x W^T. For k = 1 the input pixels are
 * the patches already, so no im2col copy is made and col is unused. */
static void conv_chunk(const float *x, int64_t height, int64_t width, int64_t cin, const float *w,
                       const float *bias, int64_t cout, int ksize, float beta, float *y,
                       int64_t row0, int64_t nrows, float *col) {
    const int64_t patch = (int64_t)ksize * ksize * cin;
    const int64_t pixels = nrows * width;
    const float *a = x + row0 * width * cin;
    if (ksize > 1) {
        im2col_rows(x, height, width, cin, ksize, row0, nrows, col);
        a = col;
    }
    float *yc = y + row0 * width * cout;
    float gemm_beta = mc_cpu_prefill_bias(yc, pixels, cout, cout, bias, beta);
    mc_cpu_sgemm(1, MC_CPU_GEMM_SPLIT_AUTO,
                 0, 1, pixels, cout, patch, 1.0f, a, patch, w, patch, gemm_beta, yc, cout);
}

mc_status mc_cpu_conv2d(mc_backend *be, const float *x, int64_t batch, int64_t height,
                        int64_t width, int64_t cin, const float *w, const float *bias,
                        int64_t cout, int ksize, float beta, float *y, mc_err *err) {
    if (ksize <= 0 || ksize % 2 == 0)
        return mc_fail(err, MC_ERR_INTERNAL, "conv2d: kernel size %d is not odd", ksize);
    if (batch <= 0 || height <= 0 || width <= 0 || cout <= 0)
        return MC_OK;
    int64_t ldx = cin;
    MC_TRY(mc_cpu_conv_round_operands(be, &x, batch * height * width, cin, &ldx, &w,
                                      cout * ksize * ksize * cin, err));
    /* A 1x1 conv has no spatial coupling: view it as batch*height*width rows
     * of one pixel each, so chunks can split anywhere. */
    if (ksize == 1) {
        height = batch * height * width;
        width = 1;
        batch = 1;
    }
    const int64_t patch = (int64_t)ksize * ksize * cin;
    if (patch > MC_BLAS_DIM_MAX || width > MC_BLAS_DIM_MAX / patch)
        return mc_fail(err, MC_ERR_VALUE, "conv2d: one row of %lld x %lld x %lld taps is too large",
                       (long long)width, (long long)ksize * ksize, (long long)cin);
    const int64_t total_rows = batch * height;
    /* im2col floats per output row; for k = 1 the chunk bound only keeps
     * the GEMM's M inside 32-bit BLAS integers. */
    const int64_t row_floats = ksize > 1 ? width * patch : 0;
    int64_t rows_per_chunk = ksize > 1 ? (int64_t)(MC_CONV_CHUNK_FLOATS / (size_t)row_floats)
                                       : MC_BLAS_DIM_MAX;
    if (rows_per_chunk < 1)
        rows_per_chunk = 1;
    int threads = mc_cpu_threads(be);
    if (threads > 62)
        threads = 62; /* scratch slots 0..61; MC_GN_SCRATCH_SLOT stays free */

    /* One GEMM per OpenMP thread (mc_cpu_sgemm runs serially inside a
     * parallel region). Chunks in a multiple of the thread count and of
     * equal size, so the static schedule is balanced. */
    float *cols[62] = {0};
    int64_t nchunks;
    MC_TRY(mc_cpu_plan_chunks(be, total_rows, row_floats, &rows_per_chunk, &threads, cols, &nchunks, err));
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t chunk = 0; chunk < nchunks; chunk++) {
        int64_t nrows;
        int64_t row0 = mc_cpu_chunk_rows(chunk, rows_per_chunk, total_rows, &nrows);
        conv_chunk(x, height, width, cin, w, bias, cout, ksize, beta, y, row0, nrows,
                   cols[omp_get_thread_num()]);
    }
    return MC_OK;
}

/* --------------------------------------------------------------- upsample */

mc_status mc_cpu_upsample_nearest2x(mc_backend *be, const float *x, int64_t batch, int64_t height,
                                    int64_t width, int64_t channels, float *y, mc_err *err) {
    (void)err;
    const int threads = mc_cpu_threads(be);
    const int64_t out_rows = batch * 2 * height;
    const size_t pixel_bytes = (size_t)channels * sizeof(float);
#pragma omp parallel for schedule(static) num_threads(threads) \
    if (out_rows * 2 * width * channels >= MC_CONV_PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < out_rows; r++) {
        /* Output row r = (image n, row oy) reads input row oy / 2 of image n. */
        int64_t n = r / (2 * height), oy = r % (2 * height);
        const float *src = x + (n * height + oy / 2) * width * channels;
        float *dst = y + r * 2 * width * channels;
        for (int64_t ix = 0; ix < width; ix++) {
            memcpy(dst + (2 * ix) * channels, src + ix * channels, pixel_bytes);
            memcpy(dst + (2 * ix + 1) * channels, src + ix * channels, pixel_bytes);
        }
    }
    return MC_OK;
}

/* Convolution-side ops of the CUDA backend: groupnorm, conv2d (the VAE's
 * stride-1 "same" convolution), conv2d_ex (any window, FID-Inception),
 * nearest x2 upsampling.
 *
 * Both convolutions lower to cuBLAS GEMMs the way the CPU backend does
 * (cpu_conv.c, cpu_window.c): a 1x1 stride-1 unpadded convolution is one
 * GEMM over the pixels read in place; anything else gathers chunks of
 * output rows into an im2col matrix [pixels, kh * kw * cin] ordered
 * (ky, kx, ci) like the packed weights [cout, kh, kw, cin], and runs one
 * GEMM per chunk. conv2d is conv2d_ex with kh = kw = k, stride 1, padding
 * k / 2. conv_naive_kernel is the plain loop definition, run in reference
 * mode (mc_cuda_set_naive).
 *
 * On a backend with a 16-bit linear_wtype both run as autocast's
 * convolutions (ops.h): the weights are rounded into scratch once per call,
 * im2col writes the columns rounded to the type (a 1x1 convolution goes
 * through im2col too, which then only rounds), and the GEMMs multiply the
 * 16-bit operands on the tensor cores with float32 sums
 * (mc_cuda_gemm_16bit_nt). The naive kernel rounds each operand it reads. */
#include <math.h>

#include "cuda_internal.h"

/* Upper bound on one im2col chunk, in floats (128 MiB): large enough that
 * each GEMM has thousands of rows, small enough to sit beside the VAE's
 * activations. At least one output pixel is always taken. */
#define CONV_CHUNK_FLOATS ((int64_t)1 << 25)

/* cuBLAS takes 32-bit sizes; pointwise GEMMs are split below this. */
#define CONV_GEMM_ROWS_MAX ((int64_t)1 << 30)

/* ---- groupnorm ------------------------------------------------------------
 *
 * Statistics per (image, group) over hw x channels/groups elements, in
 * double, two passes (mean, then centred sum of squares) like the CPU. Each
 * pass: gn_partial_kernel, one block per (image, group, chunk of
 * GN_CHUNK elements), writes one double per block; gn_finalize_kernel, one
 * thread per (image, group), adds the chunks in order. The chunking depends
 * only on the shape, so the result does not depend on the device. Then
 * gn_apply_kernel, one thread per element: y = (x - mean) * scale + shift
 * with the CPU's float coefficients, swish optional. y may be x (the apply
 * pass reads and writes each element in one thread, after the statistics). */
#define GN_THREADS 256
#define GN_CHUNK (GN_THREADS * 16)

__global__ void gn_partial_kernel(const float *x, int64_t hw, int64_t channels, int groups,
                                  int64_t chunks, const double *mean, double *partial) {
    __shared__ double red[32];
    const int64_t per_group = channels / groups;
    const int64_t count = hw * per_group;
    int64_t blk = blockIdx.x;
    const int64_t chunk = blk % chunks;
    blk /= chunks;
    const int g = (int)(blk % groups);
    const int64_t img = blk / groups;
    const float *xi = x + img * hw * channels + (int64_t)g * per_group;
    const double mu = mean != NULL ? mean[img * groups + g] : 0.0;
    const int64_t end = (chunk + 1) * GN_CHUNK < count ? (chunk + 1) * GN_CHUNK : count;
    double acc = 0.0;
    for (int64_t e = chunk * GN_CHUNK + threadIdx.x; e < end; e += blockDim.x) {
        int64_t p = e / per_group, c = e - p * per_group;
        double v = (double)xi[p * channels + c];
        if (mean != NULL) {
            v -= mu;
            v *= v;
        }
        acc += v;
    }
    acc = mc_block_sum(acc, red);
    if (threadIdx.x == 0)
        partial[blockIdx.x] = acc;
}

/* mode 0: out = mean; mode 1: out = 1 / sqrt(var + eps). */
__global__ void gn_finalize_kernel(const double *partial, int64_t chunks, int64_t items,
                                   double count, float eps, int mode, double *out) {
    MC_GRID_STRIDE_LOOP(item, items) {
        double s = 0.0;
        for (int64_t c = 0; c < chunks; c++)
            s += partial[item * chunks + c];
        out[item] = mode == 0 ? s / count : 1.0 / sqrt(s / count + (double)eps);
    }
}

__global__ void gn_apply_kernel(const float *x, int64_t batch, int64_t hw, int64_t channels,
                                int groups, const float *w, const float *b, const double *mean,
                                const double *inv_std, int swish, float *y) {
    const int64_t per_group = channels / groups;
    MC_GRID_STRIDE_LOOP(i, batch * hw * channels) {
        const int64_t c = i % channels, img = i / (hw * channels);
        const int64_t item = img * groups + c / per_group;
        const float mean_c = (float)mean[item];
        const float scale_c = (float)((w != NULL ? (double)w[c] : 1.0) * inv_std[item]);
        const float shift_c = b != NULL ? b[c] : 0.0f;
        float v = (x[i] - mean_c) * scale_c + shift_c;
        if (swish)
            v = v / (1.0f + expf(-v));
        y[i] = v;
    }
}

mc_status mc_cuda_groupnorm(mc_backend *be, const float *x, int64_t batch, int64_t hw,
                            int64_t channels, int groups, const float *w, const float *b, float eps,
                            int swish, float *y, mc_err *err) {
    MC_TRY(mc_check_groups(channels, groups, err));
    if (batch <= 0 || hw <= 0)
        return MC_OK;
    MC_TRY(mc_cuda_enter(be, err));
    cudaStream_t stream = cuda_st(be)->stream;
    const int64_t count = hw * (channels / groups);
    const int64_t chunks = (count + GN_CHUNK - 1) / GN_CHUNK;
    const int64_t items = batch * groups;
    const int64_t blocks = items * chunks;
    if (blocks > 0x7fffffffLL)
        return mc_fail(err, MC_ERR_VALUE, "cuda groupnorm: %lld blocks exceed the grid limit",
                       (long long)blocks);
    double *partial = (double *)mc_cuda_scratch(
        be, MC_CUDA_SLOT_STATS, (size_t)(blocks + 2 * items) * sizeof(double),
        "groupnorm's partial sums and statistics", err);
    if (partial == NULL)
        return err->status;
    double *mean = partial + blocks, *inv_std = mean + items;

    gn_partial_kernel<<<(unsigned)blocks, GN_THREADS, 0, stream>>>(x, hw, channels, groups, chunks,
                                                                   NULL, partial);
    MC_CUDA_LAUNCHED("gn_partial_kernel", err);
    gn_finalize_kernel<<<mc_cuda_blocks(items, 64), 64, 0, stream>>>(partial, chunks, items,
                                                                     (double)count, eps, 0, mean);
    MC_CUDA_LAUNCHED("gn_finalize_kernel", err);
    gn_partial_kernel<<<(unsigned)blocks, GN_THREADS, 0, stream>>>(x, hw, channels, groups, chunks,
                                                                   mean, partial);
    MC_CUDA_LAUNCHED("gn_partial_kernel", err);
    gn_finalize_kernel<<<mc_cuda_blocks(items, 64), 64, 0, stream>>>(
        partial, chunks, items, (double)count, eps, 1, inv_std);
    MC_CUDA_LAUNCHED("gn_finalize_kernel", err);
    gn_apply_kernel<<<mc_cuda_blocks(batch * hw * channels, MC_CUDA_THREADS), MC_CUDA_THREADS, 0,
                      stream>>>(x, batch, hw, channels, groups, w, b, mean, inv_std, swish, y);
    MC_CUDA_LAUNCHED("gn_apply_kernel", err);
    return MC_OK;
}

/* ---- convolution kernels --------------------------------------------------- */

/* im2col for output pixels [p0, p0 + np) counted over the batch (global
 * pixel P = (n * oh + oy) * ow + ox): col[(P - p0) * patch + (ky * kw + kx)
 * * cin + ci], zero where a tap falls in the padding. One warp per output
 * pixel (grid-stride over the pixels): the pixel's coordinates are divided
 * out once, then the warp copies each tap's cin values, lane by lane, so
 * reads and writes are contiguous in ci. (One thread per column element,
 * the first form, divided the 64-bit element index out per element: 31% of
 * a VAR-d16 image's GPU time on an H200, more than the decoder's GEMMs.) */
#define IM2COL_WARPS 8

template <typename T>
__global__ void im2col_kernel(const float *x, int64_t height, int64_t width, int64_t cin,
                              int64_t ldx, int kh, int kw, int stride_h, int stride_w, int pad_h,
                              int pad_w, int64_t oh, int64_t ow, int64_t p0, int64_t np, T *col) {
    const int64_t patch = (int64_t)kh * kw * cin;
    const int lane = threadIdx.x % 32;
    const int64_t first = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int64_t step = (int64_t)gridDim.x * (blockDim.x / 32);
    for (int64_t pl = first; pl < np; pl += step) {
        const int64_t P = p0 + pl;
        const int64_t ox = P % ow, rest = P / ow;
        const int64_t oy = rest % oh, n = rest / oh;
        T *dst = col + pl * patch;
        for (int ky = 0; ky < kh; ky++) {
            const int64_t iy = oy * stride_h + ky - pad_h;
            for (int kx = 0; kx < kw; kx++, dst += cin) {
                const int64_t ix = ox * stride_w + kx - pad_w;
                if (iy >= 0 && iy < height && ix >= 0 && ix < width) {
                    const float *src = x + ((n * height + iy) * width + ix) * ldx;
                    for (int64_t ci = lane; ci < cin; ci += 32)
                        mc_store_rounded(dst + ci, src[ci]);
                } else {
                    for (int64_t ci = lane; ci < cin; ci += 32)
                        mc_store_rounded(dst + ci, 0.0f);
                }
            }
        }
    }
}

/* The reference: one thread per output element (pixel, co), the CPU naive
 * kernel's loop and rounding order: acc over (ky, kx, ci) from 0 of the
 * operands rounded to T (float: as they are), then beta * y + acc + bias,
 * then ReLU. */
template <typename T>
__global__ void conv_naive_kernel(const float *x, int64_t batch, int64_t height, int64_t width,
                                  int64_t cin, int64_t ldx, int kh, int kw, int stride_h,
                                  int stride_w, int pad_h, int pad_w, const float *w,
                                  const float *bias, int64_t cout, float beta, int relu, float *y,
                                  int64_t ldy, int64_t oh, int64_t ow) {
    MC_GRID_STRIDE_LOOP(e, batch * oh * ow * cout) {
        const int64_t co = e % cout, P = e / cout;
        const int64_t ox = P % ow, rest = P / ow;
        const int64_t oy = rest % oh, n = rest / oh;
        float acc = 0.0f;
        for (int ky = 0; ky < kh; ky++) {
            const int64_t iy = oy * stride_h + ky - pad_h;
            if (iy < 0 || iy >= height)
                continue;
            for (int kx = 0; kx < kw; kx++) {
                const int64_t ix = ox * stride_w + kx - pad_w;
                if (ix < 0 || ix >= width)
                    continue;
                const float *px = x + ((n * height + iy) * width + ix) * ldx;
                const float *wk = w + ((co * kh + ky) * kw + kx) * cin;
                for (int64_t ci = 0; ci < cin; ci++)
                    acc += round_to<T>(px[ci]) * round_to<T>(wk[ci]);
            }
        }
        float *out = y + P * ldy + co;
        const float v = (beta != 0.0f ? beta * *out : 0.0f) + acc + (bias != NULL ? bias[co] : 0.0f);
        *out = relu && v < 0.0f ? 0.0f : v;
    }
}

/* The reference kernel over the operands rounded to T. */
template <typename T>
static mc_status conv_naive(mc_backend *be, const mc_window2d *g, const float *x, int64_t cin,
                            int64_t ldx, const float *w, const float *bias, int64_t cout, float beta,
                            int relu, float *y, int64_t ldy, mc_err *err) {
    const int64_t oh = mc_window_out_h(g), ow = mc_window_out_w(g);
    conv_naive_kernel<T><<<mc_cuda_blocks(g->batch * oh * ow * cout, MC_CUDA_THREADS), MC_CUDA_THREADS, 0,
                           cuda_st(be)->stream>>>(x, g->batch, g->height, g->width, cin, ldx, g->kh, g->kw,
                                                  g->stride_h, g->stride_w, g->pad_h, g->pad_w, w, bias,
                                                  cout, beta, relu, y, ldy, oh, ow);
    MC_CUDA_LAUNCHED("conv_naive_kernel", err);
    return MC_OK;
}

/* im2col of output pixels [p0, p0 + np) into col, of element type T. */
template <typename T>
static mc_status im2col(mc_backend *be, const mc_window2d *g, const float *x, int64_t cin, int64_t ldx,
                        int64_t p0, int64_t np, void *col, mc_err *err) {
    im2col_kernel<T><<<mc_cuda_blocks(np, IM2COL_WARPS), IM2COL_WARPS * 32, 0, cuda_st(be)->stream>>>(
        x, g->height, g->width, cin, ldx, g->kh, g->kw, g->stride_h, g->stride_w, g->pad_h, g->pad_w,
        mc_window_out_h(g), mc_window_out_w(g), p0, np, (T *)col);
    MC_CUDA_LAUNCHED("im2col_kernel", err);
    return MC_OK;
}

/* The shared body of conv2d and conv2d_ex (arguments checked by callers). */
static mc_status conv_window(mc_backend *be, const mc_window2d *g, const float *x, int64_t cin,
                             int64_t ldx, const float *w, const float *bias, int64_t cout,
                             float beta, int relu, float *y, int64_t ldy, mc_err *err) {
    if (g->batch == 0)
        return MC_OK;
    MC_TRY(mc_cuda_enter(be, err));
    cuda_state *st = cuda_st(be);
    const int64_t oh = mc_window_out_h(g), ow = mc_window_out_w(g);
    const int64_t pixels = g->batch * oh * ow;
    const int64_t patch = (int64_t)g->kh * g->kw * cin;
    const mc_wtype wt = be->linear_wtype;

    if (st->naive) {
        if (wt == MC_WTYPE_BF16)
            return conv_naive<__nv_bfloat16>(be, g, x, cin, ldx, w, bias, cout, beta, relu, y, ldy, err);
        if (wt == MC_WTYPE_F16)
            return conv_naive<__half>(be, g, x, cin, ldx, w, bias, cout, beta, relu, y, ldy, err);
        return conv_naive<float>(be, g, x, cin, ldx, w, bias, cout, beta, relu, y, ldy, err);
    }

    /* y = beta * y + bias first (never reading y when beta == 0); the GEMMs
     * then add onto it, or overwrite it when there is neither. */
    float gemm_beta = beta;
    if (bias != NULL) {
        MC_TRY(mc_cuda_prefill_bias(be, y, pixels, cout, ldy, bias, beta, err));
        gemm_beta = 1.0f;
    }
    const int pointwise = g->kh == 1 && g->kw == 1 && g->stride_h == 1 && g->stride_w == 1 &&
                          g->pad_h == 0 && g->pad_w == 0;
    if (pointwise && wt == MC_WTYPE_F32) {
        for (int64_t p0 = 0; p0 < pixels; p0 += CONV_GEMM_ROWS_MAX) {
            const int64_t np = pixels - p0 < CONV_GEMM_ROWS_MAX ? pixels - p0 : CONV_GEMM_ROWS_MAX;
            MC_TRY(mc_cuda_sgemm(be, 0, 1, np, cout, cin, 1.0f, x + p0 * ldx, ldx, w, cin,
                                 gemm_beta, y + p0 * ldy, ldy, err));
        }
    } else {
        /* The weights rounded once for every chunk (a 16-bit backend). */
        void *w16 = NULL;
        if (wt != MC_WTYPE_F32) {
            w16 = mc_cuda_scratch(be, MC_CUDA_SLOT_HALF_W, (size_t)(cout * patch) * 2,
                                  "a 16-bit convolution's rounded weights", err);
            if (w16 == NULL)
                return err->status;
            MC_TRY(mc_cuda_round_rows_16bit(be, w, patch, cout, patch, w16, err));
        }
        const size_t elem = wt == MC_WTYPE_F32 ? sizeof(float) : 2;
        int64_t chunk = CONV_CHUNK_FLOATS / patch;
        if (chunk < 1)
            chunk = 1; /* im2col takes any run of output pixels */
        if (chunk > CONV_GEMM_ROWS_MAX)
            chunk = CONV_GEMM_ROWS_MAX;
        if (chunk > pixels)
            chunk = pixels;
        void *col = mc_cuda_scratch(be, MC_CUDA_SLOT_COLUMNS, (size_t)(chunk * patch) * elem,
                                    "conv2d's im2col columns", err);
        if (col == NULL)
            return err->status;
        for (int64_t p0 = 0; p0 < pixels; p0 += chunk) {
            const int64_t np = pixels - p0 < chunk ? pixels - p0 : chunk;
            /* The next chunk's im2col is ordered after this GEMM on the
             * stream, so one column buffer serves every chunk. */
            if (wt == MC_WTYPE_F32) {
                MC_TRY(im2col<float>(be, g, x, cin, ldx, p0, np, col, err));
                MC_TRY(mc_cuda_sgemm(be, 0, 1, np, cout, patch, 1.0f, (const float *)col, patch, w,
                                     patch, gemm_beta, y + p0 * ldy, ldy, err));
            } else {
                if (wt == MC_WTYPE_BF16)
                    MC_TRY(im2col<__nv_bfloat16>(be, g, x, cin, ldx, p0, np, col, err));
                else
                    MC_TRY(im2col<__half>(be, g, x, cin, ldx, p0, np, col, err));
                MC_TRY(mc_cuda_gemm_16bit_nt(be, np, cout, patch, col, patch, w16, patch, gemm_beta,
                                             y + p0 * ldy, ldy, err));
            }
        }
    }
    if (relu)
        MC_TRY(mc_cuda_relu_rows(be, y, pixels, cout, ldy, err));
    return MC_OK;
}

mc_status mc_cuda_conv2d_ex(mc_backend *be, const mc_window2d *g, const float *x, int64_t cin,
                            int64_t ldx, const float *w, const float *bias, int64_t cout,
                            float beta, int relu, float *y, int64_t ldy, mc_err *err) {
    MC_TRY(mc_check_window("conv2d_ex", g, 0, err));
    MC_TRY(mc_check_pixel_strides("conv2d_ex", cin, ldx, cout, ldy, err));
    return conv_window(be, g, x, cin, ldx, w, bias, cout, beta, relu, y, ldy, err);
}

mc_status mc_cuda_conv2d(mc_backend *be, const float *x, int64_t batch, int64_t height,
                         int64_t width, int64_t cin, const float *w, const float *bias,
                         int64_t cout, int ksize, float beta, float *y, mc_err *err) {
    if (ksize <= 0 || ksize % 2 == 0)
        return mc_fail(err, MC_ERR_INTERNAL, "conv2d: kernel size %d is not odd", ksize);
    if (batch <= 0 || height <= 0 || width <= 0 || cout <= 0 || cin <= 0)
        return MC_OK;
    mc_window2d g;
    g.batch = batch;
    g.height = height;
    g.width = width;
    g.kh = g.kw = ksize;
    g.stride_h = g.stride_w = 1;
    g.pad_h = g.pad_w = ksize / 2;
    return conv_window(be, &g, x, cin, cin, w, bias, cout, beta, 0, y, cout, err);
}

/* ---- upsample ------------------------------------------------------------ */

/* One thread per output element: output (n, oy, ox, c) reads input
 * (n, oy / 2, ox / 2, c). */
__global__ void upsample2x_kernel(const float *x, int64_t batch, int64_t height, int64_t width,
                                  int64_t channels, float *y) {
    const int64_t ow = 2 * width, oh = 2 * height;
    MC_GRID_STRIDE_LOOP(e, batch * oh * ow * channels) {
        const int64_t c = e % channels, P = e / channels;
        const int64_t ox = P % ow, rest = P / ow;
        const int64_t oy = rest % oh, n = rest / oh;
        y[e] = x[((n * height + oy / 2) * width + ox / 2) * channels + c];
    }
}

mc_status mc_cuda_upsample_nearest2x(mc_backend *be, const float *x, int64_t batch, int64_t height,
                                     int64_t width, int64_t channels, float *y, mc_err *err) {
    const int64_t n = batch * 4 * height * width * channels;
    if (n <= 0)
        return MC_OK;
    MC_TRY(mc_cuda_enter(be, err));
    upsample2x_kernel<<<mc_cuda_blocks(n, MC_CUDA_THREADS), MC_CUDA_THREADS, 0,
                        cuda_st(be)->stream>>>(x, batch, height, width, channels, y);
    MC_CUDA_LAUNCHED("upsample2x_kernel", err);
    return MC_OK;
}

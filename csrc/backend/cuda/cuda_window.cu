/* Pools and the TF1 bilinear resize on the CUDA backend (FID-Inception).
 * One thread per output element (pixel, channel), channels fastest, so
 * neighbouring threads read neighbouring channels of one NHWC pixel. Each
 * kernel follows the CPU loop of cpu_window.c operation for operation. */
#include <math.h>

#include "cuda_internal.h"

/* The taps of output (oy, ox) inside the image: rows [y0, y1), cols [x0, x1). */
struct span2d {
    int64_t y0, y1, x0, x1;
};

__device__ __forceinline__ span2d window_span(int64_t oy, int64_t ox, int64_t height,
                                              int64_t width, int kh, int kw, int stride_h,
                                              int stride_w, int pad_h, int pad_w) {
    span2d s;
    const int64_t ys = oy * stride_h - pad_h, xs = ox * stride_w - pad_w;
    s.y0 = ys < 0 ? 0 : ys;
    s.x0 = xs < 0 ? 0 : xs;
    s.y1 = ys + kh < height ? ys + kh : height;
    s.x1 = xs + kw < width ? xs + kw : width;
    return s;
}

/* avg: sum the in-image taps in row-major order (as the CPU), one division.
 * max: start from the first in-image tap; a tap wins when it is larger or
 * NaN, so NaN propagates and padded taps never take part. */
__global__ void pool_kernel(const float *x, int64_t batch, int64_t height, int64_t width, int kh,
                            int kw, int stride_h, int stride_w, int pad_h, int pad_w,
                            int64_t channels, int64_t ldx, int is_avg, int count_include_pad,
                            float *y, int64_t ldy, int64_t oh, int64_t ow) {
    MC_GRID_STRIDE_LOOP(e, batch * oh * ow * channels) {
        const int64_t c = e % channels, P = e / channels;
        const int64_t ox = P % ow, rest = P / ow;
        const int64_t oy = rest % oh, n = rest / oh;
        const span2d s = window_span(oy, ox, height, width, kh, kw, stride_h, stride_w, pad_h, pad_w);
        const float *image = x + n * height * width * ldx + c;
        float acc;
        if (is_avg) {
            acc = 0.0f;
            for (int64_t iy = s.y0; iy < s.y1; iy++)
                for (int64_t ix = s.x0; ix < s.x1; ix++)
                    acc += image[(iy * width + ix) * ldx];
            const float divisor = count_include_pad ? (float)(kh * kw)
                                                    : (float)((s.y1 - s.y0) * (s.x1 - s.x0));
            acc /= divisor;
        } else {
            acc = image[(s.y0 * width + s.x0) * ldx];
            for (int64_t iy = s.y0; iy < s.y1; iy++)
                for (int64_t ix = s.x0; ix < s.x1; ix++) {
                    const float v = image[(iy * width + ix) * ldx];
                    acc = (v > acc || v != v) ? v : acc;
                }
        }
        y[P * ldy + c] = acc;
    }
}

static mc_status pool(mc_backend *be, const char *op, const mc_window2d *g, const float *x,
                      int64_t channels, int64_t ldx, int is_avg, int count_include_pad, float *y,
                      int64_t ldy, mc_err *err) {
    MC_TRY(mc_check_window(op, g, 1, err));
    MC_TRY(mc_check_pixel_strides(op, channels, ldx, channels, ldy, err));
    const int64_t oh = mc_window_out_h(g), ow = mc_window_out_w(g);
    const int64_t n = g->batch * oh * ow * channels;
    if (n <= 0)
        return MC_OK;
    MC_TRY(mc_cuda_enter(be, err));
    pool_kernel<<<mc_cuda_blocks(n, MC_CUDA_THREADS), MC_CUDA_THREADS, 0, cuda_st(be)->stream>>>(
        x, g->batch, g->height, g->width, g->kh, g->kw, g->stride_h, g->stride_w, g->pad_h,
        g->pad_w, channels, ldx, is_avg, count_include_pad, y, ldy, oh, ow);
    MC_CUDA_LAUNCHED("pool_kernel", err);
    return MC_OK;
}

mc_status mc_cuda_avg_pool2d(mc_backend *be, const mc_window2d *g, const float *x,
                             int64_t channels, int64_t ldx, int count_include_pad, float *y,
                             int64_t ldy, mc_err *err) {
    return pool(be, "avg_pool2d", g, x, channels, ldx, 1, count_include_pad, y, ldy, err);
}

mc_status mc_cuda_max_pool2d(mc_backend *be, const mc_window2d *g, const float *x,
                             int64_t channels, int64_t ldx, float *y, int64_t ldy, mc_err *err) {
    return pool(be, "max_pool2d", g, x, channels, ldx, 0, 0, y, ldy, err);
}

/* ---- TF1 bilinear resize ---------------------------------------------------
 *
 * Exact float32 semantics (ops.h): every product, sum and difference is its
 * own IEEE round-to-nearest operation through __fmul_rn / __fadd_rn /
 * __fsub_rn, which nvcc never contracts into an FMA (plain a + b * c may be
 * fused under the default --fmad=true). The per-axis scale is computed on
 * the host exactly as the CPU does, float32(in / out) from doubles. */
struct tf1_axis {
    int64_t lo, hi;
    float frac;
};

__device__ __forceinline__ tf1_axis tf1_grid(int64_t o, int64_t in, float scale) {
    tf1_axis a;
    const float src = __fmul_rn((float)o, scale);
    int64_t l = (int64_t)src; /* src >= 0: truncation is floor */
    if (l > in - 1)
        l = in - 1;
    a.lo = l;
    a.hi = l + 1 < in - 1 ? l + 1 : in - 1;
    a.frac = __fsub_rn(src, (float)l);
    return a;
}

template <typename T>
__global__ void resize_tf1_kernel(const T *x, int64_t batch, int64_t in_h, int64_t in_w,
                                  int64_t channels, int64_t out_h, int64_t out_w, float scale_h,
                                  float scale_w, int normalize, float *y) {
    MC_GRID_STRIDE_LOOP(e, batch * out_h * out_w * channels) {
        const int64_t c = e % channels, P = e / channels;
        const int64_t ox = P % out_w, rest = P / out_w;
        const int64_t oy = rest % out_h, n = rest / out_h;
        const tf1_axis ay = tf1_grid(oy, in_h, scale_h), ax = tf1_grid(ox, in_w, scale_w);
        const T *img = x + n * in_h * in_w * channels + c;
        const float tl = (float)img[(ay.lo * in_w + ax.lo) * channels];
        const float tr = (float)img[(ay.lo * in_w + ax.hi) * channels];
        const float bl = (float)img[(ay.hi * in_w + ax.lo) * channels];
        const float br = (float)img[(ay.hi * in_w + ax.hi) * channels];
        const float top = __fadd_rn(tl, __fmul_rn(__fsub_rn(tr, tl), ax.frac));
        const float bot = __fadd_rn(bl, __fmul_rn(__fsub_rn(br, bl), ax.frac));
        float v = __fadd_rn(top, __fmul_rn(__fsub_rn(bot, top), ay.frac));
        if (normalize)
            v = __fdiv_rn(__fsub_rn(v, 128.0f), 128.0f);
        y[e] = v;
    }
}

mc_status mc_cuda_resize_bilinear_tf1(mc_backend *be, const void *x, mc_pixel_type type,
                                      int64_t batch, int64_t in_h, int64_t in_w, int64_t channels,
                                      int64_t out_h, int64_t out_w, int normalize, float *y,
                                      mc_err *err) {
    MC_TRY(mc_check_resize(type, batch, in_h, in_w, channels, out_h, out_w, err));
    if (batch == 0)
        return MC_OK;
    MC_TRY(mc_cuda_enter(be, err));
    const float scale_h = (float)((double)in_h / (double)out_h);
    const float scale_w = (float)((double)in_w / (double)out_w);
    const int64_t n = batch * out_h * out_w * channels;
    const unsigned blocks = mc_cuda_blocks(n, MC_CUDA_THREADS);
    cudaStream_t stream = cuda_st(be)->stream;
    if (type == MC_PIXEL_F32)
        resize_tf1_kernel<float><<<blocks, MC_CUDA_THREADS, 0, stream>>>(
            (const float *)x, batch, in_h, in_w, channels, out_h, out_w, scale_h, scale_w,
            normalize, y);
    else
        resize_tf1_kernel<uint8_t><<<blocks, MC_CUDA_THREADS, 0, stream>>>(
            (const uint8_t *)x, batch, in_h, in_w, channels, out_h, out_w, scale_h, scale_w,
            normalize, y);
    MC_CUDA_LAUNCHED("resize_tf1_kernel", err);
    return MC_OK;
}

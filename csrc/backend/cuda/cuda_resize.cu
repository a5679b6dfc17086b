/* The VAR resize ops on the CUDA backend (ops_list.h, var_fastvar.md B3 and
 * D3): PyTorch's bicubic interpolation (align_corners = False, A = -0.75,
 * clamped taps) and its 'area' mode (adaptive average pooling).
 *
 * One thread per output element (pixel, channel), channels fastest, so
 * neighbouring threads read neighbouring channels of one NHWC pixel. Each
 * kernel follows the CPU loop of cpu_resize.c operation for operation; every
 * product and sum goes through __fmul_rn / __fadd_rn / __fsub_rn, which nvcc
 * never contracts into an FMA (a plain a + b * c may be fused under the
 * default --fmad=true), so both backends round identically. */
#include <math.h>

#include "cuda_internal.h"

/* ---- bicubic ---------------------------------------------------------------- */

#define MC_CUBIC_A (-0.75f)

/* w1(x) = ((A + 2) x - (A + 3)) x x + 1 (cpu_resize.c cubic_inner). */
__device__ __forceinline__ float cubic_inner(float x) {
    float p = __fmul_rn(MC_CUBIC_A + 2.0f, x);
    p = __fsub_rn(p, MC_CUBIC_A + 3.0f);
    p = __fmul_rn(p, x);
    p = __fmul_rn(p, x);
    return __fadd_rn(p, 1.0f);
}

/* w2(x) = ((A x - 5 A) x + 8 A) x - 4 A (cpu_resize.c cubic_outer). */
__device__ __forceinline__ float cubic_outer(float x) {
    float p = __fmul_rn(MC_CUBIC_A, x);
    p = __fsub_rn(p, 5.0f * MC_CUBIC_A);
    p = __fmul_rn(p, x);
    p = __fadd_rn(p, 8.0f * MC_CUBIC_A);
    p = __fmul_rn(p, x);
    return __fsub_rn(p, 4.0f * MC_CUBIC_A);
}

struct cubic_taps {
    int64_t idx[4];
    float w[4];
};

/* cpu_resize.c bicubic_axis; `scale` = float(in) / float(out), computed on
 * the host as the CPU does. */
__device__ __forceinline__ cubic_taps bicubic_axis(int64_t in, int64_t o, float scale) {
    cubic_taps a;
    const float centre = __fadd_rn((float)o, 0.5f);
    const float scaled = __fmul_rn(scale, centre);
    const float src = __fsub_rn(scaled, 0.5f);
    int64_t i0 = (int64_t)floorf(src);
    if (i0 > in - 1)
        i0 = in - 1;
    float t = __fsub_rn(src, (float)i0);
    t = t < 0.0f ? 0.0f : (t > 1.0f ? 1.0f : t);
    const float t2 = __fsub_rn(1.0f, t);
    a.w[0] = cubic_outer(__fadd_rn(t, 1.0f));
    a.w[1] = cubic_inner(t);
    a.w[2] = cubic_inner(t2);
    a.w[3] = cubic_outer(__fadd_rn(t2, 1.0f));
    for (int j = 0; j < 4; j++) {
        const int64_t i = i0 - 1 + j;
        a.idx[j] = i < 0 ? 0 : (i > in - 1 ? in - 1 : i);
    }
    return a;
}

__global__ void resize_bicubic_kernel(const float *x, int64_t batch, int64_t in_h, int64_t in_w,
                                      int64_t channels, int64_t out_h, int64_t out_w,
                                      float scale_h, float scale_w, float *y) {
    MC_GRID_STRIDE_LOOP(e, batch * out_h * out_w * channels) {
        const int64_t c = e % channels, P = e / channels;
        const int64_t ox = P % out_w, rest = P / out_w;
        const int64_t oy = rest % out_h, n = rest / out_h;
        const cubic_taps ty = bicubic_axis(in_h, oy, scale_h);
        const cubic_taps tx = bicubic_axis(in_w, ox, scale_w);
        const float *image = x + n * in_h * in_w * channels + c;
        float acc = 0.0f;
        for (int j = 0; j < 4; j++) {
            /* Along x on tap row j, then its share along y, added in tap
             * order (the first share is stored, not added to 0). */
            const float *row = image + ty.idx[j] * in_w * channels;
            float t = __fmul_rn(row[tx.idx[0] * channels], tx.w[0]);
            t = __fadd_rn(t, __fmul_rn(row[tx.idx[1] * channels], tx.w[1]));
            t = __fadd_rn(t, __fmul_rn(row[tx.idx[2] * channels], tx.w[2]));
            t = __fadd_rn(t, __fmul_rn(row[tx.idx[3] * channels], tx.w[3]));
            const float share = __fmul_rn(t, ty.w[j]);
            acc = j == 0 ? share : __fadd_rn(acc, share);
        }
        y[e] = acc;
    }
}

mc_status mc_cuda_resize_bicubic(mc_backend *be, const float *x, int64_t batch, int64_t in_h,
                                 int64_t in_w, int64_t channels, int64_t out_h, int64_t out_w,
                                 float *y, mc_err *err) {
    MC_TRY(mc_check_resize_f32("resize_bicubic", batch, in_h, in_w, channels, out_h, out_w, err));
    if (batch == 0)
        return MC_OK;
    MC_TRY(mc_cuda_enter(be, err));
    const float scale_h = (float)in_h / (float)out_h;
    const float scale_w = (float)in_w / (float)out_w;
    const int64_t n = batch * out_h * out_w * channels;
    resize_bicubic_kernel<<<mc_cuda_blocks(n, MC_CUDA_THREADS), MC_CUDA_THREADS, 0,
                            cuda_st(be)->stream>>>(x, batch, in_h, in_w, channels, out_h, out_w,
                                                   scale_h, scale_w, y);
    MC_CUDA_LAUNCHED("resize_bicubic_kernel", err);
    return MC_OK;
}

/* ---- area --------------------------------------------------------------------- */

/* cpu_resize.c area_bin: [floor(o in / out), ceil((o + 1) in / out)). */
__device__ __forceinline__ void area_bin(int64_t in, int64_t out, int64_t o, int64_t *start,
                                         int64_t *end) {
    *start = (o * in) / out;
    *end = ((o + 1) * in + out - 1) / out;
}

__global__ void resize_area_kernel(const float *x, int64_t batch, int64_t in_h, int64_t in_w,
                                   int64_t channels, int64_t out_h, int64_t out_w, float *y) {
    MC_GRID_STRIDE_LOOP(e, batch * out_h * out_w * channels) {
        const int64_t c = e % channels, P = e / channels;
        const int64_t ox = P % out_w, rest = P / out_w;
        const int64_t oy = rest % out_h, n = rest / out_h;
        int64_t y0, y1, x0, x1;
        area_bin(in_h, out_h, oy, &y0, &y1);
        area_bin(in_w, out_w, ox, &x0, &x1);
        const float *image = x + n * in_h * in_w * channels + c;
        float sum = 0.0f;
        for (int64_t iy = y0; iy < y1; iy++)
            for (int64_t ix = x0; ix < x1; ix++)
                sum = __fadd_rn(sum, image[(iy * in_w + ix) * channels]);
        /* sum / rows / cols, two IEEE divisions as on the CPU. */
        y[e] = __fdiv_rn(__fdiv_rn(sum, (float)(y1 - y0)), (float)(x1 - x0));
    }
}

mc_status mc_cuda_resize_area(mc_backend *be, const float *x, int64_t batch, int64_t in_h,
                              int64_t in_w, int64_t channels, int64_t out_h, int64_t out_w,
                              float *y, mc_err *err) {
    MC_TRY(mc_check_resize_f32("resize_area", batch, in_h, in_w, channels, out_h, out_w, err));
    if (batch == 0)
        return MC_OK;
    MC_TRY(mc_cuda_enter(be, err));
    const int64_t n = batch * out_h * out_w * channels;
    resize_area_kernel<<<mc_cuda_blocks(n, MC_CUDA_THREADS), MC_CUDA_THREADS, 0,
                         cuda_st(be)->stream>>>(x, batch, in_h, in_w, channels, out_h, out_w, y);
    MC_CUDA_LAUNCHED("resize_area_kernel", err);
    return MC_OK;
}

/* The VAR resize ops of the CPU backend (ops_list.h, var_fastvar.md B3 and
 * D3): PyTorch's bicubic interpolation (align_corners = False, A = -0.75,
 * clamped taps) and its 'area' mode (adaptive average pooling).
 *
 * Both are plain loops over output pixels, vectorised over channels (NHWC
 * keeps them contiguous) and split over output rows. Each output element is
 * computed by the same sequence of float32 operations as the CUDA kernels
 * of cuda_resize.cu, so the two backends agree bit for bit. The build is ISO
 * C11 (-std=c11), in which GCC does not contract a * b + c into an FMA: every
 * product and sum below is its own rounding. */
#include <math.h>
#include <omp.h>

#include "cpu_internal.h"
#include "../op_checks.h"

/* Below this many output elements an op runs on one thread. */
#define MC_RESIZE_PARALLEL_MIN_ELEMS 32768

/* ----------------------------------------------------------------- bicubic */

/* PyTorch's cubic convolution weights (A = -0.75) in its evaluation order:
 * w1(x) = ((A + 2) x - (A + 3)) x x + 1 for |x| <= 1,
 * w2(x) = ((A x - 5 A) x + 8 A) x - 4 A for 1 < |x| < 2. */
#define MC_CUBIC_A (-0.75f)

static float cubic_inner(float x) {
    float p = (MC_CUBIC_A + 2.0f) * x;
    p = p - (MC_CUBIC_A + 3.0f);
    p = p * x;
    p = p * x;
    return p + 1.0f;
}

static float cubic_outer(float x) {
    float p = MC_CUBIC_A * x;
    p = p - 5.0f * MC_CUBIC_A;
    p = p * x;
    p = p + 8.0f * MC_CUBIC_A;
    p = p * x;
    return p - 4.0f * MC_CUBIC_A;
}

/* The 4 taps (clamped indices) and weights of output index o on one axis. */
static void bicubic_axis(int64_t in, int64_t out, int64_t o, int64_t idx[4], float w[4]) {
    const float scale = (float)in / (float)out;
    const float centre = (float)o + 0.5f;
    const float scaled = scale * centre;
    const float src = scaled - 0.5f;
    int64_t i0 = (int64_t)floorf(src);
    if (i0 > in - 1)
        i0 = in - 1;
    float t = src - (float)i0;
    t = t < 0.0f ? 0.0f : (t > 1.0f ? 1.0f : t);
    const float t2 = 1.0f - t;
    w[0] = cubic_outer(t + 1.0f);
    w[1] = cubic_inner(t);
    w[2] = cubic_inner(t2);
    w[3] = cubic_outer(t2 + 1.0f);
    for (int j = 0; j < 4; j++) {
        int64_t i = i0 - 1 + j;
        idx[j] = i < 0 ? 0 : (i > in - 1 ? in - 1 : i);
    }
}

mc_status mc_cpu_resize_bicubic(mc_backend *be, const float *x, int64_t batch, int64_t in_h,
                                int64_t in_w, int64_t channels, int64_t out_h, int64_t out_w,
                                float *y, mc_err *err) {
    MC_TRY(mc_check_resize_f32("resize_bicubic", batch, in_h, in_w, channels, out_h, out_w, err));
    if (batch == 0)
        return MC_OK;
    /* The column taps of every output column: 4 indices (as 2 floats each)
     * and 4 weights, computed once. */
    float *table = mc_cpu_scratch(be, 0, (size_t)(12 * out_w), "resize_bicubic's column taps", err);
    if (table == NULL)
        return err->status;
    int64_t *col_idx = (int64_t *)table;
    float *col_w = table + 8 * out_w;
    for (int64_t ox = 0; ox < out_w; ox++)
        bicubic_axis(in_w, out_w, ox, col_idx + 4 * ox, col_w + 4 * ox);

    const int64_t total = batch * out_h;
#pragma omp parallel for schedule(static) num_threads(mc_cpu_threads(be)) \
    if (total * out_w * channels >= MC_RESIZE_PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < total; r++) {
        const int64_t n = r / out_h, oy = r % out_h;
        int64_t row_idx[4];
        float row_w[4];
        bicubic_axis(in_h, out_h, oy, row_idx, row_w);
        const float *image = x + n * in_h * in_w * channels;
        float *out_row = y + r * out_w * channels;
        for (int64_t ox = 0; ox < out_w; ox++) {
            const int64_t *cx = col_idx + 4 * ox;
            const float *wx = col_w + 4 * ox;
            float *o = out_row + ox * channels;
            for (int j = 0; j < 4; j++) {
                /* Along x on tap row j, then its share along y, added in
                 * tap order (the first share is stored, not added to 0). */
                const float *row = image + row_idx[j] * in_w * channels;
                const float *p0 = row + cx[0] * channels, *p1 = row + cx[1] * channels;
                const float *p2 = row + cx[2] * channels, *p3 = row + cx[3] * channels;
                const float wy = row_w[j];
                for (int64_t c = 0; c < channels; c++) {
                    float t = p0[c] * wx[0];
                    t = t + p1[c] * wx[1];
                    t = t + p2[c] * wx[2];
                    t = t + p3[c] * wx[3];
                    const float share = t * wy;
                    o[c] = j == 0 ? share : o[c] + share;
                }
            }
        }
    }
    return MC_OK;
}

/* -------------------------------------------------------------------- area */

/* Bin [start, end) of output index o (adaptive pooling, integer arithmetic). */
static void area_bin(int64_t in, int64_t out, int64_t o, int64_t *start, int64_t *end) {
    *start = (o * in) / out;
    *end = ((o + 1) * in + out - 1) / out;
}

mc_status mc_cpu_resize_area(mc_backend *be, const float *x, int64_t batch, int64_t in_h,
                             int64_t in_w, int64_t channels, int64_t out_h, int64_t out_w,
                             float *y, mc_err *err) {
    MC_TRY(mc_check_resize_f32("resize_area", batch, in_h, in_w, channels, out_h, out_w, err));
    const int64_t total = batch * out_h;
#pragma omp parallel for schedule(static) num_threads(mc_cpu_threads(be)) \
    if (total * out_w * channels >= MC_RESIZE_PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < total; r++) {
        const int64_t n = r / out_h, oy = r % out_h;
        int64_t y0, y1;
        area_bin(in_h, out_h, oy, &y0, &y1);
        const float *image = x + n * in_h * in_w * channels;
        float *out_row = y + r * out_w * channels;
        for (int64_t ox = 0; ox < out_w; ox++) {
            int64_t x0, x1;
            area_bin(in_w, out_w, ox, &x0, &x1);
            const float rows = (float)(y1 - y0), cols = (float)(x1 - x0);
            float *o = out_row + ox * channels;
            /* Per channel: the window summed row by row, as PyTorch. */
            for (int64_t c = 0; c < channels; c++)
                o[c] = 0.0f;
            for (int64_t iy = y0; iy < y1; iy++)
                for (int64_t ix = x0; ix < x1; ix++) {
                    const float *px = image + (iy * in_w + ix) * channels;
                    for (int64_t c = 0; c < channels; c++)
                        o[c] += px[c];
                }
            for (int64_t c = 0; c < channels; c++)
                o[c] = o[c] / rows / cols;
        }
    }
    return MC_OK;
}

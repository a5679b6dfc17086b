/* Window ops of the CPU backend for the FID-Inception network: the general
 * convolution (any kh x kw, stride, padding, strided NHWC in and out, fused
 * bias + ReLU), average and max pooling, and the TF1 bilinear resize.
 *
 * conv2d_ex lowers to GEMM like conv2d (cpu_conv.c): a 1x1 stride-1
 * unpadded convolution is one GEMM over all pixels read in place (lda =
 * ldx); anything else gathers chunks of output rows into an im2col matrix
 * [pixels, kh * kw * cin] ordered (ky, kx, ci) like the packed weights, then
 * runs one serial GEMM per chunk on each OpenMP thread (the one-pool rule of
 * cpu_backend.c). mc_cpu_conv2d_ex_naive keeps the plain loop definition,
 * which the op test runs against the same float64 reference.
 *
 * The pools and the resize are plain loops over output pixels, vectorised
 * over channels (NHWC keeps them contiguous) and split over output rows. */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "cpu_internal.h"
#include "../op_checks.h"

/* Below this many output elements an op runs on one thread. */
#define MC_WIN_PARALLEL_MIN_ELEMS 32768

/* Upper bound on one im2col chunk in floats (4 MiB), as in cpu_conv.c. */
#define MC_WIN_CHUNK_FLOATS ((size_t)1 << 20)

/* OpenBLAS takes 32-bit dimensions in this build. */
#define MC_WIN_BLAS_DIM_MAX ((int64_t)1 << 30)

/* im2col uses scratch slots 0..MC_WIN_MAX_THREADS-1 (the slots conv2d and
 * attention use; no op keeps scratch across calls). */
#define MC_WIN_MAX_THREADS 62

/* --------------------------------------------------------------- conv2d_ex */

mc_status mc_cpu_conv2d_ex_naive(mc_backend *be, const mc_window2d *g, const float *x, int64_t cin,
                                 int64_t ldx, const float *w, const float *bias, int64_t cout,
                                 float beta, int relu, float *y, int64_t ldy, mc_err *err) {
    MC_TRY(mc_check_window("conv2d_ex", g, 0, err));
    MC_TRY(mc_check_pixel_strides("conv2d_ex", cin, ldx, cout, ldy, err));
    MC_TRY(mc_cpu_conv_round_operands(be, &x, g->batch * g->height * g->width, cin, &ldx, &w,
                                      cout * g->kh * g->kw * cin, err));
    const int64_t oh = mc_window_out_h(g), ow = mc_window_out_w(g);
    for (int64_t n = 0; n < g->batch; n++)
        for (int64_t oy = 0; oy < oh; oy++)
            for (int64_t ox = 0; ox < ow; ox++)
                for (int64_t co = 0; co < cout; co++) {
                    float acc = 0.0f;
                    for (int ky = 0; ky < g->kh; ky++) {
                        int64_t iy = oy * g->stride_h + ky - g->pad_h;
                        if (iy < 0 || iy >= g->height)
                            continue;
                        for (int kx = 0; kx < g->kw; kx++) {
                            int64_t ix = ox * g->stride_w + kx - g->pad_w;
                            if (ix < 0 || ix >= g->width)
                                continue;
                            const float *px = x + ((n * g->height + iy) * g->width + ix) * ldx;
                            const float *wk = w + ((co * g->kh + ky) * g->kw + kx) * cin;
                            for (int64_t ci = 0; ci < cin; ci++)
                                acc += px[ci] * wk[ci];
                        }
                    }
                    float *out = y + ((n * oh + oy) * ow + ox) * ldy + co;
                    float v = (beta != 0.0f ? beta * *out : 0.0f) + acc +
                              (bias != NULL ? bias[co] : 0.0f);
                    *out = relu && v < 0.0f ? 0.0f : v;
                }
    return MC_OK;
}

static void relu_rows(float *y, int64_t rows, int64_t cout, int64_t ldy) {
    for (int64_t r = 0; r < rows; r++) {
        float *yr = y + r * ldy;
        for (int64_t c = 0; c < cout; c++)
            yr[c] = yr[c] > 0.0f ? yr[c] : 0.0f; /* NaN becomes 0, as max(x, 0) in C */
    }
}

/* im2col for output rows [row0, row0 + nrows) counted over the batch
 * (global row = image * out_h + oy): column row (r * out_w + ox) holds the
 * (ky, kx, ci) patch of that output pixel, zeros where a tap falls in the
 * padding. */
static void im2col_window(const mc_window2d *g, const float *x, int64_t cin, int64_t ldx,
                          int64_t oh, int64_t ow, int64_t row0, int64_t nrows, float *col) {
    const int64_t patch = (int64_t)g->kh * g->kw * cin;
    const size_t tap_bytes = (size_t)cin * sizeof(float);
    for (int64_t r = 0; r < nrows; r++) {
        int64_t gr = row0 + r;
        int64_t n = gr / oh, oy = gr % oh;
        const float *image = x + n * g->height * g->width * ldx;
        for (int64_t ox = 0; ox < ow; ox++) {
            float *dst = col + (r * ow + ox) * patch;
            for (int ky = 0; ky < g->kh; ky++) {
                int64_t iy = oy * g->stride_h + ky - g->pad_h;
                float *dst_row = dst + (int64_t)ky * g->kw * cin;
                if (iy < 0 || iy >= g->height) {
                    memset(dst_row, 0, (size_t)g->kw * tap_bytes);
                    continue;
                }
                const float *src_row = image + iy * g->width * ldx;
                int64_t ix0 = ox * g->stride_w - g->pad_w;
                if (ldx == cin && ix0 >= 0 && ix0 + g->kw <= g->width) {
                    /* The whole row of taps is one contiguous run. */
                    memcpy(dst_row, src_row + ix0 * cin, (size_t)g->kw * tap_bytes);
                    continue;
                }
                for (int kx = 0; kx < g->kw; kx++) {
                    int64_t ix = ix0 + kx;
                    if (ix < 0 || ix >= g->width)
                        memset(dst_row + (int64_t)kx * cin, 0, tap_bytes);
                    else
                        memcpy(dst_row + (int64_t)kx * cin, src_row + ix * ldx, tap_bytes);
                }
            }
        }
    }
}

mc_status mc_cpu_conv2d_ex(mc_backend *be, const mc_window2d *g, const float *x, int64_t cin,
                           int64_t ldx, const float *w, const float *bias, int64_t cout, float beta,
                           int relu, float *y, int64_t ldy, mc_err *err) {
    MC_TRY(mc_check_window("conv2d_ex", g, 0, err));
    MC_TRY(mc_check_pixel_strides("conv2d_ex", cin, ldx, cout, ldy, err));
    if (g->batch == 0)
        return MC_OK;
    MC_TRY(mc_cpu_conv_round_operands(be, &x, g->batch * g->height * g->width, cin, &ldx, &w,
                                      cout * g->kh * g->kw * cin, err));
    const int64_t oh = mc_window_out_h(g), ow = mc_window_out_w(g);
    const int64_t patch = (int64_t)g->kh * g->kw * cin;
    int threads = mc_cpu_threads(be);
    if (threads > MC_WIN_MAX_THREADS)
        threads = MC_WIN_MAX_THREADS;
    if (patch > MC_WIN_BLAS_DIM_MAX || ldx > MC_WIN_BLAS_DIM_MAX || ldy > MC_WIN_BLAS_DIM_MAX ||
        ow > MC_WIN_BLAS_DIM_MAX / patch)
        return mc_fail(err, MC_ERR_VALUE,
                       "conv2d_ex: one output row of %lld pixels x %lld taps is too large",
                       (long long)ow, (long long)patch);

    const int pointwise = g->kh == 1 && g->kw == 1 && g->stride_h == 1 && g->stride_w == 1 &&
                          g->pad_h == 0 && g->pad_w == 0;
    if (pointwise) {
        /* Every pixel is its own patch: one GEMM over all of them, read in
         * place, split across the team by mc_cpu_sgemm (in row blocks kept
         * under 32-bit BLAS sizes). */
        const int64_t pixels = g->batch * oh * ow;
        const int parallel = pixels * cout >= MC_WIN_PARALLEL_MIN_ELEMS;
        for (int64_t p0 = 0; p0 < pixels; p0 += MC_WIN_BLAS_DIM_MAX) {
            int64_t np = pixels - p0 < MC_WIN_BLAS_DIM_MAX ? pixels - p0 : MC_WIN_BLAS_DIM_MAX;
            float *yc = y + p0 * ldy;
            float gemm_beta = beta;
            if (bias != NULL) {
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
                for (int64_t r = 0; r < np; r++)
                    mc_cpu_prefill_bias(yc + r * ldy, 1, cout, ldy, bias, beta);
                gemm_beta = 1.0f;
            }
            mc_cpu_sgemm(threads, mc_cpu_gemm_split_of(be),
                         0, 1, np, cout, cin, 1.0f, x + p0 * ldx, ldx, w, cin, gemm_beta,
                         yc, ldy);
            if (relu) {
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
                for (int64_t r = 0; r < np; r++)
                    relu_rows(yc + r * ldy, 1, cout, ldy);
            }
        }
        return MC_OK;
    }

    /* Chunks of whole output rows, a multiple of the thread count and of
     * equal size so the static schedule is balanced. */
    const int64_t total_rows = g->batch * oh;
    const int64_t row_floats = ow * patch;
    int64_t rows_per_chunk = (int64_t)(MC_WIN_CHUNK_FLOATS / (size_t)row_floats);
    if (rows_per_chunk < 1)
        rows_per_chunk = 1;
    float *cols[MC_WIN_MAX_THREADS] = {0};
    int64_t nchunks;
    MC_TRY(mc_cpu_plan_chunks(be, total_rows, row_floats, &rows_per_chunk, &threads, cols, &nchunks, err));
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t chunk = 0; chunk < nchunks; chunk++) {
        int64_t nrows, row0 = mc_cpu_chunk_rows(chunk, rows_per_chunk, total_rows, &nrows);
        float *col = cols[omp_get_thread_num()];
        im2col_window(g, x, cin, ldx, oh, ow, row0, nrows, col);
        const int64_t pixels = nrows * ow;
        float *yc = y + row0 * ow * ldy;
        float gemm_beta = mc_cpu_prefill_bias(yc, pixels, cout, ldy, bias, beta);
        mc_cpu_sgemm(1, MC_CPU_GEMM_SPLIT_AUTO,
                     0, 1, pixels, cout, patch, 1.0f, col, patch, w, patch, gemm_beta, yc, ldy);
        if (relu)
            relu_rows(yc, pixels, cout, ldy);
    }
    return MC_OK;
}

/* ------------------------------------------------------------------- pools */

/* The taps of output (oy, ox) inside the image: rows [y0, y1), cols [x0, x1). */
static void window_span(const mc_window2d *g, int64_t oy, int64_t ox, int64_t *y0, int64_t *y1,
                        int64_t *x0, int64_t *x1) {
    int64_t ys = oy * g->stride_h - g->pad_h, xs = ox * g->stride_w - g->pad_w;
    *y0 = ys < 0 ? 0 : ys;
    *x0 = xs < 0 ? 0 : xs;
    *y1 = ys + g->kh < g->height ? ys + g->kh : g->height;
    *x1 = xs + g->kw < g->width ? xs + g->kw : g->width;
}

/* avg_pool2d (max = 0) and max_pool2d (max = 1): the same walk over the
 * output pixels, each window reduced by its op. */
static mc_status pool2d(mc_backend *be, const char *op, int max, const mc_window2d *g, const float *x,
                        int64_t channels, int64_t ldx, int count_include_pad, float *y, int64_t ldy, mc_err *err) {
    MC_TRY(mc_check_window(op, g, 1, err));
    MC_TRY(mc_check_pixel_strides(op, channels, ldx, channels, ldy, err));
    const int64_t oh = mc_window_out_h(g), ow = mc_window_out_w(g);
    const int64_t rows = g->batch * oh;
#pragma omp parallel for schedule(static) num_threads(mc_cpu_threads(be)) \
    if (rows * ow * channels >= MC_WIN_PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        int64_t n = r / oh, oy = r % oh;
        const float *image = x + n * g->height * g->width * ldx;
        for (int64_t ox = 0; ox < ow; ox++) {
            int64_t y0, y1, x0, x1;
            window_span(g, oy, ox, &y0, &y1, &x0, &x1);
            float *out = y + (r * ow + ox) * ldy;
            if (max) {
                memcpy(out, image + (y0 * g->width + x0) * ldx, (size_t)channels * sizeof(float));
                for (int64_t iy = y0; iy < y1; iy++)
                    for (int64_t ix = x0; ix < x1; ix++) {
                        const float *px = image + (iy * g->width + ix) * ldx;
                        for (int64_t c = 0; c < channels; c++) {
                            float v = px[c];
                            /* v > out or v is NaN: NaN wins, as in PyTorch. */
                            out[c] = (v > out[c] || v != v) ? v : out[c];
                        }
                    }
                continue;
            }
            for (int64_t c = 0; c < channels; c++)
                out[c] = 0.0f;
            for (int64_t iy = y0; iy < y1; iy++)
                for (int64_t ix = x0; ix < x1; ix++) {
                    const float *px = image + (iy * g->width + ix) * ldx;
                    for (int64_t c = 0; c < channels; c++)
                        out[c] += px[c];
                }
            /* Under the padding rule no window reaches past the padded
             * border, so including the padding always counts kh * kw. */
            float divisor = count_include_pad ? (float)(g->kh * g->kw) : (float)((y1 - y0) * (x1 - x0));
            for (int64_t c = 0; c < channels; c++)
                out[c] /= divisor;
        }
    }
    return MC_OK;
}

mc_status mc_cpu_avg_pool2d(mc_backend *be, const mc_window2d *g, const float *x, int64_t channels,
                            int64_t ldx, int count_include_pad, float *y, int64_t ldy,
                            mc_err *err) {
    return pool2d(be, "avg_pool2d", 0, g, x, channels, ldx, count_include_pad, y, ldy, err);
}

mc_status mc_cpu_max_pool2d(mc_backend *be, const mc_window2d *g, const float *x, int64_t channels,
                            int64_t ldx, float *y, int64_t ldy, mc_err *err) {
    return pool2d(be, "max_pool2d", 1, g, x, channels, ldx, 0, y, ldy, err);
}

/* -------------------------------------------------------------- TF1 resize */

/* One axis of the TF1 grid (see ops.h): every value in float32. */
static void tf1_axis(int64_t in, int64_t out, int64_t *lo, int64_t *hi, float *frac) {
    const float scale = (float)((double)in / (double)out);
    for (int64_t o = 0; o < out; o++) {
        float src = (float)o * scale;
        int64_t l = (int64_t)src; /* src >= 0: truncation is floor */
        if (l > in - 1)
            l = in - 1;
        lo[o] = l;
        hi[o] = l + 1 < in - 1 ? l + 1 : in - 1;
        frac[o] = src - (float)l;
    }
}

/* Floats of scratch the resize needs: grids for both axes, then two
 * float32 input rows per thread (uint8 input is converted row by row). */
mc_status mc_cpu_resize_bilinear_tf1(mc_backend *be, const void *x, mc_pixel_type type,
                                     int64_t batch, int64_t in_h, int64_t in_w, int64_t channels,
                                     int64_t out_h, int64_t out_w, int normalize, float *y,
                                     mc_err *err) {
    MC_TRY(mc_check_resize(type, batch, in_h, in_w, channels, out_h, out_w, err));
    if (batch == 0)
        return MC_OK;
    int threads = mc_cpu_threads(be);
    if (threads > MC_WIN_MAX_THREADS)
        threads = MC_WIN_MAX_THREADS;
    /* Grid: lo/hi as int64 (2 floats each) and frac, per output column and row. */
    const size_t grid_floats = (size_t)(5 * (out_h + out_w));
    const size_t row_floats = (size_t)(in_w * channels);
    float *scratch = mc_cpu_scratch(be, 0, grid_floats + 2 * row_floats * (size_t)threads,
                                    "resize_bilinear_tf1's grid and rows", err);
    if (scratch == NULL)
        return err->status;
    int64_t *lo_x = (int64_t *)scratch, *hi_x = lo_x + out_w;
    int64_t *lo_y = hi_x + out_w, *hi_y = lo_y + out_h;
    float *fx = (float *)(hi_y + out_h), *fy = fx + out_w;
    float *rows_buf = scratch + grid_floats;
    tf1_axis(in_w, out_w, lo_x, hi_x, fx);
    tf1_axis(in_h, out_h, lo_y, hi_y, fy);

    const int64_t total = batch * out_h;
#pragma omp parallel for schedule(static) num_threads(threads) \
    if (total * out_w * channels >= MC_WIN_PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < total; r++) {
        const int64_t n = r / out_h, oy = r % out_h;
        float *top_row = rows_buf + 2 * row_floats * (size_t)omp_get_thread_num();
        float *bot_row = top_row + row_floats;
        const float *t = NULL, *b = NULL;
        const int64_t t_off = (n * in_h + lo_y[oy]) * in_w * channels;
        const int64_t b_off = (n * in_h + hi_y[oy]) * in_w * channels;
        if (type == MC_PIXEL_F32) {
            t = (const float *)x + t_off;
            b = (const float *)x + b_off;
        } else {
            const uint8_t *src_t = (const uint8_t *)x + t_off, *src_b = (const uint8_t *)x + b_off;
            for (size_t i = 0; i < row_floats; i++) {
                top_row[i] = (float)src_t[i];
                bot_row[i] = (float)src_b[i];
            }
            t = top_row;
            b = bot_row;
        }
        const float dy = fy[oy];
        float *out = y + r * out_w * channels;
        for (int64_t ox = 0; ox < out_w; ox++) {
            const float dx = fx[ox];
            const float *tl = t + lo_x[ox] * channels, *tr = t + hi_x[ox] * channels;
            const float *bl = b + lo_x[ox] * channels, *br = b + hi_x[ox] * channels;
            float *o = out + ox * channels;
            for (int64_t c = 0; c < channels; c++) {
                /* Separate roundings (ISO C mode: no contraction to FMA). */
                float top_d = tr[c] - tl[c];
                float top_p = top_d * dx;
                float top = tl[c] + top_p;
                float bot_d = br[c] - bl[c];
                float bot_p = bot_d * dx;
                float bot = bl[c] + bot_p;
                float v_d = bot - top;
                float v_p = v_d * dy;
                float v = top + v_p;
                o[c] = normalize ? (v - 128.0f) / 128.0f : v;
            }
        }
    }
    return MC_OK;
}

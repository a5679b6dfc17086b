#include "op_checks.h"

#include <math.h>

#include "sampling_inline.h"

mc_status mc_check_window(const char *op, const mc_window2d *g, int pool, mc_err *err) {
    if (g->batch < 0 || g->height <= 0 || g->width <= 0)
        return mc_fail(err, MC_ERR_VALUE, "%s: bad input size [%lld, %lld, %lld]", op,
                       (long long)g->batch, (long long)g->height, (long long)g->width);
    if (g->kh <= 0 || g->kw <= 0 || g->stride_h <= 0 || g->stride_w <= 0 || g->pad_h < 0 ||
        g->pad_w < 0)
        return mc_fail(err, MC_ERR_VALUE,
                       "%s: bad window %dx%d, stride %dx%d, padding %dx%d (sizes and strides must "
                       "be positive, padding non-negative)",
                       op, g->kh, g->kw, g->stride_h, g->stride_w, g->pad_h, g->pad_w);
    if (pool && (g->pad_h > g->kh / 2 || g->pad_w > g->kw / 2))
        return mc_fail(err, MC_ERR_VALUE,
                       "%s: padding %dx%d exceeds half the %dx%d window (PyTorch's rule: every "
                       "window must overlap the image)",
                       op, g->pad_h, g->pad_w, g->kh, g->kw);
    if (g->height + 2 * (int64_t)g->pad_h < g->kh || g->width + 2 * (int64_t)g->pad_w < g->kw)
        return mc_fail(err, MC_ERR_VALUE,
                       "%s: the %dx%d window does not fit the %lldx%lld input padded by %dx%d", op,
                       g->kh, g->kw, (long long)g->height, (long long)g->width, g->pad_h, g->pad_w);
    return MC_OK;
}

mc_status mc_check_pixel_strides(const char *op, int64_t cin, int64_t ldx, int64_t cout, int64_t ldy,
                                 mc_err *err) {
    if (cin <= 0 || cout <= 0 || ldx < cin || ldy < cout)
        return mc_fail(err, MC_ERR_VALUE,
                       "%s: channels in %lld (pixel stride %lld), out %lld (pixel stride %lld): "
                       "channels must be positive and strides at least the channels",
                       op, (long long)cin, (long long)ldx, (long long)cout, (long long)ldy);
    return MC_OK;
}

mc_status mc_check_groups(int64_t channels, int groups, mc_err *err) {
    if (groups <= 0 || channels <= 0 || channels % groups != 0)
        return mc_fail(err, MC_ERR_INTERNAL, "groupnorm: %lld channels do not split into %d groups",
                       (long long)channels, groups);
    return MC_OK;
}

mc_status mc_check_resize(mc_pixel_type type, int64_t batch, int64_t in_h, int64_t in_w,
                          int64_t channels, int64_t out_h, int64_t out_w, mc_err *err) {
    if (type != MC_PIXEL_F32 && type != MC_PIXEL_U8)
        return mc_fail(err, MC_ERR_VALUE, "resize_bilinear_tf1: unknown pixel type %d", (int)type);
    if (batch < 0 || in_h <= 0 || in_w <= 0 || channels <= 0 || out_h <= 0 || out_w <= 0)
        return mc_fail(err, MC_ERR_VALUE,
                       "resize_bilinear_tf1: bad sizes: batch %lld, input %lldx%lld, %lld "
                       "channels, output %lldx%lld",
                       (long long)batch, (long long)in_h, (long long)in_w, (long long)channels,
                       (long long)out_h, (long long)out_w);
    return MC_OK;
}

/* Below 2^62 elements any index computed by the kernels fits int64. */
static int too_many_elements(int64_t a, int64_t b, int64_t c, int64_t d) {
    const int64_t limit = (int64_t)1 << 62;
    int64_t n = a;
    const int64_t f[3] = {b, c, d};
    for (int i = 0; i < 3; i++) {
        if (f[i] != 0 && n > limit / f[i])
            return 1;
        n *= f[i];
    }
    return 0;
}

mc_status mc_check_resize_f32(const char *op, int64_t batch, int64_t in_h, int64_t in_w,
                              int64_t channels, int64_t out_h, int64_t out_w, mc_err *err) {
    if (batch < 0 || in_h <= 0 || in_w <= 0 || channels <= 0 || out_h <= 0 || out_w <= 0 ||
        too_many_elements(batch, in_h, in_w, channels) ||
        too_many_elements(batch, out_h, out_w, channels))
        return mc_fail(err, MC_ERR_VALUE,
                       "%s: bad sizes: batch %lld, input %lldx%lld, %lld channels, output "
                       "%lldx%lld (sizes must be positive, batch non-negative)",
                       op, (long long)batch, (long long)in_h, (long long)in_w,
                       (long long)channels, (long long)out_h, (long long)out_w);
    /* The float32 grid (scale = float(in) / float(out), src = scale * (o + 0.5))
     * is exact in its integers only below 2^24. */
    if (in_h >= ((int64_t)1 << 24) || in_w >= ((int64_t)1 << 24) || out_h >= ((int64_t)1 << 24) ||
        out_w >= ((int64_t)1 << 24))
        return mc_fail(err, MC_ERR_VALUE, "%s: sides of 2^24 or more are not supported", op);
    return MC_OK;
}

mc_status mc_check_pivotal_rows(int64_t ldx, int64_t batch, int64_t rows, int64_t dim, int64_t keep,
                                mc_err *err) {
    if (batch < 0 || rows < 0 || dim < 0)
        return mc_fail(err, MC_ERR_VALUE, "pivotal_rows: batch, rows and dim must be >= 0, got %lld, %lld, %lld",
                       (long long)batch, (long long)rows, (long long)dim);
    if (keep < 0 || keep > rows)
        return mc_fail(err, MC_ERR_VALUE, "pivotal_rows: keep = %lld is outside [0, rows = %lld]", (long long)keep,
                       (long long)rows);
    if (ldx < dim)
        return mc_fail(err, MC_ERR_VALUE, "pivotal_rows: row stride ldx = %lld is below dim = %lld", (long long)ldx,
                       (long long)dim);
    if (rows > 0 && batch > INT32_MAX / rows)
        return mc_fail(err, MC_ERR_VALUE, "pivotal_rows: batch * rows = %lld * %lld exceeds the int32 row indices",
                       (long long)batch, (long long)rows);
    return MC_OK;
}

mc_status mc_check_logit_rows(const char *op, int64_t ld, int64_t rows, int64_t vocab, mc_err *err) {
    if (rows < 0)
        return mc_fail(err, MC_ERR_VALUE, "%s: rows must be >= 0, got %lld", op, (long long)rows);
    if (vocab < 1 || vocab > INT32_MAX)
        return mc_fail(err, MC_ERR_VALUE,
                       "%s: vocab must be in [1, %lld] (tokens are int32), got %lld", op,
                       (long long)INT32_MAX, (long long)vocab);
    if (ld < vocab)
        return mc_fail(err, MC_ERR_VALUE, "%s: row stride ld = %lld is below vocab = %lld", op,
                       (long long)ld, (long long)vocab);
    return MC_OK;
}

mc_status mc_check_top_p(float top_p, mc_err *err) {
    if (isnan(top_p))
        return mc_fail(err, MC_ERR_VALUE, "sample_tokens: top_p is NaN");
    return MC_OK;
}

mc_status mc_check_gumbel(float logit_scale, float tau, int64_t ldp, int64_t vocab, mc_err *err) {
    if (!(isfinite(logit_scale) && logit_scale > 0.0f) || !(isfinite(tau) && tau > 0.0f))
        return mc_fail(err, MC_ERR_VALUE,
                       "gumbel_softmax: logit_scale = %g and tau = %g must be finite and positive",
                       (double)logit_scale, (double)tau);
    if (ldp < vocab)
        return mc_fail(err, MC_ERR_VALUE, "gumbel_softmax: probs row stride ldp = %lld is below vocab = %lld",
                       (long long)ldp, (long long)vocab);
    return MC_OK;
}

mc_status mc_fail_row_fault(const char *op, int64_t row, int fault, mc_err *err) {
    const char *what = fault == MC_ROW_NAN       ? "contains NaN"
                       : fault == MC_ROW_POS_INF ? "contains +inf (its softmax is not defined)"
                                                 : "has no finite entry (every logit is -inf: its "
                                                   "softmax is not defined)";
    return mc_fail(err, MC_ERR_NUMERIC, "%s: row %lld of the logits %s", op, (long long)row, what);
}

/* Argument checks every backend applies before an op runs, in one place so the
 * CPU and CUDA backends refuse the same calls with the same messages. Plain C;
 * the CUDA sources include it inside extern "C" (see cuda_internal.h). */
#ifndef MC_OP_CHECKS_H
#define MC_OP_CHECKS_H

#include <stdint.h>

#include "../core/mc_core.h"
#include "ops.h"

/* Window geometry of conv2d_ex (pool = 0) and the pools (pool = 1: padding at
 * most half the window, PyTorch's rule). */
mc_status mc_check_window(const char *op, const mc_window2d *g, int pool, mc_err *err);

/* Channel counts positive, pixel strides at least the channels. */
mc_status mc_check_pixel_strides(const char *op, int64_t cin, int64_t ldx, int64_t cout, int64_t ldy,
                                 mc_err *err);

/* groupnorm: channels split evenly into groups. */
mc_status mc_check_groups(int64_t channels, int groups, mc_err *err);

/* resize_bilinear_tf1: a known pixel type and positive sizes (batch may be 0). */
mc_status mc_check_resize(mc_pixel_type type, int64_t batch, int64_t in_h, int64_t in_w,
                          int64_t channels, int64_t out_h, int64_t out_w, mc_err *err);

/* resize_bicubic / resize_area (named by `op`): positive sizes (batch may
 * be 0) and a tensor size that fits int64 with room for index arithmetic. */
mc_status mc_check_resize_f32(const char *op, int64_t batch, int64_t in_h, int64_t in_w,
                              int64_t channels, int64_t out_h, int64_t out_w, mc_err *err);

/* sample_tokens and gumbel_softmax: rows >= 0, 1 <= vocab <= INT32_MAX (the
 * tokens are int32), ld >= vocab. */
mc_status mc_check_logit_rows(const char *op, int64_t ld, int64_t rows, int64_t vocab, mc_err *err);

/* sample_tokens: top_p not NaN (any other value is a filter or none). */
mc_status mc_check_top_p(float top_p, mc_err *err);

/* gumbel_softmax: logit_scale and tau finite and positive, ldp >= vocab. */
mc_status mc_check_gumbel(float logit_scale, float tau, int64_t ldp, int64_t vocab, mc_err *err);

/* pivotal_rows: batch, rows, dim >= 0, 0 <= keep <= rows, ldx >= dim, and
 * batch * rows row indices that fit int32. */
mc_status mc_check_pivotal_rows(int64_t ldx, int64_t batch, int64_t rows, int64_t dim, int64_t keep,
                                mc_err *err);

/* The row fault (sampling_inline.h: MC_ROW_NAN, MC_ROW_POS_INF or
 * MC_ROW_NO_FINITE) of row `row` of the logits of `op` as an MC_ERR_NUMERIC
 * failure, in the words both backends use. */
mc_status mc_fail_row_fault(const char *op, int64_t row, int fault, mc_err *err);

#endif

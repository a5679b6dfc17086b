/* The op list: every compute op of the backend table (ops.h), written once.
 *
 * Each entry is
 *
 *   MC_OP(name, where, (parameters), (arguments), flops)
 *
 *   name        the mc_ops member, the mc_<backend>_<name> entry points, the
 *               op id MC_OP_ID_<name> and the name run_op and messages use;
 *   where       ALL (every backend implements it) or CPU_ONLY (a new op that
 *               landed on the CPU first: the CPU and guard backends run it,
 *               the CUDA table leaves it unsupported, and calling it there
 *               fails with an mc_err naming the op and the backend);
 *   parameters  the op's parameter list, `mc_backend *be` first and
 *               `mc_err *err` last; every op returns mc_status;
 *   arguments   the same names in order, to pass the call on (the guard
 *               backend's wrappers);
 *   flops       FLOPs of one call as an int64_t expression of the parameters,
 *               with the convention of marcache/flops.py and
 *               csrc/runtime/flops.c (mar.md 13): GEMMs and attention
 *               matmuls only, 2 FLOPs per multiply-add, norms, softmax and
 *               elementwise work not counted (0). The guard backend adds it
 *               up per call (mc_backend.dispatched_flops), so the tests can
 *               hold the FLOP telemetry to the work actually dispatched.
 *
 * Users define MC_OP, include this file, and get it undefined again:
 *
 *   #define MC_OP(name, where, params, args, flops) mc_status mc_cpu_##name params;
 *   #include "ops_list.h"
 *
 * The order is the table's and op_names()'s order. All tensors are row-major
 * float32 in the backend's memory unless said otherwise; "ld" arguments are
 * row strides in elements. No include guard: it is meant to be included once
 * per expansion. */

/* C[m,n] = alpha * op(A) op(B) + beta * C; op(X) = X or X^T. */
MC_OP(gemm, ALL,
      (mc_backend *be, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, float alpha,
       const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c,
       int64_t ldc, mc_err *err),
      (be, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, err),
      2 * m * n * k)

/* y = beta * y + act(x W^T + bias). x [rows, in], W [out, in] contiguous
 * (nn.Linear layout) with elements of be->linear_wtype, bias [out] or
 * NULL. beta is 0 or 1; with beta = 1 act must be NONE (residual
 * accumulation). */
MC_OP(linear, ALL,
      (mc_backend *be, const float *x, int64_t ldx, int64_t rows, int64_t in, const void *w,
       const float *bias, int64_t out, mc_act act, float beta, float *y, int64_t ldy,
       mc_err *err),
      (be, x, ldx, rows, in, w, bias, out, act, beta, y, ldy, err),
      2 * rows * in * out)

/* y = LN(x) over dim with biased variance and eps; then * w + b when w
 * (and b) are non-NULL; then * (1 + scale[m]) + shift[m] with m = r /
 * mod_period when shift and scale (always both) are non-NULL (adaLN, rows
 * of length dim with stride ld_mod; mod_period >= 1 rows share one, as the
 * tokens of one sequence share its adaLN row). Statistics in double. y may
 * be x. */
MC_OP(layernorm, ALL,
      (mc_backend *be, const float *x, int64_t ldx, int64_t rows, int64_t dim, const float *w,
       const float *b, float eps, const float *shift, const float *scale, int64_t ld_mod,
       int64_t mod_period, float *y, int64_t ldy, mc_err *err),
      (be, x, ldx, rows, dim, w, b, eps, shift, scale, ld_mod, mod_period, y, ldy, err),
      0)

/* In place: x = act(x). */
MC_OP(activation, ALL,
      (mc_backend *be, mc_act act, float *x, int64_t ld, int64_t rows, int64_t dim, mc_err *err),
      (be, act, x, ld, rows, dim, err),
      0)

/* y[r, :] += v[r % period, :]  (positional embeddings, per-step vectors). */
MC_OP(add_rows, ALL,
      (mc_backend *be, float *y, int64_t ldy, int64_t rows, int64_t dim, const float *v,
       int64_t ldv, int64_t period, mc_err *err),
      (be, y, ldy, rows, dim, v, ldv, period, err),
      0)

/* y[r] += gate[r / gate_period] * u[r], elementwise over [rows, dim] (adaLN
 * gated residual; gate_period >= 1 rows share one gate row, as a
 * sequence's tokens share its gate). */
MC_OP(gated_add, ALL,
      (mc_backend *be, float *y, int64_t ldy, const float *u, int64_t ldu, const float *gate,
       int64_t ldg, int64_t gate_period, int64_t rows, int64_t dim, mc_err *err),
      (be, y, ldy, u, ldu, gate, ldg, gate_period, rows, dim, err),
      0)

/* dst[i, :] = src[idx[i], :] for i < rows (idx in backend memory). */
MC_OP(gather_rows, ALL,
      (mc_backend *be, const float *src, int64_t lds, const int32_t *idx, int64_t rows,
       int64_t dim, float *dst, int64_t ldd, mc_err *err),
      (be, src, lds, idx, rows, dim, dst, ldd, err),
      0)

/* dst[idx[i], :] = src[i, :]. */
MC_OP(scatter_rows, ALL,
      (mc_backend *be, const float *src, int64_t lds, const int32_t *idx, int64_t rows,
       int64_t dim, float *dst, int64_t ldd, mc_err *err),
      (be, src, lds, idx, rows, dim, dst, ldd, err),
      0)

/* Multi-head attention, no mask: for each batch item b and head h,
 * out_bh = softmax(scale * q_bh k_bh^T) v_bh with keys/values the
 * concatenation of the segments. q row i of item b, head h is at
 * q + b * q_bstride + i * ldq + h * head_dim; out likewise.
 * With a 16-bit linear_wtype and mc_attention_is_16bit (head_dim a
 * multiple of 16 up to 128) it runs as autocast's fused attention does:
 * q, k and v are rounded to the 16-bit type, scores, softmax and sums
 * are float32, and the probabilities are rounded to the 16-bit type
 * before they weight v. FLOPs: q k^T and p v, 2 each per query, key and
 * channel. */
MC_OP(attention, ALL,
      (mc_backend *be, int64_t batch, int64_t nq, int heads, int head_dim, float scale,
       const float *q, int64_t ldq, int64_t q_bstride, const mc_kv_segment *segs, int nsegs,
       float *out, int64_t ldo, int64_t o_bstride, mc_err *err),
      (be, batch, nq, heads, head_dim, scale, q, ldq, q_bstride, segs, nsegs, out, ldo,
       o_bstride, err),
      4 * batch * nq * mc_kv_segment_rows(segs, nsegs) * heads * (int64_t)head_dim)

/* GroupNorm over NHWC [batch, hw, channels] (statistics per image and
 * group over hw x channels/groups, biased variance), affine, optional
 * swish afterwards. y may be x. w and b may be NULL (no affine). */
MC_OP(groupnorm, ALL,
      (mc_backend *be, const float *x, int64_t batch, int64_t hw, int64_t channels, int groups,
       const float *w, const float *b, float eps, int swish, float *y, mc_err *err),
      (be, x, batch, hw, channels, groups, w, b, eps, swish, y, err),
      0)

/* 2-D convolution, stride 1, zero padding ksize / 2, NHWC in and out.
 * w is packed [cout, ksize, ksize, cin] (the loader repacks PyTorch's
 * [cout, cin, kh, kw]); bias [cout] or NULL. y = beta * y + conv(x).
 * (The VAE's and Inception's convolutions are outside the MAR FLOP
 * convention: not counted.) */
MC_OP(conv2d, ALL,
      (mc_backend *be, const float *x, int64_t batch, int64_t height, int64_t width,
       int64_t cin, const float *w, const float *bias, int64_t cout, int ksize, float beta,
       float *y, mc_err *err),
      (be, x, batch, height, width, cin, w, bias, cout, ksize, beta, y, err),
      0)

/* Nearest-neighbour x2 upsampling, NHWC [batch, h, w, c] -> [batch, 2h, 2w, c]. */
MC_OP(upsample_nearest2x, ALL,
      (mc_backend *be, const float *x, int64_t batch, int64_t height, int64_t width,
       int64_t channels, float *y, mc_err *err),
      (be, x, batch, height, width, channels, y, err),
      0)

/* Classifier-free guidance on eps: out = u + scale * (c - u) for the
 * first `channels` columns of each row. */
MC_OP(cfg_combine, ALL,
      (mc_backend *be, const float *cond, int64_t ldc, const float *uncond, int64_t ldu,
       int64_t rows, int channels, float scale, float *out, int64_t ldo, mc_err *err),
      (be, cond, ldc, uncond, ldu, rows, channels, scale, out, ldo, err),
      0)

/* One DDPM ancestral step with LEARNED_RANGE variance, in place on
 * x [rows, channels]: eps and v are the first and second `channels`
 * columns of model output rows (stride ld_out); noise [rows, channels]
 * may be NULL when coefs->noise_scale == 0. */
MC_OP(ddpm_step, ALL,
      (mc_backend *be, float *x, int64_t rows, int channels, const float *eps, int64_t ld_eps,
       const float *v, int64_t ld_v, const float *noise, const mc_ddpm_coefs *coefs,
       mc_err *err),
      (be, x, rows, channels, eps, ld_eps, v, ld_v, noise, coefs, err),
      0)

/* Philox normals for rows of tokens (see core/philox.h): row i gets the
 * `channels` normals of (seed, image[i], stream, position[i], step). */
MC_OP(token_normals, ALL,
      (mc_backend *be, uint64_t seed, uint32_t stream, uint32_t step, const uint32_t *image,
       const uint32_t *position, int64_t rows, int channels, float *out, mc_err *err),
      (be, seed, stream, step, image, position, rows, channels, out, err),
      0)

/* y = a * x + b * y over [rows, cols] (strided). With b == 0, y is only
 * written (copies, scaled copies); cache policies use it for deltas. */
MC_OP(axpby, ALL,
      (mc_backend *be, float a, const float *x, int64_t ldx, float b, float *y, int64_t ldy,
       int64_t rows, int64_t cols, mc_err *err),
      (be, a, x, ldx, b, y, ldy, rows, cols, err),
      0)

/* out[r] = mean over heads h of cos(a_rh, b_rh), where a_rh is the h-th
 * head_dim slice of row r; cos = a.b / max(|a| |b|, 1e-8) (PyTorch's
 * cosine_similarity). LazyMAR ranks tokens by it (row-wise dot products,
 * not a matmul: not counted). */
MC_OP(cosine_rows, ALL,
      (mc_backend *be, const float *a, int64_t lda, const float *b, int64_t ldb, int64_t rows,
       int heads, int head_dim, float *out, mc_err *err),
      (be, a, lda, b, ldb, rows, heads, head_dim, out, err),
      0)

/* Attention mass: for each batch item b, out[b, j] = sum over heads h
 * and the nq query rows i of softmax_j(scale * q_bhi . k_bhj), over the
 * `keys` key rows (layouts as in attention). MARche picks the rows that
 * the tokens being generated attend to most. FLOPs: q k^T only. */
MC_OP(attention_mass, ALL,
      (mc_backend *be, int64_t batch, int64_t nq, int heads, int head_dim, float scale,
       const float *q, int64_t ldq, int64_t q_bstride, const float *k, int64_t ldk,
       int64_t k_bstride, int64_t keys, float *out, mc_err *err),
      (be, batch, nq, heads, head_dim, scale, q, ldq, q_bstride, k, ldk, k_bstride, keys, out,
       err),
      2 * batch * nq * keys * heads * (int64_t)head_dim)

/* ---- FID-Inception ops (eval_and_formats.md 3-4) ---- */

/* General 2-D convolution over NHWC with the geometry of `g` (any
 * kh x kw, strides, zero padding): y = relu?(beta * y + conv(x) + bias).
 * x has cin channels at pixel stride ldx; y has cout channels at pixel
 * stride ldy and size mc_window_out_h/w(g). w is packed
 * [cout, kh, kw, cin] (mc_bind's MC_BIND_CONV_OHWI); bias [cout] or NULL;
 * relu non-zero clamps the final sum at 0. beta == 0 never reads y. */
MC_OP(conv2d_ex, ALL,
      (mc_backend *be, const mc_window2d *g, const float *x, int64_t cin, int64_t ldx,
       const float *w, const float *bias, int64_t cout, float beta, int relu, float *y,
       int64_t ldy, mc_err *err),
      (be, g, x, cin, ldx, w, bias, cout, beta, relu, y, ldy, err),
      0)

/* Average pooling over NHWC windows of `g` (pad_h <= kh / 2 and
 * pad_w <= kw / 2, as PyTorch requires). The divisor is the number of
 * window taps inside the image when count_include_pad == 0 (TF's
 * average pool, FID-Inception), else kh * kw. Sums in float, one
 * division per output. With kh = height, kw = width, no padding it is
 * the global average pool. */
MC_OP(avg_pool2d, ALL,
      (mc_backend *be, const mc_window2d *g, const float *x, int64_t channels, int64_t ldx,
       int count_include_pad, float *y, int64_t ldy, mc_err *err),
      (be, g, x, channels, ldx, count_include_pad, y, ldy, err),
      0)

/* Max pooling over NHWC windows of `g` (same padding rule); padded taps
 * never win (PyTorch's -inf padding). NaN propagates. */
MC_OP(max_pool2d, ALL,
      (mc_backend *be, const mc_window2d *g, const float *x, int64_t channels, int64_t ldx,
       float *y, int64_t ldy, mc_err *err),
      (be, g, x, channels, ldx, y, ldy, err),
      0)

/* TF1 bilinear resize, align_corners = False, half_pixel_centers =
 * False (torch-fidelity's 'slow' method; eval_and_formats.md 4): x is
 * contiguous NHWC [batch, in_h, in_w, channels] of float32 or uint8
 * (converted to float32 first); y [batch, out_h, out_w, channels] float32.
 * Per axis scale = float32(in / out), src = float32(o) * scale in
 * float32, lo = floor(src), hi = min(lo + 1, in - 1), d = src - lo;
 * top = a + (b - a) * dx on rows lo_y and hi_y, y = top + (bottom - top)
 * * dy, every step rounded to float32 (no fused multiply-add). With
 * normalize, y = (y - 128) / 128 afterwards (the Inception input scale). */
MC_OP(resize_bilinear_tf1, ALL,
      (mc_backend *be, const void *x, mc_pixel_type type, int64_t batch, int64_t in_h,
       int64_t in_w, int64_t channels, int64_t out_h, int64_t out_w, int normalize, float *y,
       mc_err *err),
      (be, x, type, batch, in_h, in_w, channels, out_h, out_w, normalize, y, err),
      0)

/* ---- VAR model ops (var_fastvar.md A5) ---- */

/* In place, per row r and head h: the head slice v = x[r, h*hd : (h+1)*hd]
 * becomes v / max(||v||_2, 1e-12) * head_scale[h] (F.normalize, then the
 * per-head query scale of VAR's attn_l2_norm; head_scale is backend
 * memory [heads], or NULL for 1). The norm is accumulated in double and
 * each element computed in double and rounded once. Rows have stride ld
 * (the q or k part of a fused qkv). */
MC_OP(head_l2norm, ALL,
      (mc_backend *be, float *x, int64_t ld, int64_t rows, int heads, int head_dim,
       const float *head_scale, mc_err *err),
      (be, x, ld, rows, heads, head_dim, head_scale, err),
      0)

/* ---- VAR resize ops (var_fastvar.md B3, D3) ---- */

/* PyTorch's F.interpolate(mode='bicubic', align_corners=False), no
 * antialias, output size given: x contiguous NHWC [batch, in_h, in_w,
 * channels] -> y [batch, out_h, out_w, channels]. Per axis, in float32 as
 * PyTorch computes it: scale = float(in) / float(out), src = scale *
 * (o + 0.5) - 0.5, i0 = min(floor(src), in - 1), t = clamp(src - i0, 0, 1);
 * taps i0 - 1 .. i0 + 2, each clamped to [0, in - 1], with the A = -0.75
 * cubic-convolution weights of t. Separable: each of the 4 tap rows is
 * interpolated along x, then the 4 results along y (sums in tap order,
 * every product and sum its own float32 rounding). Not clamped: overshoot
 * stays. in == out is the identity; a 1x1 input gives a constant map. */
MC_OP(resize_bicubic, ALL,
      (mc_backend *be, const float *x, int64_t batch, int64_t in_h, int64_t in_w,
       int64_t channels, int64_t out_h, int64_t out_w, float *y, mc_err *err),
      (be, x, batch, in_h, in_w, channels, out_h, out_w, y, err),
      0)

/* PyTorch's F.interpolate(mode='area') = adaptive average pooling, for any
 * in/out sizes (down- and up-sampling): output cell (i, j) is the mean of
 * input rows [floor(i in_h / out_h), ceil((i + 1) in_h / out_h)) and columns
 * likewise (integer arithmetic). NHWC as resize_bicubic. Summed in float32
 * row by row, then divided by the row count and then by the column count
 * (PyTorch's sum / kh / kw). */
MC_OP(resize_area, ALL,
      (mc_backend *be, const float *x, int64_t batch, int64_t in_h, int64_t in_w,
       int64_t channels, int64_t out_h, int64_t out_w, float *y, mc_err *err),
      (be, x, batch, in_h, in_w, channels, out_h, out_w, y, err),
      0)

/* ---- VAR ops ---- */

/* VAR's token sampler (helpers.py sample_with_top_k_top_p_), one token per
 * row of logits [rows, vocab] (row stride ld), in place on the logits:
 *   a) 0 < top_k < vocab: thr = the top_k-th largest logit of the row
 *      (counting repeats); every logit < thr becomes -inf, so ties at thr
 *      survive and more than top_k entries may remain. top_k <= 0 or
 *      top_k >= vocab: no top-k filter (k >= vocab keeps everything, where
 *      torch.topk would refuse k > vocab).
 *   b) 0 < top_p < 1, on the row after a): m = the row's largest logit,
 *      e_j = exp((double)l_j - m) (0 for -inf), S = sum of e_j in vocabulary
 *      order, p_j = e_j / S; the entries in ascending (value, index) order
 *      (a stable order: equal values keep vocabulary order, -0 equals +0),
 *      c = running sum of p in that order; every entry whose c <= 1 - top_p
 *      (in double) becomes -inf, except the last (largest) of the order.
 *      top_p <= 0 or top_p >= 1: no top-p filter.
 *   c) u = w / 2^32 with w = word 0 of mc_philox_block(seed, image[r],
 *      MC_STREAM_VAR_SAMPLE, position[r], step, block 0); q_j =
 *      exp((double)l_j - m) (0 for -inf) of the filtered row, c_j the running
 *      sum in vocabulary order; out[r] = the first j with c_j > u * c_{V-1},
 *      or, if rounding leaves none, the last j with q_j > 0.
 * All sums are sequential in double in the orders stated, so the float64
 * reference reproduces the tokens and the masked logits exactly; CUDA's
 * double exp may differ from the CPU's by an ulp, which can change a
 * decision only at a tie within that rounding. The masked logits stay in
 * `logits` (more_smooth's gumbel_softmax reads them, as the official
 * in-place helper leaves them). out: int32 [rows]. image and position:
 * uint32 [rows]. Refused (MC_ERR_VALUE): rows < 0, vocab < 1 or above
 * INT32_MAX, ld < vocab, NaN top_p. A row holding NaN or +inf, or no
 * finite logit, fails with MC_ERR_NUMERIC naming the op and the row; the
 * CPU checks every row before it changes any, the CUDA backend reports the
 * first such row at its next download (the stream is not waited on here;
 * the row's token is then 0 and its logits are left as they were). */
MC_OP(sample_tokens, ALL,
      (mc_backend *be, float *logits, int64_t ld, int64_t rows, int64_t vocab, int64_t top_k,
       float top_p, uint64_t seed, uint32_t step, const uint32_t *image, const uint32_t *position,
       int32_t *out, mc_err *err),
      (be, logits, ld, rows, vocab, top_k, top_p, seed, step, image, position, out, err),
      0)

/* VAR's more_smooth embedding weights (helpers.py gumbel_softmax_with_rng,
 * hard = False): probs[r, j] = softmax_j((logits[r, j] * logit_scale +
 * g_rj) / tau) with g = -log(E), E = -log(u), u = (w + 0.5) / 2^32, w =
 * word j % 4 of mc_philox_block(seed, image[r], MC_STREAM_VAR_GUMBEL,
 * position[r], step, block j / 4). Computed in double, rounded once to
 * float; a -inf logit (one that sample_tokens removed) gets probability 0.
 * probs [rows, vocab] with row stride ldp. Refused (MC_ERR_VALUE): rows < 0,
 * vocab < 1, ld or ldp < vocab, logit_scale or tau not finite and positive.
 * A row holding NaN or +inf, or no finite logit, fails with
 * MC_ERR_NUMERIC as in sample_tokens (CUDA: at its next download; the
 * row's probs are then left unwritten). FLOPs 0: the probs x codebook GEMM
 * that follows is counted by gemm. */
MC_OP(gumbel_softmax, ALL,
      (mc_backend *be, const float *logits, int64_t ld, int64_t rows, int64_t vocab,
       float logit_scale, float tau, uint64_t seed, uint32_t step, const uint32_t *image,
       const uint32_t *position, float *probs, int64_t ldp, mc_err *err),
      (be, logits, ld, rows, vocab, logit_scale, tau, seed, step, image, position, probs, ldp,
       err),
      0)

/* ---- FastVAR ops (var_fastvar.md D2) ---- */

/* FastVAR's pivotal token selection. x holds `batch` sequences of `rows`
 * rows of `dim` channels: row r of sequence b at x + (b * rows + r) * ldx.
 * Per sequence, in double: mu = the mean of its rows (each channel summed
 * in row order, then divided by rows), score_r = sum over channels c in
 * order of (x_rc - mu_c)^2 (the squared distance to the "DC" token). The
 * `keep` rows with the largest scores are kept, a tie going to the lower
 * row index: row r is kept when fewer than `keep` rows s have score_s >
 * score_r, or score_s == score_r and s < r (a NaN score counts as larger
 * than any number and equal to another NaN, so the order stays total and
 * exactly `keep` rows are kept). out int32 [batch * keep]: sequence b's
 * kept rows at [b * keep, (b + 1) * keep) in ascending (raster) order,
 * written as b * rows + r, the row's index among all batch * rows rows
 * (what gather_rows and scatter_rows take). Refused (MC_ERR_VALUE): batch,
 * rows or dim < 0, keep outside [0, rows], ldx < dim, batch * rows above
 * INT32_MAX. FLOPs 0: a reduction, no GEMM (spec Part E counts GEMMs and
 * attention only). */
MC_OP(pivotal_rows, ALL,
      (mc_backend *be, const float *x, int64_t ldx, int64_t batch, int64_t rows, int64_t dim,
       int64_t keep, int32_t *out, mc_err *err),
      (be, x, ldx, batch, rows, dim, keep, out, err),
      0)

#undef MC_OP

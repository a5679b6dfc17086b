/* The backend seam: one table of primitive ops per backend. Models call only
 * these (through be->ops), so a second backend (CUDA) plugs in by filling the
 * same table. All tensors are row-major float32 in the backend's memory;
 * "ld" arguments are row strides in elements, so ops can read column slices
 * (one attention head, the q part of a fused qkv) without copies.
 *
 * Every op returns MC_OK or an error recorded in `err`. Ops never allocate
 * per call in steady state: scratch comes from the backend's reusable pool. */
#ifndef MC_OPS_H
#define MC_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "../core/half.h"
#include "../core/mc_core.h"

typedef struct mc_backend mc_backend;
typedef struct mc_ops mc_ops;

typedef enum mc_act { MC_ACT_NONE = 0, MC_ACT_GELU = 1, MC_ACT_SILU = 2 } mc_act;

/* Element type of the weights `linear` reads on a backend (its
 * linear_wtype). With BF16 or F16 the layer runs as PyTorch's autocast
 * does: x is rounded to the 16-bit type, products are summed in float32,
 * bias and activation are applied in float32. Every other op and tensor
 * stays float32. */
typedef enum mc_wtype { MC_WTYPE_F32 = 0, MC_WTYPE_BF16 = 1, MC_WTYPE_F16 = 2 } mc_wtype;

static inline size_t mc_wtype_size(mc_wtype t) { return t == MC_WTYPE_F32 ? 4 : 2; }

static inline const char *mc_wtype_name(mc_wtype t) {
    return t == MC_WTYPE_BF16 ? "bf16" : t == MC_WTYPE_F16 ? "fp16" : "fp32";
}

/* Conversions of one value for a 16-bit type t (BF16 or F16; core/half.h):
 * the stored bits, their value, and a float rounded to the type. */
static inline uint16_t mc_wtype_pack(mc_wtype t, float v) {
    return t == MC_WTYPE_BF16 ? mc_f32_to_bf16(v) : mc_f32_to_f16(v);
}
static inline float mc_wtype_unpack(mc_wtype t, uint16_t h) {
    return t == MC_WTYPE_BF16 ? mc_bf16_to_f32(h) : mc_f16_to_f32(h);
}
static inline float mc_wtype_round(mc_wtype t, float v) { return mc_wtype_unpack(t, mc_wtype_pack(t, v)); }

/* One block of keys/values that queries attend to. Row r of batch item b,
 * head h starts at k + b * batch_stride + r * ld + h * head_dim (same for v).
 * Attention over a list of segments equals attention over their row
 * concatenation; backends merge per-segment softmax partials exactly (running
 * max and sum of exponentials), so cached and fresh K/V never need copying
 * into one buffer. A segment may have rows == 0. */
typedef struct mc_kv_segment {
    const float *k;
    const float *v;
    int64_t rows;
    int64_t ld;
    int64_t batch_stride;
} mc_kv_segment;

/* Per-diffusion-step coefficients of the DDPM ancestral update (mar.md 6.4),
 * rounded from the float64 tables to float32 at use, as the reference does. */
typedef struct mc_ddpm_coefs {
    float sqrt_recip_alphas_cumprod;
    float sqrt_recipm1_alphas_cumprod;
    float posterior_mean_coef1;
    float posterior_mean_coef2;
    float log_beta;              /* max_log of LEARNED_RANGE */
    float posterior_log_variance; /* min_log (clipped posterior log variance) */
    float noise_scale;            /* temperature, or 0 at the last step */
} mc_ddpm_coefs;

/* Geometry of a 2-D window op over NHWC images (conv2d_ex and the pools):
 * input [batch, height, width, .], a kh x kw window moved by
 * (stride_h, stride_w) over the input zero-padded by pad_h rows above and
 * below and pad_w columns left and right. Output size, as PyTorch (floor):
 *   out_h = (height + 2 pad_h - kh) / stride_h + 1, out_w alike.
 * Pixel strides: pixel (n, i, j) of x starts at x + ((n * height + i) * width
 * + j) * ldx, so x may be a column slice of a wider NHWC buffer (ldx >= its
 * channels); the output likewise with ldy (Inception's branches write their
 * channels straight into the concatenated block output this way). */
typedef struct mc_window2d {
    int64_t batch, height, width;
    int kh, kw;
    int stride_h, stride_w;
    int pad_h, pad_w;
} mc_window2d;

static inline int64_t mc_window_out_h(const mc_window2d *g) {
    return (g->height + 2 * (int64_t)g->pad_h - g->kh) / g->stride_h + 1;
}
static inline int64_t mc_window_out_w(const mc_window2d *g) {
    return (g->width + 2 * (int64_t)g->pad_w - g->kw) / g->stride_w + 1;
}

/* Element type of image input to resize_bilinear_tf1. */
typedef enum mc_pixel_type { MC_PIXEL_F32 = 0, MC_PIXEL_U8 = 1 } mc_pixel_type;

struct mc_ops {
    const char *name;
    void (*destroy)(mc_backend *be);

    /* memory */
    void *(*alloc)(mc_backend *be, size_t bytes, mc_err *err);
    void (*release)(mc_backend *be, void *ptr);
    mc_status (*upload)(mc_backend *be, void *dst, const void *host_src, size_t bytes, mc_err *err);
    mc_status (*download)(mc_backend *be, void *host_dst, const void *src, size_t bytes, mc_err *err);
    mc_status (*copy)(mc_backend *be, void *dst, const void *src, size_t bytes, mc_err *err);

    /* C[m,n] = alpha * op(A) op(B) + beta * C; op(X) = X or X^T. */
    mc_status (*gemm)(mc_backend *be, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                      float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
                      float beta, float *c, int64_t ldc, mc_err *err);

    /* y = beta * y + act(x W^T + bias). x [rows, in], W [out, in] contiguous
     * (nn.Linear layout) with elements of be->linear_wtype, bias [out] or
     * NULL. beta is 0 or 1; with beta = 1 act must be NONE (residual
     * accumulation). */
    mc_status (*linear)(mc_backend *be, const float *x, int64_t ldx, int64_t rows, int64_t in,
                        const void *w, const float *bias, int64_t out, mc_act act, float beta,
                        float *y, int64_t ldy, mc_err *err);

    /* y = LN(x) over dim with biased variance and eps; then * w + b when w
     * (and b) are non-NULL; then * (1 + scale[r]) + shift[r] when shift and
     * scale (always both) are non-NULL (adaLN, rows of length dim with stride
     * ld_mod). Statistics in double. y may be x. */
    mc_status (*layernorm)(mc_backend *be, const float *x, int64_t ldx, int64_t rows, int64_t dim,
                           const float *w, const float *b, float eps, const float *shift,
                           const float *scale, int64_t ld_mod, float *y, int64_t ldy, mc_err *err);

    /* In place: x = act(x). */
    mc_status (*activation)(mc_backend *be, mc_act act, float *x, int64_t ld, int64_t rows,
                            int64_t dim, mc_err *err);

    /* y[r, :] += v[r % period, :]  (positional embeddings, per-step vectors). */
    mc_status (*add_rows)(mc_backend *be, float *y, int64_t ldy, int64_t rows, int64_t dim,
                          const float *v, int64_t ldv, int64_t period, mc_err *err);

    /* y += gate * u, elementwise over [rows, dim] (adaLN gated residual). */
    mc_status (*gated_add)(mc_backend *be, float *y, int64_t ldy, const float *u, int64_t ldu,
                           const float *gate, int64_t ldg, int64_t rows, int64_t dim, mc_err *err);

    /* dst[i, :] = src[idx[i], :] for i < rows (idx in backend memory). */
    mc_status (*gather_rows)(mc_backend *be, const float *src, int64_t lds, const int32_t *idx,
                             int64_t rows, int64_t dim, float *dst, int64_t ldd, mc_err *err);
    /* dst[idx[i], :] = src[i, :]. */
    mc_status (*scatter_rows)(mc_backend *be, const float *src, int64_t lds, const int32_t *idx,
                              int64_t rows, int64_t dim, float *dst, int64_t ldd, mc_err *err);

    /* Multi-head attention, no mask: for each batch item b and head h,
     * out_bh = softmax(scale * q_bh k_bh^T) v_bh with keys/values the
     * concatenation of the segments. q row i of item b, head h is at
     * q + b * q_bstride + i * ldq + h * head_dim; out likewise.
     * With a 16-bit linear_wtype and mc_attention_is_16bit (head_dim a
     * multiple of 16 up to 128) it runs as autocast's fused attention does:
     * q, k and v are rounded to the 16-bit type, scores, softmax and sums
     * are float32, and the probabilities are rounded to the 16-bit type
     * before they weight v. */
    mc_status (*attention)(mc_backend *be, int64_t batch, int64_t nq, int heads, int head_dim,
                           float scale, const float *q, int64_t ldq, int64_t q_bstride,
                           const mc_kv_segment *segs, int nsegs, float *out, int64_t ldo,
                           int64_t o_bstride, mc_err *err);

    /* GroupNorm over NHWC [batch, hw, channels] (statistics per image and
     * group over hw x channels/groups, biased variance), affine, optional
     * swish afterwards. y may be x. */
    mc_status (*groupnorm)(mc_backend *be, const float *x, int64_t batch, int64_t hw,
                           int64_t channels, int groups, const float *w, const float *b, float eps,
                           int swish, float *y, mc_err *err);

    /* 2-D convolution, stride 1, zero padding ksize / 2, NHWC in and out.
     * w is packed [cout, ksize, ksize, cin] (the loader repacks PyTorch's
     * [cout, cin, kh, kw]); bias [cout] or NULL. y = beta * y + conv(x). */
    mc_status (*conv2d)(mc_backend *be, const float *x, int64_t batch, int64_t height,
                        int64_t width, int64_t cin, const float *w, const float *bias,
                        int64_t cout, int ksize, float beta, float *y, mc_err *err);

    /* Nearest-neighbour x2 upsampling, NHWC [batch, h, w, c] -> [batch, 2h, 2w, c]. */
    mc_status (*upsample_nearest2x)(mc_backend *be, const float *x, int64_t batch, int64_t height,
                                    int64_t width, int64_t channels, float *y, mc_err *err);

    /* Classifier-free guidance on eps: out = u + scale * (c - u) for the
     * first `channels` columns of each row. */
    mc_status (*cfg_combine)(mc_backend *be, const float *cond, int64_t ldc, const float *uncond,
                             int64_t ldu, int64_t rows, int channels, float scale, float *out,
                             int64_t ldo, mc_err *err);

    /* One DDPM ancestral step with LEARNED_RANGE variance, in place on
     * x [rows, channels]: eps and v are the first and second `channels`
     * columns of model output rows (stride ld_out); noise [rows, channels]
     * may be NULL when coefs->noise_scale == 0. */
    mc_status (*ddpm_step)(mc_backend *be, float *x, int64_t rows, int channels, const float *eps,
                           int64_t ld_eps, const float *v, int64_t ld_v, const float *noise,
                           const mc_ddpm_coefs *coefs, mc_err *err);

    /* Philox normals for rows of tokens (see core/philox.h): row i gets the
     * `channels` normals of (seed, image[i], stream, position[i], step). */
    mc_status (*token_normals)(mc_backend *be, uint64_t seed, uint32_t stream, uint32_t step,
                               const uint32_t *image, const uint32_t *position, int64_t rows,
                               int channels, float *out, mc_err *err);

    /* y = a * x + b * y over [rows, cols] (strided). With b == 0, y is only
     * written (copies, scaled copies); cache policies use it for deltas. */
    mc_status (*axpby)(mc_backend *be, float a, const float *x, int64_t ldx, float b, float *y,
                       int64_t ldy, int64_t rows, int64_t cols, mc_err *err);

    /* out[r] = mean over heads h of cos(a_rh, b_rh), where a_rh is the h-th
     * head_dim slice of row r; cos = a.b / max(|a| |b|, 1e-8) (PyTorch's
     * cosine_similarity). LazyMAR ranks tokens by it. */
    mc_status (*cosine_rows)(mc_backend *be, const float *a, int64_t lda, const float *b,
                             int64_t ldb, int64_t rows, int heads, int head_dim, float *out,
                             mc_err *err);

    /* Attention mass: for each batch item b, out[b, j] = sum over heads h
     * and the nq query rows i of softmax_j(scale * q_bhi . k_bhj), over the
     * `keys` key rows (layouts as in attention). MARche picks the rows that
     * the tokens being generated attend to most. */
    mc_status (*attention_mass)(mc_backend *be, int64_t batch, int64_t nq, int heads, int head_dim,
                                float scale, const float *q, int64_t ldq, int64_t q_bstride,
                                const float *k, int64_t ldk, int64_t k_bstride, int64_t keys,
                                float *out, mc_err *err);
    /* ---- FID-Inception ops (appended; eval_and_formats.md 3-4) ---- */

    /* General 2-D convolution over NHWC with the geometry of `g` (any
     * kh x kw, strides, zero padding): y = relu?(beta * y + conv(x) + bias).
     * x has cin channels at pixel stride ldx; y has cout channels at pixel
     * stride ldy and size mc_window_out_h/w(g). w is packed
     * [cout, kh, kw, cin] (mc_bind's MC_BIND_CONV_OHWI); bias [cout] or NULL;
     * relu non-zero clamps the final sum at 0. beta == 0 never reads y. */
    mc_status (*conv2d_ex)(mc_backend *be, const mc_window2d *g, const float *x, int64_t cin,
                           int64_t ldx, const float *w, const float *bias, int64_t cout,
                           float beta, int relu, float *y, int64_t ldy, mc_err *err);

    /* Average pooling over NHWC windows of `g` (pad_h <= kh / 2 and
     * pad_w <= kw / 2, as PyTorch requires). The divisor is the number of
     * window taps inside the image when count_include_pad == 0 (TF's
     * average pool, FID-Inception), else kh * kw. Sums in float, one
     * division per output. With kh = height, kw = width, no padding it is
     * the global average pool. */
    mc_status (*avg_pool2d)(mc_backend *be, const mc_window2d *g, const float *x,
                            int64_t channels, int64_t ldx, int count_include_pad, float *y,
                            int64_t ldy, mc_err *err);

    /* Max pooling over NHWC windows of `g` (same padding rule); padded taps
     * never win (PyTorch's -inf padding). NaN propagates. */
    mc_status (*max_pool2d)(mc_backend *be, const mc_window2d *g, const float *x,
                            int64_t channels, int64_t ldx, float *y, int64_t ldy, mc_err *err);

    /* TF1 bilinear resize, align_corners = False, half_pixel_centers =
     * False (torch-fidelity's 'slow' method; eval_and_formats.md 4): x is
     * contiguous NHWC [batch, in_h, in_w, channels] of float32 or uint8
     * (converted to float32 first); y [batch, out_h, out_w, channels] float32.
     * Per axis scale = float32(in / out), src = float32(o) * scale in
     * float32, lo = floor(src), hi = min(lo + 1, in - 1), d = src - lo;
     * top = a + (b - a) * dx on rows lo_y and hi_y, y = top + (bottom - top)
     * * dy, every step rounded to float32 (no fused multiply-add). With
     * normalize, y = (y - 128) / 128 afterwards (the Inception input scale). */
    mc_status (*resize_bilinear_tf1)(mc_backend *be, const void *x, mc_pixel_type type,
                                     int64_t batch, int64_t in_h, int64_t in_w, int64_t channels,
                                     int64_t out_h, int64_t out_w, int normalize, float *y,
                                     mc_err *err);

    /* ---- graphs (optional: NULL where a backend has none) ----
     * capture_begin starts recording: the ops called until capture_end are
     * recorded, not run. While recording, ops must not allocate, upload or
     * download (they fail, and so does the recording). capture_end stops;
     * with keep != 0 and a clean recording it stores a runnable graph in
     * *graph, updating the one already there when it can (same ops, other
     * sizes or pointers) and replacing it otherwise; with keep == 0 it
     * discards the recording. graph_launch runs a graph on the backend's
     * queue, graph_free frees one. The head sampler records its 99 later
     * diffusion steps (runtime/mar_sampler.c). */
    mc_status (*capture_begin)(mc_backend *be, mc_err *err);
    mc_status (*capture_end)(mc_backend *be, void **graph, int keep, mc_err *err);
    mc_status (*graph_launch)(mc_backend *be, void *graph, mc_err *err);
    void (*graph_free)(mc_backend *be, void *graph);
};

struct mc_backend {
    const mc_ops *ops;
    int device_index;
    /* Weights of `linear` are stored in this type. Set right after the
     * backend is made, before any weight is bound (mc_bind's
     * MC_BIND_LINEAR converts to it), and never changed afterwards. */
    mc_wtype linear_wtype;
    /* Successful allocations of backend memory so far (ops->alloc and the
     * backend's own scratch growth). The tests read it between AR steps: a
     * steady-state loop allocates nothing. */
    int64_t allocations;
    /* Waits of the host for the backend's queue so far: every download and
     * every upload over MC_UPLOAD_STAGED_MAX bytes (smaller ones are staged
     * and only enqueued on CUDA). Counted the same way on every backend, so
     * the CPU tests show where an AR step would stall a GPU. */
    int64_t syncs;
    void *impl;  /* backend-private state: scratch pools, handles, streams */
};

/* Whether `attention` on this backend rounds its operands to 16 bits (see
 * the op). The head dims of the tensor-core kernel on CUDA. */
static inline int mc_attention_is_16bit(const mc_backend *be, int head_dim) {
    return be->linear_wtype != MC_WTYPE_F32 && head_dim % 16 == 0 && head_dim <= 128;
}

/* Uploads up to this size are staged (CUDA: a pinned ring) and do not wait. */
#define MC_UPLOAD_STAGED_MAX ((size_t)1 << 20)

/* Rows [row, ...) of a `linear` weight of `in` columns stored in the
 * backend's weight type (a view, like the q part of a fused qkv). */
static inline const void *mc_linear_w_rows(const mc_backend *be, const void *w, int64_t row,
                                           int64_t in) {
    return (const char *)w + (size_t)(row * in) * mc_wtype_size(be->linear_wtype);
}

/* Backend factories. The CPU backend always exists. */
mc_status mc_backend_cpu_create(mc_backend **out, int num_threads, mc_err *err);

/* The guard backend: the CPU backend's ops over memory the host cannot
 * touch. Its buffers live in one reserved address range that is readable
 * only while one of its own ops (or upload/download/copy) runs, so any
 * code that dereferences a backend pointer on the host faults at once.
 * Models run on it give the CPU's results bit for bit; the tests use it to
 * prove that model and policy code keep host and device memory apart, as
 * the CUDA backend needs, on machines without a GPU. */
mc_status mc_backend_guard_create(mc_backend **out, int num_threads, mc_err *err);
static inline void mc_backend_destroy(mc_backend *be) {
    if (be != NULL)
        be->ops->destroy(be);
}

#ifdef MC_HAVE_CUDA
/* The CUDA backend (csrc/backend/cuda/) on device `device_index`: one
 * stream, one cuBLAS handle bound to it, a stream-ordered memory pool.
 * Fails (MC_ERR_INTERNAL) when no usable device is present. */
mc_status mc_backend_cuda_create(mc_backend **out, int device_index, mc_err *err);
#endif

/* Reusable scratch of the CPU backend (grow-only; valid until the next call). */
float *mc_cpu_scratch(mc_backend *be, int slot, size_t floats, mc_err *err);

#endif

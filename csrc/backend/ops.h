/* The backend seam: one table of primitive ops per backend (the ops and their
 * contracts are listed once, in ops_list.h). Models call only
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

/* Activations of `linear` and `activation`: GELU is the exact erf form
 * (nn.GELU()), GELU_TANH the tanh approximation (nn.GELU(approximate='tanh'),
 * VAR's FFN): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). */
typedef enum mc_act { MC_ACT_NONE = 0, MC_ACT_GELU = 1, MC_ACT_SILU = 2, MC_ACT_GELU_TANH = 3 } mc_act;

/* Element type of the weights `linear` reads on a backend (its
 * linear_wtype). With BF16 or F16 the layer runs as PyTorch's autocast
 * does: x is rounded to the 16-bit type, products are summed in float32,
 * bias and activation are applied in float32. The convolutions (conv2d,
 * conv2d_ex) on such a backend run as autocast runs them too: x and w
 * (float32 in memory) rounded to the type, products summed in float32,
 * bias in float32; this is how the VAE and VQVAE decode when a model is
 * loaded in 16 bits, as the official code decodes under autocast. Every
 * other op and tensor stays float32. */
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

/* Keys of all segments together (the attention's key count). */
static inline int64_t mc_kv_segment_rows(const mc_kv_segment *segs, int nsegs) {
    int64_t rows = 0;
    for (int i = 0; i < nsegs; i++)
        rows += segs[i].rows;
    return rows;
}

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

/* Op ids in the order of ops_list.h: MC_OP_ID_gemm, MC_OP_ID_linear, ... */
typedef enum mc_op_id {
#define MC_OP(name, where, params, args, flops) MC_OP_ID_##name,
#include "ops_list.h"
    MC_OP_COUNT
} mc_op_id;

/* "gemm", "linear", ... indexed by mc_op_id. */
extern const char *const mc_op_names[MC_OP_COUNT];

struct mc_ops {
    const char *name;
    /* 1 when every op has finished when it returns (CPU, guard), so host
     * time around a group of ops is their compute time (the per-phase
     * seconds of the telemetry); 0 on a backend that queues work (CUDA),
     * where that time is only the enqueueing and is not reported. */
    int synchronous;
    void (*destroy)(mc_backend *be);

    /* memory. `what` names the buffer ("the K/V cache of encoder block 3") for
     * the out-of-memory message (mc_fail_nomem), which alloc writes: its
     * caller knows what it asked for, the backend knows why it failed. */
    void *(*alloc)(mc_backend *be, size_t bytes, const char *what, mc_err *err);
    void (*release)(mc_backend *be, void *ptr);
    mc_status (*upload)(mc_backend *be, void *dst, const void *host_src, size_t bytes, mc_err *err);
    mc_status (*download)(mc_backend *be, void *host_dst, const void *src, size_t bytes, mc_err *err);
    mc_status (*copy)(mc_backend *be, void *dst, const void *src, size_t bytes, mc_err *err);
    /* Optional (NULL: nothing to do). `w` is a whole buffer from alloc just
     * filled with a `linear` weight [out, in] of linear_wtype (mc_bind). The
     * backend may keep a copy in a layout of its own for some calls (the
     * CPU: column panels for the small-row kernel, made at the weight's
     * first small-row call); it drops the copy when w is released, or when
     * upload or copy write into w. Ops never write into a bound weight. */
    mc_status (*bind_linear)(mc_backend *be, const void *w, int64_t out, int64_t in, mc_err *err);

    /* The compute ops, one member per entry of ops_list.h (their contracts
     * are written there). A backend without an op holds a stand-in in its
     * entry (mc_ops_fill_unsupported) that fails with an mc_err naming the
     * op and the backend, never NULL. */
#define MC_OP(name, where, params, args, flops) mc_status(*name) params;
#include "ops_list.h"

    /* ---- graphs (optional: NULL where a backend has none) ----
     * capture_begin starts recording: the ops called until capture_end are
     * recorded, not run. While recording, ops must not allocate, upload or
     * download (they fail, and so does the recording). capture_end stops;
     * with keep != 0 and a clean recording it stores a runnable graph in
     * *graph, updating the one already there when it can (same ops, other
     * sizes or pointers) and replacing it otherwise; with keep == 0 it
     * discards the recording. graph_launch runs a graph on the backend's
     * queue, graph_free frees one. The head sampler records its 99 later
     * diffusion steps (runtime/mar_sampler.c): CUDA replays them as a CUDA
     * graph, the CPU on one persistent OpenMP team (cpu/cpu_graph.c), the
     * guard runs them as they are recorded. */
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
    /* FLOPs of the ops dispatched so far, per the `flops` column of
     * ops_list.h (GEMMs and attention matmuls, the convention of
     * marcache/flops.py). Counted by the guard backend, which wraps every
     * op anyway; 0 on the others. A discarded graph recording takes its
     * ops' FLOPs back, as it takes back their effects. */
    int64_t dispatched_flops;
    /* A CPU graph's launch (cpu_graph.c): the parallel regions it opened
     * for its persistent team, and the recorded calls it ran inside them.
     * 0 on the other backends. The tests read them to see that the head's
     * diffusion steps ran on one team, not a region per op. */
    int64_t team_regions, team_calls;
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

/* An op a backend does not implement (an op that landed on the CPU first,
 * ops_list.h's CPU_ONLY) holds a generated function in its table entry:
 * calling it fails with MC_ERR_INTERNAL "op 'name' is not supported on
 * backend 'backend'". mc_ops_fill_unsupported puts it into every NULL op
 * entry of a table being built; mc_op_supported tells whether an entry is a
 * real one. */
typedef void (*mc_op_fn)(void);
void mc_ops_fill_unsupported(mc_ops *ops);
int mc_op_supported(const mc_ops *ops, mc_op_id id);
/* The table entry of op `id` as a generic function pointer (NULL if empty). */
mc_op_fn mc_op_entry(const mc_ops *ops, mc_op_id id);

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

/* Reusable scratch of the CPU backend (grow-only; valid until the next call).
 * `what` names the request in an out-of-memory message ("a thread's attention scores"). */
float *mc_cpu_scratch(mc_backend *be, int slot, size_t floats, const char *what, mc_err *err);

#endif

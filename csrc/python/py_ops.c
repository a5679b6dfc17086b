/* Op-level binding: runs one primitive of the backend op table (ops.h) on
 * host NumPy arrays, for the table-driven op test (tests/test_ops.py).
 *
 *   backends() -> list[str]     backends built in (one entry per factory below)
 *   op_names() -> list[str]     every op of the table, implemented or not
 *   run_op(backend, name, inputs: tuple, params: dict) -> numpy.ndarray
 *
 * Each call creates the backend, copies the inputs into backend buffers,
 * runs the op with the GIL released, downloads the result into a fresh
 * array and releases everything, on every path. Inputs are never modified:
 * an op that works in place gets a copy and its result is returned.
 *
 * Arrays. Tensors must be numpy.ndarray of float32 (indices int32, token
 * ids uint32) with exactly the rank below; nothing is cast. Where the op
 * takes a row stride ("ld", marked strided below), a view whose last axis is
 * contiguous is passed as is: its row stride becomes ld and, for 3-D
 * arrays, its batch stride becomes the batch stride. So q = qkv[:, :, :C]
 * of a fused buffer runs the op on the fused layout. Any other layout is
 * copied to C order first. Results are C-contiguous with the shape below.
 * Optional arguments may be None or left off the end of the tuple.
 * Unknown params keys, wrong types, ranks, shapes or dtypes raise ValueError
 * naming the op and the argument; an op the backend does not implement
 * (ops_list.h: CPU_ONLY, or the guard's MARCACHE_GUARD_UNSUPPORTED hook)
 * raises NotImplementedError; a failure inside the op raises per mcpy_raise.
 * Every op also takes the param threads=0: the CPU thread count of the cpu
 * and guard backends for this call (0: all; ignored by cuda).
 *
 * The ops, their order and names come from csrc/backend/ops_list.h; each
 * run_<op> below reads its inputs from one spec list (fetch_args) and ends
 * in RETURN_OP (upload, run without the GIL, download).
 *
 * Conventions (inputs; params, "=" marks a default; result):
 *   gemm         (A, B, C=None); trans_a=False, trans_b=False, alpha=1, beta=0
 *                A [m,k] ([k,m] if trans_a), B [k,n] ([n,k] if trans_b),
 *                C [m,n] (None: zeros); all strided -> C
 *   linear       (x [rows,in] strided, W [out,in], bias [out]=None,
 *                y [rows,out] strided=None); act="none"|"gelu"|"silu"|
 *                "gelu_tanh",
 *                beta=0 (0 or 1; 1 needs act "none"), wtype="fp32"|"bf16"|
 *                "fp16" (the backend's linear_wtype: W, given as float32,
 *                is rounded to it here as the model loader does) -> y
 *   layernorm    (x [rows,dim] strided, w [dim]=None, b [dim]=None,
 *                shift [m,dim] strided=None, scale likewise=None); eps,
 *                inplace=False (y written over x), mod_period=1 (row r
 *                takes shift/scale row r // mod_period; m = ceil(rows /
 *                mod_period)) -> y. b needs w; shift and scale come together.
 *   activation   (x [rows,dim] strided,); act -> x
 *   add_rows     (y [rows,dim] strided, v [n,dim] strided); period=n
 *                (1 <= period <= n) -> y
 *   gated_add    (y, u, gate), y and u [rows,dim], gate [ceil(rows /
 *                gate_period),dim], all strided; gate_period=1 (row r
 *                takes gate row r // gate_period) -> y
 *   gather_rows  (src [n,dim] strided, idx int32 [rows]) -> dst [rows,dim]
 *                (every idx in [0, n))
 *   scatter_rows (src [rows,dim] strided, idx int32 [rows], dst [n,dim]
 *                strided) -> dst (idx in [0, n) and pairwise distinct)
 *   attention    (q [B,nq,H*hd], k1, v1, k2, v2, ...), each k/v
 *                [B,rows_s,H*hd] (1 to 8 segments; rows_s may be 0, at least
 *                one key in all), all strided; heads, scale=hd**-0.5,
 *                naive=False (CUDA only: the plain two-pass reference
 *                kernel instead of the fused one), wtype="fp32" (a 16-bit
 *                type: the 16-bit form of ops.h) -> out [B,nq,H*hd].
 *                k_s and v_s share one ld and batch stride in mc_kv_segment:
 *                if their strides differ both are copied to C order.
 *   groupnorm    (x [B,HW,C], w [C]=None, b [C]=None (None: no affine));
 *                groups, eps, swish=False, inplace=False -> y [B,HW,C]
 *   conv2d       (x [B,H,W,Cin], w [Cout,Cin,k,k] (PyTorch layout, k odd;
 *                repacked here to [Cout,k,k,Cin]), bias [Cout]=None,
 *                y [B,H,W,Cout]=None); beta=0, naive=False (the backend's
 *                plain-loop reference kernel), wtype="fp32" (a 16-bit
 *                type: the autocast form of ops.h, x and w rounded) -> y
 *   upsample_nearest2x (x [B,H,W,C],) -> y [B,2H,2W,C]
 *   cfg_combine  (cond [rows,>=ch] strided, uncond [rows,>=ch] strided);
 *                scale, channels=cond.shape[1] -> out [rows,channels]
 *   ddpm_step    (x [rows,ch], eps [rows,>=ch] strided, v [rows,>=ch]
 *                strided, noise [rows,ch]=None); the seven mc_ddpm_coefs
 *                fields by name (all required; noise needed unless
 *                noise_scale == 0) -> x
 *   token_normals (image uint32 [rows], position uint32 [rows]); seed
 *                (0..2**64-1), stream and step (0..65535), channels (1..64)
 *                -> out [rows,channels]
 *   axpby        (x [rows,cols] strided, y [rows,cols]); a, b -> y = a x + b y
 *   cosine_rows  (a [rows,H*hd] strided, b [rows,H*hd] strided); heads
 *                -> out [rows] (mean over heads of the per-head cosine)
 *   attention_mass (q [B,nq,H*hd], k [B,keys,H*hd]); heads, scale=hd**-0.5
 *                -> out [B,keys] (softmax probabilities summed over heads and queries)
 *   head_l2norm  (x [rows,H*hd] strided, head_scale [H]=None); heads -> x
 *                (each head slice L2-normalised, times head_scale[h])
 *   conv2d_ex    (x [B,H,W,Cin] pixel-strided, w [Cout,Cin,kh,kw] (PyTorch
 *                layout; repacked here), bias [Cout]=None, y [B,OH,OW,Cout]
 *                pixel-strided=None); stride_h=1, stride_w=1, pad_h=0,
 *                pad_w=0, beta=0, relu=False, naive=False (the backend's
 *                plain-loop reference kernel), wtype="fp32" (as conv2d) -> y
 *   avg_pool2d   (x [B,H,W,C] pixel-strided, y [B,OH,OW,C] pixel-strided=
 *                None); kh, kw, count_include_pad (required), stride_h=kh,
 *                stride_w=kw, pad_h=0, pad_w=0 -> y
 *   max_pool2d   as avg_pool2d without count_include_pad -> y
 *   resize_bilinear_tf1 (x [B,H,W,C] float32 or uint8,); out_h, out_w,
 *                normalize=False -> y [B,out_h,out_w,C] float32
 *   resize_bicubic (x [B,H,W,C],); out_h, out_w -> y [B,out_h,out_w,C]
 *   resize_area  (x [B,H,W,C],); out_h, out_w -> y [B,out_h,out_w,C]
 *   sample_tokens (logits [rows,vocab] strided, image uint32 [rows],
 *                position uint32 [rows]); seed (0..2**64-1), step (0..65535),
 *                top_k=0 (any integer), top_p=0 -> (tokens int32 [rows],
 *                logits [rows,vocab] as the op left them: masked entries
 *                -inf). A tuple: the op's two results.
 *   gumbel_softmax (logits [rows,vocab] strided, image uint32 [rows],
 *                position uint32 [rows], probs [rows,vocab] strided=None);
 *                seed, step (0..65535), tau, logit_scale=1 -> probs
 *   pivotal_rows (x [batch*rows,dim] strided,); keep, batch=1 -> out int32
 *                [batch*keep] (each sequence's kept rows ascending, as
 *                indices b*rows+r)
 *   Both sampling ops take rows, vocab and ld (gumbel_softmax also ldp) as optional
 *   params passed to the op as given instead of the sizes the arrays give,
 *   as long as they ask for no more than the arrays hold (rows <= the
 *   rows, vocab <= the columns, ld and ldp <= the row strides): so the
 *   tests reach the op's own refusals of rows < 0, vocab < 1, ld < vocab.
 * "Pixel-strided": a 4-D view whose last axis is contiguous and whose
 * pixels are evenly spaced (a channel slice x[..., a:b] of an NHWC array)
 * is passed as is, with the pixel stride as ldx / ldy. */
#include "py_numpy.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "../backend/cpu/cpu_internal.h" /* the plain-loop conv references (naive=True) */
#include "../backend/ops.h"
#include "py_backend.h"
#ifdef MC_HAVE_CUDA
#include "../backend/cuda/cuda_backend.h"
#endif

/* ------------------------------------------------------------------------
 * Backends: one entry per factory built in. A CUDA build adds
 * {"cuda", create_cuda_backend}; backends() lists it only while a device is
 * usable (so GPU tests skip on a machine without one), and run_op on it
 * then fails with the factory's RuntimeError. */

typedef mc_status (*backend_factory)(mc_backend **out, int threads, mc_err *err);

typedef struct backend_entry {
    const char *name;
    backend_factory create;
    int (*usable)(void); /* NULL: always */
} backend_entry;


#ifdef MC_HAVE_CUDA
/* Device 0; the CUDA backend has no CPU threads to set. */
static mc_status create_cuda_backend(mc_backend **out, int threads, mc_err *err) {
    (void)threads;
    return mc_backend_cuda_create(out, 0, err);
}

static int cuda_usable(void) { return mc_cuda_device_count() > 0; }
#endif

static const backend_entry backend_table[] = {
    {"cpu", mc_backend_cpu_create, NULL},
    {"guard", mc_backend_guard_create, NULL},
#ifdef MC_HAVE_CUDA
    {"cuda", create_cuda_backend, cuda_usable},
#endif
};

#define BACKEND_COUNT ((int)(sizeof backend_table / sizeof backend_table[0]))

/* ------------------------------------------------------------------------
 * Operands: one array of the call, its layout in elements and its backend
 * buffer. */

#define OPERAND_MAX_DIMS 4

typedef struct operand {
    const char *arg;         /* argument name, for messages */
    PyArrayObject *host;     /* owned: the array given, or a C-order copy */
    int typenum;
    int ndim;
    int64_t shape[OPERAND_MAX_DIMS];
    int64_t stride[OPERAND_MAX_DIMS]; /* elements; size-1 axes get the C-order value */
    int64_t span;            /* elements from the first to one past the last */
    void *device;            /* backend buffer holding the span, or NULL */
} operand;

typedef struct op_call {
    const char *op_name;
    mc_backend *backend;
    PyObject *inputs;        /* borrowed tuple */
    PyObject *params;        /* borrowed dict */
    operand *operands;       /* owned, `capacity` slots, never reallocated */
    int operand_count;
    int operand_capacity;
    mc_kv_segment *segments; /* owned: attention's segment list */
    mc_err err;
} op_call;

static size_t element_size(int typenum) {
    if (typenum == NPY_UINT8)
        return 1;
    if (typenum == NPY_UINT16)
        return 2;
    return typenum == NPY_FLOAT ? sizeof(float) : sizeof(int32_t);
}

static const char *dtype_name(int typenum) {
    switch (typenum) {
    case NPY_FLOAT: return "float32";
    case NPY_INT32: return "int32";
    case NPY_UINT32: return "uint32";
    case NPY_UINT8: return "uint8";
    case NPY_UINT16: return "uint16 (16-bit float bits)";
    default: return "?";
    }
}

static int64_t operand_ld(const operand *o) { return o->stride[o->ndim - 2]; }
static int64_t operand_batch_stride(const operand *o) { return o->stride[o->ndim - 3]; }

/* Layout in elements of `arr`, or 0 when it cannot be passed without a copy
 * (strided_ok: last axis contiguous, other strides non-negative, each axis
 * clear of the extent of the axes after it; else C-contiguous). */
static int describe_layout(operand *o, PyArrayObject *arr, int strided_ok) {
    const int64_t item = (int64_t)element_size(o->typenum);
    const npy_intp *dims = PyArray_DIMS(arr);
    const npy_intp *strides = PyArray_STRIDES(arr);
    int empty = 0;
    for (int i = 0; i < o->ndim; i++) {
        o->shape[i] = dims[i];
        empty |= dims[i] == 0;
    }
    if (!PyArray_ISALIGNED(arr) || !PyArray_ISNOTSWAPPED(arr))
        return 0;
    if (empty || !strided_ok) {
        if (!empty && !PyArray_IS_C_CONTIGUOUS(arr))
            return 0;
        int64_t natural = 1;
        for (int i = o->ndim - 1; i >= 0; i--) {
            o->stride[i] = natural;
            natural *= o->shape[i] > 0 ? o->shape[i] : 1;
        }
        int64_t total = 1;
        for (int i = 0; i < o->ndim; i++)
            total *= o->shape[i];
        o->span = total;
        return 1;
    }
    int64_t inner_extent = 1; /* elements spanned by axes i+1.. */
    for (int i = o->ndim - 1; i >= 0; i--) {
        int64_t s = (int64_t)strides[i];
        if (o->shape[i] == 1) {
            o->stride[i] = i == o->ndim - 1 ? 1 : o->shape[i + 1] * o->stride[i + 1];
        } else {
            if (s < 0 || s % item != 0)
                return 0;
            o->stride[i] = s / item;
            if (i == o->ndim - 1 ? o->stride[i] != 1 : o->stride[i] < inner_extent)
                return 0;
        }
        inner_extent += (o->shape[i] - 1) * o->stride[i];
    }
    o->span = inner_extent;
    return 1;
}

/* Replaces the operand's array by a C-order copy and describes that. */
static int make_contiguous(op_call *call, operand *o) {
    PyArrayObject *copy = (PyArrayObject *)PyArray_NewCopy(o->host, NPY_CORDER);
    if (copy == NULL)
        return -1;
    Py_DECREF(o->host);
    o->host = copy;
    if (!describe_layout(o, copy, 0)) {
        PyErr_Format(PyExc_RuntimeError, "%s: argument '%s': cannot lay out a C-order copy",
                     call->op_name, o->arg);
        return -1;
    }
    return 0;
}

static operand *new_operand(op_call *call, const char *arg) {
    if (call->operand_count >= call->operand_capacity) {
        PyErr_Format(PyExc_RuntimeError, "%s: more operands than the call reserved",
                     call->op_name);
        return NULL;
    }
    operand *o = &call->operands[call->operand_count++];
    memset(o, 0, sizeof *o);
    o->arg = arg;
    return o;
}

enum { ARG_REQUIRED = 0, ARG_OPTIONAL = 1 };
enum { LAYOUT_CONTIGUOUS = 0, LAYOUT_STRIDED = 1 };

/* inputs[index] as an operand of dtype `typenum` and rank `ndim`; *out is
 * NULL for an optional argument given as None or left off. */
static int fetch_array(op_call *call, Py_ssize_t index, const char *arg, int typenum, int ndim,
                       int optional, int strided_ok, operand **out) {
    *out = NULL;
    PyObject *obj = index < PyTuple_GET_SIZE(call->inputs)
                        ? PyTuple_GET_ITEM(call->inputs, index)
                        : NULL;
    if (obj == NULL || obj == Py_None) {
        if (optional)
            return 0;
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' (input %zd) is required", call->op_name,
                     arg, index);
        return -1;
    }
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_ValueError, "%s: argument '%s': expected a numpy.ndarray of %s, got %s",
                     call->op_name, arg, dtype_name(typenum), Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyArrayObject *arr = (PyArrayObject *)obj;
    if (PyArray_TYPE(arr) != typenum || !PyArray_ISNOTSWAPPED(arr)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: argument '%s': expected dtype %s (native byte order), got %S",
                     call->op_name, arg, dtype_name(typenum), (PyObject *)PyArray_DESCR(arr));
        return -1;
    }
    if (PyArray_NDIM(arr) != ndim) {
        char got[128];
        int64_t dims[NPY_MAXDIMS];
        for (int i = 0; i < PyArray_NDIM(arr); i++)
            dims[i] = (int64_t)PyArray_DIM(arr, i);
        mcpy_format_shape(got, sizeof got, PyArray_NDIM(arr), dims);
        PyErr_Format(PyExc_ValueError, "%s: argument '%s': expected %d dimensions, got shape %s",
                     call->op_name, arg, ndim, got);
        return -1;
    }
    operand *o = new_operand(call, arg);
    if (o == NULL)
        return -1;
    o->typenum = typenum;
    o->ndim = ndim;
    Py_INCREF(arr);
    o->host = arr;
    if (!describe_layout(o, arr, strided_ok) && make_contiguous(call, o) < 0)
        return -1;
    *out = o;
    return 0;
}

/* A fresh zero-filled C-order operand (binding-made outputs). */
static operand *new_zeros(op_call *call, const char *arg, int typenum, int ndim,
                          const int64_t *shape) {
    npy_intp dims[OPERAND_MAX_DIMS];
    for (int i = 0; i < ndim; i++)
        dims[i] = (npy_intp)shape[i];
    operand *o = new_operand(call, arg);
    if (o == NULL)
        return NULL;
    o->typenum = typenum;
    o->ndim = ndim;
    o->host = (PyArrayObject *)PyArray_ZEROS(ndim, dims, typenum, 0);
    if (o->host == NULL)
        return NULL;
    if (!describe_layout(o, o->host, 0)) {
        PyErr_Format(PyExc_RuntimeError, "%s: cannot lay out output '%s'", call->op_name, arg);
        return NULL;
    }
    return o;
}

/* Shape rules: a dimension is any size, exactly `value`, or at least `value`. */
typedef struct dim_rule {
    int kind;
    int64_t value;
} dim_rule;

enum { DIM_ANY = 0, DIM_EQ = 1, DIM_GE = 2 };
#define RULE_ANY ((dim_rule){DIM_ANY, 0})
#define RULE_EQ(v) ((dim_rule){DIM_EQ, (int64_t)(v)})
#define RULE_GE(v) ((dim_rule){DIM_GE, (int64_t)(v)})

static int check_shape(op_call *call, const operand *o, const dim_rule *rules) {
    int ok = 1;
    for (int i = 0; i < o->ndim; i++) {
        if (rules[i].kind == DIM_EQ && o->shape[i] != rules[i].value)
            ok = 0;
        if (rules[i].kind == DIM_GE && o->shape[i] < rules[i].value)
            ok = 0;
    }
    if (ok)
        return 0;
    char expected[256], got[128];
    size_t used = (size_t)snprintf(expected, sizeof expected, "(");
    for (int i = 0; i < o->ndim && used < sizeof expected; i++) {
        const char *sep = i ? ", " : "";
        if (rules[i].kind == DIM_ANY)
            used += (size_t)snprintf(expected + used, sizeof expected - used, "%s?", sep);
        else
            used += (size_t)snprintf(expected + used, sizeof expected - used, "%s%s%lld", sep,
                                     rules[i].kind == DIM_GE ? ">=" : "",
                                     (long long)rules[i].value);
    }
    if (used < sizeof expected)
        snprintf(expected + used, sizeof expected - used, o->ndim == 1 ? ",)" : ")");
    mcpy_format_shape(got, sizeof got, o->ndim, o->shape);
    PyErr_Format(PyExc_ValueError, "%s: argument '%s': expected shape %s, got %s", call->op_name,
                 o->arg, expected, got);
    return -1;
}

static PyObject *raise_value(op_call *call, const char *what) {
    PyErr_Format(PyExc_ValueError, "%s: %s", call->op_name, what);
    return NULL;
}

/* Copies the operand's span into a new backend buffer. */
static int upload_operand(op_call *call, operand *o) {
    const mc_ops *ops = call->backend->ops;
    size_t bytes = (size_t)(o->span > 0 ? o->span : 1) * element_size(o->typenum);
    char what[96];
    snprintf(what, sizeof what, "%s's operand '%s'", call->op_name, o->arg);
    o->device = ops->alloc(call->backend, bytes, what, &call->err);
    if (o->device == NULL) {
        mcpy_raise(&call->err);
        return -1;
    }
    if (o->span > 0 &&
        ops->upload(call->backend, o->device, PyArray_DATA(o->host),
                    (size_t)o->span * element_size(o->typenum), &call->err) != MC_OK) {
        mcpy_raise(&call->err);
        return -1;
    }
    return 0;
}

static int upload_all(op_call *call) {
    for (int i = 0; i < call->operand_count; i++)
        if (call->operands[i].device == NULL && upload_operand(call, &call->operands[i]) < 0)
            return -1;
    return 0;
}

/* The operand's backend contents as a new C-order array of its shape. */
static PyObject *download_operand(op_call *call, const operand *o) {
    const size_t item = element_size(o->typenum);
    npy_intp span_dims[1] = {(npy_intp)(o->span > 0 ? o->span : 1)};
    PyArrayObject *span = (PyArrayObject *)PyArray_SimpleNew(1, span_dims, o->typenum);
    if (span == NULL)
        return NULL;
    if (o->span > 0 && call->backend->ops->download(call->backend, PyArray_DATA(span), o->device,
                                                     (size_t)o->span * item,
                                                     &call->err) != MC_OK) {
        Py_DECREF(span);
        return mcpy_raise(&call->err);
    }
    npy_intp dims[OPERAND_MAX_DIMS];
    int64_t outer = 1;
    for (int i = 0; i < o->ndim; i++) {
        dims[i] = (npy_intp)o->shape[i];
        if (i < o->ndim - 1)
            outer *= o->shape[i];
    }
    PyArrayObject *result = (PyArrayObject *)PyArray_SimpleNew(o->ndim, dims, o->typenum);
    if (result == NULL) {
        Py_DECREF(span);
        return NULL;
    }
    const int64_t cols = o->shape[o->ndim - 1];
    if (cols > 0) {
        const char *src = PyArray_DATA(span);
        char *dst = PyArray_DATA(result);
        for (int64_t row = 0; row < outer; row++) {
            int64_t rest = row, offset = 0;
            for (int i = o->ndim - 2; i >= 0; i--) {
                offset += (rest % o->shape[i]) * o->stride[i];
                rest /= o->shape[i];
            }
            memcpy(dst + (size_t)(row * cols) * item, src + (size_t)offset * item,
                   (size_t)cols * item);
        }
    }
    Py_DECREF(span);
    return (PyObject *)result;
}

static void release_call(op_call *call) {
    for (int i = 0; i < call->operand_count; i++) {
        operand *o = &call->operands[i];
        if (o->device != NULL)
            call->backend->ops->release(call->backend, o->device);
        Py_XDECREF(o->host);
    }
    PyMem_Free(call->operands);
    PyMem_Free(call->segments);
    mc_backend_destroy(call->backend);
}

/* ------------------------------------------------------------------------
 * Params. Each op lists the keys it reads; any other key is an error except
 * the common "threads" (read by py_run_op before the backend is made). */

static int check_param_keys(op_call *call, const char *const *allowed) {
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(call->params, &pos, &key, &value)) {
        int known = 0;
        if (PyUnicode_Check(key)) {
            const char *name = PyUnicode_AsUTF8(key);
            if (name == NULL)
                return -1;
            known = strcmp(name, "threads") == 0;
            for (int i = 0; allowed[i] != NULL && !known; i++)
                known = strcmp(name, allowed[i]) == 0;
        }
        if (!known) {
            char list[512];
            size_t used = 0;
            list[0] = '\0';
            for (int i = 0; allowed[i] != NULL && used < sizeof list; i++)
                used += (size_t)snprintf(list + used, sizeof list - used, "%s%s", i ? ", " : "",
                                         allowed[i]);
            PyErr_Format(PyExc_ValueError, "%s: unknown param %R; valid params: %s",
                         call->op_name, key, allowed[0] ? list : "(none)");
            return -1;
        }
    }
    return 0;
}

/* Borrowed value of `key`, or NULL when absent (keys are str: no lookup error). */
static PyObject *param_value(op_call *call, const char *key) {
    return PyDict_GetItemString(call->params, key);
}

static int param_missing(op_call *call, const char *key) {
    PyErr_Format(PyExc_ValueError, "%s: param '%s' is required", call->op_name, key);
    return -1;
}

static int param_double(op_call *call, const char *key, int required, double fallback,
                        double *out) {
    PyObject *value = param_value(call, key);
    if (value == NULL) {
        if (required)
            return param_missing(call, key);
        *out = fallback;
        return 0;
    }
    if (PyBool_Check(value) || !PyNumber_Check(value) || PyUnicode_Check(value)) {
        PyErr_Format(PyExc_ValueError, "%s: param '%s': expected a number, got %s",
                     call->op_name, key, Py_TYPE(value)->tp_name);
        return -1;
    }
    double v = PyFloat_AsDouble(value);
    if (v == -1.0 && PyErr_Occurred())
        return -1;
    if (!isfinite(v)) {
        PyErr_Format(PyExc_ValueError, "%s: param '%s' must be finite", call->op_name, key);
        return -1;
    }
    *out = v;
    return 0;
}

static int param_float(op_call *call, const char *key, int required, float fallback,
                       float *out) {
    double v;
    if (param_double(call, key, required, fallback, &v) < 0)
        return -1;
    *out = (float)v;
    return 0;
}

/* An integer param in [lo, hi] (an exact integer: bool and float rejected). */
static int param_integer(op_call *call, const char *key, int required, long long fallback,
                         long long lo, long long hi, long long *out) {
    PyObject *value = param_value(call, key);
    if (value == NULL) {
        if (required)
            return param_missing(call, key);
        *out = fallback;
        return 0;
    }
    if (PyBool_Check(value) || PyFloat_Check(value)) {
        PyErr_Format(PyExc_ValueError, "%s: param '%s': expected an integer, got %s",
                     call->op_name, key, Py_TYPE(value)->tp_name);
        return -1;
    }
    PyObject *index = PyNumber_Index(value);
    if (index == NULL) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: param '%s': expected an integer, got %s",
                     call->op_name, key, Py_TYPE(value)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(index, &overflow);
    Py_DECREF(index);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow || v < lo || v > hi) {
        PyErr_Format(PyExc_ValueError, "%s: param '%s' must be in [%lld, %lld], got %R",
                     call->op_name, key, lo, hi, value);
        return -1;
    }
    *out = v;
    return 0;
}

/* A 64-bit unsigned param (the Philox seed). */
static int param_u64(op_call *call, const char *key, uint64_t *out) {
    PyObject *value = param_value(call, key);
    if (value == NULL)
        return param_missing(call, key);
    PyObject *index = PyBool_Check(value) || PyFloat_Check(value) ? NULL : PyNumber_Index(value);
    if (index == NULL) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: param '%s': expected an integer, got %s",
                     call->op_name, key, Py_TYPE(value)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(index);
    Py_DECREF(index);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: param '%s' must be in [0, 2**64 - 1], got %R",
                     call->op_name, key, value);
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

static int param_bool(op_call *call, const char *key, int fallback, int *out) {
    long long v;
    PyObject *value = param_value(call, key);
    if (value != NULL && PyBool_Check(value)) {
        *out = value == Py_True;
        return 0;
    }
    if (param_integer(call, key, 0, fallback, 0, 1, &v) < 0)
        return -1;
    *out = (int)v;
    return 0;
}

static int param_act(op_call *call, const char *key, int required, mc_act *out) {
    PyObject *value = param_value(call, key);
    if (value == NULL) {
        if (required)
            return param_missing(call, key);
        *out = MC_ACT_NONE;
        return 0;
    }
    const char *name = PyUnicode_Check(value) ? PyUnicode_AsUTF8(value) : NULL;
    if (name == NULL && PyErr_Occurred())
        return -1;
    if (name != NULL && strcmp(name, "none") == 0)
        *out = MC_ACT_NONE;
    else if (name != NULL && strcmp(name, "gelu") == 0)
        *out = MC_ACT_GELU;
    else if (name != NULL && strcmp(name, "silu") == 0)
        *out = MC_ACT_SILU;
    else if (name != NULL && strcmp(name, "gelu_tanh") == 0)
        *out = MC_ACT_GELU_TANH;
    else {
        PyErr_Format(PyExc_ValueError,
                     "%s: param '%s': expected 'none', 'gelu', 'silu' or 'gelu_tanh', got %R",
                     call->op_name, key, value);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------
 * Running an op. */

#define INT_MAX_LL 2147483647LL

static int check_arity(op_call *call, Py_ssize_t min_args, Py_ssize_t max_args) {
    Py_ssize_t n = PyTuple_GET_SIZE(call->inputs);
    if (n < min_args || n > max_args) {
        if (min_args == max_args)
            PyErr_Format(PyExc_ValueError, "%s: expected %zd inputs, got %zd", call->op_name,
                         min_args, n);
        else
            PyErr_Format(PyExc_ValueError, "%s: expected %zd to %zd inputs, got %zd",
                         call->op_name, min_args, max_args, n);
        return -1;
    }
    return 0;
}

/* One input of an op: its name, dtype, rank, whether it may be None or left
 * off the end, and whether a strided view is passed as is. */
typedef struct arg_spec {
    const char *name;
    int typenum;
    int ndim;
    int optional;
    int layout;
} arg_spec;

#define IN(name, ndim, layout) {name, NPY_FLOAT, ndim, ARG_REQUIRED, layout}
#define OPT_IN(name, ndim, layout) {name, NPY_FLOAT, ndim, ARG_OPTIONAL, layout}
#define SPECS(...) ((const arg_spec[]){__VA_ARGS__}), \
    (int)(sizeof((const arg_spec[]){__VA_ARGS__}) / sizeof(arg_spec))

/* The inputs of an op described by `count` specs, in order: the arity runs
 * from the leading required inputs to all of them; out[i] is NULL for an
 * optional input given as None or left off. Call as
 * fetch_args(call, SPECS(IN("x", 2, LAYOUT_STRIDED), ...), operands). */
static int fetch_args(op_call *call, const arg_spec *specs, int count, operand **out) {
    int required = 0;
    while (required < count && !specs[required].optional)
        required++;
    if (check_arity(call, required, count) < 0)
        return -1;
    for (int i = 0; i < count; i++)
        if (fetch_array(call, i, specs[i].name, specs[i].typenum, specs[i].ndim, specs[i].optional,
                        specs[i].layout, &out[i]) < 0)
            return -1;
    return 0;
}

/* The operand has exactly `shape` (its rank's worth of sizes). */
static int check_dims(op_call *call, const operand *o, const int64_t *shape) {
    dim_rule rules[OPERAND_MAX_DIMS];
    for (int i = 0; i < o->ndim; i++)
        rules[i] = RULE_EQ(shape[i]);
    return check_shape(call, o, rules);
}

/* An op's output that the caller may pass in (to be accumulated onto or
 * written into a strided view): *o as given is checked to be `shape`; when
 * None or left off it is made as zeros of that shape. */
static int output_operand(op_call *call, operand **o, const char *arg, int ndim,
                          const int64_t *shape) {
    if (*o != NULL)
        return check_dims(call, *o, shape);
    *o = new_zeros(call, arg, NPY_FLOAT, ndim, shape);
    return *o == NULL ? -1 : 0;
}

static PyObject *finish_op(op_call *call, mc_status status, const operand *result) {
    if (status != MC_OK)
        return mcpy_raise(&call->err);
    return download_operand(call, result);
}

/* Uploads every operand, evaluates `expr` (an mc_status) without the GIL
 * and returns `result` downloaded, or raises from call->err. */
#define RETURN_RUN(call, result, expr)              \
    do {                                            \
        if (upload_all(call) < 0)                   \
            return NULL;                            \
        mc_status status_;                          \
        Py_BEGIN_ALLOW_THREADS                      \
        status_ = (expr);                           \
        Py_END_ALLOW_THREADS                        \
        return finish_op(call, status_, result);    \
    } while (0)

/* RETURN_RUN of the backend's op `name` with the call's backend first and
 * its error record last. */
#define RETURN_OP(call, result, name, ...) \
    RETURN_RUN(call, result, (call)->backend->ops->name((call)->backend, __VA_ARGS__, &(call)->err))

/* The backend buffer of an optional operand, or NULL. */
#define DEVICE_OR_NULL(o) ((o) != NULL ? (o)->device : NULL)

/* naive=True runs the backend's plain reference kernel instead of its fast
 * one. The CPU's references (the convolutions) are called directly: returns
 * 1. The CUDA backend switches to its reference kernels for this call
 * (attention, conv2d, conv2d_ex): returns 0 and the op runs as usual.
 * Returns -1 with ValueError where there is no reference. */
static int use_naive(op_call *call, int naive, int cpu_has_reference) {
    if (!naive)
        return 0;
    const char *name = call->backend->ops->name;
    if (strcmp(name, "cpu") == 0) {
        if (cpu_has_reference)
            return 1;
        raise_value(call, "param 'naive': the cpu backend has no separate reference kernel for "
                          "this op (its kernel is the plain form)");
        return -1;
    }
#ifdef MC_HAVE_CUDA
    if (strcmp(name, "cuda") == 0) {
        mc_cuda_set_naive(call->backend, 1);
        return 0;
    }
#endif
    raise_value(call, "param 'naive': this backend has no reference kernels");
    return -1;
}

static PyObject *run_gemm(op_call *call) {
    static const char *const keys[] = {"trans_a", "trans_b", "alpha", "beta", NULL};
    int trans_a, trans_b;
    float alpha, beta;
    operand *in[3];
    if (check_param_keys(call, keys) < 0 || param_bool(call, "trans_a", 0, &trans_a) < 0 ||
        param_bool(call, "trans_b", 0, &trans_b) < 0 ||
        param_float(call, "alpha", 0, 1.0f, &alpha) < 0 ||
        param_float(call, "beta", 0, 0.0f, &beta) < 0 ||
        fetch_args(call, SPECS(IN("A", 2, LAYOUT_STRIDED), IN("B", 2, LAYOUT_STRIDED),
                               OPT_IN("C", 2, LAYOUT_STRIDED)), in) < 0)
        return NULL;
    operand *a = in[0], *b = in[1], *c = in[2];
    int64_t m = trans_a ? a->shape[1] : a->shape[0];
    int64_t k = trans_a ? a->shape[0] : a->shape[1];
    int64_t n = trans_b ? b->shape[0] : b->shape[1];
    dim_rule b_rule_nt[] = {RULE_EQ(k), RULE_ANY}, b_rule_t[] = {RULE_ANY, RULE_EQ(k)};
    if (check_shape(call, b, trans_b ? b_rule_t : b_rule_nt) < 0 ||
        output_operand(call, &c, "C", 2, (int64_t[]){m, n}) < 0)
        return NULL;
    RETURN_OP(call, c, gemm, trans_a, trans_b, m, n, k, alpha, a->device, operand_ld(a),
              b->device, operand_ld(b), beta, c->device, operand_ld(c));
}

/* Optional param "wtype": the backend's linear_wtype for this call. */
static int param_wtype(op_call *call, mc_wtype *out) {
    *out = MC_WTYPE_F32;
    PyObject *obj = PyDict_GetItemString(call->params, "wtype");
    if (obj == NULL)
        return 0;
    const char *name = PyUnicode_Check(obj) ? PyUnicode_AsUTF8(obj) : NULL;
    if (name == NULL) {
        PyErr_Clear();
        raise_value(call, "param 'wtype' must be 'fp32', 'bf16' or 'fp16'");
        return -1;
    }
    return mcpy_parse_wtype(name, out);
}

/* Replaces the host array of a weight operand by `fresh` (a new reference,
 * C order) and describes it. */
static int replace_weight(op_call *call, operand *w, PyArrayObject *fresh) {
    if (fresh == NULL)
        return -1;
    Py_DECREF(w->host);
    w->host = fresh;
    w->typenum = PyArray_TYPE(fresh);
    if (!describe_layout(w, fresh, 0)) {
        PyErr_Format(PyExc_RuntimeError, "%s: cannot lay out the converted weight", call->op_name);
        return -1;
    }
    return 0;
}

/* Replaces a float32 weight operand by its 16-bit bits (round to nearest
 * even, as mc_bind's MC_BIND_LINEAR does at model load). */
static int narrow_weight(op_call *call, operand *w, mc_wtype wtype) {
    PyArrayObject *bits = (PyArrayObject *)PyArray_SimpleNew(2, PyArray_DIMS(w->host), NPY_UINT16);
    if (bits == NULL)
        return -1;
    const float *src = PyArray_DATA(w->host);
    uint16_t *dst = PyArray_DATA(bits);
    npy_intp n = PyArray_SIZE(bits);
    for (npy_intp i = 0; i < n; i++)
        dst[i] = mc_wtype_pack(wtype, src[i]);
    return replace_weight(call, w, bits);
}

/* PyTorch's [cout, cin, kh, kw] convolution weight repacked to the ops'
 * [cout, kh, kw, cin] (C order). */
static int repack_conv_weight(op_call *call, operand *w) {
    npy_intp order[4] = {0, 2, 3, 1};
    PyArray_Dims permutation = {order, 4};
    PyObject *view = PyArray_Transpose(w->host, &permutation);
    if (view == NULL)
        return -1;
    PyObject *packed = PyArray_NewCopy((PyArrayObject *)view, NPY_CORDER);
    Py_DECREF(view);
    return replace_weight(call, w, (PyArrayObject *)packed);
}

/* W bound as a model's weight is (mc_bind calls bind_linear), then the op:
 * the path a model's linear takes (the CPU's column panels for fp32). The
 * call's release of W forgets it again. With `w_rewrite` (the harness's
 * check of a write into a bound weight: the CPU must drop the panels and
 * make them again from the new values, not reuse the old ones) its values
 * are then copied into W's buffer with the backend's copy and the call runs
 * again; y is the second call's. */
static mc_status bind_and_run_linear(mc_backend *be, const float *x, int64_t ldx, int64_t rows, int64_t in,
                                     void *w, const void *w_rewrite, const float *bias, int64_t out, mc_act act,
                                     float beta, float *y, int64_t ldy, mc_err *err) {
    if (be->ops->bind_linear != NULL)
        MC_TRY(be->ops->bind_linear(be, w, out, in, err));
    MC_TRY(be->ops->linear(be, x, ldx, rows, in, w, bias, out, act, beta, y, ldy, err));
    if (w_rewrite == NULL)
        return MC_OK;
    MC_TRY(be->ops->copy(be, w, w_rewrite, (size_t)(out * in) * sizeof(float), err));
    return be->ops->linear(be, x, ldx, rows, in, w, bias, out, act, beta, y, ldy, err);
}

static PyObject *run_linear(op_call *call) {
    static const char *const keys[] = {"act", "beta", "wtype", NULL};
    mc_act act;
    float beta;
    mc_wtype wtype = MC_WTYPE_F32;
    operand *in[5];
    if (check_param_keys(call, keys) < 0 || param_act(call, "act", 0, &act) < 0 ||
        param_float(call, "beta", 0, 0.0f, &beta) < 0 || check_arity(call, 2, 5) < 0 ||
        param_wtype(call, &wtype) < 0)
        return NULL;
    if (beta != 0.0f && beta != 1.0f)
        return raise_value(call, "param 'beta' must be 0 or 1");
    if (beta == 1.0f && act != MC_ACT_NONE)
        return raise_value(call, "param 'act' must be 'none' when beta == 1");
    if (fetch_args(call, SPECS(IN("x", 2, LAYOUT_STRIDED), IN("W", 2, LAYOUT_CONTIGUOUS),
                               OPT_IN("bias", 1, LAYOUT_CONTIGUOUS), OPT_IN("y", 2, LAYOUT_STRIDED),
                               OPT_IN("w_rewrite", 2, LAYOUT_CONTIGUOUS)),
                   in) < 0)
        return NULL;
    operand *x = in[0], *w = in[1], *bias = in[2], *y = in[3], *w_rewrite = in[4];
    int64_t rows = x->shape[0], width = x->shape[1], out = w->shape[0];
    if (check_shape(call, w, (dim_rule[]){RULE_ANY, RULE_EQ(width)}) < 0 ||
        (bias != NULL && check_dims(call, bias, &out) < 0) ||
        (w_rewrite != NULL && check_dims(call, w_rewrite, w->shape) < 0) ||
        (wtype != MC_WTYPE_F32 && narrow_weight(call, w, wtype) < 0) ||
        output_operand(call, &y, "y", 2, (int64_t[]){rows, out}) < 0)
        return NULL;
    /* The second call would add onto the first's y; 16-bit weights have no
     * panels (and W_rewrite would need narrowing too). */
    if (w_rewrite != NULL && (beta != 0.0f || wtype != MC_WTYPE_F32))
        return raise_value(call, "argument 'w_rewrite' needs beta 0 and wtype fp32");
    call->backend->linear_wtype = wtype;
    RETURN_RUN(call, y,
               bind_and_run_linear(call->backend, x->device, operand_ld(x), rows, width, w->device,
                                   DEVICE_OR_NULL(w_rewrite), DEVICE_OR_NULL(bias), out, act, beta, y->device,
                                   operand_ld(y), &call->err));
}

static PyObject *run_layernorm(op_call *call) {
    static const char *const keys[] = {"eps", "inplace", "mod_period", NULL};
    float eps;
    int inplace;
    long long period;
    operand *in[5];
    if (check_param_keys(call, keys) < 0 || param_float(call, "eps", 1, 0.0f, &eps) < 0 ||
        param_bool(call, "inplace", 0, &inplace) < 0 ||
        param_integer(call, "mod_period", 0, 1, 1, LLONG_MAX, &period) < 0 ||
        fetch_args(call, SPECS(IN("x", 2, LAYOUT_STRIDED), OPT_IN("w", 1, LAYOUT_CONTIGUOUS),
                               OPT_IN("b", 1, LAYOUT_CONTIGUOUS), OPT_IN("shift", 2, LAYOUT_STRIDED),
                               OPT_IN("scale", 2, LAYOUT_STRIDED)), in) < 0)
        return NULL;
    operand *x = in[0], *w = in[1], *b = in[2], *shift = in[3], *scale = in[4];
    if (eps <= 0.0f)
        return raise_value(call, "param 'eps' must be positive");
    if (b != NULL && w == NULL)
        return raise_value(call, "argument 'b' needs argument 'w'");
    if ((shift == NULL) != (scale == NULL))
        return raise_value(call, "arguments 'shift' and 'scale' come together");
    int64_t rows = x->shape[0], dim = x->shape[1];
    const int64_t mod_shape[2] = {(rows + period - 1) / period, dim};
    if ((w != NULL && check_dims(call, w, &dim) < 0) ||
        (b != NULL && check_dims(call, b, &dim) < 0) ||
        (shift != NULL && check_dims(call, shift, mod_shape) < 0) ||
        (scale != NULL && check_dims(call, scale, mod_shape) < 0))
        return NULL;
    /* shift and scale share ld_mod. */
    if (shift != NULL && operand_ld(shift) != operand_ld(scale) &&
        (make_contiguous(call, shift) < 0 || make_contiguous(call, scale) < 0))
        return NULL;
    operand *y = x;
    if (!inplace && (y = new_zeros(call, "y", NPY_FLOAT, 2, x->shape)) == NULL)
        return NULL;
    RETURN_OP(call, y, layernorm, x->device, operand_ld(x), rows, dim, DEVICE_OR_NULL(w),
              DEVICE_OR_NULL(b), eps, DEVICE_OR_NULL(shift), DEVICE_OR_NULL(scale),
              shift != NULL ? operand_ld(shift) : dim, (int64_t)period, y->device, operand_ld(y));
}

static PyObject *run_activation(op_call *call) {
    static const char *const keys[] = {"act", NULL};
    mc_act act;
    operand *x;
    if (check_param_keys(call, keys) < 0 || param_act(call, "act", 1, &act) < 0 ||
        fetch_args(call, SPECS(IN("x", 2, LAYOUT_STRIDED)), &x) < 0)
        return NULL;
    RETURN_OP(call, x, activation, act, x->device, operand_ld(x), x->shape[0], x->shape[1]);
}

static PyObject *run_add_rows(op_call *call) {
    static const char *const keys[] = {"period", NULL};
    operand *in[2];
    long long period;
    if (check_param_keys(call, keys) < 0 ||
        fetch_args(call, SPECS(IN("y", 2, LAYOUT_STRIDED), IN("v", 2, LAYOUT_STRIDED)), in) < 0)
        return NULL;
    operand *y = in[0], *v = in[1];
    if (check_shape(call, v, (dim_rule[]){RULE_GE(1), RULE_EQ(y->shape[1])}) < 0 ||
        param_integer(call, "period", 0, v->shape[0], 1, v->shape[0], &period) < 0)
        return NULL;
    RETURN_OP(call, y, add_rows, y->device, operand_ld(y), y->shape[0], y->shape[1], v->device,
              operand_ld(v), period);
}

static PyObject *run_gated_add(op_call *call) {
    static const char *const keys[] = {"gate_period", NULL};
    long long period;
    operand *in[3];
    if (check_param_keys(call, keys) < 0 ||
        param_integer(call, "gate_period", 0, 1, 1, LLONG_MAX, &period) < 0 ||
        fetch_args(call, SPECS(IN("y", 2, LAYOUT_STRIDED), IN("u", 2, LAYOUT_STRIDED),
                               IN("gate", 2, LAYOUT_STRIDED)), in) < 0)
        return NULL;
    operand *y = in[0], *u = in[1], *gate = in[2];
    const int64_t gate_shape[2] = {(y->shape[0] + period - 1) / period, y->shape[1]};
    if (check_dims(call, u, y->shape) < 0 || check_dims(call, gate, gate_shape) < 0)
        return NULL;
    RETURN_OP(call, y, gated_add, y->device, operand_ld(y), u->device, operand_ld(u), gate->device,
              operand_ld(gate), (int64_t)period, y->shape[0], y->shape[1]);
}

/* Every index in [0, limit); with `distinct`, no index twice. */
static int check_indices(op_call *call, const operand *idx, int64_t limit, int distinct) {
    const int32_t *values = PyArray_DATA(idx->host);
    unsigned char *seen = NULL;
    if (distinct && limit > 0 && (seen = PyMem_Calloc((size_t)limit, 1)) == NULL) {
        mcpy_no_memory("the index check's table", (size_t)limit);
        return -1;
    }
    int result = 0;
    for (int64_t i = 0; i < idx->shape[0] && result == 0; i++) {
        int32_t v = values[i];
        if (v < 0 || v >= limit) {
            PyErr_Format(PyExc_ValueError,
                         "%s: argument 'idx': idx[%lld] = %d is outside [0, %lld)", call->op_name,
                         (long long)i, (int)v, (long long)limit);
            result = -1;
        } else if (seen != NULL && seen[v]) {
            PyErr_Format(PyExc_ValueError,
                         "%s: argument 'idx': index %d appears twice (the order of the writes is "
                         "not defined)",
                         call->op_name, (int)v);
            result = -1;
        } else if (seen != NULL) {
            seen[v] = 1;
        }
    }
    PyMem_Free(seen);
    return result;
}

#define IDX_IN {"idx", NPY_INT32, 1, ARG_REQUIRED, LAYOUT_CONTIGUOUS}

static PyObject *run_gather_rows(op_call *call) {
    static const char *const keys[] = {NULL};
    operand *in[2], *dst;
    if (check_param_keys(call, keys) < 0 ||
        fetch_args(call, SPECS(IN("src", 2, LAYOUT_STRIDED), IDX_IN), in) < 0)
        return NULL;
    operand *src = in[0], *idx = in[1];
    int64_t rows = idx->shape[0], dim = src->shape[1];
    if (check_indices(call, idx, src->shape[0], 0) < 0 ||
        (dst = new_zeros(call, "dst", NPY_FLOAT, 2, (int64_t[]){rows, dim})) == NULL)
        return NULL;
    RETURN_OP(call, dst, gather_rows, src->device, operand_ld(src), idx->device, rows, dim,
              dst->device, operand_ld(dst));
}

static PyObject *run_scatter_rows(op_call *call) {
    static const char *const keys[] = {NULL};
    operand *in[3];
    if (check_param_keys(call, keys) < 0 ||
        fetch_args(call, SPECS(IN("src", 2, LAYOUT_STRIDED), IDX_IN, IN("dst", 2, LAYOUT_STRIDED)),
                   in) < 0)
        return NULL;
    operand *src = in[0], *idx = in[1], *dst = in[2];
    if (check_dims(call, idx, src->shape) < 0 ||
        check_shape(call, dst, (dim_rule[]){RULE_ANY, RULE_EQ(src->shape[1])}) < 0 ||
        check_indices(call, idx, dst->shape[0], 1) < 0)
        return NULL;
    RETURN_OP(call, dst, scatter_rows, src->device, operand_ld(src), idx->device, src->shape[0],
              src->shape[1], dst->device, operand_ld(dst));
}

/* heads (required) and the head width of `width` columns; -1 with
 * ValueError naming `arg` unless width is a positive multiple of heads. */
static int param_heads(op_call *call, long long max_heads, const char *arg, int64_t width,
                       long long *heads, int *head_dim) {
    if (param_integer(call, "heads", 1, 0, 1, max_heads, heads) < 0)
        return -1;
    if (width % *heads != 0 || width / *heads == 0 || width / *heads > INT_MAX_LL) {
        PyErr_Format(PyExc_ValueError,
                     "%s: argument '%s': width %lld is not a positive multiple of heads = %lld",
                     call->op_name, arg, (long long)width, *heads);
        return -1;
    }
    *head_dim = (int)(width / *heads);
    return 0;
}

static PyObject *run_attention(op_call *call) {
    static const char *const keys[] = {"heads", "scale", "naive", "wtype", NULL};
    static const char *const k_names[] = {"k1", "k2", "k3", "k4", "k5", "k6", "k7", "k8"};
    static const char *const v_names[] = {"v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8"};
    const int max_segments = (int)(sizeof k_names / sizeof k_names[0]);
    Py_ssize_t n_inputs = PyTuple_GET_SIZE(call->inputs);
    long long heads;
    int head_dim, naive;
    double scale;
    mc_wtype wtype;
    operand *q, *out;
    if (check_param_keys(call, keys) < 0 ||
        param_bool(call, "naive", 0, &naive) < 0 || use_naive(call, naive, 0) < 0 ||
        param_wtype(call, &wtype) < 0)
        return NULL;
    call->backend->linear_wtype = wtype; /* 16-bit attention (ops.h) */
    if (n_inputs < 3 || n_inputs % 2 == 0 || (n_inputs - 1) / 2 > max_segments) {
        PyErr_Format(PyExc_ValueError,
                     "attention: expected inputs (q, k1, v1, ..., kS, vS) with 1 <= S <= %d, got "
                     "%zd inputs",
                     max_segments, n_inputs);
        return NULL;
    }
    if (fetch_array(call, 0, "q", NPY_FLOAT, 3, ARG_REQUIRED, LAYOUT_STRIDED, &q) < 0 ||
        param_heads(call, INT_MAX_LL, "q", q->shape[2], &heads, &head_dim) < 0 ||
        param_double(call, "scale", 0, 1.0 / sqrt((double)head_dim), &scale) < 0)
        return NULL;
    int64_t batch = q->shape[0], nq = q->shape[1], width = q->shape[2];
    int nsegs = (int)((n_inputs - 1) / 2);
    mc_kv_segment *segs = PyMem_Calloc((size_t)nsegs, sizeof *segs);
    if (segs == NULL)
        return mcpy_no_memory("the K/V segment list", (size_t)nsegs * sizeof *segs);
    call->segments = segs;
    operand *keys_of[8], *values_of[8];
    int64_t total_keys = 0;
    for (int s = 0; s < nsegs; s++) {
        operand *k, *v;
        if (fetch_array(call, 1 + 2 * s, k_names[s], NPY_FLOAT, 3, ARG_REQUIRED, LAYOUT_STRIDED,
                        &k) < 0 ||
            fetch_array(call, 2 + 2 * s, v_names[s], NPY_FLOAT, 3, ARG_REQUIRED, LAYOUT_STRIDED,
                        &v) < 0 ||
            check_shape(call, k, (dim_rule[]){RULE_EQ(batch), RULE_ANY, RULE_EQ(width)}) < 0 ||
            check_dims(call, v, k->shape) < 0)
            return NULL;
        /* A segment has one ld and one batch stride for k and v. */
        if ((operand_ld(k) != operand_ld(v) ||
             operand_batch_stride(k) != operand_batch_stride(v)) &&
            (make_contiguous(call, k) < 0 || make_contiguous(call, v) < 0))
            return NULL;
        keys_of[s] = k;
        values_of[s] = v;
        total_keys += k->shape[1];
    }
    if (total_keys == 0)
        return raise_value(call, "the segments hold no keys (every k has 0 rows)");
    if ((out = new_zeros(call, "out", NPY_FLOAT, 3, q->shape)) == NULL || upload_all(call) < 0)
        return NULL;
    for (int s = 0; s < nsegs; s++) {
        segs[s].k = keys_of[s]->device;
        segs[s].v = values_of[s]->device;
        segs[s].rows = keys_of[s]->shape[1];
        segs[s].ld = operand_ld(keys_of[s]);
        segs[s].batch_stride = operand_batch_stride(keys_of[s]);
    }
    RETURN_OP(call, out, attention, batch, nq, (int)heads, head_dim, (float)scale, q->device,
              operand_ld(q), operand_batch_stride(q), segs, nsegs, out->device, operand_ld(out),
              operand_batch_stride(out));
}

static PyObject *run_groupnorm(op_call *call) {
    static const char *const keys[] = {"groups", "eps", "swish", "inplace", NULL};
    long long groups;
    float eps;
    int swish, inplace;
    operand *in[3];
    if (check_param_keys(call, keys) < 0 ||
        param_integer(call, "groups", 1, 0, 1, INT_MAX_LL, &groups) < 0 ||
        param_float(call, "eps", 1, 0.0f, &eps) < 0 || param_bool(call, "swish", 0, &swish) < 0 ||
        param_bool(call, "inplace", 0, &inplace) < 0 ||
        fetch_args(call, SPECS(IN("x", 3, LAYOUT_CONTIGUOUS), OPT_IN("w", 1, LAYOUT_CONTIGUOUS),
                               OPT_IN("b", 1, LAYOUT_CONTIGUOUS)), in) < 0)
        return NULL;
    operand *x = in[0], *w = in[1], *b = in[2];
    int64_t channels = x->shape[2];
    if (eps <= 0.0f)
        return raise_value(call, "param 'eps' must be positive");
    if (channels % groups != 0) {
        PyErr_Format(PyExc_ValueError,
                     "groupnorm: param 'groups' = %lld does not divide %lld channels",
                     groups, (long long)channels);
        return NULL;
    }
    if ((w != NULL && check_dims(call, w, &channels) < 0) ||
        (b != NULL && check_dims(call, b, &channels) < 0))
        return NULL;
    operand *y = x;
    if (!inplace && (y = new_zeros(call, "y", NPY_FLOAT, 3, x->shape)) == NULL)
        return NULL;
    RETURN_OP(call, y, groupnorm, x->device, x->shape[0], x->shape[1], channels, (int)groups,
              DEVICE_OR_NULL(w), DEVICE_OR_NULL(b), eps, swish, y->device);
}

static PyObject *run_conv2d(op_call *call) {
    static const char *const keys[] = {"beta", "naive", "wtype", NULL};
    float beta;
    int naive, cpu_naive = 0;
    mc_wtype wtype;
    operand *in[4];
    if (check_param_keys(call, keys) < 0 || param_float(call, "beta", 0, 0.0f, &beta) < 0 ||
        param_bool(call, "naive", 0, &naive) < 0 || param_wtype(call, &wtype) < 0 ||
        (cpu_naive = use_naive(call, naive, 1)) < 0 ||
        fetch_args(call, SPECS(IN("x", 4, LAYOUT_CONTIGUOUS), IN("w", 4, LAYOUT_CONTIGUOUS),
                               OPT_IN("bias", 1, LAYOUT_CONTIGUOUS), OPT_IN("y", 4, LAYOUT_CONTIGUOUS)),
                   in) < 0)
        return NULL;
    operand *x = in[0], *w = in[1], *bias = in[2], *y = in[3];
    int64_t batch = x->shape[0], height = x->shape[1], width = x->shape[2], cin = x->shape[3];
    int64_t cout = w->shape[0], ksize = w->shape[2];
    if (check_shape(call, w, (dim_rule[]){RULE_ANY, RULE_EQ(cin), RULE_ANY, RULE_EQ(ksize)}) < 0)
        return NULL;
    if (ksize % 2 == 0 || ksize > INT_MAX_LL) {
        PyErr_Format(PyExc_ValueError,
                     "conv2d: argument 'w': kernel size %lld must be odd (padding k // 2 keeps "
                     "the size)",
                     (long long)ksize);
        return NULL;
    }
    if ((bias != NULL && check_dims(call, bias, &cout) < 0) ||
        output_operand(call, &y, "y", 4, (int64_t[]){batch, height, width, cout}) < 0 ||
        repack_conv_weight(call, w) < 0)
        return NULL;
    call->backend->linear_wtype = wtype; /* a 16-bit convolution (ops.h) */
    if (cpu_naive)
        RETURN_RUN(call, y, mc_cpu_conv2d_naive(call->backend, x->device, batch, height, width, cin,
                                                w->device, DEVICE_OR_NULL(bias), cout, (int)ksize,
                                                beta, y->device, &call->err));
    RETURN_OP(call, y, conv2d, x->device, batch, height, width, cin, w->device, DEVICE_OR_NULL(bias),
              cout, (int)ksize, beta, y->device);
}

static PyObject *run_upsample_nearest2x(op_call *call) {
    static const char *const keys[] = {NULL};
    operand *x, *y;
    if (check_param_keys(call, keys) < 0 ||
        fetch_args(call, SPECS(IN("x", 4, LAYOUT_CONTIGUOUS)), &x) < 0)
        return NULL;
    int64_t out_shape[4] = {x->shape[0], 2 * x->shape[1], 2 * x->shape[2], x->shape[3]};
    if ((y = new_zeros(call, "y", NPY_FLOAT, 4, out_shape)) == NULL)
        return NULL;
    RETURN_OP(call, y, upsample_nearest2x, x->device, x->shape[0], x->shape[1], x->shape[2],
              x->shape[3], y->device);
}

static PyObject *run_cfg_combine(op_call *call) {
    static const char *const keys[] = {"scale", "channels", NULL};
    float scale;
    long long channels;
    operand *in[2], *out;
    if (check_param_keys(call, keys) < 0 || param_float(call, "scale", 1, 0.0f, &scale) < 0 ||
        fetch_args(call, SPECS(IN("cond", 2, LAYOUT_STRIDED), IN("uncond", 2, LAYOUT_STRIDED)),
                   in) < 0)
        return NULL;
    operand *cond = in[0], *uncond = in[1];
    if (param_integer(call, "channels", 0, cond->shape[1], 1,
                      cond->shape[1] < INT_MAX_LL ? cond->shape[1] : INT_MAX_LL, &channels) < 0 ||
        check_shape(call, uncond, (dim_rule[]){RULE_EQ(cond->shape[0]), RULE_GE(channels)}) < 0)
        return NULL;
    int64_t rows = cond->shape[0];
    if ((out = new_zeros(call, "out", NPY_FLOAT, 2, (int64_t[]){rows, channels})) == NULL)
        return NULL;
    RETURN_OP(call, out, cfg_combine, cond->device, operand_ld(cond), uncond->device,
              operand_ld(uncond), rows, (int)channels, scale, out->device, operand_ld(out));
}

static PyObject *run_ddpm_step(op_call *call) {
    static const char *const keys[] = {"sqrt_recip_alphas_cumprod",
                                       "sqrt_recipm1_alphas_cumprod",
                                       "posterior_mean_coef1",
                                       "posterior_mean_coef2",
                                       "log_beta",
                                       "posterior_log_variance",
                                       "noise_scale",
                                       NULL};
    mc_ddpm_coefs coefs;
    float *fields[] = {&coefs.sqrt_recip_alphas_cumprod, &coefs.sqrt_recipm1_alphas_cumprod,
                       &coefs.posterior_mean_coef1, &coefs.posterior_mean_coef2, &coefs.log_beta,
                       &coefs.posterior_log_variance, &coefs.noise_scale};
    operand *in[4];
    if (check_param_keys(call, keys) < 0)
        return NULL;
    for (int i = 0; keys[i] != NULL; i++)
        if (param_float(call, keys[i], 1, 0.0f, fields[i]) < 0)
            return NULL;
    if (fetch_args(call, SPECS(IN("x", 2, LAYOUT_CONTIGUOUS), IN("eps", 2, LAYOUT_STRIDED),
                               IN("v", 2, LAYOUT_STRIDED), OPT_IN("noise", 2, LAYOUT_CONTIGUOUS)),
                   in) < 0)
        return NULL;
    operand *x = in[0], *eps = in[1], *v = in[2], *noise = in[3];
    int64_t rows = x->shape[0], channels = x->shape[1];
    if (channels > INT_MAX_LL)
        return raise_value(call, "argument 'x': too many channels");
    dim_rule head_out[] = {RULE_EQ(rows), RULE_GE(channels)};
    if (check_shape(call, eps, head_out) < 0 || check_shape(call, v, head_out) < 0 ||
        (noise != NULL && check_dims(call, noise, x->shape) < 0))
        return NULL;
    if (noise == NULL && coefs.noise_scale != 0.0f)
        return raise_value(call, "argument 'noise' is required when noise_scale != 0");
    RETURN_OP(call, x, ddpm_step, x->device, rows, (int)channels, eps->device, operand_ld(eps),
              v->device, operand_ld(v), DEVICE_OR_NULL(noise), &coefs);
}

static PyObject *run_token_normals(op_call *call) {
    static const char *const keys[] = {"seed", "stream", "step", "channels", NULL};
    uint64_t seed;
    long long stream, step, channels;
    operand *in[2], *out;
    if (check_param_keys(call, keys) < 0 || param_u64(call, "seed", &seed) < 0 ||
        param_integer(call, "stream", 1, 0, 0, 0xffff, &stream) < 0 ||
        param_integer(call, "step", 1, 0, 0, 0xffff, &step) < 0 ||
        param_integer(call, "channels", 1, 0, 1, 64, &channels) < 0 ||
        fetch_args(call, SPECS({"image", NPY_UINT32, 1, ARG_REQUIRED, LAYOUT_CONTIGUOUS},
                               {"position", NPY_UINT32, 1, ARG_REQUIRED, LAYOUT_CONTIGUOUS}), in) < 0)
        return NULL;
    operand *image = in[0], *position = in[1];
    int64_t rows = image->shape[0];
    if (check_dims(call, position, image->shape) < 0 ||
        (out = new_zeros(call, "out", NPY_FLOAT, 2, (int64_t[]){rows, channels})) == NULL)
        return NULL;
    RETURN_OP(call, out, token_normals, seed, (uint32_t)stream, (uint32_t)step, image->device,
              position->device, rows, (int)channels, out->device);
}

static PyObject *run_axpby(op_call *call) {
    static const char *const keys[] = {"a", "b", NULL};
    float a, b;
    operand *in[2];
    if (check_param_keys(call, keys) < 0 || param_float(call, "a", 1, 0.0f, &a) < 0 ||
        param_float(call, "b", 1, 0.0f, &b) < 0 ||
        fetch_args(call, SPECS(IN("x", 2, LAYOUT_STRIDED), IN("y", 2, LAYOUT_CONTIGUOUS)), in) < 0)
        return NULL;
    operand *x = in[0], *y = in[1];
    if (check_dims(call, y, x->shape) < 0)
        return NULL;
    RETURN_OP(call, y, axpby, a, x->device, operand_ld(x), b, y->device, operand_ld(y), x->shape[0],
              x->shape[1]);
}

static PyObject *run_cosine_rows(op_call *call) {
    static const char *const keys[] = {"heads", NULL};
    long long heads;
    int head_dim;
    operand *in[2], *out;
    if (check_param_keys(call, keys) < 0 ||
        fetch_args(call, SPECS(IN("a", 2, LAYOUT_STRIDED), IN("b", 2, LAYOUT_STRIDED)), in) < 0)
        return NULL;
    operand *a = in[0], *b = in[1];
    int64_t rows = a->shape[0];
    if (check_dims(call, b, a->shape) < 0 ||
        param_heads(call, 4096, "a", a->shape[1], &heads, &head_dim) < 0 ||
        (out = new_zeros(call, "out", NPY_FLOAT, 1, &rows)) == NULL)
        return NULL;
    RETURN_OP(call, out, cosine_rows, a->device, operand_ld(a), b->device, operand_ld(b), rows,
              (int)heads, head_dim, out->device);
}

static PyObject *run_head_l2norm(op_call *call) {
    static const char *const keys[] = {"heads", NULL};
    long long heads;
    int head_dim;
    operand *in[2];
    if (check_param_keys(call, keys) < 0 ||
        fetch_args(call, SPECS(IN("x", 2, LAYOUT_STRIDED), OPT_IN("head_scale", 1, LAYOUT_CONTIGUOUS)),
                   in) < 0)
        return NULL;
    operand *x = in[0], *scale = in[1];
    if (param_heads(call, 4096, "x", x->shape[1], &heads, &head_dim) < 0 ||
        (scale != NULL && check_dims(call, scale, (int64_t[]){heads}) < 0))
        return NULL;
    RETURN_OP(call, x, head_l2norm, x->device, operand_ld(x), x->shape[0], (int)heads, head_dim,
              DEVICE_OR_NULL(scale));
}

static PyObject *run_attention_mass(op_call *call) {
    static const char *const keys[] = {"heads", "scale", NULL};
    long long heads;
    int head_dim;
    float scale;
    operand *in[2], *out;
    if (check_param_keys(call, keys) < 0 ||
        fetch_args(call, SPECS(IN("q", 3, LAYOUT_CONTIGUOUS), IN("k", 3, LAYOUT_CONTIGUOUS)), in) < 0)
        return NULL;
    operand *q = in[0], *k = in[1];
    if (check_shape(call, k, (dim_rule[]){RULE_EQ(q->shape[0]), RULE_GE(0), RULE_EQ(q->shape[2])}) < 0 ||
        param_heads(call, 4096, "q", q->shape[2], &heads, &head_dim) < 0 ||
        param_float(call, "scale", 0, (float)(1.0 / sqrt((double)head_dim)), &scale) < 0)
        return NULL;
    const int64_t batch = q->shape[0], nq = q->shape[1], nkeys = k->shape[1], width = q->shape[2];
    if ((out = new_zeros(call, "out", NPY_FLOAT, 2, (int64_t[]){batch, nkeys})) == NULL)
        return NULL;
    RETURN_OP(call, out, attention_mass, batch, nq, (int)heads, head_dim, scale, q->device, width,
              nq * width, k->device, width, nkeys * width, nkeys, out->device);
}

/* ------------------------------------------------------------------------
 * FID-Inception window ops. */

/* Whether a 4-D operand is an NHWC image batch with evenly spaced pixels
 * (row stride = width * pixel stride, image stride = height * row stride);
 * otherwise it is copied to C order. */
static int make_pixel_strided(op_call *call, operand *o) {
    int64_t ld = o->stride[2];
    if (o->stride[3] == 1 && o->stride[1] == o->shape[2] * ld &&
        o->stride[0] == o->shape[1] * o->stride[1])
        return 0;
    return make_contiguous(call, o);
}

static int param_window(op_call *call, mc_window2d *g, long long kh, long long kw,
                        long long stride_h_default, long long stride_w_default) {
    long long sh, sw, ph, pw;
    if (param_integer(call, "stride_h", 0, stride_h_default, 1, INT_MAX_LL, &sh) < 0 ||
        param_integer(call, "stride_w", 0, stride_w_default, 1, INT_MAX_LL, &sw) < 0 ||
        param_integer(call, "pad_h", 0, 0, 0, INT_MAX_LL, &ph) < 0 ||
        param_integer(call, "pad_w", 0, 0, 0, INT_MAX_LL, &pw) < 0)
        return -1;
    g->kh = (int)kh;
    g->kw = (int)kw;
    g->stride_h = (int)sh;
    g->stride_w = (int)sw;
    g->pad_h = (int)ph;
    g->pad_w = (int)pw;
    if (g->height + 2 * ph < kh || g->width + 2 * pw < kw) {
        PyErr_Format(PyExc_ValueError,
                     "%s: the %lldx%lld window does not fit the %lldx%lld input padded by "
                     "%lldx%lld",
                     call->op_name, kh, kw, (long long)g->height, (long long)g->width, ph, pw);
        return -1;
    }
    return 0;
}

/* The optional output y of a window op (*y as fetched): checked against
 * [B, OH, OW, C], or made as zeros (conv2d_ex with beta = 0 never reads it). */
static int window_output(op_call *call, const mc_window2d *g, int64_t channels, operand **y) {
    int64_t shape[4] = {g->batch, mc_window_out_h(g), mc_window_out_w(g), channels};
    int given = *y != NULL;
    if (output_operand(call, y, "y", 4, shape) < 0)
        return -1;
    return given ? make_pixel_strided(call, *y) : 0;
}

static PyObject *run_conv2d_ex(op_call *call) {
    static const char *const keys[] = {"stride_h", "stride_w", "pad_h", "pad_w", "beta",
                                       "relu",     "naive",    "wtype",  NULL};
    float beta;
    int relu, naive, cpu_naive = 0;
    mc_wtype wtype;
    operand *in[4];
    if (check_param_keys(call, keys) < 0 || param_float(call, "beta", 0, 0.0f, &beta) < 0 ||
        param_bool(call, "relu", 0, &relu) < 0 || param_bool(call, "naive", 0, &naive) < 0 ||
        param_wtype(call, &wtype) < 0 ||
        (cpu_naive = use_naive(call, naive, 1)) < 0 ||
        fetch_args(call, SPECS(IN("x", 4, LAYOUT_STRIDED), IN("w", 4, LAYOUT_CONTIGUOUS),
                               OPT_IN("bias", 1, LAYOUT_CONTIGUOUS), OPT_IN("y", 4, LAYOUT_STRIDED)),
                   in) < 0 ||
        make_pixel_strided(call, in[0]) < 0)
        return NULL;
    operand *x = in[0], *w = in[1], *bias = in[2], *y = in[3];
    int64_t cin = x->shape[3], cout = w->shape[0], kh = w->shape[2], kw = w->shape[3];
    if (check_shape(call, w, (dim_rule[]){RULE_GE(1), RULE_EQ(cin), RULE_GE(1), RULE_GE(1)}) < 0 ||
        (bias != NULL && check_dims(call, bias, &cout) < 0))
        return NULL;
    if (kh > INT_MAX_LL || kw > INT_MAX_LL)
        return raise_value(call, "argument 'w': kernel too large");
    mc_window2d g = {.batch = x->shape[0], .height = x->shape[1], .width = x->shape[2]};
    if (param_window(call, &g, kh, kw, 1, 1) < 0 || window_output(call, &g, cout, &y) < 0 ||
        repack_conv_weight(call, w) < 0)
        return NULL;
    call->backend->linear_wtype = wtype; /* a 16-bit convolution (ops.h) */
    if (cpu_naive)
        RETURN_RUN(call, y, mc_cpu_conv2d_ex_naive(call->backend, &g, x->device, cin, x->stride[2],
                                                   w->device, DEVICE_OR_NULL(bias), cout, beta, relu,
                                                   y->device, y->stride[2], &call->err));
    RETURN_OP(call, y, conv2d_ex, &g, x->device, cin, x->stride[2], w->device, DEVICE_OR_NULL(bias),
              cout, beta, relu, y->device, y->stride[2]);
}

/* Shared body of avg_pool2d (is_avg) and max_pool2d. */
static PyObject *run_pool(op_call *call, int is_avg) {
    static const char *const avg_keys[] = {"kh",    "kw",    "stride_h", "stride_w",
                                           "pad_h", "pad_w", "count_include_pad", NULL};
    /* max_pool2d takes the same keys without the last */
    static const char *const max_keys[] = {"kh", "kw", "stride_h", "stride_w", "pad_h", "pad_w",
                                           NULL};
    long long kh, kw;
    int include_pad = 0;
    operand *in[2];
    if (check_param_keys(call, is_avg ? avg_keys : max_keys) < 0 ||
        param_integer(call, "kh", 1, 0, 1, INT_MAX_LL, &kh) < 0 ||
        param_integer(call, "kw", 1, 0, 1, INT_MAX_LL, &kw) < 0 ||
        (is_avg && param_value(call, "count_include_pad") == NULL &&
         param_missing(call, "count_include_pad") < 0) ||
        (is_avg && param_bool(call, "count_include_pad", 0, &include_pad) < 0) ||
        fetch_args(call, SPECS(IN("x", 4, LAYOUT_STRIDED), OPT_IN("y", 4, LAYOUT_STRIDED)), in) < 0 ||
        make_pixel_strided(call, in[0]) < 0)
        return NULL;
    operand *x = in[0], *y = in[1];
    mc_window2d g = {.batch = x->shape[0], .height = x->shape[1], .width = x->shape[2]};
    int64_t channels = x->shape[3];
    if (param_window(call, &g, kh, kw, kh, kw) < 0)
        return NULL;
    if (g.pad_h > g.kh / 2 || g.pad_w > g.kw / 2)
        return raise_value(call, "padding must be at most half the window (kh // 2, kw // 2)");
    if (window_output(call, &g, channels, &y) < 0)
        return NULL;
    if (is_avg)
        RETURN_OP(call, y, avg_pool2d, &g, x->device, channels, x->stride[2], include_pad,
                  y->device, y->stride[2]);
    RETURN_OP(call, y, max_pool2d, &g, x->device, channels, x->stride[2], y->device, y->stride[2]);
}

static PyObject *run_avg_pool2d(op_call *call) { return run_pool(call, 1); }
static PyObject *run_max_pool2d(op_call *call) { return run_pool(call, 0); }

static PyObject *run_resize_bilinear_tf1(op_call *call) {
    static const char *const keys[] = {"out_h", "out_w", "normalize", NULL};
    long long out_h, out_w;
    int normalize;
    operand *x, *y;
    if (check_param_keys(call, keys) < 0 ||
        param_integer(call, "out_h", 1, 0, 1, 1 << 20, &out_h) < 0 ||
        param_integer(call, "out_w", 1, 0, 1, 1 << 20, &out_w) < 0 ||
        param_bool(call, "normalize", 0, &normalize) < 0 || check_arity(call, 1, 1) < 0)
        return NULL;
    PyObject *obj = PyTuple_GET_ITEM(call->inputs, 0);
    int typenum = PyArray_Check(obj) && PyArray_TYPE((PyArrayObject *)obj) == NPY_UINT8
                      ? NPY_UINT8
                      : NPY_FLOAT;
    if (fetch_array(call, 0, "x", typenum, 4, ARG_REQUIRED, LAYOUT_CONTIGUOUS, &x) < 0)
        return NULL;
    if (x->shape[1] < 1 || x->shape[2] < 1 || x->shape[3] < 1)
        return raise_value(call, "argument 'x': height, width and channels must be positive");
    int64_t shape[4] = {x->shape[0], out_h, out_w, x->shape[3]};
    if ((y = new_zeros(call, "y", NPY_FLOAT, 4, shape)) == NULL)
        return NULL;
    RETURN_OP(call, y, resize_bilinear_tf1, x->device,
              typenum == NPY_UINT8 ? MC_PIXEL_U8 : MC_PIXEL_F32, x->shape[0], x->shape[1],
              x->shape[2], x->shape[3], out_h, out_w, normalize, y->device);
}

/* Shared body of the VAR resize ops (resize_bicubic, resize_area): the
 * same inputs and params, the op chosen by `bicubic`. */
static PyObject *run_var_resize(op_call *call, int bicubic) {
    static const char *const keys[] = {"out_h", "out_w", NULL};
    long long out_h, out_w;
    operand *x, *y;
    if (check_param_keys(call, keys) < 0 ||
        param_integer(call, "out_h", 1, 0, 1, 1 << 20, &out_h) < 0 ||
        param_integer(call, "out_w", 1, 0, 1, 1 << 20, &out_w) < 0 ||
        fetch_args(call, SPECS(IN("x", 4, LAYOUT_CONTIGUOUS)), &x) < 0)
        return NULL;
    if (x->shape[1] < 1 || x->shape[2] < 1 || x->shape[3] < 1)
        return raise_value(call, "argument 'x': height, width and channels must be positive");
    int64_t shape[4] = {x->shape[0], out_h, out_w, x->shape[3]};
    if ((y = new_zeros(call, "y", NPY_FLOAT, 4, shape)) == NULL)
        return NULL;
    if (bicubic)
        RETURN_OP(call, y, resize_bicubic, x->device, x->shape[0], x->shape[1], x->shape[2],
                  x->shape[3], out_h, out_w, y->device);
    RETURN_OP(call, y, resize_area, x->device, x->shape[0], x->shape[1], x->shape[2], x->shape[3],
              out_h, out_w, y->device);
}

static PyObject *run_resize_bicubic(op_call *call) { return run_var_resize(call, 1); }
static PyObject *run_resize_area(op_call *call) { return run_var_resize(call, 0); }

/* ------------------------------------------------------------------------
 * VAR's sampling ops. */

#define LLONG_MIN_LL (-9223372036854775807LL - 1)
#define LLONG_MAX_LL 9223372036854775807LL
#define UINT32_IN(name) {name, NPY_UINT32, 1, ARG_REQUIRED, LAYOUT_CONTIGUOUS}

/* The size params of the sampling ops: each defaults to what the array
 * gives and may be set lower (never higher: the op must stay inside the
 * arrays), down to values the op itself refuses. */
static int param_size_override(op_call *call, const char *key, int64_t holds, int64_t *out) {
    long long v;
    if (param_integer(call, key, 0, holds, LLONG_MIN_LL, holds, &v) < 0)
        return -1;
    *out = v;
    return 0;
}

/* logits, image and position of a sampling op (inputs 0..2) with its sizes. */
static int fetch_logit_rows(op_call *call, operand **in, int count, int64_t *rows, int64_t *vocab,
                            int64_t *ld) {
    const arg_spec specs[] = {IN("logits", 2, LAYOUT_STRIDED), UINT32_IN("image"),
                              UINT32_IN("position"), OPT_IN("probs", 2, LAYOUT_STRIDED)};
    if (fetch_args(call, specs, count, in) < 0)
        return -1;
    operand *logits = in[0];
    if (check_dims(call, in[1], logits->shape) < 0 || check_dims(call, in[2], logits->shape) < 0)
        return -1;
    return param_size_override(call, "rows", logits->shape[0], rows) < 0 ||
                   param_size_override(call, "vocab", logits->shape[1], vocab) < 0 ||
                   param_size_override(call, "ld", operand_ld(logits), ld) < 0
               ? -1
               : 0;
}

static PyObject *run_sample_tokens(op_call *call) {
    static const char *const keys[] = {"seed", "step", "top_k", "top_p", "rows", "vocab", "ld", NULL};
    uint64_t seed;
    long long step, top_k;
    float top_p;
    int64_t rows, vocab, ld;
    operand *in[3], *tokens;
    if (check_param_keys(call, keys) < 0 || param_u64(call, "seed", &seed) < 0 ||
        param_integer(call, "step", 1, 0, 0, 0xffff, &step) < 0 ||
        param_integer(call, "top_k", 0, 0, LLONG_MIN_LL, LLONG_MAX_LL, &top_k) < 0 ||
        param_float(call, "top_p", 0, 0.0f, &top_p) < 0 ||
        fetch_logit_rows(call, in, 3, &rows, &vocab, &ld) < 0)
        return NULL;
    operand *logits = in[0], *image = in[1], *position = in[2];
    if ((tokens = new_zeros(call, "tokens", NPY_INT32, 1, logits->shape)) == NULL ||
        upload_all(call) < 0)
        return NULL;
    mc_status status;
    Py_BEGIN_ALLOW_THREADS
    status = call->backend->ops->sample_tokens(call->backend, logits->device, ld, rows, vocab,
                                               top_k, top_p, seed, (uint32_t)step, image->device,
                                               position->device, tokens->device, &call->err);
    Py_END_ALLOW_THREADS
    if (status != MC_OK)
        return mcpy_raise(&call->err);
    PyObject *token_array = download_operand(call, tokens);
    if (token_array == NULL)
        return NULL;
    PyObject *masked = download_operand(call, logits);
    if (masked == NULL) {
        Py_DECREF(token_array);
        return NULL;
    }
    return Py_BuildValue("(NN)", token_array, masked);
}

static PyObject *run_gumbel_softmax(op_call *call) {
    static const char *const keys[] = {"seed", "step", "tau", "logit_scale", "rows", "vocab",
                                       "ld", "ldp", NULL};
    uint64_t seed;
    long long step;
    float tau, logit_scale;
    int64_t rows, vocab, ld, ldp;
    operand *in[4];
    if (check_param_keys(call, keys) < 0 || param_u64(call, "seed", &seed) < 0 ||
        param_integer(call, "step", 1, 0, 0, 0xffff, &step) < 0 ||
        param_float(call, "tau", 1, 0.0f, &tau) < 0 ||
        param_float(call, "logit_scale", 0, 1.0f, &logit_scale) < 0 ||
        fetch_logit_rows(call, in, 4, &rows, &vocab, &ld) < 0)
        return NULL;
    operand *logits = in[0], *image = in[1], *position = in[2], *probs = in[3];
    if (output_operand(call, &probs, "probs", 2, logits->shape) < 0 ||
        param_size_override(call, "ldp", operand_ld(probs), &ldp) < 0)
        return NULL;
    RETURN_OP(call, probs, gumbel_softmax, logits->device, ld, rows, vocab, logit_scale, tau, seed,
              (uint32_t)step, image->device, position->device, probs->device, ldp);
}

static PyObject *run_pivotal_rows(op_call *call) {
    static const char *const keys[] = {"batch", "keep", NULL};
    long long batch, keep;
    operand *x, *out;
    if (check_param_keys(call, keys) < 0 ||
        param_integer(call, "batch", 0, 1, 1, INT32_MAX, &batch) < 0 ||
        param_integer(call, "keep", 1, 0, LLONG_MIN_LL, LLONG_MAX_LL, &keep) < 0 ||
        fetch_args(call, SPECS(IN("x", 2, LAYOUT_STRIDED)), &x) < 0)
        return NULL;
    if (x->shape[0] % batch != 0)
        return raise_value(call, "argument 'x': its row count is not a multiple of param 'batch'");
    const int64_t rows = x->shape[0] / batch;
    /* The op refuses keep outside [0, rows] itself; the result array is sized for a valid keep. */
    int64_t count = keep >= 0 && keep <= rows ? batch * keep : 0;
    if ((out = new_zeros(call, "out", NPY_INT32, 1, &count)) == NULL)
        return NULL;
    RETURN_OP(call, out, pivotal_rows, x->device, operand_ld(x), batch, rows, x->shape[1], keep, out->device);
}

/* ------------------------------------------------------------------------
 * The op table: one runner per entry of the op list, in its order. */

typedef PyObject *(*op_runner)(op_call *call);

static const op_runner op_runners[MC_OP_COUNT] = {
#define MC_OP(name, where, params, args, flops) run_##name,
#include "../backend/ops_list.h"
};

static PyObject *name_list(const char *const *names, int count) {
    PyObject *list = PyList_New(count);
    if (list == NULL)
        return NULL;
    for (int i = 0; i < count; i++) {
        PyObject *name = PyUnicode_FromString(names[i]);
        if (name == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, name);
    }
    return list;
}

static PyObject *py_backends(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    const char *names[BACKEND_COUNT];
    int count = 0;
    for (int i = 0; i < BACKEND_COUNT; i++)
        if (backend_table[i].usable == NULL || backend_table[i].usable())
            names[count++] = backend_table[i].name;
    return name_list(names, count);
}

static PyObject *py_op_names(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return name_list(mc_op_names, MC_OP_COUNT);
}

static PyObject *unknown_name(const char *what, const char *given, const char *const *valid,
                              int count) {
    char list[512];
    size_t used = 0;
    list[0] = '\0';
    for (int i = 0; i < count && used < sizeof list; i++)
        used += (size_t)snprintf(list + used, sizeof list - used, "%s%s", i ? ", " : "", valid[i]);
    PyErr_Format(PyExc_ValueError, "unknown %s '%s'; valid %ss: %s", what, given, what, list);
    return NULL;
}

/* The common param "threads": CPU threads of the cpu and guard backends for
 * this call (0, the default: all); the CUDA backend has none to set. */
static int param_threads(PyObject *params, const char *op_name, int *threads) {
    *threads = 0;
    PyObject *value = PyDict_GetItemString(params, "threads");
    if (value == NULL)
        return 0;
    long v = PyLong_Check(value) && !PyBool_Check(value) ? PyLong_AsLong(value) : -1;
    if (v < 0 || v > 4096) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: param 'threads' must be an integer in [0, 4096], got %R",
                     op_name, value);
        return -1;
    }
    *threads = (int)v;
    return 0;
}

static PyObject *py_run_op(PyObject *self, PyObject *args) {
    (void)self;
    const char *backend_name, *op_name;
    PyObject *inputs, *params;
    if (!PyArg_ParseTuple(args, "ssO!O!:run_op", &backend_name, &op_name, &PyTuple_Type, &inputs,
                          &PyDict_Type, &params))
        return NULL;
    int op = 0;
    while (op < MC_OP_COUNT && strcmp(mc_op_names[op], op_name) != 0)
        op++;
    if (op == MC_OP_COUNT)
        return unknown_name("op", op_name, mc_op_names, MC_OP_COUNT);
    const backend_entry *backend = NULL;
    for (int i = 0; i < BACKEND_COUNT && backend == NULL; i++)
        if (strcmp(backend_table[i].name, backend_name) == 0)
            backend = &backend_table[i];
    if (backend == NULL) {
        const char *names[BACKEND_COUNT];
        for (int i = 0; i < BACKEND_COUNT; i++)
            names[i] = backend_table[i].name;
        return unknown_name("backend", backend_name, names, BACKEND_COUNT);
    }
    int threads;
    if (param_threads(params, mc_op_names[op], &threads) < 0)
        return NULL;

    op_call call;
    memset(&call, 0, sizeof call);
    call.op_name = mc_op_names[op];
    call.inputs = inputs;
    call.params = params;
    /* Inputs, plus one binding-made output. */
    call.operand_capacity = (int)PyTuple_GET_SIZE(inputs) + 1;
    call.operands = PyMem_Calloc((size_t)call.operand_capacity, sizeof(operand));
    if (call.operands == NULL)
        return mcpy_no_memory("the op's operand list", (size_t)call.operand_capacity * sizeof(operand));
    if (backend->create(&call.backend, threads, &call.err) != MC_OK) {
        PyMem_Free(call.operands);
        return mcpy_raise(&call.err);
    }
    PyObject *result;
    if (!mc_op_supported(call.backend->ops, (mc_op_id)op))
        result = PyErr_Format(PyExc_NotImplementedError, "op %s is not implemented on backend %s",
                              call.op_name, call.backend->ops->name);
    else
        result = op_runners[op](&call);
    release_call(&call);
    return result;
}

static PyMethodDef ops_methods[] = {
    {"backends", py_backends, METH_NOARGS, "backends() -> names of the backends built in."},
    {"op_names", py_op_names, METH_NOARGS, "op_names() -> every op of the backend op table."},
    {"run_op", py_run_op, METH_VARARGS,
     "run_op(backend, name, inputs: tuple, params: dict) -> numpy.ndarray\n\n"
     "Runs one backend op on host arrays (conventions at the top of py_ops.c)."},
    {NULL, NULL, 0, NULL},
};

int mcpy_ops_init(PyObject *module) { return PyModule_AddFunctions(module, ops_methods); }

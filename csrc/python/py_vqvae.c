/* Python binding of VAR's multi-scale VQVAE (marcache._C.VQVAE): the
 * decoder, and the scale-by-scale pieces of csrc/models/vqvae.h on host
 * arrays, for tests and for decoding token maps made elsewhere.
 *
 *   VQVAE(path, num_threads=0, device='cpu', dtype='fp32')
 *                              (dtype bf16/fp16: the convolutions as autocast's, ops.h)
 *   .config                    dict: vocab, z_channels, ch, ch_mult, num_res_blocks,
 *                              num_phi, upscale, quant_resi, num_params
 *   .num_params                int
 *   .decode(f_hat)             float32 [B, side, side, z] -> float32 [B, H, W, 3] in [-1, 1]
 *   .decode_uint8(f_hat)       -> uint8 [B, H, W, 3] (mc_vae_to_uint8, as MAR)
 *   .embed(idx)                integer array [...] -> float32 [..., z] (codebook rows)
 *   .idx_to_fhat(idx_list, patch_nums)
 *                              idx_list[si]: integer [B, pn_si^2] for the first k scales of
 *                              patch_nums -> f_hat float32 [B, side, side, z], side = patch_nums[-1]
 *   .fhat_to_next(f_hat, pn)   -> float32 [B, pn, pn, z] (area resize: the next scale's input)
 *   .phi_index(si, n_scales)   -> the Phi conv of scale si (mc_vqvae_phi_index)
 *
 * Every call copies its inputs to the backend, runs with the GIL released
 * (one call at a time per object: the model's workspace is shared) and
 * copies the result back. */
#include "py_model.h"
#include "py_vqvae.h"

#include <math.h>
#include <pythread.h>
#include <string.h>

#include "../models/vqvae.h"

/* At most this many scales in patch_nums (VAR's released models have 10). */
#define VQ_MAX_SCALES 64
/* Largest image side decode produces. */
#define VQ_MAX_OUTPUT_SIDE 16384

typedef struct {
    MCPY_MODEL_HEAD /* the lock: one call at a time, the model's workspace is shared */
    mc_vqvae *vq;
    mc_vqvae_info info;
} VQVAEObject;

/* ------------------------------------------------------------ array helpers */

/* An integer array-like of token ids as a new C-contiguous int32 array,
 * every id checked to be in [0, vocab). */
static PyArrayObject *token_ids_arg(PyObject *obj, int64_t vocab, const char *what) {
    PyArrayObject *arr = (PyArrayObject *)PyArray_FROM_O(obj);
    if (arr == NULL)
        return NULL;
    char kind = PyArray_DESCR(arr)->kind;
    if (kind != 'i' && kind != 'u') {
        PyErr_Format(PyExc_ValueError, "%s must be an integer array of token ids, got dtype %S", what,
                     (PyObject *)PyArray_DESCR(arr));
        Py_DECREF(arr);
        return NULL;
    }
    PyArrayObject *wide = (PyArrayObject *)PyArray_FromAny(
        (PyObject *)arr, PyArray_DescrFromType(NPY_INT64), 0, 0,
        NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED | NPY_ARRAY_FORCECAST, NULL);
    if (wide == NULL) {
        Py_DECREF(arr);
        return NULL;
    }
    /* (uint64 ids of 2^63 and above wrap to negatives in the cast and are refused too.) */
    const npy_intp count = PyArray_SIZE(wide);
    const int64_t *ids = PyArray_DATA(wide);
    for (npy_intp i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= vocab) {
            PyErr_Format(PyExc_ValueError, "%s: token id %lld at flat index %zd is outside [0, %lld)",
                         what, (long long)ids[i], (Py_ssize_t)i, (long long)vocab);
            Py_DECREF(wide);
            Py_DECREF(arr);
            return NULL;
        }
    Py_DECREF(arr);
    PyArrayObject *narrow = (PyArrayObject *)PyArray_FromAny(
        (PyObject *)wide, PyArray_DescrFromType(NPY_INT32), 0, 0,
        NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED | NPY_ARRAY_FORCECAST, NULL);
    Py_DECREF(wide);
    return narrow;
}

/* f_hat [B, side, side, z] as float32; *side gets its side. */
static PyArrayObject *fhat_arg(VQVAEObject *self, PyObject *obj, int64_t *side) {
    PyArrayObject *f_hat = mcpy_float32_arg(obj, "f_hat");
    if (f_hat == NULL)
        return NULL;
    char shape[160];
    mcpy_format_array_shape(shape, sizeof shape, f_hat);
    const long long z = (long long)self->info.z_channels;
    if (PyArray_NDIM(f_hat) != 4 || PyArray_DIM(f_hat, 1) < 1 ||
        PyArray_DIM(f_hat, 1) != PyArray_DIM(f_hat, 2) || PyArray_DIM(f_hat, 3) != self->info.z_channels) {
        PyErr_Format(PyExc_ValueError,
                     "f_hat must have shape [n, side, side, %lld] (NHWC, z_channels = %lld), got "
                     "shape %s",
                     z, z, shape);
        Py_DECREF(f_hat);
        return NULL;
    }
    if (PyArray_DIM(f_hat, 1) > VQ_MAX_OUTPUT_SIDE / self->info.upscale) {
        PyErr_Format(PyExc_ValueError, "f_hat of shape %s would decode to images over %d pixels a side",
                     shape, VQ_MAX_OUTPUT_SIDE);
        Py_DECREF(f_hat);
        return NULL;
    }
    *side = PyArray_DIM(f_hat, 1);
    return f_hat;
}

/* ------------------------------------------------------- backend buffers */

/* Backend buffers of one call, released together on every path. */
#define VQ_MAX_BUFFERS 4
typedef struct call_buffers {
    mc_backend *be;
    void *ptr[VQ_MAX_BUFFERS];
    int count;
} call_buffers;

static void *call_alloc(call_buffers *cb, size_t bytes, const char *what, mc_err *err) {
    if (cb->count == VQ_MAX_BUFFERS) {
        mc_fail(err, MC_ERR_INTERNAL, "VQVAE binding: too many buffers in one call");
        return NULL;
    }
    void *p = cb->be->ops->alloc(cb->be, bytes > 0 ? bytes : 1, what, err);
    if (p != NULL)
        cb->ptr[cb->count++] = p;
    return p;
}

static void call_release(call_buffers *cb) {
    for (int i = 0; i < cb->count; i++)
        cb->be->ops->release(cb->be, cb->ptr[i]);
    cb->count = 0;
}

/* A call's GIL-free section: the GIL released (the thread state saved in
 * `cancel`, for Ctrl-C checks), the object's lock held, and the backend
 * buffers the call allocates (call_alloc on `cb`) released at its end. */
typedef struct vq_call {
    call_buffers cb;
    mcpy_cancel_ctx cancel;
    PyThread_type_lock lock;
} vq_call;

static void vq_call_begin(VQVAEObject *self, vq_call *call) {
    call->cb = (call_buffers){.be = self->backend};
    call->lock = self->lock;
    call->cancel.thread_state = PyEval_SaveThread();
    PyThread_acquire_lock(call->lock, WAIT_LOCK);
}

static void vq_call_end(vq_call *call) {
    call_release(&call->cb);
    PyThread_release_lock(call->lock);
    PyEval_RestoreThread(call->cancel.thread_state);
}

static int vq_ready(VQVAEObject *self) { return mcpy_require_loaded(self->vq, "VQVAE") == 0; }

/* --------------------------------------------------------------- lifetime */

MCPY_PATH_MODEL(VQVAE, VQVAEObject, mc_vqvae, vq, mc_vqvae_free, mc_vqvae_load, mc_vqvae_get_info)

/* ------------------------------------------------------------------ decode */

/* What mcpy_decode_images' decode function gets for the VQVAE. */
typedef struct vq_decode_ctx {
    mc_vqvae *vq;
    const float *f_hat; /* on the backend */
    int64_t side, fhat_floats;
    mcpy_cancel_ctx *cancel;
} vq_decode_ctx;

static mc_status vq_decode_some(void *opaque, int64_t first, int64_t count, float *out, mc_err *err) {
    const vq_decode_ctx *c = opaque;
    return mc_vqvae_decode(c->vq, c->f_hat + first * c->fhat_floats, count, c->side, out, mcpy_cancel_check,
                           c->cancel, err);
}

static PyObject *vq_decode_impl(VQVAEObject *self, PyObject *obj, int as_uint8) {
    if (!vq_ready(self))
        return NULL;
    int64_t side;
    PyArrayObject *f_hat = fhat_arg(self, obj, &side);
    if (f_hat == NULL)
        return NULL;
    const int64_t n = PyArray_DIM(f_hat, 0), out_side = side * self->info.upscale;
    const int64_t fhat_floats = side * side * self->info.z_channels;
    npy_intp dims[4] = {(npy_intp)n, (npy_intp)out_side, (npy_intp)out_side, 3};
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(4, dims, as_uint8 ? NPY_UINT8 : NPY_FLOAT32);
    if (out == NULL) {
        Py_DECREF(f_hat);
        return NULL;
    }
    mc_err err = {0};
    mc_status st = MC_OK;
    vq_call call;
    vq_call_begin(self, &call);
    vq_decode_ctx ctx = {self->vq, NULL, side, fhat_floats, &call.cancel};
    const size_t bytes = (size_t)(n * fhat_floats) * sizeof(float);
    float *dev = n > 0 ? call_alloc(&call.cb, bytes, "the f_hat maps to decode", &err) : NULL;
    if (n > 0 && dev == NULL)
        st = err.status;
    if (st == MC_OK && n > 0)
        st = self->backend->ops->upload(self->backend, dev, PyArray_DATA(f_hat), bytes, &err);
    ctx.f_hat = dev;
    if (st == MC_OK)
        st = mcpy_decode_images(vq_decode_some, &ctx, n, out_side * out_side * 3, as_uint8, PyArray_DATA(out),
                                "VQVAE", &err);
    vq_call_end(&call);
    Py_DECREF(f_hat);
    return mcpy_result(st, &err, (PyObject *)out);
}

static PyObject *VQVAE_decode(VQVAEObject *self, PyObject *f_hat) { return vq_decode_impl(self, f_hat, 0); }

static PyObject *VQVAE_decode_uint8(VQVAEObject *self, PyObject *f_hat) {
    return vq_decode_impl(self, f_hat, 1);
}

/* ------------------------------------------------------------------- embed */

static PyObject *VQVAE_embed(VQVAEObject *self, PyObject *obj) {
    if (!vq_ready(self))
        return NULL;
    PyArrayObject *idx = token_ids_arg(obj, self->info.vocab, "idx");
    if (idx == NULL)
        return NULL;
    const int ndim = PyArray_NDIM(idx);
    if (ndim >= NPY_MAXDIMS) {
        Py_DECREF(idx);
        PyErr_SetString(PyExc_ValueError, "idx has too many dimensions");
        return NULL;
    }
    npy_intp dims[NPY_MAXDIMS];
    for (int d = 0; d < ndim; d++)
        dims[d] = PyArray_DIM(idx, d);
    dims[ndim] = (npy_intp)self->info.z_channels;
    PyArrayObject *out = (PyArrayObject *)PyArray_ZEROS(ndim + 1, dims, NPY_FLOAT32, 0);
    if (out == NULL) {
        Py_DECREF(idx);
        return NULL;
    }
    const int64_t rows = PyArray_SIZE(idx), z = self->info.z_channels;
    mc_err err = {0};
    mc_status st = MC_OK;
    if (rows > 0) {
        mc_backend *be = self->backend;
        vq_call call;
        vq_call_begin(self, &call);
        int32_t *dev_idx = call_alloc(&call.cb, (size_t)rows * sizeof(int32_t), "the token indices to embed", &err);
        float *dev_out = dev_idx != NULL ? call_alloc(&call.cb, (size_t)(rows * z) * sizeof(float),
                                                      "the embedded tokens", &err)
                                         : NULL;
        st = dev_out != NULL ? MC_OK : err.status;
        if (st == MC_OK)
            st = be->ops->upload(be, dev_idx, PyArray_DATA(idx), (size_t)rows * sizeof(int32_t), &err);
        if (st == MC_OK)
            st = be->ops->gather_rows(be, mc_vqvae_codebook(self->vq), z, dev_idx, rows, z, dev_out, z,
                                      &err);
        if (st == MC_OK)
            st = be->ops->download(be, PyArray_DATA(out), dev_out, (size_t)(rows * z) * sizeof(float),
                                   &err);
        vq_call_end(&call);
    }
    Py_DECREF(idx);
    return mcpy_result(st, &err, (PyObject *)out);
}

/* ------------------------------------------------------------- idx_to_fhat */

/* patch_nums as positive ints (1 to VQ_MAX_SCALES of them, none above the
 * last, which is the f_hat side). Returns the count or -1. */
static int patch_nums_arg(PyObject *obj, int64_t *pns) {
    PyObject *seq = PySequence_Fast(obj, "patch_nums must be a sequence of positive integers");
    if (seq == NULL)
        return -1;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > VQ_MAX_SCALES) {
        PyErr_Format(PyExc_ValueError, "patch_nums must have 1 to %d entries, got %zd", VQ_MAX_SCALES, n);
        Py_DECREF(seq);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        long long v = PyLong_Check(item) && !PyBool_Check(item) ? PyLong_AsLongLong(item) : -1;
        if (v < 1 || v > VQ_MAX_OUTPUT_SIDE) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "patch_nums[%zd] must be an integer in [1, %d], got %R", i,
                         VQ_MAX_OUTPUT_SIDE, item);
            Py_DECREF(seq);
            return -1;
        }
        pns[i] = v;
    }
    Py_DECREF(seq);
    for (Py_ssize_t i = 0; i < n; i++)
        if (pns[i] > pns[n - 1]) {
            PyErr_Format(PyExc_ValueError,
                         "patch_nums[%zd] = %lld exceeds the last entry %lld (the side of f_hat)", i,
                         (long long)pns[i], (long long)pns[n - 1]);
            return -1;
        }
    return (int)n;
}

static PyObject *VQVAE_idx_to_fhat(VQVAEObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"idx_list", "patch_nums", NULL};
    PyObject *list_obj, *pn_obj;
    if (!vq_ready(self) ||
        !PyArg_ParseTupleAndKeywords(args, kwds, "OO:idx_to_fhat", kwlist, &list_obj, &pn_obj))
        return NULL;
    int64_t pns[VQ_MAX_SCALES];
    const int n_scales = patch_nums_arg(pn_obj, pns);
    if (n_scales < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(list_obj, "idx_list must be a sequence of token id arrays");
    if (seq == NULL)
        return NULL;
    const Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    if (k < 1 || k > n_scales) {
        PyErr_Format(PyExc_ValueError,
                     "idx_list must hold the token ids of the first 1 to %d scales of patch_nums, "
                     "got %zd arrays",
                     n_scales, k);
        Py_DECREF(seq);
        return NULL;
    }
    PyArrayObject *ids[VQ_MAX_SCALES] = {0};
    int64_t batch = -1, most_rows = 0;
    PyObject *result = NULL;
    for (Py_ssize_t si = 0; si < k; si++) {
        char what[48];
        snprintf(what, sizeof what, "idx_list[%zd]", si);
        ids[si] = token_ids_arg(PySequence_Fast_GET_ITEM(seq, si), self->info.vocab, what);
        if (ids[si] == NULL)
            goto done;
        const int64_t tokens = pns[si] * pns[si];
        if (PyArray_NDIM(ids[si]) != 2 || PyArray_DIM(ids[si], 1) != tokens ||
            (batch >= 0 && PyArray_DIM(ids[si], 0) != batch)) {
            char shape[160];
            mcpy_format_array_shape(shape, sizeof shape, ids[si]);
            PyErr_Format(PyExc_ValueError,
                         "%s must have shape [B, %lld] (B images, the %lldx%lld tokens of scale %zd "
                         "in raster order%s), got shape %s",
                         what, (long long)tokens, (long long)pns[si], (long long)pns[si], si,
                         batch >= 0 ? ", B as idx_list[0]" : "", shape);
            goto done;
        }
        batch = PyArray_DIM(ids[si], 0);
        if (batch * tokens > most_rows)
            most_rows = batch * tokens;
    }
    {
        const int64_t side = pns[n_scales - 1], z = self->info.z_channels;
        if (side > VQ_MAX_OUTPUT_SIDE / self->info.upscale) {
            PyErr_Format(PyExc_ValueError, "patch_nums[-1] = %lld would decode to images over %d "
                         "pixels a side", (long long)side, VQ_MAX_OUTPUT_SIDE);
            goto done;
        }
        npy_intp dims[4] = {(npy_intp)batch, (npy_intp)side, (npy_intp)side, (npy_intp)z};
        PyArrayObject *out = (PyArrayObject *)PyArray_ZEROS(4, dims, NPY_FLOAT32, 0);
        if (out == NULL)
            goto done;
        mc_err err = {0};
        mc_status st = MC_OK;
        if (batch > 0) {
            mc_backend *be = self->backend;
            vq_call call;
            const size_t fhat_bytes = (size_t)(batch * side * side * z) * sizeof(float);
            vq_call_begin(self, &call);
            float *f_hat = call_alloc(&call.cb, fhat_bytes, "the f_hat maps", &err);
            float *h = f_hat != NULL ? call_alloc(&call.cb, (size_t)(most_rows * z) * sizeof(float),
                                                  "the embedded tokens of the largest scale", &err)
                                     : NULL;
            int32_t *dev_idx = h != NULL ? call_alloc(&call.cb, (size_t)most_rows * sizeof(int32_t),
                                                      "the token indices of the largest scale", &err)
                                         : NULL;
            st = dev_idx != NULL ? MC_OK : err.status;
            /* f_hat starts at zero: the zeroed result array is the source. */
            if (st == MC_OK)
                st = be->ops->upload(be, f_hat, PyArray_DATA(out), fhat_bytes, &err);
            for (Py_ssize_t si = 0; si < k && st == MC_OK; si++) {
                const int64_t rows = batch * pns[si] * pns[si];
                st = be->ops->upload(be, dev_idx, PyArray_DATA(ids[si]), (size_t)rows * sizeof(int32_t),
                                     &err);
                if (st == MC_OK)
                    st = be->ops->gather_rows(be, mc_vqvae_codebook(self->vq), z, dev_idx, rows, z, h, z,
                                              &err);
                if (st == MC_OK)
                    st = mc_vqvae_add_scale(self->vq, f_hat, batch, side, h, pns[si],
                                            mc_vqvae_phi_index(self->vq, (int)si, n_scales), &err);
            }
            if (st == MC_OK)
                st = be->ops->download(be, PyArray_DATA(out), f_hat, fhat_bytes, &err);
            vq_call_end(&call);
        }
        if (st != MC_OK) {
            Py_DECREF(out);
            mcpy_raise(&err);
            goto done;
        }
        result = (PyObject *)out;
    }
done:
    for (Py_ssize_t si = 0; si < k; si++)
        Py_XDECREF(ids[si]);
    Py_DECREF(seq);
    return result;
}

/* ------------------------------------------------------------ fhat_to_next */

static PyObject *VQVAE_fhat_to_next(VQVAEObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"f_hat", "pn", NULL};
    PyObject *f_obj;
    long long pn;
    if (!vq_ready(self) ||
        !PyArg_ParseTupleAndKeywords(args, kwds, "OL:fhat_to_next", kwlist, &f_obj, &pn))
        return NULL;
    if (pn < 1 || pn > VQ_MAX_OUTPUT_SIDE) {
        PyErr_Format(PyExc_ValueError, "pn must be in [1, %d], got %lld", VQ_MAX_OUTPUT_SIDE, pn);
        return NULL;
    }
    int64_t side;
    PyArrayObject *f_hat = fhat_arg(self, f_obj, &side);
    if (f_hat == NULL)
        return NULL;
    const int64_t n = PyArray_DIM(f_hat, 0), z = self->info.z_channels;
    npy_intp dims[4] = {(npy_intp)n, (npy_intp)pn, (npy_intp)pn, (npy_intp)z};
    PyArrayObject *out = (PyArrayObject *)PyArray_ZEROS(4, dims, NPY_FLOAT32, 0);
    if (out == NULL) {
        Py_DECREF(f_hat);
        return NULL;
    }
    mc_err err = {0};
    mc_status st = MC_OK;
    if (n > 0) {
        mc_backend *be = self->backend;
        vq_call call;
        const size_t in_bytes = (size_t)(n * side * side * z) * sizeof(float);
        const size_t out_bytes = (size_t)(n * pn * pn * z) * sizeof(float);
        vq_call_begin(self, &call);
        float *dev_in = call_alloc(&call.cb, in_bytes, "the f_hat maps", &err);
        float *dev_out = dev_in != NULL ? call_alloc(&call.cb, out_bytes, "the next scale's inputs", &err) : NULL;
        st = dev_out != NULL ? MC_OK : err.status;
        if (st == MC_OK)
            st = be->ops->upload(be, dev_in, PyArray_DATA(f_hat), in_bytes, &err);
        if (st == MC_OK)
            st = mc_vqvae_area_input(self->vq, dev_in, n, side, pn, dev_out, &err);
        if (st == MC_OK)
            st = be->ops->download(be, PyArray_DATA(out), dev_out, out_bytes, &err);
        vq_call_end(&call);
    }
    Py_DECREF(f_hat);
    return mcpy_result(st, &err, (PyObject *)out);
}

/* --------------------------------------------------------------- phi_index */

static PyObject *VQVAE_phi_index(VQVAEObject *self, PyObject *args) {
    int si, n_scales;
    if (!vq_ready(self) || !PyArg_ParseTuple(args, "ii:phi_index", &si, &n_scales))
        return NULL;
    if (n_scales < 1 || si < 0 || si >= n_scales) {
        PyErr_Format(PyExc_ValueError, "phi_index: need 0 <= si < n_scales, got si = %d, n_scales = %d",
                     si, n_scales);
        return NULL;
    }
    return PyLong_FromLong(mc_vqvae_phi_index(self->vq, si, n_scales));
}

/* ------------------------------------------------------------- attributes */

static PyObject *VQVAE_get_config(VQVAEObject *self, void *c) {
    (void)c;
    if (!vq_ready(self))
        return NULL;
    const mc_vqvae_info *in = &self->info;
    PyObject *mult = mcpy_int_tuple(in->ch_mult, (Py_ssize_t)in->num_levels);
    if (mult == NULL)
        return NULL;
    return Py_BuildValue("{s:L,s:L,s:L,s:N,s:L,s:L,s:L,s:d,s:L}", "vocab", (long long)in->vocab,
                         "z_channels", (long long)in->z_channels, "ch", (long long)in->ch, "ch_mult",
                         mult, "num_res_blocks", (long long)in->num_res_blocks, "num_phi",
                         (long long)in->num_phi, "upscale", (long long)in->upscale, "quant_resi",
                         in->quant_resi, "num_params", (long long)in->num_params);
}

MCPY_INFO_GETTER(VQVAE, VQVAEObject, vq, "VQVAE", num_params, PyLong_FromLongLong)

static PyMethodDef VQVAE_methods[] = {
    {"decode", (PyCFunction)VQVAE_decode, METH_O,
     "decode(f_hat: float32 [n, side, side, z]) -> float32 [n, H, W, 3]\n\n"
     "decoder(post_quant_conv(f_hat)) clamped to [-1, 1]; H = W = side * upscale."},
    {"decode_uint8", (PyCFunction)VQVAE_decode_uint8, METH_O,
     "decode_uint8(f_hat) -> uint8 [n, H, W, 3]: round_half_even(clip((x + 1) / 2 * 255))."},
    {"embed", (PyCFunction)VQVAE_embed, METH_O,
     "embed(idx: integer array) -> float32 [*idx.shape, z]: the codebook rows."},
    {"idx_to_fhat", (PyCFunction)(void (*)(void))VQVAE_idx_to_fhat, METH_VARARGS | METH_KEYWORDS,
     "idx_to_fhat(idx_list, patch_nums) -> float32 [B, side, side, z]\n\n"
     "f_hat after the first len(idx_list) scales of patch_nums (side = patch_nums[-1]):\n"
     "f_hat += Phi_k(bicubic(embed(idx_list[si]) -> side x side)) scale by scale."},
    {"fhat_to_next", (PyCFunction)(void (*)(void))VQVAE_fhat_to_next, METH_VARARGS | METH_KEYWORDS,
     "fhat_to_next(f_hat, pn) -> float32 [B, pn, pn, z]: area resize (the next scale's input)."},
    {"phi_index", (PyCFunction)VQVAE_phi_index, METH_VARARGS,
     "phi_index(si, n_scales) -> index of the Phi conv used at scale si of n_scales."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef VQVAE_getset[] = {
    MCPY_GETTER_ENTRY(VQVAE, config,
                      "dict: vocab, z_channels, ch, ch_mult, num_res_blocks, num_phi, upscale, quant_resi, num_params"),
    MCPY_GETTER_ENTRY(VQVAE, num_params, "parameters bound (codebook, Phi convs, post_quant_conv, decoder)"),
    {NULL, NULL, NULL, NULL, NULL},
};

MCPY_MODEL_TYPE(VQVAE, VQVAEObject, "VQVAE",
                "VQVAE(path, num_threads=0, device='cpu', dtype='fp32'): VAR's multi-scale VQVAE (decode\n"
              "side) loaded from a safetensors file in the official key layout, on device 'cpu',\n"
              "'cuda', 'cuda:N' or 'guard'. dtype 'bf16' or 'fp16' runs its convolutions as autocast\n"
              "does (inputs and weights rounded, float32 sums).");

int mcpy_vqvae_borrow(PyObject *obj, mc_vqvae **vq, mc_backend **backend, PyThread_type_lock *lock) {
    if (!PyObject_TypeCheck(obj, &VQVAE_type)) {
        PyErr_Format(PyExc_TypeError, "vqvae must be a marcache._C.VQVAE, got %s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    VQVAEObject *self = (VQVAEObject *)obj;
    if (!vq_ready(self))
        return -1;
    *vq = self->vq;
    *backend = self->backend;
    *lock = self->lock;
    return 0;
}

int mcpy_vqvae_init(PyObject *module) { return mcpy_add_type(module, &VQVAE_type, "VQVAE", NULL); }

/* Python binding of the KL-16 VAE decoder (marcache._C.VAE) and the test
 * hook of its float -> uint8 conversion. (Its ops are reached for tests
 * through run_op, py_ops.c, like every other op.) */
#include "py_model.h"

#include <math.h>
#include <pythread.h>

#include "../models/vae.h"

/* ------------------------------------------------------------------- VAE */

typedef struct {
    /* The lock: one decode at a time (the VAE reuses its activation buffers
     * and the backend its scratch), taken with the GIL released. */
    MCPY_MODEL_HEAD
    mc_vae *vae;
    mc_vae_info info;
} VAEObject;

MCPY_PATH_MODEL(VAE, VAEObject, mc_vae, vae, mc_vae_free, mc_vae_load, mc_vae_get_info)

/* Validates tokens [n, S, C] (S a perfect square, C == z_channels) and
 * returns them as float32; *side gets sqrt(S). */
static PyArrayObject *vae_tokens_arg(VAEObject *self, PyObject *obj, int64_t *side) {
    if (mcpy_require_loaded(self->vae, "VAE") < 0)
        return NULL;
    PyArrayObject *tokens = mcpy_float32_arg(obj, "tokens");
    if (tokens == NULL)
        return NULL;
    char shape[160];
    mcpy_format_array_shape(shape, sizeof shape, tokens);
    long long z = (long long)self->info.z_channels;
    if (PyArray_NDIM(tokens) != 3) {
        PyErr_Format(PyExc_ValueError, "tokens must have shape [n, seq_len, %lld], got shape %s",
                     z, shape);
        goto fail;
    }
    int64_t seq_len = PyArray_DIM(tokens, 1), channels = PyArray_DIM(tokens, 2);
    int64_t s = (int64_t)llround(sqrt((double)seq_len));
    if (seq_len <= 0 || s * s != seq_len) {
        PyErr_Format(PyExc_ValueError,
                     "tokens must have shape [n, seq_len, %lld] with seq_len a positive perfect "
                     "square (e.g. 256 = 16 x 16), got shape %s", z, shape);
        goto fail;
    }
    if (channels != self->info.z_channels) {
        PyErr_Format(PyExc_ValueError,
                     "tokens must have shape [n, %lld, %lld] (channels = z_channels), got shape %s",
                     (long long)seq_len, z, shape);
        goto fail;
    }
    if (s > 16384 / self->info.upscale) {
        PyErr_Format(PyExc_ValueError, "tokens of shape %s would decode to images over 16384 pixels a side",
                     shape);
        goto fail;
    }
    *side = s;
    return tokens;
fail:
    Py_DECREF(tokens);
    return NULL;
}

/* What mcpy_decode_images' decode function gets for the VAE. */
typedef struct vae_decode_ctx {
    mc_vae *vae;
    const float *tokens;
    int64_t seq_len, z;
    mcpy_cancel_ctx *cancel;
} vae_decode_ctx;

static mc_status vae_decode_some(void *opaque, int64_t first, int64_t count, float *out, mc_err *err) {
    const vae_decode_ctx *c = opaque;
    return mc_vae_decode(c->vae, c->tokens + first * c->seq_len * c->z, count, c->seq_len, c->z, out,
                         mcpy_cancel_check, c->cancel, err);
}

/* Shared body of decode / decode_uint8 (mcpy_decode_images). */
static PyObject *vae_decode_impl(VAEObject *self, PyObject *obj, int as_uint8) {
    int64_t side;
    PyArrayObject *tokens = vae_tokens_arg(self, obj, &side);
    if (tokens == NULL)
        return NULL;
    const int64_t n = PyArray_DIM(tokens, 0), out_side = side * self->info.upscale;
    const int64_t out_c = self->info.out_channels;
    npy_intp dims[4] = {(npy_intp)n, (npy_intp)out_side, (npy_intp)out_side, (npy_intp)out_c};
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(4, dims, as_uint8 ? NPY_UINT8 : NPY_FLOAT32);
    if (out == NULL) {
        Py_DECREF(tokens);
        return NULL;
    }
    mc_err err = {0};
    mc_status st;
    mcpy_cancel_ctx cancel;
    vae_decode_ctx ctx = {self->vae, PyArray_DATA(tokens), PyArray_DIM(tokens, 1), self->info.z_channels, &cancel};
    cancel.thread_state = PyEval_SaveThread();
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    st = mcpy_decode_images(vae_decode_some, &ctx, n, out_side * out_side * out_c, as_uint8, PyArray_DATA(out),
                            "VAE", &err);
    PyThread_release_lock(self->lock);
    PyEval_RestoreThread(cancel.thread_state);
    Py_DECREF(tokens);
    return mcpy_result(st, &err, (PyObject *)out);
}

static PyObject *VAE_decode(VAEObject *self, PyObject *tokens) {
    return vae_decode_impl(self, tokens, 0);
}

static PyObject *VAE_decode_uint8(VAEObject *self, PyObject *tokens) {
    return vae_decode_impl(self, tokens, 1);
}

#define VAE_INFO_GETTER(field) MCPY_INFO_GETTER(VAE, VAEObject, vae, "VAE", field, PyLong_FromLongLong)
VAE_INFO_GETTER(z_channels)
VAE_INFO_GETTER(ch)
VAE_INFO_GETTER(num_res_blocks)
VAE_INFO_GETTER(num_params)
VAE_INFO_GETTER(upscale)

MCPY_INFO_GETTER(VAE, VAEObject, vae, "VAE", weight_bytes, PyLong_FromSize_t)

static PyObject *VAE_get_ch_mult(VAEObject *self, void *c) {
    (void)c;
    if (mcpy_require_loaded(self->vae, "VAE") < 0)
        return NULL;
    return mcpy_int_tuple(self->info.ch_mult, self->info.num_levels);
}

static PyMethodDef VAE_methods[] = {
    {"decode", (PyCFunction)VAE_decode, METH_O,
     "decode(tokens: float32 [n, S, z_channels]) -> float32 [n, H, W, 3]\n\n"
     "Tokens are in the scaled latent space (divided by 0.2325 here); S = side^2,\n"
     "H = W = side * upscale. Output is nominally in [-1, 1], not clamped."},
    {"decode_uint8", (PyCFunction)VAE_decode_uint8, METH_O,
     "decode_uint8(tokens) -> uint8 [n, H, W, 3]: round_half_even(clip((x + 1) / 2 * 255))."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef VAE_getset[] = {
    MCPY_GETTER_ENTRY(VAE, z_channels, "latent channels (token width)"),
    MCPY_GETTER_ENTRY(VAE, ch, "base channel count"),
    MCPY_GETTER_ENTRY(VAE, ch_mult, "channel multipliers per level (tuple)"),
    MCPY_GETTER_ENTRY(VAE, num_res_blocks,
     "Decoder num_res_blocks (each up level has this + 1 ResnetBlocks)"),
    MCPY_GETTER_ENTRY(VAE, num_params, "parameters bound (post_quant_conv + decoder)"),
    MCPY_GETTER_ENTRY(VAE, upscale, "output side / latent side"),
    MCPY_GETTER_ENTRY(VAE, weight_bytes, "bytes of backend memory the loaded weights hold"),
    {NULL, NULL, NULL, NULL, NULL},
};

MCPY_MODEL_TYPE(VAE, VAEObject, "VAE",
                "VAE(path, num_threads=0, device='cpu', dtype='fp32'): MAR's KL-16 VAE decoder loaded\n"
              "from a safetensors file in the official key layout (post_quant_conv.* and decoder.*),\n"
              "on device 'cpu', 'cuda', 'cuda:N' or 'guard'. dtype 'bf16' or 'fp16' runs its\n"
              "convolutions as autocast does (inputs and weights rounded, float32 sums).");

/* _vae_to_uint8(x) -> uint8 array like x: mc_vae_to_uint8 (test hook). */
static PyObject *op_vae_to_uint8(PyObject *self, PyObject *obj) {
    (void)self;
    PyArrayObject *x = mcpy_float32_arg(obj, "x");
    if (x == NULL)
        return NULL;
    PyArrayObject *y = (PyArrayObject *)PyArray_SimpleNew(PyArray_NDIM(x), PyArray_DIMS(x), NPY_UINT8);
    if (y == NULL) {
        Py_DECREF(x);
        return NULL;
    }
    mc_status st = mc_vae_to_uint8(PyArray_DATA(x), PyArray_SIZE(x), PyArray_DATA(y));
    Py_DECREF(x);
    if (st != MC_OK) {
        Py_DECREF(y);
        PyErr_SetString(PyExc_FloatingPointError, "to_uint8: input contains NaN");
        return NULL;
    }
    return (PyObject *)y;
}

static PyMethodDef vae_module_methods[] = {
    {"_vae_to_uint8", op_vae_to_uint8, METH_O,
     "_vae_to_uint8(x) -> uint8: round_half_even(clip((x + 1) / 2 * 255, 0, 255)) (test hook)."},
    {NULL, NULL, 0, NULL},
};

int mcpy_vae_init(PyObject *module) { return mcpy_add_type(module, &VAE_type, "VAE", vae_module_methods); }

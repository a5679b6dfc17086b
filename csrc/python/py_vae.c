/* Python binding of the KL-16 VAE decoder (marcache._C.VAE) and the test
 * hook of its float -> uint8 conversion. (Its ops are reached for tests
 * through run_op, py_ops.c, like every other op.) */
#include "py_numpy.h"
#include "py_backend.h"

#include <math.h>
#include <pythread.h>

#include "../models/vae.h"

/* ------------------------------------------------------------ array helpers */

/* Any real numeric array-like -> new reference to a C-contiguous float32
 * array. Complex, bool, object and string data are refused rather than
 * silently cast. */
static PyArrayObject *as_float32(PyObject *obj, const char *what) {
    PyArrayObject *arr = (PyArrayObject *)PyArray_FROM_O(obj);
    if (arr == NULL)
        return NULL;
    char kind = PyArray_DESCR(arr)->kind;
    if (kind != 'f' && kind != 'i' && kind != 'u') {
        PyErr_Format(PyExc_ValueError, "%s must be a real numeric array convertible to float32, "
                     "got dtype kind '%c'", what, kind);
        Py_DECREF(arr);
        return NULL;
    }
    PyObject *f32 = PyArray_FromAny((PyObject *)arr, PyArray_DescrFromType(NPY_FLOAT32), 0, 0,
                                    NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED | NPY_ARRAY_FORCECAST,
                                    NULL);
    Py_DECREF(arr);
    return (PyArrayObject *)f32;
}

/* ------------------------------------------------------------------- VAE */

typedef struct {
    PyObject_HEAD
    mc_backend *backend;
    mc_vae *vae;
    mc_vae_info info;
    /* One decode at a time: the VAE reuses its activation buffers and the
     * backend its scratch. Taken with the GIL released. */
    PyThread_type_lock lock;
} VAEObject;

static void vae_release_model(VAEObject *self) {
    mc_vae_free(self->vae);
    self->vae = NULL;
    mc_backend_destroy(self->backend);
    self->backend = NULL;
}

static void VAE_dealloc(VAEObject *self) {
    vae_release_model(self);
    if (self->lock != NULL)
        PyThread_free_lock(self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static mc_status load_vae(mc_backend *backend, mc_st_file *file, void *model, mc_err *err) {
    return mc_vae_load(backend, file, (mc_vae **)model, err);
}

static int VAE_init(VAEObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"path", "num_threads", "device", NULL};
    const char *device = "cpu";
    PyObject *path_bytes = NULL;
    int num_threads = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&|is:VAE", kwlist, PyUnicode_FSConverter,
                                     &path_bytes, &num_threads, &device))
        return -1;
    if (num_threads < 0) {
        Py_DECREF(path_bytes);
        PyErr_SetString(PyExc_ValueError, "num_threads must be >= 0 (0 = all OpenMP threads)");
        return -1;
    }
    if (mcpy_ensure_lock(&self->lock) < 0) {
        Py_DECREF(path_bytes);
        return -1;
    }
    vae_release_model(self); /* __init__ called again on a live object */

    mc_err err = {0};
    mc_backend *backend = NULL;
    mc_vae *vae = NULL;
    mc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = mcpy_load_model(PyBytes_AS_STRING(path_bytes), device, num_threads, MC_WTYPE_F32,
                         load_vae, &vae, &backend, &err);
    Py_END_ALLOW_THREADS
    Py_DECREF(path_bytes);
    if (st != MC_OK) {
        mcpy_raise(&err);
        return -1;
    }
    self->backend = backend;
    self->vae = vae;
    mc_vae_get_info(vae, &self->info);
    return 0;
}

/* Validates tokens [n, S, C] (S a perfect square, C == z_channels) and
 * returns them as float32; *side gets sqrt(S). */
static PyArrayObject *vae_tokens_arg(VAEObject *self, PyObject *obj, int64_t *side) {
    if (self->vae == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "VAE is not initialised");
        return NULL;
    }
    PyArrayObject *tokens = as_float32(obj, "tokens");
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

/* Shared body of decode / decode_uint8. With as_uint8 the images are
 * decoded one at a time into a float buffer and converted, so the float
 * copy of the whole batch never exists. */
static PyObject *vae_decode_impl(VAEObject *self, PyObject *obj, int as_uint8) {
    int64_t side;
    PyArrayObject *tokens = vae_tokens_arg(self, obj, &side);
    if (tokens == NULL)
        return NULL;
    const int64_t n = PyArray_DIM(tokens, 0), seq_len = PyArray_DIM(tokens, 1);
    const int64_t z = self->info.z_channels, out_side = side * self->info.upscale;
    const int64_t out_c = self->info.out_channels;
    npy_intp dims[4] = {(npy_intp)n, (npy_intp)out_side, (npy_intp)out_side, (npy_intp)out_c};
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(4, dims, as_uint8 ? NPY_UINT8 : NPY_FLOAT32);
    if (out == NULL) {
        Py_DECREF(tokens);
        return NULL;
    }
    const int64_t image_floats = out_side * out_side * out_c;
    float *image = NULL;
    if (as_uint8 && n > 0) {
        image = PyMem_RawMalloc((size_t)image_floats * sizeof(float));
        if (image == NULL) {
            Py_DECREF(tokens);
            Py_DECREF(out);
            return mcpy_no_memory("one decoded image", (size_t)image_floats * sizeof(float));
        }
    }
    const float *tok = PyArray_DATA(tokens);
    mc_err err = {0};
    mc_status st = MC_OK;
    mcpy_cancel_ctx cancel = {PyEval_SaveThread()};
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    if (!as_uint8) {
        st = mc_vae_decode(self->vae, tok, n, seq_len, z, PyArray_DATA(out), mcpy_cancel_check,
                           &cancel, &err);
    } else {
        uint8_t *pixels = PyArray_DATA(out);
        for (int64_t i = 0; i < n && st == MC_OK; i++) {
            st = mc_vae_decode(self->vae, tok + i * seq_len * z, 1, seq_len, z, image,
                               mcpy_cancel_check, &cancel, &err);
            if (st == MC_OK && mc_vae_to_uint8(image, image_floats, pixels + i * image_floats) != MC_OK)
                st = mc_fail(&err, MC_ERR_NUMERIC, "VAE decoder output of image %lld contains NaN",
                             (long long)i);
        }
    }
    PyThread_release_lock(self->lock);
    PyEval_RestoreThread(cancel.thread_state);
    PyMem_RawFree(image);
    Py_DECREF(tokens);
    if (st != MC_OK) {
        Py_DECREF(out);
        return mcpy_raise(&err);
    }
    return (PyObject *)out;
}

static PyObject *VAE_decode(VAEObject *self, PyObject *tokens) {
    return vae_decode_impl(self, tokens, 0);
}

static PyObject *VAE_decode_uint8(VAEObject *self, PyObject *tokens) {
    return vae_decode_impl(self, tokens, 1);
}

static PyObject *vae_int_attr(VAEObject *self, int64_t value) {
    if (self->vae == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "VAE is not initialised");
        return NULL;
    }
    return PyLong_FromLongLong((long long)value);
}

static PyObject *VAE_get_z_channels(VAEObject *self, void *c) {
    (void)c;
    return vae_int_attr(self, self->info.z_channels);
}
static PyObject *VAE_get_ch(VAEObject *self, void *c) {
    (void)c;
    return vae_int_attr(self, self->info.ch);
}
static PyObject *VAE_get_num_res_blocks(VAEObject *self, void *c) {
    (void)c;
    return vae_int_attr(self, self->info.num_res_blocks);
}
static PyObject *VAE_get_num_params(VAEObject *self, void *c) {
    (void)c;
    return vae_int_attr(self, self->info.num_params);
}
static PyObject *VAE_get_weight_bytes(VAEObject *self, void *c) {
    (void)c;
    if (self->vae == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "VAE is not initialised");
        return NULL;
    }
    return PyLong_FromSize_t(self->info.weight_bytes);
}
static PyObject *VAE_get_upscale(VAEObject *self, void *c) {
    (void)c;
    return vae_int_attr(self, self->info.upscale);
}
static PyObject *VAE_get_ch_mult(VAEObject *self, void *c) {
    (void)c;
    if (self->vae == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "VAE is not initialised");
        return NULL;
    }
    PyObject *tuple = PyTuple_New(self->info.num_levels);
    if (tuple == NULL)
        return NULL;
    for (int i = 0; i < self->info.num_levels; i++) {
        PyObject *item = PyLong_FromLongLong((long long)self->info.ch_mult[i]);
        if (item == NULL) {
            Py_DECREF(tuple);
            return NULL;
        }
        PyTuple_SET_ITEM(tuple, i, item);
    }
    return tuple;
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
    {"z_channels", (getter)VAE_get_z_channels, NULL, "latent channels (token width)", NULL},
    {"ch", (getter)VAE_get_ch, NULL, "base channel count", NULL},
    {"ch_mult", (getter)VAE_get_ch_mult, NULL, "channel multipliers per level (tuple)", NULL},
    {"num_res_blocks", (getter)VAE_get_num_res_blocks, NULL,
     "Decoder num_res_blocks (each up level has this + 1 ResnetBlocks)", NULL},
    {"num_params", (getter)VAE_get_num_params, NULL, "parameters bound (post_quant_conv + decoder)",
     NULL},
    {"upscale", (getter)VAE_get_upscale, NULL, "output side / latent side", NULL},
    {"weight_bytes", (getter)VAE_get_weight_bytes, NULL, "bytes of backend memory the loaded weights hold",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject VAE_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "marcache._C.VAE",
    .tp_basicsize = sizeof(VAEObject),
    .tp_dealloc = (destructor)VAE_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "VAE(path, num_threads=0, device='cpu'): MAR's KL-16 VAE decoder loaded from a\n"
              "safetensors file in the official key layout (post_quant_conv.* and decoder.*), on\n"
              "device 'cpu', 'cuda', 'cuda:N' or 'guard'.",
    .tp_methods = VAE_methods,
    .tp_getset = VAE_getset,
    .tp_init = (initproc)VAE_init,
    .tp_new = PyType_GenericNew,
};

/* _vae_to_uint8(x) -> uint8 array like x: mc_vae_to_uint8 (test hook). */
static PyObject *op_vae_to_uint8(PyObject *self, PyObject *obj) {
    (void)self;
    PyArrayObject *x = as_float32(obj, "x");
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

int mcpy_vae_init(PyObject *module) {
    if (PyType_Ready(&VAE_type) < 0)
        return -1;
    Py_INCREF(&VAE_type);
    if (PyModule_AddObject(module, "VAE", (PyObject *)&VAE_type) < 0) {
        Py_DECREF(&VAE_type);
        return -1;
    }
    return PyModule_AddFunctions(module, vae_module_methods);
}

/* Python binding of the FID-Inception network (marcache._C.Inception).
 *
 *   Inception(path, num_threads=0, chunk=8)
 *   .features(images: uint8 [n, h, w, 3]) -> (pool float32 [n, feature_dim],
 *                                             logits_unbiased float32 [n, num_classes])
 *
 * The forward runs with the GIL released; between chunks (and blocks) it
 * takes the GIL back just long enough to check for Ctrl-C. One call at a
 * time per object (the activation buffers are reused). */
#include "py_model.h"

#include <pythread.h>

#include "../models/inception.h"

typedef struct {
    MCPY_MODEL_HEAD /* the lock: one forward at a time (the activation buffers are reused) */
    mc_inception *net;
    mc_inception_info info;
} InceptionObject;

MCPY_MODEL_LIFECYCLE(Inception, InceptionObject, net, mc_inception_free)

/* What mcpy_load_model's loader gets for the network: the chunk size, and
 * where the network goes. */
typedef struct loading {
    int64_t chunk;
    mc_inception *net;
} loading;

static mc_status load_inception(mc_backend *backend, mc_st_file *file, void *model, mc_err *err) {
    loading *request = model;
    return mc_inception_load(backend, file, request->chunk, &request->net, err);
}

static int Inception_init(InceptionObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"path", "num_threads", "chunk", "device", NULL};
    const char *device = "cpu";
    PyObject *path_bytes = NULL;
    int num_threads = 0;
    long long chunk = 8;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&|iLs:Inception", kwlist, PyUnicode_FSConverter,
                                     &path_bytes, &num_threads, &chunk, &device))
        return -1;
    if (chunk < 1 || chunk > 4096) {
        Py_DECREF(path_bytes);
        PyErr_Format(PyExc_ValueError, "chunk must be in 1..4096, got chunk=%lld", chunk);
        return -1;
    }
    loading request = {(int64_t)chunk, NULL};
    if (mcpy_model_load((mcpy_model_object *)self, Inception_release_model, 1, path_bytes, device, num_threads,
                        "num_threads", MC_WTYPE_F32, load_inception, &request) < 0)
        return -1;
    self->net = request.net;
    mc_inception_get_info(request.net, &self->info);
    return 0;
}

static PyObject *Inception_features(InceptionObject *self, PyObject *obj) {
    if (mcpy_require_loaded(self->net, "Inception") < 0)
        return NULL;
    if (!PyArray_Check(obj) || PyArray_TYPE((PyArrayObject *)obj) != NPY_UINT8) {
        PyErr_Format(PyExc_ValueError,
                     "images must be a numpy uint8 array [n, height, width, 3] (NHWC, RGB), got %s",
                     PyArray_Check(obj) ? "another dtype" : Py_TYPE(obj)->tp_name);
        return NULL;
    }
    PyArrayObject *images = (PyArrayObject *)PyArray_FROM_OTF(obj, NPY_UINT8, NPY_ARRAY_IN_ARRAY);
    if (images == NULL)
        return NULL;
    if (PyArray_NDIM(images) != 4 || PyArray_DIM(images, 3) != 3 || PyArray_DIM(images, 1) < 1 ||
        PyArray_DIM(images, 2) < 1 || PyArray_DIM(images, 1) > MC_INCEPTION_MAX_SIDE ||
        PyArray_DIM(images, 2) > MC_INCEPTION_MAX_SIDE) {
        char shape[160];
        mcpy_format_array_shape(shape, sizeof shape, images);
        PyErr_Format(PyExc_ValueError,
                     "images must have shape [n, height, width, 3] with sides in 1..%d, got %s",
                     MC_INCEPTION_MAX_SIDE, shape);
        Py_DECREF(images);
        return NULL;
    }
    const int64_t n = PyArray_DIM(images, 0), h = PyArray_DIM(images, 1), w = PyArray_DIM(images, 2);
    npy_intp pool_dims[2] = {(npy_intp)n, (npy_intp)self->info.feature_dim};
    npy_intp logit_dims[2] = {(npy_intp)n, (npy_intp)self->info.num_classes};
    PyArrayObject *pool = (PyArrayObject *)PyArray_SimpleNew(2, pool_dims, NPY_FLOAT32);
    PyArrayObject *logits = (PyArrayObject *)PyArray_SimpleNew(2, logit_dims, NPY_FLOAT32);
    if (pool == NULL || logits == NULL) {
        Py_XDECREF(pool);
        Py_XDECREF(logits);
        Py_DECREF(images);
        return NULL;
    }
    mc_err err = {0};
    mc_status st;
    mcpy_cancel_ctx cancel = {PyEval_SaveThread()};
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    st = mc_inception_forward(self->net, PyArray_DATA(images), n, h, w, PyArray_DATA(pool),
                              PyArray_DATA(logits), mcpy_cancel_check, &cancel, &err);
    PyThread_release_lock(self->lock);
    PyEval_RestoreThread(cancel.thread_state);
    Py_DECREF(images);
    if (st != MC_OK) {
        Py_DECREF(pool);
        return mcpy_result(st, &err, (PyObject *)logits);
    }
    return Py_BuildValue("(NN)", pool, logits);
}

#define INCEPTION_INFO_GETTER(field, conv) MCPY_INFO_GETTER(Inception, InceptionObject, net, "Inception", field, conv)

INCEPTION_INFO_GETTER(feature_dim, PyLong_FromLongLong)
INCEPTION_INFO_GETTER(num_classes, PyLong_FromLongLong)
INCEPTION_INFO_GETTER(num_params, PyLong_FromLongLong)
INCEPTION_INFO_GETTER(chunk, PyLong_FromLongLong)
INCEPTION_INFO_GETTER(standard, PyBool_FromLong)
INCEPTION_INFO_GETTER(flops_per_image, PyFloat_FromDouble)

static PyMethodDef Inception_methods[] = {
    {"features", (PyCFunction)Inception_features, METH_O,
     "features(images: uint8 [n, h, w, 3]) -> (pool float32 [n, feature_dim],\n"
     "                                         logits_unbiased float32 [n, num_classes])\n\n"
     "Any image size: resized to 299 x 299 with TF1 bilinear semantics, then (x - 128) / 128.\n"
     "pool is the 2048-d FID feature; logits_unbiased = pool . fc.weight^T (IS)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Inception_getset[] = {
    MCPY_GETTER_ENTRY(Inception, feature_dim, "pool feature width (2048)"),
    MCPY_GETTER_ENTRY(Inception, num_classes, "logit count (1008)"),
    MCPY_GETTER_ENTRY(Inception, num_params, "elements of every tensor read"),
    MCPY_GETTER_ENTRY(Inception, chunk, "images per forward pass"),
    MCPY_GETTER_ENTRY(Inception, standard,
     "True when every width is the FID network's (False for narrower test networks)"),
    MCPY_GETTER_ENTRY(Inception, flops_per_image,
     "convolution + fc FLOPs of one image at 299 x 299 (2 per multiply-add)"),
    {NULL, NULL, NULL, NULL, NULL},
};

MCPY_MODEL_TYPE(Inception, InceptionObject, "Inception",
                "Inception(path, num_threads=0, chunk=8): the FID-Inception network (pytorch-fid\n"
              "key names, BatchNorm folded at load) on the CPU backend.");

/* png_unfilter(raw: bytes, height, stride, bpp) -> uint8 [height, stride]:
 * undoes the five PNG scanline filters (each row: 1 filter byte + stride
 * bytes; bpp = bytes per pixel, 1..8). For marcache.png.read_png. */
static PyObject *py_png_unfilter(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer raw;
    Py_ssize_t height, stride, bpp;
    if (!PyArg_ParseTuple(args, "y*nnn:png_unfilter", &raw, &height, &stride, &bpp))
        return NULL;
    if (height < 0 || stride < 0 || bpp < 1 || bpp > 8 ||
        (stride > 0 && height > PY_SSIZE_T_MAX / (stride + 1)) || raw.len != height * (stride + 1)) {
        PyBuffer_Release(&raw);
        return PyErr_Format(PyExc_ValueError,
                            "png_unfilter: %zd bytes of image data do not hold %zd rows of 1 + %zd "
                            "bytes (bpp %zd)",
                            raw.len, height, stride, bpp);
    }
    npy_intp dims[2] = {(npy_intp)height, (npy_intp)stride};
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(2, dims, NPY_UINT8);
    if (out == NULL) {
        PyBuffer_Release(&raw);
        return NULL;
    }
    const uint8_t *src = raw.buf;
    uint8_t *dst = PyArray_DATA(out);
    int bad = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t y = 0; y < height && bad < 0; y++) {
        const uint8_t *line = src + y * (stride + 1) + 1;
        uint8_t *cur = dst + y * stride;
        const uint8_t *prev = y > 0 ? dst + (y - 1) * stride : NULL;
        int kind = src[y * (stride + 1)];
        for (Py_ssize_t i = 0; i < stride; i++) {
            int a = i >= bpp ? cur[i - bpp] : 0;
            int b = prev != NULL ? prev[i] : 0;
            int c = (prev != NULL && i >= bpp) ? prev[i - bpp] : 0;
            int pred;
            switch (kind) {
            case 0: pred = 0; break;
            case 1: pred = a; break;
            case 2: pred = b; break;
            case 3: pred = (a + b) >> 1; break;
            case 4: {
                int p = a + b - c, pa = abs(p - a), pb = abs(p - b), pc = abs(p - c);
                pred = (pa <= pb && pa <= pc) ? a : (pb <= pc ? b : c);
                break;
            }
            default: pred = 0; bad = (int)y; break;
            }
            cur[i] = (uint8_t)(line[i] + pred);
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&raw);
    if (bad >= 0) {
        Py_DECREF(out);
        return PyErr_Format(PyExc_ValueError, "png_unfilter: bad filter type on row %d", bad);
    }
    return (PyObject *)out;
}

static PyMethodDef inception_module_methods[] = {
    {"png_unfilter", py_png_unfilter, METH_VARARGS,
     "png_unfilter(raw, height, stride, bpp) -> uint8 [height, stride]: undo PNG row filters."},
    {NULL, NULL, 0, NULL},
};

int mcpy_inception_init(PyObject *module) {
    return mcpy_add_type(module, &Inception_type, "Inception", inception_module_methods);
}

/* The model bindings' shared pieces (see py_model.h). */
#include "py_model.h"

#include "py_config.h"

#include <stdio.h>
#include <stdlib.h>

#include "../models/vae.h" /* mc_vae_to_uint8 */

void mcpy_model_release(mcpy_model_object *self, mcpy_release_fn release) {
    release(self); /* the model first: it lives on the backend */
    mc_backend_destroy(self->backend);
    self->backend = NULL;
}

void mcpy_model_dealloc(mcpy_model_object *self, mcpy_release_fn release) {
    mcpy_model_release(self, release);
    if (self->lock != NULL)
        PyThread_free_lock(self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

int mcpy_model_load(mcpy_model_object *self, mcpy_release_fn release, int with_lock, PyObject *path_bytes,
                    const char *device, int threads, const char *threads_name, mc_wtype wtype,
                    mcpy_model_loader load, void *model) {
    if (threads < 0) {
        Py_DECREF(path_bytes);
        PyErr_Format(PyExc_ValueError, "%s must be >= 0 (0 = all OpenMP threads), got %d", threads_name, threads);
        return -1;
    }
    if (with_lock && mcpy_ensure_lock(&self->lock) < 0) {
        Py_DECREF(path_bytes);
        return -1;
    }
    mcpy_model_release(self, release); /* __init__ called again on a live object: the new file and device apply */
    mc_err err = {0};
    mc_backend *backend = NULL;
    mc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = mcpy_load_model(PyBytes_AS_STRING(path_bytes), device, threads, wtype, load, model, &backend, &err);
    Py_END_ALLOW_THREADS
    Py_DECREF(path_bytes);
    if (st != MC_OK) {
        mcpy_raise(&err);
        return -1;
    }
    self->backend = backend;
    return 0;
}

int mcpy_model_init_path_threads_device(mcpy_model_object *self, PyObject *args, PyObject *kwds,
                                        const char *type_name, mcpy_release_fn release, mcpy_model_loader load,
                                        void *model) {
    static char *kwlist[] = {"path", "num_threads", "device", "dtype", NULL};
    char format[64];
    snprintf(format, sizeof format, "O&|iss:%s", type_name);
    const char *device = "cpu", *dtype = "fp32";
    PyObject *path_bytes = NULL;
    int num_threads = 0;
    mc_wtype wtype;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, format, kwlist, PyUnicode_FSConverter, &path_bytes, &num_threads,
                                     &device, &dtype))
        return -1;
    if (mcpy_parse_wtype(dtype, &wtype) < 0) {
        Py_XDECREF(path_bytes);
        return -1;
    }
    return mcpy_model_load(self, release, 1, path_bytes, device, num_threads, "num_threads", wtype, load, model);
}

mc_status mcpy_decode_images(mcpy_decode_fn decode, void *ctx, int64_t n, int64_t image_floats, int as_uint8,
                             void *out, const char *what, mc_err *err) {
    if (!as_uint8)
        return decode(ctx, 0, n, out, err);
    float *image = n > 0 ? malloc((size_t)image_floats * sizeof(float)) : NULL;
    if (n > 0 && image == NULL)
        return mc_fail_nomem_n(err, (size_t)image_floats, sizeof(float), "one decoded image");
    mc_status st = MC_OK;
    uint8_t *pixels = out;
    for (int64_t i = 0; i < n && st == MC_OK; i++) {
        st = decode(ctx, i, 1, image, err);
        if (st == MC_OK && mc_vae_to_uint8(image, image_floats, pixels + i * image_floats) != MC_OK)
            st = mc_fail(err, MC_ERR_NUMERIC, "%s decoder output of image %lld contains NaN", what, (long long)i);
    }
    free(image);
    return st;
}

int mcpy_add_type(PyObject *module, PyTypeObject *type, const char *name, PyMethodDef *functions) {
    if (PyType_Ready(type) < 0)
        return -1;
    Py_INCREF(type);
    if (PyModule_AddObject(module, name, (PyObject *)type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    return functions != NULL ? PyModule_AddFunctions(module, functions) : 0;
}

int mcpy_require_loaded(const void *model, const char *what) {
    if (model != NULL)
        return 0;
    PyErr_Format(PyExc_RuntimeError, "%s is not loaded", what);
    return -1;
}

PyObject *mcpy_result(mc_status st, const mc_err *err, PyObject *out) {
    if (st == MC_OK)
        return out;
    Py_XDECREF(out);
    return mcpy_raise(err);
}

PyArrayObject *mcpy_float32_arg(PyObject *obj, const char *what) {
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
                                    NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED | NPY_ARRAY_FORCECAST, NULL);
    Py_DECREF(arr);
    return (PyArrayObject *)f32;
}

PyArrayObject *mcpy_array_arg(PyObject *obj, int typenum, int ndim, const char *what) {
    PyArrayObject *arr = (PyArrayObject *)PyArray_FROMANY(obj, typenum, 0, 0,
                                                          NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED |
                                                              NPY_ARRAY_FORCECAST);
    if (arr == NULL)
        return NULL;
    if (PyArray_NDIM(arr) != ndim) {
        char shape[160];
        mcpy_format_array_shape(shape, sizeof shape, arr);
        PyErr_Format(PyExc_ValueError, "%s must have %d dimensions, got shape %s", what, ndim, shape);
        Py_DECREF(arr);
        return NULL;
    }
    return arr;
}

int mcpy_arrays_arg(int count, const mcpy_array_spec *spec, PyArrayObject **out) {
    for (int i = 0; i < count; i++)
        out[i] = NULL;
    for (int i = 0; i < count; i++)
        if ((out[i] = mcpy_array_arg(spec[i].obj, spec[i].typenum, spec[i].ndim, spec[i].what)) == NULL) {
            mcpy_arrays_release(i, out);
            return -1;
        }
    return 0;
}

void mcpy_arrays_release(int count, PyArrayObject **arrays) {
    for (int i = 0; i < count; i++)
        Py_CLEAR(arrays[i]);
}

PyObject *mcpy_int_tuple(const int64_t *values, Py_ssize_t n) {
    PyObject *tuple = PyTuple_New(n);
    for (Py_ssize_t i = 0; tuple != NULL && i < n; i++) {
        PyObject *item = PyLong_FromLongLong((long long)values[i]);
        if (item == NULL)
            Py_CLEAR(tuple);
        else
            PyTuple_SET_ITEM(tuple, i, item);
    }
    return tuple;
}

PyObject *mcpy_get_backend_allocations(mcpy_model_object *self, void *closure) {
    (void)closure;
    return PyLong_FromLongLong(self->backend ? (long long)self->backend->allocations : 0);
}

PyObject *mcpy_get_backend_syncs(mcpy_model_object *self, void *closure) {
    (void)closure;
    return PyLong_FromLongLong(self->backend ? (long long)self->backend->syncs : 0);
}

PyObject *mcpy_get_backend_team_regions(mcpy_model_object *self, void *closure) {
    (void)closure;
    return PyLong_FromLongLong(self->backend ? (long long)self->backend->team_regions : 0);
}

PyObject *mcpy_get_backend_team_calls(mcpy_model_object *self, void *closure) {
    (void)closure;
    return PyLong_FromLongLong(self->backend ? (long long)self->backend->team_calls : 0);
}

PyObject *mcpy_get_backend_flops(mcpy_model_object *self, void *closure) {
    (void)closure;
    return PyLong_FromLongLong(self->backend ? (long long)self->backend->dispatched_flops : 0);
}

const mc_config_schema *mcpy_policy_config(PyObject *cache, const char *family,
                                           const mc_config_schema *(*lookup)(const char *name), void **config) {
    *config = NULL;
    if (!PyDict_Check(cache)) {
        PyErr_Format(PyExc_TypeError, "cache must be None or a dict from a marcache %s cache policy's as_dict()",
                     family);
        return NULL;
    }
    PyObject *name_obj = PyDict_GetItemString(cache, "policy");
    const char *name = name_obj && PyUnicode_Check(name_obj) ? PyUnicode_AsUTF8(name_obj) : NULL;
    if (name == NULL) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "cache config: missing 'policy' (the policy's name)");
        return NULL;
    }
    const mc_config_schema *schema = lookup(name);
    if (schema == NULL) {
        PyErr_Format(PyExc_ValueError, "cache config: no %s cache policy named '%s'", family, name);
        return NULL;
    }
    *config = PyMem_Calloc(1, schema->size);
    if (*config == NULL) {
        mcpy_no_memory("the cache policy's configuration", schema->size);
        return NULL;
    }
    if (mcpy_fill_config(cache, name, schema->fields, *config, schema->size, "policy") < 0) {
        mcpy_policy_config_free(schema, *config);
        *config = NULL;
        return NULL;
    }
    return schema;
}

void mcpy_policy_config_free(const mc_config_schema *schema, void *config) {
    if (schema != NULL)
        mcpy_free_config(schema->fields, config);
    PyMem_Free(config);
}

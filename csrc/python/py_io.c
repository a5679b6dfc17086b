/* Python access to the safetensors reader: safetensors_read (all tensors as
 * float32 NumPy arrays) and safetensors_info (names, dtypes, shapes). Both
 * return the metadata dict as well. The GIL is released while the file is
 * mapped and validated and while tensors are converted. */
#include "py_numpy.h"

#include "../io/bind.h"
#include "../io/safetensors.h"
#include "py_backend.h"

/* Opens `path` (str, bytes or os.PathLike) with the GIL released. Returns
 * the file or NULL with an exception set. */
static mc_st_file *open_without_gil(PyObject *path_arg) {
    PyObject *path_bytes = NULL;
    if (!PyUnicode_FSConverter(path_arg, &path_bytes))
        return NULL;
    const char *path = PyBytes_AS_STRING(path_bytes);
    mc_err err = {0};
    mc_st_file *file = NULL;
    mc_status status;
    Py_BEGIN_ALLOW_THREADS
    status = mc_st_open(path, &file, &err);
    Py_END_ALLOW_THREADS
    Py_DECREF(path_bytes);
    if (status != MC_OK) {
        mcpy_raise(&err);
        return NULL;
    }
    return file;
}

static PyObject *metadata_dict(const mc_st_file *file) {
    PyObject *dict = PyDict_New();
    if (dict == NULL)
        return NULL;
    for (int64_t i = 0; i < file->n_metadata; i++) {
        PyObject *value = PyUnicode_FromString(file->metadata_values[i]);
        if (value == NULL || PyDict_SetItemString(dict, file->metadata_keys[i], value) < 0) {
            Py_XDECREF(value);
            Py_DECREF(dict);
            return NULL;
        }
        Py_DECREF(value);
    }
    return dict;
}

static PyObject *shape_tuple(const mc_st_tensor *t) {
    PyObject *tuple = PyTuple_New(t->ndim);
    if (tuple == NULL)
        return NULL;
    for (int d = 0; d < t->ndim; d++) {
        PyObject *dim = PyLong_FromLongLong((long long)t->shape[d]);
        if (dim == NULL) {
            Py_DECREF(tuple);
            return NULL;
        }
        PyTuple_SET_ITEM(tuple, d, dim);
    }
    return tuple;
}

static int converts_to_f32(mc_dtype dtype) {
    return dtype == MC_DT_F32 || dtype == MC_DT_F16 || dtype == MC_DT_BF16 || dtype == MC_DT_F64;
}

/* Every tensor of the file as a float32 array: {name: array}. */
static PyObject *tensor_dict(mc_st_file *file) {
    PyObject *tensors = NULL;
    PyArrayObject **arrays = NULL;
    int64_t n = file->n_tensors;
    mc_err err = {0};
    mc_status status = MC_OK;

    /* Check every dtype before allocating any array, so a file with one
     * integer tensor fails fast and names it. */
    for (int64_t i = 0; i < n; i++) {
        const mc_st_tensor *t = &file->tensors[i];
        if (!converts_to_f32(t->dtype)) {
            PyErr_Format(PyExc_ValueError,
                         "%s: key '%s' has dtype %s; safetensors_read converts only F32, F16, BF16 and F64 to "
                         "float32",
                         file->path, t->name, mc_dtype_name(t->dtype));
            return NULL;
        }
    }
    arrays = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof *arrays);
    if (arrays == NULL)
        return mcpy_no_memory("the list of tensors", (n > 0 ? (size_t)n : 1) * sizeof *arrays);
    for (int64_t i = 0; i < n; i++) {
        const mc_st_tensor *t = &file->tensors[i];
        npy_intp dims[MC_ST_MAX_DIMS];
        for (int d = 0; d < t->ndim; d++)
            dims[d] = (npy_intp)t->shape[d];
        arrays[i] = (PyArrayObject *)PyArray_SimpleNew(t->ndim, dims, NPY_FLOAT32);
        if (arrays[i] == NULL)
            goto done;
    }

    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < n && status == MC_OK; i++)
        status = mc_st_to_f32(file, &file->tensors[i], (float *)PyArray_DATA(arrays[i]), &err);
    Py_END_ALLOW_THREADS
    if (status != MC_OK) {
        mcpy_raise(&err);
        goto done;
    }

    tensors = PyDict_New();
    for (int64_t i = 0; tensors != NULL && i < n; i++)
        if (PyDict_SetItemString(tensors, file->tensors[i].name, (PyObject *)arrays[i]) < 0)
            Py_CLEAR(tensors);

done:
    for (int64_t i = 0; i < n; i++)
        Py_XDECREF(arrays[i]);
    PyMem_Free(arrays);
    return tensors;
}

/* Every tensor's (name, dtype name, shape tuple), in file order. */
static PyObject *entry_list(mc_st_file *file) {
    PyObject *entries = PyList_New((Py_ssize_t)file->n_tensors);
    for (int64_t i = 0; entries != NULL && i < file->n_tensors; i++) {
        const mc_st_tensor *t = &file->tensors[i];
        PyObject *shape = shape_tuple(t);
        PyObject *entry = shape ? Py_BuildValue("(ssN)", t->name, mc_dtype_name(t->dtype), shape) : NULL;
        if (entry == NULL)
            Py_CLEAR(entries);
        else
            PyList_SET_ITEM(entries, (Py_ssize_t)i, entry);
    }
    return entries;
}

/* What both readers return for the file at path_arg: (contents(file), its
 * metadata dict); the file is closed again in any case. */
static PyObject *read_with_metadata(PyObject *path_arg, PyObject *(*contents)(mc_st_file *file)) {
    mc_st_file *file = open_without_gil(path_arg);
    if (file == NULL)
        return NULL;
    PyObject *first = contents(file), *metadata = first ? metadata_dict(file) : NULL;
    PyObject *result = metadata ? PyTuple_Pack(2, first, metadata) : NULL;
    Py_XDECREF(first);
    Py_XDECREF(metadata);
    mc_st_close(file);
    return result;
}

static PyObject *py_safetensors_read(PyObject *self, PyObject *path_arg) {
    (void)self;
    return read_with_metadata(path_arg, tensor_dict);
}

static PyObject *py_safetensors_info(PyObject *self, PyObject *path_arg) {
    (void)self;
    return read_with_metadata(path_arg, entry_list);
}

/* Test hook: binds one tensor as a model does (mc_bind: piecewise
 * conversion, the layout, the backend's weight type, the upload) and
 * downloads it again, so the tests can compare every path of the loader with
 * NumPy. layout: "as_is", "conv_ohwi" or "linear"; a 16-bit linear weight
 * comes back as its uint16 bits. */
static PyObject *py_bind_read(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *keywords[] = {"path", "name", "layout", "dtype", "device", NULL};
    PyObject *path_obj = NULL;
    const char *name = NULL, *layout_name = "as_is", *dtype = "fp32", *device = "cpu";
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O&s|sss", keywords, PyUnicode_FSConverter, &path_obj, &name,
                                     &layout_name, &dtype, &device))
        return NULL;
    static const char *const layout_names[] = {"as_is", "conv_ohwi", "linear", NULL};
    static const mc_bind_layout layouts[] = {MC_BIND_AS_IS, MC_BIND_CONV_OHWI, MC_BIND_LINEAR};
    const int layout_index = mcpy_choice(layout_name, layout_names, "layout");
    if (layout_index < 0) {
        Py_DECREF(path_obj);
        return NULL;
    }
    const mc_bind_layout layout = layouts[layout_index];
    mc_wtype wtype;
    if (mcpy_parse_wtype(dtype, &wtype) < 0) {
        Py_DECREF(path_obj);
        return NULL;
    }
    mc_err err = {0};
    mc_st_file *file = NULL;
    mc_backend *be = NULL;
    mc_loader ld;
    int loader_ready = 0, ndim = 0;
    int64_t shape[MC_ST_MAX_DIMS] = {0};
    float *bound = NULL;
    PyArrayObject *array = NULL;
    mc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = mc_st_open(PyBytes_AS_STRING(path_obj), &file, &err);
    if (st == MC_OK)
        st = mcpy_backend_open(device, 1, wtype, &be, &err);
    if (st == MC_OK) {
        mc_loader_init(&ld, file, be, &err);
        loader_ready = 1;
        st = mc_loader_shape(&ld, name, &ndim, shape);
    }
    if (st == MC_OK)
        st = mc_bind(&ld, name, ndim, shape, layout, &bound);
    Py_END_ALLOW_THREADS
    if (st == MC_OK) {
        npy_intp dims[MC_ST_MAX_DIMS];
        for (int d = 0; d < ndim; d++)
            dims[d] = (npy_intp)shape[d];
        if (layout == MC_BIND_CONV_OHWI) { /* [O, I, kh, kw] stored, [O, kh, kw, I] bound */
            dims[1] = (npy_intp)shape[2];
            dims[2] = (npy_intp)shape[3];
            dims[3] = (npy_intp)shape[1];
        }
        const int packed = layout == MC_BIND_LINEAR && wtype != MC_WTYPE_F32;
        array = (PyArrayObject *)PyArray_SimpleNew(ndim, dims, packed ? NPY_UINT16 : NPY_FLOAT32);
        if (array != NULL && PyArray_NBYTES(array) > 0) {
            Py_BEGIN_ALLOW_THREADS
            st = be->ops->download(be, PyArray_DATA(array), bound, (size_t)PyArray_NBYTES(array), &err);
            Py_END_ALLOW_THREADS
        }
    }
    if (loader_ready)
        mc_loader_finish(&ld);
    mc_backend_destroy(be);
    mc_st_close(file);
    Py_DECREF(path_obj);
    if (st != MC_OK) {
        Py_XDECREF(array);
        mcpy_raise(&err);
        return NULL;
    }
    return (PyObject *)array;
}

static PyMethodDef io_methods[] = {
    {"_bind_read", (PyCFunction)(void (*)(void))py_bind_read, METH_VARARGS | METH_KEYWORDS,
     "_bind_read(path, name, layout='as_is', dtype='fp32', device='cpu') -> ndarray (test hook)\n\n"
     "Binds one tensor as a model load does and downloads it: float32 in the bound layout\n"
     "(conv_ohwi: [O, kh, kw, I]), or the uint16 bits of a 16-bit linear weight."},
    {"safetensors_read", py_safetensors_read, METH_O,
     "safetensors_read(path) -> (dict name -> float32 ndarray, metadata dict)\n\n"
     "Strictly validates the file, then converts every F32/F16/BF16/F64 tensor to a\n"
     "C-ordered float32 array of its stored shape; other dtypes raise ValueError."},
    {"safetensors_info", py_safetensors_info, METH_O,
     "safetensors_info(path) -> (list of (name, dtype, shape), metadata dict)\n\n"
     "Strictly validates the file and lists its tensors in header order."},
    {NULL, NULL, 0, NULL},
};

int mcpy_io_init(PyObject *module) { return PyModule_AddFunctions(module, io_methods); }

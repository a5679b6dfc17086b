/* The marcache._C extension module: build facts plus the per-area bindings. */
#define MC_PY_MODULE_MAIN
#include "py_numpy.h"

#include "../backend/cpu/cpu_internal.h"

#ifndef MC_BLAS_NAME
#define MC_BLAS_NAME "unknown"
#endif
#ifndef MC_BUILD_CFLAGS
#define MC_BUILD_CFLAGS ""
#endif

PyObject *mcpy_raise(const mc_err *err) {
    PyObject *type;
    switch (err->status) {
    case MC_ERR_KEY: type = PyExc_KeyError; break;
    case MC_ERR_IO: type = PyExc_OSError; break;
    case MC_ERR_NOT_FOUND: type = PyExc_FileNotFoundError; break;
    case MC_ERR_NOMEM: type = PyExc_MemoryError; break;
    case MC_ERR_INTERRUPTED: type = PyExc_KeyboardInterrupt; break;
    case MC_ERR_NUMERIC: type = PyExc_FloatingPointError; break;
    case MC_ERR_INTERNAL: type = PyExc_RuntimeError; break;
    case MC_ERR_VALUE:
    default: type = PyExc_ValueError; break;
    }
    if (err->status == MC_ERR_INTERRUPTED && PyErr_Occurred())
        return NULL; /* keep the KeyboardInterrupt raised by the signal check */
    PyErr_SetString(type, err->msg[0] ? err->msg : "marcache: unknown error");
    return NULL;
}

static PyObject *build_info(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return Py_BuildValue("{s:s,s:s,s:s,s:s,s:i,s:s}", "backends", "cpu", "blas", MC_BLAS_NAME,
                         "blas_config", mc_cpu_blas_config(), "cflags", MC_BUILD_CFLAGS,
                         "openmp", _OPENMP, "compiler", __VERSION__);
}

static PyMethodDef module_methods[] = {
    {"build_info", build_info, METH_NOARGS, "Backends, BLAS and compiler flags built in."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "marcache._C", "marcache C engine", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__C(void) {
    import_array();
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    if (mcpy_io_init(module) < 0 || mcpy_ops_init(module) < 0 || mcpy_mar_init(module) < 0 ||
        mcpy_vae_init(module) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}

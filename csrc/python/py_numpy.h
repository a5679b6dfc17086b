/* NumPy C API across several translation units: exactly one (module.c)
 * defines MC_PY_MODULE_MAIN and runs import_array(). */
#ifndef MC_PY_NUMPY_H
#define MC_PY_NUMPY_H
#include "py_common.h"
#define PY_ARRAY_UNIQUE_SYMBOL marcache_ARRAY_API
#ifndef MC_PY_MODULE_MAIN
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

/* mcpy_format_shape of an array's shape. */
static inline void mcpy_format_array_shape(char *buf, size_t size, PyArrayObject *arr) {
    int64_t dims[NPY_MAXDIMS];
    for (int d = 0; d < PyArray_NDIM(arr); d++)
        dims[d] = (int64_t)PyArray_DIM(arr, d);
    mcpy_format_shape(buf, size, PyArray_NDIM(arr), dims);
}
#endif

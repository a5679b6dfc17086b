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
#endif

/* Shared helpers of the CPython binding: mc_err -> Python exception, and the
 * init hooks each binding file provides to the module. */
#ifndef MC_PY_COMMON_H
#define MC_PY_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "../core/mc_core.h"

/* Raises the Python exception matching err->status with err->msg; returns NULL. */
PyObject *mcpy_raise(const mc_err *err);

/* Per-area registration, called from PyInit__C. Each returns 0 or -1 with an
 * exception set. */
int mcpy_io_init(PyObject *module);
int mcpy_ops_init(PyObject *module);
int mcpy_mar_init(PyObject *module);
int mcpy_vae_init(PyObject *module);
int mcpy_inception_init(PyObject *module);

#endif

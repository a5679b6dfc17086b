/* Shared helpers of the CPython binding: mc_err -> Python exception, and the
 * init hooks each binding file provides to the module. */
#ifndef MC_PY_COMMON_H
#define MC_PY_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "../core/mc_core.h"

/* Raises the Python exception matching err->status with err->msg; returns NULL. */
PyObject *mcpy_raise(const mc_err *err);

/* Ctrl-C polling from GIL-free C loops: the loop calls mcpy_cancel_check
 * (an `int (*)(void *)` cancel callback) with a context holding the saved
 * thread state; it takes the GIL back just long enough to run the signal
 * handlers and returns nonzero when one raised. Start with
 * `mcpy_cancel_ctx c = {PyEval_SaveThread()};` and end with
 * `PyEval_RestoreThread(c.thread_state);`. */
typedef struct mcpy_cancel_ctx {
    PyThreadState *thread_state;
} mcpy_cancel_ctx;

int mcpy_cancel_check(void *ctx);

/* Per-area registration, called from PyInit__C. Each returns 0 or -1 with an
 * exception set. */
int mcpy_io_init(PyObject *module);
int mcpy_ops_init(PyObject *module);
int mcpy_mar_init(PyObject *module);
int mcpy_vae_init(PyObject *module);
int mcpy_inception_init(PyObject *module);

#endif

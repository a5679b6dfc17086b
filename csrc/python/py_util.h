/* Helpers every file of the CPython binding uses: mc_err -> Python
 * exception, Ctrl-C polling from GIL-free C loops, shape formatting for
 * messages. They live here (py_util.c), not in module.c, so the binding's
 * files depend on this one and module.c depends on them, never back. */
#ifndef MC_PY_UTIL_H
#define MC_PY_UTIL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>

#include "../core/mc_core.h"

/* Raises the Python exception matching err->status with err->msg; returns NULL. */
PyObject *mcpy_raise(const mc_err *err);

/* MemoryError naming what could not be allocated and its size (PyErr_NoMemory's
 * MemoryError has no message, which tells a user nothing), in mc_fail_nomem's
 * format. Returns NULL. */
PyObject *mcpy_no_memory(const char *what, size_t bytes);

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

/* The index of string argument `value` among `choices` (NULL-terminated),
 * or -1 with ValueError "<what> must be 'a', 'b' or 'c', got '<value>'". */
int mcpy_choice(const char *value, const char *const *choices, const char *what);

/* "(2, 3)" or "(4,)" for messages, truncated to fit buf. */
void mcpy_format_shape(char *buf, size_t size, int ndim, const int64_t *dims);

#endif

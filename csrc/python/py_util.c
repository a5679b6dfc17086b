/* Helpers shared by every file of the binding (see py_util.h). */
#include "py_util.h"

#include <stdio.h>
#include <string.h>

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

int mcpy_cancel_check(void *ctx) {
    mcpy_cancel_ctx *c = ctx;
    PyEval_RestoreThread(c->thread_state);
    int interrupted = PyErr_CheckSignals() < 0;
    c->thread_state = PyEval_SaveThread();
    return interrupted;
}

void mcpy_format_shape(char *buf, size_t size, int ndim, const int64_t *dims) {
    size_t used = (size_t)snprintf(buf, size, "(");
    for (int i = 0; i < ndim && used < size; i++)
        used += (size_t)snprintf(buf + used, size - used, "%s%lld", i ? ", " : "", (long long)dims[i]);
    if (used < size)
        snprintf(buf + used, size - used, ndim == 1 ? ",)" : ")");
}

PyObject *mcpy_no_memory(const char *what, size_t bytes) {
    mc_err err = {0}; /* through the core's writer: one format for every MemoryError */
    mc_fail_nomem(&err, bytes, "%s", what);
    return mcpy_raise(&err);
}

int mcpy_choice(const char *value, const char *const *choices, const char *what) {
    int n = 0;
    for (; choices[n] != NULL; n++)
        if (strcmp(value, choices[n]) == 0)
            return n;
    char listed[256];
    size_t used = 0;
    listed[0] = '\0';
    for (int i = 0; i < n && used < sizeof listed; i++)
        used += (size_t)snprintf(listed + used, sizeof listed - used, "%s'%s'", i == 0 ? "" : i == n - 1 ? " or " : ", ",
                                 choices[i]);
    PyErr_Format(PyExc_ValueError, "%s must be %s, got '%s'", what, listed, value);
    return -1;
}

#include "py_generate.h"

typedef struct generate_host {
    PyThreadState *thread_state;
    PyObject *callback;  /* Python callable(step dict) or None */
    PyObject *step_list;
    mcpy_tail_fn tail_fn;
    void *tail_ctx;
    int failed;          /* a Python exception is set */
} generate_host;

static void host_release(void *opaque) {
    generate_host *h = opaque;
    h->thread_state = PyEval_SaveThread();
}

static void host_acquire(void *opaque) {
    generate_host *h = opaque;
    PyEval_RestoreThread(h->thread_state);
}

static PyObject *header_dict(const mc_step_header *s) {
    return Py_BuildValue("{s:i,s:O,s:d,s:d,s:L,s:L,s:L}", "step", s->step, "full", s->full ? Py_True : Py_False,
                         "seconds", s->seconds, "flops", s->flops, "cache_bytes", (long long)s->cache_bytes,
                         "allocations", (long long)s->allocations, "host_waits", (long long)s->host_waits);
}

/* Between steps, with the GIL: record the step, call the progress
 * callback, run the signal handlers (Ctrl-C). */
static int host_on_step(void *opaque, const mc_step_header *header, const void *tail) {
    generate_host *h = opaque;
    PyObject *d = header_dict(header);
    int cancel = d == NULL || (h->tail_fn != NULL && h->tail_fn(d, tail, h->tail_ctx) < 0) ||
                 PyList_Append(h->step_list, d) < 0;
    if (!cancel && h->callback != NULL && h->callback != Py_None) {
        PyObject *r = PyObject_CallFunctionObjArgs(h->callback, d, NULL);
        cancel = r == NULL;
        Py_XDECREF(r);
    }
    Py_XDECREF(d);
    if (!cancel && PyErr_CheckSignals() < 0)
        cancel = 1;
    h->failed = cancel;
    return cancel;
}

PyObject *mcpy_generate(const mc_generator_ops *gen, void *run, mc_backend *backend, PyObject *callback,
                        mcpy_tail_fn tail_fn, void *tail_ctx) {
    generate_host h = {.callback = callback, .tail_fn = tail_fn, .tail_ctx = tail_ctx};
    h.step_list = PyList_New(0);
    if (h.step_list == NULL)
        return NULL;
    mc_driver_host host = {.ctx = &h, .release = host_release, .acquire = host_acquire, .on_step = host_on_step};
    mc_err err = {0};
    mc_status st = mc_generate(gen, run, backend, &host, &err);
    if (st != MC_OK) {
        Py_DECREF(h.step_list);
        if (h.failed && PyErr_Occurred())
            return NULL;
        return mcpy_raise(&err);
    }
    return h.step_list;
}

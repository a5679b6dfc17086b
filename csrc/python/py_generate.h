/* The one generation binding every model family uses: runs a family's
 * generator (runtime/driver.h) with the GIL released, and turns each step's
 * telemetry into a dict (the common header here, the family's tail through
 * `tail_fn`), appended to a list and passed to the progress callback. */
#ifndef MC_PY_GENERATE_H
#define MC_PY_GENERATE_H

#include "py_common.h"

#include "../runtime/driver.h"

/* Adds a family's per-step keys to `dict`; returns 0, or -1 with an exception set. */
typedef int (*mcpy_tail_fn)(PyObject *dict, const void *tail, void *tail_ctx);

/* Returns the list of step dicts, or NULL with an exception set (the
 * callback's exception, KeyboardInterrupt, or the runtime's error). */
PyObject *mcpy_generate(const mc_generator_ops *gen, void *run, mc_backend *backend, PyObject *callback,
                        mcpy_tail_fn tail_fn, void *tail_ctx);

#endif

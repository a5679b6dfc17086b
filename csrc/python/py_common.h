/* What every file of the binding includes: Python, the shared helpers
 * (py_util.h), and the registration hook each area provides to the module
 * (module.c calls them; nothing calls back into module.c). */
#ifndef MC_PY_COMMON_H
#define MC_PY_COMMON_H

#include "py_util.h"

/* Per-area registration, called from PyInit__C. Each returns 0 or -1 with an
 * exception set. */
int mcpy_build_init(PyObject *module);
int mcpy_devpool_init(PyObject *module);
int mcpy_io_init(PyObject *module);
int mcpy_ops_init(PyObject *module);
int mcpy_mar_init(PyObject *module);
int mcpy_vae_init(PyObject *module);
int mcpy_vqvae_init(PyObject *module);
int mcpy_inception_init(PyObject *module);
int mcpy_var_init(PyObject *module);

#endif

/* What other bindings need of marcache._C.VQVAE (py_vqvae.c): VAR's
 * generate (py_var.c) runs each scale's VQ update on the VQVAE object the
 * caller passes. */
#ifndef MC_PY_VQVAE_H
#define MC_PY_VQVAE_H

#include "py_common.h"

#include <pythread.h>

#include "../backend/ops.h"
#include "../models/vqvae.h"

/* The model behind a _C.VQVAE object, the backend it lives on and the
 * object's one-call-at-a-time lock (the caller takes it, without waiting,
 * for as long as it uses the model). 0, or -1 with TypeError (not a VQVAE)
 * or RuntimeError (not loaded). */
int mcpy_vqvae_borrow(PyObject *obj, mc_vqvae **vq, mc_backend **backend, PyThread_type_lock *lock);

#endif

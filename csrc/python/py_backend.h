/* Backend selection for the model bindings (MAR, VAE, Inception). */
#ifndef MC_PY_BACKEND_H
#define MC_PY_BACKEND_H

#include "py_common.h"

#include <pythread.h>

#include "../backend/ops.h"
#include "../io/safetensors.h"

/* "fp32" / "bf16" / "fp16" -> mc_wtype; -1 with ValueError otherwise. */
int mcpy_parse_wtype(const char *dtype, mc_wtype *out);

/* Creates the backend named by `device` ("cpu", "guard", "cuda", "cuda:N")
 * with `threads` CPU threads (0: all) and `linear` weights of `wtype`.
 * Needs no GIL. A bad or unavailable device is MC_ERR_VALUE naming it. */
mc_status mcpy_backend_open(const char *device, int threads, mc_wtype wtype, mc_backend **out,
                            mc_err *err);

/* A model's loader: binds the model in `file` to `backend`; `model` is the
 * caller's out-pointer for it (mc_vae **, mc_inception **, ...). */
typedef mc_status (*mcpy_model_loader)(mc_backend *backend, mc_st_file *file, void *model,
                                       mc_err *err);

/* The load sequence the model bindings share: opens the safetensors file at
 * `path`, makes the backend for `device` (as mcpy_backend_open), calls
 * load(backend, file, model, err) and closes the file. On failure the
 * backend is destroyed and *backend is NULL. Needs no GIL. */
mc_status mcpy_load_model(const char *path, const char *device, int threads, mc_wtype wtype,
                          mcpy_model_loader load, void *model, mc_backend **backend, mc_err *err);

/* Makes *lock (a model object's one-call-at-a-time lock) unless it exists;
 * -1 with MemoryError when it cannot. */
int mcpy_ensure_lock(PyThread_type_lock *lock);

#endif

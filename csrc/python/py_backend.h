/* Backend selection for the model bindings (MAR, VAE, Inception). */
#ifndef MC_PY_BACKEND_H
#define MC_PY_BACKEND_H

#include "py_common.h"

#include "../backend/ops.h"

/* "fp32" / "bf16" / "fp16" -> mc_wtype; -1 with ValueError otherwise. */
int mcpy_parse_wtype(const char *dtype, mc_wtype *out);

/* Creates the backend named by `device` ("cpu", "guard", "cuda", "cuda:N")
 * with `threads` CPU threads (0: all) and `linear` weights of `wtype`.
 * Needs no GIL. A bad or unavailable device is MC_ERR_VALUE naming it. */
mc_status mcpy_backend_open(const char *device, int threads, mc_wtype wtype, mc_backend **out,
                            mc_err *err);

#endif

/* A policy's config struct filled from its Python fields by walking the
 * policy's C field table (runtime/config_fields.h): one generic function,
 * no per-field code. */
#ifndef MC_PY_CONFIG_H
#define MC_PY_CONFIG_H

#include "py_common.h"

#include "../runtime/config_fields.h"

/* Zeroes `config` (`size` bytes) and fills it from the dict `values` of the
 * policy's fields; `ignore` names one extra key that is not a field (or
 * NULL). A missing, unknown, mistyped or out-of-range field raises a
 * ValueError or TypeError naming `what` and the field; returns -1 then.
 * A composed policy's config (MC_FIELD_POLICY) is allocated: release with
 * mcpy_free_config. */
int mcpy_fill_config(PyObject *values, const char *what, const mc_config_field *fields, void *config, size_t size,
                     const char *ignore);

/* Frees what mcpy_fill_config allocated inside `config` (composed policies'
 * configs), not `config` itself. */
void mcpy_free_config(const mc_config_field *fields, void *config);

#endif

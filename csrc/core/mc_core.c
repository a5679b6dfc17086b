#include "mc_core.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

mc_status mc_fail(mc_err *err, mc_status status, const char *fmt, ...) {
    if (err == NULL)
        return status;
    if (err->status != MC_OK)
        return err->status;
    err->status = status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    return status;
}

int mc_mul_overflows(size_t a, size_t b, size_t *out) {
    if (a != 0 && b > SIZE_MAX / a)
        return 1;
    *out = a * b;
    return 0;
}

void *mc_aligned_alloc(size_t bytes) {
    if (bytes == 0)
        bytes = 64;
    size_t rounded = (bytes + 63) & ~(size_t)63;
    if (rounded < bytes)
        return NULL;
    return aligned_alloc(64, rounded);
}

void mc_aligned_free(void *p) { free(p); }

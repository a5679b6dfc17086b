#include "mc_core.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

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

/* The one writer of out-of-memory messages (mc_core.h). count * each is
 * the size; overflow says so instead of printing a wrapped number. */
static mc_status fail_nomem_v(mc_err *err, size_t count, size_t each, int sized, const char *because,
                              const char *what_fmt, va_list ap) {
    if (err == NULL)
        return MC_ERR_NOMEM;
    if (err->status != MC_OK)
        return err->status;
    char what[MC_ERRMSG_LEN / 2];
    vsnprintf(what, sizeof what, what_fmt, ap);
    char size[MC_ERRMSG_LEN / 4];
    size_t bytes = 0;
    const char *tail = because != NULL && because[0] ? because : NULL;
    if (!sized) {
        snprintf(size, sizeof size, "size not reported: %s", tail != NULL ? tail : "unknown");
        tail = NULL; /* inside the parentheses */
    } else if (mc_mul_overflows(count, each, &bytes)) {
        snprintf(size, sizeof size, "%zu x %zu bytes: more than the address space", count, each);
    } else if (bytes < 1024) {
        snprintf(size, sizeof size, "%zu bytes", bytes);
    } else {
        static const char *const units[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
        double scaled = (double)bytes / 1024.0;
        int unit = 0;
        /* 1023.96 KiB would print as "1024.0 KiB": move up before rounding does */
        while (unit < 5 && scaled >= 1023.95) {
            scaled /= 1024.0;
            unit++;
        }
        snprintf(size, sizeof size, "%zu bytes, %.1f %s", bytes, scaled, units[unit]);
    }
    return mc_fail(err, MC_ERR_NOMEM, "cannot allocate %s (%s)%s%s", what, size, tail != NULL ? ": " : "",
                   tail != NULL ? tail : "");
}

mc_status mc_fail_nomem(mc_err *err, size_t bytes, const char *what_fmt, ...) {
    va_list ap;
    va_start(ap, what_fmt);
    const mc_status st = fail_nomem_v(err, bytes, 1, 1, NULL, what_fmt, ap);
    va_end(ap);
    return st;
}

mc_status mc_fail_nomem_n(mc_err *err, size_t count, size_t each, const char *what_fmt, ...) {
    va_list ap;
    va_start(ap, what_fmt);
    const mc_status st = fail_nomem_v(err, count, each, 1, NULL, what_fmt, ap);
    va_end(ap);
    return st;
}

mc_status mc_fail_nomem_because(mc_err *err, size_t bytes, const char *because, const char *what_fmt, ...) {
    va_list ap;
    va_start(ap, what_fmt);
    const mc_status st = fail_nomem_v(err, bytes, 1, 1, because, what_fmt, ap);
    va_end(ap);
    return st;
}

mc_status mc_fail_nomem_unsized(mc_err *err, const char *because, const char *what_fmt, ...) {
    va_list ap;
    va_start(ap, what_fmt);
    const mc_status st = fail_nomem_v(err, 0, 0, 0, because, what_fmt, ap);
    va_end(ap);
    return st;
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

double mc_seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

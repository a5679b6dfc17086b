/* Core definitions shared by every layer: status codes, the error context
 * that carries a message up to Python, and small checked-arithmetic helpers.
 * Nothing here knows about models or Python. */
#ifndef MC_CORE_H
#define MC_CORE_H

#include <stddef.h>
#include <stdint.h>

typedef enum mc_status {
    MC_OK = 0,
    MC_ERR_VALUE,       /* bad argument or bad file content -> ValueError */
    MC_ERR_KEY,         /* missing tensor name -> KeyError */
    MC_ERR_IO,          /* cannot open/read a file -> OSError */
    MC_ERR_NOT_FOUND,   /* file does not exist -> FileNotFoundError */
    MC_ERR_NOMEM,       /* allocation failed -> MemoryError */
    MC_ERR_INTERRUPTED, /* cancelled between steps (Ctrl-C) -> KeyboardInterrupt */
    MC_ERR_NUMERIC,     /* NaN/Inf detected -> FloatingPointError */
    MC_ERR_INTERNAL     /* a broken invariant or backend failure -> RuntimeError */
} mc_status;

#define MC_ERRMSG_LEN 1024

/* One per call chain. Functions return mc_status and, on failure, leave a
 * human-readable message here; the binding turns it into an exception.
 * The cancel callback lets long C loops poll for Ctrl-C without knowing
 * about Python. */
typedef struct mc_err {
    mc_status status;
    char msg[MC_ERRMSG_LEN];
} mc_err;

/* Record an error (printf-style) and return its status so callers can write
 * `return mc_fail(err, MC_ERR_VALUE, "...")`. The first failure wins: a
 * message already set is not overwritten by callers unwinding the stack. */
mc_status mc_fail(mc_err *err, mc_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* Out of memory, in one format everywhere (csrc/ and the binding's
 * mcpy_no_memory): MC_ERR_NOMEM with
 *     "cannot allocate <what> (<N> bytes)"               under 1 KiB
 *     "cannot allocate <what> (<N> bytes, <x.y> <unit>)"  from 1 KiB on, <unit> the
 *                                                         largest of KiB..EiB with x.y >= 1.0
 * so a user sees what failed and how big it was, exact and readable. `what`
 * is printf-style ("the K/V slot list of %d images"); it is the thing, the
 * size is added here. tests/test_messages.py holds every out-of-memory
 * failure in csrc/ to these functions. */
mc_status mc_fail_nomem(mc_err *err, size_t bytes, const char *what_fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* `count` items of `each` bytes: mc_fail_nomem with their product, or, when
 * the product overflows size_t (no allocation was tried),
 *     "cannot allocate <what> (<count> x <each> bytes: more than the address space)". */
mc_status mc_fail_nomem_n(mc_err *err, size_t count, size_t each, const char *what_fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;

/* mc_fail_nomem followed by ": <because>" (the device's own reason, what a
 * pool holds): "cannot allocate <what> (<size>): <because>". */
mc_status mc_fail_nomem_because(mc_err *err, size_t bytes, const char *because, const char *what_fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;

/* For the one case where the size is not ours to know: a library (the CUDA
 * runtime, cuBLAS) that allocates inside a call and only says it failed.
 *     "cannot allocate <what> (size not reported: <because>)" */
mc_status mc_fail_nomem_unsized(mc_err *err, const char *because, const char *what_fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

#define MC_TRY(expr)                          \
    do {                                      \
        mc_status mc_try_status_ = (expr);    \
        if (mc_try_status_ != MC_OK)          \
            return mc_try_status_;            \
    } while (0)

/* size_t multiply with overflow detection: returns 1 on overflow, else
 * stores the product and returns 0. */
int mc_mul_overflows(size_t a, size_t b, size_t *out);

/* 64-byte aligned allocation (AVX-512 friendly); NULL on failure. */
void *mc_aligned_alloc(size_t bytes);
void mc_aligned_free(void *p);

/* Seconds on a monotonic clock (step and phase telemetry). */
double mc_seconds_now(void);

#endif

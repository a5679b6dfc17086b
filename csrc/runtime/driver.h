/* The family-neutral generation driver: begin / step / finish. It owns what
 * every model family's generation shares: letting other host threads run
 * while it computes (the GIL, through callbacks the binding supplies: the
 * runtime never includes Python.h), the per-step telemetry header, the
 * progress callback and cancellation (Ctrl-C) between steps, and the
 * backend's allocation and host-wait counters per step. A family (MAR's AR
 * loop, VAR's scales) supplies an mc_generator_ops and a per-step tail. */
#ifndef MC_DRIVER_H
#define MC_DRIVER_H

#include <stdint.h>

#include "../backend/ops.h"

/* The common head of every step's telemetry. */
typedef struct mc_step_header {
    int step, num_steps;
    double seconds;      /* wall time of the step */
    double flops;        /* GEMM + attention FLOPs of the step (runtime/flops.h rules) */
    int full;            /* 1 unless a cache policy made this a cached step */
    int64_t cache_bytes; /* bytes held by the cache policy */
    int64_t allocations; /* backend allocations during the step */
    int64_t host_waits;  /* host waits for the backend during the step */
} mc_step_header;

/* What the host (the binding) supplies. Every member may be NULL. */
typedef struct mc_driver_host {
    void *ctx;
    void (*release)(void *ctx); /* before compute: let other host threads run */
    void (*acquire)(void *ctx); /* after compute: take the host back */
    /* Called between steps with the host held; a nonzero return cancels the
     * generation (MC_ERR_INTERRUPTED): a failed progress callback, Ctrl-C. */
    int (*on_step)(void *ctx, const mc_step_header *header, const void *tail);
} mc_driver_host;

/* One family's generation. `end` runs whenever `begin` was called, to free
 * what begin made (after finish, or after a failure). */
typedef struct mc_generator_ops {
    mc_status (*begin)(void *run, int *num_steps, mc_err *err);
    /* Fills the header's step, flops, full and cache_bytes, and points *tail
     * at the family's telemetry (valid until the next step). */
    mc_status (*step)(void *run, int step, mc_step_header *header, const void **tail, mc_err *err);
    mc_status (*finish)(void *run, mc_err *err);
    void (*end)(void *run);
} mc_generator_ops;

mc_status mc_generate(const mc_generator_ops *gen, void *run, mc_backend *backend, const mc_driver_host *host,
                      mc_err *err);

#endif

#include "driver.h"

static void host_release(const mc_driver_host *host) {
    if (host != NULL && host->release != NULL)
        host->release(host->ctx);
}

static void host_acquire(const mc_driver_host *host) {
    if (host != NULL && host->acquire != NULL)
        host->acquire(host->ctx);
}

mc_status mc_generate(const mc_generator_ops *gen, void *run, mc_backend *backend, const mc_driver_host *host,
                      mc_err *err) {
    int num_steps = 0;
    host_release(host);
    mc_status st = gen->begin(run, &num_steps, err);
    for (int step = 0; st == MC_OK && step < num_steps; step++) {
        const double t0 = mc_seconds_now();
        const int64_t allocations = backend->allocations, waits = backend->syncs;
        mc_step_header header = {.step = step, .num_steps = num_steps};
        const void *tail = NULL;
        st = gen->step(run, step, &header, &tail, err);
        if (st != MC_OK)
            break;
        header.seconds = mc_seconds_now() - t0;
        header.allocations = backend->allocations - allocations;
        header.host_waits = backend->syncs - waits;
        if (host != NULL && host->on_step != NULL) {
            host_acquire(host);
            const int cancel = host->on_step(host->ctx, &header, tail);
            host_release(host);
            if (cancel)
                st = mc_fail(err, MC_ERR_INTERRUPTED, "generation interrupted after step %d", step);
        }
    }
    if (st == MC_OK)
        st = gen->finish(run, err);
    gen->end(run);
    host_acquire(host);
    return st;
}

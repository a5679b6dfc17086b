/* The guard backend: the CPU backend's ops over memory that the host cannot
 * touch between ops (see mc_backend_guard_create in ops.h).
 *
 * All buffers come from one reserved address range, handed out in page
 * multiples from the bottom up and never reused, so a stale pointer never
 * lands in a live buffer. The range is PROT_NONE except while one of this
 * backend's entry points runs: each one opens the used part read-write,
 * calls the CPU op on the inner CPU backend and closes it again. A model
 * that reads or writes a backend buffer from host code therefore faults on
 * the spot (SIGSEGV), where the CUDA backend would have read garbage or
 * crashed later. Freed buffers are given back to the kernel (MADV_DONTNEED)
 * but keep their addresses.
 *
 * Graphs are emulated with CUDA's semantics, so the head sampler's recorded
 * path runs in CI: during a recording the ops run at once (a CUDA graph
 * would run them at launch, right after, on the same memory), allocation,
 * upload and download fail the recording as they do on CUDA, and a failed
 * or discarded recording restores every buffer from a snapshot taken at
 * capture_begin, as if nothing had run (on CUDA nothing has). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "../cpu/cpu_internal.h"

/* Virtual address space reserved per backend; nothing is committed until a
 * page is touched. The tests' models need a few hundred MB in all. */
#define GUARD_RESERVE_BYTES ((size_t)16 << 30)

typedef struct guard_block {
    char *ptr;
    size_t bytes;
} guard_block;

typedef struct guard_state {
    mc_backend *cpu; /* the inner CPU backend the ops run on */
    char *base;      /* the reservation */
    size_t used;     /* bytes handed out from base (page multiple) */
    size_t page;
    int open_depth;  /* nested entry points open the range once */
    guard_block *blocks; /* live and freed buffers in address order */
    size_t block_count, block_capacity;
    /* graph recording emulation */
    int capturing, capture_failed;
    long fail_recording_at; /* test hook: the op of a recording that fails (0: none) */
    int64_t own_allocations; /* be->allocations adds the inner CPU's scratch growth */
    long recorded_ops;
    char *snapshot; /* the used range at capture_begin */
    void *deferred_free[32];
    int deferred_count;
    int64_t flops_at_capture; /* be->dispatched_flops at capture_begin */
    /* Test hook (MARCACHE_GUARD_UNSUPPORTED): this backend's own copy of
     * the table with one op made unsupported; be->ops points here then. */
    mc_ops own_ops;
} guard_state;

static guard_state *guard_st(mc_backend *be) { return (guard_state *)be->impl; }

static mc_status guard_open(mc_backend *be, mc_err *err) {
    guard_state *gs = guard_st(be);
    if (gs->capturing && gs->open_depth == 0 && ++gs->recorded_ops == gs->fail_recording_at) {
        gs->capture_failed = 1;
        return mc_fail(err, MC_ERR_INTERNAL, "guard backend: op %ld of the recording fails (test hook)",
                       gs->recorded_ops);
    }
    /* The op reads and writes in the weight type the guard was given. */
    gs->cpu->linear_wtype = be->linear_wtype;
    if (gs->open_depth++ > 0 || gs->used == 0)
        return MC_OK;
    if (mprotect(gs->base, gs->used, PROT_READ | PROT_WRITE) != 0) {
        gs->open_depth--;
        return mc_fail(err, MC_ERR_INTERNAL, "guard backend: mprotect(read-write) of %zu bytes failed",
                       gs->used);
    }
    return MC_OK;
}

static void guard_close(mc_backend *be) {
    guard_state *gs = guard_st(be);
    be->allocations = gs->own_allocations + gs->cpu->allocations;
    /* PROT_NONE on memory we own cannot fail short of a kernel bug; if it
     * did, the guard would only catch less. */
    if (--gs->open_depth == 0 && gs->used > 0)
        (void)mprotect(gs->base, gs->used, PROT_NONE);
}

/* Allocation, upload and download are not recordable (CUDA refuses them in
 * a graph recording too): they fail the recording. */
static mc_status refuse_while_recording(guard_state *gs, const char *what, mc_err *err) {
    if (!gs->capturing)
        return MC_OK;
    gs->capture_failed = 1;
    return mc_fail(err, MC_ERR_INTERNAL, "guard backend: %s while recording a graph", what);
}

static void *guard_alloc(mc_backend *be, size_t bytes, const char *what, mc_err *err) {
    guard_state *gs = guard_st(be);
    if (refuse_while_recording(gs, "allocation", err) != MC_OK)
        return NULL;
    size_t rounded = (bytes + gs->page - 1) / gs->page * gs->page;
    if (rounded == 0)
        rounded = gs->page;
    if (rounded < bytes || rounded > GUARD_RESERVE_BYTES - gs->used) {
        char held[128];
        snprintf(held, sizeof held, "the guard backend uses %zu of its %zu reserved bytes", gs->used,
                 (size_t)GUARD_RESERVE_BYTES);
        mc_fail_nomem_because(err, bytes, held, "%s", what);
        return NULL;
    }
    if (gs->block_count == gs->block_capacity) {
        size_t fresh = gs->block_capacity ? 2 * gs->block_capacity : 256;
        guard_block *moved = realloc(gs->blocks, fresh * sizeof *moved);
        if (moved == NULL) {
            mc_fail_nomem_n(err, fresh, sizeof *moved, "the guard backend's block list (%zu entries, for %s)", fresh,
                            what);
            return NULL;
        }
        gs->blocks = moved;
        gs->block_capacity = fresh;
    }
    char *p = gs->base + gs->used;
    gs->used += rounded;
    gs->blocks[gs->block_count++] = (guard_block){p, rounded};
    /* A freshly handed-out range must follow the current protection. */
    if (gs->open_depth > 0 && mprotect(p, rounded, PROT_READ | PROT_WRITE) != 0) {
        mc_fail(err, MC_ERR_INTERNAL, "guard backend: mprotect of a new block failed");
        return NULL;
    }
    gs->own_allocations++;
    be->allocations = gs->own_allocations + gs->cpu->allocations;
    return p;
}

static void guard_release(mc_backend *be, void *ptr) {
    guard_state *gs = guard_st(be);
    if (ptr == NULL)
        return;
    if (gs->capturing) { /* deferred, as on CUDA: a recorded free would run at every replay */
        gs->capture_failed = 1;
        if (gs->deferred_count < (int)(sizeof gs->deferred_free / sizeof gs->deferred_free[0])) {
            gs->deferred_free[gs->deferred_count++] = ptr;
            return;
        }
    }
    size_t lo = 0, hi = gs->block_count;
    while (lo < hi) { /* blocks are in address order: binary search */
        size_t mid = lo + (hi - lo) / 2;
        if (gs->blocks[mid].ptr < (char *)ptr)
            lo = mid + 1;
        else
            hi = mid;
    }
    mc_cpu_panel_set_forget(mc_cpu_panel_set_of(gs->cpu), ptr);
    if (lo < gs->block_count && gs->blocks[lo].ptr == (char *)ptr && gs->blocks[lo].bytes > 0) {
        (void)madvise(ptr, gs->blocks[lo].bytes, MADV_DONTNEED);
        gs->blocks[lo].bytes = 0; /* freed: a second release is ignored */
    }
}

static void guard_destroy(mc_backend *be) {
    guard_state *gs = guard_st(be);
    free(gs->snapshot);
    munmap(gs->base, GUARD_RESERVE_BYTES);
    mc_backend_destroy(gs->cpu);
    free(gs->blocks);
    free(gs);
    free(be);
}

static mc_status guard_copy(mc_backend *be, void *dst, const void *src, size_t bytes, mc_err *err) {
    MC_TRY(guard_open(be, err));
    if (bytes) {
        memmove(dst, src, bytes);
        mc_cpu_panel_set_stale(mc_cpu_panel_set_of(guard_st(be)->cpu), dst, bytes);
    }
    guard_close(be);
    return MC_OK;
}

/* The inner CPU backend keeps the panels; it reads the weight to make
 * them, inside the open range. */
static mc_status guard_bind_linear(mc_backend *be, const void *w, int64_t out, int64_t in, mc_err *err) {
    MC_TRY(guard_open(be, err));
    const mc_status st = mc_cpu_bind_linear(guard_st(be)->cpu, w, out, in, err);
    guard_close(be);
    return st;
}

static mc_status guard_upload(mc_backend *be, void *dst, const void *src, size_t bytes, mc_err *err) {
    MC_TRY(refuse_while_recording(guard_st(be), "upload", err));
    if (bytes > MC_UPLOAD_STAGED_MAX)
        be->syncs++;
    return guard_copy(be, dst, src, bytes, err);
}

static mc_status guard_download(mc_backend *be, void *dst, const void *src, size_t bytes, mc_err *err) {
    MC_TRY(refuse_while_recording(guard_st(be), "download", err));
    if (bytes)
        be->syncs++;
    return guard_copy(be, dst, src, bytes, err);
}

/* Copies the used range to or from the snapshot (to_snapshot != 0: save). */
static mc_status snapshot_copy(mc_backend *be, int to_snapshot, mc_err *err) {
    guard_state *gs = guard_st(be);
    MC_TRY(guard_open(be, err));
    if (to_snapshot)
        memcpy(gs->snapshot, gs->base, gs->used);
    else
        memcpy(gs->base, gs->snapshot, gs->used);
    guard_close(be);
    return MC_OK;
}

static mc_status guard_capture_begin(mc_backend *be, mc_err *err) {
    guard_state *gs = guard_st(be);
    if (gs->capturing)
        return mc_fail(err, MC_ERR_INTERNAL, "guard backend: a graph is already being recorded");
    free(gs->snapshot);
    gs->snapshot = malloc(gs->used ? gs->used : 1);
    if (gs->snapshot == NULL)
        return mc_fail_nomem(err, gs->used ? gs->used : 1, "the guard backend's snapshot for a recording");
    MC_TRY(snapshot_copy(be, 1, err));
    gs->capturing = 1;
    gs->capture_failed = 0;
    gs->deferred_count = 0;
    gs->recorded_ops = 0;
    gs->flops_at_capture = be->dispatched_flops;
    return MC_OK;
}

static mc_status guard_capture_end(mc_backend *be, void **graph, int keep, mc_err *err) {
    guard_state *gs = guard_st(be);
    gs->capturing = 0;
    mc_status st = MC_OK;
    if (!keep || gs->capture_failed) {
        /* Nothing may have run: put every buffer back as it was, and take
         * back the FLOPs of the ops that were recorded. */
        be->dispatched_flops = gs->flops_at_capture;
        st = snapshot_copy(be, 0, err);
        if (st == MC_OK)
            st = mc_fail(err, MC_ERR_INTERNAL, "guard backend: graph recording discarded");
    } else {
        *graph = gs; /* any non-NULL handle: the ops have run already */
    }
    free(gs->snapshot);
    gs->snapshot = NULL;
    for (int i = 0; i < gs->deferred_count; i++)
        guard_release(be, gs->deferred_free[i]);
    gs->deferred_count = 0;
    return st;
}

static mc_status guard_graph_launch(mc_backend *be, void *graph, mc_err *err) {
    (void)be;
    (void)graph;
    (void)err;
    return MC_OK;
}

static void guard_graph_free(mc_backend *be, void *graph) {
    (void)be;
    (void)graph;
}

/* One wrapper per op of the list: open the range, count the op's FLOPs
 * (the list's `flops` column), run the CPU op on the inner backend with the
 * same arguments, close the range. `be` is rebound to the inner backend so
 * the list's argument names pass the call on unchanged. */
#define MC_OP(name, where, params, args, flops)          \
    static mc_status guard_##name params {                \
        MC_TRY(guard_open(be, err));                      \
        mc_backend *outer = be;                           \
        outer->dispatched_flops += (int64_t)(flops);      \
        be = guard_st(outer)->cpu;                        \
        mc_status st = mc_cpu_##name args;                \
        guard_close(outer);                               \
        return st;                                        \
    }
#include "../ops_list.h"

static const mc_ops guard_ops = {
    .name = "guard",
    .synchronous = 1,
    .destroy = guard_destroy,
    .alloc = guard_alloc,
    .release = guard_release,
    .upload = guard_upload,
    .download = guard_download,
    .copy = guard_copy,
    .bind_linear = guard_bind_linear,
#define MC_OP(name, where, params, args, flops) .name = guard_##name,
#include "../ops_list.h"
    .capture_begin = guard_capture_begin,
    .capture_end = guard_capture_end,
    .graph_launch = guard_graph_launch,
    .graph_free = guard_graph_free,
};

/* MARCACHE_GUARD_UNSUPPORTED=<op> makes that op unsupported on every guard
 * backend made afterwards, as on a backend the op has not reached yet, so
 * the tests can drive that path (the error from a model, NotImplementedError
 * from run_op). An unknown op name is refused. */
static mc_status without_op_hook(guard_state *gs, const char *op, mc_err *err) {
    if (op == NULL || op[0] == '\0')
        return MC_OK;
    int id = 0;
    while (id < MC_OP_COUNT && strcmp(mc_op_names[id], op) != 0)
        id++;
    if (id == MC_OP_COUNT)
        return mc_fail(err, MC_ERR_VALUE, "MARCACHE_GUARD_UNSUPPORTED: unknown op '%s'", op);
    gs->own_ops = guard_ops;
#define MC_OP(name, where, params, args, flops) \
    if (id == MC_OP_ID_##name)                   \
        gs->own_ops.name = NULL;
#include "../ops_list.h"
    mc_ops_fill_unsupported(&gs->own_ops);
    return MC_OK;
}

mc_status mc_backend_guard_create(mc_backend **out, int num_threads, mc_err *err) {
    *out = NULL;
    mc_backend *be = calloc(1, sizeof *be);
    guard_state *gs = calloc(1, sizeof *gs);
    if (be == NULL || gs == NULL) {
        free(be);
        free(gs);
        return mc_fail_nomem(err, sizeof *be + sizeof *gs, "the guard backend");
    }
    long page = sysconf(_SC_PAGESIZE);
    gs->page = page > 0 ? (size_t)page : 4096;
    void *base = mmap(NULL, GUARD_RESERVE_BYTES, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                      -1, 0);
    if (base == MAP_FAILED) {
        const int why = errno;
        free(be);
        free(gs);
        return mc_fail_nomem_because(err, GUARD_RESERVE_BYTES, strerror(why),
                                     "the guard backend's address space (reserved, not committed)");
    }
    gs->base = base;
    /* MARCACHE_GUARD_FAIL_RECORDING=N makes the N-th op of every recording
     * fail, so the tests can drive the path where a recording is discarded
     * and the caller runs the steps directly. */
    const char *fail_at = getenv("MARCACHE_GUARD_FAIL_RECORDING");
    gs->fail_recording_at = fail_at != NULL ? strtol(fail_at, NULL, 10) : 0;
    mc_status st = mc_backend_cpu_create(&gs->cpu, num_threads, err);
    if (st == MC_OK)
        st = without_op_hook(gs, getenv("MARCACHE_GUARD_UNSUPPORTED"), err);
    if (st != MC_OK) {
        mc_backend_destroy(gs->cpu);
        munmap(base, GUARD_RESERVE_BYTES);
        free(be);
        free(gs);
        return st;
    }
    be->ops = gs->own_ops.name != NULL ? &gs->own_ops : &guard_ops;
    be->device_index = -1;
    be->impl = gs;
    *out = be;
    return MC_OK;
}

/* The CUDA backend: creation and teardown, device memory (its membership of
 * the device's shared caching allocator, backend/devpool.h, over cudaMalloc /
 * cudaFree), host <-> device copies, grow-only scratch, error helpers, the
 * run-time facts build_info() reports, and the op table. cuBLAS is loaded
 * by cuda_cublas.cu when the first backend is made.
 *
 * One backend = one device, one non-blocking stream, one cuBLAS handle bound
 * to that stream. Every op is enqueued on the stream; only download and
 * large uploads wait for it (they hand host memory back to the caller).
 * Small uploads (the AR loop's index lists) are copied into a pinned ring
 * and enqueued, so the loop does not stall the stream for them. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

/* ---- errors ------------------------------------------------------------- */

mc_status mc_cuda_fail(cudaError_t code, const char *call, mc_err *err) {
    (void)cudaGetLastError(); /* clear it: the next launch check must not see it again */
    char why[256];
    snprintf(why, sizeof why, "%s (%s)", cudaGetErrorString(code), cudaGetErrorName(code));
    /* Our own allocations report their size (mc_cuda_fail_alloc); this is a
     * call that allocates inside the runtime (a stream, a graph, a launch's
     * resources) and tells us only that it failed. */
    if (code == cudaErrorMemoryAllocation)
        return mc_fail_nomem_unsized(err, why, "what the CUDA runtime's %s needed", call);
    return mc_fail(err, MC_ERR_INTERNAL, "cuda: %s failed: %s", call, why);
}

mc_status mc_cuda_fail_alloc(cudaError_t code, const char *call, size_t bytes, const char *what,
                             mc_err *err) {
    if (code != cudaErrorMemoryAllocation)
        return mc_cuda_fail(code, call, err);
    (void)cudaGetLastError();
    char why[256];
    snprintf(why, sizeof why, "%s: %s (%s)", call, cudaGetErrorString(code), cudaGetErrorName(code));
    return mc_fail_nomem_because(err, bytes, why, "%s", what);
}

int mc_cuda_sync_launches(void) {
    static const int on = [] {
        const char *value = getenv("MARCACHE_CUDA_SYNC");
        return value != NULL && strcmp(value, "1") == 0 ? 1 : 0;
    }(); /* a function-local static: initialised once, thread-safe (C++11) */
    return on;
}

mc_status mc_cublas_fail(cublasStatus_t code, const char *call, mc_err *err) {
    /* Every cuBLAS call goes through the table, so it is loaded here. */
    char why[256];
    snprintf(why, sizeof why, "%s (%s)", mc_cublas.get_status_string(code),
             mc_cublas.get_status_name(code));
    /* cuBLAS allocates inside the call (a handle, its own buffers) and does
     * not say how much; the GEMMs' workspace is ours and sized. */
    if (code == CUBLAS_STATUS_ALLOC_FAILED)
        return mc_fail_nomem_unsized(err, why, "what cuBLAS's %s needed", call);
    return mc_fail(err, MC_ERR_INTERNAL, "cublas: %s failed: %s", call, why);
}

mc_status mc_cuda_enter(mc_backend *be, mc_err *err) {
    /* Only switch when needed: the common case costs one cheap query, and a
     * graph recording never sees a context switch. */
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess && current == cuda_st(be)->device)
        return MC_OK;
    MC_CUDA_TRY(cudaSetDevice(cuda_st(be)->device), err);
    return MC_OK;
}

/* ---- run-time facts ----------------------------------------------------- */

extern "C" int mc_cuda_device_count(void) {
    /* -1: not asked yet. The binding holds the GIL when it asks, so the
     * cache needs no lock. */
    static int cached = -1;
    if (cached < 0) {
        int count = 0;
        /* Without a driver (libcuda.so.1 missing) or a device this returns
         * cudaErrorInsufficientDriver / cudaErrorNoDevice: that is 0 devices. */
        if (cudaGetDeviceCount(&count) != cudaSuccess)
            count = 0;
        (void)cudaGetLastError();
        cached = count;
    }
    return cached;
}

extern "C" void mc_cuda_device_name(int index, char *buf, size_t size) {
    if (size == 0)
        return;
    buf[0] = '\0';
    if (index < 0 || index >= mc_cuda_device_count())
        return;
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, index) == cudaSuccess)
        snprintf(buf, size, "%s", prop.name);
    (void)cudaGetLastError();
}

extern "C" int mc_cuda_runtime_version(void) {
    int v = 0;
    if (cudaRuntimeGetVersion(&v) != cudaSuccess)
        v = 0;
    (void)cudaGetLastError();
    return v;
}

extern "C" int mc_cuda_driver_version(void) {
    int v = 0;
    if (cudaDriverGetVersion(&v) != cudaSuccess) /* 0 when no driver is installed */
        v = 0;
    (void)cudaGetLastError();
    return v;
}

extern "C" void mc_cuda_set_naive(mc_backend *be, int naive) { cuda_st(be)->naive = naive != 0; }

/* ---- memory ------------------------------------------------------------- */

/* The device side of the shared pool (backend/devpool.h): plain cudaMalloc /
 * cudaFree on the pool's device (ctx is the device index). cudaMalloc runs
 * only while the pool grows; cudaFree only on an out-of-memory trim and when
 * the last backend on the device is destroyed. */
static mc_status device_alloc(void *ctx, size_t bytes, void **out, mc_err *err) {
    const int device = (int)(intptr_t)ctx;
    int previous = -1;
    if (cudaGetDevice(&previous) != cudaSuccess || previous != device)
        MC_CUDA_TRY(cudaSetDevice(device), err);
    const cudaError_t code = cudaMalloc(out, bytes);
    if (previous >= 0 && previous != device)
        (void)cudaSetDevice(previous);
    if (code != cudaSuccess)
        return mc_cuda_fail_alloc(code, "cudaMalloc", bytes, "a block of device memory", err);
    return MC_OK;
}

static void device_free(void *ctx, void *ptr) {
    const int device = (int)(intptr_t)ctx;
    int previous = -1;
    if (cudaGetDevice(&previous) != cudaSuccess || previous != device)
        (void)cudaSetDevice(device);
    (void)cudaFree(ptr); /* a failure here is a sticky error the next op reports */
    if (previous >= 0 && previous != device)
        (void)cudaSetDevice(previous);
    (void)cudaGetLastError();
}

static const mc_devpool_raw DEVICE_RAW = {device_alloc, device_free};

/* The pool asks about this backend's stream (never while it records a
 * graph: the pool is told, see capture_begin / capture_end). */
static int stream_idle(void *ctx) {
    const cudaError_t code = cudaStreamQuery(((cuda_state *)ctx)->stream);
    if (code != cudaSuccess)
        (void)cudaGetLastError(); /* cudaErrorNotReady, or a fault the next op reports */
    return code == cudaSuccess;
}

static int stream_wait(void *ctx) {
    if (cudaStreamSynchronize(((cuda_state *)ctx)->stream) == cudaSuccess)
        return 0;
    (void)cudaGetLastError();
    return -1;
}

static const mc_devpool_owner_ops STREAM_OPS = {stream_idle, stream_wait};

/* Waits for the backend's stream, and tells the pool: the blocks this
 * backend freed before the wait are then free for every backend. */
static mc_status wait_stream(cuda_state *st, mc_err *err) {
    const uint64_t point = mc_devpool_sync_point(st->pool_owner);
    MC_CUDA_TRY(cudaStreamSynchronize(st->stream), err);
    mc_devpool_synced(st->pool_owner, point);
    return MC_OK;
}

/* Allocation, upload and download cannot be part of a graph recording
 * (ops.h): while one runs they fail, and so does the recording. */
static mc_status refuse_while_recording(cuda_state *st, const char *what, mc_err *err) {
    if (!st->capturing)
        return MC_OK;
    st->capture_failed = 1;
    return mc_fail(err, MC_ERR_INTERNAL, "cuda: %s while recording a graph", what);
}

static void *cuda_alloc(mc_backend *be, size_t bytes, const char *what, mc_err *err) {
    cuda_state *st = cuda_st(be);
    if (refuse_while_recording(st, "allocation", err) != MC_OK || mc_cuda_enter(be, err) != MC_OK)
        return NULL;
    /* A request larger than the whole device is refused here: the driver's
     * answer to absurd sizes is not documented (an allocator may assert on
     * them); the message is the same out-of-memory one. */
    if (bytes > st->total_mem) {
        char total[96];
        snprintf(total, sizeof total, "the device has %zu bytes", st->total_mem);
        mc_fail_nomem_because(err, bytes, total, "%s on device %d", what, st->device);
        return NULL;
    }
    /* A 0-byte request gets a valid, distinct pointer too (a class of 512
     * bytes); out of memory after the pool's trim and retry is
     * MC_ERR_NOMEM naming the request and what the device's pool holds. */
    void *p = mc_devpool_alloc(st->pool_owner, bytes, what, err);
    if (p == NULL)
        return NULL;
    be->allocations++;
    return p;
}

/* Keeps ptr for release after the recording; 0 when the host has no
 * memory to grow the list. */
static int defer_release(cuda_state *st, void *ptr) {
    if (st->deferred_count == st->deferred_capacity) {
        const int capacity = st->deferred_capacity > 0 ? 2 * st->deferred_capacity : 64;
        void **grown =
            (void **)realloc(st->deferred_free, (size_t)capacity * sizeof *st->deferred_free);
        if (grown == NULL)
            return 0;
        st->deferred_free = grown;
        st->deferred_capacity = capacity;
    }
    st->deferred_free[st->deferred_count++] = ptr;
    return 1;
}

static void cuda_release(mc_backend *be, void *ptr) {
    cuda_state *st = cuda_st(be);
    if (ptr != NULL && st->capturing) {
        st->capture_failed = 1; /* nothing in a recorded step should free memory */
        /* Out of host memory for the list (defer_release returns 0), the
         * block stays allocated in the pool until the process ends: a free
         * on the capturing stream would be lost with the discarded graph
         * just the same, and no other free is legal during a recording. */
        (void)defer_release(st, ptr);
        return;
    }
    /* Into the pool as this backend's: kernels already enqueued that read
     * ptr may still run, so only this stream may take it again at once
     * (devpool.h, stream order). */
    mc_devpool_free(st->pool_owner, ptr);
}

void *mc_cuda_scratch(mc_backend *be, int slot, size_t bytes, const char *what, mc_err *err) {
    cuda_state *st = cuda_st(be);
    if (slot < 0 || slot >= MC_CUDA_SCRATCH_SLOTS) {
        mc_fail(err, MC_ERR_INTERNAL, "cuda: scratch slot %d out of range", slot);
        return NULL;
    }
    if (st->scratch_bytes[slot] < bytes || st->scratch[slot] == NULL) {
        void *fresh = cuda_alloc(be, bytes, what, err);
        if (fresh == NULL)
            return NULL;
        cuda_release(be, st->scratch[slot]);
        st->scratch[slot] = fresh;
        st->scratch_bytes[slot] = bytes;
    }
    return st->scratch[slot];
}

/* Host memory is returned to the caller when upload returns. An upload of
 * up to MC_UPLOAD_STAGED_MAX bytes (index lists, per-step vectors) is
 * copied into the pinned ring, whose slot stays untouched until the stream
 * has passed its copy; a larger one (weights at load) waits for its copy,
 * since cudaMemcpyAsync from pageable memory may return before the bytes
 * are read. */
#define MC_CUDA_STAGING_BYTES ((size_t)8 << 20)

static mc_status cuda_upload(mc_backend *be, void *dst, const void *host_src, size_t bytes,
                             mc_err *err) {
    cuda_state *st = cuda_st(be);
    if (bytes == 0)
        return MC_OK;
    MC_TRY(refuse_while_recording(st, "upload", err));
    MC_TRY(mc_cuda_enter(be, err));
    if (bytes <= MC_UPLOAD_STAGED_MAX) {
        if (st->staging == NULL)
            MC_CUDA_ALLOC_TRY(cudaMallocHost((void **)&st->staging, MC_CUDA_STAGING_BYTES),
                              MC_CUDA_STAGING_BYTES, "the pinned upload ring", err);
        const size_t aligned = (bytes + 255) & ~(size_t)255;
        if (st->staging_used + aligned > MC_CUDA_STAGING_BYTES) {
            /* Every copy out of the ring so far must have left it before
             * its bytes are overwritten: one wait per 8 MB staged. */
            be->syncs++;
            MC_TRY(wait_stream(st, err));
            st->staging_used = 0;
        }
        char *slot = st->staging + st->staging_used;
        memcpy(slot, host_src, bytes);
        st->staging_used += aligned;
        MC_CUDA_TRY(cudaMemcpyAsync(dst, slot, bytes, cudaMemcpyHostToDevice, st->stream), err);
        return MC_OK;
    }
    be->syncs++;
    MC_CUDA_TRY(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, st->stream), err);
    MC_TRY(wait_stream(st, err));
    st->staging_used = 0; /* the stream is idle: the whole ring is free */
    return MC_OK;
}

/* A row fault a sampling op recorded since the last download (read back
 * into row_fault_host by the wait that just ended), as the CPU's
 * MC_ERR_NUMERIC failure; the device word is cleared for later ops. */
static mc_status report_row_fault(cuda_state *st, mc_err *err) {
    const unsigned long long key = *st->row_fault_host;
    if (key == MC_ROW_FAULT_NONE)
        return MC_OK;
    *st->row_fault_host = MC_ROW_FAULT_NONE;
    MC_CUDA_TRY(cudaMemsetAsync(st->row_fault, 0xff, sizeof *st->row_fault, st->stream), err);
    const unsigned op = (unsigned)(key >> (MC_ROW_FAULT_ROW_BITS + 2));
    const int64_t row = (int64_t)((key >> 2) & ((1ull << MC_ROW_FAULT_ROW_BITS) - 1));
    return mc_fail_row_fault(op < (unsigned)MC_OP_COUNT ? mc_op_names[op] : "a sampling op", row,
                             (int)(key & 3u), err);
}

static mc_status cuda_download(mc_backend *be, void *host_dst, const void *src, size_t bytes,
                               mc_err *err) {
    cuda_state *st = cuda_st(be);
    if (bytes == 0)
        return MC_OK;
    MC_TRY(refuse_while_recording(st, "download", err));
    MC_TRY(mc_cuda_enter(be, err));
    be->syncs++;
    MC_CUDA_TRY(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, st->stream), err);
    /* The row-fault word rides along: 8 bytes more in the same wait. */
    MC_CUDA_TRY(cudaMemcpyAsync(st->row_fault_host, st->row_fault, sizeof *st->row_fault,
                                cudaMemcpyDeviceToHost, st->stream),
                err);
    /* Also where a fault of an earlier kernel on the stream is reported. */
    MC_TRY(wait_stream(st, err));
    st->staging_used = 0;
    return report_row_fault(st, err);
}

static mc_status cuda_copy(mc_backend *be, void *dst, const void *src, size_t bytes, mc_err *err) {
    cuda_state *st = cuda_st(be);
    if (bytes == 0)
        return MC_OK;
    MC_TRY(mc_cuda_enter(be, err));
    MC_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, st->stream), err);
    return MC_OK;
}

/* ---- graphs ------------------------------------------------------------- */

/* Thread-local capture mode: a call on this thread that would synchronise
 * (cudaMalloc, a blocking copy) invalidates the recording instead of
 * running outside it, and other threads' CUDA work is unaffected. */
static mc_status cuda_capture_begin(mc_backend *be, mc_err *err) {
    cuda_state *st = cuda_st(be);
    if (!st->graphs_enabled)
        return mc_fail(err, MC_ERR_INTERNAL, "cuda: graphs are off (MARCACHE_CUDA_GRAPHS=0)");
    if (st->capturing)
        return mc_fail(err, MC_ERR_INTERNAL, "cuda: a graph is already being recorded");
    MC_TRY(mc_cuda_enter(be, err));
    /* Before the recording starts: the pool must not query or wait for a
     * capturing stream (other backends' allocations and trims). */
    mc_devpool_set_capturing(st->pool_owner, 1);
    const cudaError_t began = cudaStreamBeginCapture(st->stream, cudaStreamCaptureModeThreadLocal);
    if (began != cudaSuccess) {
        mc_devpool_set_capturing(st->pool_owner, 0);
        return mc_cuda_fail(began, "cudaStreamBeginCapture", err);
    }
    st->capturing = 1;
    st->capture_failed = 0;
    st->deferred_count = 0;
    return MC_OK;
}

static mc_status cuda_capture_end(mc_backend *be, void **graph, int keep, mc_err *err) {
    cuda_state *st = cuda_st(be);
    cudaGraph_t recorded = NULL;
    cudaError_t code = cudaStreamEndCapture(st->stream, &recorded);
    st->capturing = 0;
    mc_devpool_set_capturing(st->pool_owner, 0);
    for (int i = 0; i < st->deferred_count; i++)
        cuda_release(be, st->deferred_free[i]);
    st->deferred_count = 0;
    if (code != cudaSuccess || recorded == NULL || !keep || st->capture_failed) {
        if (recorded != NULL)
            (void)cudaGraphDestroy(recorded);
        (void)cudaGetLastError();
        if (code != cudaSuccess)
            return mc_cuda_fail(code, "cudaStreamEndCapture", err);
        return mc_fail(err, MC_ERR_INTERNAL, "cuda: graph recording discarded");
    }
    cudaGraphExec_t exec = (cudaGraphExec_t)*graph;
    if (exec != NULL) {
        /* Same op sequence as last time with other sizes or pointers: the
         * parameters are patched in place. Another topology (cuBLAS chose
         * other kernels, say) is rejected and the graph is built anew. */
        cudaGraphExecUpdateResultInfo info;
        if (cudaGraphExecUpdate(exec, recorded, &info) != cudaSuccess) {
            (void)cudaGetLastError();
            (void)cudaGraphExecDestroy(exec);
            exec = NULL;
            *graph = NULL;
        }
    }
    if (exec == NULL) {
        code = cudaGraphInstantiate(&exec, recorded, 0);
        if (code != cudaSuccess) {
            (void)cudaGraphDestroy(recorded);
            return mc_cuda_fail(code, "cudaGraphInstantiate", err);
        }
        *graph = exec;
    }
    (void)cudaGraphDestroy(recorded);
    return MC_OK;
}

static mc_status cuda_graph_launch(mc_backend *be, void *graph, mc_err *err) {
    MC_TRY(mc_cuda_enter(be, err));
    MC_CUDA_TRY(cudaGraphLaunch((cudaGraphExec_t)graph, cuda_st(be)->stream), err);
    return MC_OK;
}

static void cuda_graph_free(mc_backend *be, void *graph) {
    cuda_state *st = cuda_st(be);
    if (graph == NULL || cudaSetDevice(st->device) != cudaSuccess) {
        (void)cudaGetLastError();
        return;
    }
    /* A launched graph may still be running: destroy after it. */
    (void)cudaStreamSynchronize(st->stream);
    (void)cudaGraphExecDestroy((cudaGraphExec_t)graph);
    (void)cudaGetLastError();
}

/* ---- lifetime ----------------------------------------------------------- */

static void cuda_free_state(cuda_state *st) {
    if (st == NULL)
        return;
    if (cudaSetDevice(st->device) == cudaSuccess) {
        if (st->stream != NULL)
            (void)cudaStreamSynchronize(st->stream);
        if (st->pool_owner != NULL)
            for (int i = 0; i < MC_CUDA_SCRATCH_SLOTS; i++)
                mc_devpool_free(st->pool_owner, st->scratch[i]);
        if (st->staging != NULL)
            (void)cudaFreeHost(st->staging);
        if (st->row_fault_host != NULL)
            (void)cudaFreeHost(st->row_fault_host);
        if (st->row_fault != NULL)
            (void)cudaFree(st->row_fault);
        if (st->blas != NULL)
            (void)mc_cublas.destroy(st->blas);
        if (st->blas_workspace != NULL)
            (void)cudaFree(st->blas_workspace);
        if (st->stream != NULL)
            (void)cudaStreamDestroy(st->stream);
    }
    /* The stream was waited for above (or the device is unusable): this
     * backend's cached blocks are anyone's now; the last backend on the
     * device gives the pool's memory back to the device. */
    mc_devpool_leave(st->pool_owner);
    (void)cudaGetLastError();
    free(st->deferred_free);
    free(st);
}

static void cuda_destroy(mc_backend *be) {
    cuda_free_state(cuda_st(be));
    free(be);
}

static mc_ops make_cuda_ops(void) {
    mc_ops ops;
    memset(&ops, 0, sizeof ops);
    ops.name = "cuda";
    ops.destroy = cuda_destroy;
    ops.alloc = cuda_alloc;
    ops.release = cuda_release;
    ops.upload = cuda_upload;
    ops.download = cuda_download;
    ops.copy = cuda_copy;
    /* The list's ops that run everywhere: mc_cuda_<op>. A CPU_ONLY op stays
     * empty here and gets the unsupported stand-in below. */
#define MC_CUDA_ENTRY_ALL(name) ops.name = mc_cuda_##name;
#define MC_CUDA_ENTRY_CPU_ONLY(name)
#define MC_OP(name, where, params, args, flops) MC_CUDA_ENTRY_##where(name)
#include "../ops_list.h"
#undef MC_CUDA_ENTRY_ALL
#undef MC_CUDA_ENTRY_CPU_ONLY
    mc_ops_fill_unsupported(&ops);
    ops.capture_begin = cuda_capture_begin;
    ops.capture_end = cuda_capture_end;
    ops.graph_launch = cuda_graph_launch;
    ops.graph_free = cuda_graph_free;
    return ops;
}

/* C++ has no designated initialisers before C++20: the table is filled
 * field by field once (a function-local static is initialised thread-safely). */
static const mc_ops *cuda_ops(void) {
    static const mc_ops ops = make_cuda_ops();
    return &ops;
}

static mc_status create_state(cuda_state *st, int device_index, mc_err *err) {
    st->device = device_index;
    MC_CUDA_TRY(cudaSetDevice(device_index), err);
    MC_CUDA_TRY(cudaStreamCreateWithFlags(&st->stream, cudaStreamNonBlocking), err);
    cudaDeviceProp prop;
    MC_CUDA_TRY(cudaGetDeviceProperties(&prop, device_index), err);
    st->total_mem = prop.totalGlobalMem;
    st->smem_per_block_optin = prop.sharedMemPerBlockOptin;

    MC_TRY(mc_devpool_join(&DEVICE_RAW, (void *)(intptr_t)device_index, device_index, &STREAM_OPS,
                           st, &st->pool_owner, err));

    MC_CUBLAS_TRY(mc_cublas.create(&st->blas), err);
    MC_CUBLAS_TRY(mc_cublas.set_stream(st->blas, st->stream), err);
    /* Plain fp32: no TF32 tensor-core rounding of the inputs (GEMMs take
     * CUBLAS_COMPUTE_32F as well, see cuda_blas.cu). */
    MC_CUBLAS_TRY(mc_cublas.set_math_mode(st->blas, CUBLAS_DEFAULT_MATH), err);
    /* No atomics: the same inputs give the same bits on the same device. */
    MC_CUBLAS_TRY(mc_cublas.set_atomics_mode(st->blas, CUBLAS_ATOMICS_NOT_ALLOWED), err);
    /* A workspace of our own (32 MiB, what cuBLAS asks for on Hopper), so
     * GEMMs recorded into a graph never allocate. */
    const size_t workspace_bytes = (size_t)32 << 20;
    MC_CUDA_ALLOC_TRY(cudaMalloc(&st->blas_workspace, workspace_bytes), workspace_bytes,
                      "cuBLAS's workspace", err);
    MC_CUBLAS_TRY(mc_cublas.set_workspace(st->blas, st->blas_workspace, workspace_bytes), err);
    /* The sampling ops' row-fault word, cleared in stream order before any
     * op can run (ops go to the same stream). */
    MC_CUDA_ALLOC_TRY(cudaMalloc((void **)&st->row_fault, sizeof *st->row_fault),
                      sizeof *st->row_fault, "the sampling ops' row-fault word", err);
    MC_CUDA_ALLOC_TRY(cudaMallocHost((void **)&st->row_fault_host, sizeof *st->row_fault_host),
                      sizeof *st->row_fault_host, "the row-fault word's pinned host copy", err);
    *st->row_fault_host = MC_ROW_FAULT_NONE;
    MC_CUDA_TRY(cudaMemsetAsync(st->row_fault, 0xff, sizeof *st->row_fault, st->stream), err);
    const char *graphs = getenv("MARCACHE_CUDA_GRAPHS");
    st->graphs_enabled =
        !(graphs != NULL && strcmp(graphs, "0") == 0) && !mc_cuda_sync_launches();
    return MC_OK;
}

extern "C" mc_status mc_backend_cuda_create(mc_backend **out, int device_index, mc_err *err) {
    *out = NULL;
    int count = 0;
    cudaError_t code = cudaGetDeviceCount(&count);
    if (code != cudaSuccess) {
        (void)cudaGetLastError();
        return mc_fail(err, MC_ERR_INTERNAL,
                       "cuda backend: no usable CUDA device (cudaGetDeviceCount: %s)",
                       cudaGetErrorString(code));
    }
    if (device_index < 0 || device_index >= count)
        return mc_fail(err, MC_ERR_VALUE, "cuda backend: device %d does not exist (%d device%s)",
                       device_index, count, count == 1 ? "" : "s");
    /* cuBLAS is loaded with the first backend, not at import: a CUDA build
     * without the nvidia-cublas wheel still runs on the CPU. */
    MC_TRY(mc_cuda_cublas_load(err));
    mc_backend *be = (mc_backend *)calloc(1, sizeof *be);
    cuda_state *st = (cuda_state *)calloc(1, sizeof *st);
    if (be == NULL || st == NULL) {
        free(be);
        free(st);
        return mc_fail_nomem(err, sizeof *be + sizeof *st, "the CUDA backend");
    }
    if (create_state(st, device_index, err) != MC_OK) {
        cuda_free_state(st);
        free(be);
        return err->status;
    }
    be->ops = cuda_ops();
    be->device_index = device_index;
    be->impl = st;
    *out = be;
    return MC_OK;
}

extern "C" mc_status mc_cuda_pool_probe(int device, const size_t *sizes, int count, int rounds,
                                        int release_while_recording, uint64_t *reserved,
                                        mc_err *err) {
    mc_backend *be = NULL;
    MC_TRY(mc_backend_cuda_create(&be, device, err));
    cuda_state *st = cuda_st(be);
    void **blocks = (void **)calloc(count > 0 ? (size_t)count : 1, sizeof *blocks);
    mc_status status =
        blocks == NULL ? mc_fail_nomem_n(err, count > 0 ? (size_t)count : 1, sizeof *blocks,
                                         "the pool probe's block list")
                       : MC_OK;
    for (int r = 0; r < rounds && status == MC_OK; r++) {
        int made = 0;
        for (; made < count; made++)
            if ((blocks[made] = be->ops->alloc(be, sizes[made], "a pool probe block", err)) == NULL)
                break;
        const int record = release_while_recording && made == count;
        if (record && (status = be->ops->capture_begin(be, err)) != MC_OK)
            break;
        for (int i = 0; i < made; i++)
            be->ops->release(be, blocks[i]);
        if (record) {
            /* Releases fail a recording (ops.h): it is discarded, and the
             * deferred frees run now. */
            void *graph = NULL;
            mc_err discarded;
            memset(&discarded, 0, sizeof discarded);
            if (be->ops->capture_end(be, &graph, 0, &discarded) == MC_OK || graph != NULL) {
                status = mc_fail(err, MC_ERR_INTERNAL,
                                 "pool probe: a recording with releases was kept");
                break;
            }
        }
        if (made < count) {
            status = err->status;
            break;
        }
        cudaError_t code = cudaStreamSynchronize(st->stream);
        if (code != cudaSuccess) {
            status = mc_cuda_fail(code, "cudaStreamSynchronize", err);
            break;
        }
        mc_devpool_stats stats;
        mc_devpool_get_stats(st->pool_owner, &stats);
        reserved[r] = stats.reserved_bytes;
    }
    free(blocks);
    mc_backend_destroy(be);
    return status;
}

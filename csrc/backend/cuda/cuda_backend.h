/* What the C side (the Python binding) may ask of a CUDA build besides the
 * op table: run-time facts for build_info() and backends(), and the switch
 * to the plain reference kernels for tests. Plain C declarations with no
 * CUDA types, so C11 sources include this without the toolkit's headers. */
#ifndef MC_CUDA_BACKEND_H
#define MC_CUDA_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "../ops.h"

/* Devices the runtime sees, 0 when there is no driver or no device (the
 * failure of cudaGetDeviceCount is swallowed here, never raised). Asked once
 * per process and cached: cudaGetDeviceCount initialises the driver. */
int mc_cuda_device_count(void);

/* Name of device `index` into buf (empty string on failure). */
void mc_cuda_device_name(int index, char *buf, size_t size);

/* cudaRuntimeGetVersion (e.g. 13000), cudaDriverGetVersion (0 without a
 * driver). */
int mc_cuda_runtime_version(void);
int mc_cuda_driver_version(void);

/* Loads cuBLAS (dlopen) if no earlier call did; the CUDA backend calls it
 * when it is made. Thread-safe. The search order is at the top of
 * cuda_cublas.cu. On failure the message names the pip requirement to
 * install and every library tried, with the reason. */
mc_status mc_cuda_cublas_load(mc_err *err);

/* Folders to search before the toolkit (the nvidia-cublas wheel's library
 * folders on sys.path, registered by marcache/_cuda_libs.py at import);
 * replaces an earlier list. Has no effect after cuBLAS is loaded. */
mc_status mc_cuda_cublas_register_dirs(const char *const *dirs, int count, mc_err *err);

/* The loaded cuBLAS: its version (major * 10000 + minor * 100 + patch) and
 * its file into path; 0 and "" when none is loaded yet. */
int mc_cuda_cublas_loaded(char *path, size_t size);

/* The cuBLAS major version of the headers this build was compiled with. */
int mc_cuda_cublas_major(void);

/* naive != 0 makes the ops that have a fast and a reference kernel
 * (attention, conv2d, conv2d_ex) run the reference one on this backend. */
void mc_cuda_set_naive(mc_backend *be, int naive);

/* Test hook: on a fresh backend of device `device`, `rounds` times
 * allocates blocks of sizes[0..count) through ops->alloc, releases them and
 * waits for the stream; reserved[r] is then the pool's reserved bytes
 * (what the device's shared pool, backend/devpool.h, holds from the device). In
 * steady state it stays constant: the pool never returns memory and reuses
 * the freed blocks. An allocation failure is the alloc op's error (out of
 * device memory: MC_ERR_NOMEM naming the request). With
 * release_while_recording the releases of each round happen inside a graph
 * recording (which they make fail): they are deferred to its end and must
 * still return the blocks, however many there are. */
mc_status mc_cuda_pool_probe(int device, const size_t *sizes, int count, int rounds,
                             int release_while_recording, uint64_t *reserved, mc_err *err);

#ifdef __cplusplus
}
#endif

#endif

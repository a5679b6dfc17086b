/* One caching allocator per device, shared by every backend (model) on it:
 * the MAR model, its VAE, the FID network, VAR and its VQVAE made on
 * cuda:N all take their memory from the same pool, so memory one of them
 * freed serves the next, and an out-of-memory in one of them first makes
 * every other's cached blocks go back to the device (a trim) and retries.
 *
 * Plain C with the device calls behind two small tables (raw alloc/free of
 * the device; "is the stream idle" / "wait for the stream" per owner), so
 * the bookkeeping is tested on the CPU with a fake device
 * (_C._devpool_script, tests/test_devpool.py); the CUDA backend plugs in
 * cudaMalloc / cudaFree and cudaStreamQuery / cudaStreamSynchronize
 * (cuda_backend.cu).
 *
 * The rules, and why:
 * - Size classes: a request is rounded up to 512 bytes, and above 4 KiB to
 *   one of 8 classes per power of two (at most 1/8 = 12.5% more than asked).
 *   A freed block serves later requests of its class only (no splitting, so
 *   no fragmentation bookkeeping); other sizes reach the device, and what
 *   the cache holds goes back to it on a trim.
 * - Stream order: each backend has its own stream, and a block is freed
 *   when its last kernels are enqueued, not finished. Its owner (the backend
 *   that freed it) may take it again at once: its later kernels run after
 *   the earlier ones on the same stream. Another owner may take it only
 *   once the freeing stream is known to be past the free: the owner has
 *   waited for its stream since (mc_devpool_synced), or a non-blocking query
 *   (owner ops `idle`) says the stream has finished everything enqueued.
 *   An owner that is recording a graph is never queried or waited on (both
 *   are illegal on a capturing stream).
 * - Out of memory: when the device refuses a new block, the pool waits for
 *   every owner's stream that is not recording, gives every cached block
 *   that is then idle back to the device, and asks once more. Failing
 *   again, the request fails with MC_ERR_NOMEM naming the bytes and what the
 *   pool holds.
 * - Lifetime: a pool lives while one owner is joined; the last owner to
 *   leave gives every cached block back and destroys it.
 * All entry points are thread-safe (one mutex per pool; the registry of
 * pools has its own). */
#ifndef MC_DEVPOOL_H
#define MC_DEVPOOL_H

#include <stddef.h>
#include <stdint.h>

#include "../core/mc_core.h"

/* The device's own allocator. alloc returns MC_ERR_NOMEM when the device is
 * out of memory (the pool then trims and retries once); any other failure
 * is final. `ctx` is the device's, passed back to both. */
typedef struct mc_devpool_raw {
    mc_status (*alloc)(void *ctx, size_t bytes, void **out, mc_err *err);
    void (*free)(void *ctx, void *ptr);
} mc_devpool_raw;

/* An owner's stream: idle() says without blocking whether everything
 * enqueued so far has finished; wait() blocks until it has (0 on success,
 * -1 on a device error, then its blocks are not treated as idle). */
typedef struct mc_devpool_owner_ops {
    int (*idle)(void *owner_ctx);
    int (*wait)(void *owner_ctx);
} mc_devpool_owner_ops;

typedef struct mc_devpool mc_devpool;
typedef struct mc_devpool_owner mc_devpool_owner;

/* Counters of one pool (bytes are class sizes, as asked of the device). */
typedef struct mc_devpool_stats {
    int owners;
    uint64_t in_use_bytes, in_use_blocks;
    uint64_t cached_bytes, cached_blocks;
    uint64_t reserved_bytes;      /* in use + cached: what the device gave us */
    uint64_t peak_reserved_bytes;
    uint64_t device_allocs, device_frees; /* calls of raw alloc / free that succeeded */
    uint64_t reuses_own, reuses_other;    /* requests served from the cache, by the block's
                                             owner / by another owner */
    uint64_t trims;               /* out-of-memory trims */
} mc_devpool_stats;

/* The class a request of `bytes` is rounded up to (0 -> 512). */
size_t mc_devpool_class_bytes(size_t bytes);

/* Joins the pool of device `device` behind `raw` (made on the first join:
 * pools are keyed by (raw, device), so a fake device in a test never meets
 * a real one), as an owner whose stream `ops` queries with `owner_ctx`. */
mc_status mc_devpool_join(const mc_devpool_raw *raw, void *raw_ctx, int device,
                          const mc_devpool_owner_ops *ops, void *owner_ctx,
                          mc_devpool_owner **out, mc_err *err);

/* Leaves the pool: call after waiting for the owner's stream (its freed
 * blocks become anyone's). Blocks it still holds stay accounted as in use
 * until freed (through any owner of the same pool) or the pool ends. The
 * last owner to leave destroys the pool, giving every block back. */
void mc_devpool_leave(mc_devpool_owner *owner);

/* A block of at least `bytes` (NULL with err set: MC_ERR_NOMEM after a
 * trim and a retry, naming `what`, `bytes` and the pool's state). */
void *mc_devpool_alloc(mc_devpool_owner *owner, size_t bytes, const char *what, mc_err *err);

/* Returns a block (from mc_devpool_alloc of any owner of this pool) to the
 * cache as `owner`'s: its kernels may still be running. NULL is ignored; a
 * pointer the pool did not hand out is ignored too (counted nowhere). */
void mc_devpool_free(mc_devpool_owner *owner, void *ptr);

/* The owner's stream waits bracket: take mc_devpool_sync_point before a
 * wait for the owner's stream and pass it to mc_devpool_synced after it
 * returned; the blocks the owner freed before the point are then idle. */
uint64_t mc_devpool_sync_point(mc_devpool_owner *owner);
void mc_devpool_synced(mc_devpool_owner *owner, uint64_t point);

/* While recording a graph the owner's stream is neither queried nor
 * waited on by other owners' trims. */
void mc_devpool_set_capturing(mc_devpool_owner *owner, int capturing);

/* Waits for every owner that is not recording and gives every idle cached
 * block back to the device (also what an out-of-memory does). */
void mc_devpool_trim(mc_devpool_owner *owner);

void mc_devpool_get_stats(mc_devpool_owner *owner, mc_devpool_stats *out);

#endif

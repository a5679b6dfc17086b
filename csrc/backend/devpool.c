/* The shared per-device caching allocator (rules in devpool.h). */
#include "devpool.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct pool_block {
    void *ptr;
    size_t bytes;              /* its class size */
    mc_devpool_owner *owner;   /* cached blocks: who freed it (NULL: known idle) */
    uint64_t free_seq;         /* cached blocks: the owner's free count at its free */
} pool_block;

struct mc_devpool_owner {
    mc_devpool *pool;
    const mc_devpool_owner_ops *ops;
    void *ctx;
    uint64_t free_seq;   /* blocks this owner has freed so far */
    uint64_t synced_seq; /* its blocks freed up to this count are known finished */
    uint64_t queried_in; /* the alloc call (pool->calls) that last queried its stream */
    int capturing;
    mc_devpool_owner *next;
};

struct mc_devpool {
    const mc_devpool_raw *raw;
    void *raw_ctx;
    int device;
    pthread_mutex_t lock;
    pool_block *used;   /* handed out */
    size_t n_used, cap_used;
    pool_block *cached; /* freed, kept for reuse; capacity >= n_used + n_cached, so a
                           free never needs to grow it */
    size_t n_cached, cap_cached;
    mc_devpool_owner *owners;
    uint64_t calls; /* alloc calls so far: an owner's stream is queried once per call */
    mc_devpool_stats stats;
    mc_devpool *next;
};

/* Pools by (raw, device). Lock order: registry_lock before a pool's lock. */
static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static mc_devpool *registry;

size_t mc_devpool_class_bytes(size_t bytes) {
    if (bytes <= 4096)
        return bytes <= 512 ? 512 : (bytes + 511) & ~(size_t)511;
    /* p: the largest power of two below bytes; classes are p / 8 apart in
     * (p, 2p], so a class is at most 1/8 larger than the request. */
    size_t p = 4096;
    while (p < (SIZE_MAX >> 1) && 2 * p < bytes)
        p *= 2;
    const size_t step = p / 8;
    if (bytes > SIZE_MAX - step)
        return 0; /* no class: the request cannot be met */
    return (bytes + step - 1) / step * step;
}

/* 0 with err set (the list that could not grow, and to how many bytes). */
static int grow(pool_block **array, size_t *capacity, size_t need, const char *which, int device, mc_err *err) {
    if (*capacity >= need)
        return 1;
    size_t cap = *capacity > 0 ? *capacity : 64;
    while (cap < need && cap <= SIZE_MAX / 2)
        cap *= 2;
    size_t bytes;
    pool_block *grown = cap < need || mc_mul_overflows(cap, sizeof **array, &bytes) ? NULL : realloc(*array, bytes);
    if (grown == NULL) {
        mc_fail_nomem_n(err, cap, sizeof **array, "the %s block list of device %d's memory pool (%zu entries)", which,
                        device, cap);
        return 0;
    }
    *array = grown;
    *capacity = cap;
    return 1;
}

static void account(mc_devpool *pool) {
    mc_devpool_stats *s = &pool->stats;
    s->reserved_bytes = s->in_use_bytes + s->cached_bytes;
    if (s->reserved_bytes > s->peak_reserved_bytes)
        s->peak_reserved_bytes = s->reserved_bytes;
}

/* Whether cached block b may go to `taker` now (pool locked). May query
 * b's owner's stream, once per alloc call. */
static int usable_by(mc_devpool *pool, const pool_block *b, const mc_devpool_owner *taker) {
    mc_devpool_owner *o = b->owner;
    if (o == NULL || o == taker || b->free_seq <= o->synced_seq)
        return 1;
    if (o->capturing || o->queried_in == pool->calls)
        return 0;
    o->queried_in = pool->calls;
    /* Every free of o so far was recorded under this lock after its kernels
     * were enqueued: an idle stream now has finished all of them. */
    const uint64_t point = o->free_seq;
    if (!o->ops->idle(o->ctx))
        return 0;
    o->synced_seq = point;
    return 1;
}

static void remove_at(pool_block *array, size_t *n, size_t i) {
    array[i] = array[--*n];
}

/* Waits for every owner that is not recording; gives back each cached
 * block whose free is then known finished (pool locked). */
static void trim_locked(mc_devpool *pool) {
    for (mc_devpool_owner *o = pool->owners; o != NULL; o = o->next) {
        if (o->capturing)
            continue;
        const uint64_t point = o->free_seq;
        if (o->ops->wait(o->ctx) == 0)
            o->synced_seq = point;
    }
    for (size_t i = pool->n_cached; i-- > 0;) {
        const pool_block *b = &pool->cached[i];
        if (b->owner != NULL && b->free_seq > b->owner->synced_seq)
            continue;
        pool->raw->free(pool->raw_ctx, b->ptr);
        pool->stats.device_frees++;
        pool->stats.cached_bytes -= b->bytes;
        pool->stats.cached_blocks--;
        remove_at(pool->cached, &pool->n_cached, i);
    }
    pool->stats.trims++;
    account(pool);
}

mc_status mc_devpool_join(const mc_devpool_raw *raw, void *raw_ctx, int device,
                          const mc_devpool_owner_ops *ops, void *owner_ctx,
                          mc_devpool_owner **out, mc_err *err) {
    *out = NULL;
    mc_devpool_owner *owner = calloc(1, sizeof *owner);
    if (owner == NULL)
        return mc_fail_nomem(err, sizeof *owner, "an owner of the device memory pool");
    owner->ops = ops;
    owner->ctx = owner_ctx;
    owner->queried_in = UINT64_MAX;
    pthread_mutex_lock(&registry_lock);
    mc_devpool *pool = registry;
    while (pool != NULL && !(pool->raw == raw && pool->device == device))
        pool = pool->next;
    if (pool == NULL) {
        pool = calloc(1, sizeof *pool);
        if (pool == NULL || pthread_mutex_init(&pool->lock, NULL) != 0) {
            pthread_mutex_unlock(&registry_lock);
            free(pool);
            free(owner);
            return mc_fail_nomem(err, sizeof *pool, "the device memory pool of device %d", device);
        }
        pool->raw = raw;
        pool->raw_ctx = raw_ctx;
        pool->device = device;
        pool->next = registry;
        registry = pool;
    }
    pthread_mutex_lock(&pool->lock);
    owner->pool = pool;
    owner->next = pool->owners;
    pool->owners = owner;
    pool->stats.owners++;
    pthread_mutex_unlock(&pool->lock);
    pthread_mutex_unlock(&registry_lock);
    *out = owner;
    return MC_OK;
}

static void destroy_pool(mc_devpool *pool) {
    /* No owner is left, so no stream can still use a block. */
    for (size_t i = 0; i < pool->n_cached; i++)
        pool->raw->free(pool->raw_ctx, pool->cached[i].ptr);
    for (size_t i = 0; i < pool->n_used; i++)
        pool->raw->free(pool->raw_ctx, pool->used[i].ptr);
    free(pool->cached);
    free(pool->used);
    pthread_mutex_destroy(&pool->lock);
    free(pool);
}

void mc_devpool_leave(mc_devpool_owner *owner) {
    if (owner == NULL)
        return;
    mc_devpool *pool = owner->pool;
    pthread_mutex_lock(&registry_lock);
    pthread_mutex_lock(&pool->lock);
    for (size_t i = 0; i < pool->n_cached; i++)
        if (pool->cached[i].owner == owner)
            pool->cached[i].owner = NULL; /* its stream was waited for: idle */
    for (mc_devpool_owner **link = &pool->owners; *link != NULL; link = &(*link)->next)
        if (*link == owner) {
            *link = owner->next;
            break;
        }
    const int last = --pool->stats.owners == 0;
    pthread_mutex_unlock(&pool->lock);
    if (last) {
        for (mc_devpool **link = &registry; *link != NULL; link = &(*link)->next)
            if (*link == pool) {
                *link = pool->next;
                break;
            }
    }
    pthread_mutex_unlock(&registry_lock);
    if (last)
        destroy_pool(pool);
    free(owner);
}

void *mc_devpool_alloc(mc_devpool_owner *owner, size_t bytes, const char *what, mc_err *err) {
    mc_devpool *pool = owner->pool;
    const size_t class_bytes = mc_devpool_class_bytes(bytes);
    if (class_bytes == 0) {
        mc_fail_nomem(err, bytes, "%s on device %d (no size class holds it)", what, pool->device);
        return NULL;
    }
    pthread_mutex_lock(&pool->lock);
    pool->calls++;
    /* Room to record the block now, and to cache it at its free later. */
    if (!grow(&pool->used, &pool->cap_used, pool->n_used + 1, "in-use", pool->device, err) ||
        !grow(&pool->cached, &pool->cap_cached, pool->n_used + pool->n_cached + 1, "cached", pool->device, err)) {
        pthread_mutex_unlock(&pool->lock);
        return NULL;
    }
    /* The owner's own blocks first (no query needed), then the others'. */
    size_t found = SIZE_MAX;
    for (size_t i = pool->n_cached; i-- > 0 && found == SIZE_MAX;)
        if (pool->cached[i].bytes == class_bytes && pool->cached[i].owner == owner)
            found = i;
    for (size_t i = pool->n_cached; i-- > 0 && found == SIZE_MAX;)
        if (pool->cached[i].bytes == class_bytes && usable_by(pool, &pool->cached[i], owner))
            found = i;
    void *ptr = NULL;
    if (found != SIZE_MAX) {
        const pool_block b = pool->cached[found];
        remove_at(pool->cached, &pool->n_cached, found);
        if (b.owner == owner)
            pool->stats.reuses_own++;
        else
            pool->stats.reuses_other++;
        pool->stats.cached_bytes -= b.bytes;
        pool->stats.cached_blocks--;
        ptr = b.ptr;
    } else {
        mc_err first;
        memset(&first, 0, sizeof first);
        mc_status st = pool->raw->alloc(pool->raw_ctx, class_bytes, &ptr, &first);
        uint64_t given_back = 0;
        if (st == MC_ERR_NOMEM) {
            /* Out of device memory: what other owners (and this one) cache
             * goes back to the device, then one more try. */
            const uint64_t cached_before = pool->stats.cached_bytes;
            trim_locked(pool);
            given_back = cached_before - pool->stats.cached_bytes;
            mc_err second;
            memset(&second, 0, sizeof second);
            st = pool->raw->alloc(pool->raw_ctx, class_bytes, &ptr, &second);
            if (st != MC_OK)
                first = second;
        }
        if (st != MC_OK) {
            const mc_devpool_stats s = pool->stats;
            pthread_mutex_unlock(&pool->lock);
            if (st == MC_ERR_NOMEM) {
                char held[2 * MC_ERRMSG_LEN]; /* room for the device's whole message */
                snprintf(held, sizeof held,
                         "also after giving %llu cached bytes back to the device; %llu bytes in %llu "
                         "blocks are in use by the %d model(s) on this device, %llu bytes stay "
                         "cached by models recording a graph (%s)",
                         (unsigned long long)given_back, (unsigned long long)s.in_use_bytes,
                         (unsigned long long)s.in_use_blocks, s.owners, (unsigned long long)s.cached_bytes,
                         first.msg);
                mc_fail_nomem_because(err, class_bytes, held,
                                      "%s on device %d, a %zu-byte request rounded up to its size class", what,
                                      pool->device, bytes);
            } else
                mc_fail(err, st, "%s", first.msg);
            return NULL;
        }
        pool->stats.device_allocs++;
    }
    pool->used[pool->n_used++] = (pool_block){ptr, class_bytes, NULL, 0};
    pool->stats.in_use_bytes += class_bytes;
    pool->stats.in_use_blocks++;
    account(pool);
    pthread_mutex_unlock(&pool->lock);
    return ptr;
}

void mc_devpool_free(mc_devpool_owner *owner, void *ptr) {
    if (ptr == NULL)
        return;
    mc_devpool *pool = owner->pool;
    pthread_mutex_lock(&pool->lock);
    /* Recent blocks are freed first, mostly: search from the end. */
    for (size_t i = pool->n_used; i-- > 0;) {
        if (pool->used[i].ptr != ptr)
            continue;
        pool_block b = pool->used[i];
        remove_at(pool->used, &pool->n_used, i);
        b.owner = owner;
        b.free_seq = ++owner->free_seq;
        pool->cached[pool->n_cached++] = b; /* room reserved by mc_devpool_alloc */
        pool->stats.in_use_bytes -= b.bytes;
        pool->stats.in_use_blocks--;
        pool->stats.cached_bytes += b.bytes;
        pool->stats.cached_blocks++;
        break;
    }
    pthread_mutex_unlock(&pool->lock);
}

uint64_t mc_devpool_sync_point(mc_devpool_owner *owner) {
    pthread_mutex_lock(&owner->pool->lock);
    const uint64_t point = owner->free_seq;
    pthread_mutex_unlock(&owner->pool->lock);
    return point;
}

void mc_devpool_synced(mc_devpool_owner *owner, uint64_t point) {
    pthread_mutex_lock(&owner->pool->lock);
    if (point > owner->synced_seq)
        owner->synced_seq = point;
    pthread_mutex_unlock(&owner->pool->lock);
}

void mc_devpool_set_capturing(mc_devpool_owner *owner, int capturing) {
    pthread_mutex_lock(&owner->pool->lock);
    owner->capturing = capturing != 0;
    pthread_mutex_unlock(&owner->pool->lock);
}

void mc_devpool_trim(mc_devpool_owner *owner) {
    pthread_mutex_lock(&owner->pool->lock);
    trim_locked(owner->pool);
    pthread_mutex_unlock(&owner->pool->lock);
}

void mc_devpool_get_stats(mc_devpool_owner *owner, mc_devpool_stats *out) {
    pthread_mutex_lock(&owner->pool->lock);
    *out = owner->pool->stats;
    pthread_mutex_unlock(&owner->pool->lock);
}

/* _devpool_script(capacity, steps): the shared device allocator
 * (backend/devpool.c) driven on a fake device, a test hook that runs on any
 * machine (tests/test_devpool.py). The CUDA backend plugs the same pool into
 * cudaMalloc / cudaFree and its streams; here the device is a byte budget
 * that can be told to refuse, and each owner's "stream" is a busy flag.
 *
 * steps: a list of tuples, run in order; the result list has one entry each:
 *   ("join", k[, device])  owner k (0..7) joins the pool of `device` (0) -> None
 *   ("leave", k)           owner k leaves (its stream counts as waited for) -> None
 *   ("alloc", k, bytes)    -> the block's fake address (int), or the error message (str)
 *   ("free", k, address)   owner k frees the block -> None
 *   ("busy", k, flag)      owner k's stream has unfinished work (1) or none (0) -> None
 *   ("sync", k)            owner k waited for its stream (sync point + synced) -> None
 *   ("capturing", k, flag) owner k records a graph (1) or stopped (0) -> None
 *   ("trim", k)            mc_devpool_trim -> None
 *   ("stats", k)           the pool's counters, a dict; plus "waits" (owner k's waits)
 *                          and "device_used" (bytes the fake device has handed out)
 *   ("fail_next", n)       the next n device allocations fail as out of memory -> None
 *   ("device_used",)       bytes the fake device has handed out and not got back (int)
 * Owners still joined at the end leave, so every script ends with its pools gone. */
#include "py_numpy.h"

#include <stdio.h>
#include <string.h>

#include "../backend/devpool.h"

#define FAKE_OWNERS 8
#define FAKE_BLOCKS 4096

typedef struct fake_device {
    uint64_t capacity, used, next_address;
    int fail_next;
    int n_blocks;
    uint64_t address[FAKE_BLOCKS], bytes[FAKE_BLOCKS];
} fake_device;

typedef struct fake_owner {
    mc_devpool_owner *owner;
    int busy;
    long waits;
} fake_owner;

static mc_status fake_alloc(void *ctx, size_t bytes, void **out, mc_err *err) {
    fake_device *d = ctx;
    if (d->fail_next > 0) {
        d->fail_next--;
        return mc_fail_nomem_because(err, bytes, "the fake device was told to refuse it", "a block of the fake device");
    }
    if (d->used + bytes > d->capacity || d->n_blocks == FAKE_BLOCKS) {
        char held[160];
        snprintf(held, sizeof held, "%llu of its %llu bytes and %d of its %d blocks are in use",
                 (unsigned long long)d->used, (unsigned long long)d->capacity, d->n_blocks, FAKE_BLOCKS);
        return mc_fail_nomem_because(err, bytes, held, "a block of the fake device");
    }
    d->address[d->n_blocks] = d->next_address;
    d->bytes[d->n_blocks++] = bytes;
    *out = (void *)(uintptr_t)d->next_address; /* never dereferenced */
    d->next_address += bytes;
    d->used += bytes;
    return MC_OK;
}

static void fake_free(void *ctx, void *ptr) {
    fake_device *d = ctx;
    for (int i = 0; i < d->n_blocks; i++)
        if (d->address[i] == (uint64_t)(uintptr_t)ptr) {
            d->used -= d->bytes[i];
            d->address[i] = d->address[--d->n_blocks];
            d->bytes[i] = d->bytes[d->n_blocks];
            return;
        }
}

static int fake_idle(void *ctx) { return !((fake_owner *)ctx)->busy; }

static int fake_wait(void *ctx) {
    fake_owner *o = ctx;
    o->busy = 0;
    o->waits++;
    return 0;
}

static const mc_devpool_raw FAKE_RAW = {fake_alloc, fake_free};
static const mc_devpool_owner_ops FAKE_OWNER_OPS = {fake_idle, fake_wait};

static PyObject *stats_dict(mc_devpool_owner *owner, long waits, const fake_device *dev) {
    mc_devpool_stats s;
    mc_devpool_get_stats(owner, &s);
    return Py_BuildValue("{s:i,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:l,s:K}", "owners",
                         s.owners, "in_use_bytes", s.in_use_bytes, "in_use_blocks",
                         s.in_use_blocks, "cached_bytes", s.cached_bytes, "cached_blocks",
                         s.cached_blocks, "reserved_bytes", s.reserved_bytes,
                         "peak_reserved_bytes", s.peak_reserved_bytes, "device_allocs",
                         s.device_allocs, "device_frees", s.device_frees, "reuses_own",
                         s.reuses_own, "reuses_other", s.reuses_other, "trims", s.trims,
                         "waits", waits, "device_used", dev->used);
}

/* One step; a new reference (Py_None for steps without a result), NULL
 * with an exception for a malformed step. */
static PyObject *run_step(PyObject *step, fake_device *dev, fake_owner *owners) {
    const char *verb = NULL;
    long long a = 0, b = 0;
    if (!PyArg_ParseTuple(step, "s|LL", &verb, &a, &b))
        return NULL;
    if (strcmp(verb, "fail_next") == 0) {
        dev->fail_next = (int)a;
        Py_RETURN_NONE;
    }
    if (strcmp(verb, "device_used") == 0)
        return PyLong_FromUnsignedLongLong(dev->used);
    if (a < 0 || a >= FAKE_OWNERS)
        return PyErr_Format(PyExc_ValueError, "_devpool_script: owner %lld not in 0..%d", a,
                            FAKE_OWNERS - 1);
    fake_owner *o = &owners[a];
    if (strcmp(verb, "join") == 0) {
        if (o->owner != NULL)
            return PyErr_Format(PyExc_ValueError, "_devpool_script: owner %lld joined twice", a);
        mc_err err = {0};
        if (mc_devpool_join(&FAKE_RAW, dev, (int)b, &FAKE_OWNER_OPS, o, &o->owner, &err) != MC_OK)
            return mcpy_raise(&err);
        Py_RETURN_NONE;
    }
    if (o->owner == NULL)
        return PyErr_Format(PyExc_ValueError, "_devpool_script: owner %lld has not joined (step %s)",
                            a, verb);
    if (strcmp(verb, "leave") == 0) {
        mc_devpool_leave(o->owner);
        o->owner = NULL;
    } else if (strcmp(verb, "alloc") == 0) {
        if (b < 0)
            return PyErr_Format(PyExc_ValueError, "_devpool_script: negative size %lld", b);
        mc_err err = {0};
        void *p = mc_devpool_alloc(o->owner, (size_t)b, "a _devpool_script block", &err);
        return p != NULL ? PyLong_FromUnsignedLongLong((uint64_t)(uintptr_t)p)
                         : PyUnicode_FromString(err.msg);
    } else if (strcmp(verb, "free") == 0) {
        mc_devpool_free(o->owner, (void *)(uintptr_t)(uint64_t)b);
    } else if (strcmp(verb, "busy") == 0) {
        o->busy = b != 0;
    } else if (strcmp(verb, "sync") == 0) {
        const uint64_t point = mc_devpool_sync_point(o->owner);
        fake_wait(o);
        mc_devpool_synced(o->owner, point);
    } else if (strcmp(verb, "capturing") == 0) {
        mc_devpool_set_capturing(o->owner, (int)b);
    } else if (strcmp(verb, "trim") == 0) {
        mc_devpool_trim(o->owner);
    } else if (strcmp(verb, "stats") == 0) {
        return stats_dict(o->owner, o->waits, dev);
    } else {
        return PyErr_Format(PyExc_ValueError, "_devpool_script: unknown step '%s'", verb);
    }
    Py_RETURN_NONE;
}

static PyObject *devpool_script(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long capacity;
    PyObject *steps;
    if (!PyArg_ParseTuple(args, "KO", &capacity, &steps))
        return NULL;
    PyObject *fast = PySequence_Fast(steps, "_devpool_script: steps must be a list of tuples");
    if (fast == NULL)
        return NULL;
    fake_device *dev = PyMem_Calloc(1, sizeof *dev);
    fake_owner owners[FAKE_OWNERS];
    memset(owners, 0, sizeof owners);
    PyObject *results = dev != NULL ? PyList_New(0) : mcpy_no_memory("the fake device of _devpool_script", sizeof *dev);
    if (dev != NULL) {
        dev->capacity = capacity;
        dev->next_address = 0x100000;
    }
    for (Py_ssize_t i = 0; results != NULL && i < PySequence_Fast_GET_SIZE(fast); i++) {
        PyObject *r = run_step(PySequence_Fast_GET_ITEM(fast, i), dev, owners);
        if (r == NULL || PyList_Append(results, r) < 0)
            Py_CLEAR(results);
        Py_XDECREF(r);
    }
    for (int k = 0; k < FAKE_OWNERS; k++)
        mc_devpool_leave(owners[k].owner);
    PyMem_Free(dev);
    Py_DECREF(fast);
    return results;
}

static PyMethodDef devpool_methods[] = {
    {"_devpool_script", devpool_script, METH_VARARGS,
     "_devpool_script(capacity, steps) -> results: the shared device allocator on a fake device "
     "of `capacity` bytes (test hook; see csrc/python/py_devpool.c)"},
    {NULL, NULL, 0, NULL},
};

int mcpy_devpool_init(PyObject *module) { return PyModule_AddFunctions(module, devpool_methods); }

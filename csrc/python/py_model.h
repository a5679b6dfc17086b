/* What every model binding (MAR, VAR, VAE, VQVAE, Inception) shares: the
 * object's common head and its life cycle (load with the GIL released,
 * release, dealloc, registration), array arguments, the result of a call
 * that ran without the GIL, the backend counters, and a cache policy's
 * config parsed from its Python field dict. One copy here instead of one in
 * each py_*.c. */
#ifndef MC_PY_MODEL_H
#define MC_PY_MODEL_H

#include "py_numpy.h"
#include "py_backend.h"

#include <pythread.h>

#include "../runtime/config_fields.h"

/* The head of every model object: the backend the model lives on and the
 * one-call-at-a-time lock of the models that wait for it (VAE, VQVAE,
 * Inception; NULL for MAR and VAR, which refuse a second call instead). */
#define MCPY_MODEL_HEAD \
    PyObject_HEAD       \
    mc_backend *backend; \
    PyThread_type_lock lock;

typedef struct mcpy_model_object {
    MCPY_MODEL_HEAD
} mcpy_model_object;

/* Frees a model object's model (the type's own free function on its model
 * pointer, which it then clears); the backend is destroyed after it. */
typedef void (*mcpy_release_fn)(mcpy_model_object *self);

/* Releases the model (release) and the backend: __init__ on a live object
 * and dealloc. */
void mcpy_model_release(mcpy_model_object *self, mcpy_release_fn release);

/* tp_dealloc of a model object: the model, the backend, the lock, the object. */
void mcpy_model_dealloc(mcpy_model_object *self, mcpy_release_fn release);

/* The load part of a model's __init__: `threads` checked (>= 0; named
 * `threads_name` in the message), the lock made when `with_lock`, the old
 * model released, then the file at `path_bytes` (consumed) loaded on the
 * device's new backend with the GIL released (mcpy_load_model). 0, or -1
 * with the exception set. */
int mcpy_model_load(mcpy_model_object *self, mcpy_release_fn release, int with_lock, PyObject *path_bytes,
                    const char *device, int threads, const char *threads_name, mc_wtype wtype,
                    mcpy_model_loader load, void *model);

/* __init__(path, num_threads=0, device='cpu', dtype='fp32') of a model that
 * waits for its lock (VAE, VQVAE): the arguments parsed (`type_name` in
 * their messages), then mcpy_model_load. 0, or -1 with the exception set. */
int mcpy_model_init_path_threads_device(mcpy_model_object *self, PyObject *args, PyObject *kwds,
                                        const char *type_name, mcpy_release_fn release, mcpy_model_loader load,
                                        void *model);

/* Decodes n images of `image_floats` floats each: decode(ctx, first, count,
 * out) writes images first..first+count-1 as float32 at `out`. With
 * as_uint8 the images go one at a time through a scratch image into `out`
 * as uint8 (round_half_even(clip((x + 1) / 2 * 255)), mc_vae_to_uint8), so
 * the float copy of the whole batch never exists; NaN output is
 * MC_ERR_NUMERIC naming `what` and the image. Needs no GIL. */
typedef mc_status (*mcpy_decode_fn)(void *ctx, int64_t first, int64_t count, float *out, mc_err *err);
mc_status mcpy_decode_images(mcpy_decode_fn decode, void *ctx, int64_t n, int64_t image_floats, int as_uint8,
                             void *out, const char *what, mc_err *err);

/* Adds `type` to the module as `name` (after PyType_Ready), and the
 * module-level `functions` of the same binding (NULL: none); 0 or -1. */
int mcpy_add_type(PyObject *module, PyTypeObject *type, const char *name, PyMethodDef *functions);

/* A model type's release function `<prefix>_release_model` (the type's
 * `free_fn` on self-><member>, then NULL) and its tp_dealloc
 * `<prefix>_dealloc` (mcpy_model_dealloc). */
#define MCPY_MODEL_LIFECYCLE(prefix, type, member, free_fn)                   \
    static void prefix##_release_model(mcpy_model_object *self) {              \
        free_fn(((type *)self)->member);                                       \
        ((type *)self)->member = NULL;                                         \
    }                                                                          \
    static void prefix##_dealloc(type *self) {                                 \
        mcpy_model_dealloc((mcpy_model_object *)self, prefix##_release_model); \
    }

/* The life cycle of a model that waits for its lock and keeps an info
 * struct (VAE, VQVAE): MCPY_MODEL_LIFECYCLE, the loader `<prefix>_load`
 * (load_fn) and `<prefix>_init(path, num_threads=0, device='cpu',
 * dtype='fp32')` (dtype: the backend's linear_wtype), which sets
 * self-><member> (a `model_type *`) and fills self->info with info_fn once
 * the load has succeeded. */
#define MCPY_PATH_MODEL(prefix, type, model_type, member, free_fn, load_fn, info_fn)                      \
    MCPY_MODEL_LIFECYCLE(prefix, type, member, free_fn)                                                 \
    static mc_status prefix##_load(mc_backend *backend, mc_st_file *file, void *model, mc_err *err) {   \
        return load_fn(backend, file, model, err);                                                      \
    }                                                                                                   \
    static int prefix##_init(type *self, PyObject *args, PyObject *kwds) {                              \
        model_type *model = NULL;                                                                       \
        if (mcpy_model_init_path_threads_device((mcpy_model_object *)self, args, kwds, #prefix,         \
                                                prefix##_release_model, prefix##_load, &model) < 0)     \
            return -1;                                                                                  \
        self->member = model;                                                                           \
        info_fn(model, &self->info);                                                                    \
        return 0;                                                                                       \
    }

/* The type object `<prefix>_type` of a model binding: marcache._C.<py_name>,
 * objects of `type`, <prefix>_dealloc, <prefix>_init, <prefix>_methods and
 * <prefix>_getset, the docstring `doc`. */
#define MCPY_MODEL_TYPE(prefix, type, py_name, doc)          \
    static PyTypeObject prefix##_type = {                    \
        PyVarObject_HEAD_INIT(NULL, 0)                       \
        .tp_name = "marcache._C." py_name,                   \
        .tp_basicsize = sizeof(type),                        \
        .tp_dealloc = (destructor)prefix##_dealloc,          \
        .tp_flags = Py_TPFLAGS_DEFAULT,                      \
        .tp_doc = doc,                                       \
        .tp_methods = prefix##_methods,                      \
        .tp_getset = prefix##_getset,                        \
        .tp_init = (initproc)prefix##_init,                  \
        .tp_new = PyType_GenericNew,                         \
    }

/* RuntimeError "<what> is not loaded" when `model` is NULL: 0 or -1. */
int mcpy_require_loaded(const void *model, const char *what);

/* A getter `<prefix>_get_<field>` of `type` objects returning
 * conv(self->info.field), RuntimeError while self-><model> is NULL. */
#define MCPY_INFO_GETTER(prefix, type, model, what, field, conv)                  \
    static PyObject *prefix##_get_##field(type *self, void *closure) {              \
        (void)closure;                                                           \
        return mcpy_require_loaded(self->model, what) < 0 ? NULL : conv(self->info.field); \
    }

/* The PyGetSetDef entry of a read-only attribute `field` served by
 * <prefix>_get_<field>. */
#define MCPY_GETTER_ENTRY(prefix, field, doc) {#field, (getter)prefix##_get_##field, NULL, doc, NULL}

/* The return value of a call that ran with the GIL released: `out` when
 * `st` is MC_OK; otherwise `out` is released and err raised (NULL). */
PyObject *mcpy_result(mc_status st, const mc_err *err, PyObject *out);

/* A real numeric array-like as a new C-contiguous float32 array (complex,
 * bool, object and string data are refused rather than silently cast). */
PyArrayObject *mcpy_float32_arg(PyObject *obj, const char *what);

/* A C-contiguous array of `typenum` (cast) with `ndim` dimensions, or NULL
 * with ValueError naming `what` and the shape it got. */
PyArrayObject *mcpy_array_arg(PyObject *obj, int typenum, int ndim, const char *what);

/* Several array arguments at once (mcpy_array_arg each, in order): 0 with
 * out[0..count) set, or -1 with the exception set and every out[i] NULL. */
typedef struct mcpy_array_spec {
    PyObject *obj;
    int typenum, ndim;
    const char *what;
} mcpy_array_spec;
int mcpy_arrays_arg(int count, const mcpy_array_spec *spec, PyArrayObject **out);

/* Releases out[0..count) of mcpy_arrays_arg (NULL entries allowed). */
void mcpy_arrays_release(int count, PyArrayObject **arrays);

/* A tuple of Python ints of values[0..n). */
PyObject *mcpy_int_tuple(const int64_t *values, Py_ssize_t n);

/* The getters of a model's backend counters (allocations, host waits,
 * dispatched FLOPs, CPU graph teams); 0 before a model is loaded. */
PyObject *mcpy_get_backend_allocations(mcpy_model_object *self, void *closure);
PyObject *mcpy_get_backend_syncs(mcpy_model_object *self, void *closure);
PyObject *mcpy_get_backend_flops(mcpy_model_object *self, void *closure);
PyObject *mcpy_get_backend_team_regions(mcpy_model_object *self, void *closure);
PyObject *mcpy_get_backend_team_calls(mcpy_model_object *self, void *closure);

#define MCPY_BACKEND_COUNTER_GETSETS                                                                      \
    {"backend_allocations", (getter)mcpy_get_backend_allocations, NULL,                                   \
     "allocations of backend memory so far (weights, activations, caches, scratch growth)", NULL},        \
    {"backend_syncs", (getter)mcpy_get_backend_syncs, NULL,                                               \
     "host waits for the backend so far: downloads and uploads over 1 MiB (counted alike on every backend)", \
     NULL},                                                                                               \
    {"backend_flops", (getter)mcpy_get_backend_flops, NULL,                                               \
     "FLOPs of the GEMM and attention ops dispatched so far (ops_list.h's convention, that of "           \
     "marcache.flops); counted on the guard backend only, 0 elsewhere", NULL},                            \
    {"backend_team_regions", (getter)mcpy_get_backend_team_regions, NULL,                                 \
     "parallel regions the CPU's graph launches opened for one persistent team (0 elsewhere)", NULL},      \
    {"backend_team_calls", (getter)mcpy_get_backend_team_calls, NULL,                                     \
     "recorded calls the CPU's graph launches ran inside those regions (0 elsewhere)", NULL}

/* A cache policy's config from the dict its Python policy's as_dict() gives:
 * the "policy" key names it (found with `lookup`, the family's registry),
 * the other keys fill its config by its field table. `family` names the
 * family in messages ("MAR", "VAR"). Returns the policy's schema (the first
 * member of the family's ops table) and sets *config (release with
 * mcpy_policy_config_free), or NULL with the exception set. */
const mc_config_schema *mcpy_policy_config(PyObject *cache, const char *family,
                                           const mc_config_schema *(*lookup)(const char *name), void **config);

/* `static int parse_policy(cache, model, &ops, &config)` of a family (fam:
 * mar, var; FAM its name in messages): cache=None gives no policy (*ops and
 * *config NULL); otherwise the policy named by the dict's "policy" key, its
 * config filled (mcpy_policy_config) and checked against the model by the
 * policy's check. 0, or -1 with the exception set. The ops table's first
 * member is its schema, so the schema found is the table. */
#define MCPY_PARSE_POLICY(fam, FAM)                                                                       \
    static int parse_policy(PyObject *cache, const mc_##fam##_config *model, const mc_##fam##_policy_ops **ops, \
                            void **config) {                                                              \
        *ops = NULL;                                                                                      \
        *config = NULL;                                                                                   \
        if (cache == Py_None)                                                                             \
            return 0;                                                                                     \
        const mc_config_schema *schema = mcpy_policy_config(cache, FAM, mc_##fam##_policy_schema, config); \
        if (schema == NULL)                                                                               \
            return -1;                                                                                    \
        const mc_##fam##_policy_ops *found = (const mc_##fam##_policy_ops *)(const void *)schema;         \
        mc_err err = {0};                                                                                 \
        if (found->check(*config, model, &err) != MC_OK) {                                                \
            mcpy_policy_config_free(schema, *config);                                                     \
            *config = NULL;                                                                               \
            mcpy_raise(&err);                                                                             \
            return -1;                                                                                    \
        }                                                                                                 \
        *ops = found;                                                                                     \
        return 0;                                                                                         \
    }                                                                                                     \
    static void free_policy_config(const mc_##fam##_policy_ops *policy, void *config) {                  \
        mcpy_policy_config_free(policy ? &policy->schema : NULL, config);                                 \
    }

/* Releases what mcpy_policy_config made (schema NULL: config is NULL too). */
void mcpy_policy_config_free(const mc_config_schema *schema, void *config);

#endif

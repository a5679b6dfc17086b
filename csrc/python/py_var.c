/* marcache._C.VAR: a loaded VAR transformer (models/var.h), its generation
 * (runtime/var_sampler.h, through the one generation binding
 * mcpy_generate), and components the tests compare with the float64
 * reference scale by scale. Arguments are checked here and in marcache/;
 * compute runs with the GIL released; one call at a time per model. */
#include "py_model.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../models/var.h"
#include "../runtime/var_sampler.h"
#include "py_generate.h"
#include "py_vqvae.h"

typedef struct {
    MCPY_MODEL_HEAD
    mc_var *var;
    int busy; /* set while the GIL is released: one call at a time */
} PyVAR;

MCPY_MODEL_LIFECYCLE(var, PyVAR, var, mc_var_free)

static mc_status load_var(mc_backend *backend, mc_st_file *file, void *model, mc_err *err) {
    return mc_var_load(backend, file, (mc_var **)model, err);
}

static int var_init(PyVAR *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"path", "device", "dtype", "threads", NULL};
    PyObject *path_obj = NULL;
    const char *device = "cpu", *dtype = "fp32";
    int threads = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O&|ssi:VAR", keywords, PyUnicode_FSConverter, &path_obj,
                                     &device, &dtype, &threads))
        return -1;
    mc_wtype wtype;
    if (self->busy)
        PyErr_SetString(PyExc_RuntimeError, "this VAR model is running a call in another thread");
    if (self->busy || mcpy_parse_wtype(dtype, &wtype) < 0) {
        Py_DECREF(path_obj);
        return -1;
    }
    mc_var *var = NULL;
    /* (__init__ again on a live object: the new device and dtype apply.) */
    if (mcpy_model_load((mcpy_model_object *)self, var_release_model, 0, path_obj, device, threads, "threads", wtype,
                        load_var, &var) < 0)
        return -1;
    self->var = var;
    return 0;
}

/* Takes the model for one call (GIL held); 0, or -1 with RuntimeError. */
static int claim(PyVAR *self) {
    if (mcpy_require_loaded(self->var, "VAR model") < 0)
        return -1;
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "this VAR model is already running a call in another thread");
        return -1;
    }
    self->busy = 1;
    return 0;
}

/* labels int32 [n] with every value in 0..num_classes (num_classes = the
 * null class), n >= 1. */
static PyArrayObject *sequence_labels(PyVAR *self, PyObject *obj) {
    PyArrayObject *labels = mcpy_array_arg(obj, NPY_INT32, 1, "labels");
    if (labels == NULL)
        return NULL;
    const int64_t n = PyArray_DIM(labels, 0), classes = self->var->config.num_classes;
    const int32_t *v = PyArray_DATA(labels);
    if (n == 0) {
        Py_DECREF(labels);
        PyErr_SetString(PyExc_ValueError, "labels must hold at least one sequence's label");
        return NULL;
    }
    for (int64_t i = 0; i < n; i++)
        if (v[i] < 0 || v[i] > classes) {
            PyErr_Format(PyExc_ValueError, "label %d at index %lld is outside 0..%lld (%lld = the null class)", v[i],
                         (long long)i, (long long)classes, (long long)classes);
            Py_DECREF(labels);
            return NULL;
        }
    return labels;
}

/* The number of scales k + 1 whose tokens add up to `tokens` (scales
 * 0..k), or 0 when no prefix of the scales has that many. */
static int scales_of_tokens(const mc_var_config *c, int64_t tokens) {
    for (int k = 0; k < c->n_scales; k++)
        if (c->scale_begin[k + 1] == tokens)
            return k + 1;
    return 0;
}

/* The tokens of the largest of scales 0..n_scales-1. */
static int64_t largest_scale_rows(const mc_var_config *c, int n_scales) {
    int64_t most = 0;
    for (int s = 0; s < n_scales; s++)
        most = c->patch_nums[s] * c->patch_nums[s] > most ? c->patch_nums[s] * c->patch_nums[s] : most;
    return most;
}

/* Uploads rows begin..begin+n-1 of each of the N sequences of `seqs` (host,
 * [N, seq_rows, width]) to `dev` ([N, n, width]) through the host staging
 * buffer `stage`. */
static mc_status upload_scale(mc_backend *be, float *dev, const float *seqs, int64_t N, int64_t seq_rows, int64_t begin,
                              int64_t n, int64_t width, float *stage, mc_err *err) {
    for (int64_t b = 0; b < N; b++)
        memcpy(stage + b * n * width, seqs + (b * seq_rows + begin) * width, (size_t)(n * width) * sizeof(float));
    return be->ops->upload(be, dev, stage, (size_t)(N * n * width) * sizeof(float), err);
}

/* The reverse of upload_scale: `dev` [N, n, width] into rows begin.. of
 * each sequence of `seqs` [N, seq_rows, width]. */
static mc_status download_scale(mc_backend *be, float *seqs, const float *dev, int64_t N, int64_t seq_rows,
                                int64_t begin, int64_t n, int64_t width, float *stage, mc_err *err) {
    mc_status st = be->ops->download(be, stage, dev, (size_t)(N * n * width) * sizeof(float), err);
    for (int64_t b = 0; st == MC_OK && b < N; b++)
        memcpy(seqs + (b * seq_rows + begin) * width, stage + b * n * width, (size_t)(n * width) * sizeof(float));
    return st;
}

static PyObject *bad_token_count(const mc_var_config *c, const char *what, int64_t got, int64_t offset) {
    char list[256];
    size_t used = 0;
    list[0] = '\0';
    for (int k = 0; k < c->n_scales && used < sizeof list; k++)
        used += (size_t)snprintf(list + used, sizeof list - used, "%s%lld", k ? ", " : "",
                                 (long long)(c->scale_begin[k + 1] - offset));
    return PyErr_Format(PyExc_ValueError, "%s has %lld tokens per sequence; it must cover whole scales from the "
                        "first: one of %s", what, (long long)got, list);
}

/* scale_inputs(labels int32 [N], next_maps float32 [N, T, Cvae]) -> inputs float32 [N, first + T, C]:
 * the input embedding of scales 0..k for N sequences, T = the tokens of scales 1..k (0: the first
 * scale alone). Scale 0 is sos + pos_start + lvl_pos from the label; scale s > 0 is
 * word_embed(next_maps rows of scale s) + lvl_pos (A4 steps 5 and 7, without the CFG copy). */
static PyObject *var_scale_inputs(PyVAR *self, PyObject *args) {
    PyObject *labels_obj, *maps_obj;
    if (!PyArg_ParseTuple(args, "OO:scale_inputs", &labels_obj, &maps_obj))
        return NULL;
    if (mcpy_require_loaded(self->var, "VAR model") < 0)
        return NULL;
    const mc_var_config *c = &self->var->config;
    PyArrayObject *labels = sequence_labels(self, labels_obj);
    PyArrayObject *maps = labels ? mcpy_array_arg(maps_obj, NPY_FLOAT32, 3, "next_maps") : NULL;
    if (maps == NULL) {
        Py_XDECREF(labels);
        return NULL;
    }
    const int64_t N = PyArray_DIM(labels, 0), T = PyArray_DIM(maps, 1), first = c->scale_begin[1];
    const int n_scales = scales_of_tokens(c, first + T);
    PyArrayObject *out = NULL;
    if (PyArray_DIM(maps, 0) != N || PyArray_DIM(maps, 2) != c->vae_channels) {
        PyErr_Format(PyExc_ValueError, "next_maps must have shape [%lld, tokens, %lld] (one map row per label, "
                     "vae_channels)", (long long)N, (long long)c->vae_channels);
        goto done;
    }
    if (n_scales == 0) {
        bad_token_count(c, "next_maps", T, first);
        goto done;
    }
    const int64_t Lk = first + T, C = c->width;
    npy_intp dims[3] = {(npy_intp)N, (npy_intp)Lk, (npy_intp)C};
    out = (PyArrayObject *)PyArray_SimpleNew(3, dims, NPY_FLOAT32);
    if (out == NULL || claim(self) < 0) {
        Py_CLEAR(out);
        goto done;
    }
    mc_err err = {0};
    mc_status st = MC_OK;
    mc_var *var = self->var;
    mc_backend *be = self->backend;
    const float *map_data = PyArray_DATA(maps);
    float *out_data = PyArray_DATA(out);
    const int64_t max_rows = largest_scale_rows(c, n_scales);
    Py_BEGIN_ALLOW_THREADS
    const size_t host_bytes = (size_t)(N * max_rows * (C > c->vae_channels ? C : c->vae_channels)) * sizeof(float);
    float *d_map = NULL, *host = malloc(host_bytes);
    if (host == NULL)
        st = mc_fail_nomem(&err, host_bytes, "the scale input staging buffer");
    if (st == MC_OK)
        st = mc_var_reserve(var, N, max_rows, &err);
    if (st == MC_OK)
        st = mc_var_condition(var, PyArray_DATA(labels), N, &err);
    if (st == MC_OK && (d_map = be->ops->alloc(be, (size_t)(N * max_rows * c->vae_channels) * sizeof(float),
                                               "the scale input map", &err)) == NULL)
        st = err.status;
    for (int s = 0; s < n_scales && st == MC_OK; s++) {
        const int64_t n = c->patch_nums[s] * c->patch_nums[s], begin = c->scale_begin[s];
        if (s == 0) {
            st = mc_var_first_input(var, N, var->acts.x, &err);
        } else {
            st = upload_scale(be, d_map, map_data, N, T, begin - first, n, c->vae_channels, host, &err);
            if (st == MC_OK)
                st = mc_var_scale_input(var, s, d_map, N, 1, var->acts.x, &err);
        }
        if (st == MC_OK)
            st = download_scale(be, out_data, var->acts.x, N, Lk, begin, n, C, host, &err);
    }
    if (d_map != NULL)
        be->ops->release(be, d_map);
    free(host);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (st != MC_OK) {
        Py_CLEAR(out);
        mcpy_raise(&err);
    }
done:
    Py_DECREF(labels);
    Py_DECREF(maps);
    return (PyObject *)out;
}


MCPY_PARSE_POLICY(var, "VAR")

/* One int32 array [depth, 2, N, n] per scale, every entry's rows 0..n-1:
 * the trace a policy overwrites where it runs a sublayer on fewer rows. */
static PyObject *new_trace(const mc_var_config *c, int64_t N, int n_scales) {
    PyObject *list = PyList_New(n_scales);
    for (int s = 0; list != NULL && s < n_scales; s++) {
        const int64_t n = c->patch_nums[s] * c->patch_nums[s];
        npy_intp dims[4] = {(npy_intp)c->depth, 2, (npy_intp)N, (npy_intp)n};
        PyArrayObject *arr = (PyArrayObject *)PyArray_SimpleNew(4, dims, NPY_INT32);
        if (arr == NULL) {
            Py_CLEAR(list);
            break;
        }
        int32_t *data = PyArray_DATA(arr);
        for (int64_t i = 0; i < c->depth * 2 * N * n; i++)
            data[i] = (int32_t)(i % n);
        PyList_SET_ITEM(list, s, (PyObject *)arr);
    }
    return list;
}

/* forward_scales(labels int32 [N], inputs float32 [N, L_k, C], cache=None, trace=False) -> (hidden
 * float32 [N, L_k, C], logits float32 [N, L_k, V]) and, with trace=True, a third item: per scale an
 * int32 array [depth, 2, N, n] of the rows each block's attention (0) and FFN (1) ran on for each
 * sequence (ascending, then -1). The KV-cached scale loop over scales 0..k on given inputs (L_k
 * covers whole scales from the first), each scale through the cache policy's transformer (cache: a
 * VAR policy's as_dict(), the N sequences being a run of N images without guidance; None: every
 * block on every row), attending to the scales before; hidden is the last block's output, logits the
 * head's. Inputs that cover a scale the policy skips are refused. */
static PyObject *var_forward_scales(PyVAR *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"labels", "inputs", "cache", "trace", NULL};
    PyObject *labels_obj, *inputs_obj, *cache_obj = Py_None;
    int want_trace = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|Op:forward_scales", keywords, &labels_obj, &inputs_obj,
                                     &cache_obj, &want_trace))
        return NULL;
    if (mcpy_require_loaded(self->var, "VAR model") < 0)
        return NULL;
    const mc_var_config *c = &self->var->config;
    void *policy_config;
    const mc_var_policy_ops *policy;
    if (parse_policy(cache_obj, c, &policy, &policy_config) < 0)
        return NULL;
    PyArrayObject *labels = sequence_labels(self, labels_obj);
    PyArrayObject *inputs = labels ? mcpy_array_arg(inputs_obj, NPY_FLOAT32, 3, "inputs") : NULL;
    if (inputs == NULL) {
        Py_XDECREF(labels);
        free_policy_config(policy, policy_config);
        return NULL;
    }
    const int64_t N = PyArray_DIM(labels, 0), Lk = PyArray_DIM(inputs, 1), C = c->width, V = c->vocab;
    const int n_scales = scales_of_tokens(c, Lk);
    PyArrayObject *hidden = NULL, *logits = NULL;
    PyObject *trace = NULL, *result = NULL;
    if (PyArray_DIM(inputs, 0) != N || PyArray_DIM(inputs, 2) != C) {
        PyErr_Format(PyExc_ValueError, "inputs must have shape [%lld, tokens, %lld] (one row per label, width)",
                     (long long)N, (long long)C);
        goto done;
    }
    if (n_scales == 0) {
        bad_token_count(c, "inputs", Lk, 0);
        goto done;
    }
    npy_intp hdims[3] = {(npy_intp)N, (npy_intp)Lk, (npy_intp)C}, ldims[3] = {(npy_intp)N, (npy_intp)Lk, (npy_intp)V};
    hidden = (PyArrayObject *)PyArray_SimpleNew(3, hdims, NPY_FLOAT32);
    logits = hidden ? (PyArrayObject *)PyArray_SimpleNew(3, ldims, NPY_FLOAT32) : NULL;
    if (logits == NULL || (want_trace && (trace = new_trace(c, N, n_scales)) == NULL) || claim(self) < 0)
        goto done;
    int32_t *trace_data[MC_VAR_MAX_SCALES] = {0};
    for (int s = 0; trace != NULL && s < n_scales; s++)
        trace_data[s] = PyArray_DATA((PyArrayObject *)PyList_GET_ITEM(trace, s));
    mc_err err = {0};
    mc_status st = MC_OK;
    mc_var *var = self->var;
    mc_backend *be = self->backend;
    const float *in = PyArray_DATA(inputs);
    float *h_out = PyArray_DATA(hidden), *l_out = PyArray_DATA(logits);
    const int64_t max_rows = largest_scale_rows(c, n_scales);
    mc_var_policy run_policy = {NULL, NULL};
    Py_BEGIN_ALLOW_THREADS
    const size_t host_bytes = (size_t)(N * max_rows * (C > V ? C : V)) * sizeof(float);
    float *host = malloc(host_bytes);
    if (host == NULL)
        st = mc_fail_nomem(&err, host_bytes, "the staging buffer of one scale");
    if (st == MC_OK)
        st = mc_var_reserve(var, N, max_rows, &err);
    if (st == MC_OK) {
        mc_var_run_shape shape = {.n_images = N, .cfg_on = 0, .n_seq = N};
        st = mc_var_policy_make(&run_policy, policy, var, policy_config, &shape, &err);
    }
    if (st == MC_OK)
        st = mc_var_condition(var, PyArray_DATA(labels), N, &err);
    for (int s = 0; s < n_scales && st == MC_OK; s++) {
        const int64_t pn = c->patch_nums[s], n = pn * pn, begin = c->scale_begin[s];
        if (!run_policy.ops->scale_plan(run_policy.state, s)) {
            st = mc_fail(&err, MC_ERR_VALUE, "forward_scales: the inputs cover scale %d, which cache policy '%s' "
                         "skips", s, run_policy.ops->schema.name);
            break;
        }
        st = upload_scale(be, var->acts.x, in, N, Lk, begin, n, C, host, &err);
        mc_var_scale scale = {.si = s, .n_scales = c->n_scales, .n_seq = N, .pn = pn, .tokens = n, .begin = begin,
                              .x = var->acts.x, .trace_rows = trace_data[s]};
        mc_var_transformer_stats stats = {0};
        if (st == MC_OK)
            st = run_policy.ops->transformer(run_policy.state, &scale, &stats, &err);
        if (st == MC_OK)
            st = download_scale(be, h_out, var->acts.x, N, Lk, begin, n, C, host, &err);
        if (st == MC_OK)
            st = mc_var_logits(var, var->acts.x, N, n, var->acts.logits, &err);
        if (st == MC_OK)
            st = download_scale(be, l_out, var->acts.logits, N, Lk, begin, n, V, host, &err);
    }
    mc_var_policy_free(&run_policy);
    free(host);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (st != MC_OK) {
        mcpy_raise(&err);
        goto done;
    }
    result = trace ? Py_BuildValue("(OOO)", hidden, logits, trace) : Py_BuildValue("(OO)", hidden, logits);
done:
    Py_XDECREF(hidden);
    Py_XDECREF(logits);
    Py_XDECREF(trace);
    Py_DECREF(labels);
    Py_DECREF(inputs);
    free_policy_config(policy, policy_config);
    return result;
}

/* VAR's tail of a step dict. */
static int var_tail_dict(PyObject *d, const void *opaque, void *ctx) {
    (void)ctx;
    const mc_var_step_tail *s = opaque;
    /* block_rows: [attention rows, FFN rows] per sequence of every block. */
    PyObject *blocks = PyList_New((Py_ssize_t)s->depth);
    for (int64_t i = 0; blocks != NULL && i < s->depth; i++) {
        const long long attn = s->block_rows ? (long long)s->block_rows[2 * i] : (long long)s->tokens;
        const long long ffn = s->block_rows ? (long long)s->block_rows[2 * i + 1] : (long long)s->tokens;
        PyObject *pair = Py_BuildValue("[LL]", attn, ffn);
        if (pair == NULL) {
            Py_CLEAR(blocks);
            break;
        }
        PyList_SET_ITEM(blocks, (Py_ssize_t)i, pair);
    }
    if (blocks == NULL)
        return -1;
    PyObject *tail = Py_BuildValue("{s:i,s:L,s:L,s:O,s:L,s:L,s:L,s:d,s:N}", "scale", s->scale, "patch",
                                   (long long)s->patch, "tokens", (long long)s->tokens, "skipped",
                                   s->skipped ? Py_True : Py_False, "sequences", (long long)s->sequences,
                                   "kv_rows", (long long)s->kv_rows, "sublayer_rows", (long long)s->sublayer_rows,
                                   "guidance", s->guidance, "block_rows", blocks);
    int rc = tail == NULL ? -1 : PyDict_Update(d, tail);
    Py_XDECREF(tail);
    return rc;
}


/* generate(labels, vqvae, cfg=1.5, top_k=900, top_p=0.96, more_smooth=False, seed=0, first_index=0,
 * cache=None, callback=None) -> ((tokens int32 [n, L], f_hat float32 [n, side, side, Cvae]), steps) */
static PyObject *var_generate(PyVAR *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"labels", "vqvae", "cfg", "top_k", "top_p", "more_smooth", "seed", "first_index",
                               "cache", "callback", NULL};
    PyObject *labels_obj, *vqvae_obj, *cache_obj = Py_None, *callback = Py_None;
    double cfg = 1.5, top_p = 0.96;
    long long top_k = 900;
    int more_smooth = 0;
    unsigned long long seed = 0, first_index = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|dLdpKKOO:generate", keywords, &labels_obj, &vqvae_obj, &cfg,
                                     &top_k, &top_p, &more_smooth, &seed, &first_index, &cache_obj, &callback))
        return NULL;
    if (mcpy_require_loaded(self->var, "VAR model") < 0)
        return NULL;
    if (first_index > UINT32_MAX)
        return PyErr_Format(PyExc_ValueError, "first_index must be < 2**32");
    if (callback != Py_None && !PyCallable_Check(callback))
        return PyErr_Format(PyExc_TypeError, "callback must be None or callable");
    mc_vqvae *vq;
    mc_backend *vq_backend;
    PyThread_type_lock vq_lock;
    if (mcpy_vqvae_borrow(vqvae_obj, &vq, &vq_backend, &vq_lock) < 0)
        return NULL;
    const mc_var_config *c = &self->var->config;
    void *policy_config;
    const mc_var_policy_ops *policy;
    if (parse_policy(cache_obj, c, &policy, &policy_config) < 0)
        return NULL;
    PyArrayObject *labels = mcpy_array_arg(labels_obj, NPY_INT32, 1, "labels");
    if (labels == NULL) {
        free_policy_config(policy, policy_config);
        return NULL;
    }
    const int64_t n = PyArray_DIM(labels, 0), side = c->patch_nums[c->n_scales - 1];
    npy_intp tdims[2] = {(npy_intp)n, (npy_intp)c->tokens};
    npy_intp fdims[4] = {(npy_intp)n, (npy_intp)side, (npy_intp)side, (npy_intp)c->vae_channels};
    PyArrayObject *tokens = (PyArrayObject *)PyArray_SimpleNew(2, tdims, NPY_INT32);
    PyArrayObject *f_hat = tokens ? (PyArrayObject *)PyArray_SimpleNew(4, fdims, NPY_FLOAT32) : NULL;
    mc_var_generate_args gen = {
        .labels = PyArray_DATA(labels), .n_images = n, .cfg = cfg, .top_k = top_k, .top_p = top_p,
        .more_smooth = more_smooth, .seed = (uint64_t)seed, .first_index = (uint32_t)first_index,
        .policy = policy, .policy_config = policy_config,
    };
    mc_var_run *run = NULL;
    mc_err err = {0};
    PyObject *step_list = NULL;
    if (f_hat != NULL && mc_var_run_new(self->var, vq, vq_backend, &gen, PyArray_DATA(tokens), PyArray_DATA(f_hat),
                                        &run, &err) != MC_OK)
        mcpy_raise(&err);
    if (run != NULL && claim(self) == 0) {
        if (PyThread_acquire_lock(vq_lock, NOWAIT_LOCK)) {
            step_list = mcpy_generate(&mc_var_generator, run, self->backend, callback, var_tail_dict, NULL);
            PyThread_release_lock(vq_lock);
        } else {
            PyErr_SetString(PyExc_RuntimeError, "the VQVAE is running a call in another thread");
        }
        self->busy = 0;
    }
    mc_var_run_free(run);
    Py_DECREF(labels);
    free_policy_config(policy, policy_config);
    if (step_list == NULL) {
        Py_XDECREF(tokens);
        Py_XDECREF(f_hat);
        return NULL;
    }
    return Py_BuildValue("((NN)N)", tokens, f_hat, step_list);
}

static PyObject *var_get_config(PyVAR *self, void *closure) {
    (void)closure;
    if (self->var == NULL)
        Py_RETURN_NONE;
    const mc_var_config *c = &self->var->config;
    PyObject *patch_nums = mcpy_int_tuple(c->patch_nums, c->n_scales);
    if (patch_nums == NULL)
        return NULL;
    return Py_BuildValue("{s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:N,s:L,s:i}", "depth", (long long)c->depth, "width",
                         (long long)c->width, "heads", (long long)c->heads, "head_dim", (long long)c->head_dim,
                         "ffn_hidden", (long long)c->ffn_hidden, "vocab", (long long)c->vocab, "vae_channels",
                         (long long)c->vae_channels, "num_classes", (long long)c->num_classes, "patch_nums",
                         patch_nums, "tokens", (long long)c->tokens, "n_scales", c->n_scales);
}

static PyObject *var_get_weight_bytes(PyVAR *self, void *closure) {
    (void)closure;
    return PyLong_FromSize_t(self->var ? self->var->weights.bytes : 0);
}

static PyObject *var_get_num_params(PyVAR *self, void *closure) {
    (void)closure;
    return PyLong_FromLongLong(self->var ? (long long)mc_var_num_params(self->var) : 0);
}

static PyObject *var_get_device(PyVAR *self, void *closure) {
    (void)closure;
    if (self->backend == NULL)
        Py_RETURN_NONE;
    return PyUnicode_FromString(self->backend->ops->name);
}

static PyMethodDef var_methods[] = {
    {"generate", (PyCFunction)(void (*)(void))var_generate, METH_VARARGS | METH_KEYWORDS,
     "generate(labels int32 [n] (-1 = unconditional), vqvae (a marcache._C.VQVAE), cfg=1.5, top_k=900, "
     "top_p=0.96, more_smooth=False, seed=0, first_index=0, cache=None, callback=None) -> ((tokens int32 [n, L], "
     "f_hat float32 [n, side, side, Cvae]), list of per-scale dicts)"},
    {"scale_inputs", (PyCFunction)var_scale_inputs, METH_VARARGS,
     "scale_inputs(labels int32 [N] (num_classes = null class), next_maps float32 [N, T, Cvae]) -> inputs "
     "float32 [N, first + T, C]: the input embedding of the scales whose tokens next_maps covers (T = the "
     "tokens of scales 1..k; scale 0 comes from the label)"},
    {"forward_scales", (PyCFunction)(void (*)(void))var_forward_scales, METH_VARARGS | METH_KEYWORDS,
     "forward_scales(labels int32 [N], inputs float32 [N, L_k, C], cache=None, trace=False) -> (hidden [N, L_k, C], "
     "logits [N, L_k, V]) (trace=True adds per scale int32 [depth, 2, N, n]: the rows each sublayer ran on): the "
     "KV-cached scale loop over scales 0..k on the given inputs through the cache policy's transformer"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef var_getset[] = {
    MCPY_GETTER_ENTRY(var, config, "hyper-parameters read from the checkpoint"),
    MCPY_GETTER_ENTRY(var, num_params, "number of parameters (buffers excluded)"),
    MCPY_GETTER_ENTRY(var, weight_bytes,
                      "bytes of backend memory the loaded weights and load-time constants hold (on the CPU, "
                      "fp32 Linear weights also have column panels of about their size, not counted here: "
                      "build_info()['smallrow_panels'])"),
    MCPY_BACKEND_COUNTER_GETSETS,
    MCPY_GETTER_ENTRY(var, device, "the backend the model runs on"),
    {NULL, NULL, NULL, NULL, NULL},
};

MCPY_MODEL_TYPE(var, PyVAR, "VAR",
                "VAR(path, device='cpu', dtype='fp32', threads=0): a VAR transformer (var_fastvar.md Part A)");

int mcpy_var_init(PyObject *module) { return mcpy_add_type(module, &var_type, "VAR", NULL); }

/* marcache._C.MAR: a loaded MAR model and its sampler. Arguments are checked
 * here and in marcache/ (the public API); compute releases the GIL and polls
 * for Ctrl-C between AR steps. */
#include "py_model.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../runtime/mar_workspace.h"
#include "../runtime/mar_sampler.h"
#include "py_generate.h"

typedef struct {
    MCPY_MODEL_HEAD
    mc_mar *mar;
    mc_diffusion diffusion;
    int busy; /* set while the GIL is released: one call at a time */
} PyMAR;

MCPY_MODEL_LIFECYCLE(mar, PyMAR, mar, mc_mar_free)

/* What mcpy_load_model's loader gets for a MAR: the head count and the
 * diffusion tables it sets up first, and where the model goes. */
typedef struct mar_loading {
    int heads, diffusion_steps;
    mc_diffusion *diffusion;
    mc_mar *mar;
} mar_loading;

static mc_status load_mar(mc_backend *backend, mc_st_file *file, void *model, mc_err *err) {
    mar_loading *request = model;
    mc_status st = mc_diffusion_init(request->diffusion, request->diffusion_steps, err);
    if (st == MC_OK)
        st = mc_mar_load(backend, file, request->heads, request->diffusion->timesteps, request->diffusion->n_steps,
                         &request->mar, err);
    return st;
}

static int mar_init(PyMAR *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"path", "heads", "diffusion_steps", "threads", "device", "dtype", NULL};
    PyObject *path_obj = NULL;
    int heads = 0, diffusion_steps = 100, threads = 0;
    const char *device = "cpu", *dtype = "fp32";
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O&|iiiss", keywords, PyUnicode_FSConverter, &path_obj,
                                     &heads, &diffusion_steps, &threads, &device, &dtype))
        return -1;
    mc_wtype wtype;
    if (mcpy_parse_wtype(dtype, &wtype) < 0) {
        Py_DECREF(path_obj);
        return -1;
    }
    mar_loading request = {heads, diffusion_steps, &self->diffusion, NULL};
    /* (__init__ again on a live object: the new device and dtype apply.) */
    if (mcpy_model_load((mcpy_model_object *)self, mar_release_model, 0, path_obj, device, threads, "threads", wtype,
                        load_mar, &request) < 0)
        return -1;
    self->mar = request.mar;
    return 0;
}

static int claim(PyMAR *self) {
    if (mcpy_require_loaded(self->mar, "MAR model") < 0)
        return -1;
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError,
                        "this MAR model is already running a call in another thread");
        return -1;
    }
    self->busy = 1;
    return 0;
}

/* {"seconds": float or None, "flops": float, "weight_bytes": float} */
static PyObject *phase_dict(const mc_phase_meter *m, int timed) {
    PyObject *seconds = timed ? PyFloat_FromDouble(m->seconds) : Py_None;
    if (seconds == NULL)
        return NULL;
    PyObject *d = Py_BuildValue("{s:O,s:d,s:d}", "seconds", seconds, "flops", m->flops, "weight_bytes",
                                m->weight_bytes);
    if (timed)
        Py_DECREF(seconds);
    return d;
}

/* MAR's tail of a step dict; with trace_rows, the kept (active) rows of a
 * cached step as int32 [sequences, rows]. */
static int mar_tail_dict(PyObject *d, const void *opaque, void *trace_rows) {
    const mc_mar_step_tail *s = opaque;
    PyObject *tail = Py_BuildValue("{s:L,s:L,s:d,s:L,s:L,s:L,s:L,s:L,s:L,s:O,s:i}", "masked_before",
                                   (long long)s->masked_before, "predicted", (long long)s->predicted, "cfg",
                                   (double)s->cfg, "encoder_rows", (long long)s->encoder_rows, "decoder_rows",
                                   (long long)s->decoder_rows, "decoder_kept_rows", (long long)s->decoder_kept_rows,
                                   "head_rows", (long long)s->head_rows, "head_evaluations",
                                   (long long)s->head_evaluations, "head_cached_evaluations",
                                   (long long)s->head_cached_evaluations, "head_graph",
                                   s->head_graph ? Py_True : Py_False, "diffusion_steps", s->diffusion_steps);
    int rc = tail == NULL ? -1 : PyDict_Update(d, tail);
    Py_XDECREF(tail);
    if (rc == 0) {
        PyObject *enc = phase_dict(&s->encoder, s->phases_timed), *dec = phase_dict(&s->decoder, s->phases_timed),
                 *head = phase_dict(&s->head, s->phases_timed);
        PyObject *phases = enc && dec && head ? Py_BuildValue("{s:O,s:O,s:O}", "encoder", enc, "decoder", dec,
                                                              "head", head)
                                              : NULL;
        rc = phases == NULL || PyDict_SetItemString(d, "phases", phases) < 0 ? -1 : 0;
        Py_XDECREF(enc);
        Py_XDECREF(dec);
        Py_XDECREF(head);
        Py_XDECREF(phases);
    }
    if (rc == 0 && *(const int *)trace_rows && s->kept_rows != NULL) {
        npy_intp dims[2] = {(npy_intp)s->kept_sequences, (npy_intp)s->kept_per_sequence};
        PyObject *rows = PyArray_SimpleNew(2, dims, NPY_INT32);
        if (rows != NULL)
            memcpy(PyArray_DATA((PyArrayObject *)rows), s->kept_rows, (size_t)(dims[0] * dims[1]) * sizeof(int32_t));
        rc = rows == NULL || PyDict_SetItemString(d, "kept_rows", rows) < 0 ? -1 : 0;
        Py_XDECREF(rows);
    }
    return rc;
}

MCPY_PARSE_POLICY(mar, "MAR")

static PyObject *mar_generate(PyMAR *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"labels", "steps", "cfg", "cfg_schedule", "temperature", "seed",
                               "first_index", "callback", "cache", "trace_rows", NULL};
    PyObject *labels_obj, *callback = Py_None, *cache_obj = Py_None;
    int steps = 64, trace_rows = 0;
    double cfg = 1.0, temperature = 1.0;
    const char *schedule_name = "linear";
    unsigned long long seed = 0, first_index = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|idsdKKOOp", keywords, &labels_obj, &steps, &cfg,
                                     &schedule_name, &temperature, &seed, &first_index, &callback,
                                     &cache_obj, &trace_rows))
        return NULL;
    if (mcpy_require_loaded(self->mar, "MAR model") < 0)
        return NULL;
    static const char *const schedule_names[] = {"linear", "constant", NULL};
    static const mc_cfg_schedule schedules[] = {MC_CFG_LINEAR, MC_CFG_CONSTANT};
    const int schedule_index = mcpy_choice(schedule_name, schedule_names, "cfg_schedule");
    if (schedule_index < 0)
        return NULL;
    const mc_cfg_schedule schedule = schedules[schedule_index];
    if (first_index > UINT32_MAX)
        return PyErr_Format(PyExc_ValueError, "first_index must be < 2**32");
    void *policy_config;
    const mc_mar_policy_ops *policy;
    if (parse_policy(cache_obj, &self->mar->config, &policy, &policy_config) < 0)
        return NULL;
    PyArrayObject *labels = mcpy_array_arg(labels_obj, NPY_INT32, 1, "labels");
    if (labels == NULL) {
        free_policy_config(policy, policy_config);
        return NULL;
    }
    const int64_t n = PyArray_DIM(labels, 0);
    const int32_t *label_data = PyArray_DATA(labels);
    for (int64_t i = 0; i < n; i++)
        if (label_data[i] < -1 || label_data[i] >= self->mar->config.num_classes) {
            Py_DECREF(labels);
            free_policy_config(policy, policy_config);
            return PyErr_Format(PyExc_ValueError, "label %d at index %lld is outside 0..%lld (or -1 for unconditional)",
                                label_data[i], (long long)i, (long long)self->mar->config.num_classes - 1);
        }
    const mc_mar_config *c = &self->mar->config;
    npy_intp dims[3] = {(npy_intp)n, (npy_intp)c->seq_len, (npy_intp)c->token_channels};
    PyArrayObject *tokens = (PyArrayObject *)PyArray_SimpleNew(3, dims, NPY_FLOAT32);
    mc_mar_generate_args gen = {
        .labels = label_data, .n_images = n, .num_steps = steps, .cfg = cfg, .cfg_schedule = schedule,
        .temperature = temperature, .seed = (uint64_t)seed, .first_index = (uint32_t)first_index,
        .policy = policy, .policy_config = policy_config,
    };
    mc_mar_run *run = NULL;
    mc_err err = {0};
    PyObject *step_list = NULL;
    if (tokens != NULL && mc_mar_run_new(self->mar, &self->diffusion, &gen, PyArray_DATA(tokens), &run, &err) != MC_OK)
        mcpy_raise(&err);
    if (run != NULL && claim(self) == 0) {
        step_list = mcpy_generate(&mc_mar_generator, run, self->backend, callback, mar_tail_dict, &trace_rows);
        self->busy = 0;
    }
    mc_mar_run_free(run);
    Py_DECREF(labels);
    free_policy_config(policy, policy_config);
    if (step_list == NULL) {
        Py_XDECREF(tokens);
        return NULL;
    }
    return Py_BuildValue("(NN)", tokens, step_list);
}

/* transformer(tokens [B', S, C], mask [B', S] (nonzero = unknown), labels [B'] (-1 = fake_latent)) -> z [B', S, Dd] */
static PyObject *mar_transformer(PyMAR *self, PyObject *args) {
    PyObject *tok_obj, *mask_obj, *lab_obj;
    if (!PyArg_ParseTuple(args, "OOO", &tok_obj, &mask_obj, &lab_obj))
        return NULL;
    if (mcpy_require_loaded(self->mar, "MAR model") < 0)
        return NULL;
    const mc_mar_config *c = &self->mar->config;
    PyArrayObject *arrays[3];
    const mcpy_array_spec specs[3] = {{tok_obj, NPY_FLOAT32, 3, "tokens"}, {mask_obj, NPY_UINT8, 2, "mask"},
                                      {lab_obj, NPY_INT32, 1, "labels"}};
    if (mcpy_arrays_arg(3, specs, arrays) < 0)
        return NULL;
    PyArrayObject *tok = arrays[0], *mask = arrays[1], *lab = arrays[2];
    PyObject *result = NULL;
    int32_t *known = NULL, *out_rows = NULL;
    const int64_t B = PyArray_DIM(tok, 0), S = c->seq_len;
    if (PyArray_DIM(tok, 1) != S || PyArray_DIM(tok, 2) != c->token_channels || PyArray_DIM(mask, 0) != B ||
        PyArray_DIM(mask, 1) != S || PyArray_DIM(lab, 0) != B) {
        PyErr_Format(PyExc_ValueError, "expected tokens [B, %lld, %lld], mask [B, %lld], labels [B]",
                     (long long)S, (long long)c->token_channels, (long long)S);
        goto done;
    }
    const uint8_t *m = PyArray_DATA(mask);
    int64_t K = -1;
    known = PyMem_Malloc((size_t)(B * S + 1) * sizeof(int32_t));
    out_rows = PyMem_Malloc((size_t)(B * S + 1) * sizeof(int32_t));
    if (!known || !out_rows) {
        mcpy_no_memory("the known and output row lists", 2 * (size_t)(B * S + 1) * sizeof(int32_t));
        goto done;
    }
    for (int64_t b = 0; b < B; b++) {
        int64_t k = 0;
        for (int64_t p = 0; p < S; p++)
            if (!m[b * S + p])
                k++;
        if (K >= 0 && k != K) {
            PyErr_Format(PyExc_ValueError, "every row must have the same number of known tokens (row 0: %lld, row %lld: %lld)",
                         (long long)K, (long long)b, (long long)k);
            goto done;
        }
        K = k;
    }
    for (int64_t b = 0; b < B; b++) {
        int64_t k = 0;
        for (int64_t p = 0; p < S; p++)
            if (!m[b * S + p])
                known[b * K + k++] = (int32_t)p;
    }
    for (int64_t i = 0; i < B * S; i++)
        out_rows[i] = (int32_t)i;
    const int32_t *labels = PyArray_DATA(lab);
    for (int64_t b = 0; b < B; b++)
        if (labels[b] < -1 || labels[b] >= c->num_classes) {
            PyErr_Format(PyExc_ValueError, "label %d outside 0..%lld", labels[b], (long long)c->num_classes - 1);
            goto done;
        }
    npy_intp dims[3] = {(npy_intp)B, (npy_intp)S, (npy_intp)c->dec_width};
    PyArrayObject *z = (PyArrayObject *)PyArray_SimpleNew(3, dims, NPY_FLOAT32);
    if (z == NULL || claim(self) < 0) {
        Py_XDECREF(z);
        goto done;
    }
    mc_err err = {0};
    mc_status st;
    mc_mar *mar = self->mar;
    mc_backend *be = self->backend;
    Py_BEGIN_ALLOW_THREADS
    mc_mar_runtime_acts *acts = mc_mar_runtime_acts_of(mar, &err);
    float *d_tokens = acts ? mc_buffer_floats(be, &acts->sampler.tokens, (size_t)(B * S * c->token_channels), "sampler.tokens", &err) : NULL;
    float *d_class = d_tokens ? mc_buffer_floats(be, &acts->sampler.class_vectors, (size_t)(B * c->width), "sampler.class_vectors", &err) : NULL;
    float *d_z = d_class ? mc_buffer_floats(be, &acts->sampler.z, (size_t)(B * S * c->dec_width), "sampler.z", &err) : NULL;
    st = d_z ? MC_OK : err.status;
    if (st == MC_OK)
        st = be->ops->upload(be, d_tokens, PyArray_DATA(tok), (size_t)(B * S * c->token_channels) * sizeof(float), &err);
    if (st == MC_OK)
        st = mc_mar_class_vectors(mar, labels, B, d_class, &err);
    if (st == MC_OK) {
        mc_mar_batch batch = {.n_seq = B, .n_known = K, .tokens = d_tokens, .known_pos = known, .class_vectors = d_class};
        st = mc_mar_transformer(mar, &batch, out_rows, B * S, d_z, &err);
    }
    if (st == MC_OK)
        st = be->ops->download(be, PyArray_DATA(z), d_z, (size_t)(B * S * c->dec_width) * sizeof(float), &err);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    result = mcpy_result(st, &err, (PyObject *)z);
done:
    PyMem_Free(known);
    PyMem_Free(out_rows);
    mcpy_arrays_release(3, arrays);
    return result;
}

/* head(x [N, C], z [N, Dd], timestep_index) -> net output [N, 2C] (no CFG). */
static PyObject *mar_head(PyMAR *self, PyObject *args) {
    PyObject *x_obj, *z_obj;
    int t_index;
    if (!PyArg_ParseTuple(args, "OOi", &x_obj, &z_obj, &t_index))
        return NULL;
    if (mcpy_require_loaded(self->mar, "MAR model") < 0)
        return NULL;
    const mc_mar_config *c = &self->mar->config;
    if (t_index < 0 || t_index >= self->diffusion.n_steps)
        return PyErr_Format(PyExc_ValueError, "timestep index must be in 0..%d", self->diffusion.n_steps - 1);
    PyArrayObject *arrays[2];
    const mcpy_array_spec specs[2] = {{x_obj, NPY_FLOAT32, 2, "x"}, {z_obj, NPY_FLOAT32, 2, "z"}};
    if (mcpy_arrays_arg(2, specs, arrays) < 0)
        return NULL;
    PyArrayObject *x = arrays[0], *z = arrays[1], *out = NULL;
    const int64_t N = PyArray_DIM(x, 0);
    if (PyArray_DIM(x, 1) != c->token_channels || PyArray_DIM(z, 0) != N || PyArray_DIM(z, 1) != c->dec_width) {
        PyErr_Format(PyExc_ValueError, "expected x [N, %lld] and z [N, %lld]", (long long)c->token_channels,
                     (long long)c->dec_width);
        mcpy_arrays_release(2, arrays);
        return NULL;
    }
    npy_intp dims[2] = {(npy_intp)N, (npy_intp)(2 * c->token_channels)};
    out = (PyArrayObject *)PyArray_SimpleNew(2, dims, NPY_FLOAT32);
    if (out == NULL || claim(self) < 0) {
        Py_XDECREF(out);
        mcpy_arrays_release(2, arrays);
        return NULL;
    }
    mc_err err = {0};
    mc_status st;
    mc_mar *mar = self->mar;
    mc_backend *be = self->backend;
    const int64_t W = c->head_width, C = c->token_channels;
    Py_BEGIN_ALLOW_THREADS
    mc_mar_runtime_acts *acts = mc_mar_runtime_acts_of(mar, &err);
    float *d_x = acts ? mc_buffer_floats(be, &acts->sampler.state, (size_t)(N * C), "sampler.state", &err) : NULL;
    float *d_z = d_x ? mc_buffer_floats(be, &acts->sampler.z, (size_t)(N * c->dec_width), "sampler.z", &err) : NULL;
    float *d_c = d_z ? mc_buffer_floats(be, &acts->sampler.cond_emb, (size_t)(N * W), "sampler.cond_emb", &err) : NULL;
    float *d_out = d_c ? mc_buffer_floats(be, &acts->sampler.head_out, (size_t)(N * 2 * C), "sampler.head_out", &err) : NULL;
    st = d_out ? MC_OK : err.status;
    if (st == MC_OK)
        st = be->ops->upload(be, d_x, PyArray_DATA(x), (size_t)(N * C) * sizeof(float), &err);
    if (st == MC_OK)
        st = be->ops->upload(be, d_z, PyArray_DATA(z), (size_t)(N * c->dec_width) * sizeof(float), &err);
    if (st == MC_OK)
        st = mc_mar_head_cond(mar, d_z, N, d_c, &err);
    if (st == MC_OK)
        st = mc_mar_head_forward(mar, d_x, N, 0, d_c, mc_mar_time_embedding(mar, self->diffusion.timesteps[t_index]),
                                 d_out, &err);
    if (st == MC_OK)
        st = be->ops->download(be, PyArray_DATA(out), d_out, (size_t)(N * 2 * C) * sizeof(float), &err);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    mcpy_arrays_release(2, arrays);
    return mcpy_result(st, &err, (PyObject *)out);
}

/* head_sample(z [n or 2n, Dd], images uint32 [n], positions uint32 [n], cfg, temperature, seed) -> x [n, C] */
static PyObject *mar_head_sample(PyMAR *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"z", "images", "positions", "cfg", "temperature", "seed", NULL};
    PyObject *z_obj, *img_obj, *pos_obj;
    double cfg = 1.0, temperature = 1.0;
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|ddK", keywords, &z_obj, &img_obj, &pos_obj, &cfg,
                                     &temperature, &seed))
        return NULL;
    if (mcpy_require_loaded(self->mar, "MAR model") < 0)
        return NULL;
    const mc_mar_config *c = &self->mar->config;
    PyArrayObject *arrays[3];
    const mcpy_array_spec specs[3] = {{z_obj, NPY_FLOAT32, 2, "z"}, {img_obj, NPY_UINT32, 1, "images"},
                                      {pos_obj, NPY_UINT32, 1, "positions"}};
    if (mcpy_arrays_arg(3, specs, arrays) < 0)
        return NULL;
    PyArrayObject *z = arrays[0], *img = arrays[1], *pos = arrays[2];
    PyObject *result = NULL;
    const int cfg_on = cfg != 1.0;
    const int64_t n = PyArray_DIM(img, 0), zrows = PyArray_DIM(z, 0);
    if (PyArray_DIM(pos, 0) != n || zrows != (cfg_on ? 2 * n : n) || PyArray_DIM(z, 1) != c->dec_width) {
        PyErr_Format(PyExc_ValueError, "expected images [n], positions [n] and z [%s, %lld]", cfg_on ? "2n" : "n",
                     (long long)c->dec_width);
        goto done;
    }
    npy_intp dims[2] = {(npy_intp)n, (npy_intp)c->token_channels};
    PyArrayObject *x = (PyArrayObject *)PyArray_SimpleNew(2, dims, NPY_FLOAT32);
    if (x == NULL || claim(self) < 0) {
        Py_XDECREF(x);
        goto done;
    }
    mc_err err = {0};
    mc_status st;
    mc_backend *be = self->backend;
    Py_BEGIN_ALLOW_THREADS
    mc_mar_runtime_acts *acts = mc_mar_runtime_acts_of(self->mar, &err);
    float *d_z = acts ? mc_buffer_floats(be, &acts->sampler.z, (size_t)(zrows * c->dec_width), "sampler.z", &err) : NULL;
    st = d_z ? MC_OK : err.status;
    if (st == MC_OK)
        st = be->ops->upload(be, d_z, PyArray_DATA(z), (size_t)(zrows * c->dec_width) * sizeof(float), &err);
    if (st == MC_OK)
        st = mc_mar_head_sample(self->mar, &self->diffusion, d_z, n, cfg_on, (float)cfg, temperature, (uint64_t)seed,
                                PyArray_DATA(img), PyArray_DATA(pos), PyArray_DATA(x), &err);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    result = mcpy_result(st, &err, (PyObject *)x);
done:
    mcpy_arrays_release(3, arrays);
    return result;
}

static PyObject *mar_get_config(PyMAR *self, void *closure) {
    (void)closure;
    if (self->mar == NULL)
        Py_RETURN_NONE;
    const mc_mar_config *c = &self->mar->config;
    return Py_BuildValue("{s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:i}",
                         "width", (long long)c->width, "depth", (long long)c->enc_depth, "heads",
                         (long long)c->enc_heads, "decoder_width", (long long)c->dec_width,
                         "decoder_depth", (long long)c->dec_depth, "decoder_heads", (long long)c->dec_heads,
                         "mlp_hidden", (long long)c->mlp_hidden, "decoder_mlp_hidden",
                         (long long)c->dec_mlp_hidden, "head_width", (long long)c->head_width,
                         "head_depth", (long long)c->head_depth, "seq_len", (long long)c->seq_len,
                         "buffer_size", (long long)c->buffer_size, "token_channels",
                         (long long)c->token_channels, "num_classes", (long long)c->num_classes,
                         "diffusion_steps", self->diffusion.n_steps);
}

static PyObject *mar_get_num_params(PyMAR *self, void *closure) {
    (void)closure;
    return PyLong_FromLongLong(self->mar ? (long long)mc_mar_num_params(self->mar) : 0);
}

static PyObject *mar_get_weight_bytes(PyMAR *self, void *closure) {
    (void)closure;
    return PyLong_FromSize_t(self->mar ? self->mar->weights.bytes : 0);
}

static PyObject *mar_get_timesteps(PyMAR *self, void *closure) {
    (void)closure;
    PyObject *list = PyList_New(self->diffusion.n_steps);
    for (int i = 0; list && i < self->diffusion.n_steps; i++)
        PyList_SET_ITEM(list, i, PyLong_FromLong(self->diffusion.timesteps[i]));
    return list;
}

static PyMethodDef mar_methods[] = {
    {"generate", (PyCFunction)(void (*)(void))mar_generate, METH_VARARGS | METH_KEYWORDS,
     "generate(labels int32 [n] (-1 = unconditional), steps, cfg, cfg_schedule, temperature, seed, "
     "first_index, callback) -> (tokens float32 [n, S, C], list of per-step dicts)"},
    {"transformer", (PyCFunction)mar_transformer, METH_VARARGS,
     "transformer(tokens [B, S, C], mask uint8 [B, S] (1 = unknown), labels int32 [B] (-1 = fake_latent)) -> z [B, S, Dd]"},
    {"head", (PyCFunction)mar_head, METH_VARARGS,
     "head(x [N, C], z [N, Dd], timestep_index) -> net output [N, 2C] at timesteps[timestep_index]"},
    {"head_sample", (PyCFunction)(void (*)(void))mar_head_sample, METH_VARARGS | METH_KEYWORDS,
     "head_sample(z, images, positions, cfg=1.0, temperature=1.0, seed=0) -> x [n, C]"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef mar_getset[] = {
    MCPY_GETTER_ENTRY(mar, config, "hyper-parameters read from the checkpoint"),
    MCPY_GETTER_ENTRY(mar, num_params, "number of parameters"),
    MCPY_GETTER_ENTRY(mar, weight_bytes,
                      "bytes of backend memory the loaded weights and load-time constants hold (on the CPU, "
                      "fp32 Linear weights also have column panels of about their size, not counted here: "
                      "build_info()['smallrow_panels'])"),
    MCPY_BACKEND_COUNTER_GETSETS,
    MCPY_GETTER_ENTRY(mar, timesteps, "original diffusion timesteps tau_j seen by the head"),
    {NULL, NULL, NULL, NULL, NULL},
};

MCPY_MODEL_TYPE(mar, PyMAR, "MAR",
                "MAR(path, heads=0, diffusion_steps=100, threads=0): a MAR model on the CPU backend");

/* diffusion_tables(steps, clip=999) -> dict of the engine's respaced float64
 * tables (runtime/diffusion.c), for tests against a float64 reference. */
static PyObject *diffusion_tables(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *keywords[] = {"steps", "clip", NULL};
    int steps = 0, clip = MC_DIFFUSION_BASE_STEPS - 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "i|i", keywords, &steps, &clip))
        return NULL;
    mc_diffusion *d = malloc(sizeof *d);
    if (d == NULL)
        return mcpy_no_memory("diffusion tables", sizeof *d);
    mc_err err = {0};
    if (mc_diffusion_init_clipped(d, steps, clip, &err) != MC_OK) {
        free(d);
        return mcpy_raise(&err);
    }
    const struct {
        const char *name;
        const double *values;
    } tables[] = {
        {"betas", d->betas},
        {"alphas_cumprod", d->alphas_cumprod},
        {"sqrt_recip_alphas_cumprod", d->sqrt_recip_alphas_cumprod},
        {"sqrt_recipm1_alphas_cumprod", d->sqrt_recipm1_alphas_cumprod},
        {"posterior_variance", d->posterior_variance},
        {"posterior_log_variance_clipped", d->posterior_log_variance_clipped},
        {"posterior_mean_coef1", d->posterior_mean_coef1},
        {"posterior_mean_coef2", d->posterior_mean_coef2},
        {"log_betas", d->log_betas},
    };
    npy_intp n = d->n_steps;
    PyObject *out = PyDict_New();
    PyObject *tau = out ? PyArray_SimpleNew(1, &n, NPY_INT32) : NULL;
    int ok = tau != NULL;
    if (ok) {
        memcpy(PyArray_DATA((PyArrayObject *)tau), d->timesteps, (size_t)n * sizeof(int32_t));
        ok = PyDict_SetItemString(out, "timesteps", tau) == 0;
    }
    Py_XDECREF(tau);
    for (size_t i = 0; ok && i < sizeof tables / sizeof tables[0]; i++) {
        PyObject *arr = PyArray_SimpleNew(1, &n, NPY_FLOAT64);
        ok = arr != NULL;
        if (ok) {
            memcpy(PyArray_DATA((PyArrayObject *)arr), tables[i].values, (size_t)n * sizeof(double));
            ok = PyDict_SetItemString(out, tables[i].name, arr) == 0;
        }
        Py_XDECREF(arr);
    }
    free(d);
    if (!ok) {
        Py_XDECREF(out);
        return NULL;
    }
    return out;
}

static PyMethodDef mar_module_methods[] = {
    {"diffusion_tables", (PyCFunction)(void (*)(void))diffusion_tables, METH_VARARGS | METH_KEYWORDS,
     "diffusion_tables(steps, clip=999): the engine's respaced DDPM tables (float64) of `steps` steps, kept "
     "timesteps clipped at `clip` (DiSA)"},
    {NULL, NULL, 0, NULL},
};

int mcpy_mar_init(PyObject *module) { return mcpy_add_type(module, &mar_type, "MAR", mar_module_methods); }

#include "py_config.h"

#include <math.h>
#include <string.h>

static const mc_config_field *find_field(const mc_config_field *fields, const char *name) {
    for (const mc_config_field *f = fields; f->name != NULL; f++)
        if (strcmp(f->name, name) == 0)
            return f;
    return NULL;
}

static int read_number(PyObject *value, const char *what, const char *name, int integer, double lo, double hi,
                       double *out) {
    if (integer ? !PyLong_Check(value) : !(PyLong_Check(value) || PyFloat_Check(value))) {
        PyErr_Format(PyExc_TypeError, "%s: field '%s' must be %s, got %R", what, name,
                     integer ? "an integer" : "a number", value);
        return -1;
    }
    double x;
    if (integer) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (v == -1 && PyErr_Occurred())
            return -1;
        x = overflow ? (overflow > 0 ? INFINITY : -INFINITY) : (double)v;
    } else {
        x = PyFloat_AsDouble(value);
        if (x == -1.0 && PyErr_Occurred())
            return -1;
    }
    if (!(x >= lo && x <= hi)) {
        PyErr_Format(PyExc_ValueError, "%s: field '%s' = %R is outside [%g, %g]", what, name, value, lo, hi);
        return -1;
    }
    *out = x;
    return 0;
}

static int read_choice(PyObject *value, const char *what, const mc_config_field *f, int *out) {
    const char *text = PyUnicode_Check(value) ? PyUnicode_AsUTF8(value) : NULL;
    if (text == NULL) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: field '%s' must be one of '%s', got %R", what, f->name, f->choices,
                     value);
        return -1;
    }
    const size_t len = strlen(text);
    int index = 0;
    for (const char *p = f->choices; *p != '\0'; index++) {
        const char *bar = strchr(p, '|');
        const size_t option = bar ? (size_t)(bar - p) : strlen(p);
        if (option == len && strncmp(p, text, len) == 0) {
            *out = index;
            return 0;
        }
        p += option + (bar ? 1 : 0);
    }
    PyErr_Format(PyExc_ValueError, "%s: field '%s' must be one of '%s', got %R", what, f->name, f->choices, value);
    return -1;
}

/* A composed policy: its own field dict, "policy" naming it. */
static int fill_policy(PyObject *value, const char *what, const mc_config_field *f, mc_policy_ref *ref) {
    PyObject *name_obj = PyDict_Check(value) ? PyDict_GetItemString(value, "policy") : NULL;
    const char *name = name_obj && PyUnicode_Check(name_obj) ? PyUnicode_AsUTF8(name_obj) : NULL;
    if (name == NULL) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: field '%s' must be a policy's field dict (with 'policy'), got %R", what,
                     f->name, value);
        return -1;
    }
    const mc_config_schema *schema = f->lookup ? f->lookup(name) : NULL;
    if (schema == NULL) {
        PyErr_Format(PyExc_ValueError, "%s: field '%s' names no policy of this model family: '%s'", what, f->name,
                     name);
        return -1;
    }
    void *config = PyMem_Calloc(1, schema->size);
    if (config == NULL) {
        mcpy_no_memory("a composed policy's configuration", schema->size);
        return -1;
    }
    if (mcpy_fill_config(value, name, schema->fields, config, schema->size, "policy") < 0) {
        mcpy_free_config(schema->fields, config);
        PyMem_Free(config);
        return -1;
    }
    ref->schema = schema;
    ref->config = config;
    return 0;
}

void mcpy_free_config(const mc_config_field *fields, void *config) {
    if (config == NULL)
        return;
    for (const mc_config_field *f = fields; f->name != NULL; f++) {
        if (f->type != MC_FIELD_POLICY)
            continue;
        mc_policy_ref *ref = (mc_policy_ref *)((char *)config + f->offset);
        if (ref->config != NULL) {
            mcpy_free_config(ref->schema->fields, ref->config);
            PyMem_Free(ref->config);
        }
        ref->schema = NULL;
        ref->config = NULL;
    }
}

static int fill_field(PyObject *value, const char *what, const mc_config_field *f, char *base) {
    double x;
    switch (f->type) {
    case MC_FIELD_BOOL:
    case MC_FIELD_INT:
        if (read_number(value, what, f->name, 1, f->min, f->max, &x) < 0)
            return -1;
        *(int *)(base + f->offset) = (int)x;
        return 0;
    case MC_FIELD_DOUBLE:
        if (read_number(value, what, f->name, 0, f->min, f->max, &x) < 0)
            return -1;
        *(double *)(base + f->offset) = x;
        return 0;
    case MC_FIELD_CHOICE:
        return read_choice(value, what, f, (int *)(base + f->offset));
    case MC_FIELD_POLICY:
        return fill_policy(value, what, f, (mc_policy_ref *)(base + f->offset));
    case MC_FIELD_FLOATS:
    case MC_FIELD_DOUBLES: {
        PyObject *seq = PySequence_Fast(value, "a sequence");
        if (seq == NULL) {
            PyErr_Format(PyExc_TypeError, "%s: field '%s' must be a sequence of %d numbers", what, f->name, f->count);
            return -1;
        }
        if (PySequence_Fast_GET_SIZE(seq) != f->count) {
            PyErr_Format(PyExc_ValueError, "%s: field '%s' needs %d entries, got %zd", what, f->name, f->count,
                         PySequence_Fast_GET_SIZE(seq));
            Py_DECREF(seq);
            return -1;
        }
        for (int i = 0; i < f->count; i++) {
            if (read_number(PySequence_Fast_GET_ITEM(seq, i), what, f->name, 0, f->min, f->max, &x) < 0) {
                Py_DECREF(seq);
                return -1;
            }
            if (f->type == MC_FIELD_FLOATS)
                ((float *)(base + f->offset))[i] = (float)x;
            else
                ((double *)(base + f->offset))[i] = x;
        }
        Py_DECREF(seq);
        return 0;
    }
    }
    PyErr_Format(PyExc_SystemError, "%s: field '%s' has an unknown type", what, f->name);
    return -1;
}

int mcpy_fill_config(PyObject *values, const char *what, const mc_config_field *fields, void *config, size_t size,
                     const char *ignore) {
    if (!PyDict_Check(values)) {
        PyErr_Format(PyExc_TypeError, "%s: the configuration must be a dict of its fields, got %R", what, values);
        return -1;
    }
    memset(config, 0, size);
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(values, &pos, &key, &value)) {
        const char *name = PyUnicode_Check(key) ? PyUnicode_AsUTF8(key) : NULL;
        if (name == NULL) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s: field names must be strings, got %R", what, key);
            return -1;
        }
        if (ignore != NULL && strcmp(name, ignore) == 0)
            continue;
        if (find_field(fields, name) == NULL) {
            PyErr_Format(PyExc_ValueError, "%s: unknown field '%s'", what, name);
            return -1;
        }
    }
    for (const mc_config_field *f = fields; f->name != NULL; f++) {
        PyObject *v = PyDict_GetItemString(values, f->name);
        if (v == NULL) {
            PyErr_Format(PyExc_ValueError, "%s: missing field '%s'", what, f->name);
            return -1;
        }
        if (fill_field(v, what, f, (char *)config) < 0) {
            mcpy_free_config(fields, config);
            return -1;
        }
    }
    return 0;
}

/* A policy's configuration, declared once as a table of fields: the
 * binding (csrc/python/py_config.c) walks the table to fill the policy's
 * config struct from the Python policy's fields, with one generic function
 * and no per-field code. Family neutral: MAR and VAR policies use it alike. */
#ifndef MC_CONFIG_FIELDS_H
#define MC_CONFIG_FIELDS_H

#include <stddef.h>

typedef enum mc_field_type {
    MC_FIELD_BOOL,   /* int 0/1 from a Python bool */
    MC_FIELD_INT,    /* int within [min, max] */
    MC_FIELD_DOUBLE, /* double within [min, max] */
    MC_FIELD_FLOATS, /* float[count], each within [min, max] */
    MC_FIELD_CHOICE, /* int: the index of a string among `choices` ('|'-separated) */
    MC_FIELD_POLICY, /* mc_policy_ref: another policy of the family, composed (its own field dict) */
    MC_FIELD_DOUBLES /* double[count], each within [min, max] (values a policy must see exactly as
                        Python's floats, e.g. FastVAR's ratios r with floor(r * L)) */
} mc_field_type;

typedef struct mc_config_field mc_config_field;

/* A policy's configuration as a whole: its name, field table and struct size. */
typedef struct mc_config_schema {
    const char *name;
    const mc_config_field *fields; /* MC_FIELDS_END-terminated */
    size_t size;
} mc_config_schema;

/* A composed policy inside another's config (MC_FIELD_POLICY). */
typedef struct mc_policy_ref {
    const mc_config_schema *schema;
    void *config; /* schema->size bytes, owned by whoever filled the outer config */
} mc_policy_ref;

struct mc_config_field {
    const char *name; /* the Python policy's field name */
    mc_field_type type;
    size_t offset;    /* into the policy's config struct */
    double min, max;  /* bounds of INT, DOUBLE, FLOATS and DOUBLES values */
    int count;        /* FLOATS, DOUBLES: number of entries */
    const char *choices;
    /* POLICY: the family's policy of a name, or NULL. */
    const mc_config_schema *(*lookup)(const char *name);
};

#define MC_FIELD_BOOL_AT(st, member) {#member, MC_FIELD_BOOL, offsetof(st, member), 0, 1, 0, NULL, NULL}
#define MC_FIELD_INT_AT(st, member, lo, hi) {#member, MC_FIELD_INT, offsetof(st, member), lo, hi, 0, NULL, NULL}
#define MC_FIELD_DOUBLE_AT(st, member, lo, hi) {#member, MC_FIELD_DOUBLE, offsetof(st, member), lo, hi, 0, NULL, NULL}
#define MC_FIELD_FLOATS_AT(st, member, n, lo, hi) {#member, MC_FIELD_FLOATS, offsetof(st, member), lo, hi, n, NULL, NULL}
#define MC_FIELD_DOUBLES_AT(st, member, n, lo, hi) {#member, MC_FIELD_DOUBLES, offsetof(st, member), lo, hi, n, NULL, NULL}
#define MC_FIELD_CHOICE_AT(st, member, options) {#member, MC_FIELD_CHOICE, offsetof(st, member), 0, 0, 0, options, NULL}
/* The same, for a member of an embedded struct whose Python name is the
 * member's own name (e.g. head.head_period -> "head_period"). */
#define MC_FIELD_NAMED(name, type, st, path, lo, hi) {name, type, offsetof(st, path), lo, hi, 0, NULL, NULL}
#define MC_FIELD_POLICY_AT(st, member, find) {#member, MC_FIELD_POLICY, offsetof(st, member), 0, 0, 0, NULL, find}
#define MC_FIELDS_END {NULL, MC_FIELD_BOOL, 0, 0, 0, 0, NULL, NULL}

/* A large bound for counts that have no natural limit (steps, rows). */
#define MC_FIELD_INT_MAX 1000000.0

#endif

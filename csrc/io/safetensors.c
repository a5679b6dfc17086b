/* Strict safetensors reader (eval_and_formats.md section 9).
 *
 * Order of work, chosen so that hostile files cannot make us allocate or
 * read out of bounds: map the file, check the header length against both the
 * 100 MB cap and the file size before anything is allocated from it,
 * validate UTF-8, parse the JSON, validate every entry on its own, reject
 * duplicate names, then check that the tensors tile the data section exactly
 * (sorted by offsets: first at 0, no gaps, no overlaps, last at the end).
 *
 * Choices beyond the reference reader (which ignores unknown fields and
 * keeps the last of duplicate keys):
 *  - a tensor entry must have exactly dtype, shape and data_offsets; any
 *    other field is rejected, since an unindexed field is a place to hide
 *    data and no known writer emits one;
 *  - duplicate tensor names, duplicate fields and duplicate metadata keys
 *    are rejected;
 *  - names, metadata keys and values must not contain NUL ("\u0000"),
 *    because the C API hands them out as C strings;
 *  - a shape whose non-zero dimensions multiply past INT64_MAX bytes is
 *    rejected even when another dimension is 0, so every consumer can
 *    compute sizes without its own overflow checks;
 *  - "__metadata__": null is accepted as "no metadata" (as serde's Option). */
/* madvise and MADV_DONTNEED are not in POSIX (the build defines
 * _POSIX_C_SOURCE); posix_madvise's POSIX_MADV_DONTNEED is a no-op in glibc. */
#define _DEFAULT_SOURCE
#include "safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "json.h"

#define HEADER_PREFIX_BYTES 8

static const struct {
    const char *name;
    mc_dtype dtype;
    size_t size;
} dtype_table[] = {
    {"BOOL", MC_DT_BOOL, 1},       {"U8", MC_DT_U8, 1},   {"I8", MC_DT_I8, 1},
    {"F8_E5M2", MC_DT_F8_E5M2, 1}, {"F8_E4M3", MC_DT_F8_E4M3, 1},
    {"I16", MC_DT_I16, 2},         {"U16", MC_DT_U16, 2}, {"F16", MC_DT_F16, 2},
    {"BF16", MC_DT_BF16, 2},       {"I32", MC_DT_I32, 4}, {"U32", MC_DT_U32, 4},
    {"F32", MC_DT_F32, 4},         {"F64", MC_DT_F64, 8}, {"I64", MC_DT_I64, 8},
    {"U64", MC_DT_U64, 8},
};
#define N_DTYPES (sizeof dtype_table / sizeof dtype_table[0])

const char *mc_dtype_name(mc_dtype dtype) {
    for (size_t i = 0; i < N_DTYPES; i++)
        if (dtype_table[i].dtype == dtype)
            return dtype_table[i].name;
    return "?";
}

size_t mc_dtype_size(mc_dtype dtype) {
    for (size_t i = 0; i < N_DTYPES; i++)
        if (dtype_table[i].dtype == dtype)
            return dtype_table[i].size;
    return 0;
}

static int dtype_from_name(const char *name, mc_dtype *out) {
    for (size_t i = 0; i < N_DTYPES; i++)
        if (strcmp(dtype_table[i].name, name) == 0) {
            *out = dtype_table[i].dtype;
            return 0;
        }
    return -1;
}

int64_t mc_st_numel(const mc_st_tensor *tensor) {
    /* Validated at open: the product fits (it is bounded by the file size). */
    int64_t n = 1;
    for (int d = 0; d < tensor->ndim; d++)
        n *= tensor->shape[d];
    return n;
}

/* Truncated output is acceptable: it only feeds error messages. */
const char *mc_st_shape_text(const int64_t *shape, int ndim, char *buf, size_t size) {
    size_t used = 0;
    int n = snprintf(buf, size, "[");
    used = n > 0 ? (size_t)n : 0;
    for (int d = 0; d < ndim && used < size; d++) {
        n = snprintf(buf + used, size - used, d ? ", %lld" : "%lld", (long long)shape[d]);
        if (n < 0)
            break;
        used += (size_t)n;
    }
    if (used < size)
        snprintf(buf + used, size - used, "]");
    return buf;
}

/* ----- mapping the file ------------------------------------------------ */

static mc_status fail_errno(mc_err *err, const char *path, const char *what, int code) {
    char reason[256];
    if (strerror_r(code, reason, sizeof reason) != 0)
        snprintf(reason, sizeof reason, "errno %d", code);
    return mc_fail(err, MC_ERR_IO, "%s: %s: %s", path, what, reason);
}

static mc_status map_file(mc_st_file *file, mc_err *err) {
    const char *path = file->path;
    /* O_NONBLOCK so that a FIFO given by mistake cannot block the open; it
     * has no effect on regular files, the only kind accepted below. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        if (errno == ENOENT)
            return mc_fail(err, MC_ERR_NOT_FOUND, "No such file: %s", path);
        return fail_errno(err, path, "cannot open", errno);
    }
    struct stat info;
    if (fstat(fd, &info) != 0) {
        int code = errno;
        close(fd);
        return fail_errno(err, path, "cannot stat", code);
    }
    if (S_ISDIR(info.st_mode)) {
        close(fd);
        return mc_fail(err, MC_ERR_IO, "%s: is a directory, not a safetensors file", path);
    }
    if (!S_ISREG(info.st_mode)) {
        close(fd);
        return mc_fail(err, MC_ERR_IO, "%s: not a regular file", path);
    }
    if (info.st_size < HEADER_PREFIX_BYTES) {
        close(fd);
        return mc_fail(err, MC_ERR_VALUE,
                       "%s: file is %lld bytes, shorter than the 8-byte header length prefix", path,
                       (long long)info.st_size);
    }
    if ((uint64_t)info.st_size > SIZE_MAX) {
        close(fd);
        return mc_fail(err, MC_ERR_IO, "%s: file of %lld bytes is too large to map", path,
                       (long long)info.st_size);
    }
    size_t size = (size_t)info.st_size;
    void *mapping = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int code = errno;
    close(fd); /* the mapping keeps the file alive */
    if (mapping == MAP_FAILED)
        return fail_errno(err, path, "cannot mmap", code);
    file->mapping = mapping;
    file->mapping_size = size;
    return MC_OK;
}

/* ----- header validation ------------------------------------------------ */

/* Working state of one open() call. */
typedef struct header_check {
    mc_st_file *file;
    mc_err *err;
    const char *path;
    uint64_t data_size; /* bytes after the header */
} header_check;

static uint64_t read_u64_le(const uint8_t *b) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | b[i];
    return v;
}

/* A JSON number's lexeme for messages, capped so a 10 kB digit string does
 * not swamp the message. */
static int lexeme_len(const mc_json_value *v) { return v->u.number.len > 40 ? 40 : (int)v->u.number.len; }

static mc_status check_metadata(header_check *hc, const mc_json_value *meta) {
    mc_st_file *file = hc->file;
    if (meta->type == MC_JSON_NULL)
        return MC_OK;
    if (meta->type != MC_JSON_OBJECT)
        return mc_fail(hc->err, MC_ERR_VALUE,
                       "%s: '__metadata__' must be an object mapping strings to strings, found %s",
                       hc->path, mc_json_type_name(meta->type));
    size_t count = meta->u.object.count;
    if (count == 0)
        return MC_OK;
    file->metadata_keys = calloc(count, sizeof *file->metadata_keys);
    file->metadata_values = calloc(count, sizeof *file->metadata_values);
    if (file->metadata_keys == NULL || file->metadata_values == NULL)
        return mc_fail_nomem_n(hc->err, count, sizeof *file->metadata_keys + sizeof *file->metadata_values,
                               "the metadata table of %s (%zu entries)", hc->path, count);
    for (size_t i = 0; i < count; i++) {
        mc_json_member *m = &meta->u.object.members[i];
        if (strlen(m->key) != m->key_len)
            return mc_fail(hc->err, MC_ERR_VALUE, "%s: '__metadata__' key at header byte %zu contains a NUL character",
                           hc->path, m->key_offset);
        if (m->value.type != MC_JSON_STRING)
            return mc_fail(hc->err, MC_ERR_VALUE,
                           "%s: '__metadata__' key '%s' has a %s value; metadata values must be strings",
                           hc->path, m->key, mc_json_type_name(m->value.type));
        if (strlen(m->value.u.string.chars) != m->value.u.string.len)
            return mc_fail(hc->err, MC_ERR_VALUE, "%s: '__metadata__' value of key '%s' contains a NUL character",
                           hc->path, m->key);
        for (size_t j = 0; j < i; j++)
            if (strcmp(file->metadata_keys[j], m->key) == 0)
                return mc_fail(hc->err, MC_ERR_VALUE, "%s: '__metadata__' has duplicate key '%s'", hc->path,
                               m->key);
        /* Take the strings over from the JSON tree instead of copying. */
        file->metadata_keys[i] = m->key;
        m->key = NULL;
        file->metadata_values[i] = m->value.u.string.chars;
        m->value.u.string.chars = NULL;
        file->n_metadata = (int64_t)i + 1;
    }
    /* Quadratic duplicate search above: metadata holds a handful of entries.
     * A hostile header with many keys is still bounded by the 100 MB cap,
     * but switch to sorting if that ever matters. */
    return MC_OK;
}

static mc_status check_shape(header_check *hc, mc_st_tensor *t, const mc_json_value *shape) {
    if (shape->type != MC_JSON_ARRAY)
        return mc_fail(hc->err, MC_ERR_VALUE, "%s: tensor '%s': 'shape' must be an array of integers, found %s",
                       hc->path, t->name, mc_json_type_name(shape->type));
    if (shape->u.array.count > MC_ST_MAX_DIMS)
        return mc_fail(hc->err, MC_ERR_VALUE, "%s: tensor '%s': shape has %zu dimensions, at most %d are supported",
                       hc->path, t->name, shape->u.array.count, MC_ST_MAX_DIMS);
    t->ndim = (int)shape->u.array.count;
    for (int d = 0; d < t->ndim; d++) {
        const mc_json_value *dim = &shape->u.array.items[d];
        uint64_t value;
        mc_json_int_result r = mc_json_u64(dim, &value);
        if (r == MC_JSON_INT_NOT_NUMBER)
            return mc_fail(hc->err, MC_ERR_VALUE, "%s: tensor '%s': shape dimension %d must be an integer, found %s",
                           hc->path, t->name, d, mc_json_type_name(dim->type));
        if (r == MC_JSON_INT_OK && value > (uint64_t)INT64_MAX)
            r = MC_JSON_INT_OVERFLOW;
        if (r != MC_JSON_INT_OK)
            return mc_fail(hc->err, MC_ERR_VALUE, "%s: tensor '%s': shape dimension %d (%.*s) %s", hc->path,
                           t->name, d, lexeme_len(dim), dim->u.number.text,
                           r == MC_JSON_INT_NEGATIVE ? "is negative; dimensions must be >= 0"
                                                     : mc_json_int_result_text(r));
        t->shape[d] = (int64_t)value;
    }
    return MC_OK;
}

static mc_status check_offsets(header_check *hc, mc_st_tensor *t, const mc_json_value *offsets) {
    if (offsets->type != MC_JSON_ARRAY || offsets->u.array.count != 2)
        return mc_fail(hc->err, MC_ERR_VALUE,
                       "%s: tensor '%s': data_offsets must be an array of two integers [begin, end]", hc->path,
                       t->name);
    uint64_t bounds[2];
    for (int k = 0; k < 2; k++) {
        const mc_json_value *v = &offsets->u.array.items[k];
        mc_json_int_result r = mc_json_u64(v, &bounds[k]);
        if (r == MC_JSON_INT_NOT_NUMBER)
            return mc_fail(hc->err, MC_ERR_VALUE, "%s: tensor '%s': data_offsets %s must be an integer, found %s",
                           hc->path, t->name, k ? "end" : "begin", mc_json_type_name(v->type));
        if (r != MC_JSON_INT_OK)
            return mc_fail(hc->err, MC_ERR_VALUE, "%s: tensor '%s': data_offsets %s (%.*s) %s", hc->path, t->name,
                           k ? "end" : "begin", lexeme_len(v), v->u.number.text, mc_json_int_result_text(r));
    }
    t->begin = bounds[0];
    t->end = bounds[1];
    if (t->begin > t->end)
        return mc_fail(hc->err, MC_ERR_VALUE, "%s: tensor '%s': data_offsets [%llu, %llu] have begin > end",
                       hc->path, t->name, (unsigned long long)t->begin, (unsigned long long)t->end);
    if (t->end > hc->data_size)
        return mc_fail(hc->err, MC_ERR_VALUE,
                       "%s: tensor '%s': data_offsets end %llu is beyond the end of the data section (%llu bytes "
                       "after the header)",
                       hc->path, t->name, (unsigned long long)t->end, (unsigned long long)hc->data_size);
    return MC_OK;
}

/* shape x dtype size must equal end - begin; all products overflow-checked. */
static mc_status check_byte_size(header_check *hc, const mc_st_tensor *t) {
    char shape_text[256];
    uint64_t dtype_size = mc_dtype_size(t->dtype);
    /* Product of the non-zero dims times the element size, capped at
     * INT64_MAX so every later size computation is safe. */
    uint64_t bytes_if_nonempty = dtype_size;
    int has_zero = 0;
    for (int d = 0; d < t->ndim; d++) {
        uint64_t dim = (uint64_t)t->shape[d];
        if (dim == 0) {
            has_zero = 1;
            continue;
        }
        if (bytes_if_nonempty > (uint64_t)INT64_MAX / dim)
            return mc_fail(hc->err, MC_ERR_VALUE, "%s: tensor '%s': shape %s of %s overflows a 64-bit byte count",
                           hc->path, t->name, mc_st_shape_text(t->shape, t->ndim, shape_text, sizeof shape_text),
                           mc_dtype_name(t->dtype));
        bytes_if_nonempty *= dim;
    }
    uint64_t needed = has_zero ? 0 : bytes_if_nonempty;
    uint64_t span = t->end - t->begin;
    if (span != needed)
        return mc_fail(hc->err, MC_ERR_VALUE,
                       "%s: tensor '%s': data_offsets [%llu, %llu] span %llu bytes but shape %s of %s needs %llu",
                       hc->path, t->name, (unsigned long long)t->begin, (unsigned long long)t->end,
                       (unsigned long long)span, mc_st_shape_text(t->shape, t->ndim, shape_text, sizeof shape_text),
                       mc_dtype_name(t->dtype), (unsigned long long)needed);
    return MC_OK;
}

static mc_status check_tensor(header_check *hc, mc_st_tensor *t, const mc_json_member *entry) {
    const mc_json_value *v = &entry->value;
    if (v->type != MC_JSON_OBJECT)
        return mc_fail(hc->err, MC_ERR_VALUE,
                       "%s: tensor '%s': entry must be an object with dtype, shape and data_offsets, found %s",
                       hc->path, t->name, mc_json_type_name(v->type));
    static const char *const fields[3] = {"dtype", "shape", "data_offsets"};
    const mc_json_value *found[3] = {NULL, NULL, NULL};
    for (size_t i = 0; i < v->u.object.count; i++) {
        const mc_json_member *m = &v->u.object.members[i];
        int which = -1;
        for (int k = 0; k < 3; k++)
            if (m->key_len == strlen(fields[k]) && memcmp(m->key, fields[k], m->key_len) == 0)
                which = k;
        if (which < 0)
            return mc_fail(hc->err, MC_ERR_VALUE,
                           "%s: tensor '%s': unknown field '%s' (only dtype, shape and data_offsets are allowed)",
                           hc->path, t->name, m->key);
        if (found[which] != NULL)
            return mc_fail(hc->err, MC_ERR_VALUE, "%s: tensor '%s': field '%s' appears twice", hc->path, t->name,
                           fields[which]);
        found[which] = &m->value;
    }
    for (int k = 0; k < 3; k++)
        if (found[k] == NULL)
            return mc_fail(hc->err, MC_ERR_VALUE, "%s: tensor '%s': missing field '%s'", hc->path, t->name,
                           fields[k]);
    const mc_json_value *dtype = found[0];
    if (dtype->type != MC_JSON_STRING)
        return mc_fail(hc->err, MC_ERR_VALUE, "%s: tensor '%s': 'dtype' must be a string, found %s", hc->path,
                       t->name, mc_json_type_name(dtype->type));
    /* The name is compared as a C string: a NUL inside ("F32\u0000...") would otherwise
     * pass for the part before it. */
    if (strlen(dtype->u.string.chars) != dtype->u.string.len)
        return mc_fail(hc->err, MC_ERR_VALUE, "%s: tensor '%s': 'dtype' contains a NUL character (after '%s')",
                       hc->path, t->name, dtype->u.string.chars);
    if (dtype_from_name(dtype->u.string.chars, &t->dtype) != 0)
        return mc_fail(hc->err, MC_ERR_VALUE,
                       "%s: tensor '%s': unknown dtype '%s' (known: BOOL U8 I8 F8_E5M2 F8_E4M3 I16 U16 F16 BF16 "
                       "I32 U32 F32 F64 I64 U64)",
                       hc->path, t->name, dtype->u.string.chars);
    MC_TRY(check_shape(hc, t, found[1]));
    MC_TRY(check_offsets(hc, t, found[2]));
    return check_byte_size(hc, t);
}

typedef struct name_slot {
    const char *name;
    int64_t index;
} name_slot;

static int compare_name_slots(const void *a, const void *b) {
    const name_slot *x = a, *y = b;
    int c = strcmp(x->name, y->name);
    if (c != 0)
        return c;
    return (x->index > y->index) - (x->index < y->index);
}

typedef struct offset_slot {
    uint64_t begin, end;
    int64_t index;
} offset_slot;

static int compare_offset_slots(const void *a, const void *b) {
    const offset_slot *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return (x->index > y->index) - (x->index < y->index);
}

/* Builds the name index and rejects duplicate names. */
static mc_status index_names(header_check *hc) {
    mc_st_file *file = hc->file;
    int64_t n = file->n_tensors;
    if (n == 0)
        return MC_OK;
    name_slot *slots = malloc((size_t)n * sizeof *slots);
    file->name_order = malloc((size_t)n * sizeof *file->name_order);
    if (slots == NULL || file->name_order == NULL) {
        free(slots);
        return mc_fail_nomem_n(hc->err, (size_t)n, sizeof *slots + sizeof *file->name_order,
                               "the name index of %s's %lld tensors", hc->path, (long long)n);
    }
    for (int64_t i = 0; i < n; i++)
        slots[i] = (name_slot){file->tensors[i].name, i};
    qsort(slots, (size_t)n, sizeof *slots, compare_name_slots);
    for (int64_t i = 0; i < n; i++) {
        if (i > 0 && strcmp(slots[i - 1].name, slots[i].name) == 0) {
            mc_fail(hc->err, MC_ERR_VALUE, "%s: duplicate tensor name '%s' in the header", hc->path, slots[i].name);
            free(slots);
            return MC_ERR_VALUE;
        }
        file->name_order[i] = slots[i].index;
    }
    free(slots);
    return MC_OK;
}

/* Sorted by offsets, the tensors must tile [0, data_size) exactly. */
static mc_status check_tiling(header_check *hc) {
    mc_st_file *file = hc->file;
    int64_t n = file->n_tensors;
    uint64_t covered = 0;
    if (n > 0) {
        offset_slot *slots = malloc((size_t)n * sizeof *slots);
        if (slots == NULL)
            return mc_fail_nomem_n(hc->err, (size_t)n, sizeof *slots, "the offset order of %s's %lld tensors", hc->path,
                                   (long long)n);
        for (int64_t i = 0; i < n; i++)
            slots[i] = (offset_slot){file->tensors[i].begin, file->tensors[i].end, i};
        qsort(slots, (size_t)n, sizeof *slots, compare_offset_slots);
        const char *previous = NULL;
        for (int64_t i = 0; i < n; i++) {
            const mc_st_tensor *t = &file->tensors[slots[i].index];
            if (t->begin != covered) {
                if (previous == NULL)
                    mc_fail(hc->err, MC_ERR_VALUE,
                            "%s: tensor '%s': data_offsets [%llu, %llu]: the first tensor must begin at 0 (bytes "
                            "[0, %llu) of the data section belong to no tensor)",
                            hc->path, t->name, (unsigned long long)t->begin, (unsigned long long)t->end,
                            (unsigned long long)t->begin);
                else if (t->begin > covered)
                    mc_fail(hc->err, MC_ERR_VALUE,
                            "%s: tensor '%s': data_offsets [%llu, %llu] leave a gap of %llu bytes after tensor '%s' "
                            "(which ends at %llu)",
                            hc->path, t->name, (unsigned long long)t->begin, (unsigned long long)t->end,
                            (unsigned long long)(t->begin - covered), previous, (unsigned long long)covered);
                else
                    mc_fail(hc->err, MC_ERR_VALUE,
                            "%s: tensor '%s': data_offsets [%llu, %llu] overlap tensor '%s' (which ends at %llu)",
                            hc->path, t->name, (unsigned long long)t->begin, (unsigned long long)t->end, previous,
                            (unsigned long long)covered);
                free(slots);
                return MC_ERR_VALUE;
            }
            covered = t->end;
            previous = t->name;
        }
        free(slots);
    }
    if (covered != hc->data_size)
        return mc_fail(hc->err, MC_ERR_VALUE,
                       "%s: buffer not fully covered: the data section has %llu bytes but the tensors end at %llu "
                       "(%llu trailing bytes belong to no tensor)",
                       hc->path, (unsigned long long)hc->data_size, (unsigned long long)covered,
                       (unsigned long long)(hc->data_size - covered));
    return MC_OK;
}

static mc_status check_entries(header_check *hc, mc_json_value *root) {
    mc_st_file *file = hc->file;
    if (root->type != MC_JSON_OBJECT)
        return mc_fail(hc->err, MC_ERR_VALUE, "%s: header must be a JSON object, found %s", hc->path,
                       mc_json_type_name(root->type));
    size_t n_members = root->u.object.count;
    const mc_json_member *metadata = NULL;
    size_t n_tensors = 0;
    for (size_t i = 0; i < n_members; i++) {
        const mc_json_member *m = &root->u.object.members[i];
        if (strcmp(m->key, "__metadata__") == 0 && m->key_len == strlen("__metadata__")) {
            if (metadata != NULL)
                return mc_fail(hc->err, MC_ERR_VALUE, "%s: duplicate key '__metadata__' in the header", hc->path);
            metadata = m;
        } else {
            n_tensors++;
        }
    }
    if (metadata != NULL)
        MC_TRY(check_metadata(hc, &metadata->value));
    if (n_tensors > 0) {
        file->tensors = calloc(n_tensors, sizeof *file->tensors);
        if (file->tensors == NULL)
            return mc_fail_nomem_n(hc->err, n_tensors, sizeof *file->tensors, "the tensor table of %s (%zu entries)",
                                   hc->path, n_tensors);
    }
    const uint8_t *data_section = (const uint8_t *)file->mapping + (file->mapping_size - hc->data_size);
    for (size_t i = 0; i < n_members; i++) {
        mc_json_member *m = &root->u.object.members[i];
        if (m == metadata)
            continue;
        if (strlen(m->key) != m->key_len)
            return mc_fail(hc->err, MC_ERR_VALUE, "%s: tensor name at header byte %zu contains a NUL character",
                           hc->path, m->key_offset);
        mc_st_tensor *t = &file->tensors[file->n_tensors];
        /* Take the name over from the JSON tree; counted at once so that
         * mc_st_close frees it even if this entry fails below. */
        t->name = m->key;
        m->key = NULL;
        file->n_tensors++;
        MC_TRY(check_tensor(hc, t, m));
        t->data = data_section + t->begin;
    }
    MC_TRY(index_names(hc));
    return check_tiling(hc);
}

static mc_status parse_header(mc_st_file *file, mc_err *err) {
    header_check hc = {.file = file, .err = err, .path = file->path};
    const uint8_t *bytes = file->mapping;
    uint64_t header_len = read_u64_le(bytes);
    uint64_t after_prefix = (uint64_t)file->mapping_size - HEADER_PREFIX_BYTES;
    /* Both bounds before anything is allocated from header_len. */
    if (header_len > MC_ST_MAX_HEADER)
        return mc_fail(err, MC_ERR_VALUE, "%s: header length %llu exceeds the limit of %llu bytes", file->path,
                       (unsigned long long)header_len, (unsigned long long)MC_ST_MAX_HEADER);
    if (header_len > after_prefix)
        return mc_fail(err, MC_ERR_VALUE,
                       "%s: header length %llu exceeds the %llu bytes of the file after the 8-byte length prefix",
                       file->path, (unsigned long long)header_len, (unsigned long long)after_prefix);
    hc.data_size = after_prefix - header_len;
    const uint8_t *header = bytes + HEADER_PREFIX_BYTES;
    size_t bad;
    if (mc_utf8_validate(header, (size_t)header_len, &bad) != 0)
        return mc_fail(err, MC_ERR_VALUE, "%s: header is not valid UTF-8 (byte 0x%02x at header byte %zu)",
                       file->path, header[bad], bad);
    mc_json_value root;
    mc_json_error json_error;
    if (mc_json_parse((const char *)header, (size_t)header_len, &root, &json_error) != 0) {
        if (json_error.out_of_memory)
            return mc_fail_nomem_n(err, json_error.nomem_count, json_error.nomem_each,
                                   "%s of %s's header (at header byte %zu)", json_error.msg, file->path,
                                   json_error.offset);
        return mc_fail(err, MC_ERR_VALUE, "%s: header is not valid JSON: %s at header byte %zu", file->path,
                       json_error.msg, json_error.offset);
    }
    mc_status status = check_entries(&hc, &root);
    mc_json_free(&root);
    return status;
}

/* ----- public API -------------------------------------------------------- */

mc_status mc_st_open(const char *path, mc_st_file **out, mc_err *err) {
    *out = NULL;
    mc_st_file *file = calloc(1, sizeof *file);
    if (file == NULL)
        return mc_fail_nomem(err, sizeof *file, "the file record of %s", path);
    size_t path_len = strlen(path);
    file->path = malloc(path_len + 1);
    if (file->path == NULL) {
        free(file);
        return mc_fail_nomem(err, path_len + 1, "a copy of the path %s", path);
    }
    memcpy(file->path, path, path_len + 1);
    mc_status status = map_file(file, err);
    if (status == MC_OK)
        status = parse_header(file, err);
    if (status != MC_OK) {
        mc_st_close(file);
        return status;
    }
    *out = file;
    return MC_OK;
}

void mc_st_close(mc_st_file *file) {
    if (file == NULL)
        return;
    if (file->mapping != NULL)
        munmap(file->mapping, file->mapping_size);
    for (int64_t i = 0; i < file->n_tensors; i++)
        free(file->tensors[i].name);
    free(file->tensors);
    for (int64_t i = 0; i < file->n_metadata; i++) {
        free(file->metadata_keys[i]);
        free(file->metadata_values[i]);
    }
    free(file->metadata_keys);
    free(file->metadata_values);
    free(file->name_order);
    free(file->path);
    free(file);
}

const mc_st_tensor *mc_st_find(const mc_st_file *file, const char *name) {
    int64_t lo = 0, hi = file->n_tensors;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        const mc_st_tensor *t = &file->tensors[file->name_order[mid]];
        int c = strcmp(t->name, name);
        if (c == 0)
            return t;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

const char *mc_st_metadata(const mc_st_file *file, const char *key) {
    for (int64_t i = 0; i < file->n_metadata; i++)
        if (strcmp(file->metadata_keys[i], key) == 0)
            return file->metadata_values[i];
    return NULL;
}

/* ----- conversion to float32 ---------------------------------------------- */

static float f32_from_bits(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* IEEE half -> single, exact for every input (subnormals, infinities, NaN
 * payloads kept in the top mantissa bits). */
static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1Fu;
    uint32_t mantissa = h & 0x3FFu;
    if (exponent == 0) {
        /* zero or subnormal: mantissa * 2^-24, exact in float */
        float magnitude = (float)mantissa * 0x1p-24f;
        return sign ? -magnitude : magnitude;
    }
    if (exponent == 31)
        return f32_from_bits(sign | 0x7F800000u | (mantissa << 13));
    return f32_from_bits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

static uint16_t load_u16_le(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static uint32_t load_u32_le(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static uint64_t load_u64_le(const uint8_t *p) { return (uint64_t)load_u32_le(p) | ((uint64_t)load_u32_le(p + 4) << 32); }

/* Whole pages covering [begin, begin + bytes) of the mapping, rounded outwards:
 * a page shared with a neighbouring tensor is faulted in again from the file
 * when that tensor is read (the mapping is read-only, so nothing is lost). */
void mc_st_release(const mc_st_file *file, const mc_st_tensor *tensor, size_t first, size_t count) {
    const size_t elem = mc_dtype_size(tensor->dtype);
    const long page = sysconf(_SC_PAGESIZE);
    if (file->mapping == NULL || count == 0 || elem == 0 || page <= 0)
        return;
    const uintptr_t start = (uintptr_t)file->mapping;
    const uintptr_t limit = start + file->mapping_size;
    uintptr_t lo = (uintptr_t)(tensor->data + first * elem);
    uintptr_t hi = lo + count * elem;
    lo -= (lo - start) % (uintptr_t)page;
    hi = hi >= limit ? limit : hi;
    if (hi <= lo)
        return;
    /* Advice only: on failure the pages just stay resident until the file is
     * closed, as before. MAP_PRIVATE pages we never wrote come back from the
     * file on the next access, so dropping them cannot change what is read. */
    (void)madvise((void *)lo, (size_t)(hi - lo), MADV_DONTNEED);
}

mc_status mc_st_to_f32_range(const mc_st_file *file, const mc_st_tensor *tensor, size_t first, size_t count,
                             float *dst, mc_err *err) {
    const size_t numel = (size_t)mc_st_numel(tensor);
    if (first > numel || count > numel - first)
        return mc_fail(err, MC_ERR_INTERNAL, "%s: key '%s': elements [%zu, %zu) are outside its %zu elements",
                       file->path, tensor->name, first, first + count, numel);
    const size_t n = count;
    switch (tensor->dtype) {
    case MC_DT_F32: {
        const uint8_t *src = tensor->data + 4 * first;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        /* Same byte order: a plain copy, which also handles misalignment. */
        if (n)
            memcpy(dst, src, n * sizeof(float));
#else
        for (size_t i = 0; i < n; i++)
            dst[i] = f32_from_bits(load_u32_le(src + 4 * i));
#endif
        break;
    }
    case MC_DT_F16: {
        const uint8_t *src = tensor->data + 2 * first;
        for (size_t i = 0; i < n; i++)
            dst[i] = f16_to_f32(load_u16_le(src + 2 * i));
        break;
    }
    case MC_DT_BF16: {
        /* bfloat16 is the top half of a float32. */
        const uint8_t *src = tensor->data + 2 * first;
        for (size_t i = 0; i < n; i++)
            dst[i] = f32_from_bits((uint32_t)load_u16_le(src + 2 * i) << 16);
        break;
    }
    case MC_DT_F64: {
        const uint8_t *src = tensor->data + 8 * first;
        for (size_t i = 0; i < n; i++) {
            uint64_t bits = load_u64_le(src + 8 * i);
            double d;
            memcpy(&d, &bits, sizeof d);
            dst[i] = (float)d;
        }
        break;
    }
    default:
        return mc_fail(err, MC_ERR_VALUE, "%s: key '%s' has dtype %s, which cannot be converted to float32",
                       file->path, tensor->name, mc_dtype_name(tensor->dtype));
    }
    mc_st_release(file, tensor, first, count);
    return MC_OK;
}

mc_status mc_st_to_f32(const mc_st_file *file, const mc_st_tensor *tensor, float *dst, mc_err *err) {
    return mc_st_to_f32_range(file, tensor, 0, (size_t)mc_st_numel(tensor), dst, err);
}

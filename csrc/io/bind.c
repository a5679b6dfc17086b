/* Tensor binding: safetensors entry -> checked shape -> float32 -> backend
 * buffer, with the allocation recorded so a failed model load frees
 * everything it uploaded. */
#include "bind.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MC_BIND_MAX_NAME 512

void mc_loader_init(mc_loader *ld, const mc_st_file *file, mc_backend *backend, mc_err *err) {
    memset(ld, 0, sizeof *ld);
    ld->file = file;
    ld->backend = backend;
    ld->err = err;
}

void mc_alloc_list_free(mc_alloc_list *list, mc_backend *backend) {
    if (list == NULL)
        return;
    for (int64_t i = 0; i < list->count; i++)
        if (list->ptrs[i] != NULL)
            backend->ops->release(backend, list->ptrs[i]);
    free(list->ptrs);
    memset(list, 0, sizeof *list);
}

void mc_loader_finish(mc_loader *ld) {
    mc_aligned_free(ld->host_scratch);
    ld->host_scratch = NULL;
    ld->host_scratch_floats = 0;
    mc_alloc_list_free(&ld->allocations, ld->backend);
}

mc_alloc_list mc_loader_take_allocations(mc_loader *ld) {
    mc_alloc_list taken = ld->allocations;
    memset(&ld->allocations, 0, sizeof ld->allocations);
    return taken;
}

mc_status mc_alloc_list_push(mc_alloc_list *list, void *ptr, size_t bytes, mc_err *err) {
    if (list->count == list->capacity) {
        int64_t fresh = list->capacity ? list->capacity * 2 : 64;
        size_t fresh_bytes;
        if (fresh < list->capacity || mc_mul_overflows((size_t)fresh, sizeof *list->ptrs, &fresh_bytes))
            return mc_fail_nomem_n(err, fresh < list->capacity ? SIZE_MAX : (size_t)fresh, sizeof *list->ptrs,
                                   "the model's allocation list (past %lld entries)", (long long)list->capacity);
        void **moved = realloc(list->ptrs, fresh_bytes);
        if (moved == NULL)
            return mc_fail_nomem(err, fresh_bytes, "the model's allocation list (%lld entries)", (long long)fresh);
        list->ptrs = moved;
        list->capacity = fresh;
    }
    list->ptrs[list->count++] = ptr;
    list->bytes += bytes;
    return MC_OK;
}

/* The tensor `name`, which must have exactly shape[0..ndim); NULL with the
 * error set otherwise (missing key -> MC_ERR_KEY, other shape -> MC_ERR_VALUE,
 * both naming the file, the key and the shapes). */
static const mc_st_tensor *find_with_shape(mc_loader *ld, const char *name, int ndim, const int64_t *shape) {
    char expected[256], actual[256];
    const char *path = ld->file->path;
    const mc_st_tensor *t = mc_st_find(ld->file, name);
    if (t == NULL) {
        mc_fail(ld->err, MC_ERR_KEY, "%s: missing key '%s' (expected shape %s)", path, name,
                mc_st_shape_text(shape, ndim, expected, sizeof expected));
        return NULL;
    }
    int same = (t->ndim == ndim);
    for (int d = 0; same && d < ndim; d++)
        same = (t->shape[d] == shape[d]);
    if (!same) {
        mc_fail(ld->err, MC_ERR_VALUE, "%s: key '%s' has shape %s, expected %s", path, name,
                mc_st_shape_text(t->shape, t->ndim, actual, sizeof actual),
                mc_st_shape_text(shape, ndim, expected, sizeof expected));
        return NULL;
    }
    return t;
}

/* Grow-only host buffer for conversions; contents are not preserved. */
static float *host_scratch(mc_loader *ld, size_t floats) {
    if (ld->host_scratch_floats >= floats && ld->host_scratch != NULL)
        return ld->host_scratch;
    size_t bytes;
    float *fresh = mc_mul_overflows(floats, sizeof(float), &bytes) ? NULL : mc_aligned_alloc(bytes);
    if (fresh == NULL) {
        mc_fail_nomem_n(ld->err, floats, sizeof(float), "the conversion buffer for %s", ld->file->path);
        return NULL;
    }
    mc_aligned_free(ld->host_scratch);
    ld->host_scratch = fresh;
    ld->host_scratch_floats = floats;
    return fresh;
}

/* [O, I, kh, kw] -> [O, kh, kw, I], the layout conv2d expects, for `out_ch`
 * output channels (each one's [I, kh, kw] block is repacked on its own, so a
 * tensor can be repacked a few output channels at a time). */
static void repack_conv_ohwi(const float *src, float *dst, int64_t out_ch, const int64_t shape[4]) {
    int64_t in_ch = shape[1], kh = shape[2], kw = shape[3];
    for (int64_t o = 0; o < out_ch; o++)
        for (int64_t i = 0; i < in_ch; i++)
            for (int64_t y = 0; y < kh; y++)
                for (int64_t x = 0; x < kw; x++)
                    dst[((o * kh + y) * kw + x) * in_ch + i] = src[((o * in_ch + i) * kh + y) * kw + x];
}

/* Source elements moved per piece: a tensor goes from the mapping to its
 * backend buffer in pieces of about 4 MiB of float32, converted in a host
 * buffer of that bounded size, and each piece's file pages are released once
 * uploaded. So a load never holds a second copy of a tensor, let alone of the
 * model: resident memory is the weights plus one piece. */
#define MC_BIND_PIECE_FLOATS ((size_t)1 << 20)

/* Streams tensor `t` into `buffer` (a backend allocation of its numel
 * elements of the output type) piece by piece. */
static mc_status stream_tensor(mc_loader *ld, const mc_st_tensor *t, mc_bind_layout layout, int to_16bit,
                               char *buffer) {
    mc_backend *be = ld->backend;
    const size_t numel = (size_t)mc_st_numel(t);
    if (numel == 0)
        return MC_OK;
    const size_t out_size = to_16bit ? sizeof(uint16_t) : sizeof(float);
    /* A piece is a whole number of units: one output channel for the conv
     * repack (its [I, kh, kw] block moves as a whole), one element otherwise. */
    const size_t unit = layout == MC_BIND_CONV_OHWI ? numel / (size_t)t->shape[0] : 1;
    size_t piece = (MC_BIND_PIECE_FLOATS / unit ? MC_BIND_PIECE_FLOATS / unit : 1) * unit;
    if (piece > numel)
        piece = numel;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    /* Stored bytes already are the wanted floats: upload straight from the
     * mapping (upload is a byte copy, so alignment does not matter). */
    const int direct = (t->dtype == MC_DT_F32 && layout == MC_BIND_AS_IS);
#else
    const int direct = 0;
#endif
    float *scratch = NULL;
    if (!direct) {
        /* The conv repack and the 16-bit rounding write a second region. */
        scratch = host_scratch(ld, layout != MC_BIND_AS_IS ? 2 * piece : piece);
        if (scratch == NULL)
            return ld->err->status;
    }
    for (size_t first = 0; first < numel; first += piece) {
        const size_t count = numel - first < piece ? numel - first : piece;
        const void *src;
        if (direct) {
            src = t->data + first * sizeof(float);
        } else {
            MC_TRY(mc_st_to_f32_range(ld->file, t, first, count, scratch, ld->err));
            if (layout == MC_BIND_CONV_OHWI) {
                repack_conv_ohwi(scratch, scratch + piece, (int64_t)(count / unit), t->shape);
                src = scratch + piece;
            } else if (to_16bit) {
                uint16_t *packed = (uint16_t *)(scratch + piece);
                for (size_t i = 0; i < count; i++)
                    packed[i] = mc_wtype_pack(be->linear_wtype, scratch[i]);
                src = packed;
            } else {
                src = scratch;
            }
        }
        MC_TRY(be->ops->upload(be, buffer + first * out_size, src, count * out_size, ld->err));
        if (direct)
            mc_st_release(ld->file, t, first, count);
    }
    return MC_OK;
}

/* A backend buffer of `bytes` just filled (`filled`: how that went): kept in
 * the loader's allocation list and handed out through *out, or released. */
static mc_status keep_buffer(mc_loader *ld, void *buffer, size_t bytes, mc_status filled, float **out) {
    mc_status status = filled;
    if (status == MC_OK)
        status = mc_alloc_list_push(&ld->allocations, buffer, bytes, ld->err);
    if (status != MC_OK) {
        ld->backend->ops->release(ld->backend, buffer);
        return status;
    }
    *out = buffer;
    return MC_OK;
}

mc_status mc_bind(mc_loader *ld, const char *name, int ndim, const int64_t *shape, mc_bind_layout layout,
                  float **out) {
    *out = NULL;
    const char *path = ld->file->path;
    const mc_st_tensor *t = find_with_shape(ld, name, ndim, shape);
    if (t == NULL)
        return ld->err->status;
    if (layout == MC_BIND_CONV_OHWI && ndim != 4)
        return mc_fail(ld->err, MC_ERR_INTERNAL, "%s: key '%s': conv repacking needs a 4-D shape, got %d-D", path,
                       name, ndim);
    if (layout == MC_BIND_LINEAR && ndim != 2)
        return mc_fail(ld->err, MC_ERR_INTERNAL, "%s: key '%s': a linear weight needs a 2-D shape, got %d-D", path,
                       name, ndim);
    mc_backend *be = ld->backend;
    const int linear_weight = layout == MC_BIND_LINEAR;
    const int to_16bit = layout == MC_BIND_LINEAR && be->linear_wtype != MC_WTYPE_F32;
    if (layout == MC_BIND_LINEAR && !to_16bit)
        layout = MC_BIND_AS_IS;
    if (layout != MC_BIND_AS_IS && layout != MC_BIND_CONV_OHWI && layout != MC_BIND_LINEAR)
        return mc_fail(ld->err, MC_ERR_INTERNAL, "%s: key '%s': unknown bind layout %d", path, name, (int)layout);
    if (t->dtype != MC_DT_F32 && t->dtype != MC_DT_F16 && t->dtype != MC_DT_BF16 && t->dtype != MC_DT_F64)
        return mc_fail(ld->err, MC_ERR_VALUE, "%s: key '%s' has dtype %s, which cannot be converted to float32",
                       path, name, mc_dtype_name(t->dtype));

    /* numel * 4 fits: open() bounded numel * dtype size (>= 2 here) by
     * INT64_MAX, and non-empty tensors by the file size. */
    size_t numel = (size_t)mc_st_numel(t);
    size_t bytes = numel * (to_16bit ? sizeof(uint16_t) : sizeof(float));
    /* Never ask a backend for 0 bytes: some return NULL for that. */
    size_t alloc_bytes = bytes ? bytes : sizeof(float);
    char what[MC_ERRMSG_LEN / 2];
    snprintf(what, sizeof what, "the weight '%s' of %s", name, path);
    void *buffer = be->ops->alloc(be, alloc_bytes, what, ld->err);
    if (buffer == NULL)
        return ld->err->status;
    mc_status filled = stream_tensor(ld, t, layout, to_16bit, buffer);
    if (filled == MC_OK && linear_weight && be->ops->bind_linear != NULL)
        filled = be->ops->bind_linear(be, buffer, shape[0], shape[1], ld->err);
    return keep_buffer(ld, buffer, alloc_bytes, filled, out);
}

static mc_status format_name(mc_loader *ld, char *name, size_t size, const char *fmt, va_list ap) {
    int n = vsnprintf(name, size, fmt, ap);
    if (n < 0 || (size_t)n >= size)
        return mc_fail(ld->err, MC_ERR_INTERNAL, "%s: tensor name from format '%s' is longer than %d bytes",
                       ld->file->path, fmt, MC_BIND_MAX_NAME - 1);
    return MC_OK;
}

mc_status mc_bindf(mc_loader *ld, float **out, int ndim, const int64_t *shape, const char *fmt, ...) {
    char name[MC_BIND_MAX_NAME];
    va_list ap;
    va_start(ap, fmt);
    mc_status st = format_name(ld, name, sizeof name, fmt, ap);
    va_end(ap);
    *out = NULL;
    return st != MC_OK ? st : mc_bind(ld, name, ndim, shape, MC_BIND_AS_IS, out);
}

mc_status mc_bind_linearf(mc_loader *ld, void **out, int64_t out_features, int64_t in_features,
                          const char *fmt, ...) {
    char name[MC_BIND_MAX_NAME];
    va_list ap;
    va_start(ap, fmt);
    mc_status st = format_name(ld, name, sizeof name, fmt, ap);
    va_end(ap);
    *out = NULL;
    if (st != MC_OK)
        return st;
    float *bound = NULL;
    st = mc_bind(ld, name, 2, (const int64_t[]){out_features, in_features}, MC_BIND_LINEAR, &bound);
    *out = bound;
    return st;
}

int mc_loader_has(const mc_loader *ld, const char *name) { return mc_st_find(ld->file, name) != NULL; }

mc_status mc_loader_shape(mc_loader *ld, const char *name, int *ndim, int64_t shape[8]) {
    const mc_st_tensor *t = mc_st_find(ld->file, name);
    if (t == NULL)
        return mc_fail(ld->err, MC_ERR_KEY, "%s: missing key '%s'", ld->file->path, name);
    *ndim = t->ndim;
    for (int d = 0; d < t->ndim; d++)
        shape[d] = t->shape[d];
    return MC_OK;
}

mc_status mc_bind_host(mc_loader *ld, const char *name, int ndim, const int64_t *shape, float *dst) {
    const mc_st_tensor *t = find_with_shape(ld, name, ndim, shape);
    return t == NULL ? ld->err->status : mc_st_to_f32(ld->file, t, dst, ld->err);
}

mc_status mc_loader_upload(mc_loader *ld, const float *host, size_t floats, float **out, const char *what_fmt, ...) {
    *out = NULL;
    char what[MC_ERRMSG_LEN / 2];
    va_list ap;
    va_start(ap, what_fmt);
    vsnprintf(what, sizeof what, what_fmt, ap);
    va_end(ap);
    size_t bytes;
    if (mc_mul_overflows(floats ? floats : 1, sizeof(float), &bytes))
        return mc_fail_nomem_n(ld->err, floats, sizeof(float), "%s", what);
    mc_backend *be = ld->backend;
    void *buffer = be->ops->alloc(be, bytes, what, ld->err);
    if (buffer == NULL)
        return ld->err->status;
    const mc_status filled = floats ? be->ops->upload(be, buffer, host, floats * sizeof(float), ld->err) : MC_OK;
    return keep_buffer(ld, buffer, bytes, filled, out);
}

mc_status mc_loader_check_sizes(mc_loader *ld, const mc_shape_size *sizes, size_t count) {
    for (size_t i = 0; i < count; i++)
        if (sizes[i].value < 1)
            return mc_fail(ld->err, MC_ERR_VALUE, "%s: the %s read from '%s' is %lld; it must be at least 1",
                           ld->file->path, sizes[i].what, sizes[i].key, (long long)sizes[i].value);
    return MC_OK;
}

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
            return mc_fail(err, MC_ERR_NOMEM, "allocation list cannot grow past %lld entries",
                           (long long)list->capacity);
        void **moved = realloc(list->ptrs, fresh_bytes);
        if (moved == NULL)
            return mc_fail(err, MC_ERR_NOMEM, "out of memory growing the allocation list to %lld entries",
                           (long long)fresh);
        list->ptrs = moved;
        list->capacity = fresh;
    }
    list->ptrs[list->count++] = ptr;
    list->bytes += bytes;
    return MC_OK;
}

/* "[2, 3]" for messages; "[]" for a scalar. */
static const char *shape_text(const int64_t *shape, int ndim, char *buf, size_t size) {
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

/* Grow-only host buffer for conversions; contents are not preserved. */
static float *host_scratch(mc_loader *ld, size_t floats) {
    if (ld->host_scratch_floats >= floats && ld->host_scratch != NULL)
        return ld->host_scratch;
    size_t bytes;
    if (mc_mul_overflows(floats, sizeof(float), &bytes)) {
        mc_fail(ld->err, MC_ERR_NOMEM, "%s: conversion buffer of %zu floats overflows", ld->file->path, floats);
        return NULL;
    }
    float *fresh = mc_aligned_alloc(bytes);
    if (fresh == NULL) {
        mc_fail(ld->err, MC_ERR_NOMEM, "%s: cannot allocate a %zu-byte conversion buffer", ld->file->path, bytes);
        return NULL;
    }
    mc_aligned_free(ld->host_scratch);
    ld->host_scratch = fresh;
    ld->host_scratch_floats = floats;
    return fresh;
}

/* [O, I, kh, kw] -> [O, kh, kw, I], the layout conv2d expects. */
static void repack_conv_ohwi(const float *src, float *dst, const int64_t shape[4]) {
    int64_t out_ch = shape[0], in_ch = shape[1], kh = shape[2], kw = shape[3];
    for (int64_t o = 0; o < out_ch; o++)
        for (int64_t i = 0; i < in_ch; i++)
            for (int64_t y = 0; y < kh; y++)
                for (int64_t x = 0; x < kw; x++)
                    dst[((o * kh + y) * kw + x) * in_ch + i] = src[((o * in_ch + i) * kh + y) * kw + x];
}

mc_status mc_bind(mc_loader *ld, const char *name, int ndim, const int64_t *shape, mc_bind_layout layout,
                  float **out) {
    char expected[256], actual[256];
    *out = NULL;
    const char *path = ld->file->path;
    const mc_st_tensor *t = mc_st_find(ld->file, name);
    if (t == NULL)
        return mc_fail(ld->err, MC_ERR_KEY, "%s: missing key '%s' (expected shape %s)", path, name,
                       shape_text(shape, ndim, expected, sizeof expected));
    int same = (t->ndim == ndim);
    for (int d = 0; same && d < ndim; d++)
        same = (t->shape[d] == shape[d]);
    if (!same)
        return mc_fail(ld->err, MC_ERR_VALUE, "%s: key '%s' has shape %s, expected %s", path, name,
                       shape_text(t->shape, t->ndim, actual, sizeof actual),
                       shape_text(shape, ndim, expected, sizeof expected));
    if (layout == MC_BIND_CONV_OHWI && ndim != 4)
        return mc_fail(ld->err, MC_ERR_INTERNAL, "%s: key '%s': conv repacking needs a 4-D shape, got %d-D", path,
                       name, ndim);
    if (layout == MC_BIND_LINEAR && ndim != 2)
        return mc_fail(ld->err, MC_ERR_INTERNAL, "%s: key '%s': a linear weight needs a 2-D shape, got %d-D", path,
                       name, ndim);
    mc_backend *be = ld->backend;
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
    const void *host_src;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    const int direct = (t->dtype == MC_DT_F32 && layout == MC_BIND_AS_IS);
#else
    const int direct = 0;
#endif
    if (direct) {
        /* Stored bytes already are the wanted floats: upload straight from
         * the mapping (upload is a byte copy, so alignment does not matter). */
        host_src = t->data;
    } else {
        /* The conv repack and the 16-bit rounding need a second region;
         * both halves share one buffer. */
        size_t scratch_floats = layout != MC_BIND_AS_IS ? 2 * numel : numel;
        float *scratch = host_scratch(ld, scratch_floats ? scratch_floats : 1);
        if (scratch == NULL)
            return ld->err->status;
        MC_TRY(mc_st_to_f32(ld->file, t, scratch, ld->err));
        if (layout == MC_BIND_CONV_OHWI) {
            repack_conv_ohwi(scratch, scratch + numel, t->shape);
            host_src = scratch + numel;
        } else if (to_16bit) {
            uint16_t *packed = (uint16_t *)(scratch + numel);
            for (size_t i = 0; i < numel; i++)
                packed[i] = mc_wtype_pack(be->linear_wtype, scratch[i]);
            host_src = packed;
        } else {
            host_src = scratch;
        }
    }

    /* Never ask a backend for 0 bytes: some return NULL for that. */
    size_t alloc_bytes = bytes ? bytes : sizeof(float);
    void *buffer = be->ops->alloc(be, alloc_bytes, ld->err);
    if (buffer == NULL)
        return mc_fail(ld->err, MC_ERR_NOMEM, "%s: cannot allocate %zu bytes for key '%s'", path, alloc_bytes,
                       name);
    mc_status status = MC_OK;
    if (bytes)
        status = be->ops->upload(be, buffer, host_src, bytes, ld->err);
    if (status == MC_OK)
        status = mc_alloc_list_push(&ld->allocations, buffer, alloc_bytes, ld->err);
    if (status != MC_OK) {
        be->ops->release(be, buffer);
        return status;
    }
    *out = buffer;
    return MC_OK;
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
    char expected[256], actual[256];
    const char *path = ld->file->path;
    const mc_st_tensor *t = mc_st_find(ld->file, name);
    if (t == NULL)
        return mc_fail(ld->err, MC_ERR_KEY, "%s: missing key '%s' (expected shape %s)", path, name,
                       shape_text(shape, ndim, expected, sizeof expected));
    int same = (t->ndim == ndim);
    for (int d = 0; same && d < ndim; d++)
        same = (t->shape[d] == shape[d]);
    if (!same)
        return mc_fail(ld->err, MC_ERR_VALUE, "%s: key '%s' has shape %s, expected %s", path, name,
                       shape_text(t->shape, t->ndim, actual, sizeof actual),
                       shape_text(shape, ndim, expected, sizeof expected));
    return mc_st_to_f32(ld->file, t, dst, ld->err);
}

mc_status mc_loader_upload(mc_loader *ld, const float *host, size_t floats, float **out) {
    *out = NULL;
    size_t bytes;
    if (mc_mul_overflows(floats ? floats : 1, sizeof(float), &bytes))
        return mc_fail(ld->err, MC_ERR_NOMEM, "%s: upload of %zu floats overflows", ld->file->path,
                       floats);
    mc_backend *be = ld->backend;
    void *buffer = be->ops->alloc(be, bytes, ld->err);
    if (buffer == NULL)
        return ld->err->status;
    mc_status status = MC_OK;
    if (floats)
        status = be->ops->upload(be, buffer, host, floats * sizeof(float), ld->err);
    if (status == MC_OK)
        status = mc_alloc_list_push(&ld->allocations, buffer, bytes, ld->err);
    if (status != MC_OK) {
        be->ops->release(be, buffer);
        return status;
    }
    *out = buffer;
    return MC_OK;
}

mc_status mc_loader_check_sizes(mc_loader *ld, const mc_shape_size *sizes, size_t count) {
    for (size_t i = 0; i < count; i++)
        if (sizes[i].value < 1)
            return mc_fail(ld->err, MC_ERR_VALUE, "%s: the %s read from '%s' is %lld; it must be at least 1",
                           ld->file->path, sizes[i].what, sizes[i].key, (long long)sizes[i].value);
    return MC_OK;
}

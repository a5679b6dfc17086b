#include "workspace.h"

#include <stdio.h>
#include <string.h>

void *mc_buffer_reserve(mc_backend *be, mc_buffer *buf, size_t count, size_t elem_size, const char *what,
                        mc_err *err) {
    size_t bytes;
    if (mc_mul_overflows(count > 0 ? count : 1, elem_size, &bytes)) {
        mc_fail_nomem_n(err, count, elem_size, "workspace buffer %s", what);
        return NULL;
    }
    if (buf->data != NULL && buf->bytes >= bytes)
        return buf->data;
    char named[128];
    snprintf(named, sizeof named, "workspace buffer %s", what);
    void *fresh = be->ops->alloc(be, bytes, named, err);
    if (fresh == NULL)
        return NULL;
    if (buf->data != NULL)
        be->ops->release(be, buf->data);
    buf->data = fresh;
    buf->bytes = bytes;
    return fresh;
}

int32_t *mc_buffer_upload_ints(mc_backend *be, mc_buffer *buf, const int32_t *host, int64_t count, const char *what,
                               mc_err *err) {
    int32_t *dev = mc_buffer_ints(be, buf, (size_t)(count > 0 ? count : 0), what, err);
    if (dev == NULL)
        return NULL;
    if (count > 0 && be->ops->upload(be, dev, host, (size_t)count * sizeof(int32_t), err) != MC_OK)
        return NULL;
    return dev;
}

void mc_buffer_release(mc_backend *be, mc_buffer *buf) {
    if (buf->data != NULL)
        be->ops->release(be, buf->data);
    memset(buf, 0, sizeof *buf);
}

void mc_buffers_release(mc_backend *be, mc_buffer *first, size_t count) {
    for (size_t i = 0; i < count; i++)
        mc_buffer_release(be, &first[i]);
}

size_t mc_buffers_bytes(const mc_buffer *first, size_t count) {
    size_t total = 0;
    for (size_t i = 0; i < count; i++)
        total += first[i].bytes;
    return total;
}

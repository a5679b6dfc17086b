/* Named activation buffers (in the style of llm.c's ActivationTensors): a
 * model, the sampler and the cache policies each keep a struct whose members
 * are mc_buffer, one per activation, addressed by name and never by an
 * integer slot. A buffer grows on demand and never shrinks, so after the
 * first call of a given size nothing is allocated; growing drops the old
 * contents (buffers hold activations of the current pass only). */
#ifndef MC_WORKSPACE_H
#define MC_WORKSPACE_H

#include <stddef.h>
#include <stdint.h>

#include "ops.h"

typedef struct mc_buffer {
    void *data;   /* backend memory, or NULL before the first request */
    size_t bytes; /* capacity */
} mc_buffer;

/* At least count * elem_size bytes of `buf`, grown (contents lost) when it
 * holds fewer. A request of 0 elements still returns a valid pointer. NULL
 * with err set when the size overflows or the backend is out of memory
 * (MC_ERR_NOMEM naming `what` and the bytes). */
void *mc_buffer_reserve(mc_backend *be, mc_buffer *buf, size_t count, size_t elem_size, const char *what,
                        mc_err *err);

static inline float *mc_buffer_floats(mc_backend *be, mc_buffer *buf, size_t count, const char *what,
                                      mc_err *err) {
    return (float *)mc_buffer_reserve(be, buf, count, sizeof(float), what, err);
}

static inline int32_t *mc_buffer_ints(mc_backend *be, mc_buffer *buf, size_t count, const char *what,
                                      mc_err *err) {
    return (int32_t *)mc_buffer_reserve(be, buf, count, sizeof(int32_t), what, err);
}

/* An int32 buffer holding a copy of host[0..count) (uploaded). */
int32_t *mc_buffer_upload_ints(mc_backend *be, mc_buffer *buf, const int32_t *host, int64_t count, const char *what,
                               mc_err *err);

void mc_buffer_release(mc_backend *be, mc_buffer *buf);

/* Releases every member of a struct made only of mc_buffer members (a named
 * activation set): MC_BUFFERS_RELEASE(be, &model->acts). */
void mc_buffers_release(mc_backend *be, mc_buffer *first, size_t count);
#define MC_BUFFERS_RELEASE(be, set_ptr)                                                                        \
    mc_buffers_release((be), (mc_buffer *)(void *)(set_ptr), sizeof *(set_ptr) / sizeof(mc_buffer))

/* Bytes held by such a struct (telemetry). */
size_t mc_buffers_bytes(const mc_buffer *first, size_t count);
#define MC_BUFFERS_BYTES(set_ptr)                                                                              \
    mc_buffers_bytes((const mc_buffer *)(const void *)(set_ptr), sizeof *(set_ptr) / sizeof(mc_buffer))

#endif

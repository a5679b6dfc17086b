/* Binding of checkpoint tensors to model structs: look a name up in a
 * safetensors file, check its shape, convert to float32 once and upload it
 * to the backend. Every failure names the file, the key, and the expected
 * and actual shapes. The loader owns what it uploads until the model takes
 * the allocation list over with mc_loader_take_allocations(). */
#ifndef MC_BIND_H
#define MC_BIND_H

#include <stdint.h>

#include "../backend/ops.h"
#include "../core/mc_core.h"
#include "safetensors.h"

typedef enum mc_bind_layout {
    MC_BIND_AS_IS = 0,     /* keep the stored C-order layout */
    MC_BIND_CONV_OHWI = 1, /* 4-D conv weight [O, I, kh, kw] repacked to [O, kh, kw, I] */
    MC_BIND_LINEAR = 2     /* 2-D weight of the `linear` op: stored in the backend's
                              linear_wtype (16-bit types rounded to nearest even) */
} mc_bind_layout;

/* Device allocations made on behalf of a model, freed together. */
typedef struct mc_alloc_list {
    void **ptrs;
    int64_t count;
    int64_t capacity;
    size_t bytes;
} mc_alloc_list;

typedef struct mc_loader {
    const mc_st_file *file;
    mc_backend *backend;
    mc_err *err;
    mc_alloc_list allocations;
    float *host_scratch; /* conversion buffer, grown as needed */
    size_t host_scratch_floats;
} mc_loader;

void mc_loader_init(mc_loader *ld, const mc_st_file *file, mc_backend *backend, mc_err *err);
/* Frees the scratch and, unless taken over, every upload. */
void mc_loader_finish(mc_loader *ld);
/* Hands the allocation list to the caller (who frees it with mc_alloc_list_free). */
mc_alloc_list mc_loader_take_allocations(mc_loader *ld);
void mc_alloc_list_free(mc_alloc_list *list, mc_backend *backend);
/* Registers one more allocation in the list (for buffers a model makes itself). */
mc_status mc_alloc_list_push(mc_alloc_list *list, void *ptr, size_t bytes, mc_err *err);

/* Binds `name` (shape must be exactly `shape[0..ndim)`) into a fresh backend
 * buffer of float32. Missing key -> MC_ERR_KEY; wrong rank or shape ->
 * MC_ERR_VALUE; both messages name the file and the key. */
mc_status mc_bind(mc_loader *ld, const char *name, int ndim, const int64_t *shape,
                  mc_bind_layout layout, float **out);

/* A weight of the `linear` op, [out_features, in_features], stored in the
 * backend's linear_wtype (MC_BIND_LINEAR); name as a printf format. */
mc_status mc_bind_linearf(mc_loader *ld, void **out, int64_t out_features, int64_t in_features,
                          const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 5, 6)))
#endif
    ;

/* printf-style name variant: mc_bindf(ld, &p, 2, (int64_t[]){a, b}, "blocks.%d.w", i). */
mc_status mc_bindf(mc_loader *ld, float **out, int ndim, const int64_t *shape, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 5, 6)))
#endif
    ;

/* True when the file has a tensor of this name. */
int mc_loader_has(const mc_loader *ld, const char *name);
/* Shape of a tensor (ndim and dims) without binding it; MC_ERR_KEY when absent. */
mc_status mc_loader_shape(mc_loader *ld, const char *name, int *ndim, int64_t shape[8]);

/* Host-side variants for models that transform weights before upload
 * (FID-Inception folds BatchNorm into its convolutions): mc_bind_host
 * checks `name` exactly as mc_bind does and converts it to float32 into
 * dst (numel floats, the stored C order); mc_loader_upload copies `floats`
 * host floats into a fresh backend buffer recorded in the loader's list
 * (what_fmt names it in an out-of-memory message). */
mc_status mc_bind_host(mc_loader *ld, const char *name, int ndim, const int64_t *shape, float *dst);
mc_status mc_loader_upload(mc_loader *ld, const float *host, size_t floats, float **out, const char *what_fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 5, 6)))
#endif
    ;

/* A size of a model's configuration read back from a tensor's shape: what it is (for the
 * message), the tensor it came from, its value. */
typedef struct mc_shape_size {
    const char *what, *key;
    int64_t value;
} mc_shape_size;

/* MC_ERR_VALUE naming the first of `count` sizes below 1: a zero read from a shape gives
 * empty buffers and loops (a width-0 MAR "generated"), not a model. */
mc_status mc_loader_check_sizes(mc_loader *ld, const mc_shape_size *sizes, size_t count);

#endif

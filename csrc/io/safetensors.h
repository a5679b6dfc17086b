/* A strict safetensors reader (spec: eval_and_formats.md section 9). The
 * file is memory-mapped; the header is validated completely before any
 * tensor is exposed: header length limit, UTF-8 JSON, known dtypes,
 * shape x dtype size == byte length (overflow-checked), offsets sorted
 * contiguous from 0 with no gaps or overlaps, the last end at the file end,
 * no duplicate names, at most 8 dimensions. Tensors need not be aligned. */
#ifndef MC_SAFETENSORS_H
#define MC_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "../core/mc_core.h"

#define MC_ST_MAX_DIMS 8
#define MC_ST_MAX_HEADER 100000000ull

typedef enum mc_dtype {
    MC_DT_BOOL, MC_DT_U8, MC_DT_I8, MC_DT_F8_E5M2, MC_DT_F8_E4M3, MC_DT_I16, MC_DT_U16,
    MC_DT_F16, MC_DT_BF16, MC_DT_I32, MC_DT_U32, MC_DT_F32, MC_DT_F64, MC_DT_I64, MC_DT_U64
} mc_dtype;

typedef struct mc_st_tensor {
    char *name;
    mc_dtype dtype;
    int ndim;
    int64_t shape[MC_ST_MAX_DIMS];
    uint64_t begin, end;  /* relative to the data section */
    const uint8_t *data;  /* points into the mapping; may be unaligned */
} mc_st_tensor;

typedef struct mc_st_file {
    char *path;
    void *mapping;
    size_t mapping_size;
    int64_t n_tensors;
    mc_st_tensor *tensors;  /* in header order */
    int64_t n_metadata;
    char **metadata_keys;
    char **metadata_values;
    int64_t *name_order;    /* tensor indices sorted by name, for mc_st_find's binary search */
} mc_st_file;

/* Missing file -> MC_ERR_NOT_FOUND; unreadable -> MC_ERR_IO; any format
 * violation -> MC_ERR_VALUE with the path and the rule that failed. */
mc_status mc_st_open(const char *path, mc_st_file **out, mc_err *err);
void mc_st_close(mc_st_file *file);

const mc_st_tensor *mc_st_find(const mc_st_file *file, const char *name);
const char *mc_st_metadata(const mc_st_file *file, const char *key); /* NULL if absent */
const char *mc_dtype_name(mc_dtype dtype);
size_t mc_dtype_size(mc_dtype dtype);
int64_t mc_st_numel(const mc_st_tensor *tensor);
/* "[2, 3]" (or "[]" for a scalar) into buf, for error messages; returns buf. */
const char *mc_st_shape_text(const int64_t *shape, int ndim, char *buf, size_t size);

/* Converts a F32, F16, BF16 or F64 tensor to float32 in `dst` (numel
 * floats); other dtypes -> MC_ERR_VALUE naming the key and dtype. The file
 * pages read are released afterwards (mc_st_release). */
mc_status mc_st_to_f32(const mc_st_file *file, const mc_st_tensor *tensor, float *dst, mc_err *err);
/* The same for elements [first, first + count) of the tensor (C order), into
 * dst[0 .. count); a range outside the tensor -> MC_ERR_INTERNAL. */
mc_status mc_st_to_f32_range(const mc_st_file *file, const mc_st_tensor *tensor, size_t first, size_t count,
                             float *dst, mc_err *err);
/* Drops the mapped pages holding elements [first, first + count) of `tensor`
 * from the process's resident set once they have been read (madvise
 * MADV_DONTNEED; they stay in the page cache and a later read faults them in
 * again from the file). Loading releases each piece it has consumed, so the
 * file's pages never add up to a second copy of the weights in RSS. */
void mc_st_release(const mc_st_file *file, const mc_st_tensor *tensor, size_t first, size_t count);

#endif

/* The backend a model runs on, from the device string and dtype the Python
 * side passes ("cpu", "guard", "cuda", "cuda:N"; "fp32", "bf16", "fp16").
 * marcache/model.py resolves "auto" and checks the strings first; these
 * checks repeat them so _C can be called directly. */
#include "py_backend.h"

#include <stdlib.h>
#include <string.h>

#ifdef MC_HAVE_CUDA
#include "../backend/cuda/cuda_backend.h"
#endif

int mcpy_parse_wtype(const char *dtype, mc_wtype *out) {
    static const char *const names[] = {"fp32", "bf16", "fp16", NULL};
    static const mc_wtype wtypes[] = {MC_WTYPE_F32, MC_WTYPE_BF16, MC_WTYPE_F16};
    const int i = mcpy_choice(dtype, names, "dtype");
    if (i < 0)
        return -1;
    *out = wtypes[i];
    return 0;
}

/* "cuda" -> 0, "cuda:N" -> N; -1 for anything else. */
static int cuda_index(const char *device) {
    if (strcmp(device, "cuda") == 0)
        return 0;
    if (strncmp(device, "cuda:", 5) != 0 || device[5] == '\0')
        return -1;
    char *end = NULL;
    long index = strtol(device + 5, &end, 10);
    if (*end != '\0' || index < 0 || index > 1023 || device[5] == '+' || device[5] == '-' ||
        device[5] == ' ')
        return -1;
    return (int)index;
}

mc_status mcpy_backend_open(const char *device, int threads, mc_wtype wtype, mc_backend **out,
                            mc_err *err) {
    *out = NULL;
    mc_status st;
    if (strcmp(device, "cpu") == 0) {
        st = mc_backend_cpu_create(out, threads, err);
    } else if (strcmp(device, "guard") == 0) {
        st = mc_backend_guard_create(out, threads, err);
    } else if (cuda_index(device) >= 0) {
#ifdef MC_HAVE_CUDA
        int index = cuda_index(device), count = mc_cuda_device_count();
        if (index >= count)
            return mc_fail(err, MC_ERR_VALUE, "device '%s': %d CUDA device%s found", device, count,
                           count == 1 ? "" : "s");
        st = mc_backend_cuda_create(out, index, err);
#else
        return mc_fail(err, MC_ERR_VALUE,
                       "device '%s': this build of marcache has no CUDA backend (rebuild with "
                       "MARCACHE_CUDA=1 where nvcc is installed)",
                       device);
#endif
    } else {
        return mc_fail(err, MC_ERR_VALUE,
                       "device must be 'cpu', 'cuda', 'cuda:N' or 'guard', got '%s'", device);
    }
    if (st == MC_OK)
        (*out)->linear_wtype = wtype;
    return st;
}

mc_status mcpy_load_model(const char *path, const char *device, int threads, mc_wtype wtype,
                          mcpy_model_loader load, void *model, mc_backend **backend, mc_err *err) {
    mc_st_file *file = NULL;
    *backend = NULL;
    mc_status st = mc_st_open(path, &file, err);
    if (st == MC_OK)
        st = mcpy_backend_open(device, threads, wtype, backend, err);
    if (st == MC_OK)
        st = load(*backend, file, model, err);
    mc_st_close(file);
    if (st != MC_OK) {
        mc_backend_destroy(*backend);
        *backend = NULL;
    }
    return st;
}

int mcpy_ensure_lock(PyThread_type_lock *lock) {
    if (*lock == NULL && (*lock = PyThread_allocate_lock()) == NULL) {
        mcpy_no_memory("a model lock", sizeof(void *));
        return -1;
    }
    return 0;
}

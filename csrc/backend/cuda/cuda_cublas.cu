/* cuBLAS, loaded at run time (dlopen) when the first CUDA backend is made,
 * so that a CUDA build of marcache imports and runs on the CPU where the
 * nvidia-cublas wheel is not installed (the extension has no NEEDED entry
 * for libcublas; the CUDA runtime is linked statically and itself only
 * dlopens the driver).
 *
 * Where it looks, in this order (the first library that loads, exports every
 * symbol below and has the major version of the headers we were compiled
 * against wins; the others are not tried):
 *   1. MARCACHE_CUBLAS: a folder with lib/libcublas.so.<major> (the variable
 *      setup.py reads at build time). When set, nothing else is tried: an
 *      explicit choice that fails must not silently become another library.
 *   2. The folders the Python package registered (marcache/_cuda_libs.py):
 *      the nvidia-cublas wheel's nvidia/cu13/lib (CUDA 13) or
 *      nvidia/cublas/lib (CUDA 11/12) on this interpreter's sys.path.
 *   3. The toolkit: $CUDA_HOME/lib64, $CUDA_PATH/lib64, then the toolkit
 *      setup.py compiled with.
 *   4. The library setup.py found at build time (MC_CUBLAS_BUILD_LIB).
 *   5. The system loader (LD_LIBRARY_PATH, ldconfig): libcublas.so.<major>.
 * This is setup.py's order (MARCACHE_CUBLAS, the wheel, the toolkit), so
 * the library used at run time is the one the build found unless the
 * environment changed. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_internal.h"

#ifndef MC_CUBLAS_BUILD_LIB
#define MC_CUBLAS_BUILD_LIB ""
#endif
#ifndef MC_CUDA_BUILD_ROOT
#define MC_CUDA_BUILD_ROOT ""
#endif

#define MC_STR2(x) #x
#define MC_STR(x) MC_STR2(x)
/* "libcublas.so.13" for the headers of cuBLAS 13. */
#define MC_CUBLAS_SONAME "libcublas.so." MC_STR(CUBLAS_VER_MAJOR)

/* The pip requirement that provides this major version (what the error
 * message tells the user to install): from CUDA 13 one "nvidia-cublas"
 * package versioned like cuBLAS, before it one package per major version. */
static void cublas_wheel(char *buf, size_t size) {
    if (CUBLAS_VER_MAJOR >= 13)
        snprintf(buf, size, "nvidia-cublas>=%d,<%d", CUBLAS_VER_MAJOR, CUBLAS_VER_MAJOR + 1);
    else
        snprintf(buf, size, "nvidia-cublas-cu%d", CUBLAS_VER_MAJOR);
}

mc_cublas_api mc_cublas;

/* Guarded by load_lock: the table above is written once, before `loaded`
 * is set; readers that saw loaded == 1 (under the lock) may use it freely. */
static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;
static int loaded;
static char loaded_path[4096];
static int loaded_version;
/* Folders registered by the Python package (step 2), '\n'-separated. */
static char *registered_dirs;

extern "C" mc_status mc_cuda_cublas_register_dirs(const char *const *dirs, int count, mc_err *err) {
    size_t total = 1;
    for (int i = 0; i < count; i++)
        total += strlen(dirs[i]) + 1;
    char *joined = (char *)malloc(total);
    if (joined == NULL)
        return mc_fail_nomem(err, total, "the list of cuBLAS search folders");
    joined[0] = '\0';
    for (int i = 0; i < count; i++) {
        strcat(joined, dirs[i]);
        strcat(joined, "\n");
    }
    pthread_mutex_lock(&load_lock);
    free(registered_dirs);
    registered_dirs = joined;
    pthread_mutex_unlock(&load_lock);
    return MC_OK;
}

/* Appends "path (reason); " to the list of what was tried, as far as it fits;
 * a cut list ends in "...". (snprintf's result is looked at: GCC 13's
 * -Wformat-truncation, on in -Wall, warns about a bounded print whose result
 * is unused when the output may be cut; nvcc's host compiler on the H100/H200
 * machines is GCC 13.) */
static void note_attempt(char *tried, size_t size, const char *path, const char *reason) {
    const size_t used = strlen(tried);
    if (used + 4 >= size)
        return;
    const int n = snprintf(tried + used, size - used, "%s%s (%s)", used > 0 ? "; " : "", path, reason);
    if (n < 0 || (size_t)n >= size - used)
        memcpy(tried + size - 4, "...", 4);
}

/* src into buf (size > 0); 0 when it had to be cut to fit. A copy, not
 * snprintf("%s"): that one draws -Wformat-truncation wherever a caller has no
 * use for the result. */
static int copy_string(char *buf, size_t size, const char *src) {
    const size_t len = strnlen(src, size);
    const int fits = len < size;
    const size_t kept = fits ? len : size - 1;
    memcpy(buf, src, kept);
    buf[kept] = '\0';
    return fits;
}

/* dlsym into *slot; the symbol names are the exported ones (the _v2 names
 * that cublas_v2.h's macros map cublasCreate etc. to). */
template <typename F> static int resolve(void *lib, const char *name, F *slot, const char **missing) {
    void *p = dlsym(lib, name);
    if (p == NULL) {
        *missing = name;
        return 0;
    }
    *slot = (F)p;
    return 1;
}

/* Tries one library: 1 when it is loaded into `api` with the right major
 * version; 0 with the reason noted in `tried`. */
static int try_library(const char *path, mc_cublas_api *api, int *version, char *tried,
                       size_t tried_size) {
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        const char *why = dlerror();
        note_attempt(tried, tried_size, path, why != NULL ? why : "dlopen failed");
        return 0;
    }
    mc_cublas_api t;
    memset(&t, 0, sizeof t);
    const char *missing = NULL;
    const int all = resolve(lib, "cublasCreate_v2", &t.create, &missing) &&
                    resolve(lib, "cublasDestroy_v2", &t.destroy, &missing) &&
                    resolve(lib, "cublasSetStream_v2", &t.set_stream, &missing) &&
                    resolve(lib, "cublasSetWorkspace_v2", &t.set_workspace, &missing) &&
                    resolve(lib, "cublasSetMathMode", &t.set_math_mode, &missing) &&
                    resolve(lib, "cublasSetAtomicsMode", &t.set_atomics_mode, &missing) &&
                    resolve(lib, "cublasGemmEx", &t.gemm_ex, &missing) &&
                    resolve(lib, "cublasGetProperty", &t.get_property, &missing) &&
                    resolve(lib, "cublasGetStatusString", &t.get_status_string, &missing) &&
                    resolve(lib, "cublasGetStatusName", &t.get_status_name, &missing);
    if (!all) {
        char why[256];
        snprintf(why, sizeof why, "no symbol %s", missing);
        note_attempt(tried, tried_size, path, why);
        dlclose(lib);
        return 0;
    }
    int major = 0, minor = 0, patch = 0;
    if (t.get_property(MAJOR_VERSION, &major) != CUBLAS_STATUS_SUCCESS ||
        t.get_property(MINOR_VERSION, &minor) != CUBLAS_STATUS_SUCCESS ||
        t.get_property(PATCH_LEVEL, &patch) != CUBLAS_STATUS_SUCCESS) {
        note_attempt(tried, tried_size, path, "cublasGetProperty failed");
        dlclose(lib);
        return 0;
    }
    if (major != CUBLAS_VER_MAJOR) {
        /* Another major version has another ABI (and soname): never mix. */
        char why[128];
        snprintf(why, sizeof why, "version %d.%d.%d, this build needs %d.x", major, minor, patch,
                 CUBLAS_VER_MAJOR);
        note_attempt(tried, tried_size, path, why);
        dlclose(lib);
        return 0;
    }
    *api = t;
    *version = major * 10000 + minor * 100 + patch;
    return 1; /* the library stays loaded for the life of the process */
}

/* "<dir>/libcublas.so.N" into buf; 0 when it does not fit. */
static int in_dir(char *buf, size_t size, const char *dir, const char *sub) {
    const int n = snprintf(buf, size, "%s%s/" MC_CUBLAS_SONAME, dir, sub);
    return n > 0 && (size_t)n < size;
}

extern "C" mc_status mc_cuda_cublas_load(mc_err *err) {
    pthread_mutex_lock(&load_lock);
    if (loaded) {
        pthread_mutex_unlock(&load_lock);
        return MC_OK;
    }
    /* The candidates in the order of the comment at the top. */
    char candidates[16][4096];
    int n = 0;
    const char *explicit_dir = getenv("MARCACHE_CUBLAS");
    if (explicit_dir != NULL && explicit_dir[0] != '\0') {
        n += in_dir(candidates[n], sizeof candidates[n], explicit_dir, "/lib");
    } else {
        for (const char *d = registered_dirs; d != NULL && *d != '\0' && n < 8;) {
            const char *end = strchr(d, '\n');
            const size_t len = end != NULL ? (size_t)(end - d) : strlen(d);
            char dir[4000];
            if (len > 0 && len < sizeof dir) {
                memcpy(dir, d, len);
                dir[len] = '\0';
                n += in_dir(candidates[n], sizeof candidates[n], dir, "");
            }
            d = end != NULL ? end + 1 : d + len;
        }
        const char *roots[] = {getenv("CUDA_HOME"), getenv("CUDA_PATH"), MC_CUDA_BUILD_ROOT};
        for (const char *root : roots)
            if (root != NULL && root[0] != '\0' && n < 13)
                n += in_dir(candidates[n], sizeof candidates[n], root, "/lib64");
        if (MC_CUBLAS_BUILD_LIB[0] != '\0')
            snprintf(candidates[n++], sizeof candidates[0], "%s", MC_CUBLAS_BUILD_LIB);
        snprintf(candidates[n++], sizeof candidates[0], "%s", MC_CUBLAS_SONAME);
    }
    char tried[3000] = "";
    mc_cublas_api api;
    int version = 0;
    for (int i = 0; i < n; i++) {
        /* A full path that does not exist is noted without a dlopen (whose
         * message would say the same at more length); the bare soname goes
         * to the system loader. */
        if (strchr(candidates[i], '/') != NULL && access(candidates[i], F_OK) != 0) {
            note_attempt(tried, sizeof tried, candidates[i], "no such file");
            continue;
        }
        if (try_library(candidates[i], &api, &version, tried, sizeof tried)) {
            mc_cublas = api;
            /* candidates[i] fits: both buffers hold 4096 bytes. */
            copy_string(loaded_path, sizeof loaded_path, candidates[i]);
            /* The file the system loader chose for a bare soname (kept as
             * the soname where that path would not fit). */
            Dl_info where;
            if (strchr(candidates[i], '/') == NULL && dladdr((void *)api.create, &where) != 0 &&
                where.dli_fname != NULL &&
                !copy_string(loaded_path, sizeof loaded_path, where.dli_fname))
                copy_string(loaded_path, sizeof loaded_path, candidates[i]);
            loaded_version = version;
            loaded = 1;
            pthread_mutex_unlock(&load_lock);
            return MC_OK;
        }
    }
    pthread_mutex_unlock(&load_lock);
    char wheel[64];
    cublas_wheel(wheel, sizeof wheel);
    return mc_fail(err, MC_ERR_INTERNAL,
                   "cuda backend: cuBLAS %d.x could not be loaded; install it with "
                   "pip install \"%s\" (or set MARCACHE_CUBLAS to a folder with lib/%s). "
                   "Tried: %s",
                   CUBLAS_VER_MAJOR, wheel, MC_CUBLAS_SONAME, tried);
}

extern "C" int mc_cuda_cublas_loaded(char *path, size_t size) {
    pthread_mutex_lock(&load_lock);
    const int version = loaded ? loaded_version : 0;
    if (size > 0)
        snprintf(path, size, "%s", loaded ? loaded_path : "");
    pthread_mutex_unlock(&load_lock);
    return version;
}

extern "C" int mc_cuda_cublas_major(void) { return CUBLAS_VER_MAJOR; }

/* Build facts and backend probes of marcache._C: build_info(),
 * sgemm_seconds() (the machine's measured GEMM rate for the benchmarks),
 * and the test hooks _guard_probe(), _cpu_graph_probe(), _cuda_pool_probe(), _nomem_message(),
 * _cpu_expf(), _cpu_gelu(), _cpu_silu() and _cpu_softmax(). */
#include "py_numpy.h"

#include <math.h>
#include <string.h>
#include <time.h>

#include "../backend/cpu/cpu_internal.h"
#ifdef MC_HAVE_CUDA
#include "../backend/cuda/cuda_backend.h"
#endif

#ifndef MC_BLAS_NAME
#define MC_BLAS_NAME "unknown"
#endif
/* setup.py records how this build was compiled (build_record_macros). */
#ifndef MC_BUILD_CFLAGS
#define MC_BUILD_CFLAGS ""
#endif
#ifndef MC_BUILD_CFLAGS_ENV
#define MC_BUILD_CFLAGS_ENV ""
#endif
#ifndef MC_BUILD_SANITIZE
#define MC_BUILD_SANITIZE ""
#endif
#ifndef MC_BUILD_WERROR
#define MC_BUILD_WERROR 0
#endif

#ifdef MC_HAVE_CUDA
/* "13.0" from 13000 (cudaRuntimeGetVersion's encoding); None for 0. */
static PyObject *cuda_version_string(int v) {
    if (v <= 0)
        Py_RETURN_NONE;
    return PyUnicode_FromFormat("%d.%d", v / 1000, (v % 1000) / 10);
}
#endif

/* The CUDA entries of build_info: whether the backend is built, the
 * versions of the runtime it links, of the driver and cuBLAS it finds, and
 * the devices usable now (0 without a driver or device: the device query
 * never raises). */
static int add_cuda_info(PyObject *info) {
#ifdef MC_HAVE_CUDA
    int count = mc_cuda_device_count();
    PyObject *names = PyList_New(count);
    if (names == NULL)
        return -1;
    for (int i = 0; i < count; i++) {
        char name[256];
        mc_cuda_device_name(i, name, sizeof name);
        PyObject *s = PyUnicode_FromString(name);
        if (s == NULL) {
            Py_DECREF(names);
            return -1;
        }
        PyList_SET_ITEM(names, i, s);
    }
    /* cuBLAS is loaded with the first CUDA backend: until then its version
     * and file are None and cublas_status says so. */
    char cublas_path[4096];
    const int cublas = mc_cuda_cublas_loaded(cublas_path, sizeof cublas_path);
    PyObject *cublas_s = cublas > 0 ? PyUnicode_FromFormat("%d.%d.%d", cublas / 10000,
                                                           (cublas / 100) % 100, cublas % 100)
                                    : (Py_INCREF(Py_None), Py_None);
    PyObject *cublas_file = cublas > 0 ? PyUnicode_DecodeFSDefault(cublas_path)
                                       : (Py_INCREF(Py_None), Py_None);
    PyObject *cublas_status =
        cublas > 0 ? PyUnicode_FromString("loaded")
                   : PyUnicode_FromFormat("not loaded yet: cuBLAS %d.x is loaded when the first "
                                          "CUDA model or backend is made",
                                          mc_cuda_cublas_major());
    PyObject *entries = Py_BuildValue(
        "{s:O,s:N,s:N,s:N,s:N,s:N,s:i,s:N,s:s}", "cuda", Py_True, "cuda_runtime",
        cuda_version_string(mc_cuda_runtime_version()), "cuda_driver",
        cuda_version_string(mc_cuda_driver_version()), "cublas", cublas_s, "cublas_library",
        cublas_file, "cublas_status", cublas_status, "cuda_devices", count, "cuda_device_names",
        names, "cuda_archs", MC_CUDA_ARCHS);
#else
    PyObject *entries = Py_BuildValue(
        "{s:O,s:O,s:O,s:O,s:O,s:s,s:i,s:N,s:O}", "cuda", Py_False, "cuda_runtime", Py_None,
        "cuda_driver", Py_None, "cublas", Py_None, "cublas_library", Py_None, "cublas_status",
        "this build has no CUDA backend", "cuda_devices", 0, "cuda_device_names", PyList_New(0),
        "cuda_archs", Py_None);
#endif
    if (entries == NULL)
        return -1;
    int rc = PyDict_Update(info, entries);
    Py_DECREF(entries);
    return rc;
}

/* The CPU backend's small-row kernels (cpu_smallrow.c): cpu_isa, the
 * instruction set a CPU backend made now uses (MARCACHE_CPU_ISA honoured;
 * a bad value is reported in the string, since build_info must not raise),
 * the sets this CPU supports, smallrow_max, the row threshold
 * (MARCACHE_SMALLROW_MAX honoured; -1 with a bad environment), smallrow_panels
 * (MARCACHE_SMALLROW_PANELS) and panel_max (bound fp32 weights' column-panel
 * threshold; 0 with panels off), huge_pages, cpu_graphs (MARCACHE_CPU_GRAPHS)
 * and gemm_split (MARCACHE_GEMM_SPLIT; "invalid" with a bad environment). */
static int add_cpu_isa_info(PyObject *info) {
    mc_err err = {0};
    mc_cpu_config cfg;
    PyObject *isa_s;
    const char *gemm_split = "invalid";
    if (mc_cpu_config_from_env(&cfg, &err) == MC_OK) {
        isa_s = PyUnicode_FromString(mc_cpu_isa_name(cfg.isa));
        gemm_split = mc_cpu_gemm_split_name(cfg.gemm_split);
    } else {
        isa_s = PyUnicode_FromFormat("invalid: %s", err.msg);
        cfg.smallrow_max = -1;
        cfg.panel_max = -1;
        cfg.panels = -1;
        cfg.huge_pages = -1;
        cfg.graphs = -1;
    }
    PyObject *supported = PyList_New(0);
    static const mc_cpu_isa all[] = {MC_CPU_ISA_AVX512, MC_CPU_ISA_AVX2, MC_CPU_ISA_PLAIN};
    for (size_t k = 0; supported != NULL && k < sizeof all / sizeof all[0]; k++) {
        if (!mc_cpu_isa_supported(all[k]))
            continue;
        PyObject *name = PyUnicode_FromString(mc_cpu_isa_name(all[k]));
        if (name == NULL || PyList_Append(supported, name) < 0)
            Py_CLEAR(supported);
        Py_XDECREF(name);
    }
    if (isa_s == NULL || supported == NULL) {
        Py_XDECREF(isa_s);
        Py_XDECREF(supported);
        return -1;
    }
    PyObject *entries = Py_BuildValue("{s:N,s:N,s:i,s:i,s:i,s:i,s:i,s:s}", "cpu_isa", isa_s, "cpu_isa_supported",
                                      supported, "smallrow_max", cfg.smallrow_max, "smallrow_panels", cfg.panels,
                                      "panel_max", cfg.panels == 0 ? 0 : cfg.panel_max, "huge_pages",
                                      cfg.huge_pages, "cpu_graphs", cfg.graphs, "gemm_split", gemm_split);
    if (entries == NULL)
        return -1;
    int rc = PyDict_Update(info, entries);
    Py_DECREF(entries);
    return rc;
}

static PyObject *build_info(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
#ifdef MC_HAVE_CUDA
    /* The backends run_op and the models can use now (_C.backends()). */
    const char *backends = mc_cuda_device_count() > 0 ? "cpu,guard,cuda" : "cpu,guard";
#else
    const char *backends = "cpu,guard";
#endif
    PyObject *info = Py_BuildValue("{s:s,s:s,s:s,s:s,s:s,s:s,s:s,s:O,s:i,s:s}", "backends", backends, "blas",
                                   MC_BLAS_NAME, "blas_config", mc_cpu_blas_config(), "blas_core",
                                   mc_cpu_blas_core(), "cflags", MC_BUILD_CFLAGS, "cflags_env",
                                   MC_BUILD_CFLAGS_ENV, "sanitize", MC_BUILD_SANITIZE, "werror",
                                   MC_BUILD_WERROR ? Py_True : Py_False, "openmp", _OPENMP, "compiler",
                                   __VERSION__);
    if (info != NULL && (add_cuda_info(info) < 0 || add_cpu_isa_info(info) < 0))
        Py_CLEAR(info);
    return info;
}

/* Times the CPU backend's sgemm (C = A B^T, the nn.Linear form) on
 * uninitialised-free buffers, without Python in the loop: the machine's
 * measured GEMM rate that benchmarks report achieved FLOP/s against. */
static PyObject *sgemm_seconds(PyObject *self, PyObject *args) {
    (void)self;
    long long m, n, k;
    int reps;
    if (!PyArg_ParseTuple(args, "LLLi", &m, &n, &k, &reps))
        return NULL;
    if (m < 1 || n < 1 || k < 1 || reps < 1 || m > 65536 || n > 65536 || k > 65536)
        return PyErr_Format(PyExc_ValueError, "sgemm_seconds: sizes must be in 1..65536 and reps >= 1");
    mc_err err = {0};
    mc_backend *be = NULL;
    float *a = mc_aligned_alloc((size_t)(m * k) * sizeof(float));
    float *b = mc_aligned_alloc((size_t)(n * k) * sizeof(float));
    float *c = mc_aligned_alloc((size_t)(m * n) * sizeof(float));
    double best = 0.0;
    if (a && b && c && mc_backend_cpu_create(&be, 0, &err) == MC_OK) {
        Py_BEGIN_ALLOW_THREADS
        for (long long i = 0; i < m * k; i++)
            a[i] = (float)((i % 17) - 8) * 0.01f;
        for (long long i = 0; i < n * k; i++)
            b[i] = (float)((i % 13) - 6) * 0.01f;
        mc_cpu_sgemm(mc_cpu_threads(be), mc_cpu_gemm_split_of(be), 0, 1, m, n, k, 1.0f, a, k, b, k, 0.0f, c, n);
        for (int r = 0; r < reps; r++) {
            struct timespec t0, t1;
            clock_gettime(CLOCK_MONOTONIC, &t0);
            mc_cpu_sgemm(mc_cpu_threads(be), mc_cpu_gemm_split_of(be), 0, 1, m, n, k, 1.0f, a, k, b, k, 0.0f, c, n);
            clock_gettime(CLOCK_MONOTONIC, &t1);
            double dt = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
            if (r == 0 || dt < best)
                best = dt;
        }
        Py_END_ALLOW_THREADS
    }
    int failed = !(a && b && c && be);
    mc_aligned_free(a);
    mc_aligned_free(b);
    mc_aligned_free(c);
    mc_backend_destroy(be);
    if (failed)
        return err.status != MC_OK ? mcpy_raise(&err)
                                    : mcpy_no_memory("the sgemm probe's matrices", (size_t)(m * k + n * k + m * n) * sizeof(float));
    return PyFloat_FromDouble(best);
}

#ifdef MC_HAVE_CUDA
/* _cuda_pool_probe(sizes, rounds, release_while_recording=False) -> reserved
 * bytes after each round (see mc_cuda_pool_probe); a test hook for the CUDA
 * backend's memory pool. */
static PyObject *cuda_pool_probe(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *seq;
    int rounds, release_while_recording = 0;
    if (!PyArg_ParseTuple(args, "Oi|p", &seq, &rounds, &release_while_recording))
        return NULL;
    PyObject *fast = PySequence_Fast(seq, "sizes must be a sequence of integers");
    if (fast == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    if (rounds < 1 || rounds > 1000 || count > 1000) {
        Py_DECREF(fast);
        return PyErr_Format(PyExc_ValueError, "_cuda_pool_probe: 1..1000 rounds of at most 1000 sizes");
    }
    size_t *sizes = PyMem_Calloc((size_t)count + 1, sizeof *sizes);
    uint64_t *reserved = PyMem_Calloc((size_t)rounds, sizeof *reserved);
    if (sizes == NULL || reserved == NULL) {
        Py_DECREF(fast);
        PyMem_Free(sizes);
        PyMem_Free(reserved);
        return mcpy_no_memory("the pool probe's size lists", ((size_t)count + 1 + (size_t)rounds) * 8);
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        sizes[i] = PyLong_AsSize_t(PySequence_Fast_GET_ITEM(fast, i));
        if (sizes[i] == (size_t)-1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            PyMem_Free(sizes);
            PyMem_Free(reserved);
            return NULL;
        }
    }
    Py_DECREF(fast);
    mc_err err = {0};
    mc_status status;
    Py_BEGIN_ALLOW_THREADS
    status = mc_cuda_pool_probe(0, sizes, (int)count, rounds, release_while_recording, reserved,
                                &err);
    Py_END_ALLOW_THREADS
    PyObject *result = NULL;
    if (status != MC_OK) {
        mcpy_raise(&err);
    } else if ((result = PyList_New(rounds)) != NULL) {
        for (int r = 0; r < rounds; r++)
            PyList_SET_ITEM(result, r, PyLong_FromUnsignedLongLong(reserved[r]));
    }
    PyMem_Free(sizes);
    PyMem_Free(reserved);
    return result;
}
#endif

/* _cublas_register_dirs(list of str): the folders cuda_cublas.cu searches
 * after MARCACHE_CUBLAS and before the toolkit (marcache/_cuda_libs.py
 * passes the nvidia-cublas wheel's). A no-op in a build without CUDA. */
static PyObject *cublas_register_dirs(PyObject *self, PyObject *arg) {
    (void)self;
    PyObject *fast = PySequence_Fast(arg, "_cublas_register_dirs: expected a list of folders");
    if (fast == NULL)
        return NULL;
#ifdef MC_HAVE_CUDA
    const Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    if (count > 64) {
        Py_DECREF(fast);
        return PyErr_Format(PyExc_ValueError, "_cublas_register_dirs: at most 64 folders, got %zd",
                            count);
    }
    const char *dirs[64];
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        if (!PyUnicode_Check(item)) {
            Py_DECREF(fast);
            return PyErr_Format(PyExc_TypeError,
                                "_cublas_register_dirs: folder %zd must be a str, got %s", i,
                                Py_TYPE(item)->tp_name);
        }
        if ((dirs[i] = PyUnicode_AsUTF8(item)) == NULL) {
            Py_DECREF(fast);
            return NULL;
        }
    }
    mc_err err = {0};
    const mc_status st = mc_cuda_cublas_register_dirs(dirs, (int)count, &err);
    Py_DECREF(fast);
    if (st != MC_OK)
        return mcpy_raise(&err);
#else
    Py_DECREF(fast);
#endif
    Py_RETURN_NONE;
}

#ifdef MC_HAVE_CUDA
/* _cublas_load() -> (file, "major.minor.patch"): loads cuBLAS as the first
 * CUDA backend does (a test hook: it runs without a GPU, where making a
 * backend fails on the device first). Raises RuntimeError with the loader's
 * message when no usable library is found. */
static PyObject *cublas_load(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    mc_err err = {0};
    mc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = mc_cuda_cublas_load(&err);
    Py_END_ALLOW_THREADS
    if (st != MC_OK)
        return mcpy_raise(&err);
    char path[4096];
    const int v = mc_cuda_cublas_loaded(path, sizeof path);
    return Py_BuildValue("(NN)", PyUnicode_DecodeFSDefault(path),
                         PyUnicode_FromFormat("%d.%d.%d", v / 10000, (v / 100) % 100, v % 100));
}
#endif

/* _guard_probe(touch) -> float: a test that the guard backend guards. Stores
 * 42.0 in a guard buffer and reads it back through download (allowed); with
 * touch=True it then reads the buffer directly on the host, which must kill
 * the process with SIGSEGV (the test runs it in a subprocess). */
static PyObject *guard_probe(PyObject *self, PyObject *args) {
    (void)self;
    int touch = 0;
    if (!PyArg_ParseTuple(args, "p", &touch))
        return NULL;
    mc_err err = {0};
    mc_backend *be = NULL;
    if (mc_backend_guard_create(&be, 1, &err) != MC_OK)
        return mcpy_raise(&err);
    float value = 42.0f, back = 0.0f;
    float *buffer = be->ops->alloc(be, sizeof value, "the guard probe's buffer", &err);
    mc_status st = buffer == NULL ? err.status : MC_OK;
    if (st == MC_OK)
        st = be->ops->upload(be, buffer, &value, sizeof value, &err);
    if (st == MC_OK)
        st = be->ops->download(be, &back, buffer, sizeof back, &err);
    if (st == MC_OK && touch)
        back = *(volatile float *)buffer; /* faults: the range is PROT_NONE here */
    if (buffer != NULL)
        be->ops->release(be, buffer);
    mc_backend_destroy(be);
    if (st != MC_OK)
        return mcpy_raise(&err);
    return PyFloat_FromDouble((double)back);
}

/* _cpu_graph_probe(threads) -> dict: the CPU backend's graph hooks on one
 * Linear (8 x 1024 x 1024, bound, so it runs on the team) and a copy of its
 * result (tests/test_cpu_graphs.py):
 *   "refused": the message of an allocation inside a recording,
 *   "discarded": capture_end's message for that recording,
 *   "untouched_after_failed": y still zero (nothing ran),
 *   "twice": capture_begin's message inside a recording,
 *   "end_without_begin": capture_end's message with no recording,
 *   "untouched_after_record": y and its copy zero after a clean recording,
 *   "max_diff": largest |graph - direct| over y and the copy after launch,
 *   "team_regions": regions the launch opened,
 *   "off": capture_begin's message with MARCACHE_CPU_GRAPHS=0 (None if on). */
static float probe_max_abs(const float *a, const float *b, size_t n) {
    float m = 0.0f;
    for (size_t i = 0; i < n; i++) {
        const float d = b != NULL ? fabsf(a[i] - b[i]) : fabsf(a[i]);
        m = d > m ? d : m;
    }
    return m;
}

static PyObject *cpu_graph_probe(PyObject *self, PyObject *args) {
    (void)self;
    int threads = 2;
    if (!PyArg_ParseTuple(args, "i", &threads))
        return NULL;
    enum { ROWS = 8, IN = 1024, OUT = 1024 };
    mc_err err = {0};
    mc_backend *be = NULL;
    if (mc_backend_cpu_create(&be, threads, &err) != MC_OK)
        return mcpy_raise(&err);
    const mc_ops *ops = be->ops;
    float *x = ops->alloc(be, sizeof(float) * ROWS * IN, "the probe's x", &err);
    float *w = x ? ops->alloc(be, sizeof(float) * OUT * IN, "the probe's w", &err) : NULL;
    float *y = w ? ops->alloc(be, sizeof(float) * ROWS * OUT * 3, "the probe's y", &err) : NULL;
    PyObject *out = NULL;
    if (y == NULL)
        goto done;
    for (size_t i = 0; i < (size_t)ROWS * IN; i++)
        x[i] = (float)((i * 7919) % 61) / 61.0f - 0.5f;
    for (size_t i = 0; i < (size_t)OUT * IN; i++)
        w[i] = (float)((i * 104729) % 97) / 97.0f - 0.5f;
    if (ops->bind_linear(be, w, OUT, IN, &err) != MC_OK)
        goto done;
    float *direct = y, *graphed = y + ROWS * OUT, *copied = y + 2 * ROWS * OUT;
    memset(graphed, 0, sizeof(float) * ROWS * OUT * 2);
    if (ops->linear(be, x, IN, ROWS, IN, w, NULL, OUT, MC_ACT_NONE, 0.0f, direct, OUT, &err) != MC_OK)
        goto done;
    mc_err off = {0}, refused = {0}, discarded = {0}, twice = {0}, unbegun = {0};
    void *graph = NULL;
    if (ops->capture_begin(be, &off) == MC_OK) {
        mc_status st = ops->linear(be, x, IN, ROWS, IN, w, NULL, OUT, MC_ACT_NONE, 0.0f, graphed, OUT, &err);
        void *extra = st == MC_OK ? ops->alloc(be, 64, "an allocation inside a recording", &refused) : NULL;
        if (extra != NULL)
            ops->release(be, extra);
        (void)ops->capture_end(be, &graph, 1, &discarded);
        const float after_failed = probe_max_abs(graphed, NULL, (size_t)ROWS * OUT);
        if (st != MC_OK || ops->capture_begin(be, &err) != MC_OK)
            goto done;
        (void)ops->capture_begin(be, &twice);
        st = ops->linear(be, x, IN, ROWS, IN, w, NULL, OUT, MC_ACT_NONE, 0.0f, graphed, OUT, &err);
        if (st == MC_OK)
            st = ops->copy(be, copied, graphed, sizeof(float) * ROWS * OUT, &err);
        if (ops->capture_end(be, &graph, st == MC_OK, &err) != MC_OK || st != MC_OK)
            goto done;
        (void)ops->capture_end(be, &graph, 1, &unbegun);
        const float after_record = probe_max_abs(graphed, NULL, (size_t)ROWS * OUT * 2);
        const int64_t regions = be->team_regions;
        st = ops->graph_launch(be, graph, &err);
        ops->graph_free(be, graph);
        if (st != MC_OK)
            goto done;
        const float d1 = probe_max_abs(graphed, direct, (size_t)ROWS * OUT);
        const float d2 = probe_max_abs(copied, direct, (size_t)ROWS * OUT);
        out = Py_BuildValue("{s:s,s:s,s:O,s:s,s:s,s:O,s:d,s:L,s:O}", "refused", refused.msg, "discarded",
                            discarded.msg, "untouched_after_failed", after_failed == 0.0f ? Py_True : Py_False,
                            "twice", twice.msg, "end_without_begin", unbegun.msg, "untouched_after_record",
                            after_record == 0.0f ? Py_True : Py_False, "max_diff", (double)(d1 > d2 ? d1 : d2),
                            "team_regions", (long long)(be->team_regions - regions), "off", Py_None);
    } else {
        out = Py_BuildValue("{s:s}", "off", off.msg);
    }
done:
    if (out == NULL && !PyErr_Occurred())
        mcpy_raise(&err);
    if (y != NULL)
        ops->release(be, y);
    if (w != NULL)
        ops->release(be, w);
    if (x != NULL)
        ops->release(be, x);
    mc_backend_destroy(be);
    return out;
}

/* _nomem_message(count, each, what, because=None, sized=True) -> (status, message):
 * what mc_fail_nomem_n / _because / _unsized write, for the test of the one
 * out-of-memory format (tests/test_messages.py): no allocation can be made
 * to fail at a chosen size, overflow least of all. */
static PyObject *nomem_message(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *keywords[] = {"count", "each", "what", "because", "sized", NULL};
    unsigned long long count = 0, each = 0;
    const char *what = NULL, *because = NULL;
    int sized = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KKs|zp", keywords, &count, &each, &what, &because, &sized))
        return NULL;
    if (count > SIZE_MAX || each > SIZE_MAX)
        return PyErr_Format(PyExc_OverflowError, "_nomem_message: count and each must fit a size_t");
    if (because != NULL && sized && each != 1)
        return PyErr_Format(PyExc_ValueError, "_nomem_message: with because=, count is the bytes and each must be 1");
    mc_err err = {0};
    mc_status st;
    if (!sized)
        st = mc_fail_nomem_unsized(&err, because, "%s", what);
    else if (because != NULL)
        st = mc_fail_nomem_because(&err, (size_t)count, because, "%s", what);
    else
        st = mc_fail_nomem_n(&err, (size_t)count, (size_t)each, "%s", what);
    return Py_BuildValue("(is)", (int)(st == MC_ERR_NOMEM && err.status == MC_ERR_NOMEM), err.msg);
}

/* _cpu_expf(x, isa), _cpu_gelu(x, isa), _cpu_silu(x, isa) and _cpu_softmax(x, isa):
 * cpu_vmath.c's functions with one instruction set's code (tests only: the
 * forms must agree bit for bit and stay near the float64 functions). x: a
 * float32 array, 1-D, or 2-D for softmax (each row softmaxed). */
typedef enum vmath_fn { VMATH_EXPF, VMATH_GELU, VMATH_SILU, VMATH_SOFTMAX } vmath_fn;

static PyObject *cpu_vmath(PyObject *args, vmath_fn which) {
    static const char *const names[] = {"_cpu_expf", "_cpu_gelu", "_cpu_silu", "_cpu_softmax"};
    const char *fn = names[which];
    PyObject *obj;
    const char *isa_name;
    if (!PyArg_ParseTuple(args, "Os", &obj, &isa_name))
        return NULL;
    mc_cpu_isa isa;
    if (!mc_cpu_isa_from_name(isa_name, &isa))
        return PyErr_Format(PyExc_ValueError, "%s: isa '%s': expected avx512, avx2 or plain", fn, isa_name);
    if (!mc_cpu_isa_supported(isa))
        return PyErr_Format(PyExc_ValueError, "%s: this CPU does not support %s", fn, isa_name);
    const int ndim = which == VMATH_SOFTMAX ? 2 : 1;
    PyArrayObject *x = (PyArrayObject *)PyArray_FROMANY(obj, NPY_FLOAT32, ndim, ndim,
                                                        NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED);
    if (x == NULL)
        return NULL;
    PyArrayObject *y = (PyArrayObject *)PyArray_NewLikeArray(x, NPY_CORDER, NULL, 0);
    if (y == NULL) {
        Py_DECREF(x);
        return NULL;
    }
    const float *src = PyArray_DATA(x);
    float *dst = PyArray_DATA(y);
    const int64_t n = (int64_t)PyArray_SIZE(x);
    switch (which) {
    case VMATH_EXPF:
        mc_cpu_expf_array(isa, src, dst, n);
        break;
    case VMATH_GELU:
        mc_cpu_gelu_erf_array(isa, src, dst, n);
        break;
    case VMATH_SILU:
        mc_cpu_silu_array(isa, src, dst, n);
        break;
    case VMATH_SOFTMAX: {
        const int64_t rows = (int64_t)PyArray_DIM(x, 0), cols = (int64_t)PyArray_DIM(x, 1);
        memcpy(dst, src, (size_t)n * sizeof(float));
        mc_cpu_softmax_rows(isa, dst, rows, cols, cols);
        break;
    }
    }
    Py_DECREF(x);
    return (PyObject *)y;
}

static PyObject *cpu_expf(PyObject *self, PyObject *args) {
    (void)self;
    return cpu_vmath(args, VMATH_EXPF);
}

static PyObject *cpu_gelu(PyObject *self, PyObject *args) {
    (void)self;
    return cpu_vmath(args, VMATH_GELU);
}

static PyObject *cpu_silu(PyObject *self, PyObject *args) {
    (void)self;
    return cpu_vmath(args, VMATH_SILU);
}

static PyObject *cpu_softmax(PyObject *self, PyObject *args) {
    (void)self;
    return cpu_vmath(args, VMATH_SOFTMAX);
}

static PyMethodDef build_methods[] = {
    {"_nomem_message", (PyCFunction)(void (*)(void))nomem_message, METH_VARARGS | METH_KEYWORDS,
     "_nomem_message(count, each, what, because=None, sized=True) -> (is MC_ERR_NOMEM, message) of the "
     "out-of-memory writer (tests only)"},
    {"_guard_probe", guard_probe, METH_VARARGS,
     "_guard_probe(touch) -> 42.0 read back from a guard buffer; touch=True reads it on the host "
     "instead, which must fault (tests only)."},
    {"_cpu_graph_probe", cpu_graph_probe, METH_VARARGS,
     "_cpu_graph_probe(threads) -> the CPU backend's graph hooks on one Linear and a copy: refusal and "
     "discard messages, results against the direct call, team regions (tests only)"},
    {"build_info", build_info, METH_NOARGS, "Backends, BLAS and compiler flags built in."},
    {"_cpu_expf", cpu_expf, METH_VARARGS,
     "_cpu_expf(x, isa) -> the CPU backend's expf of a 1-D float32 array with isa's code (tests only)"},
    {"_cpu_gelu", cpu_gelu, METH_VARARGS,
     "_cpu_gelu(x, isa) -> the CPU backend's exact-erf GELU of a 1-D float32 array with isa's code (tests only)"},
    {"_cpu_silu", cpu_silu, METH_VARARGS,
     "_cpu_silu(x, isa) -> the CPU backend's SiLU of a 1-D float32 array with isa's code (tests only)"},
    {"_cpu_softmax", cpu_softmax, METH_VARARGS,
     "_cpu_softmax(x, isa) -> the CPU backend's softmax of each row of a 2-D float32 array (tests only)"},

    {"sgemm_seconds", sgemm_seconds, METH_VARARGS,
     "sgemm_seconds(m, n, k, reps) -> best seconds of one CPU-backend sgemm C[m,n] = A[m,k] B[n,k]^T"},
    {"_cublas_register_dirs", cublas_register_dirs, METH_O,
     "_cublas_register_dirs(folders): where the CUDA backend looks for libcublas before the "
     "toolkit (set by marcache at import)"},
#ifdef MC_HAVE_CUDA
    {"_cublas_load", cublas_load, METH_NOARGS,
     "_cublas_load() -> (file, version) of the cuBLAS the CUDA backend uses, loading it if "
     "needed (test hook; raises RuntimeError naming the wheel when none is found)"},
    {"_cuda_pool_probe", cuda_pool_probe, METH_VARARGS,
     "_cuda_pool_probe(sizes, rounds, release_while_recording=False) -> pool bytes reserved "
     "after each round (CUDA test hook)"},
#endif
    {NULL, NULL, 0, NULL},
};

int mcpy_build_init(PyObject *module) { return PyModule_AddFunctions(module, build_methods); }

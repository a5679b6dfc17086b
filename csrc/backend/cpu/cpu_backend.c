/* The CPU backend: OpenBLAS for GEMMs, OpenMP for everything row-parallel,
 * and a grow-only scratch pool so the AR loop does not allocate. */
#define _DEFAULT_SOURCE /* madvise and MADV_HUGEPAGE are not in POSIX */
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include <cblas.h>

#include "cpu_internal.h"

#define MC_CPU_SCRATCH_SLOTS 64

typedef struct cpu_state {
    int num_threads;
    mc_cpu_config config; /* the environment as read when the backend was made */
    float *scratch[MC_CPU_SCRATCH_SLOTS];
    size_t scratch_floats[MC_CPU_SCRATCH_SLOTS];
    mc_cpu_panel_set panels; /* the bound fp32 linear weights (cpu_panels.c) */
    mc_cpu_recorder recorder; /* graph recording (cpu_graph.c) */
} cpu_state;

static enum CBLAS_TRANSPOSE to_cblas(int trans) { return trans ? CblasTrans : CblasNoTrans; }

/* One thread pool for everything: OpenBLAS runs single-threaded and GEMMs
 * are split across the OpenMP team here. Two pools (OpenMP for the row ops,
 * OpenBLAS's pthreads for GEMMs) spin-wait against each other and ran the
 * MAR head ~5x slower on two cores. OpenBLAS never splits K, so a split
 * changes no output's summation on its SkylakeX kernels: both splits give
 * the one-thread call's bits (tests/test_smallrow.py). Its Haswell kernels
 * round some outputs differently with a call's row count (the row split as
 * well); an image's result then depends on its batch within float32
 * rounding, which the batch-invariance tests' tolerance allows.
 *
 * Which split: each thread's sgemm packs its own copy of the operand it
 * reads whole (all of W when rows are split, all of x when columns are), and
 * a row split is cut at multiples of 16 rows, so 200 rows on two threads run
 * as 112 + 88 and 514 as 272 + 242. Up to MC_GEMM_COL_SPLIT_MAX_ROWS rows the
 * columns are split (the halves come out even), given every thread at least
 * MC_GEMM_COL_SPLIT_MIN_COLS columns. Measured through `linear` on the 2-core
 * EPYC (Zen 4, OpenBLAS SkylakeX, MAR-B's four Linear shapes, weights beyond
 * L3, alternated; benchmarks/results/gemm-split-2026-11-28.md): columns
 * 1.00-1.43x the row split at 100-578 rows, even (0.98-1.03x) at 640-800,
 * where the row split is balanced; MAR-B's decoder (640 rows at batch 1)
 * keeps it. */
#define MC_GEMM_PARALLEL_MIN_FLOPS (4.0 * 1024 * 1024)
#define MC_GEMM_ROW_ALIGN 16
#define MC_GEMM_COL_ALIGN 64
#define MC_GEMM_COL_SPLIT_MAX_ROWS 600
#define MC_GEMM_COL_SPLIT_MIN_COLS 256

static void sgemm_serial(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                         const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                         float *c, int64_t ldc) {
    scipy_cblas_sgemm(CblasRowMajor, to_cblas(trans_a), to_cblas(trans_b), (blasint)m, (blasint)n,
                      (blasint)k, alpha, a, (blasint)lda, b, (blasint)ldb, beta, c, (blasint)ldc);
}

int mc_cpu_sgemm_splits_rows(int threads, int64_t m, int64_t n) {
    const int cols_fit = n >= (int64_t)threads * MC_GEMM_COL_SPLIT_MIN_COLS;
    if (m <= MC_GEMM_COL_SPLIT_MAX_ROWS && cols_fit)
        return 0;
    /* Otherwise rows, when every thread gets a useful block of them. */
    return m >= (int64_t)threads * MC_GEMM_ROW_ALIGN * 2;
}

void mc_cpu_sgemm(int threads, mc_cpu_gemm_split split, int trans_a, int trans_b, int64_t m, int64_t n,
                  int64_t k, float alpha, const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                  float *c, int64_t ldc) {
    if (m == 0 || n == 0)
        return;
    if (omp_get_level() > 0)
        threads = 1;
    if (threads <= 1 || 2.0 * (double)m * (double)n * (double)k < MC_GEMM_PARALLEL_MIN_FLOPS) {
        sgemm_serial(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    /* A forced split where the call has too few rows or columns for it
     * (fewer than one aligned block per thread) runs serially. */
    int split_rows = mc_cpu_sgemm_splits_rows(threads, m, n);
    if (split != MC_CPU_GEMM_SPLIT_AUTO) {
        split_rows = split == MC_CPU_GEMM_SPLIT_ROWS;
        if (split_rows ? m < (int64_t)threads * MC_GEMM_ROW_ALIGN : n < (int64_t)threads * MC_GEMM_COL_ALIGN) {
            sgemm_serial(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
            return;
        }
    }
    const int64_t extent = split_rows ? m : n;
    const int64_t align = split_rows ? MC_GEMM_ROW_ALIGN : MC_GEMM_COL_ALIGN;
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t per = (extent + nt - 1) / nt;
        per = (per + align - 1) / align * align;
        int64_t begin = (int64_t)t * per, end = begin + per < extent ? begin + per : extent;
        if (begin < end) {
            if (split_rows) {
                const float *a_part = trans_a ? a + begin : a + begin * lda;
                sgemm_serial(trans_a, trans_b, end - begin, n, k, alpha, a_part, lda, b, ldb, beta,
                             c + begin * ldc, ldc);
            } else {
                const float *b_part = trans_b ? b + begin * ldb : b + begin;
                sgemm_serial(trans_a, trans_b, m, end - begin, k, alpha, a, lda, b_part, ldb, beta,
                             c + begin, ldc);
            }
        }
    }
}

const char *mc_cpu_blas_config(void) { return scipy_openblas_get_config(); }

const char *mc_cpu_blas_core(void) { return scipy_openblas_get_corename(); }

int mc_cpu_threads(mc_backend *be) { return ((cpu_state *)be->impl)->num_threads; }

mc_cpu_isa mc_cpu_isa_of(mc_backend *be) { return ((cpu_state *)be->impl)->config.isa; }

int mc_cpu_smallrow_max(mc_backend *be) { return ((cpu_state *)be->impl)->config.smallrow_max; }

int mc_cpu_panel_max(mc_backend *be) {
    const cpu_state *st = be->impl;
    return st->config.panels ? st->config.panel_max : 0;
}

mc_cpu_gemm_split mc_cpu_gemm_split_of(mc_backend *be) { return ((cpu_state *)be->impl)->config.gemm_split; }

mc_cpu_panel_set *mc_cpu_panel_set_of(mc_backend *be) { return &((cpu_state *)be->impl)->panels; }

mc_cpu_recorder *mc_cpu_recorder_of(mc_backend *be) { return &((cpu_state *)be->impl)->recorder; }

int mc_cpu_graphs_enabled(mc_backend *be) { return ((cpu_state *)be->impl)->config.graphs; }

mc_status mc_cpu_bind_linear(mc_backend *be, const void *w, int64_t out, int64_t in, mc_err *err) {
    cpu_state *st = be->impl;
    if (mc_cpu_panel_max(be) == 0 || be->linear_wtype != MC_WTYPE_F32)
        return MC_OK;
    /* The plain kernel reads W in place: noted, no panels made. */
    return mc_cpu_panel_set_add(be, &st->panels, w, out, in, st->config.isa != MC_CPU_ISA_PLAIN, err);
}

float *mc_cpu_scratch(mc_backend *be, int slot, size_t floats, const char *what, mc_err *err) {
    cpu_state *st = be->impl;
    if (slot < 0 || slot >= MC_CPU_SCRATCH_SLOTS) {
        mc_fail(err, MC_ERR_INTERNAL, "scratch slot %d out of range", slot);
        return NULL;
    }
    if (st->scratch_floats[slot] < floats) {
        size_t bytes;
        float *fresh = mc_mul_overflows(floats, sizeof(float), &bytes) ? NULL : mc_aligned_alloc(bytes);
        if (fresh == NULL) {
            mc_fail_nomem_n(err, floats, sizeof(float), "%s in CPU scratch slot %d", what, slot);
            return NULL;
        }
        mc_aligned_free(st->scratch[slot]);
        be->allocations++;
        st->scratch[slot] = fresh;
        st->scratch_floats[slot] = floats;
    }
    return st->scratch[slot];
}

/* Buffers of at least this size start on a 2 MiB boundary and are marked
 * MADV_HUGEPAGE (transparent huge pages, where the kernel offers them: its
 * "madvise" or "always" mode). At batch 1 every diffusion step streams the
 * head's ~134 MB of weights and every layer's GEMM packs its W: with 4 KiB
 * pages that is a TLB miss every 4 KiB, 16 at once where OpenBLAS packs 16
 * rows of W side by side. Only whole 2 MiB ranges inside the buffer get huge
 * pages, so its tail costs no memory; the skipped head of the aligned block
 * is never touched. The advice is advisory: where the kernel refuses it
 * (huge pages off or none free) the buffer is ordinary memory, the same
 * bytes. MARCACHE_HUGE_PAGES=0 turns it off. */
#define MC_HUGE_PAGE_BYTES ((size_t)2 << 20)

void *mc_cpu_host_alloc(mc_backend *be, size_t bytes, const char *what, mc_err *err) {
    const cpu_state *st = be->impl;
    void *p = NULL;
    if (st->config.huge_pages && bytes >= MC_HUGE_PAGE_BYTES) {
        if (posix_memalign(&p, MC_HUGE_PAGE_BYTES, bytes) != 0)
            p = NULL;
#ifdef MADV_HUGEPAGE
        else
            (void)madvise(p, bytes, MADV_HUGEPAGE);
#endif
    } else {
        p = mc_aligned_alloc(bytes);
    }
    if (p == NULL)
        mc_fail_nomem(err, bytes, "%s", what);
    return p;
}

/* Allocation, upload, download and binding are not recordable (CUDA
 * refuses them in a graph recording too): they fail the recording. */
static void *cpu_alloc(mc_backend *be, size_t bytes, const char *what, mc_err *err) {
    if (mc_cpu_refuse_while_recording(be, "allocation", err) != MC_OK)
        return NULL;
    void *p = mc_cpu_host_alloc(be, bytes, what, err);
    if (p != NULL)
        be->allocations++;
    return p;
}

/* A release while recording fails the recording (a recorded call may name
 * the buffer); nothing recorded has run, so freeing it now is safe. */
static void cpu_release(mc_backend *be, void *ptr) {
    mc_err ignored = {0};
    (void)mc_cpu_refuse_while_recording(be, "release", &ignored);
    mc_cpu_panel_set_forget(mc_cpu_panel_set_of(be), ptr);
    mc_aligned_free(ptr);
}

void mc_cpu_copy_bytes(mc_backend *be, void *dst, const void *src, size_t bytes) {
    if (bytes) {
        memcpy(dst, src, bytes);
        mc_cpu_panel_set_stale(mc_cpu_panel_set_of(be), dst, bytes);
    }
}

/* Counted as the CUDA backend would wait (ops.h, mc_backend.syncs). */
static mc_status cpu_upload(mc_backend *be, void *dst, const void *src, size_t bytes, mc_err *err) {
    MC_TRY(mc_cpu_refuse_while_recording(be, "upload", err));
    if (bytes > MC_UPLOAD_STAGED_MAX)
        be->syncs++;
    mc_cpu_copy_bytes(be, dst, src, bytes);
    return MC_OK;
}

static mc_status cpu_download(mc_backend *be, void *dst, const void *src, size_t bytes, mc_err *err) {
    MC_TRY(mc_cpu_refuse_while_recording(be, "download", err));
    if (bytes)
        be->syncs++;
    mc_cpu_copy_bytes(be, dst, src, bytes);
    return MC_OK;
}

static mc_status cpu_bind_linear_entry(mc_backend *be, const void *w, int64_t out, int64_t in, mc_err *err) {
    MC_TRY(mc_cpu_refuse_while_recording(be, "binding a weight", err));
    return mc_cpu_bind_linear(be, w, out, in, err);
}

static void cpu_destroy(mc_backend *be) {
    cpu_state *st = be->impl;
    for (int i = 0; i < MC_CPU_SCRATCH_SLOTS; i++)
        mc_aligned_free(st->scratch[i]);
    mc_cpu_panel_set_free(&st->panels);
    mc_cpu_recorder_free(&st->recorder);
    free(st);
    free(be);
}

static const mc_ops cpu_ops = {
    .name = "cpu",
    .synchronous = 1,
    .destroy = cpu_destroy,
    .alloc = cpu_alloc,
    .release = cpu_release,
    .upload = cpu_upload,
    .download = cpu_download,
    .copy = mc_cpu_copy_or_record,
    .bind_linear = cpu_bind_linear_entry,
    /* every op of the list: mc_cpu_<op>, or its record while recording */
#define MC_OP(name, where, params, args, flops) .name = mc_cpu_entry_##name,
#include "../ops_list.h"
    .capture_begin = mc_cpu_capture_begin,
    .capture_end = mc_cpu_capture_end,
    .graph_launch = mc_cpu_graph_launch,
    .graph_free = mc_cpu_graph_free,
};

mc_status mc_backend_cpu_create(mc_backend **out, int num_threads, mc_err *err) {
    mc_backend *be = calloc(1, sizeof *be);
    cpu_state *st = calloc(1, sizeof *st);
    if (be == NULL || st == NULL) {
        free(be);
        free(st);
        return mc_fail_nomem(err, sizeof *be + sizeof *st, "the CPU backend");
    }
    st->num_threads = num_threads > 0 ? num_threads : omp_get_max_threads();
    /* Read once here, so a model's kernels never change under it. */
    if (mc_cpu_config_from_env(&st->config, err) != MC_OK) {
        free(be);
        free(st);
        return err->status;
    }
    /* GEMMs are threaded by mc_cpu_sgemm; OpenBLAS's own pool stays idle.
     * The setting is process-wide, and only this library's copy of
     * OpenBLAS (the scipy-openblas32 wheel) is affected. */
    scipy_openblas_set_num_threads(1);
    be->ops = &cpu_ops;
    be->device_index = -1;
    be->impl = st;
    *out = be;
    return MC_OK;
}



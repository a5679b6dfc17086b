/* The CPU backend's `linear` on its two paths, side by side in one process
 * (issue 23: where the small-row kernel should hand over to OpenBLAS).
 * Built and run by benchmarks/bench_linear.py; not part of the module.
 *
 *   linear_threshold [--weight-mib N] THREADS IN OUT ROWS...
 *   linear_threshold [--weight-mib N] --split THREADS IN OUT ROWS...
 *
 * Three CPU backends are made through the module's own factory, with
 * MARCACHE_SMALLROW_MAX=4096 and the column panels on (every call on the
 * panel kernel, cpu_panels.c), 4096 with the panels off (the lane kernel,
 * cpu_smallrow.c), and 0 (every call on OpenBLAS through mc_cpu_sgemm, with
 * the bias written first as mc_cpu_linear does), so each path is exactly
 * what the engine runs; every weight is bound (bind_linear) on each, as a
 * model's is. The weights are as many
 * [OUT, IN] fp32 matrices as make 128 MiB, more than the L3 of the machines
 * at hand, and each timed pass runs x [ROWS, IN] through all of them in turn,
 * so every call reads its W from memory, as the engine's layers do. With
 * --weight-mib N they make N MiB instead (at least one matrix), and a pass
 * runs through them as many times as reads 128 MiB: a few MiB stay in the
 * L3, as the weights of the head cache's reused evaluations do (MAR-B: 17
 * MB, read again at each of them). The
 * paths alternate pass by pass; the best of 5 passes each is printed as
 *   ROWS panels GFLOP/s  lanes GFLOP/s  OpenBLAS GFLOP/s
 * With --split both backends run every call on OpenBLAS (threshold 0), one
 * with MARCACHE_GEMM_SPLIT=rows and one with cols (how mc_cpu_sgemm divides
 * a GEMM between the threads), printed as
 *   ROWS row-split GFLOP/s  column-split GFLOP/s  the split the default picks */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/cpu/cpu_internal.h" /* mc_cpu_sgemm_splits_rows */
#include "backend/ops.h"              /* mc_backend_cpu_create, mc_backend_destroy */

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static mc_backend *make_backend(const char *smallrow_max, const char *gemm_split, const char *panels, int threads) {
    mc_err err = {0};
    mc_backend *be = NULL;
    setenv("MARCACHE_SMALLROW_MAX", smallrow_max, 1);
    setenv("MARCACHE_GEMM_SPLIT", gemm_split, 1);
    setenv("MARCACHE_SMALLROW_PANELS", panels, 1);
    if (mc_backend_cpu_create(&be, threads, &err) != MC_OK) {
        fprintf(stderr, "linear_threshold: the CPU backend: %s\n", err.msg);
        exit(2);
    }
    return be;
}

int main(int argc, char **argv) {
    int64_t weight_mib = 128;
    if (argc > 2 && strcmp(argv[1], "--weight-mib") == 0) {
        weight_mib = atol(argv[2]);
        argc -= 2;
        argv += 2;
    }
    const int split_mode = argc > 1 && strcmp(argv[1], "--split") == 0;
    if (split_mode) {
        argc--;
        argv++;
    }
    if (argc < 5 || weight_mib < 1) {
        fprintf(stderr, "usage: linear_threshold [--weight-mib N] [--split] THREADS IN OUT ROWS...\n");
        return 2;
    }
    const int threads = atoi(argv[1]);
    const int64_t in = atol(argv[2]), out = atol(argv[3]);
    int64_t max_rows = 0;
    for (int a = 4; a < argc; a++)
        if (atol(argv[a]) > max_rows)
            max_rows = atol(argv[a]);
    if (threads < 1 || in < 1 || out < 1 || max_rows < 1) {
        fprintf(stderr, "linear_threshold: THREADS, IN, OUT and ROWS must be positive\n");
        return 2;
    }
    const int64_t matrix_bytes = in * out * (int64_t)sizeof(float);
    int64_t nmat = (weight_mib << 20) / matrix_bytes;
    nmat = nmat < 1 ? 1 : nmat;
    /* Passes over the set that read 128 MiB (1 with the default set). */
    int64_t sweeps = (128ll << 20) / (nmat * matrix_bytes);
    sweeps = sweeps < 1 ? 1 : sweeps;
    float *w = malloc((size_t)(nmat * in * out) * sizeof(float));
    float *x = malloc((size_t)(max_rows * in) * sizeof(float));
    float *y = malloc((size_t)(max_rows * out) * sizeof(float));
    float *bias = malloc((size_t)out * sizeof(float));
    if (w == NULL || x == NULL || y == NULL || bias == NULL) {
        fprintf(stderr, "linear_threshold: out of memory\n");
        return 2;
    }
    /* Values of no consequence for speed; deterministic, finite, not denormal. */
    for (int64_t i = 0; i < nmat * in * out; i++)
        w[i] = (float)((uint64_t)i * 2654435761u % 1000u) * 1e-3f - 0.5f;
    for (int64_t i = 0; i < max_rows * in; i++)
        x[i] = (float)((uint64_t)i * 7919u % 100u) * 1e-2f - 0.5f;
    for (int64_t i = 0; i < out; i++)
        bias[i] = 0.01f * (float)(i % 7);
    const int npaths = split_mode ? 2 : 3;
    mc_backend *paths[3] = {
        split_mode ? make_backend("0", "rows", "1", threads) : make_backend("4096", "auto", "1", threads),
        split_mode ? make_backend("0", "cols", "1", threads) : make_backend("4096", "auto", "0", threads),
        split_mode ? NULL : make_backend("0", "auto", "1", threads)};
    /* Every matrix bound as a model's weight is, so the first backend's
     * small-row calls run on column panels (made at the first call). */
    for (int p = 0; p < npaths; p++)
        for (int64_t m = 0; m < nmat; m++) {
            mc_err err = {0};
            if (paths[p]->ops->bind_linear(paths[p], w + m * in * out, out, in, &err) != MC_OK) {
                fprintf(stderr, "linear_threshold: bind_linear: %s\n", err.msg);
                return 2;
            }
        }
    for (int a = 4; a < argc; a++) {
        const int64_t rows = atol(argv[a]);
        double best[3] = {1e30, 1e30, 1e30};
        for (int pass = 0; pass < 5 * npaths; pass++) {
            const int p = pass % npaths;
            mc_err err = {0};
            const double t0 = seconds();
            for (int64_t m = 0; m < nmat * sweeps; m++)
                if (paths[p]->ops->linear(paths[p], x, in, rows, in, w + (m % nmat) * in * out, bias, out,
                                          MC_ACT_NONE, 0.0f, y, out, &err) != MC_OK) {
                    fprintf(stderr, "linear_threshold: linear: %s\n", err.msg);
                    return 2;
                }
            const double dt = seconds() - t0;
            best[p] = dt < best[p] ? dt : best[p];
        }
        const double flop = 2.0 * (double)rows * (double)in * (double)out * (double)(nmat * sweeps);
        if (split_mode)
            printf("%lld %.2f %.2f %s\n", (long long)rows, flop / best[0] / 1e9, flop / best[1] / 1e9,
                   mc_cpu_sgemm_splits_rows(threads, rows, out) ? "rows" : "cols");
        else
            printf("%lld %.2f %.2f %.2f\n", (long long)rows, flop / best[0] / 1e9, flop / best[1] / 1e9,
                   flop / best[2] / 1e9);
        fflush(stdout);
    }
    for (int p = 0; p < npaths; p++)
        mc_backend_destroy(paths[p]);
    free(w);
    free(x);
    free(y);
    free(bias);
    return 0;
}

/* The CPU backend's `attention` op timed on its own (issue 23), for
 * benchmarks/bench_attention.py: built against a checkout's C sources, so the
 * same harness times two trees side by side (run it from each).
 *
 *   attention_time THREADS HEADS HEAD_DIM BATCH NQ KEYS [NQ KEYS ...]
 *
 * For each (NQ, KEYS): q of [BATCH, NQ, HEADS * HEAD_DIM], one K/V segment in
 * the layout of the engine's fused qkv ([BATCH, KEYS, 2 * width], k | v per
 * row), the op called through the backend's table until 0.2 s have passed,
 * the best of 5 such passes. Prints "NQ KEYS microseconds GFLOP/s" per line
 * (FLOPs: 4 per query, key and channel, the op's count). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "backend/ops.h" /* mc_backend_cpu_create, mc_backend_destroy */

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc < 7 || (argc - 5) % 2 != 0) {
        fprintf(stderr, "usage: attention_time THREADS HEADS HEAD_DIM BATCH NQ KEYS [NQ KEYS ...]\n");
        return 2;
    }
    const int threads = atoi(argv[1]), heads = atoi(argv[2]), head_dim = atoi(argv[3]);
    const int64_t batch = atol(argv[4]), width = (int64_t)heads * head_dim;
    if (threads < 1 || heads < 1 || head_dim < 1 || batch < 1) {
        fprintf(stderr, "attention_time: THREADS, HEADS, HEAD_DIM and BATCH must be positive\n");
        return 2;
    }
    mc_err err = {0};
    mc_backend *be = NULL;
    if (mc_backend_cpu_create(&be, threads, &err) != MC_OK) {
        fprintf(stderr, "attention_time: the CPU backend: %s\n", err.msg);
        return 2;
    }
    for (int a = 5; a + 1 < argc; a += 2) {
        const int64_t nq = atol(argv[a]), keys = atol(argv[a + 1]);
        if (nq < 1 || keys < 1) {
            fprintf(stderr, "attention_time: NQ and KEYS must be positive\n");
            return 2;
        }
        float *q = malloc((size_t)(batch * nq * width) * sizeof(float));
        float *kv = malloc((size_t)(batch * keys * 2 * width) * sizeof(float));
        float *out = malloc((size_t)(batch * nq * width) * sizeof(float));
        if (q == NULL || kv == NULL || out == NULL) {
            fprintf(stderr, "attention_time: out of memory\n");
            return 2;
        }
        /* Values of no consequence for speed; deterministic, finite, not denormal. */
        for (int64_t i = 0; i < batch * nq * width; i++)
            q[i] = (float)((uint64_t)i * 7919u % 1000u) * 1e-3f - 0.5f;
        for (int64_t i = 0; i < batch * keys * 2 * width; i++)
            kv[i] = (float)((uint64_t)i * 104729u % 1000u) * 1e-3f - 0.5f;
        const mc_kv_segment seg = {.k = kv, .v = kv + width, .rows = keys, .ld = 2 * width,
                                   .batch_stride = keys * 2 * width};
        double best = 1e30;
        for (int pass = 0; pass < 5; pass++) {
            int calls = 0;
            double t;
            const double t0 = seconds();
            do {
                if (be->ops->attention(be, batch, nq, heads, head_dim, 0.125f, q, width, nq * width, &seg, 1, out,
                                       width, nq * width, &err) != MC_OK) {
                    fprintf(stderr, "attention_time: attention: %s\n", err.msg);
                    return 2;
                }
                calls++;
                t = seconds() - t0;
            } while (t < 0.2);
            best = t / calls < best ? t / calls : best;
        }
        const double flop = 4.0 * (double)batch * (double)nq * (double)keys * (double)width;
        printf("%lld %lld %.1f %.2f\n", (long long)nq, (long long)keys, best * 1e6, flop / best / 1e9);
        fflush(stdout);
        free(q);
        free(kv);
        free(out);
    }
    mc_backend_destroy(be);
    return 0;
}

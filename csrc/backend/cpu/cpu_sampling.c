/* VAR's sampling ops on the CPU: sample_tokens (top-k, top-p, categorical
 * draw) and gumbel_softmax (more_smooth). The contracts are in ops_list.h.
 *
 * Plain loops, one row at a time, everything that decides a token in
 * double with sequential sums in the orders the contracts state, so the
 * float64 reference in tests/reference/ops.py reproduces the tokens and the
 * masked logits exactly. Rows are split across OpenMP threads; a row's
 * arithmetic does not depend on the split. Every row is checked before any
 * is changed, so a failing call leaves the logits as they were. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "../../core/philox.h"
#include "../op_checks.h"
#include "../sampling_inline.h"
#include "cpu_internal.h"

/* Scratch of one thread lives in slot = thread number (as attention's). */
#define MC_SAMPLING_MAX_THREADS 64

/* MC_ROW_FINE or the row's fault (sampling_inline.h). */
static int classify_row(const float *row, int64_t vocab) {
    int has_pos_inf = 0, has_finite = 0;
    for (int64_t j = 0; j < vocab; j++) {
        float v = row[j];
        if (isnan(v))
            return MC_ROW_NAN;
        if (v == INFINITY)
            has_pos_inf = 1;
        else if (v != -INFINITY)
            has_finite = 1;
    }
    return has_pos_inf ? MC_ROW_POS_INF : has_finite ? MC_ROW_FINE : MC_ROW_NO_FINITE;
}

/* The first row that cannot be sampled, as an MC_ERR_NUMERIC failure. */
static mc_status check_rows(mc_backend *be, const char *op, const float *logits, int64_t ld,
                            int64_t rows, int64_t vocab, mc_err *err) {
    int64_t first_bad = rows;
#pragma omp parallel for schedule(static) reduction(min : first_bad) num_threads(mc_cpu_threads(be)) \
    if (rows * vocab >= 32768)
    for (int64_t r = 0; r < rows; r++)
        if (classify_row(logits + r * ld, vocab) != MC_ROW_FINE && r < first_bad)
            first_bad = r;
    if (first_bad == rows)
        return MC_OK;
    return mc_fail_row_fault(op, first_bad, classify_row(logits + first_bad * ld, vocab), err);
}

/* Per-thread scratch of `per_thread` floats for up to *threads threads
 * (lowered to the slots there are); NULL entries never happen on MC_OK. */
static mc_status thread_scratch(mc_backend *be, int64_t rows, size_t per_thread, int *threads,
                                float **scratch, mc_err *err) {
    int n = mc_cpu_threads(be);
    if (n > MC_SAMPLING_MAX_THREADS)
        n = MC_SAMPLING_MAX_THREADS;
    if (n > rows)
        n = (int)rows;
    if (n < 1)
        n = 1;
    for (int t = 0; t < n; t++) {
        scratch[t] = mc_cpu_scratch(be, t, per_thread, "a thread's sampling buffer", err);
        if (scratch[t] == NULL)
            return err->status;
    }
    *threads = n;
    return MC_OK;
}

/* The k-th largest value of the row (1 <= k <= vocab), counting repeats:
 * radix selection on the order keys, most significant byte first. Each
 * pass counts, among the keys that share the digits chosen so far, how
 * many have each next byte, and walks the bytes from the top until the
 * k-th key falls in one. Exact, four passes over the row. */
static float kth_largest(const float *row, int64_t vocab, int64_t k) {
    uint32_t prefix = 0, mask = 0;
    int64_t need = k; /* rank of the wanted key among those matching the prefix */
    for (int shift = 24; shift >= 0; shift -= 8) {
        int64_t count[256] = {0};
        for (int64_t j = 0; j < vocab; j++) {
            uint32_t key = mc_logit_order_key(row[j]);
            if ((key & mask) == prefix)
                count[(key >> shift) & 0xffu]++;
        }
        int digit = 255;
        while (count[digit] < need) {
            need -= count[digit];
            digit--;
        }
        prefix |= (uint32_t)digit << shift;
        mask |= 0xffu << shift;
    }
    return mc_logit_key_value(prefix);
}

static int compare_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Step b) of the contract on one row: e holds vocab doubles, keys vocab
 * 64-bit words of scratch. The -inf entries are left out of the sort: in
 * the full ascending order they come first and add exact zeros to the
 * running sum (which stays 0 <= 1 - top_p, so they would be "removed",
 * as they already are), and the largest entry is finite. */
static void top_p_filter(float *row, int64_t vocab, double max_logit, float top_p, double *e,
                         uint64_t *keys) {
    double sum = 0.0;
    for (int64_t j = 0; j < vocab; j++) {
        e[j] = row[j] == -INFINITY ? 0.0 : exp((double)row[j] - max_logit);
        sum += e[j];
    }
    int64_t n = 0;
    for (int64_t j = 0; j < vocab; j++)
        if (row[j] != -INFINITY)
            keys[n++] = (uint64_t)mc_logit_order_key(row[j]) << 32 | (uint64_t)j;
    qsort(keys, (size_t)n, sizeof *keys, compare_u64);
    const double bound = 1.0 - (double)top_p;
    double cumulative = 0.0;
    for (int64_t i = 0; i < n; i++) {
        int64_t j = (int64_t)(keys[i] & 0xffffffffu);
        cumulative += e[j] / sum;
        if (i < n - 1 && cumulative <= bound)
            row[j] = -INFINITY;
    }
}

/* Step c): the categorical draw from the filtered row; c is vocab doubles
 * of scratch for the running sums. */
static int32_t draw_token(const float *row, int64_t vocab, double max_logit, double u, double *c) {
    double total = 0.0;
    for (int64_t j = 0; j < vocab; j++) {
        total += row[j] == -INFINITY ? 0.0 : exp((double)row[j] - max_logit);
        c[j] = total;
    }
    const double target = u * total;
    for (int64_t j = 0; j < vocab; j++)
        if (c[j] > target)
            return (int32_t)j;
    /* Only if rounding put the target at the total: the last entry with
     * weight (the largest logit has weight 1, so there is one). */
    for (int64_t j = vocab - 1; j > 0; j--)
        if (row[j] != -INFINITY && exp((double)row[j] - max_logit) > 0.0)
            return (int32_t)j;
    return 0;
}

mc_status mc_cpu_sample_tokens(mc_backend *be, float *logits, int64_t ld, int64_t rows, int64_t vocab,
                               int64_t top_k, float top_p, uint64_t seed, uint32_t step,
                               const uint32_t *image, const uint32_t *position, int32_t *out,
                               mc_err *err) {
    MC_TRY(mc_check_logit_rows("sample_tokens", ld, rows, vocab, err));
    MC_TRY(mc_check_top_p(top_p, err));
    if (rows == 0)
        return MC_OK;
    MC_TRY(check_rows(be, "sample_tokens", logits, ld, rows, vocab, err));
    const int use_top_k = top_k > 0 && top_k < vocab;
    const int use_top_p = top_p > 0.0f && top_p < 1.0f;
    /* e (vocab doubles) and keys (vocab 64-bit words), as floats. */
    float *scratch[MC_SAMPLING_MAX_THREADS];
    int threads = 1;
    MC_TRY(thread_scratch(be, rows, (size_t)vocab * 4, &threads, scratch, err));

#pragma omp parallel for schedule(dynamic, 16) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        float *row = logits + r * ld;
        double *e = (double *)scratch[omp_get_thread_num()];
        uint64_t *keys = (uint64_t *)(e + vocab);
        float max_value = -INFINITY;
        for (int64_t j = 0; j < vocab; j++)
            if (row[j] > max_value)
                max_value = row[j];
        /* Neither filter removes the largest value (top-k keeps every
         * logit >= its threshold, top-p the last of the ascending order),
         * so this maximum serves all three steps. */
        const double max_logit = (double)max_value;
        if (use_top_k) {
            const float threshold = kth_largest(row, vocab, top_k);
            for (int64_t j = 0; j < vocab; j++)
                if (row[j] < threshold)
                    row[j] = -INFINITY;
        }
        if (use_top_p)
            top_p_filter(row, vocab, max_logit, top_p, e, keys);
        uint32_t words[4];
        mc_philox_block(seed, image[r], MC_STREAM_VAR_SAMPLE, position[r], step, 0, words);
        const double u = (double)words[0] / 4294967296.0;
        out[r] = draw_token(row, vocab, max_logit, u, e);
    }
    return MC_OK;
}

mc_status mc_cpu_gumbel_softmax(mc_backend *be, const float *logits, int64_t ld, int64_t rows,
                                int64_t vocab, float logit_scale, float tau, uint64_t seed,
                                uint32_t step, const uint32_t *image, const uint32_t *position,
                                float *probs, int64_t ldp, mc_err *err) {
    MC_TRY(mc_check_logit_rows("gumbel_softmax", ld, rows, vocab, err));
    MC_TRY(mc_check_gumbel(logit_scale, tau, ldp, vocab, err));
    if (rows == 0)
        return MC_OK;
    MC_TRY(check_rows(be, "gumbel_softmax", logits, ld, rows, vocab, err));
    float *scratch[MC_SAMPLING_MAX_THREADS];
    int threads = 1;
    MC_TRY(thread_scratch(be, rows, (size_t)vocab * 2, &threads, scratch, err));

#pragma omp parallel for schedule(dynamic, 16) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = logits + r * ld;
        float *p = probs + r * ldp;
        double *z = (double *)scratch[omp_get_thread_num()];
        double max_z = -INFINITY;
        for (int64_t block = 0; block * 4 < vocab; block++) {
            uint32_t words[4];
            mc_philox_block(seed, image[r], MC_STREAM_VAR_GUMBEL, position[r], step, (uint32_t)block,
                            words);
            for (int64_t j = block * 4; j < block * 4 + 4 && j < vocab; j++) {
                if (row[j] == -INFINITY) {
                    z[j] = -INFINITY;
                    continue;
                }
                const double u = ((double)words[j % 4] + 0.5) / 4294967296.0;
                const double gumbel = -log(-log(u));
                z[j] = ((double)row[j] * (double)logit_scale + gumbel) / (double)tau;
                if (z[j] > max_z)
                    max_z = z[j];
            }
        }
        double sum = 0.0;
        for (int64_t j = 0; j < vocab; j++) {
            z[j] = z[j] == -INFINITY ? 0.0 : exp(z[j] - max_z);
            sum += z[j];
        }
        for (int64_t j = 0; j < vocab; j++)
            p[j] = (float)(z[j] / sum);
    }
    return MC_OK;
}

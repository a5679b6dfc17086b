#include "rows.h"

#include <stdlib.h>
#include <string.h>

static int compare_by_score(int32_t x, int32_t y, const float *scores) {
    if (scores[x] != scores[y])
        return scores[x] < scores[y] ? -1 : 1;
    return (x > y) - (x < y);
}

/* Insertion sort by (score, index): glibc's qsort_r is a GNU extension and
 * rows are at most a few hundred. */
static void rank_rows(int32_t *idx, int64_t n, const float *scores) {
    for (int64_t i = 1; i < n; i++) {
        int32_t v = idx[i];
        int64_t j = i - 1;
        while (j >= 0 && compare_by_score(idx[j], v, scores) > 0) {
            idx[j + 1] = idx[j];
            j--;
        }
        idx[j + 1] = v;
    }
}

/* LazyMAR keys by V cosine (least similar first); its forcing is
 * unconditional, unlike the official code, which can drop a forced row when
 * many cosines are negative (lazymar.md 5.3 item 5). MARche keys by negated
 * attention mass. */
void mc_rows_choose(const float *key, int64_t L, int64_t P, int64_t first_candidate, const int32_t *now,
                    int64_t n_now, const int32_t *prev, int64_t n_prev, int64_t count, uint8_t *taken,
                    int32_t *order, int32_t *rows) {
    memset(taken, 0, (size_t)L);
    int64_t n = 0;
    for (int64_t i = 0; i < n_now + n_prev; i++) {
        int64_t row = P + (i < n_now ? now[i] : prev[i - n_now]);
        if (!taken[row]) {
            taken[row] = 1;
            n++;
        }
    }
    int64_t m = 0;
    for (int64_t r = first_candidate; r < L; r++)
        if (!taken[r])
            order[m++] = (int32_t)r;
    rank_rows(order, m, key);
    for (int64_t i = 0; i < m && n < count; i++, n++)
        taken[order[i]] = 1;
    int64_t k = 0;
    for (int64_t r = 0; r < L; r++)
        if (taken[r])
            rows[k++] = (int32_t)r;
}

mc_status mc_rows_gather(mc_mar *mar, const float *f, int64_t n_seq, int64_t seq_rows, int64_t dim,
                         const int32_t *kept, int64_t keep, mc_buffer *index_rows, float *out, mc_err *err) {
    mc_backend *be = mar->backend;
    int32_t *gather = malloc((size_t)(n_seq * keep + 1) * sizeof(int32_t));
    int32_t *d_gather = mc_buffer_ints(be, index_rows, (size_t)(n_seq * keep), "policy.rows", err);
    if (gather == NULL)
        return mc_fail_nomem_n(err, (size_t)(n_seq * keep + 1), sizeof(int32_t), "the gather indices of %lld rows",
                               (long long)(n_seq * keep));
    for (int64_t q = 0; q < n_seq; q++)
        for (int64_t i = 0; i < keep; i++)
            gather[q * keep + i] = (int32_t)(q * seq_rows + kept[q * keep + i]);
    mc_status st = d_gather ? MC_OK : err->status;
    if (st == MC_OK)
        st = be->ops->upload(be, d_gather, gather, (size_t)(n_seq * keep) * sizeof(int32_t), err);
    if (st == MC_OK)
        st = be->ops->gather_rows(be, f, dim, d_gather, n_seq * keep, dim, out, dim, err);
    free(gather);
    return st;
}

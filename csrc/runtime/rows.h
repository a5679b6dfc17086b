/* Row selection shared by the token-pruning policies (LazyMAR, MARche):
 * ranking rows by a host score and gathering the chosen rows on the backend. */
#ifndef MC_ROWS_H
#define MC_ROWS_H

#include <stdint.h>

#include "../models/mar.h"

/* Rows of one sequence of L rows (P buffer rows first), ascending: the forced
 * rows (positions predicted now and at the previous step) always, then the
 * other rows from `first_candidate` on in ascending (key, row) order until
 * `count` rows. `taken` [L] and `order` [L] are scratch; `rows` [count] out. */
void mc_rows_choose(const float *key, int64_t L, int64_t P, int64_t first_candidate, const int32_t *now,
                    int64_t n_now, const int32_t *prev, int64_t n_prev, int64_t count, uint8_t *taken,
                    int32_t *order, int32_t *rows);

/* Gathers rows `kept` [n_seq, keep] (row indices within each sequence of
 * `seq_rows` rows) of f [n_seq, seq_rows, dim] into `out` [n_seq * keep, dim],
 * through the device index buffer `index_rows`. */
mc_status mc_rows_gather(mc_mar *mar, const float *f, int64_t n_seq, int64_t seq_rows, int64_t dim,
                         const int32_t *kept, int64_t keep, mc_buffer *index_rows, float *out, mc_err *err);

#endif

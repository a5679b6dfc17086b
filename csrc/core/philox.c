#include "philox.h"
#include "philox_inline.h"

#include <math.h>
#include <stdlib.h>

void mc_philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]) {
    mc_philox4x32_10_inline(counter[0], counter[1], counter[2], counter[3], key[0], key[1], out);
}

void mc_philox_block(uint64_t seed, uint32_t image, uint32_t stream, uint32_t position,
                     uint32_t step, uint32_t block, uint32_t out[4]) {
    mc_philox_block_inline(seed, image, stream, position, step, block, out);
}

void mc_philox_token_normals(uint64_t seed, uint32_t image, uint32_t stream, uint32_t position,
                             uint32_t step, int count, float *out) {
    for (int block = 0; block * 4 < count; block++) {
        uint32_t w[4];
        float z[4];
        mc_philox_block(seed, image, stream, position, step, (uint32_t)block, w);
        mc_box_muller_inline(w[0], w[1], &z[0], &z[1]);
        mc_box_muller_inline(w[2], w[3], &z[2], &z[3]);
        for (int i = 0; i < 4 && block * 4 + i < count; i++)
            out[block * 4 + i] = z[i];
    }
}

typedef struct order_key {
    uint32_t word;
    int32_t position;
} order_key;

static int compare_order_keys(const void *a, const void *b) {
    const order_key *x = a, *y = b;
    if (x->word != y->word)
        return x->word < y->word ? -1 : 1;
    return (x->position > y->position) - (x->position < y->position);
}

void mc_philox_order(uint64_t seed, uint32_t image, int n, int32_t *order_out) {
    order_key keys[MC_PHILOX_ORDER_MAX];
    if (n > MC_PHILOX_ORDER_MAX)
        n = MC_PHILOX_ORDER_MAX;
    uint32_t w[4];
    for (int p = 0; p < n; p++) {
        if (p % 4 == 0)
            mc_philox_block(seed, image, MC_STREAM_ORDER, 0, 0, (uint32_t)(p / 4), w);
        keys[p].word = w[p % 4];
        keys[p].position = p;
    }
    qsort(keys, (size_t)n, sizeof keys[0], compare_order_keys);
    for (int p = 0; p < n; p++)
        order_out[p] = keys[p].position;
}

#include "philox.h"

#include <math.h>
#include <stdlib.h>

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

void mc_philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]) {
    uint32_t c0 = counter[0], c1 = counter[1], c2 = counter[2], c3 = counter[3];
    uint32_t k0 = key[0], k1 = key[1];
    for (int round = 0; round < 10; round++) {
        uint64_t p0 = (uint64_t)PHILOX_M0 * c0;
        uint64_t p1 = (uint64_t)PHILOX_M1 * c2;
        uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
        uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

void mc_philox_block(uint64_t seed, uint32_t image, uint32_t stream, uint32_t position,
                     uint32_t step, uint32_t block, uint32_t out[4]) {
    const uint32_t key[2] = {(uint32_t)(seed & 0xffffffffu), (uint32_t)(seed >> 32)};
    const uint32_t counter[4] = {block, image, position, (stream << 16) | (step & 0xffffu)};
    mc_philox4x32_10(counter, key, out);
}

static void box_muller(uint32_t wa, uint32_t wb, float *z0, float *z1) {
    const double two_pi = 6.283185307179586476925286766559;
    double u1 = ((double)wa + 1.0) / 4294967296.0;
    double u2 = (double)wb / 4294967296.0;
    double r = sqrt(-2.0 * log(u1));
    *z0 = (float)(r * cos(two_pi * u2));
    *z1 = (float)(r * sin(two_pi * u2));
}

void mc_philox_token_normals(uint64_t seed, uint32_t image, uint32_t stream, uint32_t position,
                             uint32_t step, int count, float *out) {
    for (int block = 0; block * 4 < count; block++) {
        uint32_t w[4];
        float z[4];
        mc_philox_block(seed, image, stream, position, step, (uint32_t)block, w);
        box_muller(w[0], w[1], &z[0], &z[1]);
        box_muller(w[2], w[3], &z[2], &z[3]);
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

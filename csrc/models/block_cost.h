/* What a transformer block costs: the FLOPs of its two sublayers (MAR's
 * encoder and decoder blocks, VAR's blocks), and the meter a phase of a
 * generation adds its time, FLOPs and weight bytes to (telemetry). The FLOP
 * rules live here, below runtime/flops.h, so that the model's phase meter
 * (models/mar.c) and the policies' counts (runtime/) are one definition. */
#ifndef MC_BLOCK_COST_H
#define MC_BLOCK_COST_H

#include <stdint.h>

/* qkv + proj of q_rows rows per sequence, and attention against `keys` rows. */
static inline double mc_flops_block_attn(int64_t n_seq, int64_t q_rows, int64_t keys, int64_t dim) {
    double rows = (double)(n_seq * q_rows), x = (double)dim;
    return 2.0 * rows * x * 3.0 * x + 2.0 * rows * x * x + 4.0 * rows * (double)keys * x;
}

/* fc1 + fc2 of `rows` rows. */
static inline double mc_flops_block_mlp(int64_t rows, int64_t dim, int64_t hidden) {
    return 4.0 * (double)rows * (double)dim * (double)hidden;
}

/* A block whose outputs are read at `read_rows` of its q_rows rows per
 * sequence (mc_mar_block_read_rows): k and v of every row; q, attention,
 * proj and the MLP of the read rows only. All rows read (or a count <= 0,
 * which mc_mar_block_read_rows also takes for all): the whole block. */
static inline double mc_flops_block_read_rows(int64_t n_seq, int64_t q_rows, int64_t read_rows, int64_t keys,
                                              int64_t dim, int64_t hidden) {
    if (read_rows <= 0 || read_rows >= q_rows)
        return mc_flops_block_attn(n_seq, q_rows, keys, dim) + mc_flops_block_mlp(n_seq * q_rows, dim, hidden);
    const double rows = (double)(n_seq * q_rows), read = (double)(n_seq * read_rows), x = (double)dim;
    return 2.0 * rows * x * 2.0 * x + 2.0 * read * x * x + 4.0 * read * (double)keys * x + 2.0 * read * x * x +
           mc_flops_block_mlp(n_seq * read_rows, dim, hidden);
}

/* One phase of a generation (the encoder's blocks, the decoder's, the
 * diffusion head): what its calls took and did, summed over the calls. */
typedef struct mc_phase_meter {
    double seconds;      /* host time inside the calls: their compute time where the backend is
                            synchronous (mc_ops.synchronous), else only the enqueueing */
    double flops;        /* 2 per multiply-add, GEMMs and attention matmuls (mar.md 13) */
    double weight_bytes; /* Linear weight matrices the calls stream, each once per call (and once
                            per row chunk where a call splits its rows), in the stored type */
} mc_phase_meter;

static inline void mc_phase_meter_add(mc_phase_meter *m, double seconds, double flops, double weight_bytes) {
    m->seconds += seconds;
    m->flops += flops;
    m->weight_bytes += weight_bytes;
}

/* What a meter gathered since `before` (a copy taken earlier). */
static inline mc_phase_meter mc_phase_meter_since(const mc_phase_meter *now, const mc_phase_meter *before) {
    mc_phase_meter d = {now->seconds - before->seconds, now->flops - before->flops,
                        now->weight_bytes - before->weight_bytes};
    return d;
}

#endif

#include "flops.h"

double mc_flops_block_attn(int64_t n_seq, int64_t q_rows, int64_t keys, int64_t dim) {
    double rows = (double)(n_seq * q_rows), x = (double)dim;
    return 2.0 * rows * x * 3.0 * x + 2.0 * rows * x * x + 4.0 * rows * (double)keys * x;
}

double mc_flops_block_mlp(int64_t rows, int64_t dim, int64_t hidden) {
    return 4.0 * (double)rows * (double)dim * (double)hidden;
}

double mc_flops_head_eval(const mc_mar_config *c, int64_t rows, int64_t x_rows, mc_head_mode mode,
                          int skip_first, int skip_last) {
    const double W = (double)c->head_width, C = (double)c->token_channels, r = (double)rows;
    double f = 2.0 * (double)x_rows * C * W;
    for (int j = 0; j < (int)c->head_depth; j++) {
        int skipped = mode != MC_HEAD_PLAIN && j >= skip_first && j <= skip_last;
        if (skipped && (mode == MC_HEAD_RECOMPUTE || mode == MC_HEAD_REUSE))
            continue;
        f += mode == MC_HEAD_REUSE ? 2.0 * r * W * W : 10.0 * r * W * W;
    }
    return f + 4.0 * r * W * W + 4.0 * r * W * C;
}

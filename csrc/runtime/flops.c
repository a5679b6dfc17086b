#include "flops.h"

double mc_flops_mar_encoder(const mc_mar_config *c, int64_t n_seq, int64_t new_tokens, int64_t q_rows,
                            int64_t keys) {
    const int64_t D = c->width;
    return 2.0 * (double)(n_seq * new_tokens) * (double)(c->token_channels * D) +
           (double)c->enc_depth * (mc_flops_block_attn(n_seq, q_rows, keys, D) +
                                   mc_flops_block_mlp(n_seq * q_rows, D, c->mlp_hidden)) +
           2.0 * (double)(n_seq * q_rows) * (double)(D * c->dec_width);
}

double mc_mar_transformer_flops(const mc_mar_config *c, int64_t n_seq, int64_t n_known, int64_t read_rows) {
    const int64_t P = c->buffer_size, L = P + c->seq_len, enc_len = P + n_known;
    double f = mc_flops_mar_encoder(c, n_seq, n_known, enc_len, enc_len);
    if (c->dec_depth == 0)
        return f;
    return f +
           (double)(c->dec_depth - 1) * (mc_flops_block_attn(n_seq, L, L, c->dec_width) +
                                         mc_flops_block_mlp(n_seq * L, c->dec_width, c->dec_mlp_hidden)) +
           mc_flops_block_read_rows(n_seq, L, read_rows, L, c->dec_width, c->dec_mlp_hidden);
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

double mc_var_flops_conditioning(const mc_var_config *c, int64_t n_seq) {
    const double C = (double)c->width, S = (double)n_seq;
    return (double)c->depth * 2.0 * S * C * 6.0 * C + 2.0 * S * C * 2.0 * C;
}

double mc_var_flops_scale_input(const mc_var_config *c, int64_t n_maps, int64_t tokens) {
    return 2.0 * (double)(n_maps * tokens) * (double)c->vae_channels * (double)c->width;
}

double mc_var_flops_attn_sublayer(const mc_var_config *c, int64_t n_seq, int64_t rows, int64_t keys) {
    return mc_flops_block_attn(n_seq, rows, keys, c->width);
}

double mc_var_flops_ffn_sublayer(const mc_var_config *c, int64_t n_seq, int64_t rows) {
    return mc_flops_block_mlp(n_seq * rows, c->width, c->ffn_hidden);
}

double mc_var_flops_fastvar_block(const mc_var_config *c, int64_t n_seq, int64_t attn_rows, int64_t attn_keys,
                                  int64_t ffn_rows) {
    return mc_var_flops_attn_sublayer(c, n_seq, attn_rows, attn_keys) + mc_var_flops_ffn_sublayer(c, n_seq, ffn_rows);
}

double mc_var_flops_blocks(const mc_var_config *c, int64_t n_seq, int64_t rows, int64_t keys) {
    return (double)c->depth *
           (mc_var_flops_attn_sublayer(c, n_seq, rows, keys) + mc_var_flops_ffn_sublayer(c, n_seq, rows));
}

double mc_var_flops_logits(const mc_var_config *c, int64_t rows) {
    return 2.0 * (double)rows * (double)c->width * (double)c->vocab;
}

double mc_var_flops_smooth(const mc_var_config *c, int64_t rows) {
    return 2.0 * (double)rows * (double)c->vocab * (double)c->vae_channels;
}

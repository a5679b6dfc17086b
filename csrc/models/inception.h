/* The FID-Inception network (eval_and_formats.md 3-4): the TF
 * "inception-2015-12-05" graph as ported by pytorch-fid (`fid_inception_v3`)
 * and torch-fidelity (`inception-v3-compat`), on the backend op table.
 *
 *   uint8 NHWC [n, h, w, 3], any size
 *   -> TF1 bilinear resize to 299 x 299, (x - 128) / 128
 *   -> Conv2d_1a_3x3 ... Mixed_7c (FIDInceptionA/C/E_1/E_2: average pools
 *      that do not count padding, the max pool of Mixed_7c)
 *   -> global average pool: features [n, 2048] ("pool_3", FID)
 *   -> features . fc.weight^T, no bias: logits_unbiased [n, 1008] (IS)
 *
 * Weights come from a safetensors file with pytorch-fid's state_dict names
 * (`Conv2d_1a_3x3.conv.weight`, `Conv2d_1a_3x3.bn.{weight,bias,running_mean,
 * running_var}`, `Mixed_5b.branch1x1.conv.weight`, ..., `fc.weight`,
 * `fc.bias`; `*.num_batches_tracked` is ignored). BatchNorm (eps 1e-3) is
 * folded into each convolution at load, in double. Channel widths are read
 * back from the shapes, so narrower test networks of the same topology load
 * too; `info.standard` says whether the widths are the real network's.
 *
 * Images are processed `chunk` at a time through activation buffers sized
 * once at load and reused; one mc_inception must not run from two threads
 * at once. */
#ifndef MC_INCEPTION_H
#define MC_INCEPTION_H

#include <stdint.h>

#include "../backend/ops.h"
#include "../core/mc_core.h"
#include "../io/safetensors.h"

#define MC_INCEPTION_SIZE 299   /* input side after the resize */
#define MC_INCEPTION_BN_EPS 1e-3 /* torch-fidelity BasicConv2d */
#define MC_INCEPTION_MAX_SIDE 16384

typedef struct mc_inception mc_inception;

typedef struct mc_inception_info {
    int64_t feature_dim;     /* Mixed_7c output channels (2048) */
    int64_t num_classes;     /* fc rows (1008) */
    int64_t num_params;      /* elements of every tensor read (BN statistics included) */
    int64_t chunk;           /* images per forward pass */
    int standard;            /* 1 when every width is the FID network's */
    double flops_per_image;  /* convolutions + fc at 299 x 299, 2 per multiply-add */
} mc_inception_info;

/* Loads from `file` onto `be` (which must outlive the network). chunk >= 1
 * images per pass. Missing tensor -> MC_ERR_KEY; wrong shape, negative
 * running variance, or a tensor outside the layout -> MC_ERR_VALUE; each
 * message names the file and the key. */
mc_status mc_inception_load(mc_backend *be, const mc_st_file *file, int64_t chunk,
                            mc_inception **out, mc_err *err);
void mc_inception_free(mc_inception *net);
void mc_inception_get_info(const mc_inception *net, mc_inception_info *info);

/* images: host uint8 [n, height, width, 3] (C order). pool_out: host
 * float [n, feature_dim]; logits_out: host float [n, num_classes] or NULL.
 * `cancel`, when non-NULL, is polled between chunks and blocks; non-zero
 * stops with MC_ERR_INTERRUPTED. */
mc_status mc_inception_forward(mc_inception *net, const uint8_t *images, int64_t n, int64_t height,
                               int64_t width, float *pool_out, float *logits_out,
                               int (*cancel)(void *ctx), void *cancel_ctx, mc_err *err);

#endif

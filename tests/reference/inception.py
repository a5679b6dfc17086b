"""Float64 NumPy reference of the FID-Inception network (eval_and_formats.md
sections 3-4), written from the layout of pytorch-fid's `fid_inception_v3` /
torch-fidelity's `inception-v3-compat`, independently of the C code.

    uint8 NHWC, any size
    -> TF1 bilinear resize to 299 x 299 (float32 by definition, ops.resize_bilinear_tf1)
    -> (x - 128) / 128
    -> BasicConv2d stem, Mixed_5b .. Mixed_7c   (float64 from here on)
    -> global average pool: features [N, 2048]
    -> features . fc.weight^T (no bias): logits_unbiased [N, 1008]

BasicConv2d = conv (no bias) -> BatchNorm(eps 1e-3, running statistics) ->
ReLU, applied unfolded here (the engine folds BN into the conv). Weights
use pytorch-fid's state_dict names; every width is read from the weights,
so narrower test networks of the same topology run too.
"""
import zlib

import numpy as np

from . import ops

BN_EPS = 1e-3
SIZE = 299

# (block, kind) in order; A takes pool_features, C takes channels_7x7.
BLOCKS = [("Mixed_5b", "A"), ("Mixed_5c", "A"), ("Mixed_5d", "A"), ("Mixed_6a", "B"),
          ("Mixed_6b", "C"), ("Mixed_6c", "C"), ("Mixed_6d", "C"), ("Mixed_6e", "C"),
          ("Mixed_7a", "D"), ("Mixed_7b", "E1"), ("Mixed_7c", "E2")]

# Every BasicConv2d of a block kind: (branch, kh, kw, stride, (pad_h, pad_w), input).
# input: "x" = the block input, else the branch whose output feeds this one.
BRANCHES = {
    "A": [("branch1x1", 1, 1, 1, (0, 0), "x"),
          ("branch5x5_1", 1, 1, 1, (0, 0), "x"),
          ("branch5x5_2", 5, 5, 1, (2, 2), "branch5x5_1"),
          ("branch3x3dbl_1", 1, 1, 1, (0, 0), "x"),
          ("branch3x3dbl_2", 3, 3, 1, (1, 1), "branch3x3dbl_1"),
          ("branch3x3dbl_3", 3, 3, 1, (1, 1), "branch3x3dbl_2"),
          ("branch_pool", 1, 1, 1, (0, 0), "avgpool")],
    "B": [("branch3x3", 3, 3, 2, (0, 0), "x"),
          ("branch3x3dbl_1", 1, 1, 1, (0, 0), "x"),
          ("branch3x3dbl_2", 3, 3, 1, (1, 1), "branch3x3dbl_1"),
          ("branch3x3dbl_3", 3, 3, 2, (0, 0), "branch3x3dbl_2")],
    "C": [("branch1x1", 1, 1, 1, (0, 0), "x"),
          ("branch7x7_1", 1, 1, 1, (0, 0), "x"),
          ("branch7x7_2", 1, 7, 1, (0, 3), "branch7x7_1"),
          ("branch7x7_3", 7, 1, 1, (3, 0), "branch7x7_2"),
          ("branch7x7dbl_1", 1, 1, 1, (0, 0), "x"),
          ("branch7x7dbl_2", 7, 1, 1, (3, 0), "branch7x7dbl_1"),
          ("branch7x7dbl_3", 1, 7, 1, (0, 3), "branch7x7dbl_2"),
          ("branch7x7dbl_4", 7, 1, 1, (3, 0), "branch7x7dbl_3"),
          ("branch7x7dbl_5", 1, 7, 1, (0, 3), "branch7x7dbl_4"),
          ("branch_pool", 1, 1, 1, (0, 0), "avgpool")],
    "D": [("branch3x3_1", 1, 1, 1, (0, 0), "x"),
          ("branch3x3_2", 3, 3, 2, (0, 0), "branch3x3_1"),
          ("branch7x7x3_1", 1, 1, 1, (0, 0), "x"),
          ("branch7x7x3_2", 1, 7, 1, (0, 3), "branch7x7x3_1"),
          ("branch7x7x3_3", 7, 1, 1, (3, 0), "branch7x7x3_2"),
          ("branch7x7x3_4", 3, 3, 2, (0, 0), "branch7x7x3_3")],
    "E": [("branch1x1", 1, 1, 1, (0, 0), "x"),
          ("branch3x3_1", 1, 1, 1, (0, 0), "x"),
          ("branch3x3_2a", 1, 3, 1, (0, 1), "branch3x3_1"),
          ("branch3x3_2b", 3, 1, 1, (1, 0), "branch3x3_1"),
          ("branch3x3dbl_1", 1, 1, 1, (0, 0), "x"),
          ("branch3x3dbl_2", 3, 3, 1, (1, 1), "branch3x3dbl_1"),
          ("branch3x3dbl_3a", 1, 3, 1, (0, 1), "branch3x3dbl_2"),
          ("branch3x3dbl_3b", 3, 1, 1, (1, 0), "branch3x3dbl_2"),
          ("branch_pool", 1, 1, 1, (0, 0), "pool")],
}
BRANCHES["E1"] = BRANCHES["E2"] = BRANCHES["E"]

# Output channel order of each block's concatenation ("maxpool" = the
# stride-2 max pool of the block input itself).
CONCAT = {
    "A": ["branch1x1", "branch5x5_2", "branch3x3dbl_3", "branch_pool"],
    "B": ["branch3x3", "branch3x3dbl_3", "maxpool"],
    "C": ["branch1x1", "branch7x7_3", "branch7x7dbl_5", "branch_pool"],
    "D": ["branch3x3_2", "branch7x7x3_4", "maxpool"],
    "E": ["branch1x1", "branch3x3_2a", "branch3x3_2b", "branch3x3dbl_3a", "branch3x3dbl_3b",
          "branch_pool"],
}
CONCAT["E1"] = CONCAT["E2"] = CONCAT["E"]

# The stem: (name, k, stride, pad); max pools 3 / 2 after 2b and 4a.
STEM = [("Conv2d_1a_3x3", 3, 2, 0), ("Conv2d_2a_3x3", 3, 1, 0), ("Conv2d_2b_3x3", 3, 1, 1),
        ("Conv2d_3b_1x1", 1, 1, 0), ("Conv2d_4a_3x3", 3, 1, 0)]

# Widths of the real network: stem outputs, then per block the output width
# of every branch conv (pool_features / channels_7x7 folded in).
STANDARD_WIDTHS = {
    "Conv2d_1a_3x3": 32, "Conv2d_2a_3x3": 32, "Conv2d_2b_3x3": 64, "Conv2d_3b_1x1": 80,
    "Conv2d_4a_3x3": 192,
}
_A = dict(branch1x1=64, branch5x5_1=48, branch5x5_2=64, branch3x3dbl_1=64, branch3x3dbl_2=96,
          branch3x3dbl_3=96)
for _name, _pf in (("Mixed_5b", 32), ("Mixed_5c", 64), ("Mixed_5d", 64)):
    STANDARD_WIDTHS.update({"%s.%s" % (_name, k): v for k, v in _A.items()})
    STANDARD_WIDTHS[_name + ".branch_pool"] = _pf
STANDARD_WIDTHS.update({"Mixed_6a.branch3x3": 384, "Mixed_6a.branch3x3dbl_1": 64,
                        "Mixed_6a.branch3x3dbl_2": 96, "Mixed_6a.branch3x3dbl_3": 96})
for _name, _c7 in (("Mixed_6b", 128), ("Mixed_6c", 160), ("Mixed_6d", 160), ("Mixed_6e", 192)):
    for _b in ("branch7x7_1", "branch7x7_2", "branch7x7dbl_1", "branch7x7dbl_2", "branch7x7dbl_3",
               "branch7x7dbl_4"):
        STANDARD_WIDTHS["%s.%s" % (_name, _b)] = _c7
    for _b in ("branch1x1", "branch7x7_3", "branch7x7dbl_5", "branch_pool"):
        STANDARD_WIDTHS["%s.%s" % (_name, _b)] = 192
STANDARD_WIDTHS.update({"Mixed_7a.branch3x3_1": 192, "Mixed_7a.branch3x3_2": 320,
                        "Mixed_7a.branch7x7x3_1": 192, "Mixed_7a.branch7x7x3_2": 192,
                        "Mixed_7a.branch7x7x3_3": 192, "Mixed_7a.branch7x7x3_4": 192})
for _name in ("Mixed_7b", "Mixed_7c"):
    STANDARD_WIDTHS.update({"%s.%s" % (_name, k): v for k, v in dict(
        branch1x1=320, branch3x3_1=384, branch3x3_2a=384, branch3x3_2b=384, branch3x3dbl_1=448,
        branch3x3dbl_2=384, branch3x3dbl_3a=384, branch3x3dbl_3b=384, branch_pool=192).items()})
NUM_CLASSES = 1008
FEATURE_DIM = 2048


def conv_layout(divisor=1):
    """[(prefix, cout, cin, kh, kw)] for every BasicConv2d in state_dict
    order, plus the final width. divisor > 1 makes a narrower network of
    the same topology (every width // divisor, at least 1)."""
    def width(name):
        return max(1, STANDARD_WIDTHS[name] // divisor)

    layout = []
    c = 3
    for name, k, _, _ in STEM:
        layout.append((name, width(name), c, k, k))
        c = width(name)
    for block, kind in BLOCKS:
        outs = {"x": c, "avgpool": c, "pool": c}
        for branch, kh, kw, _, _, src in BRANCHES[kind]:
            prefix = "%s.%s" % (block, branch)
            layout.append((prefix, width(prefix), outs[src], kh, kw))
            outs[branch] = width(prefix)
        c = sum(outs[b] if b != "maxpool" else outs["x"] for b in CONCAT[kind])
    return layout, c


def state_dict_keys(num_batches_tracked=False):
    """Every key of pytorch-fid's fid_inception_v3 state_dict, in order."""
    keys = []
    for prefix, *_ in conv_layout()[0]:
        keys.append(prefix + ".conv.weight")
        keys += [prefix + ".bn." + s for s in ("weight", "bias", "running_mean", "running_var")]
        if num_batches_tracked:
            keys.append(prefix + ".bn.num_batches_tracked")
    return keys + ["fc.weight", "fc.bias"]


def random_weights(rng, divisor=1, num_classes=NUM_CLASSES, num_batches_tracked=True):
    """Random float32 weights in the exact key layout: He-scaled conv
    weights, BatchNorm statistics with positive variance, a random fc."""
    w = {}
    layout, feat = conv_layout(divisor)
    for prefix, cout, cin, kh, kw in layout:
        fan_in = cin * kh * kw
        w[prefix + ".conv.weight"] = (rng.standard_normal((cout, cin, kh, kw)) *
                                      np.sqrt(2.0 / fan_in)).astype(np.float32)
        w[prefix + ".bn.weight"] = rng.uniform(0.5, 1.5, cout).astype(np.float32)
        w[prefix + ".bn.bias"] = rng.normal(0.0, 0.2, cout).astype(np.float32)
        w[prefix + ".bn.running_mean"] = rng.normal(0.0, 0.2, cout).astype(np.float32)
        w[prefix + ".bn.running_var"] = rng.uniform(0.5, 2.0, cout).astype(np.float32)
        if num_batches_tracked:
            w[prefix + ".bn.num_batches_tracked"] = np.array(0, dtype=np.int64)
    w["fc.weight"] = (rng.standard_normal((num_classes, feat)) / np.sqrt(feat)).astype(np.float32)
    w["fc.bias"] = rng.normal(0.0, 0.1, num_classes).astype(np.float32)
    return w


def basic_conv(w, prefix, x, stride=1, pad=(0, 0)):
    """conv (no bias) -> BatchNorm (eps 1e-3) -> ReLU, float64."""
    y = ops.conv2d_ex(x, w[prefix + ".conv.weight"], None, stride=(stride, stride), pad=pad)
    mean = np.float64(w[prefix + ".bn.running_mean"])
    var = np.float64(w[prefix + ".bn.running_var"])
    y = (y - mean) / np.sqrt(var + BN_EPS) * np.float64(w[prefix + ".bn.weight"]) + \
        np.float64(w[prefix + ".bn.bias"])
    return np.maximum(y, 0.0)


def block(w, name, kind, x):
    outs = {"x": x}
    if kind in ("A", "C", "E1"):
        outs["avgpool"] = ops.avg_pool2d(x, 3, 3, (1, 1), (1, 1), count_include_pad=False)
    if kind == "E1":
        outs["pool"] = outs["avgpool"]
    if kind == "E2":  # the TF graph's quirk: max pool in Mixed_7c's branch_pool
        outs["pool"] = ops.max_pool2d(x, 3, 3, (1, 1), (1, 1))
    if kind in ("B", "D"):
        outs["maxpool"] = ops.max_pool2d(x, 3, 3, (2, 2))
    for branch, _, _, stride, pad, src in BRANCHES[kind]:
        outs[branch] = basic_conv(w, "%s.%s" % (name, branch), outs[src], stride, pad)
    return np.concatenate([outs[b] for b in CONCAT[kind]], axis=3)


def preprocess(images):
    """uint8 NHWC -> the network input: TF1 resize to 299 and (x - 128) / 128,
    in float32 as the graph computes it."""
    return ops.resize_bilinear_tf1(np.asarray(images, np.uint8), SIZE, SIZE, normalize=True)


def forward(w, images):
    """-> (pool features [N, F], logits_unbiased [N, K]), float64."""
    x = np.float64(preprocess(images))
    for name, k, stride, pad in STEM:
        x = basic_conv(w, name, x, stride, (pad, pad))
        if name in ("Conv2d_2b_3x3", "Conv2d_4a_3x3"):
            x = ops.max_pool2d(x, 3, 3, (2, 2))
    for name, kind in BLOCKS:
        x = block(w, name, kind, x)
    pool = x.mean(axis=(1, 2))
    logits = pool @ np.float64(w["fc.weight"]).T
    return pool, logits


def layout_fill(name, shape):
    """The fill of the committed Inception layout fixture
    (tests/fixtures/inception_layout_legacy.pth.xz, made by make_torch_fixtures.py):
    periodic, so the file compresses to almost nothing, and recomputed by
    test_convert from the key name alone."""
    n = int(np.prod(shape))
    seed = zlib.crc32(name.encode()) % 97
    v = ((np.arange(n, dtype=np.int64) * 7 + seed) % 61 - 30).astype(np.float32) / 16
    if name.endswith("running_var"):
        v = np.abs(v) + 0.5
    return v.reshape(shape)

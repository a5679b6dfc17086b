"""Kind ``inception``: the FID Inception-v3 of pytorch-fid (``spec/eval_and_formats.md``
section 3), 472 tensors; BatchNorm step counters are dropped."""
import collections

from .checks import Plan, _check_float, _compare, _dim, _state_dict, _wrong_kind


# FID Inception (pytorch-fid FIDInceptionA/C/E_1/E_2 on torchvision's Inception3,
# num_classes=1008, aux_logits=False; eval_and_formats.md section 3). Each entry:
# BasicConv2d name -> (in, out, kh, kw); every BasicConv2d has a bias-free conv
# and a BatchNorm2d (weight, bias, running_mean, running_var[, num_batches_tracked]).
def _inception_convs():
    convs = [("Conv2d_1a_3x3", 3, 32, 3, 3), ("Conv2d_2a_3x3", 32, 32, 3, 3), ("Conv2d_2b_3x3", 32, 64, 3, 3),
             ("Conv2d_3b_1x1", 64, 80, 1, 1), ("Conv2d_4a_3x3", 80, 192, 3, 3)]

    def a(name, cin, pool):
        return [(f"{name}.branch1x1", cin, 64, 1, 1), (f"{name}.branch5x5_1", cin, 48, 1, 1),
                (f"{name}.branch5x5_2", 48, 64, 5, 5), (f"{name}.branch3x3dbl_1", cin, 64, 1, 1),
                (f"{name}.branch3x3dbl_2", 64, 96, 3, 3), (f"{name}.branch3x3dbl_3", 96, 96, 3, 3),
                (f"{name}.branch_pool", cin, pool, 1, 1)]

    def c(name, c7):
        return [(f"{name}.branch1x1", 768, 192, 1, 1), (f"{name}.branch7x7_1", 768, c7, 1, 1),
                (f"{name}.branch7x7_2", c7, c7, 1, 7), (f"{name}.branch7x7_3", c7, 192, 7, 1),
                (f"{name}.branch7x7dbl_1", 768, c7, 1, 1), (f"{name}.branch7x7dbl_2", c7, c7, 7, 1),
                (f"{name}.branch7x7dbl_3", c7, c7, 1, 7), (f"{name}.branch7x7dbl_4", c7, c7, 7, 1),
                (f"{name}.branch7x7dbl_5", c7, 192, 1, 7), (f"{name}.branch_pool", 768, 192, 1, 1)]

    def e(name, cin):
        return [(f"{name}.branch1x1", cin, 320, 1, 1), (f"{name}.branch3x3_1", cin, 384, 1, 1),
                (f"{name}.branch3x3_2a", 384, 384, 1, 3), (f"{name}.branch3x3_2b", 384, 384, 3, 1),
                (f"{name}.branch3x3dbl_1", cin, 448, 1, 1), (f"{name}.branch3x3dbl_2", 448, 384, 3, 3),
                (f"{name}.branch3x3dbl_3a", 384, 384, 1, 3), (f"{name}.branch3x3dbl_3b", 384, 384, 3, 1),
                (f"{name}.branch_pool", cin, 192, 1, 1)]

    convs += a("Mixed_5b", 192, 32) + a("Mixed_5c", 256, 64) + a("Mixed_5d", 288, 64)
    convs += [("Mixed_6a.branch3x3", 288, 384, 3, 3), ("Mixed_6a.branch3x3dbl_1", 288, 64, 1, 1),
              ("Mixed_6a.branch3x3dbl_2", 64, 96, 3, 3), ("Mixed_6a.branch3x3dbl_3", 96, 96, 3, 3)]
    convs += c("Mixed_6b", 128) + c("Mixed_6c", 160) + c("Mixed_6d", 160) + c("Mixed_6e", 192)
    convs += [("Mixed_7a.branch3x3_1", 768, 192, 1, 1), ("Mixed_7a.branch3x3_2", 192, 320, 3, 3),
              ("Mixed_7a.branch7x7x3_1", 768, 192, 1, 1), ("Mixed_7a.branch7x7x3_2", 192, 192, 1, 7),
              ("Mixed_7a.branch7x7x3_3", 192, 192, 7, 1), ("Mixed_7a.branch7x7x3_4", 192, 192, 3, 3)]
    convs += e("Mixed_7b", 1280) + e("Mixed_7c", 2048)
    return convs


INCEPTION_NUM_CLASSES = 1008


def inception_expected_shapes():
    """key -> shape of the FID Inception state_dict (94 BasicConv2d x 5 + fc = 472
    tensors; the optional BatchNorm num_batches_tracked counters are extra)."""
    s = []
    for name, cin, cout, kh, kw in _inception_convs():
        s += [(f"{name}.conv.weight", (cout, cin, kh, kw)), (f"{name}.bn.weight", (cout,)),
              (f"{name}.bn.bias", (cout,)), (f"{name}.bn.running_mean", (cout,)), (f"{name}.bn.running_var", (cout,))]
    s += [("fc.weight", (INCEPTION_NUM_CLASSES, 2048)), ("fc.bias", (INCEPTION_NUM_CLASSES,))]
    return collections.OrderedDict(s)


def plan_inception(ck):
    """FID Inception (eval_and_formats.md 3; pytorch-fid's pt_inception-2015-12-05):
    the 472 tensors of Inception3(num_classes=1008, aux_logits=False) with the FID
    blocks; BatchNorm num_batches_tracked counters, if present, are dropped."""
    path = ck.path
    sd, where = _state_dict(ck.root, path, prefer=("state_dict", "model"))
    if "Conv2d_1a_3x3.conv.weight" not in sd and "Mixed_7c.branch_pool.conv.weight" not in sd:
        raise _wrong_kind(path, "inception", sd, where)
    expected = inception_expected_shapes()
    counters = [k for k in sd if k.endswith(".bn.num_batches_tracked") and k[: -len("num_batches_tracked")] +
                "running_mean" in expected]
    hint = ""
    if any(k.startswith("AuxLogits.") for k in sd) or _dim(sd, "fc.weight", 0) == 1000:
        hint = " (this looks like torchvision's ImageNet Inception-v3, not the FID weights)"
    _compare(path, "FID Inception key set (eval_and_formats.md section 3: Inception3 with 1008 classes, no aux "
             "logits)" + hint, expected, sd, optional=counters)
    tensors = collections.OrderedDict((k, sd[k]) for k in expected)
    _check_float(path, tensors)
    meta = {"num_classes": INCEPTION_NUM_CLASSES, "bn_eps": "0.001", "features": "2048",
            "variant": "pytorch-fid FID Inception (TF inception-2015-12-05)"}
    notes = ["FID Inception: 94 BasicConv2d + fc 2048 -> 1008"]
    if counters:
        notes.append(f"dropped {len(counters)} BatchNorm num_batches_tracked counters")
    return Plan("inception", tensors, meta, counters, notes)

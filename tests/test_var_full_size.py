"""Full-size VAR d16/d20/d24/d30 files in the official key layout (A3): the loader reads
every key with its real shape (head dim 64, FFN 4C, 680 tokens in 10 scales with the
default patch_nums), and the engine computes what the float64 reference computes.

Memory and time decide what runs where (the machine is shared; d30 has 2.0e9 parameters,
8 GB in float32):
  * d16: random weights stored in fp16 (0.62 GB), loaded in fp32 and compared with the
    float64 reference on the first two scales of two sequences (one conditional, one
    null), and loaded in bf16 (weights rounded to bf16: the reference within bf16 bounds).
  * d20, d24, d30: files of the real shapes whose data section is sparse (zeros, nothing
    written: the file's size is that of the fp16 weights but it takes no disk), loaded with
    dtype bf16 (half the fp32 memory: 1.2 / 2.1 / 4.0 GB) and run through the first scale;
    the config, the parameter count of A1 and finite outputs are checked. Zero weights say
    nothing about the arithmetic, which d16 and the tiny models check."""
import gc
import json
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

from marcache import _C
from reference import var as RV
from tolerance import assert_close, scaled_atol

PARAMS = {16: 310_283_520, 20: 600_917_136, 24: 1_033_399_360, 30: 2_010_020_356}


def official_shapes(depth):
    """key -> shape of the released var_d{depth}.pth, buffers left out (A3)."""
    C, H, L, V = 64 * depth, depth, 680, 4096
    shapes = {"pos_start": (1, 1, C), "pos_1LC": (1, L, C), "word_embed.weight": (C, 32), "word_embed.bias": (C,),
              "class_emb.weight": (1001, C), "lvl_embed.weight": (10, C), "head_nm.ada_lin.1.weight": (2 * C, C),
              "head_nm.ada_lin.1.bias": (2 * C,), "head.weight": (V, C), "head.bias": (V,)}
    for i in range(depth):
        p = "blocks.%d." % i
        shapes.update({p + "attn.scale_mul_1H11": (1, H, 1, 1), p + "attn.q_bias": (C,), p + "attn.v_bias": (C,),
                       p + "attn.mat_qkv.weight": (3 * C, C), p + "attn.proj.weight": (C, C),
                       p + "attn.proj.bias": (C,), p + "ffn.fc1.weight": (4 * C, C), p + "ffn.fc1.bias": (4 * C,),
                       p + "ffn.fc2.weight": (C, 4 * C), p + "ffn.fc2.bias": (C,),
                       p + "ada_lin.1.weight": (6 * C, C), p + "ada_lin.1.bias": (6 * C,)})
    return shapes


def write_sparse_fp16(path, shapes):
    """A valid safetensors file of F16 tensors whose data are all zeros, written as a
    sparse file (the header, then a seek to the end): no data pages are written."""
    header, offset = {}, 0
    for key in sorted(shapes):
        nbytes = 2 * int(np.prod(shapes[key]))
        header[key] = {"dtype": "F16", "shape": list(shapes[key]), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.truncate(8 + len(text) + offset)


def test_param_counts_of_the_shapes():
    for depth, want in PARAMS.items():
        assert sum(int(np.prod(s)) for s in official_shapes(depth).values()) == want
        assert len(official_shapes(depth)) == 12 - 2 + 12 * depth  # 12 + 13 depth keys less the 2 + depth buffers


@pytest.fixture(scope="module")
def d16(tmp_path_factory):
    """Random d16 weights of useful magnitudes (the reference generator's scales for the
    real shapes), stored in fp16; returned as float32 arrays of the stored values."""
    path = tmp_path_factory.mktemp("var_full") / "var_d16.safetensors"
    rng = np.random.default_rng(16)
    W = RV.random_var_weights(rng, depth=16, width=1024, heads=16, vocab=4096, vae_channels=32,
                              num_classes=1000, patch_nums=RV.DEFAULT_PATCH_NUMS, buffers=False)
    W = {k: v.astype(np.float16) for k, v in W.items()}
    assert set(W) == set(official_shapes(16)) and all(W[k].shape == s for k, s in official_shapes(16).items())
    save_file(W, str(path))
    yield str(path), {k: v.astype(np.float32) for k, v in W.items()}
    gc.collect()


def first_scales_inputs(ref, labels):
    """(maps, inputs) of scales 0 and 1 (the 2x2 map) for the labels."""
    rng = np.random.default_rng(0)
    maps = rng.standard_normal((len(labels), 4, 32)).astype(np.float32)
    return maps, ref.scale_inputs(labels, maps)


def test_d16_fp32_matches_reference(d16):
    path, W = d16
    m = _C.VAR(path)
    c = m.config
    assert (c["depth"], c["width"], c["heads"], c["head_dim"], c["ffn_hidden"]) == (16, 1024, 16, 64, 4096)
    assert (c["vocab"], c["vae_channels"], c["num_classes"], c["tokens"]) == (4096, 32, 1000, 680)
    assert c["patch_nums"] == RV.DEFAULT_PATCH_NUMS and m.num_params == PARAMS[16]
    ref = RV.VARReference(W)
    labels = np.array([207, 1000], np.int32)
    maps, want_inputs = first_scales_inputs(ref, labels)
    got_inputs = m.scale_inputs(labels, maps)
    assert_close(got_inputs, want_inputs, rtol=1e-6, atol=scaled_atol(want_inputs, 1e-6, axis=-1),
                 what="d16 scale inputs")
    inputs = want_inputs.astype(np.float32)
    hidden, logits = m.forward_scales(labels, inputs)
    want_h, want_l = ref.forward_scales(labels, inputs)
    assert_close(hidden, want_h, rtol=1e-5, atol=scaled_atol(want_h, 1e-5, axis=-1), what="d16 hidden")
    assert_close(logits, want_l, rtol=1e-5, atol=scaled_atol(want_l, 1e-5, axis=-1), what="d16 logits")
    del m
    gc.collect()


def test_d16_bf16_within_bf16_bounds(d16):
    path, W = d16
    m = _C.VAR(path, dtype="bf16")
    ref = RV.VARReference(W)
    labels = np.array([3, 1000], np.int32)
    inputs = first_scales_inputs(ref, labels)[1].astype(np.float32)
    _, logits = m.forward_scales(labels, inputs)
    _, want = ref.forward_scales(labels, inputs)
    # bf16 weights and activations through 16 blocks: a few 1e-2 of each token's scale
    assert_close(logits, want, rtol=0.0, atol=scaled_atol(want, 5e-2, axis=-1), what="d16 bf16 logits")
    assert np.abs(logits - want).max() > 1e-6  # the weights really were rounded
    del m
    gc.collect()


@pytest.mark.parametrize("depth", [20, 24, 30])
def test_larger_depths_load_and_run_a_scale(tmp_path, depth):
    path = tmp_path / ("var_d%d.safetensors" % depth)
    write_sparse_fp16(path, official_shapes(depth))
    m = _C.VAR(str(path), dtype="bf16")
    c = m.config
    C = 64 * depth
    assert (c["depth"], c["width"], c["heads"], c["head_dim"], c["ffn_hidden"]) == (depth, C, depth, 64, 4 * C)
    assert m.num_params == PARAMS[depth]
    labels = np.array([1, 1000], np.int32)
    inputs = m.scale_inputs(labels, np.zeros((2, 0, 32), np.float32))
    hidden, logits = m.forward_scales(labels, inputs)
    assert hidden.shape == (2, 1, C) and logits.shape == (2, 1, 4096)
    assert np.isfinite(hidden).all() and np.isfinite(logits).all()
    del m
    gc.collect()

"""The VAR transformer (csrc/models/var.c, marcache._C.VAR) against the float64 reference
(tests/reference/var.py) on a tiny random model in the official key layout: loading,
the scale inputs, the KV-cached scale loop (hidden states and logits per scale), and
the loader's refusals. Guard runs happen in a subprocess (a host access to backend
memory kills the process)."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from marcache import _C
from reference import var as RV
from tolerance import assert_close, scaled_atol
from var_fixtures import TINY, write_tiny_var
from child_env import child_env

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("var") / "tiny_var.safetensors"
    W = write_tiny_var(path, seed=3)
    return str(path), W


def reference_of(W, patch_nums=TINY["patch_nums"]):
    return RV.VARReference(W, patch_nums)


def random_next_maps(rng, n, ref):
    """Next-scale maps [n, T, Cvae] for every scale after the first (values like f_hat's)."""
    return rng.standard_normal((n, ref.L - ref.begin[1], ref.Cvae)).astype(np.float32)


def per_token(ref, share=1e-5):
    """The comparison allowance of one token: share of its largest value (float32 sums)."""
    return scaled_atol(ref, share, axis=-1)


def test_config_and_params(tiny):
    path, W = tiny
    m = _C.VAR(path)
    c = m.config
    assert (c["depth"], c["width"], c["heads"], c["head_dim"], c["ffn_hidden"]) == (2, 128, 2, 64, 512)
    assert (c["vocab"], c["vae_channels"], c["num_classes"]) == (64, 8, 10)
    assert c["patch_nums"] == (1, 2, 3, 4) and c["tokens"] == 30 and c["n_scales"] == 4
    buffers = ("lvl_1L", "attn_bias_for_masking")
    assert m.num_params == sum(v.size for k, v in W.items() if k not in buffers and "zero_k_bias" not in k)


def test_num_params_formula_of_the_spec():
    """A3's count for the released shapes, through the same C formula (d16: 310,283,520)."""
    for depth, want in ((16, 310283520), (20, 600917136), (24, 1033399360), (30, 2010020356)):
        C, H = 64 * depth, depth
        got = 1725 * C + depth * (18 * C * C + 14 * C + H) + (2 * C * C + 2 * C) + (4096 * C + 4096)
        assert got == want


def test_head_scale_cap_is_float32_ln100():
    """The cap is float32(ln 100) = 4.60517025 (torch computes it in float32), above ln 100:
    a capped head's scale is 100.0000064 in float64 and 100.0000076 in float32."""
    assert RV.SCALE_MUL_CAP == float(np.float32(math.log(100.0)))
    assert RV.SCALE_MUL_CAP - math.log(100.0) == pytest.approx(6.4e-8, rel=0.01)
    assert np.float32(np.exp(RV.SCALE_MUL_CAP)) == np.float32(100.00000763)


def test_scale_inputs(backend, tiny):
    path, W = tiny
    m = _C.VAR(path, device=backend)
    ref = reference_of(W)
    rng = np.random.default_rng(0)
    labels = np.array([3, 10, 0], np.int32)  # 10 = the null class
    maps = random_next_maps(rng, 3, ref)
    got = m.scale_inputs(labels, maps)
    want = ref.scale_inputs(labels, maps)
    assert_close(got, want, rtol=1e-6, atol=per_token(want, 1e-6), what="scale inputs")
    # a prefix of the scales: scales 0..2
    got2 = m.scale_inputs(labels, maps[:, :4 + 9])
    np.testing.assert_array_equal(got2, got[:, :14])
    got0 = m.scale_inputs(labels, maps[:, :0])
    np.testing.assert_array_equal(got0, got[:, :1])


def test_reference_kv_cache_equals_masked_forward(tiny):
    """The reference's KV-cached scale loop equals the teacher-forced forward with the
    block-causal mask (A4): a check of the reference itself."""
    _, W = tiny
    ref = reference_of(W)
    rng = np.random.default_rng(1)
    labels = np.array([1, 10], np.int32)
    inputs = ref.scale_inputs(labels, random_next_maps(rng, 2, ref))
    h1, l1 = ref.forward_scales(labels, inputs)
    h2, l2 = ref.forward_masked(labels, inputs)
    np.testing.assert_allclose(h1, h2, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(l1, l2, rtol=1e-12, atol=1e-12)


def test_forward_scales_against_reference(backend, tiny):
    """Every scale's hidden states and logits within 1e-5 (relative to each token's largest
    value) of the float64 reference, on inputs of the reference's own embedding."""
    path, W = tiny
    m = _C.VAR(path, device=backend)
    ref = reference_of(W)
    rng = np.random.default_rng(2)
    labels = np.array([4, 7, 10, 10], np.int32)
    inputs = ref.scale_inputs(labels, random_next_maps(rng, 4, ref)).astype(np.float32)
    hidden, logits = m.forward_scales(labels, inputs)
    want_h, want_l = ref.forward_scales(labels, inputs)
    for si in range(len(ref.patch_nums)):
        b, e = ref.begin[si], ref.begin[si + 1]
        assert_close(hidden[:, b:e], want_h[:, b:e], rtol=1e-5, atol=per_token(want_h[:, b:e]),
                     what="hidden states of scale %d on %s" % (si, backend))
        assert_close(logits[:, b:e], want_l[:, b:e], rtol=1e-5, atol=per_token(want_l[:, b:e]),
                     what="logits of scale %d on %s" % (si, backend))
    # the logits are not degenerate: a few units, different per token
    assert 0.5 < np.abs(want_l).max() < 100 and np.std(want_l[:, -16:], axis=-1).min() > 0.1


def test_forward_scales_prefix_and_batch_invariance(tiny):
    """Fewer scales give the first scales' results bit for bit; a sequence alone gives its
    rows of the batch within 1e-5 of each token's largest value. (Not bit for bit: OpenBLAS's
    sgemm takes other kernel paths for other row counts, so an output row's rounding depends
    on the batch; the MAR engine has the same property, test_mar.test_batch_invariance.)"""
    path, W = tiny
    m = _C.VAR(path)
    ref = reference_of(W)
    rng = np.random.default_rng(5)
    labels = np.array([2, 9, 10], np.int32)
    inputs = ref.scale_inputs(labels, random_next_maps(rng, 3, ref)).astype(np.float32)
    h, l = m.forward_scales(labels, inputs)
    h2, l2 = m.forward_scales(labels, inputs[:, :14])
    np.testing.assert_array_equal(h2, h[:, :14])
    np.testing.assert_array_equal(l2, l[:, :14])
    for i in range(3):
        hi, li = m.forward_scales(labels[i:i + 1], inputs[i:i + 1])
        assert_close(hi, h[i:i + 1], rtol=0.0, atol=per_token(h[i:i + 1]), what="hidden of sequence %d alone" % i)
        assert_close(li, l[i:i + 1], rtol=0.0, atol=per_token(l[i:i + 1]), what="logits of sequence %d alone" % i)


GUARD_CHILD = r"""
import json, sys
import numpy as np
from marcache import _C
path, labels, inputs = sys.argv[1], json.loads(sys.argv[2]), np.load(sys.argv[3])
out = {}
for device in ("cpu", "guard"):
    m = _C.VAR(path, device=device)
    h, l = m.forward_scales(np.array(labels, np.int32), inputs)
    maps = np.zeros((len(labels), 29, 8), np.float32) + 0.25
    s = m.scale_inputs(np.array(labels, np.int32), maps)
    out[device] = [h.tobytes().hex(), l.tobytes().hex(), s.tobytes().hex()]
print(json.dumps({"same": out["cpu"] == out["guard"]}))
"""


def test_guard_equals_cpu(tiny, tmp_path):
    """On the guard backend (host access to backend memory faults) the model gives the
    CPU's bits."""
    path, W = tiny
    ref = reference_of(W)
    labels = [1, 10]
    inputs = ref.scale_inputs(np.array(labels), random_next_maps(np.random.default_rng(6), 2, ref))
    np.save(tmp_path / "inputs.npy", inputs.astype(np.float32))
    env = child_env(PYTHONFAULTHANDLER="1")
    proc = subprocess.run([sys.executable, "-c", GUARD_CHILD, path, json.dumps(labels), str(tmp_path / "inputs.npy")],
                          cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"same": True}


# ------------------------------------------------------------------------------------------
# loader
# ------------------------------------------------------------------------------------------

def test_patch_nums_default_and_metadata(tmp_path):
    """Without metadata the released models' patch_nums are assumed: a model of other
    scales is refused naming both counts and the fix; with metadata it loads."""
    path = tmp_path / "no_meta.safetensors"
    write_tiny_var(path, metadata=False)
    with pytest.raises(ValueError) as info:
        _C.VAR(str(path))
    msg = str(info.value)
    assert "1,2,3,4,5,6,8,10,13,16" in msg and "10 scales of 680 tokens" in msg
    assert "'lvl_embed.weight' has 4 rows and 'pos_1LC' 30 tokens" in msg and "add metadata 'patch_nums'" in msg
    bad = tmp_path / "bad_meta.safetensors"
    W = write_tiny_var(bad)
    save_file({k: v for k, v in W.items()}, str(bad), metadata={"patch_nums": "1,2,3,5"})
    with pytest.raises(ValueError, match="patch_nums 1,2,3,5 .from the file's metadata. gives 4 scales of 39"):
        _C.VAR(str(bad))
    save_file({k: v for k, v in W.items()}, str(bad), metadata={"patch_nums": "1,2,x"})
    with pytest.raises(ValueError, match="metadata 'patch_nums' = '1,2,x' is not a list"):
        _C.VAR(str(bad))


def test_missing_scale_mul_is_refused(tmp_path):
    path = tmp_path / "old.safetensors"
    write_tiny_var(path, drop=("blocks.1.attn.scale_mul_1H11",))
    with pytest.raises(KeyError) as info:
        _C.VAR(str(path))
    msg = str(info.value)
    assert "blocks.1.attn.scale_mul_1H11" in msg and "attn_l2_norm" in msg and "#38" in msg


def test_other_files_are_refused(tmp_path):
    path = tmp_path / "mar_like.safetensors"
    save_file({"diffloss.net.input_proj.weight": np.zeros((4, 4), np.float32)}, str(path))
    with pytest.raises(ValueError, match="is a MAR checkpoint, not a VAR model"):
        _C.VAR(str(path))
    save_file({"quantize.embedding.weight": np.zeros((4, 4), np.float32)}, str(path))
    with pytest.raises(ValueError, match="is a VQVAE file, not a VAR model"):
        _C.VAR(str(path))
    bad = tmp_path / "bad_shape.safetensors"
    W = write_tiny_var(bad)
    W["blocks.0.ffn.fc2.weight"] = W["blocks.0.ffn.fc2.weight"][:, :-1]
    save_file(W, str(bad), metadata={"patch_nums": "1,2,3,4"})
    with pytest.raises(ValueError, match="blocks.0.ffn.fc2.weight"):
        _C.VAR(str(bad))


def test_bad_component_arguments(tiny):
    path, _ = tiny
    m = _C.VAR(path)
    with pytest.raises(ValueError, match=r"label 11 at index 1 is outside 0..10 \(10 = the null class\)"):
        m.forward_scales(np.array([0, 11], np.int32), np.zeros((2, 1, 128), np.float32))
    with pytest.raises(ValueError, match="inputs has 2 tokens per sequence; it must cover whole scales from the "
                                         "first: one of 1, 5, 14, 30"):
        m.forward_scales(np.array([0], np.int32), np.zeros((1, 2, 128), np.float32))
    with pytest.raises(ValueError, match=r"next_maps must have shape \[1, tokens, 8\]"):
        m.scale_inputs(np.array([0], np.int32), np.zeros((1, 4, 7), np.float32))

"""Full-size MAR-B/L/H files in the official layout (random weights): the
loader reads every key with its real shape, and the engine computes what the
float64 reference computes on them. These catch shape and layout slips that
tiny models cannot (MAR-H's head dim 80, MAR-L/H's head widths and depths).

The float64 reference on full-size weights is the slow part (about 15 s for MAR-B's
transformer on one sequence, several times that for MAR-H, on an idle core), so each
model is compared on one sequence and one head sample of one token."""
import gc

import numpy as np
import pytest
from safetensors.numpy import save_file

import marcache as mc
from reference import mar as R
from tolerance import assert_close, worst_share


def write_official(path, name, dtype, seed=0):
    """Random weights with every key and shape of the released `name` checkpoint, written
    in `dtype`; returns them as written (so the reference sees the same rounded values)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for key, shape in R.official_shapes(name).items():
        if key.endswith(".weight") and len(shape) == 1:
            value = 1.0 + 0.02 * rng.standard_normal(shape, dtype=np.float32)
        else:
            value = 0.02 * rng.standard_normal(shape, dtype=np.float32)
        tensors[key] = value.astype(dtype)
    save_file(tensors, str(path))
    return tensors


@pytest.fixture(scope="module")
def mar_base(tmp_path_factory):
    path = tmp_path_factory.mktemp("full") / "mar_base.safetensors"
    assert len(write_official(path, "mar_base", np.float32)) == 364
    model = mc.load(path)
    yield model
    del model
    gc.collect()


def test_mar_base_config_and_params(mar_base):
    c = mar_base.config
    assert (c["width"], c["depth"], c["heads"], c["head_width"], c["head_depth"]) == (768, 12, 12, 1024, 6)
    assert mar_base.num_params == 207_924_768


def test_mar_base_runs_one_ar_step(mar_base):
    tokens, info = mar_base.generate_tokens(labels=[207], steps=1, cfg=1.0, seed=0, return_info=True)
    assert tokens.shape == (1, 256, 16) and np.isfinite(tokens).all()
    assert info.steps[0]["predicted"] == 256
    assert info.flops == pytest.approx(mc.flops("mar_base", steps=1, cfg=1.0).total, rel=1e-12)


@pytest.mark.parametrize("name,dtype,width,depth,heads,head_dim,head_width,head_depth,params", [
    ("mar_base", np.float32, 768, 12, 12, 64, 1024, 6, 207_924_768),
    ("mar_large", np.float16, 1024, 16, 16, 64, 1280, 8, 478_326_304),
    ("mar_huge", np.float16, 1280, 20, 16, 80, 1536, 12, 942_403_104),
])
def test_full_size_transformer_and_head_match_reference(tmp_path, name, dtype, width, depth, heads, head_dim,
                                                        head_width, head_depth, params):
    """One sequence's z (encoder + decoder, 3 known tokens) and one token's 100-step head
    sample against the float64 reference, element-wise.
    z: rtol 1e-4, atol 1e-5 (|z| reaches ~3.5; float32 sums of 768..5120 terms leave
    elements near zero with absolute errors of a few 1e-6; MAR-B measured 3.9e-6, worst
    share 0.28 of the allowance). Head sample: rtol 1e-4, atol 1e-6 * max |reference
    sample|: on random weights the first DDPM steps amplify the state to ~1e4-1e5, and
    input_proj mixes the float32 rounding of the largest channels into every channel, so
    the channels that end small carry an absolute error proportional to the largest
    (MAR-L: 0.026 on an element of -157; 1e-6 of the scale is ~8 float32 ulps there)."""
    path = tmp_path / f"{name}.safetensors"
    W = write_official(path, name, dtype)
    model = mc.load(path)
    c = model.config
    assert (c["width"], c["depth"], c["heads"], c["width"] // c["heads"]) == (width, depth, heads, head_dim)
    assert (c["head_width"], c["head_depth"]) == (head_width, head_depth)
    assert model.num_params == params
    rng = np.random.default_rng(1)
    tokens = rng.standard_normal((1, 256, 16)).astype(np.float32)
    mask = np.ones((1, 256), bool)
    mask[0, rng.permutation(256)[:3]] = False
    z = model.transformer(tokens, mask, [1])
    z_ref = R.transformer(W, tokens, mask, np.array([1]), heads, cfg_on=False)
    assert z.shape == (1, 256, width)
    assert_close(z, z_ref, rtol=1e-4, atol=1e-5, what=f"{name} transformer output z")
    row = z[0, 77:78]
    sample = model.head_sample(row, np.array([0], np.uint32), np.array([77], np.uint32), cfg=1.0,
                               temperature=1.0, seed=3)
    # The reference converts each weight to float64 where it is used: converted once here,
    # the head's weights (1.1 GB as float64 for MAR-H) are not converted again at each of
    # the 100 steps, which made the reference sampler the slowest part of this test.
    head64 = {k: v.astype(np.float64) if k.startswith(R.HEAD) else v for k, v in W.items()}
    sample_ref = R.head_sample(head64, row, [0], [77], 3, 1.0, 1.0)
    del head64
    sample_atol = 1e-6 * float(np.abs(sample_ref).max())
    print(f"{name}: z worst share {worst_share(z, z_ref, 1e-4, 1e-5):.3g}; head sample max "
          f"{np.abs(sample_ref).max():.3g}, worst share {worst_share(sample, sample_ref, 1e-4, sample_atol):.3g}")
    assert_close(sample, sample_ref, rtol=1e-4, atol=sample_atol, what=f"{name} head sample")
    del model, W
    path.unlink()
    gc.collect()

"""Full-size MAR-B/L/H files in the official layout (random weights): the
loader reads every key with its real shape, and the engine runs them. These
catch shape and layout slips that tiny models cannot (head dim 80 of MAR-H)."""
import gc

import numpy as np
import pytest
from safetensors.numpy import save_file

import marcache as mc
from reference import mar as R


def write_official(path, name, dtype, seed=0):
    rng = np.random.default_rng(seed)
    tensors = {}
    for key, shape in R.official_shapes(name).items():
        if key.endswith(".weight") and len(shape) == 1:
            value = 1.0 + 0.02 * rng.standard_normal(shape, dtype=np.float32)
        else:
            value = 0.02 * rng.standard_normal(shape, dtype=np.float32)
        tensors[key] = value.astype(dtype)
    save_file(tensors, str(path))
    return len(tensors)


@pytest.fixture(scope="module")
def mar_base(tmp_path_factory):
    path = tmp_path_factory.mktemp("full") / "mar_base.safetensors"
    assert write_official(path, "mar_base", np.float32) == 364
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


@pytest.mark.parametrize("name,width,heads,head_dim,params", [
    ("mar_large", 1024, 16, 64, 478_326_304),
    ("mar_huge", 1280, 16, 80, 942_403_104),
])
def test_large_and_huge_load_and_run_the_transformer(tmp_path, name, width, heads, head_dim, params):
    path = tmp_path / f"{name}.safetensors"
    write_official(path, name, np.float16)
    model = mc.load(path)
    c = model.config
    assert (c["width"], c["heads"], c["width"] // c["heads"]) == (width, heads, head_dim)
    assert model.num_params == params
    tokens = np.zeros((1, 256, 16), np.float32)
    mask = np.ones((1, 256), bool)
    mask[0, :3] = False
    z = model.transformer(tokens, mask, [1])
    assert z.shape == (1, 256, width) and np.isfinite(z).all()
    out = model.head(np.zeros((2, 16), np.float32), z[0, :2], 99)
    assert out.shape == (2, 32) and np.isfinite(out).all()
    del model
    path.unlink()
    gc.collect()

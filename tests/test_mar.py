"""MAR engine against the float64 NumPy reference (tests/reference/mar.py),
on tiny random models in the official key layout."""
import numpy as np
import pytest

import marcache as mc
from mar_fixtures import rel_err, write_tiny_mar
from reference import mar as R

HEADS = 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("mar") / "tiny.safetensors"
    W = write_tiny_mar(path, seed=0, heads=HEADS)
    return mc.load(path), W, path


def test_config_read_back_from_shapes(tiny):
    model, W, _ = tiny
    c = model.config
    assert (c["width"], c["depth"], c["heads"], c["decoder_width"], c["decoder_depth"]) == (32, 2, 2, 32, 2)
    assert (c["head_width"], c["head_depth"], c["seq_len"], c["buffer_size"]) == (32, 2, 256, 64)
    assert (c["token_channels"], c["num_classes"], c["mlp_hidden"]) == (16, 1000, 128)
    assert model.num_params == sum(v.size for v in W.values())


def test_diffusion_timesteps_match_spec(tiny):
    model, _, _ = tiny
    tables = R.diffusion_tables(100)
    assert model.timesteps == [int(t) for t in tables["timesteps"]]


@pytest.mark.parametrize("known", [0, 1, 37, 255])
def test_transformer_matches_reference(tiny, known):
    model, W, _ = tiny
    rng = np.random.default_rng(known)
    B = 3
    tokens = rng.standard_normal((B, 256, 16)).astype(np.float32)
    mask = np.ones((B, 256), bool)
    for b in range(B):
        mask[b, rng.permutation(256)[:known]] = False
    labels = np.array([5, 999, 0])
    z = model.transformer(tokens, mask, labels)
    ref = R.transformer(W, tokens, mask, labels, HEADS, cfg_on=False)
    assert z.shape == (B, 256, 32)
    assert rel_err(z, ref) < 1e-5


def test_transformer_unconditional_rows_use_fake_latent(tiny):
    model, W, _ = tiny
    tokens = np.zeros((2, 256, 16), np.float32)
    mask = np.ones((2, 256), bool)
    z = model.transformer(tokens, mask, np.array([-1, -1]))
    ref = R.transformer(W, tokens, mask, None, HEADS, cfg_on=False)
    assert rel_err(z, ref) < 1e-5


@pytest.mark.parametrize("t_index", [0, 1, 50, 99])
def test_head_network_matches_reference(tiny, t_index):
    model, W, _ = tiny
    rng = np.random.default_rng(t_index)
    x = rng.standard_normal((7, 16)).astype(np.float32)
    z = rng.standard_normal((7, 32)).astype(np.float32)
    out = model.head(x, z, t_index)
    tau = R.diffusion_tables(100)["timesteps"][t_index]
    ref = R.head_net(W, x, np.full(7, tau), z)
    assert out.shape == (7, 32)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("cfg", [1.0, 2.5])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_sampler_matches_reference(tiny, cfg, temperature):
    model, W, _ = tiny
    rng = np.random.default_rng(1)
    n = 5
    z = rng.standard_normal((2 * n if cfg != 1.0 else n, 32)).astype(np.float32)
    images = np.array([0, 0, 3, 7, 7], np.uint32)
    positions = np.array([4, 200, 4, 0, 255], np.uint32)
    x = model.head_sample(z, images, positions, cfg=cfg, temperature=temperature, seed=11)
    ref = R.head_sample(W, z, images, positions, 11, temperature, cfg)
    assert rel_err(x, ref) < 1e-5


@pytest.mark.parametrize("labels,cfg,schedule,steps", [
    ([3, 7], 1.0, "linear", 4),
    ([3, 7], 3.0, "linear", 4),
    ([999], 4.0, "constant", 3),
    (None, 1.0, "linear", 2),
    (None, 2.0, "linear", 2),
    ([1, 2, 3], 2.9, "linear", 1),
])
def test_generate_matches_reference_sampler(tiny, labels, cfg, schedule, steps):
    model, W, _ = tiny
    n = 2 if labels is None else len(labels)
    tokens, info = model.generate_tokens(labels=labels, num_images=n if labels is None else None, steps=steps,
                                         cfg=cfg, cfg_schedule=schedule, temperature=0.9, seed=123,
                                         first_index=4, return_info=True)
    ref, log = R.generate_tokens(W, None if labels is None else np.array(labels), n, steps, cfg, schedule, 0.9,
                                 123, 4, heads=HEADS)
    assert rel_err(tokens, ref) <= 1e-5
    assert [s["predicted"] for s in info.steps] == [e["n_pred"] for e in log]
    assert [s["cfg"] for s in info.steps] == pytest.approx([e["cfg_iter"] for e in log], rel=0, abs=0)


def test_batch_invariance(tiny):
    """Image i of a seed is the same alone (first_index=i) and anywhere in a batch of 5."""
    model, _, _ = tiny
    labels = [11, 22, 33, 44, 55]
    batch = model.generate_tokens(labels=labels, steps=5, cfg=2.0, seed=77, first_index=10)
    for i in range(5):
        alone = model.generate_tokens(labels=[labels[i]], steps=5, cfg=2.0, seed=77, first_index=10 + i)
        assert rel_err(alone[0], batch[i]) < 1e-4
    shifted = model.generate_tokens(labels=labels[2:], steps=5, cfg=2.0, seed=77, first_index=12)
    assert rel_err(shifted, batch[2:]) < 1e-4


def test_seed_changes_result(tiny):
    model, _, _ = tiny
    a = model.generate_tokens(labels=[1], steps=3, seed=1)
    b = model.generate_tokens(labels=[1], steps=3, seed=2)
    assert rel_err(a, b) > 1e-2


@pytest.mark.parametrize("steps", [16, 32, 64, 256])
def test_schedule_tables_match_spec(tmp_path, steps):
    """Tokens predicted and cfg per step (mar.md 7.3 and 7.4), from the engine's telemetry."""
    path = tmp_path / "m.safetensors"
    write_tiny_mar(path, dim=16, depth=1, heads=1, head_width=16, head_depth=1)
    model = mc.load(path, diffusion_steps=2)
    _, info = model.generate_tokens(labels=[0], steps=steps, cfg=2.9, return_info=True)
    expected = {
        16: [2, 3, 7, 8, 11, 13, 15, 16, 19, 20, 22, 23, 23, 25, 24, 25],
        32: [1, 1, 1, 2, 3, 4, 3, 5, 5, 6, 6, 7, 7, 8, 8, 8, 10, 9, 10, 10, 11, 11, 11, 12, 11, 12, 12, 13, 12,
             12, 13, 12],
        64: [1] * 13 + [2, 3, 2, 2, 3, 3, 3, 3, 3, 3, 4, 3, 4, 4, 4, 4, 4, 4, 4, 5, 5, 4, 5, 5, 5, 5, 5, 6, 5, 5,
                        6, 5, 6, 6, 6, 5, 6, 6, 6, 6, 6, 6, 7, 6, 6, 6, 6, 7, 6, 6, 6],
        256: [1] * 256,
    }[steps]
    predicted = [s["predicted"] for s in info.steps]
    assert predicted == expected and sum(predicted) == 256
    # linear cfg uses the post-step masked count and never reaches the nominal value
    masked_after = 256 - np.cumsum(predicted)
    masked_after[-1] = 1  # the last step's clamped mask_len
    expected_cfg = [float(np.float32(1) + np.float32(1.9) * np.float32(256 - m) / np.float32(256))
                    for m in masked_after]
    assert [s["cfg"] for s in info.steps] == pytest.approx(expected_cfg, rel=1e-7)
    assert info.steps[-1]["cfg"] < 2.9
    if steps == 256:
        assert [s["cfg"] for s in info.steps[:3]] == pytest.approx(
            [1 + 1.9 * (k + 1) / 256 for k in range(3)], rel=1e-6)


def test_more_steps_than_tokens_gives_empty_steps(tmp_path):
    path = tmp_path / "m.safetensors"
    write_tiny_mar(path, dim=16, depth=1, heads=1, head_width=16, head_depth=1)
    model = mc.load(path, diffusion_steps=2)
    tokens, info = model.generate_tokens(labels=[0], steps=300, cfg=1.0, return_info=True)
    predicted = [s["predicted"] for s in info.steps]
    assert sum(predicted) == 256 and predicted.count(0) == 300 - 256
    assert all(s["flops"] == 0 for s in info.steps if s["predicted"] == 0)
    assert np.isfinite(tokens).all()


def test_fp16_and_bf16_files_load_and_match(tmp_path):
    path32 = tmp_path / "f32.safetensors"
    W = write_tiny_mar(path32)
    path16 = tmp_path / "f16.safetensors"
    write_tiny_mar(path16, dtype=np.float16)
    m32, m16 = mc.load(path32), mc.load(path16)
    tokens = np.zeros((1, 256, 16), np.float32)
    mask = np.ones((1, 256), bool)
    W16 = {k: v.astype(np.float16).astype(np.float32) for k, v in W.items()}
    ref16 = R.transformer(W16, tokens, mask, np.array([3]), HEADS, cfg_on=False)
    assert rel_err(m16.transformer(tokens, mask, [3]), ref16) < 1e-5
    assert rel_err(m32.transformer(tokens, mask, [3]), ref16) > 1e-6  # the rounding is really there

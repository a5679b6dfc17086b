"""MAR engine against the float64 NumPy reference (tests/reference/mar.py),
on tiny random models in the official key layout, element by element
(tolerance.assert_close; each atol is stated where it is used).

Besides the plain random model, two transformed ones (mar_fixtures) make choices
visible that the plain one hides: small_activations (every LayerNorm input ~1e-2,
so eps 1e-5 instead of 1e-6 in any one of them, or tanh-GELU, moves z by 100x the
tolerance and more) and v_dominant (the learned variance decides the tokens). The
comparisons on them live in tests/comparisons.py, shared with tests/test_mutations.py,
which shows each known-wrong variant of the reference fails them.
"""
import numpy as np
import pytest

import comparisons as C
import marcache as mc
from mar_fixtures import save_bf16, write_tiny_mar
from reference import mar as R
from tolerance import assert_close, worst_share

HEADS = 2
# z of the plain tiny model reaches 4.6 (decoder_norm output plus an embedding of
# scale 0.5); float32 ulp at 4.6 is 4.8e-7 and a value carries a few roundings of
# that size through 2 + 2 blocks: measured worst 8.8e-7. rtol 1e-5 for the large ones.
Z_RTOL, Z_ATOL = 1e-5, 2e-6
# head outputs up to 0.87: ulp 6e-8, measured worst 1.1e-7.
HEAD_RTOL, HEAD_ATOL = 1e-5, 1e-6


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
    assert_close(z, ref, Z_RTOL, Z_ATOL, "z")


def test_transformer_unconditional_rows_use_fake_latent(tiny):
    model, W, _ = tiny
    tokens = np.zeros((2, 256, 16), np.float32)
    mask = np.ones((2, 256), bool)
    z = model.transformer(tokens, mask, np.array([-1, -1]))
    ref = R.transformer(W, tokens, mask, None, HEADS, cfg_on=False)
    assert_close(z, ref, Z_RTOL, Z_ATOL, "z")


def test_transformer_small_activations_matches_reference():
    """Every LayerNorm's input ~1e-2: its eps and the GELU form are visible (comparisons.py)."""
    C.TRANSFORMER_SMALL.check()


@pytest.mark.parametrize("comparison", C.HEAD_NET_SMALL, ids=lambda c: c.name)
def test_head_network_small_activations_matches_reference(comparison):
    """The head's in_ln and final-layer norm see inputs ~1e-2: their eps is visible."""
    comparison.check()


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
    assert_close(out, ref, HEAD_RTOL, HEAD_ATOL, "head output")


@pytest.mark.parametrize("comparison", C.HEAD_SAMPLERS, ids=lambda c: c.name)
def test_head_sampler_matches_reference(comparison):
    """The 100-step sampler on 5 tokens, cfg 1 and 2.5: the plain tiny model at
    temperatures 1 and 0.7, and the v_dominant model at temperature 300, where the
    learned variance decides the tokens (v from the wrong row or columns, or ignored,
    fails it by 5e3x and more: test_mutations). Tolerance: comparisons.TOKEN_ROW_ATOL."""
    comparison.check()


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
    # per element, 2e-6 of its own token's largest channel (comparisons module docstring)
    assert_close(tokens, ref, 0.0, C.TOKEN_ROW_ATOL * np.abs(ref).max(axis=-1, keepdims=True), "tokens")
    assert [s["predicted"] for s in info.steps] == [e["n_pred"] for e in log]
    assert [s["cfg"] for s in info.steps] == pytest.approx([e["cfg_iter"] for e in log], rel=0, abs=0)


def test_batch_invariance(tiny):
    """Image i of a seed is the same alone (first_index=i) and anywhere in a batch of 5."""
    model, _, _ = tiny
    labels = [11, 22, 33, 44, 55]
    batch = model.generate_tokens(labels=labels, steps=5, cfg=2.0, seed=77, first_index=10)
    for i in range(5):
        alone = model.generate_tokens(labels=[labels[i]], steps=5, cfg=2.0, seed=77, first_index=10 + i)
        assert_close(alone[0], batch[i], 0.0, _same_run_atol(batch[i]), "image %d alone" % i)
    shifted = model.generate_tokens(labels=labels[2:], steps=5, cfg=2.0, seed=77, first_index=12)
    assert_close(shifted, batch[2:], 0.0, _same_run_atol(batch[2:]), "images 2..4 shifted")


def _same_run_atol(tokens):
    """Two float32 runs of one image differ only by the GEMM row splits of other batch
    sizes: each is within TOKEN_ROW_ATOL (2e-6) of its token's largest channel of the
    reference, so 1e-5 of it bounds their difference with room (was 1e-4 of the largest
    token of the whole array)."""
    return 1e-5 * np.abs(tokens).max(axis=-1, keepdims=True)


def test_seed_changes_result(tiny):
    model, _, _ = tiny
    a = model.generate_tokens(labels=[1], steps=3, seed=1)
    b = model.generate_tokens(labels=[1], steps=3, seed=2)
    # another seed gives other tokens: most elements differ by far more than float32 noise
    assert worst_share(a, b, 1e-2, 0.0) > 1 and np.mean(np.abs(a - b) > 1e-2 * np.abs(b)) > 0.9


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
    """A file stored in fp16 or bf16 loads as the float32 values it holds: the engine's z
    equals the reference on those rounded weights (Z_RTOL, Z_ATOL), and differs from the
    fp32 file's z by far more (the rounding is really there)."""
    path32 = tmp_path / "f32.safetensors"
    W = write_tiny_mar(path32)
    path16 = tmp_path / "f16.safetensors"
    write_tiny_mar(path16, dtype=np.float16)
    W16 = {k: v.astype(np.float16).astype(np.float32) for k, v in W.items()}
    path_bf16 = tmp_path / "bf16.safetensors"
    W_bf16 = save_bf16(W, path_bf16, metadata={"heads": str(HEADS)})
    tokens = np.zeros((1, 256, 16), np.float32)
    mask = np.ones((1, 256), bool)
    z32 = mc.load(path32).transformer(tokens, mask, [3])
    for path, held in ((path16, W16), (path_bf16, W_bf16)):
        assert any(not np.array_equal(held[k], W[k]) for k in W)
        ref = R.transformer(held, tokens, mask, np.array([3]), HEADS, cfg_on=False)
        assert_close(mc.load(path).transformer(tokens, mask, [3]), ref, Z_RTOL, Z_ATOL, "z of %s" % path.name)
        assert worst_share(z32, ref, Z_RTOL, Z_ATOL) > 10  # the rounding is really there

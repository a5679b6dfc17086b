"""KL-16 VAE decoder (marcache._C.VAE) against the float64 NumPy reference
(tests/reference/vae.py), with random weights written in the official key
layout (mar.md section 8.3, Appendix B)."""
import os
import sys

import numpy as np
import pytest

safetensors_numpy = pytest.importorskip("safetensors.numpy")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from interrupt import call_with_sigint_pending  # noqa: E402
from reference import vae as ref_vae  # noqa: E402
from tolerance import assert_close, scaled_atol  # noqa: E402


from marcache import _C as C  # noqa: E402 (the package preloads OpenBLAS)

SMALL_CONFIGS = {
    # 5 levels like the official model, scaled down: latent 4x4 -> 64x64.
    "five_levels": dict(ch=32, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=1, z=16),
    # 2 levels, odd latent channels: latent 8x8 -> 16x16.
    "two_levels": dict(ch=32, ch_mult=(1, 2), num_res_blocks=1, z=5),
    # num_res_blocks = 0 (one ResnetBlock per level), first level wider.
    "single_block": dict(ch=32, ch_mult=(2, 1, 3), num_res_blocks=0, z=3),
}


def write(tmp_path, weights, name="vae.safetensors"):
    path = str(tmp_path / name)
    safetensors_numpy.save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, path)
    return path


def small_weights(config="two_levels", seed=0):
    return ref_vae.random_vae_weights(np.random.default_rng(seed), **SMALL_CONFIGS[config])


# Element-wise allowance against the float64 reference for every configuration: rtol 1e-4,
# atol 1e-5. Outputs reach |x| ~2-4 after 10-30 float32 convolutions; elements near zero
# carry a few 1e-6 of absolute rounding (measured worst shares: five_levels 0.30,
# two_levels 0.11, single_block 0.10, official 0.46).
RTOL, ATOL = 1e-4, 1e-5


def tokens_for(rng, n, side, z):
    # Scaled-latent tokens: roughly unit-variance latents times 0.2325.
    return (ref_vae.LATENT_SCALE * rng.standard_normal((n, side * side, z))).astype(np.float32)


# ----- numerics ----------------------------------------------------------------

@pytest.mark.parametrize("config,side", [("five_levels", 4), ("two_levels", 8),
                                         ("single_block", 3)])
def test_small_config_matches_reference(tmp_path, config, side):
    weights = small_weights(config)
    vae = C.VAE(write(tmp_path, weights))
    cfg = SMALL_CONFIGS[config]
    tokens = tokens_for(np.random.default_rng(1), 2, side, cfg["z"])
    got = vae.decode(tokens)
    want = ref_vae.decode(weights, tokens)
    up = 2 ** (len(cfg["ch_mult"]) - 1)
    assert got.shape == (2, side * up, side * up, 3) and got.dtype == np.float32
    assert_close(got, want, RTOL, ATOL, what=f"{config} decode")


def test_config_attributes(tmp_path):
    weights = small_weights("five_levels")
    vae = C.VAE(write(tmp_path, weights))
    assert vae.z_channels == 16
    assert vae.ch == 32
    assert vae.ch_mult == (1, 1, 2, 2, 4)
    assert vae.num_res_blocks == 1
    assert vae.num_params == sum(v.size for v in weights.values())
    assert vae.upscale == 16


def test_buffers_regrow_across_calls(tmp_path):
    """Buffers sized for one latent side are reused, and regrown for a
    larger one; results do not depend on what ran before."""
    weights = small_weights("two_levels")
    vae = C.VAE(write(tmp_path, weights))
    rng = np.random.default_rng(2)
    small, large = tokens_for(rng, 1, 3, 5), tokens_for(rng, 1, 9, 5)
    first = vae.decode(small)
    assert_close(vae.decode(large), ref_vae.decode(weights, large), RTOL, ATOL, what="regrown decode")
    assert np.array_equal(vae.decode(small), first)


def test_batch_equals_single_images(tmp_path):
    vae = C.VAE(write(tmp_path, small_weights("two_levels")))
    tokens = tokens_for(np.random.default_rng(3), 3, 4, 5)
    batch = vae.decode(tokens)
    for i in range(3):
        assert np.array_equal(batch[i], vae.decode(tokens[i:i + 1])[0])


def test_thread_counts_agree(tmp_path):
    path = write(tmp_path, small_weights("two_levels"))
    tokens = tokens_for(np.random.default_rng(4), 1, 8, 5)
    one = C.VAE(path, num_threads=1).decode(tokens)
    two = C.VAE(path, num_threads=2).decode(tokens)
    # the two thread counts split the same sums differently: float32 reordering only,
    # bounded by the window sums behind each pixel (tolerance.scaled_atol)
    assert_close(one, two, rtol=0.0, atol=scaled_atol(two, 1e-5), what="VAE decode, 1 vs 2 threads")


def test_float16_and_float64_files(tmp_path):
    """The binder converts other float dtypes to float32 once at load."""
    weights = small_weights("two_levels")
    tokens = tokens_for(np.random.default_rng(5), 1, 4, 5)
    for dtype in (np.float16, np.float64):
        cast = {k: v.astype(dtype) for k, v in weights.items()}
        got = C.VAE(write(tmp_path, cast, "w_%s.safetensors" % np.dtype(dtype).name)).decode(tokens)
        assert_close(got, ref_vae.decode(cast, tokens), RTOL, ATOL, what=f"{np.dtype(dtype).name} file decode")


def test_float64_tokens_accepted(tmp_path):
    vae = C.VAE(write(tmp_path, small_weights("two_levels")))
    tokens = tokens_for(np.random.default_rng(6), 1, 4, 5)
    assert np.array_equal(vae.decode(tokens.astype(np.float64)), vae.decode(tokens))
    assert np.array_equal(vae.decode(tokens.tolist()), vae.decode(tokens))


def test_empty_batch(tmp_path):
    vae = C.VAE(write(tmp_path, small_weights("two_levels")))
    out = vae.decode(np.zeros((0, 16, 5), np.float32))
    assert out.shape == (0, 8, 8, 3)
    assert vae.decode_uint8(np.zeros((0, 16, 5), np.float32)).shape == (0, 8, 8, 3)


# ----- uint8 conversion ----------------------------------------------------------

def test_decode_uint8_matches_reference(tmp_path):
    weights = small_weights("two_levels")
    vae = C.VAE(write(tmp_path, weights))
    # Scaled up so that the image covers the clip range on both sides.
    tokens = 4 * tokens_for(np.random.default_rng(7), 2, 8, 5)
    images = vae.decode(tokens)
    got = vae.decode_uint8(tokens)
    assert got.dtype == np.uint8 and got.shape == images.shape
    assert np.array_equal(got, ref_vae.to_uint8(images))
    assert (got == 0).any() and (got == 255).any()


def test_to_uint8_exact():
    rng = np.random.default_rng(8)
    x = np.concatenate([
        rng.uniform(-1.2, 1.2, 200000),
        [-1.0, 1.0, 0.0, -1.5, 2.0, -np.inf, np.inf, 1e30, -1e30],
        # values whose float32 (x + 1) / 2 * 255 sits next to a .5 boundary
        (2.0 * (np.arange(256) + 0.5) / 255.0 - 1.0),
    ]).astype(np.float32)
    got = C._vae_to_uint8(x)
    assert np.array_equal(got, ref_vae.to_uint8(x))
    assert got[200002] == 128  # 0 -> 127.5 exactly -> half to even -> 128
    with pytest.raises(FloatingPointError):
        C._vae_to_uint8(np.array([0.0, np.nan], np.float32))


# ----- the official configuration --------------------------------------------------

@pytest.fixture(scope="module")
def official_file(tmp_path_factory):
    weights = ref_vae.random_vae_weights(np.random.default_rng(9))
    assert len(weights) == ref_vae.OFFICIAL_KEY_COUNT
    return write(tmp_path_factory.mktemp("official"), weights)


def test_official_config_decodes_full_size(official_file):
    vae = C.VAE(official_file)
    assert (vae.z_channels, vae.ch, vae.ch_mult, vae.num_res_blocks) == (16, 128, (1, 1, 2, 2, 4), 2)
    assert vae.num_params == ref_vae.OFFICIAL_PARAM_COUNT
    tokens = tokens_for(np.random.default_rng(10), 1, 16, 16)
    images = vae.decode(tokens)
    assert images.shape == (1, 256, 256, 3) and images.dtype == np.float32
    assert np.isfinite(images).all()
    assert images.std() > 0


def test_official_config_matches_reference_on_a_4x4_latent(official_file):
    """The official KL-16 configuration (ch=128, ch_mult (1, 1, 2, 2, 4), num_res_blocks=2,
    mar.md section 8) decodes a 4x4 latent (a 64x64 image) as the float64 reference does:
    the only test of two res blocks per level and of the full channel widths (RTOL, ATOL:
    the engine's worst absolute error measured 5.8e-6 on outputs up to |x| ~3)."""
    weights = safetensors_numpy.load_file(official_file)
    vae = C.VAE(official_file)
    tokens = tokens_for(np.random.default_rng(13), 1, 4, 16)
    got = vae.decode(tokens)
    want = ref_vae.decode(weights, tokens)
    assert got.shape == want.shape == (1, 64, 64, 3)
    assert_close(got, want, RTOL, ATOL, what="official KL-16 decode of a 4x4 latent")


def test_ctrl_c_interrupts_decode(official_file):
    """SIGINT pending when decode starts is turned into KeyboardInterrupt by the decoder's
    own check at a stage boundary (interrupt.call_with_sigint_pending: nothing else can
    handle it first), and the VAE stays usable, with the same output, afterwards."""
    vae = C.VAE(official_file)
    small = tokens_for(np.random.default_rng(12), 1, 2, 16)
    before = vae.decode(small)
    tokens = tokens_for(np.random.default_rng(11), 4, 16, 16)
    assert call_with_sigint_pending(vae.decode, tokens), "decode returned instead of raising KeyboardInterrupt"
    assert call_with_sigint_pending(vae.decode_uint8, tokens), "decode_uint8 returned instead of raising"
    assert np.array_equal(vae.decode(small), before)


# ----- refusing the wrong files ------------------------------------------------------

def test_ldm_kl_f16_file_refused(tmp_path):
    weights = small_weights("two_levels")
    c = weights["decoder.up.0.block.0.norm1.weight"].shape[0]
    for part in ("norm.weight", "norm.bias"):
        weights["decoder.up.0.attn.0." + part] = np.ones(c, np.float32)
    with pytest.raises(ValueError, match=r"(?s)up-path attention.*decoder\.up\.0\.attn\.0.*LDM"):
        C.VAE(write(tmp_path, weights))


def test_mar_file_refused(tmp_path):
    mar_like = {
        "z_proj.weight": np.zeros((768, 16), np.float32),
        "encoder_blocks.0.norm1.weight": np.ones(768, np.float32),
        "diffloss.net.input_proj.weight": np.zeros((1024, 16), np.float32),
    }
    with pytest.raises(ValueError, match="not a KL-16 VAE decoder"):
        C.VAE(write(tmp_path, mar_like))


def test_missing_key_named(tmp_path):
    weights = small_weights("two_levels")
    del weights["decoder.up.1.block.0.conv2.bias"]
    with pytest.raises(KeyError, match=r"decoder\.up\.1\.block\.0\.conv2\.bias.*\[64\]"):
        C.VAE(write(tmp_path, weights))


def test_misshapen_key_named(tmp_path):
    weights = small_weights("two_levels")
    weights["decoder.mid.block_1.conv1.weight"] = np.zeros((64, 64, 1, 3), np.float32)
    with pytest.raises(ValueError, match=r"decoder\.mid\.block_1\.conv1\.weight.*"
                                         r"\[64, 64, 1, 3\].*\[64, 64, 3, 3\]"):
        C.VAE(write(tmp_path, weights))


def test_unexpected_decoder_key_refused(tmp_path):
    weights = small_weights("two_levels")
    weights["decoder.mid.block_3.norm1.weight"] = np.ones(64, np.float32)
    with pytest.raises(ValueError, match=r"unexpected decoder tensor 'decoder\.mid\.block_3"):
        C.VAE(write(tmp_path, weights))


def test_encoder_keys_ignored(tmp_path):
    """A full VAE file (encoder + quant_conv too) loads; only the decoder binds."""
    weights = small_weights("two_levels")
    full = dict(weights)
    full["encoder.conv_in.weight"] = np.zeros((32, 3, 3, 3), np.float32)
    full["quant_conv.weight"] = np.zeros((10, 10, 1, 1), np.float32)
    vae = C.VAE(write(tmp_path, full))
    assert vae.num_params == sum(v.size for v in weights.values())


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        C.VAE(str(tmp_path / "absent.safetensors"))


# ----- input validation ----------------------------------------------------------------

@pytest.mark.parametrize("shape,pattern", [
    ((16, 5), r"\[n, seq_len, 5\].*\(16, 5\)"),
    ((1, 15, 5), r"perfect square.*\(1, 15, 5\)"),
    ((1, 16, 4), r"\[n, 16, 5\].*\(1, 16, 4\)"),
    ((1, 0, 5), r"perfect square.*\(1, 0, 5\)"),
])
def test_bad_token_shapes(tmp_path, shape, pattern):
    vae = C.VAE(write(tmp_path, small_weights("two_levels")))
    for method in (vae.decode, vae.decode_uint8):
        with pytest.raises(ValueError, match=pattern):
            method(np.zeros(shape, np.float32))


def test_non_numeric_tokens(tmp_path):
    vae = C.VAE(write(tmp_path, small_weights("two_levels")))
    with pytest.raises(ValueError, match="float32"):
        vae.decode(np.zeros((1, 16, 5), np.complex64))
    with pytest.raises(ValueError, match="float32"):
        vae.decode(np.array([[["a"] * 5] * 16]))

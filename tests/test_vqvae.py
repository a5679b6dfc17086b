"""VAR's multi-scale VQVAE (marcache._C.VQVAE, csrc/models/vqvae.c) against the
float64 reference (tests/reference/vqvae.py) on random models written in the
official key layout (var_fastvar.md B5), on every backend: the Phi selection
and the area bins of the spec's tables, the codebook lookup, f_hat over the
scales, the next scale's input, the decoder, and the refusal of wrong files."""
import numpy as np
import pytest

safetensors_numpy = pytest.importorskip("safetensors.numpy")

from marcache import _C  # noqa: E402
from interrupt import call_with_sigint_pending  # noqa: E402
from reference import vae as ref_vae  # noqa: E402
from reference import vqvae as ref_vq  # noqa: E402
from tolerance import assert_close, scaled_atol  # noqa: E402

# Small configurations: (weights config, patch_nums). ch 32 = one channel per GroupNorm group.
CONFIGS = {
    # 2 levels like the digits VQVAE: latent 8x8 -> 16x16 images, 4 Phi convs.
    "two_levels": (dict(ch=32, ch_mult=(1, 2), num_res_blocks=1, z=8, vocab=64, num_phi=4),
                   (1, 2, 3, 4, 6, 8)),
    # 3 levels, two blocks per level, odd latent width, 3 Phi convs (the other tick rule),
    # a non-power-of-two latent side: latent 5x5 -> 20x20 images.
    "three_levels": (dict(ch=32, ch_mult=(1, 1, 2), num_res_blocks=2, z=5, vocab=37, num_phi=3),
                     (1, 2, 3, 5)),
}

# Every element against the float64 reference: rtol 1e-5, plus an absolute allowance of
# 1e-6 of the largest value for elements near zero (a sum of float32 products rounds
# relative to its largest terms; tolerance.scaled_atol).
F_HAT_RTOL, F_HAT_SHARE = 1e-5, 1e-6
# Decoded images: rtol 1e-5 and 1e-5 absolute (outputs of order 1 after tens of float32
# convolutions and GroupNorms; the clamp to [-1, 1] bounds them).
IMAGE_RTOL, IMAGE_ATOL = 1e-5, 1e-5


def write(tmp_path, weights, name="vqvae.safetensors", metadata=None):
    path = str(tmp_path / name)
    safetensors_numpy.save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, path,
                                metadata=metadata)
    return path


def weights_for(config, seed=0):
    return ref_vq.random_vqvae_weights(np.random.default_rng(seed), **CONFIGS[config][0])


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model_file(request, tmp_path_factory):
    """(config name, weights, path) of one small VQVAE."""
    weights = weights_for(request.param)
    return request.param, weights, write(tmp_path_factory.mktemp(request.param), weights)


def random_ids(rng, batch, patch_nums, vocab):
    return [rng.integers(0, vocab, size=(batch, pn * pn)).astype(np.int32) for pn in patch_nums]


# ----- the spec's tables ----------------------------------------------------------

SPEC_PHI_TABLE = [0, 0, 1, 1, 1, 2, 2, 3, 3, 3]   # B3, 10 scales, 4 Phi convs

SPEC_AREA_BINS_16 = {   # B3, in = 16
    2: [(0, 8), (8, 16)],
    3: [(0, 6), (5, 11), (10, 16)],
    4: [(0, 4), (4, 8), (8, 12), (12, 16)],
    5: [(0, 4), (3, 7), (6, 10), (9, 13), (12, 16)],
    6: [(0, 3), (2, 6), (5, 8), (8, 11), (10, 14), (13, 16)],
    8: [(2 * i, 2 * i + 2) for i in range(8)],
    10: [(0, 2), (1, 4), (3, 5), (4, 7), (6, 8), (8, 10), (9, 12), (11, 13), (12, 15), (14, 16)],
    13: [(0, 2), (1, 3), (2, 4), (3, 5), (4, 7), (6, 8), (7, 9), (8, 10), (9, 12), (11, 13), (12, 14),
         (13, 15), (14, 16)],
}
SPEC_AREA_BINS_10_TO_13 = [(0, 1), (0, 2), (1, 3), (2, 4), (3, 4), (3, 5), (4, 6), (5, 7), (6, 7), (6, 8),
                           (7, 9), (8, 10), (9, 10)]   # D3, up-sampling


def test_reference_phi_table_is_the_spec_table():
    assert [ref_vq.phi_index(si, 10, 4) for si in range(10)] == SPEC_PHI_TABLE
    assert np.allclose(ref_vq.phi_ticks(4), [1 / 12, 13 / 36, 23 / 36, 11 / 12])


def test_reference_area_bins_are_the_spec_table():
    for out, bins in SPEC_AREA_BINS_16.items():
        assert ref_vq.area_bins(16, out) == bins, out
    assert ref_vq.area_bins(10, 13) == SPEC_AREA_BINS_10_TO_13


def test_reference_bicubic_properties():
    """The cubic-convolution weights (A = -0.75) sum to 1 (constant maps stay, a 1x1 input
    gives a constant map), are PyTorch's known 2x up-sampling coefficients at t = 1/4 and
    the half-pixel ones at t = 1/2, and make equal sizes the identity (B3)."""
    rng = np.random.default_rng(0)
    one = rng.standard_normal((2, 1, 1, 3))
    assert np.allclose(ref_vq.resize_bicubic(one, 16, 16), np.broadcast_to(one, (2, 16, 16, 3)), atol=1e-14)
    x = rng.standard_normal((1, 5, 7, 2))
    assert np.allclose(ref_vq.resize_bicubic(x, 5, 7), x, atol=1e-14)
    assert np.array_equal(ref_vq._cubic_weights(0.25), [-0.10546875, 0.87890625, 0.26171875, -0.03515625])
    assert np.array_equal(ref_vq._cubic_weights(0.5), [-0.09375, 0.59375, 0.59375, -0.09375])
    for n_in, n_out in ((4, 16), (13, 16), (16, 5)):
        assert np.allclose(ref_vq.bicubic_matrix(n_in, n_out).sum(axis=1), 1.0, atol=1e-14)
    # 2x up-sampling: output 2i + 1 weighs input rows i - 1 .. i + 2 by the t = 1/4 row
    m = ref_vq.bicubic_matrix(8, 16)
    assert np.array_equal(m[7, 2:6], [-0.10546875, 0.87890625, 0.26171875, -0.03515625])


def op_bins(backend, in_size, out_size):
    """The bins the resize_area op uses along one axis, read back from its output on
    one-hot rows: image j is 1 at column j, so output column i is non-zero exactly for
    the j in bin i (and then 1 / bin length)."""
    x = np.zeros((in_size, 1, in_size, 1), np.float32)
    x[np.arange(in_size), 0, np.arange(in_size), 0] = 1.0
    y = _C.run_op(backend, "resize_area", (x,), {"out_h": 1, "out_w": out_size})[:, 0, :, 0]
    bins = []
    for i in range(out_size):
        members = np.flatnonzero(y[:, i])
        assert np.all(np.diff(members) == 1) and np.allclose(y[members, i], 1.0 / len(members))
        bins.append((int(members[0]), int(members[-1]) + 1))
    # the same bins down the other axis
    yt = _C.run_op(backend, "resize_area", (np.ascontiguousarray(x.transpose(0, 2, 1, 3)),),
                   {"out_h": out_size, "out_w": 1})[:, :, 0, 0]
    assert np.array_equal(yt, y)
    return bins


def test_area_op_bins_are_the_spec_table(backend):
    for out, bins in SPEC_AREA_BINS_16.items():
        assert op_bins(backend, 16, out) == bins, out
    assert op_bins(backend, 10, 13) == SPEC_AREA_BINS_10_TO_13


def test_phi_index_of_the_model(tmp_path):
    """The engine's Phi choice is the spec's table for 10 scales and 4 Phi convs, and the
    reference's (numpy.linspace ticks, first minimum) for every scale count up to 16 with
    4 and with 3 Phi convs."""
    for config in ("two_levels", "three_levels"):
        vq = _C.VQVAE(write(tmp_path, weights_for(config), config + ".safetensors"))
        k = CONFIGS[config][0]["num_phi"]
        if k == 4:
            assert [vq.phi_index(si, 10) for si in range(10)] == SPEC_PHI_TABLE
        for n in range(1, 17):
            assert [vq.phi_index(si, n) for si in range(n)] == [ref_vq.phi_index(si, n, k) for si in range(n)]
        with pytest.raises(ValueError, match="0 <= si < n_scales"):
            vq.phi_index(10, 10)


# ----- components against the reference -----------------------------------------------

def test_config_and_num_params(model_file):
    config, weights, path = model_file
    vq = _C.VQVAE(path)
    cfg = CONFIGS[config][0]
    got = vq.config
    assert (got["vocab"], got["z_channels"], got["ch"], got["ch_mult"], got["num_res_blocks"],
            got["num_phi"]) == (cfg["vocab"], cfg["z"], cfg["ch"], cfg["ch_mult"], cfg["num_res_blocks"],
                                cfg["num_phi"])
    assert got["upscale"] == 2 ** (len(cfg["ch_mult"]) - 1)
    assert got["quant_resi"] == 0.5
    assert vq.num_params == got["num_params"] == sum(v.size for v in weights.values())


def test_embed_is_the_codebook(backend, model_file):
    config, weights, path = model_file
    vq = _C.VQVAE(path, device=backend)
    vocab = CONFIGS[config][0]["vocab"]
    idx = np.random.default_rng(1).integers(0, vocab, size=(2, 3, 5))
    got = vq.embed(idx)
    assert got.dtype == np.float32 and got.shape == (2, 3, 5, CONFIGS[config][0]["z"])
    assert np.array_equal(got, weights["quantize.embedding.weight"][idx])
    assert vq.embed(np.zeros((0,), np.int64)).shape == (0, CONFIGS[config][0]["z"])


def test_idx_to_fhat_matches_reference(backend, model_file):
    """f_hat after every prefix of the scales (bicubic up-sampling, Phi, accumulation),
    within 1e-5 relative of the float64 reference, on 3 images."""
    config, weights, path = model_file
    vq = _C.VQVAE(path, device=backend)
    patch_nums = CONFIGS[config][1]
    ids = random_ids(np.random.default_rng(2), 3, patch_nums, CONFIGS[config][0]["vocab"])
    for k in range(1, len(patch_nums) + 1):
        got = vq.idx_to_fhat(ids[:k], patch_nums)
        want, _ = ref_vq.idx_to_fhat(weights, ids[:k], patch_nums)
        assert got.shape == want.shape and got.dtype == np.float32
        assert_close(got, want, F_HAT_RTOL, scaled_atol(want, F_HAT_SHARE),
                     what=f"{config} f_hat after {k} scales on {backend}")


def test_next_scale_inputs_match_reference(backend, model_file):
    """The next scale's input is the area down-sampling of the cumulative f_hat."""
    config, weights, path = model_file
    vq = _C.VQVAE(path, device=backend)
    patch_nums = CONFIGS[config][1]
    ids = random_ids(np.random.default_rng(3), 2, patch_nums, CONFIGS[config][0]["vocab"])
    _, nexts = ref_vq.idx_to_fhat(weights, ids, patch_nums)
    for si in range(len(patch_nums) - 1):
        f_hat = vq.idx_to_fhat(ids[:si + 1], patch_nums)
        pn = patch_nums[si + 1]
        got = vq.fhat_to_next(f_hat, pn)
        assert got.shape == (2, pn, pn, CONFIGS[config][0]["z"])
        assert_close(got, nexts[si], F_HAT_RTOL, scaled_atol(nexts[si], F_HAT_SHARE),
                     what=f"{config} input of scale {si + 1} on {backend}")
        # the op itself on the engine's own f_hat: a plain area mean (few float32 sums)
        assert_close(got, ref_vq.resize_area(f_hat, pn, pn), 1e-6, scaled_atol(f_hat, 1e-7),
                     what="area of the engine's f_hat")


def test_decode_matches_reference(backend, model_file):
    config, weights, path = model_file
    vq = _C.VQVAE(path, device=backend)
    patch_nums = CONFIGS[config][1]
    ids = random_ids(np.random.default_rng(4), 2, patch_nums, CONFIGS[config][0]["vocab"])
    f_hat = vq.idx_to_fhat(ids, patch_nums)
    got = vq.decode(f_hat)
    raw = ref_vq.decode_unclamped(weights, f_hat)
    want = np.clip(raw, -1.0, 1.0)
    side = patch_nums[-1] * vq.config["upscale"]
    assert got.shape == (2, side, side, 3) and got.dtype == np.float32
    assert got.min() >= -1.0 and got.max() <= 1.0
    # the comparison must see the decoder's numbers, not only the clamp's bounds
    assert np.mean(np.abs(raw) < 1.0) > 0.5
    assert_close(got, want, IMAGE_RTOL, IMAGE_ATOL, what=f"{config} decode on {backend}")


@pytest.mark.parametrize("dtype,share", [("bf16", 2e-2), ("fp16", 3e-3)])
def test_decode_in_16_bits(backend, model_file, dtype, share):
    """A VQVAE loaded with a 16-bit dtype runs its convolutions as autocast's (ops.h; the
    official code decodes under its fp16 autocast): within the 16-bit operands' error of
    the float64 decode, visibly not the float32 decode, and on the guard (the CPU's
    kernels under the backend contract) the CPU's bits."""
    config, weights, path = model_file
    patch_nums = CONFIGS[config][1]
    ids = random_ids(np.random.default_rng(6), 2, patch_nums, CONFIGS[config][0]["vocab"])
    fp32 = _C.VQVAE(path, device=backend)
    f_hat = fp32.idx_to_fhat(ids, patch_nums)
    got = _C.VQVAE(path, device=backend, dtype=dtype).decode(f_hat)
    raw = ref_vq.decode_unclamped(weights, f_hat)
    assert_close(got, np.clip(raw, -1.0, 1.0), 0.0, share * np.abs(raw).max(),
                 what=f"{config} {dtype} decode on {backend}")
    assert np.abs(got - fp32.decode(f_hat)).max() > 1e-2 * share, "the dtype did not reach the convolutions"
    if backend == "guard":
        assert np.array_equal(got, _C.VQVAE(path, dtype=dtype).decode(f_hat))
    with pytest.raises(ValueError, match="dtype"):
        _C.VQVAE(path, device=backend, dtype="fp64")


def test_decode_uint8_and_batches(model_file):
    config, weights, path = model_file
    vq = _C.VQVAE(path)
    patch_nums = CONFIGS[config][1]
    z = CONFIGS[config][0]["z"]
    f_hat = 2.0 * vq.idx_to_fhat(random_ids(np.random.default_rng(5), 3, patch_nums,
                                            CONFIGS[config][0]["vocab"]), patch_nums)
    images = vq.decode(f_hat)
    assert np.array_equal(vq.decode_uint8(f_hat), ref_vae.to_uint8(images))
    for i in range(3):
        assert np.array_equal(vq.decode(f_hat[i:i + 1])[0], images[i])
    assert vq.decode(np.zeros((0, 4, 4, z), np.float32)).shape == (0, 4 * vq.config["upscale"],
                                                                   4 * vq.config["upscale"], 3)
    # a smaller latent after a larger one (the buffers are grown, then reused)
    small = f_hat[:1, :3, :3]
    assert_close(vq.decode(small), ref_vq.decode(weights, small), IMAGE_RTOL, IMAGE_ATOL,
                 what="decode of a 3x3 latent after a larger one")


def test_guard_equals_cpu_bit_for_bit(model_file):
    """The guard backend runs the CPU's kernels over memory the host cannot read: every
    result is the CPU's, so no host code touched backend memory."""
    config, weights, path = model_file
    patch_nums = CONFIGS[config][1]
    ids = random_ids(np.random.default_rng(6), 2, patch_nums, CONFIGS[config][0]["vocab"])
    out = {}
    for device in ("cpu", "guard"):
        vq = _C.VQVAE(path, device=device)
        f_hat = vq.idx_to_fhat(ids, patch_nums)
        out[device] = (f_hat, vq.fhat_to_next(f_hat, patch_nums[1]), vq.decode(f_hat), vq.embed(ids[1]))
    for a, b in zip(out["cpu"], out["guard"]):
        assert np.array_equal(a, b)


def test_ctrl_c_interrupts_decode(tmp_path):
    vq = _C.VQVAE(write(tmp_path, weights_for("two_levels")))
    f_hat = np.random.default_rng(7).standard_normal((4, 8, 8, 8)).astype(np.float32)
    before = vq.decode(f_hat[:1])
    assert call_with_sigint_pending(vq.decode, f_hat), "decode returned instead of raising KeyboardInterrupt"
    assert np.array_equal(vq.decode(f_hat[:1]), before)


# ----- the official configuration --------------------------------------------------------

def test_official_shapes_load_and_decode(tmp_path):
    """vae_ch160v4096z32's decoding tensors (B5: 189 keys; the decoder's 64,653,923
    parameters, B1) with random weights: the engine reads every shape and decodes a 1x1
    latent (a 16x16 image) as the reference does."""
    weights = ref_vq.random_vqvae_weights(np.random.default_rng(8), scale=0.5)
    assert len(weights) == ref_vq.OFFICIAL_KEY_COUNT
    decoder_params = sum(v.size for k, v in weights.items() if k.startswith("decoder."))
    assert decoder_params == ref_vq.OFFICIAL_DECODER_PARAMS
    vq = _C.VQVAE(write(tmp_path, weights))
    cfg = vq.config
    assert (cfg["vocab"], cfg["z_channels"], cfg["ch"], cfg["ch_mult"], cfg["num_res_blocks"], cfg["num_phi"],
            cfg["upscale"]) == (4096, 32, 160, (1, 1, 2, 2, 4), 2, 4, 16)
    assert vq.num_params == sum(v.size for v in weights.values())
    assert [vq.phi_index(si, 10) for si in range(10)] == SPEC_PHI_TABLE
    ids = [np.array([[17]], np.int32)]
    f_hat = vq.idx_to_fhat(ids, (1,))
    want_fhat, _ = ref_vq.idx_to_fhat(weights, ids, (1,))
    assert_close(f_hat, want_fhat, F_HAT_RTOL, scaled_atol(want_fhat, F_HAT_SHARE), what="official f_hat")
    got = vq.decode(f_hat)
    assert got.shape == (1, 16, 16, 3)
    assert_close(got, ref_vq.decode(weights, f_hat), IMAGE_RTOL, IMAGE_ATOL, what="official decode")


# ----- bad input -------------------------------------------------------------------------

def test_var_file_refused(tmp_path):
    var_like = {"class_emb.weight": np.zeros((11, 64), np.float32),
                "lvl_embed.weight": np.zeros((6, 64), np.float32),
                "blocks.0.attn.mat_qkv.weight": np.zeros((192, 64), np.float32)}
    path = write(tmp_path, var_like, "var.safetensors")
    with pytest.raises(ValueError, match=r"var\.safetensors is a VAR transformer file, not VAR's VQVAE"):
        _C.VQVAE(path)


def test_mar_file_refused(tmp_path):
    mar_like = {"z_proj.weight": np.zeros((768, 16), np.float32),
                "encoder_blocks.0.norm1.weight": np.ones(768, np.float32)}
    path = write(tmp_path, mar_like, "mar.safetensors")
    with pytest.raises(ValueError, match=r"mar\.safetensors is a MAR model file, not VAR's VQVAE"):
        _C.VQVAE(path)


def test_kl16_vae_file_refused_both_ways(tmp_path):
    kl16 = write(tmp_path, ref_vae.random_vae_weights(np.random.default_rng(0), ch=32, ch_mult=(1, 2),
                                                      num_res_blocks=1, z=5), "kl16.safetensors")
    with pytest.raises(ValueError, match=r"kl16\.safetensors is a VAE decoder without a codebook"):
        _C.VQVAE(kl16)
    vq = write(tmp_path, weights_for("two_levels"), "vq.safetensors")
    with pytest.raises(ValueError, match=r"vq\.safetensors is VAR's multi-scale VQVAE.*not MAR's KL-16"):
        _C.VAE(vq)


def test_metadata_kind_refused(tmp_path):
    path = write(tmp_path, weights_for("two_levels"), "kind.safetensors", metadata={"kind": "var"})
    with pytest.raises(ValueError, match=r"kind\.safetensors is a 'var' file \(its metadata 'kind'\)"):
        _C.VQVAE(path)
    ok = write(tmp_path, weights_for("two_levels"), "ok.safetensors",
               metadata={"kind": "vqvae", "quant_resi": "0.5"})
    assert _C.VQVAE(ok).config["quant_resi"] == 0.5


@pytest.mark.parametrize("key", ["decoder.up.1.attn.0.qkv.bias", "post_quant_conv.weight",
                                 "decoder.mid.attn_1.proj_out.weight", "quantize.quant_resi.qresi_ls.0.weight"])
def test_missing_key_named(tmp_path, key):
    weights = weights_for("two_levels")
    del weights[key]
    with pytest.raises(KeyError, match=r"missing\.safetensors.*" + key.replace(".", r"\.")):
        _C.VQVAE(write(tmp_path, weights, "missing.safetensors"))


def test_codebook_width_mismatch_named(tmp_path):
    weights = weights_for("two_levels")
    weights["quantize.embedding.weight"] = np.zeros((64, 7), np.float32)
    with pytest.raises(ValueError, match=r"cb\.safetensors: codebook 'quantize\.embedding\.weight' has "
                                         r"shape \[64, 7\].*8 channels.*expected \[64, 8\]"):
        _C.VQVAE(write(tmp_path, weights, "cb.safetensors"))


def test_misshapen_phi_named(tmp_path):
    weights = weights_for("two_levels")
    weights["quantize.quant_resi.qresi_ls.2.weight"] = np.zeros((8, 8, 1, 1), np.float32)
    with pytest.raises(ValueError, match=r"qresi_ls\.2\.weight.*\[8, 8, 1, 1\].*\[8, 8, 3, 3\]"):
        _C.VQVAE(write(tmp_path, weights))


def test_unexpected_tensors_refused(tmp_path):
    weights = weights_for("two_levels")
    weights["quantize.quant_resi.qresi_ls.5.weight"] = np.zeros((8, 8, 3, 3), np.float32)
    with pytest.raises(ValueError, match=r"unexpected quantizer tensor 'quantize\.quant_resi\.qresi_ls\.5"):
        _C.VQVAE(write(tmp_path, weights, "gap.safetensors"))
    weights = weights_for("two_levels")
    weights["decoder.up.0.attn.0.norm.weight"] = np.ones(32, np.float32)
    with pytest.raises(ValueError, match=r"unexpected decoder tensor 'decoder\.up\.0\.attn\.0"):
        _C.VQVAE(write(tmp_path, weights, "attn.safetensors"))


def test_encoder_side_ignored(tmp_path):
    """A full VQVAE state dict (encoder, quant_conv, the EMA statistics) loads; only the
    decoding tensors bind."""
    weights = weights_for("two_levels")
    full = dict(weights)
    full["encoder.conv_in.weight"] = np.zeros((32, 3, 3, 3), np.float32)
    full["quant_conv.weight"] = np.zeros((8, 8, 3, 3), np.float32)
    full["quantize.ema_vocab_hit_SV"] = np.zeros((6, 64), np.float32)
    assert _C.VQVAE(write(tmp_path, full)).num_params == sum(v.size for v in weights.values())


def test_bad_quant_resi_metadata(tmp_path):
    path = write(tmp_path, weights_for("two_levels"), metadata={"quant_resi": "half"})
    with pytest.raises(ValueError, match=r"metadata 'quant_resi' = 'half'"):
        _C.VQVAE(path)


def test_bad_arguments(tmp_path):
    vq = _C.VQVAE(write(tmp_path, weights_for("two_levels")))
    with pytest.raises(ValueError, match=r"f_hat must have shape \[n, side, side, 8\].*\(1, 4, 4, 7\)"):
        vq.decode(np.zeros((1, 4, 4, 7), np.float32))
    with pytest.raises(ValueError, match=r"f_hat must have shape.*\(1, 4, 5, 8\)"):
        vq.fhat_to_next(np.zeros((1, 4, 5, 8), np.float32), 2)
    with pytest.raises(ValueError, match=r"token id 64 at flat index 1 is outside \[0, 64\)"):
        vq.embed(np.array([0, 64]))
    with pytest.raises(ValueError, match=r"token id -1"):
        vq.embed(np.array([-1]))
    with pytest.raises(ValueError, match="integer array of token ids"):
        vq.embed(np.array([0.5]))
    with pytest.raises(ValueError, match=r"idx_list\[1\] must have shape \[B, 4\].*\(2, 3\)"):
        vq.idx_to_fhat([np.zeros((2, 1), np.int32), np.zeros((2, 3), np.int32)], (1, 2, 4))
    with pytest.raises(ValueError, match=r"idx_list\[1\] must have shape \[B, 4\].*B as idx_list\[0\]"):
        vq.idx_to_fhat([np.zeros((2, 1), np.int32), np.zeros((3, 4), np.int32)], (1, 2, 4))
    with pytest.raises(ValueError, match="first 1 to 3 scales"):
        vq.idx_to_fhat([np.zeros((1, 1), np.int32)] * 4, (1, 2, 4))
    with pytest.raises(ValueError, match=r"patch_nums\[1\] = 5 exceeds the last entry 4"):
        vq.idx_to_fhat([np.zeros((1, 1), np.int32)], (1, 5, 4))
    with pytest.raises(ValueError, match=r"pn must be in \[1,"):
        vq.fhat_to_next(np.zeros((1, 4, 4, 8), np.float32), 0)
    with pytest.raises(FileNotFoundError):
        _C.VQVAE(str(tmp_path / "absent.safetensors"))

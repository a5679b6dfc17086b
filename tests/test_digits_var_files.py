"""The shipped digits VAR and its VQVAE (issue 15; written by `tools/train_digits.py var`):
the files hold exactly what `marcache convert var|vqvae` writes for the official key layout,
and their metadata (patch_nums, sizes, the trainer's measurements) agree with the shapes.
Reads headers only: no VAR engine is needed."""
import json
import os

import pytest

from marcache import _C, digits
from marcache.convert import decoder_expected_shapes, var_expected_shapes
from marcache.convert.var import _var_is_buffer

VAR_PATH = os.path.join(digits.DATA_DIR, "digits_var.safetensors")
VQVAE_PATH = os.path.join(digits.DATA_DIR, "digits_vqvae.safetensors")


def _read_header(path):
    entries, meta = _C.safetensors_info(path)
    return {name: (dtype, tuple(shape)) for name, dtype, shape in entries}, meta


@pytest.fixture(scope="module")
def var_file():
    return _read_header(VAR_PATH)


@pytest.fixture(scope="module")
def vqvae_file():
    return _read_header(VQVAE_PATH)


def _patch_nums(meta):
    return tuple(int(p) for p in meta["patch_nums"].split(","))


def test_var_key_layout(var_file):
    tensors, meta = var_file
    assert meta["kind"] == "var"
    pns = _patch_nums(meta)
    depth, width, heads = int(meta["depth"]), int(meta["width"]), int(meta["heads"])
    expected = var_expected_shapes(depth, width, heads, vocab=int(meta["vocab"]), tokens=sum(p * p for p in pns),
                                   vae_channels=int(meta["vae_channels"]), num_classes=10, num_levels=len(pns))
    expected = {k: v for k, v in expected.items() if not _var_is_buffer(k)}
    assert {k: shape for k, (_, shape) in tensors.items()} == expected
    assert {dtype for dtype, _ in tensors.values()} == {"F16"}
    assert width == 64 * heads and 4 <= depth <= 6
    assert tensors["class_emb.weight"][1][0] == 11          # 10 digits + the null class
    assert meta["attn_l2_norm"] == "true" and meta["shared_aln"] == "false"


def test_vqvae_key_layout(vqvae_file):
    tensors, meta = vqvae_file
    assert meta["kind"] == "vqvae"
    ch, z, vocab, n_phi = int(meta["ch"]), int(meta["z_channels"]), int(meta["vocab"]), int(meta["num_phi"])
    ch_mult = tuple(int(m) for m in meta["ch_mult"].split(","))
    expected = dict(decoder_expected_shapes(ch, ch_mult, int(meta["num_res_blocks"]), z, post_quant_ks=3,
                                            fused_qkv=True, top_attention=True))
    expected["quantize.embedding.weight"] = (vocab, z)
    for k in range(n_phi):
        expected[f"quantize.quant_resi.qresi_ls.{k}.weight"] = (z, z, 3, 3)
        expected[f"quantize.quant_resi.qresi_ls.{k}.bias"] = (z,)
    assert {k: shape for k, (_, shape) in tensors.items()} == expected
    assert n_phi == 4 and meta["quant_resi"] == "0.5"
    # 16x16 digits from an 8x8 latent: one 2x up level; the latent side is the last patch num
    assert 16 == _patch_nums(meta)[-1] * 2 ** (len(ch_mult) - 1)


def test_the_pair_fits(var_file, vqvae_file):
    (vt, vm), (qt, qm) = var_file, vqvae_file
    assert _patch_nums(vm) == _patch_nums(qm)
    pns = _patch_nums(vm)
    assert vt["pos_1LC"][1][1] == sum(p * p for p in pns) and vt["lvl_embed.weight"][1][0] == len(pns)
    assert vt["pos_start"][1][1] == pns[0] ** 2
    assert list(pns) == sorted(pns) and len(set(pns)) == len(pns)
    vocab, z = qt["quantize.embedding.weight"][1]
    assert vt["head.weight"][1][0] == vocab and vt["word_embed.weight"][1][1] == z


def test_recorded_quality_and_size():
    """The trainer's own measurement (PyTorch sampler at cfg 1.5, top_k 900 = all, top_p 0.96,
    500 digits, the shipped classifier) is recorded in the file; the bar is 90%."""
    _, meta = _read_header(VAR_PATH)
    evaluation = json.loads(meta["evaluation"])
    assert evaluation["cfg 1.5"]["accuracy"] >= 0.90
    sampling = json.loads(meta["sampling"])
    assert (sampling["cfg"], sampling["top_k"], sampling["top_p"]) == (1.5, 900, 0.96)
    _, qmeta = _read_header(VQVAE_PATH)
    assert json.loads(qmeta["evaluation"])["held_out_recon_accuracy"] >= 0.95
    for path in (VAR_PATH, VQVAE_PATH):
        assert os.path.getsize(path) < 8 << 20

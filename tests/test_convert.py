"""marcache.convert: the torch-free checkpoint reader and converter.

The fixtures under tests/fixtures/ were written by the real torch.save (see
tests/fixtures/make_torch_fixtures.py, which needs PyTorch; these tests do
not). Each .npz beside a checkpoint holds the values torch held.
"""
import hashlib
import io
import json
import lzma
import os
import pickle
import struct
import subprocess
import sys
import zipfile
from collections import OrderedDict

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import marcache as mc
from marcache import _C
from marcache import convert as conv
from reference import inception as ref_inception
from reference import mar as ref_mar
from reference import vae as ref_vae

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


def subprocess_env():
    """Child Pythons import the same marcache as this test (installed or in-place)."""
    import marcache

    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(marcache.__file__)))
    return env


def fx(name):
    return os.path.join(FIXTURES, name)


def expected(npz, prefix=""):
    """name -> values torch saved (bf16 bits widened to float32, exactly)."""
    out = {}
    with np.load(fx(npz)) as data:
        for key in data.files:
            if not key.startswith(prefix):
                continue
            name = key[len(prefix):]
            if name.endswith("@bf16"):
                out[name[:-5]] = conv.bf16_bits_to_f32(data[key])
            else:
                out[name] = data[key]
    return out


def bits(arr):
    arr = np.asarray(arr)
    return arr.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[arr.dtype.itemsize])


def assert_same(got, want, name=""):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    if want.dtype.kind == "f":
        np.testing.assert_array_equal(bits(got.astype(want.dtype)), bits(want), err_msg=name)
        np.testing.assert_array_equal(got, want.astype(got.dtype), err_msg=name)
    else:
        np.testing.assert_array_equal(got, want, err_msg=name)


def read_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return n, json.loads(f.read(n))


# ======================================================================
# Reading torch.save files
# ======================================================================

def test_tiny_mar_values_are_what_torch_saved():
    ck = conv.read_checkpoint(fx("tiny_mar.pth"))
    assert ck.format == "zip"
    assert set(ck) == {"model", "model_ema", "optimizer", "epoch", "scaler", "args"}
    for part in ("model", "model_ema"):
        want = expected("tiny_mar.npz", part + "/")
        assert list(ck[part]) == list(want)
        for name, t in ck[part].items():
            assert_same(t.numpy(), want[name], f"{part}/{name}")
    # The dtypes are the stored ones; bf16 raw bits are exact.
    ema = ck["model_ema"]
    assert ema["z_proj.weight"].dtype == "F16" and ema["class_emb.weight"].dtype == "BF16"
    assert ema["fake_latent"].dtype == "F32" and ck["model"]["fake_latent"].dtype == "BF16"
    with np.load(fx("tiny_mar.npz")) as data:
        np.testing.assert_array_equal(ema["class_emb.weight"].raw(), data["model_ema/class_emb.weight@bf16"])
    ck.close()


def test_tiny_mar_layouts_offsets_strides_and_shared_storage():
    with conv.read_checkpoint(fx("tiny_mar.pth")) as ck:
        ema = ck["model_ema"]
        t = ema["decoder_embed.weight"]                 # saved as a transposed view
        assert t.stride == (1, 16) and not t.is_contiguous()
        f = ema["fake_latent"]                          # column of a [16, 3] tensor
        assert f.offset == 1 and f.stride[1] == 3 and not f.is_contiguous()
        w, b = ema["encoder_norm.weight"], ema["encoder_norm.bias"]
        assert w.storage is b.storage and (w.offset, b.offset) == (5, 21)
        for arr in (t.numpy(), f.numpy(), w.numpy()):
            assert arr.flags.c_contiguous


def test_tiny_mar_non_tensor_entries_are_inert_data():
    import argparse

    with conv.read_checkpoint(fx("tiny_mar.pth")) as ck:
        assert ck["epoch"] == 799
        assert isinstance(ck["args"], argparse.Namespace)
        assert ck["args"].model == "mar_tiny" and ck["args"].diffloss_w == 16 and ck["args"].ema_rate == 0.9999
        assert ck["scaler"]["scale"] == 65536.0
        opt = ck["optimizer"]
        assert opt["param_groups"][0]["betas"] == (0.9, 0.95)
        assert float(opt["state"][0]["step"].numpy()) == 3.0
        np.testing.assert_array_equal(opt["state"][0]["exp_avg_sq"].numpy(), np.ones(16, np.float32))


@pytest.mark.parametrize("name", ["mixed.pth", "mixed_legacy.pth"])
def test_every_dtype_and_view_in_zip_and_legacy_formats(name):
    want = expected("mixed.npz")
    with conv.read_checkpoint(fx(name)) as ck:
        assert ck.format == ("legacy" if "legacy" in name else "zip")
        for key, values in want.items():
            t = ck["nested"]["list"][0] if key == "nested.list.0" else ck[key]
            got = t.numpy()
            assert got.dtype == values.dtype, key
            assert_same(got, values, key)
        assert ck["expanded"].stride[0] == 0                      # expand(): stride 0
        assert ck["shared_a"].storage is ck["shared_b"].storage is ck["shared_every_third"].storage
        assert ck["shared_every_third"].stride == (3,)
        assert ck["transposed"].numpy().flags.c_contiguous
        assert ck["scalar"].shape == () and ck["empty"].shape == (0, 3)
        nested, args = ck["nested"], ck["args"]
        assert nested["list"][1:] == [3, "x"] and nested["tuple"] == (1.5, None)
        assert nested["set"] == {1, 2, 3} and nested["bytes"] == b"\x00ab"
        assert args.lr == 1e-4 and args.np_value == 0.5 and args.np_int == 7
        assert args.dtype == conv.TorchDtype("float16") and repr(args.device) == "device('cpu')"


def test_reader_never_imports_torch():
    code = ("import sys; sys.modules['torch'] = None\n"   # any `import torch` now raises ImportError
            "import marcache.convert as c\n"
            f"ck = c.read_checkpoint({fx('tiny_mar.pth')!r}); [t.numpy() for _, t in ck.tensors()]\n"
            f"ck = c.read_checkpoint({fx('mixed_legacy.pth')!r}); [t.numpy() for _, t in ck.tensors()]\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=FIXTURES,
                         env=subprocess_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# ======================================================================
# Converting MAR
# ======================================================================

@pytest.fixture(scope="module")
def mar_fp32(tmp_path_factory):
    dst = tmp_path_factory.mktemp("conv") / "mar.safetensors"
    plan = conv.convert("mar", fx("tiny_mar.pth"), dst, heads=2)
    return dst, plan


def test_converted_mar_reads_back_identically_with_both_readers(mar_fp32):
    dst, plan = mar_fp32
    want = expected("tiny_mar.npz", "model_ema/")
    st = load_file(str(dst))
    ours, meta = _C.safetensors_read(str(dst))
    assert set(st) == set(want) == set(ours)
    assert len(st) == 84 == len(ref_mar.mar_shapes(16, 2, 16, 1, num_classes=10))
    for name, values in want.items():
        assert st[name].dtype == np.float32
        assert_same(st[name], values.astype(np.float32), name)
        assert_same(ours[name], st[name], name)
    with safe_open(str(dst), framework="numpy") as f:
        assert f.metadata() == meta
    assert meta["kind"] == "mar" and meta["weights"] == "model_ema" and meta["dtype"] == "fp32"
    assert (meta["width"], meta["depth"], meta["heads"], meta["head_dim"]) == ("16", "2", "2", "8")
    assert (meta["head_width"], meta["head_depth"], meta["num_classes"]) == ("16", "1", "10")
    assert meta["source_file"] == "tiny_mar.pth" and meta["marcache_version"] == mc.__version__
    with open(fx("tiny_mar.pth"), "rb") as f:
        assert meta["source_sha256"] == hashlib.sha256(f.read()).hexdigest()
    assert meta["num_params"] == str(sum(v.size for v in want.values()))


def test_converted_file_layout_follows_the_writer_conventions(mar_fp32):
    dst, _ = mar_fp32
    n, header = read_header(dst)
    assert n % 8 == 0
    names = [k for k in header if k != "__metadata__"]
    offsets = [header[k]["data_offsets"] for k in names]
    assert names == sorted(names)                       # one dtype: ordered by name
    assert offsets[0][0] == 0 and all(a[1] == b[0] for a, b in zip(offsets, offsets[1:]))
    assert os.path.getsize(dst) == 8 + n + offsets[-1][1]
    assert not os.path.exists(str(dst) + ".partial")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_converted_mar_casts_like_torch(tmp_path, dtype):
    dst = tmp_path / f"mar_{dtype}.safetensors"
    conv.convert("mar", fx("tiny_mar.pth"), dst, dtype=dtype, heads=2)
    _, header = read_header(dst)
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {conv.DTYPES[dtype]}
    assert header["__metadata__"]["dtype"] == dtype
    with np.load(fx("tiny_mar.npz")) as data:
        prefix = f"model_ema_as_{dtype}/"
        torch_bits = {k[len(prefix):].replace("@bf16", ""): data[k].view(np.uint16)
                      for k in data.files if k.startswith(prefix)}
    ours, _ = _C.safetensors_read(str(dst))
    raw = _raw_tensors(dst)
    for name, want in torch_bits.items():
        np.testing.assert_array_equal(raw[name], want, err_msg=name)    # bitwise torch's .half()/.bfloat16()
        widened = conv.bf16_bits_to_f32(want) if dtype == "bf16" else want.view(np.float16).astype(np.float32)
        np.testing.assert_array_equal(ours[name], widened, err_msg=name)
    if dtype == "fp16":
        st = load_file(str(dst))
        for name, want in torch_bits.items():
            np.testing.assert_array_equal(st[name].view(np.uint16), want)


def _raw_tensors(path):
    """name -> uint16 view of each 2-byte tensor, read with nothing but json + numpy."""
    n, header = read_header(path)
    data = np.fromfile(path, dtype=np.uint8, offset=8 + n)
    return {k: data[v["data_offsets"][0]:v["data_offsets"][1]].view("<u2").reshape(v["shape"])
            for k, v in header.items() if k != "__metadata__"}


def test_weights_model_takes_the_raw_weights(tmp_path):
    dst = tmp_path / "raw.safetensors"
    plan = conv.convert("mar", fx("tiny_mar.pth"), dst, weights="model", heads=2)
    assert plan.metadata["weights"] == "model"
    st = load_file(str(dst))
    for name, values in expected("tiny_mar.npz", "model/").items():
        assert_same(st[name], values, name)


def test_converted_mar_generates_the_same_tokens_as_the_original_weights(mar_fp32, tmp_path):
    dst, _ = mar_fp32
    direct = tmp_path / "direct.safetensors"
    save_file({k: v.astype(np.float32) for k, v in expected("tiny_mar.npz", "model_ema/").items()}, str(direct),
              metadata={"heads": "2"})
    a = mc.load(dst).generate_tokens(labels=[1, 7], steps=4, cfg=2.0, seed=3)
    b = mc.load(direct).generate_tokens(labels=[1, 7], steps=4, cfg=2.0, seed=3)
    assert a.shape == (2, 256, 16)
    np.testing.assert_array_equal(a, b)


def test_released_width_needs_no_heads_and_unknown_width_asks_for_them(tmp_path):
    with pytest.raises(conv.CheckpointError, match=r"width 16 is not one of the released.*--heads"):
        conv.convert("mar", fx("tiny_mar.pth"), tmp_path / "x.safetensors")
    assert not os.path.exists(tmp_path / "x.safetensors")


# ======================================================================
# marcache.load picks the kind from the metadata
# ======================================================================

@pytest.fixture(scope="module")
def converted(tmp_path_factory, mar_fp32):
    d = tmp_path_factory.mktemp("kinds")
    out = {"mar": mar_fp32[0]}
    for kind, src in (("vae-kl16", "tiny_kl16.ckpt"), ("var", "tiny_var.pth"), ("vqvae", "tiny_vqvae.pth")):
        out[kind] = d / f"{kind}.safetensors"
        conv.convert(kind, fx(src), out[kind])
    return out


def test_load_accepts_a_converted_mar_and_vae(converted):
    model = mc.load(converted["mar"], vae=converted["vae-kl16"])
    assert model.config["width"] == 16 and model.config["heads"] == 2
    images = model.generate(labels=[3], steps=2, cfg=1.0, seed=0)
    assert images.shape == (1, 32, 32, 3) and images.dtype == np.uint8
    assert mc.model.file_kind(converted["vae-kl16"]) == "vae-kl16"


def test_load_refuses_a_vae_file_as_the_model(converted):
    with pytest.raises(ValueError, match=r"KL-16 VAE decoder file \(metadata kind='vae-kl16'.*pass it as vae="):
        mc.load(converted["vae-kl16"])


def test_load_refuses_a_mar_file_as_the_vae(converted):
    with pytest.raises(ValueError, match=r"vae= .* is a MAR model file .*not a KL-16 VAE decoder"):
        mc.load(converted["mar"], vae=converted["mar"])


def test_load_refuses_a_vqvae_as_the_model_and_decoders_of_the_other_family(converted):
    with pytest.raises(ValueError, match=r"VQVAE decoder file \(metadata kind='vqvae'.*pass it as vae=.*VAR model"):
        mc.load(converted["vqvae"])
    with pytest.raises(ValueError, match=r"vae= .* is a KL-16 VAE decoder file .*not VAR's VQVAE decoder"):
        mc.load(converted["var"], vae=converted["vae-kl16"])
    with pytest.raises(ValueError, match=r"vae= .* is VAR's VQVAE decoder file .*not a KL-16 VAE decoder.*VAR model"):
        mc.load(converted["mar"], vae=converted["vqvae"])
    with pytest.raises(ValueError, match=r"vae= .* is a VAR transformer file .*not VAR's VQVAE decoder"):
        mc.load(converted["var"], vae=converted["var"])


def test_files_without_kind_metadata_still_load_by_key_sniffing(tmp_path):
    path = tmp_path / "plain.safetensors"
    save_file({k: v.astype(np.float32) for k, v in expected("tiny_mar.npz", "model_ema/").items()}, str(path),
              metadata={"heads": "2"})
    assert mc.model.file_kind(path) is None
    assert mc.load(path).config["depth"] == 2
    vae = tmp_path / "plain_vae.safetensors"
    save_file({k: v.astype(np.float32) for k, v in expected("tiny_kl16.npz").items()
               if k.startswith(("decoder.", "post_quant_conv."))}, str(vae))
    with pytest.raises(ValueError, match="is a KL-16 VAE file, not a MAR model"):   # the C loader's sniffing
        mc.load(vae)


def test_unknown_kind_metadata_is_refused(tmp_path):
    path = tmp_path / "odd.safetensors"
    save_file({"x": np.zeros(2, np.float32)}, str(path), metadata={"kind": "gpt2"})
    with pytest.raises(ValueError, match="kind='gpt2' is not one marcache knows"):
        mc.load(path)


# ======================================================================
# The other kinds
# ======================================================================

def test_vae_kl16_keeps_the_decoder_and_drops_the_encoder(converted):
    want = expected("tiny_kl16.npz")
    keep = ref_vae.vae_shapes(ch=32, ch_mult=(1, 1), num_res_blocks=0, z=16)
    st = load_file(str(converted["vae-kl16"]))
    assert set(st) == set(keep)
    for name, shape in keep.items():
        assert st[name].shape == shape
        assert_same(st[name], want[name].astype(np.float32), name)      # fp16 in the checkpoint: exact
    _, meta = _C.safetensors_info(str(converted["vae-kl16"]))
    assert (meta["kind"], meta["ch"], meta["ch_mult"], meta["num_res_blocks"], meta["z_channels"]) == \
        ("vae-kl16", "32", "1,1", "0", "16")
    assert meta["official_config"] == "no" and meta["weights"] == "model"
    assert _C.VAE(str(converted["vae-kl16"])) is not None


def test_vae_kl16_refuses_ldm_weights_with_up_path_attention(tmp_path):
    with pytest.raises(conv.CheckpointError, match=r"up-path attention \(decoder\.up\.0\.attn\.0\..*LDM kl-f16"):
        conv.convert("vae-kl16", fx("tiny_ldm_kl16.ckpt"), tmp_path / "ldm.safetensors")
    assert not os.listdir(tmp_path)


def test_var_keeps_parameters_and_drops_buffers(converted):
    want = expected("tiny_var.npz")
    st = load_file(str(converted["var"]))
    buffers = {"lvl_1L", "attn_bias_for_masking", "blocks.0.attn.zero_k_bias", "blocks.1.attn.zero_k_bias"}
    assert set(st) == set(want) - buffers and len(st) == 10 + 12 * 2
    for name in st:
        assert_same(st[name], want[name], name)
    _, meta = _C.safetensors_info(str(converted["var"]))
    assert (meta["kind"], meta["depth"], meta["width"], meta["heads"], meta["vocab"], meta["tokens"]) == \
        ("var", "2", "16", "2", "32", "14")
    assert meta["patch_nums"] == "1,2,3"   # from the lvl_1L buffer (scale index of every token)


def test_var_patch_nums_need_a_scale_index_per_token(tmp_path):
    sd = conv_fake(conv.var_expected_shapes(2, 16, 2, vocab=32, tokens=14, vae_channels=8, num_classes=10,
                                            num_levels=3))
    with pytest.raises(conv.CheckpointError, match="lvl_1L cannot be read, so the scales of its 14 tokens in 3 "
                                                   "levels are unknown"):
        conv.plan("var", fake_ck(sd))

    class Values(FakeTensor):
        def __init__(self, values):
            super().__init__(np.shape(values), "I64")
            self.values = np.asarray(values)

        def numpy(self):
            return self.values

    good = [0] + [1] * 4 + [2] * 9
    for bad in ([0] + [1] * 3 + [2] * 10,      # a level of 3 tokens: not a square
                [0, 1, 1, 1, 2, 1] + [2] * 8):  # not ascending
        sd["lvl_1L"] = Values([bad])
        with pytest.raises(conv.CheckpointError, match="lvl_1L is not a scale index per token"):
            conv.plan("var", fake_ck(sd))
    sd["lvl_1L"] = Values([good])
    assert conv.plan("var", fake_ck(sd)).metadata["patch_nums"] == "1,2,3"


def test_vqvae_keeps_the_decoding_tensors(converted):
    want = expected("tiny_vqvae.npz")
    st = load_file(str(converted["vqvae"]))
    dropped = {k for k in want if k.startswith(("encoder.", "quant_conv.")) or k == "quantize.ema_vocab_hit_SV"}
    assert set(st) == set(want) - dropped
    assert "quantize.embedding.weight" in st and "decoder.up.1.attn.0.qkv.weight" in st
    for name in st:
        assert_same(st[name], want[name], name)
    _, meta = _C.safetensors_info(str(converted["vqvae"]))
    assert (meta["kind"], meta["vocab"], meta["num_phi"], meta["ch_mult"]) == ("vqvae", "16", "4", "1,2")


def test_inception_full_layout_from_torchvision_in_legacy_format(tmp_path):
    src = tmp_path / "pt_inception-layout.pth"
    with lzma.open(fx("inception_layout_legacy.pth.xz")) as f, open(src, "wb") as out:
        out.write(f.read())
    with conv.read_checkpoint(src) as ck:
        assert ck.format == "legacy" and len(ck) == 566
    dst = tmp_path / "inception.safetensors"
    plan = conv.convert("inception", src, dst)
    assert len(plan.tensors) == 472 and len(plan.dropped) == 94      # num_batches_tracked counters
    st = load_file(str(dst))
    assert set(st) == set(conv.inception_expected_shapes())
    for name, arr in st.items():
        np.testing.assert_array_equal(arr, ref_inception.layout_fill(name, arr.shape), err_msg=name)
    assert st["fc.weight"].shape == (1008, 2048)
    assert st["Mixed_7c.branch3x3dbl_3b.conv.weight"].shape == (384, 384, 3, 1)


def test_wrong_kind_is_named(tmp_path):
    with pytest.raises(conv.CheckpointError, match=r"It looks like a 'vae-kl16' checkpoint"):
        conv.convert("mar", fx("tiny_kl16.ckpt"), tmp_path / "x.safetensors")
    with pytest.raises(conv.CheckpointError, match=r"not a VAR checkpoint.*looks like a 'vqvae'"):
        conv.convert("var", fx("tiny_vqvae.pth"), tmp_path / "x.safetensors")
    with pytest.raises(conv.CheckpointError, match="pass --weights model"):
        ck = type("Ck", (), {"path": "p.pth", "root": {"model": dict(conv_fake(ref_mar.mar_shapes(16, 1, 16, 1)))}})
        conv.plan("mar", ck)


# ======================================================================
# Key-set validation against the spec (shape-only fake checkpoints)
# ======================================================================

class FakeTensor:
    def __init__(self, shape, dtype="F32"):
        self.shape = tuple(shape)
        self.dtype = dtype

    @property
    def numel(self):
        return int(np.prod(self.shape))


def conv_fake(shapes):
    return OrderedDict((k, FakeTensor(s)) for k, s in shapes.items())


def fake_ck(root, path="fake.pth"):
    return type("FakeCheckpoint", (), {"path": path, "root": root})()


# mar.md 1.1: tensors, parameters, heads, head dim
@pytest.mark.parametrize("name,tensors,params,heads,head_dim", [
    ("mar_base", 364, 207_924_768, 12, 64), ("mar_large", 476, 478_326_304, 16, 64),
    ("mar_huge", 604, 942_403_104, 16, 80)])
def test_released_mar_configs(name, tensors, params, heads, head_dim):
    shapes = ref_mar.official_shapes(name)
    p = conv.plan("mar", fake_ck({"model": conv_fake(shapes), "model_ema": conv_fake(shapes), "epoch": 799}))
    assert len(p.tensors) == tensors and sum(t.numel for t in p.tensors.values()) == params
    m = p.metadata
    assert (m["config"], m["heads"], m["head_dim"], m["decoder_heads"]) == (name, heads, head_dim, heads)
    assert p.dropped == ["model", "epoch"]


def test_every_missing_extra_and_misshaped_key_is_named():
    sd = conv_fake(ref_mar.official_shapes("mar_base"))
    del sd["encoder_blocks.3.attn.qkv.bias"], sd["diffloss.net.res_blocks.5.mlp.2.weight"]
    sd["encoder_blocks.3.attn.extra"] = FakeTensor((3,))
    sd["decoder.conv_in.weight"] = FakeTensor((1, 1, 3, 3))
    sd["z_proj.weight"] = FakeTensor((768, 32))
    with pytest.raises(conv.CheckpointError) as err:
        conv.plan("mar", fake_ck({"model_ema": sd}))
    msg = str(err.value)
    assert "missing (2): encoder_blocks.3.attn.qkv.bias, diffloss.net.res_blocks.5.mlp.2.weight" in msg
    assert "unexpected (2): encoder_blocks.3.attn.extra, decoder.conv_in.weight" in msg
    assert "z_proj.weight: expected [768, 16], found [768, 32]" in msg
    assert "fake.pth['model_ema']" in msg


def test_mar_weights_must_be_float():
    sd = conv_fake(ref_mar.official_shapes("mar_base"))
    sd["mask_token"] = FakeTensor((1, 1, 768), "I64")
    with pytest.raises(conv.CheckpointError, match=r"not floating point: mask_token \(I64\)"):
        conv.plan("mar", fake_ck({"model_ema": sd}))


def test_released_kl16_decoder_is_166_tensors():
    dec = ref_vae.vae_shapes()                   # Appendix B, from the independent reference
    full = OrderedDict([("encoder.conv_in.weight", FakeTensor((128, 3, 3, 3))),
                        ("quant_conv.weight", FakeTensor((32, 32, 1, 1)))])
    full.update(conv_fake(dec))
    p = conv.plan("vae-kl16", fake_ck({"model": full}))
    assert list(p.tensors) == list(dec) and len(p.tensors) == ref_vae.OFFICIAL_KEY_COUNT == 166
    assert sum(t.numel for t in p.tensors.values()) == ref_vae.OFFICIAL_PARAM_COUNT
    assert p.metadata["official_config"] == "yes" and p.dropped == ["encoder.conv_in.weight", "quant_conv.weight"]
    del full["decoder.up.2.block.1.conv2.bias"]
    with pytest.raises(conv.CheckpointError, match=r"missing \(1\): decoder\.up\.2\.block\.1\.conv2\.bias"):
        conv.plan("vae-kl16", fake_ck({"model": full}))


# var_fastvar.md A1 / A3: 12 + 13 depth keys (buffers included) and the parameter counts
@pytest.mark.parametrize("depth,keys,params", [(16, 220, 310_283_520), (20, 272, 600_917_136),
                                               (24, 324, 1_033_399_360), (30, 402, 2_010_020_356)])
def test_released_var_configs(depth, keys, params):
    shapes = conv.var_expected_shapes(depth, 64 * depth, depth)
    assert len(shapes) == keys
    sd = conv_fake(shapes)
    sd["lvl_1L"].dtype = "I64"
    p = conv.plan("var", fake_ck(sd))
    assert len(p.tensors) == keys - 2 - depth
    assert sum(t.numel for t in p.tensors.values()) == params
    assert (p.metadata["heads"], p.metadata["head_dim"], p.metadata["official_config"]) == (depth, 64, "yes")


def test_released_vqvae_decoding_tensors():
    # var_fastvar.md B1/B5: 189 decoding keys; decoder.* has 64,653,923 parameters, the
    # codebook + 4 Phi + post_quant_conv 177,312 (186,560 with quant_conv).
    shapes = conv.decoder_expected_shapes(160, (1, 1, 2, 2, 4), 2, 32, post_quant_ks=3, fused_qkv=True,
                                          top_attention=True)
    assert sum(k.startswith("decoder.") for k in shapes) == 178
    assert sum(int(np.prod(s)) for k, s in shapes.items() if k.startswith("decoder.")) == 64_653_923
    sd = conv_fake(shapes)
    sd["quantize.embedding.weight"] = FakeTensor((4096, 32))
    for i in range(4):
        sd[f"quantize.quant_resi.qresi_ls.{i}.weight"] = FakeTensor((32, 32, 3, 3))
        sd[f"quantize.quant_resi.qresi_ls.{i}.bias"] = FakeTensor((32,))
    sd["quant_conv.weight"] = FakeTensor((32, 32, 3, 3))
    sd["quantize.ema_vocab_hit_SV"] = FakeTensor((10, 4096))
    p = conv.plan("vqvae", fake_ck(sd))
    assert len(p.tensors) == 189 and p.metadata["official_config"] == "yes"
    assert sum(t.numel for k, t in p.tensors.items() if not k.startswith("decoder.")) == 177_312
    sd["quantize.something_new"] = FakeTensor((1,))
    with pytest.raises(conv.CheckpointError, match=r"unexpected \(1\): quantize\.something_new"):
        conv.plan("vqvae", fake_ck(sd))


def test_inception_rejects_torchvision_imagenet_weights():
    sd = conv_fake(conv.inception_expected_shapes())
    sd["fc.weight"], sd["fc.bias"] = FakeTensor((1000, 2048)), FakeTensor((1000,))
    sd["AuxLogits.fc.weight"] = FakeTensor((1000, 768))
    with pytest.raises(conv.CheckpointError, match=r"torchvision's ImageNet Inception-v3") as err:
        conv.plan("inception", fake_ck(sd))
    assert "fc.weight: expected [1008, 2048], found [1000, 2048]" in str(err.value)
    assert "unexpected (1): AuxLogits.fc.weight" in str(err.value)


# ======================================================================
# Malicious and damaged files
# ======================================================================

class _Evil:
    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _zip_with_pickle(path, payload, prefix="archive/"):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(prefix + "data.pkl", payload)
        z.writestr(prefix + "byteorder", "little")
        z.writestr(prefix + "version", "3\n")


def _payloads(sentinel):
    import builtins

    s = str(sentinel)
    yield "system", pickle.dumps({"model": _Evil(os.system, f"touch {s}")}, protocol=2)
    yield "eval", pickle.dumps({"args": _Evil(builtins.eval, f"open({s!r}, 'w').close()")}, protocol=4)
    yield "Popen", pickle.dumps([_Evil(subprocess.Popen, ["touch", s])], protocol=2)
    yield "getattr", b"\x80\x02c__builtin__\ngetattr\nq\x00."
    yield "system", b"(S'touch " + s.encode() + b"'\nios\nsystem\n."        # protocol 0 INST opcode
    # An allowlisted rebuild function may not be used to reach anything else either:
    yield "system", (b"\x80\x02ctorch._tensor\n_rebuild_from_type_v2\nq\x00cposix\nsystem\nq\x01.")


def test_malicious_pickles_are_refused_and_nothing_runs(tmp_path):
    sentinel = tmp_path / "pwned"
    for i, (name, payload) in enumerate(_payloads(sentinel)):
        path = tmp_path / f"evil{i}.pth"
        _zip_with_pickle(path, payload)
        with pytest.raises(conv.UnsafeCheckpointError, match=rf"global '[\w.]*{name}'.*not on marcache's allowlist"):
            conv.read_checkpoint(path)
        with pytest.raises(pickle.UnpicklingError):          # also an UnpicklingError, and a ValueError
            conv.convert("mar", path, tmp_path / "out.safetensors")
        assert not sentinel.exists(), f"payload {i} ({name}) ran"
    assert not (tmp_path / "out.safetensors").exists()


def test_pickle_cannot_modify_the_shared_allowlist_objects(tmp_path):
    # BUILD on the FloatStorage marker (would retype every later load) and on torch.float32.
    for payload in (b"\x80\x02ctorch\nFloatStorage\n}X\x05\x00\x00\x00dtypeX\x03\x00\x00\x00I64sb.",
                    b"\x80\x02ctorch\nfloat32\n}X\x02\x00\x00\x00stX\x03\x00\x00\x00I64sb.",
                    b"\x80\x02ctorch\nTensor\n(X\x04\x00\x00\x00nameX\x01\x00\x00\x00xtb."):
        path = tmp_path / "mutate.pth"
        _zip_with_pickle(path, payload)
        with pytest.raises(conv.CheckpointError, match="tries to (modify|set)"):
            conv.read_checkpoint(path)
    assert conv.ALLOWED_GLOBALS[("torch", "FloatStorage")].dtype == "F32"
    assert conv.ALLOWED_GLOBALS[("torch", "float32")].st == "F32"


def test_numpy_scalars_cannot_alter_numpy_dtypes(tmp_path):
    # A pickled np.float64 sets the state of its dtype with BUILD; the reader hands it a
    # fresh copy, so NumPy's shared float64 dtype keeps its byte order.
    payload = pickle.dumps({"x": np.float64(1.5)}, protocol=2)
    evil = payload.replace(b"X\x01\x00\x00\x00<", b"X\x01\x00\x00\x00>")    # state byte order '<' -> '>'
    assert evil != payload
    for data, want in ((payload, 1.5), (evil, np.frombuffer(np.float64(1.5).tobytes(), ">f8")[0])):
        path = tmp_path / "np.pth"
        _zip_with_pickle(path, data)
        with conv.read_checkpoint(path) as ck:
            assert ck["x"] == want
    assert np.dtype(np.float64).byteorder == "=" and np.dtype("f8").isnative
    assert np.float64(2.0) * 2 == 4.0
    for bad in (pickle.dumps(np.array([1], dtype=object)[0:1], protocol=2),):
        path = tmp_path / "obj.pth"
        _zip_with_pickle(path, bad)
        with pytest.raises(conv.CheckpointError):
            conv.read_checkpoint(path)


def test_malicious_legacy_pickle_is_refused(tmp_path):
    sentinel = tmp_path / "pwned"
    path = tmp_path / "evil_legacy.pth"
    with open(path, "wb") as f:
        for obj in (0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": True}):
            pickle.dump(obj, f, protocol=2)
        pickle.dump({"model": _Evil(os.system, f"touch {sentinel}")}, f, protocol=2)
    with pytest.raises(conv.UnsafeCheckpointError, match=r"'posix\.system'|'nt\.system'"):
        conv.read_checkpoint(path)
    assert not sentinel.exists()


def test_cli_refuses_malicious_file(tmp_path, capsys):
    from marcache.__main__ import main

    sentinel = tmp_path / "pwned"
    path = tmp_path / "evil.pth"
    _zip_with_pickle(path, pickle.dumps({"model": _Evil(os.system, f"touch {sentinel}")}, protocol=2))
    assert main(["convert", "mar", str(path), "-o", str(tmp_path / "o.safetensors"), "--quiet"]) == 2
    assert "not on marcache's allowlist" in capsys.readouterr().err
    assert not sentinel.exists()


def test_truncated_zip_is_reported(tmp_path):
    data = open(fx("tiny_mar.pth"), "rb").read()
    for cut in (len(data) // 2, len(data) - 10):
        path = tmp_path / f"cut{cut}.pth"
        path.write_bytes(data[:cut])
        with pytest.raises(conv.CheckpointError, match="not a readable zip archive.*truncated"):
            conv.read_checkpoint(path)


def test_zip_without_data_pkl_is_reported(tmp_path):
    path = tmp_path / "nopkl.pth"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data/0", b"\0" * 16)
        z.writestr("archive/version", "3\n")
    with pytest.raises(conv.CheckpointError, match="has no data.pkl record.*not a torch.save checkpoint"):
        conv.read_checkpoint(path)


def test_missing_storage_record_is_reported(tmp_path):
    path = tmp_path / "nostorage.pth"
    with zipfile.ZipFile(fx("tiny_mar.pth")) as src, zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            if info.filename != "tiny_mar/data/7":
                dst.writestr(info, src.read(info))
    with pytest.raises(conv.CheckpointError, match=r"storage '7' has no record 'tiny_mar/data/7'"):
        conv.read_checkpoint(path)


def test_corrupted_storage_fails_its_crc(tmp_path):
    data = bytearray(open(fx("tiny_mar.pth"), "rb").read())
    with conv.read_checkpoint(fx("tiny_mar.pth")) as ck:
        t = ck["model_ema"]["class_emb.weight"]
        ck._locate(t.storage)
        data[t.storage.file_offset + 3] ^= 0x40
    path = tmp_path / "flipped.pth"
    path.write_bytes(bytes(data))
    with conv.read_checkpoint(path) as ck:
        with pytest.raises(conv.CheckpointError, match="fails its CRC-32 check"):
            ck["model_ema"]["class_emb.weight"].numpy()


def test_truncated_legacy_file_is_reported(tmp_path):
    data = open(fx("mixed_legacy.pth"), "rb").read()
    path = tmp_path / "cut_legacy.pth"
    path.write_bytes(data[:-40])
    with pytest.raises(conv.CheckpointError, match="truncated"):
        conv.read_checkpoint(path)
    path.write_bytes(data[:200])
    with pytest.raises(conv.CheckpointError, match="truncated or damaged"):
        conv.read_checkpoint(path)


def test_tensor_beyond_its_storage_is_reported(tmp_path):
    # _rebuild_tensor_v2(storage '0' of 4 floats, offset 2, size (5,), stride (1,), False, OrderedDict()),
    # written opcode by opcode (torch.save would never produce it).
    buf = io.BytesIO()
    buf.write(b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(")
    buf.write(b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x04tQ")
    buf.write(b"K\x02K\x05\x85K\x01\x85\x89ccollections\nOrderedDict\n)RtR.")
    path = tmp_path / "overrun.pth"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("a/data.pkl", buf.getvalue())
        z.writestr("a/data/0", np.arange(4, dtype=np.float32).tobytes())
    with pytest.raises(conv.CheckpointError, match=r"reaches element 6 of storage '0', which holds 4 elements"):
        conv.read_checkpoint(path)


def test_not_a_checkpoint(tmp_path, mar_fp32):
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"hello world" * 10)
    with pytest.raises(conv.CheckpointError, match="not a PyTorch checkpoint"):
        conv.read_checkpoint(junk)
    with pytest.raises(conv.CheckpointError, match="not a PyTorch checkpoint"):
        conv.read_checkpoint(mar_fp32[0])                    # a safetensors file
    with pytest.raises(FileNotFoundError):
        conv.read_checkpoint(tmp_path / "missing.pth")


# ======================================================================
# Writer details and the command line
# ======================================================================

def test_writer_orders_by_alignment_then_name(tmp_path):
    path = tmp_path / "w.safetensors"
    arrays = {"b": np.arange(3, dtype=np.int8), "a": np.ones((2, 2), np.float32), "c": np.arange(2, dtype=np.int64),
              "d": np.zeros(0, np.float32), "e": np.float32(2.0) * np.ones((), np.float32)}
    conv.write_safetensors(path, arrays, {"kind": "test"}, dtype="F16")
    _, header = read_header(path)
    order = sorted((v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0], k)
                   for k, v in header.items() if k != "__metadata__")
    assert [k for _, size, k in order if size] == ["c", "a", "e", "b"]
    assert header["a"]["dtype"] == "F16" and header["c"]["dtype"] == "I64" and header["b"]["dtype"] == "I8"
    st = load_file(str(path))
    np.testing.assert_array_equal(st["c"], [0, 1])
    assert st["d"].shape == (0,) and st["e"].shape == () and st["e"] == 2.0


def test_bf16_rounding_edge_cases():
    values = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 3.4e38, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1e-40],
                      np.float32)
    got = conv.f32_to_bf16_bits(values)
    np.testing.assert_array_equal(got, [0x7F80, 0xFF80, 0x7FC0, 0, 0x8000, 0x7F80, 0x3F80, 0x3F82, 0x0001])


def test_cli_convert_and_help(tmp_path, capsys):
    from marcache.__main__ import main

    dst = tmp_path / "cli.safetensors"
    assert main(["convert", "mar", fx("tiny_mar.pth"), "-o", str(dst), "--heads", "2", "--dtype", "bf16",
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "wrote" in out and "84 tensors" in out and "as bf16" in out
    assert _C.safetensors_info(str(dst))[1]["dtype"] == "bf16"
    assert main(["convert", "mar", fx("tiny_mar.pth"), "-o", str(dst), "--quiet"]) == 2
    assert "--heads" in capsys.readouterr().err
    help_text = subprocess.run([sys.executable, "-m", "marcache", "convert", "--help"], capture_output=True,
                               text=True, cwd=FIXTURES, env=subprocess_env()).stdout
    for word in ("mar", "vae-kl16", "var", "vqvae", "inception", "checkpoint-last.pth", "kl16.ckpt",
                 "var_d16.pth", "var_d30.pth", "vae_ch160v4096z32.pth", "pt_inception-2015-12-05-6726825d.pth",
                 "--dtype", "--weights"):
        assert word in help_text, word


def test_progress_counter_without_tqdm(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    conv.convert("var", fx("tiny_var.pth"), tmp_path / "v.safetensors", progress=True)
    err = capsys.readouterr().err
    assert "sha256:" in err and "writing:" in err and "100.0%" in err

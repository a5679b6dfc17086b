"""What `convert` says when the file is not the kind asked for (issue 17, point 5).

A newcomer who runs `convert vae-kl16` on a MAR checkpoint (or any kind on
another kind's file) must read which keys the file holds and which kind it
looks like, with the command to use. The sources are the real torch.save
fixtures of tests/fixtures (make_torch_fixtures.py); the key names expected in
the messages come from the .npz files that script wrote beside them (the order
torch saved), not from the converter.
"""
import lzma
import os
import re

import numpy as np
import pytest

from marcache import convert as conv

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")

# kind -> (fixture, the entry holding its state dict or None for a flat file,
#          the .npz of the values torch saved and the prefix of its state dict there)
SOURCES = {
    "mar": ("tiny_mar.pth", "model", "tiny_mar.npz", "model/"),
    "vae-kl16": ("tiny_kl16.ckpt", "model", "tiny_kl16.npz", ""),
    "var": ("tiny_var.pth", None, "tiny_var.npz", ""),
    "vqvae": ("tiny_vqvae.pth", None, "tiny_vqvae.npz", ""),
}
# How the messages name each kind (the names of the README's kinds table).
NAMES = {"mar": "MAR", "vae-kl16": "KL-16 VAE", "var": "VAR", "vqvae": "VQVAE", "inception": "FID Inception"}
# The first keys of torchvision's Inception3 state dict (BasicConv2d = conv + BatchNorm2d,
# whose state_dict order is weight, bias, running_mean, running_var, num_batches_tracked).
INCEPTION_FIRST_KEYS = ["Conv2d_1a_3x3.conv.weight", "Conv2d_1a_3x3.bn.weight", "Conv2d_1a_3x3.bn.bias",
                        "Conv2d_1a_3x3.bn.running_mean", "Conv2d_1a_3x3.bn.running_var",
                        "Conv2d_1a_3x3.bn.num_batches_tracked"]
INCEPTION_KEY_COUNT = 566     # 94 BasicConv2d x 6 + fc.weight + fc.bias


def fx(name):
    return os.path.join(FIXTURES, name)


def torch_keys(kind):
    """The state dict's keys of a fixture, in the order torch saved them."""
    _, _, npz, prefix = SOURCES[kind]
    with np.load(fx(npz)) as data:
        return [k[len(prefix):].removesuffix("@bf16") for k in data.files if k.startswith(prefix)]


@pytest.fixture(scope="module")
def inception_pth(tmp_path_factory):
    path = tmp_path_factory.mktemp("inception") / "pt_inception-layout.pth"
    with lzma.open(fx("inception_layout_legacy.pth.xz")) as f, open(path, "wb") as out:
        out.write(f.read())
    return str(path)


def refusal(kind, src, tmp_path):
    dst = tmp_path / "out.safetensors"
    with pytest.raises(conv.CheckpointError) as err:
        conv.convert(kind, src, dst)
    assert not dst.exists() and not os.path.exists(str(dst) + ".partial")
    return str(err.value)


def test_vae_kl16_on_a_mar_checkpoint_names_the_keys_and_says_use_convert_mar(tmp_path, capsys):
    from marcache.__main__ import main

    keys = torch_keys("mar")
    assert main(["convert", "vae-kl16", fx("tiny_mar.pth"), "-o", str(tmp_path / "o.safetensors"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "not a KL-16 VAE checkpoint" in err
    assert f"its {len(keys)} keys under ['model'] begin {', '.join(keys[:6])}, ..." in err
    assert "It looks like a 'mar' checkpoint: use `convert mar`." in err
    assert "keys begin ...)" not in err          # the message of the issue: no keys named
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("asked,actual", [(asked, actual) for asked in ("vae-kl16", "var", "vqvae", "inception")
                                           for actual in SOURCES if actual != asked])
def test_every_other_kinds_file_is_named_with_its_kind(asked, actual, tmp_path):
    src, where, _, _ = SOURCES[actual]
    msg = refusal(asked, fx(src), tmp_path)
    keys = torch_keys(actual)
    inside = f" under ['{where}']" if where else ""
    assert f"not a {NAMES[asked]} checkpoint (its {len(keys)} keys{inside} begin {', '.join(keys[:6])}, ...)" in msg
    assert msg.endswith(f"It looks like a '{actual}' checkpoint: use `convert {actual}`."), msg
    # a VQVAE's decoder has up-path attention: it must not be taken for LDM kl-f16 weights
    assert "LDM" not in msg


@pytest.mark.parametrize("asked", ["vae-kl16", "var", "vqvae"])
def test_an_inception_file_is_named_as_such(asked, inception_pth, tmp_path):
    msg = refusal(asked, inception_pth, tmp_path)
    assert (f"not a {NAMES[asked]} checkpoint (its {INCEPTION_KEY_COUNT} keys begin "
            f"{', '.join(INCEPTION_FIRST_KEYS)}, ...)") in msg
    assert msg.endswith("It looks like a 'inception' checkpoint: use `convert inception`."), msg


@pytest.mark.parametrize("actual", ["vae-kl16", "var", "vqvae"])
def test_mar_on_another_kinds_file_names_that_kind(actual, tmp_path):
    msg = refusal("mar", fx(SOURCES[actual][0]), tmp_path)
    assert msg.endswith(f"It looks like a '{actual}' checkpoint: use `convert {actual}`."), msg


class FakeTensor:
    """What a plan reads of a tensor: its shape and safetensors dtype."""

    def __init__(self, shape, dtype="F32"):
        self.shape = tuple(shape)
        self.dtype = dtype


def fake_ck(root, path="fake.pth"):
    return type("FakeCheckpoint", (), {"path": path, "root": root})()


@pytest.mark.parametrize("kind", ["vae-kl16", "var", "vqvae", "inception"])
def test_keys_of_no_known_kind_are_listed_and_said_to_match_none(kind):
    sd = {"backbone.weight": FakeTensor((4, 4)), "backbone.bias": FakeTensor((4,)), "head.scale": FakeTensor((1,))}
    with pytest.raises(conv.CheckpointError) as err:
        conv.plan(kind, fake_ck({"state_dict": sd}))
    msg = str(err.value)
    assert f"fake.pth: not a {NAMES[kind]} checkpoint (its keys under ['state_dict'] are backbone.weight, " \
           "backbone.bias, head.scale)." in msg
    assert re.search(r"match none of the kinds marcache converts \(mar, vae-kl16, var, vqvae, inception\)", msg)
    assert "looks like" not in msg


def test_an_empty_state_dict_is_said_to_hold_no_tensors():
    with pytest.raises(conv.CheckpointError) as err:
        conv.plan("vae-kl16", fake_ck({"model": {}}))
    assert str(err.value) == "fake.pth: not a KL-16 VAE checkpoint (it holds no tensors under ['model'])."


def test_a_vqvae_without_its_decoder_is_called_incomplete():
    sd = {"quantize.embedding.weight": FakeTensor((16, 4)), "quantize.ema_vocab_hit_SV": FakeTensor((10, 16))}
    with pytest.raises(conv.CheckpointError) as err:
        conv.plan("vqvae", fake_ck(sd))
    assert str(err.value) == ("fake.pth: not a VQVAE checkpoint (its keys are quantize.embedding.weight, "
                              "quantize.ema_vocab_hit_SV). It has keys that only a VQVAE checkpoint has, but not "
                              "the ones its configuration is read from: an incomplete or damaged file?")

"""The C FID-Inception network (csrc/models/inception.c) against the float64
NumPy reference (tests/reference/inception.py) on random weights in the
exact pytorch-fid key layout; the loader's checks; chunking and odd sizes.

Random weights stand in for pt_inception-2015-12-05-6726825d.pth (its
converter is another issue): what is tested is that the engine computes the
network of the layout, not the trained features."""
import numpy as np
import pytest
from safetensors.numpy import save_file

import marcache  # noqa: F401  (loads OpenBLAS before _C)
from marcache import _C
from interrupt import call_with_sigint_pending, gil_released_during
from reference import inception as RI


def rel(got, want):
    want = np.asarray(want, np.float64)
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """Full-width random FID-Inception (23.9M parameters, ~95 MB file)."""
    w = RI.random_weights(np.random.default_rng(1))
    path = tmp_path_factory.mktemp("inception") / "fid_inception_random.safetensors"
    save_file(w, str(path))
    return w, path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Same topology, every width / 16: a fast network for everything but the full-size match."""
    w = RI.random_weights(np.random.default_rng(2), divisor=16, num_classes=10)
    path = tmp_path_factory.mktemp("inception") / "tiny_inception.safetensors"
    save_file(w, str(path))
    return w, path


def test_key_layout_is_pytorch_fid_state_dict(full):
    w, path = full
    keys = RI.state_dict_keys(num_batches_tracked=True)
    assert set(w) == set(keys) and len(keys) == 94 * 6 + 2
    assert "Conv2d_1a_3x3.conv.weight" in keys and "Mixed_7c.branch3x3dbl_3b.bn.running_var" in keys
    assert w["Mixed_7c.branch_pool.conv.weight"].shape == (192, 2048, 1, 1)
    assert w["fc.weight"].shape == (1008, 2048)
    net = _C.Inception(str(path))
    assert (net.feature_dim, net.num_classes, net.standard) == (2048, 1008, True)
    assert net.num_params == sum(v.size for k, v in w.items() if not k.endswith("num_batches_tracked"))
    # 5.71 G multiply-adds per image at 299 x 299 (convolutions + fc)
    assert net.flops_per_image / 2e9 == pytest.approx(5.713, abs=0.01)


@pytest.mark.parametrize("side,batch", [(299, 1), (256, 2)])
def test_full_network_matches_float64_reference(full, side, batch):
    w, path = full
    images = np.random.default_rng(side).integers(0, 256, (batch, side, side, 3), dtype=np.uint8)
    net = _C.Inception(str(path), chunk=2)
    pool, logits = net.features(images)
    ref_pool, ref_logits = RI.forward(w, images)
    assert pool.shape == (batch, 2048) and logits.shape == (batch, 1008)
    assert pool.dtype == np.float32 and logits.dtype == np.float32
    assert rel(pool, ref_pool) <= 1e-4
    assert rel(logits, ref_logits) <= 1e-4


@pytest.mark.parametrize("shape", [(3, 1, 1), (2, 31, 45), (1, 400, 333), (4, 64, 64)])
def test_any_input_size(tiny, shape):
    w, path = tiny
    n, h, wd = shape
    images = np.random.default_rng(h * wd).integers(0, 256, (n, h, wd, 3), dtype=np.uint8)
    pool, logits = _C.Inception(str(path), chunk=3).features(images)
    ref_pool, ref_logits = RI.forward(w, images)
    assert rel(pool, ref_pool) <= 1e-4 and rel(logits, ref_logits) <= 1e-4


def test_chunking_does_not_change_results(tiny):
    _, path = tiny
    images = np.random.default_rng(5).integers(0, 256, (7, 48, 40, 3), dtype=np.uint8)
    one = _C.Inception(str(path), chunk=1).features(images)
    three = _C.Inception(str(path), chunk=3)
    a, b = three.features(images), three.features(images[::-1].copy())
    for got in (a, (b[0][::-1], b[1][::-1])):
        assert rel(got[0], one[0]) <= 1e-5 and rel(got[1], one[1]) <= 1e-5
    empty = three.features(np.zeros((0, 8, 8, 3), np.uint8))
    assert empty[0].shape == (0, three.feature_dim) and empty[1].shape == (0, three.num_classes)


def test_loads_without_num_batches_tracked_and_from_float16(tiny, tmp_path):
    w, _ = tiny
    images = np.random.default_rng(6).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    stripped = {k: v for k, v in w.items() if not k.endswith("num_batches_tracked")}
    save_file(stripped, str(tmp_path / "a.safetensors"))
    save_file({k: v.astype(np.float16) for k, v in stripped.items()}, str(tmp_path / "h.safetensors"))
    ref_pool, _ = RI.forward(w, images)
    assert rel(_C.Inception(str(tmp_path / "a.safetensors")).features(images)[0], ref_pool) <= 1e-4
    half = {k: v.astype(np.float16).astype(np.float32) for k, v in stripped.items()}
    ref_half, _ = RI.forward(half, images)
    assert rel(_C.Inception(str(tmp_path / "h.safetensors")).features(images)[0], ref_half) <= 1e-4


def _write(tmp_path, weights, name="bad.safetensors"):
    path = tmp_path / name
    save_file(weights, str(path))
    return str(path)


def test_loader_errors_name_the_key(tiny, tmp_path):
    w, _ = tiny
    missing = dict(w)
    del missing["Mixed_6c.branch7x7dbl_3.bn.running_mean"]
    with pytest.raises(KeyError, match="Mixed_6c.branch7x7dbl_3.bn.running_mean"):
        _C.Inception(_write(tmp_path, missing))

    wrong = dict(w)
    wrong["Mixed_6b.branch7x7_2.conv.weight"] = np.zeros((8, 8, 7, 1), np.float32)  # 7x1, not 1x7
    with pytest.raises(ValueError, match=r"Mixed_6b.branch7x7_2.conv.weight' has shape \[8, 8, 7, 1\]"):
        _C.Inception(_write(tmp_path, wrong))

    extra = dict(w, **{"AuxLogits.fc.weight": np.zeros((10, 48), np.float32)})
    with pytest.raises(ValueError, match="unexpected tensor 'AuxLogits.fc.weight'"):
        _C.Inception(_write(tmp_path, extra))

    negative = dict(w)
    var = w["Mixed_5b.branch1x1.bn.running_var"].copy()
    var[1] = -1.0
    negative["Mixed_5b.branch1x1.bn.running_var"] = var
    with pytest.raises(ValueError, match="Mixed_5b.branch1x1.bn.running_var' has entry 1"):
        _C.Inception(_write(tmp_path, negative))

    with pytest.raises(ValueError, match="not an FID-Inception checkpoint"):
        _C.Inception(_write(tmp_path, {"decoder.conv_in.weight": np.zeros((1,), np.float32)}))
    with pytest.raises(FileNotFoundError):
        _C.Inception(str(tmp_path / "nope.safetensors"))


def test_bad_images_are_refused(tiny):
    net = _C.Inception(str(tiny[1]))
    with pytest.raises(ValueError, match="uint8"):
        net.features(np.zeros((1, 8, 8, 3), np.float32))
    with pytest.raises(ValueError, match=r"\[n, height, width, 3\]"):
        net.features(np.zeros((1, 8, 8, 4), np.uint8))
    with pytest.raises(ValueError, match=r"\[n, height, width, 3\]"):
        net.features(np.zeros((8, 8, 3), np.uint8))
    with pytest.raises(ValueError, match="chunk"):
        _C.Inception(str(tiny[1]), chunk=0)


def test_ctrl_c_interrupts_and_network_stays_usable(full):
    """SIGINT pending when features() starts is turned into KeyboardInterrupt by the
    network's own check between chunks (interrupt.call_with_sigint_pending: nothing else
    can handle it first); the network works afterwards, with the same features."""
    net = _C.Inception(str(full[1]), chunk=1)
    images = np.random.default_rng(3).integers(0, 256, (4, 64, 64, 3), dtype=np.uint8)
    before = net.features(images[:1])
    assert call_with_sigint_pending(net.features, images), "features returned instead of raising"
    after = net.features(images[:1])
    assert np.array_equal(after[0], before[0]) and np.array_equal(after[1], before[1])


def test_gil_is_released_during_features(full):
    """One observation by another thread while features() runs proves the GIL is released
    (interrupt.gil_released_during: no rate is asserted)."""
    net = _C.Inception(str(full[1]), chunk=2)
    images = np.zeros((4, 64, 64, 3), np.uint8)
    assert gil_released_during(lambda: net.features(images)), "no other thread ran while features() was running"

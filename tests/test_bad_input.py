"""Bad input gets a clear exception naming the problem, and the process and
the model stay healthy afterwards."""
import os
import signal
import threading
import time

import numpy as np
import pytest
from safetensors.numpy import save_file

import marcache as mc
from marcache import _C
from mar_fixtures import write_tiny_mar


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad") / "tiny.safetensors"
    write_tiny_mar(path)
    return path


@pytest.fixture(scope="module")
def model(tiny_path):
    return mc.load(tiny_path)


def test_missing_file():
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        mc.load("/nonexistent/nope.safetensors")


def test_missing_vae_file(tiny_path):
    with pytest.raises(FileNotFoundError, match="VAE"):
        mc.load(tiny_path, vae="/nonexistent/vae.safetensors")


def test_truncated_file(tiny_path, tmp_path):
    data = open(tiny_path, "rb").read()
    bad = tmp_path / "truncated.safetensors"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated.safetensors"):
        mc.load(bad)


def test_lying_header(tmp_path):
    bad = tmp_path / "lying.safetensors"
    header = b'{"fake_latent":{"dtype":"F32","shape":[1,32],"data_offsets":[0,4096]}}'
    bad.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 128)
    with pytest.raises(ValueError, match="lying.safetensors"):
        mc.load(bad)


def test_vae_file_passed_as_mar(tmp_path):
    path = tmp_path / "vae.safetensors"
    save_file({"decoder.conv_in.weight": np.zeros((512, 16, 3, 3), np.float32)}, str(path))
    with pytest.raises(ValueError, match="KL-16 VAE file, not a MAR model"):
        mc.load(path)


def test_var_file_passed_as_mar(tmp_path):
    path = tmp_path / "var.safetensors"
    save_file({"word_embed.weight": np.zeros((1024, 32), np.float32),
               "class_emb.weight": np.zeros((1001, 1024), np.float32)}, str(path))
    with pytest.raises(ValueError, match="VAR checkpoint"):
        mc.load(path)


def test_missing_key_is_named(tmp_path):
    W = write_tiny_mar(tmp_path / "full.safetensors")
    del W["decoder_blocks.1.mlp.fc2.bias"]
    path = tmp_path / "missing.safetensors"
    save_file(dict(W), str(path), metadata={"heads": "2"})
    with pytest.raises(KeyError, match=r"decoder_blocks\.1\.mlp\.fc2\.bias.*\[32\]"):
        mc.load(path)


def test_misshapen_key_names_both_shapes(tmp_path):
    W = write_tiny_mar(tmp_path / "full.safetensors")
    W["encoder_blocks.0.attn.qkv.weight"] = np.zeros((96, 31), np.float32)
    path = tmp_path / "shape.safetensors"
    save_file(dict(W), str(path), metadata={"heads": "2"})
    with pytest.raises(ValueError, match=r"encoder_blocks\.0\.attn\.qkv\.weight.*\[96, 31\].*\[96, 32\]"):
        mc.load(path)


def test_unknown_width_needs_heads(tmp_path):
    path = tmp_path / "noheads.safetensors"
    write_tiny_mar(path, metadata_heads=False)
    with pytest.raises(ValueError, match="heads"):
        mc.load(path)
    assert mc.load(path, heads=2).config["heads"] == 2


@pytest.mark.parametrize("kwargs,match", [
    (dict(labels=[1000]), "label 1000 at index 0 is outside 0..999"),
    (dict(labels=[3, -1]), "label -1 at index 1"),
    (dict(labels=[]), "labels is empty"),
    (dict(labels=[1.5]), "integers"),
    (dict(labels=[1], steps=0), "steps must be an integer >= 1"),
    (dict(labels=[1], temperature=0.0), "temperature must be > 0"),
    (dict(labels=[1], temperature=-1.0), "temperature must be > 0"),
    (dict(labels=[1], cfg=-0.5), "cfg must be a finite number >= 0"),
    (dict(labels=[1], cfg=float("nan")), "cfg must be a finite number >= 0"),
    (dict(labels=[1], cfg_schedule="cosine"), "cfg_schedule must be 'linear' or 'constant'"),
    (dict(labels=[1], seed=-1), "seed must be an integer"),
    (dict(labels=None), "num_images"),
])
def test_bad_generate_arguments(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        model.generate_tokens(**kwargs)


def test_bad_load_arguments(tiny_path):
    with pytest.raises(ValueError, match="device must be"):
        mc.load(tiny_path, device="tpu")
    if "cuda" not in _C.backends():
        with pytest.raises(ValueError, match="no CUDA backend|no CUDA device"):
            mc.load(tiny_path, device="cuda")
    with pytest.raises(ValueError, match="dtype must be"):
        mc.load(tiny_path, dtype="int8")
    with pytest.raises(ValueError, match="device must be"):
        mc.load(tiny_path, device="cuda:one")
    with pytest.raises(ValueError, match="diffusion_steps"):
        mc.load(tiny_path, diffusion_steps=0)


def test_generate_without_vae_says_how(model):
    with pytest.raises(ValueError, match="without a VAE"):
        model.generate(labels=[1], steps=1)


def test_model_healthy_after_errors(model):
    for _ in range(3):
        with pytest.raises(ValueError):
            model.generate_tokens(labels=[5000])
    out = model.generate_tokens(labels=[1], steps=2, seed=3)
    again = model.generate_tokens(labels=[1], steps=2, seed=3)
    assert np.array_equal(out, again)


def test_ctrl_c_interrupts_within_one_step_and_model_stays_usable(model):
    reference = model.generate_tokens(labels=[4], steps=3, seed=5)
    steps_seen = []

    def fire():
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Thread(target=fire)
    timer.start()
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        model._mar.generate(np.array([4], np.int32), steps=256, cfg=1.0, seed=5,
                            callback=lambda info: steps_seen.append(time.perf_counter()))
    timer.join()
    elapsed = time.perf_counter() - t0
    assert 0 < len(steps_seen) < 256
    assert elapsed < 0.3 + 5.0
    assert np.array_equal(model.generate_tokens(labels=[4], steps=3, seed=5), reference)


def test_gil_is_released_during_generate(model):
    ticks = []
    stop = threading.Event()

    def count():
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0.001)

    th = threading.Thread(target=count)
    th.start()
    t0 = time.perf_counter()
    model.generate_tokens(labels=[1, 2], steps=8, cfg=2.0, seed=0)
    elapsed = time.perf_counter() - t0
    stop.set()
    th.join()
    # a thread sleeping 1 ms per tick gets many ticks only if the GIL was free
    assert len(ticks) > 0.2 * elapsed / 0.001


def test_concurrent_use_of_one_model_is_refused_not_corrupted(model):
    errors = []

    def run():
        try:
            model.generate_tokens(labels=[1], steps=16, seed=0)
        except RuntimeError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all("already running" in e for e in errors)


def test_device_resolution(tiny_path, monkeypatch):
    """'auto' picks CUDA device 0 exactly when a usable CUDA backend is listed; an index past
    the devices found is refused with the count; the C layer refuses bad strings itself."""
    import marcache.model as model_module

    monkeypatch.setattr(model_module._C, "backends", lambda: ["cpu"])
    assert model_module._resolve_device("auto") == "cpu"
    monkeypatch.setattr(model_module._C, "backends", lambda: ["cpu", "cuda"])
    assert model_module._resolve_device("auto") == "cuda:0"
    monkeypatch.setattr(model_module._C, "build_info", lambda: {"cuda": True, "cuda_devices": 1})
    assert model_module._resolve_device("cuda") == "cuda:0"
    with pytest.raises(ValueError, match="1 CUDA device found"):
        model_module._resolve_device("cuda:1")
    monkeypatch.undo()
    for device, match in [("tpu", "device must be"), ("cuda:-1", "device must be"), ("cuda:x", "device must be"),
                          ("cuda:7", "CUDA")]:
        with pytest.raises(ValueError, match=match):
            _C.MAR(str(tiny_path), device=device)
    with pytest.raises(ValueError, match="dtype must be"):
        _C.MAR(str(tiny_path), dtype="fp8")
    with pytest.raises(ValueError, match="device must be|CUDA"):
        _C.VAE(str(tiny_path), device="cuda:9")

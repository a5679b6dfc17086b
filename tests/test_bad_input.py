"""Bad input gets a clear exception naming the problem, and the process and
the model stay healthy afterwards."""
import functools
import os
import signal
import threading
import time

import numpy as np
import pytest
from safetensors.numpy import save_file

import marcache as mc
from marcache import _C
from interrupt import call_with_sigint_pending, gil_released_during
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


def test_incomplete_var_file_is_reported_by_the_var_loader(tmp_path):
    """word_embed.weight makes marcache.load take the file for a VAR (no kind metadata); the
    VAR loader then names what the file lacks."""
    path = tmp_path / "var.safetensors"
    save_file({"word_embed.weight": np.zeros((1024, 32), np.float32),
               "class_emb.weight": np.zeros((1001, 1024), np.float32)}, str(path))
    with pytest.raises(ValueError, match="not a VAR checkpoint: .*'lvl_embed.weight'"):
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
    (dict(labels=[1], steps=0), r"steps must be an integer in 1\.\.2\*\*31-1"),
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


@pytest.mark.parametrize("stop_step", [0, 2, 5])
def test_ctrl_c_from_the_step_callback_stops_at_that_step(model, stop_step):
    """SIGINT raised in the step callback of step k ends generate with KeyboardInterrupt
    before step k + 1 runs; the model stays usable and gives the same tokens afterwards."""
    labels = np.array([4], np.int32)
    reference, _ = model._mar.generate(labels, steps=8, cfg=1.0, seed=5)
    steps_seen = []

    def on_step(info):
        steps_seen.append(info["step"])
        if info["step"] == stop_step:
            signal.raise_signal(signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        model._mar.generate(labels, steps=8, cfg=1.0, seed=5, callback=on_step)
    assert steps_seen == list(range(stop_step + 1))
    again, _ = model._mar.generate(labels, steps=8, cfg=1.0, seed=5)
    assert np.array_equal(again, reference)


def test_ctrl_c_pending_is_caught_by_the_loop_after_the_first_step(model):
    """With SIGINT pending when generate starts and a callback that cannot handle signals
    (list.append, a C function), it is the AR loop's own signal check after step 0 that
    raises: exactly one step ran."""
    labels = np.array([4], np.int32)
    reference, _ = model._mar.generate(labels, steps=8, cfg=1.0, seed=5)
    steps_seen = []
    call = functools.partial(model._mar.generate, labels, steps=8, cfg=1.0, seed=5, callback=steps_seen.append)
    assert call_with_sigint_pending(call), "generate returned instead of raising KeyboardInterrupt"
    assert [s["step"] for s in steps_seen] == [0]
    assert np.array_equal(model._mar.generate(labels, steps=8, cfg=1.0, seed=5)[0], reference)


def test_ctrl_c_from_another_thread_end_to_end(model):
    """The user's case: SIGINT sent by os.kill from another thread while generate runs. The
    killer thread starts at step 0; the callback of step 254 waits (up to 60 s) until the
    kill has been sent, so the signal always arrives before the run could end, however
    loaded the machine. The only time bound is the generous 60 s."""
    reference = model.generate_tokens(labels=[4], steps=3, seed=5)
    started, sent = threading.Event(), threading.Event()
    steps_seen = []

    def kill_when_started():
        if started.wait(60):
            os.kill(os.getpid(), signal.SIGINT)
            sent.set()

    def on_step(info):
        steps_seen.append(info["step"])
        started.set()
        if info["step"] == 254:
            sent.wait(60)

    killer = threading.Thread(target=kill_when_started)
    killer.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(KeyboardInterrupt):
            model._mar.generate(np.array([4], np.int32), steps=256, cfg=1.0, seed=5, callback=on_step)
    finally:
        started.set()
        killer.join()
    elapsed = time.perf_counter() - t0
    assert sent.is_set()
    assert 1 <= len(steps_seen) <= 255
    assert elapsed < 60.0
    assert np.array_equal(model.generate_tokens(labels=[4], steps=3, seed=5), reference)


def test_gil_is_released_during_generate(model):
    """One observation by another thread while generate_tokens runs proves the GIL is
    released (interrupt.gil_released_during: no rate or tick count is asserted)."""
    assert gil_released_during(lambda: model.generate_tokens(labels=[1, 2], steps=8, cfg=2.0, seed=0)), \
        "no other thread ran while generate_tokens was running"


def _run_in_thread(target):
    """A started thread running target(); its exception (if any) is kept in .error for the
    main thread to re-raise."""
    def body():
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            thread.error = exc

    thread = threading.Thread(target=body)
    thread.error = None
    thread.start()
    return thread


def test_concurrent_use_of_one_model_is_refused_not_corrupted(model):
    """Two calls that really overlap: the first holds the model inside its step-0 callback
    until the second has been tried (a barrier marks that the first is running). Exactly
    one is refused with RuntimeError, and the other's tokens equal a solo run bitwise."""
    labels = np.array([1], np.int32)
    solo, _ = model._mar.generate(labels, steps=4, cfg=2.0, seed=0)
    first_is_running = threading.Barrier(2, timeout=60)
    second_tried = threading.Event()
    outcomes = {}

    def first():
        def on_step(info):
            if info["step"] == 0:
                first_is_running.wait()
                assert second_tried.wait(60), "the second call never returned"
        outcomes["first"], _ = model._mar.generate(labels, steps=4, cfg=2.0, seed=0, callback=on_step)

    def second():
        first_is_running.wait()
        try:
            outcomes["second"], _ = model._mar.generate(labels, steps=4, cfg=2.0, seed=0)
        except RuntimeError as exc:
            outcomes["second_refused"] = str(exc)
        finally:
            second_tried.set()

    threads = [_run_in_thread(first), _run_in_thread(second)]
    for thread in threads:
        thread.join()
    for thread in threads:
        if thread.error is not None:
            raise thread.error
    assert sorted(outcomes) == ["first", "second_refused"], outcomes
    assert "already running" in outcomes["second_refused"]
    assert np.array_equal(outcomes["first"], solo)
    assert np.array_equal(model._mar.generate(labels, steps=4, cfg=2.0, seed=0)[0], solo)


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

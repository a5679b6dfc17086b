"""The command line, the end-to-end generate() with a VAE, flops() against
telemetry, and the notebook-facing conveniences."""
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
from safetensors.numpy import save_file

import marcache as mc
from mar_fixtures import write_tiny_mar
from reference import vae as ref_vae


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    mar_path = d / "tiny_mar.safetensors"
    write_tiny_mar(mar_path)
    vae_path = d / "tiny_vae.safetensors"
    vae_w = ref_vae.random_vae_weights(np.random.default_rng(3), ch=32, ch_mult=(1, 2), num_res_blocks=1)
    save_file(dict(vae_w), str(vae_path))
    return mar_path, vae_path, vae_w


def run_cli(*args, timeout=300):
    """python -m marcache ARGS, importing the same marcache as this test."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(mc.__file__)))
    return subprocess.run([sys.executable, "-m", "marcache", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=os.path.dirname(os.path.abspath(__file__)))


def read_png_size(path):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    idat = data[data.index(b"IDAT") + 4:data.index(b"IEND") - 8]
    raw = zlib.decompress(idat)
    assert len(raw) == height * (1 + 3 * width)
    return width, height


def test_generate_images_end_to_end(files):
    mar_path, vae_path, vae_w = files
    model = mc.load(mar_path, vae=vae_path)
    images, info = model.generate(labels=[1, 2], steps=3, cfg=2.0, seed=4, return_info=True)
    assert images.dtype == np.uint8 and images.shape == (2, 32, 32, 3)
    expected = ref_vae.to_uint8(ref_vae.decode(vae_w, info.tokens))
    # float32 vs float64 decoding may flip a pixel that sits on a rounding boundary
    assert np.abs(images.astype(int) - expected.astype(int)).max() <= 1
    assert info.seconds_decode > 0 and len(info.steps) == 3


def test_flops_agree_with_telemetry(files):
    model = mc.load(files[0])
    for steps, cfg, batch in [(16, 1.0, 1), (16, 2.9, 3), (64, 2.9, 2), (300, 1.0, 1)]:
        _, info = model.generate_tokens(labels=list(range(batch)), steps=steps, cfg=cfg, return_info=True) \
            if steps <= 64 else (None, None)
        rep = mc.flops(model, steps=steps, cfg=cfg, batch=batch)
        if info is not None:
            assert [s["flops"] for s in info.steps] == pytest.approx(rep.per_step, rel=1e-12)
            assert info.flops == pytest.approx(rep.total, rel=1e-12)
        assert rep.total == pytest.approx(rep.encoder + rep.decoder + rep.head, rel=1e-12)


def test_flops_of_released_configs_match_spec():
    """mar.md 13.2: MAR-B with CFG at 64 steps; encoder and decoder exactly as the official code
    computes them (convention="reference"); the engine's decoder computes its last block's
    queries, attention, proj and MLP on the predicted rows alone; head with hoisting."""
    rep = mc.flops("mar_base", steps=64, cfg=2.9)
    ref = mc.flops("mar_base", steps=64, cfg=2.9, convention="reference")
    assert ref.encoder / 1e12 == pytest.approx(3.53, abs=0.01)
    assert ref.decoder / 1e12 == pytest.approx(7.46, abs=0.01)
    assert rep.encoder == ref.encoder
    # what the last block skips per unread row of each of the 2 sequences: q and proj
    # (2 x 2 Dd^2), attention over the 320 keys (4 x 320 Dd), fc1 and fc2 (4 Dd H)
    Dd, H, L = 768, 3072, 320
    predicted = [p for _, _, p in mc.schedule.plan(256, 64)]
    assert len(predicted) == 64 and sum(predicted) == 256
    skipped = sum(2 * (L - p) * (4 * Dd * Dd + 4 * L * Dd + 4 * Dd * H) for p in predicted)
    assert rep.decoder == ref.decoder - skipped
    # the spec's hoisted head: 64 W^2 + 96 W per row per step, times 256 tokens, 2 (CFG), 100 steps;
    # ours also skips input_proj on the dead CFG half and counts cond_embed once per AR step
    W, Dd = 1024, 768
    head = 256 * 100 * (2 * 64 * W * W + 2 * 64 * W + 16 * 2 * W) + 256 * 2 * 2 * Dd * W
    assert rep.head == pytest.approx(head, rel=1e-12)
    assert mc.flops("mar_base", steps=64, cfg=1.0).total == pytest.approx(rep.total / 2, rel=0.01)
    with pytest.raises(ValueError, match="unknown model"):
        mc.flops("mar_tiny")


def test_head_params_read_counts_the_head_weights_each_evaluation_streams():
    """FlopReport.head_params_read (issue 23: the head's bytes bound it at batch 1): MAR-B's
    cond_embed once per AR step and its per-evaluation Linear weights (input_proj, the res
    blocks' adaLN / mlp.0 / mlp.2, the final adaLN and linear; not the time embedding,
    hoisted at load) once per diffusion step, counted from the official tensor shapes,
    whatever the batch and CFG; fewer with LazyMAR's head cache (a reused block reads its
    gate rows only)."""
    from reference import mar as R

    shapes = R.official_shapes("mar_base")
    per_eval = sum(int(np.prod(s)) for k, s in shapes.items() if k.startswith("diffloss.net.")
                   and k.endswith(".weight") and len(s) == 2 and ".time_embed." not in k and ".cond_embed." not in k)
    cond = int(np.prod(shapes["diffloss.net.cond_embed.weight"]))
    assert per_eval == 33_603_584  # 134 MB of fp32 per diffusion step
    for cfg, batch in ((2.9, 1), (1.0, 8)):
        rep = mc.flops("mar_base", steps=64, cfg=cfg, batch=batch)
        assert rep.head_params_read == 64 * (cond + 100 * per_eval)
    assert mc.flops("mar_base", steps=8, cfg=2.9, diffusion_steps=50).head_params_read == 8 * (cond + 50 * per_eval)
    lazy = mc.flops("mar_base", steps=64, cfg=2.9, cache=mc.LazyMAR()).head_params_read
    assert 0 < lazy < 64 * (cond + 100 * per_eval)
    assert mc.flops("mar_base", steps=64, cfg=2.9, convention="reference").head_params_read == 0


def test_cli_generate_writes_png(files, tmp_path):
    mar_path, vae_path, _ = files
    out = tmp_path / "grid.png"
    proc = run_cli("generate", "--model", str(mar_path), "--vae", str(vae_path), "--labels", "207", "360",
                   "--steps", "2", "--cfg", "2.9", "--seed", "0", "--out", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout
    width, height = read_png_size(out)
    assert (width, height) == (2 * 32 + 3 * 2, 32 + 2 * 2)


def test_cli_reports_bad_input_cleanly(files, tmp_path):
    mar_path, vae_path, _ = files
    proc = run_cli("generate", "--model", str(mar_path), "--vae", str(vae_path), "--labels", "5000", "--out",
                   str(tmp_path / "x.png"))
    assert proc.returncode == 2
    assert "label 5000" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_info_and_flops():
    proc = run_cli("info", timeout=60)
    assert proc.returncode == 0 and "blas" in proc.stdout
    proc = run_cli("flops", "mar_base", "--steps", "64", "--cfg", "2.9", timeout=60)
    assert proc.returncode == 0 and "TFLOPs per image" in proc.stdout


def test_build_info_names_backends_and_blas():
    info = mc.build_info()
    assert info["backends"] == ",".join(mc._C.backends())  # "cpu,guard", and ",cuda" with a GPU
    assert "OpenBLAS" in info["blas_config"]
    assert "-fopenmp" in info["cflags"]


def test_cli_generate_device_and_dtype(files, tmp_path):
    """--device and --dtype reach the model (and the VAE): a bf16 grid on the guard device (the
    CPU kernels over unreadable-from-host memory) is byte for byte the CPU's bf16 grid, and a
    16-bit type changes the result."""
    mar_path, vae_path, _ = files
    outs = {}
    for device, dtype in (("cpu", "bf16"), ("guard", "bf16"), ("cpu", "fp32")):
        out = tmp_path / ("%s-%s.png" % (device, dtype))
        proc = run_cli("generate", "--model", str(mar_path), "--vae", str(vae_path), "--labels", "1", "2",
                       "--steps", "3", "--cfg", "2.0", "--device", device, "--dtype", dtype, "--quiet",
                       "--out", str(out))
        assert proc.returncode == 0, proc.stderr
        outs[device, dtype] = out.read_bytes()
    assert outs["guard", "bf16"] == outs["cpu", "bf16"]
    assert outs["cpu", "bf16"] != outs["cpu", "fp32"]
    proc = run_cli("generate", "--model", str(mar_path), "--vae", str(vae_path), "--labels", "1",
                   "--dtype", "int8", "--out", str(tmp_path / "x.png"))
    assert proc.returncode == 2 and "--dtype" in proc.stderr

"""The Python side of VAR (issue 15): marcache.load's dispatch of VAR files and their
VQVAE, VARModel's generate / generate_tokens / decode and their argument checks, the
per-scale telemetry against marcache.flops, batch and shard invariance, the guard
backend, the CLI and marcache.eval.sweep. Tiny models in the official key layouts
(tests/var_fixtures.py) written with the safetensors package."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

import marcache as mc
from marcache import var_family
from marcache.__main__ import main
from mar_fixtures import write_tiny_mar
from reference import inception as RI
from reference import vae as ref_vae
from var_api_files import TINY_VAR, write_tiny_var, write_tiny_vqvae, write_var_with_metadata
from readme_blocks import readme_sweep_example
from child_env import child_env

HERE = os.path.dirname(os.path.abspath(__file__))
README = os.path.join(os.path.dirname(HERE), "README.md")
L = sum(p * p for p in TINY_VAR["patch_nums"])   # 30 tokens
SIDE = TINY_VAR["patch_nums"][-1]                # f_hat 4 x 4
IMAGE = 2 * SIDE                                 # the VQVAE's ch_mult (1, 2): 8 x 8 px


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("var_api")
    out = dict(dir=d, var=d / "var.safetensors", vqvae=d / "vqvae.safetensors")
    write_tiny_var(out["var"])
    write_tiny_vqvae(out["vqvae"])
    # the same files without any metadata but patch_nums: recognised from their tensor names
    out["var_plain"] = d / "var_plain.safetensors"
    write_var_with_metadata(out["var_plain"], {"patch_nums": "1,2,3,4"})
    out["vqvae_plain"] = d / "vqvae_plain.safetensors"
    write_tiny_vqvae(out["vqvae_plain"], metadata=False)
    out["kl16_plain"] = d / "kl16_plain.safetensors"
    save_file(dict(ref_vae.random_vae_weights(np.random.default_rng(3), ch=32, ch_mult=(1, 2), num_res_blocks=1,
                                              z=8)), str(out["kl16_plain"]))
    out["mar_plain"] = d / "mar_plain.safetensors"
    write_tiny_mar(out["mar_plain"])
    out["vqvae_v16"] = d / "vqvae_v16.safetensors"      # codebook of 16, the VAR predicts 64
    write_tiny_vqvae(out["vqvae_v16"], vocab=16)
    out["vqvae_z4"] = d / "vqvae_z4.safetensors"        # latent of 4 channels, word_embed takes 8
    write_tiny_vqvae(out["vqvae_z4"], z=4)
    return out


@pytest.fixture(scope="module")
def model(files):
    return mc.load(files["var"], vae=files["vqvae"])


# ======================================================================
# load: the kind of each file, and a VQVAE that fits the VAR
# ======================================================================

def test_load_refuses_a_vqvae_as_the_model(files):
    with pytest.raises(ValueError, match=r"model .*vqvae_plain\.safetensors is VAR's VQVAE decoder file \(recognised "
                                         r"from its tensor names\), not a MAR model or a VAR transformer: pass it as "
                                         r"vae=.* together with a VAR model file"):
        mc.load(files["vqvae_plain"])
    with pytest.raises(ValueError, match=r"metadata kind='vqvae'"):
        mc.load(files["vqvae"])


# Every vae= file a VAR refuses, with its message: decoders of another kind (told from the
# tensor names) and VQVAEs whose codebook does not fit the VAR.
WRONG_VAR_DECODERS = {
    "kl16_plain": r"vae= .*kl16_plain\.safetensors is a KL-16 VAE decoder file \(recognised from its tensor "
                  r"names\), not VAR's VQVAE decoder: pass it as vae=.* together with a MAR model file",
    "mar_plain": r"vae= .*mar_plain\.safetensors is a MAR model file .*not VAR's VQVAE",
    "var": r"vae= .* is a VAR transformer file .*not VAR's VQVAE decoder: pass it as the model path",
    "vqvae_v16": r"does not fit .*: the VQVAE's codebook has 16 entries \(quantize\.embedding\.weight \[16, 8\]\) "
                 r"but the VAR predicts 64 tokens \(head\.weight \[64, 128\]\)",
    "vqvae_z4": r"the VQVAE's latent has 4 channels \(quantize\.embedding\.weight \[64, 4\]\) but the VAR's "
                r"word_embed takes 8 \(word_embed\.weight \[128, 8\]\)",
}


@pytest.mark.parametrize("vae_key", sorted(WRONG_VAR_DECODERS))
@pytest.mark.parametrize("var_key", ["var", "var_plain"])
def test_load_refuses_a_wrong_decoder_for_a_var(files, var_key, vae_key):
    with pytest.raises(ValueError, match=WRONG_VAR_DECODERS[vae_key]):
        mc.load(files[var_key], vae=files[vae_key])


def test_load_refuses_a_vqvae_for_a_mar(files):
    with pytest.raises(ValueError, match=r"vae= .*vqvae_plain\.safetensors is VAR's VQVAE decoder file \(recognised "
                                         r"from its tensor names\), not a KL-16 VAE decoder"):
        mc.load(files["mar_plain"], vae=files["vqvae_plain"])


def test_load_refuses_mar_only_arguments_for_a_var(files):
    with pytest.raises(ValueError, match="heads=2 applies to MAR models only: .* is a VAR transformer"):
        mc.load(files["var"], vae=files["vqvae"], heads=2)
    with pytest.raises(ValueError, match="diffusion_steps applies to MAR models only"):
        mc.load(files["var"], diffusion_steps=10)
    with pytest.raises(ValueError, match="dtype must be 'fp32', 'bf16' or 'fp16'"):
        mc.load(files["var"], dtype="fp64")
    with pytest.raises(ValueError, match="device must be"):
        mc.load(files["var"], device="tpu")


def test_an_unconverted_var_checkpoint_names_both_kinds(tmp_path):
    path = tmp_path / "var_d16.pth"
    path.write_bytes(b"PK\x03\x04" + b"\0" * 64)
    with pytest.raises(ValueError, match=r"is a PyTorch checkpoint .*convert mar .*var_d16\.pth -o "
                                         r"var_d16\.safetensors \(kind var for VAR's file\)"):
        mc.load(path)


# ======================================================================
# the loaded model
# ======================================================================

@pytest.mark.parametrize("var_key,vqvae_key", [("var", "vqvae"), ("var_plain", "vqvae_plain")])
def test_load_gives_a_var_model(files, var_key, vqvae_key):
    m = mc.load(files[var_key], vae=files[vqvae_key])
    assert isinstance(m, mc.VARModel) and m.family == "var"
    c = m.config
    assert (c["depth"], c["width"], c["heads"], c["vocab"], c["vae_channels"], c["num_classes"]) == \
        (2, 128, 2, 64, 8, 10)
    assert c["patch_nums"] == (1, 2, 3, 4) and m.tokens == L and m.num_scales == 4
    assert m.num_params == var_family.num_params(c)
    v = m.vqvae_config
    assert (v["vocab"], v["z_channels"]) == (64, 8)
    assert re.fullmatch(r"VARModel\(depth=2, width=128, heads=2, vocab=64, patch_nums=1,2,3,4, classes=10, "
                        r"params=[\d,]+, decoder=vqvae, device='cpu', dtype='fp32'\)", repr(m))


def test_a_var_without_its_vqvae_says_what_it_needs(files):
    m = mc.load(files["var"])
    assert m.vqvae_config is None and "decoder=none" in repr(m)
    for call in (lambda: m.generate(labels=[1]), lambda: m.generate_tokens(labels=[1]),
                 lambda: m.decode(np.zeros((1, L), np.int32))):
        with pytest.raises(ValueError, match="needs the VQVAE .*pass vae='vqvae.safetensors' to marcache.load"):
            call()


# ======================================================================
# generation
# ======================================================================

def test_generate_images_tokens_and_telemetry(model):
    images, info = model.generate(labels=[1, 7], seed=3, return_info=True)
    assert images.dtype == np.uint8 and images.shape == (2, IMAGE, IMAGE, 3)
    assert info.tokens.dtype == np.int32 and info.tokens.shape == (2, L)
    assert info.tokens.min() >= 0 and info.tokens.max() < 64
    assert info.f_hat.dtype == np.float32 and info.f_hat.shape == (2, SIDE, SIDE, 8)
    assert len(info.steps) == 4 and [s["step"] for s in info.steps] == [0, 1, 2, 3]
    assert info.seconds_transformer_and_head > 0 and info.seconds_decode > 0
    # decode of the tokens (the VQVAE's own accumulation) and of the f_hat agree with generate's images
    np.testing.assert_array_equal(model.decode(info.f_hat), images)
    assert_close_fhat(model.fhat_from_tokens(info.tokens), info.f_hat)
    assert np.abs(model.decode(info.tokens).astype(int) - images.astype(int)).max() <= 1
    floats = model.decode_float(info.f_hat)
    assert floats.shape == (2, IMAGE, IMAGE, 3) and floats.min() >= -1 and floats.max() <= 1


def assert_close_fhat(a, b):
    from tolerance import assert_close, scaled_atol

    assert_close(a, b, rtol=0.0, atol=scaled_atol(b, 1e-5), what="f_hat of the tokens vs generate's f_hat")


@pytest.mark.parametrize("cfg,batch,more_smooth", [(1.5, 1, False), (4.0, 3, False), (0.0, 2, False),
                                                   (1.5, 2, True)])
def test_telemetry_equals_marcache_flops(model, cfg, batch, more_smooth):
    tokens, f_hat, info = model.generate_tokens(labels=list(range(batch)), cfg=cfg, more_smooth=more_smooth,
                                                return_info=True)
    rep = mc.flops(model, cfg=cfg, batch=batch, more_smooth=more_smooth)
    assert [s["flops"] for s in info.steps] == rep.per_step   # integer sums: exact
    assert info.flops == rep.total


def test_same_call_twice_is_bitwise_and_seeds_differ(model):
    a = model.generate_tokens(labels=[2, 5], seed=11)
    b = model.generate_tokens(labels=[2, 5], seed=11)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    c = model.generate_tokens(labels=[2, 5], seed=12)
    assert not np.array_equal(a[0], c[0])


def test_image_i_is_the_same_alone_in_any_batch_and_in_a_shard(model):
    """Tokens identical; f_hat within float32 rounding (the GEMM row counts differ), so the
    decoded pixels within one level."""
    from tolerance import assert_close, scaled_atol

    labels = [3, 1, 4, 1, 5]
    tokens, f_hat = model.generate_tokens(labels=labels, seed=7)
    images = model.decode(f_hat)
    for i in (0, 2, 4):
        alone_t, alone_f = model.generate_tokens(labels=[labels[i]], seed=7, first_index=i)
        np.testing.assert_array_equal(alone_t[0], tokens[i])
        assert_close(alone_f[0], f_hat[i], rtol=0.0, atol=scaled_atol(f_hat[i], 1e-5, axis=-1),
                     what=f"image {i} alone vs in the batch")
        assert np.abs(model.decode(alone_f).astype(int)[0] - images[i].astype(int)).max() <= 1
    shard_t, shard_f = model.generate_tokens(labels=labels[2:], seed=7, first_index=2)
    np.testing.assert_array_equal(shard_t, tokens[2:])
    assert_close(shard_f, f_hat[2:], rtol=0.0, atol=scaled_atol(f_hat[2:], 1e-5, axis=-1), what="a shard")


def test_unconditional_uses_the_null_class(model):
    tokens, _ = model.generate_tokens(num_images=2, seed=1)
    assert tokens.shape == (2, L)


@pytest.mark.parametrize("kwargs,message", [
    (dict(labels=[10]), r"label 10 at index 0 is outside 0\.\.9 \(the model has 10 classes\)"),
    (dict(labels=[1, -1]), r"label -1 at index 1 is outside 0\.\.9"),
    (dict(labels=[1.5]), "labels must be integers"),
    (dict(labels=[]), "labels is empty"),
    (dict(labels=None), "unconditional generation needs num_images=N"),
    (dict(labels=[1], num_images=2), "num_images=2 does not match 1 labels"),
    (dict(labels=[1], top_k=-1), r"top_k must be an integer >= 0 \(0 keeps every token\), got -1"),
    (dict(labels=[1], top_k=2.5), "top_k must be an integer >= 0"),
    (dict(labels=[1], top_k=True), "top_k must be an integer >= 0"),
    (dict(labels=[1], top_p=1.5), r"top_p must be a number in \[0, 1\].*got 1\.5"),
    (dict(labels=[1], top_p=-0.1), r"top_p must be a number in \[0, 1\]"),
    (dict(labels=[1], top_p=float("nan")), r"top_p must be a number in \[0, 1\]"),
    (dict(labels=[1], cfg=-1.0), r"cfg must be a finite number >= 0 \(0 turns guidance off\), got -1\.0"),
    (dict(labels=[1], cfg=float("inf")), "cfg must be a finite number >= 0"),
    (dict(labels=[1], cfg=float("nan")), "cfg must be a finite number >= 0"),
    (dict(labels=[1], cfg="2"), "cfg must be a finite number >= 0"),
    (dict(labels=[1], more_smooth=1), "more_smooth must be True or False"),
    (dict(labels=[1], seed=-1), r"seed must be an integer in 0\.\.2\*\*64-1, got -1"),
    (dict(labels=[1], seed=2**64), r"seed must be an integer in 0\.\.2\*\*64-1"),
    (dict(labels=[1], seed=1.0), r"seed must be an integer"),
    (dict(labels=[1], first_index=-1), "first_index must be an integer >= 0"),
    (dict(labels=[1, 2], first_index=2**32 - 1), r"first_index \+ N <= 2\*\*32"),
    (dict(labels=[1], cache=mc.LazyMAR()), "LazyMAR is a cache policy for MAR models, not VAR"),
    (dict(labels=[1], cache=mc.MARche()), "MARche is a cache policy for MAR models, not VAR"),
    # CfgFreeLate runs on VAR around NoCache or FastVAR; around a MAR policy it is a MAR policy
    (dict(labels=[1], cache=mc.CfgFreeLate(inner=mc.LazyMAR(cond_cache=True))),
     "CfgFreeLate is a cache policy for MAR models, not VAR"),
])
def test_bad_arguments_name_the_argument(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        model.generate(**kwargs)


def test_a_cache_that_is_no_policy_is_a_type_error(model):
    with pytest.raises(TypeError, match=r"cache must be None or one of marcache\.NoCache\(\.\.\.\)"):
        model.generate(labels=[1], cache="fastvar")


def test_mar_arguments_are_not_var_arguments(model):
    with pytest.raises(TypeError, match="steps"):
        model.generate(labels=[1], steps=10)


def test_decode_checks_its_input(model):
    with pytest.raises(ValueError, match=r"tokens must be codebook indices in 0\.\.63, got 0\.\.64"):
        model.decode(np.full((1, L), 64, np.int32) - np.eye(1, L, dtype=np.int32) * 64)
    with pytest.raises(ValueError, match=r"tokens must be integers \[N, 30\]"):
        model.decode(np.zeros((1, 29), np.int32))
    with pytest.raises(ValueError, match=r"decode takes tokens int \[N, 30\] or f_hat float \[N, 4, 4, 8\]"):
        model.decode(np.zeros((1, 3, 3, 8), np.float32))


def test_progress_bar_counts_scales(model, monkeypatch):
    calls = []
    from marcache import _driver

    real = _driver.run

    def spy(native, total_steps, progress=False, desc="generate", **kwargs):
        calls.append((total_steps, progress, desc))
        return real(native, total_steps, progress=progress, desc=desc, **kwargs)

    monkeypatch.setattr(_driver, "run", spy)
    model.generate_tokens(labels=[1], progress=True)
    assert calls == [(4, True, "VAR")]


def test_guard_equals_cpu_bitwise(files):
    """The guard backend (host and device memory apart; faults on a host access) gives
    the CPU's tokens and f_hat exactly, in a fresh process."""
    code = ("import json, marcache as mc\n"
            "out = {}\n"
            "for dev in ('cpu', 'guard'):\n"
            f"    m = mc.load({str(files['var'])!r}, vae={str(files['vqvae'])!r}, device=dev)\n"
            "    t, f = m.generate_tokens(labels=[1, 2, 3], cfg=2.0, seed=5)\n"
            "    s, g = m.generate_tokens(labels=[1, 2], cfg=2.0, seed=5, more_smooth=True)\n"
            "    out[dev] = [t.tolist(), f.tobytes().hex(), s.tolist(), g.tobytes().hex()]\n"
            "print(json.dumps(out))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, timeout=600,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["guard"] == out["cpu"]


# ======================================================================
# marcache.flops of a loaded model, the CLI, the sweep
# ======================================================================

def test_flops_of_a_loaded_model_use_its_config(model):
    rep = mc.flops(model, cfg=1.5)
    assert [s["tokens"] for s in rep.per_scale] == [1, 4, 9, 16]
    assert [s["keys"] for s in rep.per_scale] == [1, 5, 14, 30]
    with pytest.raises(ValueError, match="one step per scale"):
        mc.flops(model, steps=3)


def test_cli_flops_of_var_presets_and_files(files, capsys):
    assert main(["flops", "var_d16"]) == 0
    out = capsys.readouterr().out
    assert "var_d16, cfg 1.5, cache NoCache: 0.5970 TFLOPs per image" in out
    assert re.search(r"^\s+9\s+256\s+680\s+233\.29\s+39\.1%$", out, re.M)
    assert main(["flops", "var_d30", "--cfg", "0", "--more-smooth"]) == 0
    assert "var_d30, cfg 0.0, more_smooth" in capsys.readouterr().out
    assert main(["flops", str(files["var"])]) == 0
    assert re.search(r"^\s+3\s+16\s+30\s", capsys.readouterr().out, re.M)
    assert main(["flops", "var_d16", "--steps", "8"]) == 2
    assert "--steps applies to MAR models only; var_d16 is a VAR model" in capsys.readouterr().err
    assert main(["flops", "var_d16", "--cache", "lazymar"]) == 2
    assert "LazyMAR is a cache policy for MAR models, not VAR" in capsys.readouterr().err
    assert main(["flops", "mar_base", "--top-k", "5", "--more-smooth"]) == 2
    assert "--top-k, --more-smooth apply to VAR models only; mar_base is a MAR model" in capsys.readouterr().err


def test_cli_generate_and_sample_with_var_files(files, model, tmp_path, capsys):
    from marcache.png import read_png

    out = tmp_path / "grid.png"
    assert main(["generate", "--model", str(files["var"]), "--vae", str(files["vqvae"]), "--labels", "1", "2",
                 "--cfg", "2", "--top-k", "5", "--top-p", "0.9", "--quiet", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    grid = read_png(out)
    assert grid.shape[2] == 3 and grid.shape[0] >= IMAGE
    assert main(["generate", "--model", str(files["var"]), "--vae", str(files["vqvae"]), "--labels", "1",
                 "--steps", "8", "--quiet", "--out", str(out)]) == 2
    assert "--steps applies to MAR models only" in capsys.readouterr().err
    assert main(["generate", "--model", str(files["var"]), "--vae", str(files["vqvae"]), "--labels", "10",
                 "--quiet", "--out", str(out)]) == 2
    assert "label 10 at index 0 is outside 0..9" in capsys.readouterr().err
    samples = tmp_path / "samples.npz"
    assert main(["sample", "--model", str(files["var"]), "--vae", str(files["vqvae"]), "--n", "5",
                 "--per-class", "2", "--batch-size", "2", "--more-smooth", "--quiet", "--out", str(samples)]) == 0
    arr = np.load(samples)["arr_0"]
    assert arr.shape == (5, IMAGE, IMAGE, 3) and arr.dtype == np.uint8
    # sample's image i is image i of the seed's sequence with class i // per_class (batches of 2)
    direct = [model.generate(labels=lab, first_index=start, more_smooth=True)
              for start, lab in ((0, [0, 0]), (2, [1, 1]), (4, [2]))]
    np.testing.assert_array_equal(arr, np.concatenate(direct))


def test_sweep_passes_the_models_own_settings(files, model, tmp_path):
    from marcache import eval as ev

    net = ev.InceptionV3.load(_tiny_inception(tmp_path))
    rng = np.random.default_rng(4)
    reference = ev.Stats.from_features(net.features(rng.integers(0, 256, (8, IMAGE, IMAGE, 3), dtype=np.uint8))[0])
    results = ev.sweep(model, net, {"nocache": mc.NoCache()}, n=4, per_class=2, reference=reference, cfg=2.0,
                       top_k=5, batch_size=3)
    (r,) = results
    assert r.n == 4 and r.settings == {"cfg": 2.0, "top_k": 5}
    assert r.flops_per_image == pytest.approx(mc.flops(model, cfg=2.0).total, rel=1e-12)
    images = model.generate(labels=[0, 0, 1, 1], cfg=2.0, top_k=5)
    assert ev.fid(r.stats, ev.Stats.from_features(net.features(images)[0])) == pytest.approx(0.0, abs=1e-4)
    with pytest.raises(ValueError, match=r"sweep: VARModel\.generate takes no setting 'steps'; its settings: cfg, "
                                         r"more_smooth, top_k, top_p"):
        ev.sweep(model, net, [mc.NoCache()], n=2, per_class=1, reference=reference, steps=64)
    with pytest.raises(ValueError, match=r"takes no setting 'first_index'.*set by the sweep"):
        ev.sweep(model, net, [mc.NoCache()], n=2, per_class=1, reference=reference, first_index=3)


def _tiny_inception(tmp_path):
    path = tmp_path / "tiny_inception.safetensors"
    save_file(RI.random_weights(np.random.default_rng(10), divisor=16, num_classes=10), str(path))
    return path


def test_readme_pytest_sweep_example_runs_on_a_var(files, tmp_path):
    """The README's sweep example, verbatim, with only the model files changed to a VAR
    and its VQVAE (test_eval.py runs it on a MAR)."""
    from marcache import eval as ev

    (tmp_path / "test_fid_sweep.py").write_text(readme_sweep_example())
    inception = _tiny_inception(tmp_path)
    net = ev.InceptionV3.load(inception)
    rng = np.random.default_rng(5)
    ev.make_reference(rng.integers(0, 256, (8, IMAGE, IMAGE, 3), dtype=np.uint8), tmp_path / "ref.npz", net)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(mc.__file__)))
    env = dict(os.environ, MARCACHE_MODEL=str(files["var"]), MARCACHE_VAE=str(files["vqvae"]),
               MARCACHE_INCEPTION=str(inception), MARCACHE_REFERENCE=str(tmp_path / "ref.npz"), MARCACHE_FID_N="4",
               PYTHONPATH=package_root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                           str(tmp_path / "test_fid_sweep.py")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"nocache\s+4\s+\d+\.\d+", proc.stdout)


def test_sweep_refuses_settings_of_the_other_family():
    from marcache import digits, eval as ev

    mar = digits.load_model()
    with pytest.raises(ValueError, match=r"sweep: MARModel\.generate takes no setting 'top_k'; its settings: cfg, "
                                         r"cfg_schedule, steps, temperature"):
        ev.sweep(mar, None, [mc.NoCache()], n=2, per_class=1, reference=None, top_k=5)


def test_components_scale_inputs_and_forward_scales(files):
    """VARModel's components pass through to the engine: scale_inputs takes the maps as one
    array [B, T, Cvae] or as a list of per-scale maps [B, pn, pn, Cvae] (raster order)."""
    m = mc.load(files["var"])
    rng = np.random.default_rng(2)
    maps = [rng.standard_normal((2, p, p, 8)).astype(np.float32) for p in TINY_VAR["patch_nums"][1:3]]
    labels = np.array([4, 10], np.int32)           # 10: the null class
    flat = np.concatenate([x.reshape(2, -1, 8) for x in maps], axis=1)
    inputs = m.scale_inputs(labels, maps)
    assert inputs.shape == (2, 1 + 4 + 9, 128)
    np.testing.assert_array_equal(inputs, m.scale_inputs(labels, flat))
    np.testing.assert_array_equal(m.scale_inputs(labels, [])[:, :1], inputs[:, :1])
    hidden, logits = m.forward_scales(labels, inputs)
    assert hidden.shape == (2, 14, 128) and logits.shape == (2, 14, 64)
    with pytest.raises(ValueError, match=r"next_maps\[1\] must be float32 \[2, pn, pn, 8\], got \(2, 3, 3, 4\)"):
        m.scale_inputs(labels, [maps[0], np.zeros((2, 3, 3, 4), np.float32)])


def test_cli_info_of_a_var_file(files, capsys):
    assert main(["info", str(files["var"])]) == 0
    out = capsys.readouterr().out
    assert out.startswith("VARModel(depth=2, width=128") and "  patch_nums: (1, 2, 3, 4)" in out


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16_bit_linear_weights(files, model, dtype):
    """dtype= works as for MAR: the transformer's Linear weights in 16 bits (autocast's
    arithmetic); most tokens stay those of fp32 on this tiny model."""
    m = mc.load(files["var"], vae=files["vqvae"], dtype=dtype)
    assert m.dtype == dtype and f"dtype={dtype!r}" in repr(m)
    tokens, f_hat = m.generate_tokens(labels=[1, 2], seed=3)
    ref, _ = model.generate_tokens(labels=[1, 2], seed=3)
    assert tokens.shape == ref.shape and np.all(np.isfinite(f_hat))
    assert (tokens[:, :5] == ref[:, :5]).mean() >= 0.5  # the first scales' logits are far from ties

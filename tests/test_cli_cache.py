"""The command line a newcomer meets (issue 17): cache policies on every generating command,
`caches`, `generate --scale`, `sample` -> `fid` on the shipped digits model, progress bars
only on a terminal, a typo'd option reported with its command's usage, and the import
message of an unbuilt source tree."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import marcache as mc
from marcache import digits
from marcache.__main__ import cache_policies, main, make_cache
from marcache.eval import Stats, fid
from marcache.png import read_png
from tolerance import assert_close

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(mc.__file__)))
STEPS = 4  # few AR steps: these tests check plumbing, the engine is tested elsewhere


def run_cli(args, cwd, timeout=300):
    """python -m marcache ARGS in a subprocess, importing the same marcache as this test,
    from a working directory that is not the source tree."""
    env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT)
    return subprocess.run([sys.executable, "-m", "marcache", *args], capture_output=True, text=True,
                          cwd=str(cwd), env=env, timeout=timeout)


@pytest.fixture(scope="module")
def digits_model():
    return digits.load_model()


# --------------------------------------------------------------------------
# --cache, --cache-opt, --cache-file
# --------------------------------------------------------------------------

def test_registry_holds_every_public_policy_class():
    assert cache_policies() == {"nocache": mc.NoCache, "lazymar": mc.LazyMAR, "marche": mc.MARche,
                                "cfgfreelate": mc.CfgFreeLate, "fastvar": mc.FastVAR, "disa": mc.DiSA}


def test_a_policy_field_that_holds_a_policy_takes_a_name_or_an_object():
    assert make_cache("cfgfreelate", ["after=0.5", "inner=lazymar"]) == mc.CfgFreeLate(after=0.5, inner=mc.LazyMAR())
    assert make_cache("cfgfreelate") == mc.CfgFreeLate()
    with pytest.raises(ValueError, match="unknown cache policy 'lazy'"):
        make_cache("cfgfreelate", ["inner=lazy"])
    assert make_cache("disa", ["start=30", "clip=none", "schedule=cosine", "inner=lazymar"]) == \
        mc.DiSA(start=30, clip=None, schedule="cosine", inner=mc.LazyMAR())


def test_cache_options_are_typed_by_the_dataclass_fields():
    assert make_cache(None) == mc.NoCache()
    assert make_cache("lazymar") == mc.LazyMAR()
    lz = make_cache("lazymar", ["period=5", "token_cache=false", "head_recompute_above=0.5", "start=4"])
    assert lz == mc.LazyMAR(period=5, token_cache=False, head_recompute_above=0.5, start=4)
    table = ",".join(["0.5"] * 64)
    assert make_cache("lazymar", [f"retention={table}"]).retention == (0.5,) * 64
    mr = make_cache("marche", ["budget=16", "candidates=image", "encoder-cache=yes"])
    assert mr == mc.MARche(budget=16, candidates="image", encoder_cache=True)
    assert make_cache("marche", ["budget=none"]).budget is None


def test_cache_file_and_options_combine(tmp_path):
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"policy": "marche", "budget": 20, "head_cache": True}))
    assert make_cache(None, [], str(path)) == mc.MARche(budget=20, head_cache=True)
    # --cache-opt wins over the file
    assert make_cache("marche", ["budget=8"], str(path)) == mc.MARche(budget=8, head_cache=True)
    with pytest.raises(ValueError, match="--cache lazymar but --cache-file .* says policy 'marche'"):
        make_cache("lazymar", [], str(path))
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        make_cache(None, [], str(path))


@pytest.mark.parametrize("name, options, message", [
    ("marche", ["budgett=3"], r"MARche has no field budgett; its fields: budget, "),
    ("nocache", ["period=3"], r"NoCache has no field period; its fields: \(none\)"),
    ("lazymar", ["token_cache=maybe"], r"token_cache='maybe' \(LazyMAR field of type bool\): expected true or false"),
    ("lazymar", ["period=three"], r"period='three' \(LazyMAR field of type int\): not a valid value"),
    ("lazymar", ["period"], r"--cache-opt expects KEY=VALUE, got 'period'"),
    ("lazymar", ["period=0"], r"LazyMAR.period must be an integer >= 1"),
    ("fastcache", [], r"unknown cache policy 'fastcache'; expected one of nocache, lazymar, marche"),
])
def test_bad_cache_options_say_what_is_wrong(name, options, message):
    with pytest.raises(ValueError, match=message):
        make_cache(name, options)


def test_caches_lists_every_field_with_its_default(capsys):
    assert main(["caches"]) == 0
    out = capsys.readouterr().out
    for name, cls in cache_policies().items():
        assert f"{name}: marcache.{cls.__name__}" in out
        for f in dataclasses.fields(cls):
            if isinstance(f.default, tuple):
                continue  # the retention table is abbreviated; checked below
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            assert any(line.split()[:1] == [f.name] and line.rstrip().endswith(f"default {default!r}")
                       for line in out.splitlines()), f"{cls.__name__}.{f.name}"
    assert "retention              tuple          default (64 values: 1.0, 1.0, ..., 0.05)" in out


def test_typo_in_an_option_prints_the_commands_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", "digits", "--stpes", "8"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: python -m marcache generate" in err
    assert "python -m marcache generate: error: unrecognized arguments: --stpes 8" in err


def test_cli_error_is_one_line_with_exit_status_2(capsys):
    assert main(["flops", "mar_base", "--cache", "marche", "--cache-opt", "budgett=3"]) == 2
    assert capsys.readouterr().err.startswith("error: MARche has no field budgett")


def test_flops_with_a_cache_equals_the_api(capsys, digits_model):
    assert main(["flops", "mar_base", "--steps", "64", "--cfg", "2.9", "--cache", "lazymar"]) == 0
    want = mc.flops("mar_base", steps=64, cfg=2.9, cache=mc.LazyMAR()).total / 1e12
    assert f"cache LazyMAR: {want:.4f} TFLOPs per image" in capsys.readouterr().out
    assert main(["flops", "digits", "--steps", "16", "--cfg", "2", "--cache", "marche",
                 "--cache-opt", "budget=24"]) == 0
    want = mc.flops(digits_model, steps=16, cfg=2.0, cache=mc.MARche(budget=24)).total / 1e12
    assert f"cache MARche: {want:.4f} TFLOPs per image" in capsys.readouterr().out


# --------------------------------------------------------------------------
# generate --cache / --scale on the digits model
# --------------------------------------------------------------------------

def test_generate_with_a_cache_and_the_default_scale(tmp_path, capsys, digits_model):
    out = tmp_path / "g.png"
    assert main(["generate", "--model", "digits", "--labels", "3", "7", "--steps", str(STEPS), "--cfg", "2",
                 "--cache", "lazymar", "--cache-opt", "start=1", "--cache-opt", "period=2",
                 "--columns", "2", "--quiet", "--out", str(out)]) == 0
    assert "256x256 px (upscaled 16x), cache LazyMAR" in capsys.readouterr().out
    want = digits_model.generate(labels=[3, 7], steps=STEPS, cfg=2.0, cache=mc.LazyMAR(start=1, period=2))
    assert want.shape == (2, 16, 16, 3)
    img = read_png(str(out))
    pad = 2  # png.grid's default padding around and between tiles
    assert img.shape == (256 + 2 * pad, 2 * 256 + 3 * pad, 3)
    for j in range(2):
        tile = img[pad:pad + 256, pad + j * (256 + pad):pad + j * (256 + pad) + 256]
        # nearest-neighbour: every pixel is a 16x16 block; the run is deterministic, so equal bytes
        np.testing.assert_array_equal(tile[::16, ::16], want[j])
        np.testing.assert_array_equal(tile, np.repeat(np.repeat(want[j], 16, 0), 16, 1))
    # the cache changed the images (else the option was not passed through)
    assert not np.array_equal(want, digits_model.generate(labels=[3, 7], steps=STEPS, cfg=2.0))


def test_generate_keeps_a_vaes_resolution_by_default(tmp_path, capsys):
    """With --vae the decoder's output is the model's resolution (256 px for the released
    MARs): no default upscale. A tiny random MAR and VAE (32 px) stand in for them."""
    from safetensors.numpy import save_file

    from mar_fixtures import write_tiny_mar
    from reference import vae as ref_vae

    mar_path, vae_path = tmp_path / "mar.safetensors", tmp_path / "vae.safetensors"
    write_tiny_mar(mar_path)
    save_file(dict(ref_vae.random_vae_weights(np.random.default_rng(3), ch=32, ch_mult=(1, 2), num_res_blocks=1)),
              str(vae_path))
    out = tmp_path / "v.png"
    assert main(["generate", "--model", str(mar_path), "--vae", str(vae_path), "--labels", "1", "--steps", "2",
                 "--quiet", "--out", str(out)]) == 0
    assert "32x32 px, cache NoCache" in capsys.readouterr().out
    assert read_png(str(out)).shape == (32 + 4, 32 + 4, 3)
    assert main(["generate", "--model", str(mar_path), "--vae", str(vae_path), "--labels", "1", "--steps", "2",
                 "--scale", "8", "--quiet", "--out", str(out)]) == 0
    assert read_png(str(out)).shape == (256 + 4, 256 + 4, 3)


def test_generate_scale_option(tmp_path, capsys):
    out = tmp_path / "g1.png"
    assert main(["generate", "--model", "digits", "--labels", "0", "--steps", "2", "--scale", "1", "--quiet",
                 "--out", str(out)]) == 0
    assert read_png(str(out)).shape == (16 + 4, 16 + 4, 3)
    assert main(["generate", "--model", "digits", "--labels", "0", "--steps", "2", "--scale", "0",
                 "--out", str(out)]) == 2
    assert "--scale must be >= 1, got 0" in capsys.readouterr().err


# --------------------------------------------------------------------------
# sample -> fid on the digits model, and progress output
# --------------------------------------------------------------------------

def test_sample_then_fid_on_the_digits_model(tmp_path, digits_model):
    samples = tmp_path / "samples.npz"
    proc = run_cli(["sample", "--model", "digits", "--n", "6", "--per-class", "2", "--steps", str(STEPS),
                    "--cfg", "2", "--batch-size", "4", "--cache", "marche", "--out", str(samples)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "cache MARche" in proc.stdout
    # stderr is a pipe here: no progress bar, so no carriage returns in logs
    assert "\r" not in proc.stderr and "sample" not in proc.stderr, proc.stderr
    with np.load(samples) as f:
        arr = f["arr_0"]
    want = digits_model.generate(labels=[0, 0, 1, 1, 2, 2], steps=STEPS, cfg=2.0, cache=mc.MARche())
    np.testing.assert_array_equal(arr, want)

    proc = run_cli(["fid", str(samples), "digits", "--method", "symmetric", "--splits", "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    value = float(proc.stdout.split("digits-FID: ")[1].split()[0])
    # independent of the CLI's code path: the classifier's features of the array, against the
    # training digits, through the demo's digits.fid
    clf = digits.Classifier.load()
    data = digits.load_data()
    ref = digits.fid(clf.features(arr), clf.features(data["images"][data["train"]]))
    # atol 1e-3: the CLI prints 4 decimals and accumulates Stats batch by batch (float64)
    assert_close(value, ref, rtol=0, atol=1e-3, what="digits-FID of the CLI")
    assert "IS:" in proc.stdout and "2 splits" in proc.stdout


def test_fid_needs_inception_unless_digits(tmp_path):
    assert main(["fid", str(tmp_path / "s.npz"), str(tmp_path / "ref.npz")]) == 2


def test_progress_bar_when_asked_and_quiet_is_silent(tmp_path):
    out = tmp_path / "s.npz"
    args = ["sample", "--model", "digits", "--n", "2", "--per-class", "1", "--steps", "2", "--out", str(out)]
    proc = run_cli(args + ["--progress"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "sample" in proc.stderr and "2/2" in proc.stderr, proc.stderr  # tqdm's bar, forced
    proc = run_cli(args + ["--progress", "--quiet"], tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_tqdm_is_a_dependency():
    import tqdm  # noqa: F401  (pyproject lists it in dependencies: progress bars are not optional)


# --------------------------------------------------------------------------
# importing an unbuilt source tree
# --------------------------------------------------------------------------

def test_unbuilt_source_tree_says_what_to_run(tmp_path):
    """A clone's root with no built _C: `import marcache` from there names the folder and
    the command that builds it, instead of a circular-import message."""
    clone = tmp_path / "clone"
    shutil.copytree(os.path.join(PACKAGE_ROOT, "marcache"), clone / "marcache",
                    ignore=shutil.ignore_patterns("_C*.so", "__pycache__", "data"))
    (clone / "setup.py").write_text("# a source tree's marker\n")
    # An editable install (pip install -e .) maps `marcache` to its own source folder through a
    # meta-path finder that wins over the working directory: set it aside for this import.
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path "
            "if '__editable__' not in getattr(f, '__module__', '')]; import marcache")
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(clone), capture_output=True,
                          text=True, timeout=120, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()
    message = "\n".join(last[-4:])
    assert f"marcache is being imported from its source folder {clone / 'marcache'}" in message, proc.stderr
    assert "pip install -e ." in message and "python setup.py build_ext --inplace" in message
    assert "run Python from another folder" in message
    assert "circular import" not in proc.stderr


def test_demo_with_one_policy_and_quiet(tmp_path, capsys):
    out = tmp_path / "demo.png"
    assert main(["demo", "--per-class", "1", "--steps", "2", "--cache", "marche", "--cache-opt", "budget=24",
                 "--quiet", "--out", str(out), "--threads", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    # only the table: header, rule, NoCache (the baseline), the chosen policy, the real digits
    assert [line.split()[0] for line in lines] == ["policy", "-" * len(lines[0]), "NoCache", "MARche", "real"]
    assert read_png(str(out)).shape[1] > 2 * (48 + 4)  # two labelled panels

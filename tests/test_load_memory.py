"""Loading at the weights' size (issue 18).

A tensor goes from the file's mapping to its backend buffer in pieces of 2^20 source
elements (csrc/io/bind.c, MC_BIND_PIECE_FLOATS): converted (F16, BF16, F64 -> float32;
Linear weights rounded to a 16-bit type; conv weights repacked to [O, kh, kw, I]) in a
bounded host buffer, uploaded at its offset, and its file pages released. The first
tests bind tensors that span one, two and three pieces on every path (marcache._C.
_bind_read binds one tensor as a model load does and downloads it) and compare with
NumPy's conversion of the same stored values. The last measures, in a fresh child
process, the peak resident memory a model load adds: under 1.15 x the loaded weights
plus a small constant (before, the file's pages stayed resident beside the weights:
about twice the weights).
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

import marcache as mc
from marcache import _C
from mar_fixtures import save_bf16, write_tiny_mar
from reference import ops as ref_ops
from reference import vae as ref_vae
from child_env import child_env

PIECE = 1 << 20  # source elements per piece (MC_BIND_PIECE_FLOATS)
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# name -> shape: one piece exactly, two pieces (the second partial), a conv whose
# output channels split over two pieces, a conv with one output channel larger than a
# piece (a piece is then one channel), a scalar-ish vector and an empty tensor.
SHAPES = {
    "exact": (1024, 1024),
    "two": (1100, 1000),
    "conv_two": (2000, 64, 3, 3),
    "conv_wide": (3, 2, 500, 400),
    "small": (7,),
    "empty": (0, 4),
}
FILE_DTYPES = ("F32", "F16", "F64", "BF16")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """One file per stored dtype; returns {dtype: (path, {name: float32 values held})}."""
    rng = np.random.default_rng(18)
    base = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}
    out = {}
    folder = tmp_path_factory.mktemp("bind")
    for dtype in FILE_DTYPES:
        path = str(folder / f"{dtype}.safetensors")
        if dtype == "BF16":
            held = save_bf16(base, path)
        else:
            np_type = {"F32": np.float32, "F16": np.float16, "F64": np.float64}[dtype]
            stored = {k: v.astype(np_type) for k, v in base.items()}
            save_file(stored, path)
            held = {k: v.astype(np.float32) for k, v in stored.items()}
        out[dtype] = (path, held)
    return out


def assert_bits_equal(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    assert np.array_equal(got.view(np.uint8), np.ascontiguousarray(want).view(np.uint8))


@pytest.mark.parametrize("device", ["cpu", "guard"])
@pytest.mark.parametrize("file_dtype", FILE_DTYPES)
@pytest.mark.parametrize("name", ["exact", "two", "small", "empty"])
def test_as_is_in_pieces(files, device, file_dtype, name):
    path, held = files[file_dtype]
    assert_bits_equal(_C._bind_read(path, name, "as_is", device=device), held[name])


@pytest.mark.parametrize("device", ["cpu", "guard"])
@pytest.mark.parametrize("file_dtype", FILE_DTYPES)
@pytest.mark.parametrize("name", ["conv_two", "conv_wide"])
def test_conv_repack_in_pieces(files, device, file_dtype, name):
    path, held = files[file_dtype]
    want = np.ascontiguousarray(held[name].transpose(0, 2, 3, 1))
    assert_bits_equal(_C._bind_read(path, name, "conv_ohwi", device=device), want)


def wtype_bits(values, wtype):
    rounded = ref_ops.round_to_wtype(values, wtype)
    if wtype == "fp16":
        return rounded.astype(np.float16).view(np.uint16)
    return (rounded.view(np.uint32) >> 16).astype(np.uint16)


@pytest.mark.parametrize("device", ["cpu", "guard"])
@pytest.mark.parametrize("file_dtype", FILE_DTYPES)
@pytest.mark.parametrize("wtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("name", ["exact", "two"])
def test_linear_weights_in_pieces(files, device, file_dtype, wtype, name):
    path, held = files[file_dtype]
    got = _C._bind_read(path, name, "linear", dtype=wtype, device=device)
    want = held[name] if wtype == "fp32" else wtype_bits(held[name], wtype)
    assert_bits_equal(got, want)


def test_bind_read_errors_name_file_and_key(files):
    path, _ = files["F32"]
    with pytest.raises(KeyError, match="missing key 'nope'"):
        _C._bind_read(path, "nope")
    with pytest.raises(ValueError, match="layout must be"):
        _C._bind_read(path, "two", "sideways")
    with pytest.raises(RuntimeError, match="'two': conv repacking needs a 4-D shape, got 2-D"):
        _C._bind_read(path, "two", "conv_ohwi")


# ----- peak resident memory of a load, in a fresh process ---------------------------------

# The target of issue 18 is peak <= 1.15 x weights + 100 MiB for the whole process
# (interpreter included). Measured from the resident size just before the load, the
# constant only has to cover the loader's bounded buffers (a 4 MiB piece, 8 MiB of
# conversion scratch, the pages of one piece) and allocator slack.
SLACK_MIB = 24


@pytest.fixture(scope="module")
def rss_files(tmp_path_factory):
    if mc.build_info()["sanitize"]:
        pytest.skip("peak RSS is not measured under the sanitizers: AddressSanitizer's shadow memory and "
                    "quarantine are resident too")
    folder = tmp_path_factory.mktemp("rss")
    mar_path = str(folder / "mar.safetensors")
    # 8 blocks of width 512 and the head: about 30 M parameters, 122 MB of float32 weights.
    write_tiny_mar(mar_path, seed=3, heads=8, dim=512, depth=4, head_width=512, head_depth=2)
    vae_path = str(folder / "vae.safetensors")
    weights = ref_vae.random_vae_weights(np.random.default_rng(4))  # the full KL-16 decoder, 153 MB
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in weights.items()}, vae_path)
    return {"mar": mar_path, "vae": vae_path}


# MARCACHE_HUGE_PAGES=1 (the default) puts buffers of 2 MiB or more on 2 MiB boundaries and
# asks for transparent huge pages; only whole 2 MiB ranges get them, so it must not cost
# memory: the same bound holds with it on and off.
#
# An fp32 model's Linear weights also get column panels on the CPU (cpu_panels.c: a second,
# deliberate copy, made at load; MARCACHE_SMALLROW_PANELS=0 turns it off). The first cases
# load with the panels off, so any other second copy shows; the panels case holds the load
# to twice the weights (the panels hold the Linears' weights, a little padded), under a
# third copy.
@pytest.mark.parametrize("kind,dtype,huge,panels", [("mar", "fp32", "1", "0"), ("mar", "fp32", "0", "0"),
                                                    ("mar", "fp32", "1", "1"), ("mar", "bf16", "1", "1"),
                                                    ("vae", "fp32", "1", "1")])
def test_load_peak_rss_stays_near_the_weights(rss_files, kind, dtype, huge, panels):
    # The child imports the marcache this process tests (conftest's sys.path: the in-place
    # build, or the installed package when the source tree has no build, as in CI).
    env = child_env(OMP_NUM_THREADS="1", MARCACHE_HUGE_PAGES=huge, MARCACHE_SMALLROW_PANELS=panels)
    probe = os.path.join(TESTS_DIR, "load_probe.py")
    done = subprocess.run([sys.executable, probe, kind, rss_files[kind], dtype, "--reset-peak"],
                          capture_output=True, text=True, env=env, cwd=TESTS_DIR, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    weights_mib = result["weight_bytes"] / 2**20
    growth_mib = (result["peak_kib"] - result["before_kib"]) / 1024
    copies = 2 if (kind, dtype, panels) == ("mar", "fp32", "1") else 1
    bound_mib = 1.15 * copies * weights_mib + SLACK_MIB
    assert weights_mib > 50, result  # big enough that a second copy could not hide in the slack
    assert growth_mib <= bound_mib, (
        f"{kind} {dtype}, panels {panels}: loading raised the peak RSS by {growth_mib:.0f} MiB for "
        f"{weights_mib:.0f} MiB of weights (bound {bound_mib:.0f} MiB)")


def test_huge_pages_change_where_weights_live_not_the_numbers(rss_files, monkeypatch):
    """The same tokens, bit for bit, with the CPU backend's huge-page buffers on and off
    (the model's 512-wide Linears are 1-4 MiB: some of them take the aligned path), and
    build_info reports the setting a backend made now would use."""
    tokens = {}
    for huge in ("0", "1"):
        monkeypatch.setenv("MARCACHE_HUGE_PAGES", huge)
        assert mc.build_info()["huge_pages"] == int(huge)
        model = mc.load(rss_files["mar"], threads=2, diffusion_steps=4)
        tokens[huge] = np.asarray(model.generate_tokens(labels=[1, 2], steps=2, cfg=2.0, seed=5))
        del model
    assert np.isfinite(tokens["1"]).all() and np.abs(tokens["1"]).max() > 0
    np.testing.assert_array_equal(tokens["1"], tokens["0"])
    monkeypatch.setenv("MARCACHE_HUGE_PAGES", "on")
    assert mc.build_info()["huge_pages"] == -1
    assert mc.build_info()["cpu_isa"].startswith("invalid: MARCACHE_HUGE_PAGES='on': expected 0 or 1")
    with pytest.raises(ValueError, match="MARCACHE_HUGE_PAGES='on': expected 0 or 1"):
        mc.load(rss_files["mar"])

"""One test for each README promise that had none (issue 22, point 12): CFG on eps only
with the unguided variance, progress=True, threads=, build_info()["blas_core"], the fp16
overflow above 65504, InceptionV3.iter_features, and the converter's peak memory."""
import os
import platform
import struct
import subprocess
import sys
import zipfile

import numpy as np
import pytest
from safetensors.numpy import save_file

import marcache as mc
from marcache import _C
from mar_fixtures import write_tiny_mar
from reference import mar as R
from reference import ops, philox
from tolerance import assert_close, worst_share

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
HEADS = 2
CHANNELS = 16


def subprocess_env(**extra):
    """The environment for a child Python that imports the same marcache as this process
    (the in-place build when conftest put the source tree on sys.path)."""
    env = dict(os.environ)
    import marcache

    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(marcache.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([package_parent, TESTS_DIR] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path, weights) of mar_fixtures' tiny model (width 32, 2 + 2 blocks, heads 2)."""
    path = tmp_path_factory.mktemp("promises") / "tiny.safetensors"
    return path, write_tiny_mar(path)


@pytest.fixture(scope="module")
def tiny_path(tiny):
    return tiny[0]


# ----- CFG on eps only, with the unguided variance -------------------------------------

def variance_dominated(W, eps_gain=1e-2, v_gain=20.0):
    """A copy of W whose head's final Linear has its eps rows (output channels 0..C-1)
    scaled by eps_gain and its v rows (C..2C-1) by v_gain: v, which sets the learned-range
    variance of each DDPM step, then spans tens of units and changes each sample far
    beyond float32 noise (with v_gain 4 a wrong v rule still stayed within the test's
    allowance), while eps stays visible through the x0 prediction."""
    out = dict(W)
    for part in ("weight", "bias"):
        key = R.HEAD + "final_layer.linear." + part
        value = W[key].astype(np.float64).copy()
        value[:CHANNELS] *= eps_gain
        value[CHANNELS:] *= v_gain
        out[key] = value.astype(np.float32)
    return out


def head_sample_variant(W, z_rows, images, positions, seed, temperature, cfg, rule):
    """The 100-step head sampler with CFG (z_rows: n conditional rows then n unconditional
    ones), its eps and v chosen by `rule`: "official" (guided eps, v of the conditional
    row: mar.md 5.2 / 6.5), or a wrong variant: "guided_v" (CFG also on v), "uncond_v"
    (v of the unconditional row), "unguided_eps" (eps of the conditional row alone)."""
    tables = R.diffusion_tables()
    n = len(positions)
    x = ops.f64(philox.token_normals(seed, images, positions, philox.STREAM_HEAD_INIT, 0, CHANNELS))
    for j in range(len(tables["timesteps"]) - 1, -1, -1):
        out = R.head_net(W, np.concatenate([x, x]), int(tables["timesteps"][j]), z_rows)
        cond, uncond = out[:n], out[n:]
        eps = ops.cfg_combine(cond, uncond, cfg, CHANNELS)
        v = cond[:, CHANNELS:]
        if rule == "guided_v":
            v = uncond[:, CHANNELS:] + cfg * (cond[:, CHANNELS:] - uncond[:, CHANNELS:])
        elif rule == "uncond_v":
            v = uncond[:, CHANNELS:]
        elif rule == "unguided_eps":
            eps = cond[:, :CHANNELS]
        else:
            assert rule == "official"
        noise = None if j == 0 else philox.token_normals(seed, images, positions, philox.STREAM_HEAD_STEP, j,
                                                         CHANNELS)
        x = ops.ddpm_step(x, eps, v, noise, R.ddpm_coefs(tables, j, temperature))
    return x


def test_cfg_guides_eps_only_and_keeps_the_conditional_variance(tmp_path):
    """README "What is exact": CFG on eps only with unguided variance. The engine's head
    sampler under CFG 3.0, on a head whose v dominates (variance_dominated), equals the
    official rule element-wise, and each wrong rule misses that allowance at least 10 times
    (measured: CFG also on v 36x, v of the unconditional row 25x, unguided eps 1900x), so
    the comparison tells them apart. rtol 1e-5, atol 1e-3: the samples reach |x| ~4.6e4 (x0
    is amplified at the first DDPM steps) and the elements that end small carry the
    float32 rounding of those steps; the engine's worst share measured 0.14."""
    W = variance_dominated(R.random_mar_weights(np.random.default_rng(5), dim=32, depth=2, heads_unused=HEADS,
                                                head_width=32, head_depth=2))
    path = tmp_path / "v_dominated.safetensors"
    save_file(W, str(path), metadata={"heads": str(HEADS)})
    model = mc.load(path)
    rng = np.random.default_rng(6)
    n = 4
    z = rng.standard_normal((2 * n, 32)).astype(np.float32)
    images = np.array([0, 1, 1, 3], np.uint32)
    positions = np.array([7, 0, 200, 255], np.uint32)
    got = model.head_sample(z, images, positions, cfg=3.0, temperature=1.0, seed=21)
    want = head_sample_variant(W, z, images, positions, 21, 1.0, 3.0, "official")
    assert_close(want, R.head_sample(W, z, images, positions, 21, 1.0, 3.0), rtol=1e-12, atol=1e-9,
                 what="this file's sampler against reference.mar.head_sample")
    rtol, atol = 1e-5, 1e-3
    assert_close(got, want, rtol=rtol, atol=atol, what="engine head sample under CFG")
    for rule in ("guided_v", "uncond_v", "unguided_eps"):
        wrong = head_sample_variant(W, z, images, positions, 21, 1.0, 3.0, rule)
        share = worst_share(wrong, want, rtol, atol)
        assert share > 10, f"the wrong rule {rule} would pass the comparison (worst share {share:.3g})"


# ----- progress=True ---------------------------------------------------------------------

class _RecordingTqdm:
    """Stands in for tqdm.auto.tqdm: records what generate asks of the bar."""
    made = []

    def __init__(self, total=None, desc=None, unit=None, **kwargs):
        self.total, self.desc, self.unit, self.updates, self.closed = total, desc, unit, [], False
        _RecordingTqdm.made.append(self)

    def update(self, n=1):
        self.updates.append(n)

    def close(self):
        self.closed = True


def _fake_tqdm_modules(monkeypatch):
    """Makes `from tqdm.auto import tqdm` give _RecordingTqdm, whether tqdm is installed
    or not (the package and its submodule are both replaced for this test only)."""
    import types

    package, auto = types.ModuleType("tqdm"), types.ModuleType("tqdm.auto")
    auto.tqdm = _RecordingTqdm
    package.auto = auto
    package.__path__ = []
    monkeypatch.setitem(sys.modules, "tqdm", package)
    monkeypatch.setitem(sys.modules, "tqdm.auto", auto)
    _RecordingTqdm.made = []


def test_progress_true_drives_one_bar_step_per_ar_step(tiny_path, monkeypatch):
    """README: progress=True shows a tqdm bar. One bar of total=steps, one update per AR
    step, closed at the end; the tokens are those of progress=False."""
    model = mc.load(tiny_path)
    plain = model.generate_tokens(labels=[3, 9], steps=6, cfg=2.0, seed=4)
    _fake_tqdm_modules(monkeypatch)
    with_bar = model.generate_tokens(labels=[3, 9], steps=6, cfg=2.0, seed=4, progress=True)
    assert np.array_equal(with_bar, plain)
    assert len(_RecordingTqdm.made) == 1
    bar = _RecordingTqdm.made[0]
    assert (bar.total, bar.desc, bar.unit, bar.updates, bar.closed) == (6, "MAR", "step", [1] * 6, True)


def test_progress_true_without_tqdm_still_generates(tiny_path, monkeypatch):
    """README: the bar shows "when tqdm is installed": without it, progress=True is silent
    and the tokens are unchanged."""
    model = mc.load(tiny_path)
    plain = model.generate_tokens(labels=[3], steps=4, seed=4)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm` now raises ImportError
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    assert np.array_equal(model.generate_tokens(labels=[3], steps=4, seed=4, progress=True), plain)


def test_progress_true_writes_a_tqdm_bar(tiny_path, capsys):
    """With the real tqdm (the optional "eval" extra), the bar is written to stderr and
    ends at steps/steps."""
    pytest.importorskip("tqdm", reason="tqdm not installed (optional extra, pip install 'marcache[eval]')")
    mc.load(tiny_path).generate_tokens(labels=[3], steps=5, seed=4, progress=True)
    err = capsys.readouterr().err
    assert "MAR" in err and "5/5" in err and "step" in err, err


# ----- threads= ------------------------------------------------------------------------

COUNT_THREADS = r"""
import os, sys
import marcache as mc
before = len(os.listdir("/proc/self/task"))
model = mc.load(sys.argv[1], threads=int(sys.argv[2]))
tokens = model.generate_tokens(labels=[1, 2], steps=2, seed=0)
print(len(os.listdir("/proc/self/task")) - before)
tokens.tofile(sys.argv[3])
"""


@pytest.fixture(scope="module")
def tiny_reference_tokens(tiny):
    """The float64 reference's tokens of labels [1, 2], 2 AR steps, no CFG, seed 0."""
    tokens, _ = R.generate_tokens(tiny[1], np.array([1, 2]), 2, 2, 1.0, "linear", 1.0, 0, 0, HEADS)
    return tokens


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_sets_the_size_of_the_compute_team(tiny, tiny_reference_tokens, tmp_path, threads):
    """README API: load(..., threads=N). A fresh process that loads with threads=N and
    generates has N - 1 more threads than before (the OpenMP team besides the caller;
    OpenBLAS is kept at one thread), and its tokens equal the float64 reference's whatever
    N. rtol 1e-5, atol 1e-2: the head's first DDPM steps multiply the state by ~2e4, so
    tokens reach ~4.4e4 (float32 spacing 4e-3 there) and an element that ends small
    carries that absolute rounding; measured worst share 0.24 for N = 1, 2, 3 (the three
    runs were bitwise identical here)."""
    tiny_path, _ = tiny
    out = tmp_path / "tokens.f32"
    result = subprocess.run([sys.executable, "-c", COUNT_THREADS, str(tiny_path), str(threads), str(out)],
                            capture_output=True, text=True, env=subprocess_env(), timeout=300, cwd=TESTS_DIR)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.split()[-1]) == threads - 1
    tokens = np.fromfile(out, np.float32).reshape(2, 256, CHANNELS)
    assert_close(tokens, tiny_reference_tokens, rtol=1e-5, atol=1e-2, what=f"tokens with threads={threads}")


# ----- build_info()["blas_core"] -----------------------------------------------------------

def _openblas_corename():
    """The core type scipy-openblas32's OpenBLAS reports itself (its own exported
    function, read through ctypes: not marcache's code)."""
    import ctypes

    import scipy_openblas32

    name = scipy_openblas32.get_library()  # "scipy_openblas": also the prefix of its symbols
    lib = ctypes.CDLL(os.path.join(scipy_openblas32.get_lib_dir(), "lib" + name + ".so"))
    getter = getattr(lib, name + "_get_corename")
    getter.restype = ctypes.c_char_p
    return getter().decode()


BLAS_CORE = "import marcache; print(marcache.build_info()['blas_core'])"


def test_blas_core_names_the_kernels_in_use():
    """README Benchmarks: build_info()["blas_core"] says which OpenBLAS kernels are in use:
    the same name OpenBLAS itself reports, and OPENBLAS_CORETYPE, when set, is obeyed."""
    core = mc.build_info()["blas_core"]
    assert isinstance(core, str) and core
    assert core.lower() == _openblas_corename().lower()
    if platform.machine() in ("x86_64", "AMD64"):  # Haswell kernels need an x86-64 CPU with AVX2
        forced = subprocess.run([sys.executable, "-c", BLAS_CORE], capture_output=True, text=True, timeout=120,
                                env=subprocess_env(OPENBLAS_CORETYPE="Haswell"), cwd=TESTS_DIR)
        assert forced.returncode == 0, forced.stderr
        assert forced.stdout.strip().lower() == "haswell"


def test_blas_core_prefers_avx512_kernels_on_amd():
    """README Benchmarks: on AMD CPUs with AVX-512 marcache selects OpenBLAS's SkylakeX
    kernels unless OPENBLAS_CORETYPE is set. Whether this CPU qualifies is read here from
    /proc/cpuinfo; on other CPUs the choice is OpenBLAS's own (checked against it)."""
    env = subprocess_env()
    env.pop("OPENBLAS_CORETYPE", None)
    result = subprocess.run([sys.executable, "-c", BLAS_CORE], capture_output=True, text=True, timeout=120, env=env,
                            cwd=TESTS_DIR)
    assert result.returncode == 0, result.stderr
    with open("/proc/cpuinfo") as f:
        info = f.read()
    flags = next((set(line.split(":", 1)[1].split()) for line in info.splitlines() if line.startswith("flags")),
                 set())
    amd_avx512 = "AuthenticAMD" in info and {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"} <= flags
    if amd_avx512:
        assert result.stdout.strip() == "SkylakeX"
    else:
        assert result.stdout.strip().lower() == _openblas_corename().lower() or "OPENBLAS_CORETYPE" in os.environ


# ----- OpenMP spin bounded on a busy machine ------------------------------------------------------

def _libgomp_spincount(**env_extra):
    """GOMP_SPINCOUNT as libgomp itself reports it (OMP_DISPLAY_ENV=VERBOSE, printed when
    libgomp is loaded) in a child that imports marcache."""
    env = subprocess_env(OMP_DISPLAY_ENV="VERBOSE")
    for key in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        env.pop(key, None)
    env.update(env_extra)
    result = subprocess.run([sys.executable, "-c", "import marcache"], capture_output=True, text=True, timeout=120,
                            env=env, cwd=TESTS_DIR)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip().startswith("GOMP_SPINCOUNT")]
    assert len(lines) == 1, result.stderr
    return lines[0].split("=", 1)[1].strip().strip("'")


def test_openmp_spin_is_bounded_unless_the_user_chose():
    """README threads: marcache bounds libgomp's spin at barriers to 10,000 iterations (its
    default, 300,000, made a MAR-B run 4.4x slower beside two busy processes; 2.3x with the
    bound; benchmarks/bench_busy.py), and leaves GOMP_SPINCOUNT and OMP_WAIT_POLICY alone when
    the user set either. Read from libgomp's own report, so the setting is shown to reach it."""
    from marcache._loader import OPENMP_SPIN_COUNT

    assert _libgomp_spincount() == str(OPENMP_SPIN_COUNT) == "10000"
    assert _libgomp_spincount(GOMP_SPINCOUNT="77") == "77"
    assert _libgomp_spincount(OMP_WAIT_POLICY="ACTIVE") != "10000"


# ----- fp16 overflows above 65504 ------------------------------------------------------------

def test_fp16_overflows_above_65504_as_autocast_does(tiny_path):
    """README: "fp16 overflows above 65504, as under autocast": with dtype="fp16" a Linear
    input rounds to fp16, so a head input of 65519 (rounds to 65504, the largest fp16)
    stays finite and one of +-65520 (rounds to inf) does not; bf16 and fp32 stay finite.
    Which inputs overflow is decided independently by NumPy's float16 rounding."""
    x_values = np.array([65504.0, 65519.0, 65520.0, -65520.0, 1e5], np.float32)
    x = np.zeros((len(x_values), CHANNELS), np.float32)
    x[:, 0] = x_values
    z = np.random.default_rng(3).standard_normal((len(x_values), 32)).astype(np.float32)
    with np.errstate(over="ignore"):
        fp16_finite = np.isfinite(x_values.astype(np.float16))
    assert fp16_finite.tolist() == [True, True, False, False, False]
    with np.errstate(invalid="ignore"):
        out16 = mc.load(tiny_path, dtype="fp16").head(x, z, 5)
    assert np.isfinite(out16).all(axis=1).tolist() == fp16_finite.tolist()
    for dtype in ("fp32", "bf16"):
        assert np.isfinite(mc.load(tiny_path, dtype=dtype).head(x, z, 5)).all(), dtype


# ----- InceptionV3.iter_features ------------------------------------------------------------

def test_iter_features_streams_batches_equal_to_features(tmp_path):
    """README: .iter_features(...) streams. From an array it yields one (pool, logits) pair
    per batch of batch_size (5 images, batch 2: sizes 2, 2, 1); from an iterable of
    batches it pulls one batch per item it yields (it does not read ahead); the
    concatenation equals features() of all images and the float64 reference on one image
    (rtol 1e-4, atol 1e-5 as test_inception's tiny network: pool features are ~1e-1..1
    after 94 float32 convolutions)."""
    from reference import inception as RI

    from marcache.eval import InceptionV3

    weights = RI.random_weights(np.random.default_rng(2), divisor=16, num_classes=10)
    path = tmp_path / "tiny_inception.safetensors"
    save_file(weights, str(path))
    net = InceptionV3.load(str(path), chunk=2)
    images = np.random.default_rng(4).integers(0, 256, (5, 40, 48, 3), dtype=np.uint8)
    pools, logits = net.features(images)
    streamed = list(net.iter_features(images, batch_size=2))
    assert [p.shape[0] for p, _ in streamed] == [2, 2, 1]
    assert np.array_equal(np.concatenate([p for p, _ in streamed]), pools)
    assert np.array_equal(np.concatenate([lg for _, lg in streamed]), logits)

    pulled = []

    def batches():
        for start in range(0, 5, 2):
            pulled.append(start)
            yield images[start:start + 2]

    stream = net.iter_features(batches())
    first = next(stream)
    assert pulled == [0] and first[0].shape[0] == 2
    rest = list(stream)
    assert pulled == [0, 2, 4] and [p.shape[0] for p, _ in rest] == [2, 1]
    assert np.array_equal(np.concatenate([first[0]] + [p for p, _ in rest]), pools)

    want_pool, want_logits = RI.forward(weights, images[:1])
    assert_close(pools[:1], want_pool, rtol=1e-4, atol=1e-5, what="iter_features pool vs reference")
    assert_close(logits[:1], want_logits, rtol=1e-4, atol=1e-5, what="iter_features logits vs reference")


# ----- the converter's peak memory -----------------------------------------------------

def _pickle_str(text):
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def _pickle_int(value):
    return b"J" + struct.pack("<i", value)


def _pickle_tuple(values):
    return b"(" + b"".join(_pickle_int(v) for v in values) + b"t"


def write_torch_zip_checkpoint(path, tensors):
    """A torch.save zip checkpoint {"model_ema": {name: float32 tensor}}, written without
    PyTorch: the pickle (protocol 2) is spelled out opcode by opcode as torch.save writes it
    (torch._utils._rebuild_tensor_v2 over persistent-id storages 'archive/data/<k>'), and
    each tensor's bytes go into the zip one at a time, so writing needs about one tensor of
    memory. Returns the largest tensor's size in bytes."""
    pkl = [b"\x80\x02}", _pickle_str("model_ema"), b"}("]
    for index, (name, shape) in enumerate(tensors.items()):
        numel = int(np.prod(shape))
        strides = [int(np.prod(shape[i + 1:])) for i in range(len(shape))]
        pkl += [_pickle_str(name), b"ctorch._utils\n_rebuild_tensor_v2\n(",
                b"(", _pickle_str("storage"), b"ctorch\nFloatStorage\n", _pickle_str(str(index)),
                _pickle_str("cpu"), _pickle_int(numel), b"tQ",
                _pickle_int(0), _pickle_tuple(shape), _pickle_tuple(strides), b"\x89",
                b"ccollections\nOrderedDict\n)R", b"tR"]
    pkl += [b"us."]
    largest = 0
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", b"".join(pkl))
        z.writestr("archive/byteorder", b"little")
        for index, (name, shape) in enumerate(tensors.items()):
            value = np.full(shape, 0.01 * (index % 7 + 1), np.float32)
            z.writestr(f"archive/data/{index}", value.tobytes())
            largest = max(largest, value.nbytes)
        z.writestr("archive/version", b"3\n")
    return largest


# The child's resident memory before the conversion (VmRSS) and its peak after (VmHWM,
# the high-water mark of the resident set), in bytes, from /proc/self/status.
CONVERT_AND_MEASURE = r"""
import sys
import marcache.convert as conv
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
before = status("VmRSS")
conv.convert("mar", sys.argv[1], sys.argv[2], heads=int(sys.argv[3]))
print(before, status("VmHWM"))
"""


def test_converter_peak_memory_is_about_one_tensor_not_the_checkpoint(tmp_path):
    """README "Weights / Memory": tensors are read and written one at a time, so the
    converter's peak memory is about one tensor, not the checkpoint. A generated MAR
    checkpoint (width 512, 8 + 8 blocks, head 1024 x 6: 333 MiB, largest tensor 12 MiB) is
    converted in a child process, whose peak resident memory (VmHWM) exceeds its resident
    memory before the conversion (VmRSS) by less than 48 MiB: four of the largest tensors,
    a seventh of the checkpoint (an implementation holding the checkpoint or the state
    dict would grow by >= 330 MiB)."""
    shapes = R.mar_shapes(512, 8, 1024, 6)
    src, dst = tmp_path / "checkpoint-last.pth", tmp_path / "converted.safetensors"
    largest = write_torch_zip_checkpoint(src, shapes)
    size = os.path.getsize(src)
    assert size > 300 * 2**20 and largest == 12 * 2**20
    result = subprocess.run([sys.executable, "-c", CONVERT_AND_MEASURE, str(src), str(dst), "8"],
                            capture_output=True, text=True, env=subprocess_env(), timeout=600, cwd=TESTS_DIR)
    assert result.returncode == 0, result.stderr
    before, after = (int(v) for v in result.stdout.split()[-2:])
    growth = after - before
    print(f"checkpoint {size / 2**20:.1f} MiB, largest tensor {largest / 2**20:.1f} MiB, "
          f"peak RSS {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
    assert growth < 48 * 2**20, f"peak RSS grew by {growth / 2**20:.1f} MiB converting a {size / 2**20:.0f} MiB file"
    # The conversion really happened: every tensor, with its values.
    info, _ = _C.safetensors_info(str(dst))
    assert len(info) == len(shapes)

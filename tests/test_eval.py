"""marcache.eval: FID numerics (ADM formula, closed forms, the three trace
forms), Inception Score (both protocols, by hand), incremental Stats, the
ADM .npz formats, the PNG reader, the sweep helper and its documented
pytest example (run on tiny random models), and the sample / fid CLI.

The models here are tiny *random* ones (a MAR and a VAE in the official
key layouts, an FID-Inception of the real topology at 1/16 width): the
numbers test the plumbing, not image quality. A digits-trained demo model
is a separate issue."""
import math
import os
import re
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest

import marcache as mc
from eval_fixtures import CHILD_ENV, TESTS_DIR, write_tiny_eval_files
from marcache import eval as ev
from marcache.png import read_png, write_png
from readme_blocks import readme_sweep_example

HAVE_SCIPY = ev._have_scipy()
METHODS = ["symmetric", "eigvals"] + (["sqrtm"] if HAVE_SCIPY else [])
README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def random_spd(rng, d, scale=1.0):
    a = rng.standard_normal((d, 2 * d))
    return scale * (a @ a.T) / (2 * d) + 0.05 * np.eye(d)


# --------------------------------------------------------------------------
# FID
# --------------------------------------------------------------------------

def sqrtm_denman_beavers(a, iterations=100):
    """Principal square root by the Denman-Beavers iteration (an independent
    algorithm for the test): Y -> (Y + Z^-1) / 2, Z -> (Z + Y^-1) / 2."""
    y, z = a.copy(), np.eye(a.shape[0])
    for _ in range(iterations):
        y, z = (y + np.linalg.inv(z)) / 2, (z + np.linalg.inv(y)) / 2
    return y


def adm_formula(mu1, s1, mu2, s2):
    diff = mu1 - mu2
    return diff.dot(diff) + np.trace(s1) + np.trace(s2) - 2 * np.trace(sqrtm_denman_beavers(s1 @ s2))


@pytest.mark.parametrize("method", METHODS)
def test_fid_is_zero_for_identical_stats(method):
    rng = np.random.default_rng(0)
    mu, s = rng.standard_normal(32), random_spd(rng, 32)
    assert abs(ev.fid((mu, s), (mu, s), method=method)) < 1e-9 * np.trace(s)


@pytest.mark.parametrize("method", METHODS)
def test_fid_closed_form_for_commuting_gaussians(method):
    """Diagonal (and jointly rotated) covariances: Tr sqrt(S1 S2) = sum sqrt(a_i b_i), so
    FID = ||mu1 - mu2||^2 + sum (sqrt a_i - sqrt b_i)^2."""
    rng = np.random.default_rng(1)
    d = 24
    a, b = rng.uniform(0.1, 3.0, d), rng.uniform(0.1, 3.0, d)
    mu1, mu2 = rng.standard_normal(d), rng.standard_normal(d)
    closed = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(a) - np.sqrt(b)) ** 2)
    assert ev.fid((mu1, np.diag(a)), (mu2, np.diag(b)), method=method) == pytest.approx(closed, rel=1e-10)
    q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    s1, s2 = q @ np.diag(a) @ q.T, q @ np.diag(b) @ q.T
    assert ev.fid((mu1, s1), (mu2, s2), method=method) == pytest.approx(closed, rel=1e-9)
    # one dimension by hand: (m1 - m2)^2 + (sqrt(v1) - sqrt(v2))^2
    assert ev.fid(([1.0], [[4.0]]), ([3.0], [[9.0]]), method=method) == pytest.approx(4.0 + 1.0)


@pytest.mark.parametrize("method", METHODS)
def test_fid_equals_direct_adm_formula_on_random_stats(method):
    rng = np.random.default_rng(2)
    d = 48
    x1 = rng.standard_normal((400, d)) @ rng.standard_normal((d, d)) + 1.0
    x2 = rng.standard_normal((300, d)) * rng.uniform(0.5, 2, d) - 0.5
    s1, s2 = np.cov(x1, rowvar=False), np.cov(x2, rowvar=False)
    mu1, mu2 = x1.mean(0), x2.mean(0)
    want = adm_formula(mu1, s1, mu2, s2)
    got = ev.fid(ev.Stats.from_features(x1), ev.Stats.from_features(x2), method=method)
    assert got == pytest.approx(want, rel=1e-8)


def test_fid_auto_uses_sqrtm_with_scipy_and_numpy_without(monkeypatch):
    """Which method ran is recorded by wrapping the three trace-of-sqrt functions."""
    rng = np.random.default_rng(3)
    a = (rng.standard_normal(8), random_spd(rng, 8))
    b = (rng.standard_normal(8), random_spd(rng, 8))
    sym = ev.fid(a, b, method="symmetric")
    ran = []
    for name in ("_trace_sqrt_sqrtm", "_trace_sqrt_eigvals", "_trace_sqrt_symmetric"):
        def recording(*args, _name=name, _inner=getattr(ev, name)):
            ran.append(_name)
            return _inner(*args)
        monkeypatch.setattr(ev, name, recording)
    if HAVE_SCIPY:
        assert ev.fid(a, b) == pytest.approx(sym, rel=1e-9)
        assert ran == ["_trace_sqrt_sqrtm"]
    ran.clear()
    monkeypatch.setattr(ev, "_have_scipy", lambda: False)
    assert ev.fid(a, b) == pytest.approx(sym, rel=1e-12)
    assert ran == ["_trace_sqrt_symmetric"]
    with pytest.raises(ImportError, match="symmetric"):
        ev.fid(a, b, method="sqrtm")
    with pytest.raises(ValueError, match="method"):
        ev.fid(a, b, method="newton")
    with pytest.raises(ValueError, match="different lengths"):
        ev.fid(a, (np.zeros(7), np.eye(7)))


def test_sqrtm_path_retry_and_imaginary_check(monkeypatch):
    """The ADM numerics around sqrtm: a non-finite root is retried with eps on
    both diagonals; a complex root with diagonal imaginary parts > 1e-3 raises,
    smaller ones are dropped."""
    s1, s2 = np.diag([1.0, 4.0]), np.diag([9.0, 1.0])
    calls = []

    def fake_sqrtm(a):
        calls.append(a.copy())
        if len(calls) == 1:
            return np.full_like(a, np.nan)
        return np.diag(np.sqrt(np.diag(a))).astype(complex) + 1e-4j

    monkeypatch.setattr(ev, "_scipy_sqrtm", fake_sqrtm)
    with pytest.warns(UserWarning, match="singular product"):
        tr = ev._trace_sqrt_sqrtm(s1, s2, 1e-6)
    np.testing.assert_allclose(calls[1], (s1 + 1e-6 * np.eye(2)) @ (s2 + 1e-6 * np.eye(2)))
    e = 1e-6  # real part of the fake root: sqrt of the diagonal of (S1 + e)(S2 + e)
    assert tr == pytest.approx(math.sqrt((1 + e) * (9 + e)) + math.sqrt((4 + e) * (1 + e)), rel=1e-12)

    monkeypatch.setattr(ev, "_scipy_sqrtm", lambda a: np.eye(2) + 0.01j * np.eye(2))
    with pytest.raises(ValueError, match="imaginary component"):
        ev._trace_sqrt_sqrtm(s1, s2, 1e-6)


@pytest.mark.skipif(not HAVE_SCIPY, reason="SciPy not installed (optional extra)")
def test_three_trace_forms_agree_on_inception_like_stats():
    """2048-d, rank-deficient sample covariances (N < d), as FID on few samples sees."""
    rng = np.random.default_rng(4)
    d = 256
    f1 = np.abs(rng.standard_normal((200, d)) @ rng.standard_normal((d, d)) / 8)
    f2 = np.abs(rng.standard_normal((300, d)) @ rng.standard_normal((d, d)) / 8)
    a, b = ev.Stats.from_features(f1), ev.Stats.from_features(f2)
    values = [ev.fid(a, b, method=m) for m in ("sqrtm", "eigvals", "symmetric")]
    assert max(values) - min(values) <= 1e-6 * max(values)


# --------------------------------------------------------------------------
# Inception Score
# --------------------------------------------------------------------------

def is_by_hand(rows):
    """exp(mean_i sum_y p_iy (log p_iy - log mean_j p_jy)) with Python floats."""
    probs = []
    for r in rows:
        m = max(r)
        e = [math.exp(v - m) for v in r]
        probs.append([v / sum(e) for v in e])
    k = len(probs[0])
    marginal = [sum(p[y] for p in probs) / len(probs) for y in range(k)]
    kl = [sum(p[y] * (math.log(p[y]) - math.log(marginal[y])) for y in range(k)) for p in probs]
    return math.exp(sum(kl) / len(kl))


def test_inception_score_matches_hand_computation():
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((7, 4)) * 3
    # torch-fidelity: RandomState(2020) shuffle, bounds i * N // splits
    perm = np.random.RandomState(2020).permutation(7)
    shuffled = logits[perm].tolist()
    parts = [shuffled[0:2], shuffled[2:4], shuffled[4:7]]
    scores = [is_by_hand(p) for p in parts]
    got = ev.inception_score(logits, splits=3)
    assert got.mean == pytest.approx(sum(scores) / 3, rel=1e-12)
    assert got.std == pytest.approx(float(np.std(scores)), rel=1e-10) and got.splits == 3
    # ADM: consecutive parts of split_size, no shuffle
    rows = logits.tolist()
    adm = ev.inception_score(logits, protocol="adm", split_size=3)
    want = [is_by_hand(rows[0:3]), is_by_hand(rows[3:6]), is_by_hand(rows[6:7])]
    assert adm.mean == pytest.approx(sum(want) / 3, rel=1e-12) and adm.splits == 3
    assert float(ev.inception_score(logits, splits=1, protocol="torch-fidelity")) == \
        pytest.approx(is_by_hand(rows), rel=1e-12)


def test_inception_score_limits():
    assert ev.inception_score(np.zeros((20, 10)), splits=2).mean == pytest.approx(1.0)
    confident = np.full((30, 10), -50.0)
    confident[np.arange(30), np.arange(30) % 10] = 50.0
    assert ev.inception_score(confident, splits=1).mean == pytest.approx(10.0, rel=1e-6)
    with pytest.raises(ValueError, match="splits"):
        ev.inception_score(np.zeros((3, 4)), splits=4)
    with pytest.raises(ValueError, match="protocol"):
        ev.inception_score(np.zeros((3, 4)), protocol="tf")


# --------------------------------------------------------------------------
# Stats
# --------------------------------------------------------------------------

def test_stats_merged_from_shards_equal_whole_set():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((1000, 40)) * rng.uniform(0.1, 5, 40) + rng.uniform(-100, 100, 40)
    whole = ev.Stats.from_features(x)
    np.testing.assert_allclose(whole.mu, x.mean(0), rtol=0, atol=1e-10 * np.abs(x).max())
    np.testing.assert_allclose(whole.sigma, np.cov(x, rowvar=False), rtol=1e-10, atol=1e-10)
    shards = []
    for lo, hi in [(0, 1), (1, 130), (130, 131), (131, 600), (600, 1000)]:
        st = ev.Stats(40)
        for b in range(lo, hi, 37):  # uneven batches inside each shard
            st.update(x[b:min(b + 37, hi)])
        shards.append(st)
    merged = ev.Stats(40)
    for st in reversed(shards):
        merged.merge(st)
    assert merged.n == 1000
    scale = np.abs(whole.sigma).max()
    assert np.abs(merged.mu - whole.mu).max() <= 1e-10 * np.abs(whole.mu).max()
    assert np.abs(merged.sigma - whole.sigma).max() <= 1e-10 * scale


def test_stats_save_load_and_limits(tmp_path):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((50, 6))
    st = ev.Stats.from_features(x)
    st.save(tmp_path / "s.npz")
    with np.load(tmp_path / "s.npz") as f:
        assert sorted(f.files) == ["mu", "n", "sigma"] and f["sigma"].dtype == np.float64
    back = ev.Stats.load(tmp_path / "s.npz")
    np.testing.assert_array_equal(back.sigma, st.sigma)
    back.merge(ev.Stats.from_features(x))  # with n stored, loaded stats still merge
    assert back.n == 100
    fixed = ev.Stats.from_moments(st.mu, st.sigma)
    with pytest.raises(ValueError, match="without a sample count"):
        fixed.update(x)
    with pytest.raises(ValueError, match="at least 2"):
        ev.Stats.from_features(x[:1]).sigma
    with pytest.raises(ValueError, match="does not match"):
        st.update(np.zeros((2, 5)))


# --------------------------------------------------------------------------
# files: ADM npz, PNG
# --------------------------------------------------------------------------

def test_sample_batch_npz_roundtrip_and_streaming(tmp_path):
    rng = np.random.default_rng(8)
    images = rng.integers(0, 256, (10, 12, 9, 3), dtype=np.uint8)
    path = tmp_path / "samples.npz"
    ev.save_samples(images, path)
    with np.load(path) as f:
        assert f.files == ["arr_0"]
        np.testing.assert_array_equal(f["arr_0"], images)
    batches = list(ev.iter_npz_images(path, batch_size=4))
    assert [len(b) for b in batches] == [4, 4, 2] and ev.npz_image_count(path) == 10
    np.testing.assert_array_equal(np.concatenate(batches), images)
    with pytest.raises(ValueError, match="announced"):
        with ev.SampleWriter(tmp_path / "short.npz", 5, (12, 9, 3)) as w:
            w.write(images[:3])
    assert not (tmp_path / "short.npz").exists()
    with pytest.raises(ValueError, match="uint8"):
        ev.save_samples(images.astype(np.float32), tmp_path / "f.npz")


def _png_with_filters(img):
    """An RGB PNG whose rows use filter types 0..4 in turn (to test the reader)."""
    h, w, _ = img.shape
    data = img.astype(np.int32).reshape(h, w * 3)
    raw = b""
    prev = np.zeros(w * 3, np.int32)
    for y in range(h):
        kind, line = y % 5, data[y]
        left = np.concatenate([np.zeros(3, np.int32), line[:-3]])
        upleft = np.concatenate([np.zeros(3, np.int32), prev[:-3]])
        if kind == 0:
            pred = np.zeros_like(line)
        elif kind == 1:
            pred = left
        elif kind == 2:
            pred = prev
        elif kind == 3:
            pred = (left + prev) >> 1
        else:
            p = left + prev - upleft
            pa, pb, pc = np.abs(p - left), np.abs(p - prev), np.abs(p - upleft)
            pred = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, prev, upleft))
        raw += bytes([kind]) + ((line - pred) & 0xFF).astype(np.uint8).tobytes()
        prev = line

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) +
            chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def test_png_reader(tmp_path):
    rng = np.random.default_rng(9)
    img = rng.integers(0, 256, (11, 13, 3), dtype=np.uint8)
    (tmp_path / "f.png").write_bytes(_png_with_filters(img))
    np.testing.assert_array_equal(read_png(tmp_path / "f.png"), img)
    write_png(tmp_path / "w.png", img)
    np.testing.assert_array_equal(read_png(tmp_path / "w.png"), img)
    (tmp_path / "bad.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match="not a PNG"):
        read_png(tmp_path / "bad.png")


# --------------------------------------------------------------------------
# network-level helpers on a tiny random Inception
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    return write_tiny_eval_files(tmp_path_factory.mktemp("eval"))


def test_reference_from_folder_npz_and_array_agree(tiny_files, tmp_path):
    net = ev.InceptionV3.load(tiny_files["inception"], chunk=4)
    assert not net.standard and net.feature_dim == 128 and net.num_classes == 10
    images = tiny_files["ref_images"]
    from_array = ev.make_reference(images, tmp_path / "a.npz", net, batch_size=5)
    from_folder = ev.make_reference(tiny_files["folder"], tmp_path / "b.npz", net, batch_size=5)
    ev.save_samples(images, tmp_path / "ref_batch.npz")
    from_npz = ev.load_reference(tmp_path / "ref_batch.npz", inception=net, batch_size=7)
    loaded = ev.load_reference(tmp_path / "a.npz")
    pool, _ = net.features(images)
    direct = np.cov(pool.astype(np.float64), rowvar=False)
    # the features differ in float32 rounding with the batch composition (GEMM blocking)
    for st in (from_array, from_folder, from_npz, loaded):
        assert np.abs(st.sigma - direct).max() <= 1e-3 * np.abs(direct).max()
    np.testing.assert_array_equal(from_folder.sigma, from_array.sigma)  # same batches, same pixels
    with pytest.raises(ValueError, match="pass inception"):
        ev.load_reference(tmp_path / "ref_batch.npz")
    assert ev.fid(from_array, from_folder) == pytest.approx(0.0, abs=1e-6)


def test_class_major_labels():
    np.testing.assert_array_equal(ev.class_major_labels(7, 3), [0, 0, 0, 1, 1, 1, 2])
    assert ev.class_major_labels(50000, 50)[-1] == 999
    with pytest.raises(ValueError, match="1001 classes"):
        ev.class_major_labels(50050, 50)


def test_sweep_on_tiny_models(tiny_files, capsys):
    model = mc.load(tiny_files["mar"], vae=tiny_files["vae"])
    net = ev.InceptionV3.load(tiny_files["inception"])
    reference = ev.make_reference(tiny_files["ref_images"], tiny_files["dir"] / "ref.npz", net)
    results = ev.sweep(model, net, {"nocache": mc.NoCache(), "again": mc.NoCache()}, n=6, per_class=2,
                       reference=reference, steps=2, cfg=2.0, batch_size=4)
    a, b = results
    assert a.n == 6 and a.stats.n == 6 and a.logits.shape == (6, 10)
    assert a.fid == pytest.approx(b.fid, rel=1e-9)  # same seed, same labels: the same images
    assert a.fid > 0 and a.inception_score >= 1.0
    assert a.seconds_per_image > 0 and a.flops_per_image == pytest.approx(
        mc.flops(model, steps=2, cfg=2.0).total, rel=1e-9)
    # the images are those of one generate call with the class-major labels
    images = model.generate(labels=[0, 0, 1, 1, 2, 2], steps=2, cfg=2.0, seed=0)
    pool, _ = net.features(images)
    assert ev.fid(a.stats, ev.Stats.from_features(pool)) == pytest.approx(0.0, abs=1e-4)
    print(ev.format_table(results))
    assert re.search(r"nocache\s+6\s+\d+\.\d+\s+\d+\.\d+", capsys.readouterr().out)


def test_readme_pytest_sweep_example_runs(tiny_files, tmp_path):
    """The documented example, verbatim, run by pytest on the tiny random models."""
    (tmp_path / "test_fid_sweep.py").write_text(readme_sweep_example())
    net = ev.InceptionV3.load(tiny_files["inception"])
    ev.make_reference(tiny_files["ref_images"], tmp_path / "ref.npz", net)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(mc.__file__)))
    env = dict(os.environ, MARCACHE_MODEL=str(tiny_files["mar"]), MARCACHE_VAE=str(tiny_files["vae"]),
               MARCACHE_INCEPTION=str(tiny_files["inception"]), MARCACHE_REFERENCE=str(tmp_path / "ref.npz"),
               MARCACHE_FID_N="8", MARCACHE_STEPS="2",
               PYTHONPATH=package_root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                           str(tmp_path / "test_fid_sweep.py")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"policy\s+N\s+FID\s+IS\s+s/img", proc.stdout)
    assert re.search(r"nocache\s+8\s+\d+\.\d+", proc.stdout)


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------

def test_cli_sample_then_fid(tiny_files, tmp_path):
    samples = tmp_path / "samples.npz"
    run = [sys.executable, "-m", "marcache"]
    proc = subprocess.run(run + ["sample", "--model", str(tiny_files["mar"]), "--vae", str(tiny_files["vae"]),
                                 "--n", "5", "--per-class", "2", "--steps", "2", "--cfg", "2.0",
                                 "--batch-size", "2", "--out", str(samples)], cwd=TESTS_DIR, env=CHILD_ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout and "s/image" in proc.stdout
    with np.load(samples) as f:
        arr = f["arr_0"]
    assert arr.shape == (5, 32, 32, 3) and arr.dtype == np.uint8
    model = mc.load(tiny_files["mar"], vae=tiny_files["vae"])
    np.testing.assert_array_equal(arr, model.generate(labels=[0, 0, 1, 1, 2], steps=2, cfg=2.0, seed=0))

    ref = tmp_path / "ref.npz"
    proc = subprocess.run(run + ["reference", str(tiny_files["folder"]), str(ref), "--inception",
                                 str(tiny_files["inception"]), "--quiet"], capture_output=True, text=True,
                          timeout=300, cwd=TESTS_DIR, env=CHILD_ENV)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run(run + ["fid", str(samples), str(ref), "--inception", str(tiny_files["inception"]),
                                 "--splits", "1"], capture_output=True, text=True, timeout=300, cwd=TESTS_DIR, env=CHILD_ENV)
    assert proc.returncode == 0, proc.stderr
    assert "not the standard FID network" in proc.stderr
    value = float(re.search(r"FID: ([0-9.]+)", proc.stdout).group(1))
    net = ev.InceptionV3.load(tiny_files["inception"])
    want = ev.fid(net.stats(arr)[0], ev.load_reference(ref))
    assert value == pytest.approx(want, abs=1e-3)
    result = ev.evaluate(samples, ref, net, batch_size=2, is_protocol="adm")
    assert result["n"] == 5 and result["fid"] == pytest.approx(want, rel=1e-3)
    assert re.search(r"IS:\s+[0-9.]+ \+- [0-9.]+ \(1 splits, torch-fidelity\)", proc.stdout)


def test_cli_rejects_bad_sample_arguments(tiny_files, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "marcache", "sample", "--model", str(tiny_files["mar"]),
                           "--vae", str(tiny_files["vae"]), "--n", "0", "--out", str(tmp_path / "s.npz")],
                          capture_output=True, text=True, timeout=120, cwd=TESTS_DIR, env=CHILD_ENV)
    assert proc.returncode == 2 and "--n, --per-class and --batch-size must be >= 1" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "marcache", "fid", str(tmp_path / "none.npz"),
                           str(tmp_path / "ref.npz"), "--inception", str(tiny_files["inception"])],
                          capture_output=True, text=True, timeout=120, cwd=TESTS_DIR, env=CHILD_ENV)
    assert proc.returncode == 2 and "error:" in proc.stderr

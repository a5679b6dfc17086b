"""marcache.eval.frontier / plot_frontier and `demo --frontier` (issue 20) on the shipped
digits model, small: every number of a row against an independent computation (FLOPs
from marcache.flops, accuracy and digits-FID from the images generated again), the
Pareto flags against a brute-force check, bad input, the optional matplotlib."""
import subprocess
import sys

import numpy as np
import pytest

import marcache as mc
from marcache import eval as E
from child_env import child_env

STEPS, CFG, N = 3, 2.0, 20


@pytest.fixture(scope="module")
def digits_frontier():
    model = mc.digits.load_model()
    classifier = mc.digits.Classifier.load()
    policies = {"NoCache": mc.NoCache(), "DiSA": mc.DiSA(start=20, end=4),
                "LazyMAR+DiSA": mc.DiSA(start=20, end=4, inner=mc.LazyMAR(start=1, period=2))}
    result = E.frontier(model, classifier, policies, N, per_class=2, seed=7, batch_size=8, steps=STEPS, cfg=CFG)
    return model, classifier, policies, result


def test_rows_are_the_policies_measured_numbers(digits_frontier):
    model, classifier, policies, result = digits_frontier
    assert [r.name for r in result.rows] == list(policies)
    labels = mc.digits.class_labels(2)
    data = mc.digits.load_data()
    train = classifier.features(data["images"][data["train"]])
    for r in result.rows:
        policy = policies[r.name]
        images = np.concatenate([model.generate(labels=labels[s:s + 8], seed=7, first_index=s, steps=STEPS, cfg=CFG,
                                                cache=policy) for s in range(0, N, 8)])
        assert r.accuracy == pytest.approx(float(np.mean(classifier.predict(images) == labels)), abs=0)
        assert r.fid == pytest.approx(mc.digits.fid(classifier.features(images), train), rel=1e-9)
        per_batch = sum(mc.flops(model, steps=STEPS, cfg=CFG, cache=policy, batch=len(labels[s:s + 8])).total
                        for s in range(0, N, 8))
        assert r.flops_per_image == pytest.approx(per_batch / N, rel=1e-12)
        assert r.seconds_per_image > 0 and r.n == N
    base = result.rows[0]
    for r in result.rows:
        assert r.flop_ratio == pytest.approx(base.flops_per_image / r.flops_per_image)
        assert r.speedup == pytest.approx(base.seconds_per_image / r.seconds_per_image)
    assert result.rows[2].flop_ratio > result.rows[1].flop_ratio > 1.0


def test_pareto_set_is_the_non_dominated_rows(digits_frontier):
    *_, result = digits_frontier
    points = [(r.seconds_per_image, r.fid) for r in result.rows]
    for r, (t, q) in zip(result.rows, points):
        beaten = any(t2 <= t and q2 <= q and (t2, q2) != (t, q) for t2, q2 in points)
        assert r.pareto == (not beaten)
    assert result.pareto and all(r.pareto for r in result.pareto)
    assert [r.seconds_per_image for r in result.pareto] == sorted(r.seconds_per_image for r in result.pareto)
    assert "policy" in result.table() and "*" in result.table()


def test_plot_frontier_writes_a_png(digits_frontier, tmp_path):
    pytest.importorskip("matplotlib")
    *_, result = digits_frontier
    path = tmp_path / "frontier.png"
    E.plot_frontier(result, str(path), title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_frontier_without_matplotlib_says_what_to_install(digits_frontier, monkeypatch):
    *_, result = digits_frontier
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        E.plot_frontier(result, "unused.png")


def test_frontier_bad_input():
    model = mc.digits.load_model()
    classifier = mc.digits.Classifier.load()
    with pytest.raises(ValueError, match="quality must be 'fid' or 'accuracy'"):
        E.frontier(model, classifier, [mc.NoCache()], 10, quality="speed")
    with pytest.raises(TypeError, match="classifier_or_inception must be"):
        E.frontier(model, object(), [mc.NoCache()], 10)
    with pytest.raises(ValueError, match="policies is empty"):
        E.frontier(model, classifier, {}, 10)
    with pytest.raises(ValueError, match="n must be a positive integer"):
        E.frontier(model, classifier, [mc.NoCache()], 0)
    with pytest.raises(ValueError, match="takes no setting 'stepz'"):
        E.frontier(model, classifier, [mc.NoCache()], 10, stepz=3)


def test_demo_frontier_cli(tmp_path):
    out = tmp_path / "f.png"
    env = child_env()
    proc = subprocess.run([sys.executable, "-m", "marcache", "demo", "--frontier", "--per-class", "1", "--steps", "2",
                           "--batch", "5", "--out", str(out)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("NoCache", "LazyMAR", "MARche", "DiSA", "LazyMAR+DiSA", "MARche+DiSA"):
        assert name in proc.stdout
    assert "Pareto" in proc.stdout
    try:
        import matplotlib  # noqa: F401
        assert out.read_bytes()[:4] == b"\x89PNG"
    except ImportError:
        assert "no plot" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "marcache", "demo", "--frontier", "--cache", "lazymar"], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "leave out --cache" in bad.stderr

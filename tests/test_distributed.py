"""marcache.distributed (issue 19) on a local Ray (2 CPUs, workers of 1 thread), with the
tiny random MAR, VAE and Inception of eval_fixtures: (a) every image bitwise equal to a
single-process run; (b) merged mu / sigma equal to the single-process statistics within
1e-12 relative and FID within 1e-9, for 1, 2 and 3 shards of uneven sizes; (c) a worker
killed in the middle of its shard (a test hook: os._exit before a chosen image) and the
sweep still gives the same FID; (d) the merged .npz equal to the single-process CLI's,
byte for byte. The shard merge itself (exactly once, any order) is checked without Ray.

Skips without Ray (an optional extra), unless MARCACHE_REQUIRE_RAY=1, where it fails."""
import dataclasses
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import marcache as mc
from eval_fixtures import CHILD_ENV, TESTS_DIR, write_tiny_eval_files
from marcache import chunks as ch
from marcache import distributed as dist
from marcache import eval as ev

N, PER_CLASS, BATCH = 14, 3, 2
SETTINGS = dict(steps=2, cfg=2.0)


def _rel(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


# --------------------------------------------------------------------------
# the merge, without Ray
# --------------------------------------------------------------------------

def _fake_result(shard, chunks, x, shift):
    d = x - shift
    return dist.ShardResult(shard=shard, start=chunks[0].start, stop=chunks[-1].stop, n=len(x),
                            sum_x=d.sum(axis=0), sum_xxt=d.T @ d, logits=x[:, :3].astype(np.float32), images=None,
                            chunks=chunks, generate_seconds=0.0, inception_seconds=0.0, flops=0.0, worker_pid=0,
                            attempt=0)


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_merge_of_uneven_shards_in_any_order_equals_whole_set(shards):
    """(n, sum x, sum x x^T) add: any partition into shards and any arrival order give
    the whole set's mean and covariance up to float64 rounding of the additions."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((37, 16)) * 0.3 + 2.0).astype(np.float32).astype(np.float64)
    shift = x[:5].mean(axis=0)  # a shift near the mean, as the reference's mu is
    plan = ch.shard_plan(ch.chunk_plan(37, 2, 2), shards)  # 19 chunks: shards of uneven size
    results = [_fake_result(i, s, x[s[0].start:s[-1].stop], shift) for i, s in enumerate(plan)]
    want_mu, want_sigma = x.mean(axis=0), np.cov(x, rowvar=False)
    for order in (results, results[::-1]):
        merger = dist.ShardMerger(plan, shift)
        for r in order:
            assert merger.add(r)
        st = merger.stats()
        assert st.n == 37
        assert _rel(st.mu, want_mu) < 1e-12 and _rel(st.sigma, want_sigma) < 1e-12
        np.testing.assert_array_equal(merger.logits(), x[:, :3].astype(np.float32))  # index order


def test_a_shard_counted_once_and_ranges_checked():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((8, 4))
    plan = ch.shard_plan(ch.chunk_plan(8, 2, 2), 2)
    merger = dist.ShardMerger(plan)
    first = _fake_result(0, plan[0], x[:4], 0.0)
    assert merger.add(first) and not merger.add(first)  # arrives twice, counted once
    assert merger.duplicates == 1 and merger.n == 4 and not merger.complete
    with pytest.raises(ValueError, match=r"shards not merged yet: \[1\]"):
        merger.stats()
    with pytest.raises(ValueError, match="the plan says 4..7"):
        merger.add(dataclasses.replace(_fake_result(1, plan[1], x[4:], 0.0), start=3))
    with pytest.raises(ValueError, match="not in the plan"):
        merger.add(_fake_result(2, plan[1], x[4:], 0.0))
    assert merger.add(_fake_result(1, plan[1], x[4:], 0.0)) and merger.complete
    assert _rel(merger.stats().sigma, np.cov(x, rowvar=False)) < 1e-12


def test_executor_argument_is_checked():
    with pytest.raises(ValueError, match="executor must be None, 'ray'"):
        dist.as_executor("dask")
    with pytest.raises(ValueError, match="workers >= 1"):
        dist.RayExecutor(workers=0)


# --------------------------------------------------------------------------
# on a local Ray
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_session():
    try:
        import ray
    except ImportError:
        if os.environ.get("MARCACHE_REQUIRE_RAY") == "1":
            pytest.fail("MARCACHE_REQUIRE_RAY=1 but ray is not installed (pip install 'marcache[ray]')")
        pytest.skip("ray not installed (optional extra marcache[ray])")
    # the workers import the marcache under test: the raylet and its workers inherit the
    # environment of ray.init
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = CHILD_ENV["PYTHONPATH"]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()
    if saved is None:
        del os.environ["PYTHONPATH"]
    else:
        os.environ["PYTHONPATH"] = saved


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    files = write_tiny_eval_files(tmp_path_factory.mktemp("dist"))
    model = mc.load(files["mar"], vae=files["vae"], threads=1)
    net = ev.InceptionV3.load(files["inception"], threads=1)
    reference = ev.make_reference(files["ref_images"], files["dir"] / "ref.npz", net)
    single = ev.sweep(model, net, {"nocache": mc.NoCache()}, n=N, per_class=PER_CLASS, reference=reference,
                      batch_size=BATCH, **SETTINGS)[0]
    return dict(files, model=model, net=net, reference=reference, single=single)


def _executor(workers=2, shards_per_worker=2, chunk_images=BATCH, **kw):
    return dist.RayExecutor(workers=workers, threads_per_worker=1, shards_per_worker=shards_per_worker,
                            chunk_images=chunk_images, **kw)


def test_images_bitwise_equal_single_process(ray_session, tiny):
    spec = dist.ModelSpec.from_model(tiny["model"])
    images = _executor().images(spec, mc.NoCache(), N, PER_CLASS, batch_size=BATCH, **SETTINGS)
    labels = ev.class_major_labels(N, PER_CLASS)
    want = np.concatenate([tiny["model"].generate(labels=labels[s:s + BATCH], seed=0, first_index=s, **SETTINGS)
                           for s in range(0, N, BATCH)])
    assert images.shape == want.shape and images.dtype == np.uint8
    np.testing.assert_array_equal(images, want)


@pytest.mark.parametrize("workers,shards_per_worker", [(1, 1), (2, 1), (1, 3)])
def test_sweep_statistics_equal_single_process(ray_session, tiny, workers, shards_per_worker):
    """1, 2 and 3 shards of 7 chunks (7; 3 + 4; 2 + 2 + 3 chunks of 2 images)."""
    single = tiny["single"]
    executor = _executor(workers, shards_per_worker)
    result = ev.sweep(tiny["model"], tiny["net"], {"nocache": mc.NoCache()}, n=N, per_class=PER_CLASS,
                      reference=tiny["reference"], batch_size=BATCH, executor=executor, **SETTINGS)[0]
    assert executor.workers == workers
    assert result.n == N and result.stats.n == N
    assert _rel(result.stats.mu, single.stats.mu) < 1e-12
    assert _rel(result.stats.sigma, single.stats.sigma) < 1e-12
    assert result.fid == pytest.approx(single.fid, rel=1e-9, abs=1e-9)
    np.testing.assert_array_equal(result.logits, single.logits)  # the same features, in index order
    assert result.inception_score == pytest.approx(single.inception_score, rel=1e-12)
    assert result.flops_per_image == pytest.approx(single.flops_per_image, rel=1e-12)


def test_worker_killed_mid_shard_is_rerun_and_fid_unchanged(ray_session, tiny, tmp_path):
    # 2 shards of 8 and 6 images; shard 0's worker exits before image 4 (after two of its
    # four batches): the shard is rerun on a new worker, and counted once
    executor = _executor(2, 1, chunk_images=4, _exit_at=f"4:{tmp_path / 'fired'}")
    result = ev.sweep(tiny["model"], tiny["net"], [mc.NoCache()], n=N, per_class=PER_CLASS,
                      reference=tiny["reference"], batch_size=BATCH, executor=executor, **SETTINGS)[0]
    assert (tmp_path / "fired").exists() and executor.last_run["failures"] == 1
    assert result.stats.n == N
    assert result.fid == pytest.approx(tiny["single"].fid, rel=1e-9, abs=1e-9)
    assert _rel(result.stats.sigma, tiny["single"].stats.sigma) < 1e-12


def test_worker_that_keeps_dying_fails_after_bounded_retries(ray_session, tiny):
    executor = _executor(1, 1, max_retries=0, _exit_at="0")
    with pytest.raises(RuntimeError, match=r"shard 0 \(images 0..13\): its worker died 1 times \(max_retries 0\)"):
        executor.images(dist.ModelSpec.from_model(tiny["model"]), mc.NoCache(), N, PER_CLASS, batch_size=BATCH,
                        **SETTINGS)


def test_sample_npz_equals_single_process_cli(ray_session, tiny, tmp_path):
    common = ["--model", str(tiny["mar"]), "--vae", str(tiny["vae"]), "--n", str(N), "--per-class", str(PER_CLASS),
              "--steps", "2", "--cfg", "2.0", "--batch-size", str(BATCH), "--chunk-size", "4", "--threads", "1"]
    single = tmp_path / "single.npz"
    proc = subprocess.run([sys.executable, "-m", "marcache", "sample", *common, "--out", str(single)],
                          cwd=TESTS_DIR, env=CHILD_ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "ray.npz"
    _executor(2, 2, chunk_images=4).sample(dist.ModelSpec.from_model(tiny["model"]), out, mc.NoCache(), N,
                                           PER_CLASS, batch_size=BATCH, **SETTINGS)
    assert out.read_bytes() == single.read_bytes()
    assert not os.path.exists(str(out) + ".parts")

    # the CLI on its own local Ray (a second Ray on this machine: joining the test's would need
    # its session token): the same file, and FID straight from the workers' sums in one run
    cli = tmp_path / "cli.npz"
    proc = subprocess.run([sys.executable, "-m", "marcache", "sample", *common, "--ray", "--workers", "2",
                           "--fid", str(tiny["dir"] / "ref.npz"), "--inception", str(tiny["inception"]),
                           "--out", str(cli)], cwd=TESTS_DIR, env=CHILD_ENV, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert cli.read_bytes() == single.read_bytes()
    assert f"FID: {tiny['single'].fid:.4f}" in proc.stdout


def test_ctrl_c_on_the_driver_kills_the_workers(ray_session, tiny, monkeypatch):
    """A KeyboardInterrupt in the driver's wait loop (raised from ray.wait at its first
    call: deterministic, no signal timing) propagates, and the worker processes end."""
    real_wait = ray_session.wait

    def interrupted(*args, **kwargs):
        real_wait(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(ray_session, "wait", interrupted)
    executor = _executor(2, 1)
    with pytest.raises(KeyboardInterrupt):
        executor.images(dist.ModelSpec.from_model(tiny["model"]), mc.NoCache(), N, PER_CLASS, batch_size=BATCH,
                        **SETTINGS)
    monkeypatch.undo()
    assert len(executor.worker_pids) == 2
    deadline = time.monotonic() + 60
    alive = list(executor.worker_pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _running(pid)]
        time.sleep(0.2)
    assert not alive, f"worker processes {alive} still run after Ctrl-C"


def _running(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has ended
        return f.read().split(")")[-1].split()[0] != "Z"

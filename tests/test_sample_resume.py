"""Resumable `python -m marcache sample` (issue 18): chunk plans, the part store and its
manifest, a run killed at a chosen image (the MARCACHE_TEST_EXIT_AT hook, no timing)
and resumed gives the bytes of an uninterrupted run, and a changed setting refuses to
resume, naming it."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import marcache as mc
from eval_fixtures import CHILD_ENV, TESTS_DIR, write_tiny_eval_files
from marcache import chunks as ch
from marcache import eval as ev


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    return write_tiny_eval_files(tmp_path_factory.mktemp("resume"))


def test_chunk_plan_is_whole_batches_and_shards_are_balanced():
    plan = ch.chunk_plan(10, batch_size=3, chunk_images=4)  # 4 rounds up to 6 = two batches
    assert [(c.start, c.stop) for c in plan] == [(0, 6), (6, 10)]
    plan = ch.chunk_plan(14, batch_size=2, chunk_images=2)
    assert [c.size for c in plan] == [2] * 7
    shards = ch.shard_plan(plan, 3)
    assert [len(s) for s in shards] == [2, 2, 3]
    assert [c for s in shards for c in s] == plan  # every chunk once, in order
    assert len(ch.shard_plan(plan, 50)) == 7  # at most one shard per chunk
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            ch.chunk_plan(10, bad)


def test_file_identity_tells_files_apart(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
    a.write_bytes(data.tobytes())
    data[-1] ^= 1  # the last byte: in the sampled last MiB
    b.write_bytes(data.tobytes())
    assert ch.file_identity(a) != ch.file_identity(b)
    assert ch.file_identity(a) == ch.file_identity(a)


def _sample(tiny_files, out, *extra, env=None):
    cmd = [sys.executable, "-m", "marcache", "sample", "--model", str(tiny_files["mar"]), "--vae",
           str(tiny_files["vae"]), "--n", "10", "--per-class", "3", "--steps", "2", "--cfg", "2.0",
           "--batch-size", "2", "--chunk-size", "4", "--out", str(out), *extra]
    return subprocess.run(cmd, cwd=TESTS_DIR, env=dict(CHILD_ENV, **(env or {})), capture_output=True, text=True,
                          timeout=300)


def test_killed_sample_resumes_to_the_same_bytes(tiny_files, tmp_path):
    whole = tmp_path / "whole.npz"
    proc = _sample(tiny_files, whole)
    assert proc.returncode == 0, proc.stderr
    assert not os.path.exists(str(whole) + ".parts") and not os.path.exists(str(whole) + ".partial")
    model = mc.load(tiny_files["mar"], vae=tiny_files["vae"])
    labels = ev.class_major_labels(10, 3)
    want = np.concatenate([model.generate(labels=labels[s:s + 2], steps=2, cfg=2.0, seed=0, first_index=s)
                           for s in range(0, 10, 2)])
    with np.load(whole) as f:
        np.testing.assert_array_equal(f["arr_0"], want)

    # chunks [0, 4), [4, 8), [8, 10); the process dies before the batch holding image 6,
    # with chunk 0 complete and chunk 1 half written
    out = tmp_path / "resumed.npz"
    proc = _sample(tiny_files, out, env={ch.EXIT_HOOK_ENV: "6"})
    assert proc.returncode == ch.EXIT_HOOK_STATUS, proc.stderr
    parts = str(out) + ".parts"
    with open(os.path.join(parts, ch.MANIFEST)) as f:
        manifest = json.load(f)
    assert manifest["done"] == [[0, 4]] and manifest["format"] == ch.FORMAT_VERSION
    assert manifest["settings_sha256"] == ch.settings_hash(manifest["settings"])
    assert os.path.exists(os.path.join(parts, "chunk-0000000004-0000000008.npy.partial"))
    assert not os.path.exists(out)

    proc = _sample(tiny_files, out)
    assert proc.returncode == 0, proc.stderr
    assert "resuming" in proc.stderr and "4 of 10 images" in proc.stderr
    assert "4 resumed" in proc.stdout
    assert out.read_bytes() == whole.read_bytes()
    assert not os.path.exists(parts) and not os.path.exists(str(out) + ".partial")


def test_changed_setting_refuses_to_resume(tiny_files, tmp_path):
    out = tmp_path / "s.npz"
    proc = _sample(tiny_files, out, env={ch.EXIT_HOOK_ENV: "4"})
    assert proc.returncode == ch.EXIT_HOOK_STATUS, proc.stderr
    proc = _sample(tiny_files, out, "--cfg", "3.0")
    assert proc.returncode == 2
    assert "setting 'generate.cfg' differs" in proc.stderr and "then 2.0, now 3.0" in proc.stderr
    assert "--restart" in proc.stderr
    # --restart discards the parts and runs the new settings from the start
    proc = _sample(tiny_files, out, "--cfg", "3.0", "--restart")
    assert proc.returncode == 0, proc.stderr
    assert "resuming" not in proc.stderr
    model = mc.load(tiny_files["mar"], vae=tiny_files["vae"])
    with np.load(out) as f:
        np.testing.assert_array_equal(f["arr_0"][:2], model.generate(labels=[0, 0], steps=2, cfg=3.0, seed=0))


def test_part_store_rejects_a_different_model_file(tiny_files, tmp_path):
    model = mc.load(tiny_files["mar"], vae=tiny_files["vae"])
    plan = ch.chunk_plan(4, 2, 2)
    settings = ch.run_settings(model, 4, 2, 0, 2, plan, mc.NoCache(), {"steps": 2})
    store = ch.PartStore(tmp_path / "o.npz", settings)
    store.write_chunk(plan[0], [np.zeros((2, 8, 8, 3), np.uint8)])
    store.mark_done(plan[0])
    changed = {"model.sha256_ends": dict(settings, model=dict(settings["model"], sha256_ends="0" * 64)),
               "seed": ch.run_settings(model, 4, 2, 1, 2, plan, mc.NoCache(), {"steps": 2}),
               "cache.policy": ch.run_settings(model, 4, 2, 0, 2, plan, mc.LazyMAR(), {"steps": 2}),
               "generate.steps": ch.run_settings(model, 4, 2, 0, 2, plan, mc.NoCache(), {"steps": 3}),
               "chunk_images": ch.run_settings(model, 4, 2, 0, 2, ch.chunk_plan(4, 2, 4), mc.NoCache(),
                                               {"steps": 2})}
    for name, other in changed.items():
        with pytest.raises(ValueError, match=f"setting '{name}' differs"):
            ch.PartStore(tmp_path / "o.npz", other)
    assert ch.PartStore(tmp_path / "o.npz", settings).pending(plan) == plan[1:]
    # a part cut short is not counted as done
    with open(store.part_path(plan[0]), "r+b") as f:
        f.truncate(os.path.getsize(store.part_path(plan[0])) - 1)
    assert ch.PartStore(tmp_path / "o.npz", settings).pending(plan) == plan

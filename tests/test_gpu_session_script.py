"""tools/gpu_session.sh builds before `tests` and `bench` when no CUDA-enabled
extension imports (issue 21, point 2: a separate device call starts on a bare
machine). Runs the script here with a stand-in Python that records its calls and
says "CUDA build present" only after a `setup.py build_ext` call, and a stand-in
nvidia-smi; nothing is compiled."""
import os
import shutil
import stat
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, os.pardir, "tools", "gpu_session.sh")

FAKE_PYTHON = """#!/usr/bin/env bash
echo "python $*" >> "$FAKE_LOG"
case "$*" in
    *setup.py*build_ext*) touch "$FAKE_BUILT" ;;
    *build_info*cuda*) [ -e "$FAKE_BUILT" ] || exit 1 ;;
esac
exit 0
"""


def _executable(path, text):
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)


@pytest.fixture
def session_tree(tmp_path):
    (tmp_path / "tools").mkdir()
    (tmp_path / "tests").mkdir()
    shutil.copy(SCRIPT, tmp_path / "tools" / "gpu_session.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "python", FAKE_PYTHON)
    _executable(bin_dir / "nvidia-smi", "#!/bin/sh\necho 'fake GPU'\n")
    return tmp_path


def run_session(tree, *steps, built=False):
    log, marker = tree / "calls.log", tree / "built"
    if log.exists():
        log.unlink()
    if built:
        marker.touch()
    elif marker.exists():
        marker.unlink()
    env = dict(os.environ, PYTHON=str(tree / "bin" / "python"), OUT=str(tree / "out"),
               PATH=str(tree / "bin") + os.pathsep + os.environ["PATH"],
               FAKE_LOG=str(log), FAKE_BUILT=str(marker))
    proc = subprocess.run(["bash", "tools/gpu_session.sh"] + list(steps), cwd=tree, env=env,
                          capture_output=True, text=True, timeout=60)
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, calls


def _index(calls, fragment):
    hits = [i for i, c in enumerate(calls) if fragment in c]
    return hits[0] if hits else None


@pytest.mark.parametrize("step,runs", [("tests", "-m pytest"), ("bench", "bench_gpu.py"),
                                       ("var", "bench_var_gpu.py"), ("profile", "profile_var_gpu.py")])
def test_step_builds_when_the_extension_is_missing(session_tree, step, runs):
    proc, calls = run_session(session_tree, step)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    build, run = _index(calls, "setup.py build_ext"), _index(calls, runs)
    assert build is not None, "no build before %r: %r" % (step, calls)
    assert run is not None and build < run, calls


@pytest.mark.parametrize("step,runs", [("tests", "-m pytest"), ("bench", "bench_gpu.py"),
                                       ("var", "bench_var_gpu.py"), ("profile", "profile_var_gpu.py")])
def test_step_does_not_rebuild_a_cuda_build(session_tree, step, runs):
    proc, calls = run_session(session_tree, step, built=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _index(calls, "setup.py build_ext") is None, calls
    assert _index(calls, runs) is not None, calls


def test_build_tests_builds_once(session_tree):
    proc, calls = run_session(session_tree, "build", "tests")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sum("setup.py build_ext" in c for c in calls) == 1, calls


def test_var_runs_both_var_benchmarks_and_passes_arguments_through(session_tree):
    """`var` alone runs the official comparison and the FastVAR GPU point; `var ARGS`
    passes ARGS to bench_var_gpu.py only."""
    proc, calls = run_session(session_tree, "var", built=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _index(calls, "bench_var_gpu.py") is not None, calls
    fastvar = _index(calls, "bench_var.py --fastvar")
    assert fastvar is not None and "--device cuda --dtype bf16" in calls[fastvar], calls
    proc, calls = run_session(session_tree, "var", "--models", "d16", "--batches", "16", built=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = _index(calls, "bench_var_gpu.py")
    assert run is not None and "--models d16 --batches 16" in calls[run], calls
    assert _index(calls, "bench_var.py --fastvar") is None, calls


def test_profile_defaults_and_passes_arguments_through(session_tree):
    """`profile` alone profiles VAR-d16 at batch 16; `profile ARGS` passes ARGS; both write
    the JSON into $OUT."""
    proc, calls = run_session(session_tree, "profile", built=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = _index(calls, "profile_var_gpu.py")
    assert run is not None and "--model d16 --batch 16 --json" in calls[run], calls
    proc, calls = run_session(session_tree, "profile", "--model", "d30", "--batch", "64", built=True)
    run = _index(calls, "profile_var_gpu.py")
    assert run is not None and "--model d30 --batch 64 --json" in calls[run], calls

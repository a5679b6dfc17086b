"""The README's set-up block, verbatim, as a newcomer runs it (issue 17): a fresh clone of
this repository in a scratch folder, a fresh virtual environment, and the block's commands
run from the clone's root. Then the tests block's install line verbatim and its
`python -m pytest` on the tests that start subprocesses (the ones a source tree without a
built extension broke); MARCACHE_SETUP_FULL_SUITE=1 runs the line verbatim (the whole suite).

It builds the extension from scratch and fetches the build dependencies from the package
index. Measured on the shared 2-core machine (load average 10-17): clone, venv and
`pip install -e .` about 1 minute; the demo (300 digits) several minutes under that load
(25 s idle). CI runs it; set MARCACHE_SKIP_SETUP_TEST=1 to skip it locally.
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
README = os.path.join(REPO_ROOT, "README.md")
# the subprocess-starting tests that failed from a clone's root before issue 17
SUBPROCESS_TESTS = ["tests/test_eval.py::test_cli_sample_then_fid", "tests/test_cli_cache.py"]

pytestmark = pytest.mark.skipif(os.environ.get("MARCACHE_SKIP_SETUP_TEST") == "1",
                                reason="MARCACHE_SKIP_SETUP_TEST=1 (the fresh-clone set-up takes minutes)")


def readme_block(name):
    """The commands of the ```bash block that follows `<!-- readme: NAME -->`, comments dropped."""
    text = open(README).read()
    match = re.search(r"<!-- readme: %s -->\s*```bash\n(.*?)```" % re.escape(name), text, re.S)
    assert match, f"README.md has no block marked <!-- readme: {name} -->"
    commands = []
    for line in match.group(1).splitlines():
        command = line.split("  #")[0].strip()
        if command:
            commands.append(command)
    return commands


def test_readme_blocks_are_found():
    assert readme_block("setup")[0] == "pip install -e ."
    assert "python -m pytest" in readme_block("tests")


def run_in_venv(command, clone, venv, timeout):
    env = dict(os.environ, VIRTUAL_ENV=str(venv), PATH=str(venv / "bin") + os.pathsep + os.environ["PATH"],
               MARCACHE_SKIP_SETUP_TEST="1")  # the clone's own run of this file must not recurse
    # One engine thread unless the caller chose: on a shared, loaded 2-core machine the demo's
    # OpenMP threads waiting for each other made it 10x slower (see test_notebooks.py).
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    for key in ("PYTHONPATH", "PYTHONHOME"):
        env.pop(key, None)
    proc = subprocess.run(["bash", "-c", command], cwd=str(clone), env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (f"`{command}` failed in a fresh clone ({proc.returncode})\n--- stdout\n"
                                  f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    return proc


def test_readme_setup_block_from_a_fresh_clone(tmp_path):
    if shutil.which("git") is None or not os.path.exists(os.path.join(REPO_ROOT, ".git")):
        pytest.skip("not a git checkout (an installed copy of the tests): nothing to clone")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", REPO_ROOT, str(clone)], check=True, timeout=300,
                   cwd=str(tmp_path))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300, cwd=str(tmp_path))

    setup = readme_block("setup")
    for command in setup:
        proc = run_in_venv(command, clone, venv, timeout=1800)
    # the demo ran from the clone's root (the source folder first on sys.path)
    assert "NoCache" in proc.stdout and "MARche" in proc.stdout, proc.stdout
    assert (clone / "demo.png").exists()

    tests = readme_block("tests")
    for command in tests:
        if command == "python -m pytest" and os.environ.get("MARCACHE_SETUP_FULL_SUITE") != "1":
            command = "python -m pytest -q " + " ".join(SUBPROCESS_TESTS)
        run_in_venv(command, clone, venv, timeout=3600)

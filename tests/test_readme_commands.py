"""Every short shell command of the README that runs on the shipped digits model (the blocks
marked `<!-- readme: commands -->`) runs as written, from a scratch folder, within a bounded
time (issue 17). The set-up blocks are run by tests/test_readme_setup.py in a fresh clone."""
import os
import re
import shlex
import subprocess
import sys

import pytest

import marcache as mc

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(mc.__file__)))


def readme_commands():
    text = open(README).read()
    blocks = re.findall(r"<!-- readme: commands -->\s*```bash\n(.*?)```", text, re.S)
    commands = []
    for block in blocks:
        for line in block.splitlines():
            command = line.split("  #")[0].strip()
            if command:
                commands.append(command)
    return commands


COMMANDS = readme_commands()


def test_readme_has_runnable_command_blocks():
    assert len(COMMANDS) >= 6, COMMANDS
    assert any(c.startswith("python -m marcache sample --model digits") for c in COMMANDS)
    assert any(c.startswith("python -m marcache fid ") and c.endswith(" digits") for c in COMMANDS)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    # one folder for every command, in README order: fid reads what sample wrote
    return tmp_path_factory.mktemp("readme")


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_runs(command, workdir):
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "marcache"], command
    # one engine thread: the machine that runs the suite is shared (see test_notebooks.py)
    env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run([sys.executable] + argv[1:], cwd=str(workdir), env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    assert proc.stdout.strip(), command
    if "--out" in argv:
        out = workdir / argv[argv.index("--out") + 1]
        assert out.exists() and out.stat().st_size > 0, out
    if argv[3] == "fid":
        assert re.search(r"digits-FID: \d+\.\d+", proc.stdout), proc.stdout


def test_readme_paths_exist_in_the_checkout():
    """Every file the README links to or names by its repository path (a link, an image, a
    `benchmarks/...`, `tests/...`, ... in backticks) is in the checkout: CI's clean clone holds
    only tracked files, so a results file or plot left untracked (.gitignore ignores *.png)
    fails here instead of showing readers a broken link."""
    root = os.path.dirname(README)
    text = open(README).read()
    links = [t for t in re.findall(r"\]\(([^)#][^)]*)\)", text) if not t.startswith(("http://", "https://"))]
    named = re.findall(r"`((?:benchmarks|tests|notebooks|csrc|marcache|tools|\.ci)/[^`\s]+\.[A-Za-z0-9]+)`", text)
    assert links and named, "the README's links and paths were not found: has its format changed?"
    missing = sorted({p for p in links + named if not os.path.exists(os.path.join(root, p))})
    assert not missing, f"README.md names files that are not in the checkout: {missing}"

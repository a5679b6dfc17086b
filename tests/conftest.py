"""Shared test setup: import paths, and the backend parametrisation with the
GPU gate.

Any test that takes a `backend` argument runs once per backend in
KNOWN_BACKENDS plus any other backend the build reports. A backend the build
lacks is skipped, except under MARCACHE_REQUIRE_CUDA=1 (the GPU machine's CI),
where a build without "cuda" ends the whole session with exit status 1 before
any test runs: a GPU run must never pass by skipping every GPU case.
"""
import functools
import os
import signal
import sys

import pytest

import glob

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
# `reference` and the fixtures live beside the tests. The source tree's
# marcache is used only when it holds an in-place build (setup.py build_ext
# --inplace); otherwise the installed package is tested, as CI does.
paths = [TESTS_DIR]
if glob.glob(os.path.join(REPO_ROOT, "marcache", "_C*.so")):
    paths.append(REPO_ROOT)
else:
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != REPO_ROOT]
for path in paths:
    if path not in sys.path:
        sys.path.insert(0, path)

KNOWN_BACKENDS = ("cpu", "cuda")

# The Ctrl-C tests need SIGINT to raise KeyboardInterrupt. A pytest started as a
# background job of a non-interactive shell (`pytest &` or `nohup pytest &` in a
# script, some CI runners) inherits SIGINT ignored, and Python then leaves it
# ignored instead of installing its handler: every Ctrl-C test would fail for a
# reason that has nothing to do with marcache. Install Python's own handler then.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@functools.lru_cache(maxsize=None)
def built_backends():
    """Backend names of this build of marcache._C."""
    from marcache import _C

    return tuple(_C.backends())


def pytest_sessionstart(session):
    if os.environ.get("MARCACHE_REQUIRE_CUDA") != "1":
        return
    try:
        names = built_backends()
    except ImportError as exc:
        pytest.exit("MARCACHE_REQUIRE_CUDA=1 but marcache._C does not import: %s" % exc,
                    returncode=1)
    if "cuda" not in names:
        pytest.exit("MARCACHE_REQUIRE_CUDA=1 but this build has no cuda backend "
                    "(marcache._C.backends() == %r)" % (list(names),), returncode=1)


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        names = list(KNOWN_BACKENDS)
        try:
            names += [n for n in built_backends() if n not in names]
        except ImportError:
            pass  # the import error is reported by the test module itself
        metafunc.parametrize("backend", names, indirect=True)


@pytest.fixture
def backend(request):
    """The backend name under test; skips a backend this build lacks."""
    name = request.param
    if name not in built_backends():
        pytest.skip("backend %r is not in this build (marcache._C.backends() == %r)"
                    % (name, list(built_backends())))
    return name

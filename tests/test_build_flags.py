"""Warnings are errors only where MARCACHE_WERROR=1 (CI, development), never in a
user's `pip install .` (issue 21, point 7): a newer gcc or nvcc that warns about
something new must not fail an install.

setup.py runs setup() when executed, so its flag functions are taken out of its
source (ast) and run on their own, with the environment set per case."""
import ast
import os

import numpy
import pytest

SETUP = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "setup.py")
FUNCTIONS = ("werror_requested", "compile_args", "nvcc_args")
CUDA_CFG = {"cublas_include": "/opt/cublas/include", "root": "/opt/cuda",
            "cublas_lib": "/opt/cublas/lib/libcublas.so.13"}


def setup_flag_functions():
    with open(SETUP) as f:
        tree = ast.parse(f.read(), SETUP)
    keep = [node for node in tree.body
            if (isinstance(node, ast.FunctionDef) and node.name in FUNCTIONS)
            or (isinstance(node, ast.Assign) and any(getattr(t, "id", None) in
                                                     ("CUDA_GENCODE", "HERE")
                                                     for t in node.targets))]
    assert {n.name for n in keep if isinstance(n, ast.FunctionDef)} == set(FUNCTIONS)
    namespace = {"os": os, "numpy": numpy, "__file__": SETUP}
    exec(compile(ast.Module(body=keep, type_ignores=[]), SETUP, "exec"), namespace)
    return namespace


def werror_flags(args):
    """The flags that turn warnings into errors, for gcc and nvcc alike."""
    out = [a for a in args if a == "-Werror" or a.startswith("-Werror=")]
    out += [a for a in args if a.startswith("-W") and ",-Werror" in a]  # -Xcompiler lists
    out += [a for a in args if a == "all-warnings"]
    return out


@pytest.mark.parametrize("value", [None, "0", ""])
def test_no_werror_by_default(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("MARCACHE_WERROR", raising=False)
    else:
        monkeypatch.setenv("MARCACHE_WERROR", value)
    ns = setup_flag_functions()
    assert werror_flags(ns["compile_args"]()) == []
    assert werror_flags(ns["nvcc_args"](CUDA_CFG)) == []
    assert "-Wall" in ns["compile_args"]() and "-Wextra" in ns["compile_args"]()


def test_werror_when_requested(monkeypatch):
    monkeypatch.setenv("MARCACHE_WERROR", "1")
    ns = setup_flag_functions()
    assert werror_flags(ns["compile_args"]()) == ["-Werror"]
    nvcc = ns["nvcc_args"](CUDA_CFG)
    assert "-Wall,-Wextra,-Werror" in nvcc
    i = nvcc.index("-Werror")
    assert nvcc[i + 1] == "all-warnings", nvcc


def test_bad_value_is_refused(monkeypatch):
    monkeypatch.setenv("MARCACHE_WERROR", "yes please")
    with pytest.raises(SystemExit, match="MARCACHE_WERROR must be 0 or 1"):
        setup_flag_functions()["compile_args"]()


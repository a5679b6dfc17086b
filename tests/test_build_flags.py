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
FUNCTIONS = ("werror_requested", "compile_args", "nvcc_args", "sanitizers_requested", "sanitize_args",
             "c_string", "build_record_macros")
CUDA_CFG = {"cublas_include": "/opt/cublas/include", "root": "/opt/cuda",
            "cublas_lib": "/opt/cublas/lib/libcublas.so.13"}


def setup_flag_functions():
    with open(SETUP) as f:
        tree = ast.parse(f.read(), SETUP)
    keep = [node for node in tree.body
            if (isinstance(node, ast.FunctionDef) and node.name in FUNCTIONS)
            or (isinstance(node, ast.Assign) and any(getattr(t, "id", None) in
                                                     ("CUDA_GENCODE", "HERE", "SANITIZERS")
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



# ----- sanitizers and what build_info() records (issue 18) ---------------------------------

def test_sanitizer_flags(monkeypatch):
    monkeypatch.delenv("MARCACHE_SANITIZE", raising=False)
    ns = setup_flag_functions()
    assert not [a for a in ns["compile_args"]() if a.startswith("-fsanitize")]
    monkeypatch.setenv("MARCACHE_SANITIZE", "address,undefined")
    args = ns["compile_args"]()
    assert "-fsanitize=address,undefined" in args and "-fno-omit-frame-pointer" in args
    assert "-fno-sanitize-recover=all" in args  # every report aborts: a run cannot pass over one
    assert ns["sanitize_args"]() == ["-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                                     "-fno-omit-frame-pointer"]


@pytest.mark.parametrize("value", ["thread", "address,address", "address;undefined"])
def test_bad_sanitizer_is_refused(monkeypatch, value):
    monkeypatch.setenv("MARCACHE_SANITIZE", value)
    with pytest.raises(SystemExit, match="MARCACHE_SANITIZE must be a comma-separated list"):
        setup_flag_functions()["compile_args"]()


def test_build_record_macros(monkeypatch):
    """The macros py_build.c turns into build_info(): the environment's CFLAGS as given
    (quotes and backslashes survive as a C string), first on the recorded line as on the
    compiler's, the sanitizers and -Werror."""
    flags = '-O2 -DNAME="a b" -I/opt/x\\y'
    monkeypatch.setenv("CFLAGS", flags)
    monkeypatch.delenv("CPPFLAGS", raising=False)
    monkeypatch.setenv("MARCACHE_SANITIZE", "undefined")
    monkeypatch.setenv("MARCACHE_WERROR", "1")
    macros = dict(setup_flag_functions()["build_record_macros"]())
    # A C string literal with only \\ and \" escapes reads the same in Python.
    assert ast.literal_eval(macros["MC_BUILD_CFLAGS_ENV"]) == flags
    recorded = ast.literal_eval(macros["MC_BUILD_CFLAGS"])
    assert recorded.startswith(flags + " ") and "-fsanitize=undefined" in recorded and "-Werror" in recorded
    assert ast.literal_eval(macros["MC_BUILD_SANITIZE"]) == "undefined"
    assert macros["MC_BUILD_WERROR"] == "1"
    monkeypatch.delenv("CFLAGS")
    monkeypatch.delenv("MARCACHE_SANITIZE")
    monkeypatch.setenv("MARCACHE_WERROR", "0")
    macros = dict(setup_flag_functions()["build_record_macros"]())
    assert ast.literal_eval(macros["MC_BUILD_CFLAGS_ENV"]) == ""
    assert ast.literal_eval(macros["MC_BUILD_SANITIZE"]) == "" and macros["MC_BUILD_WERROR"] == "0"


def test_build_info_records_this_build():
    """build_info() of the module under test agrees with itself and with the process:
    -Werror on the recorded line exactly when werror is True, -fsanitize exactly when
    sanitize names sanitizers, and an AddressSanitizer build really runs with libasan
    mapped. In the sanitizer lane (.ci/sanitize exports MARCACHE_SANITIZE) the build
    must record the sanitizers the lane asked for."""
    import marcache

    info = marcache.build_info()
    cflags = info["cflags"].split()
    assert isinstance(info["werror"], bool) and isinstance(info["cflags_env"], str)
    assert ("-Werror" in cflags) == info["werror"], info
    assert info["cflags"].startswith(info["cflags_env"]), info
    sanitize = [s for s in info["sanitize"].split(",") if s]
    assert bool(sanitize) == any(f.startswith("-fsanitize=") for f in cflags), info
    if sanitize:
        assert "-fsanitize=" + ",".join(sanitize) in cflags, info
    if "address" in sanitize:
        with open("/proc/self/maps") as f:
            assert "libasan" in f.read(), "an AddressSanitizer build runs without libasan mapped"
    wanted = os.environ.get("MARCACHE_SANITIZE", "").strip()
    if wanted:
        assert info["sanitize"] == wanted, (wanted, info)

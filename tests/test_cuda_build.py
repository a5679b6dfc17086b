"""Facts of the CUDA build that hold with or without a GPU: what build_info
reports, that backends() lists "cuda" exactly when a device is usable, that
asking for the cuda backend without a device fails cleanly, and that a CUDA
build carries sm_80 and sm_90 machine code plus compute_90 PTX. Without a
CUDA build only the first checks apply."""
import os
import sys

import numpy as np
import pytest

from marcache import _C
from child_env import child_env

INFO = _C.build_info()
CUDA_BUILT = INFO["cuda"]

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))


def test_build_info_cuda_entries():
    for key in ("cuda", "cuda_runtime", "cuda_driver", "cublas", "cublas_library",
                "cublas_status", "cuda_devices", "cuda_device_names", "cuda_archs"):
        assert key in INFO
    assert isinstance(INFO["cuda"], bool)
    assert INFO["cuda_devices"] == len(INFO["cuda_device_names"])
    if not CUDA_BUILT:
        assert INFO["cuda_devices"] == 0 and INFO["cuda_runtime"] is None
        assert INFO["cublas"] is None and INFO["cublas_library"] is None
        return
    assert INFO["cuda_runtime"].split(".")[0].isdigit()
    # cuBLAS is loaded with the first CUDA backend: either not yet, or a version and a file
    if INFO["cublas"] is None:
        assert INFO["cublas_library"] is None
        assert INFO["cublas_status"].startswith("not loaded yet"), INFO["cublas_status"]
    else:
        assert INFO["cublas"].count(".") == 2 and os.path.isfile(INFO["cublas_library"])
        assert INFO["cublas_status"] == "loaded"
    assert INFO["cuda_archs"] == "sm_80 sm_90 compute_90"
    assert all(isinstance(n, str) and n for n in INFO["cuda_device_names"])


def test_backends_list_cuda_only_with_a_device():
    names = _C.backends()
    assert names[0] == "cpu"
    assert ("cuda" in names) == (CUDA_BUILT and INFO["cuda_devices"] > 0)
    assert INFO["backends"] == ",".join(names)


@pytest.mark.skipif(not CUDA_BUILT or INFO["cuda_devices"] > 0,
                    reason="needs a CUDA build on a machine without a usable GPU")
def test_cuda_backend_without_device_raises_runtime_error():
    a = np.ones((2, 2), np.float32)
    with pytest.raises(RuntimeError, match="no usable CUDA device"):
        _C.run_op("cuda", "gemm", (a, a), {})


@pytest.mark.skipif(not CUDA_BUILT, reason="this build has no CUDA backend")
def test_cuda_build_has_sm80_sm90_cubins_and_compute90_ptx():
    from cuda_fatbin_list import fatbin_entries

    entries = {(kind, arch) for kind, arch, _ in fatbin_entries(_C.__file__)}
    assert {("ELF", 80), ("ELF", 90), ("PTX", 90)} <= entries, entries


# ----- cuBLAS through dlopen (issue 21, point 6) ---------------------------------------------

def dynamic_needed(path):
    """The DT_NEEDED entries of a 64-bit little-endian ELF shared object (what `readelf -d`
    lists as NEEDED), read from its .dynamic and .dynstr sections."""
    import struct

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, path
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = sections[shstrndx][4]

    def name(sec):
        start = names_at + sec[0]
        return data[start:data.index(b"\0", start)].decode()

    by_name = {name(s): s for s in sections}
    dynamic, dynstr = by_name[".dynamic"], by_name[".dynstr"]
    needed = []
    for off in range(dynamic[4], dynamic[4] + dynamic[5], 16):
        tag, value = struct.unpack_from("<qQ", data, off)
        if tag == 0:
            break
        if tag == 1:  # DT_NEEDED
            start = dynstr[4] + value
            needed.append(data[start:data.index(b"\0", start)].decode())
    return needed


def test_dynamic_needed_reads_the_entries():
    """The reader above against a library whose NEEDED list is known: the extension itself
    always needs libc and OpenBLAS (the scipy-openblas32 wheel)."""
    needed = dynamic_needed(_C.__file__)
    assert "libc.so.6" in needed and any("openblas" in n for n in needed), needed


@pytest.mark.skipif(not CUDA_BUILT, reason="this build has no CUDA backend")
def test_cuda_build_needs_no_cuda_library():
    """cuBLAS is dlopened when the first CUDA backend is made, and the CUDA runtime is linked
    statically (libcudart_static.a, which dlopens the driver itself): nothing CUDA is NEEDED,
    so the extension loads where no CUDA library is installed."""
    needed = dynamic_needed(_C.__file__)
    assert not [n for n in needed if "cublas" in n or "cudart" in n or n.startswith("libcuda")], \
        needed


CPU_WORK = """
import json, sys, numpy as np, marcache
from marcache import _C
a = np.arange(6, dtype=np.float32).reshape(2, 3)
out = _C.run_op("cpu", "gemm", (a, a), {"trans_b": True})
info = marcache.build_info()
try:
    _C._cublas_load()
    load = "loaded"
except RuntimeError as exc:
    load = str(exc)
print(json.dumps({"gemm": np.asarray(out[0] if isinstance(out, tuple) else out).tolist(),
                  "status": info["cublas_status"], "load": load,
                  "after": marcache.build_info()["cublas"]}))
"""


def run_child(code, **env):
    """Runs code in a fresh interpreter with this session's import path and env added to the
    environment (a value of None removes the variable); returns its last line as JSON."""
    import json
    import subprocess

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.abspath(__file__)), env=child_env(**env))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not CUDA_BUILT, reason="this build has no CUDA backend")
def test_without_cublas_the_cuda_build_runs_cpu_work_and_names_the_wheel(tmp_path):
    """MARCACHE_CUBLAS pointing at a folder without the library hides every cuBLAS (when set it
    is the only place looked at): import and CPU work succeed, and loading fails with the pip
    requirement to install and the file tried."""
    out = run_child(CPU_WORK, MARCACHE_CUBLAS=str(tmp_path))
    a = np.arange(6, dtype=np.float64).reshape(2, 3)
    np.testing.assert_allclose(out["gemm"], a @ a.T, rtol=1e-6)
    assert out["status"].startswith("not loaded yet")
    assert 'pip install "nvidia-cublas>=13,<14"' in out["load"], out["load"]
    assert str(tmp_path / "lib" / "libcublas.so.13") + " (no such file)" in out["load"]
    assert out["after"] is None


@pytest.mark.skipif(not CUDA_BUILT, reason="this build has no CUDA backend")
def test_a_library_without_the_cublas_symbols_is_refused(tmp_path):
    """A file that loads but is not cuBLAS (here the C library under cuBLAS's name) is
    refused, naming the first missing symbol, rather than crashing at the first call."""
    import ctypes.util

    libc = ctypes.util.find_library("c")
    lib = tmp_path / "lib"
    lib.mkdir()
    for folder in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64"):
        if os.path.exists(os.path.join(folder, libc)):
            os.symlink(os.path.join(folder, libc), lib / "libcublas.so.13")
            break
    else:
        pytest.fail("the C library %s was not found in the usual folders" % libc)
    out = run_child(CPU_WORK, MARCACHE_CUBLAS=str(tmp_path))
    assert "libcublas.so.13 (no symbol cublasCreate_v2)" in out["load"], out["load"]


@pytest.mark.skipif(not CUDA_BUILT, reason="this build has no CUDA backend")
def test_cublas_is_loaded_from_the_wheel_first():
    """Without MARCACHE_CUBLAS the nvidia-cublas wheel on sys.path comes first (the wheel CI
    and development install), and build_info reports the file and version loaded."""
    from marcache import _cuda_libs

    wheel_dirs = _cuda_libs.wheel_library_dirs()
    if not wheel_dirs:
        pytest.fail("a CUDA build without the nvidia-cublas wheel on sys.path: install it "
                    '(pip install "nvidia-cublas>=13,<14") to run this test')
    code = CPU_WORK.replace('"after": marcache.build_info()["cublas"]',
                            '"after": [marcache.build_info()[k] for k in ("cublas", "cublas_library")]')
    out = run_child(code, MARCACHE_CUBLAS=None)
    assert out["load"] == "loaded", out["load"]
    version, path = out["after"]
    assert version.split(".")[0] == "13"
    assert os.path.dirname(path) == wheel_dirs[0], (path, wheel_dirs)


def test_wheel_library_dirs_order(tmp_path):
    """nvidia/cu13/lib (CUDA 13's wheel) before nvidia/cublas/lib (CUDA 11/12's), in sys.path
    order, each once; entries without the wheel add nothing."""
    from marcache import _cuda_libs

    a, b, empty = tmp_path / "a", tmp_path / "b", tmp_path / "empty"
    for d in (a / "nvidia" / "cublas" / "lib", a / "nvidia" / "cu13" / "lib", b / "nvidia" / "cu13" / "lib",
              empty):
        d.mkdir(parents=True)
    got = _cuda_libs.wheel_library_dirs([str(empty), str(a), str(b), str(a)])
    assert got == [str(a / "nvidia" / "cu13" / "lib"), str(a / "nvidia" / "cublas" / "lib"),
                   str(b / "nvidia" / "cu13" / "lib")]

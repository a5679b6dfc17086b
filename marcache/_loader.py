"""Finds the OpenBLAS shared library of the scipy-openblas32 wheel before the
extension is imported. The extension also carries an rpath to the wheel's
location next to marcache in site-packages; preloading covers in-place
builds and unusual layouts where that relative path does not hold."""
import ctypes
import os


def preload_blas():
    try:
        import scipy_openblas32
    except ImportError as exc:  # pragma: no cover - a broken install
        raise ImportError("marcache needs the 'scipy-openblas32' package (pip install scipy-openblas32)") from exc
    lib_dir = scipy_openblas32.get_lib_dir()
    name = "lib" + scipy_openblas32.get_library() + ".so"
    path = os.path.join(lib_dir, name)
    if os.path.exists(path):
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)

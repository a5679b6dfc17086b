"""marcache: MAR image generation in C, no PyTorch at run time.

The extension links OpenBLAS from the scipy-openblas32 wheel. Its rpath
finds the library in an installed tree; for in-place builds (and any other
layout) the library is preloaded here before marcache._C is imported.
"""
import ctypes as _ctypes
import os as _os


def _preload_openblas():
    try:
        import scipy_openblas32
    except ImportError:
        return
    lib_dir = scipy_openblas32.get_lib_dir()
    for name in sorted(_os.listdir(lib_dir)):
        if name.startswith("lib" + scipy_openblas32.get_library()) and ".so" in name:
            _ctypes.CDLL(_os.path.join(lib_dir, name), mode=_ctypes.RTLD_GLOBAL)
            return


_preload_openblas()

"""Where a CUDA build of marcache looks for cuBLAS, which it loads (dlopen) when the first
CUDA model or backend is made rather than at import, so a CUDA build runs on the CPU without
the nvidia-cublas wheel. The order (csrc/backend/cuda/cuda_cublas.cu, the same as setup.py's
at build time):

1. ``MARCACHE_CUBLAS``: a folder with ``lib/libcublas.so.<major>``; when set, only it;
2. the ``nvidia-cublas`` wheel on this interpreter's ``sys.path`` (``nvidia/cu13/lib`` since
   CUDA 13, ``nvidia/cublas/lib`` before), the folders this module registers;
3. the toolkit (``$CUDA_HOME/lib64``, ``$CUDA_PATH/lib64``, the one the build used);
4. the library the build found;
5. the system loader (``LD_LIBRARY_PATH``, ldconfig).

``marcache.build_info()`` reports the library loaded (``cublas``, ``cublas_library``) or that
none is loaded yet (``cublas_status``)."""
import os
import sys


def wheel_library_dirs(paths=None):
    """The nvidia-cublas wheel's library folders under the entries of ``paths`` (default
    ``sys.path``), in that order, each once: only path checks, nothing is loaded."""
    found = []
    for entry in sys.path if paths is None else paths:
        base = os.path.join(os.path.abspath(entry or os.getcwd()), "nvidia")
        for sub in ("cu13", "cublas"):
            lib = os.path.join(base, sub, "lib")
            if os.path.isdir(lib) and lib not in found:
                found.append(lib)
    return found


def register(extension):
    """Hands the wheel's folders to the extension (a no-op in a build without CUDA)."""
    extension._cublas_register_dirs(wheel_library_dirs()[:64])

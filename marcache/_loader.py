"""Finds the OpenBLAS shared library of the scipy-openblas32 wheel before the
extension is imported. The extension also carries an rpath to the wheel's
location next to marcache in site-packages; preloading covers in-place
builds and unusual layouts where that relative path does not hold."""
import ctypes
import os


def _prefer_avx512_kernels():
    """OpenBLAS's DYNAMIC_ARCH does not know the newest AMD cores (Zen 5 here)
    and falls back to its AVX2 "Haswell" kernels, which run sgemm at half the
    rate of its AVX-512 "SkylakeX" kernels on those CPUs (measured: 121 vs 228
    GFLOP/s per core). Pick SkylakeX on AMD CPUs with AVX-512, unless the user
    chose a core type. It must be set before the library is loaded."""
    if os.environ.get("OPENBLAS_CORETYPE"):
        return
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read(65536)
    except OSError:
        return
    flags = set()
    for line in info.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    needed = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}
    if "AuthenticAMD" in info and needed <= flags:
        os.environ["OPENBLAS_CORETYPE"] = "SkylakeX"


def preload_blas():
    try:
        import scipy_openblas32
    except ImportError as exc:  # pragma: no cover - a broken install
        raise ImportError("marcache needs the 'scipy-openblas32' package (pip install scipy-openblas32)") from exc
    _prefer_avx512_kernels()
    lib_dir = scipy_openblas32.get_lib_dir()
    name = "lib" + scipy_openblas32.get_library() + ".so"
    path = os.path.join(lib_dir, name)
    if os.path.exists(path):
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)

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


# libgomp's spin before a waiting thread sleeps, when neither GOMP_SPINCOUNT nor
# OMP_WAIT_POLICY is set: 300,000 iterations. See bounded_openmp_spin.
OPENMP_SPIN_COUNT = 10000


def bounded_openmp_spin():
    """Bounds how long marcache's OpenMP threads spin at a barrier before they sleep,
    unless the user chose (GOMP_SPINCOUNT or OMP_WAIT_POLICY set). libgomp's default
    spin (300,000 iterations) is harmless on an idle machine, but when another process
    keeps the cores busy a thread spinning at one of the engine's many short parallel
    regions burns the time slice its partner needs, and a MAR-B batch-1 run took 4.4x
    its idle time beside two busy loops; with 10,000 it took 2.3x (2.0x is the fair
    share), and the idle time did not change (benchmarks/bench_busy.py,
    benchmarks/results/busy-2026-11-27.md). libgomp reads it once, when it is loaded,
    so it must be set before the extension is imported; it has no effect when another
    module loaded libgomp first."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return
    os.environ["GOMP_SPINCOUNT"] = str(OPENMP_SPIN_COUNT)


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

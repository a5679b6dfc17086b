"""What the CPU benchmarks share: the sgemm rate measured beside the model (the
machine's reachable GEMM peak, with the same thread pool), the machine line, the
Markdown results table, and the optional JSON copy of the results.

The benchmarks run as scripts (``python benchmarks/bench_var.py``), so this
folder is on sys.path and they ``import _common``. marcache is imported where it is
used: bench_builds.py's parent process times other builds and imports none."""
import glob
import json
import os
import platform
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**extra):
    """The environment of a benchmark's child Python: tests/child_env.py's (os.environ,
    this process's import path as PYTHONPATH, `extra` set or removed), with the checkout
    first on the path when it holds an in-place build, as tests/conftest.py puts it, so
    the child times the marcache this run imports."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from child_env import child_env as tests_child_env

    env = tests_child_env(**extra)
    if glob.glob(os.path.join(ROOT, "marcache", "_C*.so")) and "PYTHONPATH" not in extra:
        env["PYTHONPATH"] = os.pathsep.join([ROOT, env["PYTHONPATH"]])
    return env


def build_harness(source, out_path):
    """Compile benchmarks/<source> with the checkout's CPU backend and core C sources
    against the scipy-openblas32 wheel the module links, with the module's own flags
    (-O3 -march=native, or MARCACHE_MARCH, -fopenmp): a C harness that times the engine's
    own code through its backend factory, so that running it from two trees compares them."""
    import subprocess
    import sysconfig

    import scipy_openblas32

    here = os.path.join(ROOT, "benchmarks")
    sources = [os.path.join(here, source)]
    for folder in ("csrc/backend/cpu", "csrc/backend", "csrc/core"):
        full = os.path.join(ROOT, folder)
        sources += sorted(os.path.join(full, f) for f in os.listdir(full) if f.endswith(".c"))
    lib_dir = scipy_openblas32.get_lib_dir()
    march = os.environ.get("MARCACHE_MARCH", "native")
    cmd = [os.environ.get("CC") or (sysconfig.get_config_var("CC") or "gcc").split()[0], "-O3", "-std=c11",
           "-D_GNU_SOURCE", "-fopenmp", "-DMC_BLAS_NAME=\"scipy-openblas32\"", "-I" + os.path.join(ROOT, "csrc"),
           "-I" + scipy_openblas32.get_include_dir(), "-o", out_path, *sources, "-L" + lib_dir,
           "-l" + scipy_openblas32.get_library(), "-Wl,-rpath," + lib_dir, "-lm"]
    if march:
        cmd.insert(1, "-march=" + march)
    subprocess.run(cmd, check=True)


def sgemm_rate(shapes, repeats):
    """(best GFLOP/s, {"MxNxK": GFLOP/s}) over GEMMs of the given (m, n, k) shapes
    (nn.Linear form: rows x out x in), each timed `repeats` times by _C.sgemm_seconds."""
    from marcache import _C

    rates = {}
    for m, n, k in shapes:
        seconds = _C.sgemm_seconds(m, n, k, repeats)
        rates[f"{m}x{n}x{k}"] = 2.0 * m * n * k / seconds / 1e9
    return max(rates.values()), rates


def numpy_blas_threads():
    """Call before NumPy is imported: its own OpenBLAS (not marcache's) reads its thread
    count at import. `--threads=N` on the command line sets it, else every core; the
    sgemv bandwidth (sgemv_bandwidth) is measured with that many threads."""
    import sys

    arg = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--threads=")), None)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", arg or str(os.cpu_count()))
    return int(os.environ["OPENBLAS_NUM_THREADS"])


def sgemv_bandwidth(nbytes, repeats):
    """Best GB/s of y = A x over an fp32 A of `nbytes` (NumPy's OpenBLAS): the rate this
    machine streams weights at, what a batch-1 diffusion head is bound by (issue 23)."""
    import time

    import numpy as np

    a = np.random.default_rng(0).standard_normal((max(nbytes // 4 // 1024, 1), 1024), dtype=np.float32)
    x = np.ones(1024, np.float32)
    a @ x
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ x
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


def print_machine(sgemm_by_shape):
    """The machine, its BLAS and the sgemm rates by shape, as the results files quote them."""
    import marcache as mc

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"BLAS: {mc.build_info()['blas_config']}")
    print("sgemm GFLOP/s by shape: " + ", ".join(f"{k}: {v:.1f}" for k, v in sgemm_by_shape.items()), flush=True)


def print_run_header(title, peak_before, peak_after):
    """The results' heading: the run's title with the thread count, then the sgemm
    peak measured before and after it (the larger is the machine's peak)."""
    print()
    print(f"{title}, threads={os.environ.get('OMP_NUM_THREADS', os.cpu_count())}")
    print(f"measured sgemm peak: {max(peak_before, peak_after):.1f} GFLOP/s (before {peak_before:.1f}, "
          f"after {peak_after:.1f})")


def print_table(header, rows):
    """A Markdown table: `header` a list of column titles, `rows` lists of cells."""
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")


def write_json(path, **results):
    """The results as JSON at `path` (nothing when path is None)."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


def start_busy(count):
    """`count` plain Python processes spinning `while True: pass` at this process's
    priority: the "busy machine" of bench_official.py and bench_busy.py."""
    import subprocess
    import sys

    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def stop_busy(procs):
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()

"""Build of the marcache._C extension.

C11 + OpenMP; CPU matrix products go to OpenBLAS as shipped by the
scipy-openblas32 wheel (the build NumPy and SciPy use). Its library is found
at run time through an rpath relative to this package and, as a fallback,
preloaded by marcache/__init__.py.

The CUDA backend (csrc/**/*.cu) is compiled with nvcc when nvcc and cuBLAS's
headers are both found; cuBLAS comes from the `nvidia-cublas` wheel (or a
toolkit that ships it). The .cu files become objects linked into the same
marcache._C with the static CUDA runtime, which needs only the driver
(libcuda.so.1, which it dlopens) at run time. libcublas is not linked: the
backend dlopens it when the first CUDA backend is made
(csrc/backend/cuda/cuda_cublas.cu, the same search order as here), so a CUDA
build imports and runs on the CPU without the wheel.

Environment:
  MARCACHE_MARCH   value for -march (default "native"; "" disables the flag)
  MARCACHE_DEBUG=1 build with -O0 -g (host) and -G (device)
  MARCACHE_WERROR=1 warnings are errors (-Werror for gcc, -Werror all-warnings
                   for nvcc): CI and development set it. Off by default, so a
                   user's `pip install .` with a newer compiler that warns about
                   something new still installs
  MARCACHE_CUDA    "0": no CUDA backend; "1": CUDA backend or fail; unset or
                   "auto": build it when nvcc and cuBLAS are found
  CUDA_HOME        the CUDA toolkit (default: from nvcc's location, /usr/local/cuda)
  MARCACHE_CUBLAS  a folder with include/cublas_v2.h and lib/libcublas.so*
                   (default: the nvidia-cublas wheel, then the toolkit); read
                   again at run time, where lib/libcublas.so.<major> is loaded
"""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import numpy
import scipy_openblas32
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))

# sm_80 (A100) and sm_90 (H100/H200) machine code, plus compute_90 PTX that
# the driver can compile for newer GPUs.
CUDA_GENCODE = ["-gencode", "arch=compute_80,code=sm_80",
                "-gencode", "arch=compute_90,code=sm_90",
                "-gencode", "arch=compute_90,code=compute_90"]
CUDA_ARCHS = "sm_80 sm_90 compute_90"


def c_sources():
    files = sorted(glob.glob(os.path.join("csrc", "**", "*.c"), recursive=True))
    return [f for f in files if os.sep + "dev" + os.sep not in f]


def cu_sources():
    files = glob.glob(os.path.join(HERE, "csrc", "**", "*.cu"), recursive=True)
    return sorted(os.path.relpath(f, HERE) for f in files)


def werror_requested():
    """MARCACHE_WERROR=1 (CI, development): warnings fail the build."""
    value = os.environ.get("MARCACHE_WERROR", "0").strip().lower()
    if value not in ("0", "1", ""):
        raise SystemExit("MARCACHE_WERROR must be 0 or 1, got %r" % value)
    return value == "1"


def compile_args():
    args = ["-std=c11", "-Wall", "-Wextra"] + (["-Werror"] if werror_requested() else []) + [
        "-fopenmp", "-D_POSIX_C_SOURCE=200809L", "-isystem", numpy.get_include()]
    if os.environ.get("MARCACHE_DEBUG") == "1":
        args += ["-O0", "-g"]
    else:
        args += ["-O3"]
    march = os.environ.get("MARCACHE_MARCH", "native")
    if march:
        args.append("-march=" + march)
    return args


# --------------------------------------------------------------------------
# Finding CUDA
# --------------------------------------------------------------------------

def find_nvcc():
    """(nvcc path, toolkit root) or (None, reason)."""
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvcc"))
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(on_path)
    candidates.append("/usr/local/cuda/bin/nvcc")
    nvcc = next((c for c in candidates if os.path.isfile(c) and os.access(c, os.X_OK)), None)
    if nvcc is None:
        return None, "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    # The toolkit root: CUDA_HOME, else two levels above the real nvcc (a
    # wrapper script in /usr/local/bin is not the toolkit), else /usr/local/cuda.
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
             os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "/usr/local/cuda"]
    for root in roots:
        if root and os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")):
            return nvcc, root
    return None, "nvcc found at %s but no toolkit with include/cuda_runtime.h" % nvcc


def cudart_static_dir(root):
    for sub in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib")):
        d = os.path.join(root, sub)
        if os.path.isfile(os.path.join(d, "libcudart_static.a")):
            return d
    return None


def find_cublas(cuda_root):
    """(include dir, library file) or None: the headers compiled against and the library
    whose location cuda_cublas.cu tries after the run-time places (it is not linked).

    Order: MARCACHE_CUBLAS, the nvidia-cublas wheel in this interpreter's
    site-packages (nvidia/cu13 since CUDA 13, nvidia/cublas before), the
    toolkit (cuda_cublas.cu searches in the same order at run time)."""
    def probe(include, lib):
        libs = sorted(glob.glob(os.path.join(lib, "libcublas.so*")))
        if os.path.isfile(os.path.join(include, "cublas_v2.h")) and libs:
            # Prefer the versioned soname file (the wheel ships no libcublas.so).
            versioned = [f for f in libs if f.count(".so.") == 1 and f.split(".so.")[1].isdigit()]
            return include, (versioned or libs)[0]
        return None

    if os.environ.get("MARCACHE_CUBLAS"):
        base = os.environ["MARCACHE_CUBLAS"]
        return probe(os.path.join(base, "include"), os.path.join(base, "lib"))
    site_dirs = []
    for key in ("purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path and path not in site_dirs:
            site_dirs.append(path)
    for path in sys.path:
        if path and os.path.isdir(os.path.join(path, "nvidia")) and path not in site_dirs:
            site_dirs.append(path)
    for site in site_dirs:
        for sub in ("cu13", "cublas"):
            found = probe(os.path.join(site, "nvidia", sub, "include"),
                          os.path.join(site, "nvidia", sub, "lib"))
            if found:
                return found
    if cuda_root:
        for sub in ("lib64", "lib"):
            found = probe(os.path.join(cuda_root, "include"), os.path.join(cuda_root, sub))
            if found:
                return found
    return None


def cuda_config():
    """The CUDA build settings, or None with a note printed (auto mode)."""
    mode = os.environ.get("MARCACHE_CUDA", "auto").strip().lower()
    if mode in ("0", "off", "no", "false"):
        print("marcache: CUDA backend off (MARCACHE_CUDA=0)")
        return None
    if mode not in ("1", "on", "yes", "true", "auto", ""):
        raise SystemExit("MARCACHE_CUDA must be 0, 1 or auto, got %r" % mode)
    required = mode in ("1", "on", "yes", "true")

    def missing(reason):
        if required:
            raise SystemExit("MARCACHE_CUDA=1 but " + reason)
        print("marcache: building without the CUDA backend: " + reason)
        return None

    nvcc, root = find_nvcc()
    if nvcc is None:
        return missing(root)
    rt_dir = cudart_static_dir(root)
    if rt_dir is None:
        return missing("no libcudart_static.a under %s" % root)
    cublas = find_cublas(root)
    if cublas is None:
        return missing("cuBLAS not found (pip install nvidia-cublas, or set MARCACHE_CUBLAS); "
                       "with pip's build isolation, install it first and build with "
                       "--no-build-isolation")
    include, lib_file = cublas
    print("marcache: CUDA backend on: nvcc %s, cuBLAS headers %s (loaded at run time)"
          % (nvcc, include))
    return {"nvcc": nvcc, "root": root, "cudart_dir": rt_dir, "cublas_include": include,
            "cublas_lib": lib_file}


CUDA = cuda_config()


def nvcc_args(cfg):
    args = ["-std=c++17", "-Xcompiler", "-fPIC", "-DMC_HAVE_CUDA=1",
            "-I" + os.path.join(HERE, "csrc"), "-isystem", cfg["cublas_include"],
            # -Wall -Wextra for the host compiler; with MARCACHE_WERROR=1
            # warnings are errors on both sides (-Werror for the host
            # compiler, every nvcc / cudafe / ptxas warning). Not -Wpedantic:
            # gcc rejects the "# 1 file" line directives in the host code
            # nvcc generates ("style of line directive is a GCC extension"),
            # whatever our sources say.
            "-Xcompiler", "-Wall,-Wextra" + (",-Werror" if werror_requested() else ""),
            # Where cuda_cublas.cu looks after the wheel and the run-time
            # toolkit: the toolkit and the library this build found.
            '-DMC_CUDA_BUILD_ROOT="%s"' % cfg["root"],
            '-DMC_CUBLAS_BUILD_LIB="%s"' % cfg["cublas_lib"]] + (
            ["-Werror", "all-warnings"] if werror_requested() else []) + CUDA_GENCODE
    if os.environ.get("MARCACHE_DEBUG") == "1":
        args += ["-O0", "-g", "-G"]
    else:
        args += ["-O3", "-lineinfo"]
    return args


class build_ext_cuda(build_ext):
    """Compiles csrc/**/*.cu with nvcc into objects linked with the C sources."""

    def build_extensions(self):
        if CUDA is not None:
            objects = self.compile_cuda()
            for ext in self.extensions:
                ext.extra_objects = list(ext.extra_objects or []) + objects
        super().build_extensions()

    def compile_cuda(self):
        headers = glob.glob(os.path.join(HERE, "csrc", "**", "*.h"), recursive=True)
        newest_header = max((os.path.getmtime(h) for h in headers), default=0.0)
        args = nvcc_args(CUDA)
        jobs = []
        for rel in cu_sources():
            src = os.path.join(HERE, rel)
            obj = os.path.abspath(os.path.join(self.build_temp, os.path.splitext(rel)[0] + ".cu.o"))
            os.makedirs(os.path.dirname(obj), exist_ok=True)
            stale = (self.force or not os.path.exists(obj) or
                     os.path.getmtime(obj) < max(os.path.getmtime(src), newest_header))
            jobs.append((src, obj, stale))

        def run(job):
            src, obj, stale = job
            if stale:
                cmd = [CUDA["nvcc"], "-c", src, "-o", obj] + args
                print(" ".join(cmd), flush=True)
                subprocess.run(cmd, check=True)
            return obj

        workers = max(1, min(len(jobs), os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(run, jobs))


define_macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
                 ("MC_BLAS_NAME", '"scipy-openblas32 ' + scipy_openblas32.__version__ + '"'),
                 ("MC_BUILD_CFLAGS", '"' + " ".join(a for a in compile_args()
                                                    if "/" not in a and a != "-isystem") + '"')]
libraries = [scipy_openblas32.get_library(), "m"]
library_dirs = [scipy_openblas32.get_lib_dir()]
extra_link_args = ["-fopenmp", "-Wl,-rpath,$ORIGIN/../scipy_openblas32/lib"]
if CUDA is not None:
    define_macros += [("MC_HAVE_CUDA", "1"), ("MC_CUDA_ARCHS", '"' + CUDA_ARCHS + '"')]
    # Static CUDA runtime: it dlopens the driver, so it needs libdl, librt
    # and pthreads; the .cu objects are C++ and need libstdc++. No libcublas
    # (dlopened at run time, see the top of this file): the extension's
    # NEEDED entries name no CUDA library, which tests/test_cuda_build.py
    # checks.
    library_dirs.append(CUDA["cudart_dir"])
    libraries += ["cudart_static", "dl", "rt", "pthread", "stdc++"]

ext = Extension(
    "marcache._C",
    sources=c_sources(),
    include_dirs=["csrc", scipy_openblas32.get_include_dir()],
    library_dirs=library_dirs,
    libraries=libraries,
    define_macros=define_macros,
    extra_compile_args=compile_args(),
    extra_link_args=extra_link_args,
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext_cuda})

"""Build of the marcache._C extension.

C11 + OpenMP; CPU matrix products go to OpenBLAS as shipped by the
scipy-openblas32 wheel (the build NumPy and SciPy use). Its library is found
at run time through an rpath relative to this package and, as a fallback,
preloaded by marcache/__init__.py.

Environment:
  MARCACHE_MARCH   value for -march (default "native"; "" disables the flag)
  MARCACHE_DEBUG=1 build with -O0 -g
"""
import glob
import os

import numpy
import scipy_openblas32
from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def c_sources():
    files = sorted(glob.glob(os.path.join("csrc", "**", "*.c"), recursive=True))
    return [f for f in files if os.sep + "dev" + os.sep not in f]


def compile_args():
    args = ["-std=c11", "-Wall", "-Wextra", "-Werror", "-fopenmp", "-D_POSIX_C_SOURCE=200809L",
            "-isystem", numpy.get_include()]
    if os.environ.get("MARCACHE_DEBUG") == "1":
        args += ["-O0", "-g"]
    else:
        args += ["-O3"]
    march = os.environ.get("MARCACHE_MARCH", "native")
    if march:
        args.append("-march=" + march)
    return args


ext = Extension(
    "marcache._C",
    sources=c_sources(),
    include_dirs=["csrc", scipy_openblas32.get_include_dir()],
    library_dirs=[scipy_openblas32.get_lib_dir()],
    libraries=[scipy_openblas32.get_library(), "m"],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
                   ("MC_BLAS_NAME", '"scipy-openblas32 ' + scipy_openblas32.__version__ + '"'),
                   ("MC_BUILD_CFLAGS", '"' + " ".join(a for a in compile_args()
                                                      if "/" not in a and a != "-isystem") + '"')],
    extra_compile_args=compile_args(),
    extra_link_args=["-fopenmp", "-Wl,-rpath,$ORIGIN/../scipy_openblas32/lib"],
)

setup(ext_modules=[ext])

"""The CPU backend compiles, -Werror clean, for the x86 machines users build it on.

The build here targets this machine (-march=native, AVX-512 with every extension), so an
intrinsic of an AVX-512 extension used inside code marked only `target("avx512f")`
compiles here and breaks the build on any machine without that extension: the first GELU
vector form called AVX512DQ's _mm512_andnot_ps and failed to build with -march=haswell.
This test compiles every file of csrc/backend/cpu/ (whose vector paths are chosen at run
time, so all of them are compiled on every target) with the build's C flags for the
baseline x86-64, an AVX2-only machine (Haswell, Zen 3) and an AVX-512 one."""
import os
import platform
import shutil
import subprocess
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_DIR = os.path.join(ROOT, "csrc", "backend", "cpu")
TARGETS = ("x86-64", "haswell", "znver3", "skylake-avx512")
# setup.py's C flags (without -march, which each case sets)
FLAGS = ["-std=c11", "-Wall", "-Wextra", "-Werror", "-fopenmp", "-D_POSIX_C_SOURCE=200809L", "-O3"]

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                                reason="the targets are x86 instruction sets")


def compiler():
    cc = (sysconfig.get_config_var("CC") or "gcc").split()[0]
    return shutil.which(cc) or shutil.which("gcc")


def sources():
    return sorted(f for f in os.listdir(CPU_DIR) if f.endswith(".c"))


def test_the_cpu_backend_has_sources():
    assert "cpu_vmath.c" in sources() and "cpu_smallrow.c" in sources()


@pytest.mark.parametrize("target", TARGETS)
def test_cpu_backend_compiles_for(target, tmp_path):
    cc = compiler()
    if cc is None:
        pytest.skip("no C compiler on PATH")
    import scipy_openblas32

    include = ["-I" + os.path.join(ROOT, "csrc"), "-I" + scipy_openblas32.get_include_dir()]
    failures = []
    for name in sources():
        cmd = [cc, *FLAGS, "-march=" + target, *include, "-c", os.path.join(CPU_DIR, name),
               "-o", str(tmp_path / (name + ".o"))]
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            failures.append(f"{name}:\n{proc.stderr[-3000:]}")
    assert not failures, f"-march={target}:\n" + "\n".join(failures)

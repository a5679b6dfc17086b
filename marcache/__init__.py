"""marcache: MAR and VAR image generation with training-free caching,
in C/CUDA with no PyTorch at run time.

Quick start::

    import marcache as mc
    model = mc.load("mar_base.safetensors", vae="kl16.safetensors")
    images = model.generate(labels=[207, 360], steps=64, cfg=2.9, seed=0)  # uint8 [2, 256, 256, 3]
"""
from ._loader import bounded_openmp_spin as _bounded_openmp_spin, preload_blas as _preload_blas

_bounded_openmp_spin()
_preload_blas()


def _import_extension():
    """Imports marcache._C; when it is missing, says why in words (numpy's model): the
    usual cause is Python importing the unbuilt source folder instead of the installed
    package, because the working directory is a clone's root."""
    import glob
    import importlib
    import os

    try:
        return importlib.import_module("._C", __name__)
    except ImportError as exc:
        here = os.path.dirname(os.path.abspath(__file__))
        built = glob.glob(os.path.join(here, "_C*.so")) + glob.glob(os.path.join(here, "_C*.pyd"))
        source_tree = os.path.exists(os.path.join(os.path.dirname(here), "setup.py"))
        if built or not source_tree:
            raise  # a built _C that fails to load (missing library, ...): its own message says why
        msg = (f"marcache is being imported from its source folder {here}, which has no built extension "
               f"(marcache._C). Either build it in place, from {os.path.dirname(here)}:\n"
               f"    pip install -e .          (or: python setup.py build_ext --inplace)\n"
               f"or run Python from another folder, so that the installed marcache is imported "
               f"(the current folder comes first on sys.path).")
        raise ImportError(msg) from exc


_C = _import_extension()
from . import _cuda_libs  # noqa: E402

_cuda_libs.register(_C)  # where the CUDA backend will look for cuBLAS (loaded later, if ever)
from .policies import CfgFreeLate, DiSA, FastVAR, LazyMAR, MARche, NoCache  # noqa: E402
from .flops import flops, MAR_CONFIGS, VAR_CONFIGS  # noqa: E402
from .model import MARModel, GenerationInfo, file_kind, load  # noqa: E402
from .var_model import VARModel  # noqa: E402
from . import convert  # noqa: E402  (marcache.convert.convert / read_checkpoint: no PyTorch needed)
from . import digits  # noqa: E402  (the shipped digits MAR, data and classifier)

__version__ = "0.1.0"


def build_info():
    """Backends, BLAS, OpenMP and compiler flags this build was made with.

    ``cflags``: the C flags of this build after Python's own (the environment's CFLAGS
    and CPPFLAGS first, as on the compiler's command line, then marcache's, paths left
    out); ``cflags_env``: the environment's CFLAGS and CPPFLAGS as given; ``sanitize``:
    the sanitizers built in ("address,undefined" in CI's sanitizer lane, else "");
    ``werror``: whether warnings were errors (MARCACHE_WERROR=1); ``cpu_isa``: the
    instruction set of the CPU backend's small-row linear kernels (avx512, avx2 or plain:
    the best this CPU has, or MARCACHE_CPU_ISA), ``cpu_isa_supported`` the sets this CPU
    runs, ``smallrow_max`` the most rows a linear sends to the lane kernel (16-bit weights,
    or fp32 without panels; MARCACHE_SMALLROW_MAX; 0: off); ``smallrow_panels``: 1 when
    fp32 Linear weights get column panels at load (MARCACHE_SMALLROW_PANELS, default 1),
    ``panel_max`` the most rows a linear runs on them (768 with AVX-512, 96 with AVX2, by
    the ISA in use; MARCACHE_SMALLROW_MAX sets it too; 0 with panels off); ``huge_pages``: 1 when the CPU backend asks for transparent huge pages for
    buffers of 2 MiB or more (MARCACHE_HUGE_PAGES, default 1; 0: off); ``gemm_split``: how
    the CPU backend divides an OpenBLAS GEMM between its threads (MARCACHE_GEMM_SPLIT: auto,
    rows or cols). These read the environment now, as a backend made now would; -1
    (``gemm_split``: "invalid") where it holds a bad value."""
    return dict(_C.build_info())


__all__ = ["load", "file_kind", "convert", "digits", "MARModel", "VARModel", "GenerationInfo", "NoCache", "LazyMAR",
           "MARche", "CfgFreeLate", "DiSA", "FastVAR", "flops",
           "MAR_CONFIGS", "VAR_CONFIGS", "build_info", "__version__"]

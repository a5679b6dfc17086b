"""marcache: MAR (and, later, VAR) image generation with training-free caching,
in C/CUDA with no PyTorch at run time.

Quick start::

    import marcache as mc
    model = mc.load("mar_base.safetensors", vae="kl16.safetensors")
    images = model.generate(labels=[207, 360], steps=64, cfg=2.9, seed=0)  # uint8 [2, 256, 256, 3]
"""
from ._loader import preload_blas as _preload_blas

_preload_blas()

from . import _C  # noqa: E402
from .policies import CfgFreeLate, LazyMAR, MARche, NoCache  # noqa: E402
from .flops import flops, MAR_CONFIGS  # noqa: E402
from .model import MARModel, GenerationInfo, file_kind, load  # noqa: E402
from . import convert  # noqa: E402  (marcache.convert.convert / read_checkpoint: no PyTorch needed)
from . import digits  # noqa: E402  (the shipped digits MAR, data and classifier)

__version__ = "0.1.0"


def build_info():
    """Backends, BLAS, OpenMP and compiler flags this build was made with."""
    return dict(_C.build_info())


__all__ = ["load", "file_kind", "convert", "digits", "MARModel", "GenerationInfo", "NoCache", "LazyMAR", "MARche", "CfgFreeLate", "flops",
           "MAR_CONFIGS", "build_info", "__version__"]

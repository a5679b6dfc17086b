"""Facts of the CUDA build that hold with or without a GPU: what build_info
reports, that backends() lists "cuda" exactly when a device is usable, that
asking for the cuda backend without a device fails cleanly, and that a CUDA
build carries sm_80 and sm_90 machine code plus compute_90 PTX. Without a
CUDA build only the first checks apply."""
import os
import sys

import numpy as np
import pytest

from marcache import _C

INFO = _C.build_info()
CUDA_BUILT = INFO["cuda"]

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))


def test_build_info_cuda_entries():
    for key in ("cuda", "cuda_runtime", "cuda_driver", "cublas", "cuda_devices",
                "cuda_device_names", "cuda_archs"):
        assert key in INFO
    assert isinstance(INFO["cuda"], bool)
    assert INFO["cuda_devices"] == len(INFO["cuda_device_names"])
    if not CUDA_BUILT:
        assert INFO["cuda_devices"] == 0 and INFO["cuda_runtime"] is None
        return
    assert INFO["cuda_runtime"].split(".")[0].isdigit()
    assert INFO["cublas"] is not None and INFO["cublas"].count(".") == 2
    assert INFO["cuda_archs"] == "sm_80 sm_90 compute_90"
    assert all(isinstance(n, str) and n for n in INFO["cuda_device_names"])


def test_backends_list_cuda_only_with_a_device():
    names = _C.backends()
    assert names[0] == "cpu"
    assert ("cuda" in names) == (CUDA_BUILT and INFO["cuda_devices"] > 0)
    assert INFO["backends"] == ",".join(names)


@pytest.mark.skipif(not CUDA_BUILT or INFO["cuda_devices"] > 0,
                    reason="needs a CUDA build on a machine without a usable GPU")
def test_cuda_backend_without_device_raises_runtime_error():
    a = np.ones((2, 2), np.float32)
    with pytest.raises(RuntimeError, match="no usable CUDA device"):
        _C.run_op("cuda", "gemm", (a, a), {})


@pytest.mark.skipif(not CUDA_BUILT, reason="this build has no CUDA backend")
def test_cuda_build_has_sm80_sm90_cubins_and_compute90_ptx():
    from cuda_fatbin_list import fatbin_entries

    entries = {(kind, arch) for kind, arch, _ in fatbin_entries(_C.__file__)}
    assert {("ELF", 80), ("ELF", 90), ("PTX", 90)} <= entries, entries

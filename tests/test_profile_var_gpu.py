"""profile_var_gpu.py's kernel table (issue 15's GPU profile): the GPU time of each kernel
name summed over its launches, CPU-side events left out, longest first. The profile itself
needs torch with CUDA and a GPU, so only the aggregation is tested here, on stand-in events
whose totals are worked out by hand."""
from types import SimpleNamespace

import pytest

from benchmark_modules import import_benchmark


@pytest.fixture(scope="module")
def profile_var_gpu():
    return import_benchmark("profile_var_gpu")


def event(name, device, us):
    """A torch.autograd.profiler FunctionEvent's fields that the table reads."""
    return SimpleNamespace(name=name, device_type=SimpleNamespace(name=device),
                           time_range=SimpleNamespace(elapsed_us=lambda: us))


def test_kernels_summed_by_name_cpu_events_left_out(profile_var_gpu):
    events = [event("im2col_kernel", "CUDA", 1500.0), event("aten::mm", "CPU", 9000.0),
              event("layernorm_kernel", "CUDA", 4.0), event("im2col_kernel", "CUDA", 500.0),
              event("layernorm_kernel", "CUDA", 6.0), event("nvjet_gemm", "CUDA", 700.0)]
    table = profile_var_gpu.kernel_table(SimpleNamespace(events=lambda: events))
    # ms: im2col 1.5 + 0.5 over two launches; the CPU-side aten::mm (9 ms) is not a kernel
    assert [(name, calls) for name, _, calls in table] == [("im2col_kernel", 2), ("nvjet_gemm", 1),
                                                          ("layernorm_kernel", 2)]
    assert [ms for _, ms, _ in table] == pytest.approx([2.0, 0.7, 0.01])

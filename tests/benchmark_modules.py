"""A script of benchmarks/ imported as a module, for the tests of the benchmarks' own
arithmetic and harness builds (bench_official, profile_var_gpu, bench_linear, _common)."""
import importlib
import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def import_benchmark(name):
    """benchmarks/<name>.py as a module. benchmarks/ is on sys.path only while it imports,
    so its own imports (_common, bench_gpu, bench_var) resolve there and nothing else
    changes for the test session."""
    sys.path.insert(0, BENCHMARKS)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)

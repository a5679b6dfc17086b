"""An op a backend does not implement (csrc/backend/ops_list.h: a new op lands
on the CPU first, `where` = CPU_ONLY) fails cleanly: run_op raises
NotImplementedError naming the op and the backend, and a model that calls it
gets an error naming both instead of a crash through a NULL table entry.

The guard backend's test hook MARCACHE_GUARD_UNSUPPORTED=<op> makes one op
unsupported on every guard backend made afterwards (the stand-in entry that
csrc/backend/op_table.c puts into a table's empty slots). The runs happen in
a subprocess, as every guard model run does (test_devices.py): a guard fault
kills the process."""
import json
import os
import subprocess
import sys

import pytest

from mar_fixtures import write_tiny_mar
from child_env import child_env

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r"""
import json, sys
import numpy as np
import marcache as mc
from marcache import _C

path = sys.argv[1]
out = {}

def outcome(fn):
    try:
        value = fn()
        return {"ok": True, "value": value}
    except Exception as e:
        return {"ok": False, "type": type(e).__name__, "message": str(e)}

rng = np.random.default_rng(0)
a = rng.standard_normal((3, 8)).astype(np.float32)
b = rng.standard_normal((3, 8)).astype(np.float32)
out["run_op_unsupported"] = outcome(lambda: _C.run_op("guard", "cosine_rows", (a, b), {"heads": 2}).tolist())
out["run_op_other_op"] = outcome(lambda: _C.run_op("guard", "axpby", (a, b), {"a": 2.0, "b": 0.5}).tolist())
out["run_op_cpu"] = outcome(lambda: _C.run_op("cpu", "cosine_rows", (a, b), {"heads": 2}).tolist())
model = mc.load(path, device="guard", diffusion_steps=4)
kwargs = dict(labels=[3], steps=8, cfg=2.5, seed=4)
out["nocache"] = outcome(lambda: model.generate_tokens(**kwargs).shape[1])
out["lazymar"] = outcome(lambda: model.generate_tokens(cache=mc.LazyMAR(start=2, period=3), **kwargs).shape[1])
print(json.dumps(out))
"""


def run_child(path, unsupported):
    env = child_env(PYTHONFAULTHANDLER="1", MARCACHE_GUARD_UNSUPPORTED=unsupported)
    return subprocess.run([sys.executable, "-c", CHILD, str(path)], cwd=HERE, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def tiny_mar(tmp_path_factory):
    path = tmp_path_factory.mktemp("op_list") / "tiny_mar.safetensors"
    write_tiny_mar(path, seed=11, depth=4)
    return path


def test_unsupported_op_fails_with_its_name_and_backend(tiny_mar):
    proc = run_child(tiny_mar, "cosine_rows")
    assert proc.returncode == 0, proc.stderr[-6000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # run_op refuses before running anything
    assert out["run_op_unsupported"] == {
        "ok": False, "type": "NotImplementedError",
        "message": "op cosine_rows is not implemented on backend guard"}
    # the backend's other ops, and the op on another backend, still run
    assert out["run_op_other_op"]["ok"] and out["run_op_cpu"]["ok"]
    # a model that never calls the op runs; LazyMAR ranks its tokens with it and stops
    # at the first cached step with the stand-in's error (RuntimeError, MC_ERR_INTERNAL)
    assert out["nocache"] == {"ok": True, "value": 256}
    assert out["lazymar"] == {"ok": False, "type": "RuntimeError",
                              "message": "op 'cosine_rows' is not supported on backend 'guard'"}


def test_unknown_op_in_the_hook_is_refused(tiny_mar):
    proc = run_child(tiny_mar, "no_such_op")
    assert proc.returncode != 0
    assert "MARCACHE_GUARD_UNSUPPORTED: unknown op 'no_such_op'" in proc.stderr

"""FLOPs counted where the work is dispatched (issue 22 point 5).

The FLOP telemetry (csrc/runtime/flops.c, summed per step) and marcache.flops
(marcache/flops.py) are two formulas for the same run; the tests of
test_lazymar.py / test_marche.py hold them equal, but an engine running an extra
GEMM, or skipping one, would pass there. Here the guard backend adds up the
FLOPs of every op it dispatches (the `flops` column of csrc/backend/ops_list.h:
2 m n k per GEMM, 2 rows in out per linear, 4 queries keys channels per
attention, 2 queries keys channels per attention_mass), and for every cache
policy the count dispatched in each AR step must equal that step's telemetry
and marcache.flops, exactly: all three are sums of integer products, exact in
float64 far above these sizes (the largest step here is ~1e9 < 2**53).

The guard faults on any host access to backend memory, so the runs happen in
one subprocess (as in test_devices.py), which reports the counts as JSON."""
import json
import os
import subprocess
import sys

import pytest

from mar_fixtures import write_tiny_mar
from child_env import child_env

HERE = os.path.dirname(os.path.abspath(__file__))

# Every policy of issue 14's bitwise list: NoCache, LazyMAR at its defaults and each of
# its caches alone, MARche at its defaults, with the encoder cache, and composed with
# LazyMAR's condition and head caches. 8 AR steps reach LazyMAR's cached steps (from step
# 5) and MARche's (2 of every 3); 16 diffusion steps reach the head cache's reused and
# recomputed evaluations (head_period 7).
POLICIES = {
    "nocache": "None",
    "lazymar": "mc.LazyMAR()",
    "lazymar-token-only": "mc.LazyMAR(cond_cache=False, head_cache=False)",
    "lazymar-cond-only": "mc.LazyMAR(token_cache=False, head_cache=False)",
    "lazymar-head-only": "mc.LazyMAR(token_cache=False, cond_cache=False)",
    "marche": "mc.MARche()",
    "marche+encoder": "mc.MARche(encoder_cache=True)",
    "marche+encoder+cond+head": "mc.MARche(encoder_cache=True, cond_cache=True, head_cache=True)",
}
# (policy, cfg, labels): every policy with CFG on (two sequences per image, the condition
# cache active), and the defaults and the composed MARche with CFG off (one sequence).
RUNS = [(name, 2.5, [3]) for name in POLICIES] + \
    [(name, 1.0, [5]) for name in ("nocache", "lazymar", "marche+encoder+cond+head")]
AR_STEPS, DIFFUSION_STEPS = 8, 16

CHILD = r"""
import json, sys
import marcache as mc

path, policies, runs, ar_steps = json.loads(sys.argv[1])
model = mc.load(path, device="guard", diffusion_steps=%d)


class CountingEngine:
    # The model's engine with the dispatched-FLOP counter read at every step callback.
    def __init__(self, engine):
        self.engine, self.after_step = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, *args, callback=None, **kwargs):
        def on_step(info):
            self.after_step.append(self.engine.backend_flops)
            if callback is not None:
                callback(info)
        return self.engine.generate(*args, callback=on_step, **kwargs)


engine = CountingEngine(model._mar)
model._mar = engine
out = {}
for name, cfg, labels in runs:
    cache = eval(policies[name])
    engine.after_step = []
    before = engine.backend_flops
    _, info = model.generate_tokens(labels=labels, steps=ar_steps, cfg=cfg, seed=4, cache=cache,
                                    return_info=True)
    counts = [before] + engine.after_step
    report = mc.flops(model, steps=ar_steps, cfg=cfg, cache=cache, batch=len(labels))
    out["%%s cfg=%%g" %% (name, cfg)] = {
        "dispatched": [b - a for a, b in zip(counts, counts[1:])],
        "dispatched_total": engine.backend_flops - before,
        "telemetry": [s["flops"] for s in info.steps],
        "flops_py": report.per_step,
        "flops_py_total": report.total,
        "full": [s["full"] for s in info.steps],
    }
print(json.dumps(out))
""" % DIFFUSION_STEPS


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    path = tmp_path_factory.mktemp("flop_counts") / "tiny_mar.safetensors"
    write_tiny_mar(path, seed=11, depth=4)
    env = child_env(PYTHONFAULTHANDLER="1", MARCACHE_GUARD_UNSUPPORTED=None)
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps([str(path), POLICIES, RUNS, AR_STEPS])],
                          cwd=HERE, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        pytest.fail("guard subprocess exit %d\n--- stderr\n%s" % (proc.returncode, proc.stderr[-6000:]))
    return json.loads(proc.stdout.strip().splitlines()[-1])


RUN_IDS = ["%s cfg=%g" % (name, cfg) for name, cfg, _ in RUNS]


@pytest.mark.parametrize("run", RUN_IDS)
def test_dispatched_flops_equal_telemetry_and_marcache_flops(counts, run):
    c = counts[run]
    assert len(c["dispatched"]) == AR_STEPS, "one step callback per AR step"
    # exact: integer sums (see the module docstring), compared as such
    assert c["dispatched"] == [int(f) for f in c["telemetry"]], (
        "dispatched per step %s != telemetry %s" % (c["dispatched"], c["telemetry"]))
    assert c["dispatched"] == [int(f) for f in c["flops_py"]], (
        "dispatched per step %s != marcache.flops %s" % (c["dispatched"], c["flops_py"]))
    assert all(float(f) == int(f) for f in c["telemetry"] + c["flops_py"])
    assert c["dispatched_total"] == sum(c["dispatched"]) == int(c["flops_py_total"])


def test_runs_reach_the_caches(counts):
    """The comparison covers cached work, not only full steps: NoCache runs every step in
    full, and every policy dispatches fewer FLOPs than NoCache at the same CFG (so its caches
    took effect in these runs)."""
    for run in RUN_IDS:
        nocache = counts["nocache " + run.split(" ")[1]]
        if run.startswith("nocache"):
            assert all(counts[run]["full"])
        else:
            assert counts[run]["dispatched_total"] < nocache["dispatched_total"], run

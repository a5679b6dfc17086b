"""CPU graphs (csrc/backend/cpu/cpu_graph.c, issue 23): the head sampler records its later
diffusion steps on the CPU too, and the launch replays them on one persistent OpenMP team
(small-row Linears on every thread, the small ops between them on thread 0) instead of a
parallel region per op.

What must hold, and what is checked here against the same model run with the recording off
(MARCACHE_CPU_GRAPHS=0, every op called directly, its own region):
- the tokens are the same bits, for every policy (LazyMAR's head cache records cached and
  full evaluations, DiSA respaces the steps), for fp32 (column panels), fp32 with the panels
  off and bf16 (lane kernel), the plain reference ISA, and Linears forced to OpenBLAS
  (REGION nodes that leave the team and run as called directly);
- every AR step's head ran as a graph, and each launch opened exactly one team
  (backend_team_regions = AR steps) running every recorded call (backend_team_calls), the
  elementwise ops in row slices where they are large; OpenBLAS Linears leave the team; one
  thread, or the recording off, opens none;
- each host struct an op takes by pointer is copied into the recording (it lives on the
  caller's stack): every such parameter of ops_list.h has its copy in cpu_graph.c.
"""
import os
import re

import numpy as np
import pytest

import marcache as mc
from marcache import _C
from mar_fixtures import write_tiny_mar

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(HERE, "..", "csrc", "backend")

# One image in 16 AR steps: the head runs 2 x 1 to 2 x 30 rows, as MAR-B's does at batch 1 in
# 64 steps. With head width 256 its Linears from 4 rows on are over
# MC_SMALLROW_PARALLEL_MIN_MACS (256 K multiply-adds) and run on the team, the input
# projection and the smallest calls on thread 0; every elementwise op (at most 60 x 256
# values) is under MC_PARALLEL_MIN_ELEMS, so nothing leaves the team.
STEPS = 16
LABELS = [5]
HEAD_WIDTH = 256

POLICIES = {
    "nocache": lambda: None,
    "lazymar": lambda: mc.LazyMAR(start=2, period=3),
    "marche+cond+head": lambda: mc.MARche(refresh_period=3, cond_cache=True, head_cache=True),
    "disa": lambda: mc.DiSA(),
}


@pytest.fixture(scope="module")
def wide_head_mar(tmp_path_factory):
    path = tmp_path_factory.mktemp("cpu_graphs") / "wide_head.safetensors"
    write_tiny_mar(path, seed=11, depth=4, heads=2, head_width=HEAD_WIDTH)
    return str(path)


def generate(path, monkeypatch, graphs, threads=2, dtype="fp32", policy="lazymar", labels=LABELS, steps=STEPS,
             **env):
    """Tokens, per-step head_graph flags and the model's team counters of one generate, on a
    backend made with MARCACHE_CPU_GRAPHS=graphs and `env` (read when the model loads)."""
    with monkeypatch.context() as mp:
        mp.setenv("MARCACHE_CPU_GRAPHS", str(graphs))
        for k, v in env.items():
            mp.setenv(k, str(v))
        model = mc.load(path, device="cpu", dtype=dtype, threads=threads)
    tokens, info = model.generate_tokens(labels=labels, steps=steps, cfg=2.5, seed=4, cache=POLICIES[policy](),
                                         return_info=True)
    generate.recorded_steps = sum(s["diffusion_steps"] - 1 for s in info.steps)
    return (tokens, [s["head_graph"] for s in info.steps], model._mar.backend_team_regions,
            model._mar.backend_team_calls)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_replay_on_one_team_gives_the_direct_calls_bits(wide_head_mar, monkeypatch, policy):
    direct, flags, regions, calls = generate(wide_head_mar, monkeypatch, graphs=0, policy=policy)
    assert not any(flags) and regions == 0 and calls == 0
    replayed, flags, regions, calls = generate(wide_head_mar, monkeypatch, graphs=1, policy=policy)
    assert all(flags) and len(flags) == STEPS
    # One team per AR step's launch, running every recorded call: a full evaluation of this
    # head (depth 2) is 18 calls and the sampler's update 3 more (2 at the last diffusion step,
    # which draws no noise); a cached one (LazyMAR's head cache) at least 10 in all.
    recorded = generate.recorded_steps
    if policy in ("nocache", "disa"):
        assert regions == STEPS and calls == 21 * recorded - STEPS, (regions, calls, recorded)
    else:
        assert regions == STEPS and 10 * recorded <= calls < 21 * recorded, (regions, calls, recorded)
    assert np.all(np.isfinite(direct))
    np.testing.assert_array_equal(replayed, direct)


@pytest.mark.parametrize("case", [
    dict(dtype="bf16"),                               # the lane kernel, 16-bit weights
    dict(dtype="fp32", MARCACHE_SMALLROW_PANELS=0),   # the lane kernel, fp32
    dict(dtype="fp32", MARCACHE_CPU_ISA="plain"),     # the plain reference kernels
    dict(dtype="fp32", threads=3),                    # an odd team: uneven slices
], ids=["bf16", "fp32-lanes", "plain", "three-threads"])
def test_every_kernel_path_on_the_team(wide_head_mar, monkeypatch, case):
    case = dict(case)
    threads, dtype = case.pop("threads", 2), case.pop("dtype")
    direct = generate(wide_head_mar, monkeypatch, 0, threads, dtype, **case)[0]
    replayed, flags, regions, _ = generate(wide_head_mar, monkeypatch, 1, threads, dtype, **case)
    assert all(flags) and regions == STEPS
    np.testing.assert_array_equal(replayed, direct)


BATCH = dict(labels=[3, 7, 11], steps=6)  # 2 x 3 x 26 to 2 x 3 x 66 head rows


def test_large_elementwise_ops_run_in_row_slices_on_the_team(wide_head_mar, monkeypatch):
    # Three images in 6 AR steps: the norms and residual adds are over 32 K values, so each
    # thread runs them on its slice of the rows (TEAM_ROWS nodes), still one team per launch.
    direct = generate(wide_head_mar, monkeypatch, 0, policy="nocache", **BATCH)[0]
    replayed, flags, regions, calls = generate(wide_head_mar, monkeypatch, 1, policy="nocache", **BATCH)
    assert all(flags) and regions == 6 and calls == 21 * generate.recorded_steps - 6
    np.testing.assert_array_equal(replayed, direct)


def test_openblas_linears_leave_the_team_and_one_thread_opens_none(wide_head_mar, monkeypatch):
    # MARCACHE_SMALLROW_MAX=0: every Linear goes to OpenBLAS (REGION nodes, run as called
    # directly). One image: nothing is left for a team. Three: each REGION node ends a team
    # and the row-sliced elementwise ops after it start the next, more than one per launch.
    # The same bits through the graph either way.
    for kw, teams in ((dict(), 0), (BATCH, None)):
        direct = generate(wide_head_mar, monkeypatch, 0, MARCACHE_SMALLROW_MAX=0, **kw)[0]
        replayed, flags, regions, calls = generate(wide_head_mar, monkeypatch, 1, MARCACHE_SMALLROW_MAX=0, **kw)
        assert all(flags) and (regions == teams if teams is not None else regions > 6 * 99), regions
        np.testing.assert_array_equal(replayed, direct)
    # One thread: recorded and replayed, no team.
    direct = generate(wide_head_mar, monkeypatch, 0, threads=1)[0]
    replayed, flags, regions, calls = generate(wide_head_mar, monkeypatch, 1, threads=1)
    assert all(flags) and regions == 0 and calls == 0
    np.testing.assert_array_equal(replayed, direct)


def test_every_host_struct_parameter_is_copied_into_the_recording():
    """A pointer parameter of ops_list.h is backend memory (float, int and void pointers) or a
    host struct on the caller's stack (mc_ddpm_coefs, mc_window2d, mc_kv_segment), which the
    recording must copy and the replay point at (keep_host_args, replay_args): an op
    added with such a parameter and no copy would replay from a dead stack frame."""
    ops_list = open(os.path.join(CSRC, "ops_list.h")).read()
    graph = open(os.path.join(CSRC, "cpu", "cpu_graph.c")).read()

    def cases_of(function):
        body = graph[graph.index("static %s" % function):]
        body = body[:body.index("\n}\n")]
        return set(re.findall(r"case MC_OP_ID_(\w+):", body))

    keep = cases_of("mc_status keep_host_args(")
    point = cases_of("cg_node replay_args(")
    device = re.compile(r"^(const )?(float|double|int32_t|uint32_t|int64_t|uint8_t|uint16_t|void) \*\w+$")
    needing = set()
    for name, params in re.findall(r"MC_OP\((\w+), \w+,\s*\((.*?)\),\s*\(", ops_list, re.S):
        for param in (" ".join(p.split()) for p in params.split(",")):
            if "*" in param and not param.startswith(("mc_backend *", "mc_err *")) and not device.match(param):
                needing.add(name)
    assert needing == {"attention", "ddpm_step", "conv2d_ex", "avg_pool2d", "max_pool2d"}, needing
    assert needing <= keep and needing <= point, (needing - keep, needing - point)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_graph_hooks_refuse_what_a_recording_cannot_hold(threads, monkeypatch):
    """The hooks themselves, on one bound Linear (8 x 1024 x 1024) and a copy of its result:
    an allocation inside a recording is refused and the recording discarded with nothing run;
    a second capture_begin and a capture_end without one are refused; a clean recording runs
    nothing until it is launched, then gives the direct call's bits, on one team with two
    threads and none with one; with MARCACHE_CPU_GRAPHS=0 recording is refused."""
    monkeypatch.delenv("MARCACHE_CPU_GRAPHS", raising=False)
    got = _C._cpu_graph_probe(threads)
    assert got["refused"] == "cpu: allocation while recording a graph"
    assert got["discarded"] == "cpu: graph recording discarded (allocation while recording)"
    assert got["twice"] == "cpu: a graph is already being recorded"
    assert got["end_without_begin"] == "cpu: capture_end without capture_begin"
    assert got["untouched_after_failed"] and got["untouched_after_record"]
    assert got["max_diff"] == 0.0 and got["team_regions"] == (1 if threads > 1 else 0)
    monkeypatch.setenv("MARCACHE_CPU_GRAPHS", "0")
    assert _C._cpu_graph_probe(threads) == {"off": "cpu: graphs are off (MARCACHE_CPU_GRAPHS=0)"}

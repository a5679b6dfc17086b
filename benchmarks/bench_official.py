"""marcache against the official MAR and LazyMAR code on the same weights (issue 23).

The official code (LTH14/mar for NoCache, feihongyan1/LazyMAR for LazyMAR) runs under
PyTorch in a virtual environment of its own, a benchmark-only tool: marcache never
imports PyTorch. Both sides get the same random MAR weights in the official layout
(written here once, `--weights`), the same AR steps, CFG (linear schedule), threads,
batch and class labels; model loading is not timed. Every timed run is a fresh process
(official_worker.py under --torch-python for the official side, this script with
--marcache-run for marcache), and the runs alternate: round r runs every
(implementation, policy) once, in an order rotated by r, so a change in the machine's
load falls on all alike. The ratio is official seconds / marcache seconds, medians
over the rounds; beside it, the spread of the rounds' own ratios (official / marcache
within one round: the two runs were neighbours, so the spread is the machine's noise
the ratio of medians carries). The sgemm rate the phases are read against is measured
before and after the rounds (the larger is used: on a shared host one measurement
can catch a slow moment).

--load busy runs the same table while a second process keeps both cores busy:
`--busy-procs` (default 2) plain Python processes spinning `while True: pass` at the
same priority, started before the round and stopped after it.

Set-up (outside the repository; nothing of the official code is committed):

    python3 -m venv /tmp/torchvenv
    /tmp/torchvenv/bin/pip install torch==2.14.1 torchvision==0.29.1 timm safetensors numpy scipy
    git clone https://github.com/LTH14/mar /tmp/mar
    git clone https://github.com/feihongyan1/LazyMAR /tmp/LazyMAR
    python benchmarks/bench_official.py --torch-python /tmp/torchvenv/bin/python \
        --official /tmp/mar --lazymar /tmp/LazyMAR --batches 1 8 --rounds 2 --load idle busy

(timm imports torchvision, so PyTorch comes with a matching torchvision.)
A quick look: --steps 4 --rounds 1 --batches 1.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from _common import print_machine, print_table, sgemm_rate, start_busy, stop_busy, write_json

HERE = os.path.dirname(os.path.abspath(__file__))
# Official sampler's model names -> marcache's reference shapes (tests/reference/mar.py).
MODELS = ("mar_base", "mar_large", "mar_huge")
POLICIES = ("NoCache", "LazyMAR")


def labels_for(batch):
    """The class labels both sides use (official_worker.py uses the same formula)."""
    return [(207 + 31 * i) % 1000 for i in range(batch)]


def write_random_weights(path, model):
    """Random weights in the official key layout: LayerNorm weights 1 + noise, the
    rest 0.02-scaled normal noise (non-degenerate, so LazyMAR's similarity tests see
    real differences)."""
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from reference import mar as R
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {}
    for key, shape in R.official_shapes(model).items():
        base = 1.0 if key.endswith(".weight") and len(shape) == 1 else 0.0
        tensors[key] = (base + 0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file(tensors, path)


def marcache_run(args):
    """One timed marcache generate (this script re-run with --marcache-run)."""
    import marcache as mc

    model = mc.load(args.weights, dtype=args.dtype, threads=args.threads)
    cache = mc.LazyMAR() if args.policy == "LazyMAR" else None
    start = time.perf_counter()
    tokens, info = model.generate_tokens(labels=labels_for(args.batch), steps=args.steps, cfg=args.cfg, seed=0,
                                         cache=cache, return_info=True)
    seconds = time.perf_counter() - start
    if not np.isfinite(tokens).all():
        raise SystemExit("bench_official: marcache returned non-finite tokens")
    # The engine's own split of the run (encoder, decoder, head, other), so a ratio can
    # be read against where marcache's time went.
    phases = {name: dict(seconds=p["seconds"], flops=p["flops"]) for name, p in info.phases.items()}
    print(json.dumps(dict(impl="marcache", seconds=seconds, phases=phases)))


def ratio_rows(times, loads, batches, policies):
    """One row per (load, batch, policy) from times[(load, batch, policy, impl)], each
    impl's seconds in round order: the medians over the rounds, their ratio (official /
    marcache) and every round's own ratio."""
    rows = []
    for load in loads:
        for batch in batches:
            for policy in policies:
                off = times[(load, batch, policy, "official")]
                ours = times[(load, batch, policy, "marcache")]
                rows.append(dict(load=load, batch=batch, policy=policy, official=statistics.median(off),
                                 marcache=statistics.median(ours),
                                 ratio=statistics.median(off) / statistics.median(ours),
                                 round_ratios=[o / m for o, m in zip(off, ours)]))
    return rows


def spread(ratios):
    """min / median / max of the rounds' ratios, as printed in the table."""
    return f"{min(ratios):.2f} / {statistics.median(ratios):.2f} / {max(ratios):.2f}x"


def timed(cmd, env):
    """Run one timed process; its last stdout line is its JSON result."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"bench_official: {' '.join(cmd[:3])} ... failed ({proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch-python", help="the python of the PyTorch virtual environment")
    parser.add_argument("--official", help="a checkout of LTH14/mar")
    parser.add_argument("--lazymar", help="a checkout of feihongyan1/LazyMAR")
    parser.add_argument("--model", default="mar_base", choices=MODELS)
    parser.add_argument("--weights", default=None, help="random weights in the official layout "
                        "(written when missing; default benchmarks/.cache/<model>_random.safetensors)")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--cfg", type=float, default=2.9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--load", nargs="+", default=["idle"], choices=["idle", "busy"])
    parser.add_argument("--busy-procs", type=int, default=2)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="marcache's weights")
    parser.add_argument("--json", default=None)
    # internal: one timed marcache run
    parser.add_argument("--marcache-run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--policy", default="NoCache", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.weights is None:
        args.weights = os.path.join(HERE, ".cache", f"{args.model}_random.safetensors")
    if args.marcache_run:
        return marcache_run(args)
    for name in ("torch_python", "official", "lazymar"):
        if getattr(args, name) is None and (name != "lazymar" or "LazyMAR" in args.policies):
            parser.error(f"--{name.replace('_', '-')} is required (see the set-up in --help)")
    if not os.path.exists(args.weights):
        print(f"writing random {args.model} weights to {args.weights} ...", flush=True)
        write_random_weights(args.weights, args.model)

    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    code = {"NoCache": args.official, "LazyMAR": args.lazymar}
    common = ["--weights", args.weights, "--steps", str(args.steps), "--cfg", str(args.cfg),
              "--threads", str(args.threads)]

    def official_cmd(policy, batch):
        return [args.torch_python, os.path.join(HERE, "official_worker.py"), "--code", code[policy],
                "--impl", "mar" if policy == "NoCache" else "lazymar", "--model", args.model,
                "--batch", str(batch)] + common

    def marcache_cmd(policy, batch):
        return [sys.executable, os.path.abspath(__file__), "--marcache-run", "--policy", policy,
                "--batch", str(batch), "--dtype", args.dtype, "--model", args.model] + common

    sgemm_shapes = [(2048, 2048, 2048), (64, 3072, 1024)]
    peak_before, shapes = sgemm_rate(sgemm_shapes, 3)
    print_machine(shapes)
    torch_info = None
    times = {}  # (load, batch, policy, impl) -> [seconds]
    phases = {}  # (load, batch, policy) -> [marcache's info.phases of each run]
    for load in args.load:
        for batch in args.batches:
            runs = [(policy, impl) for policy in args.policies for impl in ("official", "marcache")]
            for r in range(args.rounds):
                busy = start_busy(args.busy_procs) if load == "busy" else []
                try:
                    for i in range(len(runs)):
                        policy, impl = runs[(i + r) % len(runs)]
                        cmd = official_cmd(policy, batch) if impl == "official" else marcache_cmd(policy, batch)
                        result = timed(cmd, env)
                        if impl == "official":
                            torch_info = result
                        times.setdefault((load, batch, policy, impl), []).append(result["seconds"])
                        if impl == "marcache":
                            phases.setdefault((load, batch, policy), []).append(result["phases"])
                        print(f"{load} batch {batch} round {r}: {policy} {impl}: {result['seconds']:.1f} s "
                              f"(load average {os.getloadavg()[0]:.2f})", flush=True)
                finally:
                    stop_busy(busy)

    peak_after, _ = sgemm_rate(sgemm_shapes, 3)
    peak = max(peak_before, peak_after)
    print()
    print(f"{args.model} (random weights), {args.steps} steps, cfg {args.cfg} linear, threads={args.threads}, "
          f"marcache {args.dtype}; official: PyTorch {torch_info['torch']} ({torch_info['cpu_capability']}); "
          f"medians of {args.rounds} alternated rounds; sgemm peak {peak:.1f} GFLOP/s (before {peak_before:.1f}, "
          f"after {peak_after:.1f})")
    rows = ratio_rows(times, args.load, args.batches, args.policies)
    print_table(["load", "batch", "policy", "official s/image", "marcache s/image", "ratio",
                 "rounds' ratios (min / median / max)"],
                [[r["load"], r["batch"], r["policy"], f"{r['official'] / r['batch']:.2f}",
                  f"{r['marcache'] / r['batch']:.2f}", f"{r['ratio']:.2f}x", spread(r["round_ratios"])]
                 for r in rows])
    print()
    print("marcache by phase (the engine's telemetry of its fastest run; s/image, GFLOP/s, % of the sgemm peak):")
    for key, runs in phases.items():
        best = min(runs, key=lambda ph: sum(p["seconds"] for p in ph.values()))
        total_flops = sum(p["flops"] for p in best.values())
        total_seconds = sum(p["seconds"] for p in best.values())
        parts = [f"{name} {p['seconds'] / key[1]:.1f} s, {p['flops'] / max(p['seconds'], 1e-9) / 1e9:.0f}"
                 for name, p in best.items()]
        print(f"  {key[0]} batch {key[1]} {key[2]}: " + "; ".join(parts) +
              f"; all {total_flops / total_seconds / 1e9:.0f} GFLOP/s "
              f"({100 * total_flops / total_seconds / 1e9 / peak:.0f}%)")
    if "idle" in args.load and "busy" in args.load:
        print()
        print("busy ratio / idle ratio (issue 23 asks >= 80% at batch 1):")
        for batch in args.batches:
            for policy in args.policies:
                idle = next(r for r in rows if (r["load"], r["batch"], r["policy"]) == ("idle", batch, policy))
                busy = next(r for r in rows if (r["load"], r["batch"], r["policy"]) == ("busy", batch, policy))
                print(f"  batch {batch} {policy}: {100 * busy['ratio'] / idle['ratio']:.0f}%")
    write_json(args.json, rows=rows, times={"|".join(map(str, k)): v for k, v in times.items()},
               marcache_phases={"|".join(map(str, k)): v for k, v in phases.items()},
               torch=torch_info, sgemm_peak=peak, sgemm_peak_before=peak_before,
               sgemm_peak_after=peak_after, sgemm_shapes=shapes, steps=args.steps, cfg=args.cfg,
               threads=args.threads, model=args.model, dtype=args.dtype)


if __name__ == "__main__":
    main()

"""CPU graphs side by side (issue 23): the head's recorded diffusion steps replayed on one
persistent OpenMP team (the default) against every op called directly, each its own parallel
region (MARCACHE_CPU_GRAPHS=0), idle and beside busy processes.

    python benchmarks/bench_graphs.py                                 # digits MAR, 2 x 16 digits
    python benchmarks/bench_graphs.py --model mar_base --cache lazymar --batch 1 --rounds 2

Both models are loaded in this one process (the setting is read when a model's backend is
made), with the same weights, and their generate calls alternate call by call, the order
flipped every round, so both meet the same machine. Busy: `--busy-procs` plain Python
processes spinning `while True: pass` at the same priority (bench_busy.py's), started before
the busy rounds and stopped after. The table gives the median seconds per call, each
setting's busy / idle, and direct / graphs (above 1: the team is faster). Each model's
`backend_team_regions` / `backend_team_calls` show the team ran. Tokens are compared too: the
two must be bitwise equal.
"""
import argparse
import os
import statistics
import time

import numpy as np

import marcache as mc
from _common import print_machine, print_table, sgemm_rate, start_busy, stop_busy, write_json

HERE = os.path.dirname(os.path.abspath(__file__))
SETTINGS = {"graphs": "1", "direct": "0"}


def load_model(args, graphs):
    os.environ["MARCACHE_CPU_GRAPHS"] = graphs
    try:
        if args.model == "digits":
            return mc.digits.load_model(threads=args.threads)
        return mc.load(args.weights, threads=args.threads)
    finally:
        del os.environ["MARCACHE_CPU_GRAPHS"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["digits", "mar_base"], default="digits")
    p.add_argument("--weights", default=os.path.join(HERE, ".cache", "mar_base_random.safetensors"),
                   help="MAR-B weights (bench_cpu.py writes them)")
    p.add_argument("--cache", choices=["none", "lazymar"], default="none")
    p.add_argument("--batch", type=int, default=None, help="images per call (digits 16, MAR-B 1)")
    p.add_argument("--steps", type=int, default=None, help="AR steps (digits 16, MAR-B 64)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--busy-procs", type=int, default=os.cpu_count(), help="0: idle rounds only")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    if "MARCACHE_CPU_GRAPHS" in os.environ:
        p.error("unset MARCACHE_CPU_GRAPHS: this script sets it per model")
    if args.model == "mar_base" and not os.path.exists(args.weights):
        p.error(f"{args.weights} does not exist: run benchmarks/bench_cpu.py once to write it")
    digits = args.model == "digits"
    batch = args.batch or (16 if digits else 1)
    steps = args.steps or (16 if digits else 64)
    kw = dict(labels=[(i if digits else 207 + 31 * i) % (10 if digits else 1000) for i in range(batch)],
              steps=steps, cfg=2.0 if digits else 2.9, seed=0)
    print_machine(sgemm_rate([(1024, 1024, 1024)], 3)[1])
    print(f"model {args.model}, batch {batch}, {steps} AR steps, cache {args.cache}, threads={args.threads}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    models = {name: load_model(args, graphs) for name, graphs in SETTINGS.items()}

    def cache():
        return mc.LazyMAR() if args.cache == "lazymar" else None

    tokens = {name: m.generate_tokens(cache=cache(), **dict(kw, steps=2)) for name, m in models.items()}  # warm-up
    loads = ["idle"] + (["busy"] if args.busy_procs > 0 else [])
    seconds = {(name, load): [] for name in models for load in loads}
    for load in loads:
        spinners = start_busy(args.busy_procs) if load == "busy" else []
        try:
            if spinners:
                time.sleep(0.5)
            for r in range(args.rounds):
                order = list(models) if r % 2 == 0 else list(reversed(list(models)))
                for name in order:
                    t0 = time.perf_counter()
                    tokens[name] = models[name].generate_tokens(cache=cache(), **kw)
                    seconds[(name, load)].append(time.perf_counter() - t0)
                    print(f"{load} round {r}: {name}: {seconds[(name, load)][-1]:.2f} s", flush=True)
        finally:
            stop_busy(spinners)
    equal = bool(np.array_equal(tokens["graphs"], tokens["direct"]))
    print(f"\ntokens bitwise equal: {equal}; graphs model: {models['graphs']._mar.backend_team_regions} team "
          f"regions, {models['graphs']._mar.backend_team_calls} calls on them; direct model: "
          f"{models['direct']._mar.backend_team_regions} regions\n")
    med = {key: statistics.median(v) for key, v in seconds.items()}
    rows = []
    for load in loads:
        rows.append([load, f"{med[('graphs', load)]:.2f}", f"{med[('direct', load)]:.2f}",
                     f"{med[('direct', load)] / med[('graphs', load)]:.3f}x"])
    print_table(["load", "graphs s/call (median)", "direct s/call (median)", "direct / graphs"], rows)
    if "busy" in loads:
        print(f"\nbusy / idle: graphs {med[('graphs', 'busy')] / med[('graphs', 'idle')]:.2f}x, "
              f"direct {med[('direct', 'busy')] / med[('direct', 'idle')]:.2f}x")
    write_json(args.json, args=vars(args), seconds={f"{n} {load}": v for (n, load), v in seconds.items()},
               tokens_equal=equal)
    if not equal:
        raise SystemExit("the two settings' tokens differ")


if __name__ == "__main__":
    main()

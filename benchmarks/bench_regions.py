"""How many OpenMP parallel regions a MAR generation opens, and what they cost (issue 23).

Issue 23 asks for one parallel region per step (a persistent team walking the step's ops
with barriers) instead of one or more per op. This measures the most that could save:

1. the regions themselves: a generate call runs under a counter preloaded in front of
   libgomp (GOMP_parallel is what `#pragma omp parallel` compiles to), per policy, with
   the head evaluations of the run beside them;
2. what one region costs against what a barrier inside a persistent team costs, on this
   machine and thread count: a C loop of N empty parallel regions and a C loop of N
   barriers in one region, built here with the same compiler and -fopenmp, run with the
   OpenMP settings marcache runs with (its GOMP_SPINCOUNT bound, marcache/_loader.py);
3. regions x (region cost - barrier cost): the time a persistent team would save, beside
   the run's own seconds.

Both costs are measured idle, and again with `--busy N` processes spinning beside them
(how a busy machine turns each synchronisation into a wait for a descheduled thread).

    python benchmarks/bench_regions.py                         # digits MAR, 16 steps
    python benchmarks/bench_regions.py --model mar_base --steps 4 --busy 2
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

from _common import child_env, print_table, start_busy, stop_busy, write_json

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

COUNTER_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
/* Counts libgomp parallel regions: GOMP_parallel is what `#pragma omp parallel`
 * compiles to. The extension loads libgomp privately (RTLD_LOCAL), so the real one is
 * found by name when RTLD_NEXT does not see it. */
static long regions;
typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
void GOMP_parallel(void (*fn)(void *), void *data, unsigned nthreads, unsigned flags) {
    static gomp_parallel_fn real;
    if (!real)
        real = (gomp_parallel_fn)dlsym(RTLD_NEXT, "GOMP_parallel");
    if (!real)
        real = (gomp_parallel_fn)dlsym(dlopen("libgomp.so.1", RTLD_NOW | RTLD_NOLOAD), "GOMP_parallel");
    __atomic_add_fetch(&regions, 1, __ATOMIC_RELAXED);
    real(fn, data, nthreads, flags);
}
long gomp_regions(void) { return regions; }
"""

COST_C = r"""
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
/* argv: n threads. Prints seconds per empty parallel region and per barrier of a
 * persistent team, each the best of 3 loops of n. */
int main(int argc, char **argv) {
    const long n = atol(argv[1]);
    const int threads = atoi(argv[2]);
    volatile long sink = 0;
    double best_region = 1e9, best_barrier = 1e9;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = omp_get_wtime();
        for (long i = 0; i < n; i++) {
#pragma omp parallel num_threads(threads)
            { if (omp_get_thread_num() == 0) sink += 1; }
        }
        double t1 = omp_get_wtime();
#pragma omp parallel num_threads(threads)
        {
            for (long i = 0; i < n; i++) {
#pragma omp barrier
            }
        }
        double t2 = omp_get_wtime();
        if ((t1 - t0) / n < best_region) best_region = (t1 - t0) / n;
        if ((t2 - t1) / n < best_barrier) best_barrier = (t2 - t1) / n;
    }
    printf("%.9g %.9g\n", best_region, best_barrier);
    return (int)(sink < 0);
}
"""

CHILD = r"""
import ctypes, json, sys, time
lib = ctypes.CDLL(sys.argv[1]); lib.gomp_regions.restype = ctypes.c_long
import marcache as mc
path, steps, cfg, label, threads = sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
m = mc.load(path, threads=threads)
out = []
for name in ("NoCache", "LazyMAR"):
    cache = getattr(mc, name)()
    r0 = lib.gomp_regions(); t0 = time.perf_counter()
    _, info = m.generate_tokens(labels=[label], steps=steps, cfg=cfg, cache=cache, return_info=True)
    seconds = time.perf_counter() - t0
    out.append(dict(policy=name, regions=lib.gomp_regions() - r0, seconds=seconds,
                    head_evaluations=sum(s["head_evaluations"] for s in info.steps),
                    head_seconds=info.phases["head"]["seconds"]))
print(json.dumps(out))
"""


def build(tmp):
    cc = os.environ.get("CC", "gcc")
    counter, cost = os.path.join(tmp, "libregions.so"), os.path.join(tmp, "regions_cost")
    with open(os.path.join(tmp, "counter.c"), "w") as f:
        f.write(COUNTER_C)
    with open(os.path.join(tmp, "cost.c"), "w") as f:
        f.write(COST_C)
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", counter, os.path.join(tmp, "counter.c"), "-ldl"], check=True)
    subprocess.run([cc, "-O2", "-fopenmp", "-o", cost, os.path.join(tmp, "cost.c")], check=True)
    return counter, cost


def marcache_env(**extra):
    """This process's environment with marcache's own OpenMP setting (the spin bound it sets
    at import) and the checkout on the import path."""
    import importlib

    importlib.import_module("marcache")  # sets GOMP_SPINCOUNT in os.environ unless the user chose

    return child_env(**extra)


def region_costs(cost_exe, n, threads):
    out = subprocess.run([cost_exe, str(n), str(threads)], env=marcache_env(), capture_output=True, text=True,
                         check=True).stdout.split()
    return float(out[0]), float(out[1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="digits", choices=["digits", "mar_base"])
    parser.add_argument("--steps", type=int, default=None, help="AR steps (digits: 16, mar_base: 4)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--busy", type=int, default=0, help="also measure beside this many spinning processes")
    parser.add_argument("--n", type=int, default=200000, help="regions / barriers per cost loop")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    if args.model == "digits":
        path, steps, cfg, label = os.path.join(ROOT, "marcache", "data", "digits_mar.safetensors"), 16, 2.0, 3
    else:
        path, steps, cfg, label = os.path.join(HERE, ".cache", "mar_base_random.safetensors"), 4, 2.9, 207
        if not os.path.exists(path):
            sys.exit(f"{path} is missing: python benchmarks/bench_cpu.py --steps 1 --batches 1 writes it")
    steps = args.steps or steps
    tmp = tempfile.mkdtemp()
    try:
        counter, cost = build(tmp)
        loads = ["idle"] + (["busy"] if args.busy else [])
        results = {}
        for load in loads:
            procs = start_busy(args.busy) if load == "busy" else []
            try:
                region_s, barrier_s = region_costs(cost, args.n if load == "idle" else max(args.n // 20, 1000),
                                                   args.threads)
                child = subprocess.run([sys.executable, "-c", CHILD, counter, path, str(steps), str(cfg), str(label),
                                        str(args.threads)], env=marcache_env(LD_PRELOAD=counter),
                                       capture_output=True, text=True)
                if child.returncode != 0:
                    sys.exit(child.stderr[-3000:])
                runs = json.loads(child.stdout.strip().splitlines()[-1])
            finally:
                stop_busy(procs)
            results[load] = dict(region_seconds=region_s, barrier_seconds=barrier_s, runs=runs,
                                 load_average=os.getloadavg()[0])
            print(f"{load}: one parallel region {region_s * 1e6:.2f} us, one barrier {barrier_s * 1e6:.2f} us "
                  f"({args.threads} threads, load average {os.getloadavg()[0]:.2f})", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\n{args.model}, {steps} AR steps, batch 1, cfg {cfg}, threads={args.threads}, "
          f"GOMP_SPINCOUNT={marcache_env().get('GOMP_SPINCOUNT', 'unset')}")
    rows = []
    for load, r in results.items():
        for run in r["runs"]:
            saved = run["regions"] * max(r["region_seconds"] - r["barrier_seconds"], 0.0)
            rows.append([load, run["policy"], run["regions"], f"{run['regions'] / run['head_evaluations']:.1f}",
                         f"{run['seconds']:.2f}", f"{saved:.3f}", f"{100 * saved / run['seconds']:.1f}%"])
    print_table(["load", "policy", "parallel regions", "regions / head evaluation (all phases)", "run s",
                 "saved by one team (s, at most)", "share of the run"], rows)
    write_json(args.json, model=args.model, steps=steps, threads=args.threads, results=results)


if __name__ == "__main__":
    main()

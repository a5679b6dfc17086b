"""Two builds of marcache side by side: every cache policy of bench_cache.py, timed on the
same weights, seeds and settings, alternating between the builds run by run, so that a
restructuring can show it made no policy slower (issue 14).

Each build is a folder that holds an importable `marcache` package with its built `_C`
(for example a worktree after `python setup.py build_ext --inplace`, or a copy of an
older one). Every timed run is a fresh interpreter that imports one build, loads the
weights (not timed), runs one policy once to warm up, and then times one more run; the
runs of the two builds interleave (A B B A A B ...), which spreads drift in the machine's
load evenly over both. The table gives the median seconds of each build and their ratio,
with the spread (min..max) of each, so "the same within noise" can be read off.

    python benchmarks/bench_builds.py --old /path/to/old_root --new . --steps 16 --batch 2 --repeats 3
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import print_table, write_json  # noqa: E402

CHILD = r"""
import json, sys, time
sys.path.insert(0, {root!r})
sys.path.insert(1, {bench!r})
import marcache as mc
from bench_cache import POLICIES
assert mc.__file__.startswith({root!r}), mc.__file__
model = mc.load({weights!r})
labels = [(207 + 31 * i) % {num_classes} for i in range({batch})]
cache = POLICIES[{policy!r}][1]()
kwargs = dict(labels=labels, steps={steps}, cfg={cfg}, seed=0, cache=cache)
model.generate_tokens(**kwargs)
t0 = time.perf_counter()
model.generate_tokens(**kwargs)
print(json.dumps(dict(seconds=time.perf_counter() - t0)))
"""


def run_once(root, policy, args):
    code = CHILD.format(root=os.path.abspath(root), bench=HERE, weights=args.weights, batch=args.batch,
                        num_classes=args.num_classes, policy=policy, steps=args.steps, cfg=args.cfg)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    if proc.returncode != 0:
        raise SystemExit(f"build {root}, policy {policy} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["seconds"]


POLICY_NAMES = ["none", "lazymar", "lazymar-token", "lazymar-cond", "lazymar-head", "marche", "marche-enc",
                "marche-composed"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="folder holding the old build's marcache package")
    parser.add_argument("--new", required=True, help="folder holding the new build's marcache package")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--cfg", type=float, default=2.9)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--policies", nargs="+", default=POLICY_NAMES, choices=POLICY_NAMES)
    parser.add_argument("--weights", default=os.path.join(HERE, ".cache", "mar_base_random.safetensors"))
    parser.add_argument("--num-classes", type=int, default=1000,
                        help="labels are drawn below this (10 with --weights marcache/data/digits_mar.safetensors, "
                             "the shipped digits MAR: a restructuring check that runs in minutes on a slow machine)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sys.path.insert(0, os.path.abspath(args.new))  # the titles and the weight writer, from the new build
    from bench_cache import POLICIES
    from bench_cpu import write_random_mar_base

    if not os.path.exists(args.weights):
        os.makedirs(os.path.dirname(args.weights), exist_ok=True)
        print(f"writing random MAR-B weights to {args.weights} ...", flush=True)
        write_random_mar_base(args.weights)

    times = {(build, p): [] for build in ("old", "new") for p in args.policies}
    for rep in range(args.repeats):
        order = ("old", "new") if rep % 2 == 0 else ("new", "old")
        for policy in args.policies:
            for build in order:
                seconds = run_once(getattr(args, build), policy, args)
                times[(build, policy)].append(seconds)
                print(f"repeat {rep} {policy:16s} {build}: {seconds:.2f} s", flush=True)

    print()
    print(f"{os.path.basename(args.weights)}, CPU fp32, {args.steps} AR steps, cfg {args.cfg}, batch {args.batch}, "
          f"{args.repeats} timed runs per build and policy, builds alternating")
    rows = []
    for policy in args.policies:
        old, new = times[("old", policy)], times[("new", policy)]
        rows.append(dict(policy=policy, old=old, new=new, ratio=statistics.median(new) / statistics.median(old)))
    print_table(["policy", "old s (median, min..max)", "new s (median, min..max)", "new / old"],
                [[POLICIES[r["policy"]][0], f"{statistics.median(r['old']):.2f} ({min(r['old']):.2f}..{max(r['old']):.2f})",
                  f"{statistics.median(r['new']):.2f} ({min(r['new']):.2f}..{max(r['new']):.2f})",
                  f"{r['ratio']:.3f}"] for r in rows])
    write_json(args.json, rows=rows, steps=args.steps, cfg=args.cfg, batch=args.batch)


if __name__ == "__main__":
    main()

"""DiSA and its compositions on the shipped digits MAR (issue 20): marcache.eval.frontier
of NoCache, LazyMAR, MARche, DiSA and DiSA composed with each, on the same labels and
seeds, the policies alternating batch by batch. Writes the table as JSON and Markdown
rows and the frontier plot.

    python benchmarks/disa_digits.py [--n 500] [--batch 8] [--json F] [--plot F.png]
    python benchmarks/disa_digits.py --only NoCache "DiSA 10-2+LazyMAR(no head cache, start=1, period=16)"

Also prints the exact FLOP ratios of DiSA and LazyMAR + DiSA on MAR-B (64 steps, CFG,
batch 1 and 8; marcache.flops, equal to the engine's telemetry)."""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import marcache as mc  # noqa: E402
from marcache import eval as E  # noqa: E402


def policies():
    return {
        "NoCache": mc.NoCache(),
        "LazyMAR": mc.LazyMAR(),
        "MARche": mc.MARche(),
        "DiSA 50-5": mc.DiSA(),
        "LazyMAR+DiSA 50-5": mc.DiSA(inner=mc.LazyMAR()),
        "LazyMAR+DiSA 25-5": mc.DiSA(start=25, end=5, inner=mc.LazyMAR()),
        "MARche+DiSA 50-5": mc.DiSA(inner=mc.MARche(head_cache=True)),
        # LazyMAR's head cache reuses block outputs between adjacent diffusion steps, which
        # lie far apart in a 5-to-50-step respacing: without it the compositions keep quality
        "LazyMAR(no head cache)+DiSA 50-5": mc.DiSA(inner=mc.LazyMAR(head_cache=False)),
        "LazyMAR(no head cache)+DiSA 25-5": mc.DiSA(start=25, end=5, inner=mc.LazyMAR(head_cache=False)),
        "LazyMAR(no head cache)+DiSA 10-2": mc.DiSA(start=10, end=2, inner=mc.LazyMAR(head_cache=False)),
        "MARche+DiSA 25-5": mc.DiSA(start=25, end=5, inner=mc.MARche()),
        # Toward issue 20's 5x: at the digits model's 16 AR steps LazyMAR's defaults (start 5,
        # period 9) run 7 full steps; fewer full steps, or guidance only for the first quarter
        # of the steps, bring the FLOP ratio to 4.7-5.0x with DiSA 10 -> 2
        "DiSA 10-2+LazyMAR(no head cache, start=2, period=16)":
            mc.DiSA(start=10, end=2, inner=mc.LazyMAR(head_cache=False, start=2, period=16)),
        "DiSA 10-2+LazyMAR(no head cache, start=1, period=16)":
            mc.DiSA(start=10, end=2, inner=mc.LazyMAR(head_cache=False, start=1, period=16)),
        "DiSA 10-2+CfgFreeLate(0.25, LazyMAR(no head cache, start=2, period=5))":
            mc.DiSA(start=10, end=2, inner=mc.CfgFreeLate(
                after=0.25, inner=mc.LazyMAR(head_cache=False, start=2, period=5))),
        # Past LazyMAR's 5.0x FLOP ceiling there: MARche's cache-aware attention with its
        # encoder and condition caches leaves less of the transformer than LazyMAR's full
        # steps do (marcache.flops: 5.6x to 7.9x with DiSA 10 -> 2; refresh_period is how
        # often the cached K/V are refreshed)
        "DiSA 10-2+MARche(encoder and cond caches, refresh 6)":
            mc.DiSA(start=10, end=2, inner=mc.MARche(encoder_cache=True, cond_cache=True, refresh_period=6)),
        "DiSA 10-2+MARche(encoder and cond caches, refresh 16)":
            mc.DiSA(start=10, end=2, inner=mc.MARche(encoder_cache=True, cond_cache=True, refresh_period=16)),
        "DiSA 10-2+CfgFreeLate(0.25, MARche(encoder and cond caches, refresh 3))":
            mc.DiSA(start=10, end=2, inner=mc.CfgFreeLate(
                after=0.25, inner=mc.MARche(encoder_cache=True, cond_cache=True))),
        "DiSA 10-2+CfgFreeLate(0.25, MARche(encoder and cond caches, refresh 6))":
            mc.DiSA(start=10, end=2, inner=mc.CfgFreeLate(
                after=0.25, inner=mc.MARche(encoder_cache=True, cond_cache=True, refresh_period=6))),
    }


def mar_b_flop_ratios(cfg=2.9):
    out = {}
    for batch in (1, 8):
        base = mc.flops("mar_base", steps=64, cfg=cfg, batch=batch).total
        for name, p in (("DiSA", mc.DiSA()), ("LazyMAR", mc.LazyMAR()), ("LazyMAR+DiSA", mc.DiSA(inner=mc.LazyMAR()))):
            out[f"{name} batch {batch}"] = base / mc.flops("mar_base", steps=64, cfg=cfg, batch=batch, cache=p).total
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=500, help="digits per policy (a multiple of 10)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=mc.digits.STEPS)
    p.add_argument("--cfg", type=float, default=mc.digits.CFG)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="engine threads (0: all cores)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--only", nargs="+", default=None, metavar="POLICY",
                   help="run only these policies (names as in the table; NoCache is the speed-up's base)")
    args = p.parse_args(argv)
    grid = policies()
    if args.only:
        unknown = [name for name in args.only if name not in grid]
        if unknown:
            p.error(f"unknown policies {unknown}; known: {sorted(grid)}")
        grid = {name: grid[name] for name in args.only}
    model = mc.digits.load_model(threads=args.threads)
    classifier = mc.digits.Classifier.load()
    load_before = os.getloadavg()
    result = E.frontier(model, classifier, grid, args.n, per_class=args.n // 10, seed=args.seed,
                        batch_size=args.batch, steps=args.steps, cfg=args.cfg, progress=True)
    load_after = os.getloadavg()
    print(result.table())
    print("load average before %.1f, after %.1f" % (load_before[0], load_after[0]))
    ratios = mar_b_flop_ratios()
    for k, v in ratios.items():
        print("MAR-B 64 steps cfg 2.9 FLOP ratio %-24s %.3fx" % (k, v))
    if args.plot:
        E.plot_frontier(result, args.plot, title="digits MAR, %d digits, %d steps, cfg %g, batch %d" % (
            args.n, args.steps, args.cfg, args.batch))
    if args.json:
        rows = [dict(policy=r.name, cache=repr(r.cache), seconds_per_image=r.seconds_per_image, speedup=r.speedup,
                     gflop_per_image=r.flops_per_image / 1e9, flop_ratio=r.flop_ratio, fid=r.fid,
                     accuracy=r.accuracy, pareto=r.pareto) for r in result.rows]
        with open(args.json, "w") as f:
            json.dump(dict(n=args.n, batch=args.batch, threads=args.threads, steps=args.steps, cfg=args.cfg, seed=args.seed,
                           load_average=[load_before[0], load_after[0]], rows=rows,
                           mar_b_flop_ratios=ratios), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

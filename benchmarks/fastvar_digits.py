"""FastVAR's quality/speed curve on the shipped digits VAR (issue 16): for each setting,
N images (N / 10 per class) with the same seed, the digits classifier's class accuracy
and the digits-FID against the training digits (marcache.digits), the transformer FLOPs
per image (the engine's telemetry) and the wall time of generation (CPU).

    python benchmarks/fastvar_digits.py [--n 500] [--var PATH --vqvae PATH] [--cfg 1.5 ...]

The settings are the spec's (Part D8/D9) transposed to the digits VAR's patch_nums: with
1,2,3,4,6,8 the "last two scales" are 6x6 (scale 4) and 8x8 (scale 5) and the cache scale
the 4x4 before them (scale 3), the analogue of the released models' 10x10 before 13x13 and
16x16. Prints one line per setting and, with --json, writes the table."""
import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import marcache as mc  # noqa: E402

DATA = os.path.join(os.path.dirname(HERE), "marcache", "data")


def settings_for(n_scales, depth):
    """name -> cache policy, for a model of n_scales scales and depth blocks."""
    last, prev, cache = n_scales - 1, n_scales - 2, n_scales - 3
    return {
        "nocache": mc.NoCache(),
        "harp-like {%d:0.5,%d:0.75}" % (prev, last): mc.FastVAR(cache_scale=cache, prune={prev: 0.5, last: 0.75}),
        "infinity-like {%d:0.4,%d:0.5}" % (prev, last): mc.FastVAR(cache_scale=cache, prune={prev: 0.4, last: 0.5}),
        "last only {%d:0.5}" % last: mc.FastVAR(cache_scale=cache, prune={last: 0.5}),
        "last only {%d:0.75}" % last: mc.FastVAR(cache_scale=cache, prune={last: 0.75}),
        "cache %d, last {%d:0.5}" % (prev, last): mc.FastVAR(cache_scale=prev, prune={last: 0.5}),
        "harp-like, blocks 1..%d" % (depth - 2): mc.FastVAR(cache_scale=cache, prune={prev: 0.5, last: 0.75},
                                                            layers=(1, depth - 1)),
        "{%d:0.5} + skip last" % prev: mc.FastVAR(cache_scale=cache, prune={prev: 0.5, last: 1.0}),
        "skip last": mc.FastVAR(cache_scale=cache, prune={}, skip_last=1),
        # CfgFreeLate (guidance only before `after`), alone and composed with FastVAR
        "cfg-free last (after %.2f)" % (last / n_scales): mc.CfgFreeLate(after=last / n_scales),
        "cfg-free last two (after %.2f)" % (prev / n_scales): mc.CfgFreeLate(after=prev / n_scales),
        "cfg-free last + cache %d, last {%d:0.5}" % (prev, last): mc.CfgFreeLate(
            after=last / n_scales, inner=mc.FastVAR(cache_scale=prev, prune={last: 0.5})),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--var", default=os.path.join(DATA, "digits_var.safetensors"))
    p.add_argument("--vqvae", default=os.path.join(DATA, "digits_vqvae.safetensors"))
    p.add_argument("--n", type=int, default=500, help="images per setting (a multiple of 10)")
    p.add_argument("--cfg", type=float, default=getattr(mc.digits, "VAR_CFG", 1.5))
    p.add_argument("--top-k", type=int, default=getattr(mc.digits, "VAR_TOP_K", 0))
    p.add_argument("--top-p", type=float, default=getattr(mc.digits, "VAR_TOP_P", 0.0))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--json", default=None, help="write the table here")
    p.add_argument("--only", nargs="+", default=None,
                   help="run only the settings whose name contains one of these (NoCache always runs)")
    args = p.parse_args(argv)
    if not (os.path.exists(args.var) and os.path.exists(args.vqvae)):
        print("the digits VAR is not there (%s, %s): nothing measured" % (args.var, args.vqvae))
        return 1
    model = mc.load(args.var, vae=args.vqvae)
    c = model.config
    classifier = mc.digits.Classifier.load()
    reference = mc.digits.reference_stats(classifier)
    labels = mc.digits.class_labels(args.n // 10)
    rows = []
    print("digits VAR: patch_nums %s, depth %d; %d images, cfg %g, top_k %d, top_p %g, seed %d" % (
        ",".join(map(str, c["patch_nums"])), c["depth"], labels.size, args.cfg, args.top_k, args.top_p, args.seed))
    base_flops = None
    for name, policy in settings_for(len(c["patch_nums"]), c["depth"]).items():
        if args.only and name != "nocache" and not any(part in name for part in args.only):
            continue
        images, seconds, flops = [], 0.0, 0.0
        for start in range(0, labels.size, args.batch):
            t0 = time.perf_counter()
            out, info = model.generate(labels[start:start + args.batch], cfg=args.cfg, top_k=args.top_k,
                                       top_p=args.top_p, seed=args.seed, first_index=start, cache=policy,
                                       return_info=True)
            seconds += time.perf_counter() - t0
            flops += info.flops
            images.append(out)
        images = np.concatenate(images)
        stats, _ = mc.digits.sample_stats([images], classifier)
        from marcache.eval import fid
        row = dict(setting=name, policy=repr(policy), accuracy=classifier.accuracy(images, labels),
                   fid=float(fid(stats, reference, method="symmetric")), gflop_per_image=flops / labels.size / 1e9,
                   seconds=seconds)
        base_flops = base_flops or row["gflop_per_image"]
        row["flop_share"] = row["gflop_per_image"] / base_flops
        rows.append(row)
        print("%-32s accuracy %.3f  digits-FID %7.3f  %.4f GFLOP/image (%5.1f %%)  %.1f s" % (
            name, row["accuracy"], row["fid"], row["gflop_per_image"], 100 * row["flop_share"], seconds))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.var, n=int(labels.size), cfg=args.cfg, top_k=args.top_k, top_p=args.top_p,
                           seed=args.seed, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

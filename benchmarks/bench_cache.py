"""Cache policies side by side on the CPU (issues: LazyMAR, MARche).

Rows: NoCache, LazyMAR with all three caches and each cache alone (ablations),
MARche at the paper's defaults read as decoder-only, with LazyMAR's encoder
cache (an extension), and composed with LazyMAR's condition and head caches.

MAR-B configuration with random weights in the official layout, 64 AR steps,
CFG 2.9 (linear), batch 8 by default. Every policy runs in the same process
on the same weights and seeds; the table shows wall-clock seconds, the
wall-clock speed-up over NoCache next to the FLOP ratio (marcache's own count,
equal to the engine's telemetry), and achieved GFLOP/s.

    python benchmarks/bench_cache.py                       # all rows (~25 min on 2 cores)
    python benchmarks/bench_cache.py --policies none lazymar --steps 16 --batch 2   # a quick look
"""
import argparse
import os
import sys
import time

import marcache as mc

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import print_table, write_json  # noqa: E402
from bench_cpu import write_random_mar_base  # noqa: E402

POLICIES = {
    "none": ("NoCache", lambda: mc.NoCache()),
    "lazymar": ("LazyMAR (all three caches)", lambda: mc.LazyMAR()),
    "lazymar-token": ("LazyMAR token cache only", lambda: mc.LazyMAR(cond_cache=False, head_cache=False)),
    "lazymar-cond": ("LazyMAR condition cache only", lambda: mc.LazyMAR(token_cache=False, head_cache=False)),
    "lazymar-head": ("LazyMAR head cache only", lambda: mc.LazyMAR(token_cache=False, cond_cache=False)),
    "marche": ("MARche (paper defaults, decoder only)", lambda: mc.MARche()),
    "marche-enc": ("MARche + encoder cache (extension E1)", lambda: mc.MARche(encoder_cache=True)),
    "marche-composed": ("MARche + encoder, condition and head caches",
                        lambda: mc.MARche(encoder_cache=True, cond_cache=True, head_cache=True)),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--cfg", type=float, default=2.9)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--weights", default=os.path.join(HERE, ".cache", "mar_base_random.safetensors"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if "none" not in args.policies:
        args.policies.insert(0, "none")

    if not os.path.exists(args.weights):
        os.makedirs(os.path.dirname(args.weights), exist_ok=True)
        print(f"writing random MAR-B weights to {args.weights} ...", flush=True)
        write_random_mar_base(args.weights)
    model = mc.load(args.weights)
    print(f"BLAS core: {mc.build_info()['blas_core']}", flush=True)
    labels = [(207 + 31 * i) % 1000 for i in range(args.batch)]
    rows = []
    for key in args.policies:
        title, make = POLICIES[key]
        cache = make()
        t0 = time.perf_counter()
        _, info = model.generate_tokens(labels=labels, steps=args.steps, cfg=args.cfg, seed=0, cache=cache,
                                        return_info=True)
        seconds = time.perf_counter() - t0
        expected = mc.flops(model, steps=args.steps, cfg=args.cfg, cache=cache, batch=args.batch).total
        assert abs(info.flops - expected) <= 1e-9 * expected
        rows.append(dict(policy=key, title=title, seconds=seconds, flops=info.flops,
                         cache_bytes=max(s["cache_bytes"] for s in info.steps)))
        print(f"{title}: {seconds:.1f} s, {info.flops / seconds / 1e9:.1f} GFLOP/s", flush=True)
    base = rows[0]
    print()
    print(f"MAR-B (random weights), CPU fp32, {args.steps} steps, cfg {args.cfg}, batch {args.batch}")
    print_table(["policy", "s/image", "wall-clock speed-up", "FLOP ratio", "TFLOP/image", "GFLOP/s", "cache MB"],
                [[r["title"], f"{r['seconds'] / args.batch:.2f}", f"{base['seconds'] / r['seconds']:.2f}x",
                  f"{base['flops'] / r['flops']:.2f}x", f"{r['flops'] / args.batch / 1e12:.3f}",
                  f"{r['flops'] / r['seconds'] / 1e9:.1f}", f"{r['cache_bytes'] / 2**20:.0f}"] for r in rows])
    write_json(args.json, rows=rows, steps=args.steps, cfg=args.cfg, batch=args.batch)


if __name__ == "__main__":
    main()

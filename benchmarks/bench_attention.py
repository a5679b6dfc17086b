"""The CPU attention op on its own, at the shapes MAR-B and VAR run (issue 23).

`attention` on the CPU runs, per (batch item, head), OpenBLAS GEMMs for the scores and for
P V around marcache's softmax rows (csrc/backend/cpu/cpu_attention.c, cpu_vmath.c). This
script compiles benchmarks/attention_time.c against the checkout's C sources (as
bench_linear.py does its harness), times the op through the backend's table at the given
query and key counts, and prints its GFLOP/s beside the sgemm rate measured in the same run:
the gap is the softmax and the GEMMs' small sizes. To compare two trees, run it from each
(`PYTHONPATH=<tree> python <tree>/benchmarks/bench_attention.py`), alternated.

    python benchmarks/bench_attention.py                       # MAR-B: 12 heads of 64, CFG batch 2
    python benchmarks/bench_attention.py --threads 1 --shapes 320x320 27x320
    python benchmarks/bench_attention.py --heads 16 --head-dim 64 --batch 2 --shapes 256x680   # VAR-d16's last scale
"""
import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import build_harness, print_machine, print_table, sgemm_rate, write_json  # noqa: E402

# Queries x keys of a batch-1 LazyMAR MAR-B image (2 x 12 heads of 64 with CFG): the
# decoder's full layers (320 x 320, 85% of the attention FLOPs), its cached layers (27-160
# queries) and the encoder (64 + known tokens).
SHAPES = ("320x320", "160x320", "27x320", "8x320", "1x320", "66x66", "192x192")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2, help="items (2: one image with CFG)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="QUERIESxKEYS")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    shapes = []
    for s in args.shapes:
        try:
            nq, keys = (int(v) for v in s.lower().split("x"))
        except ValueError:
            ap.error(f"--shapes {s!r}: expected QUERIESxKEYS, e.g. 320x320")
        if nq < 1 or keys < 1:
            ap.error(f"--shapes {s!r}: queries and keys must be positive")
        shapes.append((nq, keys))
    if min(args.threads, args.heads, args.head_dim, args.batch) < 1:
        ap.error("--threads, --heads, --head-dim and --batch must be positive")

    exe = os.path.join(HERE, ".cache", "attention_time")
    os.makedirs(os.path.dirname(exe), exist_ok=True)
    build_harness("attention_time.c", exe)
    peak, by_shape = sgemm_rate(((2048, 2048, 2048),), 5)
    print_machine(by_shape)
    import marcache as mc

    print(f"CPU ISA {mc.build_info()['cpu_isa']}; threads {args.threads}; load average {os.getloadavg()[0]:.2f}",
          flush=True)
    cmd = [exe, str(args.threads), str(args.heads), str(args.head_dim), str(args.batch)]
    for nq, keys in shapes:
        cmd += [str(nq), str(keys)]
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows, results = [], []
    # sgemm's rate is for all the threads; a one-thread run is held to its share.
    reach = peak * min(args.threads, os.cpu_count() or 1) / (os.cpu_count() or 1)
    for line in text.split("\n"):
        if not line.strip():
            continue
        nq, keys, micros, gflops = line.split()
        nq, keys, micros, gflops = int(nq), int(keys), float(micros), float(gflops)
        rows.append([nq, keys, f"{micros:.1f}", f"{gflops:.1f}", f"{100 * gflops / reach:.0f}%"])
        results.append({"queries": nq, "keys": keys, "microseconds": micros, "gflops": gflops})
    print(f"\nattention, fp32, batch {args.batch} x {args.heads} heads of {args.head_dim}, {args.threads} threads; "
          f"sgemm {peak:.1f} GFLOP/s (NumPy's OpenBLAS, same run, all cores)")
    print_table(["queries", "keys", "us per call", "GFLOP/s", "of sgemm (thread share)"], rows)
    if args.json:
        write_json(args.json, threads=args.threads, heads=args.heads, head_dim=args.head_dim, batch=args.batch,
                   sgemm_gflops=peak, results=results)


if __name__ == "__main__":
    main()

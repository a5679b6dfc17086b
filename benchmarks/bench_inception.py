"""CPU benchmark of the C FID-Inception network (issue: eval).

Full-width FID-Inception with random weights in the pytorch-fid layout (the
speed does not depend on the values). Reports images per second and the
achieved GFLOP/s (convolutions + fc, 2 per multiply-add: 11.43 GFLOP per
image) for 299x299 and 256x256 uint8 inputs at several chunk sizes, next to
the sgemm rate measured in the same run with the same thread pool. Best of
`--reps` timed passes after one warm-up pass.

    python benchmarks/bench_inception.py                 # ~1 min on 2 cores
    python benchmarks/bench_inception.py --chunks 8 --images 32
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np

import marcache  # noqa: F401
from marcache import _C

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--sides", type=int, nargs="+", default=[299, 256])
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()

    from reference import inception as RI
    from safetensors.numpy import save_file

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "fid_inception_random.safetensors")
        save_file(RI.random_weights(np.random.default_rng(0)), path)
        m, n, k = 4096, 768, 768
        gemm = 2 * m * n * k / _C.sgemm_seconds(m, n, k, 3) / 1e9
        print(f"sgemm {m}x{n}x{k}: {gemm:.1f} GFLOP/s (same thread pool)")
        print(f"{'side':>5} {'chunk':>6} {'img/s':>8} {'s/img':>8} {'GFLOP/s':>9} {'of sgemm':>9}")
        for side in args.sides:
            images = np.random.default_rng(side).integers(0, 256, (args.images, side, side, 3), dtype=np.uint8)
            for chunk in args.chunks:
                net = _C.Inception(path, num_threads=args.threads, chunk=chunk)
                net.features(images[:chunk])
                best = float("inf")
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    net.features(images)
                    best = min(best, time.perf_counter() - t0)
                rate = args.images / best
                gflops = net.flops_per_image * rate / 1e9
                print(f"{side:>5} {chunk:>6} {rate:>8.2f} {1 / rate:>8.3f} {gflops:>9.1f} {gflops / gemm:>8.0%}")


if __name__ == "__main__":
    main()

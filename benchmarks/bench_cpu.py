"""CPU benchmark of the whole MAR generate loop (issue: foundation).

MAR-B configuration with random weights in the official layout, 64 AR steps,
CFG 2.9 (linear schedule), batch 1 and 8. Reports seconds per image and the
achieved GFLOP/s (exact FLOPs from marcache.flops, the same count as the
engine's telemetry) next to the sgemm rate measured in the same run on the
same machine with the same thread pool.

    python benchmarks/bench_cpu.py                  # the full table (~25 min on 2 cores)
    python benchmarks/bench_cpu.py --steps 8 --batches 1 2   # a quick look
"""
import argparse
import os
import sys
import time

import numpy as np

import marcache as mc

from _common import print_machine, print_run_header, print_table, sgemm_rate, write_json

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def write_random_mar_base(path):
    from reference import mar as R
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {}
    for key, shape in R.official_shapes("mar_base").items():
        base = 1.0 if key.endswith(".weight") and len(shape) == 1 else 0.0
        tensors[key] = (base + 0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    save_file(tensors, path)


# The GEMM shapes the MAR-B model runs (nn.Linear form: rows x out x in).
SGEMM_SHAPES = [(2048, 2048, 2048), (5120, 3072, 768), (5120, 768, 3072), (64, 3072, 1024)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--cfg", type=float, default=2.9)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--weights", default=os.path.join(HERE, ".cache", "mar_base_random.safetensors"))
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    if not os.path.exists(args.weights):
        os.makedirs(os.path.dirname(args.weights), exist_ok=True)
        print(f"writing random MAR-B weights to {args.weights} ...", flush=True)
        write_random_mar_base(args.weights)
    model = mc.load(args.weights)
    peak_before, shapes = sgemm_rate(SGEMM_SHAPES, 5)
    print_machine(shapes)

    rows = []
    for batch in args.batches:
        labels = [(207 + 31 * i) % 1000 for i in range(batch)]
        expected = mc.flops(model, steps=args.steps, cfg=args.cfg, batch=batch)
        t0 = time.perf_counter()
        _, info = model.generate_tokens(labels=labels, steps=args.steps, cfg=args.cfg, seed=0, return_info=True)
        seconds = time.perf_counter() - t0
        assert abs(info.flops - expected.total) <= 1e-9 * expected.total, (info.flops, expected.total)
        head_s = sum(s["seconds"] for s in info.steps)
        rows.append(dict(batch=batch, seconds=seconds, seconds_per_image=seconds / batch,
                         tflops=info.flops / 1e12, gflops_per_s=info.flops / seconds / 1e9, loop_seconds=head_s))
        print(f"batch {batch}: {seconds:.1f} s, {info.flops / seconds / 1e9:.1f} GFLOP/s", flush=True)
    peak_after, _ = sgemm_rate(SGEMM_SHAPES, 5)
    peak = max(peak_before, peak_after)
    print_run_header(f"MAR-B (random weights), {args.steps} steps, cfg {args.cfg} linear, CPU fp32", peak_before,
                     peak_after)
    print_table(["batch", "s/image", "TFLOP/image", "achieved GFLOP/s", "% of sgemm"],
                [[r["batch"], f"{r['seconds_per_image']:.2f}", f"{r['tflops'] / r['batch']:.3f}",
                  f"{r['gflops_per_s']:.1f}", f"{100 * r['gflops_per_s'] / peak:.0f}%"] for r in rows])
    write_json(args.json, sgemm_peak=peak, sgemm_shapes=shapes, rows=rows, steps=args.steps, cfg=args.cfg)


if __name__ == "__main__":
    main()

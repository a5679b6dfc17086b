"""CPU benchmark of the whole MAR generate loop (issue: foundation; the floor: issue 23).

MAR-B configuration with random weights in the official layout, 64 AR steps,
CFG 2.9 (linear schedule), batch 1 and 8. Reports seconds per image and the
achieved GFLOP/s (exact FLOPs from marcache.flops, the same count as the
engine's telemetry) next to the sgemm rate measured in the same run on the
same machine with the same thread pool.

A second table splits each run by phase (encoder blocks, decoder blocks, head, the rest),
from the engine's telemetry (info.phases): each phase's GFLOP/s and weight GB/s beside
the sgemm rate and sgemv bandwidth, and its time over its own floor.

The floor of each configuration, beside its measured time: the transformer's FLOPs
(encoder + decoder) at the measured sgemm rate, plus the head at its roofline, the
larger of its FLOPs at the sgemm rate and the bytes of head weights it streams
(marcache.flops' head_params_read x the weight type's size: each diffusion evaluation
reads its Linear weights once, whatever its row count) at the sgemv bandwidth measured
in the same run (NumPy's OpenBLAS over the head's bytes). At batch 1 the head is
bandwidth-bound; "x floor" is the measured time over the floor.

    python benchmarks/bench_cpu.py                  # the full table (~25 min on 2 cores)
    python benchmarks/bench_cpu.py --steps 8 --batches 1 2   # a quick look
    python benchmarks/bench_cpu.py --dtypes fp32 bf16       # bf16 Linear weights beside fp32
    python benchmarks/bench_cpu.py --caches nocache lazymar disa lazymar+disa   # policies side by side

With --caches, each (weights, batch) runs every policy in turn, so the wall speed-up
and the FLOP ratio against NoCache are measured side by side in the same run, and each
policy's floor is its own: its transformer and head FLOPs and the head weights it
streams (a LazyMAR cached head evaluation reads fewer of them).
"""
import argparse
import os
import sys
import time

from _common import (numpy_blas_threads, print_machine, print_run_header, print_table, sgemm_rate, sgemv_bandwidth,
                     write_json)

numpy_blas_threads()  # before NumPy's import: its OpenBLAS runs the sgemv

import numpy as np  # noqa: E402

import marcache as mc  # noqa: E402

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


WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# The policies --caches can name (issue 20's DiSA and its LazyMAR compositions among them).
CACHES = {
    "nocache": mc.NoCache(),
    "lazymar": mc.LazyMAR(),
    "disa": mc.DiSA(),
    "lazymar+disa": mc.DiSA(inner=mc.LazyMAR()),
    "lazymar-nohead+disa": mc.DiSA(inner=mc.LazyMAR(head_cache=False)),
}


def roofline_seconds(flops, weight_bytes, sgemm_gflops, sgemv_gbs):
    """The larger of `flops` at the sgemm rate and `weight_bytes` at the sgemv bandwidth."""
    return max(flops / (sgemm_gflops * 1e9), (weight_bytes or 0.0) / (sgemv_gbs * 1e9))


def floor_seconds(report, dtype, sgemm_gflops, sgemv_gbs):
    """(transformer, head) seconds of a run at this machine's limits: the transformer's
    FLOPs at the sgemm rate; the head at the larger of its FLOPs at the sgemm rate and its
    weight bytes at the sgemv bandwidth."""
    transformer = roofline_seconds(report.encoder + report.decoder, 0.0, sgemm_gflops, sgemv_gbs)
    head = roofline_seconds(report.head, report.head_params_read * WEIGHT_BYTES[dtype], sgemm_gflops, sgemv_gbs)
    return transformer, head


def phase_rows(rows, sgemm_gflops, sgemv_gbs):
    """One table row per (run, phase) of the telemetry: its seconds per image, its share of
    the run's, its rates against the machine's two limits and its time over its floor."""
    out = []
    for r in rows:
        total = sum(p["seconds"] for p in r["phases"].values())
        for name, p in r["phases"].items():
            floor = roofline_seconds(p["flops"], p["weight_bytes"], sgemm_gflops, sgemv_gbs)
            gbs = p["gb_per_s"]
            out.append([r["dtype"], r["batch"], r["cache"], name, f"{p['seconds'] / r['batch']:.2f}",
                        f"{100 * p['seconds'] / total:.0f}%", f"{p['gflops_per_s']:.1f}",
                        f"{100 * p['gflops_per_s'] / sgemm_gflops:.0f}%", "-" if gbs is None else f"{gbs:.1f}",
                        "-" if gbs is None else f"{100 * gbs / sgemv_gbs:.0f}%",
                        f"{p['seconds'] / floor:.2f}x" if floor > 0 else "-"])
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--cfg", type=float, default=2.9)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtypes", nargs="+", default=["fp32"], choices=sorted(WEIGHT_BYTES),
                        help="Linear weight types to run (marcache.load's dtype)")
    parser.add_argument("--caches", nargs="+", default=["nocache"], choices=list(CACHES),
                        help="policies to run side by side (speed-ups are against nocache when it is listed)")
    parser.add_argument("--weights", default=os.path.join(HERE, ".cache", "mar_base_random.safetensors"))
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    if not os.path.exists(args.weights):
        os.makedirs(os.path.dirname(args.weights), exist_ok=True)
        print(f"writing random MAR-B weights to {args.weights} ...", flush=True)
        write_random_mar_base(args.weights)
    models = {dtype: mc.load(args.weights, dtype=dtype) for dtype in args.dtypes}
    peak_before, shapes = sgemm_rate(SGEMM_SHAPES, 5)
    # The head's fp32 weights streamed by one diffusion evaluation of MAR-B (134 MB; one AR
    # step reads them once per diffusion step, and cond_embed once).
    model0 = models[args.dtypes[0]]
    head_bytes = 4 * mc.flops(model0, steps=1).head_params_read / model0.config.get("diffusion_steps", 100)
    sgemv_before = sgemv_bandwidth(int(head_bytes), 5)
    print_machine(shapes)
    info = mc.build_info()
    print(f"small-row linear: {info['cpu_isa']}, fp32 panels rows <= {info['panel_max']}, lanes rows <= "
          f"{info['smallrow_max']}; huge pages "
          f"{'on' if info['huge_pages'] == 1 else 'off'}; sgemv over the head's "
          f"{head_bytes / 1e6:.0f} MB: {sgemv_before:.1f} GB/s; load average {os.getloadavg()[0]:.2f}", flush=True)

    rows = []
    for dtype in args.dtypes:
        model = models[dtype]
        for batch in args.batches:
            labels = [(207 + 31 * i) % 1000 for i in range(batch)]
            for cache_name in args.caches:
                cache = CACHES[cache_name]
                expected = mc.flops(model, steps=args.steps, cfg=args.cfg, batch=batch, cache=cache)
                t0 = time.perf_counter()
                _, info = model.generate_tokens(labels=labels, steps=args.steps, cfg=args.cfg, seed=0, cache=cache,
                                                return_info=True)
                seconds = time.perf_counter() - t0
                assert abs(info.flops - expected.total) <= 1e-9 * expected.total, (info.flops, expected.total)
                head_s = sum(s["seconds"] for s in info.steps)
                phases = info.phases
                assert phases["head"]["flops"] == expected.head, (phases["head"]["flops"], expected.head)
                rows.append(dict(dtype=dtype, batch=batch, cache=cache_name, seconds=seconds,
                                 seconds_per_image=seconds / batch, tflops=info.flops / 1e12,
                                 gflops_per_s=info.flops / seconds / 1e9, loop_seconds=head_s, report=expected,
                                 phases=phases))
                print(f"{dtype} batch {batch} {cache_name}: {seconds:.1f} s, {info.flops / seconds / 1e9:.1f} GFLOP/s, "
                      f"load average {os.getloadavg()[0]:.2f}", flush=True)
    peak_after, _ = sgemm_rate(SGEMM_SHAPES, 5)
    sgemv_after = sgemv_bandwidth(int(head_bytes), 5)
    peak, sgemv = max(peak_before, peak_after), max(sgemv_before, sgemv_after)
    print_run_header(f"MAR-B (random weights), {args.steps} steps, cfg {args.cfg} linear, CPU", peak_before,
                     peak_after)
    print(f"measured sgemv bandwidth: {sgemv:.1f} GB/s (before {sgemv_before:.1f}, after {sgemv_after:.1f}); "
          f"load average {os.getloadavg()[0]:.2f}")
    table = []
    baseline = {(r["dtype"], r["batch"]): r for r in rows if r["cache"] == "nocache"}
    for r in rows:
        transformer_s, head_s = floor_seconds(r.pop("report"), r["dtype"], peak, sgemv)
        r.update(floor_transformer_seconds=transformer_s, floor_head_seconds=head_s,
                 floor_seconds=transformer_s + head_s)
        base = baseline.get((r["dtype"], r["batch"]))
        if base is not None:
            r.update(speedup=base["seconds"] / r["seconds"], flop_ratio=base["tflops"] / r["tflops"])
        table.append([r["dtype"], r["batch"], r["cache"], f"{r['seconds_per_image']:.2f}",
                      f"{r['speedup']:.2f}x" if "speedup" in r else "-",
                      f"{r['flop_ratio']:.3f}x" if "flop_ratio" in r else "-", f"{r['tflops'] / r['batch']:.3f}",
                      f"{r['gflops_per_s']:.1f}", f"{100 * r['gflops_per_s'] / peak:.0f}%",
                      f"{r['floor_seconds'] / r['batch']:.2f} ({transformer_s / r['batch']:.2f} + "
                      f"{head_s / r['batch']:.2f})", f"{r['seconds'] / r['floor_seconds']:.2f}x"])
    print_table(["weights", "batch", "policy", "s/image", "wall speed-up", "FLOP ratio", "TFLOP/image",
                 "achieved GFLOP/s", "% of sgemm", "floor s/image (transformer + head)", "x floor"], table)
    print()
    print(f"Per phase (the engine's telemetry, info.phases), beside this run's sgemm rate {peak:.1f} GFLOP/s and "
          f"sgemv bandwidth {sgemv:.1f} GB/s. A phase's floor is the larger of its FLOPs at the sgemm rate and its "
          f"weight bytes at the sgemv bandwidth; 'x floor' is its seconds over that.")
    print_table(["weights", "batch", "policy", "phase", "s/image", "share", "GFLOP/s", "% of sgemm",
                 "weight GB/s", "% of sgemv", "x floor"], phase_rows(rows, peak, sgemv))
    write_json(args.json, sgemm_peak=peak, sgemm_shapes=shapes, sgemv_gb_per_s=sgemv, rows=rows, steps=args.steps,
               cfg=args.cfg, caches={name: repr(CACHES[name]) for name in args.caches})


if __name__ == "__main__":
    main()

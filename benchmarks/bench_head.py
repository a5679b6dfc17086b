"""The diffusion head against the machine's memory bandwidth (issue 23).

At batch 1 one diffusion step multiplies a few rows (2 x the tokens of the AR step with
CFG: 8 for MAR-B's first steps) by ~134 MB of fp32 head weights, 4 FLOPs per byte: the
head is bound by streaming its weights. This script measures, in one run:

  (a) the bandwidth this machine gives such a stream: an sgemv over the head's bytes
      (NumPy's OpenBLAS, `--threads` threads; the best of `--repeats`), and a plain
      streaming read of the same bytes (NumPy sums over halves, one Python thread each);
  (b) marcache's `head_sample` (the 100-step DDPM sampler with CFG) on MAR-B random
      weights at a few row counts, fp32 and bf16, with the small-row path (the default:
      fp32 on column panels, bf16 on the lane kernel), fp32 on the lane kernel
      (MARCACHE_SMALLROW_PANELS=0), and without the small-row path
      (MARCACHE_SMALLROW_MAX=0: every linear goes to OpenBLAS, 16-bit weights widened per
      call), each variant a model of its own in this process, the
      variants alternated repeat by repeat so the machine's load falls on all alike.

It reports seconds per head_sample call, GB/s of head weights (the bytes each step
streams x steps, plus cond_embed once) and that as % of the sgemv bandwidth. bf16 streams
half the bytes: its GB/s counts bf16 bytes, and its "x fp32 speed" column is the time
ratio to the fp32 small-row run at the same rows. Where the machine's arithmetic is
nearer its limit than its memory (a fast memory, or more rows), the head is bound by its
FLOPs instead (2 x rows per weight): the last columns give the achieved GFLOP/s and the
head's time against its roofline, max(FLOPs / sgemm rate, bytes / sgemv bandwidth), both
measured in the same run (the sgemm rate by _common.sgemm_rate, marcache's own team).

    python benchmarks/bench_head.py                    # rows 2 8 16 32 64, fp32 and bf16
    python benchmarks/bench_head.py --rows 8 --dtypes fp32 --repeats 2   # a quick look

MARCACHE_CPU_ISA (auto, avx512, avx2, plain) picks the small-row kernels' instruction
set for the whole run; `--isa` adds variants with other sets side by side.
"""
import argparse
import os
import sys
import threading
import time

from _common import numpy_blas_threads, print_table, sgemm_rate, sgemv_bandwidth, write_json

numpy_blas_threads()  # before NumPy's import: its OpenBLAS runs the sgemv

import numpy as np  # noqa: E402

import marcache as mc  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# The sgemm rate of the roofline: the head's own layer shapes at 64 rows and a square one.
SGEMM_SHAPES = [(2048, 2048, 2048), (64, 3072, 1024)]


def head_weight_params(path):
    """(params streamed per diffusion step, params read once per call) of the head's
    Linear weights: the res blocks' adaLN / mlp.0 / mlp.2, the final layer's adaLN and
    linear, input_proj per step; cond_embed once per head_sample call (hoisted)."""
    shapes = {name: shape for name, _, shape in mc._C.safetensors_info(path)[0]}
    per_step = once = 0
    for key, shape in shapes.items():
        if not key.startswith("diffloss.net.") or not key.endswith(".weight") or len(shape) != 2:
            continue
        n = int(shape[0]) * int(shape[1])
        if ".time_embed." in key:
            continue  # hoisted at load
        if ".cond_embed." in key:
            once += n
        else:
            per_step += n
    return per_step, once


def stream_bandwidth(nbytes, repeats, threads):
    """Best GB/s of summing an fp32 array of `nbytes`, split over `threads` Python threads
    (NumPy's reductions release the GIL): a plain read of memory, no BLAS."""
    a = np.random.default_rng(1).standard_normal(nbytes // 4, dtype=np.float32)
    parts = np.array_split(a, threads)
    best = float("inf")
    for _ in range(repeats):
        workers = [threading.Thread(target=np.sum, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


def load_variant(path, dtype, smallrow, isa, threads):
    """A model whose backend reads MARCACHE_SMALLROW_MAX / MARCACHE_SMALLROW_PANELS /
    MARCACHE_CPU_ISA as set here (smallrow: True, False, or "lanes": panels off)."""
    saved = {k: os.environ.get(k) for k in ("MARCACHE_SMALLROW_MAX", "MARCACHE_CPU_ISA", "MARCACHE_SMALLROW_PANELS")}
    try:
        if not smallrow:
            os.environ["MARCACHE_SMALLROW_MAX"] = "0"
        if smallrow == "lanes":
            os.environ["MARCACHE_SMALLROW_PANELS"] = "0"
        if isa is not None:
            os.environ["MARCACHE_CPU_ISA"] = isa
        return mc.load(path, dtype=dtype, threads=threads)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 8, 16, 32, 64],
                        help="head rows per diffusion step (even: n tokens x 2 for CFG)")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--isa", nargs="*", default=[], choices=["avx512", "avx2", "plain"],
                        help="also run the small-row path with these instruction sets")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="marcache's and NumPy's threads (write --threads=N to set NumPy's too)")
    parser.add_argument("--weights", default=os.path.join(HERE, ".cache", "mar_base_random.safetensors"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if any(r < 2 or r % 2 for r in args.rows):
        parser.error("--rows must be even numbers >= 2 (CFG rows come in pairs)")

    if not os.path.exists(args.weights):
        from bench_cpu import write_random_mar_base
        os.makedirs(os.path.dirname(args.weights), exist_ok=True)
        print(f"writing random MAR-B weights to {args.weights} ...", flush=True)
        write_random_mar_base(args.weights)

    info = mc.build_info()
    per_step, once = head_weight_params(args.weights)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} "
          f"{os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}; BLAS core {info['blas_core']}; "
          f"small-row ISA {info['cpu_isa']} (supported: {', '.join(info['cpu_isa_supported'])}), "
          f"threshold {info['smallrow_max']} rows; threads {args.threads}; "
          f"NumPy's OpenBLAS threads {os.environ['OPENBLAS_NUM_THREADS']}")
    print(f"head weights: {per_step / 1e6:.2f} M params per diffusion step (+{once / 1e6:.2f} M once per call)",
          flush=True)

    variants = []  # (label, dtype, smallrow, isa)
    for dtype in args.dtypes:
        variants.append((f"{dtype} small-row", dtype, True, None))
        for isa in args.isa:
            variants.append((f"{dtype} small-row {isa}", dtype, True, isa))
        if dtype == "fp32":
            variants.append(("fp32 lanes (MARCACHE_SMALLROW_PANELS=0)", dtype, "lanes", None))
        variants.append((f"{dtype} OpenBLAS (MARCACHE_SMALLROW_MAX=0)", dtype, False, None))
    models = {v[0]: load_variant(args.weights, v[1], v[2], v[3], args.threads) for v in variants}

    fp32_bytes = 4 * per_step
    sgemv = max(sgemv_bandwidth(fp32_bytes, args.repeats) for _ in range(2))
    stream = stream_bandwidth(fp32_bytes, args.repeats, args.threads)
    sgemm, _ = sgemm_rate(SGEMM_SHAPES, args.repeats)
    print(f"sgemv over the head's fp32 bytes ({fp32_bytes / 1e6:.0f} MB): {sgemv:.1f} GB/s; "
          f"streaming read: {stream:.1f} GB/s; sgemm {sgemm:.1f} GFLOP/s", flush=True)

    rng = np.random.default_rng(0)
    steps = 100
    best = {}
    for rows in args.rows:
        n = rows // 2
        z = rng.standard_normal((rows, 768), dtype=np.float32)
        images = np.zeros(n, np.uint32)
        positions = np.arange(n, dtype=np.uint32)
        for rep in range(args.repeats):
            order = variants[rep % len(variants):] + variants[:rep % len(variants)]
            for label, *_ in order:
                t0 = time.perf_counter()
                models[label].head_sample(z, images, positions, cfg=2.9, seed=rep)
                dt = time.perf_counter() - t0
                best[(label, rows)] = min(best.get((label, rows), float("inf")), dt)
        print(f"rows {rows} done, load average {os.getloadavg()[0]:.2f}", flush=True)
    sgemv = max(sgemv, sgemv_bandwidth(fp32_bytes, args.repeats))
    sgemm = max(sgemm, sgemm_rate(SGEMM_SHAPES, args.repeats)[0])

    table, results = [], []
    for rows in args.rows:
        for label, dtype, smallrow, isa in variants:
            seconds = best[(label, rows)]
            esize = 4 if dtype == "fp32" else 2
            nbytes = esize * (per_step * steps + once)
            gbs = nbytes / seconds / 1e9
            # 2 FLOPs per weight and row (input_proj runs on half the rows under CFG: 0.05% of the weights).
            flop = 2.0 * rows * (per_step * steps + once)
            roofline = max(flop / (sgemm * 1e9), nbytes / (sgemv * 1e9))
            ref = best.get(("fp32 small-row", rows))
            speed = f"{ref / seconds:.2f}x" if ref is not None and dtype != "fp32" and smallrow is True and isa is None else ""
            table.append([rows, label, f"{seconds:.3f}", f"{gbs:.1f}", f"{100 * gbs / sgemv:.0f}%", speed,
                          f"{flop / seconds / 1e9:.0f}", f"{100 * roofline / seconds:.0f}%"])
            results.append(dict(rows=rows, variant=label, dtype=dtype, smallrow=smallrow, isa=isa or info["cpu_isa"],
                                seconds=seconds, gb_per_s=gbs, pct_sgemv=100 * gbs / sgemv,
                                gflop_per_s=flop / seconds / 1e9, pct_roofline=100 * roofline / seconds))
    print()
    print(f"head_sample, MAR-B head (random weights), {steps} steps, cfg 2.9; sgemv {sgemv:.1f} GB/s, "
          f"sgemm {sgemm:.1f} GFLOP/s (best of before and after), streaming read {stream:.1f} GB/s; "
          f"load average now {os.getloadavg()[0]:.2f}")
    print_table(["rows", "variant", "s / call", "weight GB/s", "% of sgemv", "x fp32 speed", "GFLOP/s",
                 "% of roofline"], table)
    write_json(args.json, sgemv_gb_per_s=sgemv, sgemm_gflop_per_s=sgemm, stream_gb_per_s=stream,
               head_params_per_step=per_step,
               head_params_once=once, rows=results, build=dict(cpu_isa=info["cpu_isa"],
                                                               smallrow_max=info["smallrow_max"],
                                                               panel_max=info["panel_max"],
                                                               blas_core=info["blas_core"]))


if __name__ == "__main__":
    main()

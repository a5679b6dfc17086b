"""Where a VAR image's GPU time goes, kernel by kernel (issue 15's GPU speed).

Runs marcache's VAR (random weights in the official layout, from bench_var.py's cache or
written there) under torch.profiler, whose CUPTI tracing records every CUDA kernel the
process launches, marcache's own and cuBLAS's included, and prints the kernels' total
GPU time by name, the scale loop (generate_tokens) and the VQVAE decode apart. One warm-up
call of each, then one profiled call. Needs torch with CUDA (the GPU machine's image has it);
marcache itself never imports torch.

    python benchmarks/profile_var_gpu.py --model d16 --batch 16 [--dtype bf16] [--top 25]
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from bench_gpu import make_labels  # noqa: E402
from bench_var import model_paths  # noqa: E402

CFG, TOP_K, TOP_P = 1.5, 900, 0.96


def kernel_table(prof):
    """[(kernel name, total GPU ms, calls)] of a finished profile, longest first."""
    rows = {}
    for event in prof.events():
        if event.device_type.name != "CUDA":
            continue
        ms, calls = rows.get(event.name, (0.0, 0))
        rows[event.name] = (ms + event.time_range.elapsed_us() / 1e3, calls + 1)
    return sorted(((name, ms, calls) for name, (ms, calls) in rows.items()), key=lambda r: -r[1])


def profiled(fn, what):
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm-up: allocations, cuBLAS heuristics, graph capture
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    table = kernel_table(prof)
    gpu = sum(ms for _, ms, _ in table)
    print(f"\n{what}: wall {1e3 * wall:.1f} ms (profiled), kernels {gpu:.1f} ms in "
          f"{sum(c for _, _, c in table)} launches")
    return wall, gpu, table


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="d16")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--workdir", default=os.path.join(HERE, ".cache"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import marcache as mc

    var_path, vq_path = model_paths(args.model, args.workdir)
    model = mc.load(var_path, vae=vq_path, device="cuda", dtype=args.dtype)
    labels = make_labels(args.batch)
    kw = dict(seed=0, cfg=CFG, top_k=TOP_K, top_p=TOP_P)
    _, f_hat = model.generate_tokens(labels=labels, **kw)
    out = dict(model=args.model, batch=args.batch, dtype=args.dtype, build_info=mc.build_info(), parts={})
    for what, fn in (("scale loop (generate_tokens)", lambda: model.generate_tokens(labels=labels, **kw)),
                     ("VQVAE decode", lambda: model.decode(f_hat))):
        wall, gpu, table = profiled(fn, what)
        print("| kernel | ms | share | calls |\n|---|---|---|---|")
        for name, ms, calls in table[:args.top]:
            print(f"| {name[:90]} | {ms:.2f} | {100 * ms / gpu:.1f}% | {calls} |")
        out["parts"][what] = dict(wall_ms=1e3 * wall, kernel_ms=gpu,
                                  kernels=[dict(name=n, ms=ms, calls=c) for n, ms, c in table])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()

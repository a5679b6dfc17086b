"""Benchmark of `python -m marcache convert mar` on a full-size MAR-B checkpoint.

Not a CI test: it writes a ~1.6 GB checkpoint shaped like the released MAR-B
checkpoint-last.pth ({"model": sd, "model_ema": sd2}, fp32, 364 tensors each,
random values) with the real torch.save, converts it without PyTorch under
/usr/bin/time -v, and reports wall time and peak resident memory against the
checkpoint size (the issue asks for a peak under 1.5x the checkpoint size).
It then checks the output against the source: every tensor, bit for bit.

    # 1. make the checkpoint (needs PyTorch; a separate venv is fine)
    /tmp/torchenv/bin/python benchmarks/bench_convert.py make /tmp/mar_base_ckpt.pth
    # 2. convert and measure (marcache's environment; no PyTorch)
    python benchmarks/bench_convert.py run /tmp/mar_base_ckpt.pth [--dtype fp32] [--keep]
"""
import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)                                 # in-place build of marcache


def make(path):
    import torch
    from reference import mar as R

    gen = torch.Generator().manual_seed(0)

    def random_sd(scale):
        sd = {}
        for key, shape in R.official_shapes("mar_base").items():
            base = 1.0 if key.endswith(".weight") and len(shape) == 1 else 0.0
            sd[key] = base + scale * torch.randn(*shape, generator=gen)
        return sd

    t0 = time.perf_counter()
    ckpt = {"model": random_sd(0.02), "model_ema": random_sd(0.02), "epoch": 799,
            "args": argparse.Namespace(model="mar_base", diffloss_d=6, diffloss_w=1024)}
    torch.save(ckpt, path)
    print(f"wrote {path}: {os.path.getsize(path) / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f} s "
          f"(torch {torch.__version__})")


def parse_time_v(text):
    peak_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text).group(1)
    seconds = 0.0
    for part in wall.split(":"):
        seconds = seconds * 60 + float(part)
    user = float(re.search(r"User time \(seconds\): ([\d.]+)", text).group(1))
    system = float(re.search(r"System time \(seconds\): ([\d.]+)", text).group(1))
    return peak_kb * 1024, seconds, user, system


def verify(src, dst, dtype):
    """Every tensor of the output equals the source's model_ema (fp32) bit for bit."""
    import numpy as np
    from safetensors import safe_open

    import marcache.convert as conv

    n = 0
    with conv.read_checkpoint(src) as ck, safe_open(dst, framework="numpy") as f:
        ema = ck["model_ema"]
        assert set(f.keys()) == set(ema), "key sets differ"
        for name in f.keys():
            got = f.get_tensor(name)
            want = ema[name].numpy()
            if dtype == "fp16":
                want = want.astype(np.float16)
            if not np.array_equal(got.view(np.uint8), np.ascontiguousarray(want).view(np.uint8)):
                raise AssertionError(f"{name} differs")
            n += 1
    return n


def run(src, dtype, keep):
    dst = os.path.splitext(src)[0] + f".{dtype}.safetensors"
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "marcache", "convert", "mar", src, "-o", dst,
           "--dtype", dtype, "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"conversion failed:\n{proc.stdout}\n{proc.stderr}")
    peak, wall, user, system = parse_time_v(proc.stderr)
    size = os.path.getsize(src)
    ratio = peak / size
    result = {"source_bytes": size, "output_bytes": os.path.getsize(dst), "dtype": dtype, "wall_s": round(wall, 2),
              "user_s": user, "sys_s": system, "peak_rss_bytes": peak, "peak_over_source": round(ratio, 3),
              "limit_over_source": 1.5, "cpu": platform.processor() or platform.machine(),
              "cores": os.cpu_count(), "python": platform.python_version()}
    print(proc.stdout.strip())
    print(f"source {size / 2**20:,.1f} MiB -> output {result['output_bytes'] / 2**20:,.1f} MiB ({dtype}): "
          f"{wall:.1f} s wall ({user:.1f} s user, {system:.1f} s sys), peak RSS {peak / 2**20:,.1f} MiB = "
          f"{ratio:.3f} x the checkpoint (limit 1.5)")
    if dtype == "bf16":
        print("bf16 output: not verified here (NumPy has no bfloat16; tests/test_convert.py checks bf16 bits)")
    else:
        t0 = time.perf_counter()
        result["verified_tensors"] = verify(src, dst, dtype)
        print(f"verified {result['verified_tensors']} tensors bit for bit in {time.perf_counter() - t0:.1f} s")
    print(json.dumps(result))
    if not keep:
        os.remove(dst)
    if ratio >= 1.5:
        sys.exit("peak memory is not under 1.5x the checkpoint size")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write the MAR-B-shaped checkpoint with torch.save (needs PyTorch)")
    m.add_argument("path")
    r = sub.add_parser("run", help="convert it under /usr/bin/time -v and verify the output")
    r.add_argument("path")
    r.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    r.add_argument("--keep", action="store_true", help="keep the converted file")
    args = parser.parse_args()
    if args.cmd == "make":
        make(args.path)
    else:
        run(args.path, args.dtype, args.keep)


if __name__ == "__main__":
    main()

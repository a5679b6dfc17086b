"""Where the CPU `linear` should leave its small-row kernels for OpenBLAS (issue 23).

`linear` with few rows runs one of marcache's small-row kernels: a bound fp32 weight's
column panels (csrc/backend/cpu/cpu_panels.c) up to `build_info()["panel_max"]` rows, the
lane kernel (cpu_smallrow.c: 16-bit weights, or fp32 with MARCACHE_SMALLROW_PANELS=0) up
to `build_info()["smallrow_max"]`; larger calls run OpenBLAS through mc_cpu_sgemm. This
script measures the three paths on the shapes MAR-B runs (the head's 1024 x 1024 and
1024 x 3072 layers, the transformer's 768 x 2304, 768 x 3072 and 3072 x 768) at row
counts around the thresholds, and prints GFLOP/s side by side with the ratios.

It compiles benchmarks/linear_threshold.c against the checkout's C sources and the
scipy-openblas32 wheel the module links (the module's own flags: -O3 -march=native
-fopenmp), so every path is the engine's own code through its backend factory (the weights bound as a
model's are); they alternate pass by pass in one process, weights beyond the L3 (128 MiB per shape),
the best of 5 passes each. Needs gcc and the built module (its threshold and sgemm rate).

    python benchmarks/bench_linear.py                       # all shapes, 2 threads
    python benchmarks/bench_linear.py --rows 32 64 128 --shapes 1024x1024

With --split it measures, instead, how mc_cpu_sgemm divides an OpenBLAS GEMM between the
threads: every call on OpenBLAS, split by rows (MARCACHE_GEMM_SPLIT=rows) against split by
columns (cols), and the split the default (auto) picks for that shape:

    python benchmarks/bench_linear.py --split --rows 100 200 330 514 642 --shapes 768x2304 3072x768

With --weight-mib N the weights make N MiB instead of 128 (each pass still reads 128 MiB,
going over them again): at a few MiB they stay in the L3, as the ~17 MB that the head
cache's reused evaluations read at each diffusion step do at batch 1:

    python benchmarks/bench_linear.py --weight-mib 4 --rows 1 2 3 4 6 8 --shapes 1024x1024
"""
import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import build_harness, print_machine, print_table, sgemm_rate, write_json  # noqa: E402

SHAPES = ("1024x1024", "1024x3072", "768x2304", "768x3072", "3072x768")
SGEMM_SHAPES = ((512, 1024, 1024),)


def build(out_path):
    build_harness("linear_threshold.c", out_path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 96, 128, 256, 512, 768, 1024])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="INxOUT of the weight")
    ap.add_argument("--split", action="store_true",
                    help="compare the row and column splits of OpenBLAS GEMMs instead of the two paths")
    ap.add_argument("--weight-mib", type=int, default=128,
                    help="the MiB of weights each pass runs through (default 128: beyond the L3)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    shapes = []
    for s in args.shapes:
        try:
            inp, out = (int(v) for v in s.lower().split("x"))
        except ValueError:
            ap.error(f"--shapes {s!r}: expected INxOUT, e.g. 1024x3072")
        shapes.append((inp, out))
    if min(args.rows) < 1 or args.threads < 1 or args.weight_mib < 1:
        ap.error("--rows, --threads and --weight-mib must be positive")

    exe = os.path.join(HERE, ".cache", "linear_threshold")
    os.makedirs(os.path.dirname(exe), exist_ok=True)
    build(exe)
    peak, by_shape = sgemm_rate(SGEMM_SHAPES, 3)
    print_machine(by_shape)
    import marcache as mc

    info = mc.build_info()
    print(f"small-row ISA {info['cpu_isa']}; default thresholds: panels rows <= {info['panel_max']}, "
          f"lanes rows <= {info['smallrow_max']} "
          f"(MARCACHE_SMALLROW_MAX={os.environ.get('MARCACHE_SMALLROW_MAX', 'unset')}); threads {args.threads}; "
          f"weights {args.weight_mib} MiB per shape; load average {os.getloadavg()[0]:.2f}", flush=True)
    if args.split:
        return split_table(args, exe, shapes, peak)
    rows_out, results = [], []
    for inp, out, (rows, panels, lanes, blas) in harness_lines(exe, [], args, shapes):
        rows, panels, lanes, blas = int(rows), float(panels), float(lanes), float(blas)
        picked = "panels" if rows <= info["panel_max"] else "OpenBLAS"
        rows_out.append([f"{inp} x {out}", rows, f"{panels:.1f}", f"{lanes:.1f}", f"{blas:.1f}",
                         f"{panels / lanes:.2f}x", f"{panels / blas:.2f}x", picked])
        results.append({"in": inp, "out": out, "rows": rows, "panels_gflops": panels, "lanes_gflops": lanes,
                        "openblas_gflops": blas})
    print(f"\nlinear, fp32, bias, {args.threads} threads; sgemm {peak:.1f} GFLOP/s (NumPy's OpenBLAS, same run)")
    print_table(["in x out", "rows", "panels GFLOP/s", "lanes GFLOP/s", "OpenBLAS GFLOP/s", "panels / lanes",
                 "panels / OpenBLAS", "default path (fp32)"], rows_out)
    if args.json:
        write_json(args.json, threads=args.threads, sgemm_gflops=peak, smallrow_max=info["smallrow_max"],
                   panel_max=info["panel_max"], weight_mib=args.weight_mib, results=results)


def harness_lines(exe, mode, args, shapes):
    """(in, out, fields of one output line) for every row count of every shape, from one
    run of the harness per shape (`mode`: its options before THREADS)."""
    for inp, out in shapes:
        text = subprocess.run([exe, "--weight-mib", str(args.weight_mib), *mode, str(args.threads), str(inp),
                               str(out), *map(str, args.rows)],
                              check=True, capture_output=True, text=True).stdout
        for line in text.split("\n"):
            if line.strip():
                yield inp, out, line.split()
        print(f"{inp} x {out} done, load average {os.getloadavg()[0]:.2f}", flush=True)


def split_table(args, exe, shapes, peak):
    """Row split against column split of the same OpenBLAS GEMMs, and AUTO's choice."""
    rows_out, results = [], []
    # auto: the split mc_cpu_sgemm_splits_rows picks for the shape
    for inp, out, (rows, by_rows, by_cols, auto) in harness_lines(exe, ["--split"], args, shapes):
        rows, by_rows, by_cols = int(rows), float(by_rows), float(by_cols)
        rows_out.append([f"{inp} x {out}", rows, f"{by_rows:.1f}", f"{by_cols:.1f}", f"{by_cols / by_rows:.2f}x",
                         auto])
        results.append({"in": inp, "out": out, "rows": rows, "row_split_gflops": by_rows,
                        "col_split_gflops": by_cols, "auto": auto})
    print(f"\nOpenBLAS linear, fp32, bias, {args.threads} threads; sgemm {peak:.1f} GFLOP/s (NumPy's OpenBLAS, "
          "same run)")
    print_table(["in x out", "rows", "row split GFLOP/s", "column split GFLOP/s", "columns / rows", "auto picks"],
                rows_out)
    if args.json:
        write_json(args.json, threads=args.threads, sgemm_gflops=peak, split=True, weight_mib=args.weight_mib,
                   results=results)


if __name__ == "__main__":
    main()

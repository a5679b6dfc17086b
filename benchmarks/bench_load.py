"""Peak resident memory of loading a model, next to the size of the loaded weights (issue 18).

Each load runs in a fresh child process (tests/load_probe.py): `import marcache`, then
`marcache.load` of a MAR-B or MAR-L file (random float32 weights in the official layout) with dtype fp32 or
bf16, or the KL-16 VAE (`marcache._C.VAE`). The child reports its peak RSS over its
whole life (VmHWM of /proc/self/status: interpreter, NumPy and OpenBLAS included; not
getrusage's ru_maxrss, which Linux carries over from the parent's memory at fork and
exec), its RSS before the load and after it (settled), and the bytes the loaded weights hold
(`weight_bytes`). Target: peak <= 1.15 x weights + 100 MiB.

    python benchmarks/bench_load.py                        # this checkout's build
    python benchmarks/bench_load.py --compare /work/main   # and another checkout's, alternated

Random weights are written to benchmarks/.cache/ when absent (MAR-B 832 MB, MAR-L
1.9 GB, VAE 153 MB; MAR-B is the same file bench_cpu.py writes).
"""
import argparse
import json
import os
import platform
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

FILES = {"mar_base": "mar_base_random.safetensors", "mar_large": "mar_large_random.safetensors",
         "vae": "vae_kl16_random.safetensors"}

def write_weights(name, path):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    if name == "vae":
        from reference import vae as R

        tensors = {k: np.ascontiguousarray(v, np.float32) for k, v in R.random_vae_weights(rng).items()}
    else:
        from reference import mar as R

        tensors = {}
        for key, shape in R.official_shapes(name).items():  # the formula of bench_cpu.py
            base = 1.0 if key.endswith(".weight") and len(shape) == 1 else 0.0
            tensors[key] = (base + 0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(tensors, path + ".partial")
    os.replace(path + ".partial", path)


def measure(root, kind, path, dtype):
    env = dict(os.environ, PYTHONPATH=root)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "load_probe.py"), kind, path, dtype],
                          capture_output=True, text=True, env=env, cwd="/")
    if done.returncode != 0:
        raise SystemExit(f"load of {path} ({dtype}) with {root} failed:\n{done.stderr}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["marcache"].startswith(os.path.realpath(root)):
        raise SystemExit(f"the child imported {result['marcache']}, not the build in {root}")
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", default=os.path.join(HERE, ".cache"))
    parser.add_argument("--cases", nargs="+", default=["mar_base:fp32", "mar_base:bf16", "mar_large:fp32",
                                                        "mar_large:bf16", "vae:fp32"])
    parser.add_argument("--compare", default=None,
                        help="another checkout with an in-place build (the old code), measured alternately")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    builds = [("new", ROOT)] + ([("old", os.path.abspath(args.compare))] if args.compare else [])
    cases = [tuple(c.split(":")) for c in args.cases]
    for name, _ in cases:
        path = os.path.join(args.cache_dir, FILES[name])
        if not os.path.exists(path):
            print(f"writing random {name} weights to {path} ...", flush=True)
            write_weights(name, path)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load average {' '.join(load)}")

    rows = []
    for rep in range(args.repeats):
        for name, dtype in cases:
            path = os.path.join(args.cache_dir, FILES[name])
            # alternate the builds, so both see the same machine state
            for label, root in (builds if rep % 2 == 0 else builds[::-1]):
                r = measure(root, name, path, dtype)
                r.update(build=label, model=name, dtype=dtype, file_bytes=os.path.getsize(path), repeat=rep)
                rows.append(r)
                print(json.dumps(r), flush=True)

    # weight_bytes comes from the new build (an older one may not report it); the loaded
    # weights of a model and dtype do not depend on the build.
    weights = {(r["model"], r["dtype"]): r["weight_bytes"] for r in rows if r["build"] == "new"}
    mib = 2.0 ** 20
    print()
    print("| model | dtype | file MiB | weights MiB | build | before MiB | peak MiB | settled MiB | "
          "target MiB | peak <= target | load s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    failed = False
    for r in rows:
        w = weights[(r["model"], r["dtype"])]
        target = 1.15 * w / mib + 100
        peak = r["peak_kib"] / 1024
        ok = peak <= target
        failed |= r["build"] == "new" and not ok
        print(f"| {r['model']} | {r['dtype']} | {r['file_bytes'] / mib:.0f} | {w / mib:.0f} | {r['build']} | "
              f"{r['before_kib'] / 1024:.0f} | {peak:.0f} | {r['settled_kib'] / 1024:.0f} | {target:.0f} | "
              f"{'yes' if ok else 'NO'} | {r['seconds']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("\ntarget check (new build): " + ("FAILED" if failed else "every load peaks at <= 1.15 x weights + 100 MiB"))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

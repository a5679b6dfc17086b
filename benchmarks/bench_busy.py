"""How marcache's OpenMP team copes with a busy machine (issue 23): the same generate call
idle and beside busy processes, under three OpenMP wait settings (issue 23's collapse: a
thread spinning at one of the engine's many short parallel regions burns the time slice
its partner needs).

    python benchmarks/bench_busy.py                         # MAR-B random weights, 4 AR steps, batch 1
    python benchmarks/bench_busy.py --model digits          # the shipped digits MAR, 2 x 16 digits

Settings: libgomp's own default (GOMP_SPINCOUNT=300000, what marcache ran with before it
bounded the spin), marcache's default (GOMP_SPINCOUNT=10000, set at import unless the user
set GOMP_SPINCOUNT or OMP_WAIT_POLICY) and OMP_WAIT_POLICY=PASSIVE (never spin). Every
timed run is a fresh process (libgomp reads the setting when it is loaded); busy: `--busy-procs`
plain Python processes spinning `while True: pass` at the same priority, started before the
run and stopped after it. The runs alternate setting by setting, `--rounds` times; the table
gives the median seconds and busy / idle.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

from _common import child_env, start_busy, stop_busy

HERE = os.path.dirname(os.path.abspath(__file__))
SETTINGS = {
    "libgomp default (GOMP_SPINCOUNT=300000)": {"GOMP_SPINCOUNT": "300000"},
    "marcache default (GOMP_SPINCOUNT=10000)": {},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
}
CHILD = r"""
import sys, time
import marcache as mc
model_name, weights, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
if model_name == "digits":
    m = mc.digits.load_model(threads=threads)
    labels, kw = [i % 10 for i in range(16)], dict(steps=16, cfg=2.0)
    m.generate_tokens(labels=labels[:8], seed=0, **kw)  # warm-up
    t0 = time.perf_counter()
    for _ in range(2):
        m.generate_tokens(labels=labels, seed=0, **kw)
else:
    m = mc.load(weights, threads=threads)
    m.generate_tokens(labels=[207], steps=1, cfg=2.9, seed=0)  # warm-up
    t0 = time.perf_counter()
    m.generate_tokens(labels=[207], steps=4, cfg=2.9, seed=0)
print(time.perf_counter() - t0)
"""


def run_child(args, extra_env):
    # marcache's OpenMP settings come from extra_env alone (the variant under test)
    env = child_env(**{"GOMP_SPINCOUNT": None, "OMP_WAIT_POLICY": None, **extra_env})
    out = subprocess.run([sys.executable, "-c", CHILD, args.model, args.weights, str(args.threads)], env=env,
                         capture_output=True, text=True, check=True, cwd=HERE)
    return float(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["mar_base", "digits"], default="mar_base")
    p.add_argument("--weights", default=os.path.join(HERE, ".cache", "mar_base_random.safetensors"),
                   help="MAR-B weights (bench_cpu.py writes them)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--busy-procs", type=int, default=os.cpu_count())
    args = p.parse_args()
    if args.model == "mar_base" and not os.path.exists(args.weights):
        p.error(f"{args.weights} does not exist: run benchmarks/bench_cpu.py once to write it")
    print(f"machine: {os.uname().machine}, {os.cpu_count()} cores; model {args.model}, threads={args.threads}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    seconds = {(name, load): [] for name in SETTINGS for load in ("idle", "busy")}
    for r in range(args.rounds):
        for load in ("idle", "busy"):
            spinners = start_busy(args.busy_procs) if load == "busy" else []
            if spinners:
                time.sleep(0.5)
            try:
                for name, extra in SETTINGS.items():
                    s = run_child(args, extra)
                    seconds[(name, load)].append(s)
                    print(f"round {r} {load}: {name}: {s:.2f} s", flush=True)
            finally:
                stop_busy(spinners)
    print()
    print("| setting | idle s (median) | busy s (median) | busy / idle |")
    print("|---|---|---|---|")
    for name in SETTINGS:
        idle = statistics.median(seconds[(name, "idle")])
        busy = statistics.median(seconds[(name, "busy")])
        print(f"| {name} | {idle:.2f} | {busy:.2f} | {busy / idle:.2f}x |")


if __name__ == "__main__":
    main()

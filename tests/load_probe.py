"""Loads one model in this (fresh) process and prints one JSON line about its resident memory:
used by tests/test_load_memory.py and benchmarks/bench_load.py, each in a child process.

    python load_probe.py {mar|vae} PATH DTYPE [--reset-peak]

before_kib: VmRSS after `import marcache`, just before the load; peak_kib: VmHWM after the
load (the peak of this process; with --reset-peak, of the time since the reset, which
/proc/self/clear_refs makes right before the load); settled_kib: VmRSS after the load;
weight_bytes: what the loaded weights hold (None for a build without the attribute).
VmHWM rather than getrusage's ru_maxrss: Linux carries ru_maxrss over from the parent's
memory at fork and exec, so a child of a big process would report its parent's peak.
"""
import json
import sys
import time


def status_kib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def main():
    kind, path, dtype = sys.argv[1:4]
    reset_peak = "--reset-peak" in sys.argv[4:]
    import gc

    import marcache as mc

    gc.collect()
    if reset_peak:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident size
        except OSError as exc:
            print(json.dumps({"skip": f"cannot reset the peak RSS (/proc/self/clear_refs): {exc}"}))
            return
    before = status_kib("VmRSS")
    if reset_peak and status_kib("VmHWM") > before + 1024:
        print(json.dumps({"skip": "this kernel does not reset VmHWM through /proc/self/clear_refs"}))
        return
    start = time.perf_counter()
    if kind == "vae":
        model = mc._C.VAE(path)
        weight_bytes = getattr(model, "weight_bytes", None)
    else:
        model = mc.load(path, dtype=dtype)
        weight_bytes = getattr(model._mar, "weight_bytes", None)
    seconds = time.perf_counter() - start
    print(json.dumps({"before_kib": before, "peak_kib": status_kib("VmHWM"), "settled_kib": status_kib("VmRSS"),
                      "weight_bytes": weight_bytes, "seconds": seconds, "marcache": mc.__file__}))


if __name__ == "__main__":
    main()

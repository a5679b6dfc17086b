"""Runs a fuzz corpus in this (child) process and prints one JSON line per case.

    python -m fuzz.runner safetensors --seed 18 --count 1050 --dir /tmp/x
    python -m fuzz.runner torch --seed 18 --count 264 --dir /tmp/x --only 17

Before each case it prints {"start": index, ...} and flushes, so that when the process dies
(a segfault, an abort, a hang the parent kills) the parent knows which case did it. After
each case it prints the case's record: for every call, whether it returned or raised (type,
its base classes, message, seconds); whether the canary file or environment variable
appeared (a payload ran); whether an allowlisted object of the unpickler changed; which
output files were left behind.

Address space is capped (--memory-gib) so that a file that makes the reader allocate
without bound fails here with MemoryError instead of swapping a shared machine.
"""
import argparse
import json
import os
import resource
import sys
import time


def _outcome(name, fn):
    t0 = time.perf_counter()
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - every exception is recorded for the parent to judge
        if isinstance(exc, (SystemExit, KeyboardInterrupt)):
            kind = "exit"
        else:
            kind = "raised"
        return {"call": name, "ok": False, "kind": kind, "type": type(exc).__name__,
                "mro": [c.__name__ for c in type(exc).__mro__], "msg": str(exc)[:2000],
                "seconds": time.perf_counter() - t0}
    return {"call": name, "ok": True, "seconds": time.perf_counter() - t0}


def _allowlist_fingerprint():
    """A text that changes if any object the unpickler hands out (or the classes and
    functions behind them) gains, loses or changes an attribute."""
    import argparse as argparse_module

    from marcache.convert import unpickler

    parts = []
    for key, obj in sorted(unpickler.ALLOWED_GLOBALS.items(), key=lambda kv: kv[0]):
        target = getattr(obj, "__wrapped__", obj)
        state = {}
        for attr in ("__defaults__", "__kwdefaults__", "__qualname__", "__name__", "__code__"):
            if hasattr(target, attr):
                state[attr] = repr(getattr(target, attr))
        if hasattr(target, "__dict__"):
            state["__dict__"] = sorted(repr(kv) for kv in vars(target).items())
        for slot in getattr(type(target), "__slots__", ()):
            state[slot] = repr(getattr(target, slot, None))
        parts.append(f"{key}: {state}")
    parts.append(repr(sorted(vars(argparse_module.Namespace))))
    return "\n".join(parts)


def run_safetensors(args):
    import marcache as mc
    from marcache import _C

    from fuzz import safetensors_corpus as corpus

    bases, base_paths = corpus.write_bases(args.dir)
    model_of_decoder = {"vae": base_paths["mar"], "vqvae": base_paths["var"]}
    for index in _indices(args):
        name, role, data, expect = corpus.case(bases, args.seed, index)
        print(json.dumps({"start": index, "mutation": name, "role": role}), flush=True)
        path = os.path.join(args.dir, f"case{index:05d}.safetensors")
        with open(path, "wb") as f:
            f.write(data)
        swapped = expect == "load:swapped"
        if role in ("mar", "var"):
            load = (lambda: mc.load(model_of_decoder["vae" if role == "mar" else "vqvae"], vae=path)) if swapped \
                else (lambda: mc.load(path))
        else:
            load = (lambda: mc.load(path)) if swapped else (lambda: mc.load(model_of_decoder[role], vae=path))
        calls = [_outcome("info", lambda: _C.safetensors_info(path)),
                 _outcome("read", lambda: _C.safetensors_read(path)),
                 _outcome("load", load)]
        os.remove(path)
        print(json.dumps({"index": index, "mutation": name, "role": role, "expect": expect, "path": path,
                          "bytes": len(data), "calls": calls}), flush=True)


def run_torch(args):
    import marcache as mc
    from marcache import convert as conv

    from fuzz import torch_corpus as corpus

    fixtures = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
    bases = corpus.Bases(fixtures)
    canary = os.path.join(args.dir, "canary_pwned")
    before = _allowlist_fingerprint()
    for index in _indices(args):
        name, detail, data, expect = corpus.case(bases, canary, args.seed, index)
        print(json.dumps({"start": index, "mutation": name, "detail": detail}), flush=True)
        src = os.path.join(args.dir, f"case{index:05d}.pth")
        dst = os.path.join(args.dir, f"out{index:05d}.safetensors")
        with open(src, "wb") as f:
            f.write(data)
        calls = [_outcome("convert", lambda: conv.convert("mar", src, dst, heads=2)),
                 _outcome("load", lambda: mc.load(src))]
        converted = calls[0]["ok"]
        left = sorted(f for f in os.listdir(args.dir) if f.startswith(f"out{index:05d}"))
        if converted:
            left = [f for f in left if f != os.path.basename(dst)]
            os.remove(dst)
        executed = os.path.exists(canary) or os.environ.get(corpus.CANARY_ENV) is not None
        after = _allowlist_fingerprint()
        tampered = after != before
        os.remove(src)
        print(json.dumps({"index": index, "mutation": name, "detail": detail, "expect": list(expect), "path": src,
                          "bytes": len(data), "calls": calls, "left_behind": left, "executed": executed,
                          "tampered": tampered}), flush=True)
        if tampered:
            before = after          # report each tampering once


def _indices(args):
    return [args.only] if args.only is not None else range(args.start, args.start + args.count)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", choices=["safetensors", "torch"])
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--count", type=int, default=0)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--only", type=int)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--memory-gib", type=float, default=6.0)
    args = parser.parse_args(argv)
    limit = int(args.memory_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 1000))
    (run_safetensors if args.corpus == "safetensors" else run_torch)(args)
    print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    main()

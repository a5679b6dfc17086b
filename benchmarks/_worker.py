"""The official side of a GPU benchmark, in a subprocess: its own interpreter (the one with
PyTorch; marcache has none at run time) and its own CUDA context. The parent runs
`python SCRIPT --worker KIND SPEC_JSON` and reads the one marked result line the child
prints last (JSON); whatever else the child prints is the user's to read.

Used by bench_gpu.py (official MAR) and bench_var_gpu.py (official VAR)."""
import json
import os
import subprocess
import sys

MARKER = "@@marcache-worker-result@@ "


def run_worker(script, python, kind, spec):
    """The result dict of `python script --worker kind spec`, or {"error": ...}."""
    cmd = [python, os.path.abspath(script), "--worker", kind, json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    except OSError as e:
        return dict(error=f"cannot start {python}: {e}")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    tail = proc.stdout.strip().splitlines()[-3:]
    return dict(error=f"{python} exited with code {proc.returncode} without a result "
                      f"(its stderr is above){'; stdout: ' + ' | '.join(tail) if tail else ''}")


def worker_main(workers, kind, spec_json):
    """In the child: workers[kind](spec) printed as the marked result line; an exception is
    reported as {"error": ...} (its traceback on stderr)."""
    try:
        work = workers.get(kind)
        res = work(json.loads(spec_json)) if work else dict(error=f"unknown worker {kind!r}")
    except Exception as e:  # noqa: BLE001 - reported to the parent as one line
        import traceback

        traceback.print_exc()
        res = dict(error=f"{type(e).__name__}: {e}")
    sys.stdout.write(MARKER + json.dumps(res) + "\n")
    sys.stdout.flush()


def import_official(code_dir, marker_file):
    """(torch, None) with code_dir first on sys.path, or (None, {"error": ...}) when the
    official code (code_dir/marker_file) or torch is missing."""
    if not os.path.isfile(os.path.join(code_dir, marker_file)):
        return None, dict(error=f"no official code at {code_dir} ({marker_file} missing)")
    try:
        import torch
    except ImportError as e:
        return None, dict(error=f"torch is not importable in {sys.executable}: {e}")
    sys.path.insert(0, code_dir)
    return torch, None

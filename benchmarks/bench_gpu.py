"""GPU benchmark of MAR generation, side by side with the official PyTorch code (issue #8).

MAR-B, MAR-L and MAR-H configurations with random weights in the official
layout, 64 AR steps, CFG (linear schedule; each model's README eval value:
2.9 / 3.0 / 3.2), batch 1, 16, 64 and 256, marcache in bf16 on the GPU.
Per cell: milliseconds per image, achieved TFLOP/s (exact FLOPs from
marcache.flops, the engine's own count) and its fraction of the bf16 GEMM rate
measured in the same run (torch.matmul 8192^3, CUDA events; the fp16 and fp32
rates, TF32 off, are recorded too), next to the official LTH14/mar code on the
same GPU with the same weights (its own defaults: fp16 autocast under
torch.no_grad, as engine_mar.py's evaluate runs it) and, for MAR-H at batch 64,
LazyMAR against our own NoCache. Targets (printed PASS/MISS, never asserted):
ours >= 2x official at batch 16 and >= 1.3x at batch 256; LazyMAR >= 2.5x our
NoCache for MAR-H at batch 64.

Timing: each cell is one warm-up call (same batch, same cache policy,
--warmup-steps AR steps) and then --repeats timed calls of --steps AR steps;
the best is reported. Ours is timed with time.perf_counter() around
generate_tokens (the engine synchronises before handing the tokens back); the
official code between torch.cuda.synchronize() calls.

The official code is not part of marcache and is never committed: export it
to .official/mar (ignored through .git/info/exclude), e.g.

    mkdir -p .official/mar && echo /.official/ >> .git/info/exclude
    git --git-dir=<mirror of github.com/LTH14/mar> archive HEAD models diffusion util \\
        main_mar.py engine_mar.py README.md LICENSE | tar -x -C .official/mar
    git --git-dir=<mirror> rev-parse HEAD > .official/mar/COMMIT      # recorded in the results

(being ignored, .official/ must be copied along explicitly to a GPU machine).

It runs in a subprocess (--official-python, default this interpreter) that
needs torch and timm (scipy and tqdm are stubbed when missing: the official
model uses them only for training masks and progress bars). Without the
directory or torch the official column is skipped with a message.

    python benchmarks/bench_gpu.py                           # the full table (estimated 8-10 min, H100)
    python benchmarks/bench_gpu.py --quick                   # batches 1 16 64 (estimated ~3 min)
    python benchmarks/bench_gpu.py --batches 256 --out /tmp/b256.json   # the rest, separately
    python benchmarks/bench_gpu.py --configs huge --batches 64 --no-official   # the LazyMAR cell only
    # CPU dry run of the whole pipeline on a tiny model (fp32, official code on CPU):
    python benchmarks/bench_gpu.py --configs tiny --device cpu --dtype fp32 --steps 4 \\
        --batches 1 2 --policy-cells all --official-python /path/to/python-with-torch

Weights are written once per configuration (float32 safetensors, MAR-H is
3.8 GB) to --workdir and reused. Results go to --out (JSON, rewritten after
every cell, so a run cut short keeps what it measured); --time-budget S stops
starting new cells after S seconds.
"""
import argparse
import contextlib
import datetime
import gc
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

from _worker import import_official, run_worker, worker_main

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# key -> official factory (None: built from DIMS), label, README eval cfg (linear schedule)
CONFIGS = {
    "base": dict(name="mar_base", label="MAR-B", cfg=2.9),
    "large": dict(name="mar_large", label="MAR-L", cfg=3.0),
    "huge": dict(name="mar_huge", label="MAR-H", cfg=3.2),
    "tiny": dict(name=None, label="MAR-tiny", cfg=2.9),  # CPU dry runs only
}
# Widths / depths (spec mar.md 1.1; the head size is the README eval commands' diffloss_d / diffloss_w).
DIMS = {
    "base": dict(dim=768, depth=12, heads=12, head_width=1024, head_depth=6),
    "large": dict(dim=1024, depth=16, heads=16, head_width=1280, head_depth=8),
    "huge": dict(dim=1280, depth=20, heads=16, head_width=1536, head_depth=12),
    # Deep enough for LazyMAR's select_layer 3 and the head cache's blocks 1..4.
    "tiny": dict(dim=64, depth=4, heads=4, head_width=64, head_depth=6),
}
POLICY_TITLES = {"lazymar": "LazyMAR", "marche": "MARche"}
TARGETS = dict(batch16=2.0, batch256=1.3, lazymar_huge64=2.5)


def make_labels(batch):
    return [(207 + 31 * i) % 1000 for i in range(batch)]


def log(msg):
    print(msg, flush=True)


def err(msg):
    print(msg, file=sys.stderr, flush=True)


# ==========================================================================
# GEMM rate measured in the same run
# ==========================================================================

def gemm_rates(device, size):
    """Dense GEMM TFLOP/s: torch.matmul of size^3 (bf16, fp16, fp32 with TF32 off) on a CUDA
    device, CUDA events, 3 warm-up and 10 timed products; on the CPU a NumPy float32 product."""
    if device.startswith("cuda"):
        import torch

        dev = torch.device(device)
        rates, errors = {}, {}
        with torch.cuda.device(dev):
            for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
                prev = torch.get_float32_matmul_precision()
                try:
                    torch.set_float32_matmul_precision("highest")  # fp32 without TF32
                    a = torch.randn(size, size, device=dev, dtype=dtype)
                    b = torch.randn(size, size, device=dev, dtype=dtype)
                    for _ in range(3):
                        torch.matmul(a, b)
                    torch.cuda.synchronize(dev)
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(10):
                        torch.matmul(a, b)
                    end.record()
                    end.synchronize()
                    seconds = start.elapsed_time(end) / 1e3 / 10
                    rates[key] = 2.0 * size ** 3 / seconds / 1e12
                    del a, b
                except Exception as e:  # noqa: BLE001 - recorded; the other rates still count
                    errors[key] = f"{type(e).__name__}: {e}"
                finally:
                    torch.set_float32_matmul_precision(prev)
            torch.cuda.empty_cache()
        res = dict(backend=f"torch {torch.__version__} matmul", size=size, device=torch.cuda.get_device_name(dev),
                   tflops=rates, fp32="TF32 off (float32_matmul_precision highest)")
        if errors:
            res["errors"] = errors
        return res
    n = min(size, 1024)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return dict(backend=f"numpy {np.__version__} float32 matmul (CPU)", size=n, device=platform.machine(),
                tflops={"fp32": 2.0 * n ** 3 / best / 1e12})


def measure_gemm(args):
    """In this process when torch is importable (on the CPU: NumPy); otherwise, or with
    --gemm-subprocess, in --official-python."""
    if not args.device.startswith("cuda"):
        return gemm_rates(args.device, args.gemm_size)
    if not args.gemm_subprocess and importlib.util.find_spec("torch") is not None:
        res = gemm_rates(args.device, args.gemm_size)
        res["measured_in"] = "this process"
        return res
    res = run_worker(__file__, args.official_python, "gemm", dict(device=args.device, size=args.gemm_size))
    if res.get("error"):
        log(f"GEMM rate not measured: {res['error']}")
        return None
    res["rates"]["measured_in"] = f"subprocess {args.official_python}"
    return res["rates"]


# ==========================================================================
# Random weights in the official layout
# ==========================================================================

def state_shapes(key):
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from reference import mar as R

    d = DIMS[key]
    return R.mar_shapes(d["dim"], d["depth"], d["head_width"], d["head_depth"])


def ensure_weights(key, workdir):
    """float32 safetensors with the official state_dict keys, written once (bench_cpu.py's values)."""
    name = CONFIGS[key]["name"] or key
    path = os.path.join(workdir, f"{name}_random_f32.safetensors")
    if os.path.exists(path):
        log(f"reusing random {CONFIGS[key]['label']} weights {path}")
        return path
    from safetensors.numpy import save_file

    os.makedirs(workdir, exist_ok=True)
    log(f"writing random {CONFIGS[key]['label']} weights to {path} ...")
    rng = np.random.default_rng(0)
    tensors = {}
    for k, shape in state_shapes(key).items():
        base = 1.0 if k.endswith(".weight") and len(shape) == 1 else 0.0
        tensors[k] = (base + 0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    tmp = f"{path}.tmp{os.getpid()}"
    save_file(tensors, tmp, metadata={"heads": str(DIMS[key]["heads"])})
    os.replace(tmp, path)
    return path


def flops_config(key):
    """marcache.flops' config dict for a configuration (also the tiny one, without loading it)."""
    d = DIMS[key]
    return dict(width=d["dim"], depth=d["depth"], heads=d["heads"], decoder_width=d["dim"],
                decoder_depth=d["depth"], decoder_heads=d["heads"], mlp_hidden=4 * d["dim"],
                decoder_mlp_hidden=4 * d["dim"], head_width=d["head_width"], head_depth=d["head_depth"],
                seq_len=256, buffer_size=64, token_channels=16, num_classes=1000)


class _ConfigOnly:
    def __init__(self, config):
        self.config = config


def count_flops(key, steps, cfg, cache, batch, convention="engine"):
    import marcache as mc

    return mc.flops(_ConfigOnly(flops_config(key)), steps=steps, cfg=cfg, cache=cache, batch=batch,
                    convention=convention).total


def make_policy(policy, steps):
    import marcache as mc

    if policy == "lazymar":
        return mc.LazyMAR.preset(steps) if steps in (32, 64) else mc.LazyMAR()
    if policy == "marche":
        return mc.MARche()
    raise ValueError(policy)


# ==========================================================================
# Our side
# ==========================================================================

def run_ours(key, weights, args, cfg, bench):
    """Times marcache on every batch (NoCache, plus the cache policies on the chosen cells)."""
    import marcache as mc

    label = CONFIGS[key]["label"]
    heads = DIMS[key]["heads"] if key == "tiny" else None
    try:
        t0 = time.perf_counter()
        model = mc.load(weights, device=args.device, dtype=args.dtype, heads=heads)
        bench.data["ours_load_seconds"][key] = time.perf_counter() - t0
        log(f"{label}: loaded {model!r} on {args.device} ({args.dtype}) in {time.perf_counter() - t0:.1f} s")
    except Exception as e:  # noqa: BLE001 - reported, the official side still runs
        msg = f"{type(e).__name__}: {e}"
        log(f"{label}: marcache could not load the model on {args.device}/{args.dtype}: {msg}")
        for batch in args.batches:
            bench.add_cell(dict(config=key, label=label, batch=batch, side="ours", policy="none", error=msg))
        return
    warm = warmup_steps(args)
    try:
        for batch in args.batches:
            labels = make_labels(batch)
            policies = ["none"] + [p for p in args.policies if policy_cell(args, key, batch)]
            for policy in policies:
                cell = dict(config=key, label=label, batch=batch, side="ours", policy=policy)
                if bench.out_of_time():
                    cell["error"] = "skipped (time budget)"
                    bench.add_cell(cell)
                    continue
                cache = None if policy == "none" else make_policy(policy, args.steps)
                expected = count_flops(key, args.steps, cfg, cache, batch)
                title = POLICY_TITLES.get(policy, "NoCache")
                try:
                    model.generate_tokens(labels=labels, steps=warm, cfg=cfg, cfg_schedule="linear", seed=0,
                                          cache=cache)
                    times = []
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        tokens, info = model.generate_tokens(labels=labels, steps=args.steps, cfg=cfg,
                                                             cfg_schedule="linear", seed=0, cache=cache,
                                                             return_info=True)
                        times.append(time.perf_counter() - t0)
                    best = min(times)
                    cell.update(seconds=times, best_seconds=best, ms_per_image=1e3 * best / batch,
                                flops=info.flops, flops_expected=expected,
                                flops_match=bool(abs(info.flops - expected) <= 1e-9 * expected),
                                tflops_per_s=info.flops / best / 1e12, finite=bool(np.isfinite(tokens).all()),
                                # AR steps whose head ran as a recorded CUDA graph (all, unless a
                                # recording failed and the steps ran directly)
                                head_graph_steps=int(sum(bool(st.get("head_graph")) for st in info.steps)),
                                steps_run=len(info.steps))
                    note = "" if cell["flops_match"] else \
                        f"  [engine FLOPs {info.flops:.4g} != marcache.flops {expected:.4g}]"
                    log(f"{label} batch {batch} ours {title}: {best:.3f} s, {cell['ms_per_image']:.1f} ms/image, "
                        f"{fmt_rate(cell['tflops_per_s'])} TFLOP/s{note}")
                except Exception as e:  # noqa: BLE001 - one failed cell must not end the run
                    cell["error"] = f"{type(e).__name__}: {e}"
                    log(f"{label} batch {batch} ours {title}: FAILED {cell['error']}")
                bench.add_cell(cell)
    finally:
        del model
        gc.collect()


def warmup_steps(args):
    return min(args.warmup_steps, args.steps) if args.warmup_steps else args.steps


def fmt_rate(tflops):
    return f"{tflops:.1f}" if tflops >= 10 else f"{tflops:.3g}"


def policy_cell(args, key, batch):
    return args.policy_cells == "all" or (key == "huge" and batch == 64)


# ==========================================================================
# The official side (a subprocess: its own interpreter, its own CUDA context)
# ==========================================================================

def run_official(key, weights, args, cfg, bench):
    label = CONFIGS[key]["label"]
    remaining = bench.remaining()
    spec = dict(official_dir=os.path.abspath(args.official), config=key, factory=CONFIGS[key]["name"],
                dims=DIMS[key], weights=os.path.abspath(weights), batches=args.batches, steps=args.steps, cfg=cfg,
                device=args.device, repeats=args.repeats, warmup_steps=warmup_steps(args),
                time_left=remaining)
    log(f"{label}: official code ({args.official_python}) ...")
    res = run_worker(__file__, args.official_python, "official", spec)
    if res.get("error"):
        log(f"{label}: official column skipped: {res['error']}")
        bench.data["official"]["errors"][key] = res["error"]
        for batch in args.batches:
            bench.add_cell(dict(config=key, label=label, batch=batch, side="official", policy="none",
                                error=res["error"]))
        return
    bench.data["official"]["runs"][key] = {k: v for k, v in res.items() if k != "rows"}
    for row in res["rows"]:
        cell = dict(config=key, label=label, side="official", policy="none", **row)
        if "best_seconds" in row:
            batch = row["batch"]
            cell["flops_reference"] = count_flops(key, args.steps, cfg, None, batch, convention="reference")
            cell["tflops_per_s"] = cell["flops_reference"] / row["best_seconds"] / 1e12
        bench.add_cell(cell)


def _stub_official_deps(notes):
    """models/mar.py imports scipy.stats (truncnorm: training masks only) and tqdm (progress=True only)."""
    import types

    try:
        import scipy.stats  # noqa: F401
    except ImportError:
        scipy_mod, stats_mod = types.ModuleType("scipy"), types.ModuleType("scipy.stats")

        class truncnorm:  # noqa: N801 - the name models/mar.py uses
            def __init__(self, *a, **k):
                pass

            def rvs(self, *a, **k):
                raise RuntimeError("scipy is not installed: stub truncnorm (training only)")

        stats_mod.truncnorm = truncnorm
        scipy_mod.stats = stats_mod
        sys.modules["scipy"], sys.modules["scipy.stats"] = scipy_mod, stats_mod
        notes.append("scipy missing: stubbed scipy.stats.truncnorm (the official model uses it only in training)")
    try:
        import tqdm  # noqa: F401
    except ImportError:
        tqdm_mod = types.ModuleType("tqdm")
        tqdm_mod.tqdm = lambda it, *a, **k: it
        sys.modules["tqdm"] = tqdm_mod
        notes.append("tqdm missing: stubbed (the official model uses it only with progress=True)")


def worker_official(spec):
    """Builds the official MAR (models/mar.py) with the same weights and times sample_tokens."""
    notes = []
    official_dir = spec["official_dir"]
    torch, failed = import_official(official_dir, os.path.join("models", "mar.py"))
    if failed:
        return failed
    try:
        _stub_official_deps(notes)
        import timm
        from functools import partial
        from models import mar as official_mar
        from safetensors.torch import load_file
    except Exception as e:  # noqa: BLE001
        return dict(error=f"cannot import the official code from {official_dir}: {type(e).__name__}: {e}")

    device = spec["device"]
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        return dict(error=f"torch {torch.__version__} sees no CUDA device")
    if cuda and torch.device(device).index is not None:
        torch.cuda.set_device(torch.device(device))  # the official code's bare .cuda() calls use it
    if not cuda:
        # The official code calls .cuda() on fresh tensors (models/mar.py, diffloss.py, gaussian_diffusion.py):
        # on a CPU dry run that is the identity.
        torch.Tensor.cuda = lambda self, *a, **k: self
        notes.append("CPU dry run: torch.Tensor.cuda patched to the identity, float32, no autocast")
    torch.backends.cudnn.benchmark = True  # as main_mar.py
    # main_mar.py's model arguments at their defaults, the README eval head size.
    d = spec["dims"]
    kwargs = dict(img_size=256, vae_stride=16, patch_size=1, vae_embed_dim=16, mask_ratio_min=0.7,
                  label_drop_prob=0.1, class_num=1000, attn_dropout=0.1, proj_dropout=0.1, buffer_size=64,
                  diffloss_d=d["head_depth"], diffloss_w=d["head_width"], num_sampling_steps="100",
                  diffusion_batch_mul=1, grad_checkpointing=False)
    t0 = time.perf_counter()
    with torch.device(device):  # parameters created (and randomly initialised) on the device
        if spec["factory"]:
            model = getattr(official_mar, spec["factory"])(**kwargs)
        else:
            model = official_mar.MAR(encoder_embed_dim=d["dim"], encoder_depth=d["depth"],
                                     encoder_num_heads=d["heads"], decoder_embed_dim=d["dim"],
                                     decoder_depth=d["depth"], decoder_num_heads=d["heads"], mlp_ratio=4,
                                     norm_layer=partial(torch.nn.LayerNorm, eps=1e-6), **kwargs)
    state = load_file(spec["weights"])
    model.load_state_dict(state, strict=True)
    del state
    model.eval()
    model.to(device)
    load_seconds = time.perf_counter() - t0
    err(f"  official {spec['config']}: built and loaded (strict) in {load_seconds:.1f} s")

    def autocast():
        # engine_mar.py evaluate: torch.no_grad() + torch.cuda.amp.autocast() (fp16)
        return torch.autocast("cuda", dtype=torch.float16) if cuda else contextlib.nullcontext()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def sample(batch, labels, num_iter):
        torch.manual_seed(1)  # main_mar.py --seed default
        np.random.seed(1)
        with torch.no_grad(), autocast():
            return model.sample_tokens(bsz=batch, num_iter=num_iter, cfg=spec["cfg"], cfg_schedule="linear",
                                       labels=labels, temperature=1.0)

    deadline = None if spec["time_left"] is None else time.perf_counter() + spec["time_left"]
    rows = []
    for batch in spec["batches"]:
        row = dict(batch=batch)
        if deadline is not None and time.perf_counter() > deadline:
            row["error"] = "skipped (time budget)"
            rows.append(row)
            continue
        labels = torch.tensor(make_labels(batch), dtype=torch.long, device=device)
        try:
            sample(batch, labels, spec["warmup_steps"])
            sync()
            times = []
            for _ in range(spec["repeats"]):
                sync()
                t0 = time.perf_counter()
                tokens = sample(batch, labels, spec["steps"])
                sync()
                times.append(time.perf_counter() - t0)
            best = min(times)
            row.update(seconds=times, best_seconds=best, ms_per_image=1e3 * best / batch,
                       finite=bool(torch.isfinite(tokens).all()))
            err(f"  official {spec['config']} batch {batch}: {best:.3f} s, {row['ms_per_image']:.1f} ms/image")
            del tokens
        except Exception as e:  # noqa: BLE001 - out of memory and the like: record, go on
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            err(f"  official {spec['config']} batch {batch}: FAILED {row['error']}")
            if cuda:
                torch.cuda.empty_cache()
        rows.append(row)
    return dict(rows=rows, load_seconds=load_seconds, notes=notes, torch=torch.__version__,
                timm=timm.__version__, python=sys.version.split()[0], executable=sys.executable,
                device=torch.cuda.get_device_name() if cuda else platform.machine(),
                autocast="fp16" if cuda else "none (fp32 on the CPU)")


# ==========================================================================
# Results
# ==========================================================================

class Bench:
    def __init__(self, args):
        self.args = args
        self.t_start = time.perf_counter()
        self.data = dict(benchmark="benchmarks/bench_gpu.py", issue=8, argv=sys.argv,
                         date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                         settings={k: v for k, v in vars(args).items()}, host={}, gemm={}, official={},
                         ours_load_seconds={}, cells=[], table=[], targets=[])

    def remaining(self):
        if not self.args.time_budget:
            return None
        return max(0.0, self.args.time_budget - (time.perf_counter() - self.t_start))

    def out_of_time(self):
        r = self.remaining()
        return r is not None and r <= 0

    def add_cell(self, cell):
        self.data["cells"].append(cell)
        self.save()

    def cell(self, key, batch, side, policy="none"):
        for c in self.data["cells"]:
            if c["config"] == key and c["batch"] == batch and c["side"] == side and c["policy"] == policy:
                return c
        return None

    def save(self):
        out = self.args.out
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        self.data["elapsed_seconds"] = time.perf_counter() - self.t_start
        tmp = f"{out}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=2, default=str)
        os.replace(tmp, out)


def fmt_ms(cell):
    if cell is None:
        return "—"
    if "best_seconds" not in cell:
        e = cell.get("error", "?")
        return "skipped" if e.startswith("skipped") else ("OOM" if "out of memory" in e.lower() else "error")
    return f"{cell['ms_per_image']:.1f}"


def summarize(bench, configs, peak, peak_key):
    args = bench.args
    head = ["model", "batch", "ours ms/img", "ours TFLOP/s", f"% of {peak_key} GEMM", "official ms/img",
            "official TFLOP/s", "ours vs official"]
    for p in args.policies:
        head += [f"{POLICY_TITLES[p]} ms/img", f"{POLICY_TITLES[p]} vs NoCache"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    table = []
    for key in configs:
        for batch in args.batches:
            ours, off = bench.cell(key, batch, "ours"), bench.cell(key, batch, "official")
            row = dict(config=key, label=CONFIGS[key]["label"], batch=batch)
            ok = ours is not None and "best_seconds" in ours
            if ok and peak:
                ours["pct_of_peak"] = 100.0 * ours["tflops_per_s"] / peak
            vals = [CONFIGS[key]["label"], str(batch), fmt_ms(ours),
                    fmt_rate(ours["tflops_per_s"]) if ok else "—",
                    f"{ours['pct_of_peak']:.0f}%" if ok and peak else "—", fmt_ms(off),
                    fmt_rate(off["tflops_per_s"]) if off is not None and "tflops_per_s" in off else "—"]
            row.update(ours_ms_per_image=ours.get("ms_per_image") if ours else None,
                       ours_tflops_per_s=ours.get("tflops_per_s") if ours else None,
                       ours_pct_of_peak=ours.get("pct_of_peak") if ours else None,
                       official_ms_per_image=off.get("ms_per_image") if off else None)
            if ok and off is not None and "best_seconds" in off:
                row["speedup_vs_official"] = off["best_seconds"] / ours["best_seconds"]
                vals.append(f"{row['speedup_vs_official']:.2f}x")
            else:
                vals.append("—")
            for p in args.policies:
                pc = bench.cell(key, batch, "ours", p)
                vals.append(fmt_ms(pc))
                if ok and pc is not None and "best_seconds" in pc:
                    row[f"{p}_ms_per_image"] = pc["ms_per_image"]
                    row[f"{p}_speedup_vs_nocache"] = ours["best_seconds"] / pc["best_seconds"]
                    vals.append(f"{row[f'{p}_speedup_vs_nocache']:.2f}x")
                else:
                    vals.append("—")
            lines.append("| " + " | ".join(vals) + " |")
            table.append(row)
    bench.data["table"] = table

    def find(key, batch):
        return next((r for r in table if r["config"] == key and r["batch"] == batch), None)

    targets = []
    for batch, need, tkey in ((16, TARGETS["batch16"], "batch16"), (256, TARGETS["batch256"], "batch256")):
        for key in configs:
            r = find(key, batch)
            got = r.get("speedup_vs_official") if r else None
            targets.append(dict(target=f"ours >= {need}x official, {CONFIGS[key]['label']} batch {batch}",
                                key=tkey, config=key, need=need, got=got,
                                status="n/a" if got is None else ("PASS" if got >= need else "MISS")))
    r = find("huge", 64)
    got = r.get("lazymar_speedup_vs_nocache") if r else None
    need = TARGETS["lazymar_huge64"]
    targets.append(dict(target=f"LazyMAR >= {need}x our NoCache, MAR-H batch 64", key="lazymar_huge64",
                        config="huge", need=need, got=got,
                        status="n/a" if got is None else ("PASS" if got >= need else "MISS")))
    bench.data["targets"] = targets
    return lines, targets


# ==========================================================================

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["base", "large", "huge"], choices=list(CONFIGS))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--quick", action="store_true", help="batches 1 16 64 (skips 256, ~3/4 of the full run)")
    ap.add_argument("--steps", type=int, default=64, help="AR steps (default 64)")
    ap.add_argument("--cfg", type=float, default=None,
                    help="CFG scale, linear schedule (default: the README eval value per model: 2.9 / 3.0 / 3.2)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="marcache compute dtype")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (a dry run)")
    ap.add_argument("--repeats", type=int, default=1, help="timed calls per cell after the warm-up (best kept)")
    ap.add_argument("--warmup-steps", type=int, default=8,
                    help="AR steps of each cell's warm-up call (same batch and policy); 0: --steps")
    ap.add_argument("--policies", nargs="*", default=["lazymar"], choices=list(POLICY_TITLES),
                    help="cache policies timed next to NoCache (default: lazymar)")
    ap.add_argument("--policy-cells", default="target", choices=["target", "all"],
                    help="target: MAR-H batch 64 only (default); all: every cell")
    ap.add_argument("--official", default=os.path.join(REPO, ".official", "mar"),
                    help="the exported LTH14/mar tree (default .official/mar)")
    ap.add_argument("--no-official", action="store_true", help="skip the official column")
    ap.add_argument("--official-python", default=sys.executable,
                    help="interpreter with torch + timm for the official side (default: this one)")
    ap.add_argument("--gemm-size", type=int, default=8192, help="GEMM size for the measured rate (CPU: <= 1024)")
    ap.add_argument("--gemm-subprocess", action="store_true",
                    help="measure the GEMM rate in --official-python, keeping torch out of this process")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "marcache-bench-gpu"),
                    help="where the random weights are written once and reused")
    ap.add_argument("--time-budget", type=float, default=0, help="seconds; no new cell starts after it (0: none)")
    ap.add_argument("--out", default=None, help="JSON results (default benchmarks/results/bench_gpu-<date>.json)")
    args = ap.parse_args()
    if args.quick:
        args.batches = [1, 16, 64]
    if args.out is None:
        args.out = os.path.join(HERE, "results", f"bench_gpu-{datetime.date.today().isoformat()}.json")
    if args.steps < 1 or args.repeats < 1 or min(args.batches) < 1 or args.warmup_steps < 0:
        ap.error("--steps, --repeats and --batches must be >= 1, --warmup-steps >= 0")

    import marcache as mc

    bench = Bench(args)
    info = mc.build_info()
    host = dict(python=sys.version.split()[0], executable=sys.executable, platform=platform.platform(),
                numpy=np.__version__, marcache=mc.__version__, marcache_path=os.path.dirname(mc.__file__),
                build_info=info)
    try:  # version only: torch is imported (for the GEMM) before any model is loaded, or not at all
        from importlib.metadata import version

        host["torch"] = version("torch") if importlib.util.find_spec("torch") else None
    except Exception:  # noqa: BLE001
        host["torch"] = None
    names = info.get("cuda_device_names") or []
    host["device_name"] = (names[0] if names else "CUDA device") if args.device.startswith("cuda") else \
        (platform.processor() or platform.machine())
    bench.data["host"] = host
    official_on = not args.no_official
    off_commit = None
    if official_on and not os.path.isfile(os.path.join(args.official, "models", "mar.py")):
        log(f"official code not found at {args.official} (models/mar.py): skipping the official column; "
            f"export github.com/LTH14/mar there (see this file's docstring)")
        official_on = False
    if official_on and os.path.isfile(os.path.join(args.official, "COMMIT")):
        with open(os.path.join(args.official, "COMMIT")) as f:
            off_commit = f.read().strip()
    bench.data["official"] = dict(enabled=official_on, dir=os.path.abspath(args.official), commit=off_commit,
                                  python=args.official_python, runs={}, errors={})
    log(f"device: {host['device_name']} ({args.device}); marcache {mc.__version__} from {host['marcache_path']}; "
        f"torch {host['torch']}; backends {info.get('backends')}")
    cfg_text = args.cfg if args.cfg is not None else "README per model"
    log(f"steps {args.steps}, cfg {cfg_text} (linear), dtype {args.dtype}, "
        f"batches {args.batches}, warm-up {warmup_steps(args)} steps, repeats {args.repeats}")

    gemm_before = measure_gemm(args)
    bench.data["gemm"]["before"] = gemm_before
    if gemm_before and args.device.startswith("cuda"):
        host["device_name"] = gemm_before["device"]
    if gemm_before:
        log(f"GEMM ({gemm_before['backend']}, {gemm_before['size']}^3): " +
            ", ".join(f"{k} {fmt_rate(v)} TFLOP/s" for k, v in gemm_before["tflops"].items()))
    bench.save()

    for key in args.configs:
        cfg = args.cfg if args.cfg is not None else CONFIGS[key]["cfg"]
        bench.data.setdefault("cfg", {})[key] = cfg
        weights = ensure_weights(key, args.workdir)
        run_ours(key, weights, args, cfg, bench)
        if official_on:
            if bench.out_of_time():
                for batch in args.batches:
                    bench.add_cell(dict(config=key, label=CONFIGS[key]["label"], batch=batch, side="official",
                                        policy="none", error="skipped (time budget)"))
            else:
                run_official(key, weights, args, cfg, bench)

    gemm_after = measure_gemm(args)
    bench.data["gemm"]["after"] = gemm_after
    peak_key = args.dtype if args.device.startswith("cuda") else "fp32"
    peaks = [g["tflops"].get(peak_key) for g in (gemm_before, gemm_after) if g and g["tflops"].get(peak_key)]
    peak = max(peaks) if peaks else None
    merged = {}
    for g in (gemm_before, gemm_after):
        for k, v in (g or {}).get("tflops", {}).items():
            merged[k] = max(merged.get(k, 0.0), v)
    bench.data["gemm"].update(peak_key=peak_key, peak_tflops=peak, best_tflops=merged)
    lines, targets = summarize(bench, args.configs, peak, peak_key)
    bench.save()

    log("")
    log(f"{', '.join(CONFIGS[k]['label'] for k in args.configs)} (random weights), {args.steps} steps, CFG "
        f"{args.cfg if args.cfg is not None else 'per model ' + '/'.join(str(CONFIGS[k]['cfg']) for k in args.configs)}"
        f" linear; ours {args.dtype} on {host['device_name']}; official: "
        + ((f"LTH14/mar {off_commit or '(commit unknown)'}, " +
            ("fp16 autocast" if args.device.startswith("cuda") else "fp32 on the CPU")) if official_on else "skipped"))
    if peak:
        log(f"measured GEMM peak ({peak_key}): {fmt_rate(peak)} TFLOP/s; all rates (best of before/after): " +
            ", ".join(f"{k} {fmt_rate(v)}" for k, v in merged.items()))
    for line in lines:
        log(line)
    log("")
    log("targets:")
    for t in targets:
        got = "not measured" if t["got"] is None else f"{t['got']:.2f}x"
        log(f"  {t['target']}: {got} {t['status']}")
    bad = [c for c in bench.data["cells"] if c.get("flops_match") is False]
    if bad:
        log(f"note: {len(bad)} cell(s) where the engine's FLOP telemetry differs from marcache.flops")
    log(f"results: {args.out}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker_main({"official": worker_official,
                     "gemm": lambda spec: dict(rates=gemm_rates(spec["device"], spec["size"]))},
                    sys.argv[2], sys.argv[3])
    else:
        main()

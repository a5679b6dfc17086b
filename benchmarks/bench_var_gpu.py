"""VAR on a GPU side by side with the official PyTorch code (issue 15's GPU point).

VAR-d16 and VAR-d30 with random weights in the official layout (bench_var.py writes
them: the VAR file and a random VQVAE, vae_ch160v4096z32), the README's FID recipe
(cfg 1.5, top-k 900, top-p 0.96, more_smooth off), batch 16 and 64, marcache in bf16 on
the GPU against the official FoundationVision/VAR code on the same GPU with the same
weights, as its README and demo_sample.ipynb run it: build_vae_var, then
autoregressive_infer_cfg under torch.inference_mode() and fp16 autocast; flash-attn and
xformers are used when installed (the official code picks them itself), else torch's
scaled_dot_product_attention. Target (printed PASS/MISS, never asserted): ours >= 2x
the official code at batch 16.

What is timed, on both sides the same: a whole image, from labels to uint8 pixels on the
host (the 10 scales, sampling, the VQ accumulation and the VQVAE decode; the official
side's [0, 1] images are converted with .mul(255).round().clamp(0, 255) to uint8 and
copied to the host, as ours are). One warm-up call of the same batch, then --repeats
timed calls; the best is reported. Ours also reports the scale loop and the decode apart
(GenerationInfo), and its TFLOP/s (the engine's FLOPs of the loop, = marcache.flops)
against the bf16 GEMM rate measured in the same run (torch.matmul 8192^3, as
bench_gpu.py).

The official code is never committed: export it to .official/var (ignored through
.git/info/exclude) and carry it to the GPU machine:

    mkdir -p .official/var && echo /.official/ >> .git/info/exclude
    git --git-dir=<mirror of github.com/FoundationVision/VAR> archive HEAD models dist.py utils \\
        README.md LICENSE | tar -x -C .official/var
    git --git-dir=<mirror> rev-parse HEAD > .official/var/COMMIT

It runs in a subprocess (--official-python, default this interpreter) that needs torch
and safetensors (huggingface_hub is stubbed when missing: the official VAR class only
inherits its hub mixin).

    python benchmarks/bench_var_gpu.py                                  # d16, d30; batch 16, 64
    python benchmarks/bench_var_gpu.py --models d16 --batches 16 --no-official
    # CPU dry run of the whole pipeline on a 2-block VAR (fp32, official code on the CPU):
    python benchmarks/bench_var_gpu.py --models d2 --batches 2 --device cpu --dtype fp32 \\
        --official-python /path/to/python-with-torch
"""
import argparse
import datetime
import json
import os
import platform
import sys
import time

import numpy as np

from _worker import import_official, run_worker, worker_main
from bench_gpu import gemm_rates, log, make_labels

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CFG, TOP_K, TOP_P = 1.5, 900, 0.96
TARGET_BATCH16 = 2.0


def var_name(name):
    """An argparse type: 'dN' with N in 1..30 (d16, d30; d2 for CPU dry runs), returned as is."""
    if not (name.startswith("d") and name[1:].isdigit() and 1 <= int(name[1:]) <= 30):
        raise argparse.ArgumentTypeError(f"model {name!r}: expected dN with N in 1..30 (d16, d30)")
    return name


# ==========================================================================
# Ours
# ==========================================================================

def run_ours(name, paths, args):
    import marcache as mc

    t0 = time.perf_counter()
    model = mc.load(paths[0], vae=paths[1], device=args.device, dtype=args.dtype)
    log(f"VAR-{name}: loaded on {args.device} ({args.dtype}) in {time.perf_counter() - t0:.1f} s "
        f"({model.num_params:,} parameters)")
    rows = []
    for batch in args.batches:
        labels = make_labels(batch)
        row = dict(model=name, batch=batch, side="ours")
        try:
            model.generate(labels=labels, seed=0, cfg=CFG, top_k=TOP_K, top_p=TOP_P)  # warm-up
            best = None
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                images, info = model.generate(labels=labels, seed=0, cfg=CFG, top_k=TOP_K, top_p=TOP_P,
                                              return_info=True)
                seconds = time.perf_counter() - t0
                if best is None or seconds < best[0]:
                    best = (seconds, info)
            seconds, info = best
            expected = mc.flops(model, cfg=CFG, batch=batch).total
            if abs(info.flops - expected) > 1e-9 * expected:
                raise RuntimeError(f"telemetry FLOPs {info.flops} != marcache.flops {expected}")
            assert images.shape == (batch, 256, 256, 3) and images.dtype == np.uint8
            row.update(best_seconds=seconds, ms_per_image=1e3 * seconds / batch,
                       loop_seconds=info.seconds_transformer_and_head, decode_seconds=info.seconds_decode,
                       loop_flops=info.flops, loop_tflops_per_s=info.flops / info.seconds_transformer_and_head / 1e12)
            log(f"VAR-{name} batch {batch} ours: {seconds:.3f} s, {row['ms_per_image']:.1f} ms/image "
                f"(loop {row['loop_seconds']:.3f} s, {row['loop_tflops_per_s']:.3g} TFLOP/s; "
                f"decode {row['decode_seconds']:.3f} s)")
        except Exception as e:  # noqa: BLE001 - out of memory and the like: record, go on
            row["error"] = f"{type(e).__name__}: {e}"
            log(f"VAR-{name} batch {batch} ours: FAILED {row['error']}")
        rows.append(row)
    del model
    return rows


# ==========================================================================
# The official side (a subprocess: its own interpreter and CUDA context)
# ==========================================================================

def worker_official(spec):
    """Builds the official VAR and VQVAE, loads the same weights, times autoregressive_infer_cfg."""
    import contextlib
    import importlib.util
    import types

    code = spec["official_dir"]
    torch, failed = import_official(code, os.path.join("models", "var.py"))
    if failed:
        return failed
    from safetensors.torch import load_file

    notes = []
    if importlib.util.find_spec("huggingface_hub") is None:
        hub = types.ModuleType("huggingface_hub")
        hub.PyTorchModelHubMixin = type("PyTorchModelHubMixin", (), {})
        sys.modules["huggingface_hub"] = hub
        notes.append("huggingface_hub missing: stubbed PyTorchModelHubMixin (a mixin for hub uploads only)")
    device = spec["device"]
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        return dict(error=f"torch {torch.__version__} sees no CUDA device")
    from models import build_vae_var
    from models import basic_var

    attention = ("flash-attn" if basic_var.flash_attn_func is not None else
                 "xformers" if basic_var.memory_efficient_attention is not None else
                 "torch scaled_dot_product_attention")
    t0 = time.perf_counter()
    vae, var = build_vae_var(device=device, depth=spec["depth"], shared_aln=False, attn_l2_norm=True)
    # The random files hold what marcache reads: the VQVAE's encoder and quant_conv (unused when
    # sampling) are not in them and keep the official initialisation; every other parameter must be.
    for module, path, optional in ((vae, spec["vqvae"], ("encoder.", "quant_conv.")), (var, spec["var"], ())):
        missing, unexpected = module.load_state_dict(load_file(path), strict=False)
        params = {n for n, _ in module.named_parameters()}
        missing = [k for k in missing if k in params and not k.startswith(optional)]
        if missing or unexpected:
            return dict(error=f"{path} does not fit the official model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    vae.eval()
    var.eval()
    load_seconds = time.perf_counter() - t0

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def sample(batch):
        labels = torch.tensor(make_labels(batch), dtype=torch.long, device=device)
        autocast = (torch.autocast("cuda", enabled=True, dtype=torch.float16, cache_enabled=True) if cuda
                    else contextlib.nullcontext())
        with torch.inference_mode(), autocast:
            images = var.autoregressive_infer_cfg(B=batch, label_B=labels, g_seed=0, cfg=spec["cfg"],
                                                  top_k=spec["top_k"], top_p=spec["top_p"], more_smooth=False)
            return images.mul(255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()

    rows = []
    for batch in spec["batches"]:
        row = dict(model=spec["model"], batch=batch, side="official")
        try:
            sample(batch)
            sync()
            times = []
            for _ in range(spec["repeats"]):
                sync()
                t0 = time.perf_counter()
                images = sample(batch)
                sync()
                times.append(time.perf_counter() - t0)
            assert images.shape == (batch, 256, 256, 3)
            best = min(times)
            row.update(seconds=times, best_seconds=best, ms_per_image=1e3 * best / batch)
            print(f"  official VAR-{spec['model']} batch {batch}: {best:.3f} s, {row['ms_per_image']:.1f} ms/image",
                  file=sys.stderr, flush=True)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if cuda:
                torch.cuda.empty_cache()
        rows.append(row)
    return dict(rows=rows, load_seconds=load_seconds, notes=notes, attention=attention, torch=torch.__version__,
                python=sys.version.split()[0], executable=sys.executable,
                device=torch.cuda.get_device_name() if cuda else platform.machine(),
                autocast="fp16" if cuda else "none (fp32 on the CPU)")


# ==========================================================================
# The run
# ==========================================================================

def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        return worker_main({"official": worker_official}, sys.argv[2], sys.argv[3])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", type=var_name, default=["d16", "d30"])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--official", default=os.path.join(REPO, ".official", "var"))
    parser.add_argument("--official-python", default=sys.executable)
    parser.add_argument("--no-official", action="store_true")
    parser.add_argument("--workdir", default=os.path.join(HERE, ".cache"))
    parser.add_argument("--out", default=None, help="the results as JSON")
    args = parser.parse_args()
    if any(b < 1 for b in args.batches) or args.repeats < 1:
        parser.error("--batches and --repeats must be at least 1")

    from bench_var import model_paths  # imports marcache: the parent's, not the worker's

    import marcache as mc

    data = dict(benchmark="benchmarks/bench_var_gpu.py", issue=15, argv=sys.argv,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                settings=vars(args), build_info=mc.build_info(), official={}, rows=[])
    peak = None
    if args.device.startswith("cuda"):
        try:
            data["gemm"] = gemm_rates(args.device, 8192)
            peak = data["gemm"]["tflops"].get("bf16")
            log(f"GEMM ({data['gemm']['backend']}, 8192^3): "
                + ", ".join(f"{k} {v:.1f} TFLOP/s" for k, v in data["gemm"]["tflops"].items()))
        except ImportError:
            log("GEMM rate not measured: torch is not importable here")
    commit_file = os.path.join(args.official, "COMMIT")
    commit = open(commit_file).read().strip() if os.path.exists(commit_file) else None
    for name in args.models:
        paths = model_paths(name, args.workdir)
        data["rows"] += run_ours(name, paths, args)
        if not args.no_official:
            spec = dict(official_dir=os.path.abspath(args.official), model=name, depth=int(name[1:]),
                        var=os.path.abspath(paths[0]), vqvae=os.path.abspath(paths[1]), batches=args.batches,
                        device=args.device, repeats=args.repeats, cfg=CFG, top_k=TOP_K, top_p=TOP_P)
            log(f"VAR-{name}: official code ({args.official_python}) ...")
            res = run_worker(__file__, args.official_python, "official", spec)
            if res.get("error"):
                log(f"VAR-{name}: official column skipped: {res['error']}")
            data["official"][name] = {k: v for k, v in res.items() if k != "rows"}
            data["rows"] += res.get("rows", [])
        if args.out:
            with open(args.out, "w") as f:
                json.dump(data, f, indent=2, default=str)

    def cell(name, batch, side):
        return next((r for r in data["rows"] if r["model"] == name and r["batch"] == batch and r["side"] == side
                     and "best_seconds" in r), None)

    device_name = ", ".join(mc.build_info().get("cuda_device_names") or []) if args.device != "cpu" else "CPU"
    official = next(iter(data["official"].values()), {})
    log("")
    log(f"VAR (random weights), cfg {CFG}, top-k {TOP_K}, top-p {TOP_P}; ours {args.dtype} on {device_name}; "
        f"official: FoundationVision/VAR {commit or '(no COMMIT file)'}, autocast {official.get('autocast', '-')}, "
        f"attention {official.get('attention', '-')}, torch {official.get('torch', '-')}; whole images "
        f"(labels to uint8 on the host), best of {args.repeats}")
    if peak:
        log(f"measured bf16 GEMM rate: {peak:.1f} TFLOP/s")
    log("| model | batch | ours ms/img | ours loop ms/img | ours decode ms/img | ours loop TFLOP/s | "
        "% of bf16 GEMM | official ms/img | ours vs official |")
    log("|---|---|---|---|---|---|---|---|---|")
    targets = []
    for name in args.models:
        for batch in args.batches:
            o, p = cell(name, batch, "ours"), cell(name, batch, "official")
            ratio = p["best_seconds"] / o["best_seconds"] if o and p else None
            if o and p and batch == 16:
                targets.append(f"ours >= {TARGET_BATCH16}x official, VAR-{name} batch 16: {ratio:.2f}x "
                               f"{'PASS' if ratio >= TARGET_BATCH16 else 'MISS'}")
            if o:
                log(f"| VAR-{name} | {batch} | {o['ms_per_image']:.1f} | {1e3 * o['loop_seconds'] / batch:.1f} | "
                    f"{1e3 * o['decode_seconds'] / batch:.1f} | {o['loop_tflops_per_s']:.3g} | "
                    f"{'%.0f%%' % (100 * o['loop_tflops_per_s'] / peak) if peak else '-'} | "
                    f"{'%.1f' % p['ms_per_image'] if p else '-'} | {'%.2fx' % ratio if ratio else '-'} |")
            else:
                log(f"| VAR-{name} | {batch} | failed | | | | | {'%.1f' % p['ms_per_image'] if p else '-'} | - |")
    data["targets"] = targets
    for t in targets:
        log("target: " + t)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=2, default=str)
        log(f"results: {args.out}")


if __name__ == "__main__":
    main()

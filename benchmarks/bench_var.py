"""CPU benchmark of VAR generation (issue 15): VAR-d16 and VAR-d30 with random weights in
the official key layout and the official VQVAE configuration (vae_ch160v4096z32, random
weights), the README's FID recipe (cfg 1.5, top_k 900, top_p 0.96), batch 1 and 8.

For each (model, batch) it reports seconds per image of the transformer loop (10 scales:
transformer, logits, guidance, sampling, VQ update) and of the VQVAE decode, the
transformer's FLOPs per image (the engine's telemetry, held equal to marcache.flops) and
the achieved GFLOP/s next to the sgemm rate measured in the same run, before and after,
with the same thread pool. The decode's FLOPs (convolutions, spec var_fastvar.md E3:
393.7 GFLOP per image) are outside the engine's FLOP convention and are shown apart.

    python benchmarks/bench_var.py                         # d16 and d30, batch 1 and 8
    python benchmarks/bench_var.py --models d16 --batches 1 # a quick look

FastVAR mode (issue 16): wall-clock speed-up and FLOP ratio of each FastVAR setting
against no pruning, every setting in the same process on the same weights, labels and
seed, the settings alternated run by run (round r runs them all, in an order rotated by
r), so the machine's load falls on all of them alike. The wall time is the scale loop
(transformer, logits, sampling, VQ update; generate_tokens), not the VQVAE decode, as the
FastVAR paper's speeds exclude the decode; the decode is timed once and shown apart (it
is the same for every setting). FLOP ratios are the engine's telemetry (= marcache.flops).

    python benchmarks/bench_var.py --fastvar --models d16 --batches 8 --rounds 2
    python benchmarks/bench_var.py --fastvar --models d30 --batches 8 --rounds 1 --settings none default
    # on a GPU (issue 16's d30 batch-64 bf16 point):
    python benchmarks/bench_var.py --fastvar --models d30 --batches 64 --settings none default --device cuda --dtype bf16

Weights are written once under benchmarks/.cache/ (d16 1.2 GB, d30 4 GB as bf16 bits,
converted to float32 at load; the VQVAE 0.4 GB).
"""
import argparse
import math
import os
import sys
import time

import numpy as np

import marcache as mc
from marcache.convert.decoder import decoder_expected_shapes
from marcache.convert.tensors import f32_to_bf16_bits
from marcache.convert.var import var_expected_shapes
from marcache.convert.writer import write_safetensors

from _common import print_machine, print_run_header, print_table, sgemm_rate, write_json

HERE = os.path.dirname(os.path.abspath(__file__))
DEPTHS = {"d16": 16, "d20": 20, "d24": 24, "d30": 30}
DECODE_GFLOP_PER_IMAGE = 393.7  # var_fastvar.md E3


class _RandomTensor:
    """A tensor the safetensors writer materialises only when it writes it (the d30 file
    never holds more than one tensor in memory): N(0, std) float32, or BF16 bits."""

    def __init__(self, name, shape, seed, std, fill=None, bf16=False):
        self.name, self.shape, self.seed, self.std, self.fill = name, tuple(shape), seed, std, fill
        self.dtype = "BF16" if bf16 else "F32"

    def raw(self):
        if self.fill is not None:
            arr = np.full(self.shape, self.fill, np.float32)
        else:
            rng = np.random.default_rng(self.seed)
            arr = (self.std * rng.standard_normal(self.shape, dtype=np.float32)).astype(np.float32)
        return f32_to_bf16_bits(arr) if self.dtype == "BF16" else arr


def write_random_var(path, depth, bf16):
    width = 64 * depth
    shapes = var_expected_shapes(depth, width, depth)
    tensors = {}
    for i, (key, (shape)) in enumerate(shapes.items()):
        if key in ("lvl_1L", "attn_bias_for_masking") or key.endswith("zero_k_bias"):
            continue  # buffers: the converter does not write them either
        if key.endswith("scale_mul_1H11"):
            tensors[key] = _RandomTensor(key, shape, i, 0.0, fill=math.log(4.0), bf16=bf16)
        else:
            tensors[key] = _RandomTensor(key, shape, i, 0.02, bf16=bf16)
    meta = {"kind": "var", "patch_nums": "1,2,3,4,5,6,8,10,13,16", "note": "random weights (bench_var.py)"}
    write_safetensors(path, tensors, metadata=meta, dtype="BF16" if bf16 else "F32")


def write_random_vqvae(path):
    shapes = decoder_expected_shapes(160, (1, 1, 2, 2, 4), 2, 32, post_quant_ks=3, fused_qkv=True,
                                     top_attention=True)
    shapes["quantize.embedding.weight"] = (4096, 32)
    for k in range(4):
        shapes[f"quantize.quant_resi.qresi_ls.{k}.weight"] = (32, 32, 3, 3)
        shapes[f"quantize.quant_resi.qresi_ls.{k}.bias"] = (32,)
    tensors = {}
    for i, (key, shape) in enumerate(shapes.items()):
        norm_weight = key.endswith(".weight") and len(shape) == 1
        tensors[key] = _RandomTensor(key, shape, 1000 + i, 0.02, fill=1.0 if norm_weight else None)
    write_safetensors(path, tensors, metadata={"kind": "vqvae", "note": "random weights (bench_var.py)"})


# GEMM shapes of the VAR blocks (nn.Linear form: rows x out x in).
SGEMM_SHAPES = [(2048, 2048, 2048), (512, 3072, 1024), (512, 4096, 1024), (512, 5760, 1920)]


# FastVAR mode: name -> (label, policy). "none" is the baseline every ratio is taken to.
FASTVAR_SETTINGS = {
    "none": ("NoCache()", lambda: mc.NoCache()),
    "default": ("FastVAR() (default = HART-like {8: 0.5, 9: 0.75})", lambda: mc.FastVAR()),
    "infinity": ("FastVAR(prune={8: 0.4, 9: 0.5}) (Infinity's ratios)", lambda: mc.FastVAR(prune={8: 0.4, 9: 0.5})),
    "last-0.5": ("FastVAR(prune={9: 0.5})", lambda: mc.FastVAR(prune={9: 0.5})),
    "cache8-last-0.5": ("FastVAR(cache_scale=8, prune={9: 0.5})", lambda: mc.FastVAR(cache_scale=8, prune={9: 0.5})),
    "skip-last": ("FastVAR(prune={}, skip_last=1)", lambda: mc.FastVAR(prune={}, skip_last=1)),
    "cfgfree+default": ("CfgFreeLate(after=0.8, inner=FastVAR())",
                        lambda: mc.CfgFreeLate(after=0.8, inner=mc.FastVAR())),
}


def model_paths(name, cache_dir):
    """(VAR path, VQVAE path) of random weights under cache_dir, written on first use."""
    os.makedirs(cache_dir, exist_ok=True)
    vq_path = os.path.join(cache_dir, "vqvae_ch160_random.safetensors")
    if not os.path.exists(vq_path):
        print(f"writing random VQVAE weights to {vq_path} ...", flush=True)
        write_random_vqvae(vq_path)
    depth = int(name[1:])  # "d16" -> 16: DEPTHS names the full-size models; bench_var_gpu.py dry-runs "d2"
    path = os.path.join(cache_dir, f"var_{name}_random.safetensors")
    if not os.path.exists(path):
        print(f"writing random VAR-{name} weights to {path} ...", flush=True)
        write_random_var(path, depth, bf16=depth >= 24)  # 2 bytes per weight on disk; float32 at load
    return path, vq_path


def load_model(name, cache_dir, device="cpu", dtype="fp32"):
    path, vq_path = model_paths(name, cache_dir)
    t0 = time.perf_counter()
    model = mc.load(path, vae=vq_path, device=device, dtype=dtype)
    print(f"VAR-{name}: loaded on {device} ({dtype}) in {time.perf_counter() - t0:.1f} s "
          f"({model.num_params:,} parameters)", flush=True)
    return model


def machine_header():
    """Measures the sgemm rate, prints the machine header with the load average; (peak, by shape)."""
    peak, shapes = sgemm_rate(SGEMM_SHAPES, 3)
    print_machine(shapes)
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    return peak, shapes


def fastvar_mode(args):
    """Every setting of args.settings against NoCache, alternated run by run (see the module doc)."""
    names = ["none"] + [s for s in args.settings if s != "none"]
    on_cpu = args.device == "cpu"
    # The sgemm rate is the CPU's ceiling; on a GPU the device is named instead.
    peak_before = machine_header()[0] if on_cpu else None
    if not on_cpu:
        print(f"device {args.device}: {', '.join(mc.build_info()['cuda_device_names'])}", flush=True)
    results = []
    for model_name in args.models:
        model = load_model(model_name, args.cache_dir, args.device, args.dtype)
        for batch in args.batches:
            labels = [(207 + 31 * i) % 1000 for i in range(batch)]
            # warm-up: sizes the model's and the VQVAE's workspaces for this batch cheaply (scale 0 only)
            model.generate_tokens(labels=labels, seed=0, cache=mc.FastVAR(prune={}, skip_last=model.num_scales - 1))
            seconds = {n: [] for n in names}
            flops = {}
            tokens = {}
            for r in range(args.rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                for n in order:
                    policy = FASTVAR_SETTINGS[n][1]()
                    t, f_hat, info = model.generate_tokens(labels=labels, seed=0, cache=policy, return_info=True)
                    expected = mc.flops(model, cfg=1.5, cache=policy, batch=batch).total
                    assert abs(info.flops - expected) <= 1e-9 * expected, (n, info.flops, expected)
                    seconds[n].append(info.seconds_transformer_and_head)
                    flops[n] = info.flops
                    tokens[n] = (t, f_hat)
                    print(f"VAR-{model_name} batch {batch} round {r}: {n}: {info.seconds_transformer_and_head:.1f} s "
                          f"(load {os.getloadavg()[0]:.2f})", flush=True)
            t0 = time.perf_counter()
            model.decode(tokens["none"][1])
            decode_s = time.perf_counter() - t0
            for n in names:
                # per round: the setting's time against the NoCache time of the same round
                ratios = [a / b for a, b in zip(seconds["none"], seconds[n])]
                results.append(dict(model=model_name, batch=batch, setting=n, label=FASTVAR_SETTINGS[n][0],
                                    seconds=seconds[n], speedup_per_round=ratios,
                                    speedup=sum(seconds["none"]) / sum(seconds[n]),
                                    speedup_with_decode=(sum(seconds["none"]) / args.rounds + decode_s) /
                                    (sum(seconds[n]) / args.rounds + decode_s),
                                    flops_per_image=flops[n] / batch, flop_ratio=flops["none"] / flops[n],
                                    gflops_per_s=flops[n] * args.rounds / sum(seconds[n]) / 1e9,
                                    decode_seconds=decode_s))
        del model
    peak_after = sgemm_rate(SGEMM_SHAPES, 3)[0] if on_cpu else None
    print()
    where = (f"CPU {args.dtype}, threads={os.environ.get('OMP_NUM_THREADS', os.cpu_count())}" if on_cpu else
             f"{', '.join(mc.build_info()['cuda_device_names'])} ({args.device}) {args.dtype}")
    ceiling = f"sgemm {peak_before:.1f} GFLOP/s before, {peak_after:.1f} after; " if on_cpu else ""
    print(f"FastVAR against NoCache, VAR (random weights), cfg 1.5, top_k 900, top_p 0.96, {where}, "
          f"{args.rounds} round(s) alternated; {ceiling}load average at the end {os.getloadavg()[0]:.2f}")
    print("| model | batch | setting | loop s/image (per round) | wall speed-up (per round) | GFLOP/image | "
          "FLOP ratio | loop GFLOP/s | speed-up with decode |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        per_image = ", ".join(f"{s / r['batch']:.2f}" for s in r["seconds"])
        per_round = ", ".join(f"{x:.2f}" for x in r["speedup_per_round"])
        print(f"| VAR-{r['model']} | {r['batch']} | `{r['label']}` | {per_image} | {r['speedup']:.2f}x ({per_round}) | "
              f"{r['flops_per_image'] / 1e9:.1f} | {r['flop_ratio']:.2f}x | {r['gflops_per_s']:.1f} | "
              f"{r['speedup_with_decode']:.2f}x |")
    decode = {(r["model"], r["batch"]): r["decode_seconds"] / r["batch"] for r in results}
    print("VQVAE decode (the same for every setting), s/image: " +
          ", ".join(f"VAR-{m} batch {b}: {s:.2f}" for (m, b), s in decode.items()))
    print()
    print("FLOP ratios of every setting without running (marcache.flops, per image, cfg 1.5):")
    print("| setting | " + " | ".join(f"var_{m}" for m in sorted(DEPTHS)) + " |")
    print("|---|" + "---|" * len(DEPTHS))
    for n, (label, make) in FASTVAR_SETTINGS.items():
        cells = []
        for m in sorted(DEPTHS):
            base, total = mc.flops(f"var_{m}", cfg=1.5).total, mc.flops(f"var_{m}", cfg=1.5, cache=make()).total
            cells.append(f"{total / 1e9:.1f} GFLOP ({base / total:.2f}x)")
        print(f"| `{label}` | " + " | ".join(cells) + " |")
    write_json(args.json, device=args.device, dtype=args.dtype, sgemm_before=peak_before, sgemm_after=peak_after,
               rows=results)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["d16", "d30"], choices=sorted(DEPTHS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--cache-dir", default=os.path.join(HERE, ".cache"))
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--fastvar", action="store_true", help="FastVAR mode: each setting against NoCache")
    parser.add_argument("--settings", nargs="+", default=sorted(FASTVAR_SETTINGS), choices=sorted(FASTVAR_SETTINGS),
                        help="FastVAR mode: the settings to run (NoCache always runs)")
    parser.add_argument("--rounds", type=int, default=2, help="FastVAR mode: rounds of alternated runs")
    parser.add_argument("--device", default="cpu", help="FastVAR mode: where the model runs (cpu, cuda, cuda:N)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                        help="FastVAR mode: the weights' dtype on the device")
    args = parser.parse_args()
    if not args.fastvar and (args.device != "cpu" or args.dtype != "fp32"):
        parser.error("--device and --dtype are FastVAR mode's (--fastvar); the plain mode measures the CPU in fp32")
    if args.fastvar:
        return fastvar_mode(args)

    peak_before, shapes = machine_header()
    rows = []
    for name in args.models:
        model = load_model(name, args.cache_dir)
        model.generate_tokens(labels=[1], seed=0)  # warm-up: first allocations, page faults
        for batch in args.batches:
            labels = [(207 + 31 * i) % 1000 for i in range(batch)]
            expected = mc.flops(f"var_{name}", cfg=1.5, batch=batch)
            images, info = model.generate(labels=labels, seed=0, return_info=True)
            assert images.shape == (batch, 256, 256, 3)
            assert abs(info.flops - expected.total) <= 1e-9 * expected.total, (info.flops, expected.total)
            loop_s = info.seconds_transformer_and_head
            row = dict(model=name, batch=batch, loop_seconds=loop_s, decode_seconds=info.seconds_decode,
                       gflop_per_image=info.flops / batch / 1e9, gflops_per_s=info.flops / loop_s / 1e9,
                       decode_gflops_per_s=DECODE_GFLOP_PER_IMAGE * batch / info.seconds_decode)
            rows.append(row)
            print(f"VAR-{name} batch {batch}: loop {loop_s:.1f} s ({row['gflops_per_s']:.1f} GFLOP/s), "
                  f"decode {info.seconds_decode:.1f} s", flush=True)
        del model
    peak_after, _ = sgemm_rate(SGEMM_SHAPES, 3)
    peak = max(peak_before, peak_after)
    print_run_header("VAR (random weights), cfg 1.5, top_k 900, top_p 0.96, CPU fp32", peak_before, peak_after)
    print_table(["model", "batch", "loop s/image", "decode s/image", "GFLOP/image (loop)", "loop GFLOP/s",
                 "% of sgemm", "decode GFLOP/s"],
                [[f"VAR-{r['model']}", r["batch"], f"{r['loop_seconds'] / r['batch']:.2f}",
                  f"{r['decode_seconds'] / r['batch']:.2f}", f"{r['gflop_per_image']:.1f}",
                  f"{r['gflops_per_s']:.1f}", f"{100 * r['gflops_per_s'] / peak:.0f}%",
                  f"{r['decode_gflops_per_s']:.1f}"] for r in rows])
    write_json(args.json, sgemm_peak=peak, sgemm_shapes=shapes, rows=rows)


if __name__ == "__main__":
    sys.exit(main())

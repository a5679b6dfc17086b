"""Command line: python -m marcache {demo, generate, sample, fid, reference, info, flops, convert}."""
import argparse
import os
import sys
import time


def _cmd_generate(args):
    import marcache as mc
    from .png import grid, write_png

    model = mc.load(args.model, vae=args.vae, device=args.device, dtype=args.dtype, threads=args.threads)
    labels = args.labels if args.labels else None
    images, info = model.generate(labels=labels, num_images=None if labels else args.num_images, steps=args.steps,
                                  cfg=args.cfg, cfg_schedule=args.cfg_schedule, temperature=args.temperature,
                                  seed=args.seed, first_index=args.first_index, progress=not args.quiet,
                                  return_info=True)
    write_png(args.out, grid(images, columns=args.columns))
    print(f"wrote {args.out}: {len(images)} images, {info.seconds:.1f} s "
          f"({info.seconds / len(images):.2f} s/image, {info.flops / 1e12:.2f} TFLOPs)")


def _cmd_demo(args):
    from .demo import run

    if args.per_class < 1:
        raise ValueError(f"--per-class must be >= 1, got {args.per_class}")
    run(out=args.out, per_class=args.per_class, steps=args.steps, cfg=args.cfg, seed=args.seed, threads=args.threads)


def _cmd_sample(args):
    import numpy as np

    import marcache as mc
    from .eval import SampleWriter, _Progress, class_major_labels

    if args.n < 1 or args.per_class < 1 or args.batch_size < 1:
        raise ValueError(f"--n, --per-class and --batch-size must be >= 1, got {args.n}, {args.per_class}, "
                         f"{args.batch_size}")
    model = mc.load(args.model, vae=args.vae, device=args.device, dtype=args.dtype, threads=args.threads)
    labels = class_major_labels(args.n, args.per_class, model.config.get("num_classes", 1000))
    bar = _Progress(args.n, "sample", enabled=not args.quiet)
    writer = None
    t0 = time.perf_counter()
    flops = 0.0
    try:
        for start in range(0, args.n, args.batch_size):
            lab = labels[start:start + args.batch_size]
            images, info = model.generate(labels=lab, steps=args.steps, cfg=args.cfg, cfg_schedule=args.cfg_schedule,
                                          temperature=args.temperature, seed=args.seed, first_index=start,
                                          return_info=True)
            if writer is None:
                writer = SampleWriter(args.out, args.n, images.shape[1:])
            writer.write(np.asarray(images))
            flops += info.flops
            bar.update(len(images))
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        bar.close()
    writer.close()
    dt = time.perf_counter() - t0
    print(f"wrote {args.out}: {args.n} images (arr_0 uint8 NHWC), labels i // {args.per_class}, seed {args.seed}; "
          f"{dt:.1f} s ({dt / args.n:.3f} s/image, {flops / args.n / 1e12:.3f} TFLOPs/image)")


def _cmd_fid(args):
    from .eval import InceptionV3, fid, inception_score, iter_npz_images, load_reference, npz_image_count

    inception = InceptionV3.load(args.inception, threads=args.threads, device=args.device)
    if not inception.standard:
        print("warning: this Inception is not the standard FID network (its widths differ); "
              "numbers are not comparable with published FIDs", file=sys.stderr)
    reference = load_reference(args.reference, inception, args.batch_size, progress=not args.quiet)
    stats, logits = inception.stats(iter_npz_images(args.samples, args.batch_size), progress=not args.quiet,
                                    total=npz_image_count(args.samples))
    value = fid(stats, reference, method=args.method)
    isc = inception_score(logits, splits=min(args.splits, len(logits)), protocol=args.is_protocol)
    print(f"samples:   {args.samples} ({stats.n} images)")
    print(f"reference: {args.reference}")
    print(f"FID: {value:.4f}")
    print(f"IS:  {isc.mean:.4f} +- {isc.std:.4f} ({isc.splits} splits, {args.is_protocol})")


def _cmd_reference(args):
    from .eval import InceptionV3, make_reference

    inception = InceptionV3.load(args.inception, threads=args.threads, device=args.device)
    stats = make_reference(args.source, args.out, inception, batch_size=args.batch_size, progress=not args.quiet)
    print(f"wrote {args.out}: mu [{stats.dim}], sigma [{stats.dim}, {stats.dim}] over {stats.n} images")


def _cmd_info(args):
    import marcache as mc

    if args.path is None:
        for k, v in mc.build_info().items():
            print(f"{k}: {v}")
        return
    model = mc.load(args.path)
    print(model)
    for k, v in model.config.items():
        print(f"  {k}: {v}")


def _cmd_flops(args):
    import marcache as mc

    rep = mc.flops(args.model, steps=args.steps, cfg=args.cfg, batch=1)
    print(f"{args.model}, {args.steps} steps, cfg {args.cfg}: {rep.total / 1e12:.3f} TFLOPs per image "
          f"(encoder {rep.encoder / 1e12:.3f}, decoder {rep.decoder / 1e12:.3f}, head {rep.head / 1e12:.3f})")


def _cmd_convert(args):
    from . import convert as conv

    t0 = time.perf_counter()
    plan = conv.convert(args.kind, args.src, args.out, dtype=args.dtype, weights=args.weights, heads=args.heads,
                        progress=not args.quiet)
    seconds = time.perf_counter() - t0
    size = os.path.getsize(args.out)
    for note in plan.notes:
        print(note)
    print(f"wrote {args.out}: kind {args.kind}, {len(plan.tensors)} tensors, "
          f"{int(plan.metadata['num_params']):,} parameters as {args.dtype}, {size / 2**20:,.1f} MiB, "
          f"{seconds:.1f} s (source sha256 {plan.metadata['source_sha256'][:16]}...)")


def _convert_epilog():
    from .convert import KINDS

    lines = ["kinds and the official files they take:"]
    for kind, (_, files, what) in KINDS.items():
        lines.append(f"  {kind:<10} {files}")
        lines.append(f"  {'':<10}   {what}")
    lines += ["",
              "Reads PyTorch zip (and legacy) checkpoints without PyTorch through a restricted unpickler,",
              "checks every key and shape against the spec before writing, streams tensor by tensor,",
              "and records kind, hyper-parameters and the source SHA-256 in __metadata__.",
              "",
              "example:",
              "  python -m marcache convert mar pretrained_models/mar/mar_base/checkpoint-last.pth -o mar_base.safetensors",
              "  python -m marcache convert vae-kl16 pretrained_models/vae/kl16.ckpt -o kl16.safetensors"]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m marcache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from . import digits

    m = sub.add_parser("demo", help="the shipped digits MAR with every cache policy: a PNG and a table",
                       description="Generates digits of every class with the shipped MAR (trained on "
                                   "scikit-learn's digits) for NoCache and every cache policy at its default "
                                   "settings, prints seconds per image, speedup, class accuracy, digits-FID and "
                                   "pixel fidelity to NoCache, and writes a PNG with one panel per policy.")
    m.add_argument("--out", default="demo.png")
    m.add_argument("--per-class", type=int, default=10, help="digits of each class per policy")
    m.add_argument("--steps", type=int, default=digits.STEPS)
    m.add_argument("--cfg", type=float, default=digits.CFG)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--threads", type=int, default=0)
    m.set_defaults(func=_cmd_demo)

    g = sub.add_parser("generate", help="generate a PNG grid of class-conditional images")
    g.add_argument("--model", required=True, help="MAR .safetensors (converted official checkpoint)")
    g.add_argument("--vae", default=None, help="KL-16 VAE .safetensors (not for pixel-token models such as "
                                               "marcache/data/digits_mar.safetensors)")
    g.add_argument("--labels", type=int, nargs="*", default=[], help="ImageNet class indices (none: unconditional)")
    g.add_argument("--num-images", type=int, default=4, help="images for unconditional generation")
    g.add_argument("--steps", type=int, default=64)
    g.add_argument("--cfg", type=float, default=1.0)
    g.add_argument("--cfg-schedule", default="linear", choices=["linear", "constant"])
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--first-index", type=int, default=0)
    g.add_argument("--columns", type=int, default=None)
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    g.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="type of the MAR model's Linear weights (16-bit: autocast's arithmetic)")
    g.add_argument("--threads", type=int, default=0)
    g.add_argument("--quiet", action="store_true")
    g.add_argument("--out", default="grid.png")
    g.set_defaults(func=_cmd_generate)

    s = sub.add_parser("sample", help="generate an ADM sample batch (.npz, arr_0 uint8 NHWC) for FID")
    s.add_argument("--model", required=True, help="MAR .safetensors")
    s.add_argument("--vae", required=True, help="KL-16 VAE .safetensors")
    s.add_argument("--n", type=int, default=50000, help="number of images (50000 for paper numbers)")
    s.add_argument("--per-class", type=int, default=50, help="image i has class i // per_class")
    s.add_argument("--steps", type=int, default=64)
    s.add_argument("--cfg", type=float, default=1.0)
    s.add_argument("--cfg-schedule", default="linear", choices=["linear", "constant"])
    s.add_argument("--temperature", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--batch-size", type=int, default=16)
    s.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    s.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="type of the MAR model's Linear weights (16-bit: autocast's arithmetic)")
    s.add_argument("--threads", type=int, default=0)
    s.add_argument("--quiet", action="store_true")
    s.add_argument("--out", default="samples.npz")
    s.set_defaults(func=_cmd_sample)

    d = sub.add_parser("fid", help="FID and IS of a sample batch against reference statistics")
    d.add_argument("samples", help="sample batch .npz (arr_0 uint8 NHWC)")
    d.add_argument("reference", help="reference .npz: mu/sigma (adm_in256_stats.npz, ADM reference batch) or arr_0")
    d.add_argument("--inception", required=True, help="FID-Inception .safetensors (pytorch-fid key names)")
    d.add_argument("--batch-size", type=int, default=64)
    d.add_argument("--method", default="auto", choices=["auto", "sqrtm", "eigvals", "symmetric"],
                   help="Tr sqrt(S1 S2): sqrtm = ADM evaluator (SciPy), eigvals = torch-fidelity, "
                        "symmetric = NumPy; auto = sqrtm with SciPy, else symmetric")
    d.add_argument("--is-protocol", default="torch-fidelity", choices=["torch-fidelity", "adm"])
    d.add_argument("--splits", type=int, default=10)
    d.add_argument("--threads", type=int, default=0)
    d.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (the FID network)")
    d.add_argument("--quiet", action="store_true")
    d.set_defaults(func=_cmd_fid)

    r = sub.add_parser("reference", help="reference statistics (mu, sigma) of an image folder or .npz")
    r.add_argument("source", help="folder of images (PNG; others need Pillow) or .npz with arr_0")
    r.add_argument("out", help="output .npz (mu, sigma, n)")
    r.add_argument("--inception", required=True)
    r.add_argument("--batch-size", type=int, default=64)
    r.add_argument("--threads", type=int, default=0)
    r.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (the FID network)")
    r.add_argument("--quiet", action="store_true")
    r.set_defaults(func=_cmd_reference)

    i = sub.add_parser("info", help="build facts, or the config of a model file")
    i.add_argument("path", nargs="?")
    i.set_defaults(func=_cmd_info)

    f = sub.add_parser("flops", help="FLOPs of a run without running it")
    f.add_argument("model", choices=["mar_base", "mar_large", "mar_huge"])
    f.add_argument("--steps", type=int, default=64)
    f.add_argument("--cfg", type=float, default=1.0)
    f.set_defaults(func=_cmd_flops)

    c = sub.add_parser("convert", help="convert an official PyTorch checkpoint to safetensors (no PyTorch needed)",
                       description="Convert an official PyTorch checkpoint to a marcache safetensors file, "
                                   "without PyTorch.",
                       epilog=_convert_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("kind", choices=["mar", "vae-kl16", "var", "vqvae", "inception"], help="what the checkpoint holds")
    c.add_argument("src", help="the PyTorch checkpoint (.pth / .ckpt)")
    c.add_argument("-o", "--out", required=True, help="output .safetensors file")
    c.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"],
                   help="dtype of the floating-point tensors in the output (default fp32)")
    c.add_argument("--weights", default="model_ema", choices=["model_ema", "model"],
                   help="mar only: the EMA weights used for evaluation (default) or the raw weights")
    c.add_argument("--heads", type=int, default=None,
                   help="mar only: attention heads, for widths other than the released 768/1024/1280")
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    c.set_defaults(func=_cmd_convert)

    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    try:
        args.func(args)
    except (ValueError, KeyError, FileNotFoundError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted after {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

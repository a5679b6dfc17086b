"""Command line: python -m marcache {generate, info, flops, convert}."""
import argparse
import os
import sys
import time


def _cmd_generate(args):
    import marcache as mc
    from .png import grid, write_png

    model = mc.load(args.model, vae=args.vae, device=args.device, threads=args.threads)
    labels = args.labels if args.labels else None
    images, info = model.generate(labels=labels, num_images=None if labels else args.num_images, steps=args.steps,
                                  cfg=args.cfg, cfg_schedule=args.cfg_schedule, temperature=args.temperature,
                                  seed=args.seed, first_index=args.first_index, progress=not args.quiet,
                                  return_info=True)
    write_png(args.out, grid(images, columns=args.columns))
    print(f"wrote {args.out}: {len(images)} images, {info.seconds:.1f} s "
          f"({info.seconds / len(images):.2f} s/image, {info.flops / 1e12:.2f} TFLOPs)")


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

    g = sub.add_parser("generate", help="generate a PNG grid of class-conditional images")
    g.add_argument("--model", required=True, help="MAR .safetensors (converted official checkpoint)")
    g.add_argument("--vae", required=True, help="KL-16 VAE .safetensors")
    g.add_argument("--labels", type=int, nargs="*", default=[], help="ImageNet class indices (none: unconditional)")
    g.add_argument("--num-images", type=int, default=4, help="images for unconditional generation")
    g.add_argument("--steps", type=int, default=64)
    g.add_argument("--cfg", type=float, default=1.0)
    g.add_argument("--cfg-schedule", default="linear", choices=["linear", "constant"])
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--first-index", type=int, default=0)
    g.add_argument("--columns", type=int, default=None)
    g.add_argument("--device", default="cpu")
    g.add_argument("--threads", type=int, default=0)
    g.add_argument("--quiet", action="store_true")
    g.add_argument("--out", default="grid.png")
    g.set_defaults(func=_cmd_generate)

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

"""One timed run of the official MAR or LazyMAR code (issue 23's side-by-side benchmark).

Runs under a PyTorch virtual environment, never under marcache's (marcache has no
PyTorch at run time): bench_official.py starts it with the interpreter given by
--torch-python, once per timed run, and reads the last line it prints (JSON).

    python official_worker.py --code PATH --impl mar|lazymar --weights W.safetensors \
        --model mar_base --batch 1 --steps 64 --cfg 2.9 --threads 2

--code is a checkout of LTH14/mar (impl mar) or feihongyan1/LazyMAR (impl lazymar),
kept outside the repository. Its code is imported as it is; two things are set
from outside, neither of which changes what it computes:
- the official samplers call .cuda() on new tensors; on a machine without a GPU
  Tensor.cuda is made the identity, so every tensor stays on the CPU;
- the weights are the same random weights in the official layout that marcache
  loads (bench_official.py writes them), loaded with load_state_dict(strict=False);
  a parameter that is missing from the file is an error, only buffers may be.
The model is built and loaded before the clock starts: only sample_tokens is timed.
"""
import argparse
import json
import sys
import time
import types

# The head's configuration per model, as the official README trains them
# (--diffloss_d / --diffloss_w); marcache reads the same from the weights.
HEADS = {"mar_base": (6, 1024), "mar_large": (8, 1280), "mar_huge": (12, 1536)}


def build(args, torch):
    sys.path.insert(0, args.code)
    depth, width = HEADS[args.model]
    if args.impl == "mar":
        from models import mar as official
        model = getattr(official, args.model)(img_size=256, vae_stride=16, patch_size=1, vae_embed_dim=16,
                                              buffer_size=64, diffloss_d=depth, diffloss_w=width,
                                              num_sampling_steps="100")
    else:
        from models import mar_cache as official
        model = getattr(official, args.model)(img_size=256, vae_stride=16, patch_size=1, vae_embed_dim=16,
                                              buffer_size=64, diffloss_d=depth, diffloss_w=width,
                                              num_sampling_steps="100", lazy_mar=True)
    from safetensors.torch import load_file
    state = load_file(args.weights)
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = {name for name, _ in model.named_parameters()}
    missing_params = [k for k in missing if k in params]
    if missing_params or unexpected:
        raise SystemExit(f"official_worker: {args.weights} does not fit {args.impl} {args.model}: "
                         f"missing parameters {missing_params[:5]}, unexpected keys {unexpected[:5]}")
    return model.eval()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--code", required=True)
    parser.add_argument("--impl", choices=["mar", "lazymar"], required=True)
    parser.add_argument("--weights", required=True)
    parser.add_argument("--model", default="mar_base", choices=sorted(HEADS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--cfg", type=float, default=2.9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    torch.set_num_threads(args.threads)
    if not torch.cuda.is_available():
        torch.Tensor.cuda = lambda self, *a, **k: self
    torch.manual_seed(args.seed)
    model = build(args, torch)
    labels = torch.tensor([(207 + 31 * i) % 1000 for i in range(args.batch)], dtype=torch.long)
    kwargs = {}
    if args.impl == "lazymar":
        kwargs["args"] = types.SimpleNamespace(device="cpu", lazy_mar=True)
    with torch.no_grad():
        start = time.perf_counter()
        tokens = model.sample_tokens(bsz=args.batch, num_iter=args.steps, cfg=args.cfg, cfg_schedule="linear",
                                     labels=labels, temperature=1.0, **kwargs)
        seconds = time.perf_counter() - start
    if not torch.isfinite(tokens).all():
        raise SystemExit("official_worker: the official sampler returned non-finite tokens")
    print(json.dumps(dict(impl=args.impl, seconds=seconds, torch=torch.__version__,
                          cpu_capability=torch.backends.cpu.get_cpu_capability(), threads=torch.get_num_threads(),
                          tokens_shape=list(tokens.shape))))


if __name__ == "__main__":
    main()

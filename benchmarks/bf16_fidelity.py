"""What 16-bit Linear weights (marcache.load's dtype="bf16" / "fp16") do to MAR's output (issue 23).

Fidelity, not speed (bench_cpu.py --dtypes fp32 bf16 and bench_head.py time them):

the shipped digits MAR (a trained model: its activations have a real scale), `--n` digits
(class-major labels, the same seeds) with NoCache and LazyMAR in fp32, bf16 and fp16: class
accuracy of the shipped classifier, digits-FID against the training digits, and PSNR / mean
absolute difference of the images (the tokens, through the pixel decoder's affine map and
uint8 rounding) against fp32's of the same policy.

Random MAR-B weights are no test of this: their head's outputs grow to tokens of RMS ~3e4
(8 AR steps, measured), where bf16 differs from fp32 by 0.9% RMS and fp16 overflows to NaN,
which says nothing about real weights. Real MAR-B fidelity needs the official checkpoint.

    python benchmarks/bf16_fidelity.py                  # 500 digits per row
    python benchmarks/bf16_fidelity.py --n 100
"""
import argparse
import time

import numpy as np

import marcache as mc
from marcache import digits
from marcache.demo import _psnr

from _common import print_table, write_json

DTYPES = ("fp32", "bf16", "fp16")


def digits_rows(n, batch, threads):
    classifier = digits.Classifier.load()
    data = digits.load_data()
    train_features = classifier.features(data["images"][data["train"]])
    labels = digits.class_labels(max(n // 10, 1))
    models = {dtype: mc.load(digits.MODEL_PATH, dtype=dtype, threads=threads) for dtype in DTYPES}
    rows = []
    for name in ("NoCache", "LazyMAR"):
        images = {}
        for dtype in DTYPES:
            t0 = time.perf_counter()
            images[dtype] = np.concatenate([
                models[dtype].generate(labels=labels[i:i + batch], steps=digits.STEPS, cfg=digits.CFG,
                                       temperature=digits.TEMPERATURE, seed=0, first_index=i,
                                       cache=getattr(mc, name)())
                for i in range(0, len(labels), batch)])
            ref = images["fp32"][..., 0].astype(np.float64)
            rows.append(dict(policy=name, dtype=dtype, n=len(labels),
                             accuracy=classifier.accuracy(images[dtype], labels),
                             fid=digits.fid(classifier.features(images[dtype]), train_features),
                             psnr=_psnr(images[dtype][..., 0], images["fp32"][..., 0]),
                             mean_abs_diff=float(np.abs(images[dtype][..., 0].astype(np.float64) - ref).mean()),
                             seconds=time.perf_counter() - t0))
            print(f"digits {name} {dtype}: accuracy {rows[-1]['accuracy']:.3f}, FID {rows[-1]['fid']:.2f}",
                  flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=500, help="digits per (policy, dtype), rounded down to 10 per class")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    rows = digits_rows(args.n, args.batch, args.threads)
    print(f"\nThe shipped digits MAR, {rows[0]['n']} digits, {digits.STEPS} steps, cfg {digits.CFG}, batch {args.batch}; "
          "PSNR and mean |difference| (uint8 levels) against fp32's images of the same policy")
    print_table(["policy", "weights", "class accuracy", "digits-FID", "PSNR vs fp32 (dB)", "mean |diff| vs fp32"],
                [[r["policy"], r["dtype"], f"{100 * r['accuracy']:.1f}%", f"{r['fid']:.2f}",
                  "identical" if r["psnr"] == float("inf") else f"{r['psnr']:.1f}", f"{r['mean_abs_diff']:.2f}"]
                 for r in rows])
    write_json(args.json, digits=rows, threads=args.threads)


if __name__ == "__main__":
    main()

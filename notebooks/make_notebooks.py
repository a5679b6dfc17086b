"""Writes notebooks/quickstart.ipynb and notebooks/fid_sweep.ipynb (no outputs, nbformat 4.5
cell ids). Edit the cells here and rerun (python notebooks/make_notebooks.py), so the committed
notebooks stay output-free; tests/test_notebooks.py executes them."""
import os

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
          "language_info": {"name": "python"}}


def notebook(cells, name):
    nb = new_notebook(cells=cells, metadata=KERNEL)
    for i, c in enumerate(nb.cells):
        c.id = f"{name}-{i:02d}"  # stable ids: diffs stay small when a cell changes
    nbformat.validate(nb)
    nbformat.write(nb, f"{root}/notebooks/{name}.ipynb")


md, code = new_markdown_cell, new_code_cell

quickstart = [
    md("# marcache quick start\n\n"
       "Runs on the installed package alone (`pip install \"marcache[plot]\"`), on the small MAR that ships with it:\n"
       "trained on scikit-learn's handwritten digits (16x16 pixels, 64 tokens of 2x2 pixels, 10 classes), with a\n"
       "classifier that scores what it generates. The same calls work on the official MAR-B/L/H weights once converted\n"
       "(`marcache.load(\"mar_base.safetensors\", vae=\"kl16.safetensors\")`, see the README)."),
    code("import numpy as np\n"
         "import matplotlib.pyplot as plt\n"
         "import marcache as mc\n"
         "from marcache import digits\n"
         "\n"
         "model = digits.load_model()            # an ordinary MARModel; its pixel decoder needs no VAE\n"
         "classifier = digits.Classifier.load()\n"
         "model"),
    md("## Generate\n\nOne call generates a batch; `return_info=True` adds the per-step telemetry."),
    code("labels = digits.class_labels(1)        # 0 1 2 ... 9\n"
         "images, info = model.generate(labels=labels, steps=digits.STEPS, cfg=digits.CFG, seed=0, return_info=True)\n"
         "print(images.shape, images.dtype, f\"{info.seconds:.2f} s, {info.flops / 1e9:.2f} GFLOPs\")\n"
         "print(\"classifier agrees with the requested class:\", classifier.accuracy(images, labels))\n"
         "info.steps[0]"),
    md("## Cache policies side by side\n\n"
       "Same labels and seeds for every policy: the images differ only by what the cache skips.\n"
       "`python -m marcache caches` lists every policy's fields and defaults."),
    code("policies = {\"NoCache\": mc.NoCache(), \"LazyMAR\": mc.LazyMAR(), \"MARche\": mc.MARche()}\n"
         "runs = {}\n"
         "for name, cache in policies.items():\n"
         "    imgs, run_info = model.generate(labels=labels, steps=digits.STEPS, cfg=digits.CFG, seed=0, cache=cache,\n"
         "                                    return_info=True)\n"
         "    runs[name] = (imgs, run_info)\n"
         "    print(f\"{name:8s} {run_info.seconds:6.2f} s  {run_info.flops / 1e9:6.2f} GFLOPs  \"\n"
         "          f\"class accuracy {classifier.accuracy(imgs, labels):.2f}  \"\n"
         "          f\"full steps {sum(s['full'] for s in run_info.steps)}/{len(run_info.steps)}\")"),
    md("## Per-step telemetry\n\n"
       "Each AR step reports its FLOPs (exact, as `marcache.flops` counts them) and its seconds. Cached steps are\n"
       "the dips; seconds are wall-clock on whatever machine runs this notebook, so they are noisy under load."),
    code("fig, (ax_flops, ax_sec) = plt.subplots(1, 2, figsize=(11, 3.5))\n"
         "for name, (_, run_info) in runs.items():\n"
         "    steps = [s[\"step\"] for s in run_info.steps]\n"
         "    ax_flops.plot(steps, [s[\"flops\"] / 1e6 for s in run_info.steps], marker=\"o\", label=name)\n"
         "    ax_sec.plot(steps, [1e3 * s[\"seconds\"] for s in run_info.steps], marker=\"o\", label=name)\n"
         "ax_flops.set(xlabel=\"AR step\", ylabel=\"MFLOPs (batch of 10)\", title=\"FLOPs per step\")\n"
         "ax_sec.set(xlabel=\"AR step\", ylabel=\"ms\", title=\"seconds per step\")\n"
         "ax_flops.legend()\n"
         "fig.tight_layout()"),
    md("## The images\n\nOne panel per policy, one row per class."),
    code("fig, axes = plt.subplots(1, len(runs), figsize=(2 * len(runs), 7))\n"
         "for ax, (name, (imgs, run_info)) in zip(axes, runs.items()):\n"
         "    rows = imgs[..., 0].reshape(160, 16)\n"
         "    ax.imshow(rows, cmap=\"gray\", vmin=0, vmax=255)\n"
         "    ax.set_title(f\"{name}\\n{run_info.seconds / len(imgs):.3f} s/image\")\n"
         "    ax.set_yticks(np.arange(10) * 16 + 8, [str(c) for c in range(10)])\n"
         "    ax.set_xticks([])\n"
         "axes[0].set_ylabel(\"class\")\n"
         "fig.tight_layout()"),
    md("## FLOPs without running\n\n`marcache.flops` counts a run from the configuration alone; it equals the telemetry's sum."),
    code("for name, (_, run_info) in runs.items():\n"
         "    counted = mc.flops(model, steps=digits.STEPS, cfg=digits.CFG, cache=policies[name], batch=len(labels))\n"
         "    assert counted.total == run_info.flops, (name, counted.total, run_info.flops)\n"
         "    print(f\"{name:8s} {counted.total / 1e9:.3f} GFLOPs counted, {run_info.flops / 1e9:.3f} measured\")\n"
         "r = mc.flops(\"mar_base\", steps=64, cfg=2.9)\n"
         "print(f\"MAR-B, 64 steps, CFG: {r.total / 1e12:.2f} TFLOPs per image\")"),
]

fid_sweep = [
    md("# Quality against speed: `marcache.eval.sweep`\n\n"
       "`sweep(model, network, configs, n, per_class, reference)` generates `n` images per cache configuration with\n"
       "MAR's class-major labels (image *i* is the same image of the seed's sequence in every configuration), streams\n"
       "them through a feature network and returns FID, Inception Score, seconds and FLOPs per image.\n\n"
       "Here it runs on the shipped digits model with the digits classifier as the feature network\n"
       "(`digits.ClassifierFeatures`: the *digits-FID* against the 1,500 training digits), so it needs no weights.\n"
       "With real weights pass `marcache.eval.InceptionV3.load(...)` and `load_reference(\"adm_in256_stats.npz\")`.\n"
       "FID from 20 images is a rough number (it grows as the sample shrinks); compare rows of the same size."),
    code("import matplotlib.pyplot as plt\n"
         "import marcache as mc\n"
         "from marcache import digits\n"
         "from marcache.eval import format_table, sweep\n"
         "\n"
         "model = digits.load_model()\n"
         "network = digits.ClassifierFeatures()\n"
         "reference = digits.reference_stats()\n"
         "N, PER_CLASS = 20, 2"),
    code("configs = {\n"
         "    \"NoCache\": mc.NoCache(),\n"
         "    \"LazyMAR\": mc.LazyMAR(),\n"
         "    \"MARche + caches\": mc.MARche(encoder_cache=True, cond_cache=True, head_cache=True),\n"
         "}\n"
         "results = sweep(model, network, configs, n=N, per_class=PER_CLASS, reference=reference,\n"
         "                steps=digits.STEPS, cfg=digits.CFG, batch_size=20)\n"
         "print(format_table(results))"),
    md("FLOPs are exact and machine-independent; seconds are wall-clock on this machine (noisy when it is shared)."),
    code("baseline = results[0]\n"
         "fig, (ax_flops, ax_sec) = plt.subplots(1, 2, figsize=(11, 4))\n"
         "for r in results:\n"
         "    ax_flops.scatter(baseline.flops_per_image / r.flops_per_image, r.fid)\n"
         "    ax_flops.annotate(r.name, (baseline.flops_per_image / r.flops_per_image, r.fid))\n"
         "    ax_sec.scatter(baseline.seconds_per_image / r.seconds_per_image, r.fid)\n"
         "    ax_sec.annotate(r.name, (baseline.seconds_per_image / r.seconds_per_image, r.fid))\n"
         "ax_flops.set(xlabel=\"FLOP reduction vs NoCache (x)\", ylabel=f\"digits-FID ({N} images)\")\n"
         "ax_sec.set(xlabel=\"wall-clock speed-up vs NoCache (x)\", ylabel=f\"digits-FID ({N} images)\")\n"
         "fig.tight_layout()"),
]

notebook(quickstart, "quickstart")
notebook(fid_sweep, "fid_sweep")

"""``python -m marcache demo``: the shipped digits MAR with every cache policy, and the shipped
digits VAR, side by side.

Generates ``per_class`` digits of every class with each policy (the same labels and seeds),
prints a table (seconds per image, speedup over NoCache, class accuracy of the shipped
classifier, digits-FID against the training digits, pixel fidelity to NoCache) and writes
one PNG with a panel per policy (left to right in table order, titled with the policy and its
seconds per image; one row per class 0..9, labelled on the left).
"""
import time

import numpy as np

from . import digits
from .caches import LazyMAR, MARche, NoCache
from .png import grid, write_png


def default_policies():
    """Every cache policy marcache has, at its default settings."""
    return [("NoCache", NoCache()), ("LazyMAR", LazyMAR()), ("MARche", MARche())]


def frontier_policies():
    """The grid of ``demo --frontier``: NoCache, each cache policy at its defaults, DiSA
    (50 -> 5 linear, official clip) alone and composed with each of them."""
    from .policies import DiSA

    return [("NoCache", NoCache()), ("LazyMAR", LazyMAR()), ("MARche", MARche()), ("DiSA", DiSA()),
            ("LazyMAR+DiSA", DiSA(inner=LazyMAR())), ("MARche+DiSA", DiSA(inner=MARche(head_cache=True)))]


def run_frontier(out="frontier.png", per_class=10, steps=digits.STEPS, cfg=digits.CFG, seed=0, threads=0,
                 batch_size=8, policies=None, quiet=False):
    """``demo --frontier``: marcache.eval.frontier of `policies` (default frontier_policies())
    on the digits model; prints the table and writes the plot to `out` (skipped, with a
    note, when matplotlib is not installed). Returns the Frontier."""
    from . import eval as _eval

    say = (lambda *a: None) if quiet else print  # noqa: E731
    model = digits.load_model(threads=threads)
    classifier = digits.Classifier.load()
    policies = policies or frontier_policies()
    n = 10 * per_class
    say(f"marcache demo --frontier: {model!r}; {n} digits per policy ({per_class} per class), {steps} AR steps, "
        f"cfg {cfg}, seed {seed}, batch {batch_size} (policies alternate batch by batch)")
    result = _eval.frontier(model, classifier, dict(policies), n, per_class=per_class, seed=seed,
                            batch_size=batch_size, steps=steps, cfg=cfg)
    print(result.table())
    say("* = on the speed-quality Pareto set (digits-FID against the training digits); speed-up and FLOP ratio "
        "against the first row")
    if out:
        try:
            _eval.plot_frontier(result, out, title=f"digits MAR, {n} digits, {steps} steps, cfg {cfg}")
            say(f"wrote {out}")
        except ImportError as exc:
            say(f"no plot: {exc}")
    return result


def _psnr(a, b):
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(255.0 ** 2 / mse)


def evaluate_policies(model, classifier, labels, policies, steps=digits.STEPS, cfg=digits.CFG,
                      temperature=digits.TEMPERATURE, seed=0, train_features=None, progress=None):
    """Generates `labels` with each (name, policy); returns one dict per policy with the
    images and: seconds, seconds_per_image, speedup (vs the first policy), accuracy,
    fid (vs train_features when given), psnr and mean_abs_diff (uint8 levels, vs the
    first policy's images)."""
    rows = []
    for name, policy in policies:
        t0 = time.perf_counter()
        images = model.generate(labels=labels, steps=steps, cfg=cfg, temperature=temperature, seed=seed,
                                cache=policy)
        seconds = time.perf_counter() - t0
        row = dict(policy=name, cache=policy, images=images, seconds=seconds, seconds_per_image=seconds / len(labels),
                   accuracy=classifier.accuracy(images, labels))
        if train_features is not None:
            row["fid"] = digits.fid(classifier.features(images), train_features)
        first = rows[0] if rows else row
        row["speedup"] = first["seconds"] / seconds
        diff = images[..., 0].astype(np.float64) - first["images"][..., 0].astype(np.float64)
        row["mean_abs_diff"] = float(np.abs(diff).mean())
        row["psnr"] = _psnr(images[..., 0], first["images"][..., 0])
        rows.append(row)
        if progress is not None:
            progress(row)
    return rows


def evaluate_var(model, classifier, labels, seed=0, train_features=None, first=None):
    """The digits VAR on `labels` at its settings (digits.VAR_*): one row as
    evaluate_policies gives (speedup against `first`, a MAR row; no pixel comparison: it
    is another model)."""
    t0 = time.perf_counter()
    images = model.generate(labels=labels, cfg=digits.VAR_CFG, top_k=digits.VAR_TOP_K, top_p=digits.VAR_TOP_P,
                            seed=seed)
    seconds = time.perf_counter() - t0
    row = dict(policy="VAR", cache=None, images=images, seconds=seconds, seconds_per_image=seconds / len(labels),
               accuracy=classifier.accuracy(images, labels), psnr=None, mean_abs_diff=None)
    if train_features is not None:
        row["fid"] = digits.fid(classifier.features(images), train_features)
    row["speedup"] = first["seconds"] / seconds if first is not None else 1.0
    return row


def format_table(rows, reference=None):
    head = (f"{'policy':<10} {'s/image':>8} {'speedup':>8} {'class acc':>10} {'digits-FID':>11} "
            f"{'PSNR vs NoCache':>16} {'mean |diff|':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["psnr"] is None:  # another model (the VAR): no pixel comparison with NoCache
            psnr, diff = "-", "-"
        else:
            psnr = "identical" if r["psnr"] == float("inf") else f"{r['psnr']:.1f} dB"
            diff = f"{r['mean_abs_diff']:.2f}"
        lines.append(f"{r['policy']:<10} {r['seconds_per_image']:>8.3f} {r['speedup']:>7.2f}x "
                     f"{100 * r['accuracy']:>9.1f}% {r.get('fid', float('nan')):>11.2f} {psnr:>16} "
                     f"{diff:>12}")
    if reference is not None:
        lines.append(f"{reference['policy']:<10} {'':>8} {'':>8} {100 * reference['accuracy']:>9.1f}% "
                     f"{reference['fid']:>11.2f}")
    return "\n".join(lines)


# A 3x5 pixel font (capitals, digits, a little punctuation) so that the demo picture can
# label its panels and rows with the pure-NumPy PNG writer, without Pillow or matplotlib.
_FONT = {
    "A": ".x.x.xxxxx.xx.x", "B": "xx.x.xxx.x.xxx.", "C": ".xxx..x..x...xx", "D": "xx.x.xx.xx.xxx.",
    "E": "xxxx..xx.x..xxx", "F": "xxxx..xx.x..x..", "G": ".xxx..x.xx.x.xx", "H": "x.xx.xxxxx.xx.x",
    "I": "xxx.x..x..x.xxx", "J": "..x..x..xx.x.x.", "K": "x.xx.xxx.x.xx.x", "L": "x..x..x..x..xxx",
    "M": "x.xxxxxxxx.xx.x", "N": "xx.x.xx.xx.xx.x", "O": ".x.x.xx.xx.x.x.", "P": "xx.x.xxx.x..x..",
    "Q": ".x.x.xx.xxxx.xx", "R": "xx.x.xxx.x.xx.x", "S": ".xxx...x...xxx.", "T": "xxx.x..x..x..x.",
    "U": "x.xx.xx.xx.xxxx", "V": "x.xx.xx.xx.x.x.", "W": "x.xx.xxxxxxxx.x", "X": "x.xx.x.x.x.xx.x",
    "Y": "x.xx.x.x..x..x.", "Z": "xxx..x.x.x..xxx",
    "0": "xxxx.xx.xx.xxxx", "1": ".x.xx..x..x.xxx", "2": "xx...x.x.x..xxx", "3": "xx...x.x...xxx.",
    "4": "x.xx.xxxx..x..x", "5": "xxxx..xx...xxx.", "6": ".xxx..xxxx.xxxx", "7": "xxx..x.x..x..x.",
    "8": "xxxx.xxxxx.xxxx", "9": "xxxx.xxxx..xxx.",
    ".": "............x..", "/": "..x..x.x.x..x..", "-": "......xxx......", ":": "....x.....x....",
    "+": "....x.xxx.x....", " ": "...............",
}


def text_image(text, scale=2):
    """uint8 [5*scale, 4*scale*len(text)] mask (1 = ink) of `text` in capitals."""
    glyphs = []
    for ch in text.upper():
        bits = _FONT.get(ch, _FONT[" "])
        glyph = np.array([c == "x" for c in bits], np.uint8).reshape(5, 3)
        glyphs.append(np.concatenate([glyph, np.zeros((5, 1), np.uint8)], axis=1))  # 1 column of spacing
    mask = np.concatenate(glyphs, axis=1) if glyphs else np.zeros((5, 0), np.uint8)
    return np.repeat(np.repeat(mask, scale, axis=0), scale, axis=1)


def _draw(canvas, text, top, left, width, scale=2):
    """Draws `text` centred in [left, left + width) at row `top`, shrinking to scale 1 if it
    does not fit (narrow panels at --per-class 1 or 2)."""
    mask = text_image(text, scale)
    if mask.shape[1] > width and scale > 1:
        mask = text_image(text, 1)
    mask = mask[:, :width]
    x = left + (width - mask.shape[1]) // 2
    region = canvas[top:top + mask.shape[0], x:x + mask.shape[1]]
    region[mask.astype(bool)] = 0


def panels(rows, per_class, scale=3, gap=12, labels=True):
    """One grid per policy (a row per class), side by side, on white. With labels: a title
    band above each panel (policy, seconds per image) and the class of each row on the left."""
    tiles = []
    for r in rows:
        big = np.repeat(np.repeat(r["images"], scale, axis=1), scale, axis=2)
        tiles.append(grid(big, columns=per_class, pad=2))
    height = max(t.shape[0] for t in tiles)
    out = []
    for i, t in enumerate(tiles):
        if i:
            out.append(np.full((height, gap, 3), 255, np.uint8))
        pad = np.full((height - t.shape[0], t.shape[1], 3), 255, np.uint8)
        out.append(np.concatenate([t, pad], axis=0))
    body = np.concatenate(out, axis=1)
    if not labels:
        return body
    tile = rows[0]["images"].shape[1] * scale  # one digit's side in pixels
    margin, band = 14, 2 * (5 * 2 + 4) + 4     # row-label column; two lines of scale-2 text
    canvas = np.full((band + body.shape[0], margin + body.shape[1], 3), 255, np.uint8)
    canvas[band:, margin:] = body
    left = margin
    for r, t in zip(rows, tiles):
        _draw(canvas, r["policy"], 2, left, t.shape[1])
        _draw(canvas, f"{r['seconds_per_image']:.3f} s/image", 2 + 14, left, t.shape[1])
        left += t.shape[1] + gap
    for c in range(tiles[0].shape[0] // (tile + 2)):
        _draw(canvas, str(c), band + 2 + c * (tile + 2) + (tile - 10) // 2, 0, margin)
    return canvas


def run(out="demo.png", per_class=10, steps=digits.STEPS, cfg=digits.CFG, seed=0, threads=0, quiet=False,
        policies=None, var=True):
    """The demo; returns (rows, reference). Prints as it goes unless quiet. With var, the
    shipped digits VAR runs after the MAR policies on the same labels and seed (its own
    settings: cfg 1.5, top_k 900, top_p 0.96) and adds a row and a panel."""
    say = (lambda *a: None) if quiet else print  # noqa: E731
    t_start = time.perf_counter()
    model = digits.load_model(threads=threads)
    classifier = digits.Classifier.load()
    data = digits.load_data()
    train_features = classifier.features(data["images"][data["train"]])
    held = data["held_out"]
    reference = dict(policy="real", accuracy=classifier.accuracy(data["images"][held], data["labels"][held]),
                     fid=digits.fid(classifier.features(data["images"][held]), train_features))
    labels = digits.class_labels(per_class)
    say(f"marcache demo: {model!r}")
    say(f"{len(labels)} digits per policy ({per_class} per class), {steps} AR steps, cfg {cfg} (linear), "
        f"seed {seed}")
    rows = evaluate_policies(model, classifier, labels, policies or default_policies(), steps=steps, cfg=cfg,
                             seed=seed, train_features=train_features,
                             progress=lambda r: say(f"  {r['policy']}: {r['seconds']:.1f} s"))
    if var:
        var_model = digits.load_var(threads=threads)
        say(f"and the digits VAR: {var_model!r}, cfg {digits.VAR_CFG}, top_k {digits.VAR_TOP_K}, "
            f"top_p {digits.VAR_TOP_P}")
        rows.append(evaluate_var(var_model, classifier, labels, seed=seed, train_features=train_features,
                                 first=rows[0]))
        say(f"  VAR: {rows[-1]['seconds']:.1f} s")
    say("")
    say(format_table(rows, reference))
    say(f"digits-FID: 64-d features of the shipped classifier, {len(labels)} generated digits (or the "
        f"{len(held)} held-out real digits, last row) against the {len(data['train'])} training digits; "
        f"class acc: the classifier's agreement with the requested label.")
    if out:
        write_png(out, panels(rows, per_class))
        say(f"wrote {out}: panels left to right {', '.join(r['policy'] for r in rows)} (titled with s/image); "
            f"one row per class 0-9 (labelled on the left)")
    say(f"total {time.perf_counter() - t_start:.1f} s")
    return rows, reference

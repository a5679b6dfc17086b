"""The shipped digits demo: a small MAR trained on scikit-learn's handwritten digits,
the digits themselves, and a classifier that scores generated digits.

    import marcache as mc
    model = mc.digits.load_model()                 # MAR, 64 tokens of 2x2 pixels, 10 classes
    images = model.generate(labels=[0, 1, 2], steps=16, cfg=mc.digits.CFG, seed=0)
    clf = mc.digits.Classifier.load()
    clf.predict(images), clf.features(images)      # class, 64-d features (digits-FID)

All three files were written by ``tools/train_digits.py`` (PyTorch, a development tool);
here they are read with NumPy and the engine only. The data are the UCI optdigits test
set as scikit-learn ships it (1,797 images 8x8, CC BY 4.0), upsampled to 16x16.
"""
import os

import numpy as np

from . import _C

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
MODEL_PATH = os.path.join(DATA_DIR, "digits_mar.safetensors")
CLASSIFIER_PATH = os.path.join(DATA_DIR, "digits_classifier.safetensors")
DATA_PATH = os.path.join(DATA_DIR, "digits.safetensors")
VAR_PATH = os.path.join(DATA_DIR, "digits_var.safetensors")
VQVAE_PATH = os.path.join(DATA_DIR, "digits_vqvae.safetensors")

# Sampling settings the demo and tests use (chosen on the training split's statistics,
# see tools/train_digits.py): 64 tokens in 16 AR steps is MAR-B's 4 tokens per step.
STEPS = 16
CFG = 2.0
TEMPERATURE = 1.0
# The digits VAR samples with VAR's FID recipe (the VARModel.generate defaults).
VAR_CFG = 1.5
VAR_TOP_K = 900
VAR_TOP_P = 0.96


def _read(path, what):
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} file not found: {path} (the package was installed without its data "
                                f"files; reinstall marcache, or run tools/train_digits.py)")
    arrays, _ = _C.safetensors_read(path)
    return arrays


def load_model(threads=0, device="cpu"):
    """The shipped digits MAR (a pixel-token model: decodes without a VAE)."""
    from .model import load

    return load(MODEL_PATH, device=device, threads=threads)


def load_var(threads=0, device="cpu"):
    """The shipped digits VAR (depth 6, patch_nums 1,2,3,4,6,8) with its VQVAE (ch 32, vocab
    256, an 8x8 latent for the 16x16 digits), both in the official key layouts
    (tools/train_digits.py var)."""
    from .model import load

    for path, what in ((VAR_PATH, "digits VAR"), (VQVAE_PATH, "digits VQVAE")):
        if not os.path.exists(path):
            raise FileNotFoundError(f"{what} file not found: {path} (the package was installed without its data "
                                    f"files; reinstall marcache, or run tools/train_digits.py var)")
    return load(VAR_PATH, vae=VQVAE_PATH, device=device, threads=threads)


def load_data():
    """The digits: dict with images uint8 [1797, 16, 16], labels int32 [1797] and the
    index arrays train (1,500) and held_out (297) of the split the MAR and the
    classifier were trained on (held_out was seen by neither)."""
    d = _read(DATA_PATH, "digits data")  # integers stored as F16 (exact), read as float32
    return {"images": d["images"].astype(np.uint8), "labels": d["labels"].astype(np.int32),
            "train": d["train"].astype(np.int64), "held_out": d["held_out"].astype(np.int64)}


def _as_pixels(images):
    """uint8 [N, 16, 16], [N, 16, 16, 1] or [N, 16, 16, 3] (channel 0 is used) or float in
    [-1, 1] of those shapes -> float64 [N, 256] in [-1, 1]."""
    x = np.asarray(images)
    if x.ndim == 4:
        x = x[..., 0]
    if x.ndim != 3 or x.shape[1:] != (16, 16):
        raise ValueError(f"digit images must be [N, 16, 16] or [N, 16, 16, C], got shape {np.shape(images)}")
    x = x.astype(np.float64) / 127.5 - 1.0 if x.dtype == np.uint8 else x.astype(np.float64)
    return x.reshape(x.shape[0], 256)


class Classifier:
    """MLP 256 -> 128 -> 64 -> 10 with ReLU, in float64 NumPy. Its 64-d penultimate
    activations are the features of the digits-FID."""

    def __init__(self, weights):
        self.w = {k: np.asarray(v, np.float64) for k, v in weights.items()}

    @classmethod
    def load(cls, path=CLASSIFIER_PATH):
        return cls(_read(path, "digits classifier"))

    def features(self, images):
        h = np.maximum(_as_pixels(images) @ self.w["fc1.weight"].T + self.w["fc1.bias"], 0.0)
        return np.maximum(h @ self.w["fc2.weight"].T + self.w["fc2.bias"], 0.0)

    def logits(self, images):
        return self.features(images) @ self.w["fc3.weight"].T + self.w["fc3.bias"]

    def predict(self, images):
        return np.argmax(self.logits(images), axis=1)

    def accuracy(self, images, labels):
        return float(np.mean(self.predict(images) == np.asarray(labels)))


def fid(features_a, features_b):
    """Frechet distance of two feature sets (the digits-FID on Classifier.features)."""
    from .eval import Stats, fid as _fid

    return float(_fid(Stats.from_features(features_a), Stats.from_features(features_b), method="symmetric"))


def class_labels(per_class):
    """0..9 each repeated per_class times, class-major."""
    return np.repeat(np.arange(10, dtype=np.int32), int(per_class))


def sample_stats(batches, classifier=None):
    """(Stats of the classifier's 64-d features, logits float64 [N, 10]) of digit images given
    as an iterable of uint8 batches [n, 16, 16, C] (e.g. eval.iter_npz_images of a sample file):
    the sample side of the digits-FID and of its Inception Score."""
    from .eval import Stats

    classifier = classifier or Classifier.load()
    stats, logits = Stats(64), []
    for batch in batches:
        features = classifier.features(batch)
        stats.update(features)
        logits.append(features @ classifier.w["fc3.weight"].T + classifier.w["fc3.bias"])
    if not logits:
        raise ValueError("no images to score")
    return stats, np.concatenate(logits)


def reference_stats(classifier=None):
    """Stats of the classifier's features of the 1,500 training digits: the reference side of
    the digits-FID (the demo's and ``python -m marcache fid SAMPLES digits``)."""
    from .eval import Stats

    classifier = classifier or Classifier.load()
    data = load_data()
    return Stats.from_features(classifier.features(data["images"][data["train"]]))


class ClassifierFeatures:
    """The digits classifier with the interface `marcache.eval.sweep` expects of its
    feature network (``feature_dim``; ``features(images, batch_size)`` -> (features,
    logits)), so the sweep API runs on the digits model without Inception weights:
    ``sweep(model, ClassifierFeatures(), configs, n, per_class, reference_stats())``
    reports the digits-FID and the classifier's Inception Score."""

    feature_dim = 64

    def __init__(self, classifier=None):
        self.classifier = classifier or Classifier.load()

    def features(self, images, batch_size=None):
        del batch_size  # the classifier is a small NumPy MLP: every image at once
        features = self.classifier.features(images)
        return features, features @ self.classifier.w["fc3.weight"].T + self.classifier.w["fc3.bias"]

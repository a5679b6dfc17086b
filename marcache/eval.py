"""FID and Inception Score without PyTorch, compatible with the OpenAI ADM
evaluator (guided-diffusion ``evaluations/evaluator.py``) and with MAR's
torch-fidelity protocol (spec: ``eval_and_formats.md`` sections 1-7).

Pieces:

- :class:`InceptionV3`: the FID-Inception network (the TF 2015-12-05 graph as
  ported by pytorch-fid / torch-fidelity) in C. Any uint8 image size goes in;
  it is resized to 299 x 299 with TF1 bilinear semantics and scaled by
  (x - 128) / 128 inside, as the TF graph and torch-fidelity do.
- :class:`Stats`: float64 mean and covariance accumulated incrementally
  (batches are merged with Chan's pairwise update, so 50,000 features never
  sit in memory and shards merge exactly).
- :func:`fid`: ``||mu1 - mu2||^2 + Tr S1 + Tr S2 - 2 Tr sqrtm(S1 S2)`` with the
  ADM evaluator's numerics (``scipy.linalg.sqrtm(disp=False)``, the 1e-6
  diagonal retry, the 1e-3 imaginary-part check). SciPy is optional
  (``pip install marcache[eval]``); without it a NumPy form is used (see
  :func:`fid`).
- :func:`inception_score`: torch-fidelity's protocol (MAR's published
  numbers) or ADM's.
- :func:`load_reference`, :func:`save_samples`, :func:`make_reference`: the ADM
  ``.npz`` formats (``arr_0`` uint8 NHWC samples; ``mu``/``sigma`` reference
  statistics, MAR's ``adm_in256_stats.npz`` included).
- :func:`sweep`: generate N images per cache configuration (of a MAR or a VAR
  model) with the class-major label protocol, stream them into :class:`Stats`,
  and return FID, IS and telemetry; for pytest sweeps over cache settings.

sFID (spatial features) and precision/recall of the ADM suite are not
computed.
"""
import math
import os
import time
import warnings
import zipfile
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from . import _C
from ._progress import Progress

DEFAULT_BATCH = 64  # torch-fidelity's and ADM's feature batch size


# --------------------------------------------------------------------------
# the network
# --------------------------------------------------------------------------

def _as_images(images):
    arr = np.asarray(images)
    if arr.ndim == 3:
        arr = arr[None]
    if arr.dtype != np.uint8:
        raise ValueError(f"images must be uint8 [N, H, W, 3] (RGB, 0..255), got dtype {arr.dtype}; "
                         "the FID protocols quantise to uint8 before the network")
    if arr.ndim != 4 or arr.shape[3] != 3:
        raise ValueError(f"images must have shape [N, H, W, 3], got {arr.shape}")
    return np.ascontiguousarray(arr)


class InceptionV3:
    """The FID-Inception network on marcache's C backend.

    Load it with :meth:`load` from a safetensors file holding
    ``pt_inception-2015-12-05-6726825d.pth`` converted with its pytorch-fid key
    names (``python -m marcache convert``, a separate issue). Outputs are the
    2048-d pool features (FID) and the 1008 unbiased logits (IS).
    """

    def __init__(self, net, path=None):
        self._net = net
        self.path = path

    @classmethod
    def load(cls, path, threads=0, chunk=8, device="cpu"):
        """path: safetensors file. threads: OpenMP threads (0 = all).
        chunk: images per forward pass inside C (about 13 MB of activations per image).
        device: "cpu", "auto" or "cuda[:N]", as marcache.load."""
        from .model import _resolve_device

        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"Inception weights not found: {path}")
        device = _resolve_device(device)
        return cls(_C.Inception(path, num_threads=int(threads), chunk=int(chunk), device=device), path)

    feature_dim = property(lambda self: self._net.feature_dim)
    num_classes = property(lambda self: self._net.num_classes)
    num_params = property(lambda self: self._net.num_params)
    flops_per_image = property(lambda self: self._net.flops_per_image,
                               doc="FLOPs of one image (convolutions + fc, 2 per multiply-add)")
    standard = property(lambda self: self._net.standard,
                        doc="True when every width is the real network's (not a test network)")

    def __repr__(self):
        return (f"InceptionV3(features={self.feature_dim}, classes={self.num_classes}, "
                f"params={self.num_params:,}, standard={self.standard}, path={self.path!r})")

    def iter_features(self, images, batch_size=DEFAULT_BATCH, progress=False, total=None):
        """Yields (pool float32 [b, 2048], logits_unbiased float32 [b, 1008]) per batch.

        images: a uint8 array [N, H, W, 3] (a memory map works), or an iterable
        of such batches (e.g. :func:`iter_npz_images`)."""
        if isinstance(images, np.ndarray) or hasattr(images, "__array__"):
            arr = np.asarray(images)
            if arr.ndim == 3:
                arr = arr[None]
            batches = (arr[i:i + batch_size] for i in range(0, len(arr), batch_size))
            total = len(arr)
        else:
            batches = images
        bar = Progress(total, "Inception", enabled=progress)
        try:
            for batch in batches:
                batch = _as_images(batch)
                out = self._net.features(batch)
                bar.update(len(batch))
                yield out
        finally:
            bar.close()

    def features(self, images, batch_size=DEFAULT_BATCH, progress=False):
        """(pool float32 [N, 2048], logits_unbiased float32 [N, 1008]) of uint8 images."""
        pools, logits = [], []
        for p, lg in self.iter_features(images, batch_size, progress):
            pools.append(p)
            logits.append(lg)
        if not pools:
            return (np.zeros((0, self.feature_dim), np.float32), np.zeros((0, self.num_classes), np.float32))
        return np.concatenate(pools), np.concatenate(logits)

    def stats(self, images, batch_size=DEFAULT_BATCH, progress=False, keep_logits=True, total=None):
        """Streams images through the network: returns (Stats of the pool
        features, logits [N, 1008] or None). total: image count for the
        progress bar when images is an iterable of batches."""
        st = Stats(self.feature_dim)
        logits = []
        for p, lg in self.iter_features(images, batch_size, progress, total):
            st.update(p)
            if keep_logits:
                logits.append(lg)
        return st, (np.concatenate(logits) if logits else None) if keep_logits else None


# --------------------------------------------------------------------------
# statistics
# --------------------------------------------------------------------------

class Stats:
    """Mean and covariance of feature vectors in float64, accumulated
    incrementally.

    Holds the count n, the mean and the centred sum of outer products M2.
    ``update(batch)`` merges the batch's exact two-pass statistics with Chan
    et al.'s pairwise formula (mean += d * nb / n; M2 += M2b + d d^T na nb / n),
    so the result equals ``np.mean`` / ``np.cov(rowvar=False)`` of all rows to
    rounding, whatever the batching, and shards merge the same way.
    ``sigma`` uses the unbiased N - 1 normalisation, as the ADM evaluator and
    torch-fidelity do.
    """

    def __init__(self, dim=None):
        self.n = 0
        self.dim = dim
        self._mean = None if dim is None else np.zeros(dim)
        self._m2 = None if dim is None else np.zeros((dim, dim))
        self._fixed = None  # (mu, sigma) of statistics loaded without a count

    @classmethod
    def from_features(cls, features):
        st = cls()
        st.update(features)
        return st

    @classmethod
    def from_moments(cls, mu, sigma, n=None):
        """Statistics known only by mean and covariance (a reference file).
        With n they can be merged further; without, only mu and sigma exist."""
        mu = np.asarray(mu, np.float64)
        sigma = np.asarray(sigma, np.float64)
        if mu.ndim != 1 or sigma.shape != (mu.size, mu.size):
            raise ValueError(f"mu must be [d] and sigma [d, d], got {mu.shape} and {sigma.shape}")
        st = cls(mu.size)
        if n is None:
            st._fixed = (mu, sigma)
            st._mean = st._m2 = None
            return st
        st.n = int(n)
        if st.n < 2:
            raise ValueError(f"n must be >= 2 with a covariance, got {n}")
        st._mean = mu.copy()
        st._m2 = sigma * (st.n - 1)
        return st

    @classmethod
    def from_sums(cls, n, sum_x, sum_xxt, shift=None):
        """Statistics from float64 sums over n feature rows x: sum_x = sum (x - c),
        sum_xxt = sum (x - c)(x - c)^T about a shift c (default 0), as
        marcache.distributed's workers send them. mean = c + sum_x / n and
        M2 = sum_xxt - sum_x sum_x^T / n. A shift near the mean (the reference's mu)
        keeps the subtraction from cancelling the covariance's digits."""
        sum_x = np.asarray(sum_x, np.float64)
        sum_xxt = np.asarray(sum_xxt, np.float64)
        if sum_x.ndim != 1 or sum_xxt.shape != (sum_x.size, sum_x.size):
            raise ValueError(f"sum_x must be [d] and sum_xxt [d, d], got {sum_x.shape} and {sum_xxt.shape}")
        st = cls(sum_x.size)
        st.n = int(n)
        if st.n < 1:
            return st
        shift = np.zeros(sum_x.size) if shift is None else np.asarray(shift, np.float64)
        st._mean = shift + sum_x / st.n
        st._m2 = sum_xxt - np.outer(sum_x, sum_x) / st.n
        return st

    def _check_mergeable(self, what):
        if self._fixed is not None:
            raise ValueError(f"cannot {what}: these statistics were loaded without a sample count")

    def _absorb(self, nb, mean_b, m2_b):
        if self.dim is None:
            self.dim = mean_b.size
            self._mean = np.zeros(self.dim)
            self._m2 = np.zeros((self.dim, self.dim))
        if mean_b.size != self.dim:
            raise ValueError(f"feature width {mean_b.size} does not match the statistics' {self.dim}")
        if nb == 0:
            return self
        na = self.n
        n = na + nb
        delta = mean_b - self._mean
        self._mean = self._mean + delta * (nb / n)
        self._m2 = self._m2 + m2_b + np.outer(delta, delta) * (na * nb / n)
        self.n = n
        return self

    def update(self, features):
        """Adds rows of features [b, d] (any float dtype; computed in float64)."""
        self._check_mergeable("update")
        x = np.asarray(features, np.float64)
        if x.ndim != 2:
            raise ValueError(f"features must be [batch, dim], got shape {x.shape}")
        if x.shape[0] == 0:
            return self._absorb(0, np.zeros(x.shape[1]), None) if self.dim is None else self
        mean_b = x.mean(axis=0)
        centred = x - mean_b
        return self._absorb(x.shape[0], mean_b, centred.T @ centred)

    def merge(self, other):
        """Adds another Stats (e.g. a shard) in place; returns self."""
        self._check_mergeable("merge")
        other._check_mergeable("merge")
        if other.n == 0:
            return self
        return self._absorb(other.n, other._mean, other._m2)

    def copy(self):
        st = Stats(self.dim)
        st.n = self.n
        st._mean = None if self._mean is None else self._mean.copy()
        st._m2 = None if self._m2 is None else self._m2.copy()
        st._fixed = self._fixed
        return st

    @property
    def mu(self):
        if self._fixed is not None:
            return self._fixed[0]
        if self.n < 1:
            raise ValueError("no features yet")
        return self._mean.copy()

    @property
    def sigma(self):
        if self._fixed is not None:
            return self._fixed[1]
        if self.n < 2:
            raise ValueError(f"a covariance needs at least 2 samples, have {self.n}")
        return self._m2 / (self.n - 1)

    def save(self, path):
        """Writes an ADM/MAR reference file: mu [d], sigma [d, d] (float64),
        plus the sample count n when known (other tools ignore it)."""
        arrays = {"mu": self.mu, "sigma": self.sigma}
        if self._fixed is None:
            arrays["n"] = np.array(self.n, np.int64)
        np.savez(path, **arrays)

    @classmethod
    def load(cls, path):
        """Reads mu / sigma (and n if present) from an .npz."""
        with np.load(path) as f:
            if "mu" not in f.files or "sigma" not in f.files:
                raise ValueError(f"{path}: no 'mu'/'sigma' arrays (keys: {f.files})")
            n = int(f["n"]) if "n" in f.files else None
            return cls.from_moments(f["mu"], f["sigma"], n)

    def __repr__(self):
        return f"Stats(dim={self.dim}, n={self.n if self._fixed is None else 'unknown'})"


def _moments(x):
    if isinstance(x, Stats):
        return x.mu, x.sigma
    if hasattr(x, "mu") and hasattr(x, "sigma"):
        return np.asarray(x.mu), np.asarray(x.sigma)
    mu, sigma = x
    return np.asarray(mu), np.asarray(sigma)


# --------------------------------------------------------------------------
# FID
# --------------------------------------------------------------------------

def _scipy_sqrtm(a):
    from scipy import linalg

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            out = linalg.sqrtm(a, disp=False)
        except TypeError:  # a SciPy without the disp argument
            return linalg.sqrtm(a)
    return out[0] if isinstance(out, tuple) else out


def _have_scipy():
    try:
        import scipy.linalg  # noqa: F401
    except ImportError:
        return False
    return True


def _trace_sqrt_sqrtm(s1, s2, eps):
    """ADM / pytorch-fid numerics: Tr sqrtm(S1 S2) by scipy.linalg.sqrtm."""
    covmean = _scipy_sqrtm(s1.dot(s2))
    if not np.isfinite(covmean).all():
        warnings.warn(f"fid: singular product; adding {eps} to the diagonal of both covariances")
        offset = np.eye(s1.shape[0]) * eps
        covmean = _scipy_sqrtm((s1 + offset).dot(s2 + offset))
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            raise ValueError(f"fid: imaginary component {np.max(np.abs(covmean.imag))} in sqrtm(S1 S2)")
        covmean = covmean.real
    return float(np.trace(covmean))


def _trace_sqrt_eigvals(s1, s2):
    """torch-fidelity / LTH14 fork numerics: sum_i Re sqrt(lambda_i(S1 S2))."""
    lam = np.linalg.eigvals(s1.dot(s2)).astype(np.complex128)
    return float(np.sqrt(lam).real.sum())


def _psd_sqrt(s):
    w, v = np.linalg.eigh((s + s.T) / 2)
    return (v * np.sqrt(np.clip(w, 0.0, None))) @ v.T


def _trace_sqrt_symmetric(s1, s2, eps):
    """NumPy-only numerics: Tr sqrt(S1 S2) = Tr sqrt(sqrt(S1) S2 sqrt(S1)).

    S1 S2 is similar to the symmetric PSD matrix sqrt(S1) S2 sqrt(S1), so its
    eigenvalues are real and >= 0 and the trace of its square root is the
    sum of their square roots (a symmetric eigensolver: no complex parts,
    no sqrtm iteration). Negative rounding residue of eigenvalues is clipped
    to 0; a non-finite result is retried with eps on both diagonals."""
    def attempt(a, b):
        r = _psd_sqrt(a)
        m = r @ b @ r
        lam = np.linalg.eigvalsh((m + m.T) / 2)
        return float(np.sqrt(np.clip(lam, 0.0, None)).sum())

    value = attempt(s1, s2)
    if not math.isfinite(value):
        offset = np.eye(s1.shape[0]) * eps
        value = attempt(s1 + offset, s2 + offset)
    return value


def fid(a, b, method="auto", eps=1e-6):
    """Frechet distance between two sets of statistics (Stats, objects with
    mu/sigma, or (mu, sigma) pairs):

        ||mu1 - mu2||^2 + Tr(S1) + Tr(S2) - 2 Tr sqrt(S1 S2)

    method:
      "sqrtm"     the ADM evaluator / pytorch-fid numerics: scipy.linalg.sqrtm
                  (disp=False); if the result is not finite, eps * I is added
                  to both covariances and sqrtm recomputed; a complex result
                  whose diagonal has an imaginary part above 1e-3 raises
                  ValueError, else its real part is used. Needs SciPy.
      "eigvals"   torch-fidelity / MAR's LTH14 fork: sum of Re sqrt of the
                  eigenvalues of S1 S2 (NumPy).
      "symmetric" NumPy fallback: the eigenvalues of the symmetric PSD matrix
                  sqrt(S1) S2 sqrt(S1) (similar to S1 S2). Mathematically equal
                  to the others; numerically the most stable.
      "auto"      "sqrtm" when SciPy is installed, else "symmetric".
    On real 2048-d ImageNet statistics the three agree to far below the
    reported precision (two decimals); tests check them against each other.
    """
    mu1, s1 = _moments(a)
    mu2, s2 = _moments(b)
    mu1, mu2 = np.atleast_1d(mu1).astype(np.float64), np.atleast_1d(mu2).astype(np.float64)
    s1, s2 = np.atleast_2d(s1).astype(np.float64), np.atleast_2d(s2).astype(np.float64)
    if mu1.shape != mu2.shape:
        raise ValueError(f"mean vectors have different lengths: {mu1.shape} vs {mu2.shape}")
    if s1.shape != s2.shape or s1.shape != (mu1.size, mu1.size):
        raise ValueError(f"covariances must be [{mu1.size}, {mu1.size}], got {s1.shape} and {s2.shape}")
    if method == "auto":
        method = "sqrtm" if _have_scipy() else "symmetric"
    diff = mu1 - mu2
    if method == "sqrtm":
        if not _have_scipy():
            raise ImportError("fid(method='sqrtm') needs SciPy (pip install scipy, or marcache[eval]); "
                              "method='symmetric' is the NumPy-only form")
        tr = _trace_sqrt_sqrtm(s1, s2, eps)
    elif method == "eigvals":
        tr = _trace_sqrt_eigvals(s1, s2)
    elif method == "symmetric":
        tr = _trace_sqrt_symmetric(s1, s2, eps)
    else:
        raise ValueError(f"method must be 'auto', 'sqrtm', 'eigvals' or 'symmetric', got {method!r}")
    return float(diff.dot(diff) + np.trace(s1) + np.trace(s2) - 2.0 * tr)


# --------------------------------------------------------------------------
# Inception Score
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class InceptionScore:
    mean: float
    std: float
    splits: int

    def __float__(self):
        return float(self.mean)


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(axis=1, keepdims=True)
    z = x - m
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def _split_score(log_p):
    p = np.exp(log_p)
    log_q = np.log(p.mean(axis=0, keepdims=True))
    return float(np.exp((p * (log_p - log_q)).sum(axis=1).mean()))


def inception_score(logits, splits=10, protocol="torch-fidelity", seed=2020, split_size=5000):
    """Inception Score of unbiased logits [N, 1008] (features . fc.weight^T).

    Per split: exp(mean_i KL(p(y|x_i) || p(y))), p(y) the split's mean; the
    result is the mean over splits (and their population std), computed in
    float64.

    protocol "torch-fidelity" (MAR, LazyMAR; the default): rows shuffled with
    np.random.RandomState(seed).permutation(N) (seed 2020), then `splits`
    parts with bounds i * N // splits.
    protocol "adm" (OpenAI evaluator): no shuffle, consecutive parts of
    `split_size` rows (10 parts for 50,000 samples; the last may be short).
    """
    x = np.asarray(logits, np.float64)
    if x.ndim != 2 or x.shape[0] < 1:
        raise ValueError(f"logits must be [N >= 1, classes], got shape {x.shape}")
    n = x.shape[0]
    if protocol == "torch-fidelity":
        if not 1 <= splits <= n:
            raise ValueError(f"splits must be in 1..N = {n}, got {splits}")
        x = x[np.random.RandomState(seed).permutation(n)]
        bounds = [(i * n // splits, (i + 1) * n // splits) for i in range(splits)]
    elif protocol == "adm":
        bounds = [(i, min(i + split_size, n)) for i in range(0, n, split_size)]
    else:
        raise ValueError(f"protocol must be 'torch-fidelity' or 'adm', got {protocol!r}")
    log_p = _log_softmax(x)
    scores = [_split_score(log_p[lo:hi]) for lo, hi in bounds]
    return InceptionScore(float(np.mean(scores)), float(np.std(scores)), len(scores))


# --------------------------------------------------------------------------
# ADM .npz files
# --------------------------------------------------------------------------

def _read_npy_header(f):
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(f)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(f)
    raise ValueError(f"unsupported .npy format version {version}")


def _npy_member(zf, key):
    name = key + ".npy"
    if name not in zf.namelist():
        raise KeyError(f"{zf.filename}: no array '{key}' (arrays: {[n[:-4] for n in zf.namelist()]})")
    return name


def iter_npz_images(path, batch_size=DEFAULT_BATCH, key="arr_0"):
    """Yields uint8 batches [b, H, W, 3] of `key` in an .npz, read from the
    zip member a batch at a time (as the ADM evaluator does): a 50,000-image
    sample file never has to fit in memory."""
    with zipfile.ZipFile(path) as zf, zf.open(_npy_member(zf, key)) as f:
        shape, fortran, dtype = _read_npy_header(f)
        if fortran or len(shape) != 4 or shape[3] != 3:
            raise ValueError(f"{path}: '{key}' must be a C-order [N, H, W, 3] array, got shape {shape}")
        row = int(np.prod(shape[1:])) * dtype.itemsize
        for start in range(0, shape[0], batch_size):
            count = min(batch_size, shape[0] - start)
            buf = f.read(row * count)
            if len(buf) != row * count:
                raise ValueError(f"{path}: '{key}' is truncated")
            arr = np.frombuffer(buf, dtype).reshape((count,) + tuple(shape[1:]))
            if arr.dtype != np.uint8:
                # ADM casts to float32 and feeds the graph; values must be 0..255 integers
                if not np.all((arr >= 0) & (arr <= 255)):
                    raise ValueError(f"{path}: '{key}' has values outside 0..255")
                arr = arr.astype(np.uint8)
            yield arr


def npz_image_count(path, key="arr_0"):
    with zipfile.ZipFile(path) as zf, zf.open(_npy_member(zf, key)) as f:
        shape, _, _ = _read_npy_header(f)
    return shape[0]


class SampleWriter:
    """Streams uint8 images into an ADM sample batch ``.npz`` (``arr_0``,
    NHWC) without holding them in memory::

        with SampleWriter("samples.npz", n=50000, shape=(256, 256, 3)) as w:
            for batch in batches:
                w.write(batch)
    The file is a standard uncompressed npz (np.load reads it)."""

    def __init__(self, path, n, shape):
        self.path, self.n, self.shape, self.written = os.fspath(path), int(n), tuple(shape), 0
        self._zip = zipfile.ZipFile(self.path, "w", zipfile.ZIP_STORED, allowZip64=True)
        self._f = self._zip.open("arr_0.npy", "w", force_zip64=True)
        header = {"descr": "|u1", "fortran_order": False, "shape": (self.n,) + self.shape}
        try:
            np.lib.format.write_array_header_1_0(self._f, header)
        except ValueError:  # a header too long for format 1.0
            np.lib.format.write_array_header_2_0(self._f, header)

    def write(self, images):
        arr = _as_images(images)
        if arr.shape[1:] != self.shape:
            raise ValueError(f"images of shape {arr.shape[1:]} do not match the file's {self.shape}")
        if self.written + len(arr) > self.n:
            raise ValueError(f"more than the {self.n} images announced")
        self._f.write(arr.tobytes())
        self.written += len(arr)

    def close(self):
        if self._f is None:
            return
        self._f.close()
        self._zip.close()
        self._f = None
        if self.written != self.n:
            os.remove(self.path)
            raise ValueError(f"{self.path}: {self.written} images written, {self.n} announced; file removed")

    def abort(self):
        """Closes and removes a partly written file."""
        if self._f is not None:
            self._f.close()
            self._zip.close()
            self._f = None
            os.remove(self.path)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
            return False
        self.close()
        return False


def save_samples(images, path):
    """Writes uint8 images [N, H, W, 3] as an ADM sample batch (``arr_0``)."""
    arr = _as_images(images)
    with SampleWriter(path, len(arr), arr.shape[1:]) as w:
        w.write(arr)
    return path


def load_reference(path, inception=None, batch_size=DEFAULT_BATCH, progress=False):
    """Reference statistics from an .npz: ``mu``/``sigma`` when present (ADM
    reference batches such as VIRTUAL_imagenet256_labeled.npz, MAR's
    adm_in256_stats.npz, files written by :func:`make_reference`), else
    computed from the images in ``arr_0`` (needs `inception`), as the ADM
    evaluator does."""
    with np.load(path) as f:
        files = f.files
        if "mu" in files and "sigma" in files:
            n = int(f["n"]) if "n" in files else None
            return Stats.from_moments(f["mu"], f["sigma"], n)
    if "arr_0" not in files:
        raise ValueError(f"{path}: neither 'mu'/'sigma' nor 'arr_0' (arrays: {files})")
    if inception is None:
        raise ValueError(f"{path} holds images ('arr_0') but no statistics: pass inception= to compute them")
    stats, _ = inception.stats(iter_npz_images(path, batch_size), progress=progress, keep_logits=False,
                               total=npz_image_count(path))
    return stats


_IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


def _read_image(path):
    if path.lower().endswith(".png"):
        try:
            from .png import read_png

            return read_png(path)
        except ValueError:
            pass  # a PNG variant the small reader does not handle: try Pillow
    try:
        from PIL import Image
    except ImportError as exc:
        raise ValueError(f"{path}: only 8-bit PNG is readable without Pillow (pip install pillow)") from exc
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"), np.uint8)


def iter_folder_images(folder, batch_size=DEFAULT_BATCH):
    """Yields uint8 batches of the images of a folder in sorted file order;
    a batch holds consecutive images of one size."""
    names = sorted(n for n in os.listdir(folder) if n.lower().endswith(_IMAGE_EXTENSIONS))
    if not names:
        raise ValueError(f"{folder}: no images ({', '.join(_IMAGE_EXTENSIONS)})")
    batch = []
    for name in names:
        img = _read_image(os.path.join(folder, name))
        if batch and (img.shape != batch[0].shape or len(batch) == batch_size):
            yield np.stack(batch)
            batch = []
        batch.append(img)
    if batch:
        yield np.stack(batch)


def make_reference(images, path, inception, batch_size=DEFAULT_BATCH, progress=False):
    """Builds reference statistics for a new dataset or resolution and writes
    them in the ADM/MAR layout (``mu``, ``sigma`` float64, plus ``n``).

    images: a uint8 array [N, H, W, 3], an .npz with ``arr_0``, or a folder of
    images (PNG read natively; other formats need Pillow). Returns the Stats."""
    if isinstance(images, (str, os.PathLike)):
        src = os.fspath(images)
        if os.path.isdir(src):
            source = iter_folder_images(src, batch_size)
        elif src.endswith(".npz"):
            source = iter_npz_images(src, batch_size)
        else:
            raise ValueError(f"{src}: expected a folder of images or an .npz with 'arr_0'")
    else:
        source = images
    stats, _ = inception.stats(source, batch_size=batch_size, progress=progress, keep_logits=False)
    if stats.n < 2:
        raise ValueError(f"reference statistics need at least 2 images, got {stats.n}")
    stats.save(path)
    return stats


def evaluate(samples, reference, inception, batch_size=DEFAULT_BATCH, progress=False, method="auto",
             is_protocol="torch-fidelity"):
    """FID and IS of a sample batch (.npz path or uint8 array) against reference
    statistics (Stats or .npz path). Returns dict(fid, inception_score, is_std, n)."""
    if isinstance(samples, (str, os.PathLike)):
        source = iter_npz_images(os.fspath(samples), batch_size)
    else:
        source = samples
    if not isinstance(reference, Stats):
        reference = load_reference(reference, inception, batch_size, progress)
    stats, logits = inception.stats(source, batch_size=batch_size, progress=progress)
    isc = inception_score(logits, protocol=is_protocol, splits=min(10, len(logits)))
    return {"fid": fid(stats, reference, method=method), "inception_score": isc.mean, "is_std": isc.std,
            "n": stats.n}


# --------------------------------------------------------------------------
# sweeps
# --------------------------------------------------------------------------

def class_major_labels(n, per_class, num_classes=1000, start=0):
    """Labels of images start .. start + n - 1 under MAR's evaluation protocol:
    image i has class i // per_class (50 per class for 50,000 images)."""
    if per_class < 1:
        raise ValueError(f"per_class must be >= 1, got {per_class}")
    labels = np.arange(start, start + n) // per_class
    if labels.size and labels.max() >= num_classes:
        raise ValueError(f"{start + n} images at {per_class} per class need {int(labels.max()) + 1} classes; "
                         f"the model has {num_classes}")
    return labels.astype(np.int64)


@dataclass
class SweepResult:
    """One configuration of a sweep."""
    name: str
    cache: object
    n: int
    fid: float
    inception_score: float
    is_std: float
    seconds_per_image: float        # generation (transformer + head + VAE); MAR's timer: from batch 2 on
    flops_per_image: float          # generation FLOPs (GEMMs + attention), from telemetry
    inception_seconds_per_image: float
    stats: Stats = field(repr=False)
    logits: np.ndarray = field(repr=False)
    settings: dict = field(default_factory=dict)  # the generation settings passed (the model's defaults otherwise)


_SWEEP_SETS = ("labels", "seed", "first_index", "cache", "return_info", "num_images", "progress")


def _check_generate_settings(model, settings):
    """The model's own generation settings of a sweep: names its generate takes and the
    sweep does not set itself (a ValueError naming the others)."""
    import inspect

    accepted = set(inspect.signature(model.generate).parameters) - set(_SWEEP_SETS)
    unknown = sorted(set(settings) - accepted)
    if unknown:
        raise ValueError(f"sweep: {type(model).__name__}.generate takes no setting {', '.join(map(repr, unknown))}; "
                         f"its settings: {', '.join(sorted(accepted))} (labels, seed, first_index and cache are "
                         f"set by the sweep)")


def _named_configs(configs, what):
    """[(name, cache config)] of a {name: config} dict or a list of configs (named by their `name`)."""
    if isinstance(configs, dict):
        items = list(configs.items())
    else:
        items = [(getattr(c, "name", str(c)), c) for c in configs]
    if not items:
        raise ValueError(f"{what} is empty")
    return items


def sweep(model, inception, configs, n, per_class, reference, seed=0, batch_size=16, progress=False,
          is_protocol="torch-fidelity", method="auto", executor=None, **generate_settings):
    """Generates `n` images per cache configuration and scores them.

    configs: {name: cache config} (e.g. {"nocache": marcache.NoCache()}), or a
    list of configs (named by their `name`). Labels follow MAR's protocol
    (image i has class i // per_class) and image i is image i of the seed's
    sequence in every configuration, so configurations differ only by the
    cache. Images stream through the Inception network into Stats batch by
    batch. reference: Stats or an .npz path (load_reference). Returns a list
    of SweepResult in the order of configs. seconds_per_image follows MAR's
    printout (mar.md 10): generation time (sampling + VAE decode) of every
    batch after the first, per image (all batches when there is only one).

    generate_settings: the model's own generation settings, passed to every
    model.generate call (its defaults otherwise): a MAR's steps (64), cfg (1.0),
    cfg_schedule, temperature; a VAR's cfg (1.5), top_k (900), top_p (0.96),
    more_smooth. A setting the model does not take is a ValueError.

    executor: None (this process) or "ray" (marcache.distributed on a local Ray,
    or the cluster Ray is already connected to), or a
    marcache.distributed.RayExecutor(address=..., workers=..., gpus_per_worker=...).
    The same images, and statistics equal to this process's to float64 rounding:
    the workers load the model and Inception from their files once, and stream back
    feature sums and logits. seconds_per_image is then the workers' generation
    seconds per image (summed over workers).
    """
    _check_generate_settings(model, generate_settings)
    items = _named_configs(configs, "configs")
    if not isinstance(reference, Stats):
        reference = load_reference(reference, inception)
    if executor is not None:
        from .distributed import as_executor

        return as_executor(executor).sweep(model, inception, items, n, per_class, reference, seed=seed,
                                           batch_size=batch_size, progress=progress, is_protocol=is_protocol,
                                           method=method, **generate_settings)
    num_classes = model.config.get("num_classes", 1000)
    labels = class_major_labels(n, per_class, num_classes)
    results = []
    for name, cache in items:
        stats = Stats(inception.feature_dim)
        logits, batch_seconds, batch_sizes = [], [], []
        inc_seconds = flops = 0.0
        bar = Progress(n, f"sweep {name}", enabled=progress)
        try:
            for start in range(0, n, batch_size):
                lab = labels[start:start + batch_size]
                t0 = time.perf_counter()
                images, info = model.generate(labels=lab, seed=seed, first_index=start, cache=cache,
                                              return_info=True, **generate_settings)
                t1 = time.perf_counter()
                pool, lg = inception.features(images, batch_size=len(images))
                inc_seconds += time.perf_counter() - t1
                batch_seconds.append(t1 - t0)
                batch_sizes.append(len(images))
                flops += info.flops
                stats.update(pool)
                logits.append(lg)
                bar.update(len(images))
        finally:
            bar.close()
        logits = np.concatenate(logits)
        # MAR's speed printout times every batch but the first (warm-up).
        timed = slice(1, None) if len(batch_seconds) > 1 else slice(None)
        gen_per_image = sum(batch_seconds[timed]) / sum(batch_sizes[timed])
        isc = inception_score(logits, splits=min(10, n), protocol=is_protocol)
        results.append(SweepResult(name=name, cache=cache, n=n, fid=fid(stats, reference, method=method),
                                   inception_score=isc.mean, is_std=isc.std,
                                   seconds_per_image=gen_per_image, flops_per_image=flops / n,
                                   inception_seconds_per_image=inc_seconds / n, stats=stats, logits=logits,
                                   settings=dict(generate_settings)))
    return results


@dataclass
class FrontierRow:
    """One policy of a frontier run."""
    name: str
    cache: object
    n: int
    seconds_per_image: float   # generation wall time per image, every batch after the first
    flops_per_image: float     # from the engine's telemetry
    fid: float                 # FID, or the digits-FID with the digits classifier
    accuracy: Optional[float]  # class accuracy (digits classifier), None with Inception
    speedup: float = 1.0       # the first policy's seconds_per_image / this one's
    flop_ratio: float = 1.0    # the first policy's flops_per_image / this one's
    pareto: bool = False       # on the speed-quality Pareto front


@dataclass
class Frontier:
    """The rows of marcache.eval.frontier (policies in the order given) and its Pareto set
    (rows no other row beats on both seconds per image and quality), fastest first."""
    rows: List[FrontierRow]
    pareto: List[FrontierRow]
    quality: str = "fid"

    def table(self):
        """A plain-text table of the rows (a * marks the Pareto set)."""
        lines = [f"{'policy':<34} {'s/image':>8} {'speed-up':>8} {'GFLOP/img':>10} {'FLOP ratio':>10} "
                 f"{'FID':>8} {'class acc':>9}"]
        for r in self.rows:
            acc = "-" if r.accuracy is None else f"{100 * r.accuracy:.1f}%"
            lines.append(f"{('* ' if r.pareto else '  ') + r.name:<34} {r.seconds_per_image:>8.4f} "
                         f"{r.speedup:>7.2f}x {r.flops_per_image / 1e9:>10.4f} {r.flop_ratio:>9.2f}x "
                         f"{r.fid:>8.3f} {acc:>9}")
        return "\n".join(lines)


def _dominates(a, b, quality):
    """a is at least as fast and as good as b, and better in one."""
    qa, qb = (a.fid, b.fid) if quality == "fid" else (-a.accuracy, -b.accuracy)
    return (a.seconds_per_image <= b.seconds_per_image and qa <= qb and
            (a.seconds_per_image < b.seconds_per_image or qa < qb))


def frontier(model, classifier_or_inception, policies, n, per_class=None, reference=None, seed=0, batch_size=8,
             quality="fid", progress=False, **generate_settings):
    """Runs every cache policy on the same labels and seeds and returns the speed-quality
    frontier (a Frontier: one FrontierRow per policy and the Pareto set).

    classifier_or_inception: the digits classifier (``marcache.digits.Classifier``: the
    digits-FID on its 64-d features and the class accuracy) or an ``InceptionV3`` (FID;
    no class accuracy). policies: {name: policy} or a list of policies. Image i has class
    i // per_class (default n // num_classes) and is image i of the seed's sequence under
    every policy. The policies alternate batch by batch (batch_size images each), so a
    changing load on a shared machine reaches all of them alike; s/image is the wall
    time of every batch after a policy's first. reference: Stats or an .npz path (the
    training digits' statistics by default with the classifier; required with
    Inception). quality: "fid" or "accuracy", the axis of the Pareto set.
    generate_settings: the model's generation settings (steps, cfg, ...).
    """
    if quality not in ("fid", "accuracy"):
        raise ValueError(f"frontier: quality must be 'fid' or 'accuracy', got {quality!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"frontier: n must be a positive integer, got {n!r}")
    _check_generate_settings(model, generate_settings)
    items = _named_configs(policies, "policies")
    from . import digits as _digits

    is_classifier = isinstance(classifier_or_inception, _digits.Classifier)
    if not is_classifier and not isinstance(classifier_or_inception, InceptionV3):
        raise TypeError(f"frontier: classifier_or_inception must be marcache.digits.Classifier or "
                        f"marcache.eval.InceptionV3, got {type(classifier_or_inception).__name__}")
    if quality == "accuracy" and not is_classifier:
        raise ValueError("frontier: quality='accuracy' needs the digits classifier (Inception has no class labels)")
    if reference is None:
        if not is_classifier:
            raise ValueError("frontier: reference statistics (Stats or an .npz path) are needed with Inception")
        reference = _digits.reference_stats(classifier_or_inception)
    elif not isinstance(reference, Stats):
        reference = load_reference(reference, classifier_or_inception)
    num_classes = model.config.get("num_classes", 1000)
    per_class = max(1, n // num_classes) if per_class is None else per_class
    labels = class_major_labels(n, per_class, num_classes)
    images = {name: [] for name, _ in items}
    seconds = {name: [] for name, _ in items}
    flops = {name: 0.0 for name, _ in items}
    bar = Progress(n * len(items), "frontier", enabled=progress)
    try:
        for start in range(0, n, batch_size):
            lab = labels[start:start + batch_size]
            for name, cache in items:
                t0 = time.perf_counter()
                out, info = model.generate(labels=lab, seed=seed, first_index=start, cache=cache, return_info=True,
                                           **generate_settings)
                seconds[name].append(time.perf_counter() - t0)
                flops[name] += info.flops
                images[name].append(out)
                bar.update(len(out))
    finally:
        bar.close()
    sizes = [len(labels[s:s + batch_size]) for s in range(0, n, batch_size)]
    timed = slice(1, None) if len(sizes) > 1 else slice(None)
    rows = []
    for name, cache in items:
        imgs = np.concatenate(images[name])
        if is_classifier:
            feats = classifier_or_inception.features(imgs)
            accuracy = classifier_or_inception.accuracy(imgs, labels)
        else:
            feats, accuracy = classifier_or_inception.features(imgs)[0], None
        rows.append(FrontierRow(name=name, cache=cache, n=n,
                                seconds_per_image=sum(seconds[name][timed]) / sum(sizes[timed]),
                                flops_per_image=flops[name] / n, accuracy=accuracy,
                                fid=fid(Stats.from_features(feats), reference,
                                        method="symmetric" if is_classifier else "auto")))
    for r in rows:
        r.speedup = rows[0].seconds_per_image / r.seconds_per_image
        r.flop_ratio = rows[0].flops_per_image / r.flops_per_image
        r.pareto = not any(_dominates(o, r, quality) for o in rows if o is not r)
    return Frontier(rows=rows, pareto=sorted((r for r in rows if r.pareto), key=lambda r: r.seconds_per_image),
                    quality=quality)


def plot_frontier(result, path=None, ax=None, title=None):
    """Quality (the frontier's quality axis) against seconds per image, one labelled
    point per policy, the Pareto set joined by a line. Writes a PNG to `path` when given;
    returns the matplotlib Axes. Needs matplotlib (optional: pip install matplotlib)."""
    try:
        import matplotlib
        if ax is None and path is not None:
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("marcache.eval.plot_frontier draws with matplotlib, which is not installed: "
                          "pip install matplotlib (everything else in marcache.eval works without it)") from exc
    value = (lambda r: r.fid) if result.quality == "fid" else (lambda r: 100 * r.accuracy)  # noqa: E731
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in result.rows:
        ax.plot(r.seconds_per_image, value(r), "o", color="C0" if r.pareto else "0.6")
        ax.annotate(r.name, (r.seconds_per_image, value(r)), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.plot([r.seconds_per_image for r in result.pareto], [value(r) for r in result.pareto], "-", color="C0",
            label="Pareto set")
    ax.set_xlabel("seconds per image")
    ax.set_ylabel("FID (lower is better)" if result.quality == "fid" else "class accuracy % (higher is better)")
    ax.set_xscale("log")
    ax.legend(loc="best", fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    if path is not None:
        (fig or ax.figure).savefig(path, dpi=120, bbox_inches="tight")
    if fig is not None and path is not None:
        plt.close(fig)
    return ax


def format_table(results):
    """A plain-text table: policy, N, FID, IS, seconds and TFLOPs per image."""
    lines = [f"{'policy':<16} {'N':>6} {'FID':>10} {'IS':>9} {'s/img':>9} {'TFLOPs/img':>11}"]
    for r in results:
        lines.append(f"{r.name:<16} {r.n:>6} {r.fid:>10.3f} {r.inception_score:>9.3f} "
                     f"{r.seconds_per_image:>9.4f} {r.flops_per_image / 1e12:>11.4f}")
    return "\n".join(lines)


__all__ = ["InceptionV3", "Stats", "fid", "inception_score", "InceptionScore", "load_reference",
           "save_samples", "SampleWriter", "make_reference", "evaluate", "iter_npz_images",
           "iter_folder_images", "class_major_labels", "sweep", "SweepResult", "format_table", "frontier",
           "Frontier", "FrontierRow", "plot_frontier"]

""":func:`convert`: open the checkpoint, plan the kind, hash the source, write the
safetensors file and read it back with marcache's strict C reader."""
import collections
import hashlib
import os

from .checks import _shape
from .kinds import plan
from .reader import read_checkpoint
from .tensors import DTYPES, CheckpointError
from .._progress import Progress
from .writer import _out_dtype, write_safetensors


def _sha256(path, progress):
    h = hashlib.sha256()
    size = os.path.getsize(path)
    bar = Progress(size, "sha256", unit="B", enabled=progress)
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    try:
        with open(path, "rb") as f:
            while True:
                n = f.readinto(buf)
                if not n:
                    break
                h.update(view[:n])
                bar.update(n)
    finally:
        bar.close()
    return h.hexdigest()


def _verify(dst, plan_, out_dtype):
    """Re-opens the output with marcache's strict C reader (every rule of
    eval_and_formats.md 9.3) and checks names, dtypes, shapes and metadata."""
    from .. import _C

    entries, meta = _C.safetensors_info(dst)
    got = {name: (dt, tuple(shape)) for name, dt, shape in entries}
    want = {name: (_out_dtype(t.dtype, out_dtype), _shape(t)) for name, t in plan_.tensors.items()}
    if got != want:
        raise CheckpointError(f"{dst}: the written file does not read back as planned")
    if meta.get("kind") != plan_.kind:
        raise CheckpointError(f"{dst}: metadata kind reads back as {meta.get('kind')!r}")


def _version():
    try:
        from .. import __version__
        return __version__
    except ImportError:  # pragma: no cover - used outside the package
        return "unknown"


def convert(kind, src, dst, dtype="fp32", weights="model_ema", heads=None, progress=False, verify=True):
    """Converts an official PyTorch checkpoint to a marcache safetensors file, without PyTorch.

    kind: "mar", "vae-kl16", "var", "vqvae" or "inception" (see :data:`KINDS`).
    dtype: "fp32", "fp16" or "bf16" for the floating-point tensors.
    weights: for "mar", "model_ema" (the evaluation weights, default) or "model".
    heads: for "mar" with a width other than the released 768 / 1024 / 1280.
    progress: show progress bars (tqdm if installed, else a counter on stderr).

    The full key set and every shape are checked against the spec before
    anything is written; ``__metadata__`` records ``kind``, the
    hyper-parameters, ``source_file``, ``source_sha256``, ``dtype`` and
    ``marcache_version``. Returns the :class:`Plan` that was written (its
    ``metadata`` is what the file holds).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    src = os.fspath(src)
    dst = os.fspath(dst)
    if os.path.exists(dst) and os.path.exists(src) and os.path.samefile(src, dst):
        raise ValueError(f"the output {dst} is the source checkpoint itself")
    with read_checkpoint(src) as ck:
        p = plan(kind, ck, weights=weights, heads=heads)
        meta = collections.OrderedDict([("kind", kind)])
        meta.update((k, str(v)) for k, v in p.metadata.items())
        meta["num_tensors"] = str(len(p.tensors))
        meta["num_params"] = str(sum(t.numel for t in p.tensors.values()))
        meta["dtype"] = dtype
        meta["source_file"] = os.path.basename(src)
        meta["source_format"] = f"torch.save {ck.format}"
        meta["source_sha256"] = _sha256(src, progress)
        meta["marcache_version"] = _version()
        p.metadata = meta
        write_safetensors(dst, p.tensors, meta, DTYPES[dtype], progress=progress)
    if verify:
        _verify(dst, p, DTYPES[dtype])
    return p

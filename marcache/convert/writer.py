"""The streaming safetensors writer (``spec/eval_and_formats.md`` section 9): one
tensor in memory at a time, cast to the output dtype on the way, written to
``DST.partial`` and renamed when complete."""
import json
import math
import os
import struct

import numpy as np

from .._progress import Progress
from .checks import _shape
from .tensors import _FLOAT_DTYPES, _ST_DTYPES, _np_dtype, bf16_bits_to_f32, f32_to_bf16_bits


def _out_dtype(src, target):
    return target if src in _FLOAT_DTYPES else src


def _cast(tensor, out):
    """Materialises `tensor` as a C-contiguous little-endian array of safetensors dtype `out`."""
    arr = tensor.raw()
    src = tensor.dtype
    if src != out:     # a float cast, always through float32 (exact from F16 and BF16)
        f32 = bf16_bits_to_f32(arr) if src == "BF16" else arr.astype(np.float32)
        arr = f32 if out == "F32" else f32_to_bf16_bits(f32) if out == "BF16" else f32.astype(np.float16)
    want = _np_dtype(out, "little")
    if arr.dtype != want:
        arr = arr.astype(want)
    return arr if arr.flags.c_contiguous else arr.copy(order="C")   # (ascontiguousarray turns 0-d into 1-d)


def write_safetensors(path, tensors, metadata=None, dtype="F32", progress=False):
    """Streams `tensors` (name -> LazyTensor or NumPy array) into a safetensors file.

    Floating-point tensors are written as `dtype` ("F32", "F16" or "BF16");
    others keep their dtype. Tensors are ordered like the official writer
    (descending alignment, then name) and the header is padded with spaces to a
    multiple of 8 bytes. Only one tensor is in memory at a time. The file is
    written to ``path + '.partial'`` and renamed when complete. Returns the
    number of bytes written."""
    if dtype not in ("F32", "F16", "BF16"):
        raise ValueError(f"dtype must be F32, F16 or BF16, got {dtype!r}")
    items = []
    for name, t in tensors.items():
        if isinstance(t, (np.ndarray, np.generic)):
            t = _ArrayTensor(t)
        out = _out_dtype(t.dtype, dtype)
        items.append((name, t, out))
    items.sort(key=lambda it: (-_ST_DTYPES[it[2]].itemsize, it[0]))
    header = {}
    if metadata:
        bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise ValueError(f"metadata keys and values must be strings: {bad}")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, t, out in items:
        n = int(math.prod(t.shape)) * _ST_DTYPES[out].itemsize
        header[name] = {"dtype": out, "shape": [int(s) for s in t.shape], "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    total = 8 + len(blob) + offset
    tmp = os.fspath(path) + ".partial"
    bar = Progress(offset, "writing", unit="B", enabled=progress)
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for name, t, out in items:
                arr = _cast(t, out)
                expect = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
                if arr.nbytes != expect or _shape(arr) != tuple(header[name]["shape"]):
                    raise AssertionError(f"{name}: materialised {arr.shape} / {arr.nbytes} bytes, header says "
                                         f"{header[name]['shape']} / {expect}")
                f.write(memoryview(arr.reshape(-1)).cast("B") if arr.size else b"")
                del arr
                bar.update(expect, name)
        if os.path.getsize(tmp) != total:
            raise OSError(f"{tmp}: wrote {os.path.getsize(tmp)} bytes, expected {total}")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    finally:
        bar.close()
    return total


class _ArrayTensor:
    """Adapts a NumPy array to the LazyTensor interface used by the writer."""

    _DT = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
           np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16",
           np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}

    def __init__(self, arr):
        self.arr = np.asarray(arr)
        dt = self.arr.dtype.newbyteorder("=")
        if dt not in self._DT:
            raise ValueError(f"unsupported array dtype {self.arr.dtype}")
        self.dtype = self._DT[dt]
        self.shape = self.arr.shape

    def raw(self):
        return self.arr.astype(self.arr.dtype.newbyteorder("="), order="C")

"""What every part of the converter shares: the two error types, the dtype
tables (safetensors, torch storage classes, torch dtype names), the exact
bfloat16 conversions, and the lazy tensors that point into a checkpoint file."""
import math
import pickle
import reprlib
import zlib

import numpy as np


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match the expected layout."""


class UnsafeCheckpointError(CheckpointError, pickle.UnpicklingError):
    """The pickle asks for a global outside the allowlist (it could run code)."""


_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother, _BRIEF.maxlong = 3, 80, 80, 60
_BRIEF.maxtuple = _BRIEF.maxlist = _BRIEF.maxdict = _BRIEF.maxset = _BRIEF.maxfrozenset = 8


def brief(value):
    """repr() of a value that came out of a pickle, for error messages: bounded in depth and
    length (reprlib), so a deeply nested or self-referential object, or a 100 MB string,
    cannot turn the message itself into a RecursionError or a memory hog."""
    try:
        return _BRIEF.repr(value)
    except Exception:  # a hostile __repr__ cannot come from the allowlist, but stay safe
        return f"<{type(value).__name__}>"


# ===========================================================================
# dtypes
# ===========================================================================

# safetensors dtype string -> (NumPy dtype of the raw elements, itemsize).
# BF16 is kept as its raw uint16 bits; it becomes float32 by a 16-bit shift.
_ST_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(np.uint16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")

# Storage classes as they appear in persistent ids (eval_and_formats.md 10.2).
_STORAGE_CLASSES = {
    "DoubleStorage": "F64", "FloatStorage": "F32", "HalfStorage": "F16", "BFloat16Storage": "BF16",
    "LongStorage": "I64", "IntStorage": "I32", "ShortStorage": "I16", "CharStorage": "I8",
    "ByteStorage": "U8", "BoolStorage": "BOOL",
}

# torch dtype objects (pickled as the globals torch.<name>). Those with a
# safetensors equivalent can type a tensor (_rebuild_tensor_v3); the others
# are accepted only as inert values (e.g. inside args).
_TORCH_DTYPES = {
    "float64": "F64", "double": "F64", "float32": "F32", "float": "F32", "float16": "F16",
    "half": "F16", "bfloat16": "BF16", "int64": "I64", "long": "I64", "int32": "I32",
    "int": "I32", "int16": "I16", "short": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "complex64": None, "complex128": None, "cfloat": None, "cdouble": None, "uint16": None,
    "uint32": None, "uint64": None, "float8_e4m3fn": None, "float8_e5m2": None,
}

#: Output dtypes accepted by ``--dtype`` -> safetensors dtype string.
DTYPES = {"fp32": "F32", "fp16": "F16", "bf16": "BF16"}


def _np_dtype(st, byteorder="little"):
    dt = _ST_DTYPES[st]
    if dt.itemsize > 1:
        dt = dt.newbyteorder("<" if byteorder == "little" else ">")
    return dt


def bf16_bits_to_f32(bits):
    """Raw bfloat16 bits (uint16 array) -> float32 values, exactly."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(values):
    """float32 -> bfloat16 bits with round-to-nearest-even (PyTorch's rule,
    NaN -> 0x7FC0), as uint16."""
    f = np.ascontiguousarray(values, np.float32)
    u = f.view(np.uint32)
    out = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        out[nan] = 0x7FC0
    return out


# ===========================================================================
# Storages and lazy tensors
# ===========================================================================

class _Storage:
    """One storage record: `nbytes` raw bytes of dtype `dtype` at absolute file
    offset `file_offset` (a view into a larger record in the legacy format)."""

    def __init__(self, checkpoint, key, dtype, nbytes, record=None):
        self.checkpoint = checkpoint
        self.key = key
        self.dtype = dtype
        self.nbytes = nbytes
        self.record = record          # name shown in errors
        self.file_offset = None       # set once the record is located
        self.crc = None               # zip CRC-32 of the whole record, checked on full reads
        self.record_nbytes = None     # size of the record on disk

    def read(self, start, nbytes):
        """Bytes [start, start + nbytes) of this storage as a writable buffer."""
        ck = self.checkpoint
        if start < 0 or start + nbytes > self.nbytes:
            raise CheckpointError(f"{ck.path}: a tensor reads bytes [{start}, {start + nbytes}) of storage "
                                  f"'{self.key}', which holds only {self.nbytes} bytes")
        ck._locate(self)
        buf = bytearray(nbytes)
        if nbytes:
            f = ck._file()
            f.seek(self.file_offset + start)
            got = f.readinto(buf)
            if got != nbytes:
                raise CheckpointError(f"{ck.path}: storage record '{self.record}' ends after {got} of {nbytes} "
                                      "bytes: the file is truncated")
        if self.crc is not None and start == 0 and nbytes == self.record_nbytes:
            if zlib.crc32(buf) & 0xFFFFFFFF != self.crc:
                raise CheckpointError(f"{ck.path}: storage record '{self.record}' fails its CRC-32 check: "
                                      "the file is corrupted")
        return buf


def _extent(shape, stride):
    """How many storage elements a non-empty strided view spans, from its first
    element to its last (what must be read, and what must fit in the storage)."""
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride))


class LazyTensor:
    """A tensor of a checkpoint that is read only when materialised.

    Attributes: ``shape``, ``stride`` (in elements), ``offset`` (storage
    offset in elements), ``dtype`` (safetensors dtype string), ``storage``
    (tensors that share a storage share this object), ``requires_grad``.
    """

    __slots__ = ("storage", "offset", "shape", "stride", "dtype", "requires_grad")

    def __init__(self, storage, offset, shape, stride, dtype, requires_grad=False):
        self.storage = storage
        self.offset = offset
        self.shape = shape
        self.stride = stride
        self.dtype = dtype
        self.requires_grad = requires_grad

    @property
    def numel(self):
        return int(math.prod(self.shape))

    @property
    def itemsize(self):
        return _ST_DTYPES[self.dtype].itemsize

    @property
    def nbytes(self):
        return self.numel * self.itemsize

    def is_contiguous(self):
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def raw(self):
        """The elements as a C-contiguous native-endian NumPy array of the stored
        dtype (BF16 as uint16 bits)."""
        ck = self.storage.checkpoint
        dt = _np_dtype(self.dtype, ck.byteorder)
        if self.numel == 0:
            return np.empty(self.shape, dt.newbyteorder("="))
        extent = _extent(self.shape, self.stride)
        buf = self.storage.read(self.offset * dt.itemsize, extent * dt.itemsize)
        flat = np.frombuffer(buf, dtype=dt)
        if self.is_contiguous():
            arr = flat.reshape(self.shape)
        else:
            arr = np.ascontiguousarray(np.lib.stride_tricks.as_strided(
                flat, shape=self.shape, strides=tuple(st * dt.itemsize for st in self.stride), writeable=False))
        if not dt.isnative:
            arr = arr.astype(dt.newbyteorder("="))
        return arr

    def numpy(self):
        """The values as a C-contiguous NumPy array; BF16 becomes float32 (exactly)."""
        arr = self.raw()
        return bf16_bits_to_f32(arr) if self.dtype == "BF16" else arr

    def __repr__(self):
        return (f"LazyTensor(shape={list(self.shape)}, dtype={self.dtype}, storage={self.storage.key!r}, "
                f"offset={self.offset}, stride={list(self.stride)})")

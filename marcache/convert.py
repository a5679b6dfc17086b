"""Torch-free conversion of the official PyTorch checkpoints to safetensors.

``python -m marcache convert KIND SRC -o DST`` (or :func:`convert`) reads a
PyTorch checkpoint with nothing but the standard library and NumPy, checks
its full key set and every shape against the specification, and writes a
safetensors file whose ``__metadata__`` records the kind and the
hyper-parameters, so that :func:`marcache.load` can tell the files apart.

Reading (``spec/eval_and_formats.md`` section 10):

* The zip format of ``torch.save`` (PyTorch >= 1.6): ``<archive>/data.pkl``
  (the pickle), ``<archive>/data/<key>`` (raw storages), ``<archive>/byteorder``.
  The ``<archive>`` folder name varies and is found from ``data.pkl``.
* The legacy stream format (PyTorch < 1.6, still written with
  ``_use_new_zipfile_serialization=False``): magic number, protocol and
  system-info pickles, the object pickle, the list of storage keys, then each
  storage as an int64 element count and its raw bytes. Files of the pre-0.4
  tar format are refused.
* The pickle runs through :class:`RestrictedUnpickler`, whose ``find_class``
  knows an explicit allowlist (tensor and parameter rebuild functions, the
  storage classes, ``OrderedDict``, ``argparse.Namespace`` as inert data, a few
  inert value types). Every other global is refused with an
  :class:`UnsafeCheckpointError` naming it; nothing from the file is ever
  imported or called. The rebuild functions are marcache's own and only
  record where a tensor's elements are.
* Tensors are lazy (:class:`LazyTensor`): nothing is read until a tensor is
  materialised, and then only the byte range it covers. Storage offsets,
  arbitrary (also zero) strides and storages shared by several tensors are
  honoured; the result is always C-contiguous.

Writing streams tensor by tensor (one tensor in memory at a time, so a 7 GB
checkpoint never needs two copies), into ``DST.partial`` which is renamed at
the end; the output is then re-opened and checked with marcache's strict C
safetensors reader.
"""
import argparse
import collections
import collections.abc
import hashlib
import io
import json
import math
import os
import pickle
import struct
import sys
import time
import zipfile
import zlib

import numpy as np

__all__ = ["convert", "read_checkpoint", "plan", "Checkpoint", "LazyTensor", "RestrictedUnpickler",
           "CheckpointError", "UnsafeCheckpointError", "KINDS", "DTYPES", "write_safetensors"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match the expected layout."""


class UnsafeCheckpointError(CheckpointError, pickle.UnpicklingError):
    """The pickle asks for a global outside the allowlist (it could run code)."""


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
        extent = 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride))
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


# ===========================================================================
# The restricted unpickler
# ===========================================================================

class _Frozen:
    """Base of the shared allowlist markers: a pickle's BUILD opcode must not be
    able to change them (they are reused by every load in the process)."""

    __slots__ = ()

    def __setstate__(self, state):
        raise CheckpointError(f"the pickle tries to modify {self!r}; refused")

    def __setattr__(self, name, value):
        raise CheckpointError(f"the pickle tries to set {name!r} on {self!r}; refused")


class _StorageType(_Frozen):
    """Marker for torch.<X>Storage / torch.UntypedStorage in persistent ids."""

    __slots__ = ("name", "dtype")

    def __init__(self, name, dtype):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "dtype", dtype)

    def __repr__(self):
        return f"torch.{self.name}"


class TorchDtype(_Frozen):
    """Inert stand-in for a torch dtype object (torch.float32, ...)."""

    __slots__ = ("name", "st")

    def __init__(self, name):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "st", _TORCH_DTYPES[name])

    def __repr__(self):
        return f"torch.{self.name}"

    def __eq__(self, other):
        return isinstance(other, TorchDtype) and other.name == self.name

    def __hash__(self):
        return hash(("torch", self.name))


class TorchDevice:
    """Inert stand-in for torch.device (checkpoints sometimes keep one in args)."""

    def __init__(self, type_, index=None):
        if not isinstance(type_, str) or not (index is None or isinstance(index, int)):
            raise CheckpointError(f"torch.device({type_!r}, {index!r}): unexpected arguments")
        self.type = type_
        self.index = index

    def __repr__(self):
        return f"device({self.type!r})" if self.index is None else f"device({self.type!r}, {self.index})"


class _TypeMarker(_Frozen):
    __slots__ = ("name",)

    def __init__(self, name):
        object.__setattr__(self, "name", name)

    def __repr__(self):
        return self.name


_TENSOR_TYPE = _TypeMarker("torch.Tensor")
_PARAMETER_TYPE = _TypeMarker("torch.nn.Parameter")


def _check_int(value, what, minimum=0):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CheckpointError(f"tensor {what} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_int_tuple(value, what):
    if not isinstance(value, (tuple, list)):
        raise CheckpointError(f"tensor {what} must be a tuple of integers, got {type(value).__name__}")
    return tuple(_check_int(v, what) for v in value)


def _make_tensor(storage, storage_offset, size, stride, dtype=None, requires_grad=False):
    if not isinstance(storage, _Storage):
        raise CheckpointError(f"a tensor rebuild got {type(storage).__name__} instead of a storage")
    offset = _check_int(storage_offset, "storage offset")
    shape = _check_int_tuple(size, "size")
    strides = _check_int_tuple(stride, "stride")
    if len(strides) != len(shape):
        raise CheckpointError(f"tensor size {list(shape)} and stride {list(strides)} differ in rank")
    if dtype is None:
        dtype = storage.dtype
    if dtype is None:
        raise CheckpointError(f"storage '{storage.key}' is untyped and the tensor names no dtype")
    if not isinstance(requires_grad, bool):
        raise CheckpointError(f"tensor requires_grad must be a bool, got {requires_grad!r}")
    t = LazyTensor(storage, offset, shape, strides, dtype, requires_grad)
    if t.numel:
        itemsize = _ST_DTYPES[dtype].itemsize
        extent = 1 + sum((s - 1) * st for s, st in zip(shape, strides))
        if (offset + extent) * itemsize > storage.nbytes:
            raise CheckpointError(
                f"a tensor of shape {list(shape)}, stride {list(strides)}, storage offset {offset} ({dtype}) "
                f"reaches element {offset + extent - 1} of storage '{storage.key}', which holds "
                f"{storage.nbytes // itemsize} elements")
    return t


def _check_hooks_and_metadata(backward_hooks, metadata):
    if backward_hooks is not None and not (isinstance(backward_hooks, dict) and not backward_hooks):
        raise CheckpointError("a tensor carries backward hooks; only plain tensors are supported")
    if metadata:
        raise CheckpointError(f"a tensor carries extra metadata {metadata!r} (a lazily conjugated or negated "
                              "view?); save a plain tensor with .clone() instead")


def _rebuild_tensor(storage, storage_offset, size, stride):
    """torch._utils._rebuild_tensor (old writers)."""
    return _make_tensor(storage, storage_offset, size, stride)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                       metadata=None):
    """torch._utils._rebuild_tensor_v2: only records where the elements are."""
    _check_hooks_and_metadata(backward_hooks, metadata)
    return _make_tensor(storage, storage_offset, size, stride, requires_grad=requires_grad)


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype,
                       metadata=None):
    """torch._utils._rebuild_tensor_v3: an untyped storage with an explicit dtype."""
    _check_hooks_and_metadata(backward_hooks, metadata)
    if not isinstance(dtype, TorchDtype) or dtype.st is None:
        raise CheckpointError(f"tensor dtype {dtype!r} is not supported (no safetensors equivalent)")
    return _make_tensor(storage, storage_offset, size, stride, dtype=dtype.st, requires_grad=requires_grad)


def _rebuild_parameter(data, requires_grad, backward_hooks, state=None):
    """torch._utils._rebuild_parameter(_with_state): a Parameter is its data."""
    if not isinstance(data, LazyTensor):
        raise CheckpointError(f"a Parameter rebuild got {type(data).__name__} instead of a tensor")
    _check_hooks_and_metadata(backward_hooks, None)
    if state:
        raise CheckpointError("a Parameter carries Python state; only plain parameters are supported")
    return data


_REBUILDERS = (_rebuild_tensor, _rebuild_tensor_v2, _rebuild_tensor_v3, _rebuild_parameter)


def _rebuild_from_type_v2(func, new_type, args, state):
    """torch._tensor._rebuild_from_type_v2: a tensor (sub)class wrapper."""
    if func not in _REBUILDERS or new_type not in (_TENSOR_TYPE, _PARAMETER_TYPE):
        raise CheckpointError(f"tensor rebuild through {func!r} as {new_type!r} is not supported")
    if not isinstance(args, tuple):
        raise CheckpointError("tensor rebuild arguments must be a tuple")
    if state:
        raise CheckpointError(f"a tensor carries Python state {sorted(state)!r}; only plain tensors are supported")
    return func(*args)


def _codecs_encode(text, encoding="utf-8"):
    """_codecs.encode as protocol-2 pickles use it for bytes objects (latin1 only)."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise CheckpointError(f"_codecs.encode({type(text).__name__}, {encoding!r}) is not allowed")
    return text.encode("latin1")


def _numpy_dtype(obj, align=False, copy=False):
    """numpy.dtype as pickled inside numpy scalars: plain numeric dtypes only. Always a
    fresh copy, so the BUILD (__setstate__) that follows in the pickle cannot touch
    NumPy's shared builtin dtype objects."""
    if not isinstance(obj, str):
        raise CheckpointError(f"numpy.dtype({obj!r}) is not allowed")
    dt = np.dtype(obj)
    if dt.kind not in "biuf" or dt.fields is not None or dt.subdtype is not None:
        raise CheckpointError(f"numpy.dtype({obj!r}) is not a plain numeric dtype; refused")
    return np.dtype(obj, False, True)


def _numpy_scalar(dtype, data=None):
    """numpy.core.multiarray.scalar: a NumPy scalar rebuilt from its raw bytes, with a
    clean dtype of the same kind, size and byte order."""
    if not isinstance(dtype, np.dtype) or not isinstance(data, (bytes, bytearray)):
        raise CheckpointError(f"numpy scalar of dtype {dtype!r} is not allowed")
    if dtype.kind not in "biuf" or dtype.fields is not None or dtype.subdtype is not None:
        raise CheckpointError(f"numpy scalar of dtype {dtype!r} is not a plain numeric scalar; refused")
    clean = np.dtype(dtype.str)
    if len(data) != clean.itemsize:
        raise CheckpointError(f"numpy scalar of dtype {clean} has {len(data)} bytes, expected {clean.itemsize}")
    return np.frombuffer(bytes(data), dtype=clean)[0]


_SAFE_CONTAINERS = {"set": set, "frozenset": frozenset, "slice": slice, "complex": complex}


def _reconstructor(cls, base, state):
    """copyreg._reconstructor (protocol 0/1 objects): only for allowlisted classes."""
    if cls is not argparse.Namespace or base is not object or state is not None:
        raise CheckpointError(f"copyreg._reconstructor({cls!r}, {base!r}) is not allowed")
    return argparse.Namespace()


def _allowlist():
    table = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("argparse", "Namespace"): argparse.Namespace,
        ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
        ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
        ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
        ("torch", "Tensor"): _TENSOR_TYPE,
        ("torch._tensor", "Tensor"): _TENSOR_TYPE,
        ("torch.nn.parameter", "Parameter"): _PARAMETER_TYPE,
        ("torch", "Size"): tuple,
        ("torch", "device"): TorchDevice,
        ("torch", "UntypedStorage"): _StorageType("UntypedStorage", "U8"),
        ("torch.storage", "UntypedStorage"): _StorageType("UntypedStorage", "U8"),
        ("copyreg", "_reconstructor"): _reconstructor,
        ("copy_reg", "_reconstructor"): _reconstructor,
        ("_codecs", "encode"): _codecs_encode,
        ("numpy", "dtype"): _numpy_dtype,
        ("numpy.core.multiarray", "scalar"): _numpy_scalar,
        ("numpy._core.multiarray", "scalar"): _numpy_scalar,
    }
    for name, dtype in _STORAGE_CLASSES.items():
        table[("torch", name)] = _StorageType(name, dtype)
    for name in _TORCH_DTYPES:
        table[("torch", name)] = TorchDtype(name)
    for module in ("builtins", "__builtin__"):
        for name, obj in _SAFE_CONTAINERS.items():
            table[(module, name)] = obj
    return table


#: (module, name) -> the object the unpickler gets instead; nothing else is allowed.
ALLOWED_GLOBALS = _allowlist()


class RestrictedUnpickler(pickle.Unpickler):
    """An Unpickler that resolves globals only from :data:`ALLOWED_GLOBALS` and
    storages through `persistent_load`. Anything else raises
    :class:`UnsafeCheckpointError` naming the global, before it is imported."""

    def __init__(self, file, path, persistent_load=None):
        super().__init__(file)
        self._path = path
        self._persistent = persistent_load

    def find_class(self, module, name):
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except (KeyError, TypeError):
            pass
        raise UnsafeCheckpointError(
            f"{self._path}: the pickle asks for the global '{module}.{name}', which is not on marcache's "
            "allowlist (tensor rebuild functions, storage classes, OrderedDict, argparse.Namespace and inert "
            "values); refusing to load it. Nothing from the file was executed.")

    def persistent_load(self, pid):
        if self._persistent is None:
            raise CheckpointError(f"{self._path}: unexpected persistent id {pid!r} in a header pickle")
        return self._persistent(pid)


# ===========================================================================
# Checkpoint files
# ===========================================================================

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PREFIX = b"\x80\x02\x8a\x0a" + _LEGACY_MAGIC.to_bytes(10, "little")


def _sniff(path):
    with open(path, "rb") as f:
        head = f.read(512)
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "zip"
    if head.startswith(_LEGACY_PREFIX):
        return "legacy"
    if len(head) >= 262 and head[257:262] == b"ustar":
        return "tar"
    return None


class Checkpoint(collections.abc.Mapping):
    """A PyTorch checkpoint opened without PyTorch (see :func:`read_checkpoint`).

    It is a read-only mapping over the top-level dict of the file; ``root`` is
    the whole unpickled object. Tensors are :class:`LazyTensor` objects read
    from the file on demand, so the file stays open until :meth:`close` (or the
    end of a ``with`` block).
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"checkpoint not found: {self.path}")
        if os.path.isdir(self.path):
            raise IsADirectoryError(f"checkpoint path is a directory: {self.path}")
        self.size = os.path.getsize(self.path)
        self._fh = None
        self._storages = {}
        self.byteorder = "little"
        kind = _sniff(self.path)
        self.format = kind
        if kind == "zip":
            self._open_zip()
        elif kind == "legacy":
            self._open_legacy()
        elif kind == "tar":
            raise CheckpointError(f"{self.path}: this is PyTorch's pre-0.4 tar checkpoint format, which marcache does "
                                  "not read; re-save it with a recent torch.save (zip format)")
        else:
            raise CheckpointError(f"{self.path}: not a PyTorch checkpoint (neither a torch.save zip archive nor the "
                                  "legacy torch.save stream: unknown leading bytes)")

    # ------------------------------------------------------------- plumbing
    def _file(self):
        if self._fh is None:
            self._fh = open(self.path, "rb")
        return self._fh

    def close(self):
        """Closes the file; tensors cannot be read afterwards."""
        if getattr(self, "_fh", None) is not None:
            self._fh.close()
            self._fh = None
        if getattr(self, "_zip", None) is not None:
            self._zip.close()
            self._zip = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    # ------------------------------------------------------------- mapping
    def _dict(self):
        if not isinstance(self.root, dict):
            raise TypeError(f"{self.path}: the checkpoint holds a {type(self.root).__name__}, not a dict")
        return self.root

    def __getitem__(self, key):
        return self._dict()[key]

    def __iter__(self):
        return iter(self._dict())

    def __len__(self):
        return len(self._dict())

    def __repr__(self):
        keys = list(self.root) if isinstance(self.root, dict) else type(self.root).__name__
        return f"Checkpoint({self.path!r}, format={self.format!r}, keys={keys})"

    def tensors(self):
        """(dotted path, LazyTensor) for every tensor reachable from the root, in
        container order (an object referenced twice is listed twice)."""
        out = []

        def walk(obj, prefix):
            if isinstance(obj, LazyTensor):
                out.append((prefix, obj))
            elif isinstance(obj, dict):
                for k, v in obj.items():
                    walk(v, f"{prefix}.{k}" if prefix else str(k))
            elif isinstance(obj, (list, tuple)):
                for i, v in enumerate(obj):
                    walk(v, f"{prefix}.{i}" if prefix else str(i))
            elif isinstance(obj, argparse.Namespace):
                walk(vars(obj), prefix)

        walk(self.root, "")
        return out

    # ------------------------------------------------------------- zip format
    def _open_zip(self):
        try:
            self._zip = zipfile.ZipFile(self.path)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
            raise CheckpointError(f"{self.path}: not a readable zip archive ({exc}); the file is probably truncated "
                                  "(an interrupted download?) or damaged") from None
        infos = {i.filename: i for i in self._zip.infolist()}
        pkls = sorted((n for n in infos if n == "data.pkl" or n.endswith("/data.pkl")), key=lambda n: n.count("/"))
        if not pkls:
            raise CheckpointError(f"{self.path}: the zip archive has no data.pkl record, so it is not a torch.save "
                                  f"checkpoint (records: {', '.join(list(infos)[:8])}{'...' if len(infos) > 8 else ''})")
        if len(pkls) > 1 and pkls[0].count("/") == pkls[1].count("/"):
            raise CheckpointError(f"{self.path}: the zip archive has several data.pkl records ({', '.join(pkls)})")
        self._prefix = pkls[0][: -len("data.pkl")]
        self._infos = infos
        order = infos.get(self._prefix + "byteorder")
        if order is not None:
            value = self._zip.read(order).decode("ascii", "replace").strip()
            if value not in ("little", "big"):
                raise CheckpointError(f"{self.path}: record '{order.filename}' says byte order {value!r}")
            self.byteorder = value
        try:
            data = self._zip.read(pkls[0])
        except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as exc:
            raise CheckpointError(f"{self.path}: cannot read record '{pkls[0]}': {exc}") from None
        finally:
            self._zip.close()   # storages are read through our own handle (_locate)
            self._zip = None
        self.root = self._unpickle(io.BytesIO(data), self._zip_persistent_load, pkls[0])

    def _zip_persistent_load(self, pid):
        if not isinstance(pid, tuple) or len(pid) != 5 or _ascii(pid[0]) != "storage":
            raise CheckpointError(f"{self.path}: unexpected persistent id {pid!r} (expected ('storage', type, key, "
                                  "location, numel))")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise CheckpointError(f"{self.path}: persistent id {pid!r} names no storage class")
        key = _ascii(key)
        _check_int(numel, "storage size")
        itemsize = _ST_DTYPES[storage_type.dtype].itemsize
        st = self._storages.get(key)
        if st is None:
            record = self._prefix + "data/" + key
            info = self._infos.get(record)
            if info is None:
                raise CheckpointError(f"{self.path}: storage '{key}' has no record '{record}' in the zip archive "
                                      "(a damaged or hand-edited file)")
            if info.compress_type != zipfile.ZIP_STORED:
                raise CheckpointError(f"{self.path}: record '{record}' is compressed; torch.save writes storages "
                                      "uncompressed, so this archive was re-packed: re-save it with torch.save")
            if numel * itemsize > info.file_size:
                raise CheckpointError(f"{self.path}: storage '{key}' should hold {numel} x {itemsize} bytes, but "
                                      f"record '{record}' has {info.file_size} bytes")
            st = _Storage(self, key, None if storage_type.name == "UntypedStorage" else storage_type.dtype,
                          info.file_size, record)
            st.crc = info.CRC
            st.record_nbytes = info.file_size
            st._zipinfo = info
            self._storages[key] = st
        elif st.dtype is not None and storage_type.name != "UntypedStorage" and st.dtype != storage_type.dtype:
            raise CheckpointError(f"{self.path}: storage '{key}' is used as both {st.dtype} and {storage_type.dtype}")
        return st

    def _locate(self, st):
        if st.file_offset is not None:
            return
        info = st._zipinfo
        f = self._file()
        f.seek(info.header_offset)
        header = f.read(30)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            raise CheckpointError(f"{self.path}: bad local header for record '{info.filename}': the file is damaged")
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        st.file_offset = info.header_offset + 30 + name_len + extra_len
        if st.file_offset + info.file_size > self.size:
            raise CheckpointError(f"{self.path}: record '{info.filename}' runs past the end of the file: truncated")

    # ------------------------------------------------------------- legacy format
    def _open_legacy(self):
        f = self._file()
        try:
            magic = RestrictedUnpickler(f, self.path).load()
            protocol = RestrictedUnpickler(f, self.path).load()
            sys_info = RestrictedUnpickler(f, self.path).load()
        except (EOFError, pickle.UnpicklingError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{self.path}: legacy checkpoint header is damaged ({exc})") from None
        if magic != _LEGACY_MAGIC or protocol != 1001:
            raise CheckpointError(f"{self.path}: legacy checkpoint with magic {magic!r} / protocol {protocol!r} "
                                  "(expected 1001): not a torch.save file")
        if isinstance(sys_info, dict) and sys_info.get("little_endian") is False:
            raise CheckpointError(f"{self.path}: a legacy checkpoint written on a big-endian machine; re-save it with "
                                  "a recent torch.save (zip format)")
        self._legacy_order = []
        self.root = self._unpickle(f, self._legacy_persistent_load, "the object pickle")
        keys = self._unpickle(f, None, "the storage key list")
        if not isinstance(keys, list):
            raise CheckpointError(f"{self.path}: legacy storage key list is a {type(keys).__name__}")
        pos = f.tell()
        for key in keys:
            key = _ascii(key)
            root = self._storages.get(key)
            if root is None:
                raise CheckpointError(f"{self.path}: storage '{key}' is listed but no tensor uses it")
            f.seek(pos)
            count = f.read(8)
            if len(count) != 8:
                raise CheckpointError(f"{self.path}: storage '{key}' is missing: the file is truncated")
            numel = int.from_bytes(count, self.byteorder, signed=True)
            itemsize = _ST_DTYPES[root.dtype].itemsize
            if numel * itemsize != root.record_nbytes:
                raise CheckpointError(f"{self.path}: storage '{key}' has {numel} elements on disk, the pickle expects "
                                      f"{root.record_nbytes // itemsize}")
            root.file_offset = pos + 8
            pos = root.file_offset + numel * itemsize
            if pos > self.size:
                raise CheckpointError(f"{self.path}: storage '{key}' runs past the end of the file: truncated")
        for st in self._storages.values():
            if st.file_offset is None:
                base = getattr(st, "_base", None)
                if base is None or base.file_offset is None:
                    raise CheckpointError(f"{self.path}: storage '{st.key}' has no data in the file")
                st.file_offset = base.file_offset + st._view_offset

    def _legacy_persistent_load(self, pid):
        if not isinstance(pid, tuple) or not pid:
            raise CheckpointError(f"{self.path}: unexpected persistent id {pid!r}")
        typename = _ascii(pid[0])
        if typename == "module":
            raise CheckpointError(f"{self.path}: the checkpoint pickles a whole nn.Module (source code and all); "
                                  "only state dicts of tensors are supported")
        if typename != "storage" or len(pid) != 6:
            raise CheckpointError(f"{self.path}: unexpected persistent id {pid!r}")
        _, storage_type, root_key, _location, numel, view = pid
        if not isinstance(storage_type, _StorageType) or storage_type.name == "UntypedStorage":
            raise CheckpointError(f"{self.path}: persistent id {pid!r} names no typed storage class")
        root_key = _ascii(root_key)
        _check_int(numel, "storage size")
        itemsize = _ST_DTYPES[storage_type.dtype].itemsize
        root = self._storages.get(root_key)
        if root is None:
            root = _Storage(self, root_key, storage_type.dtype, numel * itemsize, f"storage {root_key}")
            root.record_nbytes = numel * itemsize
            self._storages[root_key] = root
        if view is None:
            return root
        if not isinstance(view, tuple) or len(view) != 3:
            raise CheckpointError(f"{self.path}: bad storage view {view!r}")
        view_key, offset, size = _ascii(view[0]), _check_int(view[1], "view offset"), _check_int(view[2], "view size")
        if (offset + size) * itemsize > root.nbytes:
            raise CheckpointError(f"{self.path}: storage view '{view_key}' exceeds storage '{root_key}'")
        st = self._storages.get(view_key)
        if st is None:
            st = _Storage(self, view_key, storage_type.dtype, size * itemsize, f"view {view_key} of {root_key}")
            st._base = root
            st._view_offset = offset * itemsize
            self._storages[view_key] = st
        return st

    # ------------------------------------------------------------- shared
    def _unpickle(self, fileobj, persistent_load, what):
        try:
            return RestrictedUnpickler(fileobj, self.path, persistent_load).load()
        except CheckpointError:
            raise
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
                KeyError, struct.error) as exc:
            raise CheckpointError(f"{self.path}: cannot unpickle {what}: {type(exc).__name__}: {exc} "
                                  "(truncated or damaged file?)") from None


def _ascii(value):
    return value.decode("ascii") if isinstance(value, bytes) else str(value)


def read_checkpoint(path):
    """Opens a PyTorch checkpoint without PyTorch.

    Returns a :class:`Checkpoint`: a lazy read-only mapping over the file's
    top-level dict, whose tensors are :class:`LazyTensor` objects
    (``.numpy()`` reads one). Raises :class:`UnsafeCheckpointError` if the
    pickle names a global outside the allowlist, :class:`CheckpointError` for
    damaged or unknown files.
    """
    return Checkpoint(path)


# ===========================================================================
# Expected key sets (the specs in shared/spec)
# ===========================================================================

def _shape(t):
    return tuple(int(s) for s in t.shape)


def _block_shapes(prefix, dim, hidden):
    """One timm Block (mar.md 3.1): 12 tensors."""
    return [(f"{prefix}.norm1.weight", (dim,)), (f"{prefix}.norm1.bias", (dim,)),
            (f"{prefix}.attn.qkv.weight", (3 * dim, dim)), (f"{prefix}.attn.qkv.bias", (3 * dim,)),
            (f"{prefix}.attn.proj.weight", (dim, dim)), (f"{prefix}.attn.proj.bias", (dim,)),
            (f"{prefix}.norm2.weight", (dim,)), (f"{prefix}.norm2.bias", (dim,)),
            (f"{prefix}.mlp.fc1.weight", (hidden, dim)), (f"{prefix}.mlp.fc1.bias", (hidden,)),
            (f"{prefix}.mlp.fc2.weight", (dim, hidden)), (f"{prefix}.mlp.fc2.bias", (dim,))]


def mar_expected_shapes(width, depth, head_width, head_depth, decoder_width=None, decoder_depth=None,
                        seq_len=256, buffer_size=64, token_channels=16, num_classes=1000, mlp_hidden=None,
                        decoder_mlp_hidden=None):
    """key -> shape of a MAR state_dict (mar.md section 4, Appendix A; 364 / 476 /
    604 tensors for MAR-B / L / H). There are no buffers."""
    D, W, C = width, head_width, token_channels
    Dd = decoder_width or D
    dd = decoder_depth or depth
    L = seq_len + buffer_size
    h = "diffloss.net."
    s = [("fake_latent", (1, D)), ("encoder_pos_embed_learned", (1, L, D)), ("mask_token", (1, 1, Dd)),
         ("decoder_pos_embed_learned", (1, L, Dd)), ("diffusion_pos_embed_learned", (1, seq_len, Dd)),
         ("class_emb.weight", (num_classes, D)), ("z_proj.weight", (D, C)), ("z_proj.bias", (D,)),
         ("z_proj_ln.weight", (D,)), ("z_proj_ln.bias", (D,))]
    for i in range(depth):
        s += _block_shapes(f"encoder_blocks.{i}", D, mlp_hidden or 4 * D)
    s += [("encoder_norm.weight", (D,)), ("encoder_norm.bias", (D,)),
          ("decoder_embed.weight", (Dd, D)), ("decoder_embed.bias", (Dd,))]
    for i in range(dd):
        s += _block_shapes(f"decoder_blocks.{i}", Dd, decoder_mlp_hidden or 4 * Dd)
    s += [("decoder_norm.weight", (Dd,)), ("decoder_norm.bias", (Dd,)),
          (h + "time_embed.mlp.0.weight", (W, 256)), (h + "time_embed.mlp.0.bias", (W,)),
          (h + "time_embed.mlp.2.weight", (W, W)), (h + "time_embed.mlp.2.bias", (W,)),
          (h + "cond_embed.weight", (W, Dd)), (h + "cond_embed.bias", (W,)),
          (h + "input_proj.weight", (W, C)), (h + "input_proj.bias", (W,))]
    for j in range(head_depth):
        p = f"{h}res_blocks.{j}."
        s += [(p + "in_ln.weight", (W,)), (p + "in_ln.bias", (W,)),
              (p + "mlp.0.weight", (W, W)), (p + "mlp.0.bias", (W,)),
              (p + "mlp.2.weight", (W, W)), (p + "mlp.2.bias", (W,)),
              (p + "adaLN_modulation.1.weight", (3 * W, W)), (p + "adaLN_modulation.1.bias", (3 * W,))]
    s += [(h + "final_layer.linear.weight", (2 * C, W)), (h + "final_layer.linear.bias", (2 * C,)),
          (h + "final_layer.adaLN_modulation.1.weight", (2 * W, W)),
          (h + "final_layer.adaLN_modulation.1.bias", (2 * W,))]
    return collections.OrderedDict(s)


#: The released MAR configurations (mar.md 1.1).
MAR_CONFIGS = {
    "mar_base": dict(width=768, depth=12, heads=12, head_width=1024, head_depth=6),
    "mar_large": dict(width=1024, depth=16, heads=16, head_width=1280, head_depth=8),
    "mar_huge": dict(width=1280, depth=20, heads=16, head_width=1536, head_depth=12),
}
#: Attention heads are not in the weights (mar.md 4.2): the released widths.
MAR_HEADS_FOR_WIDTH = {768: 12, 1024: 16, 1280: 16}


def _resnet_shapes(prefix, cin, cout):
    s = [(f"{prefix}.norm1.weight", (cin,)), (f"{prefix}.norm1.bias", (cin,)),
         (f"{prefix}.conv1.weight", (cout, cin, 3, 3)), (f"{prefix}.conv1.bias", (cout,)),
         (f"{prefix}.norm2.weight", (cout,)), (f"{prefix}.norm2.bias", (cout,)),
         (f"{prefix}.conv2.weight", (cout, cout, 3, 3)), (f"{prefix}.conv2.bias", (cout,))]
    if cin != cout:
        s += [(f"{prefix}.nin_shortcut.weight", (cout, cin, 1, 1)), (f"{prefix}.nin_shortcut.bias", (cout,))]
    return s


def _attn_shapes(prefix, c, fused_qkv):
    s = [(f"{prefix}.norm.weight", (c,)), (f"{prefix}.norm.bias", (c,))]
    if fused_qkv:   # VAR's VQVAE AttnBlock: one qkv conv c -> 3c (var_fastvar.md B4)
        s += [(f"{prefix}.qkv.weight", (3 * c, c, 1, 1)), (f"{prefix}.qkv.bias", (3 * c,))]
    else:           # LDM / MAR KL-16 AttnBlock: q, k, v convs (mar.md 8.1)
        for n in ("q", "k", "v"):
            s += [(f"{prefix}.{n}.weight", (c, c, 1, 1)), (f"{prefix}.{n}.bias", (c,))]
    s += [(f"{prefix}.proj_out.weight", (c, c, 1, 1)), (f"{prefix}.proj_out.bias", (c,))]
    return s


def decoder_expected_shapes(ch, ch_mult, num_res_blocks, z_channels, post_quant_ks, fused_qkv, top_attention,
                            out_ch=3):
    """key -> shape of post_quant_conv + an LDM-style decoder: MAR's KL-16
    (mar.md 8.3 / Appendix B: post_quant 1x1, q/k/v attention in the mid block
    only, 166 tensors) or VAR's VQVAE (var_fastvar.md B4/B5: post_quant 3x3,
    fused qkv, attention also after every block of the top level, 178 + 2)."""
    top = ch * ch_mult[-1]
    z = z_channels
    k = post_quant_ks
    s = [("post_quant_conv.weight", (z, z, k, k)), ("post_quant_conv.bias", (z,)),
         ("decoder.conv_in.weight", (top, z, 3, 3)), ("decoder.conv_in.bias", (top,))]
    s += _resnet_shapes("decoder.mid.block_1", top, top)
    s += _attn_shapes("decoder.mid.attn_1", top, fused_qkv)
    s += _resnet_shapes("decoder.mid.block_2", top, top)
    levels = len(ch_mult)
    block_in = top
    per_level = {}
    for level in reversed(range(levels)):
        out = ch * ch_mult[level]
        entries = []
        for b in range(num_res_blocks + 1):
            entries += _resnet_shapes(f"decoder.up.{level}.block.{b}", block_in, out)
            block_in = out
            if top_attention and level == levels - 1:
                entries += _attn_shapes(f"decoder.up.{level}.attn.{b}", out, fused_qkv)
        if level != 0:
            entries += [(f"decoder.up.{level}.upsample.conv.weight", (out, out, 3, 3)),
                        (f"decoder.up.{level}.upsample.conv.bias", (out,))]
        per_level[level] = entries
    for level in range(levels):
        s += per_level[level]
    bottom = ch * ch_mult[0]
    s += [("decoder.norm_out.weight", (bottom,)), ("decoder.norm_out.bias", (bottom,)),
          ("decoder.conv_out.weight", (out_ch, bottom, 3, 3)), ("decoder.conv_out.bias", (out_ch,))]
    return collections.OrderedDict(s)


def var_expected_shapes(depth, width, heads, vocab=4096, tokens=680, vae_channels=32, num_classes=1000,
                        num_levels=10, ffn_hidden=None):
    """key -> (shape, dtype) of a VAR transformer state_dict (var_fastvar.md A3):
    12 + 13 * depth keys, buffers included (lvl_1L is int64)."""
    C, L = width, tokens
    hidden = ffn_hidden or 4 * C
    s = [("pos_start", (1, 1, C)), ("pos_1LC", (1, L, C)), ("lvl_1L", (1, L)),
         ("attn_bias_for_masking", (1, 1, L, L)), ("word_embed.weight", (C, vae_channels)),
         ("word_embed.bias", (C,)), ("class_emb.weight", (num_classes + 1, C)), ("lvl_embed.weight", (num_levels, C)),
         ("head_nm.ada_lin.1.weight", (2 * C, C)), ("head_nm.ada_lin.1.bias", (2 * C,)),
         ("head.weight", (vocab, C)), ("head.bias", (vocab,))]
    for i in range(depth):
        p = f"blocks.{i}."
        s += [(p + "attn.scale_mul_1H11", (1, heads, 1, 1)), (p + "attn.q_bias", (C,)), (p + "attn.v_bias", (C,)),
              (p + "attn.zero_k_bias", (C,)), (p + "attn.mat_qkv.weight", (3 * C, C)),
              (p + "attn.proj.weight", (C, C)), (p + "attn.proj.bias", (C,)),
              (p + "ffn.fc1.weight", (hidden, C)), (p + "ffn.fc1.bias", (hidden,)),
              (p + "ffn.fc2.weight", (C, hidden)), (p + "ffn.fc2.bias", (C,)),
              (p + "ada_lin.1.weight", (6 * C, C)), (p + "ada_lin.1.bias", (6 * C,))]
    return collections.OrderedDict(s)


def _var_is_buffer(name):
    return name in ("lvl_1L", "attn_bias_for_masking") or name.endswith(".attn.zero_k_bias")


# FID Inception (pytorch-fid FIDInceptionA/C/E_1/E_2 on torchvision's Inception3,
# num_classes=1008, aux_logits=False; eval_and_formats.md section 3). Each entry:
# BasicConv2d name -> (in, out, kh, kw); every BasicConv2d has a bias-free conv
# and a BatchNorm2d (weight, bias, running_mean, running_var[, num_batches_tracked]).
def _inception_convs():
    convs = [("Conv2d_1a_3x3", 3, 32, 3, 3), ("Conv2d_2a_3x3", 32, 32, 3, 3), ("Conv2d_2b_3x3", 32, 64, 3, 3),
             ("Conv2d_3b_1x1", 64, 80, 1, 1), ("Conv2d_4a_3x3", 80, 192, 3, 3)]

    def a(name, cin, pool):
        return [(f"{name}.branch1x1", cin, 64, 1, 1), (f"{name}.branch5x5_1", cin, 48, 1, 1),
                (f"{name}.branch5x5_2", 48, 64, 5, 5), (f"{name}.branch3x3dbl_1", cin, 64, 1, 1),
                (f"{name}.branch3x3dbl_2", 64, 96, 3, 3), (f"{name}.branch3x3dbl_3", 96, 96, 3, 3),
                (f"{name}.branch_pool", cin, pool, 1, 1)]

    def c(name, c7):
        return [(f"{name}.branch1x1", 768, 192, 1, 1), (f"{name}.branch7x7_1", 768, c7, 1, 1),
                (f"{name}.branch7x7_2", c7, c7, 1, 7), (f"{name}.branch7x7_3", c7, 192, 7, 1),
                (f"{name}.branch7x7dbl_1", 768, c7, 1, 1), (f"{name}.branch7x7dbl_2", c7, c7, 7, 1),
                (f"{name}.branch7x7dbl_3", c7, c7, 1, 7), (f"{name}.branch7x7dbl_4", c7, c7, 7, 1),
                (f"{name}.branch7x7dbl_5", c7, 192, 1, 7), (f"{name}.branch_pool", 768, 192, 1, 1)]

    def e(name, cin):
        return [(f"{name}.branch1x1", cin, 320, 1, 1), (f"{name}.branch3x3_1", cin, 384, 1, 1),
                (f"{name}.branch3x3_2a", 384, 384, 1, 3), (f"{name}.branch3x3_2b", 384, 384, 3, 1),
                (f"{name}.branch3x3dbl_1", cin, 448, 1, 1), (f"{name}.branch3x3dbl_2", 448, 384, 3, 3),
                (f"{name}.branch3x3dbl_3a", 384, 384, 1, 3), (f"{name}.branch3x3dbl_3b", 384, 384, 3, 1),
                (f"{name}.branch_pool", cin, 192, 1, 1)]

    convs += a("Mixed_5b", 192, 32) + a("Mixed_5c", 256, 64) + a("Mixed_5d", 288, 64)
    convs += [("Mixed_6a.branch3x3", 288, 384, 3, 3), ("Mixed_6a.branch3x3dbl_1", 288, 64, 1, 1),
              ("Mixed_6a.branch3x3dbl_2", 64, 96, 3, 3), ("Mixed_6a.branch3x3dbl_3", 96, 96, 3, 3)]
    convs += c("Mixed_6b", 128) + c("Mixed_6c", 160) + c("Mixed_6d", 160) + c("Mixed_6e", 192)
    convs += [("Mixed_7a.branch3x3_1", 768, 192, 1, 1), ("Mixed_7a.branch3x3_2", 192, 320, 3, 3),
              ("Mixed_7a.branch7x7x3_1", 768, 192, 1, 1), ("Mixed_7a.branch7x7x3_2", 192, 192, 1, 7),
              ("Mixed_7a.branch7x7x3_3", 192, 192, 7, 1), ("Mixed_7a.branch7x7x3_4", 192, 192, 3, 3)]
    convs += e("Mixed_7b", 1280) + e("Mixed_7c", 2048)
    return convs


INCEPTION_NUM_CLASSES = 1008


def inception_expected_shapes():
    """key -> shape of the FID Inception state_dict (94 BasicConv2d x 5 + fc = 472
    tensors; the optional BatchNorm num_batches_tracked counters are extra)."""
    s = []
    for name, cin, cout, kh, kw in _inception_convs():
        s += [(f"{name}.conv.weight", (cout, cin, kh, kw)), (f"{name}.bn.weight", (cout,)),
              (f"{name}.bn.bias", (cout,)), (f"{name}.bn.running_mean", (cout,)), (f"{name}.bn.running_var", (cout,))]
    s += [("fc.weight", (INCEPTION_NUM_CLASSES, 2048)), ("fc.bias", (INCEPTION_NUM_CLASSES,))]
    return collections.OrderedDict(s)


# ===========================================================================
# Plans: select, validate, describe
# ===========================================================================

class Plan:
    """What convert() will write: `tensors` (name -> LazyTensor, validated),
    `metadata` (str -> str), `dropped` (names read but not written), `notes`."""

    def __init__(self, kind, tensors, metadata, dropped=(), notes=()):
        self.kind = kind
        self.tensors = tensors
        self.metadata = metadata
        self.dropped = list(dropped)
        self.notes = list(notes)


def _fmt_shape(shape):
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _compare(path, what, expected, actual, optional=()):
    """Raises CheckpointError naming every missing key, every unexpected key and
    every wrong shape of `actual` (name -> tensor) against `expected`
    (name -> shape). Keys in `optional` may be present or absent."""
    missing = [k for k in expected if k not in actual]
    extra = [k for k in actual if k not in expected and k not in optional]
    wrong = [f"{k}: expected {_fmt_shape(expected[k])}, found {_fmt_shape(_shape(actual[k]))}"
             for k in expected if k in actual and _shape(actual[k]) != tuple(expected[k])]
    if not (missing or extra or wrong):
        return
    lines = [f"{path}: does not match the {what} ({len(expected)} tensors expected, {len(actual)} found):"]
    if missing:
        lines.append(f"  missing ({len(missing)}): " + ", ".join(missing))
    if extra:
        lines.append(f"  unexpected ({len(extra)}): " + ", ".join(extra))
    if wrong:
        lines.append(f"  wrong shape ({len(wrong)}):\n    " + "\n    ".join(wrong))
    raise CheckpointError("\n".join(lines))


def _check_float(path, tensors):
    bad = [f"{k} ({t.dtype})" for k, t in tensors.items() if t.dtype not in _FLOAT_DTYPES]
    if bad:
        raise CheckpointError(f"{path}: these weights are not floating point: " + ", ".join(bad))


def _is_tensor(value):
    """A LazyTensor, or anything with a tuple `shape` and a safetensors `dtype` string
    (the plans only look at names, shapes and dtypes)."""
    return isinstance(value, LazyTensor) or (isinstance(getattr(value, "shape", None), tuple) and
                                             getattr(value, "dtype", None) in _ST_DTYPES)


def _state_dict(root, path, prefer=("model", "state_dict")):
    """The tensor dict of a checkpoint: root[k] for the first k of `prefer`
    present, else root itself. Every value must be a tensor."""
    if not isinstance(root, dict):
        raise CheckpointError(f"{path}: the checkpoint holds a {type(root).__name__}, expected a dict")
    where = None
    sd = root
    for key in prefer:
        if key in root and isinstance(root[key], dict):
            sd, where = root[key], key
            break
    bad = [f"{k!r} ({type(v).__name__})" for k, v in sd.items() if not isinstance(k, str) or not _is_tensor(v)]
    if bad:
        inside = f"['{where}']" if where else ""
        raise CheckpointError(f"{path}{inside} is not a state dict of tensors: " + ", ".join(bad[:20]) +
                              (f" and {len(bad) - 20} more" if len(bad) > 20 else ""))
    return sd, where


def _dim(sd, key, axis):
    t = sd.get(key)
    if t is None or len(t.shape) <= axis:
        return None
    return int(t.shape[axis])


def _vote(*values):
    """The most common of the values that are not None (the earliest on a tie), so
    that one wrongly shaped tensor is reported as such instead of skewing the
    configuration read back from the others."""
    seen = [v for v in values if v is not None]
    if not seen:
        return None
    return max(seen, key=lambda v: (seen.count(v), -seen.index(v)))


def _first(*values):
    for v in values:
        if v is not None:
            return v
    return None


def _count(sd, prefix):
    """1 + the largest i of keys prefix + 'i.' (0 if none)."""
    n = 0
    for k in sd:
        if k.startswith(prefix):
            head = k[len(prefix):].split(".", 1)[0]
            if head.isdigit():
                n = max(n, int(head) + 1)
    return n


def _sniff_kind(sd):
    if "class_emb.weight" in sd and any(k.startswith("diffloss.") for k in sd):
        return "mar"
    if "word_embed.weight" in sd and "pos_1LC" in sd:
        return "var"
    if "quantize.embedding.weight" in sd:
        return "vqvae"
    if "decoder.conv_in.weight" in sd:
        return "vae-kl16"
    if "Mixed_7c.branch_pool.conv.weight" in sd:
        return "inception"
    return None


def _wrong_kind(path, kind, sd):
    found = _sniff_kind(sd)
    hint = f" It looks like a '{found}' checkpoint: use `convert {found}`." if found and found != kind else ""
    some = ", ".join(list(sd)[:6])
    return CheckpointError(f"{path}: not a {kind} checkpoint (keys begin {some}...).{hint}")


def plan_mar(ck, weights="model_ema", heads=None):
    """MAR (mar.md 4, 9): ckpt[weights] with every key and shape of the config read
    back from the shapes; records depth / width / heads / head size."""
    path = ck.path
    root = ck.root
    if weights not in ("model_ema", "model"):
        raise ValueError(f"weights must be 'model_ema' or 'model', got {weights!r}")
    if isinstance(root, dict) and weights in root:
        sd, where = _state_dict(root, path, prefer=(weights,))
    elif isinstance(root, dict) and "class_emb.weight" in root:
        sd, where = _state_dict(root, path, prefer=())
    else:
        keys = list(root) if isinstance(root, dict) else type(root).__name__
        hint = ""
        if isinstance(root, dict):
            inner = next((root[k] for k in ("model", "model_ema", "state_dict") if isinstance(root.get(k), dict)), root)
            found = _sniff_kind(inner)
            if found == "mar":
                other = "model" if weights == "model_ema" else "model_ema"
                hint = f" It has '{other}': pass --weights {other} (weights='{other}')."
            elif found:
                hint = f" It looks like a '{found}' checkpoint: use `convert {found}`."
        raise CheckpointError(f"{path}: no '{weights}' entry (top-level keys: {keys}); a MAR checkpoint-last.pth "
                              f"holds 'model' and 'model_ema'.{hint}")
    dropped = [k for k in root if k != where] if where else []
    h = "diffloss.net."
    D = _vote(_dim(sd, "class_emb.weight", 1), _dim(sd, "fake_latent", 1), _dim(sd, "z_proj.weight", 0),
              _dim(sd, "encoder_norm.weight", 0), _dim(sd, "encoder_pos_embed_learned", 2),
              _dim(sd, "decoder_embed.weight", 1))
    W = _vote(_dim(sd, h + "input_proj.weight", 0), _dim(sd, h + "time_embed.mlp.0.weight", 0),
              _dim(sd, h + "cond_embed.weight", 0), _dim(sd, h + "final_layer.linear.weight", 1))
    depth = _count(sd, "encoder_blocks.")
    if D is None or W is None or depth == 0:
        raise _wrong_kind(path, "MAR", sd)
    Dd = _first(_vote(_dim(sd, "decoder_embed.weight", 0), _dim(sd, "decoder_norm.weight", 0),
                      _dim(sd, "mask_token", 2), _dim(sd, h + "cond_embed.weight", 1),
                      _dim(sd, "diffusion_pos_embed_learned", 2)), D)
    S = _first(_dim(sd, "diffusion_pos_embed_learned", 1), 256)
    L = _first(_vote(_dim(sd, "encoder_pos_embed_learned", 1), _dim(sd, "decoder_pos_embed_learned", 1)), S + 64)
    final = _dim(sd, h + "final_layer.linear.weight", 0)
    cfg = dict(width=D, depth=depth, decoder_width=Dd, decoder_depth=_count(sd, "decoder_blocks."),
               head_width=W, head_depth=_count(sd, h + "res_blocks."), seq_len=S, buffer_size=L - S,
               token_channels=_first(_vote(_dim(sd, "z_proj.weight", 1), _dim(sd, h + "input_proj.weight", 1),
                                           final // 2 if final else None), 16),
               num_classes=_first(_dim(sd, "class_emb.weight", 0), 1000),
               mlp_hidden=_first(_dim(sd, "encoder_blocks.0.mlp.fc1.weight", 0), 4 * D),
               decoder_mlp_hidden=_first(_dim(sd, "decoder_blocks.0.mlp.fc1.weight", 0), 4 * Dd))
    expected = mar_expected_shapes(**cfg)
    name = next((n for n, c in MAR_CONFIGS.items() if all(cfg[k] == c[k] for k in
                                                           ("width", "depth", "head_width", "head_depth"))
                 and cfg["decoder_width"] == c["width"] and cfg["decoder_depth"] == c["depth"]), None)
    where_txt = f"['{where}']" if where else ""
    _compare(path + where_txt, f"MAR key set (mar.md section 4) for width {D}, depth {depth}+{cfg['decoder_depth']}, "
             f"head {W}x{cfg['head_depth']}", expected, sd)
    _check_float(path, sd)
    if heads is not None:
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
            raise ValueError(f"heads must be a positive integer, got {heads!r}")
        enc_heads = dec_heads = heads
    else:
        enc_heads, dec_heads = MAR_HEADS_FOR_WIDTH.get(D), MAR_HEADS_FOR_WIDTH.get(Dd)
        if enc_heads is None or dec_heads is None:
            raise CheckpointError(f"{path}: width {D if enc_heads is None else Dd} is not one of the released MAR "
                                  "configs (768, 1024, 1280) and attention heads are not stored in the weights "
                                  "(mar.md 4.2): pass --heads N (heads=N)")
    for w, h in ((D, enc_heads), (Dd, dec_heads)):
        if w % h:
            raise CheckpointError(f"{path}: width {w} is not divisible by {h} heads")
    tensors = collections.OrderedDict((k, sd[k]) for k in expected)
    meta = {"config": name or "custom", "weights": where or "(top level)", "width": D, "depth": depth,
            "decoder_width": Dd, "decoder_depth": cfg["decoder_depth"], "heads": enc_heads,
            "decoder_heads": dec_heads, "head_dim": D // enc_heads, "head_width": W, "head_depth": cfg["head_depth"],
            "mlp_hidden": cfg["mlp_hidden"], "seq_len": S, "buffer_size": L - S,
            "token_channels": cfg["token_channels"], "num_classes": cfg["num_classes"]}
    notes = [f"MAR {name or 'custom config'}: width {D}, depth {depth}+{cfg['decoder_depth']}, heads {enc_heads} "
             f"(head dim {D // enc_heads}), diffusion head {W} x {cfg['head_depth']}, from '{meta['weights']}'"]
    return Plan("mar", tensors, meta, dropped, notes)


def _decoder_config(path, sd, kind):
    """(ch, ch_mult, num_res_blocks, z) of an LDM-style decoder, read back from shapes.
    ch is the gcd of the level widths (the rule of csrc/models/vae.c)."""
    z = _first(_dim(sd, "post_quant_conv.weight", 0), _dim(sd, "decoder.conv_in.weight", 1))
    levels = _count(sd, "decoder.up.")
    if z is None or levels == 0:
        raise _wrong_kind(path, kind, sd)
    widths = []
    for level in range(levels):
        w = _first(_dim(sd, f"decoder.up.{level}.block.0.conv1.weight", 0),
                   _dim(sd, f"decoder.up.{level}.block.0.norm2.weight", 0))
        if w is None:
            raise CheckpointError(f"{path}: missing decoder.up.{level}.block.0.conv1.weight, so the width of decoder "
                                  f"level {level} is unknown")
        widths.append(w)
    ch = 0
    for w in widths:
        ch = math.gcd(ch, w)
    nrb = max(_count(sd, f"decoder.up.{level}.block.") for level in range(levels)) - 1
    return ch, tuple(w // ch for w in widths), nrb, z


def _split_decoder(sd):
    keep = collections.OrderedDict((k, v) for k, v in sd.items()
                                   if k.startswith("decoder.") or k.startswith("post_quant_conv."))
    return keep, [k for k in sd if k not in keep]


def _dropped_summary(dropped):
    groups = collections.OrderedDict()
    for k in dropped:
        groups.setdefault(k.split(".", 1)[0], []).append(k)
    return ", ".join(f"{g}.* ({len(ks)})" if len(ks) > 1 else ks[0] for g, ks in groups.items())


def plan_vae_kl16(ck):
    """MAR's KL-16 VAE (mar.md 8, 9): keeps post_quant_conv.* + decoder.*, which must be
    exactly the decoder of the config read back from the shapes (166 tensors for
    the released kl16.ckpt). Refuses LDM kl-f16 weights (up-path attention)."""
    path = ck.path
    sd, where = _state_dict(ck.root, path, prefer=("model", "state_dict"))
    attn = [k for k in sd if k.startswith("decoder.up.") and ".attn." in k]
    if attn:
        raise CheckpointError(
            f"{path}: the decoder has up-path attention ({attn[0]}, {len(attn)} such tensors): these are LDM kl-f16 "
            "weights, not MAR's KL-16 VAE, whose decoder has attention only in the mid block (mar.md 8.1). The two "
            "are not interchangeable: LDM weights would load partially and decode wrongly. Use MAR's kl16.ckpt.")
    if any(k.startswith("first_stage_model.") for k in sd):
        raise CheckpointError(f"{path}: keys start with 'first_stage_model.': this is a whole latent-diffusion model, "
                              "not MAR's kl16.ckpt")
    keep, dropped = _split_decoder(sd)
    ch, ch_mult, nrb, z = _decoder_config(path, keep, "KL-16 VAE")
    expected = decoder_expected_shapes(ch, ch_mult, nrb, z, post_quant_ks=1, fused_qkv=False, top_attention=False)
    official = (ch, ch_mult, nrb, z) == (128, (1, 1, 2, 2, 4), 2, 16)
    inside = f"['{where}']" if where else ""
    _compare(path + inside, f"KL-16 decoder key set (mar.md 8.3) for ch={ch}, ch_mult={ch_mult}, "
             f"num_res_blocks={nrb}, z_channels={z}", expected, keep)
    _check_float(path, keep)
    tensors = collections.OrderedDict((k, keep[k]) for k in expected)
    meta = {"ch": ch, "ch_mult": ",".join(map(str, ch_mult)), "num_res_blocks": nrb, "z_channels": z,
            "official_config": "yes" if official else "no", "weights": where or "(top level)"}
    notes = [f"KL-16 decoder: ch {ch}, ch_mult {ch_mult}, num_res_blocks {nrb}, z {z}"
             + ("" if official else " (not the released kl16 config)")]
    if dropped:
        notes.append(f"dropped (encoder side): {_dropped_summary(dropped)}")
    return Plan("vae-kl16", tensors, meta, dropped, notes)


def plan_vqvae(ck):
    """VAR's VQVAE (var_fastvar.md B5): keeps the decoding tensors (decoder.*,
    post_quant_conv.*, quantize.embedding.weight, the Phi convs; 189 for
    vae_ch160v4096z32.pth); the encoder side and training statistics are dropped."""
    path = ck.path
    sd, where = _state_dict(ck.root, path, prefer=("model", "state_dict"))
    if "quantize.embedding.weight" not in sd:
        raise _wrong_kind(path, "VQVAE", sd)
    keep, dropped = _split_decoder(sd)
    ch, ch_mult, nrb, z = _decoder_config(path, keep, "VQVAE")
    vocab = _dim(sd, "quantize.embedding.weight", 0)
    n_phi = _count(sd, "quantize.quant_resi.qresi_ls.")
    expected = decoder_expected_shapes(ch, ch_mult, nrb, z, post_quant_ks=3, fused_qkv=True, top_attention=True)
    expected["quantize.embedding.weight"] = (vocab, z)
    for i in range(n_phi):
        expected[f"quantize.quant_resi.qresi_ls.{i}.weight"] = (z, z, 3, 3)
        expected[f"quantize.quant_resi.qresi_ls.{i}.bias"] = (z,)
    for k in list(dropped):
        if k in expected:
            keep[k] = sd[k]
            dropped.remove(k)
    others = [k for k in dropped if not (k.startswith("encoder.") or k.startswith("quant_conv.") or
                                         k == "quantize.ema_vocab_hit_SV")]
    for k in others:     # unknown keys are errors, not silently dropped
        keep[k] = sd[k]
        dropped.remove(k)
    if n_phi == 0:
        expected["quantize.quant_resi.qresi_ls.0.weight"] = (z, z, 3, 3)
        expected["quantize.quant_resi.qresi_ls.0.bias"] = (z,)
    official = (ch, ch_mult, nrb, z, vocab, n_phi) == (160, (1, 1, 2, 2, 4), 2, 32, 4096, 4)
    _compare(path, f"VQVAE decoding key set (var_fastvar.md B5) for ch={ch}, ch_mult={ch_mult}, "
             f"num_res_blocks={nrb}, z_channels={z}, vocab={vocab}, {n_phi} Phi convs", expected, keep)
    _check_float(path, keep)
    tensors = collections.OrderedDict((k, keep[k]) for k in expected)
    meta = {"ch": ch, "ch_mult": ",".join(map(str, ch_mult)), "num_res_blocks": nrb, "z_channels": z,
            "vocab": vocab, "num_phi": n_phi, "quant_resi": "0.5", "official_config": "yes" if official else "no"}
    notes = [f"VQVAE: ch {ch}, ch_mult {ch_mult}, vocab {vocab} x {z}, {n_phi} Phi convs"
             + ("" if official else " (not the released vae_ch160v4096z32 config)")]
    if dropped:
        notes.append(f"dropped (encoder side, training statistics): {_dropped_summary(dropped)}")
    return Plan("vqvae", tensors, meta, dropped, notes)


def plan_var(ck):
    """VAR transformer (var_fastvar.md A2, A3): a flat state dict of 12 + 13 * depth keys.
    All keys and shapes are checked; the buffers lvl_1L, attn_bias_for_masking and
    blocks.*.attn.zero_k_bias are derivable and are not written."""
    path = ck.path
    sd, where = _state_dict(ck.root, path, prefer=("model", "state_dict"))
    C = _first(_dim(sd, "pos_start", 2), _dim(sd, "word_embed.weight", 0), _dim(sd, "class_emb.weight", 1))
    depth = _count(sd, "blocks.")
    if C is None or depth == 0 or "word_embed.weight" not in sd:
        raise _wrong_kind(path, "VAR", sd)
    heads = _first(_dim(sd, "blocks.0.attn.scale_mul_1H11", 1), depth)
    cfg = dict(depth=depth, width=C, heads=heads, vocab=_first(_dim(sd, "head.weight", 0), 4096),
               tokens=_first(_dim(sd, "pos_1LC", 1), 680), vae_channels=_first(_dim(sd, "word_embed.weight", 1), 32),
               num_classes=_first(_dim(sd, "class_emb.weight", 0), 1001) - 1,
               num_levels=_first(_dim(sd, "lvl_embed.weight", 0), 10),
               ffn_hidden=_first(_dim(sd, "blocks.0.ffn.fc1.weight", 0), 4 * C))
    expected = var_expected_shapes(**cfg)
    _compare(path, f"VAR key set (var_fastvar.md A3) for depth {depth}, width {C}, {heads} heads", expected, sd)
    if C % heads:
        raise CheckpointError(f"{path}: width {C} is not divisible by {heads} heads")
    official = (C == 64 * depth and heads == depth and cfg["vocab"] == 4096 and cfg["tokens"] == 680 and
                cfg["vae_channels"] == 32 and cfg["num_classes"] == 1000 and cfg["num_levels"] == 10)
    tensors = collections.OrderedDict((k, sd[k]) for k in expected if not _var_is_buffer(k))
    _check_float(path, tensors)
    dropped = [k for k in sd if k not in tensors]
    meta = {"depth": depth, "width": C, "heads": heads, "head_dim": C // heads, "ffn_hidden": cfg["ffn_hidden"],
            "vocab": cfg["vocab"], "tokens": cfg["tokens"], "vae_channels": cfg["vae_channels"],
            "num_classes": cfg["num_classes"], "num_levels": cfg["num_levels"], "shared_aln": "false",
            "attn_l2_norm": "true", "official_config": "yes" if official else "no"}
    notes = [f"VAR depth {depth}: width {C}, {heads} heads (head dim {C // heads}), vocab {cfg['vocab']}, "
             f"{cfg['tokens']} tokens" + ("" if official else " (not a released d16/d20/d24/d30 config)"),
             f"dropped buffers: {len(dropped)} (lvl_1L, attn_bias_for_masking, blocks.*.attn.zero_k_bias)"]
    return Plan("var", tensors, meta, dropped, notes)


def plan_inception(ck):
    """FID Inception (eval_and_formats.md 3; pytorch-fid's pt_inception-2015-12-05):
    the 472 tensors of Inception3(num_classes=1008, aux_logits=False) with the FID
    blocks; BatchNorm num_batches_tracked counters, if present, are dropped."""
    path = ck.path
    sd, where = _state_dict(ck.root, path, prefer=("state_dict", "model"))
    if "Conv2d_1a_3x3.conv.weight" not in sd and "Mixed_7c.branch_pool.conv.weight" not in sd:
        raise _wrong_kind(path, "FID Inception", sd)
    expected = inception_expected_shapes()
    counters = [k for k in sd if k.endswith(".bn.num_batches_tracked") and k[: -len("num_batches_tracked")] +
                "running_mean" in expected]
    hint = ""
    if any(k.startswith("AuxLogits.") for k in sd) or _dim(sd, "fc.weight", 0) == 1000:
        hint = " (this looks like torchvision's ImageNet Inception-v3, not the FID weights)"
    _compare(path, "FID Inception key set (eval_and_formats.md section 3: Inception3 with 1008 classes, no aux "
             "logits)" + hint, expected, sd, optional=counters)
    _check_float(path, collections.OrderedDict((k, sd[k]) for k in expected))
    tensors = collections.OrderedDict((k, sd[k]) for k in expected)
    meta = {"num_classes": INCEPTION_NUM_CLASSES, "bn_eps": "0.001", "features": "2048",
            "variant": "pytorch-fid FID Inception (TF inception-2015-12-05)"}
    notes = ["FID Inception: 94 BasicConv2d + fc 2048 -> 1008"]
    if counters:
        notes.append(f"dropped {len(counters)} BatchNorm num_batches_tracked counters")
    return Plan("inception", tensors, meta, counters, notes)


#: kind -> (plan function, expected source files, description)
KINDS = collections.OrderedDict([
    ("mar", (plan_mar, "checkpoint-last.pth", "MAR-B/L/H transformer + diffusion head; takes 'model_ema' "
                                              "(--weights model for the raw weights)")),
    ("vae-kl16", (plan_vae_kl16, "kl16.ckpt", "MAR's KL-16 VAE; keeps decoder.* and post_quant_conv.* "
                                              "(166 tensors), refuses LDM kl-f16 weights")),
    ("var", (plan_var, "var_d16.pth, var_d20.pth, var_d24.pth, var_d30.pth",
             "VAR transformer; drops the buffers lvl_1L, attn_bias_for_masking, zero_k_bias")),
    ("vqvae", (plan_vqvae, "vae_ch160v4096z32.pth", "VAR's VQVAE; keeps the 189 decoding tensors")),
    ("inception", (plan_inception, "pt_inception-2015-12-05-6726825d.pth",
                   "FID Inception-v3 of pytorch-fid / torch-fidelity (472 tensors)")),
])


def plan(kind, checkpoint, weights="model_ema", heads=None):
    """Selects and validates the tensors `kind` needs from an open :class:`Checkpoint`
    (or from any object with ``path`` and ``root``). Raises CheckpointError naming
    every missing, unexpected or wrongly shaped key."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    if kind == "mar":
        return plan_mar(checkpoint, weights=weights, heads=heads)
    if weights != "model_ema":
        raise ValueError(f"--weights applies to kind 'mar' only, not {kind!r}")
    if heads is not None:
        raise ValueError(f"--heads applies to kind 'mar' only, not {kind!r}")
    return KINDS[kind][0](checkpoint)


# ===========================================================================
# safetensors writer
# ===========================================================================

class _Progress:
    """tqdm when installed, else a throttled counter on stderr; silent when disabled."""

    def __init__(self, enabled, total, desc, unit="B"):
        self.enabled = enabled
        self.total = total
        self.desc = desc
        self.done = 0
        self._bar = None
        self._last = 0.0
        if not enabled:
            return
        try:
            from tqdm import tqdm
            self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=True, unit_divisor=1024, leave=True)
        except ImportError:
            self._bar = None

    def update(self, n, label=""):
        self.done += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last >= 0.5 or self.done >= self.total:
            self._last = now
            pct = 100.0 * self.done / self.total if self.total else 100.0
            sys.stderr.write(f"\r{self.desc}: {self.done / 2**20:,.1f} / {self.total / 2**20:,.1f} MiB "
                             f"({pct:5.1f}%) {label[:48]:<48}")
            sys.stderr.flush()

    def close(self):
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _out_dtype(src, target):
    return target if src in _FLOAT_DTYPES else src


def _cast(tensor, out):
    """Materialises `tensor` as a C-contiguous little-endian array of safetensors dtype `out`."""
    arr = tensor.raw()
    src = tensor.dtype
    if src == out:
        pass
    elif src == "BF16":
        f32 = bf16_bits_to_f32(arr)
        arr = f32 if out == "F32" else f32_to_bf16_bits(f32) if out == "BF16" else f32.astype(np.float16)
    else:
        f32 = arr.astype(np.float32)
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
    bar = _Progress(progress, offset, "writing")
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


def _sha256(path, progress):
    h = hashlib.sha256()
    size = os.path.getsize(path)
    bar = _Progress(progress, size, "sha256")
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
    from . import _C

    entries, meta = _C.safetensors_info(dst)
    got = {name: (dt, tuple(shape)) for name, dt, shape in entries}
    want = {name: (_out_dtype(t.dtype, out_dtype), _shape(t)) for name, t in plan_.tensors.items()}
    if got != want:
        raise CheckpointError(f"{dst}: the written file does not read back as planned")
    if meta.get("kind") != plan_.kind:
        raise CheckpointError(f"{dst}: metadata kind reads back as {meta.get('kind')!r}")


def _version():
    try:
        from . import __version__
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

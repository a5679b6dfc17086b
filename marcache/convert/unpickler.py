"""The restricted unpickler (``spec/eval_and_formats.md`` section 10.2).

``find_class`` resolves globals only from :data:`ALLOWED_GLOBALS`: marcache's own
tensor and parameter rebuild functions (they only record where a tensor's
elements are), inert markers for the storage classes and torch dtypes,
``OrderedDict``, ``argparse.Namespace`` as inert data and a few inert value
types. Every other global raises :class:`UnsafeCheckpointError` naming it, before
anything is imported; nothing from the file is ever called.

The objects the allowlist hands out are shared by every load in the process, so none
of them can be changed by a pickle: a BUILD opcode on a marker, a rebuild function
(wrapped in :class:`_FrozenFunction`) or a class (:class:`_FrozenClass`) raises
:class:`CheckpointError` instead of setting attributes."""
import argparse
import collections
import pickle
import types

import numpy as np

from .tensors import (_ST_DTYPES, _STORAGE_CLASSES, _TORCH_DTYPES, CheckpointError, LazyTensor, UnsafeCheckpointError,
                      _extent, _Storage, brief)


class _Frozen:
    """Base of the shared allowlist markers: a pickle's BUILD opcode must not be
    able to change them (they are reused by every load in the process)."""

    __slots__ = ()

    def __setstate__(self, state):
        raise CheckpointError(f"the pickle tries to modify {self!r}; refused")

    def __setattr__(self, name, value):
        raise CheckpointError(f"the pickle tries to set {name!r} on {self!r}; refused")


class _FrozenFunction(_Frozen):
    """An allowlisted function as the unpickler hands it out: callable, but a BUILD
    opcode on it (which would set e.g. ``__defaults__`` of the real function for every
    later load) raises instead."""

    __slots__ = ("__wrapped__", "name")

    def __init__(self, function, name):
        object.__setattr__(self, "__wrapped__", function)
        object.__setattr__(self, "name", name)

    def __call__(self, *args, **kwargs):
        return self.__wrapped__(*args, **kwargs)

    def __repr__(self):
        return self.name


class _FrozenClass(type):
    """Metaclass of the allowlisted Python classes: a BUILD opcode on the class itself
    (setattr of its slot state) cannot change it for later loads."""

    def __setattr__(cls, name, value):
        raise CheckpointError(f"the pickle tries to set {brief(name)} on {cls.__qualname__}; refused")

    def __delattr__(cls, name):
        raise CheckpointError(f"the pickle tries to delete {brief(name)} from {cls.__qualname__}; refused")


class Namespace(argparse.Namespace, metaclass=_FrozenClass):
    """argparse.Namespace (training arguments saved beside the weights), as inert data;
    a subclass only so that the class cannot be changed through a pickle."""


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


class TorchDevice(metaclass=_FrozenClass):
    """Inert stand-in for torch.device (checkpoints sometimes keep one in args)."""

    def __init__(self, type_, index=None):
        if not isinstance(type_, str) or not (index is None or isinstance(index, int)):
            raise CheckpointError(f"torch.device({brief(type_)}, {brief(index)}): unexpected arguments")
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
        raise CheckpointError(f"tensor {what} must be an integer >= {minimum}, got {brief(value)}")
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
        raise CheckpointError(f"tensor requires_grad must be a bool, got {brief(requires_grad)}")
    t = LazyTensor(storage, offset, shape, strides, dtype, requires_grad)
    if t.numel:
        itemsize = _ST_DTYPES[dtype].itemsize
        extent = _extent(shape, strides)
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
        raise CheckpointError(f"a tensor carries extra metadata {brief(metadata)} (a lazily conjugated or negated "
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
        raise CheckpointError(f"tensor dtype {brief(dtype)} is not supported (no safetensors equivalent)")
    return _make_tensor(storage, storage_offset, size, stride, dtype=dtype.st, requires_grad=requires_grad)


def _rebuild_parameter(data, requires_grad, backward_hooks, state=None):
    """torch._utils._rebuild_parameter(_with_state): a Parameter is its data."""
    if not isinstance(data, LazyTensor):
        raise CheckpointError(f"a Parameter rebuild got {type(data).__name__} instead of a tensor")
    _check_hooks_and_metadata(backward_hooks, None)
    if state:
        raise CheckpointError("a Parameter carries Python state; only plain parameters are supported")
    return data




def _rebuild_from_type_v2(func, new_type, args, state):
    """torch._tensor._rebuild_from_type_v2: a tensor (sub)class wrapper."""
    if func not in _rebuilders() or new_type not in (_TENSOR_TYPE, _PARAMETER_TYPE):
        raise CheckpointError(f"tensor rebuild through {brief(func)} as {brief(new_type)} is not supported")
    if not isinstance(args, tuple):
        raise CheckpointError("tensor rebuild arguments must be a tuple")
    if state:
        raise CheckpointError(f"a tensor carries Python state {brief(state)}; only plain tensors are supported")
    return func(*args)


def _codecs_encode(text, encoding="utf-8"):
    """_codecs.encode as protocol-2 pickles use it for bytes objects (latin1 only)."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise CheckpointError(f"_codecs.encode({type(text).__name__}, {brief(encoding)}) is not allowed")
    return text.encode("latin1")


def _numpy_dtype(obj, align=False, copy=False):
    """numpy.dtype as pickled inside numpy scalars: plain numeric dtypes only. Always a
    fresh copy, so the BUILD (__setstate__) that follows in the pickle cannot touch
    NumPy's shared builtin dtype objects."""
    if not isinstance(obj, str):
        raise CheckpointError(f"numpy.dtype({brief(obj)}) is not allowed")
    dt = np.dtype(obj)
    if dt.kind not in "biuf" or dt.fields is not None or dt.subdtype is not None:
        raise CheckpointError(f"numpy.dtype({brief(obj)}) is not a plain numeric dtype; refused")
    return np.dtype(obj, False, True)


def _numpy_scalar(dtype, data=None):
    """numpy.core.multiarray.scalar: a NumPy scalar rebuilt from its raw bytes, with a
    clean dtype of the same kind, size and byte order."""
    if not isinstance(dtype, np.dtype) or not isinstance(data, (bytes, bytearray)):
        raise CheckpointError(f"numpy scalar of dtype {brief(dtype)} is not allowed")
    if dtype.kind not in "biuf" or dtype.fields is not None or dtype.subdtype is not None:
        raise CheckpointError(f"numpy scalar of dtype {brief(dtype)} is not a plain numeric scalar; refused")
    clean = np.dtype(dtype.str)
    if len(data) != clean.itemsize:
        raise CheckpointError(f"numpy scalar of dtype {clean} has {len(data)} bytes, expected {clean.itemsize}")
    return np.frombuffer(bytes(data), dtype=clean)[0]


_SAFE_CONTAINERS = {"set": set, "frozenset": frozenset, "slice": slice, "complex": complex}


def _reconstructor(cls, base, state):
    """copyreg._reconstructor (protocol 0/1 objects): only for allowlisted classes."""
    if cls is not Namespace or base is not object or state is not None:
        raise CheckpointError(f"copyreg._reconstructor({brief(cls)}, {brief(base)}) is not allowed")
    return Namespace()


def _allowlist():
    table = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("argparse", "Namespace"): Namespace,
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
    return {key: _FrozenFunction(obj, ".".join(key)) if isinstance(obj, types.FunctionType) else obj
            for key, obj in table.items()}


#: (module, name) -> the object the unpickler gets instead; nothing else is allowed.
ALLOWED_GLOBALS = _allowlist()


def _rebuilders():
    """The allowlist's tensor and parameter rebuild functions (as the pickle sees them)."""
    return tuple(ALLOWED_GLOBALS[("torch._utils", name)] for name in
                 ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
                  "_rebuild_parameter_with_state"))


def _global_name(module, name):
    """module.name as the pickle spells it, cut to 200 characters (a GLOBAL line can be
    as long as the file)."""
    text = f"{module}.{name}"
    return text if len(text) <= 200 else text[:200] + "..."


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
            f"{self._path}: the pickle asks for the global '{_global_name(module, name)}', which is not on marcache's "
            "allowlist (tensor rebuild functions, storage classes, OrderedDict, argparse.Namespace and inert "
            "values); refusing to load it. Nothing from the file was executed.")

    def persistent_load(self, pid):
        if self._persistent is None:
            raise CheckpointError(f"{self._path}: unexpected persistent id {brief(pid)} in a header pickle")
        return self._persistent(pid)

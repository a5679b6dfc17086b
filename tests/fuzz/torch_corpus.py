"""Malformed and malicious torch.save files (issue 18), written without PyTorch.

Two valid bases: the real ``torch.save`` zip fixture ``tiny_mar.pth`` and a tiny MAR in
the legacy stream layout that ``legacy_file`` writes opcode by opcode (PyTorch < 1.6's
``_use_new_zipfile_serialization=False``: magic, protocol and system-info pickles, the
object pickle with ('storage', type, key, location, numel, view) persistent ids, the key
list, then each storage as an int64 count and its bytes). Cases cycle through
``MUTATIONS``; details come from a generator keyed by (seed, index).

A case's expectation is one of:

- ``("unsafe", "module.name")``: :class:`UnsafeCheckpointError` naming that global;
- ``("refused", None)``: a :class:`CheckpointError` naming the file;
- ``("any", None)``: a random flip that may leave the file readable: conversion either
  succeeds (and the output reads back, which ``convert`` checks itself) or is refused.

Every malicious payload, if it ran, would create the canary file or set the canary
environment variable (``canary_commands``); the runner checks both after every case.
"""
import io
import os
import pickle
import struct
import zipfile
import zlib
from collections import OrderedDict

import numpy as np

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
CANARY_ENV = "MARCACHE_FUZZ_PWNED"

_STORAGE_CLASS = {np.dtype(np.float32): "FloatStorage", np.dtype(np.float16): "HalfStorage",
                  np.dtype(np.int64): "LongStorage"}


# ----- a small pickle writer (protocol 2 opcodes, no pickler involved) -----------------------

class Ops:
    """Appends pickle opcodes; the file names each one as pickletools does."""

    def __init__(self, proto=2):
        self.b = bytearray(b"\x80" + bytes([proto]) if proto >= 2 else b"")

    def raw(self, data):
        self.b += data
        return self

    def glob(self, module, name):                       # GLOBAL
        self.b += b"c" + module.encode() + b"\n" + name.encode() + b"\n"
        return self

    def stack_glob(self, module, name):                 # STACK_GLOBAL (protocol 4)
        return self.text(module).text(name).raw(b"\x93")

    def text(self, s):                                  # BINUNICODE
        data = s.encode("utf-8", "surrogatepass")
        self.b += b"X" + struct.pack("<I", len(data)) + data
        return self

    def int_(self, v):
        if isinstance(v, bool):
            self.b += b"\x88" if v else b"\x89"
        elif 0 <= v < 256:
            self.b += b"K" + bytes([v])
        elif -2**31 <= v < 2**31:
            self.b += b"J" + struct.pack("<i", v)
        else:                                           # LONG1, two's complement little-endian
            n = (v.bit_length() + 8) // 8
            self.b += b"\x8a" + bytes([n]) + v.to_bytes(n, "little", signed=True)
        return self

    def value(self, v):
        """Plain values: None, bool, int, str, tuples and lists of these."""
        if v is None:
            self.b += b"N"
        elif isinstance(v, (bool, int)):
            self.int_(v)
        elif isinstance(v, str):
            self.text(v)
        elif isinstance(v, tuple):
            self.mark()
            for item in v:
                self.value(item)
            self.b += b"t"
        elif isinstance(v, list):
            self.b += b"]("
            for item in v:
                self.value(item)
            self.b += b"e"
        else:
            raise TypeError(type(v))
        return self

    def mark(self):
        self.b += b"("
        return self

    def op(self, code):
        self.b += code
        return self

    def call(self, module, name, *args):
        """module.name(*args) with GLOBAL + REDUCE."""
        self.glob(module, name)
        self.value(tuple(args))
        return self.op(b"R")

    def stop(self):
        self.b += b"."
        return bytes(self.b)


def tensor_ops(ops, key, storage_class, numel, offset, size, stride, legacy=False):
    """_rebuild_tensor_v2(persistent storage, offset, size, stride, False, OrderedDict())."""
    ops.glob("torch._utils", "_rebuild_tensor_v2").mark()
    ops.mark().text("storage").glob("torch", storage_class).value(key).text("cpu").value(numel)
    if legacy:
        ops.op(b"N")
    ops.op(b"t").op(b"Q")                                # BINPERSID
    ops.value(offset).value(tuple(size)).value(tuple(stride)).value(False)
    ops.glob("collections", "OrderedDict").op(b")R")     # OrderedDict()
    return ops.op(b"tR")


def state_dict_pickle(weights, legacy=False, wrap="model_ema", extra=None, proto=2):
    """The object pickle of {wrap: OrderedDict(name -> tensor)}: each tensor its own
    storage, keys '0', '1', ...; extra(ops) may add items to the top-level dict."""
    ops = Ops(proto)
    ops.op(b"}").mark()
    if wrap is not None:
        ops.text(wrap)
    ops.glob("collections", "OrderedDict").op(b")R").mark()
    for i, (name, arr) in enumerate(weights.items()):
        ops.text(name)
        stride = tuple(int(np.prod(arr.shape[d + 1:])) for d in range(arr.ndim))
        tensor_ops(ops, str(i), _STORAGE_CLASS[arr.dtype], int(arr.size), 0, arr.shape, stride, legacy)
    ops.op(b"u")
    if wrap is not None:
        ops.op(b"u")
    if extra is not None:
        ops.mark()
        extra(ops)
        ops.op(b"u")
    return ops.stop()


def zip_file(pickle_bytes, storages, prefix="archive/", byteorder=b"little", compress=zipfile.ZIP_STORED):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr(prefix + "data.pkl", pickle_bytes, compress_type=compress)
        if byteorder is not None:
            z.writestr(prefix + "byteorder", byteorder)
        for key, data in storages.items():
            z.writestr(prefix + "data/" + key, data)
        z.writestr(prefix + "version", b"3\n")
    return buf.getvalue()


def legacy_file(object_pickle, storages, magic=LEGACY_MAGIC, protocol=1001, sys_info=None, counts=None,
                keys=None):
    """The legacy stream: storages is key -> raw bytes of float32 elements."""
    out = io.BytesIO()
    pickle.dump(magic, out, protocol=2)
    pickle.dump(protocol, out, protocol=2)
    pickle.dump({"protocol_version": 1001, "little_endian": True, "type_sizes": {"short": 2, "int": 4, "long": 4}}
                if sys_info is None else sys_info, out, protocol=2)
    out.write(object_pickle)
    pickle.dump(list(storages) if keys is None else keys, out, protocol=2)
    for key, data in storages.items():
        count = len(data) // 4 if counts is None else counts.get(key, len(data) // 4)
        out.write(struct.pack("<q", count))
        out.write(data)
    return out.getvalue()


# ----- the bases -------------------------------------------------------------------------------

class Bases:
    def __init__(self, fixtures_dir):
        from mar_fixtures import R

        with open(os.path.join(fixtures_dir, "tiny_mar.pth"), "rb") as f:
            self.zip_raw = f.read()
        with zipfile.ZipFile(io.BytesIO(self.zip_raw)) as z:
            self.zip_records = OrderedDict((i.filename, z.read(i)) for i in z.infolist())
        self.zip_pkl_name = next(n for n in self.zip_records if n.endswith("data.pkl"))
        from marcache import convert as conv

        with conv.read_checkpoint(os.path.join(fixtures_dir, "tiny_mar.pth")) as ck:
            # the records a MAR conversion reads (model_ema's), whose damage it must notice
            self.zip_used_storages = sorted({t.storage.record for t in ck["model_ema"].values()})
        self._bomb = None
        rng = np.random.default_rng(7)
        W = R.random_mar_weights(rng, dim=16, depth=1, heads_unused=2, head_width=16, head_depth=1, num_classes=10)
        self.weights = OrderedDict((k, np.ascontiguousarray(v, np.float32)) for k, v in W.items())
        self.storages = OrderedDict((str(i), arr.tobytes()) for i, arr in enumerate(self.weights.values()))
        self.legacy_pickle = state_dict_pickle(self.weights, legacy=True)
        self.legacy_raw = legacy_file(self.legacy_pickle, self.storages)
        self.zip_pickle = state_dict_pickle(self.weights)
        self.zip_made = zip_file(self.zip_pickle, self.storages)

    def zip_bomb(self):
        """A zip whose data.pkl record is 66 MB of pickle opcodes deflated to a few
        hundred kB: more than marcache's pickle limit once inflated."""
        if self._bomb is None:
            body = b"N0" * (33 << 20)
            self._bomb = zip_file(b"\x80\x02}" + body + b".", self.storages, compress=zipfile.ZIP_DEFLATED)
        return self._bomb

    def first(self):
        """(name, array) of the first weight, whose geometry the tensor mutations vary."""
        return next(iter(self.weights.items()))


def _pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


# ----- malicious pickles -----------------------------------------------------------------------

def canary_commands(canary):
    """(module, name, args) calls that would leave a trace if executed."""
    c = str(canary)
    code = f"import os; os.environ[{CANARY_ENV!r}] = '1'; open({c!r}, 'w').close()"
    return [
        ("os", "system", (f"touch {c}",)), ("posix", "system", (f"touch {c}",)),
        ("nt", "system", (f"echo > {c}",)), ("os", "popen", (f"touch {c}",)),
        ("builtins", "eval", (f"__import__('os').system('touch {c}')",)), ("builtins", "exec", (code,)),
        ("__builtin__", "eval", (f"open({c!r}, 'w')",)), ("__builtin__", "execfile", (c,)),
        ("builtins", "compile", (code, "x", "exec")), ("builtins", "open", (c, "w")),
        ("builtins", "__import__", ("os",)), ("builtins", "getattr", ("os", "system")),
        ("builtins", "setattr", ("x", "y", 1)), ("builtins", "globals", ()), ("builtins", "vars", ()),
        ("builtins", "breakpoint", ()), ("builtins", "input", ()), ("builtins", "print", ("pwned",)),
        ("subprocess", "Popen", (["touch", c],)), ("subprocess", "call", (["touch", c],)),
        ("subprocess", "check_output", (["touch", c],)), ("subprocess", "run", (["touch", c],)),
        ("os", "putenv", (CANARY_ENV, "1")), ("os", "execv", ("/bin/touch", ["touch", c])),
        ("os", "_exit", (0,)), ("os", "remove", (c,)), ("os", "mkdir", (c,)), ("shutil", "rmtree", (c,)),
        ("sys", "exit", (3,)), ("importlib", "import_module", ("os",)), ("pickle", "loads", (b"x",)),
        ("operator", "attrgetter", ("system",)), ("operator", "methodcaller", ("system", f"touch {c}")),
        ("functools", "partial", ("x",)), ("types", "FunctionType", ()), ("types", "CodeType", ()),
        ("codecs", "decode", ("x", "rot13")), ("timeit", "timeit", (code,)), ("runpy", "run_path", (c,)),
        ("pathlib", "Path", (c,)), ("tempfile", "mkdtemp", ()), ("webbrowser", "open", ("http://x",)),
        ("ctypes", "CDLL", ("libc.so.6",)), ("socket", "create_connection", (("127.0.0.1", 9),)),
        ("urllib.request", "urlopen", ("http://127.0.0.1:9",)), ("numpy", "load", (c,)),
        ("numpy.core.multiarray", "_reconstruct", ()), ("numpy", "frombuffer", (b"\0" * 4,)),
        ("numpy.testing._private.utils", "runstring", (code, {})), ("torch", "load", (c,)),
        ("torch.hub", "load", ("x/y", "z")), ("torch.jit", "load", (c,)), ("torch", "as_tensor", ()),
        ("torch._utils", "_rebuild_device_tensor_from_numpy", ()), ("torch.serialization", "load", (c,)),
        ("marcache.convert.writer", "write_safetensors", (c, {})), ("marcache", "load", (c,)),
        ("copyreg", "add_extension", ("os", "system", 1)), ("code", "interact", ()),
        ("collections", "namedtuple", ("x", "y")), ("argparse", "ArgumentParser", ()),
        ("builtins", "type", ("X", (), {})), ("builtins", "object", ()), ("_codecs", "decode", ("x",)),
        ("os.path", "exists", (c,)), ("io", "open", (c, "w")), ("_io", "open", (c, "w")),
        ("posixpath", "join", ("a",)), ("__main__", "anything", ()), ("", "system", ()),
        ("os\nsystem", "x", ()), ("builtins", "eval\n", ("1",)),
    ]


def _malicious_pickle(rng, call, style):
    module, name, args = call
    ops = Ops(4 if style == "stack_global" else 2)
    if style == "inst":                                 # protocol 0 INST: calls module.name(*args)
        ops = Ops(0)
        ops.mark()
        for a in args:
            if isinstance(a, str):
                ops.raw(b"V" + a.encode("raw_unicode_escape") + b"\n")
            else:
                ops.raw(b"N")
        ops.raw(b"i" + module.encode() + b"\n" + name.encode() + b"\n")
        return bytes(ops.raw(b".").b)
    safe_args = tuple(a if isinstance(a, (str, int, type(None))) else str(a) for a in args)
    if style == "obj":                                  # OBJ: MARK class args... o
        ops.mark().glob(module, name)
        for a in safe_args:
            ops.value(a)
        return ops.op(b"o").stop()
    if style == "stack_global":
        ops.stack_glob(module, name)
    else:
        ops.glob(module, name)
    if style == "newobj":
        ops.value(safe_args).op(b"\x81")
    elif style == "build":                              # BUILD: calls __setstate__ if any
        ops.op(b"}").op(b"b")
    elif style == "in_state_dict":
        inner = Ops(2)
        inner.op(b"}").mark().text("model_ema").op(b"}").mark().text("pos_embed")
        inner.glob(module, name).value(safe_args).op(b"R").op(b"u").op(b"u")
        return inner.stop()
    elif style == "persistent_id":
        inner = Ops(2)
        inner.mark().glob(module, name).value(safe_args).op(b"R").op(b"t").op(b"Q")
        return inner.stop()
    else:
        ops.value(safe_args).op(b"R")
    return ops.stop()


_STYLES = ["reduce", "stack_global", "inst", "obj", "newobj", "build", "in_state_dict", "persistent_id"]


def malicious(rng, bases, canary):
    calls = canary_commands(canary)
    call = _pick(rng, calls)
    style = _pick(rng, _STYLES)
    payload = _malicious_pickle(rng, call, style)
    layout = _pick(rng, ["zip", "legacy", "legacy_header"])
    if layout == "zip":
        data = zip_file(payload, bases.storages)
    elif layout == "legacy":
        data = legacy_file(payload, bases.storages)
    else:                                               # the magic-number pickle itself
        out = io.BytesIO()
        out.write(b"\x80\x02\x8a\x0a" + LEGACY_MAGIC.to_bytes(10, "little") + b".")
        out.write(payload)
        data = out.getvalue()
    module, name, _ = call
    if "\n" in module + name:      # the GLOBAL line itself is broken: refused as a damaged pickle
        return data, ("refused", None), f"{style}/{layout}"
    return data, ("unsafe", f"{module}.{name}"), f"{style}/{layout}"


# ----- tensors of bad geometry ---------------------------------------------------------------

def bad_geometry(rng, bases, canary):
    name, arr = bases.first()
    numel = int(arr.size)
    shape = list(arr.shape)
    stride = [int(np.prod(shape[d + 1:])) for d in range(len(shape))]
    offset = 0
    pid_numel = numel
    storage_class = "FloatStorage"
    kind = int(rng.integers(12))
    if kind == 0:
        offset = int(rng.integers(1, numel + 10))                  # past the storage end
    elif kind == 1:
        offset = -int(rng.integers(1, 1 << 40))
    elif kind == 2:
        stride[0] = stride[0] + int(rng.integers(1, 1000))         # reaches past the end
    elif kind == 3:
        stride[-1] = -int(rng.integers(1, 5))
    elif kind == 4:
        shape[0] = -int(rng.integers(1, 10))
    elif kind == 5:
        shape[0] = _pick(rng, [2**31, 2**40, 2**62, 2**63, 2**64 + 1])
    elif kind == 6:
        stride = stride[:-1] if len(stride) > 1 else stride + [1]  # rank mismatch
    elif kind == 7:
        pid_numel = _pick(rng, [-1, numel * 4, 2**40, 2**63])      # storage larger than its record
    elif kind == 8:
        storage_class = _pick(rng, ["ComplexFloatStorage", "QInt8Storage", "Storage", "UntypedStorage", "float32"])
    elif kind == 9:                                                # on a dimension of size > 1
        stride[-1] = _pick(rng, [2**62, 2**63, 2**64])
    elif kind == 10:
        shape, stride = [_pick(rng, [2**20, 2**30])] * 2, [0, 0]    # a huge stride-0 view of one element
    else:
        offset = _pick(rng, [True, 1.5, "0", None, [0]])
    weights = OrderedDict(bases.weights)
    legacy = bool(rng.integers(2))

    def pickle_first_tensor_bad():
        ops = Ops(2)
        ops.op(b"}").mark().text("model_ema").glob("collections", "OrderedDict").op(b")R").mark()
        for i, (k, a) in enumerate(weights.items()):
            ops.text(k)
            if i == 0:
                ops.glob("torch._utils", "_rebuild_tensor_v2").mark()
                ops.mark().text("storage").glob("torch", storage_class).value("0").text("cpu").value(pid_numel)
                if legacy:
                    ops.op(b"N")
                ops.op(b"t").op(b"Q")
                if isinstance(offset, float):
                    ops.raw(b"G" + struct.pack(">d", offset))
                elif isinstance(offset, list):
                    ops.value(offset)
                else:
                    ops.value(offset)
                ops.value(tuple(shape)).value(tuple(stride)).value(False)
                ops.glob("collections", "OrderedDict").op(b")R").op(b"tR")
            else:
                st = tuple(int(np.prod(a.shape[d + 1:])) for d in range(a.ndim))
                tensor_ops(ops, str(i), "FloatStorage", int(a.size), 0, a.shape, st, legacy)
        ops.op(b"u").op(b"u")
        return ops.stop()

    payload = pickle_first_tensor_bad()
    data = legacy_file(payload, bases.storages) if legacy else zip_file(payload, bases.storages)
    return data, ("refused", None), f"geometry{kind}/{'legacy' if legacy else 'zip'}"


# ----- pickles that abuse the machine itself ---------------------------------------------------

def hostile_pickle(rng, bases, canary):
    kind = int(rng.integers(14))
    ops = Ops(2)
    if kind == 0:      # memo index far beyond anything stored: the memo table would be huge
        ops.op(b"]").op(b"r" + struct.pack("<I", _pick(rng, [2**31, 2**32 - 1, 2**28, 10**9]))).op(b"0").op(b"}")
    elif kind == 1:    # PUT with a huge decimal index (protocol 0)
        ops.op(b"]").raw(b"p" + str(_pick(rng, [10**9, 2**63, 10**30])).encode() + b"\n").op(b"0").op(b"}")
    elif kind == 2:    # GET of something never stored
        ops.op(b"}").op(_pick(rng, [b"h\x07", b"j" + struct.pack("<I", 2**32 - 1), b"g5\n", b"g-1\n"]))
    elif kind == 3:    # a bytes / str object that claims more than the file holds
        code = _pick(rng, [b"\x8e", b"\x8d", b"\x96"])                 # BINBYTES8, BINUNICODE8, BYTEARRAY8
        ops.raw(code + struct.pack("<Q", _pick(rng, [2**62, 2**40, 2**34, 10**9, 2**63 - 1])) + b"abc")
    elif kind == 4:
        code = _pick(rng, [b"B", b"X", b"T"])                        # BINBYTES, BINUNICODE, BINSTRING
        ops.raw(code + struct.pack("<I", _pick(rng, [2**32 - 1, 2**31, 2**31 - 1, 10**8])) + b"abc")
    elif kind == 5:    # LONG4 of a huge or negative length
        ops.raw(b"\x8b" + struct.pack("<i", _pick(rng, [2**31 - 1, -1, -2**31])) + b"\x01")
    elif kind == 6:    # deeply nested lists as the state dict
        depth = _pick(rng, [10**4, 10**5])
        ops.op(b"}").text("model_ema").raw(b"(" * depth + b"l" * depth).op(b"s")
    elif kind == 7:    # a deeply nested tuple as a persistent id
        depth = _pick(rng, [10**4, 10**5])
        ops.raw(b"(" * depth + b")" + b"t" * (depth - 1)).op(b"Q")
    elif kind == 8:    # a deeply nested dict key
        depth = _pick(rng, [10**4, 10**5])
        ops.op(b"}").raw(b"(" * depth + b")" + b"t" * (depth - 1)).op(b"}").op(b"s")
    elif kind == 9:    # a list that contains itself, used as a tensor size
        ops.glob("torch._utils", "_rebuild_tensor_v2").mark()
        ops.mark().text("storage").glob("torch", "FloatStorage").value("0").text("cpu").value(4).op(b"t").op(b"Q")
        ops.value(0).op(b"]").op(b"q\x01").op(b"h\x01").op(b"a").value((1,)).value(False)
        ops.glob("collections", "OrderedDict").op(b")R").op(b"tR")
    elif kind == 10:   # MARK without end, POP of an empty stack, STOP with an empty stack
        ops.raw(_pick(rng, [b"(" * 1000, b"0", b"1", b"", b"t", b"R", b"s", b"u", b"a", b"e", b"b"]))
    elif kind == 11:   # an unknown opcode, or a protocol the reader cannot know
        ops = Ops(2).raw(_pick(rng, [b"\xff", b"\x99", b"\x00", b"\x80\x09", b"\x80\xff"]))
    elif kind == 12:   # extension registry codes: never registered
        ops.raw(_pick(rng, [b"\x82\x01", b"\x83\x01\x00", b"\x84\xff\xff\xff\x7f"]))
    else:              # a persistent id that is not a storage tuple
        ops.value(_pick(rng, [("storage",), ("module", "x"), ("storage", "x", "0", "cpu", 4), "storage",
                              ("storage", None, "0", "cpu", -1), ("storage", 1, 2, 3, 4, 5, 6)])).op(b"Q")
    payload = bytes(ops.b) + b"."
    layout = _pick(rng, ["zip", "legacy", "legacy_header"])
    if layout == "zip":
        data = zip_file(payload, bases.storages)
    elif layout == "legacy":
        data = legacy_file(payload, bases.storages)
    else:
        data = b"\x80\x02\x8a\x0a" + LEGACY_MAGIC.to_bytes(10, "little") + b"." + payload
    return data, ("refused", None), f"hostile{kind}/{layout}"


def shared_object_tampering(rng, bases, canary):
    """BUILD on an allowlisted object (a rebuild function, a class, a dtype or storage
    marker) tries to change it for every later load in the process."""
    targets = [("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor"),
               ("torch._utils", "_rebuild_parameter"), ("torch._tensor", "_rebuild_from_type_v2"),
               ("argparse", "Namespace"), ("torch", "device"), ("collections", "OrderedDict"),
               ("torch", "FloatStorage"), ("torch", "float32"), ("torch", "Size"), ("_codecs", "encode"),
               ("numpy", "dtype"), ("copyreg", "_reconstructor"), ("torch", "Tensor"),
               ("builtins", "set"), ("numpy.core.multiarray", "scalar")]
    module, name = _pick(rng, targets)
    ops = Ops(2).glob(module, name)
    kind = int(rng.integers(4))
    if kind == 0:      # dict state: instance __dict__ update
        ops.op(b"}").text("__defaults__").value((True, None, None)).op(b"sb")
    elif kind == 1:    # (None, slotstate): setattr for each item
        ops.op(b"N}").text(_pick(rng, ["__defaults__", "__kwdefaults__", "__init__", "__eq__", "__call__",
                                       "__repr__", "dtype", "name", "__code__"]))
        ops.glob("_codecs", "encode").op(b"s").op(b"\x86b")
    elif kind == 2:
        ops.op(b"}").text("marcache_fuzz").value(1).op(b"sb")
    else:
        ops.op(b"N}").text("__qualname__").text("pwned").op(b"s\x86b")
    ops.op(b"0").op(b"}")
    payload = ops.stop()
    data = zip_file(payload, bases.storages) if rng.integers(2) else legacy_file(payload, bases.storages)
    return data, ("refused", None), f"tamper/{module}.{name}/{kind}"


# ----- damaged files -----------------------------------------------------------------------------

def _zip_rewrite(records, changes=None, compress=None, skip=()):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in records.items():
            if name in skip:
                continue
            if changes and name in changes:
                data = changes[name]
            z.writestr(name, data, compress_type=(compress or {}).get(name, zipfile.ZIP_STORED))
    return buf.getvalue()


def truncated(rng, bases, canary):
    raw = bases.zip_raw if rng.integers(2) else bases.legacy_raw
    return raw[:int(rng.integers(0, len(raw)))], ("refused", None), "truncated"


def damaged_zip(rng, bases, canary):
    recs = bases.zip_records
    pkl = bases.zip_pkl_name
    prefix = pkl[:-len("data.pkl")]
    storage_names = bases.zip_used_storages
    kind = int(rng.integers(13))
    if kind == 0:      # a storage byte flipped: the record fails its CRC
        name = _pick(rng, storage_names)
        data = bytearray(recs[name])
        data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
        raw = bytearray(bases.zip_raw)
        at = raw.index(bytes(recs[name])) if recs[name] in raw else None
        if at is None:
            return None
        raw[at:at + len(data)] = data
        return bytes(raw), ("refused", None), "storage_crc"
    if kind == 1:      # a data.pkl byte flipped in place: zipfile's CRC check
        raw = bytearray(bases.zip_raw)
        at = raw.index(recs[pkl]) + int(rng.integers(len(recs[pkl])))
        raw[at] ^= 1 << int(rng.integers(8))
        return bytes(raw), ("refused", None), "pickle_crc"
    if kind == 2:      # a CRC field in the central directory changed
        raw = bytearray(bases.zip_raw)
        name = _pick(rng, storage_names + [pkl])
        at = raw.find(b"PK\x01\x02", 0)
        while at >= 0:
            name_len = struct.unpack("<H", raw[at + 28:at + 30])[0]
            if raw[at + 46:at + 46 + name_len].decode() == name:
                raw[at + 16:at + 20] = struct.pack("<I", (struct.unpack("<I", raw[at + 16:at + 20])[0] ^ 0x5A5A))
                break
            at = raw.find(b"PK\x01\x02", at + 4)
        return bytes(raw), ("refused", None), "central_crc"
    if kind == 3:
        return _zip_rewrite(recs, skip=(pkl,)), ("refused", None), "no_data_pkl"
    if kind == 4:
        return _zip_rewrite(recs, skip=(_pick(rng, storage_names),)), ("refused", None), "missing_storage"
    if kind == 5:
        name = _pick(rng, storage_names)
        return (_zip_rewrite(recs, compress={name: zipfile.ZIP_DEFLATED}), ("refused", None), "compressed_storage")
    if kind == 6:
        name = _pick(rng, storage_names)
        return _zip_rewrite(recs, {name: recs[name][:-int(rng.integers(1, 5))]}), ("refused", None), "short_storage"
    if kind == 7:
        value = _pick(rng, [b"middle", b"", b"\xff\xfe", b"little" * 1000, b"LITTLE", b"lit"])
        return _zip_rewrite(recs, {prefix + "byteorder": value}), ("refused", None), "byteorder"
    if kind == 8:      # a compression method zipfile does not know / an encrypted record
        raw = bytearray(bases.zip_raw)
        target = _pick(rng, [pkl, prefix + "byteorder"])
        method = int(rng.integers(2))
        for sig, name_at, field in ((b"PK\x03\x04", 30, 8), (b"PK\x01\x02", 46, 10)):
            at = raw.find(sig)
            while at >= 0:
                off = 26 if sig == b"PK\x03\x04" else 28
                name_len = struct.unpack("<H", raw[at + off:at + off + 2])[0]
                if raw[at + name_at:at + name_at + name_len].decode(errors="replace") == target:
                    if method:
                        raw[at + field:at + field + 2] = struct.pack("<H", _pick(rng, [99, 97, 98, 7, 1]))
                    else:                       # general purpose flag bit 0: encrypted
                        flag_at = at + field - 2
                        raw[flag_at:flag_at + 2] = struct.pack("<H", struct.unpack("<H", raw[flag_at:flag_at + 2])[0]
                                                               | 1)
                at = raw.find(sig, at + 4)
        return bytes(raw), ("refused", None), "method_or_encrypted"
    if kind == 9:      # two data.pkl records at the same depth
        other = dict(recs)
        other["other/data.pkl"] = recs[pkl]
        return _zip_rewrite(other), ("refused", None), "two_data_pkl"
    if kind == 10:     # a compressed byteorder record whose stream is damaged
        raw = bytearray(_zip_rewrite(recs, compress={prefix + "byteorder": zipfile.ZIP_DEFLATED}))
        comp = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, -15)
        stream = comp.compress(b"little") + comp.flush()
        at = raw.find(stream)
        if at < 0:
            return None
        raw[at] ^= 0xFF
        return bytes(raw), ("refused", None), "byteorder_stream"
    if kind == 11:     # a local header that points elsewhere
        raw = bytearray(bases.zip_raw)
        at = raw.find(b"PK\x03\x04", int(rng.integers(1, len(raw) // 2)))
        if at < 0:
            return None
        raw[at:at + 4] = b"PK\x07\x08"
        return bytes(raw), ("any", None), "local_header"     # the record may be one a conversion never reads
    # kind 12: a pickle record that decompresses to far more than it stores (a zip bomb)
    return bases.zip_bomb(), ("refused", None), "zip_bomb"


def damaged_legacy(rng, bases, canary):
    w = bases.weights
    kind = int(rng.integers(9))
    if kind == 0:
        data = legacy_file(bases.legacy_pickle, bases.storages, magic=_pick(rng, [0, LEGACY_MAGIC + 1, "x"]))
    elif kind == 1:
        data = legacy_file(bases.legacy_pickle, bases.storages, protocol=_pick(rng, [1000, 0, -1, "1001"]))
    elif kind == 2:
        data = legacy_file(bases.legacy_pickle, bases.storages, sys_info={"little_endian": False})
    elif kind == 3:
        key = _pick(rng, list(bases.storages))
        data = legacy_file(bases.legacy_pickle, bases.storages,
                           counts={key: _pick(rng, [-1, 0, 2**62, -2**63, len(bases.storages[key]) // 4 + 1])})
    elif kind == 4:
        keys = list(bases.storages)
        data = legacy_file(bases.legacy_pickle, bases.storages,
                           keys=_pick(rng, [keys + ["999"], keys[:-1] + ["x"], "0", {"0": 1}, None]))
    elif kind == 5:    # a view beyond its storage
        ops = Ops(2)
        ops.op(b"}").mark().text("model_ema").glob("collections", "OrderedDict").op(b")R").mark()
        for i, (k, a) in enumerate(w.items()):
            ops.text(k)
            view = None if i else ("v0", int(rng.integers(1, 100)), int(a.size))
            ops.glob("torch._utils", "_rebuild_tensor_v2").mark()
            ops.mark().text("storage").glob("torch", "FloatStorage").value(str(i)).text("cpu").value(int(a.size))
            ops.value(view).op(b"t").op(b"Q")
            st = tuple(int(np.prod(a.shape[d + 1:])) for d in range(a.ndim))
            ops.value(0).value(tuple(a.shape)).value(st).value(False)
            ops.glob("collections", "OrderedDict").op(b")R").op(b"tR")
        ops.op(b"u").op(b"u")
        data = legacy_file(ops.stop(), bases.storages)
    elif kind == 6:    # a deeply nested magic number
        depth = _pick(rng, [10**4, 10**5])
        data = b"\x80\x02" + b"(" * depth + b")" + b"t" * (depth - 1) + b"." + bases.legacy_raw[27:]
    elif kind == 7:    # a huge magic-number pickle (a 16 MB string)
        data = b"\x80\x02X" + struct.pack("<I", 16 << 20) + b"a" * (16 << 20) + b"." + bases.legacy_raw
    else:              # the key list pickle damaged
        data = bytearray(bases.legacy_raw)
        at = data.rindex(pickle.dumps(list(bases.storages), protocol=2))
        data[at + 2] = ord(_pick(rng, ["}", "N", "K", "\xff"]))
        data = bytes(data)
    return data, ("refused", None), f"legacy{kind}"


def random_flips(rng, bases, canary):
    """Random bytes of a valid file changed: many files stay readable (a flipped name of a
    non-tensor entry, a timestamp), so conversion may succeed; if it fails, cleanly."""
    raw = bytearray(bases.zip_made if rng.integers(2) else bases.legacy_raw)
    region = int(rng.integers(3))
    pkl_len = len(bases.zip_pickle)
    for _ in range(int(rng.integers(1, 6))):
        if region == 0:                     # inside the pickle
            start = raw.find(bases.zip_pickle[:64]) if raw[:2] == b"PK" else 27 * 3
            at = start + int(rng.integers(0, pkl_len))
        else:
            at = int(rng.integers(len(raw)))
        raw[at] ^= 1 << int(rng.integers(8))
    return bytes(raw), ("any", None), f"flips{region}"


def not_a_checkpoint(rng, bases, canary):
    kind = int(rng.integers(5))
    if kind == 0:
        data = pickle.dumps({"model_ema": {}}, protocol=int(rng.integers(0, 6)))
    elif kind == 1:
        data = bytes(rng.integers(0, 256, size=int(rng.integers(0, 600)), dtype=np.uint8))
    elif kind == 2:
        data = b""
    elif kind == 3:
        data = b"\0" * 257 + b"ustar" + b"\0" * 300
    else:
        data = b"PK\x05\x06" + b"\0" * 18
    return data, ("refused", None), f"not_checkpoint{kind}"


MUTATIONS = [malicious, malicious, malicious, bad_geometry, hostile_pickle, shared_object_tampering, truncated,
             damaged_zip, damaged_legacy, random_flips, not_a_checkpoint]


def case(bases, canary, seed, index):
    """(mutation name, detail, file bytes, expectation) of case `index`."""
    mutation = MUTATIONS[index % len(MUTATIONS)]
    rng = np.random.default_rng([seed, index, 1])
    for _ in range(100):
        made = mutation(rng, bases, canary)
        if made is not None:
            data, expect, detail = made
            return mutation.__name__, detail, data, expect
    raise AssertionError(f"mutation {mutation.__name__} made no file in 100 draws")

"""The two torch.save file formats, read without PyTorch (``spec/eval_and_formats.md``
section 10): the zip archive (PyTorch >= 1.6) and the legacy stream; the pre-0.4
tar format is recognised and refused. :func:`read_checkpoint` opens either as a
:class:`Checkpoint`, a lazy mapping whose tensors are read on demand."""
import argparse
import collections.abc
import io
import os
import pickle
import pickletools
import struct
import zipfile
import zlib

from .tensors import _ST_DTYPES, CheckpointError, LazyTensor, _Storage, brief
from .unpickler import Namespace, RestrictedUnpickler, _check_int, _StorageType


_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PREFIX = b"\x80\x02\x8a\x0a" + _LEGACY_MAGIC.to_bytes(10, "little")

#: The largest pickle read (a checkpoint's pickle holds only the structure: MAR-H's
#: checkpoint-last.pth, optimizer state included, has a pickle well under 1 MiB). It
#: bounds what a compressed data.pkl record (a zip bomb) can make us inflate.
MAX_PICKLE_BYTES = 64 << 20

# What zipfile raises for a record it cannot read: damaged data (BadZipFile, zlib.error,
# EOFError), an unknown compression method (NotImplementedError), an encrypted record
# (RuntimeError), impossible sizes or offsets (ValueError, OverflowError).
_ZIP_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, OSError, NotImplementedError, RuntimeError, ValueError,
               OverflowError)


def _scan_pickle(stream, path, what):
    """Walks one pickle's opcodes (pickletools.genops: it only reads, builds nothing) before
    the C unpickler sees it, and refuses what would make that unpickler allocate without
    bound: a length or memo index beyond what the pickle could hold. Returns the stream
    position after the pickle's STOP."""
    opcodes = 0
    try:
        for opcode, arg, position in pickletools.genops(stream):
            opcodes += 1
            if opcode.name in ("PUT", "BINPUT", "LONG_BINPUT") and arg > opcodes:
                raise CheckpointError(f"{path}: {what} stores memo entry {arg} at byte {position}, after only "
                                      f"{opcodes} opcodes (a pickle numbers its memo from 0): a damaged or hostile "
                                      "pickle")
    except CheckpointError:
        raise
    except (ValueError, TypeError, OverflowError, EOFError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: {what} is not a valid pickle: {exc} (a truncated or damaged file?)") \
            from None
    return stream.tell()


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
            elif isinstance(obj, (argparse.Namespace, Namespace)):
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
        try:
            order = infos.get(self._prefix + "byteorder")
            if order is not None:
                value = self._read_record(order, 64).decode("ascii", "replace").strip()
                if value not in ("little", "big"):
                    raise CheckpointError(f"{self.path}: record '{order.filename}' says byte order {brief(value)}")
                self.byteorder = value
            data = self._read_record(infos[pkls[0]], MAX_PICKLE_BYTES)
        finally:
            self._zip.close()   # storages are read through our own handle (_locate)
            self._zip = None
        _scan_pickle(io.BytesIO(data), self.path, f"record '{pkls[0]}'")
        self.root = self._unpickle(io.BytesIO(data), self._zip_persistent_load, pkls[0])

    def _read_record(self, info, limit):
        """The bytes of a small zip record (the pickle, the byte order), at most `limit`."""
        if info.file_size > limit:
            raise CheckpointError(f"{self.path}: record '{info.filename}' holds {info.file_size} bytes, more than the "
                                  f"{limit} marcache reads for it (torch.save writes a small record there: a "
                                  "damaged or hostile archive)")
        try:
            return self._zip.read(info)
        except _ZIP_ERRORS as exc:
            raise CheckpointError(f"{self.path}: cannot read record '{info.filename}': {type(exc).__name__}: {exc}") \
                from None

    def _zip_persistent_load(self, pid):
        if not isinstance(pid, tuple) or len(pid) != 5 or _ascii(pid[0]) != "storage":
            raise CheckpointError(f"{self.path}: unexpected persistent id {brief(pid)} (expected ('storage', type, key, "
                                  "location, numel))")
        _, storage_type, key, _location, numel = pid
        key, itemsize, st = self._storage_ref(pid, storage_type, key, numel, typed=False)
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
        if not 0 <= info.header_offset <= self.size - 30:
            raise CheckpointError(f"{self.path}: record '{info.filename}' has its local header at offset "
                                  f"{info.header_offset}, outside the file's {self.size} bytes: the file is damaged")
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
    def _next_pickle(self, what):
        """The next pickle of the legacy stream, as a buffer the unpickler reads from after
        _scan_pickle has checked it. The stream does not say where a pickle ends, so the
        scan runs on a window of the file that grows (1 MiB, x 8) until it holds the whole
        pickle, up to MAX_PICKLE_BYTES; the file is left just after the pickle."""
        f = self._file()
        start = f.tell()
        window = 1 << 20
        while True:
            f.seek(start)
            chunk = f.read(window)
            buf = io.BytesIO(chunk)
            try:
                end = _scan_pickle(buf, self.path, what)
                break
            except CheckpointError:
                # grow only when the scan ran out of window, not of file, and did not fail earlier
                if buf.tell() < len(chunk) or len(chunk) < window:
                    raise
                if window >= MAX_PICKLE_BYTES:
                    raise CheckpointError(f"{self.path}: {what} is longer than the {MAX_PICKLE_BYTES} bytes "
                                          "marcache reads for a pickle (a checkpoint's pickles are far smaller): "
                                          "a damaged or hostile file") from None
                window *= 8
        f.seek(start + end)
        return io.BytesIO(chunk[:end])

    def _open_legacy(self):
        f = self._file()
        magic = self._unpickle(self._next_pickle("the magic number pickle"), None, "the magic number pickle")
        protocol = self._unpickle(self._next_pickle("the protocol pickle"), None, "the protocol pickle")
        sys_info = self._unpickle(self._next_pickle("the system information pickle"), None,
                                  "the system information pickle")
        if magic != _LEGACY_MAGIC or protocol != 1001:
            raise CheckpointError(f"{self.path}: legacy checkpoint with magic {brief(magic)} / protocol "
                                  f"{brief(protocol)} (expected 1001): not a torch.save file")
        if isinstance(sys_info, dict) and sys_info.get("little_endian") is False:
            raise CheckpointError(f"{self.path}: a legacy checkpoint written on a big-endian machine; re-save it with "
                                  "a recent torch.save (zip format)")
        self._legacy_order = []
        self.root = self._unpickle(self._next_pickle("the object pickle"), self._legacy_persistent_load,
                                   "the object pickle")
        keys = self._unpickle(self._next_pickle("the storage key list"), None, "the storage key list")
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
            raise CheckpointError(f"{self.path}: unexpected persistent id {brief(pid)}")
        typename = _ascii(pid[0])
        if typename == "module":
            raise CheckpointError(f"{self.path}: the checkpoint pickles a whole nn.Module (source code and all); "
                                  "only state dicts of tensors are supported")
        if typename != "storage" or len(pid) != 6:
            raise CheckpointError(f"{self.path}: unexpected persistent id {brief(pid)}")
        _, storage_type, root_key, _location, numel, view = pid
        root_key, itemsize, root = self._storage_ref(pid, storage_type, root_key, numel, typed=True)
        if root is None:
            root = _Storage(self, root_key, storage_type.dtype, numel * itemsize, f"storage {root_key}")
            root.record_nbytes = numel * itemsize
            self._storages[root_key] = root
        if view is None:
            return root
        if not isinstance(view, tuple) or len(view) != 3:
            raise CheckpointError(f"{self.path}: bad storage view {brief(view)}")
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
    def _storage_ref(self, pid, storage_type, key, numel, typed):
        """The part of a persistent id that both formats read the same way: checks the
        storage class (`typed`: the legacy format has no untyped storages) and the
        element count; returns (key, item size, the storage already made for key or None)."""
        if not isinstance(storage_type, _StorageType) or (typed and storage_type.name == "UntypedStorage"):
            what = "typed storage class" if typed else "storage class"
            raise CheckpointError(f"{self.path}: persistent id {brief(pid)} names no {what}")
        key = _ascii(key)
        _check_int(numel, "storage size")
        return key, _ST_DTYPES[storage_type.dtype].itemsize, self._storages.get(key)

    def _unpickle(self, fileobj, persistent_load, what):
        try:
            return RestrictedUnpickler(fileobj, self.path, persistent_load).load()
        except CheckpointError as exc:
            if str(exc).startswith(self.path):
                raise
            # raised by a rebuild function, which does not know the file: name it here
            raise type(exc)(f"{self.path}: {what}: {exc}") from None
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
                KeyError, struct.error, OverflowError, RecursionError) as exc:
            raise CheckpointError(f"{self.path}: cannot unpickle {what}: {type(exc).__name__}: {str(exc)[:300]} "
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

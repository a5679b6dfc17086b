"""Malformed safetensors files, mutated from small valid model files (issue 18).

Every case is made from (seed, index) alone: ``case(bases, seed, index)`` picks mutation
``MUTATIONS[index % len(MUTATIONS)]`` and draws its details from a generator keyed by
(seed, index), so one failing case can be replayed alone (``python -m fuzz.runner
safetensors --seed S --only I``).

A mutation returns the file's bytes and what must refuse it:

- ``"reader"``: the strict safetensors reader itself (``_C.safetensors_info`` / ``_read``);
  the file breaks a rule of eval_and_formats.md section 9 (header length, UTF-8, JSON,
  entry fields, dtype, shape, offsets, tiling).
- ``"load"``: a well-formed safetensors file that is not a valid model of its kind (a
  missing, renamed, reshaped, retyped or empty tensor, bad metadata); the reader may accept
  it and ``marcache.load`` must refuse it.

The bases are the tiny MAR and VAR of the engine tests, the KL-16 VAE converted from the
tiny checkpoint fixture, and the tiny VQVAE of the VAR API tests; each is loaded in its
role (model, or ``vae=`` beside a valid model).
"""
import json
import os
import struct
from collections import OrderedDict

import numpy as np

HEADER_CAP = 100_000_000  # the reader's header length limit (eval_and_formats.md 9.3)

_DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}
_FLOATS = ("F16", "BF16", "F32", "F64")


# ----- reading and writing files ---------------------------------------------------------

class Base:
    """A valid file to mutate: its tensors (name -> (dtype, shape, raw bytes), file order),
    its metadata, and its role ("mar", "var": the model; "vae", "vqvae": the decoder)."""

    def __init__(self, role, raw):
        self.role = role
        self.raw = raw
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n], object_pairs_hook=OrderedDict)
        data = raw[8 + n:]
        self.meta = header.pop("__metadata__", None)
        self.tensors = OrderedDict()
        for name, e in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            begin, end = e["data_offsets"]
            self.tensors[name] = (e["dtype"], list(e["shape"]), data[begin:end])

    def names(self):
        return list(self.tensors)


def header_object(tensors, meta):
    """The header as an ordered dict, tensors tiled in the given order."""
    header = OrderedDict()
    if meta is not None:
        header["__metadata__"] = meta
    offset = 0
    for name, (dtype, shape, blob) in tensors.items():
        header[name] = OrderedDict([("dtype", dtype), ("shape", shape), ("data_offsets", [offset, offset + len(blob)])])
        offset += len(blob)
    return header


def assemble(header, data, header_len=None):
    """Length prefix + header (an object is dumped as compact JSON, str / bytes are written
    as given) padded with spaces to a multiple of 8, + data. header_len overrides the prefix."""
    if isinstance(header, (dict, list)):
        header = json.dumps(header, separators=(",", ":"), ensure_ascii=False)
    raw = header.encode("utf-8", "surrogatepass") if isinstance(header, str) else bytes(header)
    raw += b" " * (-len(raw) % 8)
    length = len(raw) if header_len is None else header_len
    return struct.pack("<Q", length) + raw + data


def pack(tensors, meta):
    data = b"".join(blob for _, _, blob in tensors.values())
    return assemble(header_object(tensors, meta), data)


def _header_text(base, tensors=None, meta=None):
    tensors = base.tensors if tensors is None else tensors
    meta = base.meta if meta is None else meta
    return json.dumps(header_object(tensors, meta), separators=(",", ":"), ensure_ascii=False)


def _data(tensors):
    return b"".join(blob for _, _, blob in tensors.values())


def _string_spans(text):
    """(start, end) of every JSON string in text, quotes excluded."""
    spans, i, n = [], 0, len(text)
    while i < n:
        if text[i] == '"':
            j = i + 1
            while text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            spans.append((i + 1, j))
            i = j + 1
        else:
            i += 1
    return spans


def _structural_positions(text):
    """Indices of the JSON punctuation ({}[]:,) outside strings."""
    inside = np.zeros(len(text), bool)
    for a, b in _string_spans(text):
        inside[a - 1:b + 1] = True
    return [i for i, ch in enumerate(text) if ch in "{}[]:," and not inside[i]]


def _name_span(text, name):
    """(start, end) of the tensor name `name` as a key in the header text."""
    key = json.dumps(name, ensure_ascii=False) + ":{"
    start = text.index(key) + 1
    return start, start + len(json.dumps(name, ensure_ascii=False)) - 2


def _pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


def _float_tensor(rng, base, min_dims=1):
    names = [n for n, (dt, shape, _) in base.tensors.items() if dt in _FLOATS and len(shape) >= min_dims
             and int(np.prod(shape)) > 1]
    return _pick(rng, names)


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


# ----- mutations the reader must refuse ----------------------------------------------------

def truncate(rng, base):
    return base.raw[:int(rng.integers(0, len(base.raw)))], "reader"


def header_length_lies(rng, base):
    (n,) = struct.unpack("<Q", base.raw[:8])
    size = len(base.raw)
    choices = [0, n - 8, n - 1, n + 1, n + 8, n + int(rng.integers(2, 10_000)), size - 8, size, size + 1,
               HEADER_CAP + 1, 2**31, 2**32 + n, 2**63 - 1, 2**63, 2**64 - 1, int(rng.integers(0, 2**64, dtype=np.uint64))]
    length = _pick(rng, [c for c in choices if c != n and 0 <= c < 2**64])
    return struct.pack("<Q", length) + base.raw[8:], "reader"


_BAD_UTF8 = [b"\xff", b"\xfe", b"\xc0\xaf", b"\xc1\xbf", b"\xe0\x80\xaf", b"\xed\xa0\x80", b"\xed\xbf\xbf",
             b"\xf4\x90\x80\x80", b"\xf8\x88\x80\x80\x80", b"\xe2\x82", b"\x80", b"\xbf", b"\xc3"]


def non_utf8_name(rng, base):
    text = _header_text(base).encode("utf-8")
    name = _pick(rng, base.names())
    start, end = _name_span(text.decode(), name)
    at = len(text.decode()[:start].encode()) + int(rng.integers(0, end - start + 1))
    bad = text[:at] + _pick(rng, _BAD_UTF8) + text[at:]
    return assemble(bad, _data(base.tensors)), "reader"


def json_cut(rng, base):
    """The JSON text ends early (the top-level object is never closed); the length prefix
    still counts the original bytes, filled with spaces."""
    text = _header_text(base)
    cut = int(rng.integers(0, len(text) - 1))
    return assemble(text[:cut] + " " * (len(text) - cut), _data(base.tensors)), "reader"


def json_punctuation(rng, base):
    text = _header_text(base)
    at = _pick(rng, _structural_positions(text))
    replacement = _pick(rng, ["x", "#", ";", "=", "'", "", "\\", "0", "}}", "]]", "{", "["])
    if replacement == text[at] or (replacement in "{[" and text[at] in "{["):
        replacement = "#"
    return assemble(text[:at] + replacement + text[at + 1:], _data(base.tensors)), "reader"


_BAD_STRING_PIECES = ["\x01", "\x1f", "\t", "\n", "\\ud800", "\\udc00", "\\x41", "\\u12G4", "\\u00", "\\",
                      "\\'", "\\U0041", "\\ud83d\\u0041"]


def json_bad_string(rng, base):
    text = _header_text(base)
    start, end = _pick(rng, _string_spans(text))
    at = int(rng.integers(start, end + 1))
    piece = _pick(rng, _BAD_STRING_PIECES)
    return assemble(text[:at] + piece + text[at:], _data(base.tensors)), "reader"


_BAD_NUMBERS = ["01", "-0", "1.0", "1e2", "1E+2", "0x10", "+1", ".5", "1.", "Infinity", "NaN", "-", "1" * 400,
                "18446744073709551616", "-1", "-9223372036854775809", "1_0", "١"]


def json_bad_number(rng, base):
    """One shape dimension or data offset replaced with a number the rules refuse."""
    tensors = base.tensors
    name = _pick(rng, base.names())
    header = header_object(tensors, base.meta)
    field = _pick(rng, ["shape", "data_offsets"])
    values = header[name][field]
    if not values:
        field, values = "data_offsets", header[name]["data_offsets"]
    k = int(rng.integers(len(values)))
    marker = 987654321987
    values[k] = marker
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False)
    return assemble(text.replace(str(marker), _pick(rng, _BAD_NUMBERS), 1), _data(tensors)), "reader"


def deep_nesting(rng, base):
    depth = _pick(rng, [65, 100, 1000, 100_000])
    opener, closer = _pick(rng, [("[", "]"), ('{"a":', "}")])
    nested = opener * depth + "1" + closer * depth
    text = _header_text(base)
    where = _pick(rng, ["metadata", "field", "root"])
    if where == "metadata" and base.meta is not None:
        text = text.replace('"__metadata__":{', '"__metadata__":{"deep":' + nested + ",", 1)
    elif where == "field":
        name = _pick(rng, base.names())
        start, end = _name_span(text, name)
        text = text[:end + 3] + '"deep":' + nested + "," + text[end + 3:]
    else:
        text = nested
    return assemble(text, _data(base.tensors)), "reader"


def dtype_wrong_size_or_unknown(rng, base):
    name = _pick(rng, base.names())
    dtype, shape, blob = base.tensors[name]
    known = [d for d, size in _DTYPE_SIZES.items() if size != _DTYPE_SIZES[dtype]]
    new = _pick(rng, known + ["F7", "f32", "", "FLOAT32", "F32 ", "BF32", "Q4_0", "F128", "F32\u0000", 1, None,
                              [], {}, True])
    tensors = OrderedDict(base.tensors)
    tensors[name] = (new, shape, blob)
    if isinstance(new, str) and new in _DTYPE_SIZES and _numel(shape) * _DTYPE_SIZES[new] == len(blob):
        return None
    return assemble(header_object(tensors, base.meta), _data(tensors)), "reader"


def shape_inconsistent(rng, base):
    name = _pick(rng, base.names())
    dtype, shape, blob = base.tensors[name]
    kind = int(rng.integers(9))
    if kind == 0:
        new = [int(d) for d in rng.integers(0, 70, size=int(rng.integers(0, 5)))]
    elif kind == 1:
        new = list(shape) + [int(rng.integers(2, 9))]
    elif kind == 2:
        new = [d * int(rng.integers(2, 5)) for d in shape] or [3]
    elif kind == 3:
        new = [-int(rng.integers(1, 100))] + list(shape)[1:]
    elif kind == 4:
        new = [_pick(rng, [2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1])] + list(shape)
    elif kind == 5:
        new = [2**32, 2**32] + list(shape)
    elif kind == 6:
        new = [1] * int(rng.integers(9, 40))
    elif kind == 7:
        new = [_pick(rng, ["2", 2.5, None, [2], {"d": 2}, True])] + list(shape)[1:]
    else:
        new = _pick(rng, ["32", 32, None, {"0": 32}])
    if isinstance(new, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in new) \
            and len(new) <= 8 and _numel(new) * _DTYPE_SIZES[dtype] == len(blob):
        return None
    tensors = OrderedDict(base.tensors)
    tensors[name] = (dtype, new, blob)
    return assemble(header_object(tensors, base.meta), _data(tensors)), "reader"


def offsets_wrong(rng, base):
    names = base.names()
    name = _pick(rng, names)
    header = header_object(base.tensors, base.meta)
    begin, end = header[name]["data_offsets"]
    total = len(_data(base.tensors))
    kind = int(rng.integers(9))
    if kind == 0:
        k = int(rng.integers(1, 64)) * _pick(rng, [1, -1])
        new = [begin + k, end + k]
    elif kind == 1:
        new = [end, begin] if end > begin else [begin + 4, begin]
    elif kind == 2:
        new = [begin, total + int(rng.integers(1, 1 << 20))]
    elif kind == 3:
        new = [_pick(rng, [2**63, 2**64 - 1, 2**64, 10**30]), end]
    elif kind == 4:
        new = [begin, -end or -4]
    elif kind == 5:
        new = _pick(rng, [[begin], [begin, end, end], [], str(begin), None, [float(begin) + 0.5, end],
                          [str(begin), end], {"begin": begin}])
    elif kind == 6:
        other = _pick(rng, [n for n in names if n != name])
        new = list(header[other]["data_offsets"])
        if new == [begin, end]:
            return None
    elif kind == 7:
        new = [begin, end - int(rng.integers(1, 4))] if end > begin else [begin, end + 4]
    else:
        new = [int(v) for v in sorted(rng.integers(0, total + 1, size=2))]
        if new == [begin, end]:
            return None
    header[name]["data_offsets"] = new
    return assemble(header, _data(base.tensors)), "reader"


def tiling_wrong(rng, base):
    data = _data(base.tensors)
    header = header_object(base.tensors, base.meta)
    kind = int(rng.integers(3))
    if kind == 0:
        return assemble(header, data + bytes(int(rng.integers(1, 33)))), "reader"
    if kind == 1:
        return assemble(header, data[:-int(rng.integers(1, 9))]), "reader"
    # all tensors shifted: the data section begins with bytes no tensor owns
    k = int(rng.integers(1, 17))
    for name, entry in header.items():
        if name != "__metadata__":
            entry["data_offsets"] = [entry["data_offsets"][0] + k, entry["data_offsets"][1] + k]
    return assemble(header, bytes(k) + data), "reader"


def entry_structure(rng, base):
    text = _header_text(base)
    name = _pick(rng, base.names())
    start, end = _name_span(text, name)
    entry_start = end + 2                       # at the entry's "{"
    entry_end = text.index("}", entry_start) + 1
    entry = text[entry_start:entry_end]
    kind = int(rng.integers(10))
    if kind == 0:    # the same tensor name twice
        text = text[:entry_end] + "," + json.dumps(name) + ":" + entry + text[entry_end:]
    elif kind == 1:  # a field twice
        field = _pick(rng, ['"dtype":"F32"', '"shape":[1]', '"data_offsets":[0,4]'])
        text = text[:entry_start + 1] + field + "," + text[entry_start + 1:]
    elif kind == 2:  # an unknown field
        field = _pick(rng, ['"offsets":[0,4]', '"dtype ":"F32"', '"Shape":[1]', '"":0', '"data_offsets_":null'])
        text = text[:entry_start + 1] + field + "," + text[entry_start + 1:]
    elif kind == 3:  # a field missing
        field = _pick(rng, ["dtype", "shape", "data_offsets"])
        obj = json.loads(entry, object_pairs_hook=OrderedDict)
        del obj[field]
        text = text[:entry_start] + json.dumps(obj, separators=(",", ":")) + text[entry_end:]
    elif kind == 4:  # the entry is not an object
        text = text[:entry_start] + _pick(rng, ["[1,2]", '"F32"', "null", "3", "true", "[]"]) + text[entry_end:]
    elif kind == 5:  # a NUL inside the name
        at = int(rng.integers(start, end + 1))
        text = text[:at] + "\\u0000" + text[at:]
    elif kind == 6:  # the header is not an object
        text = _pick(rng, ["[]", '"x"', "3", "null", "true", "[" + text + "]"])
    elif kind == 7:  # metadata of the wrong form
        bad = _pick(rng, ['"x"', "3", "[]", '{"a":1}', '{"a":null}', '{"a":["b"]}', '{"a":{}}', '{"a":"b\\u0000"}',
                          '{"a\\u0000":"b"}', '{"a":"1","a":"2"}', "true"])
        text = text.replace('"__metadata__":' + json.dumps(base.meta, separators=(",", ":"), ensure_ascii=False),
                            '"__metadata__":' + bad, 1) if base.meta else '{"__metadata__":' + bad + "," + text[1:]
    elif kind == 8:  # __metadata__ twice
        text = '{"__metadata__":{},' + text[1:] if base.meta is None else '{"__metadata__":{"x":"y"},' + text[1:]
    else:            # an empty key or an entry with no tensor data of the right size at the end
        text = text[:-1] + ',"":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    return assemble(text, _data(base.tensors)), "reader"


# ----- well-formed files the model loaders must refuse -------------------------------------

def drop_tensor(rng, base):
    tensors = OrderedDict(base.tensors)
    del tensors[_pick(rng, base.names())]
    return pack(tensors, base.meta), "load"


def rename_tensor(rng, base):
    name = _pick(rng, base.names())
    kind = int(rng.integers(4))
    if kind == 0:
        new = name + _pick(rng, ["_", ".0", "x", " "])
    elif kind == 1:
        new = name.upper() if name.upper() != name else name + "_"
    elif kind == 2:
        digits = [i for i, ch in enumerate(name) if ch.isdigit()]
        if not digits:
            new = "module." + name
        else:
            i = _pick(rng, digits)
            new = name[:i] + str((int(name[i]) + int(rng.integers(1, 9))) % 10) + name[i + 1:]
    else:
        new = name[:-1] if len(name) > 1 else name + "_"
    if new in base.tensors:
        return None
    tensors = OrderedDict((new if k == name else k, v) for k, v in base.tensors.items())
    return pack(tensors, base.meta), "load"


def reshape_same_size(rng, base):
    name = _float_tensor(rng, base)
    dtype, shape, blob = base.tensors[name]
    n = _numel(shape)
    kind = int(rng.integers(5))
    if kind == 0:
        new = [n]
    elif kind == 1:
        new = list(shape) + [1]
    elif kind == 2:
        new = [1] + list(shape)
    elif kind == 3:
        new = list(reversed(shape))
    else:
        new = [2, n // 2] if n % 2 == 0 else [n, 1]
    if new == list(shape):
        return None
    tensors = OrderedDict(base.tensors)
    tensors[name] = (dtype, new, blob)
    return pack(tensors, base.meta), "load"


def retype_same_size(rng, base):
    name = _pick(rng, [n for n, (dt, _, _) in base.tensors.items() if dt in _FLOATS])
    dtype, shape, blob = base.tensors[name]
    size = _DTYPE_SIZES[dtype]
    new = _pick(rng, [d for d, s in _DTYPE_SIZES.items() if s == size and d not in _FLOATS])
    tensors = OrderedDict(base.tensors)
    tensors[name] = (new, shape, blob)
    return pack(tensors, base.meta), "load"


def empty_dimension(rng, base):
    name = _float_tensor(rng, base)
    dtype, shape, _ = base.tensors[name]
    new = list(shape)
    new[int(rng.integers(len(new)))] = 0
    tensors = OrderedDict(base.tensors)
    tensors[name] = (dtype, new, b"")
    return pack(tensors, base.meta), "load"


def swap_names(rng, base):
    """Two tensors of different shapes trade names (data and header stay consistent)."""
    names = base.names()
    a = _pick(rng, names)
    others = [n for n in names if base.tensors[n][1] != base.tensors[a][1]]
    b = _pick(rng, others)
    tensors = OrderedDict()
    for k, v in base.tensors.items():
        tensors[b if k == a else a if k == b else k] = v
    return pack(tensors, base.meta), "load"


_METADATA_MUTATIONS = {
    "mar": [("heads", v) for v in ["0", "-2", "3", "5", "7", "abc", "", "2.0", " 2", "2 ", "+2", "0x2", "２",
                                   "99999999999999999999999", "9223372036854775807", "64", "33"]] +
           [("kind", v) for v in ["var", "vqvae", "vae-kl16", "inception", "gpt2", "MAR", ""]] +
           [("decoder", v) for v in ["latents", "", "pixel", "pixels"]] + [("heads", None)],
    "var": [("patch_nums", v) for v in ["", "1,2,3", "1,2,3,4,5", "4,3,2,1", "1,2,,3,4", "0,1,2,3", "-1,2,3,4",
                                        "1,2,3,99999999999", "1,2,3,5", "a,b,c,d", "1;2;3;4", "1,2,3,4,", ",1,2,3,4",
                                        "1,1,1,1", "1, 2, 3, 4", "1,2,3,4" * 50, "2,3,4,5"]] +
           [("kind", v) for v in ["mar", "vqvae", "vae-kl16", "inception", "VAR", ""]],
    "vae": [("kind", v) for v in ["mar", "var", "vqvae", "inception", "kl16", ""]],
    "vqvae": [("kind", v) for v in ["mar", "var", "vae-kl16", "inception", "vq", ""]] +
             [("num_phi", v) for v in ["0", "-1", "abc"]] + [("vocab", v) for v in ["0", "7", "x"]],
}


def metadata_wrong(rng, base):
    key, value = _pick(rng, _METADATA_MUTATIONS[base.role])
    meta = OrderedDict(base.meta or {})
    if value is None:
        meta.pop(key, None)
    else:
        meta[key] = value
    if meta == (base.meta or {}):
        return None
    return pack(base.tensors, meta), "load"


def wrong_role(rng, base):
    """The file of another role: a decoder as a model, a model as a decoder; the role is
    swapped by the runner, the bytes are the base's own."""
    return base.raw, "load:swapped"


MUTATIONS = [truncate, header_length_lies, non_utf8_name, json_cut, json_punctuation, json_bad_string,
             json_bad_number, deep_nesting, dtype_wrong_size_or_unknown, shape_inconsistent, offsets_wrong,
             tiling_wrong, entry_structure, drop_tensor, rename_tensor, reshape_same_size, retype_same_size,
             empty_dimension, swap_names, metadata_wrong, wrong_role]

#: role of each base, in the order cases cycle through them (MAR twice: the most tensors)
ROLES = ("mar", "var", "mar", "vae", "vqvae")


def write_bases(directory):
    """Writes the four valid base files (and the partner models the decoders load beside)
    under directory; returns role -> Base and role -> path of the valid file."""
    from marcache import convert as conv
    from mar_fixtures import write_tiny_mar
    from var_api_files import write_tiny_var, write_tiny_vqvae

    fixtures = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
    paths = {role: os.path.join(directory, f"base_{role}.safetensors") for role in ("mar", "var", "vae", "vqvae")}
    write_tiny_mar(paths["mar"], dim=16, depth=1, head_width=16, head_depth=1, num_classes=10)
    write_tiny_var(paths["var"])
    conv.convert("vae-kl16", os.path.join(fixtures, "tiny_kl16.ckpt"), paths["vae"])
    write_tiny_vqvae(paths["vqvae"])
    bases = {}
    for role, path in paths.items():
        with open(path, "rb") as f:
            bases[role] = Base(role, f.read())
    return bases, paths


def case(bases, seed, index):
    """(mutation name, role, file bytes, expectation) of case `index`; the details come
    from a generator keyed by (seed, index), retried with the next draw when a draw
    happens to leave the file valid."""
    mutation = MUTATIONS[index % len(MUTATIONS)]
    role = ROLES[(index // len(MUTATIONS)) % len(ROLES)]
    rng = np.random.default_rng([seed, index])
    for _ in range(100):
        made = mutation(rng, bases[role])
        if made is not None and made[0] != bases[role].raw or (made is not None and made[1] == "load:swapped"):
            data, expect = made
            return mutation.__name__, role, data, expect
    raise AssertionError(f"mutation {mutation.__name__} found no change of the {role} base in 100 draws")

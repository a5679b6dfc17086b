"""Strict safetensors reader: round trips against the reference writer and
one test per validation rule (eval_and_formats.md section 9)."""
import json
import os
import struct

import numpy as np
import pytest

safetensors_numpy = pytest.importorskip("safetensors.numpy")


from marcache import _C as C  # noqa: E402 (the package preloads OpenBLAS)


# ----- helpers -------------------------------------------------------------

def write_raw(path, header, data=b"", header_len=None):
    """Writes an 8-byte length prefix, the header bytes as given (str is
    UTF-8 encoded, no padding) and the data bytes."""
    raw = header.encode("utf-8") if isinstance(header, str) else header
    length = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", length) + raw + data)
    return str(path)


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


@pytest.fixture
def build(tmp_path):
    """build(header, data=b"") -> path; header may be a dict (dumped as JSON),
    a str or bytes (written verbatim)."""
    counter = iter(range(10**6))

    def make(header, data=b"", header_len=None):
        if isinstance(header, dict):
            header = json.dumps(header)
        return write_raw(tmp_path / f"f{next(counter)}.safetensors", header, data, header_len)

    return make


def expect_error(exc_type, match, path):
    with pytest.raises(exc_type, match=match) as info:
        C.safetensors_info(path)
    # info and read share the validator; read must fail the same way.
    with pytest.raises(exc_type):
        C.safetensors_read(path)
    return str(info.value)


F32_2x3 = {"x": entry("F32", [2, 3], 0, 24)}


# ----- round trips -----------------------------------------------------------

def test_roundtrip_numpy_writer(tmp_path):
    rng = np.random.default_rng(0)
    half_specials = np.array([0.0, -0.0, 6e-8, -6e-8, 6.1e-5, 65504.0, np.inf, -np.inf, np.nan, 1 / 3],
                             dtype=np.float16)
    tensors = {
        "blocks.0.weight": rng.standard_normal((3, 4)).astype(np.float32),
        "blocks.0.half": half_specials,
        "double": rng.standard_normal((2, 2, 2)),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 5), dtype=np.float32),
        "empty_half": np.zeros((4, 0), dtype=np.float16),
    }
    metadata = {"format": "np", "source": "unit test ✓"}
    path = str(tmp_path / "model.safetensors")
    safetensors_numpy.save_file(tensors, path, metadata=metadata)

    arrays, meta = C.safetensors_read(path)
    assert meta == metadata
    assert set(arrays) == set(tensors)
    for name, ref in tensors.items():
        got = arrays[name]
        assert got.dtype == np.float32 and got.flags.c_contiguous
        assert got.shape == ref.shape
        np.testing.assert_array_equal(got, ref.astype(np.float32))

    infos, meta2 = C.safetensors_info(path)
    assert meta2 == metadata
    by_name = {name: (dtype, shape) for name, dtype, shape in infos}
    assert by_name == {
        "blocks.0.weight": ("F32", (3, 4)),
        "blocks.0.half": ("F16", (10,)),
        "double": ("F64", (2, 2, 2)),
        "scalar": ("F32", ()),
        "empty": ("F32", (0, 5)),
        "empty_half": ("F16", (4, 0)),
    }


def test_every_f16_bit_pattern(build):
    bits = np.arange(65536, dtype="<u2")
    path = build({"h": entry("F16", [65536], 0, 131072)}, bits.tobytes())
    got = C.safetensors_read(path)[0]["h"]
    ref = bits.view(np.float16).astype(np.float32)
    finite = ~np.isnan(ref)
    assert np.array_equal(got.view(np.uint32)[finite], ref.view(np.uint32)[finite])
    assert np.isnan(got[~finite]).all()
    # NaN keeps its sign and payload (in the top mantissa bits)
    h = bits[~finite].astype(np.uint32)
    expected_nan = ((h & 0x8000) << 16) | 0x7F800000 | ((h & 0x3FF) << 13)
    assert np.array_equal(got.view(np.uint32)[~finite], expected_nan)


def test_bf16_by_hand(build):
    values = np.array([1.0, -2.5, 3.14159, 1e-40, -np.inf, np.inf, np.nan, 65504.0, 1e38], dtype=np.float32)
    bf16 = (values.view(np.uint32) >> 16).astype("<u2")
    path = build({"b": entry("BF16", [3, 3], 0, 18)}, bf16.tobytes())
    got = C.safetensors_read(path)[0]["b"]
    expected = (bf16.astype(np.uint32) << 16).view(np.float32).reshape(3, 3)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_unaligned_tensor(build):
    # A 2-byte F16 tensor first puts the F32 tensor at data offset 2.
    values = np.array([1.5, -7.25, 1e-30], dtype="<f4")
    data = np.array([2.0], dtype="<f2").tobytes() + values.tobytes()
    path = build({"a": entry("F16", [1], 0, 2), "b": entry("F32", [3], 2, 14)}, data)
    arrays, _ = C.safetensors_read(path)
    np.testing.assert_array_equal(arrays["b"], values)
    assert arrays["a"][0] == 2.0


def test_empty_file_and_null_metadata(build):
    assert C.safetensors_read(build("{}")) == ({}, {})
    assert C.safetensors_info(build('{"__metadata__": null}')) == ([], {})


def test_header_order_escapes_and_pathlike(build, tmp_path):
    header = ('{"z": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},'
              ' "\\u00e9\\ud83d\\ude00\\n\\"\\/": {"dtype": "F32", "shape": [], "data_offsets": [4, 8]}}')
    path = build(header, np.array([1, 2], dtype="<f4").tobytes())
    infos, _ = C.safetensors_info(path)
    assert [name for name, _, _ in infos] == ["z", "é😀\n\"/"]
    arrays, _ = C.safetensors_read(tmp_path / os.path.basename(path))  # os.PathLike
    assert arrays["é😀\n\"/"] == 2.0


def test_non_float_dtype_named(build):
    path = build({"ids": entry("I64", [2], 0, 16)}, b"\0" * 16)
    assert C.safetensors_info(path)[0] == [("ids", "I64", (2,))]
    with pytest.raises(ValueError, match=r"key 'ids' has dtype I64"):
        C.safetensors_read(path)


def test_all_known_dtypes_accepted(build):
    sizes = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
             "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}
    header, offset = {}, 0
    for name, size in sizes.items():
        header[name] = entry(name, [2], offset, offset + 2 * size)
        offset += 2 * size
    infos, _ = C.safetensors_info(build(header, b"\0" * offset))
    assert [(n, d) for n, d, _ in infos] == [(n, n) for n in sizes]


# ----- files that must be rejected ---------------------------------------------

def test_missing_file(tmp_path):
    expect_error(FileNotFoundError, "No such file", str(tmp_path / "nope.safetensors"))


def test_directory(tmp_path):
    expect_error(OSError, "is a directory", str(tmp_path))


def test_shorter_than_prefix(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x02\0\0")
    expect_error(ValueError, "3 bytes, shorter than the 8-byte header length prefix", str(path))


def test_header_length_beyond_file(build):
    expect_error(ValueError, "header length 100 exceeds the 2 bytes of the file", build("{}", header_len=100))


@pytest.mark.parametrize("length", [100_000_001, 2**63, 2**64 - 1])
def test_header_length_over_limit_tiny_file(build, length):
    # A 10-byte file claiming a huge header: rejected before any allocation.
    expect_error(ValueError, f"header length {length} exceeds the limit of 100000000 bytes",
                 build("{}", header_len=length))


@pytest.mark.parametrize("bad", [b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82"])
def test_non_utf8_header(build, bad):
    expect_error(ValueError, "header is not valid UTF-8", build(b'{"a' + bad + b'": 1}'))


@pytest.mark.parametrize("header, rule", [
    ('{"a": }', "expected a JSON value"),
    ("", "unexpected end of input"),
    ('{"a": 1,}', "expected a string key"),
    ('{"a" 1}', "expected ':'"),
    ('{"a": [1 2]}', "expected ',' or ']'"),
    ('{"a": "x\ty"}', "control character 0x09"),
    ('{"a": "\\ud800"}', "high surrogate"),
    ('{"a": "\\udc00"}', "lone low surrogate"),
    ('{"a": "\\x"}', "invalid escape"),
    ('{"a": "\\u12G4"}', "invalid hex digit"),
    ('{"a": 01}', "leading zero"),
    ('{"a": tru}', "expected a JSON value"),
    ('{"a": "unterminated}', "unterminated string"),
    ("[" * 100000, "nesting deeper than 64"),
])
def test_invalid_json(build, header, rule):
    expect_error(ValueError, "header is not valid JSON: .*" + rule + ".* at header byte", build(header))


def test_trailing_garbage_after_json(build):
    expect_error(ValueError, "trailing 'x' after the JSON value at header byte 3", build("{} x"))


def test_header_not_object(build):
    expect_error(ValueError, "header must be a JSON object, found array", build("[]"))


def test_metadata_non_string_value(build):
    expect_error(ValueError, "'__metadata__' key 'epoch' has a number value; metadata values must be strings",
                 build('{"__metadata__": {"epoch": 3}}'))


def test_metadata_not_object(build):
    expect_error(ValueError, "'__metadata__' must be an object", build('{"__metadata__": "x"}'))


def test_unknown_dtype(build):
    expect_error(ValueError, "tensor 'x': unknown dtype 'F7'", build({"x": entry("F7", [1], 0, 4)}, b"\0" * 4))


def test_negative_dim(build):
    expect_error(ValueError, r"tensor 'x': shape dimension 1 \(-3\) is negative",
                 build({"x": entry("F32", [2, -3], 0, 0)}))


def test_more_than_8_dims(build):
    expect_error(ValueError, "tensor 'x': shape has 9 dimensions, at most 8",
                 build({"x": entry("F32", [1] * 9, 0, 4)}, b"\0" * 4))


def test_shape_size_mismatch(build):
    path = build({"x.weight": entry("F32", [2, 3], 0, 12)}, b"\0" * 12)
    message = expect_error(ValueError, "span 12 bytes", path)
    assert message == f"{path}: tensor 'x.weight': data_offsets [0, 12] span 12 bytes but shape [2, 3] of F32 needs 24"


@pytest.mark.parametrize("shape", [[2**62, 8], [2**32, 2**32], [0, 2**62, 8]])
def test_overflowing_shape(build, shape):
    expect_error(ValueError, "overflows a 64-bit byte count", build({"x": entry("F32", shape, 0, 0)}))


def test_dim_beyond_u64(build):
    expect_error(ValueError, "does not fit in 64 bits",
                 build('{"x": {"dtype": "F32", "shape": [18446744073709551616], "data_offsets": [0, 0]}}'))


@pytest.mark.parametrize("dims, rule", [("[2.0]", "fraction or exponent"), ("[1e2]", "fraction or exponent"),
                                        ('["2"]', "must be an integer, found string")])
def test_non_integer_dim(build, dims, rule):
    expect_error(ValueError, rule,
                 build('{"x": {"dtype": "F32", "shape": %s, "data_offsets": [0, 8]}}' % dims, b"\0" * 8))


def test_gap_between_tensors(build):
    header = {"a": entry("F32", [3], 0, 12), "b": entry("F32", [2], 16, 24)}
    expect_error(ValueError, r"tensor 'b': data_offsets \[16, 24\] leave a gap of 4 bytes after tensor 'a'",
                 build(header, b"\0" * 24))


def test_overlap(build):
    header = {"a": entry("F32", [3], 0, 12), "b": entry("F32", [3], 8, 20)}
    expect_error(ValueError, r"tensor 'b': data_offsets \[8, 20\] overlap tensor 'a'", build(header, b"\0" * 20))


def test_same_offsets_twice_is_overlap(build):
    header = {"a": entry("F32", [3], 0, 12), "b": entry("F32", [3], 0, 12)}
    expect_error(ValueError, "overlap tensor 'a'", build(header, b"\0" * 12))


def test_first_offset_not_zero(build):
    expect_error(ValueError, r"tensor 'x': data_offsets \[4, 28\]: the first tensor must begin at 0",
                 build({"x": entry("F32", [2, 3], 4, 28)}, b"\0" * 28))


def test_trailing_bytes_after_last_tensor(build):
    expect_error(ValueError, r"buffer not fully covered: the data section has 28 bytes but the tensors end at 24",
                 build(F32_2x3, b"\0" * 28))


def test_trailing_bytes_without_tensors(build):
    expect_error(ValueError, "buffer not fully covered", build("{}", b"\0"))


def test_end_beyond_file(build):
    expect_error(ValueError, r"tensor 'x': data_offsets end 24 is beyond the end of the data section \(20 bytes",
                 build(F32_2x3, b"\0" * 20))


def test_duplicate_key(build):
    header = ('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},'
              ' "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}')
    expect_error(ValueError, "duplicate tensor name 'a'", build(header, b"\0" * 8))


def test_duplicate_metadata(build):
    expect_error(ValueError, "duplicate key '__metadata__'", build('{"__metadata__": {}, "__metadata__": {}}'))


def test_duplicate_field(build):
    header = '{"a": {"dtype": "F32", "dtype": "F16", "shape": [1], "data_offsets": [0, 4]}}'
    expect_error(ValueError, "tensor 'a': field 'dtype' appears twice", build(header, b"\0" * 4))


def test_missing_dtype_field(build):
    expect_error(ValueError, "tensor 'a': missing field 'dtype'",
                 build('{"a": {"shape": [1], "data_offsets": [0, 4]}}', b"\0" * 4))


def test_unknown_field(build):
    header = '{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "offsets": [0, 4]}}'
    expect_error(ValueError, "tensor 'a': unknown field 'offsets'", build(header, b"\0" * 4))


def test_begin_after_end(build):
    expect_error(ValueError, r"tensor 'x': data_offsets \[8, 4\] have begin > end",
                 build({"x": entry("F32", [1], 8, 4)}, b"\0" * 8))


@pytest.mark.parametrize("offsets", ["[0]", "[0, 4, 8]", '"0-4"', "[0, -4]", "[0, 4.5]"])
def test_malformed_data_offsets(build, offsets):
    expect_error(ValueError, "tensor 'a': data_offsets",
                 build('{"a": {"dtype": "F32", "shape": [1], "data_offsets": %s}}' % offsets, b"\0" * 4))


def test_entry_not_object(build):
    expect_error(ValueError, "tensor 'a': entry must be an object", build('{"a": [1, 2]}'))


def test_nul_in_name(build):
    expect_error(ValueError, "contains a NUL character",
                 build('{"a\\u0000b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', b"\0" * 4))


def test_error_names_the_path(build):
    path = build({"x": entry("F7", [1], 0, 4)}, b"\0" * 4)
    assert expect_error(ValueError, "unknown dtype", path).startswith(path + ": ")

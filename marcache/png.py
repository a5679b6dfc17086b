"""Dependency-free PNG writer (8-bit RGB) and reader (8-bit grey/RGB/RGBA), and an
image-grid helper."""
import struct
import zlib

import numpy as np


def _chunk(kind, data):
    body = kind + data
    return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)


def write_png(path, image):
    """Writes uint8 [H, W, 3] (or [H, W]) as a PNG file."""
    img = np.asarray(image)
    if img.dtype != np.uint8:
        raise ValueError(f"write_png needs uint8 pixels, got {img.dtype}")
    if img.ndim == 2:
        img = np.repeat(img[:, :, None], 3, axis=2)
    if img.ndim != 3 or img.shape[2] != 3:
        raise ValueError(f"write_png needs [H, W, 3], got shape {img.shape}")
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[y].tobytes() for y in range(h))
    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 6)) +
                _chunk(b"IEND", b""))


def grid(images, columns=None, pad=2, background=255):
    """Tiles uint8 images [N, H, W, 3] into one image."""
    images = np.asarray(images)
    n, h, w, c = images.shape
    columns = columns or int(np.ceil(np.sqrt(n)))
    rows = int(np.ceil(n / columns))
    out = np.full((rows * h + (rows + 1) * pad, columns * w + (columns + 1) * pad, c), background, np.uint8)
    for i in range(n):
        r, col = divmod(i, columns)
        y, x = pad + r * (h + pad), pad + col * (w + pad)
        out[y:y + h, x:x + w] = images[i]
    return out


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CHANNELS = {0: 1, 2: 3, 4: 2, 6: 4}  # colour type -> samples per pixel


def _unfilter(raw, height, stride, bpp):
    """Undoes the PNG scanline filters (None, Sub, Up, Average, Paeth) in C
    (marcache._C.png_unfilter): per-byte filters are too slow in Python for
    evaluation folders of 50,000 images."""
    from . import _C

    return _C.png_unfilter(raw, height, stride, bpp)


def read_png(path):
    """Reads an 8-bit, non-interlaced PNG (grey, grey + alpha, RGB or RGBA) as
    uint8 [H, W, 3] RGB; alpha is dropped (not composited), grey is repeated.
    zlib plus a small C unfilter: enough for evaluation folders written by
    image generators (and by write_png). Other PNG variants raise ValueError."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != _PNG_SIGNATURE:
        raise ValueError(f"{path}: not a PNG file")
    pos, idat, header = 8, [], None
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if len(body) != length:
            raise ValueError(f"{path}: truncated {kind!r} chunk")
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
        pos += 12 + length
    if header is None or not idat:
        raise ValueError(f"{path}: no IHDR or IDAT chunk")
    width, height, depth, colour, _, _, interlace = header
    if depth != 8 or colour not in _CHANNELS or interlace != 0:
        raise ValueError(f"{path}: only 8-bit non-interlaced grey/RGB/RGBA PNGs are supported "
                         f"(bit depth {depth}, colour type {colour}, interlace {interlace})")
    channels = _CHANNELS[colour]
    stride = width * channels
    raw = zlib.decompress(b"".join(idat))
    if len(raw) != height * (stride + 1):
        raise ValueError(f"{path}: image data has {len(raw)} bytes, expected {height * (stride + 1)}")
    img = _unfilter(raw, height, stride, channels).reshape(height, width, channels)
    if channels in (1, 2):
        return np.repeat(img[:, :, :1], 3, axis=2)
    return np.ascontiguousarray(img[:, :, :3])

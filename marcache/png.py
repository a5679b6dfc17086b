"""A dependency-free PNG writer (8-bit RGB) and image-grid helper."""
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

"""Philox-4x32-10 (Salmon et al. 2011, Random123) and the marcache randomness
contract of csrc/core/philox.h, vectorised with NumPy uint64 arithmetic.

Contract (philox.h comment block):
  key     = (seed & 0xffffffff, seed >> 32)
  counter = (c0 = element block, c1 = image index, c2 = position,
             c3 = stream << 16 | step)
  stream 0 (ORDER): one word per position p: word p % 4 of block c0 = p // 4,
      c2 = 0, step 0; generation order = positions sorted by (word, p).
  stream 1 (HEAD_INIT): channel ch of token p = normal ch % 4 of block
      c0 = ch // 4, c2 = p, step 0.
  stream 2 (HEAD_STEP): as stream 1 with step = j (diffusion index 1..99).
  stream 3 (VAR_SAMPLE): VAR's categorical draw of token position p (its
      index in the whole multi-scale sequence) at scale si: u = w / 2^32 with
      w = word 0 of block c0 = 0, c2 = p, step = si.
  stream 4 (VAR_GUMBEL): VAR's more_smooth Gumbel noise: vocabulary entry j
      of token p at scale si uses u = (w + 0.5) / 2^32 with w = word j % 4 of
      block c0 = j // 4, c2 = p, step = si.
  Normals: Box-Muller in double on word pairs (w0, w1) -> (z0, z1) and
      (w2, w3) -> (z2, z3): u1 = (wa + 1) / 2^32, u2 = wb / 2^32,
      z = sqrt(-2 ln u1) * (cos 2 pi u2, sin 2 pi u2), rounded to float32.
"""
import numpy as np

STREAM_ORDER = 0
STREAM_HEAD_INIT = 1
STREAM_HEAD_STEP = 2
STREAM_VAR_SAMPLE = 3
STREAM_VAR_GUMBEL = 4

M0 = np.uint64(0xD2511F53)
M1 = np.uint64(0xCD9E8D57)
W0 = np.uint64(0x9E3779B9)
W1 = np.uint64(0xBB67AE85)
MASK32 = np.uint64(0xFFFFFFFF)
SHIFT32 = np.uint64(32)
ROUNDS = 10

# Random123 kat_vectors, philox4x32 with 10 rounds: (counter, key, output).
KAT_VECTORS = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def _u32(x):
    """Any integer array-like -> uint64 array holding values < 2^32."""
    return np.asarray(x, dtype=np.uint64) & MASK32


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox-4x32-10 on broadcastable arrays of 32-bit words.

    One round (Random123 philox4x32round):
        hi0:lo0 = M0 * c0 ; hi1:lo1 = M1 * c2   (32x32 -> 64-bit products)
        (c0, c1, c2, c3) <- (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)
    and the key is bumped (k0 += W0, k1 += W1 mod 2^32) between rounds.
    Returns a tuple of four uint64 arrays with values < 2^32.
    """
    c0, c1, c2, c3 = np.broadcast_arrays(_u32(c0), _u32(c1), _u32(c2), _u32(c3))
    k0 = _u32(k0)
    k1 = _u32(k1)
    for r in range(ROUNDS):
        if r > 0:
            k0 = (k0 + W0) & MASK32
            k1 = (k1 + W1) & MASK32
        p0 = M0 * c0  # < 2^64, exact in uint64
        p1 = M1 * c2
        hi0, lo0 = p0 >> SHIFT32, p0 & MASK32
        hi1, lo1 = p1 >> SHIFT32, p1 & MASK32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def self_check():
    """Assert the Random123 known-answer vectors; returns True."""
    for ctr, key, want in KAT_VECTORS:
        got = tuple(int(w) for w in philox4x32_10(*ctr, *key))
        assert got == want, "philox4x32_10 KAT mismatch: %s != %s" % (
            [hex(g) for g in got], [hex(w) for w in want])
    return True


def seed_key(seed):
    """key = (seed & 0xffffffff, seed >> 32) for a 64-bit seed."""
    seed = int(seed)
    if not 0 <= seed < 2 ** 64:
        raise ValueError("seed must be in [0, 2^64)")
    return seed & 0xFFFFFFFF, seed >> 32


def block(seed, image, stream, position, step, block):
    """The 4 words of `block` for (seed, image, stream, position, step).

    All arguments except seed may be broadcastable integer arrays. Returns a
    uint64 array of shape broadcast_shape + (4,) (values < 2^32).
    counter = (block, image, position, stream << 16 | step).
    """
    k0, k1 = seed_key(seed)
    stream = np.asarray(stream, dtype=np.uint64)
    step = np.asarray(step, dtype=np.uint64)
    if np.any(stream >= 2 ** 16) or np.any(step >= 2 ** 16):
        raise ValueError("stream and step must fit in 16 bits")
    c3 = (stream << np.uint64(16)) | step
    words = philox4x32_10(block, image, position, c3, k0, k1)
    return np.stack(words, axis=-1)


def box_muller(wa, wb):
    """Box-Muller in float64 on 32-bit words: returns (z_cos, z_sin) float64.

    u1 = (wa + 1) / 2^32 in (0, 1], u2 = wb / 2^32 in [0, 1);
    z = sqrt(-2 ln u1) * (cos 2 pi u2, sin 2 pi u2).
    """
    u1 = (np.asarray(wa, dtype=np.float64) + 1.0) / 4294967296.0
    u2 = np.asarray(wb, dtype=np.float64) / 4294967296.0
    radius = np.sqrt(-2.0 * np.log(u1))
    angle = 2.0 * np.pi * u2
    return radius * np.cos(angle), radius * np.sin(angle)


def token_normals(seed, image_idx_array, position_array, stream, step, channels):
    """Standard normals for rows of tokens, float32 [rows, channels].

    Row i gets the `channels` normals of (seed, image[i], stream, position[i],
    step): channel ch is normal ch % 4 of block ch // 4, where a block's words
    (w0, w1, w2, w3) give normals (z0, z1) = BM(w0, w1) and (z2, z3) =
    BM(w2, w3). Computed in float64, rounded to float32 at the end.
    """
    image = np.asarray(image_idx_array, dtype=np.uint64).reshape(-1)
    position = np.asarray(position_array, dtype=np.uint64).reshape(-1)
    if image.shape != position.shape:
        raise ValueError("image and position arrays must have the same length")
    nblocks = (int(channels) + 3) // 4
    blocks = np.arange(nblocks, dtype=np.uint64)
    words = block(seed, image[:, None], stream, position[:, None], step, blocks[None, :])
    z0, z1 = box_muller(words[..., 0], words[..., 1])
    z2, z3 = box_muller(words[..., 2], words[..., 3])
    z = np.stack([z0, z1, z2, z3], axis=-1).reshape(len(image), 4 * nblocks)
    return z[:, :channels].astype(np.float32)


def order_words(seed, image, n):
    """The stream-0 word of each position p < n: word p % 4 of block p // 4,
    c2 = 0, step 0 (uint64 array of length n)."""
    p = np.arange(n, dtype=np.uint64)
    words = block(seed, image, STREAM_ORDER, 0, 0, p // np.uint64(4))
    return words[np.arange(n), (p % np.uint64(4)).astype(np.int64)]


def generation_order(seed, image, n):
    """Generation order of one image: positions 0..n-1 sorted by (word, p)
    ascending, int64 array of length n (a permutation)."""
    words = order_words(seed, image, n)
    positions = np.arange(n, dtype=np.int64)
    return np.lexsort((positions, words)).astype(np.int64)


def var_sample_uniforms(seed, image, position, step):
    """Stream 3: the sampling uniform of each row, u = w / 2^32 in [0, 1) with w =
    word 0 of block 0 of (seed, image[i], 3, position[i], step); float64 [rows]."""
    image = np.asarray(image, dtype=np.uint64).reshape(-1)
    position = np.asarray(position, dtype=np.uint64).reshape(-1)
    words = block(seed, image, STREAM_VAR_SAMPLE, position, step, 0)
    return words[:, 0].astype(np.float64) / 4294967296.0


def var_gumbel_uniforms(seed, image, position, step, vocab):
    """Stream 4: the Gumbel uniforms of each row, u[i, j] = (w + 0.5) / 2^32 in (0, 1)
    with w = word j % 4 of block j // 4 of (seed, image[i], 4, position[i], step);
    float64 [rows, vocab]."""
    image = np.asarray(image, dtype=np.uint64).reshape(-1)
    position = np.asarray(position, dtype=np.uint64).reshape(-1)
    nblocks = (int(vocab) + 3) // 4
    blocks = np.arange(nblocks, dtype=np.uint64)
    words = block(seed, image[:, None], STREAM_VAR_GUMBEL, position[:, None], step, blocks[None, :])
    words = words.reshape(len(image), 4 * nblocks)[:, :vocab]
    return (words.astype(np.float64) + 0.5) / 4294967296.0

"""Float64 references of the backend ops of csrc/backend/ops.h.

Arrays replace the (pointer, leading dimension) pairs of the C interface:
pass slices for column sub-blocks. Every op returns a new float64 array and
never modifies its inputs. Conventions:
  * nn.Linear layout: W [out, in], y = x W^T + b.
  * NHWC images: [batch, height, width, channels].
"""
import math

import numpy as np

from . import philox

ACT_NONE = "none"
ACT_GELU = "gelu"
ACT_SILU = "silu"
ACT_GELU_TANH = "gelu_tanh"

_erf = np.vectorize(math.erf, otypes=[np.float64])


def f64(x):
    """Float64 copy-or-view of an array-like."""
    return np.asarray(x, dtype=np.float64)


# --------------------------------------------------------------------------
# dense
# --------------------------------------------------------------------------

def gemm(a, b, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, c=None):
    """C = alpha * op(A) op(B) + beta * C, op(X) = X or X^T.

    With beta == 0 the old C is ignored (as BLAS does: 0 * NaN is not
    propagated)."""
    a = f64(a)
    b = f64(b)
    oa = a.T if trans_a else a
    ob = b.T if trans_b else b
    out = float(alpha) * (oa @ ob)
    if beta != 0.0:
        out = out + float(beta) * f64(c)
    return out


def gelu(x):
    """Exact GELU: 0.5 x (1 + erf(x / sqrt 2)) (mar.md 1.2, nn.GELU default)."""
    x = f64(x)
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def gelu_tanh(x):
    """GELU, tanh approximation (var_fastvar.md A5.3, nn.GELU(approximate='tanh')):
    0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    x = f64(x)
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def sigmoid(x):
    """1 / (1 + exp(-x)) in float64 (exp overflow gives exactly 0)."""
    x = f64(x)
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    """SiLU / swish: x * sigmoid(x)."""
    x = f64(x)
    return x * sigmoid(x)


def activation(x, act):
    """act(x) for act in {"none", "gelu", "silu", "gelu_tanh"}."""
    if act == ACT_NONE or act is None:
        return f64(x).copy()
    if act == ACT_GELU:
        return gelu(x)
    if act == ACT_SILU:
        return silu(x)
    if act == ACT_GELU_TANH:
        return gelu_tanh(x)
    raise ValueError("unknown activation %r" % (act,))


def round_to_wtype(a, wtype):
    """float32 values of `a` rounded to nearest even in the 16-bit type `wtype`
    ("bf16", "fp16"; "fp32" leaves them), as returned by a 16-bit linear's operands.
    fp16 overflows to infinity like IEEE conversion; bf16 keeps the float32 exponent."""
    a = np.asarray(a, dtype=np.float32)
    if wtype == "fp32":
        return a.copy()
    if wtype == "fp16":
        with np.errstate(over="ignore"):
            return a.astype(np.float16).astype(np.float32)
    if wtype != "bf16":
        raise ValueError("wtype must be fp32, bf16 or fp16")
    bits = a.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    out = rounded.astype(np.uint32).view(np.float32)
    return np.where(np.isnan(a), a, out)


def linear(x, w, bias=None, act=ACT_NONE, beta=0.0, y=None):
    """y = beta * y + act(x W^T + bias). x [..., in], W [out, in].

    As in ops.h, beta is 0 or 1 and beta = 1 requires act == "none"
    (residual accumulation)."""
    if beta not in (0.0, 1.0):
        raise ValueError("beta must be 0 or 1")
    if beta == 1.0 and act not in (ACT_NONE, None):
        raise ValueError("beta = 1 needs act = none")
    out = f64(x) @ f64(w).T
    if bias is not None:
        out = out + f64(bias)
    out = activation(out, act)
    if beta == 1.0:
        out = f64(y) + out
    return out


def layernorm(x, w=None, b=None, eps=1e-6, shift=None, scale=None):
    """LayerNorm over the last dimension (PyTorch semantics).

    y = (x - mean) / sqrt(var_biased + eps); then y * w + b when w (and b)
    are given; then y * (1 + scale) + shift when shift/scale are given
    (adaLN modulation, broadcast against y)."""
    x = f64(x)
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps)
    if w is not None:
        y = y * f64(w)
    if b is not None:
        y = y + f64(b)
    if scale is not None:
        y = y * (1.0 + f64(scale))
    if shift is not None:
        y = y + f64(shift)
    return y


def add_rows(y, v, period=None):
    """y[r, :] + v[r % period, :] for a 2-D y [rows, dim], v [period, dim]."""
    y = f64(y)
    v = f64(v)
    if period is None:
        period = v.shape[0]
    idx = np.arange(y.shape[0]) % int(period)
    return y + v[idx]


def gated_add(y, u, gate):
    """y + gate * u elementwise (adaLN gated residual)."""
    return f64(y) + f64(gate) * f64(u)


def gather_rows(src, idx):
    """dst[i, :] = src[idx[i], :]."""
    return f64(src)[np.asarray(idx, dtype=np.int64)]


def scatter_rows(dst, idx, src):
    """Copy of dst with dst[idx[i], :] = src[i, :]."""
    out = f64(dst).copy()
    out[np.asarray(idx, dtype=np.int64)] = f64(src)
    return out


# --------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------

def softmax(s, axis=-1):
    """Numerically stable softmax (max subtracted; exact same maths)."""
    s = f64(s)
    s = s - s.max(axis=axis, keepdims=True)
    e = np.exp(s)
    return e / e.sum(axis=axis, keepdims=True)


def attention(q, segments, heads, scale=None, wtype="fp32"):
    """Multi-head attention without mask over a list of K/V segments.

    q: [batch, nq, heads * hd] (or [nq, heads * hd]); segments: list of
    (k, v) pairs, each [batch, rows_s, heads * hd] (rows_s may be 0). The
    keys/values are the row concatenation of the segments. Head h uses
    columns h*hd .. (h+1)*hd - 1 of q, k, v and writes the same columns of
    the output. scale defaults to hd^-0.5. Returns [batch, nq, heads*hd]
    (or 2-D if q was 2-D).

    wtype "bf16" / "fp16" with hd a multiple of 16 up to 128 is the 16-bit form of
    ops.h: q, k, v rounded to the type, the softmax probabilities rounded to it."""
    head_dim = np.shape(q)[-1] // heads
    if wtype != "fp32" and head_dim % 16 == 0 and head_dim <= 128:
        r = lambda a: round_to_wtype(np.asarray(a, np.float32), wtype)  # noqa: E731
        q = r(q)
        segments = [(r(k), r(v)) for k, v in segments]
    else:
        wtype = "fp32"
    q = f64(q)
    squeeze = q.ndim == 2
    if squeeze:
        q = q[None]
        segments = [(f64(k)[None], f64(v)[None]) for k, v in segments]
    k = np.concatenate([f64(k) for k, _ in segments], axis=1)
    v = np.concatenate([f64(v) for _, v in segments], axis=1)
    batch, nq, width = q.shape
    hd = width // heads
    if hd * heads != width:
        raise ValueError("width not divisible by heads")
    if scale is None:
        scale = hd ** -0.5
    out = np.empty_like(q)
    for h in range(heads):
        cols = slice(h * hd, (h + 1) * hd)
        s = float(scale) * np.einsum("bqd,bkd->bqk", q[:, :, cols], k[:, :, cols])
        p = softmax(s, axis=-1)
        if wtype != "fp32":
            p = f64(round_to_wtype(p.astype(np.float32), wtype))
        out[:, :, cols] = np.einsum("bqk,bkd->bqd", p, v[:, :, cols])
    return out[0] if squeeze else out


# --------------------------------------------------------------------------
# convolutional (NHWC)
# --------------------------------------------------------------------------

def groupnorm(x, groups, w, b, eps=1e-6, swish=False):
    """GroupNorm on NHWC [batch, ..., channels]: statistics per image and
    group over all spatial positions x channels/groups, biased variance;
    affine w, b [channels]; optional swish afterwards."""
    x = f64(x)
    shape = x.shape
    n, c = shape[0], shape[-1]
    if c % groups:
        raise ValueError("channels not divisible by groups")
    xg = x.reshape(n, -1, groups, c // groups)
    mean = xg.mean(axis=(1, 3), keepdims=True)
    var = ((xg - mean) ** 2).mean(axis=(1, 3), keepdims=True)
    y = ((xg - mean) / np.sqrt(var + eps)).reshape(shape)
    y = y * f64(w) + f64(b)
    if swish:
        y = silu(y)
    return y


def conv2d(x, w, bias=None, beta=0.0, y=None):
    """2-D convolution, stride 1, zero padding k // 2, NHWC in and out.

    x [N, H, W, Cin]; w in PyTorch layout [Cout, Cin, k, k] (odd k);
    bias [Cout] or None. Returns beta * y + conv(x) + bias.
    out[n, i, j, o] = sum_{c, dy, dx} x[n, i+dy-p, j+dx-p, c] w[o, c, dy, dx]."""
    x = f64(x)
    w = f64(w)
    cout, cin, kh, kw = w.shape
    if kh != kw or kh % 2 == 0 or x.shape[-1] != cin:
        raise ValueError("bad conv shapes %s %s" % (x.shape, w.shape))
    pad = kh // 2
    n, hgt, wid, _ = x.shape
    xp = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    out = np.zeros((n, hgt, wid, cout))
    for dy in range(kh):
        for dx in range(kw):
            out += xp[:, dy:dy + hgt, dx:dx + wid, :] @ w[:, :, dy, dx].T
    if bias is not None:
        out += f64(bias)
    if beta != 0.0:
        out = float(beta) * f64(y) + out
    return out


def conv_weight_to_packed(w):
    """PyTorch [Cout, Cin, k, k] -> the C backend's packed [Cout, k, k, Cin]."""
    return np.ascontiguousarray(np.transpose(np.asarray(w), (0, 2, 3, 1)))


def upsample_nearest2x(x):
    """Nearest x2 on NHWC: out[n, y, x, c] = in[n, y // 2, x // 2, c]."""
    x = f64(x)
    return np.repeat(np.repeat(x, 2, axis=1), 2, axis=2)


# --------------------------------------------------------------------------
# diffusion
# --------------------------------------------------------------------------

def cfg_combine(cond, uncond, scale, channels=None):
    """Guided eps: u + scale * (c - u) on the first `channels` columns."""
    cond = f64(cond)
    uncond = f64(uncond)
    if channels is None:
        channels = cond.shape[-1]
    c = cond[..., :channels]
    u = uncond[..., :channels]
    return u + float(scale) * (c - u)


DDPM_COEF_NAMES = ("sqrt_recip_alphas_cumprod", "sqrt_recipm1_alphas_cumprod",
                   "posterior_mean_coef1", "posterior_mean_coef2", "log_beta",
                   "posterior_log_variance", "noise_scale")


def ddpm_step(x, eps, v, noise, coefs):
    """One DDPM ancestral step with LEARNED_RANGE variance (mar.md 6.4).

    coefs: mapping with the keys of DDPM_COEF_NAMES (the float32-rounded
    table entries of the current spaced index, noise_scale = temperature,
    or 0 at the last step). noise may be None when noise_scale == 0.
      x0   = sqrt_recip_ac * x - sqrt_recipm1_ac * eps   (no clamp)
      mu   = coef1 * x0 + coef2 * x
      f    = (v + 1) / 2                                  (no clamp)
      logs = f * log_beta + (1 - f) * posterior_log_variance
      x'   = mu + noise_scale * exp(0.5 * logs) * noise
    """
    x = f64(x)
    eps = f64(eps)
    v = f64(v)
    g = {k: float(coefs[k]) for k in DDPM_COEF_NAMES}
    x0 = g["sqrt_recip_alphas_cumprod"] * x - g["sqrt_recipm1_alphas_cumprod"] * eps
    mu = g["posterior_mean_coef1"] * x0 + g["posterior_mean_coef2"] * x
    if g["noise_scale"] == 0.0:
        return mu
    frac = (v + 1.0) / 2.0
    log_var = frac * g["log_beta"] + (1.0 - frac) * g["posterior_log_variance"]
    return mu + g["noise_scale"] * np.exp(0.5 * log_var) * f64(noise)


def token_normals(seed, stream, step, image, position, channels):
    """ops.h token_normals: row i gets the `channels` Philox normals of
    (seed, image[i], stream, position[i], step); float32 [rows, channels]."""
    return philox.token_normals(seed, image, position, stream, step, channels)


def axpby(a, x, b, y):
    """y = a * x + b * y; with b == 0 the old y is not read (it may hold anything)."""
    x = f64(x)
    if b == 0:
        return a * x
    return a * x + b * f64(y)


def cosine_rows(a, b, heads, eps=1e-8):
    """Mean over heads of the cosine between matching head slices of rows of a
    and b (torch.nn.functional.cosine_similarity: a.b / max(|a| |b|, eps))."""
    a, b = f64(a), f64(b)
    rows, cols = a.shape
    a = a.reshape(rows, heads, cols // heads)
    b = b.reshape(rows, heads, cols // heads)
    dot = (a * b).sum(-1)
    denom = np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), eps)
    return (dot / denom).mean(-1)


def head_l2norm(x, heads, head_scale=None, eps=1e-12):
    """Each head slice v of each row (x [rows, heads * hd]) as v / max(||v||_2, eps)
    * head_scale[h] (F.normalize over the head channels, then VAR's per-head query
    scale; var_fastvar.md A5.2). head_scale None: 1."""
    x = f64(x)
    rows, cols = x.shape
    v = x.reshape(rows, heads, cols // heads)
    norm = np.maximum(np.sqrt((v * v).sum(-1, keepdims=True)), eps)
    scale = np.ones(heads) if head_scale is None else f64(head_scale)
    return (v / norm * scale[None, :, None]).reshape(rows, cols)


def attention_mass(q, k, heads, scale=None):
    """out[b, j] = sum over heads and query rows of softmax_j(scale q.k_j)
    (MARche's relevance of key rows to the queries). q [B, nq, H*hd], k [B, keys, H*hd]."""
    q, k = f64(q), f64(k)
    B, nq, cols = q.shape
    hd = cols // heads
    scale = 1.0 / np.sqrt(hd) if scale is None else scale
    out = np.zeros((B, k.shape[1]))
    for h in range(heads):
        qs, ks = q[:, :, h * hd:(h + 1) * hd], k[:, :, h * hd:(h + 1) * hd]
        out += softmax(scale * np.einsum("bid,bjd->bij", qs, ks), axis=-1).sum(axis=1)
    return out
# --------------------------------------------------------------------------
# FID-Inception window ops (eval_and_formats.md 3-4), NHWC
# --------------------------------------------------------------------------

def window_out_size(size, k, stride, pad):
    """PyTorch's output size (floor): (size + 2 pad - k) // stride + 1."""
    return (size + 2 * pad - k) // stride + 1


def conv2d_ex(x, w, bias=None, stride=(1, 1), pad=(0, 0), beta=0.0, y=None, relu=False):
    """General 2-D convolution, NHWC: x [N, H, W, Cin], w in PyTorch layout
    [Cout, Cin, kh, kw], zero padding pad = (ph, pw), strides (sh, sw).
    out[n, i, j, o] = sum_{c, dy, dx} xpad[n, i sh + dy, j sw + dx, c] w[o, c, dy, dx];
    result = relu?(beta * y + out + bias)."""
    x = f64(x)
    w = f64(w)
    cout, cin, kh, kw = w.shape
    if x.shape[-1] != cin:
        raise ValueError("bad conv shapes %s %s" % (x.shape, w.shape))
    (sh, sw), (ph, pw) = stride, pad
    n, hgt, wid, _ = x.shape
    oh, ow = window_out_size(hgt, kh, sh, ph), window_out_size(wid, kw, sw, pw)
    xp = np.pad(x, ((0, 0), (ph, ph), (pw, pw), (0, 0)))
    out = np.zeros((n, oh, ow, cout))
    for dy in range(kh):
        for dx in range(kw):
            tap = xp[:, dy:dy + sh * (oh - 1) + 1:sh, dx:dx + sw * (ow - 1) + 1:sw, :]
            out += tap @ w[:, :, dy, dx].T
    if bias is not None:
        out += f64(bias)
    if beta != 0.0:
        out = float(beta) * f64(y) + out
    if relu:
        out = np.maximum(out, 0.0)
    return out


def _pool_windows(x, kh, kw, stride, pad, fill):
    """[N, OH, OW, kh * kw, C] window taps of x padded with `fill`, and the
    matching mask of taps inside the image."""
    x = f64(x)
    (sh, sw), (ph, pw) = stride, pad
    n, hgt, wid, c = x.shape
    oh, ow = window_out_size(hgt, kh, sh, ph), window_out_size(wid, kw, sw, pw)
    xp = np.pad(x, ((0, 0), (ph, ph), (pw, pw), (0, 0)), constant_values=fill)
    inside = np.pad(np.ones((hgt, wid)), ((ph, ph), (pw, pw)))
    taps, masks = [], []
    for dy in range(kh):
        for dx in range(kw):
            taps.append(xp[:, dy:dy + sh * (oh - 1) + 1:sh, dx:dx + sw * (ow - 1) + 1:sw, :])
            masks.append(inside[dy:dy + sh * (oh - 1) + 1:sh, dx:dx + sw * (ow - 1) + 1:sw])
    return np.stack(taps, axis=3), np.stack(masks, axis=2)


def avg_pool2d(x, kh, kw, stride=None, pad=(0, 0), count_include_pad=True):
    """PyTorch avg_pool2d on NHWC (stride defaults to the kernel). With
    count_include_pad=False the divisor is the number of taps inside the
    image (TF's average pool); else kh * kw."""
    stride = stride or (kh, kw)
    taps, mask = _pool_windows(x, kh, kw, stride, pad, 0.0)
    total = taps.sum(axis=3)
    if count_include_pad:
        return total / (kh * kw)
    return total / mask.sum(axis=2)[None, :, :, None]


def max_pool2d(x, kh, kw, stride=None, pad=(0, 0)):
    """PyTorch max_pool2d on NHWC (padding never wins)."""
    stride = stride or (kh, kw)
    taps, _ = _pool_windows(x, kh, kw, stride, pad, -np.inf)
    return taps.max(axis=3)


def tf1_grid(in_size, out_size):
    """One axis of TF1 bilinear resizing (align_corners=False, no half-pixel
    offset), in float32 as torch-fidelity's 'slow' method and TF compute it:
    scale = float32(in / out); src = float32(o) * scale; lo = floor(src);
    hi = min(lo + 1, in - 1); frac = src - lo."""
    scale = np.float32(in_size / out_size)
    src = np.arange(out_size, dtype=np.float32) * scale
    lo = np.minimum(np.floor(src).astype(np.int64), in_size - 1)
    hi = np.minimum(lo + 1, in_size - 1)
    frac = (src - lo.astype(np.float32)).astype(np.float32)
    return lo, hi, frac


def resize_bilinear_tf1(x, out_h, out_w, normalize=False):
    """TF1 bilinear resize of NHWC images (eval_and_formats.md 4). This one
    is float32 by definition, not float64: the semantics are TF's float32
    arithmetic, and the engine must match it bit for bit. uint8 input is
    converted to float32 first; normalize applies (y - 128) / 128."""
    x = np.asarray(x).astype(np.float32)
    ly, hy, fy = tf1_grid(x.shape[1], out_h)
    lx, hx, fx = tf1_grid(x.shape[2], out_w)
    fx = fx[None, None, :, None]
    top_l, top_r = x[:, ly][:, :, lx], x[:, ly][:, :, hx]
    bot_l, bot_r = x[:, hy][:, :, lx], x[:, hy][:, :, hx]
    top = top_l + (top_r - top_l) * fx
    bot = bot_l + (bot_r - bot_l) * fx
    out = top + (bot - top) * fy[None, :, None, None]
    if normalize:
        out = (out - np.float32(128)) / np.float32(128)
    return out.astype(np.float32)


# --------------------------------------------------------------------------
# VAR sampling (var_fastvar.md A6; the contracts of sample_tokens and
# gumbel_softmax in csrc/backend/ops_list.h)
# --------------------------------------------------------------------------

def _weights(row, max_logit):
    """exp(l - max) in float64 for each float32 logit l (0 for -inf), with the C
    library's exp (math.exp) so the weights are the ones a C loop computes."""
    return np.array([0.0 if v == -np.inf else math.exp(float(v) - max_logit) for v in row],
                    dtype=np.float64)


def top_k_threshold(row, k):
    """The k-th largest value of the row, counting repeats (1 <= k <= len(row))."""
    return np.sort(np.asarray(row))[::-1][k - 1]


def sample_tokens(logits, top_k, top_p, seed, step, image, position):
    """VAR's sampler on float32 logits [rows, vocab]: returns (tokens int64 [rows],
    masked logits float32 [rows, vocab]).

    Per row, with m = the row's largest logit:
      a) 0 < top_k < vocab: logits below the top_k-th largest (ties kept) -> -inf.
      b) 0 < top_p < 1 (top_p rounded to float32, as the op receives it): e = exp(l - m)
         (0 for -inf), S = sequential sum of e in vocabulary order, p = e / S; the
         entries in ascending (value, index) order; c = sequential running sum of p in
         that order; entries with c <= 1 - top_p become -inf, except the last one.
      c) u = philox stream 3 uniform of (seed, image, position, step); q = exp(l - m) of
         the filtered row (0 for -inf), c = running sum in vocabulary order; the token is
         the first j with c_j > u * c[-1], else the last j with q_j > 0.
    Sums are sequential (np.cumsum accumulates left to right), so the float32 logits
    give the same decisions as any implementation that sums in these orders.
    """
    masked = np.array(logits, dtype=np.float32)
    rows, vocab = masked.shape
    top_p = float(np.float32(top_p))
    uniforms = philox.var_sample_uniforms(seed, image, position, step)
    tokens = np.zeros(rows, dtype=np.int64)
    for r in range(rows):
        row = masked[r]
        max_logit = float(row.max())
        if 0 < top_k < vocab:
            row[row < top_k_threshold(row, top_k)] = -np.inf
        if 0.0 < top_p < 1.0:
            e = _weights(row, max_logit)
            p = e / np.cumsum(e)[-1]
            # lexsort: the last key is the primary one; -0.0 == 0.0 as values
            order = np.lexsort((np.arange(vocab), row.astype(np.float64)))
            remove = np.cumsum(p[order]) <= 1.0 - top_p
            remove[-1] = False
            row[order[remove]] = -np.inf
        q = _weights(row, max_logit)
        c = np.cumsum(q)
        above = np.nonzero(c > uniforms[r] * c[-1])[0]
        tokens[r] = above[0] if above.size else np.nonzero(q > 0.0)[0][-1]
    return tokens, masked


def gumbel_softmax(logits, logit_scale, tau, seed, step, image, position):
    """VAR's more_smooth weights, float64 [rows, vocab]:
    softmax_j((l_j * logit_scale + g_j) / tau) with g = -log(-log(u)), u the philox
    stream 4 uniforms (u = (w + 0.5) / 2^32); -inf logits get probability 0.
    logit_scale and tau are rounded to float32 as the op receives them."""
    l = f64(logits)
    rows, vocab = l.shape
    scale = float(np.float32(logit_scale))
    tau = float(np.float32(tau))
    u = philox.var_gumbel_uniforms(seed, image, position, step, vocab)
    gumbel = -np.log(-np.log(u))
    finite = l != -np.inf
    z = np.where(finite, (np.where(finite, l, 0.0) * scale + gumbel) / tau, -np.inf)
    z = z - z.max(axis=1, keepdims=True)
    e = np.where(finite, np.exp(z), 0.0)
    return e / e.sum(axis=1, keepdims=True)

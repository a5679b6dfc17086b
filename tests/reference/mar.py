"""Float64 reference of MAR inference (LTH14/mar), written from mar.md.

Section numbers (section N.M) refer to /work/shared/spec/mar.md. Weights are a
mapping name -> array with the official state_dict key names (section 4,
Appendix A); they are read as float64 at use. Randomness comes from the
Philox contract of csrc/core/philox.h (see philox.py), not from NumPy/torch.
"""
import math
from collections import OrderedDict

import numpy as np

from . import ops, philox

LN_EPS = 1e-6          # section 1.2: every LayerNorm of the transformer and head
MLP_RATIO = 4          # section 1.2
FREQ_DIM = 256         # section 5.1: timestep frequency embedding size
MAX_PERIOD = 10000     # section 5.1
HEAD = "diffloss.net."

# Section 1.1: (D, depth, heads, head width W, head depth d).
CONFIGS = {
    "mar_base": dict(dim=768, depth=12, heads=12, head_width=1024, head_depth=6),
    "mar_large": dict(dim=1024, depth=16, heads=16, head_width=1280, head_depth=8),
    "mar_huge": dict(dim=1280, depth=20, heads=16, head_width=1536, head_depth=12),
}

# Section 5.1 says the timestep embedding is computed in fp32. With True,
# timestep_embedding emulates that (float32 freqs, float32 t * freq, cos/sin
# rounded to float32); with False it is plain float64.
TIMESTEP_FP32 = True


# ==========================================================================
# Known-wrong variants, for tests/mutations.py only
# ==========================================================================
# MUTATION maps a variant name to its value. Empty (always, except inside
# tests/mutations.py's `mutation(...)` context) means exactly the spec. Each
# variant is a mistake a port commonly makes; the mutation test shows that the
# engine tests would notice it. The names read here and in lazymar.py / marche.py:
#   "ln_eps.<site>": eps of LayerNorm <site> (LN_SITES)
#   "cfg_sign", "v_cfg", "v_uncond", "v_from_eps", "v_ignored": see guided_eps_v
#   "noise_at_last_step": see ddpm_coefs / step_noise
MUTATION = {}

# Every LayerNorm call site, by the name ln_eps takes.
LN_SITES = ("z_proj_ln", "encoder_norm", "norm1", "norm2", "decoder_norm", "head_in_ln", "head_final")


def mutated(name):
    """The value of variant `name` (False when the spec's choice is in force)."""
    return MUTATION.get(name, False)


def ln_eps(site):
    """The eps of LayerNorm `site` (one of LN_SITES): LN_EPS unless a variant changes it."""
    if site not in LN_SITES:
        raise KeyError(site)
    return MUTATION.get("ln_eps." + site, LN_EPS)


# ==========================================================================
# Weights: names, shapes, random initialisation (section 4, Appendix A)
# ==========================================================================

def _block_shapes(prefix, dim):
    """The 12 tensors of one timm Block (section 3.1), state_dict order."""
    hidden = MLP_RATIO * dim
    return [
        (prefix + ".norm1.weight", (dim,)), (prefix + ".norm1.bias", (dim,)),
        (prefix + ".attn.qkv.weight", (3 * dim, dim)), (prefix + ".attn.qkv.bias", (3 * dim,)),
        (prefix + ".attn.proj.weight", (dim, dim)), (prefix + ".attn.proj.bias", (dim,)),
        (prefix + ".norm2.weight", (dim,)), (prefix + ".norm2.bias", (dim,)),
        (prefix + ".mlp.fc1.weight", (hidden, dim)), (prefix + ".mlp.fc1.bias", (hidden,)),
        (prefix + ".mlp.fc2.weight", (dim, hidden)), (prefix + ".mlp.fc2.bias", (dim,)),
    ]


def mar_shapes(dim, depth, head_width, head_depth, seq_len=256, buffer=64,
               token_channels=16, num_classes=1000):
    """OrderedDict key -> shape of a MAR state_dict (section 4.1 generalised:
    encoder and decoder of the same width and depth), in state_dict order."""
    D, W, C = dim, head_width, token_channels
    L = seq_len + buffer
    s = [
        ("fake_latent", (1, D)),
        ("encoder_pos_embed_learned", (1, L, D)),
        ("mask_token", (1, 1, D)),
        ("decoder_pos_embed_learned", (1, L, D)),
        ("diffusion_pos_embed_learned", (1, seq_len, D)),
        ("class_emb.weight", (num_classes, D)),
        ("z_proj.weight", (D, C)), ("z_proj.bias", (D,)),
        ("z_proj_ln.weight", (D,)), ("z_proj_ln.bias", (D,)),
    ]
    for i in range(depth):
        s += _block_shapes("encoder_blocks.%d" % i, D)
    s += [("encoder_norm.weight", (D,)), ("encoder_norm.bias", (D,)),
          ("decoder_embed.weight", (D, D)), ("decoder_embed.bias", (D,))]
    for i in range(depth):
        s += _block_shapes("decoder_blocks.%d" % i, D)
    s += [("decoder_norm.weight", (D,)), ("decoder_norm.bias", (D,))]
    s += [
        (HEAD + "time_embed.mlp.0.weight", (W, FREQ_DIM)), (HEAD + "time_embed.mlp.0.bias", (W,)),
        (HEAD + "time_embed.mlp.2.weight", (W, W)), (HEAD + "time_embed.mlp.2.bias", (W,)),
        (HEAD + "cond_embed.weight", (W, D)), (HEAD + "cond_embed.bias", (W,)),
        (HEAD + "input_proj.weight", (W, C)), (HEAD + "input_proj.bias", (W,)),
    ]
    for j in range(head_depth):
        p = HEAD + "res_blocks.%d." % j
        s += [
            (p + "in_ln.weight", (W,)), (p + "in_ln.bias", (W,)),
            (p + "mlp.0.weight", (W, W)), (p + "mlp.0.bias", (W,)),
            (p + "mlp.2.weight", (W, W)), (p + "mlp.2.bias", (W,)),
            (p + "adaLN_modulation.1.weight", (3 * W, W)), (p + "adaLN_modulation.1.bias", (3 * W,)),
        ]
    s += [
        (HEAD + "final_layer.linear.weight", (2 * C, W)), (HEAD + "final_layer.linear.bias", (2 * C,)),
        (HEAD + "final_layer.adaLN_modulation.1.weight", (2 * W, W)),
        (HEAD + "final_layer.adaLN_modulation.1.bias", (2 * W,)),
    ]
    return OrderedDict(s)


def official_shapes(name):
    """Full key -> shape dict of "mar_base" / "mar_large" / "mar_huge"
    (364 / 476 / 604 tensors, section 1.1 and 4)."""
    c = CONFIGS[name]
    return mar_shapes(c["dim"], c["depth"], c["head_width"], c["head_depth"])


def random_mar_weights(rng, dim, depth, heads_unused, head_width, head_depth, seq_len=256,
                       buffer=64, token_channels=16, num_classes=1000, scale=0.05,
                       embed_scale=0.5):
    """Random MAR weights with the official names and shapes (float32).

    Matrices and biases ~ N(0, scale^2); LayerNorm weights (the only 1-D
    ".weight" tensors) ~ 1 + N(0, scale^2); learned embeddings (fake_latent,
    pos embeds, mask_token, class_emb) ~ N(0, embed_scale^2). heads is not
    stored in the weights (section 4.2) and is ignored."""
    del heads_unused
    shapes = mar_shapes(dim, depth, head_width, head_depth, seq_len, buffer,
                        token_channels, num_classes)
    embeddings = {"fake_latent", "encoder_pos_embed_learned", "mask_token",
                  "decoder_pos_embed_learned", "diffusion_pos_embed_learned",
                  "class_emb.weight"}
    out = OrderedDict()
    for name, shape in shapes.items():
        z = rng.standard_normal(shape)
        if name in embeddings:
            val = embed_scale * z
        elif name.endswith(".weight") and len(shape) == 1:
            val = 1.0 + scale * z
        else:
            val = scale * z
        out[name] = val.astype(np.float32)
    return out


def _p(W, name):
    """Weight `name` as float64."""
    return ops.f64(W[name])


def model_sizes(W):
    """Hyper-parameters read back from the shapes (section 4.2)."""
    seq_len = W["diffusion_pos_embed_learned"].shape[1]
    return dict(
        dim=W["class_emb.weight"].shape[1],
        seq_len=seq_len,
        buffer=W["encoder_pos_embed_learned"].shape[1] - seq_len,
        token_channels=W["z_proj.weight"].shape[1],
        depth=sum(1 for k in W if k.startswith("encoder_blocks.") and k.endswith(".norm1.weight")),
        head_width=W[HEAD + "input_proj.weight"].shape[0],
        head_depth=sum(1 for k in W if k.startswith(HEAD + "res_blocks.")
                       and k.endswith(".in_ln.weight")),
    )


# ==========================================================================
# Transformer (section 3)
# ==========================================================================

def block(x, p, prefix, heads):
    """timm Block (section 3.1) on x [..., L, dim]; prefix e.g.
    "encoder_blocks.0" (no trailing dot)."""
    w = lambda n: _p(p, prefix + "." + n)  # noqa: E731
    dim = x.shape[-1]
    a = ops.layernorm(x, w("norm1.weight"), w("norm1.bias"), ln_eps("norm1"))
    qkv = ops.linear(a, w("attn.qkv.weight"), w("attn.qkv.bias"))
    q, k, v = qkv[..., :dim], qkv[..., dim:2 * dim], qkv[..., 2 * dim:]
    o = ops.attention(q, [(k, v)], heads)  # scale hd^-0.5, heads side by side
    x = ops.linear(o, w("attn.proj.weight"), w("attn.proj.bias"), beta=1.0, y=x)
    m = ops.layernorm(x, w("norm2.weight"), w("norm2.bias"), ln_eps("norm2"))
    m = ops.linear(m, w("mlp.fc1.weight"), w("mlp.fc1.bias"), act=ops.ACT_GELU)
    return ops.linear(m, w("mlp.fc2.weight"), w("mlp.fc2.bias"), beta=1.0, y=x)


def kept_rows(mask, buffer):
    """Rows of the 320-row sequence the encoder keeps (section 3.2 step 5):
    0..buffer-1, then buffer + l for every known l (mask 0), ascending.
    Returns int64 [B', buffer + K]; K must be equal for all rows."""
    mask = np.asarray(mask).astype(bool)
    rows = [np.concatenate([np.arange(buffer), buffer + np.flatnonzero(~m)]) for m in mask]
    if len({len(r) for r in rows}) != 1:
        raise ValueError("every row must have the same number of known tokens")
    return np.stack(rows).astype(np.int64)


def encoder(W, tokens, mask, cls_vec, heads):
    """MAE encoder (section 3.2). tokens [B', S, C], mask [B', S] (1 =
    unknown), cls_vec [B', D]. Returns E [B', buffer + K, D]."""
    sz = model_sizes(W)
    P = sz["buffer"]
    tokens = ops.f64(tokens)
    nb = tokens.shape[0]
    y = ops.linear(tokens, _p(W, "z_proj.weight"), _p(W, "z_proj.bias"))        # step 1
    h = np.concatenate([np.zeros((nb, P, sz["dim"])), y], axis=1)              # step 2
    h[:, :P, :] = ops.f64(cls_vec)[:, None, :]                                 # buffer overwrite
    h = h + _p(W, "encoder_pos_embed_learned")[0]                              # step 3
    h = ops.layernorm(h, _p(W, "z_proj_ln.weight"), _p(W, "z_proj_ln.bias"), ln_eps("z_proj_ln"))  # step 4
    keep = kept_rows(mask, P)                                                  # step 5
    h = np.take_along_axis(h, keep[:, :, None], axis=1)
    for i in range(sz["depth"]):                                               # step 6
        h = block(h, W, "encoder_blocks.%d" % i, heads)
    return ops.layernorm(h, _p(W, "encoder_norm.weight"), _p(W, "encoder_norm.bias"), ln_eps("encoder_norm"))


def decoder(W, E, mask, heads):
    """MAE decoder (section 3.3). E [B', buffer + K, D], mask [B', S].
    Returns Z [B', S, Dd] (diffusion_pos_embed added, no final norm)."""
    sz = model_sizes(W)
    P = sz["buffer"]
    g = ops.linear(E, _p(W, "decoder_embed.weight"), _p(W, "decoder_embed.bias"))  # step 1
    nb = g.shape[0]
    full = np.broadcast_to(_p(W, "mask_token"), (nb, P + sz["seq_len"], g.shape[-1])).copy()
    keep = kept_rows(mask, P)                                                     # step 2
    full[np.arange(nb)[:, None], keep] = g
    f = full + _p(W, "decoder_pos_embed_learned")[0]                              # step 3
    for i in range(sz["depth"]):                                                  # step 4
        f = block(f, W, "decoder_blocks.%d" % i, heads)
    f = ops.layernorm(f, _p(W, "decoder_norm.weight"), _p(W, "decoder_norm.bias"), ln_eps("decoder_norm"))
    return f[:, P:, :] + _p(W, "diffusion_pos_embed_learned")[0]                 # steps 6-7


def class_vectors(W, labels_or_None, num_images):
    """Section 7.2 step 2: class_emb.weight[labels], or fake_latent repeated
    num_images times when labels is None (unconditional)."""
    if labels_or_None is None:
        return np.repeat(_p(W, "fake_latent"), num_images, axis=0)
    labels = np.asarray(labels_or_None, dtype=np.int64).reshape(-1)
    if len(labels) != num_images:
        raise ValueError("need one label per image")
    return _p(W, "class_emb.weight")[labels]


def transformer(W, tokens, mask, labels_or_None, heads, cfg_on):
    """Section 7.2 steps 2-4: encoder + decoder on the (for CFG doubled)
    batch. Rows 0..B-1 conditional, B..2B-1 unconditional (fake_latent).
    Returns Z [B', S, Dd]."""
    tokens = ops.f64(tokens)
    mask = np.asarray(mask).astype(bool)
    nb = tokens.shape[0]
    cls = class_vectors(W, labels_or_None, nb)
    if cfg_on:
        tokens = np.concatenate([tokens, tokens])
        mask = np.concatenate([mask, mask])
        cls = np.concatenate([cls, np.repeat(_p(W, "fake_latent"), nb, axis=0)])
    return decoder(W, encoder(W, tokens, mask, cls, heads), mask, heads)


# ==========================================================================
# Diffusion head (section 5)
# ==========================================================================

def timestep_embedding(t, dim=FREQ_DIM, max_period=MAX_PERIOD, fp32=None):
    """Section 5.1 step 1: [cos(t f_k), sin(t f_k)], f_k = exp(-ln(P) k/half).

    t: scalar or [N]. Returns [dim] or [N, dim] float64. With fp32 (default
    TIMESTEP_FP32) the fp32 computation of the reference is emulated:
    f = f32(exp(f32(f32(-ln P) * k) / half)), a = f32(t * f),
    out = f32(cos a), f32(sin a). Only the even-dim branch exists."""
    if fp32 is None:
        fp32 = TIMESTEP_FP32
    half = dim // 2
    t = np.asarray(t, dtype=np.float64)
    k = np.arange(half, dtype=np.float64)
    if fp32:
        f32 = np.float32
        expo = (f32(-math.log(max_period)) * k.astype(f32)).astype(f32) / f32(half)
        freqs = np.exp(expo.astype(np.float64)).astype(f32)
        args = (t[..., None].astype(f32) * freqs).astype(f32).astype(np.float64)
        emb = np.concatenate([np.cos(args), np.sin(args)], axis=-1)
        return emb.astype(f32).astype(np.float64)
    freqs = np.exp(-math.log(max_period) * k / half)
    args = t[..., None] * freqs
    return np.concatenate([np.cos(args), np.sin(args)], axis=-1)


def head_net(W, x, t, c):
    """SimpleMLPAdaLN forward (section 5.1). x [N, C], t scalar or [N]
    (original 0..999 index), c [N, Dd]. Returns [N, 2C] (eps | v)."""
    w = lambda n: _p(W, HEAD + n)  # noqa: E731
    x = ops.f64(x)
    n = x.shape[0]
    tf = np.broadcast_to(timestep_embedding(t), (n, FREQ_DIM))                       # step 1
    t_emb = ops.linear(tf, w("time_embed.mlp.0.weight"), w("time_embed.mlp.0.bias"),
                       act=ops.ACT_SILU)
    t_emb = ops.linear(t_emb, w("time_embed.mlp.2.weight"), w("time_embed.mlp.2.bias"))  # step 2
    c_emb = ops.linear(c, w("cond_embed.weight"), w("cond_embed.bias"))              # step 3
    y_act = ops.silu(t_emb + c_emb)                                                 # step 4 (+SiLU)
    h = ops.linear(x, w("input_proj.weight"), w("input_proj.bias"))                  # step 5
    width = h.shape[-1]
    j = 0
    while HEAD + "res_blocks.%d.in_ln.weight" % j in W:                              # step 6
        r = "res_blocks.%d." % j
        m = ops.linear(y_act, w(r + "adaLN_modulation.1.weight"), w(r + "adaLN_modulation.1.bias"))
        shift, scale, gate = m[:, :width], m[:, width:2 * width], m[:, 2 * width:]
        u = ops.layernorm(h, w(r + "in_ln.weight"), w(r + "in_ln.bias"), ln_eps("head_in_ln"),
                          shift=shift, scale=scale)
        u = ops.linear(u, w(r + "mlp.0.weight"), w(r + "mlp.0.bias"), act=ops.ACT_SILU)
        u = ops.linear(u, w(r + "mlp.2.weight"), w(r + "mlp.2.bias"))
        h = ops.gated_add(h, u, gate)
        j += 1
    m = ops.linear(y_act, w("final_layer.adaLN_modulation.1.weight"),                # step 7
                   w("final_layer.adaLN_modulation.1.bias"))
    u = ops.layernorm(h, None, None, ln_eps("head_final"), shift=m[:, :width], scale=m[:, width:])
    return ops.linear(u, w("final_layer.linear.weight"), w("final_layer.linear.bias"))


def head_net_cfg(W, x, t, c, cfg_scale):
    """forward_with_cfg (section 5.2). x [2n, C] (second half ignored),
    c [2n, Dd] (cond rows then uncond rows). Returns [2n, 2C]: guided eps
    in both halves, v per row (unguided)."""
    x = ops.f64(x)
    n = x.shape[0] // 2
    ch = x.shape[1]
    half = x[:n]
    out = head_net(W, np.concatenate([half, half]), t, c)
    guided = ops.cfg_combine(out[:n], out[n:], cfg_scale, ch)
    eps = np.concatenate([guided, guided])
    return np.concatenate([eps, out[:, ch:]], axis=1)


# ==========================================================================
# Gaussian diffusion tables (section 6.1-6.3)
# ==========================================================================

def cosine_alpha_bar(s):
    """Section 6.1: cos^2((s + 0.008) / 1.008 * pi / 2)."""
    return math.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2


def base_betas(num_timesteps=1000, max_beta=0.999):
    """Section 6.1: beta_i = min(1 - abar((i+1)/T) / abar(i/T), 0.999)."""
    betas = [min(1 - cosine_alpha_bar((i + 1) / num_timesteps) / cosine_alpha_bar(i / num_timesteps),
                 max_beta) for i in range(num_timesteps)]
    return np.array(betas, dtype=np.float64)


def space_timesteps(num_timesteps, section_counts):
    """Section 6.2: kept original timesteps, sorted ascending.

    section_counts: int, "N", or comma-separated counts (one per equal
    section; the spec only describes one section, the multi-section split
    follows the same rule per section). For each section of size `size`:
    stride = (size - 1) / (count - 1) (1 if count <= 1), cur = 0.0; count
    times: take start + round(cur) (Python round), cur += stride."""
    if isinstance(section_counts, str):
        if section_counts.startswith("ddim"):
            # "ddimN": the integer stride i giving exactly N steps (section 11.2).
            want = int(section_counts[4:])
            for i in range(1, num_timesteps):
                if len(range(0, num_timesteps, i)) == want:
                    return list(range(0, num_timesteps, i))
            raise ValueError("cannot create exactly %d steps with an integer stride" % want)
        counts = [int(s) for s in section_counts.split(",")]
    else:
        counts = [int(section_counts)]
    size_per, extra = divmod(num_timesteps, len(counts))
    start, steps = 0, []
    for i, count in enumerate(counts):
        size = size_per + (1 if i < extra else 0)
        if size < count:
            raise ValueError("cannot divide section of %d steps into %d" % (size, count))
        stride = 1 if count <= 1 else (size - 1) / (count - 1)
        cur = 0.0
        for _ in range(count):
            steps.append(start + round(cur))
            cur += stride
        start += size
    return sorted(set(steps))


def diffusion_tables(num_steps=100, num_timesteps=1000):
    """All float64 tables of sections 6.1-6.3 for respacing str(num_steps).

    Keys: base_betas, base_alphas_cumprod, timesteps (tau_j, int64), betas
    (beta'), alphas_cumprod, alphas_cumprod_prev, sqrt_recip_alphas_cumprod,
    sqrt_recipm1_alphas_cumprod, posterior_variance,
    posterior_log_variance_clipped, posterior_mean_coef1,
    posterior_mean_coef2, log_betas."""
    b = base_betas(num_timesteps)
    abar = np.cumprod(1.0 - b)
    tau = space_timesteps(num_timesteps, str(num_steps))
    betas, last = [], 1.0
    for i in tau:                                 # beta'_j = 1 - abar[tau_j] / abar[tau_{j-1}]
        betas.append(1.0 - abar[i] / last)
        last = abar[i]
    betas = np.array(betas, dtype=np.float64)
    ac = np.cumprod(1.0 - betas)
    ac_prev = np.append(1.0, ac[:-1])
    post_var = betas * (1.0 - ac_prev) / (1.0 - ac)
    return dict(
        base_betas=b,
        base_alphas_cumprod=abar,
        timesteps=np.array(tau, dtype=np.int64),
        betas=betas,
        alphas_cumprod=ac,
        alphas_cumprod_prev=ac_prev,
        sqrt_recip_alphas_cumprod=np.sqrt(1.0 / ac),
        sqrt_recipm1_alphas_cumprod=np.sqrt(1.0 / ac - 1.0),
        posterior_variance=post_var,
        posterior_log_variance_clipped=np.log(np.append(post_var[1], post_var[1:])),
        posterior_mean_coef1=betas * np.sqrt(ac_prev) / (1.0 - ac),
        posterior_mean_coef2=(1.0 - ac_prev) * np.sqrt(1.0 - betas) / (1.0 - ac),
        log_betas=np.log(betas),
    )


def ddpm_coefs(tables, j, temperature):
    """ops.ddpm_step coefficients of spaced index j, each table entry rounded
    to float32 at use (section 6); noise_scale = f32(temperature), or 0 at
    j == 0."""
    f = lambda key: float(np.float32(tables[key][j]))  # noqa: E731
    return dict(
        sqrt_recip_alphas_cumprod=f("sqrt_recip_alphas_cumprod"),
        sqrt_recipm1_alphas_cumprod=f("sqrt_recipm1_alphas_cumprod"),
        posterior_mean_coef1=f("posterior_mean_coef1"),
        posterior_mean_coef2=f("posterior_mean_coef2"),
        log_beta=f("log_betas"),
        posterior_log_variance=f("posterior_log_variance_clipped"),
        noise_scale=0.0 if j == 0 and not mutated("noise_at_last_step") else float(np.float32(temperature)),
    )


def step_noise(seed, images, positions, j, ch):
    """The noise of spaced step j (section 6.5): token_normals(stream 2, step j), none
    at j == 0 (the last step adds no noise; variant "noise_at_last_step" adds it)."""
    if j == 0 and not mutated("noise_at_last_step"):
        return None
    return philox.token_normals(seed, images, positions, philox.STREAM_HEAD_STEP, j, ch)


def guided_eps_v(out_c, out_u, cfg_scale, ch):
    """(eps, v) of the n conditional state rows from the network outputs out_c
    [n, 2C] (conditional) and out_u [n, 2C] (unconditional, None without CFG):
    eps = u + s (c - u) on the eps columns only; v is the conditional row's own,
    unguided (section 5.2). The variants change exactly one of these choices:
    "cfg_sign" u - s (c - u); "v_cfg" guidance also on v; "v_uncond" v of the
    unconditional row; "v_from_eps" the eps columns read as v; "v_ignored" v = -1,
    the fixed posterior variance instead of the learned range."""
    if out_u is None:
        eps = out_c[:, :ch]
    elif mutated("cfg_sign"):
        eps = out_u[:, :ch] - float(cfg_scale) * (out_c[:, :ch] - out_u[:, :ch])
    else:
        eps = ops.cfg_combine(out_c, out_u, cfg_scale, ch)
    v = out_c[:, ch:2 * ch]
    if out_u is not None and mutated("v_cfg"):
        v = ops.cfg_combine(out_c[:, ch:], out_u[:, ch:], cfg_scale, ch)
    if out_u is not None and mutated("v_uncond"):
        v = out_u[:, ch:2 * ch]
    if mutated("v_from_eps"):
        v = eps
    if mutated("v_ignored"):
        v = -np.ones_like(v)
    return eps, v


def head_sample(W, z_rows, images, positions, seed, temperature, cfg_scale, tables=None):
    """DiffLoss.sample (section 6.5) with Philox noise, for n token rows.

    images, positions: [n] (image index and token position of each row).
    z_rows: [n, Dd] (no CFG) or [2n, Dd] (CFG: n conditional rows, then the
    n unconditional rows in the same order; cfg_scale is the guidance scale).
    Noise: initial x = token_normals(stream 1, step 0), not scaled by
    temperature; the noise of spaced step j (99..1) = token_normals(stream 2,
    step j). Under CFG only the n conditional state rows are kept; the
    network sees [x; x] with [c_cond; c_uncond]. Returns float64 [n, C]."""
    if tables is None:
        tables = diffusion_tables()
    images = np.asarray(images, dtype=np.int64).reshape(-1)
    positions = np.asarray(positions, dtype=np.int64).reshape(-1)
    z_rows = ops.f64(z_rows)
    n = len(positions)
    if z_rows.shape[0] == 2 * n and n > 0:
        cfg_on = True
    elif z_rows.shape[0] == n:
        cfg_on = False
    else:
        raise ValueError("z_rows must have n or 2n rows")
    ch = W[HEAD + "input_proj.weight"].shape[1]
    x = ops.f64(philox.token_normals(seed, images, positions, philox.STREAM_HEAD_INIT, 0, ch))
    for j in range(len(tables["timesteps"]) - 1, -1, -1):
        t = int(tables["timesteps"][j])          # the network sees tau_j, not j
        if cfg_on:
            out = head_net(W, np.concatenate([x, x]), t, z_rows)
            eps, v = guided_eps_v(out[:n], out[n:], cfg_scale, ch)
        else:
            eps, v = guided_eps_v(head_net(W, x, t, z_rows), None, cfg_scale, ch)
        noise = step_noise(seed, images, positions, j, ch)
        x = ops.ddpm_step(x, eps, v, noise, ddpm_coefs(tables, j, temperature))
    return x


# ==========================================================================
# AR loop (section 7)
# ==========================================================================

def mask_schedule(seq_len, num_iter):
    """Section 7.2 step 5 for every step: list of (m_before, mask_len, n_pred).

    r = cos(((pi / 2) * (k + 1)) / num_iter) in float64 (left to right),
    mask_len = max(1, min(m_before - 1, floor(seq_len * r))), n_pred =
    m_before - mask_len, or m_before at the last step."""
    out, m_before = [], seq_len
    for k in range(num_iter):
        r = np.cos(math.pi / 2.0 * (k + 1) / num_iter)
        mask_len = int(np.floor(seq_len * r))
        mask_len = max(1, min(m_before - 1, mask_len))
        n_pred = m_before if k == num_iter - 1 else m_before - mask_len
        out.append((m_before, mask_len, n_pred))
        m_before = mask_len
    return out


def cfg_schedule(cfg, kind, mask_len, seq_len):
    """Section 7.4: the CFG scale cfg_iter of a step, as a float32 value.

    "linear": 1 + (cfg - 1) * (seq_len - mask_len) / seq_len in float32,
    evaluated the way the reference's torch expression does: (cfg - 1) in
    Python double, rounded to float32 as a scalar operand, then each
    operation rounded to float32. "constant": f32(cfg). Else
    NotImplementedError. mask_len is the clamped post-step masked count."""
    f32 = np.float32
    if kind == "linear":
        known = f32(seq_len) - f32(mask_len)
        val = f32(f32(cfg - 1) * known)
        val = f32(val / f32(seq_len))
        return float(f32(f32(1) + val))
    if kind == "constant":
        return float(f32(cfg))
    raise NotImplementedError("cfg schedule %r" % (kind,))


_cfg_iter = cfg_schedule  # generate_tokens has a parameter of the same name


def generation_orders(seed, first_index, num_images, seq_len):
    """Section 7.1 with Philox: order of image i = philox.generation_order(
    seed, first_index + i, seq_len). int64 [num_images, seq_len]."""
    return np.stack([philox.generation_order(seed, first_index + i, seq_len)
                     for i in range(num_images)])


def generate_tokens(W, labels_or_None, num_images, steps, cfg, cfg_schedule, temperature,
                    seed, first_index, heads, tables=None):
    """MAR.sample_tokens (section 7.2) with Philox orders and noise.

    labels_or_None: [num_images] class labels, or None (unconditional:
    fake_latent in the conditional slot). cfg == 1.0 turns CFG off; else
    the batch is doubled (cond rows, then uncond rows with fake_latent) and
    the head is guided with cfg_iter = cfg_schedule(cfg, kind, mask_len, S).
    After a step leaving mask_len masked, image i's masked set is
    order_i[0:mask_len]; predicted positions are taken in ascending order;
    head rows are image-major, then position ascending.
    Returns (tokens float32 [num_images, S, C], log) with one dict per
    step: step, m_before, mask_len, n_pred, cfg_iter, encoder_len."""
    sz = model_sizes(W)
    S, C, P = sz["seq_len"], sz["token_channels"], sz["buffer"]
    B = int(num_images)
    if tables is None:
        tables = diffusion_tables()
    cfg_on = cfg != 1.0
    tokens = np.zeros((B, S, C), dtype=np.float32)   # section 7.1: fp32 token state
    mask = np.ones((B, S), dtype=bool)
    orders = generation_orders(seed, first_index, B, S)
    log = []
    for k, (m_before, mask_len, n_pred) in enumerate(mask_schedule(S, steps)):
        assert np.all(mask.sum(axis=1) == m_before)
        z = transformer(W, tokens, mask, labels_or_None, heads, cfg_on)        # steps 1-4
        mask_next = np.zeros_like(mask)                                          # step 6
        mask_next[np.arange(B)[:, None], orders[:, :mask_len]] = True
        pred = mask.copy() if k == steps - 1 else mask & ~mask_next             # step 7
        mask = mask_next                                                         # step 8
        rows_b, rows_pos = np.nonzero(pred)      # image-major, position ascending
        assert len(rows_b) == B * n_pred
        z_sel = z[rows_b, rows_pos]                                              # step 9
        if cfg_on:
            z_sel = np.concatenate([z_sel, z[B + rows_b, rows_pos]])
        cfg_iter = _cfg_iter(cfg, cfg_schedule, mask_len, S) if cfg_on else 1.0  # step 10
        if n_pred > 0:
            sampled = head_sample(W, z_sel, first_index + rows_b, rows_pos, seed, temperature,
                                  cfg_iter, tables)
            tokens[rows_b, rows_pos] = sampled.astype(np.float32)               # step 11
        log.append(dict(step=k, m_before=m_before, mask_len=mask_len, n_pred=n_pred,
                        cfg_iter=cfg_iter, encoder_len=P + S - m_before))
    return tokens, log

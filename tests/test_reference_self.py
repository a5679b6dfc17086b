"""Self-tests of the float64 NumPy reference (tests/reference) against the
numbers published in spec/mar.md (copied into tests/fixtures, each file naming its
section, so nothing is read from outside the repository) and the Random123 KAT vectors.
These tests do not touch the C engine."""
import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from reference import mar, ops, philox, vae  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


# --------------------------------------------------------------------------
# Philox
# --------------------------------------------------------------------------

@pytest.mark.parametrize("ctr,key,want", philox.KAT_VECTORS)
def test_philox_kat(ctr, key, want):
    got = tuple(int(w) for w in philox.philox4x32_10(*ctr, *key))
    assert got == want


def test_philox_kat_vectorised():
    ctr = np.array([v[0] for v in philox.KAT_VECTORS], dtype=np.uint64)
    key = np.array([v[1] for v in philox.KAT_VECTORS], dtype=np.uint64)
    out = philox.philox4x32_10(ctr[:, 0], ctr[:, 1], ctr[:, 2], ctr[:, 3], key[:, 0], key[:, 1])
    got = np.stack(out, axis=-1).tolist()
    assert got == [list(v[2]) for v in philox.KAT_VECTORS]
    assert philox.self_check()


def test_philox_block_counter_layout():
    seed = 0x0123456789ABCDEF
    got = philox.block(seed, 7, 2, 33, 5, 3)
    want = philox.philox4x32_10(3, 7, 33, (2 << 16) | 5, seed & 0xFFFFFFFF, seed >> 32)
    assert got.tolist() == [int(w) for w in want]


def test_token_normals_layout():
    seed, image, pos, stream, step = 42, 3, 17, 2, 9
    z = philox.token_normals(seed, [image], [pos], stream, step, 16)
    assert z.dtype == np.float32 and z.shape == (1, 16)
    for ch in range(16):
        w = philox.block(seed, image, stream, pos, step, ch // 4)
        pair = (w[0], w[1]) if ch % 4 < 2 else (w[2], w[3])
        u1 = (float(pair[0]) + 1.0) / 2.0 ** 32
        u2 = float(pair[1]) / 2.0 ** 32
        r = math.sqrt(-2.0 * math.log(u1))
        val = r * (math.cos(2 * math.pi * u2) if ch % 2 == 0 else math.sin(2 * math.pi * u2))
        assert z[0, ch] == np.float32(val)
    # A prefix of channels is the same draw; other rows are independent of batch.
    assert np.array_equal(philox.token_normals(seed, [image], [pos], stream, step, 6)[0], z[0, :6])
    zb = philox.token_normals(seed, [0, image, 5], [1, pos, 2], stream, step, 16)
    assert np.array_equal(zb[1], z[0])


def test_token_normals_statistics():
    z = philox.token_normals(1, np.zeros(20000), np.arange(20000), 1, 0, 16).astype(np.float64)
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1.0) < 0.01


def test_var_stream_uniforms_layout():
    """Streams 3 and 4 (philox.h): the sampling uniform is word 0 of block 0 over 2^32;
    the Gumbel uniform of entry j is (word j % 4 of block j // 4 + 0.5) / 2^32."""
    seed, image, pos, step = 0xFEDCBA9876543210, 11, 1234, 7
    u = philox.var_sample_uniforms(seed, [image, 0], [pos, 1], step)
    assert u[0] == float(philox.block(seed, image, 3, pos, step, 0)[0]) / 2.0 ** 32
    g = philox.var_gumbel_uniforms(seed, [image], [pos], step, 10)
    assert g.shape == (1, 10)
    for j in range(10):
        w = philox.block(seed, image, 4, pos, step, j // 4)[j % 4]
        assert g[0, j] == (float(w) + 0.5) / 2.0 ** 32
    assert 0.0 < g.min() and g.max() < 1.0


def test_var_sample_tokens_by_hand():
    """ops.sample_tokens on rows whose filters and draws are worked out by hand."""
    # top-k 2 with the 2nd largest tied: every 3 stays.
    _, masked = ops.sample_tokens([[3.0, 1.0, 3.0, 2.0, 3.0]], 2, 0.0, 1, 0, [0], [0])
    assert masked.tolist() == [[3.0, -np.inf, 3.0, -np.inf, 3.0]]
    # top-p 0.5 on equal logits: sums 1/4, 1/2, 3/4 in index order; <= 1/2 goes.
    _, masked = ops.sample_tokens([[0.0] * 4], 0, 0.5, 1, 0, [0], [0])
    assert masked.tolist() == [[-np.inf, -np.inf, 0.0, 0.0]]
    # top-p keeps the largest entry alone when top_p is tiny; top_p 1 and top_k >= vocab keep all.
    _, masked = ops.sample_tokens([[0.5, 2.0, 1.0]], 0, 1e-20, 1, 0, [0], [0])
    assert masked.tolist() == [[-np.inf, 2.0, -np.inf]]
    row = [[0.5, 2.0, 1.0]]
    assert ops.sample_tokens(row, 3, 1.0, 1, 0, [0], [0])[1].tolist() == row
    # the draw: u from stream 3, token = first running sum of exp(l - max) above u * total
    seed, image, pos, step = 5, 2, 9, 4
    u = float(philox.block(seed, image, 3, pos, step, 0)[0]) / 2.0 ** 32
    logits = np.array([[0.0, math.log(2.0), -np.inf, math.log(3.0)]], np.float32)
    weights = [math.exp(float(v) - float(logits.max())) if v != -np.inf else 0.0 for v in logits[0]]
    sums = np.cumsum(weights)
    want = int(np.argmax(sums > u * sums[-1]))
    tokens, _ = ops.sample_tokens(logits, 0, 0.0, seed, step, [image], [pos])
    assert tokens.tolist() == [want] and want != 2


def test_var_gumbel_softmax_by_hand():
    seed, image, pos, step, tau, scale = 3, 1, 40, 2, 0.5, 1.5
    logits = np.array([[0.25, -1.0, -np.inf, 2.0, 0.5]], np.float32)
    u = philox.var_gumbel_uniforms(seed, [image], [pos], step, 5)[0]
    z = [(float(l) * scale - math.log(-math.log(u[j]))) / tau for j, l in enumerate(logits[0])
         if l != -np.inf]
    e = np.exp(np.array(z) - max(z))
    want = np.insert(e / e.sum(), 2, 0.0)
    got = ops.gumbel_softmax(logits, scale, tau, seed, step, [image], [pos])
    assert got.shape == (1, 5) and got[0, 2] == 0.0
    np.testing.assert_allclose(got[0], want, rtol=1e-14, atol=0)


def test_generation_order_is_permutation():
    seen = set()
    for image in range(4):
        order = philox.generation_order(1, image, 256)
        assert sorted(order.tolist()) == list(range(256))
        seen.add(tuple(order.tolist()))
        words = philox.order_words(1, image, 256)
        keys = list(zip(words[order].tolist(), order.tolist()))
        assert keys == sorted(keys)
    assert len(seen) == 4
    big = philox.generation_order(99, 0, 1024)
    assert sorted(big.tolist()) == list(range(1024))


# --------------------------------------------------------------------------
# Diffusion tables (section 6, Appendix C)
# --------------------------------------------------------------------------

TAU_100 = [
    0, 10, 20, 30, 40, 50, 61, 71, 81, 91,
    101, 111, 121, 131, 141, 151, 161, 172, 182, 192,
    202, 212, 222, 232, 242, 252, 262, 272, 283, 293,
    303, 313, 323, 333, 343, 353, 363, 373, 383, 394,
    404, 414, 424, 434, 444, 454, 464, 474, 484, 494,
    505, 515, 525, 535, 545, 555, 565, 575, 585, 595,
    605, 616, 626, 636, 646, 656, 666, 676, 686, 696,
    706, 716, 727, 737, 747, 757, 767, 777, 787, 797,
    807, 817, 827, 838, 848, 858, 868, 878, 888, 898,
    908, 918, 928, 938, 949, 959, 969, 979, 989, 999,
]


def test_respacing_timesteps():
    assert mar.space_timesteps(1000, "100") == TAU_100
    t50 = mar.space_timesteps(1000, "50")
    assert t50[:8] == [0, 20, 41, 61, 82, 102, 122, 143] and t50[-3:] == [958, 979, 999]
    assert mar.space_timesteps(1000, "25") == [
        0, 42, 83, 125, 166, 208, 250, 291, 333, 375, 416, 458, 500, 541, 583, 624, 666,
        708, 749, 791, 832, 874, 916, 957, 999]
    assert mar.diffusion_tables()["timesteps"].tolist() == TAU_100


REFERENCE_VALUES = [  # (table, index, value) from the Appendix C table
    ("base_betas", 0, 4.128422482196914e-05), ("base_betas", 1, 4.614175273665033e-05),
    ("base_betas", 998, 0.7499993929011166), ("base_betas", 999, 0.999),
    ("base_alphas_cumprod", 0, 0.999958715775178),
    ("base_alphas_cumprod", 999, 2.4287669070348567e-09),
    ("betas", 0, 4.128422482196914e-05), ("betas", 1, 6.798400685055217e-04),
    ("betas", 2, 1.165515552917551e-03), ("betas", 97, 0.5553756193633552),
    ("betas", 98, 0.7499392803846628), ("betas", 99, 0.9999899991985922),
    ("posterior_variance", 0, 0.0), ("posterior_variance", 1, 3.8922225902180816e-05),
    ("posterior_variance", 2, 4.456790988565292e-04),
    ("posterior_log_variance_clipped", 0, -10.15394511055059),
    ("posterior_log_variance_clipped", 1, -10.15394511055059),
    ("log_betas", 0, -10.09503009653447), ("log_betas", 99, -1.0000851416131292e-05),
    ("posterior_mean_coef1", 0, 1.0), ("posterior_mean_coef2", 0, 0.0),
    ("posterior_mean_coef1", 99, 0.015583721365743979),
    ("posterior_mean_coef2", 99, 0.003161636366245914),
    ("sqrt_recip_alphas_cumprod", 0, 1.000020642751578),
    ("sqrt_recipm1_alphas_cumprod", 0, 0.006425412771141183),
    ("sqrt_recip_alphas_cumprod", 99, 20291.169634711496),
    ("sqrt_recipm1_alphas_cumprod", 99, 20291.169610070236),
]


@pytest.mark.parametrize("table,index,value", REFERENCE_VALUES)
def test_diffusion_reference_values(table, index, value):
    got = mar.diffusion_tables()[table][index]
    assert got == pytest.approx(value, rel=1e-13, abs=1e-300)


def test_diffusion_exact_endpoints():
    t = mar.diffusion_tables()
    assert t["posterior_mean_coef1"][0] == 1.0 and t["posterior_mean_coef2"][0] == 0.0
    assert t["posterior_variance"][0] == 0.0 and t["base_betas"][999] == 0.999
    assert all(len(v) == 100 for k, v in t.items() if not k.startswith("base_"))


# --------------------------------------------------------------------------
# Mask and CFG schedules (section 7.3, 7.4)
# --------------------------------------------------------------------------

NPRED_64 = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 3, 2, 2, 3, 3, 3, 3, 3, 3, 4, 3, 4, 4, 4, 4,
            4, 4, 4, 5, 5, 4, 5, 5, 5, 5, 5, 6, 5, 5, 6, 5, 6, 6, 6, 5, 6, 6, 6, 6, 6, 6, 7, 6, 6,
            6, 6, 7, 6, 6, 6]
MBEFORE_64 = [256, 255, 254, 253, 252, 251, 250, 249, 248, 247, 246, 245, 244, 243, 241, 238,
              236, 234, 231, 228, 225, 222, 219, 216, 212, 209, 205, 201, 197, 193, 189, 185,
              181, 176, 171, 167, 162, 157, 152, 147, 142, 136, 131, 126, 120, 115, 109, 103,
              97, 92, 86, 80, 74, 68, 62, 56, 49, 43, 37, 31, 25, 18, 12, 6]
NPRED_32 = [1, 1, 1, 2, 3, 4, 3, 5, 5, 6, 6, 7, 7, 8, 8, 8, 10, 9, 10, 10, 11, 11, 11, 12, 11,
            12, 12, 13, 12, 12, 13, 12]
MBEFORE_32 = [256, 255, 254, 253, 251, 248, 244, 241, 236, 231, 225, 219, 212, 205, 197, 189,
              181, 171, 162, 152, 142, 131, 120, 109, 97, 86, 74, 62, 49, 37, 25, 12]
NPRED_16 = [2, 3, 7, 8, 11, 13, 15, 16, 19, 20, 22, 23, 23, 25, 24, 25]


@pytest.mark.parametrize("steps,npred,mbefore", [
    (64, NPRED_64, MBEFORE_64), (32, NPRED_32, MBEFORE_32), (16, NPRED_16, None),
    (256, [1] * 256, list(range(256, 0, -1)))])
def test_mask_schedule_tables(steps, npred, mbefore):
    sched = mar.mask_schedule(256, steps)
    assert [s[2] for s in sched] == npred
    assert sum(s[2] for s in sched) == 256
    if mbefore is not None:
        assert [s[0] for s in sched] == mbefore
    for (mb, ml, npr), nxt in zip(sched, sched[1:]):
        assert nxt[0] == ml and npr == mb - ml and ml >= 1
    assert sched[-1][1] == 1 and sched[-1][2] == sched[-1][0]


def test_mask_schedule_edge_cases():
    assert mar.mask_schedule(256, 1) == [(256, 1, 256)]
    long = mar.mask_schedule(256, 300)
    assert sum(s[2] for s in long) == 256 and any(s[2] == 0 for s in long)
    assert sum(1 for s in mar.mask_schedule(256, 64) if s[2] == 1) == 13


@pytest.mark.parametrize("cfg", [2.9, 3.0, 3.2, 4.0])
def test_cfg_schedule_facts(cfg):
    rel = 1e-6
    sched64 = mar.mask_schedule(256, 64)
    first = mar.cfg_schedule(cfg, "linear", sched64[0][1], 256)
    last = mar.cfg_schedule(cfg, "linear", sched64[-1][1], 256)
    assert sched64[0][1] == 255
    assert first == pytest.approx(1 + (cfg - 1) / 256, rel=rel)
    assert last == pytest.approx(1 + (cfg - 1) * 255 / 256, rel=rel)
    assert last < cfg  # the nominal cfg is never reached
    for k, (_, ml, _) in enumerate(mar.mask_schedule(256, 256)):
        want = 1 + (cfg - 1) * min(k + 1, 255) / 256
        got = mar.cfg_schedule(cfg, "linear", ml, 256)
        assert got == pytest.approx(want, rel=rel)
        assert got == float(np.float32(got))
    assert mar.cfg_schedule(cfg, "constant", 17, 256) == float(np.float32(cfg))
    with pytest.raises(NotImplementedError):
        mar.cfg_schedule(cfg, "cosine", 17, 256)


# --------------------------------------------------------------------------
# Keys, shapes, parameter counts (sections 1.1, 4, 8.3, Appendices A/B)
# --------------------------------------------------------------------------

PARAMS = {  # total, diffloss.*, everything else (section 1.1)
    "mar_base": (364, 207924768, 35749920, 172174848),
    "mar_large": (476, 478326304, 72230432, 406095872),
    "mar_huge": (604, 942403104, 151206944, 791196160),
}


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_official_key_and_param_counts(name):
    shapes = mar.official_shapes(name)
    nkeys, total, head, rest = PARAMS[name]
    count = lambda keys: sum(int(np.prod(shapes[k])) for k in keys)  # noqa: E731
    assert len(shapes) == nkeys
    assert count(shapes) == total
    assert count([k for k in shapes if k.startswith("diffloss.")]) == head
    assert count([k for k in shapes if not k.startswith("diffloss.")]) == rest


def _key_list(name):
    """(key, shape) pairs of a key-list fixture: spec/mar.md Appendix A (mar_base_keys.txt)
    or Appendix B (kl16_decoder_keys.txt), copied verbatim; '#' lines are comments."""
    out = []
    with open(os.path.join(FIXTURES, name)) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            key, shape = line.split(" ", 1)
            out.append((key, tuple(int(v) for v in shape.strip().strip("[]").split(","))))
    return out


def test_appendix_a_and_b_key_lists():
    appendix_a, appendix_b = _key_list("mar_base_keys.txt"), _key_list("kl16_decoder_keys.txt")
    assert (len(appendix_a), len(appendix_b)) == (364, 166)
    assert list(mar.official_shapes("mar_base").items()) == appendix_a
    assert list(vae.vae_shapes().items()) == appendix_b


def test_vae_key_and_param_counts():
    shapes = vae.vae_shapes()
    assert len(shapes) == 166
    assert sum(int(np.prod(s)) for s in shapes.values()) == 38189203
    w = vae.random_vae_weights(np.random.default_rng(0), ch=32, ch_mult=(1, 2), num_res_blocks=1)
    assert vae.vae_config(w) == dict(ch=32, ch_mult=(1, 2), num_res_blocks=1, z=16, out_ch=3)
    del w["decoder.up.1.block.0.norm1.weight"]
    with pytest.raises(KeyError):
        vae.check_keys(w)


def test_random_mar_weights_structure():
    w = mar.random_mar_weights(np.random.default_rng(0), 48, 3, 4, 40, 2)
    assert list(w) == list(mar.mar_shapes(48, 3, 40, 2))
    assert all(v.dtype == np.float32 for v in w.values())
    assert mar.model_sizes(w) == dict(dim=48, seq_len=256, buffer=64, token_channels=16, depth=3,
                                      head_width=40, head_depth=2)


# --------------------------------------------------------------------------
# Ops
# --------------------------------------------------------------------------

def test_ops_dense():
    rng = np.random.default_rng(1)
    a, b, c = rng.normal(size=(5, 3)), rng.normal(size=(4, 3)), rng.normal(size=(5, 4))
    assert np.allclose(ops.gemm(a, b, trans_b=True, alpha=2.0, beta=0.5, c=c), 2 * a @ b.T + 0.5 * c)
    assert np.allclose(ops.gemm(a.T, b.T, trans_a=True), a @ b.T)
    x, w, bias = rng.normal(size=(6, 3)), rng.normal(size=(4, 3)), rng.normal(size=4)
    y = rng.normal(size=(6, 4))
    assert np.allclose(ops.linear(x, w, bias, beta=1.0, y=y), y + x @ w.T + bias)
    assert np.allclose(ops.linear(x, w, bias, act="silu"), (lambda h: h / (1 + np.exp(-h)))(x @ w.T + bias))
    assert ops.gelu(np.array([1.0]))[0] == pytest.approx(0.8413447460685429, rel=1e-15)
    ln = ops.layernorm(x, eps=0.0)
    assert np.allclose(ln.mean(-1), 0) and np.allclose(ln.var(-1), 1)
    sh, sc = rng.normal(size=(6, 3)), rng.normal(size=(6, 3))
    assert np.allclose(ops.layernorm(x, eps=0.0, shift=sh, scale=sc), ln * (1 + sc) + sh)
    assert np.allclose(ops.add_rows(y, y[:2], 2), y + y[np.arange(6) % 2])
    assert np.allclose(ops.gated_add(y, x @ w.T, bias), y + bias * (x @ w.T))
    idx = np.array([4, 0, 2])
    assert np.array_equal(ops.gather_rows(y, idx), y[idx])
    assert np.array_equal(ops.scatter_rows(np.zeros((6, 4)), idx, y[:3])[idx], y[:3])


def test_ops_attention_segments():
    rng = np.random.default_rng(2)
    heads, hd = 3, 4
    q = rng.normal(size=(2, 5, heads * hd))
    k1, v1 = rng.normal(size=(2, 7, heads * hd)), rng.normal(size=(2, 7, heads * hd))
    k2, v2 = rng.normal(size=(2, 3, heads * hd)), rng.normal(size=(2, 3, heads * hd))
    out = ops.attention(q, [(k1, v1), (k2[:, :0], v2[:, :0]), (k2, v2)], heads)
    k, v = np.concatenate([k1, k2], 1), np.concatenate([v1, v2], 1)
    for bi in range(2):
        for h in range(heads):
            cs = slice(h * hd, (h + 1) * hd)
            s = q[bi, :, cs] @ k[bi, :, cs].T / math.sqrt(hd)
            p = np.exp(s) / np.exp(s).sum(1, keepdims=True)
            assert np.allclose(out[bi, :, cs], p @ v[bi, :, cs])


def test_ops_groupnorm_conv_upsample():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 3, 4, 8))
    w, b = rng.normal(size=8), rng.normal(size=8)
    y = ops.groupnorm(x, 4, w, b, eps=1e-6)
    for n in range(2):
        for g in range(4):
            seg = x[n, :, :, 2 * g:2 * g + 2]
            ref = (seg - seg.mean()) / np.sqrt(seg.var() + 1e-6) * w[2 * g:2 * g + 2] + b[2 * g:2 * g + 2]
            assert np.allclose(y[n, :, :, 2 * g:2 * g + 2], ref)
    assert np.allclose(ops.groupnorm(x, 4, w, b, swish=True), ops.silu(y))
    cw, cb = rng.normal(size=(5, 8, 3, 3)), rng.normal(size=5)
    out = ops.conv2d(x, cw, cb)
    xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    i, j = 2, 0
    assert np.allclose(out[1, i, j], np.einsum("yxc,ocyx->o", xp[1, i:i + 3, j:j + 3], cw) + cb)
    assert np.allclose(ops.conv2d(x, cw[:, :, 1:2, 1:2], None, beta=1.0, y=out), out + x @ cw[:, :, 1, 1].T)
    up = ops.upsample_nearest2x(x)
    assert up.shape == (2, 6, 8, 8) and np.array_equal(up[:, 5, 7], x[:, 2, 3])
    assert ops.conv_weight_to_packed(cw).shape == (5, 3, 3, 8)


def test_ops_ddpm_last_step_returns_x0():
    rng = np.random.default_rng(4)
    x, e, v = rng.normal(size=(3, 16)), rng.normal(size=(3, 16)), rng.normal(size=(3, 16))
    co = mar.ddpm_coefs(mar.diffusion_tables(), 0, 1.0)
    assert co["noise_scale"] == 0.0
    x0 = co["sqrt_recip_alphas_cumprod"] * x - co["sqrt_recipm1_alphas_cumprod"] * e
    assert np.array_equal(ops.ddpm_step(x, e, v, None, co), x0)
    co = mar.ddpm_coefs(mar.diffusion_tables(), 50, 0.5)
    noise = rng.normal(size=(3, 16))
    got = ops.ddpm_step(x, e, v, noise, co)
    f = (v + 1) / 2
    mu = co["posterior_mean_coef1"] * (co["sqrt_recip_alphas_cumprod"] * x
                                       - co["sqrt_recipm1_alphas_cumprod"] * e) + co["posterior_mean_coef2"] * x
    sd = np.exp(0.5 * (f * co["log_beta"] + (1 - f) * co["posterior_log_variance"]))
    assert np.allclose(got, mu + 0.5 * sd * noise)
    assert ops.cfg_combine(np.ones((2, 4)), np.zeros((2, 4)), 3.0, 2).tolist() == [[3.0, 3.0]] * 2


# --------------------------------------------------------------------------
# Model pieces and end-to-end
# --------------------------------------------------------------------------

TINY = dict(dim=32, depth=2, heads_unused=2, head_width=32, head_depth=2)


@pytest.fixture(scope="module")
def tiny_weights():
    return mar.random_mar_weights(np.random.default_rng(0), **TINY)


def test_timestep_embedding_cos_first():
    emb = mar.timestep_embedding(np.array([0, 999]))
    assert emb.shape == (2, 256)
    assert np.all(emb[0, :128] == 1.0) and np.all(emb[0, 128:] == 0.0)
    exact = mar.timestep_embedding(999, fp32=False)
    assert exact[0] == pytest.approx(math.cos(999), abs=1e-15)
    assert exact[128] == pytest.approx(math.sin(999), abs=1e-15)
    assert np.allclose(emb[1], exact, atol=1e-3)


def test_masked_tokens_do_not_matter(tiny_weights):
    rng = np.random.default_rng(5)
    tokens = rng.normal(size=(2, 256, 16)).astype(np.float32)
    mask = np.ones((2, 256), dtype=bool)
    mask[:, rng.permutation(256)[:40]] = False
    mask[1] = mask[0]
    z1 = mar.transformer(tiny_weights, tokens, mask, [1, 2], 2, cfg_on=True)
    tokens2 = tokens.copy()
    tokens2[mask] = 123.0
    z2 = mar.transformer(tiny_weights, tokens2, mask, [1, 2], 2, cfg_on=True)
    assert z1.shape == (4, 256, 32) and np.allclose(z1, z2, rtol=0, atol=1e-12)
    e = mar.encoder(tiny_weights, tokens, mask, np.zeros((2, 32)), 2)
    assert e.shape == (2, 64 + 40, 32)
    zu = mar.transformer(tiny_weights, tokens, mask, None, 2, cfg_on=False)
    assert np.allclose(zu, z1[2:], atol=1e-12)  # uncond half == unconditional run


def test_head_cfg_scale_one_equals_plain(tiny_weights):
    rng = np.random.default_rng(6)
    z = rng.normal(size=(3, 32))
    zu = rng.normal(size=(3, 32))
    x = rng.normal(size=(3, 16))
    out = mar.head_net_cfg(tiny_weights, np.concatenate([x, 99 + x]), 500, np.concatenate([z, zu]), 2.0)
    plain_c = mar.head_net(tiny_weights, x, 500, z)
    plain_u = mar.head_net(tiny_weights, x, 500, zu)
    guided = plain_u[:, :16] + 2.0 * (plain_c[:, :16] - plain_u[:, :16])
    assert np.allclose(out[:3, :16], guided) and np.allclose(out[3:, :16], guided)
    assert np.allclose(out[:3, 16:], plain_c[:, 16:]) and np.allclose(out[3:, 16:], plain_u[:, 16:])
    tables = mar.diffusion_tables()
    a = mar.head_sample(tiny_weights, z, [0, 0, 1], [3, 9, 3], 11, 1.0, 1.0, tables)
    b = mar.head_sample(tiny_weights, np.concatenate([z, zu]), [0, 0, 1], [3, 9, 3], 11, 1.0, 1.0, tables)
    assert np.all(np.isfinite(a)) and np.allclose(a, b, rtol=1e-9)


@pytest.mark.parametrize("cfg,labels", [(1.0, [3, 7]), (3.0, [3, 7]), (2.0, None)])
def test_generate_tokens_tiny(tiny_weights, cfg, labels):
    tokens, log = mar.generate_tokens(tiny_weights, labels, 2, 4, cfg, "linear", 1.0, 123, 10, 2)
    assert tokens.shape == (2, 256, 16) and tokens.dtype == np.float32
    assert np.all(np.isfinite(tokens)) and np.all(tokens != 0)
    assert [e["n_pred"] for e in log] == [s[2] for s in mar.mask_schedule(256, 4)]
    assert [e["encoder_len"] for e in log] == [64 + 256 - s[0] for s in mar.mask_schedule(256, 4)]
    if cfg == 1.0:
        assert all(e["cfg_iter"] == 1.0 for e in log)
    else:
        assert [e["cfg_iter"] for e in log] == [
            mar.cfg_schedule(cfg, "linear", s[1], 256) for s in mar.mask_schedule(256, 4)]


def test_generate_tokens_first_token_batch_independent(tiny_weights):
    """Image i of a batch starting at first_index f is image f + i: its first
    AR step (no known tokens) does not depend on the rest of the batch."""
    full, _ = mar.generate_tokens(tiny_weights, [3, 7], 2, 4, 1.0, "linear", 1.0, 5, 0, 2)
    one, _ = mar.generate_tokens(tiny_weights, [7], 1, 4, 1.0, "linear", 1.0, 5, 1, 2)
    assert np.allclose(full[1], one[0], rtol=1e-6, atol=1e-6 * np.abs(one).max())


def test_vae_decode_and_uint8():
    rng = np.random.default_rng(7)
    w = vae.random_vae_weights(rng, ch=32, ch_mult=(1, 2), num_res_blocks=1)
    img = vae.decode(w, rng.normal(size=(2, 16, 16)) * 0.2325)
    assert img.shape == (2, 8, 8, 3) and np.all(np.isfinite(img))
    lat = rng.normal(size=(1, 4, 4, 16))
    assert np.array_equal(vae.unpatchify(lat.reshape(1, 16, 16)), lat)
    # 0.0 -> 127.5 exactly: half-to-even gives 128; -0.5 -> 63.75 -> 64.
    x = np.array([-2.0, -1.0, 1.0 / 255 - 1, -0.5, 0.0, 1.0, 5.0])
    assert vae.to_uint8(x).tolist() == [0, 0, 0, 64, 128, 255, 255]

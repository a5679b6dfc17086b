"""Trains the digits demo models that ship inside marcache (development tool).

    python tools/train_digits.py all --out marcache/data

writes three files into --out (and `var` two more, see below):

  digits.safetensors             the scikit-learn digits (UCI optdigits test set,
                                 1,797 images 8x8, CC BY 4.0) as 16x16 images with
                                 values 0..255, labels, and the train / held-out split
  digits_mar.safetensors         a small MAR of the official architecture family in
                                 the official key layout, trained on the train split
  digits_classifier.safetensors  an MLP classifier of the 16x16 digits (class fidelity;
                                 its 64-d penultimate features give the digits-FID)

Needs PyTorch (CPU build: pip install torch==2.13.0) and scikit-learn. Neither is a
runtime or test dependency of marcache: the package only reads the files written here.

Determinism: every random draw comes from generators seeded by --seed and
torch.use_deterministic_algorithms is on, so a rerun with the same PyTorch version and
--threads should write the same bytes (not checked bitwise: phase 1 takes 45 minutes on
two cores). Settings are recorded in each file's __metadata__. The shipped files were
made with torch 2.13.0+cpu, --threads 2, --seed 0: `all` (data, classifier in 10 s,
phase 1 in 45 min), then phase 2 by `mar --resume <phase-1 file>` (8 min).

The MAR follows the official training recipe (spec mar.md 1.3, LTH14/mar): tokens are
2x2 pixel patches of the 16x16 image scaled to [-1, 1] (an identity "VAE"); per batch a
mask ratio from the truncated normal on [0.7, 1] (mean 1, std 0.25), the class
embedding replaced by fake_latent with probability 0.1 (which makes CFG possible), MAE
encoder on buffer + visible tokens, decoder on all rows, and the diffusion loss on the
masked tokens repeated 4 times: 1000-step cosine schedule, eps prediction + learned-range
variance, loss = MSE(eps) + the variational bound term with the mean frozen
(IDDPM's hybrid loss, as the official GaussianDiffusion computes it). AdamW with
betas (0.9, 0.95) and weight decay 0.02, EMA of the weights; the EMA weights ship.
Phase 2 fine-tunes the diffusion head alone with extra weight on the largest timesteps
(see finetune_head for why).

The VAR (`var`, issue 15) reads the shipped digits.safetensors (its train split) and
digits_classifier.safetensors from --out and writes two more files there:

  digits_vqvae.safetensors       a multi-scale VQ tokenizer in the official VQVAE layout
                                 (FoundationVision/VAR vqvae.py): ch 32, ch_mult (1, 2),
                                 1 res block, z 16, vocab 256, 4 Phi convs (quant_resi 0.5),
                                 16x16 image <-> 8x8 latent; decoding tensors only
  digits_var.safetensors         a class-conditional VAR in the official layout (var.py):
                                 depth 6, width 128, 2 heads, attn_l2_norm, 10 classes + null,
                                 patch_nums (1, 2, 3, 4, 6, 8) = 130 tokens

    MARCACHE_PYTHON=/path/to/python-with-built-marcache \
        nice python tools/train_digits.py var --out marcache/data --threads 1 --seed 0

The VQVAE trains on the digits as 3 equal RGB channels in [-1, 1]: MSE reconstruction plus
VectorQuantizer2's VQ loss over the scales (area-down / bicubic-up / Phi chain, beta 0.25,
straight-through), dead codes restarted during the first 3/4 (the official VQVAE training
code is not released). The VAR trains by teacher forcing as VARTrainer does:
idxBl_to_var_input of the frozen VQVAE's tokens, block-causal mask, labels dropped to the
null class with probability 0.1, cross-entropy on all 130 tokens, AdamW (0.9, 0.95) with the
official no-decay groups, weight decay 0.05, grad clip 2, the lin0 schedule, the official
initialisation, peak lr 1e-3 (the official 1e-4 x batch/256 is for 200+ ImageNet epochs).
Both state dicts are saved as official-layout .pth (buffers included) and converted by
`python -m marcache convert vqvae|var --dtype fp16`, which checks every key and shape; the
shipped files are the converter's tensors and metadata plus patch_nums and the settings.
The trainer then loads the fp16 weights back, samples 500 digits (50 per class) with its
PyTorch port of autoregressive_infer_cfg (KV cache, guidance t = cfg * si / (n - 1)) and
scores them with the shipped classifier (metadata 'evaluation'): class accuracy 100.0% at
cfg 1.0, 1.5 and 3.0, digits-FID 11.3 / 14.2 / 21.0 (the 297 held-out real digits: 6.3).
The VQVAE's held-out reconstructions: 99.3% class accuracy, digits-FID 6.35. A check run
outside the repository loaded the .pth files into the official VQVAE / VAR modules
(strict=True): same tokens and teacher-forcing inputs, logits within 2.5e-5 (of 42), equal
images from autoregressive_infer_cfg with the same seed.
Timing of the shipped files (torch 2.13.0+cpu, --threads 1, --seed 0, 2 cores shared with
other jobs, load average 3-5): VQVAE 600 iterations of 32 in 233 s, VAR 1200 iterations of
32 in 1442 s, sampling 3 x 500 digits in 70 s; 1758 s (29 min) wall in all.
"""
import argparse
import json
import math
import os
import time

import numpy as np

SIZE = 16          # image side after 2x upsampling
PATCH = 2          # pixels per token side: tokens of C = 4 values
SEQ = (SIZE // PATCH) ** 2
HELD_OUT = 297     # images kept out of training (FID reference and classifier test)
FREQ_DIM = 256


def load_digits_16():
    """sklearn digits -> uint8 [N, 16, 16] (bilinear 2x upsampling of the 0..16 values,
    scaled to 0..255), labels [N], and a seeded train / held-out split."""
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float64)[:, None] / 16.0
    x = F.interpolate(x, size=(SIZE, SIZE), mode="bilinear", align_corners=False)[:, 0]
    images = np.clip(np.rint(x.numpy() * 255.0), 0, 255).astype(np.uint8)
    labels = d.target.astype(np.int32)
    order = np.random.default_rng(20261122).permutation(len(labels))
    held_out = np.sort(order[:HELD_OUT]).astype(np.int32)
    train = np.sort(order[HELD_OUT:]).astype(np.int32)
    return images, labels, train, held_out


def to_tokens(images_u8):
    """uint8 [N, 16, 16] -> tokens [N, 64, 4] in [-1, 1] (MAR's patchify with c = 1:
    token = 2x2 patch, feature index = row-in-patch * 2 + column-in-patch)."""
    x = images_u8.astype(np.float32) / 127.5 - 1.0
    n = x.shape[0]
    g = SIZE // PATCH
    x = x.reshape(n, g, PATCH, g, PATCH).transpose(0, 1, 3, 2, 4)
    return x.reshape(n, g * g, PATCH * PATCH)


# --------------------------------------------------------------------------- MAR


def build_mar(cfg):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    D, C, P, S = cfg["width"], PATCH * PATCH, cfg["buffer"], SEQ

    class Attention(nn.Module):
        def __init__(self, dim, heads, drop):
            super().__init__()
            self.heads = heads
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)
            self.drop = drop

        def forward(self, x):
            b, n, d = x.shape
            q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=self.drop if self.training else 0.0)
            return F.dropout(self.proj(o.transpose(1, 2).reshape(b, n, d)), self.drop, self.training)

    class Mlp(nn.Module):
        def __init__(self, dim, drop):
            super().__init__()
            self.fc1 = nn.Linear(dim, 4 * dim)
            self.fc2 = nn.Linear(4 * dim, dim)
            self.drop = drop

        def forward(self, x):
            x = F.dropout(F.gelu(self.fc1(x)), self.drop, self.training)
            return F.dropout(self.fc2(x), self.drop, self.training)

    class Block(nn.Module):
        """timm Block as MAR uses it: pre-norm, LayerNorm eps 1e-6, exact GELU."""

        def __init__(self, dim, heads, drop):
            super().__init__()
            self.norm1 = nn.LayerNorm(dim, eps=1e-6)
            self.attn = Attention(dim, heads, drop)
            self.norm2 = nn.LayerNorm(dim, eps=1e-6)
            self.mlp = Mlp(dim, drop)

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class ResBlock(nn.Module):
        def __init__(self, w):
            super().__init__()
            self.in_ln = nn.LayerNorm(w, eps=1e-6)
            self.mlp = nn.Sequential(nn.Linear(w, w), nn.SiLU(), nn.Linear(w, w))
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(w, 3 * w))

        def forward(self, h, y):
            shift, scale, gate = self.adaLN_modulation(y).chunk(3, dim=-1)
            u = self.in_ln(h) * (1 + scale) + shift
            return h + gate * self.mlp(u)

    class FinalLayer(nn.Module):
        def __init__(self, w, out):
            super().__init__()
            self.norm_final = nn.LayerNorm(w, elementwise_affine=False, eps=1e-6)
            self.linear = nn.Linear(w, out)
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(w, 2 * w))

        def forward(self, h, y):
            shift, scale = self.adaLN_modulation(y).chunk(2, dim=-1)
            return self.linear(self.norm_final(h) * (1 + scale) + shift)

    class TimeEmbed(nn.Module):
        def __init__(self, w):
            super().__init__()
            self.mlp = nn.Sequential(nn.Linear(FREQ_DIM, w), nn.SiLU(), nn.Linear(w, w))

        def forward(self, t):
            half = FREQ_DIM // 2
            freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
            a = t[:, None].float() * freqs[None]
            return self.mlp(torch.cat([torch.cos(a), torch.sin(a)], dim=-1))

    class SimpleMLPAdaLN(nn.Module):
        def __init__(self, c, w, depth, zc):
            super().__init__()
            self.time_embed = TimeEmbed(w)
            self.cond_embed = nn.Linear(zc, w)
            self.input_proj = nn.Linear(c, w)
            self.res_blocks = nn.ModuleList([ResBlock(w) for _ in range(depth)])
            self.final_layer = FinalLayer(w, 2 * c)

        def forward(self, x, t, c):
            y = self.time_embed(t) + self.cond_embed(c)
            h = self.input_proj(x)
            for blk in self.res_blocks:
                h = blk(h, y)
            return self.final_layer(h, y)

    class DiffLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = SimpleMLPAdaLN(C, cfg["head_width"], cfg["head_depth"], D)

    class MAR(nn.Module):
        def __init__(self):
            super().__init__()
            drop = cfg["dropout"]
            self.class_emb = nn.Embedding(cfg["num_classes"], D)
            self.fake_latent = nn.Parameter(torch.zeros(1, D))
            self.z_proj = nn.Linear(C, D)
            self.z_proj_ln = nn.LayerNorm(D, eps=1e-6)
            self.encoder_pos_embed_learned = nn.Parameter(torch.zeros(1, P + S, D))
            self.encoder_blocks = nn.ModuleList([Block(D, cfg["heads"], drop) for _ in range(cfg["depth"])])
            self.encoder_norm = nn.LayerNorm(D, eps=1e-6)
            self.decoder_embed = nn.Linear(D, D)
            self.mask_token = nn.Parameter(torch.zeros(1, 1, D))
            self.decoder_pos_embed_learned = nn.Parameter(torch.zeros(1, P + S, D))
            self.decoder_blocks = nn.ModuleList([Block(D, cfg["heads"], drop)
                                                 for _ in range(cfg["decoder_depth"])])
            self.decoder_norm = nn.LayerNorm(D, eps=1e-6)
            self.diffusion_pos_embed_learned = nn.Parameter(torch.zeros(1, S, D))
            self.diffloss = DiffLoss()
            self._init()

        def _init(self):
            for p in (self.class_emb.weight, self.fake_latent, self.mask_token, self.encoder_pos_embed_learned,
                      self.decoder_pos_embed_learned, self.diffusion_pos_embed_learned):
                nn.init.normal_(p, std=0.02)
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    nn.init.xavier_uniform_(m.weight)
                    nn.init.zeros_(m.bias)
            net = self.diffloss.net
            for m in net.time_embed.mlp:
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=0.02)
            for blk in net.res_blocks:
                nn.init.zeros_(blk.adaLN_modulation[-1].weight)
                nn.init.zeros_(blk.adaLN_modulation[-1].bias)
            for m in (net.final_layer.adaLN_modulation[-1], net.final_layer.linear):
                nn.init.zeros_(m.weight)
                nn.init.zeros_(m.bias)

        def forward(self, tokens, labels, num_masked, gen):
            """Encoder + decoder with a random order per image; returns the condition
            vectors and targets of the masked tokens."""
            b = tokens.shape[0]
            order = torch.argsort(torch.rand(b, S, generator=gen), dim=1)
            mask = torch.zeros(b, S, dtype=torch.bool)
            mask.scatter_(1, order[:, :num_masked], True)

            cls = self.class_emb(labels)
            drop = (torch.rand(b, generator=gen) < cfg["label_drop"]).float()[:, None]
            cls = drop * self.fake_latent + (1 - drop) * cls
            x = torch.cat([cls[:, None].expand(b, P, D), self.z_proj(tokens)], dim=1)
            x = self.z_proj_ln(x + self.encoder_pos_embed_learned)
            keep = torch.cat([torch.ones(b, P, dtype=torch.bool), ~mask], dim=1)
            x = x[keep].reshape(b, -1, D)          # buffer + visible rows, in position order
            for blk in self.encoder_blocks:
                x = blk(x)
            x = self.decoder_embed(self.encoder_norm(x))
            full = self.mask_token.expand(b, P + S, D).clone()
            full[keep] = x.reshape(-1, D)
            x = full + self.decoder_pos_embed_learned
            for blk in self.decoder_blocks:
                x = blk(x)
            z = self.decoder_norm(x)[:, P:] + self.diffusion_pos_embed_learned
            return z[mask], tokens[mask]

    return MAR()


class Diffusion:
    """The 1000-step cosine schedule of IDDPM/DiT (spec mar.md 6.1), float64 tables."""

    def __init__(self, steps=1000):
        abar = lambda s: math.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2  # noqa: E731
        betas = np.array([min(1 - abar((i + 1) / steps) / abar(i / steps), 0.999) for i in range(steps)])
        ac = np.cumprod(1.0 - betas)
        ac_prev = np.append(1.0, ac[:-1])
        self.steps = steps
        self.sqrt_ac = np.sqrt(ac)
        self.sqrt_1mac = np.sqrt(1 - ac)
        self.sqrt_recip_ac = np.sqrt(1 / ac)
        self.sqrt_recipm1_ac = np.sqrt(1 / ac - 1)
        post_var = betas * (1 - ac_prev) / (1 - ac)
        self.post_logvar = np.log(np.append(post_var[1], post_var[1:]))
        self.coef1 = betas * np.sqrt(ac_prev) / (1 - ac)
        self.coef2 = (1 - ac_prev) * np.sqrt(1 - betas) / (1 - ac)
        self.log_betas = np.log(betas)

    def take(self, table, t):
        import torch

        return torch.from_numpy(table).float()[t][:, None]

    def loss(self, net, x0, t, c, noise):
        """MSE on eps plus the variational bound with the predicted mean frozen
        (GaussianDiffusion.training_losses, loss type MSE, LEARNED_RANGE)."""
        import torch

        x_t = self.take(self.sqrt_ac, t) * x0 + self.take(self.sqrt_1mac, t) * noise
        out = net(x_t, t, c)
        ch = x0.shape[1]
        eps, v = out[:, :ch], out[:, ch:]
        mse = ((noise - eps) ** 2).mean(dim=1)

        true_mean = self.take(self.coef1, t) * x0 + self.take(self.coef2, t) * x_t
        true_logvar = self.take(self.post_logvar, t)
        x0_pred = self.take(self.sqrt_recip_ac, t) * x_t - self.take(self.sqrt_recipm1_ac, t) * eps.detach()
        mean = self.take(self.coef1, t) * x0_pred + self.take(self.coef2, t) * x_t
        frac = (v + 1) / 2
        logvar = frac * self.take(self.log_betas, t) + (1 - frac) * self.take(self.post_logvar, t)
        kl = 0.5 * (-1.0 + logvar - true_logvar + torch.exp(true_logvar - logvar)
                    + (true_mean - mean) ** 2 * torch.exp(-logvar))
        kl = kl.mean(dim=1) / math.log(2.0)
        nll = -discretized_gaussian_log_likelihood(x0, mean, 0.5 * logvar).mean(dim=1) / math.log(2.0)
        vb = torch.where(t == 0, nll, kl)
        return mse + vb


def discretized_gaussian_log_likelihood(x, means, log_scales):
    import torch

    def cdf(u):
        return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (u + 0.044715 * u ** 3)))

    centered = x - means
    inv_std = torch.exp(-log_scales)
    cdf_plus = cdf(inv_std * (centered + 1.0 / 255.0))
    cdf_min = cdf(inv_std * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_delta))


def truncnorm_ratio(gen):
    """One draw of scipy.stats.truncnorm((0.7 - 1) / 0.25, 0, loc=1, scale=0.25) by
    inverse CDF (the official mask_ratio_generator)."""
    import torch

    lo = 0.5 * (1 + math.erf((0.7 - 1.0) / 0.25 / math.sqrt(2)))
    hi = 0.5
    u = lo + (hi - lo) * torch.rand(1, generator=gen, dtype=torch.float64).item()
    return 1.0 + 0.25 * math.sqrt(2) * torch.erfinv(torch.tensor(2 * u - 1, dtype=torch.float64)).item()


MAR_DEFAULTS = dict(width=96, heads=3, depth=3, decoder_depth=6, buffer=16, head_width=128, head_depth=3,
                    num_classes=10, dropout=0.1, label_drop=0.1, diffusion_batch_mul=4, batch=64, iters=2500,
                    lr=1e-3, warmup=200, weight_decay=0.02, ema=0.999)


def _optimizer_step(opt, loss, module, ema, ema_target, it):
    """One step of `opt` on `loss` (gradients clipped to norm 3), then the EMA of
    `module`'s floating-point state in `ema` with the usual warm-up: decay
    (1 + it) / (10 + it) until it reaches `ema_target`, so that a short run does not
    ship weights still weighted to the init."""
    import torch

    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 3.0)
    opt.step()
    decay_now = min(ema_target, (1 + it) / (10 + it))
    with torch.no_grad():
        for k, v in module.state_dict().items():
            if v.dtype.is_floating_point:
                ema[k].mul_(decay_now).add_(v, alpha=1 - decay_now)


def train_mar(tokens, labels, cfg, seed, log_every=100):
    import torch

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = build_mar(cfg)
    diffusion = Diffusion()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "pos_embed" in name or name in ("fake_latent", "mask_token") else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg["lr"], betas=(0.9, 0.95))
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x_all = torch.from_numpy(tokens)
    y_all = torch.from_numpy(labels.astype(np.int64))
    n = x_all.shape[0]
    t0 = time.time()
    running = 0.0
    for it in range(cfg["iters"]):
        lr = cfg["lr"] * min(1.0, (it + 1) / cfg["warmup"])
        lr *= 0.5 * (1 + math.cos(math.pi * max(0, it - cfg["warmup"]) / max(1, cfg["iters"] - cfg["warmup"])))
        lr = max(lr, 0.05 * cfg["lr"]) if it >= cfg["warmup"] else lr
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, n, (cfg["batch"],), generator=gen)
        num_masked = int(math.ceil(SEQ * truncnorm_ratio(gen)))
        model.train()
        z, target = model(x_all[idx], y_all[idx], num_masked, gen)
        mul = cfg["diffusion_batch_mul"]
        z, target = z.repeat(mul, 1), target.repeat(mul, 1)
        t = torch.randint(0, diffusion.steps, (z.shape[0],), generator=gen)
        noise = torch.randn(target.shape, generator=gen)
        loss = diffusion.loss(model.diffloss.net, target, t, z, noise).mean()
        _optimizer_step(opt, loss, model, ema, cfg["ema"], it)
        running += loss.item()
        if (it + 1) % log_every == 0:
            print(f"mar iter {it + 1}/{cfg['iters']} loss {running / log_every:.4f} lr {lr:.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)
            running = 0.0
    return {k: v.numpy() for k, v in ema.items()}


HEAD_DEFAULTS = dict(iters=1500, batch=64, lr=2e-4, p_last=0.25, p_high=0.25, high_from=900, ema=0.999)


def finetune_head(state, tokens, labels, cfg, hcfg, seed, log_every=100):
    """Phase 2 (not in the official recipe): the diffusion head alone, on condition vectors
    of the frozen transformer in eval mode (the vectors it sees at generation), with extra
    weight on the largest timesteps. Why: the cosine schedule clips the last beta at 0.999,
    so the first sampling step (t = 999) multiplies the head's eps error by about 350 in the
    posterior mean (sqrt(abar_989 / abar_999)). The official heads (width 1024-1536, 800
    epochs of ImageNet) predict eps there almost exactly; a 3 x 128 head trained for minutes
    does not, and its samples leave [-1, 1] by orders of magnitude. A quarter of the rows
    train at t = 999 and a quarter at t in [900, 999); the rest as in phase 1."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    model = build_mar(cfg)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    model.eval()
    net = model.diffloss.net
    for p in model.parameters():
        p.requires_grad_(False)
    for p in net.parameters():
        p.requires_grad_(True)
    diffusion = Diffusion()
    opt = torch.optim.AdamW(net.parameters(), lr=hcfg["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    ema = {k: v.detach().clone() for k, v in net.state_dict().items()}
    x_all = torch.from_numpy(tokens)
    y_all = torch.from_numpy(labels.astype(np.int64))
    t0, running = time.time(), 0.0
    for it in range(hcfg["iters"]):
        for g in opt.param_groups:
            g["lr"] = hcfg["lr"] * 0.5 * (1 + math.cos(math.pi * it / hcfg["iters"]))
        idx = torch.randint(0, x_all.shape[0], (hcfg["batch"],), generator=gen)
        num_masked = int(math.ceil(SEQ * truncnorm_ratio(gen)))
        with torch.no_grad():
            z, target = model(x_all[idx], y_all[idx], num_masked, gen)
        mul = cfg["diffusion_batch_mul"]
        z, target = z.repeat(mul, 1), target.repeat(mul, 1)
        n = z.shape[0]
        t = torch.randint(0, diffusion.steps, (n,), generator=gen)
        u = torch.rand(n, generator=gen)
        high = torch.randint(hcfg["high_from"], diffusion.steps - 1, (n,), generator=gen)
        t = torch.where(u < hcfg["p_last"], torch.full_like(t, diffusion.steps - 1),
                        torch.where(u < hcfg["p_last"] + hcfg["p_high"], high, t))
        noise = torch.randn(target.shape, generator=gen)
        net.train()
        loss = diffusion.loss(net, target, t, z, noise).mean()
        _optimizer_step(opt, loss, net, ema, hcfg["ema"], it)
        running += loss.item()
        if (it + 1) % log_every == 0:
            print(f"head iter {it + 1}/{hcfg['iters']} loss {running / log_every:.4f} {time.time() - t0:.0f}s",
                  flush=True)
            running = 0.0
    out = dict(state)
    for k, v in ema.items():
        out["diffloss.net." + k] = v.numpy()
    return out


# --------------------------------------------------------------------------- classifier

CLS_DEFAULTS = dict(hidden=128, features=64, iters=4000, batch=128, lr=2e-3, weight_decay=1e-3, noise=0.1)


def train_classifier(images, labels, cfg, seed):
    """MLP 256 -> 128 -> 64 -> 10 (ReLU) on pixels in [-1, 1], with random one-pixel
    shifts and Gaussian pixel noise so that it judges generated digits by shape."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(SIZE * SIZE, cfg["hidden"]), nn.ReLU(),
                        nn.Linear(cfg["hidden"], cfg["features"]), nn.ReLU(),
                        nn.Linear(cfg["features"], 10))
    opt = torch.optim.AdamW(net.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    x_all = torch.from_numpy(images.astype(np.float32) / 127.5 - 1.0)
    y_all = torch.from_numpy(labels.astype(np.int64))
    for it in range(cfg["iters"]):
        for g in opt.param_groups:
            g["lr"] = cfg["lr"] * 0.5 * (1 + math.cos(math.pi * it / cfg["iters"]))
        idx = torch.randint(0, x_all.shape[0], (cfg["batch"],), generator=gen)
        x = F.pad(x_all[idx], (1, 1, 1, 1), value=-1.0)
        dy, dx = torch.randint(0, 3, (2,), generator=gen).tolist()
        x = x[:, dy:dy + SIZE, dx:dx + SIZE].reshape(-1, SIZE * SIZE)
        x = x + cfg["noise"] * torch.randn(x.shape, generator=gen)
        loss = F.cross_entropy(net(x), y_all[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return {"fc1.weight": net[0].weight, "fc1.bias": net[0].bias, "fc2.weight": net[2].weight,
            "fc2.bias": net[2].bias, "fc3.weight": net[4].weight, "fc3.bias": net[4].bias}


# --------------------------------------------------------------------------- VAR
#
# The VQVAE and the VAR below are written from the spec (var_fastvar.md A3-A6, B1-B4) and
# the official module tree (FoundationVision/VAR models/vqvae.py, basic_vae.py, quant.py,
# var.py, basic_var.py): the attribute names are the official ones, so state_dict() has the
# official keys and shapes, and `marcache convert var|vqvae` checks and converts it.

VQ_DEFAULTS = dict(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=16, vocab=256, share_quant_resi=4,
                   quant_resi=0.5, beta=0.25, patch_nums=(1, 2, 3, 4, 6, 8), batch=32, iters=600, lr=1e-3,
                   warmup=30, restart_every=50, restart_until=450)
VAR_DEFAULTS = dict(depth=6, width=128, heads=2, mlp_ratio=4.0, num_classes=10, cond_drop=0.1, batch=32,
                    iters=1200, lr=1e-3, warmup=40, wp0=0.005, wpe=0.01, weight_decay=0.05, grad_clip=2.0,
                    init_adaln=0.5, init_adaln_gamma=1e-5, init_head=0.02)
SAMPLE_DEFAULTS = dict(cfg=1.5, top_k=900, top_p=0.96, per_class=50, extra_cfgs=(1.0, 3.0))


def phi_ticks(k):
    """PhiPartiallyShared's ticks (quant.py): K = 4 uses linspace(1/(3K), 1 - 1/(3K), K), i.e.
    1/12 .. 11/12 (the spec's B3 table); other K use linspace(1/(2K), 1 - 1/(2K), K)."""
    return np.linspace(1 / 3 / k, 1 - 1 / 3 / k, k) if k == 4 else np.linspace(1 / 2 / k, 1 - 1 / 2 / k, k)


def phi_index(si, n_scales, k):
    """argmin_k |ticks_k - si / (n - 1)| in float64, first minimum wins."""
    at = si / (n_scales - 1) if n_scales > 1 else 0.0
    return int(np.argmin(np.abs(phi_ticks(k) - at)))


def build_vqvae(cfg):
    """VQVAE (vqvae.py) with an LDM encoder/decoder (basic_vae.py) and VectorQuantizer2's
    multi-scale residual quantisation (quant.py, spec B3) over cfg['patch_nums']."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    def norm(c):
        return nn.GroupNorm(32, c, eps=1e-6, affine=True)

    class ResnetBlock(nn.Module):
        def __init__(self, cin, cout):
            super().__init__()
            self.norm1 = norm(cin)
            self.conv1 = nn.Conv2d(cin, cout, 3, 1, 1)
            self.norm2 = norm(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1)
            self.nin_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

        def forward(self, x):
            h = self.conv1(F.silu(self.norm1(x)))
            h = self.conv2(F.silu(self.norm2(h)))
            return self.nin_shortcut(x) + h

    class AttnBlock(nn.Module):
        """Single-head spatial attention with one fused qkv 1x1 conv (q, k, v channel blocks)."""

        def __init__(self, c):
            super().__init__()
            self.norm = norm(c)
            self.qkv = nn.Conv2d(c, 3 * c, 1)
            self.proj_out = nn.Conv2d(c, c, 1)

        def forward(self, x):
            b, c, hh, ww = x.shape
            q, k, v = self.qkv(self.norm(x)).reshape(b, 3, c, hh * ww).unbind(1)
            w = torch.softmax(torch.bmm(q.transpose(1, 2), k) * c ** -0.5, dim=2)   # [b, query, key]
            h = torch.bmm(v, w.transpose(1, 2)).reshape(b, c, hh, ww)
            return x + self.proj_out(h)

    class Upsample2x(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv = nn.Conv2d(c, c, 3, 1, 1)

        def forward(self, x):
            return self.conv(F.interpolate(x, scale_factor=2, mode="nearest"))

    class Downsample2x(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv = nn.Conv2d(c, c, 3, 2, 0)

        def forward(self, x):
            return self.conv(F.pad(x, (0, 1, 0, 1)))

    ch, mult, nrb, z = cfg["ch"], tuple(cfg["ch_mult"]), cfg["num_res_blocks"], cfg["z_channels"]
    levels = len(mult)

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv_in = nn.Conv2d(3, ch, 3, 1, 1)
            self.down = nn.ModuleList()
            block_in = ch
            for level in range(levels):
                d = nn.Module()
                d.block, d.attn = nn.ModuleList(), nn.ModuleList()
                for _ in range(nrb):
                    d.block.append(ResnetBlock(block_in, ch * mult[level]))
                    block_in = ch * mult[level]
                    if level == levels - 1:
                        d.attn.append(AttnBlock(block_in))
                if level != levels - 1:
                    d.downsample = Downsample2x(block_in)
                self.down.append(d)
            self.mid = nn.Module()
            self.mid.block_1 = ResnetBlock(block_in, block_in)
            self.mid.attn_1 = AttnBlock(block_in)
            self.mid.block_2 = ResnetBlock(block_in, block_in)
            self.norm_out = norm(block_in)
            self.conv_out = nn.Conv2d(block_in, z, 3, 1, 1)

        def forward(self, x):
            h = self.conv_in(x)
            for level, d in enumerate(self.down):
                for i, blk in enumerate(d.block):
                    h = blk(h)
                    if len(d.attn):
                        h = d.attn[i](h)
                if level != levels - 1:
                    h = d.downsample(h)
            h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
            return self.conv_out(F.silu(self.norm_out(h)))

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            block_in = ch * mult[-1]
            self.conv_in = nn.Conv2d(z, block_in, 3, 1, 1)
            self.mid = nn.Module()
            self.mid.block_1 = ResnetBlock(block_in, block_in)
            self.mid.attn_1 = AttnBlock(block_in)
            self.mid.block_2 = ResnetBlock(block_in, block_in)
            ups = []
            for level in reversed(range(levels)):
                u = nn.Module()
                u.block, u.attn = nn.ModuleList(), nn.ModuleList()
                for _ in range(nrb + 1):
                    u.block.append(ResnetBlock(block_in, ch * mult[level]))
                    block_in = ch * mult[level]
                    if level == levels - 1:
                        u.attn.append(AttnBlock(block_in))
                if level != 0:
                    u.upsample = Upsample2x(block_in)
                ups.insert(0, u)                 # stored with index = level
            self.up = nn.ModuleList(ups)
            self.norm_out = norm(block_in)
            self.conv_out = nn.Conv2d(block_in, 3, 3, 1, 1)

        def forward(self, f):
            h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(self.conv_in(f))))
            for level in reversed(range(levels)):
                u = self.up[level]
                for i, blk in enumerate(u.block):
                    h = blk(h)
                    if len(u.attn):
                        h = u.attn[i](h)
                if level != 0:
                    h = u.upsample(h)
            return self.conv_out(F.silu(self.norm_out(h)))

    class Phi(nn.Conv2d):
        def __init__(self, c, resi):
            super().__init__(c, c, 3, 1, 1)
            self.resi = resi

        def forward(self, h):
            return h * (1 - self.resi) + super().forward(h) * self.resi

    class PhiPartiallyShared(nn.Module):
        def __init__(self, k):
            super().__init__()
            self.qresi_ls = nn.ModuleList([Phi(z, cfg["quant_resi"]) for _ in range(k)])

    pns = tuple(cfg["patch_nums"])
    sn = len(pns)
    side = pns[-1]

    class VectorQuantizer2(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(cfg["vocab"], z)
            self.quant_resi = PhiPartiallyShared(cfg["share_quant_resi"])
            self.register_buffer("ema_vocab_hit_SV", torch.zeros(sn, cfg["vocab"]))

        def phi(self, si):
            return self.quant_resi.qresi_ls[phi_index(si, sn, cfg["share_quant_resi"])]

        def nearest(self, rest_nc):
            e = self.embedding.weight.detach()
            d = (rest_nc ** 2).sum(1, keepdim=True) + (e ** 2).sum(1) - 2 * rest_nc @ e.T
            return d.argmin(1)

        def up(self, h, si):
            return h if si == sn - 1 else F.interpolate(h, size=(side, side), mode="bicubic")

        def forward(self, f):
            """Training: residual quantisation over the scales; VQ loss (codebook + beta x
            commitment, averaged over scales); the straight-through f_hat; code hits."""
            b = f.shape[0]
            f_no_grad = f.detach()
            f_rest = f_no_grad.clone()
            f_hat = torch.zeros_like(f_rest)
            loss = 0.0
            hits, rests = [], []
            for si, pn in enumerate(pns):
                rest = F.interpolate(f_rest, size=(pn, pn), mode="area") if si != sn - 1 else f_rest
                rests.append(rest.permute(0, 2, 3, 1).reshape(-1, z))
                idx = self.nearest(rests[-1])
                hits.append(idx)
                h = self.embedding(idx.view(b, pn, pn)).permute(0, 3, 1, 2)
                h = self.phi(si)(self.up(h, si))
                f_hat = f_hat + h
                f_rest = f_rest - h.detach()
                loss = loss + cfg["beta"] * F.mse_loss(f_hat.detach(), f) + F.mse_loss(f_hat, f_no_grad)
            return (f_hat.detach() - f_no_grad) + f, loss / sn, hits, torch.cat(rests)

        @torch.no_grad()
        def f_to_idx(self, f):
            """f_to_idxBl_or_fhat(to_fhat=False): token lists [B, pn^2] per scale."""
            b = f.shape[0]
            f_rest = f.clone()
            out = []
            for si, pn in enumerate(pns):
                rest = F.interpolate(f_rest, size=(pn, pn), mode="area") if si != sn - 1 else f_rest
                idx = self.nearest(rest.permute(0, 2, 3, 1).reshape(-1, z))
                h = self.phi(si)(self.up(self.embedding(idx.view(b, pn, pn)).permute(0, 3, 1, 2), si))
                f_rest -= h
                out.append(idx.view(b, pn * pn))
            return out

        @torch.no_grad()
        def idx_to_fhat(self, idx_list):
            f_hat = torch.zeros(idx_list[0].shape[0], z, side, side)
            for si, (pn, idx) in enumerate(zip(pns, idx_list)):
                h = self.embedding(idx).transpose(1, 2).reshape(-1, z, pn, pn)
                f_hat += self.phi(si)(self.up(h, si))
            return f_hat

        @torch.no_grad()
        def idx_to_var_input(self, idx_list):
            """idxBl_to_var_input: teacher-forcing inputs [B, L - first_l, z] (the area-downsampled
            cumulative f_hat after each scale but the last, raster order, scales concatenated)."""
            b = idx_list[0].shape[0]
            f_hat = torch.zeros(b, z, side, side)
            nxt = []
            for si in range(sn - 1):
                pn = pns[si]
                h = self.embedding(idx_list[si]).transpose(1, 2).reshape(b, z, pn, pn)
                f_hat += self.phi(si)(F.interpolate(h, size=(side, side), mode="bicubic"))
                pn_next = pns[si + 1]
                nxt.append(F.interpolate(f_hat, size=(pn_next, pn_next), mode="area").reshape(b, z, -1).transpose(1, 2))
            return torch.cat(nxt, dim=1)

        @torch.no_grad()
        def next_input(self, si, f_hat, h):
            """get_next_autoregressive_input: f_hat += Phi(bicubic(h)); the next scale's input."""
            f_hat += self.phi(si)(self.up(h, si))
            if si == sn - 1:
                return f_hat, f_hat
            pn_next = pns[si + 1]
            return f_hat, F.interpolate(f_hat, size=(pn_next, pn_next), mode="area")

    class VQVAE(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = Encoder()
            self.decoder = Decoder()
            self.quantize = VectorQuantizer2()
            self.quant_conv = nn.Conv2d(z, z, 3, 1, 1)
            self.post_quant_conv = nn.Conv2d(z, z, 3, 1, 1)

        def encode(self, x):
            return self.quant_conv(self.encoder(x))

        def decode(self, f_hat):
            return self.decoder(self.post_quant_conv(f_hat))

        def fhat_to_img(self, f_hat):
            return self.decode(f_hat).clamp(-1, 1)

        def forward(self, x):
            f_hat, vq_loss, hits, rests = self.quantize(self.encode(x))
            return self.decode(f_hat), vq_loss, hits, rests

    return VQVAE()


def to_rgb(images_u8):
    """uint8 [N, 16, 16] -> float32 [N, 3, 16, 16] in [-1, 1], three equal channels (the VAE's
    RGB input; the MAR demo's grayscale digits as RGB)."""
    import torch

    x = torch.from_numpy(images_u8.astype(np.float32) / 127.5 - 1.0)[:, None]
    return x.expand(-1, 3, -1, -1).contiguous()


def to_uint8(images):
    """Decoder output [N, 3, 16, 16] clamped to [-1, 1] -> uint8 [N, 16, 16] of channel 0,
    round half to even of (x + 1) / 2 * 255 (marcache's mc_vae_to_uint8)."""
    x = images[:, 0].double().clamp(-1, 1).numpy()
    return np.rint((x + 1.0) / 2.0 * 255.0).astype(np.uint8)


def train_vqvae(images_u8, cfg, seed, log_every=100):
    """VQVAE training: MSE reconstruction + VectorQuantizer2's VQ loss (beta 0.25) with the
    straight-through estimator. The official VQVAE training code is not released (VAR used
    a VQGAN recipe with perceptual and GAN losses); for 16x16 digits MSE suffices. Codes
    unused for `restart_every` iterations are restarted on random residual vectors of the
    batch until `restart_until` (avoids the dead codes a small run otherwise keeps)."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed + 100)
    torch.manual_seed(seed + 100)
    vq = build_vqvae(cfg)
    opt = torch.optim.AdamW(vq.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    x_all = to_rgb(images_u8)
    n = x_all.shape[0]
    used = torch.zeros(cfg["vocab"], dtype=torch.bool)
    t0, run_rec, run_vq = time.time(), 0.0, 0.0
    for it in range(cfg["iters"]):
        lr = cfg["lr"] * min(1.0, (it + 1) / cfg["warmup"])
        lr *= 0.5 * (1 + math.cos(math.pi * it / cfg["iters"])) * 0.95 + 0.05
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, n, (cfg["batch"],), generator=gen)
        x = x_all[idx]
        vq.train()
        rec, vq_loss, hits, rests = vq(x)
        rec_loss = F.mse_loss(rec, x)
        loss = rec_loss + vq_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        for h in hits:
            used[h] = True
        if (it + 1) % cfg["restart_every"] == 0 and it + 1 <= cfg["restart_until"]:
            dead = (~used).nonzero()[:, 0]
            if len(dead):   # onto the vectors the quantiser was asked to code (any scale)
                with torch.no_grad():
                    pick = torch.randint(0, rests.shape[0], (len(dead),), generator=gen)
                    vq.quantize.embedding.weight[dead] = rests[pick].detach()
            used.zero_()
        run_rec += rec_loss.item()
        run_vq += vq_loss.item()
        if (it + 1) % log_every == 0:
            print(f"vqvae iter {it + 1}/{cfg['iters']} rec {run_rec / log_every:.4f} vq {run_vq / log_every:.4f} "
                  f"lr {lr:.2e} {time.time() - t0:.0f}s", flush=True)
            run_rec = run_vq = 0.0
    vq.eval()
    with torch.no_grad():   # code hits per scale over the training images (the official buffer's role)
        idx = vq.quantize.f_to_idx(vq.encode(x_all))
        for si, i in enumerate(idx):
            vq.quantize.ema_vocab_hit_SV[si] = torch.bincount(i.reshape(-1), minlength=cfg["vocab"]).float()
    return vq


def build_var(cfg, vq_cfg):
    """VAR (var.py, basic_var.py) with attn_l2_norm = True, shared_aln = False, class-conditional
    with a null class (row num_classes of class_emb)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    C, H, depth = cfg["width"], cfg["heads"], cfg["depth"]
    hidden = round(C * cfg["mlp_ratio"])
    pns = tuple(vq_cfg["patch_nums"])
    L = sum(p * p for p in pns)
    first_l = pns[0] ** 2
    cvae, vocab = vq_cfg["z_channels"], vq_cfg["vocab"]
    init_std = math.sqrt(1 / C / 3)

    class SelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale_mul_1H11 = nn.Parameter(torch.full((1, H, 1, 1), 4.0).log())
            self.max_scale_mul = math.log(100)
            self.mat_qkv = nn.Linear(C, 3 * C, bias=False)
            self.q_bias = nn.Parameter(torch.zeros(C))
            self.v_bias = nn.Parameter(torch.zeros(C))
            self.register_buffer("zero_k_bias", torch.zeros(C))
            self.proj = nn.Linear(C, C)

        def forward(self, x, attn_bias, cache=None):
            b, n, _ = x.shape
            qkv = F.linear(x, self.mat_qkv.weight, torch.cat((self.q_bias, self.zero_k_bias, self.v_bias)))
            q, k, v = qkv.view(b, n, 3, H, C // H).permute(2, 0, 3, 1, 4).unbind(0)
            q = F.normalize(q, dim=-1) * self.scale_mul_1H11.clamp_max(self.max_scale_mul).exp()
            k = F.normalize(k, dim=-1)
            if cache is not None:   # inference: append this scale's k, v; attend over all so far
                if "k" in cache:
                    k = cache["k"] = torch.cat((cache["k"], k), dim=2)
                    v = cache["v"] = torch.cat((cache["v"], v), dim=2)
                else:
                    cache["k"], cache["v"] = k, v
            a = torch.softmax(q @ k.transpose(-2, -1) + (0 if attn_bias is None else attn_bias), dim=-1)
            return self.proj((a @ v).transpose(1, 2).reshape(b, n, C))

    class FFN(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(C, hidden)
            self.fc2 = nn.Linear(hidden, C)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))

    class AdaLNSelfAttn(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = SelfAttention()
            self.ffn = FFN()
            self.ln_wo_grad = nn.LayerNorm(C, eps=1e-6, elementwise_affine=False)
            self.ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(C, 6 * C))

        def forward(self, x, cond, attn_bias, cache=None):
            g1, g2, s1, s2, sh1, sh2 = self.ada_lin(cond).view(-1, 1, 6, C).unbind(2)
            x = x + self.attn(self.ln_wo_grad(x) * (s1 + 1) + sh1, attn_bias, cache) * g1
            return x + self.ffn(self.ln_wo_grad(x) * (s2 + 1) + sh2) * g2

    class AdaLNBeforeHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_wo_grad = nn.LayerNorm(C, eps=1e-6, elementwise_affine=False)
            self.ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(C, 2 * C))

        def forward(self, x, cond):
            scale, shift = self.ada_lin(cond).view(-1, 1, 2, C).unbind(2)
            return self.ln_wo_grad(x) * (scale + 1) + shift

    class VAR(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_classes = cfg["num_classes"]
            self.word_embed = nn.Linear(cvae, C)
            self.class_emb = nn.Embedding(self.num_classes + 1, C)
            self.pos_start = nn.Parameter(torch.empty(1, first_l, C))
            self.pos_1LC = nn.Parameter(torch.empty(1, L, C))
            self.lvl_embed = nn.Embedding(len(pns), C)
            self.blocks = nn.ModuleList([AdaLNSelfAttn() for _ in range(depth)])
            d = torch.cat([torch.full((p * p,), i) for i, p in enumerate(pns)]).view(1, L, 1)
            dt = d.transpose(1, 2)
            self.register_buffer("lvl_1L", dt[:, 0].contiguous())
            self.register_buffer("attn_bias_for_masking",
                                 torch.where(d >= dt, 0.0, -torch.inf).reshape(1, 1, L, L).contiguous())
            self.head_nm = AdaLNBeforeHead()
            self.head = nn.Linear(C, vocab)
            self._init()

        def _init(self):
            """VAR.__init__ + init_weights with build_vae_var's defaults (init_std automated =
            sqrt(1/(3C)), head x 0.02, ada_lin x 0.5 and its gamma rows x 1e-5,
            proj / fc2 / sqrt(2 depth))."""
            for p in (self.pos_start, self.pos_1LC):
                nn.init.trunc_normal_(p, std=init_std)
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    nn.init.trunc_normal_(m.weight, std=init_std)
                    if m.bias is not None:
                        nn.init.zeros_(m.bias)
                elif isinstance(m, nn.Embedding):
                    nn.init.trunc_normal_(m.weight, std=init_std)
            with torch.no_grad():
                self.head.weight.mul_(cfg["init_head"])
                self.head_nm.ada_lin[-1].weight.mul_(cfg["init_adaln"])
                for blk in self.blocks:
                    blk.attn.proj.weight.div_(math.sqrt(2 * depth))
                    blk.ffn.fc2.weight.div_(math.sqrt(2 * depth))
                    blk.ada_lin[-1].weight[2 * C:].mul_(cfg["init_adaln"])
                    blk.ada_lin[-1].weight[:2 * C].mul_(cfg["init_adaln_gamma"])

        def forward(self, labels, x_wo_first, gen=None):
            """Teacher forcing (VAR.forward): labels replaced by the null class with probability
            cond_drop, sos + word_embed(inputs) + lvl/pos, block-causal mask, logits [B, L, V]."""
            b = x_wo_first.shape[0]
            if gen is not None:
                drop = torch.rand(b, generator=gen) < cfg["cond_drop"]
                labels = torch.where(drop, torch.full_like(labels, self.num_classes), labels)
            cond = self.class_emb(labels)
            sos = cond[:, None].expand(b, first_l, C) + self.pos_start.expand(b, first_l, C)
            x = torch.cat((sos, self.word_embed(x_wo_first)), dim=1)
            x = x + self.lvl_embed(self.lvl_1L.expand(b, -1)) + self.pos_1LC
            for blk in self.blocks:
                x = blk(x, cond, self.attn_bias_for_masking)
            return self.head(self.head_nm(x, cond))

    return VAR()


def var_param_groups(var, weight_decay):
    """filter_params of the official train.py: no weight decay for 1-d tensors, biases and
    the position / level embeddings and scale_mul."""
    nowd = ("pos_1LC", "pos_start", "lvl_embed", "scale_mul")
    decay, no_decay = [], []
    for name, p in var.named_parameters():
        (no_decay if p.ndim == 1 or name.endswith("bias") or any(k in name for k in nowd) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lin0_lr(it, cfg):
    """lr_wd_annealing(sche='lin0') of the official trainer: linear warm-up from wp0, flat for
    the first 5 % after it, then linear decay to wpe (all x peak lr)."""
    wp, max_it = cfg["warmup"], cfg["iters"]
    if it < wp:
        f = cfg["wp0"] + (1 - cfg["wp0"]) * it / wp
    else:
        passed = (it - wp) / max(1, max_it - 1 - wp)
        f = 1.0 if passed < 0.05 else cfg["wpe"] + (1 - cfg["wpe"]) * (1 - passed) / 0.95
    return f * cfg["lr"]


def train_var(tokens, inputs, labels, cfg, vq_cfg, seed, log_every=50):
    """Teacher-forced training as VARTrainer.train_step: gt tokens of all scales, inputs from
    idxBl_to_var_input, cross-entropy on every token (uniform 1/L weights), AdamW (0.9, 0.95)
    with the official no-decay groups, grad clip 2, the lin0 schedule."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed + 200)
    torch.manual_seed(seed + 200)
    var = build_var(cfg, vq_cfg)
    opt = torch.optim.AdamW(var_param_groups(var, cfg["weight_decay"]), lr=cfg["lr"], betas=(0.9, 0.95))
    y_all = torch.from_numpy(labels.astype(np.int64))
    n, vocab = tokens.shape[0], vq_cfg["vocab"]
    t0, run_loss, run_acc = time.time(), 0.0, 0.0
    for it in range(cfg["iters"]):
        lr = lin0_lr(it, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, n, (cfg["batch"],), generator=gen)
        var.train()
        logits = var(y_all[idx], inputs[idx], gen)
        gt = tokens[idx]
        loss = F.cross_entropy(logits.reshape(-1, vocab), gt.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(var.parameters(), cfg["grad_clip"])
        opt.step()
        run_loss += loss.item()
        run_acc += (logits.detach().argmax(-1) == gt).float().mean().item()
        if (it + 1) % log_every == 0:
            print(f"var iter {it + 1}/{cfg['iters']} loss {run_loss / log_every:.4f} "
                  f"acc {100 * run_acc / log_every:.1f}% lr {lr:.2e} {time.time() - t0:.0f}s", flush=True)
            run_loss = run_acc = 0.0
    var.eval()
    return var


def sample_top_k_top_p(logits, top_k, top_p, gen):
    """helpers.sample_with_top_k_top_p_ on [B, n, V]; top_k >= V keeps all (torch.topk would
    raise), as marcache's sample_tokens documents."""
    import torch

    b, n, v = logits.shape
    logits = logits.clone()
    if 0 < top_k < v:
        thr = logits.topk(top_k, dim=-1).values.amin(dim=-1, keepdim=True)
        logits.masked_fill_(logits < thr, -torch.inf)
    if 0 < top_p < 1:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
        remove = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
        remove[..., -1:] = False
        logits.masked_fill_(remove.scatter(-1, sorted_idx, remove), -torch.inf)
    probs = logits.softmax(dim=-1).view(-1, v)
    return torch.multinomial(probs, 1, replacement=True, generator=gen).view(b, n)


def var_generate(var, vq, labels, cfg_scale, top_k, top_p, gen, vq_cfg):
    """autoregressive_infer_cfg (spec A4) with per-block KV caches: 2B rows (conditional,
    then the null class), guidance t = cfg * si / (n - 1), the VQ residual update. Returns
    the decoded images [B, 3, 16, 16] in [-1, 1] and the tokens [B, L]."""
    import torch

    pns = tuple(vq_cfg["patch_nums"])
    sn, cvae, side = len(pns), vq_cfg["z_channels"], pns[-1]
    with torch.no_grad():
        b = len(labels)
        lab = torch.as_tensor(labels, dtype=torch.int64)
        cond = var.class_emb(torch.cat((lab, torch.full_like(lab, var.num_classes))))
        lvl_pos = var.lvl_embed(var.lvl_1L) + var.pos_1LC
        first = pns[0] ** 2
        x = cond[:, None].expand(2 * b, first, -1) + var.pos_start.expand(2 * b, first, -1) + lvl_pos[:, :first]
        f_hat = torch.zeros(b, cvae, side, side)
        caches = [dict() for _ in var.blocks]
        cur, toks = 0, []
        for si, pn in enumerate(pns):
            cur += pn * pn
            for blk, cache in zip(var.blocks, caches):
                x = blk(x, cond, None, cache)
            logits = var.head(var.head_nm(x, cond))
            t = cfg_scale * si / (sn - 1)
            logits = (1 + t) * logits[:b] - t * logits[b:]
            idx = sample_top_k_top_p(logits, top_k, top_p, gen)
            toks.append(idx)
            h = vq.quantize.embedding(idx).transpose(1, 2).reshape(b, cvae, pn, pn)
            f_hat, nxt = vq.quantize.next_input(si, f_hat, h)
            if si != sn - 1:
                nxt = nxt.reshape(b, cvae, -1).transpose(1, 2)
                x = (var.word_embed(nxt) + lvl_pos[:, cur:cur + pns[si + 1] ** 2]).repeat(2, 1, 1)
        return vq.fhat_to_img(f_hat), torch.cat(toks, dim=1)


class DigitsScorer:
    """marcache.digits.Classifier and the digits-FID ('symmetric' method of marcache.eval.fid)
    in NumPy float64, so that the trainer scores its samples exactly as marcache does."""

    def __init__(self, path, train_images):
        from safetensors.numpy import load_file

        self.w = {k: v.astype(np.float64) for k, v in load_file(path).items()}
        self.ref = self.moments(self.features(train_images))

    def features(self, images_u8):
        x = images_u8.reshape(len(images_u8), -1).astype(np.float64) / 127.5 - 1.0
        h = np.maximum(x @ self.w["fc1.weight"].T + self.w["fc1.bias"], 0.0)
        return np.maximum(h @ self.w["fc2.weight"].T + self.w["fc2.bias"], 0.0)

    def accuracy(self, images_u8, labels):
        logits = self.features(images_u8) @ self.w["fc3.weight"].T + self.w["fc3.bias"]
        return float(np.mean(np.argmax(logits, 1) == np.asarray(labels)))

    @staticmethod
    def moments(f):
        return f.mean(0), np.cov(f, rowvar=False)

    def fid(self, images_u8):
        mu1, s1 = self.moments(self.features(images_u8))
        mu2, s2 = self.ref

        def psd_sqrt(s):
            w, v = np.linalg.eigh((s + s.T) / 2)
            return (v * np.sqrt(np.clip(w, 0.0, None))) @ v.T

        r = psd_sqrt(s1)
        m = r @ s2 @ r
        tr = np.sqrt(np.clip(np.linalg.eigvalsh((m + m.T) / 2), 0.0, None)).sum()
        d = mu1 - mu2
        return float(d @ d + np.trace(s1) + np.trace(s2) - 2.0 * tr)


def convert_with_marcache(kind, state, workdir, name, python):
    """torch.save(state) as an official-layout .pth, then `python -m marcache convert KIND`
    (fp16) into workdir: the converter checks every key and shape of the official layout.
    Returns (tensors as numpy, the converter's metadata)."""
    import subprocess
    import sys

    import torch
    from safetensors import safe_open
    from safetensors.numpy import load_file

    pth = os.path.join(workdir, name + ".pth")
    out = os.path.join(workdir, name + ".converted.safetensors")
    torch.save({k: v.detach().clone() for k, v in state.items()}, pth)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [python or sys.executable, "-m", "marcache", "convert", kind, pth, "-o", out, "--dtype", "fp16", "--quiet"]
    subprocess.run(cmd, cwd=repo, check=True)
    with safe_open(out, "np") as f:
        meta = dict(f.metadata())
    return load_file(out), meta


def run_var(args, common):
    import tempfile

    import torch
    from safetensors.numpy import load_file, save_file

    data = load_file(os.path.join(args.out, "digits.safetensors"))
    images = data["images"].astype(np.uint8)
    labels = data["labels"].astype(np.int64)
    train = data["train"].astype(np.int64)
    held_out = data["held_out"].astype(np.int64)
    vq_cfg = dict(VQ_DEFAULTS)
    var_cfg = dict(VAR_DEFAULTS)
    if args.vq_iters is not None:
        vq_cfg["iters"] = args.vq_iters
    if args.var_iters is not None:
        var_cfg["iters"] = args.var_iters
    scorer = DigitsScorer(os.path.join(args.out, "digits_classifier.safetensors"), images[train])
    workdir = args.workdir or tempfile.mkdtemp(prefix="digits_var_")
    os.makedirs(workdir, exist_ok=True)
    t_all = time.time()

    # 1. VQVAE
    t0 = time.time()
    if args.resume_vqvae:
        vq = build_vqvae(vq_cfg)
        vq.load_state_dict(torch.load(args.resume_vqvae))
    else:
        vq = train_vqvae(images[train], vq_cfg, args.seed)
        torch.save(vq.state_dict(), os.path.join(workdir, "digits_vqvae_trained.pth"))
    vq_seconds = time.time() - t0
    vq_arrays, vq_meta = convert_with_marcache("vqvae", vq.state_dict(), workdir, "digits_vqvae",
                                               args.marcache_python)
    # From here on the fp16 weights that ship (read back as float32): tokens, teacher-forcing
    # inputs and every score come from the file's weights.
    sd = vq.state_dict()
    for k, v in vq_arrays.items():
        sd[k] = torch.from_numpy(v.astype(np.float32))
    vq.load_state_dict(sd)
    vq.eval()
    with torch.no_grad():
        idx_held = vq.quantize.f_to_idx(vq.encode(to_rgb(images[held_out])))
        rec = to_uint8(vq.fhat_to_img(vq.quantize.idx_to_fhat(idx_held)))
        idx_train = vq.quantize.f_to_idx(vq.encode(to_rgb(images[train])))
        inputs = vq.quantize.idx_to_var_input(idx_train)
    tokens = torch.cat(idx_train, dim=1)
    usage = [int((torch.bincount(i.reshape(-1), minlength=vq_cfg["vocab"]) > 0).sum()) for i in idx_train]
    vq_eval = {"held_out_recon_accuracy": scorer.accuracy(rec, labels[held_out]),
               "held_out_recon_fid": scorer.fid(rec),
               "held_out_recon_mse": float(np.mean((rec.astype(np.float64) - images[held_out]) ** 2) / 127.5 ** 2),
               "codes_used_per_scale": usage}
    print(f"vqvae: {vq_seconds:.0f}s, held-out reconstructions: {vq_eval}", flush=True)

    # 2. VAR
    t0 = time.time()
    var = train_var(tokens, inputs, labels[train], var_cfg, vq_cfg, args.seed)
    var_seconds = time.time() - t0
    var_arrays, var_meta = convert_with_marcache("var", var.state_dict(), workdir, "digits_var", args.marcache_python)
    sd = var.state_dict()
    for k, v in var_arrays.items():
        sd[k] = torch.from_numpy(v.astype(np.float32))
    var.load_state_dict(sd)
    var.eval()

    # 3. Samples of the shipped weights, scored by the shipped classifier
    scfg = dict(SAMPLE_DEFAULTS)
    sample_labels = np.repeat(np.arange(10), scfg["per_class"])
    results = {}
    t0 = time.time()
    for cfg_scale in (scfg["cfg"],) + tuple(scfg["extra_cfgs"]):
        gen = torch.Generator().manual_seed(args.seed + 300)
        imgs, _ = var_generate(var, vq, sample_labels, cfg_scale, scfg["top_k"], scfg["top_p"], gen, vq_cfg)
        u8 = to_uint8(imgs)
        key = f"cfg {cfg_scale:.1f}"
        results[key] = {"accuracy": scorer.accuracy(u8, sample_labels), "fid": scorer.fid(u8)}
        print(f"samples {key}: class accuracy {results[key]['accuracy']:.4f}, digits-FID {results[key]['fid']:.3f} "
              f"({len(sample_labels)} digits)", flush=True)
        if cfg_scale == scfg["cfg"]:
            np.savez_compressed(os.path.join(workdir, "digits_var_samples.npz"), images=u8, labels=sample_labels)
    sample_seconds = time.time() - t0
    held_fid = scorer.fid(images[held_out])
    print(f"held-out real digits: digits-FID {held_fid:.3f} (reference: the {len(train)} training digits)")

    # 4. The shipped files: the converter's tensors and metadata, plus patch_nums and settings
    pn = ",".join(map(str, vq_cfg["patch_nums"]))
    jsonable = lambda d: json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in d.items()})  # noqa: E731
    extra = {"patch_nums": pn, "image_size": str(SIZE), "image_channels": "3",
             "note": "grayscale digits as 3 equal RGB channels in [-1, 1]",
             "train_split": "digits.safetensors 'train' (1500 images)", **common}
    vq_meta.update(extra)
    vq_meta.update({"settings": jsonable(vq_cfg), "train_seconds": f"{vq_seconds:.0f}",
                    "evaluation": json.dumps(vq_eval)})
    save_file(vq_arrays, os.path.join(args.out, "digits_vqvae.safetensors"), metadata=vq_meta)
    var_meta.update(extra)
    var_meta.update({"settings": jsonable(var_cfg), "train_seconds": f"{var_seconds:.0f}",
                     "sampling": jsonable(scfg), "evaluation": json.dumps(results),
                     "held_out_real_fid": f"{held_fid:.4f}"})
    save_file(var_arrays, os.path.join(args.out, "digits_var.safetensors"), metadata=var_meta)
    print(f"wrote digits_vqvae.safetensors ({sum(v.size for v in vq_arrays.values()):,} params) and "
          f"digits_var.safetensors ({sum(v.size for v in var_arrays.values()):,} params); VQVAE {vq_seconds:.0f}s, "
          f"VAR {var_seconds:.0f}s, sampling {sample_seconds:.0f}s, total {time.time() - t_all:.0f}s "
          f"(work files in {workdir})", flush=True)


# --------------------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["all", "data", "mar", "classifier", "var"])
    ap.add_argument("--out", default="marcache/data")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=None, help="override the MAR training iterations")
    ap.add_argument("--head-iters", type=int, default=None, help="override the head fine-tuning iterations")
    ap.add_argument("--resume", default=None,
                    help="phase-1 weights (digits_mar_phase1.safetensors of an earlier run) to skip phase 1")
    ap.add_argument("--var-iters", type=int, default=None, help="var: override the VAR training iterations")
    ap.add_argument("--vq-iters", type=int, default=None, help="var: override the VQVAE training iterations")
    ap.add_argument("--resume-vqvae", default=None,
                    help="var: trained VQVAE state dict (digits_vqvae_trained.pth in --workdir) to skip its training")
    ap.add_argument("--workdir", default=None,
                    help="var: folder for the official-layout .pth files, converter outputs and samples "
                         "(default: a new temporary folder)")
    ap.add_argument("--marcache-python", default=os.environ.get("MARCACHE_PYTHON"),
                    help="var: a Python that imports marcache (built), for `python -m marcache convert` "
                         "(default $MARCACHE_PYTHON, else this Python)")
    args = ap.parse_args()

    import torch
    from safetensors.numpy import save_file

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    os.makedirs(args.out, exist_ok=True)
    images, labels, train, held_out = load_digits_16()
    common = {"source": "sklearn.datasets.load_digits (UCI optdigits, CC BY 4.0), upsampled 8x8 -> 16x16",
              "tool": "tools/train_digits.py", "torch": torch.__version__, "threads": str(args.threads),
              "seed": str(args.seed)}

    if args.what in ("all", "data"):
        # F16 holds the integers 0..2048 exactly, and marcache's reader returns float32.
        save_file({"images": images.astype(np.float16), "labels": labels.astype(np.float16),
                   "train": train.astype(np.float16), "held_out": held_out.astype(np.float16)},
                  os.path.join(args.out, "digits.safetensors"),
                  metadata={"kind": "digits-data", "note": "integer values stored as F16 (exact)", **common})
        print("wrote digits.safetensors", images.shape)

    if args.what in ("all", "classifier"):
        t0 = time.time()
        w = train_classifier(images[train], labels[train], CLS_DEFAULTS, args.seed)
        arrays = {k: v.detach().numpy().astype(np.float32) for k, v in w.items()}
        with torch.no_grad():
            x = torch.from_numpy(images[held_out].reshape(-1, SIZE * SIZE).astype(np.float32) / 127.5 - 1.0)
            h = torch.relu(x @ w["fc1.weight"].T + w["fc1.bias"])
            h = torch.relu(h @ w["fc2.weight"].T + w["fc2.bias"])
            acc = float((torch.argmax(h @ w["fc3.weight"].T + w["fc3.bias"], 1).numpy() == labels[held_out]).mean())
        save_file(arrays, os.path.join(args.out, "digits_classifier.safetensors"),
                  metadata={"kind": "digits-classifier", "held_out_accuracy": f"{acc:.4f}",
                            "settings": json.dumps(CLS_DEFAULTS), **common})
        print(f"classifier: held-out accuracy {acc:.4f} ({time.time() - t0:.0f}s)")

    if args.what == "var":
        run_var(args, common)

    if args.what in ("all", "mar"):
        cfg = dict(MAR_DEFAULTS)
        if args.iters is not None:
            cfg["iters"] = args.iters
        hcfg = dict(HEAD_DEFAULTS)
        if args.head_iters is not None:
            hcfg["iters"] = args.head_iters
        t0 = time.time()
        tokens = to_tokens(images[train])
        # Phase 2 starts from the fp16-rounded phase-1 weights (the file phase 1 alone
        # writes), so --resume from that file reproduces a full run.
        phase1 = os.path.join(args.out, "digits_mar_phase1.safetensors")
        if args.resume:
            from safetensors.numpy import load_file
            state = {k: v.astype(np.float32) for k, v in load_file(args.resume).items()}
        else:
            state = train_mar(tokens, labels[train], cfg, args.seed)
            save_file({k: v.astype(np.float16) for k, v in state.items()}, phase1)
            state = {k: v.astype(np.float16).astype(np.float32) for k, v in state.items()}
        state = finetune_head(state, tokens, labels[train], cfg, hcfg, args.seed)
        # Official names and layout; fp16 keeps the file small (the engine converts at load).
        arrays = {k: v.astype(np.float16) for k, v in state.items()}
        meta = {"kind": "mar", "heads": str(cfg["heads"]), "decoder": "pixels", "image_size": str(SIZE),
                "patch_size": str(PATCH), "image_channels": "1", "pixel_scale": "127.5", "pixel_offset": "127.5",
                "settings": json.dumps(cfg), "head_settings": json.dumps(hcfg), "train_seconds": f"{time.time() - t0:.0f}", **common}
        save_file(arrays, os.path.join(args.out, "digits_mar.safetensors"), metadata=meta)
        print(f"wrote digits_mar.safetensors ({sum(v.size for v in arrays.values()):,} params, "
              f"{time.time() - t0:.0f}s)")


if __name__ == "__main__":
    main()

"""Trains the digits demo models that ship inside marcache (development tool).

    python tools/train_digits.py all --out marcache/data

writes three files into --out:

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
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 3.0)
        opt.step()
        # EMA with the usual warm-up (decay (1 + it) / (10 + it) until it reaches
        # cfg["ema"]): a short run must not ship weights still weighted to the init.
        decay_now = min(cfg["ema"], (1 + it) / (10 + it))
        with torch.no_grad():
            for k, v in model.state_dict().items():
                if v.dtype.is_floating_point:
                    ema[k].mul_(decay_now).add_(v, alpha=1 - decay_now)
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
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 3.0)
        opt.step()
        decay_now = min(hcfg["ema"], (1 + it) / (10 + it))
        with torch.no_grad():
            for k, v in net.state_dict().items():
                ema[k].mul_(decay_now).add_(v, alpha=1 - decay_now)
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


# --------------------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["all", "data", "mar", "classifier"])
    ap.add_argument("--out", default="marcache/data")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=None, help="override the MAR training iterations")
    ap.add_argument("--head-iters", type=int, default=None, help="override the head fine-tuning iterations")
    ap.add_argument("--resume", default=None,
                    help="phase-1 weights (digits_mar_phase1.safetensors of an earlier run) to skip phase 1")
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

"""Tiny MAR models in the exact official key layout, written with the
safetensors package (an independent writer) for the engine tests."""
import numpy as np
from safetensors.numpy import save_file

from reference import mar as R

TINY = dict(dim=32, depth=2, heads=2, head_width=32, head_depth=2)


def write_tiny_mar(path, seed=0, heads=2, metadata_heads=True, dim=32, depth=2, head_width=32, head_depth=2,
                   num_classes=1000, dtype=np.float32):
    rng = np.random.default_rng(seed)
    W = R.random_mar_weights(rng, dim=dim, depth=depth, heads_unused=heads, head_width=head_width,
                             head_depth=head_depth, num_classes=num_classes)
    meta = {"heads": str(heads)} if metadata_heads else None
    save_file({k: v.astype(dtype) for k, v in W.items()}, str(path), metadata=meta)
    return W


def rel_err(a, ref):
    a = np.asarray(a, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / max(np.abs(ref).max(), 1e-30))


def amplified_mar_weights(seed, dim, depth, heads, head_width, head_depth, qkv_gain, head_gain):
    """Random official-layout MAR weights with the attention qkv and the head's
    cond_embed / adaLN / MLP weights scaled up, so that which rows a cache policy
    picks, and each head-cache rule, change the tokens far beyond float32 noise
    (plain 0.05-scale weights make nearly every choice invisible)."""
    rng = np.random.default_rng(seed)
    W = R.random_mar_weights(rng, dim=dim, depth=depth, heads_unused=heads, head_width=head_width,
                             head_depth=head_depth)
    for name in W:
        if name.endswith("attn.qkv.weight"):
            W[name] = (W[name] * qkv_gain).astype(np.float32)
        elif name.startswith(R.HEAD) and any(key in name for key in ("cond_embed.", "adaLN_modulation.", ".mlp.")):
            W[name] = (W[name] * head_gain).astype(np.float32)
    return W


def model_loader(path, W, heads):
    """Writes W to path and returns load(diffusion_steps) -> a cached marcache model."""
    import marcache as mc

    save_file(W, str(path), metadata={"heads": str(heads)})
    models = {}

    def model(diffusion_steps):
        if diffusion_steps not in models:
            models[diffusion_steps] = mc.load(path, diffusion_steps=diffusion_steps)
        return models[diffusion_steps]

    return model


# The amplified tiny model both cache-reference tests run (test_lazymar_reference,
# test_marche_reference): decoder layers 0..4, so LazyMAR's select_layer 3 has one later
# layer and MARche's full_layers 2 or 3 leave 3 or 2 cache-aware layers; head res blocks
# 0..5, so blocks 1..4 are skippable and 0 and 5 reused or recomputed.
AMPLIFIED = dict(dim=16, depth=5, heads=2, head_width=16, head_depth=6, qkv_gain=10.0, head_gain=10.0)


def amplified_tiny(tmp_dir, seed=1):
    """(load(diffusion_steps) -> model, W): the AMPLIFIED model written under tmp_dir."""
    W = amplified_mar_weights(seed, **AMPLIFIED)
    return model_loader(tmp_dir / "tiny.safetensors", W, AMPLIFIED["heads"]), W

"""Tiny MAR models in the exact official key layout, written with the
safetensors package (an independent writer) for the engine tests."""
import numpy as np
from safetensors.numpy import save_file

from reference import mar as R
from child_env import child_env

TINY = dict(dim=32, depth=2, heads=2, head_width=32, head_depth=2)


def write_tiny_mar(path, seed=0, heads=2, metadata_heads=True, dim=32, depth=2, head_width=32, head_depth=2,
                   num_classes=1000, dtype=np.float32):
    rng = np.random.default_rng(seed)
    W = R.random_mar_weights(rng, dim=dim, depth=depth, heads_unused=heads, head_width=head_width,
                             head_depth=head_depth, num_classes=num_classes)
    meta = {"heads": str(heads)} if metadata_heads else None
    save_file({k: v.astype(dtype) for k, v in W.items()}, str(path), metadata=meta)
    return W


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


def v_dominant(W, eps_gain=0.0, cond_gain=1.0):
    """W with the head's eps outputs (rows 0..C-1 of final_layer.linear) scaled by
    eps_gain and its condition path (cond_embed, the final layer's adaLN) by cond_gain,
    for tests in which the learned variance v decides the tokens.

    Every token starts as x0 = 2.03e4 (x - eps) at the first DDPM step; with random eps
    that, and the eps of every later step, swamps the noise whose scale v sets (taking v
    from the wrong row moved the tokens by ~3e-8 of their largest value). With eps
    zeroed the eps terms are gone, and at a high temperature (comparisons.V_TEMPERATURE
    = 300) the noise, exp(v-interpolated log variance / 2) per step, is of the order of
    the tokens; cond_gain makes v differ between the conditional and unconditional rows
    so that guidance on v, or v from the wrong row, shows too."""
    out = dict(W)
    C = W["z_proj.weight"].shape[1]
    for name in (R.HEAD + "final_layer.linear.weight", R.HEAD + "final_layer.linear.bias"):
        t = np.array(W[name], dtype=np.float32)
        t[:C] *= np.float32(eps_gain)
        out[name] = t
    for name in (R.HEAD + "cond_embed.weight", R.HEAD + "final_layer.adaLN_modulation.1.weight"):
        out[name] = (np.asarray(W[name], np.float32) * np.float32(cond_gain)).astype(np.float32)
    return out


EMBEDDINGS = ("fake_latent", "encoder_pos_embed_learned", "mask_token", "decoder_pos_embed_learned",
              "diffusion_pos_embed_learned", "class_emb.weight")


def small_activations(W, scale=1e-2, fc1_gain=8.0):
    """W transformed so that every LayerNorm sees inputs of size ~scale (variance
    ~1e-4, where eps 1e-6 against 1e-5 changes the normalised output by ~4%, instead
    of the random model's variance 0.25-1, where eps hardly matters), and the GELU
    sees pre-activations of size ~1-3 (where erf- and tanh-GELU differ by ~1e-4 to
    1e-3; near 0 they agree to O(x^4)):

    * embeddings, z_proj, and the affine weights of z_proj_ln / encoder_norm times
      `scale` (the residual streams start ~scale);
    * attn.proj, mlp.fc2 (and biases) and decoder_embed times `scale`, so blocks add
      ~scale to the stream; norm1 / norm2 / decoder_norm keep weights ~1;
    * mlp.fc1 times fc1_gain;
    * the head's input_proj and res-block mlp.2 times `scale` (h ~scale for in_ln and
      the final layer's norm)."""
    out = {}
    small = lambda n: any(n == e for e in EMBEDDINGS) or n.startswith(("z_proj.", "z_proj_ln.", "encoder_norm.",
                                                                         "decoder_embed.")) \
        or ".attn.proj." in n or ".mlp.fc2." in n \
        or n.startswith(R.HEAD + "input_proj.") or (n.startswith(R.HEAD + "res_blocks.") and ".mlp.2." in n)
    for name, t in W.items():
        t = np.asarray(t, np.float32)
        if small(name):
            t = t * np.float32(scale)
        elif ".mlp.fc1.weight" in name:
            t = t * np.float32(fc1_gain)
        out[name] = t.astype(np.float32)
    return out


def save_bf16(W, path, metadata=None):
    """Writes W as a BF16 safetensors file (numpy has no bfloat16, so the safetensors
    package cannot): each float32 rounded to nearest even in bf16 (reference.ops.
    round_to_wtype), its top 16 bits stored. Returns the float32 values the file holds."""
    import json
    import struct

    from reference import ops

    header, chunks, offset, held = {}, [], 0, {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    for name, t in W.items():
        rounded = ops.round_to_wtype(np.asarray(t, np.float32), "bf16")
        held[name] = rounded
        data = (rounded.view(np.uint32) >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(rounded.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(chunks))
    return held


def guard_generate_json(path, policies, diffusion_steps=100, **kw):
    """Token lists of model.generate_tokens(cache=p, **kw) for each policy source text in
    `policies`, computed on the guard backend in a child Python (so a host read of device
    memory is a failing test, not a crash of the test process) that imports the same
    marcache as this one."""
    import json
    import os
    import subprocess
    import sys

    code = (f"import json, marcache as mc; m = mc.load({str(path)!r}, diffusion_steps={diffusion_steps}, "
            f"device='guard'); print(json.dumps([m.generate_tokens(cache=p, **{kw!r}).tolist() "
            f"for p in [{', '.join(policies)}]]))")
    env = child_env()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [np.array(t, np.float32) for t in json.loads(proc.stdout.strip().splitlines()[-1])]

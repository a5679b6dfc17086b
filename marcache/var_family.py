"""The VAR model family's FLOP model (spec var_fastvar.md Part E): one function per
block kind, 2 FLOPs per multiply-add, GEMMs and attention matmuls only (norms,
softmax, the per-head L2 normalisation, sampling, the bicubic / area resizes and
the Phi convolutions are not counted, as in the spec). The engine's telemetry
(csrc/runtime/flops.c) counts with the same rules; the tests hold the two equal.

Two conventions, which differ only in the adaLN modulation and word_embed:

- ``"engine"``: what marcache computes. The modulation vectors of every block
  (ada_lin: C -> 6C) and of the head (C -> 2C) depend only on the class, so they
  are computed once per run and per sequence, at the first scale; word_embed runs
  on the B image rows of a scale's input, which both CFG halves then share (as the
  official code does: it embeds, then repeats the rows).
- ``"spec"``: the spec's Part E tables (E1, E2). The modulation is counted at every
  scale (the official code recomputes it each scale) and word_embed on every
  sequence, both CFG halves.

The difference is exactly ``(n_scales - 1) * adaln(...)`` plus the word_embed of the
unconditional half; tests/test_var_api.py checks both sides.
"""
from dataclasses import dataclass, replace

FAMILY = "var"

#: The patch_nums of the released 256-px models (spec A1); files without the
#: ``patch_nums`` metadata use these.
DEFAULT_PATCH_NUMS = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)


def _released(depth):
    """build_vae_var's config for `depth` (spec A1): width 64 * depth, depth heads of 64."""
    width = 64 * depth
    return dict(depth=depth, width=width, heads=depth, head_dim=64, ffn_hidden=4 * width, vocab=4096,
                vae_channels=32, num_classes=1000, patch_nums=DEFAULT_PATCH_NUMS)


VAR_CONFIGS = {f"var_d{d}": _released(d) for d in (16, 20, 24, 30)}


# ---------------------------------------------------------------- blocks
def block_linear(rows, width, ffn_hidden):
    """The GEMMs of one transformer block on `rows` token rows: mat_qkv (C -> 3C), proj
    (C -> C) and the FFN (C -> hidden -> C): 2 * (3C^2 + C^2 + 2 C hidden) per row
    (24 C^2 with hidden = 4C, the spec's rule)."""
    return 2 * rows * width * 3 * width + 2 * rows * width * width + 4 * rows * width * ffn_hidden


def attention(n_seq, queries, keys, width):
    """q K^T and P V of one block: `queries` query rows per sequence against `keys`
    cached rows (the scale's own included): 4 n kv C per sequence."""
    return 4 * n_seq * queries * keys * width


def head(rows, width, vocab):
    """The output head (C -> vocab) on `rows` token rows."""
    return 2 * rows * width * vocab


def word_embed(rows, vae_channels, width):
    """word_embed (Cvae -> C) on `rows` token rows of a scale's input (scales >= 1)."""
    return 2 * rows * vae_channels * width


def adaln(n_seq, depth, width):
    """The adaLN modulation of one pass: every block's ada_lin (C -> 6C) and the head's
    (C -> 2C) on one row per sequence."""
    return 2 * n_seq * (depth * 6 * width * width + 2 * width * width)


def smooth(rows, vocab, vae_channels):
    """more_smooth's probabilities x codebook GEMM ([rows, vocab] x [vocab, Cvae]),
    which replaces the codebook lookup."""
    return 2 * rows * vocab * vae_channels


# ---------------------------------------------------------------- the model
def scale_tokens(patch_nums):
    """Tokens of each scale (pn^2)."""
    return [int(p) * int(p) for p in patch_nums]


def scale_begin(patch_nums):
    """Offset of each scale's first token in the L-token sequence."""
    out, total = [], 0
    for n in scale_tokens(patch_nums):
        out.append(total)
        total += n
    return out


def num_params(c):
    """Parameters of a VAR transformer of config `c` (spec A3; buffers excluded)."""
    C, hidden, L = c["width"], c["ffn_hidden"], sum(scale_tokens(c["patch_nums"]))
    embeddings = (c["vae_channels"] + 1) * C + (c["num_classes"] + 1) * C + C + L * C + len(c["patch_nums"]) * C
    block = (3 * C * C + 2 * C) + (C * C + C) + (hidden * C + hidden) + (C * hidden + C) + (6 * C * C + 6 * C) + \
        c["heads"]
    return embeddings + c["depth"] * block + (2 * C * C + 2 * C) + (c["vocab"] * C + c["vocab"])


def plain_blocks(c, n_seq, queries, keys):
    """(linear, attention) FLOPs of all blocks run on `queries` rows per sequence
    attending to `keys` rows: one scale of the uncached model."""
    depth, C = c["depth"], c["width"]
    return (depth * block_linear(n_seq * queries, C, c["ffn_hidden"]),
            depth * attention(n_seq, queries, keys, C))


@dataclass
class ScaleContext:
    """One scale as a cache policy's FLOP model sees it."""
    config: dict    # the model's hyper-parameters
    batch: int      # images B
    cfg_on: bool    # the unconditional half runs (cfg != 0)
    scale: int      # si
    n_scales: int
    tokens: int     # pn^2
    keys: int       # KV length after this scale: tokens of scales 0..si

    @property
    def n_seq(self):
        return (2 if self.cfg_on else 1) * self.batch


def scale_flops(ctx, policy, more_smooth=False, convention="engine"):
    """The FLOP breakdown of one scale: a dict with linear, attention (the policy's
    transformer), head, embed, adaln, smooth and total."""
    c = ctx.config
    C = c["width"]
    # a policy may run a scale without guidance (CfgFreeLate): the conditional half alone
    scale_cfg_on = getattr(policy, "scale_cfg_on", None)
    if scale_cfg_on is not None and ctx.cfg_on and not scale_cfg_on(ctx):
        ctx = replace(ctx, cfg_on=False)
    runs = getattr(policy, "runs_scale", None)
    if runs is not None and not runs(ctx.scale, ctx.n_scales):
        # a skipped scale (FastVAR's ratio 1) does no work at all (the telemetry's tokens and kv_rows are 0)
        out = dict(scale=ctx.scale, tokens=0, keys=0)
        out.update((k, 0.0) for k in ("linear", "attention", "head", "embed", "adaln", "smooth", "total"))
        return out
    linear, attn = policy.scale_flops(ctx)
    # a policy that shortens the K/V cache (FastVAR) says how long it is: the telemetry's kv_rows
    keys = policy.scale_keys(ctx) if hasattr(policy, "scale_keys") else ctx.keys
    spec = convention == "spec"
    embed_rows = (ctx.n_seq if spec else ctx.batch) * ctx.tokens if ctx.scale > 0 else 0
    parts = dict(linear=linear, attention=attn, head=head(ctx.n_seq * ctx.tokens, C, c["vocab"]),
                 embed=word_embed(embed_rows, c["vae_channels"], C),
                 adaln=adaln(ctx.n_seq, c["depth"], C) if spec or ctx.scale == 0 else 0,
                 smooth=smooth(ctx.batch * ctx.tokens, c["vocab"], c["vae_channels"]) if more_smooth else 0)
    total = sum(parts.values())  # integers: exact, then one rounding to float
    out = dict(scale=ctx.scale, tokens=ctx.tokens, keys=keys)
    out.update((k, float(v)) for k, v in parts.items())
    out["total"] = float(total)
    return out

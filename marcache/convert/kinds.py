"""The kinds ``convert`` knows (:data:`KINDS`) and :func:`plan`, which dispatches to
the kind's module."""
import collections

from .inception import plan_inception
from .mar import plan_mar
from .vae_kl16 import plan_vae_kl16
from .var import plan_var
from .vqvae import plan_vqvae


#: kind -> (plan function, expected source files, description)
KINDS = collections.OrderedDict([
    ("mar", (plan_mar, "checkpoint-last.pth", "MAR-B/L/H transformer + diffusion head; takes 'model_ema' "
                                              "(--weights model for the raw weights)")),
    ("vae-kl16", (plan_vae_kl16, "kl16.ckpt", "MAR's KL-16 VAE; keeps decoder.* and post_quant_conv.* "
                                              "(166 tensors), refuses LDM kl-f16 weights")),
    ("var", (plan_var, "var_d16.pth, var_d20.pth, var_d24.pth, var_d30.pth",
             "VAR transformer; drops the buffers lvl_1L, attn_bias_for_masking, zero_k_bias")),
    ("vqvae", (plan_vqvae, "vae_ch160v4096z32.pth", "VAR's VQVAE; keeps the 189 decoding tensors")),
    ("inception", (plan_inception, "pt_inception-2015-12-05-6726825d.pth",
                   "FID Inception-v3 of pytorch-fid / torch-fidelity (472 tensors)")),
])


def plan(kind, checkpoint, weights="model_ema", heads=None):
    """Selects and validates the tensors `kind` needs from an open :class:`Checkpoint`
    (or from any object with ``path`` and ``root``). Raises CheckpointError naming
    every missing, unexpected or wrongly shaped key."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    if kind == "mar":
        return plan_mar(checkpoint, weights=weights, heads=heads)
    if weights != "model_ema":
        raise ValueError(f"--weights applies to kind 'mar' only, not {kind!r}")
    if heads is not None:
        raise ValueError(f"--heads applies to kind 'mar' only, not {kind!r}")
    return KINDS[kind][0](checkpoint)

"""VARModel: the public API of a loaded VAR transformer and its VQVAE (spec
var_fastvar.md Parts A-B). Generation runs in the C engine (marcache._C.VAR) through
the one Python driver (marcache/_driver.py), as MARModel's does."""
import math
import numbers

import numpy as np

from . import _C
from . import _driver
from . import var_family
from .model import GenerationInfo, LoadedModel, is_int as _is_int
from .policies import resolve as _resolve_cache


def _is_real(value):
    return isinstance(value, (numbers.Real, np.floating, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_generate_arguments(cfg, top_k, top_p, more_smooth, seed, first_index, n_images):
    """The sampling arguments of VARModel.generate, checked (a ValueError naming the
    argument, its accepted range and the value otherwise)."""
    if not _is_real(cfg) or not math.isfinite(float(cfg)) or cfg < 0:
        raise ValueError(f"cfg must be a finite number >= 0 (0 turns guidance off), got {cfg!r}")
    if not _is_int(top_k) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 keeps every token), got {top_k!r}")
    if not _is_real(top_p) or not 0.0 <= float(top_p) <= 1.0:
        raise ValueError(f"top_p must be a number in [0, 1] (0 or 1 keeps every token), got {top_p!r}")
    if not isinstance(more_smooth, (bool, np.bool_)):
        raise ValueError(f"more_smooth must be True or False, got {more_smooth!r}")
    if not _is_int(seed) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an integer in 0..2**64-1, got {seed!r}")
    if not _is_int(first_index) or first_index < 0 or first_index + n_images > 2**32:
        raise ValueError(f"first_index must be an integer >= 0 with first_index + N <= 2**32, got {first_index!r}")


class VARModel(LoadedModel):
    """A loaded VAR transformer and (optionally) its VQVAE.

    Use marcache.load("var_d16.safetensors", vae="vqvae.safetensors") to build one.
    The VQVAE is needed to generate (its codebook and Phi convolutions drive the
    scale loop) and to decode; without it only the transformer components run.
    Generation runs in C with the GIL released; Ctrl-C stops it between scales and
    the model stays usable.
    """

    family = var_family.FAMILY

    def __init__(self, var, vqvae=None, path=None, vae_path=None, device="cpu", dtype="fp32"):
        super().__init__(path, vae_path, device, dtype)
        self._var, self._vqvae = var, vqvae  # the _C.VAR and its _C.VQVAE (or None)

    # ----------------------------------------------------------- facts
    @property
    def config(self):
        """Hyper-parameters read back from the checkpoint shapes and metadata."""
        c = dict(self._var.config)
        c["patch_nums"] = tuple(int(p) for p in c["patch_nums"])
        return c

    @property
    def vqvae_config(self):
        """The VQVAE's hyper-parameters (None without a VQVAE)."""
        return None if self._vqvae is None else dict(self._vqvae.config)

    @property
    def num_params(self):
        """Parameters of the transformer (buffers excluded; the VQVAE has its own count)."""
        return self._var.num_params

    @property
    def patch_nums(self):
        return self.config["patch_nums"]

    @property
    def num_scales(self):
        return len(self.patch_nums)

    @property
    def tokens(self):
        """L: tokens of all scales together."""
        return sum(p * p for p in self.patch_nums)

    def __repr__(self):
        c = self.config
        return (f"VARModel(depth={c['depth']}, width={c['width']}, heads={c['heads']}, vocab={c['vocab']}, "
                f"patch_nums={','.join(map(str, c['patch_nums']))}, classes={c['num_classes']}, "
                f"params={self.num_params:,}, decoder={'vqvae' if self._vqvae is not None else 'none'}, "
                f"device={self.device!r}, dtype={self.dtype!r})")

    # ----------------------------------------------------------- arguments
    # _labels (LoadedModel): labels=None runs the null class (num_classes) on the
    # conditional half too (unconditional).

    def _need_vqvae(self, what):
        if self._vqvae is None:
            raise ValueError(f"{what} needs the VQVAE (its codebook and Phi convolutions): pass "
                             f"vae='vqvae.safetensors' to marcache.load")

    # ----------------------------------------------------------- generation
    def generate_tokens(self, labels=None, cfg=1.5, top_k=900, top_p=0.96, more_smooth=False, seed=0,
                        first_index=0, cache=None, progress=False, num_images=None, return_info=False):
        """Like generate() but returns (tokens int32 [N, L], f_hat float32 [N, side, side, Cvae])
        instead of images: the sampled codebook index of every token of every scale
        (scale by scale, raster order inside a scale) and the VQVAE's accumulated latent
        (side = the last patch num). With return_info=True: (tokens, f_hat, info)."""
        self._need_vqvae("VAR generation")
        label_arr = self._labels(labels, num_images)
        check_generate_arguments(cfg, top_k, top_p, more_smooth, seed, first_index, label_arr.size)
        cache = _resolve_cache(cache, family=var_family.FAMILY)
        if hasattr(cache, "check_model"):
            cache.check_model(self.config)
        (tokens, f_hat), step_infos, seconds = _driver.run(
            self._var.generate, self.num_scales, progress, desc="VAR", labels=label_arr, vqvae=self._vqvae,
            cfg=float(cfg), top_k=int(top_k), top_p=float(top_p), more_smooth=bool(more_smooth), seed=int(seed),
            first_index=int(first_index), cache=cache.as_dict())
        if return_info:
            info = GenerationInfo(steps=step_infos, tokens=tokens, seconds_transformer_and_head=seconds,
                                  seconds_decode=0.0, flops=float(sum(s["flops"] for s in step_infos)), f_hat=f_hat)
            return tokens, f_hat, info
        return tokens, f_hat

    def generate(self, labels=None, cfg=1.5, top_k=900, top_p=0.96, more_smooth=False, seed=0, first_index=0,
                 cache=None, progress=False, return_info=False, num_images=None):
        """Generates images: uint8 [N, H, W, 3] (H = W = last patch num x the VQVAE's upscale).

        The defaults are the README's FID recipe of the official code (cfg 1.5, top_k
        900, top_p 0.96, more_smooth off). Guidance at scale si is t = cfg * si /
        (scales - 1); cfg=0 runs the conditional half alone. top_k=0 and top_p in {0, 1}
        switch those filters off (top_k >= vocab keeps every token). more_smooth=True is
        the official visualisation mode (Gumbel-softmax mixing of codewords), not for FID.
        Image j of a call is image first_index + j of the seed's sequence: the same
        tokens whatever the batch it is generated in (pixels within float32 rounding).
        labels=None with num_images=N uses the
        null class. With return_info=True returns (images, GenerationInfo): one step dict
        per scale. progress=True shows a tqdm bar of the scales; "auto" only on a terminal.
        """
        tokens, f_hat, info = self.generate_tokens(labels, cfg=cfg, top_k=top_k, top_p=top_p,
                                                   more_smooth=more_smooth, seed=seed, first_index=first_index,
                                                   cache=cache, progress=progress, num_images=num_images,
                                                   return_info=True)
        return self._decoded(f_hat, info, return_info)

    # ----------------------------------------------------------- components
    def _fhat_of(self, tokens_or_fhat):
        """f_hat float32 [N, side, side, Cvae] of tokens int [N, L] or of an f_hat."""
        arr = np.asarray(tokens_or_fhat)
        side, z = self.patch_nums[-1], self.config["vae_channels"]
        if np.issubdtype(arr.dtype, np.integer):
            return self.fhat_from_tokens(arr)
        if arr.ndim != 4 or arr.shape[1:] != (side, side, z):
            raise ValueError(f"decode takes tokens int [N, {self.tokens}] or f_hat float [N, {side}, {side}, {z}], "
                             f"got {arr.dtype} {arr.shape}")
        return np.ascontiguousarray(arr, np.float32)

    def fhat_from_tokens(self, tokens):
        """The VQVAE's f_hat [N, side, side, Cvae] of tokens int [N, L] (the scale loop's
        residual accumulation: codebook lookup, bicubic up-sampling, Phi)."""
        self._need_vqvae("fhat_from_tokens")
        arr = np.asarray(tokens)
        vocab = self.config["vocab"]
        if arr.ndim != 2 or arr.shape[1] != self.tokens or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"tokens must be integers [N, {self.tokens}], got {arr.dtype} {arr.shape}")
        if arr.size and (arr.min() < 0 or arr.max() >= vocab):
            raise ValueError(f"tokens must be codebook indices in 0..{vocab - 1}, got {int(arr.min())}.."
                             f"{int(arr.max())}")
        arr = np.ascontiguousarray(arr, np.int32)
        begin = var_family.scale_begin(self.patch_nums)
        per_scale = [np.ascontiguousarray(arr[:, b:b + p * p]) for b, p in zip(begin, self.patch_nums)]
        return self._vqvae.idx_to_fhat(per_scale, list(self.patch_nums))

    def decode_float(self, tokens_or_fhat):
        """The VQVAE decoder on tokens int [N, L] or f_hat float32 [N, side, side, Cvae]:
        float32 images [N, H, W, 3] in [-1, 1]."""
        self._need_vqvae("decoding")
        return self._vqvae.decode(self._fhat_of(tokens_or_fhat))

    def decode(self, tokens_or_fhat):
        """uint8 images [N, H, W, 3] of tokens int [N, L] or f_hat float32 [N, side,
        side, Cvae]: round half to even of (x + 1) / 2 * 255, as MAR's decode."""
        self._need_vqvae("decoding")
        return self._vqvae.decode_uint8(self._fhat_of(tokens_or_fhat))

    def scale_inputs(self, labels, next_maps):
        """The transformer's input rows of scales 0..k for labels int [B] (num_classes, the
        null class, allowed) and the next-scale maps of scales 1..k (the area-resized
        f_hat): either float32 [B, T, Cvae] (T = the tokens of scales 1..k, raster order
        scale by scale; T = 0 for scale 0 alone) or a list of float32 [B, pn, pn, Cvae],
        one per scale 1..k. Returns float32 [B, L_k, C]: scale 0 is sos + pos_start +
        lvl_pos, scale si > 0 word_embed(map) + lvl_pos."""
        labels = np.ascontiguousarray(labels, np.int32)
        if isinstance(next_maps, (list, tuple)):
            z = self.config["vae_channels"]
            maps = [np.asarray(m, np.float32) for m in next_maps]
            for i, m in enumerate(maps):
                if m.ndim != 4 or m.shape[0] != labels.size or m.shape[1] != m.shape[2] or m.shape[3] != z:
                    raise ValueError(f"next_maps[{i}] must be float32 [{labels.size}, pn, pn, {z}], got {m.shape}")
            next_maps = (np.concatenate([m.reshape(labels.size, -1, z) for m in maps], axis=1) if maps
                         else np.zeros((labels.size, 0, z), np.float32))
        return self._var.scale_inputs(labels, np.ascontiguousarray(next_maps, np.float32))

    def forward_scales(self, labels, inputs, cache=None, trace=False):
        """The KV-cached scale loop on given inputs: labels int32 [B'] (num_classes = the
        null class), inputs float32 [B', L_k, C] (scales 0..k concatenated) -> (hidden
        [B', L_k, C], logits [B', L_k, vocab]) with no guidance and no sampling.

        cache: a VAR cache policy (None: NoCache) whose transformer runs each scale, the
        B' sequences being one run's sequences without guidance: with
        ``FastVAR(...)`` this is the pruned forward, scale by scale (inputs covering a
        scale the policy skips are refused). trace=True adds a third item, per scale an
        int32 array [depth, 2, B', pn * pn]: the rows each block's attention (0) and FFN
        (1) ran on for each sequence, ascending, then -1 (every row where a sublayer ran
        in full; FastVAR's kept rows where it pruned)."""
        policy = _resolve_cache(cache, family=var_family.FAMILY)
        if hasattr(policy, "check_model"):
            policy.check_model(self.config)
        return self._var.forward_scales(np.ascontiguousarray(labels, np.int32),
                                        np.ascontiguousarray(inputs, np.float32),
                                        cache=None if cache is None else policy.as_dict(), trace=bool(trace))

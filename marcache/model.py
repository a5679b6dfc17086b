"""The public model API: load(), MARModel.generate() and component entry points."""
import numbers
import os
import time
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

from . import _C
from . import _driver
from .policies import resolve as _resolve_cache


# What `python -m marcache convert` calls each kind of file a loader takes: the model
# (MAR or VAR) and the vae= file (MAR's KL-16 VAE or VAR's VQVAE).
_CONVERT_KIND = {"model": ("mar", "var"), "VAE": ("vae-kl16", "vqvae")}


def _check_path(path, what):
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} file not found: {path}")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{what} path is a directory, expected a .safetensors file: {path}")
    with open(path, "rb") as f:
        head = f.read(9)
    # torch.save writes a zip (PK\x03\x04) since PyTorch 1.6 and a pickle stream (PROTO
    # opcode \x80, protocol 2..5) before; read as safetensors, either gives a nonsense header
    # length. A safetensors file has its JSON header's "{" at byte 8, which tells it apart
    # from a pickle whose first bytes happen to read as a small header length.
    pickled = head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05") and head[8:9] != b"{"
    if head[:4] == b"PK\x03\x04" or pickled:
        kind, other = _CONVERT_KIND.get(what, ("<kind>", None))
        raise ValueError(f"{what} {path} is a PyTorch checkpoint (torch.save), not a safetensors file: convert "
                         f"it first, without PyTorch: python -m marcache convert {kind} {path} -o "
                         f"{os.path.splitext(os.path.basename(path))[0]}.safetensors"
                         + (f" (kind {other} for VAR's file)" if other else ""))
    return path


# Backends the models (MAR, VAE, Inception) run on. "guard" is the CPU backend over
# memory the host cannot touch between ops: a test device that proves the model and
# cache code keep host and device memory apart (see csrc/backend/guard/).
_MODEL_BACKENDS = ("cpu", "cuda", "guard")


def _resolve_device(device):
    """The backend name for _C ("cpu", "guard", "cuda:N") of a user's device argument."""
    backends = _C.backends() if hasattr(_C, "backends") else ["cpu"]
    if device == "auto":
        return "cuda:0" if "cuda" in backends else "cpu"
    if device in ("cpu", "guard"):
        return device
    if isinstance(device, str) and (device == "cuda" or device.startswith("cuda:")):
        index = device[5:] if device != "cuda" else "0"
        if not index.isdigit():
            raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {device!r}")
        if "cuda" not in backends:
            build = _C.build_info()
            why = ("this build of marcache has no CUDA backend (rebuild with MARCACHE_CUDA=1 where nvcc is "
                   "installed)" if not build.get("cuda") else "no CUDA device is visible")
            raise ValueError(f"device={device!r}: {why}; use device='cpu' or 'auto'")
        count = int(_C.build_info().get("cuda_devices", 0))
        if int(index) >= count:
            raise ValueError(f"device={device!r}: {count} CUDA device{'s' if count != 1 else ''} found")
        return f"cuda:{int(index)}"
    raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {device!r}")


@dataclass
class GenerationInfo:
    """Telemetry of one generate call: one dict per step (a MAR AR step, a VAR scale)."""
    steps: List[dict]
    tokens: np.ndarray
    seconds_transformer_and_head: float
    seconds_decode: float
    flops: float = field(default=0.0)
    f_hat: Optional[np.ndarray] = field(default=None, repr=False)  # VAR: the VQVAE latent decoded

    @property
    def seconds(self):
        return self.seconds_transformer_and_head + self.seconds_decode

    @property
    def phases(self):
        """Where the generation's work went, for a MAR model: {"encoder", "decoder", "head",
        "other"} -> {"seconds", "flops", "weight_bytes", "gflops_per_s", "gb_per_s"}, summed
        over the steps. encoder and decoder are their transformer blocks, head the diffusion
        head's sampling (its condition embedding and every diffusion step), other the rest
        of the steps (embeddings, output rows, the cache policy's bookkeeping; no decode).
        flops: GEMMs and attention matmuls (marcache.flops's rules); weight_bytes: the
        Linear weight matrices streamed (each once per call), in the stored dtype, so
        gb_per_s against a measured sgemv bandwidth says how close a small-batch phase is
        to the memory floor, and gflops_per_s against the sgemm rate how close a large one
        is to the arithmetic floor (benchmarks/bench_cpu.py prints both). Seconds are host
        time, which on a GPU is only the enqueueing: there seconds, and the rates, are None.
        None for a VAR model (its steps are scales, with no such phases)."""
        if not self.steps or "phases" not in self.steps[0]:
            return None
        out = {}
        for name in ("encoder", "decoder", "head"):
            parts = [s["phases"][name] for s in self.steps]
            timed = all(p["seconds"] is not None for p in parts)
            out[name] = dict(seconds=sum(p["seconds"] for p in parts) if timed else None,
                             flops=float(sum(p["flops"] for p in parts)),
                             weight_bytes=float(sum(p["weight_bytes"] for p in parts)))
        timed = out["head"]["seconds"] is not None
        rest = sum(s["seconds"] for s in self.steps) - sum(out[n]["seconds"] for n in ("encoder", "decoder", "head")) \
            if timed else None
        out["other"] = dict(seconds=rest, flops=self.flops - sum(out[n]["flops"] for n in ("encoder", "decoder", "head")),
                            weight_bytes=None)
        for phase in out.values():
            sec = phase["seconds"]
            phase["gflops_per_s"] = phase["flops"] / sec / 1e9 if sec else None
            phase["gb_per_s"] = phase["weight_bytes"] / sec / 1e9 if sec and phase["weight_bytes"] else None
        return out


class PixelDecoder:
    """The decoder of a pixel-token MAR (the shipped digits model): the identity "VAE".

    A token is a patch_size x patch_size patch of an image_size x image_size image with
    `channels` channels, laid out as MAR's patchify (feature = channel * p^2 + row * p +
    column); pixel value = token * scale + offset on the 0..255 scale. The model file
    declares it in its ``__metadata__``: decoder = "pixels", image_size, patch_size,
    image_channels, pixel_scale, pixel_offset."""

    def __init__(self, image_size, patch_size, channels, scale, offset):
        self.image_size, self.patch_size, self.channels = image_size, patch_size, channels
        self.scale, self.offset = scale, offset

    @classmethod
    def from_metadata(cls, metadata, config, path):
        def number(key, kind):
            if key not in metadata:
                raise ValueError(f"{path}: decoder='pixels' needs metadata {key!r}")
            try:
                value = kind(metadata[key])
            except ValueError:
                raise ValueError(f"{path}: metadata {key}={metadata[key]!r} is not a {kind.__name__}") from None
            if not (value > 0 if kind is int else np.isfinite(value)):
                raise ValueError(f"{path}: metadata {key}={metadata[key]!r} is out of range")
            return value

        size, patch, ch = number("image_size", int), number("patch_size", int), number("image_channels", int)
        grid = size // patch
        if size % patch or grid * grid != config["seq_len"] or ch * patch * patch != config["token_channels"]:
            raise ValueError(f"{path}: pixel decoder metadata (image_size={size}, patch_size={patch}, "
                             f"image_channels={ch}) does not fit the model's {config['seq_len']} tokens of "
                             f"{config['token_channels']} values")
        return cls(size, patch, ch, number("pixel_scale", float), number("pixel_offset", float))

    def _pixels(self, tokens):
        t = np.asarray(tokens, np.float32)
        n, g, p, c = t.shape[0], self.image_size // self.patch_size, self.patch_size, self.channels
        if t.ndim != 3 or t.shape[1:] != (g * g, c * p * p):
            raise ValueError(f"tokens must have shape [N, {g * g}, {c * p * p}], got {t.shape}")
        x = t.reshape(n, g, g, c, p, p).transpose(0, 1, 4, 2, 5, 3).reshape(n, g * p, g * p, c)
        return x * np.float32(self.scale) + np.float32(self.offset)

    def decode_uint8(self, tokens):
        x = np.rint(np.clip(self._pixels(tokens), 0.0, 255.0)).astype(np.uint8)
        return np.repeat(x, 3, axis=3) if self.channels == 1 else x

    def decode(self, tokens):
        """Float images in [-1, 1] nominally (pixel / 127.5 - 1), as the VAE's decode."""
        return self._pixels(tokens) / np.float32(127.5) - np.float32(1.0)


def is_int(value):
    """An integer (Python or NumPy), not a bool."""
    return isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value, (bool, np.bool_))


class LoadedModel:
    """What MARModel and VARModel share: the files they were loaded from, the device and
    weight dtype, and the checking of class labels against the model's classes."""

    def __init__(self, path, vae_path, device, dtype):
        self.path, self.vae_path = path, vae_path
        self.device, self.dtype = device, dtype

    def _labels(self, labels, num_images):
        """int32 [N] class ids in 0..num_classes-1; labels=None with num_images=N gives N
        times -1, which each engine runs as unconditional generation."""
        n_classes = self.config["num_classes"]
        if labels is None:
            if num_images is None:
                raise ValueError("unconditional generation needs num_images=N (labels=None)")
            if not is_int(num_images) or num_images < 1:
                raise ValueError(f"num_images must be an integer >= 1, got {num_images!r}")
            return np.full(int(num_images), -1, dtype=np.int32)
        arr = np.asarray(labels)
        if arr.ndim == 0:
            arr = arr.reshape(1)
        if arr.size == 0:
            raise ValueError("labels is empty: pass at least one class label, or labels=None with num_images=N")
        if arr.ndim != 1:
            raise ValueError(f"labels must be a 1-D list of class indices, got shape {arr.shape}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"labels must be integers, got dtype {arr.dtype}")
        bad = (arr < 0) | (arr >= n_classes)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"label {int(arr[i])} at index {i} is outside 0..{n_classes - 1} "
                             f"(the model has {n_classes} classes)")
        if num_images is not None and (not is_int(num_images) or int(num_images) != arr.size):
            raise ValueError(f"num_images={num_images!r} does not match {arr.size} labels")
        return arr.astype(np.int32)

    def _decoded(self, latent, info, return_info):
        """generate()'s images: decode(latent), its time in info.seconds_decode; with
        return_info, (images, info)."""
        t0 = time.perf_counter()
        images = self.decode(latent)
        info.seconds_decode = time.perf_counter() - t0
        return (images, info) if return_info else images


class MARModel(LoadedModel):
    """A loaded MAR model (and optionally its KL-16 VAE decoder).

    Use marcache.load() to build one. Generation runs in C with the GIL
    released; Ctrl-C stops it within one AR step and the model stays usable.
    A pixel-token model (decoder = "pixels" in its metadata, like the shipped
    digits model) decodes without a VAE.
    """

    family = "mar"

    def __init__(self, mar, vae=None, path=None, vae_path=None, device="cpu", dtype="fp32"):
        super().__init__(path, vae_path, device, dtype)
        self._mar, self._vae = mar, vae  # the _C.MAR and its decoder (_C.VAE, PixelDecoder or None)

    @property
    def config(self):
        """Hyper-parameters read back from the checkpoint shapes."""
        return dict(self._mar.config)

    @property
    def num_params(self):
        return self._mar.num_params

    @property
    def timesteps(self):
        """Original diffusion timesteps tau_j (j = 0..n-1) the head is evaluated at."""
        return list(self._mar.timesteps)

    def __repr__(self):
        c = self._mar.config
        return (f"MARModel(width={c['width']}, depth={c['depth']}+{c['decoder_depth']}, heads={c['heads']}, "
                f"head={c['head_depth']}x{c['head_width']}, params={self.num_params:,}, "
                f"decoder={self._decoder_name()}, device={self.device!r}, dtype={self.dtype!r})")

    def _decoder_name(self):
        if isinstance(self._vae, PixelDecoder):
            return "pixels"
        return "kl16" if self._vae is not None else "none"

    # ----------------------------------------------------------- generation
    def generate_tokens(self, labels=None, steps=64, cfg=1.0, cfg_schedule="linear", temperature=1.0, seed=0,
                        first_index=0, cache=None, progress=False, num_images=None, return_info=False,
                        trace_rows=False):
        """Like generate() but returns the latent tokens [N, S, C] instead of images.

        trace_rows=True adds to each cached step's telemetry the decoder rows a cache
        policy kept (LazyMAR) or made active (MARche): int32 [sequences, rows], ascending."""
        label_arr = self._labels(labels, num_images)
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or not 1 <= steps <= 2**31 - 1:
            raise ValueError(f"steps must be an integer in 1..2**31-1, got {steps!r}")
        if not np.isfinite(cfg) or cfg < 0:
            raise ValueError(f"cfg must be a finite number >= 0, got {cfg!r}")
        if not np.isfinite(temperature) or temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        if cfg_schedule not in ("linear", "constant"):
            raise ValueError(f"cfg_schedule must be 'linear' or 'constant', got {cfg_schedule!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**64:
            raise ValueError(f"seed must be an integer in 0..2**64-1, got {seed!r}")
        if not isinstance(first_index, (int, np.integer)) or not 0 <= first_index or \
                first_index + label_arr.size > 2**32:
            raise ValueError(f"first_index must be an integer >= 0 with first_index + N <= 2**32, got {first_index!r}")
        cache = _resolve_cache(cache, family="mar")
        cache.check_model(self._mar.config)
        rows = self._mar.config["buffer_size"] + self._mar.config["seq_len"]
        tokens, step_infos, seconds = _driver.run(
            self._mar.generate, steps, progress, desc="MAR", labels=label_arr, steps=int(steps), cfg=float(cfg),
            cfg_schedule=cfg_schedule, temperature=float(temperature), seed=int(seed), first_index=int(first_index),
            cache=cache.as_dict(rows=rows), trace_rows=bool(trace_rows))
        if return_info:
            info = GenerationInfo(steps=step_infos, tokens=tokens, seconds_transformer_and_head=seconds,
                                  seconds_decode=0.0, flops=float(sum(s["flops"] for s in step_infos)))
            return tokens, info
        return tokens

    def generate(self, labels=None, steps=64, cfg=1.0, cfg_schedule="linear", temperature=1.0, seed=0,
                 first_index=0, cache=None, progress=False, return_info=False, num_images=None):
        """Generates images: uint8 [N, H, W, 3].

        Image j of a call is image first_index + j of the seed's sequence, the
        same whatever the batch it is generated in (so a sweep can be split
        into shards). labels=None with num_images=N generates unconditionally.
        With return_info=True returns (images, GenerationInfo). progress=True shows a
        tqdm bar of the AR steps; progress="auto" shows it only when stderr is a terminal.
        """
        if self._vae is None:
            raise ValueError("this model was loaded without a VAE: pass vae='kl16.safetensors' to marcache.load, "
                             "or call generate_tokens() for latent tokens")
        tokens, info = self.generate_tokens(labels, steps=steps, cfg=cfg, cfg_schedule=cfg_schedule,
                                            temperature=temperature, seed=seed, first_index=first_index,
                                            cache=cache, progress=progress, num_images=num_images,
                                            return_info=True)
        return self._decoded(tokens, info, return_info)

    # ----------------------------------------------------------- components
    def transformer(self, tokens, mask, labels):
        """Encoder + decoder: tokens [B, S, C], mask [B, S] (True = unknown), labels [B] (-1 = unconditional)
        -> condition vectors z [B, S, Dd]. Every row must have the same number of known tokens."""
        return self._mar.transformer(np.ascontiguousarray(tokens, np.float32),
                                     np.ascontiguousarray(mask, np.uint8),
                                     np.ascontiguousarray(labels, np.int32))

    def head(self, x, z, timestep_index):
        """One diffusion-head evaluation (no CFG): x [N, C], z [N, Dd] at timesteps[timestep_index] -> [N, 2C]."""
        return self._mar.head(np.ascontiguousarray(x, np.float32), np.ascontiguousarray(z, np.float32),
                              int(timestep_index))

    def head_sample(self, z, images, positions, cfg=1.0, temperature=1.0, seed=0):
        """The 100-step DDPM head sampler on rows identified by (image index, token position).
        With cfg != 1, z holds the n conditional rows followed by the n unconditional rows."""
        return self._mar.head_sample(np.ascontiguousarray(z, np.float32), np.ascontiguousarray(images, np.uint32),
                                     np.ascontiguousarray(positions, np.uint32), cfg=float(cfg),
                                     temperature=float(temperature), seed=int(seed))

    def decode(self, tokens):
        """Decode of tokens [N, S, C] (KL-16 VAE, or the pixel decoder) -> uint8 images [N, H, W, 3]."""
        if self._vae is None:
            raise ValueError("this model was loaded without a VAE: pass vae= to marcache.load")
        return self._vae.decode_uint8(np.ascontiguousarray(tokens, np.float32))

    def decode_float(self, tokens):
        """Decode to float images [N, H, W, channels], nominally in [-1, 1]."""
        if self._vae is None:
            raise ValueError("this model was loaded without a VAE: pass vae= to marcache.load")
        return self._vae.decode(np.ascontiguousarray(tokens, np.float32))


# What each `kind` written by `marcache convert` holds (marcache/convert/kinds.py KINDS).
_KIND_DESCRIPTIONS = {
    "mar": "a MAR model",
    "vae-kl16": "a KL-16 VAE decoder",
    "var": "a VAR transformer",
    "vqvae": "VAR's VQVAE decoder",
    "inception": "the FID Inception network",
}


def file_kind(path):
    """The model kind recorded in a safetensors file's ``__metadata__`` by
    ``marcache convert`` ("mar", "vae-kl16", "var", "vqvae", "inception"), or
    None for files without it (the loaders then recognise the kind from the
    tensor names)."""
    _, metadata = _C.safetensors_info(os.fspath(path))
    kind = metadata.get("kind")
    if kind is not None and kind not in _KIND_DESCRIPTIONS:
        raise ValueError(f"{path}: metadata kind={kind!r} is not one marcache knows "
                         f"({', '.join(_KIND_DESCRIPTIONS)})")
    return kind


def _kind_from_names(path):
    """The kind a file without ``kind`` metadata holds, told from its tensor names
    where the MAR loader cannot: VAR's transformer (pos_1LC, word_embed, lvl_embed) and
    its VQVAE (quantize.embedding.weight); a KL-16 VAE (decoder.* alone) and a MAR
    (diffloss.*) too, for the messages of the VAR path. None if none matches."""
    names = {name for name, _, _ in _C.safetensors_info(os.fspath(path))[0]}
    if names & {"pos_1LC", "word_embed.weight", "lvl_embed.weight"}:
        return "var"
    if "quantize.embedding.weight" in names:
        return "vqvae"
    if any(n.startswith("diffloss.") for n in names):
        return "mar"
    if "decoder.conv_in.weight" in names:
        return "vae-kl16"
    return None


def _file_kind_and_source(path):
    """(kind, how it was told): the metadata's kind, else VAR / VQVAE tensor names
    (MAR, KL-16 and Inception files without metadata are left to the C loaders,
    whose messages name what they found)."""
    kind = file_kind(path)
    if kind is not None:
        return kind, f"metadata kind={kind!r}, written by marcache convert"
    kind = _kind_from_names(path)
    if kind in ("var", "vqvae"):
        return kind, "recognised from its tensor names"
    return None, None


# What to do with a file of each kind passed in the wrong place.
_WHERE_IT_GOES = {
    "mar": "pass it as the model path, with its KL-16 VAE as vae=",
    "var": "pass it as the model path, with its VQVAE as vae=",
    "vae-kl16": "pass it as vae=... (--vae) together with a MAR model file",
    "vqvae": "pass it as vae=... (--vae) together with a VAR model file",
    "inception": "it is the FID network: marcache.eval.InceptionV3.load (fid --inception)",
}


def _check_kind(path, want, role, kind=None, source=None):
    """A ValueError when `path` (passed as `role`) holds another kind than `want`
    (one kind or a tuple); files whose kind is unknown pass (their loader checks them)."""
    if kind is None:
        kind, source = _file_kind_and_source(path)
    wants = (want,) if isinstance(want, str) else tuple(want)
    if kind is None or kind in wants:
        return
    expected = " or ".join(_KIND_DESCRIPTIONS[w] for w in wants)
    raise ValueError(f"{role} {path} is {_KIND_DESCRIPTIONS[kind]} file ({source}), not {expected}: "
                     f"{_WHERE_IT_GOES[kind]}")


def load(path, vae=None, device="cpu", dtype="fp32", heads=None, diffusion_steps=None, threads=0):
    """Loads a model file (MAR or VAR, converted from the official checkpoint) and its decoder.

    The kind of each file is taken from its ``__metadata__`` ``kind`` (written by
    ``marcache convert``), or else from its tensor names: a VAR transformer (pos_1LC,
    word_embed, class_emb, ...) gives a VARModel, a MAR a MARModel. vae= is the KL-16
    VAE for a MAR and the VQVAE for a VAR; a decoder of the other family, or a model
    file passed as vae=, is refused with a ValueError saying where it goes.

    device: "cpu", "auto" (CUDA device 0 when built and present, else CPU) or "cuda[:N]".
      The model and its decoder are uploaded once to that device.
    dtype: the type of the weights of every Linear layer of the transformer, "fp32", "bf16" or
      "fp16". With a 16-bit type each Linear and each attention runs as PyTorch's autocast
      does: Linear inputs, q, k, v and the attention probabilities are rounded to the 16-bit
      type and products are summed in float32 (attention where the head dim is a multiple of
      16); norms, softmax, the head's DDPM update and the VAE stay float32. On the GPU this
      uses the tensor cores. On the CPU a Linear of at most 32 rows (the diffusion head at
      small batches) streams the 16-bit weights and widens them in registers, faster than
      fp32; larger ones (the transformer) widen first and are slower than fp32.
    heads: MAR only: attention heads, for non-standard widths (the released 768/1024/1280
      configs are known; VAR reads its heads from the checkpoint shapes).
    diffusion_steps: MAR only: the head's DDPM steps (default 100).
    """
    path = _check_path(path, "model")
    vae_path = _check_path(vae, "VAE") if vae is not None else None
    device = _resolve_device(device)
    if dtype not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"dtype must be 'fp32', 'bf16' or 'fp16', got {dtype!r}")
    if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1):
        raise ValueError(f"heads must be a positive integer, got {heads!r}")
    if diffusion_steps is not None and (isinstance(diffusion_steps, bool) or not isinstance(diffusion_steps, int)
                                        or not 1 <= diffusion_steps <= 1000):
        raise ValueError(f"diffusion_steps must be an integer in 1..1000, got {diffusion_steps!r}")
    kind, source = _file_kind_and_source(path)
    if kind == "var":
        if heads is not None:
            raise ValueError(f"heads={heads!r} applies to MAR models only: {path} is a VAR transformer, whose "
                             f"heads are read from its shapes (scale_mul_1H11)")
        if diffusion_steps is not None:
            raise ValueError(f"diffusion_steps applies to MAR models only: {path} is a VAR transformer")
        return _load_var(path, vae_path, device, dtype, threads)
    _check_kind(path, ("mar", "var"), "model", kind, source)
    if vae_path is not None:
        _check_kind(vae_path, "vae-kl16", "vae=")
    _, metadata = _C.safetensors_info(path)
    decoder = metadata.get("decoder")
    if decoder not in (None, "pixels"):
        raise ValueError(f"{path}: metadata decoder={decoder!r} is not one marcache knows ('pixels')")
    if decoder == "pixels" and vae_path is not None:
        raise ValueError(f"{path} is a pixel-token model (metadata decoder='pixels'): it decodes without a VAE, "
                         f"do not pass vae=")
    mar = _C.MAR(path, heads=heads or 0, diffusion_steps=100 if diffusion_steps is None else diffusion_steps,
                 threads=int(threads), device=device, dtype=dtype)
    if decoder == "pixels":
        vae_obj = PixelDecoder.from_metadata(metadata, dict(mar.config), path)
    else:
        # The decoder runs in the model's dtype, as the official code decodes under its autocast.
        vae_obj = _C.VAE(vae_path, num_threads=int(threads), device=device, dtype=dtype) \
            if vae_path is not None else None
    return MARModel(mar, vae_obj, path=path, vae_path=vae_path, device=device, dtype=dtype)


def _tensor_shapes(path):
    return {name: tuple(shape) for name, _, shape in _C.safetensors_info(os.fspath(path))[0]}


def _check_var_and_vqvae_agree(var_path, vqvae_path):
    """The VQVAE's codebook must be the one the VAR was trained on: its size is the
    VAR head's output rows and its width the in-features of word_embed."""
    var_shapes, vq_shapes = _tensor_shapes(var_path), _tensor_shapes(vqvae_path)
    codebook = vq_shapes.get("quantize.embedding.weight")
    head, embed = var_shapes.get("head.weight"), var_shapes.get("word_embed.weight")
    if codebook is None or len(codebook) != 2 or head is None or embed is None:
        return  # the C loaders name the missing or misshaped key
    vocab, z = codebook
    if head[0] != vocab:
        raise ValueError(f"vae= {vqvae_path} does not fit {var_path}: the VQVAE's codebook has {vocab} entries "
                         f"(quantize.embedding.weight {list(codebook)}) but the VAR predicts {head[0]} tokens "
                         f"(head.weight {list(head)})")
    if len(embed) == 2 and embed[1] != z:
        raise ValueError(f"vae= {vqvae_path} does not fit {var_path}: the VQVAE's latent has {z} channels "
                         f"(quantize.embedding.weight {list(codebook)}) but the VAR's word_embed takes {embed[1]} "
                         f"(word_embed.weight {list(embed)})")


def _load_var(path, vae_path, device, dtype, threads):
    from .var_model import VARModel

    vqvae = None
    if vae_path is not None:
        kind, source = _file_kind_and_source(vae_path)
        if kind is None:  # also a KL-16 VAE or a MAR without metadata: the VAR path knows no other loader
            kind, source = _kind_from_names(vae_path), "recognised from its tensor names"
        _check_kind(vae_path, "vqvae", "vae=", kind, source)
        _check_var_and_vqvae_agree(path, vae_path)
    var = _C.VAR(path, device=device, dtype=dtype, threads=int(threads))
    if vae_path is not None:
        vqvae = _C.VQVAE(vae_path, num_threads=int(threads), device=device, dtype=dtype)
    return VARModel(var, vqvae, path=path, vae_path=vae_path, device=device, dtype=dtype)

"""Torch-free conversion of the official PyTorch checkpoints to safetensors.

``python -m marcache convert KIND SRC -o DST`` (or :func:`convert`) reads a
PyTorch checkpoint with nothing but the standard library and NumPy, checks
its full key set and every shape against the specification, and writes a
safetensors file whose ``__metadata__`` records the kind and the
hyper-parameters, so that :func:`marcache.load` can tell the files apart.

Reading (``spec/eval_and_formats.md`` section 10):

* The zip format of ``torch.save`` (PyTorch >= 1.6): ``<archive>/data.pkl``
  (the pickle), ``<archive>/data/<key>`` (raw storages), ``<archive>/byteorder``.
  The ``<archive>`` folder name varies and is found from ``data.pkl``.
* The legacy stream format (PyTorch < 1.6, still written with
  ``_use_new_zipfile_serialization=False``): magic number, protocol and
  system-info pickles, the object pickle, the list of storage keys, then each
  storage as an int64 element count and its raw bytes. Files of the pre-0.4
  tar format are refused.
* The pickle runs through :class:`RestrictedUnpickler`, whose ``find_class``
  knows an explicit allowlist (tensor and parameter rebuild functions, the
  storage classes, ``OrderedDict``, ``argparse.Namespace`` as inert data, a few
  inert value types). Every other global is refused with an
  :class:`UnsafeCheckpointError` naming it; nothing from the file is ever
  imported or called. The rebuild functions are marcache's own and only
  record where a tensor's elements are.
* Tensors are lazy (:class:`LazyTensor`): nothing is read until a tensor is
  materialised, and then only the byte range it covers. Storage offsets,
  arbitrary (also zero) strides and storages shared by several tensors are
  honoured; the result is always C-contiguous.

Writing streams tensor by tensor (one tensor in memory at a time, so a 7 GB
checkpoint never needs two copies), into ``DST.partial`` which is renamed at
the end; the output is then re-opened and checked with marcache's strict C
safetensors reader.

Layout of the package (each module's docstring says more):

* ``tensors``: the error types, dtype tables, bfloat16 conversions, lazy tensors.
* ``unpickler``: the restricted unpickler and its allowlist.
* ``reader``: the zip and legacy torch.save formats; :func:`read_checkpoint`.
* ``checks``: what every kind's plan shares (:class:`Plan`, key-set comparison).
* one module per kind: ``mar``, ``vae_kl16``, ``var``, ``vqvae``, ``inception``;
  ``decoder`` holds the LDM-style decoder that KL-16 and the VQVAE share.
* ``kinds``: :data:`KINDS` and :func:`plan`; ``writer``: the safetensors writer;
  ``pipeline``: :func:`convert`.
"""
# Every name the single-file module had stays importable as marcache.convert.<name>;
# __all__ (the star-import set) is the one it had.
from .checks import Plan
from .decoder import decoder_expected_shapes
from .inception import INCEPTION_NUM_CLASSES, inception_expected_shapes, plan_inception
from .kinds import KINDS, plan
from .mar import MAR_CONFIGS, MAR_HEADS_FOR_WIDTH, mar_expected_shapes, plan_mar
from .pipeline import convert
from .reader import Checkpoint, read_checkpoint
from .tensors import (DTYPES, CheckpointError, LazyTensor, UnsafeCheckpointError, bf16_bits_to_f32,
                      f32_to_bf16_bits)
from .unpickler import ALLOWED_GLOBALS, RestrictedUnpickler, TorchDevice, TorchDtype
from .vae_kl16 import plan_vae_kl16
from .var import plan_var, var_expected_shapes
from .vqvae import plan_vqvae
from .writer import write_safetensors

__all__ = ["convert", "read_checkpoint", "plan", "Checkpoint", "LazyTensor", "RestrictedUnpickler",
           "CheckpointError", "UnsafeCheckpointError", "KINDS", "DTYPES", "write_safetensors"]

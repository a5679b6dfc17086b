"""The fuzz corpus of issue 18: seeded generators of malformed and malicious model files
and the child-process runner that feeds them to marcache's public entry points.

- ``safetensors_corpus``: >= 1,000 malformed safetensors files, mutated from small valid
  MAR, VAR, KL-16 VAE and VQVAE files (header length, UTF-8, JSON, dtype, shape, offsets,
  tiling, duplicate and missing entries, metadata, truncation), each loaded with
  ``marcache.load`` in the role its base plays.
- ``torch_corpus``: >= 200 malformed or malicious ``torch.save`` files (zip and legacy
  layouts: truncated records, bad CRCs, damaged zip structures, huge and negative sizes,
  strides and storage offsets out of range, pickles that ask for os.system, eval, exec,
  subprocess, getattr, __import__ ..., deep nesting, memo abuse), each converted with
  ``marcache.convert.convert``.
- ``runner``: ``python -m fuzz.runner CORPUS --seed S --dir D`` writes every case of a
  corpus under D, runs it and prints one JSON line per case; ``--only I`` replays case I.

Nothing is committed but the generators: every file is made at test time from the seed.
"""

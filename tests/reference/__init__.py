"""Independent float64 NumPy reference of MAR inference for marcache.

Written from /work/shared/spec/mar.md (section numbers below refer to it) and
the randomness contract in csrc/core/philox.h. Pure Python + NumPy: no torch,
no scipy. Modules:

  philox  Philox-4x32-10 counter RNG, token normals, generation orders
  ops     float64 versions of every backend op of csrc/backend/ops.h
  mar     MAR transformer, diffusion head, DDPM sampler tables, AR loop
  vae     KL-16 VAE decoder and uint8 conversion
"""

"""Tiny VAR models in the exact official key layout (var_fastvar.md A3), written with
the safetensors package (an independent writer) for the VAR engine tests."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from reference import var as RV
from reference import vqvae as RVQ
from child_env import child_env

# depth 2, width 128, 2 heads of 64, vocab 64, 4 scales (30 tokens); scale_mul spans the
# ln 100 cap (ln 2 .. ln 400 over the 4 heads).
TINY = dict(depth=2, width=128, heads=2, vocab=64, vae_channels=8, num_classes=10, patch_nums=(1, 2, 3, 4))


def patch_nums_text(patch_nums):
    return ",".join(str(p) for p in patch_nums)


def write_tiny_var(path, seed=0, dtype=np.float32, metadata=True, buffers=True, drop=(), **overrides):
    """Writes a random VAR (TINY with `overrides`) to path; returns its float32 state dict.
    metadata: write patch_nums (and kind) into __metadata__; drop: keys to leave out."""
    cfg = dict(TINY, **overrides)
    rng = np.random.default_rng(seed)
    W = RV.random_var_weights(rng, buffers=buffers, **cfg)
    meta = {"kind": "var", "patch_nums": patch_nums_text(cfg["patch_nums"])} if metadata else None
    stored = {k: (v if v.dtype == np.int64 else v.astype(dtype)) for k, v in W.items() if k not in drop}
    save_file(stored, str(path), metadata=meta)
    return W


# The tiny VQVAE the generation tests pair with the tiny VARs (vocab 64, 8 latent channels).
TINY_VQ = dict(ch=32, ch_mult=(1, 2), num_res_blocks=1, z=8, vocab=64, num_phi=4)


def write_var_and_vqvae(directory, var_seed, vq_seed, **overrides):
    """A tiny VAR (TINY with `overrides`) and a TINY_VQ VQVAE of random weights under
    `directory`: (var path, VAR state dict, VQVAE path, VQVAE state dict)."""
    var_path = os.path.join(str(directory), "tiny_var.safetensors")
    W = write_tiny_var(var_path, seed=var_seed, **overrides)
    VQW = RVQ.random_vqvae_weights(np.random.default_rng(vq_seed), **TINY_VQ)
    vq_path = os.path.join(str(directory), "tiny_vqvae.safetensors")
    save_file(dict(VQW), vq_path)
    return var_path, W, vq_path, VQW


def engine_and_reference(files, patch_nums):
    """(engine VAR, engine VQVAE, float64 VAR reference, reference VQ update) of the files
    write_var_and_vqvae wrote."""
    from marcache import _C

    var_path, W, vq_path, VQW = files
    return _C.VAR(var_path), _C.VQVAE(vq_path), RV.VARReference(W, patch_nums), ReferenceVQ(VQW)


def module_fixtures(name, var_seed, vq_seed, **overrides):
    """The `files` (write_var_and_vqvae under a temporary folder `name`) and `models`
    (engine_and_reference of them) fixtures of a test module, made once per module:
    ``files, models = module_fixtures(...)`` at the module's top level."""
    patch_nums = dict(TINY, **overrides)["patch_nums"]

    @pytest.fixture(scope="module")
    def files(tmp_path_factory):
        return write_var_and_vqvae(tmp_path_factory.mktemp(name), var_seed, vq_seed, **overrides)

    @pytest.fixture(scope="module")
    def models(files):
        return engine_and_reference(files, patch_nums)

    return files, models


class ReferenceVQ:
    """The float64 reference's VQ update, as RV.generate / RF.generate call it; wtype: the
    VQVAE's dtype (a 16-bit one rounds Phi's convolution operands, as the engine does)."""

    def __init__(self, W, wtype="fp32"):
        self.W = W
        self.wtype = wtype
        self.codebook = W["quantize.embedding.weight"]
        self.num_phi = RVQ.count_phi(W)

    def add_scale(self, f_hat, h, si, n_scales):
        return RVQ.add_scale(self.W, f_hat, h, RVQ.phi_index(si, n_scales, self.num_phi), wtype=self.wtype)

    def next_input(self, f_hat, pn):
        return RVQ.resize_area(f_hat, pn, pn)


# A child interpreter: every cache dict of argv[3] generates 3 images (labels 1, 5 and
# unconditional; cfg 1.5, top_k 20, top_p 0.9, seed 7, first index 2) on the CPU and on the
# guard backend; prints whether the tokens and f_hat bytes agree and, per run, the FLOPs
# the guard dispatched in each scale beside the telemetry's.
_GUARD_CHILD = r"""
import json, sys
import numpy as np
from marcache import _C
var_path, vq_path, caches = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
out = {}
for device in ("cpu", "guard"):
    var, vq = _C.VAR(var_path, device=device), _C.VQVAE(vq_path, device=device)
    runs, flops = [], []
    for cache in caches:
        before = var.backend_flops
        marks = []
        (t, f), steps = var.generate(np.array([1, 5, -1], np.int32), vq, seed=7, first_index=2, cfg=1.5,
                                     top_k=20, top_p=0.9, cache=cache,
                                     callback=lambda d: marks.append(var.backend_flops))
        runs.append([t.tobytes().hex(), f.tobytes().hex()])
        flops.append([np.diff([before] + marks).tolist(), [s["flops"] for s in steps]])
    out[device] = {"runs": runs, "flops": flops}
print(json.dumps({"same": out["cpu"]["runs"] == out["guard"]["runs"], "flops": out["guard"]["flops"]}))
"""


def generate_on_guard_and_cpu(var_path, vq_path, caches):
    """Runs the cache dicts on the CPU and on the guard backend in a child interpreter (a
    host read of guard memory kills it, and the test fails with its output): (whether
    every run's tokens and f_hat are the CPU's bit for bit, [(FLOPs the guard dispatched
    per scale, the telemetry's per scale)] per run)."""
    env = child_env(PYTHONFAULTHANDLER="1")
    proc = subprocess.run([sys.executable, "-c", _GUARD_CHILD, var_path, vq_path, json.dumps(caches)],
                          cwd=os.path.dirname(os.path.abspath(__file__)), env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["same"], out["flops"]


def assert_tokens_follow(tokens, want, tie_tol, max_near=0.05):
    """An engine's tokens against a reference run that followed them (forced_tokens): the
    reference's own samples must equal them except at near ties (a decision's margin below
    tie_tol), and near ties must stay under max_near of the tokens."""
    near = want["margins"] < tie_tol
    differ = want["own_tokens"] != tokens
    assert not (differ & ~near).any(), "tokens differ away from a near tie at %s" % np.argwhere(differ & ~near)
    assert near.mean() < max_near

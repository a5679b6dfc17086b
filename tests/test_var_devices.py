"""VAR tokens on another device or dtype against the CPU engine, tie-aware (issue 15).

A token sampled on the GPU (or with bf16 weights) may differ from the CPU's where a top-k,
top-p or sampling decision is within rounding of flipping; after one such token the two
runs follow different histories, so comparing whole token arrays says nothing. The check
is teacher-forced instead, in two parts that together say "the same up to ties":

1. the run's tokens are the reference sampler's (tests/reference/var.py, sample_row, with
   the same Philox uniforms) on the run's *own* logits, recomputed on its own device
   from its own tokens (scale_inputs of the float64 VQ accumulation of the tokens, then
   forward_scales with the same cache policy, guided in float32 as the engine), except
   at fp32 near ties of the sampling decision (margin < 1e-4, under 5 % of the tokens);
2. on that same history the run's logits are the CPU engine's within a bound per token
   (a share of its largest logit): no tie can hide there, the comparison is continuous.

- CPU, runs here: part 1 on the CPU engine's own fp32 and bf16 runs (NoCache and FastVAR),
  which checks the harness; part 2's bf16 bound measured on the CPU's bf16 emulation
  against fp32.
- CUDA (skips without a GPU): tokens generated on CUDA in fp32 and bf16, NoCache and
  FastVAR: part 1 on the GPU, part 2 against the CPU engine of the same dtype (fp32 1e-4;
  bf16 twice the emulation's bound, as the MAR device tests bound bf16).
"""
import numpy as np
import pytest

import marcache as mc
from marcache import _C
from reference import var as RV
from var_fixtures import ReferenceVQ, write_var_and_vqvae

PATCH_NUMS = (1, 2, 3, 4, 6, 8)
DEPTH = 3
HAS_CUDA = "cuda" in _C.backends()
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="no usable CUDA device (marcache._C.backends() == %r)"
                               % (_C.backends(),))

# Near-tie window of a sampling decision from the same logits (sample_row's margin units),
# as the CPU tests (test_var_generate).
TIE_TOL = 1e-4
# The CPU's bf16 emulation against fp32 on one history, per token as a share of its
# largest logit (test_bf16_emulation_logits_stay_near_fp32 holds it below this; measured
# 2.4e-2 with NoCache on this model, the bound twice that).
BF16_EMULATION_SHARE = 5e-2
# CUDA against the CPU engine of the same dtype: fp32 rounds in other summation orders
# (cuBLAS, block reductions) and nothing else, 1e-4 as the MAR device tests; bf16 rounds
# at other places (ops.h allows it), a perturbation of the emulation's kind and size, so by
# the triangle inequality within twice the emulation's distance from fp32.
LOGIT_SHARE = {"fp32": 1e-4, "bf16": 2 * BF16_EMULATION_SHARE}
POLICIES = {"nocache": lambda: mc.NoCache(),
            "fastvar": lambda: mc.FastVAR(cache_scale=3, prune={4: 0.5, 5: 0.75})}
SAMPLING = dict(cfg=1.5, top_k=20, top_p=0.9, seed=7, first_index=2)
LABELS = [1, 5, 7, 9]
BEGIN = np.cumsum((0,) + tuple(p * p for p in PATCH_NUMS))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_var_and_vqvae(tmp_path_factory.mktemp("var_devices"), 41, 42, depth=DEPTH, patch_nums=PATCH_NUMS)


def teacher_forced_logits(model, vq_weights, labels, tokens, cache, cfg):
    """(guided logits [B, L, V] float32, trace) of `model` (a VARModel) on the history
    `tokens` [B, L]: per scale the engine's logits given the tokens of the earlier scales
    (inputs from the float64 VQ accumulation of the tokens, Phi's operands rounded as the
    model's dtype rounds them), guided in float32 as the engine guides them; trace:
    forward_scales' rows per sublayer of each scale run. Scales the tokens leave at -1
    (skipped) stay NaN."""
    ref_vq = ReferenceVQ(vq_weights, wtype=model.dtype)
    labels = np.asarray(labels)
    B, n_scales = len(labels), len(PATCH_NUMS)
    run = [si for si in range(n_scales) if (tokens[:, BEGIN[si]:BEGIN[si + 1]] >= 0).all()]
    f_hat = np.zeros((B, PATCH_NUMS[-1], PATCH_NUMS[-1], ref_vq.codebook.shape[1]))
    maps = []
    for si in run[:-1]:
        pn = PATCH_NUMS[si]
        h = RV.f64(ref_vq.codebook)[tokens[:, BEGIN[si]:BEGIN[si + 1]]].reshape(B, pn, pn, -1)
        f_hat = ref_vq.add_scale(f_hat, h, si, n_scales)
        maps.append(ref_vq.next_input(f_hat, PATCH_NUMS[si + 1]).astype(np.float32))
    null = model.config["num_classes"]
    cond = np.where(labels < 0, null, labels).astype(np.int32)
    seq_labels = np.concatenate([cond, np.full(B, null, np.int32)]) if cfg != 0 else cond
    copies = 2 if cfg != 0 else 1
    inputs = model.scale_inputs(seq_labels, [np.concatenate([m] * copies) for m in maps])
    _, logits, trace = model.forward_scales(seq_labels, inputs, cache=cache, trace=True)
    guided = np.full((B, BEGIN[-1], logits.shape[-1]), np.nan, np.float32)
    for si in run:
        b0, b1 = BEGIN[si], BEGIN[si + 1]
        t = RV.guidance(cfg, si, n_scales)
        c = logits[:B, b0:b1]
        guided[:, b0:b1] = (np.float32(1 + t) * c + np.float32(-t) * logits[B:, b0:b1]) if cfg != 0 else c
    return guided, trace


def own_samples(guided, top_k, top_p, seed, first_index):
    """(tokens, margins) [B, L]: each token of the guided logits sampled by the reference's
    sampler with its Philox uniform; -1 and an infinite margin where the logits are NaN."""
    B = guided.shape[0]
    own = np.full((B, BEGIN[-1]), -1, np.int64)
    margins = np.full((B, BEGIN[-1]), np.inf)
    images = first_index + np.arange(B)
    for si in range(len(PATCH_NUMS)):
        b0, b1 = BEGIN[si], BEGIN[si + 1]
        if np.isnan(guided[:, b0:b1]).any():
            continue
        u = RV.sample_uniforms(seed, images[:, None], np.arange(b0, b1)[None, :], si)
        for b in range(B):
            for r in range(b1 - b0):
                own[b, b0 + r], _, margins[b, b0 + r] = RV.sample_row(guided[b, b0 + r], top_k, top_p, u[b, r])
    return own, margins


def check_tokens_follow(tokens, guided, what):
    """The run's tokens are the reference sampler's on the run's own logits, except at
    fp32 near ties (both sample in float32 / float64 from the same logits)."""
    own, margins = own_samples(guided, SAMPLING["top_k"], SAMPLING["top_p"], SAMPLING["seed"],
                               SAMPLING["first_index"])
    differ = tokens != own
    near = margins < TIE_TOL
    bad = differ & ~near
    assert not bad.any(), "%s: tokens differ away from a near tie at %s (margins %s)" % (
        what, np.argwhere(bad)[:8].tolist(), margins[bad][:8].tolist())
    assert near.mean() < 0.05, "%s: %.3f of the tokens are near ties" % (what, near.mean())


def logit_share(got, want):
    """The largest |got - want| over each token's largest |want| of two teacher-forced runs
    ((guided, trace) each) on the scales where both ran and both pruned sublayers kept the
    same rows (FastVAR's selection can flip at a near tie of its scores, and then the row
    takes a cached instead of a computed output: a tie of the selection, not rounding).
    Returns (share, the scales compared)."""
    (got, got_trace), (want, want_trace) = got, want
    scales = [si for si in range(len(got_trace)) if np.array_equal(got_trace[si], want_trace[si])]
    cols = np.concatenate([np.arange(BEGIN[si], BEGIN[si + 1]) for si in scales])
    g, w = got[:, cols].astype(np.float64), want[:, cols].astype(np.float64)
    return float((np.abs(g - w).max(axis=-1) / np.abs(w).max(axis=-1)).max()), scales


def load(files, device, dtype):
    var_path, _, vq_path, _ = files
    return mc.load(var_path, vae=vq_path, device=device, dtype=dtype)


def generated_tokens(model, cache):
    tokens, _ = model.generate_tokens(LABELS, cache=cache, **SAMPLING)
    return tokens


def forced(model, files, tokens, cache):
    return teacher_forced_logits(model, files[3], LABELS, tokens, cache, SAMPLING["cfg"])


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_cpu_tokens_follow_their_own_logits(files, policy):
    """The harness on the CPU engine: its fp32 and bf16 runs' tokens are the reference
    sampler's on their own teacher-forced logits (the teacher's inputs come from the
    float64 VQ accumulation, within float32 rounding of the engine's)."""
    for dtype in ("fp32", "bf16"):
        model = load(files, "cpu", dtype)
        tokens = generated_tokens(model, POLICIES[policy]())
        check_tokens_follow(tokens, forced(model, files, tokens, POLICIES[policy]())[0], "%s %s" % (policy, dtype))


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_bf16_emulation_logits_stay_near_fp32(files, policy):
    """The bf16 bound of the CUDA test: on the same history, the CPU's bf16 emulation's
    logits are within BF16_EMULATION_SHARE of fp32's (per token, of its largest logit) on
    every scale where FastVAR kept the same rows (all scales up to the cache scale at
    least), and bf16 does move them (else the bound would be untested)."""
    fp32, bf16 = load(files, "cpu", "fp32"), load(files, "cpu", "bf16")
    tokens = generated_tokens(fp32, POLICIES[policy]())
    share, scales = logit_share(forced(bf16, files, tokens, POLICIES[policy]()),
                                forced(fp32, files, tokens, POLICIES[policy]()))
    assert 1e-5 < share < BF16_EMULATION_SHARE, share
    assert scales[:4] == [0, 1, 2, 3]
    if policy == "nocache":
        assert scales == list(range(len(PATCH_NUMS)))


@cuda_only
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_cuda_tokens_follow_the_cpu(files, policy, dtype):
    """Issue 15: VAR generated on CUDA, tie-aware against the CPU engine. (1) The GPU's
    tokens are the reference sampler's on the GPU's own teacher-forced logits, except at
    fp32 near ties; (2) on that history the GPU's logits are the CPU engine's (same dtype)
    within LOGIT_SHARE of each token's largest logit. A GPU token that differs from what
    the CPU would have drawn therefore does so only where the logits' rounding (bounded in
    (2)) reaches a decision. The GPU run is deterministic (the same tokens twice)."""
    gpu, cpu = load(files, "cuda", dtype), load(files, "cpu", dtype)
    tokens = generated_tokens(gpu, POLICIES[policy]())
    np.testing.assert_array_equal(generated_tokens(gpu, POLICIES[policy]()), tokens)
    gpu_forced = forced(gpu, files, tokens, POLICIES[policy]())
    check_tokens_follow(tokens, gpu_forced[0], "%s %s cuda" % (policy, dtype))
    share, scales = logit_share(gpu_forced, forced(cpu, files, tokens, POLICIES[policy]()))
    assert share < LOGIT_SHARE[dtype], (policy, dtype, share)
    # FastVAR's selections may flip only at bf16 score ties; in fp32 they are the CPU's
    assert scales == list(range(len(PATCH_NUMS))) or (dtype == "bf16" and scales[:4] == [0, 1, 2, 3]), scales

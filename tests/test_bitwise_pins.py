"""Bitwise pins of the engine's tokens, taken before the runtime seams were restructured
(issue 14): a restructuring must leave every byte of every policy's output as it was.

Each pin is the SHA-256 of the exact float32 bytes of `generate_tokens` for one
(model, policy, seed). Float32 bits depend on the BLAS kernel and vector width, so there
is one table per platform, each printed by `PYTHONPATH=<checkout> python
tests/test_bitwise_pins.py`; the test recomputes every entry on the CPU and, in one
subprocess, on the guard backend. A pin is not a reference (the float64 references hold
the engine to the spec): it says only "unchanged". Should a deliberate numerical change
ever move a pin, the commit that regenerates the table must say why.

History: first taken at 896450c (SkylakeX, the last commit before the seams work) and
55fd814 (Haswell). Regenerated for issue 23: `linear` with at most 32 rows runs the
small-row kernel (csrc/backend/cpu/cpu_smallrow.c) instead of OpenBLAS, another
summation order (the same on every ISA, so MARCACHE_CPU_ISA does not change a pin); with
MARCACHE_SMALLROW_MAX=0 the old tables still held. The SkylakeX table was taken on the
project's AVX-512 EPYC. No AVX2-only machine was at hand for the Haswell table, so it was
taken on the same EPYC as an AVX2 machine would build and run: MARCACHE_MARCH=haswell,
OPENBLAS_CORETYPE=Haswell, MARCACHE_CPU_ISA=avx2. That emulation reproduced the previous
Haswell table exactly from the code before the change (d353caa).

Models: the amplified tiny model of the cache reference tests (depth 5, so LazyMAR's
select layer 3 and MARche's full layers 2 leave layers to prune, seq 256, 100 diffusion
steps) and the shipped digits model (6 decoder layers, 64 tokens). 16 AR steps, cfg 2.5,
two labels, seeds 0 and 7.
"""
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from child_env import child_env

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# policy name -> constructor source (evaluated with `mc` bound to marcache)
POLICIES = {
    "nocache": "mc.NoCache()",
    "lazymar": "mc.LazyMAR()",
    "lazymar-token": "mc.LazyMAR(cond_cache=False, head_cache=False)",
    "lazymar-cond": "mc.LazyMAR(token_cache=False, head_cache=False)",
    "lazymar-head": "mc.LazyMAR(token_cache=False, cond_cache=False)",
    "marche": "mc.MARche()",
    "marche-encoder": "mc.MARche(encoder_cache=True)",
    "marche-composed": "mc.MARche(encoder_cache=True, cond_cache=True, head_cache=True)",
}
SEEDS = (0, 7)
STEPS = 16
CFG = 2.5
LABELS = {"tiny": [1, 400], "digits": [3, 8]}

# The bits of a float32 sum depend on the BLAS kernel and the vector width the build
# targets (-march=native), so pins hold only on the platform that took them: the project's
# machines (AMD EPYC, OpenBLAS's SkylakeX kernels, AVX-512). Elsewhere the test skips and
# says why; the float64 reference tests still hold the engine there.
# The table of each platform (SkylakeX/AVX-512, Haswell without AVX-512): how each was
# taken is in the module's docstring.
PINNED_PLATFORMS = (("SkylakeX", True), ("Haswell", False))


def this_platform():
    import marcache as mc

    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        flags = ""
    return {"blas_core": mc.build_info()["blas_core"], "avx512f": " avx512f" in flags}


def _require_pinned_platform():
    """The pin table of this machine's platform (skips where none was taken)."""
    here = this_platform()
    key = (here["blas_core"], here["avx512f"])
    if key not in PINS_BY_PLATFORM:
        pytest.skip(f"bitwise pins were taken on {list(PINS_BY_PLATFORM)} (BLAS core, AVX-512); this machine is {key}")
    return PINS_BY_PLATFORM[key]

SKYLAKEX_PINS = {
    "tiny/nocache/0": "7dc8fe484cc220f0833f1dd19757f218ea3d7ceb6b5369f336b8c8fdbb654c62",
    "tiny/nocache/7": "ea2b9bb465453432839ebdbcb8134dcb1a3722bae9e41a44c90aa03a5d6ffcce",
    "tiny/lazymar/0": "805eae88f6558a94632fac6b0fcd4ac9ba60311e37d266f4ab29769c786be9bb",
    "tiny/lazymar/7": "4a531b93db5ee6977a3d09ce697b42506b8a8fad9b9e82357b3daac84061a0df",
    "tiny/lazymar-token/0": "7f235cdd102a5cf7b80a30f9bf961a71564fc89547b0cb55c2968a6d22cfc75c",
    "tiny/lazymar-token/7": "dacbfe9a040d9bc64e7bf9bf7e05f5801d9a6eb0848927390e41f25daaf15773",
    "tiny/lazymar-cond/0": "c41c6c22aeb529dc9ec896d9e8405a37655c9a9860260792caa6b5e6b0085f2b",
    "tiny/lazymar-cond/7": "4f7d3e0c2a51cb221fe72ea3ef3403efb7d99e264db45e25f9844434147866c7",
    "tiny/lazymar-head/0": "9a21e897cdd27e74e67bd5caa732be7adb9d094587753bc381a4482ef29366ef",
    "tiny/lazymar-head/7": "6c1e36a457d55fd545b35101bf0735550b6107defd854085bfc9f863c0d51497",
    "tiny/marche/0": "0624ca8e663be430602719780753e62ffe7b883374b9341483efc2b2e6884c3f",
    "tiny/marche/7": "5567f64fdc8390fe3130ad5bd1baad8b09308b6430eaf946aec473bac8353b07",
    "tiny/marche-encoder/0": "545941f96e4f3d9ae531da4d1bdbeddf12fc1ba9cfade786575fdde4a61ef51b",
    "tiny/marche-encoder/7": "1801e09fe61051d37a4d7dbc45d0df27349985d3ec7440b8b016bec1d4369b78",
    "tiny/marche-composed/0": "1ba4fc82c29f6c8f47d54d8b8650157c43b2b1476cecc4edf8b2cc979a898ea1",
    "tiny/marche-composed/7": "bff00d3a2d3ee7dd02daf9198315eb155bd3c41574e64cd313c0978e4bf53848",
    "digits/nocache/0": "33911cb074e16f3b4d17cc7e4f0048b3dd0a392d300a87f4b3790ab6a6df8ec0",
    "digits/nocache/7": "ab3b5b56c72f6e320d3024ad5ad03c436db24bc52291f426833993b58a0eb266",
    "digits/lazymar/0": "e2cbd267c3405615a105785a4d4ea711c8fd24a64bd74b9ab236fe99484b4e9a",
    "digits/lazymar/7": "9479743ce7af631d1ecfd20a9ad49ad25213decfc45607bc72ed6ff354824a8d",
    "digits/lazymar-token/0": "014c9885bca477941e19a61ee82dcb372c9dcb4d78bde823fad91b0b751f41a3",
    "digits/lazymar-token/7": "09cf83a5946532ac5f04c27234ccab14b8f0539a0536c0a606a3962c37774abd",
    "digits/lazymar-cond/0": "3275c077d90d362639e34e9bce9574e047362f00e6fa009c7bfcf86acc10c1be",
    "digits/lazymar-cond/7": "85bb211a9bb4403ee28fb8642e11b8872a239eaf15e49b1c862e7593f7c93e2b",
    "digits/lazymar-head/0": "9afcbf71b07a25efe7e77efff0c5e29c28bd3715634435091a45e4bc6b1098c0",
    "digits/lazymar-head/7": "453b87aa437362698665585078103aac77373ab45550cdbb15490e3d3ba6ff5c",
    "digits/marche/0": "878c5d9da1850ff5475ecb466b38ff62e9dda9b48a65338820e7df0b06f02e60",
    "digits/marche/7": "df9fd1b50989da9346fb6ac2553dbdb6e8676805e77f9cbbc66462ce60e6a4eb",
    "digits/marche-encoder/0": "fdaa49e7deab570c627a2c89e2292d48b2a817ab5eee5a37c22c88a3e6c7924a",
    "digits/marche-encoder/7": "bb63542fbffd2b2f4529485a84d5099771450676f12452f1512283872dd180ef",
    "digits/marche-composed/0": "22442d61124cb97b2a39c3ffc668c20f6b724d736198076876a165c0790e6ba4",
    "digits/marche-composed/7": "628ba47da36c5eae92a64ae82bcaf3826934ba7cfd0dc174618d1fc8820b1cf2",
}

HASWELL_PINS = {
    "tiny/nocache/0": "fddc7f9356c4a5b4105b0e1265a3dbd292266de55d32ec5a5d40538512531ba0",
    "tiny/nocache/7": "017a9984820a5f157d4fa2c9ef66774b0ef1e2f7f4b2c14a76e1fc47d12ea89c",
    "tiny/lazymar/0": "048ce82cf4bfbe66bfac79ed89b7230a8955fdf1783c4c5da990db9a1bc4311e",
    "tiny/lazymar/7": "5a8eeb8d4eac0daf48e3afe3c367fa8650e91c89a49067fe38b76159cab941f7",
    "tiny/lazymar-token/0": "1d45db27284cf4c56ac721d7c63107c448815679bf109823355212590c450552",
    "tiny/lazymar-token/7": "6724f4954b806dc433c8c320125eb905061d4b34594d8fa49ba3f762509b9a07",
    "tiny/lazymar-cond/0": "fccd4ae2ca98405b3c4be39350507813525ae46bc943fc9a307fd8df05ca8129",
    "tiny/lazymar-cond/7": "96449eafc8861f1a99f4b9bc8dddadabf651f115ed5709af1720710235d13526",
    "tiny/lazymar-head/0": "4c30da56fd5c26e75d97f451e45e003c4dee5b5bdd2fa76363a6bfa69e391cc7",
    "tiny/lazymar-head/7": "5ae3aa73eb2c0be4db7e0d79cca237e77aeae377af6f481a214c1eac08111797",
    "tiny/marche/0": "d751ca7f7e3047384d3449a82b5ccb4b75c2334f851d2715ee295e8c53eb9c85",
    "tiny/marche/7": "1a4e1c93997b8ae754b194517584f47b355581d552ee82f9bad4eb4c4223ba13",
    "tiny/marche-encoder/0": "b66001f5760b94bbc7d90c6841f01239a379845cad70902a2c13b20db051e48e",
    "tiny/marche-encoder/7": "6018c3ded44176dc4b69727c86ec3fbb49c1197ffe3346f1812aecfa5de76a63",
    "tiny/marche-composed/0": "f2b7f393eeeb6984ea7c676927d573793d55deda76328c440afe03f634efe8fb",
    "tiny/marche-composed/7": "74077f50aa4fde620fccbe0bd45cf156d04f906b4d48b0873c493c669038195e",
    "digits/nocache/0": "ec77f4b8f0b98adca883a809c65347126d3219eaff0e8d3d149c67fab46583ab",
    "digits/nocache/7": "f115bcc515080d3dcba08bf403348c1da2062310648ba3f551caae9321be98da",
    "digits/lazymar/0": "76f20f35d144fe0f82c3b28475dfe475580e5a2b29b38e5c7b510faa260381e2",
    "digits/lazymar/7": "c06a1947ff5ab88ccd931135ab6f2466eabb5e557db1a763df549ee00b9ca8c8",
    "digits/lazymar-token/0": "58a06f3aa5316c1aaa3bd1f55a6c00390404c1a548bc26917730f602fa6139c0",
    "digits/lazymar-token/7": "94bf243e2cea0a948c13621535107b4e10dc49b78cbf03d7e60dbf134d6cfa73",
    "digits/lazymar-cond/0": "36fa22e6b96d392751107297296183a154a36e11cb9f09e4697ebbd2d45e419c",
    "digits/lazymar-cond/7": "1bbae0eed91f1aa318d11c8a54407bcf4aa2043010e7c716d60a0c00446bc09d",
    "digits/lazymar-head/0": "a7e55372ad0036512f55dabea7adb40e06c7b5448f91be01a21027b072e4a038",
    "digits/lazymar-head/7": "a1c5f8d6374f3027392a6efc86bac01daa7dd0a9f9fabe2c6bb88ca5424490af",
    "digits/marche/0": "1a7a3e3f1ad3390a7bae37f671d4263ab8c159338e895a6c3f00350bf11c1ac5",
    "digits/marche/7": "4ab04750640472525eb1f5d4fa6e92e303c5e70b09045097e487082d94238917",
    "digits/marche-encoder/0": "4037460ae6356f712a07910a71b0b52c0600a3ece3c433b2b0bdf390338f0923",
    "digits/marche-encoder/7": "500dee1fb4e7b0b4ec4ddf5152d2b90278c18b894ca279c07e1eb7175f43e678",
    "digits/marche-composed/0": "6c4a847b62d1616e20c575829844c073b2a7231645a60d173905a3c9a7401119",
    "digits/marche-composed/7": "def0ebf15e67de49ce2e8130f28b47cfed8267404bd3dc2d79656ceb712223d4",
}

PINS_BY_PLATFORM = {PINNED_PLATFORMS[0]: SKYLAKEX_PINS, PINNED_PLATFORMS[1]: HASWELL_PINS}


def _models(tmp_dir):
    import marcache as mc
    from marcache import digits
    from mar_fixtures import amplified_tiny

    amplified_tiny(tmp_dir)  # writes tmp_dir/tiny.safetensors
    tiny_path = str(tmp_dir / "tiny.safetensors")
    return {"tiny": lambda device: mc.load(tiny_path, device=device),
            "digits": lambda device: digits.load_model(device=device)}


# On the guard backend every op maps and unmaps the device arena and every recorded head
# graph snapshots it, which makes a run about 10x slower than on the CPU: the guard checks
# every policy on the tiny model at one seed (the host/device discipline does not depend
# on the seed or the weights), the CPU every entry.
GUARD_MODELS, GUARD_SEEDS = ("tiny",), (0,)


def compute_pins(tmp_dir, device="cpu", models=None, seeds=SEEDS):
    """{"model/policy/seed": sha256 hex} of the pinned configurations on `device`
    (all models, or those named in `models`; the seeds in `seeds`)."""
    import marcache as mc

    out = {}
    for model_name, make in _models(tmp_dir).items():
        if models is not None and model_name not in models:
            continue
        model = make(device)
        for policy_name, source in POLICIES.items():
            policy = eval(source, {"mc": mc})
            for seed in seeds:
                tokens = model.generate_tokens(labels=LABELS[model_name], steps=STEPS, cfg=CFG, seed=seed,
                                               cache=policy)
                tokens = np.ascontiguousarray(tokens, dtype=np.float32)
                out[f"{model_name}/{policy_name}/{seed}"] = hashlib.sha256(tokens.tobytes()).hexdigest()
    return out


def test_cpu_tokens_equal_the_pins(tmp_path):
    pins = _require_pinned_platform()
    got = compute_pins(tmp_path, "cpu")
    assert set(got) == set(pins)
    changed = sorted(key for key in pins if got[key] != pins[key])
    assert not changed, f"tokens changed bitwise for {changed}"


def test_guard_tokens_equal_the_pins(tmp_path):
    pins = _require_pinned_platform()
    code = ("import json, pathlib, sys; sys.path.insert(0, %r); import test_bitwise_pins as t; "
            "print(json.dumps(t.compute_pins(pathlib.Path(%r), 'guard', t.GUARD_MODELS, t.GUARD_SEEDS)))"
            % (HERE, str(tmp_path)))
    env = child_env()
    proc = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(got) == len(GUARD_MODELS) * len(POLICIES) * len(GUARD_SEEDS)
    changed = sorted(key for key in got if got[key] != pins[key])
    assert not changed, f"guard tokens changed bitwise for {changed}"


if __name__ == "__main__":
    import pathlib
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        pins = compute_pins(pathlib.Path(tmp))
    print("PINS = {")
    for key, value in pins.items():
        print(f'    "{key}": "{value}",')
    print("}")

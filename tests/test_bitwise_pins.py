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
Regenerated again for issue 23's batch-8 finding: the small-row threshold went from 32 to
96 rows (benchmarks/bench_linear.py), so the heads' 64-row calls of these runs (2 labels x
CFG x 16 tokens per step) moved from OpenBLAS to the kernel; every entry changed on both
platforms, and with MARCACHE_SMALLROW_MAX=32 both tables before the change were reproduced
entry for entry (the Haswell one by the same emulation).
Regenerated again for issue 23's softmax: the CPU attention softmax moved from glibc's
expf and a serial sum to marcache's own expf (csrc/backend/cpu/cpu_vmath.c, IEEE
operations only, within 2 ulp) and 16 lane sums in a fixed tree. Every entry changed on
both platforms; each table is the same with MARCACHE_CPU_ISA=avx512, avx2 or plain, and
the commit before (822dfed, the small-row narrow path) reproduced both old tables (the
Haswell one by the same emulation).
Regenerated again for issue 23's GELU: the MLP's exact-erf GELU moved from glibc's erff to
marcache's own (mc_gelu_erf in csrc/backend/cpu/cpu_vmath.c: IEEE operations and mc_expf,
within 6 ulp of the float64 GELU). Every entry changed on both platforms; the SkylakeX
table is the same with MARCACHE_CPU_ISA=avx512, avx2 or plain, the Haswell one with avx2 or
plain, and the commit before (db14921) reproduced the old Haswell table by the same
emulation.

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
    "tiny/nocache/0": "2dbd70088a5f03eb560620eae9e980cbfc6f3c842dae6c05c688b8768a4b6289",
    "tiny/nocache/7": "675cd86131ca16755e2aa95c6e844c1942d4418ebf76591b5d062b30d6dce836",
    "tiny/lazymar/0": "2765b29d9d0bd3a196857e548de523d8dee18c6e55e8ec8c5ec694b33ee32e1a",
    "tiny/lazymar/7": "16f74675b837068660912649f12be3dcb8fcb1937200540461d8d99b679b172b",
    "tiny/lazymar-token/0": "0350944739fb37f18214e6ce646274e907819bad4cb7c8348999741fe5f9451b",
    "tiny/lazymar-token/7": "87482d3baa74580bfd245497f7ea5436728e4f2766036f78b16ac9457b3c16c4",
    "tiny/lazymar-cond/0": "ba57de5f1f5a8cfc325fb0358333ed1a0fc6db00e103944a25cd487f64c2d061",
    "tiny/lazymar-cond/7": "f57fc3e3aa4540a2d48bc8ca5edb6ec4c8a97dc32bfafe632be8fc9753bac75a",
    "tiny/lazymar-head/0": "94cf66e460e070bb7aa23c2fd39ae8e1493f719c981a06b2e353ff350554865f",
    "tiny/lazymar-head/7": "af30493a4fb6a36a12a726681b6315b2875a91f4b4572ee5787400129596d752",
    "tiny/marche/0": "345e0ffb838a04245947b03531ef1a077b1e713fe3dd4e192591b961bac49e05",
    "tiny/marche/7": "1667c7863ad75cc7f36b345baa54515f4568bebf145ff4e524227732e8c70f30",
    "tiny/marche-encoder/0": "8b0a9573d33b6a96225e851239d036c54a446725a68f65d32c2178a27427d735",
    "tiny/marche-encoder/7": "de790d30cfe3df6442e76a46305180f5e5d98feca70f679214955809c492902e",
    "tiny/marche-composed/0": "162c32683d322e5f51051e9a818549b0173b9bdbc98d5d481d4d10d1c3977b26",
    "tiny/marche-composed/7": "956adf053ba8c44248e0a88469fd084bc95c96312a7e6b4a58ff0d8eed6c1c56",
    "digits/nocache/0": "8b915503924d1ee90b4aa37bf6c6c41dad4aa785dca9204919ce818978f8d947",
    "digits/nocache/7": "4c199895fdc4c5c5e2685a3ba28bfa3c9e8092d5d7de8968ade01fd3aa078ab4",
    "digits/lazymar/0": "29fc4f56b3323c20675c0e5b065bba9c566cf396a6be09ec5950bd8d4788b40e",
    "digits/lazymar/7": "97d9641aa657972d15b3c14652ed173604077e70379d580635459da1f05beb75",
    "digits/lazymar-token/0": "90d8e64f620b5d8a048e0470eab86a8e0141d8c2bc32b954b6ed34a6988bbf11",
    "digits/lazymar-token/7": "fff240ff81c3d3d68f9eebd783ea4e55d09e61553226b7509e37b661b886257b",
    "digits/lazymar-cond/0": "d8ed496a83939a54dbae10f07386bb987b19f6bce72dbf95d1cf1d9475c5d85c",
    "digits/lazymar-cond/7": "428149d364b00e5b3b4c1cae43425cac61df49133322bac78432ad5f82ac1779",
    "digits/lazymar-head/0": "fa5fcfdec949336428c61b80ec8972d67e72ef721fac4991551abcead8d5f459",
    "digits/lazymar-head/7": "39f66c478b1d95783d485bfe43bba4dbcc4a6aff047dc3807220a012455a6837",
    "digits/marche/0": "aa08a90eb8e473800ef059138ec952a5e333b8dd0c24b6a6131776355c43db73",
    "digits/marche/7": "51d1ccc2e0ad2d85ff5c831a24aca444c1067cb2d1a3e6ac0bc1d4629b79761f",
    "digits/marche-encoder/0": "cb7f327be1b4bdc534fcd04f6027e02d4d99cabf0d9015b160381a34fe49027d",
    "digits/marche-encoder/7": "323460375641a3d2dd566ce6acba45acda90862ac04e7bde63763c0ffea02575",
    "digits/marche-composed/0": "c9d99f8c43997a6d98042becfa455e4eb0081e05b389869813040b09e2e36bf8",
    "digits/marche-composed/7": "cef1d9ebfe728dc7236f0e1f6775b9f0741754c6d5f42fb44cf8d976c6eb9fd3",
}

HASWELL_PINS = {
    "tiny/nocache/0": "810388a8d2aaf53f91c834e32b16fff6e865a15d1494cb82700cda1dcfecee1a",
    "tiny/nocache/7": "c0a083bf5518a46f62faa6150f3e3fd1144749cbc4b004efbf11454ffa893f18",
    "tiny/lazymar/0": "e57b916401690f92a416872de6e1f7aaba079903970e7a88af818d232bdd9cec",
    "tiny/lazymar/7": "49fcdbf6d6cd972d3881d3b3c79ee40bed68bfc0cda71709f09f15119e1ecb40",
    "tiny/lazymar-token/0": "a8a83387215914482a3a940c725d5b2f029f247a8ce86958fddba3958a25f7d9",
    "tiny/lazymar-token/7": "3900f0336e91280d5505aaa62d794a20530416249e86757827ee81896c48b9c5",
    "tiny/lazymar-cond/0": "49885de381e773ebab2fb14aad1d4117ea20520c74271ed422f89d412acd9e33",
    "tiny/lazymar-cond/7": "adca40c5667172cbc19dc77dab67cb3a1c2ba0bee24c08753d1ac73257425a12",
    "tiny/lazymar-head/0": "4cdec4e70971364722d1964ab4c18a2abb7cac0e0b65ab89c7e9c1d840ac45e9",
    "tiny/lazymar-head/7": "c31b7ddc2f62783cb4c24c3f7fc626ac44ca837bf14bdcfc498d591a320bc29a",
    "tiny/marche/0": "c69b40c1d442ea16ab38601f3b51564541ae9140f21fe02daafb4e16be376618",
    "tiny/marche/7": "6946fa245199d027ba4620d4519139c64a54c16d81c6e914e5855e3e10540908",
    "tiny/marche-encoder/0": "b6c723dd75d6e5dc85cea96eb8d2302bf9420f6e3132774b955258846040e8c3",
    "tiny/marche-encoder/7": "4d55b879b402c38d8a6e68078365dde51acc0c9836debdd2659628a2e9542796",
    "tiny/marche-composed/0": "0989e2c920e61cf94e0d14c58c8a10cdc8991345379af6b1f1a63fc3b7fcffc1",
    "tiny/marche-composed/7": "edb1ebac7be64a8df9c80ac75fa20479ded776fbbe72c9364a9b3d71a9b79acd",
    "digits/nocache/0": "cd75cf0d0540a234ec764287f330aae50572e345c4042a17a81f90593eaac791",
    "digits/nocache/7": "32ce7a15a3a3cc458cdf7d3f0e9dd11b7e2bad03910ab30ae478ba077acd75a3",
    "digits/lazymar/0": "b5df3501652fbfcade7df4d4741da9297accd648133023bb72759f7567210a68",
    "digits/lazymar/7": "abd8df0b00f5352e21dd64cbe722b896fa468ff925122e77cb57cd96380f96c0",
    "digits/lazymar-token/0": "40bbe7cc648fec31c2f9ad3e1d78f6efcd0ff7f9773629856da04766c205dec6",
    "digits/lazymar-token/7": "e3dc466624726fe435d00666241d691e66c05a29fc007cbe226eb9270067ad5f",
    "digits/lazymar-cond/0": "889638ceca72970e23a439d1d33584979825e18d824cb7edd7131e474cc8c478",
    "digits/lazymar-cond/7": "97f9ea29491613b05322007b84e7c3786a352c96a3b7b7552b1ffe4ba6c7430f",
    "digits/lazymar-head/0": "320d2d0ff5b6a822b582406a4fb78be904d6af21e0d5fc4293d1bc2bf8239973",
    "digits/lazymar-head/7": "ea8c3052b6bd9e149a59b0d57355e7a8eb230bf3722fb402b149f8ff7b1d95d4",
    "digits/marche/0": "5ba6ec7b4f74783e7564a1dc7ecd82b3c767099e1e76a08cb32110b3138b29c6",
    "digits/marche/7": "5248ddd5896036bc4951b4f48a3ca0109c08e9cb958013e2ad539d2f8d7993ae",
    "digits/marche-encoder/0": "67ba903d4fae23c9099c9a5bcd58151fee1aaba68302a339f7bfc400c9d195bb",
    "digits/marche-encoder/7": "ecbbf9bc2785deb670537c52101493f19b48d8c23105fa0b9d1dac92a0faec90",
    "digits/marche-composed/0": "074ce0d6b40618dafdef029ddee82771c6deecefee6f6458bee42cc987192965",
    "digits/marche-composed/7": "10c742ea36ca4110e903c366e2fbcd6f09ae048cc9be69090a8cc29cc08c2f2d",
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

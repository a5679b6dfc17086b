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
Regenerated again for the head's SiLU: x / (1 + e^-x) on mc_expf instead of glibc's expf
(within 3 ulp). Every entry changed on both platforms; the SkylakeX table is the same with
MARCACHE_CPU_ISA=avx512 or avx2. LayerNorm's double sums in 8 lanes (b2faba3) moved no
pin: the commit before it reproduced the SkylakeX table, and db14921 plus that change the
old Haswell one.

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
    "tiny/nocache/0": "64fbf28bdc747e4f1158da838ecf3ba48eee64524d41995377aa6b5d9a8c0b62",
    "tiny/nocache/7": "1ac4fede6da98cac32c8687ed548ec38d7c4ea6d57ab31a7433d4f202891fe79",
    "tiny/lazymar/0": "feaf1b9cb131f65d94e2b882b226b73e55f17b63535e2607754bb3e3e1281bbe",
    "tiny/lazymar/7": "8bd54a44b4d407bc473bc37556c7472d428366d2f364f0a78e78e30158fced63",
    "tiny/lazymar-token/0": "edd7f828dfb1a2c6e9a276af02b52a7e688277c6c6dbab71e604bbe369133c55",
    "tiny/lazymar-token/7": "352f021de19816c743890ff9d6540979ce198980b8738f9684625ee963c8d2e0",
    "tiny/lazymar-cond/0": "437659e2a17b013f8d6faab6e659d4c06eef694be6be3292df12beae17fc225f",
    "tiny/lazymar-cond/7": "e2445bcd2fdc5e0bd4445e78bb7fe5725cdea16d46d9b028b7a6ccfa0619e9d4",
    "tiny/lazymar-head/0": "f1c94f2a899dabb16a18578f71118ad005267e543c40835f56f5c8a8c81e92bb",
    "tiny/lazymar-head/7": "234eb0faa26c8acbdf953f2ac6382c31a72a39dc8e3c09894f4442e454a95de7",
    "tiny/marche/0": "23b7f3da4d70fe4e2141375f063126000edaa7e8b1c637ba24d20a44205d16fd",
    "tiny/marche/7": "8df44b0e7bd21c772012b23b90e8ab71df51dfb3166aaf2158ee5a78f43aea9b",
    "tiny/marche-encoder/0": "78baf751f6a8fb2b0c543ed4ba7283d51284a9a1e01a6c72ca3932dbfc21860b",
    "tiny/marche-encoder/7": "1d4b8bf8969574af278d726c70413aabaf59515f1d39372cfb7eb76afcbd7cc4",
    "tiny/marche-composed/0": "77cf21d168b6b17ce13c5317855c14b9223376154ef63bb9eab8a8a75c4daf52",
    "tiny/marche-composed/7": "dc719e551ceafcd9a8d0ed8d9cae20000d402a972ca348cf8a91611260faece2",
    "digits/nocache/0": "8b506987a6633e92d4ea7e5eb56a2570e7b1351e2b1708b12b1d8725413f0b66",
    "digits/nocache/7": "918d9ffd012269f13d408a8c355d660c37106c852373719c6ec91bdc005106a6",
    "digits/lazymar/0": "ad520bf9810a9706bb72575b994a30439c1e48de85490eba1841d6df42c45ad8",
    "digits/lazymar/7": "ca3e34685e20d753df46d375e38709369e5a5a9efd876c47f8a1e09caed27840",
    "digits/lazymar-token/0": "5ee90760e6b5c561a64f36b9537b1e0bb1b70d30707fd8e069de25c5d88b7b20",
    "digits/lazymar-token/7": "96c1b054b32615f0caf8029ea701582ae27a0e7b3d11a64265be6adfe8916d8a",
    "digits/lazymar-cond/0": "1c740e9d2502f6eeea22d3a32cf2c2ceab74a23d373083842346f7cbbc64b23d",
    "digits/lazymar-cond/7": "9fd43c3d91b570dc040bf083f736983b5476fa5108321a951b40121cf5e60524",
    "digits/lazymar-head/0": "d396665f0054cd7c0ad8640979ad4ca022f927da4b9d72e6944c94680c757836",
    "digits/lazymar-head/7": "d34b658aacb778b851eeb497ec361558edd913b57efd5cd1bdb7fa3074805f79",
    "digits/marche/0": "b06f10a49d18b1ad1e9d5361043ffec95173f159d6fee9d1cf4468406668de11",
    "digits/marche/7": "a4c85504e58eabebd87e58d65dab3038db941ef4e7c4bf8d4ad18e49cce00b8f",
    "digits/marche-encoder/0": "9e1b31d687f8a58858f61efd0fc0a68f9ae71d9ce7c7ba6c3e5fb9bea9178386",
    "digits/marche-encoder/7": "9a243a22238d4b3610bd685e5b076cfbcb22be92cadeae85ae651f6aecca2343",
    "digits/marche-composed/0": "066d3b7afdf28354e60a6cba9d1885f0dd11a788ef8303aeb1d965f53b9e750e",
    "digits/marche-composed/7": "660a8190b272df4d0189d5b1a4a7bc81de98c02e4fc4d15301053d5ba301fb26",
}

HASWELL_PINS = {
    "tiny/nocache/0": "856437179789b104c06e483c61f2548132d05c8f3db9cae7a2979bad3e99427e",
    "tiny/nocache/7": "c2ef2b46323d610005d304b7873f962b52fb7fea7d2e7e8055b046512f746754",
    "tiny/lazymar/0": "cb06905fcaaeba7eb9bc73c1acefb23ebf0caf0c1a5e937b3ee2b21bdf6f3272",
    "tiny/lazymar/7": "c033147e2727a9f23e47ab1a8776deedb262fb412e285e3b5231fad3489e18ea",
    "tiny/lazymar-token/0": "90c4a57995d990d29efd70659811732b3e80335f8cb699e75e06a914a5fbf63c",
    "tiny/lazymar-token/7": "99ca0ae1d6b0643ddec85b6a8d829c5ed84b3d62b2a954f94180500f2ca897b2",
    "tiny/lazymar-cond/0": "a2f0b9dc0f621a4c5e82dfe0fddd68e24f1dbd11265e757ff4f88c1f42db587a",
    "tiny/lazymar-cond/7": "063307efc65a3246605b585bfdaaa71a10d78f17c72bacaadfc70f333d5f7472",
    "tiny/lazymar-head/0": "74176cd12a0b70091bdc2852651341558f024eefded3e3483a80f1c84997275a",
    "tiny/lazymar-head/7": "3c48aa1676ca5b189a0cbbcb03ea7de490786ba50e2dd0a14cc4d27d931fa057",
    "tiny/marche/0": "40335e91d90e6607447ee52edf6f8990971b14fe369375e4dc321b9a1cb1bd3c",
    "tiny/marche/7": "72a29661d8ce9e2c854b36c4c16ae79dcc4ade95926faad892887473bee50f96",
    "tiny/marche-encoder/0": "f2e73e0e3b10b42ad57fdde5e9a278d96591811f335da715160051491b75a4a3",
    "tiny/marche-encoder/7": "9cc1df36da414ed8b0fca761ad5831787ba7de30076ff38ad5638f35b239e70c",
    "tiny/marche-composed/0": "ee81bcc08b76c7f41bac0d8ddc7c0a1b6d86f8cdd2d7186640263deba4fcea27",
    "tiny/marche-composed/7": "2467e8eecbdbfcfe22c2ccafe3d643ff1fbb5ad248fa5e29187d28e946dec36e",
    "digits/nocache/0": "0da09dabcc0bf1cf1d2d7c3c7ad0a648b7f71d8555edbdf8ec46b08a90916b68",
    "digits/nocache/7": "9166e1690cce1dc1eeab401c9db2e5a1ccf910fd066d474dc8679ae7c6fe3d2c",
    "digits/lazymar/0": "40d6bf5978f8e6dcc449e3df9d42317ee5b99a03cec42d9f74c84e626891093b",
    "digits/lazymar/7": "6b613d88641107ff79c5e03bb04d1545170358eaf4931f2dc24f3b6f721048e7",
    "digits/lazymar-token/0": "6648bd951c65812e80179b9dc1313e7e8e70f94484d8a3fd3a028a79f68ab67d",
    "digits/lazymar-token/7": "3fd61ff44b7c759374cb049ad9b15a9656652785c92385ef252e264c65bef67d",
    "digits/lazymar-cond/0": "dce09340deb825810fbfd1f5396f33a8cf80b280fd64aad8f5644df9cf91ad14",
    "digits/lazymar-cond/7": "eed8001d48d357205ef653adc809ec2518dd09d9a46c6a4c9125917aabcbf27c",
    "digits/lazymar-head/0": "f867503937679aff7eb2230348d2575181fd2a9a0a5cd76d7439ac0ac9f3dd54",
    "digits/lazymar-head/7": "da592ddb59ca5258e2d3b911e37a86710d67cbff779cea125fda1cb580e77cc9",
    "digits/marche/0": "895e0954c798e9180faf365ed9122987ec7bb38f88d8ae0c4d9326c66da1f812",
    "digits/marche/7": "1e83dd6e00074baba7e78712ddd42ab53f12404eb80e00686b9fc942f82f46e4",
    "digits/marche-encoder/0": "c38dee7781415b821b6633fac078155ba33310e8541e582b7bca4213869161ce",
    "digits/marche-encoder/7": "e29b6c5abf6e37434043151e78e3bed3b62087a88602ea993cdfb20c187d825c",
    "digits/marche-composed/0": "74f4115c7edd801ce63e8980e622837f220ce05391b703390c4c9df180ee6967",
    "digits/marche-composed/7": "027cd36ff64625e2025f800691cba20c1dcbec0f3c7d111e4cff95fe8d729a5a",
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

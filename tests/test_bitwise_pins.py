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
    "tiny/nocache/0": "3f51bb5f6150d004804f0bb04d77419fe749fd752fd461e270f2fde8440b56cf",
    "tiny/nocache/7": "5b985d0054e5856d7d68a011574c7a706fa4f76e3d247e537fb37283bb856636",
    "tiny/lazymar/0": "f8ab4c9199a44ba3ee1019fcfadfe01b7f07cbae7d96121d2e09dc113fdef072",
    "tiny/lazymar/7": "4607e4a30c2f08deb8935063c15d54d8c62a062ec92dc4e1046ab373675d8c92",
    "tiny/lazymar-token/0": "dfedd61f9b59483ef633495c7d51778dda5112e89bd2411397c9a7aabc86b173",
    "tiny/lazymar-token/7": "b736011bafbc67cd8cf320350483cdbab7b739b6685c1b67338a6c8ddb3f9ed2",
    "tiny/lazymar-cond/0": "d5f263b3be0ab816d8bb8ead403e14220b01fba93507bf0c9e3128d05499d53d",
    "tiny/lazymar-cond/7": "7013912451517a8f2630c8532d00a825ee767bc5c6aad4a1afba123ee01a4803",
    "tiny/lazymar-head/0": "ca63c5e5f27e378e037148fa40b9ca8409e7cef6c3be232544f82a8ba76b9171",
    "tiny/lazymar-head/7": "ab3316da1f61a7f84a93b40717aee7a28da127b67b6af994867bc052d8c5c048",
    "tiny/marche/0": "9655683481d41a1492dfb6e64731a57833a6879e4309d07ca8c7c1cbec7b6fd2",
    "tiny/marche/7": "a780afd1e214b89827a87fff6c80b886b0ca4112b8200f56ed061b85a2d3227b",
    "tiny/marche-encoder/0": "b7c12b9b419bfffd8c367ed36d344f93e4ccf195d54f94572012bfdc10080cd3",
    "tiny/marche-encoder/7": "265a327c1b98c87f3b32881bcbc8c4a85aeacc0c7e048d6fae90e996ef352184",
    "tiny/marche-composed/0": "14bb4713f1ac1aeafe46ce6fb3190a386b99799797e5e4123f0e4acdd84faa24",
    "tiny/marche-composed/7": "408cf29de12d97eba99a5948c5b35fdfe8d8a69d30b12b7311397f8df5acdae4",
    "digits/nocache/0": "433e191d7a97bf00042668f5ec9842f6f413f76b5780c39fddd229b56984d29f",
    "digits/nocache/7": "8dbe5ee674c5a71630095f634e962385865f452960fb452798273e95f41dfba9",
    "digits/lazymar/0": "761af9cdde167bc6a31fe81272f10f8570e536fc4f2db21fd0f8c40f4071aa7c",
    "digits/lazymar/7": "77a97bade047301a2858353f824e641074ec529d2ea8165e2af32d99699a64b4",
    "digits/lazymar-token/0": "adfd494bfe5423864edf1b7a787c3e2e4bcf7544e04d0a8f9ab01baa2f490de4",
    "digits/lazymar-token/7": "b2232de6f6525f88ab4b280a1cc3ed16f0f2088ce94554d413343c4b19c77fc6",
    "digits/lazymar-cond/0": "7dac7940f55ebe908dc52a8fb8eadf90f153f809b951fd045a6fed72d260210f",
    "digits/lazymar-cond/7": "9dd7838b1cfd713f55bfcf78c662023f2413ee50ffa1cc1f9cdff1633296f490",
    "digits/lazymar-head/0": "e2eb46357d7b083a733fa26fbc7d189f6b1aaf687f83e60c2bfedae66f316565",
    "digits/lazymar-head/7": "2f73fe892209cab054e373d4fbf70580ab2bf790b279e6992106d2c6d2ce890c",
    "digits/marche/0": "04697ed2edd17a91f261479a3ac408550d0bb0c3a6ed94f50ea06050e54123cb",
    "digits/marche/7": "408ddccaed6f128822bd36246bdc12bb7e9eeb4288d4e62e1fc65c22508fa709",
    "digits/marche-encoder/0": "b49d228b0057a293fc6562a5ee0298072fb15df007df23572d6ed1a077314e96",
    "digits/marche-encoder/7": "a6ca902b757aae98c858bd84ec118b111b0bd2335f54779aa593af83ec18a143",
    "digits/marche-composed/0": "d48b4751c11d66c2fb93aee6ea1da3f305d45be1cf18f3fa57576d9c524d0289",
    "digits/marche-composed/7": "ee90c1fa403c69fb95e0b0a429b932543a7b8dcbe7a2daf6e7605f0c9cadf03f",
}

HASWELL_PINS = {
    "tiny/nocache/0": "26526efba5c8887e004297aac1734ce4820bcfb2fc51ac70468a3b15e4f4a122",
    "tiny/nocache/7": "a2b91d44809d732a7f44124147660b00c7361ee0525f0c19f2cb12355e7b9e11",
    "tiny/lazymar/0": "4e49770633db08ad2590b4962d18a2ed5b9815b541048c8961d177f37900a170",
    "tiny/lazymar/7": "a3fdac7408e08fa0d938c1e3925d03a5f6a119aba039e43a050ca875728f997a",
    "tiny/lazymar-token/0": "0e2df2e0e9fcfb282c4c465cd3ddc75cd755ff27c8a77522258b9a1ec5ac2429",
    "tiny/lazymar-token/7": "db25dee1ba4eacfa4bfcbb972b854d26f8956a685d67c7a97cc62162aa0c2459",
    "tiny/lazymar-cond/0": "5c0af3f065471bd598c05ce24fc677d74e156dc718444a92230e97dfcf81c16e",
    "tiny/lazymar-cond/7": "1d2a95adb026d8424288fe8d12342a4f4a837e66765cab6d5ed7ca70750a0094",
    "tiny/lazymar-head/0": "3d96608c5ea056d50c891ebf89c23939cd20e549bc1181381a04a2d3714c7896",
    "tiny/lazymar-head/7": "79751b6e823c0eea885ea8aeec80cdc2c6aff32bdc261c8771fa58a328c25d71",
    "tiny/marche/0": "a9231aab19e0d2cf5e36425b54913b6515ade7d0f63147315b93dd98277dcdc2",
    "tiny/marche/7": "3fee131693f172ffbf85deb24f62a13ed112a29da28b70bd2aa312bc096939ab",
    "tiny/marche-encoder/0": "45a356a49721c256fb4d02057a481462071f8a579bbf32d4944c6c21a898cf6a",
    "tiny/marche-encoder/7": "d9f86e0aa0da2618fa7b01b8768f95b4112a6f764c505bdade18e775a7599856",
    "tiny/marche-composed/0": "4429c944cb3c1f977d090053c39506afa29c4848be161e8c9571bc17ddabfdc9",
    "tiny/marche-composed/7": "80dbdc21a84643c6a42c93aceceaf3c4320219031c238f13f3d0190516902feb",
    "digits/nocache/0": "07ec58c4a21c5f5e61888adc6d16c3d3a8016bbb6fd21de818047dbb51377e11",
    "digits/nocache/7": "c7a70f2f906389898dcad608b2ec04be78abee91f4def298d1b9a75cdae5b7ea",
    "digits/lazymar/0": "9a7c6107e27607e7463b232d634ebcc9e7107a112eeb9416d9f9f26142bdb802",
    "digits/lazymar/7": "fbd2530b8eb29126be5258579e8409cb2760e902f70bfd76a38a7394d0af001c",
    "digits/lazymar-token/0": "88518e2c0a0b3098390f48576ba4670e1461567799a4f9e96b74ab8b216e45e6",
    "digits/lazymar-token/7": "66ebfd74b8d02d56d07ed09af6834019b443f4866e753a6e1306c98f2b0b9ebb",
    "digits/lazymar-cond/0": "87253d7233c890695dabf8d030a633e7f6e1f5506763a51c384fa3a48595f8a5",
    "digits/lazymar-cond/7": "4c808ff0361f6cb63bb6ceb1935913905e8c2d7082301ad7100d62655d4c0e7f",
    "digits/lazymar-head/0": "fb69a1f76fa1569073646b816af039831ddab5177303193cdf17c5b68cc0fa17",
    "digits/lazymar-head/7": "ccceed939e6f3b25bff9d5a819cca361613787077e9b4e2b2e1248a95873897c",
    "digits/marche/0": "598f808a012ca3e6d60814f6e57145dad5ea9327e218054edd3d7c307841908f",
    "digits/marche/7": "5e1a998e98e7c2efde66d583bf3247208457153810192325b4da319d48885c90",
    "digits/marche-encoder/0": "933237a864038a172a3d0706fa14c0e272a707f1e9635ae6db3add6f4cef5f79",
    "digits/marche-encoder/7": "e91b6d9b81c48c2e69ce4539878506368bf853bf066ed7036c5a6c6996eb5252",
    "digits/marche-composed/0": "bed76760ecad276e93fe377bde89de16da731c97df7350b1c1d430ac22a1e72a",
    "digits/marche-composed/7": "54f6a1eac5890f5db5944818eb30222e9f9eaa4ca9608ed701ce5daa167a442b",
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

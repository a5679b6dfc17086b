"""Bitwise pins of the engine's tokens, taken before the runtime seams were restructured
(issue 14): a restructuring must leave every byte of every policy's output as it was.

Each pin is the SHA-256 of the exact float32 bytes of `generate_tokens` for one
(model, policy, seed). Float32 bits depend on the BLAS kernel and vector width, so there
is one table per platform: SkylakeX/AVX-512 produced by the code at commit 896450c (the
last commit before the seams work), Haswell produced by 55fd814 (which matched the
SkylakeX table in CI), each with `PYTHONPATH=<checkout> python tests/test_bitwise_pins.py`,
which prints it; the test recomputes every entry on the CPU and, in one subprocess, on the guard
backend. A pin is not a reference (the float64 references hold the engine to the spec):
it says only "unchanged". Should a deliberate numerical change ever move a pin, the
commit that regenerates the table must say why.

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
# The table of each platform: SkylakeX/AVX-512 taken at 896450c (before the seams work);
# Haswell without AVX-512 taken with the build of 55fd814 (the seams' first landing, which
# matched the SkylakeX table in CI) on the development machine of 2026-11-25.
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
    "tiny/nocache/0": "1e45e468336e44291a31f25b2bae833ccc586e811e4a736cd3b10ff1a7fd0f68",
    "tiny/nocache/7": "33152c74d02ca09c5a856958bbc4a66b8f71e2e21bb5db6f8be9821146e7c75f",
    "tiny/lazymar/0": "79634fcec18b9a7f7ea7113666661dd0635fbb9e44ccae1e829bccfb7bced56f",
    "tiny/lazymar/7": "007ef4ac2ff2c087ebf6331789ebe2bdbe7d1217e9863757a5abde5d2b956ac8",
    "tiny/lazymar-token/0": "16c6c58d87e0d0664cf34efd9c1e72793a355fc6ffbb0cc6c731089fedc44813",
    "tiny/lazymar-token/7": "e7f46d297d52e2142d2be07797fe8d1a60df9d84e4374ae87374482d31d6251f",
    "tiny/lazymar-cond/0": "7318b4ef5fa8ee6bb7b3500a53a92aafe4e1777989f5f5e35112da19da0d52d0",
    "tiny/lazymar-cond/7": "4a41d37cc42254894602c7862bce993a1e6c974b34aa7c363474962266b8c2dd",
    "tiny/lazymar-head/0": "0d6fb5fdfdce924672cbe0482e7ca9157efd31ca9f98afd28fdcdaafc09a2636",
    "tiny/lazymar-head/7": "14e14add7b6648dcfe3213b00890e3f0073c6730f4285613dc91083b2716030c",
    "tiny/marche/0": "a2464c0dcd60876476af8253be56381a19ee52c6c41a694555d363fff797029b",
    "tiny/marche/7": "7f89459efaa8423de3727cad6b009001808275827d9b71f0f2e0311c285d3a69",
    "tiny/marche-encoder/0": "cb2d2be3bac12be89186b78cba848f4c08eb10e302f4e434420406c5d02f93c7",
    "tiny/marche-encoder/7": "b74766d992fc2098a31bd795962a577881374a4d3f1e28d97be734b26b5ab794",
    "tiny/marche-composed/0": "1127820dc44dac495746311a327582ffc2156284f611891fc7e0a64286c185ca",
    "tiny/marche-composed/7": "8637722842b0009a8c0f3633f9625d593d9d1a49400e2fa7108f6636ebb33933",
    "digits/nocache/0": "401f4b564ad6053ab8dfe001187b0352f7a56faba28be74cba68ba980fb09afa",
    "digits/nocache/7": "83bf58b39771f7fe913ede29be6a3ee1330026c8702d5db1f41960b99a8d368e",
    "digits/lazymar/0": "950e4a452d5e970e6df3a3ae6d88760d86899955628878f3a1d015603ec929bf",
    "digits/lazymar/7": "d871d8d6b44cd08cb5c241b038ae051f99f2fc167d78936c8c33f05f842696d3",
    "digits/lazymar-token/0": "ce3458ca8114d7fa8a6a2a7227a687305e83dc64c174372386ddbb903bcb9a9c",
    "digits/lazymar-token/7": "cbab7c73b19826c510e372d74458869d6c556eefc611dadd8c8d2bdd2c58f29c",
    "digits/lazymar-cond/0": "9a4e6c3f9872b2a9480624009043f0594cf6fa3dfe670bc080c1dd001454b660",
    "digits/lazymar-cond/7": "4fdd7af7ae13dcf0529328f37a0c65f517a615cc64eb90a4bd15306262300db6",
    "digits/lazymar-head/0": "825fe6a6539b7c122e9dba3d67e533bc5d94260f85e4358497d5afdb1ba90292",
    "digits/lazymar-head/7": "79d41424fff64a9cc2b1d5ce22af2410891614909c96d10751179c1a66e79ebd",
    "digits/marche/0": "e95eb3437f325b590227b73b1e1d35281c8a46d39b9db8a283f3c813eba3fb1b",
    "digits/marche/7": "45340d2034d201309656181f903e9f45e49ff091eac622ece24cf5ddd7e46651",
    "digits/marche-encoder/0": "6f1a2a02794036e9e22b5e424480b2e9154cceabd71253ab224e0b52c9676e8f",
    "digits/marche-encoder/7": "fce4a62337c5796b79e8a35988a5e20fe1b17ba83e10e05ac449554f3c7f45ca",
    "digits/marche-composed/0": "c7a85368499aecab1e02d67e437026a2897713fe0b4b0e4718248799baeeb297",
    "digits/marche-composed/7": "22138d6359fea1eae2716bd956c4d2ec45dd7481b6fa89484e15a0da22be3894",
}

HASWELL_PINS = {
    "tiny/nocache/0": "07a0a972b55cf5c516266c284878aee438cddcc8312cde3ec4f73e2982946a8b",
    "tiny/nocache/7": "bc87678752319aa1724e508133db1b468cd2bdb24e5a681f6f547c155ac483fc",
    "tiny/lazymar/0": "6ca9dd3b49ce194d24c3ba8e53b7208c08a507009211794d0525895509f7b1e9",
    "tiny/lazymar/7": "71cc46c8e2a0ec46953ecf1f700e5f968719a307099c36f8e601d5feec53ed56",
    "tiny/lazymar-token/0": "19993bcaf332d5ad9c3b61a355223ba7303b664c8675abd0b3074ce92b1844f9",
    "tiny/lazymar-token/7": "6565f2ff2e6fb8e78cf7586125ea1dac80fd1f25ecddea91de00b6aa282a3835",
    "tiny/lazymar-cond/0": "a462b83e97588e898a57d0acb25cde894dac6591bb685a67122a5bd3d9368f8b",
    "tiny/lazymar-cond/7": "d7e37c126ff78ae5864dc56b767c7838a54ce5ae52b3f753c66dcca4fae33ebc",
    "tiny/lazymar-head/0": "2aa1d1859a97dcec219ba3c7228767f178f1ce0070f795f8ba7978fde94e5d13",
    "tiny/lazymar-head/7": "261adc5aa8a88373791e2f09be4fb842f47d7c52a3d3fb1f70dc9dea460e17a0",
    "tiny/marche/0": "1a98f92f59c4894eb17400fbfcef557872021c6788402046113919580d5f4ee8",
    "tiny/marche/7": "1476c0eab4e8d873d17aede1f6bdf8065e7989751847db75d0490c9690547d70",
    "tiny/marche-encoder/0": "619404db2b6646069483b1c45b787f711e418eaaffc12e49b655fe9d65037246",
    "tiny/marche-encoder/7": "fb61c663439bdc1fa657c30ccba12aaa3a35df8b9eb90dd2d1988570d3a93c7e",
    "tiny/marche-composed/0": "fcde6bc082bfea2d703a8a9b752ebf021a35a2d2ff19f9acfb185d23c380d695",
    "tiny/marche-composed/7": "2f8d1b3b39d9bb8fb64da1007be81c89628650e01255ecec1248202bef6fc2ba",
    "digits/nocache/0": "297a6bc42e8e3192ae37f3e6098e69b256936cb176b26130f1b2e2d5186ff9e4",
    "digits/nocache/7": "784e80277fdf25b3bdee78f4efb65db169cdbbeadf021a19edea8a37a1f29fe4",
    "digits/lazymar/0": "d041acb907c90f2e1049f3bb1aaa592bcdf3a5b94dc2b9158225c70fecfd76e2",
    "digits/lazymar/7": "757b4aa0ef85fccb662c45addab3b239cadc86a54e9e3510c8db3929825a1057",
    "digits/lazymar-token/0": "015cbe12890d35947749110a48e38991d82a80442ecb35687fa8d6562d9f76bf",
    "digits/lazymar-token/7": "b760c081d72d0a1e41a9df3e11868ae22712a99a9c593a9808aaf81d9f9c2101",
    "digits/lazymar-cond/0": "3e98cc650c3d6879a8d88607b11d07d22cb4c143275288d6d2aa0e72a5d1e793",
    "digits/lazymar-cond/7": "415546acf968a346e653c4a491b5c91437be50cc76322adadd7378144e2c2df5",
    "digits/lazymar-head/0": "f6ec97db02acdfc9502d15b960c2d138fc2161d2a5a13aa16d498f73700047b4",
    "digits/lazymar-head/7": "95c3f68bd7a0eab8f2e994502aad03a361e01f629f303230d108b00f5621a75b",
    "digits/marche/0": "09568be138510e97342bedb8767ca28728b4c6d7c9132ee7593f7b99ea10605e",
    "digits/marche/7": "edbb69f162077a25fd0bcefe166068e1aff3546b4c114a50e2c8fb4625457e52",
    "digits/marche-encoder/0": "275edce960acfa0a4ac4321952dfa916ca8a7df450b02d981b7ecdba4a7a50c4",
    "digits/marche-encoder/7": "029f03473a95589ab54377f6a3d00dc4db575c94a190a9687635d6a35931f77e",
    "digits/marche-composed/0": "43f875e1117e3c2f235b2393451831bf2a3cbe630b685eade34eb6356e1dda7c",
    "digits/marche-composed/7": "d7133ae15497d4bc46269fa027aac78bcd4455deaa1ed02b829d95b066b1046d",
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
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
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

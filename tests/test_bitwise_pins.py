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
    "tiny/nocache/0": "6999a6b8ecef4b4f81eed34460d49235167af5281b1b4e045f0a398ffcfab6a9",
    "tiny/nocache/7": "7d0f37860800e3a3d7ed626e46dbe5ac3ca82624fe2c9f65aca554fd256b9a6b",
    "tiny/lazymar/0": "ca42f9b4ce4c7c3d789961c88e3e3afe93b4110c2514a0bd75161c395406516f",
    "tiny/lazymar/7": "f9230f2e4e3302d6749bdc7a814798e1210f3f478e7353650089ee725047663e",
    "tiny/lazymar-token/0": "2c1a69254d3a6ea89cd72155ffcc9ef222d30ddd9d1f707d4b4e197309af7990",
    "tiny/lazymar-token/7": "7c185ee4f0e76aa7cc6bc423d6161ab4dffbc1361b397b53fce4312626899174",
    "tiny/lazymar-cond/0": "c4d417cd1bf31cd071d7e96228311b14e08b6dbed4dd40887149faf817cf2b9a",
    "tiny/lazymar-cond/7": "cc3ddd428e0b3ee409297f17bea91073d7aab9e73cbf997f65faf146b94cdd8e",
    "tiny/lazymar-head/0": "c18f4036db64b04437c54a9396453341e042166ecf77b02337a5c957e498cb73",
    "tiny/lazymar-head/7": "c7c129c6a28308cd9e06c2e8ec9721ef49f8c57d78f0ebd0b702c35eece01ce8",
    "tiny/marche/0": "7938d4edf6b013931d5b0d43c1fcb69b50edb139016c27650a05f9641420a14d",
    "tiny/marche/7": "e4f4ce7b24f9e1a1a4b0db7c85719a25538a3c9c7bb658eff2b93778178af321",
    "tiny/marche-encoder/0": "b588030a297dcc6f1f07635548400456afc3cf2aca630678373bcf5987c73997",
    "tiny/marche-encoder/7": "df76b7c4531d8ac980eadfee18b3d41f23c0bf845d0c43ecdd7a89b448d39aef",
    "tiny/marche-composed/0": "9c5529e762601a3268328c26c67ce636f62e414cb568693f8fb8bbf3f8d8f479",
    "tiny/marche-composed/7": "f05efc0e934407692408d783ec153da8d31f1ad767ffa76532f27805026361f4",
    "digits/nocache/0": "c21b53c55702ad96d7718c285ea914342fc3e1b986e88f8056bd643bc18e78d2",
    "digits/nocache/7": "a905a8e5a2ac9e3502aa5af953e2e5feba3344ae0f56b5a65ef6fc273e20f008",
    "digits/lazymar/0": "2550f748a267dde59569f856b00cf83c2bde6951f420baa484a2d615454a3014",
    "digits/lazymar/7": "e985d08c16911c05c61ac54142c6144233acabfa1feb93addfef55f5c06a817e",
    "digits/lazymar-token/0": "e66fa9143eb24aa8c6cf53a3deabb2088e7b9444df7addac15aebfee21ece7ef",
    "digits/lazymar-token/7": "969a920516fccc4ace5b88915365a7475a45d990dceaceb91101714243a84b78",
    "digits/lazymar-cond/0": "420bf39e069fc370b8ed8b7bf28143f374723321f204ee6f52ed1935f0d4b897",
    "digits/lazymar-cond/7": "9ec5a2feb05465d929b49187d588e8ca1d4bff9f3f531d4c9406d9d6bc621b7a",
    "digits/lazymar-head/0": "075080c1a98632448b0d3c1245ed6ae5e65c82f800ccc0725229d9ef3d441fc5",
    "digits/lazymar-head/7": "475b9928fe45d615ee04f17018ac4d54ae31e4b9efbe8e792768d7fedf700124",
    "digits/marche/0": "78d9d9e21c074a5ccb73fbfeece3767983be7f298663483d3c62b98ca2671daa",
    "digits/marche/7": "c1c1243a9779626a83b00b98613f164a04f7429afdf18061250091405f12a0b5",
    "digits/marche-encoder/0": "586927f6a15de03dd886659d60195f301ded56157f08de2e188a5646c17be04b",
    "digits/marche-encoder/7": "d4ef530196338b27ff3fe12713c5612d9bb7d56cb898476297941e11161eb6bd",
    "digits/marche-composed/0": "f8b8f07324efdd2773dd4dfe04fd3028eccf5c88d21d16608b55dc6a781e537d",
    "digits/marche-composed/7": "8e988c72f3dd8388cc8c7a0c69b0840e4e31aa967b23acfbdbf0cd53fcf9f2f6",
}

HASWELL_PINS = {
    "tiny/nocache/0": "092c21ee7d451a751ce85d35d50b9a77f64eea673620300b3c1e7cf215ee096e",
    "tiny/nocache/7": "a3f97af550481d7560cbfe88b7425b762c55e6a2bed0675bb903c51c1f909602",
    "tiny/lazymar/0": "cc9799c483fae6b586452d323482b9b4afd25fb26239c0a3131c5d6976b20d43",
    "tiny/lazymar/7": "66fe45a4318cc4e2bd99866f72f77ad36d624b3ca68ec8bda708f21662027acf",
    "tiny/lazymar-token/0": "63ffb3f5e2f3a8300be8bc70663d2fd16dfb9e323536da4646d3b73f8001f8a5",
    "tiny/lazymar-token/7": "08d8aa71c0603fe354725f09c31d0b3d5336bc6c0b3d689c213a5f19462a1a25",
    "tiny/lazymar-cond/0": "0b6d550f2cec29b42e72c31b2280fcc5c7d3c9c274094036eef7a679e56bdb53",
    "tiny/lazymar-cond/7": "05e1bd05eb2fa6ba9ade82970e62618513da37007ea6a7e90897e967530d27db",
    "tiny/lazymar-head/0": "95c46d3c168066c449cb893b63691413c6b0d40d704ae28070c2c774c5d99cf0",
    "tiny/lazymar-head/7": "669741deef5f3241387e7326b461c7535a919559dda73801d363b2290a4f64d6",
    "tiny/marche/0": "4bf1c185f05e19ae3e1a40199b3ba891218cf8cecce5c05c9ef3bc42621256df",
    "tiny/marche/7": "2ddcf2c726e3057a249bb31f8cc3efb6a1409cbffd24bf2734690873c30c94cb",
    "tiny/marche-encoder/0": "971b4a505d3338bba09c7cdb68a5781a96786f826e48b36e1cf9b1b6a018a626",
    "tiny/marche-encoder/7": "91f1a9f253bc140fe1b32d451c609c74c76a1527efcd9a135c811d3a7eca87c3",
    "tiny/marche-composed/0": "26d41db0588747ee37f1de28b14383c1b52315e9c89f0e844181e2390894b7b4",
    "tiny/marche-composed/7": "162cdc43f704c487351de119e7455c83d0438883fe0934d39449daae677f1cd7",
    "digits/nocache/0": "1fe0522d4f1da5f35e5e7bbaae18db73c7a4d54a9578137eea70f154dbb4df39",
    "digits/nocache/7": "371c35ae4845d6e2ff025611c99b057e057b562dd01ec278db72311e6094a787",
    "digits/lazymar/0": "811875a6849018efe1673e9f29a09885fda4ae437e04b5389ff7cea52818b287",
    "digits/lazymar/7": "754135989d2ce8acc7e849da3c8e288a6058c0c6f090b274e8210fb99c14f440",
    "digits/lazymar-token/0": "c26d5838cc941c0d51abd43b3ee66bd5bc5b98408c745a156ee2174297438f5c",
    "digits/lazymar-token/7": "9fa5f3565ae21d9951400abde101ee82b0f118ab61a83f7842bdae109ba7c622",
    "digits/lazymar-cond/0": "fb829c009430c8025044062522f378e95ec917be18a26619c7810e7db94ef7fc",
    "digits/lazymar-cond/7": "221c094d57806455d1bacf32f6224ab05feeea5a500b5db1f59cbabcd76ba129",
    "digits/lazymar-head/0": "3b61b6cce64e6710b46f212d01004374cf8a8355c7a8ec73c0d9e75977692132",
    "digits/lazymar-head/7": "c5ce64d6355a0126eed295b42df40f3d77480492fef7ef950f83eadac66f4c18",
    "digits/marche/0": "1402c2c9812b8408370a29f9bf1a15cb44d4a589421847715515eeea436770fe",
    "digits/marche/7": "709621947300fe63f3ed86341ef8c1b68d8381459c1fc68b3072faee037fb81b",
    "digits/marche-encoder/0": "209d5e5d178678a67b68c71b91b4ad56311646f0fc4d02462985e33dcf1ee12a",
    "digits/marche-encoder/7": "c2057036adfa5366d223826b471e7cd9a1ef1717411b6d4c54d4b7ff0a8d3f48",
    "digits/marche-composed/0": "944eea6194ed76fe7bed0b21546c18c11cafcead5d50ee261ff9bbc3ca1e888b",
    "digits/marche-composed/7": "bca8ced5e1a805b56a5b33741e3786515a75b5a441093a18db93061c440db3c5",
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

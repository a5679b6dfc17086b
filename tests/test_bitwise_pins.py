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
Regenerated again for issue 23's column panels: a bound fp32 Linear of at most 256 rows runs
on panels of 32 outputs (csrc/backend/cpu/cpu_panels.c), each output one fma chain over the
inputs in order, instead of the lane kernel (up to 96 rows) or OpenBLAS (97-256). Every entry
changed on both platforms; the SkylakeX table is the same with MARCACHE_CPU_ISA=avx512, avx2
or plain, and with MARCACHE_SMALLROW_PANELS=0 this commit reproduced the old SkylakeX table
entry for entry (the Haswell one by the same emulation).
Regenerated again for the panels' second step (2026-11-29): x is packed inside the team and
run in L2-sized row chunks, which took the panels past OpenBLAS up to 768 rows with AVX-512,
so their threshold is now the ISA's: 768 rows with AVX-512, 96 with AVX2 (where, emulated,
they fell behind OpenBLAS from 128 rows). Calls of 257-768 rows moved from OpenBLAS to the
panels on SkylakeX, calls of 97-256 rows from the panels to OpenBLAS on Haswell: every entry
changed on both platforms. With MARCACHE_SMALLROW_MAX=256 the change reproduced both old
tables entry for entry (the Haswell one by the same emulation). The SkylakeX table is the
same with MARCACHE_CPU_ISA=avx512 or plain; avx2 now takes AVX2's threshold (it emulates an
AVX2 machine), so on SkylakeX it gives other bits.
Regenerated again for the decoder's last block on the rows that are read (2026-11-29): its
queries, attention, proj and MLP now run on the predicted rows alone (and, at a cache policy's
full step with the condition cache, on the other masked rows as a second group), k and v on
every row from the fused weight's k/v rows. Those calls have a few rows per sequence instead of
all P + S, so they meet other kernels: the panels instead of OpenBLAS where 2 x 2 x 320 rows
passed 768, OpenBLAS's own paths for fewer than 4 rows in the attention's GEMMs (at head dim 64
its results for a row then differ in the last bits from a call with more rows). Every entry
changed on both platforms; against the commit before (806ae33) every pinned output is within
1.7e-6 (tiny) and 3.4e-4 (digits, whose 16 sampled steps amplify a rounding) of its largest
token channel, the size of a rounding carried through the sampler. The Haswell table again by
the same emulation, which reproduced the old Haswell table from 806ae33.

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
    "tiny/nocache/0": "a7b72a6b2bb2df6a4e6ac9a05f7ba6f1f26441b3c9c00b34c7ea3fc09e810bf7",
    "tiny/nocache/7": "da6f5970b31a297258fe4bc480f3e0801856a0beed1fd576336fa9d614c85370",
    "tiny/lazymar/0": "7ba256f95ec41df108066710bfc3f31decfb9ea5869f0381b7dc670f4e6e914b",
    "tiny/lazymar/7": "459306a48bf918675e4f8e8b2b513bb8f48c9b48d400453b77e30ed46c6480bc",
    "tiny/lazymar-token/0": "fe3e91611fb2f6920360f66891b6a4170e60534c101a560f85b705748ef505d9",
    "tiny/lazymar-token/7": "11854276c29708e06f6dbcb49ec01ff61f0e02692116d7ff1e62bab89ff47015",
    "tiny/lazymar-cond/0": "59ad8aa88b9bd96ed883c508cf1b4c4c14d1d9b7f81cd9e124d9c40e045ff5e7",
    "tiny/lazymar-cond/7": "c7f8a352d28432d423486f438b5ddc2c7086ce3d57a96c1e5642fe2a5286783b",
    "tiny/lazymar-head/0": "14f4b3e6a714265ec347839b088dad8c46232f9d55c4dfbba97c1cb5b642c397",
    "tiny/lazymar-head/7": "7ac3f8b27eb4ffc9cb908fc8c6f16c7e3cf65d51c18a92d685efc3809dcc33f1",
    "tiny/marche/0": "d60ed730b2cfa1c2b99938aa8afc849c7911774717215affc406a974781455df",
    "tiny/marche/7": "19ed42b9b281c2d63e0bdb49308d160f2155b2b64a5d44aaa9b85e6fac4f4329",
    "tiny/marche-encoder/0": "39d7ac0cb813ed3e64e09bbd3b1ce4f70e1e4a9d0350d2ba2240aec5e322cc25",
    "tiny/marche-encoder/7": "78f390352acd3ab8704a933d1b915a2bdd374a0e860086d80353c46e3e021146",
    "tiny/marche-composed/0": "07859756d010fccfab0cbf18a810dca926334a77064dea4d55033b90a5cf251c",
    "tiny/marche-composed/7": "5c66be61963ed16211d104adf9d886dc5bda3d7336842c459e408caf8b676bc0",
    "digits/nocache/0": "07b5f49e886847ea43c8e14dfbfb5f3c82bbf777a3e46c0bb8720581fe7aec98",
    "digits/nocache/7": "b3765f46758b04f4e31aa94b12805575e33906c64c8f996ecb71575191460c7b",
    "digits/lazymar/0": "1c9c12f8e5b6bf136582fc53f315ad5667ba99201625b74343d770ecee1fa04c",
    "digits/lazymar/7": "b6292aeca900db53a02340c485e115ca8463e95eab545f1e954cd097b5d505cc",
    "digits/lazymar-token/0": "4a0e18e41b4354aa87b944ec86c8b6a3eef7a67ecf9870c44e09839d2a07d8c0",
    "digits/lazymar-token/7": "6860fc41bcb8f80bc8f7aa10e4cf78135891710a67449412ad98da4aebba28fc",
    "digits/lazymar-cond/0": "0f19ef1b112cb247abf450b390b1007080415bd02f4cf8b98e6b97b26253f51a",
    "digits/lazymar-cond/7": "bbbb22fae8f954072cb321a9f1b112554fd56502f16d894edf57ffa19e266103",
    "digits/lazymar-head/0": "9e5556434aba19a89be780d6cbafd54ec7f6b33bc6acbc1045725faae4fdb45d",
    "digits/lazymar-head/7": "faa3ea66ba89a31ab90daef1787b16f3b2c48735db0280acae71550b65051b19",
    "digits/marche/0": "5a9e8f7ddbfd142deaf81ee97a7839e733fadb4e64511dbf8e63966e60218953",
    "digits/marche/7": "510b86d008136a4c339395491c940ed88407bc78d3961f463a458290a8a61899",
    "digits/marche-encoder/0": "ce7a51f9f967b4cfef8933c60ee6fafa488ff4f2cde263b1d99af0f55fe869a7",
    "digits/marche-encoder/7": "cdc66be0893e0da01d3d1a5978fc5e0e3b61f3f97f29528426989a129bf99b8a",
    "digits/marche-composed/0": "f1aadd9eb5a20b2c5cf73b61ec1c7f93aa738137ddddf707d445cb93329f35e0",
    "digits/marche-composed/7": "f7bcbe59bbef89379a450e5b7f10c056c03579a444616c940fba33f90c4b08e9",
}

HASWELL_PINS = {
    "tiny/nocache/0": "53fa7af46127b8a02d669c399bbafa42d887294dd8c145db0ba7e4f4aad62a2a",
    "tiny/nocache/7": "6cd61ea150fd09c063c0957a60a703ae05cad269b0541d542f7d6d26b4710351",
    "tiny/lazymar/0": "d0183e83c1767c32b3d9f64d8255beabca4d61d7acd1b6de2af413702b263767",
    "tiny/lazymar/7": "f4ce755181a5a1d9a04beaf68426e451f4d4334ef115ce919e388e45fe61dcc1",
    "tiny/lazymar-token/0": "1ac4f2fbd7e373996b36e468f16e0b02895f48a9f62e86c22bc526f8450fdc5a",
    "tiny/lazymar-token/7": "dd99d115ff1d5027670e7d1e27d96fba280540fc6c11e13bc42b49a06ab21f93",
    "tiny/lazymar-cond/0": "581869a5bb871cb2fd8ee33aac6e33e1e6bde37315f42e5cb0a48d1ae6cd3fa4",
    "tiny/lazymar-cond/7": "0321219aa5333ff2cf0db1272b6ebb2f5cb26c16ac6eb9c229b5659b84ecdc8c",
    "tiny/lazymar-head/0": "55b26a30096dab5864c84edde7599b42ac44d13bc986ea735550e47085fb45d0",
    "tiny/lazymar-head/7": "1043a59f3aeaa177145857e51639f4464b76c3d95bccf1f3d5b07616172e8b66",
    "tiny/marche/0": "f8b53355acf85a2f70a16512dbefc2768e0ce8cfe76585b40ebad7f5acd6712e",
    "tiny/marche/7": "2252efd8c643d581433492dbaa492b5ed19aa29cdd9f9e93196fa4f9afa828f4",
    "tiny/marche-encoder/0": "075e162559a684730a2ddb6c7835fd41eb65d9bfe47a2934abf697aa7fead8ae",
    "tiny/marche-encoder/7": "907e37ac810c252a5a8523fbb89a22d17d7b5c78c04a59855abff4191489ca94",
    "tiny/marche-composed/0": "9cc2d7886f723f7e8e3c86396bad21bc8d7dc548d48407b60113f9f495e07724",
    "tiny/marche-composed/7": "f816d0982fa47dae0c46f1093c5f523555fa1f28c71a28ca09ecbd8668bfda74",
    "digits/nocache/0": "b95fa13d132e35b493c9ad865e171a15e3f9aba59514a85b1670189a2289a6d4",
    "digits/nocache/7": "75c6025f1a141a929a8c985be6f0041a745acaa2abb8eb46a5ecfac0560aca18",
    "digits/lazymar/0": "3a1d6a494e234e3d68b29cfe5e0da895f7b4b1a3530fa3a107c1c81721729a9c",
    "digits/lazymar/7": "e5c583d971fec13e22b65bb0fbbb6c1f8c9e0bc2caf2c2708fc6a29587107116",
    "digits/lazymar-token/0": "6e6c5971bb7a739cb7a08247381735f0fe3a0f1df2c90d66c7a3294c944ea2f3",
    "digits/lazymar-token/7": "441dda4ce30c440bdb37c84b73020e59d9b87632dc14c9a610ac2484b6eca238",
    "digits/lazymar-cond/0": "b94a870a592d45aac0569ced614694d4aab19289a2fc21aac746037459b3c292",
    "digits/lazymar-cond/7": "c93df083455cacf60c90d27bab39cf2bea4d3ef7e926338ff356b692d7f0ac70",
    "digits/lazymar-head/0": "dfaa8f3ff982d3ff224cf331bd3467ceb67b58950135c76d8902ac4f2138ab41",
    "digits/lazymar-head/7": "f22ef4c1d783b32fd895ddf51229a16dae302fcc9a7a377b1a68205e1724b614",
    "digits/marche/0": "92774582567506b2f8a078ddf72915355e957ee9246fe530da45877074fe6562",
    "digits/marche/7": "2780d598e6712361df5d312b36537979cf28b4e918ca96911049cd8f3bee96ad",
    "digits/marche-encoder/0": "457cb4d3455a7fa9fb4fa7ca10707c8dc3e470af0fc4cfca9032b843c961071b",
    "digits/marche-encoder/7": "3a8b729132124c4f08724a7ad1888c4a7e44c399197256423563a5895b5fa6c4",
    "digits/marche-composed/0": "cf7231a8196390ce925748f0ad33db21199f57b45b307f325216928b74207da7",
    "digits/marche-composed/7": "6981c48f9aff52d965ce733ce2fa545856fb73b59f7b53852f1c0376fb7d2759",
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

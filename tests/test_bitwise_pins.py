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
    "tiny/nocache/0": "029e233acdbc7a79ca9a77b8d4abdd02a9368c33f374e34b17d165208c1e65c3",
    "tiny/nocache/7": "6bb75bb1a2a28fa72f4892c0d4023fe891fa13600aa6aebd50f0104a18f47196",
    "tiny/lazymar/0": "57aee6ee20d068fa777f459265ef67818d86c69263b8808fe612338f696fb363",
    "tiny/lazymar/7": "0a9ec75317c7cf6aa24097f935f95d91e420977007840b189914f7172df31049",
    "tiny/lazymar-token/0": "855b48e73b4d3eef6c70953e2ed31b4a16398f60232c0e9e341da194d73bbbe1",
    "tiny/lazymar-token/7": "f2de4c39fb122127d2247f94d33dbb15a1239cda78610b2c505fdb4c2e15b491",
    "tiny/lazymar-cond/0": "f39f20e50213b355561d223f27f0ff2968939004bdf17ecbd75ee63c203f2553",
    "tiny/lazymar-cond/7": "4b4079432e6fab78b832974a399fa82cc89ebb7e2adb0603ec24aca96e0e93ad",
    "tiny/lazymar-head/0": "ee055c96e7197fd16eaa2ada51a40369c1abcc16e436ab029630c6b6d7fbc0d7",
    "tiny/lazymar-head/7": "819980c17bce13450ffad90d7304502102b114045f89daa9ff7c2093df48e19d",
    "tiny/marche/0": "c5c4fa0b5c061bb4b27715448e1935d6f2d61becf1535b95080642cac9244c6c",
    "tiny/marche/7": "6e932601a2505b7f16c7506261cde0602112dca0a298a9bd51c260053935a5e3",
    "tiny/marche-encoder/0": "0e87beac21494f3a17d6c882fdc6d13fbfdb8512350e3bdc7ac5af629c9a1989",
    "tiny/marche-encoder/7": "6a2d1fa56523f4ccfd2fc26ca4288639ee4028e6f08c5606474792db7eb35c76",
    "tiny/marche-composed/0": "35238ad6cc213dd444cf397ae76daf351ecaf0db9c2208c350a75cf36be7141c",
    "tiny/marche-composed/7": "0e1cc37d7c2b15f0f6520477e4908e56f9084cdabc96a5479e6af67d609e9997",
    "digits/nocache/0": "ee623c183efbef65f9fdd7fc1a7eb0bc5ce35266021e4b050ce4f1efd4d9ca42",
    "digits/nocache/7": "205ba8f977414b395f9750c26f13de149286da72b2d2d474cee7e979f90f8adb",
    "digits/lazymar/0": "ef4687fc58245ac77b5805f1d06d4f398dd73f8eec2ba8397b8e8f78f28cd232",
    "digits/lazymar/7": "917de0213154a1d35d55a86c2cd6e29a848f904e3d31339c1c3157fe08a67952",
    "digits/lazymar-token/0": "2255f2aebc93b535ad5f745fe820858eebf8ad178c3c5d190187ee78a6d885c2",
    "digits/lazymar-token/7": "7564b32fc9d51c0589520ab96c86ed23230855c1bc1d6d41c7bc231bbb6eab86",
    "digits/lazymar-cond/0": "76cb8e3b3d2bb450b6bf8ba44481291aec753d2f9bfaeed2ebf798e94ad62d31",
    "digits/lazymar-cond/7": "8bf35592faaad203a05b1ae30d8b310c5fa48a8527420ef565b11715cf167f03",
    "digits/lazymar-head/0": "02657d9f58440bd23392d670812ac8f78968198c9b6b1a9714758648ce2b183b",
    "digits/lazymar-head/7": "67516d1361e4d21d1a23f62f0d99df7852495103cfb5b8b700b292eeeb23bf60",
    "digits/marche/0": "1c9fac0bd4f3fdc1507aeafa366abe60f8b9749fa6a1fec4f9ac41a0232459ca",
    "digits/marche/7": "28098733f8f0b968b083f250aa2c8edbad1d67e20a759e24c183bc36266691f7",
    "digits/marche-encoder/0": "62f9bc96734d3145648f22a92cf9119df622cdecf5f11bbedc4709dfb71bea89",
    "digits/marche-encoder/7": "ec558cd4577e38edcbd8237b13d48bb83ab758201edacb0193d90c927e168025",
    "digits/marche-composed/0": "101dfc118ecc6db986e4f8b00a6156157f3f2cfed715da9eeeed71c2b3df9ec0",
    "digits/marche-composed/7": "f4be0445045ac5d0a7f00a70c764920efdb9a921e9e19bec9f39b0bd21823c51",
}

HASWELL_PINS = {
    "tiny/nocache/0": "88b2250c3ff66b097aa5e5a5bad07d00f164b54237ce633571febaae6c7f268d",
    "tiny/nocache/7": "498476b18246b9d1b8424d651b89d3634b521dce19c42617ce7f3985f6fb0001",
    "tiny/lazymar/0": "5e94e13f62a230d1d3604970c78d1ecb2f4531eb490c13b6f0ee200cdfc9f13b",
    "tiny/lazymar/7": "e141ab17206ee2e0a606f3b426ac5ae2bc9fb0f0bb2cd3564f5cc6780b7f8bcb",
    "tiny/lazymar-token/0": "7ddab7ce8ebb9c3bc9106c86f8ac998cea8b4bf34bb9026b95a2d9cca0432385",
    "tiny/lazymar-token/7": "16529b0a550b3bd6ef5f5740ee6dbd833a1eb6971344511981f652759bc28b96",
    "tiny/lazymar-cond/0": "1d8c961e1aa218ed87fed244eb9ab8e460fc057b9c556c16cc6f50bc56f91ca4",
    "tiny/lazymar-cond/7": "ac5ea5867c3ebc71d89bd4f42ce027ec306b6882550f39c1046e00050533d7e6",
    "tiny/lazymar-head/0": "cc151d87cf8fdd251d8719c5ecf98aa932f965b6dbec0d029d2073d7623d6b79",
    "tiny/lazymar-head/7": "a8f8df99d094689698039b76d8bed03d42ba9ed9e8111dd8b7d31a661a152e19",
    "tiny/marche/0": "629104e96a27923eaa09436381130c4117c80eb52a5def30d146530577cedf7f",
    "tiny/marche/7": "f60a4b8ba698bb814686e2cf8930ef7d34718771f8e468a17134d47e760c6be5",
    "tiny/marche-encoder/0": "ece3a5034d32b5f3a2254b6b964d6c6172e282ff496274a4d5e3db39b0975d59",
    "tiny/marche-encoder/7": "db401561e1c337400162ddf6500217ac9119148840c881a6ecfe51f39b9fb0fc",
    "tiny/marche-composed/0": "af91b4fc9b2b4d6ff53da6074147b11b2aa074c1c61647861a88ef1b94e86ca0",
    "tiny/marche-composed/7": "99889f3782299c054843f43b4b7d81eb0a7934a5aa0091e77a7d4b45d98890c4",
    "digits/nocache/0": "dba4a0748e226a54e2ab3adedb2196690e3d429b0e7a12e5eaaaf9064e628fcc",
    "digits/nocache/7": "66f32362f9c943d34893c7006570ee423e243d92d3739c8653c8095e98b9cbb9",
    "digits/lazymar/0": "a2664fc7072be338cdcc94e1db486defd8cfb7a1260c49d9dd7b2829a02627be",
    "digits/lazymar/7": "feb374568d56ba65e88f8e0996622ee65df8bdd781709c3e6e8d13b7c11cf40e",
    "digits/lazymar-token/0": "3f7f7615bce714056a26db19057009d2376f7ec73fb5511700d06622120b5324",
    "digits/lazymar-token/7": "add4d92031f6dfff1cb3ed5075c5c29f672ec8432b3b75fc4184dde103535751",
    "digits/lazymar-cond/0": "fcf72642777841c448247830d8ef3771ff67c3e11f0630454755c73241749b20",
    "digits/lazymar-cond/7": "6c5b2824498013947e5f48f3227b601484f9802a4def5a8249eddd3b0a6035ab",
    "digits/lazymar-head/0": "17808f6b8c817fa92e4827e861fa8741e61f6d7130a6ae00c573310ff2cdabd3",
    "digits/lazymar-head/7": "92f48d0d01a4422753f30ddde934f6bb5cd8cb03799d59f4281a0cf2ee5528c8",
    "digits/marche/0": "5e0d73dfb32ba5c486fe2e76ddabcfbf9b67fe8ada19ff4dba715ec861021421",
    "digits/marche/7": "155939e2b70020da2434abd44f897560159c0a01bb6ede73468942b09f2b7b81",
    "digits/marche-encoder/0": "9c0dba5d21dcd91b76ce667d40ef953b53e0ab7687ea9af277bcb39e2d8c8a5f",
    "digits/marche-encoder/7": "a533fec81ed6ba7c3430691d01cbf5206b42a48ccdd4ca12d56526cdd4fa7b80",
    "digits/marche-composed/0": "1d730cf7761725d81befb3f2b08eecd4e1e0b13b34687c5fe694abd9cbbf6ad6",
    "digits/marche-composed/7": "0ed928bab29d33abbb076c578145e6452f53ebeac6515c9c244fd67d38e5f967",
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

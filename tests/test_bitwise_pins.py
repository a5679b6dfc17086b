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
    "tiny/nocache/0": "c969c36975447c39a980907e8c9a67f3292dd3a36a33808c29a810ef751558c0",
    "tiny/nocache/7": "0c84df9f0388b55ba82b3078a78736402b0a0186df16c9594fb49305cc003066",
    "tiny/lazymar/0": "86c8497d6eeec844cbd68ae99168f01f728f5e1c41911a4da5a3ab7cfefe0e49",
    "tiny/lazymar/7": "bdc739b9409dc5b731cca7fc7140ba11f9ddceea88fd33b37ab6908bd713390b",
    "tiny/lazymar-token/0": "cfb09d3d9e42b72beedb56069df03e60167f4e786c301076b507ab4b8d5a485c",
    "tiny/lazymar-token/7": "14d3c6592c9bebb8e35d9be59f472bf78c70fbfadecc31bdb62fe51b42e969b4",
    "tiny/lazymar-cond/0": "ec71116289d65e825a77bca0661a9bb12e55e716f538bb81d81defb1ead7e035",
    "tiny/lazymar-cond/7": "5eb5eb508fdfa989e15c9f6be2d65fce0620a15a9e6cca2453ea2391bbc63025",
    "tiny/lazymar-head/0": "3994686e3929b57ed5652531adb58f5c811ad1b65fb0a36fe960289fe51df85d",
    "tiny/lazymar-head/7": "a1049d19f5e896021d72c90fb89d6c07b939f20b4d8c582822187673955fa68e",
    "tiny/marche/0": "f98ca1f7eb4c9624ab4f9c37bb090242ce050f2f7356465d074f979c19230789",
    "tiny/marche/7": "1c157652a3ad7fe4de2453039eb3f206051bab81f452f4cf9acbd5b2940fd367",
    "tiny/marche-encoder/0": "6eb28dc86c304ea6047440ea3edbdc2e1792b3980295ab782cb451980ef553dd",
    "tiny/marche-encoder/7": "a30c16a2e5a0df69a0f93ffab9e3e619e047718ba55ead3b371c4eb51d3b64dd",
    "tiny/marche-composed/0": "8bb0ad4bdde58a921e649218812b36a602f40350592a047da076c1b11a13d682",
    "tiny/marche-composed/7": "090c7688d24d14b84f58092b53961a612fe5a46a1484f74b7d73cbceb27f1ea9",
    "digits/nocache/0": "04db397135c51b6d7151ac2d3ac78cb5f20347f1763c619408ed3f2e96ea5859",
    "digits/nocache/7": "41cc2294f4374d25678ea5ddd503a8f13296869047dc9933dc2f933e30da4e8e",
    "digits/lazymar/0": "7eae6e89caf17c8e8c7931be1ff089a6a5027bf0cde39c9a3ada3d72f8cde00e",
    "digits/lazymar/7": "616c9a91796e62cb5ad0e087c40dd52b1adbee521d10c6ab90e976342ccd551d",
    "digits/lazymar-token/0": "3f93f273c2fd530e7f2ebb67d496e94d743a7cd29a33e7bbfda1296970bb708a",
    "digits/lazymar-token/7": "890e9a2b2a55731866c77150a1285f3aa39a5ea24c1ebdf60d27f0b296d3ff83",
    "digits/lazymar-cond/0": "d9c976d78aa58858dccbc5a70727f2eaa2b45c988890ba7cefa1ff2e7376d734",
    "digits/lazymar-cond/7": "aae702abe6604f91b53f702ae6fcca97aa46980fdb527d42209e9f647538cbb7",
    "digits/lazymar-head/0": "d27d54feff609b72ef946fe80d45a008c07cdefc94d9b87d298fde2f5f31e436",
    "digits/lazymar-head/7": "93c5a6c1c17d2779d2ec552ba6c7d45462e5e8a7e5cad02abab9e0b30006df25",
    "digits/marche/0": "f06ab8880749b44e0977b34c5402cea2ab27145f7082b641d0bb5a02700ee7c5",
    "digits/marche/7": "199470a850d7abcb43752c39a1b00631826f043f10a953814162912bc973d407",
    "digits/marche-encoder/0": "9e37c32bf7400b19c72b555b258abe519f2290374b708a691d1622213428fc0e",
    "digits/marche-encoder/7": "1a23057f96ae2e13c719e60acfa19f80f01eed433a8158634aca7b4c626f5e5c",
    "digits/marche-composed/0": "9a1581edc7de637addae135b5d5a86c671d6a7b366f9fa1fe313e53911462956",
    "digits/marche-composed/7": "17c0942c9b7b240c4a5f69c4648798a59083f50c3aeaf103370e5fac7c02c3ff",
}

HASWELL_PINS = {
    "tiny/nocache/0": "9dd231bbc7ecbadd9661d6e622bbb03581cf6111c594564aa34b488df955f67f",
    "tiny/nocache/7": "2dbeb67287b8f0bd8054268f34d38a823fb4fc12a67b6073e37f08398df99292",
    "tiny/lazymar/0": "178760393a861407c76a1810513dca4717eee8389d514971c9afc8575e6acfc0",
    "tiny/lazymar/7": "ce8be0986c1d0f504549dbe11512e2d3ddf01b25b316baac422d89a6561368c8",
    "tiny/lazymar-token/0": "b8df7f3154df7cfb0cf2b97ce60b1351f5244f67359439d31ba508e4bf75d46a",
    "tiny/lazymar-token/7": "6c49eba396094c2f53180dd0b32dd2a990ec1eb26241edefc5dbbcafb6f09fc8",
    "tiny/lazymar-cond/0": "71448f49162be7cc3361cdd710ba5dfb1c4f2a5dba4e76bdd076de97a5936dc5",
    "tiny/lazymar-cond/7": "51aa905c9bc816ef9b5aa3176c42288192c3a67bddd005cff6fd958babf7d028",
    "tiny/lazymar-head/0": "16d8a32d2212fe62ef13732a674f06109da601b2dc769a2a9744109b7b253049",
    "tiny/lazymar-head/7": "225439696d900f70283d7567418c06d2fe77428f5cf82d1944238fc25eb8f4e4",
    "tiny/marche/0": "19f69a5fa84ab18fefa1f3d1db7a2927f4f5ca17d4d03cec1a7298bdaadc06c4",
    "tiny/marche/7": "8052e899f9ee6c2585588f0fd8e64cedd70d40d02eda5d260ed7abdb8cc1b3ce",
    "tiny/marche-encoder/0": "c4f17494497af41b2323ec9cc3f5857852c092260e5e4eee4f86b92f2e1a2d14",
    "tiny/marche-encoder/7": "7df24fd42a36a55fe89656e7545b1194281866fd9d50db7fd91b4eaf396dd4eb",
    "tiny/marche-composed/0": "50925169348957c81d63654b4d3b42204fa57a5807b89f15e8c57f877277bec8",
    "tiny/marche-composed/7": "8bab8ab7550ae025bb83b2967392d98bb1afae023128df3a308c7d427cd70de2",
    "digits/nocache/0": "dffe013d2c908206dabc91d0afca9b1f706dae1f3de224a73b2c0602c1e2617b",
    "digits/nocache/7": "a4ddce067038e72b1e30866915f2d28c6d8d7dd99312ca2c500c47daed74667f",
    "digits/lazymar/0": "3b220fabbf7f82393f4e37f34f8c2c91784181f0f6d834f0a9e104a5819ec3eb",
    "digits/lazymar/7": "f04a70fd02aa22f3b60631000688b62cad2815001d6462a065acaea0771fb387",
    "digits/lazymar-token/0": "4e8535e27e0794a567d999e864aff33167a076670a5dde28d77cd394bb49d852",
    "digits/lazymar-token/7": "c81c7d582d7587a450a898d2c84f453d89eb1718e535f431b6de6b53e5c49afe",
    "digits/lazymar-cond/0": "b1a1e4d2bdceddc8910ffd1a19e1fed931a1f7e405c0217d5361627cbdcce358",
    "digits/lazymar-cond/7": "92d92ad52f6d6a50cf6168c41888ca11208b8e498c78ee3956772508ee678c51",
    "digits/lazymar-head/0": "4138389cdd3513815ca860986f35be7117d775d440d91aecebfad535bb084f37",
    "digits/lazymar-head/7": "c41bbab2eb5769da341e324dcfc1d1f49c1c6f23404338b741c9c344f0a82a6d",
    "digits/marche/0": "bcf5e0d557aa1905e1ff2a0278c845adb48db5f5f9d7b9a1b98db009affbf1f3",
    "digits/marche/7": "ae5a07c92f6906841cb07b68da0ae59013f4332dd13fa3a54f0ad1c46095b1f3",
    "digits/marche-encoder/0": "45bd9245f9a1d252e0762a8bb903e427448593acc8f4dfb274863ed1c785d9d5",
    "digits/marche-encoder/7": "0de29162bdad41be7fe42bdbb61e0236c0cd7556719b67abe7256bc7268e59bd",
    "digits/marche-composed/0": "6fe9acbe6205fe5c5baee8f2cc81ae72554ffb8a04dc7980ae4c76d3d5dd543f",
    "digits/marche-composed/7": "4df9de3421f03e057da63ff4ee52cb5aded69c705d178ce15df135d7295ec08a",
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

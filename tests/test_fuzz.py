"""The fuzz corpus (issue 18): >= 1,000 malformed safetensors files and >= 200 malformed or
malicious torch.save files, generated from a fixed seed at test time (tests/fuzz/), each fed
to the public entry points in a child process.

For every file: a clean Python exception of an expected type with a message (a crash of the
child fails the test naming the case's index and seed, which `python -m fuzz.runner CORPUS
--seed S --only I` replays), no hang (a bound per file and per corpus, generous for a loaded
2-core machine), nothing executed (the canary file and environment variable the malicious
pickles would create stay absent, and no allowlisted object of the unpickler changes), and
no output left behind by a refused conversion (no DST, no DST.partial).
"""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import marcache

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
SEED = 18
SAFETENSORS_FILES = 1050
TORCH_FILES = 264
PER_FILE_SECONDS = 60.0      # hang detection: the slowest case took 2 s at load 26 (0.5 s when quiet)
CORPUS_SECONDS = 480.0       # the whole corpus: about a minute on the loaded 2-core machine

# What each entry point may raise for a malformed file: the reader's and loaders' ValueError
# (CheckpointError is one) and KeyError (a missing tensor, named). Anything else (TypeError,
# IndexError, RecursionError, a bare MemoryError, SystemError...) is a bug.
SAFETENSORS_ERRORS = {"ValueError", "KeyError"}


def _child_env():
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(marcache.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([TESTS_DIR, package_root])
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_corpus(corpus, count, directory):
    """Runs the corpus in a child; returns (records, seconds). A child that dies or hangs
    fails the test with the case it was running."""
    cmd = [sys.executable, "-m", "fuzz.runner", corpus, "--seed", str(SEED), "--count", str(count),
           "--dir", str(directory)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=TESTS_DIR, env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out, err = proc.communicate(timeout=CORPUS_SECONDS)
        timed_out = False
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        timed_out = True
    seconds = time.perf_counter() - t0
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    records = [r for r in lines if "calls" in r]
    started = [r for r in lines if "start" in r]
    finished = bool(lines) and lines[-1].get("done") is True
    if not finished:
        last = started[-1] if started else None
        replay = f"python -m fuzz.runner {corpus} --seed {SEED} --only {last['start']} --dir DIR" if last else ""
        how = f"ran past {CORPUS_SECONDS:.0f} s" if timed_out else f"ended with status {proc.returncode}"
        pytest.fail(f"the {corpus} fuzz child {how} during case {last} (seed {SEED}); replay: {replay}\n"
                    f"stderr:\n{err[-3000:]}")
    return records, seconds


def _where(record):
    return (f"case {record['index']} ({record['mutation']}{'/' + record['detail'] if 'detail' in record else ''}"
            f"{'/' + record['role'] if 'role' in record else ''}, seed {SEED})")


def _check_calls(record, allowed, problems):
    for call in record["calls"]:
        if call["seconds"] > PER_FILE_SECONDS:
            problems.append(f"{_where(record)}: {call['call']} took {call['seconds']:.1f} s")
        if call["ok"]:
            continue
        if call["kind"] != "raised" or not (set(call["mro"]) & allowed):
            problems.append(f"{_where(record)}: {call['call']} raised {call['type']}: {call['msg'][:300]}")
        elif len(call["msg"].strip()) < 10:
            problems.append(f"{_where(record)}: {call['call']} raised {call['type']} without a message")


def _report(problems, corpus):
    if problems:
        head = "\n".join(problems[:25])
        pytest.fail(f"{len(problems)} problems in the {corpus} corpus (seed {SEED}):\n{head}")


def test_safetensors_corpus(tmp_path):
    records, seconds = run_corpus("safetensors", SAFETENSORS_FILES, tmp_path)
    assert [r["index"] for r in records] == list(range(SAFETENSORS_FILES))
    problems = []
    for r in records:
        _check_calls(r, SAFETENSORS_ERRORS, problems)
        calls = {c["call"]: c for c in r["calls"]}
        if calls["load"]["ok"]:
            problems.append(f"{_where(r)}: marcache.load accepted the malformed file")
        if r["expect"] == "reader":
            for name in ("info", "read"):
                if calls[name]["ok"]:
                    problems.append(f"{_where(r)}: safetensors_{name} accepted the malformed file")
                elif r["path"] not in calls[name]["msg"]:
                    problems.append(f"{_where(r)}: the {name} error does not name the file: {calls[name]['msg'][:200]}")
    _report(problems, "safetensors")
    by_reader = sum(r["expect"] == "reader" for r in records)
    print(f"\nsafetensors fuzz corpus: {len(records)} files ({by_reader} refused by the reader, "
          f"{len(records) - by_reader} by the loaders), {seconds:.1f} s")
    assert len(records) >= 1000


def test_torch_corpus(tmp_path):
    from fuzz.torch_corpus import CANARY_ENV

    records, seconds = run_corpus("torch", TORCH_FILES, tmp_path)
    assert [r["index"] for r in records] == list(range(TORCH_FILES))
    problems = []
    for r in records:
        _check_calls(r, {"CheckpointError", "ValueError"}, problems)
        convert, load = r["calls"]
        if r["executed"]:
            problems.append(f"{_where(r)}: the payload ran (canary file or {CANARY_ENV} appeared)")
        if r["tampered"]:
            problems.append(f"{_where(r)}: an allowlisted object of the unpickler was changed")
        if r["left_behind"]:
            problems.append(f"{_where(r)}: a refused conversion left {r['left_behind']}")
        if load["ok"]:
            problems.append(f"{_where(r)}: marcache.load accepted a torch.save file")
        want, global_name = r["expect"]
        if want == "any" and (convert["ok"] or "CheckpointError" in convert["mro"]):
            continue
        if convert["ok"]:
            problems.append(f"{_where(r)}: convert accepted the file")
        elif "CheckpointError" not in convert["mro"]:
            problems.append(f"{_where(r)}: convert raised {convert['type']}, not a CheckpointError")
        elif r["path"] not in convert["msg"]:
            problems.append(f"{_where(r)}: the error does not name the file: {convert['msg'][:200]}")
        elif want == "unsafe" and ("UnsafeCheckpointError" not in convert["mro"]
                                   or f"'{global_name}'" not in convert["msg"].replace("\n", "\\n")):
            problems.append(f"{_where(r)}: not refused as the unsafe global {global_name!r}: "
                            f"{convert['type']}: {convert['msg'][:200]}")
    assert not os.path.exists(tmp_path / "canary_pwned") and CANARY_ENV not in os.environ
    _report(problems, "torch")
    kinds = {}
    for r in records:
        kinds[r["mutation"]] = kinds.get(r["mutation"], 0) + 1
    print(f"\ntorch.save fuzz corpus: {len(records)} files ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}),"
          f" {seconds:.1f} s")
    assert len(records) >= 200


# ----- what the corpus found, one case each ---------------------------------------------------
# Each of these failed before the fix named in its docstring (found by the corpus above).

def _zip_with(tmp_path, payload, **kwargs):
    from fuzz.torch_corpus import zip_file

    path = tmp_path / "case.pth"
    path.write_bytes(zip_file(payload, {}, **kwargs))
    return path


@pytest.mark.parametrize("payload, message", [
    (b"\x80\x02]r\x00\x00\x00\x80}.", r"memo entry 2147483648 at byte 3, after only 3 opcodes"),
    (b"\x80\x02]p1000000000000000000\n0}.", r"memo entry 1000000000000000000"),
    (b"\x80\x02\x8e\x00\x00\x00\x00\x00\x00\x00\x40abc.", r"not a valid pickle: expected 4611686018427387904 bytes"),
    (b"\x80\x02" + b"(" * 10000 + b")" + b"t" * 9999 + b"Q.", r"unexpected persistent id \(\(\(\(\.\.\.\),\),\),\)"),
])
def test_hostile_pickles_are_refused_before_the_unpickler_allocates(tmp_path, payload, message):
    """A memo index or length of 2**31..2**62 made the C unpickler allocate that much
    (MemoryError without a message, or a machine swapping); a deeply nested persistent id
    made the error message itself a RecursionError. Now: a CheckpointError naming the file."""
    from marcache import convert as conv

    path = _zip_with(tmp_path, payload)
    with pytest.raises(conv.CheckpointError, match=message) as info:
        conv.read_checkpoint(path)
    assert str(path) in str(info.value) and len(str(info.value)) < 2000


def test_damaged_or_unreadable_zip_records_are_checkpoint_errors(tmp_path):
    """A deflated byteorder record with a broken stream raised zlib.error; an unknown
    compression method NotImplementedError; both escaped convert()."""
    import zipfile

    from marcache import convert as conv

    path = tmp_path / "bad.pth"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("a/data.pkl", b"\x80\x02}.")
        z.writestr("a/byteorder", b"little", compress_type=zipfile.ZIP_DEFLATED)
    raw = bytearray(path.read_bytes())
    raw[raw.index(b"a/byteorder") + len(b"a/byteorder")] ^= 0xFF      # first byte of the deflate stream
    path.write_bytes(bytes(raw))
    with pytest.raises(conv.CheckpointError, match=r"cannot read record 'a/byteorder'"):
        conv.read_checkpoint(path)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("a/data.pkl", b"\x80\x02}.")
    raw = bytearray(path.read_bytes())
    for sig, at in ((b"PK\x03\x04", 8), (b"PK\x01\x02", 10)):           # method 99 in both headers
        i = raw.index(sig) + at
        raw[i:i + 2] = (99).to_bytes(2, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(conv.CheckpointError, match=r"cannot read record 'a/data.pkl': NotImplementedError"):
        conv.read_checkpoint(path)


def test_a_zip_bomb_pickle_is_refused_before_it_is_inflated(tmp_path):
    import zipfile

    from marcache import convert as conv

    path = _zip_with(tmp_path, b"\x80\x02}" + b"N0" * (33 << 20) + b".", compress=zipfile.ZIP_DEFLATED)
    assert path.stat().st_size < 1 << 20
    t0 = time.perf_counter()
    with pytest.raises(conv.CheckpointError, match=r"holds 69206020 bytes, more than the 67108864"):
        conv.read_checkpoint(path)
    assert time.perf_counter() - t0 < 5.0


@pytest.mark.parametrize("target", ["torch._utils\n_rebuild_tensor_v2", "argparse\nNamespace", "torch\ndevice",
                                    "_codecs\nencode", "copyreg\n_reconstructor"])
def test_build_cannot_change_allowlisted_functions_and_classes(tmp_path, target):
    """BUILD with slot state on an allowlisted function set e.g. its __defaults__, and on
    argparse.Namespace or torch.device replaced methods, for every later load in the
    process (the corpus's allowlist fingerprint changed). Now refused, nothing changed."""
    import argparse

    from marcache import convert as conv

    before = (conv.unpickler._rebuild_tensor_v2.__defaults__, dict(vars(argparse.Namespace)),
              dict(vars(conv.TorchDevice)), conv.unpickler._codecs_encode.__defaults__)
    payload = (b"\x80\x02c" + target.encode() + b"\nN}X\x0c\x00\x00\x00__defaults__)s\x86b0}.")
    with pytest.raises(conv.CheckpointError, match=r"tries to (modify|set)"):
        conv.read_checkpoint(_zip_with(tmp_path, payload))
    assert before == (conv.unpickler._rebuild_tensor_v2.__defaults__, dict(vars(argparse.Namespace)),
                      dict(vars(conv.TorchDevice)), conv.unpickler._codecs_encode.__defaults__)


def test_a_nul_inside_a_dtype_is_refused(tmp_path):
    """The dtype was compared as a C string, so "F32\\u0000junk" passed for F32."""
    from marcache import _C

    header = b'{"x":{"dtype":"F32\\u0000junk","shape":[1],"data_offsets":[0,4]}}'
    path = tmp_path / "nul.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    with pytest.raises(ValueError, match=r"tensor 'x': 'dtype' contains a NUL character \(after 'F32'\)"):
        _C.safetensors_info(str(path))


@pytest.mark.parametrize("key, zero_dim, what", [("word_embed.weight", 1, "latent channel count"),
                                                 ("head.weight", 0, "vocabulary")])
def test_a_var_with_an_empty_size_is_refused(tmp_path, key, zero_dim, what):
    """word_embed.weight [128, 0] (no latent channels) loaded as a VAR: sizes read from
    shapes are now at least 1."""
    from safetensors.numpy import save_file

    from var_fixtures import write_tiny_var

    W = write_tiny_var(tmp_path / "ok.safetensors")
    shape = list(W[key].shape)
    shape[zero_dim] = 0
    W[key] = np.zeros(shape, np.float32)
    if key == "head.weight":
        W["head.bias"] = np.zeros(0, np.float32)
    path = tmp_path / "zero.safetensors"
    save_file(W, str(path), metadata={"kind": "var", "patch_nums": "1,2,3,4"})
    with pytest.raises(ValueError, match=rf"the {what} read from '{key}' is 0; it must be at least 1"):
        marcache.load(path)


@pytest.mark.parametrize("config, what, key", [(dict(dim=0, heads=1), "width", "class_emb.weight"),
                                               (dict(head_width=0), "head width", "diffloss.net.input_proj.weight")])
def test_a_mar_with_an_empty_size_is_refused(tmp_path, config, what, key):
    """A consistent MAR file of width 0 (or head width 0) loaded and "generated" tokens
    (found by probing degenerate configurations beside the corpus): sizes read from shapes
    are now at least 1."""
    from mar_fixtures import write_tiny_mar

    kwargs = dict(dim=16, depth=1, head_width=16, head_depth=1, num_classes=10, heads=2)
    kwargs.update(config)
    path = tmp_path / "zero.safetensors"
    write_tiny_mar(path, **kwargs)
    with pytest.raises(ValueError, match=rf"the {what} read from '{key}' is 0; it must be at least 1"):
        marcache.load(path)


def test_the_canary_sees_a_payload_that_runs(tmp_path):
    """The corpus's canary is not vacuous: the same os.system and exec payloads, given to the
    unrestricted pickle.loads in a child process, create the canary file and set the
    canary variable."""
    code = (
        "import os, pickle, sys\n"
        "import numpy as np\n"
        "from fuzz.torch_corpus import CANARY_ENV, _malicious_pickle\n"
        "canary = sys.argv[1]\n"
        "rng = np.random.default_rng(0)\n"
        "pickle.loads(_malicious_pickle(rng, ('os', 'system', (f'touch {canary}',)), 'reduce'))\n"
        "code = f\"import os; os.environ[{CANARY_ENV!r}] = '1'\"\n"
        "pickle.loads(_malicious_pickle(rng, ('builtins', 'exec', (code,)), 'stack_global'))\n"
        "print(os.environ.get(CANARY_ENV))\n")
    canary = tmp_path / "canary_pwned"
    out = subprocess.run([sys.executable, "-c", code, str(canary)], cwd=TESTS_DIR, env=_child_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert canary.exists() and out.stdout.strip() == "1"

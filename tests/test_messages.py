"""Messages a newcomer meets (issue 17, point 5): each names the problem and what to do."""
import os
import pickle
import re
import subprocess
import sys
import zipfile

import numpy as np
import pytest
from safetensors.numpy import save_file

import marcache as mc
from marcache import _C, digits
from mar_fixtures import write_tiny_mar
from child_env import child_env


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("messages") / "tiny.safetensors"
    write_tiny_mar(path)
    return str(path)


def test_an_unconverted_zip_checkpoint_says_to_convert_it(tmp_path):
    path = tmp_path / "checkpoint-last.pth"
    with zipfile.ZipFile(path, "w") as z:  # the layout torch.save has written since PyTorch 1.6
        z.writestr("archive/data.pkl", pickle.dumps({"model_ema": {}}))
    with pytest.raises(ValueError, match=r"is a PyTorch checkpoint .*python -m marcache convert mar "
                                         r".*checkpoint-last\.pth -o checkpoint-last\.safetensors"):
        mc.load(path)


def test_an_unconverted_legacy_checkpoint_says_to_convert_it(tmp_path, tiny):
    path = tmp_path / "kl16.ckpt"
    path.write_bytes(pickle.dumps({"state_dict": {}}, protocol=2))  # legacy torch.save: a pickle stream
    with pytest.raises(ValueError, match=r"VAE .*kl16\.ckpt is a PyTorch checkpoint.*convert vae-kl16"):
        mc.load(tiny, vae=path)


def test_steps_beyond_int32_name_steps(tiny):
    model = mc.load(tiny)
    for steps in (10**12, 2**31):
        with pytest.raises(ValueError, match=r"steps must be an integer in 1\.\.2\*\*31-1, got %d" % steps):
            model.generate_tokens(labels=[1], steps=steps)
        with pytest.raises(ValueError, match=r"steps must be an integer in 1\.\.2\*\*31-1"):
            mc.flops("mar_base", steps=steps)


def test_a_heads_value_beyond_int64_is_reported_as_written(tmp_path):
    W = write_tiny_mar(tmp_path / "plain.safetensors")
    too_large = "9" * 25
    path = tmp_path / "huge_heads.safetensors"
    save_file({k: v.astype(np.float32) for k, v in W.items()}, str(path), metadata={"heads": too_large})
    with pytest.raises(ValueError, match=r"metadata 'heads' = '%s' is not a positive integer \(too large for a "
                                         r"64-bit integer\)" % too_large):
        mc.load(path)


def test_memory_error_names_what_and_how_much():
    model = digits.load_model()
    with pytest.raises(MemoryError, match=r"\d+\.?\d* [GMT]i?B"):
        model.generate_tokens(num_images=10**9, steps=1)


def test_progress_auto_shows_no_bar_when_stderr_is_not_a_terminal():
    code = ("from marcache import digits; m = digits.load_model(); "
            "m.generate_tokens(labels=[1], steps=3, progress='auto'); "
            "m.generate_tokens(labels=[1], steps=3, progress=True)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.path.dirname(__file__),
                          env=child_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # exactly one bar (progress=True), none from progress="auto" on a pipe
    assert proc.stderr.count("0/3") == 1, proc.stderr


# ----- MemoryError names what and how much (issue 18) ------------------------------------------

BINDING_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "python")
_ALLOCATION = re.compile(r"\b(malloc|calloc|realloc|PyMem_(?:Raw)?(?:Malloc|Calloc|Realloc)|mc_aligned_alloc)\s*\(")
# a size in the format: a number conversion followed by its unit
_SIZED_FORMAT = re.compile(r"%[-.\d]*(?:zu|lld|llu|lu|d|f)[^\"%]{0,3}(?:-byte|bytes|floats|MiB|GiB|elements|entries)")


# what reports a failed allocation: the core's sized writers (mc_core.h) and the binding's mcpy_no_memory
_REPORTS_NOMEM = re.compile(r"\b(mc_fail_nomem(?:_n|_because|_unsized)?|mcpy_no_memory|mc_cuda_fail_alloc|"
                            r"MC_CUDA_ALLOC_TRY)\s*\(")


def _binding_sources():
    names = sorted(n for n in os.listdir(BINDING_DIR) if n.endswith(".c"))
    assert {"py_mar.c", "py_var.c", "py_vqvae.c", "py_vae.c", "py_io.c"} <= set(names)
    for name in names:
        with open(os.path.join(BINDING_DIR, name)) as f:
            yield name, f.read()


def _functions(text):
    """(first line, body) of each top-level C function: from a line that starts a
    declaration at column 0 to the next line that is a lone "}"."""
    out, start = [], None
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if start is None and line and not line[0].isspace() and line.rstrip().endswith("{") and "(" in line:
            start = i
        elif start is not None and line == "}":
            out.append((start + 1, "\n".join(lines[start:i + 1])))
            start = None
    return out


def test_every_memory_error_of_the_bindings_names_what_and_how_much():
    """A source scan of csrc/python/ (the MAR, VAR, VQVAE, VAE, Inception, io and op
    bindings): no bare PyErr_NoMemory (its MemoryError has no message); every
    mcpy_no_memory names what (a string) and its size; every MC_ERR_NOMEM the binding
    raises itself has a size in its format; every function that allocates reports the
    failure through one of those two."""
    problems = []
    for name, text in _binding_sources():
        for m in re.finditer(r"PyErr_NoMemory\s*\(", text):
            problems.append(f"{name}:{text.count(chr(10), 0, m.start()) + 1}: bare PyErr_NoMemory()")
        for m in re.finditer(r"mcpy_no_memory\s*\(([^;]*?)\)\s*[;:)]", text, re.S):
            if name == "py_util.c":
                continue
            if not re.match(r'\s*"[^"]{4,}"\s*,\s*\S', m.group(1)):
                problems.append(f"{name}:{text.count(chr(10), 0, m.start()) + 1}: mcpy_no_memory({m.group(1)[:60]}) "
                                "does not name what and how much")
        for m in re.finditer(r"mc_fail\s*\([^,]+,\s*MC_ERR_NOMEM\s*,\s*(\"(?:[^\"\\]|\\.)*\")", text):
            if not _SIZED_FORMAT.search(m.group(1)):
                problems.append(f"{name}:{text.count(chr(10), 0, m.start()) + 1}: MemoryError {m.group(1)} has no size")
        for line, body in _functions(text):
            if _ALLOCATION.search(body) and not _REPORTS_NOMEM.search(body):
                problems.append(f"{name}:{line}: a function allocates but never reports a failed allocation")
    assert not problems, "\n".join(problems)


# ----- every out-of-memory failure in csrc/ goes through the sized writer (issue 18) -------------

CSRC_DIR = os.path.dirname(BINDING_DIR)
# raw allocators (a backend's ops->alloc is not one: it writes the message itself, from the
# `what` its caller must pass)
_RAW_ALLOCATION = re.compile(r"\b(malloc|calloc|realloc|aligned_alloc|mc_aligned_alloc|strdup|"
                             r"PyMem_(?:Raw)?(?:Malloc|Calloc|Realloc)|cudaMalloc\w*)\s*\(")
# Functions that allocate and hand the failure to their caller instead of reporting it, each
# with the reason; a name listed here that no longer allocates is an error too (no stale entries).
_ALLOCATES_WITHOUT_REPORTING = {
    ("core/mc_core.c", "mc_aligned_alloc"): "the allocator itself: NULL, and its callers report",
    ("backend/cuda/cuda_backend.cu", "defer_release"):
        "out of host memory the block stays allocated until the process ends (documented there)",
}
# where a size may be missing: the CUDA runtime and cuBLAS allocate inside calls and say only
# that they failed; the format test's hook (py_build.c) writes every form
_UNSIZED_ALLOWED = ("backend/cuda/", "python/py_build.c")
_NOMEM_CALL = re.compile(r"\bmc_fail_nomem(_n|_because|_unsized)?\s*\(")


def _strip_comments(text, strings=False):
    """C/C++ comments replaced by spaces, newlines kept (line numbers stay right); string
    literals kept as they are, or with strings=True emptied ("")."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text[i] == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j) if strings else text[i:j + 1])
            i = j + 1
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("".join(c if c == "\n" else " " for c in text[i:j]))
            i = j
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _call_arguments(text, open_paren):
    """The top-level arguments of the call whose "(" is at open_paren."""
    args, depth, start, i = [], 0, open_paren + 1, open_paren
    while i < len(text):
        c = text[i]
        if c == '"':
            j = i + 1
            while text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            i = j
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                args.append(text[start:i].strip())
                return args
        elif c == "," and depth == 1:
            args.append(text[start:i].strip())
            start = i + 1
        i += 1
    raise AssertionError("unbalanced call at %d" % open_paren)


def nomem_problems(rel, text):
    """What breaks the out-of-memory rule in one source file of csrc/ (rel: its path under
    csrc/), as "rel:line: why" strings."""
    problems = []
    if rel.startswith("core/"):
        return problems  # the writer itself (mc_core.h / mc_core.c)
    code = _strip_comments(text)
    bare = _strip_comments(text, strings=True)  # for tokens: none inside a string literal

    def where(pos, of=code):
        return f"{rel}:{of.count(chr(10), 0, pos) + 1}"

    # 1. MC_ERR_NOMEM is set only by the core's writer; elsewhere it may be compared or mapped
    for m in re.finditer(r"\bMC_ERR_NOMEM\b", bare):
        before = bare[max(0, m.start() - 12):m.start()]
        if re.search(r"(==|!=)\s*$", before) or re.match(r"\s*(==|!=)", bare[m.end():]) or \
                re.search(r"\bcase\s+$", before):
            continue
        problems.append(f"{where(m.start(), bare)}: MC_ERR_NOMEM without mc_fail_nomem (no size in its message)")
    # 2. every writer call names what (a format with a word in it) after err and the size
    for m in _NOMEM_CALL.finditer(code):
        args = _call_arguments(code, m.end() - 1)
        what_at = {None: 2, "_n": 3, "_because": 3, "_unsized": 2}[m.group(1)]
        what = args[what_at] if len(args) > what_at else ""
        literal = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', what))
        if not re.search(r"[A-Za-z]{2}|%s", literal) or literal.strip() in ("%s",) and len(args) <= what_at + 1:
            problems.append(f"{where(m.start())}: mc_fail_nomem{m.group(1) or ''} does not name what "
                            f"(what = {what[:60]!r})")
        if m.group(1) == "_unsized" and not rel.startswith(_UNSIZED_ALLOWED):
            problems.append(f"{where(m.start())}: mc_fail_nomem_unsized outside backend/cuda/ (only a library "
                            "that allocates inside a call may leave the size out)")
    # 3. a function that calls a raw allocator reports its failure with a size
    for line, body in _functions(code):
        name = re.search(r"(\w+)\s*\(", body).group(1)
        allocates = bool(_RAW_ALLOCATION.search(body))
        exempt = (rel, name) in _ALLOCATES_WITHOUT_REPORTING
        if allocates and not exempt and not _REPORTS_NOMEM.search(body) and "parse_nomem(" not in body:
            problems.append(f"{rel}:{line}: {name} allocates but never reports a failed allocation with its size")
        if exempt and not allocates:
            problems.append(f"{rel}:{line}: {name} is listed as allocating without reporting, but no longer "
                            "allocates: remove it from the list")
    # 4. the binding raises MemoryError only through mcpy_no_memory / mcpy_raise
    for m in re.finditer(r"\bPyErr_NoMemory\s*\(|\bPyExc_MemoryError\b", bare):
        if rel == "python/py_util.c" and m.group(0) == "PyExc_MemoryError":
            continue  # mcpy_raise's mapping of MC_ERR_NOMEM
        problems.append(f"{where(m.start(), bare)}: {m.group(0).strip('( ')} (a MemoryError without the sized "
                        "message)")
    return problems


def _csrc_sources():
    for folder, _, names in sorted(os.walk(CSRC_DIR)):
        for name in sorted(names):
            if name.endswith((".c", ".h", ".cu")):
                path = os.path.join(folder, name)
                with open(path) as f:
                    yield os.path.relpath(path, CSRC_DIR).replace(os.sep, "/"), f.read()


def test_every_out_of_memory_failure_in_csrc_names_what_and_how_much():
    """A source scan of csrc/ (core, io, models, runtime, backends with CUDA, binding): every
    MC_ERR_NOMEM is written by mc_fail_nomem* (mc_core.h: "cannot allocate <what> (<N> bytes,
    <x.y> MiB)"), each of those calls names what, and every function that allocates reports a
    failure through them (or the binding's mcpy_no_memory, which uses the same writer)."""
    sources = dict(_csrc_sources())
    assert {"core/mc_core.c", "backend/cuda/cuda_backend.cu", "runtime/mar_sampler.c", "io/bind.c",
            "models/mar.c", "python/py_util.c"} <= set(sources)
    problems = [p for rel, text in sources.items() for p in nomem_problems(rel, text)]
    listed = {rel_name for rel_name in _ALLOCATES_WITHOUT_REPORTING if rel_name[0] in sources}
    assert listed == set(_ALLOCATES_WITHOUT_REPORTING), "a listed file is gone"
    assert not problems, "\n".join(problems)


def test_the_scan_finds_each_kind_of_unsized_memory_error():
    """The scan above on planted code: it must fail where the rule is broken (a scan that
    finds nothing proves nothing), and pass the allowed forms."""
    bad = {
        'return mc_fail(err, MC_ERR_NOMEM, "cannot allocate the table");': "MC_ERR_NOMEM without",
        "st = cond ? MC_ERR_NOMEM : MC_OK;": "MC_ERR_NOMEM without",
        'return mc_fail_nomem(err, n, "");': "does not name what",
        'return mc_fail_nomem_n(err, n, 4, "%d", k);': "does not name what",
        'return mc_fail_nomem_unsized(err, "why", "the table");': "outside backend/cuda/",
        "return PyErr_NoMemory();": "PyErr_NoMemory",
        'PyErr_SetString(PyExc_MemoryError, "no");': "PyExc_MemoryError",
    }
    for line, why in bad.items():
        text = "static int f(int n) {\n    " + line + "\n}\n"
        found = nomem_problems("runtime/planted.c", text)
        assert len(found) == 1 and why in found[0] and found[0].startswith("runtime/planted.c:2:"), (line, found)
    unreported = "static int *f(size_t n) {\n    return malloc(n);\n}\n"
    assert [p.split(": ", 1)[1] for p in nomem_problems("io/planted.c", unreported)] == \
        ["f allocates but never reports a failed allocation with its size"]
    fine = ("static int *f(size_t n, mc_err *err) {\n"
            "    /* a comment saying MC_ERR_NOMEM is fine */\n"
            "    int *p = malloc(n * 4);\n"
            '    if (p == NULL)\n        mc_fail_nomem_n(err, n, 4, "the list of %zu ids", n);\n'
            "    if (st == MC_ERR_NOMEM)\n        return p;\n    return p;\n}\n")
    assert nomem_problems("io/planted.c", fine) == []


def _nomem_reference(count, each, what, because=None, sized=True):
    """mc_core.h's format, written from its comment (Python floats are C doubles, and '%.1f'
    rounds as printf does)."""
    if not sized:
        return "cannot allocate %s (size not reported: %s)" % (what, because)
    if count * each >= 2 ** 64:
        size = "%d x %d bytes: more than the address space" % (count, each)
    elif count * each < 1024:
        size = "%d bytes" % (count * each)
    else:
        scaled, unit = count * each / 1024.0, 0
        while unit < 5 and scaled >= 1023.95:
            scaled, unit = scaled / 1024.0, unit + 1
        size = "%d bytes, %.1f %s" % (count * each, scaled, ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")[unit])
    return "cannot allocate %s (%s)%s" % (what, size, ": " + because if because else "")


@pytest.mark.parametrize("count,each", [(0, 1), (1, 1), (1023, 1), (1024, 1), (1535, 1), (1048524, 1),
                                        (1048525, 1), (3 << 20, 1), (1000, 4), (5 << 30, 1), (1 << 40, 4),
                                        (2 ** 64 - 1, 1), (2 ** 63, 2), (2 ** 62, 4), (2 ** 32, 2 ** 32)])
def test_the_out_of_memory_format(count, each):
    status, message = _C._nomem_message(count, each, "the K/V cache of block 3")
    assert status == 1  # MC_ERR_NOMEM: a MemoryError
    assert message == _nomem_reference(count, each, "the K/V cache of block 3")


def test_the_out_of_memory_format_with_a_reason_and_without_a_size():
    assert _C._nomem_message(5000, 1, "a block", because="the device has 4096 bytes") == \
        (1, "cannot allocate a block (5000 bytes, 4.9 KiB): the device has 4096 bytes")
    assert _C._nomem_message(0, 0, "what cuBLAS's cublasCreate needed", because="out of memory",
                             sized=False) == \
        (1, "cannot allocate what cuBLAS's cublasCreate needed (size not reported: out of memory)")


@pytest.mark.parametrize("backend_name", ["cpu", "guard"])
def test_an_impossible_attention_is_a_memory_error_naming_its_scores_and_their_size(backend_name):
    """End to end: attention over 2**23 queries and 2**23 keys (32 MiB each at head dim 1)
    needs a score row block of 2**46 floats (256 TiB) per thread, more than any x86-64
    process can map (128 TiB of address space), so the allocation fails on every machine and
    every overcommit setting, at once, and the op reports it as a MemoryError naming the
    scores and their bytes; the backend works afterwards."""
    if backend_name not in _C.backends():
        pytest.skip("no %s backend in this build" % backend_name)
    n = 1 << 23
    q = np.zeros((1, n, 1), np.float32)
    with pytest.raises(MemoryError) as caught:
        _C.run_op(backend_name, "attention", (q, q, q), {"heads": 1})
    assert str(caught.value) == _nomem_reference(n * n, 4, "a thread's attention scores in CPU scratch slot 0")
    small = np.ones((1, 3, 2), np.float32)
    assert np.allclose(_C.run_op(backend_name, "attention", (small, small, small), {"heads": 1}), 1.0)


def test_a_device_out_of_memory_names_the_block_its_size_class_and_the_devices_reason():
    """End to end through the shared device pool (backend/devpool.c) on the fake device: a
    refused request of 100 bytes is its 512-byte size class, an impossible one (2**63 - 1)
    the 8 EiB class, each message naming what, the bytes and why."""
    r = _C._devpool_script(64 << 20, [("join", 0), ("fail_next", 2), ("alloc", 0, 100), ("alloc", 0, 2 ** 63 - 1)])
    what = "a _devpool_script block on device 0, a %d-byte request rounded up to its size class"
    assert r[2].startswith(_nomem_reference(512, 1, what % 100) + ": also after giving 0 cached bytes back")
    assert r[2].endswith("(" + _nomem_reference(512, 1, "a block of the fake device",
                                                because="the fake device was told to refuse it") + ")")
    assert r[3].startswith(_nomem_reference(2 ** 63, 1, what % (2 ** 63 - 1)) + ": ")
    assert "8.0 EiB" in r[3] and "0 of its 4096 blocks are in use" in r[3]

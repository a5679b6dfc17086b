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
from marcache import digits
from mar_fixtures import write_tiny_mar


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
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)), timeout=600)
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

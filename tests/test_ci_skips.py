"""The CI skip check (.ci/check_skips.py): every skipped test must match an entry of
tests/expected_skips.txt, the count is printed, and an empty report fails."""
import os
import subprocess
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
CHECKER = os.path.join(os.path.dirname(TESTS_DIR), ".ci", "check_skips.py")
EXPECTED = os.path.join(TESTS_DIR, "expected_skips.txt")

if not os.path.exists(CHECKER):  # an installed copy of the tests without the repository
    pytest.skip("no .ci/check_skips.py beside these tests", allow_module_level=True)


def junit(cases):
    """A junit XML report with (classname, name, skip message or None) test cases."""
    rows = []
    for classname, name, skip in cases:
        body = f'<skipped type="pytest.skip" message="{skip}"/>' if skip is not None else ""
        rows.append(f'<testcase classname="{classname}" name="{name}">{body}</testcase>')
    return ('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="%d">%s'
            '</testsuite></testsuites>' % (len(cases), "".join(rows)))


GPU_SESSION = os.path.join(os.path.dirname(TESTS_DIR), "tools", "gpu_session.sh")


def check(tmp_path, cases, expected=EXPECTED, gpu_session=None):
    path = tmp_path / "junit.xml"
    path.write_text(junit(cases))
    extra = ["--gpu-session", str(gpu_session)] if gpu_session else []
    return subprocess.run([sys.executable, CHECKER, str(path), str(expected)] + extra, capture_output=True,
                          text=True, cwd=TESTS_DIR)


def test_expected_skips_pass_and_are_counted(tmp_path):
    result = check(tmp_path, [
        ("test_devices", "test_cuda_tokens_match_cpu[nocache]", "no usable CUDA device (marcache._C.backends() == ['cpu'])"),
        ("test_ops", "test_op[cuda-gemm]", "backend 'cuda' is not in this build"),
        ("test_ops", "test_op[cpu-gemm]", None),
    ])
    assert result.returncode == 0, result.stderr
    assert "CI: 2 of 3 tests skipped" in result.stdout


def test_an_unexpected_skip_fails_and_is_named(tmp_path):
    result = check(tmp_path, [
        ("test_ops", "test_op[cuda-gemm]", "backend 'cuda' is not in this build"),
        ("test_reference_self", "test_appendix_a_and_b_key_lists", "spec not available"),
    ])
    assert result.returncode == 1
    assert "CI: 2 of 2 tests skipped" in result.stdout
    assert "test_reference_self::test_appendix_a_and_b_key_lists :: spec not available" in result.stderr


def test_no_tests_fails(tmp_path):
    result = check(tmp_path, [])
    assert result.returncode == 1 and "no tests" in result.stderr


def test_an_entry_without_a_reason_is_refused(tmp_path):
    expected = tmp_path / "expected.txt"
    expected.write_text("# comment\nno usable CUDA device\n")
    result = check(tmp_path, [("a", "b", None)], expected=expected)
    assert result.returncode != 0 and "regex | reason" in result.stderr


def test_a_cuda_skip_outside_the_gpu_sessions_files_fails(tmp_path):
    """A test that skips for want of CUDA in a file tools/gpu_session.sh does not run would
    not run on a lent GPU either: CI names the file."""
    script = tmp_path / "gpu_session.sh"
    script.write_text('#!/bin/sh\nGPU_TEST_FILES="test_ops.py test_devices.py"\n')
    cases = [
        ("test_ops", "test_op[cuda-gemm]", "backend 'cuda' is not in this build"),
        ("test_devices.TestX", "test_cuda_tokens[nocache]", "no usable CUDA device"),
        ("test_sampling", "test_sqrtm", "SciPy not installed (optional extra)"),
    ]
    assert check(tmp_path, cases, gpu_session=script).returncode == 0
    result = check(tmp_path, cases + [("test_var_devices", "test_cuda_tokens[bf16]", "no usable CUDA device")],
                   gpu_session=script)
    assert result.returncode == 1
    assert "test_var_devices.py" in result.stderr and "GPU_TEST_FILES" in result.stderr
    assert "test_ops.py" not in result.stderr.split("leaves out")[1]


def test_the_gpu_sessions_list_names_existing_test_files():
    """Every file the GPU session runs exists (a renamed test file would else be dropped
    silently there, where pytest's 'file not found' costs lent GPU time)."""
    import re
    with open(GPU_SESSION) as f:
        listed = re.search(r'^GPU_TEST_FILES="([^"]*)"', f.read(), re.MULTILINE).group(1).split()
    assert listed and all(os.path.isfile(os.path.join(TESTS_DIR, name)) for name in listed), listed

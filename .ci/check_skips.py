#!/usr/bin/env python3
"""Reads a pytest junit XML file, prints the skipped tests with their reasons and their
count, and exits 1 when a skipped test matches no entry of the expected list
(tests/expected_skips.txt: "regex | reason" per line, '#' comments), or when the file
records no test at all.

With --gpu-session SCRIPT (tools/gpu_session.sh), it also exits 1 when a test skipped
for want of CUDA (its reason names CUDA) lives in a test file that the script's
GPU_TEST_FILES list leaves out: such a test would not run on a lent GPU either.

Usage: check_skips.py JUNIT_XML EXPECTED_SKIPS_TXT [--gpu-session SCRIPT]"""
import re
import sys
import xml.etree.ElementTree as ET


def read_expected(path):
    """[(compiled regex, reason)] from the expected-skips file; a line without ' | reason'
    is refused, so every entry says why."""
    entries = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            pattern, sep, reason = line.partition(" | ")
            if not sep or not reason.strip() or not pattern.strip():
                raise SystemExit(f"{path}:{number}: expected 'regex | reason', got {line!r}")
            entries.append((re.compile(pattern.strip()), reason.strip()))
    return entries


def skipped_tests(junit_path):
    """(number of test cases, [(test id, skip message)])."""
    root = ET.parse(junit_path).getroot()
    cases = list(root.iter("testcase"))
    skipped = []
    for case in cases:
        for skip in case.findall("skipped"):
            test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
            skipped.append((test_id, skip.get("message", "") or (skip.text or "").strip()))
    return len(cases), skipped


CUDA_SKIP = re.compile(r"CUDA|cuda")


def gpu_session_files(script):
    """The test files tools/gpu_session.sh runs on a GPU (its GPU_TEST_FILES line)."""
    with open(script, encoding="utf-8") as f:
        found = re.search(r'^GPU_TEST_FILES="([^"]*)"', f.read(), re.MULTILINE)
    if found is None:
        raise SystemExit(f"{script}: no GPU_TEST_FILES=\"...\" line")
    return set(found.group(1).split())


def module_file(test_id):
    """'test_ops.TestX::test_y[..]' or 'tests.test_ops::...' -> 'test_ops.py'."""
    classname = test_id.split("::", 1)[0]
    parts = classname.split(".")
    module = next((p for p in parts if p.startswith("test_")), parts[-1])
    return module + ".py"


def main(argv):
    gpu_script = None
    if len(argv) == 5 and argv[3] == "--gpu-session":
        gpu_script = argv[4]
        argv = argv[:3]
    if len(argv) != 3:
        raise SystemExit(__doc__)
    total, skipped = skipped_tests(argv[1])
    expected = read_expected(argv[2])
    if total == 0:
        print("CI: the junit report records no tests", file=sys.stderr)
        return 1
    unexpected = []
    used = {}
    for test_id, message in skipped:
        text = f"{test_id} :: {message}"
        match = next((reason for regex, reason in expected if regex.search(text)), None)
        if match is None:
            unexpected.append(text)
        else:
            used[match] = used.get(match, 0) + 1
    print(f"CI: {len(skipped)} of {total} tests skipped")
    for reason, count in sorted(used.items(), key=lambda item: -item[1]):
        print(f"CI:   {count:5d} expected: {reason}")
    status = 0
    if unexpected:
        print(f"CI: {len(unexpected)} skipped tests are not in {argv[2]}:", file=sys.stderr)
        for text in unexpected:
            print(f"CI:   {text}", file=sys.stderr)
        status = 1
    if gpu_script is not None:
        listed = gpu_session_files(gpu_script)
        missing = sorted({module_file(test_id) for test_id, message in skipped
                          if CUDA_SKIP.search(message)} - listed)
        if missing:
            print(f"CI: tests that skip without CUDA live in files {gpu_script}'s GPU_TEST_FILES "
                  f"leaves out (they would not run on a GPU either): {', '.join(missing)}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))

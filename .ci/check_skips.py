#!/usr/bin/env python3
"""Reads a pytest junit XML file, prints the skipped tests with their reasons and their
count, and exits 1 when a skipped test matches no entry of the expected list
(tests/expected_skips.txt: "regex | reason" per line, '#' comments), or when the file
records no test at all.

Usage: check_skips.py JUNIT_XML EXPECTED_SKIPS_TXT"""
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


def main(argv):
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
    if unexpected:
        print(f"CI: {len(unexpected)} skipped tests are not in {argv[2]}:", file=sys.stderr)
        for text in unexpected:
            print(f"CI:   {text}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

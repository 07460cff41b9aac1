#!/usr/bin/env python3
"""Summarise the interop suites' results (JSON written by .ci/interop_plugin.py).

Usage: interop_report.py SUITE=RESULTS.json...

Prints every test that failed or errored (with the first line of its message) and every
test that passed only on a rerun, then the closing line `interop: N passed, M failed`
(`, K skipped` appended when K > 0) on its own. A missing or unreadable results file
(pytest crashed or was killed before writing it) counts as one failure, so a broken run
can never look green. Exit status: 0 when M == 0.
"""
import json
import sys


def main(args):
    passed = failed = skipped = 0
    failures, flaky = [], []
    for arg in args:
        suite, _, path = arg.partition("=")
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            failed += 1
            failures.append(f"FAILED [{suite}] <whole suite> - no results ({exc})")
            continue
        for t in data["tests"]:
            if t["outcome"] in ("failed", "error"):
                failed += 1
                failures.append(f"FAILED [{suite}] {t['id']} - {t['message']}")
            elif t["outcome"] == "skipped":
                skipped += 1
            else:
                passed += 1
                if t["reruns"]:
                    flaky.append(f"FLAKY  [{suite}] {t['id']} - passed after {t['reruns']} rerun(s)")
    for line in flaky + failures:
        print(line)
    line = f"interop: {passed} passed, {failed} failed"
    if skipped:
        line += f", {skipped} skipped"
    print(line)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

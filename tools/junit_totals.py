#!/usr/bin/env python3
"""Count the test cases of JUnit XML files: one closing line, ``tests: N passed, N failed, N skipped``.

.ci/run runs several pytest tiers; this line sums them so the run ends on one count. Exit 1 when
any case failed or errored, or when the files hold no test case at all (a tier that collected
nothing must not pass silently).

    python tools/junit_totals.py out/*.xml
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path


def totals(paths: list[Path]) -> tuple[int, int, int]:
    """(passed, failed, skipped) over every ``testcase`` of the files (an error counts as failed)."""
    passed = failed = skipped = 0
    for path in paths:
        for case in ElementTree.parse(path).getroot().iter("testcase"):
            outcomes = {child.tag for child in case}
            if outcomes & {"failure", "error"}:
                failed += 1
            elif "skipped" in outcomes:
                skipped += 1
            else:
                passed += 1
    return passed, failed, skipped


def main(argv: list[str]) -> int:
    if not argv:
        print("junit_totals: name the JUnit XML files", file=sys.stderr)
        return 2
    try:
        passed, failed, skipped = totals([Path(name) for name in argv])
    except (OSError, ElementTree.ParseError) as error:
        print(f"junit_totals: cannot read the JUnit files: {error}", file=sys.stderr)
        return 2
    print(f"tests: {passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed or passed + failed + skipped == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

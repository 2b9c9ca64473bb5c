"""tools/junit_totals.py: .ci/run's closing count over every tier's JUnit XML file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "junit_totals.py"

SUITE = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="a" name="ok"/>
<testcase classname="a" name="skipped"><skipped message="needs torch"/></testcase>
{more}</testsuite></testsuites>"""


def totals(*documents: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    paths = []
    for index, document in enumerate(documents):
        path = tmp_path / f"tier-{index}.xml"
        path.write_text(document, encoding="utf-8")
        paths.append(str(path))
    return subprocess.run([sys.executable, str(SCRIPT), *paths], capture_output=True, text=True, timeout=60)


def test_counts_every_tier_and_passes_when_nothing_failed(tmp_path: Path) -> None:
    done = totals(SUITE.format(more=""), SUITE.format(more='<testcase classname="b" name="ok2"/>'), tmp_path=tmp_path)
    assert (done.returncode, done.stdout) == (0, "tests: 3 passed, 0 failed, 2 skipped\n")


def test_a_failure_or_an_error_fails_the_count(tmp_path: Path) -> None:
    failed = '<testcase classname="b" name="bad"><failure message="x"/></testcase>'
    errored = '<testcase classname="b" name="broken"><error message="y"/></testcase>'
    done = totals(SUITE.format(more=failed + errored), tmp_path=tmp_path)
    assert (done.returncode, done.stdout) == (1, "tests: 1 passed, 2 failed, 1 skipped\n")


def test_no_test_case_at_all_fails(tmp_path: Path) -> None:
    done = totals("<testsuites><testsuite name='pytest'/></testsuites>", tmp_path=tmp_path)
    assert (done.returncode, done.stdout) == (1, "tests: 0 passed, 0 failed, 0 skipped\n")


def test_an_unreadable_file_is_refused_in_one_line(tmp_path: Path) -> None:
    done = totals("<testsuites", tmp_path=tmp_path)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1
    assert done.stderr.startswith("junit_totals: cannot read the JUnit files:")

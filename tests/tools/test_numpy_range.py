"""tools/numpy_range.sh's exit status, with a stand-in venv: its ``pip`` installs a numpy that is
only a version string, its ``qualify`` writes a receipt whose numbers the test chooses per numpy
version. Both numpys matching the checkout's digits exit 0; a failing run or other digits do not
(the script's own cleanup once turned a passing run into exit 1, failing a landing CI)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOW, TOP = "2.0.2", "2.4.6"

FAKE_PIP = f"""#!{sys.executable}
import pathlib, sys
arguments = sys.argv[1:]
target = pathlib.Path(arguments[arguments.index("--target") + 1])
version = "{LOW}" if arguments[-1].startswith("numpy==") else "{TOP}"
(target / "numpy").mkdir(parents=True)
(target / "numpy" / "__init__.py").write_text(f"__version__ = {{version!r}}\\n")
"""

FAKE_QUALIFY = f"""#!{sys.executable}
import json, os, pathlib, sys
try:
    import numpy
    version = numpy.__version__
except ImportError:
    version = "checkout"
if version == os.environ.get("FAKE_FAILS_ON"):
    sys.exit(3)
receipt = pathlib.Path(sys.argv[sys.argv.index("--receipts") + 1]) / "20261206T000000Z-0000000000000000"
(receipt / "samples").mkdir(parents=True)
(receipt / "validation-summary.json").write_text(json.dumps({{"status": "passed", "verdict": "QUALIFIED"}}))
max_abs = 0.5 if version == os.environ.get("FAKE_DIFFERS_ON") else 0.25
(receipt / "samples" / "sample-1.json").write_text(json.dumps({{"repetition": 1, "max_abs": max_abs}}))
"""


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    root, venv = tmp_path / "checkout", tmp_path / "venv"
    (root / "tools").mkdir(parents=True)
    (venv / "bin").mkdir(parents=True)
    for tool in ("numpy_range.sh", "same_numbers.py"):
        shutil.copy2(REPO / "tools" / tool, root / "tools" / tool)
    (root / "pyproject.toml").write_text(f'dependencies = ["numpy>={LOW},<2.5"]\n')
    for name, text in (("pip", FAKE_PIP), ("qualify", FAKE_QUALIFY)):
        (venv / "bin" / name).write_text(text)
        (venv / "bin" / name).chmod(0o755)
    (venv / "bin" / "python").symlink_to(sys.executable)
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run(["bash", str(root / "tools" / "numpy_range.sh")], capture_output=True, text=True,
                          env={**environment, "VENV": str(venv), **env}, timeout=120)


def test_both_numpys_with_the_checkouts_digits_exit_zero(tmp_path: Path) -> None:
    done = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    qualified = [line for line in done.stdout.splitlines() if line.endswith("QUALIFIED, the checkout's digits")]
    assert [line.split()[2] for line in qualified] == [LOW, TOP]


@pytest.mark.parametrize("version", [LOW, TOP])
def test_a_failing_run_exits_one_naming_its_numpy(tmp_path: Path, version: str) -> None:
    done = _run(tmp_path, FAKE_FAILS_ON=version)
    assert done.returncode == 1
    spec = f"numpy=={LOW}" if version == LOW else f"numpy>={LOW},<2.5"
    assert done.stderr.strip().splitlines()[-1] == f"numpy_range.sh: the main job on numpy {spec} failed (exit 3)"


def test_other_digits_fail_the_tier(tmp_path: Path) -> None:
    done = _run(tmp_path, FAKE_DIFFERS_ON=TOP)
    assert done.returncode != 0
    assert f"numpy {LOW} (numpy=={LOW}): QUALIFIED" in done.stdout
    assert f"numpy {TOP}" not in done.stdout

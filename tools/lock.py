#!/usr/bin/env python3
"""Regenerate constraints.txt, the tested set of every package ``pip install -e '.[dev,torch]'`` installs.

pyproject.toml states compatible ranges (the harness installs beside an inference stack); this
file pins one tested version of each. It is made by installing the project with its ``dev`` and
``torch`` extras into a fresh virtual environment under the current constraints.txt (its pins are
kept, a package nothing needs any more drops out, a new one resolves to its newest allowed
version) and writing back that environment's ``pip freeze``. Local version labels are dropped
(``torch==2.13.0+cpu`` is written ``torch==2.13.0``, which pip satisfies with the machine's CPU
wheel). To move a package, delete its line and run this again.

    python3 tools/lock.py              # rewrite constraints.txt (a reviewed change)
    python3 tools/lock.py --out PATH   # write elsewhere (to compare)
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "constraints.txt"
EXTRAS = "dev,torch"
HEADER = f"""\
# The tested set: every package `pip install -e '.[{EXTRAS}]'` installs, at one version each.
# pyproject.toml holds compatible ranges; tools/test.sh and the Makefile install under these pins:
#   pip install -c constraints.txt -e '.[{EXTRAS}]'
# Regenerate (a reviewed change; pins here are kept, delete a line to move that package):
#   python3 tools/lock.py
"""
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s+;]+)(\+[A-Za-z0-9.]+)?$")


def pins(freeze: str) -> list[str]:
    """``name==version`` lines of a ``pip freeze`` output, sorted by name, local labels dropped;
    anything else (the project itself, editable or direct-URL installs) left out."""
    found = {}
    for line in freeze.splitlines():
        match = PIN.fullmatch(line.strip())
        if match is None:
            continue
        name = re.sub(r"[-_.]+", "-", match.group(1)).lower()
        if name != "trust-ladder":
            found[name] = f"{name}=={match.group(2)}"
    return [found[name] for name in sorted(found)]


def run(command: Sequence[str]) -> str:
    """Run ``command``; its stdout, or exit with its stderr's tail when it fails."""
    done = subprocess.run(list(command), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-20:])
        raise SystemExit(f"lock: {' '.join(command[:4])} ... exited {done.returncode}:\n{tail}")
    return done.stdout


def lock(out: Path) -> int:
    """Install into a fresh venv under the current pins and write its freeze to ``out``."""
    with tempfile.TemporaryDirectory(prefix="trust-ladder-lock-") as scratch:
        venv = Path(scratch) / "venv"
        run([sys.executable, "-m", "venv", str(venv)])
        pip = [str(venv / "bin" / "python"), "-m", "pip"]
        seed = ["-c", str(LOCK)] if LOCK.is_file() else []
        run([*pip, "install", "-q", "--disable-pip-version-check", *seed, "-e", f"{ROOT}[{EXTRAS}]"])
        lines = pins(run([*pip, "freeze", "--disable-pip-version-check"]))
    out.write_text(HEADER + "".join(f"{line}\n" for line in lines), encoding="utf-8")
    print(f"lock: wrote {out} ({len(lines)} pins)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate constraints.txt from a fresh install of the project.")
    parser.add_argument("--out", type=Path, default=LOCK, help="where to write (default constraints.txt)")
    return lock(parser.parse_args(argv).out)


if __name__ == "__main__":
    sys.exit(main())

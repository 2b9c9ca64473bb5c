#!/usr/bin/env python3
"""Make docs/console-80.png and docs/console-160.png: one real ``qualify --recipe native-text`` run's
console output, as a terminal 80 and 160 columns wide shows it.

Runs the qualification once, in process (signing with a throwaway key in a temporary config
directory; the operator's keys are never touched), then renders the finished run's whole output
(:func:`qualify.interfaces.console.show_run`, what ``drive`` printed) on a recording rich console
of each width, exports it as SVG and screenshots it with headless Chromium. Prints each width's
plain text too. About a minute.

    .venv/bin/python tools/console_screenshots.py [--output-dir docs] [--keep DIR]
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qualify.run.qualification import QualificationRun

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WIDTHS = (80, 160)
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars")
CHROMIUM_LIMIT_S = 120.0


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if found is None:
        sys.exit("console_screenshots: needs headless Chromium (Debian: apt-get install chromium)")
    return found


def _run(receipts: Path) -> QualificationRun:
    """One finished qualification run of the default lane (its console output goes nowhere)."""
    from rich.console import Console

    from qualify.interfaces.console import drive
    from qualify.run.qualification import QualificationRun, RunOptions

    run = QualificationRun(RunOptions(recipe="native-text", receipts=receipts,
                                      command_line=["qualify", "--recipe", "native-text"]))
    code = drive(run, Console(file=io.StringIO(), width=160))
    if code != 0:
        sys.exit(f"console_screenshots: the run exited {code}, expected a passing run to show")
    return run


def _svg_size(svg: str) -> tuple[int, int]:
    found = re.search(r'viewBox="0 0 ([0-9.]+) ([0-9.]+)"', svg)
    if found is None:
        sys.exit("console_screenshots: rich's SVG has no viewBox")
    return int(float(found.group(1))) + 1, int(float(found.group(2))) + 1


def _shoot(chromium: str, svg: str, png: Path, work: Path) -> None:
    """Screenshot ``svg`` at its own size into ``png``."""
    width, height = _svg_size(svg)
    page = work / f"{png.stem}.html"
    page.write_text("<!doctype html><html><head><meta charset='utf-8'><style>html,body{margin:0;padding:0;"
                    f"background:#292929}}</style></head><body>{svg}</body></html>", encoding="utf-8")
    profile = work / f"profile-{png.stem}"
    command = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={png}",
               f"--window-size={width},{height}", page.as_uri()]
    done = subprocess.run(command, capture_output=True, text=True, timeout=CHROMIUM_LIMIT_S)
    if done.returncode != 0 or not png.is_file():
        sys.exit(f"console_screenshots: chromium exited {done.returncode}: {done.stderr[-2000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=REPO / "docs", help="where the PNGs go (default docs/)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the receipt, SVGs and pages in this directory")
    options = parser.parse_args()
    chromium = _chromium()
    with tempfile.TemporaryDirectory(prefix="console-screenshots-") as temporary:
        work = (options.keep or Path(temporary)).resolve()
        work.mkdir(parents=True, exist_ok=True)
        os.environ["XDG_CONFIG_HOME"] = str(work / "config")  # a throwaway signing key, never the operator's
        from rich.console import Console

        from qualify.interfaces.console import show_run

        output_dir = options.output_dir.resolve()
        os.chdir(work)  # the receipt path shown is receipts/<run-id>, not this machine's temporary directory
        run = _run(Path("receipts"))
        for width in WIDTHS:
            console = Console(record=True, width=width, file=io.StringIO(), highlight=False, markup=False,
                              emoji=False, force_terminal=True, color_system="truecolor")
            show_run(run, console)
            text = console.export_text(clear=False)
            svg = console.export_svg(title=f"qualify --recipe native-text ({width} columns)")
            (work / f"console-{width}.svg").write_text(svg, encoding="utf-8")
            png = output_dir / f"console-{width}.png"
            _shoot(chromium, svg, png, work)
            print(f"--- {width} columns: {png} ({png.stat().st_size} bytes)\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Make the report screenshots of docs/report.md from real runs: docs/report-single.png (a passing
run of the default lane) and docs/report-compare.png (the v-scale fault run against it).

Runs ``qualify --recipe native-text --reference-once`` twice at once (passing, and with
``--fault v-scale``), signing with a throwaway key in a temporary config directory (the operator's
keys are never touched), writes both pages with ``qualify report``, renders them in headless
Chromium at their full height and checks each screenshot the way the browser tests do (the verdict
and every plot in the DOM, no blank plot) before writing it. About a minute.

    .venv/bin/python tools/report_screenshots.py [--output-dir docs] [--keep DIR]

``--keep DIR`` keeps the receipts and pages; given again, it reuses the receipts already there.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from qualify.core.strict_json import read_strict_json
from qualify.interfaces.report import report_cli
from qualify.interfaces.report_browser import Chromium, blank_plot_problems, find_chromium
from qualify.interfaces.report_check import outline_problems, page_outline

RUN_LIMIT_S = 900.0


def _runs(work: Path, env: dict[str, str]) -> tuple[Path, Path]:
    """The passing and the v-scale fault receipt, made at once."""
    base = [sys.executable, "-m", "qualify.interfaces.cli", "--recipe", "native-text", "--reference-once"]
    # The key is made first, so the two runs do not race to make it.
    subprocess.run([sys.executable, "-m", "qualify.interfaces.cli", "keys", "init"], env=env, cwd=REPO,
                   check=True, capture_output=True)
    processes = {name: subprocess.Popen([*base, "--receipts", str(work / name), *extra], env=env, cwd=REPO,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for name, extra in (("passing", []), ("fault", ["--fault", "v-scale"]))}
    for name, process in processes.items():
        output, _ = process.communicate(timeout=RUN_LIMIT_S)
        if process.returncode != (0 if name == "passing" else 1):
            sys.exit(f"report_screenshots: the {name} run exited {process.returncode}:\n{output[-3000:]}")
    (passing,), (fault,) = (sorted((work / name).iterdir()) for name in ("passing", "fault"))
    return passing, fault


def _shoot(chromium: Chromium, page: Path, png: Path, verdicts: dict[str, str]) -> None:
    """Screenshot the whole page after checking it shows every verdict and every plot."""
    figures = page_outline(page.read_text(encoding="utf-8")).figure_order
    problems = outline_problems(chromium.dump_dom(page), verdicts=verdicts, figures=figures)
    boxes, without_svg, height = chromium.plot_boxes(page)
    problems.extend(f"plot {name}: no svg" for name in without_svg)
    chromium.screenshot(page, png, height)
    problems.extend(blank_plot_problems(png, boxes))
    if problems:
        sys.exit(f"report_screenshots: {page.name}: " + "; ".join(problems))
    print(f"report_screenshots: {png} ({png.stat().st_size} bytes; page {page.stat().st_size} bytes, "
          f"{len(figures)} plots)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=REPO / "docs", help="where the PNGs go (default docs/)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the receipts and pages in this directory")
    options = parser.parse_args()
    options.output_dir = options.output_dir.absolute()
    chromium_binary = find_chromium()
    if chromium_binary is None:
        sys.exit("report_screenshots: needs headless Chromium (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="report-screenshots-") as temporary:
        work = (options.keep or Path(temporary)).absolute()
        work.mkdir(parents=True, exist_ok=True)
        config = work / "config"
        env = {**os.environ, "XDG_CONFIG_HOME": str(config)}
        env.pop("QUALIFY_KEYS", None)
        reuse = (work / "passing").is_dir() and (work / "fault").is_dir() and (config / "trust-ladder").is_dir()
        passing, fault = ((sorted((work / "passing").iterdir())[0], sorted((work / "fault").iterdir())[0])
                          if reuse else _runs(work, env))
        shutil.copyfile(config / "trust-ladder" / "trust.json", work / "trust.json")
        single, compare = work / "report-single.html", work / "report-compare.html"
        os.chdir(work)  # the page names the trust file as given: "trust.json", no machine path
        trust = ["--trust", "trust.json"]
        codes = [report_cli([str(passing), "--output", str(single), *trust]),
                 report_cli([str(fault), str(passing), "--output", str(compare), *trust])]
        if codes != [0, 0]:
            sys.exit(f"report_screenshots: qualify report exited {codes}, expected [0, 0] (both receipts verified)")
        verdict = {name: read_strict_json(path / "validation-summary.json", "summary")["verdict"]
                   for name, path in (("passing", passing), ("fault", fault))}
        chromium = Chromium(chromium_binary, work)
        options.output_dir.mkdir(parents=True, exist_ok=True)
        _shoot(chromium, single, options.output_dir / "report-single.png", {"verdict": verdict["passing"]})
        _shoot(chromium, compare, options.output_dir / "report-compare.png",
               {"verdict-receipt-1": verdict["fault"], "verdict-receipt-2": verdict["passing"]})
        shutil.rmtree(work / "chromium-profile", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

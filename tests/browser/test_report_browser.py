"""The report as a browser shows it: headless Chromium loads the page, its DOM holds the verdict
and every plot (an ``svg`` inside each ``figure.plot``), and the screenshot is drawn where each
plot lies (not blank). The checks are shown to fail on a page missing a plot, its verdict, or a
plot's drawing, so a passing run means the page is really there.

Browser tests are marked ``browser`` (root conftest.py: skipped with a reason without Chromium,
failed instead when ``QUALIFY_REQUIRE_BROWSER=1``, as CI sets it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from qualify.contract.identity import load_identity
from qualify.core.assets import REPO_ROOT
from qualify.interfaces.report import report_cli
from qualify.interfaces.report_browser import Chromium, blank_plot_problems, find_chromium
from qualify.interfaces.report_check import outline_problems, page_outline
from qualify.interfaces.report_html import status_label
from qualify.run.run_contract import identity_path_for_lane
from tests.unit.interfaces.test_report import (
    LANE,
    RealReceipts,
    lane_envelope,
    make_series,
    real_receipts_in,
    summary_of,
    write_lane_receipt,
)

_FIGURE = re.compile(r'<figure class="plot[^"]*" id="(?P<id>[^"]+)">.*?</figure>', re.DOTALL)
_SVG = re.compile(r"(<svg\b[^>]*>).*?</svg>", re.DOTALL)
_HEADLINE = re.compile(r'(<p id="verdict-headline" class="headline">).*?</p>', re.DOTALL)


@pytest.fixture(scope="module")
def chromium(tmp_path_factory: pytest.TempPathFactory) -> Chromium:
    binary = find_chromium()
    if binary is None:  # setup runs before the root conftest's call-phase check: honour it here too
        if os.environ.get("QUALIFY_REQUIRE_BROWSER") == "1":
            pytest.fail("QUALIFY_REQUIRE_BROWSER=1 and this test needs headless Chromium", pytrace=False)
        pytest.skip("needs headless Chromium")
    return Chromium(binary, tmp_path_factory.mktemp("chromium"))


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A passing and a failing receipt written here (the default lane, with series), their pages
    and the comparison page."""
    identity = load_identity(identity_path_for_lane(LANE))
    envelope = lane_envelope(identity)
    archive = tmp_path_factory.mktemp("browser-receipts")
    passing = write_lane_receipt(archive, identity, [make_series(envelope, seed=seed) for seed in (1, 2, 3)])
    failing = write_lane_receipt(archive, identity, [make_series(envelope, seed=5, diverge_at=9, over=(1, 0),
                                                                 max_scale=1.7)], max_abs=1.7)
    out = tmp_path_factory.mktemp("browser-pages")
    made = {"passing": out / "passing.html", "failing": out / "failing.html", "compare": out / "compare.html"}
    assert report_cli([str(passing), "--output", str(made["passing"])]) == 0
    assert report_cli([str(failing), "--output", str(made["failing"])]) == 0
    assert report_cli([str(passing), str(failing), "--output", str(made["compare"])]) == 0
    made["passing-receipt"], made["failing-receipt"] = passing, failing
    return made


def expected_figures(page: Path) -> list[str]:
    """The plots the page must show, from the page's own outline as written (each then checked in
    the browser's DOM and on the screenshot)."""
    return page_outline(page.read_text(encoding="utf-8")).figure_order


def check_in_browser(chromium: Chromium, page: Path, verdicts: dict[str, str], figures: list[str],
                     workdir: Path) -> list[str]:
    """Every problem a reader would see: the DOM lacks a verdict or a plot, or a plot's region of
    the full-page screenshot is blank."""
    problems = outline_problems(chromium.dump_dom(page), verdicts=verdicts, figures=figures)
    boxes, without_svg, height = chromium.plot_boxes(page)
    problems.extend(f"plot {name}: no svg in the browser's layout" for name in without_svg)
    screenshot = chromium.screenshot(page, workdir / f"{page.stem}.png", height)
    problems.extend(blank_plot_problems(screenshot, boxes))
    return problems


# --------------------------------------------------------------------------- pages written here


@pytest.mark.browser
def test_single_page_in_chromium_shows_the_verdict_and_every_plot_drawn(
        chromium: Chromium, pages: dict[str, Path], tmp_path: Path) -> None:
    """(The failing page is checked whole by the blank-plot test below: only its blanked plot fails.)"""
    page = pages["passing"]
    figures = expected_figures(page)
    assert figures == [*(f"drift-sample-{n}" for n in (1, 2, 3)), *(f"margin-sample-{n}" for n in (1, 2, 3)),
                       "kv-heatmap"]
    verdicts = {"verdict": summary_of(pages["passing-receipt"])["verdict"], "verdict-status": status_label("passed"),
                "signature": "Signature verified"}
    assert check_in_browser(chromium, page, verdicts, figures, tmp_path) == []


@pytest.mark.browser
def test_comparison_page_in_chromium_shows_both_verdicts_and_every_plot_drawn(
        chromium: Chromium, pages: dict[str, Path], tmp_path: Path) -> None:
    page = pages["compare"]
    figures = expected_figures(page)
    assert figures == ["compare-drift", "kv-heatmap-receipt-1", "kv-heatmap-receipt-2"]
    verdicts = {f"verdict-receipt-{index}": summary_of(pages[receipt])["verdict"]
                for index, receipt in ((1, "passing-receipt"), (2, "failing-receipt"))}
    assert check_in_browser(chromium, page, verdicts, figures, tmp_path) == []


# --------------------------------------------------------------------------- the checks can fail


def without_figure(page: str, figure_id: str) -> str:
    return _FIGURE.sub(lambda found: "" if found.group("id") == figure_id else found.group(0), page)


def test_checker_reports_a_missing_plot_a_missing_svg_and_a_missing_verdict(pages: dict[str, Path]) -> None:
    text = pages["passing"].read_text(encoding="utf-8")
    verdicts = {"verdict": summary_of(pages["passing-receipt"])["verdict"]}
    figures = expected_figures(pages["passing"])
    assert outline_problems(text, verdicts=verdicts, figures=figures) == []
    assert outline_problems(without_figure(text, "margin-sample-2"), verdicts=verdicts, figures=figures) == [
        "page: no plot figure 'margin-sample-2', expected <figure class=\"plot\" id=\"margin-sample-2\">"]
    no_svg = _FIGURE.sub(lambda found: _SVG.sub("", found.group(0)) if found.group("id") == "kv-heatmap"
                         else found.group(0), text)
    assert outline_problems(no_svg, verdicts=verdicts, figures=figures) == [
        "page: plot figure 'kv-heatmap' holds 0 svg elements, expected 1"]
    no_verdict = _HEADLINE.sub(r"\1</p>", text)
    assert outline_problems(no_verdict, verdicts=verdicts, figures=figures) == [
        f"page: element 'verdict' does not hold the verdict {verdicts['verdict'][:80]!r}"]
    assert outline_problems(text, verdicts={"verdict-receipt-1": "x"}, figures=[]) == [
        "page: no element with id 'verdict-receipt-1', expected the verdict there"]


@pytest.mark.browser
def test_browser_check_fails_when_a_plot_is_removed(chromium: Chromium, pages: dict[str, Path],
                                                    tmp_path: Path) -> None:
    damaged = tmp_path / "damaged.html"
    damaged.write_text(without_figure(pages["passing"].read_text(encoding="utf-8"), "drift-sample-1"), encoding="utf-8")
    verdicts = {"verdict": summary_of(pages["passing-receipt"])["verdict"]}
    problems = check_in_browser(chromium, damaged, verdicts, expected_figures(pages["passing"]), tmp_path)
    assert problems == ["page: no plot figure 'drift-sample-1', expected <figure class=\"plot\" id=\"drift-sample-1\">"]


@pytest.mark.browser
def test_screenshot_check_fails_when_a_plot_is_blank(chromium: Chromium, pages: dict[str, Path],
                                                     tmp_path: Path) -> None:
    """An svg of the right size with nothing drawn in it: the DOM check passes, the pixels do not."""
    blank = tmp_path / "blank.html"
    text = pages["failing"].read_text(encoding="utf-8")
    blank.write_text(_FIGURE.sub(lambda found: _SVG.sub(r"\1</svg>", found.group(0))
                                 if found.group("id") == "margin-sample-1" else found.group(0), text), encoding="utf-8")
    verdicts = {"verdict": summary_of(pages["failing-receipt"])["verdict"]}
    problems = check_in_browser(chromium, blank, verdicts, expected_figures(pages["failing"]), tmp_path)
    assert len(problems) == 1 and problems[0].startswith("plot margin-sample-1: blank region"), problems


# --------------------------------------------------------------------------- without a browser


def _pytest_without_chromium(tmp_path: Path, *, required: bool) -> subprocess.CompletedProcess[str]:
    """A test in a ``tests/browser/`` folder, run under the repository's root conftest (which gives
    the folder its requirement) with Chromium made absent."""
    shutil.copyfile(REPO_ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "tests" / "browser").mkdir(parents=True)
    (tmp_path / "tests" / "browser" / "test_needs_browser.py").write_text(
        "def test_needs_browser():\n    pass\n", encoding="utf-8")
    env = {**os.environ, "QUALIFY_CHROMIUM": str(tmp_path / "no-chromium-here")}
    env.pop("QUALIFY_REQUIRE_BROWSER", None)
    if required:
        env["QUALIFY_REQUIRE_BROWSER"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rsf", "-p", "no:cacheprovider", "-p", "no:xdist",
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_browser_test_is_skipped_with_a_reason_when_chromium_is_absent(tmp_path: Path) -> None:
    done = _pytest_without_chromium(tmp_path, required=False)
    assert done.returncode == 0, done.stdout[-2000:]
    assert "1 skipped" in done.stdout and "needs headless Chromium" in done.stdout


def test_browser_test_fails_when_chromium_is_required_and_absent(tmp_path: Path) -> None:
    done = _pytest_without_chromium(tmp_path, required=True)
    assert done.returncode == 1, done.stdout[-2000:]
    assert "1 failed" in done.stdout
    assert "QUALIFY_REQUIRE_BROWSER=1 and tests/browser/ needs headless Chromium" in done.stdout


# --------------------------------------------------------------------------- real runs


@pytest.fixture(scope="session")
def real_receipts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealReceipts]:
    yield real_receipts_in(tmp_path_factory)


@pytest.mark.slow
@pytest.mark.browser
def test_real_runs_in_chromium(chromium: Chromium, real_receipts: RealReceipts, tmp_path: Path) -> None:
    """A real passing run, a real v-scale fault run and their comparison, as a reader sees them."""
    trust = ["--trust", str(real_receipts.trust)]
    for name, receipts in (("passing", [real_receipts.passing]), ("fault", [real_receipts.fault]),
                           ("compare", [real_receipts.fault, real_receipts.passing])):
        page = tmp_path / f"{name}.html"
        assert report_cli([*map(str, receipts), "--output", str(page), *trust]) == 0
        verdicts = ({f"verdict-receipt-{index}": summary_of(receipt)["verdict"] for index, receipt in enumerate(receipts, 1)}
                    if name == "compare" else {"verdict": summary_of(receipts[0])["verdict"]})
        figures = expected_figures(page)
        assert len(figures) >= 3, (name, figures)  # the drift (or comparison) plot and a heat map at least
        assert check_in_browser(chromium, page, verdicts, figures, tmp_path) == [], name

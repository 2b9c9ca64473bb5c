"""Rendering a report in headless Chromium: its DOM as the browser built it, where each plot
landed, and a screenshot whose plot regions can be checked for content (not blank).

The page itself runs no script (its Content-Security-Policy forbids it). To learn where the plots
landed, :func:`plot_boxes` renders a *probe copy* of the page: the policy removed and a short
script added that writes each plot's ``svg`` box into the document title; nothing else changes,
so the layout is the page's own. Screenshots are taken at that layout's full height.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qualify.core.errors import Refused, one_line

WINDOW_WIDTH = 960
"""The viewport width every render uses (the page's main column is 920 px)."""
MAX_HEIGHT = 16000
"""The tallest screenshot taken (a comparison of many receipts is shorter than this)."""
TIMEOUT_S = 120.0
"""A generous bound on one Chromium run (they take a second or two here)."""

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--force-device-scale-factor=1", "--mute-audio")
"""Headless, offline, no first-run or update traffic, one CSS pixel per screenshot pixel."""

_PROBE = """<script>(function () {
  var boxes = [];
  document.querySelectorAll('figure.plot').forEach(function (figure) {
    var svg = figure.querySelector('svg');
    var r = svg ? svg.getBoundingClientRect() : null;
    boxes.push([figure.id, r ? [r.left + window.scrollX, r.top + window.scrollY, r.width, r.height] : null]);
  });
  document.title = JSON.stringify({boxes: boxes, height: document.documentElement.scrollHeight});
})();</script>"""
_CSP_META = re.compile(r'<meta http-equiv="Content-Security-Policy"[^>]*>')
_TITLE = re.compile(r"<title>(.*?)</title>", re.DOTALL)


@dataclass(frozen=True)
class Box:
    """Where one plot's ``svg`` landed, in CSS pixels from the page's top left."""

    figure_id: str
    left: float
    top: float
    width: float
    height: float


def find_chromium() -> Path | None:
    """``$QUALIFY_CHROMIUM`` when set (None unless it is an executable file), else the Chromium
    (or Chrome) binary on PATH, else Debian's /usr/bin/chromium; None if absent."""
    configured = os.environ.get("QUALIFY_CHROMIUM")
    if configured:
        chosen = Path(configured)
        return chosen if chosen.is_file() and os.access(chosen, os.X_OK) else None
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return Path(found)
    fallback = Path("/usr/bin/chromium")
    return fallback if fallback.is_file() else None


class Chromium:
    """One headless Chromium binary with a profile directory of its own (``workdir``)."""

    def __init__(self, binary: Path, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.profile = workdir / "chromium-profile"

    def _run(self, page: Path, *arguments: str, height: int) -> str:
        command = [str(self.binary), *FLAGS, f"--user-data-dir={self.profile}",
                   f"--window-size={WINDOW_WIDTH},{height}", *arguments, page.absolute().as_uri()]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
                                  env={**os.environ, "TZ": "UTC"})
        except subprocess.TimeoutExpired:
            raise Refused(f"chromium: no result within {TIMEOUT_S:.0f} s for {page.name}") from None
        if done.returncode != 0:
            last = one_line(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "")
            raise Refused(f"chromium: exit status {done.returncode} for {page.name}: {last[:200]}")
        return done.stdout

    def dump_dom(self, page: Path, height: int = 1200) -> str:
        """The page's DOM as Chromium serialises it after loading (``--dump-dom``)."""
        return self._run(page, "--dump-dom", height=height)

    def plot_boxes(self, page: Path) -> tuple[list[Box], list[str], int]:
        """Each plot's svg box (from a probe copy of the page), the plots without an svg, and the
        page's full height in CSS pixels."""
        text = page.read_text(encoding="utf-8")
        probe = self.workdir / f"probe-{page.name}"
        probe.write_text(_CSP_META.sub("", text).replace("</body>", f"{_PROBE}</body>", 1), encoding="utf-8")
        found = _TITLE.search(self.dump_dom(probe))
        if found is None:
            raise Refused(f"chromium: the probe copy of {page.name} has no title, expected the plot boxes")
        layout = json.loads(html.unescape(found.group(1)))
        boxes = [Box(name, *rect) for name, rect in layout["boxes"] if rect is not None]
        missing = [name for name, rect in layout["boxes"] if rect is None]
        return boxes, missing, int(layout["height"])

    def screenshot(self, page: Path, png: Path, height: int) -> Path:
        """A PNG of the whole page (``height`` CSS pixels tall, at most :data:`MAX_HEIGHT`)."""
        self._run(page, f"--screenshot={png.absolute()}", height=min(max(height, 1), MAX_HEIGHT))
        if not png.is_file():
            raise Refused(f"chromium: no screenshot written for {page.name}")
        return png


def blank_plot_problems(png: Path, boxes: list[Box], *, minimum_std: float = 0.02,
                        minimum_inked: float = 0.005) -> list[str]:
    """One line per plot whose region of the screenshot is blank or cut off: its pixels must vary
    (standard deviation of grey levels at least ``minimum_std``, on a 0-1 scale) and at least
    ``minimum_inked`` of them must be visibly darker than the background."""
    import matplotlib.image

    image = np.asarray(matplotlib.image.imread(png), dtype=np.float64)
    grey = image[..., :3].mean(axis=2) if image.ndim == 3 else image
    problems = []
    for box in boxes:
        top, left = int(round(box.top)), int(round(box.left))
        bottom, right = int(round(box.top + box.height)), int(round(box.left + box.width))
        if box.width < 50 or box.height < 50:
            problems.append(f"plot {box.figure_id}: its svg is {box.width:.0f}x{box.height:.0f} px, expected a visible plot")
            continue
        if bottom > grey.shape[0] or right > grey.shape[1]:
            problems.append(f"plot {box.figure_id}: lies outside the {grey.shape[1]}x{grey.shape[0]} screenshot")
            continue
        region = grey[top:bottom, left:right]
        inked = float(np.mean(region < 0.8))
        if float(region.std()) < minimum_std or inked < minimum_inked:
            problems.append(f"plot {box.figure_id}: blank region (grey std {region.std():.4f}, "
                            f"{inked:.2%} inked), expected a drawn plot")
    return problems

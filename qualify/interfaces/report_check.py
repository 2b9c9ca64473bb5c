"""What a rendered report must hold, checked on its HTML (as written, or as a browser's DOM dump):
the verdict, and every expected plot as a ``figure.plot`` holding an ``<svg>``.

Used by the tests and ``tools/report_screenshots.py``; :func:`outline_problems` says in one line
each what is missing, so a page without its verdict or a plot never passes unnoticed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from html.parser import HTMLParser

_VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
                   "track", "wbr"})


@dataclass
class PageOutline:
    """A page's parts the checks read: text by element id, plot figures (whether each holds an
    ``svg``, and how many), and the page's title."""

    texts: dict[str, str] = field(default_factory=dict)
    figures: dict[str, int] = field(default_factory=dict)
    figure_order: list[str] = field(default_factory=list)
    title: str = ""


class _OutlineParser(HTMLParser):
    """Collects the text of every element with an id and the ``svg`` count of each plot figure."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.outline = PageOutline()
        self._open: list[tuple[str, str | None]] = []  # (tag, id) of every open element
        self._figure: str | None = None
        self._figure_depth = 0
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        element_id = attributes.get("id")
        classes = (attributes.get("class") or "").split()
        if tag == "figure" and "plot" in classes and element_id:
            self._figure, self._figure_depth = element_id, len(self._open)
            self.outline.figures[element_id] = 0
            self.outline.figure_order.append(element_id)
        elif tag == "svg" and self._figure is not None:
            self.outline.figures[self._figure] += 1
        self._in_title = tag == "title"
        if tag in _VOID:
            return
        self._open.append((tag, element_id))
        if element_id:
            self.outline.texts.setdefault(element_id, "")

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        # A self-closed element (<meta/>, inline SVG's <path/>) opens nothing that stays open.
        self.handle_starttag(tag, attrs)
        if tag not in _VOID and self._open and self._open[-1][0] == tag:
            self._open.pop()

    def handle_endtag(self, tag: str) -> None:
        self._in_title = False
        for index in range(len(self._open) - 1, -1, -1):
            if self._open[index][0] == tag:
                del self._open[index:]
                break
        if self._figure is not None and len(self._open) <= self._figure_depth:
            self._figure = None

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.outline.title += data
        for _tag, element_id in self._open:
            if element_id:
                self.outline.texts[element_id] += data


def page_outline(page: str) -> PageOutline:
    """The outline of an HTML page (well-formed or not: a browser's serialisation reads too)."""
    parser = _OutlineParser()
    parser.feed(page)
    parser.close()
    return parser.outline


def _normalised(text: str) -> str:
    return " ".join(text.split())


def outline_problems(page: str, *, verdicts: Mapping[str, str], figures: Iterable[str]) -> list[str]:
    """What the page lacks, one line each: for each ``element id -> verdict`` of ``verdicts`` the
    verdict's text inside that element (``verdict`` on a single page, ``verdict-receipt-<i>`` on a
    comparison), and each of ``figures`` as a plot figure holding exactly one ``svg``; empty
    when the page is complete."""
    outline = page_outline(page)
    problems = []
    for element_id, verdict in verdicts.items():
        if element_id not in outline.texts:
            problems.append(f"page: no element with id {element_id!r}, expected the verdict there")
        elif _normalised(verdict) not in _normalised(outline.texts[element_id]):
            problems.append(f"page: element {element_id!r} does not hold the verdict {verdict[:80]!r}")
    for figure_id in figures:
        count = outline.figures.get(figure_id)
        if count is None:
            problems.append(f"page: no plot figure {figure_id!r}, expected <figure class=\"plot\" id=\"{figure_id}\">")
        elif count != 1:
            problems.append(f"page: plot figure {figure_id!r} holds {count} svg elements, expected 1")
    return problems

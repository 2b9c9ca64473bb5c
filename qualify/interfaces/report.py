"""``qualify report RECEIPT...``: one self-contained HTML page per run, or a comparison of several."""

from __future__ import annotations

from collections.abc import Sequence

from qualify.core.errors import Refused


def report_cli(argv: Sequence[str]) -> int:
    """``qualify report RECEIPT... [--output FILE]`` (not written yet)."""
    raise Refused("qualify report: not implemented yet")

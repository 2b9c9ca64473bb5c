"""Golden files: text a test renders, held whole in ``tests/golden/`` so that a change of it is a
diff in review rather than a sentence edited in a test.

:class:`Golden` compares a rendering with its file. A difference fails with a unified diff; a
missing file fails too (it is never created silently). Under ``--qualify-update-goldens`` (the
option ``tests/conftest.py`` registers) the file is written instead, and the write is recorded so
the run can say which files changed.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden"
UPDATE_OPTION = "--qualify-update-goldens"


class GoldenMismatch(AssertionError):
    """A rendering that differs from its golden file, or a golden file that is missing."""


@dataclass
class Golden:
    """Compares renderings with the files under ``directory``; ``update`` rewrites them instead and
    appends each rewritten file's name to ``written``."""

    update: bool
    directory: Path = GOLDEN_DIR
    written: list[str] = field(default_factory=list)

    def check(self, name: str, rendered: str) -> str:
        """``unchanged`` when ``name`` holds ``rendered``; with ``update``, ``created`` or
        ``rewritten`` after writing it. Otherwise raises :class:`GoldenMismatch`."""
        path = self.directory / name
        shown = f"tests/golden/{name}" if self.directory == GOLDEN_DIR else str(path)
        try:
            held = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            held = None
        if held == rendered:
            return "unchanged"
        if not self.update:
            if held is None:
                raise GoldenMismatch(f"{shown}: missing; run pytest with {UPDATE_OPTION} to write it, then review it")
            diff = difflib.unified_diff(held.splitlines(keepends=True), rendered.splitlines(keepends=True),
                                        fromfile=shown, tofile=f"{shown} (rendered now)")
            raise GoldenMismatch(f"{shown}: the rendered words differ from the golden file (run pytest with "
                                 f"{UPDATE_OPTION} to accept them, then review the diff):\n{''.join(diff)}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(rendered, encoding="utf-8")
        self.written.append(shown)
        return "created" if held is None else "rewritten"

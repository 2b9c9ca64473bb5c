"""The docs are a map: every module of the package has its row in docs/architecture.md's module
table (and every row names a module that exists), and every page under docs/ is in docs/README.md."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def modules() -> set[str]:
    return {path.relative_to(REPO).as_posix() for path in (REPO / "qualify").rglob("*.py")
            if path.name != "__init__.py" and "_shipped" not in path.parts}


def module_table() -> set[str]:
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = text[text.index("## Modules"):]
    table = table[:table.index("\n## ", 1)]
    return set(re.findall(r"^\| `(qualify/[^`]+\.py)` \|", table, flags=re.MULTILINE))


def test_every_module_has_one_row_in_the_architecture_table() -> None:
    listed = module_table()
    assert sorted(modules() - listed) == [], "modules without a row in docs/architecture.md"
    assert sorted(listed - modules()) == [], "rows in docs/architecture.md naming no module"


def test_every_page_is_on_the_docs_map() -> None:
    index = (REPO / "docs" / "README.md").read_text(encoding="utf-8")
    pages = {path.name for path in (REPO / "docs").glob("*.md")} - {"README.md"}
    assert sorted(page for page in pages if f"`{page}`" not in index) == []

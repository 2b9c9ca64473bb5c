"""Console layouts that fit any width: no number is ever cut to an ellipsis.

rich squeezes a table wider than the terminal by truncating cells (``1.2…``, ``5.…``), which
turns ``5.68e-05`` seconds into what reads as five. :class:`FittedTable` measures itself against
the width it is given at render time and picks a layout in which every cell keeps its full text:
the whole table, the table folded into column groups that each repeat the key column, or one
block of "name value" rows per row. Step lines and bullet lists hang their wrapped text under
their own column, so a long message never runs back under the step's name.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

Cell = str | Text
"""A table cell: plain text, or styled text (a red ``failed``)."""

WRAPPED_TEXT_MIN = 24
"""The narrowest a wrapping text column may be (a finding or message reads badly below it)."""

BLOCK_INDENT = 2
"""How far a block's "name value" rows sit under its heading."""


@dataclass(frozen=True, slots=True)
class Field:
    """One column: its header, and whether its cells are free text that may wrap at spaces
    (findings, messages) or values that are never broken (numbers, names, yes/no)."""

    header: str
    wraps: bool = False
    justify: Literal["left", "right"] = "right"


def _plain(cell: Cell) -> str:
    return cell.plain if isinstance(cell, Text) else cell


def _longest_word(text: str) -> int:
    return max((cell_len(word) for word in text.split()), default=0)


def table_width(widths: Sequence[int]) -> int:
    """The width of a rich box table with these column widths: one space of padding each side of
    every cell and a border line before, between and after the columns."""
    return sum(widths) + 3 * len(widths) + 1


def _balanced_groups(widths: Sequence[int], width: int) -> list[list[int]] | None:
    """The columns after the key column 0 split, in order, into the fewest groups that each fit
    ``width`` beside the key column, the widest group as narrow as can be; None if one column
    cannot fit beside the key at all."""
    rest = list(range(1, len(widths)))

    def group_width(group: Sequence[int]) -> int:
        return table_width([widths[0], *(widths[index] for index in group)])

    if any(group_width([index]) > width for index in rest):
        return None

    @functools.cache
    def best(start: int, parts: int) -> tuple[int, tuple[tuple[int, ...], ...]] | None:
        """The narrowest split of ``rest[start:]`` into ``parts`` fitting groups: (widest, groups)."""
        if parts == 1:
            group = tuple(rest[start:])
            return (group_width(group), (group,)) if group_width(group) <= width else None
        found: tuple[int, tuple[tuple[int, ...], ...]] | None = None
        for end in range(start + 1, len(rest) - parts + 2):
            head = tuple(rest[start:end])
            if group_width(head) > width:
                break
            tail = best(end, parts - 1)
            if tail is not None and (found is None or max(group_width(head), tail[0]) < found[0]):
                found = (max(group_width(head), tail[0]), (head, *tail[1]))
        return found

    for parts in range(1, len(rest) + 1):
        split = best(0, parts)
        if split is not None:
            return [[0, *group] for group in split[1]]
    return None


class FittedTable:
    """A titled table whose layout is chosen at render time from the width it is given.

    ``narrow`` says what it becomes when the whole table does not fit: ``"fold"`` splits the
    columns into groups (each a table repeating the first, key column), ``"blocks"`` prints one
    block per row ("name value" rows under a heading naming the row by its key)."""

    def __init__(self, title: str, fields: Sequence[Field], rows: Iterable[Sequence[Cell]], *,
                 narrow: Literal["fold", "blocks"] = "fold") -> None:
        self.title = title
        self.fields = tuple(fields)
        self.rows = [tuple(row) for row in rows]
        self.narrow = narrow
        for row in self.rows:
            if len(row) != len(self.fields):
                raise ValueError(f"table {title!r}: a row has {len(row)} cells, expected {len(self.fields)}")

    def _width(self, index: int, *, wrap_header: bool) -> int:
        """The narrowest a column can be with every cell whole: a value column as wide as its
        widest cell and its header (or the header's longest word, when headers wrap); a text
        column as wide as its longest word, and at least :data:`WRAPPED_TEXT_MIN`."""
        field = self.fields[index]
        cells = [_plain(row[index]) for row in self.rows]
        if field.wraps:
            return max(WRAPPED_TEXT_MIN, _longest_word(field.header), *(_longest_word(c) for c in cells))
        header = _longest_word(field.header) if wrap_header else cell_len(field.header)
        return max(header, *(cell_len(c) for c in cells), 1)

    def _widths(self, *, wrap_header: bool) -> list[int]:
        return [self._width(index, wrap_header=wrap_header) for index in range(len(self.fields))]

    def layout(self, width: int) -> list[list[int]] | None:
        """Column groups (indices, each starting with the key column 0) that fit ``width``, as few
        as possible and of balanced widths: one when the whole table fits; None when it must
        become blocks. Headers may wrap at spaces when that saves a group."""
        natural, narrowest = self._widths(wrap_header=False), self._widths(wrap_header=True)
        for widths in (natural, narrowest):
            if table_width(widths) <= width:
                return [list(range(len(self.fields)))]
        if self.narrow == "blocks":
            return None
        plans = [groups for groups in (_balanced_groups(natural, width), _balanced_groups(narrowest, width))
                 if groups is not None]
        return min(plans, key=len) if plans else None

    def _table(self, columns: Sequence[int], title: str, width: int) -> Table:
        """One group's table, each value column fixed at its width (headers on one line when the
        group fits so, else wrapped at spaces), so rich never has to squeeze a cell."""
        natural = [self._width(index, wrap_header=False) for index in columns]
        wrap_header = table_width(natural) > width
        table = Table(title=title, header_style="bold")
        for index in columns:
            field = self.fields[index]
            header = Text(field.header, justify=field.justify, no_wrap=not wrap_header)
            # Values never wrap; "fold" instead of the default ellipsis is a second guard: a cell
            # is never shortened, even if a future layout miscounts.
            if field.wraps:
                table.add_column(header, justify=field.justify, overflow="fold", min_width=WRAPPED_TEXT_MIN)
            else:
                table.add_column(header, justify=field.justify, no_wrap=True, overflow="fold",
                                 width=self._width(index, wrap_header=wrap_header))
        for row in self.rows:
            table.add_row(*(row[index] for index in columns))
        return table

    def _blocks(self) -> Group:
        parts: list[RenderableType] = [Text(self.title, style="bold")]
        name_width = max(cell_len(field.header) for field in self.fields[1:]) if len(self.fields) > 1 else 1
        for row in self.rows:
            parts.append(Text.assemble((f"{self.fields[0].header} ", "bold"), _as_text(row[0], "bold")))
            grid = Table.grid(padding=(0, 1))
            grid.add_column(no_wrap=True, width=name_width, style="dim")
            grid.add_column(overflow="fold")
            for field, cell in zip(self.fields[1:], row[1:], strict=True):
                grid.add_row(field.header, cell)
            parts.append(Padding(grid, (0, 0, 0, BLOCK_INDENT)))
        return Group(*parts)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        groups = self.layout(options.max_width)
        if groups is None:
            yield self._blocks()
            return
        for number, columns in enumerate(groups, start=1):
            title = self.title if len(groups) == 1 else f"{self.title} ({number}/{len(groups)})"
            yield self._table(columns, title, options.max_width)


def _as_text(cell: Cell, style: str) -> Text:
    return cell.copy() if isinstance(cell, Text) else Text(cell, style=style)


def hanging(lead: Cell, body: Cell, *, lead_width: int | None = None) -> Table:
    """``lead`` then ``body``, the body's wrapped lines indented under its own first line (a step's
    message under the message, a reason under the reason), never back under ``lead``."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True, width=lead_width)
    grid.add_column(overflow="fold")
    grid.add_row(lead, body)
    return grid

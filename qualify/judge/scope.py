"""What a verdict covers, in words derived from the judgement: the fixture it ran and the outcome
of the lane's preregistered controls (seed 000 §32.9: a fixture verdict "does not prove a general
zero-divergence contract"; §32.10: exceedances are published, never dropped).

The scope line is built here and only here, from :class:`Scope`; no caller writes its own words,
so the wording cannot drift from the judgement it states.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DocumentOutcome:
    """One control document: the lengths (of the criteria's grid) at which the lane exceeded its
    E1 gate; none means the document is within its gates."""

    document: str
    exceeding_lengths: tuple[int, ...]

    @property
    def within(self) -> bool:
        return not self.exceeding_lengths


@dataclass(frozen=True)
class ControlsOutcome:
    """The lane's E2 controls as judged against their E1 gates, from the measuring receipt."""

    criteria: str
    lengths: tuple[int, ...]
    documents: tuple[DocumentOutcome, ...]
    source: str  # the receipt the controls were measured in (receipt://...)

    @property
    def within(self) -> int:
        return sum(1 for document in self.documents if document.within)


@dataclass(frozen=True)
class Scope:
    """The fixture a verdict ran on, and its lane's controls (None: the identity declares none)."""

    fixture: str
    repetitions: int
    prompt_tokens: int
    output_tokens: int
    controls: ControlsOutcome | None


def length_ranges(lengths: Sequence[int], grid: Sequence[int]) -> str:
    """``lengths`` as runs of consecutive grid entries: (1024, 2048, 4096) on the grid
    (512, 1024, 2048, 4096) is "1024–4096"; (512, 2048) is "512 and 2048"."""
    positions = sorted(grid.index(length) for length in set(lengths))
    runs: list[list[int]] = []
    for position in positions:
        if runs and position == runs[-1][-1] + 1:
            runs[-1].append(position)
        else:
            runs.append([position])
    words = [f"{grid[run[0]]}" if len(run) == 1 else f"{grid[run[0]]}–{grid[run[-1]]}" for run in runs]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + f" and {words[-1]}"


def controls_words(controls: ControlsOutcome | None) -> str:
    """The controls half of a scope line."""
    if controls is None:
        return "controls: none declared for this lane"
    total = len(controls.documents)
    words = f"controls ({controls.criteria}): {controls.within} of {total} documents within E1 gates"
    for document in controls.documents:
        if not document.within:
            words += (f"; {document.document} exceeds at "
                      f"{length_ranges(document.exceeding_lengths, controls.lengths)} (published)")
    return words


def fixture_words(scope: Scope) -> str:
    return (f"fixture {scope.fixture} ({scope.repetitions} × "
            f"{scope.prompt_tokens}/{scope.output_tokens})")


def scope_line(passed: bool, scope: Scope, reason: str | None = None) -> str:
    """"QUALIFIED on fixture F (3 × 2048/256); controls: ..." or "NOT QUALIFIED on fixture F
    (...): <reason>; controls: ..."."""
    if passed:
        return f"QUALIFIED on {fixture_words(scope)}; {controls_words(scope.controls)}"
    because = f": {reason}" if reason else ""
    return f"NOT QUALIFIED on {fixture_words(scope)}{because}; {controls_words(scope.controls)}"


def scope_document(scope: Scope, passed: bool) -> dict[str, Any]:
    """The scope as JSON (``--json``, receipts, JUnit): the same facts as :func:`scope_line`,
    which it carries as ``line``."""
    controls = scope.controls
    return {
        "line": scope_line(passed, scope),
        "fixture": {"name": scope.fixture, "repetitions": scope.repetitions,
                    "prompt_tokens": scope.prompt_tokens, "output_tokens": scope.output_tokens},
        "controls": None if controls is None else {
            "criteria": controls.criteria,
            "source": controls.source,
            "lengths": list(controls.lengths),
            "documents_within": controls.within,
            "documents_total": len(controls.documents),
            "documents": [{"document": document.document, "within": document.within,
                           "exceeding_lengths": list(document.exceeding_lengths)}
                          for document in controls.documents],
        },
    }

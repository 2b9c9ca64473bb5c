"""What a verdict covers, in words derived from the judgement: the fixture it ran and the outcome
of the lane's preregistered controls (seed 000 §32.9: a fixture verdict "does not prove a general
zero-divergence contract"; §32.10: exceedances are published, never dropped).

The scope line is built here and only here, from :class:`Scope`; no caller writes its own words,
so the wording cannot drift from the judgement it states.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""A fixture, control document or criteria name as a scope line shows it: one word with no
separator of the line in it (``;``, ``,``, parentheses, spaces), so the line reads one way only."""


SERVICE_CONDITIONS: dict[str, str] = {
    "aba": "A/B/A interleaving on one warm producer",
    "recovery": "a producer killed (SIGKILL) between two handoffs and started again",
}
"""Each service condition a qualification can run under (``--service-conditions``, issue 38), and
how its scope line words it (judged in :mod:`qualify.judge.service`)."""


CALIBRATED_ON = re.compile(r"receipt://[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""A calibration receipt as a scope line names it: ``receipt://<run-id>``."""


def _name(value: object, what: str) -> None:
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise ValueError(f"scope: {what} {value!r}, expected a name of letters, digits, '.', '_' or '-'")


def _count(value: object, what: str) -> None:
    if type(value) is not int or value < 1:  # bool is no count
        raise ValueError(f"scope: {what} {value!r}, expected a whole number >= 1")


@dataclass(frozen=True)
class DocumentOutcome:
    """One control document: the lengths (of the criteria's grid) at which the lane exceeded its
    E1 gate; none means the document is within its gates."""

    document: str
    exceeding_lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        _name(self.document, "control document")
        if not isinstance(self.exceeding_lengths, tuple):
            raise ValueError(f"scope: {self.document}: exceeding lengths {self.exceeding_lengths!r}, expected a tuple")
        for length in self.exceeding_lengths:
            _count(length, f"{self.document}: exceeding length")
        if list(self.exceeding_lengths) != sorted(set(self.exceeding_lengths)):
            raise ValueError(f"scope: {self.document}: exceeding lengths {self.exceeding_lengths}, expected "
                             f"increasing lengths, each once")

    @property
    def within(self) -> bool:
        return not self.exceeding_lengths


@dataclass(frozen=True)
class ControlsOutcome:
    """The lane's E2 controls as judged against their E1 gates, from the measuring receipt.
    Every exceeding length is one of ``lengths`` (the criteria's grid), so the line's length runs
    are runs of that grid; a document appears once."""

    criteria: str
    lengths: tuple[int, ...]
    documents: tuple[DocumentOutcome, ...]
    source: str  # the receipt the controls were measured in (receipt://...)

    def __post_init__(self) -> None:
        _name(self.criteria, "controls criteria")
        if not isinstance(self.lengths, tuple) or not self.lengths:
            raise ValueError(f"scope: {self.criteria}: lengths {self.lengths!r}, expected a non-empty tuple")
        for length in self.lengths:
            _count(length, f"{self.criteria}: length")
        if list(self.lengths) != sorted(set(self.lengths)):
            raise ValueError(f"scope: {self.criteria}: lengths {self.lengths}, expected increasing lengths, each once")
        if not isinstance(self.documents, tuple) or not self.documents:
            raise ValueError(f"scope: {self.criteria}: documents {self.documents!r}, expected a non-empty tuple "
                             f"(controls with no document measured state nothing)")
        names = [document.document for document in self.documents]
        if len(set(names)) != len(names):
            raise ValueError(f"scope: {self.criteria}: a control document is named twice in {names}")
        for document in self.documents:
            outside = sorted(set(document.exceeding_lengths) - set(self.lengths))
            if outside:
                raise ValueError(f"scope: {self.criteria}: {document.document} exceeds at {outside}, "
                                 f"lengths the criteria's grid {list(self.lengths)} does not hold")
        if not isinstance(self.source, str) or not self.source.strip() or not self.source.isprintable():
            raise ValueError(f"scope: {self.criteria}: source {self.source!r}, expected the measuring receipt's uri")

    @property
    def within(self) -> int:
        return sum(1 for document in self.documents if document.within)


@dataclass(frozen=True)
class EnvelopeScope:
    """The fixture envelope a producer declared non-deterministic was held to, in place of an
    anchor recheck: its rule and the honest handoffs and producer starts it was stated from."""

    rule: str
    handoffs: int
    producer_starts: int

    def __post_init__(self) -> None:
        _name(self.rule, "envelope rule")
        _count(self.handoffs, "envelope handoffs")
        _count(self.producer_starts, "envelope producer starts")


@dataclass(frozen=True)
class Scope:
    """The fixture a verdict ran on, and its lane's controls (None: the identity declares none).
    ``calibrated_on``: the calibration receipt (``receipt://<run-id>``) a rule judged here was
    calibrated on, when the rule does not come from a sealed identity (a served pair's); the
    fixture half of the line names it."""

    fixture: str
    repetitions: int
    prompt_tokens: int
    output_tokens: int
    controls: ControlsOutcome | None
    calibrated_on: str | None = None
    # The service conditions the handoffs ran under (a key of SERVICE_CONDITIONS), or None.
    service_conditions: str | None = None
    # The rule that judged the handoffs when it is not the exact-token one (the teacher-forced
    # rule's name), and (near-tie partings, all partings) over the repetitions when they were read.
    judged_by: str | None = None
    partings: tuple[int, int] | None = None
    # The fixture envelope the handoffs were held to (a producer declared non-deterministic), or None.
    envelope: EnvelopeScope | None = None

    def __post_init__(self) -> None:
        _name(self.fixture, "fixture")
        if self.service_conditions is not None and self.service_conditions not in SERVICE_CONDITIONS:
            raise ValueError(f"scope: service conditions {self.service_conditions!r}, expected one of "
                             f"{', '.join(SERVICE_CONDITIONS)}")
        for what in ("repetitions", "prompt_tokens", "output_tokens"):
            _count(getattr(self, what), f"fixture {self.fixture}: {what}")
        if self.controls is not None and not isinstance(self.controls, ControlsOutcome):
            raise ValueError(f"scope: controls {type(self.controls).__name__}, expected a ControlsOutcome or None")
        if self.calibrated_on is not None and not CALIBRATED_ON.fullmatch(str(self.calibrated_on)):
            raise ValueError(f"scope: calibrated on {self.calibrated_on!r}, expected receipt://<run-id>")
        if self.judged_by is not None:
            _name(self.judged_by, "rule")
        if self.envelope is not None and not isinstance(self.envelope, EnvelopeScope):
            raise ValueError(f"scope: envelope {type(self.envelope).__name__}, expected an EnvelopeScope or None")
        if self.partings is not None:
            near, total = self.partings
            if self.judged_by is None or not (type(near) is int and type(total) is int and 0 <= near <= total):
                raise ValueError(f"scope: partings {self.partings!r}, expected (near-ties, all) under a named rule")


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
    """The fixture half of a scope line: "fixture F (repetitions × prompt/output tokens)", and
    ", calibrated on receipt://R" inside the parentheses when the scope names its calibration, and
    ", under <conditions>" when the handoffs ran under service conditions, and ", judged
    teacher-forced by <rule>: N of M partings near-ties" under the teacher-forced rule, and ", held
    to its fixture envelope by <rule> from N handoffs over S producer starts, no anchor rechecked:
    producer declared non-deterministic" for a producer declared non-deterministic."""
    calibrated = f", calibrated on {scope.calibrated_on}" if scope.calibrated_on is not None else ""
    service = (f", under {SERVICE_CONDITIONS[scope.service_conditions]}"
               if scope.service_conditions is not None else "")
    judged = ""
    if scope.judged_by is not None:
        judged = f", judged teacher-forced by {scope.judged_by}"
        if scope.partings is not None:
            near, total = scope.partings
            judged += (": no parting" if total == 0 else f": {near} of {total} partings near-ties")
    held = ""
    if scope.envelope is not None:
        envelope = scope.envelope
        held = (f", held to its fixture envelope by {envelope.rule} from {envelope.handoffs} handoffs over "
                f"{envelope.producer_starts} producer starts, no anchor rechecked: producer declared non-deterministic")
    return (f"fixture {scope.fixture} ({scope.repetitions} × "
            f"{scope.prompt_tokens}/{scope.output_tokens}{calibrated}{service}{judged}{held})")


def scope_line(passed: bool, scope: Scope, reason: str | None = None) -> str:
    """"QUALIFIED on fixture F (3 × 2048/256); controls: ..." or "NOT QUALIFIED on fixture F
    (...): <reason>; controls: ..."."""
    if passed:
        return f"QUALIFIED on {fixture_words(scope)}; {controls_words(scope.controls)}"
    because = f": {reason}" if reason else ""
    return f"NOT QUALIFIED on {fixture_words(scope)}{because}; {controls_words(scope.controls)}"


def scope_document(scope: Scope, passed: bool) -> dict[str, Any]:
    """The scope as JSON (``--json``, receipts, JUnit): the same facts as :func:`scope_line`,
    which it carries as ``line``, with the line's two halves as the line words them
    (``fixture_words``, ``controls_words``), so a surface that shows one half quotes it, never
    re-words it."""
    controls = scope.controls
    return {
        "line": scope_line(passed, scope),
        "fixture_words": fixture_words(scope),
        "controls_words": controls_words(controls),
        "fixture": {"name": scope.fixture, "repetitions": scope.repetitions,
                    "prompt_tokens": scope.prompt_tokens, "output_tokens": scope.output_tokens},
        "judged_by": None if scope.judged_by is None else {
            "rule": scope.judged_by,
            "near_tie_partings": None if scope.partings is None else scope.partings[0],
            "partings": None if scope.partings is None else scope.partings[1]},
        "envelope": None if scope.envelope is None else {
            "rule": scope.envelope.rule, "handoffs": scope.envelope.handoffs,
            "producer_starts": scope.envelope.producer_starts},
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

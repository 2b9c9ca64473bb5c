"""Judging a lane's E2 controls against their E1 gates (seed 000 §32.10), from its controls record.

Per control document and nested length L, the gate is the upper end of the two-sided Wilson score
interval of the yardstick's disagreeing rows out of L, plus the criteria's points; the lane exceeds
when its disagreeing rows / L is strictly greater than the gate, compared exactly (as rationals:
no rounding of k / L can move a cell across its gate). The preregistered length-effect criterion
is evaluated only in the wording this module implements; any other wording, gate rule or
exceedance definition is a problem, never a guess.

Fail closed: a record or criteria with any defect gives a judgement whose ``problems`` name each
defect and whose ``outcome`` is None, with no table at all (never a partial one). Pure: the
criteria come in as the parsed document; nothing here reads a file.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal, TypeGuard

from qualify.core.digests import is_sha256_hex, jcs_sha256
from qualify.core.errors import one_line
from qualify.core.stats import wilson_interval
from qualify.core.strict_json import render
from qualify.judge.scope import ControlsOutcome, DocumentOutcome

CONTROLS_RECORD_SCHEMA_ID = "trust-ladder.controls-record.v1"
CRITERIA_SCHEMA_ID = "trust-ladder.e2-controls-criteria.v1"
RECEIPT_PREFIX = "receipt://"
NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
"""A criteria, document, yardstick or lane name (what the criteria schema admits)."""

GATE_RULES = frozenset({"wilson-upper-plus-points"})
"""Gate rules this module computes (:func:`cell_gate`)."""
EXCEEDANCE_WORDS = "a cell whose lane disagreement (disagreeing rows / L) is strictly greater than its gate"
"""The only exceedance definition this module implements (:func:`exceeds_gate`)."""
DOCUMENT_WITHIN_WORDS = "a document is within the E1 gates when none of its four cells exceeds"
"""The only document-within definition this module implements (it presumes four lengths)."""


@dataclass(frozen=True)
class LengthEffectRule:
    """A preregistered length-effect criterion: supported when every control document exceeds at
    each of ``exceeds_at`` and stays within at each of ``within_at``; rejected otherwise."""

    exceeds_at: tuple[int, ...]
    within_at: tuple[int, ...]


LENGTH_EFFECT_RULES: Mapping[str, LengthEffectRule] = {
    "every control document exceeds its gate at 2048 and at 4096 and stays within it at 512":
        LengthEffectRule(exceeds_at=(2048, 4096), within_at=(512,)),
}
"""Each length-effect wording this module evaluates, and what it means, word for word."""

LengthEffect = Literal["supported", "rejected"]


@dataclass(frozen=True)
class CellJudgement:
    """One (document, L) cell: the yardstick's count and gate, the lane's count and rate."""

    length: int
    rows: int
    yardstick_disagreeing: int
    yardstick_upper: float
    """Upper end of the two-sided Wilson interval of yardstick_disagreeing / rows."""
    gate: float
    """``yardstick_upper + points``, in float64: the number the lane's rate is compared with."""
    lane_disagreeing: int
    exceeds: bool
    """lane_disagreeing / rows > gate, compared exactly."""

    @property
    def lane_rate(self) -> float:
        return self.lane_disagreeing / self.rows


@dataclass(frozen=True)
class ProfileWindow:
    """Disagreeing rows of one profile window [start, stop) of a document's single pass."""

    start: int
    stop: int
    lane_disagreeing: int
    yardstick_disagreeing: int


@dataclass(frozen=True)
class DocumentJudgement:
    """One control document: its cells in length order, its profile, and where it exceeds."""

    document: str
    token_sha256: str
    rows: int
    cells: tuple[CellJudgement, ...]
    profile: tuple[ProfileWindow, ...]
    top_tokens_sha256: Mapping[str, str]

    @property
    def exceeding_lengths(self) -> tuple[int, ...]:
        return tuple(cell.length for cell in self.cells if cell.exceeds)

    @property
    def within_lengths(self) -> tuple[int, ...]:
        return tuple(cell.length for cell in self.cells if not cell.exceeds)

    @property
    def within(self) -> bool:
        return not self.exceeding_lengths


@dataclass(frozen=True)
class ControlsJudgement:
    """A lane's E2 controls judged against the criteria; with any problem, no table and no outcome."""

    criteria: str
    criteria_sha256: str
    lane: str
    yardstick: str
    source: str
    confidence: float | None
    points: float | None
    """The gate rule's confidence and points (None when the criteria could not be read)."""
    documents: tuple[DocumentJudgement, ...]
    length_effect: LengthEffect | None
    """The preregistered length-effect criterion: supported, rejected, or None when not judged."""
    outcome: ControlsOutcome | None
    problems: tuple[str, ...]

    def document(self) -> dict[str, Any]:
        """The judgement as JSON (what a receipt carries: every cell and profile window)."""
        return {
            "criteria": {"name": self.criteria, "sha256": self.criteria_sha256},
            "lane": self.lane,
            "yardstick": self.yardstick,
            "source": self.source,
            "gate": {"confidence": self.confidence, "points": self.points},
            "length_effect": self.length_effect,
            "problems": list(self.problems),
            "documents": [{
                "document": document.document,
                "token_sha256": document.token_sha256,
                "rows": document.rows,
                "within": document.within,
                "within_lengths": list(document.within_lengths),
                "exceeding_lengths": list(document.exceeding_lengths),
                "cells": [{"length": cell.length, "rows": cell.rows,
                           "yardstick_disagreeing": cell.yardstick_disagreeing,
                           "yardstick_upper": cell.yardstick_upper, "gate": cell.gate,
                           "lane_disagreeing": cell.lane_disagreeing, "lane_rate": cell.lane_rate,
                           "exceeds": cell.exceeds} for cell in document.cells],
                "profile": [{"start": window.start, "stop": window.stop,
                             "lane_disagreeing": window.lane_disagreeing,
                             "yardstick_disagreeing": window.yardstick_disagreeing} for window in document.profile],
                "top_tokens_sha256": dict(document.top_tokens_sha256),
            } for document in self.documents],
        }


def cell_gate(yardstick_disagreeing: int, rows: int, *, confidence: float, points: float) -> tuple[float, float]:
    """(Wilson upper bound, gate) of one cell under rule ``wilson-upper-plus-points``: the upper end
    of the two-sided ``confidence`` Wilson interval of the yardstick's rate, and it plus ``points``."""
    upper = wilson_interval(yardstick_disagreeing, rows, confidence=confidence)[1]
    return upper, upper + points


def exceeds_gate(disagreeing: int, rows: int, gate: float) -> bool:
    """Whether disagreeing / rows is strictly greater than ``gate``, compared as exact rationals
    (a rate exactly at the gate is within; one ULP over exceeds)."""
    return Fraction(disagreeing, rows) > Fraction(gate)


# --- reading the criteria and the record, collecting every defect --------------------------------


def _is_count(value: object) -> TypeGuard[int]:
    # A bool is an int in Python but not a count in a record.
    return type(value) is int


def _is_number(value: object) -> TypeGuard[float]:
    return (type(value) is int or type(value) is float) and math.isfinite(value)


def _mapping(value: object) -> Mapping[str, Any]:
    """``value`` when it is a mapping, else an empty one (its fields then read as missing)."""
    return value if isinstance(value, Mapping) else {}


def _fields(value: object, where: str, expected: Sequence[str], problems: list[str]) -> Mapping[str, Any] | None:
    """``value`` as a mapping with exactly ``expected`` keys; each missing or extra key is a problem.
    None (and a problem) when it is not a mapping; the mapping even when keys are off, so the
    fields present are still checked and every defect is named."""
    if not isinstance(value, Mapping):
        problems.append(f"{where}: found {render(value)}, expected an object with {', '.join(expected)}")
        return None
    for key in expected:
        if key not in value:
            problems.append(f"{where}.{key}: missing, expected this field")
    for key in value:
        if key not in expected:
            problems.append(f"{where}.{render(key)}: found an unexpected field, expected only {', '.join(expected)}")
    return value


def _list(value: object, where: str, problems: list[str]) -> Sequence[Any]:
    if isinstance(value, (list, tuple)):
        return value
    problems.append(f"{where}: found {render(value)}, expected a list")
    return ()


def _name(value: object, where: str, problems: list[str]) -> str | None:
    if isinstance(value, str) and NAME.fullmatch(value):
        return value
    problems.append(f"{where}: found {render(value)}, expected a name ({NAME.pattern})")
    return None


@dataclass(frozen=True)
class _Criteria:
    """What judging reads from the criteria document, checked."""

    name: str
    sha256: str
    documents: tuple[tuple[str, str], ...]  # (name, token_sha256), in the criteria's order
    lengths: tuple[int, ...]
    profile_window: int
    yardstick: str
    yardstick_sha256: str
    confidence: float
    points: float
    lanes: tuple[str, ...]
    length_effect: LengthEffectRule


def _read_criteria(criteria: object, problems: list[str]) -> _Criteria | None:
    """The checked criteria, or None with each defect in ``problems``."""
    before = len(problems)
    if not isinstance(criteria, Mapping):
        problems.append(f"criteria: found {render(criteria)}, expected the parsed criteria document")
        return None
    if criteria.get("schema") != CRITERIA_SCHEMA_ID:
        problems.append(f"criteria.schema: found {render(criteria.get('schema'))}, expected {CRITERIA_SCHEMA_ID}")
    try:
        sha256 = jcs_sha256(dict(criteria))
    except (TypeError, ValueError):
        problems.append("criteria: has no RFC 8785 form, expected a JSON document")
        sha256 = ""
    name = _name(criteria.get("name"), "criteria.name", problems)
    documents: list[tuple[str, str]] = []
    for index, entry in enumerate(_list(criteria.get("documents"), "criteria.documents", problems)):
        where = f"criteria.documents[{index}]"
        entry_name = _name(entry.get("name") if isinstance(entry, Mapping) else None, f"{where}.name", problems)
        token = entry.get("token_sha256") if isinstance(entry, Mapping) else None
        if not is_sha256_hex(token):
            problems.append(f"{where}.token_sha256: found {render(token)}, expected a SHA-256 (64 lowercase hex)")
        if entry_name is not None and is_sha256_hex(token):
            if entry_name in (known for known, _ in documents):
                problems.append(f"{where}.name: found {render(entry_name)} twice, expected each document once")
            documents.append((entry_name, str(token)))
    if not documents:
        problems.append("criteria.documents: found none, expected the control documents")
    # A value that is no list was named by _list; the rule below is about a list's entries.
    lengths = _list(criteria.get("lengths"), "criteria.lengths", problems)
    listed = isinstance(criteria.get("lengths"), (list, tuple))
    if listed and not lengths or not all(_is_count(length) and length > 0 for length in lengths) or \
            any(b <= a for a, b in zip(lengths, lengths[1:], strict=False)):
        problems.append(f"criteria.lengths: found {render(lengths)}, expected positive whole lengths, strictly increasing")
        lengths = ()
    window = criteria.get("profile_window")
    if not _is_count(window) or window < 1:
        problems.append(f"criteria.profile_window: found {render(window)}, expected a positive whole number of rows")
    elif any(length % window for length in lengths):
        problems.append(f"criteria.lengths: found {render(lengths)}, expected multiples of profile_window {window}")
    yardstick = _mapping(criteria.get("yardstick"))
    yardstick_name = _name(yardstick.get("name"), "criteria.yardstick.name", problems)
    if not is_sha256_hex(yardstick.get("sha256")):
        problems.append(f"criteria.yardstick.sha256: found {render(yardstick.get('sha256'))}, expected a SHA-256")
    gate = _mapping(criteria.get("gate"))
    if not isinstance(gate.get("rule"), str) or gate.get("rule") not in GATE_RULES:
        problems.append(f"criteria.gate.rule: found {render(gate.get('rule'))}, expected a rule this judge computes: "
                        f"{', '.join(sorted(GATE_RULES))}")
    confidence, points = gate.get("confidence"), gate.get("points")
    if not _is_number(confidence) or not 0 < confidence < 1:
        problems.append(f"criteria.gate.confidence: found {render(confidence)}, expected a number in (0, 1)")
    if not _is_number(points) or not 0 <= points < 1:
        problems.append(f"criteria.gate.points: found {render(points)}, expected a number in [0, 1)")
    if criteria.get("exceedance") != EXCEEDANCE_WORDS:
        problems.append(f"criteria.exceedance: found {render(criteria.get('exceedance'))}, expected the definition "
                        f"this judge implements: {EXCEEDANCE_WORDS!r}")
    words = _mapping(criteria.get("criteria"))
    supported_words = words.get("length_effect_supported")
    rule = LENGTH_EFFECT_RULES.get(supported_words) if isinstance(supported_words, str) else None
    if rule is None:
        problems.append(f"criteria.criteria.length_effect_supported: found {render(supported_words)}, "
                        f"expected a criterion this judge evaluates: {' | '.join(map(repr, LENGTH_EFFECT_RULES))}")
    elif lengths and not set(rule.exceeds_at + rule.within_at) <= set(lengths):
        problems.append(f"criteria.criteria.length_effect_supported: names lengths "
                        f"{render(sorted(set(rule.exceeds_at + rule.within_at)))}, not all in criteria.lengths "
                        f"{render(list(lengths))}")
    if words.get("document_within") != DOCUMENT_WITHIN_WORDS or (lengths and len(lengths) != 4):
        problems.append(f"criteria.criteria.document_within: found {render(words.get('document_within'))} over "
                        f"{len(lengths)} lengths, expected {DOCUMENT_WITHIN_WORDS!r} over four lengths")
    lanes = _list(criteria.get("lanes"), "criteria.lanes", problems)
    listed = isinstance(criteria.get("lanes"), (list, tuple))
    if listed and not lanes or not all(isinstance(lane, str) and NAME.fullmatch(lane) for lane in lanes):
        problems.append(f"criteria.lanes: found {render(lanes)}, expected the lane names the controls apply to")
    if len(problems) > before or name is None or yardstick_name is None or rule is None \
            or not _is_count(window) or not _is_number(confidence) or not _is_number(points):
        return None
    return _Criteria(name=name, sha256=sha256, documents=tuple(documents), lengths=tuple(lengths),
                     profile_window=window, yardstick=yardstick_name, yardstick_sha256=yardstick["sha256"],
                     confidence=float(confidence), points=float(points), lanes=tuple(lanes), length_effect=rule)


def _count(value: object, where: str, rows: int | None, problems: list[str]) -> int | None:
    """A whole count in 0..rows (bool and 4.0 are not counts)."""
    if not _is_count(value) or value < 0 or (rows is not None and value > rows):
        bound = "" if rows is None else f" in 0..{rows}"
        problems.append(f"{where}: found {render(value)}, expected a whole count{bound}")
        return None
    return value


CELL_FIELDS = ("length", "rows", "lane_disagreeing", "yardstick_disagreeing")
WINDOW_FIELDS = ("start", "stop", "lane_disagreeing", "yardstick_disagreeing")
DOCUMENT_FIELDS = ("document", "token_sha256", "rows", "cells", "profile", "top_tokens_sha256")
RECORD_FIELDS = ("schema", "criteria", "lane", "yardstick", "documents", "seconds")
TOP_TOKEN_FIELDS = ("reference", "lane", "yardstick")


def _read_cells(raw: object, where: str, rule: _Criteria, problems: list[str]) -> dict[int, tuple[int, int]]:
    """Length -> (lane, yardstick) disagreeing rows, each cell of the criteria exactly once."""
    cells: dict[int, tuple[int, int]] = {}
    present: set[int] = set()
    for index, cell in enumerate(_list(raw, where, problems)):
        at = f"{where}[{index}]"
        fields = _fields(cell, at, CELL_FIELDS, problems)
        if fields is None:
            continue
        length = fields.get("length")
        if not _is_count(length) or length not in rule.lengths:
            problems.append(f"{at}.length: found {render(length)}, expected one of the criteria's lengths "
                            f"{render(list(rule.lengths))}")
            continue
        if length in present:
            problems.append(f"{at}.length: found {length} twice, expected each length once")
            continue
        present.add(length)
        rows = fields.get("rows")
        if rows != length or not _is_count(rows):
            problems.append(f"{at}.rows: found {render(rows)}, expected L = {length}")
            continue
        lane = _count(fields.get("lane_disagreeing"), f"{at}.lane_disagreeing", length, problems)
        yardstick = _count(fields.get("yardstick_disagreeing"), f"{at}.yardstick_disagreeing", length, problems)
        if lane is not None and yardstick is not None:
            cells[length] = (lane, yardstick)
    for length in rule.lengths:
        if length not in present:
            problems.append(f"{where}: no cell of length {length}, expected one per criteria length")
    return cells


def _read_profile(raw: object, where: str, rows: int, rule: _Criteria, problems: list[str]) -> list[ProfileWindow]:
    """Windows [k·w, (k+1)·w) covering 0..rows in order, each count within its window."""
    windows: list[ProfileWindow] = []
    items = _list(raw, where, problems)
    expected = rows // rule.profile_window
    if isinstance(raw, (list, tuple)) and len(items) != expected:
        problems.append(f"{where}: found {len(items)} windows, expected {expected} of {rule.profile_window} rows")
    for index, window in enumerate(items):
        at = f"{where}[{index}]"
        fields = _fields(window, at, WINDOW_FIELDS, problems)
        if fields is None:
            continue
        start, stop = index * rule.profile_window, (index + 1) * rule.profile_window
        if fields.get("start") != start or not _is_count(fields.get("start")) or \
                fields.get("stop") != stop or not _is_count(fields.get("stop")):
            problems.append(f"{at}: found rows {render(fields.get('start'))}..{render(fields.get('stop'))}, "
                            f"expected {start}..{stop}")
            continue
        lane = _count(fields.get("lane_disagreeing"), f"{at}.lane_disagreeing", stop - start, problems)
        yardstick = _count(fields.get("yardstick_disagreeing"), f"{at}.yardstick_disagreeing", stop - start, problems)
        if lane is not None and yardstick is not None:
            windows.append(ProfileWindow(start, stop, lane, yardstick))
    return windows


def _read_document(raw: object, where: str, rule: _Criteria, token_sha256: str,
                   problems: list[str]) -> DocumentJudgement | None:
    before = len(problems)
    fields = _fields(raw, where, DOCUMENT_FIELDS, problems)
    if fields is None:
        return None
    name = str(fields.get("document"))
    if fields.get("token_sha256") != token_sha256:
        problems.append(f"{where}.token_sha256: found {render(fields.get('token_sha256'))}, the criteria's "
                        f"{name} is {token_sha256}")
    rows = fields.get("rows")
    longest = rule.lengths[-1]
    if rows != longest or not _is_count(rows):
        problems.append(f"{where}.rows: found {render(rows)}, expected the longest length {longest} (one pass)")
    cells = _read_cells(fields.get("cells"), f"{where}.cells", rule, problems)
    profile = _read_profile(fields.get("profile"), f"{where}.profile", longest, rule, problems)
    top = _fields(fields.get("top_tokens_sha256"), f"{where}.top_tokens_sha256", TOP_TOKEN_FIELDS, problems)
    for key in TOP_TOKEN_FIELDS:
        if top is not None and key in top and not is_sha256_hex(top[key]):
            problems.append(f"{where}.top_tokens_sha256.{key}: found {render(top[key])}, expected a SHA-256")
    if len(problems) > before or top is None:
        return None
    # The cells are prefixes of one pass, so each must be the sum of the profile windows below it.
    for length, (lane, yardstick) in cells.items():
        below = [window for window in profile if window.stop <= length]
        summed = (sum(w.lane_disagreeing for w in below), sum(w.yardstick_disagreeing for w in below))
        if summed != (lane, yardstick):
            problems.append(f"{where}.cells: length {length} counts (lane {lane}, yardstick {yardstick}) differ from "
                            f"the profile's sums over rows 0..{length} (lane {summed[0]}, yardstick {summed[1]})")
    if len(problems) > before:
        return None
    judged = []
    for length in rule.lengths:
        lane, yardstick = cells[length]
        upper, gate = cell_gate(yardstick, length, confidence=rule.confidence, points=rule.points)
        judged.append(CellJudgement(length=length, rows=length, yardstick_disagreeing=yardstick, yardstick_upper=upper,
                                    gate=gate, lane_disagreeing=lane, exceeds=exceeds_gate(lane, length, gate)))
    return DocumentJudgement(document=name, token_sha256=token_sha256, rows=longest, cells=tuple(judged),
                             profile=tuple(profile), top_tokens_sha256={key: str(top[key]) for key in TOP_TOKEN_FIELDS})


def _present(record: Mapping[str, Any], key: str, expected: Sequence[str], problems: list[str]) -> Mapping[str, Any]:
    """The record's object ``key`` with its fields checked, or an empty mapping when it is absent."""
    if key not in record:
        return {}
    return _fields(record[key], f"record.{key}", expected, problems) or {}


def _check_header(record: Mapping[str, Any], rule: _Criteria, lane: str | None, problems: list[str]) -> None:
    """Schema, the criteria digest, the lane, the yardstick and the timings."""
    if record.get("schema") != CONTROLS_RECORD_SCHEMA_ID:
        problems.append(f"record.schema: found {render(record.get('schema'))}, expected {CONTROLS_RECORD_SCHEMA_ID}")
    # A field missing from the record is already a problem (``_fields`` over the record); only
    # the fields present are checked further, so each defect is named once.
    named = _present(record, "criteria", ("name", "sha256"), problems)
    if "name" in named and named["name"] != rule.name:
        problems.append(f"record.criteria.name: found {render(named['name'])}, expected {rule.name}")
    if "sha256" in named and named["sha256"] != rule.sha256:
        problems.append(f"record.criteria.sha256: found {render(named['sha256'])}, expected the criteria's {rule.sha256}")
    found_lane = record.get("lane")
    if "lane" in record and found_lane not in rule.lanes:
        problems.append(f"record.lane: found {render(found_lane)}, expected one of the criteria's lanes "
                        f"{', '.join(rule.lanes)}")
    elif "lane" in record and lane is not None and found_lane != lane:  # a missing lane is already named
        problems.append(f"record.lane: found {render(found_lane)}, expected the lane judged, {lane}")
    yardstick = _present(record, "yardstick", ("name", "sha256"), problems)
    if "name" in yardstick and yardstick["name"] != rule.yardstick:
        problems.append(f"record.yardstick.name: found {render(yardstick['name'])}, expected {rule.yardstick}")
    if "sha256" in yardstick and yardstick["sha256"] != rule.yardstick_sha256:
        problems.append(f"record.yardstick.sha256: found {render(yardstick['sha256'])}, expected the criteria's "
                        f"{rule.yardstick_sha256}")
    seconds = _present(record, "seconds", ("prefill", "scoring"), problems)
    for key in ("prefill", "scoring"):
        if key in seconds and (not _is_number(seconds[key]) or seconds[key] < 0):
            problems.append(f"record.seconds.{key}: found {render(seconds[key])}, expected a finite number >= 0")


def _length_effect(documents: Sequence[DocumentJudgement], rule: LengthEffectRule) -> LengthEffect:
    """The criterion word for word: every document exceeds at each ``exceeds_at`` and is within at
    each ``within_at``."""
    supported = all(
        all(cell.exceeds for cell in document.cells if cell.length in rule.exceeds_at)
        and not any(cell.exceeds for cell in document.cells if cell.length in rule.within_at)
        for document in documents)
    return "supported" if supported else "rejected"


def _refused(problems: list[str], source: str, rule: _Criteria | None, record: object) -> ControlsJudgement:
    lane = record.get("lane") if isinstance(record, Mapping) else None
    return ControlsJudgement(
        criteria=rule.name if rule else "", criteria_sha256=rule.sha256 if rule else "",
        lane=lane if isinstance(lane, str) else "", yardstick=rule.yardstick if rule else "", source=source,
        confidence=rule.confidence if rule else None, points=rule.points if rule else None,
        documents=(), length_effect=None, outcome=None, problems=tuple(problems))


def judge_controls(record: Mapping[str, Any], criteria: Mapping[str, Any], *, source: str,
                   lane: str | None = None) -> ControlsJudgement:
    """Judge a controls record (``trust-ladder.controls-record.v1``) against the parsed criteria
    document it names; ``source`` is the receipt it was measured in (``receipt://...``); ``lane``,
    when given, is the lane being judged (the record must name it).

    Any defect gives ``problems`` and no table and no outcome; otherwise every cell's gate and
    exceedance, each document's within/exceeding lengths, the length-effect criterion and the
    :class:`ControlsOutcome` a verdict's scope states.
    """
    problems: list[str] = []
    if not isinstance(source, str) or not source.startswith(RECEIPT_PREFIX) or len(source) <= len(RECEIPT_PREFIX) \
            or not source.isprintable() or any(character.isspace() for character in source):
        problems.append(f"source: found {render(source)}, expected the measuring receipt ({RECEIPT_PREFIX}...)")
    rule = _read_criteria(criteria, problems)
    if rule is None:
        return _refused(problems, str(source), None, record)
    if not isinstance(record, Mapping):
        problems.append(f"record: found {render(record)}, expected a {CONTROLS_RECORD_SCHEMA_ID} object")
        return _refused(problems, str(source), rule, record)
    _fields(record, "record", RECORD_FIELDS, problems)
    _check_header(record, rule, lane, problems)
    expected = dict(rule.documents)
    judged: dict[str, DocumentJudgement] = {}
    seen: set[str] = set()
    for index, raw in enumerate(_list(record["documents"], "record.documents", problems) if "documents" in record else ()):
        where = f"record.documents[{index}]"
        name = raw.get("document") if isinstance(raw, Mapping) else None
        if not isinstance(name, str) or name not in expected:
            problems.append(f"{where}.document: found {render(name)}, expected one of the criteria's documents "
                            f"{', '.join(expected)}")
            continue
        if name in seen:
            problems.append(f"{where}.document: found {name} twice, expected each document once")
            continue
        seen.add(name)
        document = _read_document(raw, where, rule, expected[name], problems)
        if document is not None:
            judged[name] = document
    for name in expected:
        if "documents" in record and name not in seen:
            problems.append(f"record.documents: no document {name}, expected every control document of {rule.name}")
    if problems:
        return _refused(problems, str(source), rule, record)
    documents = tuple(judged[name] for name, _ in rule.documents)
    try:
        outcome = ControlsOutcome(
            criteria=rule.name, lengths=rule.lengths, source=source,
            documents=tuple(DocumentOutcome(document.document, document.exceeding_lengths) for document in documents))
    except ValueError as exc:  # the scope's own rules, should they ever be stricter than the checks above
        return _refused([one_line(str(exc))], source, rule, record)
    return ControlsJudgement(
        criteria=rule.name, criteria_sha256=rule.sha256, lane=str(record["lane"]), yardstick=rule.yardstick,
        source=source, confidence=rule.confidence, points=rule.points, documents=documents,
        length_effect=_length_effect(documents, rule.length_effect), outcome=outcome, problems=())


__all__ = [
    "CONTROLS_RECORD_SCHEMA_ID", "DOCUMENT_WITHIN_WORDS", "EXCEEDANCE_WORDS", "GATE_RULES", "LENGTH_EFFECT_RULES",
    "CellJudgement", "ControlsJudgement", "DocumentJudgement", "LengthEffect", "LengthEffectRule", "ProfileWindow",
    "cell_gate", "exceeds_gate", "judge_controls",
]

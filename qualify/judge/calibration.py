"""A calibration judged, and the numbers it seals derived by stated rules.

A calibration measures a lane on its calibration set (documents and lengths kept apart from the
qualification fixture and the controls), each handoff under a freshly started producer, then
hands off the fixture itself as the anchor whose deterministic digests later qualifications must
reproduce bit for bit (seed 000 §32.7, the G3 recheck). The bounds come from the calibration cells
only, by :data:`BOUND_RULE`; the rung-3 draft floor from the anchor's counts, by
:data:`FLOOR_RULE`. The same functions propose them at calibration, check them at freeze and
re-derive them at every load, so a sealed number that does not follow from its basis is refused.

Pure: sample records and the calibration evidence (``evidence/calibration.json``) in, numbers
and verdicts out.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from qualify.contract.rules import (
    BOUND_RULE,
    BOUND_RULE_STATEMENT,
    FIXTURE_ENVELOPE_RULE,
    FIXTURE_ENVELOPE_RULE_STATEMENT,
    FLOOR_RULE,
    FLOOR_RULE_STATEMENT,
    TEACHER_FORCED_BOUND_RULE,
)
from qualify.core.errors import Refused, one_line
from qualify.core.stats import wilson_interval
from qualify.evidence.records import BoundedDriftRule
from qualify.judge.envelope import FixtureEnvelope, HandoffSeries, derive_fixture_envelope
from qualify.judge.handoffs import (
    Check,
    Record,
    TeacherForcedRows,
    Verdict,
    _finite,
    _Judgement,
    _plain,
    judge_reproduction,
    judge_teacher_forced_rows,
    teacher_forced_rows,
)

CALIBRATION_EVIDENCE = "calibration"
"""The receipt evidence name of a calibration's cell map (``evidence/calibration.json``)."""
CALIBRATION_EVIDENCE_SCHEMA = "trust-ladder.calibration-evidence.v1"

ZERO_DRIFT_BOUND = 5e-324
"""The least positive double: the bound of a lane that showed no drift in any calibration cell.
Deltas are non-negative, so only a zero delta meets it: the bit-exact rule, written in the
positive-bound form a bounded-drift recipe's schema requires (never a margin chosen by taste)."""

CALIBRATION_PART = "calibration"
ANCHOR_PART = "anchor"
ENVELOPE_PART = "envelope"
"""A fixture handoff of a producer declared non-deterministic: its series state the fixture
envelope (:mod:`qualify.judge.envelope`); it retains no digest to recheck (there is no anchor)."""


@dataclass(frozen=True)
class CellDrift:
    """One calibration cell's handoff: which document and length, and its drift. ``rows`` are
    its teacher-forced rows (:func:`~qualify.judge.handoffs.teacher_forced_rows`), None in a
    receipt from before the teacher-forced rule, or when they cannot be read."""

    repetition: int
    document: str
    prompt_tokens: int
    max_abs: float
    mean_abs: float
    tokens_exact: bool
    rows: TeacherForcedRows | None = None
    output_tokens: int | None = None

    @property
    def teacher_forced_values(self) -> tuple[float, float, float, float] | None:
        """The four values :data:`TEACHER_FORCED_BOUND_RULE` reads: largest row max, largest row
        mean, largest cold margin at a parting (0 with none), share of parted rows."""
        if self.rows is None or self.output_tokens is None:
            return None
        rows = self.rows
        return (rows.max_abs, rows.max_row_mean_abs, max((cold for _, cold in rows.partings), default=0.0),
                len(rows.partings) / self.output_tokens)


@dataclass(frozen=True)
class TeacherForcedBounds:
    """The numbers :data:`TEACHER_FORCED_BOUND_RULE` derives from the cells: what a teacher-forced
    identity seals (its ``full_logits``)."""

    maximum_absolute: float
    maximum_mean_absolute: float
    near_tie_margin: float
    maximum_changed_row_share: float

    def rule(self) -> BoundedDriftRule:
        """The clauses these numbers make, for :func:`~qualify.judge.handoffs.judge_teacher_forced_rows`
        (which reads a sample's own token count; the repetitions are a qualification's)."""
        return BoundedDriftRule(maximum_absolute=self.maximum_absolute,
                                maximum_mean_absolute=self.maximum_mean_absolute,
                                near_tie_margin=self.near_tie_margin,
                                maximum_changed_row_share=self.maximum_changed_row_share)


@dataclass(frozen=True)
class DerivedBounds:
    """The bounds :data:`BOUND_RULE` derives from the cells, and the spread it added."""

    maximum_absolute: float
    maximum_mean_absolute: float
    max_abs_spread: float
    mean_abs_spread: float
    cells: tuple[CellDrift, ...]


def _handoffs(evidence: Mapping[str, Any], problems: list[str]) -> list[Mapping[str, Any]]:
    handoffs = evidence.get("handoffs") if isinstance(evidence, Mapping) else None
    if not isinstance(handoffs, list) or not handoffs or not all(isinstance(h, Mapping) for h in handoffs):
        problems.append("calibration evidence: handoffs missing or not a list of objects")
        return []
    return list(handoffs)


def _records_by_repetition(records: Sequence[Record]) -> dict[int, Mapping[str, Any]]:
    by_repetition: dict[int, Mapping[str, Any]] = {}
    for record in (_plain(r) for r in records):
        if isinstance(record, Mapping) and type(record.get("repetition")) is int:
            by_repetition[record["repetition"]] = record
    return by_repetition


def _cell_drift(record: Mapping[str, Any]) -> tuple[float, float] | None:
    """The handoff's teacher-forced max and mean abs deltas: the localisation's teacher-forced
    figures when tokens diverged (the free-running rows then score different contexts), else the
    sample's own (equal, since the same tokens were fed)."""
    localisation = record.get("localisation")
    teacher = localisation.get("teacher_forced") if isinstance(localisation, Mapping) else None
    if isinstance(teacher, Mapping):
        maximum, mean = _finite(teacher.get("max_abs")), _finite(teacher.get("mean_abs"))
    elif _finite(record.get("token_agreement_rate")) == 1.0:
        maximum, mean = _finite(record.get("max_abs")), _finite(record.get("mean_abs"))
    else:
        return None
    if maximum is None or mean is None or maximum < 0 or mean < 0:
        return None
    return float(maximum), float(mean)


def calibration_cells(evidence: Mapping[str, Any], records: Sequence[Record]) -> tuple[list[CellDrift], list[str]]:
    """The calibration cells (never the anchor) with their drift, and every problem that keeps a
    cell from counting (a missing or failed sample, an unreadable drift)."""
    problems: list[str] = []
    by_repetition = _records_by_repetition(records)
    cells: list[CellDrift] = []
    for handoff in _handoffs(evidence, problems):
        if handoff.get("part") != CALIBRATION_PART:
            continue
        repetition, document, tokens = handoff.get("repetition"), handoff.get("document"), handoff.get("prompt_tokens")
        if type(repetition) is not int or not isinstance(document, str) or type(tokens) is not int:
            problems.append(f"calibration evidence: a handoff entry is malformed: {one_line(repr(dict(handoff)))[:120]}")
            continue
        record = by_repetition.get(repetition)
        if record is None:
            problems.append(f"cell {document}@{tokens}: sample {repetition} missing")
            continue
        if record.get("error"):
            problems.append(f"cell {document}@{tokens}: handoff failed: {one_line(str(record['error']))}")
            continue
        drift = _cell_drift(record)
        if drift is None:
            problems.append(
                f"cell {document}@{tokens}: sample {repetition} has no teacher-forced drift that is a finite number >= 0")
            continue
        rows = teacher_forced_rows(record)
        output_tokens = record.get("output_tokens")
        cells.append(CellDrift(repetition, document, tokens, drift[0], drift[1],
                               _finite(record.get("token_agreement_rate")) == 1.0,
                               None if isinstance(rows, str) else rows,
                               output_tokens if type(output_tokens) is int and output_tokens > 0 else None))
    return cells, problems


def bound_of(values: Sequence[float]) -> tuple[float, float]:
    """(bound, spread) of :data:`BOUND_RULE`'s policy over per-cell values (at least two): the
    largest value plus one sample standard deviation, or :data:`ZERO_DRIFT_BOUND` when every value
    is zero. The one implementation of the policy: lanes and served pairs
    (:mod:`qualify.judge.served_calibration`) both derive their bounds here."""
    largest = max(values)
    if largest == 0.0:
        return ZERO_DRIFT_BOUND, 0.0
    spread = statistics.stdev(values)  # exact rational arithmetic inside: the same float everywhere
    return largest + spread, spread


def derive_bounds(cells: Sequence[CellDrift]) -> DerivedBounds | None:
    """The bounds :data:`BOUND_RULE` gives for ``cells``; None with fewer than two (no spread)."""
    if len(cells) < 2:
        return None
    maximum, max_spread = bound_of([cell.max_abs for cell in cells])
    mean, mean_spread = bound_of([cell.mean_abs for cell in cells])
    return DerivedBounds(maximum, mean, max_spread, mean_spread, tuple(cells))


def derive_teacher_forced_bounds(cells: Sequence[CellDrift]) -> TeacherForcedBounds | None:
    """The numbers :data:`TEACHER_FORCED_BOUND_RULE` gives for ``cells``; None with fewer than two
    cells or with a cell whose teacher-forced rows were not recorded."""
    values = [cell.teacher_forced_values for cell in cells]
    if len(cells) < 2 or any(value is None for value in values):
        return None
    maximum, mean, margin, share = (bound_of([value[index] for value in values if value is not None])[0]
                                    for index in range(4))
    return TeacherForcedBounds(maximum, mean, margin, min(share, 1.0))  # a share above 1 means nothing


def keeps_tokens(anchors: Sequence[Mapping[str, Any]]) -> bool:
    """The fixture's anchors kept the cold recompute's greedy tokens: the exact-token rule judges
    such a lane (a calibration cell that parted counts its teacher-forced drift); a lane whose
    fixture parts is judged teacher-forced."""
    return all(_finite(anchor.get("token_agreement_rate")) == 1.0 for anchor in anchors)


def anchor_records(evidence: Mapping[str, Any], records: Sequence[Record]) -> list[Mapping[str, Any]]:
    """The fixture's anchor samples: what a qualification must reproduce bit for bit."""
    problems: list[str] = []
    by_repetition = _records_by_repetition(records)
    wanted = [h.get("repetition") for h in _handoffs(evidence, problems) if h.get("part") == ANCHOR_PART]
    return [by_repetition[r] for r in wanted if type(r) is int and r in by_repetition]


def declares_envelope(evidence: Mapping[str, Any]) -> bool:
    """The calibration declared its producer non-deterministic: its fixture handoffs state a
    fixture envelope (``fixture_envelope`` in the evidence) instead of retaining an anchor."""
    return isinstance(evidence, Mapping) and evidence.get("fixture_envelope") is not None


def fixture_records(evidence: Mapping[str, Any], records: Sequence[Record]) -> list[Mapping[str, Any]]:
    """The fixture's handoffs of a calibration: its anchors, or for a producer declared
    non-deterministic its envelope handoffs (what decides whether the lane keeps tokens)."""
    part = ENVELOPE_PART if declares_envelope(evidence) else ANCHOR_PART
    problems: list[str] = []
    by_repetition = _records_by_repetition(records)
    wanted = [h.get("repetition") for h in _handoffs(evidence, problems) if h.get("part") == part]
    return [by_repetition[r] for r in wanted if type(r) is int and r in by_repetition]


def envelope_handoffs(evidence: Mapping[str, Any]) -> tuple[list[tuple[int, int]], list[str]]:
    """Each envelope handoff's (repetition, producer start) as the evidence records them, and
    every problem that keeps one from counting (a malformed entry, a declaration that differs
    from the entries)."""
    problems: list[str] = []
    declared = evidence.get("fixture_envelope") if isinstance(evidence, Mapping) else None
    if not isinstance(declared, Mapping):
        return [], ["calibration evidence: fixture_envelope missing or not an object"]
    found: list[tuple[int, int]] = []
    for handoff in _handoffs(evidence, problems):
        if handoff.get("part") != ENVELOPE_PART:
            continue
        repetition, start = handoff.get("repetition"), handoff.get("producer_start")
        if type(repetition) is not int or type(start) is not int or start < 1:
            problems.append(f"calibration evidence: an envelope handoff entry is malformed: "
                            f"{one_line(repr(dict(handoff)))[:120]}")
            continue
        found.append((repetition, start))
    starts = len({start for _, start in found})
    for name, count in (("handoffs", len(found)), ("producer_starts", starts)):
        if declared.get(name) != count:
            problems.append(f"calibration evidence: fixture_envelope.{name} {declared.get(name)!r}, its entries "
                            f"show {count}")
    rule = declared.get("rule")
    if not isinstance(rule, Mapping) or rule.get("name") != FIXTURE_ENVELOPE_RULE or \
            rule.get("statement") != FIXTURE_ENVELOPE_RULE_STATEMENT:
        problems.append(f"calibration evidence: fixture_envelope.rule: found {one_line(repr(rule))[:120]}, expected "
                        f"{FIXTURE_ENVELOPE_RULE} as stated")
    return found, problems


def producer_starts(evidence: Mapping[str, Any]) -> int:
    """How many producer starts a calibration's handoffs ran on: one per handoff, or as the
    entries' ``producer_start`` say where a fixture envelope's handoffs share a start."""
    problems: list[str] = []
    handoffs = _handoffs(evidence, problems)
    starts = [h.get("producer_start") for h in handoffs]
    if declares_envelope(evidence) and all(type(start) is int for start in starts):
        return len(set(starts))
    return len(handoffs)


def anchor_draft_counts(evidence: Mapping[str, Any]) -> tuple[int, int] | None:
    """(proposed, accepted) of the first anchor handoff; None when it recorded no draft."""
    problems: list[str] = []
    for handoff in _handoffs(evidence, problems):
        if handoff.get("part") != ANCHOR_PART:
            continue
        draft = handoff.get("draft")
        if not isinstance(draft, Mapping):
            return None
        proposed, accepted = draft.get("proposed"), draft.get("accepted")
        if type(proposed) is not int or type(accepted) is not int or not 0 <= accepted <= proposed or proposed < 1:
            return None
        return proposed, accepted
    return None


def derive_acceptance_floor(proposed: int, accepted: int) -> float:
    """:data:`FLOOR_RULE`: the one-sided 95 % Wilson lower bound of ``accepted / proposed``."""
    return wilson_interval(accepted, proposed, sides=1)[0]  # at the default confidence, 0.95


def _rule_problem(evidence: Mapping[str, Any]) -> str | None:
    """Why the evidence does not state :data:`BOUND_RULE` as written (None: it does)."""
    rule = evidence.get("rule") if isinstance(evidence, Mapping) else None
    if not isinstance(rule, Mapping) or rule.get("name") != BOUND_RULE or rule.get("statement") != BOUND_RULE_STATEMENT:
        return f"calibration evidence: rule: found {one_line(repr(rule))[:120]}, expected {BOUND_RULE} as stated"
    return None


def _check_rule_stated(judgement: _Judgement, evidence: Mapping[str, Any]) -> None:
    """The "rule stated" check of a calibration: its evidence names :data:`BOUND_RULE` as written."""
    problem = _rule_problem(evidence)
    judgement.check("rule stated", problem is None, problem or f"rule {BOUND_RULE}")


def bound_problems(evidence: Mapping[str, Any], records: Sequence[Record], *,
                   maximum_absolute: float | None, maximum_mean_absolute: float | None,
                   acceptance_floor: float | None, teacher_forced: TeacherForcedBounds | None = None) -> list[str]:
    """Why sealed numbers do not follow from their basis by the stated rules (empty: they do).
    ``maximum_*`` None is a rung-3 rule (bit-exact: every cell must show zero drift);
    ``acceptance_floor`` None declares no draft; ``teacher_forced`` is a teacher-forced identity's
    four numbers (then ``maximum_*`` are ignored: they are two of the four)."""
    problem = _rule_problem(evidence)
    problems = [] if problem is None else [problem]
    cells, cell_problems = calibration_cells(evidence, records)
    problems += cell_problems
    derived = derive_bounds(cells)
    if teacher_forced is not None:
        forced = derive_teacher_forced_bounds(cells)
        if forced is None:
            problems.append(f"calibration set: {len(cells)} cells with teacher-forced rows recorded, "
                            f"rule {TEACHER_FORCED_BOUND_RULE} needs at least 2 and every cell's rows")
        else:
            for name in ("maximum_absolute", "maximum_mean_absolute", "near_tie_margin", "maximum_changed_row_share"):
                sealed, given = getattr(teacher_forced, name), getattr(forced, name)
                if sealed != given:
                    problems.append(f"{name}: sealed {sealed!r}, the basis gives {given!r} by rule "
                                    f"{TEACHER_FORCED_BOUND_RULE}")
    elif derived is None:
        problems.append(f"calibration set: {len(cells)} measured cells, the rule needs at least 2")
    elif maximum_absolute is None or maximum_mean_absolute is None:
        drifting = [f"{c.document}@{c.prompt_tokens}" for c in cells if c.max_abs != 0.0 or c.mean_abs != 0.0]
        if drifting:
            problems.append(f"rung 3 is bit-exact but calibration cells drifted: {', '.join(drifting)}")
    else:
        for name, sealed, follows in (("maximum_absolute", maximum_absolute, derived.maximum_absolute),
                                      ("maximum_mean_absolute", maximum_mean_absolute, derived.maximum_mean_absolute)):
            if sealed != follows:
                problems.append(f"{name}: sealed {sealed!r}, the basis gives {follows!r} by rule {BOUND_RULE}")
    if acceptance_floor is not None:
        counts = anchor_draft_counts(evidence)
        if counts is None:
            problems.append("acceptance floor: the basis anchor recorded no draft counts")
        elif acceptance_floor != (follows_floor := derive_acceptance_floor(*counts)):
            problems.append(f"acceptance floor: sealed {acceptance_floor!r}, the basis gives {follows_floor!r} "
                            f"({counts[1]}/{counts[0]} accepted) by rule {FLOOR_RULE}")
    return problems


@dataclass(frozen=True)
class CalibrationJudgement:
    """A calibration's cells, the bounds and floor its rules derive (never applied by
    themselves), and its verdict. ``failures`` are the failed handoffs' errors."""

    cells: tuple[CellDrift, ...]
    bounds: DerivedBounds | None
    anchor_tokens_exact: bool
    deterministic: bool
    acceptance_floor: float | None
    failures: list[str]
    verdict: Verdict
    teacher_forced: TeacherForcedBounds | None = None
    # The fixture envelope its envelope handoffs state (a producer declared non-deterministic).
    envelope: FixtureEnvelope | None = None

    @property
    def proposed_maximum_absolute(self) -> float | None:
        return None if self.bounds is None else self.bounds.maximum_absolute

    @property
    def proposed_maximum_mean_absolute(self) -> float | None:
        return None if self.bounds is None else self.bounds.maximum_mean_absolute


def judge_calibration(records: Sequence[Record], evidence: Mapping[str, Any], *, lane: str, rung: int,
                      draft: bool, restarts_minimum: int,
                      envelope_series: Mapping[int, HandoffSeries] | None = None) -> CalibrationJudgement:
    """Judge a calibration of ``lane``. It passes when every handoff succeeded, at least
    ``restarts_minimum`` producer restarts happened (every handoff after the first restarts it),
    every calibration cell's drift is finite (and zero, on rung 3), the anchors' greedy tokens
    are exact, and the anchors' deterministic digests agree across their restarts and
    environments (:func:`judge_reproduction` with the anchors as each other's basis).

    A calibration that declares its producer non-deterministic (:func:`declares_envelope`) has
    no anchor: its fixture handoffs' series (``envelope_series``, by repetition) must state a
    fixture envelope (:func:`~qualify.judge.envelope.derive_fixture_envelope`) over the producer
    starts its evidence records, and no digest has to agree across them."""
    if declares_envelope(evidence):
        return _judge_envelope_calibration(records, evidence, lane=lane, rung=rung, draft=draft,
                                           restarts_minimum=restarts_minimum, series=envelope_series or {})
    judgement = _Judgement()
    failures = _check_handoffs(judgement, records)
    problems: list[str] = []
    handoffs = _handoffs(evidence, problems)
    restarts = max(len(handoffs) - 1, 0)
    judgement.check("producer restarts", restarts >= restarts_minimum,
                    f"{restarts} producer restarts (at least {restarts_minimum})")
    _check_rule_stated(judgement, evidence)
    cells, bounds = _check_cells(judgement, evidence, records)
    if rung == 3 and cells:
        drifting = [f"{c.document}@{c.prompt_tokens}" for c in cells if c.max_abs != 0.0 or c.mean_abs != 0.0]
        judgement.check("bit-exact cells", not drifting, "every cell bit-exact" if not drifting
                        else f"rung 3 needs bit-exact handoffs; drifted: {', '.join(drifting)}")
    anchors = anchor_records(evidence, records)
    anchor_ok = [r for r in anchors if not r.get("error")]
    anchor_tokens_exact = bool(anchor_ok) and all(_finite(r.get("token_agreement_rate")) == 1.0 for r in anchor_ok)
    teacher_forced = None
    if rung == 2 and anchor_ok and not keeps_tokens(anchor_ok):
        teacher_forced = _teacher_forced_rule(judgement, cells)
    else:
        judgement.check("anchor tokens exact", anchor_tokens_exact,
                        "the fixture's greedy tokens exact in every anchor handoff" if anchor_tokens_exact
                        else "the fixture's greedy tokens diverged in an anchor handoff: no rule can qualify this lane on it")
    determinism = judge_reproduction(anchor_ok, anchor_ok, rung=rung, deterministic_producer=True, draft=draft)
    deterministic = determinism.passed and len(anchor_ok) >= 2
    judgement.check("anchor reproduced", deterministic,
                    f"every deterministic digest equal across {len(anchor_ok)} anchor handoffs" if deterministic
                    else "the anchors differ (or fewer than 2): "
                    + ("; ".join(c.detail for c in determinism.checks if not c.passed) or f"{len(anchor_ok)} anchors"))
    counts = anchor_draft_counts(evidence) if draft else None
    floor = derive_acceptance_floor(*counts) if counts is not None else None
    if draft:
        judgement.check("draft counts", counts is not None,
                        f"anchor draft acceptance {counts[1]}/{counts[0]}" if counts is not None
                        else "the anchor recorded no draft counts")
    anchor_drift = [d for d in (_cell_drift(r) for r in anchor_ok) if d is not None]
    fixture_note = ""
    if bounds is not None and anchor_drift:
        fixture_max = max(d[0] for d in anchor_drift)
        fixture_mean = max(d[1] for d in anchor_drift)
        within = fixture_max <= bounds.maximum_absolute and fixture_mean <= bounds.maximum_mean_absolute
        fixture_note = (f"; the fixture's own drift (max {fixture_max!r}, mean {fixture_mean!r}) is "
                        f"{'within' if within else 'OUTSIDE'} the derived bounds")
    gives = _rule_gives(bounds, teacher_forced)
    if teacher_forced is not None:
        fixture_note = _anchors_under(anchor_ok, teacher_forced, "anchor")
    headline = (f"calibration of {lane}: {len(cells)} cells over {len({c.document for c in cells})} documents, "
                f"{len(anchor_ok)} fixture anchors, {restarts} producer restarts; {gives}"
                + (f"; acceptance floor {floor!r} by {FLOOR_RULE}" if floor is not None else "") + fixture_note)
    reasons = judgement.failures
    verdict = Verdict(not reasons, headline, list(reasons) or [headline], judgement.checks + determinism.checks)
    return CalibrationJudgement(tuple(cells), bounds, anchor_tokens_exact, deterministic, floor, failures, verdict,
                                teacher_forced)


def _teacher_forced_rule(judgement: _Judgement, cells: Sequence[CellDrift]) -> TeacherForcedBounds | None:
    """The fixture parts from the cold recompute: the teacher-forced rule the cells give (checked)."""
    teacher_forced = derive_teacher_forced_bounds(cells)
    judgement.check("teacher-forced rule", teacher_forced is not None,
                    f"the fixture parts from the cold recompute: rule {TEACHER_FORCED_BOUND_RULE} derived"
                    if teacher_forced is not None else
                    f"the fixture parts from the cold recompute, and rule {TEACHER_FORCED_BOUND_RULE} needs at "
                    f"least 2 cells with their teacher-forced rows recorded")
    return teacher_forced


def _rule_gives(bounds: DerivedBounds | None, teacher_forced: TeacherForcedBounds | None) -> str:
    """What the calibration's rule gives, for its headline."""
    if teacher_forced is not None:
        return (f"the lane parts from the cold recompute, so rule {TEACHER_FORCED_BOUND_RULE} gives "
                f"maximum_absolute {teacher_forced.maximum_absolute!r}, maximum_mean_absolute (per row) "
                f"{teacher_forced.maximum_mean_absolute!r}, near_tie_margin {teacher_forced.near_tie_margin!r}, "
                f"maximum_changed_row_share {teacher_forced.maximum_changed_row_share!r}")
    return (f"rule {BOUND_RULE} gives maximum_absolute {None if bounds is None else bounds.maximum_absolute!r}, "
            f"maximum_mean_absolute {None if bounds is None else bounds.maximum_mean_absolute!r}")


def _check_cells(judgement: _Judgement, evidence: Mapping[str, Any],
                 records: Sequence[Record]) -> tuple[list[CellDrift], DerivedBounds | None]:
    """The "calibration cells" check: the cells the evidence names, and the bounds they give."""
    cells, cell_problems = calibration_cells(evidence, records)
    bounds = derive_bounds(cells)
    judgement.check("calibration cells", not cell_problems and bounds is not None,
                    f"{len(cells)} cells measured" if not cell_problems and bounds is not None
                    else "; ".join(cell_problems) or f"{len(cells)} cells: the rule needs at least 2",
                    reasons=cell_problems)
    return cells, bounds


def _check_handoffs(judgement: _Judgement, records: Sequence[Record]) -> list[str]:
    """The "handoffs" check: every record measured, none failed; returns the failures' lines."""
    plain = [_plain(record) for record in records]
    failures = [one_line(str(r["error"])) for r in plain if isinstance(r, Mapping) and r.get("error")]
    failures += [f"sample is not a record: {type(r).__name__}" for r in plain if not isinstance(r, Mapping)]
    judgement.check("handoffs", not failures,
                    f"{len(plain)} handoffs measured" if not failures else f"{len(failures)} of {len(plain)} handoffs failed",
                    reasons=[f"handoff failed: {failure}" for failure in failures])
    return failures


def _judge_envelope_calibration(records: Sequence[Record], evidence: Mapping[str, Any], *, lane: str, rung: int,
                                draft: bool, restarts_minimum: int,
                                series: Mapping[int, HandoffSeries]) -> CalibrationJudgement:
    """:func:`judge_calibration` of a producer declared non-deterministic: the cells as always,
    then the fixture envelope its envelope handoffs state in place of an anchor."""
    judgement = _Judgement()
    failures = _check_handoffs(judgement, records)
    restarts = max(producer_starts(evidence) - 1, 0)
    judgement.check("producer restarts", restarts >= restarts_minimum,
                    f"{restarts} producer restarts (at least {restarts_minimum})")
    _check_rule_stated(judgement, evidence)
    judgement.check("non-deterministic declaration", rung == 2 and not draft,
                    "a rung-2 producer without a draft, which may be declared non-deterministic" if rung == 2 and not draft
                    else f"rung {rung}{' with a draft' if draft else ''} is bit-exact: its producer cannot be declared "
                         "non-deterministic")
    cells, bounds = _check_cells(judgement, evidence, records)
    fixture = [r for r in fixture_records(evidence, records) if not r.get("error")]
    teacher_forced = _teacher_forced_rule(judgement, cells) if fixture and not keeps_tokens(fixture) else None
    forced_note = "" if teacher_forced is None else _anchors_under(fixture, teacher_forced, "envelope handoff")
    entries, entry_problems = envelope_handoffs(evidence)
    missing = [f"envelope handoff {repetition}: no series recorded (the comparer computed no per-tensor KV series)"
               for repetition, _ in entries if repetition not in series]
    envelope: FixtureEnvelope | None = None
    problems = entry_problems + missing
    if not problems:
        try:
            envelope = derive_fixture_envelope([series[repetition] for repetition, _ in entries],
                                               starts=len({start for _, start in entries}))
        except Refused as exc:
            problems.append(one_line(str(exc)))
    judgement.check("fixture envelope", envelope is not None,
                    f"rule {FIXTURE_ENVELOPE_RULE} stated from {envelope.handoffs} envelope handoffs over "
                    f"{envelope.starts} producer starts (k {'/'.join(repr(k) for k in envelope.multipliers)})"
                    if envelope is not None else "; ".join(problems), reasons=problems)
    gives = _rule_gives(bounds, teacher_forced)
    stated = (f"; rule {FIXTURE_ENVELOPE_RULE} states the fixture envelope from {envelope.handoffs} envelope handoffs "
              f"over {envelope.starts} producer starts (k {'/'.join(repr(k) for k in envelope.multipliers)}); no "
              f"anchor: the producer is declared non-deterministic" if envelope is not None else "")
    headline = (f"calibration of {lane}: {len(cells)} cells over {len({c.document for c in cells})} documents, "
                f"{len(fixture)} fixture envelope handoffs, {restarts} producer restarts; {gives}{stated}{forced_note}")
    reasons = judgement.failures
    verdict = Verdict(not reasons, headline, list(reasons) or [headline], judgement.checks)
    return CalibrationJudgement(tuple(cells), bounds, bool(fixture) and keeps_tokens(fixture), False, None, failures,
                                verdict, teacher_forced, envelope)


def _anchors_under(anchors: Sequence[Mapping[str, Any]], bounds: TeacherForcedBounds, what: str) -> str:
    """The fixture anchors judged by the rule the cells give, as a note for the headline: like the
    exact-token rule's fixture note, it fails nothing here (the anchor sets no number; a
    qualification judges the fixture, and publishes what it finds)."""
    failing = []
    for anchor in anchors:
        verdict = judge_teacher_forced_rows(anchor, bounds.rule())
        failing += [] if verdict.passed else [f"{what} {anchor.get('repetition')}: {'; '.join(verdict.reasons)}"]
    if failing:
        return f"; the fixture's own {what}s are OUTSIDE the derived teacher-forced rule ({'; '.join(failing)})"
    return f"; the fixture's own {what}s ({len(anchors)}) are within the derived teacher-forced rule"


def cell_table(cells: Sequence[CellDrift]) -> list[dict[str, Any]]:
    """The cells as rows (document, length, max, mean, tokens exact), for a receipt or a console."""
    return [{"document": c.document, "prompt_tokens": c.prompt_tokens, "max_abs": c.max_abs,
             "mean_abs": c.mean_abs, "tokens_exact": c.tokens_exact} for c in cells]


__all__ = [
    "ANCHOR_PART", "ENVELOPE_PART", "declares_envelope", "envelope_handoffs", "fixture_records", "producer_starts",
    "BOUND_RULE", "BOUND_RULE_STATEMENT", "CALIBRATION_EVIDENCE", "CALIBRATION_EVIDENCE_SCHEMA",
    "CALIBRATION_PART", "FLOOR_RULE", "FLOOR_RULE_STATEMENT", "ZERO_DRIFT_BOUND", "CalibrationJudgement",
    "CellDrift", "Check", "DerivedBounds", "anchor_draft_counts", "anchor_records", "bound_of", "bound_problems",
    "calibration_cells", "cell_table", "derive_acceptance_floor", "derive_bounds", "judge_calibration",
    "TeacherForcedBounds", "derive_teacher_forced_bounds", "keeps_tokens",
]

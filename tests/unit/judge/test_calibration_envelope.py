"""A calibration of a producer declared non-deterministic (qualify/judge/calibration.py): the cells
set the bounds as always; the fixture's envelope handoffs, grouped in producer starts, state the
fixture envelope in place of an anchor, and no digest has to agree across them. Its words are in
tests/golden/judge.calibration.txt."""

from __future__ import annotations

from typing import Any

from qualify.contract.rules import FIXTURE_ENVELOPE_RULE, FIXTURE_ENVELOPE_RULE_STATEMENT
from qualify.judge.calibration import (
    ENVELOPE_PART,
    anchor_records,
    declares_envelope,
    envelope_handoffs,
    fixture_records,
    judge_calibration,
    producer_starts,
)
from qualify.judge.envelope import HandoffSeries, derive_fixture_envelope
from tests.unit.judge.test_calibration_rules import CELLS, evidence, parted, record
from tests.unit.judge.test_envelope import series


def envelope_evidence(starts: list[int], *, declared: dict[str, Any] | None = None) -> dict[str, Any]:
    """Three cells (a start each), then one envelope handoff per entry of ``starts`` (its producer
    start), declared as the calibration declares them."""
    document = evidence(CELLS + [(ENVELOPE_PART, "python-textwrap", 2048)] * len(starts))
    for index, entry in enumerate(document["handoffs"]):
        entry["producer_start"] = index + 1 if index < len(CELLS) else starts[index - len(CELLS)]
    document["fixture_envelope"] = declared if declared is not None else {
        "rule": {"name": FIXTURE_ENVELOPE_RULE, "statement": FIXTURE_ENVELOPE_RULE_STATEMENT},
        "handoffs": len(starts), "producer_starts": len(set(starts))}
    return document


STARTS = [4, 4, 5, 5]
HONEST = [series([1.0, 2.0, 0.0]), series([1.5, 2.0, 0.0]), series([1.25, 1.0, 0.0]), series([1.0, 2.0, 0.0])]


def calibration(starts: list[int] = STARTS, honest: list[HandoffSeries] = HONEST, **records_by_repetition: Any
                ) -> tuple[dict[str, Any], list[dict[str, Any]], dict[int, HandoffSeries]]:
    """Evidence, records (three cells, then envelope handoffs whose payloads all differ: no digest
    has to agree) and the envelope handoffs' series by repetition."""
    document = envelope_evidence(starts)
    records = [record(1, 1.0, 0.05), record(2, 1.5, 0.07), record(3, 1.25, 0.06)]
    records += [record(4 + index, 0.5, 0.05, payload_sha256=f"{index + 1:064x}") for index in range(len(starts))]
    for name, value in records_by_repetition.items():
        records[int(name.removeprefix("r")) - 1] = value
    return document, records, {4 + index: honest[index] for index in range(len(starts))}


def judged(document: dict[str, Any], records: list[dict[str, Any]], series_by_repetition: dict[int, HandoffSeries],
           **options: Any) -> Any:
    return judge_calibration(records, document, envelope_series=series_by_repetition,
                             **(dict(lane="lane-x", rung=2, draft=False, restarts_minimum=2) | options))


def test_the_envelope_handoffs_state_the_fixture_envelope_with_no_anchor() -> None:
    document, records, by_repetition = calibration()
    result = judged(document, records, by_repetition)
    assert result.verdict.passed, result.verdict.reasons
    assert result.envelope == derive_fixture_envelope(HONEST, starts=2)
    assert not result.deterministic and anchor_records(document, records) == []
    names = [check.name for check in result.verdict.checks]
    assert "fixture envelope" in names and "anchor reproduced" not in names
    assert result.bounds is not None and result.bounds.maximum_absolute > 1.5  # the cells' bound, as always


def test_restarts_are_counted_from_the_producer_starts_the_entries_record() -> None:
    document, records, by_repetition = calibration()
    assert producer_starts(document) == 5  # three cells, then two starts of two handoffs each
    assert judged(document, records, by_repetition, restarts_minimum=4).verdict.passed
    refused = judged(document, records, by_repetition, restarts_minimum=5)
    assert [check.name for check in refused.verdict.checks if not check.passed] == ["producer restarts"]


def test_the_fixture_is_its_envelope_handoffs_and_their_entries_name_their_starts() -> None:
    document, records, _ = calibration()
    assert declares_envelope(document) and not declares_envelope(evidence(CELLS))
    assert fixture_records(document, records) == records[3:]
    assert envelope_handoffs(document) == ([(4, 4), (5, 4), (6, 5), (7, 5)], [])


def test_a_handoff_without_its_series_fails_the_envelope() -> None:
    document, records, by_repetition = calibration()
    del by_repetition[6]
    result = judged(document, records, by_repetition)
    assert not result.verdict.passed and result.envelope is None
    assert [check.name for check in result.verdict.checks if not check.passed] == ["fixture envelope"]


def test_one_producer_start_states_no_envelope() -> None:
    document, records, by_repetition = calibration(starts=[4, 4, 4, 4])
    result = judged(document, records, by_repetition)
    assert not result.verdict.passed and result.envelope is None


def test_a_declaration_its_entries_do_not_show_fails() -> None:
    document, records, by_repetition = calibration()
    document["fixture_envelope"]["handoffs"] = 8
    assert not judged(document, records, by_repetition).verdict.passed
    document, records, by_repetition = calibration()
    document["fixture_envelope"]["rule"] = {"name": FIXTURE_ENVELOPE_RULE, "statement": "the largest value, doubled"}
    assert not judged(document, records, by_repetition).verdict.passed
    document, records, by_repetition = calibration()
    del document["handoffs"][4]["producer_start"]
    assert not judged(document, records, by_repetition).verdict.passed


def test_rung3_or_a_draft_cannot_be_declared_non_deterministic() -> None:
    document, records, by_repetition = calibration()
    for options in ({"rung": 3}, {"draft": True}):
        result = judged(document, records, by_repetition, **options)
        assert [check.name for check in result.verdict.checks if not check.passed] == [
            "non-deterministic declaration"], options


def test_envelope_handoffs_that_part_make_the_lane_teacher_forced() -> None:
    document, records, by_repetition = calibration()
    cells = [parted(1, 1.0, 0.1, [(5, 0.5)]), parted(2, 1.5, 0.2, [(3, 0.5)]), parted(3, 1.25, 0.15, [(9, 0.25)])]
    fixture = [parted(4 + index, 1.0, 0.1, [(7, 0.25)]) for index in range(4)]
    result = judged(document, cells + fixture, by_repetition)
    assert result.verdict.passed, result.verdict.reasons
    assert result.teacher_forced is not None and result.envelope is not None


def test_a_failed_envelope_handoff_fails_the_calibration() -> None:
    document, records, by_repetition = calibration(r5={"repetition": 5, "error": "producer failed: stalled"})
    del by_repetition[5]
    result = judged(document, records, by_repetition)
    assert {check.name for check in result.verdict.checks if not check.passed} == {"handoffs", "fixture envelope"}


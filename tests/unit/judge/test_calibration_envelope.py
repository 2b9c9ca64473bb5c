"""A calibration of a producer declared non-deterministic (qualify/judge/calibration.py): the cells
set the bounds as always; the fixture's envelope handoffs, grouped in producer starts, state the
fixture envelope in place of an anchor, and no digest has to agree across them. Its words are in
tests/golden/judge.calibration.txt."""

from __future__ import annotations

from typing import Any

from qualify.contract.rules import FIXTURE_ENVELOPE_RULE, FIXTURE_ENVELOPE_RULE_STATEMENT, TEACHER_FORCED_BOUND_RULE
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
from tests.unit.judge.test_calibration_rules import ANCHORS, CELLS, evidence, parted, record
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



def test_one_producer_start_is_no_restart() -> None:
    document, records, by_repetition = calibration()
    for entry in document["handoffs"]:
        entry["producer_start"] = 1
    document["fixture_envelope"]["producer_starts"] = 1
    result = judged(document, records, by_repetition, restarts_minimum=1)
    assert "producer restarts" in [check.name for check in result.verdict.checks if not check.passed]


def test_a_calibration_that_keeps_tokens_says_so_and_one_that_parts_does_not() -> None:
    document, records, by_repetition = calibration()
    assert judged(document, records, by_repetition).anchor_tokens_exact is True
    cells = [parted(1, 1.0, 0.1, [(5, 0.5)]), parted(2, 1.5, 0.2, [(3, 0.5)]), parted(3, 1.25, 0.15, [(9, 0.25)])]
    fixture = [parted(4, 40.0, 0.1, [(7, 0.25)])] + [parted(5 + index, 1.0, 0.1, [(7, 0.25)]) for index in range(3)]
    result = judged(document, cells + fixture, by_repetition)
    assert result.anchor_tokens_exact is False and result.teacher_forced is not None
    # The headline gives the teacher-forced rule's numbers and names the envelope handoff outside them.
    assert TEACHER_FORCED_BOUND_RULE in result.verdict.headline
    assert "envelope handoff 4:" in result.verdict.headline and "anchor 4" not in result.verdict.headline


def test_each_missing_series_is_a_reason_of_its_own() -> None:
    document, records, by_repetition = calibration()
    del by_repetition[5], by_repetition[6]
    result = judged(document, records, by_repetition)
    missing = [reason for reason in result.verdict.reasons if "no series recorded" in reason]
    assert len(missing) == 2
    failed = next(check for check in result.verdict.checks if check.name == "fixture envelope")
    assert failed.detail == "; ".join(missing)


def test_a_draft_lane_is_refused_as_one_with_a_draft() -> None:
    document, records, by_repetition = calibration()
    detail = {options: next(check.detail for check in judged(document, records, by_repetition, **dict([options])
                                                               ).verdict.checks if not check.passed)
              for options in (("draft", True), ("rung", 3))}
    assert "with a draft" in detail[("draft", True)] and "with a draft" not in detail[("rung", 3)]


def test_envelope_entries_count_from_start_one_and_a_malformed_one_is_passed_over() -> None:
    assert envelope_handoffs(envelope_evidence([1, 1, 2, 2])) == ([(4, 1), (5, 1), (6, 2), (7, 2)], [])
    document = envelope_evidence([0, 4, 5, 5])
    found, problems = envelope_handoffs(document)
    assert found == [(5, 4), (6, 5), (7, 5)] and any("malformed" in problem for problem in problems)
    assert envelope_handoffs([]) == ([], ["calibration evidence: fixture_envelope missing or not an object"])  # type: ignore[arg-type]


def test_a_deterministic_calibrations_fixture_is_its_anchors() -> None:
    document = evidence(CELLS + ANCHORS)
    records = [record(index + 1, 1.0, 0.05) for index in range(5)]
    assert fixture_records(document, records) == records[3:]
    document["handoffs"][3]["repetition"] = "4"
    assert fixture_records(document, records) == records[4:]  # an entry whose repetition is no number counts not
    assert fixture_records(document, records[:4]) == []  # nor one whose sample is missing
    for entry in document["handoffs"]:
        entry["producer_start"] = 1
    assert producer_starts(document) == 5  # one per handoff unless a fixture envelope shares them


def test_a_parting_fixture_whose_cells_give_no_teacher_forced_rule_adds_no_note() -> None:
    document, records, by_repetition = calibration()
    fixture = [parted(4 + index, 1.0, 0.1, [(7, 0.25)]) for index in range(4)]
    result = judged(document, records[:3] + fixture, by_repetition)  # the cells recorded no teacher-forced rows
    assert result.teacher_forced is None
    assert "teacher-forced rule" in [check.name for check in result.verdict.checks if not check.passed]
    assert result.verdict.headline.endswith("no anchor: the producer is declared non-deterministic")

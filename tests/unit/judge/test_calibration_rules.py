"""The stated calibration rules (qualify/judge/calibration.py): bounds from the calibration cells
only, the draft floor from the anchor's counts, and the refusal of any sealed number that does not
follow from its basis by them."""

from __future__ import annotations

import math
import statistics
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qualify.contract.rules import BOUND_RULE, BOUND_RULE_STATEMENT
from qualify.core.stats import wilson_interval
from qualify.judge.calibration import (
    ANCHOR_PART,
    CALIBRATION_PART,
    ZERO_DRIFT_BOUND,
    anchor_draft_counts,
    anchor_records,
    bound_problems,
    calibration_cells,
    cell_table,
    derive_acceptance_floor,
    derive_bounds,
    derive_teacher_forced_bounds,
    judge_calibration,
)

DIGESTS = {name: f"{index:064x}" for index, name in enumerate((
    "payload_sha256", "seams_sha256", "handoff_logit_block_sha256", "cold_logit_block_sha256",
    "handoff_generated_token_sha256", "cold_generated_token_sha256"), start=1)}


def record(repetition: int, max_abs: float, mean_abs: float, *, exact: bool = True,
           teacher: tuple[float, float] | None = None, **overrides: Any) -> dict[str, Any]:
    document: dict[str, Any] = {"repetition": repetition, "token_agreement_rate": 1.0 if exact else 0.5,
                                "max_abs": max_abs, "mean_abs": mean_abs, **DIGESTS}
    if teacher is not None:
        document["localisation"] = {"teacher_forced": {"max_abs": teacher[0], "mean_abs": teacher[1]}}
    document.update(overrides)
    return document


def evidence(parts: list[tuple[str, str, int]], *, draft: dict[str, int] | None = None) -> dict[str, Any]:
    return {
        "rule": {"name": BOUND_RULE, "statement": BOUND_RULE_STATEMENT},
        "handoffs": [{"repetition": index + 1, "part": part, "document": document, "prompt_tokens": tokens,
                      "draft": draft if part == ANCHOR_PART else None}
                     for index, (part, document, tokens) in enumerate(parts)],
    }


CELLS = [(CALIBRATION_PART, "doc-a", 1024), (CALIBRATION_PART, "doc-a", 1792), (CALIBRATION_PART, "doc-b", 1024)]
ANCHORS = [(ANCHOR_PART, "python-textwrap", 2048)] * 2


def calibrated(maxima: list[float], means: list[float], anchor: tuple[float, float] = (0.5, 0.05)
               ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    records = [record(i + 1, x, y) for i, (x, y) in enumerate(zip(maxima, means, strict=True))]
    records += [record(len(maxima) + 1 + i, *anchor) for i in range(2)]
    return evidence(CELLS[:len(maxima)] + ANCHORS), records


def test_bounds_are_the_largest_cell_plus_one_sample_standard_deviation() -> None:
    maxima, means = [1.0, 1.5, 1.25], [0.05, 0.07, 0.06]
    document, records = calibrated(maxima, means)
    cells, problems = calibration_cells(document, records)
    assert problems == []
    bounds = derive_bounds(cells)
    assert bounds is not None
    assert bounds.maximum_absolute == 1.5 + statistics.stdev(maxima)
    assert bounds.maximum_mean_absolute == 0.07 + statistics.stdev(means)


def test_the_anchor_never_sets_a_bound() -> None:
    """A fixture anchor far above every cell moves no bound: the fixture is not in the set."""
    low, _ = calibrated([1.0, 1.5], [0.05, 0.07])
    high, records_high = calibrated([1.0, 1.5], [0.05, 0.07], anchor=(50.0, 5.0))
    _, records_low = calibrated([1.0, 1.5], [0.05, 0.07])
    assert derive_bounds(calibration_cells(high, records_high)[0]) == derive_bounds(calibration_cells(low, records_low)[0])


def test_a_diverged_cell_counts_its_teacher_forced_drift_and_one_without_it_is_a_problem() -> None:
    document = evidence(CELLS[:2] + ANCHORS)
    records = [record(1, 19.7, 2.3, exact=False, teacher=(1.25, 0.066)), record(2, 1.5, 0.08),
               record(3, 0.5, 0.05), record(4, 0.5, 0.05)]
    cells, problems = calibration_cells(document, records)
    assert problems == [] and [c.max_abs for c in cells] == [1.25, 1.5] and not cells[0].tokens_exact
    records[0] = record(1, 19.7, 2.3, exact=False)
    cells, problems = calibration_cells(document, records)
    assert len(cells) == 1 and problems == ["cell doc-a@1024: sample 1 has no teacher-forced drift that is a finite number >= 0"]


def test_zero_drift_everywhere_is_the_bit_exact_bound() -> None:
    document, records = calibrated([0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
    bounds = derive_bounds(calibration_cells(document, records)[0])
    assert bounds is not None and bounds.maximum_absolute == ZERO_DRIFT_BOUND == bounds.maximum_mean_absolute
    assert bounds.max_abs_spread == 0.0 == bounds.mean_abs_spread


def test_each_cell_problem_keeps_only_its_own_cell_out() -> None:
    """An anchor listed first, a malformed entry, a missing sample, a failed handoff and two
    negative drifts (in the maximum alone, in the mean alone) each keep only their own cell out;
    the two good cells after them still count."""
    document = {"handoffs": [
        {"repetition": 1, "part": ANCHOR_PART, "document": "python-textwrap", "prompt_tokens": 2048},
        {"repetition": True, "part": CALIBRATION_PART, "document": "doc-a", "prompt_tokens": 512},
        *({"repetition": index, "part": CALIBRATION_PART, "document": name, "prompt_tokens": 512}
          for index, name in ((3, "doc-b"), (4, "doc-c"), (5, "doc-d"), (6, "doc-e"))),
        {"repetition": 7, "part": CALIBRATION_PART, "document": "doc-a", "prompt_tokens": 1024},
        {"repetition": 8, "part": CALIBRATION_PART, "document": "doc-b", "prompt_tokens": 1024},
    ]}
    records = [record(1, 0.5, 0.05), {"repetition": 4, "error": "producer failed: stalled"}, record(5, -0.5, 0.05),
               record(6, 0.5, -0.05), record(7, 1.0, 0.05), record(8, 19.0, 2.0, exact=False, teacher=(1.25, 0.06))]
    cells, problems = calibration_cells(document, records)
    assert len(problems) == 5
    assert cell_table(cells) == [
        {"document": "doc-a", "prompt_tokens": 1024, "max_abs": 1.0, "mean_abs": 0.05, "tokens_exact": True},
        {"document": "doc-b", "prompt_tokens": 1024, "max_abs": 1.25, "mean_abs": 0.06, "tokens_exact": False},
    ]


def test_an_empty_handoff_list_gives_no_cells_and_one_problem() -> None:
    cells, problems = calibration_cells({"handoffs": []}, [record(1, 1.0, 0.05)])
    assert cells == [] and len(problems) == 1


def test_one_cell_gives_no_spread_and_no_bound() -> None:
    document, records = calibrated([1.0], [0.05])
    assert derive_bounds(calibration_cells(document, records)[0]) is None
    assert bound_problems(document, records, maximum_absolute=1.0, maximum_mean_absolute=0.05,
                          acceptance_floor=None) == ["calibration set: 1 measured cells, the rule needs at least 2"]


@given(st.lists(st.floats(min_value=0.0, max_value=100.0, allow_nan=False), min_size=2, max_size=8))
def test_a_sealed_bound_one_ulp_off_the_derived_bound_is_refused(maxima: list[float]) -> None:
    means = [value / 10 for value in maxima]
    document, records = calibrated(maxima, means)
    bounds = derive_bounds(calibration_cells(document, records)[0])
    assert bounds is not None
    exact = dict(maximum_absolute=bounds.maximum_absolute, maximum_mean_absolute=bounds.maximum_mean_absolute)
    assert bound_problems(document, records, **exact, acceptance_floor=None) == []
    relaxed = math.nextafter(bounds.maximum_absolute, math.inf)
    problems = bound_problems(document, records, maximum_absolute=relaxed,
                              maximum_mean_absolute=bounds.maximum_mean_absolute, acceptance_floor=None)
    assert problems == [f"maximum_absolute: sealed {relaxed!r}, the basis gives {bounds.maximum_absolute!r} "
                        f"by rule {BOUND_RULE}"]


def test_a_basis_stating_another_rule_is_refused() -> None:
    document, records = calibrated([1.0, 1.5], [0.05, 0.07])
    document["rule"] = {"name": BOUND_RULE, "statement": "the fixture's own maximum"}
    bounds = derive_bounds(calibration_cells(document, records)[0])
    assert bounds is not None
    problems = bound_problems(document, records, maximum_absolute=bounds.maximum_absolute,
                              maximum_mean_absolute=bounds.maximum_mean_absolute, acceptance_floor=None)
    assert len(problems) == 1 and problems[0].startswith("calibration evidence: rule: found")


def test_rung3_cells_must_be_bit_exact() -> None:
    document, records = calibrated([0.0, 0.25], [0.0, 0.01])
    assert bound_problems(document, records, maximum_absolute=None, maximum_mean_absolute=None,
                          acceptance_floor=None) == ["rung 3 is bit-exact but calibration cells drifted: doc-a@1792"]


def test_a_maximum_of_none_alone_still_declares_the_bit_exact_rule_and_refuses_drift() -> None:
    document, records = calibrated([0.25, 0.0, 0.0], [0.0, 0.01, 0.0])
    both_none = bound_problems(document, records, maximum_absolute=None, maximum_mean_absolute=None,
                               acceptance_floor=None)
    bounds = derive_bounds(calibration_cells(document, records)[0])
    assert bounds is not None
    mean_given = bound_problems(document, records, maximum_absolute=None,
                                maximum_mean_absolute=bounds.maximum_mean_absolute, acceptance_floor=None)
    assert len(both_none) == 1 and set(both_none) <= set(mean_given)


def test_a_sealed_floor_without_anchor_draft_counts_is_refused() -> None:
    document, records = calibrated([1.0, 1.5, 1.25], [0.05, 0.07, 0.06])
    bounds = derive_bounds(calibration_cells(document, records)[0])
    assert bounds is not None
    exact = dict(maximum_absolute=bounds.maximum_absolute, maximum_mean_absolute=bounds.maximum_mean_absolute)
    assert bound_problems(document, records, **exact, acceptance_floor=None) == []
    assert len(bound_problems(document, records, **exact, acceptance_floor=0.5)) == 1


def test_the_draft_floor_is_the_one_sided_wilson_lower_bound_of_the_first_anchor() -> None:
    document = evidence(CELLS[:2] + ANCHORS, draft={"proposed": 255, "accepted": 225})
    assert anchor_draft_counts(document) == (255, 225)
    floor = derive_acceptance_floor(255, 225)
    assert floor == wilson_interval(225, 255, sides=1)[0]
    assert 0.84 < floor < 225 / 255  # below the measured rate, one-sided 95 %
    records = [record(1, 0.0, 0.0), record(2, 0.0, 0.0), record(3, 0.0, 0.0), record(4, 0.0, 0.0)]
    assert bound_problems(document, records, maximum_absolute=None, maximum_mean_absolute=None,
                          acceptance_floor=floor) == []
    assert bound_problems(document, records, maximum_absolute=None, maximum_mean_absolute=None,
                          acceptance_floor=0.82) == [
        f"acceptance floor: sealed 0.82, the basis gives {floor!r} (225/255 accepted) by rule "
        "wilson-one-sided-95-lower.v1"]


@pytest.mark.parametrize("draft", [None, {"proposed": 0, "accepted": 0}, {"proposed": 5, "accepted": 6},
                                   {"proposed": 5.0, "accepted": 2}, {"proposed": True, "accepted": 1}])
def test_malformed_anchor_counts_give_no_floor(draft: dict[str, Any] | None) -> None:
    assert anchor_draft_counts(evidence(ANCHORS, draft=draft)) is None


def judged(records: list[dict[str, Any]], document: dict[str, Any], **kwargs: Any) -> Any:
    options = dict(lane="lane-x", rung=2, draft=False, restarts_minimum=2) | kwargs
    return judge_calibration(records, document, **options)


def test_a_clean_calibration_passes_and_names_its_rule() -> None:
    document, records = calibrated([1.0, 1.5, 1.25], [0.05, 0.07, 0.06])
    result = judged(records, document)
    assert result.verdict.passed and result.deterministic and result.anchor_tokens_exact
    assert BOUND_RULE in result.verdict.headline and "within the derived bounds" in result.verdict.headline
    assert anchor_records(document, records) == records[3:]


def test_anchors_that_differ_fail_the_calibration() -> None:
    document, records = calibrated([1.0, 1.5], [0.05, 0.07])
    records[-1]["payload_sha256"] = "f" * 64
    result = judged(records, document)
    assert not result.verdict.passed and not result.deterministic
    assert any("payload tree" in reason or "anchors differ" in reason for reason in result.verdict.reasons)


def test_one_anchor_is_not_enough() -> None:
    document, records = calibrated([1.0, 1.5], [0.05, 0.07])
    document["handoffs"] = document["handoffs"][:-1]
    result = judged(records[:-1], document)
    assert not result.verdict.passed and not result.deterministic


def parted(repetition: int, row_max: float, row_mean: float, partings: list[tuple[int, float]]) -> dict[str, Any]:
    """A sample whose tokens parted, with its teacher-forced rows as the comparer records them."""
    teacher = {"max_abs": row_max, "mean_abs": row_mean / 2, "first_row_over_rule": None,
               "top1_flips": len(partings), "max_row_mean_abs": row_mean,
               "partings": [{"row": row, "cold_margin": margin} for row, margin in partings]}
    return record(repetition, 19.0, 2.0, exact=False, output_tokens=256, localisation={"teacher_forced": teacher})


def test_a_parted_cell_counts_its_drift_and_the_fixture_parting_makes_the_lane_teacher_forced() -> None:
    """A cell that parted counts its teacher-forced drift under the exact-token rule; a fixture
    anchor that parts leaves the exact-token rule unable to qualify the lane, so it is judged
    teacher-forced, which anchors from before that rule (no rows recorded) cannot derive."""
    document, records = calibrated([1.0, 1.5], [0.05, 0.07])
    records[0] = record(1, 19.0, 2.0, exact=False, teacher=(1.0, 0.05))
    assert judged(records, document).verdict.passed
    records[2] = record(3, 0.5, 0.05, exact=False, teacher=(0.5, 0.05))
    result = judged(records, document)
    assert not result.verdict.passed and not result.anchor_tokens_exact and result.teacher_forced is None
    assert [c.name for c in result.verdict.checks if not c.passed] == ["teacher-forced rule"]


@pytest.mark.parametrize("output_tokens", [0, -256, "256", 256.0, True, None])
def test_a_cell_without_a_whole_positive_output_length_gives_no_parted_share(output_tokens: object) -> None:
    """The parted share is partings over the decoded rows: a cell whose sample records no whole,
    positive count of them has no share, and the teacher-forced rule then derives nothing."""
    document, _ = calibrated([1.0, 1.5], [0.05, 0.07])
    cells = [parted(1, 2.0, 0.3, [(5, 0.2)]), parted(2, 3.0, 0.4, [(9, 0.4)])]
    assert derive_teacher_forced_bounds(calibration_cells(document, cells)[0]) is not None
    cells[1]["output_tokens"] = output_tokens
    found, problems = calibration_cells(document, cells)
    assert problems == [] and found[1].output_tokens is None and found[1].teacher_forced_values is None
    assert derive_teacher_forced_bounds(found) is None


def test_a_lane_that_parts_at_near_ties_is_calibrated_teacher_forced() -> None:
    document, _ = calibrated([1.0, 1.5], [0.05, 0.07])
    cells = [parted(1, 2.0, 0.3, [(5, 0.2), (40, 0.1)]), parted(2, 3.0, 0.4, [(9, 0.4)])]
    anchors = [parted(3, 2.5, 0.35, [(7, 0.3)]), parted(4, 2.5, 0.35, [(7, 0.3)])]
    result = judged(cells + anchors, document)
    assert result.verdict.passed, result.verdict.reasons
    assert result.teacher_forced is not None
    assert result.teacher_forced.maximum_absolute == 3.0 + statistics.stdev([2.0, 3.0])
    assert result.teacher_forced.maximum_mean_absolute == 0.4 + statistics.stdev([0.3, 0.4])
    assert result.teacher_forced.near_tie_margin == 0.4 + statistics.stdev([0.2, 0.4])
    assert result.teacher_forced.maximum_changed_row_share == 2 / 256 + statistics.stdev([2 / 256, 1 / 256])
    assert "teacher-forced-cell-max-plus-one-sd.v1" in result.verdict.headline


def test_a_decisive_anchor_parting_is_published_in_the_headline_and_fails_nothing_here() -> None:
    """The anchor sets no number: the fixture outside the rule its cells give is a note, as under
    the exact-token rule; the qualification judges the fixture and fails it."""
    document, _ = calibrated([1.0, 1.5], [0.05, 0.07])
    cells = [parted(1, 2.0, 0.3, [(5, 0.2)]), parted(2, 3.0, 0.4, [(9, 0.4)])]
    anchors = [parted(3, 2.5, 0.35, [(7, 3.0)]), parted(4, 2.5, 0.35, [(7, 3.0)])]
    result = judged(cells + anchors, document)
    assert result.verdict.passed and result.teacher_forced is not None
    assert "OUTSIDE the derived teacher-forced rule" in result.verdict.headline
    assert "decisive parting at step 7" in result.verdict.headline
    assert "anchor 3:" in result.verdict.headline  # the note names each fixture handoff as an anchor
    within = judged(cells + [parted(3, 2.5, 0.35, [(7, 0.3)]), parted(4, 2.5, 0.35, [(7, 0.3)])], document)
    assert "within the derived teacher-forced rule" in within.verdict.headline


def test_fewer_restarts_than_the_set_requires_fail() -> None:
    document, records = calibrated([1.0, 1.5], [0.05, 0.07])
    assert judged(records, document, restarts_minimum=3).verdict.passed  # 4 handoffs: 3 restarts
    result = judged(records, document, restarts_minimum=4)
    assert not result.verdict.passed and "3 producer restarts (at least 4)" in result.verdict.reasons


def test_a_failed_handoff_fails_the_calibration() -> None:
    document, records = calibrated([1.0, 1.5], [0.05, 0.07])
    records[1] = {"repetition": 2, "error": "producer failed: stalled"}
    result = judged(records, document)
    assert not result.verdict.passed and result.failures == ["producer failed: stalled"]


def test_the_fixture_outside_the_derived_bounds_is_said_in_the_headline() -> None:
    document, records = calibrated([1.0, 1.5], [0.05, 0.07], anchor=(9.0, 0.05))
    assert "is OUTSIDE the derived bounds" in judged(records, document).verdict.headline


def check(result: Any, name: str) -> Any:
    (found,) = [c for c in result.verdict.checks if c.name == name]
    return found


def test_a_rung3_calibration_passes_only_when_every_cell_is_bit_exact() -> None:
    document, records = calibrated([0.0, 0.0, 0.0], [0.0, 0.0, 0.0], anchor=(0.0, 0.0))
    exact = judged(records, document, rung=3)
    assert exact.verdict.passed
    assert (check(exact, "bit-exact cells").passed, check(exact, "bit-exact cells").detail) == (True, "every cell bit-exact")
    # A cell drifting in its maximum only, or in its mean only, breaks rung 3; the same cells pass rung 2.
    for drifted in (record(2, 2.0 ** -149, 0.0), record(2, 0.0, 2.0 ** -149)):
        records[1] = drifted
        failed = judged(records, document, rung=3)
        assert not failed.verdict.passed
        assert failed.verdict.reasons == ["rung 3 needs bit-exact handoffs; drifted: doc-a@1792"]
        assert not check(failed, "bit-exact cells").passed
        assert judged(records, document, rung=2).verdict.passed
        assert "bit-exact cells" not in [c.name for c in judged(records, document, rung=2).verdict.checks]


def test_the_calibration_checks_are_named_and_say_what_held() -> None:
    document, records = calibrated([1.0, 1.5, 1.25], [0.05, 0.07, 0.06])
    result = judged(records, document)
    names = [c.name for c in result.verdict.checks]
    assert names[:6] == ["handoffs", "producer restarts", "rule stated", "calibration cells", "anchor tokens exact",
                         "anchor reproduced"]
    assert check(result, "handoffs").detail == "5 handoffs measured"
    assert check(result, "rule stated").detail == f"rule {BOUND_RULE}"
    assert check(result, "calibration cells").detail == "3 cells measured"
    assert check(result, "producer restarts").detail == "4 producer restarts (at least 2)"


def test_failed_and_foreign_samples_are_each_named_in_the_verdict() -> None:
    document, records = calibrated([1.0, 1.5], [0.05, 0.07])
    samples: list[Any] = [*records[:1], {"repetition": 2, "error": "producer failed: stalled"}, *records[2:], "junk"]
    result = judged(samples, document)
    assert not result.verdict.passed
    assert check(result, "handoffs").detail == "2 of 5 handoffs failed"
    assert result.verdict.reasons[:2] == ["handoff failed: producer failed: stalled", "handoff failed: sample is not a record: str"]


def test_too_few_cells_fail_naming_the_rule_minimum_and_a_missing_rule_fails_naming_it() -> None:
    document, records = calibrated([1.0], [0.05])
    result = judged(records, document, restarts_minimum=0)
    assert not check(result, "calibration cells").passed
    assert check(result, "calibration cells").detail == "1 cells: the rule needs at least 2"
    document, records = calibrated([1.0, 1.5], [0.05, 0.07])
    del document["rule"]
    result = judged(records, document)
    assert not check(result, "rule stated").passed and result.verdict.reasons == [check(result, "rule stated").detail]
    assert "rule" in check(result, "rule stated").detail


def test_evidence_without_handoffs_gives_no_anchors_no_counts_and_no_restarts_never_an_exception() -> None:
    for broken in ({}, {"handoffs": "none"}, {"handoffs": []}, {"handoffs": [1, 2]}):
        assert anchor_records(broken, [record(1, 0.0, 0.0)]) == []
        assert anchor_draft_counts(broken) is None
        result = judged([record(1, 0.0, 0.0)], broken, restarts_minimum=0)
        assert not result.verdict.passed
        assert check(result, "producer restarts").detail == "0 producer restarts (at least 0)"


def test_an_anchor_whose_sample_is_missing_is_skipped() -> None:
    document, records = calibrated([1.0, 1.5], [0.05, 0.07])
    assert anchor_records(document, records[:-1]) == [records[2]]  # repetition 4 has no sample
    document["handoffs"][3]["repetition"] = "4"
    assert anchor_records(document, records) == [records[2]]


@pytest.mark.parametrize(("proposed", "accepted"), [(1, 0), (1, 1), (7, 0), (7, 7)])
def test_anchor_counts_at_their_bounds_are_kept(proposed: int, accepted: int) -> None:
    document = evidence(ANCHORS, draft={"proposed": proposed, "accepted": accepted})
    assert anchor_draft_counts(document) == (proposed, accepted)


def test_a_fixture_exactly_at_the_derived_bounds_is_within_them_and_one_ulp_over_is_outside() -> None:
    document, records = calibrated([1.0, 1.5, 1.25], [0.05, 0.07, 0.06])
    bounds = derive_bounds(calibration_cells(document, records)[0])
    assert bounds is not None
    for anchor, said in (((bounds.maximum_absolute, bounds.maximum_mean_absolute), "within"),
                         ((math.nextafter(bounds.maximum_absolute, math.inf), bounds.maximum_mean_absolute), "OUTSIDE"),
                         ((bounds.maximum_absolute, math.nextafter(bounds.maximum_mean_absolute, math.inf)), "OUTSIDE")):
        at, records_at = calibrated([1.0, 1.5, 1.25], [0.05, 0.07, 0.06], anchor=anchor)
        assert f"is {said} the derived bounds" in judged(records_at, at).verdict.headline


# --------------------------------------------------------------------------- what a calibration judgement holds
# (its words are held in tests/golden/judge.calibration.txt)


def outcomes(result: Any) -> dict[str, bool]:
    return {c.name: c.passed for c in result.verdict.checks}


@pytest.mark.parametrize("broken", [None, [], ["handoffs"]], ids=["none", "list", "list-of-text"])
def test_evidence_that_is_not_an_object_fails_its_rule_and_cells_never_an_exception(broken: Any) -> None:
    result = judged([record(1, 1.0, 0.05)], broken, restarts_minimum=0)
    assert not result.verdict.passed and result.bounds is None
    assert outcomes(result)["rule stated"] is False and outcomes(result)["calibration cells"] is False


def test_a_clean_calibration_returns_the_bounds_its_cells_derive_and_no_floor() -> None:
    document, records = calibrated([1.0, 1.5, 1.25], [0.05, 0.07, 0.06])
    result = judged(records, document)
    assert result.verdict.passed and all(outcomes(result).values())
    assert result.bounds is not None and result.bounds == derive_bounds(result.cells)
    assert (result.proposed_maximum_absolute, result.bounds.maximum_absolute) == (1.75, 1.75)
    assert result.proposed_maximum_mean_absolute == result.bounds.maximum_mean_absolute
    assert [c.tokens_exact for c in result.cells] == [True, True, True]
    assert result.acceptance_floor is None and result.failures == []


def test_diverged_anchors_fail_only_the_anchor_tokens_check_on_rung_3() -> None:
    document, records = calibrated([0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
    records[3:] = [record(4, 0.0, 0.0, exact=False), record(5, 0.0, 0.0, exact=False)]
    result = judged(records, document, rung=3)
    assert [name for name, passed in outcomes(result).items() if not passed] == ["anchor tokens exact"]
    assert len(result.verdict.reasons) == 1 and result.bounds == derive_bounds(result.cells)


def test_diverged_anchors_without_teacher_forced_rows_fail_only_the_teacher_forced_rule_on_rung_2() -> None:
    """On rung 2 a lane that parts is judged teacher-forced; anchors that record no teacher-forced
    rows leave that rule underivable, and nothing else fails."""
    document, records = calibrated([1.0, 1.5, 1.25], [0.05, 0.07, 0.06])
    records[3:] = [record(4, 0.5, 0.05, exact=False), record(5, 0.5, 0.05, exact=False)]
    result = judged(records, document)
    assert [name for name, passed in outcomes(result).items() if not passed] == ["teacher-forced rule"]
    assert len(result.verdict.reasons) == 1 and result.bounds == derive_bounds(result.cells)


def test_a_failed_anchor_handoff_is_left_out_of_the_anchors_and_fails_only_the_handoffs_check() -> None:
    document = evidence(CELLS + ANCHORS + [(ANCHOR_PART, "python-textwrap", 2048)])
    records = [record(1, 1.0, 0.05), record(2, 1.5, 0.07), record(3, 1.25, 0.06), record(4, 0.5, 0.05),
               record(5, 0.5, 0.05), {"repetition": 6, "error": "producer failed: stalled"}]
    result = judged(records, document)
    # the failed one is no anchor: the two left reproduce each other
    assert [name for name, passed in outcomes(result).items() if not passed] == ["handoffs"]
    assert result.failures == ["producer failed: stalled"] and len(result.verdict.reasons) == 1


def test_cell_problems_fail_the_cells_check_and_each_is_its_own_reason() -> None:
    document = evidence([(CALIBRATION_PART, "doc-a", 512), (CALIBRATION_PART, "doc-b", 512), *CELLS[:2], *ANCHORS])
    records = [{"repetition": 2, "error": "boom"}, record(3, 1.0, 0.05), record(4, 1.5, 0.07),
               record(5, 0.5, 0.05), record(6, 0.5, 0.05)]
    result = judged(records, document)
    assert [name for name, passed in outcomes(result).items() if not passed] == ["handoffs", "calibration cells"]
    assert len(result.verdict.reasons) == 3 and len(result.cells) == 2


DRAFT_DIGESTS = {"handoff_draft_tokens_sha256": "d" * 64, "handoff_draft_trace_sha256": "e" * 64}


def drafted(draft: dict[str, int] | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    document = evidence(CELLS + ANCHORS, draft=draft)
    drifts = [(1.0, 0.05), (1.5, 0.07), (1.25, 0.06), (0.5, 0.05), (0.5, 0.05)]
    return document, [record(index, *drift, **DRAFT_DIGESTS) for index, drift in enumerate(drifts, start=1)]


def test_a_draft_calibration_derives_the_floor_from_the_anchor_counts() -> None:
    document, records = drafted({"proposed": 255, "accepted": 225})
    result = judged(records, document, draft=True)
    assert result.verdict.passed and outcomes(result)["draft counts"] is True
    assert result.acceptance_floor == derive_acceptance_floor(255, 225)
    assert 0.84 < result.acceptance_floor < 225 / 255


def test_a_draft_calibration_whose_anchor_recorded_no_counts_fails_and_derives_no_floor() -> None:
    document, records = drafted(None)
    result = judged(records, document, draft=True)
    assert not result.verdict.passed and outcomes(result)["draft counts"] is False
    assert result.acceptance_floor is None and len(result.verdict.reasons) == 1


def test_a_lane_without_a_draft_derives_no_floor_even_when_the_anchor_recorded_counts() -> None:
    document, records = drafted({"proposed": 255, "accepted": 225})
    result = judged(records, document, draft=False)
    assert result.verdict.passed and result.acceptance_floor is None
    assert "draft counts" not in outcomes(result)

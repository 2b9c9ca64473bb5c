"""The teacher-forced rung-2 rule (teacher-forced-near-tie.v1): a sample whose greedy tokens part
from the cold recompute is judged by its teacher-forced rows (every parting a near-tie, every row's
max and mean within the bounds, the parted share within its ceiling); the summary and the scope
line name the rule and count the partings; the rule's two clauses validate; and a calibration's
four sealed numbers must be exactly what teacher-forced-cell-max-plus-one-sd.v1 derives."""

from __future__ import annotations

import copy
import math
import statistics
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from qualify.contract.rules import TEACHER_FORCED_BOUND_RULE, TEACHER_FORCED_RULE
from qualify.evidence.records import BoundedDriftRule, parse_rule
from qualify.judge import Verdict, judge_qualification, judge_rung2_sample, judge_summary
from qualify.judge.calibration import (
    TeacherForcedBounds,
    bound_problems,
    calibration_cells,
    derive_teacher_forced_bounds,
)
from qualify.judge.handoffs import judge_teacher_forced_rows, near_tie_partings
from qualify.judge.scope import Scope, fixture_words, scope_document, scope_line
from tests.unit.judge.test_calibration_rules import ANCHORS, CELLS, evidence, parted
from tests.unit.judge.test_calibration_rules import record as calibration_record
from tests.unit.judge.test_judge import RULE2, SEAMS_SHA, rung2_record

TOKENS = 256
HANDOFF_TOKENS_SHA = "a" * 64
"""The handoff branch's generated-token digest once its tokens parted from the cold run's."""

NEAR_TIE_MARGIN = 0.5
SHARE_CEILING = 8 / TOKENS  # 0.03125, exact in binary: a share of 8 parted rows sits on it
RULE_TF = BoundedDriftRule(maximum_absolute=11.0, maximum_mean_absolute=1.25,
                           near_tie_margin=NEAR_TIE_MARGIN, maximum_changed_row_share=SHARE_CEILING)

PARTINGS = [(7, 0.25), (40, 0.5)]
"""Two near-ties, the second exactly at the near-tie margin."""

TF_CHECKS = ["near-tie partings", "teacher-forced drift", "parted rows"]
SCOPE = Scope("python-textwrap", 3, 2048, TOKENS, None)


def teacher(partings: list[tuple[int, float]], *, row_max: float = 3.0, row_mean: float = 0.5,
            **changes: Any) -> dict[str, Any]:
    """A sample's ``localisation.teacher_forced`` as the comparer records it (receipt JSON)."""
    summary: dict[str, Any] = {
        "max_abs": row_max, "mean_abs": row_mean / 4, "first_row_over_rule": None,
        "top1_flips": len(partings), "max_row_mean_abs": row_mean,
        "partings": [{"row": row, "cold_margin": margin} for row, margin in partings],
    }
    summary.update(changes)
    return summary


def parted_sample(repetition: int = 1, partings: list[tuple[int, float]] | None = None, **teacher_changes: Any
                  ) -> dict[str, Any]:
    """A complete rung-2 sample whose tokens parted at ``partings`` (each with its cold margin):
    agreement below 1, a handoff token digest of its own, the teacher-forced rows recorded."""
    partings = PARTINGS if partings is None else partings
    return rung2_record(
        repetition,
        token_agreement_rate=(TOKENS - len(partings)) / TOKENS,
        handoff_generated_token_sha256=HANDOFF_TOKENS_SHA,
        max_row_mean_abs=1.2,
        localisation={"teacher_forced": teacher(partings, **teacher_changes)},
    )


def exact_sample(repetition: int = 1, **changes: Any) -> dict[str, Any]:
    """A complete rung-2 sample whose tokens kept the cold run's (no localisation recorded)."""
    return rung2_record(repetition, **({"max_row_mean_abs": 1.2} | changes))


def outcomes(verdict: Verdict) -> dict[str, bool]:
    return {check.name: check.passed for check in verdict.checks}


def failed_checks(verdict: Verdict) -> list[str]:
    return [check.name for check in verdict.checks if not check.passed]


# --------------------------------------------------------------------------- one sample


def test_near_tie_partings_pass_though_the_tokens_and_their_digest_part_from_the_cold_run() -> None:
    sample = parted_sample()
    assert sample["handoff_generated_token_sha256"] != sample["cold_generated_token_sha256"]
    assert sample["token_agreement_rate"] < 1.0
    verdict = judge_rung2_sample(sample, RULE_TF)
    assert verdict.passed, verdict.reasons
    checks = outcomes(verdict)
    assert all(checks[name] for name in TF_CHECKS)
    assert "tokens exact" not in checks and checks["generated-token digest"]  # it agrees with the agreement
    assert "bounded drift" not in checks  # the exact-token rule's clause is not the one judging


def test_the_exact_token_rule_still_fails_a_sample_whose_tokens_parted() -> None:
    verdict = judge_rung2_sample(parted_sample(), RULE2)
    assert not verdict.passed
    assert {"tokens exact", "generated-token digest"} <= set(failed_checks(verdict))
    assert not set(TF_CHECKS) & set(outcomes(verdict))


def test_a_decisive_parting_fails_naming_its_step_and_margin() -> None:
    verdict = judge_rung2_sample(parted_sample(partings=[(7, 0.25), (40, 0.75)]), RULE_TF)
    assert not verdict.passed
    assert failed_checks(verdict) == ["near-tie partings"]
    [reason] = verdict.reasons
    assert "decisive parting at step 40" in reason and "cold margin 0.75" in reason


def test_of_several_decisive_partings_the_first_is_named() -> None:
    verdict = judge_rung2_sample(parted_sample(partings=[(3, 2.0), (7, 0.25), (40, 0.75)]), RULE_TF)
    [reason] = verdict.reasons
    assert reason.startswith("decisive parting at step 3: cold margin 2 ")
    assert "step 40" not in reason


@pytest.mark.parametrize(("margin", "passed"), [(NEAR_TIE_MARGIN, True), (math.nextafter(NEAR_TIE_MARGIN, math.inf), False)],
                         ids=["at-the-margin", "one-ulp-over"])
def test_a_parting_exactly_at_the_near_tie_margin_is_a_near_tie_and_one_ulp_over_is_decisive(
        margin: float, passed: bool) -> None:
    verdict = judge_rung2_sample(parted_sample(partings=[(12, margin)]), RULE_TF)
    assert verdict.passed is passed
    assert outcomes(verdict)["near-tie partings"] is passed


def test_a_teacher_forced_row_max_over_the_bound_fails() -> None:
    over = math.nextafter(RULE_TF.maximum_absolute, math.inf)
    verdict = judge_rung2_sample(parted_sample(row_max=over, first_row_over_rule=40), RULE_TF)
    assert not verdict.passed and failed_checks(verdict) == ["teacher-forced drift"]
    assert "first row over the rule 40" in verdict.reasons[0]
    for unread in ("40", 40.0, True):  # a row is a whole number: anything else names none
        verdict = judge_rung2_sample(parted_sample(row_max=over, first_row_over_rule=unread), RULE_TF)
        assert failed_checks(verdict) == ["teacher-forced drift"] and "first row over" not in verdict.reasons[0]


def test_a_row_mean_over_the_bound_fails_though_the_block_mean_is_under() -> None:
    """Every row is judged alone: one row's mean over the bound fails, whatever the block's mean."""
    sample = parted_sample(row_mean=1.3)
    assert sample["localisation"]["teacher_forced"]["mean_abs"] < RULE_TF.maximum_mean_absolute
    assert sample["mean_abs"] < RULE_TF.maximum_mean_absolute
    verdict = judge_rung2_sample(sample, RULE_TF)
    assert not verdict.passed and failed_checks(verdict) == ["teacher-forced drift"]


def test_teacher_forced_rows_exactly_at_both_bounds_pass() -> None:
    verdict = judge_rung2_sample(parted_sample(row_max=RULE_TF.maximum_absolute, row_mean=RULE_TF.maximum_mean_absolute),
                                 RULE_TF)
    assert verdict.passed, verdict.reasons


def test_the_free_running_rows_after_a_parting_are_not_judged() -> None:
    """Once the tokens part, the free-running rows score another context: the teacher-forced rows
    are judged instead, so a free-running maximum over the bound does not fail the sample."""
    sample = parted_sample()
    sample["max_abs"] = 19.0
    sample["max_row_mean_abs"] = 2.0
    assert judge_rung2_sample(sample, RULE_TF).passed


@pytest.mark.parametrize(("count", "passed"), [(8, True), (9, False)], ids=["at-the-ceiling", "one-row-over"])
def test_the_parted_share_may_reach_its_ceiling_and_not_pass_it(count: int, passed: bool) -> None:
    partings = [(row * 10, 0.25) for row in range(count)]
    assert (count / TOKENS <= SHARE_CEILING) is passed
    verdict = judge_rung2_sample(parted_sample(partings=partings), RULE_TF)
    assert verdict.passed is passed, verdict.reasons
    assert failed_checks(verdict) == ([] if passed else ["parted rows"])


def test_a_sample_that_kept_its_tokens_is_judged_by_its_own_rows() -> None:
    verdict = judge_rung2_sample(exact_sample(), RULE_TF)
    assert verdict.passed, verdict.reasons
    assert all(outcomes(verdict)[name] for name in TF_CHECKS)
    assert near_tie_partings([exact_sample()], RULE_TF) == (0, 0)


@pytest.mark.parametrize("how", ["absent", "null", "nan", "negative", "text"])
def test_a_sample_that_kept_its_tokens_without_its_largest_row_mean_fails_never_read_as_zero(how: str) -> None:
    sample = exact_sample()
    if how == "absent":
        del sample["max_row_mean_abs"]
    else:
        sample["max_row_mean_abs"] = {"null": None, "nan": math.nan, "negative": -0.5, "text": "0.1"}[how]
    verdict = judge_rung2_sample(sample, RULE_TF)
    assert not verdict.passed and failed_checks(verdict) == ["teacher-forced rows"]
    assert near_tie_partings([sample], RULE_TF) is None


@pytest.mark.parametrize(("field", "value"), [("max_abs", math.nextafter(11.0, math.inf)),
                                              ("max_row_mean_abs", math.nextafter(1.25, math.inf))])
def test_a_sample_that_kept_its_tokens_fails_a_row_over_either_bound(field: str, value: float) -> None:
    changes: dict[str, Any] = {field: value}
    verdict = judge_rung2_sample(exact_sample(**changes), RULE_TF)
    assert not verdict.passed and failed_checks(verdict) == ["teacher-forced drift"]


@pytest.mark.parametrize("localisation", [None, {}, {"teacher_forced": None}, {"teacher_forced": "rows"}])
def test_tokens_that_parted_without_teacher_forced_rows_fail(localisation: Any) -> None:
    sample = parted_sample()
    sample["localisation"] = localisation
    verdict = judge_rung2_sample(sample, RULE_TF)
    assert not verdict.passed and failed_checks(verdict) == ["teacher-forced rows"]


def _edit_teacher(sample: dict[str, Any], **changes: Any) -> dict[str, Any]:
    edited = copy.deepcopy(sample)
    edited["localisation"]["teacher_forced"].update(changes)
    return edited


def _without(sample: dict[str, Any], field: str) -> dict[str, Any]:
    edited = copy.deepcopy(sample)
    del edited["localisation"]["teacher_forced"][field]
    return edited


MALFORMED_ROWS = {
    "rows-not-increasing": lambda s: _edit_teacher(s, partings=[{"row": 40, "cold_margin": 0.1},
                                                                {"row": 7, "cold_margin": 0.1}]),
    "a-row-twice": lambda s: _edit_teacher(s, partings=[{"row": 7, "cold_margin": 0.1},
                                                        {"row": 7, "cold_margin": 0.1}]),
    "no-parting-listed": lambda s: _edit_teacher(s, partings=[], top1_flips=0),
    "flips-more-than-listed": lambda s: _edit_teacher(s, top1_flips=3),
    "flips-fewer-than-listed": lambda s: _edit_teacher(s, top1_flips=1),
    "negative-margin": lambda s: _edit_teacher(s, partings=[{"row": 7, "cold_margin": -0.25},
                                                            {"row": 40, "cold_margin": 0.1}]),
    "nan-margin": lambda s: _edit_teacher(s, partings=[{"row": 7, "cold_margin": math.nan},
                                                       {"row": 40, "cold_margin": 0.1}]),
    "negative-row": lambda s: _edit_teacher(s, partings=[{"row": -1, "cold_margin": 0.1},
                                                         {"row": 40, "cold_margin": 0.1}]),
    "bool-row": lambda s: _edit_teacher(s, partings=[{"row": True, "cold_margin": 0.1},
                                                     {"row": 40, "cold_margin": 0.1}]),
    "entry-not-an-object": lambda s: _edit_teacher(s, partings=[7, 40]),
    "partings-absent": lambda s: _without(s, "partings"),
    "partings-null": lambda s: _edit_teacher(s, partings=None),
    "row-max-absent": lambda s: _without(s, "max_abs"),
    "row-mean-absent": lambda s: _without(s, "max_row_mean_abs"),
    "row-mean-nan": lambda s: _edit_teacher(s, max_row_mean_abs=math.nan),
    "row-max-negative": lambda s: _edit_teacher(s, max_abs=-1.0),
}


@pytest.mark.parametrize("edit", list(MALFORMED_ROWS.values()), ids=list(MALFORMED_ROWS))
def test_malformed_teacher_forced_rows_fail_and_are_never_counted(edit: Any) -> None:
    sample = edit(parted_sample())
    verdict = judge_rung2_sample(sample, RULE_TF)
    assert not verdict.passed and failed_checks(verdict) == ["teacher-forced rows"]
    assert near_tie_partings([sample], RULE_TF) is None


def test_a_malformed_entry_fails_even_when_its_margin_would_be_a_near_tie() -> None:
    """Malformed evidence is failed evidence: small margins do not excuse it."""
    sample = _edit_teacher(parted_sample(), top1_flips=5)
    assert all(item["cold_margin"] <= NEAR_TIE_MARGIN for item in sample["localisation"]["teacher_forced"]["partings"])
    assert not judge_rung2_sample(sample, RULE_TF).passed


def test_a_not_drift_graded_teacher_forced_rule_still_refuses_a_logit_digest_mismatch() -> None:
    rule = RULE_TF.model_copy(update={"drift_graded": False})
    verdict = judge_rung2_sample(parted_sample(), rule)
    assert not verdict.passed and failed_checks(verdict) == ["logit digests"]
    assert judge_rung2_sample(parted_sample(), RULE_TF).passed


def test_a_rule_given_as_a_dict_judges_alike() -> None:
    as_dict = RULE_TF.model_dump()
    assert parse_rule(as_dict) == RULE_TF
    for sample in (parted_sample(), parted_sample(partings=[(7, 0.75)])):
        assert judge_rung2_sample(sample, as_dict) == judge_rung2_sample(sample, RULE_TF)


@settings(max_examples=200, deadline=None)
@given(
    margins=st.lists(st.floats(min_value=0.0, max_value=10.0, allow_nan=False, allow_infinity=False), min_size=1, max_size=12),
    threshold=st.floats(min_value=1e-9, max_value=10.0, allow_nan=False, allow_infinity=False),
    gaps=st.lists(st.integers(min_value=1, max_value=20), min_size=12, max_size=12),
)
def test_the_near_tie_clause_holds_exactly_when_the_largest_cold_margin_is_within_the_threshold(
        margins: list[float], threshold: float, gaps: list[int]) -> None:
    """Every other clause passes (rows within the bounds, the share's ceiling at 1), so the sample
    passes exactly when its largest parting margin is at most the near-tie margin."""
    rows = [sum(gaps[:index + 1]) for index in range(len(margins))]  # increasing, each once, all < 256
    rule = BoundedDriftRule(maximum_absolute=11.0, maximum_mean_absolute=1.25, near_tie_margin=threshold,
                            maximum_changed_row_share=1.0)
    sample = parted_sample(partings=list(zip(rows, margins, strict=True)))
    verdict = judge_rung2_sample(sample, rule)
    near = max(margins) <= threshold
    assert verdict.passed is near
    assert outcomes(verdict)["near-tie partings"] is near
    assert near_tie_partings([sample], rule) == (sum(margin <= threshold for margin in margins), len(margins))


# --------------------------------------------------------------------------- over the repetitions


def three_parted(partings: list[tuple[int, float]] | None = None) -> list[dict[str, Any]]:
    return [dict(parted_sample(repetition, partings), seams_sha256=SEAMS_SHA) for repetition in (1, 2, 3)]


def test_a_summary_of_parting_repetitions_passes_without_the_exact_token_checks() -> None:
    verdict = judge_summary(three_parted(), RULE_TF)
    assert verdict.passed, verdict.reasons
    names = set(outcomes(verdict))
    assert "tokens exact in every repetition" not in names and "bounded drift in every repetition" not in names
    assert {"samples", "generated-token digest across repetitions"} <= names
    assert "6 partings, each a near-tie" in verdict.headline


def test_a_summary_fails_a_decisive_parting_in_one_repetition_naming_it() -> None:
    records = three_parted()
    records[1] = dict(parted_sample(2, [(7, 0.25), (40, 0.75)]), seams_sha256=SEAMS_SHA)
    verdict = judge_summary(records, RULE_TF)
    assert not verdict.passed
    assert any(reason.startswith("repetition 2: ") and "decisive parting at step 40" in reason for reason in verdict.reasons)
    assert near_tie_partings(records, RULE_TF) == (5, 6)


def test_the_exact_token_rule_fails_a_summary_of_parting_repetitions() -> None:
    verdict = judge_summary(three_parted(), RULE2)
    assert not verdict.passed
    assert not outcomes(verdict)["tokens exact in every repetition"]


def test_a_qualification_judged_teacher_forced_names_the_rule_and_counts_the_partings_in_its_scope() -> None:
    records, anchors = three_parted(), three_parted()
    verdict = judge_qualification(records, RULE_TF, anchors, deterministic_producer=True, scope=SCOPE)
    assert verdict.passed, verdict.reasons
    assert verdict.scope is not None
    assert verdict.scope.judged_by == TEACHER_FORCED_RULE == "teacher-forced-near-tie.v1"
    assert verdict.scope.partings == (6, 6)
    assert f"judged teacher-forced by {TEACHER_FORCED_RULE}" in scope_line(True, verdict.scope)
    assert f"judged teacher-forced by {TEACHER_FORCED_RULE}: 6 of 6 partings near-ties" in verdict.headline
    assert verdict.headline.startswith("QUALIFIED on fixture python-textwrap")
    document = scope_document(verdict.scope, True)
    assert document["judged_by"] == {"rule": TEACHER_FORCED_RULE, "near_tie_partings": 6, "partings": 6}
    assert document["fixture_words"] == fixture_words(verdict.scope)


def test_a_failed_teacher_forced_qualification_still_counts_its_near_ties_among_its_partings() -> None:
    records = three_parted([(7, 0.25), (40, 0.75)])
    verdict = judge_qualification(records, RULE_TF, three_parted(), deterministic_producer=True, scope=SCOPE)
    assert not verdict.passed and verdict.scope is not None
    assert verdict.scope.partings == (3, 6)
    assert verdict.headline.startswith("NOT QUALIFIED on fixture python-textwrap")
    assert "3 of 6 partings near-ties" in verdict.headline


def test_repetitions_that_kept_their_tokens_are_scoped_as_judged_teacher_forced_with_no_parting() -> None:
    records = [dict(exact_sample(repetition), seams_sha256=SEAMS_SHA) for repetition in (1, 2, 3)]
    verdict = judge_qualification(records, RULE_TF, copy.deepcopy(records), deterministic_producer=True, scope=SCOPE)
    assert verdict.passed, verdict.reasons
    assert verdict.scope is not None and verdict.scope.partings == (0, 0)
    assert f"judged teacher-forced by {TEACHER_FORCED_RULE}: no parting" in verdict.headline


def test_partings_that_cannot_be_read_leave_the_count_out_of_the_scope_but_name_the_rule() -> None:
    records = three_parted()
    records[2] = dict(_edit_teacher(records[2], top1_flips=9))
    verdict = judge_qualification(records, RULE_TF, three_parted(), deterministic_producer=True, scope=SCOPE)
    assert not verdict.passed and verdict.scope is not None
    assert verdict.scope.judged_by == TEACHER_FORCED_RULE and verdict.scope.partings is None
    assert f"judged teacher-forced by {TEACHER_FORCED_RULE})" in verdict.headline


def test_an_exact_token_qualification_names_no_teacher_forced_rule() -> None:
    records = [rung2_record(repetition, seams_sha256=SEAMS_SHA) for repetition in (1, 2, 3)]
    verdict = judge_qualification(records, RULE2, copy.deepcopy(records), deterministic_producer=True, scope=SCOPE)
    assert verdict.passed and verdict.scope is not None
    assert verdict.scope.judged_by is None and verdict.scope.partings is None
    assert "judged teacher-forced" not in verdict.headline
    assert scope_document(verdict.scope, True)["judged_by"] is None
    assert near_tie_partings(records, RULE2) is None


@pytest.mark.parametrize(("judged_by", "partings"), [
    (None, (1, 2)),  # counts without a rule that read them
    (TEACHER_FORCED_RULE, (3, 2)),  # more near-ties than partings
    (TEACHER_FORCED_RULE, (-1, 2)),
    (TEACHER_FORCED_RULE, (True, 2)),
    ("two words", None),
])
def test_a_scope_refuses_partings_it_cannot_state(judged_by: str | None, partings: tuple[Any, Any] | None) -> None:
    with pytest.raises(ValueError, match="scope: "):
        Scope("python-textwrap", 3, 2048, TOKENS, None, judged_by=judged_by, partings=partings)


# --------------------------------------------------------------------------- the rule's clauses


@pytest.mark.parametrize("given_field", ["near_tie_margin", "maximum_changed_row_share"])
def test_one_teacher_forced_clause_alone_is_refused(given_field: str) -> None:
    with pytest.raises(ValidationError, match="both or neither"):
        BoundedDriftRule.model_validate({"maximum_absolute": 11.0, "maximum_mean_absolute": 1.25, given_field: 0.5})


@pytest.mark.parametrize("field", ["near_tie_margin", "maximum_changed_row_share"])
@pytest.mark.parametrize("value", [0.0, -0.5, math.nan, math.inf])
def test_a_teacher_forced_clause_that_is_not_finite_and_positive_is_refused(field: str, value: float) -> None:
    numbers = {"near_tie_margin": 0.5, "maximum_changed_row_share": 0.25} | {field: value}
    with pytest.raises(ValidationError, match=field):
        BoundedDriftRule.model_validate({"maximum_absolute": 11.0, "maximum_mean_absolute": 1.25, **numbers})


def test_an_exact_token_rule_is_written_without_the_teacher_forced_keys_and_a_teacher_forced_one_with_both() -> None:
    assert not RULE2.teacher_forced and RULE_TF.teacher_forced
    exact = RULE2.model_dump()
    assert "near_tie_margin" not in exact and "maximum_changed_row_share" not in exact
    assert "near_tie_margin" not in RULE2.model_dump_json()
    forced = RULE_TF.model_dump()
    assert forced["near_tie_margin"] == NEAR_TIE_MARGIN and forced["maximum_changed_row_share"] == SHARE_CEILING
    assert BoundedDriftRule.model_validate_json(RULE_TF.model_dump_json()) == RULE_TF
    assert BoundedDriftRule.model_validate_json(RULE2.model_dump_json()) == RULE2


# --------------------------------------------------------------------------- the sealed numbers follow from the basis

TF_FIELDS = ("maximum_absolute", "maximum_mean_absolute", "near_tie_margin", "maximum_changed_row_share")


def teacher_forced_basis() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A calibration whose lane parts at near-ties: three cells (one kept its tokens) and two anchors."""
    records = [parted(1, 2.0, 0.3, [(5, 0.2), (40, 0.1)]), parted(2, 3.0, 0.4, [(9, 0.4)]),
               calibration_record(3, 1.5, 0.05, output_tokens=TOKENS, max_row_mean_abs=0.25),
               parted(4, 2.5, 0.35, [(7, 0.3)]), parted(5, 2.5, 0.35, [(7, 0.3)])]
    return evidence(CELLS + ANCHORS), records


def derived_bounds() -> tuple[dict[str, Any], list[dict[str, Any]], TeacherForcedBounds]:
    document, records = teacher_forced_basis()
    cells, problems = calibration_cells(document, records)
    assert problems == [] and len(cells) == 3
    bounds = derive_teacher_forced_bounds(cells)
    assert bounds is not None
    return document, records, bounds


def problems_of(document: dict[str, Any], records: list[dict[str, Any]], bounds: TeacherForcedBounds) -> list[str]:
    return bound_problems(document, records, maximum_absolute=bounds.maximum_absolute,
                          maximum_mean_absolute=bounds.maximum_mean_absolute, acceptance_floor=None,
                          teacher_forced=bounds)


def test_the_four_numbers_the_rule_derives_follow_from_their_basis() -> None:
    document, records, bounds = derived_bounds()
    assert problems_of(document, records, bounds) == []
    # Per cell: (largest row max, largest row mean, largest parting margin, parted share); the cell
    # that kept its tokens counts its own rows, a margin of 0 and a share of 0.
    assert bounds.maximum_absolute == 3.0 + statistics.stdev([2.0, 3.0, 1.5])
    assert bounds.maximum_mean_absolute == 0.4 + statistics.stdev([0.3, 0.4, 0.25])
    assert bounds.near_tie_margin == 0.4 + statistics.stdev([0.2, 0.4, 0.0])
    assert bounds.maximum_changed_row_share == 2 / TOKENS + statistics.stdev([2 / TOKENS, 1 / TOKENS, 0.0])


@pytest.mark.parametrize("field", TF_FIELDS)
@pytest.mark.parametrize("direction", [math.inf, 0.0], ids=["one-ulp-up", "one-ulp-down"])
def test_a_sealed_number_one_ulp_off_its_derived_value_is_refused_naming_it(field: str, direction: float) -> None:
    document, records, bounds = derived_bounds()
    off = math.nextafter(getattr(bounds, field), direction)
    sealed = TeacherForcedBounds(**{name: getattr(bounds, name) for name in TF_FIELDS} | {field: off})
    problems = problems_of(document, records, sealed)
    assert len(problems) == 1
    assert problems[0].startswith(f"{field}: sealed {off!r}, the basis gives {getattr(bounds, field)!r}")
    assert TEACHER_FORCED_BOUND_RULE in problems[0]


def test_the_exact_token_bounds_given_beside_teacher_forced_numbers_are_not_what_is_checked() -> None:
    document, records, bounds = derived_bounds()
    assert bound_problems(document, records, maximum_absolute=1.0, maximum_mean_absolute=0.5,
                          acceptance_floor=None, teacher_forced=bounds) == []


def test_a_cell_without_its_teacher_forced_rows_leaves_the_numbers_underivable() -> None:
    document, records, bounds = derived_bounds()
    del records[2]["max_row_mean_abs"]  # a receipt from before the rule: the cell's rows are not recorded
    assert derive_teacher_forced_bounds(calibration_cells(document, records)[0]) is None
    problems = problems_of(document, records, bounds)
    assert len(problems) == 1 and TEACHER_FORCED_BOUND_RULE in problems[0]


def test_the_derived_rule_passes_the_basis_anchors() -> None:
    """The numbers a calibration seals make a rule its own fixture anchors pass."""
    _, records, bounds = derived_bounds()
    rule = bounds.rule()
    assert rule.output_tokens == TOKENS
    assert rule.teacher_forced
    for anchor in records[3:]:
        sample = rung2_record(anchor["repetition"], token_agreement_rate=anchor["token_agreement_rate"],
                              handoff_generated_token_sha256=HANDOFF_TOKENS_SHA, localisation=anchor["localisation"])
        assert judge_rung2_sample(sample, rule).passed


# --------------------------------------------------------------------------- edges the mutation gate named


def test_rows_read_at_zero_and_below_one_are_rows_not_absences() -> None:
    """A max of 0.5 and a row mean of 0 are measurements, on both paths (tokens exact, parted)."""
    assert judge_rung2_sample(exact_sample(max_abs=0.5, max_row_mean_abs=0.0), RULE_TF).passed
    assert judge_rung2_sample(exact_sample(max_abs=0.0, max_row_mean_abs=0.0, mean_abs=0.0), RULE_TF).passed
    assert judge_rung2_sample(parted_sample(row_max=0.5, row_mean=0.0, max_abs=0.5), RULE_TF).passed
    assert judge_rung2_sample(parted_sample(row_max=0.0, row_mean=0.0, max_abs=0.0, mean_abs=0.0), RULE_TF).passed


def test_a_parting_at_the_last_row_counts_and_one_past_it_is_refused() -> None:
    assert judge_rung2_sample(parted_sample(partings=[(TOKENS - 1, 0.25)]), RULE_TF).passed
    verdict = judge_rung2_sample(parted_sample(partings=[(TOKENS, 0.25)]), RULE_TF)
    assert not verdict.passed and "below output_tokens 256" in verdict.reasons[0]


def test_a_malformed_parting_is_named_by_its_first_80_characters() -> None:
    entry = {"row": "r" * 200, "cold_margin": 0.25}
    verdict = judge_rung2_sample(parted_sample() | {
        "localisation": {"teacher_forced": teacher(PARTINGS) | {"partings": [entry], "top1_flips": 1}}}, RULE_TF)
    assert not verdict.passed
    assert verdict.reasons[0].endswith(f"malformed entry {repr(entry)[:80]}")


def test_the_rows_clauses_alone_need_a_teacher_forced_rule_and_the_samples_own_token_count() -> None:
    with pytest.raises(TypeError, match="the teacher-forced clauses need a teacher-forced rule"):
        judge_teacher_forced_rows(parted_sample(), BoundedDriftRule(maximum_absolute=1.0, maximum_mean_absolute=0.5))
    for tokens in (None, 0, "256"):
        verdict = judge_teacher_forced_rows(parted_sample() | {"output_tokens": tokens}, RULE_TF)
        assert not verdict.passed and [c.name for c in verdict.checks if not c.passed][0] == "output tokens"
    assert judge_teacher_forced_rows(parted_sample(), RULE_TF).headline == "passed: teacher-forced: 2 partings, each a near-tie"
    assert judge_teacher_forced_rows(exact_sample(), RULE_TF).headline == "passed: teacher-forced: tokens exact"
    one_row = judge_teacher_forced_rows(exact_sample() | {"output_tokens": 1}, RULE_TF)  # one decoded row is enough
    assert one_row.headline == "passed: teacher-forced: tokens exact"
    crowded = parted_sample(partings=[(row, 0.25) for row in range(9)])  # 9 of 256: over the 8-row ceiling
    verdict = judge_teacher_forced_rows(crowded, RULE_TF)
    assert not verdict.passed and [c.name for c in verdict.checks if not c.passed] == ["parted rows"]


def test_near_tie_partings_of_a_record_that_is_no_mapping_are_unread() -> None:
    assert near_tie_partings(["not a record", parted_sample()], RULE_TF) is None
    assert near_tie_partings([parted_sample(), parted_sample(2, partings=[(3, 0.75)])], RULE_TF) == (2, 3)


def test_the_scope_document_carries_near_ties_and_all_partings_apart() -> None:
    scope = Scope("python-textwrap", 3, 2048, TOKENS, None, judged_by=TEACHER_FORCED_RULE, partings=(4, 5))
    assert scope_document(scope, False)["judged_by"] == {
        "rule": TEACHER_FORCED_RULE, "near_tie_partings": 4, "partings": 5}
    with pytest.raises(ValueError, match="^scope: rule 'two words'"):
        Scope("python-textwrap", 3, 2048, TOKENS, None, judged_by="two words")


def test_a_cells_token_count_must_be_a_whole_number_above_zero_for_its_share() -> None:
    document = evidence(CELLS[:2] + ANCHORS)
    good = [parted(1, 2.0, 0.3, [(0, 0.2)]), parted(2, 3.0, 0.4, [(0, 0.4)])]
    anchors = [parted(3, 2.5, 0.35, [(0, 0.3)]), parted(4, 2.5, 0.35, [(0, 0.3)])]
    one_row = [dict(record, output_tokens=1) for record in good]
    bounds = derive_teacher_forced_bounds(calibration_cells(document, one_row + anchors)[0])
    assert bounds is not None and bounds.maximum_changed_row_share == 1.0  # 1 of 1 row: capped at the whole
    half = [dict(good[0], output_tokens=1), dict(good[1], output_tokens=2)]
    bounds = derive_teacher_forced_bounds(calibration_cells(document, half + anchors)[0])
    assert bounds is not None and bounds.maximum_changed_row_share == 1.0  # 1.0 + sd, capped
    for tokens in (0, "256", None):
        unread = [dict(good[0], output_tokens=tokens), good[1]]
        assert derive_teacher_forced_bounds(calibration_cells(document, unread + anchors)[0]) is None

"""How the judge writes numbers and counts into its words, at the edges: a drift a hair inside or
outside its bound prints in full (never as the bound itself), a summary of no samples or of one
refused sample says so, repetitions are named by their own index, and evidence that is missing on
one side is not compared."""

from __future__ import annotations

import math

import pytest

from qualify.evidence.records import BitExactRule, BoundedDriftRule
from qualify.judge import judge_draft_acceptance, judge_rung2_sample, judge_rung3_sample, judge_summary
from qualify.judge.handoffs import _num
from tests.unit.judge.test_judge import RULE2, RULE3, rung2_record, rung3_record

BOUND, MEAN_BOUND = RULE2.maximum_absolute, RULE2.maximum_mean_absolute
HAIR_UNDER, MEAN_HAIR_UNDER = math.nextafter(BOUND, 0.0), math.nextafter(MEAN_BOUND, 0.0)
HAIR_OVER, MEAN_HAIR_OVER = math.nextafter(BOUND, math.inf), math.nextafter(MEAN_BOUND, math.inf)


def detail_of(verdict, name: str) -> tuple[bool, str]:
    (check,) = [check for check in verdict.checks if check.name == name]
    return check.passed, check.detail


@pytest.mark.parametrize(("value", "against", "words"), [
    (None, None, "none"), (True, None, "true"), (False, None, "false"), (7, None, "7"),
    (0.1 + 0.2, None, "0.3"), (BOUND, BOUND, "11"), (HAIR_UNDER, BOUND, repr(HAIR_UNDER)), (HAIR_UNDER, None, "11"),
])
def test_a_number_prints_short_unless_that_would_show_it_equal_to_its_bound(value, against, words):
    assert _num(value, against) == words


# --------------------------------------------------------------------------- a hair from the bound


def test_a_sample_a_hair_inside_both_bounds_shows_both_in_full() -> None:
    verdict = judge_rung2_sample(rung2_record(max_abs=HAIR_UNDER, mean_abs=MEAN_HAIR_UNDER), RULE2)
    words = f"max {HAIR_UNDER!r} <= 11, mean {MEAN_HAIR_UNDER!r} <= 1.25"
    assert verdict.passed
    assert detail_of(verdict, "bounded drift") == (True, f"bounded drift: {words}")
    assert verdict.headline == f"passed: tokens exact (256/256) and bounded drift: {words}"


def test_a_sample_a_hair_outside_both_bounds_shows_both_in_full() -> None:
    verdict = judge_rung2_sample(rung2_record(max_abs=HAIR_OVER, mean_abs=MEAN_HAIR_OVER), RULE2)
    assert detail_of(verdict, "bounded drift") == (False, (
        f"native full-logit drift exceeds its identity rule: max={HAIR_OVER!r}, mean={MEAN_HAIR_OVER!r} "
        "(rule: max <= 11, mean <= 1.25)"))


def test_a_summary_a_hair_inside_both_bounds_shows_the_worst_in_full() -> None:
    records = [rung2_record(1), rung2_record(2, max_abs=HAIR_UNDER), rung2_record(3, mean_abs=MEAN_HAIR_UNDER)]
    verdict = judge_summary(records, RULE2)
    assert verdict.passed, verdict.reasons
    assert detail_of(verdict, "bounded drift in every repetition") == (
        True, f"bounded drift: max {HAIR_UNDER!r} <= 11, mean {MEAN_HAIR_UNDER!r} <= 1.25 in every repetition")


def test_a_summary_a_hair_outside_both_bounds_shows_the_worst_in_full() -> None:
    records = [rung2_record(1), rung2_record(2, max_abs=HAIR_OVER), rung2_record(3, mean_abs=MEAN_HAIR_OVER)]
    assert detail_of(judge_summary(records, RULE2), "bounded drift in every repetition") == (
        False, "full-logit drift is not inside the identity rule in every repetition: "
        f"worst max={HAIR_OVER!r}, mean={MEAN_HAIR_OVER!r}")


# --------------------------------------------------------------------------- counts


def test_a_summary_of_no_samples_says_so_and_finds_no_exact_tokens() -> None:
    verdict = judge_summary([], RULE2)
    assert not verdict.passed
    assert detail_of(verdict, "samples") == (False, "no samples")
    assert "no samples" in verdict.reasons
    assert detail_of(verdict, "tokens exact in every repetition") == (
        False, "token agreement is not exactly 1.0 in every repetition")


def test_a_summary_counts_the_refused_samples_not_the_passing_ones() -> None:
    records = [rung2_record(1), rung2_record(2, max_abs=12.0), rung2_record(3)]
    assert detail_of(judge_summary(records, RULE2), "samples") == (False, "1 of 3 samples refused")


def test_a_one_repetition_rule_passes_its_one_sample() -> None:
    rule = BoundedDriftRule(maximum_absolute=BOUND, maximum_mean_absolute=MEAN_BOUND, repetitions=1)
    verdict = judge_summary([rung2_record(1)], rule)
    assert verdict.passed, verdict.reasons
    assert detail_of(verdict, "samples") == (True, "every sample passes its rung-2 judgement")


def test_a_repetition_index_of_true_is_no_repetition_1() -> None:
    verdict = judge_summary([rung2_record(True), rung2_record(2), rung2_record(3)], RULE2)
    assert detail_of(verdict, "repetitions") == (
        False, "repetition 1 missing; unexpected repetition index True")
    verdict = judge_summary([rung2_record(True), rung2_record(1), rung2_record(2), rung2_record(3)], RULE2)
    assert detail_of(verdict, "repetitions") == (
        False, "expected 3 repetitions, found 4; unexpected repetition index True")


def test_a_differing_repetition_is_named_by_its_own_index_not_its_place() -> None:
    records = [rung2_record(3), rung2_record(1), rung2_record(2, payload_sha256="9" * 64)]
    assert detail_of(judge_summary(records, RULE2), "payload digest across repetitions") == (
        False, "payload digest differs across repetitions (repetition 2 vs 3): output is not deterministic")


def test_a_rung3_summary_missing_its_acceptance_fails_without_a_headline_to_crash_on() -> None:
    records = [rung3_record(i) for i in (1, 2, 3)]
    for record in records:
        del record["draft_acceptance_rate"]
    verdict = judge_summary(records, RULE3)
    assert not verdict.passed and verdict.headline.startswith("failed: ")


def test_a_rung3_summary_headline_names_the_lowest_acceptance_against_its_floor() -> None:
    records = [rung3_record(1), rung3_record(2, draft_acceptance_rate=0.96), rung3_record(3)]
    verdict = judge_summary(records, RULE3)
    assert verdict.passed, verdict.reasons
    assert "acceptance 0.96 (floor 0.95)" in verdict.headline


# --------------------------------------------------------------------------- one sample's edges


def test_one_token_one_byte_and_one_position_are_counted_not_refused() -> None:
    verdict = judge_rung2_sample(
        rung2_record(output_tokens=1, payload_bytes=1, handed_off_positions=1, recomputed_positions=0), RULE2)
    assert detail_of(verdict, "output tokens") == (False, "decoded 1 tokens, rule requires 256")
    assert detail_of(verdict, "payload") == (True, "payload 1 bytes")
    assert detail_of(verdict, "handed-off positions") == (True, "1 positions handed off, 0 recomputed")
    assert verdict.reasons == ["decoded 1 tokens, rule requires 256"]


@pytest.mark.parametrize("missing", ["handoff_generated_token_sha256", "cold_generated_token_sha256"])
def test_a_generated_token_digest_missing_on_one_side_is_not_compared(missing) -> None:
    record = rung2_record()
    del record[missing]
    verdict = judge_rung2_sample(record, RULE2)
    assert not verdict.passed
    assert "generated-token digest" not in [check.name for check in verdict.checks]


@pytest.mark.parametrize(("judge", "rule"), [(judge_rung2_sample, RULE2), (judge_rung3_sample, RULE3),
                                             (judge_rung3_sample, BitExactRule(acceptance_floor=None))])
def test_a_record_of_another_schema_or_type_fails_its_record_check(judge, rule) -> None:
    assert detail_of(judge(rung2_record(schema="other"), rule), "record")[0] is False
    assert detail_of(judge(["not", "a", "record"], rule), "record") == (False, "sample is not a record: list")


def test_a_record_carrying_an_error_fails_its_error_check() -> None:
    verdict = judge_rung2_sample(rung2_record(error="producer  went\naway"), RULE2)
    assert detail_of(verdict, "error") == (False, "sample failed: producer went away")


def test_every_omitted_and_every_invalid_field_is_named_in_one_detail() -> None:
    record = rung2_record(token_agreement_rate=2.0, payload_gbit_per_s=-1.0)
    del record["max_abs"], record["mean_abs"]
    verdict = judge_rung2_sample(record, RULE2)
    assert detail_of(verdict, "evidence") == (False, "sample omits max_abs; sample omits mean_abs")
    assert detail_of(verdict, "values") == (
        False, "sample payload_gbit_per_s is -1, below 0; sample token_agreement_rate is 2, above 1")


def test_a_repetition_index_below_1_is_an_invalid_value() -> None:
    verdict = judge_rung2_sample(rung2_record(repetition=0), RULE2)
    assert detail_of(verdict, "values") == (False, "sample repetition is 0, below 1")


def test_draft_acceptance_refuses_a_count_naming_what_it_expected() -> None:
    verdict = judge_draft_acceptance({"b": {"proposed": 10, "accepted": 11}}, proposal_tokens=4)
    assert verdict.reasons == ["document b: found proposed 10, accepted 11; expected whole counts with "
                               "0 <= accepted <= proposed and at least one proposed token"]


@pytest.mark.parametrize(("localisation", "words"), [
    ({"first_divergence_position": 3}, "first divergence at token 3"),
    ({"first_divergence_position": 3, "divergence_class": "other"}, "first divergence at token 3"),
    ({"first_divergence_position": True}, ""),
    ({"first_rule_breaking_row": 7}, ""),
])
def test_a_token_divergence_is_located_only_by_its_own_position(localisation, words) -> None:
    verdict = judge_rung2_sample(rung2_record(token_agreement_rate=0.5, localisation=localisation), RULE2)
    passed, detail = detail_of(verdict, "tokens exact")
    assert not passed and detail.startswith("tokens diverge: agreement 0.5 (128/256)")
    assert detail.removeprefix("tokens diverge: agreement 0.5 (128/256)") == (f"; {words}" if words else "")


@pytest.mark.parametrize(("localisation", "words"), [
    ({"first_rule_breaking_row": 7}, "; first rule-breaking logit row 7"),
    ({"first_rule_breaking_row": False}, ""),
    ({"first_divergence_position": 3}, ""),
])
def test_a_drift_over_its_bound_is_located_only_by_its_rule_breaking_row(localisation, words) -> None:
    verdict = judge_rung2_sample(rung2_record(max_abs=12.0, localisation=localisation), RULE2)
    assert detail_of(verdict, "bounded drift")[1].endswith("(rule: max <= 11, mean <= 1.25)" + words)

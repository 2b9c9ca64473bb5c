"""The words a receipt shows for a judgement, check by check: each check's name, outcome and detail
for a passing sample, a sample failing every check at once, boundary values, and the summary over
repetitions (complete, broken, empty, single). A receipt's reader sees exactly these lines."""

from __future__ import annotations

import pytest

from qualify.evidence.records import BitExactRule, BoundedDriftRule
from qualify.judge import judge_sample, judge_summary
from tests.test_judge import RULE2, RULE3, rung2_record, rung3_record

PASSING_SAMPLE_CHECKS = [
    ("evidence", True, "every required field present"),
    ("values", True, "every value finite and well-formed"),
    ("output tokens", True, "decoded 256 tokens"),
    ("tokens exact", True, "tokens exact: 256/256"),
    ("generated-token digest", True, "generated-token digest equals the cold run's"),
    ("payload", True, f"payload {8 * 1024 * 1024} bytes"),
    ("handed-off positions", True, "2047 positions handed off, 0 recomputed"),
    ("bounded drift", True, "bounded drift: max 10.884401 <= 11, mean 1.233789 <= 1.25"),
]


def checks_of(verdict) -> list[tuple[str, bool, str]]:
    return [(check.name, check.passed, check.detail) for check in verdict.checks]


def test_a_passing_rung2_sample_shows_each_check_passed_in_words() -> None:
    verdict = judge_sample(rung2_record(), RULE2)
    assert checks_of(verdict) == PASSING_SAMPLE_CHECKS
    assert verdict.reasons == [detail for _, _, detail in PASSING_SAMPLE_CHECKS]


def test_a_sample_failing_every_check_names_each_failure_and_where_it_diverged() -> None:
    record = rung2_record(
        output_tokens=255, token_agreement_rate=0.5, cold_generated_token_sha256="7" * 64, payload_bytes=0,
        handed_off_positions=0, max_abs=12.0,
        localisation={"first_divergence_position": 3, "cold_margin_at_divergence": 0.25,
                      "divergence_class": "near-tie", "first_rule_breaking_row": 7},
    )
    failures = [
        ("output tokens", False, "decoded 255 tokens, rule requires 256"),
        ("tokens exact", False,
         "tokens diverge: agreement 0.5 (128/255); first divergence at token 3, cold margin 0.25 (near-tie)"),
        ("generated-token digest", False, "generated-token digest differs from the cold run's"),
        ("payload", False, "payload is empty (0 bytes)"),
        ("handed-off positions", False, "no positions handed off: the handoff qualified nothing"),
        ("bounded drift", False,
         "native full-logit drift exceeds its identity rule: max=12, mean=1.233789 "
         "(rule: max <= 11, mean <= 1.25); first rule-breaking logit row 7"),
    ]
    verdict = judge_sample(record, RULE2)
    assert checks_of(verdict) == PASSING_SAMPLE_CHECKS[:2] + failures
    assert verdict.reasons == [detail for _, _, detail in failures]
    assert verdict.headline == "failed: decoded 255 tokens, rule requires 256 (and 5 more)"


def test_omitted_and_malformed_values_are_named_together_and_the_rest_still_judged() -> None:
    record = rung2_record(mean_abs=float("nan"))
    del record["max_abs"]
    verdict = judge_sample(record, RULE2)
    assert checks_of(verdict)[:2] == [
        ("evidence", False, "sample omits max_abs"),
        ("values", False, "sample mean_abs is not finite: nan"),
    ]
    assert checks_of(verdict)[2:] == PASSING_SAMPLE_CHECKS[2:7]  # no drift check without both deltas
    assert verdict.reasons == ["sample omits max_abs", "sample mean_abs is not finite: nan"]


@pytest.mark.parametrize(("field", "smallest"), [("payload_bytes", 1), ("handed_off_positions", 1)])
def test_one_byte_or_one_handed_off_position_is_enough(field: str, smallest: int) -> None:
    verdict = judge_sample(rung2_record(**{field: smallest}), RULE2)
    assert verdict.passed, verdict.reasons


@pytest.mark.parametrize(
    ("field", "value"),
    [("output_tokens", 0), ("repetition", 0), ("token_agreement_rate", -0.001), ("token_agreement_rate", 1.001),
     ("payload_gbit_per_s", -0.001), ("max_abs", -0.001), ("mean_abs", -0.001), ("recomputed_positions", -1)],
)
def test_a_value_out_of_its_range_fails_the_values_check_naming_it(field: str, value: float) -> None:
    verdict = judge_sample(rung2_record(**{field: value}), RULE2)
    values = dict((name, (passed, detail)) for name, passed, detail in checks_of(verdict))["values"]
    assert values[0] is False and field in values[1], values


@pytest.mark.parametrize(("field", "value"), [("payload_gbit_per_s", 0.0), ("token_agreement_rate", 0.0)])
def test_zero_is_inside_a_range_that_starts_at_zero(field: str, value: float) -> None:
    checks = dict((name, passed) for name, passed, _ in checks_of(judge_sample(rung2_record(**{field: value}), RULE2)))
    assert checks["values"] is True


@pytest.mark.parametrize("rate", [-0.001, 1.001])
def test_a_draft_acceptance_rate_outside_0_to_1_is_malformed(rate: float) -> None:
    verdict = judge_sample(rung3_record(draft_acceptance_rate=rate), RULE3)
    values = dict((name, (passed, detail)) for name, passed, detail in checks_of(verdict))["values"]
    assert values[0] is False and "draft_acceptance_rate" in values[1], values


def test_token_words_without_a_token_count_give_no_counts() -> None:
    exact = checks_of(judge_sample(rung2_record(output_tokens="256"), RULE2))
    diverged = checks_of(judge_sample(rung2_record(output_tokens="256", token_agreement_rate=0.5), RULE2))
    assert ("tokens exact", True, "tokens exact") in exact
    assert ("tokens exact", False, "tokens diverge: agreement 0.5") in diverged
    assert not any(name == "output tokens" for name, _, _ in exact)


SUMMARY_DIGESTS = ("generated-token digest", "payload digest", "payload size", "handoff logit block digest",
                   "cold generated-token digest", "cold logit block digest")


def test_a_passing_summary_shows_each_check_and_its_headline() -> None:
    verdict = judge_summary([rung2_record(i) for i in (1, 2, 3)], RULE2)
    drift = "bounded drift: max 10.884401 <= 11, mean 1.233789 <= 1.25 in every repetition"
    assert checks_of(verdict) == [
        ("repetitions", True, "3/3 repetitions present"),
        ("samples", True, "every sample passes its rung-2 judgement"),
        ("tokens exact in every repetition", True, "token agreement exactly 1.0 in every repetition"),
        ("bounded drift in every repetition", True, drift),
        *((f"{words} across repetitions", True, f"{words} equal across 3 repetitions") for words in SUMMARY_DIGESTS),
    ]
    assert verdict.headline == (f"passed: 3/3 handoffs with exact tokens and {drift}; "
                                "generated-token and payload digests equal across repetitions")


def test_a_single_repetition_summary_passes_when_its_rule_asks_for_one() -> None:
    rule = BoundedDriftRule(maximum_absolute=11.0, maximum_mean_absolute=1.25, repetitions=1)
    verdict = judge_summary([rung2_record(1)], rule)
    assert verdict.passed, verdict.reasons
    assert verdict.headline.startswith("passed: 1/1 handoffs with exact tokens and bounded drift: max 10.884401 <= 11")


def test_a_rung3_summary_headline_states_the_measured_acceptance_against_its_floor() -> None:
    records = [rung3_record(1, draft_acceptance_rate=0.99), rung3_record(2), rung3_record(3, draft_acceptance_rate=0.98)]
    verdict = judge_summary(records, RULE3)
    assert verdict.headline == (
        "passed: 3/3 handoffs bit-exact: tokens, full logits (digests equal, deltas 0), draft tokens and trace equal, "
        "acceptance 0.97 (floor 0.95); digests equal across repetitions"
    )
    names = [name for name, _, _ in checks_of(verdict)]
    assert names[-2:] == ["draft tokens digest across repetitions", "draft trace digest across repetitions"]


def test_a_draftless_rung3_summary_names_no_acceptance_and_no_draft_digests() -> None:
    rule = BitExactRule(acceptance_floor=None)
    verdict = judge_summary([rung3_record(i) for i in (1, 2, 3)], rule)
    assert verdict.headline == ("passed: 3/3 handoffs bit-exact: tokens, full logits (digests equal, deltas 0); "
                                "digests equal across repetitions")
    assert not any("draft" in name for name, _, _ in checks_of(verdict))


def test_a_broken_summary_names_count_gaps_strays_and_each_refused_repetition() -> None:
    records = [rung2_record(1), rung2_record(2, token_agreement_rate=0.5, max_abs=12.0), rung2_record(5), "x"]
    verdict = judge_summary(records, RULE2)
    checks = checks_of(verdict)
    assert checks[:4] == [
        ("repetitions", False, "expected 3 repetitions, found 4; repetition 3 missing; unexpected repetition index 5, None"),
        ("samples", False, "2 of 4 samples refused"),
        ("tokens exact in every repetition", False, "token agreement is not exactly 1.0 in every repetition"),
        ("bounded drift in every repetition", False,
         "full-logit drift is not inside the identity rule in every repetition"),
    ]
    assert verdict.reasons[:6] == [
        "expected 3 repetitions, found 4",
        "repetition 3 missing",
        "unexpected repetition index 5, None",
        "repetition 2: tokens diverge: agreement 0.5 (128/256)",
        "repetition 2: native full-logit drift exceeds its identity rule: max=12, mean=1.233789 "
        "(rule: max <= 11, mean <= 1.25)",
        "repetition #4: sample is not a record: str",
    ]


def test_a_repetition_seen_twice_is_named_with_its_count() -> None:
    verdict = judge_summary([rung2_record(1), rung2_record(1), rung2_record(3)], RULE2)
    assert checks_of(verdict)[0] == ("repetitions", False, "repetition 1 appears 2 times; repetition 2 missing")


def test_a_summary_drifting_outside_its_rule_names_the_worst_values() -> None:
    records = [rung2_record(1), rung2_record(2, max_abs=12.5), rung2_record(3, mean_abs=1.5)]
    checks = dict((name, (passed, detail)) for name, passed, detail in checks_of(judge_summary(records, RULE2)))
    assert checks["bounded drift in every repetition"] == (
        False, "full-logit drift is not inside the identity rule in every repetition: worst max=12.5, mean=1.5")


def test_an_empty_summary_says_no_samples() -> None:
    verdict = judge_summary([], RULE2)
    assert checks_of(verdict)[:2] == [
        ("repetitions", False,
         "expected 3 repetitions, found 0; repetition 1 missing; repetition 2 missing; repetition 3 missing"),
        ("samples", False, "no samples"),
    ]
    assert "no samples" in verdict.reasons
    assert all(detail == f"{words} missing" for (_, _, detail), words in zip(checks_of(verdict)[4:], SUMMARY_DIGESTS,
                                                                                 strict=True))

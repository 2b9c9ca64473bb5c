"""Every judging rule of qualify.judge, one record per refusal path."""

from __future__ import annotations

import copy
import math
import subprocess
import sys
from typing import Any

import pytest

from qualify.evidence.records import (
    PHASE_FIELDS,
    REQUIRED_SAMPLE_FIELDS,
    RUNG3_DRAFT_FIELDS,
    SAMPLE_SCHEMA,
    BitExactRule,
    BoundedDriftRule,
    parse_rule,
)
from qualify.judge import (
    Check,
    Verdict,
    judge_draft_acceptance,
    judge_failed_step,
    judge_incomplete,
    judge_qualification,
    judge_refused,
    judge_reproduction,
    judge_rung2_sample,
    judge_rung3_sample,
    judge_sample,
    judge_summary,
)

RULE2 = BoundedDriftRule(maximum_absolute=11.0, maximum_mean_absolute=1.25)
RULE3 = BitExactRule(acceptance_floor=0.95)
TOKENS_SHA = "1" * 64
LOGITS_HANDOFF_SHA = "2" * 64
LOGITS_COLD_SHA = "3" * 64
PAYLOAD_SHA = "4" * 64
DRAFT_SHA = "5" * 64
TRACE_SHA = "6" * 64

NUMERIC_FIELDS = ("token_agreement_rate", "max_abs", "mean_abs", "payload_gbit_per_s", *PHASE_FIELDS)


def rung2_record(repetition: int = 1, **changes) -> dict:
    """A passing rung-2 sample as read back from its receipt JSON."""
    record = {
        "schema": SAMPLE_SCHEMA,
        "repetition": repetition,
        "output_tokens": 256,
        "token_agreement_rate": 1.0,
        "max_abs": 10.884401,
        "mean_abs": 1.233789,
        "handoff_generated_token_sha256": TOKENS_SHA,
        "cold_generated_token_sha256": TOKENS_SHA,
        "handoff_logit_block_sha256": LOGITS_HANDOFF_SHA,
        "cold_logit_block_sha256": LOGITS_COLD_SHA,
        "logit_row_digests_equal": False,
        "first_logit_digest_mismatch_row": 0,
        "payload_sha256": PAYLOAD_SHA,
        "payload_bytes": 8 * 1024 * 1024,
        "payload_gbit_per_s": 6.866,
        "handed_off_positions": 2047,
        "recomputed_positions": 0,
        **{name: 0.1 for name in PHASE_FIELDS},
        "localisation": None,
        "error": None,
    }
    record.update(changes)
    return record


def rung3_record(repetition: int = 1, **changes) -> dict:
    """A passing rung-3 (bit-exact) sample."""
    record = rung2_record(
        repetition,
        max_abs=0.0,
        mean_abs=0.0,
        handoff_logit_block_sha256=LOGITS_COLD_SHA,
        logit_row_digests_equal=True,
        first_logit_digest_mismatch_row=None,
        handoff_draft_tokens_sha256=DRAFT_SHA,
        cold_draft_tokens_sha256=DRAFT_SHA,
        handoff_draft_trace_sha256=TRACE_SHA,
        cold_draft_trace_sha256=TRACE_SHA,
        draft_acceptance_rate=0.97,
        localisation={"kv_layer_max_abs": [
            {"layer": layer, "k": 0.0, "v": 0.0, "k_position": None, "v_position": None} for layer in range(4)
        ]},
    )
    record.update(changes)
    return record


def texts(verdict) -> list[str]:
    return [verdict.headline, *verdict.reasons, *(check.detail for check in verdict.checks)]


def assert_never_zero_drift(verdict) -> None:
    assert not any("zero drift" in text for text in texts(verdict))


# --------------------------------------------------------------------------- rung 2, per sample


def test_good_rung2_sample_passes_with_bounded_drift_wording():
    verdict = judge_sample(rung2_record(), RULE2)
    assert verdict.passed, verdict.reasons
    assert verdict.headline == ("passed: tokens exact (256/256) and bounded drift: max 10.884401 <= 11, "
                                "mean 1.233789 <= 1.25")
    assert_never_zero_drift(verdict)
    assert not any("bit-exact" in text for text in texts(verdict))


def test_rung2_never_says_zero_drift_even_when_the_deltas_are_zero():
    verdict = judge_sample(rung2_record(max_abs=0.0, mean_abs=0.0), RULE2)
    assert verdict.passed
    assert "bounded drift: max 0 <= 11, mean 0 <= 1.25" in verdict.headline
    assert_never_zero_drift(verdict)


@pytest.mark.parametrize("field", REQUIRED_SAMPLE_FIELDS)
@pytest.mark.parametrize("how", ["absent", "null"])
def test_each_omitted_field_is_refused(field, how):
    record = rung2_record()
    if how == "absent":
        del record[field]
    else:
        record[field] = None
    verdict = judge_sample(record, RULE2)
    assert not verdict.passed
    assert f"sample omits {field}" in verdict.reasons


def test_every_omission_is_listed_separately():
    record = rung2_record()
    for field in ("max_abs", "mean_abs", "transport_s"):
        del record[field]
    reasons = judge_sample(record, RULE2).reasons
    assert {"sample omits max_abs", "sample omits mean_abs", "sample omits transport_s"} <= set(reasons)


@pytest.mark.parametrize("field", NUMERIC_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "NaN", "Infinity", "-Infinity"])
def test_non_finite_values_are_refused(field, value):
    verdict = judge_sample(rung2_record(**{field: value}), RULE2)
    assert not verdict.passed
    assert any(reason.startswith(f"sample {field} is not finite") for reason in verdict.reasons), verdict.reasons


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("max_abs", True, "is not a number"),
        ("max_abs", "10.0", "is not a number"),
        ("mean_abs", -0.1, "below 0"),
        ("token_agreement_rate", 1.5, "above 1"),
        ("payload_bytes", 12.0, "is not a whole number"),
        ("payload_bytes", -1, "below 0"),
        ("repetition", 0, "below 1"),
        ("payload_sha256", "ABC", "is not a SHA-256 hex digest"),
        ("cold_generated_token_sha256", "A" * 64, "is not a SHA-256 hex digest"),
        ("transport_s", -0.5, "below 0"),
    ],
)
def test_malformed_values_are_refused(field, value, words):
    verdict = judge_sample(rung2_record(**{field: value}), RULE2)
    assert not verdict.passed
    assert any(reason.startswith(f"sample {field}") and words in reason for reason in verdict.reasons), verdict.reasons


@pytest.mark.parametrize(
    ("maximum", "mean"),
    [(11.000001, 1.0), (10.0, 1.2500001), (12.0, 2.0)],
    ids=["max-over", "mean-over", "both-over"],
)
def test_drift_above_the_rule_is_refused_with_the_values(maximum, mean):
    verdict = judge_sample(rung2_record(max_abs=maximum, mean_abs=mean), RULE2)
    assert not verdict.passed
    [reason] = [r for r in verdict.reasons if "drift exceeds" in r]
    assert reason == (
        f"native full-logit drift exceeds its identity rule: max={maximum:.9g}, mean={mean:.9g} "
        f"(rule: max <= 11, mean <= 1.25)"
    )


def test_drift_exactly_at_the_bounds_passes():
    assert judge_sample(rung2_record(max_abs=11.0, mean_abs=1.25), RULE2).passed


def test_a_value_a_hair_above_the_bound_never_prints_as_equal():
    hair = math.nextafter(1.25, 2.0)
    reason = next(r for r in judge_sample(rung2_record(mean_abs=hair), RULE2).reasons if "drift exceeds" in r)
    assert f"mean={hair!r}" in reason


def test_token_divergence_is_refused_with_its_localisation():
    record = rung2_record(
        token_agreement_rate=0.75,
        handoff_generated_token_sha256="9" * 64,
        localisation={
            "first_divergence_position": 64,
            "cold_margin_at_divergence": 0.02,
            "divergence_class": "near-tie",
            "first_rule_breaking_row": None,
        },
    )
    verdict = judge_sample(record, RULE2)
    assert not verdict.passed
    assert ("tokens diverge: agreement 0.75 (192/256); first divergence at token 64, cold margin 0.02 (near-tie)"
            in verdict.reasons)
    assert "generated-token digest differs from the cold run's" in verdict.reasons


def test_generated_token_digest_must_match_the_cold_run():
    verdict = judge_sample(rung2_record(handoff_generated_token_sha256="9" * 64), RULE2)
    assert verdict.reasons == ["generated-token digest differs from the cold run's"]


def test_failed_sample_is_refused_with_the_producer_message():
    record = {"schema": SAMPLE_SCHEMA, "repetition": 2, "error": "producer exited 75:\n watchdog fired"}
    verdict = judge_sample(record, RULE2)
    assert not verdict.passed
    assert verdict.reasons == ["sample failed: producer exited 75: watchdog fired"]


@pytest.mark.parametrize(
    ("changes", "check"),
    [
        ({"output_tokens": 255}, "output tokens"),
        ({"payload_bytes": 0}, "payload"),
        ({"handed_off_positions": 0}, "handed-off positions"),
    ],
)
def test_other_sample_refusals(changes, check):
    """Each defect fails its own check and no other (the words are in tests/golden/judge.handoffs.txt)."""
    verdict = judge_sample(rung2_record(**changes), RULE2)
    assert not verdict.passed
    assert [found.name for found in verdict.checks if not found.passed] == [check]
    assert len(verdict.reasons) == 1


def test_a_record_of_another_schema_is_refused() -> None:
    verdict = judge_sample(rung2_record(schema="other"), RULE2)
    assert not verdict.passed and len(verdict.reasons) == 1


def test_not_a_record_is_refused():
    assert not judge_sample(["max_abs", 1.0], RULE2).passed


def test_rung2_without_drift_graded_refuses_the_first_logit_digest_mismatch():
    rule = BoundedDriftRule(maximum_absolute=11.0, maximum_mean_absolute=1.25, drift_graded=False)
    verdict = judge_sample(rung2_record(first_logit_digest_mismatch_row=7), rule)
    assert "logit digest mismatch at row 7" in verdict.reasons
    record = rung2_record()
    del record["first_logit_digest_mismatch_row"]
    assert "sample omits first_logit_digest_mismatch_row" in judge_sample(record, rule).reasons


# --------------------------------------------------------------------------- rung 2, summary


def three(factory=rung2_record, **changes):
    return [factory(repetition, **changes) for repetition in (1, 2, 3)]


def test_summary_passes_three_good_repetitions():
    verdict = judge_summary(three(), RULE2)
    assert verdict.passed, verdict.reasons
    assert verdict.headline.startswith(
        "passed: 3/3 handoffs with exact tokens and bounded drift: max 10.884401 <= 11, mean 1.233789 <= 1.25"
    )
    assert_never_zero_drift(verdict)
    assert {check.name for check in verdict.checks} >= {
        "repetitions", "samples", "tokens exact in every repetition", "bounded drift in every repetition",
        "generated-token digest across repetitions", "payload digest across repetitions",
    }


def test_summary_reports_the_worst_repetition():
    records = three()
    records[1]["max_abs"] = 10.95
    records[2]["mean_abs"] = 1.24
    assert "max 10.95 <= 11, mean 1.24 <= 1.25" in judge_summary(records, RULE2).headline


@pytest.mark.parametrize(
    ("records", "reason"),
    [
        (three()[:2], "expected 3 repetitions, found 2"),
        (three()[:2], "repetition 3 missing"),
        ([rung2_record(1), rung2_record(1), rung2_record(3)], "repetition 1 appears 2 times"),
        ([*three(), rung2_record(4)], "unexpected repetition index 4"),
        ([], "no samples"),
    ],
)
def test_summary_requires_exactly_the_repetitions(records, reason):
    verdict = judge_summary(records, RULE2)
    assert not verdict.passed and reason in verdict.reasons


@pytest.mark.parametrize("field", REQUIRED_SAMPLE_FIELDS)
def test_summary_refuses_a_repetition_that_omits_a_field(field):
    records = three()
    del records[1][field]
    verdict = judge_summary(records, RULE2)
    assert not verdict.passed
    assert f"repetition 2: sample omits {field}" in verdict.reasons or (
        field == "repetition" and "repetition 2 missing" in verdict.reasons
    )


def test_summary_refuses_token_divergence_in_one_repetition():
    records = three()
    records[2]["token_agreement_rate"] = 0.99609375
    verdict = judge_summary(records, RULE2)
    assert "token agreement is not exactly 1.0 in every repetition" in verdict.reasons


def test_summary_refuses_drift_outside_the_rule_in_one_repetition():
    records = three()
    records[0]["max_abs"] = 11.5
    verdict = judge_summary(records, RULE2)
    assert not verdict.passed
    assert any(r.startswith("repetition 1: native full-logit drift exceeds its identity rule: max=11.5")
               for r in verdict.reasons)
    assert ("full-logit drift is not inside the identity rule in every repetition: worst max=11.5, mean=1.233789"
            in verdict.reasons)


@pytest.mark.parametrize(
    ("field", "words"),
    [
        ("payload_sha256", "payload digest"),
        ("handoff_logit_block_sha256", "handoff logit block digest"),
        ("cold_logit_block_sha256", "cold logit block digest"),
    ],
)
def test_summary_requires_deterministic_digests(field, words):
    records = three()
    records[2][field] = "f" * 64
    verdict = judge_summary(records, RULE2)
    assert not verdict.passed
    assert f"{words} differs across repetitions (repetition 3 vs 1): output is not deterministic" in verdict.reasons


def test_summary_requires_equal_generated_token_digests_across_repetitions():
    records = three()
    records[1]["handoff_generated_token_sha256"] = records[1]["cold_generated_token_sha256"] = "8" * 64
    verdict = judge_summary(records, RULE2)
    assert ("generated-token digest differs across repetitions (repetition 2 vs 1): output is not deterministic"
            in verdict.reasons)


def test_summary_refuses_a_missing_generated_token_digest():
    records = three()
    records[0]["handoff_generated_token_sha256"] = None
    verdict = judge_summary(records, RULE2)
    assert "generated-token digest missing in repetition 1" in verdict.reasons


def test_summary_refuses_payload_size_changes():
    records = three()
    records[1]["payload_bytes"] = 1
    assert ("payload size differs across repetitions (repetition 2 vs 1): output is not deterministic"
            in judge_summary(records, RULE2).reasons)


def test_summary_accepts_models_and_rule_dicts():
    verdict = judge_summary(three(), RULE2.model_dump())
    assert verdict.passed
    assert parse_rule({"rung": 2, "maximum_absolute": 1.0, "maximum_mean_absolute": 0.5}).repetitions == 3


# --------------------------------------------------------------------------- rung 3


def test_good_rung3_sample_is_bit_exact():
    verdict = judge_sample(rung3_record(), RULE3)
    assert verdict.passed, verdict.reasons
    assert "bit-exact" in verdict.headline
    assert "draft acceptance 0.97 >= floor 0.95" in verdict.reasons


def test_rung3_refuses_the_first_logit_digest_mismatch():
    record = rung3_record(
        logit_row_digests_equal=False, first_logit_digest_mismatch_row=5,
        handoff_logit_block_sha256=LOGITS_HANDOFF_SHA, max_abs=0.001, mean_abs=1e-7,
    )
    verdict = judge_rung3_sample(record, RULE3)
    assert not verdict.passed
    assert verdict.reasons == ["logit digest mismatch at row 5"]


def test_rung3_drift_graded_reports_the_deltas():
    record = rung3_record(
        logit_row_digests_equal=False, first_logit_digest_mismatch_row=5,
        handoff_logit_block_sha256=LOGITS_HANDOFF_SHA, max_abs=0.001, mean_abs=1e-7,
    )
    rule = BitExactRule(acceptance_floor=0.95, drift_graded=True)
    verdict = judge_rung3_sample(record, rule)
    assert not verdict.passed
    assert ("full logits differ: max=0.001, mean=1e-07 (bit-exact requires 0); logit digest mismatch at row 5"
            in verdict.reasons)
    assert "logit digest mismatch at row 5" in verdict.reasons


def test_rung3_refuses_nonzero_deltas_despite_equal_digests():
    verdict = judge_rung3_sample(rung3_record(max_abs=1e-6), RULE3)
    assert "full logits not bit-exact despite equal digests: max=1e-06, mean=0" in verdict.reasons


def test_rung3_refuses_block_digest_mismatch_even_if_rows_claim_equal():
    verdict = judge_rung3_sample(rung3_record(handoff_logit_block_sha256=LOGITS_HANDOFF_SHA), RULE3)
    assert not verdict.passed
    assert any("block digests differ" in r for r in verdict.reasons)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"handoff_draft_tokens_sha256": "7" * 64}, "draft tokens differ from the cold run's"),
        ({"cold_draft_trace_sha256": "7" * 64}, "draft trace differs from the cold run's"),
        ({"draft_acceptance_rate": 0.94}, "draft acceptance 0.94 is below the sealed floor 0.95"),
        ({"token_agreement_rate": 0.5}, "tokens diverge: agreement 0.5 (128/256)"),
    ],
)
def test_rung3_refusals(changes, reason):
    verdict = judge_rung3_sample(rung3_record(**changes), RULE3)
    assert not verdict.passed and reason in verdict.reasons


def test_rung3_acceptance_at_the_floor_passes():
    assert judge_rung3_sample(rung3_record(draft_acceptance_rate=0.95), RULE3).passed


@pytest.mark.parametrize("field", [*REQUIRED_SAMPLE_FIELDS, *RUNG3_DRAFT_FIELDS, "logit_row_digests_equal"])
def test_rung3_refuses_each_omitted_field(field):
    record = rung3_record()
    del record[field]
    verdict = judge_rung3_sample(record, RULE3)
    assert not verdict.passed and f"sample omits {field}" in verdict.reasons


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_rung3_refuses_a_row_digest_flag_that_is_not_true_or_false(value):
    """A flag the judge cannot read as true or false is invalid evidence, never truthy."""
    verdict = judge_rung3_sample(rung3_record(logit_row_digests_equal=value), RULE3)
    assert not verdict.passed and any("logit_row_digests_equal" in reason for reason in verdict.reasons)


def test_rung3_requires_the_mismatch_row_key_to_be_present():
    record = rung3_record()
    del record["first_logit_digest_mismatch_row"]
    assert "sample omits first_logit_digest_mismatch_row" in judge_rung3_sample(record, RULE3).reasons


def test_rung3_row_digest_lists_must_agree_with_the_reported_mismatch():
    rows = ["a" * 64] * 256
    consistent = rung3_record(handoff_logit_row_sha256=rows, cold_logit_row_sha256=rows)
    assert judge_rung3_sample(consistent, RULE3).passed
    other = list(rows)
    other[9] = "b" * 64
    lying = rung3_record(handoff_logit_row_sha256=rows, cold_logit_row_sha256=other)
    verdict = judge_rung3_sample(lying, RULE3)
    assert "recorded row digests disagree with the reported first mismatch (rows say 9)" in verdict.reasons


def test_rung3_without_a_declared_draft_skips_only_the_draft_checks():
    rule = BitExactRule(acceptance_floor=None)
    record = rung3_record()
    for field in RUNG3_DRAFT_FIELDS:
        del record[field]
    verdict = judge_rung3_sample(record, rule)
    assert verdict.passed and "no speculative draft declared by the identity" in verdict.reasons


def test_rung3_summary():
    assert judge_summary(three(rung3_record), RULE3).passed
    records = three(rung3_record)
    records[2]["handoff_draft_trace_sha256"] = records[2]["cold_draft_trace_sha256"] = "e" * 64
    verdict = judge_summary(records, RULE3)
    assert ("draft trace digest differs across repetitions (repetition 3 vs 1): output is not deterministic"
            in verdict.reasons)
    records = three(rung3_record)
    records[0].update(logit_row_digests_equal=False, first_logit_digest_mismatch_row=0,
                      handoff_logit_block_sha256=LOGITS_HANDOFF_SHA)
    assert "repetition 1: logit digest mismatch at row 0" in judge_summary(records, RULE3).reasons


def test_wrong_rule_type_is_a_programming_error():
    with pytest.raises(TypeError):
        judge_rung2_sample(rung2_record(), RULE3)
    with pytest.raises(TypeError):
        judge_rung3_sample(rung3_record(), RULE2)


def test_judging_does_not_mutate_records():
    records = three()
    before = copy.deepcopy(records)
    judge_summary(records, RULE2)
    assert records == before


def test_rung3_refuses_kv_that_differs_from_the_consumers_prefill_even_with_exact_logits():
    record = rung3_record()
    record["localisation"]["kv_layer_max_abs"][2] = {"layer": 2, "k": 5e-8, "v": 0.0, "k_position": 1000,
                                                     "v_position": None}
    verdict = judge_rung3_sample(record, RULE3)
    assert not verdict.passed
    assert any("layer 2 K" in reason and "position 1000" in reason for reason in verdict.reasons)


def test_rung3_refuses_a_sample_without_kv_evidence():
    record = rung3_record(localisation=None)
    verdict = judge_rung3_sample(record, RULE3)
    assert not verdict.passed
    assert any("omits kv_layer_max_abs" in reason for reason in verdict.reasons)


# --------------------------------------------------------------------------- a run that stopped early


def test_an_incomplete_run_is_not_qualified_and_says_why_in_one_line():
    verdict = judge_incomplete("handoff 1/3: producer failed:\n  killed by signal 9")
    assert not verdict.passed
    assert verdict.headline == "not qualified: handoff 1/3: producer failed: killed by signal 9"
    assert verdict.reasons == ["handoff 1/3: producer failed: killed by signal 9"]
    assert verdict.error == "handoff 1/3: producer failed: killed by signal 9"
    assert [check.passed for check in verdict.checks] == [False]


def test_an_incomplete_run_without_a_reason_still_fails_with_words():
    verdict = judge_incomplete("   ")
    assert not verdict.passed and verdict.error and verdict.reasons == [verdict.error]


def test_only_the_incomplete_judgement_carries_an_error():
    assert judge_summary(three(), RULE2).error is None


# --------------------------------------------------------------------------- draft acceptance


def test_draft_acceptance_states_the_pooled_and_the_lowest_document_rate():
    verdict = judge_draft_acceptance({"a": {"proposed": 100, "accepted": 90}, "b": {"proposed": 300, "accepted": 240}},
                                     proposal_tokens=4)
    assert verdict.passed
    assert verdict.headline == ("draft acceptance measured at k=4: pooled 0.825000 over 2 documents, "
                                "minimum document 0.800000")


@pytest.mark.parametrize("document", [
    {"proposed": 0, "accepted": 0}, {"proposed": 10, "accepted": 11}, {"proposed": 10},
    {"proposed": 10.0, "accepted": 5}, {"proposed": True, "accepted": 1},
])
def test_draft_acceptance_refuses_counts_that_are_not_a_measurement(document):
    verdict = judge_draft_acceptance({"a": {"proposed": 10, "accepted": 9}, "b": document}, proposal_tokens=4)
    assert not verdict.passed and verdict.reasons[0].startswith("document b: found proposed")


def test_draft_acceptance_of_no_documents_fails():
    verdict = judge_draft_acceptance({}, proposal_tokens=4)
    assert not verdict.passed and verdict.reasons == ["no documents measured"]
    assert [(c.name, c.passed) for c in verdict.checks] == [("documents", False)]


def test_draft_acceptance_names_every_bad_document_not_only_the_first():
    bad = {"proposed": 0, "accepted": 0}
    verdict = judge_draft_acceptance({"a": bad, "b": {"proposed": 4, "accepted": 3}, "c": bad}, proposal_tokens=4)
    assert [reason.split(":")[0] for reason in verdict.reasons] == ["document a", "document c"]
    assert [(c.name, c.passed) for c in verdict.checks] == [("document a", False), ("document b", True), ("document c", False)]
    assert verdict.headline.startswith("failed: document a: found proposed 0, accepted 0")


@pytest.mark.parametrize(("proposed", "accepted"), [(1, 0), (1, 1), (7, 0), (7, 7)])
def test_draft_acceptance_counts_at_their_bounds_are_a_measurement(proposed, accepted):
    verdict = judge_draft_acceptance({"a": {"proposed": proposed, "accepted": accepted}}, proposal_tokens=4)
    assert verdict.passed and verdict.reasons == [verdict.headline]
    assert verdict.checks == [Check("document a", True, f"document a: acceptance {accepted / proposed:.6f}")]


# --------------------------------------------------------------------------- failed steps and refusals


def test_a_failed_step_is_judged_not_qualified_naming_the_step_in_one_line():
    verdict = judge_failed_step("handoff 2", "wire refused\nthe manifest's lane differs")
    assert verdict.status == "failed"
    assert verdict.headline == "not qualified: handoff 2: wire refused the manifest's lane differs"
    assert verdict.reasons == ["handoff 2: wire refused the manifest's lane differs"]
    assert verdict.checks == [Check("handoff 2", False, "wire refused the manifest's lane differs")]
    assert judge_failed_step("handoff 2", "  ").reasons == ["handoff 2: step failed without a reason"]


def test_a_failed_step_lends_a_failing_samples_reasons_and_checks_and_ignores_a_passing_one():
    failing = Verdict(False, "failed: kv", ["kv differs at layer 3"], [Check("kv", False, "kv differs at layer 3")])
    passing = Verdict(True, "passed: all", ["all held"], [Check("kv", True, "kv equal")])
    lent = judge_failed_step("handoff 1", "judge refused", failing)
    assert lent.reasons == ["handoff 1: judge refused", "kv differs at layer 3"]
    assert lent.checks == [Check("handoff 1", False, "judge refused"), Check("kv", False, "kv differs at layer 3")]
    kept = judge_failed_step("handoff 1", "judge refused", passing)
    assert kept.reasons == ["handoff 1: judge refused"] and len(kept.checks) == 1


def test_a_refused_run_is_neither_passed_nor_failed_and_says_why_in_one_line():
    verdict = judge_refused("no GPU\nhere")
    assert verdict.status == "refused" and verdict.refused and not verdict.passed
    assert verdict.headline == verdict.error == "refused: no GPU here"
    assert verdict.reasons == ["no GPU here"] and verdict.checks == [Check("lane runs here", False, "no GPU here")]
    assert judge_refused("").reasons == ["run refused without a reason"]


# --------------------------------------------------------------------------- purity


def test_the_judge_imports_no_numpy_engines_or_comparison_code():
    code = ("import qualify.judge, sys; print(sorted(m for m in sys.modules "
            "if m.startswith(('numpy', 'torch', 'qualify.engines', 'qualify.evidence.compare', 'qualify.handoff'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


# --------------------------------------------------------------------------- boundaries (issue 20)

ONE_ULP_OVER_MAX = math.nextafter(RULE2.maximum_absolute, math.inf)
ONE_ULP_OVER_MEAN = math.nextafter(RULE2.maximum_mean_absolute, math.inf)


@pytest.mark.parametrize(
    ("field", "at_bound"),
    [("max_abs", RULE2.maximum_absolute), ("mean_abs", RULE2.maximum_mean_absolute)],
    ids=["max", "mean"],
)
def test_summary_passes_a_repetition_exactly_at_a_bound(field, at_bound):
    records = three()
    records[1][field] = at_bound
    verdict = judge_summary(records, RULE2)
    assert verdict.passed, verdict.reasons
    assert next(c for c in verdict.checks if c.name == "bounded drift in every repetition").passed


@pytest.mark.parametrize(
    ("field", "over"), [("max_abs", ONE_ULP_OVER_MAX), ("mean_abs", ONE_ULP_OVER_MEAN)], ids=["max", "mean"],
)
def test_summary_fails_a_repetition_one_ulp_over_a_bound(field, over):
    records = three()
    records[1][field] = over
    verdict = judge_summary(records, RULE2)
    assert not verdict.passed
    assert not next(c for c in verdict.checks if c.name == "bounded drift in every repetition").passed
    assert any(r.startswith("repetition 2: native full-logit drift exceeds its identity rule") for r in verdict.reasons)


@pytest.mark.parametrize("field", ["max_abs", "mean_abs"])
def test_a_delta_one_ulp_below_zero_is_refused_not_read_as_inside_the_bound(field):
    below_zero = math.nextafter(0.0, -math.inf)
    verdict = judge_sample(rung2_record(**{field: below_zero}), RULE2)
    assert not verdict.passed
    assert f"sample {field} is {below_zero:.9g}, below 0" in verdict.reasons


def test_a_draft_acceptance_one_ulp_over_one_is_refused_not_read_as_above_the_floor():
    over_one = math.nextafter(1.0, math.inf)
    verdict = judge_rung3_sample(rung3_record(draft_acceptance_rate=over_one), RULE3)
    assert not verdict.passed
    assert f"sample draft_acceptance_rate is {over_one:.9g}, above 1" in verdict.reasons
    assert judge_rung3_sample(rung3_record(draft_acceptance_rate=1.0), RULE3).passed


RULE3_GRADED = BitExactRule(acceptance_floor=0.95, drift_graded=True)


def test_drift_graded_rung3_passes_a_bit_exact_sample():
    verdict = judge_rung3_sample(rung3_record(), RULE3_GRADED)
    assert verdict.passed, verdict.reasons
    assert "full-logit deltas exactly 0" in verdict.reasons
    assert "logit digests equal in every row and over the block" in verdict.reasons


def test_drift_graded_rung3_still_requires_the_logit_digest_evidence():
    record = rung3_record()
    del record["logit_row_digests_equal"]
    assert "sample omits logit_row_digests_equal" in judge_rung3_sample(record, RULE3_GRADED).reasons
    record = rung3_record()
    del record["first_logit_digest_mismatch_row"]
    assert "sample omits first_logit_digest_mismatch_row" in judge_rung3_sample(record, RULE3_GRADED).reasons


SMALLEST_DELTA = math.nextafter(0.0, 1.0)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"max_abs": SMALLEST_DELTA},
         f"full logits differ: max={SMALLEST_DELTA:.9g}, mean=0 (bit-exact requires 0)"),
        ({"mean_abs": SMALLEST_DELTA},
         f"full logits differ: max=0, mean={SMALLEST_DELTA:.9g} (bit-exact requires 0)"),
        ({"logit_row_digests_equal": False}, "logit block digests differ"),
        ({"first_logit_digest_mismatch_row": 3}, "logit digest mismatch at row 3"),
        ({"handoff_logit_block_sha256": LOGITS_HANDOFF_SHA}, "logit block digests differ"),
    ],
    ids=["max-one-denormal", "mean-one-denormal", "rows-not-equal", "mismatch-row", "block-digests"],
)
def test_drift_graded_rung3_fails_on_any_one_departure_from_bit_exact(changes, reason):
    verdict = judge_rung3_sample(rung3_record(**changes), RULE3_GRADED)
    assert not verdict.passed
    assert reason in verdict.reasons, verdict.reasons


@pytest.mark.parametrize("delta", [False, True, None, "0", [0.0], math.nan, -SMALLEST_DELTA, SMALLEST_DELTA],
                         ids=["false", "true", "none", "text", "list", "nan", "below-zero", "one-denormal"])
@pytest.mark.parametrize("tensor", ["k", "v"])
def test_rung3_kv_delta_that_is_not_the_number_zero_is_refused(tensor, delta):
    record = rung3_record()
    record["localisation"]["kv_layer_max_abs"][1][tensor] = delta
    verdict = judge_rung3_sample(record, RULE3)
    assert not verdict.passed
    assert any(f"layer 1 {tensor.upper()}" in reason for reason in verdict.reasons), verdict.reasons


@pytest.mark.parametrize("zero", [0, 0.0, -0.0], ids=["int", "float", "negative-zero"])
def test_rung3_kv_delta_of_numeric_zero_passes(zero):
    record = rung3_record()
    record["localisation"]["kv_layer_max_abs"][1].update(k=zero, v=zero)
    assert judge_rung3_sample(record, RULE3).passed


ROW = "a" * 64
OTHER_ROW = "b" * 64


@pytest.mark.parametrize(
    "rows",
    [
        {"handoff_logit_row_sha256": [ROW] * 256},
        {"cold_logit_row_sha256": [ROW] * 256},
        {"handoff_logit_row_sha256": [ROW] * 256, "cold_logit_row_sha256": None},
        {"handoff_logit_row_sha256": ROW * 256, "cold_logit_row_sha256": [ROW] * 256},
        {"handoff_logit_row_sha256": [ROW] * 256, "cold_logit_row_sha256": ROW * 256},
        {"handoff_logit_row_sha256": {"0": ROW}, "cold_logit_row_sha256": {"0": ROW}},
        {"handoff_logit_row_sha256": [1] * 256, "cold_logit_row_sha256": [1] * 256},
        {"handoff_logit_row_sha256": [ROW.upper()] * 256, "cold_logit_row_sha256": [ROW.upper()] * 256},
        {"handoff_logit_row_sha256": "", "cold_logit_row_sha256": ""},
    ],
    ids=["handoff-only", "cold-only", "cold-null", "handoff-text", "cold-text", "mappings", "integers",
         "uppercase-hex", "empty-text"],
)
def test_rung3_row_digest_lists_that_are_one_sided_or_malformed_are_refused(rows):
    verdict = judge_rung3_sample(rung3_record(**rows), RULE3)
    assert not verdict.passed
    assert "sample row digests are malformed" in verdict.reasons


def test_rung3_row_digest_lists_of_unequal_length_disagree_at_the_shorter_length():
    verdict = judge_rung3_sample(
        rung3_record(handoff_logit_row_sha256=[ROW] * 256, cold_logit_row_sha256=[ROW] * 255), RULE3)
    assert not verdict.passed
    assert "recorded row digests disagree with the reported first mismatch (rows say 255)" in verdict.reasons
    # the same lists agree with a record that reports its first mismatch at the shorter length
    reported = rung3_record(handoff_logit_row_sha256=[ROW] * 256, cold_logit_row_sha256=[ROW] * 255,
                            first_logit_digest_mismatch_row=255)
    row_check = next(c for c in judge_rung3_sample(reported, RULE3).checks if c.name == "row digests")
    assert row_check.passed


def test_rung3_row_digest_lists_shorter_than_the_decode_are_refused():
    verdict = judge_rung3_sample(
        rung3_record(handoff_logit_row_sha256=[ROW] * 255, cold_logit_row_sha256=[ROW] * 255), RULE3)
    assert not verdict.passed
    assert "recorded row digests disagree with the reported first mismatch (rows say None)" in verdict.reasons


def test_rung3_row_digest_lists_differing_in_the_last_row_report_it():
    cold = [ROW] * 256
    cold[255] = OTHER_ROW
    verdict = judge_rung3_sample(rung3_record(handoff_logit_row_sha256=[ROW] * 256, cold_logit_row_sha256=cold), RULE3)
    assert "recorded row digests disagree with the reported first mismatch (rows say 255)" in verdict.reasons


@pytest.mark.parametrize(
    "fields",
    [(None, True, "held"), ("", True, "held"), ("kv", None, "held"), ("kv", 1, "held"), ("kv", False, None)],
)
def test_a_check_without_a_name_a_yes_or_no_or_words_is_refused_where_it_is_made(fields: tuple[Any, ...]) -> None:
    with pytest.raises(TypeError, match="malformed check"):
        Check(*fields)


@pytest.mark.parametrize(
    "fields",
    [
        (None, "passed: x", ["x"], []),
        (True, "", ["x"], []),
        (True, "passed: x", None, []),
        (True, "passed: x", [None], []),
        (True, "passed: x", ["x"], None),
        (True, "passed: x", ["x"], ["kv"]),
    ],
)
def test_a_malformed_verdict_is_refused_where_it_is_made(fields: tuple[Any, ...]) -> None:
    with pytest.raises(TypeError, match="malformed verdict"):
        Verdict(*fields)


# --------------------------------------------------------------------------- the whole run

SEAMS_SHA = "7" * 64


def test_a_qualification_passes_only_when_its_repetitions_pass_and_reproduce_the_anchor():
    records, anchors = three(seams_sha256=SEAMS_SHA), three(seams_sha256=SEAMS_SHA)
    verdict = judge_qualification(records, RULE2, anchors, deterministic_producer=True)
    summary, reproduction = judge_summary(records, RULE2), judge_reproduction(
        records, anchors, rung=2, deterministic_producer=True, draft=False)
    assert verdict.passed and verdict.status == "passed" and verdict.scope is None
    assert verdict.headline == f"{summary.headline}; {reproduction.headline}"
    assert verdict.reasons == [*summary.reasons, reproduction.headline]
    assert verdict.checks == [*summary.checks, *reproduction.checks]


def test_a_qualification_fails_with_the_failing_halfs_reasons_only():
    anchors = three(seams_sha256=SEAMS_SHA)
    over = three(seams_sha256=SEAMS_SHA)
    over[1]["max_abs"] = 11.5  # over RULE2's 11.0
    failed_summary = judge_qualification(over, RULE2, anchors, deterministic_producer=True)
    assert not failed_summary.passed
    assert failed_summary.reasons == [r for r in judge_summary(over, RULE2).reasons]
    moved = three(seams_sha256=SEAMS_SHA, payload_sha256="8" * 64)
    failed_reproduction = judge_qualification(moved, RULE2, anchors, deterministic_producer=True)
    assert not failed_reproduction.passed
    assert failed_reproduction.reasons == judge_reproduction(
        moved, anchors, rung=2, deterministic_producer=True, draft=False).reasons
    not_anchored = judge_qualification(moved, RULE2, anchors, deterministic_producer=False)
    assert not not_anchored.passed  # no fixture envelope: tests/unit/judge/test_envelope.py gives it one
    assert not_anchored.reasons[0].startswith("no fixture envelope for a producer declared non-deterministic")


def test_a_bit_exact_lane_with_a_floor_must_reproduce_its_draft_and_one_without_a_floor_need_not():
    anchors = three(rung3_record, seams_sha256=SEAMS_SHA)
    redrafted = three(rung3_record, seams_sha256=SEAMS_SHA, handoff_draft_tokens_sha256="9" * 64,
                      cold_draft_tokens_sha256="9" * 64)
    with_floor = judge_qualification(redrafted, RULE3, anchors, deterministic_producer=True)
    assert not with_floor.passed and any("draft tokens" in reason for reason in with_floor.reasons)
    assert judge_qualification(redrafted, BitExactRule(acceptance_floor=None), anchors, deterministic_producer=True).passed


@pytest.mark.parametrize(
    ("changes", "detail"),
    [
        (dict(first_logit_digest_mismatch_row=7, logit_row_digests_equal=False), "logit digest mismatch at row 7"),
        (dict(handoff_logit_block_sha256=LOGITS_HANDOFF_SHA),
         "logit digest mismatch: block digests differ while every row digest is reported equal"),
        (dict(handoff_logit_block_sha256=LOGITS_HANDOFF_SHA, logit_row_digests_equal=False),
         "logit digest mismatch at an unreported row"),
        (dict(logit_row_digests_equal=False), "logit digest mismatch at an unreported row"),
    ],
)
def test_rung3_names_how_its_logit_digests_disagree(changes, detail):
    verdict = judge_rung3_sample(rung3_record(**changes), RULE3)
    assert not verdict.passed
    assert [(c.passed, c.detail) for c in verdict.checks if c.name == "logit digests"] == [(False, detail)]
    assert "logit deltas" not in [c.name for c in verdict.checks]  # no delta verdict over unequal digests


# --------------------------------------------------------------------------- which checks a judgement holds, and their outcomes
# (what each check says is held in tests/golden/judge.handoffs.txt)


def outcomes(verdict) -> list[tuple[str, bool]]:
    return [(check.name, check.passed) for check in verdict.checks]


def outcome_of(verdict, name: str) -> Check:
    (found,) = [check for check in verdict.checks if check.name == name]
    return found


SAMPLE_CHECKS = ["evidence", "values", "output tokens", "tokens exact", "generated-token digest", "payload",
                 "handed-off positions"]


def test_a_sample_failing_every_check_fails_each_and_names_every_failure():
    record = rung2_record(output_tokens=255, token_agreement_rate=0.5, cold_generated_token_sha256="7" * 64,
                          payload_bytes=0, handed_off_positions=0, max_abs=12.0)
    verdict = judge_sample(record, RULE2)
    assert outcomes(verdict) == [("evidence", True), ("values", True),
                                 *((name, False) for name in SAMPLE_CHECKS[2:]), ("bounded drift", False)]
    assert not verdict.passed and len(verdict.reasons) == 6


def test_an_omitted_and_a_malformed_value_fail_together_and_the_rest_is_judged_without_a_drift_check():
    record = rung2_record(mean_abs=math.nan)
    del record["max_abs"]
    verdict = judge_sample(record, RULE2)
    assert outcomes(verdict) == [("evidence", False), ("values", False), *((name, True) for name in SAMPLE_CHECKS[2:])]
    assert len(verdict.reasons) == 2


@pytest.mark.parametrize("field", ["payload_bytes", "handed_off_positions"])
def test_one_byte_or_one_handed_off_position_is_enough(field):
    verdict = judge_sample(rung2_record(**{field: 1}), RULE2)
    assert verdict.passed, verdict.reasons


@pytest.mark.parametrize(
    ("field", "value"),
    [("output_tokens", 0), ("repetition", 0), ("token_agreement_rate", -0.001), ("token_agreement_rate", 1.001),
     ("payload_gbit_per_s", -0.001), ("max_abs", -0.001), ("mean_abs", -0.001), ("recomputed_positions", -1)],
)
def test_a_value_out_of_its_range_fails_the_values_check_naming_the_field(field, value):
    verdict = judge_sample(rung2_record(**{field: value}), RULE2)
    values = outcome_of(verdict, "values")
    assert not verdict.passed and not values.passed and field in values.detail


@pytest.mark.parametrize("field", ["payload_gbit_per_s", "token_agreement_rate"])
def test_zero_is_inside_a_range_that_starts_at_zero(field):
    assert outcome_of(judge_sample(rung2_record(**{field: 0.0}), RULE2), "values").passed


@pytest.mark.parametrize("rate", [-0.001, 1.001])
def test_a_draft_acceptance_rate_outside_0_to_1_fails_the_values_check(rate):
    verdict = judge_sample(rung3_record(draft_acceptance_rate=rate), RULE3)
    values = outcome_of(verdict, "values")
    assert not verdict.passed and not values.passed and "draft_acceptance_rate" in values.detail


def test_a_token_count_that_is_no_number_drops_the_output_tokens_check_and_still_judges_the_tokens():
    exact = judge_sample(rung2_record(output_tokens="256"), RULE2)
    diverged = judge_sample(rung2_record(output_tokens="256", token_agreement_rate=0.5), RULE2)
    assert "output tokens" not in dict(outcomes(exact)) and "output tokens" not in dict(outcomes(diverged))
    assert outcome_of(exact, "tokens exact").passed and not outcome_of(diverged, "tokens exact").passed
    assert not exact.passed and not outcome_of(exact, "values").passed


@pytest.mark.parametrize(("rate", "passes"), [(0.9500000001, True), (0.9499999999, False)])
def test_an_acceptance_a_hair_from_its_floor_is_judged_on_its_full_value(rate, passes):
    verdict = judge_sample(rung3_record(draft_acceptance_rate=rate), RULE3)
    assert verdict.passed is passes and outcome_of(verdict, "draft acceptance").passed is passes


@pytest.mark.parametrize("layers", [[{"k": "x", "v": 0.0}], [{"layer": 2, "k": 0.0}], ["not a layer"], [], "0.0"],
                         ids=["text-delta", "no-v", "not-a-layer", "no-layers", "text"])
def test_kv_evidence_that_is_not_a_number_per_layer_fails_the_kv_check_never_read_as_zero(layers):
    verdict = judge_sample(rung3_record(localisation={"kv_layer_max_abs": layers}), RULE3)
    assert not verdict.passed and not outcome_of(verdict, "kv").passed
    assert [check.name for check in verdict.checks if not check.passed] == ["kv"]


@pytest.mark.parametrize(
    ("changes", "passes"),
    [({"logit_row_digests_equal": True, "first_logit_digest_mismatch_row": None, "handoff_logit_block_sha256": "3" * 64},
      True),
     ({"logit_row_digests_equal": True, "first_logit_digest_mismatch_row": None}, False),
     ({"logit_row_digests_equal": False, "first_logit_digest_mismatch_row": None}, False),
     ({"first_logit_digest_mismatch_row": 5}, False)],
    ids=["all-equal", "block-differs", "unreported-row", "row-5"],
)
def test_default_rung2_judging_ends_with_the_logit_digest_check(changes, passes):
    rule = BoundedDriftRule(maximum_absolute=11.0, maximum_mean_absolute=1.25, drift_graded=False)
    verdict = judge_sample(rung2_record(**changes), rule)
    assert outcomes(verdict)[-1] == ("logit digests", passes) and verdict.passed is passes


@pytest.mark.parametrize("absent", ["logit_row_digests_equal", "handoff_logit_block_sha256", "cold_logit_block_sha256"])
def test_default_rung2_judging_without_a_digest_gives_no_digest_check_only_the_omission(absent):
    rule = BoundedDriftRule(maximum_absolute=11.0, maximum_mean_absolute=1.25, drift_graded=False)
    verdict = judge_sample(rung2_record(**{absent: None}), rule)
    assert not verdict.passed and not outcome_of(verdict, "evidence").passed
    assert "logit digests" not in dict(outcomes(verdict))


def test_rung3_without_its_digest_flag_judges_no_digests_or_deltas_only_the_omission():
    verdict = judge_sample(rung3_record(logit_row_digests_equal=None), RULE3)
    assert not verdict.passed and not outcome_of(verdict, "evidence").passed
    assert {"logit digests", "logit deltas"}.isdisjoint(dict(outcomes(verdict)))


def test_drift_graded_rung3_with_one_delta_missing_judges_no_deltas():
    verdict = judge_sample(rung3_record(mean_abs=None), RULE3_GRADED)
    assert not verdict.passed and "logit deltas" not in dict(outcomes(verdict))


def test_drift_graded_rung3_judges_the_deltas_before_the_digests():
    assert [name for name, _ in outcomes(judge_sample(rung3_record(), RULE3_GRADED))][7:9] == ["logit deltas",
                                                                                               "logit digests"]
    assert [name for name, _ in outcomes(judge_sample(rung3_record(), RULE3))][7:9] == ["logit digests", "logit deltas"]


def test_a_one_sided_draft_digest_is_an_omission_not_a_difference():
    verdict = judge_sample(rung3_record(cold_draft_tokens_sha256=None), RULE3)
    assert not verdict.passed and not outcome_of(verdict, "evidence").passed
    assert "draft tokens" not in dict(outcomes(verdict)) and outcome_of(verdict, "draft trace").passed


def test_a_summary_over_one_repetition_passes_when_its_rule_asks_for_one():
    rule = BoundedDriftRule(maximum_absolute=11.0, maximum_mean_absolute=1.25, repetitions=1)
    verdict = judge_summary([rung2_record(1)], rule)
    assert verdict.passed, verdict.reasons
    assert not judge_summary([rung2_record(1)], RULE2).passed


def test_a_rung3_summary_compares_the_draft_digests_only_when_the_identity_declares_a_draft():
    drafted = judge_summary(three(rung3_record), RULE3)
    draftless = judge_summary(three(rung3_record), BitExactRule(acceptance_floor=None))
    assert drafted.passed and draftless.passed
    assert [name for name, _ in outcomes(drafted)][-2:] == ["draft tokens digest across repetitions",
                                                            "draft trace digest across repetitions"]
    assert not any("draft" in name for name, _ in outcomes(draftless))


def test_a_broken_summary_fails_its_count_its_samples_its_tokens_and_its_drift():
    records = [rung2_record(1), rung2_record(2, token_agreement_rate=0.5, max_abs=12.0), rung2_record(5), "x"]
    verdict = judge_summary(records, RULE2)
    assert outcomes(verdict)[:4] == [("repetitions", False), ("samples", False),
                                     ("tokens exact in every repetition", False),
                                     ("bounded drift in every repetition", False)]
    assert not verdict.passed


def test_a_summary_of_no_samples_fails_every_check():
    verdict = judge_summary([], RULE2)
    assert not verdict.passed and verdict.checks and not any(passed for _, passed in outcomes(verdict))


def test_a_digest_missing_in_a_repetition_or_a_flag_in_its_place_fails_the_digest_check():
    second, third = rung2_record(2), rung2_record()
    del second["payload_sha256"], third["payload_sha256"], third["repetition"]
    for records in ([rung2_record(1), second, third],
                    [rung2_record(1), rung2_record(2, payload_sha256=True), rung2_record(3)]):
        verdict = judge_summary(records, RULE2)
        assert not verdict.passed and not outcome_of(verdict, "payload digest across repetitions").passed


def test_a_failed_step_and_a_qualification_carry_the_scope_they_were_judged_under():
    from qualify.judge.scope import Scope

    scope = Scope("python-textwrap", 3, 2048, 256, None)
    failed = judge_failed_step("handoff 2", "wire refused", scope=scope)
    assert (failed.status, failed.scope) == ("failed", scope)
    assert judge_failed_step("handoff 2", "wire refused").scope is None
    anchors = three(seams_sha256=SEAMS_SHA)
    passing = judge_qualification(three(seams_sha256=SEAMS_SHA), RULE2, anchors, deterministic_producer=True,
                                  scope=scope)
    failing = judge_qualification([rung2_record(1), rung2_record(2, token_agreement_rate=0.5), rung2_record(3)], RULE2,
                                  anchors, deterministic_producer=True, scope=scope)
    assert (passing.passed, passing.scope) == (True, scope)
    assert (failing.passed, failing.scope) == (False, scope)
    assert failing.reasons[0] == judge_summary(
        [rung2_record(1), rung2_record(2, token_agreement_rate=0.5), rung2_record(3)], RULE2).reasons[0]

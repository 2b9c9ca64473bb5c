"""qualify.evidence.records: rules, sample records and the validation summary are strict, frozen data.

Rules refuse what they cannot judge by; records refuse unknown fields and incomplete evidence unless
they say why the sample failed; non-finite measurements survive into the JSON form as strings so
the judge can refuse them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from qualify.core.errors import Refused
from qualify.evidence.records import (
    REQUIRED_SAMPLE_FIELDS,
    SAMPLE_SCHEMA,
    SUMMARY_SCHEMA,
    BitExactRule,
    BoundedDriftRule,
    SampleRecord,
    ValidationSummary,
    failed_sample_record,
    parse_rule,
    record_json,
    rule_from_identity,
)
from qualify.judge import judge_sample
from tests.unit.judge.test_judge import rung2_record

RULE2 = BoundedDriftRule(maximum_absolute=11.0, maximum_mean_absolute=1.25)


def complete_record(**changes) -> SampleRecord:
    """A complete rung-2 record, built as the evidence side builds one."""
    fields = {key: value for key, value in rung2_record(**changes).items() if key != "schema"}
    return SampleRecord(**fields)


def identity(rung: int, *, bounds: tuple[float, float] | None = (11.0, 1.25), floor: float | None = None):
    """Stands in for qualify.contract.identity.Identity: only what a rule is made from."""
    logits = (SimpleNamespace(mode="exact") if bounds is None
              else SimpleNamespace(maximum_absolute=bounds[0], maximum_mean_absolute=bounds[1]))
    return SimpleNamespace(
        rung=rung,
        onboarding_qualification=SimpleNamespace(repetitions=5, output_tokens=128, full_logits=logits),
        speculative_draft=None if floor is None else SimpleNamespace(acceptance_floor=floor),
    )


# --------------------------------------------------------------------------- rules


def test_a_rule_dict_parses_to_its_rung_with_the_defaults():
    rule = parse_rule({"rung": 2, "maximum_absolute": 1.0, "maximum_mean_absolute": 0.5})
    assert isinstance(rule, BoundedDriftRule)
    assert (rule.repetitions, rule.output_tokens, rule.drift_graded) == (3, 256, True)
    exact = parse_rule({"rung": 3, "acceptance_floor": None})
    assert isinstance(exact, BitExactRule) and exact.drift_graded is False


def test_a_rule_round_trips_through_its_summary_form():
    for rule in (RULE2, BitExactRule(acceptance_floor=0.82, repetitions=5)):
        assert parse_rule(json.loads(json.dumps(rule.model_dump(mode="json")))) == rule


def test_a_rule_model_is_passed_through_unchanged():
    assert parse_rule(RULE2) is RULE2


@pytest.mark.parametrize(("rule", "words"), [
    ({"rung": 2, "maximum_absolute": 0.0, "maximum_mean_absolute": 1.0}, "maximum_absolute must be finite and"),
    ({"rung": 2, "maximum_absolute": math.inf, "maximum_mean_absolute": 1.0}, "maximum_absolute must be finite"),
    ({"rung": 2, "maximum_absolute": 1.0, "maximum_mean_absolute": math.nan}, "maximum_mean_absolute must be finite"),
    ({"rung": 2, "maximum_absolute": -1.0, "maximum_mean_absolute": 1.0}, "maximum_absolute must be finite"),
    ({"rung": 3, "acceptance_floor": 1.5}, "acceptance_floor must be in (0, 1]"),
    ({"rung": 3, "acceptance_floor": 0.0}, "acceptance_floor must be in (0, 1]"),
    ({"rung": 3, "acceptance_floor": 0.9, "repetitions": 0}, "repetitions:"),
    ({"rung": 4}, "'rung'"),
    ({"maximum_absolute": 1.0}, "'rung'"),
    ({"rung": 2, "maximum_absolute": 1.0, "maximum_mean_absolute": 1.0, "margin": 0.1}, "margin:"),
    ({"rung": 2, "maximum_absolute": "1.0", "maximum_mean_absolute": 1.0}, "maximum_absolute:"),
])
def test_an_invalid_rule_is_refused_in_one_line_naming_what_is_wrong(rule, words):
    with pytest.raises(Refused) as refused:
        parse_rule(rule)
    message = str(refused.value)
    assert message.startswith("rule: ") and words in message and "\n" not in message


def test_a_rule_that_is_not_a_mapping_is_refused():
    with pytest.raises(Refused, match="expected a rule object"):
        parse_rule([("rung", 2)])  # type: ignore[arg-type]  # the wrong type is the point


def test_rules_are_frozen():
    with pytest.raises(ValidationError):
        RULE2.maximum_absolute = 20.0  # type: ignore[misc]  # assigning to a frozen model is the point


# --------------------------------------------------------------------------- rules from an identity


def test_a_rung2_identity_declares_its_bounds_and_counts():
    rule = rule_from_identity(identity(2), drift_graded=False)
    assert rule == BoundedDriftRule(maximum_absolute=11.0, maximum_mean_absolute=1.25, repetitions=5,
                                    output_tokens=128, drift_graded=False)


def test_a_rung3_identity_declares_its_draft_floor_or_none():
    assert rule_from_identity(identity(3, bounds=None, floor=0.82), drift_graded=False).acceptance_floor == 0.82
    assert rule_from_identity(identity(3, bounds=None), drift_graded=False).acceptance_floor is None


def test_an_identity_of_another_rung_is_refused():
    with pytest.raises(Refused, match=r"identity rung: found 1, expected 2 or 3"):
        rule_from_identity(identity(1), drift_graded=True)


def test_a_rung2_identity_without_drift_bounds_is_refused():
    with pytest.raises(Refused, match="must declare maximum_absolute and maximum_mean_absolute"):
        rule_from_identity(identity(2, bounds=None), drift_graded=True)


def test_an_identity_bound_the_rule_cannot_hold_is_refused():
    with pytest.raises(Refused, match="identity rule: .*maximum_absolute must be finite and positive"):
        rule_from_identity(identity(2, bounds=(math.nan, 1.0)), drift_graded=True)


# --------------------------------------------------------------------------- sample records


def test_a_record_round_trips_through_its_json_form():
    record = complete_record(handoff_logit_row_sha256=("a" * 64,), cold_logit_row_sha256=("b" * 64,),
                             localisation={"first_divergence_position": 3, "cold_margin_at_divergence": 0.5,
                                           "drift_at_divergence": 0.1, "divergence_class": "decisive",
                                           "first_rule_breaking_row": None, "min_cold_margin": 0.01})
    document = record_json(record)
    assert document["schema"] == SAMPLE_SCHEMA
    assert set(REQUIRED_SAMPLE_FIELDS) <= set(document)
    assert document["seams_sha256"] is None  # every field present in the JSON form, null when not measured
    assert SampleRecord.model_validate_json(json.dumps(document)) == record


@pytest.mark.parametrize("field", REQUIRED_SAMPLE_FIELDS)
def test_a_record_without_an_error_must_carry_every_required_field(field):
    # repetition has no null form at all; every other field is refused by name
    with pytest.raises(ValidationError, match="repetition" if field == "repetition" else f"sample omits {field}"):
        complete_record(**{field: None})


def test_an_unknown_field_is_refused():
    with pytest.raises(ValidationError, match="extra"):
        complete_record(speedup=2.0)


@pytest.mark.parametrize(("field", "value"), [
    ("payload_sha256", "not-a-digest"),
    ("payload_sha256", "A" * 64),
    ("payload_bytes", -1),
    ("handed_off_positions", 2.5),
    ("max_abs", "0.1"),
    ("repetition", 0),
    ("logit_row_digests_equal", 1),
])
def test_a_malformed_value_is_refused(field, value):
    with pytest.raises(ValidationError, match=field):
        complete_record(**{field: value})


def test_a_non_finite_measurement_is_kept_and_written_as_a_string_the_judge_refuses():
    record = complete_record(max_abs=math.nan, mean_abs=math.inf)
    document = record_json(record)
    assert (document["max_abs"], document["mean_abs"]) == ("NaN", "Infinity")
    json.dumps(document, allow_nan=False)  # the JSON form is standard JSON
    reasons = judge_sample(document, RULE2).reasons
    assert "sample max_abs is not finite: NaN" in reasons and "sample mean_abs is not finite: Infinity" in reasons


def test_a_stored_non_finite_measurement_never_reads_back_as_a_number():
    document = record_json(complete_record(max_abs=math.nan))
    with pytest.raises(ValidationError, match="max_abs"):
        SampleRecord.model_validate_json(json.dumps(document))


def test_records_are_frozen():
    record = complete_record()
    with pytest.raises(ValidationError):
        record.max_abs = 0.0  # type: ignore[misc]  # assigning to a frozen model is the point


# --------------------------------------------------------------------------- failed samples


def test_a_failed_record_keeps_what_was_measured_and_its_error_in_one_line():
    record = failed_sample_record(2, "producer failed:\n  killed by signal 9", payload_bytes=1024)
    document = record_json(record)
    assert document["error"] == "producer failed: killed by signal 9"
    assert document["payload_bytes"] == 1024 and document["max_abs"] is None
    verdict = judge_sample(document, RULE2)
    assert not verdict.passed and verdict.reasons == ["sample failed: producer failed: killed by signal 9"]


def test_a_failed_record_without_a_message_still_says_it_failed():
    assert failed_sample_record(1, "  ").error == "sample failed without a message"


def test_a_failed_record_refuses_measurements_it_does_not_know():
    with pytest.raises(ValidationError, match="extra"):
        failed_sample_record(1, "refused", warmup_s=1.0)


def test_a_blank_error_is_not_a_reason():
    with pytest.raises(ValidationError, match="error must say why the sample failed"):
        SampleRecord(repetition=1, error=" ")


# --------------------------------------------------------------------------- validation summary


def summary(**changes) -> ValidationSummary:
    fields = {
        "run_id": "20261129T000000Z-0123456789abcdef", "recipe": "native-text", "lane": "nvfp4-native-splitk",
        "rung": 2, "identity_sha256": "a" * 64, "passed": True, "status": "passed", "verdict": "passed: ...",
        "reasons": ("held",),
        "checks": ({"name": "samples", "passed": True, "detail": "held"},), "rule": RULE2.model_dump(mode="json"),
        "samples": 3, "started_utc": "2026-11-29T00:00:00.000000Z", "finished_utc": "2026-11-29T00:00:01.000000Z",
    }
    return ValidationSummary.model_validate(fields | changes)


def test_a_summary_names_its_schema_and_round_trips():
    document = json.loads(summary().model_dump_json(by_alias=True))
    assert document["schema"] == SUMMARY_SCHEMA and document["error"] is None
    assert ValidationSummary.model_validate_json(json.dumps(document)) == summary()
    assert parse_rule(document["rule"]) == RULE2


@pytest.mark.parametrize(("field", "value"), [
    ("identity_sha256", "abc"), ("rung", 4), ("samples", -1), ("passed", "yes"), ("schema", "other.v1"),
    ("verdict_line", "x"), ("identity_sha256", None), ("lane", None), ("status", "failed"),
])
def test_a_summary_refuses_what_it_cannot_hold(field, value):
    with pytest.raises(ValidationError):
        summary(**{field: value})


# --------------------------------------------------------------------------- purity


def test_records_import_no_numpy_engines_or_comparison_code():
    code = ("import qualify.evidence.records, sys; print(sorted(m for m in sys.modules "
            "if m.startswith(('numpy', 'torch', 'qualify.engines', 'qualify.evidence.compare', 'qualify.contract'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"

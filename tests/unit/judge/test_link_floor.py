"""A declared link-rate floor: the identity that declares it (schema v4), and its judgement over a
run's samples, word for word. The run that refuses it without a network link, and verdicts on
records a TLS producer really sent, are in tests/unit/handoff/test_handoff_tls.py; freezing one, in
tests/unit/core/test_rfc8785_digests.py."""

from __future__ import annotations

import json

import jsonschema
import pytest

from qualify.contract.identity import (
    IDENTITY_SCHEMA_ID,
    LINK_FLOOR_SCHEMA_ID,
    Identity,
    identity_json_schema,
    identity_sha256,
    parse_identity_document,
    validate_identity_document,
)
from qualify.core.assets import CONTRACTS_DIR
from qualify.core.errors import Refused
from qualify.judge import judge_link_floor, judge_qualification, judge_reproduction, judge_summary
from tests.unit.judge.test_judge import RULE2, SEAMS_SHA, three

SHIPPED = CONTRACTS_DIR / "vllm-to-reference-identity-v1.json"


def shipped_document() -> dict:
    return json.loads(SHIPPED.read_text(encoding="utf-8"))


def with_floor(gbit_per_s: object = 3.0, schema: str = LINK_FLOOR_SCHEMA_ID) -> dict:
    document = shipped_document()
    return {**document, "schema": schema, "link_floor": {"gbit_per_s_minimum": gbit_per_s}}


def rated(*rates: object) -> list[dict]:
    records = three()[:len(rates)]
    for record, rate in zip(records, rates, strict=True):
        record["payload_gbit_per_s"] = rate
    return records


def floor_check(verdict) -> tuple[str, bool, str]:
    (check,) = verdict.checks
    return check.name, check.passed, check.detail


# --------------------------------------------------------------------------- the identity


def test_a_v4_identity_declares_its_floor_and_is_sealed_by_its_own_digest() -> None:
    identity = parse_identity_document(with_floor(), where="identity x")
    assert identity.link_floor is not None and identity.link_floor.gbit_per_s_minimum == 3.0
    assert identity.document() == with_floor()
    sealed = validate_identity_document(with_floor(), where="identity x",
                                        sealed_identities={"vllm-to-reference": identity_sha256(identity)})
    assert sealed == identity
    shipped = parse_identity_document(shipped_document(), where="identity y")
    assert identity_sha256(identity) != identity_sha256(shipped)


def test_a_v3_identity_has_no_floor_and_keeps_its_digest() -> None:
    identity = parse_identity_document(shipped_document(), where="identity y")
    assert identity.schema_id == IDENTITY_SCHEMA_ID and identity.link_floor is None
    assert "link_floor" not in identity.document()
    assert identity.document() == shipped_document()


V5_FIELDS = ("schema, lane, lane_kind, recipe, rung, producer_mode, native_variant, onboarding_qualification, "
             "target_cache_identity_sha256, checkpoint, producer_engine, consumer_engine, connector, tokenizer_sha256, "
             "prompt, prompt_template, context_policy, rope, logit_units, speculative_draft, calibration, controls")


@pytest.mark.parametrize(("document", "words"), [
    (with_floor(schema=IDENTITY_SCHEMA_ID), f"identity x: link_floor: found unexpected field, expected only {V5_FIELDS}"),
    ({**shipped_document(), "schema": LINK_FLOOR_SCHEMA_ID}, "identity x: link_floor: missing, expected this field"),
    (with_floor(0), "identity x: link_floor.gbit_per_s_minimum: found 0, expected a number > 0"),
    (with_floor(-1.5), "identity x: link_floor.gbit_per_s_minimum: found -1.5, expected a number > 0"),
    (with_floor("fast"), 'identity x: link_floor.gbit_per_s_minimum: found "fast", expected type number'),
    ({**with_floor(), "link_floor": None}, "identity x: link_floor: found null, expected type object"),
])
def test_a_floor_in_the_wrong_version_or_of_the_wrong_kind_is_refused_in_one_line(document: dict, words: str) -> None:
    with pytest.raises(Refused) as refusal:
        parse_identity_document(document, where="identity x")
    assert str(refusal.value) == words


@pytest.mark.parametrize(("document", "problem"), [
    (with_floor(schema=IDENTITY_SCHEMA_ID),
     f"link_floor: expected none (schema {IDENTITY_SCHEMA_ID}; a floor needs {LINK_FLOOR_SCHEMA_ID})"),
    ({**shipped_document(), "schema": LINK_FLOOR_SCHEMA_ID}, f"link_floor: expected a floor (schema {LINK_FLOOR_SCHEMA_ID})"),
])
def test_an_identity_built_in_python_follows_the_same_version_rule(document: dict, problem: str) -> None:
    with pytest.raises(ValueError, match=r"validation error") as error:
        Identity.model_validate_json(json.dumps(document))
    assert problem in str(error.value)


def test_only_v6s_schema_has_the_floor_and_there_it_is_required() -> None:
    v3, v4 = identity_json_schema(IDENTITY_SCHEMA_ID), identity_json_schema(LINK_FLOOR_SCHEMA_ID)
    assert "link_floor" not in v3["properties"] and "LinkFloor" not in v3["$defs"]
    assert "link_floor" not in v3["required"]
    assert v4["properties"]["link_floor"]["$ref"] == "#/$defs/LinkFloor" and "link_floor" in v4["required"]
    assert v4["$defs"]["LinkFloor"]["required"] == ["gbit_per_s_minimum"]
    jsonschema.Draft202012Validator(v4).validate(with_floor())
    jsonschema.Draft202012Validator(v3).validate(shipped_document())
    assert {key: value for key, value in v4.items() if key not in ("$id", "title", "description", "properties",
                                                                   "required", "$defs")} == {
        key: value for key, value in v3.items() if key not in ("$id", "title", "description", "properties",
                                                               "required", "$defs")}


# --------------------------------------------------------------------------- the judgement


def test_every_handoff_at_or_above_the_floor_passes_naming_the_slowest() -> None:
    verdict = judge_link_floor(rated(9.5, 3.0, 12.25), 3.0)
    detail = "payload rate at or above the link floor 3 Gbit/s in every repetition (slowest 3 Gbit/s)"
    assert verdict.passed and verdict.headline == f"passed: {detail}"
    assert floor_check(verdict) == ("link floor", True, detail)
    assert verdict.reasons == [detail]


def test_handoffs_below_the_floor_are_named_with_their_rates() -> None:
    verdict = judge_link_floor(rated(9.5, 2.5, 1.0), 3.0)
    words = "payload rate below the link floor 3 Gbit/s in repetition 2 (2.5 Gbit/s), 3 (1 Gbit/s)"
    assert not verdict.passed and verdict.reasons == [words]
    assert verdict.headline == f"failed: {words}"
    assert floor_check(verdict) == ("link floor", False, words)


def test_a_rate_just_under_the_floor_prints_in_full_not_as_the_floor() -> None:
    verdict = judge_link_floor(rated(2.9999999999), 3.0)
    assert verdict.reasons == ["payload rate below the link floor 3 Gbit/s in repetition 1 (2.9999999999 Gbit/s)"]


def test_a_rate_that_is_missing_or_no_number_fails_and_is_never_read_as_fast() -> None:
    records = rated(None, "Infinity", True)
    del records[0]["payload_gbit_per_s"]
    verdict = judge_link_floor([*records, "not a record", {"payload_gbit_per_s": 0.5}], 3.0)
    missing = "payload rate missing or not a number in repetition 1, 2, 3, #4"
    slow = "payload rate below the link floor 3 Gbit/s in repetition #5 (0.5 Gbit/s)"
    assert verdict.reasons == [missing, slow]
    assert verdict.headline == f"failed: {missing} (and 1 more)"
    assert floor_check(verdict) == ("link floor", False, f"{missing}; {slow}")


def test_no_samples_fail_the_floor() -> None:
    verdict = judge_link_floor([], 3.0)
    assert not verdict.passed and verdict.reasons == ["no samples to judge the link floor on"]


def test_a_qualification_under_a_floor_needs_the_floor_too() -> None:
    anchors = three(seams_sha256=SEAMS_SHA)
    records = three(seams_sha256=SEAMS_SHA)  # each at 6.866 Gbit/s
    summary = judge_summary(records, RULE2)
    reproduction = judge_reproduction(records, anchors, rung=2, deterministic_producer=True, draft=False)
    floor = judge_link_floor(records, 6.0)
    verdict = judge_qualification(records, RULE2, anchors, deterministic_producer=True, link_floor_gbit_per_s=6.0)
    assert verdict.passed
    assert verdict.headline == f"{summary.headline}; {reproduction.headline}; {floor.headline}"
    assert verdict.reasons == [*summary.reasons, reproduction.headline, floor.headline]
    assert verdict.checks == [*summary.checks, *reproduction.checks, *floor.checks]
    slow = judge_qualification(records, RULE2, anchors, deterministic_producer=True, link_floor_gbit_per_s=7.0)
    assert not slow.passed
    assert slow.reasons == ["payload rate below the link floor 7 Gbit/s in repetition 1 (6.866 Gbit/s), "
                            "2 (6.866 Gbit/s), 3 (6.866 Gbit/s)"]
    unfloored = judge_qualification(records, RULE2, anchors, deterministic_producer=True)
    assert unfloored.checks == [*summary.checks, *reproduction.checks]

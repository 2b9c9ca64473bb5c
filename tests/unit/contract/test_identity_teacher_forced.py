"""A teacher-forced identity (schema v7): full_logits mode teacher-forced with its four numbers,
require_exact_tokens false, bounds by teacher-forced-cell-max-plus-one-sd.v1. It loads, makes the
teacher-forced judging rule, and every mix of it with the exact-token form is refused naming the
field, by the schema layer and by the model alike. (The committed v7 schema equals the generated one:
tests/unit/contract/test_shipped_contracts.py checks every version.)"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from pydantic import ValidationError

from qualify.contract.identity import (
    IDENTITY_SCHEMA_ID,
    IDENTITY_SCHEMA_PATHS,
    TEACHER_FORCED_SCHEMA_ID,
    Identity,
    TeacherForcedLogits,
    identity_json_schema,
    identity_sha256,
    parse_identity_document,
    validate_identity_document,
)
from qualify.contract.rules import (
    BOUND_RULE,
    BOUND_RULE_STATEMENT,
    TEACHER_FORCED_BOUND_RULE,
    TEACHER_FORCED_BOUND_RULE_STATEMENT,
)
from qualify.core.assets import CONTRACTS_DIR
from qualify.core.digests import jcs_sha256
from qualify.core.errors import Refused
from qualify.evidence.records import BoundedDriftRule, rule_from_identity
from tests.unit.contract.test_identity import mutated

SHIPPED = CONTRACTS_DIR / "nvfp4-native-w4a4-identity-v1.json"
"""A shipped v5 rung-2 identity (bounded-drift, exact tokens) the v7 documents are made from."""

NUMBERS = {"maximum_absolute": 2.5, "maximum_mean_absolute": 0.25, "near_tie_margin": 0.75,
           "maximum_changed_row_share": 0.0625}
RULE = "onboarding_qualification"
LOGITS = f"{RULE}.full_logits"


def shipped_document() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(SHIPPED.read_text(encoding="utf-8"))
    assert document["schema"] == IDENTITY_SCHEMA_ID and document["rung"] == 2
    return document


def v7_document() -> dict[str, Any]:
    document = shipped_document()
    document["schema"] = TEACHER_FORCED_SCHEMA_ID
    document[RULE]["require_exact_tokens"] = False
    document[RULE]["full_logits"] = {"mode": "teacher-forced", **NUMBERS}
    document["calibration"]["bound_rule"] = {"name": TEACHER_FORCED_BOUND_RULE,
                                             "statement": TEACHER_FORCED_BOUND_RULE_STATEMENT}
    document["link_floor"] = None
    return document


def refusal(document: dict[str, Any]) -> str:
    """The one-line refusal of loading ``document`` (schema layer, then model)."""
    with pytest.raises(Refused) as caught:
        parse_identity_document(document, where="identity x")
    message = str(caught.value)
    assert "\n" not in message and message.startswith("identity x: ")
    return message


def model_refusal(document: dict[str, Any]) -> str:
    """What the model alone says of ``document`` (an identity built in Python, no schema layer)."""
    with pytest.raises(ValidationError) as caught:
        Identity.model_validate_json(json.dumps(document))
    return str(caught.value)


# --------------------------------------------------------------------------- a v7 identity


def test_a_v7_identity_loads_judged_teacher_forced_and_keeps_its_document() -> None:
    document = v7_document()
    identity = parse_identity_document(document, where="identity x")
    assert identity.schema_id == TEACHER_FORCED_SCHEMA_ID and identity.teacher_forced
    logits = identity.onboarding_qualification.full_logits
    assert isinstance(logits, TeacherForcedLogits)
    assert {name: getattr(logits, name) for name in NUMBERS} == NUMBERS
    assert identity.onboarding_qualification.require_exact_tokens is False
    assert identity.link_floor is None
    assert identity.document() == document  # link_floor: null stays in a v7 document


def test_a_v7_identity_is_sealed_by_the_sha256_of_its_rfc8785_bytes() -> None:
    document = v7_document()
    identity = parse_identity_document(document, where="identity x")
    assert identity_sha256(identity) == jcs_sha256(document)
    sealed = {identity.seal_name: jcs_sha256(document)}
    assert validate_identity_document(document, where="identity x", sealed_identities=sealed) == identity
    assert identity_sha256(identity) != identity_sha256(parse_identity_document(shipped_document(), where="y"))


def test_the_shipped_v5_identity_is_not_teacher_forced() -> None:
    assert not parse_identity_document(shipped_document(), where="identity y").teacher_forced


def test_a_v7_identity_may_declare_a_link_floor() -> None:
    identity = parse_identity_document(mutated(v7_document(), "link_floor", {"gbit_per_s_minimum": 3.0}), where="x")
    assert identity.link_floor is not None and identity.link_floor.gbit_per_s_minimum == 3.0


def test_a_v7_identity_must_state_its_link_floor_even_when_null() -> None:
    document = v7_document()
    del document["link_floor"]
    assert refusal(document) == "identity x: link_floor: missing, expected this field"


def test_a_v7_share_ceiling_of_exactly_one_loads() -> None:
    identity = parse_identity_document(mutated(v7_document(), f"{LOGITS}.maximum_changed_row_share", 1.0), where="x")
    rule = rule_from_identity(identity, drift_graded=True)
    assert isinstance(rule, BoundedDriftRule) and rule.maximum_changed_row_share == 1.0


@pytest.mark.parametrize("drift_graded", [True, False])
def test_a_v7_identity_makes_the_teacher_forced_rule_with_its_four_numbers(drift_graded: bool) -> None:
    identity = parse_identity_document(v7_document(), where="identity x")
    rule = rule_from_identity(identity, drift_graded=drift_graded)
    assert isinstance(rule, BoundedDriftRule) and rule.teacher_forced
    assert {name: getattr(rule, name) for name in NUMBERS} == NUMBERS
    assert rule.drift_graded is drift_graded
    assert (rule.repetitions, rule.output_tokens) == (3, 256)


def test_a_v5_identity_makes_the_exact_token_rule() -> None:
    rule = rule_from_identity(parse_identity_document(shipped_document(), where="identity y"), drift_graded=True)
    assert isinstance(rule, BoundedDriftRule) and not rule.teacher_forced
    assert rule.near_tie_margin is None and rule.maximum_changed_row_share is None


# --------------------------------------------------------------------------- refusals, each naming the field


def _v7_bounded_drift() -> dict[str, Any]:
    return mutated(v7_document(), LOGITS, shipped_document()[RULE]["full_logits"])


def _v5_teacher_forced() -> dict[str, Any]:
    document = mutated(v7_document(), "schema", IDENTITY_SCHEMA_ID)
    del document["link_floor"]
    return document


def _exact_tokens_under_teacher_forced() -> dict[str, Any]:
    return mutated(v7_document(), f"{RULE}.require_exact_tokens", True)


def _exact_token_bound_rule_under_teacher_forced() -> dict[str, Any]:
    return mutated(v7_document(), "calibration.bound_rule", {"name": BOUND_RULE, "statement": BOUND_RULE_STATEMENT})


REFUSED = {
    # case: (document, what the schema layer's refusal starts with, what the model's names)
    "v7-with-bounded-drift": (_v7_bounded_drift, f"identity x: {LOGITS}.",
                              f'{LOGITS}.mode: found "bounded-drift", schema "{TEACHER_FORCED_SCHEMA_ID}"'),
    "v5-with-teacher-forced": (_v5_teacher_forced, f'identity x: {LOGITS}.mode: found "teacher-forced"',
                               f'{LOGITS}.mode: found "teacher-forced", schema "{IDENTITY_SCHEMA_ID}"'),
    "exact-tokens-under-teacher-forced": (_exact_tokens_under_teacher_forced,
                                          f"identity x: {RULE}.require_exact_tokens: found true",
                                          f"{RULE}.require_exact_tokens: found true, expected false"),
    "exact-token-bound-rule-under-teacher-forced": (
        _exact_token_bound_rule_under_teacher_forced,
        f'identity x: calibration.bound_rule.name: found "{BOUND_RULE}", expected {TEACHER_FORCED_BOUND_RULE}',
        f'calibration.bound_rule.name: found "{BOUND_RULE}", expected {TEACHER_FORCED_BOUND_RULE}'),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_mix_of_the_teacher_forced_and_exact_token_forms_is_refused_naming_the_field(case: str) -> None:
    make, loaded, modelled = REFUSED[case]
    assert refusal(make()).startswith(loaded)
    assert modelled in model_refusal(make())


@pytest.mark.parametrize(("value", "words"), [(0.0, "expected a number > 0"), (-0.25, "expected a number > 0"),
                                              (1.5, "expected a number <= 1"),
                                              (1.0000000000000002, "expected a number <= 1")])
def test_a_share_ceiling_of_zero_or_above_one_is_refused_naming_the_field(value: float, words: str) -> None:
    document = mutated(v7_document(), f"{LOGITS}.maximum_changed_row_share", value)
    assert refusal(document) == f"identity x: {LOGITS}.maximum_changed_row_share: found {value!r}, {words}"
    assert "maximum_changed_row_share" in model_refusal(document)


@pytest.mark.parametrize("field", ["near_tie_margin", "maximum_absolute", "maximum_mean_absolute"])
def test_a_teacher_forced_number_of_zero_is_refused_naming_the_field(field: str) -> None:
    document = mutated(v7_document(), f"{LOGITS}.{field}", 0.0)
    assert refusal(document).startswith(f"identity x: {LOGITS}.{field}: found 0.0")
    assert field in model_refusal(document)


@pytest.mark.parametrize("field", list(NUMBERS))
def test_a_teacher_forced_rule_missing_a_number_is_refused_naming_it(field: str) -> None:
    document = v7_document()
    del document[RULE]["full_logits"][field]
    assert refusal(document) == f"identity x: {LOGITS}.{field}: missing, expected this field"


def test_a_mean_bound_above_the_max_bound_is_refused_under_teacher_forced_too() -> None:
    document = mutated(v7_document(), f"{LOGITS}.maximum_mean_absolute", 3.0)
    assert refusal(document).startswith(f"identity x: {LOGITS}.maximum_mean_absolute: found 3.0, expected at most")


# --------------------------------------------------------------------------- the committed v7 schema


def committed_v7_schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(IDENTITY_SCHEMA_PATHS[TEACHER_FORCED_SCHEMA_ID].read_text(encoding="utf-8"))
    return schema


def test_the_committed_v7_schema_validates_a_v7_document_and_the_v5_schema_refuses_it() -> None:
    jsonschema.Draft202012Validator(committed_v7_schema()).validate(v7_document())
    jsonschema.Draft202012Validator(committed_v7_schema()).validate(
        mutated(v7_document(), "link_floor", {"gbit_per_s_minimum": 3.0}))
    assert not jsonschema.Draft202012Validator(identity_json_schema(IDENTITY_SCHEMA_ID)).is_valid(v7_document())


@pytest.mark.parametrize(("path", "value"), [
    (f"{RULE}.require_exact_tokens", True),
    (LOGITS, {"mode": "bounded-drift", "maximum_absolute": 2.5, "maximum_mean_absolute": 0.25}),
    (f"{LOGITS}.maximum_changed_row_share", 0.0),
    (f"{LOGITS}.maximum_changed_row_share", 1.5),
    (f"{LOGITS}.near_tie_margin", 0.0),
    ("schema", IDENTITY_SCHEMA_ID),
])
def test_the_committed_v7_schema_refuses_what_v7_does_not_allow(path: str, value: Any) -> None:
    validator = jsonschema.Draft202012Validator(committed_v7_schema())
    assert validator.is_valid(v7_document())
    assert not validator.is_valid(mutated(v7_document(), path, value))


def test_the_v5_schema_keeps_exact_tokens_and_no_teacher_forced_mode() -> None:
    v5 = identity_json_schema(IDENTITY_SCHEMA_ID)
    assert "TeacherForcedLogits" not in v5["$defs"]
    assert v5["$defs"]["OnboardingQualification"]["properties"]["require_exact_tokens"] == {"const": True, "type": "boolean"}
    jsonschema.Draft202012Validator(v5).validate(shipped_document())

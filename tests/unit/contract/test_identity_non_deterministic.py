"""An identity whose producer is declared non-deterministic (schema v8): rung 2,
require_deterministic_remote_output false and, then and only then, a sealed fixture envelope (rule,
handoffs, producer starts, multipliers, ceilings digest). It loads under either rung-2 mode, keeps
its document, and every inconsistent or unknown field is refused in one line naming it, by the
schema layer and by the model alike; the older versions load as they did. (The committed v8 schema
equals the generated one: tests/unit/contract/test_shipped_contracts.py checks every version.)
The refusals' words are in tests/golden/contract.identity.txt."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from pydantic import ValidationError

from qualify.contract.identity import (
    IDENTITY_SCHEMA_ID,
    IDENTITY_SCHEMA_PATHS,
    NON_DETERMINISTIC_SCHEMA_ID,
    TEACHER_FORCED_SCHEMA_ID,
    Identity,
    identity_json_schema,
    identity_sha256,
    parse_identity_document,
)
from qualify.contract.rules import (
    BOUND_RULE,
    BOUND_RULE_STATEMENT,
    FIXTURE_ENVELOPE_RULE,
    FIXTURE_ENVELOPE_RULE_STATEMENT,
)
from qualify.core.digests import jcs_sha256
from tests.unit.contract.test_identity import make_document, mutated
from tests.unit.contract.test_identity_teacher_forced import LOGITS, RULE, refusal, shipped_document, v7_document

ENVELOPE = f"{RULE}.fixture_envelope"
SEALED = {
    "rule": {"name": FIXTURE_ENVELOPE_RULE, "statement": FIXTURE_ENVELOPE_RULE_STATEMENT},
    "handoffs": 8,
    "producer_starts": 2,
    "multipliers": {"row_max_abs": 2.0, "row_mean_abs": 2.0, "position_max_abs": 7.17,
                    "tensor_position_max_abs": 6.56},
    "ceilings_sha256": "ab" * 32,
}


def declared_non_deterministic(document: dict[str, Any]) -> dict[str, Any]:
    """``document`` as v8, its producer declared non-deterministic with the sealed envelope."""
    document["schema"] = NON_DETERMINISTIC_SCHEMA_ID
    document[RULE]["require_deterministic_remote_output"] = False
    document[RULE]["fixture_envelope"] = json.loads(json.dumps(SEALED))
    document["link_floor"] = None
    return document


def v8_document() -> dict[str, Any]:
    """The shipped default lane's v5 document declared non-deterministic (bounded-drift, exact tokens)."""
    return declared_non_deterministic(shipped_document())


def v8_teacher_forced() -> dict[str, Any]:
    """A v7 document declared non-deterministic: v8 judges either rung-2 mode."""
    return declared_non_deterministic(v7_document())


def model_refusal(document: dict[str, Any]) -> str:
    """What the model alone says of ``document``, a content rule's field joined to where it runs."""
    with pytest.raises(ValidationError) as caught:
        Identity.model_validate_json(json.dumps(document))
    return str(caught.value).replace("\n  ", ".")


# --------------------------------------------------------------------------- a v8 identity


@pytest.mark.parametrize("make", [v8_document, v8_teacher_forced])
def test_a_v8_identity_loads_declared_non_deterministic_with_its_sealed_envelope(make: Any) -> None:
    document = make()
    identity = parse_identity_document(document, where="identity x")
    assert identity.schema_id == NON_DETERMINISTIC_SCHEMA_ID and not identity.deterministic_producer
    sealed = identity.onboarding_qualification.fixture_envelope
    assert sealed is not None
    assert (sealed.rule.name, sealed.handoffs, sealed.producer_starts, sealed.ceilings_sha256) == (
        FIXTURE_ENVELOPE_RULE, 8, 2, "ab" * 32)
    assert sealed.multipliers.position_max_abs == 7.17
    assert identity.document() == document
    assert identity_sha256(identity) == jcs_sha256(document)  # the envelope is under the seal


def test_a_v8_identity_may_declare_a_link_floor() -> None:
    identity = parse_identity_document(mutated(v8_document(), "link_floor", {"gbit_per_s_minimum": 3.0}), where="x")
    assert identity.link_floor is not None and identity.link_floor.gbit_per_s_minimum == 3.0


@pytest.mark.parametrize("make", [shipped_document, v7_document])
def test_the_older_versions_load_deterministic_and_carry_no_envelope(make: Any) -> None:
    document = make()
    identity = parse_identity_document(document, where="identity y")
    assert identity.deterministic_producer and identity.onboarding_qualification.fixture_envelope is None
    assert identity.document() == document  # no fixture_envelope key appears in their documents
    assert "fixture_envelope" not in identity.document()[RULE]


def test_a_different_sealed_digest_is_a_different_identity() -> None:
    moved = mutated(v8_document(), f"{ENVELOPE}.ceilings_sha256", "cd" * 32)
    assert identity_sha256(parse_identity_document(moved, where="x")) != identity_sha256(
        parse_identity_document(v8_document(), where="x"))


# --------------------------------------------------------------------------- refusals, each naming the field


def _v8_deterministic() -> dict[str, Any]:
    return mutated(v8_document(), f"{RULE}.require_deterministic_remote_output", True)


def _v5_non_deterministic() -> dict[str, Any]:
    return mutated(shipped_document(), f"{RULE}.require_deterministic_remote_output", False)


def _v7_non_deterministic() -> dict[str, Any]:
    return mutated(v7_document(), f"{RULE}.require_deterministic_remote_output", False)


def _v8_without_envelope() -> dict[str, Any]:
    document = v8_document()
    del document[RULE]["fixture_envelope"]
    return document


def _v8_null_envelope() -> dict[str, Any]:
    return mutated(v8_document(), ENVELOPE, None)


def _v5_with_envelope() -> dict[str, Any]:
    return mutated(shipped_document(), ENVELOPE, json.loads(json.dumps(SEALED)))


def _unknown_envelope_field() -> dict[str, Any]:
    return mutated(v8_document(), f"{ENVELOPE}.ceilings", [1.0, 2.0])


def _unknown_multiplier() -> dict[str, Any]:
    return mutated(v8_document(), f"{ENVELOPE}.multipliers.row_p99_abs", 2.0)


def _more_starts_than_handoffs() -> dict[str, Any]:
    return mutated(v8_document(), f"{ENVELOPE}.producer_starts", 9)


def _another_rule() -> dict[str, Any]:
    return mutated(v8_document(), f"{ENVELOPE}.rule", {"name": BOUND_RULE, "statement": BOUND_RULE_STATEMENT})


def _a_reworded_rule() -> dict[str, Any]:
    return mutated(v8_document(), f"{ENVELOPE}.rule.statement", FIXTURE_ENVELOPE_RULE_STATEMENT + " or so")


def _a_multiplier_below_two() -> dict[str, Any]:
    return mutated(v8_document(), f"{ENVELOPE}.multipliers.row_max_abs", 1.5)


def _too_few_handoffs() -> dict[str, Any]:
    return mutated(v8_document(), f"{ENVELOPE}.handoffs", 3)


def _one_start() -> dict[str, Any]:
    return mutated(v8_document(), f"{ENVELOPE}.producer_starts", 1)


def _placeholder_digest() -> dict[str, Any]:
    return mutated(v8_document(), f"{ENVELOPE}.ceilings_sha256", "0" * 64)


def _rung3_non_deterministic() -> dict[str, Any]:
    return declared_non_deterministic(make_document("kquant-exact-dflash"))


def _v8_exact_mode() -> dict[str, Any]:
    return mutated(v8_document(), LOGITS, {"mode": "exact"})


REFUSED = {
    # case: (document, the field the refusal names)
    "v8 declaring a deterministic producer": (_v8_deterministic, f"{RULE}.require_deterministic_remote_output"),
    "v5 declaring a non-deterministic producer": (_v5_non_deterministic, f"{RULE}.require_deterministic_remote_output"),
    "v7 declaring a non-deterministic producer": (_v7_non_deterministic, f"{RULE}.require_deterministic_remote_output"),
    "v8 without its envelope": (_v8_without_envelope, ENVELOPE),
    "v8 with a null envelope": (_v8_null_envelope, ENVELOPE),
    "v5 with an envelope": (_v5_with_envelope, RULE),
    "an unknown envelope field": (_unknown_envelope_field, f"{ENVELOPE}.ceilings"),
    "an unknown multiplier": (_unknown_multiplier, f"{ENVELOPE}.multipliers.row_p99_abs"),
    "more producer starts than handoffs": (_more_starts_than_handoffs, f"{ENVELOPE}.producer_starts"),
    "another rule": (_another_rule, f"{ENVELOPE}.rule.name"),
    "a reworded rule": (_a_reworded_rule, f"{ENVELOPE}.rule.statement"),
    "a multiplier below two": (_a_multiplier_below_two, f"{ENVELOPE}.multipliers.row_max_abs"),
    "three handoffs": (_too_few_handoffs, f"{ENVELOPE}.handoffs"),
    "one producer start": (_one_start, f"{ENVELOPE}.producer_starts"),
    "the placeholder digest": (_placeholder_digest, f"{ENVELOPE}.ceilings_sha256"),
    "rung 3 declared non-deterministic": (_rung3_non_deterministic, ""),
    "v8 with the exact mode": (_v8_exact_mode, LOGITS),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_inconsistent_or_unknown_field_is_refused_in_one_line_naming_it(case: str) -> None:
    make, field = REFUSED[case]
    assert refusal(make()).startswith(f"identity x: {field}")


MODEL_REFUSED = {
    # What the model alone refuses (an identity built in Python, no schema layer), by the field named.
    "v8 declaring a deterministic producer": f"{RULE}.require_deterministic_remote_output",
    "v5 declaring a non-deterministic producer": f"{RULE}.require_deterministic_remote_output",
    "v8 without its envelope": ENVELOPE,
    "v5 with an envelope": ENVELOPE,
    "an unknown envelope field": f"{ENVELOPE}.ceilings",
    "more producer starts than handoffs": f"{ENVELOPE}.producer_starts",
    "another rule": f"{ENVELOPE}.rule.name",
    "a multiplier below two": f"{ENVELOPE}.multipliers.row_max_abs",
    "three handoffs": f"{ENVELOPE}.handoffs",
    "rung 3 declared non-deterministic": f"{RULE}.require_deterministic_remote_output",
}


@pytest.mark.parametrize("case", list(MODEL_REFUSED))
def test_the_model_itself_refuses_what_the_schema_also_refuses(case: str) -> None:
    make, _ = REFUSED[case]
    assert MODEL_REFUSED[case] in model_refusal(make())


# --------------------------------------------------------------------------- the committed v8 schema


def committed_v8_schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(IDENTITY_SCHEMA_PATHS[NON_DETERMINISTIC_SCHEMA_ID].read_text(encoding="utf-8"))
    return schema


def test_the_committed_v8_schema_validates_both_rung2_modes_and_the_older_schemas_refuse_them() -> None:
    validator = jsonschema.Draft202012Validator(committed_v8_schema())
    for document in (v8_document(), v8_teacher_forced()):
        validator.validate(document)
        for older in (IDENTITY_SCHEMA_ID, TEACHER_FORCED_SCHEMA_ID):
            assert not jsonschema.Draft202012Validator(identity_json_schema(older)).is_valid(document)


@pytest.mark.parametrize(("path", "value"), [
    (f"{RULE}.require_deterministic_remote_output", True),
    (ENVELOPE, None),
    (f"{ENVELOPE}.handoffs", 3),
    (f"{ENVELOPE}.producer_starts", 1),
    (f"{ENVELOPE}.multipliers.row_mean_abs", 1.0),
    (f"{ENVELOPE}.extra", 1),
    (LOGITS, {"mode": "exact"}),
])
def test_the_committed_v8_schema_refuses_what_v8_does_not_allow(path: str, value: Any) -> None:
    validator = jsonschema.Draft202012Validator(committed_v8_schema())
    assert validator.is_valid(v8_document())
    assert not validator.is_valid(mutated(v8_document(), path, value))


def test_the_older_schemas_fix_a_deterministic_producer_and_know_no_envelope() -> None:
    for schema_id in (IDENTITY_SCHEMA_ID, TEACHER_FORCED_SCHEMA_ID):
        schema = identity_json_schema(schema_id)
        rule = schema["$defs"]["OnboardingQualification"]["properties"]
        assert rule["require_deterministic_remote_output"] == {"const": True, "type": "boolean"}
        assert "fixture_envelope" not in rule and "SealedFixtureEnvelope" not in schema["$defs"]

"""Contract schemas: every shipped one is a valid draft 2020-12 schema (the check the runtime leaves
to this test, since it costs about 0.17 s per schema in every process), and a schema file the
validators cannot speak is refused naming the file, never used."""

from __future__ import annotations

import json

import jsonschema
import pytest

from qualify.core import assets
from qualify.core.errors import Refused
from qualify.core.strict_json import check_schema, schema_validator

SHIPPED_SCHEMAS = sorted(assets.CONTRACTS_DIR.glob("*.schema.json"))


def test_the_contracts_folder_ships_schemas() -> None:
    assert len(SHIPPED_SCHEMAS) >= 30


@pytest.mark.parametrize("schema_path", SHIPPED_SCHEMAS, ids=lambda path: path.name)
def test_every_shipped_schema_passes_the_draft_2020_12_meta_schema(schema_path) -> None:
    schema = json.loads(schema_path.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema_validator(schema_path).schema == schema  # the runtime loader takes it as it is


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        json.dumps(["a", "list"]),
        json.dumps({"type": "object"}),
        json.dumps({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object"}),
    ],
    ids=["not-json", "not-an-object", "no-draft", "draft-07"],
)
def test_a_schema_file_the_validators_cannot_speak_is_refused_naming_the_file(tmp_path, text) -> None:
    schema_path = tmp_path / "odd.schema.json"
    schema_path.write_text(text, encoding="utf-8")
    with pytest.raises(Refused) as refused:
        check_schema({}, schema_path, "document")
    assert str(schema_path) in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_missing_schema_file_is_refused_naming_it(tmp_path) -> None:
    with pytest.raises(Refused) as refused:
        check_schema({}, tmp_path / "absent.schema.json", "document")
    assert "absent.schema.json" in str(refused.value)


def test_the_validator_keeps_json_types_strict(tmp_path) -> None:
    schema_path = tmp_path / "count.schema.json"
    schema_path.write_text(json.dumps({"$schema": "https://json-schema.org/draft/2020-12/schema",
                                       "type": "object", "properties": {"count": {"type": "integer"}}}))
    check_schema({"count": 4}, schema_path, "document")
    for not_an_integer in (4.0, True, 1 << 63):
        with pytest.raises(Refused):
            check_schema({"count": not_an_integer}, schema_path, "document")

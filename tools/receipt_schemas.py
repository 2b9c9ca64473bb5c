#!/usr/bin/env python3
"""Generate the JSON Schemas of a receipt's data files, so the committed ones never drift.

The sample record and the validation summary (v3, and the older v2 and v1) are generated from
their pydantic models (``qualify.evidence.records``; v3's ``scope`` from
``qualify.archive.writer.ScopeRecord``); host.json and versions.json, which have no model,
from the constants their writers use (``qualify.core.hostenv``, ``qualify.archive.layout``). The
manifest, envelope, statement and trust schemas are written by hand and not touched here. The
format as a whole: docs/receipts.md.

    .venv/bin/python tools/receipt_schemas.py --check   # exit 0 in step, 1 a committed file differs
    .venv/bin/python tools/receipt_schemas.py --write   # regenerate them (a reviewed change)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydantic import TypeAdapter
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema

from qualify.archive.layout import HOST_SCHEMA, RUN_ID
from qualify.archive.writer import SCOPED_SUMMARY_SCHEMA, ScopeRecord
from qualify.core.assets import CONTRACTS_DIR
from qualify.core.hostenv import HOST_FACTS_KEYS, HOST_FACTS_MAX_BYTES, HOST_FACTS_SCHEMA
from qualify.evidence.records import (
    LEGACY_SUMMARY_SCHEMA,
    REQUIRED_SAMPLE_FIELDS,
    SAMPLE_SCHEMA,
    SUMMARY_SCHEMA,
    QualificationRule,
    SampleRecord,
    ValidationSummary,
)

VERSIONS_SCHEMA = "trust-ladder.receipt-versions.v1"
NON_FINITE = ("NaN", "Infinity", "-Infinity")
"""How the JSON form writes a non-finite float (``ser_json_inf_nan="strings"``): as evidence."""
TIMESTAMP = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?Z$"
SHA256 = r"^[0-9a-f]{64}$"
HOST_TEXT_MAX, HOST_ITEMS_MAX, HOST_DEPTH_MAX = 512, 256, 6
"""host_facts_problem's bounds (``qualify.core.hostenv``): string length, list and object size,
nesting depth; tests/unit/contract/test_receipt_schemas.py checks the schema refuses what it refuses."""


class _FileFormSchema(GenerateJsonSchema):
    """Pydantic's generator for a file's JSON form: no per-field titles or defaults, and every
    field required, because the writer dumps every field (null when not measured)."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False

    def field_is_required(self, field: Any, total: bool) -> bool:
        return True

    def default_schema(self, schema: core_schema.WithDefaultSchema) -> JsonSchemaValue:
        generated = super().default_schema(schema)
        generated.pop("default", None)
        return generated


class _EvidenceSchema(_FileFormSchema):
    """A measured float may be written as "NaN"/"Infinity"/"-Infinity" (the judge refuses it
    there, rather than the number vanishing), unless its field forbids non-finite values."""

    def float_schema(self, schema: core_schema.FloatSchema) -> JsonSchemaValue:
        number = super().float_schema(schema)
        if schema.get("allow_inf_nan") is False:
            return number
        return {"anyOf": [number, {"enum": list(NON_FINITE)}]}


def _head(schema_id: str, title: str, description: str) -> dict[str, Any]:
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": schema_id,
            "title": title, "description": description}


def _is(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """A condition on one property (which the schema requires, so it is always there to test)."""
    return {"properties": {name: schema}}


def _not_null(names: Sequence[str]) -> dict[str, Any]:
    return {"properties": {name: {"not": {"type": "null"}} for name in names}}


ADDED_BY_TEACHER_FORCED_RULE: dict[str, tuple[str, ...]] = {
    "SampleRecord": ("max_row_mean_abs",),
    "TeacherForcedSummary": ("max_row_mean_abs", "partings"),
    "BoundedDriftRule": ("near_tie_margin", "maximum_changed_row_share"),
    "ScopeRecord": ("judged_by", "envelope"),
}
"""Fields the teacher-forced rule (and, for ``envelope``, the fixture envelope) added to forms that
receipts written before it lack: written by every writer since (null when not measured), optional
to a schema so an older receipt still fits."""


def _optional_where_added(definitions: dict[str, Any]) -> None:
    """Take :data:`ADDED_BY_TEACHER_FORCED_RULE`'s fields out of ``required`` where they appear."""
    for name, fields in ADDED_BY_TEACHER_FORCED_RULE.items():
        definition = definitions.get(name)
        if definition is not None:
            definition["required"] = [field for field in definition["required"] if field not in fields]


def sample_record_schema() -> dict[str, Any]:
    """``samples/sample-<n>.json``: :class:`SampleRecord`'s JSON form (:func:`record_json`)."""
    generated = SampleRecord.model_json_schema(by_alias=True, mode="serialization", schema_generator=_EvidenceSchema)
    generated.pop("title")
    description = generated.pop("description").replace("\n", " ")
    generated["properties"]["schema"] = {"const": SAMPLE_SCHEMA}
    generated["properties"]["error"] = {"oneOf": [{"type": "null"}, {"type": "string", "pattern": r"\S"}]}
    # The model's own rule: a sample without an error holds every required measurement.
    generated["if"] = {"properties": {"error": {"type": "null"}}}
    generated["then"] = _not_null(REQUIRED_SAMPLE_FIELDS)
    _optional_where_added({"SampleRecord": generated, **generated["$defs"]})
    head = _head(SAMPLE_SCHEMA, "Sample record (samples/sample-<n>.json)",
                 f"{description} Every field is present (null when not measured); a non-finite measurement is "
                 f"the string NaN, Infinity or -Infinity. Generated from qualify.evidence.records.SampleRecord by "
                 f"tools/receipt_schemas.py.")
    return {**head, **generated}


def scope_schema() -> dict[str, Any]:
    """A verdict's scope (:class:`qualify.archive.writer.ScopeRecord`) with its parts under
    ``$defs``: the form the v3 summary's ``scope`` and ``--json``'s recipe document share."""
    generated = ScopeRecord.model_json_schema(by_alias=True, mode="serialization", schema_generator=_FileFormSchema)
    defs = {**generated.pop("$defs"), "ScopeRecord": generated}
    for part in defs.values():
        part["description"] = part["description"].replace("\n", " ").replace(":func:", "")
    return defs


def summary_schema(schema_id: str) -> dict[str, Any]:
    """``validation-summary.json`` of one version: :class:`ValidationSummary` with its rule typed
    as the judging rule it holds (v1 has no ``status``; v3 adds the verdict's ``scope``)."""
    generated = ValidationSummary.model_json_schema(by_alias=True, mode="serialization",
                                                    schema_generator=_FileFormSchema)
    # Validation mode: the rule's serializer drops its unused clauses, which serialization mode cannot describe.
    rule = TypeAdapter(QualificationRule).json_schema(mode="validation", schema_generator=_FileFormSchema)
    generated["$defs"].update(rule.pop("$defs"))
    generated.pop("title")
    description = generated.pop("description").replace("``", "")
    properties = generated["properties"]
    properties["schema"] = {"const": schema_id}
    properties["run_id"] = {"type": "string", "pattern": RUN_ID.pattern, "description": "the receipt directory's name"}
    properties["rule"] = {"oneOf": [{"type": "null"}, rule]}
    if schema_id != SCOPED_SUMMARY_SCHEMA:  # written before the teacher-forced rule existed: the rule as it then was
        for name in ADDED_BY_TEACHER_FORCED_RULE["BoundedDriftRule"]:
            del generated["$defs"]["BoundedDriftRule"]["properties"][name]
            generated["$defs"]["BoundedDriftRule"]["required"].remove(name)
    properties["started_utc"] = properties["finished_utc"] = {"type": "string", "pattern": TIMESTAMP}
    if schema_id in (SUMMARY_SCHEMA, SCOPED_SUMMARY_SCHEMA):
        properties["status"] = {"enum": ["passed", "failed", "refused", "incomplete"]}
        generated["allOf"] = [  # the model's own rules (ValidationSummary._status_matches)
            {"if": _is("passed", {"const": True}), "then": _is("status", {"const": "passed"}),
             "else": _is("status", {"not": {"const": "passed"}})},
            {"if": _is("identity_sha256", {"type": "null"}), "then": _is("status", {"const": "refused"})},
            {"if": _is("lane", {"type": "null"}), "then": _is("identity_sha256", {"type": "null"})},
        ]
        note = (" status: passed (qualified), failed (judged, not qualified), refused (before any evidence) or "
                "incomplete (ended before its verdict); passed is true exactly when status is passed. "
                "identity_sha256 is null only in a run refused before its identity loaded (no identity.json), "
                "lane null only then too.")
        if schema_id == SCOPED_SUMMARY_SCHEMA:
            generated["$defs"].update(scope_schema())
            properties["scope"] = {"oneOf": [{"type": "null"}, {"$ref": "#/$defs/ScopeRecord"}]}
            generated["required"].append("scope")
            generated["allOf"].append(  # a run that judged nothing states no scope
                {"if": _is("status", {"enum": ["refused", "incomplete"]}), "then": _is("scope", {"type": "null"})})
            note += (" scope: what the verdict covers (qualify.judge.scope.scope_document): the scope line, its "
                     "fixture and controls halves word for word, the fixture, and the lane's E2 controls against "
                     "their E1 gates (null when the lane declares none); null when the verdict has no scope (a "
                     "calibration, a run refused or stopped before its verdict), always null for refused and "
                     "incomplete.")
    else:
        del properties["status"]
        generated["required"].remove("status")
        for name in ("lane", "identity_sha256"):  # v1 summaries always name both
            properties[name] = next(branch for branch in properties[name]["anyOf"] if branch != {"type": "null"})
        note = " Legacy: written before status existed; passed and error say how the run ended."
    _optional_where_added(generated["$defs"])
    head = _head(schema_id, f"Validation summary {schema_id.rsplit('.', 1)[1]} (validation-summary.json)",
                 f"{description}{note} Generated from qualify.evidence.records.ValidationSummary by "
                 f"tools/receipt_schemas.py.")
    return {**head, **generated}


def _host_value(depth: int) -> dict[str, Any]:
    """A value at ``depth`` of a host-facts document: a bounded scalar, list or object; one at
    the deepest level holds no containers with items (their items would be too deep)."""
    inner: dict[str, Any] = {"$ref": f"#/$defs/depth{depth + 1}"} if depth < HOST_DEPTH_MAX else {"not": {}}
    return {"oneOf": [
        {"type": ["null", "boolean", "integer", "number"]},
        {"type": "string", "maxLength": HOST_TEXT_MAX},
        {"type": "array", "maxItems": HOST_ITEMS_MAX, "items": inner},
        {"type": "object", "maxProperties": HOST_ITEMS_MAX, "propertyNames": {"minLength": 1, "maxLength": 64},
         "additionalProperties": inner},
    ]}


def host_schema() -> dict[str, Any]:
    """``host.json``: the consumer's host facts and, per producer start, its facts or why they are missing."""
    objects = {"cpu", "env", "blas", "numpy", "harness"}
    properties: dict[str, Any] = {
        "schema": {"const": HOST_FACTS_SCHEMA},
        "pid": {"type": "integer", "minimum": 1},
        **{name: {"allOf": [{"$ref": "#/$defs/depth1"}, {"type": "string"}]} for name in ("python", "machine", "platform")},
        **{name: {"allOf": [{"$ref": "#/$defs/depth1"}, {"type": "object"}]} for name in objects},
        **{name: {"allOf": [{"$ref": "#/$defs/depth1"}, {"type": ["object", "null"]}]} for name in ("torch", "gpu")},
    }
    assert set(properties) == HOST_FACTS_KEYS, "qualify.core.hostenv.HOST_FACTS_KEYS changed; update host_schema"
    facts = {"type": "object", "additionalProperties": False, "required": sorted(HOST_FACTS_KEYS),
             "properties": dict(sorted(properties.items())),
             "description": f"one process's qualify.core.hostenv.host_facts document: CPU model and SIMD flags, BLAS "
                            f"library, kernel and threads, kernel-selecting environment variables, numpy's SIMD "
                            f"dispatch, torch threads and GPUs, the harness's git commit; strings at most "
                            f"{HOST_TEXT_MAX} characters, lists and objects at most {HOST_ITEMS_MAX} entries, keys "
                            f"1 to 64 characters, nesting at most {HOST_DEPTH_MAX} deep, at most "
                            f"{HOST_FACTS_MAX_BYTES} bytes as JSON (the size is not expressible here)"}
    start = {"oneOf": [
        {"type": "object", "additionalProperties": False, "required": ["facts", "note"],
         "properties": {"facts": {"$ref": "#/$defs/facts"}, "note": {"type": "null"}}},
        {"type": "object", "additionalProperties": False, "required": ["facts", "note"],
         "properties": {"facts": {"type": "null"}, "note": {"type": "string", "minLength": 1}}},
    ], "description": "one producer start: the facts it reported when ready, or a note saying why there are none"}
    head = _head(HOST_SCHEMA, "Receipt host facts (host.json)",
                 "What each process of the run ran on: the consumer's facts (taken when the receipt was finalized) "
                 "and one entry per producer start, in order (a calibration restarts its producer for every "
                 "handoff; empty when no producer reached readiness). Recorded, never judged. Generated by "
                 "tools/receipt_schemas.py from qualify.core.hostenv's constants.")
    defs = {"facts": facts, **{f"depth{depth}": _host_value(depth) for depth in range(1, HOST_DEPTH_MAX + 1)}}
    return {**head, "type": "object", "additionalProperties": False, "required": ["schema", "consumer", "producers"],
            "properties": {"schema": {"const": HOST_SCHEMA}, "consumer": {"$ref": "#/$defs/facts"},
                           "producers": {"type": "array", "items": start}},
            "$defs": defs}


def versions_schema() -> dict[str, Any]:
    """``versions.json``: the library versions of the writing process and the run's engines."""
    text = {"type": "string", "minLength": 1, "maxLength": 1000}
    engine = {"type": "object", "additionalProperties": False, "required": ["name", "version", "abi", "digests"],
              "properties": {"name": text, "version": text, "abi": text,
                             "digests": {"type": "object", "additionalProperties": {"type": "string", "pattern": SHA256},
                                         "description": "SHA-256 of each file the engine loads, by path"}},
              "description": "an engine as the run found it: its name, version, ABI string and file digests"}
    head = _head(VERSIONS_SCHEMA, "Receipt versions (versions.json)",
                 "The versions the run's numbers depend on: Python, the platform and the installed libraries "
                 "(qualify.archive.writer.library_versions; a library that is not installed is left out), and the "
                 "run's engines (qualify.run.qualification: the harness version, and the consumer engine once the "
                 "run built it; absent from a run refused before it had one). The file carries no schema field: "
                 "its name says what it is. Generated by tools/receipt_schemas.py.")
    return {**head, "type": "object", "additionalProperties": False, "required": ["libraries"],
            "properties": {
                "libraries": {"type": "object", "required": ["python", "platform"], "additionalProperties": text,
                              "propertyNames": {"pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]*$"},
                              "description": "package name to version string"},
                "engines": {"type": "object", "additionalProperties": False, "required": ["harness"],
                            "properties": {"harness": text, "consumer": engine}},
            }}


GENERATED: Mapping[str, Callable[[], dict[str, Any]]] = {
    "sample-record.v1.schema.json": sample_record_schema,
    "validation-summary.v3.schema.json": lambda: summary_schema(SCOPED_SUMMARY_SCHEMA),
    "validation-summary.v2.schema.json": lambda: summary_schema(SUMMARY_SCHEMA),
    "validation-summary.v1.schema.json": lambda: summary_schema(LEGACY_SUMMARY_SCHEMA),
    "receipt-host.v1.schema.json": host_schema,
    "receipt-versions.v1.schema.json": versions_schema,
}
"""Each generated schema file under contracts/ and what makes it."""


def schema_text(name: str) -> str:
    """The committed form of a generated schema: two-space indented JSON and a newline."""
    return json.dumps(GENERATED[name](), indent=2, ensure_ascii=False) + "\n"


def stale_files(directory: Path = CONTRACTS_DIR) -> list[str]:
    """The generated schema files under ``directory`` that are missing or differ from their generator."""
    stale = []
    for name in GENERATED:
        path = directory / name
        if not path.is_file() or path.read_text(encoding="utf-8") != schema_text(name):
            stale.append(name)
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    """--check: 0 every committed schema is what its generator makes, 1 one differs; --write: regenerate."""
    parser = argparse.ArgumentParser(description="Generate or check the receipt data-file schemas under contracts/.")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--check", action="store_true", help="exit 1 when a committed schema differs from its generator")
    action.add_argument("--write", action="store_true", help="write every generated schema")
    args = parser.parse_args(argv)
    if args.write:
        for name in GENERATED:
            (CONTRACTS_DIR / name).write_text(schema_text(name), encoding="utf-8")
            print(f"# wrote contracts/{name}")
        return 0
    stale = stale_files()
    for name in stale:
        print(f"receipt_schemas: contracts/{name} differs from its generator; "
              f"run: .venv/bin/python tools/receipt_schemas.py --write", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())

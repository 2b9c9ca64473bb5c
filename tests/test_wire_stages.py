"""An unexpected failure anywhere in opening a handoff is refused naming the stage it happened in
(receipts and the tampering tallies group refusals by that name), and the refusals that need their
own inputs to reach: a key or manifest of the wrong type, a non-contiguous payload, a manifest
without a schema, an unsupported expected dtype, a wrong draft context, a payload header with an
extra tensor or a name that is not valid Unicode."""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from typing import Any

import pytest

from qualify.core.errors import HandoffRefused, Refused
from qualify.handoff import wire
from qualify.handoff.wire import Handoff, HandoffExpectation, manifest_canonical_bytes, manifest_mac
from tests.test_handoff_wire import (
    DRAFT_GEOMETRY,
    EXPECTATION,
    GEOMETRY,
    HEADER_END,
    KEY,
    MANIFEST,
    PAYLOAD,
    SEALED,
    open_,
    random_kv,
    seal,
)


def refusal(handoff: Handoff, **changes: object) -> tuple[str, str]:
    with pytest.raises(HandoffRefused) as refused:
        open_(handoff, **changes)
    return refused.value.check, str(refused.value)


def drafted() -> Handoff:
    kv = random_kv(GEOMETRY, seed=4)
    kv.draft = random_kv(DRAFT_GEOMETRY, seed=5)
    return seal(kv)


def fail(*_args: Any, **_kwargs: Any) -> Any:
    raise RuntimeError("boom")


# --------------------------------------------------------------------------- each stage by name


@pytest.mark.parametrize(("stage", "helper"), [
    ("mac", "manifest_mac"),
    ("manifest", "_parse_manifest"),
    ("run", "_check_run_binding"),
    ("identity", "_check_expectations"),
    ("geometry", "_check_geometries"),
    ("payload.bytes", "_exact_payload_bytes"),
    ("payload.header", "_locate_tensors"),
    ("payload.tree_sha256", "_tensor_digests"),
    ("payload.layout", "_check_payload_layout"),
])
def test_an_unexpected_error_is_refused_naming_the_stage_it_happened_in(monkeypatch, stage, helper):
    monkeypatch.setattr(wire, helper, fail)
    assert refusal(SEALED) == (stage, f"handoff {stage}: unexpected RuntimeError (boom)")


def test_an_unexpected_error_while_checking_seams_is_refused_as_the_seam_stage(monkeypatch):
    seam_digests = {seam["k_sha256"] for seam in MANIFEST["seams"]}
    real_compare = wire.hmac.compare_digest

    def compare_digest(found: Any, claimed: Any) -> bool:
        if claimed in seam_digests:
            raise RuntimeError("boom")
        return real_compare(found, claimed)

    monkeypatch.setattr(wire.hmac, "compare_digest", compare_digest)
    assert refusal(SEALED) == ("seam", "handoff seam: unexpected RuntimeError (boom)")


def test_an_unexpected_error_in_the_draft_context_or_the_install_names_its_stage(monkeypatch):
    handoff = drafted()
    with monkeypatch.context() as patched:
        patched.setattr(wire, "draft_context_sha256", fail)
        assert refusal(handoff, draft_geometry=DRAFT_GEOMETRY) == (
            "draft_context", "handoff draft_context: unexpected RuntimeError (boom)")
    monkeypatch.setattr(wire.KVCache, "from_tensors", fail)
    assert refusal(handoff, draft_geometry=DRAFT_GEOMETRY) == (
        "install", "handoff install: unexpected RuntimeError (boom)")


def test_a_harness_refusal_inside_a_stage_keeps_its_words_and_takes_the_stages_name(monkeypatch):
    def refuse(*_args: Any) -> None:
        raise Refused("the expectation could not be read")

    monkeypatch.setattr(wire, "_check_expectations", refuse)
    assert refusal(SEALED) == ("identity", "the expectation could not be read")


# --------------------------------------------------------------------------- inputs of the wrong kind


def test_a_key_that_is_no_bytes_is_the_callers_mistake_named_by_its_type():
    with pytest.raises(Refused) as refused:
        open_(SEALED, key="not bytes")  # type: ignore[arg-type]
    assert type(refused.value) is Refused and str(refused.value) == "handoff key: found str, expected bytes"


def test_a_manifest_that_is_no_bytes_is_refused_by_the_mac_check_naming_its_type():
    assert refusal(Handoff("text", SEALED.mac, PAYLOAD)) == (  # type: ignore[arg-type]
        "mac", "handoff manifest_bytes: found str, expected bytes")


def test_a_payload_in_a_non_contiguous_buffer_is_refused_as_such():
    strided = memoryview(bytes(2 * len(PAYLOAD)))[::2]
    assert refusal(Handoff(SEALED.manifest_bytes, SEALED.mac, strided)) == (
        "payload.bytes", "handoff payload: not a contiguous byte buffer")


def test_a_manifest_without_a_schema_is_refused_by_the_schema_check():
    document = json.loads(SEALED.manifest_bytes)
    del document["schema"]
    manifest_bytes = manifest_canonical_bytes(document)
    assert refusal(Handoff(manifest_bytes, manifest_mac(KEY, manifest_bytes), PAYLOAD)) == (
        "manifest.schema", "handoff manifest: schema: missing, expected this field")


def test_an_expected_dtype_the_wire_cannot_carry_is_refused_naming_the_four_it_can():
    with pytest.raises(Refused) as refused:
        replace(EXPECTATION, geometry=replace(GEOMETRY, dtype="int8"))
    assert str(refused.value) == ("handoff expectation geometry.dtype: found 'int8', expected one of "
                                  "float64, float32, float16, bfloat16")


def test_an_expectation_checks_its_draft_geometry_too():
    with pytest.raises(Refused) as refused:
        HandoffExpectation(**{**EXPECTATION.__dict__, "draft_geometry": replace(DRAFT_GEOMETRY, layers=0)})
    assert str(refused.value) == "handoff expectation draft_geometry.layers: found 0, expected an int >= 1"


def test_a_geometry_or_draft_geometry_other_than_expected_is_refused_by_its_own_check():
    assert refusal(SEALED, geometry=replace(GEOMETRY, kv_heads=1))[0] == "geometry"
    assert refusal(drafted(), draft_geometry=replace(DRAFT_GEOMETRY, layers=3))[0] == "draft_geometry"
    assert refusal(SEALED, geometry=replace(GEOMETRY, positions=7)) == (
        "geometry", "geometry positions: handoff has 6, expected 7 handed-off positions")


def test_a_draft_context_digest_other_than_the_drafts_is_refused_in_those_words():
    handoff = drafted()
    document = json.loads(handoff.manifest_bytes)
    document["draft_context_sha256"] = "0" * 64
    manifest_bytes = manifest_canonical_bytes(document)
    forged = Handoff(manifest_bytes, manifest_mac(KEY, manifest_bytes), handoff.payload_bytes)
    assert refusal(forged, draft_geometry=DRAFT_GEOMETRY) == ("draft_context", "draft context digest mismatch")


# --------------------------------------------------------------------------- the payload header


def with_extra_tensors(*names: str) -> bytes:
    """PAYLOAD with empty tensors ``names`` added to its header, after the last data byte."""
    header = json.loads(PAYLOAD[8:HEADER_END])
    end = max(entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__")
    for name in names:
        header[name] = {"dtype": "F32", "shape": [0], "data_offsets": [end, end]}
    text = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(text)) + text + PAYLOAD[HEADER_END:]


def test_tensors_the_manifest_does_not_declare_are_refused_naming_the_first():
    payload = with_extra_tensors("zz", "zy")
    located = wire._locate_tensors(memoryview(payload))
    manifest = open_(SEALED).manifest
    with pytest.raises(HandoffRefused) as refused:
        wire._check_payload_layout(memoryview(payload), located, manifest)
    assert (refused.value.check, str(refused.value)) == ("payload.layout", "handoff payload: unexpected tensor 'zy'")


def test_a_tensor_name_that_is_not_valid_unicode_is_refused_by_the_header_check():
    with pytest.raises(HandoffRefused) as refused:
        wire._locate_tensors(memoryview(with_extra_tensors("\ud800")))
    assert (refused.value.check, str(refused.value)) == (
        "payload.header", 'handoff payload header: ["\\ud800"]: key holds a lone UTF-16 surrogate, expected text')

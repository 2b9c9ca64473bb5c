"""Which check refuses a handoff, and in what words: every refusal carries the name of the check
that refused it (receipts and the tampering tallies group refusals by it), from the MAC through the
payload header, its tree digest, its layout and seams. An unexpected failure anywhere in opening a
handoff is refused naming the stage it happened in; the refusals that need inputs of their own to
reach are here too: a key or manifest of the wrong type, a non-contiguous payload, a manifest
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
from qualify.handoff.wire import Handoff, HandoffExpectation, manifest_canonical_bytes, manifest_mac, open_handoff
from tests.support.wire_mutants import failing_expectation
from tests.unit.handoff.test_handoff_wire import (
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
    refusal,
    reseal,
    seal,
    tampered,
)


def sealed_over(payload: bytes) -> Handoff:
    """A producer holding the key seals a payload of the expected size whose header is broken: the
    manifest's tree digest can be anything, because the header is read before the digest."""
    document = json.loads(SEALED.manifest_bytes)
    document["payload"] = {"format": "safetensors", "tree_sha256": "0" * 64, "bytes": len(payload)}
    manifest_bytes = manifest_canonical_bytes(document)
    return Handoff(manifest_bytes, manifest_mac(KEY, manifest_bytes), payload)


def with_header(header: bytes, size: int | None = None) -> bytes:
    """PAYLOAD's length, its first 8 bytes saying ``size`` (the header's own length by default)."""
    body = struct.pack("<Q", len(header) if size is None else size) + header
    return body + b"\0" * (len(PAYLOAD) - len(body))


def test_a_tampered_mac_or_manifest_is_refused_by_the_mac_check() -> None:
    for handoff in (tampered("mac-byte", 0, 1), tampered("manifest-byte", 5, 1)):
        check, words = refusal(handoff)
        assert check == "mac" and words.startswith("handoff MAC does not verify under key ")


def test_a_short_payload_is_refused_by_its_byte_count() -> None:
    assert refusal(tampered("truncated-payload", 9, 0)) == (
        "payload.bytes", f"handoff payload: 9 bytes, manifest payload.bytes says {len(PAYLOAD)}")


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (with_header(b"{}", size=len(PAYLOAD) - 7), f"handoff payload: header length {len(PAYLOAD) - 7} exceeds the payload"),
        (with_header(b"{}", size=2**63 + 5), f"handoff payload: header length {2**63 + 5} exceeds the payload"),
        (with_header(b"[1]"), "handoff payload header: not a JSON object"),
        (with_header(b'{"t": 1}'), "handoff payload: tensor t header is malformed"),
        (with_header(b'{"t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}'),
         "handoff payload: tensor t data_offsets is malformed"),
    ],
)
def test_a_broken_payload_header_is_refused_by_the_header_check(payload: bytes, words: str) -> None:
    assert refusal(sealed_over(payload)) == ("payload.header", words)


def test_a_header_that_is_not_json_is_refused_by_the_header_check_naming_it() -> None:
    check, words = refusal(sealed_over(with_header(b"{not json")))
    assert check == "payload.header" and words.startswith("handoff payload header")


def test_the_payload_is_read_as_unsigned_bytes_whatever_buffer_carries_it() -> None:
    signed = memoryview(bytearray(SEALED.payload_bytes)).cast("b")
    opened = open_(Handoff(SEALED.manifest_bytes, SEALED.mac, signed))
    assert opened.manifest.payload_size == len(PAYLOAD)


@pytest.mark.parametrize(("kind", "a", "b", "check", "start"), [
    ("payload-byte", HEADER_END + 3, 1, "payload.tree_sha256", "handoff payload tree digest mismatch: found "),
    ("swapped-layers-resealed", 0, 1, "seam", "seam digest mismatch at layer 0 K"),
    ("reordered-header-resealed", 0, 1, "payload.layout",
     "handoff payload: tensor order: position 0 holds layers.1.k, expected layers.0.k"),
])
def test_payload_tampering_is_refused_by_the_check_it_breaks(kind: str, a: int, b: int, check: str, start: str) -> None:
    refused_by, words = refusal(tampered(kind, a, b))
    assert refused_by == check and words.startswith(start)


@pytest.mark.parametrize("size", [0, 7])
def test_fewer_than_8_bytes_hold_no_safetensors_header(size: int) -> None:
    with pytest.raises(HandoffRefused) as refused:
        wire._locate_tensors(memoryview(bytes(size)))
    assert (refused.value.check, str(refused.value)) == (
        "payload.header", f"handoff payload: {size} bytes, too short for a safetensors header")


def test_8_bytes_hold_a_header_length_and_nothing_else() -> None:
    with pytest.raises(HandoffRefused) as refused:
        wire._locate_tensors(memoryview(struct.pack("<Q", 0)))
    assert refused.value.check == "payload.header" and "too short" not in str(refused.value)


class SquaresClock:
    """perf_counter reading 1, 4, 9, 16, ...: each phase between two readings has its own length,
    and no reading is 0 (a phase timed as a sum of two readings would pass at 0)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return float(self.calls * self.calls)


def test_opening_times_each_phase_between_its_own_two_readings(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = SquaresClock()
    monkeypatch.setattr(wire.time, "perf_counter", clock)
    timings = open_(SEALED).timings
    assert clock.calls == 6  # started, MAC, manifest, digest, checks, installed
    assert (timings.mac_s, timings.manifest_s, timings.digest_s, timings.checks_s, timings.install_s) == (3, 5, 7, 9, 11)


NONCANONICAL = SEALED.manifest_bytes.replace(b'{"', b'{ "', 1)
SCHEMA = json.loads(SEALED.manifest_bytes)["schema"]


@pytest.mark.parametrize(
    ("handoff", "check", "words"),
    [
        (Handoff(b"{", manifest_mac(KEY, b"{"), PAYLOAD), "manifest.json",
         "handoff manifest: not JSON (Expecting property name enclosed in double quotes at line 1 column 2)"),
        (Handoff(NONCANONICAL, manifest_mac(KEY, NONCANONICAL), PAYLOAD), "manifest.canonical",
         "handoff manifest: not in canonical JSON form (RFC 8785)"),
        (reseal(PAYLOAD, schema="trust-ladder.handoff-manifest.v3"), "manifest.schema",
         f'handoff manifest: schema: found "trust-ladder.handoff-manifest.v3", expected "{SCHEMA}" (producer and '
         "consumer run the same harness version; a manifest is never archived, so no other version is read)"),
        (reseal(PAYLOAD, handed_off_positions=7), "manifest.handed_off_positions",
         "handoff manifest: handed_off_positions 7 disagrees with geometry.positions 6"),
        (reseal(PAYLOAD, seams=MANIFEST["seams"][:-1]), "manifest.seams",
         "handoff manifest: seams lists 4 layers, geometry.layers is 5"),
        (reseal(PAYLOAD, seams=[MANIFEST["seams"][1], MANIFEST["seams"][0], *MANIFEST["seams"][2:]]), "manifest.seams",
         "handoff manifest: seams[0] is for layer 1, expected layer 0"),
    ],
    ids=["not-json", "not-canonical", "other-schema", "positions", "seam-count", "seam-order"],
)
def test_a_broken_manifest_is_refused_by_the_manifest_check_it_breaks(handoff: Handoff, check: str, words: str) -> None:
    assert refusal(handoff) == (check, words)


def test_a_draft_context_where_none_is_expected_or_none_where_one_is_names_both_sides() -> None:
    kv = random_kv(GEOMETRY, seed=4)
    kv.draft = random_kv(DRAFT_GEOMETRY, seed=5)
    with_draft = seal(kv)
    with pytest.raises(HandoffRefused) as present:
        open_(with_draft)
    with pytest.raises(HandoffRefused) as absent:
        open_(SEALED, draft_geometry=DRAFT_GEOMETRY)
    assert (present.value.check, str(present.value)) == (
        "draft_geometry", "draft_geometry: draft context present, consumer expects none")
    assert (absent.value.check, str(absent.value)) == (
        "draft_geometry", "draft_geometry: draft context absent, consumer expects one")


@pytest.mark.parametrize("threads", [1, 256])
def test_digest_threads_from_1_to_256_open_the_same_handoff(threads: int) -> None:
    assert open_(SEALED, digest_threads=threads).manifest.payload_tree_sha256 == MANIFEST["payload"]["tree_sha256"]


@pytest.mark.parametrize("threads", [0, 257, True])
def test_digest_threads_outside_1_to_256_are_refused(threads: int) -> None:
    with pytest.raises(Refused, match=f"^digest_threads: found {threads}, expected an int from 1 to 256$"):
        open_(SEALED, digest_threads=threads)


# --------------------------------------------------------------------------- stages and rarer inputs


def drafted() -> Handoff:
    kv = random_kv(GEOMETRY, seed=4)
    kv.draft = random_kv(DRAFT_GEOMETRY, seed=5)
    return seal(kv)


def fail(*_args: Any, **_kwargs: Any) -> Any:
    raise RuntimeError("boom")


# --------------------------------------------------------------------------- each stage by name
# An unexpected failure inside a stage is reached here through the consumer's own input (an
# expectation whose field fails when a stage reads it) or through the public functions a stage calls
# (the MAC, the canonical form, the header's JSON reader, the tree digest, the seam comparison, the
# draft context digest, the install). The payload layout stage calls neither: it reads only the
# producer's bytes, which every hostile producer test refuses by name, so nothing reaches an
# unexpected failure there.


@pytest.mark.parametrize(("stage", "field"), [
    ("run", "run_id"),
    ("identity", "identity_sha256"),
    ("geometry", "geometry"),
    ("payload.bytes", "expected_payload_bytes"),
])
def test_an_unexpected_error_is_refused_naming_the_stage_it_happened_in(stage, field):
    with pytest.raises(HandoffRefused) as refused:
        open_handoff(SEALED, KEY, failing_expectation(EXPECTATION, field, RuntimeError("boom")))
    assert (refused.value.check, str(refused.value)) == (stage, f"handoff {stage}: unexpected RuntimeError (boom)")


@pytest.mark.parametrize(("stage", "function"), [
    ("mac", "manifest_mac"),
    ("manifest", "manifest_canonical_bytes"),
    ("payload.tree_sha256", "payload_tree_sha256"),
])
def test_an_unexpected_error_in_a_public_function_a_stage_calls_is_refused_naming_the_stage(monkeypatch, stage,
                                                                                          function):
    monkeypatch.setattr(wire, function, fail)
    assert refusal(SEALED) == (stage, f"handoff {stage}: unexpected RuntimeError (boom)")


def test_an_unexpected_error_reading_the_payload_header_is_refused_as_the_header_stage(monkeypatch):
    real_parse = wire.parse_untrusted_json

    def parse(data: Any, where: str, **limits: Any) -> Any:
        if where == "handoff payload header":  # the manifest, read first, parses as ever
            raise RuntimeError("boom")
        return real_parse(data, where, **limits)

    monkeypatch.setattr(wire, "parse_untrusted_json", parse)
    assert refusal(SEALED) == ("payload.header", "handoff payload.header: unexpected RuntimeError (boom)")


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


def test_a_harness_refusal_inside_a_stage_keeps_its_words_and_takes_the_stages_name():
    expectation = failing_expectation(EXPECTATION, "identity_sha256", Refused("the expectation\ncould not be read"))
    with pytest.raises(HandoffRefused) as refused:
        open_handoff(SEALED, KEY, expectation)
    assert (refused.value.check, str(refused.value)) == ("identity", "the expectation could not be read")


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

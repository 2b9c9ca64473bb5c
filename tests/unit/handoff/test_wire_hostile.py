"""A hostile producer that holds the run key: every mutant it can send is refused, by name.

The red-team findings are one test each (named after the case); the property tests open keyed
and unkeyed mutants of a real sealed handoff (:mod:`tests.support.wire_mutants`) in process and require
each to be refused with ``HandoffRefused`` naming a documented check, unless the oracle
:func:`~tests.support.wire_mutants.equivalent` says it carries exactly what the pristine handoff carried.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qualify.contract.lanes import ProducerMode
from qualify.core.errors import HandoffRefused, Refused
from qualify.handoff import wire
from qualify.handoff.wire import Handoff, OpenedHandoff, handoff_key_id, manifest_mac, open_handoff, payload_layout
from tests.support.fuzz_budget import fuzz_examples
from tests.support.wire_mutants import (
    DRAFT_GEOMETRY,
    GEOMETRY,
    OTHER_KEY,
    RUN_KEY,
    Mutant,
    Raw,
    all_mutants,
    canonical_bytes,
    equivalent,
    failing_expectation,
    forbid_hashing,
    pristine_expectation,
    pristine_handoff,
    pristine_kv,
    seal_pristine,
)

# Every check name open_handoff may report (the module docstring's list, plus the stages an
# unexpected failure is named after).
DOCUMENTED_CHECKS = {
    "mac", "manifest.json", "manifest.schema", "manifest.canonical", "manifest.handed_off_positions",
    "manifest.seams", "manifest.run_id", "manifest.lane", "manifest.key_id", "geometry", "draft_geometry",
    "handed_off_positions", "payload.bytes", "payload.header", "payload.tree_sha256", "payload.layout", "seam",
    "draft_context", "identity", "cache_identity", "producer_mode", "prompt", "request_id",
}


def forged(edit: dict[str, object], *, draft: bool = False, raw: dict[str, str] | None = None) -> Handoff:
    """The pristine manifest with ``edit`` applied (``"a.b"`` paths), canonical, MACed with the run
    key; ``raw`` puts verbatim JSON tokens (``1e400``) at paths no encoder would write them."""
    original = pristine_handoff(draft)
    document = json.loads(original.manifest_bytes)
    markers = {}
    for path, value in {**edit, **{p: Raw(t) for p, t in (raw or {}).items()}}.items():
        *parents, last = path.split(".")
        target = document
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if isinstance(value, Raw):
            markers[f"@@{path}@@"] = value.token
            value = f"@@{path}@@"
        target[int(last) if isinstance(target, list) else last] = value
    data = canonical_bytes(document)
    for marker, token in markers.items():
        data = data.replace(json.dumps(marker).encode(), token.encode())
    return Handoff(data, manifest_mac(RUN_KEY, data), original.payload_bytes)


def refusal_of(handoff: Handoff, *, draft: bool = False, **expectation: object) -> HandoffRefused:
    """Open ``handoff`` against the pristine expectation (with ``expectation`` changes); the refusal."""
    with pytest.raises(HandoffRefused) as refused:
        open_handoff(handoff, RUN_KEY, replace(pristine_expectation(draft), **expectation))
    message = str(refused.value)
    assert "\n" not in message and "Traceback" not in message, message
    assert refused.value.check in DOCUMENTED_CHECKS, refused.value.check
    return refused.value


# ------------------------------------------------------------------------------------------
# finding: a producer holding the run key could crash the consumer with non-integers and infinity


def test_geometry_layers_4_0_is_refused_naming_the_field() -> None:
    refused = refusal_of(forged({}, raw={"geometry.layers": "4.0"}))  # RFC 8785 would write 4
    assert refused.check == "manifest.schema"
    assert str(refused) == "handoff manifest: geometry.layers: found 4.0, expected type integer"


def test_seams_layer_0_0_is_refused_naming_the_field() -> None:
    refused = refusal_of(forged({}, raw={"seams.0.layer": "0.0"}))
    assert refused.check == "manifest.schema"
    assert str(refused) == "handoff manifest: seams[0].layer: found 0.0, expected type integer"


def test_compute_s_1e400_is_refused_naming_the_field() -> None:
    refused = refusal_of(forged({}, raw={"timings.compute_s": "1e400"}))
    assert refused.check == "manifest.json"
    assert str(refused) == ("handoff manifest: timings.compute_s: found a number that overflows to infinity, "
                            "expected a finite number")


def test_handed_off_positions_as_a_float_is_refused_naming_the_field() -> None:
    refused = refusal_of(forged({}, raw={"handed_off_positions": repr(float(GEOMETRY.positions))}))
    assert (refused.check, str(refused)) == (
        "manifest.schema", "handoff manifest: handed_off_positions: found 8.0, expected type integer")


def test_payload_bytes_as_a_float_is_refused_naming_the_field() -> None:
    size = float(len(pristine_handoff().payload_bytes))
    refused = refusal_of(forged({}, raw={"payload.bytes": repr(size)}))
    assert (refused.check, str(refused)) == (
        "manifest.schema", f"handoff manifest: payload.bytes: found {size!r}, expected type integer")


@pytest.mark.parametrize(("path", "value"), [("handed_off_positions", True), ("geometry.kv_heads", "2"),
                                             ("payload.bytes", 1 << 63), ("geometry.head_dim", -1)],
                         ids=["true", "string", "past-int64", "negative"])
def test_a_non_integer_or_out_of_range_integer_is_refused_naming_the_field(path: str, value: object) -> None:
    refused = refusal_of(forged({path: value}))
    assert refused.check == "manifest.schema"
    assert str(refused).startswith(f"handoff manifest: {path}: found "), str(refused)


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-1e400", "1" + "0" * 5000])
def test_a_non_finite_or_unparsable_number_is_refused_naming_the_manifest(token: str) -> None:
    refused = refusal_of(forged({}, raw={"timings.digest_s": token}))
    assert refused.check == "manifest.json" and str(refused).startswith("handoff manifest: "), str(refused)


def test_a_manifest_past_the_size_bound_is_refused_before_parsing() -> None:
    big = b" " * wire.MAX_MANIFEST_BYTES + pristine_handoff().manifest_bytes
    refused = refusal_of(Handoff(big, manifest_mac(RUN_KEY, big), pristine_handoff().payload_bytes))
    assert refused.check == "manifest.json"
    assert str(refused) == f"handoff manifest: {len(big)} bytes, expected at most {wire.MAX_MANIFEST_BYTES}"


@pytest.mark.parametrize("depth", [wire.MAX_MANIFEST_DEPTH + 1, 33, 200_000])
def test_a_manifest_nested_past_the_bound_is_refused_without_recursion(depth: int) -> None:
    # the bound is the manifest's own (8 levels; it has 3), tighter than the parser's default (32)
    refused = refusal_of(forged({}, raw={"timings.serialize_s": "[" * depth + "]" * depth}))
    assert refused.check == "manifest.json" and "nesting deeper than 8 levels" in str(refused)


def test_a_float_shape_in_the_payload_header_is_refused_naming_the_layout() -> None:
    """A header whose shape says 2.0 where the geometry says 2: refused on layout, never installed."""
    original = pristine_handoff()
    payload = bytes(original.payload_bytes)
    end = 8 + struct.unpack_from("<Q", payload)[0]
    header = json.loads(payload[8:end])
    header["layers.0.k"]["shape"] = [float(d) for d in header["layers.0.k"]["shape"]]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    mutated = struct.pack("<Q", len(text)) + text + payload[end:]
    document = json.loads(original.manifest_bytes)
    leaves = [wire.hashlib.sha256(mutated[b:e]).digest() for b, e in sorted(
        (len(text) + 8 + h["data_offsets"][0], len(text) + 8 + h["data_offsets"][1]) for h in header.values())]
    document["payload"].update(tree_sha256=wire.payload_tree_sha256(mutated[:len(text) + 8], leaves),
                               bytes=len(mutated))
    manifest = canonical_bytes(document)
    if len(mutated) != len(payload):  # the float header is longer: the size check refuses first
        assert refusal_of(Handoff(manifest, manifest_mac(RUN_KEY, manifest), mutated)).check == "payload.bytes"
    else:
        refused = refusal_of(Handoff(manifest, manifest_mac(RUN_KEY, manifest), mutated))
        assert refused.check == "payload.layout", str(refused)


# ------------------------------------------------------------------------------------------
# finding: a manifest whose key id and lane do not match the run still qualified


def test_foreign_key_id_is_refused_naming_key_id() -> None:
    refused = refusal_of(forged({"key_id": handoff_key_id(OTHER_KEY)}))
    assert refused.check == "manifest.key_id"
    assert str(refused) == (f"key_id is {handoff_key_id(OTHER_KEY)!r}, expected {handoff_key_id(RUN_KEY)!r} "
                            f"(the run key the MAC verified under)")


def test_foreign_lane_is_refused_naming_lane() -> None:
    refused = refusal_of(forged({"lane": "nvfp4-native-w4a4"}))
    assert (refused.check, str(refused)) == ("manifest.lane", "lane is 'nvfp4-native-w4a4', expected 'nvfp4-exact'")


def test_foreign_run_id_is_refused_naming_run_id() -> None:
    refused = refusal_of(forged({"run_id": "run-other"}))
    assert (refused.check, str(refused)) == ("manifest.run_id", "run_id is 'run-other', expected 'run-mutants'")


def test_a_handoff_sealed_for_another_lane_is_refused_naming_lane() -> None:
    """The honest seal of another lane's producer, under this run's key: refused on its lane."""
    other_lane = seal_pristine(lane="other-lane").to_handoff()
    assert refusal_of(other_lane).check == "manifest.lane"


def test_foreign_producer_mode_with_the_expected_cache_identity_is_refused_naming_producer_mode() -> None:
    refused = refusal_of(forged({"producer_mode": "native"}))
    assert (refused.check, str(refused)) == ("producer_mode", "producer_mode is 'native', expected 'exact'")


def test_run_binding_is_checked_before_any_payload_byte_is_hashed(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_hashing(monkeypatch, pristine_handoff().payload_bytes)
    for edit, check in (({"run_id": "run-2"}, "manifest.run_id"), ({"lane": "other-lane"}, "manifest.lane"),
                        ({"key_id": "0" * 16}, "manifest.key_id")):
        assert refusal_of(forged(edit)).check == check


# ------------------------------------------------------------------------------------------
# payload sizes against the geometry, before any allocation or hashing


def test_expected_payload_bytes_is_the_exact_payload_size_of_the_geometry() -> None:
    assert pristine_expectation().expected_payload_bytes == len(pristine_handoff().payload_bytes)
    assert pristine_expectation(draft=True).expected_payload_bytes == len(pristine_handoff(True).payload_bytes)
    assert pristine_expectation(draft=True).expected_payload_bytes == payload_layout(GEOMETRY, DRAFT_GEOMETRY).size
    bigger = replace(pristine_expectation(), geometry=replace(GEOMETRY, positions=9))
    assert bigger.expected_payload_bytes - pristine_expectation().expected_payload_bytes == 2 * 2 * 2 * 4 * 4


def test_payload_bytes_other_than_the_expected_size_is_refused_before_hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    original = pristine_handoff()
    size = len(original.payload_bytes)
    short = Handoff(original.manifest_bytes, original.mac, bytes(original.payload_bytes)[:-1])
    forbid_hashing(monkeypatch, original.payload_bytes)
    refused = refusal_of(forged({"payload.bytes": size + 8}))
    assert (refused.check, str(refused)) == ("payload.bytes", f"payload.bytes is {size + 8}, expected {size} "
                                                              f"for the expected geometry")
    forbid_hashing(monkeypatch, short.payload_bytes)
    assert refusal_of(short).check == "payload.bytes"


# ------------------------------------------------------------------------------------------
# one error type at the boundary


@pytest.mark.parametrize(
    ("field", "error", "check"),
    [
        ("run_id", KeyError("layers.0.k"), "run"),
        ("run_id", MemoryError(), "run"),
        ("identity_sha256", TypeError("unhashable type: 'list'"), "identity"),
        ("identity_sha256", RecursionError("maximum recursion depth exceeded"), "identity"),
        ("geometry", UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"), "geometry"),
        ("geometry", OverflowError("int too large"), "geometry"),
        ("expected_payload_bytes", struct.error("unpack requires a buffer of 8 bytes"), "payload.bytes"),
        ("expected_payload_bytes", ValueError("bad"), "payload.bytes"),
    ],
    ids=["KeyError", "MemoryError", "TypeError", "RecursionError", "UnicodeError", "OverflowError",
         "struct.error", "ValueError"],
)
def test_an_unexpected_exception_inside_open_handoff_is_refused_naming_its_stage(
    field: str, error: Exception, check: str,
) -> None:
    # the consumer's own expectation fails when a stage reads it: whatever the exception, one refusal
    with pytest.raises(HandoffRefused) as refused:
        open_handoff(pristine_handoff(), RUN_KEY, failing_expectation(pristine_expectation(), field, error))
    assert refused.value.check == check
    assert str(refused.value).startswith(f"handoff {check}: unexpected {type(error).__name__}")
    assert "\n" not in str(refused.value) and refused.value.__suppress_context__


def test_running_out_of_memory_while_hashing_the_payload_is_refused_as_the_tree_digest_stage(
        monkeypatch: pytest.MonkeyPatch) -> None:
    handoff = pristine_handoff()

    def sha256(data: object = b"", *args: object) -> object:
        if isinstance(data, memoryview) and data.obj is handoff.payload_bytes:
            raise MemoryError("cannot allocate")
        return hashlib.sha256(data, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(wire, "hashlib", type("OutOfMemory", (), {"sha256": staticmethod(sha256)}))
    with pytest.raises(HandoffRefused) as refused:
        open_handoff(handoff, RUN_KEY, pristine_expectation())
    assert (refused.value.check, str(refused.value)) == ("payload.tree_sha256",
                                                         "handoff payload.tree_sha256: unexpected MemoryError (cannot allocate)")


@pytest.mark.parametrize(
    ("manifest", "mac", "payload", "check"),
    [
        (None, b"", b"", "mac"),
        (42, b"", b"", "mac"),
        ("manifest", b"", b"", "mac"),
        ("pristine", "not bytes", "pristine", "mac"),
        ("pristine", "pristine", "a string", "payload.bytes"),
        ("pristine", "pristine", 12345, "payload.bytes"),
        ("pristine", "pristine", memoryview(np.zeros((8, 64), np.uint8)[:, ::2]), "payload.bytes"),
    ],
    ids=["none-manifest", "int-manifest", "str-manifest", "str-mac", "str-payload", "int-payload", "strided-payload"],
)
def test_a_handoff_of_the_wrong_types_is_refused_not_raised(manifest: object, mac: object, payload: object,
                                                            check: str) -> None:
    original = pristine_handoff()
    handoff = Handoff(original.manifest_bytes if manifest == "pristine" else manifest,  # type: ignore[arg-type]
                      original.mac if mac == "pristine" else mac,  # type: ignore[arg-type]
                      original.payload_bytes if isinstance(payload, str) and payload == "pristine" else payload)  # type: ignore[arg-type]
    assert refusal_of(handoff).check == check


def test_a_refusal_raised_without_a_check_still_names_one() -> None:
    assert HandoffRefused("old raiser").check == "handoff"
    assert HandoffRefused("x", check="mac").check == "mac"


def test_the_caller_s_own_mistakes_stay_plain_refusals() -> None:
    """A bad key is the caller's, not the handoff's: ``Refused``, not ``HandoffRefused``."""
    with pytest.raises(Refused, match="handoff key: 16 bytes") as refused:
        open_handoff(pristine_handoff(), b"k" * 16, pristine_expectation())
    assert not isinstance(refused.value, HandoffRefused)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lane": "Bad Lane"}, "handoff expectation lane: found 'Bad Lane', expected a lane name"),
        ({"lane": None}, "handoff expectation lane: found None"),
        ({"producer_mode": "fast"}, "handoff expectation producer_mode: found 'fast', expected exact or native"),
        ({"geometry": replace(GEOMETRY, layers=4.0)}, "handoff expectation geometry.layers: found 4.0, expected an int >= 1"),
        ({"geometry": replace(GEOMETRY, positions=True)}, "handoff expectation geometry.positions: found True"),
        ({"geometry": replace(GEOMETRY, dtype="int8")}, "handoff expectation geometry.dtype: found 'int8'"),
        ({"draft_geometry": replace(DRAFT_GEOMETRY, kv_heads=0)}, "handoff expectation draft_geometry.kv_heads: found 0"),
    ],
    ids=["lane", "lane-none", "mode", "layers-float", "positions-bool", "dtype", "draft-kv-heads"],
)
def test_a_malformed_expectation_is_refused_naming_its_field(change: dict[str, object], message: str) -> None:
    with pytest.raises(Refused, match=message):
        replace(pristine_expectation(), **change)


def test_the_producer_refuses_to_seal_what_the_strict_schema_refuses() -> None:
    with pytest.raises(Refused, match="^handoff manifest: lane: 'Bad Lane' does not match"):
        seal_pristine(lane="Bad Lane")
    with pytest.raises(Refused, match="^handoff manifest: run_id: '' does not match"):
        seal_pristine(run_id="")


# ------------------------------------------------------------------------------------------
# the oracle can fail, and a timings-only change is accepted


def test_the_oracle_accepts_a_timings_only_change_and_rejects_other_content() -> None:
    original = pristine_handoff()
    retimed = forged({"timings.compute_s": 7.5, "timings.digest_s": 0})
    assert equivalent(original, open_handoff(retimed, RUN_KEY, pristine_expectation()))
    other = pristine_kv()
    other.keys[1][0, 0, 0] += 1.0  # an honest seal of other content: opens, but is not the original
    sealed = wire.seal_handoff_parts(other, key=RUN_KEY, identity_sha256=pristine_expectation().identity_sha256,
                                     target_cache_identity=pristine_expectation().cache_identity,
                                     producer_mode=ProducerMode.EXACT, lane="nvfp4-exact",
                                     prompt_sha256=pristine_expectation().prompt_sha256, run_id="run-mutants",
                                     request_id="req-1", compute_s=0.25).to_handoff()
    assert not equivalent(original, open_handoff(sealed, RUN_KEY, pristine_expectation()))
    opened = open_handoff(original, RUN_KEY, pristine_expectation())
    assert not equivalent(original, opened._replace(manifest=replace(opened.manifest, lane="other")))
    assert not equivalent(original, opened._replace(manifest=replace(opened.manifest, handed_off_positions=8.0)))
    assert not equivalent(original, opened._replace(manifest=replace(opened.manifest, compute_s=-1.0)))
    assert np.array_equal(opened.kv.keys[0], pristine_kv().keys[0])


# ------------------------------------------------------------------------------------------
# property: every mutant is refused, by name, unless it is equivalent


def open_mutant(mutant: Mutant, fuzz_tally) -> None:
    """Open one mutant; tally its outcome; fail on a raw exception or a non-equivalent acceptance."""
    fuzz_tally.add("examples")
    fuzz_tally.add(f"kind.{mutant.kind}")
    try:
        opened: OpenedHandoff = open_handoff(mutant.handoff, mutant.key, mutant.expectation)
    except HandoffRefused as refusal:
        fuzz_tally.add("refused")
        fuzz_tally.add(f"check.{refusal.check}")
        message = str(refusal)
        assert refusal.check in DOCUMENTED_CHECKS, (refusal.check, mutant.what)
        assert message and "\n" not in message, (message, mutant.what)
        return
    except Exception as exc:
        fuzz_tally.add("raw_exceptions")
        raise AssertionError(f"{mutant.kind} {mutant.what}: raw {type(exc).__name__}: {exc}") from exc
    if equivalent(mutant.original, opened):
        fuzz_tally.add("accepted_equivalent")
    else:
        fuzz_tally.add("accepted_non_equivalent")
        raise AssertionError(f"{mutant.kind} {mutant.what}: accepted, and not equivalent to the original")


def identity_of(handoff: Handoff) -> bytes:
    """One digest of everything a handoff carries (to count distinct mutants)."""
    return hashlib.sha256(b"|".join((bytes(handoff.manifest_bytes), bytes(handoff.mac),
                                     hashlib.sha256(memoryview(handoff.payload_bytes)).digest()))).digest()


def run_mutants(examples: int, fuzz_tally) -> None:
    """Open ``examples`` mutants in process; tally outcomes, checks and distinct mutants."""
    fuzz_tally.add("accepted_non_equivalent", 0)
    fuzz_tally.add("raw_exceptions", 0)
    seen: set[bytes] = set()

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(all_mutants())
    def check(mutant: Mutant) -> None:
        seen.add(identity_of(mutant.handoff))
        open_mutant(mutant, fuzz_tally)

    check()
    fuzz_tally.add("distinct", len(seen))
    counts = fuzz_tally.counts
    assert counts["examples"] >= examples
    assert counts["raw_exceptions"] == 0 and counts["accepted_non_equivalent"] == 0, counts
    assert counts["refused"] + counts.get("accepted_equivalent", 0) == counts["examples"], counts
    kinds = {"kind.manifest-field", "kind.manifest-value", "kind.manifest-bytes", "kind.payload", "kind.unkeyed"}
    assert kinds <= set(counts), counts


def test_every_hostile_mutant_is_refused_unless_equivalent(fuzz_tally) -> None:
    run_mutants(fuzz_examples(500), fuzz_tally)


@pytest.mark.slow
def test_ten_thousand_hostile_mutants_are_refused_unless_equivalent(fuzz_tally) -> None:
    run_mutants(10_000, fuzz_tally)


@settings(max_examples=fuzz_examples(200), deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.floats(min_value=0.0, max_value=2.0**53 - 1, allow_nan=False, allow_infinity=False), st.sampled_from(
    ("compute_s", "serialize_s", "digest_s")))
def test_a_mutant_changing_only_a_timing_to_another_finite_time_is_accepted_and_equivalent(
    seconds: float, field: str,
) -> None:
    handoff = forged({f"timings.{field}": seconds})
    opened = open_handoff(handoff, RUN_KEY, pristine_expectation())
    assert equivalent(pristine_handoff(), opened)
    assert getattr(opened.manifest, field) == seconds

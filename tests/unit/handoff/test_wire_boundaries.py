"""The handoff wire at its edges: what sealing refuses (and in what words), the zero-copy payload parts
a sender writes, the producer's timings, and the tree-digest refusal when no seam changed.

Handoffs are sealed from the small KVs of :mod:`tests.unit.handoff.test_handoff_wire` and opened against its
expectation; the expected refusal lines are written out here from what each scenario means.
"""

from __future__ import annotations

import json
import struct
import time
from types import SimpleNamespace

import numpy as np
import pytest

from qualify.contract.lanes import ProducerMode
from qualify.core.errors import HandoffRefused, Refused
from qualify.core.kv import KVCache, KVGeometry
from qualify.handoff import wire
from qualify.handoff.wire import Handoff, payload_layout, seal_handoff_parts
from tests.unit.handoff.test_handoff_wire import (
    CACHE_EXACT,
    DRAFT_GEOMETRY,
    GEOMETRY,
    IDENTITY,
    KEY,
    KV,
    PROMPT,
    open_,
    random_kv,
    seal,
    tree_digest,
)

WIRE_DTYPES = "float64, float32, float16, bfloat16"


def seal_parts(kv: KVCache = KV, **changes: object) -> wire.SealedHandoff:
    """``seal_handoff_parts`` with the valid arguments of ``tests.unit.handoff.test_handoff_wire.seal``, ``changes`` applied."""
    arguments: dict[str, object] = {
        "key": KEY, "identity_sha256": IDENTITY, "target_cache_identity": CACHE_EXACT,
        "producer_mode": ProducerMode.EXACT, "lane": "nvfp4-exact", "prompt_sha256": PROMPT,
        "run_id": "run-1", "request_id": "req-1", "compute_s": 0.25,
    }
    arguments.update(changes)
    return seal_handoff_parts(kv, **arguments)  # type: ignore[arg-type]


def refusal_of(kv: KVCache, **changes: object) -> str:
    with pytest.raises(Refused) as refused:
        seal_parts(kv, **changes)
    assert not isinstance(refused.value, HandoffRefused)  # the producer's own mistake, not a handoff's
    return str(refused.value)


def kv_of(shape: tuple[int, ...], layers: int = 1, dtype: str = "float32") -> KVCache:
    return KVCache([np.ones(shape, dtype=dtype) for _ in range(layers)],
                   [np.ones(shape, dtype=dtype) for _ in range(layers)])


# ------------------------------------------------------------------------------------------
# sealing refuses a KV the wire cannot carry, naming what it found


@pytest.mark.parametrize(
    ("kv", "message"),
    [
        (KVCache([], []), "kv: 0 K and 0 V layers, expected equal and >= 1"),
        (KVCache(KV.keys[:2], KV.values[:1]), "kv: 2 K and 1 V layers, expected equal and >= 1"),
        (KVCache(KV.keys[:1], KV.values[:2]), "kv: 1 K and 2 V layers, expected equal and >= 1"),
        (kv_of((2, 6)), "kv: layer 0 K has shape [2, 6], expected 3 dimensions"),
        (kv_of((2, 6, 4), dtype="int32"), f"kv: dtype int32, expected one of {WIRE_DTYPES}"),
        (KVCache([KV.keys[0], KV.keys[1][:, :5]], KV.values[:2]),
         "kv: layer 1 K is float32 [2, 5, 4], expected float32 [2, 6, 4] like layer 0 K"),
        (KVCache(KV.keys[:1], [KV.values[0].astype("float16")]),
         "kv: layer 0 V is float16 [2, 6, 4], expected float32 [2, 6, 4] like layer 0 K"),
        (kv_of((0, 6, 4)), "kv: empty shape [0, 6, 4]"),
        (kv_of((2, 0, 4)), "kv: empty shape [2, 0, 4]"),
        (kv_of((2, 6, 0)), "kv: empty shape [2, 6, 0]"),
    ],
    ids=["no-layers", "more-k", "more-v", "2-d", "int32", "layer-1-k-shape", "layer-0-v-dtype",
         "no-heads", "no-positions", "no-head-dim"],
)
def test_sealing_refuses_a_kv_the_wire_cannot_carry_in_one_line_naming_it(kv: KVCache, message: str) -> None:
    assert refusal_of(kv) == message


def test_a_one_element_kv_in_each_dimension_is_sealed_and_opened() -> None:
    # The smallest KV there is, one float32 each: 4 bytes, not a whole number of any wider item.
    kv = kv_of((1, 1, 1))
    geometry = KVGeometry(layers=1, kv_heads=1, head_dim=1, positions=1, dtype="float32")
    opened = open_(seal_parts(kv).to_handoff(), geometry=geometry)
    assert opened.kv.keys[0].shape == (1, 1, 1) and opened.kv.keys[0].dtype == np.float32
    assert np.array_equal(opened.kv.values[0], kv.values[0])


def test_a_draft_the_wire_cannot_carry_is_refused_naming_the_draft() -> None:
    kv = random_kv(GEOMETRY, seed=11)
    kv.draft = kv_of((1, 6, 0))
    assert refusal_of(kv) == "kv draft: empty shape [1, 6, 0]"
    kv.draft = KVCache(kv_of((1, 6, 4)).keys, [])
    assert refusal_of(kv) == "kv draft: 1 K and 0 V layers, expected equal and >= 1"


def test_a_draft_carrying_its_own_draft_is_refused() -> None:
    kv = random_kv(GEOMETRY, seed=12)
    kv.draft = random_kv(DRAFT_GEOMETRY, seed=13)
    kv.draft.draft = random_kv(DRAFT_GEOMETRY, seed=14)
    assert refusal_of(kv) == "kv: a draft context cannot carry its own draft"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"identity_sha256": "A" * 64}, f"identity_sha256: found {'A' * 64!r}, expected 64 lowercase hex characters"),
        ({"target_cache_identity": CACHE_EXACT[:63]},
         f"target_cache_identity_sha256: found {CACHE_EXACT[:63]!r}, expected 64 lowercase hex characters"),
        ({"prompt_sha256": PROMPT + "0"},
         f"prompt_sha256: found {PROMPT + '0'!r}, expected 64 lowercase hex characters"),
    ],
    ids=["identity-uppercase", "cache-one-short", "prompt-one-long"],
)
def test_sealing_refuses_a_digest_that_is_not_64_lowercase_hex_naming_its_manifest_field(
        changes: dict[str, object], message: str) -> None:
    assert refusal_of(KV, **changes) == message


@pytest.mark.parametrize(
    ("compute_s", "shown"),
    [(-5e-324, "-5e-324"), (-1, "-1"), (float("inf"), "inf"), (float("nan"), "nan"), ("0.25", "'0.25'"),
     (None, "None"), (True, "True")],
    ids=["one-ulp-below-zero", "negative-int", "infinite", "nan", "string", "none", "bool"],
)
def test_sealing_refuses_a_compute_time_that_is_not_a_finite_number_at_least_zero(compute_s: object,
                                                                                  shown: str) -> None:
    assert refusal_of(KV, compute_s=compute_s) == f"compute_s: found {shown}, expected a finite number >= 0"


def test_a_compute_time_of_exactly_zero_is_sealed() -> None:
    timings = json.loads(seal_parts(compute_s=0).manifest_bytes)["timings"]
    assert timings["compute_s"] == 0


def test_payload_layout_refuses_a_dtype_the_wire_cannot_carry() -> None:
    with pytest.raises(Refused) as refused:
        payload_layout(KVGeometry(layers=1, kv_heads=1, head_dim=1, positions=1, dtype="int8"))
    assert str(refused.value) == f"geometry dtype: found 'int8', expected one of {WIRE_DTYPES}"


def test_a_serialiser_failure_is_refused_as_one_line_naming_the_manifest(monkeypatch: pytest.MonkeyPatch) -> None:
    # The schema refuses every number JCS cannot represent first, so the guard is reached only by
    # a failing serialiser; it must still be a Refused line, never a raw ValueError.
    def fails(document: object) -> bytes:
        raise ValueError("number 1e400\nis not representable")

    monkeypatch.setattr(wire, "jcs_bytes", fails)
    assert refusal_of(KV) == "handoff manifest: number 1e400 is not representable"


# ------------------------------------------------------------------------------------------
# the payload parts a sender writes


def test_payload_parts_are_flat_byte_views_a_sender_can_slice_at_any_byte() -> None:
    # A sender resuming a partial write slices a part at a byte count; that needs 1-D bytes.
    kv = kv_of((1, 3, 1), layers=2, dtype="float16")  # 6 bytes a tensor: no wider item divides it
    kv.keys[1] = np.arange(3, dtype=np.float16).reshape(1, 3, 1)
    sealed = seal_parts(kv)
    for part in sealed.payload_parts:
        assert (part.ndim, part.format, part.itemsize, len(part)) == (1, "B", 1, part.nbytes)
    assert sum(part.nbytes for part in sealed.payload_parts) == sealed.payload_size
    layout = payload_layout(KVGeometry(layers=2, kv_heads=1, head_dim=1, positions=3, dtype="float16"))
    begin, end = layout.offsets["layers.1.k"]
    payload = b"".join(sealed.payload_parts)
    assert payload[begin:end] == kv.keys[1].tobytes()
    part = sealed.payload_parts[1 + sorted(layout.offsets, key=layout.offsets.get).index("layers.1.k")]
    assert bytes(part[5:]) == kv.keys[1].tobytes()[5:]


def test_native_little_endian_tensors_are_sealed_as_views_not_copies() -> None:
    kv = random_kv(GEOMETRY, seed=15)
    sealed = seal_parts(kv)
    layout = payload_layout(GEOMETRY)
    names = sorted(layout.offsets, key=layout.offsets.get)
    tensors = kv.tensors()
    for name, part in zip(names, sealed.payload_parts[1:], strict=True):
        assert np.shares_memory(np.frombuffer(part, dtype=np.uint8), tensors[name]), name


def test_on_a_big_endian_host_native_order_tensors_are_converted_not_passed_through(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Native order there is big-endian and the wire is little-endian, so each tensor must be
    # converted (copied); on this little-endian machine the converted bytes are the same ones.
    kv = random_kv(GEOMETRY, seed=16)
    expected = b"".join(seal_parts(kv).payload_parts)
    monkeypatch.setattr(wire, "sys", SimpleNamespace(byteorder="big"))
    sealed = seal_parts(kv)
    tensors = kv.tensors()
    for part in sealed.payload_parts[1:]:
        assert not any(np.shares_memory(np.frombuffer(part, dtype=np.uint8), array) for array in tensors.values())
    assert b"".join(sealed.payload_parts) == expected


def test_the_producer_timings_are_durations_within_the_seal_call() -> None:
    started = time.perf_counter()
    sealed = seal_parts(compute_s=1.5)
    elapsed = time.perf_counter() - started
    timings = json.loads(sealed.manifest_bytes)["timings"]
    assert timings["compute_s"] == 1.5
    assert 0 <= timings["serialize_s"] <= elapsed
    assert 0 <= timings["digest_s"] <= elapsed
    assert timings["serialize_s"] + timings["digest_s"] <= elapsed


# ------------------------------------------------------------------------------------------
# the tree digest refusal


def test_a_changed_draft_byte_is_refused_on_the_tree_digest_without_naming_a_seam() -> None:
    # Draft tensors are leaves of the tree but not seams, so no layer is named.
    kv = random_kv(GEOMETRY, seed=17)
    kv.draft = random_kv(DRAFT_GEOMETRY, seed=18)
    handoff = seal(kv)
    claimed = json.loads(handoff.manifest_bytes)["payload"]["tree_sha256"]
    payload = bytearray(handoff.payload_bytes)
    header_end = 8 + struct.unpack_from("<Q", payload)[0]
    begin, _ = json.loads(payload[8:header_end])["draft.layers.0.v"]["data_offsets"]
    payload[header_end + begin] ^= 0x80
    found = tree_digest(bytes(payload))
    with pytest.raises(HandoffRefused) as refused:
        open_(Handoff(handoff.manifest_bytes, handoff.mac, bytes(payload)), draft_geometry=DRAFT_GEOMETRY)
    assert refused.value.check == "payload.tree_sha256"
    assert str(refused.value) == (f"handoff payload tree digest mismatch: found {found[:16]}…, "
                                  f"manifest payload.tree_sha256 says {claimed[:16]}…")


def test_a_changed_layer_byte_is_refused_on_the_tree_digest_naming_the_layer() -> None:
    handoff = seal()
    claimed = json.loads(handoff.manifest_bytes)["payload"]["tree_sha256"]
    payload = bytearray(handoff.payload_bytes)
    begin, end = payload_layout(GEOMETRY).offsets["layers.3.v"]
    payload[end - 1] ^= 0x01
    found = tree_digest(bytes(payload))
    with pytest.raises(HandoffRefused) as refused:
        open_(Handoff(handoff.manifest_bytes, handoff.mac, bytes(payload)))
    assert str(refused.value) == (f"handoff payload tree digest mismatch: found {found[:16]}…, "
                                  f"manifest payload.tree_sha256 says {claimed[:16]}…; "
                                  f"seam digest differs at layer 3 V")

"""The handoff wire format: sealing, the consumer's verify order, and refusal of tampering.

One small random KV is sealed once; every test derives handoffs from it. A *compromised
producer* (it holds the key) is modelled by :func:`reseal`, which recomputes the payload tree
digest and the MAC around a changed payload, so only the checks after them can catch the change.
The tree digest is recomputed here independently of the module (:func:`tree_digest`), from the
construction the manifest schema documents.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import threading
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import safetensors.numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qualify.contract.lanes import ProducerMode
from qualify.core.errors import HandoffRefused, Refused
from qualify.core.kv import KVCache, KVGeometry
from qualify.handoff import wire
from qualify.handoff.wire import (
    MANIFEST_SCHEMA,
    Handoff,
    HandoffExpectation,
    handoff_key_id,
    manifest_canonical_bytes,
    manifest_mac,
    mint_run_key,
    open_handoff,
    payload_tree_sha256,
    seal_handoff_parts,
)
from tests.support.fuzz_budget import fuzz_examples

KEY = mint_run_key()
IDENTITY = hashlib.sha256(b"identity").hexdigest()
CACHE_EXACT = hashlib.sha256(b"cache exact").hexdigest()
CACHE_NATIVE = hashlib.sha256(b"cache native").hexdigest()
PROMPT = hashlib.sha256(b"prompt").hexdigest()
GEOMETRY = KVGeometry(layers=5, kv_heads=2, head_dim=4, positions=6, dtype="float32")
DRAFT_GEOMETRY = KVGeometry(layers=2, kv_heads=1, head_dim=4, positions=6, dtype="float32")


def random_kv(geometry: KVGeometry, seed: int) -> KVCache:
    rng = np.random.default_rng(seed)
    shape = (geometry.kv_heads, geometry.positions, geometry.head_dim)
    return KVCache(
        [rng.standard_normal(shape).astype(geometry.dtype) for _ in range(geometry.layers)],
        [rng.standard_normal(shape).astype(geometry.dtype) for _ in range(geometry.layers)],
    )


KV = random_kv(GEOMETRY, seed=1)


def seal(kv: KVCache = KV, *, key: bytes = KEY, cache: str = CACHE_EXACT, mode: str = ProducerMode.EXACT,
         request_id: str = "req-1", **options: object) -> Handoff:
    """One contiguous handoff, as a producer's transport sends it (``options``: digest_threads)."""
    return seal_handoff_parts(kv, key=key, identity_sha256=IDENTITY, target_cache_identity=cache,
                              producer_mode=mode, lane="nvfp4-exact", prompt_sha256=PROMPT,
                              run_id="run-1", request_id=request_id, compute_s=0.25,
                              **options).to_handoff()  # type: ignore[arg-type]


EXPECTATION = HandoffExpectation(identity_sha256=IDENTITY, cache_identity=CACHE_EXACT, geometry=GEOMETRY,
                                 prompt_sha256=PROMPT, run_id="run-1", request_id="req-1", lane="nvfp4-exact",
                                 producer_mode=ProducerMode.EXACT)


def open_(handoff: Handoff, *, key: bytes = KEY, digest_threads: int = wire.DEFAULT_DIGEST_THREADS,
          **changes: object):
    """Open ``handoff`` against :data:`EXPECTATION` with ``changes`` (HandoffExpectation fields)."""
    return open_handoff(handoff, key=key, expectation=replace(EXPECTATION, **changes),
                        digest_threads=digest_threads)


def refusal(handoff: Handoff, **changes: object) -> tuple[str, str]:
    """The check that refuses ``handoff`` (opened as :func:`open_` does) and its words."""
    with pytest.raises(HandoffRefused) as refused:
        open_(handoff, **changes)
    return refused.value.check, str(refused.value)


def tensor_spans_of(payload: bytes) -> list[tuple[str, int, int]]:
    """``(name, begin, end)`` of every tensor in payload layout order (ascending data_offsets)."""
    header_end = 8 + struct.unpack_from("<Q", payload)[0]
    header = json.loads(payload[8:header_end])
    spans = [(name, header_end + entry["data_offsets"][0], header_end + entry["data_offsets"][1])
             for name, entry in header.items()]
    return sorted(spans, key=lambda span: (span[1], span[2]))


def leaves_of(payload: bytes) -> list[bytes]:
    return [hashlib.sha256(payload[begin:end]).digest() for _, begin, end in tensor_spans_of(payload)]


def tree_digest(payload: bytes) -> str:
    """SHA-256(prefix || SHA-256(t_1) || ... || SHA-256(t_n)), written out independently."""
    header_end = 8 + struct.unpack_from("<Q", payload)[0]
    return hashlib.sha256(payload[:header_end] + b"".join(leaves_of(payload))).hexdigest()


SEALED = seal()
PAYLOAD = bytes(SEALED.payload_bytes)
MANIFEST = json.loads(SEALED.manifest_bytes)
HEADER_END = 8 + struct.unpack_from("<Q", PAYLOAD)[0]
TENSOR_BYTES = GEOMETRY.kv_heads * GEOMETRY.positions * GEOMETRY.head_dim * 4


def reseal(payload: bytes, *, key: bytes = KEY, **manifest_changes) -> Handoff:
    """What a compromised producer sends: tree digest, byte count and MAC made to match."""
    document = json.loads(SEALED.manifest_bytes)
    document["payload"] = {"format": "safetensors", "tree_sha256": tree_digest(payload),
                           "bytes": len(payload)}
    document.update(manifest_changes)
    manifest_bytes = manifest_canonical_bytes(document)
    return Handoff(manifest_bytes, manifest_mac(key, manifest_bytes), payload)


def tensor_span(name: str) -> tuple[int, int]:
    begin, end = json.loads(PAYLOAD[8:HEADER_END])[name]["data_offsets"]
    return HEADER_END + begin, HEADER_END + end


def swap_layer_data(payload: bytes, first: int, second: int) -> bytes:
    """Swap the K and V bytes of two layers; the header still names them as before."""
    data = bytearray(payload)
    for part in ("k", "v"):
        a, b = tensor_span(f"layers.{first}.{part}"), tensor_span(f"layers.{second}.{part}")
        data[a[0]:a[1]], data[b[0]:b[1]] = payload[b[0]:b[1]], payload[a[0]:a[1]]
    return bytes(data)


def reorder_layers_in_header(first: int, second: int) -> bytes:
    """A valid safetensors payload holding the same tensors, two layers stored in swapped order."""
    header = json.loads(PAYLOAD[8:HEADER_END])
    names = list(header)
    i, j = names.index(f"layers.{first}.k"), names.index(f"layers.{second}.k")
    names[i:i + 2], names[j:j + 2] = names[j:j + 2], names[i:i + 2]
    entries, blobs, offset = {}, [], 0
    for name in names:
        begin, end = tensor_span(name)
        entries[name] = dict(header[name], data_offsets=[offset, offset + end - begin])
        blobs.append(PAYLOAD[begin:end])
        offset += end - begin
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


# ------------------------------------------------------------------------------------------
# round trip and format


def test_round_trip_installs_identical_kv_and_reports_manifest() -> None:
    kv, manifest, timings = open_(SEALED)
    for found, wanted in zip(kv.keys + kv.values, KV.keys + KV.values, strict=True):
        assert found.dtype == wanted.dtype and np.array_equal(found, wanted)
    assert manifest.geometry == GEOMETRY and manifest.handed_off_positions == 6
    assert manifest.producer_mode == "exact" and manifest.key_id == handoff_key_id(KEY)
    assert manifest.schema == MANIFEST_SCHEMA == "trust-ladder.handoff-manifest.v4"
    assert manifest.payload_size == len(PAYLOAD)
    assert manifest.payload_tree_sha256 == tree_digest(PAYLOAD) == MANIFEST["payload"]["tree_sha256"]
    assert manifest.payload_sha256 == manifest.payload_tree_sha256  # what sample records store
    assert manifest.payload_tree_sha256 != hashlib.sha256(PAYLOAD).hexdigest()
    assert manifest.seams[3].v_sha256 == hashlib.sha256(KV.values[3].tobytes()).hexdigest()
    assert manifest.compute_s == 0.25
    assert timings.verify_s >= 0 and timings.install_s >= 0


def test_payload_is_exactly_safetensors_numpy_save() -> None:
    many_layers = random_kv(replace(GEOMETRY, layers=12), seed=2)  # layers.10 sorts before .2
    many_layers.draft = random_kv(replace(DRAFT_GEOMETRY, dtype="float16"), seed=3)
    handoff = seal(many_layers)
    assert bytes(handoff.payload_bytes) == safetensors.numpy.save(many_layers.tensors())
    loaded = safetensors.numpy.load(bytes(handoff.payload_bytes))
    assert loaded.keys() == many_layers.tensors().keys()
    for name, array in many_layers.tensors().items():
        assert loaded[name].dtype == array.dtype and np.array_equal(loaded[name], array)


def test_draft_context_round_trip_and_expectation() -> None:
    kv = random_kv(GEOMETRY, seed=4)
    kv.draft = random_kv(DRAFT_GEOMETRY, seed=5)
    handoff = seal(kv)
    opened = open_(handoff, draft_geometry=DRAFT_GEOMETRY)
    assert opened.kv.draft is not None
    assert np.array_equal(opened.kv.draft.values[1], kv.draft.values[1])
    assert opened.manifest.draft_context_sha256 == hashlib.sha256(
        b"".join(hashlib.sha256(a.tobytes()).digest()
                 for a in (kv.draft.keys[0], kv.draft.values[0], kv.draft.keys[1],
                           kv.draft.values[1]))).hexdigest()
    assert opened.manifest.payload_tree_sha256 == tree_digest(bytes(handoff.payload_bytes))
    with pytest.raises(HandoffRefused, match="draft_geometry: draft context present"):
        open_(handoff)
    with pytest.raises(HandoffRefused, match="draft_geometry: draft context absent"):
        open_(SEALED, draft_geometry=DRAFT_GEOMETRY)
    with pytest.raises(HandoffRefused, match="draft_geometry kv_heads"):
        open_(handoff, draft_geometry=replace(DRAFT_GEOMETRY, kv_heads=2))


def test_installed_arrays_are_views_of_the_received_buffer() -> None:
    received = bytearray(PAYLOAD)
    kv, _, _ = open_(Handoff(SEALED.manifest_bytes, SEALED.mac, received))
    assert np.shares_memory(kv.keys[0], np.frombuffer(received, dtype=np.uint8))
    assert kv.keys[0].flags.c_contiguous and kv.keys[0].flags.writeable


def test_big_endian_and_strided_input_is_sealed_as_canonical_little_endian() -> None:
    odd = KVCache([np.asfortranarray(a).astype(">f4") for a in KV.keys],
                  [a.astype(">f4") for a in KV.values])
    assert bytes(seal(odd).payload_bytes) == PAYLOAD


# ------------------------------------------------------------------------------------------
# the payload tree digest


def test_tree_digest_is_the_documented_construction_and_its_leaves_are_the_seams() -> None:
    spans = tensor_spans_of(PAYLOAD)
    assert spans[0][1] == HEADER_END and spans[-1][2] == len(PAYLOAD)
    leaves = leaves_of(PAYLOAD)
    assert payload_tree_sha256(PAYLOAD[:HEADER_END], leaves) == MANIFEST["payload"]["tree_sha256"]
    by_name = {name: leaf.hex() for (name, _, _), leaf in zip(spans, leaves, strict=True)}
    for seam in MANIFEST["seams"]:
        assert seam["k_sha256"] == by_name[f"layers.{seam['layer']}.k"]
        assert seam["v_sha256"] == by_name[f"layers.{seam['layer']}.v"]
    with pytest.raises(ValueError, match="tensor digest 1: 31 bytes"):
        payload_tree_sha256(PAYLOAD[:HEADER_END], [leaves[0], leaves[1][:31]])


def test_tree_digest_changes_when_any_single_tensor_or_header_byte_changes() -> None:
    """Every byte of the payload, every single-bit flip: the tree digest differs each time."""
    original = MANIFEST["payload"]["tree_sha256"]
    leaves = leaves_of(PAYLOAD)
    spans = tensor_spans_of(PAYLOAD)
    seen = {original}
    flips = 0
    for position in range(HEADER_END):  # the length field and the JSON header
        for bit in range(8):
            prefix = bytearray(PAYLOAD[:HEADER_END])
            prefix[position] ^= 1 << bit
            digest = payload_tree_sha256(bytes(prefix), leaves)
            assert digest != original, (position, bit)
            seen.add(digest)
            flips += 1
    for index, (name, begin, end) in enumerate(spans):  # every byte of every tensor
        for position in range(begin, end):
            for bit in range(8):
                data = bytearray(PAYLOAD[begin:end])
                data[position - begin] ^= 1 << bit
                changed = [*leaves[:index], hashlib.sha256(data).digest(), *leaves[index + 1:]]
                digest = payload_tree_sha256(PAYLOAD[:HEADER_END], changed)
                assert digest != original, (name, position, bit)
                seen.add(digest)
                flips += 1
    assert flips == 8 * len(PAYLOAD) and len(seen) == flips + 1  # all distinct, too
    # and the consumer, under the producer's own MAC, stops at the tree digest
    tampered = bytearray(PAYLOAD)
    tampered[tensor_span("layers.2.k")[0] + 7] ^= 0x10
    with pytest.raises(HandoffRefused, match="^handoff payload tree digest mismatch: found "):
        open_(Handoff(SEALED.manifest_bytes, SEALED.mac, bytes(tampered)))
    tampered = bytearray(PAYLOAD)
    shape_digit = PAYLOAD.index(b'"shape":[2,6,4]') + len(b'"shape":[2,')
    tampered[shape_digit] ^= 0x01  # a header that still parses: "6" becomes "7"
    with pytest.raises(HandoffRefused, match="^handoff payload tree digest mismatch: found "):
        open_(Handoff(SEALED.manifest_bytes, SEALED.mac, bytes(tampered)))


@pytest.mark.parametrize("digest_threads", [None, 4])
def test_each_side_hashes_each_payload_byte_once_over_its_threads(
    monkeypatch: pytest.MonkeyPatch, digest_threads: int | None,
) -> None:
    """Seal and open a payload above the threading threshold, counting bytes fed to SHA-256 and
    the threads that fed them (two by default)."""
    geometry = KVGeometry(layers=5, kv_heads=2, head_dim=64, positions=1024, dtype="float32")
    kv = random_kv(geometry, seed=11)
    hashed: list[int] = []
    threads: set[int] = set()
    helpers: list[bool] = []
    real_sha256 = hashlib.sha256

    class CountingThread(threading.Thread):
        """A helper thread the hashing starts, counted (daemon or not, as it was asked for)."""

        def __init__(self, *args, daemon: bool | None = None, **kwargs) -> None:
            helpers.append(bool(daemon))
            super().__init__(*args, daemon=daemon, **kwargs)

    class CountingThreading:
        Thread = CountingThread
        Lock = threading.Lock

    class CountingSha256:
        def __init__(self, data: bytes | memoryview = b"") -> None:
            self._inner = real_sha256()
            self.update(data)

        def update(self, data: bytes | memoryview) -> None:
            hashed.append(memoryview(data).nbytes)
            threads.add(threading.get_ident())
            self._inner.update(data)

        def __getattr__(self, name: str):
            return getattr(self._inner, name)

    class CountingHashlib:
        sha256 = CountingSha256

    monkeypatch.setattr(wire, "hashlib", CountingHashlib)
    monkeypatch.setattr(wire, "threading", CountingThreading)
    # The MAC and key name hash the manifest and key, not the payload: keep them off the count.
    monkeypatch.setattr(wire, "manifest_mac",
                        lambda key, data: hmac.new(key, data, real_sha256).digest())
    monkeypatch.setattr(wire, "handoff_key_id", lambda key: real_sha256(key).hexdigest()[:16])
    chosen = {} if digest_threads is None else {"digest_threads": digest_threads}
    handoff = seal(kv, **chosen)
    size = len(handoff.payload_bytes)
    assert size > wire._PARALLEL_DIGEST_MIN_BYTES
    leaves = 32 * 2 * geometry.layers
    expected_threads = digest_threads or wire.DEFAULT_DIGEST_THREADS
    # The calling thread and (threads - 1) helpers share the tensors; every helper may not win one.
    assert sum(hashed) == size + leaves, "the producer hashes each payload byte exactly once"
    assert helpers == [True] * (expected_threads - 1) and 2 <= len(threads) <= expected_threads, threads
    hashed.clear()
    threads.clear()
    helpers.clear()
    opened = open_(handoff, geometry=geometry, **chosen)
    assert sum(hashed) == size + leaves, "the consumer hashes each payload byte exactly once"
    assert helpers == [True] * (expected_threads - 1) and 2 <= len(threads) <= expected_threads, threads
    assert opened.manifest.payload_tree_sha256 == tree_digest(bytes(handoff.payload_bytes))
    assert np.array_equal(opened.kv.keys[4], kv.keys[4])


@pytest.mark.parametrize("threads", [0, 257, 1.5, True, "4"])
def test_bad_digest_threads_are_refused(threads: object) -> None:
    with pytest.raises(Refused, match="digest_threads: found"):
        seal(KV, digest_threads=threads)
    with pytest.raises(Refused, match="digest_threads: found"):
        open_(SEALED, digest_threads=threads)


BF16_GEOMETRY = replace(GEOMETRY, dtype="bfloat16")


def bf16_kv(seed: int) -> KVCache:
    """bfloat16 KV (ml_dtypes' numpy dtype) with every bit pattern drawn, finite or not."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    shape = (GEOMETRY.kv_heads, GEOMETRY.positions, GEOMETRY.head_dim)
    draw = [rng.integers(0, 1 << 16, size=shape, dtype=np.uint16).view(ml_dtypes.bfloat16)
            for _ in range(2 * GEOMETRY.layers)]
    return KVCache(draw[:GEOMETRY.layers], draw[GEOMETRY.layers:])


def test_bfloat16_round_trip_keeps_every_bit_and_tags_bf16() -> None:
    kv = bf16_kv(seed=21)
    handoff = seal(kv)
    payload = bytes(handoff.payload_bytes)
    header = json.loads(payload[8:8 + struct.unpack_from("<Q", payload)[0]])
    assert {entry["dtype"] for entry in header.values()} == {"BF16"}
    assert json.loads(handoff.manifest_bytes)["geometry"]["dtype"] == "bfloat16"
    opened = open_(handoff, geometry=BF16_GEOMETRY)
    for found, wanted in zip(opened.kv.keys + opened.kv.values, kv.keys + kv.values, strict=True):
        assert found.dtype == wanted.dtype
        assert np.array_equal(found.view(np.uint16), wanted.view(np.uint16))
    # A float32 consumer refuses a bf16 handoff on its geometry, before installing anything.
    with pytest.raises(HandoffRefused, match="geometry dtype: handoff has bfloat16, consumer model has float32"):
        open_(handoff)


def test_payload_layout_places_every_tensor_where_sealing_puts_it() -> None:
    kv = random_kv(replace(GEOMETRY, layers=12), seed=23)
    layout = wire.payload_layout(kv.geometry)
    buffer = bytearray(layout.size)
    buffer[:len(layout.prefix)] = layout.prefix
    for name, array in kv.tensors().items():
        begin, end = layout.offsets[name]
        buffer[begin:end] = array.tobytes()
    assert bytes(buffer) == bytes(seal(kv).payload_bytes)
    with pytest.raises(Refused, match="geometry dtype: found 'int8'"):
        wire.payload_layout(replace(GEOMETRY, dtype="int8"))


# ------------------------------------------------------------------------------------------
# refusals, one field each


def test_wrong_key_is_refused() -> None:
    other = mint_run_key()
    with pytest.raises(HandoffRefused, match=f"MAC does not verify under key {handoff_key_id(other)}"):
        open_(SEALED, key=other)
    with pytest.raises(HandoffRefused, match="MAC does not verify"):
        open_(seal(key=other))


def test_other_producer_mode_is_refused_on_cache_identity() -> None:
    native = seal(cache=CACHE_NATIVE, mode=ProducerMode.NATIVE)
    with pytest.raises(HandoffRefused,
                       match="target_cache_identity_sha256 .* \\(producer mode native\\), expected"):
        open_(native)
    assert open_(native, cache_identity=CACHE_NATIVE,
                 producer_mode=ProducerMode.NATIVE).manifest.producer_mode is ProducerMode.NATIVE


@pytest.mark.parametrize(
    ("expected", "message"),
    [
        (replace(GEOMETRY, layers=4), "geometry layers: handoff has 5, consumer model has 4"),
        (replace(GEOMETRY, kv_heads=4), "geometry kv_heads: handoff has 2, consumer model has 4"),
        (replace(GEOMETRY, head_dim=8), "geometry head_dim: handoff has 4, consumer model has 8"),
        (replace(GEOMETRY, dtype="float16"), "geometry dtype: handoff has float32"),
        (replace(GEOMETRY, positions=7), "geometry positions: handoff has 6, expected 7"),
    ],
    ids=["layers", "kv_heads", "head_dim", "dtype", "positions"],
)
def test_geometry_mismatch_names_the_field(expected: KVGeometry, message: str) -> None:
    with pytest.raises(HandoffRefused, match=message):
        open_(SEALED, geometry=expected)


def test_seam_mismatch_names_layer_and_part_when_producer_reseals() -> None:
    tampered = bytearray(PAYLOAD)
    begin, _ = tensor_span("layers.3.v")
    tampered[begin + 5] ^= 0x40
    with pytest.raises(HandoffRefused, match="^seam digest mismatch at layer 3 V$"):
        open_(reseal(bytes(tampered)))
    tampered = bytearray(PAYLOAD)
    tampered[tensor_span("layers.0.k")[1] - 1] ^= 0x01
    with pytest.raises(HandoffRefused, match="^seam digest mismatch at layer 0 K$"):
        open_(reseal(bytes(tampered)))


# Consumer-side faults in documented order (the checks after the payload's).
LATE_FAULTS = {"identity": {"identity_sha256": "e" * 64}, "cache_identity": {"cache_identity": CACHE_NATIVE},
               "producer_mode": {"producer_mode": ProducerMode.NATIVE}, "prompt": {"prompt_sha256": "f" * 64},
               "request_id": {"request_id": "req-2"}}


def late_faults_from(check: str | None) -> dict[str, object]:
    """Every consumer-side fault from ``check`` on (all of them for ``None``)."""
    names = list(LATE_FAULTS)
    start = 0 if check is None else names.index(check)
    return {field: value for name in names[start:] for field, value in LATE_FAULTS[name].items()}


def test_verify_order_is_the_documented_order_with_every_later_check_also_failing() -> None:
    """With faults at every later check too, the refusal names the earliest in the documented order:
    MAC, manifest, run binding, identity/cache/mode/prompt/request, geometry, payload size, tree
    digest, layout, seams."""
    flipped = bytearray(PAYLOAD)
    flipped[tensor_span("layers.1.k")[0]] ^= 0x01
    flipped = bytes(flipped)
    truncated = PAYLOAD[:-4]
    wrong_geometry = {"geometry": replace(GEOMETRY, kv_heads=1)}
    run_faults = {"run_id": "run-2", "lane": "other-lane", "key_id": "0" * 16}
    everything_late = {**wrong_geometry, **late_faults_from(None)}
    short = Handoff(SEALED.manifest_bytes, SEALED.mac, truncated)
    cases = [
        ("mac", reseal(flipped, key=mint_run_key(), **run_faults), everything_late),
        ("manifest.schema", reseal(flipped, handed_off_positions="6", **run_faults), everything_late),
        ("manifest.run_id", reseal(flipped, **run_faults), everything_late),
        ("manifest.lane", reseal(flipped, lane="other-lane", key_id="0" * 16), everything_late),
        ("manifest.key_id", reseal(flipped, key_id="0" * 16), everything_late),
        *((check, short, {**wrong_geometry, **late_faults_from(check)}) for check in LATE_FAULTS),
        ("geometry", short, wrong_geometry),
        ("payload.bytes", short, {}),
        ("payload.tree_sha256", Handoff(SEALED.manifest_bytes, SEALED.mac, flipped), {}),
        ("payload.layout", reseal(reorder_layers_in_header(1, 3)), {}),
        ("seam", reseal(flipped), {}),
    ]
    for check, handoff, expectation_faults in cases:
        with pytest.raises(HandoffRefused) as refusal:
            open_(handoff, **expectation_faults)
        assert refusal.value.check == check, (check, str(refusal.value))
        assert "\n" not in str(refusal.value)


def test_draft_context_mismatch_when_producer_reseals() -> None:
    kv = random_kv(GEOMETRY, seed=6)
    kv.draft = random_kv(DRAFT_GEOMETRY, seed=7)
    handoff = seal(kv)
    document = json.loads(handoff.manifest_bytes)
    payload = bytearray(handoff.payload_bytes)
    header_end = 8 + struct.unpack_from("<Q", payload)[0]
    begin, _ = json.loads(payload[8:header_end])["draft.layers.1.k"]["data_offsets"]
    payload[header_end + begin] ^= 0x01
    document["payload"]["tree_sha256"] = tree_digest(bytes(payload))
    manifest_bytes = manifest_canonical_bytes(document)
    forged = Handoff(manifest_bytes, manifest_mac(KEY, manifest_bytes), bytes(payload))
    with pytest.raises(HandoffRefused, match="draft context digest mismatch"):
        open_(forged, draft_geometry=DRAFT_GEOMETRY)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"identity_sha256": "e" * 64}, "^identity_sha256 is"),
        ({"prompt_sha256": "f" * 64}, "^prompt_sha256 is"),
        ({"request_id": "req-2"}, "^request_id is 'req-1', expected 'req-2'"),
        ({"run_id": "run-2"}, "^run_id is 'run-1', expected 'run-2'"),
    ],
    ids=["identity", "prompt", "replayed-request", "other-run"],
)
def test_expectation_mismatch_names_the_field(overrides: dict, message: str) -> None:
    with pytest.raises(HandoffRefused, match=message):
        open_(SEALED, **overrides)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"producer_mode": "fast"}, 'handoff manifest: producer_mode: found "fast", expected one of "exact", "native"'),
        ({"extra": 1}, "handoff manifest: extra: found unexpected field, expected only schema, run_id"),
        ({"handed_off_positions": 5}, "handed_off_positions 5 disagrees with geometry.positions 6"),
        ({"seams": MANIFEST["seams"][:4]}, "seams lists 4 layers, geometry.layers is 5"),
        ({"seams": [MANIFEST["seams"][i] for i in (1, 0, 2, 3, 4)]},
         "seams\\[0\\] is for layer 1, expected layer 0"),
        ({"geometry": dict(MANIFEST["geometry"], layers=6), "seams": MANIFEST["seams"]
          + [dict(MANIFEST["seams"][0], layer=5)]}, "^geometry layers: handoff has 6, consumer model has 5$"),
    ],
    ids=["mode", "extra-field", "positions", "missing-seam", "seam-order", "missing-layer"],
)
def test_manifest_problems_under_a_valid_mac_are_refused(change: dict, message: str) -> None:
    with pytest.raises(HandoffRefused, match=message):
        open_(reseal(PAYLOAD, **change))


def test_non_canonical_manifest_is_refused_even_with_valid_mac() -> None:
    pretty = json.dumps(MANIFEST, indent=1).encode()
    with pytest.raises(HandoffRefused, match="not in canonical JSON form"):
        open_(Handoff(pretty, manifest_mac(KEY, pretty), PAYLOAD))
    duplicated = SEALED.manifest_bytes[:-1] + b',"lane":"x"}'
    with pytest.raises(HandoffRefused, match="duplicate key 'lane'"):
        open_(Handoff(duplicated, manifest_mac(KEY, duplicated), PAYLOAD))


def test_a_renamed_tensor_in_a_resealed_payload_is_refused_at_layout() -> None:
    renamed = PAYLOAD[:HEADER_END].replace(b'"layers.4.v"', b'"layers.4.w"') + PAYLOAD[HEADER_END:]
    with pytest.raises(HandoffRefused, match="^handoff payload: tensor layers.4.v is missing$") as refusal:
        open_(reseal(renamed))
    assert refusal.value.check == "payload.layout"


def test_reordered_layer_in_a_valid_safetensors_payload_is_refused() -> None:
    with pytest.raises(HandoffRefused, match="tensor order: position 2 holds layers.3.k"):
        open_(reseal(reorder_layers_in_header(1, 3)))


def test_sealing_refuses_what_the_consumer_would_refuse() -> None:
    with pytest.raises(Refused, match="producer_mode: found 'fast'"):
        seal(mode="fast")
    with pytest.raises(Refused, match="handoff key: 16 bytes"):
        seal(key=b"k" * 16)
    with pytest.raises(Refused, match="layer 2 V is float32 \\[2, 5, 4\\]"):
        short = random_kv(GEOMETRY, seed=8)
        short.values[2] = short.values[2][:, :5]
        seal(short)


def test_run_keys_are_fresh_and_named_by_a_short_digest() -> None:
    first, second = mint_run_key(), mint_run_key()
    assert len(first) == 32 and first != second
    assert handoff_key_id(first) == hashlib.sha256(first).hexdigest()[:16]


# ------------------------------------------------------------------------------------------
# property: every tampered handoff is refused


TAMPER_COUNTS: Counter[str] = Counter()
LAYER = st.integers(0, GEOMETRY.layers - 1)
TAMPERS = st.one_of(
    st.tuples(st.just("payload-byte"), st.integers(0, len(PAYLOAD) - 1), st.integers(1, 255)),
    st.tuples(st.just("manifest-byte"), st.integers(0, len(SEALED.manifest_bytes) - 1),
              st.integers(1, 255)),
    st.tuples(st.just("mac-byte"), st.integers(0, 31), st.integers(1, 255)),
    st.tuples(st.just("truncated-payload"), st.integers(0, len(PAYLOAD) - 1), st.just(0)),
    st.tuples(st.just("swapped-layers"), LAYER, LAYER).filter(lambda t: t[1] != t[2]),
    st.tuples(st.just("swapped-layers-resealed"), LAYER, LAYER).filter(lambda t: t[1] != t[2]),
    st.tuples(st.just("reordered-header-resealed"), LAYER, LAYER).filter(lambda t: t[1] < t[2]),
    st.tuples(st.just("payload-byte-resealed"), st.integers(HEADER_END, len(PAYLOAD) - 1),
              st.integers(1, 255)),
)


def tampered(kind: str, a: int, b: int) -> Handoff:
    manifest, mac, payload = SEALED.manifest_bytes, SEALED.mac, PAYLOAD
    if kind == "payload-byte":
        flipped = bytearray(payload)
        flipped[a] ^= b
        return Handoff(manifest, mac, bytes(flipped))
    if kind == "manifest-byte":
        flipped = bytearray(manifest)
        flipped[a] ^= b
        return Handoff(bytes(flipped), mac, payload)
    if kind == "mac-byte":
        flipped = bytearray(mac)
        flipped[a] ^= b
        return Handoff(manifest, bytes(flipped), payload)
    if kind == "truncated-payload":
        return Handoff(manifest, mac, payload[:a])
    if kind == "swapped-layers":
        return Handoff(manifest, mac, swap_layer_data(payload, a, b))
    if kind == "swapped-layers-resealed":
        return reseal(swap_layer_data(payload, a, b))
    if kind == "reordered-header-resealed":
        return reseal(reorder_layers_in_header(a, b))
    if kind == "payload-byte-resealed":
        flipped = bytearray(payload)
        flipped[a] ^= b
        return reseal(bytes(flipped))
    raise AssertionError(kind)


def test_every_tampered_handoff_is_refused() -> None:
    """1,000 tampered handoffs; each refused, and one changed tensor byte at the right check."""
    TAMPER_COUNTS.clear()

    @settings(max_examples=fuzz_examples(1000), deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(TAMPERS)
    def check(tamper: tuple[str, int, int]) -> None:
        kind, a, b = tamper
        TAMPER_COUNTS["examples"] += 1
        with pytest.raises(HandoffRefused) as refusal:
            open_(tampered(kind, a, b))
        message = str(refusal.value)
        if kind == "payload-byte" and a >= HEADER_END:
            assert message.startswith("handoff payload tree digest mismatch"), message
        if kind == "payload-byte-resealed":
            span = next(s for s in tensor_spans_of(PAYLOAD) if s[1] <= a < s[2])
            layer, part = span[0].split(".")[1:]
            assert message == f"seam digest mismatch at layer {layer} {part.upper()}", message
        TAMPER_COUNTS["refused"] += 1
        TAMPER_COUNTS[kind] += 1

    check()
    assert TAMPER_COUNTS["examples"] >= fuzz_examples(1000)
    assert TAMPER_COUNTS["refused"] == TAMPER_COUNTS["examples"]
    kinds = {"payload-byte", "manifest-byte", "mac-byte", "truncated-payload", "swapped-layers",
             "swapped-layers-resealed", "reordered-header-resealed", "payload-byte-resealed"}
    assert kinds <= set(TAMPER_COUNTS), TAMPER_COUNTS


def test_a_byte_flipped_after_sealing_is_refused_naming_its_layer():
    """A flip in transit (after the MAC) fails the tree digest, and the refusal says where."""
    import numpy as np

    from qualify.core.errors import HandoffRefused
    from qualify.core.kv import KVCache
    from qualify.handoff.wire import HandoffExpectation, mint_run_key, open_handoff, seal_handoff_parts

    rng = np.random.default_rng(3)
    kv = KVCache([rng.standard_normal((2, 16, 8), dtype=np.float32) for _ in range(4)],
                 [rng.standard_normal((2, 16, 8), dtype=np.float32) for _ in range(4)])
    key = mint_run_key()
    sealed = seal_handoff_parts(kv, key=key, identity_sha256="a" * 64, target_cache_identity="b" * 64,
                                producer_mode=ProducerMode.NATIVE, lane="nvfp4-native-w4a4", prompt_sha256="c" * 64,
                                run_id="run", request_id="req", compute_s=0.0).to_handoff()
    payload = bytearray(sealed.payload_bytes)
    offset = payload.index(kv.keys[2].tobytes())  # layer 2 K's bytes in the payload
    payload[offset + 5] ^= 0x04
    tampered = type(sealed)(sealed.manifest_bytes, sealed.mac, bytes(payload))
    with pytest.raises(HandoffRefused, match="tree digest mismatch.*seam digest differs at layer 2 K"):
        open_handoff(tampered, key=key, expectation=HandoffExpectation(
            identity_sha256="a" * 64, cache_identity="b" * 64, geometry=kv.geometry, prompt_sha256="c" * 64,
            run_id="run", request_id="req", lane="nvfp4-native-w4a4", producer_mode=ProducerMode.NATIVE))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"identity_sha256": "A" * 64}, "handoff expectation identity_sha256: found 'AAAA"),
        ({"cache_identity": ""}, "handoff expectation cache_identity: found ''"),
        ({"prompt_sha256": None}, "handoff expectation prompt_sha256: found None"),
        ({"run_id": ""}, "handoff expectation run_id: found '', expected a non-empty id"),
        ({"request_id": 7}, "handoff expectation request_id: found 7"),
        ({"geometry": GEOMETRY.as_dict()}, "handoff expectation geometry: found dict, expected KVGeometry"),
        ({"draft_geometry": "none"}, "handoff expectation draft_geometry: found str, expected KVGeometry"),
    ],
    ids=["identity", "cache", "prompt", "run_id", "request_id", "geometry", "draft"],
)
def test_a_malformed_expectation_is_refused_before_anything_is_opened(change: dict, message: str) -> None:
    with pytest.raises(Refused, match=message):
        replace(EXPECTATION, **change)


def test_open_handoff_takes_only_an_expectation_object() -> None:
    with pytest.raises(Refused, match="open_handoff expectation: found dict, expected HandoffExpectation"):
        open_handoff(SEALED, key=KEY, expectation={"identity_sha256": IDENTITY})  # type: ignore[arg-type]  # the wrong type is the point


# ------------------------------------------------------------------------------------------
# payload refusals after the MAC, each reached by a producer that holds the key (issue 20)

HEADER_SIZE = HEADER_END - 8
SHORT_NAMES = {name: f"t{index}" for index, name in enumerate(json.loads(PAYLOAD[8:HEADER_END]))}


def with_header(header: object) -> bytes:
    """PAYLOAD's data under another header, space-padded to the original's bytes: the payload
    keeps its length, so only the checks after the size check can refuse it."""
    text = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= HEADER_SIZE, "the changed header must fit the original header's bytes"
    return struct.pack("<Q", HEADER_SIZE) + text + b" " * (HEADER_SIZE - len(text)) + PAYLOAD[HEADER_END:]


def with_header_length(claimed: int) -> bytes:
    """PAYLOAD with its 8-byte header length replaced by ``claimed``."""
    return struct.pack("<Q", claimed) + PAYLOAD[8:]


def short_named_header() -> dict[str, dict[str, object]]:
    """PAYLOAD's header with every tensor renamed ``t<i>``: the same structure, with room to spare."""
    return {SHORT_NAMES[name]: dict(entry) for name, entry in json.loads(PAYLOAD[8:HEADER_END]).items()}


def sent_with_valid_mac(payload: bytes) -> Handoff:
    """``payload`` under a manifest MACed with the run key, its byte count right and its tree digest
    the pristine one: refusals at the header stage come before any hashing."""
    document = json.loads(SEALED.manifest_bytes)
    document["payload"]["bytes"] = len(payload)
    manifest_bytes = manifest_canonical_bytes(document)
    return Handoff(manifest_bytes, manifest_mac(KEY, manifest_bytes), payload)


def edited(**entries: dict[str, object]) -> dict[str, dict[str, object]]:
    header = short_named_header()
    for name, change in entries.items():
        header[name] = {**header[name], **change}
    return header


LAST = f"t{2 * GEOMETRY.layers - 1}"


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (with_header_length(len(PAYLOAD) - 7),
         f"handoff payload: header length {len(PAYLOAD) - 7} exceeds the payload"),
        (with_header(b"[]"), "handoff payload header: not a JSON object"),
        (with_header({**short_named_header(), "t0": [1]}), "handoff payload: tensor t0 header is malformed"),
        (with_header(edited(t0={"extra": 0})), "handoff payload: tensor t0 header is malformed"),
        (with_header({**short_named_header(), "t0": {"dtype": "F32", "shape": [2, 6, 4]}}),
         "handoff payload: tensor t0 header is malformed"),
        (with_header(edited(t0={"data_offsets": "0,192"})), "handoff payload: tensor t0 data_offsets is malformed"),
        (with_header(edited(t0={"data_offsets": [0, 96, 192]})),
         "handoff payload: tensor t0 data_offsets is malformed"),
        (with_header(edited(t0={"data_offsets": [-1, 192]})),
         "handoff payload: tensor t0 data_offsets is malformed"),
        (with_header(edited(t0={"data_offsets": [0.0, 192]})),
         "handoff payload: tensor t0 data_offsets is malformed"),
        (with_header(edited(t0={"data_offsets": [False, 192]})),
         "handoff payload: tensor t0 data_offsets is malformed"),
        (with_header(edited(t0={"data_offsets": [192, 0]})), "handoff payload: tensor t0 data_offsets is malformed"),
        (with_header(edited(t0={"data_offsets": [0, 188]})),
         "handoff payload: tensor t1 data_offsets are not contiguous"),
        (with_header(edited(t0={"data_offsets": [0, 196]})),
         "handoff payload: tensor t1 data_offsets are not contiguous"),
        (with_header(edited(**{LAST: {"data_offsets": [
            short_named_header()[LAST]["data_offsets"][0], len(PAYLOAD) - HEADER_END - 4]}})),  # type: ignore[index]
         f"handoff payload: tensors end at byte {len(PAYLOAD) - 4}, payload has {len(PAYLOAD)}"),
    ],
    ids=["header-length-one-over", "not-an-object", "entry-not-a-mapping", "entry-extra-key", "entry-missing-key",
         "offsets-text", "offsets-three", "offsets-negative", "offsets-float", "offsets-bool", "offsets-reversed",
         "gap", "overlap", "trailing-bytes"],
)
def test_a_malformed_payload_header_under_a_valid_mac_is_refused_before_hashing(payload: bytes, message: str) -> None:
    assert len(payload) == len(PAYLOAD)
    with pytest.raises(HandoffRefused) as refusal:
        open_(sent_with_valid_mac(payload))
    assert (refusal.value.check, str(refusal.value)) == ("payload.header", message)


def test_a_header_exactly_as_long_as_the_payload_allows_is_not_refused_as_too_long() -> None:
    payload = with_header_length(len(PAYLOAD) - 8)
    with pytest.raises(HandoffRefused) as refusal:
        open_(sent_with_valid_mac(payload))
    assert "exceeds the payload" not in str(refusal.value)


def test_a_zero_length_tensor_is_well_formed_structure() -> None:
    header = short_named_header()
    header["z"] = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
    with pytest.raises(HandoffRefused) as refusal:
        open_(sent_with_valid_mac(with_header(header)))
    assert refusal.value.check == "payload.tree_sha256", str(refusal.value)  # past the header stage


def header_text_edited(old: bytes, new: bytes) -> bytes:
    """PAYLOAD with one byte string of its header replaced by another of the same length."""
    assert len(old) == len(new) and PAYLOAD[8:HEADER_END].count(old) == 1
    return PAYLOAD[:8] + PAYLOAD[8:HEADER_END].replace(old, new) + PAYLOAD[HEADER_END:]


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (header_text_edited(b'"layers.0.k":{"dtype":"F32"', b'"layers.0.k":{"dtype":"F16"'),
         "handoff payload: tensor layers.0.k dtype F16, manifest geometry says float32"),
        (header_text_edited(b'"layers.0.k":{"dtype":"F32"', b'"layers.0.k":{"dtype":12345'),
         "handoff payload: tensor layers.0.k dtype 12345, manifest geometry says float32"),
        (header_text_edited(b'"layers.0.k":{"dtype":"F32","shape":[2,6,4]',
                            b'"layers.0.k":{"dtype":"F32","shape":[4,6,2]'),
         "handoff payload: tensor layers.0.k shape [4, 6, 2], manifest geometry says [2, 6, 4]"),
        (header_text_edited(b'"data_offsets":[0,192]},"layers.0.v":{"dtype":"F32","shape":[2,6,4],'
                            b'"data_offsets":[192,384]',
                            b'"data_offsets":[0,188]},"layers.0.v":{"dtype":"F32","shape":[2,6,4],'
                            b'"data_offsets":[188,384]'),
         f"handoff payload: tensor layers.0.k holds 188 bytes, manifest geometry says {TENSOR_BYTES}"),
        (header_text_edited(b'"layers.0.k":{"dtype":"F32","shape":[2,6,4]',
                            b'"layers.0.k":{"shape":[2,6,4],"dtype":"F32"'),
         "handoff payload: header is not the canonical safetensors header"),
        (PAYLOAD[:HEADER_END - 1] + b"\t" + PAYLOAD[HEADER_END:],
         "handoff payload: header is not the canonical safetensors header"),
    ],
    ids=["dtype", "dtype-not-text", "shape", "byte-count", "key-order", "padding"],
)
def test_a_payload_layout_other_than_the_geometry_s_is_refused_after_the_tree_digest(payload: bytes,
                                                                                      message: str) -> None:
    assert len(payload) == len(PAYLOAD)
    with pytest.raises(HandoffRefused) as refusal:
        open_(reseal(payload))
    assert (refusal.value.check, str(refusal.value)) == ("payload.layout", message)


@pytest.mark.parametrize("change", [-4, -1, 1, 8], ids=["4-short", "1-short", "1-over", "8-over"])
def test_a_payload_whose_size_agrees_with_its_manifest_but_not_the_geometry_is_refused(change: int) -> None:
    payload = PAYLOAD[:change] if change < 0 else PAYLOAD + b"\0" * change
    with pytest.raises(HandoffRefused) as refusal:
        open_(sent_with_valid_mac(payload))
    assert (refusal.value.check, str(refusal.value)) == (
        "payload.bytes", f"payload.bytes is {len(PAYLOAD) + change}, expected {len(PAYLOAD)} for the expected geometry")


@pytest.mark.parametrize("threaded", [True, False])
def test_a_digest_that_raises_raises_in_the_caller_and_one_that_returns_gives_its_value(threaded: bool) -> None:
    def fails() -> None:
        raise ZeroDivisionError("digest failed")

    with pytest.raises(ZeroDivisionError, match="digest failed"):
        wire._Concurrent(fails, threaded=threaded).result()
    assert wire._Concurrent(lambda: 7, threaded=threaded).result() == 7


def test_an_unexpected_exceptions_text_is_one_line_of_at_most_160_characters() -> None:
    assert wire._exception_text(ValueError("a\nb")) == "a b"
    assert wire._exception_text(ValueError("x" * 161)) == "x" * 160

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text")

    assert wire._exception_text(Unprintable()) == "no message"

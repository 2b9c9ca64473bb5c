"""The handoff wire format: a safetensors KV payload, a JSON manifest, and an HMAC-SHA256 over it.

A producer seals a :class:`~qualify.core.kv.KVCache` into a :class:`Handoff`: the payload is the
safetensors encoding of ``KVCache.tensors()`` (byte-identical to ``safetensors.numpy.save``,
built without copying the tensors; float16/32/64, or bfloat16 as ml_dtypes' numpy dtype), the
manifest names what the payload is (per-layer seam digests, payload tree digest and size,
identity, cache identity, producer mode, geometry, prompt digest, producer phase times), and the
MAC covers the manifest's canonical bytes, its RFC 8785 serialisation
(:func:`manifest_canonical_bytes`, manifest v4), which in turn cover the payload through its tree
digest (:func:`payload_tree_sha256`).

Each side hashes every payload byte exactly once: one SHA-256 per tensor (over two threads by
default, ``digest_threads`` on a larger host; hashlib releases the GIL). Those tensor digests
are at once the seam digests of ``layers.{i}.k`` / ``layers.{i}.v``, the leaves of the payload
tree digest, and the inputs of the draft context digest (:func:`draft_context_sha256`).

The consumer opens a handoff against a :class:`HandoffExpectation` in a fixed order and refuses
on the first difference with one line naming it; :attr:`HandoffRefused.check` names the check:

1. MAC under the run key (``mac``).
2. Manifest: strict JSON, size and nesting bounded before parsing (``manifest.json``); the JSON
   Schema with strict types, where an integer is a JSON integer literal (never ``4.0`` or
   ``true``), at most 2**53 - 1 (what RFC 8785 represents exactly), and every number is finite
   (``manifest.schema``; a manifest of another version, v3 included, is refused naming it);
   canonical form, RFC 8785 (``manifest.canonical``); self-consistency
   (``manifest.handed_off_positions``, ``manifest.seams``).
3. Run binding: run id, lane, and the key id, which must name the key the MAC verified under
   (``manifest.run_id``, ``manifest.lane``, ``manifest.key_id``).
4. Identity digest, target cache identity and producer mode (``identity``, ``cache_identity``,
   ``producer_mode``), the prompt digest (``prompt``), then the request id (``request_id``: no
   replay of another request's handoff).
5. Geometry, draft geometry and handed-off positions against the consumer's (``geometry``,
   ``draft_geometry``, ``handed_off_positions``).
6. Payload byte count: ``payload.bytes`` is the exact size for that geometry and the received
   payload has that many bytes (``payload.bytes``); nothing has been hashed yet.
7. Payload tree digest, recomputed from freshly computed tensor digests (``payload.tree_sha256``;
   a payload that does not split into a safetensors header and contiguous tensors has none and
   is refused as ``payload.header``).
8. Payload layout: tensor names, order, dtypes, shapes, canonical header (``payload.layout``).
9. Every seam digest (``seam digest mismatch at layer 3 V``, ``seam``) and the draft context
   digest (``draft_context``).

:func:`open_handoff` is the one boundary: anything else that goes wrong inside it is refused as
``HandoffRefused`` naming the stage it happened in, never a raw exception.

Only then are the tensors installed, as zero-copy views of the verified payload buffer.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import secrets
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal, NamedTuple, TypeVar

import ml_dtypes  # noqa: F401  (registers numpy's "bfloat16" dtype, the wire's BF16 tensors)
import numpy as np

from qualify.contract.lanes import ProducerMode
from qualify.core.assets import require_asset
from qualify.core.digests import is_sha256_hex, jcs_bytes
from qualify.core.errors import HandoffRefused, Refused, one_line
from qualify.core.kv import KVCache, KVGeometry
from qualify.core.strict_json import check_schema, parse_untrusted_json, render

MANIFEST_SCHEMA = "trust-ladder.handoff-manifest.v4"
MANIFEST_SCHEMA_PATH = require_asset("contracts/handoff-manifest.v4.schema.json")
# The only manifest version read. A manifest lives on the wire between a producer and a consumer
# of the same harness version and is never archived (a receipt keeps its digests, not the
# manifest), so an older version (v3: legacy canonical JSON under the MAC) is refused, not read.
PAYLOAD_FORMAT = "safetensors"
RUN_KEY_BYTES = 32
MAC_BYTES = 32
KEY_ID_HEX_CHARS = 16
DRAFT_PREFIX = "draft."

# numpy dtype name -> (safetensors dtype tag, rank in safetensors' layout sort: higher first).
# "bfloat16" is ml_dtypes' numpy dtype (imported above, which registers the name).
_SAFETENSORS_DTYPES: Mapping[str, tuple[str, int]] = {
    "float64": ("F64", 3),
    "float32": ("F32", 2),
    "float16": ("F16", 1),
    "bfloat16": ("BF16", 1),
}
_TAG_TO_DTYPE = {tag: name for name, (tag, _) in _SAFETENSORS_DTYPES.items()}
KV_DTYPES: tuple[str, ...] = tuple(_SAFETENSORS_DTYPES)
"""The KV dtypes a payload can carry (numpy dtype names)."""
_MAX_HEADER_BYTES = 16 << 20
MAX_MANIFEST_BYTES = 16 << 20
"""Largest manifest a consumer parses (a manifest of a few hundred layers is tens of kilobytes)."""
MAX_MANIFEST_DEPTH = 8
"""Deepest JSON nesting a manifest may have (it has 3 levels)."""
# The manifest schema's lane pattern: an expectation's lane must be one a manifest can carry.
_LANE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
# Below this many payload bytes, hashing runs on one thread (a thread costs more than it saves).
_PARALLEL_DIGEST_MIN_BYTES = 4 << 20
# Threads that hash tensors by default (the calling thread plus helpers); hashlib releases the
# GIL. Two suit the 2-core CI machine; a caller on a larger host passes ``digest_threads``.
DEFAULT_DIGEST_THREADS = 2
# A payload tree leaf: one tensor's raw SHA-256 digest.
_LEAF_BYTES = 32

Buffer = bytes | bytearray | memoryview
_T = TypeVar("_T")


# --------------------------------------------------------------------------------------------
# keys


def mint_run_key() -> bytes:
    """A fresh 32-byte run key (one per qualification run; enrollment keys are minted alike)."""
    return secrets.token_bytes(RUN_KEY_BYTES)


def handoff_key_id(key: bytes) -> str:
    """A handoff key's public name (a run key, or a lane's enrolled key): the first 16 hex digits
    of its SHA-256 (safe to log and record; a receipt-signing key's id is
    :func:`qualify.archive.keys.signing_key_id`)."""
    return hashlib.sha256(_checked_key(key)).hexdigest()[:KEY_ID_HEX_CHARS]


def manifest_mac(key: bytes, manifest_bytes: bytes) -> bytes:
    """HMAC-SHA256 of the manifest's canonical bytes under ``key`` (32 raw bytes)."""
    return hmac.new(_checked_key(key), manifest_bytes, hashlib.sha256).digest()


def manifest_canonical_bytes(document: Mapping[str, Any]) -> bytes:
    """A manifest's one byte form, what the MAC covers and what the consumer compares the received
    bytes with: RFC 8785 (JCS), so a verifier in any language reproduces it with a stock library.
    ``ValueError`` for what JCS cannot represent exactly (the schema refuses it first)."""
    return jcs_bytes(document)


def _checked_key(key: object) -> bytes:
    if not isinstance(key, (bytes, bytearray)):
        raise Refused(f"handoff key: found {type(key).__name__}, expected bytes")
    if len(key) < RUN_KEY_BYTES:
        raise Refused(f"handoff key: {len(key)} bytes, expected at least {RUN_KEY_BYTES}")
    return bytes(key)


# --------------------------------------------------------------------------------------------
# public data types


TransportKind = Literal["unix", "tcp", "tls", "in-process"]
"""How a handoff travels: the producer's Unix socket, loopback TCP, TCP under TLS, or in process."""


@dataclass(frozen=True)
class TransportStats:
    """How a handoff reached the consumer, measured by its transport.

    Over a socket, ``transfer_s`` runs from the first response byte to the last payload byte and
    ``request_s`` from sending the request to the last byte (it includes the producer's compute
    and sealing). In process, ``transfer_s`` is the producer's own copy into the payload plus any
    join of the sealed parts: 0, with ``gbit_per_s`` 0, when the payload was written in place.
    """

    request_s: float
    transfer_s: float
    payload_bytes: int
    gbit_per_s: float
    # As the producer reported them in its response frame (unauthenticated; informational).
    producer_compute_s: float | None = None
    producer_seal_s: float | None = None
    # The longest the producer sent nothing (no byte, no heartbeat) during the request: a stall
    # it recovered from when at least protocol.STALL_NOTE_S; 0 in process.
    longest_silence_s: float = 0.0
    # What carried it: a Unix socket, plain TCP (loopback), TCP under TLS, or nothing (in process).
    kind: TransportKind = "in-process"

    @property
    def phase_overlap_s(self) -> float | None:
        """How long the producer's compute and sealing ran while the payload was already moving:
        their sum plus the transfer, less the request's wall time (at least 0); 0 for a producer
        that answers only once sealed, more for one that streams as it computes. None when the
        producer reported no phase times (they are informational, from its frame header)."""
        if self.producer_compute_s is None or self.producer_seal_s is None:
            return None
        return max(0.0, self.producer_compute_s + self.producer_seal_s + self.transfer_s - self.request_s)


@dataclass(frozen=True)
class Handoff:
    """One sealed handoff as it travels: manifest bytes, their MAC, and the safetensors payload."""

    manifest_bytes: bytes
    mac: bytes
    payload_bytes: Buffer
    transport: TransportStats | None = None


@dataclass(frozen=True)
class SealedHandoff:
    """A producer's handoff before it is sent: the payload as zero-copy parts (prefix + tensors).

    Concatenating ``payload_parts`` gives the payload; a sender writes them one after another.
    """

    manifest_bytes: bytes
    mac: bytes
    payload_parts: tuple[memoryview, ...]
    payload_size: int

    def to_handoff(self) -> Handoff:
        """Join the parts into one payload buffer (one copy; for in-process use and tests)."""
        return Handoff(self.manifest_bytes, self.mac, b"".join(self.payload_parts))


@dataclass(frozen=True)
class SeamDigest:
    """SHA-256 of one layer's K and V raw C-order bytes (the payload tree's leaves for them)."""

    layer: int
    k_sha256: str
    v_sha256: str


@dataclass(frozen=True)
class HandoffManifest:
    """The typed view of a verified manifest (every field the sample record needs)."""

    schema: str
    run_id: str
    request_id: str
    lane: str
    producer_mode: ProducerMode
    key_id: str
    identity_sha256: str
    target_cache_identity_sha256: str
    prompt_sha256: str
    handed_off_positions: int
    geometry: KVGeometry
    payload_tree_sha256: str
    payload_size: int
    seams: tuple[SeamDigest, ...]
    draft_geometry: KVGeometry | None
    draft_context_sha256: str | None
    compute_s: float
    serialize_s: float
    digest_s: float

    @property
    def payload_sha256(self) -> str:
        """The payload digest a sample record stores: since manifest v2, the tree digest.

        Kept so callers that record ``payload_sha256`` keep working; it is
        :func:`payload_tree_sha256`, not a flat SHA-256 of the payload bytes.
        """
        return self.payload_tree_sha256


@dataclass(frozen=True)
class VerifyTimings:
    """Consumer phase times in seconds; ``digest_s`` is the tensor digests (two threads) + tree."""

    mac_s: float
    manifest_s: float
    digest_s: float
    checks_s: float
    install_s: float

    @property
    def verify_s(self) -> float:
        return self.mac_s + self.manifest_s + self.digest_s + self.checks_s

    @property
    def total_s(self) -> float:
        return self.verify_s + self.install_s


@dataclass(frozen=True)
class HandoffExpectation:
    """What the consumer expects a handoff to carry; :func:`open_handoff` refuses any difference.

    ``geometry`` is the consumer model's KV geometry at the expected handed-off positions and
    dtype; ``draft_geometry`` is required exactly when a draft context rides along. ``run_id``,
    ``lane`` and ``producer_mode`` bind the handoff to this run's producer, ``request_id`` to this
    request (no replay of another request's handoff).
    """

    identity_sha256: str
    cache_identity: str
    geometry: KVGeometry
    prompt_sha256: str
    run_id: str
    request_id: str
    lane: str
    producer_mode: ProducerMode
    draft_geometry: KVGeometry | None = None

    def __post_init__(self) -> None:
        for name, digest in (("identity_sha256", self.identity_sha256), ("cache_identity", self.cache_identity),
                             ("prompt_sha256", self.prompt_sha256)):
            if not is_sha256_hex(digest):
                raise Refused(f"handoff expectation {name}: found {digest!r}, expected 64 lowercase hex characters")
        for name, value in (("run_id", self.run_id), ("request_id", self.request_id)):
            if not isinstance(value, str) or not value:
                raise Refused(f"handoff expectation {name}: found {value!r}, expected a non-empty id")
        if not isinstance(self.lane, str) or _LANE.fullmatch(self.lane) is None:
            raise Refused(f"handoff expectation lane: found {self.lane!r}, expected a lane name "
                          f"(lowercase letters, digits, '.', '_', '-'; at most 64)")
        try:
            ProducerMode(self.producer_mode)
        except ValueError:
            raise Refused(f"handoff expectation producer_mode: found {self.producer_mode!r}, "
                          f"expected exact or native") from None
        drafted = [] if self.draft_geometry is None else [("draft_geometry", self.draft_geometry)]
        for name, geometry in [("geometry", self.geometry), *drafted]:
            if not isinstance(geometry, KVGeometry):
                raise Refused(f"handoff expectation {name}: found {type(geometry).__name__}, expected KVGeometry")
            _check_expected_geometry(name, geometry)

    @property
    def expected_payload_bytes(self) -> int:
        """The exact payload size a handoff of this geometry (and draft geometry) has, so a
        receiver can refuse an announced size before allocating anything."""
        return _exact_payload_bytes(self.geometry, self.draft_geometry)


def _check_expected_geometry(name: str, geometry: KVGeometry) -> None:
    """An expected geometry the wire can carry: positive integer dimensions, a wire dtype."""
    for part in ("layers", "kv_heads", "head_dim", "positions"):
        value = getattr(geometry, part)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise Refused(f"handoff expectation {name}.{part}: found {value!r}, expected an int >= 1")
    if geometry.dtype not in _SAFETENSORS_DTYPES:
        raise Refused(f"handoff expectation {name}.dtype: found {geometry.dtype!r}, expected one of "
                      f"{', '.join(_SAFETENSORS_DTYPES)}")


@lru_cache(maxsize=64)
def _exact_payload_bytes(geometry: KVGeometry, draft: KVGeometry | None) -> int:
    return payload_layout(geometry, draft).size


class OpenedHandoff(NamedTuple):
    """What :func:`open_handoff` returns: the installed KV, its manifest, and verify timings."""

    kv: KVCache
    manifest: HandoffManifest
    timings: VerifyTimings


# --------------------------------------------------------------------------------------------
# payload layout (safetensors, byte-identical to safetensors.numpy.save)


@dataclass(frozen=True)
class _TensorSlot:
    name: str
    dtype: str
    shape: tuple[int, int, int]

    @property
    def nbytes(self) -> int:
        kv_heads, positions, head_dim = self.shape
        return kv_heads * positions * head_dim * np.dtype(self.dtype).itemsize


def _wire_names(layers: int, prefix: str) -> list[str]:
    """Tensor names in wire order (``KVCache.tensors()`` order): layer by layer, K before V."""
    return [f"{prefix}layers.{i}.{part}" for i in range(layers) for part in ("k", "v")]


def _slots(geometry: KVGeometry, draft: KVGeometry | None) -> list[_TensorSlot]:
    """Every tensor a payload of this geometry carries, in wire order."""
    slots: list[_TensorSlot] = []
    for prefix, geo in [("", geometry)] + ([] if draft is None else [(DRAFT_PREFIX, draft)]):
        shape = (geo.kv_heads, geo.positions, geo.head_dim)
        slots.extend(_TensorSlot(name, geo.dtype, shape) for name in _wire_names(geo.layers, prefix))
    return slots


def _layout_order(slots: Sequence[_TensorSlot]) -> list[_TensorSlot]:
    """safetensors' data order: larger dtype first, then name (bytewise), as ``save`` writes."""
    return sorted(slots, key=lambda s: (-_SAFETENSORS_DTYPES[s.dtype][1], s.name.encode()))


def _payload_prefix(layout: Sequence[_TensorSlot]) -> bytes:
    """The 8-byte little-endian header length plus the space-padded JSON header."""
    entries: dict[str, Any] = {}
    offset = 0
    for slot in layout:
        end = offset + slot.nbytes
        entries[slot.name] = {
            "dtype": _SAFETENSORS_DTYPES[slot.dtype][0],
            "shape": list(slot.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    header = json.dumps(entries, separators=(",", ":")).encode("ascii")
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


class PayloadLayout(NamedTuple):
    """Where a payload of one geometry puts everything: the header prefix, each tensor's
    ``(begin, end)`` byte offsets in the payload, and the payload's size."""

    prefix: bytes
    offsets: dict[str, tuple[int, int]]
    size: int


def payload_layout(geometry: KVGeometry, draft: KVGeometry | None = None) -> PayloadLayout:
    """The payload layout :func:`seal_handoff_parts` writes for this geometry, so a producer can
    place its tensors straight into one payload buffer (e.g. one device-to-host copy)."""
    if geometry.dtype not in _SAFETENSORS_DTYPES:
        raise Refused(f"geometry dtype: found {geometry.dtype!r}, expected one of {', '.join(_SAFETENSORS_DTYPES)}")
    layout = _layout_order(_slots(geometry, draft))
    prefix = _payload_prefix(layout)
    offsets: dict[str, tuple[int, int]] = {}
    cursor = len(prefix)
    for slot in layout:
        offsets[slot.name] = (cursor, cursor + slot.nbytes)
        cursor += slot.nbytes
    return PayloadLayout(prefix, offsets, cursor)


def _geometry_of(keys: Sequence[np.ndarray], values: Sequence[np.ndarray], what: str) -> KVGeometry:
    """Check one KV's arrays agree on shape and dtype; refuse anything the wire cannot carry."""
    if len(keys) == 0 or len(keys) != len(values):
        raise Refused(f"{what}: {len(keys)} K and {len(values)} V layers, expected equal and >= 1")
    first = keys[0]
    if first.ndim != 3:
        raise Refused(f"{what}: layer 0 K has shape {list(first.shape)}, expected 3 dimensions")
    dtype = first.dtype.name
    if dtype not in _SAFETENSORS_DTYPES:
        raise Refused(f"{what}: dtype {dtype}, expected one of {', '.join(_SAFETENSORS_DTYPES)}")
    for index, (key, value) in enumerate(zip(keys, values, strict=True)):
        for part, array in (("K", key), ("V", value)):
            if array.shape != first.shape or array.dtype != first.dtype:
                raise Refused(
                    f"{what}: layer {index} {part} is {array.dtype} {list(array.shape)}, "
                    f"expected {first.dtype} {list(first.shape)} like layer 0 K"
                )
    kv_heads, positions, head_dim = first.shape
    if min(kv_heads, positions, head_dim) < 1:
        raise Refused(f"{what}: empty shape {list(first.shape)}")
    return KVGeometry(len(keys), kv_heads, head_dim, positions, dtype)


def _wire_array(array: np.ndarray) -> np.ndarray:
    """The array as C-contiguous little-endian (a copy only when it is not already)."""
    if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and sys.byteorder == "big"):
        array = array.astype(array.dtype.newbyteorder("<"))
    return np.ascontiguousarray(array)


def _byte_view(array: np.ndarray) -> memoryview:
    return array.ravel().view(np.uint8).data


# --------------------------------------------------------------------------------------------
# hashing


def payload_tree_sha256(prefix: Buffer, tensor_digests: Sequence[bytes]) -> str:
    """The payload digest the manifest carries as ``payload.tree_sha256`` (hex).

    A two-level hash tree over a safetensors payload ``prefix || t_1 || ... || t_n``, where
    ``prefix`` is the 8-byte little-endian header length plus the JSON header and ``t_1 .. t_n``
    are the tensors' data in payload layout order (ascending ``data_offsets``)::

        tree_sha256 = SHA-256(prefix || SHA-256(t_1) || ... || SHA-256(t_n))

    with each ``SHA-256(t_i)`` the 32 raw digest bytes. ``tensor_digests`` are those raw digests,
    in that order. The input is unambiguous: the prefix states its own length and the header
    fixes ``n`` and every tensor's span, so equal trees mean equal prefixes and equal tensor
    digests (short of a SHA-256 collision), and the tree binds every payload byte, as the flat
    SHA-256 did, while each byte is hashed once.
    """
    digest = hashlib.sha256(prefix)
    for index, leaf in enumerate(tensor_digests):
        if len(leaf) != _LEAF_BYTES:
            raise ValueError(f"tensor digest {index}: {len(leaf)} bytes, expected 32 raw bytes")
        digest.update(leaf)
    return digest.hexdigest()


def draft_context_sha256(draft_tensor_digests: Sequence[bytes]) -> str:
    """The manifest's ``draft_context_sha256`` (hex): SHA-256 over the draft tensors' digests.

    ``draft_tensor_digests`` are the 32-byte raw SHA-256s of ``draft.layers.{i}.k`` and
    ``draft.layers.{i}.v`` in wire order (layer by layer, K before V); they are the same leaves
    the payload tree uses, so no draft byte is hashed twice.
    """
    return hashlib.sha256(b"".join(draft_tensor_digests)).hexdigest()


def _check_digest_threads(threads: object) -> int:
    if type(threads) is not int or not 1 <= threads <= 256:
        raise Refused(f"digest_threads: found {threads!r}, expected an int from 1 to 256")
    return threads


def _tensor_digests(views: Sequence[Buffer], threads: int = DEFAULT_DIGEST_THREADS) -> list[bytes]:
    """The raw SHA-256 of each view, hashed once each over ``threads`` threads.

    The threads take tensors from a shared queue, largest first, so a busy core slows the
    split rather than stalling it. Small payloads are hashed on the calling thread alone.
    """
    sizes = [memoryview(view).nbytes for view in views]
    if threads < 2 or len(views) < 2 or sum(sizes) < _PARALLEL_DIGEST_MIN_BYTES:
        return [hashlib.sha256(view).digest() for view in views]
    digests: list[bytes] = [b""] * len(views)
    pending = iter(sorted(range(len(views)), key=lambda index: -sizes[index]))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                index = next(pending, None)
            if index is None:
                return
            digests[index] = hashlib.sha256(views[index]).digest()

    helpers = [_Concurrent(work, threaded=True) for _ in range(min(threads, len(views)) - 1)]
    try:
        work()
    finally:
        for helper in helpers:
            helper.result()
    return digests


class _Concurrent:
    """Runs one callable on a helper thread (hashlib releases the GIL), or inline when small."""

    def __init__(self, work: Callable[[], _T], *, threaded: bool) -> None:
        self._work = work
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._work()
        except BaseException as exc:  # re-raised in the caller's thread by result()
            self._error = exc

    def result(self) -> Any:
        if self._thread is None:
            self._run()
        else:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


# --------------------------------------------------------------------------------------------
# producer side


def seal_handoff_parts(
    kv: KVCache,
    *,
    key: bytes,
    identity_sha256: str,
    target_cache_identity: str,
    producer_mode: ProducerMode,
    lane: str,
    prompt_sha256: str,
    run_id: str,
    request_id: str,
    compute_s: float,
    digest_threads: int = DEFAULT_DIGEST_THREADS,
) -> SealedHandoff:
    """Seal ``kv`` without copying its tensors: digests, manifest, MAC, payload as parts.

    Refuses (``Refused``) a producer mode other than exact/native and any malformed input, so a
    producer can never sign something the consumer's schema would reject. The parts are the
    header prefix and views of ``kv``'s own arrays; when those arrays already sit in one buffer
    in :func:`payload_layout` order, that buffer is the contiguous payload.
    """
    _check_digest_threads(digest_threads)
    try:
        mode = ProducerMode(producer_mode)  # the enum, or (from an untyped caller) its value
    except ValueError:
        raise Refused(f"producer_mode: found {producer_mode!r}, expected exact or native") from None
    for field_name, digest in (
        ("identity_sha256", identity_sha256),
        ("target_cache_identity_sha256", target_cache_identity),
        ("prompt_sha256", prompt_sha256),
    ):
        if not is_sha256_hex(digest):
            raise Refused(f"{field_name}: found {digest!r}, expected 64 lowercase hex characters")
    # A bool is an int in Python but no duration.
    if not (isinstance(compute_s, (int, float)) and not isinstance(compute_s, bool) and math.isfinite(compute_s)
            and compute_s >= 0):
        raise Refused(f"compute_s: found {compute_s!r}, expected a finite number >= 0")
    started = time.perf_counter()
    keys = [_wire_array(a) for a in kv.keys]
    values = [_wire_array(a) for a in kv.values]
    geometry = _geometry_of(keys, values, "kv")
    named: dict[str, np.ndarray] = {}
    for index, (key_array, value_array) in enumerate(zip(keys, values, strict=True)):
        named[f"layers.{index}.k"] = key_array
        named[f"layers.{index}.v"] = value_array
    draft_geometry: KVGeometry | None = None
    if kv.draft is not None:
        if kv.draft.draft is not None:
            raise Refused("kv: a draft context cannot carry its own draft")
        draft_keys = [_wire_array(a) for a in kv.draft.keys]
        draft_values = [_wire_array(a) for a in kv.draft.values]
        draft_geometry = _geometry_of(draft_keys, draft_values, "kv draft")
        for index, (key_array, value_array) in enumerate(zip(draft_keys, draft_values, strict=True)):
            named[f"{DRAFT_PREFIX}layers.{index}.k"] = key_array
            named[f"{DRAFT_PREFIX}layers.{index}.v"] = value_array
    layout = _layout_order(_slots(geometry, draft_geometry))
    prefix = _payload_prefix(layout)
    tensor_views = [_byte_view(named[slot.name]) for slot in layout]
    parts = (memoryview(prefix), *tensor_views)
    payload_size = sum(part.nbytes for part in parts)
    serialized = time.perf_counter()

    leaves = _tensor_digests(tensor_views, digest_threads)
    tree_sha256 = payload_tree_sha256(prefix, leaves)
    leaf_by_name = {slot.name: leaf for slot, leaf in zip(layout, leaves, strict=True)}
    seams = [
        {
            "layer": index,
            "k_sha256": leaf_by_name[f"layers.{index}.k"].hex(),
            "v_sha256": leaf_by_name[f"layers.{index}.v"].hex(),
        }
        for index in range(geometry.layers)
    ]
    draft_context = None
    if draft_geometry is not None:
        draft_context = draft_context_sha256(
            [leaf_by_name[name] for name in _wire_names(draft_geometry.layers, DRAFT_PREFIX)]
        )
    digested = time.perf_counter()

    manifest: dict[str, Any] = {
        "schema": MANIFEST_SCHEMA,
        "run_id": run_id,
        "request_id": request_id,
        "lane": lane,
        "producer_mode": mode.value,
        "key_id": handoff_key_id(key),
        "identity_sha256": identity_sha256,
        "target_cache_identity_sha256": target_cache_identity,
        "prompt_sha256": prompt_sha256,
        "handed_off_positions": geometry.positions,
        "geometry": geometry.as_dict(),
        "payload": {"format": PAYLOAD_FORMAT, "tree_sha256": tree_sha256, "bytes": payload_size},
        "seams": seams,
        "timings": {
            "compute_s": float(compute_s),
            "serialize_s": serialized - started,
            "digest_s": digested - serialized,
        },
    }
    if draft_geometry is not None:
        manifest["draft_geometry"] = draft_geometry.as_dict()
        manifest["draft_context_sha256"] = draft_context
    _validate_manifest_schema(manifest, refusal=Refused)
    try:
        manifest_bytes = manifest_canonical_bytes(manifest)
    except ValueError as exc:  # the schema bounds every number; this is a guard, not a path
        raise Refused(f"handoff manifest: {one_line(str(exc))}") from None
    return SealedHandoff(manifest_bytes, manifest_mac(key, manifest_bytes), parts, payload_size)


# --------------------------------------------------------------------------------------------
# manifest parsing


def _validate_manifest_schema(document: object, *, refusal: type[Refused]) -> None:
    """The manifest schema with strict types (an integer is a JSON integer, numbers finite); a
    manifest declaring another version (an older producer) is refused naming that version."""
    try:
        if isinstance(document, dict) and document.get("schema", MANIFEST_SCHEMA) != MANIFEST_SCHEMA:
            raise Refused(f"handoff manifest: schema: found {render(document['schema'])}, expected "
                          f"{render(MANIFEST_SCHEMA)} (producer and consumer run the same harness version; "
                          f"a manifest is never archived, so no other version is read)")
        check_schema(document, MANIFEST_SCHEMA_PATH, "handoff manifest")
    except Refused as exc:
        if refusal is HandoffRefused:
            raise HandoffRefused(one_line(str(exc)), check="manifest.schema") from None
        raise


def _strict_json(data: bytes, what: str, *, max_bytes: int, check: str) -> Any:
    """Untrusted JSON, bounded in size and nesting before parsing, or a refusal naming ``check``."""
    try:
        return parse_untrusted_json(data, what, max_bytes=max_bytes, max_depth=MAX_MANIFEST_DEPTH)
    except Refused as exc:
        raise HandoffRefused(one_line(str(exc)), check=check) from None


def _geometry_from(document: Mapping[str, Any]) -> KVGeometry:
    return KVGeometry(
        document["layers"],
        document["kv_heads"],
        document["head_dim"],
        document["positions"],
        document["dtype"],
    )


def _parse_manifest(manifest_bytes: bytes) -> HandoffManifest:
    """Strict JSON, strict schema, canonical form, then self-consistency; the typed view."""
    document = _strict_json(manifest_bytes, "handoff manifest", max_bytes=MAX_MANIFEST_BYTES,
                            check="manifest.json")
    _validate_manifest_schema(document, refusal=HandoffRefused)
    # Past the schema's bounds the canonical form always exists (a failure would still be refused,
    # by open_handoff's boundary, as an unexpected error in the manifest stage).
    if manifest_canonical_bytes(document) != manifest_bytes:
        raise HandoffRefused("handoff manifest: not in canonical JSON form (RFC 8785)", check="manifest.canonical")
    geometry = _geometry_from(document["geometry"])
    if document["handed_off_positions"] != geometry.positions:
        raise HandoffRefused(
            f"handoff manifest: handed_off_positions {document['handed_off_positions']} "
            f"disagrees with geometry.positions {geometry.positions}",
            check="manifest.handed_off_positions",
        )
    seams = tuple(SeamDigest(s["layer"], s["k_sha256"], s["v_sha256"]) for s in document["seams"])
    if len(seams) != geometry.layers:
        raise HandoffRefused(
            f"handoff manifest: seams lists {len(seams)} layers, geometry.layers is {geometry.layers}",
            check="manifest.seams",
        )
    for index, seam in enumerate(seams):
        if seam.layer != index:
            raise HandoffRefused(
                f"handoff manifest: seams[{index}] is for layer {seam.layer}, expected layer {index}",
                check="manifest.seams",
            )
    draft = document.get("draft_geometry")
    timings = document["timings"]
    return HandoffManifest(
        schema=document["schema"],
        run_id=document["run_id"],
        request_id=document["request_id"],
        lane=document["lane"],
        producer_mode=ProducerMode(document["producer_mode"]),  # the schema allows only its values
        key_id=document["key_id"],
        identity_sha256=document["identity_sha256"],
        target_cache_identity_sha256=document["target_cache_identity_sha256"],
        prompt_sha256=document["prompt_sha256"],
        handed_off_positions=document["handed_off_positions"],
        geometry=geometry,
        payload_tree_sha256=document["payload"]["tree_sha256"],
        payload_size=document["payload"]["bytes"],
        seams=seams,
        draft_geometry=None if draft is None else _geometry_from(draft),
        draft_context_sha256=document.get("draft_context_sha256"),
        compute_s=float(timings["compute_s"]),
        serialize_s=float(timings["serialize_s"]),
        digest_s=float(timings["digest_s"]),
    )


# --------------------------------------------------------------------------------------------
# payload parsing (consumer)


def _first_changed_seam(located: _LocatedPayload, leaves: Sequence[bytes],
                        manifest: HandoffManifest) -> str:
    """Where bytes changed after sealing: the first layer whose K or V digest differs from the
    (MAC-verified) manifest's seam digest, as a suffix for the refusal; empty if none does."""
    found = {tensor.name: leaf.hex() for tensor, leaf in zip(located.tensors, leaves, strict=True)}
    for seam in manifest.seams:
        for part, claimed in (("k", seam.k_sha256), ("v", seam.v_sha256)):
            if found.get(f"layers.{seam.layer}.{part}") != claimed:
                return f"; seam digest differs at layer {seam.layer} {part.upper()}"
    return ""


class _LocatedTensor(NamedTuple):
    name: str
    dtype_tag: object
    shape: object
    begin: int  # absolute byte offsets in the payload
    end: int


class _LocatedPayload(NamedTuple):
    """A payload split into its prefix and its tensors in layout (ascending offset) order."""

    data_start: int
    tensors: tuple[_LocatedTensor, ...]


class _PayloadLayout(NamedTuple):
    data_start: int
    offsets: dict[str, tuple[int, int]]


def _locate_tensors(payload: memoryview) -> _LocatedPayload:
    """Split a payload into header prefix and tensors, as its own header places them.

    Only structure is checked here (what the tree digest needs): a readable header of tensor
    entries whose ``data_offsets`` tile the data area exactly, with no gap, overlap or trailing
    byte. Whether those are the tensors the manifest declares is :func:`_check_payload_layout`'s
    job, after the tree digest.
    """
    size = payload.nbytes
    if size < 8:
        raise HandoffRefused(
            f"handoff payload: {size} bytes, too short for a safetensors header",
            check="payload.header",
        )
    (header_size,) = struct.unpack_from("<Q", payload)
    if header_size > min(_MAX_HEADER_BYTES, size - 8):
        raise HandoffRefused(
            f"handoff payload: header length {header_size} exceeds the payload",
            check="payload.header",
        )
    header = _strict_json(bytes(payload[8 : 8 + header_size]), "handoff payload header",
                          max_bytes=_MAX_HEADER_BYTES, check="payload.header")
    if not isinstance(header, dict):
        raise HandoffRefused("handoff payload header: not a JSON object", check="payload.header")
    data_start = 8 + header_size
    found: list[_LocatedTensor] = []
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise HandoffRefused(
                f"handoff payload: tensor {name} header is malformed",
                check="payload.header",
            )
        offsets = entry["data_offsets"]
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int and o >= 0 for o in offsets)
            or offsets[0] > offsets[1]
        ):
            raise HandoffRefused(
                f"handoff payload: tensor {name} data_offsets is malformed",
                check="payload.header",
            )
        found.append(_LocatedTensor(name, entry["dtype"], entry["shape"],
                                    data_start + offsets[0], data_start + offsets[1]))
    found.sort(key=lambda t: (t.begin, t.end, t.name.encode()))  # no lone surrogates: parsed strictly
    cursor = data_start
    for tensor in found:
        if tensor.begin != cursor:
            raise HandoffRefused(
                f"handoff payload: tensor {tensor.name} data_offsets are not contiguous",
                check="payload.header",
            )
        cursor = tensor.end
    if cursor != size:
        raise HandoffRefused(
            f"handoff payload: tensors end at byte {cursor}, payload has {size}",
            check="payload.header",
        )
    return _LocatedPayload(data_start, tuple(found))


def _check_payload_layout(
    payload: memoryview, located: _LocatedPayload, manifest: HandoffManifest
) -> _PayloadLayout:
    """Refuse tensor names, order, dtypes or shapes the manifest does not declare.

    The header must be byte-for-byte the canonical one for the declared geometry, so nothing
    (metadata, padding, key order) can vary between two payloads with equal tensors.
    """
    slots = _slots(manifest.geometry, manifest.draft_geometry)
    expected_names = {slot.name for slot in slots}
    found_names = {tensor.name for tensor in located.tensors}
    missing = [slot.name for slot in slots if slot.name not in found_names]
    if missing:
        raise HandoffRefused(f"handoff payload: tensor {missing[0]} is missing", check="payload.layout")
    extra = sorted(found_names - expected_names)
    if extra:
        raise HandoffRefused(f"handoff payload: unexpected tensor {extra[0]!r}", check="payload.layout")
    layout = _layout_order(slots)
    offsets_by_name: dict[str, tuple[int, int]] = {}
    for position, tensor in enumerate(located.tensors):  # as many as the slots: names checked above
        slot = layout[position]
        if tensor.name != slot.name:
            raise HandoffRefused(
                f"handoff payload: tensor order: position {position} holds {tensor.name}, "
                f"expected {slot.name}",
                check="payload.layout",
            )
        tag = tensor.dtype_tag
        if not isinstance(tag, str) or _TAG_TO_DTYPE.get(tag) != slot.dtype:
            raise HandoffRefused(
                f"handoff payload: tensor {slot.name} dtype {tensor.dtype_tag}, manifest "
                f"geometry says {slot.dtype}",
                check="payload.layout",
            )
        if not isinstance(tensor.shape, list) or any(type(d) is not int for d in tensor.shape) \
                or tensor.shape != list(slot.shape):  # strict: a shape of 2.0 is no shape of 2
            raise HandoffRefused(
                f"handoff payload: tensor {slot.name} shape {tensor.shape}, manifest geometry says "
                f"{list(slot.shape)}",
                check="payload.layout",
            )
        if tensor.end - tensor.begin != slot.nbytes:
            raise HandoffRefused(
                f"handoff payload: tensor {slot.name} holds {tensor.end - tensor.begin} bytes, "
                f"manifest geometry says {slot.nbytes}",
                check="payload.layout",
            )
        offsets_by_name[slot.name] = (tensor.begin, tensor.end)
    if bytes(payload[: located.data_start]) != _payload_prefix(layout):
        raise HandoffRefused(
            "handoff payload: header is not the canonical safetensors header",
            check="payload.layout",
        )
    return _PayloadLayout(located.data_start, offsets_by_name)


# --------------------------------------------------------------------------------------------
# consumer side


def _short(digest: str) -> str:
    return digest[:16] + "…"


class _Stage:
    """The check :func:`open_handoff` is at, so an unexpected failure is refused naming it."""

    def __init__(self) -> None:
        self.check = "mac"


def open_handoff(
    handoff: Handoff,
    key: bytes,
    expectation: HandoffExpectation,
    *,
    digest_threads: int = DEFAULT_DIGEST_THREADS,
) -> OpenedHandoff:
    """Verify ``handoff`` in the documented order and install it, or raise ``HandoffRefused``.

    The installed arrays are views of ``handoff.payload_bytes`` (writable if that buffer is).
    ``digest_threads`` threads hash the tensors. A bad ``key``, ``expectation`` or
    ``digest_threads`` is the caller's mistake (``Refused``); anything wrong with the handoff,
    expected or not, is ``HandoffRefused`` with ``check`` naming the check or stage.
    """
    if not isinstance(expectation, HandoffExpectation):
        raise Refused(f"open_handoff expectation: found {type(expectation).__name__}, expected HandoffExpectation")
    _check_digest_threads(digest_threads)
    run_key = _checked_key(key)
    stage = _Stage()
    try:
        return _open_verified(handoff, run_key, expectation, digest_threads, stage)
    except HandoffRefused:
        raise
    except Refused as exc:  # a refusal from a shared helper: still this handoff's refusal
        raise HandoffRefused(one_line(str(exc)), check=stage.check) from None
    except Exception as exc:  # the boundary: never a raw exception out of a hostile handoff
        raise HandoffRefused(
            one_line(f"handoff {stage.check}: unexpected {type(exc).__name__} ({_exception_text(exc)})"),
            check=stage.check,
        ) from None


def _exception_text(exc: BaseException) -> str:
    try:
        return one_line(str(exc))[:160]
    except Exception:  # an exception whose message itself fails
        return "no message"


def _wire_bytes(data: object, what: str) -> bytes:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise HandoffRefused(f"{what}: found {type(data).__name__}, expected bytes", check="mac")
    return bytes(data)


def _open_verified(handoff: Handoff, key: bytes, expectation: HandoffExpectation, digest_threads: int,
                   stage: _Stage) -> OpenedHandoff:
    """:func:`open_handoff`'s checks in the documented order; ``stage`` follows them."""
    started = time.perf_counter()
    manifest_bytes = _wire_bytes(handoff.manifest_bytes, "handoff manifest_bytes")
    mac = handoff.mac
    if not isinstance(mac, (bytes, bytearray)) or not hmac.compare_digest(bytes(mac), manifest_mac(key, manifest_bytes)):
        raise HandoffRefused(f"handoff MAC does not verify under key {handoff_key_id(key)}", check="mac")
    mac_done = time.perf_counter()

    stage.check = "manifest"
    manifest = _parse_manifest(manifest_bytes)
    stage.check = "run"
    _check_run_binding(manifest, key, expectation)
    # What the manifest claims about where the KV comes from, before its shape: a handoff from
    # another identity, cache or mode is named as such, not as the shape difference it implies.
    stage.check = "identity"
    _check_expectations(manifest, expectation)
    stage.check = "geometry"
    _check_geometries(manifest, expectation)
    manifest_done = time.perf_counter()

    stage.check = "payload.bytes"
    try:
        payload = memoryview(handoff.payload_bytes).cast("B")
    except (TypeError, ValueError):
        raise HandoffRefused("handoff payload: not a contiguous byte buffer", check="payload.bytes") from None
    expected_size = expectation.expected_payload_bytes
    if manifest.payload_size != expected_size:
        raise HandoffRefused(
            f"payload.bytes is {manifest.payload_size}, expected {expected_size} for the expected geometry",
            check="payload.bytes",
        )
    if payload.nbytes != manifest.payload_size:
        raise HandoffRefused(
            f"handoff payload: {payload.nbytes} bytes, manifest payload.bytes says {manifest.payload_size}",
            check="payload.bytes",
        )
    # The tree digest: each tensor hashed once (over the digest threads), then prefix and leaves.
    stage.check = "payload.header"
    located = _locate_tensors(payload)
    stage.check = "payload.tree_sha256"
    leaves = _tensor_digests([payload[tensor.begin : tensor.end] for tensor in located.tensors],
                             digest_threads)
    tree_sha256 = payload_tree_sha256(payload[: located.data_start], leaves)
    digest_done = time.perf_counter()

    if not hmac.compare_digest(tree_sha256, manifest.payload_tree_sha256):
        raise HandoffRefused(
            f"handoff payload tree digest mismatch: found {_short(tree_sha256)}, manifest "
            f"payload.tree_sha256 says {_short(manifest.payload_tree_sha256)}"
            + _first_changed_seam(located, leaves, manifest),
            check="payload.tree_sha256",
        )
    stage.check = "payload.layout"
    layout = _check_payload_layout(payload, located, manifest)
    stage.check = "seam"
    leaf_by_name = {tensor.name: leaves[index] for index, tensor in enumerate(located.tensors)}
    for seam in manifest.seams:
        for part, claimed in (("k", seam.k_sha256), ("v", seam.v_sha256)):
            if not hmac.compare_digest(leaf_by_name[f"layers.{seam.layer}.{part}"].hex(), claimed):
                raise HandoffRefused(f"seam digest mismatch at layer {seam.layer} {part.upper()}", check="seam")
    stage.check = "draft_context"
    if manifest.draft_geometry is not None and manifest.draft_context_sha256 is not None:
        draft_names = _wire_names(manifest.draft_geometry.layers, DRAFT_PREFIX)
        found_context = draft_context_sha256([leaf_by_name[name] for name in draft_names])
        if not hmac.compare_digest(found_context, manifest.draft_context_sha256):
            raise HandoffRefused("draft context digest mismatch", check="draft_context")

    checks_done = time.perf_counter()

    stage.check = "install"
    named: dict[str, np.ndarray] = {}
    for slot in _slots(manifest.geometry, manifest.draft_geometry):
        begin, end = layout.offsets[slot.name]
        count = (end - begin) // np.dtype(slot.dtype).itemsize
        array = np.frombuffer(payload, dtype=np.dtype(slot.dtype).newbyteorder("<"), count=count,
                              offset=begin)
        named[slot.name] = array.reshape(slot.shape)
    kv = KVCache.from_tensors(named)
    installed = time.perf_counter()
    timings = VerifyTimings(
        mac_s=mac_done - started,
        manifest_s=manifest_done - mac_done,
        digest_s=digest_done - manifest_done,
        checks_s=checks_done - digest_done,
        install_s=installed - checks_done,
    )
    return OpenedHandoff(kv, manifest, timings)


def _check_run_binding(manifest: HandoffManifest, key: bytes, expected: HandoffExpectation) -> None:
    """The manifest is this run's: its run id, its lane, and the key the MAC verified under."""
    if manifest.run_id != expected.run_id:
        raise HandoffRefused(f"run_id is {manifest.run_id!r}, expected {expected.run_id!r}",
                             check="manifest.run_id")
    if manifest.lane != expected.lane:
        raise HandoffRefused(f"lane is {manifest.lane!r}, expected {expected.lane!r}", check="manifest.lane")
    run_key_id = handoff_key_id(key)
    if manifest.key_id != run_key_id:
        raise HandoffRefused(
            f"key_id is {manifest.key_id!r}, expected {run_key_id!r} (the run key the MAC verified under)",
            check="manifest.key_id",
        )


def _check_geometries(manifest: HandoffManifest, expected: HandoffExpectation) -> None:
    """Geometry and draft geometry: each must equal the consumer's (the handed-off positions
    equal the geometry's positions, which the manifest's own check has refused otherwise)."""
    _check_geometry("geometry", manifest.geometry, expected.geometry)
    if (manifest.draft_geometry is None) != (expected.draft_geometry is None):
        found = "present" if manifest.draft_geometry is not None else "absent"
        wanted = "one" if expected.draft_geometry is not None else "none"
        raise HandoffRefused(f"draft_geometry: draft context {found}, consumer expects {wanted}",
                             check="draft_geometry")
    if manifest.draft_geometry is not None and expected.draft_geometry is not None:
        _check_geometry("draft_geometry", manifest.draft_geometry, expected.draft_geometry)


def _check_expectations(manifest: HandoffManifest, expected: HandoffExpectation) -> None:
    """Identity, cache identity, producer mode, prompt and request id: each the consumer's."""
    if manifest.identity_sha256 != expected.identity_sha256:
        raise HandoffRefused(
            f"identity_sha256 is {_short(manifest.identity_sha256)}, expected "
            f"{_short(expected.identity_sha256)}",
            check="identity",
        )
    if manifest.target_cache_identity_sha256 != expected.cache_identity:
        raise HandoffRefused(
            f"target_cache_identity_sha256 is {_short(manifest.target_cache_identity_sha256)} "
            f"(producer mode {manifest.producer_mode.value}), expected {_short(expected.cache_identity)}",
            check="cache_identity",
        )
    expected_mode = ProducerMode(expected.producer_mode)
    if manifest.producer_mode is not expected_mode:
        raise HandoffRefused(
            f"producer_mode is {manifest.producer_mode.value!r}, expected {expected_mode.value!r}",
            check="producer_mode",
        )
    if manifest.prompt_sha256 != expected.prompt_sha256:
        raise HandoffRefused(
            f"prompt_sha256 is {_short(manifest.prompt_sha256)}, expected "
            f"{_short(expected.prompt_sha256)}",
            check="prompt",
        )
    if manifest.request_id != expected.request_id:
        raise HandoffRefused(
            f"request_id is {manifest.request_id!r}, expected {expected.request_id!r}",
            check="request_id",
        )


def _check_geometry(what: str, found: KVGeometry, expected: KVGeometry) -> None:
    for name in ("layers", "kv_heads", "head_dim", "dtype"):
        if getattr(found, name) != getattr(expected, name):
            raise HandoffRefused(
                f"{what} {name}: handoff has {getattr(found, name)}, consumer model has "
                f"{getattr(expected, name)}",
                check=what,
            )
    if found.positions != expected.positions:
        raise HandoffRefused(
            f"{what} positions: handoff has {found.positions}, expected {expected.positions} "
            f"handed-off positions",
            check=what,
        )

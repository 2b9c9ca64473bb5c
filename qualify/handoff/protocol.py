"""What the producer process and the harness share: frames, client auth, the start expectation.

Both sides of the socket import this module; neither imports the other. Every frame is a 4-byte
big-endian length, a canonical-JSON header, then the raw blobs the header's ``blobs`` list
sizes. On connect the producer sends ``hello`` with a nonce; the client answers ``auth`` with the
run id its handoffs must be sealed under and HMAC-SHA256(run key, :data:`CLIENT_AUTH_CONTEXT` ||
nonce || run id) (:func:`client_auth_mac`); then
``ready?``, ``prefill {tokens, request_id}`` (answered by ``handoff`` with blobs manifest, MAC,
payload) and ``shutdown``. While a request (or the start-up, on the ready channel) is in progress the producer
sends a ``progress`` heartbeat every :data:`HEARTBEAT_S`, so a consumer can tell a producer that
computes from one that is stopped (:class:`PhaseDeadlines`).

:class:`ProducerExpectation` is what the harness expects the producer's engine to be (written as
the ``--expect`` document, checked by the producer once at start); :func:`handed_off_positions`
is how many of a prompt's positions a lane's producer hands off, for producer and transports alike.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from qualify.contract.lanes import LANES
from qualify.core.arguments import require_private_file
from qualify.core.digests import canonical_json_bytes, is_sha256_hex
from qualify.core.errors import Refused
from qualify.core.strict_json import parse_untrusted_json
from qualify.engines.base import ModelGeometry
from qualify.handoff.wire import KV_DTYPES

if TYPE_CHECKING:
    from qualify.contract.identity import Identity

PROTOCOL = "trust-ladder.handoff-protocol.v2"
EXIT_OK = 0
EXIT_REFUSED = 2
EXIT_TEMPFAIL = 75
DEFAULT_WATCHDOG_S = 900.0
DEFAULT_WARMUP_TOKENS = 16
KEY_ENV = "QUALIFY_HANDOFF_KEY"
PRODUCER_MODULE = "qualify.interfaces.producer_command"
"""What the harness runs as ``python -m`` to start a producer process (``qualify producer serve``)."""
CLIENT_AUTH_CONTEXT = b"trust-ladder.handoff.client-auth.v2\x00"
MAX_HEADER_BYTES = 1 << 20
FRAME_LENGTH = struct.Struct(">I")
SOCKET_BUFFER_BYTES = 4 << 20
ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
# Deepest nesting a frame header may have (a header is at most 3 levels deep: host facts).
MAX_HEADER_DEPTH = 8
# How often a busy producer says it is still working (a ``progress`` frame or ready-channel line).
HEARTBEAT_S = 0.5
# The ready channel's heartbeat line (without its newline); the last line is the ready line.
READY_PROGRESS_LINE = canonical_json_bytes({"event": "progress"})

# A decoded frame header: a JSON object (its fields are checked where they are read).
FrameHeader = dict[str, Any]


# --------------------------------------------------------------------------------------------
# frames and client authentication


def encode_frame_header(header: Mapping[str, Any]) -> bytes:
    """Length prefix plus canonical JSON header; the blobs listed in ``header['blobs']`` follow."""
    body = canonical_json_bytes(dict(header))
    if len(body) > MAX_HEADER_BYTES:
        raise Refused(f"frame header: {len(body)} bytes, limit {MAX_HEADER_BYTES}")
    return FRAME_LENGTH.pack(len(body)) + body


def decode_frame_header(body: bytes) -> FrameHeader:
    """Parse one frame header (bounded size and nesting, strict JSON); anything but a JSON object
    with a string ``op`` is refused."""
    header = parse_untrusted_json(body, "frame header", max_bytes=MAX_HEADER_BYTES,
                                  max_depth=MAX_HEADER_DEPTH)
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise Refused("frame header: expected a JSON object with a string 'op'")
    return header


def client_auth_mac(key: bytes, nonce: bytes, run_id: str) -> bytes:
    """What a client proves it holds the run key with, for this connection (the producer's fresh
    nonce) and the run it names (the run id every handoff on the connection is then sealed under,
    so a handoff of another run never verifies in this one); domain-separated from manifest MACs."""
    return hmac.new(key, CLIENT_AUTH_CONTEXT + nonce + run_id.encode("ascii"), hashlib.sha256).digest()


def read_run_key(source: tuple[str, str]) -> bytes:
    """Read the hex run key from a descriptor, file (a regular file only its owner can read) or
    environment variable (then forget it): ``("fd"|"file"|"env", value)``. The producer's
    ``--key-fd/--key-file/--key-env`` and the consumer's ``--key-file/--key-env`` (``--producer-at``)."""
    kind, value = source
    try:
        if kind == "fd":
            with os.fdopen(int(value), "rb", closefd=True) as stream:
                text = stream.read(4096)
        elif kind == "file":
            require_private_file(f"run key file {value}", Path(value), "no such file")
            text = Path(value).read_bytes()[:4096]
        elif kind == "env":
            text = os.environ.pop(value, "").encode()
        else:
            raise StartRefused(f"run key: found source {kind!r}, expected fd, file or env")
    except (OSError, ValueError) as exc:
        raise StartRefused(f"run key: cannot read from {kind} ({type(exc).__name__})") from None
    except Refused as exc:
        raise StartRefused(str(exc)) from None
    try:
        key = bytes.fromhex(text.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise StartRefused(f"run key from {kind}: not hex text") from None
    if len(key) < 32:
        raise StartRefused(f"run key from {kind}: {len(key)} bytes, expected at least 32")
    return key


# --------------------------------------------------------------------------------------------
# consumer-side deadlines


def seconds_or_none(value: object) -> float | None:
    """A non-negative finite number of seconds from a producer's frame or record, else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf"):
        return float(value)
    return None


@dataclass(frozen=True)
class PhaseDeadlines:
    """How long the consumer waits for a producer, per phase, in seconds; past one, the run fails
    and the producer's process group is killed.

    ``ready``: start to ready line (engine build and warm-up prefill). ``verify``: connect,
    authenticate and the ``ready?`` answer (the consumer verifying whom it talks to).
    ``handoff``: a prefill request to its last payload byte. ``silence``: the longest the
    producer may send nothing at all (no heartbeat, no byte) in any phase: a stopped producer is
    caught here, however long its compute is allowed to take.
    """

    ready_s: float
    verify_s: float
    handoff_s: float
    silence_s: float

    def __post_init__(self) -> None:
        for name in ("ready_s", "verify_s", "handoff_s", "silence_s"):
            value = getattr(self, name)
            if type(value) not in (int, float) or not 0 < value < float("inf"):
                raise Refused(f"deadline {name}: found {value!r}, expected a positive finite number of seconds")

    def overridden(self, deadline_s: float | None) -> PhaseDeadlines:
        """Every phase limited to ``deadline_s`` (an operator's ``--deadline-s``), or unchanged."""
        if deadline_s is None:
            return self
        return PhaseDeadlines(ready_s=deadline_s, verify_s=deadline_s, handoff_s=deadline_s,
                              silence_s=min(self.silence_s, deadline_s))

    def describe(self) -> str:
        return (f"ready {self.ready_s:.1f} s, verify {self.verify_s:.1f} s, handoff {self.handoff_s:.1f} s, "
                f"silence {self.silence_s:.1f} s")


# A silence of at least this long is recorded as a stall the producer recovered from (four
# missed heartbeats: a scheduler hiccup is shorter).
STALL_NOTE_S = 4 * HEARTBEAT_S
# Floors and factors of the deadlines a run derives from its basis receipt
# (qualify.run.run_contract.phase_deadlines); DEFAULT_DEADLINES when there is none (calibration).
READY_FLOOR_S = 120.0
VERIFY_FLOOR_S = 30.0
HANDOFF_FLOOR_S = 60.0
CALIBRATED_FACTOR = 10.0
SILENCE_S = 15.0
DEFAULT_DEADLINES = PhaseDeadlines(ready_s=600.0, verify_s=VERIFY_FLOOR_S, handoff_s=900.0,
                                   silence_s=SILENCE_S)


# --------------------------------------------------------------------------------------------
# handed-off positions


def handed_off_positions(lane: str, prompt_positions: int) -> int:
    """How many of ``prompt_positions`` prefilled positions ``lane``'s producer hands off.

    A lane of the table follows its :meth:`~qualify.contract.lanes.LaneSpec.handed_off_positions`
    (whole blocks where vLLM is on either side). A lane outside the table (a test or bench lane,
    served by its own ``--engine-factory``) hands off every position; an engine that hands off
    fewer is refused by the producer's geometry check, never trimmed silently.
    """
    spec = LANES.get(lane)
    return prompt_positions if spec is None else spec.handed_off_positions(prompt_positions)


# --------------------------------------------------------------------------------------------
# start-time expectations


class StartRefused(Refused):
    """The producer refuses to start (exit 2): bad arguments, key, engine or expectation."""


_GEOMETRY_INTS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab", "max_positions")
_EXPECTATION_FIELDS = frozenset({"engine_version", "engine_name", "engine_abi", "engine_kat_sha256",
                                 "identity_sha256", "kv_dtype", "digests", "geometry"})


@dataclass(frozen=True)
class ProducerExpectation:
    """What the harness expects the producer's engine to be; checked once, at start.

    ``digests`` (checkpoint file -> SHA-256), ``engine_name``, ``engine_abi`` and
    ``engine_kat_sha256`` (the engine's known-answer digest, ``qualify.engines.kat``) are checked
    when given. ``identity_sha256`` is the frozen identity the run is under; it goes into every
    manifest. The target cache identity is *not* here: the engine declares its own (derived from
    the mode it was built in), so a producer in the wrong mode cannot echo the expected one.
    """

    engine_version: str
    geometry: ModelGeometry
    identity_sha256: str
    engine_name: str | None = None
    engine_abi: str | None = None
    digests: Mapping[str, str] | None = None
    kv_dtype: str = "float32"
    engine_kat_sha256: str | None = None

    def to_document(self) -> dict[str, Any]:
        """The JSON document ``--expect`` reads."""
        geometry = self.geometry
        return {
            "engine_version": self.engine_version,
            "engine_name": self.engine_name,
            "engine_abi": self.engine_abi,
            "engine_kat_sha256": self.engine_kat_sha256,
            "identity_sha256": self.identity_sha256,
            "kv_dtype": self.kv_dtype,
            "digests": None if self.digests is None else dict(self.digests),
            "geometry": {
                **{name: getattr(geometry, name) for name in _GEOMETRY_INTS},
                "rope_theta": geometry.rope_theta,
            },
        }

    @classmethod
    def from_document(cls, document: object) -> ProducerExpectation:
        """Read an ``--expect`` document; any missing, extra or mistyped field is refused."""
        if not isinstance(document, dict) or set(document) != _EXPECTATION_FIELDS:
            found = sorted(document) if isinstance(document, dict) else type(document).__name__
            raise StartRefused(f"--expect: fields {found}, expected exactly {sorted(_EXPECTATION_FIELDS)}")
        if not isinstance(document["engine_version"], str) or not document["engine_version"]:
            raise StartRefused("--expect: engine_version must be a non-empty string")
        for name in ("engine_name", "engine_abi"):
            if document[name] is not None and not isinstance(document[name], str):
                raise StartRefused(f"--expect: {name} must be a string or null")
        if not is_sha256_hex(document["identity_sha256"]):
            raise StartRefused("--expect: identity_sha256 must be 64 lowercase hex characters")
        if document["engine_kat_sha256"] is not None and not is_sha256_hex(document["engine_kat_sha256"]):
            raise StartRefused("--expect: engine_kat_sha256 must be 64 lowercase hex characters or null")
        if document["kv_dtype"] not in KV_DTYPES:
            raise StartRefused(f"--expect: kv_dtype {document['kv_dtype']!r} is not a KV dtype")
        digests = document["digests"]
        if digests is not None and (
            not isinstance(digests, dict)
            or not all(isinstance(k, str) and is_sha256_hex(v) for k, v in digests.items())
        ):
            raise StartRefused("--expect: digests must map file names to SHA-256 hex, or be null")
        geometry = document["geometry"]
        if not isinstance(geometry, dict) or set(geometry) != {*_GEOMETRY_INTS, "rope_theta"}:
            raise StartRefused(f"--expect: geometry fields must be exactly {[*_GEOMETRY_INTS, 'rope_theta']}")
        for name in _GEOMETRY_INTS:
            if type(geometry[name]) is not int or geometry[name] < 1:
                raise StartRefused(f"--expect: geometry.{name} must be a positive integer")
        theta = geometry["rope_theta"]
        if type(theta) not in (int, float) or not np.isfinite(theta) or theta <= 0:
            raise StartRefused("--expect: geometry.rope_theta must be a positive finite number")
        return cls(
            engine_version=document["engine_version"],
            geometry=ModelGeometry(**{name: geometry[name] for name in _GEOMETRY_INTS},
                                   rope_theta=float(theta)),
            identity_sha256=document["identity_sha256"],
            engine_name=document["engine_name"],
            engine_abi=document["engine_abi"],
            engine_kat_sha256=document["engine_kat_sha256"],
            digests=None if digests is None else dict(digests),
            kv_dtype=document["kv_dtype"],
        )


def expectation_from_identity(identity: Identity, model_geometry: ModelGeometry) -> ProducerExpectation:
    """Build the start expectation from a loaded ``qualify.contract.identity.Identity``.

    The identity pins the producer engine (name, version, ABI), the checkpoint file digests,
    the context length and the RoPE base; the rest of the model geometry comes from the model's
    config (``model_geometry``), which must agree with the identity on those two numbers.
    """
    # Imported here: the identity module loads pydantic and the sealed constants, which the
    # producer process (it reads only the --expect document) never needs.
    from qualify.contract.identity import identity_sha256
    from qualify.engines.factory import lane_kv_dtype

    if model_geometry.max_positions != identity.context_policy.max_positions:
        raise Refused(
            f"identity context_policy.max_positions {identity.context_policy.max_positions} "
            f"disagrees with the model's max_positions {model_geometry.max_positions}"
        )
    if model_geometry.rope_theta != identity.rope.theta:
        raise Refused(
            f"identity rope.theta {identity.rope.theta} disagrees with the model's rope_theta "
            f"{model_geometry.rope_theta}"
        )
    engine = identity.producer_engine
    return ProducerExpectation(
        engine_version=engine.version,
        geometry=model_geometry,
        identity_sha256=identity_sha256(identity),
        engine_name=engine.name,
        engine_abi=engine.abi,
        engine_kat_sha256=engine.kat_sha256,
        digests=dict(identity.checkpoint.files),
        kv_dtype=lane_kv_dtype(identity.spec),
    )

"""How the consumer gets a sealed handoff from a producer: the :class:`Transport` edge.

A transport has one request-sized method (as httpx's transports have ``handle_request``):
``request_prefill(prompt, request_id)`` returns a :class:`~qualify.handoff.wire.Handoff` for
:func:`~qualify.handoff.wire.open_handoff`, with :class:`~qualify.handoff.wire.TransportStats`.
Two implement it:

* :class:`qualify.handoff.client.ProducerProcess`: the producer service in its own process, over
  its Unix (or loopback TCP) socket;
* :class:`qualify.handoff.client.RemoteProducer`: a producer service an operator already runs,
  perhaps on another host, over TCP under mutual TLS (``--producer-at``; ``docs/transport.md``);
* :class:`InProcessTransport`: a producer in the consumer's own process. It seals with
  :func:`~qualify.handoff.wire.seal_handoff_parts` under the run key (the service's manifest and
  MAC path), so its handoffs are opened and refused exactly like a socket handoff. A producer that
  writes its KV straight into a caller-owned payload buffer laid out by
  :func:`~qualify.handoff.wire.payload_layout` (a pinned host buffer a GPU copies into) is sealed
  and opened in place, with no copy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

import numpy as np

from qualify.contract.lanes import ProducerMode
from qualify.core.assets import prompt_sha256
from qualify.core.digests import is_sha256_hex
from qualify.core.errors import ProducerFailed, Refused, one_line
from qualify.core.hostenv import host_facts
from qualify.core.kv import KVCache
from qualify.handoff.protocol import ID_PATTERN, handed_off_positions
from qualify.handoff.wire import (
    DEFAULT_DIGEST_THREADS,
    Handoff,
    SealedHandoff,
    TransportStats,
    handoff_key_id,
    seal_handoff_parts,
)

if TYPE_CHECKING:
    from qualify.handoff.client import ProducerProcess, RemoteProducer


class Transport(Protocol):
    """A producer the consumer asks for sealed handoffs; started once, closed once."""

    @property
    def host_facts(self) -> dict[str, object] | None:
        """What the producer runs on (the receipt's host.json), once started; None if unknown."""
        ...

    @property
    def host_facts_problem(self) -> str | None:
        """Why :attr:`host_facts` is None (None when they are known)."""
        ...

    @property
    def ready_silence_s(self) -> float:
        """The longest the producer was silent while starting (a stall it recovered from when at
        least protocol.STALL_NOTE_S); 0 in process."""
        ...

    def start(self) -> None:
        """Make the producer ready to serve (a warm producer, an authenticated connection)."""
        ...

    def request_prefill(self, prompt: np.ndarray, request_id: str) -> Handoff:
        """The sealed, not yet verified, handoff of ``prompt``'s KV; raises ``ProducerFailed``."""
        ...

    def close(self) -> None:
        """Stop the producer; a closed transport serves no further request."""
        ...


@dataclass(frozen=True)
class ProducedKV:
    """One in-process prefill: the KV to hand off and how it was made.

    ``payload``, when given, is the caller-owned uint8 buffer of
    ``payload_layout(kv.geometry).size`` bytes that holds the payload: the layout's header prefix,
    then ``kv``'s tensors, which are views of it at the layout's offsets; the handoff is sealed and
    opened in place. ``compute_s`` is the prefill's time; ``transfer_s`` the producer's own copy
    of the KV into ``payload`` (e.g. device to pinned host), 0 when it made none.
    """

    kv: KVCache
    payload: np.ndarray | None
    compute_s: float
    transfer_s: float = 0.0


class InProcessProducer(Protocol):
    """A producer that runs in the consumer's process."""

    def produce(self, prompt: np.ndarray, request_id: str) -> ProducedKV:
        """The KV of ``prompt``'s handed-off positions."""
        ...


class Prefiller(Protocol):
    """Any engine with a host prefill (``qualify.engines.base.Engine`` and the factory's engines)."""

    def prefill(self, tokens: np.ndarray) -> KVCache: ...


class PrefillProducer:
    """An :class:`InProcessProducer` of an engine's ``prefill`` (host numpy KV, sealed from its
    own arrays and joined into one payload buffer by the transport)."""

    def __init__(self, engine: Prefiller) -> None:
        self.engine = engine

    def produce(self, prompt: np.ndarray, request_id: str) -> ProducedKV:
        started = time.perf_counter()
        kv = self.engine.prefill(prompt)
        return ProducedKV(kv, None, time.perf_counter() - started)


class InProcessTransport:
    """A :class:`Transport` whose producer runs in this process; see the module docstring.

    ``lane`` is the lane the manifests name; it fixes how many of a prompt's positions the
    producer must hand off (:func:`qualify.handoff.protocol.handed_off_positions`). A producer
    that raises, hands off another count, or lays out ``payload`` otherwise than it says fails
    as a producer process would: ``ProducerFailed``, and every later request fails too.
    """

    def __init__(
        self,
        producer: InProcessProducer,
        *,
        key: bytes,
        identity_sha256: str,
        cache_identity: str,
        mode: ProducerMode,
        lane: str,
        run_id: str,
        digest_threads: int = DEFAULT_DIGEST_THREADS,
    ) -> None:
        handoff_key_id(key)  # refuses a key that is not bytes of at least 32
        for name, digest in (("identity_sha256", identity_sha256), ("cache_identity", cache_identity)):
            if not is_sha256_hex(digest):
                raise Refused(f"in-process transport {name}: found {digest!r}, expected 64 lowercase hex characters")
        try:
            self.mode = ProducerMode(mode)  # the enum, or (from an untyped caller) its value
        except ValueError:
            raise Refused(f"in-process transport mode: found {mode!r}, expected exact or native") from None
        if not isinstance(run_id, str) or not ID_PATTERN.fullmatch(run_id):
            raise Refused(f"in-process transport run_id: found {run_id!r}, expected [A-Za-z0-9._:-], 1-128")
        self.producer = producer
        self.lane = lane
        self.run_id = run_id
        self.identity_sha256 = identity_sha256
        self.cache_identity = cache_identity
        self.digest_threads = digest_threads
        self._key = bytes(key)
        self._host_facts: dict[str, object] | None = None
        self._host_facts_problem: str | None = "the in-process producer has not started"
        self._started = False
        self._closed = False
        self._failure: ProducerFailed | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def host_facts(self) -> dict[str, object] | None:
        return self._host_facts

    @property
    def host_facts_problem(self) -> str | None:
        return self._host_facts_problem

    @property
    def ready_silence_s(self) -> float:
        return 0.0  # the same process: it cannot be stopped while the consumer waits

    def start(self) -> None:
        """Record this process's host facts (the producer runs here); the producer warms itself."""
        if self._started:
            raise Refused("in-process transport: already started")
        self._host_facts, self._host_facts_problem = host_facts(), None
        self._started = True

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> InProcessTransport:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- requests ------------------------------------------------------------------------------

    def request_prefill(self, prompt: np.ndarray, request_id: str) -> Handoff:
        """Produce, check and seal the KV of ``prompt``; the handoff is not yet verified."""
        if self._failure is not None:
            raise self._failure
        if not self._started or self._closed:
            raise ProducerFailed(f"in-process producer {self.lane}: {'closed' if self._closed else 'not started'}")
        tokens = np.asarray(prompt)
        if tokens.ndim != 1 or tokens.size == 0 or tokens.dtype.kind not in "iu":
            raise Refused(f"prefill tokens: found {tokens.dtype} {list(tokens.shape)}, "
                          f"expected a non-empty 1-D array of integer token ids")
        if not isinstance(request_id, str) or not ID_PATTERN.fullmatch(request_id):
            raise Refused(f"request_id: found {request_id!r}, expected [A-Za-z0-9._:-], 1-128")
        started = time.perf_counter()
        try:
            produced = self.producer.produce(tokens, request_id)
            sealed, seal_s = self._seal(tokens, request_id, produced)
            payload, copy_s = self._payload(sealed, produced)
        except Exception as exc:
            self._failure = ProducerFailed(one_line(
                f"in-process producer {self.lane}: prefill {request_id} failed: {type(exc).__name__}: {exc}"))
            raise self._failure from exc
        transfer_s = produced.transfer_s + copy_s
        stats = TransportStats(
            request_s=time.perf_counter() - started,
            transfer_s=transfer_s,
            payload_bytes=sealed.payload_size,
            # Nothing crossed at a measurable rate when the producer wrote the payload in place.
            gbit_per_s=sealed.payload_size * 8 / transfer_s / 1e9 if transfer_s > 0 else 0.0,
            producer_compute_s=produced.compute_s,
            producer_seal_s=seal_s,
        )
        return Handoff(sealed.manifest_bytes, sealed.mac, payload, transport=stats)

    def _seal(self, tokens: np.ndarray, request_id: str, produced: ProducedKV) -> tuple[SealedHandoff, float]:
        """Check the produced KV hands off the lane's positions, then seal it (the service's path);
        returns the sealed handoff and the seconds sealing took."""
        if not isinstance(produced, ProducedKV):
            raise Refused(f"produce returned {type(produced).__name__}, expected ProducedKV")
        for name, seconds in (("compute_s", produced.compute_s), ("transfer_s", produced.transfer_s)):
            if not (isinstance(seconds, (int, float)) and 0 <= seconds < float("inf")):
                raise Refused(f"produced {name}: found {seconds!r}, expected a finite number >= 0")
        positions = handed_off_positions(self.lane, len(tokens))
        found = produced.kv.geometry.positions
        if found != positions:
            raise Refused(f"produced {found} positions of a {len(tokens)}-token prompt, the lane hands off {positions}")
        started = time.perf_counter()
        sealed = seal_handoff_parts(
            produced.kv,
            key=self._key,
            identity_sha256=self.identity_sha256,
            target_cache_identity=self.cache_identity,
            producer_mode=self.mode,
            lane=self.lane,
            # The manifest names the tokens whose KV it carries (whole blocks for vLLM).
            prompt_sha256=prompt_sha256(tokens[:positions]),
            run_id=self.run_id,
            request_id=request_id,
            compute_s=float(produced.compute_s),
            digest_threads=self.digest_threads,
        )
        return sealed, time.perf_counter() - started

    @staticmethod
    def _payload(sealed: SealedHandoff, produced: ProducedKV) -> tuple[memoryview, float]:
        """The contiguous payload and the seconds spent copying into it (0 when in place)."""
        if produced.payload is None:
            started = time.perf_counter()
            buffer = np.empty(sealed.payload_size, dtype=np.uint8)  # writable, like a received payload
            cursor = 0
            for part in sealed.payload_parts:
                buffer[cursor:cursor + part.nbytes] = np.frombuffer(part, dtype=np.uint8)
                cursor += part.nbytes
            return buffer.data, time.perf_counter() - started
        return _in_place_payload(sealed, produced.payload), 0.0


def _in_place_payload(sealed: SealedHandoff, payload: np.ndarray) -> memoryview:
    """``payload`` as the sealed payload, refused unless it holds the sealed header and its tensor
    parts are ``payload``'s own bytes at the layout offsets (what was hashed is what is sent)."""
    if not (isinstance(payload, np.ndarray) and payload.dtype == np.uint8 and payload.ndim == 1
            and payload.flags.c_contiguous):
        raise Refused("produced payload: expected a 1-D C-contiguous uint8 array laid out by payload_layout")
    if payload.nbytes != sealed.payload_size:
        raise Refused(f"produced payload: {payload.nbytes} bytes, the sealed payload has {sealed.payload_size}")
    prefix, *tensors = sealed.payload_parts
    if payload[:prefix.nbytes].tobytes() != prefix.tobytes():
        raise Refused("produced payload: its header is not payload_layout's for the produced KV geometry")
    base = payload.ctypes.data
    offset = prefix.nbytes
    for index, part in enumerate(tensors):
        if np.frombuffer(part, dtype=np.uint8).ctypes.data != base + offset:
            raise Refused(f"produced payload: tensor {index} in layout order is not a view of the payload at byte "
                          f"{offset} (the KV must be written into the buffer payload_layout describes)")
        offset += part.nbytes
    return payload.data


if TYPE_CHECKING:
    # Each implements the edge (checked by the type checker, not at run time).
    _PRODUCER_PROCESS_IS_A_TRANSPORT: type[Transport] = ProducerProcess
    _IN_PROCESS_IS_A_TRANSPORT: type[Transport] = InProcessTransport
    _REMOTE_PRODUCER_IS_A_TRANSPORT: type[Transport] = RemoteProducer

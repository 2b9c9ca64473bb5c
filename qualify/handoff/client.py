"""The harness side of the handoff: start the producer process, wait for it, request handoffs.

:class:`ProducerProcess` is the socket :class:`~qualify.handoff.transport.Transport`; it speaks
:mod:`qualify.handoff.protocol` and never imports the producer's own module.

:class:`ProducerProcess` runs ``python -m qualify.interfaces.producer_command`` (``qualify producer
serve``, :data:`~qualify.handoff.protocol.PRODUCER_MODULE`) in its own process group,
hands it the run key through an inherited pipe (never argv, never the environment), waits for its
ready line (written only after a warm-up prefill), authenticates on the socket, and requests
handoffs. It connects only to what it created (the Unix socket path it chose) or what the
operator gave (a TCP host and port), never to an address the producer announces.

:class:`RemoteProducer` is the transport of a producer an operator already runs, perhaps on
another host (``--producer-at HOST:PORT``): TCP under mutual TLS 1.3 (plain TCP on loopback only),
the same handshake and requests over :class:`ProducerConnection`, the same deadlines.

The producer's own session keeps a signal sent to the harness's process group (a terminal's, a CI
cancel's) from reaching it mid-write: the harness stops it (:meth:`ProducerProcess.kill`, then
:meth:`~ProducerProcess.close`, which also removes its temporary directory). Should the harness die
without doing so (SIGKILL), the producer dies with it: by the kernel's parent-death signal
(``--parent-pid``, Linux) and by the end of its stdin (``--exit-with-stdin``).

Every wait is bounded by the consumer's own :class:`~qualify.handoff.protocol.PhaseDeadlines`
(ready, verify, handoff, and the longest silence allowed: the producer sends a heartbeat every
half second while it works) and watches the process, so a producer that dies (SIGKILL, exit 75,
closed socket), stops (SIGSTOP) or stalls becomes a :class:`ProducerFailure` carrying its last
message and exit status, and its process group is killed, within the deadline. A silence it
recovered from is kept: :attr:`ProducerProcess.ready_silence_s` and
``TransportStats.longest_silence_s``.

Everything the producer sends (ready line, frame headers, blob sizes) is parsed here, behind one
boundary: anything malformed or unexpected becomes a :class:`ProducerFailure` naming the field,
never a raw exception.

The producer's ``ready`` answer carries its host facts (``qualify.core.hostenv.host_facts``);
:attr:`ProducerProcess.host_facts` holds them once checked, or None with
:attr:`ProducerProcess.host_facts_problem` saying why. They are informational: a producer whose
facts are missing or malformed still serves, and the receipt records them as missing.
"""

from __future__ import annotations

import collections
import ipaddress
import json
import mmap
import os
import secrets
import select
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, NoReturn

import numpy as np

from qualify.contract.lanes import ProducerMode
from qualify.core import model_choice
from qualify.core.assets import PACKAGE_PARENT
from qualify.core.errors import ProducerFailed, Refused, one_line
from qualify.core.hostenv import host_facts_problem
from qualify.core.strict_json import parse_untrusted_json
from qualify.handoff.protocol import (
    DEFAULT_DEADLINES,
    DEFAULT_WARMUP_TOKENS,
    DEFAULT_WATCHDOG_S,
    EXIT_REFUSED,
    FRAME_LENGTH,
    ID_PATTERN,
    KEY_ENV,
    MAX_HEADER_BYTES,
    PRODUCER_MODULE,
    PROTOCOL,
    READY_PROGRESS_LINE,
    SOCKET_BUFFER_BYTES,
    FrameHeader,
    PhaseDeadlines,
    ProducerExpectation,
    client_auth_mac,
    decode_frame_header,
    encode_frame_header,
    seconds_or_none,
)
from qualify.handoff.tls import peer_certificate_sha256
from qualify.handoff.wire import MAC_BYTES, Handoff, TransportKind, TransportStats, handoff_key_id

# How often a blocked wait wakes to check the process and its deadline.
POLL_S = 0.2
# After the producer reports a fatal error or the socket closes, how long it has to exit.
EXIT_GRACE_S = 5.0
# A handoff larger than this is refused before any memory is allocated for it (when the run
# does not give the exact size its expected geometry implies).
DEFAULT_MAX_PAYLOAD_BYTES = 16 << 30
MAX_MANIFEST_BYTES = 16 << 20
# The ready channel carries heartbeat lines and one ready line; a longer line is not ours.
MAX_READY_LINE_BYTES = 64 << 10
_READY_FIELDS = frozenset({"event", "protocol", "pid", "address", "lane", "producer_mode", "key_id",
                           "warmup_s"})
OUTPUT_TAIL_LINES = 40
# Payloads at least this large are received into huge-page-advised anonymous memory.
HUGE_PAGE_MIN_BYTES = 4 << 20
WORKDIR_PREFIX = "trust-ladder-producer-"
"""The producer's private temporary directory (socket, expectation file), under ``$TMPDIR``."""


def receive_buffer(size: int) -> memoryview:
    """A writable buffer for a payload: large ones are anonymous memory advised for huge pages.

    Faulting in 4 KiB pages one by one costs about as much as a SHA-256 pass over the same bytes
    on a virtual machine; transparent huge pages cut that to a small fraction.
    """
    if size < HUGE_PAGE_MIN_BYTES:
        return memoryview(bytearray(size))
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass  # no transparent huge pages here: plain pages still work
    return memoryview(region)


# The socket phases a read belongs to (the ready phase is read from the ready channel).
_Phase = Literal["verify", "handoff"]


class _Silence:
    """When the producer last showed life (a byte, a heartbeat), and the longest gap so far."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.longest_s = 0.0

    def heard(self) -> None:
        now = time.monotonic()
        self.longest_s = max(self.longest_s, now - self.last)
        self.last = now

    def current_s(self) -> float:
        return time.monotonic() - self.last


class ProducerFailure(ProducerFailed):
    """The producer died, reported a fatal error, or missed a deadline.

    ``exit_status`` is the process's status (negative: killed by that signal; None: unknown);
    ``producer_message`` is the producer's own last word (error frame or last log line).
    """

    def __init__(self, message: str, *, exit_status: int | None, producer_message: str) -> None:
        super().__init__(one_line(message))
        self.exit_status = exit_status
        self.producer_message = producer_message


class ProducerStartRefused(Refused):
    """The producer refused to start (exit 2): bad mode, key, engine or expectation mismatch."""

    def __init__(self, message: str, *, exit_status: int | None, producer_message: str) -> None:
        super().__init__(one_line(message))
        self.exit_status = exit_status
        self.producer_message = producer_message


class ConnectionBroken(ProducerFailed):
    """The connection failed or the producer broke the protocol or a deadline; one line naming
    the field or phase. ``stuck``: the producer must be killed now (it is stopped, silent past
    its deadline, or speaking something else), rather than given time to exit on its own."""

    def __init__(self, reason: str, producer_message: str | None = None, *,
                 stuck: bool = False) -> None:
        super().__init__(one_line(reason))
        self.reason = one_line(reason)
        self.producer_message = producer_message
        self.stuck = stuck


def checked_host_facts(ready: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """The ``host`` of a ready answer if it is a well-formed host-facts document, with None;
    otherwise None and why not (informational: never a failure)."""
    if "host" not in ready:
        return None, "the producer's ready answer has no host facts"
    problem = host_facts_problem(ready["host"])
    if problem is None:
        return dict(ready["host"]), None
    return None, one_line(f"the producer's host facts are malformed: {problem}")[:400]


def parse_ready_line(line: bytes, *, lane: str, mode: ProducerMode, run_key_id: str, pid: int) -> dict[str, Any]:
    """The producer's ready line, every field checked against what the client started (its lane,
    mode, run key, process); anything else raises :class:`ConnectionBroken` naming the field. The
    announced address is kept for the record, never used."""
    try:
        info = parse_untrusted_json(line, "ready line", max_bytes=MAX_READY_LINE_BYTES, max_depth=2)
    except Refused as exc:
        raise ConnectionBroken(str(exc), stuck=True) from None
    if not isinstance(info, dict) or set(info) != _READY_FIELDS:
        found = sorted(info) if isinstance(info, dict) else type(info).__name__
        raise ConnectionBroken(f"ready line: fields {str(found)[:200]}, expected {sorted(_READY_FIELDS)}", stuck=True)
    expected: dict[str, object] = {"event": "ready", "protocol": PROTOCOL, "lane": lane,
                                   "producer_mode": mode.value, "key_id": run_key_id, "pid": pid}
    for name, wanted in expected.items():
        if type(info[name]) is not type(wanted) or info[name] != wanted:
            raise ConnectionBroken(f"ready line {name}: found {str(info[name])[:80]!r}, expected {wanted!r}",
                                   stuck=True)
    if seconds_or_none(info["warmup_s"]) is None:
        raise ConnectionBroken(f"ready line warmup_s: found {str(info['warmup_s'])[:40]!r}, expected seconds >= 0",
                               stuck=True)
    if not isinstance(info["address"], str):
        raise ConnectionBroken("ready line address: expected a string", stuck=True)
    return info


class ProducerConnection:
    """One authenticated conversation with a producer over a connected socket: the handshake,
    prefill requests and shutdown. Everything the producer sends is parsed here, and anything
    wrong, late or silent raises :class:`ConnectionBroken`, never another exception.

    ``is_alive`` says whether the producer is still running (a dead one is reported at once
    rather than at its deadline); ``expected_payload_bytes`` is the exact payload size the run's
    geometry implies, refused otherwise before anything is allocated.
    """

    def __init__(self, sock: socket.socket, *, key: bytes, run_id: str, deadlines: PhaseDeadlines,
                 is_alive: Callable[[], bool] = lambda: True, expected_payload_bytes: int | None = None,
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES, kind: TransportKind = "unix") -> None:
        if not isinstance(run_id, str) or not ID_PATTERN.fullmatch(run_id):
            raise Refused(f"producer connection run_id: found {run_id!r}, expected [A-Za-z0-9._:-], 1-128")
        self._sock = sock
        self._key = key
        self.run_id = run_id
        self.kind: TransportKind = kind
        self.deadlines = deadlines
        self._is_alive = is_alive
        self.expected_payload_bytes = expected_payload_bytes
        self.max_payload_bytes = max_payload_bytes

    def close(self) -> None:
        self._sock.close()

    def handshake(self) -> FrameHeader:
        """``hello`` (nonce), ``auth`` (our proof of the run key), ``ready?``; returns the
        ``ready`` answer (with the producer's host facts), all within the verify deadline. The
        ``auth`` names this run: the producer seals every handoff of the connection under it."""
        deadline = time.monotonic() + self.deadlines.verify_s
        try:
            hello = self._read_header(deadline, phase="verify")
            if hello.get("op") != "hello" or hello.get("protocol") != PROTOCOL:
                raise ConnectionBroken(f"greeting: found op {str(hello.get('op'))[:40]!r}, expected hello "
                                       f"with protocol {PROTOCOL}", stuck=True)
            nonce_hex = hello.get("nonce")
            if not isinstance(nonce_hex, str) or len(nonce_hex) != 64:
                raise ConnectionBroken("greeting nonce: expected 64 hex characters", stuck=True)
            nonce = bytes.fromhex(nonce_hex)
            self._send({"op": "auth", "run_id": self.run_id,
                        "mac": client_auth_mac(self._key, nonce, self.run_id).hex()})
            self._expect_ok(self._read_header(deadline, phase="verify"), "auth")
            self._send({"op": "ready?"})
            ready = self._read_header(deadline, phase="verify")
            self._expect_ok(ready, "ready")
            return ready
        except ConnectionBroken:
            raise
        except Exception as exc:  # the boundary: nothing the producer sends escapes raw
            raise ConnectionBroken(f"handshake: unexpected {type(exc).__name__}: {one_line(str(exc))[:160]}",
                                   stuck=True) from None

    def shutdown(self, grace_s: float) -> None:
        """Ask the producer to exit; best effort (a producer that does not answer is killed)."""
        try:
            self._send({"op": "shutdown"})
            self._read_header(time.monotonic() + grace_s)
        except (ConnectionBroken, OSError):
            pass

    def request_prefill(self, prompt: np.ndarray | Sequence[int], request_id: str) -> Handoff:
        """Ask for the KV of ``prompt``; returns the sealed handoff with transport stats.

        The handoff is not yet verified: pass it to ``qualify.handoff.wire.open_handoff``.
        Raises :class:`ConnectionBroken` if the producer fails, dies, stops, breaks the protocol
        or misses the handoff deadline; ``Refused`` for a malformed request.
        """
        if not isinstance(request_id, str) or not ID_PATTERN.fullmatch(request_id):
            raise Refused(f"prefill request_id: found {request_id!r}, expected an id")
        token_array = np.asarray(prompt)
        if token_array.ndim != 1 or token_array.dtype.kind not in "iu":
            raise Refused(f"prefill tokens: found {token_array.dtype} {list(token_array.shape)}, "
                          f"expected a 1-D array of integer token ids")
        token_list = token_array.tolist()
        deadline = time.monotonic() + self.deadlines.handoff_s
        silence = _Silence()
        try:
            sent = time.perf_counter()
            self._send({"op": "prefill", "request_id": request_id, "tokens": token_list})
            first_byte: list[float] = []
            header = self._read_answer(request_id, deadline, silence, first_byte)
            manifest_size, mac_size, payload_size = self._blob_sizes(header)
            manifest_bytes = bytes(self._read_exact(manifest_size, deadline, silence=silence))
            mac = bytes(self._read_exact(mac_size, deadline, silence=silence))
            payload = receive_buffer(payload_size)
            self._read_into(payload, deadline, silence=silence)
            done = time.perf_counter()
        except ConnectionBroken:
            raise
        except Exception as exc:  # the boundary: nothing the producer sends escapes raw
            raise ConnectionBroken(f"handoff {request_id}: unexpected {type(exc).__name__}: "
                                   f"{one_line(str(exc))[:160]}", stuck=True) from None
        transfer_s = max(done - first_byte[0], 1e-9)
        stats = TransportStats(
            request_s=done - sent,
            transfer_s=transfer_s,
            payload_bytes=payload_size,
            gbit_per_s=payload_size * 8 / transfer_s / 1e9,
            producer_compute_s=seconds_or_none(header.get("compute_s")),
            producer_seal_s=seconds_or_none(header.get("seal_s")),
            longest_silence_s=max(silence.longest_s, silence.current_s()),
            kind=self.kind,
        )
        return Handoff(manifest_bytes, mac, payload, transport=stats)

    def _read_answer(self, request_id: str, deadline: float, silence: _Silence,
                     first_byte: list[float]) -> FrameHeader:
        """The request's answer header, after any heartbeats for it."""
        while True:
            header = self._read_header(deadline, first_byte, phase="handoff", silence=silence)
            if header.get("op") == "progress" and header.get("request_id") == request_id \
                    and "status" not in header:
                first_byte.clear()  # the transfer starts with the answer, not a heartbeat
                continue
            if header.get("status") != "ok":
                message = str(header.get("error", "error without a message"))
                exiting = header.get("exit_status")
                raise ConnectionBroken(f"prefill {request_id} failed" +
                            (f" (producer exiting {str(exiting)[:8]})" if exiting is not None else ""),
                            producer_message=message)
            if header.get("op") != "handoff" or header.get("request_id") != request_id:
                raise ConnectionBroken(f"handoff frame: answered op {str(header.get('op'))[:40]!r} for request "
                            f"{str(header.get('request_id'))[:80]!r}, expected a handoff for {request_id!r}",
                            stuck=True)
            return header

    def _blob_sizes(self, header: FrameHeader) -> tuple[int, int, int]:
        """The handoff frame's blob sizes, each checked before anything is allocated for it."""
        blobs = header.get("blobs")
        if (not isinstance(blobs, list) or len(blobs) != 3
                or not all(type(b) is int and b >= 0 for b in blobs)):
            raise ConnectionBroken(f"handoff frame blobs: found {str(blobs)[:80]}, expected 3 non-negative integers",
                        stuck=True)
        manifest_size, mac_size, payload_size = blobs
        if manifest_size > MAX_MANIFEST_BYTES:
            raise ConnectionBroken(f"handoff frame blobs: manifest of {manifest_size} bytes, expected at most "
                        f"{MAX_MANIFEST_BYTES}", stuck=True)
        if mac_size != MAC_BYTES:
            raise ConnectionBroken(f"handoff frame blobs: MAC of {mac_size} bytes, expected {MAC_BYTES}", stuck=True)
        # Larger than the run's geometry allows is refused before any allocation; smaller is
        # received (no allocation risk) so the wire can name why, e.g. another mode's cache.
        if self.expected_payload_bytes is not None and payload_size > self.expected_payload_bytes:
            raise ConnectionBroken(f"handoff frame blobs: payload of {payload_size} bytes, expected at most "
                                   f"{self.expected_payload_bytes} (the run's geometry)", stuck=True)
        if payload_size > self.max_payload_bytes:
            raise ConnectionBroken(f"handoff frame blobs: payload of {payload_size} bytes, expected at most "
                        f"{self.max_payload_bytes}", stuck=True)
        return manifest_size, mac_size, payload_size

    # -- socket I/O with deadlines -------------------------------------------------------------

    def _send(self, header: Mapping[str, Any]) -> None:
        try:
            self._sock.settimeout(self.deadlines.verify_s)
            self._sock.sendall(encode_frame_header(header))
        except OSError as exc:
            raise ConnectionBroken(f"cannot send {header.get('op')!r} ({type(exc).__name__})", stuck=True) from None

    def _read_header(self, deadline: float, first_byte: list[float] | None = None, *,
                     phase: _Phase = "verify", silence: _Silence | None = None) -> FrameHeader:
        prefix = self._read_exact(FRAME_LENGTH.size, deadline, first_byte, phase=phase, silence=silence)
        (length,) = FRAME_LENGTH.unpack(prefix)
        if length > MAX_HEADER_BYTES:
            raise ConnectionBroken(f"frame header: {length} bytes, expected at most {MAX_HEADER_BYTES}", stuck=True)
        try:
            return decode_frame_header(bytes(self._read_exact(length, deadline, phase=phase, silence=silence)))
        except Refused as exc:
            raise ConnectionBroken(str(exc), stuck=True) from None

    def _read_exact(self, count: int, deadline: float, first_byte: list[float] | None = None, *,
                    phase: _Phase = "handoff", silence: _Silence | None = None) -> bytearray:
        buffer = bytearray(count)
        self._read_into(memoryview(buffer), deadline, first_byte, phase=phase, silence=silence)
        return buffer

    def _read_into(self, view: memoryview, deadline: float, first_byte: list[float] | None = None, *,
                   phase: _Phase = "handoff", silence: _Silence | None = None) -> None:
        """Fill ``view`` from the socket, checking the phase deadline before every read and, waking
        every POLL_S while nothing arrives, the producer's silence and its process."""
        silence = silence if silence is not None else _Silence()
        self._sock.settimeout(POLL_S)
        received = 0
        total = view.nbytes
        limit = self.deadlines.handoff_s if phase == "handoff" else self.deadlines.verify_s
        while received < total:
            # Checked before every read, not only when one times out: bytes trickling in (a link or
            # a producer slower than the deadline, or heartbeats sent faster than POLL_S) never time
            # a read out.
            if time.monotonic() > deadline:
                raise ConnectionBroken(f"no answer within the {phase} deadline of {limit:g} s", stuck=True)
            try:
                count = self._sock.recv_into(view[received:], total - received)
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise ConnectionBroken(f"no answer within the {phase} deadline of {limit:g} s", stuck=True) from None
                if silence.current_s() > self.deadlines.silence_s:
                    raise ConnectionBroken(f"silent for {silence.current_s():.1f} s during {phase} (stopped or "
                                f"stalled; silence deadline {self.deadlines.silence_s:g} s)", stuck=True) from None
                if not self._is_alive():
                    raise ConnectionBroken("exited while the request was open") from None
                continue
            except OSError as exc:  # a TLS alert or a broken record included (ssl.SSLError)
                reason = getattr(exc, "reason", None)
                raise ConnectionBroken(f"connection failed ({type(exc).__name__}"
                                       f"{': ' + str(reason) if reason else ''})") from None
            if count == 0:
                raise ConnectionBroken("closed the connection")
            silence.heard()
            if first_byte is not None and not first_byte:
                first_byte.append(time.perf_counter())
            received += count

    def _expect_ok(self, header: Mapping[str, Any], op: str) -> None:
        if header.get("status") != "ok" or header.get("op") != op:
            raise ConnectionBroken(f"{op} refused", producer_message=str(header.get("error", "")))


class ProducerProcess:
    """A producer service subprocess, used as a context manager; see the module docstring."""

    def __init__(
        self,
        *,
        lane: str,
        mode: ProducerMode,
        key: bytes,
        run_id: str,
        expectation: ProducerExpectation,
        watchdog_s: float = DEFAULT_WATCHDOG_S,
        deadlines: PhaseDeadlines = DEFAULT_DEADLINES,
        engine_factory: str | None = None,
        transport: Literal["unix", "tcp"] = "unix",
        socket_path: Path | None = None,
        tcp_host: str = "127.0.0.1",
        tcp_port: int = 0,
        warmup_tokens: int = DEFAULT_WARMUP_TOKENS,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        expected_payload_bytes: int | None = None,
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        if transport not in ("unix", "tcp"):
            raise Refused(f"producer transport: found {transport!r}, expected unix or tcp")
        if transport == "tcp" and not (type(tcp_port) is int and 0 < tcp_port < 65536):
            raise Refused(f"producer tcp port: found {tcp_port!r}, expected the port to connect to "
                          f"(1-65535; the client never connects to an address the producer announces)")
        if not isinstance(deadlines, PhaseDeadlines):
            raise Refused(f"producer deadlines: found {type(deadlines).__name__}, expected PhaseDeadlines")
        try:
            self.mode = ProducerMode(mode)  # the enum, or (from an untyped caller) its value
        except ValueError:
            raise Refused(f"producer mode: found {mode!r}, expected exact or native") from None
        self.lane = lane
        self._key = bytes(key)
        self.run_id = run_id
        self.expectation = expectation
        self.watchdog_s = watchdog_s
        self.deadlines = deadlines
        self.engine_factory = engine_factory
        self.transport = transport
        self.socket_path = socket_path
        self.tcp_host = tcp_host
        self.tcp_port = tcp_port
        self.warmup_tokens = warmup_tokens
        self.max_payload_bytes = max_payload_bytes
        self.expected_payload_bytes = expected_payload_bytes
        self.python = python
        self.env = dict(env) if env is not None else None
        self.cwd = cwd if cwd is not None else PACKAGE_PARENT
        self.extra_args = tuple(extra_args)
        self.ready_info: dict[str, Any] = {}
        # The longest the producer was silent before its ready line (a stall it recovered from
        # when at least protocol.STALL_NOTE_S).
        self.ready_silence_s = 0.0
        # The producer's own host facts from its authenticated ``ready`` answer (None until then,
        # or when missing or malformed; host_facts_problem then says why).
        self.host_facts: dict[str, Any] | None = None
        self.host_facts_problem: str | None = "the producer has not reported ready"
        self._process: subprocess.Popen[bytes] | None = None
        self._connection: ProducerConnection | None = None
        self._workdir: Path | None = None
        self._output: collections.deque[str] = collections.deque(maxlen=OUTPUT_TAIL_LINES)
        self._drain: threading.Thread | None = None
        self._failure: ProducerFailure | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> ProducerProcess:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @property
    def pid(self) -> int:
        if self._process is None:
            raise ProducerFailure("producer: not started", exit_status=None, producer_message="")
        return self._process.pid

    @property
    def exit_status(self) -> int | None:
        return None if self._process is None else self._process.poll()

    def output_tail(self) -> list[str]:
        """The producer's last log lines (stdout and stderr, merged)."""
        return list(self._output)

    def start(self) -> None:
        """Spawn the producer, wait for its ready line, connect, authenticate, ask ``ready?``."""
        if self._process is not None:
            raise Refused("producer: already started")
        workdir = self._make_workdir()
        expect_path = workdir / "expect.json"
        expect_path.write_text(json.dumps(self.expectation.to_document()), encoding="utf-8")
        key_read, key_write = os.pipe()
        ready_read, ready_write = os.pipe()
        try:
            os.write(key_write, self._key.hex().encode("ascii") + b"\n")
            os.close(key_write)
            key_write = -1
            argv = [
                self.python, "-m", PRODUCER_MODULE,
                "--lane", self.lane, "--mode", self.mode.value, "--run-id", self.run_id,
                "--expect", str(expect_path), "--watchdog-s", repr(float(self.watchdog_s)),
                "--key-fd", str(key_read), "--ready-fd", str(ready_write),
                "--warmup-tokens", str(self.warmup_tokens), "--exit-with-stdin",
            ]
            if threading.current_thread() is threading.main_thread():
                # The kernel's parent-death signal follows the thread that forks: only the main
                # thread lives as long as this process (from another, stdin is the only tie).
                # ``python`` must run the producer itself: a launcher that forks it is refused.
                argv += ["--parent-pid", str(os.getpid())]
            if self.transport == "unix":
                path = self.socket_path or workdir / "producer.sock"
                self.socket_path = path
                argv += ["--socket", str(path)]
            else:
                argv += ["--host", self.tcp_host, "--port", str(self.tcp_port)]
            if self.engine_factory is not None:
                argv += ["--engine-factory", self.engine_factory]
            chosen = model_choice.chosen()
            if chosen is not None:  # the producer loads (and pins) the same model
                argv += ["--model", chosen.argument]
            argv += list(self.extra_args)
            child_env = dict(os.environ)
            child_env.pop(KEY_ENV, None)
            if self.env is not None:
                child_env.update(self.env)
            child_env.pop(KEY_ENV, None)
            self._process = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                pass_fds=(key_read, ready_write), start_new_session=True, env=child_env,
                cwd=str(self.cwd),
            )
        except BaseException:
            os.close(ready_read)
            self._discard_workdir()
            raise
        finally:
            os.close(key_read)
            os.close(ready_write)
            if key_write >= 0:
                os.close(key_write)
        drain = threading.Thread(target=self._drain_output, name="producer-output", daemon=True)
        drain.start()
        # Kept only once started: an interrupt between creating and starting it would leave close()
        # joining a thread that never ran ("cannot join thread before it is started", exit 70).
        self._drain = drain
        try:
            self.ready_info = self._wait_ready(ready_read)
            self._connect()
        except (ProducerFailure, ProducerStartRefused, Refused):
            raise
        except Exception as exc:  # the boundary: nothing the producer sends escapes raw
            self._raise_failure(f"start: unexpected {type(exc).__name__}: {one_line(str(exc))[:160]}",
                                kill_now=True)
        finally:
            os.close(ready_read)

    def _make_workdir(self) -> Path:
        """A new private directory under ``$TMPDIR`` (mode 0700, as ``mkdtemp`` makes), named in
        ``self._workdir`` before it is made, so a signal raised at any point leaves nothing that
        :meth:`close` does not remove (``mkdtemp`` returns its name only after making it)."""
        while True:
            workdir = Path(tempfile.gettempdir()) / f"{WORKDIR_PREFIX}{secrets.token_hex(8)}"
            self._workdir = workdir
            try:
                workdir.mkdir(mode=0o700)
            except FileExistsError:  # not ours (a 64-bit name collision): forget it, try another
                self._workdir = None
                continue
            # Any other failure leaves a name that does not exist: removing it is a no-op.
            return workdir

    def _drain_output(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for raw in self._process.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            if line:
                self._output.append(line)

    def _wait_ready(self, ready_read: int) -> dict[str, Any]:
        """Read the ready channel until the ready line: heartbeat lines reset the silence clock;
        the ready deadline bounds the whole wait."""
        assert self._process is not None
        deadline = time.monotonic() + self.deadlines.ready_s
        silence = _Silence()
        buffered = b""
        while True:
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                if line == READY_PROGRESS_LINE:
                    continue
                self.ready_silence_s = silence.longest_s
                return self._checked_ready_line(line)
            if len(buffered) > MAX_READY_LINE_BYTES:
                self._raise_failure(f"ready line: longer than {MAX_READY_LINE_BYTES} bytes", kill_now=True)
            if time.monotonic() > deadline:
                self._raise_failure(f"not ready within the ready deadline of {self.deadlines.ready_s:g} s",
                                    kill_now=True)
            if silence.current_s() > self.deadlines.silence_s:
                self._raise_failure(f"silent for {silence.current_s():.1f} s while starting (stopped or "
                                    f"stalled; silence deadline {self.deadlines.silence_s:g} s)", kill_now=True)
            readable, _, _ = select.select([ready_read], [], [], POLL_S)
            if readable:
                chunk = os.read(ready_read, 4096)
                if chunk:
                    silence.heard()
                    buffered += chunk
                    continue
                self._raise_failure("closed its ready channel without a ready line", starting=True)
            if self._process.poll() is not None:
                self._raise_failure("exited before it was ready", starting=True)

    def _checked_ready_line(self, line: bytes) -> dict[str, Any]:
        try:
            return parse_ready_line(line, lane=self.lane, mode=self.mode, run_key_id=handoff_key_id(self._key),
                                    pid=self._process_pid())
        except ConnectionBroken as broken:
            self._raise_failure(broken.reason, kill_now=True)

    def _process_pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def _connect(self) -> None:
        """Connect to the socket this client chose (or the operator's TCP address), never the
        announced one; then authenticate and ask ``ready?`` within the verify deadline."""
        try:
            if self.transport == "unix":
                assert self.socket_path is not None
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                target: Any = str(self.socket_path)
            else:
                sock = socket.socket(socket.AF_INET6 if ":" in self.tcp_host else socket.AF_INET,
                                     socket.SOCK_STREAM)
                target = (self.tcp_host, self.tcp_port)
            for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                try:
                    sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
                except OSError:
                    pass
            sock.settimeout(min(POLL_S * 25, self.deadlines.verify_s))
            sock.connect(target)
        except OSError as exc:
            self._raise_failure(f"cannot connect to {target} ({exc})", kill_now=True)
        self._connection = ProducerConnection(
            sock, key=self._key, run_id=self.run_id, deadlines=self.deadlines,
            is_alive=lambda: self.exit_status is None, expected_payload_bytes=self.expected_payload_bytes,
            max_payload_bytes=self.max_payload_bytes, kind=self.transport)
        try:
            self.host_facts, self.host_facts_problem = checked_host_facts(self._connection.handshake())
        except ConnectionBroken as broken:
            self._raise_failure(broken.reason, kill_now=broken.stuck, producer_message=broken.producer_message)

    def close(self) -> None:
        """Ask the producer to shut down; stop its process group if it does not; clean up."""
        process = self._process
        if self._connection is not None:
            if process is not None and process.poll() is None and self._failure is None:
                self._connection.shutdown(EXIT_GRACE_S)
            self._connection.close()
            self._connection = None
        if process is not None:
            if process.stdin is not None:
                try:
                    process.stdin.close()
                except OSError:
                    pass
            self._wait_exit(EXIT_GRACE_S, kill=True)
            if self._drain is not None:
                self._drain.join(timeout=EXIT_GRACE_S)
            # The output pipe, once its reader ended (left open, it is closed by the garbage
            # collector with a ResourceWarning, an error under `pytest -W error`).
            if process.stdout is not None and (self._drain is None or not self._drain.is_alive()):
                process.stdout.close()
        self._discard_workdir()

    def _discard_workdir(self) -> None:
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    # -- requests ------------------------------------------------------------------------------

    def request_prefill(self, prompt: np.ndarray | Sequence[int], request_id: str) -> Handoff:
        """Ask for the KV of ``prompt``; returns the sealed handoff with transport stats.

        The handoff is not yet verified: pass it to ``qualify.handoff.wire.open_handoff``.
        Raises :class:`ProducerFailure` if the producer fails, dies, stops, breaks the protocol
        or misses the handoff deadline (then its process group is killed).
        """
        if self._failure is not None:
            raise self._failure
        if self._connection is None:
            raise ProducerFailure("producer: not connected", exit_status=self.exit_status,
                                  producer_message="")
        try:
            return self._connection.request_prefill(prompt, request_id)
        except ConnectionBroken as broken:
            self._raise_failure(broken.reason, kill_now=broken.stuck, producer_message=broken.producer_message)

    # -- failure -------------------------------------------------------------------------------

    def kill(self) -> None:
        """SIGKILL the producer's process group now, with no graceful shutdown (an interrupted
        run waits for nothing); :meth:`close` still reaps it and cleans up."""
        self._kill_group()

    def _kill_group(self) -> None:
        """SIGKILL the producer's own process group (it was started in a new session)."""
        if self._process is not None and self._process.poll() is None:
            try:
                os.killpg(self._process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _wait_exit(self, grace_s: float, *, kill: bool) -> int | None:
        """Wait up to ``grace_s`` for the producer to exit; then SIGKILL its group if ``kill``."""
        process = self._process
        if process is None:
            return None
        try:
            return process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            if not kill:
                return None
        self._kill_group()
        try:
            return process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            return None

    def _raise_failure(self, reason: str, *, kill_now: bool = False, starting: bool = False,
                       producer_message: str | None = None) -> NoReturn:
        """Collect the exit status and last words, stop the process group, and raise.

        ``kill_now`` for a producer that is stuck (missed deadline, broken protocol); otherwise it
        gets EXIT_GRACE_S to exit on its own (it is dying, or has said it will exit 75).
        """
        if self._connection is not None:
            self._connection.close()
            self._connection = None
        if kill_now:
            self._kill_group()
        status = self._wait_exit(EXIT_GRACE_S, kill=True)
        if self._drain is not None:
            self._drain.join(timeout=EXIT_GRACE_S)
        tail = self.output_tail()
        last_line = next((line for line in reversed(tail) if line.startswith("producer:")),
                         tail[-1] if tail else "")
        message = producer_message or last_line.removeprefix("producer: ") or "no message"
        status_text = "unknown" if status is None else (
            f"killed by signal {-status}" if status < 0 else str(status))
        self._discard_workdir()
        if starting and status == EXIT_REFUSED:
            refusal = message.removeprefix("refused to start: ")
            raise ProducerStartRefused(
                f"producer {self.lane} ({self.mode.value}) refused to start: {refusal}",
                exit_status=status, producer_message=message,
            )
        text = (f"producer {self.lane} ({self.mode.value}): {reason}; exit status {status_text}; "
                f"producer said: {message}")
        failure = ProducerFailure(text, exit_status=status, producer_message=message)
        self._failure = failure
        raise failure


# --------------------------------------------------------------------------------------------
# a producer already running elsewhere


def parse_producer_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[V6]:PORT`` for an IPv6 address) of ``--producer-at``; refused in one line
    otherwise. HOST is a host name or an IP address; PORT 1-65535."""
    host, separator, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not separator or not host or not port_text.isascii() or not port_text.isdigit() \
            or not 0 < int(port_text) < 65536:
        raise Refused(f"--producer-at: found {text!r}, expected HOST:PORT (PORT 1-65535; [ADDRESS]:PORT for IPv6)")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not all(label and len(label) <= 63 and label.isascii() and label.replace("-", "").isalnum()
                   for label in host.split(".")):
            raise Refused(f"--producer-at: host {host!r} is neither an IP address nor a host name") from None
    return host, int(port_text)


def is_loopback_host(host: str) -> bool:
    """``localhost`` or a loopback IP address (a name that resolves elsewhere is not loopback)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RemoteProducer:
    """The :class:`~qualify.handoff.transport.Transport` of a producer an operator already runs
    (``qualify producer serve --port``), perhaps on another host: connect to ``host:port``, under
    TLS when ``tls`` is given (the producer's certificate checked against the pinned CA and
    ``host``; our client certificate presented), then authenticate with the run key, naming the
    run. Plain TCP is refused unless ``host`` is loopback.

    The producer is not ours to stop: :meth:`close` closes the connection only. A failure (TLS or
    authentication refused, a deadline, a broken or truncated stream) raises :class:`ProducerFailure`
    with one line and ends the connection; nothing received from a failed request is returned.
    """

    def __init__(self, *, host: str, port: int, key: bytes, run_id: str, lane: str, mode: ProducerMode,
                 deadlines: PhaseDeadlines = DEFAULT_DEADLINES, tls: ssl.SSLContext | None = None,
                 expected_payload_bytes: int | None = None,
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:
        if not (type(port) is int and 0 < port < 65536):
            raise Refused(f"producer port: found {port!r}, expected 1-65535")
        if tls is None and not is_loopback_host(host):
            raise Refused(f"--producer-at {host}:{port}: not loopback; plain TCP would carry the KV in the clear, "
                          f"give --tls-ca, --tls-cert and --tls-key")
        if not isinstance(deadlines, PhaseDeadlines):
            raise Refused(f"producer deadlines: found {type(deadlines).__name__}, expected PhaseDeadlines")
        handoff_key_id(key)  # refuses a key that is not bytes of at least 32
        self.host = host
        self.port = port
        self._key = bytes(key)
        self.run_id = run_id
        self.lane = lane
        self.mode = ProducerMode(mode)
        self.deadlines = deadlines
        self._tls = tls
        self.kind: TransportKind = "tcp" if tls is None else "tls"
        self.expected_payload_bytes = expected_payload_bytes
        self.max_payload_bytes = max_payload_bytes
        self.host_facts: dict[str, Any] | None = None
        self.host_facts_problem: str | None = "the producer has not reported ready"
        self.ready_silence_s = 0.0
        # What the TLS session was (version, cipher, the producer's certificate), for the record.
        self.tls_session: dict[str, str] | None = None
        self._connection: ProducerConnection | None = None
        self._failure: ProducerFailure | None = None
        self._started = False

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.kind}:{host}:{self.port}"

    def __enter__(self) -> RemoteProducer:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def start(self) -> None:
        """Connect, secure (TLS), authenticate and ask ``ready?``, all within the verify deadline;
        the producer's answer must name this lane, mode and run."""
        if self._started:
            raise Refused("producer: already started")
        self._started = True
        deadline = time.monotonic() + self.deadlines.verify_s
        sock = self._dial(deadline)
        self._connection = ProducerConnection(
            sock, key=self._key, run_id=self.run_id, deadlines=self.deadlines,
            expected_payload_bytes=self.expected_payload_bytes, max_payload_bytes=self.max_payload_bytes,
            kind=self.kind)
        try:
            ready = self._connection.handshake()
        except ConnectionBroken as broken:
            self._fail(broken.reason, broken.producer_message)
        expected = {"lane": self.lane, "producer_mode": self.mode.value, "run_id": self.run_id}
        for name, wanted in expected.items():
            if ready.get(name) != wanted:
                self._fail(f"ready answer {name}: found {str(ready.get(name))[:80]!r}, expected {wanted!r}")
        self.host_facts, self.host_facts_problem = checked_host_facts(ready)

    def _dial(self, deadline: float) -> socket.socket:
        """A connected socket (TLS handshake done when TLS is on) within ``deadline``."""
        try:
            sock = socket.create_connection((self.host, self.port),
                                            timeout=max(deadline - time.monotonic(), POLL_S))
        except OSError as exc:
            self._fail(f"cannot connect ({type(exc).__name__}: {one_line(str(exc))[:120]})")
        for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
            except OSError:
                pass
        if self._tls is None:
            return sock
        sock.settimeout(max(deadline - time.monotonic(), POLL_S))
        try:
            # A stream cut without TLS's close_notify is an error, never a quiet end.
            secured = self._tls.wrap_socket(sock, server_hostname=self.host, suppress_ragged_eofs=False)
        except ssl.SSLCertVerificationError as exc:
            sock.close()
            self._fail(f"TLS: the producer's certificate is refused ({one_line(exc.verify_message or str(exc))}; "
                       f"checked against --tls-ca for host {self.host})")
        except TimeoutError:
            sock.close()
            self._fail(f"TLS handshake not done within the verify deadline of {self.deadlines.verify_s:g} s")
        except (ssl.SSLError, OSError) as exc:
            sock.close()
            reason = getattr(exc, "reason", None) or type(exc).__name__
            self._fail(f"TLS handshake failed ({reason}; the producer may have refused our client certificate)")
        certificate = peer_certificate_sha256(secured)
        self.tls_session = {"version": str(secured.version()), "cipher": str((secured.cipher() or ("?",))[0]),
                            "producer_certificate_sha256": certificate or "none"}
        return secured

    def request_prefill(self, prompt: np.ndarray | Sequence[int], request_id: str) -> Handoff:
        """The sealed, not yet verified handoff of ``prompt``; see
        :meth:`ProducerConnection.request_prefill`. Raises :class:`ProducerFailure`."""
        if self._failure is not None:
            raise self._failure
        if self._connection is None:
            raise ProducerFailure(f"producer at {self.address}: not connected", exit_status=None,
                                  producer_message="")
        try:
            return self._connection.request_prefill(prompt, request_id)
        except ConnectionBroken as broken:
            self._fail(broken.reason, broken.producer_message)

    def close(self) -> None:
        """Close the connection; the producer stays up for its next client."""
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def kill(self) -> None:
        """What an interrupted run does to its producer: here, drop the connection now."""
        self.close()

    def _fail(self, reason: str, producer_message: str | None = None) -> NoReturn:
        self.close()
        said = f"; producer said: {producer_message}" if producer_message else ""
        failure = ProducerFailure(f"producer {self.lane} ({self.mode.value}) at {self.address}: {reason}{said}",
                                  exit_status=None, producer_message=producer_message or "")
        self._failure = failure
        raise failure

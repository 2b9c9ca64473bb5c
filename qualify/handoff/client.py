"""The harness side of the handoff: start the producer process, wait for it, request handoffs.

:class:`ProducerProcess` is the socket :class:`~qualify.handoff.transport.Transport`; it speaks
:mod:`qualify.handoff.protocol` and never imports the producer's own module.

:class:`ProducerProcess` runs ``python -m qualify.handoff.service`` in its own process group,
hands it the run key through an inherited pipe (never argv, never the environment), waits for its
ready line (written only after a warm-up prefill), authenticates on the socket, and requests
handoffs. Every wait has a deadline and watches the process, so a producer that dies (SIGKILL,
exit 75, closed socket) or stalls becomes a :class:`ProducerFailure` carrying its last message
and exit status within seconds, never a hang.

The producer's ``ready`` answer carries its host facts (``qualify.core.hostenv.host_facts``);
:attr:`ProducerProcess.host_facts` holds them once checked, or None with
:attr:`ProducerProcess.host_facts_problem` saying why. They are informational: a producer whose
facts are missing or malformed still serves, and the receipt records them as missing.
"""

from __future__ import annotations

import collections
import json
import mmap
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, NoReturn

import numpy as np

from qualify.contract.lanes import ProducerMode
from qualify.core.assets import REPO_ROOT
from qualify.core.errors import ProducerFailed, Refused, one_line
from qualify.core.hostenv import host_facts_problem
from qualify.handoff.protocol import (
    DEFAULT_WARMUP_TOKENS,
    DEFAULT_WATCHDOG_S,
    EXIT_REFUSED,
    FRAME_LENGTH,
    KEY_ENV,
    MAX_HEADER_BYTES,
    PROTOCOL,
    SOCKET_BUFFER_BYTES,
    FrameHeader,
    ProducerExpectation,
    client_auth_mac,
    decode_frame_header,
    encode_frame_header,
)
from qualify.handoff.wire import MAC_BYTES, Handoff, TransportStats

# How often a blocked wait wakes to check the process and its deadline.
POLL_S = 0.2
# After the producer reports a fatal error or the socket closes, how long it has to exit.
EXIT_GRACE_S = 5.0
DEFAULT_READY_TIMEOUT_S = 600.0
# A handoff larger than this is refused before any memory is allocated for it.
DEFAULT_MAX_PAYLOAD_BYTES = 16 << 30
MAX_MANIFEST_BYTES = 16 << 20
OUTPUT_TAIL_LINES = 40
# Payloads at least this large are received into huge-page-advised anonymous memory.
HUGE_PAGE_MIN_BYTES = 4 << 20


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


def _seconds(value: object) -> float | None:
    """A non-negative finite number of seconds from a frame header, else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf"):
        return float(value)
    return None


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


class _Dead(Exception):
    """Internal: the connection or process is gone; carries what we know."""

    def __init__(self, reason: str, producer_message: str | None = None, *,
                 stuck: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.producer_message = producer_message
        self.stuck = stuck


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
        ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
        request_timeout_s: float | None = None,
        engine_factory: str | None = None,
        transport: Literal["unix", "tcp"] = "unix",
        socket_path: Path | None = None,
        tcp_host: str = "127.0.0.1",
        tcp_port: int = 0,
        warmup_tokens: int = DEFAULT_WARMUP_TOKENS,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        if transport not in ("unix", "tcp"):
            raise Refused(f"producer transport: found {transport!r}, expected unix or tcp")
        try:
            self.mode = ProducerMode(mode)  # the enum, or (from an untyped caller) its value
        except ValueError:
            raise Refused(f"producer mode: found {mode!r}, expected exact or native") from None
        self.lane = lane
        self._key = bytes(key)
        self.run_id = run_id
        self.expectation = expectation
        self.watchdog_s = watchdog_s
        self.ready_timeout_s = ready_timeout_s
        self.request_timeout_s = request_timeout_s if request_timeout_s is not None else watchdog_s + 30.0
        self.engine_factory = engine_factory
        self.transport = transport
        self.socket_path = socket_path
        self.tcp_host = tcp_host
        self.tcp_port = tcp_port
        self.warmup_tokens = warmup_tokens
        self.max_payload_bytes = max_payload_bytes
        self.python = python
        self.env = dict(env) if env is not None else None
        self.cwd = cwd if cwd is not None else REPO_ROOT
        self.extra_args = tuple(extra_args)
        self.ready_info: dict[str, Any] = {}
        # The producer's own host facts from its authenticated ``ready`` answer (None until then,
        # or when missing or malformed; host_facts_problem then says why).
        self.host_facts: dict[str, Any] | None = None
        self.host_facts_problem: str | None = "the producer has not reported ready"
        self._process: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
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
        self._workdir = Path(tempfile.mkdtemp(prefix="trust-ladder-producer-"))
        expect_path = self._workdir / "expect.json"
        expect_path.write_text(json.dumps(self.expectation.to_document()), encoding="utf-8")
        key_read, key_write = os.pipe()
        ready_read, ready_write = os.pipe()
        try:
            os.write(key_write, self._key.hex().encode("ascii") + b"\n")
            os.close(key_write)
            key_write = -1
            argv = [
                self.python, "-m", "qualify.handoff.service",
                "--lane", self.lane, "--mode", self.mode.value, "--run-id", self.run_id,
                "--expect", str(expect_path), "--watchdog-s", repr(float(self.watchdog_s)),
                "--key-fd", str(key_read), "--ready-fd", str(ready_write),
                "--warmup-tokens", str(self.warmup_tokens), "--exit-with-stdin",
            ]
            if self.transport == "unix":
                path = self.socket_path or self._workdir / "producer.sock"
                self.socket_path = path
                argv += ["--socket", str(path)]
            else:
                argv += ["--host", self.tcp_host, "--port", str(self.tcp_port)]
            if self.engine_factory is not None:
                argv += ["--engine-factory", self.engine_factory]
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
        self._drain = threading.Thread(target=self._drain_output, name="producer-output",
                                       daemon=True)
        self._drain.start()
        try:
            self.ready_info = self._wait_ready(ready_read)
        finally:
            os.close(ready_read)
        self._connect()

    def _drain_output(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for raw in self._process.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            if line:
                self._output.append(line)

    def _wait_ready(self, ready_read: int) -> dict[str, Any]:
        assert self._process is not None
        deadline = time.monotonic() + self.ready_timeout_s
        buffered = b""
        while b"\n" not in buffered:
            if time.monotonic() > deadline:
                self._raise_failure(f"not ready within {self.ready_timeout_s:g} s", kill_now=True)
            readable, _, _ = select.select([ready_read], [], [], POLL_S)
            if readable:
                chunk = os.read(ready_read, 4096)
                if chunk:
                    buffered += chunk
                    continue
                self._raise_failure("closed its ready channel without a ready line", starting=True)
            if self._process.poll() is not None:
                self._raise_failure("exited before it was ready", starting=True)
        try:
            info = json.loads(buffered.split(b"\n", 1)[0])
        except ValueError:
            info = None
        if not isinstance(info, dict) or info.get("event") != "ready" \
                or info.get("protocol") != PROTOCOL:
            self._raise_failure(f"wrote an unreadable ready line {buffered[:200]!r}", kill_now=True)
        return info

    def _connect(self) -> None:
        address = str(self.ready_info.get("address", ""))
        try:
            if address.startswith("unix:"):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                target: Any = address[len("unix:"):]
            elif address.startswith("tcp:"):
                host, _, port = address[len("tcp:"):].rpartition(":")
                sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                                     socket.SOCK_STREAM)
                target = (host, int(port))
            else:
                self._raise_failure(f"announced an unknown address {address!r}", kill_now=True)
            for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                try:
                    sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
                except OSError:
                    pass
            sock.settimeout(POLL_S * 25)
            sock.connect(target)
        except OSError as exc:
            self._raise_failure(f"cannot connect to {address} ({exc})", kill_now=True)
        self._sock = sock
        deadline = time.monotonic() + self.request_timeout_s
        try:
            hello = self._read_header(deadline)
            if hello.get("op") != "hello" or hello.get("protocol") != PROTOCOL:
                raise _Dead(f"unexpected greeting {hello.get('op')!r}", stuck=True)
            nonce = bytes.fromhex(str(hello.get("nonce", "")))
            self._send({"op": "auth", "mac": client_auth_mac(self._key, nonce).hex()})
            self._expect_ok(self._read_header(deadline), "auth")
            self._send({"op": "ready?"})
            ready = self._read_header(deadline)
            self._expect_ok(ready, "ready")
            self._take_host_facts(ready)
        except (_Dead, ValueError) as exc:
            self._raise_failure(str(exc), kill_now=not isinstance(exc, _Dead) or exc.stuck,
                                producer_message=getattr(exc, "producer_message", None))

    def _take_host_facts(self, ready: Mapping[str, Any]) -> None:
        """Keep the ``host`` of a ready answer if it is a well-formed host-facts document;
        otherwise record why not (informational: never a failure)."""
        if "host" not in ready:
            self.host_facts, self.host_facts_problem = None, "the producer's ready answer has no host facts"
            return
        problem = host_facts_problem(ready["host"])
        if problem is None:
            self.host_facts, self.host_facts_problem = dict(ready["host"]), None
        else:
            self.host_facts = None
            self.host_facts_problem = one_line(f"the producer's host facts are malformed: {problem}")[:400]

    def close(self) -> None:
        """Ask the producer to shut down; stop its process group if it does not; clean up."""
        process = self._process
        if process is not None and process.poll() is None and self._sock is not None \
                and self._failure is None:
            try:
                self._send({"op": "shutdown"})
                self._read_header(time.monotonic() + EXIT_GRACE_S)
            except (_Dead, OSError):
                pass
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if process is not None:
            if process.stdin is not None:
                try:
                    process.stdin.close()
                except OSError:
                    pass
            self._wait_exit(EXIT_GRACE_S, kill=True)
            if self._drain is not None:
                self._drain.join(timeout=EXIT_GRACE_S)
        self._discard_workdir()

    def _discard_workdir(self) -> None:
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    # -- requests ------------------------------------------------------------------------------

    def request_prefill(self, prompt: np.ndarray | Sequence[int], request_id: str,
                        *, timeout_s: float | None = None) -> Handoff:
        """Ask for the KV of ``prompt``; returns the sealed handoff with transport stats.

        The handoff is not yet verified: pass it to ``qualify.handoff.wire.open_handoff``.
        Raises :class:`ProducerFailure` if the producer fails, dies or misses the deadline.
        """
        if self._failure is not None:
            raise self._failure
        if self._sock is None:
            raise ProducerFailure("producer: not connected", exit_status=self.exit_status,
                                  producer_message="")
        token_array = np.asarray(prompt)
        if token_array.ndim != 1 or token_array.dtype.kind not in "iu":
            raise Refused(f"prefill tokens: found {token_array.dtype} {list(token_array.shape)}, "
                          f"expected a 1-D array of integer token ids")
        token_list = token_array.tolist()
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.request_timeout_s)
        try:
            sent = time.perf_counter()
            self._send({"op": "prefill", "request_id": request_id, "tokens": token_list})
            first_byte: list[float] = []
            header = self._read_header(deadline, first_byte)
            if header.get("status") != "ok":
                message = str(header.get("error", "error without a message"))
                exiting = header.get("exit_status")
                raise _Dead(f"prefill {request_id} failed" +
                            (f" (producer exiting {exiting})" if exiting is not None else ""),
                            producer_message=message)
            if header.get("op") != "handoff" or header.get("request_id") != request_id:
                raise _Dead(f"answered {header.get('op')!r} for request "
                            f"{header.get('request_id')!r}, expected a handoff for {request_id!r}",
                            stuck=True)
            blobs = header.get("blobs")
            if (not isinstance(blobs, list) or len(blobs) != 3
                    or not all(type(b) is int and b >= 0 for b in blobs)):
                raise _Dead("handoff frame: malformed blobs", stuck=True)
            manifest_size, mac_size, payload_size = blobs
            if manifest_size > MAX_MANIFEST_BYTES or mac_size != MAC_BYTES \
                    or payload_size > self.max_payload_bytes:
                raise _Dead(f"handoff frame: sizes {blobs} exceed limits", stuck=True)
            manifest_bytes = bytes(self._read_exact(manifest_size, deadline))
            mac = bytes(self._read_exact(mac_size, deadline))
            payload = receive_buffer(payload_size)
            self._read_into(payload, deadline)
            done = time.perf_counter()
        except _Dead as dead:
            self._raise_failure(dead.reason, kill_now=dead.stuck,
                                producer_message=dead.producer_message)
        transfer_s = max(done - first_byte[0], 1e-9)
        stats = TransportStats(
            request_s=done - sent,
            transfer_s=transfer_s,
            payload_bytes=payload_size,
            gbit_per_s=payload_size * 8 / transfer_s / 1e9,
            producer_compute_s=_seconds(header.get("compute_s")),
            producer_seal_s=_seconds(header.get("seal_s")),
        )
        return Handoff(manifest_bytes, mac, payload, transport=stats)

    # -- socket I/O with deadlines -------------------------------------------------------------

    def _send(self, header: Mapping[str, Any]) -> None:
        assert self._sock is not None
        try:
            self._sock.settimeout(self.request_timeout_s)
            self._sock.sendall(encode_frame_header(header))
        except OSError as exc:
            raise _Dead(f"cannot send {header.get('op')!r} ({type(exc).__name__})") from None

    def _read_header(self, deadline: float, first_byte: list[float] | None = None) -> FrameHeader:
        prefix = self._read_exact(FRAME_LENGTH.size, deadline, first_byte)
        (length,) = FRAME_LENGTH.unpack(prefix)
        if length > MAX_HEADER_BYTES:
            raise _Dead(f"frame header of {length} bytes exceeds {MAX_HEADER_BYTES}", stuck=True)
        try:
            return decode_frame_header(bytes(self._read_exact(length, deadline)))
        except Refused as exc:
            raise _Dead(str(exc), stuck=True) from None

    def _read_exact(self, count: int, deadline: float,
                    first_byte: list[float] | None = None) -> bytearray:
        buffer = bytearray(count)
        self._read_into(memoryview(buffer), deadline, first_byte)
        return buffer

    def _read_into(self, view: memoryview, deadline: float,
                   first_byte: list[float] | None = None) -> None:
        """Fill ``view`` from the socket, waking every POLL_S to check deadline and process."""
        assert self._sock is not None and self._process is not None
        self._sock.settimeout(POLL_S)
        received = 0
        total = view.nbytes
        while received < total:
            try:
                count = self._sock.recv_into(view[received:], total - received)
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise _Dead("no response before the client deadline", stuck=True) from None
                if self._process.poll() is not None:
                    raise _Dead("exited while the request was open") from None
                continue
            except OSError as exc:
                raise _Dead(f"connection failed ({type(exc).__name__})") from None
            if count == 0:
                raise _Dead("closed the connection")
            if first_byte is not None and not first_byte:
                first_byte.append(time.perf_counter())
            received += count

    def _expect_ok(self, header: Mapping[str, Any], op: str) -> None:
        if header.get("status") != "ok" or header.get("op") != op:
            raise _Dead(f"{op} refused", producer_message=str(header.get("error", "")))

    # -- failure -------------------------------------------------------------------------------

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
        if self._sock is not None:
            self._sock.close()
            self._sock = None
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

"""The producer service: one process that prefills prompts and answers with sealed KV handoffs.

Started by the harness (``qualify.handoff.client.ProducerProcess``) or by an operator, through its
command (:mod:`qualify.interfaces.producer_command`, which parses the arguments into a
:class:`ServiceConfig` and calls :func:`serve`)::

    python -m qualify.interfaces.producer_command --lane NAME --mode exact|native --socket PATH \\
        --run-id ID --expect EXPECT.json --key-fd N [--watchdog-s 900]

or, for consumers on other hosts (``qualify --recipe ... --producer-at HOST:PORT``; mutual TLS 1.3
with the set ``qualify keys tls`` issues, ``qualify.handoff.tls``; ``docs/transport.md``)::

    qualify producer serve --lane NAME --mode native --expect EXPECT.json --key-file RUN.key \\
        --host 0.0.0.0 --allow-non-loopback --port 7443 \\
        --tls-cert producer.crt --tls-key producer.key --tls-client-ca ca.crt

Without ``--run-id`` the producer seals each connection's handoffs under the run id its
authenticated client names (``auth``, covered by the client's MAC); with one, a client naming
another is turned away. A non-loopback address is refused without TLS.

Start is fail-closed: a mode other than exact/native, a key that is missing or short, an engine
whose version, geometry or digests differ from ``--expect`` all exit 2 before anything is served.
Readiness means a warm-up prefill has completed (then one ready line is written), not that the
process is alive. Every request runs under a watchdog; on expiry, and after any error that touched
the engine, the producer sends an error frame and exits 75 (EX_TEMPFAIL): a dead producer is a
known state, a live one serving from a half-broken engine is not. Three consecutive non-engine
errors of an authenticated client (bad frames, bad requests) also exit 75.

Admission (:mod:`qualify.handoff.admission`): every accepted connection gets its TLS handshake,
``hello`` and ``auth`` on a thread of its own under one short deadline, bounded in number in all
and per peer address; one authenticated client is served at a time, the others wait their turn.
A peer that connects and stays silent, trickles its handshake, or holds a certificate but not the
run key is dropped at that deadline without delaying anyone, and never counts toward the exit.

Protocol (:mod:`qualify.handoff.protocol`, shared with the client; Unix socket by default,
loopback TCP, or TCP under TLS): ``hello``/``auth`` with the run key, then ``ready?``, ``prefill`` and
``shutdown``. The ``ready`` answer carries ``host``: this process's
:func:`qualify.core.hostenv.host_facts` (CPU, ISA flags, BLAS kernel and threads, numpy SIMD
dispatch, GPU, harness commit), taken once after the warm-up prefill, so the consumer can record
in its receipt what the producer ran on. A lane hands off the positions
:func:`qualify.handoff.protocol.handed_off_positions` says (whole blocks on vLLM lanes); an
engine whose prefill hands off any other count is an engine error.

Dying with the harness: the harness starts the producer in a session of its own and stops it
itself on SIGINT, SIGTERM and SIGHUP. For a harness that cannot (SIGKILLed, crashed), two ties end
the producer: ``--parent-pid`` (Linux: the kernel SIGKILLs the producer when that parent dies;
checked right after the request, so a parent already gone is caught too) and
``--exit-with-stdin`` (a thread that leaves with ``os._exit`` when the harness's end of stdin
closes; nothing before that exit can block or raise).
"""

from __future__ import annotations

import ctypes
import faulthandler
import hmac
import importlib
import json
import os
import queue
import secrets
import signal
import socket
import ssl
import stat
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar, cast

import numpy as np

from qualify.contract.lanes import ProducerMode
from qualify.core.assets import prompt_sha256
from qualify.core.digests import canonical_json_bytes, is_sha256_hex
from qualify.core.errors import Refused, one_line
from qualify.core.hostenv import host_facts
from qualify.engines.base import Engine, LaneEngine, ModelGeometry
from qualify.engines.faults import faulty_producer
from qualify.handoff.admission import LISTEN_BACKLOG, Admissions, Admitting
from qualify.handoff.protocol import (
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_TEMPFAIL,
    FRAME_LENGTH,
    HEARTBEAT_S,
    ID_PATTERN,
    MAX_HEADER_BYTES,
    PROTOCOL,
    READY_PROGRESS_LINE,
    SOCKET_BUFFER_BYTES,
    FrameHeader,
    ProducerExpectation,
    StartRefused,
    client_auth_mac,
    decode_frame_header,
    encode_frame_header,
    handed_off_positions,
    read_run_key,
)
from qualify.handoff.tls import server_context
from qualify.handoff.wire import SealedHandoff, handoff_key_id, seal_handoff_parts

DEFAULT_ENGINE_FACTORY = "qualify.engines.factory:build_producer"
MAX_NON_ENGINE_ERRORS = 3
# How often connections past their admission deadline are looked for and dropped.
EXPIRY_SWEEP_S = 0.25
# Once a frame has started, the rest must arrive within this many seconds.
FRAME_STALL_S = 60.0
# The run id a producer without --run-id seals its warm-up prefill under (never sent).
WARMUP_RUN_ID = "warmup"
# A GIL-independent backstop (faulthandler, exits 1) behind the watchdog, for a hang in C code
# that never releases the GIL and so never lets the watchdog thread run.
BACKSTOP_GRACE_S = 60.0

_T = TypeVar("_T")
# ``module:function`` building the producer engine of (lane name, producer mode).
EngineFactory = Callable[[str, ProducerMode], Engine]


# --------------------------------------------------------------------------------------------
# start-time checks


def check_engine(engine: object, *, mode: ProducerMode, expectation: ProducerExpectation) -> str:
    """Compare the built engine with the expectation; returns its target cache identity.

    Raises ``StartRefused`` naming the first field that differs.
    """
    for attribute in ("name", "version", "abi", "geometry", "prefill"):
        if not hasattr(engine, attribute):
            raise StartRefused(f"engine: has no {attribute!r}; it does not implement Engine")
    found_facts = {attribute: getattr(engine, attribute) for attribute in ("name", "version", "abi", "geometry")}
    for attribute, wanted in (("version", expectation.engine_version), ("name", expectation.engine_name),
                              ("abi", expectation.engine_abi)):
        if wanted is not None and found_facts[attribute] != wanted:
            raise StartRefused(f"engine {attribute}: found {found_facts[attribute]!r}, expected {wanted!r}")
    geometry = found_facts["geometry"]
    if not isinstance(geometry, ModelGeometry):
        raise StartRefused(f"engine geometry: found {type(geometry).__name__}, expected ModelGeometry")
    for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab", "max_positions",
                 "rope_theta"):
        found, wanted = getattr(geometry, name), getattr(expectation.geometry, name)
        if found != wanted:
            label = {"max_positions": "max_positions (context length)"}.get(name, name)
            raise StartRefused(f"engine geometry {label}: found {found}, expected {wanted}")
    if expectation.digests is not None:
        found_digests = getattr(engine, "digests", None)
        if not isinstance(found_digests, Mapping):
            raise StartRefused("engine digests: the engine exposes none, expected checkpoint digests")
        for name in sorted(set(found_digests) | set(expectation.digests)):
            if found_digests.get(name) != expectation.digests.get(name):
                raise StartRefused(
                    f"engine digests {name}: found {found_digests.get(name)!r}, expected "
                    f"{expectation.digests.get(name)!r}"
                )
    # A factory's LaneEngine carries its mode; another engine declares ``producer_mode`` (enum or value).
    declared = engine.mode if isinstance(engine, LaneEngine) else getattr(engine, "producer_mode", None)
    if declared is None:
        raise StartRefused(f"engine producer_mode: the engine declares none, expected {mode.value!r}")
    if getattr(declared, "value", declared) != mode.value:
        raise StartRefused(f"engine producer_mode: found {getattr(declared, 'value', declared)!r}, "
                           f"expected {mode.value!r}")
    cache_identity = getattr(engine, "target_cache_identity_sha256", None)
    if not is_sha256_hex(cache_identity):
        raise StartRefused(
            f"engine target_cache_identity_sha256: found {cache_identity!r}; the factory must "
            f"derive it for the mode it built (qualify.contract.lanes.target_cache_identity)"
        )
    return str(cache_identity)


# --------------------------------------------------------------------------------------------
# configuration, key, factory, socket


@dataclass(frozen=True)
class ServiceConfig:
    """Validated start arguments."""

    lane: str
    mode: ProducerMode
    run_id: str | None
    expect_path: Path
    socket_path: Path | None
    host: str
    port: int | None
    allow_non_loopback: bool
    watchdog_s: float
    engine_factory: str
    warmup_tokens: int
    ready_fd: int | None
    exit_with_stdin: bool
    key_source: tuple[str, str] = field(repr=False)
    fault: str | None = None
    parent_pid: int | None = None
    model: str | None = None
    # (certificate, private key, client CA) when the TCP socket serves TLS.
    tls: tuple[Path, Path, Path] | None = None


def load_factory(spec: str) -> EngineFactory:
    """Resolve ``module:function``; refuses anything else."""
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise StartRefused(f"--engine-factory: found {spec!r}, expected module:function")
    try:
        factory = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as exc:
        raise StartRefused(one_line(f"--engine-factory {spec}: cannot load ({exc})")) from None
    if not callable(factory):
        raise StartRefused(f"--engine-factory {spec}: not callable")
    # What it returns is checked against the expectation (check_engine) before anything is served.
    return cast(EngineFactory, factory)


def load_expectation(path: Path) -> ProducerExpectation:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise StartRefused(one_line(f"--expect {path}: cannot read JSON ({exc})")) from None
    return ProducerExpectation.from_document(document)


def bind_unix(path: Path) -> socket.socket:
    """Bind a 0600 Unix socket; a stale socket file (nobody listening) is replaced."""
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise StartRefused(f"--socket {path}: exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(2.0)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()
        else:
            raise StartRefused(f"--socket {path}: a live producer is already serving it")
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        listener.bind(str(path))
    except OSError as exc:
        listener.close()
        raise StartRefused(one_line(f"--socket {path}: cannot bind ({exc})")) from None
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    listener.listen(LISTEN_BACKLOG)
    return listener


def bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        raise StartRefused(one_line(f"--host/--port {host}:{port}: cannot bind ({exc})")) from None
    listener.listen(LISTEN_BACKLOG)
    return listener


# --------------------------------------------------------------------------------------------
# the service


class _PeerGone(Exception):
    """The client closed the connection (between frames: normal; inside one: an error)."""


class _BadFrame(Exception):
    """A frame could not be read or understood (a non-engine error)."""


class StartHeartbeat:
    """A ``{"event":"progress"}`` line on the ready channel every HEARTBEAT_S, from process start
    until the ready line: engine build and warm-up can take minutes, a stopped process none."""

    def __init__(self, ready_fd: int) -> None:
        self._fd = ready_fd
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="producer-start-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        line = READY_PROGRESS_LINE + b"\n"
        while not self._stopped.wait(HEARTBEAT_S):
            try:
                os.write(self._fd, line)
            except OSError:
                return  # the harness closed the channel: it is no longer waiting

    def stop(self) -> None:
        """No beat after this returns (the ready line must be the channel's last line)."""
        self._stopped.set()
        self._thread.join()


def _log(message: str) -> None:
    """One line on stderr; never raises: with the harness gone its pipe fails (EPIPE), and a
    failed log line must not stop the exit that follows it."""
    try:
        print(f"producer: {one_line(message)}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


class ProducerService:
    """Admits connections concurrently and serves one authenticated client at a time; fails
    closed (exit 75) as the module says."""

    def __init__(
        self,
        *,
        engine: Engine,
        config: ServiceConfig,
        key: bytes,
        expectation: ProducerExpectation,
        cache_identity: str,
        listener: socket.socket,
        address: str,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.engine = engine
        self.tls = tls
        # The run id handoffs are sealed under: --run-id, else the current client's (see _converse).
        self.run_id = config.run_id if config.run_id is not None else WARMUP_RUN_ID
        self.config = config
        self.key = key
        self.expectation = expectation
        self.cache_identity = cache_identity
        self.listener = listener
        self.address = address
        self.send_lock = threading.Lock()
        self.non_engine_errors = 0
        self.admissions = Admissions()
        # Authenticated connections (socket, run id), served in turn by serve().
        self.authenticated: queue.Queue[tuple[socket.socket, str]] = queue.Queue()
        self.requests_served = 0
        self._host_facts: dict[str, Any] | None = None
        # Beats on the ready channel from start to the ready line (see StartHeartbeat).
        self.start_heartbeat: StartHeartbeat | None = None

    def host_facts(self) -> dict[str, Any]:
        """This process's host facts, taken once (after the warm-up, when ``main`` asks first)."""
        if self._host_facts is None:
            self._host_facts = host_facts()
        return self._host_facts

    # -- exits ---------------------------------------------------------------------------------

    def cleanup(self) -> None:
        """Close the listener and remove the socket file (best effort)."""
        try:
            self.listener.close()
        except OSError:
            pass
        if self.config.socket_path is not None:
            try:
                if stat.S_ISSOCK(self.config.socket_path.lstat().st_mode):
                    self.config.socket_path.unlink()
            except OSError:
                pass

    def exit_now(self, status: int, message: str) -> NoReturn:
        """Log one line, remove the socket, and leave without running anything else."""
        _log(f"{message} (exit {status})")
        self.cleanup()
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass  # the harness's end of the pipe is gone: leave all the same
        os._exit(status)

    def send_error(self, conn: socket.socket | None, op: str, message: str, *,
                   request_id: str | None = None, exiting: int | None = None,
                   lock_timeout_s: float = -1) -> None:
        """Best-effort error frame (never raises)."""
        if conn is None:
            return
        header: FrameHeader = {"op": op, "status": "error", "error": one_line(message)}
        if request_id is not None:
            header["request_id"] = request_id
        if exiting is not None:
            header["exit_status"] = exiting
        if not self.send_lock.acquire(timeout=lock_timeout_s):
            return
        try:
            conn.settimeout(5.0)
            conn.sendall(encode_frame_header(header))
        except OSError:
            pass
        finally:
            self.send_lock.release()

    # -- watchdog ------------------------------------------------------------------------------

    def guarded(self, label: str, work: Callable[[], _T], conn: socket.socket | None,
                request_id: str | None = None, *, beat: Callable[[], None] | None = None) -> _T:
        """Run ``work`` under the watchdog, calling ``beat`` every HEARTBEAT_S while it runs (the
        consumer's evidence that this process is not stopped); on expiry report the error and
        exit 75."""
        results: list[_T] = []
        errors: list[BaseException] = []

        def target() -> None:
            try:
                results.append(work())
            except BaseException as exc:  # handed to the serving thread below
                errors.append(exc)

        worker = threading.Thread(target=target, name=f"producer-{label}", daemon=True)
        faulthandler.dump_traceback_later(self.config.watchdog_s + BACKSTOP_GRACE_S, exit=True)
        worker.start()
        give_up = time.monotonic() + self.config.watchdog_s
        while worker.is_alive() and time.monotonic() < give_up:
            worker.join(min(HEARTBEAT_S, max(give_up - time.monotonic(), 0.0)))
            if worker.is_alive() and beat is not None:
                beat()
        faulthandler.cancel_dump_traceback_later()
        if worker.is_alive():
            message = f"watchdog: {label} did not finish within {self.config.watchdog_s:g} s"
            self.send_error(conn, "prefill", message, request_id=request_id,
                            exiting=EXIT_TEMPFAIL, lock_timeout_s=1.0)
            self.exit_now(EXIT_TEMPFAIL, message)
        if errors:
            raise errors[0]
        return results[0]

    # -- start ---------------------------------------------------------------------------------

    def warm_up(self) -> float:
        """A real prefill and seal of a short prompt; readiness means this completed."""
        limit = self.engine.geometry.max_positions
        # The warm-up hands off at least one position and keeps one token past them (a whole-block
        # lane hands off nothing below one block, so it warms up past its first block).
        first = next((n for n in range(1, limit + 1) if handed_off_positions(self.config.lane, n) >= 1), limit)
        count = min(max(self.config.warmup_tokens, first + 1), limit)
        tokens = np.arange(count, dtype=np.int64) % self.engine.geometry.vocab
        started = time.perf_counter()
        try:
            self.guarded("warm-up prefill", lambda: self._prefill_and_seal(tokens, "warmup"), None)
        except StartRefused:
            raise
        except Exception as exc:
            self.exit_now(EXIT_TEMPFAIL, f"warm-up prefill failed: {type(exc).__name__}: {exc}")
        return time.perf_counter() - started

    def _prefill_and_seal(
        self, tokens: np.ndarray, request_id: str
    ) -> tuple[SealedHandoff, float, float]:
        """Prefill, check the KV geometry, seal; returns (sealed, compute_s, seal_s)."""
        started = time.perf_counter()
        kv = self.engine.prefill(tokens)
        compute_s = time.perf_counter() - started
        geometry = kv.geometry
        positions = handed_off_positions(self.config.lane, len(tokens))
        wanted = self.engine.geometry.kv_geometry(positions, self.expectation.kv_dtype)
        if geometry != wanted:
            raise StartRefused(
                f"engine prefill geometry: produced {geometry.as_dict()}, expected {wanted.as_dict()}"
            )
        sealed = seal_handoff_parts(
            kv,
            key=self.key,
            identity_sha256=self.expectation.identity_sha256,
            target_cache_identity=self.cache_identity,
            producer_mode=self.config.mode,
            lane=self.config.lane,
            # The manifest names the tokens whose KV it carries (whole blocks for vLLM).
            prompt_sha256=prompt_sha256(tokens[:positions]),
            run_id=self.run_id,
            request_id=request_id,
            compute_s=compute_s,
        )
        return sealed, compute_s, time.perf_counter() - started - compute_s

    def announce_ready(self, warmup_s: float) -> None:
        if self.start_heartbeat is not None:
            self.start_heartbeat.stop()
        line = canonical_json_bytes({
            "event": "ready",
            "protocol": PROTOCOL,
            "pid": os.getpid(),
            "address": self.address,
            "lane": self.config.lane,
            "producer_mode": self.config.mode.value,
            "key_id": handoff_key_id(self.key),
            "warmup_s": warmup_s,
        }) + b"\n"
        if self.config.ready_fd is None:
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
        else:
            with os.fdopen(self.config.ready_fd, "wb", closefd=True) as stream:
                stream.write(line)

    # -- serving -------------------------------------------------------------------------------

    def serve(self) -> int:
        """Admit connections on other threads and serve the authenticated ones in turn until
        ``shutdown``; returns the exit status (0)."""
        threading.Thread(target=self._accept_forever, name="producer-accept", daemon=True).start()
        threading.Thread(target=self._expire_forever, name="producer-expire", daemon=True).start()
        while True:
            conn, run_id = self.authenticated.get()
            if self.config.run_id is None:
                self.run_id = run_id
            with conn:
                if self._serve_connection(conn):
                    self.cleanup()
                    return EXIT_OK

    def _accept_forever(self) -> None:
        while True:
            try:
                accepted, peer = self.listener.accept()
            except OSError:  # the listener closed (cleanup): nothing more to admit
                return
            _tune(accepted)
            peer_address = peer[0] if isinstance(peer, tuple) else "local"
            entry, displaced = self.admissions.enter(accepted, peer_address)
            for other in displaced:
                _log(f"admission: a connection of {other.peer} displaced by a newer one (admission bound)")
            threading.Thread(target=self._admit, args=(entry,), name="producer-admit", daemon=True).start()

    def _expire_forever(self) -> None:
        while True:
            time.sleep(EXPIRY_SWEEP_S)
            for entry in self.admissions.expire():
                _log(f"admission: {entry.peer} not authenticated within {self.admissions.seconds:g} s; "
                     "connection dropped")

    def _admit(self, entry: Admitting) -> None:
        """TLS, hello and auth for one connection under its admission deadline; an authenticated
        one joins the queue serve() takes from, any other is closed."""
        conn: socket.socket | None = None
        run_id: str | None = None
        # Every read and write of the admission waits at most its whole deadline; the sweeper
        # (_expire_forever) cuts a peer that trickles bytes to stay inside each one.
        entry.sock.settimeout(self.admissions.seconds)
        try:
            conn = self._secured(entry)
            run_id = None if conn is None else self._authenticate(conn, entry)
        except OSError:  # dropped (displaced or late), or the peer left mid-way
            pass
        except Exception as exc:  # one connection's admission never takes the producer down
            _log(f"admission of {entry.peer}: {type(exc).__name__}: {one_line(str(exc))}; connection dropped")
        finally:
            self.admissions.leave(entry)
        if run_id is None or entry.dropped:
            try:
                entry.sock.close()
            except OSError:
                pass
            return
        assert conn is not None
        self.authenticated.put((conn, run_id))

    def _secured(self, entry: Admitting) -> socket.socket | None:
        """``entry``'s socket itself without TLS; else its TLS side once the handshake (the
        client's certificate verified against --tls-client-ca) completes. A client that fails or
        stalls it is dropped, logged, and counts for nothing: it never reached the protocol."""
        if self.tls is None:
            return entry.sock
        wrapped = self.tls.wrap_socket(entry.sock, server_side=True, do_handshake_on_connect=False)
        entry.sock = wrapped  # the TLS socket keeps the plain one's timeout
        if entry.dropped:  # displaced while the socket changed hands
            entry.drop()
        try:
            wrapped.do_handshake()
        except (ssl.SSLError, OSError) as exc:
            if not entry.dropped:
                reason = getattr(exc, "reason", None) or type(exc).__name__
                _log(f"TLS handshake with {entry.peer} failed ({reason}); connection dropped")
            return None
        return wrapped

    def _authenticate(self, conn: socket.socket, entry: Admitting) -> str | None:
        """hello, then the client's auth frame, by ``entry``'s deadline: the run id it proved it
        holds the run key for, or None (an error frame sent where the peer said something)."""
        nonce = secrets.token_bytes(32)
        conn.sendall(encode_frame_header({"op": "hello", "protocol": PROTOCOL, "nonce": nonce.hex(),
                                          "key_id": handoff_key_id(self.key)}))
        try:
            auth = _read_header(conn, self.admissions.seconds, self.admissions.seconds)
        except (_PeerGone, _BadFrame):
            return None
        proof = auth.get("mac") if auth.get("op") == "auth" else None
        run_id = auth.get("run_id")
        problem = None
        if not isinstance(run_id, str) or not ID_PATTERN.fullmatch(run_id):
            problem = f"auth run_id: found {str(run_id)[:80]!r}, expected an id"
        else:
            try:
                proof_bytes = bytes.fromhex(proof) if isinstance(proof, str) else b""
            except ValueError:
                proof_bytes = b""
            if not hmac.compare_digest(proof_bytes, client_auth_mac(self.key, nonce, run_id)):
                problem = "client authentication failed (wrong run key?)"
            elif self.config.run_id is not None and run_id != self.config.run_id:
                problem = f"auth run_id: found {run_id!r}, this producer serves run {self.config.run_id!r}"
        if problem is not None:
            _log(f"auth from {entry.peer}: {problem}; connection dropped")
            conn.sendall(encode_frame_header({"op": "auth", "status": "error", "error": one_line(problem)}))
            return None
        conn.sendall(encode_frame_header({"op": "auth", "status": "ok"}))
        assert isinstance(run_id, str)
        return run_id

    def _non_engine_error(self, conn: socket.socket, op: str, message: str) -> None:
        self.non_engine_errors += 1
        _log(f"{op}: {message}")
        if self.non_engine_errors >= MAX_NON_ENGINE_ERRORS:
            self.send_error(conn, op, message, exiting=EXIT_TEMPFAIL)
            self.exit_now(EXIT_TEMPFAIL, f"{MAX_NON_ENGINE_ERRORS} consecutive non-engine errors")
        self.send_error(conn, op, message)

    def _serve_connection(self, conn: socket.socket) -> bool:
        """One client: hello/auth, then requests. Returns True after ``shutdown``."""
        try:
            return self._converse(conn)
        except OSError as exc:  # the client vanished between requests: wait for the next one
            _log(f"connection lost ({type(exc).__name__})")
            return False

    def _converse(self, conn: socket.socket) -> bool:
        """An authenticated client's requests, until it leaves (False) or asks ``shutdown`` (True)."""
        while True:
            try:
                request = self._read_frame(conn)
            except _PeerGone:
                return False
            except (_BadFrame, OSError) as exc:
                self._non_engine_error(conn, "frame", str(exc))
                return False
            op = request["op"]
            if op == "ready?":
                self.non_engine_errors = 0
                self._send(conn, {
                    "op": "ready", "status": "ok", "ready": True, "lane": self.config.lane,
                    "producer_mode": self.config.mode.value, "engine": self.engine.name,
                    "engine_version": self.engine.version, "run_id": self.run_id,
                    "requests_served": self.requests_served, "host": self.host_facts(),
                })
            elif op == "prefill":
                self._handle_prefill(conn, request)
            elif op == "shutdown":
                self._send(conn, {"op": "shutdown", "status": "ok"})
                _log("shutdown requested")
                return True
            else:
                self._non_engine_error(conn, op, f"unknown op {op!r}")

    def _handle_prefill(self, conn: socket.socket, request: FrameHeader) -> None:
        request_id = request.get("request_id")
        tokens = request.get("tokens")
        geometry = self.engine.geometry
        problem = None
        if set(request) != {"op", "request_id", "tokens"}:
            problem = f"prefill fields {sorted(request)}, expected op, request_id, tokens"
        elif not isinstance(request_id, str) or not ID_PATTERN.fullmatch(request_id):
            problem = f"request_id {request_id!r} is not an id"
        elif not isinstance(tokens, list) or not 1 <= len(tokens) <= geometry.max_positions:
            problem = f"tokens: expected a list of 1..{geometry.max_positions} token ids"
        elif not all(type(t) is int and 0 <= t < geometry.vocab for t in tokens):
            problem = f"tokens: every id must be an integer in [0, {geometry.vocab})"
        if problem is not None:
            self._non_engine_error(conn, "prefill", problem)
            return
        self.non_engine_errors = 0
        token_array = np.asarray(tokens, dtype=np.int64)
        assert isinstance(request_id, str)

        answering = threading.Event()
        started = time.monotonic()

        def work() -> None:
            sealed, compute_s, seal_s = self._prefill_and_seal(token_array, request_id)
            header = {
                "op": "handoff", "status": "ok", "request_id": request_id,
                "blobs": [len(sealed.manifest_bytes), len(sealed.mac), sealed.payload_size],
                "compute_s": compute_s, "seal_s": seal_s,
            }
            with self.send_lock:
                answering.set()  # no heartbeat may follow the answer's first byte
                conn.settimeout(None)
                conn.sendall(encode_frame_header(header))
                conn.sendall(sealed.manifest_bytes)
                conn.sendall(sealed.mac)
                for part in sealed.payload_parts:
                    conn.sendall(part)

        def beat() -> None:
            # Skipped while the answer is being sent (its bytes are the progress then).
            if not self.send_lock.acquire(blocking=False):
                return
            try:
                if not answering.is_set():
                    conn.settimeout(FRAME_STALL_S)
                    conn.sendall(encode_frame_header({
                        "op": "progress", "request_id": request_id,
                        "elapsed_s": round(time.monotonic() - started, 3)}))
            except OSError:
                pass  # the client is gone; the answer's send reports it
            finally:
                self.send_lock.release()

        try:
            self.guarded(f"prefill {request_id}", work, conn, request_id, beat=beat)
        except Exception as exc:
            message = f"prefill {request_id} failed: {type(exc).__name__}: {exc}"
            self.send_error(conn, "prefill", message, request_id=request_id,
                            exiting=EXIT_TEMPFAIL, lock_timeout_s=1.0)
            self.exit_now(EXIT_TEMPFAIL, message)
        self.requests_served += 1

    def _send(self, conn: socket.socket, header: Mapping[str, Any]) -> None:
        with self.send_lock:
            conn.settimeout(FRAME_STALL_S)
            conn.sendall(encode_frame_header(header))

    def _read_frame(self, conn: socket.socket) -> FrameHeader:
        """The next request: waited for as long as the client likes (between requests it decodes),
        then the rest of the frame within FRAME_STALL_S."""
        return _read_header(conn, None, FRAME_STALL_S)


def _read_header(conn: socket.socket, first_wait: float | None, stall_s: float) -> FrameHeader:
    """One frame header from ``conn``: its first bytes within ``first_wait`` seconds (None: no
    limit), each later read within ``stall_s`` seconds."""
    conn.settimeout(first_wait)
    first = conn.recv(FRAME_LENGTH.size)
    if not first:
        raise _PeerGone()
    conn.settimeout(stall_s)
    prefix = first + _recv_exact(conn, FRAME_LENGTH.size - len(first))
    (length,) = FRAME_LENGTH.unpack(prefix)
    if length > MAX_HEADER_BYTES:
        raise _BadFrame(f"frame header of {length} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = decode_frame_header(_recv_exact(conn, length))
    except Refused as exc:
        raise _BadFrame(str(exc)) from None
    if header.get("blobs"):
        raise _BadFrame("requests carry no blobs")
    return header


def _recv_exact(conn: socket.socket, count: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < count:
        chunk = conn.recv(count - len(chunks))
        if not chunk:
            raise _BadFrame("connection closed inside a frame")
        chunks += chunk
    return bytes(chunks)


def _tune(conn: socket.socket) -> None:
    """Larger socket buffers: fewer wake-ups when moving hundreds of megabytes."""
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            conn.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        except OSError:
            pass


# -- dying with the harness ----------------------------------------------------------------
# The harness starts the producer in its own session (so a terminal's or CI's process-group signal
# reaches the harness, which then stops the producer itself); these are the ties that end the
# producer when the harness cannot: it was SIGKILLed, or died some other way.

PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal the kernel sends this process when its parent thread dies."""
STDIN_CLOSED_LINE = b"producer: stdin closed (parent gone); exiting\n"


def _set_parent_death_signal(signum: int) -> bool:
    """Ask the kernel for ``signum`` when the parent dies (Linux prctl); False where there is none."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        answer = libc.prctl(ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(signum), ctypes.c_ulong(0),
                            ctypes.c_ulong(0), ctypes.c_ulong(0))
    except (OSError, AttributeError):
        return False
    return int(answer) == 0


def die_with_parent(parent_pid: int) -> bool:
    """Have the kernel SIGKILL this process when ``parent_pid``, its parent, dies (Linux
    PR_SET_PDEATHSIG), and refuse at once if that parent is already gone (it died before the
    request, so no signal will ever come: the parent is then init or a subreaper). Returns
    whether the kernel took the request; elsewhere only ``--exit-with-stdin`` ties the two."""
    armed = _set_parent_death_signal(signal.SIGKILL)
    parent_now = os.getppid()  # after the request: a parent dying from here on sends the signal
    if parent_now != parent_pid:
        raise StartRefused(f"--parent-pid: found {parent_pid}, this process's parent is {parent_now} "
                           f"(the harness that started it is gone)")
    return armed


def _last_word(line: bytes) -> None:
    """Write ``line`` to stderr if that cannot block or raise: a pipe is written without blocking
    (its reader may be gone, or alive and no longer reading, or another thread may be blocked
    writing to it), a regular file plainly, anything else (a terminal) not at all."""
    try:
        mode = os.fstat(2).st_mode
        if stat.S_ISFIFO(mode):
            os.set_blocking(2, False)  # the process is leaving: nothing else here writes after this
        elif not stat.S_ISREG(mode):
            return
        os.write(2, line)
    except OSError:
        pass


def watch_stdin(fd: int = 0) -> NoReturn:
    """Block until ``fd`` ends (EOF, or any error reading it: the harness closed it or died), then
    leave at once with status 0. Nothing can stop the exit: it runs in ``finally`` after a last
    word that can neither block nor raise (a stderr pipe without a reader once killed this
    thread before it reached ``os._exit``, leaving the producer orphaned)."""
    try:
        while os.read(fd, 4096):  # the raw fd: no buffered-reader lock at interpreter exit
            pass
    finally:
        try:
            _last_word(STDIN_CLOSED_LINE)
        finally:
            os._exit(EXIT_OK)


def exit_when_stdin_closes() -> None:
    """Start the thread that ends this process when the harness's end of stdin closes
    (:func:`watch_stdin`)."""
    threading.Thread(target=watch_stdin, name="producer-stdin-watch", daemon=True).start()


def _faultable(built: Engine, fault: str) -> LaneEngine:
    """Faults wrap the factory's LaneEngines only (they keep its mode and cache identity)."""
    if not isinstance(built, LaneEngine):
        raise StartRefused(f"--fault {fault}: the engine factory built {type(built).__name__}, expected a LaneEngine")
    return built


def _with_fault(build: EngineFactory, engine: Engine, lane: str, mode: ProducerMode, fault: str) -> Engine:
    """``engine`` serving the named fault; ``other-mode`` makes its entries with the lane's engine
    built in the other producer mode."""
    other = None
    if fault == "other-mode":
        other_mode = ProducerMode.NATIVE if mode is ProducerMode.EXACT else ProducerMode.EXACT
        other = _faultable(build(lane, other_mode), fault)
    return faulty_producer(_faultable(engine, fault), fault, other)


def refused_to_start(refusal: StartRefused) -> int:
    """Log a start refusal in the producer's one line and return the exit status it means (2)."""
    _log(f"refused to start: {refusal}")
    return EXIT_REFUSED


def serve(config: ServiceConfig, *, factory: EngineFactory | None = None) -> int:
    """Run the producer service under ``config``; returns its exit status (75 exits happen in
    place; a start refused before serving is logged and returns 2)."""
    heartbeat: StartHeartbeat | None = None
    try:
        if config.parent_pid is not None:
            die_with_parent(config.parent_pid)
        if config.ready_fd is not None:
            heartbeat = StartHeartbeat(config.ready_fd)
        key = read_run_key(config.key_source)
        expectation = load_expectation(config.expect_path)
        if config.exit_with_stdin:
            exit_when_stdin_closes()
        build = factory if factory is not None else load_factory(config.engine_factory)
        try:
            if config.model is not None:
                from qualify.engines.chosen_model import use_model

                use_model(config.model)
            engine = honest = build(config.lane, config.mode)
            if config.fault is not None:
                engine = _with_fault(build, engine, config.lane, config.mode, config.fault)
        except Refused as exc:
            raise StartRefused(one_line(f"engine build for lane {config.lane}: {exc}")) from None
        except Exception as exc:
            raise StartRefused(one_line(
                f"engine build for lane {config.lane} failed: {type(exc).__name__}: {exc}"
            )) from None
        cache_identity = check_engine(engine, mode=config.mode, expectation=expectation)
        if expectation.engine_kat_sha256 is not None:
            from qualify.engines.kat import check_known_answer

            try:  # the honest engine's arithmetic, not an injected fault's
                check_known_answer(honest, expectation.engine_kat_sha256, "producer")
            except Refused as exc:
                raise StartRefused(one_line(str(exc))) from None
        tls = None
        if config.tls is not None:
            cert, tls_key, client_ca = config.tls
            try:
                tls = server_context(cert=cert, key=tls_key, client_ca=client_ca)
            except Refused as exc:
                raise StartRefused(one_line(f"TLS: {exc}")) from None
        if config.socket_path is not None:
            listener = bind_unix(config.socket_path)
            address = f"unix:{config.socket_path}"
        else:
            assert config.port is not None
            listener = bind_tcp(config.host, config.port)
            host, port = listener.getsockname()[:2]
            address = f"{'tcp' if tls is None else 'tls'}:{host}:{port}"
    except StartRefused as exc:
        return refused_to_start(exc)
    service = ProducerService(engine=engine, config=config, key=key, expectation=expectation,
                              cache_identity=cache_identity, listener=listener, address=address, tls=tls)
    service.start_heartbeat = heartbeat
    try:
        warmup_s = service.warm_up()
    except StartRefused as exc:
        service.cleanup()
        return refused_to_start(exc)
    service.host_facts()  # after the warm-up: the BLAS pools it started, not an idle process's
    _log(f"ready on {address} (lane {config.lane}, mode {config.mode.value}, warm-up {warmup_s:.3f} s)")
    service.announce_ready(warmup_s)
    return service.serve()

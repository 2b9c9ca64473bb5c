"""A resident producer, supervised: ``qualify producer supervise`` and ``qualify producer health``.

``producer serve`` exits 75 after any error that touched its engine, by design, and then stays
down. The supervisor (issue #38, item 2) brings it back or fails closed:

* **Readiness is a signed startup receipt**, never process liveness: the producer writes its ready
  line only after its model is loaded and its warm-up prefill sealed; the supervisor then writes
  ``startup/startup.json`` (the ready line, the producer's pid, when it started and became ready)
  and ``startup/startup.sig.json`` (the operator's Ed25519 signature over its bytes) into the state
  directory, and only then records ``ready`` in ``state.json``.
* **The restart ritual**, before every start: the stale startup receipt is moved aside into
  ``stale/`` under a UTC timestamp (never deleted), a Unix socket nobody listens on is removed,
  then the producer starts again. (The producer keeps no other state on disk: its caches are in
  memory and die with it; ``producer.log`` keeps every start's lines, each start headed.)
* **Backoff and latch**: a producer that exits without having stayed ready ``stable_s`` seconds is
  a consecutive failure; the wait before the next start doubles per consecutive failure, and at
  ``failures_to_latch`` (default 3) the supervisor latches off: ``latched.json`` records why, with
  the producer's last log lines, it prints them, and exits :data:`EXIT_LATCHED`. A latched state
  directory is never started again until the operator moves ``latched.json`` aside: no flapping.
* **Health** (:func:`health`): up, ready, latched, and the identity the startup receipt names
  (lane, producer mode, run-key id, address, pid), its signature checked against a trust file.

May import every layer below :mod:`qualify.run`; the command lines are in
:mod:`qualify.interfaces.producer_command`.
"""

from __future__ import annotations

import base64
import datetime as _dt
import fcntl
import json
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from qualify.archive.keys import SigningKey, TrustFile
from qualify.core.digests import canonical_json_bytes
from qualify.core.errors import Refused, one_line
from qualify.handoff.protocol import PRODUCER_MODULE

EXIT_STOPPED = 0  # stopped by a signal to the supervisor (the producer stopped with it)
EXIT_LATCHED = 69  # EX_UNAVAILABLE: latched off after consecutive failures; no restart until reset
EXIT_NOT_READY = 1  # health: up but not ready, or the supervisor is gone

STATE_FILE = "state.json"
LATCH_FILE = "latched.json"
STARTUP_DIR = "startup"
STARTUP_FILE = "startup.json"
SIGNATURE_FILE = "startup.sig.json"
STALE_DIR = "stale"
PRODUCER_LOG = "producer.log"
LOCK_FILE = "supervisor.lock"
STARTUP_SCHEMA = "trust-ladder.producer-startup.v1"
LOG_LINES_KEPT = 20
MAX_BACKOFF_S = 300.0
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class SupervisorConfig:
    """What ``producer supervise`` was given: the ``producer serve`` arguments it starts the
    producer with, its state directory and its restart policy."""

    serve_argv: tuple[str, ...]
    state_dir: Path
    socket_path: Path | None = None
    failures_to_latch: int = 3
    first_backoff_s: float = 1.0
    stable_s: float = 60.0
    ready_timeout_s: float = 1800.0


def _utc(moment: float | None = None) -> str:
    return _dt.datetime.fromtimestamp(time.time() if moment is None else moment, _dt.UTC).isoformat(
        timespec="milliseconds").replace("+00:00", "Z")


def _write_whole(path: Path, data: bytes) -> None:
    """``data`` at ``path``, whole or not at all (a reader never sees a partial file)."""
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    partial.write_bytes(data)
    os.replace(partial, path)


def _say(message: str) -> None:
    print(f"qualify producer supervise: {one_line(message)}", file=sys.stderr, flush=True)


def write_state(state_dir: Path, status: str, **facts: Any) -> None:
    """``state.json``: the supervisor's status and facts, this process its supervisor (replaced whole)."""
    document = {"schema": "trust-ladder.producer-supervisor-state.v1", "status": status, "utc": _utc(),
                "supervisor_pid": os.getpid(), **facts}
    _write_whole(state_dir / STATE_FILE, canonical_json_bytes(document) + b"\n")


def write_startup_receipt(state_dir: Path, key: SigningKey, ready: dict[str, Any], *, started: float,
                          restarts: int, serve_argv: tuple[str, ...]) -> dict[str, Any]:
    """``startup/``: the producer's ready line and when it started and became ready, signed by
    ``key`` (a directory renamed into place whole); returns the signed document."""
    document = {"schema": STARTUP_SCHEMA, "ready": ready, "producer_pid": ready["pid"],
                "started_utc": _utc(started), "ready_utc": _utc(), "supervisor_pid": os.getpid(),
                "restarts": restarts, "serve_arguments": list(serve_argv)}
    data = canonical_json_bytes(document) + b"\n"
    signature = {"keyid": key.key_id, "sig": base64.b64encode(key.sign(data)).decode("ascii")}
    partial = state_dir / f".{STARTUP_DIR}.partial-{os.getpid()}"
    partial.mkdir()
    (partial / STARTUP_FILE).write_bytes(data)
    (partial / SIGNATURE_FILE).write_bytes(canonical_json_bytes(signature) + b"\n")
    os.replace(partial, state_dir / STARTUP_DIR)
    return document


@dataclass
class Supervisor:
    """One supervised producer in ``config.state_dir`` (see the module docstring)."""

    config: SupervisorConfig
    key: SigningKey
    failures: int = 0
    restarts: int = 0
    stopping: int | None = None  # the signal that asked the supervisor to stop

    # -- files ---------------------------------------------------------------------------------

    def _path(self, name: str) -> Path:
        return self.config.state_dir / name

    def _state(self, status: str, **facts: Any) -> None:
        write_state(self.config.state_dir, status, consecutive_failures=self.failures, restarts=self.restarts,
                    **facts)

    def _last_log_lines(self) -> list[str]:
        try:
            with self._path(PRODUCER_LOG).open("r", encoding="utf-8", errors="replace") as log:
                return [line.rstrip("\n") for line in deque(log, maxlen=LOG_LINES_KEPT)]
        except OSError:
            return []

    def _restart_ritual(self) -> None:
        """The stale startup receipt moved aside under a timestamp, a stale socket removed."""
        startup = self._path(STARTUP_DIR)
        if startup.exists():
            stale = self._path(STALE_DIR)
            stale.mkdir(exist_ok=True)
            stamp = _utc().replace(":", "").replace("-", "")
            startup.rename(stale / f"{STARTUP_DIR}-{stamp}-{self.restarts}")
        socket_path = self.config.socket_path
        if socket_path is not None:
            try:
                if stat.S_ISSOCK(socket_path.lstat().st_mode) and not socket_in_use(socket_path):
                    socket_path.unlink()
            except FileNotFoundError:
                pass

    # -- the producer --------------------------------------------------------------------------

    def _start(self) -> tuple[subprocess.Popen[bytes], float]:
        argv = [sys.executable, "-P", "-m", PRODUCER_MODULE, *self.config.serve_argv, "--parent-pid", str(os.getpid())]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                          env.get("PYTHONPATH")]))
        with self._path(PRODUCER_LOG).open("ab") as log:
            log.write(f"--- supervisor: start {self.restarts + 1} at {_utc()} ---\n".encode())
            log.flush()
            child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                                     start_new_session=True, env=env)
        return child, time.time()

    def _await_ready(self, child: subprocess.Popen[bytes]) -> dict[str, Any] | None:
        """The producer's ready document, or None when it exited, stalled past the timeout or
        said something else first."""
        assert child.stdout is not None
        give_up = time.monotonic() + self.config.ready_timeout_s
        line = b""
        while self.stopping is None and time.monotonic() < give_up:
            readable, _, _ = select.select([child.stdout], [], [], 0.2)
            if not readable:
                continue
            chunk = os.read(child.stdout.fileno(), 65536)
            if not chunk:
                return None
            line += chunk
            if b"\n" in line:
                break
        else:
            return None
        try:
            ready = json.loads(line.split(b"\n", 1)[0])
        except ValueError:
            return None
        return ready if isinstance(ready, dict) and ready.get("event") == "ready" \
            and ready.get("pid") == child.pid else None

    def _wait_exit(self, child: subprocess.Popen[bytes]) -> int:
        while self.stopping is None:
            try:
                return child.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                continue
        return self._stop_child(child)

    def _stop_child(self, child: subprocess.Popen[bytes]) -> int:
        if child.poll() is None:
            child.terminate()
            try:
                return child.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                child.kill()
        return child.wait()

    def _backoff(self) -> None:
        wait = min(self.config.first_backoff_s * 2 ** (self.failures - 1), MAX_BACKOFF_S)
        self._state("backing-off", wait_s=wait)
        give_up = time.monotonic() + wait
        while self.stopping is None and time.monotonic() < give_up:
            time.sleep(min(0.1, max(give_up - time.monotonic(), 0.0)))

    def _latch(self, why: str) -> int:
        lines = self._last_log_lines()
        document = {"schema": "trust-ladder.producer-latch.v1", "utc": _utc(), "reason": why,
                    "consecutive_failures": self.failures, "last_log_lines": lines}
        _write_whole(self._path(LATCH_FILE), canonical_json_bytes(document) + b"\n")
        self._state("latched", reason=why)
        _say(f"latched off: {why}; {self._path(LATCH_FILE)} says so, and the producer is not started "
             f"again until that file is moved aside; its last log lines:")
        for line in lines:
            print(f"  {line}", file=sys.stderr)
        return EXIT_LATCHED

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.stopping = signum

    def run(self) -> int:
        """Start, await readiness, restart, back off, latch; returns the exit status."""
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._on_signal)
        while True:
            self._restart_ritual()
            self._state("starting")
            child, started = self._start()
            ready = self._await_ready(child)
            became_ready = time.monotonic()
            if ready is not None and self.stopping is None:
                startup = write_startup_receipt(self.config.state_dir, self.key, ready, started=started,
                                                restarts=self.restarts, serve_argv=self.config.serve_argv)
                self._state("ready", producer_pid=child.pid, address=ready.get("address"),
                            lane=ready.get("lane"), producer_mode=ready.get("producer_mode"),
                            key_id=ready.get("key_id"), ready_utc=startup["ready_utc"])
                code = self._wait_exit(child)
            else:
                code = self._stop_child(child)
            if child.stdout is not None:
                child.stdout.close()
            if self.stopping is not None:
                self._restart_ritual()
                self._state("stopped", signal=self.stopping)
                return EXIT_STOPPED
            stable = ready is not None and time.monotonic() - became_ready >= self.config.stable_s
            self.failures = 0 if stable else self.failures + 1
            how = f"exit {code}" if code >= 0 else f"signal {-code}"
            what = "after" if ready is not None else "before"
            _say(f"producer pid {child.pid} ended ({how}) {what} becoming ready")
            if self.failures >= self.config.failures_to_latch:
                return self._latch(f"{self.failures} consecutive failures, the last {how} {what} "
                                   f"becoming ready")
            self.restarts += 1
            if self.failures:
                self._backoff()
                if self.stopping is not None:
                    self._state("stopped", signal=self.stopping)
                    return EXIT_STOPPED


def supervise(config: SupervisorConfig, key: SigningKey) -> int:
    """``producer supervise``: refused (:data:`EXIT_LATCHED`) on a latched state directory, else
    supervised until a signal stops it or it latches."""
    config.state_dir.mkdir(parents=True, exist_ok=True)
    latch = config.state_dir / LATCH_FILE
    if latch.exists():
        _say(f"latched: {latch} records an earlier latch; move it aside (after fixing its cause) to start again")
        return EXIT_LATCHED
    with (config.state_dir / LOCK_FILE).open("a") as lock:
        try:  # one supervisor per state directory, held for its whole life (released when it exits)
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise Refused(f"--state-dir {config.state_dir}: another supervisor is running there") from None
        return Supervisor(config, key).run()


# --------------------------------------------------------------------------- health


@dataclass(frozen=True)
class Health:
    """What ``producer health`` found: the status word, its exit code and the facts behind it."""

    status: str  # ready | starting | backing-off | stopped | down | latched
    exit_code: int
    facts: dict[str, Any]

    def document(self) -> dict[str, Any]:
        return {"schema": "trust-ladder.producer-health.v1", "status": self.status,
                "up": self.status not in ("down", "stopped", "latched"), "ready": self.status == "ready",
                "latched": self.status == "latched", **self.facts}


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or isinstance(pid, bool) or pid < 1:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        document = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise Refused(f"{what} {path}: missing") from None
    except (OSError, ValueError) as exc:
        raise Refused(f"{what} {path}: unreadable ({type(exc).__name__})") from None
    if not isinstance(document, dict):
        raise Refused(f"{what} {path}: expected a JSON object")
    return document


def verified_startup(state_dir: Path, trust: TrustFile) -> dict[str, Any]:
    """The startup receipt's document, its signature verified by a key ``trust`` holds unrevoked;
    refused in one line otherwise."""
    directory = state_dir / STARTUP_DIR
    data_path = directory / STARTUP_FILE
    try:
        data = data_path.read_bytes()
    except OSError:
        raise Refused(f"startup receipt {data_path}: missing") from None
    signature = _read_json(directory / SIGNATURE_FILE, "startup signature")
    trusted = trust.get(str(signature.get("keyid")))
    if trusted is None or trusted.revoked is not None:
        raise Refused(f"startup receipt {data_path}: signed by key {str(signature.get('keyid'))[:16]}…, "
                      f"which {trust.source} does not trust")
    try:
        trusted.public_key().verify(base64.b64decode(str(signature.get("sig")), validate=True), data)
    except Exception:  # cryptography's InvalidSignature, or a signature that is not base64
        raise Refused(f"startup receipt {data_path}: the signature does not verify") from None
    document = json.loads(data)
    if not isinstance(document, dict) or document.get("schema") != STARTUP_SCHEMA:
        raise Refused(f"startup receipt {data_path}: not a {STARTUP_SCHEMA} document")
    return document


def health(state_dir: Path, trust: TrustFile) -> Health:
    """Up, ready, latched, and the identity the startup receipt names (see the module docstring)."""
    if (state_dir / LATCH_FILE).exists():
        latch = _read_json(state_dir / LATCH_FILE, "latch")
        return Health("latched", EXIT_LATCHED, {"reason": latch.get("reason")})
    state = _read_json(state_dir / STATE_FILE, "supervisor state")
    status = state.get("status")
    if not _alive(state.get("supervisor_pid")):
        return Health("down" if status != "stopped" else "stopped", EXIT_NOT_READY,
                      {"supervisor_pid": state.get("supervisor_pid")})
    if status != "ready":
        return Health(str(status), EXIT_NOT_READY, {"supervisor_pid": state.get("supervisor_pid")})
    startup = verified_startup(state_dir, trust)
    ready = startup["ready"]
    if startup.get("producer_pid") != state.get("producer_pid") or not _alive(startup.get("producer_pid")):
        return Health("starting", EXIT_NOT_READY, {"supervisor_pid": state.get("supervisor_pid")})
    identity = {name: ready.get(name) for name in ("lane", "producer_mode", "key_id", "address", "pid")}
    return Health("ready", 0, {"supervisor_pid": state.get("supervisor_pid"), "identity": identity,
                               "ready_utc": startup.get("ready_utc"), "restarts": startup.get("restarts")})


def socket_in_use(path: Path) -> bool:
    """Whether something listens on the Unix socket at ``path`` (another producer)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True

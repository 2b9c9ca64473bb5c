"""A stopped or stalled producer never holds a run: the consumer's own deadlines and heartbeats.

The producer processes here are real (``python -m qualify.interfaces.producer_command``) serving a stub
engine whose prefill sleeps; SIGSTOP/SIGCONT stand in for a producer the kernel, a debugger or an
overloaded host has frozen. The end-to-end test at the bottom stops the shipped lane's producer
in the middle of a real ``qualify --recipe native-text`` run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from qualify.contract.lanes import ProducerMode
from qualify.core.assets import REPO_ROOT
from qualify.core.kv import KVCache
from qualify.handoff import service
from qualify.handoff.client import ProducerFailure, ProducerProcess
from qualify.handoff.protocol import STALL_NOTE_S, PhaseDeadlines
from qualify.run.run_contract import phase_deadlines
from tests.unit.handoff.test_handoff_service import (
    EXPECTATION,
    HANG_GUARD_S,
    KEY,
    RUN_ID,
    TOKENS,
    StubEngine,
    open_stub_handoff,
    stub_kv,
)

FACTORY = "tests.unit.handoff.test_producer_deadlines:build_sleepy_engine"
SLEEP_ENV = "QUALIFY_TEST_PREFILL_SLEEP_S"
ATTACKER_ENV = "QUALIFY_TEST_ANNOUNCED_ADDRESS"
# Short deadlines so a test sees a stop within seconds (a run derives longer ones: see below).
SILENCE_S = 3.0
# A bound on how long any test here may take to see a failure it provoked: the deadline plus the
# kill and reap grace, with room for a loaded two-core CI machine.
REPORT_MARGIN_S = 20.0


# ------------------------------------------------------------------------------------------
# the producer side (imported by the producer subprocess)


class SleepyEngine(StubEngine):
    """The stub engine; every prefill after the warm-up sleeps ``$QUALIFY_TEST_PREFILL_SLEEP_S``."""

    def prefill(self, tokens: np.ndarray) -> KVCache:
        self.calls += 1
        if self.calls > 1:  # the first call is the producer's warm-up
            time.sleep(float(os.environ.get(SLEEP_ENV, "0")))
        return stub_kv(tokens)


def build_sleepy_engine(lane: str, mode: ProducerMode) -> SleepyEngine:
    announced = os.environ.get(ATTACKER_ENV)
    if announced:
        # A hostile producer: its ready line names another socket than the one it listens on.
        serving = service.ProducerService
        original = serving.announce_ready

        def announce_elsewhere(self: service.ProducerService, warmup_s: float) -> None:
            self.address = announced
            original(self, warmup_s)

        serving.announce_ready = announce_elsewhere  # type: ignore[method-assign]
    return SleepyEngine("ok", mode, lane)


# ------------------------------------------------------------------------------------------
# helpers


def deadlines(*, silence_s: float = SILENCE_S, handoff_s: float = HANG_GUARD_S) -> PhaseDeadlines:
    return PhaseDeadlines(ready_s=HANG_GUARD_S, verify_s=HANG_GUARD_S, handoff_s=handoff_s, silence_s=silence_s)


def sleepy_producer(prefill_sleep_s: float, **options: object) -> ProducerProcess:
    env = {SLEEP_ENV: repr(prefill_sleep_s)}
    env.update(options.pop("env", {}))  # type: ignore[arg-type]
    return ProducerProcess(lane="stub-ok", mode=ProducerMode.EXACT, key=KEY, run_id=RUN_ID,
                           expectation=EXPECTATION, watchdog_s=HANG_GUARD_S, engine_factory=FACTORY,
                           env=env, **options)  # type: ignore[arg-type]


def after(seconds: float, action: Callable[[], None]) -> threading.Timer:
    timer = threading.Timer(seconds, action)
    timer.daemon = True
    timer.start()
    return timer


def signal_group(process: ProducerProcess, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass


def gone(pid: int) -> bool:
    """True when no process (not even a zombie) has ``pid``: nothing was orphaned."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# ------------------------------------------------------------------------------------------
# the client: silence, stalls, deadlines


def test_sigstop_during_a_handoff_fails_at_the_silence_deadline_and_kills_the_group() -> None:
    with sleepy_producer(30.0, deadlines=deadlines()) as producer:
        pid = producer.pid
        stopper = after(0.5, lambda: signal_group(producer, signal.SIGSTOP))
        started = time.monotonic()
        with pytest.raises(ProducerFailure, match=r"silent for \d+\.\d s during handoff .*silence deadline 3 s") as failed:
            producer.request_prefill(TOKENS, "req-stopped")
        waited = time.monotonic() - started
        stopper.join()
    assert SILENCE_S <= waited < SILENCE_S + REPORT_MARGIN_S
    assert failed.value.exit_status == -signal.SIGKILL
    assert gone(pid)


def test_sigstop_while_starting_fails_at_the_silence_deadline_and_kills_the_group() -> None:
    producer = sleepy_producer(0.0, deadlines=deadlines())
    spawned = threading.Event()
    original_drain = producer._drain_output

    def drain_then_stop() -> None:  # runs once the process exists, before its ready line
        assert producer._process is not None
        os.killpg(producer._process.pid, signal.SIGSTOP)
        spawned.set()
        original_drain()

    producer._drain_output = drain_then_stop  # type: ignore[method-assign]
    started = time.monotonic()
    with pytest.raises(ProducerFailure, match=r"silent for \d+\.\d s while starting") as failed:
        producer.start()
    waited = time.monotonic() - started
    assert spawned.is_set()
    assert SILENCE_S <= waited < SILENCE_S + REPORT_MARGIN_S
    assert failed.value.exit_status == -signal.SIGKILL
    assert producer._process is not None and gone(producer._process.pid)


def test_a_compute_longer_than_the_silence_deadline_is_kept_alive_by_heartbeats() -> None:
    # Two silence deadlines of compute: without the producer's heartbeats this would fail. (The
    # deadline is five heartbeats, so a loaded CI machine's scheduling gaps stay well inside it.)
    silence_s = 2.5
    with sleepy_producer(2 * silence_s, deadlines=deadlines(silence_s=silence_s)) as producer:
        handoff = producer.request_prefill(TOKENS, "req-long")
    assert handoff.transport is not None
    assert handoff.transport.longest_silence_s < silence_s
    open_stub_handoff(handoff, request_id="req-long")


def test_a_recovered_stall_is_measured_with_its_length() -> None:
    stall_s = 3.0
    with sleepy_producer(2.0, deadlines=deadlines(silence_s=15.0)) as producer:
        after(0.5, lambda: signal_group(producer, signal.SIGSTOP))
        after(0.5 + stall_s, lambda: signal_group(producer, signal.SIGCONT))
        handoff = producer.request_prefill(TOKENS, "req-stalled")
    assert handoff.transport is not None
    assert stall_s - 0.5 <= handoff.transport.longest_silence_s < stall_s + REPORT_MARGIN_S
    assert handoff.transport.longest_silence_s >= STALL_NOTE_S
    open_stub_handoff(handoff, request_id="req-stalled")


def test_handoff_deadline_bounds_a_producer_that_keeps_beating_but_never_answers() -> None:
    with sleepy_producer(60.0, deadlines=deadlines(silence_s=15.0, handoff_s=2.0)) as producer:
        pid = producer.pid
        with pytest.raises(ProducerFailure, match="no answer within the handoff deadline of 2 s"):
            producer.request_prefill(TOKENS, "req-forever")
    assert gone(pid)


def test_client_connects_only_to_the_socket_it_created(tmp_path: Path) -> None:
    decoy_path = tmp_path / "decoy.sock"
    decoy = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    decoy.bind(str(decoy_path))
    decoy.listen(1)
    decoy.settimeout(0.5)
    with sleepy_producer(0.0, env={ATTACKER_ENV: f"unix:{decoy_path}"}, deadlines=deadlines()) as producer:
        assert producer.ready_info["address"] == f"unix:{decoy_path}"  # announced, and ignored
        handoff = producer.request_prefill(TOKENS, "req-own-socket")
    open_stub_handoff(handoff, request_id="req-own-socket")
    with pytest.raises(TimeoutError):
        decoy.accept()
    decoy.close()


# ------------------------------------------------------------------------------------------
# deadlines derived from the identity


def test_phase_deadlines_scale_with_the_calibrated_handoff_above_their_floors() -> None:
    slow = {"producer_compute_s": 10.0, "serialize_s": 0.5, "transport_s": 0.5}
    fast = {"producer_compute_s": 0.01, "serialize_s": 0.01, "transport_s": 0.01}
    derived = phase_deadlines([fast, slow])
    assert derived.handoff_s == pytest.approx(110.0)
    assert derived.ready_s == pytest.approx(120.0)  # the floor: 10 x 10 s of compute is 100 s
    assert phase_deadlines([fast]).handoff_s == 60.0
    # A record without finite phases is not evidence of speed: the floors stand.
    assert phase_deadlines([{"producer_compute_s": float("nan")}]).handoff_s == 60.0


def test_deadline_override_limits_every_phase_and_the_silence() -> None:
    overridden = phase_deadlines([]).overridden(5.0)
    assert (overridden.ready_s, overridden.verify_s, overridden.handoff_s, overridden.silence_s) == (5.0, 5.0, 5.0, 5.0)
    assert phase_deadlines([]).overridden(100.0).silence_s == 15.0


# ------------------------------------------------------------------------------------------
# end to end: the shipped lane's producer stopped in a real run (tools/stall_drill.py)


@pytest.mark.slow
def test_sigstop_in_a_real_run_stall_recorded_then_stop_fails_the_run_within_its_deadline(tmp_path: Path) -> None:
    """Handoff 1: the producer is stopped for 4 s and resumes (the run records the stall).
    Handoff 2: it is stopped for good; the run fails at the silence deadline, exit 1, with a
    verifiable receipt and no producer left behind."""
    seen_path = tmp_path / "drill.json"
    subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "stall_drill.py"), "--receipts", str(tmp_path / "receipts"),
                    "--recover-s", "4", "--stop-at", "2", "--json", str(seen_path)],
                   cwd=REPO_ROOT, check=True, capture_output=True, timeout=1200)
    seen = json.loads(seen_path.read_text())
    assert seen["exit_status"] == 1, seen["last_output_line"]
    assert seen["stop_to_exit_s"] < 15.0 + REPORT_MARGIN_S  # the silence deadline, well under 60 s
    assert seen["producer_left_behind"] is False
    assert len(seen["receipts"]) == 1 and seen["receipt_problems"] == []
    assert any(line.startswith("sample-1: producer stalled: silent") for line in seen["stall_lines"])
    assert seen["samples"]["sample-1"]["producer_stall_s"] >= 3.5
    assert "silent for" in seen["samples"]["sample-2"]["error"]


# ------------------------------------------------------------------------------------------
# no orphan when the harness itself dies


def test_a_producer_whose_harness_is_killed_exits_though_its_log_pipe_is_gone(tmp_path: Path) -> None:
    """SIGKILL the harness: its end of the producer's stdin and log pipes closes at once. The
    producer must exit on the stdin EOF even though writing its last log line fails (EPIPE)."""
    harness = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
sys.path.insert(0, {str(REPO_ROOT)!r})
from tests.unit.handoff.test_producer_deadlines import sleepy_producer, deadlines
producer = sleepy_producer(0.0, deadlines=deadlines())
producer.start()
print(producer.pid, flush=True)
time.sleep(600)
"""], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert harness.stdout is not None
        producer_pid = int(harness.stdout.readline())
        harness.kill()
        harness.wait(HANG_GUARD_S)
        give_up = time.monotonic() + REPORT_MARGIN_S
        while not gone(producer_pid) and time.monotonic() < give_up:
            time.sleep(0.1)
    finally:
        if harness.poll() is None:
            harness.kill()
    alive = not gone(producer_pid)
    if alive:
        os.kill(producer_pid, signal.SIGKILL)
    assert not alive, "the producer outlived its killed harness (an orphan)"

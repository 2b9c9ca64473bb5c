"""``qualify producer supervise`` and ``producer health``: back after every kill with a fresh signed
startup receipt, latched after consecutive failures at start, refused arguments, and a restart
that hands off the same payload bit for bit.

Producers serve :mod:`tests.unit.handoff.test_handoff_service`'s stub engine on a Unix socket,
except the restart test, which serves the shipped lane's real producer on loopback TCP (the
shipped model is small: the whole file takes seconds).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qualify.archive.keys import default_trust_path, ensure_signing_key, load_trust
from qualify.contract.lanes import DEFAULT_LANES, ProducerMode, Recipe
from qualify.core import assets
from qualify.handoff.client import RemoteProducer
from qualify.handoff.wire import mint_run_key
from qualify.interfaces.producer_command import producer_health_cli
from qualify.run.supervisor import EXIT_LATCHED, LATCH_FILE, STALE_DIR, STARTUP_DIR, STATE_FILE, verified_startup
from tests.unit.handoff.test_handoff_service import EXPECTATION, FACTORY, HANG_GUARD_DEADLINES, HANG_GUARD_S
from tests.unit.handoff.test_producer_deadlines import gone

CLI = "import sys; from qualify.interfaces.cli import main; sys.exit(main(sys.argv[1:]))"


def qualify_process(*argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", CLI, *argv], cwd=assets.REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def qualify_run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CLI, *argv], cwd=assets.REPO_ROOT, capture_output=True, text=True,
                          timeout=HANG_GUARD_S * 2, check=False)


def write_key(directory: Path) -> Path:
    path = directory / "run.key"
    path.write_text(mint_run_key().hex())
    path.chmod(0o600)
    return path


def stub_serve_arguments(tmp_path: Path, lane: str = "stub-ok") -> list[str]:
    expect = tmp_path / "expect.json"
    expect.write_text(json.dumps(EXPECTATION.to_document()))
    return ["--lane", lane, "--mode", "exact", "--expect", str(expect), "--key-file", str(write_key(tmp_path)),
            "--socket", str(tmp_path / "producer.sock"), "--engine-factory", FACTORY]


def state(state_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((state_dir / STATE_FILE).read_text())
    except (OSError, ValueError):  # not written yet (each write replaces the file whole)
        return {}


def wait_for(condition: Callable[[dict[str, Any]], bool], what: str, supervisor: subprocess.Popen[str],
             state_dir: Path) -> dict[str, Any]:
    """The supervisor's state once ``condition`` holds of it (the hang guard bounds the wait)."""
    give_up = time.monotonic() + HANG_GUARD_S
    while not condition(found := state(state_dir)):
        if supervisor.poll() is not None:
            raise AssertionError(f"the supervisor exited {supervisor.returncode} waiting for {what}: "
                                 f"{supervisor.communicate()[1][-2000:]}")
        if time.monotonic() > give_up:
            raise AssertionError(f"not {what} within {HANG_GUARD_S} s: {found}")
        time.sleep(0.05)
    return found


def health(state_dir: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    code = producer_health_cli(["--state-dir", str(state_dir), "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.fixture
def stopped_at_the_end() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(HANG_GUARD_S)
            except subprocess.TimeoutExpired:
                process.kill()
        process.communicate()


def test_a_producer_killed_five_times_is_back_each_time_with_a_fresh_signed_startup_receipt(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], stopped_at_the_end: list[subprocess.Popen[str]]) -> None:
    ensure_signing_key()
    state_dir = tmp_path / "state"
    supervisor = qualify_process("producer", "supervise", "--state-dir", str(state_dir), "--backoff-s", "0.05",
                                 "--stable-s", "0", "--", *stub_serve_arguments(tmp_path))
    stopped_at_the_end.append(supervisor)
    trust = load_trust(default_trust_path())
    pids = []
    for kill in range(6):
        pid = wait_for(lambda found: found.get("status") == "ready" and found.get("producer_pid") not in pids,
                       f"ready after {kill} kills", supervisor, state_dir)["producer_pid"]
        startup = verified_startup(state_dir, trust)
        assert startup["producer_pid"] == startup["ready"]["pid"] == pid and startup["restarts"] == kill
        code, found = health(state_dir, capsys)
        assert (code, found["status"], found["identity"]["lane"], found["identity"]["pid"]) == (0, "ready", "stub-ok", pid)
        if kill == 0:  # one supervisor per state directory
            (tmp_path / "second").mkdir()
            second = qualify_run("producer", "supervise", "--state-dir", str(state_dir), "--",
                                 *stub_serve_arguments(tmp_path / "second"))
            assert second.returncode == 2 and len(second.stderr.strip().splitlines()) == 1
        pids.append(pid)
        if kill < 5:
            os.kill(pid, signal.SIGKILL)
    stale = sorted((state_dir / STALE_DIR).iterdir())
    assert len(stale) == 5 and all((entry / "startup.json").is_file() for entry in stale)
    assert len(set(pids)) == 6 and all(gone(pid) for pid in pids[:5])
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(HANG_GUARD_S) == 0
    assert gone(pids[-1]) and state(state_dir)["status"] == "stopped"
    assert not (state_dir / STARTUP_DIR).exists() and len(list((state_dir / STALE_DIR).iterdir())) == 6
    assert health(state_dir, capsys)[0] == 1


def test_a_producer_failing_at_start_latches_after_three_failures_and_stays_latched(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state_dir = tmp_path / "state"
    serve = stub_serve_arguments(tmp_path, lane="stub-unbuildable")
    latched = qualify_run("producer", "supervise", "--state-dir", str(state_dir), "--backoff-s", "0.05", "--", *serve)
    assert latched.returncode == EXIT_LATCHED
    latch = json.loads((state_dir / LATCH_FILE).read_text())
    assert latch["consecutive_failures"] == 3 and latch["last_log_lines"]
    assert latch["last_log_lines"][-1] in latched.stderr  # the producer's last words, printed
    starts = (state_dir / "producer.log").read_text().count("--- supervisor: start")
    assert starts == 3 and state(state_dir)["status"] == "latched"
    assert health(state_dir, capsys)[0] == EXIT_LATCHED
    again = qualify_run("producer", "supervise", "--state-dir", str(state_dir), "--", *serve)
    assert again.returncode == EXIT_LATCHED
    assert (state_dir / "producer.log").read_text().count("--- supervisor: start") == 3  # nothing started


@pytest.mark.parametrize("supervisor_options, serve_change", [
    ([], "no separator"),
    (["--backoff-s", "1_0"], None),
    (["--backoff-s", "inf"], None),
    (["--stable-s", "-1"], None),
    (["--failures-to-latch", "0"], None),
    ([], ["--ready-fd", "1"]),
    ([], ["--parent-pid", "1"]),
    ([], ["--mode", "fast"]),
])
def test_bad_arguments_are_refused_in_one_line_before_anything_starts(
        tmp_path: Path, supervisor_options: list[str], serve_change: list[str] | str | None) -> None:
    serve = stub_serve_arguments(tmp_path)
    if isinstance(serve_change, list):
        serve += serve_change  # a later repeat of an option overrides the earlier one
    separator = [] if serve_change == "no separator" else ["--"]
    refused = qualify_run("producer", "supervise", "--state-dir", str(tmp_path / "state"), *supervisor_options,
                          *separator, *serve)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert not (tmp_path / "state").exists()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_restart_between_two_handoffs_of_one_prompt_hands_off_the_same_payload(
        tmp_path: Path, stopped_at_the_end: list[subprocess.Popen[str]]) -> None:
    """The shipped lane's real producer, supervised on a loopback port: a handoff, the producer
    SIGKILLed, supervised back, the same request again: the same payload, bit for bit."""
    lane = DEFAULT_LANES[Recipe.NATIVE_TEXT]
    expect = tmp_path / "expect.json"
    assert qualify_run("producer", "expect", "--recipe", Recipe.NATIVE_TEXT.value, "--out", str(expect)).returncode == 0
    key_path = write_key(tmp_path)
    port = free_port()
    state_dir = tmp_path / "state"
    supervisor = qualify_process("producer", "supervise", "--state-dir", str(state_dir), "--stable-s", "0", "--",
                                 "--lane", lane, "--mode", ProducerMode.NATIVE.value, "--expect", str(expect),
                                 "--key-file", str(key_path), "--port", str(port))
    stopped_at_the_end.append(supervisor)
    tokens = np.asarray(assets.load_prompt()[:200], dtype=np.int64)
    key = bytes.fromhex(key_path.read_text())
    payloads, pids = [], []
    for attempt in range(2):
        pids.append(wait_for(lambda found: found.get("status") == "ready" and found.get("producer_pid") not in pids,
                             f"ready (attempt {attempt})", supervisor, state_dir)["producer_pid"])
        with RemoteProducer(host="127.0.0.1", port=port, key=key, run_id="run-restart", lane=lane,
                            mode=ProducerMode.NATIVE, deadlines=HANG_GUARD_DEADLINES, tls=None) as producer:
            payloads.append(bytes(producer.request_prefill(tokens, "sample-1").payload_bytes))
        if attempt == 0:
            os.kill(pids[0], signal.SIGKILL)
    assert pids[0] != pids[1] and len(payloads[0]) > 0
    assert payloads[0] == payloads[1]

"""Cancellation: a ``qualify --recipe`` run stopped by SIGINT, SIGTERM or SIGHUP (Ctrl-C, a CI
cancel, a closed terminal) once any step has finished exits 128 + the signal's number, leaves no
process and nothing under ``$TMPDIR``, and leaves one receipt that ``qualify receipts verify``
verifies, marked incomplete. A run SIGKILLed still loses its producer (the kernel's parent-death
signal); the producer's stdin watcher leaves even when its stderr cannot be written.

The runs are real ``qualify`` subprocesses in a session of their own, signalled as a shell or CI
signals a job: the whole process group. The step a signal lands in is found from the console's
one line per finished step. One phase per signal runs in the default tier; all 21 (3 signals x 7
steps, ~30 s each) in the slow tier.
"""

from __future__ import annotations

import fcntl
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import termios
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from qualify.archive.keys import ensure_signing_key
from qualify.archive.layout import PARTIAL_PREFIX, SUMMARY
from qualify.archive.reader import read_receipt_json
from qualify.handoff.client import WORKDIR_PREFIX
from qualify.handoff.protocol import PRODUCER_MODULE
from qualify.interfaces import cli
from qualify.run.qualification import STEP_LABELS
from qualify.run.signals import INTERRUPT_SIGNALS, RunInterrupted, interrupts_raise
from tests.support.processes import default_dispositions, with_default_signals

REPO = Path(__file__).resolve().parents[2]
PHASE_WAIT_S = 240.0
"""Bound on reaching a step (seconds, on a loaded 2-core machine running two of these at once)."""
EXIT_WAIT_S = 60.0
"""Bound on an interrupted run's exit: kill the producer, seal the receipt."""
GONE_WAIT_S = 5.0
"""Bound on the run's last process ending once the run has exited (or, SIGKILLed, died)."""
FAST_CASES = {(signal.SIGINT, "identity sealed"), (signal.SIGTERM, "producer ready"),
              (signal.SIGHUP, "producer ready")}
"""The default tier's cases: one per signal, early (a few seconds each); the rest are slow."""


@pytest.fixture(autouse=True)
def signing_key_exists() -> None:
    """The session's signing key, made before any subprocess runs (two runs at once must not
    race to make it)."""
    ensure_signing_key()


# -- the run's processes, from /proc ---------------------------------------------------------------


def _proc_stat(pid: str) -> tuple[str, int] | None:
    """(state, session id) of a process; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
    return fields[0], int(fields[3])


def run_processes(marker: str, session: int) -> set[int]:
    """Live processes of a run: its session's, and any whose command line names ``marker`` (the
    run's own ``$TMPDIR``, where the producer's socket and expectation file live). A zombie is
    not live: it runs nothing and holds nothing but its exit status."""
    found = set()
    needle = marker.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        state = _proc_stat(entry)
        if state is None or state[0] in "ZX":
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if state[1] == session or needle in cmdline:
            found.add(int(entry))
    return found


def wait_gone(marker: str, session: int, bound_s: float) -> set[int]:
    """Poll until no process of the run lives, at most ``bound_s``; what is left."""
    deadline = time.monotonic() + bound_s
    while True:
        left = run_processes(marker, session)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


# -- one run, signalled at a step ------------------------------------------------------------------


@dataclass
class Places:
    archive: Path
    tmpdir: Path
    cwd: Path


@pytest.fixture
def places(tmp_path: Path) -> Iterator[Places]:
    """The run's archive and working directory under ``tmp_path``; its ``$TMPDIR`` a short new
    directory of its own (pytest's paths are too long for the producer's Unix socket path)."""
    tmpdir = Path(tempfile.mkdtemp(prefix="cancel-"))
    found = Places(tmp_path / "archive", tmpdir, tmp_path / "cwd")
    found.archive.mkdir()
    found.cwd.mkdir()
    yield found
    shutil.rmtree(tmpdir, ignore_errors=True)


@dataclass
class Stopped:
    """What a signalled run did: exit code, output, and what of it lived when the signal was sent."""

    code: int
    stdout: str
    stderr: str
    processes_at_signal: set[int]
    workdirs_at_signal: list[str]
    exit_s: float
    gone_s: float
    left: set[int]


def _read_lines(stream: object, lines: queue.Queue[str | None]) -> None:
    assert hasattr(stream, "readline")
    for raw in iter(stream.readline, b""):
        lines.put(raw.decode("utf-8", "replace"))
    lines.put(None)


def step_line(label: str) -> re.Pattern[str]:
    """The console's line for a finished step (passed or not)."""
    return re.compile(rf"^\s*[✓✗]\s+{re.escape(label)}\s")


def start_run(places: Places) -> subprocess.Popen[bytes]:
    """``qualify --recipe native-text`` in a session of its own, with the test's ``$TMPDIR``;
    stdout piped unbuffered (one line per finished step), stderr to a file beside the places."""
    env = dict(os.environ, TMPDIR=str(places.tmpdir), PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "qualify.interfaces.cli", "--recipe", "native-text", "--reference-once",
               "--receipts", str(places.archive)]
    with open(places.cwd.parent / "stderr", "wb") as stderr:
        return subprocess.Popen(with_default_signals(command), cwd=places.cwd, env=env, stdout=subprocess.PIPE, stderr=stderr,
                                start_new_session=True)


def wait_for_step(process: subprocess.Popen[bytes], lines: queue.Queue[str | None], label: str,
                  seen: list[str]) -> None:
    """Read the run's output until ``label``'s line (bounded); a failed step or an early end fails."""
    pattern = step_line(label)
    deadline = time.monotonic() + PHASE_WAIT_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        if line is None:
            raise AssertionError(f"the run ended before step {label!r}: {''.join(seen)}")
        seen.append(line)
        if pattern.match(line):
            assert "✓" in line, f"step {label!r} failed: {''.join(seen)}"
            return
    raise AssertionError(f"step {label!r} not reached within {PHASE_WAIT_S} s: {''.join(seen)}")


def stop_run_at(places: Places, label: str, signum: int) -> Stopped:
    """Start a run, send ``signum`` to its process group as the line for ``label`` appears; wait
    for it to exit and for its last process to end."""
    process = start_run(places)
    marker = f"{places.tmpdir}{os.sep}"
    lines: queue.Queue[str | None] = queue.Queue()
    reader = threading.Thread(target=_read_lines, args=(process.stdout, lines), daemon=True)
    reader.start()
    seen: list[str] = []
    try:
        wait_for_step(process, lines, label, seen)
        at_signal = run_processes(marker, process.pid) - {process.pid}
        workdirs = sorted(path.name for path in places.tmpdir.glob(f"{WORKDIR_PREFIX}*"))
        signalled = time.monotonic()
        os.killpg(process.pid, signum)
        code = process.wait(timeout=EXIT_WAIT_S)
        exited = time.monotonic()
        left = wait_gone(marker, process.pid, GONE_WAIT_S)
        gone = time.monotonic()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    reader.join(timeout=EXIT_WAIT_S)
    while not lines.empty():
        line = lines.get_nowait()
        if line is not None:
            seen.append(line)
    stderr = (places.cwd.parent / "stderr").read_text(errors="replace")
    return Stopped(code, "".join(seen), stderr, at_signal, workdirs, exited - signalled, gone - signalled, left)


def trust_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """The session key's trust file, as an auditor gets it: ``qualify keys show --trust-file``."""
    capsys.readouterr()
    assert cli.main(["keys", "show", "--trust-file"]) == 0
    path = tmp_path / "trust.json"
    path.write_text(capsys.readouterr().out, encoding="utf-8")
    return path


def verify(paths: list[Path], trust: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``qualify receipts verify --trust TRUST PATH...`` (in process): exit code and output."""
    capsys.readouterr()
    code = cli.main(["receipts", "verify", "--trust", str(trust), *map(str, paths)])
    return code, capsys.readouterr().out


def assert_finished_run_is_untouched(places: Places, stopped: Stopped, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A run that finished before its signal: one whole passed receipt that verifies, its path the
    last line of the output, no process or temporary file left."""
    assert not stopped.left and not any(places.tmpdir.iterdir()), stopped
    entries = sorted(places.archive.iterdir())
    assert len(entries) == 1 and not entries[0].name.startswith(PARTIAL_PREFIX), entries
    assert read_receipt_json(entries[0], SUMMARY)["status"] == "passed"
    assert stopped.stdout.rstrip().endswith(entries[0].name), stopped.stdout
    code, out = verify([entries[0]], trust_file(tmp_path, capsys), capsys)
    assert code == 0 and out.startswith(f"ok        {entries[0].name}: passed; signed by "), out


HANDLED_ALIKE_AFTER = "handoff 1/3"
"""SIGTERM and SIGHUP go through SIGINT's handler (``qualify.run.signals``; only the exit status
differs): SIGINT is sent after every step; the other two after an early step (FAST_CASES) and after
the first handoff, and not again at the later steps, where they would repeat SIGINT's cases."""


def _cases() -> Iterator[object]:
    for signum in INTERRUPT_SIGNALS:
        for label in STEP_LABELS:
            if signum != signal.SIGINT and (signum, label) not in FAST_CASES and label != HANDLED_ALIKE_AFTER:
                continue
            marks = () if (signum, label) in FAST_CASES else (pytest.mark.slow,)
            yield pytest.param(signum, label, marks=marks, id=f"{signum.name}-{label.replace(' ', '-').replace('/', 'of')}")


@pytest.mark.parametrize(("signum", "label"), list(_cases()))
def test_run_signalled_after_a_step_exits_by_the_signal_and_leaves_a_verifiable_receipt_and_nothing_else(
    places: Places, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    record_property: Callable[[str, object], None], signum: signal.Signals, label: str,
) -> None:
    stopped = stop_run_at(places, label, signum)
    context = (stopped.stdout, stopped.stderr)
    if label in (STEP_LABELS[-2], "verdict") and stopped.code == 0:
        # The verdict line is printed as sealing starts, and the verdict step after the last
        # handoff's line takes tens of milliseconds; on a loaded machine the whole run can finish
        # before the signal lands (seen after "handoff 3/3" in a clean-clone CI run: exit 0, the
        # process gone 0.13 s after the signal). The executable then notes the signal instead of
        # dying by it (``cli.console``, ``hold_interrupts_after_runs``): the run's own exit code
        # and whole receipt stand, nothing says "interrupted", and the process is not killed in
        # its last output or teardown.
        assert "interrupted" not in stopped.stderr, context
        assert_finished_run_is_untouched(places, stopped, tmp_path, capsys)
        return
    assert stopped.code == 128 + signum, context
    index = STEP_LABELS.index(label)
    if index >= STEP_LABELS.index("producer ready") and label != "verdict":
        # The producer lived when the signal was sent (so the checks below can fail).
        assert stopped.processes_at_signal and len(stopped.workdirs_at_signal) == 1, stopped
    assert not stopped.left, f"processes left {GONE_WAIT_S} s after the run exited: {stopped.left}"
    assert not any(places.tmpdir.iterdir()), sorted(places.tmpdir.iterdir())
    entries = sorted(places.archive.iterdir())
    assert len(entries) == 1 and not entries[0].name.startswith(PARTIAL_PREFIX), entries
    receipt = entries[0]
    summary = read_receipt_json(receipt, SUMMARY)
    record_property("cancellation", f"{signum.name} after {label}: exit {stopped.exit_s:.2f} s, last process "
                                    f"gone {stopped.gone_s:.2f} s after the signal; receipt {summary['status']}"
                                    f" ({summary.get('error')})")
    # The signal lands in the next step or a later one (a step can end at once: the reference
    # step whose cold branches a forked child computes), or between steps; once the verdict is
    # being sealed it is held until the receipt is whole, which then keeps its verdict.
    later = "|".join(re.escape(step) for step in STEP_LABELS[index + 1:])
    since = "|".join(re.escape(step) for step in STEP_LABELS[index:-1])
    sealed_first = label == "verdict" or (label == STEP_LABELS[-2] and summary["status"] == "passed")
    if sealed_first:
        assert summary["status"] == "passed", summary
        expected_status = "passed"
    else:
        assert summary["status"] == "incomplete", summary
        assert re.fullmatch(rf"interrupted by {signum.name} (during ({later})|after ({since}))",
                            summary["error"]), summary
        expected_status = "incomplete"
    lines = stopped.stderr.splitlines()
    assert lines and re.fullmatch(rf"qualify: interrupted by {signum.name} .*; receipt: {re.escape(str(receipt))} "
                                  rf"\({expected_status}\)", lines[-1]), stopped.stderr
    code, out = verify([receipt], trust_file(tmp_path, capsys), capsys)
    assert code == 0, out
    assert out.startswith(f"ok        {receipt.name}: {expected_status}; signed by "), out


def test_sigkilled_run_still_ends_its_producer_and_its_archive_still_verifies(
    places: Places, tmp_path: Path, capsys: pytest.CaptureFixture[str], record_property: Callable[[str, object], None],
) -> None:
    """SIGKILL cannot be caught: the producer dies by the kernel's parent-death signal (or the end
    of its stdin), its temporary directory stays (nothing is left to remove it), and the
    ``.partial-`` receipt is listed by ``receipts verify``, which still exits 0."""
    process = start_run(places)
    marker = f"{places.tmpdir}{os.sep}"
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_read_lines, args=(process.stdout, lines), daemon=True).start()
    try:
        wait_for_step(process, lines, "producer ready", [])
        producers = run_processes(marker, process.pid) - {process.pid}
        assert producers, "no producer process found under the run's TMPDIR"
        signalled = time.monotonic()
        os.killpg(process.pid, signal.SIGKILL)
        assert process.wait(timeout=EXIT_WAIT_S) == -signal.SIGKILL
        left = wait_gone(marker, process.pid, GONE_WAIT_S)
        record_property("cancellation", f"SIGKILL after producer ready: producer gone "
                                        f"{time.monotonic() - signalled:.2f} s after the signal")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert not left, f"producer processes left {GONE_WAIT_S} s after the run was SIGKILLed: {left}"
    assert [path.name.startswith(WORKDIR_PREFIX) for path in places.tmpdir.iterdir()] == [True]
    assert any(path.name.startswith(PARTIAL_PREFIX) for path in places.archive.iterdir())
    code, out = verify([places.archive], trust_file(tmp_path, capsys), capsys)
    assert code == 0, out
    assert re.search(rf"^partial   {re.escape(PARTIAL_PREFIX)}\S+: a run stopped before", out, re.M), out
    assert out.splitlines()[-1] == "1 receipts: 0 verified, 1 partial", out


@pytest.mark.parametrize(("command", "signum"), [
    pytest.param(["calibrate", "--recipe", "native-text", "--lane", "nvfp4-native-w4a4", "--no-controls"],
                 signal.SIGTERM, id="calibrate-SIGTERM"),
    pytest.param(["selftest", "--fault", "rope-offset"], signal.SIGHUP, id="selftest-SIGHUP"),
])
def test_calibrate_and_selftest_signalled_once_their_producer_is_ready_stop_as_a_run_does(
    places: Places, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str], signum: signal.Signals,
) -> None:
    """They drive a run's steps themselves: the same exit code, no process, nothing under
    ``$TMPDIR`` (the self-test's scratch archive included), and a verifiable incomplete receipt."""
    env = dict(os.environ, TMPDIR=str(places.tmpdir), PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "qualify.interfaces.cli", *command, "--receipts", str(places.archive)]
    marker = f"{places.tmpdir}{os.sep}"
    with open(tmp_path / "stderr", "wb") as stderr:
        process = subprocess.Popen(with_default_signals(argv), cwd=places.cwd, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + PHASE_WAIT_S
        while not any("step producer ready: ok" in log.read_text(errors="replace")
                      for log in places.archive.glob(f"{PARTIAL_PREFIX}*/command.log")):
            assert process.poll() is None, (tmp_path / "stderr").read_text(errors="replace")
            assert time.monotonic() < deadline, f"no producer ready within {PHASE_WAIT_S} s"
            time.sleep(0.05)
        assert run_processes(marker, process.pid) - {process.pid}, "no producer process found"
        os.killpg(process.pid, signum)
        code = process.wait(timeout=EXIT_WAIT_S)
        left = wait_gone(marker, process.pid, GONE_WAIT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    err = (tmp_path / "stderr").read_text(errors="replace")
    assert code == 128 + signum, err
    assert err.splitlines()[-1] == "qualify: interrupted", err
    assert not left, left
    assert not any(places.tmpdir.iterdir()), sorted(places.tmpdir.iterdir())
    entries = sorted(places.archive.iterdir())
    assert len(entries) == 1 and not entries[0].name.startswith(PARTIAL_PREFIX), entries
    summary = read_receipt_json(entries[0], SUMMARY)
    assert summary["status"] == "incomplete", summary
    assert re.fullmatch(rf"interrupted by {signum.name} (during|after) .+", summary["error"]), summary
    code, out = verify([entries[0]], trust_file(tmp_path, capsys), capsys)
    assert code == 0 and out.startswith(f"ok        {entries[0].name}: incomplete; signed by "), out


# -- the producer's ties to the harness ------------------------------------------------------------


WATCHER = textwrap.dedent("""
    import sys, time
    from qualify.handoff.service import exit_when_stdin_closes
    exit_when_stdin_closes()
    print("watching", flush=True)
    if sys.argv[1] == "full":
        sys.stderr.write("x" * (1 << 22))  # blocks on the full pipe, holding stderr's lock
        sys.stderr.flush()
    time.sleep(120)
""")


def _pipe_full(fd: int) -> bool:
    capacity = fcntl.fcntl(fd, 1032)  # F_GETPIPE_SZ
    pending = bytearray(4)
    fcntl.ioctl(fd, termios.FIONREAD, pending)
    return int.from_bytes(pending, sys.byteorder) >= capacity


@pytest.mark.parametrize("stderr_state", ["closed", "full"])
def test_stdin_watcher_exits_when_stdin_closes_even_if_stderr_cannot_be_written(stderr_state: str) -> None:
    """``closed``: the harness's end of the stderr pipe is gone (a write fails with EPIPE);
    ``full``: it is open but no longer read, and the main thread is blocked writing to it."""
    process = subprocess.Popen([sys.executable, "-c", WATCHER, stderr_state], cwd=REPO, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdin is not None and process.stdout is not None and process.stderr is not None
    try:
        assert process.stdout.readline() == b"watching\n"
        if stderr_state == "closed":
            process.stderr.close()
        else:
            deadline = time.monotonic() + 30
            while not _pipe_full(process.stderr.fileno()):
                assert time.monotonic() < deadline, "the child never filled its stderr pipe"
                time.sleep(0.02)
        process.stdin.close()
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


PARENT_DIES = textwrap.dedent("""
    import os, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())], stdin=subprocess.DEVNULL,
                             start_new_session=True)
    print(child.pid, flush=True)
    child.wait()
""")
ARMED_CHILD = textwrap.dedent("""
    import sys, time
    from qualify.handoff.service import die_with_parent
    assert die_with_parent(int(sys.argv[1]))
    print("armed", flush=True)
    time.sleep(120)
""")


def test_producer_tied_by_parent_pid_dies_when_its_parent_is_sigkilled() -> None:
    """The kernel's parent-death signal alone (no stdin tie): the child's own session and a
    stdin of /dev/null, as a SIGKILLed harness leaves it."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT_DIES, ARMED_CHILD], cwd=REPO, stdout=subprocess.PIPE)
    assert parent.stdout is not None
    child = None
    try:
        child = int(parent.stdout.readline())
        assert parent.stdout.readline() == b"armed\n"
        assert _proc_stat(str(child)) is not None
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + GONE_WAIT_S
        while (state := _proc_stat(str(child))) is not None and state[0] not in "ZX":
            assert time.monotonic() < deadline, f"child {child} outlived its SIGKILLed parent by {GONE_WAIT_S} s"
            time.sleep(0.02)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child is not None and (state := _proc_stat(str(child))) is not None and state[0] not in "ZX":
            os.kill(child, signal.SIGKILL)


def test_producer_whose_parent_is_already_gone_refuses_to_start() -> None:
    """The parent died before the producer asked for its death signal (no signal will come): it
    says so in one line and exits 2, before reading a key or building an engine."""
    not_the_parent = os.getpid() + 1 if os.getpid() > 1 else 2
    done = subprocess.run(
        [sys.executable, "-m", PRODUCER_MODULE, "--lane", "nvfp4-native-w4a4", "--mode", "native",
         "--run-id", "run-1", "--expect", "nowhere.json", "--socket", "nowhere.sock", "--key-env", "NO_KEY_HERE",
         "--parent-pid", str(not_the_parent)],
        cwd=REPO, capture_output=True, timeout=120, check=False)
    assert done.returncode == 2, done
    assert done.stderr.decode().splitlines() == [
        f"producer: refused to start: --parent-pid: found {not_the_parent}, this process's parent is "
        f"{os.getpid()} (the harness that started it is gone)"], done


# -- the run's signal handlers ----------------------------------------------------------------------


@pytest.mark.parametrize("signum", INTERRUPT_SIGNALS, ids=lambda s: s.name)
def test_each_interrupt_signal_raises_run_interrupted_carrying_it(signum: signal.Signals) -> None:
    with default_dispositions(), interrupts_raise(), pytest.raises(RunInterrupted) as raised:
        os.kill(os.getpid(), signum)
        time.sleep(5)  # the handler raises at the next bytecode; this never completes
    assert raised.value.signum == signum


def test_sighup_ignored_by_nohup_stays_ignored_during_a_run() -> None:
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with interrupts_raise():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)  # ignored: nothing is raised
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_the_executable_notes_a_signal_after_a_run_and_stops_the_next_run_with_it() -> None:
    """Deterministic form of the race the verdict cases can hit: under
    ``hold_interrupts_after_runs`` a SIGHUP or SIGTERM that lands after a run's scope is noted
    (the process lives on and exits with its own code), and the next run stops at its start."""
    script = textwrap.dedent("""
        import os, signal, sys
        from qualify.run.signals import RunInterrupted, hold_interrupts_after_runs, interrupts_raise
        hold_interrupts_after_runs()
        with interrupts_raise():
            pass
        for signum in (signal.SIGHUP, signal.SIGTERM):
            os.kill(os.getpid(), signum)
        print("alive after both signals")
        try:
            with interrupts_raise():
                print("next run started")
        except RunInterrupted as exc:
            print(f"next run stopped by {signal.Signals(exc.signum).name}")
        sys.exit(7)
    """)
    done = subprocess.run(with_default_signals([sys.executable, "-c", script]), capture_output=True, text=True, timeout=60)
    assert done.returncode == 7, done
    assert done.stdout.splitlines() == ["alive after both signals", "next run stopped by SIGHUP"], done

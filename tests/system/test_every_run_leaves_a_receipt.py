"""Every run leaves a receipt: a contract refused before its identity loads leaves one marked
refused (with no identity files), an interrupted run (SIGINT, SIGTERM) one marked incomplete, and
``qualify receipts verify`` verifies both, listing their status. Real ``qualify`` and ``pytest``
subprocesses; the interrupt cases wait for the producer to be ready (a few seconds; the pytest
recipe's, which also collects and starts pytest, are in the slow tier)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from qualify.archive.attestation import ENVELOPE
from qualify.archive.keys import ensure_signing_key
from qualify.archive.layout import IDENTITY_FILES, MANIFEST, MANIFEST_SCHEMA, PARTIAL_PREFIX, REQUIRED_FILES, SUMMARY
from qualify.archive.reader import read_receipt_json
from qualify.archive.verify import verify_receipt
from qualify.archive.writer import ReceiptWriter
from qualify.core.digests import document_sha256, jcs_bytes
from qualify.core.errors import Refused
from qualify.evidence.records import ValidationSummary
from qualify.interfaces import cli
from qualify.judge import judge_incomplete, judge_refused
from qualify.run import signals
from qualify.run.run_contract import default_identity_path
from tests.support.processes import default_dispositions, with_default_signals

REPO = Path(__file__).resolve().parents[2]
SHIPPED = default_identity_path("native-text")
READY_WAIT_S = 180.0
"""Bound on waiting for the producer to be ready (seconds, on a loaded 2-core machine)."""
EXIT_WAIT_S = 60.0
"""Bound on an interrupted run's exit: kill the producer, seal the receipt."""


# -- helpers -------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def signing_key_exists() -> None:
    """The session's signing key, made before any subprocess runs (the first run on a machine
    makes it and says so on stderr: a second line these tests do not count)."""
    ensure_signing_key()


def qualify_command(*argv: str) -> list[str]:
    return [sys.executable, "-m", "qualify.interfaces.cli", *argv]


def receipts_in(archive: Path) -> list[Path]:
    """Everything in the archive: published receipts and any ``.partial-`` leftover."""
    return sorted(archive.iterdir())


def only_receipt(archive: Path) -> Path:
    """The archive's one receipt, published (no ``.partial-`` leftover, no claimed empty directory)."""
    entries = receipts_in(archive)
    assert len(entries) == 1 and not entries[0].name.startswith("."), entries
    return entries[0]


def verify_archive(archive: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``qualify receipts verify ARCHIVE`` (in process, the session's trust file): exit code and output."""
    capsys.readouterr()
    code = cli.main(["receipts", "verify", str(archive)])
    return code, capsys.readouterr().out


def shipped_identity() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(SHIPPED.read_text(encoding="utf-8"))
    return document


def relaxed_bound(path: Path) -> None:
    document = shipped_identity()
    document["onboarding_qualification"]["full_logits"]["maximum_absolute"] *= 2  # a looser rule than sealed
    path.write_text(json.dumps(document), encoding="utf-8")


def unknown_lane(path: Path) -> None:
    document = shipped_identity()
    document["lane"] = "no-such-lane"
    path.write_text(json.dumps(document), encoding="utf-8")


def not_json(path: Path) -> None:
    path.write_bytes(b"{\"lane\": \"nvfp4-native-w4a4\",")


# -- a contract refused before its identity loads -----------------------------------------------


@pytest.mark.parametrize(("make_identity", "refusal"), [
    (not_json, "not JSON"),
    (relaxed_bound, "identity sha256 found"),
    (unknown_lane, 'lane: found "no-such-lane"'),
], ids=["not-json", "relaxed-bound", "unknown-lane"])
def test_identity_refused_before_it_loads_leaves_one_refused_receipt_that_verifies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make_identity: Callable[[Path], None], refusal: str
) -> None:
    identity, archive, cwd = tmp_path / "identity.json", tmp_path / "archive", tmp_path / "cwd"
    archive.mkdir()
    cwd.mkdir()
    make_identity(identity)
    done = subprocess.run(qualify_command("--recipe", "native-text", "--identity", str(identity),
                                          "--receipts", str(archive)),
                          cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("refused: identity sealed: ") and refusal in lines[0], done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    receipt = only_receipt(archive)
    assert f"receipt: {receipt} (refused)" in done.stdout
    assert not any(cwd.iterdir())  # nothing written where it ran
    # A receipt with no identity: the command, the refusal, host and versions, signed.
    names = {path.relative_to(receipt).as_posix() for path in receipt.rglob("*") if path.is_file()}
    assert names.isdisjoint(IDENTITY_FILES) and set(REQUIRED_FILES) | {"host.json"} <= names, names
    summary = read_receipt_json(receipt, SUMMARY)
    assert summary["status"] == "refused" and summary["passed"] is False and summary["samples"] == 0
    assert summary["identity_sha256"] is None and summary["lane"] is None and summary["recipe"] == "native-text"
    assert summary["error"] == lines[0] and summary["verdict"] == lines[0]
    log = (receipt / "command.log").read_text(encoding="utf-8")
    assert log.startswith(f"command: qualify --recipe native-text --identity {identity} --receipts {archive}\n")
    assert "step identity sealed: REFUSED" in log and refusal in log
    code, out = verify_archive(archive, capsys)
    assert code == 0, out
    assert out.startswith(f"ok        {receipt.name}: refused; signed by ")
    assert out.splitlines()[-1] == "1 receipts: 1 verified (1 refused)"


def test_shipped_identity_refused_names_the_lane_the_operator_chose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With no --identity the run loads the lane's shipped identity: a refusal there names that
    lane in the receipt (in process: the shipped file itself is never touched)."""
    from qualify.contract import identity as identity_module

    def refuse(path: object, **_: object) -> object:
        raise Refused(f"identity {path}: lane nvfp4-native-w4a4: identity sha256 found 0, sealed 1")

    monkeypatch.setattr(identity_module, "load_identity", refuse)
    code = cli.main(["--recipe", "native-text", "--receipts", str(tmp_path)])
    assert code == 2
    summary = read_receipt_json(only_receipt(tmp_path), SUMMARY)
    assert summary["status"] == "refused" and summary["identity_sha256"] is None
    assert summary["lane"] == "nvfp4-native-w4a4"
    assert verify_receipt(only_receipt(tmp_path)) == []


def test_unusable_receipts_directory_says_no_receipt_can_be_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory\n")
    code = cli.main(["--recipe", "native-text", "--receipts", str(a_file)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "expected a directory" in err and "no receipt can be written there" in err, err


def test_mistyped_flag_is_no_run_and_leaves_no_receipt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["--recipe", "native-text", "--receipts", str(tmp_path), "--referense-once"])
    assert code == 2 and len(capsys.readouterr().err.splitlines()) == 1
    assert receipts_in(tmp_path) == []


# -- the format: a receipt with no identity ------------------------------------------------------


AN_IDENTITY = {"schema": "trust-ladder.onboarding-identity.v2", "lane": "x"}
"""An identity document as far as a receipt is concerned (the writer does not validate it)."""


def identityless_writer(archive: Path) -> ReceiptWriter:
    return ReceiptWriter(archive, command_line=["qualify", "--recipe", "native-text"], identity=None,
                         recipe="native-text", lane=None)


def test_receipt_without_identity_records_only_a_refusal(tmp_path: Path) -> None:
    writer = identityless_writer(tmp_path)
    with pytest.raises(Refused, match="status incomplete without an identity"):
        writer.finalize(judge_incomplete("interrupted by SIGINT during identity sealed"))
    path = writer.finalize(judge_refused("identity sealed: identity x.json: not JSON"))
    assert verify_receipt(path) == []
    assert read_receipt_json(path, SUMMARY)["status"] == "refused"


def test_receipt_without_identity_left_by_an_exception_is_sealed_refused(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), identityless_writer(tmp_path) as writer:
        raise RuntimeError("boom")
    assert read_receipt_json(writer.path, SUMMARY)["status"] == "refused"
    assert verify_receipt(writer.path) == []


def test_summary_names_no_identity_only_when_refused() -> None:
    fields: dict[str, Any] = dict(run_id="r", recipe="native-text", lane=None, rung=None, identity_sha256=None,
                                  passed=False, verdict="v", reasons=(), checks=(), rule=None, samples=0,
                                  started_utc="t", finished_utc="t")
    assert ValidationSummary(status="refused", **fields).identity_sha256 is None
    for status in ("incomplete", "failed"):
        with pytest.raises(ValueError, match="only a run refused before its identity loaded"):
            ValidationSummary(status=status, **fields)
    with pytest.raises(ValueError, match="a run with an identity names its lane"):
        ValidationSummary(status="refused", **{**fields, "identity_sha256": "a" * 64})


def relist(receipt: Path) -> None:
    """Rewrite the manifest to list exactly the files now there (a consistent forgery: only the
    cross-checks between files can catch it)."""
    files = sorted(path for path in receipt.rglob("*") if path.is_file() and path.name not in (MANIFEST, ENVELOPE))
    entries = [{"path": path.relative_to(receipt).as_posix(), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                "bytes": path.stat().st_size} for path in files]
    os.chmod(receipt / MANIFEST, 0o644)
    (receipt / MANIFEST).write_bytes(jcs_bytes({"schema": MANIFEST_SCHEMA, "run_id": receipt.name, "files": entries}))


def test_an_identity_file_beside_a_summary_naming_none_is_reported(tmp_path: Path) -> None:
    """Integrity: identity files are required unless the summary names no identity, and then forbidden."""
    path = identityless_writer(tmp_path).finalize(judge_refused("identity sealed: not JSON"))
    assert verify_receipt(path) == []
    path.chmod(0o755)
    (path / "identity.json").write_text(json.dumps(AN_IDENTITY))
    (path / "identity.sha256").write_text(f"{document_sha256(AN_IDENTITY)}\n")
    relist(path)
    problems = verify_receipt(path)
    assert f"{path.name}: {SUMMARY} names no identity, the receipt holds identity.json" in problems, problems


def test_a_receipt_under_an_identity_still_needs_its_identity_files(tmp_path: Path) -> None:
    writer = ReceiptWriter(tmp_path, command_line=["qualify"], identity=AN_IDENTITY, recipe="native-text", lane="x")
    path = writer.finalize(judge_incomplete("run ended"))
    assert verify_receipt(path) == []
    path.chmod(0o755)
    (path / "identity.json").unlink()
    relist(path)
    problems = verify_receipt(path)
    assert f"{path.name}: missing file identity.json (required: {SUMMARY} names an identity)" in problems, problems


# -- signals -------------------------------------------------------------------------------------


def test_the_runs_sigterm_handler_is_installed_only_for_the_run() -> None:
    def before(signum: int, frame: object) -> None:
        raise AssertionError("not called")

    previous = signal.signal(signal.SIGTERM, before)
    try:
        with signals.interrupts_raise():
            assert signal.getsignal(signal.SIGTERM) is not before
            with pytest.raises(signals.RunInterrupted) as raised:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises at the next bytecode; the sleep is only its bound
            assert raised.value.signum == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_signal_while_a_receipt_is_sealed_is_raised_once_it_is_sealed() -> None:
    with default_dispositions(), signals.interrupts_raise():
        with pytest.raises(signals.RunInterrupted), signals.signals_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # delivered meanwhile, and held
            sealed = True
        assert sealed
        with signals.signals_held(discard=True):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # discarded: a second signal while stopping for the first


# -- interrupted runs ----------------------------------------------------------------------------


def wait_for_producer_ready(archive: Path, process: subprocess.Popen[bytes]) -> int:
    """Poll the open receipt's command.log until the producer is ready; its pid (bounded wait)."""
    deadline = time.monotonic() + READY_WAIT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, "the run ended before its producer was ready"
        for log in archive.glob(f"{PARTIAL_PREFIX}*/command.log"):
            text = log.read_text(encoding="utf-8", errors="replace")
            if "step producer ready: ok" in text:
                found = re.search(r"producer host: pid (\d+)", text)
                assert found, text
                return int(found.group(1))
        time.sleep(0.1)
    raise AssertionError(f"the producer was not ready within {READY_WAIT_S} s")


def assert_group_gone(pgid: int) -> None:
    """The producer's process group is empty (bounded wait: its reaping may lag the exit)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"producer process group {pgid} still has processes")


@pytest.fixture
def interrupted_places(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    archive, cwd = tmp_path / "archive", tmp_path / "cwd"
    archive.mkdir()
    cwd.mkdir()
    yield archive, cwd


def interrupt_run(command: list[str], cwd: Path, archive: Path, signum: int) -> tuple[int, str, str, int]:
    """Start ``command``, send ``signum`` once its producer is ready; (exit code, stdout, stderr, producer pid)."""
    out_path, err_path = archive.parent / "stdout", archive.parent / "stderr"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        process = subprocess.Popen(with_default_signals(command), cwd=cwd, stdout=out, stderr=err)
        try:
            producer = wait_for_producer_ready(archive, process)
            process.send_signal(signum)
            code = process.wait(timeout=EXIT_WAIT_S)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    return code, out_path.read_text(errors="replace"), err_path.read_text(errors="replace"), producer


def assert_incomplete_receipt(archive: Path, name: str, capsys: pytest.CaptureFixture[str]) -> Path:
    receipt = only_receipt(archive)
    summary = read_receipt_json(receipt, SUMMARY)
    assert summary["status"] == "incomplete" and summary["passed"] is False, summary
    assert re.fullmatch(rf"interrupted by {name} {STEP_AFTER_READY}", summary["error"]), summary
    assert f"{summary['error']}" in (receipt / "command.log").read_text(encoding="utf-8")
    code, out = verify_archive(archive, capsys)
    assert code == 0, out
    assert out.startswith(f"ok        {receipt.name}: incomplete; signed by ")
    assert out.splitlines()[-1] == "1 receipts: 1 verified (1 incomplete)"
    return receipt


STEP_AFTER_READY = r"(during (reference computed|handoff [123]/3)|after (producer ready|reference computed))"
"""Where a signal sent once the producer is ready lands: in a later step, or just between steps (the
reference step, whose cold branches a forked child computes, returns at once)."""
SIGNALS = [pytest.param(signal.SIGINT, 130, id="SIGINT"), pytest.param(signal.SIGTERM, 143, id="SIGTERM")]


@pytest.mark.parametrize(("signum", "exit_code"), SIGNALS)
def test_interrupted_qualify_run_kills_its_producer_and_leaves_an_incomplete_receipt(
    interrupted_places: tuple[Path, Path], capsys: pytest.CaptureFixture[str], signum: signal.Signals, exit_code: int
) -> None:
    archive, cwd = interrupted_places
    code, out, err, producer = interrupt_run(
        qualify_command("--recipe", "native-text", "--reference-once", "--receipts", str(archive)), cwd, archive, signum)
    assert code == exit_code, (out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and re.match(rf"qualify: interrupted by {signum.name} {STEP_AFTER_READY}; ", lines[0]), err
    assert_group_gone(producer)
    receipt = assert_incomplete_receipt(archive, signum.name, capsys)
    assert lines[0].endswith(f"; receipt: {receipt} (incomplete)"), err
    assert not any(cwd.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "exit_code"), SIGNALS)
def test_interrupted_pytest_recipe_kills_its_producer_and_leaves_an_incomplete_receipt(
    interrupted_places: tuple[Path, Path], capsys: pytest.CaptureFixture[str], signum: signal.Signals, exit_code: int
) -> None:
    archive, _cwd = interrupted_places
    command = [sys.executable, "-m", "pytest", "recipes/native_text.py", "-q", "-p", "no:xdist",
               "--qualify-reference-once", "--qualify-receipts", str(archive)]
    code, out, err, producer = interrupt_run(command, REPO, archive, signum)
    assert code == exit_code, (out, err)
    assert f"RunInterrupted: {signum.name}" in out and "Traceback" not in out + err, (out, err)  # pytest's interrupt line
    assert_group_gone(producer)
    assert_incomplete_receipt(archive, signum.name, capsys)

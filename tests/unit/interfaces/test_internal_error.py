"""A bug in the harness has its own exit code, 70, never a refusal's 2: one line on stderr naming
the exception and where its traceback was saved, in the run's receipt when the run has one (sealed
as incomplete, still verifiable), else in the user state directory. Forced through public seams:
the run's default transport factory (``qualification.producer_process``) and a delegated
command's handler (``qualify.interfaces.verify_command.verify_cli``) replaced by ones that raise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qualify.archive.keys import init_key
from qualify.archive.verify import authenticate_receipt
from qualify.core.internal_error import EXIT_INTERNAL_ERROR
from qualify.interfaces import cli
from qualify.interfaces import verify_command as verify_module
from qualify.run import qualification
from tests.conftest import isolate_cli_environment
from tests.support.receipt_forgery import operator_trust

PREFIX = "qualify: internal error (a bug in the harness): "


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _raising(*args: object, **kwargs: object) -> None:
    raise ZeroDivisionError("forced: a bug\nwith a second line")


@pytest.fixture
def newcomer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The CLI as a newcomer runs it, writing under ``tmp_path`` only; its state directory there."""
    (tmp_path / "cwd").mkdir()
    isolate_cli_environment(monkeypatch, cwd=tmp_path / "cwd", archive=tmp_path / "archive", data=tmp_path / "data")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    init_key()  # the operator's signing key exists (a first run announces making one, on stderr)
    return tmp_path


def test_a_bug_outside_any_run_exits_70_naming_its_traceback_in_the_state_directory(
        newcomer: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(verify_module, "verify_cli", _raising)
    code, out, err = _main(capsys, "receipts", "verify")
    assert code == EXIT_INTERNAL_ERROR and out == ""
    what, _, saved = _one_line(err).removeprefix(PREFIX).partition("; traceback: ")
    assert what == "ZeroDivisionError: forced: a bug with a second line"
    assert Path(saved).parent == newcomer / "state" / "trust-ladder" / "tracebacks"
    text = Path(saved).read_text(encoding="utf-8")
    assert "Traceback (most recent call last):" in text and text.rstrip().endswith("with a second line")


def test_under_json_a_bug_prints_no_document_only_its_exit_code_and_line(
        newcomer: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(verify_module, "verify_cli", _raising)
    code, out, err = _main(capsys, "receipts", "verify", "--json")
    assert (code, out) == (EXIT_INTERNAL_ERROR, "") and _one_line(err).startswith(PREFIX)


def test_debugging_raises_the_bug_instead(newcomer: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verify_module, "verify_cli", _raising)
    monkeypatch.setenv("QUALIFY_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        cli.main(["receipts", "verify"])


def test_a_bug_during_a_run_exits_70_and_its_traceback_is_in_the_run_s_sealed_receipt(
        newcomer: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(qualification, "producer_process", _raising)
    code, out, err = _main(capsys, "--recipe", "native-text", "--reference-once")
    assert code == EXIT_INTERNAL_ERROR, (out, err)
    what, _, saved = _one_line(err).removeprefix(PREFIX).partition("; traceback: ")
    assert what == "during producer ready: ZeroDivisionError: forced: a bug with a second line"
    (receipt,) = (newcomer / "archive").iterdir()
    assert Path(saved) == receipt / "evidence" / "internal-error.json"
    document = json.loads(Path(saved).read_text(encoding="utf-8"))
    assert (document["step"], document["exception"]) == ("producer ready", "ZeroDivisionError")
    assert document["traceback"][0] == "Traceback (most recent call last):"
    check = authenticate_receipt(receipt, operator_trust())
    assert (check.state, check.status) == ("verified", "incomplete"), check.problems
    assert check.predicate is not None and check.predicate["error"] == f"internal error {what}"


def test_the_process_exits_70_not_2(tmp_path: Path) -> None:
    """The ``qualify`` executable's own exit status (``console()``), in a process of its own."""
    code = ("import sys; import qualify.interfaces.verify_command as verify\n"
            "def boom(argv): raise RuntimeError('forced')\n"
            "verify.verify_cli = boom\n"
            "from qualify.interfaces.cli import console\n"
            "console()\n")
    done = subprocess.run([sys.executable, "-c", code, "receipts", "verify"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                                                       "XDG_STATE_HOME": str(tmp_path / "state")})
    assert done.returncode == EXIT_INTERNAL_ERROR == 70, done.stderr
    assert _one_line(done.stderr).startswith(f"{PREFIX}RuntimeError: forced; traceback: {tmp_path / 'state'}")

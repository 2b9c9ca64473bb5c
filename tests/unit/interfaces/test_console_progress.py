"""Progress while a run's steps run: on a terminal a spinner, the step and its elapsed time, which
gives way to the step's finished line; piped to a file or a log, only the lines (no control codes);
under ``--json``, nothing on stdout but the document."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from qualify.interfaces import console as operator
from qualify.judge import Verdict
from qualify.run.qualification import STEP_LABELS, RunOptions, StepOutcome

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # escapes, carriage returns, cursor moves (not \t or \n)


class FakeRun:
    """Stands in for QualificationRun in :func:`drive`: each step passes (or ``fail_at`` fails),
    with a sample record once the handoffs ran; ``seen`` records what a terminal showed while
    each step ran."""

    def __init__(self, fail_at: str | None = None, refused: bool = False, console: Console | None = None) -> None:
        self.options = RunOptions(recipe="native-text")
        self.labels = STEP_LABELS
        self.outcomes: dict[str, StepOutcome] = {}
        self.records: list[dict[str, Any]] = []
        self.verdict: Verdict | None = None
        self.receipt_path: Path | None = Path("/archive/20260101T000000Z-0123456789abcdef")
        self.fail_at, self._refused, self.console = fail_at, refused, console
        self.seen: dict[str, str] = {}
        self.closed = False

    @property
    def refused(self) -> bool:
        return any(outcome.refused for outcome in self.outcomes.values())

    def step(self, label: str) -> StepOutcome:
        if any(not outcome.passed for outcome in self.outcomes.values()):
            outcome = StepOutcome(label, False, f"blocked: step '{self.fail_at}' failed", 0.0)
        elif label == self.fail_at:
            outcome = StepOutcome(label, False, "identity x.json: schema: missing", 0.25, refused=self._refused)
        else:
            if self.console is not None:
                self.seen[label] = self.console.file.getvalue()  # type: ignore[attr-defined]
            outcome = StepOutcome(label, True, f"{label} done", 1.5)
        self.outcomes[label] = outcome
        if label == "verdict" and outcome.passed:
            self.records = [{"repetition": 1, "output_tokens": 256, "token_agreement_rate": 1.0,
                             "max_abs": 1.278604507446289, "mean_abs": 0.07923601299503324,
                             "payload_bytes": 8388608, "payload_gbit_per_s": 18.5, "producer_compute_s": 1.6,
                             "transport_s": 0.004, "verify_s": 0.016, "install_s": 5.68e-05, "decode_s": 2.7,
                             "recompute_s": 9.8, "error": None, "localisation": None}]
            self.verdict = Verdict(True, "passed: 1/1", ["every sample passes"])
        return outcome

    def interrupted(self, signum: int) -> None:
        raise AssertionError("not interrupted")

    def close(self) -> None:
        self.closed = True


def test_piped_output_has_no_control_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    piped = io.StringIO()
    monkeypatch.setattr("sys.stdout", piped)
    console = operator.operator_console()
    assert not console.is_terminal
    run = FakeRun()
    assert operator.drive(run, console) == 0  # type: ignore[arg-type]
    text = piped.getvalue()
    assert not CONTROL.search(text), repr(text)
    assert text.count("✓") == len(STEP_LABELS) and "QUALIFIED: passed: 1/1" in text and "5.68e-05" in text
    assert run.closed


def test_a_terminal_shows_the_step_and_its_elapsed_time_while_it_runs() -> None:
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, force_interactive=True, width=100, highlight=False,
                      markup=False, emoji=False)
    run = FakeRun(console=console)
    assert operator.drive(run, console) == 0  # type: ignore[arg-type]
    for label in STEP_LABELS:  # while each step ran: its label and the clock, before its line
        assert f"{label} 0:00:0" in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", run.seen[label]), run.seen[label]
    assert "\x1b" in screen.getvalue()  # a live display, which the piped case must never have


def test_blocked_steps_are_one_line_after_the_failed_step(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # pytest-xdist's workers say 80: the one line would wrap
    run = FakeRun(fail_at="identity sealed", refused=True)
    code = operator.drive(run, operator.operator_console())  # type: ignore[arg-type]
    out, err = capsys.readouterr()
    assert code == 2
    assert err == "refused: identity sealed: identity x.json: schema: missing\n"
    lines = out.splitlines()
    assert lines[0].startswith(" ✗ identity sealed") and len(lines) == 3, out
    assert lines[1] == (" · not run (blocked: step 'identity sealed' failed): " + ", ".join(STEP_LABELS[1:]))
    assert lines[2] == f"receipt: {run.receipt_path} (refused)"


def test_json_progress_is_silent_when_stderr_is_not_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stderr", err)
    console = operator.json_progress_console()
    assert operator.drive(FakeRun(), console) == 0  # type: ignore[arg-type]
    assert out.getvalue() == "" and err.getvalue() == ""


@pytest.mark.parametrize("fail_at", [None, "identity sealed", "verdict"])
def test_show_run_prints_again_what_drive_printed(monkeypatch: pytest.MonkeyPatch, fail_at: str | None) -> None:
    """tools/console_screenshots.py renders a finished run with :func:`show_run`: the header and
    exactly the lines :func:`drive` printed while it ran (a passing, refused and failed run)."""
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setattr("sys.stderr", io.StringIO())  # a refused run's one line is not the console's
    live = Console(file=io.StringIO(), width=120, highlight=False, markup=False, emoji=False)
    run = FakeRun(fail_at=fail_at, refused=fail_at == "identity sealed")
    live.print(operator.header_line(run.options.recipe))
    operator.drive(run, live)  # type: ignore[arg-type]
    again = Console(file=io.StringIO(), width=120, highlight=False, markup=False, emoji=False)
    operator.show_run(run, again)  # type: ignore[arg-type]
    shown = again.file.getvalue()  # type: ignore[attr-defined]
    assert shown == live.file.getvalue() and "qualify --recipe native-text" in shown  # type: ignore[attr-defined]

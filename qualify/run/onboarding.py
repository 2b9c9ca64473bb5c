"""What an operator does after ``qualify calibrate``: the proposed rule and the sealed change it needs,
as lines the console prints (and ``--json`` carries).

A line styled :data:`COMMAND_STYLE` is one shell command and nothing else: the lines in that style,
run in order exactly as printed (pasted into one shell), copy the calibration receipt into the
checkout's ``receipts/``, freeze the identity, regenerate ``sealed_data.py`` and check the result.
They start with ``cd`` to the checkout and name the running interpreter, so neither the shell's
directory nor its ``PATH`` changes what they do. The receipt is copied rather than passed to
``tools/freeze_identity.py --archive-dir``: every later reader of the basis receipt (``qualify
identity check``, every run, ``--write-sealed`` re-sealing every shipped lane) resolves it under
``receipts/`` only, so the basis must be committed there anyway.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from qualify.contract.lanes import recipe_named
from qualify.core import model_choice
from qualify.core.assets import REPO_ROOT
from qualify.run.calibrate import Calibration

COMMAND_STYLE = "cyan"
"""The style of a line that is one runnable shell command (no prose on it)."""

COMMANDS_HEADING = "sealed change it needs (made by a reviewed commit, never by this command): run these lines in order"
"""The prose line that precedes the commands (tests find the block by it)."""

FREEZE_TOOL = Path("tools") / "freeze_identity.py"
BASIS_FILE = "command.log"
"""The basis file an identity's ``onboarding_qualification.basis`` URI names in its receipt."""


@dataclass(frozen=True, slots=True)
class StepLine:
    """One printed line: its text and how it is shown (``bold``, ``bold red``, ``yellow``,
    :data:`COMMAND_STYLE` for a runnable command, or plain)."""

    text: str
    style: str = ""


def next_steps(result: Calibration, lane: str, recipe: str, connector: list[str] | None = None) -> list[StepLine]:
    """The verdict on a calibration and, when its rules derive a rule, the commands that seal it
    (the freeze tool derives every number from the receipt again: none is passed to it).
    ``connector``: a connector lane's ``--connector ...`` options, as calibrated."""
    if result.failures:
        return [StepLine("no rule derived: a handoff failed; publish this receipt as its result", "bold red")]
    envelope = result.envelope
    if result.non_deterministic and (envelope is None or not result.passed):
        return [StepLine(f"no rule derived: {result.headline}", "bold red")]
    # A producer declared non-deterministic: its fixture envelope is sealed beside the bounds.
    held = [] if envelope is None else [StepLine(
        f"derived fixture envelope ({envelope.rule}: the producer is declared non-deterministic, so every handoff "
        f"is held to it and no anchor is rechecked): {envelope.handoffs} envelope handoffs over {envelope.starts} "
        f"producer starts, k {'/'.join(repr(k) for k in envelope.multipliers)} for row max, row mean, position, "
        f"layer tensor position", "bold")]
    forced = result.teacher_forced
    if forced is not None and result.passed:
        lead = StepLine(
            f"derived teacher-forced rule (the fixture parts from the cold recompute, each time at a near-tie; "
            f"largest cell value plus one standard deviation over {len(result.cells)} calibration cells): "
            f"maximum_absolute {forced.maximum_absolute!r}, maximum_mean_absolute (per row) "
            f"{forced.maximum_mean_absolute!r}, near_tie_margin {forced.near_tie_margin!r}, "
            f"maximum_changed_row_share {forced.maximum_changed_row_share!r}", "bold")
        return [lead, *held, *freeze_steps(lane, result.receipt_path, connector)]
    if envelope is not None and result.proposed_maximum_absolute is not None:
        lead = StepLine(
            f"derived rule (largest cell value plus one standard deviation over {len(result.cells)} calibration "
            f"cells): maximum_absolute {result.proposed_maximum_absolute!r}, "
            f"maximum_mean_absolute {result.proposed_maximum_mean_absolute!r}", "bold")
        return [lead, *held, *freeze_steps(lane, result.receipt_path, connector)]
    if not result.tokens_exact:
        return [StepLine("no rule derived: the lane does not keep exact tokens on its fixture (an anchor handoff "
                         "diverged) and the teacher-forced rule refuses it (see the receipt's verdict); publish "
                         "this receipt as its result", "bold red")]
    if not result.deterministic:
        return [StepLine("no rule derived: the fixture anchors differ across restarts or environments (see the "
                         "receipt's verdict); no sealed identity can cover it", "bold red")]
    if not result.passed:
        return [StepLine(f"no rule derived: {result.headline}", "bold red")]
    if recipe_named(recipe).rung == 3:
        if result.acceptance_floor is None:
            return [StepLine("rung 3 is bit-exact by its recipe; no draft floor was derived", "bold red")]
        lead = StepLine(f"rung 3 is bit-exact by its recipe: no bound; draft acceptance floor {result.acceptance_floor!r} "
                        f"(one-sided 95 % Wilson lower bound of the fixture anchor's counts)", "bold")
        return [lead, *freeze_steps(lane, result.receipt_path, connector)]
    if result.proposed_maximum_absolute is None or result.proposed_maximum_mean_absolute is None:
        return [StepLine("no bound can be derived from these cells", "yellow")]
    lines = []
    if result.observed_max_abs == 0.0:
        lines.append(StepLine("no drift observed in any cell: the derived bound is the least positive "
                              "double, which only a zero delta meets (a bit-exact rule)", "bold"))
    lines.append(StepLine(
        f"derived rule (largest cell value plus one standard deviation over {len(result.cells)} calibration cells): "
        f"maximum_absolute {result.proposed_maximum_absolute!r}, "
        f"maximum_mean_absolute {result.proposed_maximum_mean_absolute!r}", "bold"))
    return lines + freeze_steps(lane, result.receipt_path, connector)


def identity_name(lane: str) -> str:
    """The file name ``tools/freeze_identity.py --lane`` gives the lane's identity."""
    return f"{lane}-identity-v1.json"


def freeze_steps(lane: str, receipt: Path | None, connector: list[str] | None = None) -> list[StepLine]:
    """The heading and the commands that copy the receipt into ``receipts/``, freeze the lane's
    identity from it (the tool derives its numbers by the stated rules), regenerate the sealed
    data and check it."""
    if receipt is None:
        return [StepLine("the calibration archived no receipt: there is no basis to freeze from", "bold red")]
    if not (REPO_ROOT / FREEZE_TOOL).is_file():
        return [StepLine(f"freezing needs the repository checkout: {FREEZE_TOOL} is not beside this "
                         f"installation ({REPO_ROOT})", "yellow")]
    receipt = receipt.resolve()
    choice = model_choice.chosen()
    # In the checkout, where the freeze writes: a chosen --model's identities live apart.
    contracts = Path("contracts") if choice is None else Path("contracts") / model_choice.MODELS_PREFIX / choice.name
    # A connector lane's identity is its connector's (connectors/<name>-identity-v1.json).
    identity = (contracts / identity_name(lane) if connector is None
                else contracts / "connectors" / identity_name(connector[1]))
    model = [] if choice is None else ["--model", choice.argument]
    freeze = [_python(), str(FREEZE_TOOL), *model, "--lane", lane, *(connector or []),
              "--basis", f"receipt://{receipt.name}/{BASIS_FILE}"]
    if (REPO_ROOT / identity).exists():  # a re-calibrated lane replaces its identity (the commit shows the change)
        freeze.append("--replace")
    freeze.append("--write-sealed")
    commands = [["cd", str(REPO_ROOT)]]
    if receipt.parent != (REPO_ROOT / "receipts").resolve():
        commands.append(["cp", "-r", str(receipt), "receipts/"])
    commands.append(freeze)
    commands.append([*_qualify(), "identity", "check", str(identity), *model])
    unshowable = next((token for command in commands for token in command if not token.isprintable()), None)
    if unshowable is not None:  # a line break or control character: no one-line command can carry it
        return [StepLine(f"no command can be printed on one line for {unshowable!r} (it holds a line break or "
                         f"control character): copy the receipt into receipts/ and run tools/freeze_identity.py "
                         f"by hand (docs/onboarding.md)", "yellow")]
    return [StepLine(f"{COMMANDS_HEADING}, then review and commit receipts/{receipt.name}, {identity} "
                     "and qualify/contract/sealed_data.py:", "bold"),
            *(StepLine(shlex.join(command), COMMAND_STYLE) for command in commands)]


def _python() -> str:
    """The running interpreter: the freeze tool imports the engines this run built."""
    return sys.executable or "python3"


def _qualify() -> list[str]:
    """``qualify`` as the running interpreter's module: run from the checkout, it imports that
    checkout's package, so it reads the sealed data the freeze just wrote (a console script could
    import another install)."""
    return [_python(), "-m", "qualify.interfaces.cli"]

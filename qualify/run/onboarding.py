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
from qualify.core.assets import CONTRACTS_DIR, REPO_ROOT
from qualify.core.errors import Refused
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


def next_steps(result: Calibration, lane: str, recipe: str) -> list[StepLine]:
    """The verdict on a calibration and, when it proposes a rule, the commands that seal it."""
    if result.failures or not result.tokens_exact:
        return [StepLine("no rule proposed: the lane does not keep exact tokens (or a handoff failed) "
                         "on this prompt; publish this receipt as its result", "bold red")]
    if not result.deterministic:
        return [StepLine("no rule proposed: the producer's output differed across restarts or "
                         "environments (see the receipt's verdict); no sealed identity can cover it", "bold red")]
    if recipe_named(recipe).rung == 3:
        return _rung3_steps(result, lane)
    if result.proposed_maximum_absolute is None or result.proposed_maximum_mean_absolute is None:
        return [StepLine("no bound can be proposed from this envelope", "yellow")]
    lines = []
    if result.observed_max_abs == 0.0:
        lines.append(StepLine("no drift observed in any handoff: the proposed bound is the least positive "
                              "double, which only a zero delta meets (a bit-exact rule)", "bold"))
    lines.append(StepLine(
        f"proposed rule (the envelope over every calibration environment, no margin): maximum_absolute "
        f"{result.proposed_maximum_absolute!r}, maximum_mean_absolute {result.proposed_maximum_mean_absolute!r}",
        "bold"))
    rule = ["--maximum-absolute", repr(result.proposed_maximum_absolute),
            "--maximum-mean-absolute", repr(result.proposed_maximum_mean_absolute)]
    return lines + freeze_steps(lane, result.receipt_path, rule)


def _rung3_steps(result: Calibration, lane: str) -> list[StepLine]:
    """Rung 3 has no bound to propose; its draft acceptance floor comes from a measurement
    (``bench/measure_draft.py``), so only a floor already sealed for the lane can be reused."""
    floor = sealed_acceptance_floor(lane)
    if floor is None:
        return [StepLine(f"rung 3 is bit-exact by its recipe; lane {lane} has no sealed draft acceptance floor "
                         "to keep: measure one with bench/measure_draft.py, then freeze with "
                         "tools/freeze_identity.py --acceptance-floor (docs/onboarding.md)", "bold")]
    lead = StepLine(f"rung 3 is bit-exact by its recipe: no bound to propose; the draft acceptance floor stays "
                    f"the sealed {floor!r} (a new floor is measured by bench/measure_draft.py)", "bold")
    return [lead, *freeze_steps(lane, result.receipt_path, ["--acceptance-floor", repr(floor)])]


def sealed_acceptance_floor(lane: str) -> float | None:
    """The draft acceptance floor of the lane's shipped identity, if it has one that loads."""
    from qualify.contract.identity import parse_identity_document
    from qualify.core.strict_json import read_strict_json

    path = CONTRACTS_DIR / identity_name(lane)
    if not path.is_file():
        return None
    try:
        identity = parse_identity_document(read_strict_json(path, "identity"), where=f"identity {path}")
    except Refused:
        return None
    draft = identity.speculative_draft
    return None if draft is None else draft.acceptance_floor


def identity_name(lane: str) -> str:
    """The file name ``tools/freeze_identity.py --lane`` gives the lane's identity."""
    return f"{lane}-identity-v1.json"


def freeze_steps(lane: str, receipt: Path | None, rule: list[str]) -> list[StepLine]:
    """The heading and the commands that copy the receipt into ``receipts/``, freeze the lane's
    identity from it under ``rule`` (freeze tool options), regenerate the sealed data and check it."""
    if receipt is None:
        return [StepLine("the calibration archived no receipt: there is no basis to freeze from", "bold red")]
    if not (REPO_ROOT / FREEZE_TOOL).is_file():
        return [StepLine(f"freezing needs the repository checkout: {FREEZE_TOOL} is not beside this "
                         f"installation ({REPO_ROOT})", "yellow")]
    receipt = receipt.resolve()
    identity = Path("contracts") / identity_name(lane)  # in the checkout, where the freeze writes
    freeze = [_python(), str(FREEZE_TOOL), "--lane", lane, *rule,
              "--basis", f"receipt://{receipt.name}/{BASIS_FILE}"]
    if (REPO_ROOT / identity).exists():  # a re-calibrated lane replaces its identity (the commit shows the change)
        freeze.append("--replace")
    freeze.append("--write-sealed")
    commands = [["cd", str(REPO_ROOT)]]
    if receipt.parent != (REPO_ROOT / "receipts").resolve():
        commands.append(["cp", "-r", str(receipt), "receipts/"])
    commands.append(freeze)
    commands.append([*_qualify(), "identity", "check", str(identity)])
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

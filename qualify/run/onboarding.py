"""What an operator does after ``qualify calibrate``: the proposed rule and the sealed change it needs,
as lines the console prints (and ``--json`` carries), each command runnable exactly as printed."""

from __future__ import annotations

from dataclasses import dataclass

from qualify.contract.lanes import recipe_named
from qualify.run.calibrate import Calibration


@dataclass(frozen=True, slots=True)
class StepLine:
    """One printed line: its text and how it is shown (``bold``, ``bold red``, ``yellow`` or plain)."""

    text: str
    style: str = ""


def next_steps(result: Calibration, lane: str, recipe: str) -> list[StepLine]:
    """The verdict on a calibration and, when it proposes a rule, the freeze command that seals it."""
    receipt_name = result.receipt_path.name if result.receipt_path is not None else "<run-id>"
    if result.failures or not result.tokens_exact:
        return [StepLine("no rule proposed: the lane does not keep exact tokens (or a handoff failed) "
                         "on this prompt; publish this receipt as its result", "bold red")]
    if not result.deterministic:
        return [StepLine("no rule proposed: the producer's output differed across restarts or "
                         "environments (see the receipt's verdict); no sealed identity can cover it", "bold red")]
    if recipe_named(recipe).rung == 3:
        return [StepLine("rung 3 is bit-exact by its recipe: freeze with tools/freeze_identity.py "
                         f"--lane {lane} --acceptance-floor F --basis receipt://{receipt_name}/command.log", "bold")]
    if result.proposed_maximum_absolute is None:
        return [StepLine("no bound can be proposed from this envelope", "yellow")]
    lines = []
    if result.observed_max_abs == 0.0:
        lines.append(StepLine("no drift observed in any handoff: the proposed bound is the least positive "
                              "double, which only a zero delta meets (a bit-exact rule)", "bold"))
    lines.append(StepLine(
        f"proposed rule (the envelope over every calibration environment, no margin): maximum_absolute "
        f"{result.proposed_maximum_absolute}, maximum_mean_absolute {result.proposed_maximum_mean_absolute}", "bold"))
    lines.append(StepLine(
        "sealed change it needs (made by a reviewed commit, never by this command): copy the receipt into "
        "receipts/, then\n"
        f"  tools/freeze_identity.py --lane {lane} --maximum-absolute "
        f"{result.proposed_maximum_absolute} --maximum-mean-absolute "
        f"{result.proposed_maximum_mean_absolute} --basis receipt://{receipt_name}/command.log --write-sealed"))
    return lines

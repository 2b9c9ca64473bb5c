"""``qualify soak --handoffs N --link-floor G [--criteria FILE]``: N back-to-back handoffs against one
producer, under criteria committed before the run (:mod:`qualify.run.soak`).

Exit 0 when the soak passed, 1 when it failed (a producer death, a refused handoff, a payload
other than the anchor's, a rate under the floor), 2 when refused (the command line differs from
the criteria, bad input), 128 + the signal when interrupted; every run leaves a receipt.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from rich.console import Console
from rich.text import Text

from qualify.contract.soak import DEFAULT_SOAK_CRITERIA, check_command_matches, load_soak_criteria
from qualify.core.arguments import (
    OneLineParser,
    deadline_seconds,
    path_argument,
    rate_gbit_per_s,
    require_regular_file,
    say_refusal,
    whole_number,
)
from qualify.core.assets import asset_relpath
from qualify.interfaces.console import (
    MODEL_HELP,
    blocked_line,
    blocked_steps,
    bullet,
    exit_code,
    live_activity,
    operator_console,
    receipt_archive,
    receipt_line,
    refusal_line,
    remote_arguments,
    remote_producer_choice,
    step_line,
)
from qualify.run.qualification import RunOptions
from qualify.run.signals import interrupt_signal, interrupts_raise
from qualify.run.soak import SoakRun


def _parser() -> OneLineParser:
    parser = OneLineParser(prog="qualify soak", description=(
        "Hand off the identity's fixture N times back to back against one producer, N and the rate floor "
        "fixed beforehand in committed soak criteria; a pass at N claims nothing beyond N."))
    parser.add_argument("--handoffs", type=whole_number, required=True, metavar="N",
                        help="how many handoffs: must equal the criteria's")
    parser.add_argument("--link-floor", type=rate_gbit_per_s, required=True, metavar="GBIT_PER_S",
                        help="every handoff's payload rate floor in Gbit/s: must equal the criteria's")
    parser.add_argument("--criteria", type=path_argument, metavar="FILE",
                        help="the committed soak criteria (default: contracts/soak/native-text-unix-v1.json)")
    parser.add_argument("--identity", type=path_argument, help="frozen identity JSON (default: the recipe's shipped lane)")
    parser.add_argument("--model", metavar="NAME|PATH", help=MODEL_HELP)
    parser.add_argument("--receipts", type=path_argument,
                        help="receipt archive (default $QUALIFY_RECEIPTS, else the user data dir)")
    parser.add_argument("--deadline-s", type=deadline_seconds, metavar="SECONDS",
                        help="limit every producer phase to SECONDS (default: from the identity's basis receipt)")
    remote_arguments(parser)
    return parser


def soak_cli(argv: Sequence[str]) -> int:
    """Run one soak: refused before any step when the command line differs from the criteria."""
    args = _parser().parse_args(list(argv))
    if args.criteria is not None:
        require_regular_file("--criteria", args.criteria)
    if args.identity is not None:
        require_regular_file("--identity", args.identity)
    criteria_file = args.criteria or DEFAULT_SOAK_CRITERIA
    criteria = load_soak_criteria(criteria_file)
    shown_file = os.fspath(args.criteria) if args.criteria is not None else asset_relpath(DEFAULT_SOAK_CRITERIA)
    producer_at = remote_producer_choice(args)
    check_command_matches(criteria, f"soak criteria {shown_file}", handoffs=args.handoffs,
                          link_floor_gbit_per_s=args.link_floor, network=producer_at is not None)
    receipt_archive(args.receipts)
    options = RunOptions(recipe=criteria.recipe, identity=args.identity, receipts=args.receipts,
                         command_line=["qualify", "soak", *argv], deadline_s=args.deadline_s, model=args.model,
                         producer_at=producer_at)
    console = operator_console()
    run = SoakRun(options, criteria)
    console.print(Text(f"qualify soak: {criteria.handoffs} handoffs, floor {criteria.link_floor_gbit_per_s:g} Gbit/s "
                       f"{criteria.link_words} (criteria {criteria.name}, sha256 {criteria.sha256[:16]})", style="bold"))
    with interrupts_raise():
        try:
            for label in run.labels:
                if any(not outcome.passed for outcome in run.outcomes.values()):
                    run.step(label)  # blocked by the failed step: shown on one line
                    continue
                with live_activity(console, label) as progress:
                    run.progress = progress
                    outcome = run.step(label)
                console.print(step_line(outcome))
        except KeyboardInterrupt as exc:
            run.interrupted(interrupt_signal(exc))
            raise
        finally:
            run.close()
    refusal = refusal_line(run)
    if refusal is not None:
        say_refusal(refusal)
    _show_report(run, console)
    return exit_code(run)


def _show_report(run: SoakRun, console: Console) -> None:
    """Every handoff's rate, the verdict and its failing reasons, the receipt."""
    blocked = blocked_steps(run)
    if blocked:
        console.print(blocked_line(blocked))
    if run.soak_records:
        rates = " · ".join(
            f"{record['handoff']} {record['payload_gbit_per_s']:.2f}" if record.get("payload_gbit_per_s") is not None
            else f"{record['handoff']} -" for record in run.soak_records)
        console.print(Text(f"payload rate by handoff (Gbit/s): {rates}", overflow="fold"))
    verdict = run.verdict
    if verdict is not None:
        console.print(Text(verdict.headline, style="bold green" if verdict.passed else "bold red", overflow="fold"))
        if not verdict.passed:
            for reason in verdict.reasons:
                console.print(bullet(reason))
    if run.receipt_path is not None:
        console.print(receipt_line(run.receipt_path, " (refused)" if run.refused else ""), soft_wrap=True)

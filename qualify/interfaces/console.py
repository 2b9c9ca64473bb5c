"""What an operator sees: ``qualify --recipe``, ``qualify calibrate`` and ``qualify selftest``.

Drives :class:`qualify.run.qualification.QualificationRun` in-process with rich progress (one line per
progress label), prints the per-sample table, the verdict in the judgement's own words and the
receipt path. Exit codes: 0 qualified, 1 not qualified, 2 refused contract or bad usage,
130 / 143 interrupted by SIGINT / SIGTERM (128 + the signal's number).

Every run leaves a receipt, from its first step on: a refused one (its identity not JSON, of an
unknown lane, with a bound other than the sealed one, its lane unable to run here) is marked
refused, an interrupted one incomplete ("interrupted by SIGINT during <step>"; the producer's
process group is killed first). Arguments are checked before the run begins, and what they refuse
leaves none: a usage error, a missing or non-file --identity, an engine pair no lane runs, an
unknown fault, and a --receipts archive that cannot hold a receipt (its refusal says so). A run
whose identity never loaded has a receipt without identity files, whose summary names no
identity and, when --identity named the file, no lane.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from qualify.archive.layout import archive_dir
from qualify.contract.lanes import LANES, EngineChoice, Recipe, lane_spec
from qualify.core.arguments import (
    OneLineParser,
    deadline_seconds,
    path_argument,
    require_regular_file,
    require_writable_directory,
    say_refusal,
    shown,
)
from qualify.core.errors import Refused
from qualify.run.qualification import (
    STEP_LABELS,
    QualificationRun,
    RunOptions,
    StepOutcome,
    interrupt_signal,
    interrupts_raise,
    signals_held,
)

EXIT_PASS, EXIT_FAILED, EXIT_REFUSED = 0, 1, 2
EXIT_SIGNAL_BASE = 128
"""An interrupted run exits 128 + the signal's number, as a shell reports it: 130 SIGINT, 143 SIGTERM."""

RECIPE_NAMES = [recipe.value for recipe in Recipe]
ENGINE_NAMES = [engine.value for engine in EngineChoice]
MAX_REPETITIONS = 1000
"""The most handoffs one calibration runs (each restarts the producer); more is a typo."""


def _recipe_parser(prog: str) -> argparse.ArgumentParser:
    parser = OneLineParser(prog=prog, description="Run a qualification recipe.")
    parser.add_argument("--recipe", required=True, choices=RECIPE_NAMES)
    parser.add_argument("--identity", type=path_argument, help="frozen identity JSON (default: the recipe's shipped lane)")
    parser.add_argument("--producer", default=EngineChoice.REFERENCE.value, choices=ENGINE_NAMES,
                        help="producer engine (default: reference, the embedded engine; vllm: vLLM "
                             "through the project KV connector, needs tools/install_vllm.sh)")
    parser.add_argument("--consumer", default=EngineChoice.REFERENCE.value, choices=ENGINE_NAMES,
                        help="consumer engine (default: reference; vllm: a second vLLM engine)")
    parser.add_argument("--reference-once", action="store_true",
                        help="compute the cold local recompute once per run instead of per sample")
    parser.add_argument("--drift-graded", action="store_true",
                        help="rung 3: grade deltas instead of refusing at the first logit digest mismatch")
    parser.add_argument("--fault", help="run against a named fault lane (see qualify selftest)")
    parser.add_argument("--receipts", type=path_argument,
                        help="receipt archive (default $QUALIFY_RECEIPTS, else the user data dir)")
    parser.add_argument("--deadline-s", type=deadline_seconds, metavar="SECONDS",
                        help="limit every producer phase (ready, verify, handoff) to SECONDS "
                             "(default: derived from the identity's basis receipt)")
    return parser


def _repetitions(text: str) -> int:
    """``--repetitions``: a whole number of handoffs, 1 to :data:`MAX_REPETITIONS` (ASCII digits
    only: ``int`` would also take ``1_0``, spaces and other scripts' digits)."""
    if not re.fullmatch(r"[0-9]{1,7}", text) or not 1 <= int(text) <= MAX_REPETITIONS:
        raise argparse.ArgumentTypeError(
            f"found {shown(text)}, expected a whole number of handoffs from 1 to {MAX_REPETITIONS}")
    return int(text)


def _receipt_archive(receipts: Path | None) -> Path:
    """The archive a run writes to, refused up front (one line, before any step) when it is a
    file, under a file, or cannot be written: no receipt can be written there, so no run begins."""
    try:
        if receipts is not None:
            return require_writable_directory("--receipts", receipts)
        label = "$QUALIFY_RECEIPTS" if os.environ.get("QUALIFY_RECEIPTS") else "receipt archive (the default)"
        try:
            default = archive_dir(None)
        except RuntimeError:  # pathlib: "~user" with no such user
            raise Refused(f"{label}: cannot expand '~' in {shown(os.environ.get('QUALIFY_RECEIPTS', ''))}") from None
        return require_writable_directory(label, default)
    except Refused as refusal:
        raise Refused(f"{refusal}; no receipt can be written there, so the run did not start") from None


def _check_run_choices(args: argparse.Namespace) -> None:
    """What a recipe run is asked to do, refused before any step: a missing or non-file identity,
    a recipe/producer/consumer pair no lane runs, an unknown fault, an unusable archive."""
    from qualify.engines import faults
    from qualify.run.contract import chosen_lane

    if args.identity is not None:
        require_regular_file("--identity", args.identity)
    chosen_lane(args.recipe, args.producer, args.consumer)
    if args.fault is not None:
        faults.fault_named(args.fault)
    _receipt_archive(args.receipts)


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.{digits}g}" if abs(value) < 1e-3 and value != 0 else f"{value:.{digits}f}"
    return str(value)


def sample_table(records: Sequence[dict[str, Any]]) -> Table:
    """The per-sample table: tokens agreed, drift, payload and phase times."""
    table = Table(title="handoff samples", header_style="bold")
    for column in ("sample", "tokens agreed", "max abs", "mean abs", "payload MB", "Gbit/s",
                   "producer s", "transport s", "verify s", "install s", "decode s", "recompute s"):
        table.add_column(column, justify="right")
    for record in records:
        if record.get("error"):
            table.add_row(str(record.get("repetition")), Text("failed", style="red"), *["-"] * 10)
            continue
        agreed = round(record["token_agreement_rate"] * record["output_tokens"])
        table.add_row(
            str(record["repetition"]), f"{agreed}/{record['output_tokens']}",
            _fmt(record["max_abs"], 6), _fmt(record["mean_abs"], 6),
            _fmt(record["payload_bytes"] / 1e6, 2), _fmt(record["payload_gbit_per_s"], 2),
            *(_fmt(record[name], 3) for name in ("producer_compute_s", "transport_s", "verify_s",
                                                  "install_s", "decode_s", "recompute_s")),
        )
    return table


def _localisation_lines(records: Sequence[dict[str, Any]], kv_only: bool = False) -> list[str]:
    """Where each sample diverged (first token, first rule-breaking row, teacher-forced drift,
    per-layer KV deltas); ``kv_only`` keeps just the KV deltas, for passing runs."""
    lines = []
    for record in records:
        where = record.get("localisation")
        if not where:
            continue
        parts = [f"sample {record['repetition']}:"]
        if kv_only:
            where = {"kv_layer_max_abs": where.get("kv_layer_max_abs")}
        if where.get("first_divergence_position") is not None:
            parts.append(f"first token divergence at step {where['first_divergence_position']} "
                         f"(cold top-1/top-2 margin {_fmt(where.get('cold_margin_at_divergence'), 4)}, "
                         f"{where.get('divergence_class')})")
        if where.get("first_rule_breaking_row") is not None:
            parts.append(f"first logit row over the rule: {where['first_rule_breaking_row']}")
        teacher = where.get("teacher_forced")
        if teacher:
            parts.append(f"teacher-forced drift max {_fmt(teacher['max_abs'], 4)} mean "
                         f"{_fmt(teacher['mean_abs'], 4)}, top-1 flips {teacher['top1_flips']}")
        layers = where.get("kv_layer_max_abs") or []
        if layers:
            parts.append("KV max abs delta per layer (K/V): " + ", ".join(
                f"L{item['layer']} {_fmt(item['k'], 4)}/{_fmt(item['v'], 4)}" for item in layers))
        lines.append(" ".join(parts))
    for record in records:
        if record.get("error"):
            lines.append(f"sample {record.get('repetition')}: {record['error']}")
    return lines


def operator_console() -> Console:
    """Rich console for operator output; wide enough for the sample table in logs and pipes. No
    markup or emoji codes: messages carry operators' paths and arguments, printed as they are."""
    return Console(highlight=False, markup=False, emoji=False, width=None if sys.stdout.isatty() else 160)


def _print_step(console: Console, outcome: StepOutcome) -> None:
    mark, style = ("✓", "green") if outcome.passed else ("✗", "red")
    console.print(Text.assemble((f" {mark} ", style), (f"{outcome.label:<20}", "bold"),
                                f" {outcome.seconds:6.2f} s  ", outcome.message))


def drive(run: QualificationRun, console: Console) -> int:
    """Run every step with progress, then the table, verdict and receipt path; the exit code. A
    refused run (the contract, or the lane cannot run here) says why in one line on stderr."""
    try:
        for label in STEP_LABELS:
            with console.status(f"{label} …"):
                outcome = run.step(label)
            _print_step(console, outcome)
    except KeyboardInterrupt as exc:  # between steps (one during a step has been handled by it)
        run.interrupted(interrupt_signal(exc))
        raise
    finally:
        run.close()  # whatever happened, the receipt is sealed and the producer stopped
    if run.refused:
        refusal = next(outcome for outcome in run.outcomes.values() if outcome.refused)
        say_refusal(f"refused: {refusal.label}: {refusal.message}")
        if run.receipt_path is not None:
            console.print(Text(f"receipt: {run.receipt_path} (refused)"))
        return EXIT_REFUSED
    if run.records:
        console.print(sample_table(run.records))
        failed = run.verdict is None or not run.verdict.passed
        for line in _localisation_lines(run.records, kv_only=not failed):
            console.print(Text(line, style="yellow" if failed else "dim"))
    verdict = run.verdict
    if verdict is not None:
        style = "bold green" if verdict.passed else "bold red"
        console.print(Text(("QUALIFIED: " if verdict.passed else "NOT QUALIFIED: ") + verdict.headline, style=style))
        for reason in verdict.reasons:
            console.print(f"  - {reason}")
    if run.receipt_path is not None:
        console.print(Text(f"receipt: {run.receipt_path}"))
    return EXIT_PASS if verdict is not None and verdict.passed else EXIT_FAILED


def run_cli(argv: Sequence[str]) -> int:
    """``qualify --recipe NAME [...]``: bad input is refused (exit 2, one line) before any step;
    SIGINT or SIGTERM during the run seals its receipt as incomplete, kills the producer's process
    group and exits 130 or 143, saying so in one line on stderr."""
    args = _recipe_parser("qualify").parse_args(list(argv))
    _check_run_choices(args)
    options = RunOptions(
        recipe=args.recipe, identity=args.identity, producer=args.producer,
        consumer=args.consumer, reference_once=args.reference_once, drift_graded=args.drift_graded, fault=args.fault,
        receipts=args.receipts, command_line=["qualify", *argv], deadline_s=args.deadline_s,
    )
    console = operator_console()
    run = QualificationRun(options)
    with interrupts_raise():  # the previous SIGINT/SIGTERM handlers come back when the run ends
        try:
            console.print(Text(f"qualify --recipe {args.recipe}", style="bold"))
            return drive(run, console)
        except KeyboardInterrupt as exc:
            with signals_held(discard=True):  # a second signal does not cut the report short
                return _report_interrupt(run, interrupt_signal(exc))


def _report_interrupt(run: QualificationRun, signum: int) -> int:
    """Seal the interrupted run (if it is not already), say so in one line, exit 128 + ``signum``."""
    run.interrupted(signum)
    where = run.interruption or f"interrupted by {signal.Signals(signum).name}"
    if run.receipt_path is not None and run.verdict is not None:
        say_refusal(f"qualify: {where}; receipt: {run.receipt_path} ({run.verdict.status})")
    else:
        say_refusal(f"qualify: {where}; no receipt was written (none before the run's identity loads)")
    return EXIT_SIGNAL_BASE + signum


def calibrate_cli(argv: Sequence[str]) -> int:
    """``qualify calibrate --recipe R --lane L --repetitions N``: measure, archive, propose."""
    from qualify.run.calibrate import calibrate
    from qualify.run.onboarding import next_steps

    parser = OneLineParser(prog="qualify calibrate",
                           description="Measure a lane's drift envelope and propose its sealed bounds.")
    parser.add_argument("--recipe", required=True, choices=RECIPE_NAMES)
    parser.add_argument("--lane", required=True, choices=list(LANES), metavar="LANE",
                        help="lane name (qualify/contract/lanes.py)")
    parser.add_argument("--repetitions", type=_repetitions, default=5,
                        help=f"handoffs to measure, 1 to {MAX_REPETITIONS} (default 5)")
    parser.add_argument("--receipts", type=path_argument, help="receipt archive for the calibration receipt")
    args = parser.parse_args(list(argv))
    spec = lane_spec(args.lane)
    if spec.recipe.value != args.recipe:
        raise Refused(f"calibrate --lane {args.lane}: its recipe is {spec.recipe.value}, the run is --recipe {args.recipe}")
    _receipt_archive(args.receipts)
    console = operator_console()
    options = RunOptions(recipe=args.recipe, receipts=args.receipts,
                         command_line=["qualify", "calibrate", *argv])
    result = calibrate(args.lane, args.recipe, args.repetitions, options,
                       log=lambda line: console.print(Text(line, style="dim")))
    console.print(sample_table(result.records))
    for line in _localisation_lines(result.records):
        console.print(Text(line, style="yellow"))
    console.print(f"observed envelope: max abs {result.observed_max_abs!r}, "
                  f"mean abs {result.observed_mean_abs!r}; tokens exact in every handoff: {result.tokens_exact}")
    for step in next_steps(result, args.lane, args.recipe):
        console.print(Text(step.text, style=step.style))
    console.print(Text(f"receipt: {result.receipt_path}"))
    return EXIT_PASS if result.tokens_exact and result.deterministic and not result.failures else EXIT_FAILED


def selftest_cli(argv: Sequence[str]) -> int:
    """``qualify selftest [--fault NAME] [--receipts DIR]``: every fault lane must fail, localised."""
    import tempfile

    from qualify.run.selftest import all_fault_runs, run_fault

    parser = OneLineParser(prog="qualify selftest",
                           description="Run the recipes against the fault lanes; each must fail where it was injected.")
    parser.add_argument("--fault", action="append", help="only this fault (repeatable)")
    parser.add_argument("--receipts", type=path_argument,
                        help="archive for the self-test's failing receipts (default: a temporary directory)")
    args = parser.parse_args(list(argv))
    runs = all_fault_runs()
    known = sorted({name for name, _ in runs})
    unknown = [name for name in args.fault or () if name not in known]
    if unknown:  # every name is checked: one typo among several is not silently skipped
        raise Refused(f"selftest --fault: found {shown(unknown[0])}, expected one of {', '.join(known)}")
    pairs = [(name, rung) for name, rung in runs if not args.fault or name in args.fault]
    if args.receipts is not None:
        require_writable_directory("--receipts", args.receipts)
    console = operator_console()
    table = Table(title="fault lanes", header_style="bold")
    for column in ("fault", "recipe", "caught", "localised", "finding"):
        table.add_column(column)
    all_passed = True
    with tempfile.TemporaryDirectory(prefix="qualify-selftest-") as scratch:
        receipts = args.receipts or Path(scratch)
        for name, rung in pairs:
            with console.status(f"fault {name} (rung {rung}) …"):
                result = run_fault(name, rung, receipts)
            all_passed &= result.passed
            table.add_row(name, result.recipe, "yes" if result.caught else Text("NO", style="red"),
                          "yes" if result.localised else Text("NO", style="red"), result.finding)
            console.print(f"{'✓' if result.passed else '✗'} {name} ({result.recipe}): {result.finding}")
    console.print(table)
    console.print(Text("selftest passed: every fault lane failed where it was injected" if all_passed
                       else "selftest FAILED: a fault lane was not caught or not localised",
                       style="bold green" if all_passed else "bold red"))
    return EXIT_PASS if all_passed else EXIT_FAILED

"""What an operator sees: ``qualify --recipe``, ``qualify calibrate`` and ``qualify selftest``.

Drives :class:`qualify.run.qualification.QualificationRun` in-process, one line per finished step
(on a terminal a spinner with the elapsed time shows while a step runs, then gives way to the
step's line; piped to a file or a log, nothing but the lines, no control codes), then the
per-sample table, the verdict in the judgement's own words and the receipt path. Tables fit any
width (:mod:`qualify.interfaces.tables`): no number is ever cut short. Output that is not a
terminal is 160 columns wide, or ``$COLUMNS`` when that is a whole number of at least 40.

``--json`` prints one JSON document on stdout instead (:mod:`qualify.interfaces.documents`),
nothing else there; progress then goes to stderr when stderr is a terminal, else nowhere.

Exit codes: 0 qualified, 1 not qualified, 2 refused contract or bad usage, 128 + the signal's
number when interrupted (130 SIGINT, 143 SIGTERM, 129 SIGHUP).

Every run leaves a receipt, from its first step on: a refused one (its identity not JSON, of an
unknown lane, with a bound other than the sealed one, its lane unable to run here) is marked
refused, an interrupted one incomplete ("interrupted by SIGINT during <step>"; the producer's
process group is killed first). Arguments are checked before the run begins, and what they refuse
leaves none: a usage error, a missing or non-file --identity, an engine pair no lane runs, an
unknown fault, and a --receipts archive that cannot hold a receipt (its refusal says so): one
line on stderr, nothing on stdout (under ``--json``, the refusal document). A run whose identity
never loaded has a receipt without identity files, whose summary names no identity and, when
--identity named the file, no lane.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from qualify.archive.layout import archive_dir
from qualify.contract.lanes import LANES, VLLM_VIA_CONNECTOR_LANE, EngineChoice, Recipe, lane_spec
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
from qualify.handoff.setup import RemoteProducerChoice
from qualify.interfaces import documents
from qualify.interfaces.tables import Field, FittedTable, hanging
from qualify.judge.scope import SERVICE_CONDITIONS
from qualify.run.connector_lane import ConnectorLaneRun, ConnectorRequest
from qualify.run.qualification import STEP_LABELS, QualificationRun, RunOptions, StepOutcome
from qualify.run.signals import interrupt_signal, interrupts_raise, signals_held

if TYPE_CHECKING:
    from qualify.judge import Verdict
    from qualify.run.selftest import FaultResult

EXIT_PASS, EXIT_FAILED, EXIT_REFUSED = 0, 1, 2
EXIT_SIGNAL_BASE = 128
"""An interrupted run exits 128 + the signal's number, as a shell reports it: 130 SIGINT, 143 SIGTERM."""

RECIPE_NAMES = [recipe.value for recipe in Recipe]
ENGINE_NAMES = [engine.value for engine in EngineChoice]
MAX_REPETITIONS = 1000
"""The most handoffs one calibration runs (each restarts the producer); more is a typo."""

PIPE_WIDTH = 160
"""Columns of output that is not a terminal (a log, a pipe): wide enough for the whole sample table."""
MIN_COLUMNS = 40
"""The narrowest ``$COLUMNS`` honoured for such output (a smaller or non-numeric value is ignored)."""


def json_help(command: str) -> str:
    """``--json``'s help, naming the command's current schema file."""
    return f"print one JSON document on stdout (contracts/{documents.schema_file(command)}) instead of the report"


MODEL_HELP = ("a published model's name, a Hugging Face directory or a GGUF file: qualify that model "
              "instead of the shipped one, under its own identities in contracts/models/<name>/ (docs/models.md)")


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
    parser.add_argument("--model", metavar="NAME|PATH", help=MODEL_HELP)
    parser.add_argument("--service-conditions", choices=tuple(SERVICE_CONDITIONS), metavar="aba|recovery",
                        help="also judge determinism under service conditions: aba (three prompts interleaved on "
                             "one warm producer, each equal to its solo run) or recovery (the producer killed and "
                             "started again between handoffs 1 and 2, its handoffs equal to the one before)")
    parser.add_argument("--json", action="store_true", help=json_help("recipe"))
    _connector_arguments(parser)
    remote_arguments(parser)
    return parser


def remote_arguments(parser: argparse.ArgumentParser) -> None:
    """``--producer-at`` and what reaching a running producer needs (TLS files, its run key)."""
    remote = parser.add_argument_group("a producer already running (docs/transport.md)")
    remote.add_argument("--producer-at", metavar="HOST:PORT",
                        help="connect to this running producer (qualify producer serve --port) instead of starting one")
    remote.add_argument("--tls-ca", type=path_argument, metavar="FILE",
                        help="TLS: the only CA the producer's certificate may chain to (qualify keys tls: ca.crt)")
    remote.add_argument("--tls-cert", type=path_argument, metavar="FILE",
                        help="TLS: this consumer's client certificate (consumer.crt)")
    remote.add_argument("--tls-key", type=path_argument, metavar="FILE",
                        help="TLS: its private key (consumer.key, mode 0600)")
    remote.add_argument("--key-file", type=path_argument, metavar="FILE",
                        help="the run key the producer was started with (hex, mode 0600; qualify keys tls: run.key)")
    remote.add_argument("--key-env", metavar="VARIABLE", help="read that run key from this environment variable")


def _connector_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("a KV connector under test, between two vLLM engines (docs/connectors.md)")
    group.add_argument("--connector", metavar="NAME",
                       help="a connector vLLM registers (ExampleConnector, ...) or your class's name with "
                            "--connector-module: lane vllm-via-connector, needs tools/install_vllm.sh")
    group.add_argument("--connector-config", metavar="JSON",
                       help="its kv_connector_extra_config, a JSON object; '{storage}' in a string is a fresh "
                            "folder of the run's, emptied before each handoff")
    group.add_argument("--connector-module", metavar="MODULE", help="the module defining --connector's class")
    group.add_argument("--connector-fault", metavar="FAULT",
                       help="inject this fault into every load (qualify/engines/connector_faults.py): the run must fail")


def connector_request(args: argparse.Namespace, command: str) -> ConnectorRequest | None:
    """``--connector`` and its options as the run will resolve them; options without
    ``--connector`` are refused in one line."""
    from qualify.run.connector_lane import ConnectorRequest

    given = [f"--connector-{name}" for name in ("config", "module", "fault")
             if getattr(args, f"connector_{name}") is not None]
    if args.connector is None:
        if given:
            raise Refused(f"{given[0]}: only with --connector NAME")
        return None
    for option, value in (("--producer-at", getattr(args, "producer_at", None)), ("--fault", getattr(args, "fault", None))):
        if value is not None:
            raise Refused(f"{option}: not with --connector (the connector lane starts its own vLLM engines)")
    if getattr(args, "producer", "reference") != "reference" or getattr(args, "consumer", "reference") != "reference":
        raise Refused(f"{command} --connector: runs vLLM on both sides; leave --producer and --consumer unset")
    return ConnectorRequest(args.connector, args.connector_config, args.connector_module, args.connector_fault)


def _anchors(text: str) -> int:
    """``--anchors``: a whole number of fixture anchor handoffs, 2 to :data:`MAX_REPETITIONS` (ASCII
    digits only: a retained digest must be shown to reproduce at least once)."""
    if not re.fullmatch(r"[0-9]{1,7}", text) or not 2 <= int(text) <= MAX_REPETITIONS:
        raise argparse.ArgumentTypeError(
            f"found {shown(text)}, expected a whole number of anchor handoffs from 2 to {MAX_REPETITIONS}")
    return int(text)


def _whole_number(option: str) -> Callable[[str], int]:
    """A whole-number option (ASCII digits, 1 to :data:`MAX_REPETITIONS`); the rule's own limits
    (an envelope's least handoffs and starts) are checked once every option is read."""
    def parse(text: str) -> int:
        if not re.fullmatch(r"[0-9]{1,7}", text) or not 1 <= int(text) <= MAX_REPETITIONS:
            raise argparse.ArgumentTypeError(f"found {shown(text)}, expected a whole number from 1 to {MAX_REPETITIONS}")
        return int(text)

    parse.__name__ = option
    return parse


def receipt_archive(receipts: Path | None) -> Path:
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
    from qualify.run.run_contract import chosen_lane

    if args.identity is not None:
        require_regular_file("--identity", args.identity)
    chosen_lane(args.recipe, args.producer, args.consumer)
    if args.fault is not None:
        faults.fault_named(args.fault)
    receipt_archive(args.receipts)


def remote_producer_choice(args: argparse.Namespace) -> RemoteProducerChoice | None:
    """``--producer-at`` and what it needs (the run key; TLS unless loopback), refused in one line
    before any step; None without it, and then none of its options may be given."""
    from qualify.handoff.client import is_loopback_host, parse_producer_address
    from qualify.handoff.protocol import KEY_ENV, read_run_key
    from qualify.handoff.tls import client_context

    tls_files = {"--tls-ca": args.tls_ca, "--tls-cert": args.tls_cert, "--tls-key": args.tls_key}
    key_options = {"--key-file": args.key_file, "--key-env": args.key_env}
    if args.producer_at is None:
        given = [name for name, value in {**tls_files, **key_options}.items() if value is not None]
        if given:
            raise Refused(f"{given[0]}: only with --producer-at (a run that starts its producer mints its own "
                          f"run key and speaks over a private socket)")
        return None
    if getattr(args, "fault", None) is not None:
        raise Refused("--fault: not with --producer-at (a fault lane is served by a producer this run starts)")
    if getattr(args, "service_conditions", None) is not None:
        raise Refused("--service-conditions: not with --producer-at (they restart the producer, so they need one "
                      "this run starts)")
    host, port = parse_producer_address(args.producer_at)
    if any(value is not None for value in tls_files.values()):
        missing = [name for name, value in tls_files.items() if value is None]
        if missing:
            raise Refused(f"TLS: {', '.join(missing)} missing; give --tls-ca, --tls-cert and --tls-key together")
        tls = client_context(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key)
    elif not is_loopback_host(host):
        raise Refused(f"--producer-at {args.producer_at}: not loopback; plain TCP would carry the KV in the clear, "
                      f"give --tls-ca, --tls-cert and --tls-key")
    else:
        tls = None
    sources = [(kind, str(value)) for kind, value in (("file", args.key_file), ("env", args.key_env))
               if value is not None]
    if not sources and KEY_ENV in os.environ:
        sources = [("env", KEY_ENV)]
    if len(sources) != 1:
        raise Refused(f"--producer-at: give the producer's run key with exactly one of --key-file or --key-env "
                      f"(or set {KEY_ENV})")
    return RemoteProducerChoice(host=host, port=port, key=read_run_key(sources[0]), tls=tls)


# --------------------------------------------------------------------------- numbers and tables


def _fmt(value: Any, digits: int = 3) -> str:
    """A number for a table cell: ``digits`` decimals, or ``digits`` significant ones below 1e-3
    (so 5.68e-05 seconds never reads as 0.000), in exponent form from 1e9 on (a hostile record's
    1e+43 is not forty digits wide); non-finite values and text as they are."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if abs(value) >= 1e9:
            return f"{value:.{digits}e}"
        return f"{value:.{digits}g}" if abs(value) < 1e-3 and value != 0 else f"{value:.{digits}f}"
    return str(value)


def _drift(value: Any) -> str:
    """A logit delta with the nine significant digits the verdict's text uses, so the table's
    number is the one the rule is compared with."""
    return f"{value:.9g}" if isinstance(value, float) and math.isfinite(value) else _fmt(value)


PHASE_COLUMNS = (("producer s", "producer_compute_s"), ("transport s", "transport_s"), ("verify s", "verify_s"),
                 ("install s", "install_s"), ("decode s", "decode_s"), ("recompute s", "recompute_s"))
SAMPLE_FIELDS = (Field("sample"), Field("tokens agreed"), Field("max abs"), Field("mean abs"), Field("payload MB"),
                 Field("Gbit/s"), *(Field(header) for header, _ in PHASE_COLUMNS))


def _sample_row(record: dict[str, Any]) -> list[str | Text]:
    if record.get("error"):
        return [str(record.get("repetition")), Text("failed", style="red"), *["-"] * (len(SAMPLE_FIELDS) - 2)]
    agreed = documents.tokens_agreed(record)
    payload = record.get("payload_bytes")
    return [
        str(record["repetition"]), f"{_fmt(agreed)}/{_fmt(record.get('output_tokens'))}",
        _drift(record.get("max_abs")), _drift(record.get("mean_abs")),
        _fmt(payload / 1e6 if isinstance(payload, int) else payload, 2), _fmt(record.get("payload_gbit_per_s"), 2),
        *(_fmt(record.get(name), 3) for _, name in PHASE_COLUMNS),
    ]


def sample_table(records: Sequence[dict[str, Any]]) -> FittedTable:
    """The per-sample table: tokens agreed, drift, payload and phase times; folded into column
    groups (each repeating the sample number) where the console is too narrow for all of them."""
    return FittedTable("handoff samples", SAMPLE_FIELDS, [_sample_row(record) for record in records])


SELFTEST_FIELDS = (Field("fault", justify="left"), Field("recipe", justify="left"), Field("caught", justify="left"),
                   Field("localised", justify="left"), Field("finding", wraps=True, justify="left"))


def _yes(flag: bool) -> str | Text:
    return "yes" if flag else Text("NO", style="red")


def selftest_table(results: Sequence[FaultResult]) -> FittedTable:
    """The fault lanes: caught, localised and what was found; one block per fault where narrow."""
    rows = [[result.fault, result.recipe, _yes(result.caught), _yes(result.localised), result.finding]
            for result in results]
    return FittedTable("fault lanes", SELFTEST_FIELDS, rows, narrow="blocks")


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


# --------------------------------------------------------------------------- consoles and progress


def pipe_width() -> int:
    """Columns for output that is not a terminal: ``$COLUMNS`` when it is a whole number of at
    least :data:`MIN_COLUMNS`, else :data:`PIPE_WIDTH`."""
    columns = os.environ.get("COLUMNS", "")
    if re.fullmatch(r"[0-9]{1,5}", columns) and int(columns) >= MIN_COLUMNS:
        return int(columns)
    return PIPE_WIDTH


def operator_console(*, stderr: bool = False) -> Console:
    """Rich console for operator output: a terminal's own width, else :func:`pipe_width`. No
    markup or emoji codes: messages carry operators' paths and arguments, printed as they are."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, highlight=False, markup=False, emoji=False,
                   width=None if stream.isatty() else pipe_width())


def json_progress_console() -> Console:
    """Under ``--json``: stdout holds only the document, so progress goes to stderr on a
    terminal and nowhere otherwise (a log of stderr then holds only refusal lines)."""
    console = operator_console(stderr=True)
    console.quiet = not sys.stderr.isatty()
    return console


@contextmanager
def live_activity(console: Console, description: str) -> Iterator[Callable[[str], None]]:
    """While the body runs: a spinner, ``description`` and the elapsed time, removed when it ends
    (the caller prints what finished). Only on an interactive terminal: elsewhere nothing, so a
    log holds no control codes. Yields a function that replaces the description."""
    if console.quiet or not console.is_interactive:
        yield lambda text: None
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(description, total=None)
        yield lambda text: progress.update(task, description=text)


STEP_LABEL_WIDTH = max(len(label) for label in STEP_LABELS) + 2


def step_line(outcome: StepOutcome) -> Table:
    """A finished step: mark, label, seconds, and its message wrapped under itself."""
    mark, style = ("✓", "green") if outcome.passed else ("✗", "red")
    grid = Table.grid(padding=(0, 1, 0, 0))
    grid.add_column(no_wrap=True, width=2)
    grid.add_column(no_wrap=True, width=STEP_LABEL_WIDTH, style="bold")
    grid.add_column(no_wrap=True, width=8, justify="right")
    grid.add_column(overflow="fold")
    grid.add_row(Text(f" {mark}", style=style), outcome.label, f"{outcome.seconds:.2f} s", outcome.message)
    return grid


def blocked_line(blocked: Sequence[StepOutcome]) -> Text:
    """The steps a failure kept from running, on one line (they share their reason)."""
    return Text(f" · not run ({blocked[0].message}): {', '.join(outcome.label for outcome in blocked)}", style="dim")


def bullet(text: str) -> Table:
    """``  - text``, wrapped lines indented under the text."""
    return hanging("  -", text, lead_width=3)


def verdict_line(verdict: Verdict) -> Text:
    """The run's verdict, once: a verdict with a scope is its headline as the judge wrote it,
    which opens with its scope line (QUALIFIED or NOT QUALIFIED on its fixture, its controls),
    whole and wrapped, never cut; a verdict without one (a run stopped at a step) is prefixed
    with the word, as it carries none of its own."""
    style = "bold green" if verdict.passed else "bold red"
    if verdict.scope is not None:
        return Text(verdict.headline, style=style, overflow="fold")
    return Text(("QUALIFIED: " if verdict.passed else "NOT QUALIFIED: ") + verdict.headline, style=style,
                overflow="fold")


def receipt_line(path: Path, note: str = "") -> Text:
    return Text(f"receipt: {path}{note}")


# --------------------------------------------------------------------------- qualify --recipe


def refusal_line(run: QualificationRun) -> str | None:
    """The one stderr line of a run refused at a step (its contract, or its lane cannot run here)."""
    refusal = next((outcome for outcome in run.outcomes.values() if outcome.refused), None)
    return None if refusal is None else f"refused: {refusal.label}: {refusal.message}"


def blocked_steps(run: QualificationRun) -> list[StepOutcome]:
    """The steps a failed step kept from running (every one after it)."""
    outcomes = [run.outcomes[label] for label in run.labels if label in run.outcomes]
    first_failed = next((index for index, outcome in enumerate(outcomes) if not outcome.passed), len(outcomes))
    return outcomes[first_failed + 1:]


def exit_code(run: QualificationRun) -> int:
    """0 qualified, 1 not qualified, 2 refused (the contract, or the lane cannot run here)."""
    if run.refused:
        return EXIT_REFUSED
    return EXIT_PASS if run.verdict is not None and run.verdict.passed else EXIT_FAILED


def show_report(run: QualificationRun, console: Console) -> None:
    """What follows the step lines of a finished run: the steps it did not run, the sample table
    and where samples diverged, the verdict with its reasons, the receipt path."""
    blocked = blocked_steps(run)
    if blocked:
        console.print(blocked_line(blocked))
    if run.refused:
        if run.receipt_path is not None:
            console.print(receipt_line(run.receipt_path, " (refused)"), soft_wrap=True)
        return
    if run.records:
        console.print(sample_table(run.records))
        failed = run.verdict is None or not run.verdict.passed
        for line in _localisation_lines(run.records, kv_only=not failed):
            console.print(Text(line, style="yellow" if failed else "dim"))
    verdict = run.verdict
    if verdict is not None:
        console.print(verdict_line(verdict))
        for reason in verdict.reasons:
            console.print(bullet(reason))
    if run.receipt_path is not None:
        console.print(receipt_line(run.receipt_path), soft_wrap=True)  # a path is copied whole, never wrapped


def show_run(run: QualificationRun, console: Console) -> None:
    """A finished run's whole console output again, as :func:`drive` printed it (for another width:
    tools/console_screenshots.py renders one run at several)."""
    console.print(header_line(run.options.recipe))
    blocked = blocked_steps(run)
    for label in run.labels:
        outcome = run.outcomes.get(label)
        if outcome is not None and outcome not in blocked:
            console.print(step_line(outcome))
    show_report(run, console)


def header_line(recipe: str) -> Text:
    return Text(f"qualify --recipe {recipe}", style="bold")


def drive(run: QualificationRun, console: Console) -> int:
    """Run every step with progress, then the table, verdict and receipt path; the exit code. A
    refused run (the contract, or the lane cannot run here) says why in one line on stderr."""
    try:
        for label in run.labels:
            if any(not outcome.passed for outcome in run.outcomes.values()):
                run.step(label)  # blocked by the failed step: recorded as not run, shown on one line
                continue
            with live_activity(console, label):
                outcome = run.step(label)
            console.print(step_line(outcome))
    except KeyboardInterrupt as exc:  # between steps (one during a step has been handled by it)
        run.interrupted(interrupt_signal(exc))
        raise
    finally:
        run.close()  # whatever happened, the receipt is sealed and the producer stopped
    refusal = refusal_line(run)
    if refusal is not None:
        say_refusal(refusal)
    show_report(run, console)
    return exit_code(run)


def run_cli(argv: Sequence[str]) -> int:
    """``qualify --recipe NAME [...]``: bad input is refused (exit 2, one line) before any step;
    an interrupt signal during the run seals its receipt as incomplete, kills the producer's
    process group and exits 128 + the signal's number, saying so in one line on stderr."""
    from qualify.run.run_contract import default_identity_path

    args = _recipe_parser("qualify").parse_args(list(argv))
    connector = connector_request(args, "qualify")
    if connector is not None:  # the connector lane: vLLM on both sides, through the operator's connector
        if args.service_conditions is not None:
            raise Refused("--service-conditions: not with --connector (the connector lane's producer is the "
                          "operator's vLLM, which this run does not restart)")
        args.producer = args.consumer = EngineChoice.VLLM.value
    _check_run_choices(args)
    producer_at = remote_producer_choice(args)
    options = RunOptions(
        recipe=args.recipe, identity=args.identity, producer=args.producer,
        consumer=args.consumer, reference_once=args.reference_once, drift_graded=args.drift_graded, fault=args.fault,
        receipts=args.receipts, command_line=["qualify", *argv], deadline_s=args.deadline_s, model=args.model,
        producer_at=producer_at, service_conditions=args.service_conditions,
    )
    console = json_progress_console() if args.json else operator_console()
    run = QualificationRun(options) if connector is None else ConnectorLaneRun(options, request=connector)

    def identity_path() -> Path:  # the default is the chosen model's: known once the run chose it
        return args.identity or default_identity_path(args.recipe, args.producer, args.consumer)

    with interrupts_raise():  # the previous handlers come back when the run ends
        try:
            console.print(header_line(args.recipe))
            code = drive(run, console)
            if args.json:
                with signals_held(discard=True):  # the run is sealed: its document is printed whole
                    documents.emit(_recipe_json(run, code, refusal_line(run), identity_path()))
            return code
        except KeyboardInterrupt as exc:
            with signals_held(discard=True):  # a second signal does not cut the report short
                code, line = _report_interrupt(run, interrupt_signal(exc))
                if args.json:
                    documents.emit(_recipe_json(run, code, line, identity_path()))
                return code


def _recipe_json(run: QualificationRun, code: int, message: str | None, identity_path: Path) -> dict[str, Any]:
    """The run's ``--json`` document, from its sealed receipt."""
    status = "incomplete" if run.interrupted_by is not None else documents.STATUS_BY_EXIT.get(code, "refused")
    return documents.recipe_document(exit_code=code, message=message, recipe=run.options.recipe,
                                     identity_path=identity_path, receipt=run.receipt_path, status=status)


def _report_interrupt(run: QualificationRun, signum: int) -> tuple[int, str]:
    """Seal the interrupted run (if it is not already), say so in one line; 128 + ``signum`` and the line."""
    run.interrupted(signum)
    where = run.interruption or f"interrupted by {signal.Signals(signum).name}"
    if run.receipt_path is not None and run.verdict is not None:
        line = f"qualify: {where}; receipt: {run.receipt_path} ({run.verdict.status})"
    else:
        line = f"qualify: {where}; no receipt was written (none before the run's identity loads)"
    say_refusal(line)
    return EXIT_SIGNAL_BASE + signum, line


# --------------------------------------------------------------------------- calibrate, selftest


def calibrate_cli(argv: Sequence[str]) -> int:
    """``qualify calibrate --recipe R --lane L [--anchors N] [--no-controls]``: measure the lane on
    its calibration set, anchor its fixture, measure its controls, archive, derive the rule."""
    from qualify.judge.scope import controls_words
    from qualify.run.calibrate import ANCHOR_HANDOFFS, ENVELOPE_HANDOFFS, ENVELOPE_STARTS, calibrate
    from qualify.run.onboarding import next_steps

    parser = OneLineParser(prog="qualify calibrate",
                           description="Measure a lane on its calibration set, anchor its fixture and measure its "
                                       "controls; derive its sealed bounds by the stated rule.")
    parser.add_argument("--recipe", required=True, choices=RECIPE_NAMES)
    parser.add_argument("--lane", choices=list(LANES), metavar="LANE",
                        help="lane name (qualify/contract/lanes.py); with --connector: vllm-via-connector")
    parser.add_argument("--anchors", type=_anchors, default=None,
                        help=f"fixture anchor handoffs, 2 to {MAX_REPETITIONS} (default {ANCHOR_HANDOFFS}; none "
                             f"with --non-deterministic)")
    parser.add_argument("--no-controls", action="store_true",
                        help="skip the E2 controls (the receipt then cannot seal an identity that declares them)")
    parser.add_argument("--non-deterministic", action="store_true",
                        help="declare the producer non-deterministic: no anchor; the fixture handed off "
                             "--envelope-handoffs times over --envelope-starts producer starts states its fixture "
                             "envelope (docs/calibration.md)")
    parser.add_argument("--envelope-handoffs", type=_whole_number("--envelope-handoffs"), default=None,
                        help=f"with --non-deterministic: fixture envelope handoffs (default {ENVELOPE_HANDOFFS})")
    parser.add_argument("--envelope-starts", type=_whole_number("--envelope-starts"), default=None,
                        help=f"with --non-deterministic: producer starts they run on (default {ENVELOPE_STARTS})")
    parser.add_argument("--receipts", type=path_argument, help="receipt archive for the calibration receipt")
    parser.add_argument("--model", metavar="NAME|PATH", help=MODEL_HELP)
    parser.add_argument("--json", action="store_true", help=json_help("calibrate"))
    _connector_arguments(parser)
    args = parser.parse_args(list(argv))
    if args.non_deterministic and args.anchors is not None:
        raise Refused("--anchors: a producer declared --non-deterministic retains no anchor (its fixture handoffs "
                      "state the envelope: --envelope-handoffs)")
    for option in ("envelope_handoffs", "envelope_starts"):
        if getattr(args, option) is not None and not args.non_deterministic:
            raise Refused(f"--{option.replace('_', '-')}: only with --non-deterministic")
    anchors = ANCHOR_HANDOFFS if args.anchors is None else args.anchors
    envelope_handoffs = ENVELOPE_HANDOFFS if args.envelope_handoffs is None else args.envelope_handoffs
    envelope_starts = ENVELOPE_STARTS if args.envelope_starts is None else args.envelope_starts
    connector = connector_request(args, "qualify calibrate")
    if connector is not None:
        if args.lane not in (None, VLLM_VIA_CONNECTOR_LANE):
            raise Refused(f"--lane {args.lane}: --connector calibrates lane {VLLM_VIA_CONNECTOR_LANE}")
        args.lane = VLLM_VIA_CONNECTOR_LANE
    elif args.lane is None:
        raise Refused("--lane: required (or --connector NAME for the connector lane)")
    elif args.lane == VLLM_VIA_CONNECTOR_LANE:
        raise Refused(f"--lane {args.lane}: needs --connector NAME")
    from qualify.engines.chosen_model import use_model

    use_model(args.model)
    spec = lane_spec(args.lane)
    if spec.recipe.value != args.recipe:
        raise Refused(f"calibrate --lane {args.lane}: its recipe is {spec.recipe.value}, the run is --recipe {args.recipe}")
    if args.non_deterministic:
        from qualify.run.calibrate import check_envelope_counts

        check_envelope_counts(spec, envelope_handoffs, envelope_starts)  # refused before any step
    receipt_archive(args.receipts)
    console = json_progress_console() if args.json else operator_console()
    options = RunOptions(recipe=args.recipe, receipts=args.receipts,
                         command_line=["qualify", "calibrate", *argv])
    fixture = (f"{envelope_handoffs} envelope handoffs over {envelope_starts} starts" if args.non_deterministic
               else f"{anchors} anchors")
    with live_activity(console, f"calibrate {args.lane}: calibration set, {fixture}") as show:
        def log(line: str) -> None:
            console.print(Text(line, style="dim"))
            show(f"calibrate {args.lane}: {line[:60]}")

        factory: Any = QualificationRun if connector is None else partial(ConnectorLaneRun, request=connector)
        result = calibrate(spec, args.recipe, options, log=log, anchors=anchors,
                           controls=not args.no_controls, run_factory=factory,
                           non_deterministic=args.non_deterministic, envelope_handoffs=envelope_handoffs,
                           envelope_starts=envelope_starts)
    code = EXIT_PASS if result.passed else EXIT_FAILED
    steps = next_steps(result, args.lane, args.recipe, None if connector is None else connector.arguments())
    if args.json:
        documents.emit(documents.calibration_document(result, exit_code=code, recipe=args.recipe,
                                                      anchors=0 if args.non_deterministic else anchors, steps=steps))
        return code
    console.print(sample_table(result.records))
    for line in _localisation_lines(result.records):
        console.print(Text(line, style="yellow"))
    for cell in result.cells:
        console.print(f"cell {cell.document}@{cell.prompt_tokens}: teacher-forced max abs {cell.max_abs!r}, "
                      f"mean abs {cell.mean_abs!r}; greedy tokens exact: {cell.tokens_exact}")
    # One line each, never wrapped: a reader greps them, and the docs quote them.
    console.print(Text(result.headline, style="bold" if result.passed else "bold red"), soft_wrap=True)
    if result.controls is not None:
        console.print(Text(controls_words(result.controls), style="bold"), soft_wrap=True)
    for step in steps:
        console.print(Text(step.text, style=step.style), soft_wrap=True)  # a command is one line, never wrapped
    if result.receipt_path is not None:
        console.print(receipt_line(result.receipt_path), soft_wrap=True)
    return code


def selftest_cli(argv: Sequence[str]) -> int:
    """``qualify selftest [--fault NAME] [--receipts DIR]``: every fault lane must fail, localised."""
    import tempfile

    from qualify.run.selftest import all_fault_runs, run_fault

    parser = OneLineParser(prog="qualify selftest",
                           description="Run the recipes against the fault lanes; each must fail where it was injected.")
    parser.add_argument("--fault", action="append", help="only this fault (repeatable)")
    parser.add_argument("--receipts", type=path_argument,
                        help="archive for the self-test's failing receipts (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help=json_help("selftest"))
    args = parser.parse_args(list(argv))
    runs = all_fault_runs()
    known = sorted({name for name, _ in runs})
    unknown = [name for name in args.fault or () if name not in known]
    if unknown:  # every name is checked: one typo among several is not silently skipped
        raise Refused(f"selftest --fault: found {shown(unknown[0])}, expected one of {', '.join(known)}")
    pairs = [(name, rung) for name, rung in runs if not args.fault or name in args.fault]
    if args.receipts is not None:
        require_writable_directory("--receipts", args.receipts)
    console = json_progress_console() if args.json else operator_console()
    results: list[tuple[int, FaultResult]] = []
    with tempfile.TemporaryDirectory(prefix="qualify-selftest-") as scratch:
        receipts = args.receipts or Path(scratch)
        for name, rung in pairs:
            with live_activity(console, f"fault {name} (rung {rung})") as show:
                result = run_fault(name, rung, receipts, on_step=lambda line: show(f"fault {line[:70]}"))
            results.append((rung, result))
            mark, style = ("✓", "green") if result.passed else ("✗", "red")
            console.print(Text.assemble((mark, style), f" {name} ({result.recipe}): {result.finding}"))
    all_passed = all(result.passed for _, result in results)
    code = EXIT_PASS if all_passed else EXIT_FAILED
    if args.json:
        documents.emit(documents.selftest_document(results, exit_code=code, receipts_kept=args.receipts is not None))
        return code
    console.print(selftest_table([result for _, result in results]))
    console.print(Text("selftest passed: every fault lane failed where it was injected" if all_passed
                       else "selftest FAILED: a fault lane was not caught or not localised",
                       style="bold green" if all_passed else "bold red"))
    return code

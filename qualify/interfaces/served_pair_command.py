"""A running pair of ``vllm serve`` instances, black-box over HTTP (docs/connectors.md, "A served pair"):

* ``qualify calibrate --recipe native-text --prefill-url URL --decode-url URL [--model M]
  --identity PATH [--receipts DIR]`` measures the pair on the calibration set and, when the
  calibration passes, writes its identity to PATH (:mod:`qualify.run.served_calibrate`);
  exit 0 calibrated, 1 the calibration failed (no identity written), 2 refused;
* ``qualify --recipe native-text --prefill-url URL --decode-url URL [--model M] --served-identity
  PATH [--receipts DIR]`` qualifies it under that identity (:mod:`qualify.run.served_pair`);
  exit 0 qualified, 1 not qualified, 2 refused (without ``--served-identity`` too: one line naming
  the calibrate command).

A recipe or calibrate command line that names either URL is one of these (:func:`wants_served_pair`);
the served options are their own group. Every refusal is one line on stderr with a refused receipt.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.text import Text

from qualify.archive.layout import archive_dir
from qualify.contract.lanes import Recipe
from qualify.core.arguments import OneLineParser, path_argument, require_writable_directory, say_refusal
from qualify.core.errors import Refused

SERVED_OPTIONS = ("--prefill-url", "--decode-url")
EXIT_PASS, EXIT_FAILED, EXIT_REFUSED = 0, 1, 2


def wants_served_pair(argv: Sequence[str]) -> bool:
    """Whether a recipe command line names a served pair (either URL option)."""
    return any(token == option or token.startswith(f"{option}=") for token in argv for option in SERVED_OPTIONS)


def add_served_pair_options(parser: argparse.ArgumentParser) -> None:
    """The served-pair option group (shown in ``qualify --recipe NAME --help`` too)."""
    group = parser.add_argument_group("a served prefill/decode pair of vllm serve instances (docs/connectors.md)")
    group.add_argument("--prefill-url", metavar="URL",
                       help="the prefill server (kv_producer), e.g. http://127.0.0.1:8100; with --decode-url")
    group.add_argument("--decode-url", metavar="URL",
                       help="the decode server (kv_consumer); the cold recompute runs there too")
    group.add_argument("--served-identity", metavar="PATH", type=path_argument,
                       help="the pair's identity, written by qualify calibrate --prefill-url ... --identity PATH "
                            "(required: a served pair is judged only under bounds calibrated for it)")


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="qualify", description="Qualify a served prefill/decode pair over HTTP.")
    parser.add_argument("--recipe", required=True, choices=[Recipe.NATIVE_TEXT.value])
    parser.add_argument("--model", metavar="NAME|PATH",
                        help="the model the pair serves (default: the shipped model)")
    parser.add_argument("--receipts", type=path_argument,
                        help="receipt archive (default $QUALIFY_RECEIPTS, else the user data dir)")
    add_served_pair_options(parser)
    return parser


def _archive(receipts: Path | None) -> Path:
    """The receipt archive, refused up front when no receipt can be written there."""
    try:
        if receipts is not None:
            return require_writable_directory("--receipts", receipts)
        try:
            default = archive_dir(None)
        except RuntimeError:  # pathlib: "~user" with no such user
            raise Refused("$QUALIFY_RECEIPTS: cannot expand '~'") from None
        return require_writable_directory("receipt archive", default)
    except Refused as refusal:
        raise Refused(f"{refusal}; no receipt can be written there, so the run did not start") from None


def served_pair_cli(argv: Sequence[str]) -> int:
    """Run the served pair; the exit code."""
    from qualify.run.served_pair import ServedOptions, run_served_pair

    args = _parser().parse_args(list(argv))
    archive = _archive(args.receipts)
    console = Console(highlight=False, markup=False, emoji=False, soft_wrap=True)
    console.print(Text(f"qualify --recipe {args.recipe} (served pair)", style="bold"))
    options = ServedOptions(recipe=args.recipe, prefill_url=args.prefill_url, decode_url=args.decode_url,
                            model=args.model, receipts=archive, command_line=["qualify", *argv],
                            identity=args.served_identity)
    run = run_served_pair(options, lambda line: console.print(Text(line), soft_wrap=True))
    verdict = run.verdict
    if verdict is None:  # pragma: no cover - run_served_pair always judges or refuses
        raise Refused("served pair: ended without a verdict")
    if verdict.refused:
        say_refusal(f"refused: {verdict.reasons[0] if verdict.reasons else verdict.headline}")
    else:
        console.print(Text(verdict.headline, style="bold green" if verdict.passed else "bold red"))
        for reason in verdict.reasons if not verdict.passed else []:
            console.print(Text(f"  - {reason}"))
    if run.receipt_path is not None:
        console.print(Text(f"receipt: {run.receipt_path}" + (" (refused)" if verdict.refused else "")))
    return EXIT_PASS if verdict.passed else EXIT_REFUSED if verdict.refused else EXIT_FAILED


def _calibrate_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="qualify calibrate",
                           description="Calibrate a served prefill/decode pair over HTTP and write its identity.")
    parser.add_argument("--recipe", required=True, choices=[Recipe.NATIVE_TEXT.value])
    parser.add_argument("--model", metavar="NAME|PATH",
                        help="the model the pair serves (default: the shipped model)")
    parser.add_argument("--receipts", type=path_argument,
                        help="receipt archive (default $QUALIFY_RECEIPTS, else the user data dir); the qualification "
                             "resolves the calibration receipt there")
    group = parser.add_argument_group("a served prefill/decode pair of vllm serve instances (docs/connectors.md)")
    group.add_argument("--prefill-url", metavar="URL", help="the prefill server (kv_producer)")
    group.add_argument("--decode-url", metavar="URL", help="the decode server (kv_consumer)")
    group.add_argument("--identity", "--out", dest="identity", metavar="PATH", type=path_argument,
                       help="where to write the pair's identity (a new JSON file; never overwritten)")
    return parser


def served_calibrate_cli(argv: Sequence[str]) -> int:
    """Calibrate the served pair; the exit code."""
    from qualify.run.served_calibrate import run_served_calibration
    from qualify.run.served_pair import ServedOptions

    args = _calibrate_parser().parse_args(list(argv))
    archive = _archive(args.receipts)
    console = Console(highlight=False, markup=False, emoji=False, soft_wrap=True)
    console.print(Text(f"qualify calibrate --recipe {args.recipe} (served pair)", style="bold"))
    options = ServedOptions(recipe=args.recipe, prefill_url=args.prefill_url, decode_url=args.decode_url,
                            model=args.model, receipts=archive, command_line=["qualify", "calibrate", *argv])
    result = run_served_calibration(options, args.identity, lambda line: console.print(Text(line), soft_wrap=True))
    verdict = result.verdict
    if verdict is None:  # pragma: no cover - run_served_calibration always judges or refuses
        raise Refused("served calibration: ended without a verdict")
    if verdict.refused:
        say_refusal(f"refused: {verdict.reasons[0] if verdict.reasons else verdict.headline}")
    else:
        for cell in result.judgement.cells if result.judgement is not None else ():
            console.print(Text(cell.words()), soft_wrap=True)
        console.print(Text(verdict.headline, style="bold green" if verdict.passed else "bold red"))
        for reason in verdict.reasons if not verdict.passed else []:
            console.print(Text(f"  - {reason}"))
    if result.receipt_path is not None:
        console.print(Text(f"receipt: {result.receipt_path}" + (" (refused)" if verdict.refused else "")))
    if result.identity_path is not None:
        console.print(Text(f"identity: {result.identity_path}"))
        console.print(Text(f"next: {result.next_command}"), soft_wrap=True)
    elif not verdict.refused:
        console.print(Text("no identity written: the calibration failed"))
    return EXIT_PASS if verdict.passed else EXIT_REFUSED if verdict.refused else EXIT_FAILED

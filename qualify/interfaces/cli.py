"""The ``qualify`` console script.

Exit codes (:data:`EXIT_CODES`, the same for every command): 0 pass, 1 failed qualification,
2 refused (contract, usage or environment), 70 internal error (a bug in the harness), 128 + N a run
stopped by signal N (130 SIGINT, 143 SIGTERM, 129 SIGHUP; its receipt sealed as incomplete). Every
refusal is one line on stderr, never a traceback. An internal error is one line too, naming where
its traceback was saved (:mod:`qualify.core.internal_error`: in the run's receipt when there is
one, else the user state directory); ``QUALIFY_DEBUG=1`` raises it instead. Under ``--json`` an
internal error prints no document: its exit code is the signal.
Every parser is a :class:`OneLineParser` (a usage error is one line, exit 2), and path options
are refused up front by the ``require_*`` helpers of :mod:`qualify.core.arguments` (empty, a file where a directory belongs,
under a file, unwritable), before any step runs or anything is written.

``--json`` (on ``--recipe``, ``selftest``, ``receipts verify``, ``calibrate`` and ``identity check``)
prints one JSON document on stdout, validating against ``contracts/cli-<command>.v1.schema.json``
(:mod:`qualify.interfaces.documents`), with the same exit code; a refusal is still one line on
stderr, and stdout then holds the short refused document carrying that line.

Commands whose work lives in other modules are *delegated*: each has a loader function whose
plain import runs only when the command runs (so ``qualify --help`` never imports torch or the
engines), and the handler is called as ``handler(argv) -> int`` with the arguments after the
command words (for ``--recipe``, the whole argument list). A handler that cannot be imported makes
the command exit 2 with a one-line "not available".

======================  ==============================================================
command                 handler
======================  ==============================================================
``--recipe NAME ...``   ``qualify.interfaces.console.run_cli``
``receipts verify``     ``qualify.interfaces.verify_command.verify_cli``
``keys``                ``qualify.interfaces.keys_command.keys_cli``
``enroll``              ``qualify.interfaces.enroll_command.enroll_cli``
``calibrate``           ``qualify.interfaces.console.calibrate_cli``
``selftest``            ``qualify.interfaces.console.selftest_cli``
``report``              ``qualify.interfaces.report.report_cli``
``producer serve``      ``qualify.interfaces.producer_command.producer_serve_cli``
``producer expect``     ``qualify.interfaces.producer_command.producer_expect_cli``
``producer supervise``  ``qualify.interfaces.producer_command.producer_supervise_cli``
``producer health``     ``qualify.interfaces.producer_command.producer_health_cli``
``model inspect``       ``qualify.interfaces.model_command.model_inspect_cli``
======================  ==============================================================

A ``--recipe`` run naming ``--prefill-url`` or ``--decode-url`` is a served pair, handled by
``qualify.interfaces.served_pair_command.served_pair_cli``; a ``calibrate`` naming either, by
``qualify.interfaces.served_pair_command.served_calibrate_cli``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, cast

from rich.console import Console
from rich.text import Text

from qualify import __version__
from qualify.contract.lanes import Recipe
from qualify.core.arguments import OneLineParser, path_argument, printable_line
from qualify.core.errors import Refused, one_line
from qualify.core.internal_error import EXIT_INTERNAL_ERROR, InternalError, described, internal_error_line, save_traceback

EXIT_PASS = 0
EXIT_FAILED = 1
EXIT_REFUSED = 2

EXIT_CODES = (
    "Exit codes, the same for every command: 0 qualified (or done); 1 not qualified (a failed "
    "qualification, calibration or self-test, a receipt that does not verify); 2 refused: the "
    "contract, the usage or the environment (one line on stderr); "
    f"{EXIT_INTERNAL_ERROR} internal error, a bug in the harness (one line naming the saved "
    "traceback: in the run's receipt, else the user state directory); 128+N stopped by signal N "
    "(130 SIGINT, 143 SIGTERM, 129 SIGHUP; the receipt sealed as incomplete)."
)
"""The exit codes as ``qualify --help`` states them (docs/troubleshooting.md, "Exit codes")."""

# --------------------------------------------------------------------------- delegates


def _call_with_argv(handler: Callable[..., object], argv: list[str]) -> object:
    return handler(argv)


Handler = Callable[..., object]


def _load_verify() -> Handler:
    from qualify.interfaces.verify_command import verify_cli

    return verify_cli


def _load_keys() -> Handler:
    from qualify.interfaces.keys_command import keys_cli

    return keys_cli


def _load_enroll() -> Handler:
    from qualify.interfaces.enroll_command import enroll_cli

    return enroll_cli


def _load_calibrate() -> Handler:
    from qualify.interfaces.console import calibrate_cli

    return calibrate_cli


def _load_selftest() -> Handler:
    from qualify.interfaces.console import selftest_cli

    return selftest_cli


def _load_report() -> Handler:
    from qualify.interfaces.report import report_cli

    return report_cli


def _load_producer_serve() -> Handler:
    from qualify.interfaces.producer_command import producer_serve_cli

    return producer_serve_cli


def _load_producer_expect() -> Handler:
    from qualify.interfaces.producer_command import producer_expect_cli

    return producer_expect_cli


def _load_producer_supervise() -> Handler:
    from qualify.interfaces.producer_command import producer_supervise_cli

    return producer_supervise_cli


def _load_producer_health() -> Handler:
    from qualify.interfaces.producer_command import producer_health_cli

    return producer_health_cli


def _load_model_inspect() -> Handler:
    from qualify.interfaces.model_command import model_inspect_cli

    return model_inspect_cli


def _load_served_pair() -> Handler:
    from qualify.interfaces.served_pair_command import served_pair_cli

    return served_pair_cli


def _load_served_calibrate() -> Handler:
    from qualify.interfaces.served_pair_command import served_calibrate_cli

    return served_calibrate_cli


def _load_soak() -> Handler:
    from qualify.interfaces.soak_command import soak_cli

    return soak_cli


def _load_recipe() -> Handler:
    from qualify.interfaces.console import run_cli

    return run_cli


@dataclass(frozen=True, slots=True)
class Delegate:
    """A command implemented elsewhere: its words, the loader importing its handler, a help line,
    and how the handler is called (default ``handler(argv)``)."""

    words: tuple[str, ...]
    load: Callable[[], Handler]
    help: str
    call: Callable[[Handler, list[str]], object] = _call_with_argv


DELEGATES: tuple[Delegate, ...] = (
    Delegate(("receipts", "verify"), _load_verify,
             "verify receipts: signature by a trusted key, the signed statement, every file"),
    Delegate(("keys",), _load_keys, "the receipt-signing key: init, show, rotate; a TLS set: tls"),
    Delegate(("enroll",), _load_enroll, "enroll a qualified lane and mint its handoff key"),
    Delegate(("calibrate",), _load_calibrate,
             "measure a lane's drift envelope over repeated handoffs (the basis receipt)"),
    Delegate(("selftest",), _load_selftest, "run the harness's own end-to-end self checks"),
    Delegate(("report",), _load_report, "write an HTML report of one receipt, or a comparison of several"),
    Delegate(("producer", "serve"), _load_producer_serve, "run a producer service process (Unix socket, or TCP under TLS)"),
    Delegate(("producer", "expect"), _load_producer_expect,
             "write the --expect document of a producer a run reaches with --producer-at"),
    Delegate(("producer", "supervise"), _load_producer_supervise,
             "run a producer under supervision: signed startup receipt, restart ritual, backoff, latch"),
    Delegate(("producer", "health"), _load_producer_health,
             "whether a supervised producer is up, ready or latched, and what it serves"),
    Delegate(("soak",), _load_soak,
             "hand off N times back to back against one producer, under committed soak criteria"),
    Delegate(("model", "inspect"), _load_model_inspect,
             "load a model (published name, Hugging Face directory or GGUF file) and print what it is"),
)
RECIPE_DELEGATE = Delegate(("--recipe",), _load_recipe, "run a qualification recipe")
SERVED_PAIR_DELEGATE = Delegate(("--recipe",), _load_served_pair, "qualify a served prefill/decode pair over HTTP")
SERVED_CALIBRATE_DELEGATE = Delegate(("calibrate",), _load_served_calibrate,
                                     "calibrate a served prefill/decode pair over HTTP and write its identity")
SERVED_PAIR_OPTIONS = ("--prefill-url", "--decode-url")
"""A recipe run or a calibration naming either is a served pair (``qualify.interfaces.served_pair_command``)."""

# No markup or emoji codes: messages carry operators' paths and arguments, printed as they are.
_OUT = Console(highlight=False, soft_wrap=True, markup=False, emoji=False)
_ERR = Console(stderr=True, highlight=False, soft_wrap=True, markup=False, emoji=False)


def _debug() -> bool:
    return os.environ.get("QUALIFY_DEBUG") == "1"


def _say_error(message: str) -> None:
    _ERR.print(Text(printable_line(message), style="bold red"))


def _recipe_names() -> list[str]:
    return [recipe.value for recipe in Recipe]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also what ``--help`` shows)."""
    parser = OneLineParser(
        prog="qualify",
        description=(
            "Qualify KV-cache handoff between inference engines against a frozen onboarding "
            "identity, and archive the evidence."
        ),
        epilog=EXIT_CODES,
    )
    parser.add_argument(
        "--recipe",
        metavar="NAME",
        choices=_recipe_names(),
        help=f"run a qualification recipe ({', '.join(_recipe_names())}); "
        "further options go to the recipe runner",
    )
    parser.add_argument("--version", action="version", version=f"qualify {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    identity = commands.add_parser("identity", help="frozen onboarding identities")
    identity_commands = identity.add_subparsers(dest="identity_command", metavar="ACTION")
    identity_commands.required = True
    check = identity_commands.add_parser(
        "check", help="validate an identity file: schema, model rules, its lane's seal and basis receipt"
    )
    check.add_argument("path", metavar="PATH", type=path_argument, help="identity JSON file")
    check.add_argument("--json", action="store_true",
                       help="print one JSON document on stdout (contracts/cli-identity-check.v1.schema.json)")
    check.add_argument("--model", metavar="NAME|PATH",
                       help="the model the identity pins (default: a published model by the name it pins)")

    groups: dict[str, argparse._SubParsersAction[OneLineParser]] = {}
    for delegate in DELEGATES:
        if len(delegate.words) == 1:
            commands.add_parser(delegate.words[0], help=delegate.help, add_help=False)
            continue
        group_name, action = delegate.words
        if group_name not in groups:
            group = commands.add_parser(group_name, help=f"{group_name} commands")
            groups[group_name] = group.add_subparsers(dest=f"{group_name}_command", metavar="ACTION")
            groups[group_name].required = True
        groups[group_name].add_parser(action, help=delegate.help, add_help=False)
    return parser


def _exit_code(label: str, code: object) -> int:
    if type(code) is int and 0 <= code <= 255:
        return code
    _say_error(f"qualify {label}: handler returned {code!r}, expected an exit code 0-255")
    return EXIT_REFUSED


def run_delegate(delegate: Delegate, argv: Sequence[str]) -> int:
    """Load and call a delegated handler; one that cannot be imported is "not available" (exit 2)."""
    label = " ".join(delegate.words)
    try:
        handler = delegate.load()
    except Exception as exc:
        if _debug():
            raise
        _say_error(f"qualify {label}: not available ({type(exc).__name__}: {one_line(str(exc))[:160]})")
        return EXIT_REFUSED
    return _exit_code(label, delegate.call(handler, list(argv)))


def _choose_pinned_model(pinned: str | None, model: str | None, where: str) -> None:
    """Choose the model an identity pins before its basis is rechecked: ``--model`` when given, a
    published model by its name; an identity of a model at a path needs ``--model PATH``."""
    from qualify.engines.chosen_model import use_model
    from qualify.engines.model_source import PUBLISHED_MODELS

    if model is not None:
        use_model(model)
    elif pinned is not None:
        if pinned not in PUBLISHED_MODELS:
            raise Refused(f"{where}: pins the model {pinned}; pass --model PATH (its Hugging Face directory or GGUF file)")
        use_model(pinned)


def identity_check(path: str | os.PathLike[str], *, as_json: bool = False, model: str | None = None) -> int:
    """``qualify identity check PATH [--json] [--model NAME|PATH]``: 0 with lane and digest when
    valid, 2 on refusal."""
    from qualify.contract.identity import identity_sha256, load_identity
    from qualify.run.run_contract import checked_basis

    identity = load_identity(path)
    _choose_pinned_model(identity.model_name, model, f"identity {path}")
    basis = checked_basis(identity, where=f"identity {path}").path
    if as_json:
        from qualify.interfaces import documents

        documents.emit(documents.identity_check_document(Path(path), identity, identity_sha256(identity), basis))
        return EXIT_PASS
    _OUT.print(
        Text(
            f"identity {path}: valid: lane {identity.lane} (lane kind {identity.lane_kind.value}, "
            f"recipe {identity.recipe.value}, rung {identity.rung}, producer mode "
            f"{identity.producer_mode.value}); identity_sha256 {identity_sha256(identity)}"
        )
    )
    return EXIT_PASS


def _wants_recipe(argv: Sequence[str]) -> bool:
    command_words = {words[0] for words in (d.words for d in DELEGATES)} | {"identity"}
    if argv and argv[0] in command_words:
        return False
    return any(token == "--recipe" or token.startswith("--recipe=") for token in argv)


def _asks_version_with_more(argv: list[str]) -> bool:
    """Whether ``argv`` names ``--version`` beside other arguments: argparse would print the
    version and exit 0 before it read them."""
    options = argv[: argv.index("--")] if "--" in argv else argv
    return len(argv) > 1 and "--version" in options


def _dispatch(argv: list[str]) -> int:
    if _asks_version_with_more(argv):
        _say_error("qualify: --version takes no other arguments")
        return EXIT_REFUSED
    if _wants_recipe(argv):
        recipe_parser = OneLineParser(prog="qualify", add_help=False)
        recipe_parser.add_argument("--recipe", metavar="NAME", choices=_recipe_names(), required=True)
        recipe_parser.parse_known_args(argv)
        if any(token.split("=", 1)[0] in SERVED_PAIR_OPTIONS for token in argv):
            return run_delegate(SERVED_PAIR_DELEGATE, argv)
        return run_delegate(RECIPE_DELEGATE, argv)
    if argv[:1] == ["calibrate"] and any(token.split("=", 1)[0] in SERVED_PAIR_OPTIONS for token in argv[1:]):
        return run_delegate(SERVED_CALIBRATE_DELEGATE, argv[1:])
    for delegate in DELEGATES:
        if tuple(argv[: len(delegate.words)]) == delegate.words:
            return run_delegate(delegate, argv[len(delegate.words):])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "identity":
        return identity_check(args.path, as_json=args.json, model=args.model)
    _say_error("qualify: expected a command or --recipe NAME (see qualify --help)")
    return EXIT_REFUSED


JSON_COMMANDS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("receipts", "verify"), "receipts-verify"), (("selftest",), "selftest"), (("calibrate",), "calibrate"),
    (("identity", "check"), "identity-check"),
)
"""The commands that take ``--json`` (beside ``--recipe``): their words and their schema's name."""


def json_command(argv: Sequence[str]) -> str | None:
    """The schema name of the ``--json`` command ``argv`` asks for, or None (no ``--json`` before
    a ``--``, or a command without one)."""
    options = list(argv[: argv.index("--")] if "--" in argv else argv)
    if "--json" not in options:
        return None
    if _wants_recipe(argv):
        return "recipe"
    return next((name for words, name in JSON_COMMANDS if tuple(argv[: len(words)]) == words), None)


class _Watched:
    """A text stream passing every write through, noting whether anything was written and the
    last non-empty line (a refusal is the last line a refused command writes to stderr)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.written = False
        self.last_line = ""
        self._pending = ""

    def write(self, text: str) -> int:
        if text:
            self.written = True
            *complete, self._pending = (self._pending + text).split("\n")
            lines = [line for line in complete if line.strip()]
            if lines:
                self.last_line = lines[-1]
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, isatty, fileno, encoding: the stream's own
        return getattr(self._stream, name)


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point; returns the process exit code. Under ``--json``, a command
    refused before it printed its document (a usage error, a refused argument, an unavailable
    command) prints the short refusal document on stdout, its message the one line on stderr."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    command = json_command(arguments)
    if command is None:
        return _main(arguments)
    saved = sys.stdout, sys.stderr
    out, err = _Watched(sys.stdout), _Watched(sys.stderr)
    sys.stdout, sys.stderr = cast(TextIO, out), cast(TextIO, err)
    try:
        code = _main(arguments)
    finally:
        sys.stdout, sys.stderr = saved
    if code == EXIT_REFUSED and not out.written:
        from qualify.interfaces import documents

        message = err.last_line.strip() or f"qualify {command.replace('-', ' ')}: refused"
        documents.emit(documents.refusal_document(command, message))
    return code


def _main(arguments: list[str]) -> int:
    try:
        return _dispatch(arguments)
    except SystemExit as exc:  # argparse: 0 for --help/--version, 2 for usage errors
        if exc.code is None:
            return EXIT_PASS
        if isinstance(exc.code, int):
            return exc.code
        _say_error(str(exc.code))
        return EXIT_REFUSED
    except Refused as exc:
        _say_error(f"refused: {exc}")
        return EXIT_REFUSED
    except KeyboardInterrupt as exc:  # 128 + the signal: a run's RunInterrupted carries it, Ctrl-C is SIGINT (2)
        _say_error("qualify: interrupted")
        return 128 + int(getattr(exc, "signum", 2))
    except InternalError as exc:  # a run's: its traceback is saved already, in its receipt if it had one
        if _debug():
            raise
        _say_error(f"qualify: {exc}")
        return EXIT_INTERNAL_ERROR
    except Exception as exc:  # nothing explains it: a bug in the harness
        if _debug():
            raise
        _say_error(f"qualify: {internal_error_line(described(exc), save_traceback(exc))}")
        return EXIT_INTERNAL_ERROR


BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
"""The variables through which an operator sets OpenBLAS's thread count (any one of them)."""


def default_blas_threads(environ: dict[str, str] | os._Environ[str]) -> str | None:
    """Where ``environ`` sets no BLAS thread count, set ``OPENBLAS_NUM_THREADS`` to half the CPUs
    this process may run on (at least 1) and return it; else None. A run keeps two engine
    processes busy at once (the consumer here, the producer it starts, which inherits it), and
    OpenBLAS workers beyond the cores spin-wait: on 2 cores the main job took 47-57 CPU seconds
    with OpenBLAS's own default and 27-30 with one thread, in the same wall time. The numpy
    engines' bits do not depend on it (:mod:`qualify.core.numerics`); receipts record it."""
    if any(name in environ for name in BLAS_THREAD_VARIABLES):
        return None
    threads = str(max(1, len(os.sched_getaffinity(0)) // 2))
    environ["OPENBLAS_NUM_THREADS"] = threads
    return threads


def console() -> None:
    """The ``qualify`` executable: :func:`main`, with an interrupt signal that lands after a run
    (its receipt whole, its verdict printed) noted rather than fatal
    (:func:`~qualify.run.signals.hold_interrupts_after_runs`), then the signals blocked
    until the process ends. A decided exit code is never turned into a death by signal; a signal
    during a run is handled there (128 + the signal). BLAS threads default first
    (:func:`default_blas_threads`): OpenBLAS reads them once, when numpy loads."""
    default_blas_threads(os.environ)
    import signal

    started = False
    try:
        from qualify.run.signals import hold_interrupts_after_runs

        hold_interrupts_after_runs()
        started = True
        code = main()
    except KeyboardInterrupt as exc:  # before main, or between the command's end and the block below
        if not started:
            _say_error("qualify: interrupted")
        code = 128 + int(getattr(exc, "signum", signal.SIGINT))
    finally:
        # qualify.run.signals.INTERRUPT_SIGNALS, named here: an interrupt during its import leaves it unbound
        signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))
    sys.exit(code)


if __name__ == "__main__":
    console()

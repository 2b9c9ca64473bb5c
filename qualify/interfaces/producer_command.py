"""``qualify producer serve``, ``expect``, ``supervise`` and ``health``: the producer service's
command line, the ``--expect`` document a producer is started with, and the supervisor of a
resident producer (:mod:`qualify.run.supervisor` says what it does).

``producer serve`` (:func:`producer_serve_cli`; also the process the harness starts, ``python -m
qualify.interfaces.producer_command``) parses and checks its arguments (a refusal is one line on
stderr, exit 2) and runs :func:`qualify.handoff.service.serve`, which says what the service does.

``producer expect`` (:func:`producer_expect_cli`) writes the ``--expect`` document a remote
producer is started with (``qualify producer serve --expect FILE``), derived as a ``qualify
--recipe`` run derives its contract, so the producer's start-time check and the run expect the
same engine. Run it where the consumer runs (its checks are the run's: the identity sealed, its
basis receipt, this host's consumer engine against the identity's pins), then copy the file to
the producer's host. Exit 0 once the file is written whole, 2 on any refusal (one line on stderr,
nothing written).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import re
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from qualify.contract.lanes import LANES, ProducerMode, Recipe
from qualify.core.arguments import (
    DECIMAL_NUMBER,
    OneLineParser,
    deadline_seconds,
    path_argument,
    require_regular_file,
    require_writable_directory,
    require_writable_file,
    say_refusal,
    whole_number,
    whole_number_from,
)
from qualify.core.errors import Refused, one_line
from qualify.engines.faults import fault_named
from qualify.handoff.protocol import (
    DEFAULT_WARMUP_TOKENS,
    DEFAULT_WATCHDOG_S,
    ID_PATTERN,
    KEY_ENV,
    StartRefused,
    read_run_key,
)
from qualify.handoff.service import (
    DEFAULT_ENGINE_FACTORY,
    EngineFactory,
    ServiceConfig,
    load_expectation,
    refused_to_start,
    serve,
)

EXIT_WRITTEN = 0
EXIT_REFUSED = 2

LANE_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
"""What ``producer serve --lane`` takes (the factory refuses a name it does not build)."""

# --------------------------------------------------------------------------- producer serve


class _ServeParser(OneLineParser):
    """The shared one-line parser, its usage error raised as a start refusal (logged in the
    producer's one line, exit 2, as every other refusal before serving)."""

    def error(self, message: str) -> NoReturn:
        raise StartRefused(one_line(f"producer arguments: {message}"))


def _serve_parser() -> _ServeParser:
    # Abbreviated options stay accepted, as they were before this parser joined the shared one
    # (a change of the producer's command line is not a refactor's to make).
    parser = _ServeParser(prog="qualify producer serve", add_help=True, allow_abbrev=True,
                          description="KV handoff producer service (fails closed, exit 75).")
    parser.add_argument("--lane", required=True, help="lane name (e.g. nvfp4-native-splitk)")
    parser.add_argument("--mode", required=True, help="producer mode: exact or native")
    parser.add_argument("--run-id", help="run id recorded in every manifest (default: the one each "
                        "authenticated client names)")
    parser.add_argument("--expect", required=True, type=Path,
                        help="JSON: expected engine version, geometry, digests, identity digest")
    parser.add_argument("--socket", type=Path, help="Unix socket path (default transport)")
    parser.add_argument("--port", type=whole_number_from(0), help="serve loopback TCP on this port instead (0: any)")
    parser.add_argument("--host", default="127.0.0.1", help="TCP address (loopback only unless "
                        "--allow-non-loopback)")
    parser.add_argument("--allow-non-loopback", action="store_true",
                        help="permit a non-loopback TCP address (explicit opt-in; needs TLS)")
    parser.add_argument("--tls-cert", type=Path, help="TLS: this producer's certificate (PEM; qualify keys tls)")
    parser.add_argument("--tls-key", type=Path, help="TLS: its private key (PEM, mode 0600)")
    parser.add_argument("--tls-client-ca", type=Path,
                        help="TLS: the CA a consumer's client certificate must chain to (mutual TLS)")
    parser.add_argument("--watchdog-s", type=deadline_seconds, default=DEFAULT_WATCHDOG_S,
                        help="per-request watchdog in seconds; on expiry the producer exits 75")
    parser.add_argument("--key-fd", type=whole_number_from(0), help="read the hex run key from this descriptor")
    parser.add_argument("--key-file", type=Path, help="read the hex run key from this file")
    parser.add_argument("--key-env", help=f"read the hex run key from this variable "
                        f"(default {KEY_ENV} when set)")
    parser.add_argument("--engine-factory", default=DEFAULT_ENGINE_FACTORY,
                        help="module:function building the engine from (lane, mode)")
    parser.add_argument("--warmup-tokens", type=whole_number, default=DEFAULT_WARMUP_TOKENS)
    parser.add_argument("--ready-fd", type=whole_number_from(0), help="write the ready line here (default stdout)")
    parser.add_argument("--exit-with-stdin", action="store_true",
                        help="exit when stdin reaches EOF (the parent is gone)")
    parser.add_argument("--parent-pid", type=whole_number,
                        help="die with this process, the one that started the producer (Linux: the "
                             "kernel SIGKILLs the producer when it dies; refused if it is not the parent)")
    parser.add_argument("--fault", default=None,
                        help="serve a named fault lane (qualify.engines.faults; self-tests and operators)")
    parser.add_argument("--model", default=None, metavar="NAME|PATH",
                        help="serve the lane on this model (a published name, a Hugging Face directory or a GGUF "
                        "file) instead of the shipped one")
    return parser


def parse_config(argv: Sequence[str] | None) -> ServiceConfig:
    """Parse and validate the command line; refuses (exit 2) with one line naming the option."""
    args = _serve_parser().parse_args(argv)
    try:
        mode = ProducerMode(args.mode)
    except ValueError:
        raise StartRefused(f"--mode: found {args.mode!r}, expected exact or native") from None
    if args.fault is not None:
        try:
            fault_named(args.fault)
        except Refused as refusal:
            raise StartRefused(f"--fault: {one_line(str(refusal))}") from None
    if not LANE_PATTERN.fullmatch(args.lane):
        raise StartRefused(f"--lane: found {args.lane!r}, expected a lane name")
    if args.run_id is not None and not ID_PATTERN.fullmatch(args.run_id):
        raise StartRefused(f"--run-id: found {args.run_id!r}, expected [A-Za-z0-9._:-], 1-128")
    if not (args.watchdog_s > 0 and math.isfinite(args.watchdog_s)):
        raise StartRefused(f"--watchdog-s: found {args.watchdog_s}, expected a positive number")
    if (args.socket is None) == (args.port is None):
        raise StartRefused("transport: give exactly one of --socket PATH or --port N")
    if args.port is not None and not 0 <= args.port <= 65535:
        raise StartRefused(f"--port: found {args.port}, expected 0-65535")
    tls_files = (args.tls_cert, args.tls_key, args.tls_client_ca)
    if any(path is not None for path in tls_files):
        if not all(path is not None for path in tls_files):
            raise StartRefused("TLS: give all of --tls-cert, --tls-key and --tls-client-ca, or none")
        if args.port is None:
            raise StartRefused("TLS: --tls-cert/--tls-key/--tls-client-ca serve TCP; give --port, not --socket")
    if args.port is not None:
        _check_tcp_host(args.host, args.allow_non_loopback, tls=args.tls_cert is not None)
    if args.ready_fd is not None:
        try:
            os.fstat(args.ready_fd)
        except OSError:
            raise StartRefused(f"--ready-fd: {args.ready_fd} is not an open descriptor") from None
    if args.warmup_tokens < 1:
        raise StartRefused(f"--warmup-tokens: found {args.warmup_tokens}, expected >= 1")
    if args.parent_pid is not None and args.parent_pid < 1:
        raise StartRefused(f"--parent-pid: found {args.parent_pid}, expected a process id >= 1")
    sources = [(kind, value) for kind, value in (("fd", args.key_fd), ("file", args.key_file),
                                                   ("env", args.key_env)) if value is not None]
    if not sources and KEY_ENV in os.environ:
        sources = [("env", KEY_ENV)]
    if len(sources) != 1:
        raise StartRefused("run key: give exactly one of --key-fd, --key-file, --key-env (never "
                           "the key itself on the command line)")
    kind, value = sources[0]
    return ServiceConfig(
        lane=args.lane, mode=mode, run_id=args.run_id, expect_path=args.expect,
        socket_path=args.socket, host=args.host, port=args.port,
        allow_non_loopback=args.allow_non_loopback, watchdog_s=float(args.watchdog_s),
        engine_factory=args.engine_factory, warmup_tokens=args.warmup_tokens,
        ready_fd=args.ready_fd, exit_with_stdin=args.exit_with_stdin,
        key_source=(kind, str(value)), fault=args.fault, parent_pid=args.parent_pid, model=args.model,
        tls=None if args.tls_cert is None else (args.tls_cert, args.tls_key, args.tls_client_ca),
    )


def _check_tcp_host(host: str, allow_non_loopback: bool, *, tls: bool) -> None:
    """Loopback, or a non-loopback address the operator opted into and serves under TLS (a
    handed-off prompt's KV is never readable on a network)."""
    if host == "localhost":
        return
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise StartRefused(f"--host: found {host!r}, expected an IP address or localhost") from None
    if address.is_loopback:
        return
    if not allow_non_loopback:
        raise StartRefused(f"--host: {host} is not loopback; pass --allow-non-loopback to serve it")
    if not tls:
        raise StartRefused(f"--host: {host} is not loopback and plain TCP would put the KV on the network in "
                           f"the clear; serve it with --tls-cert, --tls-key and --tls-client-ca")


def producer_serve_cli(argv: Sequence[str] | None = None, *, factory: EngineFactory | None = None) -> int:
    """``qualify producer serve ...``: run the producer service; returns its exit status (2 when
    refused before serving; 75 exits happen in place)."""
    try:
        config = parse_config(argv)
    except StartRefused as refusal:
        return refused_to_start(refusal)
    return serve(config, factory=factory)


# --------------------------------------------------------------------------- producer expect


def _expect_parser() -> OneLineParser:
    parser = OneLineParser(prog="qualify producer expect",
                           description="Write the --expect document of a producer a run reaches with --producer-at "
                                       "(docs/transport.md).")
    parser.add_argument("--recipe", required=True, choices=[recipe.value for recipe in Recipe])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--identity", type=path_argument, metavar="FILE",
                       help="the frozen identity the run will be under (default: the recipe's shipped lane)")
    which.add_argument("--lane", choices=list(LANES), metavar="LANE",
                       help="the lane whose frozen identity the run will be under (contracts/<lane>-identity-v1.json)")
    parser.add_argument("--model", metavar="NAME|PATH",
                        help="the model the run qualifies (as qualify --recipe --model; default: the shipped one)")
    parser.add_argument("--out", required=True, type=path_argument, metavar="FILE",
                        help="where to write the document (replaced whole)")
    return parser


def expectation_document(recipe: str, *, identity: Path | None = None, lane: str | None = None,
                         model: str | None = None) -> tuple[dict[str, object], str, str]:
    """The ``--expect`` document of a run of ``recipe`` under ``identity`` (or ``lane``'s frozen
    identity, or the recipe's shipped lane), with the lane and producer mode to serve it as."""
    from qualify.engines.chosen_model import use_model
    from qualify.run.run_contract import default_identity_path, identity_path_for_lane, run_contract

    use_model(model)
    if identity is None:
        identity = default_identity_path(recipe) if lane is None else identity_path_for_lane(lane)
        require_regular_file(f"--lane {lane}: its identity" if lane is not None else f"--recipe {recipe}: its identity",
                             identity)
    contract = run_contract(recipe, identity)
    if lane is not None and contract.lane != lane:
        raise Refused(f"--lane {lane}: its identity file {identity} is of lane {contract.lane}")
    return contract.expectation.to_document(), contract.lane, contract.producer_mode.value


def producer_expect_cli(argv: Sequence[str]) -> int:
    """``qualify producer expect --recipe R [--identity FILE | --lane L] [--model M] --out FILE``."""
    from qualify.interfaces.report import write_atomically

    args = _expect_parser().parse_args(list(argv))
    try:
        out = require_writable_file("--out", args.out)
        if args.identity is not None:
            require_regular_file("--identity", args.identity)
        document, lane, mode = expectation_document(args.recipe, identity=args.identity, lane=args.lane,
                                                    model=args.model)
        write_atomically(out, (json.dumps(document, indent=2, sort_keys=True) + "\n").encode("utf-8"), "--out")
    except Refused as refusal:
        say_refusal(f"qualify producer expect: {refusal}")
        return EXIT_REFUSED
    model = "" if args.model is None else f" --model {shlex.quote(args.model)}"
    print(f"producer expect: wrote {out} (lane {lane}, mode {mode}, identity sha256 {document['identity_sha256']}); "
          f"serve it with: qualify producer serve --lane {lane} --mode {mode} --expect {shlex.quote(str(out))}{model} ...",
          flush=True)
    return EXIT_WRITTEN


if __name__ == "__main__":
    sys.exit(producer_serve_cli())


# --------------------------------------------------------------------------- producer supervise / health

SUPERVISOR_OWN_OPTIONS = ("--ready-fd", "--parent-pid", "--exit-with-stdin")
"""``producer serve`` options the supervisor sets itself (it reads the ready line, and the
producer dies with it), refused among the arguments it is given."""


def _seconds(*, zero: bool = False) -> Callable[[str], float]:
    """argparse ``type``: a finite number of seconds in ASCII decimals, positive (or, with
    ``zero``, zero or more)."""
    def parse(text: str) -> float:
        value = float(text) if DECIMAL_NUMBER.fullmatch(text) else math.nan
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            least = "zero or more" if zero else "a positive number of"
            raise argparse.ArgumentTypeError(f"found {text!r}, expected {least} seconds")
        return value
    return parse


def _count(text: str) -> int:
    if not re.fullmatch(r"[0-9]{1,3}", text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"found {text!r}, expected a whole number from 1 to 999")
    return int(text)


def _supervise_parser() -> OneLineParser:
    parser = OneLineParser(prog="qualify producer supervise",
                           description="Run a producer under supervision: readiness by a signed startup receipt, "
                                       "restart with stale state moved aside, backoff, latch (docs/transport.md). "
                                       "Usage: qualify producer supervise --state-dir DIR [options] -- "
                                       "<producer serve arguments>")
    parser.add_argument("--state-dir", required=True, type=path_argument, metavar="DIR",
                        help="state.json, the startup receipt, stale/, latched.json, producer.log")
    parser.add_argument("--failures-to-latch", type=_count, default=3,
                        help="consecutive failures after which it latches off (default 3)")
    parser.add_argument("--backoff-s", type=_seconds(), default=1.0,
                        help="wait after the first failure, doubled per consecutive failure (default 1)")
    parser.add_argument("--stable-s", type=_seconds(zero=True), default=60.0,
                        help="a producer ready this long before it ends is not a failure (default 60)")
    parser.add_argument("--ready-timeout-s", type=_seconds(), default=1800.0,
                        help="a start not ready within this is a failure (default 1800)")
    return parser


def producer_supervise_cli(argv: Sequence[str] | None = None) -> int:
    """``qualify producer supervise --state-dir DIR [options] -- <producer serve arguments>``:
    exit 0 when a signal stopped it, 69 latched, 2 refused before starting (one line)."""
    from qualify.archive.keys import ensure_signing_key
    from qualify.run.supervisor import SupervisorConfig, supervise

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        say_refusal("qualify producer supervise: error: give the producer's arguments after --, as "
                    "`qualify producer supervise --state-dir DIR -- --lane ... --mode ...`")
        return EXIT_REFUSED
    split = argv.index("--")
    options = _supervise_parser().parse_args(argv[:split])
    serve_argv = argv[split + 1:]
    own = [option for option in SUPERVISOR_OWN_OPTIONS
           if any(word == option or word.startswith(option + "=") for word in serve_argv)]
    try:
        if own:
            raise StartRefused(f"{own[0]}: the supervisor sets it itself; leave it out of the producer's arguments")
        config = parse_config(serve_argv)  # every producer argument checked before anything starts
        kind, value = config.key_source
        if kind == "fd":
            raise StartRefused("--key-fd: a supervised producer rereads its run key at every restart; give "
                               "--key-file or --key-env")
        if kind == "file":
            read_run_key(config.key_source)  # refused now, not at each of three starts before a latch
        load_expectation(config.expect_path)
        state_dir = require_writable_directory("--state-dir", options.state_dir) if options.state_dir.exists() \
            else options.state_dir
        key = ensure_signing_key()
    except (StartRefused, Refused) as refusal:
        say_refusal(f"qualify producer supervise: {one_line(str(refusal))}")
        return EXIT_REFUSED
    try:
        return supervise(SupervisorConfig(
            serve_argv=tuple(serve_argv), state_dir=state_dir, socket_path=config.socket_path,
            failures_to_latch=options.failures_to_latch, first_backoff_s=options.backoff_s,
            stable_s=options.stable_s, ready_timeout_s=options.ready_timeout_s), key)
    except Refused as refusal:  # another supervisor holds the state directory
        say_refusal(f"qualify producer supervise: {one_line(str(refusal))}")
        return EXIT_REFUSED


def producer_health_cli(argv: Sequence[str] | None = None) -> int:
    """``qualify producer health --state-dir DIR [--trust FILE] [--json]``: one line (or a JSON
    document); exit 0 ready, 1 starting, backing off, stopped or down, 69 latched, 2 refused (no
    state, or a startup receipt whose signature does not verify)."""
    from qualify.archive.keys import default_trust_path, load_trust
    from qualify.run.supervisor import health

    parser = OneLineParser(prog="qualify producer health",
                           description="Whether a supervised producer is up, ready or latched, and what it serves.")
    parser.add_argument("--state-dir", required=True, type=path_argument, metavar="DIR")
    parser.add_argument("--trust", type=path_argument, help="trust file the startup receipt's signer must be in "
                        "(default: the operator's)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    options = parser.parse_args(argv)
    try:
        found = health(options.state_dir, load_trust(options.trust or default_trust_path()))
    except Refused as refusal:
        say_refusal(f"qualify producer health: {one_line(str(refusal))}")
        return EXIT_REFUSED
    document = found.document()
    if options.json:
        print(json.dumps(document, sort_keys=True))
    elif found.status == "ready":
        identity = document["identity"]
        print(f"ready: lane {identity['lane']}, mode {identity['producer_mode']}, run key {str(identity['key_id'])[:16]}…, "
              f"at {identity['address']}, producer pid {identity['pid']}, startup receipt verified "
              f"(ready since {document['ready_utc']}, {document['restarts']} restarts)")
    elif found.status == "latched":
        print(f"latched: {document['reason']}")
    else:
        pid = document.get("supervisor_pid")
        print({"down": f"down: the supervisor (pid {pid}) is not running and did not stop itself",
               "stopped": f"stopped: the supervisor (pid {pid}) stopped, and its producer with it"}.get(
                   found.status, f"{found.status}: not ready yet (supervisor pid {pid})"))
    return found.exit_code

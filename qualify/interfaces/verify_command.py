"""``qualify receipts verify [--trust FILE] [--json] [PATH ...]``: every receipt under the paths
checked by :mod:`qualify.archive.verify`, one line each and a tally, or one JSON document
(``contracts/cli-receipts-verify.v2.schema.json``). Exit 0 every receipt verified, 1 any unsigned,
untrusted or tampered, 2 unusable input (one line on stderr)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from qualify.archive.keys import default_trust_path, load_trust
from qualify.archive.layout import default_archive_dir
from qualify.archive.verify import shown, verify_document, verify_paths
from qualify.core.arguments import OneLineParser, path_argument, say_refusal
from qualify.core.errors import Refused


def _parser() -> OneLineParser:
    parser = OneLineParser(prog="qualify receipts verify",
                           description="Verify receipts: signature, signed statement, every file.")
    parser.add_argument("paths", nargs="*", metavar="PATH", type=path_argument, help="receipts or archives")
    parser.add_argument("--trust", type=path_argument,
                        help=f"trust file of public keys (default {default_trust_path()} when it exists)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document on stdout (contracts/cli-receipts-verify.v2.schema.json)")
    return parser


def _listable(target: Path) -> None:
    """Refuse ``target`` unless it is a directory that can be listed (each path is checked before
    any report and named: with several, the refusal says which one)."""
    try:
        if not target.is_dir():
            raise Refused(f"receipts verify: {shown(str(target))}: no such directory")
        os.listdir(target)
    except OSError as exc:  # is_dir itself raises for some, a name too long say
        raise Refused(f"receipts verify: {shown(str(target))}: cannot list "
                      f"({exc.strerror or type(exc).__name__})") from None


def verify_cli(args: Sequence[str]) -> int:
    """``qualify receipts verify [--trust FILE] [--json] [PATH ...]``: PATH is a receipt or an
    archive (default: the archive location); FILE a trust file (default: the operator's, when it
    exists). Exit 0 every receipt verified, 1 any unsigned, untrusted or tampered, 2 unusable
    input (one line on stderr). ``--json`` prints one document on stdout instead of the report."""
    try:
        options = _parser().parse_args(list(args))
    except SystemExit as exit_:
        return 0 if exit_.code == 0 else 2
    try:
        trust_path = options.trust or default_trust_path()
        trust = load_trust(trust_path) if options.trust or os.path.lexists(trust_path) else None
        targets = [Path(path).expanduser() for path in options.paths] or [default_archive_dir()]
        for target in targets:
            _listable(target)
        if not options.json:
            return verify_paths(targets, trust, sys.stdout)
        document = verify_document(targets, trust, trust_path)
    except Refused as refusal:
        say_refusal(str(refusal))
        return 2
    sys.stdout.write(json.dumps(document, indent=2, allow_nan=False) + "\n")
    sys.stdout.flush()
    code: int = document["exit_code"]
    return code

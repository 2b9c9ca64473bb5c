"""``qualify enroll``: enroll a qualified producer lane and mint its handoff key
(:mod:`qualify.run.enroll`). Every path option is refused up front, in one line naming it, before
anything is read or minted. Exit 0 enrolled, 2 refused (one line on stderr)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from qualify.archive.keys import default_trust_path, load_trust
from qualify.archive.layout import archive_dir
from qualify.archive.reader import resolve_receipt_uri
from qualify.core.arguments import (
    OneLineParser,
    path_argument,
    require_directory,
    require_writable_directory,
    require_writable_file,
    say_refusal,
)
from qualify.core.errors import Refused
from qualify.run.enroll import default_key_dir, default_registry_path, enroll


def _default_location(label: str, locate: Callable[[], Path]) -> Path:
    """A default location (from the environment or the home directory), refused in one line
    when its ``~`` cannot expand."""
    try:
        return locate()
    except RuntimeError:  # pathlib: "~user" with no such user, or no home directory
        raise Refused(f"{label}: the default location cannot expand '~'; name it explicitly") from None


def _checked_places(options: Any) -> tuple[Path, Path, Path | None]:
    """(registry, key directory, receipt archive or None) of ``qualify enroll``, each refused up
    front with one line naming its option: a registry that is a directory, a key directory that
    is a file, anything unwritable, a receipt archive that is not a directory. (The identity is
    refused by its loader, in one line, before any key exists.)"""
    registry = require_writable_file(
        "--registry" if options.registry else "registry (the default)",
        options.registry or _default_location("--registry", default_registry_path))
    keys = require_writable_directory(
        "--keys" if options.keys else "key directory (the default)",
        options.keys or _default_location("--keys", default_key_dir))
    receipts = None if options.receipts is None else require_directory("--receipts", options.receipts)
    return registry, keys, receipts


def _receipt_argument(text: str) -> str:
    """``--receipt``: a receipt URI as given, or a directory path (refused when empty or unusable)."""
    if text.startswith("receipt://"):
        return text
    return os.fspath(path_argument(text))


def _parser() -> OneLineParser:
    parser = OneLineParser(prog="qualify enroll",
                           description="Enroll a qualified producer lane and mint its handoff key.")
    parser.add_argument("--identity", required=True, type=path_argument,
                        help="frozen onboarding identity JSON of the lane")
    parser.add_argument("--receipt", required=True, type=_receipt_argument,
                        help="the lane's qualification receipt: a directory or receipt://<run-id>/<file>")
    parser.add_argument("--registry", default=None, type=path_argument,
                        help=f"enrollment registry (default {default_registry_path()})")
    parser.add_argument("--keys", default=None, type=path_argument, help=f"key directory (default {default_key_dir()})")
    parser.add_argument("--receipts", default=None, type=path_argument, help="receipt archive for receipt:// URIs")
    parser.add_argument("--trust", default=None, type=path_argument,
                        help=f"trust file of receipt-signing keys (default {default_trust_path()})")
    parser.add_argument("--rotate", action="store_true",
                        help="re-enroll an enrolled lane: a new handoff key, the old one revoked on the record")
    return parser


def enroll_cli(args: Sequence[str]) -> int:
    """``qualify enroll --identity PATH --receipt DIR|receipt://<run-id>/<file> [--registry PATH]
    [--keys DIR] [--receipts DIR] [--trust FILE] [--rotate]``: exit 0 when enrolled, 2 when
    refused (one line on stderr; every path option is checked before anything is read or minted;
    the trust file defaults to the operator's, and a missing one is refused)."""
    parser = _parser()
    try:
        options = parser.parse_args(list(args))
    except SystemExit as exit_:
        return 0 if exit_.code == 0 else 2
    try:
        registry, keys, receipts = _checked_places(options)
        receipt = options.receipt
        if receipt.startswith("receipt://"):
            run_id = receipt.removeprefix("receipt://").partition("/")[0]
            resolve_receipt_uri(receipt, archive_dir(receipts))
            receipt_path = archive_dir(receipts) / run_id
        else:
            receipt_path = require_directory("--receipt", Path(receipt))
        trust = load_trust(options.trust or default_trust_path())
        enrollment = enroll(options.identity, receipt_path, registry, keys, trust=trust, rotate=options.rotate)
    except Refused as refusal:
        say_refusal(str(refusal))
        return 2
    print(
        f"enrolled {enrollment.lane} ({enrollment.lane_kind.value}, {enrollment.recipe.value}): "
        f"key {enrollment.key_id}, receipt {enrollment.receipt}"
    )
    return 0

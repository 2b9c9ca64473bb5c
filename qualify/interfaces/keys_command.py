"""``qualify keys init|show|rotate|tls``: the operator's receipt-signing key
(:mod:`qualify.archive.keys`) and the TLS set of a producer on another host
(:mod:`qualify.handoff.tls`). Exit 0 done, 2 refused (one line on stderr)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from qualify.archive.keys import ALGORITHM, TRUST_FILE, init_key, load_signing_key, rotate_key, trust_file_of
from qualify.archive.layout import json_bytes
from qualify.core.arguments import OneLineParser, path_argument, say_refusal, whole_number
from qualify.core.errors import Refused, one_line
from qualify.handoff.tls import DEFAULT_VALID_DAYS, SET_FILES, issue_tls_set


def _parser() -> OneLineParser:
    parser = OneLineParser(prog="qualify keys", description="The operator's receipt-signing key.")
    commands = parser.add_subparsers(dest="command", required=True)
    init = commands.add_parser("init", help="make the signing key (refused when one exists)")
    init.add_argument("--comment", default=None, help="a note kept with the key in the trust file")
    show = commands.add_parser("show", help="print the public key and its key id")
    show.add_argument("--trust-file", action="store_true",
                      help="print a trust file holding only this key (for an auditor's --trust)")
    rotate = commands.add_parser("rotate", help="replace the key, recording the old one's revocation")
    rotate.add_argument("--reason", required=True, help="why the key is replaced (kept in the trust file)")
    tls = commands.add_parser("tls", help="issue a TLS set for a producer on another host: CA, producer and "
                              "consumer certificates and keys, a run key (docs/transport.md)")
    tls.add_argument("--dir", required=True, type=path_argument, help="an empty or new directory for the set")
    tls.add_argument("--producer-host", required=True, action="append", metavar="NAME|ADDRESS",
                     help="a host name or IP address consumers dial the producer by (repeatable)")
    tls.add_argument("--valid-days", type=whole_number, default=DEFAULT_VALID_DAYS,
                     help=f"how long the certificates are valid (default {DEFAULT_VALID_DAYS})")
    return parser


def keys_cli(args: Sequence[str]) -> int:
    """``qualify keys init|show|rotate|tls``: exit 0 done, 2 refused (one line on stderr)."""
    try:
        options = _parser().parse_args(list(args))
    except SystemExit as exit_:
        return 0 if exit_.code == 0 else 2
    try:
        if options.command == "init":
            key = init_key(comment=options.comment)
            print(f"signing key {key.key_id} made at {key.path}; trusted in {key.path.parent / TRUST_FILE}")
        elif options.command == "show":
            key = load_signing_key()
            if options.trust_file:
                sys.stdout.write(json_bytes(trust_file_of(key).document()).decode("utf-8"))
            else:
                print(f"key id      {key.key_id}\nalgorithm   {ALGORITHM}\npublic key  {key.public.hex()}\n"
                      f"file        {key.path}")
                sys.stdout.write(key.public_pem())
        elif options.command == "tls":
            issued = issue_tls_set(options.dir, options.producer_host, valid_days=options.valid_days)
            print(f"TLS set written to {issued.directory}: {', '.join(SET_FILES)}\n"
                  f"ca.crt        sha256 {issued.ca_sha256}\nproducer.crt  sha256 {issued.producer_sha256}\n"
                  f"consumer.crt  sha256 {issued.consumer_sha256}\n"
                  f"the CA's private key was not kept: no further certificate chains to this CA")
        else:
            key, old = rotate_key(options.reason)
            print(f"signing key {old} revoked ({one_line(options.reason)}); new key {key.key_id} at {key.path}")
    except Refused as refusal:
        say_refusal(str(refusal))
        return 2
    return 0

"""``qualify producer expect``: the ``--expect`` document a remote producer is started with
(``qualify producer serve --expect FILE``), derived as a ``qualify --recipe`` run derives its
contract, so the producer's start-time check and the run expect the same engine.

Run it where the consumer runs (its checks are the run's: the identity sealed, its basis
receipt, this host's consumer engine against the identity's pins), then copy the file to the
producer's host. Exit 0 once the file is written whole, 2 on any refusal (one line on stderr,
nothing written).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path

from qualify.contract.lanes import LANES, Recipe
from qualify.core.arguments import (
    OneLineParser,
    path_argument,
    require_regular_file,
    require_writable_file,
    say_refusal,
)
from qualify.core.errors import Refused

EXIT_WRITTEN = 0
EXIT_REFUSED = 2


def _parser() -> OneLineParser:
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
    from qualify.run.contract import default_identity_path, identity_path_for_lane, run_contract

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

    args = _parser().parse_args(list(argv))
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

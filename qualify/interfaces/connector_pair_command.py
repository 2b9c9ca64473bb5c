"""The connector pair's command: ``python -m qualify.interfaces.connector_pair_command``.

``producer`` and ``consumer`` are the two engine processes :mod:`qualify.engines.connector_pair`
starts (one vLLM engine per process); ``pair`` runs both for a connector named on the command line
and prints one summary line. May import the engines layer and below.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from qualify.core import assets
from qualify.core.arguments import whole_number_from
from qualify.core.digests import strict_json_loads
from qualify.core.errors import Refused, one_line
from qualify.engines.connector_pair import consumer_main, producer_main, run_pair, summary_line
from qualify.engines.connector_session import SERVE_ROLES, serve
from qualify.engines.connector_under_test import resolve_connector_dict


def main(argv: list[str] | None = None) -> int:
    """``python -m qualify.interfaces.connector_pair_command producer|consumer|pair ...`` (one engine per process)."""
    parser = argparse.ArgumentParser(prog="python -m qualify.interfaces.connector_pair_command")
    parser.add_argument("role", choices=("producer", "consumer", "pair", *SERVE_ROLES))
    parser.add_argument("--connector", required=True,
                        help="producer/consumer: a ConnectorSpec.as_dict JSON file; pair: the connector's name")
    parser.add_argument("--connector-config", help="pair: the connector's config (a JSON object)")
    parser.add_argument("--connector-module", help="pair: the module defining the connector class")
    parser.add_argument("--out", type=Path, required=True, help="producer/consumer: the result file; pair: a work folder")
    parser.add_argument("--saved", type=Path, help="consumer: the producer's output (absent: the consumer "
                        "engine is its own producer)")
    parser.add_argument("--same-engine", action="store_true", help="pair: one kv_both engine produces and consumes")
    parser.add_argument("--fault", action="append", default=[], help="a fault branch (consumer only)")
    parser.add_argument("--model-dir", type=Path, default=assets.MODEL_DIR)
    parser.add_argument("--reply-fd", type=whole_number_from(0), help="serve-*: the pipe each reply line is written to")
    parser.add_argument("--model-view", type=Path, help="serve-*: the folder of the model's files the engine "
                        "names the model by (one path for both engines of a pair)")
    parser.add_argument("--side-channel-port", type=whole_number_from(0), help="serve-*: where the engine's connector listens "
                        "for its peer's handshake (NIXL's side channel)")
    args = parser.parse_args(argv)
    try:
        if args.role == "pair":
            from qualify.engines.connector_under_test import parse_connector_config, resolve_connector

            spec = resolve_connector(args.connector, module=args.connector_module,
                                     config=parse_connector_config(args.connector_config))
            try:
                result = run_pair(spec, args.out, model_dir=args.model_dir, same_engine=args.same_engine)
            except RuntimeError as exc:
                print(f"{spec.name}: cannot run here: {one_line(str(exc))}", flush=True)
                return 1
            print(summary_line(result), flush=True)
            return 0
        spec = resolve_connector_dict(strict_json_loads(Path(args.connector).read_bytes()), f"connector {args.connector}")
        if args.role in SERVE_ROLES:
            if args.reply_fd is None:
                raise Refused(f"--reply-fd: {args.role} needs the pipe its replies go to")
            with os.fdopen(args.reply_fd, "w", encoding="utf-8") as reply:
                try:
                    serve(args.role, spec, args.model_dir, sys.stdin, reply, side_channel_port=args.side_channel_port,
                          model_view=args.model_view)
                except Refused as exc:
                    reply.write(json.dumps({"ok": False, "refused": one_line(str(exc))}) + "\n")
                    return 2
                except Exception as exc:  # the harness reads the cause from the reply, the traceback from the log
                    reply.write(json.dumps({"ok": False, "error": one_line(f"{type(exc).__name__}: {exc}")[:400]}) + "\n")
                    raise
            return 0
        if args.role == "producer":
            producer_main(spec, args.out, args.model_dir)
        else:
            consumer_main(spec, args.saved, args.out, args.model_dir, list(args.fault))
    except Refused as exc:
        print(f"refused: {one_line(str(exc))}", flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

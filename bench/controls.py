"""Measure the E2 controls (seed 000 §32.10) of every lane the criteria name: one record per lane.

Reads the preregistered criteria (``contracts/e2-controls-v2.json``, loaded and checked by
:func:`qualify.contract.controls.load_controls_criteria`: document digests, yardstick file digest)
and the control documents, then per lane runs :func:`qualify.evidence.controls_measure.measure_controls`:
per document one prefill by the lane's producer, one by the yardstick (the Q8_0 k-quant target)
and one by the consumer itself, each scored row by row by the lane's consumer. The reference and
yardstick passes depend only on the consumer, so lanes whose consumers share an ABI reuse them.

Writes ``<out>/controls-<lane>.json`` (schema ``trust-ladder.controls-record.v1``), prints the
disagreeing rows per document and length (yardstick, then each lane, as k/L) and the wall time;
the last line is ``controls_wall_s: <seconds>``. Judging is not done here
(``qualify.judge.controls`` reads the records).

BLAS runs on ``--blas-threads`` threads (default 1: on a shared machine spinning BLAS threads slow
every pass many times over; the engines' bits do not depend on it).

Usage: python bench/controls.py [--lanes LANE,...] [--criteria FILE] [--out DIR] [--blas-threads N] [--model M]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from threadpoolctl import threadpool_limits

from qualify.contract.controls import load_controls_criteria, load_document
from qualify.contract.lanes import lane_spec
from qualify.core.errors import Refused
from qualify.evidence.controls_measure import (
    SharedScoring,
    build_control_engines,
    measure_controls,
    score_shared,
    yardstick_identity,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "controls"


def progress(line: str) -> None:
    print(f"  {line}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lanes", help="comma-separated lanes (default: the criteria's lanes)")
    parser.add_argument("--criteria", help="criteria file (default: contracts/e2-controls-v2.json)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"folder for the records (default: {DEFAULT_OUT})")
    parser.add_argument("--blas-threads", type=int, default=1, help="BLAS threads (default: 1)")
    parser.add_argument("--model", metavar="NAME|PATH",
                        help="a chosen model (docs/models.md): its criteria and documents, its lanes' engines")
    args = parser.parse_args()
    with threadpool_limits(limits=args.blas_threads, user_api="blas"):
        return run(args)


def run(args: argparse.Namespace) -> int:
    began = time.perf_counter()
    try:
        if args.model is not None:
            from qualify.engines.chosen_model import use_model

            use_model(args.model)
        criteria, criteria_sha256 = load_controls_criteria(args.criteria)
        lanes = args.lanes.split(",") if args.lanes else list(criteria.lanes)
        documents = {entry.name: load_document(entry.name) for entry in criteria.documents}
        yardstick_id = yardstick_identity(criteria)
        shared: SharedScoring | None = None
        records = {}
        for lane in lanes:
            engines = build_control_engines(lane_spec(lane))
            if shared is None or shared.consumer_abi != engines.consumer.abi:
                print(f"reference and yardstick passes (consumer {engines.consumer.abi})", flush=True)
                shared = score_shared(engines.consumer, engines.yardstick, documents, progress)
            print(f"lane {lane}", flush=True)
            records[lane] = measure_controls(
                engines.consumer, engines.producer, engines.yardstick, documents, criteria.lengths,
                criteria.profile_window, lane=lane, criteria={"name": criteria.name, "sha256": criteria_sha256},
                yardstick_id=yardstick_id, progress=progress, shared=shared)
    except Refused as exc:
        print(f"controls: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    for lane, record in records.items():
        path = args.out / f"controls-{lane}.json"
        path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {path}")
    print_table(records)
    wall = time.perf_counter() - began
    for lane, record in records.items():
        print(f"{lane}: prefill {record['seconds']['prefill']:.1f} s, scoring {record['seconds']['scoring']:.1f} s "
              "(shared passes counted in every record)")
    print(f"BLAS threads: {args.blas_threads}")
    print(f"controls_wall_s: {wall:.1f}")
    return 0


def print_table(records: dict[str, dict[str, Any]]) -> None:
    """Disagreeing rows k/L per document and length: the yardstick (the same in every record),
    then each lane."""
    lanes = list(records)
    first = records[lanes[0]]
    header = f"{'document':20s} {'length':>6s} {'yardstick':>11s}" + "".join(f" {lane:>20s}" for lane in lanes)
    print(header)
    for index, document in enumerate(first["documents"]):
        for cell_index, cell in enumerate(document["cells"]):
            row = f"{document['document']:20s} {cell['length']:6d} {cell['yardstick_disagreeing']:>5d}/{cell['rows']:<5d}"
            for lane in lanes:
                lane_cell = records[lane]["documents"][index]["cells"][cell_index]
                row += f" {lane_cell['lane_disagreeing']:>14d}/{lane_cell['rows']:<5d}"
            print(row)


if __name__ == "__main__":
    raise SystemExit(main())

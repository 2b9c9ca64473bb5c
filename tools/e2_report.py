#!/usr/bin/env python3
"""Print the E1/E2 tables of the shipped lanes from their basis receipts, as published in
``docs/calibration.md``: every control cell (the yardstick's disagreeing rows, its two-sided 95 %
Wilson upper bound, the gate, each lane's disagreeing rows and whether it exceeds), each
document's 512-token position profile, and the preregistered length-effect criterion's outcome.

Reads only what the identities pin (``contracts/<lane>-identity-v1.json`` -> its basis receipt's
``evidence/controls.json``), judged by ``qualify.judge.controls.judge_controls`` against the
committed criteria: the same judgement every qualification states in its scope line.

``--model M --receipt RUN_ID ...`` reads a chosen model's calibration receipts instead (a lane
whose anchors diverge has no identity to pin one), judged against that model's criteria, and
prints each receipt's handoffs first: every calibration cell and fixture anchor with its tokens
agreed, drift, and where its greedy tokens first diverged (the cold top-1 minus top-2 margin
there, and the divergence class).

Usage: python tools/e2_report.py [--model NAME|PATH --receipt RUN_ID [--receipt ...]]
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from qualify.contract.controls import load_controls_criteria
from qualify.contract.identity import load_identity
from qualify.core.assets import CONTRACTS_DIR, RECEIPTS_DIR
from qualify.core.errors import Refused, one_line
from qualify.judge.controls import ControlsJudgement, judge_controls
from qualify.judge.scope import controls_words
from qualify.run.run_contract import receipt_evidence


def judged_lane(lane: str, criteria_document: dict[str, object]) -> tuple[str, ControlsJudgement]:
    """The lane's basis run id and its controls judged from that receipt."""
    identity = load_identity(CONTRACTS_DIR / f"{lane}-identity-v1.json")
    run_id = identity.onboarding_qualification.basis.removeprefix("receipt://").partition("/")[0]
    record = receipt_evidence(RECEIPTS_DIR / run_id, "controls")
    source = f"receipt://{run_id}/evidence/controls.json"
    return run_id, judge_controls(record, criteria_document, source=source, lane=lane)


def calibration_handoffs(run_id: str) -> tuple[str, list[dict[str, object]]]:
    """A calibration receipt's lane and handoffs (repetition numbered): from its calibration
    evidence, or, for one stopped before it wrote that (interrupted during its controls), from the
    calibration document it ran under (``identity.json``), which lists every handoff in order."""
    import json

    if (RECEIPTS_DIR / run_id / "evidence" / "calibration.json").is_file():
        calibration = receipt_evidence(RECEIPTS_DIR / run_id, "calibration")
        return str(calibration["lane"]), list(calibration["handoffs"])
    document = json.loads((RECEIPTS_DIR / run_id / "identity.json").read_text(encoding="utf-8"))
    return str(document["lane"]), [{**handoff, "repetition": index}
                                   for index, handoff in enumerate(document["handoffs"], start=1)]


def judged_receipt(run_id: str, criteria_document: dict[str, object]) -> tuple[str, str, ControlsJudgement | None]:
    """A calibration receipt's lane, run id and controls judgement (None without controls)."""
    lane, _ = calibration_handoffs(run_id)
    if not (RECEIPTS_DIR / run_id / "evidence" / "controls.json").is_file():
        return lane, run_id, None
    record = receipt_evidence(RECEIPTS_DIR / run_id, "controls")
    source = f"receipt://{run_id}/evidence/controls.json"
    return lane, run_id, judge_controls(record, criteria_document, source=source, lane=lane)


def print_handoffs(run_id: str) -> None:
    """Every handoff of a calibration receipt: cell or anchor, tokens agreed, drift, divergence."""
    import json

    lane, handoffs = calibration_handoffs(run_id)
    print(f"\n`{lane}`, `receipts/{run_id}`:\n")
    print("| handoff | document @ tokens | tokens agreed | max abs | mean abs | first divergence | cold margin there "
          "| class | teacher-forced top-1 flips |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for handoff in handoffs:
        record = json.loads((RECEIPTS_DIR / run_id / "samples" / f"sample-{handoff['repetition']}.json")
                            .read_text(encoding="utf-8"))
        where = record.get("localisation") or {}
        forced = where.get("teacher_forced") or {}
        margin, position = where.get("cold_margin_at_divergence"), where.get("first_divergence_position")
        print(f"| {handoff['repetition']} {handoff['part']} | {handoff['document']} @ {handoff['prompt_tokens']} | "
              f"{round(record['token_agreement_rate'] * record['output_tokens'])}/{record['output_tokens']} | "
              f"{record['max_abs']:.4g} | {record['mean_abs']:.4g} | {'none' if position is None else position} | "
              f"{'-' if margin is None else f'{margin:.4f}'} | {where.get('divergence_class') or '-'} | "
              f"{forced.get('top1_flips', '-')} |")


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", metavar="NAME|PATH", help="a chosen model: judge against its criteria")
    parser.add_argument("--receipt", action="append", default=[], metavar="RUN_ID",
                        help="a calibration receipt under receipts/ (with --model; repeatable)")
    args = parser.parse_args()
    try:
        if args.model is not None:
            from qualify.engines.chosen_model import use_model

            use_model(args.model)
        criteria, digest = load_controls_criteria()
        if args.receipt:
            found = [judged_receipt(run_id, criteria.document()) for run_id in args.receipt]
            for _, run_id, _ in found:
                print_handoffs(run_id)
            judged = {lane: (run_id, judgement) for lane, run_id, judgement in found if judgement is not None}
            print()
        else:
            judged = {lane: judged_lane(lane, criteria.document()) for lane in criteria.lanes}
    except Refused as exc:
        print(f"e2_report: refused: {one_line(str(exc))}", file=sys.stderr)
        return 2
    if not judged:
        print("no receipt measured controls")
        return 0
    lanes = list(judged)
    print(f"criteria {criteria.name} (sha256 {digest}); gate: Wilson two-sided {criteria.gate.confidence:g} upper "
          f"+ {criteria.gate.points:g}\n")
    for lane, (run_id, judgement) in judged.items():
        if judgement.outcome is None:
            print(f"{lane}: controls do not judge: {'; '.join(judgement.problems)}")
            return 1
        print(f"- `{lane}` (basis `receipts/{run_id}`): {controls_words(judgement.outcome)}; "
              f"length-effect criterion {judgement.length_effect}")
    print("\n| document | L | yardstick k/L | Wilson upper | gate | " + " | ".join(f"{lane} k/L" for lane in lanes) + " |")
    print("| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in lanes) + " |")
    first = judged[lanes[0]][1]
    for index, document in enumerate(first.documents):
        for position, cell in enumerate(document.cells):
            values = []
            for lane in lanes:
                other = judged[lane][1].documents[index].cells[position]
                rate = other.lane_disagreeing / other.rows
                values.append(f"{other.lane_disagreeing}/{other.rows} ({rate:.4f}){' **exceeds**' if other.exceeds else ''}")
            print(f"| {document.document} | {cell.length} | {cell.yardstick_disagreeing}/{cell.rows} "
                  f"({cell.yardstick_disagreeing / cell.rows:.4f}) | {cell.yardstick_upper:.4f} | {cell.gate:.4f} | "
                  + " | ".join(values) + " |")
    print("\n512-token position profile (disagreeing rows per window; yardstick / " + " / ".join(lanes) + "):\n")
    print("| document | " + " | ".join(f"{w.start}-{w.stop}" for w in first.documents[0].profile) + " |")
    print("| --- | " + " | ".join("---" for _ in first.documents[0].profile) + " |")
    for index, document in enumerate(first.documents):
        cells = []
        for position, window in enumerate(document.profile):
            counts = [str(window.yardstick_disagreeing)] + [
                str(judged[lane][1].documents[index].profile[position].lane_disagreeing) for lane in lanes]
            cells.append(" / ".join(counts))
        print(f"| {document.document} | " + " | ".join(cells) + " |")
    exceeding = sum(1 for lane in lanes for d in judged[lane][1].documents for c in d.cells if c.exceeds)
    print(f"\nexceeding cells over {len(lanes)} lanes: {exceeding}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Calibrate, freeze and qualify the ``transformers`` CUDA lanes on a GPU machine, in one call.

Runs on the GPU machine (``source tools/device_env.sh`` first), from the repo root. For each lane:
``qualify calibrate`` (the calibration set's cells and the fixture anchors, basis receipt under
``receipts/``) -> if it passed, ``tools/freeze_identity.py --write-sealed``, which derives the bounds
from that receipt by the stated rule (identity JSON under
``contracts/``, *this copy's* ``qualify/contract/sealed_data.py`` regenerated) -> ``qualify --recipe
native-text --identity ...`` in a fresh process. A lane whose tokens diverge is not frozen: its
calibration receipt, with localisation, is the published result. Everything it made is packed
into ``OUT/gpu-lanes.tar`` with a ``summary.json``; the sealed_data.py change comes back inside it
and is committed as a reviewed change, like any other freeze.

    python3 tools/gpu_lanes.py --out "$OUT" [--lane transformers-cuda-bf16 ...]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from qualify.contract.lanes import LANES, TRANSFORMERS_LANE_SETTINGS, lane_spec

SEALED_DATA = REPO / "qualify" / "contract" / "sealed_data.py"


def calibrate_lane(lane: str) -> dict:
    """Run the calibration in-process; return its figures and receipt."""
    from qualify.run.calibrate import calibrate
    from qualify.run.qualification import RunOptions

    command = ["qualify", "calibrate", "--recipe", "native-text", "--lane", lane, "--receipts", "receipts"]
    options = RunOptions(recipe="native-text", receipts=REPO / "receipts", command_line=command)
    began = time.perf_counter()
    result = calibrate(lane_spec(lane), "native-text", options, log=print)
    return {
        "lane": lane,
        "calibration_receipt": result.receipt_path.name,
        "calibration_seconds": round(time.perf_counter() - began, 2),
        "observed_max_abs": result.observed_max_abs,
        "observed_mean_abs": result.observed_mean_abs,
        "tokens_exact": result.tokens_exact,
        "passed": result.passed,
        "headline": result.headline,
        "failures": list(result.failures),
        "deterministic": result.deterministic,
        "proposed_maximum_absolute": result.proposed_maximum_absolute,
        "proposed_maximum_mean_absolute": result.proposed_maximum_mean_absolute,
        "token_agreement": [r.get("token_agreement_rate") for r in result.records],
    }


def freeze_lane(summary: dict) -> None:
    """Freeze the lane's identity from its calibration and regenerate the sealed data."""
    import freeze_identity

    argv = ["--lane", summary["lane"], "--basis", f"receipt://{summary['calibration_receipt']}/command.log",
            "--replace", "--write-sealed"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = freeze_identity.main(argv)
    if status != 0:
        raise SystemExit(f"gpu_lanes: freeze of {summary['lane']} refused (status {status})")
    summary["identity"] = f"contracts/{summary['lane']}-identity-v1.json"


def qualify_lane(summary: dict) -> None:
    """Run ``qualify --recipe native-text`` on the frozen identity in a fresh process."""
    before = set((REPO / "receipts").iterdir())
    began = time.perf_counter()
    from qualify.contract.lanes import VLLM_LANE_ENGINES

    producer, consumer = VLLM_LANE_ENGINES.get(summary["lane"], ("reference", "reference"))
    completed = subprocess.run(
        [sys.executable, "-m", "qualify.interfaces.cli", "--recipe", "native-text", "--identity", summary["identity"],
         "--producer", producer, "--consumer", consumer, "--receipts", "receipts"],
        cwd=REPO, capture_output=True, text=True, check=False)
    print(completed.stdout[-4000:], completed.stderr[-2000:])
    made = sorted(path.name for path in set((REPO / "receipts").iterdir()) - before)
    summary.update(qualification_exit=completed.returncode, qualification_receipts=made,
                   qualification_seconds=round(time.perf_counter() - began, 2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu-lanes.tar")
    parser.add_argument("--qualify-only", action="store_true",
                        help="qualify the lanes' committed identities (no calibration, no freeze)")
    parser.add_argument("--calibrate-only", action="store_true",
                        help="calibrate and pack the receipts; freeze and qualify later (when other lanes are re-frozen)")
    parser.add_argument("--lane", action="append", choices=sorted(LANES),
                        help="default: every transformers lane (another lane: a dry run on a CPU)")
    args = parser.parse_args(argv)
    receipts_before = set((REPO / "receipts").iterdir())
    summaries = []
    for lane in args.lane or list(TRANSFORMERS_LANE_SETTINGS):
        if args.qualify_only:
            summaries.append({"lane": lane, "identity": f"contracts/{lane}-identity-v1.json"})
            continue
        summary = calibrate_lane(lane)
        if summary["passed"] and summary["proposed_maximum_absolute"] and not args.calibrate_only:
            freeze_lane(summary)
        summaries.append(summary)
    for summary in summaries:
        if "identity" in summary:
            qualify_lane(summary)
    print(json.dumps(summaries, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (REPO / "summary.json").write_text(json.dumps(summaries, indent=1) + "\n", encoding="utf-8")
    with tarfile.open(args.out / "gpu-lanes.tar", "w") as tar:
        tar.add(REPO / "summary.json", arcname="summary.json")
        tar.add(SEALED_DATA, arcname="qualify/contract/sealed_data.py")
        for path in sorted(set((REPO / "receipts").iterdir()) - receipts_before):
            tar.add(path, arcname=f"receipts/{path.name}")
        for summary in summaries:
            if "identity" in summary:
                tar.add(REPO / summary["identity"], arcname=summary["identity"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

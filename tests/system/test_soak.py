"""``qualify soak`` end to end on the shipped lane (issue 38 item 4): real producer processes, the
shipped identity's anchor, sealed receipts; a short soak passing, one whose producer dies, one
under a floor no link meets, and a command line that differs from its criteria."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from qualify.archive.reader import read_receipt_json
from qualify.contract.soak import load_soak_criteria
from qualify.engines.factory import build_producer
from qualify.interfaces.report_data import load_receipt
from qualify.interfaces.report_html import status_label
from qualify.run.qualification import RunOptions
from qualify.run.soak import SOAK_EVIDENCE, SoakRun
from tests.support.receipt_forgery import check

REPO_ROOT = Path(__file__).resolve().parents[2]
DIES_AT_HANDOFF = 3
WARMUP_TOKENS_AT_MOST = 1024  # a handoff's prefix is 2047 tokens


def build_producer_dying_at_handoff_3(lane: str, mode: str):
    """A real producer engine SIGKILLed inside the third soak handoff's prefill (the short warm-up
    prefills at start are not counted)."""
    lane_engine = build_producer(lane, mode)
    engine = lane_engine.engine
    real_prefill = engine.prefill
    calls: list[int] = []

    def prefill(tokens):
        if len(tokens) > WARMUP_TOKENS_AT_MOST:
            calls.append(len(tokens))
        if len(calls) == DIES_AT_HANDOFF:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_prefill(tokens)

    engine.prefill = prefill
    return lane_engine


def criteria_file(tmp_path: Path, handoffs: int, floor: float) -> Path:
    path = tmp_path / "criteria.json"
    path.write_text(json.dumps({"schema": "trust-ladder.soak-criteria.v1", "name": "test-soak", "recipe": "native-text",
                                "link": "unix-socket", "handoffs": handoffs, "link_floor_gbit_per_s": floor,
                                "rationale": "a test's soak"}), encoding="utf-8")
    return path


def soak(tmp_path: Path, handoffs: int, floor: float, engine_factory: str | None = None) -> tuple[SoakRun, list[dict]]:
    criteria = load_soak_criteria(criteria_file(tmp_path, handoffs, floor))
    run = SoakRun(RunOptions(recipe="native-text", receipts=tmp_path / "receipts", engine_factory=engine_factory),
                  criteria)
    try:
        run.run_all()
    finally:
        run.close()
    assert run.receipt_path is not None and check(run.receipt_path).state == "verified"
    evidence = read_receipt_json(run.receipt_path, f"evidence/{SOAK_EVIDENCE}.json")
    assert evidence["criteria_sha256"] == criteria.sha256
    return run, evidence["handoffs"]


def test_a_short_soak_passes_and_its_receipt_holds_every_handoff(tmp_path: Path):
    run, handoffs = soak(tmp_path, 4, 0.01)
    assert run.verdict is not None and run.verdict.passed, run.verdict.headline
    assert check(run.receipt_path).status == "passed"
    assert [record["handoff"] for record in handoffs] == [1, 2, 3, 4]
    assert len({record["payload_sha256"] for record in handoffs}) == 1
    assert all(record["error"] is None and record["payload_gbit_per_s"] > 0.01 for record in handoffs)
    assert "claims nothing beyond them" in run.verdict.headline
    # The HTML report names it a soak, never a qualification.
    view = load_receipt(run.receipt_path, None)
    assert view.soak and status_label(view.status, soak=view.soak) != status_label(view.status)


def test_a_producer_death_fails_the_soak_at_that_handoff(tmp_path: Path):
    run, handoffs = soak(tmp_path, 5, 0.01, "tests.system.test_soak:build_producer_dying_at_handoff_3")
    assert run.verdict is not None and not run.verdict.passed
    assert check(run.receipt_path).status == "failed"
    assert [record["error"] is None for record in handoffs] == [True, True, False]
    death = handoffs[-1]
    assert death["producer_died"] is True and death["exit_status"] == -signal.SIGKILL
    assert "2 of 5 handoffs completed; the producer died at handoff 3" in run.verdict.headline
    assert not run.outcomes["soak"].passed and "blocked" in run.outcomes["verdict"].message


def test_a_floor_no_link_meets_fails_every_handoff_and_still_reports_each(tmp_path: Path):
    run, handoffs = soak(tmp_path, 3, 10_000.0)
    assert run.verdict is not None and not run.verdict.passed
    assert len(handoffs) == 3 and all(record["error"] is None for record in handoffs)
    assert [check.detail.split(",")[1].strip() for check in run.verdict.checks if check.name.startswith("handoff ")] == [
        "below the floor 10000 Gbit/s"] * 3


def test_a_command_line_that_differs_from_its_criteria_is_refused_before_any_step(tmp_path: Path):
    path = criteria_file(tmp_path, 4, 1.0)
    receipts = tmp_path / "receipts"
    receipts.mkdir()
    result = subprocess.run([sys.executable, "-m", "qualify.interfaces.cli", "soak", "--handoffs", "5", "--link-floor",
                             "1", "--criteria", str(path), "--receipts", str(receipts)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "--handoffs 5" in result.stderr
    assert list(receipts.iterdir()) == []

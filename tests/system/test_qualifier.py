"""The qualification run end to end: real producer process, real consumer, receipts.

These run the shipped model through the whole pipeline, so they are marked slow.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path

import pytest

from qualify.archive.reader import read_receipt_json
from qualify.archive.verify import verify_receipt
from qualify.contract.controls import load_calibration_set
from qualify.contract.lanes import lane_spec
from qualify.core import assets
from qualify.engines.factory import build_producer
from qualify.evidence.records import BoundedDriftRule
from qualify.judge.calibration import ANCHOR_PART
from qualify.run.qualification import STEP_LABELS, QualificationRun, RunOptions
from qualify.run.run_contract import ORDERED_HANDOFFS, CalibrationHandoff, calibration_contract
from tests.support.receipt_forgery import check

LANE = "nvfp4-native-splitk"
DIES_ON_REQUEST = 2  # the warm-up prefill is request 1; the first handoff is request 2


def build_dying_producer(lane: str, mode: str):
    """A real producer engine whose process is SIGKILLed inside the first handoff's prefill."""
    lane_engine = build_producer(lane, mode)
    engine = lane_engine.engine  # the wrapped engine: the lane wrapper itself is immutable
    real_prefill = engine.prefill
    calls = []

    def prefill(tokens):
        calls.append(len(tokens))
        if len(calls) >= DIES_ON_REQUEST:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_prefill(tokens)

    engine.prefill = prefill
    return lane_engine


def build_nan_producer(lane: str, mode: str):
    """A real producer engine whose first handoff's KV holds one NaN (layer 2's V), sealed and
    sent intact: the bytes verify, the values cannot be installed."""
    lane_engine = build_producer(lane, mode)
    engine = lane_engine.engine
    real_prefill = engine.prefill
    calls = []

    def prefill(tokens):
        kv = real_prefill(tokens)
        calls.append(len(tokens))
        if len(calls) == DIES_ON_REQUEST:
            kv.values[2][1, 5, 3] = float("nan")
        return kv

    engine.prefill = prefill
    return lane_engine


def _contract_with_rule():
    """The lane's real artifacts handing off the fixture three times, under a rule wide enough for
    the lane (the run's prompt is the contract's first handoff's: the fixture)."""
    calibration_set, set_digest = load_calibration_set()
    fixture = CalibrationHandoff(ANCHOR_PART, assets.MAIN_PROMPT, assets.load_prompt(assets.MAIN_PROMPT))
    contract = calibration_contract(lane_spec(LANE), "native-text", [fixture] * ORDERED_HANDOFFS,
                                    calibration_set={"name": calibration_set.name, "sha256": set_digest},
                                    controls=None)
    return dataclasses.replace(contract, rule=BoundedDriftRule(maximum_absolute=1.0, maximum_mean_absolute=0.1))


def test_steps_refuse_to_run_out_of_order(tmp_path: Path):
    run = QualificationRun(RunOptions(recipe="native-text", receipts=tmp_path), _contract_with_rule())
    outcome = run.step("handoff 1/3")
    assert not outcome.passed
    assert "blocked: step 'identity sealed' did not run" in outcome.message
    run.close()


@pytest.mark.slow
def test_producer_killed_mid_handoff_leaves_complete_failing_receipt(tmp_path: Path):
    options = RunOptions(recipe="native-text", receipts=tmp_path, reference_once=True,
                         engine_factory="tests.system.test_qualifier:build_dying_producer")
    run = QualificationRun(options, _contract_with_rule())
    outcomes = [run.step(label) for label in STEP_LABELS]
    run.close()
    assert [o.passed for o in outcomes[:3]] == [True, True, True]
    assert not outcomes[3].passed and "producer failed" in outcomes[3].message
    assert all(not o.passed and "blocked" in o.message for o in outcomes[4:])
    receipt = run.receipt_path
    assert receipt is not None and verify_receipt(receipt) == []
    checked = check(receipt)  # signed like every receipt, its failure authenticated
    # A handoff the producer failed is judged: the run failed (incomplete is a run cut short).
    assert (checked.state, checked.status) == ("verified", "failed"), checked
    summary = read_receipt_json(receipt, "validation-summary.json")
    assert summary["passed"] is False and "producer failed" in summary["verdict"]
    sample = read_receipt_json(receipt, "samples/sample-1.json")
    assert "producer failed" in sample["error"] and "killed by signal 9" in sample["error"]


@pytest.mark.slow
def test_a_producers_nan_kv_leaves_a_failed_sample_and_a_failed_run(tmp_path: Path):
    """As a killed producer: the sample that carried it fails, naming the tensor, and the receipt
    is complete and failed, not incomplete."""
    options = RunOptions(recipe="native-text", receipts=tmp_path, reference_once=True,
                         engine_factory="tests.system.test_qualifier:build_nan_producer")
    run = QualificationRun(options, _contract_with_rule())
    outcomes = [run.step(label) for label in STEP_LABELS]
    run.close()
    assert [o.passed for o in outcomes[:3]] == [True, True, True] and not outcomes[3].passed
    receipt = run.receipt_path
    assert receipt is not None and verify_receipt(receipt) == []
    assert (check(receipt).state, check(receipt).status) == ("verified", "failed")
    sample = read_receipt_json(receipt, "samples/sample-1.json")
    assert "kv.values" in sample["error"] and "layers.2.v" in sample["error"]

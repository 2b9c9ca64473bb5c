"""The one orchestrator with its edge interfaces swapped: an in-process transport in place of the
producer process, and a deferred comparer in place of the immediate one. The evidence and the
verdict must not depend on either choice."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from qualify.contract.controls import load_calibration_set
from qualify.contract.lanes import lane_spec
from qualify.core import assets
from qualify.core.assets import REPO_ROOT
from qualify.engines.factory import build_producer
from qualify.evidence.comparers import HostComparer
from qualify.evidence.records import BoundedDriftRule
from qualify.handoff.setup import TransportSetup
from qualify.handoff.transport import InProcessTransport, PrefillProducer
from qualify.judge.calibration import ANCHOR_PART
from qualify.run.qualification import STEP_LABELS, QualificationRun, RunOptions
from qualify.run.run_contract import ORDERED_HANDOFFS, CalibrationHandoff, calibration_contract

LANE = "nvfp4-native-splitk"
# The per-sample evidence that must not depend on the transport or on deferred comparison.
EVIDENCE = ("payload_sha256", "seams_sha256", "max_abs", "mean_abs", "token_agreement_rate",
            "handoff_logit_block_sha256", "cold_logit_block_sha256", "handoff_generated_token_sha256")


def _contract():  # the fixture three times, under a rule wide enough for the lane, so every step runs
    calibration_set, set_digest = load_calibration_set()
    fixture = CalibrationHandoff(ANCHOR_PART, assets.MAIN_PROMPT, assets.load_prompt(assets.MAIN_PROMPT))
    contract = calibration_contract(lane_spec(LANE), "native-text", [fixture] * ORDERED_HANDOFFS,
                                    calibration_set={"name": calibration_set.name, "sha256": set_digest},
                                    controls=None)
    return dataclasses.replace(contract, rule=BoundedDriftRule(maximum_absolute=1.0, maximum_mean_absolute=0.1),
                               basis_records=None)


def in_process(setup: TransportSetup) -> InProcessTransport:
    producer = build_producer(setup.lane, setup.mode)
    return InProcessTransport(PrefillProducer(producer), key=setup.key,
                              identity_sha256=setup.expectation.identity_sha256,
                              cache_identity=producer.target_cache_identity_sha256, mode=producer.mode,
                              lane=setup.lane, run_id=setup.run_id)


class DeferredHost(HostComparer):
    """The host comparer declared deferred: the run records each sample one step late."""

    deferred = True


def _run(tmp_path: Path, **interfaces) -> tuple[QualificationRun, list]:
    run = QualificationRun(RunOptions(recipe="native-text", receipts=tmp_path, reference_once=True), _contract(),
                           **interfaces)
    outcomes = [run.step(label) for label in STEP_LABELS[:6]]
    run.settle_all()
    run.close()
    return run, outcomes


@pytest.mark.slow
def test_in_process_and_deferred_runs_gather_the_socket_runs_evidence(tmp_path: Path) -> None:
    socket_run, socket_outcomes = _run(tmp_path / "socket")
    local_run, local_outcomes = _run(tmp_path / "local", transport=in_process, comparer=DeferredHost)
    assert all(outcome.passed for outcome in socket_outcomes + local_outcomes)
    # Deferred: each handoff step reports its comparison, recorded when the next one decodes.
    assert "recorded with the next step" in local_outcomes[3].message
    assert [r["repetition"] for r in local_run.records] == [1, 2, 3]
    for socket_record, local_record in zip(socket_run.records, local_run.records, strict=True):
        assert {k: socket_record[k] for k in EVIDENCE} == {k: local_record[k] for k in EVIDENCE}


def test_meanwhile_records_the_previous_sample_and_only_that_one() -> None:
    """A deferred comparer calls the run's ``meanwhile`` while a handoff decodes: it records the
    oldest compared sample, in order, and does nothing when none is waiting."""
    run = QualificationRun(RunOptions(recipe="native-text"), _contract())
    kept: list[tuple[str, int]] = []
    run._keep = lambda record, repetition: kept.append((record, repetition)) or "kept"  # type: ignore[method-assign]
    run._settle_previous()
    assert kept == []
    run._unsettled += [(1, lambda: "record 1"), (2, lambda: "record 2")]
    run._settle_previous()
    assert kept == [("record 1", 1)] and [r for r, _ in run._unsettled] == [2]
    run.settle_all()
    assert kept == [("record 1", 1), ("record 2", 2)] and run._unsettled == []


def _gpu_scale():
    spec = importlib.util.spec_from_file_location("gpu_scale_bench", REPO_ROOT / "bench" / "gpu_scale.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module



"""The fixture envelope at the run's edge (qualify/run/fixture_envelope.py, and the run's use of it):
a handoff's series as the judge reads them; a basis receipt's envelope re-derived from its series
files and held to the identity's seal, a differing seal or a missing file refused in one line
naming it; and a qualification under a non-deterministic identity holding every sample to the
envelope, a sample without its series (a comparer that computes none) failing it. The refusals'
words are in tests/golden/run.fixture_envelope.txt."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save

from qualify.contract.identity import Identity, parse_identity_document
from qualify.core.errors import Refused
from qualify.evidence.comparers import ComparedHandoff, HostComparer
from qualify.evidence.records import BoundedDriftRule, failed_sample_record
from qualify.evidence.series import envelope_file_name
from qualify.judge.envelope import SERIES_NAMES, FixtureEnvelope, ceilings_sha256, derive_fixture_envelope
from qualify.run.fixture_envelope import basis_envelope, basis_envelope_series, handoff_series, identity_seal
from qualify.run.qualification import STEP_LABELS, QualificationRun, RunOptions, StepFailed
from tests.unit.contract.test_identity_non_deterministic import v8_document
from tests.unit.judge.test_calibration_envelope import envelope_evidence

LAYERS, POSITIONS, ROWS = 2, 3, 4


def arrays(scale: float) -> dict[str, np.ndarray]:
    """One handoff's envelope series as a receipt holds them, every value a multiple of ``scale``."""
    tensors = np.arange(2 * LAYERS * POSITIONS, dtype="<f8").reshape(2 * LAYERS, POSITIONS) * scale
    return {"row_max_abs": np.arange(ROWS, dtype="<f8") * scale, "row_mean_abs": np.arange(ROWS, dtype="<f8") * scale / 8,
            "position_max_abs": tensors.max(axis=0), "tensor_position_max_abs": tensors}


SCALES = (1.0, 1.25, 1.5, 1.0)
STARTS = [4, 4, 5, 5]


def basis(tmp_path: Path, scales: tuple[float, ...] = SCALES) -> tuple[Path, dict[str, Any]]:
    """A calibration receipt's directory with its envelope handoffs' series files (repetitions 4..)."""
    receipt = tmp_path / "20261207T000000Z-0123456789abcdef"
    (receipt / "series").mkdir(parents=True)
    for index, scale in enumerate(scales):
        data = save({name: array for name, array in sorted(arrays(scale).items())})
        (receipt / "series" / envelope_file_name(4 + index)).write_bytes(data)
    return receipt, envelope_evidence(STARTS[:len(scales)])


def honest_envelope() -> FixtureEnvelope:
    return derive_fixture_envelope([handoff_series(arrays(scale)) for scale in SCALES], starts=2)


def sealed_identity(envelope: FixtureEnvelope, **changes: Any) -> Identity:
    document = v8_document()
    sealed = document["onboarding_qualification"]["fixture_envelope"]
    sealed.update(handoffs=envelope.handoffs, producer_starts=envelope.starts,
                  ceilings_sha256=ceilings_sha256(envelope),
                  multipliers={name: k for (name, _), k in zip(SERIES_NAMES, envelope.multipliers, strict=True)})
    sealed.update(changes)
    return parse_identity_document(document, where="identity x")


def test_a_handoffs_series_flatten_layer_by_layer_k_before_v() -> None:
    series = handoff_series(arrays(1.0))
    assert series.row_max_abs == (0.0, 1.0, 2.0, 3.0)
    # Index layer * 2 * positions + (0 for K, 1 for V) * positions + position.
    assert series.tensor_position_max_abs == tuple(float(n) for n in range(2 * LAYERS * POSITIONS))
    assert series.position_max_abs == (9.0, 10.0, 11.0)


def test_the_seal_an_identity_carries_is_read_field_for_field() -> None:
    envelope = honest_envelope()
    seal = identity_seal(sealed_identity(envelope))
    assert seal is not None and (seal.handoffs, seal.starts, seal.multipliers, seal.ceilings_sha256) == (
        envelope.handoffs, envelope.starts, envelope.multipliers, ceilings_sha256(envelope))


def test_the_basis_envelope_follows_from_its_series_files(tmp_path: Path) -> None:
    receipt, evidence = basis(tmp_path)
    series, starts = basis_envelope_series(receipt, evidence)
    assert starts == 2 and series == [handoff_series(arrays(scale)) for scale in SCALES]
    envelope = honest_envelope()
    assert basis_envelope(sealed_identity(envelope), receipt, evidence, where="identity x") == envelope


@pytest.mark.parametrize(("change", "field"), [
    ({"ceilings_sha256": "ab" * 32}, "fixture_envelope.ceilings_sha256"),
    ({"handoffs": 5}, "fixture_envelope.handoffs"),
    ({"producer_starts": 3}, "fixture_envelope.producer_starts"),
])
def test_a_seal_that_does_not_follow_from_the_basis_is_refused_naming_the_field(
        tmp_path: Path, change: dict[str, Any], field: str) -> None:
    receipt, evidence = basis(tmp_path)
    with pytest.raises(Refused) as caught:
        basis_envelope(sealed_identity(honest_envelope(), **change), receipt, evidence, where="identity x")
    message = str(caught.value)
    assert "\n" not in message and f": {field}: sealed " in message


def test_a_basis_series_file_moved_by_one_ulp_is_refused(tmp_path: Path) -> None:
    receipt, evidence = basis(tmp_path)
    moved = arrays(SCALES[2])  # the largest row at index 3: its ceiling moves with it
    moved["row_max_abs"][3] = np.nextafter(moved["row_max_abs"][3], np.inf)
    (receipt / "series" / envelope_file_name(6)).write_bytes(save(moved))
    with pytest.raises(Refused) as caught:
        basis_envelope(sealed_identity(honest_envelope()), receipt, evidence, where="identity x")
    # The largest value moved: its ceiling, and with it the row maxima's leave-one-out multiple.
    assert ": fixture_envelope.multipliers.row_max_abs: sealed 2.0" in str(caught.value)
    assert str(caught.value).endswith("(and 1 more)")


def test_a_missing_or_malformed_series_file_is_refused_naming_it(tmp_path: Path) -> None:
    receipt, evidence = basis(tmp_path)
    (receipt / "series" / envelope_file_name(6)).unlink()
    with pytest.raises(Refused) as caught:
        basis_envelope_series(receipt, evidence)
    assert envelope_file_name(6) in str(caught.value)
    (receipt / "series" / envelope_file_name(6)).write_bytes(b"not safetensors")
    with pytest.raises(Refused) as caught:
        basis_envelope_series(receipt, evidence)
    assert envelope_file_name(6) in str(caught.value) and str(tmp_path) not in str(caught.value)


def test_a_basis_that_declares_no_envelope_is_refused(tmp_path: Path) -> None:
    receipt, evidence = basis(tmp_path)
    del evidence["fixture_envelope"]
    with pytest.raises(Refused):
        basis_envelope_series(receipt, evidence)
    with pytest.raises(Refused):
        basis_envelope(parse_identity_document(_deterministic(), where="x"), receipt, envelope_evidence(STARTS),
                       where="identity x")


def _deterministic() -> dict[str, Any]:
    from tests.unit.contract.test_identity_teacher_forced import shipped_document

    return shipped_document()


# --------------------------------------------------------------------------- the run holds samples to it


def envelope_contract(envelope: FixtureEnvelope) -> Any:
    """The orchestrator test's contract (the fixture three times), declared non-deterministic: no
    anchor, the envelope to hold every sample to."""
    from tests.unit.run.test_orchestrator import _contract

    return dataclasses.replace(_contract(), anchor_records=[], deterministic_producer=False,
                               fixture_envelope=envelope)


class Receipt:
    """What _keep writes, kept in memory."""

    def __init__(self) -> None:
        self.envelope_series: dict[int, dict[str, np.ndarray]] = {}
        self.finalized = False

    def add_sample(self, record: Any) -> None:
        pass

    def add_series(self, repetition: int, tensors: Any) -> None:
        pass

    def add_envelope_series(self, repetition: int, tensors: dict[str, np.ndarray]) -> None:
        self.envelope_series[repetition] = tensors

    def log(self, line: str) -> None:
        pass


def test_a_sample_without_its_series_fails_the_envelope_and_one_with_them_is_written() -> None:
    honest = handoff_series(arrays(1.0))
    envelope = derive_fixture_envelope([honest] * 4, starts=2)
    run = QualificationRun(RunOptions(recipe="native-text"), envelope_contract(envelope))
    run.receipt = Receipt()  # type: ignore[assignment]
    run._envelope_pending = {1: arrays(1.0), 2: None}
    for repetition in (1, 2, 3):
        # An errored record fails its own sample: what is kept beside it is what this test reads.
        with pytest.raises(StepFailed):
            run._keep(failed_sample_record(repetition, "stands in for a compared sample"), repetition)
    assert set(run.receipt.envelope_series) == {1}  # type: ignore[attr-defined]
    verdict = run._judge_envelope()
    assert not verdict.passed and [reason.split(":")[0] for reason in verdict.reasons] == ["handoff 2", "handoff 3"]
    run.envelope_series[2] = run.envelope_series[3] = arrays(1.0)
    run._envelope_missing.clear()
    assert run._judge_envelope().passed


class WithoutTensorSeries(HostComparer):
    """The host comparer giving what the device comparer gives: no per-tensor KV series."""

    def compare(self, kv: Any, pending: Any, meanwhile: Any) -> ComparedHandoff:
        compared = super().compare(kv, pending, meanwhile)
        comparison = compared.result()
        assert comparison.kv is not None
        stripped = dataclasses.replace(comparison, kv=dataclasses.replace(comparison.kv, tensor_position_max_abs=None))
        return ComparedHandoff(lambda: stripped, compared.seconds)


def ceilings_everywhere(value: float) -> FixtureEnvelope:
    """An envelope of the shipped model's fixture shape (4 layers, 2047 handed-off positions, 256
    rows) whose every ceiling is ``value``."""
    rows, positions, layers = 256, 2047, 4
    return FixtureEnvelope(4, 2, (value,) * rows, (value,) * rows, (value,) * positions,
                           (value,) * (2 * layers * positions))


@pytest.mark.slow
def test_a_comparer_that_computes_no_per_tensor_series_fails_closed(tmp_path: Path) -> None:
    """Ceilings no honest value reaches, yet the run fails: its comparer gave no evidence to hold."""
    contract = envelope_contract(ceilings_everywhere(1e30))
    contract = dataclasses.replace(contract, rule=BoundedDriftRule(repetitions=3, output_tokens=256,
                                                                   maximum_absolute=1e3, maximum_mean_absolute=1e2))
    run = QualificationRun(RunOptions(recipe="native-text", receipts=tmp_path, reference_once=True), contract,
                           comparer=WithoutTensorSeries)
    outcomes = [run.step(label) for label in STEP_LABELS]
    run.close()
    assert [outcome.passed for outcome in outcomes] == [True] * 6 + [False]
    assert run.verdict is not None and run.verdict.scope is not None and run.verdict.scope.envelope is not None
    assert [check.name for check in run.verdict.checks if not check.passed] == ["inside the fixture envelope"]
    summary = json.loads((run.receipt_path / "validation-summary.json").read_text(encoding="utf-8"))  # type: ignore[operator]
    assert summary["status"] == "failed" and not list((run.receipt_path / "series").glob("envelope-*"))  # type: ignore[operator]


def test_a_soak_under_a_non_deterministic_identity_is_refused_at_its_first_step(tmp_path: Path) -> None:
    """A soak holds every handoff's payload to the anchor bit for bit: such a producer has none."""
    from qualify.contract.soak import load_soak_criteria
    from qualify.run.soak import SoakRun
    from tests.system.test_soak import criteria_file

    run = SoakRun(RunOptions(recipe="native-text", receipts=tmp_path / "receipts"),
                  load_soak_criteria(criteria_file(tmp_path, 2, 0.001)),
                  contract=envelope_contract(ceilings_everywhere(1.0)))
    outcome = run.step("identity sealed")
    run.close()
    assert not outcome.passed and outcome.refused
    summary = json.loads((run.receipt_path / "validation-summary.json").read_text(encoding="utf-8"))  # type: ignore[operator]
    assert summary["status"] == "refused"

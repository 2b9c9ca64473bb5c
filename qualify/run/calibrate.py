"""Calibration: measure a lane on its calibration set, retain its fixture anchor, measure its
preregistered controls, and archive all of it as the basis receipt a frozen identity cites.

The bounds come from the calibration set alone (documents and lengths kept apart from the
qualification fixture and the controls), each cell under a freshly started producer in the next
numeric environment this host can run; the fixture is then handed off (at least twice, across
restarts) only to retain the digests a qualification must reproduce bit for bit, never to set a
bound. A producer declared non-deterministic retains no anchor: the fixture is handed off
repeatedly over several producer starts and each handoff's series state its fixture envelope
(:mod:`qualify.judge.envelope`). The rules that turn these into sealed numbers are stated in
:mod:`qualify.contract.rules` and applied by :mod:`qualify.judge.calibration`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qualify.contract.controls import CalibrationSet, load_calibration_set, load_controls_criteria, load_document
from qualify.contract.lanes import LaneSpec
from qualify.contract.rules import FIXTURE_ENVELOPE_RULE, FIXTURE_ENVELOPE_RULE_STATEMENT
from qualify.core import assets
from qualify.core.errors import ProducerFailed, Refused
from qualify.engines.base import LaneEngine
from qualify.evidence.comparers import ComparerFactory
from qualify.handoff.setup import TransportFactory
from qualify.judge.calibration import (
    ANCHOR_PART,
    CALIBRATION_EVIDENCE,
    CALIBRATION_EVIDENCE_SCHEMA,
    CALIBRATION_PART,
    ENVELOPE_PART,
    CellDrift,
    TeacherForcedBounds,
    judge_calibration,
)
from qualify.judge.envelope import MINIMUM_ENVELOPE_HANDOFFS, MINIMUM_ENVELOPE_STARTS, FixtureEnvelope
from qualify.judge.scope import ControlsOutcome
from qualify.run.fixture_envelope import handoff_series
from qualify.run.qualification import STEP_LABELS, QualificationRun, RunOptions, driven
from qualify.run.run_contract import CalibrationHandoff, calibration_contract

CONTROLS_EVIDENCE = "controls"
"""The receipt evidence name of a lane's E2 controls record (``evidence/controls.json``)."""

ANCHOR_HANDOFFS = 2
"""Fixture anchors per calibration: two, across a producer restart and another environment, so
the retained digests are shown to reproduce before any qualification relies on them."""

ENVELOPE_HANDOFFS = 8
ENVELOPE_STARTS = 2
"""A producer declared non-deterministic hands the fixture off 8 times over 2 producer starts (4
per start) in place of the anchors: :func:`~qualify.judge.envelope.derive_fixture_envelope` needs
at least 4 handoffs and 2 starts; with 4 per start the run-to-run range within a process and
across a restart are both measured, and each handoff left out still meets 7 others for its
leave-one-out step (an envelope from fewer runs is a looser bound on the false-alarm rate:
docs/detection-power.md measured 0 of 30 honest held-out handoffs refused with these counts)."""

ENVELOPE_EVIDENCE_SCHEMA = "trust-ladder.calibration-evidence.v2"
"""The calibration evidence of a producer declared non-deterministic: v1 plus ``fixture_envelope``
(rule, handoffs, producer starts) and each handoff's ``producer_start``; no anchors."""


@dataclass(frozen=True)
class CalibrationEnvironment:
    """Environment variables one calibration handoff's producer starts with, on top of the
    operator's; ``requires`` names the CPU flag the setting needs (a Haswell kernel needs AVX2);
    ``narrow_numpy`` also makes numpy run its next-narrower SIMD paths
    (:func:`qualify.core.hostenv.numpy_narrower_dispatch`)."""

    variables: dict[str, str]
    requires: str | None = None
    narrow_numpy: bool = False


# Each calibration handoff restarts the producer under the next of these, so the measured envelope
# covers producer restarts, BLAS kernels (the pinned OpenBLAS runs Zen as Haswell, so Sandybridge
# is the third), BLAS and OpenMP thread counts and numpy's SIMD dispatch: an engine whose output
# moved with any of them shows it as differing anchor digests, and the calibration fails.
CALIBRATION_ENVIRONMENTS: tuple[CalibrationEnvironment, ...] = (
    CalibrationEnvironment({}),
    CalibrationEnvironment({"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_NUM_THREADS": "2", "OMP_NUM_THREADS": "2"},
                           requires="avx2"),
    CalibrationEnvironment({"OPENBLAS_CORETYPE": "Prescott", "OPENBLAS_NUM_THREADS": "1"}),
    # VLLM_CPU_ATTN_SPLIT_KV=0 moves vLLM's decode logits unless the harness pins it (it does).
    CalibrationEnvironment({"OPENBLAS_CORETYPE": "Sandybridge", "OPENBLAS_NUM_THREADS": "2",
                            "VLLM_CPU_ATTN_SPLIT_KV": "0"}, requires="avx", narrow_numpy=True),
    CalibrationEnvironment({"OPENBLAS_NUM_THREADS": "1"}, narrow_numpy=True),
)


def calibration_environments() -> list[dict[str, str]]:
    """The calibration environments this CPU can run, in order."""
    from qualify.core.hostenv import cpu_flags, numpy_narrower_dispatch

    flags = cpu_flags()
    narrower = numpy_narrower_dispatch()
    environments = []
    for environment in CALIBRATION_ENVIRONMENTS:
        if environment.requires is not None and environment.requires not in flags:
            continue
        variables = dict(environment.variables)
        if environment.narrow_numpy and narrower:
            variables["NPY_DISABLE_CPU_FEATURES"] = narrower
        environments.append(variables)
    return environments


@dataclass
class Calibration:
    """A calibration's cells, anchors, the numbers its rules derive (never applied by
    themselves) and its controls outcome."""

    lane: str
    records: list[dict[str, Any]]
    cells: tuple[CellDrift, ...]
    proposed_maximum_absolute: float | None
    proposed_maximum_mean_absolute: float | None
    acceptance_floor: float | None
    receipt_path: Path | None
    failures: list[str]
    # The fixture's greedy tokens exact in every anchor handoff.
    tokens_exact: bool = False
    # The anchors' deterministic digests equal across their restarts and environments.
    deterministic: bool = False
    passed: bool = False
    headline: str = ""
    controls: ControlsOutcome | None = None
    # The controls judgement as JSON (every cell's gate and exceedance), empty without controls.
    controls_judgement: dict[str, Any] = field(default_factory=dict)
    # The teacher-forced rule's four numbers, when the fixture parted (docs/calibration.md 1b).
    teacher_forced: TeacherForcedBounds | None = None
    # A producer declared non-deterministic: the fixture envelope its envelope handoffs state.
    envelope: FixtureEnvelope | None = None
    non_deterministic: bool = False

    @property
    def observed_max_abs(self) -> float:
        """The largest cell max abs delta (NaN without cells)."""
        return max((cell.max_abs for cell in self.cells), default=float("nan"))

    @property
    def observed_mean_abs(self) -> float:
        return max((cell.mean_abs for cell in self.cells), default=float("nan"))


def calibration_handoffs(calibration_set: CalibrationSet, anchors: int = ANCHOR_HANDOFFS,
                         envelope_handoffs: int = 0) -> list[CalibrationHandoff]:
    """Every handoff a calibration makes, in order: each calibration document at each prompt
    length of the set, then ``anchors`` handoffs of the qualification fixture, or, for a producer
    declared non-deterministic (``envelope_handoffs`` > 0), that many fixture envelope handoffs."""
    handoffs = [CalibrationHandoff(CALIBRATION_PART, entry.name, load_document(entry.name)[:length])
                for entry in calibration_set.documents for length in calibration_set.prompt_lengths]
    fixture = assets.load_prompt(assets.MAIN_PROMPT)
    if envelope_handoffs > 0:
        return handoffs + [CalibrationHandoff(ENVELOPE_PART, assets.MAIN_PROMPT, fixture)] * envelope_handoffs
    return handoffs + [CalibrationHandoff(ANCHOR_PART, assets.MAIN_PROMPT, fixture)] * anchors


def envelope_start(index: int, handoffs: int, starts: int) -> int:
    """Which of ``starts`` producer starts (from 0) the ``index``-th of ``handoffs`` envelope
    handoffs runs on: consecutive runs of nearly equal length, so a start hands off more than once."""
    return index * starts // handoffs


def check_envelope_counts(spec: LaneSpec, handoffs: int, starts: int) -> None:
    """Refuse a non-deterministic declaration the rule cannot state an envelope from, or a lane
    whose rung judges bit-exact handoffs (rung 3, a draft): one line naming the option."""
    if spec.recipe.rung != 2 or spec.speculative_draft:
        raise Refused(f"--non-deterministic: lane {spec.name} is rung {spec.recipe.rung} (bit-exact): only a rung-2 "
                      f"producer without a draft may be declared non-deterministic")
    if handoffs < MINIMUM_ENVELOPE_HANDOFFS:
        raise Refused(f"--envelope-handoffs: found {handoffs}, expected at least {MINIMUM_ENVELOPE_HANDOFFS} "
                      f"(a fixture envelope is stated from that many honest handoffs)")
    if not MINIMUM_ENVELOPE_STARTS <= starts <= handoffs // 2:
        raise Refused(f"--envelope-starts: found {starts}, expected {MINIMUM_ENVELOPE_STARTS} to {handoffs // 2} "
                      f"(each start hands the fixture off at least twice, of {handoffs} envelope handoffs)")


def _measure_controls(spec: LaneSpec, consumer: LaneEngine, log: Callable[[str], None]) -> dict[str, Any]:
    """The lane's E2 controls record (:mod:`qualify.evidence.controls_measure`), measured in this process:
    the lane's producer engine and the yardstick built by the factory, scored by the run's consumer."""
    from qualify.evidence.controls_measure import build_control_engines, measure_controls, yardstick_identity

    criteria, digest = load_controls_criteria()
    engines = build_control_engines(spec)
    documents = {entry.name: load_document(entry.name) for entry in criteria.documents}
    return measure_controls(consumer, engines.producer, engines.yardstick, documents, criteria.lengths,
                            criteria.profile_window, lane=spec.name, criteria={"name": criteria.name, "sha256": digest},
                            yardstick_id=yardstick_identity(criteria), progress=lambda line: log(line))


def calibrate(spec: LaneSpec, recipe: str, options: RunOptions,
              log: Callable[[str], None] | None = None, *,
              transport: TransportFactory | None = None, comparer: ComparerFactory | None = None,
              environments: list[dict[str, str]] | None = None, consumer: LaneEngine | None = None,
              calibration_set: tuple[CalibrationSet, str] | None = None, anchors: int = ANCHOR_HANDOFFS,
              controls: bool = True, run_factory: Callable[..., QualificationRun] = QualificationRun,
              non_deterministic: bool = False, envelope_handoffs: int = ENVELOPE_HANDOFFS,
              envelope_starts: int = ENVELOPE_STARTS) -> Calibration:
    """Measure the lane ``spec`` on its calibration set and anchor its fixture (each handoff under a fresh
    producer, cycling ``environments``: by default every one this CPU runs; an in-process
    producer passes ``[{}]``), measure its E2 controls when the committed criteria preregister the
    lane (``controls=False`` skips them, and the calibration then cannot seal an identity that
    declares them), archive everything as one receipt and judge it. ``run_factory`` builds the run
    (the connector lane's :class:`~qualify.run.connector_lane.ConnectorLaneRun`, bound to its connector).

    ``non_deterministic`` declares the producer non-deterministic: no anchor is retained; the
    fixture is handed off ``envelope_handoffs`` times over ``envelope_starts`` producer starts, each
    handoff's envelope series recorded (``series/envelope-<n>.safetensors``), and the fixture
    envelope stated from them (:data:`~qualify.contract.rules.FIXTURE_ENVELOPE_RULE`)."""
    if non_deterministic:
        check_envelope_counts(spec, envelope_handoffs, envelope_starts)
    elif anchors < 2:
        raise Refused(f"--anchors: found {anchors}, expected at least 2 (a retained digest must be shown to reproduce)")
    lane = spec.name
    chosen_set, set_digest = calibration_set or load_calibration_set()
    criteria, criteria_digest = load_controls_criteria()
    from qualify.contract.controls import check_disjoint

    check_disjoint(criteria, chosen_set)
    preregistered = lane in criteria.lanes
    controls_ref = {"name": criteria.name, "sha256": criteria_digest} if preregistered and controls else None
    handoffs = calibration_handoffs(chosen_set, anchors, envelope_handoffs if non_deterministic else 0)
    environments = calibration_environments() if environments is None else environments
    declared = ({"rule": {"name": FIXTURE_ENVELOPE_RULE, "statement": FIXTURE_ENVELOPE_RULE_STATEMENT},
                 "handoffs": envelope_handoffs, "producer_starts": envelope_starts} if non_deterministic else None)
    contract = calibration_contract(spec, recipe, handoffs,
                                    calibration_set={"name": chosen_set.name, "sha256": set_digest},
                                    controls=controls_ref, output_tokens=chosen_set.output_tokens,
                                    fixture_envelope=declared)
    run = run_factory(options, contract, log=log, transport=transport, comparer=comparer, consumer=consumer)
    if not options.reference_once:  # one cold branch per handoff, each computed ahead of it
        run.planned_handoffs = [(handoff.prompt, len(handoff.prompt) - 1) for handoff in handoffs]
    # Each handoff's producer start (from 1; the steps start the first): every cell and anchor on a
    # fresh one, the envelope handoffs in runs that share one, so both within-process and
    # across-restart variation are in the envelope.
    first_envelope = len(handoffs) - (envelope_handoffs if non_deterministic else 0)
    starts: list[int] = []
    for index in range(len(handoffs)):
        group = (None if index < first_envelope
                 else envelope_start(index - first_envelope, envelope_handoffs, envelope_starts))
        shares = index > first_envelope and group == envelope_start(index - 1 - first_envelope, envelope_handoffs,
                                                                     envelope_starts)
        starts.append(starts[-1] if shares else (starts[-1] if starts else 0) + 1)
    run.envelope_repetitions = set(range(first_envelope + 1, len(handoffs) + 1)) if non_deterministic else set()
    echo = log or (lambda line: None)
    entries: list[dict[str, Any]] = []
    controls_record: dict[str, Any] | None = None
    with driven(run):  # SIGINT, SIGTERM, SIGHUP stop it cleanly; closed however it ends
        for label in STEP_LABELS[:3]:
            outcome = run.step(label)
            if not outcome.passed:
                raise Refused(f"calibration {label}: {outcome.message}")
        for index, handoff in enumerate(handoffs):
            environment = environments[(starts[index] - 1) % len(environments)]
            fresh = index == 0 or starts[index] != starts[index - 1]
            if index > 0 and fresh:  # the first handoff uses the producer the steps started (no overrides)
                try:
                    run.switch_prompt(handoff.document, handoff.prompt, environment)
                except ProducerFailed as exc:  # the producer's failure, not the harness's: no rule
                    raise Refused(f"calibration handoff {index + 1}/{len(handoffs)}: the producer did not "
                                  f"restart: {exc}") from None
            message = run._handoff(index)
            run.log(f"calibration handoff {index + 1}/{len(handoffs)} ({handoff.part} {handoff.document} "
                    f"@{len(handoff.prompt)}, {'fresh producer' if fresh else 'the same producer'} "
                    f"(start {starts[index]}), environment {environment or 'as the operator set it'}): {message}")
            entry: dict[str, Any] = {"repetition": index + 1, "part": handoff.part, "document": handoff.document,
                                     "prompt_tokens": len(handoff.prompt),
                                     "prompt_sha256": assets.prompt_sha256(handoff.prompt), "environment": environment}
            if non_deterministic:
                entry["producer_start"] = starts[index]
            entries.append(entry)
        run.settle_all()  # a deferred comparer's last samples
        for entry in entries:
            counts = run.draft_counts.get(entry["repetition"])
            entry["draft"] = None if counts is None else {"proposed": counts[0], "accepted": counts[1]}
        if controls_ref is not None:
            run.log(f"measuring E2 controls ({criteria.name}) in this process")
            controls_record = _measure_controls(spec, run._consumer, echo)
            run._receipt.add_evidence(CONTROLS_EVIDENCE, controls_record)
        from qualify.contract.rules import BOUND_RULE, BOUND_RULE_STATEMENT, FLOOR_RULE, FLOOR_RULE_STATEMENT

        evidence: dict[str, Any] = {
            "schema": ENVELOPE_EVIDENCE_SCHEMA if non_deterministic else CALIBRATION_EVIDENCE_SCHEMA,
            "lane": lane,
            "set": {"name": chosen_set.name, "sha256": set_digest},
            "rule": {"name": BOUND_RULE, "statement": BOUND_RULE_STATEMENT},
            "floor_rule": {"name": FLOOR_RULE, "statement": FLOOR_RULE_STATEMENT} if spec.speculative_draft else None,
            "fixture": {"name": assets.MAIN_PROMPT, "prompt_tokens": len(handoffs[-1].prompt),
                        "prompt_sha256": assets.prompt_sha256(handoffs[-1].prompt),
                        "output_tokens": chosen_set.output_tokens},
            "handoffs": entries,
            "controls": controls_ref,
        }
        if declared is not None:
            evidence["fixture_envelope"] = declared
        run._receipt.add_evidence(CALIBRATION_EVIDENCE, evidence)
        series = {repetition: handoff_series(arrays) for repetition, arrays in run.envelope_series.items()}
        judged = judge_calibration(run.records, evidence, lane=lane, rung=spec.recipe.rung,
                                   draft=spec.speculative_draft, restarts_minimum=chosen_set.producer_restarts_minimum,
                                   envelope_series=series)
        outcome_words, controls_outcome, table = _judged_controls(controls_record, criteria, run)
        verdict = judged.verdict
        if outcome_words:
            from dataclasses import replace

            verdict = replace(verdict, headline=f"{verdict.headline}; {outcome_words}")
        run.verdict = verdict
        run.receipt_path = run.finish(verdict)
    return Calibration(lane, run.records, judged.cells, judged.proposed_maximum_absolute,
                       judged.proposed_maximum_mean_absolute, judged.acceptance_floor, run.receipt_path,
                       judged.failures, judged.anchor_tokens_exact, judged.deterministic, verdict.passed,
                       verdict.headline, controls_outcome, table, judged.teacher_forced, judged.envelope,
                       non_deterministic)


def _judged_controls(record: dict[str, Any] | None, criteria: Any, run: QualificationRun
                     ) -> tuple[str, ControlsOutcome | None, dict[str, Any]]:
    """The controls' judgement for the calibration's headline: words, outcome, judgement as JSON."""
    if record is None:
        return "", None, {}
    from qualify.judge.controls import judge_controls
    from qualify.judge.scope import controls_words

    uri = f"receipt://{run._receipt.run_id}/evidence/{CONTROLS_EVIDENCE}.json"
    judged = judge_controls(record, criteria.document(), source=uri, lane=run._contract.lane)
    if judged.outcome is None:
        return f"controls not established: {'; '.join(judged.problems)}", None, judged.document()
    return controls_words(judged.outcome), judged.outcome, judged.document()

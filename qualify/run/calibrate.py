"""Calibration: measure a lane's handoffs under every numeric environment this host can run, archive
the measurement as the basis receipt a frozen identity cites, and propose the rule."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qualify.core.errors import Refused
from qualify.judge import Verdict
from qualify.run.contract import calibration_contract
from qualify.run.qualification import STEP_LABELS, QualificationRun, RunOptions


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
# moved with any of them shows it as differing digests, and the calibration fails.
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


ZERO_DRIFT_BOUND = 5e-324
"""The least positive double: the bound of a lane that showed no drift in any calibration handoff.
Deltas are non-negative, so only a zero delta meets it: the bit-exact rule, written in the
positive-bound form a bounded-drift recipe's schema requires (never a margin chosen by taste)."""


def propose_bound(observed: float) -> float | None:
    """The bound a calibration proposes for an observed maximum: the maximum itself, with no
    margin (the handoffs already ran under every calibration environment, and the engines'
    output does not move with them); :data:`ZERO_DRIFT_BOUND` when it is exactly zero; None when
    it is not a finite non-negative number."""
    import math

    if not math.isfinite(observed) or observed < 0:
        return None
    return float(observed) if observed > 0 else ZERO_DRIFT_BOUND


@dataclass
class Calibration:
    """A calibration's measured envelope and the rule it proposes (never applied by itself)."""

    lane: str
    records: list[dict[str, Any]]
    observed_max_abs: float
    observed_mean_abs: float
    tokens_exact: bool
    proposed_maximum_absolute: float | None
    proposed_maximum_mean_absolute: float | None
    receipt_path: Path | None
    failures: list[str]
    # Every deterministic digest equal across the handoffs (restarts, kernels, threads, dispatch).
    deterministic: bool = False


def calibrate(lane: str, recipe: str, repetitions: int, options: RunOptions,
              log: Callable[[str], None] | None = None) -> Calibration:
    """Measure ``repetitions`` handoffs of ``lane`` against the cold recompute, archive the run as
    a receipt (the basis a frozen identity cites), and propose bounds a hair above the envelope."""
    if repetitions < 1:
        raise Refused(f"--repetitions: found {repetitions}, expected at least 1")
    from qualify.contract.lanes import lane_spec
    from qualify.judge import judge_reproduction

    environments = calibration_environments()
    run = QualificationRun(options, calibration_contract(lane, recipe), log=log)
    failures: list[str] = []
    deterministic = False
    try:
        for label in STEP_LABELS[:3]:
            outcome = run.step(label)
            if not outcome.passed:
                raise Refused(f"calibration {label}: {outcome.message}")
        for index in range(repetitions):
            environment = environments[index % len(environments)]
            if index > 0:  # the first handoff uses the producer the steps started (no overrides)
                run.restart_producer(environment)
            message = run._handoff(index)
            run.log(f"calibration handoff {index + 1}/{repetitions} (fresh producer, environment "
                    f"{environment or 'as the operator set it'}): {message}")
        measured = [r for r in run.records if not r.get("error")]
        failures = [r["error"] for r in run.records if r.get("error")]
        tokens_exact = bool(measured) and all(r["token_agreement_rate"] == 1.0 for r in measured)
        observed_max = max((r["max_abs"] for r in measured), default=float("nan"))
        observed_mean = max((r["mean_abs"] for r in measured), default=float("nan"))
        proposal = (propose_bound(observed_max), propose_bound(observed_mean))
        # The samples are each other's basis: every deterministic digest must agree across them.
        spec = lane_spec(lane)
        determinism = judge_reproduction(measured, measured, rung=spec.recipe.rung, deterministic_producer=True,
                                         draft=spec.speculative_draft)
        deterministic = determinism.passed and len(measured) == repetitions
        headline = (f"calibration of {lane} over {repetitions} handoffs (a fresh producer each, "
                    f"{min(repetitions, len(environments))} environments): observed max abs {observed_max!r}, "
                    f"max mean abs {observed_mean!r}, tokens exact in every handoff: {tokens_exact}, "
                    f"deterministic digests equal in every handoff: {deterministic}; proposed rule "
                    f"maximum_absolute {proposal[0]}, maximum_mean_absolute {proposal[1]}")
        reasons = [f"handoff failed: {failure}" for failure in failures]
        if not tokens_exact:
            reasons.append("greedy tokens diverged: no bounded-drift rule can qualify this lane on this prompt")
        if not deterministic:
            reasons.append("the producer's output differs across restarts or environments: "
                           + "; ".join(check.detail for check in determinism.checks if not check.passed))
        run.verdict = Verdict(not reasons, headline, reasons or [headline])
        run.receipt_path = run.receipt.finalize(run.verdict)
    finally:
        run.close()
    return Calibration(lane, run.records, observed_max, observed_mean, tokens_exact,
                       proposal[0], proposal[1], run.receipt_path, failures, deterministic)

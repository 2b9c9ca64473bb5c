"""Calibration: measure a lane's handoffs under every numeric environment this host can run, archive
the measurement as the basis receipt a frozen identity cites, and propose the rule."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qualify.core.errors import Refused
from qualify.engines.base import LaneEngine
from qualify.evidence.comparers import ComparerFactory
from qualify.judge import judge_calibration
from qualify.run.contract import calibration_contract
from qualify.run.qualification import STEP_LABELS, QualificationRun, RunOptions, TransportFactory, driven


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
    headline: str = ""


def calibrate(lane: str, recipe: str, repetitions: int, options: RunOptions,
              log: Callable[[str], None] | None = None, *,
              transport: TransportFactory | None = None, comparer: ComparerFactory | None = None,
              environments: list[dict[str, str]] | None = None, consumer: LaneEngine | None = None) -> Calibration:
    """Measure ``repetitions`` handoffs of ``lane`` against the cold recompute, archive the run as
    a receipt (the basis a frozen identity cites), and propose the observed envelope as the rule.
    ``transport``/``comparer`` are the run's (default: producer process, host compare);
    ``environments`` the producer environments cycled through (default: every one this CPU runs;
    an in-process producer passes ``[{}]``, it has no environment of its own)."""
    if repetitions < 1:
        raise Refused(f"--repetitions: found {repetitions}, expected at least 1")
    from qualify.contract.lanes import lane_spec

    environments = calibration_environments() if environments is None else environments
    run = QualificationRun(options, calibration_contract(lane, recipe), log=log, transport=transport,
                           comparer=comparer, consumer=consumer)
    with driven(run):  # SIGINT, SIGTERM, SIGHUP stop it cleanly; closed however it ends
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
        run.settle_all()  # a deferred comparer's last samples
        spec = lane_spec(lane)
        judged = judge_calibration(run.records, lane=lane, rung=spec.recipe.rung, draft=spec.speculative_draft,
                                   repetitions=repetitions, environments=len(environments))
        run.verdict = judged.verdict
        run.receipt_path = run.finish(run.verdict)
    return Calibration(lane, run.records, judged.observed_max_abs, judged.observed_mean_abs, judged.tokens_exact,
                       judged.proposed_maximum_absolute, judged.proposed_maximum_mean_absolute, run.receipt_path,
                       judged.failures, judged.deterministic, judged.verdict.headline)

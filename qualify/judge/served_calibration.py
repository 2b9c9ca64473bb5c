"""A served pair's calibration judged, and the bounds its stated rule derives (issue 36 item 3).

``qualify calibrate --recipe native-text --prefill-url U --decode-url V`` serves each cell of the
calibration set (a document kept apart from the fixture, at one prompt length) three ways on the
pair, under the strongest logprobs the decode server grants: a cold recompute on the decode
server, a second cold recompute, and one handoff (prefill on the prefill server, decode from the
transferred KV). Both the second cold recompute and the handoff are compared with the first
(:func:`qualify.judge.served.compare_branch`): the decode server's own repeatability, and the
handoff's drift. A cell's values are the larger of the two comparisons' per-position maximum
(under top-k: the nats each move of the top-k rule needed) and mean |Δ logprob|; the bounds follow
from the cells by :data:`~qualify.contract.rules.SERVED_BOUND_RULE`, the lanes' policy
(:func:`qualify.judge.calibration.bound_of`, one implementation).

The calibration fails (no identity is written) unless every cold recompute was cold, every handoff
was one (the prefill server computed the prompt, the decode server's connector loaded it), every
compared position carried the evidence, every value is finite and at least two cells were measured.

Pure: branches in, numbers and a verdict out; :func:`bounds_from_evidence` re-derives the bounds
from a basis receipt's ``evidence/served-calibration.json`` when an identity is loaded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from qualify.contract.rules import SERVED_BOUND_RULE, SERVED_BOUND_RULE_STATEMENT, SERVED_TOP_K_RULE
from qualify.judge.calibration import ZERO_DRIFT_BOUND, bound_of
from qualify.judge.handoffs import Check, Verdict
from qualify.judge.served import (
    FULL,
    BranchDrift,
    Evidence,
    ServedBranch,
    ServedHandoff,
    bound_words,
    cold_check,
    compare_branch,
    loaded_check,
    prefill_check,
)

SERVED_CALIBRATION_EVIDENCE = "served-calibration"
"""The receipt evidence name of a served pair's calibration (``evidence/served-calibration.json``)."""
SERVED_CALIBRATION_SCHEMA = "trust-ladder.served-calibration-evidence.v1"


@dataclass(frozen=True)
class ServedCell:
    """One calibration cell as the pair served it."""

    document: str
    prompt_tokens: int
    cold: ServedBranch
    cold_again: ServedBranch
    handoff: ServedHandoff


@dataclass(frozen=True)
class CellMeasure:
    """A cell's two comparisons against its first cold recompute, and the values the rule takes."""

    document: str
    prompt_tokens: int
    cold_again: BranchDrift
    handoff: BranchDrift

    @property
    def max_abs(self) -> float | None:
        """The cell's maximum: the larger comparison's largest per-position movement (None: unusable)."""
        values = [d.movement for d in (self.cold_again, self.handoff)]
        if any(v is None for v in values):
            return None
        return max(v for v in values if v is not None)

    @property
    def mean_abs(self) -> float | None:
        values = [d.mean_abs for d in (self.cold_again, self.handoff)]
        if any(v is None for v in values):
            return None
        return max(v for v in values if v is not None)

    @property
    def usable(self) -> bool:
        return all(v is not None and math.isfinite(v) for v in (self.max_abs, self.mean_abs))

    def words(self) -> str:
        """One line for the operator: each comparison's maximum and mean, and under top-k the moves."""
        def side(name: str, drift: BranchDrift) -> str:
            movement, mean = drift.movement, drift.mean_abs
            text = (f"{name} max {'none' if movement is None else f'{movement:.6g}'}, mean "
                    f"{'none' if mean is None else f'{mean:.6g}'} over {len(drift.rows)} positions")
            if drift.first_divergence is not None:
                text += f" (tokens diverged at {drift.first_divergence})"
            if any(row.entered or row.left or row.out_of_order for row in drift.rows):
                text += (f", {drift.out_of_order} positions out of order, {drift.membership_moves} with ids "
                         f"entering or leaving the top k")
            return text

        return (f"cell {self.document}@{self.prompt_tokens}: {side('second cold vs cold', self.cold_again)}; "
                f"{side('handoff vs cold', self.handoff)}")

    def record(self) -> dict[str, Any]:
        """The cell as the evidence holds it."""
        return {"document": self.document, "prompt_tokens": self.prompt_tokens,
                "max_abs": self.max_abs if self.usable else None, "mean_abs": self.mean_abs if self.usable else None,
                "cold_again_vs_cold": self.cold_again.document(), "handoff_vs_cold": self.handoff.document()}


@dataclass(frozen=True)
class ServedBounds:
    """The bounds the rule derives and the spread it added."""

    maximum_absolute: float
    maximum_mean_absolute: float
    max_abs_spread: float
    mean_abs_spread: float


def derive_served_bounds(values: Sequence[tuple[float, float]]) -> ServedBounds | None:
    """The bounds :data:`SERVED_BOUND_RULE` gives for per-cell (max, mean) values; None with fewer
    than two cells (no spread)."""
    if len(values) < 2:
        return None
    maximum, max_spread = bound_of([value[0] for value in values])
    mean, mean_spread = bound_of([value[1] for value in values])
    return ServedBounds(maximum, mean, max_spread, mean_spread)


@dataclass(frozen=True)
class ServedCalibrationJudgement:
    """The cells measured, the bounds derived (None unless the calibration passed) and the verdict."""

    cells: tuple[CellMeasure, ...]
    bounds: ServedBounds | None
    verdict: Verdict

    def evidence(self, evidence: Evidence, calibration_set: Mapping[str, Any], output_tokens: int) -> dict[str, Any]:
        """The receipt's ``evidence/served-calibration.json``: every cell's comparisons (with the
        per-position series), the rule and the derived bounds."""
        bounds = self.bounds
        return {"schema": SERVED_CALIBRATION_SCHEMA, "set": dict(calibration_set), "output_tokens": output_tokens,
                "evidence": {"mode": evidence.mode, "top_k": evidence.k, "vocab": evidence.vocab},
                "rule": {"name": SERVED_BOUND_RULE, "statement": SERVED_BOUND_RULE_STATEMENT},
                "top_k_rule": None if evidence.mode == FULL else SERVED_TOP_K_RULE,
                "cells": [cell.record() for cell in self.cells],
                "bounds": None if bounds is None else {
                    "maximum_absolute": bounds.maximum_absolute, "maximum_mean_absolute": bounds.maximum_mean_absolute,
                    "max_abs_spread": bounds.max_abs_spread, "mean_abs_spread": bounds.mean_abs_spread}}


def _extreme(cells: Sequence[CellMeasure], which: str, what: str) -> str:
    values = [getattr(getattr(cell, which), what) for cell in cells]
    usable = [v for v in values if v is not None and math.isfinite(v)]
    return f"{max(usable):.6g}" if usable else "none"


def judge_served_calibration(cells: Sequence[ServedCell], evidence: Evidence, *,
                             output_tokens: int) -> ServedCalibrationJudgement:
    """Judge a served pair's calibration cells under ``evidence``."""
    measures: list[CellMeasure] = []
    checks: list[Check] = []
    for cell in cells:
        label = f"cell {cell.document}@{cell.prompt_tokens}"
        checks.append(cold_check(cell.cold, cell.prompt_tokens, f"{label}: cold recompute"))
        checks.append(cold_check(cell.cold_again, cell.prompt_tokens, f"{label}: second cold recompute"))
        checks.append(prefill_check(f"{label}: handoff", cell.handoff.prefill_external_hits, cell.prompt_tokens))
        checks.append(loaded_check(f"{label}: handoff", cell.handoff.loaded, cell.prompt_tokens))
        measure = CellMeasure(cell.document, cell.prompt_tokens,
                              compare_branch(cell.cold, cell.cold_again, evidence, output_tokens),
                              compare_branch(cell.cold, cell.handoff.loaded, evidence, output_tokens))
        measures.append(measure)
        short = measure.cold_again.short + measure.handoff.short
        checks.append(Check(f"{label}: evidence", short == 0 and measure.usable,
                            f"{evidence.words()} at every compared position, finite" if short == 0 and measure.usable
                            else f"{short} compared positions without {evidence.words()} on both branches"
                            if short else "a |Δ logprob| that is not a finite number"))
    usable = [(m.max_abs, m.mean_abs) for m in measures if m.usable]
    values = [(float(a), float(b)) for a, b in usable if a is not None and b is not None]
    checks.append(Check("calibration cells", len(measures) >= 2,
                        f"{len(measures)} cells measured" if len(measures) >= 2
                        else f"{len(measures)} cells: the rule needs at least 2"))
    passed = all(check.passed for check in checks)
    bounds = derive_served_bounds(values) if passed else None
    documents = len({m.document for m in measures})
    diverged = [f"{m.document}@{m.prompt_tokens}" for m in measures
                if m.handoff.first_divergence is not None or m.cold_again.first_divergence is not None]
    measured = (f"second cold recompute vs cold: max {_extreme(measures, 'cold_again', 'movement')}, mean "
                f"{_extreme(measures, 'cold_again', 'mean_abs')}; handoff vs cold: max "
                f"{_extreme(measures, 'handoff', 'movement')}, mean {_extreme(measures, 'handoff', 'mean_abs')}")
    if evidence.mode != FULL:
        moved = sum(m.handoff.out_of_order + m.cold_again.out_of_order for m in measures)
        members = sum(m.handoff.membership_moves + m.cold_again.membership_moves for m in measures)
        measured += f"; top-{evidence.k} positions out of order {moved}, with membership moves {members}"
    if diverged:
        measured += f"; greedy tokens diverged in {', '.join(diverged)} (compared up to the divergence)"
    derived = (f"rule {SERVED_BOUND_RULE} gives maximum_absolute {bound_words(bounds.maximum_absolute)}, "
               f"maximum_mean_absolute {bound_words(bounds.maximum_mean_absolute)}" if bounds is not None
               else "no bounds derived")
    headline = (f"calibration of a served pair on {evidence.words()}: {len(measures)} cells over {documents} "
                f"documents ({measured}); {derived}")
    failing = [f"{check.name}: {check.detail}" for check in checks if not check.passed]
    verdict = Verdict(passed, headline, failing or [headline], checks)
    return ServedCalibrationJudgement(tuple(measures), bounds, verdict)


def bounds_from_evidence(document: Any) -> tuple[ServedBounds | None, list[str]]:
    """The bounds :data:`SERVED_BOUND_RULE` gives for a basis receipt's served-calibration
    evidence (its cells' recorded values), and every problem that keeps it from giving them."""
    problems: list[str] = []
    if not isinstance(document, Mapping) or document.get("schema") != SERVED_CALIBRATION_SCHEMA:
        return None, [f"evidence: expected schema {SERVED_CALIBRATION_SCHEMA}"]
    rule = document.get("rule")
    if not isinstance(rule, Mapping) or rule.get("name") != SERVED_BOUND_RULE or \
            rule.get("statement") != SERVED_BOUND_RULE_STATEMENT:
        problems.append(f"rule: expected {SERVED_BOUND_RULE} as stated in qualify/contract/rules.py")
    cells = document.get("cells")
    values: list[tuple[float, float]] = []
    for index, cell in enumerate(cells if isinstance(cells, list) else []):
        maximum = cell.get("max_abs") if isinstance(cell, Mapping) else None
        mean = cell.get("mean_abs") if isinstance(cell, Mapping) else None
        if not all(isinstance(v, float) and math.isfinite(v) and v >= 0 for v in (maximum, mean)):
            problems.append(f"cells[{index}]: max_abs and mean_abs are not finite numbers >= 0")
            continue
        values.append((float(maximum), float(mean)))  # type: ignore[arg-type]
    bounds = derive_served_bounds(values)
    if bounds is None:
        problems.append(f"cells: {len(values)} usable, the rule needs at least 2")
    return (None if problems else bounds), problems


__all__ = [
    "SERVED_CALIBRATION_EVIDENCE", "SERVED_CALIBRATION_SCHEMA", "ZERO_DRIFT_BOUND", "CellMeasure", "ServedBounds",
    "ServedCalibrationJudgement", "ServedCell", "bounds_from_evidence", "derive_served_bounds",
    "judge_served_calibration",
]

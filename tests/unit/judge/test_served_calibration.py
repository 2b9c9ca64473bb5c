"""A served pair's calibration judged (qualify.judge.served_calibration): the bounds follow from the
cells by the lanes' policy (one implementation), a cell's value is the larger of its cold-vs-cold
and handoff-vs-cold comparisons, and a calibration without a real cold recompute or a real
handoff derives nothing."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from qualify.judge.calibration import ZERO_DRIFT_BOUND, CellDrift, derive_bounds
from qualify.judge.served import FULL, TOP_K, Evidence, ServedBranch, ServedHandoff
from qualify.judge.served_calibration import (
    ServedCell,
    bounds_from_evidence,
    derive_served_bounds,
    judge_served_calibration,
)

N, VOCAB, PROMPT = 6, 8, 32
EVIDENCE = Evidence(FULL, None, VOCAB)
SET = {"name": "calibration-set-v1", "sha256": "a" * 64}


def rows(shift: float = 0.0, at: int | None = None, width: int = VOCAB) -> tuple[dict[int, float], ...]:
    return tuple({t: -0.3 * t - 0.01 * p + (shift if p == at else 0.0) for t in range(width)} for p in range(N))


def branch(logprobs=None, *, tokens=None, external=0, local=0, cached=0) -> ServedBranch:
    return ServedBranch(tuple(tokens if tokens is not None else [0] * N), logprobs if logprobs is not None else rows(),
                        cached, external, local)


def cell(name: str = "doc", *, again=None, loaded=None, prefill_external: int | None = 0) -> ServedCell:
    return ServedCell(name, PROMPT, branch(), again or branch(),
                      ServedHandoff(1, 0, prefill_external, loaded or branch(external=PROMPT)))


def judged(cells, evidence=EVIDENCE):
    return judge_served_calibration(cells, evidence, output_tokens=N)


def test_cells_without_drift_give_the_bound_only_a_zero_delta_meets():
    judgement = judged([cell("a"), cell("b")])
    assert judgement.verdict.passed and judgement.bounds is not None
    assert (judgement.bounds.maximum_absolute, judgement.bounds.maximum_mean_absolute) == (ZERO_DRIFT_BOUND,) * 2
    assert "zero drift" not in judgement.verdict.headline.lower()


def test_the_bounds_are_the_lanes_policy_over_each_cells_larger_comparison():
    shifts = [(0.01, 0.0), (0.0, 0.03), (0.02, 0.005)]  # (second cold, handoff) per cell
    cells = [cell(f"d{i}", again=branch(rows(a, at=1)), loaded=branch(rows(h, at=2), external=PROMPT))
             for i, (a, h) in enumerate(shifts)]
    judgement = judged(cells)
    assert judgement.bounds is not None
    maxima = [max(a, h) for a, h in shifts]
    means = [max(a, h) / N for a, h in shifts]  # a shift moves every entry of one of the N positions
    assert judgement.bounds.maximum_absolute == pytest.approx(max(maxima) + statistics.stdev(maxima))
    lanes = derive_bounds([CellDrift(i, f"d{i}", PROMPT, m.max_abs, m.mean_abs, True)
                           for i, m in enumerate(judgement.cells)])
    assert lanes is not None
    assert (judgement.bounds.maximum_absolute, judgement.bounds.maximum_mean_absolute) == (
        lanes.maximum_absolute, lanes.maximum_mean_absolute)
    assert [m.mean_abs for m in judgement.cells] == pytest.approx(means)


@pytest.mark.parametrize("bad", [
    cell("b", again=branch(external=24)),                            # the second cold recompute loaded the prompt
    cell("b", again=branch(external=None, local=None)),              # its counters are unknown
    cell("b", prefill_external=24),                                  # the prefill server loaded instead of computing
    cell("b", loaded=branch(external=0)),                            # the handoff loaded nothing
    cell("b", loaded=branch(rows(width=VOCAB - 1), external=PROMPT)),  # short of the full vocabulary
    cell("b", loaded=branch(rows(math.inf, at=0), external=PROMPT)),   # a delta that is not finite
])
def test_a_calibration_without_real_cold_recomputes_and_handoffs_derives_nothing(bad):
    judgement = judged([cell("a"), bad])
    assert not judgement.verdict.passed and judgement.bounds is None


def test_one_cell_is_no_spread_and_derives_nothing():
    judgement = judged([cell("a")])
    assert not judgement.verdict.passed and judgement.bounds is None


def test_a_token_divergence_limits_the_comparison_to_the_positions_before_it():
    diverged = branch(rows(5.0, at=4), tokens=[0, 0, 0, 1, 1, 1], external=PROMPT)
    judgement = judged([cell("a"), cell("b", loaded=diverged)])
    assert judgement.verdict.passed
    assert judgement.cells[1].handoff.first_divergence == 3 and judgement.cells[1].max_abs == 0.0


def test_top_k_cells_count_the_moves_the_rule_needed():
    k = 3
    cold_rows = tuple({0: -0.1, 1: -1.0, 2: -2.0, 3: -2.0004} for _ in range(N))
    moved = tuple({0: -0.1, 1: -1.0, 3: -2.0001, 2: -2.0003} for _ in range(N))  # 3 enters, 2 leaves at the k-th
    cells = [ServedCell(name, PROMPT, branch(cold_rows), branch(cold_rows),
                        ServedHandoff(1, 0, 0, branch(moved, external=PROMPT))) for name in ("a", "b")]
    judgement = judged(cells, Evidence(TOP_K, k, 0))
    assert judgement.verdict.passed and judgement.bounds is not None
    assert judgement.cells[0].handoff.membership_moves == N
    assert judgement.cells[0].max_abs == pytest.approx(0.0004)  # id 3 entered from 0.0004 below the cold k-th


def test_the_bounds_follow_again_from_the_evidence_the_receipt_holds_and_not_from_an_edited_one():
    cells = [cell("a", loaded=branch(rows(0.01, at=1), external=PROMPT)), cell("b")]
    judgement = judged(cells)
    document = json.loads(json.dumps(judgement.evidence(EVIDENCE, SET, N)))
    bounds, problems = bounds_from_evidence(document)
    assert problems == [] and bounds == judgement.bounds
    edited = json.loads(json.dumps(document))
    edited["cells"][0]["max_abs"] = 1.0
    assert bounds_from_evidence(edited)[0] != judgement.bounds
    reworded = {**document, "rule": {**document["rule"], "statement": "any bound I like"}}
    assert bounds_from_evidence(reworded)[0] is None


def test_derive_served_bounds_needs_two_cells():
    assert derive_served_bounds([(0.1, 0.01)]) is None
    assert derive_served_bounds([(0.0, 0.0), (0.0, 0.0)]) is not None

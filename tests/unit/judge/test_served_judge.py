"""The served-pair judge (qualify.judge.served): a pass needs every piece of handoff evidence, the
exact greedy tokens and the logprobs within the identity's calibrated bounds, under full evidence
or the top-k rule; the top-k rule itself (judge_top_k_row), by hypothesis and by hand-built rows
that must fail."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qualify.judge.calibration import ZERO_DRIFT_BOUND
from qualify.judge.served import (
    FULL,
    TOP_K,
    Evidence,
    ServedBranch,
    ServedHandoff,
    ServedRule,
    judge_served_pair,
    judge_top_k_row,
    token_sha256,
    top_ids,
)

N, VOCAB, PROMPT = 8, 16, 64
BASIS = "receipt://20261205T090000Z-0123456789abcdef"


def rule(mode=FULL, k=None, bound=1e-3, mean_bound=None) -> ServedRule:
    return ServedRule(evidence=Evidence(mode, k, VOCAB), maximum_absolute=bound,
                      maximum_mean_absolute=bound if mean_bound is None else mean_bound, prompt_tokens=PROMPT,
                      output_tokens=N, repetitions=3, basis=BASIS, bound_rule="served-cell-max-plus-one-sd.v1",
                      top_k_rule=None if mode == FULL else "served-top-k-within-bound.v1")


def rows(width: int = VOCAB, shift: float = 0.0, at: int | None = None) -> tuple[dict[int, float], ...]:
    """Per position a descending logprob row of ``width`` ids (``shift`` added at position ``at``)."""
    return tuple({token: -0.5 * token - position * 0.01 + (shift if position == at else 0.0) for token in range(width)}
                 for position in range(N))


def branch(*, tokens=None, logprobs=None, cached=PROMPT // 2, external=PROMPT // 2, local=0) -> ServedBranch:
    return ServedBranch(tokens=tuple(tokens if tokens is not None else [0] * N),
                        logprobs=logprobs if logprobs is not None else rows(), cached_tokens=cached, external_hits=external,
                        local_hits=local)


COLD = branch(cached=0, external=0)


def handoffs(loaded: ServedBranch | None = None, *, prefill_external: int | None = 0) -> list[ServedHandoff]:
    return [ServedHandoff(repetition, 0, prefill_external, loaded or branch()) for repetition in (1, 2, 3)]


def failed_checks(verdict) -> list[str]:
    return [check.name for check in verdict.checks if not check.passed]


# --------------------------------------------------------------------------- the pair's verdict


def test_a_pair_with_every_piece_of_evidence_passes_with_its_evidence_and_calibration_in_the_scope():
    verdict, samples = judge_served_pair(COLD, handoffs(), rule())
    assert verdict.passed and verdict.status == "passed" and not failed_checks(verdict)
    assert verdict.scope is not None and verdict.scope.fixture.endswith("full-logprobs")
    assert verdict.scope.calibrated_on == BASIS and BASIS in verdict.headline
    assert (verdict.scope.repetitions, verdict.scope.prompt_tokens, verdict.scope.output_tokens) == (3, PROMPT, N)
    assert [sample.max_abs for sample in samples] == [0.0] * 3
    assert all(sample.compared_entries == N * VOCAB for sample in samples)
    document = samples[0].document()
    assert document["token_agreement_rate"] == 1.0 and document["localisation"]["first_divergence_position"] is None
    assert document["handoff_generated_token_sha256"] == document["cold_generated_token_sha256"] == token_sha256([0] * N)


def test_top_k_evidence_names_its_k_in_the_scope_and_compares_every_entry_both_rows_carry():
    top = rule(TOP_K, k=4)
    verdict, samples = judge_served_pair(branch(cached=0, external=0, logprobs=rows(5)), handoffs(branch(logprobs=rows(5))), top)
    assert verdict.passed and verdict.scope is not None and verdict.scope.fixture.endswith("top4-logprobs")
    assert samples[0].compared_entries == N * 5  # the top 4 and the fifth entry both rows carry
    assert top.document()["evidence"] == "top-k" and top.document()["top_k"] == 4


def test_top_k_ids_in_another_order_fail_even_when_the_tokens_agree():
    swapped = tuple({**row, 3: row[1], 1: row[3]} for row in rows(5))
    verdict, samples = judge_served_pair(branch(cached=0, external=0, logprobs=rows(5)),
                                         handoffs(branch(logprobs=swapped)), rule(TOP_K, k=2))
    assert not verdict.passed and samples[0].tokens_equal == N
    assert samples[0].document()["top_k_positions_with_membership_moves"] == N


@pytest.mark.parametrize("shift, passes", [(5e-4, True), (2e-3, False)])
def test_a_logprob_delta_passes_up_to_the_bound(shift, passes):
    verdict, samples = judge_served_pair(COLD, handoffs(branch(logprobs=rows(shift=shift, at=5))), rule(mean_bound=1.0))
    assert verdict.passed is passes
    assert samples[0].max_abs == pytest.approx(shift)


def test_a_mean_delta_outside_its_bound_fails_though_every_entry_is_within_the_maximum():
    shifted = tuple({token: value + 5e-4 for token, value in row.items()} for row in rows())
    assert judge_served_pair(COLD, handoffs(branch(logprobs=shifted)), rule(bound=1e-3, mean_bound=1e-3))[0].passed
    assert not judge_served_pair(COLD, handoffs(branch(logprobs=shifted)), rule(bound=1e-3, mean_bound=1e-4))[0].passed


def test_under_the_zero_bound_only_equal_logprobs_pass():
    zero = rule(bound=ZERO_DRIFT_BOUND)
    assert judge_served_pair(COLD, handoffs(), zero)[0].passed
    nudged = rows(shift=math.ulp(0.5), at=3)
    assert not judge_served_pair(COLD, handoffs(branch(logprobs=nudged)), zero)[0].passed


def test_a_token_divergence_fails_and_is_localised_and_later_rows_are_not_compared():
    tokens = [0] * 5 + [7] * 3
    verdict, samples = judge_served_pair(COLD, handoffs(branch(tokens=tokens, logprobs=rows(shift=9.0, at=7))), rule())
    assert not verdict.passed and verdict.status == "failed"
    assert (samples[0].first_divergence, samples[0].tokens_equal) == (5, 5)
    assert samples[0].max_abs == 0.0 and samples[0].document()["positions_compared"] == 6


def test_a_full_row_short_of_the_vocabulary_is_no_full_evidence():
    short = rows(VOCAB - 1)
    verdict, samples = judge_served_pair(COLD, handoffs(branch(logprobs=short)), rule())
    assert not verdict.passed and samples[0].positions_short == N


@pytest.mark.parametrize("loaded, prefill_external, cold", [
    (branch(cached=0, external=0), 0, COLD),                 # nothing loaded: the decode server recomputed
    (branch(cached=32, external=16, local=16), 0, COLD),     # half of it from the decode server's own prefix cache
    (branch(cached=32, external=None, local=None), 0, COLD),  # its /metrics did not account for the request
    (branch(), 32, COLD),                                    # the prefill server loaded the prompt instead of computing it
    (branch(), None, COLD),                                  # the prefill server's connector hits unknown
    (branch(), 0, branch(cached=32, external=32)),           # the cold branch was not cold
    (branch(), 0, branch(cached=0, external=0, local=32)),   # ... its prefix cache served it
    (branch(), 0, branch(cached=32, external=0)),            # ... it reported cached tokens
    (branch(), 0, branch(cached=None, external=None, local=None)),
])
def test_missing_evidence_of_a_real_handoff_fails_closed(loaded, prefill_external, cold):
    verdict, _ = judge_served_pair(cold, handoffs(loaded, prefill_external=prefill_external), rule())
    assert not verdict.passed and verdict.status == "failed" and len(failed_checks(verdict)) >= 1


def test_a_handshake_pair_reporting_the_prefill_servers_cached_count_passes_on_the_decode_servers_counters():
    # Under a prefill/decode handshake (NIXL) vLLM's usage on the decode server carries the prefill
    # server's cached count (0 here); its counters show the whole prompt came through the connector.
    verdict, samples = judge_served_pair(COLD, handoffs(branch(cached=0, external=PROMPT)), rule())
    assert verdict.passed and samples[0].external_hits == PROMPT and samples[0].cached_tokens == 0


def test_a_cold_branch_from_a_server_without_cached_token_counts_is_cold_on_its_counters():
    verdict, _ = judge_served_pair(branch(cached=None, external=0), handoffs(), rule())
    assert verdict.passed


def test_fewer_handoffs_than_the_rule_fail():
    verdict, _ = judge_served_pair(COLD, handoffs()[:2], rule())
    assert not verdict.passed


def test_the_rule_document_is_what_the_receipt_holds():
    document = rule(bound=0.5, mean_bound=0.25).document()
    assert document["kind"] == "served-pair" and document["evidence"] == "full" and document["top_k"] is None
    assert (document["maximum_absolute_logprob_delta"], document["maximum_mean_absolute_logprob_delta"]) == (0.5, 0.25)
    assert document["calibrated_on"] == BASIS


# --------------------------------------------------------------------------- the top-k rule, by hand

K = 4
COLD_ROW = {0: -0.1, 1: -1.0, 2: -2.0, 3: -3.0}
"""A cold top-4 row as a server gives it: the 4 ids only (c_k = -3.0)."""
BOUND = 1e-3
MUST_FAIL = {
    "a real rank change": {0: -1.0, 1: -0.1, 2: -2.0, 3: -3.0},
    "a swap across 1.5 bounds, each logprob within one": {0: -0.1, 1: -1.0, 2: -2.0008, 3: -2.0007},
    "an id missing from 2 nats above the k-th": {0: -0.1, 2: -2.0, 3: -3.0, 9: -3.0},
    "an id entering 1.5 nats above the k-th": {0: -0.1, 1: -1.0, 9: -1.5, 2: -2.0},
    "one logprob outside the bound": {0: -0.1, 1: -1.0, 2: -2.002, 3: -3.0},
    "fewer than k entries": {0: -0.1, 1: -1.0, 2: -2.0},
}
"""Hand-built loaded rows the rule must refuse against :data:`COLD_ROW` (the swap's cold row is
:data:`NEAR_ROW`); the golden file shows which clause each breaks."""
NEAR_ROW = {0: -0.1, 1: -1.0, 2: -2.0, 3: -2.0015}
MAY_PASS = {
    "a swap within the bound": (NEAR_ROW | {3: -2.0015}, {0: -0.1, 1: -1.0, 3: -1.9999, 2: -2.0}, 0.002),
    "an exchange at the k-th within the bound": (
        {0: -0.1, 1: -1.0, 2: -2.0, 3: -3.0, 5: -3.0005}, {0: -0.1, 1: -1.0, 2: -2.0, 5: -2.9996, 3: -3.0001}, BOUND),
}
"""(cold row, loaded row, bound) the rule holds: moves the bound covers."""


def cold_of(name: str) -> dict[int, float]:
    return NEAR_ROW if "swap across" in name else COLD_ROW


def test_the_same_row_holds_under_the_zero_bound():
    assert judge_top_k_row(COLD_ROW, dict(COLD_ROW), K, ZERO_DRIFT_BOUND).held


@pytest.mark.parametrize("name", list(MUST_FAIL))
def test_hand_built_rows_that_must_fail(name):
    verdict = judge_top_k_row(cold_of(name), MUST_FAIL[name], K, BOUND)
    assert not verdict.held and verdict.reason


@pytest.mark.parametrize("name", list(MAY_PASS))
def test_moves_within_the_bound_hold_and_fail_under_a_bound_below_them(name):
    cold, loaded, bound = MAY_PASS[name]
    verdict = judge_top_k_row(cold, loaded, K, bound)
    assert verdict.held and verdict.drift.movement > 0
    assert not judge_top_k_row(cold, loaded, K, verdict.drift.movement / 2).held


def test_an_exchange_at_the_k_th_counts_one_id_entering_and_one_leaving():
    cold, loaded, bound = MAY_PASS["an exchange at the k-th within the bound"]
    drift = judge_top_k_row(cold, loaded, K, bound).drift
    assert (drift.entered, drift.left) == (1, 1)


def test_a_tie_in_the_loaded_row_of_ids_apart_in_the_cold_one_counts_as_out_of_order():
    tied = {0: -0.1, 1: -1.5, 2: -1.5, 3: -3.0}
    verdict = judge_top_k_row(COLD_ROW, tied, K, 0.6)
    assert not verdict.held and verdict.drift.order_gap == pytest.approx(1.0)


# --------------------------------------------------------------------------- the top-k rule, by hypothesis

logprob = st.floats(min_value=-30.0, max_value=0.0, allow_nan=False)
row_strategy = st.dictionaries(st.integers(0, 40), logprob, min_size=1, max_size=30)


@settings(max_examples=300, deadline=None)
@given(row=row_strategy, k=st.integers(1, 30))
def test_a_row_against_itself_holds_under_the_zero_bound(row, k):
    verdict = judge_top_k_row(row, dict(row), k, ZERO_DRIFT_BOUND)
    assert verdict.held is (len(row) >= k)


@settings(max_examples=300, deadline=None)
@given(cold=row_strategy, loaded=row_strategy, k=st.integers(1, 10), bound=st.floats(1e-9, 5.0))
def test_the_row_holds_exactly_when_its_movement_is_within_the_bound(cold, loaded, k, bound):
    verdict = judge_top_k_row(cold, loaded, k, bound)
    assert verdict.held is (not verdict.drift.short and verdict.drift.movement <= bound)
    assert (verdict.reason is None) is verdict.held
    # The bound a row holds under is monotone: a looser bound never turns a hold into a failure.
    if verdict.held:
        assert judge_top_k_row(cold, loaded, k, bound * 2).held


@settings(max_examples=300, deadline=None)
@given(cold=row_strategy, k=st.integers(1, 10), data=st.data())
def test_nudges_within_the_bound_hold_and_a_top_id_moved_past_a_clear_gap_fails(cold, k, data):
    bound = 1e-3
    nudged = {token: value + data.draw(st.floats(-bound / 4, bound / 4)) for token, value in cold.items()}
    if len(cold) >= k:
        # Moves of at most bound/4 each keep every clause within bound/2 + ... <= bound.
        assert judge_top_k_row(cold, nudged, k, bound).held
    top = top_ids(cold, k)
    if len(cold) >= k >= 2 and cold[top[0]] - cold[top[-1]] > 2 * bound:
        demoted = {**cold, top[0]: cold[top[-1]] - 1.0}  # the first id falls below the k-th: a real change
        assert not judge_top_k_row(cold, demoted, k, bound).held

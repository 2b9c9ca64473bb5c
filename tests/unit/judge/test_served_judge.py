"""The served-pair judge (qualify.judge.served): a pass needs every piece of handoff evidence, the
exact greedy tokens and the logprobs within the bound, under full or top-k evidence."""

from __future__ import annotations

import dataclasses

import pytest

from qualify.judge.served import (
    FULL,
    TOP_K,
    ServedBranch,
    ServedHandoff,
    ServedRule,
    judge_served_pair,
    token_sha256,
)

N, VOCAB, PROMPT = 8, 16, 64


def rule(mode=FULL, k=None, bound=1e-3) -> ServedRule:
    return ServedRule(mode=mode, k=k, vocab=VOCAB, bound=bound, prompt_tokens=PROMPT, output_tokens=N, repetitions=3)


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


def test_a_pair_with_every_piece_of_evidence_passes_with_its_evidence_in_the_scope():
    verdict, samples = judge_served_pair(COLD, handoffs(), rule())
    assert verdict.passed and verdict.status == "passed" and not failed_checks(verdict)
    assert verdict.scope is not None and verdict.scope.fixture.endswith("full-logprobs")
    assert (verdict.scope.repetitions, verdict.scope.prompt_tokens, verdict.scope.output_tokens) == (3, PROMPT, N)
    assert [sample.max_abs for sample in samples] == [0.0] * 3
    assert all(sample.compared_entries == N * VOCAB for sample in samples)
    document = samples[0].document()
    assert document["token_agreement_rate"] == 1.0 and document["localisation"]["first_divergence_position"] is None
    assert document["handoff_generated_token_sha256"] == document["cold_generated_token_sha256"] == token_sha256([0] * N)


def test_top_k_evidence_names_its_k_in_the_scope_and_compares_the_k_entries():
    top = rule(TOP_K, k=4)
    verdict, samples = judge_served_pair(branch(cached=0, external=0, logprobs=rows(5)), handoffs(branch(logprobs=rows(5))), top)
    assert verdict.passed and verdict.scope is not None and verdict.scope.fixture.endswith("top4-logprobs")
    assert samples[0].compared_entries == N * 4
    assert top.document()["evidence"] == "top-k" and top.document()["top_k"] == 4


def test_other_top_k_token_ids_fail_even_when_the_tokens_agree():
    swapped = tuple({**row, 3: row[1], 1: row[3]} for row in rows(5))
    verdict, samples = judge_served_pair(branch(cached=0, external=0, logprobs=rows(5)),
                                         handoffs(branch(logprobs=swapped)), rule(TOP_K, k=2))
    assert not verdict.passed and samples[0].topk_mismatches == N and samples[0].tokens_equal == N


@pytest.mark.parametrize("shift, passes", [(5e-4, True), (2e-3, False)])
def test_a_logprob_delta_passes_up_to_the_bound(shift, passes):
    verdict, samples = judge_served_pair(COLD, handoffs(branch(logprobs=rows(shift=shift, at=5))), rule())
    assert verdict.passed is passes
    assert samples[0].max_abs == pytest.approx(shift)


def test_a_token_divergence_fails_and_is_localised():
    tokens = [0] * 5 + [7] * 3
    verdict, samples = judge_served_pair(COLD, handoffs(branch(tokens=tokens)), rule())
    assert not verdict.passed and verdict.status == "failed"
    assert (samples[0].first_divergence, samples[0].tokens_equal) == (5, 5)


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
    document = rule().document()
    assert document["kind"] == "served-pair" and document["evidence"] == "full" and document["top_k"] is None
    assert dataclasses.replace(rule(), bound=0.5).document()["maximum_absolute_logprob_delta"] == 0.5

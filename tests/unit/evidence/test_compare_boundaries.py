"""The comparison's edges: the refusals name the branch and field at fault, the smallest blocks
(one row, one or two logits, no rows, no draft) are measured rather than refused or crashed, and
the numpy, torch and comparer paths keep their bounds, units, digests, buffers and clocks."""

from __future__ import annotations

import hashlib
import math
import threading
import time

import numpy as np
import pytest

from qualify.core.errors import Refused
from qualify.engines.base import DecodeResult
from qualify.evidence import compare
from qualify.evidence.compare import (
    LogitDigests,
    LogitTransform,
    compare_branches,
    compare_kv,
    compare_logit_blocks,
    draft_acceptance_rate,
    draft_tokens_sha256,
    draft_trace_sha256,
    first_digest_mismatch,
    generated_token_sha256,
    logit_digests,
    parse_logit_transform,
    teacher_forced_drift,
    token_agreement,
    top1_top2_margins,
    transform_between,
)

F32 = np.float32


def _block(rows: int = 4, vocab: int = 3, seed: int = 0, scale: float = 4.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * scale).astype(F32)


def _branch(logits: np.ndarray, draft_trace=None) -> DecodeResult:
    return DecodeResult(logits.argmax(axis=1).astype(np.int64), logits, draft_trace=draft_trace)


def _refusal(call) -> str:
    with pytest.raises(Refused) as refusal:
        call()
    return str(refusal.value)


# ---- numpy refusals: each names the branch and the field -------------------------------------------


def test_compare_branches_refusals_name_the_branch_and_field_at_fault():
    cold = _block()
    good = _branch(cold)
    bounds = dict(maximum_absolute=1.0, maximum_mean_absolute=1.0)
    cases = [
        (lambda: compare_branches(DecodeResult(good.tokens.astype(np.float64), cold), good, "raw", **bounds),
         "handoff tokens: expected a 1-D integer token array, found float64[4]"),
        (lambda: compare_branches(good, DecodeResult(good.tokens.reshape(4, 1), cold), "raw", **bounds),
         "cold tokens: expected a 1-D integer token array, found int64[4, 1]"),
        (lambda: compare_branches(DecodeResult(good.tokens, cold.astype(np.float64)), good, "raw", **bounds),
         "handoff logits: expected float32 [rows, vocab] logits, found float64[4, 3]"),
        (lambda: compare_branches(good, DecodeResult(good.tokens, np.zeros((4, 0), F32)), "raw", **bounds),
         "cold logits: logit rows are empty"),
        (lambda: compare_branches(good, DecodeResult(good.tokens, _block(vocab=5)), "raw", **bounds),
         "logits: shapes differ: handoff [4, 3] vs cold [4, 5]"),
        (lambda: compare_branches(good, good, "raw", teacher_forced_logits=cold.astype(np.float64), **bounds),
         "teacher-forced logits: expected float32 [rows, vocab] logits, found float64[4, 3]"),
        (lambda: compare_branches(good, good, "raw", teacher_forced_logits=cold[:3], **bounds),
         "teacher-forced logits: shapes differ: handoff [3, 3] vs cold [4, 3]"),
    ]
    assert [_refusal(call) for call, _ in cases] == [words for _, words in cases]


def test_block_and_drift_refusals_name_the_field_at_fault():
    cold = _block()
    cases = [
        (lambda: compare_logit_blocks(cold.astype(np.float64), cold),
         "handoff logits: expected float32 [rows, vocab] logits, found float64[4, 3]"),
        (lambda: compare_logit_blocks(cold, cold[0]),
         "cold logits: expected float32 [rows, vocab] logits, found float32[3]"),
        (lambda: compare_logit_blocks(cold, cold[:2]), "logits: shapes differ: handoff [4, 3] vs cold [2, 3]"),
        (lambda: teacher_forced_drift(cold.astype(np.float64), cold),
         "teacher-forced logits: expected float32 [rows, vocab] logits, found float64[4, 3]"),
        (lambda: teacher_forced_drift(cold, np.zeros((4, 0), F32)), "cold logits: logit rows are empty"),
        (lambda: teacher_forced_drift(cold[:3], cold),
         "teacher-forced logits: shapes differ: handoff [3, 3] vs cold [4, 3]"),
        (lambda: logit_digests(np.zeros((2, 0), F32)), "logits: logit rows are empty"),
        (lambda: top1_top2_margins(cold.astype(np.float64)),
         "logits: expected float32 [rows, vocab] logits, found float64[4, 3]"),
    ]
    assert [_refusal(call) for call, _ in cases] == [words for _, words in cases]


def test_token_refusals_name_the_branch_and_field_at_fault():
    tokens = np.array([1, 2, 3], dtype=np.int64)
    cases = [
        (lambda: token_agreement(tokens.astype(np.float32), tokens),
         "handoff tokens: expected a 1-D integer token array, found float32[3]"),
        (lambda: token_agreement(tokens, tokens.reshape(1, 3)),
         "cold tokens: expected a 1-D integer token array, found int64[1, 3]"),
        (lambda: token_agreement(tokens, np.append(tokens, 4)), "tokens: shapes differ: handoff [3] vs cold [4]"),
        (lambda: token_agreement(tokens[:0], tokens[:0]), "tokens: no generated tokens to compare"),
        (lambda: generated_token_sha256(np.array([-1], dtype=np.int64)), "generated tokens: token ids must fit uint32"),
        (lambda: generated_token_sha256(np.array([1 << 32], dtype=np.int64)),
         "generated tokens: token ids must fit uint32"),
        (lambda: generated_token_sha256(np.array([True])),
         "generated tokens: expected a 1-D integer token array, found bool[1]"),
    ]
    assert [_refusal(call) for call, _ in cases] == [words for _, words in cases]


def test_the_largest_uint32_token_id_is_accepted_and_hashed_as_four_bytes():
    assert generated_token_sha256(np.array([0xFFFFFFFF], dtype=np.int64)) == hashlib.sha256(b"\xff" * 4).hexdigest()


def test_one_generated_token_is_enough_to_compare():
    same = token_agreement(np.array([7]), np.array([7]))
    other = token_agreement(np.array([7]), np.array([8]))
    assert (same.rate, same.first_divergence) == (1.0, None)
    assert (other.rate, other.first_divergence) == (0.0, 0)


def test_kv_without_layers_is_refused_in_words():
    assert _refusal(lambda: compare_kv([], [], [], [])) == "kv: no layers to compare"


# ---- transforms -----------------------------------------------------------------------------------


def test_a_transform_that_is_not_text_is_refused_not_crashed():
    assert _refusal(lambda: parse_logit_transform(None)) == (
        "logit transform: found None, expected 'raw' or 'tanh-softcap:<positive cap>'")


@pytest.mark.parametrize(("spec", "cap"), [("tanh-softcap:0.5", 0.5), ("tanh-softcap:1", 1.0)])
def test_a_soft_cap_at_or_below_one_is_still_positive_and_accepted(spec, cap):
    assert parse_logit_transform(spec) == LogitTransform(spec, cap)


def test_equal_units_need_the_raw_transform():
    assert transform_between("tanh-softcap:30", "tanh-softcap:30") == LogitTransform("raw", None)


def test_a_capped_transform_writes_into_the_buffer_it_is_given_in_float32():
    transform = parse_logit_transform("tanh-softcap:2")
    rows = np.array([[0.0, 1.0, -50.0]], dtype=np.float64)
    out = np.zeros((1, 3), F32)
    written = transform.apply(rows.astype(F32), out=out)
    assert written is out
    # 2 * tanh(1 / 2), and a logit far past the cap lands on -cap.
    np.testing.assert_allclose(out, [[0.0, 2 * math.tanh(0.5), -2.0]], rtol=1e-6)
    assert transform.apply(rows).dtype == np.float32


# ---- the smallest blocks ------------------------------------------------------------------------


def test_one_logit_per_row_is_digested_and_has_an_infinite_margin():
    logits = np.array([[1.0], [2.0]], F32)
    digests = logit_digests(logits)
    assert digests.row_sha256 == tuple(hashlib.sha256(row.tobytes()).hexdigest() for row in logits)
    margins = top1_top2_margins(logits)
    assert margins.dtype == np.float64 and margins.tolist() == [math.inf, math.inf]


def test_margins_of_two_and_three_logit_rows_see_the_runner_up_on_either_side():
    assert top1_top2_margins(np.array([[1.0, 3.0], [4.0, 1.5]], F32)).tolist() == [2.0, 2.5]
    # The winner second (runner-up before it) and second to last (runner-up after it).
    rows = np.array([[2.0, 5.0, 1.0], [1.0, 5.0, 4.0]], F32)
    assert top1_top2_margins(rows).tolist() == [3.0, 1.0]


def test_blocks_without_rows_measure_nan_not_a_crash():
    empty = np.zeros((0, 3), F32)
    delta = compare_logit_blocks(empty, empty, maximum_absolute=1.0, maximum_mean_absolute=1.0)
    assert math.isnan(delta.max_abs) and math.isnan(delta.mean_abs) and delta.first_row_over_rule is None


def test_a_chunk_holds_as_many_whole_rows_as_fit_and_at_least_one(monkeypatch):
    monkeypatch.setattr(compare, "CHUNK_BYTES", 4 * 1000 * 3)
    assert compare._chunk_rows(1000) == 3
    assert compare._chunk_rows(1001) == 2
    monkeypatch.setattr(compare, "CHUNK_BYTES", 100)
    assert compare._chunk_rows(1000) == 1


def test_tall_blocks_streamed_one_row_at_a_time_are_digested_and_counted_whole(monkeypatch):
    # More rows than logits per row, one row per chunk: every row must be visited.
    monkeypatch.setattr(compare, "CHUNK_BYTES", 8)
    cold = _block(rows=6, vocab=2, seed=3)
    forced = cold.copy()
    forced[0] = forced[0, ::-1]
    forced[5] = forced[5, ::-1]
    digests = logit_digests(cold)
    assert len(digests.row_sha256) == 6
    assert digests.block_sha256 == hashlib.sha256(cold.tobytes()).hexdigest()
    assert teacher_forced_drift(forced, cold).top1_flips == 2


def test_teacher_forced_drift_is_measured_in_the_contract_units():
    cold = np.zeros((1, 2), F32)
    forced = np.array([[100.0, 0.0]], F32)
    assert teacher_forced_drift(forced, cold, "raw").max_abs == 100.0
    capped = teacher_forced_drift(forced, cold, "tanh-softcap:5")
    assert capped.max_abs == pytest.approx(5 * math.tanh(20.0), rel=1e-6)


# ---- bounds, units and drafts in one comparison --------------------------------------------------


def test_bit_identical_branches_under_a_soft_cap_differ_by_exactly_zero():
    cold = _block(rows=6, vocab=50, scale=40.0)
    result = compare_branches(_branch(cold.copy()), _branch(cold), "tanh-softcap:30", maximum_absolute=0.0,
                              maximum_mean_absolute=0.0, teacher_forced_logits=cold.copy())
    assert (result.max_abs, result.mean_abs, result.delta.first_row_over_rule) == (0.0, 0.0, None)
    assert (result.teacher_forced.max_abs, result.teacher_forced.mean_abs) == (0.0, 0.0)


def _one_row_over_the_maximum_only():
    """Row 2 of 4 moves one logit of ten by 0.5: over a 0.25 maximum, far under a 1.0 mean."""
    cold = _block(rows=4, vocab=10, seed=5)
    handoff = cold.copy()
    handoff[2, 0] += F32(0.5)
    return handoff, cold


def test_a_row_over_the_maximum_alone_is_located_in_both_the_free_and_teacher_forced_runs():
    handoff, cold = _one_row_over_the_maximum_only()
    result = compare_branches(_branch(handoff), _branch(cold), "raw", maximum_absolute=0.25,
                              maximum_mean_absolute=1.0, teacher_forced_logits=handoff)
    assert result.delta.first_row_over_rule == 2 and result.teacher_forced.first_row_over_rule == 2


def test_a_trace_proposing_and_accepting_nothing_has_a_digest_and_no_rate():
    assert draft_tokens_sha256([((), 0)]) == hashlib.sha256(b"").hexdigest()
    assert draft_tokens_sha256([]) == hashlib.sha256(b"").hexdigest()
    assert draft_acceptance_rate([((), 0)]) is None


def test_a_draft_with_nothing_accepted_has_a_zero_rate():
    assert draft_acceptance_rate([((1, 2), 0), ((3,), 0)]) == 0.0


def test_the_draft_trace_digest_is_of_compact_json():
    assert draft_trace_sha256([((1, 2), 1), ((3,), 0)]) == hashlib.sha256(b"[[[1,2],1],[[3],0]]").hexdigest()


def test_the_handoff_draft_counts_reach_the_comparison():
    cold = _block()
    result = compare_branches(_branch(cold, [((1, 2, 3), 3), ((4, 5), 1)]), _branch(cold), "raw",
                              maximum_absolute=1.0, maximum_mean_absolute=1.0)
    assert result.handoff_draft_counts == (5, 4) and result.cold_draft_tokens_sha256 is None


def test_a_shorter_digest_list_that_agrees_so_far_mismatches_at_its_length():
    three = LogitDigests(("a", "b", "c"), "block")
    two = LogitDigests(("a", "b"), "other")
    assert first_digest_mismatch(two, three) == 2 and first_digest_mismatch(three, two) == 2


# ---- torch: the device comparison ---------------------------------------------------------------


@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="the device comparison needs torch (the torch extra)")


class _TickPerThread:
    """A perf_counter that advances one second per call on each thread, so every timed span is
    exactly one second however the hashing threads interleave."""

    def __init__(self) -> None:
        self._local = threading.local()

    def perf_counter(self) -> float:
        self._local.now = getattr(self._local, "now", 0.0) + 1.0
        return self._local.now


def test_device_logit_and_token_refusals_say_what_was_found(torch):
    from qualify.evidence.compare_device import DeviceBranch, LogitDigester, prepare_cold

    cold = torch.from_numpy(_block())
    tokens = cold.argmax(dim=1)
    with LogitDigester(threads=2) as digester:
        cases = [
            (lambda: digester.submit([[1.0]]), "logits: expected float32 [rows, vocab] logits, found list"),
            (lambda: digester.submit(cold.double()),
             "logits: expected float32 [rows, vocab] logits, found torch.float64[4, 3]"),
            (lambda: digester.submit(torch.zeros(2, 0)), "logits: logit rows are empty"),
            (lambda: prepare_cold(DeviceBranch(tokens, cold[0]), "raw", digester),
             "cold logits: expected float32 [rows, vocab] logits, found torch.float32[3]"),
            (lambda: prepare_cold(DeviceBranch(tokens.tolist(), cold), "raw", digester),
             "cold tokens: expected a 1-D integer token tensor, found list"),
            (lambda: prepare_cold(DeviceBranch(tokens.float(), cold), "raw", digester),
             "cold tokens: expected a 1-D integer token tensor, found torch.float32[4]"),
            (lambda: prepare_cold(DeviceBranch(tokens[:3], cold), "raw", digester),
             "decode result: 4 cold logit rows but 3 cold tokens"),
        ]
        assert [_refusal(call) for call, _ in cases] == [words for _, words in cases]


def test_device_handoff_refusals_name_the_handoff_field(torch):
    from qualify.evidence.compare_device import DeviceBranch, LogitDigester, prepare_cold, start_comparison

    cold = torch.from_numpy(_block())
    tokens = cold.argmax(dim=1)
    bounds = dict(maximum_absolute=1.0, maximum_mean_absolute=1.0)
    with LogitDigester(threads=2) as digester:
        reference = prepare_cold(DeviceBranch(tokens, cold), "raw", digester)
        cases = [
            (lambda: start_comparison(DeviceBranch(tokens, cold.double()), reference, "raw", digester=digester,
                                      **bounds),
             "handoff logits: expected float32 [rows, vocab] logits, found torch.float64[4, 3]"),
            (lambda: start_comparison(DeviceBranch(tokens.bool(), cold), reference, "raw", digester=digester,
                                      **bounds),
             "handoff tokens: expected a 1-D integer token tensor, found torch.bool[4]"),
            (lambda: start_comparison(DeviceBranch(tokens, cold), reference, "raw", digester=digester,
                                      teacher_forced_logits=cold.half(), **bounds),
             "teacher-forced logits: expected float32 [rows, vocab] logits, found torch.float16[4, 3]"),
            (lambda: start_comparison(DeviceBranch(tokens, cold), reference, "raw", digester=digester,
                                      teacher_forced_logits=cold[:3], **bounds),
             "teacher-forced logits: shapes differ: handoff [3, 3] vs cold [4, 3]"),
        ]
        assert [_refusal(call) for call, _ in cases] == [words for _, words in cases]


def test_device_kv_refusals_name_the_layer_and_tensor(torch):
    from qualify.evidence.compare_device import compare_kv_device

    kv = torch.zeros(2, 6, 4)
    short = torch.zeros(2, 5, 4)
    cases = [
        (lambda: compare_kv_device([], [], [], []), "kv: no layers to compare"),
        (lambda: compare_kv_device([torch.zeros(2, 3)], [kv], [kv], [kv]),
         "kv layer 0 K: expected [kv_heads, positions, head_dim], found [2, 3]"),
        (lambda: compare_kv_device([kv], [torch.zeros(2, 3)], [kv], [kv]),
         "kv layer 0 V: expected [kv_heads, positions, head_dim], found [2, 3]"),
        (lambda: compare_kv_device([kv, short], [kv, kv], [kv, kv], [kv, kv]),
         "kv layer 1 K: 5 handed-off positions, layer 0 has 6"),
        (lambda: compare_kv_device([kv, kv], [kv, short], [kv, kv], [kv, kv]),
         "kv layer 1 V: 5 handed-off positions, layer 0 has 6"),
        (lambda: compare_kv_device([kv], [kv], [torch.zeros(3, 6, 4)], [kv]),
         "kv layer 0 K: handed-off shape [2, 6, 4] does not fit own prefill [3, 6, 4]"),
        (lambda: compare_kv_device([kv], [kv], [kv], [torch.zeros(2, 6, 4, 1)]),
         "kv layer 0 V: handed-off shape [2, 6, 4] does not fit own prefill [2, 6, 4, 1]"),
    ]
    assert [_refusal(call) for call, _ in cases] == [words for _, words in cases]


def test_device_cold_margins_of_one_and_two_logit_rows_and_a_nan_row(torch):
    from qualify.evidence.compare_device import DeviceBranch, LogitDigester, prepare_cold

    def margins(rows):
        logits = torch.tensor(rows, dtype=torch.float32)
        return prepare_cold(DeviceBranch(logits.argmax(dim=1), logits), "raw", digester).margins

    with LogitDigester(threads=2) as digester:
        one = margins([[1.0], [2.0]])
        assert one.dtype == np.float64 and one.tolist() == [math.inf, math.inf]
        assert margins([[1.0, 3.0], [4.0, 1.5]]).tolist() == [2.0, 2.5]
        # Only the row holding the NaN loses its margin.
        mixed = margins([[1.0, 3.0, 0.0], [math.nan, 1.0, 0.0]])
        assert mixed[0] == 2.0 and math.isnan(mixed[1])


def test_a_one_row_device_comparison_with_teacher_forcing_reports_its_flip_timings_and_drafts(torch):
    from qualify.evidence.compare_device import DeviceBranch, LogitDigester, prepare_cold, start_comparison

    cold = torch.tensor([[3.0, 1.0, 0.0]])
    forced = torch.tensor([[1.0, 3.0, 0.0]])
    handoff_trace, cold_trace = [((1, 2), 1)], [((3,), 1)]
    with LogitDigester(threads=2) as digester:
        reference = prepare_cold(DeviceBranch(cold.argmax(dim=1), cold, cold_trace), "raw", digester)
        began = time.perf_counter()
        pending = start_comparison(DeviceBranch(cold.argmax(dim=1), cold.clone(), handoff_trace), reference, "raw",
                                   maximum_absolute=1.0, maximum_mean_absolute=1.0, digester=digester,
                                   teacher_forced_logits=forced)
        wall = time.perf_counter() - began
        assert set(pending.timings) == {"logit_pass_s", "logit_pass_bytes", "summaries_s"}
        # Two passes (free run, teacher-forced), each reading its block and the cold block.
        assert pending.timings["logit_pass_bytes"] == 4 * 3 * 4
        assert 0.0 <= pending.timings["summaries_s"] <= wall
        result = pending.result()
    assert "digest_wait_s" in pending.timings
    assert result.teacher_forced.top1_flips == 1
    assert result.handoff_draft_tokens_sha256 == draft_tokens_sha256(handoff_trace)
    assert result.cold_draft_tokens_sha256 == draft_tokens_sha256(cold_trace)
    assert result.cold_draft_trace_sha256 == draft_trace_sha256(cold_trace)
    assert result.handoff_draft_counts == (2, 1)


def test_a_device_row_over_the_maximum_alone_is_located_in_both_runs(torch):
    from qualify.evidence.compare_device import DeviceBranch, compare_branches_device

    handoff, cold = _one_row_over_the_maximum_only()
    t = torch.from_numpy
    result = compare_branches_device(
        DeviceBranch(t(handoff.argmax(axis=1)), t(handoff)), DeviceBranch(t(cold.argmax(axis=1)), t(cold)), "raw",
        maximum_absolute=0.25, maximum_mean_absolute=1.0, teacher_forced_logits=t(handoff))
    assert result.delta.first_row_over_rule == 2 and result.teacher_forced.first_row_over_rule == 2


def test_compare_branches_device_closes_only_the_digester_it_made_and_uses_the_one_given(torch, monkeypatch):
    from qualify.evidence import compare_device
    from qualify.evidence.compare_device import DeviceBranch, LogitDigester, compare_branches_device

    closed = []
    close = LogitDigester.close
    monkeypatch.setattr(LogitDigester, "close", lambda self: (closed.append(self), close(self))[1])
    cold = torch.from_numpy(_block(rows=3, vocab=5))
    branch = DeviceBranch(cold.argmax(dim=1), cold)
    bounds = dict(maximum_absolute=1.0, maximum_mean_absolute=1.0)
    compare_branches_device(branch, branch, "raw", **bounds)
    assert len(closed) == 1
    given = compare_device.LogitDigester(threads=2)
    for _ in range(2):  # still open for a second sample
        compare_branches_device(branch, branch, "raw", digester=given, **bounds)
    assert len(closed) == 1
    given.close()
    # Two samples, each a handoff and a cold block, each hashed by a row pass and a block pass.
    assert given.hashed_bytes == 2 * 2 * 2 * cold.numel() * 4


@pytest.mark.parametrize("threads", [True, 2.5, "3", 1])
def test_the_digester_refuses_a_thread_count_that_is_not_an_integer_of_at_least_two(torch, threads):
    from qualify.evidence.compare_device import LogitDigester

    assert _refusal(lambda: LogitDigester(threads)) == (
        f"logit digester threads: expected an integer >= 2, found {threads!r}")


def test_the_digester_refuses_a_big_endian_host(torch, monkeypatch):
    import sys

    from qualify.evidence.compare_device import LogitDigester

    monkeypatch.setattr(sys, "byteorder", "big")
    assert _refusal(LogitDigester) == (
        "logit digests: float32 rows are hashed as little-endian bytes; this host is big-endian")


@pytest.mark.parametrize("threads", [2, 3])
def test_the_digester_accounts_every_hashing_pass(torch, monkeypatch, threads):
    from qualify.evidence import compare_device
    from qualify.evidence.compare_device import LogitDigester

    monkeypatch.setattr(compare_device, "time", _TickPerThread())
    logits = torch.from_numpy(_block(rows=5, vocab=7))
    with LogitDigester(threads=threads) as digester:
        assert (digester.hash_seconds, digester.hashed_bytes) == (0.0, 0)
        job = digester.submit(logits)
        assert job.result() == logit_digests(logits.numpy())
    # One block pass and the rows split over the other threads, one tick each pass; the block
    # pass and the row passes each read every byte once.
    assert digester.hash_seconds == float(threads)
    assert digester.hashed_bytes == 2 * logits.numel() * 4


def test_a_reserved_buffer_serves_a_block_of_its_size_and_comes_back(torch):
    from qualify.evidence.compare_device import LogitDigester

    logits = torch.from_numpy(_block(rows=4, vocab=5))
    digester = LogitDigester(threads=2)
    digester.reserve(4, 5, 1, pinned=False)
    digester.submit(logits)
    digester.close()  # without waiting for the job: closing waits for the hashing
    assert digester.hashed_bytes == 2 * logits.numel() * 4
    assert [buffer.numel() for buffer in digester._free] == [20]


def test_a_reserved_buffer_too_small_for_the_block_is_not_used(torch):
    from qualify.evidence.compare_device import LogitDigester

    logits = torch.from_numpy(_block(rows=4, vocab=5))
    with LogitDigester(threads=2) as digester:
        digester.reserve(1, 1, 1, pinned=False)
        assert digester.submit(logits).result() == logit_digests(logits.numpy())


# ---- the comparers --------------------------------------------------------------------------------


def test_a_bfloat16_host_array_becomes_a_bfloat16_tensor_of_the_same_values(torch):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from qualify.evidence.comparers import host_tensor

    tensor = host_tensor(np.array([1.5, -2.0, 0.0], dtype=ml_dtypes.bfloat16))
    assert tensor.dtype == torch.bfloat16 and tensor.tolist() == [1.5, -2.0, 0.0]


def test_the_device_comparer_refuses_to_compare_before_its_reference_and_times_each_step(torch, monkeypatch):
    from qualify.evidence import compare_device
    from qualify.evidence.comparers import DeviceComparer
    from tests.unit.evidence.test_comparers import _setup

    setup, engine = _setup()
    kv = engine.prefill(setup.prompt[:setup.handoff_positions])
    pending = setup.prompt[setup.handoff_positions:]
    comparer = DeviceComparer(setup, engine, "cpu", digest_threads=2)
    try:
        assert comparer.last_timings == {}
        with pytest.raises(RuntimeError) as early:
            comparer.compare(kv, pending, meanwhile=lambda: None)
        assert str(early.value) == "DeviceComparer.compare before reference()"
        monkeypatch.setattr(compare_device, "time", _TickPerThread())
        # The reference's seconds are its prefill's and its decode's, one tick each.
        assert comparer.reference() == 2.0
        monkeypatch.undo()
        compared = comparer.compare(kv, pending, meanwhile=lambda: None)
        compared.result()
        assert compared.seconds["digest_wait"] == comparer.last_timings["digest_wait_s"]
    finally:
        comparer.close()
    # The two buffers reserved for the run (cold block, handoff block) are back, and no more.
    assert len(comparer.digester._free) == 2


def test_the_host_comparer_asked_to_reuse_a_reference_it_never_made_recomputes_it(torch):
    import dataclasses

    from qualify.evidence.comparers import HostComparer
    from tests.unit.evidence.test_comparers import _setup

    setup, engine = _setup()
    setup = dataclasses.replace(setup, reference_once=True)
    kv = engine.prefill(setup.prompt[:setup.handoff_positions])
    comparer = HostComparer(setup)
    compared = comparer.compare(kv, setup.prompt[setup.handoff_positions:], meanwhile=lambda: None)
    assert "recompute" in compared.seconds and compared.result().max_abs == 0.0

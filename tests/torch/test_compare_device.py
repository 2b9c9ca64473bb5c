"""qualify.evidence.compare_device against qualify.evidence.compare on the same data, plus the scale bench's smoke.

compare_device computes the full-logit comparison with torch where the logits are; on CPU
tensors it must give compare.py's BranchComparison: equal tokens, digests, row maxima, margins,
first rows over the rule, divergence localisation, teacher-forced flips and KV deltas; row and
overall means equal to float32 summation rounding (torch reduces rows in another order than
numpy's pairwise sum: relative 1e-5). Cases: agreeing branches, a diverging branch with teacher
forcing, a tanh soft cap, a NaN row (fail closed), refusals. The smoke runs bench/gpu_scale.py's
tiny profile on the CPU end to end (receipt verified). CUDA (skipped without a GPU): the same
equivalence with the blocks on the GPU.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from qualify.core.errors import Refused
from qualify.engines.base import DecodeResult
from qualify.evidence.compare import BranchComparison, compare_branches, logit_digests

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]

ROWS, VOCAB = 48, 1500
MEAN_RTOL = 1e-5
REPO_ROOT = Path(__file__).resolve().parents[2]


def _data(seed: int = 1, noise: float = 1e-3, diverge_at: int | None = None):
    """Cold and handoff blocks (handoff = cold + noise; every seed used here keeps all greedy
    tokens); when ``diverge_at`` is given, the handoff's rows from there get a new top-1."""
    rng = np.random.default_rng(seed)
    cold = (rng.standard_normal((ROWS, VOCAB)) * 4).astype(np.float32)
    handoff = (cold + rng.standard_normal((ROWS, VOCAB)) * noise).astype(np.float32)
    forced = (cold + rng.standard_normal((ROWS, VOCAB)) * noise).astype(np.float32)
    if diverge_at is not None:
        handoff[diverge_at:, 7] = cold[diverge_at:].max(axis=1) + 1.0
    cold_tokens = cold.argmax(axis=1).astype(np.int64)
    handoff_tokens = handoff.argmax(axis=1).astype(np.int64)
    keys = [rng.standard_normal((2, 30, 8)).astype(np.float32) for _ in range(6)]
    own = [k + (rng.standard_normal(k.shape) * 1e-3).astype(np.float32) for k in keys]
    own = [np.concatenate([o, np.ones((2, 4, 8), np.float32)], axis=1) for o in own]  # own prefill is longer
    return cold, handoff, forced, cold_tokens, handoff_tokens, keys, own


def _both(data, transform: str = "raw", *, teacher: bool = False, bounds=(0.03, 0.00082)):
    import torch

    from qualify.evidence.compare_device import DeviceBranch, compare_branches_device

    cold, handoff, forced, cold_tokens, handoff_tokens, keys, own = data
    expected = compare_branches(
        DecodeResult(handoff_tokens, handoff), DecodeResult(cold_tokens, cold), transform,
        maximum_absolute=bounds[0], maximum_mean_absolute=bounds[1],
        teacher_forced_logits=forced if teacher else None,
        handoff_kv=(keys[:3], keys[3:]), own_kv=(own[:3], own[3:]))
    t = torch.from_numpy
    found = compare_branches_device(
        DeviceBranch(t(handoff_tokens), t(handoff)), DeviceBranch(t(cold_tokens), t(cold)), transform,
        maximum_absolute=bounds[0], maximum_mean_absolute=bounds[1],
        teacher_forced_logits=t(forced) if teacher else None,
        handoff_kv=([t(k) for k in keys[:3]], [t(k) for k in keys[3:]]),
        own_kv=([t(o) for o in own[:3]], [t(o) for o in own[3:]]))
    return expected, found


def assert_same(expected: BranchComparison, found: BranchComparison, *, ulps: float = 0.0) -> None:
    """Every field equal; means to MEAN_RTOL; with ``ulps`` > 0 (a soft cap, whose tanh differs
    between numpy and torch in the last bit), maxima, margins and means also to that absolute
    tolerance (no element of a capped block moves by more than it)."""
    assert isinstance(found, BranchComparison)
    for field in dataclasses.fields(BranchComparison):
        left, right = getattr(expected, field.name), getattr(found, field.name)
        if field.name == "delta":
            _same_delta(left, right, ulps)
        elif field.name == "teacher_forced":
            assert (left is None) == (right is None)
            if left is not None:
                assert left.top1_flips == right.top1_flips and left.first_row_over_rule == right.first_row_over_rule
                _same_numbers(left.max_abs, right.max_abs, ulps)
                assert math.isclose(left.mean_abs, right.mean_abs, rel_tol=MEAN_RTOL, abs_tol=ulps)
                np.testing.assert_allclose(right.row_max_abs, left.row_max_abs, rtol=0, atol=ulps)
                np.testing.assert_allclose(right.row_mean_abs, left.row_mean_abs, rtol=MEAN_RTOL, atol=ulps)
        elif field.name == "cold_margins":
            np.testing.assert_allclose(right, left, rtol=0, atol=ulps)
        elif field.name in ("handoff_tokens", "cold_tokens"):
            assert right.dtype == left.dtype == np.int64 and np.array_equal(left, right), field.name
        elif field.name in ("cold_margin_at_divergence", "drift_at_divergence"):
            assert (left is None) == (right is None)
            if left is not None:
                _same_numbers(left, right, ulps)
        elif field.name == "kv":
            assert (left is None) == (right is None)
            if left is not None:
                assert left.layers == right.layers
                assert np.array_equal(left.position_max_abs, right.position_max_abs)
        else:
            assert left == right, field.name


def _same_numbers(left: float, right: float, ulps: float) -> None:
    assert left == right if ulps == 0 else abs(left - right) <= ulps


def _same_delta(left, right, ulps: float) -> None:
    _same_numbers(left.max_abs, right.max_abs, ulps)
    assert math.isclose(left.mean_abs, right.mean_abs, rel_tol=MEAN_RTOL, abs_tol=ulps)
    np.testing.assert_allclose(right.row_max_abs, left.row_max_abs, rtol=0, atol=ulps)
    np.testing.assert_allclose(right.row_mean_abs, left.row_mean_abs, rtol=MEAN_RTOL, atol=ulps)
    assert left.first_row_over_rule == right.first_row_over_rule


# ---- equivalence with compare.py -----------------------------------------------------------------


def test_agreeing_branches_give_compare_py_result() -> None:
    expected, found = _both(_data())
    assert expected.token_agreement_rate == 1.0 and expected.first_logit_digest_mismatch == 0
    assert expected.delta.first_row_over_rule is not None  # some row's mean is above 0.00082
    assert_same(expected, found)


def test_diverging_branch_with_teacher_forcing_gives_compare_py_result() -> None:
    expected, found = _both(_data(seed=1, diverge_at=20), teacher=True)
    assert expected.first_divergence == 20 and expected.teacher_forced is not None
    assert expected.divergence_class == "decisive"  # the new top-1 is far above drift
    assert_same(expected, found)


def test_near_tie_divergence_is_classified_the_same() -> None:
    data = list(_data(seed=2))
    cold, handoff = data[0], data[1]
    row = 11
    top = int(cold[row].argmax())
    cold[row, (top + 1) % VOCAB] = cold[row, top] - 0.005  # a near-tie in the cold run
    handoff[row, (top + 1) % VOCAB] = cold[row, top] + 0.004  # the handoff flips it
    data[3], data[4] = cold.argmax(axis=1).astype(np.int64), handoff.argmax(axis=1).astype(np.int64)
    expected, found = _both(tuple(data), teacher=True)
    assert expected.first_divergence == row and expected.divergence_class == "near-tie"
    assert_same(expected, found)


def test_soft_cap_units_agree_to_float32_rounding() -> None:
    expected, found = _both(_data(seed=3), "tanh-softcap:30.0", teacher=True)
    assert found.transform == "tanh-softcap:30.0"
    assert_same(expected, found, ulps=4e-6)  # two float32 ulps at the cap, 30


def test_a_nan_row_fails_closed_like_compare_py() -> None:
    data = list(_data(seed=4))
    data[1] = data[1].copy()
    data[1][5, 3] = np.nan
    expected, found = _both(tuple(data))
    assert math.isnan(found.max_abs) and math.isnan(found.mean_abs)
    assert math.isnan(found.delta.row_max_abs[5]) and found.delta.first_row_over_rule <= 5
    assert expected.delta.first_row_over_rule == found.delta.first_row_over_rule


def test_digests_are_compare_py_digests_and_survive_buffer_reuse() -> None:
    """The digester copies before it hashes: overwriting the source right after submitting
    does not change the digests, and reused host buffers give fresh, correct digests."""
    import torch

    from qualify.evidence.compare_device import LogitDigester

    cold = _data()[0]
    source = torch.from_numpy(cold.copy())
    with LogitDigester(threads=3) as digester:
        job = digester.submit(source)
        source.zero_()
        assert job.result() == logit_digests(cold)
        second = digester.submit(source)
        assert second.result() == logit_digests(np.zeros_like(cold))
        assert digester.hashed_bytes == 4 * cold.nbytes  # each block: one block pass, one row pass


def test_a_prepared_cold_reference_serves_several_samples() -> None:
    import torch

    from qualify.evidence.compare_device import DeviceBranch, LogitDigester, prepare_cold, start_comparison

    cold, handoff, _, cold_tokens, handoff_tokens, _, _ = _data(seed=5)
    t = torch.from_numpy
    with LogitDigester() as digester:
        reference = prepare_cold(DeviceBranch(t(cold_tokens), t(cold)), "raw", digester)
        results = []
        for _ in range(2):
            pending = start_comparison(DeviceBranch(t(handoff_tokens), t(handoff)), reference, "raw",
                                       maximum_absolute=1.0, maximum_mean_absolute=1.0, digester=digester)
            assert pending.timings["logit_pass_bytes"] == 2 * handoff.nbytes
            results.append(pending.result())
    expected = compare_branches(DecodeResult(handoff_tokens, handoff), DecodeResult(cold_tokens, cold), "raw",
                                maximum_absolute=1.0, maximum_mean_absolute=1.0)
    for found in results:
        assert_same(expected, found)


def test_refusals_name_the_field() -> None:
    import torch

    from qualify.evidence.compare_device import DeviceBranch, LogitDigester, compare_branches_device, compare_kv_device

    cold, handoff, _, cold_tokens, handoff_tokens, keys, own = _data()
    t = torch.from_numpy
    good = DeviceBranch(t(cold_tokens), t(cold))
    cases = [
        (lambda: compare_branches_device(DeviceBranch(t(handoff_tokens), t(handoff).double()), good, "raw",
                                         maximum_absolute=1, maximum_mean_absolute=1), "handoff logits"),
        (lambda: compare_branches_device(DeviceBranch(t(handoff_tokens), t(handoff[:, :-1].copy())), good, "raw",
                                         maximum_absolute=1, maximum_mean_absolute=1), "shapes differ"),
        (lambda: compare_branches_device(DeviceBranch(t(handoff_tokens[:-1].copy()), t(handoff)), good, "raw",
                                         maximum_absolute=1, maximum_mean_absolute=1), "decode result"),
        (lambda: compare_branches_device(DeviceBranch(t(handoff_tokens).float(), t(handoff)), good, "raw",
                                         maximum_absolute=1, maximum_mean_absolute=1), "handoff tokens"),
        (lambda: compare_branches_device(DeviceBranch(t(handoff_tokens), t(handoff)), good, "softcap",
                                         maximum_absolute=1, maximum_mean_absolute=1), "logit transform"),
        (lambda: compare_kv_device([t(keys[0])], [], [t(own[0])], [t(own[1])]), "layer counts"),
        (lambda: compare_kv_device([t(keys[0])], [t(keys[1])], [t(own[0][:, :5])], [t(own[1])]), "does not fit"),
        (lambda: LogitDigester(threads=1), "threads"),
    ]
    for call, words in cases:
        with pytest.raises(Refused, match=words) as refusal:
            call()
        assert "\n" not in str(refusal.value)


# ---- CUDA ---------------------------------------------------------------------------------------



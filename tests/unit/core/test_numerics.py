"""qualify.core.numerics: the machine-independent arithmetic is accurate, exact where it claims to be,
and row-independent."""

from __future__ import annotations

import numpy as np
import pytest

from qualify.core import numerics
from qualify.core.numerics import (
    FixedPointRows,
    cos_sin,
    exp,
    matmul_rows,
    power,
    tree_sum,
    weighted_sum,
    whole_rows_are_exact,
)


def ulps(found: np.ndarray, exact: np.ndarray) -> np.ndarray:
    return np.abs(found.astype(np.float64) - exact) / np.spacing(np.abs(found)).astype(np.float64)


def test_exp_is_within_1_3_ulp_and_handles_the_ends() -> None:
    x = np.random.default_rng(0).uniform(-87, 88, 200_000).astype(np.float32)
    assert ulps(exp(x), np.exp(x.astype(np.float64))).max() <= 1.3
    assert exp(np.array([-np.inf, 0.0, np.inf, -200.0], np.float32)).tolist() == [0.0, 1.0, np.inf, 0.0]


def test_cos_sin_match_float64_to_float32_rounding() -> None:
    angles = (np.arange(4096, dtype=np.float32)[:, None] * np.float32(0.37)).ravel()
    cos, sin = cos_sin(angles)
    assert ulps(cos, np.cos(angles.astype(np.float64))).max() <= 1.0
    assert ulps(sin, np.sin(angles.astype(np.float64))).max() <= 1.0


def test_tree_sum_adds_in_a_fixed_pairwise_order() -> None:
    x = np.array([[1e8, 1.0, -1e8, 1.0, 3.0]], dtype=np.float32)
    # ((1e8 + -1e8) + (1 + 1)) + 3 in float32, not left to right (which loses the first 1).
    assert tree_sum(x)[0, 0] == np.float32(5.0)
    assert tree_sum(x).shape == (1, 1)


def test_matmul_rows_is_float32_accurate_and_row_independent() -> None:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((64, 700)).astype(np.float32)  # three reduction chunks
    w = rng.standard_normal((48, 700)).astype(np.float32)
    exact = a.astype(np.float64) @ w.astype(np.float64).T
    found = matmul_rows(a, FixedPointRows.of(w))
    scale = np.abs(a).max(axis=1, keepdims=True) * np.abs(w).max(axis=1)[None, :]
    assert (np.abs(found - exact) <= 700 * 2.0**-20 * scale).all()
    one_row = matmul_rows(a[5:6], FixedPointRows.of(w))
    assert np.array_equal(one_row[0], found[5])


def test_integer_images_stay_inside_their_bits() -> None:
    values = np.random.default_rng(2).standard_normal((8, 300)).astype(np.float32) * 1e3
    rows = FixedPointRows.of(values, bits=21)
    assert np.abs(rows.integers).max() <= 2**21
    assert np.array_equal(rows.integers, np.rint(rows.integers))
    assert np.abs(rows.integers * rows.scale - values).max() <= rows.scale.max()


def test_weighted_sum_matches_probabilities_times_values() -> None:
    rng = np.random.default_rng(3)
    probs = rng.dirichlet(np.ones(600), size=(2, 4)).astype(np.float32)  # [2, 4, 600]
    values = rng.standard_normal((2, 600, 32)).astype(np.float32)
    exact = probs.astype(np.float64) @ values.astype(np.float64)
    found = weighted_sum(probs, FixedPointRows.of(values))
    assert np.abs(found - exact).max() <= 1e-5


@pytest.mark.parametrize("shift", [0.0, 0.002], ids=["probabilities", "signed weights"])
def test_weighted_sum_is_the_documented_conversion_whatever_the_weights_signs(shift: float) -> None:
    """Each value row's scale folded into the weights, the folded rows converted to 23-bit
    integers by their largest magnitude (a negative one where it is larger), one exact product,
    rounded once: the same bits for probabilities and for weights of either sign."""
    rng = np.random.default_rng(5)
    weights = (rng.dirichlet(np.ones(300), size=(2, 3)) - shift).astype(np.float32)  # [2, 3, 300]
    weights[1, 2, 7] = np.float32(-0.5) if shift else weights[1, 2, 7]  # the row's largest is negative
    values = FixedPointRows.of(rng.standard_normal((2, 300, 16)).astype(np.float32))
    folded = weights.astype(np.float64) * np.swapaxes(values.scale, -1, -2)
    largest = np.abs(folded).max(axis=-1, keepdims=True)
    scale = np.ldexp(1.0, np.frexp(largest)[1] - 23)
    integers = np.rint(folded / scale)
    assert np.abs(integers).max() <= 2**23
    expected = ((integers @ values.integers) * scale).astype(np.float32)
    assert np.array_equal(weighted_sum(weights, values).view(np.uint32), expected.view(np.uint32))


def test_whole_rows_are_exact_up_to_the_last_row_sum_below_2_to_the_53() -> None:
    # A row's absolute sum times the right operand's largest integer (2^21) bounds every partial sum.
    limit = 2.0 ** (53 - 21)
    below = np.zeros((2, 600))
    below[:, :2] = [limit / 2, limit / 2 - 1]  # absolute sum limit - 1
    assert whole_rows_are_exact(below)
    at_limit = below.copy()
    at_limit[1, 2] = -1.0  # the second row's absolute sum reaches the limit (signs do not cancel)
    assert not whole_rows_are_exact(at_limit)
    # Rows of largest-magnitude integers: 511 fit below 2^53, 512 reach it.
    assert whole_rows_are_exact(np.full((1, 511), -2.0**23))
    assert not whole_rows_are_exact(np.full((1, 512), -2.0**23))


@pytest.mark.parametrize("left_scale", [1.0, 2.0**23], ids=["small rows", "rows too large for one product"])
def test_one_product_gives_the_chunked_sums_bits(monkeypatch: pytest.MonkeyPatch, left_scale: float) -> None:
    """matmul_rows and weighted_sum give the same bits whether a call is one product over the whole
    reduction or the REDUCTION_CHUNK-long exact sums added left to right."""
    rng = np.random.default_rng(4)
    a = rng.standard_normal((16, 1536)).astype(np.float32)
    a[:, 7] *= 50.0  # an outlier feature, as real residual streams have
    if left_scale > 1.0:
        a = np.sign(a) * np.float32(1.0)  # every entry at the row's largest magnitude
    w = FixedPointRows.of(rng.standard_normal((96, 1536)).astype(np.float32))
    probs = rng.dirichlet(np.ones(1536), size=(3, 4)).astype(np.float32)
    values = FixedPointRows.of(rng.standard_normal((3, 1536, 64)).astype(np.float32))
    left_rows = FixedPointRows.of(a, 23).integers
    assert whole_rows_are_exact(left_rows) == (left_scale == 1.0)
    fast = matmul_rows(a, w), weighted_sum(probs, values)
    monkeypatch.setattr(numerics, "whole_rows_are_exact", lambda *args, **kwargs: False)
    chunked = matmul_rows(a, w), weighted_sum(probs, values)
    for found, expected in zip(fast, chunked, strict=True):
        assert np.array_equal(found.view(np.uint32), expected.view(np.uint32))


def test_power_is_exact_where_the_power_is_representable_and_keeps_shapes() -> None:
    exponents = np.array([[0.0, 0.25], [0.5, 0.75]], dtype=np.float32)
    assert power(10000.0, exponents).tolist() == [[1.0, 10.0], [100.0, 1000.0]]
    assert power(4.0, np.array([0.5, -0.5], dtype=np.float32)).dtype == np.float32
    assert power(4.0, np.array([0.5, -0.5], dtype=np.float32)).tolist() == [2.0, 0.5]

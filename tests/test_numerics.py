"""qualify.core.numerics: the machine-independent arithmetic is accurate, exact where it claims to be,
and row-independent."""

from __future__ import annotations

import numpy as np

from qualify.core.numerics import FixedPointRows, cos_sin, exp, matmul_rows, tree_sum, weighted_sum


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

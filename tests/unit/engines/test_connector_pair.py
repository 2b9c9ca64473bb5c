"""The connector pair's comparisons (pure numpy; the engine runs are in tests/vllm/test_connector_lane.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qualify.engines.connector_pair import (
    compare_kv_cells,
    digest_mismatches,
    first_token_divergence,
    localise,
)

BLOCK = 4


def _kv(seed: int, layers: int = 2, heads: int = 2, positions: int = 12, dim: int = 3) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {layer: (rng.standard_normal((heads, positions, dim)).astype(np.float32),
                    rng.standard_normal((heads, positions, dim)).astype(np.float32)) for layer in range(layers)}


def _copy(kv: dict[int, tuple[np.ndarray, np.ndarray]]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    return {layer: (k.copy(), v.copy()) for layer, (k, v) in kv.items()}


def test_equal_kv_has_no_differing_cell():
    kv = _kv(0)
    assert compare_kv_cells(kv, _copy(kv), 12, BLOCK) == []
    assert localise([]) is None


def test_each_changed_element_is_named_by_its_cell_position_and_dim():
    cold = _kv(1)
    loaded = _copy(cold)
    loaded[1][1][0, 6, 2] += np.float32(0.25)  # layer 1, V, head 0, position 6 (block 1), dim 2
    loaded[0][0][1, 11, 0] = np.nan  # layer 0, K, head 1, position 11 (block 2)
    cells = compare_kv_cells(loaded, cold, 12, BLOCK)
    assert [(c.layer, c.tensor, c.head, c.block, c.first_position, c.first_dim, c.differing) for c in cells] == [
        (0, "K", 1, 2, 11, 0, 1), (1, "V", 0, 1, 6, 2, 1)]
    assert cells[0].max_abs == float("inf") and cells[0].as_dict()["max_abs"] is None
    assert cells[1].max_abs == pytest.approx(0.25, rel=1e-6)
    json.dumps([c.as_dict() for c in cells], allow_nan=False)  # JSON without NaN or infinity
    summary = localise(cells)
    assert summary is not None
    assert (summary["layers"], summary["tensors"], summary["heads"], summary["blocks"]) == ([0, 1], ["K", "V"], [0, 1], [1, 2])
    assert summary["first"]["layer"] == 0 and summary["worst"]["layer"] == 0


def test_only_the_compared_positions_count():
    cold = _kv(2)
    loaded = _copy(cold)
    loaded[0][0][0, 10, 0] += 1  # beyond the 8 loaded positions
    assert compare_kv_cells(loaded, cold, 8, BLOCK) == []
    assert len(compare_kv_cells(loaded, cold, 12, BLOCK)) == 1


def test_a_sign_of_zero_is_a_difference_in_bits():
    cold = _kv(3)
    cold[0][0][0, 0, 0] = 0.0
    loaded = _copy(cold)
    loaded[0][0][0, 0, 0] = -0.0
    (cell,) = compare_kv_cells(loaded, cold, 12, BLOCK)
    assert cell.max_abs == 0.0 and cell.differing == 1


def test_mismatched_layers_or_shapes_are_errors():
    with pytest.raises(ValueError, match="layers"):
        compare_kv_cells(_kv(4, layers=2), _kv(4, layers=3), 12, BLOCK)
    with pytest.raises(ValueError, match="shapes"):
        compare_kv_cells(_kv(4, positions=8), _kv(4, positions=12), 12, BLOCK)


def test_digest_mismatches_name_cells_in_order_and_count_unsaved_cells():
    saved = {"0/K/0/0": "a", "0/K/0/1": "b", "1/V/3/10": "c"}
    loaded = {"1/V/3/10": "x", "0/K/0/1": "b", "0/K/0/0": "a", "0/K/0/2": "d", "0/K/0/9": "a"}
    assert digest_mismatches(loaded, saved) == ["0/K/0/2", "0/K/0/9", "1/V/3/10"]


def test_first_token_divergence():
    assert first_token_divergence(np.array([1, 2, 3]), np.array([1, 2, 3])) is None
    assert first_token_divergence(np.array([1, 5, 3]), np.array([1, 2, 3])) == 1
    assert first_token_divergence(np.array([1, 2]), np.array([1, 2, 3])) == 2

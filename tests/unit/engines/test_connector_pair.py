"""The connector pair's comparisons and the prefill/decode handshake's parameters (pure; the engine runs
are in tests/vllm/test_connector_lane.py and tests/vllm/test_connector_nixl.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qualify.core.errors import Refused
from qualify.engines.connector_pair import (
    MAX_TRANSFER_PARAMS_CHARS,
    PREFILL_TRANSFER_PARAMS,
    compare_kv_cells,
    digest_mismatches,
    first_token_divergence,
    localise,
    request_transfer_params,
    returned_transfer_params,
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


# -- the prefill/decode handshake ----------------------------------------------------------------


NIXL_RETURNED = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": ([3, 4, 5],),
                 "remote_engine_id": "e-1", "remote_request_id": "r-1", "remote_host": "localhost",
                 "remote_port": 5601, "tp_size": 1, "remote_num_tokens": 2048}
TAG = {"qualify_connector": {"key": "sample-1", "cold": False, "capture": False, "fault": None}}


def test_the_producer_asks_for_a_remote_decode_as_a_proxy_does():
    assert PREFILL_TRANSFER_PARAMS["do_remote_decode"] is True
    assert PREFILL_TRANSFER_PARAMS["do_remote_prefill"] is False
    params = request_transfer_params(PREFILL_TRANSFER_PARAMS, TAG)
    assert params == {**PREFILL_TRANSFER_PARAMS, **TAG}
    params["do_remote_decode"] = False  # the engine may rewrite its request's copy
    assert PREFILL_TRANSFER_PARAMS["do_remote_decode"] is True


def test_what_the_producer_returned_goes_with_the_consumers_request_under_its_tag():
    returned = returned_transfer_params(NIXL_RETURNED)
    assert returned is not None and returned["remote_block_ids"] == [[3, 4, 5]]  # as JSON carries it
    assert json.loads(json.dumps(returned)) == returned
    params = request_transfer_params(returned, TAG)
    assert {key: params[key] for key in returned} == returned and params["qualify_connector"] == TAG["qualify_connector"]
    # A returned key named like the tag never replaces the harness's own.
    assert request_transfer_params({"qualify_connector": "forged"}, TAG) == TAG


def test_a_connector_that_returns_nothing_sends_the_consumer_only_its_tag():
    assert returned_transfer_params(None) is None
    assert returned_transfer_params({}) is None
    assert request_transfer_params(None, TAG) == TAG


@pytest.mark.parametrize("returned", [["do_remote_prefill"], {"remote_port": float("nan")}, {"blob": object()},
                                      {"blob": "x" * MAX_TRANSFER_PARAMS_CHARS}],
                         ids=["not-an-object", "not-finite", "not-json", "too-long"])
def test_returned_params_no_proxy_could_forward_are_refused_in_one_line(returned):
    with pytest.raises(Refused) as refused:
        returned_transfer_params(returned)
    assert "\n" not in str(refused.value)

"""The shipped transformers CUDA lanes qualify on a GPU, and a block-order fault in the bf16 lane is caught and localised."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qualify.archive.verify import verify_receipt
from qualify.contract.identity import load_identity
from tests.torch.test_transformers_lanes import LANES, identity_path, only_receipt, qualify_cli


@pytest.mark.slow
@pytest.mark.parametrize("lane", LANES)
def test_shipped_cuda_identity_qualifies_on_a_gpu(lane: str, tmp_path: Path) -> None:
    completed = qualify_cli(tmp_path, "--identity", str(identity_path(lane)))
    assert completed.returncode == 0, completed.stdout[-3000:]
    receipt = only_receipt(tmp_path)
    samples = [json.loads(path.read_text()) for path in sorted((receipt / "samples").glob("*.json"))]
    assert len(samples) == 3 and all(sample["token_agreement_rate"] == 1.0 for sample in samples)
    bounds = load_identity(identity_path(lane)).onboarding_qualification.full_logits
    assert all(0 < sample["max_abs"] <= bounds.maximum_absolute for sample in samples)
    assert verify_receipt(receipt) == []


@pytest.mark.slow
def test_block_order_fault_in_the_bf16_lane_is_caught_and_localised(tmp_path: Path) -> None:
    from qualify.engines.faults import BLOCK_POSITIONS, SWAPPED_BLOCKS

    completed = qualify_cli(tmp_path, "--identity", str(identity_path("transformers-cuda-bf16")),
                            "--fault", "block-order")
    assert completed.returncode == 1, completed.stdout[-3000:]
    sample = json.loads((only_receipt(tmp_path) / "samples" / "sample-1.json").read_text())
    over = sample["localisation"]["kv_over_envelope"]
    assert over, sample["localisation"]
    low, high = SWAPPED_BLOCKS[0] * BLOCK_POSITIONS, (SWAPPED_BLOCKS[1] + 1) * BLOCK_POSITIONS
    assert all(item["tensor"] == "K" and low <= item["position"] < high for item in over), over

"""bench/gpu_scale.py's faults (on torch tensors) touch only their site."""

from __future__ import annotations

import pytest

from tests.unit.run.test_orchestrator import _gpu_scale


def test_the_scale_benchs_faults_touch_only_their_site() -> None:
    torch = pytest.importorskip("torch")
    from qualify.engines.faults import BLOCK_POSITIONS, SWAPPED_BLOCKS

    bench = _gpu_scale()
    generator = torch.Generator().manual_seed(1)
    keys = [torch.randn(2, 700, 8, generator=generator).to(torch.bfloat16) for _ in range(4)]
    values = [torch.randn(2, 700, 8, generator=generator).to(torch.bfloat16) for _ in range(4)]
    moved, same_values, where = bench.apply_fault("kv-ulp", keys, values)
    changed = [(layer, index) for layer in range(4)
               for index in torch.nonzero(moved[layer] != keys[layer]).tolist()]
    layer, head, position, dim = bench.fault_site(4, 700)
    assert changed == [(layer, [head, position, dim])] and same_values is values and "one ULP" in where
    swapped, _, _ = bench.apply_fault("block-order", keys, values)
    first, second = (block * BLOCK_POSITIONS for block in SWAPPED_BLOCKS)
    for original, result in zip(keys, swapped, strict=True):
        assert torch.equal(result[:, first:first + BLOCK_POSITIONS], original[:, second:second + BLOCK_POSITIONS])
        assert torch.equal(result[:, :first], original[:, :first])
    with pytest.raises(bench.Refused, match="--fault"):
        bench.apply_fault("v-scale", keys, values)

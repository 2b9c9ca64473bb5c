"""On an NVIDIA GPU the device comparison gives compare.py's result."""

from __future__ import annotations

import numpy as np
import pytest

from qualify.engines.base import DecodeResult
from qualify.evidence.compare import compare_branches
from tests.torch.test_compare_device import _data, assert_same

pytestmark = pytest.mark.usefixtures("one_torch_thread")



def test_on_the_gpu_the_comparison_is_compare_py_result() -> None:
    import torch

    from qualify.evidence.compare_device import DeviceBranch, compare_branches_device

    cold, handoff, forced, cold_tokens, handoff_tokens, keys, own = _data(seed=6, diverge_at=30)
    expected = compare_branches(DecodeResult(handoff_tokens, handoff), DecodeResult(cold_tokens, cold), "raw",
                                maximum_absolute=0.03, maximum_mean_absolute=0.01, teacher_forced_logits=forced,
                                handoff_kv=(keys[:3], keys[3:]), own_kv=(own[:3], own[3:]))

    def cuda(array: np.ndarray):
        return torch.from_numpy(array).cuda()

    found = compare_branches_device(
        DeviceBranch(cuda(handoff_tokens), cuda(handoff)), DeviceBranch(cuda(cold_tokens), cuda(cold)), "raw",
        maximum_absolute=0.03, maximum_mean_absolute=0.01, teacher_forced_logits=cuda(forced),
        handoff_kv=([cuda(k) for k in keys[:3]], [cuda(k) for k in keys[3:]]),
        own_kv=([cuda(o) for o in own[:3]], [cuda(o) for o in own[3:]]))
    assert_same(expected, found)

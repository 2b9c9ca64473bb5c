"""The handoff wire against torch's own safetensors writer: a bfloat16 payload is byte for byte what ``safetensors.torch`` saves."""

from __future__ import annotations

import numpy as np

from tests.unit.handoff.test_handoff_wire import bf16_kv, seal


def test_bfloat16_payload_is_exactly_safetensors_torch_save() -> None:
    import torch
    from safetensors.torch import save

    kv = bf16_kv(seed=22)
    tensors = {name: torch.from_numpy(array.view(np.uint16).copy()).view(torch.bfloat16)
               for name, array in kv.tensors().items()}
    assert bytes(seal(kv).payload_bytes) == save(tensors)

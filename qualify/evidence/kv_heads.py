"""KV localised to a KV head: per (layer, K/V, KV head) max abs deltas of a handed-off KV against
the consumer's own prefill, and the first head over an envelope.

:func:`qualify.evidence.compare.compare_kv` localises a KV difference to a layer and a position
(per layer K and V maxima, a per-position profile); a fault that moves whole heads, such as a
tensor-parallel gather putting a rank's heads in the wrong place, needs the head too. This works
on the device, on whole ``[layers, 2, kv_heads, positions, head_dim]`` tensors, and leaves only
``layers * 2 * kv_heads`` numbers (and one position) to bring to the host.
"""

from __future__ import annotations

import numpy as np
import torch

from qualify.core.errors import Refused
from qualify.engines.torch_llama_tp import KV_KINDS, KVHeadSite


def kv_head_deltas(handoff: torch.Tensor, own: torch.Tensor) -> np.ndarray:
    """Max abs delta per (layer, K/V, KV head) of ``handoff`` against ``own``, both
    ``[layers, 2, kv_heads, positions, head_dim]``: float64 ``[layers, 2, kv_heads]`` (NaN where a
    head holds a NaN)."""
    if handoff.shape != own.shape or handoff.ndim != 5 or handoff.shape[1] != 2:
        raise Refused(f"kv heads: handed-off {list(handoff.shape)} and own {list(own.shape)}: expected "
                      "equal shapes [layers, 2, kv_heads, positions, head_dim]")
    delta = (handoff.float() - own.float()).abs()  # NaN stays NaN
    return delta.amax(dim=(3, 4)).double().cpu().numpy()


def first_head_over(handoff: torch.Tensor, own: torch.Tensor, envelope: np.ndarray | float) -> KVHeadSite | None:
    """The first (layer, K/V, KV head), in that order, whose max abs delta exceeds ``envelope``
    (a number, or one per site ``[layers, 2, kv_heads]``; NaN counts as over), with the first
    position over it there; None when every head is within."""
    deltas = kv_head_deltas(handoff, own)
    over = np.argwhere(~(deltas <= envelope))  # row-major: layer, then K/V, then head
    if over.shape[0] == 0:
        return None
    layer, kind, head = (int(value) for value in over[0])
    limit = float(envelope if np.ndim(envelope) == 0 else np.asarray(envelope)[layer, kind, head])
    per_position = (handoff[layer, kind, head].float() - own[layer, kind, head].float()).abs().amax(dim=-1)
    positions = torch.nonzero(~(per_position <= limit))
    return KVHeadSite(layer, KV_KINDS[kind], head, int(positions[0, 0]), float(deltas[layer, kind, head]))

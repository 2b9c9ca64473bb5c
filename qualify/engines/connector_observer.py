"""The observing wrapper: what a KV connector under test saved and loaded, per layer, per block.

vLLM loads :class:`ObservingConnector` with ``kv_connector="ObservingConnector"``,
``kv_connector_module_path="qualify.engines.connector_observer"`` and
``kv_connector_extra_config={"connector_under_test": ConnectorSpec.as_dict()}``; it delegates every
call to the connector under test (:mod:`qualify.engines.connector_delegate`) and, for requests the
harness tags (``RequestTag``), records in this process (:data:`OBSERVATIONS`, keyed by the tag's key):

* saved: when ``save_kv_layer`` hands a layer to the connector, the request's prompt KV in that
  layer's pages, decoded with the CPU page layout into canonical ``[kv_heads, positions, head_dim]``
  K (post-RoPE) and V, digested per (layer, K or V, KV head, block); the arrays are kept when the tag
  asks to ``capture`` them (the cold recompute's own prefill KV);
* loaded: once the connector's load is complete (after its ``wait_for_layer_load`` for a
  synchronous load; for an asynchronous one, once it reported the request received, before the
  forward: :mod:`qualify.engines.connector_loads`), the positions it claimed to load, read back
  from the request's blocks the same way, digested and kept, so the harness compares them with the
  consumer's own cold prefill block by block;
* cold: for a tag with ``cold``, the connector's hit is recorded and vLLM is told 0 matched tokens,
  so the request is a local recompute on the same engine; the connector sees a request it was not
  chosen to load (as MultiConnector's unchosen children do).

Nothing the connector under test receives or returns is changed otherwise. The records are
read by :func:`take_observation` after the request finished (vLLM in-process).

Imports: ``qualify.core``, ``qualify.engines`` and vLLM.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from qualify.engines.connector_delegate import (
    DelegatingConnector,
    RequestTag,
    ScheduledRequest,
    WrapperRefused,
)
from qualify.engines.vllm_connector import decode_blocks

if TYPE_CHECKING:
    from vllm.v1.request import Request

TENSORS = ("K", "V")

CellKey = tuple[int, str, int, int]
"""(layer, "K" or "V", KV head, block index within the request)."""


def block_digests(layer: int, keys: np.ndarray, values: np.ndarray, block_size: int) -> dict[CellKey, str]:
    """SHA-256 of each (layer, tensor, KV head, block) cell of canonical K and V
    ``[kv_heads, positions, head_dim]`` (float32 little-endian bytes; a last partial block covers
    the positions it holds)."""
    digests: dict[CellKey, str] = {}
    for tensor, array in zip(TENSORS, (keys, values), strict=True):
        data = np.ascontiguousarray(array, dtype="<f4")
        for head in range(data.shape[0]):
            for block, start in enumerate(range(0, data.shape[1], block_size)):
                digests[(layer, tensor, head, block)] = hashlib.sha256(
                    data[head, start:start + block_size].tobytes()).hexdigest()
    return digests


@dataclass
class Observation:
    """What the wrapper saw of one tagged request (arrays are canonical float32 copies)."""

    key: str
    claimed_tokens: int = 0
    """Tokens the connector claimed to load (0 for a cold or missed request)."""
    suppressed_hit: int | None = None
    """For a cold request: the hit the connector reported and the wrapper suppressed."""
    saved_tokens: int = 0
    saved_digests: dict[CellKey, str] = field(default_factory=dict)
    saved: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    """Layer -> (K, V) of the prompt as handed to ``save_kv_layer`` (kept when the tag captures)."""
    loaded_digests: dict[CellKey, str] = field(default_factory=dict)
    loaded: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    """Layer -> (K, V) of the loaded positions, read after the connector's load completed."""


_LOCK = threading.Lock()
OBSERVATIONS: dict[str, Observation] = {}
"""Tag key -> observation, shared by the scheduler-side and worker-side wrappers of this process."""


def _observation(key: str) -> Observation:
    with _LOCK:
        return OBSERVATIONS.setdefault(key, Observation(key))


def take_observation(key: str) -> Observation:
    """Remove and return the observation of the request tagged ``key`` (empty if it was never seen)."""
    with _LOCK:
        return OBSERVATIONS.pop(key, Observation(key))


class ObservingConnector(DelegatingConnector):
    """Delegates to the connector under test and records what it saved and loaded."""

    def scheduler_hit(self, request: Request, tag: RequestTag, matched: int | None, load_async: bool) -> int | None:
        if not tag.cold:
            return matched
        _observation(tag.key).suppressed_hit = matched
        return 0

    def _read(self, kv_layer: torch.Tensor, request: ScheduledRequest, positions: int) -> tuple[np.ndarray, np.ndarray]:
        count = -(-positions // self.block_size)
        if count > len(request.block_ids):
            raise WrapperRefused(f"request {request.tag.key}: {positions} positions need {count} blocks, "
                                 f"it holds {len(request.block_ids)}")
        keys, values = decode_blocks(kv_layer, list(request.block_ids[:count]), self.head_dim)
        return keys[:, :positions].copy(), values[:, :positions].copy()

    def after_layer_load(self, layer_name: str, layer: int, kv_layer: torch.Tensor,
                         requests: list[ScheduledRequest]) -> None:
        for request in requests:
            keys, values = self._read(kv_layer, request, request.loaded_tokens)
            digests = block_digests(layer, keys, values, self.block_size)
            with _LOCK:
                observed = OBSERVATIONS.setdefault(request.tag.key, Observation(request.tag.key))
                observed.claimed_tokens = request.loaded_tokens
                observed.loaded[layer] = (keys, values)
                observed.loaded_digests.update(digests)

    def before_layer_save(self, layer_name: str, layer: int, kv_layer: torch.Tensor,
                          requests: list[ScheduledRequest]) -> torch.Tensor:
        for request in requests:
            if request.computed_tokens + request.scheduled_tokens < request.prompt_tokens:
                raise WrapperRefused(f"request {request.tag.key}: the prompt's prefill was split "
                                     f"({request.scheduled_tokens} of {request.prompt_tokens} tokens scheduled); "
                                     f"raise max_num_batched_tokens")
            keys, values = self._read(kv_layer, request, request.prompt_tokens)
            digests = block_digests(layer, keys, values, self.block_size)
            with _LOCK:
                observed = OBSERVATIONS.setdefault(request.tag.key, Observation(request.tag.key))
                observed.saved_tokens = request.prompt_tokens
                observed.saved_digests.update(digests)
                if request.tag.capture:
                    observed.saved[layer] = (keys, values)
        return kv_layer

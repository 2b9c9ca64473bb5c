"""A fault-injecting KV connector: the connector under test, with one way of corrupting what it loads.

:class:`FaultInjectingConnector` is itself a connector under test: vLLM loads it with
``kv_connector="FaultInjectingConnector"``, ``kv_connector_module_path="qualify.engines.connector_faults"``
and ``kv_connector_extra_config={"connector_under_test": ConnectorSpec.as_dict(), "fault": NAME or
null}``. It delegates every call to the wrapped connector (:mod:`qualify.engines.connector_delegate`)
and, once the wrapped connector's load of a layer is complete (:mod:`qualify.engines.connector_loads`
says when, for synchronous and asynchronous loads), corrupts that layer's loaded blocks
the way broken connectors do (:data:`FAULTS`): the consumer's cache then holds what a buggy connector
would have delivered, and the harness, which does not trust the connector, must catch and localise
it. A request's tag may name its own fault (``RequestTag.fault``), so one consumer engine runs a
branch per fault; without one, the configured fault applies (null: none, a pure delegation).

Every fault has a fixed site (:data:`FAULT_LAYER`, :data:`FAULT_HEAD`, :data:`FAULT_BLOCK`, ...) and
:func:`expected_footprint` says which (layer, K or V, KV head, block) cells it changes, so a test
can demand the localisation names exactly those. Faults act on whole pages (blocks, heads) or, for a
single element, through the CPU page layout decode/encode of :mod:`qualify.engines.vllm_connector`.

Imports: ``qualify.core``, ``qualify.engines`` and vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from qualify.engines.connector_delegate import (
    DelegatingConnector,
    ScheduledRequest,
    WrapperRefused,
)
from qualify.engines.vllm_connector import decode_blocks, encode_blocks

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig

FAULT_LAYER = 2
FAULT_HEAD = 1
"""The KV head a GQA replication overwrites (with head :data:`GQA_SOURCE_HEAD`)."""
GQA_SOURCE_HEAD = 0
FAULT_BLOCK = 5
"""The block (index within the request's blocks) that block faults hit."""
STALE_SOURCE_BLOCK = 0
"""The block of an earlier request whose pages the stale-block fault delivers instead."""
SWAPPED_LAYERS = (1, 2)
SCALED_POSITION_IN_BLOCK = 17
SCALED_DIM = 5
SCALE = 1.0 + 2.0 ** -10

FAULTS: dict[str, str] = {
    "gqa-head-replication": f"KV head {FAULT_HEAD} of layer {FAULT_LAYER} delivered as a copy of KV head "
                            f"{GQA_SOURCE_HEAD} (K and V, every loaded block), as a wrong GQA head replication does",
    "block-off-by-one": f"block {FAULT_BLOCK} receives block {FAULT_BLOCK + 1}'s content (every layer, K and V)",
    "stale-block": f"block {FAULT_BLOCK} receives block {STALE_SOURCE_BLOCK} of an earlier request "
                   f"(every layer, K and V)",
    "dtype-bf16": "every loaded value rounded through bfloat16",
    "dtype-fp8": "every loaded value rounded through float8_e4m3fn (unscaled)",
    "partial-block-dropped": "the last loaded block is not delivered (its slots are left zero) while the "
                             "connector claims it",
    "layers-swapped": f"layers {SWAPPED_LAYERS[0]} and {SWAPPED_LAYERS[1]} delivered in each other's place "
                      f"(K and V, every loaded block)",
    "element-scaled": f"one K element of layer {FAULT_LAYER}, KV head {FAULT_HEAD}, block {FAULT_BLOCK} "
                      f"(position {SCALED_POSITION_IN_BLOCK} in the block, dim {SCALED_DIM}) "
                      f"multiplied by 1 + 2**-10",
}
"""Fault name -> what it does (the sites are this module's constants)."""

Cell = tuple[int, str, int, int]


def expected_footprint(fault: str, *, layers: int, kv_heads: int, loaded_blocks: int) -> set[Cell]:
    """The (layer, tensor, KV head, block) cells ``fault`` changes when a request's first
    ``loaded_blocks`` blocks are loaded, in a model of ``layers`` layers and ``kv_heads`` KV heads
    (a fault may leave an element equal by chance; over a block of real KV it does not)."""
    both = ("K", "V")
    every_layer, every_head = range(layers), range(kv_heads)
    every_block = range(loaded_blocks)
    if fault == "gqa-head-replication":
        return {(FAULT_LAYER, t, FAULT_HEAD, b) for t in both for b in every_block}
    if fault in ("block-off-by-one", "stale-block"):
        return {(layer, t, h, FAULT_BLOCK) for layer in every_layer for t in both for h in every_head}
    if fault in ("dtype-bf16", "dtype-fp8"):
        return {(layer, t, h, b) for layer in every_layer for t in both for h in every_head for b in every_block}
    if fault == "partial-block-dropped":
        return {(layer, t, h, loaded_blocks - 1) for layer in every_layer for t in both for h in every_head}
    if fault == "layers-swapped":
        return {(layer, t, h, b) for layer in SWAPPED_LAYERS for t in both for h in every_head for b in every_block}
    if fault == "element-scaled":
        return {(FAULT_LAYER, "K", FAULT_HEAD, FAULT_BLOCK)}
    raise KeyError(fault)


def check_fault(name: Any, what: str = "fault") -> str | None:
    """``name`` if it is a known fault or None; ``WrapperRefused`` otherwise."""
    if name is None or (isinstance(name, str) and name in FAULTS):
        return name
    raise WrapperRefused(f"{what}: found {name!r}, expected null or one of {', '.join(FAULTS)}")


class FaultInjectingConnector(DelegatingConnector):
    """Delegates to the wrapped connector and corrupts what it loaded (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.fault = check_fault(self.extra_config.get("fault"), "kv_connector_extra_config.fault")
        unknown = set(self.extra_config) - {"connector_under_test", "fault"}
        if unknown:
            raise WrapperRefused(f"kv_connector_extra_config: unknown field {sorted(unknown)[0]!r}")
        self._stale: dict[int, torch.Tensor] = {}
        self._swap_pages: dict[tuple[str, int], torch.Tensor] = {}

    def _fault_of(self, request: ScheduledRequest) -> str | None:
        return check_fault(request.tag.fault, "kv_transfer_params fault") if request.tag.fault else self.fault

    def before_layer_save(self, layer_name: str, layer: int, kv_layer: torch.Tensor,
                          requests: list[ScheduledRequest]) -> torch.Tensor:
        # The stale-block fault's source: a block of the first request this engine computed.
        if layer not in self._stale:
            for request in requests:
                if request.loaded_tokens == 0 and len(request.block_ids) > STALE_SOURCE_BLOCK:
                    self._stale[layer] = kv_layer[request.block_ids[STALE_SOURCE_BLOCK]].clone()
                    break
        return kv_layer

    def after_layer_load(self, layer_name: str, layer: int, kv_layer: torch.Tensor,
                         requests: list[ScheduledRequest]) -> None:
        for request in requests:
            fault = self._fault_of(request)
            if fault is None:
                continue
            count = request.loaded_tokens // self.block_size
            if count <= FAULT_BLOCK + 1:
                raise WrapperRefused(f"fault {fault}: the connector loaded {count} whole blocks, the fault "
                                     f"site needs more than {FAULT_BLOCK + 1}")
            blocks = list(request.block_ids[:count])
            self._inject(fault, layer_name, layer, kv_layer, blocks, request)

    def _inject(self, fault: str, layer_name: str, layer: int, kv_layer: torch.Tensor, blocks: list[int],
                request: ScheduledRequest) -> None:
        index = torch.as_tensor(blocks, dtype=torch.long)
        if fault == "gqa-head-replication" and layer == FAULT_LAYER:
            kv_layer[index, FAULT_HEAD] = kv_layer[index, GQA_SOURCE_HEAD]
        elif fault == "block-off-by-one":
            kv_layer[blocks[FAULT_BLOCK]] = kv_layer[blocks[FAULT_BLOCK + 1]]
        elif fault == "stale-block":
            if layer not in self._stale:
                raise WrapperRefused("fault stale-block: no earlier request's block in this engine to deliver")
            kv_layer[blocks[FAULT_BLOCK]] = self._stale[layer]
        elif fault in ("dtype-bf16", "dtype-fp8"):
            dtype = torch.bfloat16 if fault == "dtype-bf16" else torch.float8_e4m3fn
            kv_layer[index] = kv_layer[index].to(dtype).to(kv_layer.dtype)
        elif fault == "partial-block-dropped":
            kv_layer[blocks[-1]] = 0
        elif fault == "layers-swapped" and layer in SWAPPED_LAYERS:
            self._swap(layer, kv_layer, index, request)
        elif fault == "element-scaled" and layer == FAULT_LAYER:
            keys, values = decode_blocks(kv_layer, [blocks[FAULT_BLOCK]], self.head_dim)
            keys[FAULT_HEAD, SCALED_POSITION_IN_BLOCK, SCALED_DIM] *= np.float32(SCALE)
            encode_blocks(kv_layer, [blocks[FAULT_BLOCK]], keys, values)

    def _swap(self, layer: int, kv_layer: torch.Tensor, index: torch.Tensor, request: ScheduledRequest) -> None:
        """The first swapped layer to finish loading takes the other's pages (waiting for the other
        layer's load first, as the wrapped connector guarantees it, unless the load was asynchronous
        and is complete already); the second gets the first's."""
        first, second = SWAPPED_LAYERS
        key = request.req_id
        if layer == first:
            other_name = self.attention_layers()[second]
            if not request.load_async:
                self.inner.wait_for_layer_load(other_name)
            other = self.checked_layer(self.layer_cache(other_name))
            self._swap_pages[(key, second)] = kv_layer[index].clone()
            kv_layer[index] = other[index]
        else:
            pages = self._swap_pages.pop((key, second), None)
            if pages is None:
                raise WrapperRefused(f"fault layers-swapped: layer {second} loaded before layer {first}")
            kv_layer[index] = pages

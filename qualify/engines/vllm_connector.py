"""The project KV connector: vLLM's ``KVConnectorBase_V1`` exporting and installing canonical KV.

Loaded by vLLM through ``kv_connector_module_path="qualify.engines.vllm_connector"`` with
``kv_connector="QualifyKVConnector"`` and ``kv_role="kv_both"``; :class:`qualify.engines.vllm_engine.VllmEngine`
runs vLLM in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the scheduler-role and
worker-role instances of this class and the engine share :data:`MAILBOX` in one process. A
request says what the connector does for it through ``SamplingParams.extra_args["kv_transfer_params"]
= {"qualify": {"op": "export" | "import", "key": KEY}}``:

* ``export`` (producer role): when the request's prefill runs, each attention layer's paged cache
  is decoded into the harness's canonical per-token layout (:mod:`qualify.core.kv`: K post-RoPE and V,
  ``[kv_heads, positions, head_dim]`` float32) for the whole blocks of the prompt, and left in
  ``MAILBOX.exports[KEY]``. The engine seals it with :mod:`qualify.handoff.wire` (seam digests,
  manifest, MAC) in the producer service; this module never signs anything.
* ``import`` (consumer role): the verified, installed :class:`~qualify.core.kv.KVCache` the engine put
  in ``MAILBOX.imports[KEY]`` is written into the request's freshly allocated blocks before the
  forward pass; the scheduler is told those positions are computed, and the rest of the prompt
  (placeholder positions are never recomputed; the pending tokens are) runs as usual.
  ``MAILBOX.loaded[KEY]`` records how many positions were installed.

Whole blocks only: a handoff of P positions must have P a multiple of the block size, and the
consumer recomputes the tokens after it as pending tokens.

Page layout. The CPU backend's cache per layer is ``[num_blocks, kv_heads, block_size,
2 * head_dim]``; for the ``vec`` kernel (float32, block size a multiple of 32, x86) each
(block, head) page physically holds K transposed, ``[head_dim, block_size]``, followed by V
``[block_size, head_dim]``. That is the only layout this connector decodes or encodes
(:data:`KNOWN_LAYOUT`); any other backend, ISA, dtype, shape or stride is refused with one line,
never guessed. :class:`qualify.engines.vllm_engine.VllmEngine` tests the decode against the
reference engine's KV at start (a wrong layout would be refused there too).

Fault variants (``kv_connector_extra_config={"qualify_fault": NAME}``) corrupt the export the
way broken disaggregated serving has, before the producer seals it (a compromised producer signs
what it sends), so only the harness's comparison can catch them: see :data:`CONNECTOR_FAULTS`.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

KNOWN_LAYOUT = "cpu-vec-f32-kT-v1"
"""CPU_ATTN backend, ``vec`` ISA, float32: per (block, head) K^T [head_dim, block] then V [block, head_dim]."""

# Where single-site connector faults land (named in every report and test).
FAULT_LAYER = 2
FAULT_HEAD = 1
FAULT_POSITION = 1000
FAULT_DIM = 5
FAULT_BIT = 22  # a float32 mantissa bit: a relative change of about 0.5 for a normal number
SWAPPED_BLOCKS = (3, 4)
LONG_REQUEST_POSITIONS = 1024
"""The "raise" and "shift-install" faults (and the engine's "other-prompt") reach only requests of at
least this many positions: they spare the engine's short warm-up and its known-answer check (259
positions), as a fault that depends on length would, so only a handoff's comparison can catch them."""

CONNECTOR_FAULTS: dict[str, str] = {
    "k-bit-flip": f"one bit ({FAULT_BIT}) of one K element flipped at layer {FAULT_LAYER} "
                  f"(head {FAULT_HEAD}, position {FAULT_POSITION}, dim {FAULT_DIM})",
    "block-order": f"blocks {SWAPPED_BLOCKS} read from the page table in each other's place (K and V)",
    "raise": f"the connector raises while saving layer {FAULT_LAYER} of a request of at least "
             f"{LONG_REQUEST_POSITIONS} positions (an engine failing mid-request)",
    "shift-install": "consumer: claims every handed-off token but installs the KV one block later, "
                     "so the cache holds KV of another position range (vLLM #52617), for a request "
                     f"of at least {LONG_REQUEST_POSITIONS} positions",
}

_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(layer_name: str) -> int:
    """``model.layers.3.self_attn.attn`` -> 3; refuses a name without a layer index."""
    match = _LAYER_NAME.search(layer_name)
    if match is None:
        raise LayoutRefused(f"attention layer name {layer_name!r} has no layer index")
    return int(match.group(1))


class LayoutRefused(RuntimeError):
    """The paged cache is not in a layout this connector understands (it never guesses)."""


@dataclass
class Mailbox:
    """Process-wide state shared by the engine and both connector roles (in-process vLLM)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    # KEY -> canonical KV to install (set by the engine before the request).
    imports: dict[str, Any] = field(default_factory=dict)
    # KEY -> {layer index: (K, V)} exported during the request; "positions" -> int.
    exports: dict[str, dict[Any, Any]] = field(default_factory=dict)
    # KEY -> positions installed into the paged cache.
    loaded: dict[str, int] = field(default_factory=dict)
    # The layout a connector checked when it first saw a cache (for the engine's facts).
    layout: str | None = None


MAILBOX = Mailbox()


def _qualify_params(request: Any) -> dict[str, Any] | None:
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict):
        return None
    value = params.get("qualify")
    return value if isinstance(value, dict) else None


# ---------------------------------------------------------------------------------------------
# page layout


def check_layout(kv_layer: torch.Tensor, *, block_size: int, kv_heads: int, head_dim: int,
                 isa: str | None) -> str:
    """Return :data:`KNOWN_LAYOUT` if ``kv_layer`` is that layout, else raise ``LayoutRefused``."""
    if isa != "vec":
        raise LayoutRefused(f"paged KV layout: CPU attention ISA {isa!r}, only 'vec' is understood")
    if kv_layer.dtype != torch.float32:
        raise LayoutRefused(f"paged KV layout: dtype {kv_layer.dtype}, only torch.float32 is understood")
    if kv_layer.dim() != 4:
        raise LayoutRefused(f"paged KV layout: {kv_layer.dim()} dimensions {list(kv_layer.shape)}, "
                            f"expected [blocks, kv_heads, block_size, 2*head_dim]")
    _, heads, size, width = kv_layer.shape
    if (heads, size, width) != (kv_heads, block_size, 2 * head_dim):
        raise LayoutRefused(f"paged KV layout: shape {list(kv_layer.shape)}, expected [*, {kv_heads}, "
                            f"{block_size}, {2 * head_dim}]")
    if not kv_layer.is_contiguous():
        raise LayoutRefused(f"paged KV layout: strides {kv_layer.stride()} are not contiguous")
    return KNOWN_LAYOUT


def decode_blocks(kv_layer: torch.Tensor, block_ids: list[int], head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Pages -> canonical K, V ``[kv_heads, len(block_ids) * block_size, head_dim]`` (copies)."""
    _, heads, block_size, _ = kv_layer.shape
    index = torch.as_tensor(block_ids, dtype=torch.long)
    pages = kv_layer.index_select(0, index).reshape(len(block_ids), heads, 2, block_size * head_dim)
    k_t = pages[:, :, 0].reshape(len(block_ids), heads, head_dim, block_size)
    v = pages[:, :, 1].reshape(len(block_ids), heads, block_size, head_dim)
    keys = k_t.permute(1, 0, 3, 2).reshape(heads, -1, head_dim)
    values = v.permute(1, 0, 2, 3).reshape(heads, -1, head_dim)
    return (np.ascontiguousarray(keys.numpy(), dtype=np.float32),
            np.ascontiguousarray(values.numpy(), dtype=np.float32))


def encode_blocks(kv_layer: torch.Tensor, block_ids: list[int], keys: np.ndarray, values: np.ndarray) -> None:
    """Canonical K, V ``[kv_heads, n * block_size, head_dim]`` -> the pages of ``block_ids``."""
    _, heads, block_size, width = kv_layer.shape
    head_dim = width // 2
    count = len(block_ids)
    k = torch.from_numpy(np.ascontiguousarray(keys, dtype=np.float32)).reshape(heads, count, block_size, head_dim)
    v = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(heads, count, block_size, head_dim)
    pages = torch.empty((count, heads, 2, block_size * head_dim), dtype=torch.float32)
    pages[:, :, 0] = k.permute(1, 0, 3, 2).reshape(count, heads, -1)
    pages[:, :, 1] = v.permute(1, 0, 2, 3).reshape(count, heads, -1)
    kv_layer.index_copy_(0, torch.as_tensor(block_ids, dtype=torch.long),
                         pages.reshape(count, heads, block_size, width))


def flip_bit(array: np.ndarray, head: int, position: int, dim: int, bit: int) -> None:
    """Flip one bit of one float32 element in place."""
    view = array.view(np.uint32)
    view[head, position, dim] ^= np.uint32(1 << bit)


# ---------------------------------------------------------------------------------------------
# the connector


@dataclass(frozen=True)
class _Transfer:
    req_id: str
    key: str
    op: str  # "export" | "import"
    block_ids: tuple[int, ...]
    positions: int


@dataclass
class QualifyConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]  # vLLM is untyped: its bases are Any
    transfers: list[_Transfer] = field(default_factory=list)


class QualifyKVConnector(KVConnectorBase_V1):  # type: ignore[misc]  # vLLM is untyped: its bases are Any
    """Exports a request's prompt KV in the canonical layout, or installs a verified handoff."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = int(vllm_config.cache_config.block_size)
        model = vllm_config.model_config
        self._kv_heads = int(model.get_total_num_kv_heads())
        self._head_dim = int(model.get_head_size())
        self._fault = self._kv_transfer_config.get_from_extra_config("qualify_fault", None)
        if self._fault is not None and self._fault not in CONNECTOR_FAULTS:
            raise LayoutRefused(f"qualify_fault: found {self._fault!r}, expected one of "
                                f"{', '.join(CONNECTOR_FAULTS)}")
        self._pending_import: dict[str, tuple[str, int]] = {}
        self._layout_checked = False

    # -- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = _qualify_params(request)
        if params is None or params.get("op") != "import":
            return 0, False
        kv = MAILBOX.imports.get(params["key"])
        if kv is None:
            return 0, False
        positions = int(kv.geometry.positions)
        prompt = len(request.prompt_token_ids or [])
        if positions % self._block_size or positions >= prompt:
            # Not whole blocks, or nothing left to compute: install nothing (the engine refuses).
            return 0, False
        return max(positions - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        params = _qualify_params(request)
        if num_external_tokens > 0 and params is not None:
            self._pending_import[request.request_id] = (params["key"], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = QualifyConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            pending = self._pending_import.pop(new.req_id, None)
            block_ids = tuple(new.block_ids[0])
            if pending is not None:
                key, positions = pending
                meta.transfers.append(_Transfer(new.req_id, key, "import", block_ids, positions))
                continue
            extra = (new.sampling_params.extra_args or {}) if new.sampling_params else {}
            params = (extra.get("kv_transfer_params") or {}).get("qualify")
            if isinstance(params, dict) and params.get("op") == "export":
                prompt = len(new.prompt_token_ids or [])
                scheduled = scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
                if new.num_computed_tokens + scheduled < prompt:
                    raise LayoutRefused(f"export {params['key']}: the prompt's prefill was split "
                                        f"({scheduled} of {prompt} tokens scheduled); raise "
                                        f"max_num_batched_tokens")
                positions = (prompt // self._block_size) * self._block_size
                count = positions // self._block_size
                meta.transfers.append(_Transfer(new.req_id, params["key"], "export",
                                                block_ids[:count], positions))
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._pending_import.pop(request.request_id, None)
        return False, None

    # -- worker side ------------------------------------------------------------------------

    def _isa(self) -> str | None:
        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        except ImportError:
            return None
        isa: str | None = _get_attn_isa(torch.float32, self._block_size, self._head_dim)
        return isa

    def _check(self, kv_layer: torch.Tensor) -> None:
        if not self._layout_checked:
            MAILBOX.layout = check_layout(kv_layer, block_size=self._block_size, kv_heads=self._kv_heads,
                                          head_dim=self._head_dim, isa=self._isa())
            self._layout_checked = True

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        imports = [t for t in metadata.transfers if t.op == "import"]
        if not imports:
            return
        for name, layer in forward_context.no_compile_layers.items():
            kv_cache = getattr(layer, "kv_cache", None)
            if kv_cache is None:
                continue
            if isinstance(kv_cache, (list, tuple)):
                kv_cache = kv_cache[0]
            self._check(kv_cache)
            index = layer_index(name)
            for transfer in imports:
                kv = MAILBOX.imports[transfer.key]
                count = transfer.positions // self._block_size
                blocks = list(transfer.block_ids[:count])
                keys, values = kv.keys[index], kv.values[index]
                if self._fault == "shift-install" and transfer.positions >= LONG_REQUEST_POSITIONS:
                    # The cache claims all tokens, but holds KV of positions one block later.
                    keys = np.concatenate([keys[:, self._block_size:], keys[:, :self._block_size]], axis=1)
                    values = np.concatenate([values[:, self._block_size:], values[:, :self._block_size]], axis=1)
                encode_blocks(kv_cache, blocks, keys[:, :transfer.positions], values[:, :transfer.positions])
        with MAILBOX.lock:
            for transfer in imports:
                MAILBOX.loaded[transfer.key] = transfer.positions

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        exports = [t for t in metadata.transfers if t.op == "export"]
        if not exports:
            return
        self._check(kv_layer)
        index = layer_index(layer_name)
        if self._fault == "raise" and index == FAULT_LAYER and any(
                t.positions >= LONG_REQUEST_POSITIONS for t in exports):
            raise RuntimeError(f"qualify connector fault 'raise': failing while saving layer {index}")
        for transfer in exports:
            blocks = list(transfer.block_ids)
            if self._fault == "block-order" and len(blocks) > max(SWAPPED_BLOCKS):
                a, b = SWAPPED_BLOCKS
                blocks[a], blocks[b] = blocks[b], blocks[a]
            keys, values = decode_blocks(kv_layer, blocks, self._head_dim)
            if self._fault == "k-bit-flip" and index == FAULT_LAYER and keys.shape[1] > FAULT_POSITION:
                flip_bit(keys, FAULT_HEAD, FAULT_POSITION, FAULT_DIM, FAULT_BIT)
            with MAILBOX.lock:
                entry = MAILBOX.exports.setdefault(transfer.key, {})
                entry[index] = (keys, values)
                entry["positions"] = transfer.positions

    def wait_for_save(self) -> None:
        return

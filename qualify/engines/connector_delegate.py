"""A vLLM KV connector that wraps the connector under test and delegates every call to it.

:class:`DelegatingConnector` is loaded by vLLM like any connector (``kv_connector_module_path``);
its ``kv_connector_extra_config`` is ``{"connector_under_test": ConnectorSpec.as_dict()}`` (plus
what a subclass reads). It re-resolves that spec in the engine's process (refusing one that
resolves differently), builds the connector under test with the same vLLM config except the
``KVTransferConfig`` fields naming the connector (as vLLM's own MultiConnector builds its
children), and forwards every method of ``KVConnectorBase_V1``, both roles, with the same
arguments, returning the inner connector's results (attributes the base does not define are
forwarded too). What it adds is bookkeeping, for the subclasses that observe or inject faults:

* Requests are tagged by the harness with ``kv_transfer_params[TAG] = {"key": ..., "cold": bool,
  "capture": bool, "fault": name | null}`` (:class:`RequestTag`); untagged requests are only delegated.
* Scheduler side: each step's connector metadata is an envelope (:class:`DelegatedMetadata`)
  holding the inner connector's metadata and, for every tagged request scheduled for the first
  time, its blocks, prompt length and the tokens the connector claimed to load
  (:class:`ScheduledRequest`). The worker side unwraps it and binds the inner metadata.
* Worker side: :meth:`after_layer_load` sees a layer's loaded blocks once they are final (what
  attention reads), at the point :mod:`qualify.engines.connector_loads` names for the way the
  connector loaded them: a synchronous load (``get_num_new_matched_tokens`` said
  ``load_async=False``: ExampleConnector, LMCache) once the inner connector's
  ``wait_for_layer_load(layer)`` returns; an asynchronous one (NIXL, Mooncake: vLLM parks the
  request until the connector reports it received, then schedules it) when the step that first
  computes the request binds its metadata, before the forward writes anything into the pages (the
  CPU backend writes the recomputed last prompt token's KV before ``wait_for_layer_load``), and
  only once the inner connector's ``get_transfer_results``/``get_finished`` reported the request as
  received (refused otherwise). Before ``save_kv_layer`` forwards a layer,
  :meth:`before_layer_save` sees what the connector is given.

Known limits (vLLM 0.32): vLLM sees the wrapper's class, so configuration-time switches keyed on a
connector's registered name (NIXL's DCP and Mamba adjustments) and the hybrid KV cache manager
(the wrapper does not declare ``SupportsHMA``; the CPU platform never enables it) follow the
wrapper, not the connector under test. The scheduler and worker must share one process for the
subclasses' process-wide records (the harness runs vLLM in-process).

Imports: ``qualify.core``, ``qualify.engines`` (connector resolution, page layout) and vLLM.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from qualify.engines.connector_loads import NotReceived, received_loads, synchronous_loads
from qualify.engines.connector_under_test import ConnectorSpec, resolve_connector_dict
from qualify.engines.vllm_connector import check_layout, layer_index

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

TAG = "qualify_connector"
"""The ``kv_transfer_params`` key under which the harness tags its requests."""

CONNECTOR_UNDER_TEST = "connector_under_test"
"""The wrapper's ``kv_connector_extra_config`` key holding the inner connector's spec."""

_KEY = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def cpu_attention_isa(block_size: int, head_dim: int) -> str | None:
    """The CPU attention kernel vLLM picks for float32 pages of this shape (``"vec"``, ``"amx"``,
    ...), or None where this vLLM has no CPU attention backend (then no layout is understood).
    The project connector asks the same (its ``_isa``); its source is pinned whole by the vLLM
    identities, so this copy stays here until identities pin behaviour instead (issue 35)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None
    isa: str | None = _get_attn_isa(torch.float32, block_size, head_dim)
    return isa


class WrapperRefused(RuntimeError):
    """A wrapper's config or a request tag is malformed (raised inside vLLM: the engine stops)."""


@dataclass(frozen=True)
class RequestTag:
    """What the harness asks of a request: ``key`` names its records; ``cold`` suppresses the
    connector's hit (a cold recompute on the same engine); ``capture`` keeps the prompt's computed
    KV; ``fault`` selects a fault of a fault-injecting wrapper (None: none)."""

    key: str
    cold: bool = False
    capture: bool = False
    fault: str | None = None

    def as_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` of a request carrying this tag."""
        return {TAG: {"key": self.key, "cold": self.cold, "capture": self.capture, "fault": self.fault}}


def request_tag(kv_transfer_params: Any) -> RequestTag | None:
    """The tag in a request's ``kv_transfer_params`` (None when untagged); ``WrapperRefused``
    for a malformed tag (the harness wrote it: a malformed one is a bug, never ignored)."""
    if not isinstance(kv_transfer_params, dict) or TAG not in kv_transfer_params:
        return None
    value = kv_transfer_params[TAG]
    if not isinstance(value, dict) or set(value) != {"key", "cold", "capture", "fault"}:
        raise WrapperRefused(f"kv_transfer_params.{TAG}: expected an object with key, cold, capture, fault")
    key, cold, capture, fault = value["key"], value["cold"], value["capture"], value["fault"]
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise WrapperRefused(f"kv_transfer_params.{TAG}.key: expected 1-64 of [A-Za-z0-9_.-], found {key!r}")
    if not isinstance(cold, bool) or not isinstance(capture, bool):
        raise WrapperRefused(f"kv_transfer_params.{TAG}: cold and capture must be true or false")
    if fault is not None and not isinstance(fault, str):
        raise WrapperRefused(f"kv_transfer_params.{TAG}.fault: expected a fault name or null")
    return RequestTag(key, cold, capture, fault)


@dataclass(frozen=True)
class ScheduledRequest:
    """A tagged request in the first step that computes it (what the worker side needs)."""

    req_id: str
    tag: RequestTag
    block_ids: tuple[int, ...]
    prompt_tokens: int
    computed_tokens: int
    """Tokens already in the cache when the step starts (loaded by the connector; no local prefix cache)."""
    loaded_tokens: int
    """Tokens the connector claimed (``update_state_after_alloc``'s ``num_external_tokens``)."""
    scheduled_tokens: int
    load_async: bool = False
    """The connector loads them asynchronously (vLLM schedules the request once it reported them received)."""


@dataclass
class DelegatedMetadata(KVConnectorMetadata):  # type: ignore[misc]  # vLLM is untyped: its bases are Any
    """The wrapper's per-step metadata: the inner connector's, and the tagged requests' facts."""

    inner: Any
    requests: tuple[ScheduledRequest, ...] = field(default_factory=tuple)


def _inner_vllm_config(vllm_config: VllmConfig, spec: ConnectorSpec) -> VllmConfig:
    """``vllm_config`` with the transfer config naming the connector under test (every other
    transfer field, the role and the engine id kept); a shallow copy, as MultiConnector makes."""
    inner = copy.copy(vllm_config)
    inner.kv_transfer_config = dataclasses.replace(vllm_config.kv_transfer_config, **spec.transfer_arguments())
    return inner


def _spec_of(extra_config: Any) -> ConnectorSpec:
    if not isinstance(extra_config, dict) or CONNECTOR_UNDER_TEST not in extra_config:
        raise WrapperRefused(f"kv_connector_extra_config: expected a {CONNECTOR_UNDER_TEST!r} object "
                             f"(ConnectorSpec.as_dict of the connector to wrap)")
    try:
        return resolve_connector_dict(extra_config[CONNECTOR_UNDER_TEST],
                                      f"kv_connector_extra_config.{CONNECTOR_UNDER_TEST}")
    except Exception as exc:  # Refused is not a vLLM error type: say it in vLLM's terms
        raise WrapperRefused(str(exc)) from None


def _inner_class(vllm_config: VllmConfig) -> tuple[type[KVConnectorBase_V1], VllmConfig]:
    spec = _spec_of(vllm_config.kv_transfer_config.kv_connector_extra_config)
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    inner_config = _inner_vllm_config(vllm_config, spec)
    cls: type[KVConnectorBase_V1] = KVConnectorFactory.get_connector_class(inner_config.kv_transfer_config)
    return cls, inner_config


class DelegatingConnector(KVConnectorBase_V1):  # type: ignore[misc]  # vLLM is untyped: its bases are Any
    """Delegates every connector call to the connector under test (see the module docstring)."""

    _inner_classes: dict[str, type[KVConnectorBase_V1]] = {}
    """Inner classes built in this process (for the class methods vLLM calls without a config)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.spec = _spec_of(self._kv_transfer_config.kv_connector_extra_config)
        self.extra_config: dict[str, Any] = self._kv_transfer_config.kv_connector_extra_config
        cls, inner_config = _inner_class(vllm_config)
        DelegatingConnector._inner_classes[type(self).__name__] = cls
        self.inner: KVConnectorBase_V1 = cls(inner_config, role, kv_cache_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        model = vllm_config.model_config
        self.kv_heads = int(model.get_total_num_kv_heads())
        self.head_dim = int(model.get_head_size())
        # Scheduler side: tokens the connector claimed per request, until its first scheduled step,
        # and the requests whose claim it loads asynchronously.
        self._claimed: dict[str, int] = {}
        self._async: set[str] = set()
        # Worker side: this step's tagged requests, whether the page layout was checked, and the
        # requests the inner connector reported as received (asynchronous loads).
        self._step: tuple[ScheduledRequest, ...] = ()
        self._layout_checked = False
        self._received: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes this class and the base lack: the inner connector's own API.
        if name in ("inner", "__setstate__") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    # -- hooks for subclasses ----------------------------------------------------------------

    def scheduler_hit(self, request: Request, tag: RequestTag, matched: int | None, load_async: bool) -> int | None:
        """The hit reported to vLLM for a tagged request (default: the connector's own)."""
        return matched

    def after_layer_load(self, layer_name: str, layer: int, kv_layer: torch.Tensor,
                         requests: list[ScheduledRequest]) -> None:
        """Called once the inner connector's load of ``layer`` is complete, for the tagged requests
        of this step that the connector loaded into (``loaded_tokens > 0``)."""

    def before_layer_save(self, layer_name: str, layer: int, kv_layer: torch.Tensor,
                          requests: list[ScheduledRequest]) -> torch.Tensor:
        """Called before ``save_kv_layer`` is forwarded, with this step's tagged requests; returns
        the tensor the inner connector is given (default: ``kv_layer`` itself)."""
        return kv_layer

    # -- helpers for subclasses ----------------------------------------------------------------

    def checked_layer(self, kv_layer: torch.Tensor) -> torch.Tensor:
        """``kv_layer`` (the first virtual engine's cache if a list) once its page layout is the
        one :mod:`qualify.engines.vllm_connector` decodes; ``LayoutRefused`` otherwise."""
        if isinstance(kv_layer, (list, tuple)):
            kv_layer = kv_layer[0]
        if not self._layout_checked:
            check_layout(kv_layer, block_size=self.block_size, kv_heads=self.kv_heads, head_dim=self.head_dim,
                         isa=cpu_attention_isa(self.block_size, self.head_dim))
            self._layout_checked = True
        return kv_layer

    def attention_layers(self) -> dict[int, str]:
        """Layer index -> name of every attention layer holding a KV cache in this engine."""
        names = self._vllm_config.compilation_config.static_forward_context
        return {layer_index(name): name for name in names if getattr(names[name], "kv_cache", None) is not None}

    @staticmethod
    def layer_cache(layer_name: str) -> torch.Tensor:
        """The paged KV cache of ``layer_name`` in the current forward pass."""
        from vllm.model_executor.layers.attention.attention import get_attention_context

        kv_cache: torch.Tensor = get_attention_context(layer_name)[2]
        return kv_cache

    # -- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        matched, load_async = self.inner.get_num_new_matched_tokens(request, num_computed_tokens)
        tag = request_tag(getattr(request, "kv_transfer_params", None))
        if tag is None:
            return matched, load_async
        reported = self.scheduler_hit(request, tag, matched, load_async)
        load_async = bool(load_async) if reported else False
        if load_async:
            self._async.add(request.request_id)
        else:
            self._async.discard(request.request_id)
        return reported, load_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.inner.update_state_after_alloc(request, blocks, num_external_tokens)
        if request_tag(getattr(request, "kv_transfer_params", None)) is not None and num_external_tokens > 0:
            self._claimed[request.request_id] = int(num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        inner = self.inner.build_connector_meta(scheduler_output)
        requests = []
        for new in scheduler_output.scheduled_new_reqs:
            extra = (new.sampling_params.extra_args or {}) if new.sampling_params is not None else {}
            tag = request_tag(extra.get("kv_transfer_params"))
            if tag is None:
                continue
            requests.append(ScheduledRequest(
                req_id=new.req_id, tag=tag, block_ids=tuple(int(b) for b in new.block_ids[0]),
                prompt_tokens=len(new.prompt_token_ids or []), computed_tokens=int(new.num_computed_tokens),
                loaded_tokens=self._claimed.pop(new.req_id, 0),
                scheduled_tokens=int(scheduler_output.num_scheduled_tokens.get(new.req_id, 0)),
                load_async=new.req_id in self._async))
            self._async.discard(new.req_id)
        return DelegatedMetadata(inner=inner, requests=tuple(requests))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._claimed.pop(request.request_id, None)
        self._async.discard(request.request_id)
        result: tuple[bool, dict[str, Any] | None] = self.inner.request_finished(request, block_ids)
        return result

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> Any:
        return self.inner.get_external_cache_hit_sources(request, num_external_tokens)

    def on_new_request(self, request: Request) -> None:
        self.inner.on_new_request(request)

    def update_connector_output(self, connector_output: Any) -> None:
        self.inner.update_connector_output(connector_output)

    def register_finished_partial_tail(self, request: Request, block_ids: tuple[list[int], ...],
                                       partial_tail_offloads: list[tuple[int, int, int]]) -> bool:
        result: bool = self.inner.register_finished_partial_tail(request, block_ids, partial_tail_offloads)
        return result

    def take_events(self) -> Iterable[Any]:
        events: Iterable[Any] = self.inner.take_events()
        return events

    def has_pending_block_frees(self) -> bool:
        result: bool = self.inner.has_pending_block_frees()
        return result

    def has_pending_push_work(self) -> bool:
        result: bool = self.inner.has_pending_push_work()
        return result

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self.inner.bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self.inner.bind_gpu_block_pool(gpu_block_pool)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        result: tuple[int, ...] = self.inner.get_loaded_kv_cache_group_ids(request)
        return result

    def get_finished_count(self) -> int | None:
        result: int | None = self.inner.get_finished_count()
        return result

    def reset_cache(self) -> bool | None:
        result: bool | None = self.inner.reset_cache()
        return result

    # -- worker side ---------------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        if not isinstance(connector_metadata, DelegatedMetadata):
            raise WrapperRefused(f"{type(self).__name__}: step metadata is a {type(connector_metadata).__name__}, "
                                 f"expected the wrapper's DelegatedMetadata")
        super().bind_connector_metadata(connector_metadata)
        self._step = connector_metadata.requests
        self.inner.bind_connector_metadata(connector_metadata.inner)
        # Asynchronously loaded requests: final since the connector reported them received; read
        # now, before this step's forward writes the recomputed tail into their pages.
        try:
            ready = received_loads(self._step, self._received, type(self).__name__)
        except NotReceived as exc:
            raise WrapperRefused(str(exc)) from None
        if ready:
            for layer, layer_name in sorted(self.attention_layers().items()):
                self.after_layer_load(layer_name, layer, self.checked_layer(self.layer_cache(layer_name)), ready)
            self._received.difference_update(r.req_id for r in ready)

    def clear_connector_metadata(self) -> None:
        self.inner.clear_connector_metadata()
        self._step = ()
        super().clear_connector_metadata()

    def has_connector_metadata(self) -> bool:
        result: bool = self.inner.has_connector_metadata()
        return result

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        inner = kv_connector_metadata.inner if isinstance(kv_connector_metadata, DelegatedMetadata) \
            else kv_connector_metadata
        self.inner.handle_preemptions(inner)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.inner.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.inner.wait_for_layer_load(layer_name)
        loaded = synchronous_loads(self._step)
        if loaded:
            self.after_layer_load(layer_name, layer_index(layer_name),
                                  self.checked_layer(self.layer_cache(layer_name)), loaded)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        given = kv_layer
        if self._step:
            given = self.before_layer_save(layer_name, layer_index(layer_name), self.checked_layer(kv_layer),
                                           list(self._step))
        self.inner.save_kv_layer(layer_name, given, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self.inner.wait_for_save()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.inner.register_kv_caches(kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        self.inner.set_host_xfer_buffer_ops(copy_operation)

    def get_mem_pool_context(self) -> Any:
        return self.inner.get_mem_pool_context()

    def finish_forward(self) -> None:
        self.inner.finish_forward()

    def reset_capture_state(self) -> None:
        self.inner.reset_capture_state()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        result: tuple[set[str] | None, set[str] | None] = self.inner.get_finished(finished_req_ids)
        self._received.update(result[1] or ())
        return result

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = self.inner.get_transfer_results(finished_req_ids)
        self._received.update(getattr(results, "finished_recving", None) or ())
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        result: set[int] = self.inner.get_block_ids_with_load_errors()
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def get_kv_connector_stats(self) -> Any:
        return self.inner.get_kv_connector_stats()

    def get_kv_connector_kv_cache_events(self) -> Any:
        return self.inner.get_kv_connector_kv_cache_events()

    def get_handshake_metadata(self) -> Any:
        return self.inner.get_handshake_metadata()

    def build_connector_worker_meta(self) -> Any:
        return self.inner.build_connector_worker_meta()

    def set_xfer_handshake_metadata(self, metadata: Any) -> None:
        self.inner.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: Any) -> None:
        self.inner.set_xfer_handshake_metadata_pp_aware(metadata)

    # -- properties and class methods ----------------------------------------------------------

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        result: bool = self.inner.supports_divergent_local_hybrid_hits
        return result

    @property
    def requires_kv_delivery(self) -> bool:
        result: bool = self.inner.requires_kv_delivery
        return result

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        inner_cls, inner_config = _inner_class(vllm_config)
        layout: str | None = inner_cls.get_required_kvcache_layout(inner_config)
        return layout

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        spec = _spec_of(extra_config)
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        inner_cls = KVConnectorFactory.get_connector_class(
            KVTransferConfig(kv_role="kv_both", **spec.transfer_arguments()))
        result: bool = inner_cls.requires_piecewise_for_cudagraph(dict(spec.config))
        return result

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        inner_cls = DelegatingConnector._inner_classes.get(cls.__name__)
        return None if inner_cls is None else inner_cls.build_kv_connector_stats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: Any, labelnames: Any,
                           per_engine_labelvalues: Any) -> Any:
        inner_cls, inner_config = _inner_class(vllm_config)
        return inner_cls.build_prom_metrics(inner_config, metric_types, labelnames, per_engine_labelvalues)

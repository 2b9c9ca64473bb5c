"""When the wrappers may read what a KV connector loaded: the rule of
:mod:`qualify.engines.connector_delegate`, kept free of vLLM so it is tested on its own.

A connector loads a request's claimed tokens in one of two ways, which it tells vLLM in
``get_num_new_matched_tokens`` (``load_async``):

* **synchronously** (ExampleConnector, LMCache): inside the step that computes the request, layer by
  layer; a layer's loaded blocks are final once the connector's ``wait_for_layer_load(layer)``
  returns, and are read there;
* **asynchronously** (NIXL, Mooncake): between steps. vLLM parks the request until the connector's
  worker reports it received (``get_transfer_results``/``get_finished``: ``finished_recving``), then
  schedules it. Its blocks are final when the step that first computes it starts, and are read when
  that step binds its connector metadata: before the forward, which on the CPU backend writes the
  recomputed last prompt token's KV into the pages before ``wait_for_layer_load`` is called. A
  request read there must have been reported received; one that was not is refused, never read
  half loaded.

Imports: nothing of the harness (pure).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar


class LoadedRequest(Protocol):
    """What the rule needs of a scheduled request (``ScheduledRequest`` has it)."""

    @property
    def req_id(self) -> str: ...

    @property
    def loaded_tokens(self) -> int: ...

    @property
    def load_async(self) -> bool: ...


R = TypeVar("R", bound=LoadedRequest)


def synchronous_loads(step: Iterable[R]) -> list[R]:
    """This step's requests read after each layer's ``wait_for_layer_load``: loaded synchronously."""
    return [request for request in step if request.loaded_tokens > 0 and not request.load_async]


def asynchronous_loads(step: Iterable[R], received: Iterable[str]) -> tuple[list[R], list[str]]:
    """This step's asynchronously loaded requests: those the connector reported received (read when
    the step binds its metadata) and the ids of those it did not (never read: refused)."""
    done = set(received)
    loaded = [request for request in step if request.loaded_tokens > 0 and request.load_async]
    return ([request for request in loaded if request.req_id in done],
            [request.req_id for request in loaded if request.req_id not in done])


def received_loads(step: Sequence[R], received: Iterable[str], wrapper: str) -> list[R]:
    """:func:`asynchronous_loads`' ready requests; ``NotReceived`` (one line) when a request is
    computed before the connector reported its load received."""
    ready, missing = asynchronous_loads(step, received)
    if missing:
        raise NotReceived(f"{wrapper}: request {missing[0]} is computed before its connector reported its "
                          f"asynchronous load received (finished_recving); its loaded KV is not read half loaded")
    return ready


class NotReceived(RuntimeError):
    """An asynchronously loaded request is computed before its connector reported it received
    (raised inside vLLM: the engine stops, as for every malformed wrapper state)."""

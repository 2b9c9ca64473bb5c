"""When the wrappers read what a connector loaded (:mod:`qualify.engines.connector_loads`): a
synchronous load after each layer's ``wait_for_layer_load``, an asynchronous one when the step that
first computes the request binds its metadata, and only once the connector reported it received.
(The wrappers in real vLLM engines: tests/vllm/test_connector_nixl.py.)"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from qualify.engines.connector_loads import NotReceived, asynchronous_loads, received_loads, synchronous_loads


@dataclass(frozen=True)
class Scheduled:
    req_id: str
    loaded_tokens: int
    load_async: bool = False


SYNC = Scheduled("sync", 1920)
ASYNC = Scheduled("async", 2048, load_async=True)
COLD = Scheduled("cold", 0)
COLD_ASYNC = Scheduled("cold-async", 0, load_async=True)


def test_a_synchronous_load_is_read_after_each_layer_and_an_asynchronous_one_is_not() -> None:
    assert synchronous_loads([SYNC, ASYNC, COLD, COLD_ASYNC]) == [SYNC]


def test_an_asynchronous_load_is_read_once_reported_received() -> None:
    assert asynchronous_loads([SYNC, ASYNC, COLD, COLD_ASYNC], {"async"}) == ([ASYNC], [])
    assert received_loads([SYNC, ASYNC], ["async", "another"], "Wrapper") == [ASYNC]


def test_a_request_that_claimed_nothing_is_never_read() -> None:
    assert asynchronous_loads([COLD, COLD_ASYNC], set()) == ([], [])
    assert received_loads([COLD, COLD_ASYNC, SYNC], [], "Wrapper") == []


def test_an_asynchronous_load_computed_before_it_was_reported_received_is_refused_not_read() -> None:
    assert asynchronous_loads([ASYNC], {"other"}) == ([], ["async"])
    with pytest.raises(NotReceived) as refused:
        received_loads([ASYNC], {"other"}, "ObservingConnector")
    assert "\n" not in str(refused.value) and "async" in str(refused.value)

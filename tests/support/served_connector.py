"""A KV connector with a prefill/decode handshake, for the served-pair tests
(``tests/vllm/test_served_pair.py``): vLLM's ExampleConnector (KV saved to and loaded from a shared
directory) behind the handshake NIXL uses, so a served pair of it can be calibrated and qualified
on this CPU build without ``nixl``.

* A request carrying ``kv_transfer_params {"do_remote_decode": true}`` (the prefill request a
  disaggregated-prefill proxy sends) saves its prompt's KV, loads none, and returns
  ``{"do_remote_prefill": true}`` as its ``kv_transfer_params``.
* A request carrying ``{"do_remote_prefill": true}`` (the decode request, with what the prefill
  returned) loads the prompt's saved KV.
* Any other request (a cold recompute) neither saves nor loads: unlike ExampleConnector, whose
  every request saves and loads whatever the store holds, the decode server can recompute cold as
  often as it is asked.

Loaded by vLLM from its module path (``kv_connector_module_path: tests.support.served_connector``,
``kv_connector: HandshakeExampleConnector``); the server starts in the repository root.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector


class HandshakeExampleConnector(ExampleConnector):
    """ExampleConnector that saves only for a prefill request and loads only into its decode request."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._saving: set[str] = set()

    @staticmethod
    def _params(request: Any) -> dict[str, Any]:
        params = getattr(request, "kv_transfer_params", None)
        return params if isinstance(params, dict) else {}

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = self._params(request)
        if params.get("do_remote_decode"):
            self._saving.add(request.request_id)
        if not params.get("do_remote_prefill"):
            return 0, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        # Only the new requests that load (a decode) or save (a prefill) reach ExampleConnector's
        # bookkeeping; the scheduler's output itself is left as it is.
        kept = [new for new in scheduler_output.scheduled_new_reqs
                if new.req_id in self._requests_need_load or new.req_id in self._saving]
        return super().build_connector_meta(dataclasses.replace(scheduler_output, scheduled_new_reqs=kept))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._saving.discard(request.request_id)
        if self._params(request).get("do_remote_decode"):
            return False, {"do_remote_prefill": True, "do_remote_decode": False}
        return False, None

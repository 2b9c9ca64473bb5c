"""Producer factories with a vLLM connector fault built in (``RunOptions.engine_factory`` /
``--engine-factory module:function``), for self-tests and operators.

Each builds the lane's real producer with one fault of
:data:`qualify.engines.vllm_connector.CONNECTOR_FAULTS` (or ``other-prompt``, the engine's own
fault) switched on; the handoff is sealed and authenticated as an honest one, so only the
harness's comparison can catch it.
"""

from __future__ import annotations

from qualify.contract.lanes import ProducerMode
from qualify.engines.base import LaneEngine
from qualify.engines.factory import build_producer


def build_k_bit_flip_producer(lane: str, mode: ProducerMode) -> LaneEngine:
    """One bit of one exported K element flipped."""
    return build_producer(lane, mode, vllm_fault="k-bit-flip")


def build_block_order_producer(lane: str, mode: ProducerMode) -> LaneEngine:
    """Two exported blocks read from the page table in each other's place."""
    return build_producer(lane, mode, vllm_fault="block-order")


def build_other_prompt_producer(lane: str, mode: ProducerMode) -> LaneEngine:
    """The KV of another held-out prompt, handed off for this one."""
    return build_producer(lane, mode, vllm_fault="other-prompt")


def build_raising_producer(lane: str, mode: ProducerMode) -> LaneEngine:
    """A connector that raises while saving a long request (an engine failing mid-request)."""
    return build_producer(lane, mode, vllm_fault="raise")

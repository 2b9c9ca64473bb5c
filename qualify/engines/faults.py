"""Fault lanes: deliberate producer faults, selectable by name, for self-tests and operators.

Each fault corrupts what a producer hands off in one way real disaggregated serving has broken,
after the producer computed it and before it is sealed, so the MAC verifies (a compromised or
buggy producer signs what it sends) and only the harness's comparison can catch it. ``other-mode``
instead runs the producer in the other producer mode, which the consumer refuses on its cache
identity before any decode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from qualify.core.errors import Refused
from qualify.core.kv import KVCache
from qualify.core.numerics import cos_sin
from qualify.engines.base import DecodeResult, LaneEngine, ModelGeometry

# Where single-site faults land; chosen once, before any run, and named in every report.
FAULT_LAYER = 2
FAULT_HEAD = 1
FAULT_POSITION = 1000
FAULT_DIM = 5
# Positions per block for the block-order fault (vLLM's CPU block size is 128).
BLOCK_POSITIONS = 128
SWAPPED_BLOCKS = (3, 4)
# V scale for the bound-breaking fault, chosen on the default lane (nvfp4-native-w4a4) as the
# smallest of 1.005, 1.01, 1.02, 1.03, 1.05 that breaks its sealed bounds: at 1.02 the full-logit
# max delta is 1.2898 against the sealed 1.28 while all 256 tokens stay exact (1.01 gave 1.2256).
V_SCALE_FACTOR = 1.02
V_SCALE_NOTE = f"layer {FAULT_LAYER} V scaled by {V_SCALE_FACTOR}"


@dataclass(frozen=True)
class Fault:
    """A named fault: which rungs it applies to, what it does, and where a report must point."""

    name: str
    rungs: tuple[int, ...]
    description: str
    expect: str


FAULTS: dict[str, Fault] = {
    fault.name: fault
    for fault in (
        Fault("kv-ulp", (3,), f"one K element at layer {FAULT_LAYER} nudged by one ULP",
              f"layer {FAULT_LAYER} K"),
        Fault("rope-offset", (2,), "keys rotated with RoPE positions offset by one", "layer 0 K"),
        Fault("block-order", (2,), f"K blocks {SWAPPED_BLOCKS} of {BLOCK_POSITIONS} positions handed off "
              "in each other's place while V blocks stay (K and V block tables disagree)",
              f"positions {SWAPPED_BLOCKS[0] * BLOCK_POSITIONS}..{(SWAPPED_BLOCKS[1] + 1) * BLOCK_POSITIONS - 1}"),
        Fault("other-prompt", (2,), "KV of another held-out prompt", "position 0"),
        Fault("v-scale", (2,), V_SCALE_NOTE, f"layer {FAULT_LAYER} V"),
        Fault("other-mode", (2, 3), "a cache entry from the other producer mode (its cache identity)",
              "cache identity"),
    )
}


def fault_named(name: str) -> Fault:
    """The fault called ``name``; unknown names are refused."""
    if name not in FAULTS:
        raise Refused(f"fault: unknown name {name!r}; expected one of {', '.join(sorted(FAULTS))}")
    return FAULTS[name]


def nudge_one_ulp(kv: KVCache) -> KVCache:
    """One K element at (FAULT_LAYER, FAULT_HEAD, FAULT_POSITION, FAULT_DIM) moved by one ULP."""
    keys = [k.copy() for k in kv.keys]
    position = min(FAULT_POSITION, keys[FAULT_LAYER].shape[1] - 1)
    element = keys[FAULT_LAYER][FAULT_HEAD, position, FAULT_DIM]
    keys[FAULT_LAYER][FAULT_HEAD, position, FAULT_DIM] = np.nextafter(element, np.float32(np.inf))
    return KVCache(keys, kv.values, draft=kv.draft, meta=kv.meta)


def rotate_keys_one_position(kv: KVCache, rope_theta: float) -> KVCache:
    """Keys as if RoPE had used position p+1 for token p (rotate_half layout, every layer)."""
    head_dim = kv.keys[0].shape[-1]
    inv_freq = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    angle = np.concatenate([inv_freq, inv_freq])  # one position's rotation per dim: [head_dim]
    cos, sin = cos_sin(angle.astype(np.float32))  # machine-independent bits
    half = head_dim // 2

    def rotate(k: np.ndarray) -> np.ndarray:  # k: [kv_heads, positions, head_dim]
        rotated_half = np.concatenate([-k[..., half:], k[..., :half]], axis=-1)
        return np.ascontiguousarray(k * cos + rotated_half * sin, dtype=np.float32)

    return KVCache([rotate(k) for k in kv.keys], kv.values, draft=kv.draft, meta=kv.meta)


def swap_blocks(kv: KVCache) -> KVCache:
    """Two K blocks handed off in each other's place while V stays: the K and V block tables
    disagree. (Swapping K and V blocks together only permutes whole key/value pairs, which
    attention cannot see, since each key carries its own RoPE rotation.)"""
    first, second = (b * BLOCK_POSITIONS for b in SWAPPED_BLOCKS)

    def swapped(t: np.ndarray) -> np.ndarray:  # t: [kv_heads, positions, head_dim]
        out = t.copy()
        out[:, first:first + BLOCK_POSITIONS] = t[:, second:second + BLOCK_POSITIONS]
        out[:, second:second + BLOCK_POSITIONS] = t[:, first:first + BLOCK_POSITIONS]
        return out

    return KVCache([swapped(k) for k in kv.keys], kv.values, draft=kv.draft, meta=kv.meta)


def scale_one_layer_v(kv: KVCache) -> KVCache:
    """Layer FAULT_LAYER's V multiplied by V_SCALE_FACTOR."""
    values = [v.copy() for v in kv.values]
    values[FAULT_LAYER] = (values[FAULT_LAYER] * np.float32(V_SCALE_FACTOR)).astype(np.float32)
    return KVCache(kv.keys, values, draft=kv.draft, meta=kv.meta)


def kv_transform(name: str, rope_theta: float) -> Callable[[KVCache], KVCache] | None:
    """The KV corruption a fault applies after prefill; None for faults applied elsewhere."""
    fault_named(name)
    return {
        "kv-ulp": nudge_one_ulp,
        "rope-offset": lambda kv: rotate_keys_one_position(kv, rope_theta),
        "block-order": swap_blocks,
        "v-scale": scale_one_layer_v,
    }.get(name)


OTHER_PROMPT = "prose-email-architecture"


class FaultInjectingEngine:
    """The honest producer's engine (name, version, ABI, geometry, decode) whose prefill runs
    ``prefill_engine`` and then applies one named fault to the KV it hands off."""

    def __init__(self, honest: LaneEngine, fault: str, prefill_engine: LaneEngine) -> None:
        self.honest = honest
        self.fault = fault
        self.prefill_engine = prefill_engine
        self._transform = kv_transform(fault, honest.geometry.rope_theta)

    @property
    def name(self) -> str:
        return self.honest.name

    @property
    def version(self) -> str:
        return self.honest.version

    @property
    def abi(self) -> str:
        return self.honest.abi

    @property
    def logit_units(self) -> str:
        return self.honest.logit_units

    @property
    def geometry(self) -> ModelGeometry:
        return self.honest.geometry

    def prefill(self, tokens: np.ndarray) -> KVCache:
        if self.fault == "other-prompt":
            from qualify.core.assets import load_prompt

            tokens = load_prompt(OTHER_PROMPT)[: len(tokens)]
        kv = self.prefill_engine.prefill(tokens)
        return self._transform(kv) if self._transform is not None else kv

    def decode(self, kv: KVCache, pending: np.ndarray, n: int) -> DecodeResult:
        return self.honest.decode(kv, pending, n)

    def teacher_forced(self, kv: KVCache, pending: np.ndarray, forced: np.ndarray) -> np.ndarray:
        return self.honest.teacher_forced(kv, pending, forced)


def faulty_producer(engine: LaneEngine, name: str, other_mode_engine: LaneEngine | None = None) -> LaneEngine:
    """A producer whose handoffs carry the fault ``name``; everything else is ``engine``'s (name,
    version, ABI, geometry, digests, mode and cache identity), so it starts, seals and
    authenticates exactly as an honest one would. ``other-mode`` needs the lane's engine built in
    the other producer mode: the entry is made there and carries that mode's cache identity,
    while the producer passes its start checks as the declared mode."""
    fault_named(name)
    if (name == "other-mode") != (other_mode_engine is not None):
        raise Refused("fault other-mode: needs the lane's engine built in the other producer mode")
    made_by = other_mode_engine if other_mode_engine is not None else engine
    return replace(engine, engine=FaultInjectingEngine(engine, name, made_by),
                   target_cache_identity_sha256=made_by.target_cache_identity_sha256)

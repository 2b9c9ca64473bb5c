"""Fault lanes: deliberate producer faults, selectable by name, for self-tests and operators.

Each fault corrupts what a producer hands off in one way real disaggregated serving has broken,
after the producer computed it and before it is sealed, so the MAC verifies (a compromised or
buggy producer signs what it sends) and only the harness's comparison can catch it. ``other-mode``
instead runs the producer in the other producer mode, which the consumer refuses on its cache
identity before any decode.

A fault is named by a bare name (:data:`FAULTS`, what the self-test runs) or as ``NAME=VALUE``
with a magnitude (:data:`FAULT_CLASSES`: ``v-scale=1.001``, ``kv-ulp=16``, ``head-swap=64``),
where a larger value is a larger fault; :func:`fault_named` is the one place either is checked.
"""

from __future__ import annotations

import re
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
# Where block-swap=N's first span starts: block-order's first block, so block-swap=128 is block-order.
BLOCK_SWAP_START = SWAPPED_BLOCKS[0] * BLOCK_POSITIONS
# The KV heads head-swap=N exchanges (layer FAULT_LAYER).
SWAPPED_HEADS = (FAULT_HEAD, FAULT_HEAD + 1)
# Seed of the order in which kv-ulp=N picks its elements after the kv-ulp site (fixed, so a larger
# N nudges a superset of a smaller one's elements).
KV_ULP_SEED = 20261201
# V scale of the bare v-scale fault (the self-test's), chosen on an earlier engine as the smallest
# of 1.005, 1.01, 1.02, 1.03, 1.05 that broke the default lane's sealed bounds. On the current
# engines (abi 3) the default lane's full-logit max delta at 1.02 is 1.3017 against the sealed
# 1.2786, all 256 tokens exact; docs/detection-power.md gives the smallest scale each rule catches.
V_SCALE_FACTOR = 1.02
V_SCALE_NOTE = f"layer {FAULT_LAYER} V scaled by {V_SCALE_FACTOR}"


@dataclass(frozen=True)
class Fault:
    """A fault as named: which rungs the self-test runs it at, what it does, where a report must
    point; ``kind`` is its class (the name without ``=VALUE``) and ``value`` its magnitude (None
    for a fault without one)."""

    name: str
    rungs: tuple[int, ...]
    description: str
    expect: str
    kind: str
    value: float | None = None


@dataclass(frozen=True)
class FaultClass:
    """A fault with a magnitude, named ``NAME=VALUE``: the VALUE's meaning and range (a larger
    value is a larger fault), and its description and report site for a value."""

    name: str
    rungs: tuple[int, ...]
    meaning: str
    minimum: float
    maximum: float
    whole: bool
    describe: Callable[[float], str]
    expect: Callable[[float], str]

    @property
    def expected(self) -> str:
        """The accepted values in words, for a refusal."""
        kind = "a whole number" if self.whole else "a number"
        return f"{kind} from {value_text(self.minimum)} to {value_text(self.maximum)} ({self.meaning})"


def value_text(value: float) -> str:
    """A fault value as a name writes it: whole numbers without a fraction, others as Python's
    shortest round-tripping repr (``1.001``), so the text parses back to the same value."""
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def _swap_span(value: float) -> str:
    n = int(value)
    return f"positions {BLOCK_SWAP_START}..{BLOCK_SWAP_START + 2 * n - 1}"


FAULT_CLASSES: dict[str, FaultClass] = {
    fault.name: fault
    for fault in (
        FaultClass("v-scale", (2,), f"F: layer {FAULT_LAYER} V multiplied by F", 1.0000001, 2.0, False,
                   lambda f: f"layer {FAULT_LAYER} V scaled by {value_text(f)}", lambda f: f"layer {FAULT_LAYER} V"),
        FaultClass("k-scale", (2,), f"F: layer {FAULT_LAYER} K multiplied by F", 1.0000001, 2.0, False,
                   lambda f: f"layer {FAULT_LAYER} K scaled by {value_text(f)}", lambda f: f"layer {FAULT_LAYER} K"),
        FaultClass("kv-ulp", (3,), f"N: layer {FAULT_LAYER} K elements each nudged up by one ULP", 1, 65536, True,
                   lambda n: (f"one K element at layer {FAULT_LAYER} nudged by one ULP" if n == 1 else
                              f"{int(n)} K elements at layer {FAULT_LAYER} (the kv-ulp site, then seeded picks) "
                              "each nudged up by one ULP"),
                   lambda n: f"layer {FAULT_LAYER} K"),
        FaultClass("position-shift", (2,), "D: every key rotated by D more RoPE positions", 1e-06, 4096.0, False,
                   lambda d: ("keys rotated with RoPE positions offset by one" if d == 1 else
                              f"keys rotated with RoPE positions offset by {value_text(d)}"),
                   lambda d: "layer 0 K"),
        FaultClass("block-swap", (2,), f"N: two adjacent K spans of N positions from {BLOCK_SWAP_START} swapped, "
                   "V kept", 1, 512, True,
                   lambda n: (f"K spans of {int(n)} positions at {BLOCK_SWAP_START} and {BLOCK_SWAP_START + int(n)} "
                              "handed off in each other's place while V stays (K and V block tables disagree)"),
                   _swap_span),
        FaultClass("element-scale", (2,), f"F: one layer-{FAULT_LAYER} K element (the kv-ulp site) multiplied by F",
                   1.0000001, 1e6, False,
                   lambda f: f"one K element at layer {FAULT_LAYER} scaled by {value_text(f)}",
                   lambda f: f"layer {FAULT_LAYER} K"),
        FaultClass("last-position-scale", (2,), "F: every layer's K and V at the last handed-off position "
                   "multiplied by F", 1.0000001, 2.0, False,
                   lambda f: f"K and V of the last handed-off position scaled by {value_text(f)} in every layer",
                   lambda f: "the last handed-off position"),
        FaultClass("head-swap", (2,), f"N: layer {FAULT_LAYER} KV heads {SWAPPED_HEADS[0]} and {SWAPPED_HEADS[1]} "
                   "exchanged over the last N positions", 1, 4096, True,
                   lambda n: (f"layer {FAULT_LAYER} K and V of KV heads {SWAPPED_HEADS[0]} and {SWAPPED_HEADS[1]} "
                              f"exchanged over the last {int(n)} handed-off positions (all of them when fewer)"),
                   lambda n: f"layer {FAULT_LAYER} K and V"),
    )
}
"""Every fault with a magnitude, by class name; ``NAME=VALUE`` names one."""


def _bare(name: str, kind: str, value: float | None, rungs: tuple[int, ...], description: str, expect: str) -> Fault:
    return Fault(name, rungs, description, expect, kind, value)


FAULTS: dict[str, Fault] = {
    fault.name: fault
    for fault in (
        _bare("kv-ulp", "kv-ulp", 1, (3,), f"one K element at layer {FAULT_LAYER} nudged by one ULP",
              f"layer {FAULT_LAYER} K"),
        _bare("rope-offset", "position-shift", 1.0, (2,), "keys rotated with RoPE positions offset by one",
              "layer 0 K"),
        _bare("block-order", "block-swap", BLOCK_POSITIONS, (2,),
              f"K blocks {SWAPPED_BLOCKS} of {BLOCK_POSITIONS} positions handed off "
              "in each other's place while V blocks stay (K and V block tables disagree)",
              f"positions {SWAPPED_BLOCKS[0] * BLOCK_POSITIONS}..{(SWAPPED_BLOCKS[1] + 1) * BLOCK_POSITIONS - 1}"),
        _bare("other-prompt", "other-prompt", None, (2,), "KV of another held-out prompt", "position 0"),
        _bare("v-scale", "v-scale", V_SCALE_FACTOR, (2,), V_SCALE_NOTE, f"layer {FAULT_LAYER} V"),
        _bare("other-mode", "other-mode", None, (2, 3),
              "a cache entry from the other producer mode (its cache identity)", "cache identity"),
    )
}
"""The bare-named faults (what ``qualify selftest`` runs); ``rope-offset`` is ``position-shift=1``
and ``block-order`` is ``block-swap=128``, each with its own name and wording."""

# A plain decimal number: no sign, no whitespace, no underscores, no nan/inf (float() takes all of those).
_DECIMAL = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
_WHOLE = re.compile(r"[0-9]+")


def _names_expected() -> str:
    return (f"expected one of {', '.join(sorted(FAULTS))}, or NAME=VALUE with NAME one of "
            f"{', '.join(sorted(FAULT_CLASSES))}")


def fault_named(name: str) -> Fault:
    """The fault called ``name``: a bare name of :data:`FAULTS` or ``NAME=VALUE`` of
    :data:`FAULT_CLASSES` with VALUE in its range. Anything else is refused in one line naming
    the fault and what was expected."""
    if not isinstance(name, str):
        raise Refused(f"fault: found {name!r}, expected a fault name")
    if "=" not in name:
        if name in FAULTS:
            return FAULTS[name]
        if name in FAULT_CLASSES:
            kind = FAULT_CLASSES[name]
            raise Refused(f"fault {name}: needs a value, {name}=VALUE with VALUE {kind.expected}")
        raise Refused(f"fault: unknown name {name!r}; {_names_expected()}")
    kind_name, text = name.split("=", 1)
    if kind_name not in FAULT_CLASSES:
        if kind_name in FAULTS:
            raise Refused(f"fault {kind_name}: takes no value, found {name!r}; faults with a value are "
                          f"{', '.join(sorted(FAULT_CLASSES))}")
        raise Refused(f"fault: unknown name {kind_name!r} in {name!r}; {_names_expected()}")
    kind = FAULT_CLASSES[kind_name]
    pattern = _WHOLE if kind.whole else _DECIMAL
    value = float(text) if pattern.fullmatch(text) else None
    if value is None or not kind.minimum <= value <= kind.maximum:
        raise Refused(f"fault {kind_name}: found {text!r}, expected {kind.expected}")
    value = int(value) if kind.whole else value
    return Fault(f"{kind_name}={value_text(value)}", kind.rungs, kind.describe(value), kind.expect(value),
                 kind_name, value)


# --------------------------------------------------------------------------- the corruptions


def nudge_ulps(kv: KVCache, count: int = 1) -> KVCache:
    """``count`` elements of layer FAULT_LAYER's K each moved up by one ULP: first the element at
    (FAULT_HEAD, FAULT_POSITION, FAULT_DIM) (the position clamped to the last handed-off one), then
    elements in a fixed seeded order, so a larger count nudges a superset (all when it exceeds them)."""
    keys = [k.copy() for k in kv.keys]
    target = keys[FAULT_LAYER]
    heads, positions, dims = target.shape
    site = int(np.ravel_multi_index((FAULT_HEAD, min(FAULT_POSITION, positions - 1), FAULT_DIM), target.shape))
    order = np.random.default_rng(KV_ULP_SEED).permutation(heads * positions * dims)
    picked = np.concatenate([[site], order[order != site]])[:count]
    flat = target.reshape(-1)  # a view: target is a fresh C-contiguous copy
    flat[picked] = np.nextafter(flat[picked], np.array(np.inf, dtype=flat.dtype))
    return KVCache(keys, kv.values, draft=kv.draft, meta=kv.meta)


def rotate_keys(kv: KVCache, rope_theta: float, offset: float = 1.0) -> KVCache:
    """Keys as if RoPE had used position p+``offset`` for token p (rotate_half layout, every
    layer); a whole offset is a position-id off-by-N, a fractional one positions held imprecisely."""
    head_dim = kv.keys[0].shape[-1]
    inv_freq = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    angle = offset * np.concatenate([inv_freq, inv_freq])  # the rotation per dim: [head_dim]
    cos, sin = cos_sin(angle.astype(np.float32))  # machine-independent bits
    half = head_dim // 2

    def rotate(k: np.ndarray) -> np.ndarray:  # k: [kv_heads, positions, head_dim]
        rotated_half = np.concatenate([-k[..., half:], k[..., :half]], axis=-1)
        return np.ascontiguousarray(k * cos + rotated_half * sin, dtype=k.dtype)

    return KVCache([rotate(k) for k in kv.keys], kv.values, draft=kv.draft, meta=kv.meta)


def swap_blocks(kv: KVCache, span: int = BLOCK_POSITIONS) -> KVCache:
    """Two adjacent K spans of ``span`` positions from BLOCK_SWAP_START handed off in each other's
    place while V stays: the K and V block tables disagree. (Swapping K and V blocks together only
    permutes whole key/value pairs, which attention cannot see, since each key carries its own
    RoPE rotation.) A KV too short to hold both spans (a warm-up prefill) is handed off unchanged."""
    first, second = BLOCK_SWAP_START, BLOCK_SWAP_START + span
    if kv.keys[0].shape[1] < second + span:
        return kv

    def swapped(t: np.ndarray) -> np.ndarray:  # t: [kv_heads, positions, head_dim]
        out = t.copy()
        out[:, first:second] = t[:, second:second + span]
        out[:, second:second + span] = t[:, first:second]
        return out

    return KVCache([swapped(k) for k in kv.keys], kv.values, draft=kv.draft, meta=kv.meta)


def scale_layer(kv: KVCache, tensor: str, factor: float) -> KVCache:
    """Layer FAULT_LAYER's K (``tensor`` "k") or V ("v") multiplied by ``factor`` (as float32),
    kept in its dtype; every other tensor untouched."""
    if tensor not in ("k", "v"):
        raise Refused(f"scale_layer tensor: found {tensor!r}, expected 'k' or 'v'")
    chosen = kv.keys if tensor == "k" else kv.values
    scaled = list(chosen)
    original = scaled[FAULT_LAYER]
    scaled[FAULT_LAYER] = (original * np.float32(factor)).astype(original.dtype)
    keys, values = (scaled, kv.values) if tensor == "k" else (kv.keys, scaled)
    return KVCache(keys, values, draft=kv.draft, meta=kv.meta)


def swap_heads(kv: KVCache, positions: int) -> KVCache:
    """Layer FAULT_LAYER's K and V of KV heads SWAPPED_HEADS exchanged over the last ``positions``
    positions (all of them when fewer are handed off): the head order of a tensor-parallel shard
    read in another order than it was written."""
    first, second = SWAPPED_HEADS
    keys, values = list(kv.keys), list(kv.values)
    for tensors in (keys, values):
        original = tensors[FAULT_LAYER]
        start = max(0, original.shape[1] - positions)
        out = original.copy()
        out[first, start:] = original[second, start:]
        out[second, start:] = original[first, start:]
        tensors[FAULT_LAYER] = out
    return KVCache(keys, values, draft=kv.draft, meta=kv.meta)


def scale_element(kv: KVCache, factor: float) -> KVCache:
    """The one K element of :func:`nudge_ulps`' site (layer FAULT_LAYER, head FAULT_HEAD, position
    FAULT_POSITION clamped to the last handed-off one, dim FAULT_DIM) multiplied by ``factor``."""
    keys = list(kv.keys)
    target = keys[FAULT_LAYER].copy()
    site = (FAULT_HEAD, min(FAULT_POSITION, target.shape[1] - 1), FAULT_DIM)
    target[site] = (target[site] * np.float32(factor)).astype(target.dtype)
    keys[FAULT_LAYER] = target
    return KVCache(keys, kv.values, draft=kv.draft, meta=kv.meta)


def scale_last_position(kv: KVCache, factor: float) -> KVCache:
    """Every layer's K and V at the last handed-off position multiplied by ``factor``: the position
    a producer that wrote its final token's KV late, or from another step, gets wrong."""
    def scaled(t: np.ndarray) -> np.ndarray:  # t: [kv_heads, positions, head_dim]
        out = t.copy()
        out[:, -1] = (t[:, -1] * np.float32(factor)).astype(t.dtype)
        return out

    return KVCache([scaled(k) for k in kv.keys], [scaled(v) for v in kv.values], draft=kv.draft, meta=kv.meta)


def kv_transform(name: str, rope_theta: float) -> Callable[[KVCache], KVCache] | None:
    """The KV corruption the fault ``name`` applies after prefill; None for faults applied
    elsewhere (``other-prompt``, ``other-mode``)."""
    fault = fault_named(name)
    value = fault.value
    if value is None:
        return None
    transforms: dict[str, Callable[[KVCache], KVCache]] = {
        "v-scale": lambda kv: scale_layer(kv, "v", value),
        "k-scale": lambda kv: scale_layer(kv, "k", value),
        "kv-ulp": lambda kv: nudge_ulps(kv, int(value)),
        "position-shift": lambda kv: rotate_keys(kv, rope_theta, value),
        "block-swap": lambda kv: swap_blocks(kv, int(value)),
        "head-swap": lambda kv: swap_heads(kv, int(value)),
        "element-scale": lambda kv: scale_element(kv, value),
        "last-position-scale": lambda kv: scale_last_position(kv, value),
    }
    return transforms[fault.kind]


OTHER_PROMPT = "prose-email-architecture"


class FaultInjectingEngine:
    """The honest producer's engine (name, version, ABI, geometry, decode) whose prefill runs
    ``prefill_engine`` and then applies one named fault to the KV it hands off."""

    def __init__(self, honest: LaneEngine, fault: str, prefill_engine: LaneEngine) -> None:
        self.honest = honest
        self.fault = fault
        self.prefill_engine = prefill_engine
        self._kind = fault_named(fault).kind
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
        if self._kind == "other-prompt":
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
    fault = fault_named(name)
    if (fault.kind == "other-mode") != (other_mode_engine is not None):
        raise Refused("fault other-mode: needs the lane's engine built in the other producer mode")
    made_by = other_mode_engine if other_mode_engine is not None else engine
    return replace(engine, engine=FaultInjectingEngine(engine, name, made_by),
                   target_cache_identity_sha256=made_by.target_cache_identity_sha256)

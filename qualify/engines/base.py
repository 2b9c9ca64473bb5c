"""The interface every engine speaks, as producer and as consumer.

A qualification prompt of P tokens is split once: the producer prefills ``prompt[:h]`` and hands
off that KV; the consumer feeds the pending tokens ``prompt[h:]`` (at least one) and then decodes
greedily. The cold local recompute is the consumer's own ``prefill(prompt[:h])`` followed by the
same decode, so both branches run identical decode arithmetic and differ only in where the KV
came from.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from qualify.contract.lanes import LaneSpec, ProducerMode
from qualify.core.errors import Refused
from qualify.core.kv import KVCache, KVGeometry

ENGINE_VERSION = "0.1.0"
"""The harness engines' own version (reference, k-quant, speculative, torch-llama), which frozen
identities pin: it changes with a reviewed engine change, never with the harness's release version
(``qualify.__version__``, from git), so a new commit does not unpin every shipped identity."""


@dataclass(frozen=True)
class ModelGeometry:
    """Model shape facts a producer checks against the identity at start."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    rope_theta: float

    def kv_geometry(self, positions: int, dtype: str = "float32") -> KVGeometry:
        return KVGeometry(self.layers, self.kv_heads, self.head_dim, positions, dtype)


@dataclass
class DecodeResult:
    """Greedy decode output: ``tokens`` int32 [n]; ``logits`` float32 [n, vocab], row i scored
    the choice of tokens[i]. ``draft_trace`` (speculative lanes) is per step
    ``(proposed_tokens, accepted_count)``."""

    tokens: np.ndarray
    logits: np.ndarray
    draft_trace: list[tuple[tuple[int, ...], int]] | None = None
    seconds: float = 0.0
    meta: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    """Producer and consumer operations. ``logit_units`` names what ``logits`` are in:
    ``"raw"`` or a transform spec string such as ``"tanh-softcap:30.0"``."""

    # Read-only properties, so a plain class attribute and a delegating property both satisfy it.
    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...

    @property
    def abi(self) -> str: ...

    @property
    def logit_units(self) -> str: ...

    @property
    def geometry(self) -> ModelGeometry: ...

    def prefill(self, tokens: np.ndarray) -> KVCache:
        """KV of exactly ``tokens`` (positions 0..len-1) in the canonical layout."""
        ...

    def decode(self, kv: KVCache, pending: np.ndarray, n: int) -> DecodeResult:
        """Feed ``pending`` after ``kv``'s positions, then greedily generate ``n`` tokens."""
        ...

    def teacher_forced(self, kv: KVCache, pending: np.ndarray, forced: np.ndarray) -> np.ndarray:
        """Logits [len(forced), vocab]: row i scores position after pending + forced[:i]."""
        ...


@runtime_checkable
class Linear(Protocol):
    """One projection ``y[T, n_out] = x[T, n_in] @ W.T`` in some arithmetic (dense float32,
    NVFP4 exact a16-q8, a native variant, k-quant). Row t of ``y`` must depend only on row t of
    ``x`` for the exact arithmetics, so results do not depend on batch shape."""

    n_in: int
    n_out: int

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x: float32 [T, n_in] -> float32 [T, n_out]."""
        ...


def stacked_columns(projections: Sequence[Linear]) -> list[slice]:
    """Each projection's output columns once their outputs stand side by side (a projection's
    ``stack``: q/k/v or gate/up run as one)."""
    ends = np.cumsum([projection.n_out for projection in projections]).tolist()
    return [slice(end - projection.n_out, end) for projection, end in zip(projections, ends, strict=True)]


def check_tokens(tokens: np.ndarray, vocab: int, what: str) -> np.ndarray:
    """Refuse anything but a non-empty 1-D array of integer ids in 0..vocab-1; an int64 copy."""
    array = np.asarray(tokens)
    if array.ndim != 1 or array.size == 0:
        raise Refused(f"{what}: expected a non-empty 1-D token array, found shape {list(array.shape)}")
    if not np.issubdtype(array.dtype, np.integer):
        raise Refused(f"{what}: expected integer token ids, found dtype {array.dtype}")
    if array.min() < 0 or array.max() >= vocab:
        raise Refused(f"{what}: token ids must lie in 0..{vocab - 1}, "
                      f"found {int(array.min())}..{int(array.max())}")
    return array.astype(np.int64)


def check_finite_logits(engine_name: str, logits: np.ndarray) -> None:
    """Refuse decode logits [steps, vocab] holding NaN or infinity, naming the first bad step."""
    finite_rows = np.isfinite(logits).all(axis=1)
    if not finite_rows.all():
        raise Refused(f"{engine_name}: non-finite logits at decode step {int(np.argmin(finite_rows))}")


def finished_decode(engine_name: str, tokens: np.ndarray, logits: np.ndarray, *, began: float,
                    handed_off: int, pending_tokens: int) -> DecodeResult:
    """The end every plain decode loop shares: refuse non-finite logits, then the result with its
    wall time since ``began`` (``time.perf_counter``) and the handed-off and pending counts."""
    check_finite_logits(engine_name, logits)
    return DecodeResult(tokens=tokens, logits=logits, seconds=time.perf_counter() - began,
                        meta={"handed_off_positions": float(handed_off), "pending_tokens": float(pending_tokens)})


def check_decode_count(n: object) -> int:
    """Refuse a decode length that is not a positive integer."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise Refused(f"decode n: expected a positive integer, found {n!r}")
    return int(n)


class GreedyDecoder:
    """``decode`` and ``teacher_forced`` as two views of one loop, ``_run(kv, pending, steps,
    forced)`` (greedy when ``forced`` is None), so decode equals teacher forcing on its own
    tokens by construction. Engines mix this in and implement ``_run``."""

    geometry: ModelGeometry

    def _tokens(self, tokens: np.ndarray, what: str) -> np.ndarray:
        return check_tokens(tokens, self.geometry.vocab, what)

    def decode(self, kv: KVCache, pending: np.ndarray, n: int) -> DecodeResult:
        """Install ``kv``, feed ``pending``, then generate ``n`` greedy tokens (argmax, ties to
        the lowest id), keeping every full logit row."""
        return self._run(kv, pending, check_decode_count(n), forced=None)

    def teacher_forced(self, kv: KVCache, pending: np.ndarray, forced: np.ndarray) -> np.ndarray:
        """Logits [len(forced), vocab]: row i scores the position after pending + forced[:i]."""
        forced = self._tokens(forced, "forced tokens")
        return self._run(kv, pending, int(forced.size), forced=forced).logits

    def _run(self, kv: KVCache, pending: np.ndarray, steps: int, forced: np.ndarray | None
             ) -> DecodeResult:
        raise NotImplementedError


@runtime_checkable
class DraftingEngine(Protocol):
    """An engine whose handoffs carry a speculative draft's own KV beside the target's."""

    def draft_kv_geometry(self, positions: int) -> KVGeometry:
        """The draft context a handoff of ``positions`` target positions carries."""
        ...


@dataclass(frozen=True)
class LaneEngine:
    """One side of a lane as the factory built it: the engine plus the lane facts a handoff is
    checked against (mode, checkpoint digests, mode-separated cache identity, block granularity).

    It satisfies :class:`Engine` by explicit delegation. ``handoff_block_size`` is set on a
    producer that hands off whole blocks only (a lane with vLLM on either side): its ``prefill``
    keeps ``spec.handed_off_positions`` of the positions and the consumer recomputes the rest.
    """

    engine: Engine
    spec: LaneSpec
    mode: ProducerMode
    digests: Mapping[str, str]
    target_cache_identity_sha256: str
    handoff_block_size: int | None = None

    def __post_init__(self) -> None:
        block = self.handoff_block_size
        if block is not None and self.spec.handed_off_positions(block + 1) != block:
            raise Refused(f"lane {self.spec.name}: handoff_block_size: found {block}, but the lane does not "
                          f"hand off whole blocks of {block}")

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def version(self) -> str:
        return self.engine.version

    @property
    def abi(self) -> str:
        return self.engine.abi

    @property
    def logit_units(self) -> str:
        return self.engine.logit_units

    @property
    def geometry(self) -> ModelGeometry:
        return self.engine.geometry

    def prefill(self, tokens: np.ndarray) -> KVCache:
        """The engine's KV of ``tokens``, cut to the whole blocks this producer hands off."""
        kv = self.engine.prefill(tokens)
        if self.handoff_block_size is None:
            return kv
        computed = kv.geometry.positions
        positions = self.spec.handed_off_positions(computed)
        if positions == 0:
            raise Refused(f"prefill: {computed} positions fill no whole block of {self.handoff_block_size}")
        if positions == computed:
            return kv  # as the engine made it (a vLLM export is whole blocks already)
        trimmed = KVCache([k[:, :positions].copy() for k in kv.keys],
                          [v[:, :positions].copy() for v in kv.values])
        trimmed.meta.update(kv.meta)
        return trimmed

    def decode(self, kv: KVCache, pending: np.ndarray, n: int) -> DecodeResult:
        return self.engine.decode(kv, pending, n)

    def teacher_forced(self, kv: KVCache, pending: np.ndarray, forced: np.ndarray) -> np.ndarray:
        return self.engine.teacher_forced(kv, pending, forced)

    def draft_kv_geometry(self, positions: int) -> KVGeometry | None:
        """The draft context a handoff of ``positions`` carries; None unless the engine drafts."""
        if isinstance(self.engine, DraftingEngine):
            return self.engine.draft_kv_geometry(positions)
        return None

"""The interface every engine speaks, as producer and as consumer.

A qualification prompt of P tokens is split once: the producer prefills ``prompt[:h]`` and hands
off that KV; the consumer feeds the pending tokens ``prompt[h:]`` (at least one) and then decodes
greedily. The cold local recompute is the consumer's own ``prefill(prompt[:h])`` followed by the
same decode, so both branches run identical decode arithmetic and differ only in where the KV
came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from qualify.core.errors import Refused
from qualify.core.kv import KVCache, KVGeometry


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

    name: str
    version: str
    abi: str
    logit_units: str
    geometry: ModelGeometry

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

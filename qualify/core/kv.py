"""The canonical KV layout every engine produces and every consumer installs.

Per layer, K (post-RoPE) and V as C-contiguous arrays shaped ``[kv_heads, positions, head_dim]``
in the dtype named by the geometry. Tensor names on the wire are ``layers.{i}.k`` and
``layers.{i}.v`` in layer order; a speculative draft's own context (rung 3 only) travels beside
it as ``draft.layers.{i}.k`` / ``draft.layers.{i}.v``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class KVGeometry:
    """What a consumer checks before installing: it must equal its own model's geometry."""

    layers: int
    kv_heads: int
    head_dim: int
    positions: int
    dtype: str

    def as_dict(self) -> dict[str, int | str]:
        return {
            "layers": self.layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "positions": self.positions,
            "dtype": self.dtype,
        }


@dataclass
class KVCache:
    """K and V per layer in the canonical layout; ``draft`` carries a draft model's own KV."""

    keys: list[np.ndarray]
    values: list[np.ndarray]
    draft: KVCache | None = None
    # Free-form phase timings or notes an engine attaches (e.g. producer compute seconds).
    meta: dict[str, float] = field(default_factory=dict)

    @property
    def geometry(self) -> KVGeometry:
        first = self.keys[0]
        kv_heads, positions, head_dim = first.shape
        return KVGeometry(len(self.keys), kv_heads, head_dim, positions, str(first.dtype))

    def tensors(self, prefix: str = "") -> dict[str, np.ndarray]:
        """Name -> array in wire order (layer by layer, K before V; draft context last)."""
        named: dict[str, np.ndarray] = {}
        for index, (key, value) in enumerate(zip(self.keys, self.values, strict=True)):
            named[f"{prefix}layers.{index}.k"] = key
            named[f"{prefix}layers.{index}.v"] = value
        if self.draft is not None:
            named.update(self.draft.tensors(prefix=f"{prefix}draft."))
        return named

    @classmethod
    def from_tensors(cls, named: dict[str, np.ndarray]) -> KVCache:
        """Inverse of :meth:`tensors`; the caller has already verified names and digests."""
        target = {k: v for k, v in named.items() if not k.startswith("draft.")}
        draft = {k[len("draft."):]: v for k, v in named.items() if k.startswith("draft.")}
        layers = len(target) // 2
        keys = [np.ascontiguousarray(target[f"layers.{i}.k"]) for i in range(layers)]
        values = [np.ascontiguousarray(target[f"layers.{i}.v"]) for i in range(layers)]
        return cls(keys, values, draft=cls.from_tensors(draft) if draft else None)


def first_non_finite(kv: KVCache) -> str | None:
    """The wire name of the first tensor of ``kv`` (draft context included) holding a NaN or an
    infinity, or None: no consumer installs such a KV (:func:`check_kv_fits`)."""
    return next((name for name, array in kv.tensors().items() if not np.isfinite(array).all()), None)


def check_kv_fits(kv: KVCache, layers: int, kv_heads: int, head_dim: int, max_positions: int,
                  extra_positions: int) -> int:
    """Refuse (one line naming the tensor) a KV a consumer cannot install: wrong layer count,
    not float32, a shape other than [kv_heads, positions, head_dim], non-finite values, or no room
    for ``extra_positions`` more within ``max_positions``. Returns the position count."""
    from qualify.core.errors import Refused

    if not isinstance(kv, KVCache) or len(kv.keys) != layers or len(kv.values) != layers:
        found = (len(kv.keys), len(kv.values)) if isinstance(kv, KVCache) else type(kv).__name__
        raise Refused(f"kv: expected {layers} layers of K and V, found {found}")
    positions = None
    for index in range(layers):
        for kind, array in (("k", kv.keys[index]), ("v", kv.values[index])):
            where = f"kv: layers.{index}.{kind}"
            if not isinstance(array, np.ndarray) or array.dtype != np.float32:
                found_dtype = array.dtype if isinstance(array, np.ndarray) else type(array).__name__
                raise Refused(f"{where}: expected float32, found {found_dtype}")
            if positions is None and array.ndim == 3:
                positions = int(array.shape[1])  # layer 0's K sets the position count for all
            if array.ndim != 3 or array.shape != (kv_heads, positions, head_dim):
                raise Refused(f"{where}: shape {list(array.shape)}, expected [{kv_heads}, "
                              f"{positions if positions is not None else 'positions'}, {head_dim}]")
            if not np.isfinite(array).all():
                raise Refused(f"{where}: non-finite values")
    assert positions is not None
    if extra_positions < 0 or positions + extra_positions > max_positions:
        raise Refused(f"kv: {positions} positions plus {extra_positions} to feed exceed "
                      f"max_positions {max_positions}")
    return positions

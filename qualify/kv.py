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
    draft: "KVCache | None" = None
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
    def from_tensors(cls, named: dict[str, np.ndarray]) -> "KVCache":
        """Inverse of :meth:`tensors`; the caller has already verified names and digests."""
        target = {k: v for k, v in named.items() if not k.startswith("draft.")}
        draft = {k[len("draft."):]: v for k, v in named.items() if k.startswith("draft.")}
        layers = len(target) // 2
        keys = [np.ascontiguousarray(target[f"layers.{i}.k"]) for i in range(layers)]
        values = [np.ascontiguousarray(target[f"layers.{i}.v"]) for i in range(layers)]
        return cls(keys, values, draft=cls.from_tensors(draft) if draft else None)

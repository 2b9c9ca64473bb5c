"""The EAGLE-1 draft head (rung 3): one Llama decoder layer that guesses the target's next hidden
state, so the target can verify several guessed tokens in one forward.

Trained by ``tools/train_model.py`` (class ``Draft``). Draft position t reads

    u_t   = fc([embed(token t+1), h_t])        # [2 * hidden] -> [hidden]; h_t is the target's
                                               # last hidden state at t, before the final norm
    ĥ_t+1 = DecoderLayer(u)_t                  # own K/V, RoPE at position t, causal over 0..t
    token t+2 proposal = argmax(lm_head(final_norm(ĥ_t+1)))   # the target's own norm and head

When proposing several tokens, a guessed hidden state stands in for the unknown h (EAGLE-1's
feature feedback): position t+1 reads (embed(proposal t+2), ĥ_t+1). Rows with guessed inputs are
never kept: after the target verifies, the draft re-runs accepted positions with the target's true
hidden states, so its KV only ever holds true-input rows.

The layer, norms, RoPE and attention are the reference engine's (``DecoderLayer`` with prefix
``layer.``); projections come from a ``make_linear`` factory (dense float32 from
``draft.safetensors``, or the k-quant lane's Q8_0 from GGUF).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from qualify.core.errors import Refused
from qualify.core.kv import KVCache
from qualify.engines.base import ModelGeometry
from qualify.engines.checkpoint import check_tensors
from qualify.engines.kquant import decode_rows
from qualify.engines.reference import (
    DecodeCache,
    DecoderLayer,
    KeepFloat32,
    MakeLinear,
    arithmetic_kind,
    dense_linear,
)

DRAFT_FILE = "draft.safetensors"
LAYER_PREFIX = "layer."


def draft_tensor_shapes(geometry: ModelGeometry, intermediate: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the EAGLE-1 draft checkpoint, by name, with its shape."""
    hidden, attn_width = geometry.hidden, geometry.heads * geometry.head_dim
    kv_width = geometry.kv_heads * geometry.head_dim
    return {
        "fc.weight": (hidden, 2 * hidden),
        "layer.input_layernorm.weight": (hidden,),
        "layer.self_attn.q_proj.weight": (attn_width, hidden),
        "layer.self_attn.k_proj.weight": (kv_width, hidden),
        "layer.self_attn.v_proj.weight": (kv_width, hidden),
        "layer.self_attn.o_proj.weight": (hidden, attn_width),
        "layer.post_attention_layernorm.weight": (hidden,),
        "layer.mlp.gate_proj.weight": (intermediate, hidden),
        "layer.mlp.up_proj.weight": (intermediate, hidden),
        "layer.mlp.down_proj.weight": (hidden, intermediate),
    }


def check_draft_weights(weights: dict[str, np.ndarray], geometry: ModelGeometry, intermediate: int,
                        source: str) -> None:
    """The draft's tensors, checked with :func:`check_tensors` against its geometry."""
    check_tensors(weights, draft_tensor_shapes(geometry, intermediate), source)


def load_draft_safetensors(path: Path, geometry: ModelGeometry, intermediate: int) -> dict[str, np.ndarray]:
    """The draft's float32 weights (float16 widened exactly) from ``draft.safetensors``, checked."""
    from safetensors.numpy import load_file

    path = Path(path)
    if not path.is_file():
        raise Refused(f"{path}: file: missing")
    try:
        stored = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types, plus OSError/ValueError
        raise Refused(f"{path}: file: unreadable safetensors ({type(exc).__name__})") from None
    weights: dict[str, np.ndarray] = {}
    for name, tensor in stored.items():
        if tensor.dtype not in (np.dtype(np.float16), np.dtype(np.float32)):
            raise Refused(f"{path}: {name}: dtype {tensor.dtype}, expected float16 or float32")
        weights[name] = np.ascontiguousarray(tensor, dtype=np.float32)
    check_draft_weights(weights, geometry, intermediate, str(path))
    return weights


class EagleDraft:
    """The EAGLE-1 draft head: ``fc`` plus one reference ``DecoderLayer`` with its own KV."""

    def __init__(self, weights: dict[str, np.ndarray], geometry: ModelGeometry, rms_norm_eps: float,
                 rope: tuple[np.ndarray, np.ndarray], make_linear: MakeLinear = dense_linear) -> None:
        intermediate = weights.get("layer.mlp.gate_proj.weight")
        if not isinstance(intermediate, np.ndarray) or intermediate.ndim != 2:
            raise Refused("draft weights: layer.mlp.gate_proj.weight: missing or not a matrix")
        check_draft_weights(weights, geometry, intermediate.shape[0], "draft weights")
        self.geometry = geometry
        self.fc = make_linear("fc.weight", weights["fc.weight"])  # [2 * hidden] -> [hidden]
        self.layer = DecoderLayer(weights, LAYER_PREFIX, geometry, rms_norm_eps, rope, make_linear,
                                  KeepFloat32())
        self.linear_kinds = sorted({arithmetic_kind(linear, "draft linear")
                                    for linear in (self.fc, *self.layer.linears)})

    def layer_inputs(self, next_embeddings: np.ndarray, hidden: np.ndarray) -> np.ndarray:
        """fc([embed(token t+1), h_t]): [R, hidden] + [R, hidden] -> [R, hidden]."""
        return self.fc(np.concatenate([next_embeddings, hidden], axis=1))

    def prefill(self, next_embeddings: np.ndarray, hidden: np.ndarray) -> KVCache:
        """Draft KV of positions 0..R-1 (row t: embedding of token t+1, target hidden at t) in the
        canonical layout: one layer, K post-RoPE and V [kv_heads, R, head_dim]."""
        _, keys, values = self.layer.prefill(self.layer_inputs(next_embeddings, hidden), need_output=False)
        return KVCache([keys], [values])

    def forward_rows(self, cache: DecodeCache, next_embeddings: np.ndarray, hidden: np.ndarray,
                     positions: np.ndarray) -> np.ndarray:
        """Append R rows at RoPE ``positions`` [R] to the draft cache (slots cache.length..) and
        return the predicted next hidden states ĥ [R, hidden] (before the final norm)."""
        start = cache.length
        if start + hidden.shape[0] > cache.capacity:
            raise Refused(f"draft cache: {hidden.shape[0]} rows after {start} exceed capacity {cache.capacity}")
        predicted = decode_rows(self.layer, self.layer_inputs(next_embeddings, hidden), positions,
                                cache.layers[0], start)
        cache.length = start + hidden.shape[0]
        return predicted

    def new_cache(self, draft_kv: KVCache, extra_positions: int) -> DecodeCache:
        """Install (copy) a handed-off draft KV with room for ``extra_positions`` more rows,
        refusing one whose layer count, dtype, shape or values do not fit this draft."""
        kv_heads, head_dim = self.geometry.kv_heads, self.geometry.head_dim
        if not isinstance(draft_kv, KVCache) or len(draft_kv.keys) != 1 or len(draft_kv.values) != 1:
            raise Refused("kv: draft: expected one layer of draft K and V")
        positions = None
        for kind, array in (("k", draft_kv.keys[0]), ("v", draft_kv.values[0])):
            where = f"kv: draft.layers.0.{kind}"
            if not isinstance(array, np.ndarray) or array.dtype != np.float32:
                found = array.dtype if isinstance(array, np.ndarray) else type(array).__name__
                raise Refused(f"{where}: expected float32, found {found}")
            positions = array.shape[1] if positions is None and array.ndim == 3 else positions
            if array.shape != (kv_heads, positions, head_dim):
                raise Refused(f"{where}: shape {list(array.shape)}, expected [{kv_heads}, {positions}, {head_dim}]")
            if not np.isfinite(array).all():
                raise Refused(f"{where}: non-finite values")
        assert positions is not None
        return DecodeCache.install(draft_kv, extra_positions)

"""The numpy reference engine: a Llama decoder (Hugging Face ``LlamaForCausalLM`` math), readable
top to bottom, deterministic bit for bit, and the harness's embedded default engine.

Model, per token row (shapes for the shipped model: hidden 256, 8 query heads, 4 KV heads,
head_dim 32, intermediate 512, vocab 4096):

    x = embed[token]                                   # [hidden], float16 weights upcast to float32
    for each layer:
        h = RMSNorm(x)                                 # float32, weight * x / sqrt(mean(x^2) + eps)
        q, k, v = Wq h, Wk h, Wv h                     # pluggable Linear (dense fixed-point by default)
        q, k, v = q + bq, k + bk, v + bv               # Qwen2 only: float32 biases
        q, k = RoPE(q), RoPE(k)                        # Hugging Face rotate_half layout
                                                       #   (inverse frequencies scaled for Llama 3.x)
        a = softmax(q k^T / sqrt(head_dim)) v          # grouped-query, causal, float32 softmax
        x = x + Wo a
        m = RMSNorm(x)
        x = x + Wdown(silu(Wgate m) * Wup m)           # SwiGLU
    logits = RMSNorm(x) @ head^T                       # embed (tied) or lm_head, always dense fixed-point

Two forward paths share the layer weights and arithmetic kinds but not reduction shapes:

* ``prefill`` is batched over positions (one matmul per projection, attention in query blocks),
  because it only produces KV and speed matters there;
* decode (``forward_rows``, used by ``decode`` and ``teacher_forced``) runs every new row through
  the whole model on its own, one step per token, so a speculative verifier that feeds k+1 rows
  at once, or a consumer that gets several pending tokens, reproduces plain one-token decode bit
  for bit.

``score_rows`` (the E2 controls' consumer side) is batched like prefill but keeps decode's
reduction shapes: row r is the decode step at position r after a handoff of r positions, bit for
bit, for every r at once.

Every contraction, sum and transcendental goes through ``qualify.core.numerics``, whose results
are exact by construction (integer contractions, fixed-order sums, elementwise polynomials): the
same bits on every x86-64 machine whatever BLAS kernel, thread count or numpy SIMD dispatch it
runs with (the tests compare them in subprocesses).

The ``materialize`` hook stands in for intermediates a fast producer stores in a narrower type.
It is applied, in both paths, to: the residual stream after each add, every RMSNorm output
(including the final norm), the attention probabilities, the attention output (before ``o_proj``)
and the SwiGLU product (before ``down_proj``). KV stays float32 (the canonical layout).
"""

from __future__ import annotations

import functools
import inspect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qualify.core import assets
from qualify.core.digests import sha256_bytes
from qualify.core.errors import Refused
from qualify.core.hostenv import check_ieee_environment
from qualify.core.kv import KVCache, check_kv_fits
from qualify.core.numerics import (
    LEFT_BITS,
    REDUCTION_CHUNK,
    FixedPointRows,
    cos_sin,
    exp,
    matmul_rows,
    power,
    tree_sum,
    weighted_sum,
    whole_rows_are_exact,
)
from qualify.engines.base import (
    ENGINE_VERSION,
    DecodeResult,
    GreedyDecoder,
    Linear,
    ModelGeometry,
    finished_decode,
    stacked_columns,
)
from qualify.engines.checkpoint import RopeScaling, check_weights, load_config, load_weights

# Bump whenever the numerics of this file change (op order, reduction shapes, block size, dtypes):
# the abi is part of every lane's cache identity, so old KV never aliases new arithmetic.
ABI_VERSION = "numpy-llama-abi-3"
# Prefill attention runs over query blocks of this many rows: scores for one block are
# [kv_heads, group, block, keys] float32 (~8 MB at 2047 positions) instead of the whole
# [heads, T, T] matrix, and keys after the block are never computed.
PREFILL_QUERY_BLOCK = 128
# Additive causal mask of one diagonal block: -inf where key > query, else 0 (adding 0 is exact).
CAUSAL_SQUARE = np.triu(np.full((PREFILL_QUERY_BLOCK, PREFILL_QUERY_BLOCK), -np.inf, dtype=np.float32), k=1)
CAUSAL_SQUARE.flags.writeable = False

Materialize = Callable[[np.ndarray], np.ndarray]
MakeLinear = Callable[[str, np.ndarray], Linear]


# --------------------------------------------------------------------------------------------
# Pluggable pieces: projections and materialization
# --------------------------------------------------------------------------------------------


def check_finite_activations(x: np.ndarray, what: str) -> None:
    """Refuse non-finite activations (a KV or residual that overflowed) before the fixed-point
    conversion, which has no image for them."""
    if not np.isfinite(x).all():
        raise Refused(f"{what}: activations contain non-finite values")


class DenseLinear:
    """The default projection: ``x @ W.T`` through the machine-independent :func:`matmul`."""

    kind = "dense-fixed-point-v1"

    def __init__(self, weight_f32: np.ndarray, name: str = "dense linear") -> None:
        weight = np.ascontiguousarray(weight_f32, dtype=np.float32)  # [n_out, n_in]
        self.n_out, self.n_in = weight.shape
        self.name = name
        self.weight_rows = FixedPointRows.of(weight)  # [n_out, n_in], converted once

    @classmethod
    def stack(cls, projections: Sequence[DenseLinear]) -> DenseLinear:
        """One projection over the rows of ``projections`` stacked: :func:`matmul_rows` converts
        each weight row on its own and each output column depends on its row alone, so every
        column has its own projection's bits. The projections' ``weight_rows`` become views of
        the stacked rows, so nothing is held twice."""
        stacked = cls.__new__(cls)
        stacked.name = " + ".join(projection.name for projection in projections)
        stacked.n_in, stacked.n_out = projections[0].n_in, sum(p.n_out for p in projections)
        stacked.weight_rows = FixedPointRows(np.concatenate([p.weight_rows.integers for p in projections]),
                                             np.concatenate([p.weight_rows.scale for p in projections]))
        for projection, own in zip(projections, stacked_columns(projections), strict=True):
            projection.weight_rows = stacked.weight_rows[(own,)]
        return stacked

    def __call__(self, x: np.ndarray) -> np.ndarray:
        check_finite_activations(x, self.name)
        return matmul_rows(x, self.weight_rows)  # [T, n_in] @ [n_in, n_out] -> [T, n_out]


class SharedInputProjections:
    """Projections that read the same input (q/k/v; gate/up), applied together. Where they are
    all of one class that can ``stack`` them (one projection whose output columns are theirs side
    by side, each column with its own projection's bits), they run as that one projection: one
    call instead of one per projection, and the input prepared once (a decode step is mostly
    per-call cost). Any other mix is called projection by projection."""

    def __init__(self, *projections: Linear) -> None:
        self.projections = projections
        self.stacked: Linear | None = None
        arithmetic = type(projections[0])
        stack = getattr(arithmetic, "stack", None)
        if len(projections) > 1 and callable(stack) and all(type(p) is arithmetic for p in projections) \
                and len({p.n_in for p in projections}) == 1:
            self.stacked = stack(projections)
            self.splits = [columns.stop for columns in stacked_columns(projections)[:-1]]

    def __call__(self, x: np.ndarray) -> list[np.ndarray]:
        if self.stacked is None:
            return [projection(x) for projection in self.projections]
        return np.split(self.stacked(x), self.splits, axis=-1)


def dense_linear(name: str, weight_f32: np.ndarray) -> DenseLinear:
    """The default ``make_linear`` factory: every projection dense (fixed-point contraction)."""
    return DenseLinear(weight_f32, name)


class KeepFloat32:
    """The default ``materialize`` hook: intermediates stay float32 (identity)."""

    kind = "f32"

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return x


class RoundTripFloat16:
    """A ``materialize`` hook that stores intermediates as float16, as an f16 fast producer does
    (values beyond float16's range become infinities, as they would there)."""

    kind = "f16-round-trip"

    def __call__(self, x: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Building blocks (pure functions, float32 in and out)
# --------------------------------------------------------------------------------------------


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: np.float32) -> np.ndarray:
    """x [T, hidden] -> weight * x / sqrt(mean(x^2) + eps), computed in float32 like HF."""
    mean_square = tree_sum(x * x) / np.float32(x.shape[-1])  # [T, 1]
    return weight * (x * (np.float32(1.0) / np.sqrt(mean_square + eps)))


def scaled_inverse_frequencies(inv_freq: np.ndarray, scaling: RopeScaling) -> np.ndarray:
    """Hugging Face's ``linear`` and ``llama3`` RoPE scaling of float32 inverse frequencies, or a
    GGUF's per-frequency factors, in float32 elementwise operations (each IEEE-rounded, so the same
    bits on every machine)."""
    f32 = np.float32
    factor = f32(scaling.factor)
    if scaling.rope_type == "frequency-factors":  # a GGUF's rope_freqs.weight, as llama.cpp divides by it
        return (inv_freq / np.asarray(scaling.frequency_factors, dtype=np.float32)).astype(np.float32)
    if scaling.rope_type == "linear":
        return inv_freq / factor
    low, high = f32(scaling.low_freq_factor), f32(scaling.high_freq_factor)
    old_context = f32(scaling.original_max_position_embeddings)
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = f32(2 * math.pi) / inv_freq
    # Long wavelengths (low frequencies) are divided by factor; short ones kept; between, blended.
    llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (f32(1) - smooth) * llama / factor + smooth * llama
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, llama).astype(np.float32)


def rope_tables(positions: int, head_dim: int, theta: float,
                scaling: RopeScaling | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [positions, head_dim] float32, angles laid out [f, f] (HF rotate_half layout);
    the inverse frequencies scaled when the model declares a RoPE scaling."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / power(float(np.float32(theta)), exponents)  # [head_dim / 2]
    if scaling is not None:
        inv_freq = scaled_inverse_frequencies(inv_freq, scaling)
    # One float32 product per angle, the same rounding as HF's float32 outer product.
    freqs = np.arange(positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    angles = np.concatenate([freqs, freqs], axis=-1)  # [positions, head_dim]
    return cos_sin(angles)


def rope_cache_sha256(theta: float, head_dim: int, max_positions: int, scaling: RopeScaling | None = None) -> str:
    """SHA-256 of :func:`rope_tables`: float32 little-endian cos then sin, ``[max_positions,
    head_dim]``. An identity pins it, and every run recomputes it on its host."""
    cos, sin = rope_tables(max_positions, head_dim, theta, scaling)
    return sha256_bytes(np.asarray(cos, dtype="<f4").tobytes() + np.asarray(sin, dtype="<f4").tobytes())


def rotate_half(x: np.ndarray) -> np.ndarray:
    """[..., head_dim]: (x1, x2) -> (-x2, x1), halves along the last axis."""
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate q or k ([..., head_dim]) by the angles of its positions (cos/sin broadcast)."""
    rotated: np.ndarray = x * cos + rotate_half(x) * sin
    return rotated


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x) as x / (1 + exp(-x)); exp overflow for x < -88 correctly gives -0."""
    with np.errstate(over="ignore"):
        return x / (np.float32(1.0) + exp(-x))


def softmax_(scores: np.ndarray) -> np.ndarray:
    """In-place float32 softmax over the last axis (max-subtracted; -inf entries become 0)."""
    scores -= scores.max(axis=-1, keepdims=True)
    if scores.flags.c_contiguous:
        exp(scores, out=scores)
    else:
        scores[...] = exp(scores)
    scores /= tree_sum(scores)
    return scores


def visible_tree_sum(x: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """x [..., rows, keys], visible [rows] -> [..., rows, 1]: row i's sum over its first visible[i]
    entries in exactly :func:`tree_sum`'s fixed pairwise order for that length (the entries after
    them are never read), so a causal block's rows get decode's softmax denominators bit for bit.

    Each level folds row i's entry j + half_i onto entry j (j < half_i, half_i = length_i // 2);
    an odd row's last entry moves to slot half_i as ``0 + x`` (exact). Rows differ only in half_i,
    so one gather per level serves them all."""
    lengths = np.asarray(visible, dtype=np.int64)  # [rows]
    rows = lengths.size
    while lengths.max(initial=0) > 1:
        half = lengths // 2  # [rows]
        lengths = lengths - half  # ceil(length / 2): the folded pairs plus an odd last entry
        width, keys = int(lengths.max()), x.shape[-1]
        slot = np.arange(width)[None, :]  # [1, width]
        # Slots past a row's new length read a clipped, meaningless partner: never read again.
        partner = np.minimum(slot + half[:, None], keys - 1)  # [rows, width]
        # One gather along the flattened [rows * keys] axis (faster than indexing two axes).
        flat = np.ascontiguousarray(x).reshape(-1, rows * keys)
        partners = np.take(flat, np.arange(rows)[:, None] * keys + partner, axis=1)
        kept = np.where(slot < half[:, None], x[..., :width], np.float32(0))
        x = kept + partners.reshape(*x.shape[:-1], width)
    return x[..., :1]


def weighted_sum_own_diagonal(probs: np.ndarray, past_value_rows: FixedPointRows,
                              own_value_rows: FixedPointRows, start: int) -> np.ndarray:
    """:func:`~qualify.core.numerics.weighted_sum` of a causal query block whose row i reads the
    handed-off values at keys 0..start+i-1 and its own value at key start+i: probs [kv, group,
    rows, keys], past values [kv, keys, hd], own values [kv, rows, hd] -> [kv, group, rows, hd].

    Bit for bit the decode row's ``weighted_sum`` over its own slots: the same folded row (the own
    value's scale at the diagonal), the same integers, the same REDUCTION_CHUNK-long exact partial
    sums (the own term joins the chunk holding key start+i) added left to right; the chunks past a
    row's keys add only zeros."""
    rows = probs.shape[-2]
    diagonal = np.arange(rows)
    scales = np.swapaxes(past_value_rows.scale, -1, -2)[:, None]  # [kv, 1, 1, keys]
    nonnegative = bool(probs.min(initial=0.0) >= 0)  # as weighted_sum: one pass fewer when true
    folded = np.multiply(probs, scales, dtype=np.float64)  # [kv, group, rows, keys], exact
    own_scales = own_value_rows.scale[:, None, :, 0]  # [kv, 1, rows]
    folded[..., diagonal, start + diagonal] = probs[..., diagonal, start + diagonal] * own_scales
    left = FixedPointRows.of(folded, LEFT_BITS, reuse=True, nonnegative=nonnegative)
    # Row i's terms are its integers here, the own weight at its diagonal included.
    one_product = whole_rows_are_exact(left.integers, nonnegative=nonnegative)
    own_weights = left.integers[..., diagonal, start + diagonal].copy()  # [kv, group, rows]
    left.integers[..., diagonal, start + diagonal] = 0  # the diagonal multiplies the own value
    own_terms = own_weights[..., None] * own_value_rows.integers[:, None]  # [kv, group, rows, hd], exact
    own_chunks = (start + diagonal) // REDUCTION_CHUNK  # the chunk each row's own key falls in
    kv_heads, group, _, keys = probs.shape
    left_rows = left.integers.reshape(kv_heads, group * rows, keys)  # one BLAS batch per KV head
    if one_product:
        # No partial sum of a row, its own term included, reaches 2^53: the chunked sum below is
        # the exact integer, and so is one product over every key plus the own term.
        total: np.ndarray = (left_rows @ past_value_rows.integers).reshape(kv_heads, group, rows, -1)
        total += own_terms
    else:
        chunk_totals = []
        for chunk, chunk_start in enumerate(range(0, keys, REDUCTION_CHUNK)):
            keys_in_chunk = slice(chunk_start, chunk_start + REDUCTION_CHUNK)
            partial = (left_rows[..., keys_in_chunk] @ past_value_rows.integers[:, keys_in_chunk]
                       ).reshape(kv_heads, group, rows, -1)
            in_chunk = own_chunks == chunk
            partial[..., in_chunk, :] += own_terms[..., in_chunk, :]  # integers below 2^52: exact
            chunk_totals.append(partial)
        total = np.asarray(functools.reduce(np.add, chunk_totals))  # left to right
    total *= left.scale  # exact: powers of two
    rounded: np.ndarray = total.astype(np.float32)
    return rounded


# --------------------------------------------------------------------------------------------
# One decoder layer
# --------------------------------------------------------------------------------------------


class DecoderLayer:
    """One Llama decoder layer (attention + SwiGLU MLP), with a batched prefill path and a
    single-row decode path. ``prefix`` is the layer's weight-name prefix, e.g.
    ``model.layers.0.`` (a draft head's own layer can reuse this with its prefix)."""

    def __init__(self, weights: dict[str, np.ndarray], prefix: str, geometry: ModelGeometry,
                 rms_norm_eps: float, rope: tuple[np.ndarray, np.ndarray],
                 make_linear: MakeLinear, materialize: Materialize) -> None:
        self.heads, self.kv_heads, self.head_dim = geometry.heads, geometry.kv_heads, geometry.head_dim
        self.group = self.heads // self.kv_heads  # query heads per KV head
        self.scale = np.float32(1.0 / math.sqrt(self.head_dim))
        self.eps = np.float32(rms_norm_eps)
        self.rope_cos, self.rope_sin = rope  # [max_positions, head_dim]
        self.materialize = materialize
        self.attention_norm = weights[prefix + "input_layernorm.weight"]  # [hidden]
        self.mlp_norm = weights[prefix + "post_attention_layernorm.weight"]  # [hidden]

        def linear(name: str) -> Linear:
            return make_engine_linear(make_linear, prefix + name, weights[prefix + name])

        self.q_proj = linear("self_attn.q_proj.weight")  # hidden -> heads * head_dim
        self.k_proj = linear("self_attn.k_proj.weight")  # hidden -> kv_heads * head_dim
        self.v_proj = linear("self_attn.v_proj.weight")  # hidden -> kv_heads * head_dim
        self.o_proj = linear("self_attn.o_proj.weight")  # heads * head_dim -> hidden
        self.gate_proj = linear("mlp.gate_proj.weight")  # hidden -> intermediate
        self.up_proj = linear("mlp.up_proj.weight")  # hidden -> intermediate
        self.down_proj = linear("mlp.down_proj.weight")  # intermediate -> hidden

        self.shared_qkv = SharedInputProjections(self.q_proj, self.k_proj, self.v_proj)
        self.gate_up = SharedInputProjections(self.gate_proj, self.up_proj)
        # Qwen2's Q/K/V biases [width] float32, added after each projection (None: a Llama).
        names = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
        self.qkv_bias = tuple(weights[prefix + name] for name in names) if prefix + names[0] in weights else None

    def qkv(self, h: np.ndarray) -> tuple[np.ndarray, ...]:
        """h [T, hidden] -> q [T, heads * hd], k and v [T, kv_heads * hd], biases added if any."""
        q, k, v = self.shared_qkv(h)
        if self.qkv_bias is None:
            return q, k, v
        return tuple(projected + bias for projected, bias in zip((q, k, v), self.qkv_bias, strict=True))

    @property
    def linears(self) -> list[Linear]:
        return [self.q_proj, self.k_proj, self.v_proj, self.o_proj,
                self.gate_proj, self.up_proj, self.down_proj]

    def _mlp_residual(self, x: np.ndarray) -> np.ndarray:
        """x [T, hidden] -> x + down(silu(gate(norm x)) * up(norm x)), materialized."""
        m = self.materialize(rms_norm(x, self.mlp_norm, self.eps))  # [T, hidden]
        gate, up = self.gate_up(m)  # [T, intermediate] each
        swiglu = self.materialize(silu(gate) * up)  # [T, intermediate]
        return self.materialize(x + self.down_proj(swiglu))

    # ---- prefill: all positions at once --------------------------------------------------

    def prefill(self, x: np.ndarray, *, need_output: bool = True
                ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        """x [T, hidden] at positions 0..T-1 -> (x_out [T, hidden] or None, K, V), K post-RoPE
        and V as C-contiguous [kv_heads, T, head_dim]. ``need_output=False`` stops after K/V
        (the last layer's output only feeds logits, which prefill does not return)."""
        q, k, v = self._project_qkv(x)
        if not need_output:
            return None, k, v
        attended = self._prefill_attention(q, k, v)  # [T, heads * head_dim]
        x = self.materialize(x + self.o_proj(attended))
        return self._mlp_residual(x), k, v

    def _project_qkv(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """x [T, hidden] at positions 0..T-1 -> q [heads, T, hd], k [kv_heads, T, hd] (both
        post-RoPE) and v [kv_heads, T, hd], C-contiguous float32."""
        positions = x.shape[0]
        cos, sin = self.rope_cos[:positions], self.rope_sin[:positions]  # [T, head_dim]
        h = self.materialize(rms_norm(x, self.attention_norm, self.eps))  # [T, hidden]
        q, k, v = self.qkv(h)  # [T, heads * hd], [T, kv_heads * hd] x 2
        q = q.reshape(positions, self.heads, self.head_dim).transpose(1, 0, 2)
        k = k.reshape(positions, self.kv_heads, self.head_dim).transpose(1, 0, 2)
        v = v.reshape(positions, self.kv_heads, self.head_dim).transpose(1, 0, 2)
        q = np.ascontiguousarray(apply_rope(q, cos, sin))  # [heads, T, head_dim]
        k = np.ascontiguousarray(apply_rope(k, cos, sin))  # [kv_heads, T, head_dim]
        v = np.ascontiguousarray(v, dtype=np.float32)  # [kv_heads, T, head_dim]
        return q, k, v

    def _prefill_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Causal grouped-query attention over all positions, in query blocks (no Python loop
        over positions). q [heads, T, hd], k/v [kv_heads, T, hd] -> [T, heads * hd]."""
        kv_heads, group, head_dim = self.kv_heads, self.group, self.head_dim
        positions = q.shape[1]
        # Query head h reads KV head h // group (HF repeat_kv order), so [heads] -> [kv, group].
        grouped = q.reshape(kv_heads, group, positions, head_dim)
        key_rows, value_rows = FixedPointRows.of(k), FixedPointRows.of(v)  # one scale per position
        out = np.empty((kv_heads, group, positions, head_dim), dtype=np.float32)
        for start in range(0, positions, PREFILL_QUERY_BLOCK):
            stop = min(start + PREFILL_QUERY_BLOCK, positions)
            rows = stop - start
            q_block = grouped[:, :, start:stop].reshape(kv_heads, group * rows, head_dim)
            # Only keys 0..stop-1 can be visible to this block.
            scores = matmul_rows(q_block, key_rows[:, :stop])  # [kv, group * rows, stop]
            scores *= self.scale
            scores = scores.reshape(kv_heads, group, rows, stop)
            # Query at position i sees keys j <= i. Keys before the block are visible to every
            # row, so only the block's diagonal square needs -inf above its diagonal.
            scores[..., start:stop] += CAUSAL_SQUARE[:rows, :rows]
            probs = self.materialize(softmax_(scores))  # [kv, group, rows, stop]
            block = weighted_sum(probs.reshape(kv_heads, group * rows, stop), value_rows[:, :stop])
            out[:, :, start:stop] = block.reshape(kv_heads, group, rows, head_dim)
        # [kv, group, T, hd] -> [heads, T, hd] -> [T, heads * hd] (heads concatenated per row)
        merged = out.reshape(self.heads, positions, head_dim).transpose(1, 0, 2)
        return self.materialize(merged.reshape(positions, self.heads * head_dim))

    # ---- scoring after a handoff: every row at once, each one a decode step ------------------

    def score_rows(self, x: np.ndarray, past_keys: np.ndarray, past_values: np.ndarray) -> np.ndarray:
        """x [T, hidden] at positions 0..T-1 -> x_out [T, hidden], where row r attends over the
        handed-off K/V of positions 0..r-1 (``past_keys``/``past_values`` [kv_heads, T, hd], K
        post-RoPE) and its own K/V at r: each row is :meth:`decode_row` at position r after a
        handoff of r positions, bit for bit."""
        q, k, v = self._project_qkv(x)
        attended = self._scoring_attention(q, k, v, past_keys, past_values)  # [T, heads * head_dim]
        x = self.materialize(x + self.o_proj(attended))
        return self._mlp_residual(x)

    def _scoring_attention(self, q: np.ndarray, own_k: np.ndarray, own_v: np.ndarray,
                           past_k: np.ndarray, past_v: np.ndarray) -> np.ndarray:
        """Row r's grouped-query attention over keys 0..r: handed-off keys 0..r-1, its own key at
        r, in prefill's query blocks with decode's reduction shapes. q [heads, T, hd], own and
        past K/V [kv_heads, T, hd] -> [T, heads * hd]."""
        kv_heads, group, head_dim = self.kv_heads, self.group, self.head_dim
        positions = q.shape[1]
        grouped = q.reshape(kv_heads, group, positions, head_dim)
        past_key_rows, past_value_rows = FixedPointRows.of(past_k), FixedPointRows.of(past_v)
        own_value_rows = FixedPointRows.of(own_v)  # [kv, T, hd], one scale per position
        # Each row's score against its own key, [kv, group, T]: rows [kv, T, group, hd] against
        # one key per row [kv, T, 1, hd] (matmul_rows gives each score the same bits alone).
        own_key_rows = FixedPointRows.of(own_k[:, :, None, :])
        own_scores = matmul_rows(grouped.transpose(0, 2, 1, 3), own_key_rows)[..., 0].transpose(0, 2, 1)
        out = np.empty((kv_heads, group, positions, head_dim), dtype=np.float32)
        for start in range(0, positions, PREFILL_QUERY_BLOCK):
            stop = min(start + PREFILL_QUERY_BLOCK, positions)
            rows = stop - start
            diagonal = np.arange(rows)  # row i of the block sits at position start + i
            q_block = grouped[:, :, start:stop].reshape(kv_heads, group * rows, head_dim)
            scores = matmul_rows(q_block, past_key_rows[:, :stop])  # [kv, group * rows, stop]
            scores = scores.reshape(kv_heads, group, rows, stop)
            # Key r of row r is the row's own, not the handed-off one; keys after r are masked.
            scores[..., diagonal, start + diagonal] = own_scores[:, :, start:stop]
            scores *= self.scale
            scores[..., start:stop] += CAUSAL_SQUARE[:rows, :rows]
            # softmax_ with each row's denominator summed over exactly its start + i + 1 keys.
            scores -= scores.max(axis=-1, keepdims=True)
            scores[...] = exp(scores)
            scores /= visible_tree_sum(scores, np.arange(start + 1, stop + 1))
            probs = self.materialize(scores)  # [kv, group, rows, stop]
            out[:, :, start:stop] = weighted_sum_own_diagonal(
                probs, past_value_rows[:, :stop], own_value_rows[:, start:stop], start)
        # [kv, group, T, hd] -> [heads, T, hd] -> [T, heads * hd] (heads concatenated per row)
        merged = out.reshape(self.heads, positions, head_dim).transpose(1, 0, 2)
        return self.materialize(merged.reshape(positions, self.heads * head_dim))

    # ---- decode: one row -------------------------------------------------------------------

    def decode_row(self, x: np.ndarray, position: int, cache: LayerKV) -> np.ndarray:
        """x [1, hidden] at ``position`` -> x_out [1, hidden]. Writes this row's K (post-RoPE)
        and V into ``cache`` at slot ``position`` and attends over slots 0..position. The same
        code runs for every row whatever the block size."""
        cos, sin = self.rope_cos[position], self.rope_sin[position]  # [head_dim]
        h = self.materialize(rms_norm(x, self.attention_norm, self.eps))  # [1, hidden]
        q, k, v = self.qkv(h)  # [1, heads * hd], [1, kv_heads * hd] x 2
        q = apply_rope(q.reshape(self.heads, self.head_dim), cos, sin)
        k = apply_rope(k.reshape(self.kv_heads, 1, self.head_dim), cos, sin)
        cache.write(position, k, v.reshape(self.kv_heads, 1, self.head_dim))
        attended = self.materialize(self.attend_row(q, cache, visible=position + 1))
        x = self.materialize(x + self.o_proj(attended))
        return self._mlp_residual(x)

    def attend_row(self, q: np.ndarray, cache: LayerKV, visible: int) -> np.ndarray:
        """One query row's grouped-query attention over cache slots 0..visible-1:
        q [heads, head_dim] (post-RoPE) -> [1, heads * head_dim]."""
        grouped = q.reshape(self.kv_heads, self.group, self.head_dim)  # [kv, group, hd]
        scores = matmul_rows(grouped, cache.key_rows[:, :visible])  # [kv, group, visible]
        scores *= self.scale
        probs = self.materialize(softmax_(scores))
        attended = weighted_sum(probs, cache.value_rows[:, :visible])  # [kv, group, hd]
        return attended.reshape(1, self.heads * self.head_dim)


def arithmetic_kind(hook: object, what: str) -> str:
    """The name of a projection's or materialize hook's arithmetic, for the engine abi: its
    ``kind`` string when it declares one, else its module-level class or function name. A name
    that does not identify the arithmetic (lambda, nested or partial function) is refused,
    because two different arithmetics must never share an abi (and so a cache identity)."""
    kind = getattr(hook, "kind", None)
    if isinstance(kind, str) and kind:
        return kind
    if isinstance(hook, (functools.partial, np.ufunc)):
        raise Refused(f"{what}: a {type(hook).__name__} does not name its arithmetic; "
                      "declare a 'kind' string")
    named = hook if inspect.isfunction(hook) or inspect.isbuiltin(hook) else type(hook)
    name = getattr(named, "__qualname__", "")
    if not name or "<" in name:
        raise Refused(f"{what}: {name or type(hook).__name__} does not name its arithmetic; "
                      "declare a 'kind' string")
    return name


def engine_abi(linear_kinds: set[str], materialize_kind: str) -> str:
    """A reference engine's abi: this file's arithmetic, its projections' kinds and its
    materialize hook's (named only when intermediates do not stay float32)."""
    abi = f"{ABI_VERSION}+{','.join(sorted(linear_kinds))}"
    return abi if materialize_kind == KeepFloat32.kind else f"{abi}+{materialize_kind}"


def make_engine_linear(make_linear: MakeLinear, name: str, weight_f32: np.ndarray) -> Linear:
    """Call the factory and refuse a projection whose shape disagrees with the weight or whose
    arithmetic has no name (see :func:`arithmetic_kind`)."""
    linear = make_linear(name, weight_f32)
    n_out, n_in = weight_f32.shape
    if getattr(linear, "n_in", None) != n_in or getattr(linear, "n_out", None) != n_out:
        raise Refused(f"make_linear: {name}: n_in/n_out {getattr(linear, 'n_in', None)}/"
                      f"{getattr(linear, 'n_out', None)}, expected {n_in}/{n_out}")
    arithmetic_kind(linear, f"make_linear: {name}")
    return linear


# --------------------------------------------------------------------------------------------
# Decode state
# --------------------------------------------------------------------------------------------


@dataclass
class LayerKV:
    """One layer's decode-time K/V: float32 ``[kv_heads, capacity, head_dim]`` and their
    fixed-point images (one scale per slot), converted once when a slot is written."""

    keys: np.ndarray
    values: np.ndarray
    key_rows: FixedPointRows
    value_rows: FixedPointRows

    @classmethod
    def install(cls, keys: np.ndarray, values: np.ndarray, capacity: int) -> LayerKV:
        """A layer with room for ``capacity`` slots, slots 0.. filled from K/V [kv, P, hd]."""
        kv_heads, _, head_dim = keys.shape
        empty = np.zeros((kv_heads, capacity, head_dim), dtype=np.float32)
        # The keys' integers are stored head-dim-major, [kv, head_dim, capacity] viewed as
        # [kv, capacity, head_dim]: a decode step's scores then read each head dim's visible keys
        # as one contiguous run, not one short row per key (same values, so the same bits).
        key_integers = np.zeros((kv_heads, head_dim, capacity)).swapaxes(-1, -2)
        key_rows = FixedPointRows(key_integers, np.zeros((kv_heads, capacity, 1)))
        layer = cls(empty, empty.copy(), key_rows, FixedPointRows.of(empty))
        layer.write(0, keys, values)
        return layer

    def write(self, slot: int, keys: np.ndarray, values: np.ndarray) -> None:
        """K/V [kv_heads, R, head_dim] into slots slot..slot+R-1."""
        rows = slice(slot, slot + keys.shape[1])
        self.keys[:, rows], self.values[:, rows] = keys, values
        for image, tensor in ((self.key_rows, keys), (self.value_rows, values)):
            converted = FixedPointRows.of(tensor)
            image.integers[:, rows], image.scale[:, rows] = converted.integers, converted.scale


@dataclass
class DecodeCache:
    """Preallocated per-layer K/V (:class:`LayerKV`); positions 0..length-1 are filled.
    ``truncate`` rolls back (a verifier rejecting draft tokens)."""

    layers: list[LayerKV]
    length: int
    meta: dict[str, float] = field(default_factory=dict)

    @classmethod
    def install(cls, kv: KVCache, extra_positions: int) -> DecodeCache:
        """Copy a canonical KV (already checked to fit) into a cache with ``extra_positions`` room."""
        positions = kv.keys[0].shape[1]
        layers = [LayerKV.install(key, value, positions + extra_positions)
                  for key, value in zip(kv.keys, kv.values, strict=True)]
        return cls(layers, length=positions)

    @property
    def keys(self) -> list[np.ndarray]:
        return [layer.keys for layer in self.layers]

    @property
    def values(self) -> list[np.ndarray]:
        return [layer.values for layer in self.layers]

    @property
    def capacity(self) -> int:
        return int(self.layers[0].keys.shape[1])

    def truncate(self, length: int) -> None:
        """Forget positions ``length`` onward; they are overwritten when fed again."""
        if not 0 <= length <= self.length:
            raise Refused(f"decode cache: truncate length {length} outside 0..{self.length}")
        self.length = length

    def export(self) -> KVCache:
        """The filled positions as a canonical KVCache (copies)."""
        return KVCache([np.ascontiguousarray(k[:, :self.length]) for k in self.keys],
                       [np.ascontiguousarray(v[:, :self.length]) for v in self.values])


@dataclass
class RowsOutput:
    """What ``forward_rows`` returns: ``logits`` float32 [T, vocab] (row t scores the token after
    row t) and ``hidden`` float32 [T, hidden], the last hidden state before the final norm."""

    logits: np.ndarray
    hidden: np.ndarray


# --------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------


class ReferenceEngine(GreedyDecoder):
    """The numpy Llama engine: producer (``prefill``) and consumer (``decode``,
    ``teacher_forced``) of the canonical KV layout, with pluggable projections."""

    name = "reference-numpy"
    # Pure numpy, no thread pool or device: a forked child may run it (qualify.evidence.cold_ahead).
    fork_safe = True
    version = ENGINE_VERSION
    logit_units = "raw"

    def __init__(self, geometry: ModelGeometry, weights: dict[str, np.ndarray], *,
                 rms_norm_eps: float, make_linear: MakeLinear | None = None,
                 materialize: Materialize | None = None, rope_scaling: RopeScaling | None = None) -> None:
        gate = weights.get("model.layers.0.mlp.gate_proj.weight")
        if not isinstance(gate, np.ndarray) or gate.ndim != 2:
            raise Refused("weights: model.layers.0.mlp.gate_proj.weight: missing or not a matrix")
        # An untied head and Q/K/V biases come with the weights (the loader checked them against
        # the config); each is then checked like every other tensor.
        check_weights(weights, geometry, gate.shape[0], "weights", tied_head="lm_head.weight" not in weights,
                      qkv_bias="model.layers.0.self_attn.q_proj.bias" in weights)
        if isinstance(rms_norm_eps, bool) or not isinstance(rms_norm_eps, (int, float, np.floating)) \
                or not math.isfinite(rms_norm_eps) or rms_norm_eps <= 0:
            raise Refused(f"rms_norm_eps: expected a positive finite number, found {rms_norm_eps!r}")
        rms_norm_eps = float(rms_norm_eps)
        self.geometry = geometry
        self.intermediate = int(gate.shape[0])
        self.rms_norm_eps = rms_norm_eps
        make_linear = dense_linear if make_linear is None else make_linear
        self.materialize: Materialize = KeepFloat32() if materialize is None else materialize
        materialize_kind = arithmetic_kind(self.materialize, "materialize")

        self.rope = rope_tables(geometry.max_positions, geometry.head_dim, geometry.rope_theta, rope_scaling)
        self.embed = weights["model.embed_tokens.weight"]  # [vocab, hidden] float32
        # The LM head [vocab, hidden]: the embedding when tied, else lm_head.weight.
        self.lm_head_rows = FixedPointRows.of(weights.get("lm_head.weight", self.embed))
        self.layers = [
            DecoderLayer(weights, f"model.layers.{index}.", geometry, rms_norm_eps, self.rope,
                         make_linear, self.materialize)
            for index in range(geometry.layers)
        ]
        self.final_norm = weights["model.norm.weight"]  # [hidden]
        self.eps = np.float32(rms_norm_eps)

        linear_kinds = {arithmetic_kind(linear, "make_linear") for layer in self.layers for linear in layer.linears}
        check_ieee_environment()
        # The arithmetic's name only: numpy and its BLAS are recorded in the host facts, and the
        # known-answer check (qualify.engines.kat) pins the bits they must give.
        self.abi = engine_abi(linear_kinds, materialize_kind)

    @classmethod
    def from_model_dir(cls, model_dir: Path = assets.MODEL_DIR, make_linear: MakeLinear | None = None,
                       materialize: Materialize | None = None) -> ReferenceEngine:
        """Load ``config.json`` + ``model.safetensors`` from ``model_dir`` (refusing bad ones)."""
        config = load_config(Path(model_dir))
        weights = load_weights(Path(model_dir), config)
        return cls(config.geometry, weights, rms_norm_eps=config.rms_norm_eps,
                   make_linear=make_linear, materialize=materialize, rope_scaling=config.rope_scaling)

    # ---- shared pieces ---------------------------------------------------------------------

    def _logits(self, x: np.ndarray) -> np.ndarray:
        """Final norm then the LM head: x [T, hidden] -> float32 [T, vocab], always the
        fixed-point contraction whatever the projections are (the embedding upcast from float16)."""
        normed = self.materialize(rms_norm(x, self.final_norm, self.eps))
        check_finite_activations(normed, "lm head")
        return matmul_rows(normed, self.lm_head_rows)

    # ---- producer --------------------------------------------------------------------------

    def prefill(self, tokens: np.ndarray) -> KVCache:
        """KV of exactly ``tokens`` (positions 0..len-1): per layer K (post-RoPE) and V float32
        [kv_heads, positions, head_dim], C-contiguous."""
        kv, _ = self._prefill(tokens, need_hidden=False)
        return kv

    def prefill_with_hidden(self, tokens: np.ndarray) -> tuple[KVCache, np.ndarray]:
        """``prefill`` plus the last hidden state before the final norm, float32 [T, hidden]
        (what an EAGLE draft head reads)."""
        kv, hidden = self._prefill(tokens, need_hidden=True)
        assert hidden is not None
        return kv, hidden

    def _prefill(self, tokens: np.ndarray, need_hidden: bool) -> tuple[KVCache, np.ndarray | None]:
        began = time.perf_counter()
        tokens = self._tokens(tokens, "prefill tokens")
        if tokens.size > self.geometry.max_positions:
            raise Refused(f"prefill tokens: {tokens.size} positions exceed max_positions "
                          f"{self.geometry.max_positions}")
        x: np.ndarray | None = self.embed[tokens]  # [T, hidden]
        keys, values = [], []
        for index, layer in enumerate(self.layers):
            last = index == len(self.layers) - 1
            assert x is not None
            x, k, v = layer.prefill(x, need_output=need_hidden or not last)
            keys.append(k)
            values.append(v)
        kv = KVCache(keys, values, meta={"prefill_seconds": time.perf_counter() - began})
        return kv, x

    # ---- consumer --------------------------------------------------------------------------

    def new_cache(self, kv: KVCache, extra_positions: int) -> DecodeCache:
        """Install (copy) a canonical KV into a cache with room for ``extra_positions`` more,
        refusing a KV whose geometry, dtype or values do not fit this model."""
        geometry = self.geometry
        check_kv_fits(kv, geometry.layers, geometry.kv_heads, geometry.head_dim,
                      geometry.max_positions, extra_positions)
        return DecodeCache.install(kv, extra_positions)

    def forward_rows(self, cache: DecodeCache, tokens: np.ndarray) -> RowsOutput:
        """Feed ``tokens`` at positions cache.length.. and append their K/V. Each row runs
        through the whole model alone (see module docstring), so the result for a row never
        depends on how many rows were fed together."""
        tokens = self._tokens(tokens, "tokens")
        if cache.length + tokens.size > cache.capacity:
            raise Refused(f"decode cache: {tokens.size} tokens after {cache.length} positions "
                          f"exceed capacity {cache.capacity}")
        logits = np.empty((tokens.size, self.geometry.vocab), dtype=np.float32)
        hidden = np.empty((tokens.size, self.geometry.hidden), dtype=np.float32)
        for row, token in enumerate(tokens):
            position = cache.length
            x = self.embed[token:token + 1]  # [1, hidden]
            for layer, layer_kv in zip(self.layers, cache.layers, strict=True):
                x = layer.decode_row(x, position, layer_kv)
            hidden[row] = x[0]
            logits[row] = self._logits(x)[0]
            cache.length = position + 1
        return RowsOutput(logits=logits, hidden=hidden)

    def score_rows(self, tokens: np.ndarray, past: KVCache) -> np.ndarray:
        """Teacher-forced logits float32 [T, vocab] of ``tokens`` after a handoff: row r is exactly
        ``teacher_forced(past[:r], tokens[r:r + 1], ...)[0]``, the decode step at position r from
        the handed-off K/V of positions 0..r-1 and this engine's own K/V at r, computed for every
        r at once (prefill's query blocks). ``past`` holds exactly T positions (a producer's
        prefill of ``tokens``; its last position is never read)."""
        tokens = self._tokens(tokens, "score tokens")
        geometry = self.geometry
        positions = check_kv_fits(past, geometry.layers, geometry.kv_heads, geometry.head_dim,
                                  geometry.max_positions, extra_positions=0)
        if positions != tokens.size:
            raise Refused(f"score past: {positions} positions, expected {tokens.size} "
                          "(the KV of exactly the scored tokens)")
        x = self.embed[tokens]  # [T, hidden]
        for layer, keys, values in zip(self.layers, past.keys, past.values, strict=True):
            x = layer.score_rows(x, keys, values)
        return self._logits(x)

    def _run(self, kv: KVCache, pending: np.ndarray, steps: int, forced: np.ndarray | None
             ) -> DecodeResult:
        """The one decode loop: greedy when ``forced`` is None, else feeding ``forced``. Both
        feed one token per step through ``forward_rows``, so decode equals teacher_forced fed
        its own tokens bit for bit."""
        began = time.perf_counter()
        pending = self._tokens(pending, "pending tokens")
        # The last chosen token is never fed, so the cache needs pending + steps - 1 positions.
        cache = self.new_cache(kv, extra_positions=pending.size + steps - 1)
        handed_off = cache.length
        logits = np.empty((steps, self.geometry.vocab), dtype=np.float32)
        tokens = np.empty(steps, dtype=np.int32)
        current = self.forward_rows(cache, pending).logits[-1]  # scores the first new token
        for step in range(steps):
            logits[step] = current
            tokens[step] = forced[step] if forced is not None else int(np.argmax(current))
            if step + 1 < steps:
                current = self.forward_rows(cache, tokens[step:step + 1]).logits[0]
        return finished_decode(self.name, tokens, logits, began=began, handed_off=handed_off,
                               pending_tokens=pending.size)

"""GGUF k-quant lane (rung 3): Q8_0 weights read with ``gguf``, and an integer-exact contraction.

Weights are ``llama.cpp`` Q8_0 blocks (32 int8 quants + one float16 scale ``d_w``), written by
``tools/make_gguf.py`` and read back with ``gguf.GGUFReader`` (never a hand-written parser).

Exact arithmetic (``ExactQ8Linear``), the same as llama.cpp's reference ``q8_0 x q8_0`` dot:

1. activations are quantized per block of 32 exactly as ``quantize_row_q8_0_ref``:
   ``d = amax / 127`` (float32), ``q = roundf(x * (1/d))`` (half away from zero), ``d`` stored
   as float16;
2. each block's dot ``isum = sum_j q_w[j] * q_a[j]`` is an exact integer;
3. the float epilogue is pinned: ``acc = 0f; for block b in order: acc += float32(isum_b) *
   (d_w_b * d_a_b)``, every operation a float32 IEEE op, with no fused multiply-add.

Step 2 runs on float32 BLAS: each product is an integer of magnitude <= 128*128 = 2^14 and every
partial sum of a 32-term block is an integer of magnitude <= 32 * 2^14 = 2^19 < 2^24, so every
float32 addition is exact in any order, with or without FMA, on any thread count
(:func:`check_block_sum_bound` checks the operand ranges that this proof needs). Row t of the
output depends only on row t of the input, so results do not depend on BLAS, threads or batch
shape.

Native arithmetic (``NativeQ8Linear``): the same quantized operands, dequantized to float32 and
contracted over the whole row by the reference engine's machine-independent fixed-point
contraction (another rounding than the per-block sums). It is the ``kquant-native``
producer for fault tests: rung 3 must refuse its cache entries.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from qualify.contract.lanes import ProducerMode
from qualify.core import assets
from qualify.core.errors import Refused, one_line
from qualify.core.kv import KVCache
from qualify.core.numerics import FixedPointRows, matmul_rows
from qualify.engines.base import (
    ENGINE_VERSION,
    DecodeResult,
    GreedyDecoder,
    Linear,
    ModelGeometry,
    check_tokens,
    finished_decode,
    stacked_columns,
)
from qualify.engines.checkpoint import RopeScaling
from qualify.engines.reference import (
    DecodeCache,
    DecoderLayer,
    KeepFloat32,
    LayerKV,
    MakeLinear,
    ReferenceEngine,
    RowsOutput,
    apply_rope,
    arithmetic_kind,
    engine_abi,
    rms_norm,
)

QUANT_TYPE = gguf.GGMLQuantizationType.Q8_0
BLOCK = 32  # Q8_0 quants per block (llama.cpp QK8_0)
Q8_MAX = 127  # activations are quantized to [-127, 127]; stored weights may hold -128
FLOAT32_EXACT_INTEGER_LIMIT = 2**24  # every integer of smaller magnitude is a float32
TARGET_GGUF_NAME = "target-q8_0.gguf"
DRAFT_GGUF_NAME = "eagle1-draft-q8_0.gguf"
TARGET_ARCH = "llama"
DRAFT_ARCH = "trust-ladder-eagle1"
# Rows of activations contracted per chunk: bounds the [blocks, rows, n_out] integer-sum buffer.
# Rows are independent, so chunking never changes a result.
ROW_CHUNK = 256
BATCHED_BLOCK_ROWS = 16  # up to this many rows, a contraction's block dots run as one batched call


# ---------------------------------------------------------------------------------------------
# Q/K row layout: llama.cpp's rope kernel pairs (2i, 2i+1); Hugging Face's rotate_half pairs
# (i, i + head_dim/2). convert_hf_to_gguf.py permutes q/k rows; we do the same, and undo it.
# ---------------------------------------------------------------------------------------------


def permute_qk_rows_to_gguf(weight: np.ndarray, heads: int) -> np.ndarray:
    """HF rotate_half row order -> llama.cpp interleaved order (``convert_hf_to_gguf.permute``)."""
    rows = weight.shape[0]
    return (weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def permute_qk_rows_from_gguf(weight: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of :func:`permute_qk_rows_to_gguf` (a pure row permutation, exact on Q8_0 rows)."""
    rows = weight.shape[0]
    return (weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


# ---------------------------------------------------------------------------------------------
# Q8_0 operands
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Q8Matrix:
    """A Q8_0 matrix ``[n_out, n_in]``: ``quants`` int8 [n_out, blocks, 32] and ``scales`` float32
    [n_out, blocks] (float16 values widened exactly)."""

    quants: np.ndarray
    scales: np.ndarray

    @property
    def n_out(self) -> int:
        return int(self.quants.shape[0])

    @property
    def n_in(self) -> int:
        return int(self.quants.shape[1] * BLOCK)

    @classmethod
    def from_gguf_bytes(cls, raw: np.ndarray, n_out: int, n_in: int) -> Q8Matrix:
        """Split raw Q8_0 bytes ``uint8 [n_out, blocks * 34]`` into quants and scales."""
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n_out, n_in // BLOCK, 2 + BLOCK)
        scales = blocks[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float32)
        quants = blocks[:, :, 2:].copy().view(np.int8)
        return cls(quants=np.ascontiguousarray(quants), scales=np.ascontiguousarray(scales))

    def permute_rows_from_gguf(self, heads: int) -> Q8Matrix:
        """Undo the q/k row permutation (quant blocks run along n_in, so rows move whole)."""
        return Q8Matrix(np.ascontiguousarray(permute_qk_rows_from_gguf(self.quants, heads)),
                        np.ascontiguousarray(permute_qk_rows_from_gguf(self.scales, heads)))

    def dequantize(self) -> np.ndarray:
        """float32 [n_out, n_in]: ``q * d`` per element (what ``gguf`` dequantizes to)."""
        weight: np.ndarray = (self.quants.astype(np.float32) * self.scales[:, :, None]).reshape(self.n_out, self.n_in)
        return weight

    def rows(self, index: np.ndarray) -> np.ndarray:
        """Dequantized rows ``float32 [len(index), n_in]`` (embedding lookup of a tied table)."""
        quants, scales = self.quants[index], self.scales[index]
        rows: np.ndarray = (quants.astype(np.float32) * scales[:, :, None]).reshape(len(index), self.n_in)
        return rows


def quantize_activations_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [T, n_in] -> (quants int8 [T, blocks, 32], scales float32 [T, blocks]).

    Bit-for-bit llama.cpp's ``quantize_row_q8_0_ref`` (and ``gguf.quants`` Q8_0): ``d = amax/127``,
    ``id = d ? 1/d : 0``, ``q = roundf(x * id)`` half away from zero, scale kept as float16; except
    that where 1/d overflows (amax < 127 * 2^-128, undefined behaviour there) ``id`` is 0.
    """
    quants, scales = _quantize_activations(x)
    return quants.astype(np.int8), scales


def _quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`quantize_activations_q8_0` with the integer quants left as float32 values."""
    rows, n_in = x.shape
    blocks = x.reshape(rows, n_in // BLOCK, BLOCK)
    amax = np.abs(blocks).max(axis=2)  # [T, blocks]
    d = amax / np.float32(Q8_MAX)
    with np.errstate(divide="ignore", over="ignore"):
        inverse = np.float32(1) / d
    # d == 0 -> id = 0 (as llama.cpp). A subnormal d whose reciprocal overflows would make
    # llama.cpp cast inf/NaN to int8 (undefined); we pin id = 0 there: its float16 scale is 0,
    # so the block contributes 0 either way.
    inverse = np.where(np.isfinite(inverse), inverse, np.float32(0)).astype(np.float32)
    scaled = blocks * inverse[:, :, None]  # [T, blocks, 32]
    magnitude = np.abs(scaled)
    floor = np.floor(magnitude)
    rounded = np.copysign(floor + (magnitude - floor >= np.float32(0.5)), scaled)  # roundf
    return rounded, d.astype(np.float16).astype(np.float32)


def check_block_sum_bound(max_abs_weight_quant: int, max_abs_activation_quant: int) -> None:
    """Refuse operands whose 32-term block dot could leave float32's exact-integer range."""
    bound = BLOCK * max_abs_weight_quant * max_abs_activation_quant
    if bound >= FLOAT32_EXACT_INTEGER_LIMIT:
        raise Refused(f"kquant: block integer sum bound {bound} reaches 2^24; float32 BLAS would round")


# ---------------------------------------------------------------------------------------------
# Linears (the Linear protocol of qualify.engines.base)
# ---------------------------------------------------------------------------------------------


class ExactQ8Linear:
    """``y[T, n_out] = x[T, n_in] @ W.T`` in llama.cpp's q8_0 x q8_0 arithmetic, integer-exact per
    block with a pinned float32 epilogue; row t depends only on row t of x."""

    kind = "q8_0-exact"

    def __init__(self, name: str, weight: Q8Matrix):
        self.name = name
        self.n_in = weight.n_in
        self.n_out = weight.n_out
        self.blocks = self.n_in // BLOCK
        # [blocks, 32, n_out] float32 copies of the integer quants, laid out for batched GEMM.
        self._quants_by_block = np.ascontiguousarray(
            weight.quants.astype(np.float32).transpose(1, 2, 0))
        self._scales_by_block = np.ascontiguousarray(weight.scales.T)  # [blocks, n_out]
        check_block_sum_bound(int(np.abs(weight.quants.astype(np.int16)).max(initial=0)), Q8_MAX)

    @classmethod
    def stack(cls, projections: Sequence[ExactQ8Linear]) -> ExactQ8Linear:
        """One linear whose output columns are ``projections``' side by side (q/k/v, gate/up),
        each column with its own projection's bits (exact block sums, an elementwise epilogue by
        its own weight scales); the input is quantized once, and the projections' blocks become
        views of the stacked ones."""
        stacked = cls.__new__(cls)
        stacked.name = " + ".join(projection.name for projection in projections)
        stacked.n_in, stacked.blocks = projections[0].n_in, projections[0].blocks
        stacked.n_out = sum(projection.n_out for projection in projections)
        stacked._quants_by_block = np.concatenate([p._quants_by_block for p in projections], axis=2)
        stacked._scales_by_block = np.concatenate([p._scales_by_block for p in projections], axis=1)
        for projection, own in zip(projections, stacked_columns(projections), strict=True):
            projection._quants_by_block = stacked._quants_by_block[:, :, own]
            projection._scales_by_block = stacked._scales_by_block[:, own]
        return stacked

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = _check_input(self.name, x, self.n_in)
        out = np.empty((x.shape[0], self.n_out), dtype=np.float32)
        for start in range(0, x.shape[0], ROW_CHUNK):
            out[start:start + ROW_CHUNK] = self._contract(x[start:start + ROW_CHUNK])
        return out

    def _contract(self, x: np.ndarray) -> np.ndarray:
        act_quants, act_scales = _quantize_activations(x)  # [T, blocks, 32] ints as float32, [T, blocks]
        if float(np.abs(act_quants).max(initial=0)) > Q8_MAX:
            raise Refused(f"kquant: {self.name}: activation quant outside [-127, 127]")
        rows = x.shape[0]
        # Epilogue, per block: float32(isum) * (d_w * d_a), isum the block's exact integer dot
        # [T, 32] @ [32, n_out]; then a left-to-right float32 sum over blocks starting from +0.0:
        # acc = ((0 + t_0) + t_1) + ... (each add one IEEE rounding).
        acc: np.ndarray = np.zeros((rows, self.n_out), dtype=np.float32)
        if rows <= BATCHED_BLOCK_ROWS:
            # A few rows (decode): every block at once, where per-block calls would cost more than
            # the arithmetic. [blocks, T, 32] @ [blocks, 32, n_out] -> [blocks, T, n_out].
            terms = np.matmul(act_quants.transpose(1, 0, 2), self._quants_by_block)
            terms *= self._scales_by_block[:, None, :] * act_scales.T[:, :, None]
            for block_terms in terms:
                acc += block_terms
            return acc
        # Many rows (prefill): block by block, so one [T, n_out] term is live at a time instead
        # of every block's (which do not stay in cache).
        for block in range(self.blocks):
            block_terms = act_quants[:, block] @ self._quants_by_block[block]  # [T, n_out]
            block_terms *= self._scales_by_block[block][None, :] * act_scales[:, block][:, None]
            acc += block_terms
        return acc


class NativeQ8Linear:
    """The same Q8_0 operands, dequantized and contracted whole-row by the reference's fixed-point
    contraction (another rounding than the per-block integer sums): the kquant ``native``
    producer arithmetic, for fault tests."""

    kind = "q8_0-native-fixed-point"

    def __init__(self, name: str, weight: Q8Matrix):
        self.name = name
        self.n_in = weight.n_in
        self.n_out = weight.n_out
        self._dequantized_rows = FixedPointRows.of(weight.dequantize())  # [n_out, n_in]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = _check_input(self.name, x, self.n_in)
        act_quants, act_scales = quantize_activations_q8_0(x)
        act = (act_quants.astype(np.float32) * act_scales[:, :, None]).reshape(x.shape)
        return matmul_rows(act, self._dequantized_rows)


def _check_input(name: str, x: np.ndarray, n_in: int) -> np.ndarray:
    if x.ndim != 2 or x.shape[1] != n_in:
        raise Refused(f"kquant: {name}: input shape {list(x.shape)}, expected [T, {n_in}]")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        raise Refused(f"kquant: {name}: non-finite activation")
    return x


# ---------------------------------------------------------------------------------------------
# GGUF loading (fail closed)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFTensorSpec:
    """What one tensor must be: ``quantized`` -> Q8_0 [n_out, n_in]; else F32 of ``shape``."""

    shape: tuple[int, ...]
    quantized: bool


def layer_tensor_specs(block: str, hidden: int, heads: int, kv_heads: int, head_dim: int,
                       intermediate: int) -> dict[str, GGUFTensorSpec]:
    """Tensors of one llama decoder layer under ``{block}.*`` (numpy shapes: [n_out, n_in])."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return {
        f"{block}.attn_norm.weight": GGUFTensorSpec((hidden,), False),
        f"{block}.attn_q.weight": GGUFTensorSpec((q, hidden), True),
        f"{block}.attn_k.weight": GGUFTensorSpec((kv, hidden), True),
        f"{block}.attn_v.weight": GGUFTensorSpec((kv, hidden), True),
        f"{block}.attn_output.weight": GGUFTensorSpec((hidden, q), True),
        f"{block}.ffn_norm.weight": GGUFTensorSpec((hidden,), False),
        f"{block}.ffn_gate.weight": GGUFTensorSpec((intermediate, hidden), True),
        f"{block}.ffn_up.weight": GGUFTensorSpec((intermediate, hidden), True),
        f"{block}.ffn_down.weight": GGUFTensorSpec((hidden, intermediate), True),
    }


def read_gguf(path: Path, arch: str, specs: dict[str, GGUFTensorSpec],
              hparams: dict[str, int | float]) -> dict[str, Q8Matrix | np.ndarray]:
    """Tensors of a GGUF file checked against ``specs`` and ``hparams``; refuse (one line naming
    the file and tensor or key) a missing/extra tensor, wrong type or shape, non-finite values."""
    path = Path(path)
    if not path.is_file():
        raise Refused(f"{path}: file: missing")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # gguf raises ValueError/IndexError/OSError on malformed files
        raise Refused(one_line(f"{path}: file: unreadable GGUF ({type(exc).__name__}: {exc})")) from None
    found_arch = _field(reader, path, "general.architecture")
    if found_arch != arch:
        raise Refused(f"{path}: general.architecture: found {found_arch!r}, expected {arch!r}")
    for key, expected in hparams.items():
        value = _field(reader, path, key)
        # GGUF stores these hparams as uint32 / float32: compare in the stored type.
        if isinstance(expected, int):
            matches = isinstance(value, int) and value == expected
        else:
            matches = isinstance(value, float) and np.float32(value) == np.float32(expected)
        if not matches:
            raise Refused(f"{path}: {key}: found {value!r}, expected {expected!r}")
    stored = {tensor.name: tensor for tensor in reader.tensors}
    for name in sorted(set(stored) - set(specs)):
        raise Refused(f"{path}: {name}: unexpected tensor")
    loaded: dict[str, Q8Matrix | np.ndarray] = {}
    for name, spec in specs.items():
        if name not in stored:
            raise Refused(f"{path}: {name}: tensor missing")
        tensor = stored[name]
        shape = tuple(int(dim) for dim in reversed(tensor.shape.tolist()))  # ggml -> numpy order
        expected_type = QUANT_TYPE if spec.quantized else gguf.GGMLQuantizationType.F32
        if tensor.tensor_type != expected_type:
            raise Refused(f"{path}: {name}: type {tensor.tensor_type.name}, expected {expected_type.name}")
        if shape != spec.shape:
            raise Refused(f"{path}: {name}: shape {list(shape)}, expected {list(spec.shape)}")
        if spec.quantized:
            if spec.shape[1] % BLOCK != 0:
                raise Refused(f"{path}: {name}: n_in {spec.shape[1]} is not a multiple of {BLOCK}")
            matrix = Q8Matrix.from_gguf_bytes(tensor.data, *spec.shape)
            bad = int(matrix.scales.size - np.count_nonzero(np.isfinite(matrix.scales)))
            if bad:
                raise Refused(f"{path}: {name}: {bad} non-finite block scales")
            loaded[name] = matrix
        else:
            values = np.array(tensor.data, dtype=np.float32).reshape(spec.shape)
            if not np.isfinite(values).all():
                raise Refused(f"{path}: {name}: non-finite values")
            loaded[name] = values
    return loaded


def _field(reader: Any, path: Path, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        raise Refused(f"{path}: {key}: metadata key missing")
    try:
        return field.contents()
    except Exception as exc:
        raise Refused(one_line(f"{path}: {key}: unreadable ({type(exc).__name__})")) from None


# ---------------------------------------------------------------------------------------------
# The lane's checkpoint: target + draft weights as named linears and float32 vectors
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KQuantConfig:
    """The model shape facts both GGUF files are checked against (from the shipped config.json)."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    max_positions: int
    rope_theta: float
    rms_norm_eps: float
    # A chosen model's RoPE scaling (Llama 3.x); the shipped model's RoPE is plain.
    rope_scaling: RopeScaling | None = None

    def hparams(self, arch: str, layers: int) -> dict[str, int | float]:
        return {
            f"{arch}.context_length": self.max_positions,
            f"{arch}.embedding_length": self.hidden,
            f"{arch}.feed_forward_length": self.intermediate,
            f"{arch}.block_count": layers,
            f"{arch}.attention.head_count": self.heads,
            f"{arch}.attention.head_count_kv": self.kv_heads,
            f"{arch}.attention.key_length": self.head_dim,
            f"{arch}.attention.value_length": self.head_dim,
            f"{arch}.rope.dimension_count": self.head_dim,
            f"{arch}.rope.freq_base": self.rope_theta,
            f"{arch}.attention.layer_norm_rms_epsilon": self.rms_norm_eps,
            f"{arch}.vocab_size": self.vocab,
        }


def config_from_json(path: Path) -> KQuantConfig:
    """The shape facts of ``config.json``, refusing a missing or malformed file in one line."""
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
        facts = KQuantConfig(
            vocab=int(config["vocab_size"]), hidden=int(config["hidden_size"]),
            intermediate=int(config["intermediate_size"]), layers=int(config["num_hidden_layers"]),
            heads=int(config["num_attention_heads"]), kv_heads=int(config["num_key_value_heads"]),
            head_dim=int(config["head_dim"]), max_positions=int(config["max_position_embeddings"]),
            rope_theta=float(config["rope_theta"]), rms_norm_eps=float(config["rms_norm_eps"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise Refused(one_line(f"{path}: cannot read model config ({type(exc).__name__}: {exc})")) from None
    if not (math.isfinite(facts.rope_theta) and math.isfinite(facts.rms_norm_eps)):
        raise Refused(f"{path}: rope_theta/rms_norm_eps: expected finite numbers")
    return facts


# GGUF suffix inside ``blk.{i}`` -> Hugging Face suffix inside one decoder layer.
GGUF_TO_HF_LAYER: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj",
    "attn_k.weight": "self_attn.k_proj",
    "attn_v.weight": "self_attn.v_proj",
    "attn_output.weight": "self_attn.o_proj",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj",
    "ffn_up.weight": "mlp.up_proj",
    "ffn_down.weight": "mlp.down_proj",
}


@dataclass(frozen=True)
class KQuantWeights:
    """One GGUF file's contents by Hugging Face name: ``matrices`` (Q8_0 projections, Q/K rows
    back in HF order) and ``vectors`` (float32 norm weights)."""

    path: Path
    matrices: dict[str, Q8Matrix]
    vectors: dict[str, np.ndarray]


def _matrix(loaded: dict[str, Q8Matrix | np.ndarray], name: str, path: Path) -> Q8Matrix:
    """The Q8_0 matrix ``name`` of a read GGUF (its spec asked for a quantized tensor)."""
    value = loaded[name]
    if not isinstance(value, Q8Matrix):
        raise Refused(f"{path}: {name}: expected a Q8_0 matrix, found {type(value).__name__}")
    return value


def _vector(loaded: dict[str, Q8Matrix | np.ndarray], name: str, path: Path) -> np.ndarray:
    """The float vector ``name`` of a read GGUF (its spec asked for an unquantized tensor)."""
    value = loaded[name]
    if not isinstance(value, np.ndarray):
        raise Refused(f"{path}: {name}: expected a float tensor, found {type(value).__name__}")
    return value


def _hf_layer(loaded: dict[str, Q8Matrix | np.ndarray], block: str, hf_prefix: str,
              config: KQuantConfig, matrices: dict[str, Q8Matrix], vectors: dict[str, np.ndarray]) -> None:
    for gguf_suffix, hf_suffix in GGUF_TO_HF_LAYER.items():
        value = loaded[f"{block}.{gguf_suffix}"]
        if isinstance(value, Q8Matrix):
            if gguf_suffix == "attn_q.weight":
                value = value.permute_rows_from_gguf(config.heads)
            elif gguf_suffix == "attn_k.weight":
                value = value.permute_rows_from_gguf(config.kv_heads)
            matrices[hf_prefix + hf_suffix] = value
        else:
            vectors[hf_prefix + hf_suffix] = value


def load_target_gguf(path: Path, config: KQuantConfig) -> KQuantWeights:
    """The target: ``model.embed_tokens`` (tied LM head), ``model.layers.{i}.*`` projections,
    norm weights and ``model.norm.weight``."""
    c = config
    specs = {"token_embd.weight": GGUFTensorSpec((c.vocab, c.hidden), True),
             "output_norm.weight": GGUFTensorSpec((c.hidden,), False)}
    for index in range(c.layers):
        specs.update(layer_tensor_specs(f"blk.{index}", c.hidden, c.heads, c.kv_heads, c.head_dim,
                                        c.intermediate))
    loaded = read_gguf(path, TARGET_ARCH, specs, c.hparams(TARGET_ARCH, c.layers))
    matrices = {"model.embed_tokens": _matrix(loaded, "token_embd.weight", path)}
    vectors = {"model.norm.weight": _vector(loaded, "output_norm.weight", path)}
    for index in range(c.layers):
        _hf_layer(loaded, f"blk.{index}", f"model.layers.{index}.", c, matrices, vectors)
    return KQuantWeights(Path(path), matrices, vectors)


def load_draft_gguf(path: Path, config: KQuantConfig) -> KQuantWeights:
    """The EAGLE-1 draft: ``fc`` [hidden, 2*hidden] and ``layer.*`` (one decoder layer)."""
    c = config
    specs = {"fc.weight": GGUFTensorSpec((c.hidden, 2 * c.hidden), True)}
    specs.update(layer_tensor_specs("blk.0", c.hidden, c.heads, c.kv_heads, c.head_dim, c.intermediate))
    loaded = read_gguf(path, DRAFT_ARCH, specs, c.hparams(DRAFT_ARCH, 1))
    matrices = {"fc": _matrix(loaded, "fc.weight", path)}
    vectors: dict[str, np.ndarray] = {}
    _hf_layer(loaded, "blk.0", "layer.", c, matrices, vectors)
    return KQuantWeights(Path(path), matrices, vectors)


# ---------------------------------------------------------------------------------------------
# The k-quant target model and its plain greedy engine
# ---------------------------------------------------------------------------------------------

ABI_VERSION = "kquant-q8_0-abi-1"
"""Bump whenever this lane's numerics change (quantizer, epilogue order, LM head, row forward)."""


def kquant_abi(mode: ProducerMode) -> str:
    """The abi of a k-quant target in ``mode`` (:class:`KQuantModel`'s), composed without loading
    a GGUF: every projection and the LM head are of ``mode``'s one linear class, and intermediates
    stay float32, so those name the reference engine's part as it composes it."""
    kind = _linear_class(mode).kind
    return _target_abi(engine_abi({kind}, KeepFloat32.kind), kind)


def _target_abi(reference_abi: str, lm_head_kind: str) -> str:
    return f"{ABI_VERSION}+{reference_abi}+lm_head-{lm_head_kind}"


def _linear_class(mode: ProducerMode) -> type[ExactQ8Linear] | type[NativeQ8Linear]:
    return ExactQ8Linear if mode is ProducerMode.EXACT else NativeQ8Linear


def linear_factory(matrices: dict[str, Q8Matrix], mode: ProducerMode) -> MakeLinear:
    """A ``make_linear(name, weight_f32)`` for :class:`ReferenceEngine` / :class:`DecoderLayer`
    that serves the GGUF's Q8_0 matrix called ``name`` (``.weight`` dropped) in ``mode``'s
    arithmetic; ``weight_f32`` is that matrix dequantized (the reference's shape check)."""
    linear_class = _linear_class(mode)

    def make_linear(name: str, weight_f32: np.ndarray) -> Linear:
        key = name.removesuffix(".weight")
        if key not in matrices:
            raise Refused(f"kquant: {name}: no Q8_0 matrix of that name in the GGUF checkpoint")
        del weight_f32  # the dequantized copy of matrices[key]; the quantized operands are used
        return linear_class(key, matrices[key])

    return make_linear


def dequantized_weights(weights: KQuantWeights) -> dict[str, np.ndarray]:
    """float32 weights by Hugging Face name (``*.weight``): Q8_0 matrices dequantized, norms as is
    (what the reference layers read for norms, shapes and the embedding lookup)."""
    named = {f"{name}.weight": matrix.dequantize() for name, matrix in weights.matrices.items()}
    named.update(weights.vectors)
    return named


def decode_rows(layer: DecoderLayer, x: np.ndarray, positions: np.ndarray, cache: LayerKV,
                first_slot: int) -> np.ndarray:
    """Several new rows through one decoder layer at once: x [R, hidden] at RoPE ``positions``
    [R] -> x_out [R, hidden]; row r's K/V go to cache slot ``first_slot + r`` and it attends over
    slots 0..first_slot+r.

    Projections and the MLP run batched (row-invariant for the exact Q8_0 linears); attention
    runs per row with exactly :meth:`DecoderLayer.decode_row`'s shapes and ops. So each row is
    bit-identical to feeding the rows one at a time, which is what lets a speculative verifier
    score k+1 rows in one forward and still reproduce plain greedy decode bit for bit.
    (Slots and positions differ only for a draft whose context has a gap; see speculative.py.)
    """
    rows = x.shape[0]
    heads, kv_heads, head_dim = layer.heads, layer.kv_heads, layer.head_dim
    cos = layer.rope_cos[positions][:, None, :]  # [R, 1, head_dim]
    sin = layer.rope_sin[positions][:, None, :]
    h = layer.materialize(rms_norm(x, layer.attention_norm, layer.eps))  # [R, hidden]
    q, k, v = layer.qkv(h)  # [R, heads * hd], [R, kv * hd] x 2
    q = apply_rope(q.reshape(rows, heads, head_dim), cos, sin)  # [R, heads, hd]
    k = apply_rope(k.reshape(rows, kv_heads, head_dim), cos, sin)  # [R, kv, hd]
    v = v.reshape(rows, kv_heads, head_dim)  # [R, kv, hd]
    cache.write(first_slot, k.transpose(1, 0, 2), v.transpose(1, 0, 2))
    attended = np.empty((rows, heads * head_dim), dtype=np.float32)
    for row in range(rows):  # the decode_row attention, row by row
        attended[row] = layer.attend_row(q[row], cache, visible=first_slot + row + 1)[0]
    attended = layer.materialize(attended)
    x = layer.materialize(x + layer.o_proj(attended))
    return layer._mlp_residual(x)


class KQuantModel:
    """The k-quant target: GGUF Q8_0 weights in the reference engine's layers (prefill is the
    reference's batched prefill), a Q8_0 LM head in the same arithmetic (the embedding when tied,
    else ``lm_head``), and a batched row forward whose every row is bit-identical to one-row
    decode. Biases (Qwen2's Q/K/V) stay float32 and are added after their projections."""

    def __init__(self, weights: KQuantWeights, config: KQuantConfig, mode: ProducerMode) -> None:
        if not isinstance(mode, ProducerMode):
            raise Refused(f"kquant: producer mode: found {mode!r}, expected exact or native")
        geometry = ModelGeometry(layers=config.layers, hidden=config.hidden, heads=config.heads,
                                 kv_heads=config.kv_heads, head_dim=config.head_dim, vocab=config.vocab,
                                 max_positions=config.max_positions, rope_theta=config.rope_theta)
        self.mode = mode
        self.config = config
        self.geometry = geometry
        self.make_linear = linear_factory(weights.matrices, mode)
        dequantized = dequantized_weights(weights)
        self.reference = ReferenceEngine(geometry, dequantized, rms_norm_eps=config.rms_norm_eps,
                                         make_linear=self.make_linear, rope_scaling=config.rope_scaling)
        self.embed_table = self.reference.embed  # [vocab, hidden] float32, dequantized Q8_0 rows
        head = "lm_head.weight" if "lm_head" in weights.matrices else "model.embed_tokens.weight"  # untied, or tied
        self.lm_head = self.make_linear(head, dequantized[head])
        self.final_norm = weights.vectors["model.norm.weight"]  # [hidden]
        self.eps = np.float32(config.rms_norm_eps)
        self.abi = _target_abi(self.reference.abi, arithmetic_kind(self.lm_head, "lm_head"))

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """Token ids [R] -> embeddings float32 [R, hidden] (Q8_0 rows dequantized, as get_rows)."""
        rows: np.ndarray = self.embed_table[tokens]
        return rows

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """Last hidden states [R, hidden] (before the final norm) -> logits float32 [R, vocab]."""
        return self.lm_head(rms_norm(hidden, self.final_norm, self.eps))

    def forward_rows(self, cache: DecodeCache, tokens: np.ndarray) -> RowsOutput:
        """Feed ``tokens`` [R] at positions cache.length.. in one batched forward; append their
        K/V. Row r is bit-identical to feeding the tokens one at a time (exact mode)."""
        tokens = check_tokens(tokens, self.geometry.vocab, "tokens")
        start = cache.length
        if start + tokens.size > cache.capacity:
            raise Refused(f"decode cache: {tokens.size} tokens after {start} positions exceed "
                          f"capacity {cache.capacity}")
        positions = np.arange(start, start + tokens.size)
        x = self.embed(tokens)  # [R, hidden]
        for layer, layer_kv in zip(self.reference.layers, cache.layers, strict=True):
            x = decode_rows(layer, x, positions, layer_kv, start)
        cache.length = start + tokens.size
        return RowsOutput(logits=self.logits(x), hidden=x)


def load_kquant_model(mode: ProducerMode = ProducerMode.EXACT, model_dir: Path = assets.MODEL_DIR
                      ) -> KQuantModel:
    """The shipped target from ``model_dir/gguf/target-q8_0.gguf`` (shape facts from
    ``model_dir/config.json``), refusing a missing or malformed file."""
    config = config_from_json(Path(model_dir) / "config.json")
    weights = load_target_gguf(Path(model_dir) / "gguf" / TARGET_GGUF_NAME, config)
    return KQuantModel(weights, config, mode)


class KQuantEngine(GreedyDecoder):
    """Plain greedy engine on the k-quant target (Engine protocol), no draft: the
    ``kquant-native`` producer, and the plain-decode baseline speculative decode must equal."""

    name = "kquant-numpy"
    # Pure numpy, no thread pool or device: a forked child may run it (qualify.evidence.cold_ahead).
    fork_safe = True
    version = ENGINE_VERSION
    logit_units = "raw"

    def __init__(self, model: KQuantModel) -> None:
        self.model = model
        self.geometry = model.geometry
        self.abi = model.abi

    def prefill(self, tokens: np.ndarray) -> KVCache:
        """Target KV of exactly ``tokens`` (positions 0..len-1), canonical layout."""
        return self.model.reference.prefill(tokens)

    def _run(self, kv: KVCache, pending: np.ndarray, steps: int, forced: np.ndarray | None) -> DecodeResult:
        began = time.perf_counter()
        pending = self._tokens(pending, "pending tokens")
        cache = self.model.reference.new_cache(kv, extra_positions=pending.size + steps - 1)
        handed_off = cache.length
        logits = np.empty((steps, self.geometry.vocab), dtype=np.float32)
        tokens = np.empty(steps, dtype=np.int32)
        current = self.model.forward_rows(cache, pending).logits[-1]
        for step in range(steps):
            logits[step] = current
            tokens[step] = forced[step] if forced is not None else int(np.argmax(current))
            if step + 1 < steps:
                current = self.model.forward_rows(cache, tokens[step:step + 1]).logits[0]
        return finished_decode(self.name, tokens, logits, began=began, handed_off=handed_off,
                               pending_tokens=pending.size)


def build_kquant_engine(mode: ProducerMode = ProducerMode.EXACT, model_dir: Path = assets.MODEL_DIR
                        ) -> KQuantEngine:
    """A plain (non-speculative) k-quant engine; ``ProducerMode.NATIVE`` is the kquant-native
    producer whose KV must never pass for the exact lane's."""
    return KQuantEngine(load_kquant_model(mode, model_dir))

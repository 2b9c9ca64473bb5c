"""NVFP4 projections ``y[T, n_out] = x[T, n_in] @ W.T`` in four arithmetics, and their factories.

* ``exact`` (consumer and verification anchor): seed 003 section 7.4.2, the integer-exact a16-q8
  contraction. Activations become Q8_K integers per 256-value super-block (a shorter last one
  where a row is not a multiple of 256); each super-block's
  weight(q1 * q9) x activation(q8) sum is an exact integer (done as a float64 BLAS matmul, exact
  because every partial sum stays below 2^53, checked at construction); a pinned float32 epilogue
  (x 2^-10, x 1/iscale, x scale2, sequential add over super-blocks); output rounded through
  float16. Row t of y depends only on row t of x, bit for bit, whatever the batch or BLAS threads.
* ``splitk`` (native, mild): the same quantized operands dequantized to float32, each 64-wide K
  chunk contracted on its own and rounded to float32 (the machine-independent fixed-point
  contraction of ``qualify.core.numerics``), the chunks summed as a pairwise float32 tree
  (another reduction topology).
* ``f16`` (native, medium): ``splitk`` with both operands materialized in float16, and the
  engine's intermediates rounded through float16 (``qualify.engines.reference.RoundTripFloat16``).
* ``w4a4`` (native, harsh): seed section 7.4.3. Activations quantized per 16 values to E2M1 with
  an E4M3FN block scale under a global activation scale: ``1/input_scale_inv`` when the
  checkpoint carries one, else dynamic per row ``row amax / (6 * 448)`` (keeps rows independent).
  Integer sum of weight-q1 x act-q1 x weight-q9 x act-q9 (units 2^-20), epilogue x 2^-20,
  x weight scale2, x activation global scale, float16 output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal, get_args

import numpy as np

from qualify.core.errors import Refused
from qualify.core.numerics import FixedPointRows, matmul_rows
from qualify.engines.base import Linear, stacked_columns
from qualify.engines.nvfp4 import (
    BLOCK_SIZE,
    E2M1_MAX,
    E4M3FN_MAX,
    E4M3FN_Q9,
    Nvfp4Checkpoint,
    Nvfp4Tensor,
    dequantize_nvfp4,
    e2m1_q1,
    load_nvfp4_checkpoint,
    quantize_blocks_e2m1,
    validate_nvfp4_tensor,
)

Arithmetic = Literal["exact", "splitk", "f16", "w4a4"]
ARITHMETICS: tuple[str, ...] = get_args(Arithmetic)

SUPER_BLOCK = 256  # Q8_K activation super-block
Q8_MAX = 127
FLOAT64_EXACT_LIMIT = 2**53  # integers (and sums of them) below this are exact in float64
TWO_POW_M10 = np.float32(2.0**-10)  # q1 (2^-1) x q9 (2^-9)
TWO_POW_M20 = np.float32(2.0**-20)  # weight q1 q9 x activation q1 q9
W4A4_ACT_Q10_MAX = 12 * int(E4M3FN_Q9[0x7E])  # |act q1| <= 12 (6.0), |act q9| <= 448 * 2^9
SPLIT_K = 64


def _require_float64_exact(max_row_abs_q: int, operand_max: int, name: str) -> None:
    """Refuse unless every partial sum of a row contraction is an integer below 2^53."""
    bound = int(max_row_abs_q) * int(operand_max)
    if bound >= FLOAT64_EXACT_LIMIT:
        raise Refused(f"{name}: integer row bound {bound} >= 2^53; "
                      "a float64 contraction would not be exact")


def _activations_f32(x: np.ndarray, n_in: int, name: str) -> np.ndarray:
    """Refuse anything but finite float32 [T, n_in]."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != n_in:
        got = f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))}"
        raise Refused(f"{name}: activations must be float32 [T, {n_in}], got {got}")
    if not np.isfinite(x).all():
        raise Refused(f"{name}: activations contain non-finite values")
    return x


F16_MIN_NORMAL_BITS = np.uint32(0x38800000)  # float32 bits of 2^-14, the least float16 normal
F16_OVERFLOW_BITS = np.uint32(0x477FF000)  # float32 bits of 65520: at or above, float16 is inf
F16_CAST_SIZE = 4096  # up to this many values, numpy's own two casts are the faster path


def round_through_f16(values_f32: np.ndarray) -> np.ndarray:
    """float32 -> nearest float16 (ties to even) -> float32; bit-identical to
    ``astype(float16).astype(float32)`` but faster: zeros and float16-normal values round their
    float32 bit pattern to 10 mantissa bits; the rare rest (float16 subnormals, overflow, NaN)
    take ``astype``."""
    values = np.ascontiguousarray(values_f32, dtype=np.float32)
    if values.size <= F16_CAST_SIZE:  # a decode row: two casts cost less than the bit path's calls
        with np.errstate(over="ignore"):
            return values.astype(np.float16).astype(np.float32)
    bits = values.view(np.uint32)
    rounded = bits >> np.uint32(13)
    rounded &= np.uint32(1)  # lowest kept mantissa bit: a tie goes to even
    rounded += np.uint32(0x0FFF)
    rounded += bits
    rounded &= np.uint32(0xFFFFE000)
    out = rounded.view(np.float32)
    magnitude_bits = bits & np.uint32(0x7FFFFFFF)
    # Special unless F16_MIN_NORMAL_BITS <= magnitude < F16_OVERFLOW_BITS (one unsigned compare
    # after the shift) or the value is a zero.
    special = magnitude_bits - F16_MIN_NORMAL_BITS >= F16_OVERFLOW_BITS - F16_MIN_NORMAL_BITS
    special &= magnitude_bits != 0
    if special.any():
        with np.errstate(over="ignore"):
            out[special] = values[special].astype(np.float16).astype(np.float32)
    return out


def super_block_columns(n_in: int) -> list[slice]:
    """The Q8_K super-blocks along K: 256 columns each; a row whose length is not a multiple of
    256 (a 576-wide model) ends in one shorter block of the remaining columns (a multiple of 16),
    quantized and contracted by the same rule. llama.cpp has no Q8_K for such rows; rows that are
    multiples of 256 get exactly the super-blocks they always had."""
    return [slice(start, min(start + SUPER_BLOCK, n_in)) for start in range(0, n_in, SUPER_BLOCK)]


def quantize_activations_q8k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_K per super-block (:func:`super_block_columns`): signed first absolute maximum m,
    iscale = -127/m (float32), q = min(127, round-half-even(iscale * x)); the block scale is
    1/iscale (0 for an all-zero block, whose codes are 0). x float32 [T, n_in] -> q8 int8
    [T, n_in], q8_scale float32 [T, S]."""
    q8_values, q8_scale = _q8k_values(x)
    return q8_values.astype(np.int8), q8_scale


def _q8k_blocks(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_K of equal-width blocks float32 [T, S, width] -> integer-valued float32 codes of the same
    shape and float32 scales [T, S]."""
    rows, super_blocks, width = blocks.shape
    first_max_index = np.argmax(np.abs(blocks), axis=2)  # [T, S]; argmax keeps the first
    # One gather over the [T * S, width] view (take_along_axis builds its index grids per call).
    signed_max = blocks.reshape(-1, width)[np.arange(rows * super_blocks), first_max_index.ravel()]
    signed_max = signed_max.reshape(rows, super_blocks)  # [T, S]
    zero_block = signed_max == 0
    with np.errstate(divide="ignore"):
        iscale = np.where(zero_block, np.float32(0.0), np.float32(-Q8_MAX) / signed_max)
        q8_scale = np.where(zero_block, np.float32(0.0), np.float32(1.0) / iscale)
    q8 = blocks * iscale[:, :, None]
    np.rint(q8, out=q8)
    np.minimum(q8, Q8_MAX, out=q8)
    return q8, q8_scale.astype(np.float32)


def _q8k_values(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``quantize_activations_q8k`` with the codes left as integer-valued float32 [T, n_in]."""
    rows, n_in = x.shape
    whole = n_in - n_in % SUPER_BLOCK
    if whole == n_in:
        q8, q8_scale = _q8k_blocks(x.reshape(rows, n_in // SUPER_BLOCK, SUPER_BLOCK))
        return q8.reshape(rows, n_in), q8_scale
    parts = [_q8k_blocks(x[:, whole:].reshape(rows, 1, n_in - whole))]
    if whole:
        parts.insert(0, _q8k_blocks(np.ascontiguousarray(x[:, :whole]).reshape(rows, whole // SUPER_BLOCK, SUPER_BLOCK)))
    q8_values = np.concatenate([q8.reshape(rows, -1) for q8, _ in parts], axis=1)
    return q8_values, np.concatenate([scale for _, scale in parts], axis=1)


def _dequantized_q8_activations(x: np.ndarray) -> np.ndarray:
    """Q8_K round trip in float32 [T, n_in]: q8 * (1/iscale), the operand native lanes contract."""
    q8, q8_scale = _q8k_values(x)
    dequantized = np.empty_like(q8)
    for index, columns in enumerate(super_block_columns(x.shape[1])):
        np.multiply(q8[:, columns], q8_scale[:, index : index + 1], out=dequantized[:, columns])
    return dequantized


def _require_whole_blocks(tensor: Nvfp4Tensor) -> None:
    if tensor.n_in % BLOCK_SIZE:
        raise Refused(f"{tensor.name}: n_in {tensor.n_in} is not a multiple of the NVFP4 block {BLOCK_SIZE}")


class ExactA16Q8Linear:
    """Seed 003 section 7.4.2: integer-exact a16-q8 contraction with the pinned float32 epilogue.

    Holds the folded integer weight (e2m1_q1 * e4m3fn_q9, units 2^-10) as one float64 [width,
    n_out] block per activation super-block, so each super-block's integer sum is one exact BLAS
    matmul."""

    arithmetic = "exact"
    kind = "nvfp4-exact-a16q8-v1"

    def __init__(self, tensor: Nvfp4Tensor) -> None:
        validate_nvfp4_tensor(tensor)
        _require_whole_blocks(tensor)
        _require_float64_exact(tensor.max_row_abs_weight_q10(), Q8_MAX, tensor.name)
        self.name, self.n_in, self.n_out = tensor.name, tensor.n_in, tensor.n_out
        self.scale2: np.float32 | np.ndarray = tensor.scale2  # float32 [n_out] once stacked
        weight_q10_t = np.ascontiguousarray(tensor.weight_q10().T, np.float64)  # [n_in, n_out]
        # [width, n_out] per activation super-block: one exact integer matmul each
        self._columns = super_block_columns(self.n_in)
        self._weight_q10_t_by_super_block = [weight_q10_t[columns] for columns in self._columns]

    @classmethod
    def stack(cls, projections: Sequence[ExactA16Q8Linear]) -> ExactA16Q8Linear:
        """One linear whose output columns are ``projections``' side by side (q/k/v, gate/up),
        each column with its own projection's bits: its super-block sums are exact integers and
        its epilogue multiplies by its own ``scale2``, elementwise. The input is quantized once;
        the projections' weight blocks become views of the stacked ones (nothing held twice)."""
        stacked = cls.__new__(cls)
        stacked.name = " + ".join(projection.name for projection in projections)
        stacked.n_in, stacked.n_out = projections[0].n_in, sum(p.n_out for p in projections)
        stacked.scale2 = np.concatenate([np.full(p.n_out, p.scale2, dtype=np.float32) for p in projections])
        stacked._columns = projections[0]._columns
        stacked._weight_q10_t_by_super_block = [
            np.concatenate([p._weight_q10_t_by_super_block[s] for p in projections], axis=1)
            for s in range(len(stacked._columns))]
        for projection, own in zip(projections, stacked_columns(projections), strict=True):
            projection._weight_q10_t_by_super_block = [block[:, own] for block in stacked._weight_q10_t_by_super_block]
        return stacked

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x float32 [T, n_in] -> float32 [T, n_out] (values exactly representable in float16)."""
        x = _activations_f32(x, self.n_in, self.name)
        q8, q8_scale = _q8k_values(x)  # integer-valued [T, n_in], float32 [T, S]
        q8_f64 = q8.astype(np.float64)
        total = np.zeros((x.shape[0], self.n_out), dtype=np.float32)
        for s, (columns, weight_q10_t) in enumerate(zip(self._columns, self._weight_q10_t_by_super_block,
                                                        strict=True)):
            integer_total = q8_f64[:, columns] @ weight_q10_t  # [T, n_out], exact integers
            contribution = integer_total.astype(np.float32)  # exact integer, rounded once
            contribution *= TWO_POW_M10  # 1. x 2^-10
            contribution *= q8_scale[:, s : s + 1]  # 2. x activation scale 1/iscale
            contribution *= self.scale2  # 3. x tensor scale2
            total += contribution  # 4. sequential accumulation over super-blocks
        return round_through_f16(total)


def _pairwise_tree_sum(parts: list[np.ndarray]) -> np.ndarray:
    while len(parts) > 1:
        pairs = range(0, len(parts) - 1, 2)
        parts = [parts[i] + parts[i + 1] for i in pairs] + ([parts[-1]] if len(parts) % 2 else [])
    return parts[0]


class SplitKLinear:
    """Native ``splitk``: dequantized float32 operands (weights, Q8_K activations), one float32
    partial per 64-wide K chunk, summed as a pairwise tree; float16 output rounding."""

    arithmetic = "splitk"
    kind = "nvfp4-native-splitk64-tree-v2"
    operands_in_f16 = False

    def __init__(self, tensor: Nvfp4Tensor) -> None:
        validate_nvfp4_tensor(tensor)
        _require_whole_blocks(tensor)
        self.name, self.n_in, self.n_out = tensor.name, tensor.n_in, tensor.n_out
        weight = dequantize_nvfp4(tensor)  # float32 [n_out, n_in]
        if self.operands_in_f16:
            weight = round_through_f16(weight)
        # One fixed-point image per 64-wide K chunk: each chunk is its own contraction.
        self._weight_chunks = [FixedPointRows.of(weight[:, k : k + SPLIT_K])
                               for k in range(0, self.n_in, SPLIT_K)]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = _activations_f32(x, self.n_in, self.name)
        activations = _dequantized_q8_activations(x)  # float32 [T, n_in]
        if self.operands_in_f16:
            activations = round_through_f16(activations)
        partials = [  # float32 [T, n_out] per 64-wide K chunk, machine-independent
            matmul_rows(activations[:, index * SPLIT_K : (index + 1) * SPLIT_K], chunk)
            for index, chunk in enumerate(self._weight_chunks)
        ]
        return round_through_f16(_pairwise_tree_sum(partials))


class F16Linear(SplitKLinear):
    """Native ``f16``: ``splitk`` with weight and activation operands materialized in float16."""

    arithmetic = "f16"
    kind = "nvfp4-native-f16-operands-splitk64-tree-v2"
    operands_in_f16 = True


class W4A4Linear:
    """Native ``w4a4`` (seed section 7.4.3): E2M1 activations with E4M3FN scales per 16 values and
    a global activation scale; one exact integer sum per row (units 2^-20), float32 epilogue."""

    arithmetic = "w4a4"
    kind = "nvfp4-native-w4a4-v1"

    def __init__(self, tensor: Nvfp4Tensor) -> None:
        validate_nvfp4_tensor(tensor)
        _require_float64_exact(tensor.max_row_abs_weight_q10(), W4A4_ACT_Q10_MAX, tensor.name)
        self.name, self.n_in, self.n_out = tensor.name, tensor.n_in, tensor.n_out
        self.scale2, self.input_scale_inv = tensor.scale2, tensor.input_scale_inv
        self._weight_q10_t = tensor.weight_q10().T.astype(np.float64)  # [n_in, n_out]

    def quantize_activations(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """x float32 [T, n_in] -> activation q1*q9 (float64 [T, n_in], units 2^-10) and the global
        activation scale float32 [T, 1] (static 1/input_scale_inv, else dynamic row amax/2688)."""
        rows = x.shape[0]
        if self.input_scale_inv is not None:
            static_scale = np.float32(1.0) / self.input_scale_inv
            act_scale2 = np.full((rows, 1), static_scale, dtype=np.float32)
        else:
            act_scale2 = np.abs(x).max(axis=1, keepdims=True) / np.float32(E2M1_MAX * E4M3FN_MAX)
        codes, scale_bytes = quantize_blocks_e2m1(x, act_scale2)
        act_q10 = e2m1_q1(codes).reshape(rows, -1, BLOCK_SIZE) * E4M3FN_Q9[scale_bytes][:, :, None]
        return act_q10.reshape(rows, self.n_in).astype(np.float64), act_scale2.astype(np.float32)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = _activations_f32(x, self.n_in, self.name)
        act_q10, act_scale2 = self.quantize_activations(x)
        integer_total = act_q10 @ self._weight_q10_t  # [T, n_out], exact integers (2^-20 units)
        y = integer_total.astype(np.float32) * TWO_POW_M20
        y *= self.scale2
        y *= act_scale2
        return round_through_f16(y)


_LINEAR_BY_ARITHMETIC: dict[str, type[ExactA16Q8Linear] | type[SplitKLinear] | type[W4A4Linear]] = {
    "exact": ExactA16Q8Linear,
    "splitk": SplitKLinear,
    "f16": F16Linear,
    "w4a4": W4A4Linear,
}


def _require_arithmetic(arithmetic: str) -> None:
    if arithmetic not in ARITHMETICS:
        raise Refused(f"nvfp4 arithmetic: {arithmetic!r} is not one of {list(ARITHMETICS)}")


def nvfp4_linear_kind(arithmetic: Arithmetic) -> str:
    """The ``kind`` every projection of ``arithmetic`` declares (part of its engine's abi)."""
    _require_arithmetic(arithmetic)
    return _LINEAR_BY_ARITHMETIC[arithmetic].kind


def make_nvfp4_linear(tensor: Nvfp4Tensor, arithmetic: Arithmetic) -> Linear:
    """One NVFP4 Linear of the named arithmetic over ``tensor``."""
    _require_arithmetic(arithmetic)
    return _LINEAR_BY_ARITHMETIC[arithmetic](tensor)


def make_nvfp4_linear_factory(
    checkpoint: Nvfp4Checkpoint | str | Path, arithmetic: Arithmetic
) -> Callable[[str, np.ndarray | None], Linear]:
    """``make_linear(name, weight_f32) -> Linear`` for the reference engine. It ignores the float
    weight's values (the NVFP4 tensors of ``name`` are the weight) but refuses a shape mismatch or
    a name the checkpoint lacks. A W4A4 checkpoint (input_scale_inv present) admits only w4a4."""
    _require_arithmetic(arithmetic)
    if not isinstance(checkpoint, Nvfp4Checkpoint):
        checkpoint = load_nvfp4_checkpoint(checkpoint)
    where = checkpoint.path or "nvfp4 checkpoint"
    if checkpoint.activation_precision == "nvfp4" and arithmetic != "w4a4":
        raise Refused(f"{where}: activation_precision 'nvfp4' (W4A4) does not admit "
                      f"arithmetic {arithmetic!r}")

    def make_linear(name: str, weight_f32: np.ndarray | None = None) -> Linear:
        tensor = checkpoint.nvfp4.get(name)
        if tensor is None:
            raise Refused(f"{where}: no NVFP4 tensor named {name!r}")
        if weight_f32 is not None and tuple(np.shape(weight_f32)) != (tensor.n_out, tensor.n_in):
            raise Refused(f"{name}: float weight shape {list(np.shape(weight_f32))} does not "
                          f"match NVFP4 [{tensor.n_out}, {tensor.n_in}]")
        return make_nvfp4_linear(tensor, arithmetic)

    return make_linear

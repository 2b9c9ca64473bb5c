"""Float arithmetic whose bits do not depend on the machine: the numpy engines' only reductions and
transcendentals.

A float32 BLAS result depends on the kernel OpenBLAS picks for the CPU (or ``OPENBLAS_CORETYPE``)
and on how the work is split over threads; numpy's ``exp``, ``cos`` and reductions may dispatch
to other SIMD code paths on another CPU. None of that may move a judged bit, so the engines use:

* :func:`matmul_rows` and :func:`weighted_sum`: contractions that are *exact by
  construction*. Each vector of an operand (a row of activations, a weight row, one position's
  K or V) is scaled by a power of two and rounded (ties to even) to integers of ``LEFT_BITS`` /
  ``RIGHT_BITS`` bits (:class:`FixedPointRows`); every ``REDUCTION_CHUNK``-long integer dot
  product is then exact in float64 whatever order or kernel BLAS adds it with (every partial sum
  stays below 2^53), chunks are added left to right, and the result is scaled back and rounded
  once to float32. Its error is that of a float32 GEMM (each operand keeps 23 or 21 bits below
  its vector's largest magnitude). When a call's rows are small enough that no partial sum of a
  whole row can reach 2^53 (:func:`whole_rows_are_exact`, true of nearly every real call), the
  chunks' left-to-right sum is the exact integer too, and one BLAS call over the whole reduction
  gives the same bits with one pass over the right operand.
* :func:`tree_sum`: a pairwise sum over the last axis in a fixed order, built from elementwise
  adds (each one IEEE-rounded, so SIMD width cannot change it).
* :func:`exp` (float32) and :func:`cos_sin` (float64, rounded once to float32): polynomials
  after a Cody-Waite range reduction, from elementwise ``+ - * rint ldexp`` only; :func:`power`
  (RoPE's inverse frequencies, a few values per model) in decimal software arithmetic.

Elementwise ufuncs (add, multiply, divide, sqrt, maximum, rint, ldexp, casts) are correctly
rounded IEEE operations on every x86-64 SIMD path, so everything built from them is portable.
"""

from __future__ import annotations

import decimal
import math
from dataclasses import dataclass

import numpy as np

LEFT_BITS = 23  # |integer| <= 2^23 for the left operand (activations, probabilities)
RIGHT_BITS = 21  # |integer| <= 2^21 for the right operand (weights, keys, values)
REDUCTION_CHUNK = 256  # 2^8 terms: |sum| <= 2^(23 + 21 + 8) = 2^52 < 2^53, exact in float64
EXACT_INTEGER_BITS = 53  # every integer of magnitude below 2^53 is a float64
assert LEFT_BITS + RIGHT_BITS + REDUCTION_CHUNK.bit_length() - 1 < EXACT_INTEGER_BITS


@dataclass(frozen=True)
class FixedPointRows:
    """Vectors along the last axis as integers (float64, |value| <= 2^bits) times one power-of-two
    ``scale`` per vector: ``values ~= integers * scale``. A weight [n_out, n_in] is converted
    once; K and V are converted once per position ([kv_heads, positions, head_dim])."""

    integers: np.ndarray  # [..., N, K] float64, integer-valued
    scale: np.ndarray  # [..., N, 1] float64, powers of two

    @classmethod
    def of(cls, values: np.ndarray, bits: int = RIGHT_BITS, *, reuse: bool = False,
           nonnegative: bool = False) -> FixedPointRows:
        """Scale each vector so its largest magnitude becomes an integer of ``bits`` bits, then
        round every element to the nearest integer (ties to even). Multiplying by a power of two
        is exact, so the only rounding is ``rint``'s. ``reuse`` converts a float64 ``values`` in
        place (the caller's temporary); ``nonnegative`` is the caller's checked promise that no
        element is below zero, so a vector's largest magnitude is its maximum (one pass, not two)."""
        largest = values.max(axis=-1, keepdims=True)
        if not nonnegative:
            largest = np.maximum(largest, -values.min(axis=-1, keepdims=True))
        if not np.isfinite(largest).all():
            raise ValueError("fixed-point conversion: non-finite values")
        _, exponent = np.frexp(largest)  # largest = m * 2^exponent, m in [0.5, 1) (0 for 0)
        integers = values if reuse and values.dtype == np.float64 else values.astype(np.float64)
        integers *= np.ldexp(1.0, bits - exponent)
        np.rint(integers, out=integers)
        return cls(integers, np.ldexp(1.0, exponent - bits))

    def __getitem__(self, index: tuple[slice, ...]) -> FixedPointRows:
        """The same rows sliced (leading axes and the row axis only)."""
        return FixedPointRows(self.integers[index], self.scale[index])


def whole_rows_are_exact(left: np.ndarray, right_bits: int = RIGHT_BITS, *, nonnegative: bool = False) -> bool:
    """Whether every row of integer-valued ``left`` [..., M, K] times integers of at most
    ``right_bits`` bits stays below 2^53 at every partial sum, in any order: the row's absolute sum
    times 2^right_bits bounds them all. Then the whole dot product is exact in float64, equal to
    the chunked left-to-right sum, whatever BLAS kernel, blocking or thread split adds it.
    ``nonnegative``: the caller knows no integer is negative, so the row sums need no ``abs``."""
    if left.shape[-1] <= REDUCTION_CHUNK:
        return True
    row_sums = (left if nonnegative else np.abs(left)).sum(axis=-1)  # integers below 2^53: exact
    return bool(row_sums.max(initial=0.0) < 2.0 ** (EXACT_INTEGER_BITS - right_bits))


def _exact_product(left: np.ndarray, right_t: np.ndarray, whole_rows: bool) -> np.ndarray:
    """left [..., M, K] @ right_t [..., K, N] -> float64 [..., M, N], exact: each row of ``left``
    is integers times one power of two (its scale, or 1), each column of ``right_t`` integers of at
    most RIGHT_BITS bits times one power of two, so every partial sum is an integer times the
    row's and the column's scales. ``whole_rows`` (:func:`whole_rows_are_exact` of the integers):
    one BLAS call, exact whatever order it adds in. Else each REDUCTION_CHUNK-long partial sum is
    exact (its integer below 2^53) and the chunks are added left to right; both give the same bits
    whenever the first applies, and a power-of-two scale commutes with every one of those roundings."""
    if whole_rows:
        return np.asarray(left @ right_t)
    total = left[..., :REDUCTION_CHUNK] @ right_t[..., :REDUCTION_CHUNK, :]
    for start in range(REDUCTION_CHUNK, left.shape[-1], REDUCTION_CHUNK):
        total += left[..., start:start + REDUCTION_CHUNK] @ right_t[..., start:start + REDUCTION_CHUNK, :]
    return np.asarray(total)


def matmul_rows(a: np.ndarray, b: FixedPointRows) -> np.ndarray:
    """a [..., M, K] @ b.T, with b given as rows [..., N, K] (one scale per column of b.T), ->
    float32 [..., M, N]: a projection ``x @ W.T`` or attention scores ``q @ K.T``. Row m of the
    result depends on row m of ``a`` alone, so one row or many give the same bits."""
    left = FixedPointRows.of(a, LEFT_BITS)
    whole_rows = whole_rows_are_exact(left.integers)
    scaled_left = np.multiply(left.integers, left.scale, out=left.integers)  # exact: powers of two
    total = _exact_product(scaled_left, np.swapaxes(b.integers, -1, -2), whole_rows)
    result = np.empty(total.shape, dtype=np.float32)
    # The column scales (exact: powers of two), then the one rounding to float32, in one pass.
    np.multiply(total, np.swapaxes(b.scale, -1, -2), out=result, casting="same_kind")
    return result


def weighted_sum(weights: np.ndarray, values: FixedPointRows) -> np.ndarray:
    """weights [..., M, K] @ values [..., K, N], the values converted per row (per position, one
    scale each): attention's probabilities times V. Each value row's scale is folded into the
    weights first (exact in float64), then the weights are converted per row."""
    # Probabilities are never negative; checked on the float32 weights (half the bytes), it lets
    # the conversion and the exactness bound skip a pass each over the float64 rows.
    nonnegative = bool(weights.min(initial=0.0) >= 0)  # False for a NaN, which the conversion refuses
    folded = np.multiply(weights, np.swapaxes(values.scale, -1, -2), dtype=np.float64)  # [..., M, K], exact
    left = FixedPointRows.of(folded, LEFT_BITS, reuse=True, nonnegative=nonnegative)
    whole_rows = whole_rows_are_exact(left.integers, nonnegative=nonnegative)
    total = _exact_product(left.integers, values.integers, whole_rows)
    total *= left.scale
    return total.astype(np.float32)


def tree_sum(x: np.ndarray) -> np.ndarray:
    """Sum over the last axis, keepdims, as a fixed pairwise tree of elementwise adds: the upper
    half is folded onto the lower half until one column is left (an odd last column waits)."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        folded = x[..., :half] + x[..., half:2 * half]
        x = np.concatenate([folded, x[..., 2 * half:]], axis=-1) if x.shape[-1] % 2 else folded
    return x


# exp: x = n ln2 + r with |r| <= ln2/2, exp(x) = 2^n p(r); ln2 split so that n * LN2_HIGH is exact
# in float32 (|n| <= 150 needs 8 bits; LN2_HIGH has 16). Degree-7 Taylor: truncation 5e-9 relative.
LOG2_E = np.float32(1.4426950408889634)
LN2_HIGH = np.float32(0.693145751953125)
LN2_LOW = np.float32(1.428606765330187045e-06)
EXP_TAYLOR = [np.float32(1.0 / math.factorial(k)) for k in range(7, -1, -1)]
EXP_CLAMP = (np.float32(-104.0), np.float32(89.0))  # exp rounds to 0 below, to inf above
# Elements per pass: the temporaries stay in cache. 2^15 measured 5-15 % faster than 2^14 and
# 2^16 on a 2,048-key prefill block and a decode row's scores (one chunk then), same bits.
EXP_CHUNK = 1 << 15


def exp(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """exp of float32 ``x`` -> float32 (within 1.3 ULP of the true value; -inf -> 0, +inf ->
    inf), from elementwise float32 ``* + rint ldexp`` only, in cache-sized chunks. ``out``: a
    C-contiguous float32 array of x's shape to write into, ``x`` itself included (each chunk is
    read before it is written)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if out is None:
        out = np.empty_like(x)
    elif out.dtype != np.float32 or out.shape != x.shape or not out.flags.c_contiguous:
        raise ValueError("exp: out must be C-contiguous float32 of the input's shape")
    flat_in, flat_out = x.reshape(-1), out.reshape(-1)
    for start in range(0, flat_in.size, EXP_CHUNK):
        v = np.maximum(flat_in[start:start + EXP_CHUNK], EXP_CLAMP[0])
        np.minimum(v, EXP_CLAMP[1], out=v)
        n = v * LOG2_E
        np.rint(n, out=n)
        r = n * LN2_HIGH
        np.subtract(v, r, out=r)
        r -= n * LN2_LOW
        p = r * EXP_TAYLOR[0]
        p += EXP_TAYLOR[1]
        for coefficient in EXP_TAYLOR[2:]:
            p *= r
            p += coefficient
        with np.errstate(over="ignore"):
            np.ldexp(p, n.astype(np.int32), out=flat_out[start:start + EXP_CHUNK])
    return out


def power(base: float, exponents: np.ndarray) -> np.ndarray:
    """float32 ``base ** exponents``, each power correctly rounded to float64 in decimal arithmetic
    (software, so the same digits on every machine) and then rounded to float32. numpy's own
    float32 ``power`` dispatches to SIMD code whose last bit depends on the CPU: with AVX-512 it
    differs from the scalar result at some RoPE exponents (theta 100000, head_dim 64)."""
    context = decimal.Context(prec=40)
    powers = [float(context.power(decimal.Decimal(float(base)), decimal.Decimal(float(exponent))))
              for exponent in np.asarray(exponents, dtype=np.float32).ravel()]
    return np.array(powers, dtype=np.float64).astype(np.float32).reshape(np.shape(exponents))


# cos/sin: x = n pi/2 + r, |r| <= pi/4, three-part pi/2 (fdlibm's) so n * part is exact for the
# angles RoPE uses (|x| < 2^20).
PIO2_1 = 1.57079632673412561417e+00
PIO2_2 = 6.07710050650619224932e-11
PIO2_3 = 2.02226624879595063154e-21
SIN_TAYLOR = [(-1.0) ** k / math.factorial(2 * k + 1) for k in range(10, -1, -1)]
COS_TAYLOR = [(-1.0) ** k / math.factorial(2 * k) for k in range(10, -1, -1)]


def _even_polynomial(r2: np.ndarray, coefficients: list[float]) -> np.ndarray:
    p = np.full_like(r2, coefficients[0])
    for coefficient in coefficients[1:]:
        p *= r2
        p += coefficient
    return p


def cos_sin(angles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of float32 ``angles`` (|angle| < 2^20) -> float32 each, Taylor polynomials of
    degree 20/21 in float64 after a three-part Cody-Waite reduction by pi/2."""
    x = angles.astype(np.float64)
    if not np.all(np.abs(x) < 2.0**20):
        raise ValueError("cos_sin: angles must be finite and below 2^20 in magnitude")
    n = np.rint(x * (2.0 / np.pi))
    r = x - n * PIO2_1
    r -= n * PIO2_2
    r -= n * PIO2_3
    r2 = r * r
    sin_r = r * _even_polynomial(r2, SIN_TAYLOR)
    cos_r = _even_polynomial(r2, COS_TAYLOR)
    quadrant = n.astype(np.int64) % 4
    cos = np.choose(quadrant, [cos_r, -sin_r, -cos_r, sin_r])
    sin = np.choose(quadrant, [sin_r, cos_r, -sin_r, -cos_r])
    return cos.astype(np.float32), sin.astype(np.float32)

"""The NVFP4 weight format of seed 003: E2M1 codes, E4M3FN block scales, a per-tensor scale2.

A weight ``W[n_out, n_in]`` is stored as 4-bit E2M1 codes packed two per byte (lo nibble = even
column), one E4M3FN scale byte per 16 consecutive values of a row, and one float32 ``scale2`` per
tensor. Dequantization order is pinned: ``(e2m1 * e4m3fn) * scale2`` in float32, never regrouped.
Quantization follows the ModelOpt recipe with ties-to-even at every E2M1 midpoint.

Every decoded quantity also has an integer twin: E2M1 in units of 2^-1 (``e2m1_q1``) and E4M3FN
in units of 2^-9 (``e4m3fn_q9``), so block contractions can be done as exact integer sums.

Checkpoint (safetensors, seed 003 section 7.3 names): ``<name>`` U8 payload ``[n_out, n_in/2]``;
``<name>.nvfp4_scale`` F8_E4M3 with header shape ``[n_in/16, n_out]`` (element ``[b, o]`` is the
scale of block b of row o); ``<name>.nvfp4_scale2`` F32 scalar; optional
``<name>.nvfp4_input_scale_inv`` F32 scalar (W4A4 only). Every other tensor is F16 (embeddings,
tied head, norms). Metadata ``weight_precision`` must be ``nvfp4``; ``activation_precision`` is
``a16`` (weight-only, no input_scale_inv anywhere) or ``nvfp4`` (input_scale_inv on every tensor).
Loading fails closed: one-line ``Refused`` naming the tensor.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors import deserialize

from qualify.core.errors import Refused, one_line

BLOCK_SIZE = 16  # values per E4M3FN scale
E2M1_MAX = 6.0
E4M3FN_MAX = 448.0
E4M3FN_MAX_BYTE = 0x7E  # +448, the saturation code
E4M3FN_NAN_BYTES = (0x7F, 0xFF)

SCALE_SUFFIX = ".nvfp4_scale"
SCALE2_SUFFIX = ".nvfp4_scale2"
INPUT_SCALE_INV_SUFFIX = ".nvfp4_input_scale_inv"
COMPANION_SUFFIXES = (SCALE_SUFFIX, SCALE2_SUFFIX, INPUT_SCALE_INV_SUFFIX)

WEIGHT_PRECISION_KEY = "weight_precision"
ACTIVATION_PRECISION_KEY = "activation_precision"
WEIGHT_PRECISION_NVFP4 = "nvfp4"
ACTIVATION_PRECISIONS = ("a16", "nvfp4")  # a16: weight-only W4A16; nvfp4: W4A4

# --- E2M1 ---------------------------------------------------------------------------------------

# Code c (4 bits: sign, 2 exponent, 1 mantissa) -> value. Codes 8..15 are the negatives of 0..7.
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)
# Integer twin: value in units of 2^-1 (exact: every E2M1 value is a multiple of 0.5).
E2M1_Q1 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int64)
# Magnitude midpoints between consecutive codes 0..7 (ModelOpt ``e2m1_bounds``). A value exactly
# on a midpoint goes to the even code: down at 0.25, 1.25, 2.5, 5.0; up at 0.75, 1.75, 3.5.
E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
_E2M1_MIDPOINTS_ROUNDING_UP = np.array([0.75, 1.75, 3.5], dtype=np.float32)
_E2M1_THRESHOLDS = tuple((midpoint, bool(np.isin(midpoint, _E2M1_MIDPOINTS_ROUNDING_UP)))
                         for midpoint in E2M1_MIDPOINTS)  # (midpoint, whether a tie rounds up)


def e2m1_decode(codes: np.ndarray) -> np.ndarray:
    """E2M1 codes (uint8, 0..15) -> float32 values."""
    values: np.ndarray = E2M1_VALUES[np.asarray(codes, dtype=np.uint8) & 0xF]
    return values


def e2m1_q1(codes: np.ndarray) -> np.ndarray:
    """E2M1 codes -> int64 values in units of 2^-1 (the exact integer twin of ``e2m1_decode``)."""
    values: np.ndarray = E2M1_Q1[np.asarray(codes, dtype=np.uint8) & 0xF]
    return values


def e2m1_round(values_f32: np.ndarray) -> np.ndarray:
    """float32 -> nearest E2M1 code (uint8), ties to even, saturating at +-6; sign from ``x < 0``.

    Same decisions as ModelOpt ``_cast_fp4``: -0.0 maps to code 0, a small negative to code 8.
    """
    values = np.asarray(values_f32, dtype=np.float32)
    if np.isnan(values).any():
        raise Refused("e2m1_round: NaN value; E2M1 has no NaN")
    magnitude = np.abs(values)
    # The code's magnitude is the number of midpoints it lies above (at or above one that rounds
    # up): seven elementwise compares, several times faster than a binary search per value.
    index = np.zeros(values.shape, dtype=np.uint8)
    for midpoint, rounds_up in _E2M1_THRESHOLDS:
        index += magnitude >= midpoint if rounds_up else magnitude > midpoint
    return index | ((values < 0).astype(np.uint8) << 3)


def pack_e2m1(codes: np.ndarray) -> np.ndarray:
    """Codes uint8 [rows, n] (n even) -> packed uint8 [rows, n/2]; lo nibble = even column."""
    codes = np.asarray(codes, dtype=np.uint8)
    return (codes[:, 0::2] & 0xF) | ((codes[:, 1::2] & 0xF) << 4)


def unpack_e2m1(packed: np.ndarray) -> np.ndarray:
    """Packed uint8 [rows, n/2] -> codes uint8 [rows, n]; even column from the lo nibble."""
    packed = np.asarray(packed, dtype=np.uint8)
    codes = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.uint8)
    codes[:, 0::2] = packed & 0xF
    codes[:, 1::2] = packed >> 4
    return codes


# --- E4M3FN -------------------------------------------------------------------------------------


def _e4m3fn_table() -> tuple[np.ndarray, np.ndarray]:
    """Decode tables for all 256 bytes: float32 values (NaN at 0x7f/0xff) and int64 units of 2^-9.

    Normal: (1 + m/8) * 2^(e-7) = (8 + m) << (e - 1) units of 2^-9; subnormal (e = 0): m units.
    """
    values = np.empty(256, dtype=np.float32)
    q9 = np.zeros(256, dtype=np.int64)
    for byte in range(256):
        sign = -1 if byte & 0x80 else 1
        exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
        if byte in E4M3FN_NAN_BYTES:
            values[byte] = np.nan
            continue
        units = mantissa if exponent == 0 else (8 + mantissa) << (exponent - 1)
        q9[byte] = sign * units
        values[byte] = np.float32(sign * math.ldexp(units, -9))
    return values, q9


E4M3FN_VALUES, E4M3FN_Q9 = _e4m3fn_table()
E4M3FN_VALUES.flags.writeable = False
E4M3FN_Q9.flags.writeable = False
_E4M3FN_POSITIVE = E4M3FN_VALUES[:0x7F].astype(np.float64)  # bytes 0x00..0x7e, increasing


def _refuse_nan_scale_bytes(scale_bytes: np.ndarray, what: str) -> None:
    nan_mask = (scale_bytes & 0x7F) == 0x7F
    if nan_mask.any():
        where = tuple(int(i) for i in np.argwhere(nan_mask)[0])
        byte = int(scale_bytes[where])
        raise Refused(f"{what}: E4M3FN NaN byte 0x{byte:02x} at index {list(where)}")


def e4m3fn_decode(scale_bytes: np.ndarray, what: str = "e4m3fn") -> np.ndarray:
    """E4M3FN bytes -> float32 values; refuses NaN bytes 0x7f/0xff (``what`` names the source)."""
    scale_bytes = np.asarray(scale_bytes, dtype=np.uint8)
    _refuse_nan_scale_bytes(scale_bytes, what)
    values: np.ndarray = E4M3FN_VALUES[scale_bytes]
    return values


def e4m3fn_q9(scale_bytes: np.ndarray, what: str = "e4m3fn") -> np.ndarray:
    """E4M3FN bytes -> int64 values in units of 2^-9 (exact twin of ``e4m3fn_decode``)."""
    scale_bytes = np.asarray(scale_bytes, dtype=np.uint8)
    _refuse_nan_scale_bytes(scale_bytes, what)
    values: np.ndarray = E4M3FN_Q9[scale_bytes]
    return values


def e4m3fn_encode(values_f32: np.ndarray) -> np.ndarray:
    """float32 -> E4M3FN bytes: round to nearest, ties to even code, saturating at +-448.

    NaN is refused (the format's NaN bytes are never produced); -0.0 keeps its sign bit.
    """
    values = np.asarray(values_f32, dtype=np.float32)
    if np.isnan(values).any():
        raise Refused("e4m3fn_encode: NaN value; scales must be finite")
    magnitude = np.minimum(np.abs(values).astype(np.float64), E4M3FN_MAX)
    upper = np.searchsorted(_E4M3FN_POSITIVE, magnitude, side="left")  # first code >= magnitude
    upper = np.minimum(upper, E4M3FN_MAX_BYTE)
    lower = np.maximum(upper - 1, 0)
    # Midpoints of adjacent E4M3FN values are exact in float64, so the comparison is exact.
    midpoint = (_E4M3FN_POSITIVE[lower] + _E4M3FN_POSITIVE[upper]) / 2.0
    exact_hit = _E4M3FN_POSITIVE[upper] == magnitude
    take_upper = exact_hit | (magnitude > midpoint) | ((magnitude == midpoint) & (upper % 2 == 0))
    code = np.where(take_upper, upper, lower).astype(np.uint8)
    return code | (np.signbit(values).astype(np.uint8) << 7)


# --- one quantized tensor -----------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Nvfp4Tensor:
    """One NVFP4 weight: packed codes uint8 [n_out, n_in/2], E4M3FN scale bytes uint8
    [n_out, n_in/16] (row-contiguous, block b of row o at [o, b]), float32 ``scale2``, and the
    optional W4A4 ``input_scale_inv``."""

    packed: np.ndarray
    scale_bytes: np.ndarray
    scale2: np.float32
    input_scale_inv: np.float32 | None = None
    name: str = "nvfp4"

    @property
    def n_out(self) -> int:
        return int(self.packed.shape[0])

    @property
    def n_in(self) -> int:
        return int(self.packed.shape[1]) * 2

    def codes(self) -> np.ndarray:
        """E2M1 codes uint8 [n_out, n_in]."""
        return unpack_e2m1(self.packed)

    def scales_f32(self) -> np.ndarray:
        """Decoded block scales float32 [n_out, n_in/16]."""
        return e4m3fn_decode(self.scale_bytes, f"{self.name}{SCALE_SUFFIX}")

    def scales_q9(self) -> np.ndarray:
        """Block scales int64 [n_out, n_in/16] in units of 2^-9."""
        return e4m3fn_q9(self.scale_bytes, f"{self.name}{SCALE_SUFFIX}")

    def max_row_abs_weight_q10(self) -> int:
        """max over rows of sum_i |e2m1_q1 * e4m3fn_q9| (units 2^-10), without folding the matrix:
        the operand bound that decides whether a float64 integer contraction is exact."""
        abs_q1 = np.abs(E2M1_Q1).astype(np.uint8)[self.codes()].reshape(self.n_out, -1, BLOCK_SIZE)
        block_abs_q1 = abs_q1.sum(axis=2, dtype=np.int64)  # [n_out, n_in/16]
        return int((block_abs_q1 * np.abs(self.scales_q9())).sum(axis=1).max())

    def weight_q10(self) -> np.ndarray:
        """Folded integer weight int64 [n_out, n_in]: e2m1_q1 * e4m3fn_q9, units of 2^-10.

        Times scale2 this is the dequantized weight; it is what exact contractions multiply."""
        q1 = e2m1_q1(self.codes()).reshape(self.n_out, -1, BLOCK_SIZE)
        folded: np.ndarray = (q1 * self.scales_q9()[:, :, None]).reshape(self.n_out, self.n_in)
        return folded


def validate_nvfp4_tensor(tensor: Nvfp4Tensor) -> None:
    """Refuse (one line naming the tensor) unless dtypes, shapes, scale bytes and scalars hold."""
    name = tensor.name
    packed, scale_bytes = tensor.packed, tensor.scale_bytes
    if not isinstance(packed, np.ndarray) or packed.dtype != np.uint8 or packed.ndim != 2:
        raise Refused(f"{name}: payload must be uint8 [n_out, n_in/2]")
    if packed.shape[0] < 1 or packed.shape[1] < 1 or packed.shape[1] % (BLOCK_SIZE // 2):
        raise Refused(f"{name}: payload shape {list(packed.shape)} is not [n_out, n_in/2] "
                      "with n_in % 16 == 0")
    expected_scale = (packed.shape[0], packed.shape[1] * 2 // BLOCK_SIZE)
    if not isinstance(scale_bytes, np.ndarray) or scale_bytes.dtype != np.uint8:
        raise Refused(f"{name}{SCALE_SUFFIX}: must be E4M3FN bytes (uint8)")
    if scale_bytes.shape != expected_scale:
        raise Refused(f"{name}{SCALE_SUFFIX}: shape {list(scale_bytes.shape)}, "
                      f"expected {list(expected_scale)}")
    _refuse_nan_scale_bytes(scale_bytes, f"{name}{SCALE_SUFFIX}")
    _require_positive_scalar(tensor.scale2, f"{name}{SCALE2_SUFFIX}")
    if tensor.input_scale_inv is not None:
        _require_positive_scalar(tensor.input_scale_inv, f"{name}{INPUT_SCALE_INV_SUFFIX}")


def _require_positive_scalar(value: object, what: str) -> None:
    if not isinstance(value, np.float32):
        raise Refused(f"{what}: must be a float32 scalar, got {type(value).__name__}")
    if not (np.isfinite(value) and value > 0):
        raise Refused(f"{what}: must be finite and positive, got {float(value)!r}")


def quantize_blocks_e2m1(
    values_f32: np.ndarray, scale2_f32: np.ndarray | np.float32
) -> tuple[np.ndarray, np.ndarray]:
    """ModelOpt block recipe for rows [R, n] under global scales scale2 [R, 1] (or scalar):
    block scale = E4M3FN(block amax / (6 * scale2)) (zero -> 1.0), codes = round_e2m1(v / (scale *
    scale2)). Returns codes uint8 [R, n] and scale bytes uint8 [R, n/16]. A zero divisor (all-zero
    row, or a scale that underflows E4M3FN) yields code 0: any code would decode to 0 there."""
    values = np.asarray(values_f32, dtype=np.float32)
    rows, n = values.shape
    blocks = values.reshape(rows, n // BLOCK_SIZE, BLOCK_SIZE)
    scale2 = np.asarray(scale2_f32, dtype=np.float32).reshape(-1, 1)
    block_amax = np.abs(blocks).max(axis=2)  # [R, n/16]
    with np.errstate(divide="ignore", invalid="ignore"):
        block_scale = block_amax / (np.float32(E2M1_MAX) * scale2)
    block_scale = np.where(block_amax == 0, np.float32(1.0), block_scale)  # ModelOpt: zero -> 1.0
    scale_bytes = e4m3fn_encode(block_scale)
    divisor = (E4M3FN_VALUES[scale_bytes] * scale2)[:, :, None]  # [R, n/16, 1] float32
    with np.errstate(divide="ignore", invalid="ignore"):
        quotient = np.where(divisor == 0, np.float32(0.0), blocks / divisor)
    codes = e2m1_round(quotient.astype(np.float32)).reshape(rows, n)
    return codes, scale_bytes


def quantize_nvfp4(weight_f32: np.ndarray, name: str = "nvfp4") -> Nvfp4Tensor:
    """Quantize float32 [n_out, n_in] (n_in % 16 == 0) with the standard recipe:
    scale2 = amax / (6 * 448); per-16 scale = E4M3FN(block amax / (6 * scale2)); E2M1 codes."""
    weight = np.asarray(weight_f32)
    if weight.dtype != np.float32 or weight.ndim != 2:
        raise Refused(f"{name}: quantize_nvfp4 needs float32 [n_out, n_in], "
                      f"got {weight.dtype} {list(weight.shape)}")
    if weight.shape[0] < 1 or weight.shape[1] < BLOCK_SIZE or weight.shape[1] % BLOCK_SIZE:
        raise Refused(f"{name}: n_in {weight.shape[1]} must be a positive multiple of {BLOCK_SIZE}")
    if not np.isfinite(weight).all():
        raise Refused(f"{name}: weight has non-finite values")
    amax = np.abs(weight).max()
    if amax == 0:
        raise Refused(f"{name}: weight is all zero; scale2 would not be positive")
    scale2 = np.float32(amax / np.float32(E2M1_MAX * E4M3FN_MAX))
    codes, scale_bytes = quantize_blocks_e2m1(weight, scale2)
    tensor = Nvfp4Tensor(pack_e2m1(codes), scale_bytes, scale2, None, name)
    validate_nvfp4_tensor(tensor)
    return tensor


def dequantize_nvfp4(tensor: Nvfp4Tensor) -> np.ndarray:
    """float32 [n_out, n_in] in the pinned order ``(e2m1 * e4m3fn) * scale2``."""
    values = e2m1_decode(tensor.codes()).reshape(tensor.n_out, -1, BLOCK_SIZE)
    scaled = values * tensor.scales_f32()[:, :, None]  # exact in float32
    weight: np.ndarray = (scaled * tensor.scale2).reshape(tensor.n_out, tensor.n_in)
    return weight


# --- safetensors I/O ----------------------------------------------------------------------------

# safetensors header dtype -> numpy storage dtype (F8_E4M3 held as its raw E4M3FN bytes)
_ST_DTYPES: dict[str, np.dtype] = {
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "U8": np.dtype("u1"),
    "F8_E4M3": np.dtype("u1"),
}


@dataclass(frozen=True, eq=False)
class StoredTensor:
    """One safetensors entry: header dtype (``F16``, ``F32``, ``U8``, ``F8_E4M3``) and its array
    (F8_E4M3 held as raw uint8 bytes)."""

    dtype: str
    array: np.ndarray


def write_safetensors(
    path: str | Path, tensors: Mapping[str, StoredTensor], metadata: Mapping[str, str]
) -> None:
    """Write entries with exact header dtypes (F8_E4M3 included), byte-deterministically.

    safetensors' own writer orders metadata keys by a hash map, so equal inputs gave different
    bytes; this writer emits the header JSON with sorted keys (spaces pad it to 8 bytes) and the
    data in name order, then reads the file back through safetensors to prove it well-formed."""
    header: dict[str, object] = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    chunks: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        stored = tensors[name]
        if stored.dtype not in _ST_DTYPES:
            raise Refused(f"{name}: cannot write safetensors dtype {stored.dtype!r}")
        array = np.asarray(stored.array).astype(_ST_DTYPES[stored.dtype], copy=False)
        data = array.tobytes(order="C")
        header[name] = {"dtype": stored.dtype, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    header_bytes = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as handle:
        handle.write(struct.pack("<Q", len(header_bytes)) + header_bytes)
        for data in chunks:
            handle.write(data)
    read_safetensors(partial)
    partial.replace(path)


def read_safetensors(path: str | Path) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """Read every entry (F8_E4M3 as raw uint8) and the metadata; refuse unknown dtypes.

    safetensors' numpy API cannot return F8 tensors, so tensors come from ``deserialize`` (raw
    bytes, header validated by safetensors) and metadata from the stdlib-parsed JSON header."""
    try:
        data = Path(path).read_bytes()
        (header_len,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + header_len].decode("utf-8"))
        entries = deserialize(data)  # type: ignore[no-untyped-call]  # safetensors leaves it unannotated
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        raise Refused(one_line(f"{path}: not a readable safetensors file ({reason})")) from None
    metadata = header.get("__metadata__") or {}
    tensors: dict[str, StoredTensor] = {}
    for name, entry in entries:
        if entry["dtype"] not in _ST_DTYPES:
            raise Refused(f"{path}: tensor {name}: unsupported dtype {entry['dtype']}")
        storage_dtype = _ST_DTYPES[entry["dtype"]]
        array = np.frombuffer(bytes(entry["data"]), dtype=storage_dtype).reshape(entry["shape"])
        tensors[name] = StoredTensor(entry["dtype"], array)
    return tensors, dict(metadata)


@dataclass(frozen=True, eq=False)
class Nvfp4Checkpoint:
    """A loaded, validated NVFP4 checkpoint: quantized projections by name, F16 tensors
    (embeddings/tied head, norms) by name, and the safetensors metadata."""

    nvfp4: Mapping[str, Nvfp4Tensor]
    dense_f16: Mapping[str, np.ndarray]
    metadata: Mapping[str, str] = field(default_factory=dict)
    path: Path | None = None

    @property
    def activation_precision(self) -> str:
        return self.metadata[ACTIVATION_PRECISION_KEY]


def nvfp4_checkpoint_entries(
    nvfp4: Mapping[str, Nvfp4Tensor], dense_f16: Mapping[str, np.ndarray]
) -> dict[str, StoredTensor]:
    """The safetensors entries of a checkpoint (names per seed 003 section 7.3)."""
    entries: dict[str, StoredTensor] = {}
    for name, tensor in nvfp4.items():
        validate_nvfp4_tensor(tensor)
        entries[name] = StoredTensor("U8", tensor.packed)
        # The scale is stored [n_in/16, n_out] (seed order): element [b, o] is block b of row o.
        entries[name + SCALE_SUFFIX] = StoredTensor("F8_E4M3", tensor.scale_bytes.T)
        entries[name + SCALE2_SUFFIX] = StoredTensor("F32", np.array(tensor.scale2, np.float32))
        if tensor.input_scale_inv is not None:
            entries[name + INPUT_SCALE_INV_SUFFIX] = StoredTensor(
                "F32", np.array(tensor.input_scale_inv, dtype=np.float32)
            )
    for name, array in dense_f16.items():
        if name in entries:
            raise Refused(f"{name}: both an NVFP4 and a dense tensor")
        if np.asarray(array).dtype != np.float16:
            raise Refused(f"{name}: dense tensors must be float16, got {np.asarray(array).dtype}")
        entries[name] = StoredTensor("F16", np.asarray(array))
    return entries


def write_nvfp4_checkpoint(
    path: str | Path,
    nvfp4: Mapping[str, Nvfp4Tensor],
    dense_f16: Mapping[str, np.ndarray],
    extra_metadata: Mapping[str, str] | None = None,
) -> None:
    """Write a checkpoint whose metadata pairs with its tensors (weight/activation precision)."""
    if not nvfp4:
        raise Refused(f"{path}: an NVFP4 checkpoint needs at least one NVFP4 tensor")
    with_input_scale = {t.input_scale_inv is not None for t in nvfp4.values()}
    if len(with_input_scale) != 1:
        raise Refused(f"{path}: input_scale_inv must be on every NVFP4 tensor or on none")
    metadata = {"format": "pt", **(extra_metadata or {})}
    metadata[WEIGHT_PRECISION_KEY] = WEIGHT_PRECISION_NVFP4
    metadata[ACTIVATION_PRECISION_KEY] = "nvfp4" if with_input_scale == {True} else "a16"
    write_safetensors(path, nvfp4_checkpoint_entries(nvfp4, dense_f16), metadata)


def _companion_base(name: str) -> str | None:
    for suffix in COMPANION_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return None


def _scalar_f32(tensors: Mapping[str, StoredTensor], name: str, path: Path) -> np.float32:
    stored = tensors[name]
    if stored.dtype != "F32" or stored.array.shape != ():
        raise Refused(f"{path}: tensor {name}: must be an F32 scalar, "
                      f"got {stored.dtype} {list(stored.array.shape)}")
    value = np.float32(stored.array[()])
    if not (np.isfinite(value) and value > 0):
        raise Refused(f"{path}: tensor {name}: must be finite and positive, got {float(value)!r}")
    return value


def _load_one_nvfp4(tensors: Mapping[str, StoredTensor], name: str, path: Path) -> Nvfp4Tensor:
    """Validate one payload and its companions, in seed order: payload, scale, scale2, input."""
    if name not in tensors:
        raise Refused(f"{path}: tensor {name}: missing NVFP4 payload for its companions")
    payload = tensors[name]
    shape = payload.array.shape
    if payload.dtype != "U8" or len(shape) != 2 or shape[1] % (BLOCK_SIZE // 2):
        raise Refused(f"{path}: tensor {name}: payload must be U8 [n_out, n_in/2] "
                      "with n_in % 16 == 0, "
                      f"got {payload.dtype} {list(payload.array.shape)}")
    n_out, n_in = payload.array.shape[0], payload.array.shape[1] * 2
    scale_name = name + SCALE_SUFFIX
    if scale_name not in tensors:
        raise Refused(f"{path}: tensor {scale_name}: missing")
    scale = tensors[scale_name]
    if scale.dtype != "F8_E4M3":
        raise Refused(f"{path}: tensor {scale_name}: dtype {scale.dtype}, expected F8_E4M3")
    if scale.array.shape != (n_in // BLOCK_SIZE, n_out):
        raise Refused(f"{path}: tensor {scale_name}: shape {list(scale.array.shape)}, "
                      f"expected {[n_in // BLOCK_SIZE, n_out]}")
    _refuse_nan_scale_bytes(scale.array, f"{path}: tensor {scale_name}")
    scale2_name = name + SCALE2_SUFFIX
    if scale2_name not in tensors:
        raise Refused(f"{path}: tensor {scale2_name}: missing")
    scale2 = _scalar_f32(tensors, scale2_name, path)
    input_name = name + INPUT_SCALE_INV_SUFFIX
    input_scale_inv = _scalar_f32(tensors, input_name, path) if input_name in tensors else None
    tensor = Nvfp4Tensor(
        np.ascontiguousarray(payload.array), np.ascontiguousarray(scale.array.T), scale2,
        input_scale_inv, name,
    )
    validate_nvfp4_tensor(tensor)
    return tensor


def load_nvfp4_checkpoint(path: str | Path) -> Nvfp4Checkpoint:
    """Load and validate every NVFP4 tensor and companion before any use (fail closed)."""
    path = Path(path)
    tensors, metadata = read_safetensors(path)
    payload_names = {n for n, t in tensors.items() if t.dtype == "U8"}
    companion_bases = {b for b in map(_companion_base, tensors) if b is not None}
    nvfp4_names = sorted(payload_names | companion_bases)
    weight_precision = metadata.get(WEIGHT_PRECISION_KEY)
    if weight_precision != WEIGHT_PRECISION_NVFP4:
        if nvfp4_names:
            raise Refused(f"{path}: metadata {WEIGHT_PRECISION_KEY}={weight_precision!r} but NVFP4 "
                          f"tensors are present (e.g. {nvfp4_names[0]}); expected 'nvfp4'")
        raise Refused(f"{path}: not an NVFP4 checkpoint "
                      f"(metadata {WEIGHT_PRECISION_KEY}={weight_precision!r})")
    if not nvfp4_names:
        raise Refused(f"{path}: metadata {WEIGHT_PRECISION_KEY}='nvfp4' "
                      "but no NVFP4 tensors are present")
    activation_precision = metadata.get(ACTIVATION_PRECISION_KEY)
    if activation_precision not in ACTIVATION_PRECISIONS:
        raise Refused(f"{path}: metadata {ACTIVATION_PRECISION_KEY}={activation_precision!r}, "
                      f"expected one of {list(ACTIVATION_PRECISIONS)}")
    nvfp4 = {name: _load_one_nvfp4(tensors, name, path) for name in nvfp4_names}
    for name, tensor in nvfp4.items():
        has_input = tensor.input_scale_inv is not None
        if has_input != (activation_precision == "nvfp4"):
            state = "present" if has_input else "missing"
            raise Refused(f"{path}: tensor {name}{INPUT_SCALE_INV_SUFFIX}: {state} but metadata "
                          f"{ACTIVATION_PRECISION_KEY}={activation_precision!r}")
    dense_f16: dict[str, np.ndarray] = {}
    for name, stored in tensors.items():
        if name in nvfp4 or _companion_base(name) in nvfp4:
            continue
        if stored.dtype != "F16":
            raise Refused(f"{path}: tensor {name}: dtype {stored.dtype}, "
                          "expected F16 for unquantized tensors")
        dense_f16[name] = stored.array
    return Nvfp4Checkpoint(nvfp4, dense_f16, metadata, path)

"""NVFP4 format (seed 003): codebooks, rounding, quantize/dequantize, checkpoint I/O fail-closed.

Expected values come from independent decoders (gguf's NVFP4 dequantizer, torch.float8_e4m3fn, a
formula written here) or from brute force, never from the code under test; the only literal
expectations are the seed's worked fixture.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from qualify.core.errors import Refused
from qualify.engines.nvfp4 import (
    E2M1_MIDPOINTS,
    E2M1_VALUES,
    E4M3FN_VALUES,
    INPUT_SCALE_INV_SUFFIX,
    SCALE2_SUFFIX,
    SCALE_SUFFIX,
    Nvfp4Tensor,
    StoredTensor,
    dequantize_nvfp4,
    e2m1_decode,
    e2m1_q1,
    e2m1_round,
    e4m3fn_decode,
    e4m3fn_encode,
    e4m3fn_q9,
    load_nvfp4_checkpoint,
    pack_e2m1,
    quantize_nvfp4,
    read_safetensors,
    unpack_e2m1,
    write_nvfp4_checkpoint,
    write_safetensors,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
SHIPPED_SOURCE = REPO_ROOT / "model" / "model.safetensors"
SHIPPED_NVFP4 = REPO_ROOT / "model" / "nvfp4" / "model.safetensors"
FINITE_E4M3FN_BYTES = np.array([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=np.uint8)


def bits(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.uint32)


def formula_e4m3fn(byte: int) -> float:
    """Independent E4M3FN decode: 1 sign, 4 exponent (bias 7), 3 mantissa, subnormals at e = 0."""
    sign = -1.0 if byte >> 7 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 7
    if exponent == 0:
        return sign * (mantissa / 8.0) * 2.0**-6
    return sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)


# --- the seed's worked fixture ------------------------------------------------------------------


def test_seed_fixture_decodes_bit_for_bit() -> None:
    """Seed 003 section 7.2: bytes 10 32 54 76 98 BA DC FE, scale 0x38, scale2 0.25."""
    packed = np.array([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]], dtype=np.uint8)
    tensor = Nvfp4Tensor(packed, np.array([[0x38]], dtype=np.uint8), np.float32(0.25))
    expected = np.array(
        [0.0, 0.125, 0.25, 0.375, 0.5, 0.75, 1.0, 1.5,
         -0.0, -0.125, -0.25, -0.375, -0.5, -0.75, -1.0, -1.5], dtype=np.float32)
    assert e4m3fn_decode(np.array([0x38], dtype=np.uint8))[0] == 1.0
    np.testing.assert_array_equal(bits(dequantize_nvfp4(tensor)[0]), bits(expected))


# --- E2M1 ---------------------------------------------------------------------------------------


def test_e2m1_codebook_and_integer_twin() -> None:
    codes = np.arange(16, dtype=np.uint8)
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    for code in range(16):
        sign = -1.0 if code & 8 else 1.0
        # Independent E2M1: exponent bits 2..1, mantissa bit 0, bias 1, subnormal at e = 0.
        e, m = (code >> 1) & 3, code & 1
        value = sign * (m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))
        assert bits(e2m1_decode(np.array([code]))) == bits(np.float32(value))
        assert abs(value) == magnitudes[code & 7]
    np.testing.assert_array_equal(e2m1_q1(codes), (2 * E2M1_VALUES).astype(np.int64))


def test_pack_puts_even_index_in_lo_nibble() -> None:
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, size=(5, 32), dtype=np.uint8)
    packed = pack_e2m1(codes)
    assert packed.shape == (5, 16)
    np.testing.assert_array_equal(packed & 0xF, codes[:, 0::2])
    np.testing.assert_array_equal(packed >> 4, codes[:, 1::2])
    np.testing.assert_array_equal(unpack_e2m1(packed), codes)


def brute_force_e2m1(value: float) -> int:
    """Nearest E2M1 magnitude code by search, a tie going to the even code; sign from value < 0."""
    magnitude = min(abs(value), 6.0)
    distances = [abs(magnitude - float(v)) for v in E2M1_VALUES[:8]]
    best = min(distances)
    candidates = [c for c, d in enumerate(distances) if d == best]
    code = next((c for c in candidates if c % 2 == 0), candidates[0])
    return code | (8 if value < 0 else 0)


def test_e2m1_rounding_ties_to_even_at_every_midpoint() -> None:
    for i, midpoint in enumerate(E2M1_MIDPOINTS):
        below, above = i, i + 1  # the codes either side of this midpoint
        even = below if below % 2 == 0 else above
        for sign in (1.0, -1.0):
            value = np.float32(sign * midpoint)
            sign_bit = 8 if sign < 0 else 0
            assert e2m1_round(np.array([value]))[0] == even | sign_bit, float(value)
            toward_zero = np.nextafter(value, np.float32(0))
            away = np.nextafter(value, np.float32(sign * np.inf))
            assert e2m1_round(np.array([toward_zero]))[0] == below | sign_bit
            assert e2m1_round(np.array([away]))[0] == above | sign_bit


def test_e2m1_rounding_is_nearest_and_saturates() -> None:
    rng = np.random.default_rng(2)
    values = np.concatenate([
        rng.uniform(-8, 8, 4000), rng.uniform(-0.3, 0.3, 500),
        [6.0, 7.5, 1e30, -1e30, 0.0, -0.0, 5.0, -5.0],
    ]).astype(np.float32)
    got = e2m1_round(values)
    assert [int(c) for c in got] == [brute_force_e2m1(float(v)) for v in values]


def test_e2m1_rounding_refuses_nan() -> None:
    with pytest.raises(Refused, match="NaN"):
        e2m1_round(np.array([1.0, np.nan], dtype=np.float32))


# --- E4M3FN -------------------------------------------------------------------------------------


def test_e4m3fn_all_finite_bytes_match_formula_and_q9_twin() -> None:
    decoded = e4m3fn_decode(FINITE_E4M3FN_BYTES)
    q9 = e4m3fn_q9(FINITE_E4M3FN_BYTES)
    assert len(FINITE_E4M3FN_BYTES) == 254
    for byte, value, units in zip(FINITE_E4M3FN_BYTES, decoded, q9, strict=False):
        expected = formula_e4m3fn(int(byte))
        assert bits(value) == bits(np.float32(expected)), hex(byte)
        assert math.ldexp(int(units), -9) == expected, hex(byte)
    assert decoded.max() == 448.0 and decoded.min() == -448.0


def test_e4m3fn_all_finite_bytes_match_torch() -> None:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is an optional extra
        pytest.skip("torch is not importable; the formula decode still covers all 254 bytes")
    as_torch = torch.from_numpy(FINITE_E4M3FN_BYTES.copy()).view(torch.float8_e4m3fn).to(torch.float32)
    np.testing.assert_array_equal(bits(e4m3fn_decode(FINITE_E4M3FN_BYTES)), bits(as_torch.numpy()))
    # And torch's float32 -> e4m3fn cast (round to nearest even) agrees with our encoder in range.
    rng = np.random.default_rng(3)
    values = np.concatenate([rng.uniform(0, 448, 20000), rng.uniform(0, 2**-6, 2000)]).astype(np.float32)
    theirs = torch.from_numpy(values).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(e4m3fn_encode(values), theirs)


@pytest.mark.parametrize("byte", [0x7F, 0xFF])
def test_e4m3fn_nan_bytes_refused(byte: int) -> None:
    scale_bytes = np.array([0x38, byte], dtype=np.uint8)
    for decode in (e4m3fn_decode, e4m3fn_q9):
        with pytest.raises(Refused, match=f"NaN byte 0x{byte:02x}") as refusal:
            decode(scale_bytes, "weight.nvfp4_scale")
        assert "\n" not in str(refusal.value) and "weight.nvfp4_scale" in str(refusal.value)


def test_e4m3fn_encode_round_trips_and_ties_to_even() -> None:
    assert list(e4m3fn_encode(E4M3FN_VALUES[FINITE_E4M3FN_BYTES])) == list(FINITE_E4M3FN_BYTES)
    positive = E4M3FN_VALUES[:0x7F].astype(np.float64)  # bytes 0x00..0x7e, increasing
    for low in range(0x7E):
        midpoint = np.float32((positive[low] + positive[low + 1]) / 2)
        assert float(midpoint) == (positive[low] + positive[low + 1]) / 2  # exact in float32
        even = low if low % 2 == 0 else low + 1
        assert e4m3fn_encode(np.array([midpoint]))[0] == even
        assert e4m3fn_encode(np.array([np.nextafter(midpoint, np.float32(0))]))[0] == low
        assert e4m3fn_encode(np.array([np.nextafter(midpoint, np.float32(np.inf))]))[0] == low + 1
        assert e4m3fn_encode(np.array([-midpoint]))[0] == even | 0x80


def test_e4m3fn_encode_saturates_and_refuses_nan() -> None:
    big = np.array([448.0, 464.0, 480.0, 1e6, np.inf], dtype=np.float32)
    assert list(e4m3fn_encode(big)) == [0x7E] * 5
    assert list(e4m3fn_encode(-big)) == [0xFE] * 5
    with pytest.raises(Refused, match="NaN"):
        e4m3fn_encode(np.array([np.nan], dtype=np.float32))


# --- cross-check against gguf's NVFP4 dequantizer ------------------------------------------------


def to_gguf_nvfp4_blocks(codes: np.ndarray, scale_bytes: np.ndarray) -> np.ndarray:
    """Our codes [rows, n] and scale bytes [rows, n/16] -> gguf NVFP4 blocks of 64 values (36
    bytes: 4 scale bytes, then per 16-value sub-block 8 bytes with value j in the lo nibble and
    value j + 8 in the hi nibble of byte j)."""
    rows, n = codes.shape
    groups = codes.reshape(rows * n // 64, 4, 16)
    qs = (groups[:, :, :8] | (groups[:, :, 8:] << 4)).astype(np.uint8).reshape(-1, 32)
    return np.concatenate([scale_bytes.reshape(-1, 4), qs], axis=1)


def test_decoding_matches_gguf_nvfp4_on_random_blocks() -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    rng = np.random.default_rng(4)
    rows, n = 12, 256
    codes = rng.integers(0, 16, size=(rows, n), dtype=np.uint8)
    scale_bytes = rng.integers(0, 0x7F, size=(rows, n // 16), dtype=np.uint8)  # finite, sign 0
    blocks = to_gguf_nvfp4_blocks(codes, scale_bytes)
    theirs = gguf_dequantize(blocks, GGMLQuantizationType.NVFP4).reshape(rows, n)
    tensor = Nvfp4Tensor(pack_e2m1(codes), scale_bytes, np.float32(1.0))
    ours = dequantize_nvfp4(tensor)
    np.testing.assert_array_equal(ours, theirs)  # gguf decodes code 8 as +0.0; == ignores the sign
    scale2 = np.float32(0.0371)
    tensor2 = Nvfp4Tensor(pack_e2m1(codes), scale_bytes, scale2)
    np.testing.assert_array_equal(dequantize_nvfp4(tensor2), theirs.astype(np.float32) * scale2)


# --- quantization recipe ------------------------------------------------------------------------


def test_quantize_follows_the_standard_recipe() -> None:
    rng = np.random.default_rng(5)
    weight = (rng.standard_normal((24, 64)) * np.exp(rng.uniform(-4, 2, (24, 1)))).astype(np.float32)
    weight[3, 16:32] = 0.0  # an all-zero block gets scale 1.0
    tensor = quantize_nvfp4(weight, "w")
    amax = np.abs(weight).max()
    assert tensor.scale2 == np.float32(amax / np.float32(2688.0))
    block_amax = np.abs(weight.reshape(24, 4, 16)).max(axis=2)
    raw_scale = block_amax / (np.float32(6.0) * tensor.scale2)
    for (row, block), byte in np.ndenumerate(tensor.scale_bytes):
        target = 1.0 if block_amax[row, block] == 0 else min(float(raw_scale[row, block]), 448.0)
        decoded = float(E4M3FN_VALUES[byte])
        neighbours = [abs(float(v) - target) for v in E4M3FN_VALUES[:0x7F]]
        assert abs(decoded - target) == min(neighbours)  # nearest E4M3FN
    divisor = (tensor.scales_f32() * tensor.scale2)[:, :, None]
    quotients = (weight.reshape(24, 4, 16) / divisor).reshape(24, 64)
    assert [int(c) for c in tensor.codes().ravel()] == [brute_force_e2m1(float(q)) for q in quotients.ravel()]
    dequantized = dequantize_nvfp4(tensor)
    assert np.abs(dequantized).max() == pytest.approx(amax, rel=2**-8)


def test_quantize_matches_a_torch_modelopt_style_recipe() -> None:
    try:
        import torch
    except ImportError:  # pragma: no cover
        pytest.skip("torch is not importable")
    rng = np.random.default_rng(6)
    block_magnitudes = np.exp(rng.uniform(-3, 3, (16, 8))).repeat(16, axis=1)  # [16, 128]
    weight = (rng.standard_normal((16, 128)) * block_magnitudes).astype(np.float32)
    w = torch.from_numpy(weight)
    scale2 = w.abs().amax().float() / (6.0 * 448.0)
    block_amax = w.view(16, 8, 16).abs().amax(dim=-1)
    per_block = block_amax / (6.0 * scale2)
    per_block[per_block == 0] = 1.0
    scale_fp8 = per_block.clamp(max=448.0).to(torch.float8_e4m3fn)
    tensor = quantize_nvfp4(weight)
    assert tensor.scale2 == np.float32(scale2.item())
    np.testing.assert_array_equal(tensor.scale_bytes, scale_fp8.view(torch.uint8).numpy())


def test_quantize_refuses_bad_weights() -> None:
    with pytest.raises(Refused, match="all zero"):
        quantize_nvfp4(np.zeros((2, 16), dtype=np.float32), "z")
    with pytest.raises(Refused, match="non-finite"):
        quantize_nvfp4(np.full((2, 16), np.inf, dtype=np.float32), "inf")
    with pytest.raises(Refused, match="multiple of 16"):
        quantize_nvfp4(np.ones((2, 24), dtype=np.float32), "odd")


# --- checkpoint I/O -----------------------------------------------------------------------------

Q_NAME = "model.layers.0.self_attn.q_proj.weight"
K_NAME = "model.layers.0.self_attn.k_proj.weight"
EMBED = "model.embed_tokens.weight"


def small_checkpoint(path: Path, input_scale_inv: bool = False) -> dict[str, Nvfp4Tensor]:
    rng = np.random.default_rng(7)
    tensors = {
        Q_NAME: quantize_nvfp4(rng.standard_normal((32, 64)).astype(np.float32), Q_NAME),
        K_NAME: quantize_nvfp4(rng.standard_normal((16, 64)).astype(np.float32), K_NAME),
    }
    if input_scale_inv:
        tensors = {n: Nvfp4Tensor(t.packed, t.scale_bytes, t.scale2, np.float32(20.0), n)
                   for n, t in tensors.items()}
    dense = {EMBED: rng.standard_normal((10, 64)).astype(np.float16)}
    write_nvfp4_checkpoint(path, tensors, dense, {"source_sha256": "test"})
    return tensors


def test_checkpoint_round_trip_names_dtypes_and_shapes(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    written = small_checkpoint(path)
    with safe_open(str(path), "np") as handle:
        assert handle.get_slice(Q_NAME).get_dtype() == "U8"
        assert handle.get_slice(Q_NAME).get_shape() == [32, 32]
        assert handle.get_slice(Q_NAME + SCALE_SUFFIX).get_dtype() == "F8_E4M3"
        assert handle.get_slice(Q_NAME + SCALE_SUFFIX).get_shape() == [64 // 16, 32]  # [n_in/16, n_out]
        assert handle.get_slice(Q_NAME + SCALE2_SUFFIX).get_dtype() == "F32"
        assert handle.get_slice(Q_NAME + SCALE2_SUFFIX).get_shape() == []
        assert handle.get_slice(EMBED).get_dtype() == "F16"
        assert handle.metadata()["weight_precision"] == "nvfp4"
        assert handle.metadata()["activation_precision"] == "a16"
    loaded = load_nvfp4_checkpoint(path)
    assert sorted(loaded.nvfp4) == sorted(written) and list(loaded.dense_f16) == [EMBED]
    for name, tensor in written.items():
        np.testing.assert_array_equal(bits(dequantize_nvfp4(loaded.nvfp4[name])),
                                      bits(dequantize_nvfp4(tensor)))
        np.testing.assert_array_equal(loaded.nvfp4[name].scale_bytes, tensor.scale_bytes)
        assert loaded.nvfp4[name].input_scale_inv is None
    # Element [b, o] of the stored scale is block b of row o.
    stored, _ = read_safetensors(path)
    np.testing.assert_array_equal(stored[Q_NAME + SCALE_SUFFIX].array.T, written[Q_NAME].scale_bytes)


def test_checkpoint_bytes_are_deterministic(tmp_path: Path) -> None:
    small_checkpoint(tmp_path / "a.safetensors")
    small_checkpoint(tmp_path / "b.safetensors")
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def test_w4a4_checkpoint_pairs_input_scale_with_activation_precision(tmp_path: Path) -> None:
    path = tmp_path / "w4a4.safetensors"
    small_checkpoint(path, input_scale_inv=True)
    loaded = load_nvfp4_checkpoint(path)
    assert loaded.activation_precision == "nvfp4"
    assert loaded.nvfp4[Q_NAME].input_scale_inv == np.float32(20.0)


def mutate(tmp_path: Path, change, input_scale_inv: bool = False) -> Path:
    """Write a valid checkpoint, apply ``change(entries, metadata)``, rewrite it, return its path."""
    source = tmp_path / "valid.safetensors"
    small_checkpoint(source, input_scale_inv)
    entries, metadata = read_safetensors(source)
    entries = {n: StoredTensor(t.dtype, t.array.copy()) for n, t in entries.items()}
    change(entries, metadata)
    path = tmp_path / "mutated.safetensors"
    write_safetensors(path, entries, metadata)
    return path


def set_entry(name: str, dtype: str, array: np.ndarray):
    def change(entries: dict, metadata: dict) -> None:
        entries[name] = StoredTensor(dtype, np.asarray(array))
    return change


def drop_entry(name: str):
    def change(entries: dict, metadata: dict) -> None:
        del entries[name]
    return change


def set_metadata(key: str, value: str | None):
    def change(entries: dict, metadata: dict) -> None:
        if value is None:
            metadata.pop(key)
        else:
            metadata[key] = value
    return change


def nan_scale_byte(entries: dict, metadata: dict) -> None:
    entries[Q_NAME + SCALE_SUFFIX].array[1, 5] = 0x7F


SCALE = Q_NAME + SCALE_SUFFIX
SCALE2 = Q_NAME + SCALE2_SUFFIX
INPUT = Q_NAME + INPUT_SCALE_INV_SUFFIX
POSITIVE = "must be finite and positive"
FAIL_CLOSED_CASES = {  # case -> (change to a valid checkpoint, refusal that must name the tensor)
    "missing scale": (drop_entry(SCALE), f"tensor {SCALE}: missing"),
    "missing scale2": (drop_entry(SCALE2), f"tensor {SCALE2}: missing"),
    "missing payload": (drop_entry(Q_NAME), f"tensor {Q_NAME}: missing NVFP4 payload"),
    "scale wrong dtype": (set_entry(SCALE, "U8", np.zeros((4, 32), np.uint8)),
                          f"tensor {SCALE}: dtype U8, expected F8_E4M3"),
    "scale transposed": (set_entry(SCALE, "F8_E4M3", np.zeros((32, 4), np.uint8)),
                         rf"tensor {SCALE}: shape \[32, 4\], expected \[4, 32\]"),
    "scale NaN byte": (nan_scale_byte, f"tensor {SCALE}: E4M3FN NaN byte 0x7f"),
    "scale2 zero": (set_entry(SCALE2, "F32", np.array(0.0, np.float32)), f"tensor {SCALE2}: {POSITIVE}"),
    "scale2 negative": (set_entry(SCALE2, "F32", np.array(-1.0, np.float32)), f"tensor {SCALE2}: {POSITIVE}"),
    "scale2 inf": (set_entry(SCALE2, "F32", np.array(np.inf, np.float32)), f"tensor {SCALE2}: {POSITIVE}"),
    "scale2 nan": (set_entry(SCALE2, "F32", np.array(np.nan, np.float32)), f"tensor {SCALE2}: {POSITIVE}"),
    "scale2 not scalar": (set_entry(SCALE2, "F32", np.array([0.5], np.float32)),
                          f"tensor {SCALE2}: must be an F32 scalar"),
    "scale2 f16": (set_entry(SCALE2, "F16", np.array(0.5, np.float16)),
                   f"tensor {SCALE2}: must be an F32 scalar"),
    "payload wrong dtype": (set_entry(Q_NAME, "F16", np.zeros((32, 64), np.float16)),
                            f"tensor {Q_NAME}: payload must be U8"),
    "orphan companion": (set_entry("model.norm.weight" + SCALE2_SUFFIX, "F32", np.array(1.0, np.float32)),
                         "tensor model.norm.weight: missing NVFP4 payload"),
    "dense not f16": (set_entry(EMBED, "F32", np.zeros((10, 64), np.float32)),
                      f"tensor {EMBED}: dtype F32, expected F16"),
    "input_scale_inv without nvfp4 activations": (
        set_entry(INPUT, "F32", np.array(2.0, np.float32)),
        f"tensor {INPUT}: present but metadata activation_precision='a16'"),
    "weight precision absent": (set_metadata("weight_precision", None),
                                "weight_precision=None but NVFP4 tensors are present"),
    "weight precision other": (set_metadata("weight_precision", "q4_k_xl"),
                               "weight_precision='q4_k_xl' but NVFP4 tensors"),
    "activation precision unknown": (set_metadata("activation_precision", "fp8"),
                                     "activation_precision='fp8', expected one of"),
}


@pytest.mark.parametrize("case", sorted(FAIL_CLOSED_CASES))
def test_loader_fails_closed(tmp_path: Path, case: str) -> None:
    change, message = FAIL_CLOSED_CASES[case]
    path = mutate(tmp_path, change)
    with pytest.raises(Refused, match=message) as refusal:
        load_nvfp4_checkpoint(path)
    assert "\n" not in str(refusal.value)


def test_loader_refuses_w4a4_metadata_without_input_scales(tmp_path: Path) -> None:
    path = mutate(tmp_path, drop_entry(INPUT), input_scale_inv=True)
    with pytest.raises(Refused, match=f"tensor {INPUT}: missing but metadata activation_precision='nvfp4'"):
        load_nvfp4_checkpoint(path)


def test_loader_refuses_nvfp4_metadata_without_nvfp4_tensors(tmp_path: Path) -> None:
    path = tmp_path / "dense.safetensors"
    write_safetensors(path, {EMBED: StoredTensor("F16", np.zeros((2, 16), np.float16))},
                      {"weight_precision": "nvfp4", "activation_precision": "a16"})
    with pytest.raises(Refused, match="no NVFP4 tensors are present"):
        load_nvfp4_checkpoint(path)
    write_safetensors(path, {EMBED: StoredTensor("F16", np.zeros((2, 16), np.float16))}, {})
    with pytest.raises(Refused, match="not an NVFP4 checkpoint"):
        load_nvfp4_checkpoint(path)


def test_loader_refuses_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    with pytest.raises(Refused, match="junk.safetensors: not a readable safetensors file"):
        load_nvfp4_checkpoint(path)


# --- the shipped derived checkpoint -------------------------------------------------------------


def test_shipped_checkpoint_is_derived_deterministically(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_nvfp4", REPO_ROOT / "tools" / "make_nvfp4.py")
    make_nvfp4 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_nvfp4)
    rebuilt = make_nvfp4.derive(SHIPPED_SOURCE, tmp_path)
    assert rebuilt.read_bytes() == SHIPPED_NVFP4.read_bytes()
    for name in ("config.json", "hf_quant_config.json"):
        assert (tmp_path / name).read_bytes() == (SHIPPED_NVFP4.parent / name).read_bytes()


def test_shipped_checkpoint_quantizes_projections_and_keeps_f16_head_and_norms() -> None:
    from qualify.engines.nvfp4_layouts import detect_layout, load_checkpoint

    assert detect_layout(SHIPPED_NVFP4.parent) == "modelopt"
    checkpoint = load_checkpoint(SHIPPED_NVFP4.parent)
    source, _ = read_safetensors(SHIPPED_SOURCE)
    projections = {n for n in source if n.endswith("_proj.weight")}
    assert set(checkpoint.nvfp4) == projections and len(projections) == 28
    assert set(checkpoint.dense_f16) == set(source) - projections
    assert EMBED in checkpoint.dense_f16 and "model.norm.weight" in checkpoint.dense_f16
    for name, array in checkpoint.dense_f16.items():
        np.testing.assert_array_equal(array, source[name].array)
    for name, tensor in checkpoint.nvfp4.items():
        weight = source[name].array.astype(np.float32)
        assert (tensor.n_out, tensor.n_in) == weight.shape
        error = np.linalg.norm(dequantize_nvfp4(tensor) - weight) / np.linalg.norm(weight)
        assert error < 0.15, name  # 4-bit: about 0.1 relative error on a trained weight
    assert checkpoint.metadata["weight_precision"] == "nvfp4"
    assert checkpoint.activation_precision == "a16"

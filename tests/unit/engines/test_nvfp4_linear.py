"""NVFP4 contractions: the integer-exact a16-q8 Linear against a scalar oracle of seed 003 section
7.4.2 and a float64 reference, batch and thread invariance, the 2^53 guard, the native variants,
and the factories the reference engine plugs in.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qualify.core.errors import Refused
from qualify.engines.base import Linear
from qualify.engines.nvfp4 import (
    E2M1_VALUES,
    E4M3FN_VALUES,
    Nvfp4Tensor,
    dequantize_nvfp4,
    quantize_nvfp4,
    write_nvfp4_checkpoint,
)
from qualify.engines.nvfp4_layouts import load_checkpoint, write_checkpoint
from qualify.engines.nvfp4_linear import (
    ARITHMETICS,
    ExactA16Q8Linear,
    W4A4Linear,
    make_nvfp4_linear,
    make_nvfp4_linear_factory,
    quantize_activations_q8k,
    round_through_f16,
    super_block_columns,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
SHIPPED_NVFP4 = REPO_ROOT / "model" / "nvfp4" / "model.safetensors"
E2M1_Q1_ORACLE = [int(2 * v) for v in E2M1_VALUES]  # weights in units of 2^-1


def bits(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)


def q9_oracle(byte: int) -> int:
    """E4M3FN byte -> value in units of 2^-9, from the float formula (independent of the module)."""
    sign = -1 if byte >> 7 else 1
    exponent, mantissa = (byte >> 3) & 0xF, byte & 7
    value = (mantissa / 8.0) * 2.0**-6 if exponent == 0 else (1 + mantissa / 8.0) * 2.0 ** (exponent - 7)
    units = value * 512
    assert units == int(units)
    return sign * int(units)


def q8k_oracle(block: np.ndarray) -> tuple[list[int], np.float32]:
    """ggml quantize_row_q8_K for one 256-value block, scalar, in float32."""
    amax, signed_max = np.float32(0), np.float32(0)
    for value in block:
        if abs(value) > amax:
            amax, signed_max = abs(value), value
    if amax == 0:
        return [0] * len(block), np.float32(0)
    iscale = np.float32(-127) / signed_max
    return [min(127, int(np.rint(np.float32(iscale * v)))) for v in block], np.float32(1) / iscale


def exact_oracle(tensor: Nvfp4Tensor, x: np.ndarray) -> np.ndarray:
    """Seed 003 section 7.4.2 written as its kernel loop: integer block dots over packed bytes, i64
    super-block totals, the four pinned float32 operations, then float16."""
    rows, n_in = x.shape
    out = np.zeros((rows, tensor.n_out), dtype=np.float32)
    for t in range(rows):
        quantized = [q8k_oracle(x[t, s:s + 256]) for s in range(0, n_in, 256)]
        for o in range(tensor.n_out):
            total = np.float32(0)
            for s, (q8, q8_scale) in enumerate(quantized):
                integer_total = 0
                for group in range(16):
                    dot = 0
                    for pair in range(8):
                        byte = int(tensor.packed[o, (s * 256 + group * 16) // 2 + pair])
                        dot += E2M1_Q1_ORACLE[byte & 15] * q8[group * 16 + 2 * pair]
                        dot += E2M1_Q1_ORACLE[byte >> 4] * q8[group * 16 + 2 * pair + 1]
                    integer_total += dot * q9_oracle(int(tensor.scale_bytes[o, s * 16 + group]))
                contribution = np.float32(np.float32(integer_total) * np.float32(2.0**-10))
                contribution = np.float32(contribution * q8_scale)
                contribution = np.float32(contribution * tensor.scale2)
                total = np.float32(total + contribution)
            out[t, o] = np.float32(np.float16(total))
    return out


def random_case(rng: np.random.Generator, rows: int, n_out: int, n_in: int) -> tuple[Nvfp4Tensor, np.ndarray]:
    """A weight with per-row magnitudes spread over decades and activations with outliers and an
    occasional all-zero super-block."""
    weight = rng.standard_normal((n_out, n_in)) * np.exp(rng.uniform(-6, 3, (n_out, 1)))
    weight *= np.exp(rng.uniform(-3, 0, (1, n_in)))
    x = rng.standard_normal((rows, n_in)) * np.exp(rng.uniform(-4, 4, (rows, 1)))
    x[rng.random((rows, n_in)) < 0.01] *= 50
    if n_in >= 512 and rows > 1:
        x[rows - 1, 256:512] = 0.0
    return quantize_nvfp4(weight.astype(np.float32), "w"), x.astype(np.float32)


# --- activation quantization --------------------------------------------------------------------


def test_q8k_matches_scalar_ggml_loop() -> None:
    rng = np.random.default_rng(21)
    x = (rng.standard_normal((5, 768)) * np.exp(rng.uniform(-8, 8, (5, 1)))).astype(np.float32)
    x[2, 256:512] = 0.0
    x[3, 10], x[3, 20] = 9.0, -9.0  # equal magnitudes: the first one sets the sign
    x[3, :256] = np.clip(x[3, :256], -8, 8)
    x[3, 10], x[3, 20] = 9.0, -9.0
    q8, q8_scale = quantize_activations_q8k(x)
    for t in range(5):
        for s in range(3):
            codes, scale = q8k_oracle(x[t, s * 256:(s + 1) * 256])
            assert list(q8[t, s * 256:(s + 1) * 256]) == codes
            assert bits(q8_scale[t, s]) == bits(scale)
    assert q8[3, 10] == -127 and q8[3, 20] == 127
    assert not q8[2, 256:512].any() and q8_scale[2, 1] == 0


def test_q8k_rounds_half_to_even() -> None:
    block = np.zeros((1, 256), dtype=np.float32)
    block[0, :6] = [-127.0, 2.5, 3.5, -2.5, 0.5, 1.5]  # signed max -127: iscale = 1
    q8, q8_scale = quantize_activations_q8k(block)
    assert list(q8[0, :6]) == [-127, 2, 4, -2, 0, 2] and q8_scale[0, 0] == 1.0


# --- the exact contraction ----------------------------------------------------------------------


def test_exact_matches_scalar_oracle_bit_for_bit() -> None:
    rng = np.random.default_rng(22)
    tensor, x = random_case(rng, rows=3, n_out=5, n_in=512)
    y = ExactA16Q8Linear(tensor)(x)
    np.testing.assert_array_equal(bits(y), bits(exact_oracle(tensor, x)))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 2), n_out=st.integers(1, 3),
       super_blocks=st.integers(1, 2))
def test_exact_matches_scalar_oracle_on_random_shapes(
    seed: int, rows: int, n_out: int, super_blocks: int
) -> None:
    tensor, x = random_case(np.random.default_rng(seed), rows, n_out, 256 * super_blocks)
    np.testing.assert_array_equal(bits(ExactA16Q8Linear(tensor)(x)), bits(exact_oracle(tensor, x)))


def float64_reference(tensor: Nvfp4Tensor, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(reference, sum of |super-block contributions|) in float64 from the same quantized values:
    dequantized weight (e2m1 * e4m3fn * scale2, exact in float64) and q8 * (1/iscale)."""
    codes = np.empty((tensor.n_out, tensor.n_in), dtype=np.uint8)
    codes[:, 0::2], codes[:, 1::2] = tensor.packed & 15, tensor.packed >> 4
    scales = E4M3FN_VALUES[tensor.scale_bytes].astype(np.float64).repeat(16, axis=1)
    weight = E2M1_VALUES[codes].astype(np.float64) * scales * np.float64(tensor.scale2)
    q8, q8_scale = quantize_activations_q8k(x)
    reference = np.zeros((x.shape[0], tensor.n_out))
    magnitude = np.zeros_like(reference)
    for s in range(q8_scale.shape[1]):
        cols = slice(256 * s, 256 * (s + 1))
        integer_part = q8[:, cols].astype(np.float64) @ weight[:, cols].T
        contribution = integer_part * q8_scale[:, s:s + 1].astype(np.float64)
        reference += contribution
        magnitude += np.abs(contribution)
    return reference, magnitude


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 9), n_out=st.integers(1, 40),
       super_blocks=st.integers(1, 3))
def test_exact_equals_float64_reference_to_rounding(
    seed: int, rows: int, n_out: int, super_blocks: int
) -> None:
    tensor, x = random_case(np.random.default_rng(seed), rows, n_out, 256 * super_blocks)
    y = ExactA16Q8Linear(tensor)(x).astype(np.float64)
    reference, magnitude = float64_reference(tensor, x)
    # float32 epilogue: 4 roundings per super-block plus the sequential sum; then float16 output.
    float32_error = (5 + super_blocks) * 2.0**-24 * magnitude
    tolerance = (1 + 2.0**-10) * float32_error + 2.0**-11 * np.abs(reference) + 2.0**-24
    in_range = np.abs(reference) < 65504 * (1 - 2.0**-10)
    overflow = np.abs(reference) > 65520 * (1 + 2.0**-10)  # float16 rounds these to +-inf
    assert np.all(np.abs(y - reference)[in_range] <= tolerance[in_range])
    assert np.array_equal(y[overflow], np.copysign(np.inf, reference[overflow]))


def test_exact_projections_stacked_keep_each_projections_bits() -> None:
    """q/k/v stacked (one quantization of the input, one contraction, each column its own
    scale2) give every projection's own bits at one row and at many, and the projections' weight
    blocks become views of the stacked ones."""
    rng = np.random.default_rng(24)
    tensors = [random_case(rng, rows=1, n_out=n_out, n_in=512)[0] for n_out in (48, 16, 16)]
    alone = [ExactA16Q8Linear(tensor) for tensor in tensors]
    together = [ExactA16Q8Linear(tensor) for tensor in tensors]
    stacked = ExactA16Q8Linear.stack(together)
    assert stacked.n_out == 80 and len({float(t.scale2) for t in tensors}) == 3
    for rows in (1, 37):
        x = random_case(rng, rows=rows, n_out=1, n_in=512)[1]
        columns = np.split(stacked(x), [48, 64], axis=1)
        for column, single, viewed in zip(columns, alone, together, strict=True):
            np.testing.assert_array_equal(bits(column), bits(single(x)))
            np.testing.assert_array_equal(bits(viewed(x)), bits(single(x)))
    for projection in together:
        for block, stacked_block in zip(projection._weight_q10_t_by_super_block,
                                        stacked._weight_q10_t_by_super_block, strict=True):
            assert np.shares_memory(block, stacked_block)


def test_exact_is_batch_invariant_bit_for_bit() -> None:
    rng = np.random.default_rng(23)
    tensor, x = random_case(rng, rows=37, n_out=48, n_in=512)
    linear = ExactA16Q8Linear(tensor)
    batched = linear(x)
    one_by_one = np.concatenate([linear(x[t:t + 1]) for t in range(x.shape[0])])
    np.testing.assert_array_equal(bits(batched), bits(one_by_one))
    order = rng.permutation(x.shape[0])
    np.testing.assert_array_equal(bits(linear(x[order])), bits(batched[order]))
    np.testing.assert_array_equal(bits(linear(x[5:29])), bits(batched[5:29]))


THREAD_SCRIPT = """
import hashlib, sys
import numpy as np
from qualify.engines.nvfp4 import quantize_nvfp4
from qualify.engines.nvfp4_linear import make_nvfp4_linear
rng = np.random.default_rng(11)
weight = rng.standard_normal((384, 512)).astype(np.float32)
x = rng.standard_normal((300, 512)).astype(np.float32)
tensor = quantize_nvfp4(weight)
for arithmetic in ("exact", "w4a4"):
    print(arithmetic, hashlib.sha256(make_nvfp4_linear(tensor, arithmetic)(x).tobytes()).hexdigest())
"""


def test_exact_output_identical_across_processes_and_blas_threads() -> None:
    digests = []
    for threads in ("1", "2"):
        env = dict(os.environ, OPENBLAS_NUM_THREADS=threads, OMP_NUM_THREADS=threads,
                   PYTHONPATH=str(REPO_ROOT))
        result = subprocess.run([sys.executable, "-c", THREAD_SCRIPT], env=env, cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=120, check=True)
        digests.append(result.stdout)
    assert digests[0] == digests[1]
    rng = np.random.default_rng(11)
    weight = rng.standard_normal((384, 512)).astype(np.float32)
    x = rng.standard_normal((300, 512)).astype(np.float32)
    here = hashlib.sha256(make_nvfp4_linear(quantize_nvfp4(weight), "exact")(x).tobytes()).hexdigest()
    assert f"exact {here}" in digests[0]


# --- the 2^53 guard -----------------------------------------------------------------------------


def test_exact_refuses_a_weight_whose_integer_sums_could_pass_2_pow_53() -> None:
    """Every code +6.0 under scale 448: |q1 * q9| = 12 * 229376 per value; 2^25 inputs times
    127 exceed 2^53, so float64 partial sums could round."""
    n_in = 2**25
    tensor = Nvfp4Tensor(np.full((1, n_in // 2), 0x77, dtype=np.uint8),
                         np.full((1, n_in // 16), 0x7E, dtype=np.uint8), np.float32(1.0), None, "huge")
    with pytest.raises(Refused, match=r"huge: integer row bound \d+ >= 2\^53") as refusal:
        ExactA16Q8Linear(tensor)
    assert "\n" not in str(refusal.value)


def test_w4a4_guard_refuses_adversarial_weight_and_admits_half_of_it() -> None:
    # A constant weight quantizes to code 6.0 under scale 448 everywhere: the worst case per value.
    with pytest.raises(Refused, match=r"adversarial: integer row bound \d+ >= 2\^53"):
        W4A4Linear(quantize_nvfp4(np.ones((2, 2048), dtype=np.float32), "adversarial"))
    W4A4Linear(quantize_nvfp4(np.ones((2, 1024), dtype=np.float32), "admitted"))
    ExactA16Q8Linear(quantize_nvfp4(np.ones((2, 2048), dtype=np.float32), "exact admits it"))


# --- native variants ----------------------------------------------------------------------------


def e4m3fn_nearest(value: float) -> int:
    """Brute-force E4M3FN encode of a non-negative value: nearest, ties to the even byte, <= 448."""
    value = min(value, 448.0)
    distances = [abs(float(E4M3FN_VALUES[b]) - value) for b in range(0x7F)]
    best = min(distances)
    candidates = [b for b, d in enumerate(distances) if d == best]
    return next((b for b in candidates if b % 2 == 0), candidates[0])


def e2m1_nearest_q1(value: float) -> int:
    magnitude = min(abs(value), 6.0)
    distances = [abs(magnitude - float(v)) for v in E2M1_VALUES[:8]]
    candidates = [c for c, d in enumerate(distances) if d == min(distances)]
    code = next((c for c in candidates if c % 2 == 0), candidates[0])
    return -E2M1_Q1_ORACLE[code] if value < 0 else E2M1_Q1_ORACLE[code]


def w4a4_oracle(tensor: Nvfp4Tensor, x: np.ndarray) -> np.ndarray:
    """Seed section 7.4.3 scalar: activations E2M1 + E4M3FN per 16 under a global scale (static
    1/input_scale_inv, else row amax / 2688), one integer sum per row, x 2^-20, x scale2, x act."""
    out = np.zeros((x.shape[0], tensor.n_out), dtype=np.float32)
    for t in range(x.shape[0]):
        if tensor.input_scale_inv is not None:
            act_scale2 = np.float32(1) / tensor.input_scale_inv
        else:
            act_scale2 = np.float32(np.abs(x[t]).max() / np.float32(2688))
        act_q10 = []
        for b in range(tensor.n_in // 16):
            block = x[t, 16 * b:16 * (b + 1)]
            amax = np.abs(block).max()
            raw = np.float32(1) if amax == 0 else np.float32(amax / (np.float32(6) * act_scale2))
            byte = e4m3fn_nearest(float(raw))
            divisor = np.float32(E4M3FN_VALUES[byte] * act_scale2)
            act_q10 += [e2m1_nearest_q1(float(np.float32(v / divisor)) if divisor else 0.0) * q9_oracle(byte)
                        for v in block]
        for o in range(tensor.n_out):
            total = 0
            for i in range(tensor.n_in):
                byte = int(tensor.packed[o, i // 2])
                q1 = E2M1_Q1_ORACLE[(byte >> 4) if i % 2 else (byte & 15)]
                total += q1 * q9_oracle(int(tensor.scale_bytes[o, i // 16])) * act_q10[i]
            y = np.float32(np.float32(total) * np.float32(2.0**-20))
            y = np.float32(y * tensor.scale2)
            y = np.float32(y * act_scale2)
            out[t, o] = np.float32(np.float16(y))
    return out


def test_w4a4_matches_scalar_oracle_dynamic_and_static_scale() -> None:
    rng = np.random.default_rng(24)
    tensor, x = random_case(rng, rows=3, n_out=4, n_in=256)
    x[1] = 0.0  # an all-zero row has a zero global scale and outputs zeros
    y = W4A4Linear(tensor)(x)
    np.testing.assert_array_equal(bits(y), bits(w4a4_oracle(tensor, x)))
    assert not y[1].any()
    static = Nvfp4Tensor(tensor.packed, tensor.scale_bytes, tensor.scale2, np.float32(1.7), "w")
    np.testing.assert_array_equal(bits(W4A4Linear(static)(x)), bits(w4a4_oracle(static, x)))


def test_w4a4_is_batch_invariant() -> None:
    tensor, x = random_case(np.random.default_rng(25), rows=11, n_out=16, n_in=512)
    linear = W4A4Linear(tensor)
    one_by_one = np.concatenate([linear(x[t:t + 1]) for t in range(11)])
    np.testing.assert_array_equal(bits(linear(x)), bits(one_by_one))


def test_native_variants_stay_near_exact_and_order_by_harshness() -> None:
    rng = np.random.default_rng(26)
    weight = rng.standard_normal((64, 512)).astype(np.float32)
    x = rng.standard_normal((40, 512)).astype(np.float32)
    tensor = quantize_nvfp4(weight)
    outputs = {arithmetic: make_nvfp4_linear(tensor, arithmetic)(x) for arithmetic in ARITHMETICS}
    scale = np.abs(outputs["exact"]).max()
    drift = {a: np.abs(outputs[a] - outputs["exact"]).max() / scale for a in ARITHMETICS}
    assert drift["exact"] == 0
    assert drift["splitk"] < 2e-3  # same operands, another float32 order, one f16 rounding
    assert drift["f16"] < 5e-3  # plus float16 operands
    assert 1e-3 < drift["w4a4"] < 0.3  # 4-bit activations: far coarser
    for y in outputs.values():
        np.testing.assert_array_equal(bits(round_through_f16(y)), bits(y))  # float16 outputs
    dense = x @ dequantize_nvfp4(tensor).T
    assert np.abs(outputs["splitk"] - dense).max() / scale < 0.05  # only q8 activation error


# --- float16 rounding helper --------------------------------------------------------------------


def test_round_through_f16_equals_numpy_cast() -> None:
    every_f16 = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    finite = np.sort(every_f16[np.isfinite(every_f16)].astype(np.float64))
    midpoints = ((finite[:-1] + finite[1:]) / 2).astype(np.float32)  # exact: 12 significant bits
    random_bits = np.random.default_rng(27).integers(0, 2**32, 2**20, dtype=np.uint64).astype(np.uint32)
    probes = [every_f16, midpoints, np.nextafter(midpoints, np.float32(np.inf)),
              np.nextafter(midpoints, np.float32(-np.inf)),
              np.array([65519.996, 65520.0, 1e38, -1e38], np.float32), random_bits.view(np.float32)]
    values = np.concatenate(probes).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = values.astype(np.float16).astype(np.float32)
    whole = round_through_f16(values)  # the bit path
    rows = np.concatenate([round_through_f16(values[start:start + 1000])  # decode-sized: the casts
                           for start in range(0, values.size, 1000)])
    for got in (whole, rows):
        same = (bits(got) == bits(expected)) | (np.isnan(got) & np.isnan(expected))
        assert same.all(), values[~same][:5]


# --- factories and hooks ------------------------------------------------------------------------


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
def test_factory_builds_linears_from_the_shipped_checkpoint(arithmetic: str) -> None:
    checkpoint = load_checkpoint(SHIPPED_NVFP4.parent)
    make_linear = make_nvfp4_linear_factory(checkpoint, arithmetic)
    name = "model.layers.2.mlp.down_proj.weight"
    tensor = checkpoint.nvfp4[name]
    linear = make_linear(name, np.zeros((tensor.n_out, tensor.n_in), dtype=np.float32))
    assert isinstance(linear, Linear) and (linear.n_out, linear.n_in) == (256, 512)
    assert isinstance(linear.kind, str) and arithmetic in linear.kind
    x = np.random.default_rng(28).standard_normal((3, 512)).astype(np.float32)
    assert linear(x).shape == (3, 256) and linear(x).dtype == np.float32
    with pytest.raises(Refused, match="no NVFP4 tensor named 'model.embed_tokens.weight'"):
        make_linear("model.embed_tokens.weight", np.zeros((4096, 256), dtype=np.float32))
    with pytest.raises(Refused, match=rf"{name}: float weight shape \[512, 256\] does not match"):
        make_linear(name, np.zeros((512, 256), dtype=np.float32))


def test_factory_loads_a_path_and_refuses_unknown_arithmetic(tmp_path: Path) -> None:
    companion = tmp_path / "model.safetensors"
    write_checkpoint(load_checkpoint(SHIPPED_NVFP4.parent), tmp_path, "companion")
    make_linear = make_nvfp4_linear_factory(companion, "exact")
    assert make_linear("model.layers.0.self_attn.k_proj.weight", None).n_out == 128
    with pytest.raises(Refused, match="nvfp4 arithmetic: 'fp8' is not one of"):
        make_nvfp4_linear_factory(SHIPPED_NVFP4, "fp8")  # type: ignore[arg-type]


def test_w4a4_checkpoint_admits_only_w4a4(tmp_path: Path) -> None:
    tensor = quantize_nvfp4(np.random.default_rng(29).standard_normal((8, 256)).astype(np.float32), "p")
    static = Nvfp4Tensor(tensor.packed, tensor.scale_bytes, tensor.scale2, np.float32(3.0), "p")
    write_nvfp4_checkpoint(tmp_path / "w.safetensors", {"p": static}, {})
    with pytest.raises(Refused, match="does not admit arithmetic 'exact'"):
        make_nvfp4_linear_factory(tmp_path / "w.safetensors", "exact")
    w4a4 = make_nvfp4_linear_factory(tmp_path / "w.safetensors", "w4a4")("p", None)
    assert w4a4.input_scale_inv == np.float32(3.0)


def test_linear_refuses_bad_activations() -> None:
    linear = ExactA16Q8Linear(quantize_nvfp4(np.ones((4, 256), dtype=np.float32), "p"))
    with pytest.raises(Refused, match=r"p: activations must be float32 \[T, 256\], got float64"):
        linear(np.ones((1, 256)))
    with pytest.raises(Refused, match="got float32 \\[1, 128\\]"):
        linear(np.ones((1, 128), dtype=np.float32))
    with pytest.raises(Refused, match="p: activations contain non-finite values"):
        linear(np.full((1, 256), np.nan, dtype=np.float32))


def test_a_row_not_a_multiple_of_256_ends_in_a_shorter_super_block_quantized_by_the_same_rule() -> None:
    """A 576-wide model (SmolLM2): two 256-wide super-blocks and a 64-wide last one, each
    quantized as if it stood alone; every arithmetic runs it, row by row as in a batch."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 576)).astype(np.float32)
    q8, scale = quantize_activations_q8k(x)
    assert scale.shape == (3, 3)
    for columns, block in zip(super_block_columns(576), range(3), strict=True):
        alone_q8, alone_scale = quantize_activations_q8k(np.ascontiguousarray(x[:, columns]))
        assert np.array_equal(q8[:, columns], alone_q8)
        assert np.array_equal(scale[:, block], alone_scale[:, 0])
    assert [c.stop - c.start for c in super_block_columns(576)] == [256, 256, 64]
    tensor = quantize_nvfp4(rng.standard_normal((8, 576)).astype(np.float32), "p")
    for arithmetic in ARITHMETICS:
        linear = make_nvfp4_linear(tensor, arithmetic)
        batched = linear(x)
        assert batched.shape == (3, 8)
        for row in range(3):
            assert np.array_equal(batched[row], linear(x[row : row + 1])[0])

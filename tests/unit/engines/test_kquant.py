"""The k-quant lane's GGUF checkpoint and integer-exact Q8_0 contraction (rung 3).

What must hold: the shipped GGUF files are what ``tools/make_gguf.py`` writes (byte for byte) and
``gguf``'s own reader/dequantizer reads back the quantized weights our loader uses; activations
quantize exactly like llama.cpp's reference; the exact contraction equals an int64 block-sum
reference bit for bit and a float64 reference to rounding; rows never depend on batch shape; the
loader refuses malformed files in one line.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from safetensors.numpy import load_file

from qualify.core.assets import MODEL_DIR, REPO_ROOT
from qualify.core.errors import Refused
from qualify.engines.kquant import (
    BLOCK,
    DRAFT_GGUF_NAME,
    TARGET_GGUF_NAME,
    ExactQ8Linear,
    NativeQ8Linear,
    Q8Matrix,
    config_from_json,
    load_draft_gguf,
    load_target_gguf,
    permute_qk_rows_from_gguf,
    permute_qk_rows_to_gguf,
    quantize_activations_q8_0,
)

GGUF_DIR = MODEL_DIR / "gguf"
TARGET = GGUF_DIR / TARGET_GGUF_NAME
DRAFT = GGUF_DIR / DRAFT_GGUF_NAME
Q8_0 = gguf.GGMLQuantizationType.Q8_0
CONFIG = config_from_json(MODEL_DIR / "config.json")


@pytest.fixture(scope="module")
def target_weights():
    return load_target_gguf(TARGET, CONFIG)


def gguf_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """gguf's own Q8_0 quantizer, split into (int8 quants [T, blocks, 32], float32 scales)."""
    raw = gguf.quants.quantize(x, Q8_0).reshape(x.shape[0], x.shape[1] // BLOCK, 2 + BLOCK)
    return raw[:, :, 2:].view(np.int8), raw[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float32)


# --- the GGUF files ------------------------------------------------------------------------------


def test_shipped_gguf_files_are_what_make_gguf_writes(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "make_gguf.py"), "--out-dir", str(tmp_path)],
                   check=True, capture_output=True)
    for name in (TARGET_GGUF_NAME, DRAFT_GGUF_NAME):
        assert (tmp_path / name).read_bytes() == (GGUF_DIR / name).read_bytes(), name


def test_gguf_round_trip_through_ggufs_own_dequantizer(target_weights) -> None:
    """Every Q8_0 tensor, dequantized by gguf itself, equals the source float16 weights requantized
    by gguf and equals our loader's matrix (Q/K permutation undone)."""
    source = load_file(str(MODEL_DIR / "model.safetensors"))
    stored = {t.name: t for t in gguf.GGUFReader(TARGET).tensors}
    pairs = {"token_embd.weight": ("model.embed_tokens", None)}
    for i in range(CONFIG.layers):
        pairs[f"blk.{i}.attn_q.weight"] = (f"model.layers.{i}.self_attn.q_proj", CONFIG.heads)
        pairs[f"blk.{i}.attn_k.weight"] = (f"model.layers.{i}.self_attn.k_proj", CONFIG.kv_heads)
        pairs[f"blk.{i}.attn_v.weight"] = (f"model.layers.{i}.self_attn.v_proj", None)
        pairs[f"blk.{i}.attn_output.weight"] = (f"model.layers.{i}.self_attn.o_proj", None)
        pairs[f"blk.{i}.ffn_gate.weight"] = (f"model.layers.{i}.mlp.gate_proj", None)
        pairs[f"blk.{i}.ffn_up.weight"] = (f"model.layers.{i}.mlp.up_proj", None)
        pairs[f"blk.{i}.ffn_down.weight"] = (f"model.layers.{i}.mlp.down_proj", None)
    for gguf_name, (hf_name, heads) in pairs.items():
        tensor = stored[gguf_name]
        assert tensor.tensor_type == Q8_0
        by_gguf = gguf.quants.dequantize(tensor.data, Q8_0)
        if heads is not None:
            by_gguf = permute_qk_rows_from_gguf(by_gguf, heads)
        weight = source[hf_name + ".weight"].astype(np.float32)
        requantized = gguf.quants.dequantize(gguf.quants.quantize(weight, Q8_0), Q8_0)
        np.testing.assert_array_equal(by_gguf, requantized, err_msg=gguf_name)
        np.testing.assert_array_equal(by_gguf, target_weights.matrices[hf_name].dequantize(), err_msg=gguf_name)
        # Q8_0 error per element: half a step, plus 127 times the float16 rounding of the step.
        step = np.abs(weight).reshape(weight.shape[0], -1, BLOCK).max(axis=2, keepdims=True) / 127
        error = np.abs(by_gguf - weight).reshape(step.shape[0], -1, BLOCK)
        assert float((error - step * (0.5 + 127 * 2.0**-11)).max()) <= 1e-8, gguf_name
    norms = {"output_norm.weight": "model.norm.weight", "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight"}
    for gguf_name, hf_name in norms.items():
        np.testing.assert_array_equal(stored[gguf_name].data, source[hf_name].astype(np.float32))
        np.testing.assert_array_equal(target_weights.vectors[hf_name], source[hf_name].astype(np.float32))


def test_draft_gguf_round_trip() -> None:
    source = load_file(str(MODEL_DIR / "draft.safetensors"))
    draft = load_draft_gguf(DRAFT, CONFIG)
    assert set(draft.matrices) == {"fc", "layer.self_attn.q_proj", "layer.self_attn.k_proj",
                                   "layer.self_attn.v_proj", "layer.self_attn.o_proj", "layer.mlp.gate_proj",
                                   "layer.mlp.up_proj", "layer.mlp.down_proj"}
    for name, matrix in draft.matrices.items():
        weight = source[name + ".weight"].astype(np.float32)
        np.testing.assert_array_equal(
            matrix.dequantize(), gguf.quants.dequantize(gguf.quants.quantize(weight, Q8_0), Q8_0), err_msg=name)
    for name, vector in draft.vectors.items():
        np.testing.assert_array_equal(vector, source[name].astype(np.float32))


@given(hnp.arrays(np.float32, (4, 8), elements=st.floats(-8, 8, width=32)), st.integers(1, 4))
def test_qk_permutation_round_trips(weight: np.ndarray, heads: int) -> None:
    rows = np.repeat(weight, heads, axis=0)
    assert np.array_equal(permute_qk_rows_from_gguf(permute_qk_rows_to_gguf(rows, heads), heads), rows)


# --- activation quantization ---------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 5), st.sampled_from([32, 64, 256])),
                  elements=st.floats(-1e4, 1e4, width=32)))
def test_activation_quantizer_is_llama_cpp_reference(x: np.ndarray) -> None:
    quants, scales = quantize_activations_q8_0(x)
    with np.errstate(all="ignore"):
        expected_quants, expected_scales = gguf_q8_0(x)
        d = np.abs(x.reshape(x.shape[0], -1, BLOCK)).max(axis=2) / np.float32(127)
        undefined = ~np.isfinite(np.float32(1) / d)  # llama.cpp casts inf/NaN to int8 there
    expected_quants = np.where(undefined[:, :, None], 0, expected_quants)
    np.testing.assert_array_equal(quants, expected_quants)
    np.testing.assert_array_equal(scales, expected_scales)


def test_activation_quantizer_pins_subnormal_blocks_to_zero() -> None:
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = np.float32(1e-44)  # d = amax / 127 is subnormal; 1 / d overflows
    quants, scales = quantize_activations_q8_0(x)
    assert not quants.any() and scales[0, 0] == 0.0


def test_activation_quantizer_rounds_ties_away_from_zero() -> None:
    x = np.zeros((1, 32), np.float32)
    x[0, :4] = [127.0, 0.5, -0.5, -2.5]  # d = 1 -> exact ties
    quants, scales = quantize_activations_q8_0(x)
    assert scales[0, 0] == 1.0
    assert quants[0, 0, :4].tolist() == [127, 1, -1, -3]
    zero_quants, zero_scales = quantize_activations_q8_0(np.zeros((1, 32), np.float32))
    assert not zero_quants.any() and zero_scales[0, 0] == 0.0


# --- the exact contraction -----------------------------------------------------------------------


def int64_reference(weight: Q8Matrix, x: np.ndarray) -> np.ndarray:
    """Block sums in int64 (no floats at all), then the pinned float32 epilogue, row by row."""
    quants, scales = quantize_activations_q8_0(x)
    out = np.zeros((x.shape[0], weight.n_out), np.float32)
    for row in range(x.shape[0]):
        sums = np.einsum("bj,obj->ob", quants[row].astype(np.int64), weight.quants.astype(np.int64))
        acc = np.zeros(weight.n_out, np.float32)
        for block in range(sums.shape[1]):
            acc = acc + sums[:, block].astype(np.float32) * (weight.scales[:, block] * scales[row, block])
        out[row] = acc
    return out


def random_matrix(rng: np.random.Generator, n_out: int, n_in: int) -> Q8Matrix:
    quants = rng.integers(-128, 128, size=(n_out, n_in // BLOCK, BLOCK)).astype(np.int8)
    scales = rng.uniform(1e-4, 1e-2, size=(n_out, n_in // BLOCK)).astype(np.float16).astype(np.float32)
    return Q8Matrix(quants, scales)


def test_exact_contraction_equals_int64_and_float64_references(target_weights) -> None:
    rng = np.random.default_rng(7)
    cases = [(target_weights.matrices["model.layers.1.mlp.down_proj"], 512),
             (target_weights.matrices["model.embed_tokens"], 256), (random_matrix(rng, 96, 128), 128)]
    for weight, n_in in cases:
        x = (rng.standard_normal((9, n_in)) * rng.uniform(0.1, 30, size=(9, 1))).astype(np.float32)
        x[3] = 0.0
        y = ExactQ8Linear("w", weight)(x)
        np.testing.assert_array_equal(y, int64_reference(weight, x))
        quants, scales = quantize_activations_q8_0(x)
        act64 = (quants.astype(np.float64) * scales[:, :, None]).reshape(x.shape)
        terms = act64[:, None, :] * weight.dequantize().astype(np.float64)[None, :, :]
        exact = terms.sum(axis=2)
        # float32 epilogue: one rounding per block product and per accumulation.
        bound = 2 * (n_in // BLOCK + 2) * np.finfo(np.float32).eps * np.abs(terms).sum(axis=2) + 1e-30
        assert (np.abs(y.astype(np.float64) - exact) <= bound).all()


def test_extreme_quants_stay_exact() -> None:
    """Every product at the bound (-128 x -127 x 32 terms): block sums stay exact in float32."""
    weight = Q8Matrix(np.full((4, 8, BLOCK), -128, np.int8), np.ones((4, 8), np.float32))
    x = np.full((2, 256), -1.0, np.float32)
    y = ExactQ8Linear("w", weight)(x)
    np.testing.assert_array_equal(y, int64_reference(weight, x))


def test_projections_stacked_keep_each_projections_bits(target_weights) -> None:
    """q/k/v stacked (the input quantized once, one contraction, each column its own weight
    scales) give every projection's own bits, at decode's few rows and prefill's many."""
    rng = np.random.default_rng(12)
    names = [f"model.layers.0.self_attn.{name}_proj" for name in "qkv"]
    alone = [ExactQ8Linear(name, target_weights.matrices[name]) for name in names]
    together = [ExactQ8Linear(name, target_weights.matrices[name]) for name in names]
    stacked = ExactQ8Linear.stack(together)
    splits = list(np.cumsum([linear.n_out for linear in alone])[:-1])
    for rows in (1, 300):
        x = (rng.standard_normal((rows, 256)) * 4).astype(np.float32)
        for column, single, viewed in zip(np.split(stacked(x), splits, axis=1), alone, together, strict=True):
            np.testing.assert_array_equal(column.view(np.uint32), single(x).view(np.uint32))
            np.testing.assert_array_equal(viewed(x).view(np.uint32), single(x).view(np.uint32))
    assert all(np.shares_memory(linear._quants_by_block, stacked._quants_by_block) for linear in together)


def test_rows_do_not_depend_on_batch_shape(target_weights) -> None:
    rng = np.random.default_rng(11)
    linear = ExactQ8Linear("gate", target_weights.matrices["model.layers.2.mlp.gate_proj"])
    x = (rng.standard_normal((300, 256)) * 4).astype(np.float32)  # crosses the 256-row chunk
    batched = linear(x)
    one_by_one = np.concatenate([linear(x[i:i + 1]) for i in range(len(x))])
    np.testing.assert_array_equal(batched, one_by_one)
    np.testing.assert_array_equal(linear(x[::-1].copy())[::-1], batched)
    np.testing.assert_array_equal(linear(np.concatenate([x[:7], x[:7]]))[7:], batched[:7])


def test_native_linear_uses_the_same_operands_in_another_order(target_weights) -> None:
    rng = np.random.default_rng(3)
    weight = target_weights.matrices["model.layers.0.mlp.down_proj"]
    x = (rng.standard_normal((64, 512)) * 3).astype(np.float32)
    exact, native = ExactQ8Linear("down", weight)(x), NativeQ8Linear("down", weight)(x)
    scale = np.abs(exact).max()
    assert np.abs(exact - native).max() <= 1e-5 * scale
    assert not np.array_equal(exact, native)  # another accumulation order: some rows differ in ULPs


def test_linear_refuses_non_finite_or_misshaped_input(target_weights) -> None:
    linear = ExactQ8Linear("q", target_weights.matrices["model.layers.0.self_attn.q_proj"])
    with pytest.raises(Refused, match="non-finite"):
        linear(np.full((1, 256), np.nan, np.float32))
    with pytest.raises(Refused, match=r"input shape \[1, 128\]"):
        linear(np.zeros((1, 128), np.float32))


# --- loader refusals -----------------------------------------------------------------------------


def rewrite_target(tmp_path: Path, *, drop: str | None = None, extra: bool = False,
                   as_f16: str | None = None, reshape: str | None = None, arch: str = "llama",
                   heads: int | None = None) -> Path:
    """A copy of the target GGUF written through gguf.GGUFWriter with one thing wrong."""
    reader = gguf.GGUFReader(TARGET)
    out = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(out, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        key = key.replace("llama.", f"{arch}.", 1)
        if key.endswith("attention.head_count") and heads is not None:
            value = heads
        writer.add_key_value(key, value, field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None)
    for tensor in reader.tensors:
        if tensor.name == drop:
            continue
        if tensor.name == as_f16:
            writer.add_tensor(tensor.name, gguf.quants.dequantize(tensor.data, Q8_0).astype(np.float16))
        elif tensor.name == reshape:
            data = np.asarray(tensor.data)
            writer.add_tensor(tensor.name, data[: data.shape[0] // 2].copy(), raw_dtype=tensor.tensor_type)
        else:
            writer.add_tensor(tensor.name, np.asarray(tensor.data).copy(),
                              raw_dtype=tensor.tensor_type if tensor.tensor_type == Q8_0 else None)
    if extra:
        writer.add_tensor("output.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_rewritten_copy_loads(tmp_path: Path) -> None:
    """The refusal fixtures below differ from a loadable file only in the one broken thing."""
    load_target_gguf(rewrite_target(tmp_path), CONFIG)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"drop": "blk.2.ffn_up.weight"}, r"blk\.2\.ffn_up\.weight: tensor missing"),
    ({"extra": True}, r"output\.weight: unexpected tensor"),
    ({"as_f16": "blk.0.attn_v.weight"}, r"blk\.0\.attn_v\.weight: type F16, expected Q8_0"),
    ({"reshape": "blk.1.attn_output.weight"}, r"blk\.1\.attn_output\.weight: shape \[128, 256\], expected \[256, 256\]"),
    ({"arch": "mistral"}, r"general\.architecture: found 'mistral', expected 'llama'"),
    ({"heads": 16}, r"llama\.attention\.head_count: found 16, expected 8"),
])
def test_loader_refuses_malformed_files(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(Refused, match=message) as refused:
        load_target_gguf(rewrite_target(tmp_path, **kwargs), CONFIG)
    assert "\n" not in str(refused.value)


def test_loader_refuses_non_finite_block_scale(tmp_path: Path) -> None:
    bad = tmp_path / "inf-scale.gguf"
    shutil.copyfile(TARGET, bad)
    offset = next(t.data_offset for t in gguf.GGUFReader(TARGET).tensors if t.name == "blk.3.ffn_down.weight")
    with open(bad, "r+b") as handle:  # block 0's float16 scale -> +inf
        handle.seek(offset)
        handle.write(np.float16(np.inf).tobytes())
    with pytest.raises(Refused, match=r"blk\.3\.ffn_down\.weight: 1 non-finite block scales"):
        load_target_gguf(bad, CONFIG)


def test_loader_refuses_missing_truncated_and_foreign_files(tmp_path: Path) -> None:
    with pytest.raises(Refused, match="file: missing"):
        load_target_gguf(tmp_path / "absent.gguf", CONFIG)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(TARGET.read_bytes()[:100_000])
    with pytest.raises(Refused, match="unreadable GGUF"):
        load_target_gguf(truncated, CONFIG)
    with pytest.raises(Refused, match="general.architecture"):
        load_target_gguf(DRAFT, CONFIG)  # the draft file is not a llama target


# --- the k-quant target model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_model():
    from qualify.engines.kquant import load_kquant_model

    return load_kquant_model()


def test_model_rows_do_not_depend_on_how_many_are_fed_together(target_model) -> None:
    """Rows fed in one batched forward equal rows fed one at a time, K/V included, and one-row
    hidden states equal the reference engine's own decode_row path with the same linears."""
    from qualify.core import assets
    prompt = assets.load_prompt()
    kv = target_model.reference.prefill(prompt[:160])
    rows = prompt[160:169]
    batched_cache = target_model.reference.new_cache(kv, 16)
    single_cache = target_model.reference.new_cache(kv, 16)
    reference_cache = target_model.reference.new_cache(kv, 16)
    batched = target_model.forward_rows(batched_cache, rows)
    singles = [target_model.forward_rows(single_cache, rows[i:i + 1]) for i in range(len(rows))]
    np.testing.assert_array_equal(batched.logits, np.concatenate([s.logits for s in singles]))
    np.testing.assert_array_equal(batched.hidden, np.concatenate([s.hidden for s in singles]))
    for mine, theirs in zip(batched_cache.keys + batched_cache.values,
                            single_cache.keys + single_cache.values, strict=True):
        np.testing.assert_array_equal(mine[:, :169], theirs[:, :169])
    by_reference = target_model.reference.forward_rows(reference_cache, rows)
    np.testing.assert_array_equal(batched.hidden, by_reference.hidden)


def test_native_mode_keeps_operands_but_not_bits() -> None:
    from qualify.contract.lanes import ProducerMode
    from qualify.core import assets
    from qualify.engines.kquant import build_kquant_engine

    prompt = assets.load_prompt()[:96]
    exact = build_kquant_engine(ProducerMode.EXACT).prefill(prompt)
    native = build_kquant_engine(ProducerMode.NATIVE).prefill(prompt)
    assert any(not np.array_equal(a, b) for a, b in zip(exact.values, native.values, strict=True))
    # Layer 0's V reads identical quantized operands: only the accumulation order differs.
    np.testing.assert_allclose(native.values[0], exact.values[0], atol=1e-5 * float(np.abs(exact.values[0]).max()))
    for a, b in zip(exact.values, native.values, strict=True):  # later layers: requantization flips
        np.testing.assert_allclose(b, a, atol=1e-2 * float(np.abs(a).max()))

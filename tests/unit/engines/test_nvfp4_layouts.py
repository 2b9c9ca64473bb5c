"""NVFP4 checkpoint layouts (companion, modelopt, compressed-tensors): bit-exact round trips,
detection, and fail-closed refusals.

Files are also read back here without the module under test: the safetensors header is parsed
with struct/json and E2M1/E4M3FN are decoded from their definitions, so the on-disk conventions
(orientation, scale2 vs reciprocal global scale, input scale) are checked independently.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from qualify.core.errors import Refused
from qualify.engines.nvfp4 import (
    ACTIVATION_PRECISION_KEY,
    WEIGHT_PRECISION_KEY,
    Nvfp4Checkpoint,
    StoredTensor,
    dequantize_nvfp4,
    load_nvfp4_checkpoint,
    quantize_nvfp4,
    read_safetensors,
    write_safetensors,
)
from qualify.engines.nvfp4_layouts import (
    EXACT_RECIPROCALS_KEY,
    LAYOUTS,
    detect_layout,
    load_checkpoint,
    write_checkpoint,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
SHIPPED_DIR = REPO_ROOT / "model" / "nvfp4"
ONE = np.float32(1.0)

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
K_PROJ = "model.layers.0.self_attn.k_proj.weight"
DOWN_PROJ = "model.layers.0.mlp.down_proj.weight"
Q_PREFIX = Q_PROJ[: -len(".weight")]
SHAPES = {Q_PROJ: (32, 64), K_PROJ: (16, 64), DOWN_PROJ: (64, 32)}


def bits(values: np.ndarray | np.float32) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.uint32)


def reciprocal_round_trips(value: np.float32) -> bool:
    """float32(1 / float32(1 / v)) == v, computed here with plain numpy float32 division."""
    return bool(ONE / (ONE / np.float32(value)) == np.float32(value))


def first_float32_from(start: float, round_trips: bool) -> np.float32:
    """The first float32 at or above ``start`` whose reciprocal does (or does not) round-trip,
    searched over consecutive bit patterns a block at a time (a scalar nextafter walk took seconds
    at import)."""
    first = int(bits(np.float32(start)))
    for block_start in range(first, first + (1 << 24), 1 << 12):
        candidates = np.arange(block_start, block_start + (1 << 12), dtype=np.uint32).view(np.float32)
        found = np.flatnonzero((ONE / (ONE / candidates) == candidates) == round_trips)
        if found.size:
            return np.float32(candidates[found[0]])
    raise AssertionError(f"no float32 from {start} whose reciprocal round-trips is {round_trips}")


# Per-tensor scalars chosen so that both reciprocal paths (plain, and exact bits in metadata) run.
SCALE2 = {Q_PROJ: first_float32_from(1.7e-4, False), K_PROJ: first_float32_from(2.3e-4, True),
          DOWN_PROJ: first_float32_from(3.1e-4, True)}
INPUT_SCALE_INV = {Q_PROJ: first_float32_from(311.0, False), K_PROJ: first_float32_from(97.0, True),
                   DOWN_PROJ: np.float32(2.0**9)}


def random_checkpoint(w4a4: bool, seed: int = 0) -> Nvfp4Checkpoint:
    rng = np.random.default_rng(seed)
    nvfp4 = {}
    for index, (name, shape) in enumerate(SHAPES.items()):
        weight = (rng.standard_normal(shape) * 0.05 * (index + 1)).astype(np.float32)
        weight[0, :16] = 0.0  # an all-zero block (scale byte for 1.0, codes 0)
        tensor = quantize_nvfp4(weight, name)
        tensor = replace(tensor, scale2=SCALE2[name])
        if w4a4:
            tensor = replace(tensor, input_scale_inv=INPUT_SCALE_INV[name])
        nvfp4[name] = tensor
    dense = {
        "model.embed_tokens.weight": rng.standard_normal((64, 64)).astype(np.float16),
        "model.norm.weight": (1.0 + 0.1 * rng.standard_normal(64)).astype(np.float16),
    }
    metadata = {"format": "pt", "quantization_recipe": "test-recipe", WEIGHT_PRECISION_KEY: "nvfp4",
                ACTIVATION_PRECISION_KEY: "nvfp4" if w4a4 else "a16"}
    return Nvfp4Checkpoint(nvfp4, dense, metadata)


def assert_same_model(expected: Nvfp4Checkpoint, got: Nvfp4Checkpoint) -> None:
    """Every NVFP4 weight dequantizes to the same float32 bits; every F16 tensor has the same bytes."""
    assert sorted(got.nvfp4) == sorted(expected.nvfp4)
    for name, tensor in expected.nvfp4.items():
        loaded = got.nvfp4[name]
        assert loaded.name == name
        np.testing.assert_array_equal(bits(dequantize_nvfp4(loaded)), bits(dequantize_nvfp4(tensor)))
        np.testing.assert_array_equal(loaded.packed, tensor.packed)
        np.testing.assert_array_equal(loaded.scale_bytes, tensor.scale_bytes)
        assert bits(loaded.scale2) == bits(tensor.scale2)
        if tensor.input_scale_inv is None:
            assert loaded.input_scale_inv is None
        else:
            assert loaded.input_scale_inv is not None
            assert bits(loaded.input_scale_inv) == bits(tensor.input_scale_inv)
    assert sorted(got.dense_f16) == sorted(expected.dense_f16)
    for name, array in expected.dense_f16.items():
        assert got.dense_f16[name].dtype == np.float16
        assert got.dense_f16[name].shape == array.shape
        assert got.dense_f16[name].tobytes() == np.asarray(array).tobytes()


def raw_entries(path: Path) -> tuple[dict[str, tuple[str, list[int], bytes]], dict[str, str]]:
    """The safetensors file parsed by hand: name -> (dtype, shape, raw bytes), and metadata."""
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    metadata = header.pop("__metadata__", {})
    base = 8 + header_len
    entries = {name: (entry["dtype"], entry["shape"], data[base + entry["data_offsets"][0] : base + entry["data_offsets"][1]])
               for name, entry in header.items()}
    return entries, metadata


def formula_e2m1(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    return sign * (mantissa * 0.5 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1))


def formula_e4m3fn(byte: int) -> float:
    sign = -1.0 if byte >> 7 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 7
    if exponent == 0:
        return sign * (mantissa / 8.0) * 2.0**-6
    return sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)


E2M1_F64 = np.array([formula_e2m1(c) for c in range(16)])
E4M3FN_F64 = np.array([formula_e4m3fn(b) for b in range(256)])


def decode_e2m1_e4m3_f64(packed: bytes, scale: bytes, n_out: int, n_in: int) -> np.ndarray:
    """float64 e2m1 * e4m3fn [n_out, n_in] from row-contiguous payload and scale bytes (exact)."""
    payload = np.frombuffer(packed, dtype=np.uint8).reshape(n_out, n_in // 2)
    codes = np.empty((n_out, n_in), dtype=np.uint8)
    codes[:, 0::2], codes[:, 1::2] = payload & 0xF, payload >> 4
    scales = E4M3FN_F64[np.frombuffer(scale, dtype=np.uint8).reshape(n_out, n_in // 16)]
    decoded: np.ndarray = E2M1_F64[codes] * np.repeat(scales, 16, axis=1)
    return decoded


def f32_scalar(raw: bytes) -> np.float32:
    (value,) = struct.unpack("<f", raw)
    return np.float32(value)


def write_layout(checkpoint: Nvfp4Checkpoint, directory: Path, layout: str) -> Path:
    written = write_checkpoint(checkpoint, directory, layout)
    assert written == directory / "model.safetensors"
    return written


def edit_file(path: Path, edit: Callable[[dict[str, StoredTensor], dict[str, str]], object]) -> None:
    tensors, metadata = read_safetensors(path)
    tensors, metadata = dict(tensors), dict(metadata)
    edit(tensors, metadata)
    write_safetensors(path, tensors, metadata)


def refusal(path_or_dir: Path) -> str:
    with pytest.raises(Refused) as caught:
        load_checkpoint(path_or_dir)
    message = str(caught.value)
    assert "\n" not in message
    return message


# --- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("w4a4", [False, True], ids=["w4a16", "w4a4"])
def test_every_layout_round_trips_bit_exactly(tmp_path: Path, w4a4: bool) -> None:
    checkpoint = random_checkpoint(w4a4)
    loaded = {}
    for layout in LAYOUTS:
        write_layout(checkpoint, tmp_path / layout, layout)
        assert detect_layout(tmp_path / layout) == layout
        assert detect_layout(tmp_path / layout / "model.safetensors") == layout
        loaded[layout] = load_checkpoint(tmp_path / layout)
        assert_same_model(checkpoint, loaded[layout])
        assert loaded[layout].activation_precision == ("nvfp4" if w4a4 else "a16")
        assert dict(loaded[layout].metadata) == dict(checkpoint.metadata)
    for layout in LAYOUTS[1:]:  # and therefore identical to each other
        assert_same_model(loaded["companion"], loaded[layout])


@pytest.mark.parametrize("w4a4", [False, True], ids=["w4a16", "w4a4"])
def test_exact_reciprocal_metadata_only_where_the_reciprocal_does_not_round_trip(tmp_path: Path, w4a4: bool) -> None:
    checkpoint = random_checkpoint(w4a4)
    expected = {"modelopt": {Q_PREFIX + ".input_scale"} if w4a4 else set(),
                "compressed-tensors": {Q_PREFIX + ".weight_global_scale"}}
    # Only q_proj's scalars lose their value through a float32 reciprocal (chosen that way above).
    assert [reciprocal_round_trips(SCALE2[n]) for n in SHAPES] == [False, True, True]
    assert [reciprocal_round_trips(INPUT_SCALE_INV[n]) for n in SHAPES] == [False, True, True]
    for layout, names in expected.items():
        _, metadata = raw_entries(write_layout(checkpoint, tmp_path / layout, layout))
        table = json.loads(metadata.get(EXACT_RECIPROCALS_KEY, "{}"))
        assert set(table) == names
        for name, hex_bits in table.items():
            tensor = checkpoint.nvfp4[name.rsplit(".", 1)[0] + ".weight"]
            value = tensor.scale2 if layout == "compressed-tensors" else tensor.input_scale_inv
            assert value is not None
            assert hex_bits == f"0x{int(bits(value)):08x}"


def test_shipped_checkpoint_in_every_layout_dequantizes_bit_identically(tmp_path: Path) -> None:
    shipped = load_checkpoint(SHIPPED_DIR)
    model_config = {k: v for k, v in json.loads((SHIPPED_DIR / "config.json").read_text()).items()
                    if k != "quantization_config"}
    for layout in LAYOUTS:
        directory = tmp_path / layout
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(model_config), encoding="utf-8")
        write_layout(shipped, directory, layout)
        assert detect_layout(directory) == layout
        loaded = load_checkpoint(directory)
        assert_same_model(shipped, loaded)
        assert dict(loaded.metadata) == dict(shipped.metadata)
        config = json.loads((directory / "config.json").read_text())
        assert {k: v for k, v in config.items() if k != "quantization_config"} == model_config
    # The shipped checkpoint is ModelOpt's layout (tools/make_nvfp4.py): rewriting it gives its exact bytes.
    assert (tmp_path / "modelopt" / "model.safetensors").read_bytes() == (SHIPPED_DIR / "model.safetensors").read_bytes()
    assert detect_layout(SHIPPED_DIR) == "modelopt"
    assert_same_model(shipped, load_nvfp4_checkpoint(tmp_path / "companion" / "model.safetensors"))


def test_layouts_can_be_converted_into_one_another(tmp_path: Path) -> None:
    checkpoint = random_checkpoint(w4a4=True, seed=3)
    current = checkpoint
    for step, layout in enumerate(("modelopt", "compressed-tensors", "companion", "modelopt")):
        write_layout(current, tmp_path / f"{step}-{layout}", layout)
        current = load_checkpoint(tmp_path / f"{step}-{layout}")
    assert_same_model(checkpoint, current)


# --- the on-disk conventions, read without the module under test --------------------------------


@pytest.mark.parametrize("w4a4", [False, True], ids=["w4a16", "w4a4"])
def test_modelopt_file_names_shapes_and_scales(tmp_path: Path, w4a4: bool) -> None:
    checkpoint = random_checkpoint(w4a4)
    entries, _ = raw_entries(write_layout(checkpoint, tmp_path, "modelopt"))
    dense = {"model.embed_tokens.weight", "model.norm.weight"}
    expected_names = dense | {name[: -len(".weight")] + suffix for name in checkpoint.nvfp4
                              for suffix in (".weight", ".weight_scale", ".weight_scale_2") + ((".input_scale",) if w4a4 else ())}
    assert set(entries) == expected_names
    for name, tensor in checkpoint.nvfp4.items():
        prefix, (n_out, n_in) = name[: -len(".weight")], SHAPES[name]
        payload, scale = entries[prefix + ".weight"], entries[prefix + ".weight_scale"]
        assert payload[:2] == ("U8", [n_out, n_in // 2])
        assert scale[:2] == ("F8_E4M3", [n_out, n_in // 16])  # row-contiguous, not transposed
        scale2 = entries[prefix + ".weight_scale_2"]
        assert scale2[:2] == ("F32", [])
        assert bits(f32_scalar(scale2[2])) == bits(tensor.scale2)  # weight_scale_2 is our scale2
        # dequant = e2m1 * weight_scale * weight_scale_2: e2m1 * e4m3 is exact, one rounding after.
        decoded = (decode_e2m1_e4m3_f64(payload[2], scale[2], n_out, n_in) * float(f32_scalar(scale2[2]))).astype(np.float32)
        np.testing.assert_array_equal(bits(decoded), bits(dequantize_nvfp4(tensor)))
        if w4a4:
            assert tensor.input_scale_inv is not None
            input_scale = entries[prefix + ".input_scale"]
            assert input_scale[:2] == ("F32", [])
            # input_scale is the activation global scale W4A4Linear uses: float32(1 / input_scale_inv).
            assert bits(f32_scalar(input_scale[2])) == bits(ONE / tensor.input_scale_inv)


@pytest.mark.parametrize("w4a4", [False, True], ids=["w4a16", "w4a4"])
def test_compressed_tensors_file_names_shapes_and_reciprocal_global_scale(tmp_path: Path, w4a4: bool) -> None:
    checkpoint = random_checkpoint(w4a4)
    entries, _ = raw_entries(write_layout(checkpoint, tmp_path, "compressed-tensors"))
    suffixes = (".weight_packed", ".weight_scale", ".weight_global_scale") + ((".input_global_scale",) if w4a4 else ())
    assert set(entries) == {"model.embed_tokens.weight", "model.norm.weight"} | {
        name[: -len(".weight")] + suffix for name in checkpoint.nvfp4 for suffix in suffixes}
    for name, tensor in checkpoint.nvfp4.items():
        prefix, (n_out, n_in) = name[: -len(".weight")], SHAPES[name]
        payload, scale = entries[prefix + ".weight_packed"], entries[prefix + ".weight_scale"]
        assert payload[:2] == ("U8", [n_out, n_in // 2])
        assert scale[:2] == ("F8_E4M3", [n_out, n_in // 16])
        assert payload[2] == tensor.packed.tobytes() and scale[2] == tensor.scale_bytes.tobytes()
        global_scale = entries[prefix + ".weight_global_scale"]
        assert global_scale[:2] == ("F32", [1])
        g = f32_scalar(global_scale[2])
        assert bits(g) == bits(ONE / tensor.scale2)  # a divisor: the float32 reciprocal of scale2
        # A consumer's dequant e2m1 * weight_scale / weight_global_scale is ours to float32 rounding.
        consumer = decode_e2m1_e4m3_f64(payload[2], scale[2], n_out, n_in) / float(g)
        np.testing.assert_allclose(consumer, dequantize_nvfp4(tensor), rtol=2.0**-22, atol=0.0)
        if w4a4:
            assert tensor.input_scale_inv is not None
            input_global = entries[prefix + ".input_global_scale"]
            assert input_global[:2] == ("F32", [1])
            assert bits(f32_scalar(input_global[2])) == bits(tensor.input_scale_inv)  # stored as is


@pytest.mark.parametrize(("layout", "algo", "inputs"), [
    ("modelopt", "W4A16_NVFP4", None), ("modelopt", "NVFP4", None),
    ("compressed-tensors", None, False), ("compressed-tensors", None, True)])
def test_quantization_configs(tmp_path: Path, layout: str, algo: str | None, inputs: bool | None) -> None:
    w4a4 = algo == "NVFP4" or bool(inputs)
    write_layout(random_checkpoint(w4a4), tmp_path, layout)
    section = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    excluded = ["lm_head", "model.embed_tokens"]
    if layout == "modelopt":
        hf = json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]
        assert hf == {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": excluded}
        assert section == {"quant_method": "modelopt", **hf, "ignore": excluded}
    else:
        assert not (tmp_path / "hf_quant_config.json").exists()
        assert (section["quant_method"], section["format"], section["ignore"]) == ("compressed-tensors", "nvfp4-pack-quantized", excluded)
        (group,) = section["config_groups"].values()
        assert {k: group["weights"][k] for k in ("num_bits", "type", "strategy", "group_size")} == {
            "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
        assert (group["input_activations"] is not None) == inputs


def test_no_float32_has_a_non_round_tripping_value_as_its_rounded_reciprocal() -> None:
    """Why the exact bits go to metadata: when float32(1/float32(1/v)) != v, no stored float32
    (the rounded reciprocal or any neighbour) would give v back."""
    start = np.float32(0.75).view(np.uint32)
    values = (start + np.arange(1 << 16, dtype=np.uint32)).view(np.float32)
    nearest = ONE / values
    lost = ONE / nearest != values
    assert 0.05 < lost.mean() < 0.5
    for step in range(-3, 4):
        neighbour = (nearest.view(np.int32) + step).view(np.float32)
        assert not (ONE / neighbour == values)[lost].any()


# --- detection ----------------------------------------------------------------------------------


def test_detect_refuses_unknown_and_ambiguous(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    write_safetensors(plain / "model.safetensors", {"model.norm.weight": StoredTensor("F16", np.ones(8, np.float16))}, {})
    with pytest.raises(Refused) as caught:
        detect_layout(plain)
    assert str(caught.value) == (
        f"{plain / 'model.safetensors'}: no NVFP4 layout recognized (expected companion '*.nvfp4_scale', "
        "modelopt '*.weight_scale_2' or compressed-tensors '*.weight_packed' tensors)")

    ct = tmp_path / "ct"
    write_layout(random_checkpoint(w4a4=False), ct, "compressed-tensors")
    (ct / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    with pytest.raises(Refused) as caught:
        detect_layout(ct)
    assert str(caught.value) == (
        f"{ct / 'model.safetensors'}: ambiguous NVFP4 layout: compressed-tensors "
        "(tensor model.layers.0.mlp.down_proj.weight_global_scale), modelopt (hf_quant_config.json)")

    companion = tmp_path / "companion"
    write_layout(random_checkpoint(w4a4=False), companion, "companion")
    (companion / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(Refused) as caught:
        detect_layout(companion)
    assert str(caught.value) == (
        f"{companion / 'config.json'} quantization_config: quant_method 'gptq' is not an NVFP4 layout "
        "(expected 'modelopt' or 'compressed-tensors')")


def test_modelopt_tensors_without_a_quantization_config_are_refused(tmp_path: Path) -> None:
    write_layout(random_checkpoint(w4a4=False), tmp_path, "modelopt")
    (tmp_path / "hf_quant_config.json").unlink()
    (tmp_path / "config.json").unlink()
    with pytest.raises(Refused) as caught:
        detect_layout(tmp_path)
    assert str(caught.value) == (
        f"{tmp_path / 'model.safetensors'}: modelopt tensors but no quantization config (expected "
        f"{tmp_path / 'config.json'} quantization_config or {tmp_path / 'hf_quant_config.json'})")


def test_write_refuses_unknown_layout_and_ambiguous_directory(tmp_path: Path) -> None:
    checkpoint = random_checkpoint(w4a4=False)
    with pytest.raises(Refused) as caught:
        write_checkpoint(checkpoint, tmp_path / "x", "gguf")
    assert str(caught.value) == "nvfp4 layout: 'gguf' is not one of ['companion', 'modelopt', 'compressed-tensors']"
    write_layout(checkpoint, tmp_path / "m", "modelopt")
    with pytest.raises(Refused) as caught:
        write_checkpoint(checkpoint, tmp_path / "m", "companion")
    assert str(caught.value) == (f"{tmp_path / 'm' / 'config.json'}: has a quantization_config; a companion "
                                 "checkpoint beside it would be ambiguous")


# --- loader refusals ----------------------------------------------------------------------------



@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_missing_weight_scale_is_refused(tmp_path: Path, layout: str) -> None:
    path = write_layout(random_checkpoint(w4a4=False), tmp_path, layout)
    edit_file(path, lambda tensors, _: tensors.pop(Q_PREFIX + ".weight_scale"))
    assert refusal(tmp_path) == f"{path}: tensor {Q_PREFIX}.weight_scale: missing"


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_transposed_weight_scale_is_refused(tmp_path: Path, layout: str) -> None:
    """The companion orientation [n_in/16, n_out] is wrong here."""
    path = write_layout(random_checkpoint(w4a4=False), tmp_path, layout)

    def transpose(tensors: dict[str, StoredTensor], _: dict[str, str]) -> None:
        tensors[Q_PREFIX + ".weight_scale"] = StoredTensor("F8_E4M3", tensors[Q_PREFIX + ".weight_scale"].array.T.copy())

    edit_file(path, transpose)
    assert refusal(tmp_path) == f"{path}: tensor {Q_PREFIX}.weight_scale: shape [4, 32], expected [32, 4]"


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("byte", [0x7F, 0xFF])
def test_nan_scale_byte_is_refused(tmp_path: Path, layout: str, byte: int) -> None:
    path = write_layout(random_checkpoint(w4a4=False), tmp_path, layout)

    def poison(tensors: dict[str, StoredTensor], _: dict[str, str]) -> None:
        scale = tensors[Q_PREFIX + ".weight_scale"].array.copy()
        scale[5, 2] = byte
        tensors[Q_PREFIX + ".weight_scale"] = StoredTensor("F8_E4M3", scale)

    edit_file(path, poison)
    assert refusal(tmp_path) == f"{path}: tensor {Q_PREFIX}.weight_scale: E4M3FN NaN byte 0x{byte:02x} at index [5, 2]"


@pytest.mark.parametrize(("layout", "suffix", "stored", "expected"), [
    ("modelopt", ".weight_scale", StoredTensor("U8", np.zeros((32, 4), np.uint8)), "dtype U8, expected F8_E4M3"),
    ("modelopt", ".weight_scale_2", StoredTensor("F32", np.array(0.0, np.float32)), "must be finite and positive, got 0.0"),
    ("modelopt", ".weight_scale_2", StoredTensor("F32", np.array(-1.0, np.float32)), "must be finite and positive, got -1.0"),
    ("modelopt", ".weight_scale_2", StoredTensor("F16", np.array(1.0, np.float16)), "must be an F32 scalar (shape [] or [1]), got F16 []"),
    ("compressed-tensors", ".weight_global_scale", StoredTensor("F32", np.array([np.inf], np.float32)), "must be finite and positive, got inf"),
    ("compressed-tensors", ".weight_global_scale", StoredTensor("F32", np.ones((2,), np.float32)), "must be an F32 scalar (shape [] or [1]), got F32 [2]"),
    ("compressed-tensors", ".weight_packed", StoredTensor("U8", np.zeros((32, 31), np.uint8)),
     "payload must be U8 [n_out, n_in/2] with n_in % 16 == 0, got U8 [32, 31]"),
])
def test_bad_tensor_is_refused_naming_it(tmp_path: Path, layout: str, suffix: str, stored: StoredTensor, expected: str) -> None:
    path = write_layout(random_checkpoint(w4a4=False), tmp_path, layout)
    edit_file(path, lambda tensors, _: tensors.__setitem__(Q_PREFIX + suffix, stored))
    assert refusal(tmp_path) == f"{path}: tensor {Q_PREFIX}{suffix}: {expected}"


@pytest.mark.parametrize(("layout", "input_suffix"), [("modelopt", ".input_scale"), ("compressed-tensors", ".input_global_scale")])
def test_mixed_w4a4_and_w4a16_is_refused(tmp_path: Path, layout: str, input_suffix: str) -> None:
    path = write_layout(random_checkpoint(w4a4=True), tmp_path, layout)
    k_prefix = K_PROJ[: -len(".weight")]

    edit_file(path, lambda tensors, _: tensors.pop(k_prefix + input_suffix))
    down_prefix = DOWN_PROJ[: -len(".weight")]
    assert refusal(tmp_path) == (f"{path}: tensor {k_prefix}{input_suffix}: missing but "
                                 f"{down_prefix}{input_suffix} is present (mixed W4A4/W4A16)")


def test_config_declaring_w4a4_without_input_scales_is_refused(tmp_path: Path) -> None:
    path = write_layout(random_checkpoint(w4a4=False), tmp_path, "modelopt")
    for name in ("hf_quant_config.json", "config.json"):
        document = json.loads((tmp_path / name).read_text())
        section = document["quantization"] if name == "hf_quant_config.json" else document["quantization_config"]
        section["quant_algo"] = "NVFP4"
        (tmp_path / name).write_text(json.dumps(document))
    down_prefix = DOWN_PROJ[: -len(".weight")]
    assert refusal(tmp_path) == (f"{path}: tensor {down_prefix}.input_scale: missing but "
                                 f"{tmp_path / 'hf_quant_config.json'} quant_algo 'NVFP4'")


def test_config_excluding_a_quantized_module_is_refused(tmp_path: Path) -> None:
    path = write_layout(random_checkpoint(w4a4=False), tmp_path, "compressed-tensors")
    document = json.loads((tmp_path / "config.json").read_text())
    document["quantization_config"]["ignore"].append("re:.*self_attn.*")
    (tmp_path / "config.json").write_text(json.dumps(document))
    k_prefix = K_PROJ[: -len(".weight")]
    assert refusal(tmp_path) == (f"{path}: tensor {k_prefix}.weight_packed: NVFP4, but the quantization config "
                                 f"excludes module '{k_prefix}' ('re:.*self_attn.*')")


def test_tampered_exact_reciprocal_is_refused(tmp_path: Path) -> None:
    path = write_layout(random_checkpoint(w4a4=False), tmp_path, "compressed-tensors")
    name = Q_PREFIX + ".weight_global_scale"
    wrong = np.float32(SCALE2[Q_PROJ] * 2)

    def tamper(_: dict[str, StoredTensor], metadata: dict[str, str]) -> None:
        metadata[EXACT_RECIPROCALS_KEY] = json.dumps({name: f"0x{int(bits(wrong)):08x}"})

    edit_file(path, tamper)
    stored = float(ONE / SCALE2[Q_PROJ])
    assert refusal(tmp_path) == (f"{path}: metadata {EXACT_RECIPROCALS_KEY}: '{name}': 1/{float(wrong)!r} rounds to "
                                 f"{float(ONE / wrong)!r}, not the stored {stored!r}")


def test_reader_without_the_metadata_gets_scale2_within_one_ulp(tmp_path: Path) -> None:
    """What a consumer that ignores nvfp4_exact_reciprocals (vLLM) sees: float32(1/stored)."""
    path = write_layout(random_checkpoint(w4a4=False), tmp_path, "compressed-tensors")
    edit_file(path, lambda _, metadata: metadata.pop(EXACT_RECIPROCALS_KEY))
    loaded = load_checkpoint(tmp_path)
    got, want = bits(loaded.nvfp4[Q_PROJ].scale2), bits(SCALE2[Q_PROJ])
    assert got != want and abs(int(got) - int(want)) == 1
    assert bits(loaded.nvfp4[K_PROJ].scale2) == bits(SCALE2[K_PROJ])


def test_modelopt_reader_without_the_metadata_keeps_the_activation_scale(tmp_path: Path) -> None:
    """vLLM's input_scale_inv = float32(1/input_scale) may differ from ours, but the activation
    global scale W4A4Linear uses, float32(1/input_scale_inv), is the same float32."""
    path = write_layout(random_checkpoint(w4a4=True), tmp_path, "modelopt")
    edit_file(path, lambda _, metadata: metadata.pop(EXACT_RECIPROCALS_KEY))
    loaded = load_checkpoint(tmp_path).nvfp4[Q_PROJ].input_scale_inv
    assert loaded is not None
    assert bits(loaded) != bits(INPUT_SCALE_INV[Q_PROJ])
    assert bits(ONE / loaded) == bits(ONE / INPUT_SCALE_INV[Q_PROJ])


def test_dense_tensor_in_place_of_a_compressed_tensors_weight_name_is_refused(tmp_path: Path) -> None:
    path = write_layout(random_checkpoint(w4a4=False), tmp_path, "compressed-tensors")
    edit_file(path, lambda tensors, _: tensors.__setitem__(Q_PROJ, StoredTensor("F16", np.zeros((32, 64), np.float16))))
    assert refusal(tmp_path) == (f"{path}: tensor {Q_PROJ}: both a dense tensor and the name of the NVFP4 weight "
                                 f"{Q_PREFIX}.weight_packed")


def test_writer_refuses_names_and_scales_a_layout_cannot_hold(tmp_path: Path) -> None:
    checkpoint = random_checkpoint(w4a4=False)
    renamed = Nvfp4Checkpoint({"proj": replace(checkpoint.nvfp4[Q_PROJ], name="proj")}, {}, {})
    with pytest.raises(Refused) as caught:
        write_checkpoint(renamed, tmp_path / "a", "modelopt")
    assert str(caught.value) == ("proj: the modelopt layout stores a quantized weight as '<prefix>.weight'; "
                                 "this name has no '.weight' suffix")
    tiny = np.float32(1e-45)  # 1/tiny overflows float32
    subnormal = Nvfp4Checkpoint({Q_PROJ: replace(checkpoint.nvfp4[Q_PROJ], scale2=tiny)}, {}, {})
    with pytest.raises(Refused) as caught:
        write_checkpoint(subnormal, tmp_path / "b", "compressed-tensors")
    assert str(caught.value) == (f"{Q_PREFIX}.weight_global_scale: 1/{float(tiny)!r} is not a finite positive "
                                 "float32; the compressed-tensors layout stores this scale as a reciprocal")
    assert not (tmp_path / "b" / "model.safetensors").exists()


def test_scale_bytes_are_transposed_only_in_the_companion_layout(tmp_path: Path) -> None:
    """Companion stores header shape [n_in/16, n_out] with block-major bytes; the others row-major."""
    checkpoint = random_checkpoint(w4a4=False)
    scale = checkpoint.nvfp4[Q_PROJ].scale_bytes  # [n_out, n_in/16], block b of row o at [o, b]
    companion, _ = raw_entries(write_layout(checkpoint, tmp_path / "c", "companion"))
    assert companion[Q_PROJ + ".nvfp4_scale"][:2] == ("F8_E4M3", [4, 32])
    assert companion[Q_PROJ + ".nvfp4_scale"][2] == np.ascontiguousarray(scale.T).tobytes()
    for layout in ("modelopt", "compressed-tensors"):
        entries, _ = raw_entries(write_layout(checkpoint, tmp_path / layout, layout))
        assert entries[Q_PREFIX + ".weight_scale"][:2] == ("F8_E4M3", [32, 4])
        assert entries[Q_PREFIX + ".weight_scale"][2] == scale.tobytes()
    assert scale.T.tobytes() != scale.tobytes()

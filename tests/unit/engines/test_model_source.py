"""``--model PATH``: a Hugging Face directory or a GGUF file loads into the same float32 weights and
tokenizer, every file pinned by digest, and whatever the reference engine does not implement is
refused in one line naming the file and field or tensor (never a partial model).

The fixtures are the shipped model itself: its directory is a Hugging Face directory, and the
tests write it out as sharded safetensors and as GGUF (F32, Q8_0) with ``gguf.GGUFWriter``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

from qualify.core.assets import MODEL_DIR
from qualify.core.digests import sha256_bytes
from qualify.core.errors import Refused
from qualify.engines.checkpoint import load_config, load_weights
from qualify.engines.kquant import permute_qk_rows_to_gguf
from qualify.engines.model_source import (
    GGUF_LAYER_NAMES,
    PUBLISHED_MODELS,
    TOKENIZER_FILE,
    add_gguf_tokenizer,
    load_model,
    resolve_model,
)

HF_FILES = ("config.json", TOKENIZER_FILE, "model.safetensors")
SAMPLE_TEXT = "def wrap(text, width=70):\n    return [line[:width] for line in text.split('\\n')]  # 12345\n"


@pytest.fixture(scope="module")
def shipped() -> tuple[object, dict[str, np.ndarray]]:
    config = load_config(MODEL_DIR)
    return config, load_weights(MODEL_DIR, config)


def hf_copy(directory: Path) -> Path:
    directory.mkdir()
    for name in HF_FILES:
        shutil.copyfile(MODEL_DIR / name, directory / name)
    return directory


def write_gguf(path: Path, config: object, weights: dict[str, np.ndarray], *, quant: str = "F32",
               architecture: str = "llama", skip: str = "", extra: dict[str, np.ndarray] | None = None,
               raw: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
               tokenizer_json: Path = MODEL_DIR / TOKENIZER_FILE) -> Path:
    """Weights as llama.cpp's GGUF of ``architecture``: a Llama's Q/K rows permuted as
    convert_hf_to_gguf.py does (a Qwen2's not), Q/K/V biases and an untied head where the weights
    have them, projections in ``quant``, norms F32, tokenizer in metadata."""
    geometry = config.geometry  # type: ignore[attr-defined]
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_context_length(geometry.max_positions)
    writer.add_embedding_length(geometry.hidden)
    writer.add_feed_forward_length(config.intermediate)  # type: ignore[attr-defined]
    writer.add_head_count(geometry.heads)
    writer.add_head_count_kv(geometry.kv_heads)
    writer.add_rope_dimension_count(geometry.head_dim)
    writer.add_rope_freq_base(geometry.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)  # type: ignore[attr-defined]
    writer.add_block_count(geometry.layers)
    if geometry.head_dim * geometry.heads != geometry.hidden:
        writer.add_key_length(geometry.head_dim)
        writer.add_value_length(geometry.head_dim)
    add_gguf_tokenizer(writer, tokenizer_json)
    hf_to_gguf = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight"}
    for index in range(geometry.layers):
        for gguf_suffix, hf_suffix in GGUF_LAYER_NAMES.items():
            hf_to_gguf[f"model.layers.{index}.{hf_suffix}"] = f"blk.{index}.{gguf_suffix}"
    for hf_name, gguf_name in hf_to_gguf.items():
        if gguf_name == skip or hf_name not in weights:
            continue
        weight = weights[hf_name]
        if architecture != "llama":
            pass  # llama.cpp's Qwen2 rotates in Hugging Face's half-split layout: nothing to permute
        elif hf_name.endswith("q_proj.weight"):
            weight = permute_qk_rows_to_gguf(weight, geometry.heads)
        elif hf_name.endswith("k_proj.weight"):
            weight = permute_qk_rows_to_gguf(weight, geometry.kv_heads)
        if weight.ndim == 2 and quant != "F32":
            kind = gguf.GGMLQuantizationType[quant]
            writer.add_tensor(gguf_name, gguf.quants.quantize(np.ascontiguousarray(weight), kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(weight, dtype=np.float32))
    for name, value in (extra or {}).items():
        writer.add_tensor(name, value)
    for name, (data, kind) in (raw or {}).items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_same_bits(left: dict[str, np.ndarray], right: dict[str, np.ndarray]) -> None:
    assert sorted(left) == sorted(right)
    for name in left:
        assert left[name].shape == right[name].shape, name
        assert np.array_equal(left[name].view(np.uint32), right[name].view(np.uint32)), name


def test_hf_directory_loads_the_shipped_weights_and_pins_each_file(tmp_path: Path, shipped) -> None:
    model = load_model(hf_copy(tmp_path / "hf"))
    assert model.kind == "hf"
    assert_same_bits(model.weights, shipped[1])
    assert [entry.name for entry in model.files] == list(HF_FILES)
    assert model.tokenizer.encode(SAMPLE_TEXT).ids == load_model(MODEL_DIR).tokenizer.encode(SAMPLE_TEXT).ids


def test_sharded_bf16_directory_widens_exactly(tmp_path: Path, shipped) -> None:
    """Two shards named by the index; one tensor stored as BF16 (values chosen bf16-exact)."""
    config, weights = shipped
    directory = tmp_path / "sharded"
    directory.mkdir()
    for name in ("config.json", TOKENIZER_FILE):
        shutil.copyfile(MODEL_DIR / name, directory / name)
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    bf16_name = "model.norm.weight"
    bf16_values = (weights[bf16_name].view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    expected = dict(weights, **{bf16_name: bf16_values})
    for shard, members in halves.items():
        save_file({name: weights[name] for name in members if name != bf16_name}, str(directory / shard))
    # safetensors.numpy cannot write BF16: append the tensor by hand to shard 2's header.
    shard_two = directory / "model-00002-of-00002.safetensors"
    data = shard_two.read_bytes()
    header_size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + header_size])
    body = data[8 + header_size:]
    bf16_bytes = (bf16_values.view(np.uint32) >> 16).astype("<u2").tobytes()
    header[bf16_name] = {"dtype": "BF16", "shape": list(bf16_values.shape),
                         "data_offsets": [len(body), len(body) + len(bf16_bytes)]}
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    shard_two.write_bytes(len(encoded).to_bytes(8, "little") + encoded + body + bf16_bytes)
    weight_map = {name: shard for shard, members in halves.items() for name in members}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    model = load_model(directory)
    assert_same_bits(model.weights, expected)
    assert [entry.name for entry in model.files][2:] == ["model.safetensors.index.json", *halves]


def test_f32_gguf_gives_the_same_weights_and_tokens_as_the_hf_directory(tmp_path: Path, shipped) -> None:
    config, weights = shipped
    model = load_model(write_gguf(tmp_path / "m.gguf", config, weights))
    assert model.kind == "gguf"
    assert model.geometry == config.geometry
    assert model.config.intermediate == config.intermediate
    assert np.float32(model.config.rms_norm_eps) == np.float32(config.rms_norm_eps)
    assert_same_bits(model.weights, weights)  # the Q/K permutation is undone exactly
    hf_tokenizer = load_model(MODEL_DIR).tokenizer
    text = (MODEL_DIR.parent / "qualify" / "core" / "numerics.py").read_text()
    assert model.tokenizer.encode(text).ids == hf_tokenizer.encode(text).ids
    assert [entry.name for entry in model.files] == ["m.gguf"]


TOKENIZER_PROBE = SAMPLE_TEXT + "In 2024, 1234567 people said: I'LL go, they're here!\n\n\n   x\t\u00e9t\u00e9 99.5%"


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_llama3_and_qwen2_pre_tokenizers_survive_the_gguf_round_trip(pre: str, tmp_path: Path, shipped) -> None:
    """The shipped vocabulary under Llama 3's (digits in threes) or Qwen2's (digits one by one)
    split regex, as their tokenizer.json files state it: written to a GGUF as ``tokenizer.ggml.pre``
    ``llama-bpe`` or ``qwen2`` and rebuilt from it, the tokenizer gives the same ids as the
    tokenizer.json it came from."""
    from tokenizers import Tokenizer

    from qualify.engines.model_source import GGUF_PRE_TOKENIZERS

    document = json.loads((MODEL_DIR / TOKENIZER_FILE).read_text(encoding="utf-8"))
    document["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": GGUF_PRE_TOKENIZERS[pre]}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    tokenizer_json = tmp_path / "tokenizer.json"
    tokenizer_json.write_text(json.dumps(document), encoding="utf-8")
    source = Tokenizer.from_file(str(tokenizer_json))
    rebuilt = load_model(write_gguf(tmp_path / "t.gguf", *shipped, tokenizer_json=tokenizer_json)).tokenizer
    assert rebuilt.encode(TOKENIZER_PROBE).ids == source.encode(TOKENIZER_PROBE).ids
    digits = [piece for piece, _ in rebuilt.pre_tokenizer.pre_tokenize_str("1234567")]
    assert digits == (["123", "456", "7"] if pre == "llama-bpe" else list("1234567"))


def test_q8_0_gguf_is_the_row_wise_q8_0_of_each_weight(tmp_path: Path, shipped) -> None:
    """Q8_0 quantizes rows independently, so undoing the Q/K row permutation after dequantizing
    must give exactly Q8_0 round-tripped Hugging Face rows; norms stay F32 copies."""
    config, weights = shipped
    model = load_model(write_gguf(tmp_path / "q8.gguf", config, weights, quant="Q8_0"))
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    for name, weight in weights.items():
        expected = weight if weight.ndim == 1 else \
            gguf.quants.dequantize(gguf.quants.quantize(weight, q8_0), q8_0).astype(np.float32)
        assert np.array_equal(model.weights[name], expected), name
        if weight.ndim == 2:
            assert not np.array_equal(model.weights[name], weight), name  # really quantized


def refusal(path: Path, pins: dict[str, str] | None = None) -> str:
    with pytest.raises(Refused) as caught:
        load_model(path, pins)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_unsupported_architectures_are_refused_naming_the_field(tmp_path: Path, shipped) -> None:
    directory = hf_copy(tmp_path / "hf")
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["GemmaForCausalLM"]
    (directory / "config.json").write_text(json.dumps(config))
    message = refusal(directory)
    assert "config.json: architectures: expected one of" in message and "found ['GemmaForCausalLM']" in message
    message = refusal(write_gguf(tmp_path / "g.gguf", *shipped, architecture="gpt2"))
    assert message.endswith("g.gguf: general.architecture: found 'gpt2', expected one of 'llama', 'qwen2'")


def test_missing_tensors_are_refused_naming_the_tensor(tmp_path: Path, shipped) -> None:
    config, weights = shipped
    directory = hf_copy(tmp_path / "hf")
    save_file({k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"},
              str(directory / "model.safetensors"))
    assert "model.layers.1.mlp.up_proj.weight: tensor missing; expected shape" in refusal(directory)
    path = write_gguf(tmp_path / "g.gguf", config, weights, skip="blk.2.attn_v.weight")
    assert "g.gguf: model.layers.2.self_attn.v_proj.weight: tensor missing" in refusal(path)


def test_an_untied_head_loads_and_unknown_tensor_types_are_refused(tmp_path: Path, shipped) -> None:
    config, weights = shipped
    head = weights["model.embed_tokens.weight"][::-1].copy()
    untied = load_model(write_gguf(tmp_path / "untied.gguf", config, weights, extra={"output.weight": head}))
    assert not untied.config.tied_head and np.array_equal(untied.weights["lm_head.weight"], head)
    # IQ4_NL: 32 values in 18 bytes; a real llama.cpp type the loader does not dequantize.
    hidden = config.geometry.hidden
    raw = {"blk.0.attn_q.weight": (np.zeros((hidden, hidden // 32 * 18), dtype=np.uint8),
                                   gguf.GGMLQuantizationType.IQ4_NL)}
    odd = write_gguf(tmp_path / "iq.gguf", config, weights, skip="blk.0.attn_q.weight", raw=raw)
    assert "iq.gguf: blk.0.attn_q.weight: tensor type IQ4_NL not supported" in refusal(odd)


def test_truncated_files_are_refused(tmp_path: Path, shipped) -> None:
    directory = hf_copy(tmp_path / "hf")
    weights_file = directory / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:-1000])
    assert "model.safetensors: file: unreadable safetensors" in refusal(directory)
    path = write_gguf(tmp_path / "g.gguf", *shipped)
    path.write_bytes(path.read_bytes()[:-1000])
    assert "g.gguf: file: unreadable GGUF" in refusal(path)


def test_pins_refuse_a_wrong_digest_a_missing_file_and_an_unpinned_file(tmp_path: Path) -> None:
    directory = hf_copy(tmp_path / "hf")
    pins = {entry.name: entry.sha256 for entry in load_model(directory).files}
    assert {entry.name: entry.sha256 for entry in load_model(directory, pins).files} == pins
    wrong = dict(pins, **{"tokenizer.json": "0" * 64})
    assert f"tokenizer.json: sha256 {pins['tokenizer.json']}, expected the pinned {'0' * 64}" \
        in refusal(directory, wrong)
    assert "model.safetensors.index.json: pinned file missing" \
        in refusal(directory, dict(pins, **{"model.safetensors.index.json": "1" * 64}))
    unpinned = {name: digest for name, digest in pins.items() if name != "config.json"}
    assert "config.json: read but not pinned by the identity" in refusal(directory, unpinned)


def test_another_architecture_is_refused_from_the_header_alone(tmp_path: Path, shipped) -> None:
    """The refusal needs only the GGUF header: a file cut right after its metadata (no tensor
    data; the gguf reader refuses it as unreadable) still names its architecture, and so does a
    HF directory whose weights are gone."""
    whole = write_gguf(tmp_path / "Gemma-3.270M.Q8.gguf", *shipped, architecture="gemma3")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:4096])
    assert refusal(cut).endswith("cut.gguf: general.architecture: found 'gemma3', expected one of 'llama', 'qwen2'")
    directory = hf_copy(tmp_path / "hf")
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["Gemma3ForCausalLM"]
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").unlink()
    assert "architectures: expected one of" in refusal(directory)


def test_a_gguf_header_cut_before_its_architecture_is_refused(tmp_path: Path, shipped) -> None:
    whole = write_gguf(tmp_path / "g.gguf", *shipped)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:30])
    assert refusal(cut).endswith("cut.gguf: header: truncated GGUF metadata")


def test_a_bare_name_that_is_no_published_model_is_refused_naming_those_that_are(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Refused) as caught:
        resolve_model("gemma-3-270m")
    assert "not a published model's name" in str(caught.value)
    assert all(name in str(caught.value) for name in PUBLISHED_MODELS)
    (tmp_path / "gemma-3-270m").mkdir()  # a directory of that name is a path, as given
    assert resolve_model("gemma-3-270m") == Path("gemma-3-270m")


def test_a_path_that_is_neither_is_refused(tmp_path: Path) -> None:
    assert refusal(tmp_path / "absent").endswith("absent: model: missing; expected a Hugging Face "
                                                 "directory or a GGUF file")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    assert "notes.txt: model: neither a directory nor a GGUF file" in refusal(text)


def test_a_fifo_is_refused_not_read(tmp_path: Path) -> None:
    """A FIFO (or a device) as --model would block ``open`` until a writer came, or never end:
    refused in one line before any read, by ``qualify model inspect`` as by a run."""
    import os
    import subprocess
    import sys

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    receipts = tmp_path / "receipts"  # the refused run's receipt stays here, not in the operator's archive
    for command in (["model", "inspect", str(fifo)],
                    ["--recipe", "native-text", "--model", str(fifo), "--receipts", str(receipts)]):
        done = subprocess.run([sys.executable, "-m", "qualify.interfaces.cli", *command], capture_output=True,
                              text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        refusal_line = done.stderr.splitlines()[-1]  # a run says first where it made its signing key
        assert str(fifo) in refusal_line and "not a regular file" in refusal_line
    assert len(list(receipts.iterdir())) == 1  # every run leaves a receipt, a refused one too


# ---- qualify model inspect: the same loader from the command line, exit 2 with one line ------


def inspect(argument: str | Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from qualify.interfaces import cli

    capsys.readouterr()
    code = cli.main(["model", "inspect", str(argument)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_model_inspect_prints_geometry_and_every_file_digest(capsys: pytest.CaptureFixture[str]) -> None:
    from qualify.core.digests import sha256_file

    code, out, err = inspect(MODEL_DIR, capsys)
    assert code == 0, err
    assert "hf, llama, 4 layers, hidden 256, 8 heads / 4 KV heads x 32, intermediate 512, vocab 4096" in out
    for name in HF_FILES:
        assert f"file {name}: {(MODEL_DIR / name).stat().st_size} bytes, sha256 {sha256_file(MODEL_DIR / name)}" in out


@pytest.mark.parametrize("damage", ["architecture", "missing tensor", "truncated", "wrong digest"])
def test_model_inspect_refuses_damaged_models_in_one_line_with_exit_2(
        damage: str, tmp_path: Path, shipped, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from qualify.engines import model_source

    config, weights = shipped
    argument: str | Path
    if damage == "architecture":
        argument = write_gguf(tmp_path / "g.gguf", config, weights, architecture="gpt2")
        expected = "general.architecture: found 'gpt2', expected one of 'llama', 'qwen2'"
    elif damage == "missing tensor":
        argument = write_gguf(tmp_path / "g.gguf", config, weights, skip="blk.3.ffn_down.weight")
        expected = "model.layers.3.mlp.down_proj.weight: tensor missing"
    elif damage == "truncated":
        argument = hf_copy(tmp_path / "hf")
        data = (argument / "model.safetensors").read_bytes()
        (argument / "model.safetensors").write_bytes(data[: len(data) // 2])
        expected = "model.safetensors: file: unreadable safetensors"
    else:  # a published model whose installed file is not the pinned one
        site = tmp_path / "site"
        (site / "fake_model-1.0.dist-info").mkdir(parents=True)
        (site / "fake_model-1.0.dist-info" / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: fake-model\nVersion: 1.0\n")
        (site / "fake_model").mkdir()
        (site / "fake_model" / "weights.gguf").write_bytes(b"GGUF not the pinned bytes")
        monkeypatch.syspath_prepend(str(site))
        pinned = model_source.PublishedModel(
            name="pinned-test", distribution="fake-model", version="1.0", file="fake_model/weights.gguf",
            sha256="0" * 64, upstream="test", license="test")
        monkeypatch.setitem(model_source.PUBLISHED_MODELS, "pinned-test", pinned)
        argument = "pinned-test"
        expected = f"weights.gguf: sha256: {sha256_bytes(b'GGUF not the pinned bytes')}, expected the pinned {'0' * 64}"
    code, out, err = inspect(argument, capsys)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("refused: ") and expected in lines[0], err
    assert out == ""


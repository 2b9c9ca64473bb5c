"""``--model``: a chosen model is loaded whole once per process, its files pinned under
``models/<name>/``, its prompts cut by each record's rule under its tokenizer, its NVFP4 lanes'
weights derived in process by the shipped checkpoint's recipe; an identity of another model, a
file whose digest differs and a lane kind that cannot run it are refused in one line (exit 2),
each run still leaving a receipt.

The chosen model here is a copy of the shipped model as a Hugging Face directory: its rule-cut
prompts and derived NVFP4 weights must then be the shipped ones, bit for bit.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from qualify.archive.keys import ensure_signing_key
from qualify.contract.controls import load_document, model_contracts_dir
from qualify.contract.lanes import LaneKind, ProducerMode
from qualify.core import assets, model_choice
from qualify.core.digests import sha256_file
from qualify.core.errors import Refused
from qualify.engines import chosen_model
from qualify.engines.factory import build_producer, checkpoint_digests
from qualify.engines.nvfp4_layouts import load_checkpoint
from qualify.interfaces import cli
from qualify.run.run_contract import check_model

HF_FILES = ("config.json", "tokenizer.json", "model.safetensors")


@pytest.fixture(autouse=True)
def shipped_model_again() -> Iterator[None]:
    """The choice is per process: put the shipped model back after every test."""
    yield
    chosen_model.use_model(None)


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    """The shipped model as a user's Hugging Face directory named ``tiny``."""
    directory = tmp_path / "tiny"
    directory.mkdir()
    for name in HF_FILES:
        shutil.copyfile(assets.MODEL_DIR / name, directory / name)
    return directory


def test_a_chosen_directory_is_pinned_file_by_file_under_its_name(tiny: Path) -> None:
    choice = chosen_model.use_model(str(tiny))
    assert choice is not None and model_choice.chosen() is choice
    assert choice.name == "tiny" and choice.argument == str(tiny)
    assert dict(choice.files) == {f"models/tiny/{name}": sha256_file(tiny / name) for name in HF_FILES}
    assert choice.tokenizer_sha256 == sha256_file(tiny / "tokenizer.json")
    assert model_contracts_dir() == assets.CONTRACTS_DIR / "models" / "tiny"
    digests = checkpoint_digests(LaneKind.NVFP4)
    assert set(digests) == {*choice.files, "models/tiny/derived/nvfp4-w4a16"}
    chosen_model.use_model(None)
    assert model_choice.chosen() is None
    assert model_contracts_dir() == assets.CONTRACTS_DIR
    assert "model/nvfp4/model.safetensors" in checkpoint_digests(LaneKind.NVFP4)


def test_rules_under_the_shipped_tokenizer_give_the_committed_prompts_and_documents(tiny: Path) -> None:
    committed_prompt, committed_document = assets.load_prompt(), load_document("prose-idle-news")
    chosen_model.use_model(str(tiny))
    assert np.array_equal(assets.load_prompt(), committed_prompt)
    assert np.array_equal(load_document("prose-idle-news"), committed_document)


def test_the_derived_nvfp4_weights_are_the_shipped_checkpoints_bit_for_bit(tiny: Path) -> None:
    """tools/make_nvfp4.py made the shipped checkpoint from these float16 weights by the same recipe."""
    shipped = load_checkpoint(assets.MODEL_DIR / "nvfp4")
    chosen_model.use_model(str(tiny))
    derived = chosen_model.nvfp4_checkpoint()
    assert sorted(derived.nvfp4) == sorted(shipped.nvfp4)
    for name, tensor in derived.nvfp4.items():
        other = shipped.nvfp4[name]
        assert np.array_equal(tensor.packed, other.packed), name
        assert np.array_equal(tensor.scale_bytes, other.scale_bytes), name
        assert np.float32(tensor.scale2).tobytes() == np.float32(other.scale2).tobytes(), name
    digest, size = chosen_model.nvfp4_checkpoint_sha256()
    assert size > sum(t.packed.nbytes + t.scale_bytes.nbytes for t in derived.nvfp4.values())
    assert checkpoint_digests(LaneKind.NVFP4)["models/tiny/derived/nvfp4-w4a16"] == digest


def test_a_chosen_models_nvfp4_producer_hands_off_the_shipped_lanes_kv(tiny: Path) -> None:
    prompt = assets.load_prompt()[:48]
    shipped_kv = build_producer("nvfp4-native-splitk", ProducerMode.NATIVE).prefill(prompt)
    chosen_model.use_model(str(tiny))
    chosen = build_producer("nvfp4-native-splitk", ProducerMode.NATIVE)
    assert chosen.digests == checkpoint_digests(LaneKind.NVFP4)
    chosen_tensors, shipped_tensors = chosen.prefill(prompt).tensors(), shipped_kv.tensors()
    assert sorted(chosen_tensors) == sorted(shipped_tensors)
    for name, tensor in chosen_tensors.items():
        assert np.array_equal(tensor, shipped_tensors[name]), name


def test_the_q8_0_yardstick_is_llama_cpps_q8_0_of_each_weight(tiny: Path) -> None:
    import gguf

    chosen_model.use_model(str(tiny))
    weights = chosen_model.q8_0_weights()
    loaded = chosen_model.loaded_model()
    name = "model.layers.0.mlp.down_proj"
    expected = gguf.quants.dequantize(
        gguf.quants.quantize(loaded.weights[f"{name}.weight"], gguf.GGMLQuantizationType.Q8_0),
        gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(weights.matrices[name].dequantize(), expected)
    assert "model.norm.weight" in weights.vectors and "model.embed_tokens" in weights.matrices


def test_lanes_that_run_only_the_shipped_model_are_refused(tiny: Path) -> None:
    chosen_model.use_model(str(tiny))
    with pytest.raises(Refused, match=r"^--model tiny: lane kind transformers runs only the shipped model; expected "
                                      r"a lane of kind nvfp4, kquant or vllm$"):
        build_producer("transformers-cuda-fp32", ProducerMode.NATIVE)
    with pytest.raises(Refused, match=r"^lane kquant-exact-dflash: its draft was trained for the shipped target "
                                      r"only; --model runs the draftless lane kquant-exact$"):
        build_producer("kquant-exact-dflash", ProducerMode.EXACT)


def test_a_chosen_models_draftless_kquant_lane_hands_off_the_shipped_targets_kv(tiny: Path) -> None:
    """tools/make_gguf.py quantized the shipped target from these float16 weights through gguf's
    Q8_0, as the chosen model's lane does in process: the same KV, bit for bit."""
    prompt = assets.load_prompt()[:48]
    shipped = build_producer("kquant-exact", ProducerMode.EXACT)
    assert "model/gguf/target-q8_0.gguf" in shipped.digests
    shipped_kv = shipped.prefill(prompt)
    chosen_model.use_model(str(tiny))
    chosen = build_producer("kquant-exact", ProducerMode.EXACT)
    assert chosen.digests == checkpoint_digests(LaneKind.KQUANT)
    assert set(chosen.digests) == {*chosen_model.require_choice().files, "models/tiny/derived/q8_0"}
    assert chosen.engine.abi == shipped.engine.abi
    chosen_tensors, shipped_tensors = chosen.prefill(prompt).tensors(), shipped_kv.tensors()
    assert sorted(chosen_tensors) == sorted(shipped_tensors)
    for name, tensor in chosen_tensors.items():
        assert np.array_equal(tensor, shipped_tensors[name]), name


def _identity_pinning(files: dict[str, str], lane_kind: LaneKind = LaneKind.NVFP4) -> SimpleNamespace:
    return SimpleNamespace(model_name=model_choice.pinned_model_name(files, "identity"), lane_kind=lane_kind,
                           checkpoint=SimpleNamespace(files=files))


def test_an_identity_of_another_model_or_another_file_digest_is_refused(tiny: Path) -> None:
    shipped_files = checkpoint_digests(LaneKind.NVFP4)
    chosen_model.use_model(str(tiny))
    tiny_files = checkpoint_digests(LaneKind.NVFP4)
    check_model(_identity_pinning(tiny_files), "identity x")  # type: ignore[arg-type]
    with pytest.raises(Refused, match=r"^identity x: checkpoint.files: pins the shipped model, the run has "
                                      r"--model tiny$"):
        check_model(_identity_pinning(shipped_files), "identity x")  # type: ignore[arg-type]
    stale = {**tiny_files, "models/tiny/model.safetensors": "ab" * 32}
    with pytest.raises(Refused, match=r"^identity x: checkpoint.files: models/tiny/model.safetensors: pinned "
                                      rf"sha256 {'ab' * 32}, found {tiny_files['models/tiny/model.safetensors']}$"):
        check_model(_identity_pinning(stale), "identity x")  # type: ignore[arg-type]
    chosen_model.use_model(None)
    with pytest.raises(Refused, match=r"pins --model tiny, the run has the shipped model \(no --model\)$"):
        check_model(_identity_pinning(tiny_files), "identity x")  # type: ignore[arg-type]


def test_an_identity_mixing_two_models_files_is_refused() -> None:
    with pytest.raises(Refused, match="pins files of a, the shipped model, expected one model's files"):
        model_choice.pinned_model_name({"models/a/x.gguf": "0" * 64, "model/config.json": "1" * 64}, "identity")


def _truncated(tiny: Path) -> Path:
    data = (tiny / "model.safetensors").read_bytes()
    (tiny / "model.safetensors").write_bytes(data[: len(data) // 2])
    return tiny


def _other_architecture(tiny: Path) -> Path:
    config = (tiny / "config.json").read_text(encoding="utf-8")
    (tiny / "config.json").write_text(config.replace('"LlamaForCausalLM"', '"GemmaForCausalLM"'), encoding="utf-8")
    return tiny


@pytest.mark.parametrize(("damage", "says"), [
    (lambda tiny: tiny / "absent", "model: missing; expected a Hugging Face directory or a GGUF file"),
    (_truncated, "model.safetensors"),
    (_other_architecture, "architectures"),
], ids=["missing", "truncated", "architecture"])
def test_a_bad_model_refuses_the_run_in_one_line_with_exit_2_and_a_receipt(
        tiny: Path, tmp_path: Path, damage, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    ensure_signing_key()
    archive = tmp_path / "receipts"
    archive.mkdir()
    model = damage(tiny)
    code = cli.main(["--recipe", "native-text", "--model", str(model), "--receipts", str(archive)])
    err = capsys.readouterr().err
    assert code == 2, err
    refusals = [line for line in err.splitlines() if "refused" in line]
    assert len(refusals) == 1 and says in refusals[0] and "Traceback" not in err, err
    assert [path.name.startswith(".") for path in archive.iterdir()] == [False]  # one receipt, published


def test_the_vllm_lanes_directory_holds_the_pinned_arrays_privately(tiny: Path) -> None:
    """vLLM reads a float32 Hugging Face directory this process wrote from the arrays it pinned:
    loaded back it gives those arrays bit for bit, and no other user can write into it."""
    from qualify.engines.checkpoint import load_config, load_weights

    chosen_model.use_model(str(tiny))
    directory = chosen_model.hf_float32_dir()
    assert directory.stat().st_mode & 0o777 == 0o700
    assert chosen_model.hf_float32_dir() == directory  # written once per process
    config = load_config(directory)
    assert config.geometry == chosen_model.loaded_model().geometry
    weights = load_weights(directory, config)
    pinned = chosen_model.loaded_model().weights
    assert sorted(weights) == sorted(pinned)
    assert all(np.array_equal(weights[name].view(np.uint32), pinned[name].view(np.uint32)) for name in pinned)
    digest, _ = chosen_model.hf_float32_sha256()
    assert checkpoint_digests(LaneKind.VLLM)["models/tiny/derived/hf-float32"] == digest


def test_a_chosen_models_kquant_recipe_defaults_to_the_draftless_lane(tiny: Path) -> None:
    from qualify.run.run_contract import default_identity_path

    assert default_identity_path("kquant-target-plus-dflash") == assets.CONTRACTS_DIR / "kquant-exact-dflash-identity-v1.json"
    chosen_model.use_model(str(tiny))
    with pytest.raises(Refused, match=r"kquant-exact-identity-v1.json: no such file: lane kquant-exact has no frozen "
                                      r"identity for --model tiny \(docs/models.md\); frozen for it: none$"):
        default_identity_path("kquant-target-plus-dflash")


def test_a_chosen_models_missing_identity_names_the_lanes_frozen_for_it(
        tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from qualify.run import run_contract as contract

    frozen = tmp_path / "contracts-of-tiny"
    frozen.mkdir()
    (frozen / "kquant-exact-identity-v1.json").write_text(
        json.dumps({"lane": "kquant-exact", "recipe": "kquant-target-plus-dflash"}), encoding="utf-8")
    monkeypatch.setattr(contract, "model_contracts_dir", lambda: frozen)
    chosen_model.use_model(str(tiny))
    assert contract.default_identity_path("kquant-target-plus-dflash") == frozen / "kquant-exact-identity-v1.json"
    with pytest.raises(Refused, match=r"lane nvfp4-native-w4a4 has no frozen identity for --model tiny .*; frozen for "
                                      r"it: kquant-exact \(qualify --recipe kquant-target-plus-dflash --identity "
                                      rf"{re.escape(str(frozen / 'kquant-exact-identity-v1.json'))}\)$"):
        contract.default_identity_path("native-text")

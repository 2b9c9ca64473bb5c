"""The architectures users serve, against Hugging Face transformers (issue 37): Llama 3.x (``llama3``
and ``linear`` RoPE scaling, an untied ``lm_head``), Mistral without sliding window (a head size
other than hidden / heads, as Mistral Nemo has) and Qwen2/2.5 (Q/K/V biases, tied or untied head).
Each checkpoint is built here with random weights from its architecture's config (tiny, the
shipped tokenizer's vocabulary), saved as a Hugging Face directory, loaded through ``--model``'s
loader, and run by the numpy reference engine and the torch engine (float32, CPU): full logits
within float32 rounding of transformers' on every position of a prompt and of a decode after a
handoff. ``qualify model
inspect`` prints each; the NVFP4 and k-quant lanes hand them off (``tests/vllm/`` runs the vLLM
lanes on them).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qualify.core import assets
from qualify.core.errors import Refused
from qualify.engines import chosen_model
from qualify.engines.model_source import load_model
from qualify.engines.reference import ReferenceEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT_TOKENS, HANDOFF, DECODE = 96, 80, 12
# Max |Δlogit| over logits of magnitude ~3.6: measured 0.7-1.1e-5 (float32 rounding over 2 layers
# and 12 decode steps); leaving out the RoPE scaling gives 2.2-3.2, leaving out Qwen2's biases 4.6-4.7.
TOLERANCE = 1e-4


def _tiny(kind: str) -> tuple[Any, Any]:
    """(config, model class) of a tiny random checkpoint of ``kind``, vocabulary the shipped tokenizer's."""
    transformers = pytest.importorskip("transformers", reason="torch extra not installed (pip install -e '.[torch]')")
    common = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  rms_norm_eps=1e-6, hidden_act="silu", initializer_range=0.1)
    if kind == "llama3":
        return transformers.LlamaConfig(
            **common, head_dim=32, tie_word_embeddings=False, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64}), transformers.LlamaForCausalLM
    if kind == "mistral":
        return transformers.MistralConfig(**common, head_dim=64, tie_word_embeddings=False, rope_theta=1000000.0,
                                          sliding_window=None), transformers.MistralForCausalLM
    if kind == "llama-linear":
        return transformers.LlamaConfig(**common, head_dim=32, tie_word_embeddings=True, rope_theta=10000.0,
                                        rope_scaling={"rope_type": "linear", "factor": 4.0}), transformers.LlamaForCausalLM
    tied = kind == "qwen2-tied"
    return transformers.Qwen2Config(**common, tie_word_embeddings=tied, rope_theta=1000000.0,
                                    use_sliding_window=False), transformers.Qwen2ForCausalLM


def write_tiny_checkpoint(kind: str, directory: Path) -> Any:
    """A random-weight checkpoint of ``kind`` saved as a Hugging Face directory (the shipped
    tokenizer beside it); the transformers model, in eval mode."""
    import torch

    config, model_class = _tiny(kind)
    torch.manual_seed(20261206)
    model = model_class(config).eval()
    with torch.no_grad():  # biases are zero at init: give them values, or they test nothing
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0.0, 0.5)
    model.save_pretrained(directory, safe_serialization=True)
    shutil.copyfile(assets.MODEL_DIR / "tokenizer.json", directory / "tokenizer.json")
    return model


KINDS = ["llama3", "llama-linear", "mistral", "qwen2", "qwen2-tied"]
ARCHITECTURE = {"llama3": "llama", "llama-linear": "llama", "mistral": "mistral", "qwen2": "qwen2",
                "qwen2-tied": "qwen2"}


@pytest.fixture(params=KINDS)
def checkpoint(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Path, Any]]:
    """A random-weight checkpoint as a Hugging Face directory, and the transformers model."""
    directory = tmp_path / f"{request.param}-tiny"
    model = write_tiny_checkpoint(request.param, directory)
    yield request.param, directory, model
    chosen_model.use_model(None)


def _transformers_logits(model: Any, prompt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """All prompt rows' logits, and greedy decode rows after a handoff of HANDOFF positions."""
    import torch

    with torch.no_grad():
        full = model(torch.tensor(prompt[None]), use_cache=False).logits[0].numpy()
        out = model(torch.tensor(prompt[None, :HANDOFF]), use_cache=True)
        cache, token = out.past_key_values, torch.tensor(prompt[None, HANDOFF:])
        rows = []
        for _ in range(DECODE):
            out = model(token, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            rows.append(out.logits[0, -1].numpy())
            token = out.logits[:, -1:].argmax(-1)
    return full, np.stack(rows)


def assert_agrees_with_transformers(engine: Any, model: Any, kind: str) -> None:
    """``engine``'s logits against transformers': every prompt row (the engine decoding the prompt
    one row at a time after a handoff of one position, teacher-forced) and a greedy decode after a
    handoff of HANDOFF positions, within TOLERANCE, with the same greedy tokens."""
    prompt = assets.load_prompt()[:PROMPT_TOKENS]
    expected_rows, expected_decode = _transformers_logits(model, prompt)
    decoded = engine.decode(engine.prefill(prompt[:HANDOFF]), prompt[HANDOFF:], DECODE)
    forced = engine.teacher_forced(engine.prefill(prompt[:1]), prompt[1:2], prompt[2:PROMPT_TOKENS])
    assert np.abs(forced - expected_rows[1:PROMPT_TOKENS - 1]).max() < TOLERANCE, kind
    assert np.abs(decoded.logits - expected_decode).max() < TOLERANCE, kind
    assert list(decoded.tokens) == list(expected_decode.argmax(-1)), kind


def test_the_reference_engine_agrees_with_transformers(checkpoint: tuple[str, Path, Any]) -> None:
    kind, directory, model = checkpoint
    loaded = load_model(directory)
    assert loaded.config.architecture == ARCHITECTURE[kind]
    assert loaded.config.tied_head == (kind in ("llama-linear", "qwen2-tied"))
    assert loaded.config.qkv_bias == kind.startswith("qwen2")
    assert (loaded.config.rope_scaling is not None) == kind.startswith("llama")
    engine = ReferenceEngine(loaded.geometry, loaded.weights, rms_norm_eps=loaded.config.rms_norm_eps,
                             rope_scaling=loaded.config.rope_scaling)
    assert_agrees_with_transformers(engine, model, kind)


def test_the_torch_engine_agrees_with_transformers(checkpoint: tuple[str, Path, Any]) -> None:
    """The same checks for :class:`TorchLlama` on the CPU in float32: its scaled RoPE tables,
    untied head and fused Q|K|V bias, from the directory ``--model`` would load."""
    from qualify.engines.torch_llama import TorchLlama

    kind, directory, model = checkpoint
    engine = TorchLlama.from_model_dir(directory, dtype="float32", device="cpu", cache_positions=PROMPT_TOKENS + DECODE,
                                       max_decode_steps=PROMPT_TOKENS, cuda_graph=False)
    assert engine.shape.tied_embeddings == (kind in ("llama-linear", "qwen2-tied"))
    assert_agrees_with_transformers(engine, model, kind)


def llama3_frequency_factors(config: Any) -> np.ndarray:
    """``rope_freqs.weight`` as convert_hf_to_gguf.py computes it from a ``llama3`` rope_scaling:
    per inverse frequency 1 (short wavelengths), ``factor`` (long ones) or the blend's divisor."""
    import math

    scaling, dim = config.rope_scaling, config.head_dim
    base = config.rope_theta if hasattr(config, "rope_theta") else config.rope_parameters["rope_theta"]
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    factors = []
    for index in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (index / dim)
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


GGUF_ARCHITECTURE = {"llama3": "llama", "mistral": "llama", "qwen2": "qwen2"}  # llama.cpp writes a Mistral as llama


@pytest.mark.parametrize("kind", sorted(GGUF_ARCHITECTURE))
def test_a_gguf_of_the_checkpoint_agrees_with_transformers(kind: str, tmp_path: Path) -> None:
    """The same checkpoint as llama.cpp's GGUF: a Llama 3 with its ``llama3`` scaling as
    ``rope_freqs.weight`` frequency factors (convert_hf_to_gguf.py's form), a Mistral as a
    ``llama`` whose head size (64) is given by ``key_length`` (hidden 128 / 4 heads would say 32),
    a Qwen2 with its biases and unpermuted Q/K rows under ``general.architecture = qwen2``.
    Loaded by path, the reference engine's logits are transformers' within the same tolerance."""
    from tests.unit.engines.test_model_source import write_gguf

    directory = tmp_path / kind
    model = write_tiny_checkpoint(kind, directory)
    hf = load_model(directory)
    extra = {"rope_freqs.weight": llama3_frequency_factors(model.config)} if kind == "llama3" else None
    path = write_gguf(tmp_path / f"{kind}.Tiny-F32.gguf", hf.config, hf.weights, architecture=GGUF_ARCHITECTURE[kind],
                      extra=extra, tokenizer_json=directory / "tokenizer.json")
    loaded = load_model(path)
    assert loaded.geometry == hf.geometry and loaded.config.architecture == GGUF_ARCHITECTURE[kind]
    assert (loaded.config.qkv_bias, loaded.config.tied_head) == (hf.config.qkv_bias, hf.config.tied_head)
    assert (loaded.config.rope_scaling is not None) == (kind == "llama3")
    if kind == "llama3":  # vLLM is given a Hugging Face config, and factors have no rope_scaling there
        with pytest.raises(Refused, match="rope_freqs.weight"):
            chosen_model.hf_config_document(loaded.config)
    engine = ReferenceEngine(loaded.geometry, loaded.weights, rms_norm_eps=loaded.config.rms_norm_eps,
                             rope_scaling=loaded.config.rope_scaling)
    assert_agrees_with_transformers(engine, model, kind)


def test_model_inspect_prints_the_architecture_and_the_other_lanes_refuse_it(
        checkpoint: tuple[str, Path, Any], capsys: pytest.CaptureFixture[str]) -> None:
    from qualify.interfaces import cli

    kind, directory, _ = checkpoint
    assert cli.main(["model", "inspect", str(directory)]) == 0
    printed = capsys.readouterr().out
    assert f", {ARCHITECTURE[kind]}, " in printed
    chosen_model.use_model(str(directory))
    engine = chosen_model.reference_engine()
    assert engine.prefill(assets.load_prompt()[:8]).geometry.positions == 8
    assert chosen_model.q8_0_engine().prefill(assets.load_prompt()[:8]).geometry.positions == 8
    # What a vLLM lane loads: the same architecture, scaling, head and weights, written afresh.
    written = chosen_model.hf_float32_dir()
    assert load_model(written).config == load_model(directory).config
    source = json.loads((directory / "config.json").read_text())
    assert json.loads((written / "config.json").read_text())["architectures"] == source["architectures"]


LANES = {"nvfp4-native-splitk": "native-text", "kquant-exact": "kquant-target-plus-dflash"}


@pytest.mark.parametrize("lane", sorted(LANES))
@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_a_lanes_handoffs_on_the_checkpoint(kind: str, lane: str, tmp_path: Path) -> None:
    """The run's handoffs on the chosen model: a real producer process loading the same directory
    (``--model``), the lane's quantized projections over the checkpoint's biases, untied head and
    scaled RoPE, checked against the consumer's cold recompute. k-quant: bit for bit (rung 3).
    NVFP4: a random model's top-two margins are tiny, so 4-bit weights part from the cold
    recompute at a near-tie; what shows the architecture is right is that the parting is a
    near-tie and the teacher-forced drift after it stays small (dropping the biases or the scaling
    moves logits by 2-5, above). No identity is frozen for the model: no anchor, no verdict."""
    import dataclasses

    from qualify.contract.lanes import lane_spec
    from qualify.evidence.records import BitExactRule, BoundedDriftRule
    from qualify.judge.calibration import ANCHOR_PART
    from qualify.run.qualification import STEP_LABELS, QualificationRun, RunOptions
    from qualify.run.run_contract import ORDERED_HANDOFFS, CalibrationHandoff, calibration_contract

    directory = tmp_path / f"{kind}-tiny"
    write_tiny_checkpoint(kind, directory)
    try:
        chosen_model.use_model(str(directory))
        fixture = CalibrationHandoff(ANCHOR_PART, assets.MAIN_PROMPT, assets.load_prompt(assets.MAIN_PROMPT))
        contract = calibration_contract(lane_spec(lane), LANES[lane], [fixture] * ORDERED_HANDOFFS,
                                        calibration_set={"name": "none", "sha256": "0" * 64}, controls=None)
        rule = (BitExactRule(acceptance_floor=None) if lane == "kquant-exact"
                else BoundedDriftRule(maximum_absolute=1.0, maximum_mean_absolute=0.1))
        contract = dataclasses.replace(contract, rule=rule)
        run = QualificationRun(RunOptions(recipe=LANES[lane], receipts=tmp_path / "receipts", reference_once=True,
                                          model=str(directory)), contract)
        outcomes = [run.step(label) for label in STEP_LABELS[:-1]]
        run.close()
    finally:
        chosen_model.use_model(None)
    assert [outcome.passed for outcome in outcomes[:3]] == [True] * 3, [o.message for o in outcomes]
    assert run.records, [o.message for o in outcomes]
    if lane == "kquant-exact":
        assert [outcome.passed for outcome in outcomes] == [True] * len(outcomes), [o.message for o in outcomes]
        assert all(record["token_agreement_rate"] == 1.0 for record in run.records)
        assert all(record["handoff_logit_block_sha256"] == record["cold_logit_block_sha256"] for record in run.records)
        return
    for record in run.records:
        if record["token_agreement_rate"] == 1.0:
            assert 0 < record["max_abs"] < 1.0
        else:
            where = record["localisation"]
            assert where["divergence_class"] == "near-tie", where
            assert where["teacher_forced"]["max_abs"] < 1.0 and where["teacher_forced"]["mean_abs"] < 0.05, where

"""Loading the model ``--model`` names, once per process, and the weights its lanes derive from it.

:func:`use_model` resolves the argument (a published model's name, a Hugging Face directory or a
GGUF file), loads and validates the whole model, and records the choice in
:mod:`qualify.core.model_choice` for the layers below. The lanes of a chosen model derive their
quantized weights here, deterministically, from its float weights: the NVFP4 lanes quantize every
projection with the same recipe the shipped NVFP4 checkpoint was made with, and the E2 yardstick
quantizes them to Q8_0 through ``gguf``. Each derivation is pinned by a digest of its quantized
bytes beside the model's files, so a changed quantizer changes the lane's cache identity.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from qualify.contract.lanes import ProducerMode
from qualify.core import model_choice
from qualify.core.errors import Refused
from qualify.core.model_choice import ModelChoice
from qualify.engines.checkpoint import ARCHITECTURES, LlamaConfig, RopeScaling
from qualify.engines.kquant import KQuantConfig, KQuantEngine, KQuantModel, KQuantWeights, Q8Matrix
from qualify.engines.model_source import PUBLISHED_MODELS, LoadedModel, load_model, resolve_model
from qualify.engines.nvfp4 import (
    ACTIVATION_PRECISION_KEY,
    WEIGHT_PRECISION_KEY,
    WEIGHT_PRECISION_NVFP4,
    Nvfp4Checkpoint,
    quantize_nvfp4,
)
from qualify.engines.reference import MakeLinear, Materialize, ReferenceEngine

QUANTIZED_PROJECTION = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
"""The projections a chosen model's NVFP4 lanes quantize (embeddings, the tied head and norms stay
in the model's own precision), as ``tools/make_nvfp4.py`` does for the shipped model."""
NVFP4_DERIVED = "derived/nvfp4-w4a16"
"""Checkpoint key (under ``models/<name>/``) of the NVFP4 weights derived in process: its digest
is over the quantized bytes (:func:`nvfp4_checkpoint_sha256`)."""
Q8_0_DERIVED = "derived/q8_0"
"""Checkpoint key of the Q8_0 yardstick weights derived in process (:func:`q8_0_weights`)."""
HF_FLOAT32_DERIVED = "derived/hf-float32"
"""Checkpoint key of the float32 Hugging Face directory a vLLM lane loads (:func:`hf_float32_dir`):
its digest is over the float32 weights it holds, in name order."""

_LOADED: list[LoadedModel] = []


def use_model(argument: str | None) -> ModelChoice | None:
    """Choose the process's model: None is the shipped model; anything else is loaded whole and
    validated now (refused in one line, exit 2, before any engine is built)."""
    if argument is None:
        model_choice.choose(None)
        _LOADED.clear()
        return None
    path = resolve_model(argument)
    loaded = load_model(path)
    name = model_choice.model_name_for(str(argument), path, published=str(argument) in PUBLISHED_MODELS)
    choice = ModelChoice(
        name=name, argument=str(argument), path=path,
        files=MappingProxyType({model_choice.file_key(name, entry.name): entry.sha256 for entry in loaded.files}),
        file_sizes=MappingProxyType({model_choice.file_key(name, entry.name): entry.size_bytes
                                     for entry in loaded.files}),
        tokenizer=loaded.tokenizer, tokenizer_sha256=_tokenizer_sha256(loaded))
    _LOADED.clear()
    _LOADED.append(loaded)
    model_choice.choose(choice)
    _nvfp4_derived.cache_clear()
    _q8_0_derived.cache_clear()
    hf_float32_dir.cache_clear()
    nvfp4_checkpoint_sha256.cache_clear()
    q8_0_weights_sha256.cache_clear()
    hf_float32_sha256.cache_clear()
    return choice


def _tokenizer_sha256(loaded: LoadedModel) -> str:
    """A Hugging Face directory's ``tokenizer.json`` digest; a GGUF file's own digest (its
    tokenizer is in its metadata, which the file digest covers)."""
    wanted = "tokenizer.json" if loaded.kind == "hf" else loaded.path.name
    return next(entry.sha256 for entry in loaded.files if entry.name == wanted)


def loaded_model() -> LoadedModel:
    """The chosen model as loaded; refused when no ``--model`` was chosen."""
    if not _LOADED:
        raise Refused("no --model chosen in this process")
    return _LOADED[0]


def reference_engine(make_linear: MakeLinear | None = None, materialize: Materialize | None = None) -> ReferenceEngine:
    """The numpy reference engine on the chosen model's float32 weights (``make_linear`` and
    ``materialize`` as :class:`~qualify.engines.reference.ReferenceEngine` takes them)."""
    loaded = loaded_model()
    return ReferenceEngine(loaded.geometry, loaded.weights, rms_norm_eps=loaded.config.rms_norm_eps,
                           make_linear=make_linear, materialize=materialize, rope_scaling=loaded.config.rope_scaling)


def rope_scaling() -> RopeScaling | None:
    """The chosen model's RoPE scaling (None for the shipped model, or plain RoPE): what its RoPE
    tables, and the digest an identity pins of them, are computed with."""
    return _LOADED[0].config.rope_scaling if _LOADED and model_choice.chosen() is not None else None


def require_choice() -> ModelChoice:
    choice = model_choice.chosen()
    if choice is None:
        raise Refused("no --model chosen in this process")
    return choice


@cache
def _nvfp4_derived() -> Nvfp4Checkpoint:
    return _nvfp4_of(loaded_model())


@cache
def _q8_0_derived() -> KQuantWeights:
    return _q8_0_of(loaded_model())


def _nvfp4_of(loaded: LoadedModel) -> Nvfp4Checkpoint:
    tensors = {name: quantize_nvfp4(np.ascontiguousarray(weight, dtype=np.float32), name)
               for name, weight in sorted(loaded.weights.items()) if QUANTIZED_PROJECTION.match(name)}
    if not tensors:
        raise Refused(f"--model {loaded.path}: no projection weights to quantize to NVFP4")
    metadata = {WEIGHT_PRECISION_KEY: WEIGHT_PRECISION_NVFP4, ACTIVATION_PRECISION_KEY: "a16",
                "quantization_recipe": "nvfp4-modelopt-w4a16-v1"}
    return Nvfp4Checkpoint(nvfp4=MappingProxyType(tensors), dense_f16=MappingProxyType({}),
                           metadata=MappingProxyType(metadata), path=None)


def nvfp4_checkpoint() -> Nvfp4Checkpoint:
    """The chosen model's NVFP4 checkpoint, quantized in this process from its float weights
    (W4A16, the shipped checkpoint's recipe)."""
    return _nvfp4_derived()


@cache
def nvfp4_checkpoint_sha256() -> tuple[str, int]:
    """SHA-256 and byte count over the derived NVFP4 tensors, in name order: each name, its packed
    E2M1 codes, its E4M3FN scale bytes (row-major [n_out, n_in/16]) and its float32 scale2."""
    return _parts_sha256(
        (name, np.ascontiguousarray(tensor.packed), np.ascontiguousarray(tensor.scale_bytes), np.float32(tensor.scale2))
        for name, tensor in sorted(nvfp4_checkpoint().nvfp4.items()))


def _parts_sha256(entries: Iterable[tuple[str, *tuple[np.ndarray | np.generic, ...]]]) -> tuple[str, int]:
    """SHA-256 over each entry's name and arrays, every part prefixed by its 8-byte length (so no
    two different splits hash alike), and the byte count of the parts."""
    digest, size = hashlib.sha256(), 0
    for name, *arrays in entries:
        for part in (name.encode("utf-8"), *(array.tobytes() for array in arrays)):
            digest.update(len(part).to_bytes(8, "little") + part)
            size += len(part)
    return digest.hexdigest(), size


def _q8_0_of(loaded: LoadedModel) -> KQuantWeights:
    import gguf

    matrices: dict[str, Q8Matrix] = {}
    vectors: dict[str, np.ndarray] = {}
    for name, weight in sorted(loaded.weights.items()):
        # The projections, the embedding and an untied head in Q8_0; norms and biases stay float32.
        if QUANTIZED_PROJECTION.match(name) or name in ("model.embed_tokens.weight", "lm_head.weight"):
            raw = gguf.quants.quantize(np.ascontiguousarray(weight, dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
            matrices[name.removesuffix(".weight")] = Q8Matrix.from_gguf_bytes(raw, *weight.shape)
        else:
            vectors[name] = np.ascontiguousarray(weight, dtype=np.float32)
    return KQuantWeights(loaded.path, matrices, vectors)


def q8_0_weights() -> KQuantWeights:
    """The chosen model's Q8_0 weights (Hugging Face names), quantized in this process through
    ``gguf.quants`` (llama.cpp's reference Q8_0)."""
    return _q8_0_derived()


@cache
def q8_0_weights_sha256() -> tuple[str, int]:
    """SHA-256 and byte count over the derived Q8_0 matrices in name order (name, int8 quants,
    float32 scales)."""
    return _parts_sha256((name, matrix.quants, matrix.scales) for name, matrix in sorted(q8_0_weights().matrices.items()))


def q8_0_engine(mode: ProducerMode = ProducerMode.EXACT) -> KQuantEngine:
    """The chosen model's Q8_0 weights, plain greedy decode: in llama.cpp's exact arithmetic, the
    ``kquant-exact`` lane's engine and the E2 yardstick; ``NATIVE`` is the ``kquant-native``
    fault producer's float accumulation."""
    loaded = loaded_model()
    geometry = loaded.geometry
    config = KQuantConfig(vocab=geometry.vocab, hidden=geometry.hidden, intermediate=loaded.config.intermediate,
                          layers=geometry.layers, heads=geometry.heads, kv_heads=geometry.kv_heads,
                          head_dim=geometry.head_dim, max_positions=geometry.max_positions,
                          rope_theta=geometry.rope_theta, rms_norm_eps=loaded.config.rms_norm_eps,
                          rope_scaling=loaded.config.rope_scaling)
    return KQuantEngine(KQuantModel(q8_0_weights(), config, mode))


@cache
def hf_float32_sha256() -> tuple[str, int]:
    """SHA-256 and byte count over the chosen model's float32 weights in name order (name, bytes)."""
    return _parts_sha256((name, np.ascontiguousarray(weight, dtype=np.float32))
                         for name, weight in sorted(loaded_model().weights.items()))


def hf_config_document(config: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of a float32 Hugging Face directory of ``config``'s model: a Llama
    (its RoPE scaling as Hugging Face writes it), a Mistral or a Qwen2 (no sliding window), tied or not."""
    geometry = config.geometry
    scaling = config.rope_scaling
    if scaling is not None and scaling.rope_type == "frequency-factors":
        raise Refused("--model: a GGUF's RoPE frequency factors (rope_freqs.weight) have no Hugging Face "
                      "rope_scaling to give vLLM; give the model's Hugging Face directory for the vLLM lanes")
    rope_scaling = None if scaling is None else (
        {"rope_type": "linear", "factor": scaling.factor} if scaling.rope_type == "linear" else
        {"rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
         "high_freq_factor": scaling.high_freq_factor,
         "original_max_position_embeddings": scaling.original_max_position_embeddings})
    architecture = {value: key for key, value in ARCHITECTURES.items()}[config.architecture]
    document: dict[str, Any] = {
        "architectures": [architecture], "model_type": config.architecture, "vocab_size": geometry.vocab,
        "hidden_size": geometry.hidden, "intermediate_size": config.intermediate,
        "num_hidden_layers": geometry.layers, "num_attention_heads": geometry.heads,
        "num_key_value_heads": geometry.kv_heads, "head_dim": geometry.head_dim, "hidden_act": "silu",
        "max_position_embeddings": geometry.max_positions, "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": geometry.rope_theta, "rope_scaling": rope_scaling, "tie_word_embeddings": config.tied_head,
        "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "float32",
    }
    if config.architecture == "llama":
        document.update(attention_bias=False, mlp_bias=False)
    elif config.architecture == "mistral":
        document.update(sliding_window=None)
    else:
        document.update(use_sliding_window=False, sliding_window=None, max_window_layers=geometry.layers)
    return document


@cache
def hf_float32_dir() -> Path:
    """The chosen model as a float32 ``LlamaForCausalLM`` directory (``config.json``,
    ``model.safetensors``, ``tokenizer.json``) for engines that load only that format (vLLM): the
    very arrays the pin (:func:`hf_float32_sha256`) and the reference engine cover, written by this
    process into its own private temporary directory (never a shared cache another process could
    have changed), removed when the interpreter exits."""
    import atexit
    import json
    import shutil
    import tempfile

    from safetensors.numpy import save_file

    loaded, choice = loaded_model(), require_choice()
    document = hf_config_document(loaded.config)
    directory = Path(tempfile.mkdtemp(prefix=f"qualify-{choice.name}-hf-float32-"))  # mode 0700
    atexit.register(shutil.rmtree, directory, True)
    (directory / "config.json").write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    save_file({name: np.ascontiguousarray(weight, dtype=np.float32) for name, weight in loaded.weights.items()},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
    loaded.tokenizer.save(str(directory / "tokenizer.json"))
    return directory

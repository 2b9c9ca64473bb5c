"""Load a Hugging Face Llama checkpoint (``config.json`` + ``model.safetensors``), failing closed.

Only what the reference engine implements is accepted: ``LlamaForCausalLM`` (Llama 2 and 3.x:
RoPE plain, ``linear`` or ``llama3``-scaled; tied or untied ``lm_head``; no biases),
``MistralForCausalLM`` (the same arithmetic, without sliding-window attention) and
``Qwen2ForCausalLM`` (Qwen2 and 2.5: Q/K/V biases, tied or untied head, no sliding window), with
SiLU. Weights are upcast to float32 exactly (float16 -> float32 is
lossless) and refused if any value is not finite. Every refusal is one line naming file and field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qualify.core.errors import Refused, one_line
from qualify.engines.base import ModelGeometry

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# Stored dtypes we upcast; float16 and float32 both convert to float32 without rounding.
ACCEPTED_WEIGHT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32))


ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
"""The Hugging Face architectures the engines implement, and their ``model_type``."""


@dataclass(frozen=True)
class RopeScaling:
    """A scaled RoPE (Hugging Face ``rope_scaling``): ``linear`` divides every inverse frequency
    by ``factor``; ``llama3`` divides the low frequencies by it, keeps the high ones and blends
    between (Llama 3.1 and later)."""

    rope_type: str  # "linear", "llama3" or "frequency-factors"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # "frequency-factors": llama3 scaling as a GGUF stores it (``rope_freqs.weight``, what
    # convert_hf_to_gguf.py computes from the four numbers above): each inverse frequency divided
    # by its float32 factor, as llama.cpp applies them. ``factor`` is then the largest of them.
    frequency_factors: tuple[float, ...] = ()


@dataclass(frozen=True)
class LlamaConfig:
    """The config fields the reference engine needs, already validated. The defaults are the
    shipped model's: a Llama with a tied head, no biases and plain RoPE."""

    geometry: ModelGeometry
    intermediate: int
    rms_norm_eps: float
    architecture: str = "llama"  # a value of ARCHITECTURES
    tied_head: bool = True  # the LM head is the embedding; else lm_head.weight
    qkv_bias: bool = False  # q/k/v projections carry biases (Qwen2)
    rope_scaling: RopeScaling | None = None

    @property
    def plain(self) -> bool:
        """Whether this is the architecture every engine implements (the shipped model's)."""
        return self.tied_head and not self.qkv_bias and self.rope_scaling is None

    def features(self) -> str:
        """What sets it apart from a plain Llama, in words (for refusals)."""
        parts = [name for name, present in (("an untied lm_head", not self.tied_head),
                                            ("Q/K/V biases", self.qkv_bias)) if present]
        if self.rope_scaling is not None:
            parts.append(f"{self.rope_scaling.rope_type} RoPE scaling")
        return ", ".join(parts) or "nothing"


def _refuse(path: Path, field: str, problem: str) -> Refused:
    return Refused(one_line(f"{path}: {field}: {problem}"))


def _positive_int(config: dict[str, Any], key: str, path: Path) -> int:
    if key not in config:
        raise _refuse(path, key, "missing; expected a positive integer")
    value = config[key]
    # bool is an int subclass in Python; a JSON true is not a size.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _refuse(path, key, f"expected a positive integer, found {value!r}")
    return value


def _positive_float(config: dict[str, Any], key: str, path: Path) -> float:
    if key not in config:
        raise _refuse(path, key, "missing; expected a positive number")
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise _refuse(path, key, f"expected a positive finite number, found {value!r}")
    return float(value)


def _rope_scaling(section: dict[str, Any], field: str, path: Path) -> RopeScaling | None:
    """``rope_scaling`` (transformers 4) or ``rope_parameters`` (transformers 5): None for plain
    RoPE, the scaling for ``linear`` and ``llama3``; any other type is refused naming it."""
    rope_type = section.get("rope_type", section.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return RopeScaling("linear", _positive_float(section, "factor", path))
    if rope_type == "llama3":
        low, high = (_positive_float(section, key, path) for key in ("low_freq_factor", "high_freq_factor"))
        if high <= low:
            raise _refuse(path, f"{field}.high_freq_factor", f"{high} is not above low_freq_factor {low}")
        return RopeScaling("llama3", _positive_float(section, "factor", path), low, high,
                           _positive_int(section, "original_max_position_embeddings", path))
    raise _refuse(path, f"{field}.rope_type", f"found {rope_type!r}, expected 'default', 'linear' or 'llama3' "
                                              "(dynamic and YaRN scaling are not implemented)")


def _rope(config: dict[str, Any], path: Path) -> tuple[float, RopeScaling | None]:
    """RoPE's theta and scaling: rope_theta and rope_scaling at top level (transformers 4 style),
    or in rope_parameters (transformers 5)."""
    scaling = config.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise _refuse(path, "rope_scaling", f"expected null or an object, found {scaling!r}")
    parsed = None if scaling is None else _rope_scaling(scaling, "rope_scaling", path)
    parameters = config.get("rope_parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise _refuse(path, "rope_parameters", f"expected an object, found {parameters!r}")
        from_parameters = _rope_scaling(parameters, "rope_parameters", path)
        if scaling is not None and from_parameters != parsed:
            raise _refuse(path, "rope_parameters", "disagrees with rope_scaling")
        parsed = from_parameters
    return _rope_theta(config, path), parsed


def _rope_theta(config: dict[str, Any], path: Path) -> float:
    """rope_theta at top level (transformers 4 style) or in rope_parameters (transformers 5)."""
    parameters = config.get("rope_parameters")
    if isinstance(parameters, dict):
        if "rope_theta" in parameters:
            theta = _positive_float(parameters, "rope_theta", path)
            if "rope_theta" in config and _positive_float(config, "rope_theta", path) != theta:
                raise _refuse(path, "rope_theta", "disagrees with rope_parameters.rope_theta")
            return theta
    return _positive_float(config, "rope_theta", path)


def load_config(model_dir: Path) -> LlamaConfig:
    """Read and validate ``config.json``; refuse anything the reference engine does not implement."""
    path = Path(model_dir) / CONFIG_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _refuse(path, "file", "missing") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise _refuse(path, "file", f"unreadable ({type(exc).__name__})") from None
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise _refuse(path, "json", f"not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise _refuse(path, "json", f"expected an object, found {type(config).__name__}")

    architectures = config.get("architectures")
    if not isinstance(architectures, list) or len(architectures) != 1 or architectures[0] not in ARCHITECTURES:
        raise _refuse(path, "architectures", f"expected one of {[[name] for name in ARCHITECTURES]}, "
                                             f"found {architectures!r}")
    architecture = ARCHITECTURES[architectures[0]]
    if config.get("model_type", architecture) != architecture:
        raise _refuse(path, "model_type", f"expected {architecture!r}, found {config.get('model_type')!r}")
    if architecture == "qwen2" and config.get("use_sliding_window", False) is not False:
        raise _refuse(path, "use_sliding_window", f"expected false (sliding-window attention is not implemented), "
                                                  f"found {config['use_sliding_window']!r}")
    # A Mistral without a window is a Llama (Hugging Face's MistralAttention differs only there).
    if architecture == "mistral" and config.get("sliding_window") is not None:
        raise _refuse(path, "sliding_window", f"expected null (sliding-window attention is not implemented), "
                                              f"found {config['sliding_window']!r}")
    if "hidden_act" not in config:
        raise _refuse(path, "hidden_act", "missing; expected 'silu'")
    if config["hidden_act"] != "silu":
        raise _refuse(path, "hidden_act", f"expected 'silu', found {config['hidden_act']!r}")
    if "tie_word_embeddings" not in config:
        raise _refuse(path, "tie_word_embeddings", "missing; expected true or false")
    if not isinstance(config["tie_word_embeddings"], bool):
        raise _refuse(path, "tie_word_embeddings", f"expected true or false, found {config['tie_word_embeddings']!r}")
    for key in ("mlp_bias",) if architecture == "qwen2" else ("attention_bias", "mlp_bias"):
        # Absent means false in Hugging Face's LlamaConfig; anything but false is unimplemented.
        if config.get(key, False) is not False:
            raise _refuse(path, key, f"expected false (no biases), found {config[key]!r}")

    layers = _positive_int(config, "num_hidden_layers", path)
    hidden = _positive_int(config, "hidden_size", path)
    heads = _positive_int(config, "num_attention_heads", path)
    kv_heads = _positive_int(config, "num_key_value_heads", path)
    # Absent or null, head_dim is hidden_size // num_attention_heads, as in Hugging Face's configs
    # (Llama 3.x and Qwen2.5 checkpoints on the Hub leave it out; Mistral Nemo sets another).
    head_dim = hidden // heads if config.get("head_dim") is None else _positive_int(config, "head_dim", path)
    intermediate = _positive_int(config, "intermediate_size", path)
    vocab = _positive_int(config, "vocab_size", path)
    max_positions = _positive_int(config, "max_position_embeddings", path)
    rms_norm_eps = _positive_float(config, "rms_norm_eps", path)
    rope_theta, rope_scaling = _rope(config, path)
    if heads % kv_heads != 0:
        raise _refuse(path, "num_key_value_heads",
                      f"{kv_heads} does not divide num_attention_heads {heads}")
    if head_dim % 2 != 0:
        raise _refuse(path, "head_dim", f"expected an even number (RoPE rotates pairs), found {head_dim}")

    geometry = ModelGeometry(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                             head_dim=head_dim, vocab=vocab, max_positions=max_positions,
                             rope_theta=rope_theta)
    return LlamaConfig(geometry=geometry, intermediate=intermediate, rms_norm_eps=rms_norm_eps,
                       architecture=architecture, tied_head=config["tie_word_embeddings"],
                       qkv_bias=architecture == "qwen2", rope_scaling=rope_scaling)


def expected_tensor_shapes(geometry: ModelGeometry, intermediate: int, *, tied_head: bool = True,
                           qkv_bias: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint holds, by Hugging Face name, with its shape: a Llama's, plus
    ``lm_head.weight`` when the head is untied and the Q/K/V biases of a Qwen2."""
    hidden, attn_width = geometry.hidden, geometry.heads * geometry.head_dim
    kv_width = geometry.kv_heads * geometry.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (geometry.vocab, hidden)}
    for index in range(geometry.layers):
        prefix = f"model.layers.{index}."
        shapes[prefix + "input_layernorm.weight"] = (hidden,)
        shapes[prefix + "self_attn.q_proj.weight"] = (attn_width, hidden)
        shapes[prefix + "self_attn.k_proj.weight"] = (kv_width, hidden)
        shapes[prefix + "self_attn.v_proj.weight"] = (kv_width, hidden)
        shapes[prefix + "self_attn.o_proj.weight"] = (hidden, attn_width)
        shapes[prefix + "post_attention_layernorm.weight"] = (hidden,)
        shapes[prefix + "mlp.gate_proj.weight"] = (intermediate, hidden)
        shapes[prefix + "mlp.up_proj.weight"] = (intermediate, hidden)
        shapes[prefix + "mlp.down_proj.weight"] = (hidden, intermediate)
        if qkv_bias:
            shapes[prefix + "self_attn.q_proj.bias"] = (attn_width,)
            shapes[prefix + "self_attn.k_proj.bias"] = (kv_width,)
            shapes[prefix + "self_attn.v_proj.bias"] = (kv_width,)
    shapes["model.norm.weight"] = (hidden,)
    if not tied_head:
        shapes["lm_head.weight"] = (geometry.vocab, hidden)
    return shapes


def check_tensors(weights: dict[str, np.ndarray], expected: dict[str, tuple[int, ...]], source: str,
                  unexpected_note: str = "") -> None:
    """Refuse (one line naming ``source`` and the tensor) a missing, unexpected, mis-shaped,
    non-float32 or non-finite tensor against the ``expected`` name -> shape table."""
    for name, shape in expected.items():
        if name not in weights:
            raise Refused(f"{source}: {name}: tensor missing; expected shape {list(shape)}")
        tensor = weights[name]
        if not isinstance(tensor, np.ndarray) or tensor.dtype != np.float32:
            found = tensor.dtype if isinstance(tensor, np.ndarray) else type(tensor).__name__
            raise Refused(f"{source}: {name}: expected a float32 array, found {found}")
        if tensor.shape != shape:
            raise Refused(f"{source}: {name}: shape {list(tensor.shape)}, expected {list(shape)}")
        if not np.isfinite(tensor).all():
            count = int(tensor.size - np.count_nonzero(np.isfinite(tensor)))
            raise Refused(f"{source}: {name}: {count} non-finite values")
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise Refused(f"{source}: {unexpected[0]}: unexpected tensor ({len(unexpected)} unexpected"
                      f"{unexpected_note})")


def check_weights(weights: dict[str, np.ndarray], geometry: ModelGeometry, intermediate: int,
                  source: str, *, tied_head: bool = True, qkv_bias: bool = False) -> None:
    """The model's tensors, checked with :func:`check_tensors` against its geometry and config."""
    check_tensors(weights, expected_tensor_shapes(geometry, intermediate, tied_head=tied_head, qkv_bias=qkv_bias),
                  source, "; an lm_head beside a tied embedding, or biases of a Llama, are not implemented")


def load_checkpoint(model_dir: Path) -> tuple[ModelGeometry, dict[str, np.ndarray]]:
    """Geometry and float32 weights (Hugging Face names) of the checkpoint in ``model_dir``."""
    config = load_config(model_dir)
    return config.geometry, load_weights(model_dir, config)


def load_weights(model_dir: Path, config: LlamaConfig) -> dict[str, np.ndarray]:
    """The float32 weights of ``model.safetensors``, checked against ``config``."""
    # Imported here so that importing this module stays cheap for code that only reads configs.
    from safetensors.numpy import load_file

    path = Path(model_dir) / WEIGHTS_FILE
    if not path.is_file():
        raise _refuse(path, "file", "missing")
    try:
        stored = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types, plus OSError/ValueError
        raise _refuse(path, "file", f"unreadable safetensors ({type(exc).__name__}: {exc})") from None
    weights: dict[str, np.ndarray] = {}
    for name, tensor in stored.items():
        if tensor.dtype not in ACCEPTED_WEIGHT_DTYPES:
            raise _refuse(path, name, f"dtype {tensor.dtype}, expected float16 or float32")
        weights[name] = np.ascontiguousarray(tensor, dtype=np.float32)
    check_weights(weights, config.geometry, config.intermediate, str(path), tied_head=config.tied_head,
                  qkv_bias=config.qkv_bias)
    return weights


HF_MODEL_FILES = (CONFIG_FILE, WEIGHTS_FILE)


def model_files_view(model_dir: Path, label: str, at: Path | None = None) -> Path:
    """A private directory of symlinks to exactly ``config.json`` and ``model.safetensors``: the
    shipped model directory also holds the draft head's safetensors, which Hugging Face-style
    loaders (transformers, vLLM) would load as extra shards. Removed at interpreter exit; at ``at``
    instead (a new folder, the caller's to remove) when several processes must name the model by
    one path (a NIXL pair's handshake compares the model path)."""
    import atexit
    import shutil
    import tempfile

    if at is None:
        view = Path(tempfile.mkdtemp(prefix=f"qualify-{label}-model-"))
        atexit.register(shutil.rmtree, view, True)
    else:
        view = at
        view.mkdir(parents=True)
    for name in HF_MODEL_FILES:
        source = Path(model_dir).resolve() / name
        if not source.is_file():
            raise Refused(f"{label} model: {source} is missing")
        (view / name).symlink_to(source)
    return view

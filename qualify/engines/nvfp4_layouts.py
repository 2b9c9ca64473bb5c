"""NVFP4 checkpoints in the three on-disk layouts real tools use, read and written bit-exactly.

One in-memory model (``Nvfp4Checkpoint``: ``Nvfp4Tensor`` per quantized weight, F16 for the rest)
and three layouts of ``model.safetensors`` (``<p>`` is the Hugging Face name less ``.weight``):

* ``companion`` (seed 003, ``nvfp4.py``'s writer and loader, unchanged): ``<p>.weight`` U8
  ``[n_out, n_in/2]``; ``<p>.weight.nvfp4_scale`` F8_E4M3 ``[n_in/16, n_out]`` (transposed);
  ``.nvfp4_scale2`` F32 ``[]`` = scale2; ``.nvfp4_input_scale_inv`` F32 ``[]`` = input_scale_inv;
  metadata ``weight_precision``/``activation_precision``; no quantization config.
* ``modelopt`` (TensorRT Model Optimizer, as vLLM's ModelOpt NVFP4 methods read it):
  ``<p>.weight`` U8 ``[n_out, n_in/2]``; ``<p>.weight_scale`` F8_E4M3 ``[n_out, n_in/16]``;
  ``<p>.weight_scale_2`` F32 ``[]`` = scale2; ``<p>.input_scale`` F32 ``[]`` = 1/input_scale_inv
  (W4A4 only); ``hf_quant_config.json`` plus ``config.json`` ``quantization_config``
  (``quant_method`` ``modelopt``, ``quant_algo`` ``NVFP4`` for W4A4 or ``W4A16_NVFP4``).
* ``compressed-tensors`` (llm-compressor ``nvfp4-pack-quantized``): ``<p>.weight_packed`` U8
  ``[n_out, n_in/2]``; ``<p>.weight_scale`` F8_E4M3 ``[n_out, n_in/16]``;
  ``<p>.weight_global_scale`` F32 ``[1]`` = 1/scale2 (a divisor: dequant is
  ``e2m1 * weight_scale / weight_global_scale``); ``<p>.input_global_scale`` F32 ``[1]`` =
  input_scale_inv (W4A4 only); ``config.json`` ``quantization_config``.

Nibble order (lo nibble = even column) and E4M3FN bytes are identical in all three; only the
scale tensor's orientation and the two per-tensor scalars differ. A scalar stored as a reciprocal
(modelopt ``input_scale``, compressed-tensors ``weight_global_scale``) is ``float32(1/v)``; the
reader takes ``float32(1/stored)``, as vLLM does. That gives back ``v`` exactly unless no float32
has ``v`` as its rounded reciprocal (about 17% of values); then the writer also records ``v``'s
bits in the safetensors metadata key ``nvfp4_exact_reciprocals`` (tensor name -> ``0x%08x``) and
the reader uses them after checking that ``float32(1/v)`` is the stored value. Every reader
refusal is one line naming the file and the tensor or config key (see docs/nvfp4-layouts.md).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Literal

import numpy as np

from qualify.core.errors import Refused, one_line
from qualify.core.strict_json import read_strict_json
from qualify.engines.nvfp4 import (
    ACTIVATION_PRECISION_KEY,
    BLOCK_SIZE,
    COMPANION_SUFFIXES,
    WEIGHT_PRECISION_KEY,
    WEIGHT_PRECISION_NVFP4,
    Nvfp4Checkpoint,
    Nvfp4Tensor,
    StoredTensor,
    e4m3fn_decode,
    load_nvfp4_checkpoint,
    read_safetensors,
    validate_nvfp4_tensor,
    write_nvfp4_checkpoint,
    write_safetensors,
)

Layout = Literal["companion", "modelopt", "compressed-tensors"]
LAYOUTS: tuple[Layout, ...] = ("companion", "modelopt", "compressed-tensors")

SAFETENSORS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
HF_QUANT_CONFIG_FILE = "hf_quant_config.json"
QUANTIZATION_CONFIG_KEY = "quantization_config"
EXACT_RECIPROCALS_KEY = "nvfp4_exact_reciprocals"  # safetensors metadata: name -> float32 bits

MODELOPT_QUANT_METHOD = "modelopt"
MODELOPT_W4A4_ALGO = "NVFP4"
MODELOPT_W4A16_ALGO = "W4A16_NVFP4"
CT_QUANT_METHOD = "compressed-tensors"
CT_FORMAT = "nvfp4-pack-quantized"
PRODUCER = {"name": "trust-ladder", "version": "nvfp4-layouts-v1"}

_CT_ARGS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": BLOCK_SIZE}
_METADATA_NOT_CARRIED = (WEIGHT_PRECISION_KEY, ACTIVATION_PRECISION_KEY, EXACT_RECIPROCALS_KEY)
_BITS_HEX = re.compile(r"0x[0-9a-f]{8}")


@dataclass(frozen=True)
class _Names:
    """Suffixes after ``<prefix>`` for one layout, and which scalars are stored as reciprocals."""

    layout: Layout
    payload: str
    scale: str
    global_scale: str
    input_scale: str
    global_is_reciprocal: bool  # stored = 1/scale2
    input_is_reciprocal: bool  # stored = 1/input_scale_inv
    scalar_shape: tuple[int, ...]

    @property
    def parts(self) -> tuple[str, str, str, str]:
        return (self.payload, self.scale, self.global_scale, self.input_scale)


_MODELOPT = _Names("modelopt", ".weight", ".weight_scale", ".weight_scale_2", ".input_scale",
                   global_is_reciprocal=False, input_is_reciprocal=True, scalar_shape=())
_CT = _Names("compressed-tensors", ".weight_packed", ".weight_scale", ".weight_global_scale",
             ".input_global_scale", global_is_reciprocal=True, input_is_reciprocal=False,
             scalar_shape=(1,))
_NAMES: dict[str, _Names] = {"modelopt": _MODELOPT, "compressed-tensors": _CT}
# Tensor-name suffixes that belong to one layout only (``.weight_scale`` is shared, so it is none).
_MARKERS: dict[str, tuple[str, ...]] = {
    "companion": COMPANION_SUFFIXES,
    "modelopt": (".weight_scale_2", ".input_scale"),
    "compressed-tensors": (".weight_packed", ".weight_global_scale", ".input_global_scale"),
}


# --- float32 reciprocals ------------------------------------------------------------------------


def reciprocal_f32(value: np.float32) -> np.float32:
    """``1/value`` rounded once to float32 (ties to even), as torch and vLLM compute it."""
    with np.errstate(over="ignore", divide="ignore"):
        return np.float32(np.float32(1.0) / np.float32(value))


def f32_bits_hex(value: np.float32) -> str:
    """The float32's bit pattern as ``0x%08x`` (the form ``nvfp4_exact_reciprocals`` stores)."""
    return f"0x{int(np.array(value, dtype=np.float32).view(np.uint32)):08x}"


def _f32_from_bits_hex(text: str) -> np.float32:
    return np.float32(np.array(int(text, 16), dtype=np.uint32).view(np.float32))


def _positive_finite(value: np.float32) -> bool:
    return bool(np.isfinite(value) and value > 0)


# --- write --------------------------------------------------------------------------------------


def _require_layout(layout: str) -> Layout:
    for known in LAYOUTS:
        if layout == known:
            return known
    raise Refused(f"nvfp4 layout: {layout!r} is not one of {list(LAYOUTS)}")


def _prefix_of(name: str, layout: str) -> str:
    if not name.endswith(".weight") or name == ".weight":
        raise Refused(f"{name}: the {layout} layout stores a quantized weight as '<prefix>.weight'; "
                      "this name has no '.weight' suffix")
    return name[: -len(".weight")]


def _excluded_modules(checkpoint: Nvfp4Checkpoint) -> list[str]:
    """Modules a consumer must leave unquantized: every 2-D dense ``.weight`` and ``lm_head``
    (tied or F16) unless ``lm_head.weight`` itself is NVFP4."""
    modules = {name[: -len(".weight")] for name, array in checkpoint.dense_f16.items()
               if name.endswith(".weight") and np.ndim(array) == 2}
    if "lm_head.weight" not in checkpoint.nvfp4:
        modules.add("lm_head")
    return sorted(modules)


def _is_w4a4(nvfp4: Mapping[str, Nvfp4Tensor], where: str) -> bool:
    with_input = {t.input_scale_inv is not None for t in nvfp4.values()}
    if len(with_input) != 1:
        raise Refused(f"{where}: input_scale_inv must be on every NVFP4 tensor or on none")
    return with_input == {True}


def _layout_entries(
    checkpoint: Nvfp4Checkpoint, names: _Names, where: str
) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """The safetensors entries of ``checkpoint`` in a modelopt/compressed-tensors layout, and the
    exact values of reciprocal-stored scalars whose reciprocal does not round-trip."""
    if not checkpoint.nvfp4:
        raise Refused(f"{where}: an NVFP4 checkpoint needs at least one NVFP4 tensor")
    _is_w4a4(checkpoint.nvfp4, where)
    entries: dict[str, StoredTensor] = {}
    exact: dict[str, str] = {}

    def put(name: str, stored: StoredTensor) -> None:
        if name in entries:
            raise Refused(f"{name}: two tensors would share this name in the {names.layout} layout")
        entries[name] = stored

    def put_scalar(name: str, value: np.float32, reciprocal: bool) -> None:
        stored = value
        if reciprocal:
            stored = reciprocal_f32(value)
            if not _positive_finite(stored):
                raise Refused(f"{name}: 1/{float(value)!r} is not a finite positive float32; the "
                              f"{names.layout} layout stores this scale as a reciprocal")
            if reciprocal_f32(stored) != value:
                exact[name] = f32_bits_hex(value)
        put(name, StoredTensor("F32", np.full(names.scalar_shape, stored, dtype=np.float32)))

    for name in sorted(checkpoint.nvfp4):
        tensor = checkpoint.nvfp4[name]
        validate_nvfp4_tensor(tensor)
        prefix = _prefix_of(name, names.layout)
        put(prefix + names.payload, StoredTensor("U8", tensor.packed))
        put(prefix + names.scale, StoredTensor("F8_E4M3", tensor.scale_bytes))  # row-contiguous
        put_scalar(prefix + names.global_scale, tensor.scale2, names.global_is_reciprocal)
        if tensor.input_scale_inv is not None:
            put_scalar(prefix + names.input_scale, tensor.input_scale_inv, names.input_is_reciprocal)
    reserved = tuple(s for s in names.parts if s != ".weight") + tuple(
        s for markers in _MARKERS.values() for s in markers)
    for name in sorted(checkpoint.dense_f16):
        array = np.asarray(checkpoint.dense_f16[name])
        if name in checkpoint.nvfp4 or name in entries:
            raise Refused(f"{name}: both an NVFP4 and a dense tensor in the {names.layout} layout")
        if name.endswith(reserved):
            suffix = next(s for s in reserved if name.endswith(s))
            raise Refused(f"{name}: a dense tensor ending in {suffix!r} would read back as an NVFP4 "
                          f"part in the {names.layout} layout")
        if array.dtype != np.float16:
            raise Refused(f"{name}: dense tensors must be float16, got {array.dtype}")
        put(name, StoredTensor("F16", array))
    return entries, exact


def _modelopt_section(w4a4: bool, excluded: list[str]) -> dict[str, Any]:
    return {"quant_algo": MODELOPT_W4A4_ALGO if w4a4 else MODELOPT_W4A16_ALGO,
            "kv_cache_quant_algo": None, "group_size": BLOCK_SIZE, "exclude_modules": excluded}


def _ct_section(w4a4: bool, excluded: list[str]) -> dict[str, Any]:
    weights = {**_CT_ARGS, "symmetric": True, "dynamic": False}
    # "local": the global activation scale is static (input_global_scale), block scales dynamic.
    inputs = {**_CT_ARGS, "symmetric": True, "dynamic": "local"} if w4a4 else None
    group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
             "output_activations": None, "format": CT_FORMAT}
    return {"quant_method": CT_QUANT_METHOD, "format": CT_FORMAT, "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": excluded, "kv_cache_scheme": None}


def _write_json(path: Path, document: Mapping[str, Any]) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    partial.replace(path)


def _read_json_object(path: Path) -> dict[str, Any]:
    document = read_strict_json(path, "checkpoint config")
    if not isinstance(document, dict):
        raise Refused(f"{path}: expected a JSON object, got {type(document).__name__}")
    return document


def _refuse_conflicting_configs(directory: Path, layout: Layout) -> None:
    """Refuse to leave a directory whose quantization configs name another layout."""
    config_path, hf_path = directory / CONFIG_FILE, directory / HF_QUANT_CONFIG_FILE
    has_section = config_path.is_file() and QUANTIZATION_CONFIG_KEY in _read_json_object(config_path)
    if layout == "companion" and has_section:
        raise Refused(f"{config_path}: has a {QUANTIZATION_CONFIG_KEY}; a companion checkpoint "
                      "beside it would be ambiguous")
    if layout != "modelopt" and hf_path.exists():
        raise Refused(f"{hf_path}: exists; a {layout} checkpoint beside it would be ambiguous")


def write_checkpoint(checkpoint: Nvfp4Checkpoint, directory: str | Path, layout: str) -> Path:
    """Write ``checkpoint`` as ``directory/model.safetensors`` in ``layout``, with that layout's
    quantization config (merged into an existing config.json); returns the safetensors path."""
    chosen = _require_layout(layout)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / SAFETENSORS_FILE
    _refuse_conflicting_configs(directory, chosen)
    carried = {k: v for k, v in checkpoint.metadata.items() if k != EXACT_RECIPROCALS_KEY}
    if chosen == "companion":
        write_nvfp4_checkpoint(path, checkpoint.nvfp4, checkpoint.dense_f16, carried)
        return path
    names = _NAMES[chosen]
    entries, exact = _layout_entries(checkpoint, names, str(path))
    metadata = {"format": "pt", **{k: v for k, v in carried.items() if k not in _METADATA_NOT_CARRIED}}
    if exact:
        metadata[EXACT_RECIPROCALS_KEY] = json.dumps(exact, sort_keys=True, separators=(",", ":"))
    w4a4, excluded = _is_w4a4(checkpoint.nvfp4, str(path)), _excluded_modules(checkpoint)
    write_safetensors(path, entries, metadata)
    config_path = directory / CONFIG_FILE
    config = _read_json_object(config_path) if config_path.is_file() else {}
    if chosen == "modelopt":
        section = _modelopt_section(w4a4, excluded)
        _write_json(directory / HF_QUANT_CONFIG_FILE, {"producer": PRODUCER, "quantization": section})
        # Older ModelOpt exports name the list exclude_modules; vLLM's flat reader reads ignore.
        config[QUANTIZATION_CONFIG_KEY] = {"quant_method": MODELOPT_QUANT_METHOD, **section,
                                           "ignore": excluded}
    else:
        config[QUANTIZATION_CONFIG_KEY] = _ct_section(w4a4, excluded)
    _write_json(config_path, config)
    return path


# --- open and detect ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Source:
    """One checkpoint on disk: its safetensors entries and metadata and its quantization configs."""

    path: Path
    directory: Path
    tensors: dict[str, StoredTensor]
    metadata: dict[str, str]
    config_section: dict[str, Any] | None  # config.json quantization_config
    hf_quant_config: dict[str, Any] | None  # hf_quant_config.json

    @property
    def config_where(self) -> str:
        return f"{self.directory / CONFIG_FILE} {QUANTIZATION_CONFIG_KEY}"


def _open(path_or_dir: str | Path) -> _Source:
    path = Path(path_or_dir)
    if path.is_dir():
        directory, path = path, path / SAFETENSORS_FILE
        if not path.is_file():
            raise Refused(f"{directory}: no {SAFETENSORS_FILE} (expected a single-file safetensors "
                          "checkpoint)")
    elif path.is_file():
        directory = path.parent
    else:
        raise Refused(f"{path}: no such checkpoint file or directory")
    tensors, metadata = read_safetensors(path)
    section: dict[str, Any] | None = None
    config_path = directory / CONFIG_FILE
    if config_path.is_file():
        config = _read_json_object(config_path)
        if QUANTIZATION_CONFIG_KEY in config:
            if not isinstance(config[QUANTIZATION_CONFIG_KEY], dict):
                raise Refused(f"{config_path}: {QUANTIZATION_CONFIG_KEY} must be a JSON object")
            section = config[QUANTIZATION_CONFIG_KEY]
    hf_path = directory / HF_QUANT_CONFIG_FILE
    hf_quant_config = _read_json_object(hf_path) if hf_path.exists() else None
    return _Source(path, directory, tensors, metadata, section, hf_quant_config)


def _layout_evidence(source: _Source) -> dict[str, str]:
    """Each layout that something in the checkpoint points at, with the first such thing."""
    evidence: dict[str, str] = {}
    for layout, suffixes in _MARKERS.items():
        hits = sorted(name for name in source.tensors if name.endswith(suffixes))
        if hits:
            evidence[layout] = f"tensor {hits[0]}"
    precision_keys = sorted(k for k in (WEIGHT_PRECISION_KEY, ACTIVATION_PRECISION_KEY)
                            if k in source.metadata)
    if precision_keys:
        evidence.setdefault("companion", f"metadata {precision_keys[0]}")
    if source.config_section is not None:
        method = source.config_section.get("quant_method")
        by_method = {MODELOPT_QUANT_METHOD: "modelopt", CT_QUANT_METHOD: "compressed-tensors"}
        if not isinstance(method, str) or method not in by_method:
            raise Refused(f"{source.config_where}: quant_method {method!r} is not an NVFP4 layout "
                          f"(expected {MODELOPT_QUANT_METHOD!r} or {CT_QUANT_METHOD!r})")
        evidence.setdefault(by_method[method], f"{CONFIG_FILE} quant_method {method!r}")
    if source.hf_quant_config is not None:
        evidence.setdefault("modelopt", HF_QUANT_CONFIG_FILE)
    return evidence


def _detect(source: _Source) -> Layout:
    evidence = _layout_evidence(source)
    if not evidence:
        raise Refused(f"{source.path}: no NVFP4 layout recognized (expected companion '*.nvfp4_scale', "
                      "modelopt '*.weight_scale_2' or compressed-tensors '*.weight_packed' tensors)")
    if len(evidence) > 1:
        found = ", ".join(f"{layout} ({why})" for layout, why in sorted(evidence.items()))
        raise Refused(f"{source.path}: ambiguous NVFP4 layout: {found}")
    layout = _require_layout(next(iter(evidence)))
    if layout == "companion":
        return layout
    names = _NAMES[layout]
    parts = tuple(s for s in names.parts if s != ".weight")
    if not any(name.endswith(parts) for name in source.tensors):
        raise Refused(f"{source.path}: {evidence[layout]} names {layout} but no tensor ends in "
                      f"{' / '.join(parts)}")
    if source.config_section is None and (layout != "modelopt" or source.hf_quant_config is None):
        also = f" or {source.directory / HF_QUANT_CONFIG_FILE}" if layout == "modelopt" else ""
        raise Refused(f"{source.path}: {layout} tensors but no quantization config (expected "
                      f"{source.config_where}{also})")
    _layout_config(source, layout)
    return layout


def detect_layout(path_or_dir: str | Path) -> str:
    """Which of ``LAYOUTS`` a checkpoint file or directory is in, from its tensor names, metadata
    and quantization configs; refuses (one line) anything ambiguous, unknown or inconsistent."""
    return _detect(_open(path_or_dir))


# --- quantization configs -----------------------------------------------------------------------


@dataclass(frozen=True)
class _LayoutConfig:
    """What a layout's quantization config declares: W4A4 or not, and the excluded modules."""

    w4a4: bool
    excluded: tuple[str, ...]
    declared_by: str


def _str_list(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise Refused(f"{where}: expected a list of module names")
    return tuple(value)


def _expect(section: Mapping[str, Any], key: str, expected: object, where: str) -> None:
    if key not in section or section[key] != expected or type(section[key]) is not type(expected):
        got = repr(section[key]) if key in section else "missing"
        raise Refused(f"{where}: {key} {got}, expected {expected!r}")


def _modelopt_algo(section: Mapping[str, Any], where: str, required: Iterable[str]) -> str:
    for key in required:
        if key not in section:
            raise Refused(f"{where}: {key} missing")
    algo = section.get("quant_algo")
    if not isinstance(algo, str) or algo.upper() not in (MODELOPT_W4A4_ALGO, MODELOPT_W4A16_ALGO):
        raise Refused(f"{where}: quant_algo {algo!r}, expected {MODELOPT_W4A4_ALGO!r} (W4A4) or "
                      f"{MODELOPT_W4A16_ALGO!r}")
    if "group_size" in section:
        _expect(section, "group_size", BLOCK_SIZE, where)
    if section.get("kv_cache_quant_algo") is not None:
        raise Refused(f"{where}: kv_cache_quant_algo {section['kv_cache_quant_algo']!r}, expected "
                      "null (KV-cache quantization is not part of this weight format)")
    return algo.upper()


def _modelopt_config(source: _Source) -> _LayoutConfig:
    algos: dict[str, str] = {}
    excluded: list[str] = []
    if source.hf_quant_config is not None:
        where = str(source.directory / HF_QUANT_CONFIG_FILE)
        quantization = source.hf_quant_config.get("quantization")
        if not isinstance(quantization, dict):
            raise Refused(f"{where}: quantization must be a JSON object")
        required = ("group_size", "kv_cache_quant_algo", "exclude_modules")
        algos[where] = _modelopt_algo(quantization, f"{where} quantization", required)
        excluded += _str_list(quantization["exclude_modules"], f"{where} quantization.exclude_modules")
    if source.config_section is not None:
        where = source.config_where
        algos[where] = _modelopt_algo(source.config_section, where, ("quant_algo",))
        for key in ("exclude_modules", "ignore"):
            if key in source.config_section:
                excluded += _str_list(source.config_section[key], f"{where}.{key}")
    if not algos:
        raise Refused(f"{source.path}: modelopt tensors but no quantization config (expected "
                      f"{source.config_where} or {source.directory / HF_QUANT_CONFIG_FILE})")
    if len(set(algos.values())) != 1:
        found = ", ".join(f"{where}: {algo!r}" for where, algo in algos.items())
        raise Refused(f"{source.path}: quant_algo disagrees between configs ({found})")
    where, algo = next(iter(algos.items()))
    return _LayoutConfig(algo == MODELOPT_W4A4_ALGO, tuple(excluded), f"{where} quant_algo {algo!r}")


def _ct_args(args: object, where: str) -> None:
    if not isinstance(args, dict):
        raise Refused(f"{where}: expected a JSON object of quantization arguments")
    for key, expected in _CT_ARGS.items():
        _expect(args, key, expected, where)
    if args.get("symmetric", True) is not True:
        raise Refused(f"{where}: symmetric {args['symmetric']!r}, expected true")


def _ct_config(source: _Source) -> _LayoutConfig:
    section, where = source.config_section, source.config_where
    if section is None:
        raise Refused(f"{source.path}: compressed-tensors tensors but no {where}")
    _expect(section, "format", CT_FORMAT, where)
    if section.get("quantization_status", "compressed") != "compressed":
        raise Refused(f"{where}: quantization_status {section['quantization_status']!r}, "
                      "expected 'compressed'")
    if section.get("kv_cache_scheme") is not None:
        raise Refused(f"{where}: kv_cache_scheme is set, expected null (KV-cache quantization is "
                      "not part of this weight format)")
    groups = section.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise Refused(f"{where}: config_groups must be a non-empty JSON object")
    w4a4: set[bool] = set()
    for group_name in sorted(groups):
        group, group_where = groups[group_name], f"{where}.config_groups.{group_name}"
        if not isinstance(group, dict):
            raise Refused(f"{group_where}: expected a JSON object")
        if group.get("format", CT_FORMAT) != CT_FORMAT:
            raise Refused(f"{group_where}: format {group['format']!r}, expected {CT_FORMAT!r}")
        _ct_args(group.get("weights"), f"{group_where}.weights")
        inputs = group.get("input_activations")
        if inputs is not None:
            _ct_args(inputs, f"{group_where}.input_activations")
        w4a4.add(inputs is not None)
    if len(w4a4) != 1:
        raise Refused(f"{where}: config_groups mix W4A4 and weight-only NVFP4")
    excluded = _str_list(section.get("ignore", []), f"{where}.ignore")
    declared = "W4A4 input_activations" if w4a4 == {True} else "input_activations null"
    return _LayoutConfig(w4a4 == {True}, excluded, f"{where} {declared}")


def _layout_config(source: _Source, layout: Layout) -> _LayoutConfig:
    return _modelopt_config(source) if layout == "modelopt" else _ct_config(source)


def _excludes(prefix: str, pattern: str, layout: str, where: str) -> bool:
    """Whether a config's exclusion entry names ``prefix`` the way that layout's consumer reads it:
    ModelOpt wildcards (fnmatch); compressed-tensors exact names or ``re:`` regexes."""
    if layout == "modelopt":
        return fnmatchcase(prefix, pattern)
    if pattern.startswith("re:"):
        try:
            return re.match(pattern[3:], prefix) is not None
        except re.error as exc:
            raise Refused(one_line(f"{where}: ignore entry {pattern!r} is not a regex ({exc})")) from None
    return prefix == pattern


# --- load ---------------------------------------------------------------------------------------


def _exact_reciprocals(source: _Source, names: _Names) -> dict[str, np.float32]:
    """The writer's exact values for reciprocal-stored scalars, from the safetensors metadata."""
    text = source.metadata.get(EXACT_RECIPROCALS_KEY)
    if text is None:
        return {}
    where = f"{source.path}: metadata {EXACT_RECIPROCALS_KEY}"
    try:
        table = json.loads(text)
    except (TypeError, ValueError):
        table = None
    if not isinstance(table, dict) or not all(
        isinstance(v, str) and _BITS_HEX.fullmatch(v) for v in table.values()
    ):
        raise Refused(f"{where}: expected a JSON object of tensor name -> '0x%08x' float32 bits")
    reciprocal_suffixes = tuple(s for s, reciprocal in (
        (names.global_scale, names.global_is_reciprocal), (names.input_scale, names.input_is_reciprocal),
    ) if reciprocal)
    exact: dict[str, np.float32] = {}
    for name, bits in sorted(table.items()):
        if name not in source.tensors or not name.endswith(reciprocal_suffixes):
            raise Refused(f"{where}: {name!r} is not a reciprocal-stored {names.layout} scale tensor "
                          "in this file")
        exact[name] = _f32_from_bits_hex(bits)
        if not _positive_finite(exact[name]):
            raise Refused(f"{where}: {name!r}: {bits} is not a finite positive float32")
    return exact


def _read_scalar(source: _Source, name: str, reciprocal: bool, exact: Mapping[str, np.float32]) -> np.float32:
    """One per-tensor scale as the in-memory model holds it (un-reciprocated where stored so)."""
    if name not in source.tensors:
        raise Refused(f"{source.path}: tensor {name}: missing")
    stored = source.tensors[name]
    if stored.dtype != "F32" or stored.array.shape not in ((), (1,)):
        raise Refused(f"{source.path}: tensor {name}: must be an F32 scalar (shape [] or [1]), "
                      f"got {stored.dtype} {list(stored.array.shape)}")
    value = np.float32(stored.array.reshape(())[()])
    if not _positive_finite(value):
        raise Refused(f"{source.path}: tensor {name}: must be finite and positive, got {float(value)!r}")
    if not reciprocal:
        return value
    if name in exact:
        if reciprocal_f32(exact[name]) != value:
            raise Refused(f"{source.path}: metadata {EXACT_RECIPROCALS_KEY}: {name!r}: 1/"
                          f"{float(exact[name])!r} rounds to {float(reciprocal_f32(exact[name]))!r}, "
                          f"not the stored {float(value)!r}")
        return exact[name]
    derived = reciprocal_f32(value)
    if not _positive_finite(derived):
        raise Refused(f"{source.path}: tensor {name}: 1/{float(value)!r} is not a finite positive float32")
    return derived


def _load_one(source: _Source, names: _Names, prefix: str, exact: Mapping[str, np.float32]) -> Nvfp4Tensor:
    """Validate one weight's payload and parts, in order: payload, scale, global, input."""
    path, tensors = source.path, source.tensors
    payload_name, scale_name = prefix + names.payload, prefix + names.scale
    if payload_name not in tensors:
        raise Refused(f"{path}: tensor {payload_name}: missing NVFP4 payload for its companions")
    payload = tensors[payload_name]
    shape = payload.array.shape
    if payload.dtype != "U8" or len(shape) != 2 or min(shape) < 1 or shape[1] % (BLOCK_SIZE // 2):
        raise Refused(f"{path}: tensor {payload_name}: payload must be U8 [n_out, n_in/2] with "
                      f"n_in % 16 == 0, got {payload.dtype} {list(shape)}")
    n_out, n_in = shape[0], shape[1] * 2
    if scale_name not in tensors:
        raise Refused(f"{path}: tensor {scale_name}: missing")
    scale = tensors[scale_name]
    if scale.dtype != "F8_E4M3":
        raise Refused(f"{path}: tensor {scale_name}: dtype {scale.dtype}, expected F8_E4M3")
    if scale.array.shape != (n_out, n_in // BLOCK_SIZE):
        raise Refused(f"{path}: tensor {scale_name}: shape {list(scale.array.shape)}, "
                      f"expected {[n_out, n_in // BLOCK_SIZE]}")
    e4m3fn_decode(scale.array, f"{path}: tensor {scale_name}")  # refuses NaN bytes 0x7f/0xff
    scale2 = _read_scalar(source, prefix + names.global_scale, names.global_is_reciprocal, exact)
    input_name = prefix + names.input_scale
    input_scale_inv = (_read_scalar(source, input_name, names.input_is_reciprocal, exact)
                       if input_name in tensors else None)
    tensor = Nvfp4Tensor(np.ascontiguousarray(payload.array), np.ascontiguousarray(scale.array),
                         scale2, input_scale_inv, prefix + ".weight")
    validate_nvfp4_tensor(tensor)
    return tensor


def _quantized_prefixes(tensors: Mapping[str, StoredTensor], names: _Names) -> list[str]:
    """Prefixes with any NVFP4 part: a scale, global or input tensor, or a payload (modelopt's
    ``.weight`` counts only when U8, since dense weights share that name)."""
    prefixes: set[str] = set()
    for name, stored in tensors.items():
        for suffix in names.parts:
            if name.endswith(suffix) and (suffix != ".weight" or stored.dtype == "U8"):
                prefixes.add(name[: -len(suffix)])
    return sorted(prefixes)


def _load_layout(source: _Source, layout: Layout) -> Nvfp4Checkpoint:
    names, path = _NAMES[layout], source.path
    config = _layout_config(source, layout)
    exact = _exact_reciprocals(source, names)
    prefixes = _quantized_prefixes(source.tensors, names)
    if not prefixes:
        raise Refused(f"{path}: no {layout} NVFP4 tensors")
    nvfp4 = {prefix + ".weight": _load_one(source, names, prefix, exact) for prefix in prefixes}
    with_input = [p for p in prefixes if nvfp4[p + ".weight"].input_scale_inv is not None]
    without_input = [p for p in prefixes if nvfp4[p + ".weight"].input_scale_inv is None]
    if with_input and without_input:
        raise Refused(f"{path}: tensor {without_input[0]}{names.input_scale}: missing but "
                      f"{with_input[0]}{names.input_scale} is present (mixed W4A4/W4A16)")
    if bool(with_input) != config.w4a4:
        state = "present" if with_input else "missing"
        raise Refused(f"{path}: tensor {prefixes[0]}{names.input_scale}: {state} but "
                      f"{config.declared_by}")
    for prefix in prefixes:
        for pattern in config.excluded:
            if _excludes(prefix, pattern, layout, source.config_where):
                raise Refused(f"{path}: tensor {prefix}{names.payload}: NVFP4, but the quantization "
                              f"config excludes module {prefix!r} ({pattern!r})")
    owned = {prefix + suffix for prefix in prefixes for suffix in names.parts}
    dense_f16: dict[str, np.ndarray] = {}
    for name in sorted(source.tensors):
        stored = source.tensors[name]
        if name in owned:
            continue
        if stored.dtype != "F16":
            raise Refused(f"{path}: tensor {name}: dtype {stored.dtype}, expected F16 for unquantized "
                          "tensors")
        if name in nvfp4:
            raise Refused(f"{path}: tensor {name}: both a dense tensor and the name of the NVFP4 weight "
                          f"{name[: -len('.weight')]}{names.payload}")
        dense_f16[name] = stored.array
    metadata = {k: v for k, v in source.metadata.items() if k != EXACT_RECIPROCALS_KEY}
    metadata[WEIGHT_PRECISION_KEY] = WEIGHT_PRECISION_NVFP4
    metadata[ACTIVATION_PRECISION_KEY] = "nvfp4" if with_input else "a16"
    return Nvfp4Checkpoint(nvfp4, dense_f16, metadata, path)


def load_checkpoint(path_or_dir: str | Path) -> Nvfp4Checkpoint:
    """Load and validate a checkpoint in any of ``LAYOUTS`` (detected, fail closed) into the one
    in-memory model, so every layout of the same weights dequantizes bit-identically."""
    source = _open(path_or_dir)
    layout = _detect(source)
    if layout == "companion":
        return load_nvfp4_checkpoint(source.path)
    return _load_layout(source, layout)

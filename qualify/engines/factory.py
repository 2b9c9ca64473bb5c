"""Builds the producer and consumer engines of a lane, and names the files each depends on.

Every engine built here is a :class:`~qualify.engines.base.LaneEngine`: the engine plus its
``mode``, ``digests`` (asset name such as ``model/config.json`` -> SHA-256 of each checkpoint file it read) and
``target_cache_identity_sha256`` derived from the lane's kind, its mode, its variant, those digests
and the engine ABI, so a KV entry made in one mode can never be installed where the other is
expected.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal

from qualify.contract.lanes import (
    KQUANT_EXACT_LANE,
    LANES,
    TORCH_LLAMA_MODELS,
    TRANSFORMERS_LANE_SETTINGS,
    VLLM_BLOCK_SIZE,
    EngineChoice,
    LaneKind,
    LaneSpec,
    NativeVariant,
    ProducerMode,
    lane_spec,
    target_cache_identity,
)
from qualify.core import assets, model_choice
from qualify.core.digests import sha256_file
from qualify.core.errors import Refused
from qualify.engines.base import Engine, LaneEngine, ModelGeometry

if TYPE_CHECKING:
    from qualify.engines.nvfp4_linear import Arithmetic
    from qualify.engines.reference import Materialize

TORCH_LLAMA_CACHE_POSITIONS = 2048 + 256

NVFP4_DIR = assets.MODEL_DIR / "nvfp4"
"""The shipped NVFP4 checkpoint, in NVIDIA ModelOpt's layout (``tools/make_nvfp4.py``)."""
NVFP4_FILES = ("config.json", "hf_quant_config.json", "model.safetensors")

Role = Literal["producer", "consumer"]

def checkpoint_files(kind: LaneKind) -> tuple[Path, ...]:
    """The checkpoint files a lane kind's engines read (what the identity pins)."""
    if kind is LaneKind.NVFP4:
        return (assets.MODEL_DIR / "config.json", assets.MODEL_DIR / "model.safetensors",
                *(NVFP4_DIR / name for name in NVFP4_FILES))
    if kind is LaneKind.KQUANT:
        from qualify.engines import speculative

        return (assets.MODEL_DIR / "config.json", *speculative.checkpoint_paths())
    if kind in (LaneKind.VLLM, LaneKind.TRANSFORMERS):
        # vLLM, transformers and the reference engine all read exactly these (raw token ids).
        return (assets.MODEL_DIR / "config.json", assets.MODEL_DIR / "model.safetensors")
    if kind is LaneKind.TORCH_LLAMA:
        # The random-weight model files (shape, dtype, seed): the weights are drawn from them.
        return tuple(assets.asset_path(relpath) for relpath in TORCH_LLAMA_MODELS.values())
    raise Refused(f"lane kind {kind.value}: no engine in this harness builds it")


CHOSEN_MODEL_KINDS = (LaneKind.NVFP4, LaneKind.KQUANT, LaneKind.VLLM)
"""The lane kinds a ``--model`` runs: their engines derive their weights from the model's floats
(NVFP4 and Q8_0 quantized in process; vLLM from a float32 Hugging Face directory written from
them). A k-quant lane with a draft still runs only the shipped model (its draft is the shipped
target's)."""


def _require_chosen_model_kind(kind: LaneKind) -> None:
    if kind not in CHOSEN_MODEL_KINDS:
        choice = model_choice.chosen()
        *others, last = (k.value for k in CHOSEN_MODEL_KINDS)
        raise Refused(f"--model {choice.name if choice else ''}: lane kind {kind.value} runs only the shipped "
                      f"model; expected a lane of kind {', '.join(others)} or {last}")


def chosen_checkpoint(kind: LaneKind) -> tuple[dict[str, str], int]:
    """The chosen model's checkpoint map for a lane kind (``models/<name>/<file>`` -> SHA-256, plus
    the digest of the quantized weights the kind derives in process) and its total bytes."""
    from qualify.engines import chosen_model

    choice = chosen_model.require_choice()
    _require_chosen_model_kind(kind)
    digests, total = dict(choice.files), sum(choice.file_sizes.values())
    derived = {LaneKind.NVFP4: (chosen_model.NVFP4_DERIVED, chosen_model.nvfp4_checkpoint_sha256),
               LaneKind.KQUANT: (chosen_model.Q8_0_DERIVED, chosen_model.q8_0_weights_sha256),
               LaneKind.VLLM: (chosen_model.HF_FLOAT32_DERIVED, chosen_model.hf_float32_sha256)}
    derived_key, derived_digest = derived[kind]
    derived_sha256, derived_bytes = derived_digest()
    digests[model_choice.file_key(choice.name, derived_key)] = derived_sha256
    return dict(sorted(digests.items())), total + derived_bytes


def require_checkpoint_files(kind: LaneKind) -> None:
    """Refuse (:class:`~qualify.core.assets.AssetMissing`, naming the file) before any engine of the
    lane kind opens its checkpoint, when one of its files is missing: the harness cannot run.
    A chosen ``--model`` was loaded whole when it was chosen; only its lane kind is checked."""
    if model_choice.chosen() is not None:
        _require_chosen_model_kind(kind)
        return
    for path in checkpoint_files(kind):
        assets.require_asset(assets.asset_relpath(path))


@cache
def _digest(path: Path) -> str:
    return sha256_file(path)


def checkpoint_digests(kind: LaneKind) -> dict[str, str]:
    """Asset name (``model/config.json``, as identities pin it) -> SHA-256 of every checkpoint file
    the lane kind reads; a missing one is a broken install (:class:`~qualify.core.assets.AssetMissing`).
    Under a chosen ``--model``: its files and derived weights (:func:`chosen_checkpoint`)."""
    if model_choice.chosen() is not None:
        return chosen_checkpoint(kind)[0]
    digests = {}
    for path in checkpoint_files(kind):
        relpath = assets.asset_relpath(path)
        digests[relpath] = _digest(assets.require_asset(relpath))
    return digests


def _nvfp4_arithmetic(spec: LaneSpec, mode: ProducerMode) -> Arithmetic:
    """The NVFP4 contraction an engine of ``spec`` built in ``mode`` runs: the consumer and the
    exact anchor decode with the integer-exact a16-q8 contraction, a native producer with its variant."""
    if mode is ProducerMode.EXACT:
        return "exact"
    match spec.variant:
        case NativeVariant.SPLITK:
            return "splitk"
        case NativeVariant.F16:
            return "f16"
        case NativeVariant.W4A4:
            return "w4a4"
        case None:
            raise Refused(f"lane {spec.name}: native mode needs a variant")


def _nvfp4_materialize(arithmetic: Arithmetic) -> Materialize:
    """An NVFP4 engine's intermediates: float16 round trips for ``f16``, else float32."""
    from qualify.engines.reference import KeepFloat32, RoundTripFloat16

    return RoundTripFloat16() if arithmetic == "f16" else KeepFloat32()


def _nvfp4_abi(arithmetic: Arithmetic) -> str:
    """``_nvfp4_engine(arithmetic).abi`` without building it: no checkpoint loaded and no weight
    image made (seconds of the identity step on a real model). Every projection of the engine
    is of that arithmetic (the factory makes no other), so its kind and the materialize hook's
    name the abi, as :class:`~qualify.engines.reference.ReferenceEngine` composes it."""
    from qualify.engines.nvfp4_linear import nvfp4_linear_kind
    from qualify.engines.reference import arithmetic_kind, engine_abi

    return engine_abi({nvfp4_linear_kind(arithmetic)}, arithmetic_kind(_nvfp4_materialize(arithmetic), "materialize"))


def _nvfp4_engine(arithmetic: Arithmetic) -> Engine:
    from qualify.engines.nvfp4_layouts import load_checkpoint
    from qualify.engines.nvfp4_linear import make_nvfp4_linear_factory
    from qualify.engines.reference import ReferenceEngine

    materialize = _nvfp4_materialize(arithmetic)
    if model_choice.chosen() is not None:
        from qualify.engines import chosen_model

        return chosen_model.reference_engine(
            make_nvfp4_linear_factory(chosen_model.nvfp4_checkpoint(), arithmetic), materialize)
    return ReferenceEngine.from_model_dir(
        assets.MODEL_DIR,
        make_linear=make_nvfp4_linear_factory(load_checkpoint(NVFP4_DIR), arithmetic),
        materialize=materialize,
    )


def _kquant_engine(spec: LaneSpec, mode: ProducerMode) -> Engine:
    """A k-quant lane's engine: the speculative target-plus-draft engine on a lane with a draft
    (the shipped model only), else the plain Q8_0 target (a chosen model's derived in process)."""
    if spec.speculative_draft:
        if model_choice.chosen() is not None:
            raise Refused(f"lane {spec.name}: its draft was trained for the shipped target only; "
                          f"--model runs the draftless lane {KQUANT_EXACT_LANE}")
        from qualify.engines import speculative

        return speculative.build_engine(mode)
    if model_choice.chosen() is not None:
        from qualify.engines import chosen_model

        return chosen_model.q8_0_engine(mode)
    from qualify.engines.kquant import build_kquant_engine

    return build_kquant_engine(mode)


def _vllm_lane_engine(spec: LaneSpec, role: Role, vllm_fault: str | None = None) -> Engine:
    """One side of a ``vllm`` lane: vLLM through the project connector, or the float32 reference."""
    producer, consumer = spec.engines
    chosen = model_choice.chosen() is not None
    if (producer if role == "producer" else consumer) is EngineChoice.VLLM:
        from qualify.engines.chosen_model import hf_float32_dir
        from qualify.engines.vllm_engine import VllmEngine

        return VllmEngine(role=role, fault=vllm_fault, model_dir=hf_float32_dir() if chosen else assets.MODEL_DIR)
    from qualify.engines.reference import ReferenceEngine

    if chosen:
        from qualify.engines.chosen_model import reference_engine

        return reference_engine()
    return ReferenceEngine.from_model_dir(assets.MODEL_DIR)


def _transformers_lane_engine(spec: LaneSpec, role: Role) -> Engine:
    """One side of a ``transformers`` lane: the GPU producer, or the float32 reference consumer."""
    from qualify.engines.reference import ReferenceEngine

    if role == "consumer":
        return ReferenceEngine.from_model_dir(assets.MODEL_DIR)
    from qualify.engines.transformers_engine import TransformersEngine

    settings = TRANSFORMERS_LANE_SETTINGS[spec.name]
    return TransformersEngine(assets.MODEL_DIR, device=settings.device, dtype=settings.dtype,
                              tf32=settings.tf32)


def lane_producer_abi(spec: LaneSpec) -> str:
    """The ABI a lane's producer engine reports on this host in its declared mode, without
    starting vLLM when it is vLLM or loading the model when it is transformers (that still needs
    the lane's GPU: the ABI names it)."""
    if spec.kind is LaneKind.TRANSFORMERS:
        from qualify.engines.transformers_engine import engine_abi

        settings = TRANSFORMERS_LANE_SETTINGS[spec.name]
        return engine_abi(settings.device, settings.dtype, settings.tf32)
    if spec.engines[0] is EngineChoice.VLLM:
        from qualify.engines.vllm_engine import vllm_engine_abi

        return vllm_engine_abi()
    if spec.kind is LaneKind.TORCH_LLAMA:
        import torch

        from qualify.engines.torch_llama import DTYPES, random_model
        from qualify.engines.torch_llama import engine_abi as torch_llama_abi

        # The producer runs without CUDA graphs (_build); no 8B-shaped engine is built to say so.
        _, _, dtype, device = random_model(assets.require_asset(TORCH_LLAMA_MODELS[spec.name]))
        return torch_llama_abi(torch.device(device), DTYPES[dtype], cuda_graph=False)
    if spec.kind is LaneKind.NVFP4:
        require_checkpoint_files(spec.kind)
        return _nvfp4_abi(_nvfp4_arithmetic(spec, spec.mode))
    if spec.kind is LaneKind.KQUANT and not spec.speculative_draft:
        # The draftless target's abi names its arithmetic alone: no GGUF read, no Q8_0 images
        # made (2.6 s of the identity step on the published model).
        from qualify.engines.kquant import kquant_abi

        require_checkpoint_files(spec.kind)
        return kquant_abi(spec.mode)
    return _build(spec, spec.mode).abi


def _build(spec: LaneSpec, mode: ProducerMode, role: Role = "producer",
           vllm_fault: str | None = None) -> Engine:
    require_checkpoint_files(spec.kind)
    if spec.kind is LaneKind.VLLM:
        if mode is not ProducerMode.NATIVE:
            raise Refused(f"lane {spec.name}: vLLM lanes run in native mode only, found {mode.value}")
        return _vllm_lane_engine(spec, role, vllm_fault)
    if spec.kind is LaneKind.TRANSFORMERS:
        if mode is not ProducerMode.NATIVE:
            raise Refused(f"lane {spec.name}: transformers lanes run in native mode only, found {mode.value}")
        return _transformers_lane_engine(spec, role)
    if spec.kind is LaneKind.NVFP4:
        return _nvfp4_engine(_nvfp4_arithmetic(spec, mode))
    if spec.kind is LaneKind.KQUANT:
        return _kquant_engine(spec, mode)
    if spec.kind is LaneKind.TORCH_LLAMA:
        from qualify.engines.torch_llama import TorchLlama, random_model_weights

        # One weight set per process: the in-process producer and the consumer share it; only
        # the consumer decodes, with CUDA graphs.
        weights = random_model_weights(assets.require_asset(TORCH_LLAMA_MODELS[spec.name]))
        # The cache holds the recipe's context (2048 prompt + 256 output): every decode step
        # attends over the whole static cache, so a larger one only slows the decode.
        return TorchLlama(weights, cache_positions=TORCH_LLAMA_CACHE_POSITIONS, cuda_graph=role == "consumer")
    raise Refused(f"lane kind {spec.kind.value}: no engine in this harness builds it")


def _lane_engine(engine: Engine, spec: LaneSpec, mode: ProducerMode, role: Role) -> LaneEngine:
    """``engine`` with its mode, checkpoint digests and the mode-separated target cache identity;
    a producer on a lane with vLLM on either side hands off whole blocks only."""
    digests = MappingProxyType(checkpoint_digests(spec.kind))
    whole_blocks = role == "producer" and EngineChoice.VLLM in spec.engines
    return LaneEngine(
        engine=engine, spec=spec, mode=mode, digests=digests,
        target_cache_identity_sha256=target_cache_identity(_mode_spec(spec, mode), digests, engine.abi),
        handoff_block_size=VLLM_BLOCK_SIZE if whole_blocks else None,
    )


def lane_engine_of(engine: Engine, spec: LaneSpec, role: Role) -> LaneEngine:
    """``engine`` as the lane ``spec``'s engine in its declared mode (an engine built elsewhere:
    the connector lane's facts of an engine that runs in its own process)."""
    return _lane_engine(engine, spec, spec.mode, role)


def _mode_spec(spec: LaneSpec, mode: ProducerMode) -> LaneSpec:
    """The lane whose cache identity an engine built in ``mode`` carries (its own mode's)."""
    if mode is spec.mode:
        return spec
    for other in LANES.values():
        if other.kind is spec.kind and other.mode is mode:
            return other
    raise Refused(f"lane {spec.name}: no lane of kind {spec.kind.value} runs in {mode.value} mode")


def producer_mode(mode: ProducerMode | str) -> ProducerMode:
    """``mode`` as a :class:`ProducerMode`; the text an operator or a process argument gives
    (``exact`` | ``native``) is converted, anything else refused."""
    try:
        return ProducerMode(mode)
    except ValueError:
        raise Refused(f"producer mode: found {mode!r}, expected exact or native") from None


def producer_engine(spec: LaneSpec, mode: ProducerMode, vllm_fault: str | None = None) -> LaneEngine:
    """The producer engine of the lane ``spec`` in ``mode``.

    A producer started in the other mode than its lane declares is built as that mode's lane
    (e.g. the exact anchor), so its handoffs carry that mode's cache identity and are refused.
    """
    return _lane_engine(_build(spec, mode, "producer", vllm_fault), spec, mode, "producer")


def build_producer(lane: str, mode: ProducerMode, vllm_fault: str | None = None) -> LaneEngine:
    """The producer process's default engine factory (``--engine-factory``, called with the
    process's ``--lane`` and ``--mode``): the lane named ``lane``, resolved here, in ``mode``
    (:func:`producer_engine`)."""
    # The handoff service still passes its --mode text here; producer_mode converts it.
    return producer_engine(lane_spec(lane), producer_mode(mode), vllm_fault)


def build_consumer(spec: LaneSpec, vllm_fault: str | None = None) -> LaneEngine:
    """The consumer engine for the lane ``spec``: the exact arithmetic of the lane's kind (for a
    ``vllm`` lane, the lane's consumer side: the float32 reference engine or vLLM; for a
    ``transformers`` lane, the float32 reference engine)."""
    if spec.kind in (LaneKind.VLLM, LaneKind.TRANSFORMERS, LaneKind.TORCH_LLAMA):
        # Both sides run their own float32 (or lower) arithmetic: there is no exact anchor.
        engine = _build(spec, spec.mode, "consumer", vllm_fault)
    else:
        engine = _build(spec, ProducerMode.EXACT)
    return _lane_engine(engine, spec, spec.mode, "consumer")


def lane_kv_dtype(spec: LaneSpec) -> str:
    """The dtype a lane's KV crosses in: a ``torch-llama`` lane's model dtype (its engine keeps
    its cache in it: bfloat16 halves the bytes to hash and move); float32 on every other lane."""
    if spec.kind is LaneKind.TORCH_LLAMA:
        from qualify.engines.torch_llama import random_model

        return random_model(assets.require_asset(TORCH_LLAMA_MODELS[spec.name]))[2]
    return "float32"


def build_cache_identity(spec: LaneSpec) -> str:
    """Derive a lane's cache identity from its producer engine's ABI and checkpoint digests."""
    return target_cache_identity(spec, checkpoint_digests(spec.kind), lane_producer_abi(spec))


def _chosen_geometry() -> ModelGeometry:
    from qualify.engines.chosen_model import loaded_model

    return loaded_model().geometry


@dataclass(frozen=True)
class ProducerFacts:
    """What a lane's producer pins in an identity or calibration contract."""

    name: str
    version: str
    abi: str
    geometry: ModelGeometry
    digests: Mapping[str, str]


def producer_facts(spec: LaneSpec) -> ProducerFacts:
    """Name, version, ABI, geometry and checkpoint digests of the lane ``spec``'s producer in its
    declared mode, without starting vLLM when the producer is vLLM (it runs in the producer process)."""
    if spec.engines[0] is EngineChoice.VLLM:
        from qualify.engines.checkpoint import load_config
        from qualify.engines.vllm_engine import VllmEngine, check_pin, vllm_engine_abi

        geometry = (load_config(assets.MODEL_DIR).geometry if model_choice.chosen() is None
                    else _chosen_geometry())
        return ProducerFacts(name=VllmEngine.name, version=check_pin(), abi=vllm_engine_abi(),
                             geometry=geometry,
                             digests=MappingProxyType(checkpoint_digests(spec.kind)))
    producer = producer_engine(spec, spec.mode)
    return ProducerFacts(name=producer.name, version=producer.version, abi=producer.abi,
                         geometry=producer.geometry, digests=producer.digests)

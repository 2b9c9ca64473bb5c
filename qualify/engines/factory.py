"""Builds the producer and consumer engines of a lane, and names the files each depends on.

Every engine built here carries ``producer_mode``, ``digests`` (repo-relative path -> SHA-256 of
each checkpoint file it read) and ``target_cache_identity_sha256`` derived from the lane's kind,
its mode, its variant, those digests and the engine ABI, so a KV entry made in one mode can never
be installed where the other is expected.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Literal

from qualify.contract.lanes import LaneKind, LaneSpec, ProducerMode, lane_spec, target_cache_identity
from qualify.core import assets
from qualify.core.digests import sha256_file
from qualify.core.errors import Refused
from qualify.engines.base import Engine

NVFP4_CHECKPOINT = assets.MODEL_DIR / "nvfp4" / "model.safetensors"

Role = Literal["producer", "consumer"]

ADAPTER_SOURCES: dict[LaneKind, tuple[str, str]] = {
    LaneKind.NVFP4: ("qualify-nvfp4-linear", "qualify/engines/nvfp4_linear.py"),
    LaneKind.KQUANT: ("qualify-kquant", "qualify/engines/kquant.py"),
    LaneKind.VLLM: ("qualify-vllm-connector", "qualify/engines/vllm_connector.py"),
    LaneKind.TRANSFORMERS: ("qualify-transformers-engine", "qualify/engines/transformers_engine.py"),
}
"""The producer adapter per lane kind: its name and the repo-relative source file whose SHA-256
an identity pins (the code that turns the lane's weights into its arithmetic)."""


def check_adapter(kind: LaneKind, name: str, sha256: str) -> None:
    """Refuse an identity whose pinned adapter is not this checkout's adapter source."""
    if kind not in ADAPTER_SOURCES:
        raise Refused(f"lane kind {kind.value}: no adapter source is known for it")
    expected_name, relpath = ADAPTER_SOURCES[kind]
    found = _digest(assets.REPO_ROOT / relpath)
    if name != expected_name or sha256 != found:
        raise Refused(f"adapter {name}: identity pins sha256 {sha256}, {relpath} ({expected_name}) "
                      f"is {found}; re-freeze the identity after a reviewed adapter change")


def checkpoint_files(kind: LaneKind) -> tuple[Path, ...]:
    """The checkpoint files a lane kind's engines read (what the identity pins)."""
    if kind is LaneKind.NVFP4:
        return (assets.MODEL_DIR / "config.json", assets.MODEL_DIR / "model.safetensors",
                NVFP4_CHECKPOINT)
    if kind is LaneKind.KQUANT:
        from qualify.engines import speculative

        return (assets.MODEL_DIR / "config.json", *speculative.checkpoint_paths())
    if kind in (LaneKind.VLLM, LaneKind.TRANSFORMERS):
        # vLLM, transformers and the reference engine all read exactly these (raw token ids).
        return (assets.MODEL_DIR / "config.json", assets.MODEL_DIR / "model.safetensors")
    raise Refused(f"lane kind {kind.value}: no engine in this harness builds it")


@cache
def _digest(path: Path) -> str:
    return sha256_file(path)


def checkpoint_digests(kind: LaneKind) -> dict[str, str]:
    """Repo-relative path -> SHA-256 of every checkpoint file the lane kind reads."""
    digests = {}
    for path in checkpoint_files(kind):
        if not path.is_file():
            raise Refused(f"checkpoint file {path.relative_to(assets.REPO_ROOT)}: missing")
        digests[str(path.relative_to(assets.REPO_ROOT))] = _digest(path)
    return digests


def _nvfp4_engine(arithmetic: str) -> Engine:
    from qualify.engines.nvfp4_linear import make_nvfp4_linear_factory
    from qualify.engines.reference import KeepFloat32, ReferenceEngine, RoundTripFloat16

    materialize = RoundTripFloat16() if arithmetic == "f16" else KeepFloat32()
    return ReferenceEngine.from_model_dir(
        assets.MODEL_DIR,
        make_linear=make_nvfp4_linear_factory(NVFP4_CHECKPOINT, arithmetic),
        materialize=materialize,
    )


def _vllm_lane_engine(spec: LaneSpec, role: Role, vllm_fault: str | None = None) -> Engine:
    """One side of a ``vllm`` lane: vLLM through the project connector, or the float32 reference."""
    from qualify.contract.lanes import VLLM_LANE_ENGINES

    producer, consumer = VLLM_LANE_ENGINES[spec.name]
    if (producer if role == "producer" else consumer) == "vllm":
        from qualify.engines.vllm_engine import VllmEngine

        return VllmEngine(role=role, fault=vllm_fault)
    from qualify.engines.reference import ReferenceEngine

    engine = ReferenceEngine.from_model_dir(assets.MODEL_DIR)
    if role == "producer":
        # vLLM installs whole blocks only: the reference producer hands off whole blocks too.
        from qualify.contract.lanes import VLLM_BLOCK_SIZE

        return WholeBlockProducer(engine, VLLM_BLOCK_SIZE)
    return engine


class WholeBlockProducer:
    """A producer that hands off only the whole blocks of its prefill (for a vLLM consumer)."""

    def __init__(self, engine: Engine, block_size: int) -> None:
        self._engine = engine
        self.handoff_block_size = block_size

    def __getattr__(self, attribute: str):
        return getattr(self._engine, attribute)

    def prefill(self, tokens):
        from qualify.core.kv import KVCache

        kv = self._engine.prefill(tokens)
        positions = (kv.geometry.positions // self.handoff_block_size) * self.handoff_block_size
        if positions == 0:
            raise Refused(f"prefill: {kv.geometry.positions} positions fill no whole block")
        trimmed = KVCache([k[:, :positions].copy() for k in kv.keys],
                          [v[:, :positions].copy() for v in kv.values])
        trimmed.meta.update(kv.meta)
        return trimmed


def _transformers_lane_engine(spec: LaneSpec, role: Role) -> Engine:
    """One side of a ``transformers`` lane: the GPU producer, or the float32 reference consumer."""
    from qualify.engines.reference import ReferenceEngine

    if role == "consumer":
        return ReferenceEngine.from_model_dir(assets.MODEL_DIR)
    from qualify.contract.lanes import TRANSFORMERS_LANE_SETTINGS
    from qualify.engines.transformers_engine import TransformersEngine

    settings = TRANSFORMERS_LANE_SETTINGS[spec.name]
    return TransformersEngine(assets.MODEL_DIR, device=settings.device, dtype=settings.dtype,
                              tf32=settings.tf32)


def _producer_abi(spec: LaneSpec) -> str:
    """The ABI a lane's producer engine reports, without starting vLLM when it is vLLM or loading
    the model when it is transformers (that still needs the lane's GPU: the ABI names it)."""
    if spec.kind is LaneKind.TRANSFORMERS:
        from qualify.contract.lanes import TRANSFORMERS_LANE_SETTINGS
        from qualify.engines.transformers_engine import engine_abi

        settings = TRANSFORMERS_LANE_SETTINGS[spec.name]
        return engine_abi(settings.device, settings.dtype, settings.tf32)
    if spec.kind is LaneKind.VLLM:
        from qualify.contract.lanes import VLLM_LANE_ENGINES

        if VLLM_LANE_ENGINES[spec.name][0] == "vllm":
            from qualify.engines.vllm_engine import vllm_engine_abi

            return vllm_engine_abi()
    return _build(spec, spec.mode).abi


def _build(spec: LaneSpec, mode: ProducerMode, role: Role = "producer",
           vllm_fault: str | None = None) -> Engine:
    if spec.kind is LaneKind.VLLM:
        if mode is not ProducerMode.NATIVE:
            raise Refused(f"lane {spec.name}: vLLM lanes run in native mode only, found {mode.value}")
        return _vllm_lane_engine(spec, role, vllm_fault)
    if spec.kind is LaneKind.TRANSFORMERS:
        if mode is not ProducerMode.NATIVE:
            raise Refused(f"lane {spec.name}: transformers lanes run in native mode only, found {mode.value}")
        return _transformers_lane_engine(spec, role)
    if spec.kind is LaneKind.NVFP4:
        # The consumer and the exact anchor decode with the integer-exact a16-q8 contraction.
        arithmetic = "exact" if mode is ProducerMode.EXACT else spec.variant.value  # type: ignore[union-attr]
        if mode is ProducerMode.NATIVE and spec.variant is None:
            raise Refused(f"lane {spec.name}: native mode needs a variant")
        return _nvfp4_engine(arithmetic)
    if spec.kind is LaneKind.KQUANT:
        from qualify.engines import speculative

        return speculative.build_engine(mode)
    raise Refused(f"lane kind {spec.kind.value}: no engine in this harness builds it")


def _stamp(engine: Engine, spec: LaneSpec, mode: ProducerMode) -> Engine:
    """Attach mode, checkpoint digests and the mode-separated target cache identity."""
    digests = checkpoint_digests(spec.kind)
    engine.producer_mode = mode.value  # type: ignore[attr-defined]
    engine.digests = digests  # type: ignore[attr-defined]
    engine.target_cache_identity_sha256 = target_cache_identity(  # type: ignore[attr-defined]
        _mode_spec(spec, mode), digests, engine.abi)
    return engine


def _mode_spec(spec: LaneSpec, mode: ProducerMode) -> LaneSpec:
    """The lane whose cache identity an engine built in ``mode`` carries (its own mode's)."""
    if mode is spec.mode:
        return spec
    for other in _lanes_of_kind(spec.kind):
        if other.mode is mode:
            return other
    raise Refused(f"lane {spec.name}: no lane of kind {spec.kind.value} runs in {mode.value} mode")


def _lanes_of_kind(kind: LaneKind) -> list[LaneSpec]:
    from qualify.contract.lanes import LANES

    return [spec for spec in LANES.values() if spec.kind is kind]


def build_producer(lane: str, mode: str, vllm_fault: str | None = None) -> Engine:
    """The producer engine of ``lane`` in ``mode`` (``exact`` | ``native``; nothing else).

    A producer started in the other mode than its lane declares is built as that mode's lane
    (e.g. the exact anchor), so its handoffs carry that mode's cache identity and are refused.
    """
    spec = lane_spec(lane)
    try:
        producer_mode = ProducerMode(mode)
    except ValueError:
        raise Refused(f"producer mode: found {mode!r}, expected exact or native") from None
    return _stamp(_build(spec, producer_mode, "producer", vllm_fault), _mode_spec(spec, producer_mode),
                  producer_mode)


def build_consumer(lane: str, vllm_fault: str | None = None) -> Engine:
    """The consumer engine for ``lane``: the exact arithmetic of the lane's kind (for a ``vllm``
    lane, the lane's consumer side: the float32 reference engine or vLLM; for a ``transformers``
    lane, the float32 reference engine)."""
    spec = lane_spec(lane)
    if spec.kind in (LaneKind.VLLM, LaneKind.TRANSFORMERS):
        # Both sides run their own float32 (or lower) arithmetic: there is no exact anchor.
        return _stamp(_build(spec, spec.mode, "consumer", vllm_fault), spec, spec.mode)
    return _stamp(_build(spec, ProducerMode.EXACT), spec, spec.mode)


def expected_cache_identity(lane: str) -> str:
    """The target cache identity a handoff of ``lane`` must carry (its declared mode)."""
    spec = lane_spec(lane)
    return build_cache_identity(spec)


def lane_producer_abi(lane: str) -> str:
    """The ABI ``lane``'s producer reports on this host in its declared mode (vLLM and
    transformers producers are not started)."""
    return _producer_abi(lane_spec(lane))


def build_cache_identity(spec: LaneSpec) -> str:
    """Derive a lane's cache identity from its producer engine's ABI and checkpoint digests."""
    return target_cache_identity(spec, checkpoint_digests(spec.kind), _producer_abi(spec))


def producer_facts(lane: str):
    """Name, version, ABI, geometry and checkpoint digests of ``lane``'s producer in its declared
    mode, without starting vLLM when the producer is vLLM (it runs in the producer process)."""
    from types import SimpleNamespace

    spec = lane_spec(lane)
    if spec.kind is LaneKind.VLLM:
        from qualify.contract.lanes import VLLM_LANE_ENGINES

        if VLLM_LANE_ENGINES[spec.name][0] == "vllm":
            from qualify.engines.reference import load_config
            from qualify.engines.vllm_engine import VllmEngine, check_pin, vllm_engine_abi

            return SimpleNamespace(
                name=VllmEngine.name, version=check_pin(), abi=vllm_engine_abi(),
                geometry=load_config(assets.MODEL_DIR).geometry, digests=checkpoint_digests(spec.kind))
    return build_producer(lane, spec.mode.value)

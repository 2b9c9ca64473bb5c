"""Lane kinds, recipes, producer modes, native variants, the lane table and cache identities.

A *lane* is one way of producing KV for the consumer: a lane kind (which engine family), a
producer mode (``exact``: integer-exact, bit-identical to the consumer; ``native``: the producer's
own fast arithmetic) and, for native NVFP4, a variant. The lane kind picks the qualification
recipe (and so the rung) through :func:`recipe_for`, an exhaustive ``match`` ending in
``assert_never``: a new :class:`LaneKind` without a recipe fails the type checker and
``tests/unit/contract/test_lanes.py``. Exact and native lanes derive different target-cache identities, so a KV
entry from one can never be installed where the other is expected (seed §32.8).

Lane table decisions (documented here, enforced by tests):

* ``nvfp4-exact`` is the verification anchor (seed §32.7): it may be *qualified* under
  ``native-text`` as a control (it must pass with zero drift) but it is never *enrollable*: it
  exists to be compared against, not served.
* ``kquant-native`` (float accumulation) exists for fault tests: rung 3 must refuse it on the first
  logit digest mismatch. It is never enrollable.
* A native-mode lane cannot declare speculative-draft geometry (:func:`check_speculative_draft`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import assert_never

from qualify.core.digests import canonical_sha256, is_sha256_hex
from qualify.core.errors import Refused

ZERO_SHA256 = "0" * 64


class LaneKind(str, Enum):
    """The producer engine family of a lane.

    ``vllm`` lanes hand KV between vLLM (through the project KV connector,
    :mod:`qualify.engines.vllm_connector`) and the reference engine; which side is which is in
    :data:`VLLM_LANE_ENGINES`. ``transformers`` lanes run Hugging Face ``transformers`` on an
    NVIDIA GPU as the producer and hand KV to the CPU reference consumer; each lane's device,
    dtype and TF32 setting is in :data:`TRANSFORMERS_LANE_SETTINGS`.
    """

    NVFP4 = "nvfp4"
    KQUANT = "kquant"
    VLLM = "vllm"
    TRANSFORMERS = "transformers"
    TORCH_LLAMA = "torch-llama"


class Recipe(str, Enum):
    """A qualification contract; the recipe fixes the rung of the trust ladder."""

    NATIVE_TEXT = "native-text"
    KQUANT_TARGET_PLUS_DFLASH = "kquant-target-plus-dflash"

    @property
    def rung(self) -> int:
        """Rung 2 (exact tokens, bounded logits) or rung 3 (bit-exact full handoff)."""
        match self:
            case Recipe.NATIVE_TEXT:
                return 2
            case Recipe.KQUANT_TARGET_PLUS_DFLASH:
                return 3
            case _:
                assert_never(self)

    @property
    def onboarding_schema(self) -> str:
        """The ``onboarding_qualification.schema`` string an identity for this recipe carries."""
        match self:
            case Recipe.NATIVE_TEXT:
                return "trust-ladder.native-text-onboarding.v1"
            case Recipe.KQUANT_TARGET_PLUS_DFLASH:
                return "trust-ladder.kquant-target-plus-dflash-onboarding.v1"
            case _:
                assert_never(self)

    @property
    def full_logits_mode(self) -> str:
        """How full logits are judged: ``bounded-drift`` (rung 2) or ``exact`` (rung 3)."""
        match self:
            case Recipe.NATIVE_TEXT:
                return "bounded-drift"
            case Recipe.KQUANT_TARGET_PLUS_DFLASH:
                return "exact"
            case _:
                assert_never(self)


class ProducerMode(str, Enum):
    """``exact``: integer-exact, bit-identical to the consumer; ``native``: fast, drifts."""

    EXACT = "exact"
    NATIVE = "native"


class NativeVariant(str, Enum):
    """Native NVFP4 contractions, mild to harsh: reduction topology, f16 intermediates, W4A4."""

    SPLITK = "splitk"
    F16 = "f16"
    W4A4 = "w4a4"


def recipe_for(kind: LaneKind) -> Recipe:
    """The one recipe a lane kind qualifies under (total; the type checker enforces it)."""
    match kind:
        case LaneKind.NVFP4:
            return Recipe.NATIVE_TEXT
        case LaneKind.KQUANT:
            return Recipe.KQUANT_TARGET_PLUS_DFLASH
        case LaneKind.VLLM:
            return Recipe.NATIVE_TEXT
        case LaneKind.TRANSFORMERS:
            return Recipe.NATIVE_TEXT
        case LaneKind.TORCH_LLAMA:
            return Recipe.NATIVE_TEXT
        case _:
            assert_never(kind)


def check_speculative_draft(lane: str, mode: ProducerMode, has_draft: bool) -> None:
    """Refuse speculative-draft geometry on a native-mode lane (seed §32.8, Chapter 33)."""
    if has_draft and mode is ProducerMode.NATIVE:
        raise Refused(
            f"lane {lane}: speculative_draft: a native-mode lane cannot declare speculative-draft "
            f"geometry; drop the draft, or route speculative serving to the kquant lane "
            f"({KQUANT_EXACT_DFLASH_LANE})"
        )


@dataclass(frozen=True, slots=True)
class LaneSpec:
    """One producer lane: its kind, recipe, producer mode, native variant and draft geometry.

    ``enrollable`` is False for lanes that exist to be compared against (the exact anchor) or to
    be refused (fault tests); they can be qualified but a handoff key is never minted for them.
    """

    name: str
    kind: LaneKind
    recipe: Recipe
    mode: ProducerMode
    variant: NativeVariant | None
    speculative_draft: bool
    enrollable: bool = True

    @property
    def engines(self) -> tuple[EngineChoice, EngineChoice]:
        """(producer, consumer) engine: ``vllm`` on a side a vLLM lane runs vLLM, else the
        embedded ``reference`` (a ``transformers`` lane's producer is built by its own kind)."""
        return VLLM_LANE_ENGINES.get(self.name, (EngineChoice.REFERENCE, EngineChoice.REFERENCE))

    def handed_off_positions(self, handoff_positions: int) -> int:
        """How many of ``handoff_positions`` the producer hands off: whole blocks on a lane with
        vLLM on either side (vLLM exports and installs whole blocks; the consumer recomputes the
        rest as pending tokens), else all of them."""
        if EngineChoice.VLLM in self.engines:
            return (handoff_positions // VLLM_BLOCK_SIZE) * VLLM_BLOCK_SIZE
        return handoff_positions

    def __post_init__(self) -> None:
        if not isinstance(self.kind, LaneKind):
            raise Refused(f"lane {self.name}: kind: found {self.kind!r}, expected a LaneKind")
        if not isinstance(self.recipe, Recipe):
            raise Refused(f"lane {self.name}: recipe: found {self.recipe!r}, expected a Recipe")
        if not isinstance(self.mode, ProducerMode):
            raise Refused(f"lane {self.name}: mode: found {self.mode!r}, expected exact or native")
        if self.variant is not None and not isinstance(self.variant, NativeVariant):
            raise Refused(f"lane {self.name}: variant: found {self.variant!r}, expected a variant")
        expected = recipe_for(self.kind)
        if self.recipe is not expected:
            raise Refused(
                f"lane {self.name}: recipe: found {self.recipe.value}, lane kind "
                f"{self.kind.value} qualifies under {expected.value}"
            )
        if self.mode is ProducerMode.EXACT and self.variant is not None:
            raise Refused(
                f"lane {self.name}: variant: found {self.variant.value}, an exact-mode lane has none"
            )
        if self.kind is LaneKind.NVFP4 and self.mode is ProducerMode.NATIVE and self.variant is None:
            raise Refused(f"lane {self.name}: variant: a native nvfp4 lane must name its variant")
        if self.variant is not None and self.kind is not LaneKind.NVFP4:
            raise Refused(
                f"lane {self.name}: variant: found {self.variant.value}, native variants are "
                f"nvfp4 contractions (lane kind {self.kind.value})"
            )
        check_speculative_draft(self.name, self.mode, self.speculative_draft)
        if self.speculative_draft and self.recipe.rung != 3:
            raise Refused(
                f"lane {self.name}: speculative_draft: only rung-3 recipes qualify a draft "
                f"(recipe {self.recipe.value} is rung {self.recipe.rung})"
            )


KQUANT_EXACT_DFLASH_LANE = "kquant-exact-dflash"
KQUANT_EXACT_LANE = "kquant-exact"
VLLM_TO_REFERENCE_LANE = "vllm-to-reference"
VLLM_TO_VLLM_LANE = "vllm-to-vllm"
VLLM_VIA_CONNECTOR_LANE = "vllm-via-connector"
"""Two vLLM engines joined by a KV connector the operator names (``--connector``): the connector
under test, not the project's, moves the KV (:mod:`qualify.run.connector_lane`)."""
REFERENCE_TO_VLLM_LANE = "reference-to-vllm"

VLLM_BLOCK_SIZE = 128
"""The KV block size the vLLM engine is started with (its CPU default, pinned): a vLLM producer
hands off whole blocks only."""

class EngineChoice(str, Enum):
    """An engine an operator names with ``--producer``/``--consumer``."""

    REFERENCE = "reference"
    VLLM = "vllm"


VLLM_LANE_ENGINES: Mapping[str, tuple[EngineChoice, EngineChoice]] = MappingProxyType({
    VLLM_TO_REFERENCE_LANE: (EngineChoice.VLLM, EngineChoice.REFERENCE),
    VLLM_TO_VLLM_LANE: (EngineChoice.VLLM, EngineChoice.VLLM),
    # After vllm-to-vllm: --producer vllm --consumer vllm names that lane; this one needs --connector.
    VLLM_VIA_CONNECTOR_LANE: (EngineChoice.VLLM, EngineChoice.VLLM),
    REFERENCE_TO_VLLM_LANE: (EngineChoice.REFERENCE, EngineChoice.VLLM),
})
"""(producer engine, consumer engine) of every ``vllm`` lane: ``vllm`` is vLLM through the project
connector, ``reference`` the float32 numpy engine. Both sides of a vLLM lane run their own float32
arithmetic, so every vLLM lane is ``native`` (bounded drift, rung 2)."""

TRANSFORMERS_CUDA_FP32_LANE = "transformers-cuda-fp32"
TRANSFORMERS_CUDA_TF32_LANE = "transformers-cuda-tf32"
TRANSFORMERS_CUDA_BF16_LANE = "transformers-cuda-bf16"


@dataclass(frozen=True, slots=True)
class TorchSettings:
    """How a ``transformers`` lane's producer runs: torch device, model dtype, TF32 matmuls."""

    device: str
    dtype: str
    tf32: bool


TRANSFORMERS_LANE_SETTINGS: Mapping[str, TorchSettings] = MappingProxyType({
    TRANSFORMERS_CUDA_FP32_LANE: TorchSettings("cuda", "float32", tf32=False),
    TRANSFORMERS_CUDA_TF32_LANE: TorchSettings("cuda", "float32", tf32=True),
    TRANSFORMERS_CUDA_BF16_LANE: TorchSettings("cuda", "bfloat16", tf32=False),
})
"""Producer settings of every ``transformers`` lane. The producer is ``LlamaForCausalLM`` on the
GPU (:mod:`qualify.engines.transformers_engine`); the consumer is always the float32 numpy
reference engine on the CPU, so each lane is ``native`` (bounded drift, rung 2). The engine ABI
names device, GPU, dtype and TF32, so each lane's cache identity differs."""

LLAMA3_8B_SHAPE_LANE = "llama3-8b-shape-pd"

TORCH_LLAMA_MODELS: Mapping[str, str] = MappingProxyType({
    LLAMA3_8B_SHAPE_LANE: "model/llama3-8b-shape/config.json",
})
"""The model each ``torch-llama`` lane runs: a repo-relative JSON file naming a Llama shape, dtype,
device and weight seed (weights are drawn from the seed on the device; the file is what the
identity pins). Producer and consumer are the compact CUDA-graph engine
(:mod:`qualify.engines.torch_llama`) in one process, the producer without CUDA graphs: a
prefill/decode split of one engine, at Llama-3 8B's shape on one GPU."""

_LANE_LIST: tuple[LaneSpec, ...] = (
    LaneSpec(
        "nvfp4-native-splitk", LaneKind.NVFP4, Recipe.NATIVE_TEXT, ProducerMode.NATIVE,
        NativeVariant.SPLITK, speculative_draft=False,
    ),
    LaneSpec(
        "nvfp4-native-f16", LaneKind.NVFP4, Recipe.NATIVE_TEXT, ProducerMode.NATIVE,
        NativeVariant.F16, speculative_draft=False,
    ),
    LaneSpec(
        "nvfp4-native-w4a4", LaneKind.NVFP4, Recipe.NATIVE_TEXT, ProducerMode.NATIVE,
        NativeVariant.W4A4, speculative_draft=False,
    ),
    # The verification anchor: qualifiable as a zero-drift control, never enrollable.
    LaneSpec(
        "nvfp4-exact", LaneKind.NVFP4, Recipe.NATIVE_TEXT, ProducerMode.EXACT, None,
        speculative_draft=False, enrollable=False,
    ),
    LaneSpec(
        KQUANT_EXACT_DFLASH_LANE, LaneKind.KQUANT, Recipe.KQUANT_TARGET_PLUS_DFLASH,
        ProducerMode.EXACT, None, speculative_draft=True,
    ),
    # The Q8_0 target alone, without a draft: rung 3 for any model (a --model's own Q8_0 weights;
    # the shipped draft was trained for the shipped target only).
    LaneSpec(
        KQUANT_EXACT_LANE, LaneKind.KQUANT, Recipe.KQUANT_TARGET_PLUS_DFLASH, ProducerMode.EXACT,
        None, speculative_draft=False,
    ),
    # Fault-test lane (float accumulation): rung 3 must refuse it; never enrollable.
    LaneSpec(
        "kquant-native", LaneKind.KQUANT, Recipe.KQUANT_TARGET_PLUS_DFLASH, ProducerMode.NATIVE,
        None, speculative_draft=False, enrollable=False,
    ),
    # Real vLLM (CPU build, float32) through the project KV connector, each way and P/D.
    LaneSpec(
        VLLM_TO_REFERENCE_LANE, LaneKind.VLLM, Recipe.NATIVE_TEXT, ProducerMode.NATIVE, None,
        speculative_draft=False,
    ),
    LaneSpec(
        VLLM_TO_VLLM_LANE, LaneKind.VLLM, Recipe.NATIVE_TEXT, ProducerMode.NATIVE, None,
        speculative_draft=False,
    ),
    # vLLM to vLLM through the operator's KV connector (one identity per connector: the adapter).
    LaneSpec(
        VLLM_VIA_CONNECTOR_LANE, LaneKind.VLLM, Recipe.NATIVE_TEXT, ProducerMode.NATIVE, None,
        speculative_draft=False,
    ),
    LaneSpec(
        REFERENCE_TO_VLLM_LANE, LaneKind.VLLM, Recipe.NATIVE_TEXT, ProducerMode.NATIVE, None,
        speculative_draft=False,
    ),
    # transformers on an NVIDIA GPU (fp32 with TF32 off and on, bf16) into the CPU reference.
    *(
        LaneSpec(name, LaneKind.TRANSFORMERS, Recipe.NATIVE_TEXT, ProducerMode.NATIVE, None,
                 speculative_draft=False)
        for name in TRANSFORMERS_LANE_SETTINGS
    ),
    # Qualification at scale on one GPU (random weights: measured, never served).
    LaneSpec(LLAMA3_8B_SHAPE_LANE, LaneKind.TORCH_LLAMA, Recipe.NATIVE_TEXT, ProducerMode.NATIVE, None,
             speculative_draft=False, enrollable=False),
)

LANES: Mapping[str, LaneSpec] = MappingProxyType({spec.name: spec for spec in _LANE_LIST})
"""Every lane the harness knows, by identity name (immutable)."""

DEFAULT_NATIVE_TEXT_LANE = "nvfp4-native-w4a4"
"""The lane ``qualify --recipe native-text`` qualifies by default."""

DEFAULT_LANES: Mapping[Recipe, str] = MappingProxyType({
    Recipe.NATIVE_TEXT: DEFAULT_NATIVE_TEXT_LANE,
    Recipe.KQUANT_TARGET_PLUS_DFLASH: KQUANT_EXACT_DFLASH_LANE,
})
"""The lane each recipe qualifies when the operator names neither an identity nor vLLM engines."""


def recipe_named(name: str) -> Recipe:
    """The recipe called ``name`` (``--recipe``); an unknown name is refused, listing the known ones."""
    try:
        return Recipe(name)
    except ValueError:
        raise Refused(f"--recipe: found {name!r}, expected one of {', '.join(r.value for r in Recipe)}") from None


def engine_named(option: str, name: str) -> EngineChoice:
    """The engine an operator named with ``option`` (``--producer``/``--consumer``)."""
    try:
        return EngineChoice(name)
    except ValueError:
        raise Refused(f"{option}: found {name!r}, expected one of {', '.join(e.value for e in EngineChoice)}") from None


def lane_for_engines(recipe: Recipe, producer: EngineChoice, consumer: EngineChoice) -> LaneSpec:
    """The lane a recipe qualifies for an operator's ``--producer``/``--consumer`` choice: the
    recipe's default lane for two reference engines, else the vLLM lane running that pair."""
    # The tables name lanes of LANES (tests/unit/contract/test_lanes.py): no name to refuse here.
    if (producer, consumer) == (EngineChoice.REFERENCE, EngineChoice.REFERENCE):
        return LANES[DEFAULT_LANES[recipe]]
    if recipe is not Recipe.NATIVE_TEXT:
        raise Refused(f"--producer {producer.value} --consumer {consumer.value}: vLLM lanes qualify under "
                      f"--recipe {Recipe.NATIVE_TEXT.value}, not {recipe.value}")
    for lane, engines in VLLM_LANE_ENGINES.items():
        if engines == (producer, consumer):
            return LANES[lane]
    raise Refused(f"--producer {producer.value} --consumer {consumer.value}: no lane runs that pair")


def lane_spec(name: str) -> LaneSpec:
    """The lane called ``name``; an unknown name is refused, listing the known ones. Called where a
    name comes in (a command's ``--lane``, a producer process's factory); below that edge the
    :class:`LaneSpec` itself travels (a loaded identity's is :attr:`Identity.spec`)."""
    spec = LANES.get(name) if isinstance(name, str) else None
    if spec is None:
        raise Refused(f"lane: found {name!r}, expected one of {', '.join(LANES)}")
    return spec


def target_cache_identity(
    spec: LaneSpec, checkpoint_digests: Mapping[str, str], engine_abi: str
) -> str:
    """Canonical SHA-256 of what a KV entry's validity depends on, mode-separated (§32.8).

    Hashes ``{"lane_kind", "producer_mode", "native_variant", "checkpoint_sha256": {relpath:
    sha256}, "engine_abi"}`` (plus ``"vllm_lane_engines"``: [producer, consumer] for a ``vllm``
    lane, ``"torch_settings"``: {device, dtype, tf32} for a ``transformers`` lane,
    ``"speculative_draft": false`` for a draftless ``kquant`` lane) with
    :func:`qualify.core.digests.canonical_sha256`.
    """
    if not isinstance(spec, LaneSpec):
        raise Refused(f"target cache identity: spec: found {type(spec).__name__}, expected LaneSpec")
    if not isinstance(engine_abi, str) or not engine_abi.strip():
        raise Refused(f"lane {spec.name}: engine abi: found {engine_abi!r}, expected a non-empty string")
    if not isinstance(checkpoint_digests, Mapping) or not checkpoint_digests:
        raise Refused(f"lane {spec.name}: checkpoint digests: expected a non-empty mapping")
    digests: dict[str, str] = {}
    for relpath, digest in checkpoint_digests.items():
        if not isinstance(relpath, str) or not relpath:
            raise Refused(f"lane {spec.name}: checkpoint file: found {relpath!r}, expected a path")
        if not is_sha256_hex(digest) or digest == ZERO_SHA256:
            raise Refused(
                f"lane {spec.name}: checkpoint file {relpath}: found {digest!r}, expected a "
                f"non-zero 64-character lowercase hex SHA-256"
            )
        digests[relpath] = digest
    document: dict[str, object] = {
        "lane_kind": spec.kind.value,
        "producer_mode": spec.mode.value,
        "native_variant": None if spec.variant is None else spec.variant.value,
        "checkpoint_sha256": digests,
        "engine_abi": engine_abi,
    }
    if spec.kind is LaneKind.VLLM:
        # vLLM lanes share kind, mode and variant: their (producer, consumer) engines separate them.
        document["vllm_lane_engines"] = list(VLLM_LANE_ENGINES[spec.name])
    if spec.name == VLLM_VIA_CONNECTOR_LANE:
        # Its KV crosses the operator's connector, never the harness's wire: named apart from
        # vllm-to-vllm (same engines), which leaves every other lane's document unchanged.
        document["transport"] = "kv-connector"
    if spec.kind is LaneKind.KQUANT and not spec.speculative_draft:
        # A draftless k-quant target hands off no draft context: never the draft lane's KV, though
        # kind, mode and checkpoint can be the same. (Added with the draftless lane; the draft
        # lane's document is unchanged, so its sealed identity stands.)
        document["speculative_draft"] = False
    if spec.kind is LaneKind.TRANSFORMERS:
        # transformers lanes too: their torch settings separate them (the ABI names them as well).
        settings = TRANSFORMERS_LANE_SETTINGS[spec.name]
        document["torch_settings"] = {"device": settings.device, "dtype": settings.dtype,
                                      "tf32": settings.tf32}
    return canonical_sha256(document)

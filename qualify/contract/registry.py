"""Lane registry files: the enrolled producer lanes, refused whole on any doubt at load.

A registry (``contracts/lane-registry.v2.schema.json``) lists entries ``{lane, lane_kind,
recipe, identity_sha256, receipt, receipt_signer, key_id}`` and the handoff keys revoked when a
lane was re-enrolled with ``--rotate`` (a revoked key id is never accepted or reused). v1
registries (no signer, no revocations) stay readable and are written back as v2 (their entries'
signer null). Loading refuses, before any key could be minted: an
unknown lane kind or recipe, a kind/recipe pair that disagrees with
:func:`qualify.contract.lanes.recipe_for`, a lane the harness does not know or that is not enrollable, a
lane whose kind differs from the lane table, and duplicate key ids or duplicate entries.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qualify.contract.lanes import LANES, LaneKind, LaneSpec, Recipe, recipe_for
from qualify.core.assets import require_asset
from qualify.core.errors import Refused
from qualify.core.strict_json import check_schema, format_path, read_strict_json, render

REGISTRY_SCHEMA_ID = "trust-ladder.lane-registry.v2"
REGISTRY_SCHEMA_PATH = require_asset("contracts/lane-registry.v2.schema.json")
LEGACY_REGISTRY_SCHEMA_ID = "trust-ladder.lane-registry.v1"
LEGACY_REGISTRY_SCHEMA_PATH = require_asset("contracts/lane-registry.v1.schema.json")


@dataclass(frozen=True, slots=True)
class RegistryEntry:
    """One enrolled lane: its identity digest, qualification receipt and handoff key id."""

    lane: str
    lane_kind: LaneKind
    recipe: Recipe
    identity_sha256: str
    receipt: str
    key_id: str
    receipt_signer: str | None = None
    """Key id of the receipt-signing key verified at enrollment (None: enrolled under a v1 registry)."""

    @property
    def spec(self) -> LaneSpec:
        return LANES[self.lane]

    def document(self) -> dict[str, str | None]:
        return {
            "lane": self.lane,
            "lane_kind": self.lane_kind.value,
            "recipe": self.recipe.value,
            "identity_sha256": self.identity_sha256,
            "receipt": self.receipt,
            "receipt_signer": self.receipt_signer,
            "key_id": self.key_id,
        }


@dataclass(frozen=True, slots=True)
class RevokedKey:
    """A handoff key revoked when its lane was re-enrolled with ``--rotate``."""

    lane: str
    key_id: str
    identity_sha256: str
    receipt: str
    revoked_utc: str
    reason: str
    replaced_by: str

    def document(self) -> dict[str, str]:
        return {"lane": self.lane, "key_id": self.key_id, "identity_sha256": self.identity_sha256,
                "receipt": self.receipt, "revoked_utc": self.revoked_utc, "reason": self.reason,
                "replaced_by": self.replaced_by}


@dataclass(frozen=True, slots=True)
class LaneRegistry:
    """An immutable, validated registry."""

    entries: tuple[RegistryEntry, ...]
    revoked: tuple[RevokedKey, ...] = ()

    def for_lane(self, lane: str) -> tuple[RegistryEntry, ...]:
        """Entries enrolled for ``lane`` (one per identity version)."""
        return tuple(entry for entry in self.entries if entry.lane == lane)

    def by_key_id(self, key_id: str) -> RegistryEntry:
        """The entry a handoff key belongs to; an unknown key id is refused."""
        for entry in self.entries:
            if entry.key_id == key_id:
                return entry
        for revoked in self.revoked:
            if revoked.key_id == key_id:
                raise Refused(f"registry: key_id {render(key_id)} of lane {revoked.lane} was revoked "
                              f"{revoked.revoked_utc} ({revoked.reason})")
        raise Refused(f"registry: key_id: found {render(key_id)}, no enrolled lane has it")

    def document(self) -> dict[str, Any]:
        """The JSON document of this registry (what a writer serialises)."""
        return {"schema": REGISTRY_SCHEMA_ID, "entries": [entry.document() for entry in self.entries],
                "revoked": [revoked.document() for revoked in self.revoked]}


def _known(value: str, enum: type[LaneKind] | type[Recipe]) -> LaneKind | Recipe | None:
    for member in enum:
        if member.value == value:
            return member
    return None


def registry_from_document(document: Any, where: str) -> LaneRegistry:
    """Validate a parsed registry document; ``where`` starts every refusal line."""
    schema = document.get("schema") if isinstance(document, dict) else None
    if isinstance(document, dict) and schema not in (REGISTRY_SCHEMA_ID, LEGACY_REGISTRY_SCHEMA_ID):
        raise Refused(f"{where}: schema: found {render(schema)}, expected {REGISTRY_SCHEMA_ID} "
                      f"(or the legacy {LEGACY_REGISTRY_SCHEMA_ID})")
    legacy = schema == LEGACY_REGISTRY_SCHEMA_ID
    check_schema(document, LEGACY_REGISTRY_SCHEMA_PATH if legacy else REGISTRY_SCHEMA_PATH, where)
    revoked = tuple(RevokedKey(**raw) for raw in ([] if legacy else document["revoked"]))
    revoked_ids = {entry.key_id for entry in revoked}
    entries: list[RegistryEntry] = []
    seen_keys: dict[str, int] = {}
    seen_identities: dict[tuple[str, str], int] = {}
    for index, raw in enumerate(document["entries"]):
        at = format_path(["entries", index])
        kind = _known(raw["lane_kind"], LaneKind)
        if not isinstance(kind, LaneKind):
            raise Refused(
                f"{where}: {at}.lane_kind: found {render(raw['lane_kind'])}, expected one of "
                f"{', '.join(k.value for k in LaneKind)} (unknown lane kinds are refused before "
                f"any key is minted)"
            )
        recipe = _known(raw["recipe"], Recipe)
        if not isinstance(recipe, Recipe):
            raise Refused(
                f"{where}: {at}.recipe: found {render(raw['recipe'])}, expected one of "
                f"{', '.join(r.value for r in Recipe)} (unknown recipes are refused before any "
                f"key is minted)"
            )
        if recipe is not recipe_for(kind):
            raise Refused(
                f"{where}: {at}.recipe: found {render(recipe.value)}, lane kind {kind.value} "
                f"qualifies under {recipe_for(kind).value}"
            )
        spec = LANES.get(raw["lane"])
        if spec is None:
            raise Refused(
                f"{where}: {at}.lane: found {render(raw['lane'])}, expected one of {', '.join(LANES)}"
            )
        if spec.kind is not kind:
            raise Refused(
                f"{where}: {at}.lane_kind: found {render(kind.value)}, lane {spec.name} is "
                f"{spec.kind.value}"
            )
        if not spec.enrollable:
            raise Refused(
                f"{where}: {at}.lane: {spec.name} is not enrollable (it exists to be compared "
                f"against or to be refused, never served)"
            )
        key_id = raw["key_id"]
        if key_id in seen_keys:
            raise Refused(
                f"{where}: {at}.key_id: found {render(key_id)}, already used by entries[{seen_keys[key_id]}]"
            )
        if key_id in revoked_ids:
            raise Refused(f"{where}: {at}.key_id: found {render(key_id)}, which this registry lists as revoked")
        seen_keys[key_id] = index
        pair = (spec.name, raw["identity_sha256"])
        if pair in seen_identities:
            raise Refused(
                f"{where}: {at}: lane {spec.name} with this identity_sha256 is already "
                f"entries[{seen_identities[pair]}]"
            )
        seen_identities[pair] = index
        entries.append(
            RegistryEntry(
                lane=spec.name,
                lane_kind=kind,
                recipe=recipe,
                identity_sha256=raw["identity_sha256"],
                receipt=raw["receipt"],
                key_id=key_id,
                receipt_signer=raw.get("receipt_signer"),
            )
        )
    return LaneRegistry(tuple(entries), revoked)


def load_registry(path: str | os.PathLike[str]) -> LaneRegistry:
    """Read and validate a lane registry file; any doubt is a one-line ``Refused``."""
    document = read_strict_json(path, "registry")
    return registry_from_document(document, f"registry {os.fspath(path)}")


def validate_registry_document(document: Mapping[str, Any]) -> LaneRegistry:
    """Validate a registry document before it is written (writers call this first)."""
    return registry_from_document(dict(document), "registry (to be written)")

"""Lane registry files: unknown or inconsistent lanes are refused when the file loads."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from qualify.contract.lanes import LaneKind, Recipe
from qualify.contract.registry import LaneRegistry, load_registry, validate_registry_document
from qualify.core.digests import sha256_bytes
from qualify.core.errors import Refused

ENTRY = {
    "lane": "nvfp4-native-splitk",
    "lane_kind": "nvfp4",
    "recipe": "native-text",
    "identity_sha256": sha256_bytes(b"identity"),
    "receipt": "receipt://20261129T084512Z-3f9a0c1d2e4b5a69/validation-summary.json",
    "key_id": "3f9a0c1d2e4b5a69",
}
RUNG3 = {
    "lane": "kquant-exact-dflash",
    "lane_kind": "kquant",
    "recipe": "kquant-target-plus-dflash",
    "identity_sha256": sha256_bytes(b"identity 3"),
    "receipt": "receipt://20261129T090000Z-0011223344556677",
    "key_id": "0011223344556677",
}


SIGNER = sha256_bytes(b"receipt-signing public key")


def document(*entries: dict[str, Any], revoked: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    """A v2 registry of ``entries`` (each signed by SIGNER unless it says otherwise)."""
    return {"schema": "trust-ladder.lane-registry.v2", "entries": [{"receipt_signer": SIGNER, **e} for e in entries],
            "revoked": list(revoked)}


def write(tmp_path: Path, content: Any) -> Path:
    path = tmp_path / "registry.json"
    path.write_text(json.dumps(content) if not isinstance(content, str) else content)
    return path


def refusal(tmp_path: Path, content: Any) -> str:
    path = write(tmp_path, content)
    with pytest.raises(Refused) as caught:
        load_registry(path)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"registry {path}: ")
    return message


def test_valid_registry_loads(tmp_path: Path) -> None:
    registry = load_registry(write(tmp_path, document(ENTRY, RUNG3)))
    assert isinstance(registry, LaneRegistry)
    assert [entry.lane for entry in registry.entries] == ["nvfp4-native-splitk", "kquant-exact-dflash"]
    first = registry.entries[0]
    assert first.lane_kind is LaneKind.NVFP4 and first.recipe is Recipe.NATIVE_TEXT
    assert registry.by_key_id("0011223344556677").recipe is Recipe.KQUANT_TARGET_PLUS_DFLASH
    assert registry.for_lane("nvfp4-native-splitk") == (first,)
    assert registry.document() == document(ENTRY, RUNG3)
    with pytest.raises(Refused, match="no enrolled lane"):
        registry.by_key_id("ffffffffffffffff")
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.key_id = "other"  # type: ignore[misc]
    assert load_registry(write(tmp_path, document())).entries == ()


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("lane_kind", "sglang", 'entries[0].lane_kind: found "sglang", expected one of nvfp4, kquant, vllm, transformers, torch-llama (unknown lane kinds are refused before any key is minted)'),
        ("lane_kind", "sglang", "unknown lane kinds are refused before any key is minted"),
        ("recipe", "native-text-v2", 'entries[0].recipe: found "native-text-v2", expected one of native-text, kquant-target-plus-dflash'),
        ("recipe", "kquant-target-plus-dflash", 'entries[0].recipe: found "kquant-target-plus-dflash", lane kind nvfp4 qualifies under native-text'),
        ("lane", "vllm-native", 'entries[0].lane: found "vllm-native"'),
        ("lane", "kquant-exact-dflash", "lane kquant-exact-dflash is kquant"),
        ("lane", "nvfp4-exact", "nvfp4-exact is not enrollable"),
        ("identity_sha256", "0" * 64, "found the placeholder"),
        ("identity_sha256", "ABC", "64 lowercase hex"),
        ("receipt", "https://x.invalid/r", "entries[0].receipt"),
        ("key_id", "", "entries[0].key_id"),
        ("key_id", 7, "entries[0].key_id: found 7, expected type string"),
    ],
)
def test_bad_entries_are_refused_at_load(tmp_path: Path, field: str, value: Any, fragment: str) -> None:
    entry = dict(ENTRY, **{field: value})
    assert fragment in refusal(tmp_path, document(entry))


def test_a_v1_registry_loads_and_is_written_back_as_v2_with_no_signer(tmp_path: Path) -> None:
    legacy = {"schema": "trust-ladder.lane-registry.v1", "entries": [dict(ENTRY)]}
    registry = load_registry(write(tmp_path, legacy))
    assert registry.entries[0].receipt_signer is None and registry.revoked == ()
    assert registry.document() == document(dict(ENTRY, receipt_signer=None))
    assert "entries[0].receipt_signer: found unexpected field" in refusal(
        tmp_path, {**legacy, "entries": [dict(ENTRY, receipt_signer=SIGNER)]})


def test_a_revoked_key_is_refused_by_key_id_and_never_reenrolled(tmp_path: Path) -> None:
    revoked = {"lane": ENTRY["lane"], "key_id": "9999999999999999", "identity_sha256": ENTRY["identity_sha256"],
               "receipt": ENTRY["receipt"], "revoked_utc": "2026-11-30T00:00:00Z", "reason": "rotated",
               "replaced_by": ENTRY["key_id"]}
    registry = load_registry(write(tmp_path, document(ENTRY, revoked=(revoked,))))
    with pytest.raises(Refused, match='key_id "9999999999999999" of lane nvfp4-native-splitk was revoked'):
        registry.by_key_id("9999999999999999")
    back = dict(ENTRY, key_id="9999999999999999")
    assert "which this registry lists as revoked" in refusal(tmp_path, document(back, revoked=(revoked,)))


def test_kind_must_match_the_lane_table(tmp_path: Path) -> None:
    entry = dict(RUNG3, lane="kquant-exact-dflash", lane_kind="nvfp4", recipe="native-text")
    assert 'entries[0].lane_kind: found "nvfp4", lane kquant-exact-dflash is kquant' in refusal(tmp_path, document(entry))


def test_structure_is_closed_and_duplicates_refused(tmp_path: Path) -> None:
    extra = document(dict(ENTRY, note="x"))
    assert "entries[0].note: found unexpected field" in refusal(tmp_path, extra)
    missing = document({k: v for k, v in ENTRY.items() if k != "key_id"})
    assert "entries[0].key_id: missing" in refusal(tmp_path, missing)
    assert "schema: found" in refusal(tmp_path, {**document(ENTRY), "schema": "v0"})
    assert "already used by entries[0]" in refusal(tmp_path, document(ENTRY, dict(RUNG3, key_id=ENTRY["key_id"])))
    twice = document(ENTRY, dict(ENTRY, key_id="aaaaaaaaaaaaaaaa"))
    assert "with this identity_sha256 is already entries[0]" in refusal(tmp_path, twice)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("not json", "not JSON"),
        ('{"schema": "trust-ladder.lane-registry.v1", "schema": "x", "entries": []}', "duplicate key"),
        ("[" * 5000, "nesting deeper"),
        ('{"schema": "trust-ladder.lane-registry.v1", "entries": [NaN]}', "expected a finite number"),
    ],
    ids=["not-json", "duplicate-key", "nesting", "nan"],
)
def test_malformed_registry_files_are_refused(tmp_path: Path, content: str, fragment: str) -> None:
    assert fragment in refusal(tmp_path, content)


def test_missing_registry_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(Refused, match="no such file"):
        load_registry(tmp_path / "absent.json")


def test_documents_are_validated_before_writing() -> None:
    assert validate_registry_document(document(ENTRY)).entries[0].lane == "nvfp4-native-splitk"
    bad = copy.deepcopy(document(ENTRY))
    bad["entries"][0]["lane_kind"] = "transformers"
    with pytest.raises(Refused, match="registry \\(to be written\\): entries\\[0\\].lane_kind"):
        validate_registry_document(bad)

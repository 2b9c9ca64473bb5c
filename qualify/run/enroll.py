"""Enrollment: minting handoff keys for qualified producer lanes, into the lane registry.

A handoff key is minted only for an enrollable lane whose identity has a passing qualification
receipt that authenticates: signed by a key of the trust file (``--trust``, default the
operator's) and not revoked, every file as its signed statement names it, the statement naming
this identity's digest and concluding ``passed``, and samples that still pass when re-judged under
this identity's own rule (so a receipt judged under a looser rule cannot enroll). Anything else (a
failing, altered, transplanted, unsigned, foreign or untrusted receipt) is refused with one line,
before any key exists. Enrolling an enrolled lane again is refused unless ``--rotate``, which
revokes its old handoff key on the record (the registry's ``revoked`` list) and deletes its file.

The registry is the project's one lane-registry format (:mod:`qualify.contract.registry`,
``contracts/lane-registry.v2.schema.json``): entries ``{lane, lane_kind, recipe,
identity_sha256, receipt, receipt_signer, key_id}`` and ``revoked`` keys; loading it refuses unknown lanes, lane kinds and recipes
before any key is minted, and every document is validated before it is written (atomically).
Keys: 32 random bytes in ``<key_dir>/<key_id>.key``, mode 0600 in a 0700 directory; ``key_id``
is the first 16 hex characters of the key's SHA-256 (:func:`qualify.handoff.wire.handoff_key_id`).
Default locations sit beside the receipt archive's default, outside the checkout:
``$XDG_DATA_HOME/trust-ladder/`` or ``~/.local/share/trust-ladder/`` (``$QUALIFY_REGISTRY`` for
the registry file, ``$QUALIFY_KEYS`` for the key directory). The command is
:mod:`qualify.interfaces.enroll_command`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import secrets
from pathlib import Path
from typing import Any

from qualify.archive.attestation import read_attestation
from qualify.archive.keys import TrustFile
from qualify.archive.layout import receipt_uri
from qualify.archive.reader import read_receipt_json, sample_records
from qualify.archive.verify import authenticate_receipt
from qualify.contract.lanes import LANES
from qualify.contract.registry import LaneRegistry, RegistryEntry, RevokedKey, validate_registry_document
from qualify.contract.registry import load_registry as _load_registry_file
from qualify.core.arguments import require_private_file
from qualify.core.digests import document_sha256
from qualify.core.errors import Refused, one_line
from qualify.evidence.records import parse_rule, rule_from_identity
from qualify.handoff.wire import handoff_key_id
from qualify.judge import judge_summary

KEY_BYTES = 32


def _data_home() -> Path:
    data_home = os.environ.get("XDG_DATA_HOME")
    base = Path(data_home) if data_home and os.path.isabs(data_home) else Path.home() / ".local" / "share"
    return base / "trust-ladder"


def default_registry_path() -> Path:
    """``$QUALIFY_REGISTRY``, else ``<data home>/trust-ladder/lane-registry.json``."""
    configured = os.environ.get("QUALIFY_REGISTRY")
    return Path(configured).expanduser() if configured else _data_home() / "lane-registry.json"


def default_key_dir() -> Path:
    """``$QUALIFY_KEYS``, else ``<data home>/trust-ladder/keys``."""
    configured = os.environ.get("QUALIFY_KEYS")
    return Path(configured).expanduser() if configured else _data_home() / "keys"


def load_registry(path: str | os.PathLike[str]) -> LaneRegistry:
    """The lane registry at ``path`` (no file yet: an empty registry); anything malformed or
    unknown is refused by :func:`qualify.contract.registry.load_registry` before a key is minted."""
    if not os.path.lexists(path):
        return LaneRegistry(())
    return _load_registry_file(path)


def _write_registry(path: Path, registry: LaneRegistry) -> None:
    document = registry.document()
    validate_registry_document(document)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(document, indent=2, sort_keys=True) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


# --------------------------------------------------------------------------- enrollment


def _identity_digest(identity: Any) -> str:
    """The identity digest (``qualify.contract.identity.identity_sha256``: canonical SHA-256 of its document)."""
    try:
        from qualify.contract.identity import Identity, identity_sha256

        if isinstance(identity, Identity):
            return identity_sha256(identity)
    except ImportError:  # pragma: no cover - identity module absent
        pass
    return document_sha256(identity.document())


def _load_identity(identity: Any) -> Any:
    """A path is loaded and sealed, and its basis receipt checked against the sealed digest."""
    if isinstance(identity, (str, os.PathLike)):
        from qualify.contract.identity import load_identity
        from qualify.run.run_contract import checked_basis

        loaded = load_identity(identity)
        checked_basis(loaded, where=f"identity {os.fspath(identity)}")
        return loaded
    return identity


def enroll(
    identity: Any,
    receipt_dir: str | os.PathLike[str],
    registry_path: str | os.PathLike[str],
    key_dir: str | os.PathLike[str],
    *,
    trust: TrustFile | None,
    rotate: bool = False,
) -> RegistryEntry:
    """Mint and register a handoff key for ``identity``'s lane from its qualification receipt.

    ``identity`` is a loaded :class:`qualify.contract.identity.Identity` (or a path to load).
    The receipt must verify end to end under ``trust`` (signed by a trusted, unrevoked key; every
    file its signed statement names), its signed statement must name this identity's digest and
    conclude ``passed``, and its samples must pass again under this identity's own rule. A lane
    already enrolled is refused unless ``rotate``: then its old handoff key is revoked on the
    record (the registry's ``revoked`` list) and its key file deleted. Every refusal is one line,
    before any key exists.
    """
    identity = _load_identity(identity)
    lane = identity.lane
    spec = LANES.get(lane)
    if spec is None:
        raise Refused(f"enroll: lane {lane!r} is unknown; expected one of {', '.join(LANES)}")
    kind = getattr(identity.lane_kind, "value", identity.lane_kind)
    recipe = getattr(identity.recipe, "value", identity.recipe)
    if spec.kind.value != kind or spec.recipe.value != recipe:
        raise Refused(f"enroll: identity declares {kind}/{recipe}, lane {lane} is {spec.kind.value}/{spec.recipe.value}")
    if not spec.enrollable:
        raise Refused(f"enroll: lane {lane} is never enrollable (it exists to be compared against or refused)")
    digest = _identity_digest(identity)

    receipt = Path(receipt_dir)
    run_id = receipt.name
    check = authenticate_receipt(receipt, trust)
    if check.state in ("unsigned", "legacy"):  # a legacy pin attests a basis receipt, never a signer
        raise Refused(f"enroll: receipt {run_id} is unsigned (a legacy receipt); enrollment needs a receipt "
                      f"signed by a trusted key")
    if check.state != "verified":
        more = f" (and {len(check.problems) - 1} more)" if len(check.problems) > 1 else ""
        raise Refused(f"enroll: receipt {run_id} is {check.state}: {check.problems[0]}{more}")
    predicate = read_attestation(receipt, trust).predicate
    if predicate["identity_sha256"] != digest:
        signed = predicate["identity_sha256"]
        raise Refused(f"enroll: receipt {run_id} qualified identity {str(signed)[:16]}…, not this identity {digest[:16]}…")
    recorded = (receipt / "identity.sha256").read_text(encoding="utf-8").strip()
    summary = read_receipt_json(receipt, "validation-summary.json")
    if predicate["status"] != "passed" or summary.get("passed") is not True or recorded != digest:
        raise Refused(f"enroll: receipt {run_id} is a {predicate['status']} qualification: "
                      f"{one_line(str(predicate['verdict']))}")
    if predicate["lane"] != lane or predicate["recipe"] != recipe:
        raise Refused(
            f"enroll: receipt {run_id} qualified lane {predicate['lane']!r} under {predicate['recipe']!r}, "
            f"not {lane} under {recipe}"
        )
    _rejudge(receipt, summary, identity)

    registry = load_registry(registry_path)  # a malformed registry is refused before any key exists
    enrolled = registry.for_lane(lane)
    if enrolled and not rotate:
        raise Refused(f"enroll: lane {lane} is already enrolled (handoff key {enrolled[0].key_id}, "
                      f"{enrolled[0].receipt}); --rotate replaces its key and revokes the old one on the record")
    if rotate and not enrolled:
        raise Refused(f"enroll: --rotate: lane {lane} is not enrolled in {registry_path}; nothing to rotate")
    keys = Path(key_dir)
    key_id = _mint_key(keys)
    entry = RegistryEntry(
        lane=spec.name,
        lane_kind=spec.kind,
        recipe=spec.recipe,
        identity_sha256=digest,
        receipt=receipt_uri(run_id, "validation-summary.json"),
        key_id=key_id,
        receipt_signer=check.key_id,
    )
    now = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    revoked = tuple(RevokedKey(lane=old.lane, key_id=old.key_id, identity_sha256=old.identity_sha256,
                               receipt=old.receipt, revoked_utc=now, replaced_by=key_id,
                               reason=f"re-enrolled with --rotate from {entry.receipt}")
                    for old in enrolled)
    kept = tuple(existing for existing in registry.entries if existing.lane != lane)
    _write_registry(Path(registry_path), LaneRegistry((*kept, entry), (*registry.revoked, *revoked)))
    for old in enrolled:  # the record says revoked; the key itself no longer exists to be misused
        with contextlib.suppress(FileNotFoundError):
            (keys / f"{old.key_id}.key").unlink()
    return entry


def _mint_key(keys: Path) -> str:
    """A new random handoff key in ``keys`` (0600 in a 0700 directory); returns its key id."""
    key = secrets.token_bytes(KEY_BYTES)
    key_id = handoff_key_id(key)
    keys.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(keys, 0o700)
    descriptor = os.open(keys / f"{key_id}.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(key)
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(keys / f"{key_id}.key", 0o600)
    return key_id


def _rejudge(receipt: Path, summary: dict[str, Any], identity: Any) -> None:
    """The receipt's samples must pass again under the identity's own rule (not a looser one)."""
    run_id = receipt.name
    try:
        judged_rule = parse_rule(summary.get("rule") or {})
    except Exception:
        raise Refused(f"enroll: receipt {run_id} records no usable judging rule") from None
    expected = rule_from_identity(identity, drift_graded=judged_rule.drift_graded)
    if judged_rule != expected:
        raise Refused(f"enroll: receipt {run_id} was judged under a rule other than this identity's")
    verdict = judge_summary(list(sample_records(receipt).values()), expected)
    if not verdict.passed:
        raise Refused(f"enroll: receipt {run_id} samples do not pass when re-judged: {verdict.reasons[0]}")


def enrollment_for(
    lane: str, registry_path: str | os.PathLike[str], identity_sha256: str | None = None
) -> RegistryEntry:
    """The registry entry of an enrolled lane (optionally of one identity digest); refused when
    the lane is not enrolled or the choice is ambiguous."""
    entries = load_registry(registry_path).for_lane(lane)
    if identity_sha256 is not None:
        entries = tuple(entry for entry in entries if entry.identity_sha256 == identity_sha256)
    if not entries:
        which = f" with identity {identity_sha256[:16]}…" if identity_sha256 else ""
        raise Refused(f"key: lane {lane!r}{which} is not enrolled in {registry_path}")
    if len(entries) > 1:
        raise Refused(f"key: lane {lane!r} has {len(entries)} enrolled identities in {registry_path}; name the identity digest")
    return entries[0]


def key_for(
    lane: str,
    registry_path: str | os.PathLike[str],
    key_dir: str | os.PathLike[str],
    identity_sha256: str | None = None,
) -> bytes:
    """The enrolled handoff key of ``lane``; a consumer accepts that lane's handoffs only under it.

    Refuses a lane that is not enrolled, and a key file that is missing, a link, readable by
    others, of the wrong size, or whose digest does not match the registered key id.
    """
    entry = enrollment_for(lane, registry_path, identity_sha256)
    path = Path(key_dir) / f"{entry.key_id}.key"
    require_private_file(f"key: {path}", path, f"no such key file for lane {lane}")
    key = path.read_bytes()
    if len(key) != KEY_BYTES:
        raise Refused(f"key: {path}: {len(key)} bytes, expected {KEY_BYTES}")
    if handoff_key_id(key) != entry.key_id:
        raise Refused(f"key: {path}: digest does not match key id {entry.key_id}")
    return key

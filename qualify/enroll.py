"""Enrollment: the registry of enrolled producer lanes, and handoff key minting.

A handoff key is minted only for an enrollable lane whose identity has a verified, passing
qualification receipt: the manifest verifies, the receipt's ``identity.sha256`` is this
identity's digest, its validation summary passed, and its samples still pass when re-judged
under this identity's own rule. Anything else (a failing, altered or foreign receipt) is refused
with one line, before any key exists.

Registry (``enrollment.json``): ``{"schema": "trust-ladder.enrollment-registry.v1", "lanes":
[{lane, lane_kind, recipe, identity_sha256, receipt_uri, receipt_manifest_sha256, key_id,
enrolled_utc}]}``; a registry naming an unknown lane, lane kind or recipe is refused when it is
loaded. Keys: 32 random bytes in ``<key_dir>/<key_id>.key``, mode 0600 in a 0700 directory;
``key_id`` is the first 16 hex characters of the key's SHA-256. Re-enrolling a lane rotates its
key (the registry then names the new one). Default locations sit beside the receipt archive's
default, outside the checkout: ``$XDG_DATA_HOME/trust-ladder/`` or
``~/.local/share/trust-ladder/`` (``$QUALIFY_ENROLLMENT`` for the registry file,
``$QUALIFY_KEYS`` for the key directory).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import re
import secrets
import stat
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from qualify.digests import canonical_sha256, is_sha256_hex, sha256_file
from qualify.errors import Refused, one_line
from qualify.judge import judge_summary
from qualify.lanes import LANES, LaneKind, Recipe
from qualify.records import parse_rule, rule_from_identity
from qualify.receipts import (
    MANIFEST,
    RUN_ID,
    archive_dir,
    read_receipt_json,
    receipt_files,
    receipt_uri,
    resolve_receipt_uri,
    verify_receipt,
)

REGISTRY_SCHEMA = "trust-ladder.enrollment-registry.v1"
KEY_BYTES = 32
_KEY_ID = re.compile(r"^[0-9a-f]{16}$")
_ENTRY_FIELDS = (
    "lane", "lane_kind", "recipe", "identity_sha256", "receipt_uri",
    "receipt_manifest_sha256", "key_id", "enrolled_utc",
)


def _data_home() -> Path:
    data_home = os.environ.get("XDG_DATA_HOME")
    base = Path(data_home) if data_home and os.path.isabs(data_home) else Path.home() / ".local" / "share"
    return base / "trust-ladder"


def default_registry_path() -> Path:
    """``$QUALIFY_ENROLLMENT``, else ``<data home>/trust-ladder/enrollment.json``."""
    configured = os.environ.get("QUALIFY_ENROLLMENT")
    return Path(configured).expanduser() if configured else _data_home() / "enrollment.json"


def default_key_dir() -> Path:
    """``$QUALIFY_KEYS``, else ``<data home>/trust-ladder/keys``."""
    configured = os.environ.get("QUALIFY_KEYS")
    return Path(configured).expanduser() if configured else _data_home() / "keys"


@dataclass(frozen=True)
class Enrollment:
    """One enrolled producer lane: what was qualified, by which receipt, under which key."""

    lane: str
    lane_kind: str
    recipe: str
    identity_sha256: str
    receipt_uri: str
    receipt_manifest_sha256: str
    key_id: str
    enrolled_utc: str


# --------------------------------------------------------------------------- registry file


def _check_entry(entry: Any, index: int, where: str) -> Enrollment:
    field = f"{where}: lanes[{index}]"
    if not isinstance(entry, dict):
        raise Refused(f"{field}: found {type(entry).__name__}, expected an object")
    missing = [name for name in _ENTRY_FIELDS if name not in entry]
    if missing:
        raise Refused(f"{field}: omits {missing[0]}")
    extra = sorted(set(entry) - set(_ENTRY_FIELDS))
    if extra:
        raise Refused(f"{field}: unknown field {extra[0]!r}")
    if any(not isinstance(entry[name], str) for name in _ENTRY_FIELDS):
        name = next(name for name in _ENTRY_FIELDS if not isinstance(entry[name], str))
        raise Refused(f"{field}.{name}: found {entry[name]!r}, expected a string")
    kinds = [kind.value for kind in LaneKind]
    if entry["lane_kind"] not in kinds:
        raise Refused(f"{field}.lane_kind: found {entry['lane_kind']!r}, expected one of {', '.join(kinds)}")
    recipes = [recipe.value for recipe in Recipe]
    if entry["recipe"] not in recipes:
        raise Refused(f"{field}.recipe: found {entry['recipe']!r}, expected one of {', '.join(recipes)}")
    spec = LANES.get(entry["lane"])
    if spec is None:
        raise Refused(f"{field}.lane: found {entry['lane']!r}, expected one of {', '.join(LANES)}")
    if spec.kind.value != entry["lane_kind"] or spec.recipe.value != entry["recipe"]:
        raise Refused(
            f"{field}: lane {spec.name} is {spec.kind.value}/{spec.recipe.value}, "
            f"registry says {entry['lane_kind']}/{entry['recipe']}"
        )
    if not spec.enrollable:
        raise Refused(f"{field}.lane: {spec.name} is never enrollable")
    for name in ("identity_sha256", "receipt_manifest_sha256"):
        if not is_sha256_hex(entry[name]):
            raise Refused(f"{field}.{name}: found {entry[name]!r}, expected a SHA-256 hex digest")
    if not _KEY_ID.fullmatch(entry["key_id"]):
        raise Refused(f"{field}.key_id: found {entry['key_id']!r}, expected 16 lowercase hex characters")
    if not entry["receipt_uri"].startswith("receipt://"):
        raise Refused(f"{field}.receipt_uri: found {entry['receipt_uri']!r}, expected receipt://<run-id>/<file>")
    return Enrollment(**{name: entry[name] for name in _ENTRY_FIELDS})


def load_registry(path: str | os.PathLike[str]) -> dict[str, Enrollment]:
    """Enrolled lanes by name; a missing file is an empty registry, anything malformed or unknown
    (lane, lane kind, recipe) is refused before any key is minted or read."""
    registry = Path(path)
    where = f"registry {registry}"
    if not registry.exists():
        return {}
    try:
        document = json.loads(registry.read_text(encoding="utf-8"), parse_constant=lambda text: text)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise Refused(f"{where}: not a readable JSON document ({type(exc).__name__})") from None
    if not isinstance(document, dict) or set(document) != {"schema", "lanes"}:
        raise Refused(f"{where}: expected exactly the fields schema and lanes")
    if document["schema"] != REGISTRY_SCHEMA:
        raise Refused(f"{where}: schema: found {document['schema']!r}, expected {REGISTRY_SCHEMA!r}")
    if not isinstance(document["lanes"], list):
        raise Refused(f"{where}: lanes: expected a list")
    enrolled: dict[str, Enrollment] = {}
    for index, entry in enumerate(document["lanes"]):
        enrollment = _check_entry(entry, index, where)
        if enrollment.lane in enrolled:
            raise Refused(f"{where}: lanes[{index}].lane: {enrollment.lane} is enrolled twice")
        enrolled[enrollment.lane] = enrollment
    return enrolled


def _write_registry(path: Path, enrolled: dict[str, Enrollment]) -> None:
    document = {"schema": REGISTRY_SCHEMA, "lanes": [asdict(enrolled[name]) for name in sorted(enrolled)]}
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
    """The identity digest (``qualify.identity.identity_sha256``: canonical SHA-256 of its document)."""
    try:
        from qualify.identity import Identity, identity_sha256

        if isinstance(identity, Identity):
            return identity_sha256(identity)
    except ImportError:  # pragma: no cover - identity module absent
        pass
    return canonical_sha256(identity.document())


def _load_identity(identity: Any) -> Any:
    if isinstance(identity, (str, os.PathLike)):
        from qualify.identity import load_identity

        return load_identity(identity)
    return identity


def enroll(
    identity: Any,
    receipt_dir: str | os.PathLike[str],
    registry_path: str | os.PathLike[str],
    key_dir: str | os.PathLike[str],
) -> Enrollment:
    """Mint and register a handoff key for ``identity``'s lane from its qualification receipt.

    ``identity`` is a loaded :class:`qualify.identity.Identity` (or a path to load). Refuses, with
    one line and before any key exists: a lane that is never enrollable, a receipt that fails
    verification, one for another identity, and one whose qualification did not pass.
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
    problems = verify_receipt(receipt)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise Refused(f"enroll: receipt {receipt} fails verification: {problems[0]}{more}")
    run_id = receipt.name
    recorded = (receipt / "identity.sha256").read_text(encoding="utf-8").strip()
    if recorded != digest:
        raise Refused(f"enroll: receipt {run_id} qualified identity {recorded[:16]}…, not this identity {digest[:16]}…")
    summary = read_receipt_json(receipt, "validation-summary.json")
    if summary.get("passed") is not True:
        raise Refused(f"enroll: receipt {run_id} is a failing qualification: {one_line(str(summary.get('verdict')))}")
    if summary.get("lane") != lane or summary.get("recipe") != recipe:
        raise Refused(
            f"enroll: receipt {run_id} qualified lane {summary.get('lane')!r} under {summary.get('recipe')!r}, "
            f"not {lane} under {recipe}"
        )
    _rejudge(receipt, summary, identity)

    manifest_sha256 = sha256_file(receipt / MANIFEST)
    enrolled = load_registry(registry_path)  # a malformed registry is refused before any key exists
    key = secrets.token_bytes(KEY_BYTES)
    key_id = hashlib.sha256(key).hexdigest()[:16]
    keys = Path(key_dir)
    keys.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(keys, 0o700)
    descriptor = os.open(keys / f"{key_id}.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(key)
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(keys / f"{key_id}.key", 0o600)

    enrollment = Enrollment(
        lane=lane,
        lane_kind=kind,
        recipe=recipe,
        identity_sha256=digest,
        receipt_uri=receipt_uri(run_id, "validation-summary.json"),
        receipt_manifest_sha256=manifest_sha256,
        key_id=key_id,
        enrolled_utc=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    )
    enrolled[lane] = enrollment
    _write_registry(Path(registry_path), enrolled)
    return enrollment


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
    samples = sorted(
        (path for path in receipt_files(receipt) if path.startswith("samples/")),
        key=lambda path: int(path.removeprefix("samples/sample-").removesuffix(".json")),
    )
    verdict = judge_summary([read_receipt_json(receipt, path) for path in samples], expected)
    if not verdict.passed:
        raise Refused(f"enroll: receipt {run_id} samples do not pass when re-judged: {verdict.reasons[0]}")


def key_for(lane: str, registry_path: str | os.PathLike[str], key_dir: str | os.PathLike[str]) -> bytes:
    """The enrolled handoff key of ``lane``; a consumer accepts that lane's handoffs only under it.

    Refuses a lane that is not enrolled, and a key file that is missing, a link, readable by
    others, of the wrong size, or whose digest does not match the registered key id.
    """
    enrolled = load_registry(registry_path)
    enrollment = enrolled.get(lane)
    if enrollment is None:
        raise Refused(f"key: lane {lane!r} is not enrolled in {registry_path}")
    path = Path(key_dir) / f"{enrollment.key_id}.key"
    try:
        info = path.lstat()
    except FileNotFoundError:
        raise Refused(f"key: {path}: no such key file for lane {lane}") from None
    if not stat.S_ISREG(info.st_mode):
        raise Refused(f"key: {path}: not a regular file")
    if info.st_mode & 0o077:
        raise Refused(f"key: {path}: mode {stat.S_IMODE(info.st_mode):04o} lets others read it; expected 0600")
    key = path.read_bytes()
    if len(key) != KEY_BYTES:
        raise Refused(f"key: {path}: {len(key)} bytes, expected {KEY_BYTES}")
    if hashlib.sha256(key).hexdigest()[:16] != enrollment.key_id:
        raise Refused(f"key: {path}: digest does not match key id {enrollment.key_id}")
    return key


def enrollment_for(lane: str, registry_path: str | os.PathLike[str]) -> Enrollment:
    """The registry entry of an enrolled lane (refused when not enrolled)."""
    enrollment = load_registry(registry_path).get(lane)
    if enrollment is None:
        raise Refused(f"enrollment: lane {lane!r} is not enrolled in {registry_path}")
    return enrollment


def enroll_cli(args: Sequence[str]) -> int:
    """``qualify enroll --identity PATH --receipt DIR|receipt://<run-id>/<file> [--registry PATH]
    [--keys DIR] [--receipts DIR]``: exit 0 when enrolled, 2 when refused."""
    parser = argparse.ArgumentParser(prog="qualify enroll", description="Enroll a qualified producer lane and mint its handoff key.")
    parser.add_argument("--identity", required=True, help="frozen onboarding identity JSON of the lane")
    parser.add_argument("--receipt", required=True, help="the lane's qualification receipt: a directory or receipt://<run-id>/<file>")
    parser.add_argument("--registry", default=None, help=f"enrollment registry (default {default_registry_path()})")
    parser.add_argument("--keys", default=None, help=f"key directory (default {default_key_dir()})")
    parser.add_argument("--receipts", default=None, help="receipt archive for receipt:// URIs")
    try:
        options = parser.parse_args(list(args))
    except SystemExit as exit_:
        return 0 if exit_.code == 0 else 2
    try:
        receipt = options.receipt
        if receipt.startswith("receipt://"):
            run_id = receipt.removeprefix("receipt://").partition("/")[0]
            resolve_receipt_uri(receipt, archive_dir(options.receipts))
            receipt_path = archive_dir(options.receipts) / run_id
            if not RUN_ID.fullmatch(run_id):  # pragma: no cover - resolve refused already
                raise Refused(f"enroll: receipt uri {receipt!r} is malformed")
        else:
            receipt_path = Path(receipt)
        enrollment = enroll(
            options.identity,
            receipt_path,
            Path(options.registry) if options.registry else default_registry_path(),
            Path(options.keys) if options.keys else default_key_dir(),
        )
    except Refused as refusal:
        print(one_line(str(refusal)), file=sys.stderr)
        return 2
    print(
        f"enrolled {enrollment.lane} ({enrollment.lane_kind}, {enrollment.recipe}): key {enrollment.key_id}, "
        f"receipt {enrollment.receipt_uri}"
    )
    return 0

"""The operator's receipt-signing key and the trust file of public keys receipts are checked against.

Every receipt is signed (:mod:`qualify.archive.attestation`) with one Ed25519 key per operator
account. The private key lives in the user's config directory (``platformdirs``:
``$XDG_CONFIG_HOME/trust-ladder`` or ``~/.config/trust-ladder`` on Linux), never in a checkout:
``signing-key.pem``, PKCS#8 PEM, mode 0600 in a 0700 directory, unencrypted so CI can sign
unattended (whoever can read the operator's account can sign as the operator: docs/receipts.md).

A key id is the SHA-256 hex digest of the raw 32-byte public key, so an auditor recomputes it from
the public key alone. The trust file (``trust-ladder.trust.v1``, ``contracts/trust.v1.schema.json``)
lists public keys by key id; a key that was rotated out stays listed with its revocation (when, why,
which key replaced it), and nothing it signed verifies any more. A v2 trust file
(``contracts/trust.v2.schema.json``) also gives each key its role and the window of run starts it
may vouch for, and pins legacy receipts (from before signing) by their manifest's SHA-256: the
project's own, ``contracts/basis-trust.json``, is how an auditor verifies the basis receipts. ``<config>/trust.json`` is the
operator's own trust file: ``keys init`` adds the new key to it. An auditor verifies with a trust
file of their choosing (``qualify receipts verify --trust FILE``), e.g. one made by
``qualify keys show --trust-file`` on the operator's machine and carried over.

The command (``qualify keys init|show|rotate|tls``) is :mod:`qualify.interfaces.keys_command`.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import secrets
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import platformdirs
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from qualify.archive.layout import json_bytes
from qualify.core.arguments import require_private_file
from qualify.core.assets import asset_path, require_asset
from qualify.core.errors import Refused, one_line
from qualify.core.strict_json import check_schema, parse_untrusted_json, read_bounded

TRUST_SCHEMA = "trust-ladder.trust.v1"
TRUST_SCHEMA_PATH = require_asset("contracts/trust.v1.schema.json")
TRUST_SCHEMA_V2 = "trust-ladder.trust.v2"
TRUST_SCHEMA_V2_PATH = require_asset("contracts/trust.v2.schema.json")
_TRUST_SCHEMAS = {TRUST_SCHEMA: TRUST_SCHEMA_PATH, TRUST_SCHEMA_V2: TRUST_SCHEMA_V2_PATH}
OPERATOR_ROLE = "operator"
"""A v2 key's role when it is an operator account's receipt-signing key (``keys init`` makes one)."""
BASIS_TRUST_FILE = asset_path("contracts/basis-trust.json")
"""The project's trust file for its basis receipts (``receipts/``): the keys that signed them and
the legacy ones pinned by manifest digest. ``qualify receipts verify --trust`` it."""
SIGNING_KEY_FILE = "signing-key.pem"
TRUST_FILE = "trust.json"
ALGORITHM = "ed25519"
_KEY_FILE_MAX_BYTES = 4 << 10
_TRUST_FILE_MAX_BYTES = 4 << 20


def config_dir() -> Path:
    """Where the signing key and the operator's trust file live: ``platformdirs``' user config dir."""
    return Path(platformdirs.user_config_dir("trust-ladder", appauthor=False))


def signing_key_id(public_key: bytes) -> str:
    """A receipt-signing key's id: the SHA-256 hex of its raw 32-byte Ed25519 public key (a
    handoff key's id is :func:`qualify.handoff.wire.handoff_key_id`)."""
    return hashlib.sha256(public_key).hexdigest()


def _utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class SigningKey:
    """The operator's private key, with its raw public key and key id."""

    private: Ed25519PrivateKey
    public: bytes
    key_id: str
    path: Path

    def sign(self, message: bytes) -> bytes:
        return self.private.sign(message)

    def public_pem(self) -> str:
        """The public key as SubjectPublicKeyInfo PEM (what ``qualify keys show`` prints)."""
        return self.private.public_key().public_bytes(serialization.Encoding.PEM,
                                                      serialization.PublicFormat.SubjectPublicKeyInfo).decode("ascii")


@dataclass(frozen=True)
class Revocation:
    utc: str
    reason: str
    replaced_by: str | None

    def document(self) -> dict[str, Any]:
        return {"utc": self.utc, "reason": self.reason, "replaced_by": self.replaced_by}


@dataclass(frozen=True)
class TrustedKey:
    """One public key of a trust file; ``revoked`` is None while it is trusted. A v2 file's key
    also has a ``role`` and vouches only for runs started from ``valid_from`` to ``valid_until``
    (None: no end); a v1 file's has neither (``role`` None) and vouches for any run."""

    key_id: str
    public: bytes
    comment: str
    added_utc: str
    revoked: Revocation | None = None
    role: str | None = None
    valid_from: str | None = None
    valid_until: str | None = None

    def public_key(self) -> Ed25519PublicKey:
        return Ed25519PublicKey.from_public_bytes(self.public)

    def vouches_for(self, started_utc: str) -> bool:
        """Whether a run started at ``started_utc`` (ISO 8601, UTC) lies inside the key's window."""
        if self.valid_from is None:
            return True
        started, start = _utc_instant(started_utc), _utc_instant(self.valid_from)
        end = None if self.valid_until is None else _utc_instant(self.valid_until)
        if started is None or start is None or (self.valid_until is not None and end is None):
            return False  # an unreadable time vouches for nothing
        return start <= started and (end is None or started <= end)

    def window(self) -> str:
        """The key's window in words: ``runs started from A to B`` (``from A on`` with no end)."""
        return f"runs started from {self.valid_from} " + (f"to {self.valid_until}" if self.valid_until else "on")

    def document(self, schema: str = TRUST_SCHEMA) -> dict[str, Any]:
        document = {"keyid": self.key_id, "algorithm": ALGORITHM, "public_key": self.public.hex(),
                    "comment": self.comment, "added_utc": self.added_utc,
                    "revoked": None if self.revoked is None else self.revoked.document()}
        if schema == TRUST_SCHEMA_V2:
            document.update(role=self.role or OPERATOR_ROLE, valid_from=self.valid_from or self.added_utc,
                            valid_until=self.valid_until)
        return document


def _utc_instant(text: str) -> _dt.datetime | None:
    """An ISO 8601 UTC time (``...Z``, with or without fractions of a second), or None."""
    if not isinstance(text, str) or not text.endswith("Z"):
        return None
    try:
        moment = _dt.datetime.fromisoformat(text)
    except ValueError:
        return None
    return moment if moment.utcoffset() == _dt.timedelta(0) else None


@dataclass(frozen=True)
class LegacyReceipt:
    """A receipt from before signing that a v2 trust file pins by its manifest's SHA-256."""

    run_id: str
    manifest_sha256: str
    note: str

    def document(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "manifest_sha256": self.manifest_sha256, "note": self.note}


@dataclass(frozen=True)
class TrustFile:
    """Public keys by key id, and (v2) legacy receipts by run id, from one trust file (``source``
    names it in messages); ``schema`` is the version it is written back as."""

    keys: tuple[TrustedKey, ...]
    source: str
    legacy: tuple[LegacyReceipt, ...] = ()
    schema: str = TRUST_SCHEMA

    def get(self, wanted: str) -> TrustedKey | None:
        return next((key for key in self.keys if key.key_id == wanted), None)

    def legacy_receipt(self, run_id: str) -> LegacyReceipt | None:
        return next((entry for entry in self.legacy if entry.run_id == run_id), None)

    def document(self) -> dict[str, Any]:
        document: dict[str, Any] = {"schema": self.schema, "keys": [key.document(self.schema) for key in self.keys]}
        if self.schema == TRUST_SCHEMA_V2:
            document["legacy_receipts"] = [entry.document() for entry in self.legacy]
        return document


# --------------------------------------------------------------------------- reading


def parse_trust(data: bytes, where: str) -> TrustFile:
    """A trust file's bytes, validated whole: schema (v1, or v2 with roles, windows and legacy
    receipts), one entry per key id, every key id the digest of its public key (a trust file cannot
    name one key and hold another), every window from its start to a later end, one pin per run."""
    document = parse_untrusted_json(data, where, max_bytes=_TRUST_FILE_MAX_BYTES)
    found = document.get("schema") if isinstance(document, dict) else None
    schema = found if isinstance(found, str) and found in _TRUST_SCHEMAS else TRUST_SCHEMA
    check_schema(document, _TRUST_SCHEMAS[schema], where)
    keys: list[TrustedKey] = []
    for index, entry in enumerate(document["keys"]):
        public = bytes.fromhex(entry["public_key"])
        if signing_key_id(public) != entry["keyid"]:
            raise Refused(f"{where}: keys[{index}].keyid is not the SHA-256 of its public_key")
        if any(key.key_id == entry["keyid"] for key in keys):
            raise Refused(f"{where}: keys[{index}].keyid {entry['keyid'][:16]}… is listed twice")
        try:
            Ed25519PublicKey.from_public_bytes(public)
        except ValueError:
            raise Refused(f"{where}: keys[{index}].public_key is not an Ed25519 public key") from None
        revoked = entry["revoked"]
        valid_from, valid_until = entry.get("valid_from"), entry.get("valid_until")
        for name, moment in (("valid_from", valid_from), ("valid_until", valid_until)):
            if moment is not None and _utc_instant(moment) is None:
                raise Refused(f"{where}: keys[{index}].{name} {moment!r} is not a UTC time")
        start = None if valid_from is None else _utc_instant(valid_from)
        end = None if valid_until is None else _utc_instant(valid_until)
        if start is not None and end is not None and end < start:
            raise Refused(f"{where}: keys[{index}]: valid_until {valid_until} is before valid_from {valid_from}")
        keys.append(TrustedKey(entry["keyid"], public, entry["comment"], entry["added_utc"],
                               None if revoked is None else
                               Revocation(revoked["utc"], revoked["reason"], revoked["replaced_by"]),
                               entry.get("role"), valid_from, valid_until))
    legacy: list[LegacyReceipt] = []
    for index, entry in enumerate(document.get("legacy_receipts", [])):
        if any(pinned.run_id == entry["run_id"] for pinned in legacy):
            raise Refused(f"{where}: legacy_receipts[{index}].run_id {entry['run_id']} is listed twice")
        legacy.append(LegacyReceipt(entry["run_id"], entry["manifest_sha256"], entry["note"]))
    return TrustFile(tuple(keys), where, tuple(legacy), schema)


def load_trust(path: str | os.PathLike[str]) -> TrustFile:
    """The trust file at ``path``, or :class:`Refused` in one line naming it."""
    where = f"trust file {os.fspath(path)}"
    return parse_trust(read_bounded(Path(path), _TRUST_FILE_MAX_BYTES, where), where)


def default_trust_path() -> Path:
    return config_dir() / TRUST_FILE


def load_signing_key(directory: Path | None = None) -> SigningKey:
    """The operator's signing key, refused in one line when missing, a link, readable by others
    or not an Ed25519 PKCS#8 PEM key."""
    path = (directory or config_dir()) / SIGNING_KEY_FILE
    info = require_private_file(f"signing key {path}", path, "none yet; `qualify keys init` makes one")
    if info.st_size > _KEY_FILE_MAX_BYTES:
        raise Refused(f"signing key {path}: {info.st_size} bytes, expected a PEM key")
    try:
        private = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError, OSError) as exc:
        raise Refused(f"signing key {path}: not a readable unencrypted PEM key ({type(exc).__name__})") from None
    if not isinstance(private, Ed25519PrivateKey):
        raise Refused(f"signing key {path}: a {type(private).__name__}, expected an Ed25519 key")
    public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return SigningKey(private, public, signing_key_id(public), path)


# --------------------------------------------------------------------------- writing


def _write_private(path: Path, data: bytes) -> None:
    """Publish ``path`` with ``data``, mode 0600, whole or not at all: written to a temporary name,
    then hard-linked into place, which fails if ``path`` exists (two first runs racing both read
    the one key that won, never a half-written one). Raises ``FileExistsError`` to the loser."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, 0o600)
        os.link(temporary, path)
    finally:
        os.unlink(temporary)


def _write_trust(path: Path, trust: TrustFile) -> None:
    """Replace the trust file atomically (validated first: a trust file is never half written)."""
    document = trust.document()
    check_schema(document, _TRUST_SCHEMAS[trust.schema], f"trust file {path}")
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(json_bytes(document))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _prepare(directory: Path) -> None:
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
    except OSError as exc:
        raise Refused(f"key directory {directory}: cannot create it ({exc.strerror or type(exc).__name__})") from None


def _own_trust(directory: Path) -> TrustFile:
    path = directory / TRUST_FILE
    return load_trust(path) if os.path.lexists(path) else TrustFile((), f"trust file {path}")


def _new_key(directory: Path, trust: TrustFile, comment: str) -> tuple[SigningKey, TrustFile]:
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    path = directory / SIGNING_KEY_FILE
    _write_private(path, pem)
    entry = TrustedKey(signing_key_id(public), public, one_line(comment), _utc_now())
    return SigningKey(private, public, entry.key_id, path), replace(trust, keys=(*trust.keys, entry))


def init_key(directory: Path | None = None, comment: str | None = None) -> SigningKey:
    """Make the operator's signing key and trust it in the operator's trust file; refused when a
    key exists (``keys rotate`` replaces one, on the record)."""
    directory = directory or config_dir()
    _prepare(directory)
    if os.path.lexists(directory / SIGNING_KEY_FILE):
        raise Refused(f"signing key {directory / SIGNING_KEY_FILE}: exists; `qualify keys rotate` replaces it")
    trust = _own_trust(directory)
    key, trust = _new_key(directory, trust, comment or _default_comment())
    _write_trust(directory / TRUST_FILE, trust)
    return key


def ensure_signing_key(directory: Path | None = None, announce: Any = None) -> SigningKey:
    """The operator's signing key, made on first use (a run must sign its receipt; ``announce``
    is called with one line when a key is made)."""
    directory = directory or config_dir()
    if not os.path.lexists(directory / SIGNING_KEY_FILE):
        try:
            key = init_key(directory)
        except (Refused, FileExistsError):  # another first run made it meanwhile: use that one
            return load_signing_key(directory)
        line = (f"made signing key {key.key_id[:16]}… at {key.path} (trusted in {directory / TRUST_FILE}; "
                f"`qualify keys show` prints it)")
        (announce or (lambda text: print(text, file=sys.stderr)))(line)
        return key
    return load_signing_key(directory)


def rotate_key(reason: str, directory: Path | None = None) -> tuple[SigningKey, str]:
    """Replace the signing key: a new key is made and trusted, the old one is marked revoked in
    the trust file (time, reason, successor) and its private key file deleted. Returns the new
    key and the old key id. Receipts the old key signed no longer verify against this file."""
    directory = directory or config_dir()
    reason = one_line(reason)
    if not reason:
        raise Refused("keys rotate: --reason is empty; a revocation records why")
    old = load_signing_key(directory)
    trust = _own_trust(directory)
    retired = directory / f".{SIGNING_KEY_FILE}.{old.key_id[:16]}.retired"
    os.replace(old.path, retired)  # the new key takes the name; the old one is deleted below
    try:
        key, trust = _new_key(directory, trust, _default_comment())
    except BaseException:
        os.replace(retired, old.path)
        raise
    revocation = Revocation(_utc_now(), reason, key.key_id)
    entries = [replace(entry, revoked=revocation) if entry.key_id == old.key_id and entry.revoked is None else entry
               for entry in trust.keys]
    if not any(entry.key_id == old.key_id for entry in entries):
        entries.append(TrustedKey(old.key_id, old.public, "rotated out", revocation.utc, revocation))
    _write_trust(directory / TRUST_FILE, replace(trust, keys=tuple(entries)))
    os.unlink(retired)
    return key, old.key_id


def trust_file_of(key: SigningKey) -> TrustFile:
    """A trust file holding only ``key``, listed as its owner's trust file lists it (for an
    auditor's ``--trust``; ``qualify keys show --trust-file``)."""
    entry = _own_trust(key.path.parent).get(key.key_id) or TrustedKey(
        key.key_id, key.public, _default_comment(), _utc_now())
    return TrustFile((entry,), "")


def _default_comment() -> str:
    try:
        user = os.getlogin()
    except OSError:
        user = os.environ.get("USER", "operator")
    return f"{user}@{os.uname().nodename} receipt signing key"

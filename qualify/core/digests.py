"""SHA-256 helpers and the one canonical JSON byte form used for every document digest.

Canonical JSON (defined once, here): UTF-8 bytes of ``json.dumps(obj, sort_keys=True,
separators=(",", ":"), ensure_ascii=False, allow_nan=False)``. Object keys are sorted, there is
no insignificant whitespace, floats use Python's shortest round-trip repr, NaN and infinities are
refused. An identity's digest, a manifest's MAC input and a receipt's digests all use it.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 22


def is_sha256_hex(value: object) -> bool:
    """True for exactly 64 lowercase hex characters."""
    return isinstance(value, str) and SHA256_HEX.fullmatch(value) is not None


def sha256_bytes(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def canonical_json_bytes(obj: Any) -> bytes:
    """The canonical byte form of a JSON document (see module docstring)."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def canonical_sha256(obj: Any) -> str:
    return sha256_bytes(canonical_json_bytes(obj))


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise ValueError(f"duplicate key {key!r}")
        document[key] = value
    return document


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict_json_loads(data: bytes | str) -> Any:
    """Parse standard JSON only: duplicate keys and NaN/Infinity raise ``ValueError`` (bytes must
    be UTF-8), so a document can never mean two things to two readers."""
    text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
    return json.loads(text, object_pairs_hook=_refuse_duplicate_keys, parse_constant=_refuse_constant)

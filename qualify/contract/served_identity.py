"""A served pair's identity (``trust-ladder.served-pair-identity.v1``): what ``qualify calibrate
--recipe native-text --prefill-url U --decode-url V --identity PATH`` writes after a passing
calibration, and what ``qualify --recipe native-text ... --served-identity PATH`` judges under.

It pins both servers' vLLM versions and ``max_model_len``, the served model (the name ``--model``
gave, the id the servers list, and the RFC 8785 SHA-256 of the served root's ``config.json`` when
that directory was readable), the evidence (full logprobs, or top-k and its k), the calibrated
bounds with the rules they follow (:mod:`qualify.contract.rules`: the bound rule, and the top-k
rule under top-k), the fixture (its prompt digest), the calibration set, and the basis: the
calibration receipt's URI and the SHA-256 of its signed statement (``attestation.dsse.json``).

Loading is fail-closed: a file that is missing, not strict JSON, breaks the schema
(``contracts/served-pair-identity.v1.schema.json``, closed objects) or names a rule other than the
stated ones is refused in one line naming the file and the field. Whether the pair and the basis
receipt still agree with it is checked where the pair is reached (:mod:`qualify.run.served_pair`).

User pairs are not shipped: the operator keeps the file (``--identity``); nothing under
``contracts/`` is a served pair's identity.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qualify.contract.rules import SERVED_BOUND_RULE, SERVED_RULES, SERVED_TOP_K_RULE
from qualify.core.assets import CONTRACTS_DIR
from qualify.core.digests import document_sha256
from qualify.core.errors import Refused
from qualify.core.strict_json import check_schema, read_strict_json, render

SERVED_IDENTITY_SCHEMA = "trust-ladder.served-pair-identity.v1"
SERVED_IDENTITY_SCHEMA_PATH = CONTRACTS_DIR / "served-pair-identity.v1.schema.json"
OPTION = "--served-identity"


@dataclass(frozen=True)
class ServedIdentity:
    """The typed view of a checked identity file; ``document`` is the file's JSON as read."""

    path: Path
    document: Mapping[str, Any]
    sha256: str

    def field(self, dotted: str) -> Any:
        """The value at ``a.b.c`` (the schema guarantees every field is present)."""
        value: Any = self.document
        for part in dotted.split("."):
            value = value[part]
        return value

    @property
    def mode(self) -> str:
        return str(self.document["evidence"]["mode"])

    @property
    def top_k(self) -> int | None:
        value = self.document["evidence"]["top_k"]
        return None if value is None else int(value)

    @property
    def vocab(self) -> int:
        return int(self.document["evidence"]["vocab"])

    @property
    def maximum_absolute(self) -> float:
        return float(self.document["rule"]["maximum_absolute"])

    @property
    def maximum_mean_absolute(self) -> float:
        return float(self.document["rule"]["maximum_mean_absolute"])

    @property
    def basis(self) -> str:
        return str(self.document["basis"]["receipt"])

    @property
    def statement_sha256(self) -> str:
        return str(self.document["basis"]["statement_sha256"])

    @property
    def top_k_rule(self) -> str | None:
        rule = self.document["rule"]["top_k_rule"]
        return None if rule is None else str(rule["name"])


def _check_rules(document: Mapping[str, Any], where: str) -> None:
    rule, evidence = document["rule"], document["evidence"]
    expected = {"rule.bound_rule": SERVED_BOUND_RULE,
                "rule.top_k_rule": None if evidence["mode"] == "full" else SERVED_TOP_K_RULE}
    for name, wanted in expected.items():
        found = rule[name.split(".")[1]]
        if wanted is None:
            if found is not None:
                raise Refused(f"{where}: {name}: found {render(found)}, expected null under full logprobs")
            continue
        if not isinstance(found, Mapping) or found.get("name") != wanted or found.get("statement") != SERVED_RULES[wanted]:
            raise Refused(f"{where}: {name}: found {render(found)}, expected {wanted} as stated in "
                          f"qualify/contract/rules.py")
    if (evidence["mode"] == "full") != (evidence["top_k"] is None):
        raise Refused(f"{where}: evidence.top_k: found {render(evidence['top_k'])}, expected "
                      f"{'null under full logprobs' if evidence['mode'] == 'full' else 'k under top-k'}")
    if evidence["mode"] == "full" and evidence["vocab"] < 1:
        raise Refused(f"{where}: evidence.vocab: found {evidence['vocab']}, expected the vocabulary under full logprobs")


def load_served_identity(path: str | os.PathLike[str] | None) -> ServedIdentity:
    """The identity file at ``path``, checked; :class:`Refused` (one line naming ``--served-identity``,
    the file and the field) when it is not given, missing, not JSON or not a served-pair identity."""
    if path is None:
        raise Refused(f"{OPTION}: missing")
    where = f"{OPTION} {os.fspath(path)}"
    document = read_strict_json(path, OPTION)
    if not isinstance(document, dict):
        raise Refused(f"{where}: found {type(document).__name__}, expected a JSON object ({SERVED_IDENTITY_SCHEMA})")
    if document.get("schema") != SERVED_IDENTITY_SCHEMA:
        raise Refused(f"{where}: schema: found {render(document.get('schema'))}, expected {SERVED_IDENTITY_SCHEMA}")
    check_schema(document, SERVED_IDENTITY_SCHEMA_PATH, where)
    _check_rules(document, where)
    return ServedIdentity(Path(path), document, document_sha256(document))


def served_identity_document(document: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A document about to be written as an identity, checked against the schema and the rules
    (the writer's own output is refused like any other file's)."""
    check_schema(dict(document), SERVED_IDENTITY_SCHEMA_PATH, where)
    _check_rules(document, where)
    return dict(document)

"""Soak criteria: what a soak run (``qualify soak``, issue 38) is held to, fixed in a committed file
before the run (``contracts/soak/*.json``, schema ``contracts/soak-criteria.v1.schema.json``).

The command line repeats the handoff count and the floor; a run whose command line differs from
its criteria is refused, so a soak can never be tuned after the fact. The receipt seals the
criteria's SHA-256 (over their RFC 8785 bytes). Imports only :mod:`qualify.core`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qualify.core.assets import CONTRACTS_DIR
from qualify.core.digests import jcs_bytes, sha256_bytes
from qualify.core.errors import Refused
from qualify.core.strict_json import check_schema, read_strict_json

SOAK_SCHEMA_PATH = CONTRACTS_DIR / "soak-criteria.v1.schema.json"
DEFAULT_SOAK_CRITERIA = CONTRACTS_DIR / "soak" / "native-text-unix-v1.json"
"""The committed criteria ``qualify soak`` runs when ``--criteria`` is not given."""

LINK_WORDS = {"unix-socket": "over a Unix socket on this host", "network": "across a network link (--producer-at)"}
"""How a verdict names the link its floor was judged on."""


@dataclass(frozen=True)
class SoakCriteria:
    """A soak's preregistered numbers, its document and that document's SHA-256."""

    name: str
    recipe: str
    link: str
    handoffs: int
    link_floor_gbit_per_s: float
    rationale: str
    document: dict[str, Any]
    sha256: str

    @property
    def link_words(self) -> str:
        return LINK_WORDS[self.link]


def load_soak_criteria(path: str | os.PathLike[str] | None = None) -> SoakCriteria:
    """The criteria at ``path`` (default: :data:`DEFAULT_SOAK_CRITERIA`), checked against their
    schema; any doubt is a one-line refusal naming the file and the field."""
    file = DEFAULT_SOAK_CRITERIA if path is None else Path(path)
    where = f"soak criteria {os.fspath(file)}"
    document = read_strict_json(file, "soak criteria")
    check_schema(document, SOAK_SCHEMA_PATH, where)
    return SoakCriteria(
        name=document["name"], recipe=document["recipe"], link=document["link"], handoffs=document["handoffs"],
        link_floor_gbit_per_s=float(document["link_floor_gbit_per_s"]), rationale=document["rationale"],
        document=document, sha256=sha256_bytes(jcs_bytes(document)),
    )


def check_command_matches(criteria: SoakCriteria, where: str, *, handoffs: int, link_floor_gbit_per_s: float,
                          network: bool) -> None:
    """Refuse a command line that asks for other numbers, or another link, than the criteria fixed."""
    fixed = "a soak runs what its committed criteria fixed before it; change them there"
    if handoffs != criteria.handoffs:
        raise Refused(f"--handoffs {handoffs}: {where} fixes handoffs {criteria.handoffs}; {fixed}")
    if link_floor_gbit_per_s != criteria.link_floor_gbit_per_s:
        raise Refused(f"--link-floor {link_floor_gbit_per_s:g}: {where} fixes link_floor_gbit_per_s "
                      f"{criteria.link_floor_gbit_per_s:g}; {fixed}")
    if network != (criteria.link == "network"):
        asked = "--producer-at (a network link)" if network else "a producer this run starts (a Unix socket)"
        raise Refused(f"{asked}: {where} fixes link {criteria.link}; {fixed}")

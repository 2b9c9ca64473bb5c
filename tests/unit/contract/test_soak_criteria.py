"""Soak criteria: the committed file loads and seals its digest; a command line that differs from
it, and a file that breaks its schema, are refused in one line naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qualify.contract.soak import DEFAULT_SOAK_CRITERIA, check_command_matches, load_soak_criteria
from qualify.core.digests import jcs_bytes, sha256_bytes
from qualify.core.errors import Refused


def test_the_committed_criteria_load_with_their_digest():
    criteria = load_soak_criteria()
    document = json.loads(DEFAULT_SOAK_CRITERIA.read_text(encoding="utf-8"))
    assert (criteria.handoffs, criteria.link_floor_gbit_per_s, criteria.link) == (
        document["handoffs"], document["link_floor_gbit_per_s"], "unix-socket")
    assert criteria.sha256 == sha256_bytes(jcs_bytes(document))
    check_command_matches(criteria, "here", handoffs=document["handoffs"],
                          link_floor_gbit_per_s=document["link_floor_gbit_per_s"], network=False)


@pytest.mark.parametrize(("asked", "field"), [
    ({"handoffs": 99}, "--handoffs 99"), ({"link_floor_gbit_per_s": 1.5}, "--link-floor 1.5"),
    ({"network": True}, "--producer-at"),
])
def test_a_command_line_that_differs_from_the_criteria_is_refused(asked: dict, field: str):
    criteria = load_soak_criteria()
    given = {"handoffs": criteria.handoffs, "link_floor_gbit_per_s": criteria.link_floor_gbit_per_s,
             "network": False, **asked}
    with pytest.raises(Refused) as refused:
        check_command_matches(criteria, "soak criteria X", **given)
    assert str(refused.value).startswith(field) and "soak criteria X" in str(refused.value)


@pytest.mark.parametrize(("change", "field"), [
    ({"handoffs": 0}, "handoffs"), ({"handoffs": 1.5}, "handoffs"), ({"handoffs": True}, "handoffs"),
    ({"link_floor_gbit_per_s": 0}, "link_floor_gbit_per_s"), ({"link": "carrier-pigeon"}, "link"),
    ({"recipe": "other"}, "recipe"), ({"extra": 1}, "extra"), ({"schema": "v0"}, "schema"),
])
def test_criteria_that_break_their_schema_are_refused_naming_the_field(tmp_path: Path, change: dict, field: str):
    document = {**json.loads(DEFAULT_SOAK_CRITERIA.read_text(encoding="utf-8")), **change}
    path = tmp_path / "criteria.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    with pytest.raises(Refused) as refused:
        load_soak_criteria(path)
    assert str(path) in str(refused.value) and field in str(refused.value)

"""MultiConnector (over ExampleConnector) through the connector lane: qualified against its identity
(the shipped one where it covers this host, else calibrated and frozen here first), and a fault in
every load caught and localised. Each qualification starts its own two engines (one pair per run):
about two minutes on two cores, four more where it calibrates."""

from __future__ import annotations

import json

import pytest

from tests.support.connector_lane import REPO, LaneIdentity, evidence, faulted_cells, identity_here, qualified_run

CONFIG = json.dumps({"connectors": [{"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                     "kv_connector_extra_config": {"shared_storage_path": "{storage}"}}]})
CONNECTOR = ["--connector", "MultiConnector", "--connector-config", CONFIG]
SHIPPED = REPO / "contracts" / "connectors" / "MultiConnector-identity-v1.json"
HANDED_OFF = 1920
"""ExampleConnector (MultiConnector's one child) loads the whole blocks before the last prompt token."""


def _schema(name: str) -> dict:
    return json.loads((REPO / "contracts" / name).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def lane(tmp_path_factory) -> LaneIdentity:
    return identity_here(CONNECTOR, SHIPPED, tmp_path_factory.mktemp("multi-connector"))


def test_qualifies_through_multiconnector(lane, monkeypatch, tmp_path):
    receipt = qualified_run(lane, CONNECTOR, monkeypatch, tmp_path / "runs", claimed=HANDED_OFF)
    assert evidence(receipt, "connector")["pin"]["name"] == "MultiConnector"


def test_a_fault_in_every_load_is_caught_and_localised(lane, monkeypatch, tmp_path):
    cells, _ = faulted_cells(lane, CONNECTOR, "gqa-head-replication", monkeypatch, tmp_path / "runs")
    assert cells == {(2, tensor, 1, block) for tensor in ("K", "V") for block in range(HANDED_OFF // 128)}

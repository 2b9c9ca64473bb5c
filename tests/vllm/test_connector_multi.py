"""MultiConnector (over ExampleConnector) through the connector lane: qualified against its identity
(the shipped one where it covers this host, else calibrated and frozen here first), and a fault in
every load caught and localised. Each qualification starts its own two engines (one pair per run):
about two minutes on two cores, four more where it calibrates."""

from __future__ import annotations

import json

import jsonschema
import pytest

from qualify.archive.verify import verify_receipt
from qualify.contract.lanes import VLLM_VIA_CONNECTOR_LANE
from qualify.interfaces import cli
from tests.support.connector_lane import REPO, LaneIdentity, evidence, identity_here, only_receipt, summary

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
    identity_path = lane.apply(monkeypatch)
    runs = tmp_path / "runs"
    code = cli.main(["--recipe", "native-text", *CONNECTOR, "--identity", str(identity_path), "--receipts", str(runs)])
    receipt = only_receipt(runs)
    assert verify_receipt(receipt) == []
    judged = summary(receipt)
    assert code == 0, judged
    assert judged["passed"] and judged["lane"] == VLLM_VIA_CONNECTOR_LANE and judged["samples"] == 3
    for sample in (1, 2, 3):
        found = evidence(receipt, f"connector-sample-{sample}")
        jsonschema.validate(found, _schema("connector-sample.v1.schema.json"))
        assert found["claimed_tokens"] == HANDED_OFF and found["kv_cells"] == []
        assert found["loaded_cells_differing_from_saved"] == []
    assert evidence(receipt, "connector")["pin"]["name"] == "MultiConnector"


def test_a_fault_in_every_load_is_caught_and_localised(lane, monkeypatch, tmp_path):
    identity_path = lane.apply(monkeypatch)
    runs = tmp_path / "runs"
    code = cli.main(["--recipe", "native-text", *CONNECTOR, "--connector-fault", "gqa-head-replication",
                     "--identity", str(identity_path), "--receipts", str(runs)])
    assert code == 1
    receipt = only_receipt(runs)
    assert verify_receipt(receipt) == []
    found = evidence(receipt, "connector-sample-1")
    cells = {(c["layer"], c["tensor"], c["head"], c["block"]) for c in found["kv_cells"]}
    assert cells == {(2, tensor, 1, block) for tensor in ("K", "V") for block in range(HANDED_OFF // 128)}
    assert len(found["loaded_cells_differing_from_saved"]) == len(cells)

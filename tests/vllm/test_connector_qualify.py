"""The connector lane end to end, as an operator runs it: calibrate vLLM's ExampleConnector on this
host, freeze its identity, seal it (in this process only), qualify through it; a fault injected in
every load is caught and localised; a bad connector is refused with a receipt.

One module-scoped calibration (two resident engines, eight handoffs), then each qualification
starts its own two engines: about three minutes on two cores.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import pytest

from qualify.archive.verify import verify_receipt
from qualify.contract import identity as identity_module
from qualify.contract import sealed_data
from qualify.contract.lanes import VLLM_VIA_CONNECTOR_LANE
from qualify.interfaces import cli

REPO = Path(__file__).resolve().parents[2]
CONFIG = json.dumps({"shared_storage_path": "{storage}"})
CONNECTOR = ["--connector", "ExampleConnector", "--connector-config", CONFIG]


def _only_receipt(archive: Path) -> Path:
    (receipt,) = [path for path in archive.iterdir() if path.is_dir()]
    return receipt


def _schema(name: str) -> dict:
    return json.loads((REPO / "contracts" / name).read_text(encoding="utf-8"))


def _summary(receipt: Path) -> dict:
    return json.loads((receipt / "validation-summary.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
    """Calibrated and frozen on this host: (identity path, calibration archive, seal)."""
    work = tmp_path_factory.mktemp("connector-calibration")
    archive = work / "receipts"
    code = cli.main(["calibrate", "--recipe", "native-text", *CONNECTOR, "--receipts", str(archive)])
    assert code == 0, "calibration did not pass"
    calibration = _only_receipt(archive)
    assert verify_receipt(calibration) == []

    sys.path.insert(0, str(REPO / "tools"))
    import freeze_identity

    from qualify.engines.vllm_engine import check_pin, vllm_engine_abi

    identity_path = work / "identity.json"
    engine = ["vllm", check_pin(), vllm_engine_abi()]
    argv = ["--lane", VLLM_VIA_CONNECTOR_LANE, *CONNECTOR, "--basis", f"receipt://{calibration.name}/command.log",
            "--producer-engine", *engine, "--consumer-engine", *engine,
            "--archive-dir", str(archive), "--out", str(identity_path)]
    assert freeze_identity.main(argv) == 0
    document = json.loads(identity_path.read_text(encoding="utf-8"))
    parsed = identity_module.parse_identity_document(document, where="frozen")
    seal = freeze_identity.seal_of(parsed, archive)
    return identity_path, archive, parsed.seal_name, seal


@pytest.fixture
def sealed(frozen, monkeypatch):
    identity_path, archive, seal_name, seal = frozen
    monkeypatch.setattr(sealed_data, "SEALED_IDENTITIES", {**sealed_data.SEALED_IDENTITIES, seal_name: seal.identity_sha256})
    monkeypatch.setattr(sealed_data, "SEALED_BASIS_MANIFESTS",
                        {**sealed_data.SEALED_BASIS_MANIFESTS, seal_name: seal.basis_manifest_sha256})
    monkeypatch.setattr(identity_module, "DEFAULT_ARCHIVE_DIR", archive)
    return identity_path, seal_name


def test_the_identity_pins_the_connector(sealed):
    identity_path, seal_name = sealed
    document = json.loads(identity_path.read_text(encoding="utf-8"))
    assert document["lane"] == VLLM_VIA_CONNECTOR_LANE
    assert document["connector"]["name"] == "ExampleConnector"
    assert seal_name == f"{VLLM_VIA_CONNECTOR_LANE}/ExampleConnector"


def test_qualifies_through_the_connector(sealed, tmp_path):
    identity_path, _ = sealed
    runs = tmp_path / "runs"
    code = cli.main(["--recipe", "native-text", *CONNECTOR, "--identity", str(identity_path), "--receipts", str(runs)])
    receipt = _only_receipt(runs)
    assert verify_receipt(receipt) == []
    summary = _summary(receipt)
    assert code == 0, summary
    assert summary["passed"] and summary["lane"] == VLLM_VIA_CONNECTOR_LANE and summary["samples"] == 3
    for sample in (1, 2, 3):
        evidence = json.loads((receipt / "evidence" / f"connector-sample-{sample}.json").read_text(encoding="utf-8"))
        assert evidence["claimed_tokens"] > 0 and evidence["kv_cells"] == []
        assert evidence["loaded_cells_differing_from_saved"] == []
        jsonschema.validate(evidence, _schema("connector-sample.v1.schema.json"))
    connector = json.loads((receipt / "evidence" / "connector.json").read_text(encoding="utf-8"))
    jsonschema.validate(connector, _schema("connector-evidence.v1.schema.json"))
    assert connector["fault"] is None and connector["pin"]["name"] == "ExampleConnector"
    # Both engine processes measured their known answers, and they are the ones the freeze took
    # from the calibration (a run whose engines measure others is refused at 'producer ready').
    document = json.loads(identity_path.read_text(encoding="utf-8"))
    assert connector["kat"] == {"producer": document["producer_engine"]["kat_sha256"],
                                "consumer": document["consumer_engine"]["kat_sha256"]}
    # 3. enroll: the lane's handoff key, from this receipt.
    assert cli.main(["enroll", "--identity", str(identity_path), "--receipt", str(receipt),
                     "--registry", str(tmp_path / "registry.json"), "--keys", str(tmp_path / "keys")]) == 0
    registry = json.loads((tmp_path / "registry.json").read_text(encoding="utf-8"))
    assert [entry["lane"] for entry in registry["entries"]] == [VLLM_VIA_CONNECTOR_LANE]


def test_another_config_is_refused_by_the_identity(sealed, tmp_path):
    identity_path, _ = sealed
    runs = tmp_path / "runs"
    other = json.dumps({"shared_storage_path": "{storage}/elsewhere"})
    code = cli.main(["--recipe", "native-text", "--connector", "ExampleConnector", "--connector-config", other,
                     "--identity", str(identity_path), "--receipts", str(runs)])
    assert code == 2
    receipt = _only_receipt(runs)
    assert verify_receipt(receipt) == []
    assert _summary(receipt)["status"] == "refused"


def test_a_fault_in_every_load_is_caught_and_localised(sealed, tmp_path):
    identity_path, _ = sealed
    runs = tmp_path / "runs"
    code = cli.main(["--recipe", "native-text", *CONNECTOR, "--connector-fault", "element-scaled",
                     "--identity", str(identity_path), "--receipts", str(runs)])
    assert code == 1
    receipt = _only_receipt(runs)
    assert verify_receipt(receipt) == []
    evidence = json.loads((receipt / "evidence" / "connector-sample-1.json").read_text(encoding="utf-8"))
    jsonschema.validate(evidence, _schema("connector-sample.v1.schema.json"))
    (cell,) = evidence["kv_cells"]
    assert (cell["layer"], cell["tensor"], cell["head"], cell["block"], cell["differing"]) == (2, "K", 1, 5, 1)
    assert evidence["loaded_cells_differing_from_saved"] == ["2/K/1/5"]


@pytest.mark.parametrize("arguments", [
    ["--connector", "NoSuchConnector"],
    ["--connector", "ExampleConnector", "--connector-config", "{not json"],
    ["--connector", "Nope", "--connector-module", "no.such.module"],
], ids=["unknown-name", "config-not-json", "module-does-not-import"])
def test_a_bad_connector_is_refused_with_a_receipt(arguments, tmp_path):
    runs = tmp_path / "runs"
    code = cli.main(["--recipe", "native-text", *arguments, "--receipts", str(runs)])
    assert code == 2
    receipt = _only_receipt(runs)
    assert verify_receipt(receipt) == []
    summary = _summary(receipt)
    assert summary["status"] == "refused" and summary["lane"] == VLLM_VIA_CONNECTOR_LANE

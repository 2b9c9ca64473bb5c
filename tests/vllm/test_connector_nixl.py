"""NixlConnector through the connector lane, in process: the lane drives NIXL's prefill/decode
handshake (the producer's request asks for a remote decode, what it returns goes with the
consumer's, the producer stays up while the consumer pulls), and reads the asynchronously loaded KV
once NIXL reported it received. Qualified against its identity (the shipped one where it covers
this host, else calibrated and frozen here first), and a fault in every load caught and localised.

Needs the ``nixl`` package, which tools/install_vllm.sh does not install (``.venv-vllm/bin/pip
install nixl``): without it those tests skip naming it, and the lane's refusal of NIXL is tested
instead (one line, exit 2, a refused receipt). About two minutes on two cores with nixl, four more
where it calibrates; about 30 s without.
"""

from __future__ import annotations

import importlib.util

import pytest

from qualify.archive.verify import verify_receipt
from qualify.contract.lanes import VLLM_VIA_CONNECTOR_LANE
from qualify.interfaces import cli
from tests.support.connector_lane import REPO, LaneIdentity, faulted_cells, identity_here, only_receipt, qualified_run, summary

CONNECTOR = ["--connector", "NixlConnector", "--connector-config", "{}"]
SHIPPED = REPO / "contracts" / "connectors" / "NixlConnector-identity-v1.json"
HAVE_NIXL = importlib.util.find_spec("nixl") is not None
needs_nixl = pytest.mark.skipif(not HAVE_NIXL, reason="needs the nixl package (.venv-vllm/bin/pip install nixl); "
                                                      "tools/install_vllm.sh does not install it")
PROMPT_TOKENS = 2048
"""NIXL hands off the whole prompt; vLLM recomputes its last token over it."""


def _schema(name: str) -> dict:
    import json

    return json.loads((REPO / "contracts" / name).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def lane(tmp_path_factory) -> LaneIdentity:
    return identity_here(CONNECTOR, SHIPPED, tmp_path_factory.mktemp("nixl-connector"))


@needs_nixl
def test_qualifies_through_nixl_driving_its_handshake(lane, monkeypatch, tmp_path):
    qualified_run(lane, CONNECTOR, monkeypatch, tmp_path / "runs", claimed=PROMPT_TOKENS)


@needs_nixl
def test_a_fault_in_every_load_is_caught_and_localised(lane, monkeypatch, tmp_path):
    cells, found = faulted_cells(lane, CONNECTOR, "partial-block-dropped", monkeypatch, tmp_path / "runs")
    last = PROMPT_TOKENS // 128 - 1
    assert cells == {(layer, tensor, head, last) for layer in range(4) for tensor in ("K", "V") for head in range(4)}
    assert len(found["loaded_cells_differing_from_saved"]) == len(cells)


@pytest.mark.skipif(HAVE_NIXL, reason="nixl is installed here: the lane runs NIXL instead (the tests above)")
def test_without_nixl_the_connector_is_refused_with_a_receipt(tmp_path):
    runs = tmp_path / "runs"
    code = cli.main(["--recipe", "native-text", *CONNECTOR, "--receipts", str(runs)])
    assert code == 2
    receipt = only_receipt(runs)
    assert verify_receipt(receipt) == []
    judged = summary(receipt)
    assert judged["status"] == "refused" and judged["lane"] == VLLM_VIA_CONNECTOR_LANE

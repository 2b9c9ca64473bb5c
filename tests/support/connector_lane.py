"""A connector lane's identity for the vLLM tests (tests/vllm/): the shipped one where it covers this
host, else one calibrated and frozen here, as an operator would (``qualify calibrate``, then the
freeze tool), and sealed for the test only (its fixture patches the public sealed tables).

A shipped connector identity covers the vLLM ABI it was calibrated on (vLLM and torch builds, CPU
ISA class, threads, numeric environment: docs/connectors.md); CI's host may be another class, so
the tests never skip for it: they calibrate. Needs vLLM (imported lazily).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qualify.archive.verify import verify_receipt
from qualify.contract import identity as identity_module
from qualify.contract import sealed_data
from qualify.contract.lanes import VLLM_VIA_CONNECTOR_LANE
from qualify.interfaces import cli

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class LaneIdentity:
    """The identity a connector test qualifies against: its path, and for one calibrated here its
    archive and seal (None for the shipped one, sealed in the code already)."""

    path: Path
    calibrated_here: bool
    archive: Path | None = None
    seal_name: str | None = None
    seal: Any = None

    def apply(self, monkeypatch: Any) -> Path:
        """Seal a calibrated identity for this test (public tables only); the identity's path."""
        if self.calibrated_here:
            assert self.seal_name is not None and self.archive is not None
            monkeypatch.setattr(sealed_data, "SEALED_IDENTITIES",
                                {**sealed_data.SEALED_IDENTITIES, self.seal_name: self.seal.identity_sha256})
            monkeypatch.setattr(sealed_data, "SEALED_BASIS_MANIFESTS",
                                {**sealed_data.SEALED_BASIS_MANIFESTS, self.seal_name: self.seal.basis_manifest_sha256})
            monkeypatch.setattr(identity_module, "DEFAULT_ARCHIVE_DIR", self.archive)
        return self.path


def only_receipt(archive: Path) -> Path:
    (receipt,) = [path for path in archive.iterdir() if path.is_dir()]
    return receipt


def shipped_covers_here(shipped: Path) -> bool:
    """Whether the shipped identity exists and pins this host's vLLM ABI on both sides."""
    from qualify.engines.vllm_engine import vllm_engine_abi

    if not shipped.exists():
        return False
    document = json.loads(shipped.read_text(encoding="utf-8"))
    abi = vllm_engine_abi()
    return bool(document["producer_engine"]["abi"] == abi and document["consumer_engine"]["abi"] == abi)


def identity_here(connector: list[str], shipped: Path, work: Path) -> LaneIdentity:
    """The shipped identity where it covers this host, else one calibrated and frozen in ``work``."""
    if shipped_covers_here(shipped):
        return LaneIdentity(shipped, calibrated_here=False)
    archive = work / "receipts"
    code = cli.main(["calibrate", "--recipe", "native-text", *connector, "--receipts", str(archive)])
    calibration = only_receipt(archive)
    assert code == 0, json.loads((calibration / "validation-summary.json").read_text(encoding="utf-8"))
    assert verify_receipt(calibration) == []
    sys.path.insert(0, str(REPO / "tools"))
    import freeze_identity

    from qualify.engines.vllm_engine import check_pin, vllm_engine_abi

    identity_path = work / "identity.json"
    engine = ["vllm", check_pin(), vllm_engine_abi()]
    argv = ["--lane", VLLM_VIA_CONNECTOR_LANE, *connector, "--basis", f"receipt://{calibration.name}/command.log",
            "--producer-engine", *engine, "--consumer-engine", *engine,
            "--archive-dir", str(archive), "--out", str(identity_path)]
    assert freeze_identity.main(argv) == 0
    parsed = identity_module.parse_identity_document(json.loads(identity_path.read_text(encoding="utf-8")),
                                                     where="frozen")
    return LaneIdentity(identity_path, True, archive, parsed.seal_name, freeze_identity.seal_of(parsed, archive))


def evidence(receipt: Path, name: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((receipt / "evidence" / f"{name}.json").read_text(encoding="utf-8"))
    return document


def summary(receipt: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((receipt / "validation-summary.json").read_text(encoding="utf-8"))
    return document


def qualified_run(lane: LaneIdentity, connector: list[str], monkeypatch: Any, runs: Path, claimed: int) -> Path:
    """Qualify through ``connector`` under ``lane``'s identity: exit 0, the receipt verified, three
    samples each loading ``claimed`` prompt tokens bit-equal to the cold prefill and to what was saved."""
    import jsonschema

    code = cli.main(["--recipe", "native-text", *connector, "--identity", str(lane.apply(monkeypatch)),
                     "--receipts", str(runs)])
    receipt = only_receipt(runs)
    assert verify_receipt(receipt) == []
    judged = summary(receipt)
    assert code == 0, judged
    assert judged["passed"] and judged["lane"] == VLLM_VIA_CONNECTOR_LANE and judged["samples"] == 3
    schema = json.loads((REPO / "contracts" / "connector-sample.v1.schema.json").read_text(encoding="utf-8"))
    for sample in (1, 2, 3):
        found = evidence(receipt, f"connector-sample-{sample}")
        jsonschema.validate(found, schema)
        assert found["claimed_tokens"] == claimed and found["kv_cells"] == []
        assert found["loaded_cells_differing_from_saved"] == []
    return receipt


def faulted_cells(lane: LaneIdentity, connector: list[str], fault: str, monkeypatch: Any,
                  runs: Path) -> tuple[set[tuple[int, str, int, int]], dict[str, Any]]:
    """Run ``fault`` in every load: exit 1, the receipt verified; the (layer, K/V, head, block)
    cells sample 1 localised, and its evidence."""
    code = cli.main(["--recipe", "native-text", *connector, "--connector-fault", fault,
                     "--identity", str(lane.apply(monkeypatch)), "--receipts", str(runs)])
    assert code == 1
    receipt = only_receipt(runs)
    assert verify_receipt(receipt) == []
    found = evidence(receipt, "connector-sample-1")
    return {(c["layer"], c["tensor"], c["head"], c["block"]) for c in found["kv_cells"]}, found

"""``qualify calibrate`` then ``qualify --recipe native-text`` on the calibrating host can fail.

The bound is sealed from a calibration over documents other than the fixture, by the stated rule;
then a producer that differs from the honest one by a fault just outside that bound is qualified
under it, on the same host, and fails on the drift rule itself. The fault one grid step smaller
stays inside the bound and is caught by the anchor recheck alone (the handed-off bytes changed).
A small calibration set (the committed documents at 256 tokens) stands in for the committed one,
so the test takes minutes, not tens of minutes."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from qualify.contract import controls as controls_module
from qualify.contract import identity as identity_module
from qualify.contract import sealed_data
from qualify.contract.lanes import lane_spec
from qualify.interfaces import cli
from qualify.run.calibrate import calibrate
from qualify.run.qualification import RunOptions
from tests.conftest import small_calibration_set
from tests.support.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
LANE = "nvfp4-native-splitk"
V_SCALE_GRID = ("1.0001", "1.0002", "1.0005", "1.001", "1.002", "1.005", "1.01", "1.02", "1.05", "1.1", "1.2",
                "1.5", "2")


def _criteria_without(lane: str, directory: Path) -> Path:
    """The committed E2 criteria with ``lane`` left out of its lanes (its controls take minutes and
    are not what this test is about); both calibration and loading read this copy."""
    document = json.loads(controls_module.CRITERIA_PATH.read_text(encoding="utf-8"))
    document["lanes"] = [name for name in document["lanes"] if name != lane]
    path = directory / "e2-controls-small.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    return path


def _qualify(identity: Path, runs: Path, fault: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    capsys.readouterr()
    code = cli.main(["--recipe", "native-text", "--identity", str(identity), "--receipts", str(runs),
                     "--reference-once", "--fault", fault])
    capsys.readouterr()
    newest = max(runs.iterdir(), key=lambda path: path.stat().st_mtime)
    return code, json.loads((newest / "validation-summary.json").read_text(encoding="utf-8"))


@pytest.mark.slow
def test_a_sealed_bound_fails_a_producer_just_outside_it_on_the_calibrating_host(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    small_set, _digest = small_calibration_set(tmp_path)
    monkeypatch.setattr(controls_module, "CALIBRATION_SET_PATH", tmp_path / "calibration-set-small.json")
    monkeypatch.setattr(controls_module, "CRITERIA_PATH", _criteria_without(LANE, tmp_path))
    archive = tmp_path / "archive"

    # 1. Calibrate on this host: the set's cells (never the fixture) and two fixture anchors.
    calibration = calibrate(lane_spec(LANE), "native-text", RunOptions(recipe="native-text", receipts=archive))
    assert calibration.passed, calibration.headline
    assert {cell.document for cell in calibration.cells}.isdisjoint({"python-textwrap"})

    # 2. Freeze with the tool: it derives the bounds from the receipt by the stated rule.
    freeze = load_script(REPO / "tools" / "freeze_identity.py")
    identity_path = tmp_path / "identity.json"
    assert calibration.receipt_path is not None
    argv = ["--lane", LANE, "--basis", f"receipt://{calibration.receipt_path.name}/command.log",
            "--archive-dir", str(archive), "--out", str(identity_path)]
    with contextlib.redirect_stdout(io.StringIO()):
        assert freeze.main(argv) == 0, capsys.readouterr().err
    frozen = identity_module.parse_identity_document(json.loads(identity_path.read_text()), where="identity")
    bound = frozen.onboarding_qualification.full_logits
    assert (bound.maximum_absolute, bound.maximum_mean_absolute) == (  # type: ignore[union-attr]
        calibration.proposed_maximum_absolute, calibration.proposed_maximum_mean_absolute)
    # A relaxed bound is refused by the same tool.
    relaxed = [*argv[:-2], "--out", str(tmp_path / "relaxed.json"), "--maximum-absolute",
               repr(2 * calibration.proposed_maximum_absolute)]  # type: ignore[operator]
    assert freeze.main(relaxed) == 2 and "must follow from its basis" in capsys.readouterr().err
    seal = freeze.seal_of(frozen, archive)
    monkeypatch.setattr(sealed_data, "SEALED_IDENTITIES", {**sealed_data.SEALED_IDENTITIES, LANE: seal.identity_sha256})
    monkeypatch.setattr(sealed_data, "SEALED_BASIS_MANIFESTS",
                        {**sealed_data.SEALED_BASIS_MANIFESTS, LANE: seal.basis_manifest_sha256})
    monkeypatch.setattr(identity_module, "DEFAULT_ARCHIVE_DIR", archive)

    # 3. The smallest V scale (layer 2) on the grid whose drift the sealed bound does not admit,
    #    found in process with the bench's probe (the same wire, comparison and judge).
    detection = load_script(REPO / "bench" / "detection_power.py")
    bench = detection.set_up_lane(LANE, f"{bound.maximum_absolute!r},{bound.maximum_mean_absolute!r}")  # type: ignore[union-attr]
    #    The grid is probed in order up to the first factor caught (the larger ones are not
    #    asked about); the one before it was probed on the way there and must have passed.
    probes = {}
    for factor in V_SCALE_GRID:
        probes[factor] = bench.probe(factor, f"v-scale={factor}")
        if probes[factor].caught_drift:
            break
    caught = [factor for factor, probe in probes.items() if probe.caught_drift]
    assert caught, "no grid factor breaks the sealed bound"
    outside = caught[0]
    assert outside != V_SCALE_GRID[0], "the smallest grid factor already breaks the sealed bound: no step inside it"
    inside = V_SCALE_GRID[V_SCALE_GRID.index(outside) - 1]
    assert not probes[inside].caught_drift

    # 4. Qualify under the sealed identity on this host: just outside fails on the drift rule.
    runs = tmp_path / "runs"
    code, summary = _qualify(identity_path, runs, f"v-scale={outside}", capsys)
    assert code == 1 and summary["status"] == "failed", summary["verdict"]
    failed = {check["name"] for check in summary["checks"] if not check["passed"]}
    assert failed & {"bounded drift", "bounded drift in every repetition"}, failed
    assert summary["verdict"].startswith("NOT QUALIFIED on fixture python-textwrap (3 × 2048/256)")

    # 5. One grid step smaller is inside the bound: only the anchor recheck catches it.
    code, summary = _qualify(identity_path, runs, f"v-scale={inside}", capsys)
    assert code == 1, summary["verdict"]
    failed = {check["name"] for check in summary["checks"] if not check["passed"]}
    assert "bounded drift in every repetition" not in failed
    assert "payload tree as anchored" in failed, failed

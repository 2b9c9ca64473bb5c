"""A producer declared non-deterministic, end to end through the real CLI in a scratch checkout:
``qualify calibrate --non-deterministic`` states the default lane's fixture envelope,
``tools/freeze_identity.py`` seals it in a v8 identity, and ``qualify --recipe native-text`` holds
every handoff to it with no anchor recheck: the honest producer qualifies, a fault at the last
handed-off position fails on the envelope alone, and an identity whose sealed ceilings digest does
not follow from its basis is refused at load (exit 2).

The scratch checkout (``tests/system/test_onboarding_doc.py``'s helpers) is where the freeze
rewrites ``contracts/`` and ``qualify/contract/sealed_data.py``; there, so the test takes about a
minute and a half rather than tens of minutes, the committed calibration set is cut to two of its
documents at 256 tokens and the lane is left out of the E2 criteria (its controls take minutes and
are not what this test is about). Every command writes its receipts under the test's directory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.system.test_onboarding_doc import scratch_checkout, scratch_environment

pytestmark = pytest.mark.slow

LANE = "nvfp4-native-w4a4"
COMMAND_LIMIT_S = 900
"""A bound on each command (a calibration is about 45 s on 2 idle cores): ending within it is the
behaviour asserted, never how long it took."""


def shrunk_contracts(checkout: Path) -> None:
    """The scratch checkout's calibration set cut to two documents at 256 tokens, and its E2
    criteria without the lane (both read by calibration, freeze and load alike)."""
    contracts = checkout / "contracts"
    calibration_set = json.loads((contracts / "calibration-set-v1.json").read_text(encoding="utf-8"))
    calibration_set["documents"] = calibration_set["documents"][:2]
    calibration_set["prompt_lengths"] = [256]
    (contracts / "calibration-set-v1.json").write_text(json.dumps(calibration_set), encoding="utf-8")
    criteria_path = contracts / "e2-controls-v2.json"
    criteria = json.loads(criteria_path.read_text(encoding="utf-8"))
    criteria["lanes"] = [name for name in criteria["lanes"] if name != LANE]
    criteria_path.write_text(json.dumps(criteria), encoding="utf-8")


def run(checkout: Path, env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    """One command of the checkout (``qualify ...`` as ``python -m qualify.interfaces.cli``, or a tool)."""
    command = [sys.executable, *argv] if argv[0].endswith(".py") else [sys.executable, "-m",
                                                                        "qualify.interfaces.cli", *argv]
    return subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, timeout=COMMAND_LIMIT_S)


def newest_receipt(archive: Path) -> Path:
    receipts = [path for path in archive.iterdir() if not path.name.startswith(".")]
    return max(receipts, key=lambda path: path.stat().st_mtime)


def summary_of(receipt: Path) -> dict:
    return json.loads((receipt / "validation-summary.json").read_text(encoding="utf-8"))


def test_a_non_deterministic_declaration_is_calibrated_frozen_and_held_to_its_fixture_envelope(tmp_path: Path) -> None:
    checkout = scratch_checkout(tmp_path / "checkout")
    shrunk_contracts(checkout)
    env = scratch_environment(checkout, tmp_path)
    calibrations, runs = tmp_path / "calibrations", tmp_path / "runs"
    calibrations.mkdir()
    runs.mkdir()

    # 1. Calibrate: the cells, then the fixture handed off 4 times over 2 producer starts; no anchor.
    done = run(checkout, env, "calibrate", "--recipe", "native-text", "--lane", LANE, "--non-deterministic",
               "--envelope-handoffs", "4", "--receipts", str(calibrations))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    basis = newest_receipt(calibrations)
    evidence = json.loads((basis / "evidence" / "calibration.json").read_text(encoding="utf-8"))
    envelope_runs = [entry for entry in evidence["handoffs"] if entry["part"] == "envelope"]
    assert [entry["producer_start"] for entry in envelope_runs] == [3, 3, 4, 4]
    assert not any(entry["part"] == "anchor" for entry in evidence["handoffs"])
    assert sorted(path.name for path in (basis / "series").glob("envelope-*.safetensors")) == [
        f"envelope-{entry['repetition']}.safetensors" for entry in envelope_runs]

    # 2. Freeze a v8 identity from that receipt, copied under receipts/ as the printed commands do.
    subprocess.run(["cp", "-r", str(basis), str(checkout / "receipts")], check=True)
    frozen = run(checkout, env, "tools/freeze_identity.py", "--lane", LANE, "--basis",
                 f"receipt://{basis.name}/command.log", "--replace", "--write-sealed")
    assert frozen.returncode == 0, frozen.stderr
    identity_path = checkout / "contracts" / f"{LANE}-identity-v1.json"
    identity = json.loads(identity_path.read_text(encoding="utf-8"))
    rule = identity["onboarding_qualification"]
    assert identity["schema"] == "trust-ladder.onboarding-identity.v8"
    assert rule["require_deterministic_remote_output"] is False
    sealed = rule["fixture_envelope"]
    assert (sealed["rule"]["name"], sealed["handoffs"], sealed["producer_starts"]) == (
        "fixture-envelope-loo-range.v1", 4, 2)
    checked = run(checkout, env, "identity", "check", str(identity_path))
    assert checked.returncode == 0, checked.stderr

    # 3. The honest producer qualifies, judged by the envelope, with no anchor rechecked.
    honest = run(checkout, env, "--recipe", "native-text", "--receipts", str(runs), "--reference-once")
    assert honest.returncode == 0, honest.stdout[-3000:] + honest.stderr[-3000:]
    receipt = newest_receipt(runs)
    summary = summary_of(receipt)
    assert summary["status"] == "passed"
    assert summary["scope"]["envelope"] == {"rule": "fixture-envelope-loo-range.v1", "handoffs": 4,
                                            "producer_starts": 2}
    checks = {check["name"]: check["passed"] for check in summary["checks"]}
    assert checks["inside the fixture envelope"] is True
    assert not any(name.endswith("as anchored") for name in checks), checks
    assert sorted(path.name for path in (receipt / "series").glob("envelope-*.safetensors")) == [
        f"envelope-{n}.safetensors" for n in (1, 2, 3)]

    # 4. Every layer's K and V at the last handed-off position scaled by 1.001: inside the drift
    #    bounds, outside the envelope, which alone fails the run.
    faulty = run(checkout, env, "--recipe", "native-text", "--receipts", str(runs), "--reference-once",
                 "--fault", "last-position-scale=1.001")
    assert faulty.returncode == 1, faulty.stdout[-3000:] + faulty.stderr[-3000:]
    summary = summary_of(newest_receipt(runs))
    assert summary["status"] == "failed"
    assert [check["name"] for check in summary["checks"] if not check["passed"]] == ["inside the fixture envelope"]

    # 5. A sealed ceilings digest that does not follow from the basis, re-sealed as a reviewer
    #    might wave it through: every load re-derives the envelope and refuses it.
    sealed["ceilings_sha256"] = "0" * 63 + "1"
    identity_path.write_text(json.dumps(identity, indent=2) + "\n", encoding="utf-8")
    resealed = run(checkout, env, "tools/freeze_identity.py", "--write-sealed")
    assert resealed.returncode == 0, resealed.stderr
    refused = run(checkout, env, "identity", "check", str(identity_path))
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "fixture_envelope.ceilings_sha256" in refused.stderr
    before = set(runs.iterdir())
    refused_run = run(checkout, env, "--recipe", "native-text", "--receipts", str(runs))
    assert refused_run.returncode == 2, refused_run.stderr
    assert summary_of(newest_receipt(runs))["status"] == "refused" and set(runs.iterdir()) != before

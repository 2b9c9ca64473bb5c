"""The published model's default native lane end to end (``qualify --recipe native-text --model
smollm2-135m-instruct-q4_1``): NVFP4 W4A4 parts from the cold recompute at near-ties on a real
model, so its identity is judged teacher-forced (docs/calibration.md section 1b)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.published import NAME

# beside_vllm: .ci/run runs it on the core the vLLM tier leaves idle (tools/test.sh), not in the slow tier.
pytestmark = [pytest.mark.published_model, pytest.mark.slow, pytest.mark.beside_vllm]


def test_the_default_native_lane_on_the_published_model_is_judged_teacher_forced(
        published_model: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A verdict under the teacher-forced rule, whichever it is: the receipt verifies, its exit
    code is its status's, its scope names the rule, and the partings it counts are the samples'
    own, each a near-tie exactly when its cold margin is within the sealed near-tie margin."""
    from qualify.archive.verify import verify_receipt
    from qualify.interfaces import cli

    archive = tmp_path / "receipts"
    archive.mkdir()
    code = cli.main(["--recipe", "native-text", "--model", NAME, "--reference-once", "--receipts", str(archive)])
    out, err = capsys.readouterr()
    receipts = [path for path in archive.iterdir() if not path.name.startswith(".")]
    assert len(receipts) == 1, (out, err)
    assert verify_receipt(receipts[0]) == []
    identity = json.loads((receipts[0] / "identity.json").read_text(encoding="utf-8"))
    logits = identity["onboarding_qualification"]["full_logits"]
    assert identity["lane"] == "nvfp4-native-w4a4" and logits["mode"] == "teacher-forced"
    summary = json.loads((receipts[0] / "validation-summary.json").read_text(encoding="utf-8"))
    assert (summary["status"], code) in (("passed", 0), ("failed", 1)), (out, err)
    judged_by = summary["scope"]["judged_by"]
    assert judged_by["rule"] == "teacher-forced-near-tie.v1"
    margins = []
    for record in sorted((receipts[0] / "samples").glob("sample-*.json")):
        sample = json.loads(record.read_text(encoding="utf-8"))
        teacher = (sample["localisation"] or {}).get("teacher_forced")
        margins += [parting["cold_margin"] for parting in (teacher or {}).get("partings") or []]
    assert margins, "SmolLM2 parts from the cold recompute under NVFP4 W4A4"
    if judged_by["partings"] is not None:  # counted when every handoff ran (a refused sample stops the run)
        assert judged_by["partings"] == len(margins)
        assert judged_by["near_tie_partings"] == sum(margin <= logits["near_tie_margin"] for margin in margins)
    assert "judged teacher-forced by teacher-forced-near-tie.v1" in summary["scope"]["line"]

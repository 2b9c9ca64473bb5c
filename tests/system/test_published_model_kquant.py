"""The published model's k-quant lane end to end (``qualify --recipe kquant-target-plus-dflash --model
smollm2-135m-instruct-q4_1``): rung 3, bit-exact, on any x86-64 host; no vLLM needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.published import NAME

pytestmark = [pytest.mark.published_model, pytest.mark.slow]



def test_the_draftless_kquant_lane_on_the_published_model_qualifies_bit_exact(
        published_model: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rung 3 on SmolLM2: its own weights in Q8_0 on both sides, llama.cpp's exact arithmetic; no
    host pin (the arithmetic is exact by construction), so it qualifies on every x86-64 machine."""
    from qualify.archive.verify import verify_receipt
    from qualify.interfaces import cli

    archive = tmp_path / "receipts"
    archive.mkdir()
    code = cli.main(["--recipe", "kquant-target-plus-dflash", "--model", NAME, "--reference-once", "--receipts", str(archive)])
    out, err = capsys.readouterr()
    receipts = [path for path in archive.iterdir() if not path.name.startswith(".")]
    assert len(receipts) == 1, (out, err)
    assert verify_receipt(receipts[0]) == []
    assert code == 0, (out, err)
    identity = json.loads((receipts[0] / "identity.json").read_text(encoding="utf-8"))
    assert identity["lane"] == "kquant-exact" and identity["speculative_draft"] is None
    samples = sorted((receipts[0] / "samples").glob("sample-*.json"))
    assert len(samples) == 3
    for record in samples:
        sample = json.loads(record.read_text(encoding="utf-8"))
        assert sample["token_agreement_rate"] == 1.0 and sample["max_abs"] == 0.0
        assert sample["handoff_logit_block_sha256"] == sample["cold_logit_block_sha256"]

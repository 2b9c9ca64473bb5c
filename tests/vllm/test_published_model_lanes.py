"""The published model's lanes (``contracts/models/smollm2-135m-instruct-q4_1/``) run end to end
through ``qualify --recipe native-text --model smollm2-135m-instruct-q4_1``: the vLLM CPU producer
lane qualifies on the CPU class its identity pins, and is refused (exit 2, naming the calibrate
command) on any other; either way the run leaves a receipt that verifies. Runs in .venv-vllm
(``pytest -m vllm``), with the model's package installed (``tools/install_vllm.sh``)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.published_model, pytest.mark.slow]

NAME = "smollm2-135m-instruct-q4_1"
LANE = "vllm-to-reference"


@pytest.fixture
def published_model() -> Iterator[None]:
    """The model's package present (failed, not skipped, under QUALIFY_REQUIRE_PUBLISHED_MODELS=1),
    and the process back on the shipped model afterwards (the choice is per process)."""
    pytest.importorskip("vllm")
    from qualify.engines.chosen_model import use_model
    from qualify.engines.model_source import PUBLISHED_MODELS

    published = PUBLISHED_MODELS[NAME]
    try:
        metadata.distribution(published.distribution)
    except metadata.PackageNotFoundError:
        message = f"{published.distribution}=={published.version} is not installed (tools/install_vllm.sh installs it)"
        if os.environ.get("QUALIFY_REQUIRE_PUBLISHED_MODELS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    try:
        yield
    finally:
        use_model(None)


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
    code = cli.main(["--recipe", "native-text", "--producer", "vllm", "--model", NAME, "--receipts", str(archive)])
    out, err = capsys.readouterr()
    receipts = [path for path in archive.iterdir() if not path.name.startswith(".")]
    assert len(receipts) == 1, (out, err)
    assert verify_receipt(receipts[0]) == []
    if pinned != found:
        assert code == 2, (out, err)
        assert f"qualify calibrate --recipe native-text --lane {LANE}" in err
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


def test_the_draftless_kquant_lane_on_the_published_model_qualifies_bit_exact(
        published_model: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rung 3 on SmolLM2: its own weights in Q8_0 on both sides, llama.cpp's exact arithmetic; no
    host pin (the arithmetic is exact by construction), so it qualifies on every x86-64 machine."""
    from qualify.archive.verify import verify_receipt
    from qualify.interfaces import cli

    archive = tmp_path / "receipts"
    archive.mkdir()
    code = cli.main(["--recipe", "kquant-target-plus-dflash", "--model", NAME, "--receipts", str(archive)])
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

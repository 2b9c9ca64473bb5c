"""The transformers engine's known-answer digest (KAT), on the CPU with the shipped model.

``transformers-torch`` is a measured KAT engine (``qualify.engines.kat.MEASURED_ENGINE_NAMES``): its
GPU identities pin the digest measured on their GPU, and the producer process checks it before it is
ready. Here, on the CPU in float32 (one torch thread): the digest is the same for two builds in one
process, moves under a one-ULP change of one weight, and an identity pinning none is refused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # a shared 2-core machine: keep BLAS to one thread

import pytest

from qualify.core import assets
from qualify.core.errors import Refused
from qualify.engines.kat import (
    KAT_ENGINE_NAMES,
    MEASURED_ENGINE_NAMES,
    check_known_answer,
    check_pinned,
    has_known_answer,
    known_answer_sha256,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUDGED = "model.layers.2.mlp.down_proj.weight"
"""The weight one element of which is moved by one ULP (the projection test_kat.py nudges)."""


def build() -> object:
    from qualify.engines.transformers_engine import TransformersEngine

    return TransformersEngine(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def engine() -> object:
    return build()


@pytest.fixture(scope="module")
def digest(engine: object) -> str:
    return known_answer_sha256(engine)


def test_the_transformers_engine_is_a_measured_known_answer_engine(engine: object) -> None:
    assert engine.name == "transformers-torch"  # type: ignore[attr-defined]
    assert engine.name in MEASURED_ENGINE_NAMES and engine.name in KAT_ENGINE_NAMES  # type: ignore[attr-defined]
    assert has_known_answer(engine)


def test_the_known_answer_is_the_same_for_two_builds_in_one_process(engine: object, digest: str) -> None:
    assert known_answer_sha256(engine) == digest  # the same build again
    second = build()
    assert known_answer_sha256(second) == digest
    check_known_answer(second, digest, "producer")  # what the producer process runs before it is ready


def test_a_one_ulp_change_of_one_weight_moves_the_known_answer(digest: str) -> None:
    import torch

    changed = build()
    weight = changed.model.get_parameter(NUDGED)  # type: ignore[attr-defined]
    before = weight.data[0, 0].clone()
    weight.data[0, 0] = torch.nextafter(before, torch.tensor(float("inf"), dtype=before.dtype))
    assert weight.data[0, 0].item() != before.item()
    assert changed.abi == build().abi  # type: ignore[attr-defined]  # what a version pin would see: the same
    assert known_answer_sha256(changed) != digest
    with pytest.raises(Refused, match=rf"^producer engine transformers-torch \(.*\): known-answer digest: "
                                      rf"expected {digest}, found [0-9a-f]{{64}}: .* torch .*"):
        check_known_answer(changed, digest, "producer")


def test_an_engine_started_with_no_pinned_known_answer_is_refused(engine: object) -> None:
    with pytest.raises(Refused, match="^producer engine transformers-torch: known-answer digest: pinned none"):
        check_known_answer(engine, None, "producer")


@pytest.mark.parametrize("lane", ["transformers-cuda-fp32", "transformers-cuda-tf32", "transformers-cuda-bf16"])
def test_a_gpu_identity_without_its_producers_known_answer_is_refused_naming_the_field(
        lane: str, tmp_path: Path) -> None:
    """What 'identity sealed' runs on the producer pin (``qualify.run.run_contract``): an identity of
    a transformers lane that pins no producer KAT is refused in one line naming the field."""
    document = json.loads((assets.CONTRACTS_DIR / f"{lane}-identity-v1.json").read_bytes())
    producer = document["producer_engine"]
    assert producer["name"] == "transformers-torch"
    with pytest.raises(Refused, match=rf"^identity {lane}: producer_engine.kat_sha256: pinned none, expected the "
                                      r"transformers-torch engine's known-answer digest \(re-freeze the identity\)$"):
        check_pinned(producer["name"], None, "producer", f"identity {lane}")


def test_measuring_without_the_gpu_the_lanes_pin_is_refused_in_one_line(tmp_path: Path) -> None:
    """``tools/measure_known_answer.py`` measures only where the lane's producer runs: here (no CUDA
    device visible) it is refused in one line (exit 2) and writes nothing."""
    import subprocess
    import sys

    out = tmp_path / "known-answers.json"
    completed = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[2] / "tools" / "measure_known_answer.py"),
                                "--lane", "transformers-cuda-bf16", "--out", str(out)],
                               env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True,
                               timeout=300, check=False)
    assert completed.returncode == 2, completed.stderr
    assert completed.stderr == ("measure_known_answer: refused: transformers engine device: 'cuda' requested but "
                                "torch sees no CUDA device\n")
    assert not out.exists()

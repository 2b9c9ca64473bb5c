"""The ``transformers`` CUDA lanes: a GPU producer handing KV to the CPU reference consumer.

Without a GPU (CI): each lane's consumer is the float32 reference engine, its producer is refused
with one line naming CUDA, and a qualification of its shipped identity fails closed with a
receipt. With a GPU (``pytest -m cuda`` on the GPU machine): each shipped identity qualifies, and
a K block-order fault in the bf16 lane's handoff is caught and localised.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from qualify.contract.identity import load_identity
from qualify.contract.lanes import TRANSFORMERS_LANE_SETTINGS, ProducerMode, lane_spec, target_cache_identity
from qualify.core import assets
from qualify.core.errors import Refused
from qualify.engines.factory import build_cache_identity, build_consumer, build_producer, checkpoint_digests
from qualify.engines.reference import ReferenceEngine

LANES = sorted(TRANSFORMERS_LANE_SETTINGS)


def identity_path(lane: str) -> Path:
    return assets.CONTRACTS_DIR / f"{lane}-identity-v1.json"


def qualify_cli(receipts: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qualify.interfaces.cli", "--recipe", "native-text",
                           "--receipts", str(receipts), *args], cwd=assets.REPO_ROOT,
                          env=dict(os.environ, **(env or {})), capture_output=True, text=True,
                          timeout=600, check=False)


def only_receipt(receipts: Path) -> Path:
    made = sorted(path for path in receipts.iterdir() if path.is_dir())
    assert len(made) == 1, made
    return made[0]


@pytest.mark.parametrize("lane", LANES)
def test_identity_pins_the_gpu_producer_and_the_cpu_reference_consumer(lane: str) -> None:
    identity = load_identity(identity_path(lane))
    settings = TRANSFORMERS_LANE_SETTINGS[lane]
    abi = identity.producer_engine.abi
    assert identity.producer_engine.name == "transformers-torch"
    assert f"+{settings.dtype}+tf32-{'on' if settings.tf32 else 'off'}+" in abi and "+cuda-" in abi
    assert identity.consumer_engine.name == "reference-numpy"
    # The cache identity follows from the pinned producer ABI; on a GPU the factory derives it too.
    spec = lane_spec(lane)
    assert target_cache_identity(spec, checkpoint_digests(spec.kind), abi) == identity.target_cache_identity_sha256


def test_the_three_lanes_have_distinct_bounds_ordered_by_precision() -> None:
    bounds = {lane: load_identity(identity_path(lane)).onboarding_qualification.full_logits for lane in LANES}
    fp32, tf32, bf16 = (bounds[f"transformers-cuda-{name}"] for name in ("fp32", "tf32", "bf16"))
    assert fp32.maximum_absolute < tf32.maximum_absolute < bf16.maximum_absolute
    assert fp32.maximum_mean_absolute < tf32.maximum_mean_absolute < bf16.maximum_mean_absolute


@pytest.mark.parametrize("lane", LANES)
def test_consumer_is_the_default_reference_engine(lane: str) -> None:
    consumer = build_consumer(lane_spec(lane))
    default = ReferenceEngine.from_model_dir()
    assert (consumer.name, consumer.abi) == (default.name, default.abi)
    assert consumer.mode is ProducerMode.NATIVE


@pytest.mark.torch
@pytest.mark.parametrize("lane", LANES)
def test_producer_without_a_gpu_is_refused_naming_cuda(lane: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(Refused, match="'cuda' requested but torch sees no CUDA device"):
        build_producer(lane, ProducerMode.NATIVE)
    with pytest.raises(Refused, match="'cuda' requested but torch sees no CUDA device"):
        build_cache_identity(lane_spec(lane))
    with pytest.raises(Refused, match="transformers lanes run in native mode only"):
        build_producer(lane, ProducerMode.EXACT)


@pytest.mark.torch
def test_qualification_without_a_gpu_is_refused_at_the_first_step(tmp_path: Path) -> None:
    """The identity pins a GPU this host lacks: refused (exit 2) before any producer starts."""
    lane = "transformers-cuda-bf16"
    completed = qualify_cli(tmp_path, "--identity", str(identity_path(lane)), env={"CUDA_VISIBLE_DEVICES": ""})
    assert completed.returncode == 2, completed.stdout[-2000:] + completed.stderr
    refusal = " ".join(completed.stdout.split())
    assert "✗ identity sealed" in refusal and "sees no CUDA device" in refusal
    assert "producer ready" in refusal and "blocked: step 'identity sealed' failed" in refusal



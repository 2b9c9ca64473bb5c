"""The vLLM lanes on Llama 3.x and Qwen2.x (issue 37): vLLM's CPU engine loads the float32
directory the harness writes for a chosen model (``qualify.engines.chosen_model.hf_float32_dir``:
its architecture, RoPE scaling, untied head and biases), and the KV it hands off matches the
numpy reference engine's to float32 rounding; the reference decodes from either the same logits.
The checkpoints are the torch tests' tiny random ones (``tests/torch/test_architectures.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from qualify.contract.lanes import ProducerMode
from qualify.core import assets
from qualify.engines import chosen_model
from tests.torch.test_architectures import write_tiny_checkpoint

PREFIX, DECODE = 250, 16
KV_TOLERANCE = 1e-4  # measured 0.9-1.5e-5 on K and V of magnitude ~5
LOGIT_TOLERANCE = 1e-4  # measured 0.5-1.0e-5


@pytest.fixture(autouse=True)
def shipped_model_again() -> Iterator[None]:
    yield
    chosen_model.use_model(None)


@pytest.mark.parametrize("kind", ["llama3", "mistral", "qwen2"])
def test_vllm_hands_off_the_references_kv_on_the_architecture(kind: str, tmp_path: Path) -> None:
    from qualify.engines.factory import build_producer

    directory = tmp_path / f"{kind}-tiny"
    write_tiny_checkpoint(kind, directory)
    chosen_model.use_model(str(directory))
    prompt = assets.load_prompt()[:PREFIX + DECODE]
    handed_off = build_producer("vllm-to-reference", ProducerMode.NATIVE).prefill(prompt[:PREFIX])
    positions = handed_off.geometry.positions  # whole vLLM blocks of the prefix
    reference = chosen_model.reference_engine()
    own = reference.prefill(prompt[:positions])
    for layer, (k, v, own_k, own_v) in enumerate(zip(handed_off.keys, handed_off.values, own.keys, own.values,
                                                     strict=True)):
        assert np.abs(k - own_k).max() < KV_TOLERANCE and np.abs(v - own_v).max() < KV_TOLERANCE, (kind, layer)
    cold = reference.decode(own, prompt[positions:PREFIX], DECODE)
    forced = reference.teacher_forced(handed_off, prompt[positions:PREFIX], cold.tokens)
    assert np.abs(forced - cold.logits).max() < LOGIT_TOLERANCE, kind

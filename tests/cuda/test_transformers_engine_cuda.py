"""The transformers engine on a GPU: a CUDA producer into the CPU reference consumer, and a CUDA consumer's decode."""

from __future__ import annotations

import numpy as np
import pytest

from qualify.core.kv import KVCache
from qualify.engines.base import DecodeResult
from qualify.engines.reference import ReferenceEngine
from tests.torch import test_transformers_engine
from tests.torch.test_transformers_engine import (
    DECODE,
    HANDOFF,
    LOGIT_TOLERANCE,
    compare,
    max_kv_delta,
)

# Its fixtures, bound by assignment (an import only a parameter uses reads as unused to the linter).
reference_kv = test_transformers_engine.reference_kv
reference_cold = test_transformers_engine.reference_cold

pytestmark = pytest.mark.usefixtures("one_torch_thread")



@pytest.mark.parametrize(("dtype", "tf32"), [("float32", False), ("float32", True), ("bfloat16", False)])
def test_cuda_producer_into_cpu_reference_decode(
        dtype: str, tf32: bool, reference: ReferenceEngine, prompt: np.ndarray,
        reference_kv: KVCache, reference_cold: DecodeResult) -> None:
    from qualify.engines.transformers_engine import TransformersEngine

    producer = TransformersEngine(device="cuda", dtype=dtype, tf32=tf32)
    assert f"+{dtype}+tf32-{'on' if tf32 else 'off'}+" in producer.abi and "+cuda-" in producer.abi
    kv = producer.prefill(prompt[:HANDOFF])
    assert kv.geometry == reference_kv.geometry
    key_delta, value_delta = max_kv_delta(kv, reference_kv)
    handed = reference.decode(kv, prompt[HANDOFF:], DECODE)
    print(f"cuda {dtype} tf32={tf32}: max abs K delta {key_delta:.3e}, V delta {value_delta:.3e}")
    matching, delta = compare(f"cuda {dtype} tf32={tf32} KV -> reference decode vs reference cold",
                              handed, reference_cold)
    assert np.isfinite(handed.logits).all()
    if dtype == "float32" and not tf32:
        assert key_delta < 1e-3 and value_delta < 1e-3
        assert matching == DECODE and delta < LOGIT_TOLERANCE


def test_cuda_consumer_decode_equals_teacher_forced(prompt: np.ndarray, reference_kv: KVCache,
                                                    reference_cold: DecodeResult) -> None:
    from qualify.engines.transformers_engine import TransformersEngine

    consumer = TransformersEngine(device="cuda", dtype="float32")
    handed = consumer.decode(reference_kv, prompt[HANDOFF:], DECODE)
    forced = consumer.teacher_forced(reference_kv, prompt[HANDOFF:], handed.tokens)
    matching, _ = compare("reference KV -> cuda fp32 decode vs reference cold", handed, reference_cold)
    assert forced.tobytes() == handed.logits.tobytes()
    assert matching == DECODE

"""The run's two comparers measure the same thing: the host (numpy) comparer and the device
(torch) comparer give the same comparison of one handoff, and a deferred comparer calls the
run's ``meanwhile`` once per compare, before its result is asked for."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the device comparer needs torch (the torch extra)")

from qualify.evidence.compare import parse_logit_transform  # noqa: E402
from qualify.evidence.comparers import ComparerSetup, DeviceComparer, HostComparer  # noqa: E402

SHAPE = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256,
             max_positions=128, rope_theta=10000.0, rms_norm_eps=1e-5, tied_embeddings=False)


def _setup() -> tuple[ComparerSetup, object]:
    from qualify.engines.torch_llama import LlamaShape, TorchLlama, random_weights

    torch.set_num_threads(1)
    engine = TorchLlama(random_weights(LlamaShape(**SHAPE), seed=7, dtype="float32", device="cpu"),
                        max_decode_steps=8, cuda_graph=False)
    prompt = np.random.default_rng(3).integers(0, SHAPE["vocab"], size=40, dtype=np.int64)
    return ComparerSetup(consumer=engine, prompt=prompt, handoff_positions=39, output_tokens=8,
                         transform=parse_logit_transform("raw"), maximum_absolute=1.0,
                         maximum_mean_absolute=0.1, reference_once=True), engine


def _compare(comparer, kv, pending):
    calls = []
    comparer.reference()
    compared = comparer.compare(kv, pending, meanwhile=lambda: calls.append("meanwhile"))
    assert calls == ["meanwhile"]
    return compared.result(), compared.seconds


def test_host_and_device_comparers_agree_on_a_drifted_handoff() -> None:
    setup, engine = _setup()
    kv = engine.prefill(setup.prompt[:setup.handoff_positions])
    kv.keys[1][0, 5, 3] += 0.25  # a drift the comparison must see, in both places
    pending = setup.prompt[setup.handoff_positions:]
    host, host_seconds = _compare(HostComparer(setup), kv, pending)
    device = DeviceComparer(setup, engine, "cpu", digest_threads=2)
    try:
        on_device, device_seconds = _compare(device, kv, pending)
    finally:
        device.close()
    assert host.delta.max_abs > 0
    assert on_device.delta.max_abs == host.delta.max_abs
    assert on_device.delta.mean_abs == pytest.approx(host.delta.mean_abs, rel=1e-5)
    assert on_device.handoff_digests == host.handoff_digests and on_device.cold_digests == host.cold_digests
    assert on_device.token_agreement_rate == host.token_agreement_rate
    assert {"decode", "compare"} <= set(host_seconds) and {"install", "decode", "compare"} <= set(device_seconds)
    assert device.engine_seconds["reference decode"] and device.engine_seconds["consumer decode"]


def test_an_exact_handoff_compares_to_zero_on_the_device() -> None:
    setup, engine = _setup()
    kv = engine.prefill(setup.prompt[:setup.handoff_positions])
    device = DeviceComparer(setup, engine, "cpu", digest_threads=2)
    try:
        comparison, _ = _compare(device, kv, setup.prompt[setup.handoff_positions:])
    finally:
        device.close()
    assert comparison.delta.max_abs == 0.0 and comparison.first_logit_digest_mismatch is None
    assert comparison.handoff_digests == comparison.cold_digests


def _timed_compare(comparer, kv, pending):
    import time

    started = time.perf_counter()
    compared = comparer.compare(kv, pending, meanwhile=lambda: None)
    result = compared.result()
    return result, compared.seconds, time.perf_counter() - started


@pytest.mark.parametrize("reference_once", [True, False])
def test_a_diverging_handoff_is_teacher_forced_and_timed_alike_on_host_and_device(reference_once: bool) -> None:
    import dataclasses

    from qualify.evidence.compare import compare_kv, first_row_over_rule

    setup, engine = _setup()
    setup = dataclasses.replace(setup, reference_once=reference_once, maximum_absolute=1e-3, maximum_mean_absolute=1e-4)
    own = engine.prefill(setup.prompt[:setup.handoff_positions])
    kv = engine.prefill(setup.prompt[:setup.handoff_positions])
    for layer in range(SHAPE["layers"]):
        kv.values[layer][:] *= -4.0  # far enough to part the greedy tokens
    pending = setup.prompt[setup.handoff_positions:]
    results = {}
    for name, comparer in (("host", HostComparer(setup)), ("device", DeviceComparer(setup, engine, "cpu", digest_threads=2))):
        try:
            comparer.reference()
            first = _timed_compare(comparer, kv, pending)
            second = _timed_compare(comparer, kv, pending)
        finally:
            comparer.close()
        results[name] = first[0]
        for result, seconds, wall in (first, second):
            assert result.first_divergence is not None and result.teacher_forced is not None
            assert all(0.0 <= taken <= wall for taken in seconds.values()), (name, seconds, wall)
            assert "teacher_forced" in seconds
        if name == "host":  # the first handoff meets the reference step's cold branch; later ones their own
            assert "recompute" not in first[1]
            assert ("recompute" in second[1]) is (not reference_once)
    host, device = results["host"], results["device"]
    assert device.teacher_forced.max_abs == host.teacher_forced.max_abs > 0
    assert host.delta.first_row_over_rule == first_row_over_rule(
        host.delta.row_max_abs, host.delta.row_mean_abs, 1e-3, 1e-4) == 0
    expected = compare_kv(kv.keys, kv.values, own.keys, own.values)
    for found in (host.kv, device.kv):
        assert [(layer.k, layer.v) for layer in found.layers] == [(layer.k, layer.v) for layer in expected.layers]
    assert max(layer.v for layer in host.kv.layers) > 0 and max(layer.k for layer in host.kv.layers) == 0.0

"""The compact torch Llama's CUDA-graph decode on a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from tests.torch.test_torch_llama import tiny_shape

pytestmark = pytest.mark.usefixtures("one_torch_thread")



def test_cuda_graph_decode_equals_eager_decode() -> None:
    """The captured step replayed equals the same step run eagerly, bit for bit (bf16 weights),
    and decode equals teacher forcing on its own tokens on the graph path too."""
    import torch

    from qualify.engines.torch_llama import TorchLlama, random_weights

    weights = random_weights(tiny_shape(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=4096,
                                        max_positions=1024), seed=5, dtype="bfloat16", device="cuda")
    graph = TorchLlama(weights, cache_positions=600, max_decode_steps=64)
    eager = graph.sharing_weights(cuda_graph=False)
    assert graph.use_graph and not eager.use_graph and "+cudagraph" in graph.abi and "+head-f32-" in graph.abi
    prompt = torch.from_numpy(np.random.default_rng(1).integers(0, 4096, 513)).cuda()
    results = []
    for engine in (graph, eager):
        engine.prefill_device(prompt[:512])
        run = engine.decode_device(prompt[512:], 64)
        results.append((run.tokens.clone(), run.logits.clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    forced = graph.decode_device(prompt[512:], 64, forced=results[0][0])
    assert torch.equal(forced.logits, results[0][1])

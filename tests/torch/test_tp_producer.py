"""A TP=2 producer (qualify.engines.torch_llama_tp) handing its KV to a TP=1 consumer, on the CPU.

Two gloo processes (torch.multiprocessing spawn, one torch thread each) prefill a tiny float32
random Llama tensor-parallel and gather their KV shards to rank 0; the test process re-lays them
out for TP=1 and compares them with TorchLlama's own TP=1 prefill of the same prompt. Two shapes:
kv_heads=2 (one KV head per rank) and kv_heads=1 < world size 2 (the head replicated on both
ranks). The honest handoff agrees with TP=1 within KV_TOLERANCE; each of the three gather faults
is caught and localised to its layer, K/V and KV head, or, where a fault cannot change anything
(permuting identical replicas; the per-rank head count without replication), the KV is the
honest one.

Why a tolerance, not bit equality: layer 0's K and V are computed before any all-reduce and
are bit-equal (asserted); after it each row-parallel product (Wo, W2) is two half-width partial
products summed by all_reduce, where TP=1 is one full-width product, so float32 rounding differs
in the last bits and the difference propagates through the later layers. Measured on these
shapes with torch 2.13 CPU: max abs delta 1.5e-7 (kv_heads=2) and 1.2e-7 (kv_heads=1), a few
float32 ulps; KV_TOLERANCE is ~70x that, and every fault moves some KV by more than 1e-2.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]

WORLD_SIZE = 2
PROMPT_TOKENS = 24
KV_TOLERANCE = 1e-5
FAULT_LAYER = 1  # the permutation fault's layer (of 3): not the first, so localisation is tested
SEED = 7


def tiny_shape(kv_heads: int) -> Any:
    from qualify.engines.torch_llama import LlamaShape

    return LlamaShape(layers=3, hidden=64, heads=4, kv_heads=kv_heads, head_dim=16, intermediate=128,
                      vocab=256, max_positions=64, rope_theta=10000.0, rms_norm_eps=1e-5,
                      tied_embeddings=False)


def prompts() -> tuple[Any, Any]:
    """The request's prompt and another request's (same length, other tokens)."""
    generator = torch.Generator().manual_seed(SEED)
    return (torch.randint(0, 256, (PROMPT_TOKENS,), generator=generator),
            torch.randint(0, 256, (PROMPT_TOKENS,), generator=generator))


def tp_worker(rank: int, kv_heads: int, rendezvous: str, out: str) -> None:
    """One gloo rank: draw the weights, prefill both prompts TP=2, gather the shards to rank 0,
    which saves them."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from qualify.engines.torch_llama import random_weights
    from qualify.engines.torch_llama_tp import TPPrefill

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD_SIZE)
    try:
        producer = TPPrefill(random_weights(tiny_shape(kv_heads), seed=SEED, dtype="float32", device="cpu"))
        gathered = [producer.gather_to_rank0(producer.prefill(tokens)) for tokens in prompts()]
        if rank == 0:
            torch.save({"shards": gathered[0], "other_shards": gathered[1],
                        "sharding": producer.sharding}, out)
    finally:
        dist.destroy_process_group()


def tp_run(kv_heads: int, directory: Path) -> dict[str, Any]:
    """Spawn the two ranks; rank 0's gathered shards, the sharding record, and the TP=1 prefill."""
    import torch.multiprocessing as mp

    from qualify.engines.torch_llama import TorchLlama, random_weights

    out = directory / "shards.pt"
    mp.spawn(tp_worker, args=(kv_heads, str(directory / "rendezvous"), str(out)), nprocs=WORLD_SIZE)
    result: dict[str, Any] = torch.load(out, weights_only=False)
    consumer = TorchLlama(random_weights(tiny_shape(kv_heads), seed=SEED, dtype="float32", device="cpu"),
                          cache_positions=PROMPT_TOKENS + 1, cuda_graph=False)
    consumer.prefill_device(prompts()[0])
    result["tp1"] = consumer.cache[:, :, :, :PROMPT_TOKENS].clone()  # [layers, 2, kv_heads, T, hd]
    return result


@pytest.fixture(scope="module")
def two_kv_heads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return tp_run(2, tmp_path_factory.mktemp("tp-kv2"))


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return tp_run(1, tmp_path_factory.mktemp("tp-kv1"))


def first_site(kv: Any, run: dict[str, Any]) -> Any:
    from qualify.evidence.kv_heads import first_head_over

    return first_head_over(kv, run["tp1"], KV_TOLERANCE)


# ---- the sharding record -------------------------------------------------------------------


def test_sharding_record_names_which_rank_holds_which_kv_head(two_kv_heads: dict[str, Any],
                                                               one_kv_head: dict[str, Any]) -> None:
    assert two_kv_heads["sharding"].as_dict() == {
        "world_size": 2, "heads": 4, "kv_heads": 2, "heads_per_rank": 2, "kv_heads_per_rank": 1,
        "replicas": 1, "rank_kv_heads": [[0], [1]]}
    assert one_kv_head["sharding"].as_dict() == {
        "world_size": 2, "heads": 4, "kv_heads": 1, "heads_per_rank": 2, "kv_heads_per_rank": 1,
        "replicas": 2, "rank_kv_heads": [[0], [0]]}


def test_a_split_that_does_not_divide_is_refused() -> None:
    from qualify.core.errors import Refused
    from qualify.engines.torch_llama_tp import tp_sharding

    with pytest.raises(Refused, match="does not divide heads 4"):
        tp_sharding(tiny_shape(2), 3)
    twelve_heads = replace(tiny_shape(1), heads=12, kv_heads=3)
    with pytest.raises(Refused, match="does not divide kv_heads 3"):
        tp_sharding(twelve_heads, 2)
    with pytest.raises(Refused, match="kv_heads 3 does not divide it"):
        tp_sharding(twelve_heads, 4)


# ---- the honest handoff --------------------------------------------------------------------


@pytest.mark.parametrize("shape_name", ["two_kv_heads", "one_kv_head"])
def test_honest_gather_equals_the_tp1_prefill(shape_name: str, request: pytest.FixtureRequest) -> None:
    from qualify.engines.torch_llama_tp import relayout_to_tp1

    run = request.getfixturevalue(shape_name)
    gathered = relayout_to_tp1(run["shards"], run["sharding"])
    assert gathered.replica_disagreement is None
    assert gathered.kv.shape == run["tp1"].shape
    assert torch.equal(gathered.kv[0], run["tp1"][0])  # before any all_reduce: bit-equal
    assert float((gathered.kv - run["tp1"]).abs().max()) <= KV_TOLERANCE
    assert first_site(gathered.kv, run) is None


def test_per_layer_maxima_agree_with_compare_kv(two_kv_heads: dict[str, Any]) -> None:
    """The per-head deltas refine compare_kv's per-layer ones: their per-layer maxima are its."""
    from qualify.engines.torch_llama_tp import permute_heads_across_ranks, relayout_to_tp1
    from qualify.evidence.compare import compare_kv
    from qualify.evidence.kv_heads import kv_head_deltas

    run = two_kv_heads
    faulty = relayout_to_tp1(permute_heads_across_ranks(run["shards"], run["sharding"], layer=FAULT_LAYER),
                             run["sharding"]).kv
    per_head = kv_head_deltas(faulty, run["tp1"])
    numpy_kv = [[t.numpy() for t in tensors] for tensors in (faulty[:, 0], faulty[:, 1],
                                                              run["tp1"][:, 0], run["tp1"][:, 1])]
    per_layer = compare_kv(*numpy_kv).layers
    for layer, delta in enumerate(per_layer):
        assert delta.k == pytest.approx(per_head[layer, 0].max(), rel=1e-6)
        assert delta.v == pytest.approx(per_head[layer, 1].max(), rel=1e-6)


# ---- the three faults ----------------------------------------------------------------------


def test_head_permutation_across_ranks_is_localised(two_kv_heads: dict[str, Any]) -> None:
    from qualify.engines.torch_llama_tp import permute_heads_across_ranks, relayout_to_tp1

    run = two_kv_heads
    faulty = relayout_to_tp1(permute_heads_across_ranks(run["shards"], run["sharding"], layer=FAULT_LAYER),
                             run["sharding"])
    site = first_site(faulty.kv, run)
    assert site is not None and (site.layer, site.kind, site.kv_head) == (FAULT_LAYER, "K", 0)
    assert site.position == 0 and site.max_abs > 1e-2


def test_head_permutation_of_replicas_changes_nothing(one_kv_head: dict[str, Any]) -> None:
    from qualify.engines.torch_llama_tp import permute_heads_across_ranks, relayout_to_tp1

    run = one_kv_head
    faulty = relayout_to_tp1(permute_heads_across_ranks(run["shards"], run["sharding"], layer=FAULT_LAYER),
                             run["sharding"])
    honest = relayout_to_tp1(run["shards"], run["sharding"])
    assert faulty.replica_disagreement is None and torch.equal(faulty.kv, honest.kv)


def test_shard_from_another_request_is_localised_to_that_ranks_heads(two_kv_heads: dict[str, Any]) -> None:
    from qualify.engines.torch_llama_tp import relayout_to_tp1, shard_from_other_request

    run = two_kv_heads
    faulty = relayout_to_tp1(shard_from_other_request(run["shards"], run["other_shards"], rank=1), run["sharding"])
    site = first_site(faulty.kv, run)
    # Rank 1 holds KV head 1; the prompts differ at position 0, so layer 0 K differs there.
    assert site is not None and (site.layer, site.kind, site.kv_head, site.position) == (0, "K", 1, 0)
    assert faulty.replica_disagreement is None


def test_stale_replica_is_caught_by_the_replica_check(one_kv_head: dict[str, Any]) -> None:
    """With the head replicated, re-layout reads rank 0's copy, so the KV itself is honest; the
    stale replica on rank 1 is caught by the check that replicas agree, at its layer and head."""
    from qualify.engines.torch_llama_tp import relayout_to_tp1, shard_from_other_request

    run = one_kv_head
    faulty = relayout_to_tp1(shard_from_other_request(run["shards"], run["other_shards"], rank=1), run["sharding"])
    assert first_site(faulty.kv, run) is None
    site = faulty.replica_disagreement
    assert site is not None and (site.layer, site.kind, site.kv_head, site.position) == (0, "K", 0, 0)
    # Rank 0's shard from the other request is not hidden either: the KV itself is wrong.
    wrong_first = relayout_to_tp1(shard_from_other_request(run["shards"], run["other_shards"], rank=0),
                                  run["sharding"])
    site = first_site(wrong_first.kv, run)
    assert site is not None and (site.layer, site.kind, site.kv_head) == (0, "K", 0)


def test_per_rank_head_count_is_localised_under_replication(one_kv_head: dict[str, Any]) -> None:
    """SGLang #22145: rank 1's replica lands one head row on, i.e. on the next token's row of the
    one head, so head 0 reads positions shifted by one from position 1 on."""
    from qualify.engines.torch_llama_tp import place_by_per_rank_head_count

    run = one_kv_head
    faulty = place_by_per_rank_head_count(run["shards"], run["sharding"])
    site = first_site(faulty, run)
    assert site is not None and (site.layer, site.kind, site.kv_head, site.position) == (0, "K", 0, 1)


def test_per_rank_head_count_is_harmless_without_replication(two_kv_heads: dict[str, Any]) -> None:
    from qualify.engines.torch_llama_tp import place_by_per_rank_head_count, relayout_to_tp1

    run = two_kv_heads
    placed = place_by_per_rank_head_count(run["shards"], run["sharding"])
    assert torch.equal(placed, relayout_to_tp1(run["shards"], run["sharding"]).kv)

"""A TP=2 producer hands its KV to a TP=1 consumer: gather, re-layout, compare, decode, three faults.

Each rank of a ``torch.distributed`` group (NCCL on GPUs, gloo on the CPU) draws the same random
weights, prefills the prompt tensor-parallel (:class:`qualify.engines.torch_llama_tp.TPPrefill`)
and gathers its KV shard to rank 0, which re-lays the shards out for TP=1 and compares them with
a TP=1 :class:`~qualify.engines.torch_llama.TorchLlama` prefill of the same prompt on the same
weights, per layer, K/V and KV head (:mod:`qualify.evidence.kv_heads`). Two KV-head counts run:
the model's own (Llama-3 8B: 8 KV heads, 4 per rank) and 1, fewer KV heads than ranks, so each is
replicated on both.

What equality to expect: the TP KV is not bit-equal to TP=1's after layer 0. Every row-parallel
product (Wo, W2) is two half-width partial products summed by all_reduce where TP=1 has one
full-width product, so the summation order, and in bf16 the roundings of the residual stream,
differ. The bench reports the max abs KV delta per layer and whether greedy decode of
``--decode`` tokens from the handed-off KV matches the TP=1 consumer's decode from its own
prefill (bf16 at 8B: expect small deltas growing with depth, and tokens that may part where a
top-1/top-2 margin is within that noise; float32 on the CPU: deltas of a few ulps, tokens equal).

The honest per-site deltas are the envelope the faults are judged against: a fault is caught
where some (layer, K/V, KV head) exceeds ENVELOPE_FACTOR times its honest delta plus
ENVELOPE_FLOOR, or where replicas of a KV head disagree; it is localised when the first such site
is the one the fault was applied at. Faults (:mod:`qualify.engines.torch_llama_tp`), each where
it can change something: a head permutation across ranks (layer FAULT_LAYER, without
replication: with one KV head on both ranks there is nothing to permute), rank 1's shard from
another request (both), and the SGLang #22145 per-rank head count (only under replication:
without it per-rank times world size is the total).

The sharding record goes to ``--json`` beside the results: the handoff manifest (v4) has no
field for it, so it is a sidecar.

    torchrun --nproc-per-node 2 bench/gpu_tp_handoff.py [--json PATH]            # 2 GPUs, NCCL, 8B shape
    torchrun --nproc-per-node 2 bench/gpu_tp_handoff.py --backend gloo --device cpu --tiny

Last line: ``tp_handoff_faults_localised: <localised>/3``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np
import torch
import torch.distributed as dist

from qualify.core.errors import Refused, one_line
from qualify.engines.torch_llama import LlamaShape, TorchLlama, random_model, random_weights
from qualify.engines.torch_llama_tp import (
    KVHeadSite,
    TPPrefill,
    permute_heads_across_ranks,
    place_by_per_rank_head_count,
    relayout_to_tp1,
    shard_from_other_request,
)
from qualify.evidence.kv_heads import first_head_over, kv_head_deltas

CONFIG = REPO_ROOT / "model" / "llama3-8b-shape" / "config.json"
TINY = LlamaShape(layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256,
                  max_positions=4096, rope_theta=500000.0, rms_norm_eps=1e-5, tied_embeddings=False)
TINY_SEED = 7
PROMPT_SEED = 20261219
ENVELOPE_FACTOR = 4.0
ENVELOPE_FLOOR = 1e-6
FAULT_LAYER = 2
STALE_RANK = 1
FAULTS = ("head permutation across ranks", "rank shard from another request", "per-rank KV head count")


def log(*parts: object) -> None:
    if dist.get_rank() == 0:
        print(*parts, flush=True)


def prompts(vocab: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The request's prompt (``count`` handed off + 1 pending) and another request's: seeded
    random token ids, the other's first token different so the two differ from position 0."""
    generator = torch.Generator().manual_seed(PROMPT_SEED)
    prompt = torch.randint(0, vocab, (count + 1,), generator=generator)
    other = torch.randint(0, vocab, (count,), generator=generator)
    other[0] = (prompt[0] + 1) % vocab
    return prompt, other


def check_same_weights(fingerprint: str) -> None:
    """Refuse unless every rank drew the same weights (a seeded draw is per device kind)."""
    fingerprints: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(fingerprints, fingerprint)
    if len(set(fingerprints)) != 1:
        raise Refused(f"ranks drew different weights: {fingerprints}")


def site_text(site: KVHeadSite | None) -> str:
    return "not caught" if site is None else str(site)


def run_shape(shape: LlamaShape, seed: int, dtype: str, device: str, prompt_tokens: int, decode: int
              ) -> dict[str, Any] | None:
    """One KV-head count: TP prefill and gather on every rank; the rest on rank 0 (None elsewhere)."""
    weights = random_weights(shape, seed=seed, dtype=dtype, device=device)
    check_same_weights(weights.fingerprint())
    prompt, other = prompts(shape.vocab, prompt_tokens)
    producer = TPPrefill(weights)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    sync()
    began = time.perf_counter()
    shards = producer.gather_to_rank0(producer.prefill(prompt[:prompt_tokens]))
    sync()
    tp_seconds = time.perf_counter() - began
    other_shards = producer.gather_to_rank0(producer.prefill(other))
    if shards is None or other_shards is None:
        return None
    sharding = producer.sharding
    del producer

    cold = TorchLlama(weights, cache_positions=prompt_tokens + decode, max_decode_steps=decode)
    cold.prefill_device(prompt[:prompt_tokens])
    own = cold.cache[:, :, :, :prompt_tokens].clone()  # [layers, 2, kv_heads, T, hd]
    honest = relayout_to_tp1(shards, sharding)
    honest_deltas = kv_head_deltas(honest.kv, own)  # [layers, 2, kv_heads]
    envelope = honest_deltas * ENVELOPE_FACTOR + ENVELOPE_FLOOR

    pending = prompt[prompt_tokens:]
    own_tokens = cold.decode_device(pending, decode).tokens.cpu().numpy()
    consumer = cold.sharing_weights()
    consumer.install_device([honest.kv[layer, 0] for layer in range(shape.layers)],
                            [honest.kv[layer, 1] for layer in range(shape.layers)])
    handed_tokens = consumer.decode_device(pending, decode).tokens.cpu().numpy()
    parted = np.flatnonzero(handed_tokens != own_tokens)

    faults: dict[str, dict[str, Any]] = {}

    def judge(name: str, kv: torch.Tensor, replica_site: KVHeadSite | None, expected: tuple[int, str, int]) -> None:
        site = first_head_over(kv, own, envelope) or replica_site
        localised = site is not None and (site.layer, site.kind, site.kv_head) == expected
        faults[name] = {"expected": {"layer": expected[0], "kind": expected[1], "kv_head": expected[2]},
                        "found": None if site is None else dataclasses.asdict(site),
                        "via": "replica check" if site is not None and site is replica_site else "kv vs TP=1",
                        "localised": localised}

    layer = min(FAULT_LAYER, shape.layers - 1)
    if sharding.replicas == 1:
        permuted = relayout_to_tp1(permute_heads_across_ranks(shards, sharding, layer=layer), sharding)
        judge(FAULTS[0], permuted.kv, permuted.replica_disagreement, (layer, "K", sharding.rank_kv_heads[0][0]))
    stale = relayout_to_tp1(shard_from_other_request(shards, other_shards, rank=STALE_RANK), sharding)
    judge(FAULTS[1], stale.kv, stale.replica_disagreement, (0, "K", sharding.rank_kv_heads[STALE_RANK][0]))
    if sharding.replicas > 1:
        judge(FAULTS[2], place_by_per_rank_head_count(shards, sharding), None, (0, "K", 0))

    return {
        "tp_sharding": sharding.as_dict(),
        "tp_prefill_and_gather_s": tp_seconds,
        "replica_disagreement": None if honest.replica_disagreement is None
        else dataclasses.asdict(honest.replica_disagreement),
        "kv_max_abs_delta_per_layer": {"k": honest_deltas[:, 0].max(axis=1).tolist(),
                                       "v": honest_deltas[:, 1].max(axis=1).tolist()},
        "kv_bit_equal": bool(torch.equal(honest.kv, own)),
        "decode_tokens": decode,
        "decode_tokens_equal": int((handed_tokens == own_tokens).sum()),
        "decode_first_parting": int(parted[0]) if parted.size else None,
        "faults": faults,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="a tiny float32 model (CPU smoke run)")
    parser.add_argument("--kv-heads", default=None,
                        help="comma-separated KV-head counts to run (default: the model's, then 1)")
    parser.add_argument("--prompt-tokens", type=int, default=2047)
    parser.add_argument("--decode", type=int, default=256)
    parser.add_argument("--json", type=Path, default=None, help="write the results and sharding records here")
    args = parser.parse_args()

    if args.device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(args.backend)
    try:
        if args.tiny:
            shape, seed, dtype = TINY, TINY_SEED, "float32"
        else:
            shape, seed, dtype, _ = random_model(CONFIG)
        counts = [shape.kv_heads, 1] if args.kv_heads is None else [int(n) for n in args.kv_heads.split(",")]
        log(f"tp handoff: world {dist.get_world_size()} ({args.backend}, {args.device}), {dtype}, "
            f"{shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads, KV heads {counts}, "
            f"{args.prompt_tokens} tokens handed off, {args.decode} decoded")
        results: dict[str, Any] = {}
        for kv_heads in counts:
            result = run_shape(dataclasses.replace(shape, kv_heads=kv_heads), seed, dtype, args.device,
                               args.prompt_tokens, args.decode)
            if args.device == "cuda":
                torch.cuda.empty_cache()
            if result is None:
                continue
            results[f"kv_heads={kv_heads}"] = result
            per_layer = result["kv_max_abs_delta_per_layer"]
            log(f"\nkv_heads={kv_heads}: sharding {result['tp_sharding']['rank_kv_heads']} "
                f"(replicas {result['tp_sharding']['replicas']}), TP prefill+gather "
                f"{result['tp_prefill_and_gather_s']:.3f} s, bit-equal to TP=1: {result['kv_bit_equal']}")
            log("  max abs KV delta per layer, K: " + " ".join(f"{d:.2g}" for d in per_layer["k"]))
            log("  max abs KV delta per layer, V: " + " ".join(f"{d:.2g}" for d in per_layer["v"]))
            log(f"  greedy decode from handed-off KV vs TP=1's own: {result['decode_tokens_equal']}/"
                f"{result['decode_tokens']} tokens equal, first parting "
                f"{result['decode_first_parting']}")
            for name, fault in result["faults"].items():
                found = KVHeadSite(**fault["found"]) if fault["found"] else None
                log(f"  fault {name}: {site_text(found)} via {fault['via']}; expected layer "
                    f"{fault['expected']['layer']} {fault['expected']['kind']} kv_head "
                    f"{fault['expected']['kv_head']}: {'localised' if fault['localised'] else 'NOT localised'}")
        if dist.get_rank() != 0:
            return 0
        verdicts: dict[str, list[bool]] = {name: [] for name in FAULTS}
        for result in results.values():
            for name, fault in result["faults"].items():
                verdicts[name].append(fault["localised"])
        localised = sum(1 for runs in verdicts.values() if runs and all(runs))
        if args.json is not None:
            args.json.write_text(json.dumps({"shapes": results, "faults_localised": localised}, indent=2) + "\n")
        print(f"tp_handoff_faults_localised: {localised}/{len(FAULTS)}", flush=True)
        return 0
    except Refused as exc:
        print(f"refused: {one_line(str(exc))}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())

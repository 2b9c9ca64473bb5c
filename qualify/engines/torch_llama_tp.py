"""A tensor-parallel prefill of the compact torch Llama, its KV gathered and re-laid out for TP=1.

The same model math as :class:`qualify.engines.torch_llama.TorchLlama` (same weights type, same
RMSNorm, RoPE tables and rotation), split Megatron-style over the ranks of a
``torch.distributed`` process group (NCCL on GPUs, gloo on the CPU; no home-made collectives):

    x = embed[token]                                             # [T, hidden], every rank
    for each layer:
        q, k, v = split(Wqkv[rank rows] · RMSNorm(x))            # column-parallel: this rank's heads
        q, k = RoPE(q), RoPE(k)
        x = x + all_reduce(Wo[:, rank cols] · attention(q, k, v))  # row-parallel: partial sums
        x = x + all_reduce(W2[:, rank cols] · (silu(W1 m) * W3 m))  # W1|W3 column-, W2 row-parallel

Query heads are split evenly (``heads / world_size`` per rank, consecutive). KV heads are split
the way vLLM and SGLang split them: with ``kv_heads >= world_size`` each rank holds
``kv_heads / world_size`` consecutive heads; with fewer KV heads than ranks each rank holds one,
``kv_head = rank * kv_heads // world_size``, so each KV head is replicated on
``world_size / kv_heads`` ranks (the ranks whose query heads read it). A rank's KV shard is
``[layers, 2, local_kv_heads, positions, head_dim]``.

A handoff to a TP=1 consumer gathers the shards to rank 0 (``torch.distributed.gather``) and
re-lays them out as ``[layers, 2, kv_heads, positions, head_dim]``: each KV head from the first
rank that holds it, its replicas on the other ranks checked equal to it (:func:`relayout_to_tp1`).
What went where is a :class:`TPSharding` record, which travels beside the KV: the handoff
manifest (v4) admits no field beyond its schema's, so the record is a sidecar that a bench or test
writes next to its results (:meth:`TPSharding.as_dict`), not a manifest field.

Three faults of real TP-to-TP=1 handoffs apply at that gather/re-layout step
(:func:`permute_heads_across_ranks`, :func:`shard_from_other_request`,
:func:`place_by_per_rank_head_count`); :mod:`qualify.evidence.kv_heads` localises what they did
to a layer, K or V and KV head.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from qualify.core.errors import Refused
from qualify.engines.torch_llama import LayerWeights, LlamaShape, LlamaWeights, apply_rope, rms_norm, rope_tables

KV_KINDS = ("K", "V")  # index 0 and 1 of a KV tensor's second axis


# --------------------------------------------------------------------------------------------
# The sharding record
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TPSharding:
    """How a TP producer split the model's heads over its ranks: the record that goes with the
    gathered KV (as a sidecar; see the module docstring)."""

    world_size: int
    heads: int
    kv_heads: int
    heads_per_rank: int  # query heads per rank, consecutive: rank r has r*hpr .. (r+1)*hpr-1
    kv_heads_per_rank: int  # KV heads each rank holds (1 when KV heads are replicated)
    replicas: int  # ranks holding each KV head (1 without replication)
    rank_kv_heads: tuple[tuple[int, ...], ...]  # rank -> the global KV heads it holds, in order

    def holders(self, kv_head: int) -> tuple[int, ...]:
        """The ranks holding ``kv_head``, lowest first (the first is the one re-layout reads)."""
        return tuple(rank for rank, held in enumerate(self.rank_kv_heads) if kv_head in held)

    def as_dict(self) -> dict[str, object]:
        """The record as JSON-ready values (the sidecar's ``tp_sharding``)."""
        return {"world_size": self.world_size, "heads": self.heads, "kv_heads": self.kv_heads,
                "heads_per_rank": self.heads_per_rank, "kv_heads_per_rank": self.kv_heads_per_rank,
                "replicas": self.replicas, "rank_kv_heads": [list(held) for held in self.rank_kv_heads]}


def tp_sharding(shape: LlamaShape, world_size: int) -> TPSharding:
    """The vLLM/SGLang head split of ``shape`` over ``world_size`` ranks; refuses a split that
    does not divide evenly (query heads, KV heads or their replication, the MLP width)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise Refused(f"tp world size: expected a positive integer, found {world_size!r}")
    if shape.heads % world_size or shape.intermediate % world_size:
        raise Refused(f"tp world size {world_size}: does not divide heads {shape.heads} "
                      f"and intermediate {shape.intermediate}")
    kv_heads = shape.kv_heads
    if kv_heads >= world_size:
        if kv_heads % world_size:
            raise Refused(f"tp world size {world_size}: does not divide kv_heads {kv_heads}")
        per_rank, replicas = kv_heads // world_size, 1
        held = tuple(tuple(range(rank * per_rank, (rank + 1) * per_rank)) for rank in range(world_size))
    else:
        if world_size % kv_heads:
            raise Refused(f"tp world size {world_size}: kv_heads {kv_heads} does not divide it "
                          "(each KV head must be replicated on a whole number of ranks)")
        per_rank, replicas = 1, world_size // kv_heads
        held = tuple((rank * kv_heads // world_size,) for rank in range(world_size))
    return TPSharding(world_size=world_size, heads=shape.heads, kv_heads=kv_heads,
                      heads_per_rank=shape.heads // world_size, kv_heads_per_rank=per_rank,
                      replicas=replicas, rank_kv_heads=held)


# --------------------------------------------------------------------------------------------
# One rank's weights
# --------------------------------------------------------------------------------------------


def shard_layer(layer: LayerWeights, shape: LlamaShape, sharding: TPSharding, rank: int) -> LayerWeights:
    """``rank``'s slices of one layer (contiguous copies): Wqkv rows of its query heads, then of
    its KV heads' K and V (column-parallel); Wo columns of its query heads (row-parallel); W1|W3
    rows of its slice of the MLP width (column-parallel) and W2 columns of it (row-parallel).
    Norm weights are whole (replicated)."""
    hd, heads, kv_heads = shape.head_dim, shape.heads, shape.kv_heads
    first_head = rank * sharding.heads_per_rank
    q_rows = slice(first_head * hd, (first_head + sharding.heads_per_rank) * hd)
    held = sharding.rank_kv_heads[rank]
    kv_rows = slice(held[0] * hd, (held[-1] + 1) * hd)  # a rank's KV heads are consecutive
    k_part = layer.wqkv[heads * hd:(heads + kv_heads) * hd]  # [kv_heads * hd, hidden]
    v_part = layer.wqkv[(heads + kv_heads) * hd:]
    wqkv = torch.cat((layer.wqkv[q_rows], k_part[kv_rows], v_part[kv_rows]))  # [(hpr + 2 kvpr) hd, hidden]
    width = shape.intermediate // sharding.world_size
    mlp_rows = slice(rank * width, (rank + 1) * width)
    gate, up = layer.w13[:shape.intermediate], layer.w13[shape.intermediate:]
    return LayerWeights(attention_norm=layer.attention_norm, wqkv=wqkv.contiguous(),
                        wo=layer.wo[:, q_rows].contiguous(), mlp_norm=layer.mlp_norm,
                        w13=torch.cat((gate[mlp_rows], up[mlp_rows])).contiguous(),
                        w2=layer.w2[:, mlp_rows].contiguous())


# --------------------------------------------------------------------------------------------
# The TP prefill
# --------------------------------------------------------------------------------------------


class TPPrefill:
    """One rank of a TP prefill: it holds its weight shards and returns its KV shard.

    Every rank of the default process group (or ``group``) constructs one with the same full
    weights (drawn from the same seed, or loaded) and calls :meth:`prefill` with the same tokens;
    the two all-reduces per layer are the only communication.
    """

    def __init__(self, weights: LlamaWeights, *, group: dist.ProcessGroup | None = None) -> None:
        shape = weights.shape
        self.shape, self.group = shape, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.sharding = tp_sharding(shape, self.world_size)
        self.device, self.dtype = weights.device, weights.dtype
        self.embed = weights.embed  # [vocab, hidden], whole on every rank
        with torch.inference_mode():
            self.layers = [shard_layer(layer, shape, self.sharding, self.rank) for layer in weights.layers]
        self.local_heads = self.sharding.heads_per_rank
        self.local_kv_heads = self.sharding.kv_heads_per_rank
        self.scale = 1.0 / math.sqrt(shape.head_dim)

    def _all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel product's partial [T, hidden] over the ranks, in place."""
        dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=self.group)
        return partial

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's KV shard of ``tokens`` [T] (int64, positions 0..T-1):
        ``[layers, 2, local_kv_heads, T, head_dim]`` in the model dtype, K post-RoPE."""
        shape, eps, hd = self.shape, self.shape.rms_norm_eps, self.shape.head_dim
        heads, kv_heads = self.local_heads, self.local_kv_heads
        count = int(tokens.shape[0])
        with torch.inference_mode():
            ids = tokens.to(device=self.device, dtype=torch.int64)
            cos, sin = rope_tables(count, hd, float(shape.rope_theta))
            cos, sin = cos.to(self.device)[:, None], sin.to(self.device)[:, None]  # [T, 1, hd]
            shard = torch.empty((shape.layers, 2, kv_heads, count, hd), dtype=self.dtype, device=self.device)
            x = F.embedding(ids, self.embed)  # [T, hidden]
            for index, layer in enumerate(self.layers):
                h = rms_norm(x, layer.attention_norm, eps)
                qkv = F.linear(h, layer.wqkv).view(count, heads + 2 * kv_heads, hd)
                qk = apply_rope(qkv[:, :heads + kv_heads], cos, sin)  # one rotation, as TorchLlama
                q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]  # [T, *, hd]
                shard[index, 0] = k.transpose(0, 1)  # [local_kv_heads, T, hd]
                shard[index, 1] = v.transpose(0, 1)
                attended = F.scaled_dot_product_attention(
                    q.transpose(0, 1)[None], shard[index, 0, None], shard[index, 1, None],
                    is_causal=True, scale=self.scale, enable_gqa=True)  # [1, local heads, T, hd]
                x = x + self._all_reduce(F.linear(attended[0].transpose(0, 1).reshape(count, -1), layer.wo))
                normed = rms_norm(x, layer.mlp_norm, eps)
                gate, up = F.linear(normed, layer.w13).chunk(2, dim=-1)  # [T, intermediate / world]
                x = x + self._all_reduce(F.linear(F.silu(gate) * up, layer.w2))
        return shard

    def gather_to_rank0(self, shard: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's KV shard on rank 0, in rank order (``torch.distributed.gather``); None on
        the other ranks. Shards are equally shaped, so a plain gather carries them."""
        shard = shard.contiguous()
        if self.rank == 0:
            shards = [torch.empty_like(shard) for _ in range(self.world_size)]
            dist.gather(shard, gather_list=shards, dst=0, group=self.group)
            return shards
        dist.gather(shard, dst=0, group=self.group)
        return None


# --------------------------------------------------------------------------------------------
# Re-layout for a TP=1 consumer
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVHeadSite:
    """Where two KVs first differ: layer, K or V, KV head (TP=1 numbering), the first position
    and the max abs delta over that head."""

    layer: int
    kind: str  # "K" or "V"
    kv_head: int
    position: int
    max_abs: float

    def __str__(self) -> str:
        return (f"layer {self.layer} {self.kind} kv_head {self.kv_head} position {self.position} "
                f"(max abs {self.max_abs:.3g})")


@dataclass(frozen=True)
class GatheredKV:
    """The re-laid-out KV ``[layers, 2, kv_heads, positions, head_dim]`` and, when replicas of a
    KV head disagreed, the first site where a replica differs from the copy that was used."""

    kv: torch.Tensor
    replica_disagreement: KVHeadSite | None


def first_differing_site(left: torch.Tensor, right: torch.Tensor, layer_offset: int = 0,
                         head_numbers: Sequence[int] | None = None) -> KVHeadSite | None:
    """The first (layer, K/V, head) in order where two ``[layers, 2, heads, positions, hd]``
    tensors are not equal, with its first differing position; None when equal. Bitwise: replicas
    come from the same arithmetic on the same inputs. ``head_numbers`` renames the heads axis."""
    differs = (left != right).any(dim=-1)  # [layers, 2, heads, positions]
    sites = differs.any(dim=-1).nonzero()  # [n, 3], row-major: layer, then K/V, then head
    if sites.shape[0] == 0:
        return None
    layer, kind, head = (int(value) for value in sites[0])
    position = int(differs[layer, kind, head].nonzero()[0, 0])
    delta = (left[layer, kind, head].float() - right[layer, kind, head].float()).abs().max()
    named = head if head_numbers is None else head_numbers[head]
    return KVHeadSite(layer + layer_offset, KV_KINDS[kind], named, position, float(delta))


def relayout_to_tp1(shards: Sequence[torch.Tensor], sharding: TPSharding) -> GatheredKV:
    """Per-rank shards ``[layers, 2, local_kv_heads, T, hd]`` (rank order) -> the TP=1 layout
    ``[layers, 2, kv_heads, T, hd]``: KV head h from its first holder, replicas dropped after
    a bitwise check against it (they are the same computation on the same rank-local inputs)."""
    if len(shards) != sharding.world_size:
        raise Refused(f"tp gather: {len(shards)} shards for world size {sharding.world_size}")
    columns = []
    disagreement: KVHeadSite | None = None
    for kv_head in range(sharding.kv_heads):
        first, *others = sharding.holders(kv_head)
        used = shards[first][:, :, sharding.rank_kv_heads[first].index(kv_head)]  # [layers, 2, T, hd]
        columns.append(used)
        for rank in others:
            replica = shards[rank][:, :, sharding.rank_kv_heads[rank].index(kv_head)]
            site = first_differing_site(used[:, :, None], replica[:, :, None], head_numbers=(kv_head,))
            if site is not None and disagreement is None:
                disagreement = site
    return GatheredKV(torch.stack(columns, dim=2), disagreement)


# --------------------------------------------------------------------------------------------
# Faults at the gather/re-layout step
# --------------------------------------------------------------------------------------------


def permute_heads_across_ranks(shards: Sequence[torch.Tensor], sharding: TPSharding, *, layer: int,
                               local_head: int = 0) -> list[torch.Tensor]:
    """Rank r's local KV head ``local_head`` of ``layer`` (K and V) comes from rank r+1
    (cyclically): a gather that put heads in the wrong rank's place. With every rank holding a
    replica of the same head this changes nothing (there is nothing to permute)."""
    faulty = [shard.clone() for shard in shards]
    for rank in range(sharding.world_size):
        source = shards[(rank + 1) % sharding.world_size]
        faulty[rank][layer, :, local_head] = source[layer, :, local_head]
    return faulty


def shard_from_other_request(shards: Sequence[torch.Tensor], other_request_shards: Sequence[torch.Tensor],
                             *, rank: int) -> list[torch.Tensor]:
    """``rank``'s shard (every layer, K and V) taken from another request's prefill: a gather
    that matched shards by slot rather than by request."""
    faulty = list(shards)
    faulty[rank] = other_request_shards[rank]
    return faulty


def place_by_per_rank_head_count(shards: Sequence[torch.Tensor], sharding: TPSharding) -> torch.Tensor:
    """The SGLang #22145 mode: the TP=1 layout built from each rank's KV head count, not the
    model's total. The sender back-computes the total as ``kv_heads_per_rank * world_size`` (too
    many when heads are replicated) and writes rank r's local head j at head offset
    ``r * kv_heads_per_rank + j`` of each token's row in the consumer's token-major buffer
    ``[T, kv_heads, hd]`` (SGLang's per-layer K and V buffers), every rank writing, in rank order.
    An offset past the last head spills into the next token's row; past the last token it is
    lost. Without replication the offsets are the right ones. Returns ``[layers, 2, kv_heads, T, hd]``."""
    layers, _, _, count, hd = shards[0].shape
    kv_heads = sharding.kv_heads
    rows = torch.zeros((layers, 2, count * kv_heads, hd), dtype=shards[0].dtype, device=shards[0].device)
    token_rows = torch.arange(count, device=rows.device) * kv_heads  # [T]: each token's first head row
    for rank, shard in enumerate(shards):
        for local in range(sharding.kv_heads_per_rank):
            target = token_rows + rank * sharding.kv_heads_per_rank + local  # [T]
            kept = target < count * kv_heads
            rows[:, :, target[kept]] = shard[:, :, local, kept]
    return rows.view(layers, 2, count, kv_heads, hd).transpose(2, 3).contiguous()

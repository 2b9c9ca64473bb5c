"""The E2 controls' two consumer-side passes for the torch-llama engine, on its device: teacher-forced
row scoring from a handed-off KV, and a cell's handoff decode. Tensors stay where they are.

Row scoring is the criteria's measure (``contracts/e2-controls-v2.json``): row r is scored by the
consumer from the KV of positions 0..r-1 of a given source and its own computation at r, with the
document's tokens fed. The CPU controls run one decode step per row (``ReferenceEngine.score_rows``
batches it bit for bit); 32768 graph replays per pass would take minutes at the 8B shape, so here
the rows are scored in chunks, every row at once: the consumer's own blocks (projections, RoPE,
MLP, float32-accumulating head, in its dtype) with attention by torch's
``scaled_dot_product_attention`` over the source's keys 0..r-1 plus the row's own key, a boolean
mask per chunk (no full score matrix: a chunk of C rows attends over at most r + C keys). Rows do
not depend on each other (every earlier position's K/V is the source's), so a chunk runs all
layers at once. The scorer is the same for every source, so its arithmetic, which is not the
decode step's bit for bit, cancels in a disagreement between two sources.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from qualify.core.errors import Refused
from qualify.engines.torch_llama import TorchLlama, rms_norm

DeviceKV = tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]
"""Per layer K (post-RoPE) and V, each [kv_heads, positions, head_dim] on the engine's device."""


def _check_source(engine: TorchLlama, tokens: torch.Tensor, kv: DeviceKV, what: str) -> None:
    """Refuse tokens that are not 1-D ids on the engine's device, or a KV that does not cover them."""
    shape = engine.shape
    if tokens.ndim != 1 or tokens.numel() == 0 or tokens.dtype != torch.int64 or tokens.device != engine.device:
        raise Refused(f"{what}: tokens {tokens.dtype} {list(tokens.shape)} on {tokens.device}, expected "
                      f"non-empty 1-D int64 on {engine.device}")
    keys, values = kv
    if len(keys) != shape.layers or len(values) != shape.layers:
        raise Refused(f"{what}: {len(keys)}/{len(values)} layers of K/V, expected {shape.layers}")
    for index in range(shape.layers):
        for kind, tensor in (("k", keys[index]), ("v", values[index])):
            if tensor.ndim != 3 or tensor.shape[0] != shape.kv_heads or tensor.shape[2] != shape.head_dim \
                    or tensor.shape[1] < tokens.shape[0] or tensor.dtype != engine.dtype:
                raise Refused(f"{what}: layers.{index}.{kind} {tensor.dtype} {list(tensor.shape)}, expected "
                              f"{engine.dtype} [{shape.kv_heads}, >= {tokens.shape[0]}, {shape.head_dim}]")


def score_logit_chunks(engine: TorchLlama, tokens: torch.Tensor, kv: DeviceKV, chunk: int
                       ) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(start, stop, float32 logits [stop - start, vocab]) per chunk of ``chunk`` rows: row r
    scored from ``kv``'s positions 0..r-1 and the consumer's own K/V at r (module docstring)."""
    _check_source(engine, tokens, kv, "row scoring")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise Refused(f"row scoring chunk: expected a positive number of rows, found {chunk!r}")
    eps = engine.shape.rms_norm_eps
    keys, values = kv
    weights = engine.weights
    positions = torch.arange(tokens.shape[0], device=engine.device)
    with torch.inference_mode():
        for start in range(0, tokens.shape[0], chunk):
            stop = min(start + chunk, tokens.shape[0])
            rows = positions[start:stop]
            # Keys of the chunk: the source's 0..stop-1 (row r sees those before r), then the rows'
            # own (row r sees only its own).
            visible = torch.cat((positions[None, :stop] < rows[:, None],
                                 torch.eye(stop - start, dtype=torch.bool, device=engine.device)), dim=1)
            cos, sin = engine.rope_cos[start:stop, None], engine.rope_sin[start:stop, None]
            x = F.embedding(tokens[start:stop], weights.embed)  # [C, hidden]
            for index, layer in enumerate(weights.layers):
                # The consumer's own projection and RoPE (TorchLlama._qkv): q [C, heads, hd], k/v [C, kv, hd].
                q, k, v = engine._qkv(layer, rms_norm(x, layer.attention_norm, eps), cos, sin)
                layer_keys = torch.cat((keys[index][:, :stop], k.transpose(0, 1)), dim=1)  # [kv, stop + C, hd]
                layer_values = torch.cat((values[index][:, :stop], v.transpose(0, 1)), dim=1)
                # Query head h reads KV head h // group, expanded so every fused kernel takes the mask.
                attended = F.scaled_dot_product_attention(
                    q.transpose(0, 1)[None], layer_keys.repeat_interleave(engine.group, dim=0)[None],
                    layer_values.repeat_interleave(engine.group, dim=0)[None], attn_mask=visible,
                    scale=engine.scale)  # [1, heads, C, hd]
                x = x + F.linear(attended[0].transpose(0, 1).reshape(stop - start, -1), layer.wo)
                x = engine._mlp(layer, x)
            yield start, stop, engine._logits(x)


def score_top_tokens(engine: TorchLlama, tokens: torch.Tensor, kv: DeviceKV, chunk: int) -> torch.Tensor:
    """Each row's top token (int64 [T], the first index of its maximum logit: ``torch.argmax``)
    under :func:`score_logit_chunks`."""
    top = torch.empty(tokens.shape[0], dtype=torch.int64, device=engine.device)
    for start, stop, logits in score_logit_chunks(engine, tokens, kv, chunk):
        top[start:stop] = logits.argmax(dim=-1)
    return top


def kv_prefix(kv: DeviceKV, positions: int) -> DeviceKV:
    """Views of ``kv``'s first ``positions`` positions (the handoff of a shorter prompt)."""
    keys, values = kv
    return [k[:, :positions] for k in keys], [v[:, :positions] for v in values]


def kv_equal(first: DeviceKV, second: DeviceKV) -> bool:
    """Whether two KV sources hold the same bits in every layer."""
    pairs = [*zip(first[0], second[0], strict=True), *zip(first[1], second[1], strict=True)]
    return all(a.shape == b.shape and torch.equal(a, b) for a, b in pairs)


@dataclass(frozen=True)
class DecodeComparison:
    """A cell's handoff decode: the reference's greedy tokens from its own KV, and per step whether
    the lane's top token (teacher-forced on those tokens from the handed-off KV) differs."""

    reference_tokens: np.ndarray  # int64 [steps]
    lane_top: np.ndarray  # int64 [steps]

    @property
    def disagreeing(self) -> int:
        return int(np.count_nonzero(self.lane_top != self.reference_tokens))

    @property
    def first_divergence(self) -> int | None:
        """The first step whose top tokens differ (the lane's free run would leave the reference's
        tokens there), or None when all agree."""
        differing = np.flatnonzero(self.lane_top != self.reference_tokens)
        return int(differing[0]) if differing.size else None


def decode_cell(decoder: TorchLlama, tokens: torch.Tensor, length: int, steps: int, reference_kv: DeviceKV,
                lane_kv: DeviceKV) -> DecodeComparison:
    """The handoff of prompt ``tokens[:length]`` as the lane runs it: positions 0..length-2 handed
    off, the last prompt token pending, ``steps`` decoded by ``decoder`` (the consumer's decode
    path). The reference decodes greedily from its own KV; the lane is teacher-forced on the
    reference's tokens from its KV, so a step disagrees exactly where a free run would diverge."""
    if not 2 <= length <= tokens.shape[0]:
        raise Refused(f"decode cell: length {length}, expected 2..{tokens.shape[0]}")
    pending = tokens[length - 1:length]
    decoder.install_device(*kv_prefix(reference_kv, length - 1))
    reference = decoder.decode_device(pending, steps).tokens.clone()
    decoder.install_device(*kv_prefix(lane_kv, length - 1))
    lane = decoder.decode_device(pending, steps, forced=reference).logits.argmax(dim=-1)
    return DecodeComparison(reference.cpu().numpy(), lane.cpu().numpy())

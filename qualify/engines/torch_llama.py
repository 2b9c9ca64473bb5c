"""A compact torch Llama, top to bottom in one file, with a static KV cache and a CUDA-graph decode.

The same model as :mod:`qualify.engines.reference` (Hugging Face ``LlamaForCausalLM`` math:
RMSNorm, RoPE in the rotate_half layout, grouped-query attention, SwiGLU; the Llama 3.x, Mistral
and Qwen2.x variants the loader accepts: ``linear`` or ``llama3`` RoPE scaling, an untied head,
Q/K/V biases), written the way Meta's reference ``model.py`` is, for the GPU. It exists so the
harness can qualify a handoff at a real model shape (Llama-3 8B: 32 layers, hidden 4096, 32
heads, 8 KV heads, vocab 128256) in seconds:

    x = embed[token]                                        # [T, hidden]
    for each layer:
        q, k, v = split(Wqkv · RMSNorm(x) + bqkv)           # one fused projection (bias: Qwen2)
        q, k = RoPE(q), RoPE(k)                             # rotated in float32, cast back
        x = x + Wo · attention(q, K cache, V cache)         # GQA: query head h reads KV head h // group
        x = x + W2 · (silu(W1 m) * W3 m),  m = RMSNorm(x)   # one fused W1|W3 projection
    logits = Wout · RMSNorm(x)                              # [T, vocab], float32 accumulate and rows

Weights come from the shipped checkpoint (``model/``; float16 stored, tied embeddings), from any
model ``--model`` loads (a Hugging Face directory or a GGUF file, :mod:`qualify.engines.model_source`),
or are drawn at a given shape from a seed with a ``torch.Generator`` on the device (deterministic for a
given device kind, seed and torch version). Q|K|V and W1|W3 are stored fused; the per-projection
tensors Hugging Face names are row slices of them (:meth:`LlamaWeights.hf_state_dict`), so a
``transformers`` model can run on the very same weight storage.

The KV cache is preallocated: per layer K (post-RoPE) and V ``[kv_heads, cache_positions + 2,
head_dim]`` in the model dtype (the two extra slots absorb the graph-capture warm-up steps).
``prefill`` writes positions ``0..T-1``; a decode writes the positions after ``length`` as
scratch, so the installed prompt KV is never modified and a decode can be repeated (teacher
forcing after a free run) without reinstalling it. One decode step reads
its token, position and step index from device tensors, attends over the whole static cache with
the positions after its own masked out, writes its float32 logit row into a preallocated
``[max_decode_steps, vocab]`` buffer and feeds the argmax (ties to the lowest id: ``torch.argmax``
returns the first maximum) or a forced token back on the device. Nothing in a step depends on the
host, so on CUDA it is captured once as a ``torch.cuda.CUDAGraph`` and replayed once per token;
on the CPU the same step runs eagerly. Decode equals teacher forcing on its own tokens bit for
bit: both replay the same step, which only chooses what it feeds next.

Two faces: the harness :class:`~qualify.engines.base.Engine` protocol (numpy in, numpy out, KV in
the canonical float32 layout of :mod:`qualify.core.kv`), and device methods (``prefill_device``,
``install_device``, ``decode_device``, ``kv_device``) that keep KV and logits as torch tensors
where they are, for ``bench/gpu_scale.py``.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict, Unpack

import numpy as np
import torch
import torch.nn.functional as F

from qualify.core import assets
from qualify.core.errors import Refused
from qualify.core.kv import KVCache, check_kv_fits
from qualify.engines.base import ENGINE_VERSION, DecodeResult, GreedyDecoder, ModelGeometry, check_decode_count, finished_decode
from qualify.engines.checkpoint import RopeScaling
from qualify.engines.model_source import load_model
from qualify.engines.reference import scaled_inverse_frequencies

# Bump whenever the numerics of this file change (op order, fusion, dtypes, attention): the abi is
# part of a lane's cache identity, so KV of old arithmetic never aliases new arithmetic.
ABI_VERSION = "torch-llama-abi-1"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEVICES = ("cpu", "cuda")
# Hugging Face's LlamaConfig.initializer_range: random weights are N(0, 0.02), norms are ones.
INIT_STD = 0.02
# The eager warm-up steps before a CUDA graph capture write K/V like any step; they run at these
# extra slots past the usable cache, which no real step can see (they lie after its position).
WARMUP_SLOTS = 2


# --------------------------------------------------------------------------------------------
# Shape and weights
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaShape:
    """Everything the model's arithmetic depends on besides its weights."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: int
    rope_theta: float
    rms_norm_eps: float
    tied_embeddings: bool
    rope_scaling: RopeScaling | None = None  # Llama 3.x: linear or llama3 (scaled inverse frequencies)
    qkv_bias: bool = False  # Qwen2: the fused Q|K|V projection carries a bias

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab",
                     "max_positions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise Refused(f"model shape {name}: expected a positive integer, found {value!r}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value <= 0:
                raise Refused(f"model shape {name}: expected a positive finite number, found {value!r}")
        if self.heads % self.kv_heads:
            raise Refused(f"model shape kv_heads: {self.kv_heads} does not divide heads {self.heads}")
        if self.head_dim % 2:
            raise Refused(f"model shape head_dim: expected an even number (RoPE rotates pairs), "
                          f"found {self.head_dim}")
        for name in ("tied_embeddings", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise Refused(f"model shape {name}: expected true or false, found {getattr(self, name)!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise Refused(f"model shape rope_scaling: expected none or a RopeScaling, found {self.rope_scaling!r}")

    @property
    def geometry(self) -> ModelGeometry:
        return ModelGeometry(layers=self.layers, hidden=self.hidden, heads=self.heads,
                             kv_heads=self.kv_heads, head_dim=self.head_dim, vocab=self.vocab,
                             max_positions=self.max_positions, rope_theta=float(self.rope_theta))

    @property
    def qkv_width(self) -> int:
        """Rows of the fused Q|K|V projection: (heads + 2 * kv_heads) * head_dim."""
        return (self.heads + 2 * self.kv_heads) * self.head_dim


@dataclass
class LayerWeights:
    """One decoder layer's tensors (model dtype, on the device)."""

    attention_norm: torch.Tensor  # [hidden]
    wqkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]: Q rows, then K, then V
    wo: torch.Tensor  # [hidden, heads * head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    w13: torch.Tensor  # [2 * intermediate, hidden]: gate (W1) rows, then up (W3)
    w2: torch.Tensor  # [hidden, intermediate]: down
    bqkv: torch.Tensor | None = None  # [(heads + 2 * kv_heads) * head_dim] Q|K|V bias (Qwen2), else None


@dataclass
class LlamaWeights:
    """All weights; read-only once built, so several engines (and a transformers model) may
    share them."""

    shape: LlamaShape
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Hugging Face ``LlamaForCausalLM`` names -> views of these tensors (no copies): the
        per-projection matrices are row slices of the fused ones, which are contiguous."""
        shape = self.shape
        q_rows, kv_rows = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        state = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.final_norm}
        for index, layer in enumerate(self.layers):
            prefix = f"model.layers.{index}."
            state[prefix + "input_layernorm.weight"] = layer.attention_norm
            state[prefix + "self_attn.q_proj.weight"] = layer.wqkv[:q_rows]
            state[prefix + "self_attn.k_proj.weight"] = layer.wqkv[q_rows:q_rows + kv_rows]
            state[prefix + "self_attn.v_proj.weight"] = layer.wqkv[q_rows + kv_rows:]
            if layer.bqkv is not None:
                state[prefix + "self_attn.q_proj.bias"] = layer.bqkv[:q_rows]
                state[prefix + "self_attn.k_proj.bias"] = layer.bqkv[q_rows:q_rows + kv_rows]
                state[prefix + "self_attn.v_proj.bias"] = layer.bqkv[q_rows + kv_rows:]
            state[prefix + "self_attn.o_proj.weight"] = layer.wo
            state[prefix + "post_attention_layernorm.weight"] = layer.mlp_norm
            state[prefix + "mlp.gate_proj.weight"] = layer.w13[:shape.intermediate]
            state[prefix + "mlp.up_proj.weight"] = layer.w13[shape.intermediate:]
            state[prefix + "mlp.down_proj.weight"] = layer.w2
        if not shape.tied_embeddings:
            state["lm_head.weight"] = self.lm_head
        return state

    def fingerprint(self) -> str:
        """A cheap identification of the weights (not a cryptographic digest): SHA-256 over
        each tensor's float64 sum and sum of squares, computed where the weights are. Two runs
        that drew the same weights print the same fingerprint."""
        import hashlib

        sums = []
        for _, tensor in sorted(self.hf_state_dict().items()):
            as_float = tensor.float()
            sums.append(torch.stack([as_float.sum(dtype=torch.float64),
                                     as_float.square().sum(dtype=torch.float64)]))
        host = torch.stack(sums).cpu().numpy()
        return hashlib.sha256(host.astype("<f8").tobytes()).hexdigest()


def check_dtype_device(dtype: str, device: str) -> torch.dtype:
    """Refuse a dtype or device this engine does not implement, or CUDA where there is none."""
    if dtype not in DTYPES:
        raise Refused(f"torch llama dtype: expected one of {', '.join(DTYPES)}, found {dtype!r}")
    if device not in DEVICES:
        raise Refused(f"torch llama device: expected one of {', '.join(DEVICES)}, found {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise Refused("torch llama device: 'cuda' requested but torch sees no CUDA device")
    return DTYPES[dtype]


def random_weights(shape: LlamaShape, *, seed: int, dtype: str = "bfloat16",
                   device: str = "cuda") -> LlamaWeights:
    """Weights drawn N(0, INIT_STD) directly on ``device`` in ``dtype`` (norms ones), tensor by
    tensor in a fixed order from one generator seeded with ``seed``: the same seed, device kind
    and torch version give the same weights."""
    torch_dtype = check_dtype_device(dtype, device)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise Refused(f"random weights seed: expected a non-negative integer, found {seed!r}")
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)

    def normal(*size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch_dtype, device=device).normal_(0.0, INIT_STD, generator=generator)

    def ones() -> torch.Tensor:
        return torch.ones(shape.hidden, dtype=torch_dtype, device=device)

    with torch.inference_mode():
        embed = normal(shape.vocab, shape.hidden)
        layers = [LayerWeights(attention_norm=ones(), wqkv=normal(shape.qkv_width, shape.hidden),
                               wo=normal(shape.hidden, shape.heads * shape.head_dim), mlp_norm=ones(),
                               w13=normal(2 * shape.intermediate, shape.hidden),
                               w2=normal(shape.hidden, shape.intermediate),
                               bqkv=normal(shape.qkv_width) if shape.qkv_bias else None)
                  for _ in range(shape.layers)]
        lm_head = embed if shape.tied_embeddings else normal(shape.vocab, shape.hidden)
        return LlamaWeights(shape, embed, layers, ones(), lm_head)


def checkpoint_weights(model_dir: Path = assets.MODEL_DIR, *, dtype: str = "float32",
                       device: str = "cpu") -> LlamaWeights:
    """The model at ``model_dir`` (a Hugging Face directory or a GGUF file, loaded and validated
    by :func:`qualify.engines.model_source.load_model` as ``--model`` loads it: float32, exact),
    fused and cast to ``dtype`` on ``device``."""
    torch_dtype = check_dtype_device(dtype, device)
    loaded = load_model(Path(model_dir))
    config, stored = loaded.config, loaded.weights  # float32 numpy, HF names, checked
    geometry = config.geometry
    shape = LlamaShape(layers=geometry.layers, hidden=geometry.hidden, heads=geometry.heads,
                       kv_heads=geometry.kv_heads, head_dim=geometry.head_dim,
                       intermediate=config.intermediate, vocab=geometry.vocab,
                       max_positions=geometry.max_positions, rope_theta=geometry.rope_theta,
                       rms_norm_eps=config.rms_norm_eps, tied_embeddings=config.tied_head,
                       rope_scaling=config.rope_scaling, qkv_bias=config.qkv_bias)

    def tensor(*names: str) -> torch.Tensor:
        joined = np.concatenate([stored[name] for name in names], axis=0)
        return torch.from_numpy(joined).to(device=device, dtype=torch_dtype).contiguous()

    layers = []
    for index in range(shape.layers):
        p = f"model.layers.{index}."
        layers.append(LayerWeights(
            attention_norm=tensor(p + "input_layernorm.weight"),
            wqkv=tensor(p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                        p + "self_attn.v_proj.weight"),
            wo=tensor(p + "self_attn.o_proj.weight"),
            mlp_norm=tensor(p + "post_attention_layernorm.weight"),
            w13=tensor(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
            w2=tensor(p + "mlp.down_proj.weight"),
            bqkv=tensor(p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias")
            if shape.qkv_bias else None))
    embed = tensor("model.embed_tokens.weight")
    lm_head = embed if shape.tied_embeddings else tensor("lm_head.weight")
    return LlamaWeights(shape, embed, layers, tensor("model.norm.weight"), lm_head)


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, hidden] -> weight * x / sqrt(mean(x^2) + eps), reduced in float32 (torch's fused
    rms_norm upcasts half types internally; one kernel per norm on CUDA)."""
    return F.rms_norm(x, weight.shape, weight, eps)


def rope_tables(positions: int, head_dim: int, theta: float,
                scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [positions, head_dim] float32, angles laid out [f, f] (HF rotate_half layout),
    computed on the CPU in float32 exactly as Hugging Face computes them; the inverse
    frequencies scaled by the reference engine's float32 rule when the model declares a scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # [hd/2]
    if scaling is not None:
        inv_freq = torch.from_numpy(scaled_inverse_frequencies(inv_freq.numpy(), scaling))
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [P, hd/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [P, hd]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate q or k [..., head_dim] by its positions' angles, in float32 (as Meta's reference
    does), then cast back: pairs are (i, i + head_dim/2), the Hugging Face checkpoint layout."""
    x32 = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)  # rotate_half
    return (x32 * cos + rotated * sin).to(x.dtype)


def _half_head_kind(device: torch.device, dtype: torch.dtype) -> str:
    """``f32-out`` when ``torch.mm(..., out_dtype=torch.float32)`` runs for ``dtype`` on this
    device (probed on a tiny product), else ``f32-copy``."""
    try:
        probe = torch.ones((1, 8), dtype=dtype, device=device)
        result = torch.mm(probe, probe.t(), out_dtype=torch.float32)
        return "f32-out" if result.dtype == torch.float32 and float(result[0, 0]) == 8.0 else "f32-copy"
    except (RuntimeError, NotImplementedError, TypeError):
        return "f32-copy"


def head_kind(device: torch.device, dtype: torch.dtype) -> str:
    """How the LM head keeps float32 logits: ``f32`` (a float32 model), else :func:`_half_head_kind`."""
    return "f32" if dtype == torch.float32 else _half_head_kind(device, dtype)


def engine_version() -> str:
    return f"torch-llama-{ENGINE_VERSION}+torch-{torch.__version__}"


def engine_abi(device: torch.device, dtype: torch.dtype, cuda_graph: bool) -> str:
    """The ABI an engine on ``device`` in ``dtype`` reports, without building one (no weights):
    what an identity pins for it (torch, CUDA and GPU, dtype, head accumulation, graphs)."""
    dtype_name = next(name for name, value in DTYPES.items() if value == dtype)
    kind = "cpu" if device.type == "cpu" else \
        f"cuda-{torch.version.cuda}-{torch.cuda.get_device_name(device).replace(' ', '-')}"
    graphs = "cudagraph" if cuda_graph and device.type == "cuda" else "eager"
    return f"{ABI_VERSION}+torch-{torch.__version__}+{kind}+{dtype_name}+head-{head_kind(device, dtype)}+{graphs}"


# --------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------


@dataclass
class DeviceDecode:
    """A decode's results where they were computed: ``tokens`` int64 [n], ``logits`` float32
    [n, vocab]. Views of the engine's buffers: valid until its next decode."""

    tokens: torch.Tensor
    logits: torch.Tensor


class EngineOptions(TypedDict, total=False):
    """The keyword options of :class:`TorchLlama` (what its builders pass through)."""

    cache_positions: int | None
    max_decode_steps: int
    cuda_graph: bool


class TorchLlama(GreedyDecoder):
    """The compact Llama behind the Engine protocol, plus device-side methods (module docstring).

    ``cache_positions`` sizes the static KV cache (every decode step attends over all of it,
    masked, so it should be no larger than the work needs); ``max_decode_steps`` sizes the logit
    buffer. ``cuda_graph`` (CUDA only) captures the decode step once and replays it.
    """

    name = "torch-llama"
    logit_units = "raw"

    def __init__(self, weights: LlamaWeights, *, cache_positions: int | None = None,
                 max_decode_steps: int = 256, cuda_graph: bool = True) -> None:
        shape = weights.shape
        self.shape, self.weights = shape, weights
        self.geometry = shape.geometry
        self.device, self.dtype = weights.device, weights.dtype
        capacity = shape.max_positions if cache_positions is None else cache_positions
        for name, value, limit in (("cache_positions", capacity, shape.max_positions),
                                   ("max_decode_steps", max_decode_steps, None)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 \
                    or (limit is not None and value > limit):
                bound = f" no larger than max_positions {limit}" if limit is not None else ""
                raise Refused(f"torch llama {name}: expected a positive integer{bound}, found {value!r}")
        self.cache_positions, self.max_decode_steps = capacity, max_decode_steps
        self.use_graph = bool(cuda_graph) and self.device.type == "cuda"
        # Logits are float32 rows. A bf16 head rounded to bf16 before the upcast would quantise
        # every logit to 8 bits of mantissa (0.03 at a logit of 5): drift would be measured in
        # steps of that size and exact top-1 ties (resolved to the lowest id) would be common.
        # So a half-precision head keeps its float32 accumulator: torch.mm(out_dtype=float32)
        # where the backend has it (CUDA), else a float32 copy of the head (CPU smoke runs).
        self.head_kind = head_kind(self.device, self.dtype)
        if self.head_kind == "f32-copy":
            self._lm_head_f32 = weights.lm_head.float()
        self.group = shape.heads // shape.kv_heads  # query heads per KV head
        self.scale = 1.0 / math.sqrt(shape.head_dim)
        self.version = engine_version()
        self.abi = engine_abi(self.device, self.dtype, self.use_graph)

        device, dtype = self.device, self.dtype
        slots = capacity + WARMUP_SLOTS
        with torch.inference_mode():
            cos, sin = rope_tables(slots, shape.head_dim, float(shape.rope_theta), shape.rope_scaling)
            self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)  # [slots, hd] float32
            # K and V of every layer, [layers, 2, kv_heads, slots, head_dim]; zeros, so masked
            # positions hold finite values (0 * garbage could be NaN) before anything is written.
            self.cache = torch.zeros((shape.layers, 2, shape.kv_heads, slots, shape.head_dim),
                                     dtype=dtype, device=device)
            self.length = 0  # positions 0..length-1 hold installed or prefilled KV
            # Decode state the graph reads and advances; set from the host before each decode.
            self.input_token = torch.zeros(1, dtype=torch.int64, device=device)  # fed this step
            self.position = torch.zeros(1, dtype=torch.int64, device=device)  # its position
            self.step_index = torch.zeros(1, dtype=torch.int64, device=device)  # logit row to write
            self.forcing = torch.zeros(1, dtype=torch.bool, device=device)  # feed forced tokens?
            self.forced_tokens = torch.zeros(max_decode_steps, dtype=torch.int64, device=device)
            self.out_tokens = torch.zeros(max_decode_steps, dtype=torch.int64, device=device)
            self.out_logits = torch.zeros((max_decode_steps, shape.vocab), dtype=torch.float32, device=device)
            self.key_positions = torch.arange(slots, device=device)  # [slots]
        self._graph: torch.cuda.CUDAGraph | None = None

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def from_model_dir(cls, model_dir: Path = assets.MODEL_DIR, *, dtype: str = "float32",
                       device: str = "cpu", **options: Unpack[EngineOptions]) -> TorchLlama:
        """The shipped checkpoint, or any model the loader accepts; see :func:`checkpoint_weights`."""
        return cls(checkpoint_weights(model_dir, dtype=dtype, device=device), **options)

    @classmethod
    def random(cls, shape: LlamaShape, *, seed: int, dtype: str = "bfloat16", device: str = "cuda",
               **options: Unpack[EngineOptions]) -> TorchLlama:
        """Random weights of ``shape`` drawn on ``device``; see :func:`random_weights`."""
        return cls(random_weights(shape, seed=seed, dtype=dtype, device=device), **options)

    def sharing_weights(self, **options: Unpack[EngineOptions]) -> TorchLlama:
        """Another engine on the same (read-only) weight tensors, with its own cache and graph."""
        settings: EngineOptions = {"cache_positions": self.cache_positions,
                                   "max_decode_steps": self.max_decode_steps, "cuda_graph": self.use_graph}
        settings.update(options)
        return TorchLlama(self.weights, **settings)

    # ---- the model ---------------------------------------------------------------------------

    def _qkv(self, layer: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [T, hidden] -> q [T, heads, hd], k [T, kv_heads, hd] (both post-RoPE), v [T, kv_heads, hd].
        cos/sin are [T, 1, hd] (broadcast over heads)."""
        shape = self.shape
        qkv = F.linear(h, layer.wqkv, layer.bqkv).view(h.shape[0], shape.heads + 2 * shape.kv_heads, shape.head_dim)
        qk = apply_rope(qkv[:, :shape.heads + shape.kv_heads], cos, sin)  # one rotation for q and k
        return qk[:, :shape.heads], qk[:, shape.heads:], qkv[:, shape.heads + shape.kv_heads:]

    def _mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> x + W2 (silu(W1 m) * W3 m), m = RMSNorm(x)."""
        gate, up = F.linear(rms_norm(x, layer.mlp_norm, self.shape.rms_norm_eps), layer.w13).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer.w2)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: x [T, hidden] -> float32 [T, vocab]. The head multiplies in
        the model dtype and accumulates and stores in float32 (see ``head_kind``)."""
        normed = rms_norm(x, self.weights.final_norm, self.shape.rms_norm_eps)
        if self.head_kind == "f32-out":
            return torch.mm(normed, self.weights.lm_head.t(), out_dtype=torch.float32)
        if self.head_kind == "f32-copy":
            return F.linear(normed.float(), self._lm_head_f32)
        return F.linear(normed, self.weights.lm_head)

    def _forward_chunk(self, tokens: torch.Tensor, start: int, need_logits: bool) -> torch.Tensor | None:
        """Feed tokens [T] (device int64) at positions start..start+T-1: write their K/V into
        the cache and attend causally over positions 0..start+T-1. Returns logits [T, vocab]
        when asked; else the last layer stops after its K/V (nothing downstream reads it)."""
        shape, eps = self.shape, self.shape.rms_norm_eps
        count = tokens.shape[0]
        stop = start + count
        cos = self.rope_cos[start:stop, None]  # [T, 1, hd]
        sin = self.rope_sin[start:stop, None]
        # Causal over the new rows; keys before ``start`` are visible to every new row.
        mask = None if start == 0 else \
            self.key_positions[None, :stop] <= self.key_positions[start:stop, None]  # [T, stop]
        x = F.embedding(tokens, self.weights.embed)  # [T, hidden]
        for index, layer in enumerate(self.weights.layers):
            q, k, v = self._qkv(layer, rms_norm(x, layer.attention_norm, eps), cos, sin)
            self.cache[index, 0, :, start:stop] = k.transpose(0, 1)  # [kv_heads, T, hd]
            self.cache[index, 1, :, start:stop] = v.transpose(0, 1)
            if not need_logits and index == shape.layers - 1:
                return None
            keys = self.cache[index, 0, None, :, :stop]  # [1, kv_heads, stop, hd]
            values = self.cache[index, 1, None, :, :stop]
            attended = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys, values, attn_mask=mask, is_causal=mask is None,
                scale=self.scale, enable_gqa=True)  # [1, heads, T, hd]
            x = x + F.linear(attended[0].transpose(0, 1).reshape(count, -1), layer.wo)
            x = self._mlp(layer, x)
        return self._logits(x)

    def _step(self) -> None:
        """One decode step on the device state (capturable: no host value is read). Feeds
        ``input_token`` at ``position``, writes its K/V there, writes the float32 logit row
        ``step_index``, then feeds back the argmax (or ``forced_tokens[step_index]`` when
        ``forcing``) and advances position and step."""
        shape, eps = self.shape, self.shape.rms_norm_eps
        heads, kv_heads, hd = shape.heads, shape.kv_heads, shape.head_dim
        cos = self.rope_cos.index_select(0, self.position)[:, None]  # [1, 1, hd]
        sin = self.rope_sin.index_select(0, self.position)[:, None]
        hidden_keys = self.key_positions > self.position  # [slots]: after this position
        x = F.embedding(self.input_token, self.weights.embed)  # [1, hidden]
        for index, layer in enumerate(self.weights.layers):
            q, k, v = self._qkv(layer, rms_norm(x, layer.attention_norm, eps), cos, sin)
            cache_k, cache_v = self.cache[index, 0], self.cache[index, 1]  # [kv_heads, slots, hd]
            cache_k.index_copy_(1, self.position, k.view(kv_heads, 1, hd))
            cache_v.index_copy_(1, self.position, v.view(kv_heads, 1, hd))
            grouped = (q * self.scale).view(kv_heads, self.group, hd)  # query head h -> KV head h // group
            scores = torch.matmul(grouped, cache_k.transpose(1, 2))  # [kv_heads, group, slots]
            scores = scores.float().masked_fill(hidden_keys, float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(self.dtype)
            attended = torch.matmul(probs, cache_v)  # [kv_heads, group, hd]
            x = x + F.linear(attended.view(1, heads * hd), layer.wo)
            x = self._mlp(layer, x)
        logits = self._logits(x)  # [1, vocab]
        self.out_logits.index_copy_(0, self.step_index, logits)
        chosen = torch.where(self.forcing, self.forced_tokens.index_select(0, self.step_index),
                             logits.argmax(dim=-1))  # [1]; argmax ties go to the lowest id
        self.out_tokens.index_copy_(0, self.step_index, chosen)
        self.input_token.copy_(chosen)
        self.position.add_(1)
        self.step_index.add_(1)

    def _capture(self) -> None:
        """Capture ``_step`` as a CUDA graph, after eager warm-up steps on a side stream (they
        write K/V only into the WARMUP_SLOTS past the usable cache). The caller sets the real
        decode state afterwards."""
        self._set_state(0, self.cache_positions, forcing=False)
        side = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_SLOTS):
                self._step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step()
        self._graph = graph

    # ---- device-side API ---------------------------------------------------------------------

    def _device_tokens(self, tokens: torch.Tensor | np.ndarray, what: str) -> torch.Tensor:
        """Token ids as a 1-D int64 tensor on the engine's device; host arrays are checked
        (range, dtype, shape) with the harness's rules, device tensors for shape and dtype."""
        if isinstance(tokens, torch.Tensor):
            if tokens.ndim != 1 or tokens.numel() == 0 or tokens.dtype.is_floating_point \
                    or tokens.dtype == torch.bool:
                raise Refused(f"{what}: expected a non-empty 1-D integer token tensor, "
                              f"found {tokens.dtype} {list(tokens.shape)}")
            ids = tokens.to(device=self.device, dtype=torch.int64)
            low, high = (int(value) for value in torch.stack([ids.min(), ids.max()]).cpu())
            if low < 0 or high >= self.shape.vocab:
                raise Refused(f"{what}: token ids must lie in 0..{self.shape.vocab - 1}, found {low}..{high}")
            return ids
        return torch.from_numpy(self._tokens(tokens, what)).to(self.device)

    def prefill_device(self, tokens: torch.Tensor | np.ndarray) -> None:
        """Prefill ``tokens`` at positions 0..T-1 into the static cache (asynchronous on CUDA)."""
        ids = self._device_tokens(tokens, "prefill tokens")
        if ids.shape[0] > self.cache_positions:
            raise Refused(f"prefill tokens: {ids.shape[0]} positions exceed cache_positions "
                          f"{self.cache_positions}")
        with torch.inference_mode():
            self._forward_chunk(ids, 0, need_logits=False)
        self.length = int(ids.shape[0])

    def kv_device(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer K and V views [kv_heads, length, head_dim] of the installed/prefilled KV."""
        keys = [self.cache[index, 0, :, :self.length] for index in range(self.shape.layers)]
        values = [self.cache[index, 1, :, :self.length] for index in range(self.shape.layers)]
        return keys, values

    def install_device(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Copy a canonical KV (per layer [kv_heads, positions, head_dim], any float dtype, any
        device; pinned host memory copies asynchronously) into the cache, cast to the model
        dtype, then refuse it if any installed value is not finite (one device-side check)."""
        shape = self.shape
        if len(keys) != shape.layers or len(values) != shape.layers:
            raise Refused(f"kv: expected {shape.layers} layers of K and V, found {len(keys)}/{len(values)}")
        positions = keys[0].shape[1] if keys[0].ndim == 3 else -1
        for index in range(shape.layers):
            for kind, tensor in (("k", keys[index]), ("v", values[index])):
                if tuple(tensor.shape) != (shape.kv_heads, positions, shape.head_dim) \
                        or not tensor.dtype.is_floating_point:
                    raise Refused(f"kv: layers.{index}.{kind}: {tensor.dtype} {list(tensor.shape)}, expected "
                                  f"floating [{shape.kv_heads}, positions, {shape.head_dim}]")
        if positions < 1 or positions >= self.cache_positions:
            raise Refused(f"kv: {positions} positions, expected 1..{self.cache_positions - 1} "
                          f"(cache_positions {self.cache_positions} leaves room to decode)")
        with torch.inference_mode():
            for index in range(shape.layers):
                self.cache[index, 0, :, :positions].copy_(keys[index], non_blocking=True)
                self.cache[index, 1, :, :positions].copy_(values[index], non_blocking=True)
            if not bool(torch.isfinite(self.cache[:, :, :, :positions]).all()):
                raise Refused("kv: non-finite values in the installed KV")
        self.length = int(positions)

    def warm_up(self) -> None:
        """Capture the decode graph now (CUDA) rather than at the first decode; writes only
        scratch positions, so installed KV is untouched."""
        if self.use_graph and self._graph is None:
            with torch.inference_mode():
                self._capture()

    def _set_state(self, token: int | torch.Tensor, position: int, forcing: bool) -> None:
        if isinstance(token, torch.Tensor):
            self.input_token.copy_(token.view(1))
        else:
            self.input_token.fill_(token)
        self.position.fill_(position)
        self.step_index.fill_(0)
        self.forcing.fill_(forcing)

    def decode_device(self, pending: torch.Tensor | np.ndarray, steps: int,
                      forced: torch.Tensor | np.ndarray | None = None) -> DeviceDecode:
        """Feed ``pending`` after the installed KV, then ``steps`` greedy tokens (or ``forced``
        ones). Asynchronous on CUDA: returns views of the engine's token and logit buffers,
        valid until the next decode. Positions after ``length`` are scratch, so this can be
        called again on the same installed KV."""
        steps = check_decode_count(steps)
        ids = self._device_tokens(pending, "pending tokens")
        if steps > self.max_decode_steps:
            raise Refused(f"decode n: {steps} exceeds this engine's max_decode_steps {self.max_decode_steps}")
        if self.length < 1:
            raise Refused("decode: no KV installed or prefilled")
        # The last chosen token is never fed, so the cache needs pending + steps - 1 more positions.
        if self.length + ids.shape[0] + steps - 1 > self.cache_positions:
            raise Refused(f"decode: {self.length} positions plus {ids.shape[0]} pending and {steps} "
                          f"decoded tokens exceed cache_positions {self.cache_positions}")
        forced_ids = None
        if forced is not None:
            forced_ids = self._device_tokens(forced, "forced tokens")
            if forced_ids.shape[0] != steps:
                raise Refused(f"forced tokens: {forced_ids.shape[0]} tokens for {steps} steps")
        with torch.inference_mode():
            installed = self.length
            if ids.shape[0] > 1:  # earlier pending tokens as one chunk, then the last as step 0
                self._forward_chunk(ids[:-1], installed, need_logits=False)
            if forced_ids is not None:
                self.forced_tokens[:steps].copy_(forced_ids)
            first_position = installed + ids.shape[0] - 1
            if self.use_graph and self._graph is None:
                self._capture()
            self._set_state(ids[-1], first_position, forced_ids is not None)
            for _ in range(steps):
                if self._graph is not None:
                    self._graph.replay()
                else:
                    self._step()
        return DeviceDecode(self.out_tokens[:steps], self.out_logits[:steps])

    # ---- Engine protocol (numpy) -------------------------------------------------------------

    def prefill(self, tokens: np.ndarray) -> KVCache:
        """KV of exactly ``tokens`` (positions 0..len-1): per layer K (post-RoPE) and V float32
        numpy [kv_heads, positions, head_dim], C-contiguous (bf16 -> float32 is exact)."""
        began = time.perf_counter()
        self.prefill_device(self._tokens(tokens, "prefill tokens"))
        keys, values = self.kv_device()
        return KVCache([_canonical(k) for k in keys], [_canonical(v) for v in values],
                       meta={"prefill_seconds": time.perf_counter() - began})

    def _run(self, kv: KVCache, pending: np.ndarray, steps: int, forced: np.ndarray | None
             ) -> DecodeResult:
        """Check and install ``kv``, decode on the device, copy tokens and logits to the host."""
        began = time.perf_counter()
        pending = self._tokens(pending, "pending tokens")
        if steps > self.max_decode_steps:
            raise Refused(f"decode n: {steps} exceeds this engine's max_decode_steps {self.max_decode_steps}")
        shape = self.shape
        # check_kv_fits names the limit max_positions; here it is this engine's cache_positions.
        handed_off = check_kv_fits(kv, shape.layers, shape.kv_heads, shape.head_dim,
                                   self.cache_positions, pending.size + steps - 1)
        self.install_device([torch.from_numpy(k) for k in kv.keys], [torch.from_numpy(v) for v in kv.values])
        result = self.decode_device(pending, steps, forced)
        tokens = result.tokens.cpu().numpy().astype(np.int32)  # [steps]
        logits = result.logits.cpu().numpy().copy()  # [steps, vocab] float32, detached from the buffer
        return finished_decode(self.name, tokens, logits, began=began, handed_off=handed_off,
                               pending_tokens=pending.size)


def _canonical(tensor: torch.Tensor) -> np.ndarray:
    """A cache view [kv_heads, positions, head_dim] (strided over the cache's slots) as a
    C-contiguous float32 numpy copy (bf16 -> float32 is exact)."""
    return np.ascontiguousarray(tensor.float().cpu().numpy())


# --------------------------------------------------------------------------------------------
# A random-weight model named by a file (the torch-llama lanes)
# --------------------------------------------------------------------------------------------

# A random-model file names its shape with Hugging Face's config keys, so the tools that read a
# model directory's config.json (RoPE base, head size, context) read it unchanged.
RANDOM_MODEL_SHAPE_KEYS = {
    "layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads", "head_dim": "head_dim", "intermediate": "intermediate_size",
    "vocab": "vocab_size", "max_positions": "max_position_embeddings", "rope_theta": "rope_theta",
    "rms_norm_eps": "rms_norm_eps", "tied_embeddings": "tie_word_embeddings",
}
RANDOM_MODEL_FIELDS = {"architecture", "weights", "seed", "dtype", "device", *RANDOM_MODEL_SHAPE_KEYS.values()}


def random_model(path: Path) -> tuple[LlamaShape, int, str, str]:
    """(shape, seed, dtype, device) a random-model file names; refuses any other field set."""
    from qualify.core.strict_json import read_strict_json

    document = read_strict_json(path, "random model")
    if not isinstance(document, dict) or set(document) != RANDOM_MODEL_FIELDS:
        found = sorted(document) if isinstance(document, dict) else type(document).__name__
        raise Refused(f"random model {path}: fields: found {found}, expected {sorted(RANDOM_MODEL_FIELDS)}")
    if document["architecture"] != "llama":
        raise Refused(f"random model {path}: architecture: found {document['architecture']!r}, expected 'llama'")
    shape = LlamaShape(**{name: document[key] for name, key in RANDOM_MODEL_SHAPE_KEYS.items()})
    return shape, document["seed"], document["dtype"], document["device"]


@functools.cache
def random_model_weights(path: Path) -> LlamaWeights:
    """The weights a random-model file names (shape, dtype, device, seed), drawn once per process:
    a lane's in-process producer and its consumer share them (read-only)."""
    shape, seed, dtype, device = random_model(path)
    return random_weights(shape, seed=seed, dtype=dtype, device=device)

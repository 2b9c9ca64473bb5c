"""Qualification at scale: the native-text recipe on a Llama-3-8B-shaped model on one GPU.

One process, one GPU. Random bf16 weights of Llama-3 8B's shape (32 layers, hidden 4096, 32
heads, 8 KV heads, head_dim 128, intermediate 14336, vocab 128256, RoPE theta 500000, untied LM
head) are drawn on the GPU from the contract's seed (nothing can be downloaded). The consumer is
the compact :mod:`qualify.engines.torch_llama` engine (static KV cache, CUDA-graph decode). The
producer is named by the contract profile, and runs on the very same weight tensors (read-only;
neither engine writes them):

* ``llama3-8b`` (the measured run): a second compact-engine instance with its own cache, i.e.
  a prefill/decode split of one engine, like the project's ``vllm-to-vllm`` lane;
* ``llama3-8b-transformers``: Hugging Face ``transformers`` ``LlamaModel`` (sdpa), handed views
  of the compact engine's fused matrices. It rotates q/k in bf16 where the compact engine
  rotates in float32, and on random weights that drift flips near-tie greedy choices at once
  (its calibration: first divergence at token 1): the harness refuses it, localised;
* ``tiny``: a 2-layer shape on the CPU (transformers producer), a smoke run of the same code.

The recipe, as ``qualify --recipe native-text`` runs it: a 2048-token prompt (seeded generator,
digest pinned in the contract); the producer prefills ``prompt[:2047]``; the consumer feeds the
pending token and decodes 256 greedy tokens keeping every float32 logit row; the cold reference
is the consumer's own prefill plus the same decode (once per run, like ``--reference-once``);
three ordered handoffs. Per handoff:

1. producer prefill -> 64 K/V tensors, 268 MB bf16, on the GPU;
2. transport: the tensors are gathered, in the order :func:`qualify.handoff.wire.payload_layout`
   gives, into a device staging buffer and copied once into a pinned host buffer that is the
   safetensors payload (``BF16`` tensors); the producer seals those bytes in place with
   :func:`qualify.handoff.wire.seal_handoff_parts` (tensor digests on 16 threads, tree digest,
   seams, handoff-manifest v3, HMAC-SHA256 under a fresh run key);
3. the consumer opens the same host bytes with :func:`qualify.handoff.wire.open_handoff` (MAC,
   manifest schema, tree digest re-hashed on 16 threads, layout, seams, identity, cache identity,
   geometry, prompt, ids); only then installs those bytes (one host to device copy, then into its
   static cache; a non-finite value is refused);
4. decode 256 tokens on the GPU (graph replays), full logits in a device buffer; if the tokens
   diverge, a teacher-forced decode on the same KV (engine time, listed apart);
5. :func:`qualify.evidence.compare_device.start_comparison` against the cold branch, on the GPU (logit
   deltas, margins, KV deltas); only summaries and, for the digests, the logit block cross to the
   host (hashed on threads while the next sample decodes);
6. :func:`qualify.evidence.records.sample_record`, :func:`qualify.judge.judge_sample`, the receipt
   (:class:`qualify.archive.receipts.ReceiptWriter`); finally :func:`qualify.judge.judge_summary`.

The rule (rung 2, bounded drift) is fixed before a measured run in
``bench/gpu_scale_contract.json``; each profile's ``basis`` says which ``--calibrate`` run of
this script measured it (bounds 1 % above the observed envelope, three significant digits:
:func:`qualify.run.qualification.propose_bound`; a floor of 1e-6 / 1e-7 where nothing was observed).

Timing, all in the same run: engine time is the producer's prefills and the consumer's decodes
plus the reference prefill and decode, each timed with CUDA events around the pure engine call.
The qualification wall runs from contract load to receipt written, excluding the one-time CUDA
context, weight generation and warm-up (first calls, graph capture), which are reported beside
it; the overhead ratio is wall / engine. Device-to-device copy bandwidth (GB/s counting read +
write) and single-thread SHA-256 are measured after the wall, on the same GPU and host.

    python bench/gpu_scale.py [--receipts DIR] [--json PATH]           # the measured run (GPU)
    python bench/gpu_scale.py --calibrate [--repetitions 5]            # proposes the bounds
    python bench/gpu_scale.py --profile llama3-8b-transformers         # the cross-engine lane
    python bench/gpu_scale.py --profile tiny                           # CPU smoke, tiny shape
    python bench/gpu_scale.py --fault kv-ulp|block-order               # must fail, localised

Last line: ``gpu_scale_overhead_ratio: <wall / engine>``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np

from qualify import __version__
from qualify.core.assets import prompt_sha256
from qualify.core.digests import canonical_sha256, strict_json_loads
from qualify.core.errors import HandoffRefused, Refused, one_line

CONTRACT_SCHEMA = "trust-ladder.gpu-scale-contract.v1"
DEFAULT_CONTRACT = REPO_ROOT / "bench" / "gpu_scale_contract.json"
PRODUCERS = ("transformers-sdpa", "torch-llama")
KV_HASH_THREADS = max(2, min(16, os.cpu_count() or 2))
LOGIT_HASH_THREADS = max(2, min(6, os.cpu_count() or 2))
COPY_BYTES = {"cuda": 2 << 30, "cpu": 256 << 20}  # device-to-device copy bandwidth probe
CALIBRATION_REPETITIONS = 5
# What a calibration proposes when it observed no drift at all (a bounded-drift rule needs
# positive bounds): the floor the project's vllm-to-vllm lane uses, far below any real drift.
FLOOR_BOUNDS = (1e-6, 1e-7)


# --------------------------------------------------------------------------- the contract


@dataclass(frozen=True)
class Profile:
    """One validated profile of the contract (what the run is checked against)."""

    name: str
    document: dict[str, Any]  # the identity stored in the receipt (digest = identity_sha256)
    lane: str
    device: str
    dtype: str
    seed: int
    shape: Any  # qualify.engines.torch_llama.LlamaShape
    producer: str
    prompt_seed: int
    prompt_tokens: int
    prompt_sha256: str
    handoff_positions: int
    output_tokens: int
    repetitions: int
    maximum_absolute: float | None
    maximum_mean_absolute: float | None
    kv_envelope: list[tuple[float, float]] | None

    @property
    def identity_sha256(self) -> str:
        return canonical_sha256(self.document)


def _field(document: dict[str, Any], key: str, where: str, kind: str) -> Any:
    """One field, type-checked; refuses with the field's path."""
    if key not in document:
        raise Refused(f"{where}.{key}: missing")
    value = document[key]
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool) and value >= 0,
        "positive": isinstance(value, int) and not isinstance(value, bool) and value > 0,
        "number": isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0,
        "bool": isinstance(value, bool),
        "str": isinstance(value, str) and bool(value),
        "dict": isinstance(value, dict),
    }[kind]
    if not ok:
        raise Refused(f"{where}.{key}: found {value!r}, expected a {kind.replace('int', 'non-negative integer')}")
    return value


def load_contract(path: Path, profile_name: str, calibrating: bool) -> Profile:
    """Read and validate the contract's profile (fail closed, one line naming the field)."""
    from qualify.engines.torch_llama import DTYPES, LlamaShape

    try:
        document = strict_json_loads(Path(path).read_bytes())
    except FileNotFoundError:
        raise Refused(f"--contract {path}: no such file") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise Refused(f"--contract {path}: not a JSON document ({one_line(str(exc))})") from None
    if not isinstance(document, dict) or document.get("schema") != CONTRACT_SCHEMA:
        raise Refused(f"--contract {path}: schema: expected {CONTRACT_SCHEMA!r}")
    profiles = _field(document, "profiles", "contract", "dict")
    if profile_name not in profiles or not isinstance(profiles[profile_name], dict):
        raise Refused(f"--profile: found {profile_name!r}, the contract has {', '.join(sorted(profiles))}")
    body = profiles[profile_name]
    where = f"profiles.{profile_name}"
    lane = _field(body, "lane", where, "str")
    if _field(body, "recipe", where, "str") != "native-text":
        raise Refused(f"{where}.recipe: expected 'native-text'")
    device = _field(body, "device", where, "str")
    if device not in ("cuda", "cpu"):
        raise Refused(f"{where}.device: found {device!r}, expected 'cuda' or 'cpu'")
    producer = _field(body, "producer", where, "str")
    if producer not in PRODUCERS:
        raise Refused(f"{where}.producer: found {producer!r}, expected one of {', '.join(PRODUCERS)}")
    model = _field(body, "model", where, "dict")
    mwhere = f"{where}.model"
    dtype = _field(model, "dtype", mwhere, "str")
    if dtype not in DTYPES:
        raise Refused(f"{mwhere}.dtype: found {dtype!r}, expected one of {', '.join(DTYPES)}")
    shape = LlamaShape(**{key: _field(model, key, mwhere, kind) for key, kind in (
        ("layers", "positive"), ("hidden", "positive"), ("heads", "positive"), ("kv_heads", "positive"),
        ("head_dim", "positive"), ("intermediate", "positive"), ("vocab", "positive"),
        ("max_positions", "positive"), ("rope_theta", "number"), ("rms_norm_eps", "number"),
        ("tied_embeddings", "bool"))})
    prompt = _field(body, "prompt", where, "dict")
    prompt_tokens = _field(prompt, "tokens", f"{where}.prompt", "positive")
    handoff_positions = _field(body, "handoff_positions", where, "positive")
    if handoff_positions != prompt_tokens - 1:
        raise Refused(f"{where}.handoff_positions: found {handoff_positions}, the recipe hands off "
                      f"prompt.tokens - 1 = {prompt_tokens - 1} (one pending token)")
    output_tokens = _field(body, "output_tokens", where, "positive")
    if prompt_tokens + output_tokens > shape.max_positions:
        raise Refused(f"{where}.output_tokens: prompt plus output exceed model.max_positions")
    repetitions = _field(body, "repetitions", where, "positive")
    if repetitions != 3:
        raise Refused(f"{where}.repetitions: found {repetitions}, the recipe runs 3 ordered handoffs")
    logits = _field(body, "full_logits", where, "dict")
    if logits.get("mode") != "bounded-drift":
        raise Refused(f"{where}.full_logits.mode: expected 'bounded-drift'")
    bounds: list[float | None] = []
    for key in ("maximum_absolute", "maximum_mean_absolute"):
        value = logits.get(key)
        if value is None and calibrating:
            bounds.append(None)
            continue
        if value is None:
            raise Refused(f"{where}.full_logits.{key}: null; run --calibrate first and fix the bounds")
        bounds.append(_field(logits, key, f"{where}.full_logits", "number"))
    envelope = body.get("kv_envelope")
    if envelope is not None:
        if not (isinstance(envelope, list) and len(envelope) == shape.layers and all(
                isinstance(pair, list) and len(pair) == 2 and all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
                    for x in pair) for pair in envelope)):
            raise Refused(f"{where}.kv_envelope: expected null or {shape.layers} [K, V] pairs of finite numbers >= 0")
        envelope = [(float(k), float(v)) for k, v in envelope]
    _field(body, "basis", where, "str")
    identity = {"schema": CONTRACT_SCHEMA, "profile": profile_name, **body}
    profile = Profile(
        name=profile_name, document=identity, lane=lane, device=device, dtype=dtype,
        seed=_field(model, "seed", mwhere, "int"), shape=shape, producer=producer,
        prompt_seed=_field(prompt, "seed", f"{where}.prompt", "int"), prompt_tokens=prompt_tokens,
        prompt_sha256=_field(prompt, "sha256", f"{where}.prompt", "str"),
        handoff_positions=handoff_positions, output_tokens=output_tokens, repetitions=repetitions,
        maximum_absolute=bounds[0], maximum_mean_absolute=bounds[1], kv_envelope=envelope)
    found = prompt_sha256(make_prompt(profile.prompt_seed, prompt_tokens, shape.vocab))
    if found != profile.prompt_sha256:
        raise Refused(f"{where}.prompt.sha256: the seeded prompt hashes to {found}, the contract pins "
                      f"{profile.prompt_sha256}")
    return profile


def make_prompt(seed: int, tokens: int, vocab: int) -> np.ndarray:
    """The fixed prompt: ``tokens`` ids uniform in 0..vocab-1 from numpy's PCG64 seeded ``seed``."""
    return np.random.default_rng(seed).integers(0, vocab, size=tokens, dtype=np.int64)


# --------------------------------------------------------------------------- clocks


class DeviceClock:
    """Seconds of device work between :meth:`start` and :meth:`stop`: CUDA events on the GPU
    (read later without a sync in between), wall time on the CPU (which runs synchronously)."""

    def __init__(self, device: str) -> None:
        import torch

        self.torch, self.cuda = torch, device == "cuda"

    def start(self) -> Any:
        if self.cuda:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, started: Any) -> Callable[[], float]:
        """A function returning the elapsed seconds (it synchronises on the stop event)."""
        if self.cuda:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()

            def seconds() -> float:
                event.synchronize()
                return started.elapsed_time(event) / 1000.0
            return seconds
        elapsed = time.perf_counter() - started
        return lambda: elapsed

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()


# --------------------------------------------------------------------------- producers


def transformers_producer(weights: Any, device: str) -> tuple[Callable[[Any], tuple[list, list]], dict[str, str]]:
    """Hugging Face ``LlamaModel`` (sdpa) on the compact engine's weight storage: built on the
    meta device, then every parameter assigned a view of the shared tensors (no copy)."""
    import torch
    import transformers
    from transformers import DynamicCache, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaModel, LlamaRotaryEmbedding

    shape = weights.shape
    config = LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        max_position_embeddings=shape.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": float(shape.rope_theta)},
        rms_norm_eps=shape.rms_norm_eps, tie_word_embeddings=shape.tied_embeddings,
        attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaModel(config)
    model.requires_grad_(False)
    state = {name[len("model."):]: tensor for name, tensor in weights.hf_state_dict().items()
             if name.startswith("model.")}
    model.load_state_dict(state, assign=True, strict=True)
    model.rotary_emb = LlamaRotaryEmbedding(config=config).to(device)
    model.eval()
    if model.embed_tokens.weight.data_ptr() != weights.embed.data_ptr():
        raise Refused("transformers producer: embedding is not the shared weight tensor")

    def prefill(ids: Any) -> tuple[list, list]:
        cache = DynamicCache(config=config)
        with torch.inference_mode():
            model(input_ids=ids[None], past_key_values=cache, use_cache=True)
        if len(cache.layers) != shape.layers or cache.get_seq_length() != ids.shape[0]:
            raise Refused(f"transformers producer: cache has {len(cache.layers)} layers of "
                          f"{cache.get_seq_length()} positions, expected {shape.layers} of {ids.shape[0]}")
        return [layer.keys[0] for layer in cache.layers], [layer.values[0] for layer in cache.layers]

    facts = {"name": "transformers-LlamaModel-sdpa",
             "version": f"transformers-{transformers.__version__}+torch-{torch.__version__}",
             "abi": f"hf-llama-sdpa+bf16-rope+{weights.dtype}".replace("torch.", "")}
    return prefill, facts


def compact_producer(consumer: Any) -> tuple[Callable[[Any], tuple[list, list]], dict[str, str]]:
    """A second compact engine on the same weights (its own cache): same arithmetic as the
    consumer's prefill, so its handoffs should reproduce the cold KV exactly."""
    engine = consumer.sharing_weights(cuda_graph=False)

    def prefill(ids: Any) -> tuple[list, list]:
        engine.prefill_device(ids)
        return engine.kv_device()

    return prefill, {"name": engine.name, "version": engine.version, "abi": engine.abi}


# --------------------------------------------------------------------------- producer faults

SCALE_FAULTS = ("kv-ulp", "block-order")
"""Producer-side faults (``--fault``), as in :mod:`qualify.engines.faults`, applied to the producer's KV on
the device after its prefill and before sealing: the MAC verifies, so only the comparison can
catch them."""


def fault_site(layers: int, positions: int) -> tuple[int, int, int, int]:
    """(layer, head, position, dim) of the single-element fault: qualify.engines.faults' site, clamped."""
    from qualify.engines.faults import FAULT_DIM, FAULT_HEAD, FAULT_LAYER, FAULT_POSITION

    return min(FAULT_LAYER, layers - 1), FAULT_HEAD, min(FAULT_POSITION, positions - 1), FAULT_DIM


def apply_fault(name: str, keys: list[Any], values: list[Any]) -> tuple[list[Any], list[Any], str]:
    """The producer's KV with fault ``name`` applied (copies of the touched tensors), and where."""
    import torch

    from qualify.engines.faults import BLOCK_POSITIONS, SWAPPED_BLOCKS

    keys = list(keys)
    if name == "kv-ulp":
        layer, head, position, dim = fault_site(len(keys), keys[0].shape[1])
        keys[layer] = keys[layer].clone()
        bits = keys[layer].view({2: torch.int16, 4: torch.int32}[keys[layer].element_size()])
        bits[head, position, dim] += 1  # the next representable magnitude: one ULP
        return keys, values, f"layer {layer} K head {head} position {position} dim {dim} moved by one ULP"
    if name == "block-order":
        first, second = (block * BLOCK_POSITIONS for block in SWAPPED_BLOCKS)
        if keys[0].shape[1] < second + BLOCK_POSITIONS:
            raise Refused(f"--fault block-order: needs {second + BLOCK_POSITIONS} handed-off positions")
        for index, key in enumerate(keys):
            swapped = key.clone()
            swapped[:, first:first + BLOCK_POSITIONS] = key[:, second:second + BLOCK_POSITIONS]
            swapped[:, second:second + BLOCK_POSITIONS] = key[:, first:first + BLOCK_POSITIONS]
            keys[index] = swapped
        return keys, values, f"K positions {first}..{second + BLOCK_POSITIONS - 1}: blocks {SWAPPED_BLOCKS} swapped, V kept"
    raise Refused(f"--fault: found {name!r}, expected one of {', '.join(SCALE_FAULTS)}")


# --------------------------------------------------------------------------- the run


@dataclass
class Figures:
    """Everything measured; printed as a table and written as JSON."""

    values: dict[str, Any] = field(default_factory=dict)

    def add(self, name: str, value: Any) -> None:
        self.values[name] = value


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Device-to-device copy GB/s, counting bytes read plus bytes written (best of 10)."""
    import torch

    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    clock, best = DeviceClock(device), math.inf
    for _ in range(11):  # the first is a warm-up
        started = clock.start()
        target.copy_(source)
        best = min(best, clock.stop(started)())
    return 2 * nbytes / best / 1e9


def sha256_rate(data: np.ndarray) -> float:
    """Single-thread hashlib.sha256 GB/s over ``data`` (best of 3)."""
    best = math.inf
    for _ in range(3):
        began = time.perf_counter()
        hashlib.sha256(memoryview(data)).digest()
        best = min(best, time.perf_counter() - began)
    return data.nbytes / best / 1e9


def run(options: argparse.Namespace) -> dict[str, Any]:
    import torch

    from qualify.archive.receipts import ReceiptWriter
    from qualify.core.kv import KVCache, KVGeometry
    from qualify.engines.torch_llama import TorchLlama, random_weights
    from qualify.evidence.compare_device import DeviceBranch, LogitDigester, prepare_cold, start_comparison
    from qualify.evidence.records import BoundedDriftRule, failed_sample_record, record_json, sample_record
    from qualify.handoff.wire import Handoff, mint_run_key, open_handoff, payload_layout, seal_handoff_parts
    from qualify.judge import Verdict, judge_sample, judge_summary
    from qualify.run.qualification import comparison_bounds, propose_bound

    figures = Figures()
    calibrating = options.calibrate
    if calibrating and options.fault is not None:
        raise Refused("--fault: a calibration measures a lane as it is; run the fault without --calibrate")
    total_began = time.perf_counter()
    profile = load_contract(options.contract, options.profile, calibrating)
    contract_s = time.perf_counter() - total_began
    device = profile.device
    if device == "cuda" and not torch.cuda.is_available():
        raise Refused(f"profile {profile.name}: device cuda, but torch sees no CUDA device "
                      f"(run --profile tiny on a CPU)")
    repetitions = options.repetitions if calibrating else profile.repetitions
    if isinstance(repetitions, int) and repetitions < 1:
        raise Refused(f"--repetitions: found {repetitions}, expected at least 1")
    clock = DeviceClock(device)
    shape, handoff, steps = profile.shape, profile.handoff_positions, profile.output_tokens
    if device == "cpu":
        torch.set_num_threads(1)  # a smoke run on a shared CPU: no thread oversubscription

    # ---- one-time setup, outside the qualification wall (reported beside it) ----------------
    began = time.perf_counter()
    if device == "cuda":
        torch.cuda.init()
        torch.empty(1, device=device)  # the CUDA context
    cuda_init_s = time.perf_counter() - began
    began = time.perf_counter()
    weights = random_weights(shape, seed=profile.seed, dtype=profile.dtype, device=device)
    fingerprint = weights.fingerprint()
    clock.sync()
    weights_s = time.perf_counter() - began
    began = time.perf_counter()
    consumer = TorchLlama(weights, cache_positions=profile.prompt_tokens + steps, max_decode_steps=steps)
    producer_prefill, producer_facts = (transformers_producer(weights, device) if profile.producer == "transformers-sdpa"
                                        else compact_producer(consumer))
    consumer_facts = {"name": consumer.name, "version": consumer.version, "abi": consumer.abi}
    warm_prompt = torch.from_numpy(make_prompt(profile.prompt_seed + 1, profile.prompt_tokens, shape.vocab)).to(device)
    producer_prefill(warm_prompt[:handoff])
    consumer.prefill_device(warm_prompt[:handoff])
    consumer.warm_up()
    warm_run = consumer.decode_device(warm_prompt[handoff:], min(steps, 4))
    digester = LogitDigester(LOGIT_HASH_THREADS)
    # One small comparison loads the comparison's kernels (lazy CUDA module loading costs ~0.1 s
    # at the first call) and starts the digest threads, as an engine's warm-up loads its own.
    warm_branch = DeviceBranch(warm_run.tokens.clone(), warm_run.logits.clone())
    warm_kv = consumer.kv_device()
    start_comparison(warm_branch, prepare_cold(warm_branch, "raw", digester), "raw", maximum_absolute=1.0,
                     maximum_mean_absolute=1.0, digester=digester, teacher_forced_logits=warm_branch.logits,
                     handoff_kv=warm_kv, own_kv=warm_kv).result()
    clock.sync()
    warmup_s = time.perf_counter() - began

    # ---- the qualification wall: from here to the receipt (plus the contract load above) -----
    wall_began = time.perf_counter()
    pinned = device == "cuda"
    geometry = KVGeometry(shape.layers, shape.kv_heads, shape.head_dim, handoff, profile.dtype)
    layout = payload_layout(geometry)
    payload_tensor = torch.empty(layout.size, dtype=torch.uint8, pin_memory=pinned)
    payload = payload_tensor.numpy()
    payload[:len(layout.prefix)] = np.frombuffer(layout.prefix, dtype=np.uint8)
    start = len(layout.prefix)
    payload_data = payload_tensor[start:]  # the tensors, in layout order
    tensor_shape = (shape.kv_heads, handoff, shape.head_dim)
    # The producer's KV as the wire sees it: numpy views of the pinned payload (sealed in place).
    host_tensors = {name: payload[begin:end].view(np.dtype(profile.dtype)).reshape(tensor_shape)
                    for name, (begin, end) in layout.offsets.items()}
    host_kv = KVCache([host_tensors[f"layers.{i}.k"] for i in range(shape.layers)],
                      [host_tensors[f"layers.{i}.v"] for i in range(shape.layers)])
    # A device staging buffer in the same layout: the producer's 64 tensors are gathered into it
    # (device copies), so the payload crosses to the host in one copy, and back in one.
    staging = torch.empty(payload_data.shape[0], dtype=torch.uint8, device=device)
    staged = {name: staging[begin - start:end - start].view(weights.dtype).view(tensor_shape)
              for name, (begin, end) in layout.offsets.items()}
    digester.reserve(steps, shape.vocab, 2, pinned=pinned)
    prompt = torch.from_numpy(make_prompt(profile.prompt_seed, profile.prompt_tokens, shape.vocab)).to(device)
    prompt_host = prompt.cpu().numpy()
    handed_prompt_sha256 = prompt_sha256(prompt_host[:handoff])
    cache_identity = canonical_sha256({"lane": profile.lane, "producer": producer_facts,
                                       "consumer_abi": consumer.abi, "model": profile.document["model"]})
    rule = None if calibrating else BoundedDriftRule(
        repetitions=profile.repetitions, output_tokens=steps, maximum_absolute=profile.maximum_absolute,
        maximum_mean_absolute=profile.maximum_mean_absolute, drift_graded=True)
    maximum_absolute, maximum_mean_absolute = comparison_bounds(rule)
    key = mint_run_key()
    archive = Path(options.receipts) if options.receipts else Path(tempfile.mkdtemp(prefix="gpu-scale-receipts-"))
    command = ["python", "bench/gpu_scale.py", *sys.argv[1:]]
    device_name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    engine: dict[str, list[float]] = {"producer prefill": [], "consumer decode": [], "reference prefill": [],
                                      "reference decode": [], "teacher-forced decode": []}
    harness: dict[str, list[float]] = {name: [] for name in (
        "transport (gather, device to pinned host)", "seal (hash, tree, manifest, MAC)", "verify (MAC, manifest, re-hash)",
        "install (host to device, into the cache, finiteness)", "compare on device (+ summaries to host)",
        "digest wait (critical path)", "record, judge, receipt")}
    compare_rates: list[float] = []
    records: list[dict[str, Any]] = []
    verdicts: list[Verdict] = []

    with ReceiptWriter(archive, command_line=command, identity=profile.document, recipe="native-text",
                       lane=profile.lane, rule=rule, identity_sha256=profile.identity_sha256,
                       versions={"harness": __version__, "producer": producer_facts, "consumer": consumer_facts,
                                 "device": device_name, "weights_fingerprint": fingerprint,
                                 "weights": f"random normal(0, 0.02) seed {profile.seed}, {profile.dtype}, "
                                            f"torch.Generator on {device}"}) as receipt:
        receipt.log(f"profile {profile.name}: {profile.producer} -> {consumer.name} on {device_name}; "
                    f"weights fingerprint {fingerprint}; {'calibration' if calibrating else 'qualification'}")

        # reference: the consumer's own prefill and decode (once per run)
        started = clock.start()
        consumer.prefill_device(prompt[:handoff])
        prefill_time = clock.stop(started)
        reference_keys, reference_values = consumer.kv_device()
        own_keys = [k.clone() for k in reference_keys]  # the install of each handoff overwrites them
        own_values = [v.clone() for v in reference_values]
        started = clock.start()
        cold_run = consumer.decode_device(prompt[handoff:], steps)
        decode_time = clock.stop(started)
        cold = DeviceBranch(cold_run.tokens.clone(), cold_run.logits.clone())
        engine["reference prefill"].append(prefill_time())
        engine["reference decode"].append(decode_time())
        cold_reference = prepare_cold(cold, "raw", digester)
        recompute_s = engine["reference prefill"][0] + engine["reference decode"][0]
        receipt.log(f"reference computed: {steps} tokens, prefill {engine['reference prefill'][0]:.3f} s, "
                    f"decode {engine['reference decode'][0]:.3f} s")

        finish_previous: Callable[[], None] | None = None
        for repetition in range(1, repetitions + 1):
            request_id = f"sample-{repetition}"
            started = clock.start()
            keys, values = producer_prefill(prompt[:handoff])
            compute_s = clock.stop(started)()  # waits for the prefill, so transport times only itself
            if options.fault is not None:
                keys, values, where = apply_fault(options.fault, keys, values)
                receipt.log(f"{request_id}: producer fault {options.fault}: {where}")
            began = time.perf_counter()
            for index in range(shape.layers):
                staged[f"layers.{index}.k"].copy_(keys[index])
                staged[f"layers.{index}.v"].copy_(values[index])
            payload_data.copy_(staging, non_blocking=True)
            clock.sync()
            transport_s = time.perf_counter() - began
            engine["producer prefill"].append(compute_s)
            harness["transport (gather, device to pinned host)"].append(transport_s)
            del keys, values
            began = time.perf_counter()
            sealed = seal_handoff_parts(
                host_kv, key=key, identity_sha256=profile.identity_sha256, target_cache_identity=cache_identity,
                producer_mode="native", lane=profile.lane, prompt_sha256=handed_prompt_sha256,
                run_id=receipt.run_id, request_id=request_id, compute_s=compute_s, digest_threads=KV_HASH_THREADS)
            harness["seal (hash, tree, manifest, MAC)"].append(time.perf_counter() - began)
            began = time.perf_counter()
            try:
                # The sealed parts are views of ``payload``, so the contiguous payload is that buffer.
                opened = open_handoff(
                    Handoff(sealed.manifest_bytes, sealed.mac, payload), key=key,
                    expected_identity_sha256=profile.identity_sha256, expected_cache_identity=cache_identity,
                    expected_geometry=geometry, expected_prompt_sha256=handed_prompt_sha256,
                    expected_run_id=receipt.run_id, expected_request_id=request_id,
                    digest_threads=KV_HASH_THREADS)
                tree = opened.manifest.payload_tree_sha256
            except HandoffRefused as exc:
                if finish_previous is not None:  # keep the receipt's samples in order
                    finish_previous()
                    finish_previous = None
                record = failed_sample_record(repetition, f"handoff refused: {one_line(str(exc))}",
                                              payload_bytes=layout.size)
                receipt.add_sample(record)
                records.append(record_json(record))
                continue
            verify_s = time.perf_counter() - began
            harness["verify (MAC, manifest, re-hash)"].append(verify_s)
            began = time.perf_counter()
            staging.copy_(payload_data, non_blocking=True)  # the verified host bytes, in one copy
            consumer.install_device([staged[f"layers.{i}.k"] for i in range(shape.layers)],
                                    [staged[f"layers.{i}.v"] for i in range(shape.layers)])
            install_s = time.perf_counter() - began
            harness["install (host to device, into the cache, finiteness)"].append(install_s)

            started = clock.start()
            branch = consumer.decode_device(prompt[handoff:], steps)
            decode_time = clock.stop(started)
            if finish_previous is not None:  # the previous sample's record, while the GPU decodes
                finish_previous()
            decode_s = decode_time()
            engine["consumer decode"].append(decode_s)

            teacher_forced = None
            handoff_branch = DeviceBranch(branch.tokens, branch.logits)
            if not torch.equal(branch.tokens, cold.tokens):
                # Rows after a divergence compare like with like only when the handoff branch is
                # fed the cold tokens: keep the free run, then decode again on the same KV.
                handoff_branch = DeviceBranch(branch.tokens.clone(), branch.logits.clone())
                started = clock.start()
                forced_run = consumer.decode_device(prompt[handoff:], steps, forced=cold.tokens)
                engine["teacher-forced decode"].append(clock.stop(started)())
                teacher_forced = forced_run.logits
            began = time.perf_counter()
            pending = start_comparison(
                handoff_branch, cold_reference, "raw", maximum_absolute=maximum_absolute,
                maximum_mean_absolute=maximum_mean_absolute, digester=digester,
                teacher_forced_logits=teacher_forced, handoff_kv=consumer.kv_device(),
                own_kv=(own_keys, own_values))
            harness["compare on device (+ summaries to host)"].append(time.perf_counter() - began)
            compare_rates.append(pending.timings["logit_pass_bytes"] / pending.timings["logit_pass_s"] / 1e9)
            phases = {"producer_compute_s": compute_s, "serialize_s": harness["seal (hash, tree, manifest, MAC)"][-1], "transport_s": transport_s,
                      "verify_s": verify_s, "install_s": install_s, "decode_s": decode_s,
                      "recompute_s": recompute_s}

            def finish(pending=pending, repetition=repetition, phases=phases, tree=tree,
                       transport_s=transport_s) -> None:
                comparison = pending.result()
                harness["digest wait (critical path)"].append(pending.timings["digest_wait_s"])
                began = time.perf_counter()
                record = sample_record(
                    repetition=repetition, comparison=comparison, payload_sha256=tree,
                    payload_bytes=layout.size, payload_gbit_per_s=layout.size * 8 / transport_s / 1e9,
                    handed_off_positions=handoff, recomputed_positions=profile.prompt_tokens - handoff,
                    phases=phases, kv_envelope=profile.kv_envelope)
                document = record_json(record)
                records.append(document)
                receipt.add_sample(record)
                if rule is not None:
                    verdict = judge_sample(document, rule)
                    verdicts.append(verdict)
                    receipt.log(f"sample {repetition}: {verdict.headline}")
                else:
                    receipt.log(f"calibration sample {repetition}: max_abs {document['max_abs']!r}, "
                                f"mean_abs {document['mean_abs']!r}, tokens {document['token_agreement_rate']}")
                harness["record, judge, receipt"].append(time.perf_counter() - began)

            finish_previous = finish
        if finish_previous is not None:
            finish_previous()

        measured = [r for r in records if not r.get("error")]
        if rule is not None:
            verdict = judge_summary(records, rule)
        else:
            tokens_exact = bool(measured) and all(r["token_agreement_rate"] == 1.0 for r in measured)
            observed = (max((r["max_abs"] for r in measured), default=math.nan),
                        max((r["mean_abs"] for r in measured), default=math.nan))
            proposal = (propose_bound(observed[0]), propose_bound(observed[1]))
            floor = tokens_exact and observed == (0.0, 0.0)
            if floor:
                proposal = FLOOR_BOUNDS
            headline = (f"calibration of {profile.lane} over {len(records)} handoffs: observed max abs "
                        f"{observed[0]!r}, max mean abs {observed[1]!r}, tokens exact in every handoff: "
                        f"{tokens_exact}; proposed maximum_absolute {proposal[0]}, maximum_mean_absolute {proposal[1]}"
                        + (" (the floor: no drift was observed)" if floor else ""))
            verdict = Verdict(tokens_exact and len(measured) == len(records), headline, [headline])
            envelope = [[0.0, 0.0] for _ in range(shape.layers)]
            for document in measured:
                for item in document["localisation"]["kv_layer_max_abs"]:
                    pair = envelope[item["layer"]]
                    pair[0], pair[1] = max(pair[0], item["k"]), max(pair[1], item["v"])
            figures.add("calibration_observed_max_abs", observed[0])
            figures.add("calibration_observed_mean_abs", observed[1])
            figures.add("calibration_proposed_full_logits", {"mode": "bounded-drift", "maximum_absolute": proposal[0],
                                                              "maximum_mean_absolute": proposal[1]})
            figures.add("calibration_floor", floor)
            figures.add("calibration_kv_envelope", envelope)
        receipt_path = receipt.finalize(verdict)  # logs the verdict line itself
    wall_end = time.perf_counter()
    digester.close()

    # ---- baselines measured in the same run, after the wall -----------------------------------
    d2d_gbs = copy_bandwidth(device, COPY_BYTES[device])
    sha_gbs = sha256_rate(payload)

    engine_s = sum(sum(values) for values in engine.values())
    qualification_wall_s = contract_s + (wall_end - wall_began)
    # Everything in the wall that is neither engine nor a timed harness phase: buffer allocation,
    # receipt open and finalize, cold-branch preparation, the summary judgement, orchestration.
    other_s = qualification_wall_s - engine_s - sum(sum(values) for values in harness.values())
    hash_gbs = [layout.size / s / 1e9 for s in harness["seal (hash, tree, manifest, MAC)"]]
    verify_gbs = [layout.size / s / 1e9 for s in harness["verify (MAC, manifest, re-hash)"]]
    figures.add("profile", profile.name)
    figures.add("device", device_name)
    figures.add("producer", producer_facts)
    figures.add("consumer", consumer_facts)
    figures.add("mode", "calibration" if calibrating else "qualification")
    figures.add("fault", options.fault)
    figures.add("engine_seconds", {name: values for name, values in engine.items() if values})
    figures.add("engine_total_s", engine_s)
    figures.add("harness_seconds", {name: values for name, values in harness.items() if values})
    figures.add("harness_other_s", other_s)
    figures.add("setup_cuda_init_s", cuda_init_s)
    figures.add("setup_weights_s", weights_s)
    figures.add("setup_warmup_s", warmup_s)
    figures.add("contract_load_s", contract_s)
    figures.add("qualification_wall_s", qualification_wall_s)
    figures.add("total_wall_s", wall_end - total_began)
    figures.add("overhead_ratio", qualification_wall_s / engine_s)
    figures.add("overhead_ratio_with_setup", (wall_end - total_began) / engine_s)
    figures.add("d2d_copy_gbs_read_plus_write", d2d_gbs)
    figures.add("compare_gbs_logit_bytes_read", compare_rates)
    figures.add("compare_over_d2d", [rate / d2d_gbs for rate in compare_rates])
    figures.add("kv_payload_bytes", layout.size)
    figures.add("kv_seal_gbs", hash_gbs)
    figures.add("kv_verify_gbs", verify_gbs)
    figures.add("sha256_single_thread_gbs", sha_gbs)
    figures.add("kv_hash_threads", KV_HASH_THREADS)
    figures.add("logit_digest_thread_gbs", digester.hashed_bytes / max(digester.hash_seconds, 1e-9) / 1e9)
    figures.add("verdict", {"passed": verdict.passed, "headline": verdict.headline})
    figures.add("samples", [{**{key: record.get(key) for key in (
        "repetition", "token_agreement_rate", "max_abs", "mean_abs", "payload_sha256", "error")},
        "localisation": localisation_summary(record.get("localisation"))} for record in records])
    figures.add("receipt", str(receipt_path))
    return figures.values


# --------------------------------------------------------------------------- output


def localisation_summary(localisation: dict[str, Any] | None) -> dict[str, Any] | None:
    """The part of a record's localisation a reader checks first: first divergence, first
    rule-breaking row, and the first three K/V tensors above the lane's KV envelope."""
    if not localisation:
        return None
    return {"first_divergence_position": localisation.get("first_divergence_position"),
            "first_rule_breaking_row": localisation.get("first_rule_breaking_row"),
            "kv_over_envelope": (localisation.get("kv_over_envelope") or [])[:3]}


def print_report(values: dict[str, Any]) -> None:
    engine, harness = values["engine_seconds"], values["harness_seconds"]
    print(f"gpu_scale: profile {values['profile']} on {values['device']}; producer {values['producer']['name']} "
          f"({values['producer']['version']}), consumer {values['consumer']['abi']}")
    if values["fault"] is not None:
        print(f"producer fault: {values['fault']} (the run must fail, localised)")
    print(f"{'engine (CUDA events around the engine call)':58s} {'total s':>9s}  per call")
    for name, seconds in engine.items():
        print(f"  {name:56s} {sum(seconds):9.3f}  {' '.join(f'{s:.3f}' for s in seconds)}")
    print(f"  {'engine total':56s} {values['engine_total_s']:9.3f}")
    print(f"{'harness (wall)':58s} {'total s':>9s}  per sample")
    for name, seconds in harness.items():
        print(f"  {name:56s} {sum(seconds):9.3f}  {' '.join(f'{s:.4f}' for s in seconds)}")
    print(f"  {'other (buffers, receipt, cold preparation, summary)':56s} "
          f"{values['harness_other_s']:9.3f}")
    print(f"one-time setup outside the qualification wall: CUDA context {values['setup_cuda_init_s']:.3f} s, "
          f"weights {values['setup_weights_s']:.3f} s, "
          f"warm-up (producer and consumer first calls, graph capture) {values['setup_warmup_s']:.3f} s")
    print(f"qualification wall (contract load to receipt written, setup excluded): "
          f"{values['qualification_wall_s']:.3f} s; with setup: {values['total_wall_s']:.3f} s")
    print(f"overhead ratio wall / engine: {values['overhead_ratio']:.3f} (with setup "
          f"{values['overhead_ratio_with_setup']:.3f})")
    rates = values["compare_gbs_logit_bytes_read"]
    print(f"device-to-device copy: {values['d2d_copy_gbs_read_plus_write']:.1f} GB/s (read + write); "
          f"full-logit compare: {' '.join(f'{r:.1f}' for r in rates)} GB/s of logit bytes read, "
          f"ratio to the copy {' '.join(f'{r:.3f}' for r in values['compare_over_d2d'])}")
    print(f"KV payload {values['kv_payload_bytes']} bytes: seal (hash + tree + manifest + MAC) "
          f"{' '.join(f'{r:.2f}' for r in values['kv_seal_gbs'])} GB/s, verify "
          f"{' '.join(f'{r:.2f}' for r in values['kv_verify_gbs'])} GB/s on {values['kv_hash_threads']} threads; "
          f"single-thread hashlib.sha256 {values['sha256_single_thread_gbs']:.2f} GB/s "
          f"(seal ratio {min(values['kv_seal_gbs'], default=math.nan) / values['sha256_single_thread_gbs']:.2f}x at worst)")
    for sample in values["samples"]:
        if sample.get("error"):
            print(f"  sample {sample['repetition']}: FAILED {sample['error']}")
        else:
            print(f"  sample {sample['repetition']}: tokens agreed {sample['token_agreement_rate']}, max abs "
                  f"{sample['max_abs']!r}, mean abs {sample['mean_abs']!r}, payload {sample['payload_sha256'][:16]}")
            where = sample.get("localisation")
            if where:
                over = ", ".join(f"layer {item['layer']} {item['tensor']} position {item.get('position')} "
                                 f"delta {item['delta']:.4g} > {item['envelope']:.4g}" for item in where["kv_over_envelope"])
                print(f"    localised: first divergence {where['first_divergence_position']}, first rule-breaking "
                      f"row {where['first_rule_breaking_row']}; KV above envelope: {over or 'none'}")
    if "calibration_proposed_full_logits" in values:
        print(f"calibration: observed max abs {values['calibration_observed_max_abs']!r}, mean abs "
              f"{values['calibration_observed_mean_abs']!r}; proposed {json.dumps(values['calibration_proposed_full_logits'])}")
    print(f"verdict: {values['verdict']['headline']}")
    print(f"receipt: {values['receipt']}")
    print(f"gpu_scale_overhead_ratio: {values['overhead_ratio']:.3f}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contract", type=Path, default=DEFAULT_CONTRACT, help="the bench contract JSON")
    parser.add_argument("--profile", default="llama3-8b", help="contract profile (llama3-8b, or tiny for a CPU smoke run)")
    parser.add_argument("--receipts", type=Path, default=None, help="receipt archive (default: a new temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here as JSON")
    parser.add_argument("--calibrate", action="store_true", help="measure and propose bounds (no rule)")
    parser.add_argument("--fault", choices=SCALE_FAULTS,
                        help="corrupt the producer's KV before sealing (the run must fail, localised)")
    parser.add_argument("--repetitions", type=int, default=CALIBRATION_REPETITIONS,
                        help=f"handoffs of a calibration (default {CALIBRATION_REPETITIONS}); a qualification runs 3")
    return parser


def main(argv: list[str] | None = None) -> int:
    options = _parser().parse_args(argv)
    try:
        values = run(options)
    except Refused as exc:
        print(f"gpu_scale: refused: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except Exception as exc:  # a GPU error, out of memory...: one line, no traceback
        print(f"gpu_scale: failed: {type(exc).__name__}: {one_line(str(exc))}", file=sys.stderr)
        return 1
    if options.json is not None:
        options.json.write_text(json.dumps(values, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
    print_report(values)
    return 0 if values["verdict"]["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

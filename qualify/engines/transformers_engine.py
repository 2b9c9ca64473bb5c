"""Hugging Face ``transformers`` (torch, CPU or CUDA) behind the harness's Engine protocol.

:class:`TransformersEngine` runs the shipped Llama checkpoint with ``LlamaForCausalLM`` in float32,
bfloat16 or float16, on the CPU or an NVIDIA GPU, and speaks the same producer and consumer
interfaces as the numpy reference engine:

* ``prefill(tokens)`` runs the base model over ``tokens`` with a fresh ``DynamicCache`` and returns
  that cache in the canonical layout (per layer K post-RoPE and V, float32 numpy
  ``[kv_heads, positions, head_dim]``). Hugging Face caches K after RoPE, as
  ``[batch, kv_heads, positions, head_dim]``; the tests check it against the reference engine.
* ``decode(kv, pending, n)`` checks the canonical KV (geometry, float32, finite), casts it to the
  model dtype and installs it into a ``DynamicCache`` layer by layer (``cache.update``), feeds the
  pending tokens as one block, then generates ``n`` greedy tokens (argmax, ties to the lowest id),
  one token per forward, keeping every full logit row as float32 ``[n, vocab]``.
* ``teacher_forced(kv, pending, forced)`` runs the same loop feeding ``forced`` instead of the
  argmax, so decode equals teacher forcing on its own tokens bit for bit.

The loop keeps tokens and logits on the model's device (``_run_on_device``); only the public
methods copy to the host. A bf16/fp16 consumer rounds an installed float32 KV to its own dtype;
values beyond float16's range are refused rather than turned into infinities.

Every refusal is :class:`qualify.core.errors.Refused` with one line: unknown device, dtype or attention
implementation, CUDA asked for where there is none, TF32 asked for off CUDA, a KV whose layers,
shape, dtype or values do not fit this model, bad token arrays.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np

from qualify.core import assets
from qualify.core.errors import Refused, one_line
from qualify.core.kv import KVCache, check_kv_fits
from qualify.engines.base import DecodeResult, GreedyDecoder, ModelGeometry, finished_decode
from qualify.engines.checkpoint import WEIGHTS_FILE, load_config, model_files_view

# Bump whenever this file's numerics change (how KV is installed, how pending tokens are fed).
ABI_VERSION = "transformers-torch-abi-1"
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")
FLOAT16_MAX = float(np.finfo(np.float16).max)


def _torch() -> Any:
    """Import torch lazily: the harness runs without the torch extra."""
    try:
        import torch
        import transformers  # noqa: F401  (checked here so the refusal names the extra)
    except ImportError as exc:
        raise Refused(f"transformers engine: needs the torch extra (pip install -e '.[torch]'): {exc}") from None
    return torch


def check_options(device: str, dtype: str, tf32: bool, attn_implementation: str) -> None:
    """Refuse constructor options the engine does not implement (before anything is loaded)."""
    if device not in DEVICES:
        raise Refused(f"transformers engine device: expected one of {', '.join(DEVICES)}, found {device!r}")
    if dtype not in DTYPES:
        raise Refused(f"transformers engine dtype: expected one of {', '.join(DTYPES)}, found {dtype!r}")
    if attn_implementation not in ATTENTION_IMPLEMENTATIONS:
        raise Refused(f"transformers engine attn_implementation: expected one of "
                      f"{', '.join(ATTENTION_IMPLEMENTATIONS)}, found {attn_implementation!r}")
    if not isinstance(tf32, bool):
        raise Refused(f"transformers engine tf32: expected true or false, found {tf32!r}")
    if tf32 and device != "cuda":
        raise Refused(f"transformers engine tf32: TF32 exists only on CUDA, found device {device!r}")


def device_kind(torch: Any, device: str) -> str:
    """What the arithmetic runs on, for the abi: ``cpu`` or ``cuda-<cuda version>-<GPU name>``."""
    if device == "cpu":
        return "cpu"
    name = torch.cuda.get_device_name(0).replace(" ", "-")
    return f"cuda-{torch.version.cuda}-{name}"


def engine_version() -> str:
    """``transformers-<version>+torch-<version>`` of this process (what the identity pins)."""
    torch = _torch()
    import transformers

    return f"transformers-{transformers.__version__}+torch-{torch.__version__}"


def engine_abi(device: str, dtype: str, tf32: bool, attn_implementation: str = "sdpa") -> str:
    """The ABI an engine with these options reports, without loading the model: this file's
    numerics version, the library versions, the device (CUDA version and GPU name), the dtype,
    TF32 and the attention implementation; each changes the producer's arithmetic."""
    check_options(device, dtype, tf32, attn_implementation)
    torch = _torch()
    if device == "cuda" and not torch.cuda.is_available():
        raise Refused("transformers engine device: 'cuda' requested but torch sees no CUDA device")
    return (f"{ABI_VERSION}+{engine_version()}+{device_kind(torch, device)}+{dtype}"
            f"+tf32-{'on' if tf32 else 'off'}+attn-{attn_implementation}")


class TransformersEngine(GreedyDecoder):
    """``LlamaForCausalLM`` on torch behind the Engine protocol (see the module docstring)."""

    name = "transformers-torch"
    logit_units = "raw"

    def __init__(self, model_dir: Path = assets.MODEL_DIR, *, device: str = "cpu",
                 dtype: str = "float32", tf32: bool = False, attn_implementation: str = "sdpa") -> None:
        self.abi = engine_abi(device, dtype, tf32, attn_implementation)  # checks the options first
        self.version = engine_version()
        self.device, self.dtype, self.tf32 = device, dtype, tf32
        self.attn_implementation = attn_implementation
        self.torch_dtype = getattr(_torch(), dtype)
        self.geometry: ModelGeometry = load_config(Path(model_dir)).geometry
        self.model = self._load(Path(model_dir))

    def _load(self, model_dir: Path) -> Any:
        """Load weights from a symlink view of the model directory, refusing missing or unexpected
        tensors (a silently initialised weight would be a different model)."""
        torch = _torch()
        from transformers import LlamaForCausalLM

        with self._precision():
            # output_loading_info=True returns (model, info); transformers' annotation names only the model.
            model, info = cast(tuple[Any, dict[str, list[str]]], LlamaForCausalLM.from_pretrained(
                str(model_files_view(model_dir, "transformers")), dtype=self.torch_dtype,
                attn_implementation=self.attn_implementation, output_loading_info=True))
        problems = {key: sorted(value) for key, value in info.items() if value}
        if problems:
            raise Refused(one_line(f"transformers model {model_dir / WEIGHTS_FILE}: loading reported {problems}"))
        model = model.to(torch.device(self.device)).eval()
        model.requires_grad_(False)
        return model

    @contextlib.contextmanager
    def _precision(self) -> Iterator[None]:
        """Set the TF32 switches this engine's abi names for the duration of a call, then restore
        them (they are process-global; another engine in the process may want the opposite)."""
        torch = _torch()
        matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
        saved = (matmul.allow_tf32, cudnn.allow_tf32)
        matmul.allow_tf32 = cudnn.allow_tf32 = self.tf32
        try:
            with torch.inference_mode():
                yield
        finally:
            matmul.allow_tf32, cudnn.allow_tf32 = saved

    # ---- input checks ------------------------------------------------------------------------

    def _check_kv(self, kv: KVCache, extra_positions: int) -> int:
        """Refuse a KV whose layers, shapes, dtype or values do not fit this model, or that leaves
        no room for ``extra_positions`` more; return its position count."""
        geometry = self.geometry
        positions = check_kv_fits(kv, geometry.layers, geometry.kv_heads, geometry.head_dim,
                                  geometry.max_positions, extra_positions)
        if self.dtype == "float16":
            for name, array in kv.tensors().items():
                if np.abs(array).max(initial=0.0) > FLOAT16_MAX:
                    raise Refused(f"kv: {name}: values beyond float16's range for a float16 consumer")
        return positions

    # ---- producer ----------------------------------------------------------------------------

    def prefill(self, tokens: np.ndarray) -> KVCache:
        """KV of exactly ``tokens`` (positions 0..len-1): per layer K (post-RoPE) and V float32
        [kv_heads, positions, head_dim], C-contiguous."""
        began = time.perf_counter()
        tokens = self._tokens(tokens, "prefill tokens")
        if tokens.size > self.geometry.max_positions:
            raise Refused(f"prefill tokens: {tokens.size} positions exceed max_positions "
                          f"{self.geometry.max_positions}")
        with self._precision():
            cache = self._prefill_on_device(tokens)
            keys = [_to_canonical(layer.keys) for layer in cache.layers]
            values = [_to_canonical(layer.values) for layer in cache.layers]
        return KVCache(keys, values, meta={"prefill_seconds": time.perf_counter() - began})

    def _prefill_on_device(self, tokens: np.ndarray) -> Any:
        """Run the base model (no LM head) over ``tokens``; return its filled DynamicCache, each
        layer's keys/values [1, kv_heads, T, head_dim] in the model dtype on the device."""
        torch = _torch()
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        ids = torch.as_tensor(tokens, device=self.device)[None]  # [1, T]
        self.model.model(input_ids=ids, past_key_values=cache, use_cache=True)
        if len(cache.layers) != self.geometry.layers or cache.get_seq_length() != tokens.size:
            raise Refused(f"{self.name}: prefill cache has {len(cache.layers)} layers of "
                          f"{cache.get_seq_length()} positions, expected {self.geometry.layers} of {tokens.size}")
        return cache

    # ---- consumer ----------------------------------------------------------------------------

    def _run(self, kv: KVCache, pending: np.ndarray, steps: int, forced: np.ndarray | None
             ) -> DecodeResult:
        """Check inputs, install the KV, run the one decode loop, copy results to the host."""
        began = time.perf_counter()
        pending = self._tokens(pending, "pending tokens")
        # The last chosen token is never fed, so the cache needs pending + steps - 1 positions.
        handed_off = self._check_kv(kv, extra_positions=pending.size + steps - 1)
        with self._precision():
            cache = self._install(kv)
            tokens, logits = self._run_on_device(cache, pending, steps, forced)
            tokens_host = tokens.cpu().numpy().astype(np.int32)  # [steps]
            logits_host = logits.cpu().numpy()  # [steps, vocab] float32
        return finished_decode(self.name, tokens_host, logits_host, began=began, handed_off=handed_off,
                               pending_tokens=pending.size)

    def _install(self, kv: KVCache) -> Any:
        """A DynamicCache holding ``kv`` (already checked), cast to the model dtype on the device:
        per layer keys/values [1, kv_heads, positions, head_dim]."""
        torch = _torch()
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for index, (key, value) in enumerate(zip(kv.keys, kv.values, strict=True)):
            k = torch.from_numpy(key).to(device=self.device, dtype=self.torch_dtype)[None]
            v = torch.from_numpy(value).to(device=self.device, dtype=self.torch_dtype)[None]
            cache.update(k, v, index)
        return cache

    def _run_on_device(self, cache: Any, pending: np.ndarray, steps: int, forced: np.ndarray | None
                       ) -> tuple[Any, Any]:
        """The one decode loop, on the device: greedy when ``forced`` is None, else feeding
        ``forced``. Returns tokens int64 [steps] and logits float32 [steps, vocab], both on the
        device (no per-step host sync: the argmax is fed back as a tensor)."""
        torch = _torch()
        logits = torch.empty((steps, self.geometry.vocab), dtype=torch.float32, device=self.device)
        tokens = torch.empty(steps, dtype=torch.int64, device=self.device)
        forced_ids = None if forced is None else torch.as_tensor(forced, device=self.device)
        next_ids = torch.as_tensor(pending, device=self.device)[None]  # [1, pending]
        for step in range(steps):
            out = self.model(input_ids=next_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            logits[step] = out.logits[0, -1].float()  # [vocab]; scores the token of this step
            tokens[step] = logits[step].argmax() if forced_ids is None else forced_ids[step]
            next_ids = tokens[step:step + 1][None]  # [1, 1]; fed by the next step's forward
        return tokens, logits


def _to_canonical(tensor: Any) -> np.ndarray:
    """[1, kv_heads, positions, head_dim] in any dtype on any device -> float32 numpy
    [kv_heads, positions, head_dim], C-contiguous (bf16/fp16 -> float32 is exact)."""
    return np.ascontiguousarray(tensor[0].float().cpu().numpy())

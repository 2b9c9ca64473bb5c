"""vLLM (CPU build, float32) as a harness engine, through the project KV connector.

:class:`VllmEngine` runs vLLM in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with the settings
measured in ``../shared/notes/vllm-on-cpu.md`` and the connector of
:mod:`qualify.engines.vllm_connector` (``kv_role="kv_both"``):

* ``prefill(tokens)`` runs the prompt with ``max_tokens=1`` and returns the connector's export:
  the canonical KV of the whole blocks of ``tokens`` (``handoff_block_size`` = 128). A cold
  recompute's KV (:class:`ColdKV`) also remembers its tokens, so ``decode`` of it runs the plain
  prompt without the connector (the cold branch is the same engine without the handoff).
* ``decode(kv, pending, n)`` of a handed-off KV puts the KV in the connector's mailbox and runs
  placeholder ids for the handed-off positions followed by ``pending``: the connector installs
  the KV into the request's blocks and vLLM computes only the pending tokens. A connector that
  did not install every handed-off position is an error (never a silent cold run).
* Full logits: ``logprobs_mode="raw_logits"`` with ``SamplingParams(logprobs=-1,
  flat_logprobs=True)``, scattered by token id into vocab order (float32).

The engine refuses to start unless the installed vLLM is exactly :data:`VLLM_PIN`; its ABI pins the
vLLM version and the SHA-256 of its installed ``RECORD`` (which lists the SHA-256 of every file
the wheel installed), the torch version, the dtype, the block size, the page layout, the host's CPU
ISA class (``qualify.core.hostenv.cpu_isa_class``) with torch's own CPU dispatch level, and the
numeric environment the harness pins (:data:`THREADS` and a digest of :data:`ENV`).

Numeric environment. vLLM's CPU kernels are deterministic for a fixed configuration, but their
bits depend on the OpenMP thread count (measured: 1 and 2 threads give other KV and logits; the
work split changes the float reductions) and on switches an operator's environment can flip
(``VLLM_CPU_ATTN_SPLIT_KV``: other decode logits; ``VLLM_FLOAT32_MATMUL_PRECISION``, ...). Exact
arithmetic is not possible here, so every process that builds a vLLM engine or computes its ABI
fixes the environment itself (:func:`pin_numeric_environment`): :data:`ENV` overrides whatever the
operator set, the ISA and precision overrides of :data:`ENV_REMOVED` are dropped, every other
``VLLM_*`` variable except logging and telemetry (:data:`VLLM_ENV_KEPT`) is dropped, and torch's
intra-op thread count is set to :data:`THREADS`. An operator sets nothing.

One engine per process. vLLM keeps its distributed groups (world, tensor parallel, ...) and the
worker-side KV connector in process globals, and an engine's shutdown (run by a finalizer when
its ``LLM`` is garbage-collected) tears them down for whoever uses them then. Building a
:class:`VllmEngine` therefore first shuts down the previous one in this process
(:func:`close_active_engine`); a closed engine refuses further requests.
"""

from __future__ import annotations

import importlib.metadata
import os
import time
import uuid
import weakref
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from qualify.contract.lanes import VLLM_BLOCK_SIZE
from qualify.core import assets
from qualify.core.digests import canonical_json_bytes, sha256_bytes
from qualify.core.errors import Refused
from qualify.core.kv import KVCache
from qualify.engines.base import DecodeResult, ModelGeometry
from qualify.engines.checkpoint import model_files_view

VLLM_PIN = "0.32.0"
VLLM_DISTRIBUTION = "vllm-cpu"
DTYPE = "float32"
PLACEHOLDER_TOKEN = 0
"""Token id fed at handed-off positions: their KV comes from the handoff, never from these ids."""

LAYOUT_PROBE_TOKENS = 256
LAYOUT_TOLERANCE = 1e-4
"""Start-up layout test: K and V decoded from vLLM's pages must match the reference engine's
within this fraction of each layer's largest magnitude (measured in float32: under 1e-5 on the
shipped model; 1.2e-4 absolute on SmolLM2-135M's last layer V, whose values are far larger)."""

THREADS = 1
"""torch / OpenMP intra-op threads of every vLLM engine process (measured on the AVX-512 host: 1
and 2 threads give other KV and logits; with 1 thread a handed-off decode is bit-identical to the
cold recompute, and every host has one core)."""

ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    # Numerics (set over any operator value; see the module docstring).
    "OMP_NUM_THREADS": str(THREADS),
    "MKL_NUM_THREADS": str(THREADS),
    "VLLM_CPU_ATTN_SPLIT_KV": "1",
    "VLLM_FLOAT32_MATMUL_PRECISION": "highest",
    "VLLM_BATCH_INVARIANT": "0",
}
"""Set in every process that builds a vLLM engine or computes its ABI, overriding the operator."""

ENV_REMOVED = (
    "ATEN_CPU_CAPABILITY",  # torch's CPU dispatch level (the ABI records the level in effect)
    "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_CPU_ISA_HINTS", "DNNL_CPU_ISA_HINTS",
    "ONEDNN_DEFAULT_FPMATH_MODE", "DNNL_DEFAULT_FPMATH_MODE",
    "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "MKL_DYNAMIC", "OMP_DYNAMIC", "OMP_THREAD_LIMIT",
)
"""Overrides of the kernels' instruction set, float precision or thread count: dropped, so the
host's own CPU class (pinned in the ABI) decides."""

VLLM_ENV_KEPT = (
    "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_PREFIX", "VLLM_LOGGING_STREAM",
    "VLLM_LOGGING_CONFIG_PATH", "VLLM_LOGGING_COLOR", "VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK",
)
"""The only ``VLLM_*`` variables an operator may set (logging and telemetry); the others are dropped."""


def numeric_environment_sha256() -> str:
    """Digest of what :func:`pin_numeric_environment` fixes (recorded in the ABI)."""
    return sha256_bytes(canonical_json_bytes({
        "threads": THREADS, "env": ENV, "removed": list(ENV_REMOVED), "vllm_kept": list(VLLM_ENV_KEPT)}))


def pin_numeric_environment() -> None:
    """Fix this process's numeric environment for vLLM (the module docstring says what and why).
    Idempotent; call it before torch or vLLM start their thread pools and read their switches.
    ``Refused`` when torch does not run :data:`THREADS` intra-op threads afterwards."""
    for key in [k for k in os.environ if k.startswith("VLLM_") and k not in ENV and k not in VLLM_ENV_KEPT]:
        del os.environ[key]
    for key in ENV_REMOVED:
        os.environ.pop(key, None)
    os.environ.update(ENV)
    import torch

    # torch._C.set_num_threads, not torch.set_num_threads: vLLM's CPU worker replaces the latter
    # with a no-op for the rest of the process once an engine has started.
    torch._C.set_num_threads(THREADS)
    if torch.get_num_threads() != THREADS:
        raise Refused(f"vllm numeric environment: torch runs {torch.get_num_threads()} threads after "
                      f"pinning {THREADS}; refusing to start")
    from vllm import envs

    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()  # a previous engine's cached switches must not outlive the pin


def installed_vllm_version() -> str | None:
    for name in (VLLM_DISTRIBUTION, "vllm"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@cache
def vllm_record_sha256() -> str:
    """SHA-256 over the installed vLLM package's own files as its ``RECORD`` lists them (path and
    content hash, sorted). Only entries under the package folder count, without ``__pycache__``:
    launcher scripts (pip rewrites their shebang with the venv's path) and byte-code (stamped at
    install) differ between installs of the same wheel; the package's files do not."""
    for name in (VLLM_DISTRIBUTION, "vllm"):
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        package_files = sorted(
            f"{entry},{entry.hash.value if entry.hash else ''}" for entry in dist.files or ()
            if entry.parts and entry.parts[0] == "vllm" and "__pycache__" not in entry.parts
        )
        if package_files:
            return sha256_bytes("\n".join(package_files).encode("utf-8"))
    raise Refused("vllm: not installed (run tools/install_vllm.sh)")


def check_pin() -> str:
    """The installed vLLM version, or ``Refused`` when it is not :data:`VLLM_PIN`."""
    version = installed_vllm_version()
    if version is None:
        raise Refused("vllm: not installed (run tools/install_vllm.sh)")
    if version != VLLM_PIN:
        raise Refused(f"vllm: installed version {version}, this harness pins {VLLM_PIN}; refusing to start")
    return version


@cache
def vllm_engine_abi() -> str:
    """What a vLLM lane's KV depends on besides the checkpoint (no engine is started): the vLLM
    and torch builds, dtype, block size and page layout, the host's CPU ISA class and torch's CPU
    dispatch level, and the pinned numeric environment (threads and :data:`ENV` digest). Pins this
    process's numeric environment first (:func:`pin_numeric_environment`)."""
    check_pin()
    pin_numeric_environment()
    torch_version = importlib.metadata.version("torch")
    import torch

    from qualify.core.hostenv import cpu_isa_class
    from qualify.engines.vllm_connector import KNOWN_LAYOUT  # imports vllm (no engine start)

    return (f"{VLLM_DISTRIBUTION}-{VLLM_PIN}+files-{vllm_record_sha256()[:16]}+torch-{torch_version}"
            f"+{DTYPE}+block-{VLLM_BLOCK_SIZE}+{KNOWN_LAYOUT}"
            f"+cpu-{cpu_isa_class()}+aten-{torch.backends.cpu.get_cpu_capability()}"
            f"+threads-{THREADS}+env-{numeric_environment_sha256()[:12]}")


@dataclass(kw_only=True)
class ColdKV(KVCache):
    """A prefill's export that remembers the tokens it was made from: decoding it is the cold local
    recompute (the plain prompt through the same engine, no connector transfer)."""

    source_tokens: np.ndarray


def llm_arguments(model_dir: Path) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments of every harness engine (the measured CPU settings, float32, the
    lane block size, full raw logits); the caller adds its ``kv_transfer_config``."""
    return {
        "model": str(model_files_view(Path(model_dir), "vllm")), "dtype": DTYPE, "skip_tokenizer_init": True,
        "enforce_eager": True,
        "gpu_memory_utilization": 0.2, "enable_prefix_caching": False, "max_model_len": 4096,
        "max_num_batched_tokens": 4096, "block_size": VLLM_BLOCK_SIZE,
        "max_logprobs": -1, "logprobs_mode": "raw_logits", "seed": 0,
    }


def greedy_sampling_params(max_tokens: int, logits: bool, kv_transfer_params: dict[str, Any] | None) -> Any:
    """Greedy ``SamplingParams`` for exactly ``max_tokens`` tokens, with every raw logit row when
    ``logits`` (flat format), and ``kv_transfer_params`` for the KV connector."""
    from vllm import SamplingParams

    extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, detokenize=False,
        ignore_eos=True, logprobs=-1 if logits else None, flat_logprobs=logits, extra_args=extra)


def raw_logit_rows(completion: Any, n: int, vocab: int) -> np.ndarray:
    """A completion's flat raw logits scattered by token id into ``[n, vocab]`` float32 rows;
    ``RuntimeError`` when a position or a vocab entry is missing or non-finite."""
    flat = completion.logprobs
    if flat is None or len(flat.start_indices) != n:
        raise RuntimeError(f"vllm returned logits for {0 if flat is None else len(flat.start_indices)} "
                           f"positions, expected {n}")
    ids = np.asarray(flat.token_ids, dtype=np.int64)
    values = np.asarray(flat.logprobs, dtype=np.float32)
    starts = np.asarray(flat.start_indices, dtype=np.int64)
    ends = np.asarray(flat.end_indices, dtype=np.int64)
    counts = ends - starts
    if not np.all(counts >= vocab):
        raise RuntimeError(f"vllm returned {int(counts.min())} logits for a position, expected "
                           f"at least the vocab ({vocab}; the sampled token may come first)")
    rows = np.full((n, vocab), np.nan, dtype=np.float32)
    row_of = np.repeat(np.arange(n), counts)
    flat_index = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends, strict=True)])
    rows[row_of, ids[flat_index]] = values[flat_index]
    if not np.all(np.isfinite(rows)):
        raise RuntimeError("vllm raw logits: a vocab entry is missing or non-finite")
    return rows


def check_page_decode(exported: KVCache, model_dir: Path) -> float:
    """Trust a decode of vLLM's pages only if it reproduces the reference engine's K (post-RoPE)
    and V on the prompt's first :data:`LAYOUT_PROBE_TOKENS` positions (``exported`` holds at least
    those); a layout misread is refused. Returns the largest absolute difference."""
    from qualify.engines.reference import ReferenceEngine

    tokens = assets.load_prompt()[:LAYOUT_PROBE_TOKENS]
    reference = ReferenceEngine.from_model_dir(model_dir).prefill(tokens)
    worst = 0.0
    for layer, (k, v, rk, rv) in enumerate(zip(exported.keys, exported.values, reference.keys,
                                                reference.values, strict=True)):
        for part, ours, theirs in (("K", k, rk), ("V", v, rv)):
            probe = min(ours.shape[1], theirs.shape[1])
            expected, decoded = theirs[:, :probe], ours[:, :probe]
            delta = float(np.max(np.abs(decoded - expected)))
            # Relative to the layer's largest magnitude (at least 1): a misread page moves values
            # by about that much, float32 kernels by a few units of its last place.
            tolerance = LAYOUT_TOLERANCE * max(1.0, float(np.max(np.abs(expected))))
            if not delta <= tolerance:
                raise Refused(f"vllm KV page layout: the decoded layer {layer} {part} differs from "
                              f"the reference engine's by {delta:.3g} (> {tolerance:.3g}, {LAYOUT_TOLERANCE} of "
                              f"its largest magnitude); layout not recognised, refusing to start")
            worst = max(worst, delta)
    return worst


_ACTIVE: weakref.ref[VllmEngine] | None = None
"""The engine built last in this process (see "One engine per process" in the module docstring)."""


def close_active_engine() -> None:
    """Shut down the vLLM engine built last in this process, if it is still open."""
    global _ACTIVE
    engine = _ACTIVE() if _ACTIVE is not None else None
    _ACTIVE = None
    if engine is not None:
        engine.close()


class VllmEngine:
    """vLLM behind the harness's Engine protocol (see the module docstring)."""

    name = "vllm"
    logit_units = "raw"

    def __init__(self, role: str = "producer", model_dir: Path = assets.MODEL_DIR,
                 fault: str | None = None) -> None:
        self.llm: Any = None
        self.version = check_pin()
        self.abi = vllm_engine_abi()
        self.role = role
        self.fault = fault
        self.handoff_block_size = VLLM_BLOCK_SIZE
        from qualify.engines.checkpoint import load_config

        self.geometry: ModelGeometry = load_config(Path(model_dir)).geometry
        connector_fault = fault if fault in ("k-bit-flip", "block-order", "raise", "shift-install") else None
        if fault is not None and connector_fault is None and fault != "other-prompt":
            raise Refused(f"vllm engine fault: found {fault!r}")
        # vLLM's process globals belong to one engine at a time: the previous one is shut down
        # here, never by its finalizer in the middle of this engine's requests.
        close_active_engine()
        pin_numeric_environment()
        from vllm import LLM
        from vllm.config import KVTransferConfig

        extra: dict[str, Any] = {} if connector_fault is None else {"qualify_fault": connector_fault}
        started = time.perf_counter()
        llm = LLM(
            **llm_arguments(Path(model_dir)),
            kv_transfer_config=KVTransferConfig(
                kv_connector="QualifyKVConnector",
                kv_connector_module_path="qualify.engines.vllm_connector",
                kv_role="kv_both", kv_connector_extra_config=extra),
        )
        global _ACTIVE
        self.llm = llm
        _ACTIVE = weakref.ref(self)
        self.start_s = time.perf_counter() - started
        # Time spent inside vLLM's generate calls (bench/vllm_lane.py's baseline).
        self.generate_s = 0.0
        try:
            self.layout_max_abs = self._layout_self_test(Path(model_dir))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Shut this engine down now: its worker, its KV connector and vLLM's distributed state
        (idempotent). Later requests to it raise."""
        llm, self.llm = self.llm, None
        if llm is None:
            return
        client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if client is not None:
            # InprocClient.shutdown detaches the finalizer that would otherwise run this later.
            client.shutdown()

    # -- plumbing ---------------------------------------------------------------------------

    def _generate(self, prompt: list[int], max_tokens: int, qualify: dict[str, str] | None,
                  logits: bool) -> Any:
        (completion,) = self._generate_many([prompt], max_tokens, qualify, logits)
        return completion

    def _generate_many(self, prompts: list[list[int]], max_tokens: int,
                       qualify: dict[str, str] | None, logits: bool) -> list[Any]:
        if self.llm is None:
            raise RuntimeError("vllm engine closed (a later VllmEngine in this process shut it down: "
                               "vLLM's distributed state and KV connector are per process)")
        import torch

        if torch.get_num_threads() != THREADS:  # something in this process moved it: the pin holds
            torch._C.set_num_threads(THREADS)
        params = greedy_sampling_params(max_tokens, logits, None if qualify is None else {"qualify": qualify})
        started = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        self.generate_s += time.perf_counter() - started
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vllm returned {len(outputs)} outputs for {len(prompts)} prompts")
        return [output.outputs[0] for output in outputs]

    def _tokens(self, tokens: np.ndarray, what: str) -> list[int]:
        array = np.asarray(tokens)
        if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
            raise Refused(f"{what}: expected a non-empty 1-D integer token array")
        if array.min() < 0 or array.max() >= self.geometry.vocab:
            raise Refused(f"{what}: token ids must lie in 0..{self.geometry.vocab - 1}")
        return [int(t) for t in array]

    def _rows(self, completion: Any, n: int) -> np.ndarray:
        return raw_logit_rows(completion, n, self.geometry.vocab)

    # -- Engine protocol --------------------------------------------------------------------

    def prefill(self, tokens: np.ndarray) -> KVCache:
        """Canonical KV of the whole blocks of ``tokens`` (the connector's export)."""
        ids = self._tokens(tokens, "prefill tokens")
        from qualify.engines.vllm_connector import LONG_REQUEST_POSITIONS

        if self.fault == "other-prompt" and len(ids) >= LONG_REQUEST_POSITIONS:
            other = assets.load_prompt("prose-email-architecture")
            if len(other) < len(ids):
                raise Refused("fault other-prompt: the other prompt is shorter")
            ids = [int(t) for t in other[: len(ids)]]
        exported = self._export(ids)
        return ColdKV(exported.keys, exported.values, meta=exported.meta, source_tokens=np.asarray(tokens).copy())

    def _export(self, ids: list[int]) -> KVCache:
        """Run ``ids`` with ``max_tokens=1`` and collect the connector's whole-block export."""
        key = uuid.uuid4().hex
        from qualify.engines.vllm_connector import MAILBOX

        started = time.perf_counter()
        try:
            self._generate(ids, 1, {"op": "export", "key": key}, logits=False)
            entry = MAILBOX.exports.pop(key, None)
        finally:
            MAILBOX.exports.pop(key, None)
        positions = (len(ids) // VLLM_BLOCK_SIZE) * VLLM_BLOCK_SIZE
        if positions == 0:
            raise Refused(f"prefill: {len(ids)} tokens fill no whole block of {VLLM_BLOCK_SIZE}")
        if entry is None or entry.get("positions") != positions:
            raise RuntimeError(f"vllm connector exported no KV for {positions} positions")
        layers = self.geometry.layers
        missing = [i for i in range(layers) if i not in entry]
        if missing:
            raise RuntimeError(f"vllm connector exported no KV for layer {missing[0]}")
        kv = KVCache([entry[i][0] for i in range(layers)], [entry[i][1] for i in range(layers)])
        kv.meta["compute_s"] = time.perf_counter() - started
        return kv

    def _layout_self_test(self, model_dir: Path) -> float:
        """Trust the connector's page decode only if it reproduces the reference engine's K
        (post-RoPE) and V on a short probe prompt; a layout it misreads is refused at start."""
        tokens = assets.load_prompt()[:LAYOUT_PROBE_TOKENS]
        return check_page_decode(self._export([int(t) for t in tokens]), model_dir)

    def decode(self, kv: KVCache, pending: np.ndarray, n: int) -> DecodeResult:
        pending_ids = self._tokens(pending, "pending tokens")
        started = time.perf_counter()
        if isinstance(kv, ColdKV):
            # Cold local recompute: the same engine, the plain prompt, no connector transfer.
            prompt = self._tokens(kv.source_tokens, "cold tokens") + pending_ids
            completion = self._generate(prompt, n, None, logits=True)
            meta = {"handed_off_positions": 0.0}
        else:
            positions = kv.geometry.positions
            if positions % VLLM_BLOCK_SIZE:
                raise Refused(f"decode: {positions} handed-off positions are not whole blocks of "
                              f"{VLLM_BLOCK_SIZE}; the producer must hand off whole blocks")
            from qualify.engines.vllm_connector import MAILBOX

            key = uuid.uuid4().hex
            MAILBOX.imports[key] = kv
            try:
                prompt = [PLACEHOLDER_TOKEN] * positions + pending_ids
                completion = self._generate(prompt, n, {"op": "import", "key": key}, logits=True)
                loaded = MAILBOX.loaded.pop(key, 0)
            finally:
                MAILBOX.imports.pop(key, None)
                MAILBOX.loaded.pop(key, None)
            if loaded != positions:
                raise RuntimeError(f"vllm connector installed {loaded} of {positions} handed-off positions")
            meta = {"handed_off_positions": float(positions), "recomputed_positions": float(len(pending_ids))}
        tokens = np.asarray(completion.token_ids, dtype=np.int32)
        if len(tokens) != n:
            raise RuntimeError(f"vllm generated {len(tokens)} tokens, expected {n}")
        logits = self._rows(completion, n)
        return DecodeResult(tokens, logits, seconds=time.perf_counter() - started, meta=meta)

    def teacher_forced(self, kv: KVCache, pending: np.ndarray, forced: np.ndarray) -> np.ndarray:
        """Row i scores the position after pending + forced[:i]: one single-token request per row,
        all in one batch, each installing the same handoff (only run when tokens diverged)."""
        forced_ids = self._tokens(forced, "forced tokens")
        pending_ids = self._tokens(pending, "pending tokens")
        if isinstance(kv, ColdKV):
            base = self._tokens(kv.source_tokens, "cold tokens")
            prompts = [base + pending_ids + forced_ids[:i] for i in range(len(forced_ids))]
            completions = self._generate_many(prompts, 1, None, logits=True)
        else:
            positions = kv.geometry.positions
            from qualify.engines.vllm_connector import MAILBOX

            key = uuid.uuid4().hex
            MAILBOX.imports[key] = kv
            try:
                prompts = [[PLACEHOLDER_TOKEN] * positions + pending_ids + forced_ids[:i]
                           for i in range(len(forced_ids))]
                completions = self._generate_many(prompts, 1, {"op": "import", "key": key}, logits=True)
            finally:
                MAILBOX.imports.pop(key, None)
                MAILBOX.loaded.pop(key, None)
        rows: np.ndarray = np.concatenate([self._rows(c, 1) for c in completions]).astype(np.float32)
        return rows


"""A connector pair: a vLLM producer saves a prompt's KV through the connector under test, a vLLM
consumer loads it through the same connector and decodes; the consumer's cold recompute is judged
against it, and the loaded KV against the consumer's own cold prefill, block by block.

Two processes (vLLM keeps process globals: one engine per process), each started by
:func:`run_producer` / :func:`run_consumer` as ``python -m qualify.interfaces.connector_pair_command``:

* producer (``kv_role="kv_producer"``): prefills the 2048-token fixture prompt
  (``qualify.core.assets.load_prompt()``) with one generated token; the observing wrapper
  (:mod:`qualify.engines.connector_observer`) digests what the connector was handed to save.
* consumer (``kv_role="kv_consumer"``): first the cold recompute (the same prompt, the connector's
  hit suppressed, its prefill KV captured), then each loaded branch: the prompt again, the
  connector loads what it claims, 256 greedy tokens are decoded with every raw logit row. A branch
  may carry a fault of the fault-injecting wrapper (:mod:`qualify.engines.connector_faults`).
* same engine (``run_pair(..., same_engine=True)``): one ``kv_both`` engine is both, for connectors
  that offload and reload within an engine; vLLM's prefix caching is on (hash-keyed connectors need
  its block hashes) and the local prefix cache is emptied before each request.

Both engines use the harness's vLLM settings and pinned numeric environment
(:mod:`qualify.engines.vllm_engine`); the consumer tests its page decode against the reference
engine before trusting a localisation. The consumer reports, per branch: tokens and logits against
the cold branch (exact tokens, the largest absolute logit delta), the loaded KV against the cold
prefill KV (every differing (layer, K or V, KV head, block) cell, with the first differing position
and dim), and the loaded digests against the producer's saved digests. Nothing here judges: the
harness's judge applies a lane's rule to these facts.

Imports: ``qualify.core``, ``qualify.contract`` and ``qualify.engines``; vLLM only in the engine processes.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qualify.contract.lanes import VLLM_BLOCK_SIZE
from qualify.core import assets
from qualify.core.digests import strict_json_loads
from qualify.core.errors import Refused, one_line
from qualify.core.kv import KVCache
from qualify.engines.connector_under_test import ConnectorSpec

DECODE_TOKENS = 256
SIDE_CHANNEL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
"""Where a connector engine listens for its peer's handshake (NIXL's side channel): set in the
engine process after its numeric environment is pinned, one port per engine."""
PREFILL_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None}
"""What vLLM's disaggregated-prefill proxies send with the prefill request: the connector keeps the
prompt's KV for a remote decode and returns where to fetch it (its ``kv_transfer_params``)."""
MAX_TRANSFER_PARAMS_CHARS = 64 * 1024
"""Longest ``kv_transfer_params`` a producer may return (NIXL's are a few hundred bytes)."""
OBSERVER_CLASS = "ObservingConnector"
OBSERVER_MODULE = "qualify.engines.connector_observer"
PRODUCER_KEY = "producer"
COLD_KEY = "cold"
LOADED_KEY = "loaded"
RESULT_SCHEMA = "trust-ladder.connector-pair.v1"
PROCESS_TIMEOUT_S = 900
"""Longest an engine process may run (engine start and ten 2048-token branches take about a
minute on two shared cores)."""


# ---------------------------------------------------------------------------------------------
# comparisons (pure numpy; also used by the tests)


@dataclass(frozen=True)
class CellDelta:
    """One (layer, K or V, KV head, block) cell where two KVs differ."""

    layer: int
    tensor: str
    head: int
    block: int
    max_abs: float
    """Largest absolute difference in the cell (``inf`` where a value is not finite in one only)."""
    differing: int
    """Elements that differ (not bit-equal)."""
    first_position: int
    first_dim: int

    def as_dict(self) -> dict[str, Any]:
        """JSON form; a non-finite ``max_abs`` (a NaN or infinity on one side) is written as null."""
        return {"layer": self.layer, "tensor": self.tensor, "head": self.head, "block": self.block,
                "max_abs": self.max_abs if math.isfinite(self.max_abs) else None, "differing": self.differing,
                "first_position": self.first_position, "first_dim": self.first_dim}


def compare_kv_cells(ours: dict[int, tuple[np.ndarray, np.ndarray]], theirs: dict[int, tuple[np.ndarray, np.ndarray]],
                     positions: int, block_size: int) -> list[CellDelta]:
    """Every cell where ``ours`` and ``theirs`` (layer -> canonical K, V) are not bit-equal over
    the first ``positions`` positions, in (layer, tensor, head, block) order. A layer missing on
    either side is ``ValueError``."""
    if set(ours) != set(theirs):
        raise ValueError(f"KV comparison: layers {sorted(ours)} against {sorted(theirs)}")
    cells: list[CellDelta] = []
    for layer in sorted(ours):
        for index, tensor in enumerate(("K", "V")):
            a = ours[layer][index][:, :positions]
            b = theirs[layer][index][:, :positions]
            if a.shape != b.shape or a.shape[1] != positions:
                raise ValueError(f"KV comparison: layer {layer} {tensor} shapes {a.shape} and {b.shape} "
                                 f"for {positions} positions")
            differ = a.view(np.uint32) != b.view(np.uint32)
            for head in range(a.shape[0]):
                for block, start in enumerate(range(0, positions, block_size)):
                    mask = differ[head, start:start + block_size]
                    if not mask.any():
                        continue
                    where = np.argwhere(mask)[0]
                    with np.errstate(invalid="ignore"):
                        delta = np.abs(a[head, start:start + block_size].astype(np.float64)
                                       - b[head, start:start + block_size].astype(np.float64))
                    worst = float(np.nanmax(np.where(np.isnan(delta), np.inf, delta)))
                    cells.append(CellDelta(layer, tensor, head, block, worst, int(mask.sum()),
                                           start + int(where[0]), int(where[1])))
    return cells


def digest_mismatches(loaded: dict[str, str], saved: dict[str, str]) -> list[str]:
    """Cells (``"layer/tensor/head/block"``) whose loaded digest differs from the saved one;
    a loaded cell the producer never digested counts as differing."""
    return sorted((cell for cell, digest in loaded.items() if saved.get(cell) != digest), key=_cell_order)


def _cell_order(cell: str) -> tuple[int, str, int, int]:
    layer, tensor, head, block = cell.split("/")
    return int(layer), tensor, int(head), int(block)


def _cell_name(cell: tuple[int, str, int, int]) -> str:
    return "/".join(str(part) for part in cell)


def localise(cells: list[CellDelta]) -> dict[str, Any] | None:
    """A divergence's footprint: which layers, tensors, heads and blocks differ, the first cell
    (in layer, tensor, head, block order) and the worst; None when nothing differs."""
    if not cells:
        return None
    worst = max(cells, key=lambda c: c.max_abs)
    return {"layers": sorted({c.layer for c in cells}), "tensors": sorted({c.tensor for c in cells}),
            "heads": sorted({c.head for c in cells}), "blocks": sorted({c.block for c in cells}),
            "cells": len(cells), "first": cells[0].as_dict(), "worst": worst.as_dict()}


def first_token_divergence(tokens: np.ndarray, cold: np.ndarray) -> int | None:
    """First index where two token sequences differ (None when they are equal)."""
    common = min(len(tokens), len(cold))
    differ = np.flatnonzero(np.asarray(tokens)[:common] != np.asarray(cold)[:common])
    if differ.size:
        return int(differ[0])
    return None if len(tokens) == len(cold) else common


def returned_transfer_params(returned: Any) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` a producer's request returned, as they go with the consumer's
    request: None when the connector returned none (ExampleConnector) or an empty object, else a
    JSON object of at most :data:`MAX_TRANSFER_PARAMS_CHARS` characters (the consumer's request adds
    the harness's tag over it); one-line ``Refused`` otherwise (the connector answered something no
    proxy could forward)."""
    if returned is None:
        return None
    if not isinstance(returned, dict):
        raise Refused(f"producer: the connector returned kv_transfer_params of type {type(returned).__name__}, "
                      f"expected a JSON object or none")
    try:
        text = json.dumps(returned, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError):
        raise Refused("producer: the connector's kv_transfer_params are not JSON (a value that is not a finite "
                      "number, string, boolean, null, array or object); expected a JSON object") from None
    if len(text) > MAX_TRANSFER_PARAMS_CHARS:
        raise Refused(f"producer: the connector's kv_transfer_params hold {len(text)} characters, "
                      f"expected at most {MAX_TRANSFER_PARAMS_CHARS}")
    document: dict[str, Any] = json.loads(text)
    return document or None


def request_transfer_params(transfer: dict[str, Any] | None, tagged: dict[str, Any]) -> dict[str, Any]:
    """A request's ``kv_transfer_params``: the handshake's (``transfer``, a copy) with the harness's
    tag (``tagged``) over them, so a connector can neither drop nor rewrite the tag."""
    return {**copy.deepcopy(transfer or {}), **tagged}


# ---------------------------------------------------------------------------------------------
# results


@dataclass
class Branch:
    """One consumer branch (the cold recompute or a loaded branch) against the cold one."""

    key: str
    fault: str | None
    tokens: list[int]
    claimed_tokens: int
    token_divergence: int | None
    logits_max_abs: float
    """Largest absolute raw-logit delta over the rows up to the first token divergence (all rows
    when the tokens agree)."""
    logit_rows_equal: bool
    kv_cells: list[dict[str, Any]] = field(default_factory=list)
    kv_localisation: dict[str, Any] | None = None
    saved_mismatches: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _branch_from(document: dict[str, Any]) -> Branch:
    return Branch(**document)


@dataclass
class PairResult:
    """What one pair run measured (see the module docstring); ``as_dict`` is its JSON form."""

    connector: dict[str, Any]
    engine_abi: str
    prompt_tokens: int
    decode_tokens: int
    block_size: int
    saved_tokens: int
    suppressed_hit: int | None
    layout_max_abs: float
    cold_tokens: list[int]
    branches: list[Branch]
    timings: dict[str, float]

    def branch(self, key: str) -> Branch:
        for branch in self.branches:
            if branch.key == key:
                return branch
        raise KeyError(key)

    def as_dict(self) -> dict[str, Any]:
        document = dict(vars(self))
        document["branches"] = [dict(vars(b)) for b in self.branches]
        return {"schema": RESULT_SCHEMA, **document}


# ---------------------------------------------------------------------------------------------
# the engine processes


def _build_llm(spec: ConnectorSpec, role: str, model_dir: Path, prefix_caching: bool = False,
               side_channel_port: int | None = None, model_view: Path | None = None) -> Any:
    from qualify.engines.vllm_engine import check_pin, llm_arguments, pin_numeric_environment

    check_pin()
    pin_numeric_environment()
    if side_channel_port is not None:
        # Set after the pin (which drops every other VLLM_* variable): where this engine's connector
        # listens for a peer's handshake (NIXL's side channel); it changes no bits.
        os.environ[SIDE_CHANNEL_PORT_ENV] = str(side_channel_port)
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from qualify.engines.connector_delegate import CONNECTOR_UNDER_TEST

    arguments = {**llm_arguments(model_dir), "enable_prefix_caching": prefix_caching}
    if model_view is not None:
        # The path both engines of a pair name the model by (NIXL's handshake refuses a peer whose
        # model path differs); the same files as llm_arguments' private view.
        arguments["model"] = str(model_view)
    return LLM(**arguments, kv_transfer_config=KVTransferConfig(
        kv_connector=OBSERVER_CLASS, kv_connector_module_path=OBSERVER_MODULE, kv_role=role,
        kv_connector_extra_config={CONNECTOR_UNDER_TEST: spec.as_dict()}))


def _generate(llm: Any, prompt: list[int], max_tokens: int, tag: Any, logits: bool,
              transfer: dict[str, Any] | None = None) -> Any:
    """The completion of ``prompt`` (see :func:`_generate_request`)."""
    return _generate_request(llm, prompt, max_tokens, tag, logits, transfer).outputs[0]


def _generate_request(llm: Any, prompt: list[int], max_tokens: int, tag: Any, logits: bool,
                      transfer: dict[str, Any] | None = None) -> Any:
    """vLLM's ``RequestOutput`` for ``prompt``: ``max_tokens`` greedy tokens (every raw logit row when
    ``logits``), the request tagged ``tag`` and carrying ``transfer`` (a connector's handshake
    ``kv_transfer_params``) besides the tag."""
    import torch

    from qualify.engines.vllm_engine import THREADS, greedy_sampling_params

    # With prefix caching on (a same-engine pair), every request starts from an empty local cache:
    # whatever is not recomputed comes from the connector (the connector's own store is kept).
    if llm.llm_engine.vllm_config.cache_config.enable_prefix_caching and not llm.reset_prefix_cache():
        raise RuntimeError("same-engine pair: vLLM did not reset its local prefix cache")
    if torch.get_num_threads() != THREADS:  # vLLM's worker may move it; the pin holds
        torch._C.set_num_threads(THREADS)
    params = greedy_sampling_params(max_tokens, logits, request_transfer_params(transfer, tag.as_params()))
    (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return output


def _digest_names(digests: dict[tuple[int, str, int, int], str]) -> dict[str, str]:
    return {_cell_name(cell): digest for cell, digest in sorted(digests.items())}


def producer_main(spec: ConnectorSpec, out: Path, model_dir: Path) -> None:
    """The producer process: prefill the fixture prompt through the wrapped connector; write the
    saved digests to ``out``."""
    from qualify.engines.vllm_engine import vllm_engine_abi

    started = time.perf_counter()
    llm = _build_llm(spec, "kv_producer", model_dir)
    built = time.perf_counter()
    saved = _produce(llm)
    out.write_text(json.dumps({
        **saved, "engine_abi": vllm_engine_abi(),
        "timings": {"engine_start_s": built - started, "prefill_s": time.perf_counter() - built},
    }, allow_nan=False), encoding="utf-8")


def _produce(llm: Any, prompt: list[int] | None = None, key: str = PRODUCER_KEY,
             transfer: dict[str, Any] | None = None) -> dict[str, Any]:
    """Prefill ``prompt`` (default: the fixture prompt) with one generated token, tagged ``key``
    and carrying ``transfer`` (the prefill side of a handshake); the digests of what the connector
    was handed to save, and the ``kv_transfer_params`` the request returned (None: none)."""
    from qualify.engines.connector_delegate import RequestTag
    from qualify.engines.connector_observer import take_observation

    prompt = [int(t) for t in assets.load_prompt()] if prompt is None else prompt
    output = _generate_request(llm, prompt, 1, RequestTag(key), logits=False, transfer=transfer)
    observed = take_observation(key)
    if observed.saved_tokens != len(prompt):
        raise RuntimeError(f"producer: the observer saw {observed.saved_tokens} of {len(prompt)} prompt tokens "
                           f"handed to the connector")
    returned = getattr(output, "kv_transfer_params", None)
    return {"saved_tokens": observed.saved_tokens, "saved_digests": _digest_names(observed.saved_digests),
            "kv_transfer_params": returned_transfer_params(returned)}


def consumer_main(spec: ConnectorSpec, saved_path: Path | None, out: Path, model_dir: Path, faults: list[str]) -> None:
    """The consumer process: the cold recompute, then the loaded branch and one branch per fault;
    write the comparison to ``out`` (:class:`PairResult`). Without ``saved_path`` the consumer is
    its own producer (``kv_role="kv_both"``, the producer's request first): the deployment of
    connectors that offload and reload within one engine."""
    from qualify.engines.connector_delegate import RequestTag
    from qualify.engines.connector_observer import Observation, take_observation
    from qualify.engines.vllm_engine import check_page_decode, raw_logit_rows, vllm_engine_abi

    prompt = [int(t) for t in assets.load_prompt()]
    from qualify.engines.checkpoint import load_config

    vocab = load_config(model_dir).geometry.vocab
    timings: dict[str, float] = {}
    started = time.perf_counter()
    # A same-engine pair turns vLLM's prefix caching on (hash-keyed offloading connectors need its
    # block hashes) and empties the local prefix cache before each request (see _generate).
    llm = _build_llm(spec, "kv_consumer" if saved_path is not None else "kv_both", model_dir,
                     prefix_caching=saved_path is None)
    timings["engine_start_s"] = time.perf_counter() - started
    if saved_path is not None:
        saved = strict_json_loads(saved_path.read_bytes())
    else:
        started = time.perf_counter()
        saved = {**_produce(llm), "timings": {"prefill_s": time.perf_counter() - started}}

    started = time.perf_counter()
    cold = _generate(llm, prompt, DECODE_TOKENS, RequestTag(COLD_KEY, cold=True, capture=True), logits=True)
    cold_observed = take_observation(COLD_KEY)
    timings["cold_s"] = time.perf_counter() - started
    if cold_observed.claimed_tokens or len(cold_observed.saved) == 0:
        raise RuntimeError(f"consumer: the cold recompute loaded {cold_observed.claimed_tokens} tokens "
                           f"and captured {len(cold_observed.saved)} layers; expected 0 and every layer")
    cold_tokens = np.asarray(cold.token_ids, dtype=np.int64)
    cold_rows = raw_logit_rows(cold, DECODE_TOKENS, vocab)
    layers = sorted(cold_observed.saved)
    layout_max_abs = check_page_decode(KVCache([cold_observed.saved[i][0] for i in layers],
                                               [cold_observed.saved[i][1] for i in layers]), model_dir)

    branches: list[Branch] = []
    for fault in [None, *faults]:
        key = LOADED_KEY if fault is None else f"fault-{fault}"
        started = time.perf_counter()
        completion = _generate(llm, prompt, DECODE_TOKENS, RequestTag(key, fault=fault), logits=True)
        observed: Observation = take_observation(key)
        tokens = np.asarray(completion.token_ids, dtype=np.int64)
        rows = raw_logit_rows(completion, DECODE_TOKENS, vocab)
        divergence = first_token_divergence(tokens, cold_tokens)
        upto = DECODE_TOKENS if divergence is None else divergence + 1
        cells: list[CellDelta] = []
        if observed.claimed_tokens:
            cells = compare_kv_cells(observed.loaded, cold_observed.saved, observed.claimed_tokens, VLLM_BLOCK_SIZE)
        branches.append(Branch(
            key=key, fault=fault, tokens=[int(t) for t in tokens], claimed_tokens=observed.claimed_tokens,
            token_divergence=divergence,
            logits_max_abs=float(np.max(np.abs(rows[:upto].astype(np.float64) - cold_rows[:upto]))),
            logit_rows_equal=bool(np.array_equal(rows.view(np.uint32), cold_rows.view(np.uint32))),
            kv_cells=[c.as_dict() for c in cells], kv_localisation=localise(cells),
            saved_mismatches=digest_mismatches(_digest_names(observed.loaded_digests), saved["saved_digests"]),
            seconds=time.perf_counter() - started))
    result = PairResult(
        connector=spec.as_dict(), engine_abi=vllm_engine_abi(), prompt_tokens=len(prompt),
        decode_tokens=DECODE_TOKENS, block_size=VLLM_BLOCK_SIZE, saved_tokens=int(saved["saved_tokens"]),
        suppressed_hit=cold_observed.suppressed_hit, layout_max_abs=layout_max_abs,
        cold_tokens=[int(t) for t in cold_tokens], branches=branches,
        timings={**{f"producer_{k}": v for k, v in saved["timings"].items()}, **timings})
    out.write_text(json.dumps(result.as_dict(), allow_nan=False), encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# the harness side


CONNECTOR_PAIR_MODULE = "qualify.interfaces.connector_pair_command"
"""The ``python -m`` target of a producer or consumer process (commands live in interfaces)."""


def _run_process(role: str, arguments: list[str], workdir: Path, timeout_s: float, label: str | None = None) -> None:
    log = workdir / f"{label or role}.log"
    command = [sys.executable, "-m", CONNECTOR_PAIR_MODULE, role, *arguments]
    with open(log, "w", encoding="utf-8") as handle:
        try:
            done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  check=False, env=dict(os.environ))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"connector pair {role}: no result within {timeout_s:.0f} s (log: {log})") from None
    if done.returncode != 0:
        lines = [line for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
        refusal = next((line for line in reversed(lines) if line.startswith("refused: ")), None)
        if refusal is not None:
            raise Refused(refusal[len("refused: "):])
        raise RuntimeError(one_line(f"connector pair {role} failed (exit {done.returncode}): {log_cause(log)} "
                                    f"(log: {log})"))


def log_cause(log: Path) -> str:
    """The exception that ended an engine process, from its log (vLLM wraps engine-core failures:
    the first one raised names the cause), else the log's last line."""
    lines = [line for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    errors = [_RANK_PREFIX.sub("", line) for line in lines if _EXCEPTION_LINE.match(_RANK_PREFIX.sub("", line))]
    return (errors[0] if errors else (lines[-1] if lines else "no output"))[:400]


_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit): ")


def summary_line(result: PairResult) -> str:
    """One line per pair run: what the loaded branch claimed and how it compares with the cold one."""
    branch = result.branch(LOADED_KEY)
    if branch.claimed_tokens == 0:
        return (f"{result.connector['name']}: no handoff (the consumer's connector claimed 0 of "
                f"{result.prompt_tokens} prompt tokens; the cold recompute's suppressed hit was {result.suppressed_hit})")
    tokens = "tokens equal" if branch.token_divergence is None else f"tokens diverge at {branch.token_divergence}"
    first = branch.kv_cells[0] if branch.kv_cells else None
    kv = "loaded KV bit-equal to the cold prefill" if first is None else (
        f"loaded KV differs in {len(branch.kv_cells)} cells, first at layer {first['layer']} {first['tensor']} "
        f"head {first['head']} block {first['block']} position {first['first_position']}")
    return (f"{result.connector['name']}: loaded {branch.claimed_tokens} of {result.prompt_tokens} prompt tokens; "
            f"{tokens} ({result.decode_tokens}); logits max abs {branch.logits_max_abs:.3g} "
            f"(bit-equal: {branch.logit_rows_equal}); {kv}; {len(branch.saved_mismatches)} loaded cells differ "
            f"from what the producer saved")


def run_producer(spec: ConnectorSpec, workdir: Path, *, model_dir: Path = assets.MODEL_DIR,
                 timeout_s: float = PROCESS_TIMEOUT_S) -> Path:
    """Run the producer process; returns the file of its saved digests (``workdir/producer.json``)."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "producer-connector.json"
    spec_path.write_text(json.dumps(spec.as_dict()), encoding="utf-8")
    out = workdir / "producer.json"
    _run_process("producer", ["--connector", str(spec_path), "--out", str(out), "--model-dir", str(model_dir)],
                 workdir, timeout_s)
    return out


def run_consumer(spec: ConnectorSpec, saved: Path | None, workdir: Path, *, faults: tuple[str, ...] = (),
                 model_dir: Path = assets.MODEL_DIR, timeout_s: float = PROCESS_TIMEOUT_S,
                 label: str = "consumer") -> PairResult:
    """Run a consumer process against the producer's ``saved`` digests (None: the consumer is its
    own producer); ``faults`` adds one branch per fault (the connector must be the fault-injecting
    wrapper)."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / f"{label}-connector.json"
    spec_path.write_text(json.dumps(spec.as_dict()), encoding="utf-8")
    out = workdir / f"{label}.json"
    arguments = ["--connector", str(spec_path), "--out", str(out), "--model-dir", str(model_dir)]
    if saved is not None:
        arguments += ["--saved", str(saved)]
    for fault in faults:
        arguments += ["--fault", fault]
    _run_process("consumer", arguments, workdir, timeout_s, label)
    return load_result(out)


def run_pair(spec: ConnectorSpec, workdir: Path, *, model_dir: Path = assets.MODEL_DIR,
             same_engine: bool = False) -> PairResult:
    """The producer, then the consumer, of ``spec`` (no faults); with ``same_engine`` one
    ``kv_both`` engine is both (for connectors that offload and reload within an engine)."""
    saved = None if same_engine else run_producer(spec, workdir, model_dir=model_dir)
    return run_consumer(spec, saved, workdir, model_dir=model_dir)


def load_result(path: Path) -> PairResult:
    """A :class:`PairResult` read back from its JSON form."""
    document = strict_json_loads(path.read_bytes())
    if not isinstance(document, dict) or document.pop("schema", None) != RESULT_SCHEMA:
        raise Refused(f"connector pair result {path}: expected schema {RESULT_SCHEMA}")
    document["branches"] = [_branch_from(b) for b in document["branches"]]
    return PairResult(**document)

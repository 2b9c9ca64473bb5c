"""Resident connector engines: a vLLM producer and a vLLM consumer joined by the connector under
test, each kept up for a whole run and asked one request at a time.

A qualification makes three handoffs and a calibration eight; starting two engines per handoff
would cost more than the handoffs. Each engine runs in its own process (vLLM keeps process
globals: one engine per process), started as ``python -m qualify.interfaces.connector_pair_command
serve-producer|serve-consumer``. Requests arrive one JSON line at a time on the process's stdin;
each reply is one JSON line on a pipe of its own (vLLM writes its logs to stdout and stderr, which
go to the session's log file). Arrays travel as ``.npy``/``.npz`` files in the session's folder.

* producer: ``produce`` prefills a prompt through the wrapped connector (one generated token) and
  replies with the observer's per-cell digests of what the connector was handed to save, and the
  ``kv_transfer_params`` the request returned. The request carries what a disaggregated-prefill
  proxy sends (``transfer``: ``{"do_remote_decode": true, ...}``), so a connector with a
  prefill/decode handshake (NIXL) keeps the prompt's KV for the consumer and says where it is;
  connectors without one ignore it and return none (ExampleConnector).
* consumer: ``cold`` decodes a prompt with the connector's hit suppressed (the cold local
  recompute) and keeps its prefill KV; ``load`` decodes it again, its request carrying the
  producer's returned ``kv_transfer_params`` (``transfer``), the connector loading what it claims,
  and writes the tokens, every raw logit row and the loaded KV (whole claimed positions).

Both engines stay up for the whole run, so a producer is alive while its consumer reads (a
handshake connector's consumer pulls the KV from the producer's pages). Each engine gets a
side-channel port of its own (:data:`~qualify.engines.connector_pair.SIDE_CHANNEL_PORT_ENV`, NIXL's
handshake listener; other connectors ignore it), free when the session starts, and the run gives
both engines one model path (``model_view``: NIXL's handshake refuses a peer that names the model
by another path).

Nothing here judges: the run builds sample records from these files (:mod:`qualify.run.connector_lane`).

Imports: ``qualify.core``, ``qualify.contract`` and ``qualify.engines``; vLLM only in the engine processes.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import numpy as np

from qualify.core.errors import Refused, one_line
from qualify.engines.connector_under_test import ConnectorSpec

SERVE_ROLES = ("serve-producer", "serve-consumer")
START_TIMEOUT_S = 600.0
"""Longest an engine may take to start (vLLM's CPU engine starts in about 20 s on two cores)."""
REQUEST_TIMEOUT_S = 900.0
"""Longest one request may take (a 2048-token prefill and 256 decoded tokens take seconds)."""


# ---------------------------------------------------------------------------------------------
# the engine process


def serve(role: str, spec: ConnectorSpec, model_dir: Path, requests: IO[str], reply: IO[str],
          side_channel_port: int | None = None, model_view: Path | None = None) -> None:
    """The resident engine loop: start the engine, reply ``ready``, then answer each request line
    until ``quit`` or end of input. A request that fails is answered with its one-line cause and
    the process goes on only when the failure was the request's (a refused request)."""
    from qualify.engines.connector_pair import _build_llm
    from qualify.engines.vllm_engine import check_pin, vllm_engine_abi

    if role not in SERVE_ROLES:
        raise Refused(f"role: found {role!r}, expected one of {', '.join(SERVE_ROLES)}")
    started = time.perf_counter()
    llm = _build_llm(spec, "kv_producer" if role == "serve-producer" else "kv_consumer", model_dir,
                     side_channel_port=side_channel_port, model_view=model_view)
    # The consumer reads KV out of vLLM's pages: trusted only once its decode reproduces the
    # reference engine's KV on the fixture's first positions (a cold request, nothing loaded).
    layout = None if role == "serve-producer" else _check_layout(llm, model_dir)
    known_answer = _known_answer(llm, model_dir)
    from qualify.core.hostenv import host_facts

    # What this engine's process runs on (CPU, BLAS, threads, its environment overrides): host.json.
    _answer(reply, {"ok": True, "ready": True, "engine_abi": vllm_engine_abi(), "version": check_pin(),
                    "start_s": time.perf_counter() - started, "layout_max_abs": layout, "host_facts": host_facts(),
                    "kat_sha256": known_answer})
    for line in requests:
        if not line.strip():
            continue
        request = json.loads(line)
        op = request.get("op")
        if op == "quit":
            return
        try:
            if role == "serve-producer" and op == "produce":
                answer = _serve_produce(llm, request)
            elif role == "serve-consumer" and op in ("cold", "load"):
                answer = _serve_decode(llm, request, model_dir)
            else:
                raise Refused(f"request op: found {op!r}, expected what {role} answers")
        except Refused as exc:
            _answer(reply, {"ok": False, "refused": one_line(str(exc))})
            continue
        _answer(reply, {"ok": True, **answer})


def _answer(reply: IO[str], document: dict[str, Any]) -> None:
    reply.write(json.dumps(document, allow_nan=False) + "\n")
    reply.flush()


def _prompt_of(request: dict[str, Any]) -> list[int]:
    return [int(t) for t in np.load(request["prompt"], allow_pickle=False)]


def _serve_produce(llm: Any, request: dict[str, Any]) -> dict[str, Any]:
    from qualify.engines.connector_pair import _produce

    started = time.perf_counter()
    saved = _produce(llm, _prompt_of(request), request["key"], transfer=_transfer_of(request))
    return {**saved, "seconds": time.perf_counter() - started}


def _transfer_of(request: dict[str, Any]) -> dict[str, Any] | None:
    transfer = request.get("transfer")
    if transfer is not None and not isinstance(transfer, dict):
        raise Refused(f"request transfer: found {type(transfer).__name__}, expected a JSON object or null")
    return transfer


def _check_layout(llm: Any, model_dir: Path) -> float:
    from qualify.core import assets
    from qualify.core.kv import KVCache
    from qualify.engines.connector_delegate import RequestTag
    from qualify.engines.connector_observer import take_observation
    from qualify.engines.connector_pair import _generate
    from qualify.engines.vllm_engine import LAYOUT_PROBE_TOKENS, check_page_decode

    prompt = [int(t) for t in assets.load_prompt()[:LAYOUT_PROBE_TOKENS]]
    _generate(llm, prompt, 1, RequestTag("layout-probe", cold=True, capture=True), logits=False)
    kv = take_observation("layout-probe").saved
    layers = sorted(kv)
    return check_page_decode(KVCache([kv[i][0] for i in layers], [kv[i][1] for i in layers]), model_dir)


def _known_answer(llm: Any, model_dir: Path) -> str:
    """This engine's known-answer digest (``qualify.engines.kat``): the fixed KAT tokens as one cold
    request (the connector's hit suppressed), its prefill KV read out of vLLM's pages, and
    ``KAT_DECODE_STEPS`` greedy tokens with their raw logit rows. It pins vLLM's arithmetic on this
    host; the connector's own path is what the handoffs judge."""
    from qualify.engines.checkpoint import load_config
    from qualify.engines.connector_delegate import RequestTag
    from qualify.engines.connector_observer import take_observation
    from qualify.engines.connector_pair import _generate
    from qualify.engines.kat import KAT_DECODE_STEPS, digest_of, kat_tokens
    from qualify.engines.vllm_engine import raw_logit_rows

    vocab = load_config(model_dir).geometry.vocab
    tokens = [int(t) for t in kat_tokens(vocab)]
    completion = _generate(llm, tokens, KAT_DECODE_STEPS, RequestTag("known-answer", cold=True, capture=True),
                           logits=True)
    kv = take_observation("known-answer").saved
    parts: list[tuple[str, np.ndarray]] = []
    for layer in sorted(kv):
        parts += [(f"prefill.{layer}.k", kv[layer][0]), (f"prefill.{layer}.v", kv[layer][1])]
    parts += [("decode.tokens", np.asarray(completion.token_ids, dtype=np.int32)),
              ("decode.logits", raw_logit_rows(completion, KAT_DECODE_STEPS, vocab))]
    return digest_of(parts)


def _serve_decode(llm: Any, request: dict[str, Any], model_dir: Path) -> dict[str, Any]:
    """``cold``: the prompt with the connector's hit suppressed, its prefill KV kept; ``load``: the
    connector loads what it claims, the loaded KV kept. Both decode ``tokens`` greedy tokens with
    every raw logit row, written with the KV to ``out`` (``.npz``)."""
    from qualify.engines.checkpoint import load_config
    from qualify.engines.connector_delegate import RequestTag
    from qualify.engines.connector_observer import take_observation
    from qualify.engines.connector_pair import _digest_names, _generate
    from qualify.engines.vllm_engine import raw_logit_rows

    cold = request["op"] == "cold"
    key, count = request["key"], int(request["tokens"])
    prompt = _prompt_of(request)
    tag = RequestTag(key, cold=cold, capture=cold, fault=None if cold else request.get("fault"))
    started = time.perf_counter()
    completion = _generate(llm, prompt, count, tag, logits=True, transfer=None if cold else _transfer_of(request))
    seconds = time.perf_counter() - started
    observed = take_observation(key)
    vocab = load_config(model_dir).geometry.vocab
    rows = raw_logit_rows(completion, count, vocab)
    kv = observed.saved if cold else observed.loaded
    if cold and (observed.claimed_tokens or not kv):
        raise RuntimeError(f"cold recompute {key}: the connector loaded {observed.claimed_tokens} tokens and "
                           f"{len(kv)} layers were captured; expected 0 and every layer")
    layers = sorted(kv)
    arrays: dict[str, np.ndarray] = {"tokens": np.asarray(completion.token_ids, dtype=np.int64), "logits": rows}
    for layer in layers:
        arrays[f"k{layer}"], arrays[f"v{layer}"] = kv[layer]
    np.savez(request["out"], **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds too narrowly
    return {"seconds": seconds, "layers": len(layers), "claimed_tokens": observed.claimed_tokens,
            "suppressed_hit": observed.suppressed_hit, "loaded_digests": _digest_names(observed.loaded_digests)}


# ---------------------------------------------------------------------------------------------
# the harness side


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing on ``host`` listens on now (the kernel's choice), for an engine's side channel."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
    return port


def _parent_path() -> str:
    """This process's import path for the engine process: a connector (and its distribution's
    version, which the engine process pins again) resolves there as it resolved here, however this
    process was started (a console script has no working directory on its path, ``python -m`` has)."""
    entries = [os.path.abspath(entry) if entry else os.getcwd() for entry in sys.path]
    return os.pathsep.join(dict.fromkeys(entry for entry in entries if os.path.isdir(entry)))


class EngineSession:
    """One resident engine process (see the module docstring); :meth:`request` asks it one thing."""

    def __init__(self, role: str, spec: ConnectorSpec, model_dir: Path, workdir: Path,
                 env: dict[str, str] | None = None, start_timeout_s: float = START_TIMEOUT_S,
                 model_view: Path | None = None) -> None:
        if role not in SERVE_ROLES:
            raise Refused(f"engine session role: found {role!r}, expected one of {', '.join(SERVE_ROLES)}")
        from qualify.engines.connector_pair import CONNECTOR_PAIR_MODULE

        self.role = role
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        spec_path = workdir / f"{role}-connector.json"
        spec_path.write_text(json.dumps(spec.as_dict()), encoding="utf-8")
        self.log_path = workdir / f"{role}.log"
        self.side_channel_port = free_port()
        read_end, write_end = os.pipe()
        self._log = open(self.log_path, "a", encoding="utf-8")
        try:
            self.process = subprocess.Popen(
                # -P: no working directory put first on the path; the path is this process's (PYTHONPATH).
                [sys.executable, "-P", "-m", CONNECTOR_PAIR_MODULE, role, "--connector", str(spec_path),
                 "--out", str(workdir), "--model-dir", str(model_dir), "--reply-fd", str(write_end),
                 "--side-channel-port", str(self.side_channel_port),
                 *(["--model-view", str(model_view)] if model_view is not None else [])],
                stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT, pass_fds=(write_end,),
                env={**os.environ, **(env or {}), "PYTHONPATH": _parent_path()}, text=True, start_new_session=True)
        finally:
            os.close(write_end)
        self._replies = os.fdopen(read_end, "r", encoding="utf-8")
        self._buffer = ""
        self.ready = self._reply(start_timeout_s, "start")

    def request(self, document: dict[str, Any], timeout_s: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
        """Send one request; its reply. ``Refused`` when the engine refused it, ``RuntimeError``
        (with the log's cause) when the process died or did not answer in time."""
        stdin = self.process.stdin
        if stdin is None or self.process.poll() is not None:
            raise RuntimeError(self._died("before the request"))
        try:
            stdin.write(json.dumps(document) + "\n")
            stdin.flush()
        except BrokenPipeError:
            raise RuntimeError(self._died("while sending a request")) from None
        return self._reply(timeout_s, str(document.get("op")))

    def _reply(self, timeout_s: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while "\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise RuntimeError(f"connector {self.role}: no answer to {what} within {timeout_s:.0f} s "
                                   f"(log: {self.log_path})")
            ready, _, _ = select.select([self._replies], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self._replies.fileno(), 1 << 16).decode("utf-8")
                if not chunk:
                    self.process.wait(timeout=30)
                    raise RuntimeError(self._died(f"during {what}"))
                self._buffer += chunk
        line, self._buffer = self._buffer.split("\n", 1)
        answer = json.loads(line)
        if not answer.get("ok"):
            if "refused" in answer:
                raise Refused(answer["refused"])
            raise RuntimeError(f"connector {self.role}: {answer.get('error', 'failed')}")
        return dict(answer)

    def _died(self, when: str) -> str:
        from qualify.engines.connector_pair import log_cause

        return one_line(f"connector {self.role} engine exited {when} (exit {self.process.poll()}): "
                        f"{log_cause(self.log_path)} (log: {self.log_path})")

    def close(self) -> None:
        """Ask the engine to quit, then stop it (its whole process group) if it does not."""
        if self.process.poll() is None:
            try:
                if self.process.stdin is not None:
                    self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                    self.process.stdin.close()
                self.process.wait(timeout=30)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                self.kill()
                self.process.wait()
        self._replies.close()
        self._log.close()

    def kill(self) -> None:
        """Stop the engine at once (an interrupted run)."""
        import signal

        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

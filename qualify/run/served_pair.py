"""A served prefill/decode pair, qualified black-box over HTTP (issue 36 item 3).

``qualify --recipe native-text --prefill-url URL --decode-url URL [--model M]`` runs, against two
running ``vllm serve`` instances joined by the user's KV connector:

1. **checks** (each refused in one line, exit 2, with a refused receipt): both URLs given and
   answering within a bounded timeout; each a vLLM server (``/version``, ``/v1/models`` owned by
   vllm); each serving ``--model`` (the served root's ``config.json`` equal to the model's when
   the root is readable here, else the served name); both serving the same model;
2. **the cold recompute**, first, before anything was prefilled: the decode server serves the
   fixture prompt (token ids, ``/v1/completions``) for 256 greedy tokens with the strongest
   logprobs it allows (``logprobs=-1``, full vocabulary, when ``--max-logprobs`` allows it, else
   the largest top-k of 20, 5, 1 it accepts); neither its connector nor its prefix cache may
   supply any of the prompt;
3. **three ordered handoffs**: the prefill server prefills the prompt (``max_tokens=1``,
   ``kv_transfer_params {"do_remote_decode": true, ...}`` as vLLM's disaggregated-prefill proxies
   send it); its returned ``kv_transfer_params`` go with the decode request; the decode server
   decodes 256 greedy tokens from the transferred KV. Each server's ``/metrics``
   (``vllm:prompt_tokens``, ``vllm:prefix_cache_hits``, ``vllm:external_prefix_cache_hits``) is
   read around each request, so the loaded branch's prompt is known to come from its connector, and
   the prefill server's KV from its own computation (the per-request ``cached_tokens`` is recorded,
   not trusted: under a handshake vLLM reports the prefill server's count there);
4. **the judge** (:mod:`qualify.judge.served`) and a signed receipt like any run's.

HTTP stays in :mod:`qualify.handoff.served`; judging is pure.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qualify.archive.writer import ReceiptWriter
from qualify.core import assets
from qualify.core.digests import jcs_sha256
from qualify.core.errors import Refused, one_line
from qualify.handoff.served import Endpoint, parse_base_url
from qualify.judge import Verdict, judge_refused
from qualify.judge.served import FULL, TOP_K, EvidenceMode, ServedBranch, ServedHandoff, ServedRule, judge_served_pair

LANE = "served-pair"
IDENTITY_SCHEMA = "trust-ladder.served-pair-identity.v1"
OUTPUT_TOKENS = 256
REPETITIONS = 3
LOGPROB_BOUND = 1e-3
"""The bound on |Δ logprob| (nats) between a loaded branch and the cold recompute: stated, not
calibrated (a served pair has no calibration yet)."""
TOP_K_TRIED = (20, 5, 1)
"""The top-k values tried, largest first, when the decode server refuses full logprobs."""
DECODE_TIMEOUT_S = 600.0
"""Seconds one completion request may take (256 tokens on a slow CPU server)."""
METRICS_SETTLE_S = 5.0
"""Seconds to wait for a server's cache-hit counters to account for a finished request."""
PREFILL_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None}
"""What vLLM's disaggregated-prefill proxies send with the prefill request."""
STEPS = ("pair checked", "cold recompute", "handoff 1/3", "handoff 2/3", "handoff 3/3", "verdict")

_METRIC = re.compile(
    r"^(vllm:(?:(?:external_)?prefix_cache_hits|prompt_tokens)_total)(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$")


@dataclass(frozen=True)
class ServedOptions:
    """What the operator asked for."""

    recipe: str
    prefill_url: str | None
    decode_url: str | None
    model: str | None
    receipts: Path
    command_line: Sequence[str]


@dataclass
class ServedRun:
    """A served-pair run's outcome: its verdict, receipt path and the lines it showed."""

    verdict: Verdict | None = None
    receipt_path: Path | None = None
    samples: list[dict[str, Any]] = field(default_factory=list)
    log: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Server:
    """One checked server: its endpoint, vLLM version and the model entry it serves."""

    endpoint: Endpoint
    version: str
    model_id: str
    root: str
    max_model_len: int | None
    model_check: str

    def document(self) -> dict[str, Any]:
        return {"url": self.endpoint.base, "vllm_version": self.version, "model_id": self.model_id,
                "model_root": self.root, "max_model_len": self.max_model_len, "model_check": self.model_check}


# --------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class ExpectedModel:
    """The model ``--model`` names: its name, its parsed config.json (None for a GGUF file) and
    the prompt's token ids under its tokenizer."""

    name: str
    config: dict[str, Any] | None
    prompt: tuple[int, ...]


def expected_model(model: str | None) -> ExpectedModel:
    """The shipped model (no ``--model``, or its directory), or the one ``--model`` names."""
    from qualify.engines.chosen_model import use_model

    shipped = model is None or (Path(model).is_dir() and Path(model).resolve() == assets.MODEL_DIR.resolve())
    choice = use_model(None if shipped else model)
    path = assets.MODEL_DIR if choice is None else choice.path
    config = None
    if (path / "config.json").is_file():
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    name = "shipped" if choice is None else choice.name
    return ExpectedModel(name=name, config=config, prompt=tuple(int(t) for t in assets.load_prompt()))


def _served_config(root: str) -> dict[str, Any] | None:
    path = Path(root) / "config.json"
    try:
        document = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError):
        return None
    return document if isinstance(document, dict) else None


def _differing_field(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> str:
    for key in sorted(set(ours) | set(theirs)):
        if ours.get(key) != theirs.get(key):
            return key
    return "(none)"


def check_server(option: str, url: str | None, model: ExpectedModel, model_argument: str | None) -> Server:
    """One server of the pair, refused in one line naming ``option``: missing, not answering,
    not vLLM, not serving the model."""
    if url is None:
        raise Refused(f"{option}: missing; a served pair needs both --prefill-url and --decode-url")
    endpoint = Endpoint(option, parse_base_url(option, url))
    version_document = endpoint.get_json("/version", "a vLLM server's version document")
    version = version_document.get("version") if isinstance(version_document, dict) else None
    if not isinstance(version, str) or not version:
        raise Refused(f"{option} {endpoint.base}: /version names no vLLM version; not a vLLM server")
    models = endpoint.get_json("/v1/models", "vLLM's model list")
    entries = models.get("data") if isinstance(models, dict) else None
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise Refused(f"{option} {endpoint.base}: /v1/models lists no model")
    served = [e for e in entries if e.get("owned_by") == "vllm" and isinstance(e.get("id"), str)]
    if not served:
        raise Refused(f"{option} {endpoint.base}: /v1/models lists no model owned by vllm; not a vLLM server")
    if len(served) != 1:
        raise Refused(f"{option} {endpoint.base}: serves {len(served)} models; a served pair serves one")
    entry = served[0]
    model_id, root = str(entry["id"]), str(entry.get("root") or entry["id"])
    config = _served_config(root)
    if config is not None and model.config is not None:
        if config != model.config:
            raise Refused(f"{option} {endpoint.base}: serves another model: {root}/config.json differs from "
                          f"{model.name}'s in {_differing_field(model.config, config)!r}")
        check = f"config.json of {root} equals {model.name}'s"
    else:
        names = {model.name, *([model_argument, Path(model_argument).name] if model_argument else [])}
        why = (f"{root}/config.json is not readable here" if config is None
               else f"{model.name} has no config.json to compare (a GGUF file)")
        if model_id not in names and Path(root).name not in names:
            raise Refused(f"{option} {endpoint.base}: serves {model_id!r} (root {root!r}), not --model {model.name}; "
                          f"checked by name: {why}")
        check = f"by name only ({model_id!r}): {why}"
    max_len = entry.get("max_model_len")
    if type(max_len) is int and max_len < len(model.prompt) + OUTPUT_TOKENS:
        raise Refused(f"{option} {endpoint.base}: max_model_len {max_len} is shorter than the fixture's "
                      f"{len(model.prompt)} + {OUTPUT_TOKENS} tokens")
    return Server(endpoint, version, model_id, root, max_len if type(max_len) is int else None, check)


# --------------------------------------------------------------------------- requests


def cache_counters(server: Server) -> tuple[float, float, float] | None:
    """(prompt tokens, local prefix-cache hits, connector hits) from the server's /metrics, in
    tokens since it started; None when it does not expose all three."""
    answer = server.endpoint.get("/metrics")
    if answer.status != 200:
        return None
    found: dict[str, float] = {}
    for line in answer.body.decode("utf-8", "replace").splitlines():
        match = _METRIC.match(line)
        if match:
            found[match.group(1)] = found.get(match.group(1), 0.0) + float(match.group(2))
    names = ("vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")
    if not all(name in found for name in names):
        return None
    return found[names[0]], found[names[1]], found[names[2]]


def request_hits(server: Server, before: tuple[float, float, float] | None,
                 prompt_tokens: int) -> tuple[int | None, int | None]:
    """(local prefix-cache hits, connector hits) of one request of ``prompt_tokens``: the counters'
    deltas once the server has counted the request's prompt (waiting up to
    :data:`METRICS_SETTLE_S`); (None, None) when that is not known."""
    if before is None:
        return None, None
    deadline = time.monotonic() + METRICS_SETTLE_S
    while True:
        after = cache_counters(server)
        if after is None:
            return None, None
        prompt, local, external = (a - b for a, b in zip(after, before, strict=True))
        if prompt == prompt_tokens:
            return int(local), int(external)
        if prompt > prompt_tokens or time.monotonic() >= deadline:  # another request's tokens: unknown
            return None, None
        time.sleep(0.1)


def _completion_body(server: Server, prompt: Sequence[int], max_tokens: int, logprobs: int | None,
                     transfer: Mapping[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": server.model_id, "prompt": list(prompt), "max_tokens": max_tokens, "min_tokens": max_tokens,
        "temperature": 0.0, "ignore_eos": True, "stream": False, "return_token_ids": True,
        "return_tokens_as_token_ids": True}
    if logprobs is not None:
        body["logprobs"] = logprobs
    if transfer is not None:
        body["kv_transfer_params"] = dict(transfer)
    return body


def complete(server: Server, prompt: Sequence[int], max_tokens: int, logprobs: int | None,
             transfer: Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    """One /v1/completions request; its document, refused in one line when it failed."""
    status, document = server.endpoint.post_json(
        "/v1/completions", _completion_body(server, prompt, max_tokens, logprobs, transfer), DECODE_TIMEOUT_S)
    if status != 200 or not isinstance(document, dict):
        message = document.get("message") or document.get("error") if isinstance(document, dict) else None
        raise Refused(f"{server.endpoint.option} {server.endpoint.base}: {what}: HTTP {status}"
                      + (f" ({one_line(str(message))[:200]})" if message else ""))
    return document


def _cached_tokens(document: Mapping[str, Any]) -> int | None:
    usage = document.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if type(cached) is int and cached >= 0 else None


_TOKEN_KEY = re.compile(r"^token_id:(-?[0-9]+)$")


def branch_of(server: Server, document: Mapping[str, Any], n: int, hits: tuple[int | None, int | None],
              what: str) -> ServedBranch:
    """A decode's tokens and per-position logprobs (keys ``token_id:N``), refused when malformed."""
    choices = document.get("choices")
    choice = choices[0] if isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict) else None
    tokens = choice.get("token_ids") if choice is not None else None
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise Refused(f"{server.endpoint.option} {server.endpoint.base}: {what}: no token_ids in its answer "
                      f"(return_token_ids is a vLLM request field); not a vLLM server")
    logprobs = choice.get("logprobs") if choice is not None else None
    rows = logprobs.get("top_logprobs") if isinstance(logprobs, dict) else None
    parsed: list[dict[int, float]] = []
    for row in rows if isinstance(rows, list) else []:
        entries: dict[int, float] = {}
        for key, value in (row.items() if isinstance(row, dict) else []):
            match = _TOKEN_KEY.match(key) if isinstance(key, str) else None
            if match is None or not isinstance(value, (int, float)):
                raise Refused(f"{server.endpoint.option} {server.endpoint.base}: {what}: a logprob keyed "
                              f"{str(key)[:40]!r}, expected 'token_id:N' (return_tokens_as_token_ids)")
            entries[int(match.group(1))] = float(value)
        parsed.append(entries)
    return ServedBranch(tokens=tuple(tokens[:n]), logprobs=tuple(parsed[:n]), cached_tokens=_cached_tokens(document),
                        external_hits=hits[1], local_hits=hits[0])


# --------------------------------------------------------------------------- the run


def _refused_receipt(options: ServedOptions, log: Sequence[str], reason: str) -> Path:
    with ReceiptWriter(options.receipts, command_line=options.command_line, identity=None,
                       recipe=options.recipe, lane=LANE) as writer:
        for line in log:
            writer.log(line)
        return writer.finalize(judge_refused(reason))


def run_served_pair(options: ServedOptions, show: Callable[[str], None]) -> ServedRun:
    """Check the pair, run the cold recompute and the three handoffs, judge, write the receipt.
    Every refusal leaves a refused receipt (``run.verdict.refused``)."""
    run = ServedRun()

    def note(line: str) -> None:
        run.log.append(line)
        show(line)

    try:
        return _run(options, run, note)
    except Refused as exc:
        reason = str(exc)
        run.verdict = judge_refused(reason)
        run.receipt_path = _refused_receipt(options, run.log, reason)
        return run


def _identity(options: ServedOptions, model: ExpectedModel, prefill: Server, decode: Server,
              rule: ServedRule) -> dict[str, Any]:
    return {"schema": IDENTITY_SCHEMA, "lane": LANE, "recipe": options.recipe,
            "model": {"name": model.name, "config_sha256": None if model.config is None else jcs_sha256(model.config),
                      "prompt_tokens": len(model.prompt)},
            "prefill": prefill.document(), "decode": decode.document(), "rule": rule.document()}


def _cold(decode: Server, model: ExpectedModel, vocab: int | None) -> tuple[ServedBranch, EvidenceMode, int | None, int]:
    """The cold recompute with the strongest logprobs the decode server accepts: (branch, mode, k, vocab)."""
    tries: list[int] = [-1, *TOP_K_TRIED]
    for logprobs in tries:
        before = cache_counters(decode)
        status, document = decode.endpoint.post_json(
            "/v1/completions", _completion_body(decode, model.prompt, OUTPUT_TOKENS, logprobs, None), DECODE_TIMEOUT_S)
        if status == 400 and logprobs != tries[-1]:
            continue  # the server's --max-logprobs is smaller: try the next top-k
        if status != 200 or not isinstance(document, dict):
            raise Refused(f"--decode-url {decode.endpoint.base}: the cold recompute's request: HTTP {status}")
        branch = branch_of(decode, document, OUTPUT_TOKENS, request_hits(decode, before, len(model.prompt)),
                           "the cold recompute")
        widths = {len(row) for row in branch.logprobs}
        if logprobs == -1:
            size = vocab if vocab is not None else min(widths, default=0)
            if size > 0 and all(width >= size for width in widths) and len(branch.logprobs) == OUTPUT_TOKENS:
                return branch, FULL, None, size
            continue
        return branch, TOP_K, logprobs, vocab or 0
    raise Refused(f"--decode-url {decode.endpoint.base}: gives no logprobs for the fixture (tried -1 and top-k "
                  f"{', '.join(str(k) for k in TOP_K_TRIED)})")


def _run(options: ServedOptions, run: ServedRun, note: Callable[[str], None]) -> ServedRun:
    for option, url in (("--prefill-url", options.prefill_url), ("--decode-url", options.decode_url)):
        if url is None:  # before any request: a pair is both servers
            raise Refused(f"{option}: missing; a served pair needs both --prefill-url and --decode-url")
        parse_base_url(option, url)
    model = expected_model(options.model)
    prefill = check_server("--prefill-url", options.prefill_url, model, options.model)
    decode = check_server("--decode-url", options.decode_url, model, options.model)
    if prefill.endpoint.base == decode.endpoint.base:
        raise Refused(f"--decode-url {decode.endpoint.base}: the same server as --prefill-url; a pair is two servers")
    configs = _served_config(prefill.root), _served_config(decode.root)
    same = prefill.root == decode.root or (configs[0] is not None and configs[0] == configs[1]) or (
        None in configs and prefill.model_id == decode.model_id)
    if not same:
        raise Refused(f"--decode-url {decode.endpoint.base}: serves {decode.root!r}, the prefill server {prefill.root!r}")
    note(f"pair checked: prefill {prefill.endpoint.base} (vLLM {prefill.version}), decode {decode.endpoint.base} "
         f"(vLLM {decode.version}), model {model.name}: {decode.model_check}")
    vocab = model.config.get("vocab_size") if model.config is not None else None
    started = time.monotonic()
    cold, mode, k, size = _cold(decode, model, vocab if type(vocab) is int else None)
    note(f"cold recompute: {len(cold.tokens)} tokens, {'full' if mode == FULL else f'top-{k}'} logprobs, "
         f"connector {cold.external_hits}, prefix cache {cold.local_hits} (reported cached {cold.cached_tokens}) "
         f"({time.monotonic() - started:.1f} s)")
    rule = ServedRule(mode=mode, k=k, vocab=size, bound=LOGPROB_BOUND,
                      prompt_tokens=len(model.prompt), output_tokens=OUTPUT_TOKENS, repetitions=REPETITIONS)
    handoffs: list[ServedHandoff] = []
    logprobs = -1 if mode == FULL else k
    with ReceiptWriter(options.receipts, command_line=options.command_line,
                       identity=_identity(options, model, prefill, decode, rule), recipe=options.recipe, lane=LANE,
                       rule=rule.document()) as writer:
        for line in run.log:
            writer.log(line)
        try:
            _handoffs(prefill, decode, model, logprobs, writer, note, handoffs)
        except Refused as exc:  # a server failed mid-run: the receipt says so, refused
            run.verdict = judge_refused(str(exc))
            run.receipt_path = writer.finalize(run.verdict)
            return run
        verdict, samples = judge_served_pair(cold, handoffs, rule)
        writer.add_evidence("served-pair", {"prefill": prefill.document(), "decode": decode.document(),
                                            "cold_tokens": list(cold.tokens), "cold_cached_tokens": cold.cached_tokens,
                                            "cold_connector_tokens": cold.external_hits,
                                            "cold_prefix_cache_tokens": cold.local_hits,
                                            "rule": rule.document()})
        for sample in samples:
            document = sample.document()
            run.samples.append(document)
            writer.add_sample(document)
        run.verdict = verdict
        run.receipt_path = writer.finalize(verdict)
    return run


def _handoffs(prefill: Server, decode: Server, model: ExpectedModel, logprobs: int | None, writer: ReceiptWriter,
              note: Callable[[str], None], handoffs: list[ServedHandoff]) -> None:
    """The three ordered handoffs: prefill on the prefill server, decode from the transferred KV."""
    for repetition in range(1, REPETITIONS + 1):
        started = time.monotonic()
        before = cache_counters(prefill)
        produced = complete(prefill, model.prompt, 1, None, PREFILL_TRANSFER_PARAMS, f"handoff {repetition}'s prefill")
        prefill_cached = _cached_tokens(produced)
        prefill_external = request_hits(prefill, before, len(model.prompt))[1]
        transfer = produced.get("kv_transfer_params")
        before = cache_counters(decode)
        loaded_document = complete(decode, model.prompt, OUTPUT_TOKENS, logprobs,
                                   transfer if isinstance(transfer, dict) else None, f"handoff {repetition}'s decode")
        cached = _cached_tokens(loaded_document)
        loaded = branch_of(decode, loaded_document, OUTPUT_TOKENS, request_hits(decode, before, len(model.prompt)),
                           f"handoff {repetition}'s decode")
        handoffs.append(ServedHandoff(repetition, prefill_cached, prefill_external, loaded))
        line = (f"handoff {repetition}/{REPETITIONS}: prefill cached {prefill_cached} (connector {prefill_external}), "
                f"transfer params {'returned' if isinstance(transfer, dict) else 'none'}; decode connector "
                f"{loaded.external_hits}, prefix cache {loaded.local_hits} (reported cached {cached}) "
                f"({time.monotonic() - started:.1f} s)")
        writer.log(line)
        note(line)

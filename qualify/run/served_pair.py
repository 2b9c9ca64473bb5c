"""A served prefill/decode pair, qualified black-box over HTTP (issue 36 item 3).

``qualify --recipe native-text --prefill-url URL --decode-url URL [--model M] --served-identity PATH``
runs, against two running ``vllm serve`` instances joined by the user's KV connector:

1. **checks** (each refused in one line, exit 2, with a refused receipt): both URLs given; the
   identity file given, JSON, of its schema (:mod:`qualify.contract.served_identity`; without it
   the run is refused, naming the calibrate command: a served pair is judged only under bounds
   calibrated for it); each URL answering within a bounded timeout; each a vLLM server
   (``/version``, ``/v1/models`` owned by vllm); each serving ``--model`` (the served root's
   ``config.json`` equal to the model's when the root is readable here, else the served name);
   both serving the same model; the pair as the identity pins it (vLLM versions,
   ``max_model_len``, model, fixture prompt); the decode server granting exactly the evidence the
   identity was calibrated on (:func:`probe_evidence`: weaker or stronger is a pair that changed);
   the basis receipt (:func:`checked_served_basis`) resolving in the receipt archive, verified,
   signed by a trusted key, passed, its signed statement the one pinned, and the bounds following
   from its evidence by the rule;
2. **the cold recompute**, first, before anything was prefilled: the decode server serves the
   fixture prompt (token ids, ``/v1/completions``) for 256 greedy tokens with the calibrated
   logprobs; neither its connector nor its prefix cache may supply any of the prompt;
3. **three ordered handoffs**: the prefill server prefills the prompt (``max_tokens=1``,
   ``kv_transfer_params {"do_remote_decode": true, ...}`` as vLLM's disaggregated-prefill proxies
   send it); its returned ``kv_transfer_params`` go with the decode request; the decode server
   decodes 256 greedy tokens from the transferred KV. Each server's ``/metrics``
   (``vllm:prompt_tokens``, ``vllm:prefix_cache_hits``, ``vllm:external_prefix_cache_hits``) is
   read around each request, so the loaded branch's prompt is known to come from its connector, and
   the prefill server's KV from its own computation (the per-request ``cached_tokens`` is recorded,
   not trusted: under a handshake vLLM reports the prefill server's count there);
4. **the judge** (:mod:`qualify.judge.served`) under the identity's bounds and rule, and a signed
   receipt like any run's (its ``identity.json`` the identity file, byte for byte).

The calibration that writes the identity is :mod:`qualify.run.served_calibrate`. HTTP stays in
:mod:`qualify.handoff.served`; judging is pure.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qualify.archive.writer import ReceiptWriter
from qualify.contract.rules import SERVED_BOUND_RULE
from qualify.contract.served_identity import ServedIdentity, load_served_identity
from qualify.core import assets
from qualify.core.digests import jcs_sha256
from qualify.core.errors import Refused, one_line
from qualify.core.strict_json import render
from qualify.handoff.served import Endpoint, parse_base_url
from qualify.judge import Verdict, judge_refused
from qualify.judge.served import FULL, TOP_K, Evidence, ServedBranch, ServedHandoff, ServedRule, judge_served_pair

LANE = "served-pair"
CHECKED_PAIR_SCHEMA = "trust-ladder.served-pair-checked.v1"
"""The receipt's document of the pair as a calibration checked it (its ``identity.json``)."""
OUTPUT_TOKENS = 256
REPETITIONS = 3
TOP_K_CEILING = 1 << 20
"""The largest k :func:`probe_evidence` searches for when the vocabulary is unknown."""
DECODE_TIMEOUT_S = 600.0
"""Seconds one completion request may take (256 tokens on a slow CPU server)."""
METRICS_SETTLE_S = 5.0
"""Seconds to wait for a server's cache-hit counters to account for a finished request."""
PREFILL_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None}
"""What vLLM's disaggregated-prefill proxies send with the prefill request."""
STEPS = ("pair checked", "identity checked", "cold recompute", "handoff 1/3", "handoff 2/3", "handoff 3/3", "verdict")

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
    identity: Path | None = None


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
    checked_by: str = "name"  # "config": its config.json equals --model's; "name": by the served name only
    config_sha256: str | None = None  # RFC 8785 SHA-256 of the served root's config.json when readable here

    def document(self) -> dict[str, Any]:
        return {"url": self.endpoint.base, "vllm_version": self.version, "model_id": self.model_id,
                "model_root": self.root, "max_model_len": self.max_model_len, "model_check": self.model_check,
                "checked_by": self.checked_by, "config_sha256": self.config_sha256}


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
    return Server(endpoint, version, model_id, root, max_len if type(max_len) is int else None, check,
                  "config" if config is not None and model.config is not None else "name",
                  None if config is None else jcs_sha256(config))


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


# --------------------------------------------------------------------------- the pair and its evidence


@dataclass(frozen=True)
class Pair:
    """Both servers, checked, and the model they serve."""

    model: ExpectedModel
    prefill: Server
    decode: Server

    @property
    def prompt_sha256(self) -> str:
        return assets.prompt_sha256(np.asarray(self.model.prompt, dtype=np.int64))

    def document(self) -> dict[str, Any]:
        """The pair as checked: what a calibration receipt's ``identity.json`` holds."""
        return {"schema": CHECKED_PAIR_SCHEMA, "lane": LANE,
                "model": {"name": self.model.name,
                          "config_sha256": None if self.model.config is None else jcs_sha256(self.model.config),
                          "prompt_tokens": len(self.model.prompt), "prompt_sha256": self.prompt_sha256},
                "prefill": self.prefill.document(), "decode": self.decode.document()}


def check_urls(options: ServedOptions) -> None:
    """Both URLs given and well formed, before any request: a pair is both servers."""
    for option, url in (("--prefill-url", options.prefill_url), ("--decode-url", options.decode_url)):
        if url is None:
            raise Refused(f"{option}: missing; a served pair needs both --prefill-url and --decode-url")
        parse_base_url(option, url)


def check_pair(options: ServedOptions, note: Callable[[str], None]) -> Pair:
    """Both servers checked (each a vLLM server of ``--model``), two servers of one model."""
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
    return Pair(model, prefill, decode)


def _vocab(model: ExpectedModel) -> int | None:
    vocab = model.config.get("vocab_size") if model.config is not None else None
    return vocab if type(vocab) is int and vocab > 0 else None


def _grants(decode: Server, probe: Sequence[int], logprobs: int) -> int | None:
    """The entries the decode server's first logprob row carries when asked for ``logprobs`` (one
    greedy token of a one-token prompt), None when it refuses the request (HTTP 400)."""
    status, document = decode.endpoint.post_json(
        "/v1/completions", _completion_body(decode, probe, 1, logprobs, None), DECODE_TIMEOUT_S)
    if status == 400:
        return None
    if status != 200 or not isinstance(document, dict):
        raise Refused(f"--decode-url {decode.endpoint.base}: a logprobs probe ({logprobs}): HTTP {status}")
    branch = branch_of(decode, document, 1, (None, None), "a logprobs probe")
    return len(branch.logprobs[0]) if branch.logprobs else 0


def probe_evidence(decode: Server, model: ExpectedModel, expected: Evidence | None = None) -> Evidence:
    """The strongest logprobs the decode server grants: full (``logprobs: -1`` answered with the
    whole vocabulary), else top-k for the largest k it accepts (a binary search, or, given the
    ``expected`` evidence, k and k + 1 only). Each probe is one greedy token of a one-token prompt;
    the server's counters are let settle afterwards, so no probe is counted in a later request."""
    probe = list(model.prompt[:1])
    vocab = _vocab(model)
    before = cache_counters(decode)
    sent = 0

    def grants(logprobs: int) -> int | None:
        nonlocal sent
        found = _grants(decode, probe, logprobs)
        sent += found is not None  # a refused request (HTTP 400) counts no prompt tokens
        return found

    try:
        width = grants(-1)
        if width is not None and width > 0 and (vocab is None or width >= vocab):
            return Evidence(FULL, None, vocab or width)
        ceiling = (vocab - 1) if vocab is not None else TOP_K_CEILING

        def granted(k: int) -> bool:
            found = grants(k)
            return found is not None and found >= k

        if expected is not None and expected.mode == TOP_K and expected.k is not None:
            k = expected.k
            if granted(k):  # k as calibrated; k + 1 too would be stronger evidence than calibrated
                return Evidence(TOP_K, k + 1 if k + 1 <= ceiling and granted(k + 1) else k, vocab or 0)
            ceiling = k - 1  # weaker: find how much weaker, for the refusal's words
        if ceiling < 1 or not granted(1):
            raise Refused(f"--decode-url {decode.endpoint.base}: grants no logprobs (logprobs 1 refused); a served pair "
                          f"is judged on logprobs")
        low, high = 1, ceiling
        while low < high:
            middle = (low + high + 1) // 2
            if granted(middle):
                low = middle
            else:
                high = middle - 1
        return Evidence(TOP_K, low, vocab or 0)
    finally:
        request_hits(decode, before, sent * len(probe))  # let the counters account for the probes


def decode_branch(decode: Server, prompt: Sequence[int], evidence: Evidence, transfer: Mapping[str, Any] | None,
                  what: str) -> ServedBranch:
    """One decode of ``prompt`` on the decode server (256 greedy tokens, the evidence's logprobs),
    with the prompt tokens its connector and its prefix cache supplied."""
    before = cache_counters(decode)
    document = complete(decode, prompt, OUTPUT_TOKENS, -1 if evidence.mode == FULL else evidence.k, transfer, what)
    return branch_of(decode, document, OUTPUT_TOKENS, request_hits(decode, before, len(prompt)), what)


def handoff(pair: Pair, prompt: Sequence[int], evidence: Evidence, repetition: int, what: str) -> ServedHandoff:
    """One handoff: prefill on the prefill server, decode from the transferred KV."""
    before = cache_counters(pair.prefill)
    produced = complete(pair.prefill, prompt, 1, None, PREFILL_TRANSFER_PARAMS, f"{what}'s prefill")
    prefill_external = request_hits(pair.prefill, before, len(prompt))[1]
    transfer = produced.get("kv_transfer_params")
    loaded = decode_branch(pair.decode, prompt, evidence, transfer if isinstance(transfer, dict) else None,
                           f"{what}'s decode")
    return ServedHandoff(repetition, _cached_tokens(produced), prefill_external, loaded)


def handoff_line(what: str, done: ServedHandoff, started: float) -> str:
    loaded = done.loaded
    return (f"{what}: prefill cached {done.prefill_cached_tokens} (connector {done.prefill_external_hits}); decode "
            f"connector {loaded.external_hits}, prefix cache {loaded.local_hits} (reported cached "
            f"{loaded.cached_tokens}) ({time.monotonic() - started:.1f} s)")


# --------------------------------------------------------------------------- the identity


def calibrate_command(options: ServedOptions, identity: str = "PATH") -> str:
    """The command that calibrates this pair and writes its identity."""
    quote = shlex.quote
    model = f" --model {quote(options.model)}" if options.model else ""
    return (f"qualify calibrate --recipe {options.recipe} --prefill-url {quote(options.prefill_url or 'URL')} "
            f"--decode-url {quote(options.decode_url or 'URL')}{model} --identity {identity}")


def observed_fields(pair: Pair) -> dict[str, Any]:
    """The identity's fields as this pair shows them now."""
    return {
        "prefill.vllm_version": pair.prefill.version, "prefill.max_model_len": pair.prefill.max_model_len,
        "decode.vllm_version": pair.decode.version, "decode.max_model_len": pair.decode.max_model_len,
        "model.name": pair.model.name, "model.served_model_id": pair.decode.model_id,
        "model.config_sha256": pair.decode.config_sha256, "model.model_check": pair.decode.checked_by,
        "fixture.name": assets.MAIN_PROMPT, "fixture.prompt_tokens": len(pair.model.prompt),
        "fixture.prompt_sha256": pair.prompt_sha256, "fixture.output_tokens": OUTPUT_TOKENS,
        "fixture.repetitions": REPETITIONS,
    }


def _evidence_words(mode: str, k: int | None) -> str:
    return "full logprobs" if mode == FULL else f"top-{k} logprobs"


def check_against_identity(identity: ServedIdentity, pair: Pair, recalibrate: str) -> None:
    """The pair as the identity pins it, refused in one line naming the first field that differs."""
    where = f"--served-identity {identity.path}"
    for name, found in observed_fields(pair).items():
        expected = identity.field(name)
        if expected != found:
            raise Refused(f"{where}: {name}: expected {render(expected)} (as calibrated), found {render(found)} on the "
                          f"pair; a changed pair is calibrated anew: {recalibrate}")


def check_evidence(identity: ServedIdentity, evidence: Evidence, recalibrate: str) -> None:
    """The decode server grants the evidence the identity was calibrated on, no weaker, no stronger."""
    where = f"--served-identity {identity.path}"
    if (evidence.mode, evidence.k) != (identity.mode, identity.top_k) or (
            evidence.mode == FULL and evidence.vocab != identity.vocab):
        stronger = evidence.mode == FULL or (identity.mode == TOP_K and (evidence.k or 0) > (identity.top_k or 0))
        grants = ("full logprobs" if evidence.mode == FULL else f"more than top-{identity.top_k} logprobs"
                  if stronger else f"top-{evidence.k} logprobs at most")
        raise Refused(f"{where}: evidence: expected {_evidence_words(identity.mode, identity.top_k)} (as calibrated), "
                      f"the decode server grants {grants} ({'stronger' if stronger else 'weaker'} evidence than "
                      f"calibrated: a bound holds only for the evidence it was calibrated on); {recalibrate}")


def checked_served_basis(identity: ServedIdentity, archive: Path) -> None:
    """The identity's basis: the calibration receipt resolves in ``archive``, verifies, is signed
    by a trusted key and passed; its signed statement is the one the identity pins; its evidence is
    the identity's; and the identity's bounds follow from its cells by the rule. One line each."""
    import os

    from qualify.archive.attestation import ENVELOPE
    from qualify.archive.keys import default_trust_path, load_trust
    from qualify.archive.reader import read_receipt_json, resolve_receipt_uri
    from qualify.archive.verify import authenticate_receipt
    from qualify.core.digests import sha256_file
    from qualify.judge.served_calibration import SERVED_CALIBRATION_EVIDENCE, bounds_from_evidence

    where = f"--served-identity {identity.path}: basis {identity.basis}"
    relative = f"evidence/{SERVED_CALIBRATION_EVIDENCE}.json"
    receipt = resolve_receipt_uri(f"{identity.basis}/{relative}", archive).parent.parent
    trust_path = default_trust_path()
    check = authenticate_receipt(receipt, load_trust(trust_path) if os.path.lexists(trust_path) else None)
    if check.state != "verified":
        raise Refused(f"{where}: {check.state}: {check.problems[0] if check.problems else 'not verified'}")
    found = sha256_file(receipt / ENVELOPE)
    if found != identity.statement_sha256:
        raise Refused(f"{where}: basis.statement_sha256: expected {identity.statement_sha256}, found {found} "
                      f"(the receipt's {ENVELOPE})")
    summary = read_receipt_json(receipt, "validation-summary.json")
    if summary.get("status") != "passed" or summary.get("lane") != LANE:
        raise Refused(f"{where}: expected a passing served-pair calibration, found status {summary.get('status')!r} "
                      f"of lane {summary.get('lane')!r}")
    evidence = read_receipt_json(receipt, relative)
    pinned = {"mode": identity.mode, "top_k": identity.top_k, "vocab": identity.vocab}
    measured = evidence.get("evidence") if isinstance(evidence, dict) else None
    if not isinstance(evidence, dict) or measured != pinned:
        raise Refused(f"{where}: evidence: the basis measured {render(measured)}, the identity pins {render(pinned)}")
    from qualify.contract.controls import load_calibration_set

    committed, digest = load_calibration_set()
    if identity.field("calibration.set") != {"name": committed.name, "sha256": digest}:
        raise Refused(f"--served-identity {identity.path}: calibration.set: expected the committed set {committed.name} "
                      f"{digest}, found {render(identity.field('calibration.set'))}")
    if evidence.get("set") != identity.field("calibration.set"):
        raise Refused(f"{where}: calibration.set: expected {render(identity.field('calibration.set'))}, the basis "
                      f"measured {render(evidence.get('set'))}")
    bounds, problems = bounds_from_evidence(evidence)
    if bounds is None:
        raise Refused(f"{where}: {problems[0] if problems else 'no bounds'}")
    cells = evidence.get("cells")
    if not isinstance(cells, list) or len(cells) != identity.field("calibration.cells"):
        raise Refused(f"{where}: calibration.cells: expected {identity.field('calibration.cells')}, the basis holds "
                      f"{len(cells) if isinstance(cells, list) else 'none'}")
    for name, sealed, follows in (("rule.maximum_absolute", identity.maximum_absolute, bounds.maximum_absolute),
                                  ("rule.maximum_mean_absolute", identity.maximum_mean_absolute,
                                   bounds.maximum_mean_absolute)):
        if sealed != follows:
            raise Refused(f"--served-identity {identity.path}: {name}: expected {follows!r} (its basis "
                          f"{identity.basis} gives it by rule {SERVED_BOUND_RULE}), found {sealed!r}")


# --------------------------------------------------------------------------- the run


def _refused_receipt(options: ServedOptions, log: Sequence[str], reason: str,
                     identity: ServedIdentity | None = None) -> Path:
    with ReceiptWriter(options.receipts, command_line=options.command_line,
                       identity=None if identity is None else identity.path, recipe=options.recipe,
                       lane=LANE) as writer:
        for line in log:
            writer.log(line)
        return writer.finalize(judge_refused(reason))


def run_served_pair(options: ServedOptions, show: Callable[[str], None]) -> ServedRun:
    """Check the pair against its identity, run the cold recompute and the three handoffs, judge,
    write the receipt. Every refusal leaves a refused receipt (``run.verdict.refused``)."""
    run = ServedRun()
    loaded: list[ServedIdentity] = []

    def note(line: str) -> None:
        run.log.append(line)
        show(line)

    try:
        return _run(options, run, note, loaded)
    except Refused as exc:
        reason = str(exc)
        run.verdict = judge_refused(reason)
        run.receipt_path = _refused_receipt(options, run.log, reason, loaded[0] if loaded else None)
        return run


def rule_of(identity: ServedIdentity, evidence: Evidence, prompt_tokens: int) -> ServedRule:
    return ServedRule(evidence=evidence, maximum_absolute=identity.maximum_absolute,
                      maximum_mean_absolute=identity.maximum_mean_absolute, prompt_tokens=prompt_tokens,
                      output_tokens=OUTPUT_TOKENS, repetitions=REPETITIONS, basis=identity.basis,
                      bound_rule=SERVED_BOUND_RULE, top_k_rule=identity.top_k_rule)


def _run(options: ServedOptions, run: ServedRun, note: Callable[[str], None],
         loaded: list[ServedIdentity]) -> ServedRun:
    check_urls(options)
    if options.identity is None:
        raise Refused(f"--served-identity: missing; a served pair is judged only under bounds calibrated for it: "
                      f"run `{calibrate_command(options)}` first, then pass --served-identity PATH")
    identity = load_served_identity(options.identity)
    loaded.append(identity)
    recalibrate = f"run `{calibrate_command(options)}`"
    pair = check_pair(options, note)
    check_against_identity(identity, pair, recalibrate)
    evidence = probe_evidence(pair.decode, pair.model,
                              Evidence(FULL if identity.mode == FULL else TOP_K, identity.top_k, identity.vocab))
    check_evidence(identity, evidence, recalibrate)
    checked_served_basis(identity, options.receipts)
    rule = rule_of(identity, evidence, len(pair.model.prompt))
    note(f"identity checked: {identity.path} (sha256 {identity.sha256[:16]}…), calibrated on {identity.basis}; "
         f"evidence {evidence.words()}")
    started = time.monotonic()
    cold = decode_branch(pair.decode, pair.model.prompt, evidence, None, "the cold recompute")
    note(f"cold recompute: {len(cold.tokens)} tokens, {evidence.words()}, connector {cold.external_hits}, prefix "
         f"cache {cold.local_hits} (reported cached {cold.cached_tokens}) ({time.monotonic() - started:.1f} s)")
    handoffs: list[ServedHandoff] = []
    with ReceiptWriter(options.receipts, command_line=options.command_line, identity=identity.path,
                       recipe=options.recipe, lane=LANE, rule=rule.document()) as writer:
        for line in run.log:
            writer.log(line)
        try:
            for repetition in range(1, REPETITIONS + 1):
                started = time.monotonic()
                what = f"handoff {repetition}/{REPETITIONS}"
                handoffs.append(handoff(pair, pair.model.prompt, evidence, repetition, what))
                line = handoff_line(what, handoffs[-1], started)
                writer.log(line)
                note(line)
        except Refused as exc:  # a server failed mid-run: the receipt says so, refused
            run.verdict = judge_refused(str(exc))
            run.receipt_path = writer.finalize(run.verdict)
            return run
        verdict, samples = judge_served_pair(cold, handoffs, rule)
        writer.add_evidence("served-pair", {**pair.document(), "cold_tokens": list(cold.tokens),
                                            "cold_cached_tokens": cold.cached_tokens,
                                            "cold_connector_tokens": cold.external_hits,
                                            "cold_prefix_cache_tokens": cold.local_hits, "rule": rule.document()})
        for sample in samples:
            document = sample.document()
            run.samples.append(document)
            writer.add_sample(document)
        run.verdict = verdict
        run.receipt_path = writer.finalize(verdict)
    return run

"""``qualify calibrate --prefill-url ... --identity PATH`` then ``qualify --recipe native-text ...
--served-identity PATH`` against a fake pair of vLLM OpenAI servers (the real pair:
tests/vllm/test_served_pair.py): the calibration finds the largest top-k the decode server
grants, writes an identity whose bounds the qualification re-derives from the signed basis, and
the qualification judges under it; a connector that loads into every request (ExampleConnector's
way) fails the calibration and writes no identity; an identity edited after the calibration is
refused."""

from __future__ import annotations

import hashlib
import json
import shlex
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from qualify.archive.keys import ensure_signing_key
from qualify.archive.verify import verify_receipt
from qualify.contract.served_identity import load_served_identity
from qualify.core import assets
from qualify.interfaces.cli import main

VOCAB = json.loads((assets.MODEL_DIR / "config.json").read_text())["vocab_size"]
BLOCK = 128


@dataclass
class FakePair:
    """Two fake servers sharing a KV store: the prefill request saves, a decode request carrying
    ``do_remote_prefill`` loads (the handshake), or, with ``load_always``, any request loads what
    the store holds (ExampleConnector's way)."""

    max_logprobs: int
    load_always: bool = False
    store: set[str] = field(default_factory=set)
    counters: dict[str, dict[str, float]] = field(default_factory=dict)

    def completion(self, name: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        prompt, logprobs = list(body["prompt"]), body.get("logprobs")
        if logprobs is not None and (logprobs == -1 and self.max_logprobs != -1 or
                                     logprobs != -1 and self.max_logprobs != -1 and logprobs > self.max_logprobs):
            return 400, {"message": "logprobs too large"}
        key = hashlib.sha256(json.dumps(prompt[: (len(prompt) - 1) // BLOCK * BLOCK]).encode()).hexdigest()
        params = body.get("kv_transfer_params") or {}
        loads = key in self.store and (params.get("do_remote_prefill") or self.load_always)
        counts = self.counters.setdefault(name, {"prompt": 0.0, "local": 0.0, "external": 0.0})
        counts["prompt"] += len(prompt)
        counts["external"] += (len(prompt) - 1) // BLOCK * BLOCK if loads else 0
        if params.get("do_remote_decode") or self.load_always:
            self.store.add(key)
        start = sum(prompt) % VOCAB
        tokens = [(start + i) % VOCAB for i in range(body["max_tokens"])]
        width = VOCAB if logprobs == -1 else logprobs
        rows = [{f"token_id:{(t + j) % VOCAB}": -0.5 * j for j in range(width or 0)} for t in tokens]
        choice: dict[str, Any] = {"token_ids": tokens, "logprobs": {"top_logprobs": rows} if logprobs is not None else None}
        answer: dict[str, Any] = {"choices": [choice], "usage": {"prompt_tokens_details": {"cached_tokens": 0}}}
        if params.get("do_remote_decode"):
            answer["kv_transfer_params"] = {"do_remote_prefill": True}
        return 200, answer

    def metrics(self, name: str) -> str:
        counts = self.counters.setdefault(name, {"prompt": 0.0, "local": 0.0, "external": 0.0})
        return (f"vllm:prompt_tokens_total{{model_name=\"m\"}} {counts['prompt']}\n"
                f"vllm:prefix_cache_hits_total{{model_name=\"m\"}} {counts['local']}\n"
                f"vllm:external_prefix_cache_hits_total{{model_name=\"m\"}} {counts['external']}\n")


@pytest.fixture
def serve() -> Iterator[Any]:
    servers: list[ThreadingHTTPServer] = []

    def start(pair: FakePair, name: str) -> str:
        class Handler(BaseHTTPRequestHandler):
            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                models = {"data": [{"id": "shipped", "owned_by": "vllm", "root": str(assets.MODEL_DIR),
                                    "max_model_len": 4096}]}
                routes = {"/version": json.dumps({"version": "0.32.0"}).encode(), "/v1/models": json.dumps(models).encode(),
                          "/metrics": pair.metrics(name).encode()}
                self._send(200, routes[self.path]) if self.path in routes else self._send(404, b"")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, answer = pair.completion(name, body)
                self._send(status, json.dumps(answer).encode())

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture(autouse=True)
def _signing_key() -> None:
    ensure_signing_key()


def _calibrate(urls: tuple[str, str], identity: Path, receipts: Path, capsys) -> tuple[int, str]:
    code = main(["calibrate", "--recipe", "native-text", "--prefill-url", urls[0], "--decode-url", urls[1],
                 "--identity", str(identity), "--receipts", str(receipts)])
    return code, capsys.readouterr().out


def _qualify(urls: tuple[str, str], identity: Path, receipts: Path, capsys) -> tuple[int, str]:
    code = main(["--recipe", "native-text", "--prefill-url", urls[0], "--decode-url", urls[1],
                 "--served-identity", str(identity), "--receipts", str(receipts)])
    return code, capsys.readouterr().err


def test_calibrate_finds_the_largest_top_k_and_the_qualification_judges_under_the_identity(serve, tmp_path, capsys):
    pair = FakePair(max_logprobs=7)
    urls = serve(pair, "prefill"), serve(pair, "decode")
    identity, receipts = tmp_path / "pair.json", tmp_path / "receipts"
    code, out = _calibrate(urls, identity, receipts, capsys)
    assert code == 0, out
    loaded = load_served_identity(identity)
    assert (loaded.mode, loaded.top_k, loaded.top_k_rule) == ("top-k", 7, "served-top-k-within-bound.v1")
    [basis] = list(receipts.iterdir())
    assert verify_receipt(basis) == [] and loaded.basis == f"receipt://{basis.name}"
    # The command the calibration printed to run next is the qualification under the identity.
    [command] = [line.removeprefix("next: ") for line in out.splitlines() if line.startswith("next: ")]
    code = main(shlex.split(command)[1:])
    assert code == 0, capsys.readouterr()
    [receipt] = [path for path in receipts.iterdir() if path != basis]
    summary = json.loads((receipt / "validation-summary.json").read_text())
    assert verify_receipt(receipt) == [] and summary["status"] == "passed"
    assert summary["scope"]["fixture"]["name"] == "native-text-served-pair.top7-logprobs"
    assert loaded.basis in summary["scope"]["fixture_words"]


def test_a_connector_that_loads_into_every_request_fails_the_calibration_and_writes_no_identity(serve, tmp_path, capsys):
    pair = FakePair(max_logprobs=3, load_always=True)
    urls = serve(pair, "prefill"), serve(pair, "decode")
    identity, receipts = tmp_path / "pair.json", tmp_path / "receipts"
    code, out = _calibrate(urls, identity, receipts, capsys)
    assert code == 1 and not identity.exists(), out
    [receipt] = list(receipts.iterdir())
    summary = json.loads((receipt / "validation-summary.json").read_text())
    assert verify_receipt(receipt) == [] and summary["status"] == "failed"
    failing = [check["name"] for check in summary["checks"] if not check["passed"]]
    assert any(name.endswith("second cold recompute") for name in failing)
    assert any(name.endswith("prefill computed on the prefill server") for name in failing)


@pytest.mark.parametrize("edit, field_name", [
    (lambda d: d["rule"].update(maximum_mean_absolute=1.0), "rule.maximum_mean_absolute"),
    (lambda d: d["basis"].update(statement_sha256="0" * 64), "basis.statement_sha256"),
    (lambda d: d["evidence"].update(top_k=6), "evidence"),
    (lambda d: d["basis"].update(receipt="receipt://20990101T000000Z-0000000000000000"), "receipt://20990101T000000Z"),
])
def test_an_identity_edited_after_its_calibration_is_refused(serve, tmp_path, capsys, edit, field_name):
    pair = FakePair(max_logprobs=7)
    urls = serve(pair, "prefill"), serve(pair, "decode")
    identity, receipts = tmp_path / "pair.json", tmp_path / "receipts"
    assert _calibrate(urls, identity, receipts, capsys)[0] == 0
    document = json.loads(identity.read_text())
    edit(document)
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(document))
    code, err = _qualify(urls, edited, receipts, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and field_name in err, err

"""A served prefill/decode pair, black-box over HTTP (issue 36 item 3): two real ``vllm serve``
processes (vLLM's OpenAI server, ``python -m vllm.entrypoints.openai.api_server``) on free
localhost ports, joined by ExampleConnector (kv_producer / kv_consumer over one storage path),
serving the shipped model as the harness's vLLM lanes load it; ``qualify --prefill-url ...
--decode-url ...`` runs against them and leaves a signed receipt that verifies.

What this pair shows: ExampleConnector saves what any instance computes, whatever its ``kv_role``,
so the decode server's cold recompute lands in the shared store and the prefill server then loads
it instead of computing the prompt. The run sees that (the prefill server's connector hits) and
does not qualify the pair: the KV handed over is the decode server's own. The loaded branch is
still compared, and is bit-equal to the cold recompute under full-vocabulary logprobs.

Two pairs, one after the other (each started once, about 15 s on two cores): one allowing full
logprobs (two runs against it), then one allowing only the top 20 (one run).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from qualify.archive.keys import ensure_signing_key
from qualify.contract.lanes import VLLM_BLOCK_SIZE
from qualify.core import assets
from qualify.engines.checkpoint import model_files_view
from qualify.engines.vllm_engine import ENV, ENV_REMOVED, VLLM_ENV_KEPT
from qualify.interfaces.cli import main

PROMPT_TOKENS = len(assets.load_prompt())
HANDED_OFF = ((PROMPT_TOKENS - 1) // VLLM_BLOCK_SIZE) * VLLM_BLOCK_SIZE
"""ExampleConnector stores the whole blocks before the prompt's last token (1920 of 2048)."""
VOCAB = json.loads((assets.MODEL_DIR / "config.json").read_text())["vocab_size"]
TOP_K = 20
"""The second pair's --max-logprobs: below the vocabulary, so the run judges on top-20 logprobs."""
START_LIMIT_S = 300.0
"""How long a server may take to answer /health before the fixture gives up (a hang is a failure)."""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _server_env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not (key.startswith("VLLM_") and key not in VLLM_ENV_KEPT) and key not in ENV_REMOVED}
    return {**env, **ENV}


def _start(role: str, port: int, model: Path, storage: Path, log: Path, max_logprobs: int) -> subprocess.Popen[bytes]:
    transfer = {"kv_connector": "ExampleConnector", "kv_role": role,
                "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", "shipped", "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "float32", "--skip-tokenizer-init", "--enforce-eager", "--max-model-len", "4096",
               "--max-num-batched-tokens", "4096", "--block-size", str(VLLM_BLOCK_SIZE), "--seed", "0",
               "--max-logprobs", str(max_logprobs), "--enable-prompt-tokens-details", "--no-enable-prefix-caching",
               "--kv-transfer-config", json.dumps(transfer)]
    with log.open("wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=_server_env(),
                                start_new_session=True)


def _wait_healthy(process: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + START_LIMIT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"vllm server on port {port} exited {process.returncode}: "
                        f"{log.read_text(errors='replace')[-2000:]}", pytrace=False)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"vllm server on port {port} did not answer /health in {START_LIMIT_S:g} s: "
                f"{log.read_text(errors='replace')[-2000:]}", pytrace=False)


@pytest.fixture(scope="module", params=[-1, TOP_K], ids=["full-logprobs", f"max-logprobs-{TOP_K}"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, int]]:
    """The running pair's (prefill URL, decode URL, --max-logprobs): one pair allowing full
    logprobs, then one allowing only the top 20."""
    max_logprobs = int(request.param)
    root = tmp_path_factory.mktemp("served-pair")
    model = model_files_view(assets.MODEL_DIR, "served")
    storage = root / "kv"
    storage.mkdir()
    ports = _free_port(), _free_port()
    logs = root / "prefill.log", root / "decode.log"
    processes = [_start(role, port, model, storage, log, max_logprobs)
                 for role, port, log in zip(("kv_producer", "kv_consumer"), ports, logs, strict=True)]
    try:
        for process, port, log in zip(processes, ports, logs, strict=True):
            _wait_healthy(process, port, log)
        yield f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}", max_logprobs
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _run(pair: tuple[str, str, int], receipts: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, Path]:
    ensure_signing_key()
    code = main(["--recipe", "native-text", "--prefill-url", pair[0], "--decode-url", pair[1],
                 "--model", str(assets.MODEL_DIR), "--receipts", str(receipts)])
    out = capsys.readouterr().out
    [receipt] = [path for path in receipts.iterdir() if path.is_dir()]
    assert main(["receipts", "verify", str(receipt)]) == 0, capsys.readouterr()
    capsys.readouterr()
    assert str(receipt) in out
    return code, receipt


def _documents(receipt: Path) -> tuple[dict, list[dict], dict]:
    summary = json.loads((receipt / "validation-summary.json").read_text())
    samples = [json.loads((receipt / "samples" / f"sample-{n}.json").read_text()) for n in (1, 2, 3)]
    evidence = json.loads((receipt / "evidence" / "served-pair.json").read_text())
    return summary, samples, evidence


def test_the_served_pair_gets_a_verdict_on_the_strongest_logprobs_and_its_receipt_verifies(pair, tmp_path, capsys):
    code, receipt = _run(pair, tmp_path / "receipts", capsys)
    summary, samples, evidence = _documents(receipt)
    # The verdict, its evidence mode (full under --max-logprobs -1, else the top 20) and its rule.
    full = pair[2] == -1
    assert summary["lane"] == "served-pair" and summary["rule"]["evidence"] == ("full" if full else "top-k")
    assert summary["rule"]["top_k"] == (None if full else TOP_K)
    assert summary["scope"]["fixture"]["name"].endswith("full-logprobs" if full else f"top{TOP_K}-logprobs")
    # The cold branch recomputed the whole prompt.
    assert evidence["cold_cached_tokens"] == evidence["cold_connector_tokens"] == evidence["cold_prefix_cache_tokens"] == 0
    for sample in samples:
        # Loaded through the decode server's connector, none of it from its local prefix cache ...
        assert sample["decode_cached_tokens"] == sample["decode_connector_tokens"] == HANDED_OFF
        assert sample["decode_prefix_cache_tokens"] == 0
        # ... and equal to the cold recompute: every token, every logprob of the vocabulary.
        assert sample["tokens_equal"] == 256 and sample["max_abs"] == 0.0
        assert sample["compared_logprob_entries"] == 256 * (VOCAB if full else TOP_K)
        # But the prefill server loaded the prompt from the store (the decode server's cold
        # recompute, saved by its ExampleConnector) instead of computing it: no evidence of a handoff.
        assert sample["prefill_connector_tokens"] == HANDED_OFF
    assert (code, summary["status"]) == (1, "failed")


@pytest.mark.parametrize("pair", [-1], ids=["full-logprobs"], indirect=True)  # once: the path is the same under top-k
def test_a_second_run_finds_no_cold_recompute_and_does_not_qualify(pair, tmp_path, capsys):
    # The store now holds the prompt: the decode server loads it for the "cold" branch too.
    code, receipt = _run(pair, tmp_path / "receipts", capsys)
    summary, _samples, evidence = _documents(receipt)
    assert evidence["cold_cached_tokens"] == evidence["cold_connector_tokens"] == HANDED_OFF
    assert (code, summary["status"]) == (1, "failed")

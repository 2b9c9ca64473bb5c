"""A served prefill/decode pair, black-box over HTTP (issue 36 item 3): two real ``vllm serve``
processes (vLLM's OpenAI server, ``python -m vllm.entrypoints.openai.api_server``) on free
localhost ports, joined by a connector with a prefill/decode handshake
(``tests/support/served_connector.py``: vLLM's ExampleConnector storage behind the
``kv_transfer_params`` handshake NIXL uses), serving the shipped model as the harness's vLLM lanes
load it. ``qualify calibrate --prefill-url ... --decode-url ... --identity PATH`` calibrates the
pair and writes its identity; ``qualify --recipe native-text ... --served-identity PATH`` qualifies
it under that identity; both leave signed receipts that verify; a pair that differs from its
identity is refused.

Two pairs, one after the other (each started once): one allowing full logprobs, then one allowing
only the top 20. Each is calibrated once (the module's fixture) and qualified once; the refusals
cost at most a few one-token probes. No test re-parametrizes ``pair`` (an indirect parameter
starts a pair of its own).
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from qualify.archive.keys import ensure_signing_key
from qualify.archive.verify import verify_receipt
from qualify.contract.lanes import VLLM_BLOCK_SIZE
from qualify.contract.rules import SERVED_RULES, SERVED_TOP_K_RULE
from qualify.contract.served_identity import load_served_identity
from qualify.core import assets
from qualify.core.digests import sha256_file
from qualify.engines.checkpoint import model_files_view
from qualify.engines.vllm_engine import ENV, ENV_REMOVED, VLLM_ENV_KEPT
from qualify.interfaces.cli import main
from qualify.judge.calibration import bound_of

REPO = Path(__file__).resolve().parents[2]
PROMPT_TOKENS = len(assets.load_prompt())
HANDED_OFF = ((PROMPT_TOKENS - 1) // VLLM_BLOCK_SIZE) * VLLM_BLOCK_SIZE
"""ExampleConnector's storage holds the whole blocks before the prompt's last token (1920 of 2048)."""
VOCAB = json.loads((assets.MODEL_DIR / "config.json").read_text())["vocab_size"]
TOP_K = 20
"""The second pair's --max-logprobs: below the vocabulary, so it is calibrated and judged on top-20 logprobs."""
START_LIMIT_S = 300.0
"""How long a server may take to answer /health before the fixture gives up (a hang is a failure)."""
CONNECTOR = {"kv_connector": "HandshakeExampleConnector", "kv_connector_module_path": "tests.support.served_connector"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _server_env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not (key.startswith("VLLM_") and key not in VLLM_ENV_KEPT) and key not in ENV_REMOVED}
    return {**env, **ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))}


def _start(role: str, port: int, model: Path, storage: Path, log: Path, max_logprobs: int) -> subprocess.Popen[bytes]:
    transfer = {**CONNECTOR, "kv_role": role, "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", "shipped", "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "float32", "--skip-tokenizer-init", "--enforce-eager", "--max-model-len", "4096",
               "--max-num-batched-tokens", "4096", "--block-size", str(VLLM_BLOCK_SIZE), "--seed", "0",
               "--max-logprobs", str(max_logprobs), "--enable-prompt-tokens-details", "--no-enable-prefix-caching",
               "--kv-transfer-config", json.dumps(transfer)]
    with log.open("wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=_server_env(), cwd=REPO,
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


@dataclass(frozen=True)
class Calibrated:
    """One pair's calibration: exit code, receipt, the identity written, the archive and its output."""

    code: int
    receipt: Path
    identity: Path
    receipts: Path
    out: str


def _receipt_of(receipts: Path, before: set[Path]) -> Path:
    [receipt] = [path for path in receipts.iterdir() if path.is_dir() and path not in before]
    return receipt


@pytest.fixture(scope="module")
def calibrated(pair, tmp_path_factory) -> Calibrated:
    """The pair calibrated once: ``qualify calibrate ... --identity PATH``."""
    ensure_signing_key()
    root = tmp_path_factory.mktemp("served-calibration")
    receipts, identity = root / "receipts", root / "pair-identity.json"
    capture = _Capture()
    with capture:
        code = main(["calibrate", "--recipe", "native-text", "--prefill-url", pair[0], "--decode-url", pair[1],
                     "--model", str(assets.MODEL_DIR), "--identity", str(identity), "--receipts", str(receipts)])
    return Calibrated(code, _receipt_of(receipts, set()), identity, receipts, capture.text)


class _Capture:
    """Standard output of a command run by a module-scoped fixture (capsys is function-scoped)."""

    def __enter__(self) -> _Capture:
        import io

        self._saved, self._buffer = sys.stdout, io.StringIO()
        sys.stdout = self._buffer
        return self

    def __exit__(self, *exc: object) -> None:
        sys.stdout = self._saved
        self.text = self._buffer.getvalue()


def _verified(receipt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert verify_receipt(receipt) == []
    assert main(["receipts", "verify", str(receipt)]) == 0, capsys.readouterr()
    capsys.readouterr()


def _qualify(argv: list[str], receipts: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, Path, str, str]:
    before = {path for path in receipts.iterdir() if path.is_dir()}
    code = main(argv)
    captured = capsys.readouterr()
    receipt = _receipt_of(receipts, before)
    _verified(receipt, capsys)
    return code, receipt, captured.out, captured.err


def test_the_pair_is_calibrated_then_qualified_under_its_identity_on_the_strongest_logprobs(calibrated, pair, capsys):
    full = pair[2] == -1
    # The calibration passed, left a receipt that verifies and wrote the identity, which pins the
    # evidence the decode server grants and its signed statement.
    assert calibrated.code == 0, calibrated.out
    _verified(calibrated.receipt, capsys)
    identity = load_served_identity(calibrated.identity)
    assert (identity.mode, identity.top_k) == (("full", None) if full else ("top-k", TOP_K))
    assert identity.basis == f"receipt://{calibrated.receipt.name}"
    assert identity.statement_sha256 == sha256_file(calibrated.receipt / "attestation.dsse.json")
    assert identity.field("model.model_check") == "config" and identity.field("decode.vllm_version")
    evidence = json.loads((calibrated.receipt / "evidence" / "served-calibration.json").read_text())
    cells = evidence["cells"]
    assert len(cells) == identity.field("calibration.cells") == 6
    for cell in cells:
        for comparison in ("cold_again_vs_cold", "handoff_vs_cold"):
            assert cell[comparison]["compared_logprob_entries"] == 256 * (VOCAB if full else TOP_K)
            assert cell[comparison]["tokens_equal"] == 256
        # The decode server's cold recompute repeated itself bit for bit on both kinds of host measured.
        assert cell["cold_again_vs_cold"]["max_abs"] == 0.0
    # The identity's bounds are the rule's over these cells (qualify.judge.calibration.bound_of:
    # the largest value plus one sample standard deviation, or ZERO_DRIFT_BOUND where every cell
    # is zero). Hosts differ: the ones every landing ran on before 2026-12-07 gave all cells
    # bit-equal; an AVX-512 Xeon without AMX gave 3 of 6 handoffs 1.5e-5 to 1.9e-5 from their cold
    # recompute.
    assert (identity.maximum_absolute, identity.maximum_mean_absolute) == (
        bound_of([cell["max_abs"] for cell in cells])[0], bound_of([cell["mean_abs"] for cell in cells])[0])
    # The command the calibration printed to run next qualifies the pair under the identity.
    [command] = [line.removeprefix("next: ") for line in calibrated.out.splitlines() if line.startswith("next: ")]
    code, receipt, out, err = _qualify(shlex.split(command)[1:], calibrated.receipts, capsys)
    assert code == 0, out + err
    summary = json.loads((receipt / "validation-summary.json").read_text())
    assert summary["status"] == "passed" and summary["lane"] == "served-pair"
    assert summary["scope"]["fixture"]["name"].endswith("full-logprobs" if full else f"top{TOP_K}-logprobs")
    assert identity.basis in summary["scope"]["fixture_words"]
    assert (receipt / "identity.json").read_bytes() == calibrated.identity.read_bytes()
    for n in (1, 2, 3):
        sample = json.loads((receipt / "samples" / f"sample-{n}.json").read_text())
        # The prefill server computed the prompt; the decode server loaded it through its connector ...
        assert sample["prefill_connector_tokens"] == 0 and sample["decode_prefix_cache_tokens"] == 0
        assert sample["decode_connector_tokens"] == HANDED_OFF
        # ... and decoded what its cold recompute decoded, every logprob of the evidence within the bound.
        assert sample["tokens_equal"] == 256 and sample["max_abs"] <= identity.maximum_absolute
        assert sample["compared_logprob_entries"] == 256 * (VOCAB if full else TOP_K)


def _refused(calibrated: Calibrated, pair, edit, tmp_path: Path, capsys) -> str:
    document = json.loads(calibrated.identity.read_text())
    edit(document)
    path = tmp_path / "edited-identity.json"
    path.write_text(json.dumps(document))
    code, receipt, _out, err = _qualify(
        ["--recipe", "native-text", "--prefill-url", pair[0], "--decode-url", pair[1], "--model", str(assets.MODEL_DIR),
         "--served-identity", str(path), "--receipts", str(calibrated.receipts)], calibrated.receipts, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert json.loads((receipt / "validation-summary.json").read_text())["status"] == "refused"
    return err.strip()


def test_a_pair_of_another_vllm_version_than_its_identity_is_refused(calibrated, pair, tmp_path, capsys):
    line = _refused(calibrated, pair, lambda d: d["decode"].update(vllm_version="0.0.1"), tmp_path, capsys)
    assert "decode.vllm_version" in line and "0.0.1" in line


def test_a_pair_granting_other_evidence_than_its_identity_is_refused(calibrated, pair, tmp_path, capsys):
    # The full pair against an identity of top-20 (stronger evidence than calibrated), the top-20
    # pair against one of full logprobs (weaker): either way the bound was not calibrated for it.
    def other(document: dict) -> None:
        if pair[2] == -1:
            document["evidence"] = {"mode": "top-k", "top_k": TOP_K, "vocab": VOCAB}
            document["rule"]["top_k_rule"] = {"name": SERVED_TOP_K_RULE, "statement": SERVED_RULES[SERVED_TOP_K_RULE]}
        else:
            document["evidence"] = {"mode": "full", "top_k": None, "vocab": VOCAB}
            document["rule"]["top_k_rule"] = None

    line = _refused(calibrated, pair, other, tmp_path, capsys)
    assert "evidence" in line and "full logprobs" in line and f"top-{TOP_K}" in line  # what was expected, what was found


def test_an_identity_whose_bound_does_not_follow_from_its_basis_is_refused(calibrated, pair, tmp_path, capsys):
    line = _refused(calibrated, pair, lambda d: d["rule"].update(maximum_absolute=0.5), tmp_path, capsys)
    assert "rule.maximum_absolute" in line and calibrated.receipt.name in line

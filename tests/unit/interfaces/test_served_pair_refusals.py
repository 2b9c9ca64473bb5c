"""``qualify --recipe native-text --prefill-url URL --decode-url URL --served-identity PATH`` and
``qualify calibrate --recipe native-text --prefill-url URL --decode-url URL --identity PATH``: every
bad input is refused in one line naming its option (or the identity's field), exit 2, with a
refused receipt that verifies. The servers here are tiny fakes standing in for faults only (a real
served pair: tests/vllm/test_served_pair.py)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import qualify.handoff.served as served_transport
from qualify.archive.keys import ensure_signing_key
from qualify.core import assets
from qualify.interfaces.cli import main
from tests.unit.contract.test_served_identity import identity_document

Route = Callable[[], tuple[int, bytes]]


def _json(document: object, status: int = 200) -> Route:
    return lambda: (status, json.dumps(document).encode())


@pytest.fixture
def fake_server() -> Iterator[Callable[[dict[str, Route]], str]]:
    """Start a fake HTTP server answering ``routes`` (path -> (status, body)), 404 elsewhere; its URL."""
    servers: list[ThreadingHTTPServer] = []

    def start(routes: dict[str, Route]) -> str:
        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                status, body = routes.get(self.path, lambda: (404, b"not found"))()
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

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


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _vllm_routes(root: Path, *, owned_by: str = "vllm") -> dict[str, Route]:
    models = {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": owned_by, "root": str(root),
                                          "max_model_len": 4096}]}
    return {"/version": _json({"version": "0.32.0"}), "/v1/models": _json(models)}


@pytest.fixture(autouse=True)
def _signing_key() -> None:
    ensure_signing_key()  # made before the run, so the run's stderr is its refusal only


def refused_run(tmp_path: Path, capsys: pytest.CaptureFixture[str], *options: str, command: tuple[str, ...] = (),
                identity: object = "valid") -> str:
    """Run the command (a qualification, or ``command`` such as ``("calibrate",)``) with a
    schema-valid identity file unless ``identity`` says otherwise (None: no option); assert exit 2,
    one line on stderr and one refused receipt that verifies; the line."""
    receipts = tmp_path / "receipts"
    extra: list[str] = []
    if identity is not None and not command:
        path = tmp_path / "pair.json"
        path.write_text(json.dumps(identity_document()) if identity == "valid" else str(identity))
        extra = ["--served-identity", str(path)]
    code = main([*command, "--recipe", "native-text", *options, *extra, "--receipts", str(receipts)])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    [receipt] = [path for path in receipts.iterdir() if path.is_dir()]
    assert main(["receipts", "verify", str(receipt)]) == 0, capsys.readouterr()
    capsys.readouterr()
    summary = json.loads((receipt / "validation-summary.json").read_text())
    assert summary["status"] == "refused" and summary["lane"] == "served-pair"
    return lines[0]


def test_a_pair_missing_its_decode_url_is_refused(tmp_path, capsys, fake_server):
    line = refused_run(tmp_path, capsys, "--prefill-url", fake_server(_vllm_routes(assets.MODEL_DIR)))
    assert "--decode-url" in line


def test_a_url_that_does_not_answer_is_refused(tmp_path, capsys):
    dead = f"http://127.0.0.1:{_free_port()}"
    line = refused_run(tmp_path, capsys, "--prefill-url", dead, "--decode-url", dead)
    assert "--prefill-url" in line and dead in line


def test_a_server_that_accepts_but_never_answers_is_refused_after_the_bounded_timeout(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(served_transport, "CHECK_TIMEOUT_S", 0.5)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)  # connections complete in the backlog; nothing is ever read or answered
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        line = refused_run(tmp_path, capsys, "--prefill-url", url, "--decode-url", url)
    assert "--prefill-url" in line and "/version" in line


def test_an_endpoint_that_is_not_vllm_is_refused(tmp_path, capsys, fake_server):
    not_vllm = fake_server({"/": _json({"hello": "world"})})
    line = refused_run(tmp_path, capsys, "--prefill-url", not_vllm, "--decode-url", not_vllm)
    assert "--prefill-url" in line and "/version" in line


def test_a_model_list_not_owned_by_vllm_is_refused(tmp_path, capsys, fake_server):
    other = fake_server(_vllm_routes(assets.MODEL_DIR, owned_by="openai"))
    line = refused_run(tmp_path, capsys, "--prefill-url", other, "--decode-url", other)
    assert "--prefill-url" in line and "owned_by" not in line  # the line names the list, not a field


def test_a_server_of_another_model_is_refused(tmp_path, capsys, fake_server):
    other_model = tmp_path / "other-model"
    other_model.mkdir()
    config = json.loads((assets.MODEL_DIR / "config.json").read_text())
    (other_model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 5}))
    right = fake_server(_vllm_routes(assets.MODEL_DIR))
    wrong = fake_server(_vllm_routes(other_model))
    line = refused_run(tmp_path, capsys, "--prefill-url", right, "--decode-url", wrong)
    assert "--decode-url" in line and "num_hidden_layers" in line


def test_a_url_that_is_not_http_is_refused(tmp_path, capsys):
    line = refused_run(tmp_path, capsys, "--prefill-url", "ftp://127.0.0.1:1", "--decode-url", "http://127.0.0.1:1")
    assert "--prefill-url" in line


def test_a_run_without_an_identity_is_refused_before_any_request_naming_the_calibrate_command(tmp_path, capsys):
    dead, other = (f"http://127.0.0.1:{_free_port()}" for _ in range(2))
    line = refused_run(tmp_path, capsys, "--prefill-url", dead, "--decode-url", other, identity=None)
    assert "--served-identity" in line and "qualify calibrate" in line and "--identity" in line


def test_an_identity_that_is_not_json_is_refused_before_any_request(tmp_path, capsys):
    dead, other = (f"http://127.0.0.1:{_free_port()}" for _ in range(2))
    line = refused_run(tmp_path, capsys, "--prefill-url", dead, "--decode-url", other, identity="{not json")
    assert line.count("--served-identity") == 1 and dead not in line


def test_a_pair_of_another_vllm_version_than_its_identity_is_refused_naming_the_field(tmp_path, capsys, fake_server):
    routes = {**_vllm_routes(assets.MODEL_DIR), "/version": _json({"version": "0.31.0"})}
    line = refused_run(tmp_path, capsys, "--prefill-url", fake_server(routes), "--decode-url", fake_server(routes))
    assert "prefill.vllm_version" in line and "0.32.0" in line and "0.31.0" in line


def test_a_calibration_without_an_identity_path_is_refused(tmp_path, capsys):
    dead, other = (f"http://127.0.0.1:{_free_port()}" for _ in range(2))
    line = refused_run(tmp_path, capsys, "--prefill-url", dead, "--decode-url", other, command=("calibrate",))
    assert "--identity" in line


def test_a_calibration_never_overwrites_an_identity(tmp_path, capsys):
    dead, other = (f"http://127.0.0.1:{_free_port()}" for _ in range(2))
    existing = tmp_path / "pair.json"
    existing.write_text("{}")
    line = refused_run(tmp_path, capsys, "--prefill-url", dead, "--decode-url", other, "--identity", str(existing),
                       command=("calibrate",))
    assert "--identity" in line and str(existing) in line
    assert existing.read_text() == "{}"

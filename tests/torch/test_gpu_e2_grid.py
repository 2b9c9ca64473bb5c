"""The long-context E2 grid (bench/gpu_e2_grid.py, qualify/evidence/controls_device.py) on a tiny random
torch-llama model on the CPU, so the default suite checks what the GPU run relies on.

Row scoring is checked against the consumer's own decode step after a handoff of r positions; the
chunking does not change a row; a cell of length L is the first L rows of the document's one pass
(its profile windows sum to it); a handoff with one perturbed layer disagrees where an honest one
agrees; the output ends with ``e2_grid_wall_s: <seconds>``; refusals are one line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from tests.support.scripts import load_script

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = {
    "architecture": "llama", "weights": "random normal(0, 0.02), norms ones", "seed": 7, "dtype": "float32",
    "device": "cpu", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "intermediate_size": 128, "vocab_size": 4096, "max_position_embeddings": 256,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
}
GRID = ["--lengths", "32,64,128", "--decode", "4", "--chunk", "48", "--profile-window", "32"]
LOGIT_TOLERANCE = 1e-4  # float32 on the CPU: the batched scorer and the decode step differ by reduction order


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script(REPO / "bench" / "gpu_e2_grid.py")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny.json"
    path.write_text(json.dumps(TINY_MODEL), encoding="utf-8")
    return path


def run_grid(bench: ModuleType, tiny_model: Path, out: Path, capsys: pytest.CaptureFixture[str],
             *extra: str) -> tuple[int, list[str], dict[str, Any]]:
    code = bench.main(["--model-file", str(tiny_model), "--out", str(out), *GRID, *extra])
    lines = capsys.readouterr().out.splitlines()
    record = json.loads((out / "e2-grid.json").read_text(encoding="utf-8")) if code == 0 else {}
    return code, lines, record


def test_row_r_is_scored_from_the_sources_first_r_positions_and_its_own_step(bench: ModuleType,
                                                                             tiny_model: Path) -> None:
    import torch

    from qualify.evidence.controls_device import score_logit_chunks

    engines = bench.build_engines(tiny_model, [64], 4, 16)
    tokens = torch.from_numpy(bench.load_documents(REPO / "bench" / "documents", 40)["c-test-clinic"][0])
    engines.producer.prefill_device(tokens)
    # A source unlike the consumer's own prefill, so a row that read its own K/V would show it.
    source = bench.apply_fault("kv-layer", engines.producer.kv_device())
    scored = torch.cat([logits for _, _, logits in score_logit_chunks(engines.consumer, tokens, source, 7)])
    whole = torch.cat([logits for _, _, logits in score_logit_chunks(engines.consumer, tokens, source, 40)])
    assert torch.equal(scored.argmax(dim=-1), whole.argmax(dim=-1))
    assert float((scored - whole).abs().max()) <= LOGIT_TOLERANCE
    for row in (1, 2, 7, 8, 39):
        engines.consumer.install_device([k[:, :row] for k in source[0]], [v[:, :row] for v in source[1]])
        stepped = engines.consumer.decode_device(tokens[row:row + 1], 1).logits[0]
        assert float((stepped - scored[row]).abs().max()) <= LOGIT_TOLERANCE, row
        assert int(stepped.argmax()) == int(scored[row].argmax()), row


def test_an_honest_handoff_agrees_on_every_row_and_step_and_prints_the_wall_last(
        bench: ModuleType, tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines, record = run_grid(bench, tiny_model, tmp_path, capsys)
    assert code == 0
    assert re.fullmatch(r"e2_grid_wall_s: \d+\.\d", lines[-1])
    assert [document["document"] for document in record["documents"]] == list(bench.DOCUMENT_NAMES)
    for document in record["documents"]:
        assert document["kv_equal"] is True
        assert [(cell["length"], cell["lane_disagreeing"], cell["decode"]["disagreeing"]) for cell in document["cells"]] \
            == [(32, 0, 0), (64, 0, 0), (128, 0, 0)]
        assert document["top_tokens_sha256"]["lane"] == document["top_tokens_sha256"]["reference"]
        assert any(line.split()[:3] == [document["document"], "128", "0/128"] for line in lines)


def test_a_perturbed_layer_in_the_handoff_disagrees_in_nested_cells(
        bench: ModuleType, tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines, record = run_grid(bench, tiny_model, tmp_path, capsys, "--fault", "kv-layer")
    assert code == 0
    assert re.fullmatch(r"e2_grid_wall_s: \d+\.\d", lines[-1])
    for document in record["documents"]:
        assert document["kv_equal"] is False
        windows = np.array([window["lane_disagreeing"] for window in document["profile"]])
        # Nesting: a cell of length L is the first L rows of the one pass, i.e. its first L/32 windows.
        assert [cell["lane_disagreeing"] for cell in document["cells"]] == [int(windows[:n].sum()) for n in (1, 2, 4)]
        assert document["cells"][-1]["lane_disagreeing"] > 0
        assert all(cell["rate"] == cell["lane_disagreeing"] / cell["length"] for cell in document["cells"])
    assert sum(cell["decode"]["disagreeing"] for document in record["documents"] for cell in document["cells"]) > 0


@pytest.mark.parametrize(("argv", "message"), [
    (["--lengths", "64,32"], "controls lengths[1]: found 32, expected a whole length above 64"),
    (["--lengths", "32,64,40000"], "document python-test-descr: 32768 tokens, expected at least the longest length 40000"),
    (["--lengths", "32,x"], "--lengths: found '32,x', expected comma-separated whole numbers"),
])
def test_bad_options_are_refused_in_one_line(bench: ModuleType, tiny_model: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    options = ["--model-file", str(tiny_model), "--out", str(tmp_path), "--decode", "2", "--profile-window", "32", *argv]
    assert bench.main(options) == 2
    captured = capsys.readouterr()
    assert captured.err == f"gpu_e2_grid: refused: {message}\n"
    assert not (tmp_path / "e2-grid.json").exists()


def test_the_8b_grid_is_refused_in_one_line_without_cuda(bench: ModuleType, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the 8B grid would run")
    assert bench.main(["--out", str(tmp_path), "--lengths", "2048", "--decode", "1"]) == 2
    assert capsys.readouterr().err == ("gpu_e2_grid: refused: torch llama device: 'cuda' requested but torch sees "
                                       "no CUDA device\n")

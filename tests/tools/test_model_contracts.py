"""tools/model_contracts.py on a GGUF file named as published GGUFs are (dots and capitals): both
contracts are written under names their schemas accept and load back through the harness's
loaders; nothing is left behind when the pair is refused."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from qualify.contract.controls import (
    MODEL_CALIBRATION_SET_FILE,
    MODEL_CRITERIA_FILE,
    load_calibration_set,
    load_controls_criteria,
)
from qualify.core.assets import MODEL_DIR
from qualify.engines import chosen_model
from qualify.engines.checkpoint import load_config, load_weights
from tests.unit.engines.test_model_source import write_gguf

REPO_ROOT = Path(__file__).resolve().parents[2]
CONTRACT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


def _tool():
    spec = importlib.util.spec_from_file_location("model_contracts_tool", REPO_ROOT / "tools" / "model_contracts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def shipped() -> tuple[object, dict]:
    config = load_config(MODEL_DIR)
    return config, load_weights(MODEL_DIR, config)


@pytest.fixture(autouse=True)
def shipped_model_again() -> Iterator[None]:
    yield
    chosen_model.use_model(None)


def test_a_gguf_named_with_dots_and_capitals_gets_contracts_that_load(tmp_path: Path, shipped) -> None:
    model = write_gguf(tmp_path / "Shipped.Model-F32.gguf", *shipped)
    out = tmp_path / "contracts"
    assert _tool().main(["--model", str(model), "--out", str(out)]) == 0
    assert sorted(path.name for path in out.iterdir()) == sorted([MODEL_CALIBRATION_SET_FILE, MODEL_CRITERIA_FILE])
    names = [json.loads((out / name).read_text())["name"] for name in (MODEL_CALIBRATION_SET_FILE, MODEL_CRITERIA_FILE)]
    assert names == ["calibration-set-shipped-model-f32-gguf-v1", "e2-controls-shipped-model-f32-gguf-v1"]
    assert all(CONTRACT_NAME.fullmatch(name) and len(name) <= 64 for name in names)
    chosen_model.use_model(str(model))
    assert load_calibration_set(out / MODEL_CALIBRATION_SET_FILE)[0].name == names[0]
    assert load_controls_criteria(out / MODEL_CRITERIA_FILE)[0].name == names[1]


def test_long_names_are_cut_and_kept_apart() -> None:
    tool = _tool()
    first, second = (tool.contract_name_part("A" * 80 + suffix) for suffix in (".gguf", ".GGUF2"))
    assert first != second and all(len(part) <= tool.CONTRACT_NAME_ROOM and CONTRACT_NAME.fullmatch(part)
                                   for part in (first, second))


def test_existing_contracts_are_kept_unless_replaced(tmp_path: Path, shipped, capsys: pytest.CaptureFixture[str]) -> None:
    model = write_gguf(tmp_path / "m.gguf", *shipped)
    out = tmp_path / "contracts"
    out.mkdir()
    (out / MODEL_CRITERIA_FILE).write_text("{}")
    assert _tool().main(["--model", str(model), "--out", str(out)]) == 2
    assert "exists; pass --replace" in capsys.readouterr().err
    assert sorted(path.name for path in out.iterdir()) == [MODEL_CRITERIA_FILE]

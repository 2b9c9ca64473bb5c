"""Write a chosen model's calibration set and E2 controls criteria, before any measurement on it.

Both are the shipped contracts' rules applied to the model: the same documents, lengths, gate and
hypotheses, with each document's ``token_sha256`` taken under the model's own tokenizer (its
rule, "the first N tokens of this source text", cut from ``model/sources``), and the E1 yardstick
the model's own float weights quantized to Q8_0 in process (pinned by the digest of the quantized
bytes). Commit the two files before calibrating: the criteria are preregistered by their commit
time, which must precede every receipt measured under them.

Usage: python tools/model_contracts.py --model NAME|PATH [--written TEXT] [--replace] [--out DIR]
Writes contracts/models/<name>/calibration-set-v1.json and e2-controls-v1.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from qualify.contract.controls import (
    CALIBRATION_SET_PATH,
    CRITERIA_PATH,
    MODEL_CALIBRATION_SET_FILE,
    MODEL_CRITERIA_FILE,
    load_calibration_set,
    load_controls_criteria,
    load_document,
    model_contracts_dir,
)
from qualify.core import model_choice
from qualify.core.assets import prompt_sha256
from qualify.core.errors import Refused, one_line
from qualify.core.strict_json import read_strict_json
from qualify.engines import chosen_model


def _with_model_tokens(documents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each document entry with its ``token_sha256`` under the chosen model's tokenizer."""
    return [{**entry, "token_sha256": prompt_sha256(load_document(entry["name"]))} for entry in documents]


CONTRACT_NAME_ROOM = 64 - len("calibration-set--v1")
"""The longest model part a contract's name may hold (the schemas allow 64 characters)."""


def contract_name_part(model_name: str) -> str:
    """The model's name as its contracts' names may hold it (lower case, letters, digits, '_' and
    '-'; "SmolLM2-135M-Instruct.Q4_1.gguf" gives "smollm2-135m-instruct-q4_1-gguf"), a short
    digest of the whole name added when it has to be cut, so two models never share one."""
    part = re.sub(r"[^a-z0-9_]+", "-", model_name.lower()).strip("-_") or "model"
    if len(part) > CONTRACT_NAME_ROOM:
        part = f"{part[:CONTRACT_NAME_ROOM - 9].rstrip('-_')}-{hashlib.sha256(model_name.encode()).hexdigest()[:8]}"
    return part


def model_contracts(written: str) -> dict[str, dict[str, Any]]:
    """The chosen model's two documents, by file name."""
    choice = chosen_model.require_choice()
    calibration_set = read_strict_json(CALIBRATION_SET_PATH, "calibration set")
    criteria = read_strict_json(CRITERIA_PATH, "controls criteria")
    calibration_set["documents"] = _with_model_tokens(calibration_set["documents"])
    criteria["documents"] = _with_model_tokens(criteria["documents"])
    digest, _ = chosen_model.q8_0_weights_sha256()
    part = contract_name_part(choice.name)
    calibration_set["name"] = f"calibration-set-{part}-v1"
    criteria["name"] = f"e2-controls-{part}-v1"
    criteria["written"] = written
    criteria["yardstick"] = {
        "name": "q8_0-of-model",
        "description": (f"E1: the {choice.name} model's own float weights quantized to Q8_0 in process "
                        "(gguf.quants, llama.cpp's reference Q8_0) and run in llama.cpp's exact arithmetic, a "
                        "second real quantization of the same weights, handing off its KV to the same consumer "
                        "and scored on the same rows"),
        "file": model_choice.file_key(choice.name, chosen_model.Q8_0_DERIVED),
        "sha256": digest,
    }
    return {MODEL_CALIBRATION_SET_FILE: calibration_set, MODEL_CRITERIA_FILE: criteria}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, metavar="NAME|PATH")
    parser.add_argument("--written", default="before any control was measured on any lane of this model",
                        help="the criteria's 'written' statement")
    parser.add_argument("--replace", action="store_true", help="overwrite existing files")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="write them here instead of contracts/models/<name>/ (to look before committing)")
    args = parser.parse_args(argv)
    try:
        chosen_model.use_model(args.model)
        out_dir = args.out or model_contracts_dir()
        documents = model_contracts(args.written)
        for name in documents:
            if (out_dir / name).exists() and not args.replace:
                raise Refused(f"{out_dir / name}: exists; pass --replace to overwrite it")
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=".unchecked-") as staging:
            staged = {name: Path(staging) / name for name in documents}
            for name, document in documents.items():
                staged[name].write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
            # Both must load through the harness's own fail-closed loaders before either is in
            # place: a refused pair leaves nothing under contracts/models/.
            load_calibration_set(staged[MODEL_CALIBRATION_SET_FILE])
            criteria, _ = load_controls_criteria(staged[MODEL_CRITERIA_FILE])
            from qualify.evidence.controls_measure import yardstick_identity

            yardstick_identity(criteria)
            for name, path in staged.items():
                os.replace(path, out_dir / name)
    except Refused as exc:
        print(f"model_contracts: refused: {one_line(str(exc))}", file=sys.stderr)
        return 2
    for name in documents:
        print(out_dir / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

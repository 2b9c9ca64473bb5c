"""A served pair's identity file (qualify.contract.served_identity): a file that is missing, not
JSON, breaks its schema or names a rule other than the stated ones is refused in one line naming
the file and the field; a valid one loads with its canonical digest."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from qualify.contract.rules import SERVED_BOUND_RULE, SERVED_RULES, SERVED_TOP_K_RULE
from qualify.contract.served_identity import load_served_identity
from qualify.core.digests import document_sha256
from qualify.core.errors import Refused


def identity_document(*, mode: str = "full", k: int | None = None) -> dict[str, Any]:
    """A schema-valid identity (its basis receipt need not exist: loading the file checks none)."""
    top_k_rule = None if mode == "full" else {"name": SERVED_TOP_K_RULE, "statement": SERVED_RULES[SERVED_TOP_K_RULE]}
    return {
        "schema": "trust-ladder.served-pair-identity.v1", "recipe": "native-text", "lane": "served-pair",
        "prefill": {"vllm_version": "0.32.0", "max_model_len": 4096},
        "decode": {"vllm_version": "0.32.0", "max_model_len": 4096},
        "model": {"name": "shipped", "served_model_id": "shipped", "config_sha256": "c" * 64, "model_check": "config"},
        "evidence": {"mode": mode, "top_k": k, "vocab": 4096},
        "rule": {"maximum_absolute": 5e-324, "maximum_mean_absolute": 5e-324,
                 "bound_rule": {"name": SERVED_BOUND_RULE, "statement": SERVED_RULES[SERVED_BOUND_RULE]},
                 "top_k_rule": top_k_rule},
        "fixture": {"name": "python-textwrap", "prompt_tokens": 2048, "prompt_sha256": "d" * 64, "output_tokens": 256,
                    "repetitions": 3},
        "calibration": {"set": {"name": "calibration-set-v1", "sha256": "e" * 64}, "cells": 6},
        "basis": {"receipt": "receipt://20261205T090000Z-0123456789abcdef", "statement_sha256": "f" * 64},
    }


def write(path: Path, document: Any) -> Path:
    path.write_text(json.dumps(document) if not isinstance(document, str) else document, encoding="utf-8")
    return path


def edited(change) -> dict[str, Any]:
    document = copy.deepcopy(identity_document())
    change(document)
    return document


def test_a_valid_identity_loads_with_its_digest(tmp_path):
    identity = load_served_identity(write(tmp_path / "pair.json", identity_document()))
    assert identity.sha256 == document_sha256(identity_document())
    assert (identity.mode, identity.top_k, identity.vocab, identity.top_k_rule) == ("full", None, 4096, None)
    top = load_served_identity(write(tmp_path / "top.json", identity_document(mode="top-k", k=20)))
    assert (top.mode, top.top_k, top.top_k_rule) == ("top-k", 20, SERVED_TOP_K_RULE)


@pytest.mark.parametrize("content, field", [
    (None, "no such file"),
    ("{not json", "pair.json"),
    ([1, 2], "pair.json"),
    (edited(lambda d: d.pop("basis")), "basis"),
    (edited(lambda d: d["decode"].update(vllm_version=32)), "decode.vllm_version"),
    (edited(lambda d: d["rule"].update(maximum_absolute=0.0)), "rule.maximum_absolute"),
    (edited(lambda d: d["evidence"].update(mode="top-5")), "evidence.mode"),
    (edited(lambda d: d["model"].update(extra=1)), "model"),
    (edited(lambda d: d["rule"]["bound_rule"].update(statement="a bound I chose")), "rule.bound_rule"),
    (edited(lambda d: d["evidence"].update(top_k=20)), "evidence.top_k"),
    (edited(lambda d: d.update(schema="trust-ladder.onboarding-identity.v5")), "schema"),
])
def test_a_bad_identity_file_is_refused_in_one_line_naming_the_option_and_the_field(tmp_path, content, field):
    path = tmp_path / "pair.json"
    if content is not None:
        write(path, content)
    with pytest.raises(Refused) as refused:
        load_served_identity(path)
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"--served-identity {path}") and field in line


def test_a_top_k_identity_without_its_top_k_rule_is_refused(tmp_path):
    document = identity_document(mode="top-k", k=20)
    document["rule"]["top_k_rule"] = None
    with pytest.raises(Refused, match="rule.top_k_rule"):
        load_served_identity(write(tmp_path / "pair.json", document))

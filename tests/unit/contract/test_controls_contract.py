"""The preregistered E2 controls criteria and calibration set load fail closed: strict JSON, their
schemas, typed models that give back exactly the document, and the files they name (document ids
hashing to their digests, enough tokens, the yardstick file); the two sets share no document and
neither holds the qualification fixture."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import rfc8785

from qualify.contract.controls import (
    CALIBRATION_SET_PATH,
    CALIBRATION_SET_SCHEMA_PATH,
    CRITERIA_PATH,
    CRITERIA_SCHEMA_PATH,
    check_disjoint,
    load_calibration_set,
    load_controls_criteria,
    load_document,
)
from qualify.core import assets
from qualify.core.digests import sha256_bytes
from qualify.core.errors import Refused
from qualify.judge.controls import DOCUMENT_WITHIN_WORDS, EXCEEDANCE_WORDS, GATE_RULES, LENGTH_EFFECT_RULES

CRITERIA: dict[str, Any] = json.loads(CRITERIA_PATH.read_text(encoding="utf-8"))
CALIBRATION: dict[str, Any] = json.loads(CALIBRATION_SET_PATH.read_text(encoding="utf-8"))
SHLEX_IDS_SHA256 = "b4b55313ea1af4293c24238afb20d1d790f18808cca4287fd271e999e53965f1"
YARDSTICK_SHA256 = "9c55b5fc0d393746644287152fa8b36ae3078c09ac290c2af7f3f1e6f3df8d07"


def test_the_committed_criteria_load_with_the_digest_of_their_rfc8785_bytes():
    criteria, digest = load_controls_criteria()
    assert digest == sha256_bytes(rfc8785.dumps(CRITERIA))
    assert [document.name for document in criteria.documents] == ["python-test-shlex", "prose-idle-news",
                                                                 "config-idle-keys"]
    assert criteria.lengths == (512, 1024, 2048, 4096) and criteria.profile_window == 512
    assert (criteria.gate.rule, criteria.gate.confidence, criteria.gate.points) == ("wilson-upper-plus-points", 0.95, 0.02)
    assert criteria.document() == CRITERIA


def test_the_committed_calibration_set_loads_and_shares_nothing_with_the_controls():
    calibration, digest = load_calibration_set()
    assert digest == sha256_bytes(rfc8785.dumps(CALIBRATION))
    assert calibration.prompt_lengths == (1024, 1792) and calibration.document() == CALIBRATION
    check_disjoint(load_controls_criteria()[0], calibration)


@pytest.mark.parametrize("entry", CRITERIA["documents"] + CALIBRATION["documents"], ids=lambda entry: entry["name"])
def test_load_document_gives_the_ids_the_entry_digests(entry: dict[str, Any]):
    ids = load_document(entry["name"])
    assert ids.dtype == np.int64 and ids.shape == (entry["tokens"],)
    assert assets.prompt_sha256(ids) == entry["token_sha256"]


def test_the_judge_evaluates_exactly_the_wordings_the_criteria_schema_admits():
    schema = json.loads(CRITERIA_SCHEMA_PATH.read_text(encoding="utf-8"))["properties"]
    assert set(schema["gate"]["properties"]["rule"]["enum"]) == GATE_RULES
    assert schema["exceedance"]["const"] == EXCEEDANCE_WORDS
    words = schema["criteria"]["properties"]
    assert set(words["length_effect_supported"]["enum"]) == set(LENGTH_EFFECT_RULES)
    assert words["document_within"]["enum"] == [DOCUMENT_WITHIN_WORDS]


def test_both_schemas_are_closed_at_every_object():
    def objects(node: Any) -> list[dict[str, Any]]:
        found = []
        if isinstance(node, dict):
            if node.get("type") == "object":
                found.append(node)
            for value in node.values():
                found += objects(value)
        elif isinstance(node, list):
            for value in node:
                found += objects(value)
        return found

    for path in (CRITERIA_SCHEMA_PATH, CALIBRATION_SET_SCHEMA_PATH):
        schema = json.loads(path.read_text(encoding="utf-8"))
        assert all(node.get("additionalProperties") is False and set(node["required"]) == set(node["properties"])
                   for node in objects(schema)), path.name


# --- refusals of a criteria file ---------------------------------------------------------------------


Edit = Callable[[dict[str, Any]], None]


def _set(path: str, value: object) -> Edit:
    def edit(document: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        target: Any = document
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        target[int(last) if isinstance(target, list) else last] = value
    return edit


def _delete(path: str) -> Edit:
    def edit(document: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        target: Any = document
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        del target[int(last) if isinstance(target, list) else last]
    return edit


def _append_copy(path: str, index: int) -> Edit:
    def edit(document: dict[str, Any]) -> None:
        document[path].append(copy.deepcopy(document[path][index]))
    return edit


FIXTURE_ENTRY = {"name": "python-textwrap", "kind": "python source", "source": "CPython 3.11.7 Lib/textwrap.py",
                 "source_sha256": "62867e40cdea6669b361f72af4d7daf0359f207c92cbeddfc7c7506397c1f31c", "tokens": 4096,
                 "token_sha256": SHLEX_IDS_SHA256, "file": "model/documents/python-textwrap.json"}

CRITERIA_REFUSALS: list[tuple[str, Edit, str]] = [
    ("an extra field", _set("verdict", "pass"), "verdict: found unexpected field, expected only schema, name"),
    ("a missing gate", _delete("gate"), "gate: missing, expected this field"),
    ("tokens as a string", _set("documents/0/tokens", "4096"), "documents[0].tokens: found \"4096\", expected type integer"),
    ("tokens as a float", _set("documents/0/tokens", 4096.0), "documents[0].tokens: found 4096.0, expected type integer"),
    ("tokens as a bool", _set("documents/0/tokens", True), "documents[0].tokens: found true, expected type integer"),
    ("confidence 1", _set("gate/confidence", 1), "gate.confidence: found 1, expected a number < 1"),
    ("an unknown gate rule", _set("gate/rule", "wilson-upper"), "gate.rule: found \"wilson-upper\", expected one of"),
    ("another length criterion", _set("criteria/length_effect_supported", "every document exceeds at 4096"),
     "criteria.length_effect_supported: found"),
    ("another exceedance", _set("exceedance", "a cell at or above its gate"), "exceedance: found"),
    ("lengths not increasing", _set("lengths", [512, 2048, 1024, 4096]),
     "lengths[2]: found 1024 after 2048, expected strictly increasing lengths"),
    ("a repeated length", _set("lengths", [512, 1024, 1024, 4096]), "lengths: [512, 1024, 1024, 4096] has non-unique elements"),
    ("a length not a whole window", _set("lengths", [512, 1000, 2048, 4096]),
     "lengths[1]: found 1000, expected a multiple of profile_window 512"),
    ("fewer tokens than the longest length", _set("lengths", [512, 1024, 2048, 8192]),
     "documents[0].tokens: found 4096, expected at least 8192 (the longest length 8192)"),
    ("a repeated document", _append_copy("documents", 0), "documents[3].name: found \"python-test-shlex\", already documents[0]'s"),
    ("an unknown lane", _set("lanes/0", "nvfp4-native-w8a8"), "lanes[0]: found \"nvfp4-native-w8a8\", expected a lane of the lane table"),
    ("a file not named for its document", _set("documents/0/file", "model/documents/prose-idle-news.json"),
     "documents[0].file: found \"model/documents/prose-idle-news.json\", expected \"model/documents/python-test-shlex.json\""),
    ("ids hashing to another digest", _set("documents/0/token_sha256", "1" * 64),
     f"documents[0].token_sha256: found {'1' * 64}, model/documents/python-test-shlex.json's ids hash to {SHLEX_IDS_SHA256}"),
    ("another source", _set("documents/0/source", "CPython 3.12.0 Lib/test/test_shlex.py"), "documents[0].source: found"),
    ("a calibration document", _set("documents/0", copy.deepcopy(CALIBRATION["documents"][0])),
     "documents[0].tokens: found 1792, expected at least 4096"),
    ("the fixture by name", _set("documents/0", FIXTURE_ENTRY),
     "documents[0].name: found \"python-textwrap\", which is the qualification fixture's"),
    ("the fixture by source", _set("documents/0/source", "CPython 3.11.7 Lib/textwrap.py"),
     "documents[0].source: found \"CPython 3.11.7 Lib/textwrap.py\", which is the qualification fixture's"),
    ("a document with no file", _set("documents/0", {**CRITERIA["documents"][0], "name": "python-test-nope",
                                                     "file": "model/documents/python-test-nope.json"}),
     "asset model/documents/python-test-nope.json: missing"),
    ("another yardstick digest", _set("yardstick/sha256", "2" * 64),
     f"yardstick.sha256: found {'2' * 64}, model/gguf/target-q8_0.gguf hashes to {YARDSTICK_SHA256}"),
    ("a yardstick with no file", _set("yardstick/file", "model/gguf/target-q6_k.gguf"), "asset model/gguf/target-q6_k.gguf: missing"),
]


@pytest.mark.parametrize("edit, expected", [(e, x) for _, e, x in CRITERIA_REFUSALS],
                         ids=[name for name, _, _ in CRITERIA_REFUSALS])
def test_a_criteria_file_is_refused_in_one_line_naming_file_and_field(tmp_path: Path, edit: Edit, expected: str):
    document = copy.deepcopy(CRITERIA)
    edit(document)
    path = tmp_path / "e2-controls.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    with pytest.raises(Refused) as refused:
        load_controls_criteria(path)
    message = str(refused.value)
    assert "\n" not in message
    if not message.startswith("asset "):   # a missing shipped file is refused by its own name first
        assert message.startswith(f"controls criteria {path}: ")
    assert expected in message, message


@pytest.mark.parametrize("text, expected", [
    ('{"schema": "a", "schema": "b"}', "duplicate key 'schema'"),
    ('{"schema": NaN}', "not JSON"),
    ("[]", "found [], expected type object"),
])
def test_a_criteria_file_that_is_not_one_strict_json_object_is_refused(tmp_path: Path, text: str, expected: str):
    path = tmp_path / "e2-controls.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(Refused, match="^controls criteria ") as refused:
        load_controls_criteria(path)
    assert expected in str(refused.value)


CALIBRATION_REFUSALS: list[tuple[str, Edit, str]] = [
    ("prompt lengths not increasing", _set("prompt_lengths", [1792, 1024]),
     "prompt_lengths[1]: found 1024 after 1792, expected strictly increasing lengths"),
    ("a prompt longer than the documents", _set("prompt_lengths", [1024, 2048]),
     "documents[0].tokens: found 1792, expected at least 2048 (the longest prompt length 2048)"),
    ("no output tokens", _set("output_tokens", 0), "output_tokens: found 0, expected a number >= 1"),
    ("an extra field", _set("bounds", {}), "bounds: found unexpected field"),
    ("a control document", _set("documents/0", copy.deepcopy(CRITERIA["documents"][0])),
     "documents[0].name: model/documents/python-test-shlex.json is a control document, expected a calibration document"),
    ("the fixture", _set("documents/1", FIXTURE_ENTRY), "documents[1].name: found \"python-textwrap\", which is the qualification fixture's"),
    ("ids hashing to another digest", _set("documents/2/token_sha256", "3" * 64), "documents[2].token_sha256: found 3333"),
]


@pytest.mark.parametrize("edit, expected", [(e, x) for _, e, x in CALIBRATION_REFUSALS],
                         ids=[name for name, _, _ in CALIBRATION_REFUSALS])
def test_a_calibration_set_file_is_refused_in_one_line_naming_file_and_field(tmp_path: Path, edit: Edit, expected: str):
    document = copy.deepcopy(CALIBRATION)
    edit(document)
    path = tmp_path / "calibration-set.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    with pytest.raises(Refused) as refused:
        load_calibration_set(path)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"calibration set {path}: ")
    assert expected in message, message


# --- the two sets share no document ---------------------------------------------------------------


def test_a_calibration_set_sharing_a_control_document_by_name_is_refused():
    criteria, _ = load_controls_criteria()
    calibration, _ = load_calibration_set()
    shared = calibration.model_copy(update={"documents": (*calibration.documents, criteria.documents[2])})
    with pytest.raises(Refused, match=r"^calibration set calibration-set-v1: documents\[3\]\.name: found "
                                      r"\"config-idle-keys\", which is control document config-idle-keys's"):
        check_disjoint(criteria, shared)


@pytest.mark.parametrize("field", ["source", "source_sha256"])
def test_a_calibration_set_sharing_a_control_source_under_another_name_is_refused(field: str):
    criteria, _ = load_controls_criteria()
    calibration, _ = load_calibration_set()
    renamed = calibration.documents[0].model_copy(update={field: getattr(criteria.documents[1], field)})
    shared = calibration.model_copy(update={"documents": (renamed, *calibration.documents[1:])})
    with pytest.raises(Refused, match=rf"documents\[0\]\.{field}: found .*, which is control document prose-idle-news's"):
        check_disjoint(criteria, shared)


def test_the_fixture_in_either_set_is_refused_by_the_disjointness_check():
    criteria, _ = load_controls_criteria()
    calibration, _ = load_calibration_set()
    fixture = calibration.documents[0].model_copy(update={"name": "python-textwrap"})
    with pytest.raises(Refused, match=r"^controls criteria e2-controls-v2: documents\[0\]\.name: found \"python-textwrap\""):
        check_disjoint(criteria.model_copy(update={"documents": (fixture,)}), calibration)
    with pytest.raises(Refused, match=r"^calibration set calibration-set-v1: documents\[0\]\.name: found \"python-textwrap\""):
        check_disjoint(criteria, calibration.model_copy(update={"documents": (fixture,)}))


# --- a document file -----------------------------------------------------------------------------


@pytest.fixture
def asset_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An asset root holding copies of the documents and the fixture prompt, the yardstick linked."""
    root = tmp_path / "assets"
    shutil.copytree(assets.ASSET_ROOT / "model" / "documents", root / "model" / "documents")
    (root / "model" / "prompts").mkdir()
    shutil.copy(assets.ASSET_ROOT / "model" / "prompts" / "python-textwrap.json", root / "model" / "prompts")
    (root / "model" / "gguf").mkdir()
    (root / "model" / "gguf" / "target-q8_0.gguf").symlink_to(assets.ASSET_ROOT / "model" / "gguf" / "target-q8_0.gguf")
    monkeypatch.setattr(assets, "ASSET_ROOT", root)
    return root


def _edit_document(root: Path, name: str, edit: Edit) -> None:
    path = root / "model" / "documents" / f"{name}.json"
    document = json.loads(path.read_text(encoding="utf-8"))
    edit(document)
    path.write_text(json.dumps(document), encoding="utf-8")


DOCUMENT_REFUSALS: list[tuple[str, Edit, str]] = [
    ("an id changed under the same digest", _set("token_ids/7", 8), "token_sha256: found b4b55313"),
    ("an id past uint32", _set("token_ids/0", 1 << 32), "token_ids[0]: found 4294967296, expected a token id in 0..4294967295"),
    ("a negative id", _set("token_ids/0", -1), "token_ids[0]: found -1"),
    ("a bool id", _set("token_ids/0", True), "token_ids[0]: Input should be a valid integer, found true"),
    ("an id dropped", _delete("token_ids/4095"), "token_ids: found 4095 ids, expected tokens = 4096"),
    ("another name", _set("name", "python-test-shlex2"), "name: found \"python-test-shlex2\", expected \"python-test-shlex\""),
    ("an extra field", _set("main", True), "main: Extra inputs are not permitted"),
    ("an unknown set", _set("set", "training"), "set: Input should be 'calibration' or 'control'"),
]


@pytest.mark.parametrize("edit, expected", [(e, x) for _, e, x in DOCUMENT_REFUSALS],
                         ids=[name for name, _, _ in DOCUMENT_REFUSALS])
def test_a_tampered_document_file_is_refused_by_load_document_and_the_criteria(asset_copy: Path, edit: Edit,
                                                                                 expected: str):
    _edit_document(asset_copy, "python-test-shlex", edit)
    with pytest.raises(Refused) as refused:
        load_document("python-test-shlex")
    message = str(refused.value)
    assert message.startswith("document model/documents/python-test-shlex.json: ") and "\n" not in message
    assert expected in message, message
    with pytest.raises(Refused, match="^document model/documents/python-test-shlex.json: "):
        load_controls_criteria()


def test_an_untampered_copy_loads_and_a_document_of_the_wrong_set_is_refused(asset_copy: Path):
    assert load_controls_criteria()[0].name == "e2-controls-v2"
    _edit_document(asset_copy, "prose-idle-news", _set("set", "calibration"))
    with pytest.raises(Refused, match=r"documents\[1\]\.name: model/documents/prose-idle-news.json is a calibration "
                                      r"document, expected a control document"):
        load_controls_criteria()


@pytest.mark.parametrize("name", ["", "../prompts/python-textwrap", "Python-Test-Shlex", "a/b", None, 3])
def test_load_document_refuses_a_name_that_is_not_a_document_name(name: Any):
    with pytest.raises(Refused, match=r"^document: name found .*, expected a document name"):
        load_document(name)


def test_load_document_refuses_a_document_with_no_file():
    with pytest.raises(Refused, match=r"^asset model/documents/python-test-nope.json: missing"):
        load_document("python-test-nope")

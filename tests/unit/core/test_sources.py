"""The shipped source texts (``model/sources``) are the ones every prompt and document was cut from:
each matches its record's ``source_sha256``, and the record's rule applied to the shipped copy
under the shipped tokenizer gives its committed token ids exactly, so a model with another
tokenizer can be given the same prompts by the same rule on any Python."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from qualify.core import assets
from qualify.core.errors import Refused

RECORDS = sorted({*assets.MODEL_DIR.glob("prompts/*.json"), *assets.MODEL_DIR.glob("documents/*.json")})


@pytest.fixture(scope="module")
def shipped_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(assets.MODEL_DIR / "tokenizer.json"))


@pytest.mark.parametrize("record", RECORDS, ids=lambda path: f"{path.parent.name}/{path.stem}")
def test_the_rule_on_the_shipped_source_gives_the_committed_tokens(record, shipped_tokenizer) -> None:
    document = json.loads(record.read_text(encoding="utf-8"))
    committed = document["token_ids"]
    assert document["rule"].startswith(f"the first {len(committed)} tokens of Lib/")
    rebuilt = shipped_tokenizer.encode(assets.source_text(document["name"])).ids[: len(committed)]
    assert rebuilt == committed
    assert assets.prompt_sha256(np.asarray(rebuilt)) == document.get("token_sha256", assets.prompt_sha256(
        np.asarray(committed)))


def test_every_record_has_its_source_and_no_source_is_orphaned() -> None:
    names = {record.stem for record in RECORDS}
    assert {path.stem for path in (assets.MODEL_DIR / "sources").glob("*.txt")} == names


def test_a_source_that_differs_from_its_record_is_refused(tmp_path, monkeypatch) -> None:
    name = "python-textwrap"
    original = assets.asset_path(f"{assets.SOURCES_DIR}/{name}.txt")
    edited = original.read_bytes().replace(b"textwrap", b"textwarp", 1)
    (tmp_path / "model" / "sources").mkdir(parents=True)
    (tmp_path / "model" / "sources" / f"{name}.txt").write_bytes(edited)
    (tmp_path / "model" / "prompts").mkdir()
    (tmp_path / "model" / "prompts" / f"{name}.json").write_text(
        (assets.MODEL_DIR / "prompts" / f"{name}.json").read_text(encoding="utf-8"), encoding="utf-8")
    monkeypatch.setattr(assets, "ASSET_ROOT", tmp_path)
    with pytest.raises(Refused, match=rf"model/sources/{name}.txt: sha256 [0-9a-f]{{64}}, expected "):
        assets.source_text(name)
    with pytest.raises(Refused, match="unknown name 'no-such-document'"):
        assets.source_text("no-such-document")

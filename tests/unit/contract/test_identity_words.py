"""The exact words of identity refusals, and the basis manifest read at its edges.

Checks that each refusal of an onboarding identity (loading, sealing, schema generation, the basis
receipt's manifest) names the right field and the right values, and that the manifest read refuses a
symbolic link, a FIFO and one byte over its size bound without blocking.
"""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from qualify.contract.identity import (
    BASIS_MANIFEST_MAX_BYTES,
    IDENTITY_SCHEMA_ID,
    Identity,
    check_basis_receipt,
    check_sealed,
    identity_json_schema,
    parse_identity_document,
)
from qualify.contract.lanes import LANES
from qualify.contract.rules import STATED_RULES
from qualify.core.digests import sha256_bytes
from qualify.core.errors import Refused
from tests.unit.contract.test_identity import BASIS_RUN_ID, BASIS_URI, digest, make_document, mutated

WHERE = "identity x"
ZERO = "0" * 64
LOADABLE = '"trust-ladder.onboarding-identity.v3", "trust-ladder.onboarding-identity.v4"'  # every version that loads


def parse_refusal(document: Any) -> str:
    with pytest.raises(Refused) as caught:
        parse_identity_document(document, where=WHERE)
    message = str(caught.value)
    assert "\n" not in message
    return message


# --- content rules: the field path, then the problem ---------------------------------------------


def test_an_unknown_lane_lists_every_known_lane_comma_separated() -> None:
    message = parse_refusal(mutated(make_document(), "lane", "no-such-lane"))
    head = f'{WHERE}: lane: found "no-such-lane", expected one of '
    assert message.startswith(head)
    assert message[len(head):].split(", ") == list(LANES)


@pytest.mark.parametrize("rule", ["bound_rule", "floor_rule"])
def test_an_unknown_rule_name_is_refused_at_the_name_listing_the_stated_rules(rule: str) -> None:
    document = mutated(make_document(), f"calibration.{rule}", {"name": "taste.v1", "statement": "by eye"})
    message = parse_refusal(document)
    head = f'{WHERE}: calibration.{rule}.name: found "taste.v1", expected one of '
    assert message.startswith(head)
    assert message[len(head):].split(", ") == list(STATED_RULES)
    assert len(STATED_RULES) > 1  # a single rule would let any separator pass


def test_a_refusal_of_the_whole_identity_is_the_problem_alone_without_a_path() -> None:
    # The native-lane draft rule runs on the whole document and names its own field in its words.
    draft = make_document("kquant-exact-dflash")["speculative_draft"]
    assert parse_refusal(mutated(make_document(), "speculative_draft", draft)) == (
        f"{WHERE}: lane nvfp4-native-splitk: speculative_draft: a native-mode lane cannot declare "
        "speculative-draft geometry; drop the draft, or route speculative serving to the kquant lane "
        "(kquant-exact-dflash)")


def test_a_prompt_token_mismatch_names_both_numbers() -> None:
    assert parse_refusal(mutated(make_document(), "prompt.tokens", 2047)) == (
        f"{WHERE}: prompt.tokens: found 2047, expected onboarding_qualification.prompt_tokens 2048")


def test_a_checkpoint_mixing_two_models_is_refused_showing_the_document_it_found() -> None:
    files = {"model/config.json": digest("config"), "models/foo/config.json": digest("weights")}
    message = parse_refusal(make_document(files=files))
    assert message.startswith(
        f"{WHERE}: (document): Value error, checkpoint: checkpoint.files: pins files of foo, the shipped model, "
        "expected one model's files, found "
        '{"schema": "trust-ladder.onboarding-identity.v3", "lane": "nvfp4-native-splitk", ')
    assert message.endswith("…")  # the document is shortened, never dumped whole


# --- the model used directly (no schema layer in front of it) ------------------------------------


def _model_errors(document: dict[str, Any]) -> list[Any]:
    with pytest.raises(ValidationError) as caught:
        Identity.model_validate_json(json.dumps(document), strict=True)
    return caught.value.errors(include_url=False)


def test_the_model_refuses_the_placeholder_digest_at_the_field_itself() -> None:
    error = _model_errors(mutated(make_document(), "tokenizer_sha256", ZERO))[0]
    assert error["type"] == "identity_rule"
    assert error["loc"] == ("tokenizer_sha256",)
    # An empty field: the problem is at the location, nothing below it.
    assert error["ctx"] == {"field": "", "problem": f'found the placeholder "{ZERO}", expected a real SHA-256'}


def test_the_model_message_is_the_field_path_then_the_problem() -> None:
    error = _model_errors(mutated(make_document(), "prompt.tokens", 2047))[0]
    assert error["msg"] == "prompt.tokens: found 2047, expected onboarding_qualification.prompt_tokens 2048"


# --- schema versions ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_retired_schema_is_refused_naming_the_version_to_refreeze_as(version: str) -> None:
    retired = f"trust-ladder.onboarding-identity.{version}"
    assert parse_refusal(mutated(make_document(), "schema", retired)) == (
        f'{WHERE}: schema: found "{retired}", a retired version whose bounds were sealed from the fixture '
        'itself; re-calibrate and re-freeze it as "trust-ladder.onboarding-identity.v3" (docs/calibration.md)')


@pytest.mark.parametrize(("value", "shown"), [("trust-ladder.onboarding-identity.v9", '"trust-ladder.onboarding-identity.v9"'),
                                              (["x"], '["x"]'), ({"v": 3}, '{"v": 3}')])
def test_an_unknown_schema_even_an_unhashable_one_is_refused_naming_it(value: Any, shown: str) -> None:
    assert parse_refusal(mutated(make_document(), "schema", value)) == (
        f"{WHERE}: schema: found {shown}, expected one of {LOADABLE}")


def test_generating_the_schema_of_an_unknown_version_is_refused_naming_both() -> None:
    with pytest.raises(Refused) as caught:
        identity_json_schema("trust-ladder.onboarding-identity.v2")
    assert str(caught.value) == (
        f'identity schema: found "trust-ladder.onboarding-identity.v2", expected one of {LOADABLE}')
    assert identity_json_schema(IDENTITY_SCHEMA_ID)["properties"]["schema"] == {
        "const": IDENTITY_SCHEMA_ID, "type": "string"}


# --- the seal -----------------------------------------------------------------------------------


def test_an_unsealed_lane_lists_every_sealed_lane_comma_separated() -> None:
    table = {"nvfp4-native-f16": digest("a"), "vllm-to-vllm": digest("b")}
    with pytest.raises(Refused) as caught:
        check_sealed(_identity(), WHERE, table)
    assert str(caught.value) == (
        f'{WHERE}: lane: found "nvfp4-native-splitk", sealed lanes: nvfp4-native-f16, vllm-to-vllm')


# --- the basis receipt's manifest ------------------------------------------------------------------


FIELD = "onboarding_qualification.basis"


def _identity(basis: str = BASIS_URI) -> Identity:
    return parse_identity_document(mutated(make_document(), FIELD, basis), where=WHERE)


def _receipt(tmp_path: Path) -> Path:
    receipt = tmp_path / "archive" / BASIS_RUN_ID
    receipt.mkdir(parents=True)
    return receipt


def _check(identity: Identity, tmp_path: Path, sealed: str, checked: list[Path] | None = None) -> Path:
    """The basis check with the archive layer stubbed: the URI resolves, every file verifies."""

    def resolve(uri: str, archive: Path) -> Path:
        return archive / "resolved"

    def verify(receipt: Path) -> tuple[list[str], int]:
        if checked is not None:
            checked.append(receipt)
        return [], 1

    return check_basis_receipt(identity, resolve, verify, where=WHERE, archive_dir=tmp_path / "archive",
                               sealed_basis_manifests={identity.seal_name: sealed})


def _unreadable(reason: str) -> str:
    return f"{WHERE}: {FIELD}: {BASIS_URI}: cannot read its receipt's manifest.json ({reason})"


def test_a_manifest_exactly_at_the_size_bound_is_read_whole(tmp_path: Path) -> None:
    data = b"m" * BASIS_MANIFEST_MAX_BYTES
    (_receipt(tmp_path) / "manifest.json").write_bytes(data)
    assert _check(_identity(), tmp_path, sha256_bytes(data)) == tmp_path / "archive" / "resolved"


def test_a_manifest_one_byte_over_the_size_bound_is_refused_naming_the_bound(tmp_path: Path) -> None:
    data = b"m" * (BASIS_MANIFEST_MAX_BYTES + 1)
    (_receipt(tmp_path) / "manifest.json").write_bytes(data)
    with pytest.raises(Refused) as caught:
        _check(_identity(), tmp_path, sha256_bytes(data))
    assert str(caught.value) == _unreadable("larger than 16777216 bytes")


def test_a_manifest_that_is_a_symbolic_link_is_never_followed(tmp_path: Path) -> None:
    # The link's target would even match the seal: only refusing to follow it stops it.
    target = tmp_path / "elsewhere.json"
    target.write_bytes(b"{}")
    (_receipt(tmp_path) / "manifest.json").symlink_to(target)
    with pytest.raises(Refused) as caught:
        _check(_identity(), tmp_path, sha256_bytes(b"{}"))
    assert str(caught.value) == _unreadable(os.strerror(errno.ELOOP))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")
def test_a_manifest_that_is_a_fifo_is_refused_at_once_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = _receipt(tmp_path) / "manifest.json"
    os.mkfifo(fifo)
    returned = threading.Event()
    rescued: list[bool] = []

    def rescue() -> None:
        # A blocking open of a FIFO waits for a writer: open one late, so a blocked read ends and shows.
        if returned.wait(2.0):
            return
        try:
            descriptor = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return
        rescued.append(True)
        os.close(descriptor)

    helper = threading.Thread(target=rescue, daemon=True)
    helper.start()
    try:
        with pytest.raises(Refused) as caught:
            _check(_identity(), tmp_path, digest("manifest"))
    finally:
        returned.set()
        helper.join()
    assert not rescued, "opening the manifest waited for a writer"
    assert str(caught.value) == _unreadable("not a regular file")


def test_the_receipt_is_named_by_the_first_segment_of_a_nested_basis_uri(tmp_path: Path) -> None:
    nested = f"receipt://{BASIS_RUN_ID}/samples/0.json"
    data = b"{}"
    (_receipt(tmp_path) / "manifest.json").write_bytes(data)
    checked: list[Path] = []
    _check(_identity(nested), tmp_path, sha256_bytes(data), checked)
    assert checked == [tmp_path / "archive" / BASIS_RUN_ID]
    with pytest.raises(Refused) as caught:
        _check(_identity(nested), tmp_path, digest("another"))
    assert str(caught.value) == (
        f"{WHERE}: {FIELD}: {nested}: receipt {BASIS_RUN_ID} file manifest.json sha256 found {sha256_bytes(data)}, "
        f"sealed {digest('another')} (lane nvfp4-native-splitk); its files differ from the calibration the rule "
        "was frozen from")


def test_an_identity_digest_of_no_identity_or_of_one_with_no_canonical_form_is_refused_in_one_line(monkeypatch):
    from qualify.contract import identity as identity_module
    from qualify.run.run_contract import identity_path_for_lane

    with pytest.raises(Refused) as refused:
        identity_module.identity_sha256({"lane": "x"})  # type: ignore[arg-type]
    assert str(refused.value) == "identity digest: found dict, expected Identity"
    identity = identity_module.load_identity(identity_path_for_lane("nvfp4-native-splitk"))

    def no_canonical_form(_document: object) -> str:
        raise ValueError("no canonical\nform")

    monkeypatch.setattr(identity_module, "document_sha256", no_canonical_form)
    with pytest.raises(Refused) as refused:
        identity_module.identity_sha256(identity)
    assert str(refused.value) == "identity nvfp4-native-splitk: no canonical form"

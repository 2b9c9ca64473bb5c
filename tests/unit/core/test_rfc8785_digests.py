"""RFC 8785 digests in the current schema versions, legacy digests for the old ones.

A v5 identity's digest is what a stock RFC 8785 library gives (``rfc8785.dumps``), so a verifier
in another language reproduces it; v1 and v2 identities are retired (refused at load, whatever
their seal), while the committed legacy receipts keep the old canonical form and the committed
signed ones RFC 8785; a document whose schema is neither is refused in one line. The wire manifest
v4 is MAC'd over its RFC 8785 bytes, and v3 is refused naming its schema.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
import rfc8785
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qualify.contract.identity import (
    IDENTITY_SCHEMA_ID,
    RETIRED_IDENTITY_SCHEMA_IDS,
    identity_sha256,
    load_identity,
    parse_identity_document,
)
from qualify.contract.sealed_data import SEALED_IDENTITIES
from qualify.core.assets import CONTRACTS_DIR, REPO_ROOT
from qualify.core.digests import (
    JCS_SCHEMAS,
    LEGACY_SCHEMAS,
    canonical_json_bytes,
    canonical_sha256,
    document_bytes,
    document_sha256,
    sha256_bytes,
)
from qualify.core.errors import HandoffRefused, Refused
from qualify.run.run_contract import CALIBRATION_SCHEMA
from tests.support.scripts import load_script
from tests.support.wire_mutants import RUN_KEY, pristine_expectation, pristine_handoff, pristine_kv, seal_pristine
from tests.unit.archive.test_receipts import committed_receipts
from tests.unit.contract.test_identity import make_pair

V1 = "trust-ladder.onboarding-identity.v1"
V2 = "trust-ladder.onboarding-identity.v2"
V3 = "trust-ladder.onboarding-identity.v3"
V5 = "trust-ladder.onboarding-identity.v5"
V6 = "trust-ladder.onboarding-identity.v6"
V7 = "trust-ladder.onboarding-identity.v7"
V8 = "trust-ladder.onboarding-identity.v8"
SHIPPED = sorted(CONTRACTS_DIR.glob("*-identity-v1.json"))
LEGACY_RECEIPTS, SIGNED_RECEIPTS = committed_receipts()


def retired_refusal(where: str, schema: str) -> str:
    """The one line a retired identity version is refused with."""
    return (f'{where}: schema: found "{schema}", a retired version whose bounds were sealed from the fixture '
            f'itself; re-calibrate and re-freeze it as "{V5}" (docs/calibration.md)')


# --- identities ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_a_shipped_v3_identity_digest_is_reproduced_by_a_stock_rfc8785_library(path: Path) -> None:
    document = json.loads(path.read_bytes())
    assert document["schema"] == V5 == IDENTITY_SCHEMA_ID
    stock = hashlib.sha256(rfc8785.dumps(document)).hexdigest()
    assert stock == SEALED_IDENTITIES[document["lane"]] == identity_sha256(load_identity(path))
    # The legacy form differs for every shipped identity (1e-06 / 0.000001, 10000.0 / 10000), which
    # is why the digest had to change form: a stock library could not reproduce the old one.
    assert canonical_json_bytes(document) != rfc8785.dumps(document)


def test_a_v3_identity_is_sealed_by_its_rfc8785_digest_never_its_legacy_form(tmp_path: Path) -> None:
    pair = make_pair(tmp_path)
    document = pair.document
    stock = hashlib.sha256(rfc8785.dumps(document)).hexdigest()
    identity = load_identity(pair.path, sealed_identities={"nvfp4-native-splitk": stock})
    assert identity.schema_id == V5 and identity_sha256(identity) == stock == document_sha256(document)
    assert canonical_sha256(document) != stock  # rope.theta 10000.0: "10000.0" legacy, "10000" RFC 8785
    # Sealed under the other form, the same document is refused: the form is part of the seal.
    with pytest.raises(Refused, match=", sealed "):
        load_identity(pair.path, sealed_identities={"nvfp4-native-splitk": canonical_sha256(document)})


@pytest.mark.parametrize("retired", [V1, V2])
def test_a_retired_identity_version_is_refused_at_load_whatever_its_seal(tmp_path: Path, retired: str) -> None:
    """A v1 or v2 document (no calibration set, no stated rule) is refused in one line naming its
    version, even with its own digest sealed; the digest function still computes the form the
    version declared (archived receipts hold such documents)."""
    assert RETIRED_IDENTITY_SCHEMA_IDS == (V1, V2)
    pair = make_pair(tmp_path)
    document = {key: value for key, value in pair.document.items() if key not in ("calibration", "controls")}
    document["schema"] = retired
    pair.write(document)
    legacy, stock = canonical_sha256(document), hashlib.sha256(rfc8785.dumps(document)).hexdigest()
    assert document_sha256(document) == (legacy if retired == V1 else stock) == sha256_bytes(document_bytes(document))
    for sealed in (legacy, stock):
        with pytest.raises(Refused) as caught:
            load_identity(pair.path, sealed_identities={"nvfp4-native-splitk": sealed})
        assert str(caught.value) == retired_refusal(f"identity {pair.path}", retired)
    with pytest.raises(Refused) as caught:
        parse_identity_document(document, where="identity (memory)")
    assert str(caught.value) == retired_refusal("identity (memory)", retired)


@pytest.mark.parametrize("path", SHIPPED[:3], ids=lambda p: p.name)
@pytest.mark.parametrize("retired", [V1, V2])
def test_a_shipped_identity_relabelled_retired_is_refused_in_one_line(path: Path, retired: str, tmp_path: Path) -> None:
    relabelled = tmp_path / path.name
    relabelled.write_text(json.dumps({**json.loads(path.read_bytes()), "schema": retired}), encoding="utf-8")
    with pytest.raises(Refused) as caught:
        load_identity(relabelled)
    assert str(caught.value) == retired_refusal(f"identity {relabelled}", retired)


@pytest.mark.parametrize("schema", ["trust-ladder.onboarding-identity.v9", "trust-ladder.onboarding-identity",
                                    "", 2, None])
def test_an_unknown_identity_schema_is_refused_in_one_line(tmp_path: Path, schema: object) -> None:
    pair = make_pair(tmp_path)
    pair.write({**pair.document, "schema": schema})
    with pytest.raises(Refused) as caught:
        pair.load()
    message = str(caught.value)
    assert message == f'identity {pair.path}: schema: found {json.dumps(schema)}, expected one of "{V5}", "{V6}", "{V7}", "{V8}"', message


def test_the_freeze_tool_refreezes_a_shipped_identity_to_itself_and_refuses_a_retired_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--refreeze writes the current schema: a copy of the shipped v5 file, whose artifacts have not
    moved, comes back byte for byte under its sealed digest; a v2 copy is refused in one line and
    left as it was (a retired identity is re-calibrated, never relabelled)."""
    freeze = load_script(REPO_ROOT / "tools" / "freeze_identity.py")
    shipped = CONTRACTS_DIR / "nvfp4-native-splitk-identity-v1.json"
    copy_path = tmp_path / shipped.name
    copy_path.write_bytes(shipped.read_bytes())
    assert freeze.main(["--refreeze", str(copy_path)]) == 0, capsys.readouterr().err
    assert copy_path.read_bytes() == shipped.read_bytes()
    assert SEALED_IDENTITIES["nvfp4-native-splitk"] in capsys.readouterr().out
    retired = tmp_path / "retired" / shipped.name
    retired.parent.mkdir()
    text = json.dumps({**json.loads(shipped.read_bytes()), "schema": V2}, indent=2) + "\n"
    retired.write_text(text, encoding="utf-8")
    assert freeze.main(["--refreeze", str(retired)]) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", f"freeze_identity: refused: {retired_refusal(f'identity {retired}', V2)}\n")
    assert retired.read_text(encoding="utf-8") == text


def test_the_freeze_tool_declares_a_link_floor_and_a_refreeze_keeps_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--link-floor-gbps writes v4 with the floor; a later --refreeze without it keeps both; a
    floor the schema refuses is refused in one line, the file left as it was."""
    freeze = load_script(REPO_ROOT / "tools" / "freeze_identity.py")
    shipped = CONTRACTS_DIR / "nvfp4-native-splitk-identity-v1.json"
    path = tmp_path / shipped.name
    path.write_bytes(shipped.read_bytes())
    assert freeze.main(["--refreeze", str(path), "--link-floor-gbps", "2.5"]) == 0, capsys.readouterr().err
    assert json.loads(path.read_bytes()) == {**json.loads(shipped.read_bytes()), "schema": V6,
                                             "link_floor": {"gbit_per_s_minimum": 2.5}}
    floored = path.read_bytes()
    assert freeze.main(["--refreeze", str(path)]) == 0, capsys.readouterr().err
    assert path.read_bytes() == floored
    capsys.readouterr()
    assert freeze.main(["--refreeze", str(path), "--link-floor-gbps", "0"]) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"freeze_identity: refused: identity {path}: link_floor.gbit_per_s_minimum: "
                            "found 0.0, expected a number > 0\n")
    assert path.read_bytes() == floored


# --- the one digest function, by declared schema ---------------------------------------------

JSON_LEAVES = (st.none() | st.booleans() | st.integers(min_value=-(2**53) + 1, max_value=2**53 - 1)
               | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
JSON_VALUES = st.recursive(JSON_LEAVES, lambda children: st.lists(children, max_size=3)
                           | st.dictionaries(st.text(max_size=6), children, max_size=3), max_leaves=12)


@settings(max_examples=300, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(body=st.dictionaries(st.text(max_size=8).filter(lambda key: key != "schema"), JSON_VALUES, max_size=5),
       schema=st.sampled_from(sorted(JCS_SCHEMAS | LEGACY_SCHEMAS)))
def test_document_sha256_takes_the_form_its_schema_declares(body: dict[str, Any], schema: str) -> None:
    document = {"schema": schema, **body}
    expected = rfc8785.dumps(document) if schema in JCS_SCHEMAS else canonical_json_bytes(document)
    assert document_bytes(document) == expected
    assert document_sha256(document) == hashlib.sha256(expected).hexdigest()


@pytest.mark.parametrize(("document", "found"), [
    ({"schema": "trust-ladder.onboarding-identity.v9", "lane": "x"}, "schema 'trust-ladder.onboarding-identity.v9'"),
    ({"lane": "x"}, "no schema"),
    ({"schema": ["x"]}, "schema ['x']"),
    ([1, 2], "no schema"),
    ({"schema": "x\ny"}, "schema 'x\\ny'"),
])
def test_an_undeclared_or_unknown_schema_is_refused_naming_it(document: object, found: str) -> None:
    with pytest.raises(ValueError) as caught:
        document_sha256(document)
    message = str(caught.value)
    assert message.startswith(f"document digest: found {found}, expected a hashed document's schema, one of ")
    assert "\n" not in message and V2 in message and V1 in message


def test_what_rfc8785_cannot_write_is_refused_naming_the_schema() -> None:
    for value in (2**53, -(2**53), math.nan, math.inf):
        with pytest.raises(ValueError, match=f"^document digest: schema {V2}: not RFC 8785 canonicalizable"):
            document_sha256({"schema": V2, "value": value})
    with pytest.raises(ValueError, match=f"^document digest: schema {V1}: not canonical JSON"):
        document_sha256({"schema": V1, "value": math.nan})


def test_a_calibration_document_is_digested_over_its_rfc8785_bytes() -> None:
    assert CALIBRATION_SCHEMA == "trust-ladder.calibration.v3" and CALIBRATION_SCHEMA in JCS_SCHEMAS
    document = {"schema": CALIBRATION_SCHEMA, "output_tokens": 256, "theta": 10000.0, "tolerance": 1e-06}
    assert document_sha256(document) == hashlib.sha256(b'{"output_tokens":256,"schema":"trust-ladder.calibration.v3",'
                                                       b'"theta":10000,"tolerance":0.000001}').hexdigest()


@pytest.mark.parametrize("receipt", LEGACY_RECEIPTS, ids=lambda p: p.name)
def test_a_committed_legacy_receipt_s_identity_digest_still_verifies(receipt: Path) -> None:
    """Every legacy receipt's ``identity.json`` declares a schema digested the legacy way, and its
    recorded ``identity.sha256`` is still what :func:`document_sha256` computes."""
    document = json.loads((receipt / "identity.json").read_bytes())
    assert document["schema"] in LEGACY_SCHEMAS
    assert document_sha256(document) == canonical_sha256(document)
    assert document_sha256(document) == (receipt / "identity.sha256").read_text(encoding="ascii").strip()


@pytest.mark.parametrize("receipt", SIGNED_RECEIPTS, ids=lambda p: p.name)
def test_a_committed_signed_receipt_s_identity_digest_is_its_rfc8785_digest(receipt: Path) -> None:
    """Every signed receipt's ``identity.json`` (a v3 calibration document or a v3 identity)
    declares an RFC 8785 schema, and its recorded ``identity.sha256`` is a stock library's digest."""
    document = json.loads((receipt / "identity.json").read_bytes())
    assert document["schema"] in {"trust-ladder.calibration.v3", V3} and document["schema"] in JCS_SCHEMAS
    assert hashlib.sha256(rfc8785.dumps(document)).hexdigest() == document_sha256(document) == \
        (receipt / "identity.sha256").read_text(encoding="ascii").strip()


def test_a_parsed_v3_identity_is_refused_when_its_typed_form_would_change_its_digest(tmp_path: Path) -> None:
    """RFC 8785 writes 11.0 as 11: the model still keeps the document's own types, so a bound
    written as an integer is refused, not silently digested like the float."""
    pair = make_pair(tmp_path)
    document = copy.deepcopy(pair.document)
    document["onboarding_qualification"]["full_logits"]["maximum_absolute"] = 11
    assert rfc8785.dumps(document) == rfc8785.dumps(pair.document)
    with pytest.raises(Refused, match="maximum_absolute: found 11, expected 11.0 \\(its typed form\\)"):
        parse_identity_document(document, where="identity (memory)")


# --- the wire manifest v4 --------------------------------------------------------------------


def _remac(manifest: bytes) -> Any:
    from qualify.handoff.wire import Handoff, manifest_mac

    return Handoff(manifest, manifest_mac(RUN_KEY, manifest), pristine_handoff().payload_bytes)


def _open(handoff: Any) -> Any:
    from qualify.handoff.wire import open_handoff

    return open_handoff(handoff, RUN_KEY, pristine_expectation())


def test_a_sealed_manifest_is_v4_and_its_own_rfc8785_bytes() -> None:
    from qualify.handoff.wire import MANIFEST_SCHEMA, manifest_mac

    sealed = seal_pristine().to_handoff()
    document = json.loads(sealed.manifest_bytes)
    assert document["schema"] == MANIFEST_SCHEMA == "trust-ladder.handoff-manifest.v4"
    assert rfc8785.dumps(document) == sealed.manifest_bytes  # what the MAC covers, stock-reproducible
    assert sealed.mac == manifest_mac(RUN_KEY, sealed.manifest_bytes)
    assert _open(sealed).manifest.schema == MANIFEST_SCHEMA


def test_a_v3_manifest_is_refused_in_one_line_naming_its_schema() -> None:
    document = json.loads(pristine_handoff().manifest_bytes)
    document["schema"] = "trust-ladder.handoff-manifest.v3"
    with pytest.raises(HandoffRefused) as caught:
        _open(_remac(canonical_json_bytes(document)))  # as a v3 producer wrote it, MAC'd with the run key
    assert caught.value.check == "manifest.schema"
    assert str(caught.value).startswith('handoff manifest: schema: found "trust-ladder.handoff-manifest.v3", '
                                        'expected "trust-ladder.handoff-manifest.v4"')
    assert "\n" not in str(caught.value)


def test_a_v4_manifest_in_the_legacy_canonical_form_is_refused_as_not_canonical() -> None:
    document = json.loads(pristine_handoff().manifest_bytes)
    document["timings"]["compute_s"] = 1e-05  # legacy "1e-05", RFC 8785 "0.00001"
    legacy = canonical_json_bytes(document)
    assert legacy != rfc8785.dumps(document)
    with pytest.raises(HandoffRefused) as caught:
        _open(_remac(legacy))
    assert caught.value.check == "manifest.canonical"
    assert _open(_remac(rfc8785.dumps(document))).manifest.compute_s == 1e-05


@pytest.mark.parametrize(("path", "token"), [
    ("payload.bytes", str(2**53)), ("handed_off_positions", str(2**63 - 1)), ("timings.digest_s", "9007199254740992"),
    ("timings.compute_s", "1e300"), ("geometry.head_dim", str(2**53 + 7)),
])
def test_a_number_past_2_53_is_refused_naming_the_field(path: str, token: str) -> None:
    document = json.loads(pristine_handoff().manifest_bytes)
    *parents, last = path.split(".")
    target = document
    for part in parents:
        target = target[part]
    target[last] = "@@number@@"
    manifest = rfc8785.dumps(document).replace(b'"@@number@@"', token.encode())
    with pytest.raises(HandoffRefused) as caught:
        _open(_remac(manifest))
    assert caught.value.check == "manifest.schema", str(caught.value)
    assert str(caught.value).startswith(f"handoff manifest: {path}: found "), str(caught.value)


def test_the_producer_refuses_a_time_rfc8785_cannot_carry_naming_it() -> None:
    from qualify.handoff.wire import seal_handoff_parts

    arguments = {"key": RUN_KEY, "identity_sha256": "a" * 64, "target_cache_identity": "b" * 64,
                 "producer_mode": "exact", "lane": "nvfp4-exact", "prompt_sha256": "c" * 64,
                 "run_id": "run", "request_id": "req"}
    refusal = "^handoff manifest: timings.compute_s: found 9007199254740992.0, expected a number <= 9007199254740991$"
    with pytest.raises(Refused, match=refusal):
        seal_handoff_parts(pristine_kv(), compute_s=2.0**53, **arguments)
    assert seal_handoff_parts(pristine_kv(), compute_s=2.0**53 - 1, **arguments).payload_size > 0

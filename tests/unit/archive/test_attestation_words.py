"""The signed statement's refusals, each in its own words: what is wrong and where, so an auditor
reading ``receipts verify`` can tell a malformed envelope from a bad signature from a statement
its own signer got wrong. The forgeries are built by hand (tests/support/receipt_forgery.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qualify.archive.attestation import (
    ENVELOPE,
    STATEMENT_TYPE,
    AttestationProblem,
    _strict_base64,
    read_attestation,
    sign_statement,
)
from qualify.archive.layout import SUMMARY
from qualify.core.errors import Refused
from tests.support.receipt_forgery import (
    envelope_of,
    forger_key,
    operator_key,
    operator_trust,
    signed_envelope,
    statement_of,
    writable_receipt,
    write_envelope,
)


@pytest.fixture
def receipt(tmp_path: Path) -> Path:
    """A genuine signed receipt, writable, whose envelope each test replaces."""
    return writable_receipt(tmp_path / "archive")


def problem(receipt: Path) -> AttestationProblem:
    """What ``read_attestation`` refuses ``receipt``'s envelope for, under the operator's trust."""
    with pytest.raises(AttestationProblem) as refusal:
        read_attestation(receipt, operator_trust())
    return refusal.value


def test_the_genuine_envelope_is_read(receipt):
    """The control: the untouched envelope gives its signer and the statement's subjects."""
    attestation = read_attestation(receipt, operator_trust())
    assert attestation.key_id == operator_key().key_id
    assert SUMMARY in attestation.subjects


def test_an_envelope_that_is_not_json_is_tampered_naming_the_parse_error(receipt):
    (receipt / ENVELOPE).write_bytes(b"{not json")
    found = problem(receipt)
    assert (found.kind, str(found)) == (
        "tampered", f"{ENVELOPE}: not JSON (Expecting property name enclosed in double quotes at line 1 column 2)")


def test_a_payload_with_stray_pad_bits_is_named_as_the_payload(receipt):
    """``AB==`` decodes to the byte ``AA==`` encodes: the check comes before the signature's."""
    envelope = envelope_of(receipt)
    envelope["payload"] = "AB=="
    write_envelope(receipt, envelope)
    found = problem(receipt)
    assert (found.kind, str(found)) == ("tampered", f"{ENVELOPE}: payload is not in canonical base64")


@pytest.mark.parametrize(("text", "words"), [
    ("AA\nAA", "is not standard base64"),  # a character outside the alphabet
    ("AA-_", "is not standard base64"),  # the URL-safe alphabet
    ("AAA", "is not standard base64"),  # missing padding
    ("AAAA=", "is not in canonical base64"),  # decodes, but not this spelling
])
def test_base64_other_than_its_one_spelling_is_refused_in_words_that_say_which(text, words):
    """The helper's own contract, which the envelope schema's pattern only partly repeats."""
    with pytest.raises(AttestationProblem) as refusal:
        _strict_base64(text, "payload")
    assert str(refusal.value) == f"{ENVELOPE}: payload {words}"


def test_a_signature_that_does_not_verify_names_the_claimed_key_by_its_first_16_digits(receipt):
    """The forger signs, claiming the operator's key id: tampered, naming the key claimed."""
    claimed = operator_key().key_id
    write_envelope(receipt, signed_envelope(statement_of(receipt), forger_key(), keyid=claimed))
    found = problem(receipt)
    assert found.kind == "tampered"
    assert str(found) == (f"{ENVELOPE}: the signature does not verify under key {claimed[:16]}… "
                          "(statement or envelope altered)")


def test_a_malformed_statement_signed_by_a_trusted_key_is_tampered_naming_the_statement(receipt):
    write_envelope(receipt, signed_envelope({"_type": STATEMENT_TYPE}, operator_key()))
    found = problem(receipt)
    assert (found.kind, str(found)) == ("tampered", f"{ENVELOPE} statement: subject: missing, expected this field")


def test_a_statement_naming_one_file_twice_is_tampered_naming_the_file(receipt):
    statement = statement_of(receipt)
    statement["subject"] = [*statement["subject"], statement["subject"][0]]
    write_envelope(receipt, signed_envelope(statement, operator_key()))
    name = statement["subject"][0]["name"]
    found = problem(receipt)
    assert (found.kind, str(found)) == ("tampered", f"{ENVELOPE}: statement names {name} twice")


def test_signing_a_statement_its_schema_refuses_is_refused_naming_the_receipt_statement():
    """The signer checks first: a receipt never carries a statement its verifier would refuse."""
    with pytest.raises(Refused) as refusal:
        sign_statement([(SUMMARY, "0" * 64)], {}, operator_key())  # a predicate without its schema
    assert str(refusal.value) == "receipt statement: predicate.schema: missing, expected this field"


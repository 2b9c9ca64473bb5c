"""Fuzzing the signed receipt: mutants of one genuine receipt (signed by the session's operator
key) are checked by ``authenticate_receipt`` against the operator's trust file. The oracle: a
mutant is accepted (state ``verified``) only when it is byte-identical to the original (a no-op
mutation, which must be accepted); every other one is refused (tampered or untrusted), with
one-line problems. Accepted non-identical mutants are counted (``accepted``) and must be 0.

Mutations, in four families:

* bytes of any file, the manifest, envelope and series included: flip, truncate, append, insert,
  overwrite; then optionally the manifest re-hashed (RFC 8785) and the whole receipt re-signed
  by the forger's own key;
* files: delete, add, rename, swap, replace by a symbolic link (to an identical copy or another
  file) or by a directory, an extra directory, the receipt directory renamed; re-hashed and
  re-signed likewise;
* the statement: decoded from the payload, any field or subject changed, deleted, added,
  duplicated or reordered, re-encoded (RFC 8785 or not) with the original signature, re-signed
  by the forger's key, or signed by it under the operator's key id;
* the envelope: payloadType, keyid, sig, extra fields, the signature list, whitespace and key
  order, non-canonical base64 (line breaks, no padding, URL-safe alphabet, stray pad bits).

A quarter of the mutants also go through ``verify_paths`` (the command's report): exit 0 only for
an accepted one, one labelled line per problem and a tally. Default tier: a few hundred mutants;
``slow`` tier: over 5,000 (each a fresh ``shutil.copytree`` of the template)."""

from __future__ import annotations

import base64
import io
import itertools
import json
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qualify.archive.attestation import ENVELOPE, PAYLOAD_TYPE
from qualify.archive.keys import SigningKey, TrustFile, ensure_signing_key
from qualify.archive.layout import MANIFEST, SUMMARY
from qualify.archive.verify import authenticate_receipt, verify_paths
from qualify.archive.writer import ReceiptWriter
from qualify.core.digests import jcs_bytes
from qualify.judge import judge_summary
from tests.support.receipt_forgery import (
    IDENTITY,
    RULE,
    forger_key,
    make_writable,
    operator_trust,
    pae,
    rehash_manifest,
    resign,
    statement_of,
)
from tests.unit.judge.test_judge import rung2_record

SERIES = "series/sample-1.safetensors"
FILES = ("command.log", "host.json", "identity.json", "identity.sha256", MANIFEST, "samples/sample-1.json",
         "samples/sample-2.json", "samples/sample-3.json", SERIES, SUMMARY, "versions.json", ENVELOPE)
"""Every file of the template receipt."""

TIERS = [pytest.param(1, id="fast"), pytest.param(20, id="slow", marks=pytest.mark.slow)]
"""Example-count multipliers: the four families' fast counts sum to 260, slow ones to 5,200."""

PAYLOADS = st.one_of(
    st.binary(min_size=1, max_size=16),
    st.sampled_from([b"\n", b" ", b"\x00", b"\xff", b"{}", b"[", b'"', b"\\", b"==", b"\xef\xbb\xbf", b"null",
                     b"1e400", b'{"a":' * 40]),
)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8) | st.sampled_from(["0" * 64, "passed", "failed", "refused", "incomplete", "../x"]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=6,
)


# --------------------------------------------------------------------------- the template


@dataclass(frozen=True)
class Template:
    """The genuine receipt every mutant starts from, what it holds, and whom to trust."""

    archive: Path
    receipt: Path
    snapshot: dict[str, tuple[object, ...]]
    trust: TrustFile
    forger: SigningKey
    operator_key_id: str
    scratch: Path
    counter: Callable[[], int]



def envelope_bytes(envelope: dict) -> bytes:
    """The mutant envelope as a forger writes it: RFC 8785 when it has a canonical form, else
    plain JSON (an integer beyond 2**53 has none; the verifier must refuse it either way)."""
    try:
        return jcs_bytes(envelope)
    except ValueError:
        return json.dumps(envelope, sort_keys=True, separators=(",", ":")).encode()

def snapshot(root: Path) -> dict[str, tuple[object, ...]]:
    """What a receipt directory holds, by relative path (its own name under ""): each file's
    bytes, each link's target, each directory; two receipts with equal snapshots are identical."""
    found: dict[str, tuple[object, ...]] = {"": ("name", root.name)}
    for current, directories, files in os.walk(root):
        for name in directories + files:
            path = Path(current) / name
            mode = path.lstat().st_mode
            key = path.relative_to(root).as_posix()
            if stat.S_ISLNK(mode):
                found[key] = ("link", os.readlink(path))
            elif stat.S_ISREG(mode):
                found[key] = ("file", path.read_bytes())
            else:
                found[key] = ("dir" if stat.S_ISDIR(mode) else "other",)
    return found


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    archive = tmp_path_factory.mktemp("template")
    ensure_signing_key(announce=lambda line: None)
    records = [rung2_record(i) for i in (1, 2, 3)]
    writer = ReceiptWriter(archive, command_line=["qualify", "--recipe", "native-text"], identity=IDENTITY,
                           recipe="native-text", lane="nvfp4-native-splitk", rule=RULE)
    for record in records:
        writer.add_sample(record)
    writer.add_series(1, {"logit_max_abs_delta": np.linspace(0.0, 1.0, 8), "handoff_tokens": np.arange(8)})
    receipt = writer.finalize(judge_summary(records, RULE))
    make_writable(receipt)  # copies keep the modes: writable mutants, removable scratch
    trust = operator_trust()
    checked = authenticate_receipt(receipt, trust)
    assert (checked.state, checked.problems) == ("verified", []), checked
    taken = snapshot(receipt)
    assert sorted(key for key, kind in taken.items() if kind[0] == "file") == sorted(FILES)
    numbers = itertools.count()
    return Template(archive, receipt, taken, trust, forger_key(), checked.key_id or "",
                    tmp_path_factory.mktemp("mutants"), lambda: next(numbers))


# --------------------------------------------------------------------------- mutations


@dataclass(frozen=True)
class Mutation:
    """One edit of a copy of the template; ``apply`` returns the receipt directory to check (a
    mutation may rename it). Its repr is what a failing example prints."""

    description: str
    apply: Callable[[Path, Template], Path]

    def __repr__(self) -> str:
        return self.description


def _edit_bytes(data: bytes, kind: str, position: int, mask: int, payload: bytes) -> bytes:
    at = position % (len(data) + 1)
    if kind == "flip":
        at = position % len(data)
        return data[:at] + bytes([data[at] ^ mask]) + data[at + 1:]
    if kind == "truncate":
        return data[:at]
    if kind == "append":
        return data + payload
    if kind == "insert":
        return data[:at] + payload + data[at:]
    return data[:at] + payload + data[at + len(payload):]  # overwrite


def outside(receipt: Path) -> Path:
    """A directory beside the mutant's archive (never inside it), for what a mutant links to."""
    place = receipt.parent
    found = place.with_name(f"{place.name}-outside")
    found.mkdir(exist_ok=True)
    return found


def _finish(receipt: Path, template: Template, then: str) -> Path:
    """What the forger does after the edit: nothing, re-hash the manifest, or re-hash and re-sign
    a statement over the files as they now are with their own key (not through a manifest or an
    envelope the edit made a link or a directory)."""
    for written in (receipt / MANIFEST, receipt / ENVELOPE):
        if os.path.lexists(written) and not stat.S_ISREG(written.lstat().st_mode):
            then = "none"
    if then in ("rehash", "resign"):
        rehash_manifest(receipt)
    if then == "resign":
        resign(receipt, template.forger, _template_predicate(template))
    return receipt


def _template_predicate(template: Template) -> dict[str, Any]:
    predicate: dict[str, Any] = statement_of(template.receipt)["predicate"]
    return predicate


THEN = st.sampled_from(["none", "none", "rehash", "resign"])


@st.composite
def byte_mutations(draw: st.DrawFn) -> Mutation:
    name = draw(st.sampled_from(FILES))
    kind = draw(st.sampled_from(["flip", "flip", "truncate", "append", "insert", "overwrite"]))
    position, mask = draw(st.integers(0, 1 << 16)), draw(st.integers(1, 255))
    payload, then = draw(PAYLOADS), draw(THEN)
    if name in (MANIFEST, ENVELOPE):
        then = "none"  # re-hashing or re-signing would overwrite the edit itself

    def apply(receipt: Path, template: Template) -> Path:
        path = receipt / name
        path.write_bytes(_edit_bytes(path.read_bytes(), kind, position, mask, payload))
        return _finish(receipt, template, then)

    return Mutation(f"{name}: {kind} at {position} mask {mask} payload {payload[:16]!r}, then {then}", apply)


NEW_NAMES = ("notes.txt", "samples/sample-4.json", ".hidden", "series/sample-2.safetensors",
             "samples/extra/deep.json", f"{ENVELOPE}.bak", "attestation.json", "series/.x", "manifest.json.orig")
FILE_KINDS = ("delete", "add_new", "add_copy", "rename", "swap", "symlink_copy", "symlink_inside", "directory",
              "extra_directory", "samples_symlink", "rename_receipt", "empty")


@st.composite
def file_mutations(draw: st.DrawFn) -> Mutation:
    kind = draw(st.sampled_from(FILE_KINDS))
    name, other = draw(st.sampled_from(FILES)), draw(st.sampled_from(FILES))
    new = draw(st.sampled_from(NEW_NAMES))
    payload, then = draw(PAYLOADS), draw(THEN)

    def apply(receipt: Path, template: Template) -> Path:
        path = receipt / name
        if kind == "delete":
            path.unlink()
        elif kind in ("add_new", "add_copy"):
            (receipt / new).parent.mkdir(parents=True, exist_ok=True)
            (receipt / new).write_bytes(payload if kind == "add_new" else path.read_bytes())
        elif kind == "rename":
            (receipt / new).parent.mkdir(parents=True, exist_ok=True)
            path.rename(receipt / new)
        elif kind == "swap":
            first, second = path.read_bytes(), (receipt / other).read_bytes()
            path.write_bytes(second)
            (receipt / other).write_bytes(first)
        elif kind == "symlink_copy":  # an identical copy outside the receipt: only the link is wrong
            copy = outside(receipt) / f"copy-of-{path.name}"
            shutil.copyfile(path, copy)
            path.unlink()
            path.symlink_to(copy)
        elif kind == "symlink_inside":
            path.unlink()
            path.symlink_to(receipt / other)
        elif kind == "directory":
            data = path.read_bytes()
            path.unlink()
            path.mkdir()
            (path / "inside").write_bytes(data)
        elif kind == "extra_directory":
            (receipt / new).parent.mkdir(parents=True, exist_ok=True)
            (receipt / new).mkdir()
        elif kind == "samples_symlink":
            moved = outside(receipt) / "moved-samples"
            (receipt / "samples").rename(moved)
            (receipt / "samples").symlink_to(moved, target_is_directory=True)
        elif kind == "rename_receipt":
            renamed = receipt.with_name(receipt.name[:-1] + ("0" if receipt.name[-1] != "0" else "1"))
            receipt.rename(renamed)
            receipt = renamed
        else:  # empty
            path.write_bytes(b"")
        return _finish(receipt, template, then)

    return Mutation(f"{kind}: {name} / {other} / {new}, payload {payload[:16]!r}, then {then}", apply)


def _json_paths(document: Any, prefix: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    found = [prefix]
    if isinstance(document, dict):
        for key, value in document.items():
            found.extend(_json_paths(value, (*prefix, key)))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            found.extend(_json_paths(value, (*prefix, index)))
    return found


def _encode(document: Any, canonical: bool) -> bytes:
    """A statement's payload bytes: RFC 8785 (falling back, for what it refuses, to the compact
    sorted form), or an indented non-canonical form."""
    if canonical:
        try:
            return jcs_bytes(document)
        except ValueError:
            return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    return json.dumps(document, indent=1).encode()


def _edit_json(document: Any, path: tuple[str | int, ...], op: str, value: Any) -> Any:
    """``document`` with the value at ``path`` replaced, deleted, duplicated or given a sibling."""
    if not path:
        return value if op == "replace" else document
    parent = document
    for part in path[:-1]:
        parent = parent[part]
    last = path[-1]
    if op == "replace":
        parent[last] = value
    elif op == "delete":
        del parent[last]
    elif op == "add":
        if isinstance(parent, dict):
            parent[f"{last}_"] = value
        else:
            parent.append(value)
    elif op == "duplicate" and isinstance(parent, list):
        parent.append(parent[last])
    elif op == "reverse" and isinstance(parent, list):
        parent.reverse()
    return document


@st.composite
def statement_mutations(draw: st.DrawFn) -> Mutation:
    target = draw(st.integers(0, 1 << 16))
    op = draw(st.sampled_from(["replace", "replace", "replace", "delete", "add", "duplicate", "reverse", "subject"]))
    value = draw(JSON_VALUES)
    subject_edit = draw(st.sampled_from(["digest_of_other", "name_of_other", "drop", "zero_digest", "upper"]))
    which, other = draw(st.integers(0, 63)), draw(st.integers(0, 63))
    canonical = draw(st.booleans())
    sign = draw(st.sampled_from(["keep", "forger", "forger_claims_operator"]))

    def apply(receipt: Path, template: Template) -> Path:
        envelope = json.loads((receipt / ENVELOPE).read_bytes())
        statement = json.loads(base64.b64decode(envelope["payload"]))
        if op == "subject":
            subjects = statement["subject"]
            chosen, donor = subjects[which % len(subjects)], subjects[other % len(subjects)]
            if subject_edit == "digest_of_other":
                chosen["digest"] = dict(donor["digest"])
            elif subject_edit == "name_of_other":
                chosen["name"] = donor["name"]
            elif subject_edit == "drop":
                subjects.remove(chosen)
            elif subject_edit == "zero_digest":
                chosen["digest"]["sha256"] = "0" * 64
            else:
                chosen["digest"]["sha256"] = chosen["digest"]["sha256"].upper()
        else:
            paths = _json_paths(statement)
            statement = _edit_json(statement, paths[target % len(paths)], op, value)
        payload = _encode(statement, canonical)
        if sign == "keep":
            envelope["payload"] = base64.b64encode(payload).decode("ascii")
        else:
            keyid = template.operator_key_id if sign == "forger_claims_operator" else template.forger.key_id
            signature = template.forger.sign(pae(PAYLOAD_TYPE, payload))
            envelope = {"payload": base64.b64encode(payload).decode("ascii"), "payloadType": PAYLOAD_TYPE,
                        "signatures": [{"keyid": keyid, "sig": base64.b64encode(signature).decode("ascii")}]}
        (receipt / ENVELOPE).write_bytes(envelope_bytes(envelope))
        return receipt

    detail = f"subject {subject_edit} {which}/{other}" if op == "subject" else f"path #{target} := {value!r}"
    return Mutation(f"statement {op} {detail}, {'RFC 8785' if canonical else 'indented'}, sig {sign}", apply)


ENVELOPE_KINDS = ("payload_type", "keyid", "sig_flip", "sig_zero", "sig_short", "extra_top", "extra_signature",
                  "signatures_empty", "signatures_twice", "signatures_forger_first", "signatures_forger_last",
                  "whitespace", "key_order", "escaped_payload", "base64_newline", "base64_unpadded",
                  "base64_urlsafe", "base64_pad_bits", "not_a_string", "signatures_object")


def _sig_bytes(envelope: dict[str, Any]) -> bytes:
    return base64.b64decode(envelope["signatures"][0]["sig"])


@st.composite
def envelope_mutations(draw: st.DrawFn) -> Mutation:
    kind = draw(st.sampled_from(ENVELOPE_KINDS))
    field = draw(st.sampled_from(["payload", "sig"]))
    position, mask = draw(st.integers(0, 1 << 12)), draw(st.integers(1, 255))
    text = draw(st.sampled_from(["application/vnd.in-toto+json ", "application/vnd.in-toto+JSON", "application/json",
                                 "", "application/vnd.in-toto+json\u0000", "application/vnd.dsse.envelope.v1+json"]))
    value = draw(JSON_VALUES)
    indent = draw(st.sampled_from([None, 0, 1, 2]))

    def apply(receipt: Path, template: Template) -> Path:
        envelope: dict[str, Any] = json.loads((receipt / ENVELOPE).read_bytes())
        signature = envelope["signatures"][0]
        payload = base64.b64decode(envelope["payload"])
        forged = {"keyid": template.forger.key_id,
                  "sig": base64.b64encode(template.forger.sign(pae(PAYLOAD_TYPE, payload))).decode("ascii")}
        data: bytes | None = None
        if kind == "payload_type":
            envelope["payloadType"] = text
        elif kind == "keyid":
            keyid = signature["keyid"]
            at = position % len(keyid)
            signature["keyid"] = [template.forger.key_id, keyid.upper(), keyid[:-1],
                                  keyid[:at] + format(int(keyid[at], 16) ^ (mask & 15 or 1), "x") + keyid[at + 1:]
                                  ][mask % 4]
        elif kind == "sig_flip":
            raw = bytearray(_sig_bytes(envelope))
            raw[position % len(raw)] ^= mask
            signature["sig"] = base64.b64encode(bytes(raw)).decode("ascii")
        elif kind == "sig_zero":
            signature["sig"] = base64.b64encode(bytes(64)).decode("ascii")
        elif kind == "sig_short":
            signature["sig"] = base64.b64encode(_sig_bytes(envelope)[:position % 64]).decode("ascii")
        elif kind == "extra_top":
            envelope[["extra", "signature", "payload_type", "payloadtype"][mask % 4]] = value
        elif kind == "extra_signature":
            signature[["cert", "public_key", "keyId", "sig "][mask % 4]] = value
        elif kind == "signatures_empty":
            envelope["signatures"] = []
        elif kind == "signatures_twice":
            envelope["signatures"] = [signature, dict(signature)]
        elif kind == "signatures_forger_first":
            envelope["signatures"] = [forged, signature]
        elif kind == "signatures_forger_last":
            envelope["signatures"] = [signature, forged]
        elif kind == "whitespace":
            data = (json.dumps(envelope, sort_keys=True, indent=indent) + ["\n", " ", "", "\r\n"][mask % 4]).encode()
        elif kind == "key_order":
            data = json.dumps(dict(reversed(list(envelope.items()))), separators=(",", ":")).encode()
        elif kind == "escaped_payload":  # the same string, one character written as a \\u escape
            encoded = jcs_bytes(envelope)
            start = encoded.index(b'"payload":"') + len(b'"payload":"')
            at = start + position % len(envelope["payload"])
            data = encoded[:at] + b"\\u%04x" % encoded[at] + encoded[at + 1:]
        elif kind == "base64_newline":
            at = position % len(envelope[field] if field == "payload" else signature["sig"])
            holder = envelope if field == "payload" else signature
            key = "payload" if field == "payload" else "sig"
            holder[key] = holder[key][:at] + "\n" + holder[key][at:]
        elif kind == "base64_unpadded":
            holder = envelope if field == "payload" else signature
            key = "payload" if field == "payload" else "sig"
            holder[key] = holder[key].rstrip("=")
        elif kind == "base64_urlsafe":
            holder = envelope if field == "payload" else signature
            key = "payload" if field == "payload" else "sig"
            holder[key] = holder[key].replace("+", "-").replace("/", "_")
        elif kind == "base64_pad_bits":  # the last character before the padding, its unused bits set
            holder = envelope if field == "payload" else signature
            key = "payload" if field == "payload" else "sig"
            encoded_text = holder[key]
            body = encoded_text.rstrip("=")
            if len(body) != len(encoded_text):
                alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
                spare = 0b1111 if len(encoded_text) - len(body) == 2 else 0b11
                last = alphabet.index(body[-1]) | (mask & spare or 1)
                holder[key] = body[:-1] + alphabet[last] + encoded_text[len(body):]
        elif kind == "not_a_string":
            envelope[["payload", "payloadType"][mask % 2]] = value if not isinstance(value, str) else 4
        else:  # signatures_object
            envelope["signatures"] = signature
        (receipt / ENVELOPE).write_bytes(data if data is not None else envelope_bytes(envelope))
        return receipt

    return Mutation(f"envelope {kind} ({field}, {position}, {mask}, {text!r}, {value!r}, indent {indent})", apply)


# --------------------------------------------------------------------------- the property


def check_mutant(template: Template, tally: Any, mutation: Mutation, report: bool) -> None:
    """A fresh copy of the template, ``mutation`` applied: verified if and only if identical."""
    place = template.scratch / f"m{template.counter()}"
    shutil.copytree(template.archive, place, symlinks=True)
    try:
        receipt = mutation.apply(place / template.receipt.name, template)
        identical = snapshot(receipt) == template.snapshot
        checked = authenticate_receipt(receipt, template.trust)
        tally.add("examples")
        tally.add("identical" if identical else f"state_{checked.state}")
        if checked.state == "verified" and not identical:
            tally.add("accepted")
        if any("cannot check" in problem for problem in checked.problems):
            tally.add("cannot_check")  # a caught surprise: still refused, but every problem should have a name
        assert (checked.state == "verified") is identical, (mutation, checked)
        assert checked.state in ("verified", "tampered", "untrusted"), (mutation, checked)
        assert identical or checked.problems, (mutation, checked)
        for problem in checked.problems:
            assert problem and "\n" not in problem and "\r" not in problem and "Traceback" not in problem, problem
        if report:  # the archive holding it (a receipt path whose manifest is gone is taken for an archive)
            out = io.StringIO()
            code = verify_paths([place], template.trust, out)
            lines = out.getvalue().splitlines()
            tally.add(f"report_exit_{code}")
            assert code == (0 if identical else 1), (mutation, lines)
            label = {"verified": "ok       ", "tampered": "TAMPERED ", "untrusted": "UNTRUSTED"}[checked.state]
            assert all(line.startswith(f"{label} {checked.name}: ") for line in lines[:-1]), lines
            assert len(lines) - 1 == (1 if identical else len(checked.problems)), lines
            assert lines[-1] == ("1 receipts: 1 verified (1 passed)" if identical
                                 else f"1 receipts: 0 verified, 1 {checked.state}"), lines
    finally:
        shutil.rmtree(place)
        shutil.rmtree(place.with_name(f"{place.name}-outside"), ignore_errors=True)


def fuzz(template: Template, tally: Any, mutations: st.SearchStrategy[Mutation], examples: int) -> None:
    @settings(max_examples=examples, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(mutation=mutations, report=st.sampled_from([False, False, False, True]))
    def run(mutation: Mutation, report: bool) -> None:
        check_mutant(template, tally, mutation, report)

    run()
    assert tally.counts.get("accepted", 0) == 0
    assert tally.counts["examples"] >= examples, tally.counts  # the count quoted is the count run


def test_the_template_itself_is_verified_and_a_copy_is_identical(template, fuzz_tally):
    """The oracle's other half: an untouched copy is identical and verified (so a verifier that
    refused everything would fail here, not pass the fuzz)."""
    check_mutant(template, fuzz_tally, Mutation("no-op", lambda receipt, template: receipt), report=True)
    assert fuzz_tally.counts == {"examples": 1, "identical": 1, "report_exit_0": 1}


@pytest.mark.parametrize("tier", TIERS)
def test_byte_mutations_of_any_file_are_never_verified(template, fuzz_tally, tier):
    fuzz(template, fuzz_tally, byte_mutations(), 80 * tier)


@pytest.mark.parametrize("tier", TIERS)
def test_file_mutations_are_never_verified(template, fuzz_tally, tier):
    fuzz(template, fuzz_tally, file_mutations(), 60 * tier)


@pytest.mark.parametrize("tier", TIERS)
def test_statement_mutations_are_never_verified(template, fuzz_tally, tier):
    fuzz(template, fuzz_tally, statement_mutations(), 60 * tier)


@pytest.mark.parametrize("tier", TIERS)
def test_envelope_mutations_are_never_verified(template, fuzz_tally, tier):
    fuzz(template, fuzz_tally, envelope_mutations(), 60 * tier)

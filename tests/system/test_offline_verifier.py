"""tools/verify_receipt_offline.py: an auditor verifies a signed receipt with the standard library
and ``cryptography`` alone, and reaches the harness's own conclusion (``qualify receipts verify``)."""

from __future__ import annotations

import ast
import base64
import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qualify.archive.keys import init_key, load_trust, rotate_key
from qualify.archive.verify import authenticate_receipt
from qualify.core.assets import REPO_ROOT
from qualify.interfaces.keys_command import keys_cli
from tests.support.scripts import load_script as load_script_at
from tests.unit.archive.test_receipts import as_v2_receipt, make_writable
from tests.unit.contract.test_receipt_schemas import fresh_receipt

SCRIPT = REPO_ROOT / "tools" / "verify_receipt_offline.py"
DOC = REPO_ROOT / "docs" / "receipts.md"
ENVELOPE = "attestation.dsse.json"


def run_script(*args: object) -> tuple[int, list[str], str]:
    """The script as an auditor runs it: its own process, this interpreter."""
    done = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout.splitlines(), done.stderr


def load_script() -> ModuleType:
    return load_script_at(SCRIPT)


def in_process(module: ModuleType, trust: Path, receipt: Path) -> tuple[int, list[str]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = module.main(["--trust", str(trust), str(receipt)])
    return code, out.getvalue().splitlines()


def harness_state(trust: Path, receipt: Path) -> str:
    return authenticate_receipt(receipt, load_trust(trust)).state


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A fresh receipt signed with the session's key, and the trust file ``qualify keys show
    --trust-file`` prints for that key (what an auditor is handed)."""
    root = tmp_path_factory.mktemp("offline")
    receipt = fresh_receipt(root / "archive")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert keys_cli(["show", "--trust-file"]) == 0
    trust = root / "trust.json"
    trust.write_text(out.getvalue(), encoding="utf-8")
    return receipt, trust


def editable_copy(receipt: Path, destination: Path) -> Path:
    copy = destination / receipt.name
    shutil.copytree(receipt, copy)
    make_writable(copy)
    return copy


def test_a_fresh_receipt_verifies_offline(signed):
    receipt, trust = signed
    code, lines, stderr = run_script("--trust", trust, receipt)
    assert (code, stderr) == (0, ""), lines
    (line,) = lines
    assert line.startswith(f"verified {receipt.name}: status failed, lane nvfp4-native-splitk, verdict failed: ")
    assert line.endswith("; 12 files")  # the envelope aside
    assert harness_state(trust, receipt) == "verified"


def test_a_scoped_receipt_verifies_offline_its_verdict_stating_its_scope(signed, tmp_path):
    """The verdict the script prints is the signed one, which opens with the scope line: a v3
    receipt needs nothing new of the script (the summary is one more signed file to it)."""
    _, trust = signed
    receipt = fresh_receipt(tmp_path / "archive", scope=True)
    summary = json.loads((receipt / "validation-summary.json").read_bytes())
    keyid = json.loads((receipt / ENVELOPE).read_bytes())["signatures"][0]["keyid"]
    code, lines, stderr = run_script("--trust", trust, receipt)
    assert (code, stderr) == (0, ""), lines
    assert lines == [f"verified {receipt.name}: status failed, lane nvfp4-native-splitk, verdict "
                     f"{summary['verdict']}; signed by key {keyid[:16]}; 12 files"]
    assert lines[0].count("NOT QUALIFIED on " + summary["scope"]["fixture_words"]) == 1
    assert lines[0].count(summary["scope"]["controls_words"]) == 1
    assert harness_state(trust, receipt) == "verified"


def test_a_v2_receipt_still_verifies_offline(signed, tmp_path):
    _, trust = signed
    receipt = as_v2_receipt(fresh_receipt(tmp_path / "archive", scope=True))
    assert "scope" not in json.loads((receipt / "validation-summary.json").read_bytes())
    code, lines, _ = run_script("--trust", trust, receipt)
    assert code == 0 and lines[0].startswith(f"verified {receipt.name}: status failed"), lines
    assert harness_state(trust, receipt) == "verified"


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _resign_payload(receipt: Path) -> None:
    """Edit the signed statement's conclusion without the key: the signature no longer covers it."""
    envelope = json.loads((receipt / ENVELOPE).read_bytes())
    statement = json.loads(base64.b64decode(envelope["payload"]))
    statement["predicate"]["status"] = "passed"
    envelope["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    (receipt / ENVELOPE).write_text(json.dumps(envelope), encoding="utf-8")


EDITS = {
    "a sample's byte flipped": (lambda r: _flip(r / "samples" / "sample-2.json"), "samples/sample-2.json: altered"),
    "the summary rewritten": (lambda r: (r / "validation-summary.json").write_text("{}"), "validation-summary.json: altered"),
    "a series deleted": (lambda r: (r / "series" / "sample-1.safetensors").unlink(), "series/sample-1.safetensors: a subject"),
    "a file added": (lambda r: (r / "samples" / "sample-4.json").write_text("{}"), "samples/sample-4.json: altered or added"),
    "the statement edited": (_resign_payload, f"{ENVELOPE}: the signature does not verify"),
    "the signature replaced": (lambda r: (r / ENVELOPE).write_text((r / ENVELOPE).read_text().replace(
        json.loads((r / ENVELOPE).read_text())["signatures"][0]["sig"], base64.b64encode(bytes(64)).decode())),
        f"{ENVELOPE}: the signature does not verify"),
    "the envelope deleted": (lambda r: (r / ENVELOPE).unlink(), f"no {ENVELOPE}"),
    "the envelope not JSON": (lambda r: (r / ENVELOPE).write_text("{"), "unreadable or malformed input (JSONDecodeError"),
    "a file replaced by a link": (lambda r: ((r / "host.json").unlink(), (r / "host.json").symlink_to(r / "versions.json")),
                                  "host.json: not a regular file"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_receipt_does_not_verify_offline(signed, tmp_path, edit):
    receipt, trust = signed
    copy = editable_copy(receipt, tmp_path)
    change, expected = EDITS[edit]
    change(copy)
    code, lines, stderr = run_script("--trust", trust, copy)
    assert (code, stderr, len(lines)) == (1, "", 1), lines
    assert lines[0].startswith(f"NOT VERIFIED {copy.name}: {expected}"), lines
    assert harness_state(trust, copy) != "verified"


def test_a_renamed_receipt_does_not_verify_offline(signed, tmp_path):
    receipt, trust = signed
    copy = editable_copy(receipt, tmp_path)
    renamed = copy.rename(copy.with_name("20990101T000000Z-0000000000000000"))
    code, lines, _ = run_script("--trust", trust, renamed)
    assert code == 1 and lines == [f"NOT VERIFIED {renamed.name}: signed statement: repeats a subject, or names run "
                                   f"{receipt.name}"]
    assert harness_state(trust, renamed) != "verified"


def test_a_link_to_a_receipt_is_not_followed_offline(signed, tmp_path):
    """A failing run's name linked to a passing receipt must not read as that name verified: the
    script verifies a receipt at its own path, never through a link (as ``receipts verify``)."""
    receipt, trust = signed
    link = tmp_path / "20990101T000000Z-0000000000000000"
    link.symlink_to(receipt, target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    same_name = tmp_path / "elsewhere" / receipt.name  # a link whose name is its target's run id
    same_name.symlink_to(receipt, target_is_directory=True)
    for path in (link, same_name):
        code, lines, _ = run_script("--trust", trust, path)
        assert code == 1 and len(lines) == 1 and lines[0].startswith(f"NOT VERIFIED {path.name}: "), lines
    assert run_script("--trust", trust, receipt)[0] == 0


def test_a_receipt_signed_by_an_untrusted_key_does_not_verify_offline(signed, tmp_path):
    _, trust = signed
    stranger = init_key(tmp_path / "stranger-config")
    receipt = fresh_receipt(tmp_path / "archive", signing_key=stranger)
    code, lines, _ = run_script("--trust", trust, receipt)
    assert (code, lines) == (1, [f"NOT VERIFIED {receipt.name}: signed by key {stranger.key_id[:16]}, which the trust "
                                 f"file does not list"])
    assert harness_state(trust, receipt) == "untrusted"
    # The stranger's own trust file trusts the stranger: a trust file is only as good as its source.
    assert run_script("--trust", tmp_path / "stranger-config" / "trust.json", receipt)[0] == 0


def test_a_receipt_signed_by_a_rotated_out_key_no_longer_verifies_offline(tmp_path):
    config = tmp_path / "config"
    old = init_key(config)
    before = fresh_receipt(tmp_path / "archive", signing_key=old)
    assert run_script("--trust", config / "trust.json", before)[0] == 0
    new, _ = rotate_key("laptop lost", config)
    code, lines, _ = run_script("--trust", config / "trust.json", before)
    assert (code, lines) == (1, [f"NOT VERIFIED {before.name}: signed by key {old.key_id[:16]}, which the trust file "
                                 f"revoked (laptop lost)"])
    after = fresh_receipt(tmp_path / "archive", signing_key=new)
    assert run_script("--trust", config / "trust.json", after)[0] == 0


def test_a_trust_file_whose_key_id_is_not_its_keys_digest_is_refused(signed, tmp_path):
    receipt, trust = signed
    document = json.loads(trust.read_bytes())
    document["keys"][0]["public_key"] = "00" * 32
    forged = tmp_path / "trust.json"
    forged.write_text(json.dumps(document), encoding="utf-8")
    code, lines, _ = run_script("--trust", forged, receipt)
    assert code == 1 and lines[0].endswith("is not the SHA-256 of its public key")


def test_a_legacy_unsigned_receipt_does_not_verify_offline(signed):
    _, trust = signed
    legacy = sorted(path for path in (REPO_ROOT / "receipts").iterdir() if path.is_dir())[0]
    code, lines, _ = run_script("--trust", trust, legacy)
    assert (code, lines) == (1, [f"NOT VERIFIED {legacy.name}: no {ENVELOPE}: not a receipt, or an unsigned (legacy) one"])


@pytest.mark.parametrize("args", [[], ["--trust"], ["--trust", "t.json"], ["t.json", "receipt"], ["--trust", "t", "r", "x"]])
def test_bad_usage_exits_2(args):
    code, lines, stderr = run_script(*args)
    assert (code, lines) == (2, []) and stderr.startswith("usage: verify_receipt_offline.py --trust TRUST.json RECEIPT_DIR")


@settings(derandomize=True, max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_any_single_byte_change_to_any_file_fails_offline_as_in_the_harness(signed, tmp_path_factory, data, fuzz_tally):
    receipt, trust = signed
    module = load_script()
    copy = editable_copy(receipt, tmp_path_factory.mktemp("flip"))
    files = sorted(path for path in copy.rglob("*") if path.is_file())
    target = data.draw(st.sampled_from(files))
    content = bytearray(target.read_bytes())
    content[data.draw(st.integers(0, len(content) - 1))] ^= data.draw(st.integers(1, 255))
    target.write_bytes(bytes(content))
    code, lines = in_process(module, trust, copy)
    fuzz_tally.add("examples")
    fuzz_tally.add("refused" if code == 1 else "accepted")
    assert code == 1 and len(lines) == 1 and lines[0].startswith("NOT VERIFIED "), lines
    assert harness_state(trust, copy) != "verified"


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
                           max_leaves=16)


@settings(derandomize=True, max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_hostile_envelope_or_trust_file_gets_one_line_and_exit_1_never_a_traceback(signed, tmp_path_factory, data,
                                                                                     fuzz_tally):
    """Any field of the envelope, its signature or the trust file's key replaced by any JSON value:
    the script accepts only when every field it checks is untouched (an unused extra field)."""
    receipt, trust = signed
    module = load_script()
    copy = editable_copy(receipt, tmp_path_factory.mktemp("hostile"))
    original_envelope, original_trust = json.loads((copy / ENVELOPE).read_bytes()), json.loads(trust.read_bytes())
    envelope, trust_document = json.loads(json.dumps(original_envelope)), json.loads(json.dumps(original_trust))
    where = data.draw(st.sampled_from(["envelope", "envelope fields", "signature", "trusted key"]))
    value = data.draw(JSON_VALUES)
    if where == "envelope":
        envelope = value
    else:
        target = {"envelope fields": envelope, "signature": envelope["signatures"][0],
                  "trusted key": trust_document["keys"][0]}[where]
        target[data.draw(st.sampled_from(sorted(target)) | st.text(max_size=8))] = value
    (copy / ENVELOPE).write_text(json.dumps(envelope), encoding="utf-8")
    hostile_trust = copy.parent / "trust.json"
    hostile_trust.write_text(json.dumps(trust_document), encoding="utf-8")
    code, lines = in_process(module, hostile_trust, copy)
    fuzz_tally.add("examples")
    fuzz_tally.add("refused" if code == 1 else "accepted")
    assert len(lines) == 1, lines
    if code == 0:
        def checked(document: dict) -> list[object]:
            return [document["payload"], document["payloadType"],
                    [(signature["keyid"], signature["sig"]) for signature in document["signatures"]]]
        assert checked(envelope) == checked(original_envelope)
        key, original_key = trust_document["keys"][0], original_trust["keys"][0]
        assert [key[name] for name in ("keyid", "public_key", "revoked")] == \
            [original_key[name] for name in ("keyid", "public_key", "revoked")]
    else:
        assert code == 1 and lines[0].startswith(f"NOT VERIFIED {copy.name}: "), lines


def test_the_script_imports_only_the_standard_library_and_cryptography():
    tree = ast.parse(SCRIPT.read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module is not None
            imported.add(node.module.split(".")[0])
    assert "cryptography" in imported
    assert imported - {"cryptography"} <= sys.stdlib_module_names, imported - sys.stdlib_module_names
    assert not any(isinstance(node, ast.Call) and getattr(node.func, "id", "") == "__import__" for node in ast.walk(tree))
    assert len(SCRIPT.read_text(encoding="utf-8").splitlines()) < 90


def test_the_docs_quote_the_script_byte_for_byte():
    text = DOC.read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(#!/usr/bin/env python3\n.*?)^```$", text, flags=re.DOTALL | re.MULTILINE)
    assert len(blocks) == 1, "docs/receipts.md quotes tools/verify_receipt_offline.py in one python block"
    assert blocks[0] == SCRIPT.read_text(encoding="utf-8"), "docs/receipts.md's copy differs from the script"


def test_the_docs_install_cryptography_at_the_harness_pin():
    (pin,) = re.findall(r'^(cryptography==[0-9.]+)$', (REPO_ROOT / "constraints.txt").read_text(encoding="utf-8"), re.MULTILINE)
    assert f"pip install '{pin}'" in DOC.read_text(encoding="utf-8")

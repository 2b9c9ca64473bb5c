"""The receipt-signing key and trust files: made private, shown, rotated on the record."""

from __future__ import annotations

import hashlib
import json
import os
import stat

import pytest

from qualify.archive.keys import (
    BASIS_TRUST_FILE,
    SIGNING_KEY_FILE,
    TRUST_FILE,
    TRUST_SCHEMA_V2,
    config_dir,
    ensure_signing_key,
    init_key,
    load_signing_key,
    load_trust,
    parse_trust,
    rotate_key,
)
from qualify.core.errors import Refused
from qualify.interfaces.keys_command import keys_cli


@pytest.fixture
def config(tmp_path, monkeypatch):
    """A fresh XDG config home: the key and trust file land in <it>/trust-ladder."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path / "config" / "trust-ladder"


def test_init_makes_a_private_key_under_the_user_config_dir_and_trusts_it(config):
    key = init_key()
    assert config_dir() == config and key.path == config / SIGNING_KEY_FILE
    assert stat.S_IMODE(key.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(config.stat().st_mode) == 0o700
    assert key.key_id == hashlib.sha256(key.public).hexdigest()
    trust = load_trust(config / TRUST_FILE)
    (entry,) = trust.keys
    assert entry.key_id == key.key_id and entry.public == key.public and entry.revoked is None


def test_a_second_init_is_refused_and_keeps_the_key(config):
    first = init_key()
    with pytest.raises(Refused, match="exists; `qualify keys rotate` replaces it"):
        init_key()
    assert load_signing_key().key_id == first.key_id


def test_a_key_readable_by_others_is_refused(config):
    key = init_key()
    os.chmod(key.path, 0o644)
    with pytest.raises(Refused, match="mode 0644 lets others read it; expected 0600"):
        load_signing_key()


def test_a_key_file_that_is_not_a_pem_key_is_refused(config):
    key = init_key()
    os.chmod(key.path, 0o600)
    key.path.write_bytes(b"not a key\n")
    with pytest.raises(Refused, match="not a readable unencrypted PEM key"):
        load_signing_key()


def test_a_missing_key_is_made_once_on_first_use_and_announced(config):
    said: list[str] = []
    made = ensure_signing_key(announce=said.append)
    again = ensure_signing_key(announce=said.append)
    assert made.key_id == again.key_id
    assert len(said) == 1 and made.key_id[:16] in said[0]


def test_rotate_revokes_the_old_key_on_the_record_and_deletes_it(config):
    old = init_key()
    new, old_id = rotate_key("laptop lost")
    assert old_id == old.key_id != new.key_id
    assert load_signing_key().key_id == new.key_id
    assert sorted(path.name for path in config.iterdir()) == [SIGNING_KEY_FILE, TRUST_FILE]
    trust = load_trust(config / TRUST_FILE)
    revoked = trust.get(old.key_id)
    assert revoked is not None and revoked.revoked is not None
    assert revoked.revoked.reason == "laptop lost" and revoked.revoked.replaced_by == new.key_id
    current = trust.get(new.key_id)
    assert current is not None and current.revoked is None


def test_init_and_rotate_keep_a_v2_trust_file_v2_with_its_pins_and_the_new_keys_role_and_window(config):
    """An operator who adopted a v2 trust file (roles, windows, legacy pins) does not lose them."""
    config.mkdir(parents=True)
    v2 = json.loads(BASIS_TRUST_FILE.read_bytes())
    (config / TRUST_FILE).write_text(json.dumps(v2))
    first = init_key()
    second, _old = rotate_key("moved hosts")
    trust = load_trust(config / TRUST_FILE)
    assert trust.schema == TRUST_SCHEMA_V2 and [pin.document() for pin in trust.legacy] == v2["legacy_receipts"]
    assert trust.get(v2["keys"][0]["keyid"]).valid_until == v2["keys"][0]["valid_until"]
    for made in (first, second):
        key = trust.get(made.key_id)
        assert (key.role, key.valid_from, key.valid_until) == ("operator", key.added_utc, None)
    assert trust.get(first.key_id).revoked.replaced_by == second.key_id and trust.get(second.key_id).revoked is None


def test_rotate_needs_a_reason(config):
    init_key()
    with pytest.raises(Refused, match="--reason is empty"):
        rotate_key("  \n ")


def test_a_trust_file_whose_key_id_is_not_its_keys_digest_is_refused(config):
    init_key()
    document = json.loads((config / TRUST_FILE).read_text())
    document["keys"][0]["keyid"] = "ab" * 32
    with pytest.raises(Refused, match=r"keys\[0\]\.keyid is not the SHA-256 of its public_key"):
        parse_trust(json.dumps(document).encode(), "trust file t.json")


def test_a_trust_file_listing_a_key_twice_is_refused(config):
    init_key()
    document = json.loads((config / TRUST_FILE).read_text())
    document["keys"].append(document["keys"][0])
    with pytest.raises(Refused, match="is listed twice"):
        parse_trust(json.dumps(document).encode(), "trust file t.json")


@pytest.mark.parametrize("data, words", [
    (b"", "not JSON"),
    (b'{"schema": "trust-ladder.trust.v1"}', "keys"),
    (b'{"schema": "trust-ladder.trust.v9", "keys": []}', "schema"),
    (b'{"schema": "trust-ladder.trust.v1", "keys": [], "extra": 1}', "extra"),
])
def test_a_malformed_trust_file_is_one_named_refusal(data, words):
    with pytest.raises(Refused) as refusal:
        parse_trust(data, "trust file t.json")
    message = str(refusal.value)
    assert message.startswith("trust file t.json:") and "\n" not in message
    assert words in message


def test_keys_cli_init_show_and_trust_file_agree(config, capsys):
    assert keys_cli(["init"]) == 0
    made = capsys.readouterr().out
    key = load_signing_key()
    assert key.key_id in made
    assert keys_cli(["show"]) == 0
    shown = capsys.readouterr().out
    assert f"key id      {key.key_id}" in shown and key.public.hex() in shown
    assert "BEGIN PUBLIC KEY" in shown and "PRIVATE" not in shown
    assert keys_cli(["show", "--trust-file"]) == 0
    exported = parse_trust(capsys.readouterr().out.encode(), "exported")
    assert [entry.key_id for entry in exported.keys] == [key.key_id]


def test_keys_cli_refusals_are_one_line_exit_2(config, capsys):
    assert keys_cli(["show"]) == 2
    assert "none yet; `qualify keys init` makes one" in capsys.readouterr().err
    assert keys_cli(["rotate"]) == 2  # --reason is required
    assert keys_cli(["init"]) == 0
    assert keys_cli(["init"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 2 and "exists" in err[-1]


def _first_use(directory: str) -> str:
    from pathlib import Path

    return ensure_signing_key(Path(directory), announce=lambda line: None).key_id


def test_first_runs_racing_for_the_key_all_sign_with_the_one_that_won(tmp_path):
    import concurrent.futures
    import multiprocessing

    for trial in range(5):
        directory = tmp_path / f"trial-{trial}"
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(4, mp_context=context) as pool:
            key_ids = list(pool.map(_first_use, [str(directory)] * 4))
        assert len(set(key_ids)) == 1 and key_ids[0] == load_signing_key(directory).key_id
        assert [key.key_id for key in load_trust(directory / TRUST_FILE).keys] == key_ids[:1]
        assert sorted(path.name for path in directory.iterdir()) == [SIGNING_KEY_FILE, TRUST_FILE]

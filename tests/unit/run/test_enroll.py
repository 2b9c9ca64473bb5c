"""Enrollment: a key only for a lane with a verified, passing receipt of its own identity."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from qualify.archive.keys import default_trust_path, ensure_signing_key, load_trust
from qualify.archive.writer import ReceiptWriter
from qualify.contract.lanes import LaneKind, Recipe
from qualify.contract.registry import REGISTRY_SCHEMA_ID
from qualify.core.digests import document_sha256
from qualify.core.errors import Refused
from qualify.evidence.records import rule_from_identity
from qualify.interfaces.enroll_command import enroll_cli
from qualify.judge import judge_summary
from qualify.run.enroll import enroll, enrollment_for, key_for, load_registry
from tests.unit.archive.test_receipts import make_writable
from tests.unit.judge.test_judge import rung2_record, rung3_record


@dataclass
class FakeIdentity:
    """Stands in for qualify.contract.identity.Identity: the attributes enrollment reads, and document()."""

    lane: str = "nvfp4-native-splitk"
    lane_kind: LaneKind = LaneKind.NVFP4
    recipe: Recipe = Recipe.NATIVE_TEXT
    rung: int = 2
    maximum_absolute: float = 11.0
    maximum_mean_absolute: float = 1.25
    acceptance_floor: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def onboarding_qualification(self):
        return SimpleNamespace(
            repetitions=3, output_tokens=256,
            full_logits=SimpleNamespace(
                maximum_absolute=self.maximum_absolute, maximum_mean_absolute=self.maximum_mean_absolute
            ),
        )

    @property
    def speculative_draft(self):
        return None if self.acceptance_floor is None else SimpleNamespace(acceptance_floor=self.acceptance_floor)

    def document(self) -> dict[str, Any]:
        return {
            "schema": "trust-ladder.onboarding-identity.v2",  # a hashed document declares its schema
            "lane": self.lane, "lane_kind": self.lane_kind.value, "recipe": self.recipe.value,
            "bounds": [self.maximum_absolute, self.maximum_mean_absolute], **self.extra,
        }


def qualify_receipt(archive: Path, identity: FakeIdentity, records=None, *, rule=None) -> Path:
    """A receipt as the qualifier writes it: samples, the judge's verdict, finalize."""
    rule = rule or rule_from_identity(identity, drift_graded=True)
    records = records if records is not None else [rung2_record(i) for i in (1, 2, 3)]
    writer = ReceiptWriter(
        archive, command_line=["qualify", "--recipe", identity.recipe.value], identity=identity,
        recipe=identity.recipe.value, lane=identity.lane, rule=rule,
    )
    for record in records:
        writer.add_sample(record)
    return writer.finalize(judge_summary(records, rule))


@pytest.fixture
def places(tmp_path):
    """An archive, a registry and a key directory, and the trust file holding the session's
    receipt-signing key (made here, before any receipt is written)."""
    ensure_signing_key()
    return SimpleNamespace(archive=tmp_path / "archive", registry=tmp_path / "state" / "enrollment.json",
                           keys=tmp_path / "state" / "keys", trust=load_trust(default_trust_path()))


def test_enroll_mints_a_private_key_for_a_passing_receipt(places):
    identity = FakeIdentity()
    receipt = qualify_receipt(places.archive, identity)
    enrollment = enroll(identity, receipt, places.registry, places.keys, trust=places.trust)
    assert enrollment.lane == "nvfp4-native-splitk" and enrollment.lane_kind is LaneKind.NVFP4
    assert enrollment.recipe is Recipe.NATIVE_TEXT
    assert enrollment.identity_sha256 == document_sha256(identity.document())
    assert enrollment.receipt == f"receipt://{receipt.name}/validation-summary.json"
    key_path = places.keys / f"{enrollment.key_id}.key"
    key = key_path.read_bytes()
    assert len(key) == 32 and hashlib.sha256(key).hexdigest()[:16] == enrollment.key_id
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(places.keys.stat().st_mode) == 0o700
    registry = json.loads(places.registry.read_text())
    assert registry["schema"] == REGISTRY_SCHEMA_ID and registry["entries"][0]["key_id"] == enrollment.key_id
    assert load_registry(places.registry).by_key_id(enrollment.key_id) == enrollment
    assert key_for("nvfp4-native-splitk", places.registry, places.keys) == key
    assert enrollment_for("nvfp4-native-splitk", places.registry) == enrollment


def test_enroll_a_rung3_lane(places):
    identity = FakeIdentity(
        lane="kquant-exact-dflash", lane_kind=LaneKind.KQUANT, recipe=Recipe.KQUANT_TARGET_PLUS_DFLASH, rung=3,
        acceptance_floor=0.95,
    )
    receipt = qualify_receipt(places.archive, identity, [rung3_record(i) for i in (1, 2, 3)])
    enrollment = enroll(identity, receipt, places.registry, places.keys, trust=places.trust)
    assert len(key_for("kquant-exact-dflash", places.registry, places.keys)) == 32
    assert enrollment.recipe is Recipe.KQUANT_TARGET_PLUS_DFLASH


def test_re_enrolling_is_refused_without_rotate(places):
    identity = FakeIdentity()
    receipt = qualify_receipt(places.archive, identity)
    first = enroll(identity, receipt, places.registry, places.keys, trust=places.trust)
    with pytest.raises(Refused, match=f"already enrolled \\(handoff key {first.key_id}.*--rotate replaces its key"):
        enroll(identity, receipt, places.registry, places.keys, trust=places.trust)
    assert sorted(path.name for path in places.keys.iterdir()) == [f"{first.key_id}.key"]
    assert load_registry(places.registry).entries == (first,)


def test_rotate_revokes_the_old_key_on_the_record_and_deletes_its_file(places):
    identity = FakeIdentity()
    receipt = qualify_receipt(places.archive, identity)
    first = enroll(identity, receipt, places.registry, places.keys, trust=places.trust)
    second = enroll(identity, receipt, places.registry, places.keys, trust=places.trust, rotate=True)
    assert first.key_id != second.key_id
    assert hashlib.sha256(key_for(identity.lane, places.registry, places.keys)).hexdigest()[:16] == second.key_id
    registry = load_registry(places.registry)
    assert registry.entries == (second,)
    (revoked,) = registry.revoked
    assert (revoked.lane, revoked.key_id, revoked.replaced_by) == (identity.lane, first.key_id, second.key_id)
    assert "--rotate" in revoked.reason and revoked.receipt == first.receipt
    assert not (places.keys / f"{first.key_id}.key").exists()
    with pytest.raises(Refused, match=f"key_id \"{first.key_id}\" of lane {identity.lane} was revoked"):
        registry.by_key_id(first.key_id)


def test_rotate_of_a_lane_not_enrolled_is_refused(places):
    identity = FakeIdentity()
    receipt = qualify_receipt(places.archive, identity)
    with pytest.raises(Refused, match="--rotate: lane nvfp4-native-splitk is not enrolled"):
        enroll(identity, receipt, places.registry, places.keys, trust=places.trust, rotate=True)
    assert _no_key_minted(places)


def test_a_revoked_key_id_can_never_come_back_into_the_registry(places):
    identity = FakeIdentity()
    receipt = qualify_receipt(places.archive, identity)
    first = enroll(identity, receipt, places.registry, places.keys, trust=places.trust)
    enroll(identity, receipt, places.registry, places.keys, trust=places.trust, rotate=True)
    document = json.loads(places.registry.read_text())
    document["entries"][0]["key_id"] = first.key_id
    places.registry.write_text(json.dumps(document))
    with pytest.raises(Refused, match="which this registry lists as revoked"):
        load_registry(places.registry)


def test_an_unsigned_or_untrusted_receipt_is_refused(places):
    from qualify.archive.keys import TrustFile

    identity = FakeIdentity()
    receipt = qualify_receipt(places.archive, identity)
    with pytest.raises(Refused, match=f"receipt {receipt.name} is untrusted: signed by key .*does not list"):
        enroll(identity, receipt, places.registry, places.keys, trust=TrustFile((), "trust file empty.json"))
    make_writable(receipt)
    (receipt / "attestation.dsse.json").unlink()
    with pytest.raises(Refused, match=f"receipt {receipt.name} is tampered: missing file attestation.dsse.json"):
        enroll(identity, receipt, places.registry, places.keys, trust=places.trust)
    assert _no_key_minted(places)


def _no_key_minted(places) -> bool:
    return not places.keys.exists() or not any(places.keys.iterdir())


def test_a_failing_receipt_is_refused(places):
    identity = FakeIdentity()
    records = [rung2_record(i) for i in (1, 2, 3)]
    records[1]["max_abs"] = 11.5
    receipt = qualify_receipt(places.archive, identity, records)
    with pytest.raises(Refused, match="is a failed qualification: failed: repetition 2: native full-logit drift") as refusal:
        enroll(identity, receipt, places.registry, places.keys, trust=places.trust)
    assert "\n" not in str(refusal.value)
    assert _no_key_minted(places) and not places.registry.exists()


def test_an_altered_receipt_is_refused(places):
    identity = FakeIdentity()
    receipt = qualify_receipt(places.archive, identity)
    make_writable(receipt)
    path = receipt / "samples" / "sample-2.json"
    path.write_text(path.read_text().replace("10.884401", "10.884400"))
    with pytest.raises(Refused, match="is tampered: altered file samples/sample-2.json"):
        enroll(identity, receipt, places.registry, places.keys, trust=places.trust)
    assert _no_key_minted(places)


def test_a_foreign_receipt_is_refused(places):
    identity = FakeIdentity()
    other = FakeIdentity(extra={"checkpoint": "another"})
    receipt = qualify_receipt(places.archive, other)
    with pytest.raises(Refused, match="qualified identity .*, not this identity"):
        enroll(identity, receipt, places.registry, places.keys, trust=places.trust)
    assert _no_key_minted(places)


def test_a_receipt_judged_under_a_looser_rule_is_refused(places):
    """Samples outside the identity's rule cannot enroll through a receipt judged more leniently."""
    identity = FakeIdentity()
    loose = rule_from_identity(FakeIdentity(maximum_absolute=20.0), drift_graded=True)
    records = [rung2_record(i, max_abs=15.0) for i in (1, 2, 3)]
    receipt = qualify_receipt(places.archive, identity, records, rule=loose)
    with pytest.raises(Refused, match="judged under a rule other than this identity's"):
        enroll(identity, receipt, places.registry, places.keys, trust=places.trust)
    assert _no_key_minted(places)


def test_a_lane_that_is_never_enrollable_is_refused(places):
    anchor = FakeIdentity(lane="nvfp4-exact")
    receipt = qualify_receipt(places.archive, anchor)
    with pytest.raises(Refused, match="nvfp4-exact is never enrollable"):
        enroll(anchor, receipt, places.registry, places.keys, trust=places.trust)
    assert _no_key_minted(places)


def test_an_identity_whose_kind_disagrees_with_the_lane_table_is_refused(places):
    wrong = FakeIdentity(lane_kind=LaneKind.KQUANT)
    with pytest.raises(Refused, match="identity declares kquant/native-text"):
        enroll(wrong, places.archive, places.registry, places.keys, trust=places.trust)


def test_a_missing_receipt_is_refused(places):
    with pytest.raises(Refused, match="not a receipt directory"):
        enroll(FakeIdentity(), places.archive / "nothing", places.registry, places.keys, trust=places.trust)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda e: e.update(lane_kind="vllm-gpu"), "lane_kind: found \"vllm-gpu\", expected one of nvfp4, kquant"),
        (lambda e: e.update(recipe="fast-text"), "recipe: found \"fast-text\""),
        (lambda e: e.update(lane="mystery"), "lane: found \"mystery\""),
        (lambda e: e.update(lane_kind="kquant"), "recipe: found \"native-text\", lane kind kquant"),
        (lambda e: e.pop("identity_sha256"), "identity_sha256"),
        (lambda e: e.update(extra=1), "extra"),
    ],
)
def test_a_registry_with_unknown_or_malformed_entries_is_refused_before_minting(places, change, words):
    identity = FakeIdentity()
    receipt = qualify_receipt(places.archive, identity)
    enroll(identity, receipt, places.registry, places.keys, trust=places.trust)
    document = json.loads(places.registry.read_text())
    change(document["entries"][0])
    places.registry.write_text(json.dumps(document))
    keys_before = set(places.keys.iterdir())
    with pytest.raises(Refused, match=re.escape(words)):
        load_registry(places.registry)
    with pytest.raises(Refused, match=re.escape(words)):
        enroll(identity, receipt, places.registry, places.keys, trust=places.trust)
    assert set(places.keys.iterdir()) == keys_before
    with pytest.raises(Refused, match=re.escape(words)):
        key_for(identity.lane, places.registry, places.keys)


def test_key_for_selects_by_identity_and_refuses_ambiguity(places):
    identity = FakeIdentity()
    receipt = qualify_receipt(places.archive, identity)
    entry = enroll(identity, receipt, places.registry, places.keys, trust=places.trust)
    assert key_for(identity.lane, places.registry, places.keys, identity_sha256=entry.identity_sha256)
    with pytest.raises(Refused, match="with identity 0000000000000000… is not enrolled"):
        key_for(identity.lane, places.registry, places.keys, identity_sha256="0" * 64)
    document = json.loads(places.registry.read_text())
    document["entries"].append({**document["entries"][0], "identity_sha256": "a" * 64, "key_id": "b" * 16})
    places.registry.write_text(json.dumps(document))
    with pytest.raises(Refused, match="has 2 enrolled identities"):
        key_for(identity.lane, places.registry, places.keys)
    assert key_for(identity.lane, places.registry, places.keys, identity_sha256=entry.identity_sha256)


def test_key_for_refuses(places):
    identity = FakeIdentity()
    receipt = qualify_receipt(places.archive, identity)
    enrollment = enroll(identity, receipt, places.registry, places.keys, trust=places.trust)
    key_path = places.keys / f"{enrollment.key_id}.key"
    with pytest.raises(Refused, match="'nvfp4-native-f16' is not enrolled"):
        key_for("nvfp4-native-f16", places.registry, places.keys)
    os.chmod(key_path, 0o644)
    with pytest.raises(Refused, match="mode 0644 lets others read it"):
        key_for(identity.lane, places.registry, places.keys)
    os.chmod(key_path, 0o600)
    key_path.write_bytes(bytes(32))
    with pytest.raises(Refused, match="digest does not match key id"):
        key_for(identity.lane, places.registry, places.keys)
    key_path.write_bytes(bytes(31))
    with pytest.raises(Refused, match="31 bytes, expected 32"):
        key_for(identity.lane, places.registry, places.keys)
    key_path.unlink()
    with pytest.raises(Refused, match="no such key file"):
        key_for(identity.lane, places.registry, places.keys)


def test_enroll_cli(places, capsys):
    """The command as an operator runs it: a shipped identity file (its basis receipt committed in
    receipts/), and a passing receipt of that identity."""
    from qualify.contract.identity import load_identity
    from qualify.run.run_contract import identity_path_for_lane

    identity_path = identity_path_for_lane("nvfp4-native-splitk")
    identity = load_identity(identity_path)
    rule = rule_from_identity(identity, drift_graded=True)
    within = dict(max_abs=rule.maximum_absolute / 2, mean_abs=rule.maximum_mean_absolute / 2)
    receipt = qualify_receipt(places.archive, identity, [rung2_record(i, **within) for i in (1, 2, 3)], rule=rule)
    args = ["--identity", str(identity_path), "--registry", str(places.registry), "--keys", str(places.keys)]
    assert enroll_cli([*args, "--receipt", str(receipt)]) == 0
    assert capsys.readouterr().out.startswith("enrolled nvfp4-native-splitk (nvfp4, native-text): key ")
    uri = f"receipt://{receipt.name}/validation-summary.json"
    assert enroll_cli([*args, "--receipt", uri, "--receipts", str(places.archive)]) == 2
    assert "already enrolled" in capsys.readouterr().err
    assert enroll_cli([*args, "--receipt", uri, "--receipts", str(places.archive), "--rotate"]) == 0
    capsys.readouterr()
    assert enroll_cli([*args, "--receipt", str(receipt), "--trust", str(places.archive / "none.json")]) == 2
    assert "trust file" in capsys.readouterr().err
    assert enroll_cli([*args, "--receipt", "receipt://../x/y", "--receipts", str(places.archive)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "receipt uri" in err
    assert enroll_cli(["--identity", "x"]) == 2


@pytest.mark.parametrize("lane", ["nvfp4-native-splitk", "kquant-exact-dflash"])
def test_enroll_a_loaded_identity(tmp_path, places, lane):
    """The real qualify.contract.identity.Identity: its digest, its rule, and a receipt of it."""
    from qualify.contract.identity import identity_sha256
    from tests.unit.contract.test_identity import make_pair

    identity = make_pair(tmp_path / "pair", lane).load()
    rule = rule_from_identity(identity, drift_graded=identity.rung == 2)
    factory = rung2_record if identity.rung == 2 else rung3_record
    receipt = qualify_receipt(places.archive, identity, [factory(i) for i in (1, 2, 3)], rule=rule)
    assert (receipt / "identity.sha256").read_text().strip() == identity_sha256(identity)
    enrollment = enroll(identity, receipt, places.registry, places.keys, trust=places.trust)
    assert enrollment.identity_sha256 == identity_sha256(identity)
    assert len(key_for(lane, places.registry, places.keys)) == 32
    if identity.rung == 3:
        assert rule.acceptance_floor == identity.speculative_draft.acceptance_floor
    else:
        assert (rule.maximum_absolute, rule.maximum_mean_absolute) == (11.0, 1.25)


def test_the_consumer_accepts_an_enrolled_lanes_handoffs_only_under_its_minted_key(places):
    import numpy as np

    from qualify.core.errors import HandoffRefused
    from qualify.core.kv import KVCache
    from qualify.handoff.wire import HandoffExpectation, mint_run_key, open_handoff, seal_handoff_parts

    identity = FakeIdentity()
    enroll(identity, qualify_receipt(places.archive, identity), places.registry, places.keys, trust=places.trust)
    enrolled_key = key_for(identity.lane, places.registry, places.keys)
    rng = np.random.default_rng(7)
    kv = KVCache([rng.standard_normal((2, 8, 4), dtype=np.float32) for _ in range(2)],
                 [rng.standard_normal((2, 8, 4), dtype=np.float32) for _ in range(2)])
    facts = dict(identity_sha256="a" * 64, target_cache_identity="b" * 64, producer_mode="native",
                 lane=identity.lane, prompt_sha256="c" * 64, run_id="serve", request_id="r1", compute_s=0.0)
    expected = HandoffExpectation(identity_sha256="a" * 64, cache_identity="b" * 64, geometry=kv.geometry,
                                  prompt_sha256="c" * 64, run_id="serve", request_id="r1", lane=identity.lane,
                                  producer_mode="native")
    opened = open_handoff(seal_handoff_parts(kv, key=enrolled_key, **facts).to_handoff(), key=enrolled_key,
                          expectation=expected)
    assert all(np.array_equal(a, b) for a, b in zip(opened.kv.keys, kv.keys, strict=False))
    with pytest.raises(HandoffRefused, match="MAC does not verify"):
        open_handoff(seal_handoff_parts(kv, key=mint_run_key(), **facts).to_handoff(), key=enrolled_key,
                     expectation=expected)

"""Identity loading: every layer refuses, one line naming the field, found and sealed values.

``make_pair`` builds a consistent (identity file, sealed table, receipt archive) triple from
synthetic digests; other test modules import it.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import math
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from qualify.contract import identity as identity_module
from qualify.contract import sealed as sealed_module
from qualify.contract.identity import (
    MAX_DOCUMENT_BYTES,
    Identity,
    check_engine_units,
    identity_sha256,
    load_identity,
    logit_units_label,
    validate_identity_document,
)
from qualify.contract.lanes import LANES, target_cache_identity
from qualify.contract.sealed import (
    SEALED_IDENTITIES,
    SealedCheckpoint,
    SealedContextPolicy,
    SealedDraft,
    SealedDraftGeometry,
    SealedEngine,
    SealedIdentity,
    SealedLogitUnits,
    SealedNamedDigest,
    SealedPrompt,
    SealedQualification,
    SealedRope,
    sealed_table,
)
from qualify.core.digests import canonical_sha256, sha256_bytes, sha256_file
from qualify.core.errors import Refused

BASIS_RUN_ID = "calibration-20260817"
BASIS_URI = f"receipt://{BASIS_RUN_ID}/command.log"
FALLBACK_BASIS_BYTES = b"calibration run: max/mean 10.88/1.23 over 5 repetitions\n"


def make_basis_receipt(archive: Path) -> Path:
    """An archived basis receipt; a real one when ``qualify.archive.receipts`` exists (it verifies the
    manifest), else a plain file (identity.py then checks the sealed file digest only)."""
    if importlib.util.find_spec("qualify.archive.receipts") is None:
        path = archive / BASIS_RUN_ID / "command.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(FALLBACK_BASIS_BYTES)
        return path
    from qualify.archive.receipts import ReceiptWriter

    archive.mkdir(parents=True, exist_ok=True)
    writer = ReceiptWriter(
        archive,
        command_line=["qualify", "calibrate", "--lane", "fixture"],
        identity={"calibration": "fixture"},
        recipe="native-text",
        lane="fixture",
        run_id=BASIS_RUN_ID,
    )
    writer.log("measured max/mean 10.88/1.23 over 5 repetitions")
    return writer.finalize(None, error="calibration fixture (no verdict)") / "command.log"


def writable(path: Path) -> Path:
    """Undo the receipt writer's read-only modes so a test can tamper with a file."""
    os.chmod(path.parent, 0o755)
    if path.exists():
        os.chmod(path, 0o644)
    return path


def digest(label: str) -> str:
    return sha256_bytes(label.encode())


def make_sealed(
    lane: str = "nvfp4-native-splitk", basis_sha256: str | None = None, **overrides: Any
) -> SealedIdentity:
    """A self-consistent sealed identity for ``lane`` with synthetic digests."""
    spec = LANES[lane]
    files = overrides.pop(
        "files", {"model/config.json": digest("config"), "model/nvfp4/model.safetensors": digest("weights")}
    )
    producer = SealedEngine("qualify-reference", "0.1.0", f"{lane}-abi-v1")
    draft = None
    if spec.speculative_draft:
        draft = SealedDraft(
            SealedDraftGeometry("eagle-1", 1, 256, 8, 4, 32, 4), 0.6, digest("draft")
        )
    bounded = spec.recipe.full_logits_mode == "bounded-drift"
    fields: dict[str, Any] = dict(
        lane=lane,
        checkpoint=SealedCheckpoint(files, 10_265_158),
        producer_engine=producer,
        consumer_engine=SealedEngine("qualify-reference", "0.1.0", "nvfp4-exact-v1"),
        adapter=SealedNamedDigest("qualify-nvfp4-linear", digest("adapter")),
        tokenizer_sha256=digest("tokenizer"),
        prompt=SealedPrompt("python-textwrap", 2048, digest("prompt")),
        prompt_template=SealedNamedDigest("raw-token-ids", digest("template")),
        context_policy=SealedContextPolicy(2047, 4096),
        rope=SealedRope(10000.0, digest("rope")),
        logit_units=SealedLogitUnits("tanh-softcap", 30.0),
        target_cache_identity_sha256=target_cache_identity(spec, files, producer.abi),
        speculative_draft=draft,
        qualification=SealedQualification(
            prompt_tokens=2048,
            output_tokens=256,
            repetitions=3,
            prompt_sha256=digest("prompt"),
            require_exact_tokens=True,
            require_deterministic_remote_output=True,
            maximum_absolute=11.0 if bounded else None,
            maximum_mean_absolute=1.25 if bounded else None,
            basis=BASIS_URI,
            basis_sha256=basis_sha256 or digest("basis"),
        ),
    )
    fields.update(overrides)
    return SealedIdentity(**fields)


@dataclasses.dataclass
class Pair:
    """An identity file, the sealed table it matches, and the receipt archive of its basis."""

    path: Path
    document: dict[str, Any]
    sealed: SealedIdentity
    table: Any
    archive: Path

    def write(self, document: Any) -> Path:
        self.path.write_text(json.dumps(document, allow_nan=True), encoding="utf-8")
        return self.path

    def load(self, document: Any | None = None) -> Identity:
        if document is not None:
            self.write(document)
        return load_identity(self.path, sealed_identities=self.table, archive_dir=self.archive)


def make_pair(root: Path, lane: str = "nvfp4-native-splitk", **overrides: Any) -> Pair:
    """A consistent (identity file, sealed table, archive with the basis receipt) for ``lane``."""
    archive = root / "receipts"
    basis = make_basis_receipt(archive)
    sealed = make_sealed(lane, basis_sha256=sha256_file(basis), **overrides)
    pair = Pair(root / f"{lane}.json", sealed.identity_document(), sealed, sealed_table(sealed), archive)
    pair.write(pair.document)
    return pair


@pytest.fixture
def pair(tmp_path: Path) -> Pair:
    return make_pair(tmp_path)


def refused(pair: Pair, document: Any) -> str:
    with pytest.raises(Refused) as caught:
        pair.load(document)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"identity {pair.path}: ")
    return message


def mutated(document: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    clone = copy.deepcopy(document)
    *parents, last = path.split(".")
    node = clone
    for part in parents:
        node = node[part]
    if value is _REMOVE:
        del node[last]
    else:
        node[last] = value
    return clone


_REMOVE = object()


# --- valid identities ---------------------------------------------------------------------------


@pytest.mark.parametrize("lane", sorted(LANES))
def test_every_lane_has_a_loadable_pair(tmp_path: Path, lane: str) -> None:
    pair = make_pair(tmp_path, lane)
    identity = pair.load()
    assert identity.lane == lane
    assert identity.spec is LANES[lane]
    assert identity.rung == LANES[lane].recipe.rung
    assert identity_sha256(identity) == canonical_sha256(json.loads(pair.path.read_text()))
    assert identity_sha256(identity) == pair.sealed.identity_sha256


def test_identity_digest_is_independent_of_formatting(pair: Pair) -> None:
    first = identity_sha256(pair.load())
    pair.path.write_text(json.dumps(pair.document, indent=4, sort_keys=True))
    assert identity_sha256(pair.load()) == first


def test_identity_model_is_frozen(pair: Pair) -> None:
    identity = pair.load()
    with pytest.raises(ValidationError):
        identity.lane = "nvfp4-native-f16"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        identity.onboarding_qualification.full_logits.maximum_absolute = 12.0  # type: ignore[union-attr,misc]
    with pytest.raises(TypeError):
        identity.checkpoint.files["model/config.json"] = digest("other")  # type: ignore[index]


def test_no_lane_is_sealed_by_default_until_the_lead_freezes(pair: Pair) -> None:
    for lane, sealed in SEALED_IDENTITIES.items():
        assert sealed.lane == lane
    if "nvfp4-native-splitk" not in SEALED_IDENTITIES:
        with pytest.raises(Refused, match="lane: found \"nvfp4-native-splitk\", sealed lanes"):
            load_identity(pair.path, archive_dir=pair.archive)


# --- one field at a time ------------------------------------------------------------------------

RULE = "onboarding_qualification"
BOUNDS = f"{RULE}.full_logits"

SEALED_MISMATCHES = [
    (f"{BOUNDS}.maximum_absolute", 12.0, "found 12.0, sealed 11.0"),
    (f"{BOUNDS}.maximum_absolute", 10.5, "found 10.5, sealed 11.0"),
    (f"{BOUNDS}.maximum_absolute", 11, "found 11, sealed 11.0"),
    (f"{BOUNDS}.maximum_mean_absolute", 1.5, "found 1.5, sealed 1.25"),
    (f"{BOUNDS}.maximum_mean_absolute", 1.0, "found 1.0, sealed 1.25"),
    (f"{RULE}.prompt_tokens", 2047, "found 2047, sealed 2048"),
    (f"{RULE}.output_tokens", 255, "found 255, sealed 256"),
    (f"{RULE}.repetitions", 2, "found 2, sealed 3"),
    (f"{RULE}.require_exact_tokens", False, "found false, sealed true"),
    (f"{RULE}.require_deterministic_remote_output", False, "found false, sealed true"),
    (f"{RULE}.prompt_sha256", digest("other prompt"), "sealed \"" + digest("prompt")),
    (f"{RULE}.basis", "receipt://other-run/command.log", f"sealed \"{BASIS_URI}\""),
    (
        f"{RULE}.schema",
        "trust-ladder.kquant-target-plus-dflash-onboarding.v1",
        'sealed "trust-ladder.native-text-onboarding.v1"',
    ),
    ("target_cache_identity_sha256", digest("other cache"), "sealed \""),
    ("tokenizer_sha256", digest("other tokenizer"), "sealed \""),
    ("adapter.sha256", digest("other adapter"), "sealed \""),
    ("prompt.sha256", digest("other"), "sealed \""),
    ("prompt.tokens", 2047, "found 2047, sealed 2048"),
    ("prompt_template.sha256", digest("other"), "sealed \""),
    ("rope.cache_sha256", digest("other"), "sealed \""),
    ("rope.theta", 500000.0, "found 500000.0, sealed 10000.0"),
    ("producer_engine.version", "0.2.0", 'found "0.2.0", sealed "0.1.0"'),
    ("producer_engine.abi", "other-abi", 'found "other-abi"'),
    ("consumer_engine.name", "vllm", 'found "vllm", sealed "qualify-reference"'),
    ("checkpoint.total_bytes", 1, "found 1, sealed 10265158"),
    ("context_policy.handoff_positions", 2032, "found 2032, sealed 2047"),
    ("context_policy.max_positions", 8192, "found 8192, sealed 4096"),
    ("logit_units.cap", 50.0, "found 50.0, sealed 30.0"),
    ("native_variant", "f16", 'found "f16", sealed "splitk"'),
    ("native_variant", None, 'found null, sealed "splitk"'),
    ("producer_mode", "exact", 'found "exact", sealed "native"'),
    ("rung", 3, "found 3, sealed 2"),
    ("recipe", "kquant-target-plus-dflash", 'found "kquant-target-plus-dflash", sealed "native-text"'),
    ("lane_kind", "kquant", 'found "kquant", sealed "nvfp4"'),
]


@pytest.mark.parametrize(("field", "value", "expected"), SEALED_MISMATCHES)
def test_each_sealed_field_is_refused_when_changed(
    pair: Pair, field: str, value: Any, expected: str
) -> None:
    message = refused(pair, mutated(pair.document, field, value))
    assert f": {field}: " in message
    assert expected in message


STRUCTURAL = [
    (f"{BOUNDS}.maximum_absolute", -1.0, "expected a number > 0"),
    (f"{BOUNDS}.maximum_absolute", 0.0, "expected a number > 0"),
    (f"{BOUNDS}.maximum_mean_absolute", -0.5, "expected a number > 0"),
    (f"{BOUNDS}.maximum_mean_absolute", 0, "expected a number > 0"),
    (f"{BOUNDS}.maximum_absolute", "11.0", "expected type number"),
    (f"{BOUNDS}.maximum_absolute", _REMOVE, "missing"),
    (f"{BOUNDS}.mode", "exact", "found unexpected field"),
    (f"{BOUNDS}.mode", "loose", 'found "loose", expected one of "bounded-drift", "exact"'),
    (f"{RULE}.require_exact_tokens", "true", "expected type boolean"),
    (f"{RULE}.require_exact_tokens", 1, "expected type boolean"),
    (f"{RULE}.repetitions", 3.0, "valid integer"),
    (f"{RULE}.repetitions", "3", "expected type integer"),
    (f"{RULE}.basis", "", "expected receipt://<run-id>/<file>"),
    (f"{RULE}.basis", "receipt://run/../../etc/passwd", "expected receipt://<run-id>/<file>"),
    (f"{RULE}.basis", "https://example.invalid/x.log", "expected receipt://<run-id>/<file>"),
    (f"{RULE}.schema", "trust-ladder.native-text-onboarding.v2", "expected one of"),
    (f"{RULE}.basis", _REMOVE, "missing"),
    (f"{RULE}.extra", True, "found unexpected field"),
    ("schema", "trust-ladder.onboarding-identity.v2", 'expected "trust-ladder.onboarding-identity.v1"'),
    ("lane_kind", "sglang", 'found "sglang", expected one of "nvfp4", "kquant", "vllm", "transformers"'),
    ("producer_mode", "fast", "expected one of"),
    ("tokenizer_sha256", digest("tokenizer").upper(), "64 lowercase hex"),
    ("tokenizer_sha256", digest("tokenizer")[:63], "64 lowercase hex"),
    ("tokenizer_sha256", digest("tokenizer") + "0", "64 lowercase hex"),
    ("tokenizer_sha256", "g" * 64, "64 lowercase hex"),
    ("tokenizer_sha256", "TODO", "64 lowercase hex"),
    ("tokenizer_sha256", "0" * 64, "found the placeholder"),
    ("target_cache_identity_sha256", "0" * 64, "found the placeholder"),
    ("adapter.sha256", " " + digest("adapter")[1:], "64 lowercase hex"),
    ("rope", _REMOVE, "rope: missing"),
    ("speculative_draft", _REMOVE, "speculative_draft: missing"),
    ("unexpected", 1, "unexpected: found unexpected field"),
    ("checkpoint.files", {}, "checkpoint.files"),
    ("logit_units", {"transform": "softcap", "cap": 30.0}, "expected one of \"raw\", \"tanh-softcap\""),
    ("logit_units", {"transform": "raw", "cap": 30.0}, "logit_units.cap: found unexpected field"),
]


@pytest.mark.parametrize(("field", "value", "expected"), STRUCTURAL)
def test_structural_mutations_are_refused_naming_the_field(
    pair: Pair, field: str, value: Any, expected: str
) -> None:
    message = refused(pair, mutated(pair.document, field, value))
    assert expected in message
    assert field.split(".")[0] in message


def test_checkpoint_file_digest_is_named_by_relpath(pair: Pair) -> None:
    document = copy.deepcopy(pair.document)
    document["checkpoint"]["files"]["model/nvfp4/model.safetensors"] = digest("tampered")
    message = refused(pair, document)
    assert 'checkpoint.files["model/nvfp4/model.safetensors"]: found "' in message
    document["checkpoint"]["files"]["../model.safetensors"] = digest("x")
    assert "without '.' or '..' segments" in refused(pair, document)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_bounds_are_refused_naming_the_field(pair: Pair, constant: str) -> None:
    text = json.dumps(pair.document).replace('"maximum_absolute": 11.0', f'"maximum_absolute": {constant}')
    assert constant in text
    pair.path.write_text(text)
    with pytest.raises(Refused) as caught:
        pair.load()
    message = str(caught.value)
    assert "onboarding_qualification.full_logits.maximum_absolute" in message
    assert "expected a finite number" in message


def test_native_lane_with_draft_geometry_is_refused_with_routing_advice(pair: Pair) -> None:
    draft = {
        "geometry": {"kind": "eagle-1", "layers": 1, "hidden_size": 256, "heads": 8,
                     "kv_heads": 4, "head_dim": 32, "proposal_tokens": 4},
        "acceptance_floor": 0.6,
        "draft_sha256": digest("draft"),
    }
    message = refused(pair, mutated(pair.document, "speculative_draft", draft))
    assert "native-mode lane cannot declare speculative-draft geometry" in message
    assert "drop the draft" in message and "kquant" in message


def test_rung3_identity_mutations(tmp_path: Path) -> None:
    pair = make_pair(tmp_path, "kquant-exact-dflash")
    assert pair.load().onboarding_qualification.full_logits.mode == "exact"
    floor = mutated(pair.document, "speculative_draft.acceptance_floor", 0.5)
    assert "speculative_draft.acceptance_floor: found 0.5, sealed 0.6" in refused(pair, floor)
    geometry = mutated(pair.document, "speculative_draft.geometry.proposal_tokens", 8)
    assert "found 8, sealed 4" in refused(pair, geometry)
    drift = mutated(pair.document, f"{BOUNDS}", {"mode": "bounded-drift", "maximum_absolute": 1.0,
                                                  "maximum_mean_absolute": 0.1})
    assert "full_logits.mode: found \"bounded-drift\", sealed \"exact\"" in refused(pair, drift)
    no_draft = mutated(pair.document, "speculative_draft", None)
    assert "speculative_draft: found null, sealed {" in refused(pair, no_draft)


def test_lane_not_sealed_is_refused(pair: Pair) -> None:
    message = refused(pair, mutated(pair.document, "lane", "nvfp4-native-f16"))
    assert 'lane: found "nvfp4-native-f16", sealed lanes: nvfp4-native-splitk' in message


# --- the basis receipt --------------------------------------------------------------------------


def test_unresolvable_basis_is_refused(pair: Pair) -> None:
    writable(pair.archive / BASIS_RUN_ID / "command.log").unlink()
    message = refused(pair, pair.document)
    assert "onboarding_qualification.basis: " in message
    assert "command.log" in message


def test_altered_basis_is_refused(pair: Pair) -> None:
    basis = writable(pair.archive / BASIS_RUN_ID / "command.log")
    basis.write_bytes(basis.read_bytes() + b"edited\n")
    assert "onboarding_qualification.basis: " in refused(pair, pair.document)


@pytest.fixture
def without_receipts_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exercise the fallback used while ``qualify.archive.receipts`` does not exist."""
    monkeypatch.setattr(identity_module, "_receipt_resolver", lambda context: None)


@pytest.mark.usefixtures("without_receipts_module")
def test_fallback_basis_checks_existence_and_sealed_digest(pair: Pair) -> None:
    pair.load()
    basis = writable(pair.archive / BASIS_RUN_ID / "command.log")
    original = basis.read_bytes()
    basis.write_bytes(original + b"edited\n")
    message = refused(pair, pair.document)
    assert f"onboarding_qualification.basis: {BASIS_URI}: sha256 found" in message
    assert f"sealed {pair.sealed.qualification.basis_sha256}" in message
    basis.unlink()
    assert f"onboarding_qualification.basis: {BASIS_URI} does not resolve" in refused(pair, pair.document)


@pytest.mark.usefixtures("without_receipts_module")
def test_fallback_basis_symlink_out_of_archive_is_refused(pair: Pair, tmp_path: Path) -> None:
    target = writable(pair.archive / BASIS_RUN_ID / "command.log")
    outside = tmp_path / "outside.log"
    outside.write_bytes(target.read_bytes())
    target.unlink()
    target.symlink_to(outside)
    assert "outside the receipt archive" in refused(pair, pair.document)


def test_receipts_module_resolver_is_used_when_present(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, Path]] = []
    fake = types.ModuleType("qualify.archive.receipts")

    def resolve_receipt_uri(uri: str, archive_dir: Path) -> Path:
        calls.append((uri, archive_dir))
        return archive_dir / BASIS_RUN_ID / "command.log"

    fake.resolve_receipt_uri = resolve_receipt_uri  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "qualify.archive.receipts", fake)
    pair.load()
    assert calls == [(BASIS_URI, pair.archive)]

    def refuse(uri: str, archive_dir: Path) -> Path:
        raise Refused(f"receipt {uri}: manifest: command.log altered")

    fake.resolve_receipt_uri = refuse  # type: ignore[attr-defined]
    assert f"basis: receipt {BASIS_URI}: manifest" in refused(pair, pair.document)
    del fake.resolve_receipt_uri
    assert "qualify.archive.receipts is unusable" in refused(pair, pair.document)


# --- sealed constants ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "placeholder", ["0" * 64, "TODO", "", digest("x").upper(), digest("x")[:63], "z" * 64, None]
)
def test_placeholder_digests_never_seal(placeholder: Any) -> None:
    with pytest.raises(Refused, match="tokenizer_sha256"):
        make_sealed(tokenizer_sha256=placeholder)
    with pytest.raises(Refused, match="checkpoint"):
        make_sealed(files={"model/config.json": placeholder})


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"maximum_absolute": math.nan}, "maximum_absolute"),
        ({"maximum_absolute": math.inf}, "maximum_absolute"),
        ({"maximum_absolute": -11.0}, "maximum_absolute"),
        ({"maximum_absolute": 0.0}, "maximum_absolute"),
        ({"maximum_absolute": 11}, "maximum_absolute"),
        ({"maximum_mean_absolute": 0.0}, "maximum_mean_absolute"),
        ({"maximum_mean_absolute": 12.0}, "maximum_mean_absolute"),
        ({"require_exact_tokens": False}, "require_exact_tokens"),
        ({"require_deterministic_remote_output": False}, "require_deterministic_remote_output"),
        ({"basis": ""}, "basis"),
        ({"basis": "receipt://run/../x"}, "basis"),
        ({"basis_sha256": "0" * 64}, "basis_sha256"),
        ({"prompt_sha256": digest("other")}, "prompt.sha256"),
        ({"prompt_tokens": 2047}, "prompt.tokens"),
    ],
)
def test_inconsistent_sealed_rules_fail_at_construction(overrides: dict[str, Any], field: str) -> None:
    base = make_sealed()
    rule = dataclasses.replace(base.qualification, **overrides)
    with pytest.raises(Refused, match=field):
        make_sealed(qualification=rule)


def test_sealed_cache_identity_must_be_derived() -> None:
    with pytest.raises(Refused, match="target_cache_identity_sha256"):
        make_sealed(target_cache_identity_sha256=digest("made up"))
    with pytest.raises(Refused, match="speculative-draft"):
        make_sealed(speculative_draft=SealedDraft(SealedDraftGeometry("eagle-1", 1, 1, 1, 1, 1, 1), 0.5, digest("d")))


def test_sealed_constants_are_immutable() -> None:
    sealed = make_sealed()
    with pytest.raises(dataclasses.FrozenInstanceError):
        sealed.lane = "nvfp4-native-f16"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        sealed.qualification.maximum_absolute = 12.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        sealed.checkpoint.files["model/config.json"] = digest("x")  # type: ignore[index]
    table = sealed_table(sealed)
    with pytest.raises(TypeError):
        table["nvfp4-native-f16"] = sealed  # type: ignore[index]
    with pytest.raises(TypeError):
        SEALED_IDENTITIES["nvfp4-native-splitk"] = sealed  # type: ignore[index]
    with pytest.raises(TypeError):
        del sealed_module.SEALED_IDENTITIES["nvfp4-native-splitk"]  # type: ignore[attr-defined]
    with pytest.raises(Refused, match="sealed twice"):
        sealed_table(sealed, sealed)
    # The document a sealed constant hands out is a copy: editing it changes nothing sealed.
    document = sealed.identity_document()
    document["onboarding_qualification"]["full_logits"]["maximum_absolute"] = 12.0
    assert sealed.identity_document()["onboarding_qualification"]["full_logits"]["maximum_absolute"] == 11.0


# --- logit units (seed §32.6) -------------------------------------------------------------------


def test_engine_units_must_match_the_contract(pair: Pair, tmp_path: Path) -> None:
    identity = pair.load()
    assert logit_units_label(identity.logit_units) == "tanh-softcap:30.0"
    check_engine_units(identity, "tanh-softcap:30.0")
    check_engine_units(identity, "tanh-softcap:30")
    for other in ("raw", "tanh-softcap:20.0", "tanh-softcap:nan", "softcap:30", "", "TANH-SOFTCAP:30"):
        with pytest.raises(Refused, match="compares in 'tanh-softcap:30.0'"):
            check_engine_units(identity, other)
    raw = make_pair(tmp_path / "raw", "kquant-exact-dflash", logit_units=SealedLogitUnits("raw"))
    raw_identity = raw.load()
    check_engine_units(raw_identity, "raw")
    with pytest.raises(Refused, match="engine reports \"tanh-softcap:30.0\""):
        check_engine_units(raw_identity, "tanh-softcap:30.0")


# --- malformed files ----------------------------------------------------------------------------


def _refused_file(pair: Pair, data: bytes) -> str:
    pair.path.write_bytes(data)
    with pytest.raises(Refused) as caught:
        pair.load()
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"identity {pair.path}: ")
    return message


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"", "not JSON"),
        (b"not json", "not JSON"),
        (b'{"a": 1,}', "not JSON"),
        (b"[]", "expected type object"),
        (b"null", "expected type object"),
        (json.dumps({"a": 1}).encode("utf-16"), "not UTF-8"),
        ('{"lane": "caf\u00e9"}'.encode("latin-1"), "not UTF-8"),
        (b"\xef\xbb\xbf{}", "byte-order mark"),
        (b'{"lane": "a", "lane": "b"}', "duplicate key 'lane'"),
        (b"[" * 100_000, "nesting deeper than 32"),
        (b'{"a": ' * 40 + b"1" + b"}" * 40, "nesting deeper than 32"),
        (b'{"lane": "x\\ud800"}', "lone UTF-16 surrogate"),
        (b'{"lane": "nvfp4-native-splitk\\n"}', "control character U+000A"),
        (b'{"a": 1' + b"0" * 5000 + b"}", "not JSON"),
    ],
    ids=lambda value: repr(value[:24]) if isinstance(value, bytes) else "",
)
def test_malformed_files_are_refused_in_one_line(pair: Pair, data: bytes, expected: str) -> None:
    assert expected in _refused_file(pair, data)


def test_oversized_file_is_refused_before_parsing(pair: Pair) -> None:
    message = _refused_file(pair, b"[" * (MAX_DOCUMENT_BYTES + 1))
    assert "expected at most 1048576" in message


def test_directory_and_missing_file_are_refused(tmp_path: Path) -> None:
    with pytest.raises(Refused, match="is a directory"):
        load_identity(tmp_path)
    with pytest.raises(Refused, match="no such file"):
        load_identity(tmp_path / "absent.json")


def test_in_memory_documents_get_the_same_checks(pair: Pair) -> None:
    with pytest.raises(Refused, match="finite"):
        validate_identity_document(
            mutated(pair.document, f"{BOUNDS}.maximum_absolute", math.nan),
            where="identity (memory)", sealed_identities=pair.table, archive_dir=pair.archive,
        )
    identity = validate_identity_document(
        pair.document, where="identity (memory)", sealed_identities=pair.table, archive_dir=pair.archive
    )
    assert identity_sha256(identity) == pair.sealed.identity_sha256


# --- property: no mutant is ever accepted -------------------------------------------------------

JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=80)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=12), children, max_size=3),
    max_leaves=6,
)


def _paths(node: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found: list[tuple[str, ...]] = []
    if isinstance(node, dict):
        for key, value in node.items():
            found.append(prefix + (key,))
            found.extend(_paths(value, prefix + (key,)))
    return found


def _near_miss(value: Any) -> st.SearchStrategy[Any]:
    """Half same-type perturbations (which pass the schema and reach the sealed layer), half
    type confusions."""
    confusions = st.one_of(
        st.just(str(value)), st.just([value]), st.just({"value": value}), st.none(), JSON_VALUES
    )
    same: list[Any] = []
    if isinstance(value, bool):
        same = [not value]
        confusions = confusions | st.sampled_from([int(value), str(value).lower()])
    elif isinstance(value, int):
        same = [value + 1, value - 1, -value, 0, value * 2, value // 2]
        confusions = confusions | st.just(float(value))
    elif isinstance(value, float):
        same = [
            math.nextafter(value, math.inf), math.nextafter(value, -math.inf), value * 2,
            value / 2, -value, 0.0, value + 1.0, value - 0.25,
        ]
        confusions = confusions | st.sampled_from([int(value), math.nan, math.inf, -math.inf])
    elif isinstance(value, str):
        same = [value.upper(), value[:-1], value + "0", " " + value, value + "\n", "", "0" * 64, "TODO"]
        edits = st.integers(min_value=0, max_value=max(len(value) - 1, 0)).flatmap(
            lambda i: st.sampled_from("0123456789abcdef-._x").map(lambda c: value[:i] + c + value[i + 1:])
        )
        hex_digest = st.binary(min_size=32, max_size=32).map(bytes.hex)
        return st.one_of(st.sampled_from(same), edits, hex_digest, confusions)
    elif isinstance(value, dict):
        same = [{}, {key: value[key] for key in list(value)[:-1]}]
        confusions = confusions | st.just(list(value.values()))
    else:
        return confusions
    return st.one_of(st.sampled_from(same), confusions)


@pytest.mark.slow
def test_hypothesis_no_mutant_is_accepted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lanes = ("nvfp4-native-splitk", "kquant-exact-dflash")
    pairs = {lane: make_pair(tmp_path / lane, lane) for lane in lanes}
    stats = {"calls": 0, "mutants": 0, "accepted": 0, "unchanged": 0, "by_sealed": 0}
    accepted: list[str] = []

    @settings(
        max_examples=2000,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        stats["calls"] += 1
        pair = pairs[data.draw(st.sampled_from(lanes), label="lane")]
        original = json.dumps(pair.document, allow_nan=True)
        document = copy.deepcopy(pair.document)
        operation = data.draw(
            st.sampled_from(["near-miss", "replace", "near-miss", "remove", "near-miss", "add"]),
            label="op",
        )
        paths = _paths(document)
        if operation == "add":
            containers = [()] + [p for p in paths if isinstance(_get(document, p), dict)]
            target = data.draw(st.sampled_from(containers), label="container")
            key = data.draw(st.text(max_size=24), label="key")
            _get(document, target)[key] = data.draw(JSON_VALUES, label="value")
        else:
            target = data.draw(st.sampled_from(paths), label="path")
            parent = _get(document, target[:-1])
            if operation == "remove":
                del parent[target[-1]]
            elif operation == "replace":
                parent[target[-1]] = data.draw(JSON_VALUES, label="value")
            else:
                parent[target[-1]] = data.draw(_near_miss(parent[target[-1]]), label="value")
        text = json.dumps(document, allow_nan=True)
        if text == original:
            stats["unchanged"] += 1
            return
        stats["mutants"] += 1
        pair.path.write_text(text, encoding="utf-8")
        try:
            load_identity(pair.path, sealed_identities=pair.table, archive_dir=pair.archive)
        except Refused as exc:
            assert "\n" not in str(exc)
            stats["by_sealed"] += ", sealed " in str(exc)
            return
        stats["accepted"] += 1
        accepted.append(text[:300])

    run()
    examples = stats["mutants"] + stats["unchanged"]
    with capsys.disabled():
        print(
            f"\nhypothesis identity mutations: {examples} examples run ({stats['calls']} calls), "
            f"{stats['mutants']} mutants, {stats['accepted']} accepted; "
            f"{stats['by_sealed']} refused at the sealed-constant layer, the rest earlier"
        )
    assert examples >= 2000
    assert stats["accepted"] == 0, accepted[:3]


def _leaves(node: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(node, dict):
        return [leaf for key, value in node.items() for leaf in _leaves(value, prefix + (key,))]
    return [prefix] if node is not None else []


@pytest.mark.slow
def test_hypothesis_schema_valid_mutants_stop_at_the_sealed_layer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same-type, well-formed changes of any leaf (another real digest, a bigger bound, a
    flipped flag, a renamed engine) pass the schema and must be refused by the sealed constants."""
    lanes = ("nvfp4-native-splitk", "kquant-exact-dflash")
    pairs = {lane: make_pair(tmp_path / lane, lane) for lane in lanes}
    stats = {"mutants": 0, "accepted": 0, "by_sealed": 0}

    @settings(max_examples=1000, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        pair = pairs[data.draw(st.sampled_from(lanes), label="lane")]
        document = copy.deepcopy(pair.document)
        path = data.draw(st.sampled_from(_leaves(document)), label="leaf")
        parent = _get(document, path[:-1])
        value = parent[path[-1]]
        if isinstance(value, bool):
            changed: Any = not value
        elif isinstance(value, int):
            changed = value + data.draw(st.integers(min_value=1, max_value=4096), label="delta")
        elif isinstance(value, float):
            changed = value * data.draw(st.floats(min_value=1.0 + 1e-9, max_value=8.0), label="factor")
            changed = changed if changed != value else math.nextafter(value, math.inf)
        elif isinstance(value, str) and len(value) == 64:
            changed = data.draw(st.binary(min_size=32, max_size=32).map(bytes.hex).filter(lambda d: d != value))
        else:
            changed = value + data.draw(st.sampled_from(["-2", "x", ".1", "_b"]), label="suffix")
        parent[path[-1]] = changed
        stats["mutants"] += 1
        pair.path.write_text(json.dumps(document), encoding="utf-8")
        try:
            load_identity(pair.path, sealed_identities=pair.table, archive_dir=pair.archive)
        except Refused as exc:
            stats["by_sealed"] += ", sealed " in str(exc)
            return
        stats["accepted"] += 1

    run()
    with capsys.disabled():
        print(
            f"\nhypothesis well-formed leaf mutations: {stats['mutants']} mutants, "
            f"{stats['accepted']} accepted, {stats['by_sealed']} refused by the sealed constants"
        )
    assert stats["mutants"] >= 1000
    assert stats["accepted"] == 0
    assert stats["by_sealed"] > stats["mutants"] // 2


def _get(document: Any, path: tuple[str, ...]) -> Any:
    node = document
    for part in path:
        node = node[part]
    return node


# --- tools/freeze_identity.py -------------------------------------------------------------------


def _freeze_tool() -> types.ModuleType:
    path = Path(__file__).resolve().parents[1] / "tools" / "freeze_identity.py"
    spec = importlib.util.spec_from_file_location("freeze_identity", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_freeze_tool_writes_an_identity_and_a_pasteable_sealed_block(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("qualify.engines.reference")
    freeze = _freeze_tool()
    archive = tmp_path / "receipts"
    basis = make_basis_receipt(archive)
    out = tmp_path / "nvfp4-native-splitk-identity-v1.json"
    argv = [
        "--lane", "nvfp4-native-splitk",
        "--producer-engine", "reference-numpy", "0.1.0", "abi-native",
        "--consumer-engine", "reference-numpy", "0.1.0", "abi-exact",
        "--checkpoint", "model/config.json", "--checkpoint", "model/model.safetensors",
        "--adapter", "qualify-lanes=qualify/contract/lanes.py",
        "--maximum-absolute", "11.0", "--maximum-mean-absolute", "1.25",
        "--basis", BASIS_URI, "--archive-dir", str(archive), "--out", str(out),
    ]
    assert freeze.main(argv) == 0
    printed = capsys.readouterr().out
    namespace = dict(vars(sealed_module))
    exec(printed, namespace)  # the block is valid Python against qualify.contract.sealed's names
    sealed = namespace["SEALED_NVFP4_NATIVE_SPLITK"]
    assert isinstance(sealed, SealedIdentity)
    assert sealed.qualification.basis_sha256 == sha256_file(basis)
    assert sealed.qualification.maximum_absolute == 11.0
    identity = load_identity(out, sealed_identities=sealed_table(sealed), archive_dir=archive)
    assert identity_sha256(identity) == sealed.identity_sha256
    assert sealed.identity_sha256 in printed
    assert identity.prompt.tokens == 2048 and identity.context_policy.handoff_positions == 2047

    # Never over an existing file (unless --replace), and placeholders never freeze.
    before = out.read_bytes()
    assert freeze.main(argv) == 2
    assert out.read_bytes() == before
    assert "exists; pass --replace" in capsys.readouterr().err
    assert freeze.main([*argv[:-2], "--out", str(tmp_path / "x.json"), "--basis", "receipt://nope/x"]) == 2
    assert "does not resolve" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()

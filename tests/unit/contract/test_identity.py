"""Identity loading: every layer refuses in one line naming the field; the seal refuses any edit.

``make_pair`` builds a consistent (identity file, sealed digests, receipt archive with the basis)
triple from synthetic digests; other test modules import it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import threading
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from qualify.archive.reader import resolve_receipt_uri
from qualify.archive.verify import check_receipt
from qualify.contract import sealed_data
from qualify.contract.identity import (
    BASIS_MANIFEST_MAX_BYTES,
    IDENTITY_SCHEMA_ID,
    Identity,
    check_basis_receipt,
    identity_json_schema,
    identity_sha256,
    load_identity,
    parse_identity_document,
    validate_identity_document,
)
from qualify.contract.lanes import LANES, VLLM_VIA_CONNECTOR_LANE, target_cache_identity
from qualify.contract.rules import BOUND_RULE, BOUND_RULE_STATEMENT, FLOOR_RULE, FLOOR_RULE_STATEMENT
from qualify.contract.units import RawLogitUnits, SoftcapLogitUnits, logit_units_label, parse_logit_units
from qualify.core.digests import document_sha256, sha256_bytes, sha256_file
from qualify.core.errors import Refused
from qualify.core.strict_json import MAX_DOCUMENT_BYTES

REPO = Path(__file__).resolve().parents[3]
BASIS_RUN_ID = "calibration-20260817"
BASIS_URI = f"receipt://{BASIS_RUN_ID}/command.log"


def make_basis_receipt(archive: Path) -> Path:
    """An archived, verifiable basis receipt; returns its ``command.log``."""
    from qualify.archive.writer import ReceiptWriter
    from qualify.judge import judge_incomplete

    archive.mkdir(parents=True, exist_ok=True)
    writer = ReceiptWriter(
        archive,
        command_line=["qualify", "calibrate", "--lane", "fixture"],
        identity={"schema": "trust-ladder.calibration.v2", "calibration": "fixture"},
        recipe="native-text",
        lane="fixture",
        run_id=BASIS_RUN_ID,
    )
    writer.log("measured max/mean 10.88/1.23 over 5 repetitions")
    return writer.finalize(judge_incomplete("calibration fixture (no verdict)")) / "command.log"


def writable(path: Path) -> Path:
    """Undo the receipt writer's read-only modes so a test can tamper with a file."""
    os.chmod(path.parent, 0o755)
    if path.exists():
        os.chmod(path, 0o644)
    return path


def digest(label: str) -> str:
    return sha256_bytes(label.encode())


def make_document(
    lane: str = "nvfp4-native-splitk",
    *,
    files: Mapping[str, str] | None = None,
    logit_units: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A self-consistent identity document for ``lane`` with synthetic digests (report order)."""
    spec = LANES[lane]
    files = dict(files or {"model/config.json": digest("config"), "model/nvfp4/model.safetensors": digest("weights")})
    abi = f"{lane}-abi-v1"
    full_logits: dict[str, Any] = {"mode": spec.recipe.full_logits_mode}
    if spec.recipe.full_logits_mode == "bounded-drift":
        full_logits |= {"maximum_absolute": 11.0, "maximum_mean_absolute": 1.25}
    draft = None
    if spec.speculative_draft:
        draft = {
            "geometry": {"kind": "eagle-1", "layers": 1, "hidden_size": 256, "heads": 8, "kv_heads": 4,
                         "head_dim": 32, "proposal_tokens": 4},
            "acceptance_floor": 0.6,
            "draft_sha256": digest("draft"),
        }
    return {
        "schema": "trust-ladder.onboarding-identity.v5",
        "lane": lane,
        "lane_kind": spec.kind.value,
        "recipe": spec.recipe.value,
        "rung": spec.recipe.rung,
        "producer_mode": spec.mode.value,
        "native_variant": None if spec.variant is None else spec.variant.value,
        "onboarding_qualification": {
            "schema": spec.recipe.onboarding_schema,
            "prompt_tokens": 2048,
            "output_tokens": 256,
            "repetitions": 3,
            "prompt_sha256": digest("prompt"),
            "require_exact_tokens": True,
            "require_deterministic_remote_output": True,
            "full_logits": full_logits,
            "basis": BASIS_URI,
        },
        "target_cache_identity_sha256": target_cache_identity(spec, files, abi),
        "checkpoint": {"files": files, "total_bytes": 10_265_158},
        "producer_engine": {"name": "qualify-reference", "version": "0.1.0", "abi": abi,
                            "kat_sha256": digest("producer kat")},
        "consumer_engine": {"name": "qualify-reference", "version": "0.1.0", "abi": "nvfp4-exact-v1",
                            "kat_sha256": digest("consumer kat")},
        "connector": {"name": "ExampleConnector", "sha256": digest("connector")} if lane == VLLM_VIA_CONNECTOR_LANE else None,
        "tokenizer_sha256": digest("tokenizer"),
        "prompt": {"name": "python-textwrap", "tokens": 2048, "sha256": digest("prompt")},
        "prompt_template": {"name": "raw-token-ids", "sha256": digest("template")},
        "context_policy": {"handoff_positions": 2047, "max_positions": 4096},
        "rope": {"theta": 10000.0, "cache_sha256": digest("rope")},
        "logit_units": dict(logit_units or {"transform": "tanh-softcap", "cap": 30.0}),
        "speculative_draft": draft,
        "calibration": {
            "set": {"name": "calibration-set-v1", "sha256": digest("calibration-set")},
            "bound_rule": {"name": BOUND_RULE, "statement": BOUND_RULE_STATEMENT},
            "floor_rule": {"name": FLOOR_RULE, "statement": FLOOR_RULE_STATEMENT} if spec.speculative_draft else None,
        },
        "controls": None,
    }


@dataclasses.dataclass
class Pair:
    """An identity file, the sealed digests it matches (identity, basis receipt manifest), and the
    receipt archive of its basis."""

    path: Path
    document: dict[str, Any]
    table: Mapping[str, str]
    bases: Mapping[str, str]
    archive: Path

    @property
    def sealed_sha256(self) -> str:
        return self.table[parse_identity_document(self.document, where="pair").seal_name]

    def write(self, document: Any) -> Path:
        self.path.write_text(json.dumps(document, allow_nan=True), encoding="utf-8")
        return self.path

    def load(self, document: Any | None = None) -> Identity:
        if document is not None:
            self.write(document)
        return load_identity(self.path, sealed_identities=self.table)

    def check_basis(self, identity: Identity) -> Path:
        return check_basis_receipt(identity, resolve_receipt_uri, check_receipt, where=f"identity {self.path}",
                                   archive_dir=self.archive, sealed_basis_manifests=self.bases)


def make_pair(root: Path, lane: str = "nvfp4-native-splitk", **overrides: Any) -> Pair:
    """A consistent (identity file, sealed digests, archive with the basis receipt) for ``lane``."""
    archive = root / "receipts"
    basis = make_basis_receipt(archive)
    document = make_document(lane, **overrides)
    lane_name = parse_identity_document(document, where="made").seal_name
    pair = Pair(root / f"{lane}.json", document, {lane_name: document_sha256(document)},
                {lane_name: sha256_file(basis.parent / "manifest.json")}, archive)
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
    assert identity_sha256(identity) == document_sha256(json.loads(pair.path.read_text()))
    assert identity_sha256(identity) == pair.sealed_sha256
    assert pair.check_basis(identity) == (pair.archive / BASIS_RUN_ID / "command.log").resolve()


def test_identity_digest_is_independent_of_formatting(pair: Pair) -> None:
    first = identity_sha256(pair.load())
    pair.path.write_text(json.dumps(pair.document, indent=4, sort_keys=True))
    assert identity_sha256(pair.load()) == first


def test_the_typed_model_serialises_to_the_document_in_report_order(pair: Pair) -> None:
    assert list(pair.load().document()) == list(pair.document)
    assert json.dumps(pair.load().document()) == json.dumps(pair.document)


def test_identity_model_is_frozen(pair: Pair) -> None:
    identity = pair.load()
    with pytest.raises(ValidationError):
        identity.lane = "nvfp4-native-f16"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        identity.onboarding_qualification.full_logits.maximum_absolute = 12.0  # type: ignore[union-attr,misc]
    with pytest.raises(TypeError):
        identity.checkpoint.files["model/config.json"] = digest("other")  # type: ignore[index]


def test_the_shipped_sealed_tables_are_immutable() -> None:
    with pytest.raises(TypeError):
        sealed_data.SEALED_IDENTITIES["nvfp4-native-splitk"] = digest("x")  # type: ignore[index]
    with pytest.raises(TypeError):
        del sealed_data.SEALED_BASIS_MANIFESTS["nvfp4-native-splitk"]  # type: ignore[attr-defined]


# --- the seal: any edit of a sealed identity is refused, naming lane and digests -----------------

RULE = "onboarding_qualification"
BOUNDS = f"{RULE}.full_logits"

SEALED_EDITS = [
    (f"{BOUNDS}.maximum_absolute", 12.0),
    (f"{BOUNDS}.maximum_absolute", 10.5),
    (f"{BOUNDS}.maximum_mean_absolute", 1.5),
    (f"{BOUNDS}.maximum_mean_absolute", 1.0),
    (f"{RULE}.output_tokens", 255),
    (f"{RULE}.repetitions", 2),
    (f"{RULE}.basis", "receipt://other-run/command.log"),
    ("tokenizer_sha256", digest("other tokenizer")),
    ("producer_engine.kat_sha256", digest("other producer kat")),
    ("consumer_engine.kat_sha256", None),
    ("prompt_template.sha256", digest("other")),
    ("rope.cache_sha256", digest("other")),
    ("rope.theta", 500000.0),
    ("producer_engine.version", "0.2.0"),
    ("consumer_engine.name", "vllm"),
    ("checkpoint.total_bytes", 1),
    ("context_policy.handoff_positions", 2032),
    ("context_policy.max_positions", 8192),
    ("logit_units.cap", 50.0),
    ("logit_units", {"transform": "raw"}),
]


@pytest.mark.parametrize(("field", "value"), SEALED_EDITS)
def test_an_edited_field_is_refused_by_the_seal_naming_lane_and_digests(pair: Pair, field: str, value: Any) -> None:
    edited = mutated(pair.document, field, value)
    message = refused(pair, edited)
    assert (f"lane nvfp4-native-splitk: identity sha256 found {document_sha256(edited)}, "
            f"sealed {pair.sealed_sha256}") in message
    assert "re-freezing it with tools/freeze_identity.py in a reviewed commit" in message


def test_an_unsealed_lane_is_refused(tmp_path: Path) -> None:
    splitk, f16 = make_pair(tmp_path / "splitk"), make_pair(tmp_path / "f16", "nvfp4-native-f16")
    with pytest.raises(Refused, match='lane: found "nvfp4-native-f16", sealed lanes: nvfp4-native-splitk$'):
        load_identity(f16.path, sealed_identities=splitk.table)
    with pytest.raises(Refused, match="sealed lanes: none yet"):
        load_identity(f16.path, sealed_identities={})


def test_the_shipped_seal_is_the_default(pair: Pair) -> None:
    with pytest.raises(Refused, match=f"sealed {sealed_data.SEALED_IDENTITIES['nvfp4-native-splitk']}"):
        load_identity(pair.path)


# --- the model's rules: they hold for every identity, sealed or not ------------------------------

MODEL_RULES = [
    (f"{RULE}.prompt_tokens", 2047, "prompt.tokens: found 2048, expected onboarding_qualification.prompt_tokens 2047"),
    (f"{RULE}.prompt_sha256", digest("other prompt"), "prompt.sha256: found"),
    ("prompt.sha256", digest("other"), "prompt.sha256: found"),
    ("prompt.tokens", 2047, "prompt.tokens: found 2047, expected"),
    (f"{RULE}.schema", "trust-ladder.kquant-target-plus-dflash-onboarding.v1",
     'onboarding_qualification.schema: found "trust-ladder.kquant-target-plus-dflash-onboarding.v1", recipe '
     'native-text uses "trust-ladder.native-text-onboarding.v1"'),
    (f"{BOUNDS}.maximum_mean_absolute", 12.0,
     "onboarding_qualification.full_logits.maximum_mean_absolute: found 12.0, expected at most maximum_absolute (11.0)"),
    ("target_cache_identity_sha256", digest("other cache"), "target_cache_identity_sha256: found"),
    ("producer_engine.abi", "other-abi", "target_cache_identity_sha256: found"),
    ("checkpoint.files", {"model/config.json": digest("other")}, "target_cache_identity_sha256: found"),
    ("native_variant", "f16", 'native_variant: found "f16", lane nvfp4-native-splitk is "splitk"'),
    ("native_variant", None, 'native_variant: found null, lane nvfp4-native-splitk is "splitk"'),
    ("producer_mode", "exact", 'producer_mode: found "exact", lane nvfp4-native-splitk is "native"'),
    ("rung", 3, "rung: found 3, lane nvfp4-native-splitk is 2"),
    ("recipe", "kquant-target-plus-dflash", 'recipe: found "kquant-target-plus-dflash", lane nvfp4-native-splitk'),
    ("lane_kind", "kquant", 'lane_kind: found "kquant", lane nvfp4-native-splitk is "nvfp4"'),
    ("lane", "nvfp4-native-f16", 'native_variant: found "splitk", lane nvfp4-native-f16 is "f16"'),
    ("lane", "no-such-lane", 'lane: found "no-such-lane", expected one of nvfp4-native-splitk'),
    ("context_policy.handoff_positions", 2048, "context_policy.handoff_positions: found 2048, expected fewer than"),
    ("context_policy.max_positions", 2100, "context_policy.max_positions: found 2100, expected at least"),
    (f"{BOUNDS}.maximum_absolute", 11, "maximum_absolute: found 11, expected 11.0 (its typed form)"),
]


@pytest.mark.parametrize(("field", "value", "expected"), MODEL_RULES)
def test_model_rules_refuse_naming_the_field(pair: Pair, field: str, value: Any, expected: str) -> None:
    message = refused(pair, mutated(pair.document, field, value))
    assert expected in message
    assert ", sealed " not in message


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("tokenizer_sha256", "0" * 64, "placeholder"),
        ("checkpoint.files", {"model/config.json": "0" * 64}, "placeholder"),
        ("tokenizer_sha256", "TODO", "should match pattern"),
        ("tokenizer_sha256", digest("x").upper(), "should match pattern"),
        ("producer_engine.name", "two  spaces", "should match pattern"),
        (f"{RULE}.require_exact_tokens", False, "found false, expected true under mode \"bounded-drift\""),
        (f"{RULE}.require_deterministic_remote_output", False, "declares a deterministic one"),
        (f"{RULE}.basis", "receipt://run/../x", "should match pattern"),
        (f"{BOUNDS}.maximum_absolute", 0.0, "greater than 0"),
        ("speculative_draft", None, ""),
    ],
)
def test_the_model_itself_refuses_what_the_schema_also_refuses(
    field: str, value: Any, expected: str
) -> None:
    """The schema is generated from the model, but the model does not lean on it: a document
    that skips the schema layer meets the same constraints."""
    lane = "kquant-exact-dflash" if field == "speculative_draft" else "nvfp4-native-splitk"
    document = mutated(make_document(lane), field, value)
    with pytest.raises(ValidationError) as caught:
        Identity.model_validate_json(json.dumps(document), strict=True)
    assert expected in str(caught.value)


def test_native_lane_with_draft_geometry_is_refused_with_routing_advice(pair: Pair) -> None:
    draft = make_document("kquant-exact-dflash")["speculative_draft"]
    message = refused(pair, mutated(pair.document, "speculative_draft", draft))
    assert "native-mode lane cannot declare speculative-draft geometry" in message
    assert "drop the draft" in message and "kquant" in message


def test_rung3_identity_edits(tmp_path: Path) -> None:
    pair = make_pair(tmp_path, "kquant-exact-dflash")
    assert pair.load().onboarding_qualification.full_logits.mode == "exact"
    for field, value in (("speculative_draft.acceptance_floor", 0.5),
                         ("speculative_draft.geometry.proposal_tokens", 8)):
        assert f"sealed {pair.sealed_sha256}" in refused(pair, mutated(pair.document, field, value))
    drift = mutated(pair.document, BOUNDS, {"mode": "bounded-drift", "maximum_absolute": 1.0,
                                            "maximum_mean_absolute": 0.1})
    assert ('full_logits.mode: found "bounded-drift", recipe kquant-target-plus-dflash judges "exact"'
            in refused(pair, drift))
    no_draft = mutated(pair.document, "speculative_draft", None)
    assert "speculative_draft: found null, expected a draft" in refused(pair, no_draft)


# --- the schema layer (generated from the model) ------------------------------------------------

STRUCTURAL = [
    (f"{BOUNDS}.maximum_absolute", -1.0, "expected a number > 0"),
    (f"{BOUNDS}.maximum_absolute", 0.0, "expected a number > 0"),
    (f"{BOUNDS}.maximum_mean_absolute", -0.5, "expected a number > 0"),
    (f"{BOUNDS}.maximum_mean_absolute", 0, "expected a number > 0"),
    (f"{BOUNDS}.maximum_absolute", "11.0", "expected type number"),
    (f"{BOUNDS}.maximum_absolute", _REMOVE, "missing"),
    (f"{BOUNDS}.mode", "exact", "found unexpected field"),
    (f"{BOUNDS}.mode", "loose", 'found "loose", expected one of "bounded-drift", "exact"'),
    (f"{RULE}.require_exact_tokens", "true", "expected true"),
    (f"{RULE}.require_exact_tokens", 1, "expected true"),
    (f"{RULE}.require_exact_tokens", False, "expected true"),
    (f"{RULE}.repetitions", 3.0, "found 3.0, expected type integer"),
    (f"{RULE}.repetitions", "3", "expected type integer"),
    (f"{RULE}.basis", "", "expected receipt://<run-id>/<file>"),
    (f"{RULE}.basis", "receipt://run/../../etc/passwd", "expected receipt://<run-id>/<file>"),
    (f"{RULE}.basis", "https://example.invalid/x.log", "expected receipt://<run-id>/<file>"),
    (f"{RULE}.schema", "trust-ladder.native-text-onboarding.v2", "expected one of"),
    (f"{RULE}.basis", _REMOVE, "missing"),
    (f"{RULE}.extra", True, "found unexpected field"),
    ("schema", "trust-ladder.onboarding-identity.v2",
     'found "trust-ladder.onboarding-identity.v2", a retired version whose bounds were sealed from the fixture'),
    ("schema", "trust-ladder.onboarding-identity.v9", 'expected one of "trust-ladder.onboarding-identity.v5", '
                                                      '"trust-ladder.onboarding-identity.v6"'),
    ("calibration.bound_rule.statement", "the fixture's own maximum", "differs from rule cell-max-plus-one-sd.v1"),
    ("calibration.bound_rule.name", "wilson-one-sided-95-lower.v1", "differs from rule wilson-one-sided-95-lower.v1"),
    ("calibration.bound_rule.name", "taste.v1", 'found "taste.v1", expected one of'),
    ("calibration", _REMOVE, "missing"),
    ("lane_kind", "sglang", 'found "sglang", expected one of "nvfp4", "kquant", "vllm", "transformers"'),
    ("producer_mode", "fast", "expected one of"),
    ("tokenizer_sha256", digest("tokenizer").upper(), "64 lowercase hex"),
    ("tokenizer_sha256", digest("tokenizer")[:63], "64 lowercase hex"),
    ("tokenizer_sha256", digest("tokenizer") + "0", "64 lowercase hex"),
    ("tokenizer_sha256", "g" * 64, "64 lowercase hex"),
    ("tokenizer_sha256", "TODO", "64 lowercase hex"),
    ("tokenizer_sha256", "0" * 64, "found the placeholder"),
    ("target_cache_identity_sha256", "0" * 64, "found the placeholder"),
    ("consumer_engine.kat_sha256", " " + digest("consumer kat")[1:], "64 lowercase hex"),
    ("adapter", {"name": "qualify-nvfp4-linear", "sha256": digest("adapter")}, "adapter: found unexpected field"),
    ("producer_engine.version", "", "printable ASCII name"),
    ("rope", _REMOVE, "rope: missing"),
    ("speculative_draft", _REMOVE, "speculative_draft: missing"),
    ("unexpected", 1, "unexpected: found unexpected field"),
    ("checkpoint.files", {}, "checkpoint.files"),
    ("logit_units", {"transform": "softcap", "cap": 30.0}, "expected one of \"raw\", \"tanh-softcap\""),
    ("logit_units", {"transform": "raw", "cap": 30.0}, "logit_units.cap: found unexpected field"),
    ("logit_units", {"cap": 30.0}, "logit_units.transform: missing"),
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
    document["checkpoint"]["files"]["model/nvfp4/model.safetensors"] = "0" * 64
    message = refused(pair, document)
    assert 'checkpoint.files["model/nvfp4/model.safetensors"]: found the placeholder' in message
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


# --- the basis receipt: resolved by the archive layer, checked against the sealed digest ---------


def test_loading_checks_the_basis_uri_shape_only_and_never_imports_the_archive(pair: Pair) -> None:
    writable(pair.archive / BASIS_RUN_ID / "command.log").unlink()
    assert pair.load().onboarding_qualification.basis == BASIS_URI
    code = ("import sys, qualify.contract.identity, qualify.contract.registry; "
            "print(sorted(m for m in sys.modules if m.startswith('qualify.archive')))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_unresolvable_basis_is_refused(pair: Pair) -> None:
    identity = pair.load()
    writable(pair.archive / BASIS_RUN_ID / "command.log").unlink()
    with pytest.raises(Refused) as caught:
        pair.check_basis(identity)
    message = str(caught.value)
    assert message.startswith(f"identity {pair.path}: onboarding_qualification.basis: ")
    assert "command.log" in message and "\n" not in message


def test_altered_basis_is_refused_by_the_receipt_manifest(pair: Pair) -> None:
    identity = pair.load()
    basis = writable(pair.archive / BASIS_RUN_ID / "command.log")
    basis.write_bytes(basis.read_bytes() + b"edited\n")
    with pytest.raises(Refused, match=f"identity {pair.path}: onboarding_qualification.basis: .*verification"):
        pair.check_basis(identity)


def test_another_intact_basis_is_refused_by_the_sealed_manifest_digest(pair: Pair) -> None:
    identity = pair.load()
    found = sha256_file(pair.archive / BASIS_RUN_ID / "manifest.json")
    other = {identity.lane: digest("another calibration")}
    with pytest.raises(Refused) as caught:
        check_basis_receipt(identity, resolve_receipt_uri, check_receipt, where="identity x",
                            archive_dir=pair.archive, sealed_basis_manifests=other)
    assert str(caught.value) == (
        f"identity x: onboarding_qualification.basis: {BASIS_URI}: receipt {BASIS_RUN_ID} file manifest.json "
        f"sha256 found {found}, sealed {other[identity.lane]} (lane nvfp4-native-splitk); its files differ "
        f"from the calibration the rule was frozen from")
    with pytest.raises(Refused, match="lane nvfp4-native-splitk has no sealed basis receipt manifest digest"):
        check_basis_receipt(identity, resolve_receipt_uri, check_receipt, where="identity x",
                            archive_dir=pair.archive, sealed_basis_manifests={})


@pytest.mark.parametrize(
    ("problems", "said"),
    [(["command.log: sha256 differs"], "command.log: sha256 differs"),
     (["a: missing", "b: extra", "c: size"], "a: missing (and 2 more)"),
     (["a: missing", "b: extra"], "a: missing (and 1 more)")],
)
def test_a_failing_basis_is_refused_naming_its_first_problem_and_counting_the_rest(
        pair: Pair, problems: list[str], said: str) -> None:
    identity = pair.load()
    checked: list[Path] = []

    def verify(receipt: Path) -> tuple[list[str], int]:
        checked.append(receipt)
        return problems, 3

    with pytest.raises(Refused) as caught:
        check_basis_receipt(identity, resolve_receipt_uri, verify, where="identity x", archive_dir=pair.archive)
    assert str(caught.value) == (
        f"identity x: onboarding_qualification.basis: {BASIS_URI}: receipt fails verification: {said}")
    assert checked == [pair.archive / BASIS_RUN_ID]  # the receipt directory, named by the URI's first segment


def test_a_basis_that_cannot_be_read_is_refused_naming_the_os_error(pair: Pair) -> None:
    identity = pair.load()

    def unreadable(receipt: Path) -> tuple[list[str], int]:
        raise PermissionError(13, "Permission denied")

    with pytest.raises(Refused, match=r"cannot read its receipt's manifest.json \(Permission denied\)$"):
        check_basis_receipt(identity, resolve_receipt_uri, unreadable, where="identity x", archive_dir=pair.archive)

    def nameless(receipt: Path) -> tuple[list[str], int]:
        raise OSError()

    with pytest.raises(Refused, match=r"cannot read its receipt's manifest.json \(OSError\)$"):
        check_basis_receipt(identity, resolve_receipt_uri, nameless, where="identity x", archive_dir=pair.archive)


# --- the basis receipt's manifest read at its edges (the refusals' words: tests/golden/contract.identity.txt)


def basis_identity(basis: str = BASIS_URI) -> Identity:
    """A parsed synthetic identity whose basis is ``basis``."""
    return parse_identity_document(mutated(make_document(), "onboarding_qualification.basis", basis), where="identity x")


def check_manifest_only(identity: Identity, archive: Path, sealed: str, checked: list[Path] | None = None) -> Path:
    """The basis check with the archive layer passed in: the URI resolves, every file verifies,
    so only the manifest read and its seal are left to refuse (the verified receipts go to ``checked``)."""

    def verify(receipt: Path) -> tuple[list[str], int]:
        if checked is not None:
            checked.append(receipt)
        return [], 1

    return check_basis_receipt(identity, lambda uri, archive_dir: archive_dir / "resolved", verify, where="identity x",
                               archive_dir=archive, sealed_basis_manifests={identity.seal_name: sealed})


@contextlib.contextmanager
def writer_rescue(fifo: Path, after_s: float = 2.0) -> Iterator[list[bool]]:
    """While the block runs, open ``fifo`` for writing once ``after_s`` has passed, so a read that
    blocks waiting for a writer ends (and shows): the list yielded holds True if that was needed."""
    done = threading.Event()
    rescued: list[bool] = []

    def rescue() -> None:
        if done.wait(after_s):
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
        yield rescued
    finally:
        done.set()
        helper.join()


def basis_receipt_dir(tmp_path: Path) -> Path:
    receipt = tmp_path / "archive" / BASIS_RUN_ID
    receipt.mkdir(parents=True)
    return receipt


def test_a_manifest_exactly_at_the_size_bound_is_read_whole_and_one_byte_over_is_refused(tmp_path: Path) -> None:
    manifest = basis_receipt_dir(tmp_path) / "manifest.json"
    data = b"m" * BASIS_MANIFEST_MAX_BYTES
    manifest.write_bytes(data)
    assert check_manifest_only(basis_identity(), tmp_path / "archive", sha256_bytes(data)) == \
        tmp_path / "archive" / "resolved"
    manifest.write_bytes(data + b"m")
    with pytest.raises(Refused):
        check_manifest_only(basis_identity(), tmp_path / "archive", sha256_bytes(data + b"m"))


def test_a_manifest_that_is_a_symbolic_link_is_never_followed(tmp_path: Path) -> None:
    # The link's target would even match the seal: only refusing to follow it stops it.
    target = tmp_path / "elsewhere.json"
    target.write_bytes(b"{}")
    (basis_receipt_dir(tmp_path) / "manifest.json").symlink_to(target)
    with pytest.raises(Refused):
        check_manifest_only(basis_identity(), tmp_path / "archive", sha256_bytes(b"{}"))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")
def test_a_manifest_that_is_a_fifo_is_refused_at_once_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = basis_receipt_dir(tmp_path) / "manifest.json"
    os.mkfifo(fifo)
    with writer_rescue(fifo) as rescued, pytest.raises(Refused):
        check_manifest_only(basis_identity(), tmp_path / "archive", digest("manifest"))
    assert not rescued, "opening the manifest waited for a writer"


def test_the_receipt_is_named_by_the_first_segment_of_a_nested_basis_uri(tmp_path: Path) -> None:
    nested = basis_identity(f"receipt://{BASIS_RUN_ID}/samples/0.json")
    (basis_receipt_dir(tmp_path) / "manifest.json").write_bytes(b"{}")
    checked: list[Path] = []
    check_manifest_only(nested, tmp_path / "archive", sha256_bytes(b"{}"), checked)
    assert checked == [tmp_path / "archive" / BASIS_RUN_ID]
    with pytest.raises(Refused):
        check_manifest_only(nested, tmp_path / "archive", digest("another"))


def test_the_model_refuses_the_placeholder_digest_at_the_field_itself() -> None:
    with pytest.raises(ValidationError) as caught:
        Identity.model_validate_json(json.dumps(mutated(make_document(), "tokenizer_sha256", "0" * 64)), strict=True)
    error = caught.value.errors(include_url=False)[0]
    assert (error["type"], error["loc"], error["ctx"]["field"]) == ("identity_rule", ("tokenizer_sha256",), "")


def test_the_schema_of_the_current_version_fixes_its_own_name() -> None:
    assert identity_json_schema(IDENTITY_SCHEMA_ID)["properties"]["schema"] == {"const": IDENTITY_SCHEMA_ID,
                                                                              "type": "string"}


def test_the_digest_of_no_identity_or_of_one_with_no_canonical_form_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from qualify.contract import identity as identity_module

    with pytest.raises(Refused):
        identity_sha256({"lane": "x"})  # type: ignore[arg-type]
    loaded = basis_identity()

    def no_canonical_form(_document: object) -> str:
        raise ValueError("no canonical\nform")

    monkeypatch.setattr(identity_module, "document_sha256", no_canonical_form)
    with pytest.raises(Refused) as refused_digest:
        identity_sha256(loaded)
    assert "\n" not in str(refused_digest.value)


# --- logit units (seed §32.6) -------------------------------------------------------------------


def test_logit_units_labels_round_trip() -> None:
    softcap = SoftcapLogitUnits(transform="tanh-softcap", cap=30.0)
    assert logit_units_label(softcap) == "tanh-softcap:30.0"
    assert logit_units_label(RawLogitUnits(transform="raw")) == "raw"
    assert parse_logit_units("tanh-softcap:30") == softcap
    assert parse_logit_units("raw") == RawLogitUnits(transform="raw")
    for label in ("tanh-softcap:nan", "tanh-softcap:-1", "tanh-softcap:inf", "softcap:30", "", "TANH-SOFTCAP:30"):
        with pytest.raises(Refused, match="expected raw or tanh-softcap:<finite positive cap>"):
            parse_logit_units(label)


def test_identity_logit_units_are_typed(tmp_path: Path) -> None:
    softcap = make_pair(tmp_path / "softcap").load()
    assert logit_units_label(softcap.logit_units) == "tanh-softcap:30.0"
    raw = make_pair(tmp_path / "raw", "kquant-exact-dflash", logit_units={"transform": "raw"}).load()
    assert logit_units_label(raw.logit_units) == "raw"


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
        validate_identity_document(mutated(pair.document, f"{BOUNDS}.maximum_absolute", math.nan),
                                   where="identity (memory)", sealed_identities=pair.table)
    identity = validate_identity_document(pair.document, where="identity (memory)", sealed_identities=pair.table)
    assert identity_sha256(identity) == pair.sealed_sha256
    assert identity_sha256(parse_identity_document(pair.document, where="identity (memory)")) == pair.sealed_sha256


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
    """Half same-type perturbations (which pass the schema and reach the seal), half type
    confusions."""
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
            load_identity(pair.path, sealed_identities=pair.table)
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
            f"{stats['by_sealed']} refused by the seal, the rest earlier"
        )
    assert examples >= 2000
    assert stats["accepted"] == 0, accepted[:3]


def _leaves(node: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(node, dict):
        return [leaf for key, value in node.items() for leaf in _leaves(value, prefix + (key,))]
    return [prefix] if node is not None else []


@pytest.mark.slow
def test_hypothesis_schema_valid_mutants_stop_at_the_seal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same-type, well-formed changes of any leaf (another real digest, a bigger bound, a
    flipped flag, a renamed engine) pass the schema and most reach the seal, which refuses them."""
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
            load_identity(pair.path, sealed_identities=pair.table)
        except Refused as exc:
            stats["by_sealed"] += ", sealed " in str(exc)
            return
        stats["accepted"] += 1

    run()
    with capsys.disabled():
        print(
            f"\nhypothesis well-formed leaf mutations: {stats['mutants']} mutants, "
            f"{stats['accepted']} accepted, {stats['by_sealed']} refused by the seal"
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
    path = REPO / "tools" / "freeze_identity.py"
    spec = importlib.util.spec_from_file_location("freeze_identity", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_freeze_tool_derives_the_bounds_from_a_real_calibration_and_refuses_any_other(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The shipped splitk calibration copied into a scratch archive: the tool writes the identity
    with the bounds the rule derives from it (none given), prints its sealed lines, and refuses a
    bound one ULP off, a basis of another lane and an unresolvable basis, writing nothing."""
    pytest.importorskip("qualify.engines.reference")
    import shutil

    freeze = _freeze_tool()
    lane = "nvfp4-native-splitk"
    shipped = json.loads((REPO / "contracts" / f"{lane}-identity-v1.json").read_bytes())
    uri = shipped["onboarding_qualification"]["basis"]
    run_id = uri.removeprefix("receipt://").partition("/")[0]
    archive = tmp_path / "receipts"
    shutil.copytree(REPO / "receipts" / run_id, archive / run_id)
    out = tmp_path / f"{lane}-identity-v1.json"
    argv = [
        "--lane", lane,
        "--producer-engine", "reference-numpy", "0.1.0", "abi-native",
        "--consumer-engine", "reference-numpy", "0.1.0", "abi-exact",
        "--basis", uri, "--archive-dir", str(archive), "--out", str(out),
    ]
    assert freeze.main(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    sealed = document_sha256(json.loads(out.read_bytes()))
    assert json.loads(out.read_bytes())["schema"] == "trust-ladder.onboarding-identity.v5"
    assert freeze.sealed_lines(lane, freeze.Seal(sealed, sha256_file(archive / run_id / "manifest.json"))) in printed
    identity = load_identity(out, sealed_identities={lane: sealed})
    assert identity.onboarding_qualification.full_logits == type(identity.onboarding_qualification.full_logits)(
        **shipped["onboarding_qualification"]["full_logits"])
    assert identity.calibration.set.sha256 == shipped["calibration"]["set"]["sha256"]
    assert out.read_bytes() == freeze.identity_bytes(identity)

    # Never over an existing file (unless --replace); a bound that does not follow, a basis of
    # another lane and an unresolvable basis never freeze.
    before = out.read_bytes()
    assert freeze.main(argv) == 2
    assert out.read_bytes() == before
    assert "exists; pass --replace" in capsys.readouterr().err
    derived = shipped["onboarding_qualification"]["full_logits"]["maximum_absolute"]
    off = [*argv[:-2], "--out", str(tmp_path / "off.json"), "--maximum-absolute", repr(math.nextafter(derived, 0.0))]
    assert freeze.main(off) == 2
    assert f"the basis gives {derived!r} by rule cell-max-plus-one-sd.v1" in capsys.readouterr().err
    other = [*argv[:-2], "--out", str(tmp_path / "other.json")]
    other[other.index(lane)] = "nvfp4-native-f16"
    assert freeze.main(other) == 2
    assert f"a calibration of lane '{lane}', not nvfp4-native-f16" in capsys.readouterr().err
    assert freeze.main([*argv[:-2], "--out", str(tmp_path / "x.json"), "--basis", "receipt://nope/x"]) == 2
    assert "does not resolve" in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in ("x.json", "off.json", "other.json"))



DRAFT_RULE_CALIBRATION = "20261207T042556Z-1cc33780f9cf9e90"
"""nvfp4-native-w4a4 on SmolLM2 judged by the teacher-forced rule's draft, which failed a
calibration whose fixture parts in more rows than the derived ceiling: a failed verdict."""


def test_a_failed_calibration_is_no_basis_to_freeze_from() -> None:
    """A calibration whose verdict failed is published as its result, never frozen from, even
    where its numbers are derivable (this one's are, by the teacher-forced rule)."""
    from qualify.contract.lanes import lane_spec
    from qualify.core.errors import Refused as Refusal

    freeze = _freeze_tool()
    with pytest.raises(Refusal, match="the calibration's verdict is 'failed', not 'passed'"):
        freeze.derived_numbers(lane_spec("nvfp4-native-w4a4"), f"receipt://{DRAFT_RULE_CALIBRATION}/command.log",
                               REPO / "receipts")


def test_refreeze_recomputes_the_artifact_digests_and_keeps_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An identity that pins an old known-answer digest (the arithmetic was changed since): --refreeze
    rewrites exactly the shipped identity, and prints its shipped seal."""
    freeze = _freeze_tool()
    shipped = REPO / "contracts" / "nvfp4-native-splitk-identity-v1.json"
    stale = json.loads(shipped.read_bytes())
    stale["consumer_engine"]["kat_sha256"] = digest("the arithmetic before a reviewed change")
    copy_path = tmp_path / shipped.name
    copy_path.write_text(json.dumps(stale, indent=2) + "\n", encoding="utf-8")
    assert freeze.main(["--refreeze", str(copy_path)]) == 0, capsys.readouterr().err
    assert copy_path.read_bytes() == shipped.read_bytes()
    lane = "nvfp4-native-splitk"
    seal = freeze.Seal(sealed_data.SEALED_IDENTITIES[lane], sealed_data.SEALED_BASIS_MANIFESTS[lane])
    assert freeze.sealed_lines(lane, seal) in capsys.readouterr().out


def test_refreeze_moves_a_source_pinned_v3_identity_to_known_answers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A v3 identity (an adapter source pin, numpy/BLAS versions in its ABIs, no known answers)
    re-freezes to exactly the shipped v5 identity: numbers, basis and rules kept."""
    freeze = _freeze_tool()
    shipped = REPO / "contracts" / "nvfp4-native-splitk-identity-v1.json"
    old = json.loads(shipped.read_bytes())
    old["schema"] = "trust-ladder.onboarding-identity.v3"
    old["adapter"] = {"name": "qualify-nvfp4-linear", "sha256": digest("adapter source")}
    for role in ("producer_engine", "consumer_engine"):
        engine = old[role]
        engine["abi"] += "+numpy-2.3.5+scipy-openblas-0.3.30"
        del engine["kat_sha256"]
    copy_path = tmp_path / shipped.name
    copy_path.write_text(json.dumps(old, indent=2) + "\n", encoding="utf-8")
    with pytest.raises(Refused, match="schema"):
        load_identity(copy_path)
    assert freeze.main(["--refreeze", str(copy_path)]) == 0, capsys.readouterr().err
    assert copy_path.read_bytes() == shipped.read_bytes()


@pytest.mark.published_model
@pytest.mark.slow
def test_refreeze_of_a_published_models_identity_uses_that_models_head_size(
    published_model: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--refreeze --model: the RoPE cache digest follows the chosen model's head size (64), not the
    shipped model's (32): a stale digest is rewritten to exactly the shipped identity."""
    from tests.support.published import NAME as PUBLISHED_MODEL

    freeze = _freeze_tool()
    shipped = REPO / "contracts" / "models" / PUBLISHED_MODEL / "kquant-exact-identity-v1.json"
    stale = json.loads(shipped.read_bytes())
    stale["rope"]["cache_sha256"] = digest("a RoPE cache of another head size")
    copy_path = tmp_path / shipped.name
    copy_path.write_text(json.dumps(stale, indent=2) + "\n", encoding="utf-8")
    assert freeze.main(["--model", PUBLISHED_MODEL, "--refreeze", str(copy_path)]) == 0, capsys.readouterr().err
    assert copy_path.read_bytes() == shipped.read_bytes()


def test_freeze_tool_needs_something_to_do(capsys: pytest.CaptureFixture[str]) -> None:
    assert _freeze_tool().main([]) == 2
    assert "expected --lane, --refreeze, --write-sealed or --write-schema" in capsys.readouterr().err


@pytest.mark.parametrize(("lane", "connector"), [
    (VLLM_VIA_CONNECTOR_LANE, None),
    ("vllm-to-vllm", {"name": "ExampleConnector", "sha256": digest("connector")}),
    (VLLM_VIA_CONNECTOR_LANE, {"name": "not a class name", "sha256": digest("connector")}),
])
def test_only_the_connector_lane_pins_a_connector(tmp_path: Path, lane: str, connector: Any) -> None:
    """Lane vllm-via-connector pins its connector (its seal name is the lane and the connector's
    name); any other lane naming a connector is refused, as is a connector name that is no class name."""
    pair = make_pair(tmp_path, lane)
    assert "connector" in refused(pair, mutated(pair.document, "connector", connector))


def test_each_connector_is_sealed_apart(tmp_path: Path) -> None:
    document = make_document(VLLM_VIA_CONNECTOR_LANE)
    first = parse_identity_document(document, where="first").seal_name
    other = mutated(document, "connector", {"name": "Other", "sha256": digest("connector")})
    second = parse_identity_document(other, where="second").seal_name
    assert (first, second) == (f"{VLLM_VIA_CONNECTOR_LANE}/ExampleConnector", f"{VLLM_VIA_CONNECTOR_LANE}/Other")

#!/usr/bin/env python3
"""Freeze a lane's onboarding identity from the real artifacts, and keep the sealed data in step.

Freeze (``--lane``): computes the SHA-256 of every pinned artifact (checkpoint files under
``model/``, tokenizer, main prompt via ``qualify.core.assets.prompt_sha256``, RoPE cache,
draft), derives the lane's target-cache identity, derives the bounds (and a rung-3 draft floor)
from the basis calibration receipt by the stated rules (``qualify/contract/rules.py``; a number
given with ``--maximum-absolute``/``--maximum-mean-absolute``/``--acceptance-floor`` must equal
the derived one, else the freeze is refused), pins the calibration set, the rules and the E2
controls criteria by digest, validates the document through the identity model, checks it the way
every load does, writes the identity JSON (schema v3, whose digest is over its RFC 8785 bytes;
never over an existing file unless ``--replace``; written whole via a temporary file) and prints
its sealed-data lines: the identity's digest and its basis receipt's ``manifest.json`` digest,
which pins every file of the (verified) basis receipt.

Engines exact by construction (the numpy engines) are pinned by ABI and known-answer digest
(``qualify.engines.kat``), computed from the engines the lane's factory builds here; an engine
this host cannot build (vLLM, CUDA) is pinned by ``--producer-engine``/``--consumer-engine``. An
engine measured where it runs (``MEASURED_ENGINE_NAMES``) carries the digest measured there: a
connector lane's from its basis receipt, a GPU engine's (a ``transformers`` lane's producer, a
``torch-llama`` lane's producer and consumer) from ``--producer-kat-evidence FILE`` and
``--consumer-kat-evidence FILE``, the document ``tools/measure_known_answer.py`` wrote on that GPU.
That digest is pinned only where the file's engine for the lane and role is the identity's engine of
that role (name, version and ABI equal), its measurements agree and its KAT input is this
harness's; else the freeze is refused. Without one, a freeze pinning such an engine that this host
cannot build is refused too: an identity pinning no digest for it would be refused by every run at
``identity sealed`` (absent evidence is failed evidence).

Re-freeze (``--refreeze PATH...``): recomputes those artifact digests and the numpy engines' ABI
and known-answer digests of existing identities, keeping their other engines, rules and basis
URIs -- for a reviewed change that moves no number: ``--refreeze contracts/*-identity-v1.json
--write-sealed``. With ``--producer-kat-evidence FILE`` (``--consumer-kat-evidence FILE``) it pins
the producer's (consumer's) measured digest (checked as above) in each identity it re-freezes:
``--refreeze contracts/transformers-cuda-*-identity-v1.json --producer-kat-evidence
bench/results/gpu-lanes/known-answers.json --write-sealed``; ``--refreeze
contracts/llama3-8b-shape-pd-identity-v1.json --producer-kat-evidence FILE --consumer-kat-evidence
FILE --write-sealed``, ``FILE`` ``bench/results/gpu-lanes/known-answers-llama3-8b-shape.json``. A
source-pinned v3/v4 identity is moved to v5/v6 (its ``adapter`` pin and the numpy/BLAS versions in
its ABIs dropped). (Retired v1/v2 identities are re-calibrated, not re-frozen.)

``--write-sealed`` regenerates ``qualify/contract/sealed_data.py`` whole from
``contracts/*-identity-v1.json`` and their basis receipts; ``--write-schema`` regenerates
``contracts/onboarding-identity.v3.schema.json`` from the identity model. Both are committed
in a reviewed change. (The ``-v1`` in an identity's file name is the lane identity's version, not
the schema's.)

The basis receipt is read from ``--archive-dir`` (default the checkout's ``receipts/``), but
``qualify identity check`` and every run resolve it under ``receipts/`` only: copy the calibration
receipt there first (``qualify calibrate`` prints the exact commands; ``docs/onboarding.md``).
Example (re-calibrating a shipped lane: ``--replace`` its identity)::

    cp -r ~/.local/share/trust-ladder/receipts/<run-id> receipts/
    .venv/bin/python tools/freeze_identity.py --lane nvfp4-native-splitk \\
        --basis receipt://<run-id>/command.log --replace --write-sealed
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from qualify.archive.layout import SUMMARY
from qualify.archive.reader import resolve_receipt_uri
from qualify.contract.controls import model_contracts_dir
from qualify.contract.identity import (
    BASIS_MANIFEST,
    DEFAULT_ARCHIVE_DIR,
    IDENTITY_SCHEMA_ID,
    IDENTITY_SCHEMA_IDS,
    IDENTITY_SCHEMA_PATHS,
    LINK_FLOOR_SCHEMA_ID,
    NON_DETERMINISTIC_SCHEMA_ID,
    RELPATH,
    SOURCE_PINNED_IDENTITY_SCHEMA_IDS,
    TEACHER_FORCED_SCHEMA_ID,
    Identity,
    identity_schema_text,
    identity_sha256,
    parse_identity_document,
)
from qualify.contract.lanes import (
    TORCH_LLAMA_MODELS,
    VLLM_VIA_CONNECTOR_LANE,
    LaneKind,
    LaneSpec,
    lane_spec,
    target_cache_identity,
)
from qualify.contract.rules import (
    BOUND_RULE,
    BOUND_RULE_STATEMENT,
    FIXTURE_ENVELOPE_RULE,
    FIXTURE_ENVELOPE_RULE_STATEMENT,
    FLOOR_RULE,
    FLOOR_RULE_STATEMENT,
    TEACHER_FORCED_BOUND_RULE,
    TEACHER_FORCED_BOUND_RULE_STATEMENT,
)
from qualify.contract.units import parse_logit_units
from qualify.core import model_choice
from qualify.core.assets import CONTRACTS_DIR, MAIN_PROMPT, MODEL_DIR, load_prompt, prompt_sha256
from qualify.core.digests import jcs_sha256, sha256_file
from qualify.core.errors import Refused, one_line
from qualify.core.strict_json import read_strict_json, schema_validator
from qualify.engines.chosen_model import rope_scaling
from qualify.engines.reference import rope_cache_sha256
from qualify.run.run_contract import connector_identity_path

DEFAULT_DRAFT = "model/gguf/eagle1-draft-q8_0.gguf"
"""The k-quant lane's EAGLE-1 draft weights (what ``speculative_draft.draft_sha256`` pins)."""

SEALED_DATA_PATH = REPO_ROOT / "qualify" / "contract" / "sealed_data.py"
SHIPPED_IDENTITIES = "*-identity-v1.json"

RAW_TOKEN_TEMPLATE_NAME = "raw-token-ids"
RAW_TOKEN_TEMPLATE_RULE = {
    "template": RAW_TOKEN_TEMPLATE_NAME,
    "rule": "prompt token ids are fed verbatim: no chat template, no BOS or EOS insertion",
}
"""The harness applies no chat template; its template digest is the SHA-256 of this rule's RFC 8785
bytes (the same bytes as the legacy canonical form: the rule holds strings only)."""


class Seal(NamedTuple):
    """What ``qualify/contract/sealed_data.py`` holds for one lane."""

    identity_sha256: str
    basis_manifest_sha256: str


def file_digests(relpaths: Sequence[str], what: str) -> tuple[dict[str, str], int]:
    """Repository-relative path -> SHA-256 (sorted), and the files' total size."""
    files: dict[str, str] = {}
    total = 0
    for relpath in relpaths:
        path = REPO_ROOT / relpath
        if not RELPATH.fullmatch(relpath) or not path.is_file():
            raise Refused(f"{what} {relpath}: not a repository-relative file")
        files[relpath] = sha256_file(path)
        total += path.stat().st_size
    return dict(sorted(files.items())), total


def repo_file_sha256(relpath: str, what: str) -> str:
    """SHA-256 of one repository-relative file."""
    return file_digests([relpath], what)[0][relpath]


def collect_checkpoint(spec: LaneSpec, override: Sequence[str] | None) -> tuple[dict[str, str], int]:
    """The lane's checkpoint files: ``override`` (repository-relative), else the map
    ``qualify.engines.factory.checkpoint_digests`` derives (what the producer service compares)."""
    if override:
        return file_digests(override, "--checkpoint")
    if model_choice.chosen() is not None:
        from qualify.engines.factory import chosen_checkpoint

        return chosen_checkpoint(spec.kind)
    try:
        from qualify.engines.factory import checkpoint_digests

        relpaths = list(checkpoint_digests(spec.kind))
    except Refused:
        raise
    except Exception as exc:
        raise Refused(
            f"checkpoint: qualify.engines.factory.checkpoint_digests failed "
            f"({type(exc).__name__}: {one_line(str(exc))}); pass --checkpoint RELPATH"
        ) from None
    return file_digests(relpaths, "checkpoint")


def engine_pins(spec: LaneSpec) -> tuple[dict[str, str | None], dict[str, str | None]]:
    """(producer, consumer) name/version/abi of the engines the factory builds for the lane."""
    try:
        from qualify.engines.factory import build_consumer, build_producer

        # Each pin (its known answer) is taken while its engine is the live one: a process holds
        # one vLLM engine at a time, so building the consumer closes a vLLM producer.
        producer = engine_pin(build_producer(spec.name, spec.mode))
        consumer = engine_pin(build_consumer(spec))
    except Refused:
        raise
    except Exception as exc:
        raise Refused(
            f"engines: building lane {spec.name} failed ({type(exc).__name__}: {one_line(str(exc))}); "
            f"pass --producer-engine and --consumer-engine"
        ) from None
    return producer, consumer


def engine_pin(engine: Any) -> dict[str, str | None]:
    """An engine's identity pin: name, version, ABI and, for an engine exact by construction, its
    known-answer digest (computed here, on this engine)."""
    from qualify.engines.kat import has_known_answer, known_answer_sha256

    kat = known_answer_sha256(engine) if has_known_answer(engine) else None
    return {**_engine(engine.name, engine.version, engine.abi), "kat_sha256": kat}


def named_engine_pin(given: Sequence[str], spec: LaneSpec, role: str,
                     measured: Mapping[str, Any] | None = None, evidence: Path | None = None
                     ) -> dict[str, str | None]:
    """An engine pin given on the command line (``--producer-engine``/``--consumer-engine``): an
    engine with a known-answer check that this host builds as given carries its digest (a connector
    lane's: the one its engine process measured in the basis calibration, ``measured``; an engine
    measured on its own machine: the one ``evidence`` records for it in ``role``,
    :func:`evidence_known_answer`);
    a measured engine this host cannot build, given no evidence, is refused; a pin of another build
    is pinned as given, with none (a run then refuses an engine with a known-answer check pinned
    without one)."""
    from qualify.engines.factory import build_consumer, producer_engine
    from qualify.engines.kat import KAT_ENGINE_NAMES, MEASURED_ENGINE_NAMES

    pin = _engine(*given)
    if pin["name"] not in KAT_ENGINE_NAMES:
        return pin
    if spec.name == VLLM_VIA_CONNECTOR_LANE:
        return {**pin, "kat_sha256": (measured or {}).get(role)}
    if evidence is not None:  # measured on the machine it runs on
        return {**pin, "kat_sha256": evidence_known_answer(evidence, spec.name, pin, role)}
    unbuildable = unbuildable_here(spec, role) if pin["name"] in MEASURED_ENGINE_NAMES else None
    if unbuildable is not None:  # an identity pinning no digest would be refused by every run
        raise Refused(f"--{role}-engine {pin['name']}: its known-answer digest is measured where it runs, and "
                      f"this host cannot build it ({unbuildable}); measure it there (tools/measure_known_answer.py) "
                      f"and pass --{role}-kat-evidence FILE")
    built = engine_pin(producer_engine(spec, spec.mode) if role == "producer" else build_consumer(spec))
    return built if [built[key] for key in ("name", "version", "abi")] == list(given) else pin


def unbuildable_here(spec: LaneSpec, role: str) -> str | None:
    """Why this host cannot build the lane's ``role`` engine to measure its KAT, or None where it can:
    a ``transformers`` lane's producer needs torch and the CUDA device its ABI names, a
    ``torch-llama`` lane's engines torch and the device and dtype its model file names (checked
    without loading or drawing the model)."""
    if spec.kind is LaneKind.TORCH_LLAMA:
        from qualify.core.assets import require_asset

        try:
            from qualify.engines.torch_llama import check_dtype_device, random_model
        except ImportError as exc:
            return f"torch is not installed ({one_line(str(exc))})"
        try:
            _, _, dtype, device = random_model(require_asset(TORCH_LLAMA_MODELS[spec.name]))
            check_dtype_device(dtype, device)
        except Refused as exc:
            return one_line(str(exc))
        return None
    if spec.kind is not LaneKind.TRANSFORMERS or role != "producer":
        return None
    from qualify.engines.factory import lane_producer_abi

    try:
        lane_producer_abi(spec)
    except Refused as exc:
        return one_line(str(exc))
    return None


def evidence_known_answer(path: Path, lane: str, pin: Mapping[str, str | None], role: str = "producer") -> str:
    """The KAT digest ``path`` (``tools/measure_known_answer.py``'s document) records for lane
    ``lane``'s ``role`` engine, once it is shown to be of the engine ``pin`` names (name, version,
    ABI), deterministic (every measurement equal) and of this harness's KAT input for the lane's
    vocabulary; refused otherwise."""
    from qualify.engines.kat import kat_input

    where = f"--{role}-kat-evidence {path}"
    entry, recorded_input = evidence_entry(read_strict_json(path, "known-answer evidence"), lane, role, where)
    engine = entry.get("engine")
    if not isinstance(engine, dict):
        engine = {}
    for key in ("name", "version", "abi"):
        if engine.get(key) != pin[key]:
            raise Refused(f"{where}: lane {lane}: measured on {role}_engine.{key} {engine.get(key)!r}, the "
                          f"identity pins {pin[key]!r}: a known answer measured under other pins is not pinned")
    expected_input = kat_input(lane_vocab(lane_spec(lane)))
    if recorded_input != expected_input:
        raise Refused(f"{where}: kat_input: found {recorded_input}, this harness's KAT input is {expected_input}")
    digest, measurements = entry.get("kat_sha256"), entry.get("measurements")
    if (not isinstance(digest, str) or len(digest) != 64 or not isinstance(measurements, list)
            or len(measurements) < 2 or any(found != digest for found in measurements)):
        raise Refused(f"{where}: lane {lane}: kat_sha256 {digest!r} is not what every measurement gave "
                      f"({measurements}): no known answer")
    return digest


def evidence_entry(document: Any, lane: str, role: str, where: str) -> tuple[dict[str, Any], Any]:
    """(the entry, the KAT input it records) of ``lane``'s ``role`` engine in a known-answer evidence
    document: schema v2 (per lane its ``kat_input`` and one entry per measured role) or v1 (one
    ``kat_input`` for the document and one producer entry per lane); refused where it has none."""
    from qualify.engines.kat import KAT_EVIDENCE_SCHEMA, KAT_EVIDENCE_SCHEMA_V1

    schema = document.get("schema") if isinstance(document, dict) else None
    if schema not in (KAT_EVIDENCE_SCHEMA, KAT_EVIDENCE_SCHEMA_V1):
        found = schema if isinstance(document, dict) else type(document).__name__
        raise Refused(f"{where}: schema: found {found!r}, expected {KAT_EVIDENCE_SCHEMA!r} (or "
                      f"{KAT_EVIDENCE_SCHEMA_V1!r})")
    lanes = document.get("lanes")
    measured = lanes.get(lane) if isinstance(lanes, dict) else None
    if schema == KAT_EVIDENCE_SCHEMA_V1:  # a producer entry per lane
        entry = measured if isinstance(measured, dict) and measured.get("role", "producer") == role else None
        recorded_input = document.get("kat_input")
    else:
        entry = measured.get(role) if isinstance(measured, dict) else None
        recorded_input = measured.get("kat_input") if isinstance(measured, dict) else None
    if not isinstance(entry, dict):
        raise Refused(f"{where}: records no measurement of lane {lane}" + ("" if role == "producer" else f"'s {role}"))
    return entry, recorded_input


def lane_vocab(spec: LaneSpec) -> int:
    """The vocabulary the lane's engines run (their KAT's token ids are drawn over it): a
    ``torch-llama`` lane's model file's, else the shipped model's (read as JSON: no torch)."""
    if spec.kind is LaneKind.TORCH_LLAMA:
        config_path = lane_model_dir(spec, None) / "config.json"
        vocab = _read_config(config_path).get("vocab_size")
        if isinstance(vocab, bool) or not isinstance(vocab, int):
            raise Refused(f"model config {config_path}: vocab_size: found {vocab!r}, expected an integer")
        return vocab
    from qualify.engines.checkpoint import load_config

    return load_config(MODEL_DIR).geometry.vocab


def _engine(name: str, version: str, abi: str) -> dict[str, str | None]:
    """A pin given by name (an engine this host cannot build): no known-answer digest."""
    return {"name": name, "version": version, "abi": abi, "kat_sha256": None}


TOKENIZER = MODEL_DIR / "tokenizer.json"
"""The tokenizer of the shipped prompts: every lane reads the same raw token ids."""


def tokenizer_sha256() -> str:
    """The shipped tokenizer's digest, or a chosen ``--model``'s (its tokenizer.json, or its GGUF)."""
    choice = model_choice.chosen()
    return sha256_file(TOKENIZER) if choice is None else choice.tokenizer_sha256


def model_geometry(spec: LaneSpec, model_dir: Path) -> tuple[float, int, int]:
    """(rope theta, head dim, max positions) of the lane's model: a chosen ``--model``'s as loaded,
    else ``model_dir/config.json``'s."""
    if model_choice.chosen() is not None:
        from qualify.engines.chosen_model import loaded_model

        geometry = loaded_model().geometry
        return geometry.rope_theta, geometry.head_dim, geometry.max_positions
    config_path = model_dir / "config.json"
    return _geometry(_read_config(config_path), config_path)


def lane_model_dir(spec: LaneSpec, override: str | None) -> Path:
    """The directory whose ``config.json`` gives a lane's RoPE base, head size and context: the
    shipped model's, or a ``torch-llama`` lane's random-model file's directory."""
    if override is not None:
        return Path(override)
    if spec.kind is LaneKind.TORCH_LLAMA:
        return (REPO_ROOT / TORCH_LLAMA_MODELS[spec.name]).parent
    return MODEL_DIR


def _read_config(path: Path) -> dict[str, Any]:
    document = read_strict_json(path, "model config")
    if not isinstance(document, dict):
        raise Refused(f"model config {path}: found {type(document).__name__}, expected a JSON object")
    return document


def _geometry(config: Mapping[str, Any], where: Path) -> tuple[float, int, int]:
    """(rope theta, head dim, max positions) of the model config."""
    try:
        theta = float(config["rope_theta"])
        head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
        max_positions = int(config["max_position_embeddings"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        raise Refused(f"model config {where}: missing rope_theta/head_dim/max_position_embeddings") from None
    return theta, head_dim, max_positions


def _prompt(name: str, tokens: int) -> tuple[int, str]:
    """(token count, ``prompt_sha256``) of the first ``tokens`` tokens of the named prompt."""
    ids = load_prompt(name)
    if len(ids) < tokens:
        raise Refused(f"prompt {name}: {len(ids)} tokens, expected at least {tokens}")
    return tokens, prompt_sha256(ids[:tokens])


def _basis_file(uri: str, archive_dir: Path) -> Path:
    """The basis receipt file, resolved and verified by the archive layer."""
    try:
        return resolve_receipt_uri(uri, archive_dir)
    except Refused as exc:
        raise Refused(f"--basis: {uri} does not resolve under {archive_dir} ({one_line(str(exc))}); copy the "
                      f"calibration receipt's directory into {archive_dir} first") from None


def basis_manifest_sha256(uri: str, archive_dir: Path) -> str:
    """SHA-256 of the basis receipt's ``manifest.json``, once the basis file resolves and the
    archive layer verified every file of that receipt against it (so the digest pins them all)."""
    _basis_file(uri, archive_dir)
    run_id = uri.removeprefix("receipt://").partition("/")[0]
    return sha256_file(_basis_file(f"receipt://{run_id}/{BASIS_MANIFEST}", archive_dir))


def connector_pin(args: argparse.Namespace) -> dict[str, str]:
    """A connector lane's ``connector``: the one ``--connector`` names, resolved here, which must be
    the one its calibration went through (the basis receipt's ``evidence/connector.json``)."""
    return _connector_basis(args)[0]


def connector_known_answers(args: argparse.Namespace) -> dict[str, str]:
    """The known-answer digests the basis calibration's engine processes measured, by role (the
    basis receipt's ``evidence/connector.json``); refused where it records none."""
    measured = _connector_basis(args)[1].get("kat")
    if not isinstance(measured, dict) or not all(isinstance(measured.get(role), str) for role in ("producer", "consumer")):
        raise Refused(f"basis {args.basis}: evidence/connector.json records no known-answer digests for its "
                      "engines (a calibration before vLLM known-answer checks): re-calibrate")
    return measured


def _connector_basis(args: argparse.Namespace) -> tuple[dict[str, str], dict[str, Any]]:
    from qualify.run.connector_lane import CONNECTOR_EVIDENCE, ConnectorRequest

    if args.connector is None:
        raise Refused(f"lane {VLLM_VIA_CONNECTOR_LANE}: pass --connector NAME (and its --connector-config, "
                      f"--connector-module) as calibrated")
    name, sha256 = ConnectorRequest(args.connector, args.connector_config, args.connector_module).resolve().pin
    basis_dir = _basis_file(args.basis, Path(args.archive_dir)).parent
    calibrated = read_strict_json(basis_dir / "evidence" / f"{CONNECTOR_EVIDENCE}.json", "connector evidence")
    if calibrated.get("pin") != {"name": name, "sha256": sha256} or calibrated.get("fault") is not None:
        raise Refused(f"--connector {args.connector}: pin {name} {sha256} differs from the basis receipt's "
                      f"{calibrated.get('pin')} (fault {calibrated.get('fault')})")
    return {"name": name, "sha256": sha256}, calibrated


def build_document(args: argparse.Namespace) -> dict[str, Any]:
    """The identity document of ``args.lane`` computed from the artifacts on disk (not yet
    validated: :func:`freeze` runs it through the identity model)."""
    spec: LaneSpec = lane_spec(args.lane)
    model_dir = lane_model_dir(spec, args.model_dir)

    files, total_bytes = collect_checkpoint(spec, args.checkpoint)
    if spec.name == VLLM_VIA_CONNECTOR_LANE:
        # Both engines run in engine processes: this host's vLLM facts, with the known-answer
        # digests those processes measured in the basis calibration.
        measured = connector_known_answers(args)
        from qualify.engines.vllm_engine import VllmEngine, check_pin, vllm_engine_abi

        here = (VllmEngine.name, check_pin(), vllm_engine_abi())
        producer = named_engine_pin(args.producer_engine or here, spec, "producer", measured)
        consumer = named_engine_pin(args.consumer_engine or here, spec, "consumer", measured)
    elif args.producer_engine and args.consumer_engine:
        producer = named_engine_pin(args.producer_engine, spec, "producer", evidence=args.producer_kat_evidence)
        consumer = named_engine_pin(args.consumer_engine, spec, "consumer", evidence=args.consumer_kat_evidence)
    else:
        built_producer, built_consumer = engine_pins(spec)
        producer = (named_engine_pin(args.producer_engine, spec, "producer", evidence=args.producer_kat_evidence)
                    if args.producer_engine else built_producer)
        consumer = (named_engine_pin(args.consumer_engine, spec, "consumer", evidence=args.consumer_kat_evidence)
                    if args.consumer_engine else built_consumer)
    producer = with_measured_known_answer(producer, spec, "producer", args.producer_kat_evidence)
    consumer = with_measured_known_answer(consumer, spec, "consumer", args.consumer_kat_evidence)

    connector = connector_pin(args) if spec.name == VLLM_VIA_CONNECTOR_LANE else None
    prompt_tokens, prompt_digest = _prompt(args.prompt, args.prompt_tokens)
    theta, head_dim, max_positions = model_geometry(spec, model_dir)

    _basis_file(args.basis, Path(args.archive_dir))
    derived = derived_numbers(spec, args.basis, Path(args.archive_dir))
    draft: dict[str, Any] | None = None
    if spec.speculative_draft:
        if args.draft_proposal_tokens is None:
            raise Refused(f"lane {spec.name}: pass --draft-proposal-tokens")
        follows("--acceptance-floor", args.acceptance_floor, derived.acceptance_floor, FLOOR_RULE)
        draft_sha256 = repo_file_sha256(args.draft, "--draft")
        draft_config = _read_config(model_dir / "draft_config.json")
        config = _read_config(model_dir / "config.json")
        draft = {
            "geometry": {
                "kind": draft_config.get("kind"),
                "layers": draft_config.get("layers"),
                "hidden_size": config.get("hidden_size"),
                "heads": config.get("num_attention_heads"),
                "kv_heads": config.get("num_key_value_heads"),
                "head_dim": head_dim,
                "proposal_tokens": args.draft_proposal_tokens,
            },
            "acceptance_floor": derived.acceptance_floor,
            "draft_sha256": draft_sha256,
        }
    elif args.acceptance_floor is not None or args.draft_proposal_tokens is not None or args.draft:
        raise Refused(f"lane {spec.name}: declares no speculative draft; drop the draft options")

    full_logits: dict[str, Any] = {"mode": spec.recipe.full_logits_mode}
    bounded = spec.recipe.full_logits_mode == "bounded-drift"
    if not bounded and (args.maximum_absolute is not None or args.maximum_mean_absolute is not None):
        raise Refused(f"lane {spec.name}: recipe {spec.recipe.value} is exact; drop the bounds")
    teacher_forced = derived.teacher_forced
    if teacher_forced is not None:
        # The lane parts from the cold recompute: judged teacher-forced (v7), four numbers sealed.
        full_logits = {"mode": "teacher-forced"}
        for name in ("maximum_absolute", "maximum_mean_absolute"):
            full_logits[name] = follows(f"--{name.replace('_', '-')}", getattr(args, name),
                                        getattr(teacher_forced, name), TEACHER_FORCED_BOUND_RULE)
        full_logits["near_tie_margin"] = teacher_forced.near_tie_margin
        full_logits["maximum_changed_row_share"] = teacher_forced.maximum_changed_row_share
    elif bounded:
        full_logits["maximum_absolute"] = follows("--maximum-absolute", args.maximum_absolute,
                                                  derived.maximum_absolute, BOUND_RULE)
        full_logits["maximum_mean_absolute"] = follows("--maximum-mean-absolute", args.maximum_mean_absolute,
                                                       derived.maximum_mean_absolute, BOUND_RULE)

    envelope = derived.envelope
    schema = (NON_DETERMINISTIC_SCHEMA_ID if envelope is not None
              else IDENTITY_SCHEMA_ID if teacher_forced is None else TEACHER_FORCED_SCHEMA_ID)
    qualification_envelope = {} if envelope is None else {"fixture_envelope": sealed_envelope(envelope)}
    return {
        "schema": schema,
        "lane": spec.name,
        "lane_kind": spec.kind.value,
        "recipe": spec.recipe.value,
        "rung": spec.recipe.rung,
        "producer_mode": spec.mode.value,
        "native_variant": None if spec.variant is None else spec.variant.value,
        "onboarding_qualification": {
            "schema": spec.recipe.onboarding_schema,
            "prompt_tokens": prompt_tokens,
            "output_tokens": args.output_tokens,
            "repetitions": args.repetitions,
            "prompt_sha256": prompt_digest,
            "require_exact_tokens": teacher_forced is None,
            "require_deterministic_remote_output": envelope is None,
            "full_logits": full_logits,
            "basis": args.basis,
            **qualification_envelope,
        },
        "target_cache_identity_sha256": target_cache_identity(spec, files, str(producer["abi"])),
        "checkpoint": {"files": files, "total_bytes": total_bytes},
        "producer_engine": producer,
        "consumer_engine": consumer,
        "connector": connector,
        "tokenizer_sha256": tokenizer_sha256(),
        "prompt": {"name": args.prompt, "tokens": prompt_tokens, "sha256": prompt_digest},
        "prompt_template": {"name": RAW_TOKEN_TEMPLATE_NAME, "sha256": jcs_sha256(RAW_TOKEN_TEMPLATE_RULE)},
        "context_policy": {"handoff_positions": prompt_tokens - 1, "max_positions": max_positions},
        "rope": {"theta": theta, "cache_sha256": rope_cache_sha256(theta, head_dim, max_positions, rope_scaling())},
        "logit_units": parse_logit_units(args.logit_units).model_dump(mode="json"),
        "speculative_draft": draft,
        "calibration": derived.calibration,
        "controls": derived.controls,
        **({} if teacher_forced is None and envelope is None else {"link_floor": None}),
    }


def sealed_envelope(envelope: Any) -> dict[str, Any]:
    """An identity's ``onboarding_qualification.fixture_envelope`` for the envelope its basis
    states (:class:`qualify.judge.envelope.FixtureEnvelope`): its rule as stated, counts, each
    series' multiple and the digest of its ceilings (the ceilings stay in the basis receipt)."""
    from qualify.judge.envelope import SERIES_NAMES, ceilings_sha256

    return {"rule": {"name": FIXTURE_ENVELOPE_RULE, "statement": FIXTURE_ENVELOPE_RULE_STATEMENT},
            "handoffs": envelope.handoffs, "producer_starts": envelope.starts,
            "multipliers": {name: k for (name, _), k in zip(SERIES_NAMES, envelope.multipliers, strict=True)},
            "ceilings_sha256": ceilings_sha256(envelope)}


class Derived(NamedTuple):
    """What the basis receipt gives by the stated rules (the only numbers a freeze may seal)."""

    maximum_absolute: float | None
    maximum_mean_absolute: float | None
    acceptance_floor: float | None
    calibration: dict[str, Any]
    controls: dict[str, str] | None
    teacher_forced: Any = None  # TeacherForcedBounds when the lane parts from the cold recompute
    envelope: Any = None  # FixtureEnvelope when the basis declares its producer non-deterministic


def derived_numbers(spec: LaneSpec, basis_uri: str, archive_dir: Path) -> Derived:
    """The bounds and draft floor the basis calibration receipt gives by the stated rules, and the
    calibration/controls blocks naming what it measured; refuses a basis that is not a calibration
    of this lane under the committed calibration set, or that does not judge."""
    from qualify.contract.controls import load_calibration_set, load_controls_criteria
    from qualify.judge.calibration import (
        anchor_draft_counts,
        calibration_cells,
        declares_envelope,
        derive_acceptance_floor,
        derive_bounds,
        derive_teacher_forced_bounds,
        fixture_records,
        keeps_tokens,
    )
    from qualify.judge.envelope import derive_fixture_envelope
    from qualify.run.fixture_envelope import basis_envelope_series
    from qualify.run.run_contract import receipt_evidence, receipt_sample_records

    run_id = basis_uri.removeprefix("receipt://").partition("/")[0]
    receipt = archive_dir / run_id
    evidence = receipt_evidence(receipt, "calibration")
    records = receipt_sample_records(receipt)
    if evidence.get("lane") != spec.name:
        raise Refused(f"--basis {basis_uri}: a calibration of lane {evidence.get('lane')!r}, not {spec.name}")
    summary = read_strict_json(receipt / SUMMARY, f"--basis {basis_uri}: {SUMMARY}")
    if not isinstance(summary, dict) or summary.get("status") != "passed":
        status = summary.get("status") if isinstance(summary, dict) else None
        raise Refused(f"--basis {basis_uri}: the calibration's verdict is {status!r}, not 'passed': a failed "
                      f"calibration is no basis (its receipt is published as its result)")
    calibration_set, set_digest = load_calibration_set()
    stated_set = {"name": calibration_set.name, "sha256": set_digest}
    if evidence.get("set") != stated_set:
        raise Refused(f"--basis {basis_uri}: measured calibration set {evidence.get('set')!r}, the committed set is "
                      f"{stated_set!r}; re-calibrate")
    cells, problems = calibration_cells(evidence, records)
    bounds = derive_bounds(cells)
    if problems or bounds is None:
        raise Refused(f"--basis {basis_uri}: its cells do not give a bound: {'; '.join(problems) or 'fewer than 2 cells'}")
    envelope = None
    if declares_envelope(evidence):  # a producer declared non-deterministic: its envelope, no anchor
        series, starts = basis_envelope_series(receipt, evidence)
        try:
            envelope = derive_fixture_envelope(series, starts=starts)
        except Refused as exc:
            raise Refused(f"--basis {basis_uri}: its envelope handoffs state no fixture envelope: "
                          f"{one_line(str(exc))}") from None
    teacher_forced = None
    if spec.recipe.rung == 2 and not keeps_tokens(fixture_records(evidence, records)):
        teacher_forced = derive_teacher_forced_bounds(cells)
        if teacher_forced is None:
            raise Refused(f"--basis {basis_uri}: the lane parts from the cold recompute and its cells do not record "
                          f"teacher-forced rows; re-calibrate")
    counts = anchor_draft_counts(evidence)
    floor = derive_acceptance_floor(*counts) if spec.speculative_draft and counts is not None else None
    if spec.speculative_draft and floor is None:
        raise Refused(f"--basis {basis_uri}: its fixture anchor recorded no draft counts; re-calibrate")
    criteria, criteria_digest = load_controls_criteria()
    controls = {"name": criteria.name, "sha256": criteria_digest} if spec.name in criteria.lanes else None
    if controls is not None and evidence.get("controls") != controls:
        raise Refused(f"--basis {basis_uri}: lane {spec.name} is preregistered in {criteria.name}, its basis "
                      f"measured controls {evidence.get('controls')!r}; re-calibrate with the controls")
    return Derived(
        maximum_absolute=bounds.maximum_absolute if spec.recipe.full_logits_mode == "bounded-drift" else None,
        maximum_mean_absolute=bounds.maximum_mean_absolute if spec.recipe.full_logits_mode == "bounded-drift" else None,
        acceptance_floor=floor,
        calibration={"set": stated_set,
                     "bound_rule": ({"name": BOUND_RULE, "statement": BOUND_RULE_STATEMENT} if teacher_forced is None
                                    else {"name": TEACHER_FORCED_BOUND_RULE,
                                          "statement": TEACHER_FORCED_BOUND_RULE_STATEMENT}),
                     "floor_rule": ({"name": FLOOR_RULE, "statement": FLOOR_RULE_STATEMENT}
                                    if spec.speculative_draft else None)},
        controls=controls,
        teacher_forced=teacher_forced,
        envelope=envelope,
    )


def with_measured_known_answer(pin: dict[str, str | None], spec: LaneSpec, role: str,
                               evidence: Path | None) -> dict[str, str | None]:
    """``pin`` with the ``role`` engine's digest ``evidence`` records (measured elsewhere: it must be
    of this engine, and agree with the digest this host gave where it built the engine); ``pin`` as
    it is without evidence."""
    if evidence is None:
        return pin
    measured_kat = evidence_known_answer(evidence, spec.name, pin, role)
    if pin["kat_sha256"] not in (None, measured_kat):
        raise Refused(f"--{role}-kat-evidence {evidence}: lane {spec.name}: records {measured_kat}, this host's "
                      f"{pin['name']} engine gives {pin['kat_sha256']}")
    return {**pin, "kat_sha256": measured_kat}


def follows(option: str, given: float | None, derived: float | None, rule: str) -> float:
    """The derived number; a number given on the command line must be exactly it (a freeze seals
    nothing its basis does not give by the stated rule)."""
    if derived is None:
        raise Refused(f"{option}: the basis gives no value by rule {rule}")
    if given is not None and float(given) != derived:
        raise Refused(f"{option}: found {given!r}, the basis gives {derived!r} by rule {rule}; a sealed number "
                      f"must follow from its basis")
    return derived


def refrozen_document(identity: Identity, args: argparse.Namespace) -> dict[str, Any]:
    """``identity`` with every artifact digest recomputed from disk and the current schema version;
    engines, rule bounds and basis URI kept. The target-cache identity is re-derived from the new
    checkpoint digests."""
    spec = identity.spec
    # The chosen --model's head size where the identity is a published model's, else the lane's.
    _, head_dim, _ = model_geometry(spec, lane_model_dir(spec, args.model_dir))
    document = identity.document()

    files, total_bytes = (collect_checkpoint(spec, None) if identity.model_name is not None
                          else file_digests(list(identity.checkpoint.files), "checkpoint"))
    if identity.prompt_template.name != RAW_TOKEN_TEMPLATE_NAME:
        raise Refused(f"--refreeze: prompt_template.name: found {identity.prompt_template.name!r}, expected "
                      f"{RAW_TOKEN_TEMPLATE_NAME!r}")
    _, prompt_digest = _prompt(identity.prompt.name, identity.prompt.tokens)
    rope = identity.rope
    max_positions = identity.context_policy.max_positions

    if not identity.teacher_forced and identity.deterministic_producer:  # v7 and v8 keep their version
        document["schema"] = LINK_FLOOR_SCHEMA_ID if "link_floor" in document else IDENTITY_SCHEMA_ID
    document["checkpoint"] = {"files": files, "total_bytes": total_bytes}
    document["producer_engine"], document["consumer_engine"] = refrozen_engines(identity)
    for role, evidence in (("producer", args.producer_kat_evidence), ("consumer", args.consumer_kat_evidence)):
        if evidence is not None:  # the engine's KAT, measured where it runs
            pin = document[f"{role}_engine"]
            pin["kat_sha256"] = evidence_known_answer(evidence, spec.name, pin, role)
    document["target_cache_identity_sha256"] = target_cache_identity(spec, files, document["producer_engine"]["abi"])
    document["tokenizer_sha256"] = tokenizer_sha256()
    document["prompt"]["sha256"] = prompt_digest
    document["onboarding_qualification"]["prompt_sha256"] = prompt_digest
    document["prompt_template"]["sha256"] = jcs_sha256(RAW_TOKEN_TEMPLATE_RULE)
    document["rope"]["cache_sha256"] = rope_cache_sha256(rope.theta, head_dim, max_positions, rope_scaling())
    if document["speculative_draft"] is not None:
        document["speculative_draft"]["draft_sha256"] = repo_file_sha256(args.draft or DEFAULT_DRAFT, "--draft")
    return document


def check_follows_basis(identity: Identity, archive_dir: Path) -> None:
    """The check every load repeats: the sealed numbers follow from the basis by the stated rules,
    and the basis's controls judge (:mod:`qualify.run.run_contract`)."""
    from qualify.run.run_contract import basis_controls, basis_rule_problems, receipt_evidence, receipt_sample_records

    run_id = identity.onboarding_qualification.basis.removeprefix("receipt://").partition("/")[0]
    receipt = archive_dir / run_id
    evidence = receipt_evidence(receipt, "calibration")
    problems = basis_rule_problems(identity, evidence, receipt_sample_records(receipt))
    if problems:
        raise Refused(f"identity {identity.lane}: {problems[0]}")
    if not identity.deterministic_producer:  # its sealed envelope, re-derived from the basis's series
        from qualify.run.fixture_envelope import basis_envelope

        basis_envelope(identity, receipt, evidence, where=f"identity {identity.lane}")
    basis_controls(identity, receipt)


def seal_of(identity: Identity, archive_dir: Path) -> Seal:
    """The identity's sealed data: its digest and its verified basis receipt's manifest digest."""
    return Seal(identity_sha256(identity), basis_manifest_sha256(identity.onboarding_qualification.basis, archive_dir))


def _entry(lane: str, digest: str) -> str:
    return f'    "{lane}": "{digest}",\n'


def sealed_lines(lane: str, seal: Seal) -> str:
    """The lane's two entries of ``qualify/contract/sealed_data.py``, as printed for review."""
    return (
        f"# qualify/contract/sealed_data.py, SEALED_IDENTITIES:\n{_entry(lane, seal.identity_sha256)}"
        f"# qualify/contract/sealed_data.py, SEALED_BASIS_MANIFESTS:\n{_entry(lane, seal.basis_manifest_sha256)}"
    )


def sealed_data_source(seals: Mapping[str, Seal]) -> str:
    """The whole of ``qualify/contract/sealed_data.py`` for these lanes (sorted by lane)."""
    lanes = sorted(seals)
    identities = "".join(_entry(lane, seals[lane].identity_sha256) for lane in lanes)
    bases = "".join(_entry(lane, seals[lane].basis_manifest_sha256) for lane in lanes)
    return (
        '"""Sealed digests of the shipped onboarding identities: what each lane must present.\n'
        "\n"
        "Generated by ``tools/freeze_identity.py --write-sealed`` from ``contracts/*-identity-v1.json`` and\n"
        "their basis receipts under ``receipts/``. An identity is accepted only if its digest equals its\n"
        "lane's entry here, so relaxing a bound in the JSON fails onboarding: a sealed identity changes\n"
        "only by a re-freeze, committed in front of a reviewer (seed §32.2). Its basis receipt is pinned\n"
        "whole: the SHA-256 of the receipt's ``manifest.json``, which lists every file's SHA-256.\n"
        '"""\n'
        "\n"
        "from __future__ import annotations\n"
        "\n"
        "from collections.abc import Mapping\n"
        "from types import MappingProxyType\n"
        "\n"
        "SEALED_IDENTITIES: Mapping[str, str] = MappingProxyType({\n"
        f"{identities}"
        "})\n"
        '"""Lane -> SHA-256 of its frozen identity (``qualify.core.digests.document_sha256``: over the\n'
        'RFC 8785 bytes of a v3 identity)."""\n'
        "\n"
        "SEALED_BASIS_MANIFESTS: Mapping[str, str] = MappingProxyType({\n"
        f"{bases}"
        "})\n"
        '"""Lane -> SHA-256 of the ``manifest.json`` of the basis receipt (``onboarding_qualification.basis``)\n'
        "its rule was calibrated from; ``qualify.contract.identity.check_basis_receipt`` also checks every\n"
        'file of that receipt against the manifest."""\n'
    )


def shipped_seals(contracts_dir: Path, archive_dir: Path) -> dict[str, Seal]:
    """Seal name (the lane, or ``<model>/<lane>``) -> seal of every identity file in ``contracts_dir``
    and its ``models/<name>/``; a lane shipped twice for one model is refused."""
    seals: dict[str, Seal] = {}
    paths = [*contracts_dir.glob(SHIPPED_IDENTITIES), *contracts_dir.glob(f"models/*/{SHIPPED_IDENTITIES}"),
             *contracts_dir.glob(f"connectors/{SHIPPED_IDENTITIES}"),
             *contracts_dir.glob(f"models/*/connectors/{SHIPPED_IDENTITIES}")]
    for path in sorted(paths):
        where = f"identity {path}"
        identity = parse_identity_document(read_strict_json(path, "identity"), where=where)
        if identity.seal_name in seals:
            raise Refused(f"{where}: lane {identity.seal_name} is already shipped by another identity file")
        seals[identity.seal_name] = seal_of(identity, archive_dir)
    return seals


def write_file(path: Path, data: bytes, replace: bool) -> None:
    """Write ``data`` whole (temporary file then rename); refuse to overwrite unless asked."""
    if path.exists() and not replace:
        raise Refused(f"{path}: exists; pass --replace to overwrite it")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def identity_bytes(identity: Identity) -> bytes:
    """The committed form of an identity file: two-space indented JSON in report order, and a newline."""
    return json.dumps(identity.document(), indent=2, ensure_ascii=False, allow_nan=False).encode("utf-8") + b"\n"


def default_proposal_tokens() -> int | None:
    """Draft tokens per step the speculative engine uses, if that module says."""
    try:
        from qualify.engines.speculative import DEFAULT_PROPOSAL_TOKENS
    except Exception:
        return None
    return int(DEFAULT_PROPOSAL_TOKENS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="freeze_identity", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--lane", help="freeze a new identity of this lane (qualify/contract/lanes.py)")
    what.add_argument("--refreeze", metavar="PATH", nargs="+",
                      help="recompute the artifact digests of these identity files (engines, rule, basis kept)")
    parser.add_argument("--write-sealed", action="store_true",
                        help="then regenerate qualify/contract/sealed_data.py from contracts/*-identity-v1.json")
    parser.add_argument("--write-schema", action="store_true",
                        help="first regenerate contracts/onboarding-identity.v3.schema.json from the identity model")
    parser.add_argument("--producer-engine", nargs=3, metavar=("NAME", "VERSION", "ABI"),
                        help="default: what qualify.engines.factory.build_producer reports")
    parser.add_argument("--consumer-engine", nargs=3, metavar=("NAME", "VERSION", "ABI"),
                        help="default: what qualify.engines.factory.build_consumer reports")
    parser.add_argument("--producer-kat-evidence", type=Path, metavar="FILE",
                        help="pin the producer's known-answer digest measured where it runs, from this "
                             "tools/measure_known_answer.py document (its engine must be the pinned one)")
    parser.add_argument("--consumer-kat-evidence", type=Path, metavar="FILE",
                        help="the same for the consumer (a torch-llama lane's, measured on its GPU)")
    parser.add_argument("--basis", help="receipt://<run-id>/<file> of the calibration (with --lane)")
    parser.add_argument("--maximum-absolute", type=float,
                        help="rung-2 bound (max abs logit delta): derived from --basis; if given, must equal it")
    parser.add_argument("--maximum-mean-absolute", type=float,
                        help="rung-2 bound (mean abs delta): derived from --basis; if given, must equal it")
    parser.add_argument("--acceptance-floor", type=float,
                        help="rung-3 draft acceptance floor: derived from --basis; if given, must equal it")
    parser.add_argument("--draft-proposal-tokens", type=int,
                        help="rung-3 draft tokens per step (default: the speculative engine's)")
    parser.add_argument("--link-floor-gbps", type=float, metavar="GBIT_PER_S",
                        help="declare a link-rate floor (schema v4): every handoff must cross its network link at "
                             "this payload rate or faster, so the lane qualifies only against a producer at "
                             "--producer-at HOST:PORT")
    parser.add_argument("--connector", metavar="NAME", help="lane vllm-via-connector: the connector calibrated")
    parser.add_argument("--connector-config", metavar="JSON", help="its config, as calibrated")
    parser.add_argument("--connector-module", metavar="MODULE", help="its module, as calibrated")
    parser.add_argument("--checkpoint", action="append", metavar="RELPATH",
                        help="repository-relative checkpoint file (repeatable; default: "
                        "qualify.engines.factory.checkpoint_digests of the lane kind)")
    parser.add_argument("--draft", metavar="RELPATH",
                        help=f"rung-3 draft weights, repository-relative (default {DEFAULT_DRAFT})")
    parser.add_argument("--prompt", default=MAIN_PROMPT, help="held-out prompt name")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--logit-units", default="raw", help="raw or tanh-softcap:<cap>")
    parser.add_argument("--model-dir", default=None,
                        help="the model directory whose config.json gives RoPE and context (default: the lane's)")
    parser.add_argument("--model", metavar="NAME|PATH",
                        help="freeze (or re-freeze) for this model (a published name, a Hugging Face directory or a "
                        "GGUF file); default out contracts/models/<name>/<lane>-identity-v1.json")
    parser.add_argument("--archive-dir", default=str(DEFAULT_ARCHIVE_DIR),
                        help="where receipt:// URIs resolve (default receipts/ in the checkout)")
    parser.add_argument("--out", help="identity JSON to write (default contracts/<lane>-identity-v1.json)")
    parser.add_argument("--replace", action="store_true", help="overwrite an existing --out file")
    return parser


def declare_link_floor(document: dict[str, Any], gbit_per_s: float | None) -> dict[str, Any]:
    """The document with a link-rate floor declared (schema v4), or as it was when none is given."""
    if gbit_per_s is None:
        return document
    kept = (TEACHER_FORCED_SCHEMA_ID, NON_DETERMINISTIC_SCHEMA_ID)  # a floor or none already
    schema = document["schema"] if document.get("schema") in kept else LINK_FLOOR_SCHEMA_ID
    return {**document, "schema": schema, "link_floor": {"gbit_per_s_minimum": gbit_per_s}}


def _freeze(args: argparse.Namespace) -> None:
    spec = lane_spec(args.lane)
    if args.basis is None:
        raise Refused(f"lane {spec.name}: pass --basis receipt://<run-id>/<file> (the calibration receipt)")
    if spec.speculative_draft:
        args.draft = args.draft or DEFAULT_DRAFT
        if args.draft_proposal_tokens is None:
            args.draft_proposal_tokens = default_proposal_tokens()
    out = (Path(args.out) if args.out else connector_identity_path(args.connector) if spec.name == VLLM_VIA_CONNECTOR_LANE
           else model_contracts_dir() / f"{spec.name}-identity-v1.json")
    identity = parse_identity_document(declare_link_floor(build_document(args), args.link_floor_gbps),
                                       where=f"identity {out}")
    seal = seal_of(identity, Path(args.archive_dir))
    check_follows_basis(identity, Path(args.archive_dir))
    write_file(out, identity_bytes(identity), args.replace)
    print(f"# wrote {out} (identity_sha256 {seal.identity_sha256})")
    print(sealed_lines(identity.seal_name, seal), end="")


def unpinned_sources(document: Any) -> Any:
    """A source-pinned v3/v4 identity document as v5/v6 (its numbers untouched): the ``adapter``
    source pin dropped, the numpy/BLAS versions cut from the numpy engines' ABIs and their
    known-answer digests left to :func:`refrozen_engines`. Any other document as it is."""
    if not isinstance(document, dict) or document.get("schema") not in SOURCE_PINNED_IDENTITY_SCHEMA_IDS:
        return document
    moved = {key: value for key, value in document.items() if key != "adapter"}
    moved["schema"] = LINK_FLOOR_SCHEMA_ID if "link_floor" in document else IDENTITY_SCHEMA_ID
    for role in ("producer_engine", "consumer_engine"):
        engine = dict(document[role])
        engine["abi"] = "+".join(part for part in str(engine["abi"]).split("+")
                                 if not part.startswith(("numpy-2", "numpy-1", "scipy-openblas-")))
        moved[role] = {**engine, "kat_sha256": None}
    # The cache identity follows the producer ABI; refrozen_document derives it again.
    moved["target_cache_identity_sha256"] = target_cache_identity(
        lane_spec(moved["lane"]), moved["checkpoint"]["files"], moved["producer_engine"]["abi"])
    return moved


def refrozen_engines(identity: Identity) -> tuple[dict[str, Any], dict[str, Any]]:
    """(producer, consumer) pins: a numpy engine's rebuilt here with its known-answer digest; any
    other engine's (vLLM, CUDA) kept as pinned (a vLLM engine's digest was measured where it runs)."""
    from qualify.engines.factory import build_consumer, producer_engine
    from qualify.engines.kat import EXACT_ENGINE_NAMES

    spec = identity.spec
    pins = []
    for pinned, role in ((identity.producer_engine, "producer"), (identity.consumer_engine, "consumer")):
        if pinned.name not in EXACT_ENGINE_NAMES:
            pins.append(pinned.model_dump(mode="json"))
            continue
        pins.append(engine_pin(producer_engine(spec, spec.mode) if role == "producer" else build_consumer(spec)))
    return pins[0], pins[1]


def _refreeze(path: Path, args: argparse.Namespace) -> None:
    where = f"identity {path}"
    old = parse_identity_document(unpinned_sources(read_strict_json(path, "identity")), where=where)
    identity = parse_identity_document(declare_link_floor(refrozen_document(old, args), args.link_floor_gbps),
                                       where=where)
    seal = seal_of(identity, Path(args.archive_dir))
    check_follows_basis(identity, Path(args.archive_dir))
    write_file(path, identity_bytes(identity), replace=True)
    print(f"# re-froze {path}: identity_sha256 {identity_sha256(old)} -> {seal.identity_sha256}")
    print(sealed_lines(identity.seal_name, seal), end="")


def _write_sealed(args: argparse.Namespace) -> None:
    seals = shipped_seals(CONTRACTS_DIR, Path(args.archive_dir))
    write_file(SEALED_DATA_PATH, sealed_data_source(seals).encode("utf-8"), replace=True)
    print(f"# wrote {SEALED_DATA_PATH} ({len(seals)} lanes: {', '.join(sorted(seals))})")


def _write_schema() -> None:
    for schema_id in IDENTITY_SCHEMA_IDS:
        write_file(IDENTITY_SCHEMA_PATHS[schema_id], identity_schema_text(schema_id).encode("utf-8"), replace=True)
        print(f"# wrote {IDENTITY_SCHEMA_PATHS[schema_id]}")
    schema_validator.cache_clear()  # later steps in this process validate against the new files


def main(argv: Sequence[str] | None = None) -> int:
    """Freeze, re-freeze and/or regenerate: 0 done, 2 refused (one line on stderr)."""
    args = build_parser().parse_args(argv)
    if not (args.lane or args.refreeze or args.write_sealed or args.write_schema):
        print("freeze_identity: refused: expected --lane, --refreeze, --write-sealed or --write-schema",
              file=sys.stderr)
        return 2
    try:
        if args.model is not None:
            from qualify.engines.chosen_model import use_model

            use_model(args.model)
        if args.write_schema:
            _write_schema()
        if args.lane:
            _freeze(args)
        for path in args.refreeze or ():
            _refreeze(Path(path), args)
        if args.write_sealed:
            _write_sealed(args)
    except Refused as exc:
        print(f"freeze_identity: refused: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except (OSError, KeyError, TypeError, ValueError) as exc:
        print(f"freeze_identity: refused: {type(exc).__name__}: {one_line(str(exc))}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

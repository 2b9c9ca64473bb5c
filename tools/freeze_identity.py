#!/usr/bin/env python3
"""Freeze one lane's onboarding identity from the real artifacts, in one command.

Computes the SHA-256 of every pinned artifact (checkpoint files under ``model/``, tokenizer,
main prompt via ``qualify.core.assets.prompt_sha256``, RoPE cache, adapter, draft, basis receipt),
derives the lane's target-cache identity, validates the result through the same layers as
``qualify identity check``, then writes the identity JSON (never over an existing file unless
``--replace``; written whole via a temporary file) and prints the ``SealedIdentity(...)`` block
to paste into ``qualify/contract/sealed.py``.

Example (rung 2, after the calibration run archived its receipt)::

    .venv/bin/python tools/freeze_identity.py --lane nvfp4-native-splitk \\
        --producer-engine qualify-reference 0.1.0 nvfp4-splitk-v1 \\
        --consumer-engine qualify-reference 0.1.0 nvfp4-exact-v1 \\
        --maximum-absolute 11.0 --maximum-mean-absolute 1.25 \\
        --basis receipt://<run-id>/command.log
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np

from qualify.contract.identity import DEFAULT_ARCHIVE_DIR, validate_identity_document
from qualify.contract.lanes import LANES, LaneSpec, lane_spec, target_cache_identity
from qualify.contract.sealed import (
    RECEIPT_URI,
    RELPATH,
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
from qualify.core.assets import CONTRACTS_DIR, MAIN_PROMPT, MODEL_DIR, load_prompt, prompt_sha256
from qualify.core.digests import canonical_json_bytes, canonical_sha256, sha256_bytes, sha256_file
from qualify.core.errors import Refused, one_line
from qualify.engines.factory import ADAPTER_SOURCES

DEFAULT_DRAFT = "model/gguf/eagle1-draft-q8_0.gguf"
"""The k-quant lane's EAGLE-1 draft weights (what ``speculative_draft.draft_sha256`` pins)."""

RAW_TOKEN_TEMPLATE_NAME = "raw-token-ids"
RAW_TOKEN_TEMPLATE_RULE = {
    "template": RAW_TOKEN_TEMPLATE_NAME,
    "rule": "prompt token ids are fed verbatim: no chat template, no BOS or EOS insertion",
}
"""The harness applies no chat template; its template digest is the canonical SHA-256 of this."""


def rope_cache_sha256(theta: float, head_dim: int, max_positions: int) -> str:
    """SHA-256 of the RoPE cache the reference engine builds (``rope_tables``): float32
    little-endian cos then sin, ``[max_positions, head_dim]``."""
    try:
        from qualify.engines.reference import rope_tables
    except ImportError as exc:
        raise Refused(f"rope: qualify.engines.reference.rope_tables unavailable ({exc})") from None
    cos, sin = rope_tables(max_positions, head_dim, theta)
    return sha256_bytes(np.asarray(cos, dtype="<f4").tobytes() + np.asarray(sin, dtype="<f4").tobytes())


def collect_checkpoint(spec: LaneSpec, override: Sequence[str] | None) -> tuple[dict[str, str], int]:
    """Repository-relative path -> SHA-256 of the lane's checkpoint files, and their total size.

    Default: ``qualify.engines.factory.checkpoint_digests`` (the map the producer service
    compares its engine against); ``override`` names repository-relative files instead.
    """
    if override:
        files = {}
        for relpath in override:
            if not RELPATH.fullmatch(relpath) or not (REPO_ROOT / relpath).is_file():
                raise Refused(f"--checkpoint {relpath}: not a repository-relative file")
            files[relpath] = sha256_file(REPO_ROOT / relpath)
    else:
        try:
            from qualify.engines.factory import checkpoint_digests

            files = dict(checkpoint_digests(spec.kind))
        except Refused:
            raise
        except Exception as exc:
            raise Refused(
                f"checkpoint: qualify.engines.factory.checkpoint_digests failed "
                f"({type(exc).__name__}: {one_line(str(exc))}); pass --checkpoint RELPATH"
            ) from None
    total = 0
    for relpath in files:
        if not RELPATH.fullmatch(relpath):
            raise Refused(f"checkpoint: {relpath!r} is not a plain repository-relative path")
        total += (REPO_ROOT / relpath).stat().st_size
    return dict(sorted(files.items())), total


def engine_pins(spec: LaneSpec) -> tuple[SealedEngine, SealedEngine]:
    """(producer, consumer) name/version/abi of the engines the factory builds for the lane."""
    try:
        from qualify.engines.factory import build_consumer, build_producer

        producer = build_producer(spec.name, spec.mode.value)
        consumer = build_consumer(spec.name)
    except Refused:
        raise
    except Exception as exc:
        raise Refused(
            f"engines: building lane {spec.name} failed ({type(exc).__name__}: {one_line(str(exc))}); "
            f"pass --producer-engine and --consumer-engine"
        ) from None
    return (
        SealedEngine(producer.name, producer.version, producer.abi),
        SealedEngine(consumer.name, consumer.version, consumer.abi),
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise Refused(f"{path}: cannot read JSON ({type(exc).__name__})") from None
    if not isinstance(document, dict):
        raise Refused(f"{path}: expected a JSON object")
    return document


def _named_file(value: str, what: str) -> tuple[str, Path]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise Refused(f"{what}: found {value!r}, expected NAME=PATH")
    return name, (REPO_ROOT / path if not os.path.isabs(path) else Path(path))


def _logit_units(value: str) -> SealedLogitUnits:
    if value == "raw":
        return SealedLogitUnits("raw")
    prefix = "tanh-softcap:"
    if value.startswith(prefix):
        try:
            cap = float(value[len(prefix):])
        except ValueError:
            cap = math.nan
        if math.isfinite(cap) and cap > 0:
            return SealedLogitUnits("tanh-softcap", cap)
    raise Refused(f"--logit-units: found {value!r}, expected raw or tanh-softcap:<positive cap>")


def build_sealed(args: argparse.Namespace) -> SealedIdentity:
    """The sealed identity of ``args.lane`` computed from the artifacts on disk."""
    spec: LaneSpec = lane_spec(args.lane)
    model_dir = Path(args.model_dir)
    archive_dir = Path(args.archive_dir)
    config = _read_json(model_dir / "config.json")

    files, total_bytes = collect_checkpoint(spec, args.checkpoint)
    if args.producer_engine and args.consumer_engine:
        producer, consumer = SealedEngine(*args.producer_engine), SealedEngine(*args.consumer_engine)
    else:
        built_producer, built_consumer = engine_pins(spec)
        producer = SealedEngine(*args.producer_engine) if args.producer_engine else built_producer
        consumer = SealedEngine(*args.consumer_engine) if args.consumer_engine else built_consumer

    adapter_name, adapter_path = (
        _named_file(args.adapter, "--adapter")
        if args.adapter
        else (ADAPTER_SOURCES[spec.kind][0], REPO_ROOT / ADAPTER_SOURCES[spec.kind][1])
    )
    if not adapter_path.is_file():
        raise Refused(f"adapter {adapter_name}: no file {adapter_path} (pass --adapter NAME=PATH)")

    tokens = load_prompt(args.prompt)
    if len(tokens) < args.prompt_tokens:
        raise Refused(f"prompt {args.prompt}: {len(tokens)} tokens, expected {args.prompt_tokens}")
    tokens = tokens[: args.prompt_tokens]
    prompt_digest = prompt_sha256(tokens)

    try:
        theta = float(config["rope_theta"])
        head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
        max_positions = int(config["max_position_embeddings"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        raise Refused(f"{model_dir / 'config.json'}: missing rope_theta/head_dim/max positions") from None

    draft: SealedDraft | None = None
    if spec.speculative_draft:
        if args.acceptance_floor is None or args.draft_proposal_tokens is None:
            raise Refused(f"lane {spec.name}: pass --acceptance-floor and --draft-proposal-tokens")
        draft_path = REPO_ROOT / args.draft
        if not RELPATH.fullmatch(args.draft) or not draft_path.is_file():
            raise Refused(f"--draft {args.draft}: not a repository-relative file")
        draft_config = _read_json(model_dir / "draft_config.json")
        draft = SealedDraft(
            geometry=SealedDraftGeometry(
                kind=str(draft_config.get("kind")),
                layers=int(draft_config.get("layers", 0)),
                hidden_size=int(config["hidden_size"]),
                heads=int(config["num_attention_heads"]),
                kv_heads=int(config["num_key_value_heads"]),
                head_dim=head_dim,
                proposal_tokens=args.draft_proposal_tokens,
            ),
            acceptance_floor=float(args.acceptance_floor),
            draft_sha256=sha256_file(draft_path),
        )
    elif args.acceptance_floor is not None or args.draft_proposal_tokens is not None or args.draft:
        raise Refused(f"lane {spec.name}: declares no speculative draft; drop the draft options")

    bounded = spec.recipe.full_logits_mode == "bounded-drift"
    if bounded and (args.maximum_absolute is None or args.maximum_mean_absolute is None):
        raise Refused(f"lane {spec.name}: pass --maximum-absolute and --maximum-mean-absolute")
    if not bounded and (args.maximum_absolute is not None or args.maximum_mean_absolute is not None):
        raise Refused(f"lane {spec.name}: recipe {spec.recipe.value} is exact; drop the bounds")

    match = RECEIPT_URI.fullmatch(args.basis)
    if match is None:
        raise Refused(f"--basis: found {args.basis!r}, expected receipt://<run-id>/<file>")
    basis_path = archive_dir / match["run_id"] / match["file"]
    if not basis_path.is_file():
        raise Refused(f"--basis: {args.basis} does not resolve (no file {basis_path})")

    return SealedIdentity(
        lane=spec.name,
        checkpoint=SealedCheckpoint(files=files, total_bytes=total_bytes),
        producer_engine=producer,
        consumer_engine=consumer,
        adapter=SealedNamedDigest(adapter_name, sha256_file(adapter_path)),
        tokenizer_sha256=sha256_file(model_dir / "tokenizer.json"),
        prompt=SealedPrompt(args.prompt, int(len(tokens)), prompt_digest),
        prompt_template=SealedNamedDigest(
            RAW_TOKEN_TEMPLATE_NAME, canonical_sha256(RAW_TOKEN_TEMPLATE_RULE)
        ),
        context_policy=SealedContextPolicy(
            handoff_positions=args.prompt_tokens - 1, max_positions=max_positions
        ),
        rope=SealedRope(theta, rope_cache_sha256(theta, head_dim, max_positions)),
        logit_units=_logit_units(args.logit_units),
        target_cache_identity_sha256=target_cache_identity(spec, files, producer.abi),
        speculative_draft=draft,
        qualification=SealedQualification(
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
            repetitions=args.repetitions,
            prompt_sha256=prompt_digest,
            require_exact_tokens=True,
            require_deterministic_remote_output=True,
            maximum_absolute=None if args.maximum_absolute is None else float(args.maximum_absolute),
            maximum_mean_absolute=(
                None if args.maximum_mean_absolute is None else float(args.maximum_mean_absolute)
            ),
            basis=args.basis,
            basis_sha256=sha256_file(basis_path),
        ),
    )


def _python_literal(value: Any, indent: int) -> str:
    pad = " " * indent
    if is_dataclass(value) and not isinstance(value, type):
        inner = ",\n".join(
            f"{pad}    {field.name}={_python_literal(getattr(value, field.name), indent + 4)}"
            for field in fields(value)
        )
        return f"{type(value).__name__}(\n{inner},\n{pad})"
    if isinstance(value, Mapping):
        if not value:
            return "{}"
        inner = ",\n".join(f"{pad}    {key!r}: {item!r}" for key, item in value.items())
        return "{\n" + inner + f",\n{pad}}}"
    return repr(value)


def constant_name(lane: str) -> str:
    """``nvfp4-native-splitk`` -> ``SEALED_NVFP4_NATIVE_SPLITK``."""
    return "SEALED_" + lane.upper().replace("-", "_")


def sealed_python_block(sealed: SealedIdentity) -> str:
    """The Python source to paste into ``qualify/contract/sealed.py`` for this sealed identity."""
    name = constant_name(sealed.lane)
    return (
        f"# {sealed.lane}: frozen by tools/freeze_identity.py; identity_sha256 "
        f"{sealed.identity_sha256}\n{name} = {_python_literal(sealed, 0)}\n"
    )


def write_new_file(path: Path, data: bytes, replace: bool) -> None:
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


def lane_needs_draft(lane: str) -> bool:
    """True for lanes that declare speculative-draft geometry (rung 3)."""
    spec = LANES.get(lane)
    return bool(spec is not None and spec.speculative_draft)


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
    parser.add_argument("--lane", required=True, help="lane identity name (qualify/contract/lanes.py)")
    parser.add_argument("--producer-engine", nargs=3, metavar=("NAME", "VERSION", "ABI"),
                        help="default: what qualify.engines.factory.build_producer reports")
    parser.add_argument("--consumer-engine", nargs=3, metavar=("NAME", "VERSION", "ABI"),
                        help="default: what qualify.engines.factory.build_consumer reports")
    parser.add_argument("--basis", required=True, help="receipt://<run-id>/<file> of the calibration")
    parser.add_argument("--maximum-absolute", type=float, help="rung-2 bound (max abs logit delta)")
    parser.add_argument("--maximum-mean-absolute", type=float, help="rung-2 bound (mean abs delta)")
    parser.add_argument("--acceptance-floor", type=float, help="rung-3 draft acceptance floor")
    parser.add_argument("--draft-proposal-tokens", type=int,
                        help="rung-3 draft tokens per step (default: the speculative engine's)")
    parser.add_argument("--adapter", help="NAME=PATH of the producer adapter source (default per kind)")
    parser.add_argument("--checkpoint", action="append", metavar="RELPATH",
                        help="repository-relative checkpoint file (repeatable; default: "
                        "qualify.engines.factory.checkpoint_digests of the lane kind)")
    parser.add_argument("--draft", metavar="RELPATH",
                        help="rung-3 draft weights, repository-relative "
                        f"(default {DEFAULT_DRAFT})")
    parser.add_argument("--prompt", default=MAIN_PROMPT, help="held-out prompt name")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--logit-units", default="raw", help="raw or tanh-softcap:<cap>")
    parser.add_argument("--model-dir", default=str(MODEL_DIR))
    parser.add_argument("--archive-dir", default=str(DEFAULT_ARCHIVE_DIR))
    parser.add_argument("--out", help="identity JSON to write (default contracts/<lane>-identity-v1.json)")
    parser.add_argument("--replace", action="store_true", help="overwrite an existing --out file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Freeze one identity: 0 written, 2 refused (one line on stderr)."""
    args = build_parser().parse_args(argv)
    if lane_needs_draft(args.lane):
        args.draft = args.draft or DEFAULT_DRAFT
        if args.draft_proposal_tokens is None:
            args.draft_proposal_tokens = default_proposal_tokens()
    try:
        sealed = build_sealed(args)
        document = sealed.identity_document()
        out = Path(args.out) if args.out else CONTRACTS_DIR / f"{sealed.lane}-identity-v1.json"
        validate_identity_document(
            document,
            where=f"identity {out}",
            sealed_identities=sealed_table(sealed),
            archive_dir=args.archive_dir,
        )
        data = json.dumps(document, indent=2, ensure_ascii=False, allow_nan=False).encode("utf-8") + b"\n"
        if json.loads(data) != document or canonical_json_bytes(json.loads(data)) != canonical_json_bytes(document):
            raise Refused(f"{out}: the written form does not round-trip")
        write_new_file(out, data, args.replace)
    except Refused as exc:
        print(f"freeze_identity: refused: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except (OSError, KeyError, TypeError, ValueError) as exc:
        print(f"freeze_identity: refused: {type(exc).__name__}: {one_line(str(exc))}", file=sys.stderr)
        return 2
    print(f"# wrote {out} (identity_sha256 {sealed.identity_sha256})")
    print(sealed_python_block(sealed))
    print(f"# then: SEALED_IDENTITIES = sealed_table(..., {constant_name(sealed.lane)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

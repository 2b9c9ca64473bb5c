#!/usr/bin/env python3
"""Measure GPU lane engines' known-answer digests (KATs) where they run, and write the evidence.

An engine that is not exact by construction (``qualify.engines.kat.MEASURED_ENGINE_NAMES``) has
its KAT measured on the hardware its identity pins: the ``transformers`` lanes' producer and the
``torch-llama`` lanes' producer and consumer, on their GPU. This tool builds each lane's engines as
the run does (``qualify.engines.factory.build_producer``, ``build_consumer``), measures each
measured role's KAT three times (twice on one build, once on a second build; a ``torch-llama``
lane's weights are drawn again from their seed for the second: a digest that moves between them is
no known answer, exit 2) and writes one JSON document (schema
``trust-ladder.known-answer-evidence.v2``): this host's torch, CUDA, GPU and numpy, and per lane
the KAT input (over the lane's vocabulary) and per role the engine's name, version and ABI, the
digests, and whether the engine's version and ABI are what the lane's shipped identity pins
(``pins_hold``).

``tools/freeze_identity.py --refreeze IDENTITY --producer-kat-evidence FILE`` (and
``--consumer-kat-evidence FILE``) pins a lane's digest from that document only where its engine is
the identity's engine of that role (name, version and ABI equal): a KAT measured under other pins
is never pinned. Run it on the GPU machine, from the repo root (only numpy, rfc8785, torch and
transformers are needed there)::

    python3 tools/measure_known_answer.py --out "$OUT/known-answers.json"
    python3 tools/measure_known_answer.py --lane llama3-8b-shape-pd --out "$OUT/known-answers-llama.json"

Exit 0 when every digest agrees, 2 when one does not (the document is written either way), or
when a lane's engine cannot be built here (one line on stderr, nothing written).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from qualify.contract.lanes import TORCH_LLAMA_MODELS, TRANSFORMERS_LANE_SETTINGS, LaneKind, lane_spec
from qualify.core import assets
from qualify.core.errors import Refused, one_line
from qualify.engines.kat import KAT_EVIDENCE_SCHEMA, MEASURED_ENGINE_NAMES, kat_input, known_answer_sha256

BUILDS = 2
"""Builds per lane: the KAT is measured twice on the first and once on the second."""
ROLES = ("producer", "consumer")
MEASURED_ROLES: dict[str, tuple[str, ...]] = {
    **{lane: ("producer",) for lane in TRANSFORMERS_LANE_SETTINGS},  # its consumer is the exact numpy engine
    **{lane: ROLES for lane in TORCH_LLAMA_MODELS},
}
"""The lanes this tool measures, and which of their engines are measured where they run."""


def host_facts() -> dict[str, Any]:
    """What the measuring host runs: python, numpy, torch, CUDA, cuDNN, transformers, the GPU and
    its driver (``nvidia-smi``, where there is one), the CPU."""
    import numpy as np
    import torch

    try:
        import transformers

        transformers_version: str | None = transformers.__version__
    except ImportError:  # a torch-llama lane needs none
        transformers_version = None
    facts: dict[str, Any] = {
        "python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),  # type: ignore[no-untyped-call]
        "transformers": transformers_version, "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "gpu_capability": list(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None,
        "driver": None,
    }
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60, check=False)
        facts["driver"] = smi.stdout.strip() or None
    except OSError:
        pass
    return facts


def identity_pins(lane: str, role: str) -> dict[str, Any] | None:
    """The ``role`` engine the lane's shipped identity pins (read as JSON: this tool needs none of
    the identity model's dependencies), or None where no identity is shipped."""
    path = assets.CONTRACTS_DIR / f"{lane}-identity-v1.json"
    if not path.is_file():
        return None
    pinned = json.loads(path.read_bytes())[f"{role}_engine"]
    return {key: pinned[key] for key in ("name", "version", "abi", "kat_sha256")}


def _fresh_weights(kind: LaneKind) -> None:
    """Let the next build draw a ``torch-llama`` lane's weights again from their seed (a process
    draws them once and shares them between its engines), and free the last build's."""
    gc.collect()
    if kind is LaneKind.TORCH_LLAMA:
        import torch

        from qualify.engines.torch_llama import random_model_weights

        random_model_weights.cache_clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def measure(lane: str) -> dict[str, Any]:
    """The lane's measured engines' KATs, ``BUILDS`` builds over (see the module docstring)."""
    from qualify.engines.factory import build_consumer, build_producer

    spec = lane_spec(lane)
    roles = MEASURED_ROLES[lane]
    digests: dict[str, list[str]] = {role: [] for role in roles}
    seconds: dict[str, list[float]] = {role: [] for role in roles}
    found: dict[str, dict[str, str]] = {}
    vocab = 0
    for build in range(BUILDS):
        _fresh_weights(spec.kind)
        for role in roles:
            engine: Any = build_producer(lane, spec.mode) if role == "producer" else build_consumer(spec)
            if engine.name not in MEASURED_ENGINE_NAMES:
                raise Refused(f"lane {lane}: {role} engine {engine.name} is not measured where it runs "
                              f"(qualify.engines.kat.MEASURED_ENGINE_NAMES); its KAT is computed by the freeze")
            for _ in range(2 if build == 0 else 1):
                began = time.perf_counter()
                digests[role].append(known_answer_sha256(engine))
                seconds[role].append(round(time.perf_counter() - began, 4))
            found[role] = {"name": engine.name, "version": engine.version, "abi": engine.abi}
            vocab = engine.geometry.vocab
            del engine
    measured: dict[str, Any] = {"kat_input": kat_input(vocab)}
    for role in roles:
        pinned = identity_pins(lane, role)
        measured[role] = {
            "engine": found[role],
            "kat_sha256": digests[role][0],
            "measurements": digests[role],
            "deterministic": len(set(digests[role])) == 1,
            "kat_seconds": seconds[role],
            "identity_pins": pinned,
            "pins_hold": pinned is not None and all(pinned[key] == found[role][key] for key in found[role]),
        }
    _fresh_weights(spec.kind)
    return measured


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="measure_known_answer",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--lane", action="append", choices=sorted(MEASURED_ROLES),
                        help="a lane to measure (repeatable; default every lane this tool measures)")
    parser.add_argument("--out", required=True, type=Path, help="the evidence JSON to write")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    lanes = args.lane or sorted(MEASURED_ROLES)
    try:
        measured = {lane: measure(lane) for lane in lanes}
        document = {
            "schema": KAT_EVIDENCE_SCHEMA,
            "measured_utc": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "tool": "tools/measure_known_answer.py",
            "host": host_facts(),
            "lanes": measured,
        }
    except Refused as exc:
        print(f"measure_known_answer: refused: {one_line(str(exc))}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    status = 0
    for lane, lane_entry in measured.items():
        for role in MEASURED_ROLES[lane]:
            entry = lane_entry[role]
            pinned = entry["identity_pins"] or {}
            print(f"{lane} {role}: KAT {entry['kat_sha256']} ("
                  f"{'deterministic' if entry['deterministic'] else 'NOT deterministic: ' + ' '.join(entry['measurements'])}"
                  f"); abi {entry['engine']['abi']}; identity pins {'hold' if entry['pins_hold'] else 'DIFFER'} "
                  f"(pinned abi {pinned.get('abi')}, version {pinned.get('version')})")
            if not entry["deterministic"]:
                status = 2
    print(f"# wrote {args.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
